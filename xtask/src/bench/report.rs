//! The benchmark's report: raw results (JSON and CSV), PNG plots (plotters), and a Markdown
//! page with every figure and its ratios to the no-proxy baseline and to kube-proxy.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{bail, Context};
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use super::fleet::{self, FleetRun};

/// The contenders, in the report's column order.
pub const CONTENDERS: &[&str] = &["no-proxy", "ebpf-proxy", "kube-proxy-iptables", "kube-proxy-nftables"];

/// One figure: a metric of one contender at one scale, the median of its samples.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Figure {
    pub n: usize,
    pub contender: String,
    pub metric: String,
    pub value: f64,
    pub samples: Vec<f64>,
}

/// What the report says about the run besides the figures.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Run {
    pub command: String,
    pub started: String,
    pub duration_s: f64,
    pub quick: bool,
    pub window_s: f64,
    pub rounds: u32,
    pub scales: Vec<usize>,
    pub machine: BTreeMap<String, String>,
    pub versions: BTreeMap<String, String>,
    /// Failed operations (connections, requests) per contender and N, with their error names.
    pub failures: Vec<String>,
    /// Rounds measured again, and why.
    #[serde(default)]
    pub notes: Vec<String>,
    /// Contenders left out from some N on, and why.
    #[serde(default)]
    pub dropped: Vec<Dropped>,
    /// Why the run stopped before it measured everything (a partial report).
    #[serde(default)]
    pub incomplete: Option<String>,
    /// The contenders measured (`--contenders`); empty: all of them.
    #[serde(default)]
    pub contenders: Vec<String>,
    /// The fleet part's runs planned (`none` first: the API server alone); empty: none.
    #[serde(default)]
    pub fleet_kinds: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Dropped {
    pub n: usize,
    pub contender: String,
    pub why: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Report {
    pub run: Run,
    pub figures: Vec<Figure>,
    /// Per-packet cost of the TC ingress program, per path and build (`packet_cost.rs`).
    #[serde(default)]
    pub packet_costs: Vec<PacketCost>,
    /// The fleet part: many nodes against one API server (`fleet.rs`).
    #[serde(default)]
    pub fleet: Vec<FleetRun>,
}

/// One path's time per packet in one build of the programs: the median of its rounds.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PacketCost {
    /// One of `packet_cost::CASES`.
    pub case: String,
    /// `shipped` or `no-log`.
    pub build: String,
    pub ns: f64,
    pub samples: Vec<f64>,
}

/// A metric the report shows: key, title, unit, whether more is better, who has it.
pub struct Metric {
    pub key: &'static str,
    pub title: &'static str,
    pub unit: &'static str,
    pub higher_is_better: bool,
    /// The no-proxy baseline has no proxy to start or measure.
    pub proxies_only: bool,
}

pub const METRICS: &[Metric] = &[
    Metric { key: "clusterip_rate_1", title: "Pod → ClusterIP short connections, 1 client", unit: "conn/s", higher_is_better: true, proxies_only: false },
    Metric { key: "clusterip_rate_2", title: "Pod → ClusterIP short connections, 2 clients", unit: "conn/s", higher_is_better: true, proxies_only: false },
    Metric { key: "clusterip_connect_p50", title: "Pod → ClusterIP connect() latency p50 (1 client)", unit: "µs", higher_is_better: false, proxies_only: false },
    Metric { key: "clusterip_connect_p99", title: "Pod → ClusterIP connect() latency p99 (1 client)", unit: "µs", higher_is_better: false, proxies_only: false },
    Metric { key: "clusterip_ab_rate", title: "Pod → ClusterIP short connections, `ab -c 1` (no keep-alive)", unit: "conn/s", higher_is_better: true, proxies_only: false },
    Metric { key: "nodeport_rate_1", title: "External → NodePort short connections, 1 client", unit: "conn/s", higher_is_better: true, proxies_only: false },
    Metric { key: "nodeport_connect_p50", title: "External → NodePort connect() latency p50", unit: "µs", higher_is_better: false, proxies_only: false },
    Metric { key: "nodeport_connect_p99", title: "External → NodePort connect() latency p99", unit: "µs", higher_is_better: false, proxies_only: false },
    Metric { key: "rr_p50", title: "Request/response on one connection (1000/s) p50", unit: "µs", higher_is_better: false, proxies_only: false },
    Metric { key: "rr_p99", title: "Request/response on one connection (1000/s) p99", unit: "µs", higher_is_better: false, proxies_only: false },
    Metric { key: "stream_gbps", title: "One long TCP stream, pod → ClusterIP (iperf3)", unit: "Gbit/s", higher_is_better: true, proxies_only: false },
    Metric { key: "cpu_per_10k", title: "System + softirq CPU per 10 000 ClusterIP connections (whole machine)", unit: "CPU s", higher_is_better: false, proxies_only: false },
    Metric { key: "endpoint_change_p50", title: "One endpoint removed at N: API write → no new connection reaches it, p50", unit: "ms", higher_is_better: false, proxies_only: true },
    Metric { key: "endpoint_change_p99", title: "One endpoint removed at N: API write → no new connection reaches it, p99", unit: "ms", higher_is_better: false, proxies_only: true },
    Metric { key: "programming_mean", title: "The proxy's own kubeproxy_network_programming_duration_seconds over those changes, mean (Δsum ÷ Δcount)", unit: "ms", higher_is_better: false, proxies_only: true },
    Metric { key: "cold_start", title: "Cold start: proxy started → the newest of N Services answers", unit: "s", higher_is_better: false, proxies_only: true },
    Metric { key: "cold_sync", title: "Of the cold start, the proxy's own sync time (Σ sync_proxy_rules_duration_seconds): programming once it has the objects", unit: "s", higher_is_better: false, proxies_only: true },
    Metric { key: "cold_cpu", title: "Proxy CPU time during the cold start", unit: "CPU s", higher_is_better: false, proxies_only: true },
    Metric { key: "cold_peak_rss", title: "Proxy peak RSS during the cold start", unit: "MiB", higher_is_better: false, proxies_only: true },
    Metric { key: "churn_cpu", title: "Proxy CPU time per 100 endpoint changes during churn (10 changes/s)", unit: "CPU s", higher_is_better: false, proxies_only: true },
    Metric { key: "churn_peak_rss", title: "Proxy peak RSS during churn (10 changes/s)", unit: "MiB", higher_is_better: false, proxies_only: true },
    Metric { key: "rss", title: "Proxy RSS after the data-path windows", unit: "MiB", higher_is_better: false, proxies_only: true },
];

