//! `cargo xtask bench`: ebpf-proxy side by side with the real kube-proxy (iptables and
//! nftables modes) and with no proxy at all, on one machine, one API server, one topology.
//!
//! ```text
//!   control-plane netns: etcd + kube-apiserver  <── every proxy watches it (a forwarder each)
//!   node netns × 4 (no-proxy, ebpf-proxy, kube-proxy iptables, kube-proxy nftables), each:
//!     client pod 10.244.3.10 (br1) ──routed── node ──br0── 10 backend pods 10.244.1.11-20
//!     external client 192.168.240.2 ── ext0 192.168.240.1 (NodePort 30080)
//! ```
//! For each N the Services are created through the API (every proxy sees the same objects),
//! then each proxy is cold-started alone and timed until the newest Service answers, then the
//! data-path windows run, the contenders taking turns. See `report.rs` for what is written.

mod fleet;
mod packet_cost;
mod report;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use e2e::agent::{Agent, AgentDir};
use e2e::control_plane::ControlPlane;
use e2e::forward::Forwarder;
use e2e::kube_proxy::{self, KubeProxy, Mode};
use e2e::probe::{self, Rate, Server};
use e2e::topology::{ExternalClient, Topology};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, NodeAddress, NodeStatus, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};

use report::{Figure, Report};