pub fn metric(key: &str) -> &'static Metric {
    METRICS.iter().find(|m| m.key == key).unwrap_or_else(|| panic!("unknown metric {key}"))
}

/// The plots: file name, metric, y label, whether the y axis is logarithmic.
const PLOTS: &[(&str, &str, &str, bool)] = &[
    ("clusterip-rate.png", "clusterip_rate_1", "connections/s (pod → ClusterIP, 1 client)", false),
    ("clusterip-connect-p99.png", "clusterip_connect_p99", "connect() p99, µs (pod → ClusterIP)", true),
    ("programming-time.png", "cold_start", "cold start until the newest Service answers, s", true),
    ("rss.png", "cold_peak_rss", "proxy peak RSS during cold start, MiB", false),
];

impl Report {
    pub fn packet_cost(&self, case: &str, build: &str) -> Option<f64> {
        self.packet_costs.iter().find(|c| c.case == case && c.build == build).map(|c| c.ns)
    }

    pub fn value(&self, n: usize, contender: &str, metric: &str) -> Option<f64> {
        self.figures.iter().find(|f| f.n == n && f.contender == contender && f.metric == metric).map(|f| f.value)
    }

    /// Whether the run produced `metric` at all (a run made before it existed did not).
    fn has_metric(&self, metric: &str) -> bool {
        self.figures.iter().any(|f| f.metric == metric)
    }

    /// Whether this run measured `contender` (`--contenders`).
    fn measured(&self, contender: &str) -> bool {
        self.run.contenders.is_empty() || self.run.contenders.iter().any(|c| c == contender)
    }

    /// Every (N, contender, metric) the run must have produced that is missing or not finite.
    pub fn missing(&self) -> Vec<String> {
        let mut missing = Vec::new();
        for &n in &self.run.scales {
            for contender in CONTENDERS.iter().filter(|c| self.measured(c)) {
                let dropped = self.run.dropped.iter().any(|d| d.contender == *contender && d.n <= n);
                for m in METRICS {
                    if (m.proxies_only && *contender == "no-proxy") || dropped {
                        continue;
                    }
                    match self.value(n, contender, m.key) {
                        Some(v) if v.is_finite() => {}
                        Some(v) => missing.push(format!("N={n} {contender} {}: {v}", m.key)),
                        None => missing.push(format!("N={n} {contender} {}: absent", m.key)),
                    }
                }
            }
        }
        for kind in &self.run.fleet_kinds {
            match self.fleet.iter().find(|f| &f.proxy == kind) {
                None => missing.push(format!("fleet {kind}: absent")),
                Some(f) => {
                    let figures = [f.steady_s, f.steady_cpu, f.outage_s, f.recovery_s, f.recovery_cpu, f.recovery_peak_rps];
                    if figures.iter().any(|v| !v.is_finite() || *v < 0.0) || f.recovery_requests.is_empty() {
                        missing.push(format!("fleet {kind}: a figure is missing or not finite"));
                    }
                    if f.nodes > 0 && (f.start_requests.is_empty() || f.converge_s.is_empty()) {
                        missing.push(format!("fleet {kind}: no start requests or no node converged"));
                    }
                }
            }
        }
        for (case, ..) in super::packet_cost::CASES {
            for (build, _) in super::packet_cost::builds() {
                match self.packet_cost(case, build) {
                    Some(v) if v.is_finite() && v > 0.0 => {}
                    other => missing.push(format!("packet cost {case} ({build} build): {other:?}")),
                }
            }
        }
        missing
    }
}

/// Writes `results.json`, `results.csv`, the plots and `README.md` into `dir`; fails if a plot
/// is missing, or (`strict`: the run that just measured them) a figure.
pub fn write(dir: &Path, report: &Report, strict: bool) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(dir.join("results.json"), serde_json::to_string_pretty(report)?)?;
    let mut csv = String::from("n,contender,metric,unit,value,samples\n");
    for f in &report.figures {
        let samples: Vec<String> = f.samples.iter().map(|s| format!("{s}")).collect();
        writeln!(csv, "{},{},{},{},{},{}", f.n, f.contender, f.metric, metric(&f.metric).unit, f.value, samples.join(" "))?;
    }
    std::fs::write(dir.join("results.csv"), csv)?;
    register_font()?;
    for (file, key, label, log_y) in PLOTS {
        plot(&dir.join(file), report, key, label, *log_y).with_context(|| format!("drawing {file}"))?;
    }
    std::fs::write(dir.join("README.md"), markdown(report))?;
    let missing = report.missing();
    if strict && !missing.is_empty() {
        bail!("the benchmark did not produce every figure:\n  {}", missing.join("\n  "));
    }
    for (file, ..) in PLOTS {
        let size = std::fs::metadata(dir.join(file)).map(|m| m.len()).unwrap_or(0);
        if size < 1000 {
            bail!("plot {file} was not drawn ({size} bytes)");
        }
    }
    Ok(())
}

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

fn register_font() -> anyhow::Result<()> {
    let bytes = std::fs::read(FONT).with_context(|| format!("reading {FONT} (Debian's fonts-dejavu-core; `cargo xtask setup` installs it)"))?;
    plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
        .map_err(|_| anyhow::anyhow!("{FONT} is not a usable font"))
}

const COLOURS: &[RGBColor] = &[RGBColor(120, 120, 120), RGBColor(214, 39, 40), RGBColor(31, 119, 180), RGBColor(44, 160, 44)];

fn plot(path: &Path, report: &Report, key: &str, label: &str, log_y: bool) -> anyhow::Result<()> {
    let m = metric(key);
    let series: Vec<(&str, RGBColor, Vec<(f64, f64)>)> = CONTENDERS
        .iter()
        .zip(COLOURS)
        .filter(|(c, _)| !(m.proxies_only && **c == "no-proxy"))
        .map(|(c, colour)| {
            let points = report.run.scales.iter().filter_map(|&n| report.value(n, c, key).map(|v| (n.max(1) as f64, v))).collect();
            (*c, *colour, points)
        })
        .collect();
    let values: Vec<f64> = series.iter().flat_map(|(_, _, p)| p.iter().map(|(_, v)| *v)).filter(|v| v.is_finite()).collect();
    let max_n = report.run.scales.iter().copied().max().unwrap_or(1).max(10) as f64;
    // An empty plot (every contender left out) still gets a valid range.
    let y_max = values.iter().copied().fold(0.0f64, f64::max).max(1.0) * 1.15;
    let y_min = values.iter().copied().fold(f64::INFINITY, f64::min).min(y_max / 2.0).max(1e-3);
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let caption = format!("{} vs number of Services", m.title);
    let mut builder = ChartBuilder::on(&root);
    builder.caption(caption, ("sans-serif", 20)).margin(16).x_label_area_size(44).y_label_area_size(80);
    let x_range = (1.0f64..max_n * 1.5).log_scale();
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart.configure_mesh().x_desc("Services (N), log scale").y_desc(label).label_style(("sans-serif", 14)).draw()?;
            for (name, colour, points) in &series {
                let colour = *colour;
                chart
                    .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))?
                    .label(*name)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
                chart.draw_series(points.iter().map(|p| Circle::new(*p, 4, colour.filled())))?;
            }
            chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).label_font(("sans-serif", 14)).draw()?;
        }};
    }
    if log_y {
        draw!(builder.build_cartesian_2d(x_range, (y_min / 1.5..y_max * 1.5).log_scale())?);
    } else {
        draw!(builder.build_cartesian_2d(x_range, 0.0..y_max)?);
    }
    root.present()?;
    Ok(())
}

fn format_value(v: f64) -> String {
    if !v.is_finite() {
        "—".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b != 0.0 && a.is_finite() && b.is_finite() => format!("{:.2}×", a / b),
        _ => "—".into(),
    }
}