const NAMESPACE: &str = "bench";
const BACKENDS: u8 = 10;
const NODE_PORT: u16 = 30080;
/// The Service the `ab` cross-check targets: HTTP on the backends' port 8081.
const HTTP_VIP: &str = "10.96.200.1";
/// The Service of the long-stream window: port 80 to iperf3 on be0 (10.244.1.11:5201).
const IPERF_VIP: &str = "10.96.200.2";
const IPERF_PORT: u16 = 5201;
/// kube-proxy's network-programming histogram (ebpf-proxy exports it under this name too).
const PROGRAMMING_METRIC_SUM: &str = "kubeproxy_network_programming_duration_seconds_sum";
const PROGRAMMING_METRIC_COUNT: &str = "kubeproxy_network_programming_duration_seconds_count";
/// The time a proxy spent in its syncs (both export it under kube-proxy's name).
const SYNC_METRIC_SUM: &str = "kubeproxy_sync_proxy_rules_duration_seconds_sum";
const SYNC_METRIC_COUNT: &str = "kubeproxy_sync_proxy_rules_duration_seconds_count";
/// The backend the endpoint changes and the churn take out of the newest Service and put back.
const CHANGED: u8 = BACKENDS - 1;
/// Endpoint changes per second during the churn window.
const CHURN_PER_SECOND: u32 = 10;
const CLUSTER_CIDR: &str = "10.244.0.0/16";
const NODEPORT_CIDR: &str = "192.168.240.0/24";
/// The agent's `--node-name` (the test harness's default) and its Node object.
const EBPF_NODE: &str = "node-1";
/// Map sizes that hold 30 000 Services × 10 endpoints (see the report's set-up).
const AGENT_ARGS: &[&str] = &[
    "--interfaces=ext0",
    "--nodeport-addresses=192.168.240.0/24",
    "--map-size-services=1048576",
];

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn request_stop(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn check_interrupted() -> anyhow::Result<()> {
    if STOP.load(Ordering::SeqCst) {
        bail!("interrupted: cleaning up");
    }
    Ok(())
}

pub struct Options {
    pub quick: bool,
    pub max_services: usize,
    pub out: PathBuf,
    pub window: Option<Duration>,
    pub rounds: Option<u32>,
    pub command: String,
    /// A proxy whose newest Service does not answer this long after its cold start is left out
    /// from that N on.
    pub cold_start_limit: Duration,
    /// The proxies measured (the no-proxy baseline always is); `None`: all three.
    pub contenders: Option<Vec<String>>,
    /// Simulated nodes per proxy in the fleet part (0: no fleet part); default 100, 5 quick.
    pub fleet_nodes: Option<usize>,
    /// How long the API server is down in the fleet part; default 60 s, 5 s quick.
    pub fleet_outage: Option<Duration>,
}

/// The ClusterIP of Service `bench-i`: 10.96.1.1 onwards, 250 per /24.
fn service_ip(i: usize) -> String {
    format!("10.96.{}.{}", 1 + i / 250, 1 + i % 250)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Contender {
    NoProxy,
    Ebpf,
    KubeProxy(Mode),
}

impl Contender {
    const ALL: [Contender; 4] = [Contender::NoProxy, Contender::Ebpf, Contender::KubeProxy(Mode::Iptables), Contender::KubeProxy(Mode::Nftables)];

    /// The proxies named (`ebpf-proxy`, `kube-proxy-iptables`, `kube-proxy-nftables`), after
    /// the no-proxy baseline; all of them without names.
    pub fn selected(names: Option<&[String]>) -> anyhow::Result<Vec<Contender>> {
        let Some(names) = names else { return Ok(Self::ALL.to_vec()) };
        for name in names {
            if !Self::ALL[1..].iter().any(|c| c.name() == name) {
                let known: Vec<&str> = Self::ALL[1..].iter().map(|c| c.name()).collect();
                bail!("--contenders: unknown proxy {name:?} (known: {})", known.join(", "));
            }
        }
        Ok(Self::ALL.into_iter().filter(|c| *c == Contender::NoProxy || names.iter().any(|n| n == c.name())).collect())
    }

    fn name(self) -> &'static str {
        match self {
            Contender::NoProxy => "no-proxy",
            Contender::Ebpf => "ebpf-proxy",
            Contender::KubeProxy(Mode::Iptables) => "kube-proxy-iptables",
            Contender::KubeProxy(Mode::Nftables) => "kube-proxy-nftables",
        }
    }
}

enum Proxy {
    None,
    Ebpf { agent: Agent, _dir: AgentDir },
    KubeProxy(KubeProxy),
}

/// One node namespace of the common shape, with its proxy. Fields drop in order: the proxy
/// first, the namespaces last.
struct BenchNode {
    contender: Contender,
    /// Did not program the Services within the cold-start limit at some N: left out since.
    dropped_out: bool,
    proxy: Proxy,
    _access: Option<Forwarder>,
    _servers: Vec<Server>,
    _iperf: IperfServer,
    ext: ExternalClient,
    topo: Topology,
}

impl BenchNode {
    fn new(contender: Contender, api: &ControlPlane) -> anyhow::Result<Self> {
        let mut topo = Topology::new()?;
        topo.add_subnet("br1", "10.244.3")?;
        let client = topo.add_pod_on("client", "br1", "10.244.3", 10)?;
        tune_client(&client.netns)?;
        let mut servers = Vec::new();
        for b in 0..BACKENDS {
            let name = format!("be{b}");
            topo.add_pod(&name, 11 + b)?;
            servers.push(probe::serve_ports(&topo, &name, &name, &[("--tcp", &[8080]), ("--http", &[8081])])?);
        }
        let iperf = IperfServer::start(&topo, "be0")?;
        let ext = topo.add_external_client("ext")?;
        tune_client(&ext.netns)?;
        let mut node =
            Self { contender, dropped_out: false, proxy: Proxy::None, _access: None, _servers: servers, _iperf: iperf, ext, topo };
        match contender {
            Contender::NoProxy => node.ext.route_via_node("10.244.1.0/24")?,
            Contender::Ebpf => {
                let (access, kubeconfig) = api.access_from(&node.topo.node.path(), &format!("agent-{}", node.topo.id))?;
                let dir = AgentDir::new(&format!("{}-bench", node.topo.id))?;
                let agent = Agent::start_kube_in_node_with(&node.topo, &dir, &kubeconfig, AGENT_ARGS)?;
                node._access = Some(access);
                node.proxy = Proxy::Ebpf { agent, _dir: dir };
            }
            Contender::KubeProxy(mode) => {
                let (access, kubeconfig) = api.access_from(&node.topo.node.path(), &format!("kube-proxy-{}", node.topo.id))?;
                let config = kube_proxy::Config {
                    mode,
                    netns: node.topo.node.path(),
                    kubeconfig,
                    node_name: contender.name().into(),
                    cluster_cidr: CLUSTER_CIDR.into(),
                    nodeport_addresses: NODEPORT_CIDR.into(),
                    log: api.dir.join(format!("{}.log", contender.name())),
                };
                let mut proxy = KubeProxy::start(config)?;
                proxy.wait_healthy(Duration::from_secs(60))?;
                node._access = Some(access);
                node.proxy = Proxy::KubeProxy(proxy);
            }
        }
        Ok(node)
    }

    /// A proxy (not the baseline) that is still measured at this N.
    fn measured_proxy(&self) -> bool {
        self.contender != Contender::NoProxy && !self.dropped_out
    }

    fn pid(&self) -> Option<u32> {
        match &self.proxy {
            Proxy::None => None,
            Proxy::Ebpf { agent, .. } => agent.pid(),
            Proxy::KubeProxy(proxy) => proxy.pid(),
        }
    }

    /// Stops the proxy and removes everything it programmed (pins and checkpoint, or rules),
    /// so that the next start is cold.
    fn stop_and_clean(&mut self) -> anyhow::Result<()> {
        match &mut self.proxy {
            Proxy::None => Ok(()),
            Proxy::Ebpf { agent, .. } => {
                agent.simulate_reboot()?;
                if agent.state_dir.exists() {
                    std::fs::remove_dir_all(&agent.state_dir)?;
                }
                Ok(())
            }
            Proxy::KubeProxy(proxy) => proxy.stop_and_clean(),
        }
    }

    /// Kills the proxy; what it programmed stays until the namespace goes (cleaning up a
    /// ruleset it could not even program in time would take as long).
    fn kill(&mut self) {
        match &mut self.proxy {
            Proxy::None => {}
            Proxy::Ebpf { agent, .. } => {
                let _ = agent.kill();
            }
            Proxy::KubeProxy(proxy) => proxy.kill(),
        }
    }

    /// Starts a fresh proxy process (after [`BenchNode::stop_and_clean`]).
    fn start(&mut self) -> anyhow::Result<()> {
        match &mut self.proxy {
            Proxy::None => Ok(()),
            Proxy::Ebpf { agent, .. } => agent.spawn(),
            Proxy::KubeProxy(proxy) => proxy.restart(),
        }
    }

    /// The address the client pod's short connections go to at scale `n`.
    fn cluster_target(&self, n: usize) -> String {
        match self.contender {
            Contender::NoProxy => "10.244.1.11:8080".into(),
            _ => format!("{}:80", service_ip(n - 1)),
        }
    }

    fn nodeport_target(&self) -> String {
        match self.contender {
            Contender::NoProxy => "10.244.1.11:8080".into(),
            _ => format!("{}:{NODE_PORT}", self.ext.node_ip),
        }
    }

    fn http_target(&self) -> String {
        match self.contender {
            Contender::NoProxy => "10.244.1.11:8081".into(),
            _ => format!("{HTTP_VIP}:80"),
        }
    }

    /// The proxy's `/metrics` text (both export kube-proxy's metric names).
    fn metrics_text(&self) -> anyhow::Result<String> {
        match &self.proxy {
            Proxy::None => bail!("no proxy, no metrics"),
            Proxy::Ebpf { agent, .. } => {
                let (status, text) = agent.get(true, "/metrics")?;
                anyhow::ensure!(status == 200, "ebpf-proxy /metrics answered {status}");
                Ok(text)
            }
            Proxy::KubeProxy(proxy) => proxy.metrics(),
        }
    }

    /// (sum in s, count) of the proxy's own `kubeproxy_network_programming_duration_seconds`,
    /// over its series (kube-proxy labels them by `ip_family`); (0, 0) while it has none
    /// (kube-proxy exports a series from its first observation).
    fn programming_duration(&self) -> anyhow::Result<(f64, f64)> {
        programming_duration(&self.metrics_text()?, self.contender.name())
    }

    fn iperf_target(&self) -> (String, u16) {
        match self.contender {
            Contender::NoProxy => ("10.244.1.11".into(), IPERF_PORT),
            _ => (IPERF_VIP.into(), 80),
        }
    }

    fn client_probe(&self) -> anyhow::Result<Command> {
        self.topo.command_in("client", &e2e::bin("epx-probe"))
    }
}

/// (sum in s, count) of `kubeproxy_network_programming_duration_seconds` in the `/metrics`
/// text of `who`, over its series (kube-proxy labels them by `ip_family`); (0, 0) while it has
/// none (kube-proxy exports a series from its first observation).
fn programming_duration(text: &str, who: &str) -> anyhow::Result<(f64, f64)> {
    let scrape = e2e::metrics::parse(text, who)?;
    let sum = |name| e2e::metrics::sum(&scrape, name, |_| true).unwrap_or(0.0);
    Ok((sum(PROGRAMMING_METRIC_SUM), sum(PROGRAMMING_METRIC_COUNT)))
}

/// `iperf3 -s` in a backend pod, for the long-stream window; killed on drop.
struct IperfServer(std::process::Child);

impl IperfServer {
    /// Starts it and waits until it listens (its first line of output).
    fn start(topo: &Topology, pod: &str) -> anyhow::Result<Self> {
        use std::io::{BufRead, BufReader};
        let mut child = topo
            .command_in(pod, Path::new("/usr/bin/iperf3"))?
            .args(["-s", "-p", &IPERF_PORT.to_string(), "--forceflush"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting iperf3 -s (Debian's iperf3; `cargo xtask setup` installs it)")?;
        let mut line = String::new();
        let stdout = child.stdout.take().context("iperf3's output")?;
        let mut reader = BufReader::new(stdout);
        while !line.contains("listening") {
            line.clear();
            if reader.read_line(&mut line)? == 0 {
                let _ = child.kill();
                let _ = child.wait();
                bail!("iperf3 -s in {pod} ended before it listened");
            }
        }
        // Its later output is not read: it goes nowhere rather than filling a pipe.
        std::thread::spawn(move || std::io::copy(&mut reader, &mut std::io::sink()));
        Ok(Self(child))
    }
}

impl Drop for IperfServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A client host's settings: a wide ephemeral range and TIME_WAIT reuse, so that tens of
/// thousands of short connections never run out of ports (the same for every contender).
fn tune_client(netns: &e2e::topology::Netns) -> anyhow::Result<()> {
    netns.exec(&["sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65535"])?;
    netns.exec(&["sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"])?;
    Ok(())
}

/// A progress line per step, with the elapsed and (estimated) remaining time.
struct Progress {
    started: Instant,
    done: usize,
    total: usize,
}

impl Progress {
    fn step(&mut self, what: &str) {
        self.done += 1;
        let elapsed = self.started.elapsed().as_secs();
        let remaining = if self.done > 1 { elapsed * (self.total - self.done + 1) as u64 / (self.done - 1) as u64 } else { 0 };
        eprintln!(
            "\x1b[1m[bench {}/{}]\x1b[0m {what}  (elapsed {}m{:02}s, ~{}m{:02}s left)",
            self.done,
            self.total,
            elapsed / 60,
            elapsed % 60,
            remaining / 60,
            remaining % 60
        );
    }
}

/// While alive, Ctrl-C and SIGTERM only ask the benchmark to stop (it then unwinds, and every
/// namespace, process and pin it made is removed); the previous handlers come back on drop.
struct StopOnSignal {
    previous: [libc::sighandler_t; 2],
}

impl StopOnSignal {
    fn install() -> Self {
        STOP.store(false, Ordering::SeqCst);
        // SAFETY: the handler only stores to an atomic.
        let previous = unsafe {
            [
                libc::signal(libc::SIGINT, request_stop as *const () as libc::sighandler_t),
                libc::signal(libc::SIGTERM, request_stop as *const () as libc::sighandler_t),
            ]
        };
        Self { previous }
    }
}

impl Drop for StopOnSignal {
    fn drop(&mut self) {
        // SAFETY: restoring the handlers `install` replaced.
        unsafe {
            libc::signal(libc::SIGINT, self.previous[0]);
            libc::signal(libc::SIGTERM, self.previous[1]);
        }
    }
}

pub fn run(options: &Options) -> anyhow::Result<()> {
    let _signals = StopOnSignal::install();
    let mut scales: Vec<usize> = if options.quick { vec![1, 100] } else { vec![1, 1000, 10_000, 30_000] };
    scales.retain(|&n| n <= options.max_services.max(1));
    let window = options.window.unwrap_or(if options.quick { Duration::from_secs(1) } else { Duration::from_secs(5) });
    let rounds = options.rounds.unwrap_or(if options.quick { 1 } else { 3 });
    let changes = if options.quick { 3 } else { 20 };
    let churn_time = Duration::from_secs(if options.quick { 5 } else { 60 });
    let started = Instant::now();
    let mut report = Report::default();
    report.run = report::Run {
        command: options.command.clone(),
        started: utc_now(),
        quick: options.quick,
        window_s: window.as_secs_f64(),
        rounds,
        scales: scales.clone(),
        machine: machine(),
        versions: versions()?,
        ..Default::default()
    };
    // Steps: per N, the Services, 3 cold starts and rounds × 4 contenders × windows.
    let contenders = Contender::selected(options.contenders.as_deref())?;
    let proxies = contenders.len() - 1;
    let fleet = fleet_plan(options, &scales, &contenders);
    let fleet_steps = fleet.as_ref().map_or(0, |f| 2 * f.kinds.len());
    let mut progress = Progress { started, done: 0, total: 3 + fleet_steps + scales.len() * (3 + proxies + rounds as usize * contenders.len()) };
    if options.contenders.is_some() {
        report.run.contenders = contenders.iter().map(|c| c.name().to_owned()).collect();
    }
    report.run.fleet_kinds = fleet.as_ref().map(|f| f.kinds.iter().map(|k| k.name().to_owned()).collect()).unwrap_or_default();
    let plan = Plan { scales, window, rounds, changes, churn_time, cold_start_limit: options.cold_start_limit, contenders, fleet };
    let measured = measure(&plan, &mut report, &mut progress);
    report.run.duration_s = started.elapsed().as_secs_f64();
    if let Err(error) = &measured {
        // What was measured before the failure (or Ctrl-C) is still written, marked incomplete.
        report.run.incomplete = Some(format!("{error:#}"));
        eprintln!("the benchmark stopped early; writing what it measured: {error:#}");
        report::write(&options.out, &report, false)?;
        eprintln!("partial report: {}", options.out.join("README.md").display());
        return measured;
    }
    report::write(&options.out, &report, true)?;
    eprintln!("report: {}", options.out.join("README.md").display());
    Ok(())
}

struct Plan {
    scales: Vec<usize>,
    window: Duration,
    rounds: u32,
    changes: u32,
    churn_time: Duration,
    cold_start_limit: Duration,
    contenders: Vec<Contender>,
    /// Run at N = its `services`, after that N's other figures.
    fleet: Option<fleet::Plan>,
}

/// The fleet part, at the largest N up to 1 000 (each simulated node holds every Service, and
/// a hundred kube-proxies of 10 000 Services would not fit a small machine): the API server
/// alone, then ebpf-proxy and kube-proxy (nftables) if they are measured.
fn fleet_plan(options: &Options, scales: &[usize], contenders: &[Contender]) -> Option<fleet::Plan> {
    let nodes = options.fleet_nodes.unwrap_or(if options.quick { 5 } else { 100 });
    let services = scales.iter().copied().filter(|&n| n <= 1000).max()?;
    let mut kinds = vec![fleet::Kind::None];
    if contenders.contains(&Contender::Ebpf) {
        kinds.push(fleet::Kind::Ebpf);
    }
    if contenders.contains(&Contender::KubeProxy(Mode::Nftables)) {
        kinds.push(fleet::Kind::KubeProxy);
    }
    (nodes > 0).then(|| fleet::Plan {
        nodes,
        services,
        steady: Duration::from_secs(if options.quick { 5 } else { 60 }),
        outage: options.fleet_outage.unwrap_or(Duration::from_secs(if options.quick { 5 } else { 60 })),
        converge_limit: Duration::from_secs(300),
        settle: Duration::from_secs(if options.quick { 2 } else { 10 }),
        kinds,
    })
}

fn measure(plan: &Plan, report: &mut Report, progress: &mut Progress) -> anyhow::Result<()> {
    let Plan { scales, window, rounds, changes, churn_time, cold_start_limit, contenders, fleet } = plan;
    let (window, rounds, changes, churn_time) = (*window, *rounds, *changes, *churn_time);
    progress.step("per-packet cost of the TC ingress program (BPF_PROG_TEST_RUN), with and without log calls");
    report.packet_costs = packet_cost::measure().context("measuring the per-packet cost")?;
    for (case, title, _) in packet_cost::CASES {
        let ns = |build| report.packet_cost(case, build).unwrap_or(f64::NAN);
        eprintln!("    {title}: {:.0} ns (without log calls {:.0} ns)", ns("shipped"), ns("no-log"));
    }
    progress.step("starting etcd and kube-apiserver");
    let mut cp_topo = Topology::new()?;
    // The fleet part counts `GET /version` in the API server's audit log.
    let audit = fleet.as_ref().map(|_| fleet::version_audit()).transpose()?;
    let audit_args = audit.as_ref().map(e2e::audit::Audit::apiserver_args).unwrap_or_default();
    let mut api = ControlPlane::start_with(&mut cp_topo, &audit_args.iter().map(String::as_str).collect::<Vec<_>>())?;
    api.apply(&format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {NAMESPACE}}}\n"))?;
    create_nodes(&api)?;
    create_http_service(&api)?;

    progress.step("node namespaces: pods, backends, external clients; the proxies start");
    let mut nodes = Vec::new();
    for &contender in contenders {
        check_interrupted()?;
        nodes.push(BenchNode::new(contender, &api).with_context(|| format!("setting up the {} node", contender.name()))?);
    }

    let mut created = 0;
    for &n in scales {
        check_interrupted()?;
        // The proxies are stopped (and their state removed) while the Services are created:
        // each is then started cold and timed, and none spends the machine's CPU re-syncing
        // during the creation (kube-proxy's iptables mode takes minutes per sync at 10 000).
        for node in nodes.iter_mut().filter(|node| !node.dropped_out) {
            node.stop_and_clean().with_context(|| format!("stopping {}", node.contender.name()))?;
        }
        progress.step(&format!("N={n}: creating Services {created}..{n} and their EndpointSlices through the API"));
        let t = Instant::now();
        create_services(&api, created, n)?;
        eprintln!("    {} Services and slices created in {:.1?}", n - created, t.elapsed());
        created = n;

        for node in nodes.iter_mut().filter(|node| node.measured_proxy()) {
            check_interrupted()?;
            let name = node.contender.name();
            progress.step(&format!("N={n}: cold start of {name}"));
            match cold_start(node, n, *cold_start_limit).with_context(|| format!("cold start of {name} at N={n}"))? {
                Some(cold) => {
                    eprintln!(
                        "    answers after {:.2} s ({:.2} s of it in its syncs), {:.2} CPU s, peak RSS {:.1} MiB",
                        cold.seconds, cold.syncing, cold.cpu, cold.peak_rss
                    );
                    report.figures.push(figure(n, name, "cold_start", vec![cold.seconds]));
                    report.figures.push(figure(n, name, "cold_sync", vec![cold.syncing]));
                    report.figures.push(figure(n, name, "cold_cpu", vec![cold.cpu]));
                    report.figures.push(figure(n, name, "cold_peak_rss", vec![cold.peak_rss]));
                }
                None => {
                    // Not programmed within the limit: it is left out from here on (this N's
                    // windows and every larger N), and the report says so.
                    let what = format!("the newest Service did not answer within {cold_start_limit:?} of its cold start; left out at N ≥ {n}");
                    eprintln!("    {what}");
                    report.run.dropped.push(report::Dropped { n, contender: name.into(), why: what });
                    node.kill();
                    node.dropped_out = true;
                }
            }
        }
        let nodes_in: Vec<usize> = (0..nodes.len()).filter(|&i| !nodes[i].dropped_out).collect();

        let mut samples: std::collections::BTreeMap<(&str, &str), Vec<f64>> = Default::default();
        for round in 0..rounds as usize {
            for k in 0..nodes_in.len() {
                check_interrupted()?;
                let node = &nodes[nodes_in[(k + round) % nodes_in.len()]];
                let name = node.contender.name();
                progress.step(&format!("N={n}: data path of {name}, round {}/{rounds}", round + 1));
                // On a shared machine (a VM) the hypervisor may take the CPUs away for a while:
                // a round that lost more than 5 % of its time to steal is measured again (twice
                // at most; the report says so).
                let mut attempt = 0;
                let windows = loop {
                    let steal_before = steal_seconds()?;
                    let t = Instant::now();
                    let windows = data_path(node, n, window).with_context(|| format!("data path of {name} at N={n}"))?;
                    let stolen = (steal_seconds()? - steal_before) / (t.elapsed().as_secs_f64() * cores());
                    if stolen <= 0.05 || attempt == 2 {
                        if stolen > 0.05 {
                            report.run.notes.push(format!("N={n} {name} round {}: {:.0} % of the CPU time stolen by the hypervisor even on the third try", round + 1, stolen * 100.0));
                        }
                        break windows;
                    }
                    attempt += 1;
                    report.run.notes.push(format!("N={n} {name} round {}: measured again ({:.0} % of the CPU time stolen by the hypervisor)", round + 1, stolen * 100.0));
                    eprintln!("    {:.0} % of the CPU time was stolen by the hypervisor: measuring this round again", stolen * 100.0);
                };
                for (metric, value) in windows.values {
                    samples.entry((name, metric)).or_default().push(value);
                }
                for failure in windows.failures {
                    report.run.failures.push(format!("N={n} {name}: {failure}"));
                }
            }
        }
        for ((contender, metric), values) in samples {
            report.figures.push(figure(n, contender, metric, values));
        }

        check_interrupted()?;
        progress.step(&format!("N={n}: {changes} endpoint removals, timed until no new connection reaches the endpoint"));
        for (contender, latencies, programming) in endpoint_changes(&api, &nodes, n, changes).with_context(|| format!("endpoint changes at N={n}"))? {
            eprintln!("    {contender}: its own network_programming_duration_seconds over these changes: mean {programming:.0} ms");
            report.figures.push(figure(n, contender, "programming_mean", vec![programming]));
            let mut sorted = latencies.clone();
            sorted.sort_by(|a, b| a.total_cmp(b));
            let at = |q: f64| sorted[((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1];
            eprintln!("    {contender}: p50 {:.0} ms, p99 {:.0} ms", at(0.5), at(0.99));
            report.figures.push(Figure { n, contender: contender.into(), metric: "endpoint_change_p50".into(), value: at(0.5), samples: latencies.clone() });
            report.figures.push(Figure { n, contender: contender.into(), metric: "endpoint_change_p99".into(), value: at(0.99), samples: latencies });
        }
        check_interrupted()?;
        progress.step(&format!("N={n}: {:.0} s of endpoint churn ({CHURN_PER_SECOND} changes/s), every proxy running", churn_time.as_secs_f64()));
        for (contender, cpu, rss) in churn(&api, &nodes, n, churn_time).with_context(|| format!("endpoint churn at N={n}"))? {
            eprintln!("    {contender}: {cpu:.2} CPU s per 100 changes, peak RSS {rss:.1} MiB");
            report.figures.push(figure(n, contender, "churn_cpu", vec![cpu]));
            report.figures.push(figure(n, contender, "churn_peak_rss", vec![rss]));
        }
        for node in nodes.iter().filter(|node| !node.dropped_out) {
            if let Some(pid) = node.pid() {
                let (rss, _) = memory_mib(pid)?;
                report.figures.push(figure(n, node.contender.name(), "rss", vec![rss]));
            }
        }
        if let (Some(fleet), Some(audit)) = (fleet.as_ref().filter(|f| f.services == n), &audit) {
            // The node namespaces' proxies are paused: the API server's figures are the fleet's.
            let _paused = Paused::all(nodes.iter().filter_map(BenchNode::pid));
            fleet::measure(&mut api, audit, fleet, progress, &mut report.fleet).context("the fleet part")?;
        }
    }
    drop(nodes);
    drop(api);
    drop(cp_topo);
    Ok(())
}

fn figure(n: usize, contender: &str, metric: &str, samples: Vec<f64>) -> Figure {
    let mut sorted = samples.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let value = sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN);
    Figure { n, contender: contender.into(), metric: metric.into(), value, samples }
}

/// What a cold start took, read when the newest Service first answered.
struct ColdStart {
    /// From the proxy's process start.
    seconds: f64,
    /// Of which the proxy spent in its syncs, by its own `sync_proxy_rules_duration_seconds`:
    /// the programming once it had the objects.
    syncing: f64,
    cpu: f64,
    peak_rss: f64,
}

/// Cold-starts `node`'s proxy and waits until the newest Service answers from the client pod.
/// (None: it did not answer within `limit`.)
fn cold_start(node: &mut BenchNode, n: usize, limit: Duration) -> anyhow::Result<Option<ColdStart>> {
    let target = node.cluster_target(n);
    let started = Instant::now();
    node.start()?;
    let status = node
        .client_probe()?
        .args(["wait", "--to", &target, "--limit-ms", &limit.as_millis().to_string()])
        .stdin(Stdio::null())
        .status()
        .context("running epx-probe wait")?;
    let elapsed = started.elapsed().as_secs_f64();
    if !status.success() {
        if let Proxy::KubeProxy(proxy) = &mut node.proxy {
            proxy.check_running()?;
        }
        return Ok(None);
    }
    let pid = node.pid().context("the proxy is not running")?;
    let cpu = cpu_seconds(pid)?;
    let (_, peak) = memory_mib(pid)?;
    // A sync is recorded once it ends, and the newest Service can answer before that (the
    // maps are written first): the time is read once the sync that programmed it is recorded.
    let name = node.contender.name();
    let deadline = Instant::now() + Duration::from_secs(30);
    let syncing = loop {
        let scrape = e2e::metrics::parse(&node.metrics_text()?, name)?;
        let recorded = |metric| e2e::metrics::sum(&scrape, metric, |_| true).unwrap_or(0.0);
        if recorded(SYNC_METRIC_COUNT) > 0.0 {
            break recorded(SYNC_METRIC_SUM);
        }
        anyhow::ensure!(Instant::now() < deadline, "{name} answers, but records no {SYNC_METRIC_COUNT} within 30 s");
        std::thread::sleep(Duration::from_millis(20));
    };
    if let Proxy::KubeProxy(proxy) = &mut node.proxy {
        proxy.check_running()?;
    }
    Ok(Some(ColdStart { seconds: elapsed, syncing, cpu, peak_rss: peak }))
}

struct Windows {
    values: Vec<(&'static str, f64)>,
    failures: Vec<String>,
}

/// The data-path windows of one contender at scale `n`.
fn data_path(node: &BenchNode, n: usize, window: Duration) -> anyhow::Result<Windows> {
    let mut out = Windows { values: Vec::new(), failures: Vec::new() };
    let mut note = |what: &str, rate: &Rate| {
        if rate.failed > 0 {
            out.failures.push(format!("{what}: {} of {} failed ({:?})", rate.failed, rate.failed + rate.ok, rate.errors));
        }
    };
    let cluster = node.cluster_target(n);
    let cpu_before = machine_cpu_seconds()?;
    let one = probe::rate(node.client_probe()?, &cluster, 1, window, None)?;
    let cpu = machine_cpu_seconds()? - cpu_before;
    note("ClusterIP, 1 client", &one);
    let two = probe::rate(node.client_probe()?, &cluster, 2, window, None)?;
    note("ClusterIP, 2 clients", &two);
    let nodeport = probe::rate(node.ext.command(&e2e::bin("epx-probe"))?, &node.nodeport_target(), 1, window, None)?;
    note("NodePort", &nodeport);
    let rr = probe::rate(node.client_probe()?, &cluster, 1, window, Some(1000))?;
    note("request/response", &rr);
    let ab = ab_rate(node, window)?;
    let stream = iperf_gbps(node, window)?;
    out.values.extend([
        ("stream_gbps", stream),
        ("clusterip_rate_1", one.per_second),
        ("clusterip_rate_2", two.per_second),
        ("clusterip_connect_p50", one.p50_us as f64),
        ("clusterip_connect_p99", one.p99_us as f64),
        ("nodeport_rate_1", nodeport.per_second),
        ("nodeport_connect_p50", nodeport.p50_us as f64),
        ("nodeport_connect_p99", nodeport.p99_us as f64),
        ("rr_p50", rr.p50_us as f64),
        ("rr_p99", rr.p99_us as f64),
        ("cpu_per_10k", cpu / (one.ok.max(1) as f64) * 10_000.0),
        ("clusterip_ab_rate", ab),
    ]);
    Ok(out)
}

/// `ab -c 1 -t WINDOW` (no keep-alive) from the client pod to the HTTP Service: requests/s.
fn ab_rate(node: &BenchNode, window: Duration) -> anyhow::Result<f64> {
    let mut command = node.topo.command_in("client", Path::new("/usr/bin/ab"))?;
    let url = format!("http://{}/", node.http_target());
    let output = command
        .args(["-q", "-c", "1", "-n", "10000000", "-s", "5", "-t", &window.as_secs().max(1).to_string(), &url])
        .stdin(Stdio::null())
        .output()
        .context("running ab (Debian's apache2-utils; `cargo xtask setup` installs it)")?;
    let text = String::from_utf8_lossy(&output.stdout);
    let failed = text.lines().find_map(|l| l.strip_prefix("Failed requests:")).map(|v| v.trim().to_owned());
    let rate = text
        .lines()
        .find_map(|l| l.strip_prefix("Requests per second:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok());
    match rate {
        Some(rate) if failed.as_deref() == Some("0") => Ok(rate),
        _ => bail!("ab against {url} failed ({}): {}{}", output.status, text.trim(), String::from_utf8_lossy(&output.stderr).trim()),
    }
}

/// One TCP stream for `window` from the client pod through the iperf3 Service (`iperf3 -c`,
/// JSON output): the receiver's Gbit/s.
fn iperf_gbps(node: &BenchNode, window: Duration) -> anyhow::Result<f64> {
    let (host, port) = node.iperf_target();
    let output = node
        .topo
        .command_in("client", Path::new("/usr/bin/iperf3"))?
        .args(["-c", &host, "-p", &port.to_string(), "-t", &window.as_secs().max(1).to_string(), "-J"])
        .stdin(Stdio::null())
        .output()
        .context("running iperf3 -c")?;
    let result: serde_json::Value = serde_json::from_slice(&output.stdout).with_context(|| {
        format!("iperf3 -c {host}:{port}: no JSON ({}): {}", output.status, String::from_utf8_lossy(&output.stderr).trim())
    })?;
    match result["end"]["sum_received"]["bits_per_second"].as_f64() {
        Some(bits) if output.status.success() => Ok(bits / 1e9),
        _ => bail!("iperf3 -c {host}:{port} failed ({}): {}", output.status, result["error"]),
    }
}

fn unix_micros() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

/// The endpoints of the pool, without backend `be{without}` if given.
fn pool_endpoints(without: Option<u8>) -> Vec<Endpoint> {
    slice("x", 8080).endpoints.into_iter().enumerate().filter(|(b, _)| Some(*b as u8) != without).map(|(_, e)| e).collect()
}

/// For each proxy in turn, `changes` times: backend be9 is removed from the newest Service's
/// slice, and that proxy's client pod connects to the Service 2000 times a second until be9
/// has not answered for 1.5 s; the latency is the last answer from be9 minus the time of the
/// write (so it includes the watch's delivery). be9 is then put back, and the proxy must route
/// to it again before the next change. The other proxies are paused (SIGSTOP) during a proxy's
/// turn, so that their work on the same changes (kube-proxy re-syncs every rule: at 10 000
/// Services, seconds of both CPUs per change) does not count against it; they catch up at the
/// start of their own turn (a first change that is not counted). Returns per contender the
/// latencies (ms) and the mean of its own network-programming figure over its turn's changes
/// (ms; NaN if it recorded none).
fn endpoint_changes(
    api: &ControlPlane,
    nodes: &[BenchNode],
    n: usize,
    changes: u32,
) -> anyhow::Result<Vec<(&'static str, Vec<f64>, f64)>> {
    use std::io::{BufRead, BufReader};
    let removed_name = format!("be{CHANGED}");
    let service = format!("bench-{}", n - 1);
    let target = format!("{}:80", service_ip(n - 1));
    let slices: Api<EndpointSlice> = Api::namespaced(api.client(), NAMESPACE);
    let proxies: Vec<&BenchNode> = nodes.iter().filter(|node| node.measured_proxy()).collect();
    let mut latencies: Vec<(&'static str, Vec<f64>, f64)> = proxies.iter().map(|node| (node.contender.name(), Vec::new(), f64::NAN)).collect();
    let set_endpoints = |without: Option<u8>, at: u64| set_pool(api, &slices, &service, without, at);
    let routed_again = |node: &BenchNode, limit_ms: &str| routed_to(node, &target, &removed_name, limit_ms);
    for (turn, node) in proxies.iter().enumerate() {
        let _paused = Paused::all(
            proxies
                .iter()
                .enumerate()
                .filter(|(other, _)| *other != turn)
                .filter_map(|(_, p)| p.pid()),
        );
        routed_again(node, "120000")?;
        // The first change of a turn is not counted: a proxy that was paused catches up on
        // the changes of the others' turns (kube-proxy in one sync, which also records their
        // latencies, seconds long since it was paused) before that change reaches it.
        let mut programmed_before = (0.0, 0.0);
        let out = &mut latencies[turn].1;
        for change in 0..=changes {
            check_interrupted()?;
            let mut child = node
                .client_probe()?
                .args(["last-answer", "--to", &target, "--name", &removed_name, "--quiet-ms", "1500", "--limit-ms", "30000"])
                .stdout(Stdio::piped())
                .stdin(Stdio::null())
                .spawn()
                .context("spawning epx-probe last-answer")?;
            let mut reader = BufReader::new(child.stdout.take().context("stdout")?);
            let mut line = String::new();
            reader.read_line(&mut line)?;
            if line.trim() != "seen" {
                let _ = child.kill();
                bail!("{}: {removed_name} never answered on {target} before the change ({line:?})", node.contender.name());
            }
            let written = unix_micros();
            set_endpoints(Some(CHANGED), written)?;
            let mut line = String::new();
            reader.read_line(&mut line)?;
            child.wait()?;
            let answer: serde_json::Value = serde_json::from_str(line.trim()).with_context(|| format!("parsing {line:?}"))?;
            if answer["quiet"] != true {
                bail!("{}: {removed_name} still got new connections 30 s after it was removed ({answer})", node.contender.name());
            }
            let last = answer["last_us"].as_u64().context("no last answer")?;
            set_endpoints(None, unix_micros())?;
            routed_again(node, "30000")?;
            if change == 0 {
                programmed_before = node.programming_duration()?;
            } else {
                out.push(last.saturating_sub(written) as f64 / 1000.0);
            }
        }
        let programmed = node.programming_duration()?;
        let (sum, count) = (programmed.0 - programmed_before.0, programmed.1 - programmed_before.1);
        latencies[turn].2 = if count > 0.0 { sum / count * 1000.0 } else { f64::NAN };
    }
    // Every proxy routes to be9 again before the next step measures it.
    for node in &proxies {
        routed_again(node, "120000")?;
    }
    Ok(latencies)
}

/// Sets the endpoints of `service`'s slice to the pool, without `be{without}` if given, with
/// the change's trigger time `at` (µs since the epoch).
fn set_pool(api: &ControlPlane, slices: &Api<EndpointSlice>, service: &str, without: Option<u8>, at: u64) -> anyhow::Result<()> {
    let trigger = trigger_time(at);
    let patch = serde_json::json!({
        "metadata": { "annotations": { "endpoints.kubernetes.io/last-change-trigger-time": trigger } },
        "endpoints": pool_endpoints(without),
    });
    api.block_on(slices.patch(&format!("{service}-pool"), &PatchParams::default(), &Patch::Merge(&patch)))
        .with_context(|| format!("changing the endpoints of {service}"))?;
    Ok(())
}

/// A slice's `endpoints.kubernetes.io/last-change-trigger-time` for `at` (µs since the epoch):
/// to the microsecond (RFC 3339 with a fraction, which kube-proxy and ebpf-proxy both parse),
/// so that the proxies' own network-programming figures are not off by up to a second.
fn trigger_time(at: u64) -> String {
    k8s_openapi::jiff::Timestamp::from_microsecond(at as i64).map(|t| t.to_string()).unwrap_or_default()
}

/// Waits until backend `name` answers on `target` through `node` (within `limit_ms`: a proxy
/// that was paused or busy catches up first).
fn routed_to(node: &BenchNode, target: &str, name: &str, limit_ms: &str) -> anyhow::Result<()> {
    let status = node
        .client_probe()?
        .args(["wait", "--to", target, "--name", name, "--limit-ms", limit_ms])
        .stdin(Stdio::null())
        .status()?;
    if !status.success() {
        bail!("{}: {name} did not come back on {target} within {limit_ms} ms", node.contender.name());
    }
    Ok(())
}

/// Endpoint churn at scale `n`: for `duration`, [`CHURN_PER_SECOND`] changes a second to the
/// newest Service's slice (be9 out, in, out, …), every proxy running. Per proxy: its CPU
/// seconds per 100 changes (with the children it waited for) and its largest RSS, sampled
/// every 100 ms. Every proxy routes to be9 again before this returns.
fn churn(api: &ControlPlane, nodes: &[BenchNode], n: usize, duration: Duration) -> anyhow::Result<Vec<(&'static str, f64, f64)>> {
    let service = format!("bench-{}", n - 1);
    let slices: Api<EndpointSlice> = Api::namespaced(api.client(), NAMESPACE);
    let proxies: Vec<(&'static str, u32)> = nodes
        .iter()
        .filter(|node| node.measured_proxy())
        .filter_map(|node| Some((node.contender.name(), node.pid()?)))
        .collect();
    let cpu_before: Vec<f64> = proxies.iter().map(|(_, pid)| cpu_seconds(*pid)).collect::<anyhow::Result<_>>()?;
    let mut peak = vec![0.0f64; proxies.len()];
    let started = Instant::now();
    let (mut changes, mut next_sample) = (0u32, Instant::now());
    while started.elapsed() < duration {
        check_interrupted()?;
        let due = started + Duration::from_secs_f64(f64::from(changes) / f64::from(CHURN_PER_SECOND));
        if Instant::now() >= due {
            let without = (changes % 2 == 0).then_some(CHANGED);
            set_pool(api, &slices, &service, without, unix_micros())?;
            changes += 1;
        }
        if Instant::now() >= next_sample {
            for (i, (_, pid)) in proxies.iter().enumerate() {
                peak[i] = peak[i].max(memory_mib(*pid)?.0);
            }
            next_sample += Duration::from_millis(100);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    set_pool(api, &slices, &service, None, unix_micros())?;
    changes += 1;
    let target = format!("{}:80", service_ip(n - 1));
    for node in nodes.iter().filter(|node| node.measured_proxy()) {
        routed_to(node, &target, &format!("be{CHANGED}"), "120000")?;
    }
    // The changes a proxy had not caught up with when the churn stopped count too: its CPU is
    // read once it has been idle for a second.
    let mut out = Vec::new();
    for (i, (name, pid)) in proxies.iter().enumerate() {
        let cpu = settled_cpu_seconds(*pid, Duration::from_secs(120))? - cpu_before[i];
        out.push((*name, cpu / f64::from(changes) * 100.0, peak[i]));
    }
    Ok(out)
}

/// Processes paused with SIGSTOP, resumed (SIGCONT) when this is dropped, also on failure.
struct Paused(Vec<u32>);

impl Paused {
    fn all(pids: impl IntoIterator<Item = u32>) -> Self {
        let pids: Vec<u32> = pids.into_iter().collect();
        for pid in &pids {
            // SAFETY: kill has no memory preconditions; the pid is a child this run started.
            unsafe { libc::kill(*pid as libc::pid_t, libc::SIGSTOP) };
        }
        Self(pids)
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        for pid in &self.0 {
            // SAFETY: as above.
            unsafe { libc::kill(*pid as libc::pid_t, libc::SIGCONT) };
        }
    }
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as f64
}

/// User + system CPU seconds of process `pid` so far, with those of the children it has
/// waited for (kube-proxy's `iptables-restore` and `nft` runs).
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat.rsplit_once(") ").context("malformed /proc/PID/stat")?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // Fields 14-17 of stat(5) (utime, stime, cutime, cstime): the list after the command
    // starts at field 3.
    let mut ticks = 0.0;
    for field in &fields[11..15] {
        ticks += field.parse::<f64>()?;
    }
    Ok(ticks / clock_ticks())
}

/// [`cpu_seconds`] of `pid` once it has used less than 20 ms of CPU in a second (or when
/// `limit` is over).
fn settled_cpu_seconds(pid: u32, limit: Duration) -> anyhow::Result<f64> {
    let until = Instant::now() + limit;
    let mut last = cpu_seconds(pid)?;
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let now = cpu_seconds(pid)?;
        if now - last < 0.02 || Instant::now() >= until {
            return Ok(now);
        }
        last = now;
    }
}

/// (VmRSS, VmHWM) of process `pid`, in MiB.
fn memory_mib(pid: u32) -> anyhow::Result<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> anyhow::Result<f64> {
        let line = status.lines().find(|l| l.starts_with(name)).with_context(|| format!("no {name} in /proc/{pid}/status"))?;
        let kib: f64 = line.split_whitespace().nth(1).context("malformed status line")?.parse()?;
        Ok(kib / 1024.0)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// System + irq + softirq CPU seconds of the whole machine so far (`/proc/stat`).
fn machine_cpu_seconds() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let cpu = stat.lines().next().context("empty /proc/stat")?;
    let fields: Vec<f64> = cpu.split_whitespace().skip(1).map(|f| f.parse().unwrap_or(0.0)).collect();
    // user nice system idle iowait irq softirq ...
    Ok((fields[2] + fields[5] + fields[6]) / clock_ticks())
}

fn cores() -> f64 {
    std::thread::available_parallelism().map(|n| n.get() as f64).unwrap_or(1.0)
}

/// CPU time the hypervisor gave to others, all CPUs, so far (`steal` in `/proc/stat`).
fn steal_seconds() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let cpu = stat.lines().next().context("empty /proc/stat")?;
    let steal: f64 = cpu.split_whitespace().nth(8).context("no steal column in /proc/stat")?.parse()?;
    Ok(steal / clock_ticks())
}

/// The Node objects of the proxies' nodes, with their address (kube-proxy reads it).
fn create_nodes(api: &ControlPlane) -> anyhow::Result<()> {
    for contender in Contender::ALL {
        create_node(api, if contender == Contender::Ebpf { EBPF_NODE } else { contender.name() })?;
    }
    Ok(())
}

/// Node `name`, with an InternalIP (kube-proxy reads its node's addresses).
fn create_node(api: &ControlPlane, name: &str) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(api.client());
    api.block_on(async {
        let node = Node { metadata: ObjectMeta { name: Some(name.into()), ..Default::default() }, ..Default::default() };
        nodes.create(&PostParams::default(), &node).await.with_context(|| format!("creating Node {name}"))?;
        let status = NodeStatus {
            addresses: Some(vec![NodeAddress { type_: "InternalIP".into(), address: "192.168.240.1".into() }]),
            ..Default::default()
        };
        let patch = serde_json::json!({ "status": status });
        nodes.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await.with_context(|| format!("setting the address of Node {name}"))?;
        anyhow::Ok(())
    })
}

fn service(name: &str, ip: &str, target_port: i32, node_port: Option<u16>) -> Service {
    Service {
        metadata: ObjectMeta { name: Some(name.into()), namespace: Some(NAMESPACE.into()), ..Default::default() },
        spec: Some(ServiceSpec {
            type_: Some(if node_port.is_some() { "NodePort" } else { "ClusterIP" }.into()),
            cluster_ip: Some(ip.into()),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: 80,
                target_port: Some(IntOrString::Int(target_port)),
                node_port: node_port.map(i32::from),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn slice(service: &str, port: i32) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(format!("{service}-pool")),
            namespace: Some(NAMESPACE.into()),
            labels: Some([("kubernetes.io/service-name".to_owned(), service.to_owned())].into()),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: (0..BACKENDS)
            .map(|b| Endpoint {
                addresses: vec![format!("10.244.1.{}", 11 + b)],
                conditions: Some(EndpointConditions { ready: Some(true), serving: Some(true), terminating: Some(false) }),
                // The ebpf-proxy node's name: the backends are its own pods. (kube-proxy, with
                // externalTrafficPolicy Cluster, does not look at it.)
                node_name: Some(EBPF_NODE.into()),
                ..Default::default()
            })
            .collect(),
        ports: Some(vec![EndpointPort { name: Some("http".into()), port: Some(port), protocol: Some("TCP".into()), ..Default::default() }]),
    }
}

/// The Services of the `ab` cross-check (every backend's HTTP port) and of the long stream
/// (iperf3 on be0 only).
fn create_http_service(api: &ControlPlane) -> anyhow::Result<()> {
    let services: Api<Service> = Api::namespaced(api.client(), NAMESPACE);
    let slices: Api<EndpointSlice> = Api::namespaced(api.client(), NAMESPACE);
    api.block_on(async {
        services.create(&PostParams::default(), &service("bench-http", HTTP_VIP, 8081, None)).await.context("creating bench-http")?;
        slices.create(&PostParams::default(), &slice("bench-http", 8081)).await.context("creating bench-http's slice")?;
        services.create(&PostParams::default(), &service("bench-iperf", IPERF_VIP, i32::from(IPERF_PORT), None)).await.context("creating bench-iperf")?;
        let mut iperf = slice("bench-iperf", i32::from(IPERF_PORT));
        iperf.endpoints.truncate(1);
        slices.create(&PostParams::default(), &iperf).await.context("creating bench-iperf's slice")?;
        anyhow::Ok(())
    })
}

/// Creates Services `bench-from` .. `bench-(to-1)` and their slices, 64 requests in flight.
fn create_services(api: &ControlPlane, from: usize, to: usize) -> anyhow::Result<()> {
    let services: Api<Service> = Api::namespaced(api.client(), NAMESPACE);
    let slices: Api<EndpointSlice> = Api::namespaced(api.client(), NAMESPACE);
    api.block_on(async {
        futures::stream::iter(from..to)
            .map(|i| {
                let (services, slices) = (services.clone(), slices.clone());
                async move {
                    check_interrupted()?;
                    let name = format!("bench-{i}");
                    let node_port = (i == 0).then_some(NODE_PORT);
                    services.create(&PostParams::default(), &service(&name, &service_ip(i), 8080, node_port)).await.with_context(|| format!("creating Service {name}"))?;
                    slices.create(&PostParams::default(), &slice(&name, 8080)).await.with_context(|| format!("creating the slice of {name}"))?;
                    anyhow::Ok(())
                }
            })
            .buffer_unordered(64)
            .try_collect::<Vec<()>>()
            .await
    })?;
    Ok(())
}

fn utc_now() -> String {
    let output = Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]).output();
    output.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_default()
}

fn machine() -> std::collections::BTreeMap<String, String> {
    let mut m = std::collections::BTreeMap::new();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo.lines().find_map(|l| l.strip_prefix("model name")).map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned());
    m.insert("CPU".into(), format!("{} × {}", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0), model.unwrap_or_default()));
    let mem = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let total = mem.lines().next().and_then(|l| l.split_whitespace().nth(1)).and_then(|k| k.parse::<f64>().ok()).unwrap_or(0.0);
    m.insert("memory".into(), format!("{:.1} GiB", total / 1024.0 / 1024.0));
    let kernel = Command::new("uname").arg("-r").output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_default();
    m.insert("kernel".into(), kernel);
    m
}

fn versions() -> anyhow::Result<std::collections::BTreeMap<String, String>> {
    let mut v = std::collections::BTreeMap::new();
    let kp = Command::new(kube_proxy::binary()).arg("--version").output().context("kube-proxy --version")?;
    v.insert("kube-proxy".into(), String::from_utf8_lossy(&kp.stdout).trim().to_owned());
    let rev = Command::new("git").args(["-C", &crate::workspace_root().display().to_string(), "describe", "--always", "--dirty"]).output();
    v.insert("ebpf-proxy".into(), format!("git {}", rev.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_default()));
    let nft = Command::new("nft").arg("--version").output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_default();
    let ipt = Command::new("iptables").arg("--version").output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_default();
    v.insert("nft".into(), nft);
    v.insert("iptables".into(), ipt);
    Ok(v)
}

/// Redraws the report in `dir` from its `results.json`.
pub fn redraw(dir: &Path) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(dir.join("results.json")).with_context(|| format!("reading {}/results.json", dir.display()))?;
    let report: Report = serde_json::from_str(&text)?;
    // A report from an older version may lack figures added since: drawn as they are.
    report::write(dir, &report, false)
}