/// The report page. The figures are this run's; the prose around them is fixed, so a re-run
/// rewrites it all.
pub fn markdown(report: &Report) -> String {
    let run = &report.run;
    let mut md = String::new();
    let _ = writeln!(md, "# Benchmarks: ebpf-proxy against kube-proxy (iptables, nftables) and no proxy\n");
    let _ = writeln!(
        md,
        "Generated by `{}` on {} ({}; {:.0} min). {}\n",
        run.command,
        run.started,
        if run.quick { "**quick run: short windows, figures not meant to be read**" } else { "full run" },
        run.duration_s / 60.0,
        "Raw figures: [results.json](results.json), [results.csv](results.csv) (every sample; the plots can be redrawn from them with `cargo xtask bench --redraw DIR`)."
    );
    if let Some(why) = &run.incomplete {
        let _ = writeln!(md, "**This run stopped before it measured everything** ({why}); the figures below are those it had.\n");
    }
    if !run.contenders.is_empty() {
        let _ = writeln!(md, "**Only these contenders were measured** (`--contenders`): {}.\n", run.contenders.join(", "));
    }
    if !run.dropped.is_empty() {
        let _ = writeln!(md, "**Left out**:\n");
        for d in &run.dropped {
            let _ = writeln!(md, "- {} at N = {}: {}", d.contender, d.n, d.why);
        }
        let _ = writeln!(md);
    }
    let _ = writeln!(md, "## Machine and versions\n");
    for (k, v) in run.machine.iter().chain(run.versions.iter()) {
        let _ = writeln!(md, "- **{k}**: {v}");
    }
    let _ = writeln!(md, "\n## Set-up\n");
    md.push_str(SETUP);
    let _ = writeln!(
        md,
        "\nEach rate or latency figure is the median of {} windows of {:.0} s; the contenders take turns (A B C D, then B C D A, …) so that the machine's drift spreads over all of them. Scales: N = {}.\n",
        run.rounds,
        run.window_s,
        run.scales.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    );
    let _ = writeln!(md, "## Targets\n");
    md.push_str(&targets(report));
    let _ = writeln!(md, "\n## Plots\n");
    for (file, key, ..) in PLOTS {
        let _ = writeln!(md, "![{}]({file})", metric(key).title);
    }
    let _ = writeln!(md, "\n## Every figure\n");
    // A metric added after the run was made (a redrawn older report) gets no table.
    for m in METRICS.iter().filter(|m| report.has_metric(m.key)) {
        let better = if m.higher_is_better { "higher is better" } else { "lower is better" };
        let _ = writeln!(md, "### {} ({}, {better})\n", m.title, m.unit);
        let _ = writeln!(md, "| N | no proxy | ebpf-proxy | kube-proxy iptables | kube-proxy nftables | ebpf ÷ no proxy | ebpf ÷ iptables | ebpf ÷ nftables |");
        let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|---:|---:|");
        for &n in &run.scales {
            let v = |c: &str| report.value(n, c, m.key);
            let cell = |c: &str| v(c).map(format_value).unwrap_or_else(|| "—".into());
            let _ = writeln!(
                md,
                "| {n} | {} | {} | {} | {} | {} | {} | {} |",
                cell("no-proxy"),
                cell("ebpf-proxy"),
                cell("kube-proxy-iptables"),
                cell("kube-proxy-nftables"),
                ratio(v("ebpf-proxy"), v("no-proxy")),
                ratio(v("ebpf-proxy"), v("kube-proxy-iptables")),
                ratio(v("ebpf-proxy"), v("kube-proxy-nftables")),
            );
        }
        let _ = writeln!(md);
    }
    md.push_str(&packet_costs(report));
    md.push_str(&fleet_section(report));
    let _ = writeln!(md, "## Failed operations\n");
    if run.failures.is_empty() {
        let _ = writeln!(md, "None: every connection and request of every window was answered.");
    } else {
        for f in &run.failures {
            let _ = writeln!(md, "- {f}");
        }
    }
    let _ = writeln!(md, "\n## Rounds measured again\n");
    if run.notes.is_empty() {
        let _ = writeln!(md, "None: no round lost more than 5 % of its CPU time to the hypervisor (`steal` in /proc/stat).");
    } else {
        for n in &run.notes {
            let _ = writeln!(md, "- {n}");
        }
    }
    md
}

/// The per-packet section: each path's time in the shipped build and in the build without log
/// calls.
fn packet_costs(report: &Report) -> String {
    let mut out = String::from("## Per-packet cost of the TC ingress program\n\n");
    out.push_str(PACKET_COST);
    out.push_str("\n| Path | shipped build, ns/packet | without log calls, ns/packet | difference |\n|---|---:|---:|---:|\n");
    for (case, title, _) in super::packet_cost::CASES {
        let (shipped, no_log) = (report.packet_cost(case, "shipped"), report.packet_cost(case, "no-log"));
        let cell = |v: Option<f64>| v.map(|v| format!("{v:.0}")).unwrap_or_else(|| "—".into());
        let difference = match (shipped, no_log) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:+.0} ns ({:+.1} %)", a - b, (a / b - 1.0) * 100.0),
            _ => "—".into(),
        };
        let _ = writeln!(out, "| {title} | {} | {} | {difference} |", cell(shipped), cell(no_log));
    }
    out.push('\n');
    out
}

const PACKET_COST: &str = "\
Measured in the kernel with `BPF_PROG_TEST_RUN` (the kernel's own timing of the program, without the system call): \
`epx_tc_ingress` of the shipped build, and of the same programs built without aya-log's calls (`EPX_EBPF_NO_LOG`), each \
loaded with maps of its own in a namespace with known routes, nothing attached. Each packet runs once and is timed alone \
(the kernel's repeat mode would run the program again on the packet it already rewrote), so every figure includes the \
same few tens of ns of the kernel's timer; per path and round, the median of 4 000 packets (established flows: the same \
packet of a flow its SYN opened; new flows: 4 000 distinct SYNs). Each figure is the median of 7 rounds, the two builds \
taking turns. The kernel logs only on failure paths \
(`proxy-ebpf/src/failure.rs`): a packet that goes through never reaches a log call, so the two builds should differ by \
no more than the noise on every path but the failure path. That one is timed twice: on programs loaded just before (the \
first 500 failures, whose records fit the 128 KiB log ring), and after thousands more (nothing reads the ring here, so it \
is full and each write fails at once, as in a flood the agent cannot keep up with).\n";

/// The targets, checked against this run's figures.
fn targets(report: &Report) -> String {
    let mut out = String::from("| Target | Figure | Met |\n|---|---|---|\n");
    let scales = &report.run.scales;
    // A target against a proxy this run did not measure (`--contenders`) is neither met nor
    // missed: its figure is `None`.
    let mut row = |what: String, figure: Option<Option<f64>>, goal: f64, at_least: bool| {
        let Some(figure) = figure else {
            let _ = writeln!(out, "| {what} | — | not measured |");
            return;
        };
        let (text, met) = match figure {
            Some(f) if f.is_finite() => (format!("{f:.2}"), if at_least { f >= goal } else { f < goal }),
            _ => ("—".into(), false),
        };
        let _ = writeln!(out, "| {what} | {text} | {} |", if met { "yes" } else { "**no**" });
    };
    let r = |n: usize, a: &str, b: &str, m: &str| {
        report.measured(b).then(|| match (report.value(n, a, m), report.value(n, b, m)) {
            (Some(x), Some(y)) if y > 0.0 => Some(x / y),
            _ => None,
        })
    };
    for &n in scales {
        row(format!("N={n}: ClusterIP rate ≥ 0.95 × no proxy"), r(n, "ebpf-proxy", "no-proxy", "clusterip_rate_1"), 0.95, true);
        row(format!("N={n}: ClusterIP rate ≥ 1.0 × nftables"), r(n, "ebpf-proxy", "kube-proxy-nftables", "clusterip_rate_1"), 1.0, true);
    }
    if let Some(&first) = scales.first() {
        row(format!("N={first}: ClusterIP rate ≥ 1.0 × iptables"), r(first, "ebpf-proxy", "kube-proxy-iptables", "clusterip_rate_1"), 1.0, true);
        row(format!("N={first}: NodePort rate ≥ 1.0 × iptables"), r(first, "ebpf-proxy", "kube-proxy-iptables", "nodeport_rate_1"), 1.0, true);
    }
    if let Some(&last) = scales.iter().max() {
        row(format!("N={last}: ClusterIP rate ≥ 3 × iptables (target set at N=30000)"), r(last, "ebpf-proxy", "kube-proxy-iptables", "clusterip_rate_1"), 3.0, true);
        if let Some(&first) = scales.first() {
            let flat = match (report.value(last, "ebpf-proxy", "nodeport_rate_1"), report.value(first, "ebpf-proxy", "nodeport_rate_1")) {
                (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                _ => None,
            };
            row(format!("NodePort rate flat in N (N={last} ÷ N={first} ≥ 0.9)"), Some(flat), 0.9, true);
        }
        row(format!("N={last}: cold start < 2 s after the agent starts"), Some(report.value(last, "ebpf-proxy", "cold_start")), 2.0, false);
        // Not measured by runs made before the figure existed.
        let sync_time = report.has_metric("cold_sync").then(|| report.value(last, "ebpf-proxy", "cold_sync"));
        row(format!("N={last}: programmed < 2 s after the agent has the objects (its own sync time)"), sync_time, 2.0, false);
        row(format!("N={last}: one endpoint change reaches the datapath < 50 ms p99 (watch included)"), Some(report.value(last, "ebpf-proxy", "endpoint_change_p99")), 50.0, false);
        row(format!("N={last}: agent peak RSS < 100 MiB"), Some(report.value(last, "ebpf-proxy", "cold_peak_rss")), 100.0, false);
    }
    out
}

const SETUP: &str = "\
- **One machine, one kube-apiserver** (and etcd, both upstream, from `cargo xtask peers`) that every proxy reads. \
Every contender has its own **node network namespace of the same shape**: a client pod on bridge `br1` \
(10.244.3.10/24), ten backend pods on bridge `br0` (10.244.1.11–20, `epx-probe serve`: answer with the pod's name, then echo), \
and an external client namespace on its own link (192.168.240.2 → the node's 192.168.240.1). \
Client and backends are on different subnets, routed through the node, so replies pass the node's netfilter hooks without \
`br_netfilter` (kube-proxy needs one or the other; a routed subnet changes nothing on the host).\n\
- **Services**: N Services `bench/bench-i` created through the API, ClusterIP 10.96.x.y port 80 → 8080, each with one \
EndpointSlice of the same 10 backend pods; `bench-0` is also a NodePort (30080). The data-path windows target the newest \
Service (`bench-(N-1)`; `bench-0` for the NodePort).\n\
- **no-proxy**: the client connects straight to a backend pod (10.244.1.11:8080); the external client routes to it through the node.\n\
- **ebpf-proxy**: `ebpf-proxy agent --source kube --interfaces ext0 --nodeport-addresses 192.168.240.0/24 \
--map-size-services 1048576`, socket-level load balancing on the node's pod cgroup. \
**The default map sizes (65 536 entries) do not hold 30 000 Services × 10 endpoints**: the service map needs \
frontends × (1 + backends) entries, and every Service address is a frontend twice (traffic from the node's sockets and \
from outside), so 2 × 30 000 × 11 = 660 000 entries (the backend map holds each distinct endpoint once); \
`ebpf-proxy agent --help` says so at `--map-size-services`.\n\
- **kube-proxy** v1.34 (`--proxy-mode iptables` or `nftables`, default sync settings), each in its own node namespace with \
`--cluster-cidr 10.244.0.0/16 --nodeport-addresses 192.168.240.0/24 --conntrack-max-per-core 0` (`nf_conntrack_max` is \
host-wide and read-only inside a namespace) and its Node object.\n\
- **Cold start**: before the Services of each N are created, every proxy is stopped and its state removed (ebpf-proxy: \
`ebpf-proxy cleanup` and its checkpoint; kube-proxy: `kube-proxy --cleanup`), so none re-syncs during the creation. Then each \
is started alone, and timed from its process start until the newest Service answers from the client pod; its CPU time \
(with the `iptables-restore`/`nft` children kube-proxy waited for) and peak RSS are read at that moment.\n\
- **Client sockets**: the client pod and the external client have `ip_local_port_range 1024 65535` and `tcp_tw_reuse 1`, \
so that tens of thousands of short connections do not run out of ports in any contender's run.\n\
- **Traffic**: `epx-probe rate` (this repository): connect, read the answer, close, as fast as it goes, timing each \
`connect()` (SYN → established, the first-packet latency); `rr`: one connection, 1000 request/response exchanges per second. \
Endpoint changes, one proxy at a time: backend be9 is removed from the newest Service's slice (a merge patch through the \
API) while that proxy's client pod connects 2000 times a second; the figure is be9's last answer minus the time of the \
write (so it includes the watch's delivery), over 20 changes (3 in the quick run) after one that is not counted (it lets a proxy that was paused catch up), be9 put back and routed to again in \
between. The other proxies are paused (SIGSTOP) meanwhile, so that their work on the same changes (kube-proxy re-writes \
every rule per change) does not delay the one measured; each catches up at the start of its own turn. \
Each proxy's own `kubeproxy_network_programming_duration_seconds` (both export it; the slices' \
`last-change-trigger-time` is written to the microsecond here) is read from its `/metrics` before and after its turn: \
the mean is the change in its sum over the change in its count (its buckets are too coarse for a p99 at these \
latencies). Churn: then, every proxy running, 10 changes a second to the same slice (be9 out, in, out, …) for 60 s (5 s in the quick \
run); each proxy's CPU time per 100 changes (with the children it waited for; read once it has caught up and been idle for a \
second) and its largest RSS, read every 100 ms. \
Long stream: `iperf3 -c` from the client pod for one window, through a Service whose one endpoint is `iperf3 -s` on be0. \
Cross-check: Debian's `ab -c 1` (ApacheBench, no keep-alive) against the same ClusterIP. CPU: system + softirq time of the \
whole machine (`/proc/stat`) during the 1-client ClusterIP window, per 10 000 connections (client, server and proxy together).\n";



/// Requests of `run` whose verb and resource start as `prefix` says (e.g. `LIST`, `GET /version`).
fn requests_of(requests: &BTreeMap<String, f64>, prefix: &str) -> f64 {
    requests.iter().filter(|(k, _)| k.starts_with(prefix)).map(|(_, v)| v).sum()
}

/// The fleet part: one column per run, the API server alone first; per node figures net of it;
/// the extrapolation to 5 000 nodes.
fn fleet_section(report: &Report) -> String {
    let Some(alone) = report.fleet.iter().find(|f| f.proxy == "none") else { return String::new() };
    let runs: Vec<&FleetRun> = report.fleet.iter().filter(|f| f.proxy != "none").collect();
    let nodes = runs.first().map_or(0, |f| f.nodes);
    let mut out = format!("## Fleet: {nodes} nodes against one kube-apiserver (N = {})\n\n", alone.services);
    out.push_str(FLEET);
    let _ = write!(out, "\n| | API server alone |");
    for f in &runs {
        let _ = write!(out, " {} × {} |", f.proxy, f.nodes);
    }
    let _ = write!(out, "\n|---|---:|");
    for _ in &runs {
        out.push_str("---:|");
    }
    out.push('\n');
    let mut row = |what: &str, cell: &dyn Fn(&FleetRun) -> String| {
        let _ = write!(out, "| {what} | {} |", cell(alone));
        for f in &runs {
            let _ = write!(out, " {} |", cell(f));
        }
        out.push('\n');
    };
    // Net of the API server alone; a difference below zero is its own requests varying between
    // the windows (its reconcilers run every 10 s), shown as 0.
    let per_node =
        |f: &FleetRun, value: f64, baseline: f64| if f.nodes == 0 { "—".to_owned() } else { format_value(((value - baseline) / f.nodes as f64).max(0.0)) };
    row("Requests while the nodes start (first started → all serving, settled)", &|f| format_value(fleet::total(&f.start_requests)));
    row("— per node", &|f| per_node(f, fleet::total(&f.start_requests), 0.0));
    row("Steady state: requests/s", &|f| format_value(fleet::total(&f.steady_rps)));
    row("— per node, net of the API server alone", &|f| per_node(f, fleet::total(&f.steady_rps), fleet::total(&alone.steady_rps)));
    row("— of which `GET /version`/s", &|f| format_value(requests_of(&f.steady_rps, "GET /version")));
    row("Steady state: kube-apiserver CPU, cores", &|f| format_value(f.steady_cpu));
    row("Steady state: watches open", &|f| format_value(f.steady_watches));
    row("API server down for, s", &|f| format_value(f.outage_s));
    row("Connections the nodes opened to the API's address while it was down, per node per minute", &|f| {
        if f.nodes == 0 { "—".into() } else { format_value(f.outage_connections / f.nodes as f64 / (f.outage_s / 60.0)) }
    });
    row("Nodes converged (the Service created after the outage is in their datapath)", &|f| format!("{} / {}", f.converge_s.len(), f.nodes));
    row("Convergence after `/readyz` is ok again: p50, s", &|f| quantile(&f.converge_s, 0.5));
    row("Convergence: last node, s", &|f| quantile(&f.converge_s, 1.0));
    row("Recovery: API server start → last node converged, s", &|f| format_value(f.recovery_s));
    row("Recovery: requests", &|f| format_value(fleet::total(&f.recovery_requests)));
    row("— per node, net of the API server alone", &|f| per_node(f, fleet::total(&f.recovery_requests), fleet::total(&alone.recovery_requests)));
    row("— `LIST` / `GET /version`", &|f| {
        format!("{} / {}", format_value(requests_of(&f.recovery_requests, "LIST")), format_value(requests_of(&f.recovery_requests, "GET /version")))
    });
    row("Recovery: most requests in one second after `/readyz` is ok", &|f| format_value(f.recovery_peak_rps));
    row("Recovery: kube-apiserver CPU s (its own start included)", &|f| format_value(f.recovery_cpu));
    row("Watches open when the last node converged", &|f| format_value(f.recovery_watches));
    row("CPU s of the nodes' proxies from the outage until the last converged, per node", &|f| per_node(f, f.recovery_node_cpu, 0.0));

    let _ = writeln!(out, "\n### Extrapolated to 5 000 nodes\n");
    out.push_str(FLEET_5000);
    let _ = write!(out, "\n| | ");
    out.push_str(&runs.iter().map(|f| f.proxy.as_str()).collect::<Vec<_>>().join(" | "));
    let _ = write!(out, " |\n|---|");
    out.push_str(&"---:|".repeat(runs.len()));
    out.push('\n');
    let scale = |f: &FleetRun, value: f64, baseline: f64| if f.nodes == 0 { f64::NAN } else { ((value - baseline) / f.nodes as f64).max(0.0) * 5000.0 };
    let mut row5000 = |what: &str, cell: &dyn Fn(&FleetRun) -> String| {
        let _ = write!(out, "| {what} |");
        for f in &runs {
            let _ = write!(out, " {} |", cell(f));
        }
        out.push('\n');
    };
    row5000("Steady state: requests/s", &|f| format_value(scale(f, fleet::total(&f.steady_rps), fleet::total(&alone.steady_rps))));
    row5000("Steady state: `GET /version`/s (ebpf-proxy before commit 1c26db1: one per node every 10 s = 500/s)", &|f| {
        format_value(scale(f, requests_of(&f.steady_rps, "GET /version"), requests_of(&alone.steady_rps, "GET /version")))
    });
    row5000("Connections to the API's address per second while it is down", &|f| format_value(f.outage_connections / f.nodes as f64 / f.outage_s * 5000.0));
    row5000("Requests after an outage (the relist herd)", &|f| format_value(scale(f, fleet::total(&f.recovery_requests), fleet::total(&alone.recovery_requests))));
    row5000("— `LIST` requests", &|f| format_value(scale(f, requests_of(&f.recovery_requests, "LIST"), requests_of(&alone.recovery_requests, "LIST"))));
    row5000("— `GET /version` once it answers (before commit 1c26db1: every 2 s per failing node, 2 500/s)", &|f| {
        format_value(scale(f, requests_of(&f.recovery_requests, "GET /version"), requests_of(&alone.recovery_requests, "GET /version")))
    });
    out.push('\n');
    out
}

/// The `q` quantile of `values` (nearest rank), or `—`.
fn quantile(values: &[f64], q: f64) -> String {
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    match sorted.len() {
        0 => "—".into(),
        len => format_value(sorted[((len as f64 * q).ceil() as usize).clamp(1, len) - 1]),
    }
}

const FLEET: &str = "\
Many simulated nodes against the same kube-apiserver, one proxy at a time (the node namespaces' own proxies paused). Each \
node is a network namespace with only its loopback, a forwarder to the API server there, a Node object of its own \
(`fleet-i`) and its proxy: `ebpf-proxy agent --source kube` (socket-level programs on an empty cgroup of its own, no \
interface, flow tables of 1 024 entries: no traffic flows) or a real kube-proxy in nftables mode (its informers, hence \
its requests, are those of iptables mode; nftables programs 1 000 Services in a fraction of the time). Requests are \
kube-apiserver's own `apiserver_request_total` (by verb and resource; the bench's reads of `/metrics` and `/readyz` left \
out; a watch is counted there when it ends, so the watches a phase opened, the rise of `apiserver_longrunning_requests`, \
count as its requests too, as `WATCH … (open)`, and open watches are also shown apart), plus \
`GET /version` from its audit log (a policy that records only that path: non-resource requests are not in \
`apiserver_request_total`); its CPU time from `/proc`. While the API server is down, each node's forwarder counts the \
connections the node opens to it (every request, watch or probe attempt is one), as a load balancer in front would. Steady state: a window after the nodes have started and settled. Outage: kube-apiserver \
is killed (etcd keeps running) and started again after the outage; as soon as it is ready a new Service with 10 endpoints \
is created, and each node's `/metrics` is polled (every node in turn, then 0.1 s of pause) until that Service is in \
its datapath: the agent's `ebpf_proxy_services_programmed` has grown by one, kube-proxy's count of \
`kubeproxy_network_programming_duration_seconds` has grown (the new slice carries a trigger time; a relist of \
unchanged slices records nothing). The recovery's \
requests and CPU are those of the new kube-apiserver process from its start until the last node converged. The column \
\"API server alone\" is the same sequence with no node: the share of every figure that is not the nodes'. All the nodes \
share this machine's cores (and the API server's): what they spend recovering is shown per node, and where it is much, \
a node of its own would converge sooner than here.\n";

const FLEET_5000: &str = "\
Linear in the nodes: each node's requests (net of the API server alone; 0 where the difference is below the API \
server's own variation between windows) times 5 000. The API server's CPU is not \
extrapolated: it depends on its cache and on how the requests spread in time, which one machine running the nodes too \
cannot show. Before commit 1c26db1 every agent sent `GET /version` every 10 s (every 2 s while failing); since, it \
sends none while its watches are fine (HTTP/2 PINGs and TCP keep-alive find a dead connection), and probes only while \
a watch is failing (after 2 s, 4 s, then every 8 to 12 s while the API does not answer; commit 8fee9fd) to relist as \
soon as the API answers. Each kind is listed in one request answered from the API server's cache (`resourceVersion=0`, \
no page size; commit 6ec92ee); before, in consistent reads of 500 objects a page (3 per kind at N = 1000).\n";
