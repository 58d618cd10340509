//! Build, test and demo orchestration: `cargo xtask setup|build|test|demo`.
//!
//! The kernel crate is built here and only here (Debian's rustc-web with build-std=core for
//! bpfel-unknown-none); the userspace binary embeds the object it produced.

mod bench;
mod cluster;
mod demo;
mod peers;
mod setup;
mod vm;

use std::path::{Path, PathBuf};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "ebpf-proxy build, test and demo tasks (run as root on Debian)")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what building and testing need (Debian packages, bpf-linker); idempotent.
    Setup,
    /// Build the eBPF object and `target/release/ebpf-proxy` with the object embedded.
    Build,
    /// Run every test: unit tests, end-to-end tests in network namespaces, then the end-to-end
    /// tests that need no API server again on kernel 6.1 in a VM (`vm-test`).
    Test {
        /// Extra arguments for the test binaries (e.g. a test name filter).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Pods as network namespaces, the agent on a Service manifest, traffic shown flowing.
    Demo,
    /// Build the upstream peers from their Go modules into the cache (only those missing):
    /// kube-apiserver, kube-proxy, kubelet, kube-controller-manager, kube-scheduler, kubectl,
    /// etcd and CoreDNS.
    Peers,
    /// The end-to-end tests that need no API server, on another kernel in a QEMU VM (TCG).
    VmTest {
        /// Kernel series to boot: Debian 12's linux-image-cloud-amd64 (downloaded, not installed).
        #[arg(long, default_value = vm::DEFAULT_KERNEL)]
        kernel: String,
        /// Give up on the whole VM run after this many seconds.
        #[arg(long, default_value_t = vm::DEFAULT_TIMEOUT_SECS)]
        timeout: u64,
        /// e2e test binaries to run (default: those that need no kube-apiserver).
        tests: Vec<String>,
        /// Extra arguments for the test binaries (e.g. a test name filter).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Benchmark ebpf-proxy against the real kube-proxy (iptables and nftables modes) and no
    /// proxy, each in a node namespace of the same shape, all reading one kube-apiserver; writes
    /// a report with plots and raw results (default: docs/benchmarks).
    Bench {
        /// N = 1 and 100, 1 s windows, one round: checks that every figure and plot is produced
        /// (CI runs this; its figures are not meant to be read). Writes to target/bench-quick.
        #[arg(long)]
        quick: bool,
        /// Stop at this many Services (the full run goes 1, 1000, 10000, 30000).
        #[arg(long, default_value_t = 30_000)]
        max_services: usize,
        /// Seconds per data-path window (default 5; 1 with --quick).
        #[arg(long)]
        window: Option<u64>,
        /// Windows per figure, the contenders taking turns (default 3; 1 with --quick).
        #[arg(long)]
        rounds: Option<u32>,
        /// Where the report goes.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Only redraw the report and plots in this directory from its results.json.
        #[arg(long, value_name = "DIR")]
        redraw: Option<PathBuf>,
        /// Seconds a proxy may take after its cold start until the newest Service answers;
        /// past that it is left out from that N on (the report says so).
        #[arg(long, default_value_t = 600)]
        cold_start_limit: u64,
        /// Measure only these proxies (comma-separated: ebpf-proxy, kube-proxy-iptables,
        /// kube-proxy-nftables) against the no-proxy baseline; default: all.
        #[arg(long, value_delimiter = ',')]
        contenders: Option<Vec<String>>,
        /// Simulated nodes per proxy in the fleet part (many nodes against one API server; run
        /// at the largest N up to 1000); 0 leaves it out. Default 100 (5 with --quick).
        #[arg(long)]
        fleet_nodes: Option<usize>,
        /// Seconds the API server is down in the fleet part (default 60; 5 with --quick).
        #[arg(long)]
        fleet_outage: Option<u64>,
    },
    /// A local control plane (etcd + kube-apiserver) in a network namespace, with a kubeconfig;
    /// `up --node` adds a real node: kube-controller-manager, kube-scheduler, kubelet on
    /// containerd, CoreDNS. No kube-proxy: Services need the agent.
    Cluster {
        #[command(subcommand)]
        action: ClusterAction,
    },
}

#[derive(Subcommand)]
enum ClusterAction {
    /// Start it and keep it running until Ctrl-C; prints the kubeconfig path.
    Up {
        /// Also a real single-node Kubernetes without kube-proxy, in namespaces and temporary
        /// directories of its own: kube-controller-manager, kube-scheduler, kubelet on Debian's
        /// containerd/runc/CNI plugins, locally built images (pause, epx-probe, CoreDNS) and
        /// CoreDNS as Service kube-system/kube-dns (10.96.0.10). Builds the missing peers first.
        #[arg(long)]
        node: bool,
    },
    /// Remove what an interrupted `up` (or test run) left behind: processes, namespaces,
    /// cgroups, temporary directories, pins; restores the kernel settings kubelet changed.
    Down,
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask sits in the workspace").to_owned()
}

/// Runs a command, streaming its output, and fails if it fails.
pub fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("spawning {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}

pub fn step(message: &str) {
    eprintln!("\x1b[1m==> {message}\x1b[0m");
}

/// The eBPF object as `cargo xtask build` leaves it.
pub fn ebpf_object() -> PathBuf {
    workspace_root().join("target/bpf/bpfel-unknown-none/release/proxy-ebpf")
}

/// The same programs with different code (`EPX_EBPF_VARIANT`), for the upgrade test.
pub fn upgrade_object() -> PathBuf {
    workspace_root().join("target/bpf/proxy-ebpf-upgrade.o")
}

/// The same programs without aya-log's calls (`EPX_EBPF_NO_LOG`), which the benchmark compares
/// per packet with the shipped build.
pub fn no_log_object() -> PathBuf {
    workspace_root().join("target/bpf/proxy-ebpf-no-log.o")
}

fn build() -> anyhow::Result<()> {
    setup::ensure_build_tools()?;
    let root = workspace_root();
    step("building the eBPF programs (Debian rustc-web, build-std=core, bpfel-unknown-none)");
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let path = format!("{home}/.cargo/bin:{}", std::env::var("PATH").unwrap_or_default());
    let mut cargo = Command::new(setup::DEBIAN_CARGO);
    // The outer (rustup) cargo's variables must not leak into Debian's cargo.
    for (key, _) in std::env::vars() {
        if key.starts_with("CARGO") || key.starts_with("RUSTUP") || key == "RUSTC_WRAPPER" || key == "RUSTFLAGS" {
            cargo.env_remove(key);
        }
    }
    cargo
        .current_dir(&root)
        .env("PATH", path)
        .env("RUSTC", setup::DEBIAN_RUSTC)
        .env("RUSTC_BOOTSTRAP", "1")
        .env("CARGO_TARGET_DIR", root.join("target/bpf"))
        .env("RUSTFLAGS", "--cfg bpf_target_arch=\"x86_64\" -C debuginfo=2 -C link-arg=--btf")
        .args(["build", "--package", "proxy-ebpf", "--release", "-Z", "build-std=core", "--target", "bpfel-unknown-none"]);
    // The upgrade test needs a second object whose programs differ in code but not in behaviour
    // (`EPX_EBPF_VARIANT`, see proxy-ebpf). Only the proxy-ebpf crate rebuilds, not core.
    run(cargo.env("EPX_EBPF_VARIANT", "upgrade-test"))?;
    std::fs::copy(ebpf_object(), upgrade_object())?;
    run(cargo.env_remove("EPX_EBPF_VARIANT").env("EPX_EBPF_NO_LOG", "1"))?;
    std::fs::copy(ebpf_object(), no_log_object())?;
    run(cargo.env_remove("EPX_EBPF_NO_LOG"))?;

    step("building ebpf-proxy and the test tools (release)");
    run(Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(&root)
        .env("EPX_EBPF_OBJECT", ebpf_object())
        .args(["build", "--release", "--package", "proxy-user", "--package", "e2e"]))?;
    eprintln!("built {}", root.join("target/release/ebpf-proxy").display());
    Ok(())
}

fn test(args: &[String]) -> anyhow::Result<()> {
    build()?;
    setup::ensure_runtime()?;
    // tests/tests/real_node.rs runs a kubelet on Debian's containerd, images built with buildah.
    setup::ensure_node_tools()?;
    // The control-plane tests run the real kube-apiserver and etcd from here, the real-node test
    // also kubelet, kube-controller-manager, kube-scheduler, kubectl and CoreDNS.
    let peers = peers::run()?;
    setup::sweep_leftovers();
    step("running all tests (unit tests, then end-to-end tests in network namespaces)");
    // One test at a time: the end-to-end tests measure timing (e.g. "within 1 s") on 2 cores.
    let mut child = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(workspace_root())
        .env("EPX_EBPF_OBJECT", ebpf_object())
        .env("EPX_PEERS_DIR", &peers)
        // Every binary runs even after one fails, so a red run shows every failure.
        .args(["test", "--release", "--no-fail-fast", "--package", "proxy-user", "--package", "e2e", "--package", "xtask", "--lib", "--bins", "--tests", "--"])
        .arg("--test-threads=1")
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .context("spawning cargo test")?;
    // Echo the output and add up every binary's "test result:" line into one closing line.
    let (mut passed, mut failed) = (0u64, 0u64);
    for line in BufReader::new(child.stdout.take().context("stdout")?).lines() {
        let line = line?;
        println!("{line}");
        if let Some((p, f)) = result_counts(&line) {
            passed += p;
            failed += f;
        }
    }
    let status = child.wait()?;
    // The benchmark's quick mode: every figure and plot of the report is produced (no number
    // is judged here; the full run's report is docs/benchmarks).
    step("running the benchmark in quick mode (cargo xtask bench --quick)");
    let bench_ok = match bench_quick(&peers) {
        Ok(()) => {
            passed += 1;
            true
        }
        Err(e) => {
            println!("\nthe quick benchmark failed: {e:#}");
            failed += 1;
            false
        }
    };
    // Final section: the end-to-end tests that need no API server again, on the second kernel
    // (Debian 12's 6.1: no tcx, so the packet programs take the clsact path), in a VM.
    step(&format!("running the end-to-end tests on kernel {} in a VM", vm::DEFAULT_KERNEL));
    let options = vm::Options {
        kernel: vm::DEFAULT_KERNEL.into(),
        tests: Vec::new(),
        args: args.to_vec(),
        timeout: std::time::Duration::from_secs(vm::DEFAULT_TIMEOUT_SECS),
    };
    let vm_ok = match vm::run_tests(&options) {
        Ok(report) => {
            vm::print_summary(&report);
            passed += report.passed;
            failed += report.failed;
            report.ok
        }
        Err(e) => {
            println!("\nthe VM tests could not run: {e:#}");
            failed += 1;
            false
        }
    };
    println!("\ntests: {passed} passed, {failed} failed");
    if !status.success() {
        bail!("cargo test failed with {status}");
    }
    if !bench_ok {
        bail!("the quick benchmark failed");
    }
    if !vm_ok {
        bail!("the end-to-end tests on kernel {} failed", vm::DEFAULT_KERNEL);
    }
    if passed == 0 {
        bail!("no test ran");
    }
    Ok(())
}

fn bench_options(quick: bool, max_services: usize, out: Option<PathBuf>) -> bench::Options {
    let default_out = if quick { "target/bench-quick" } else { "docs/benchmarks" };
    let mut command = String::from("cargo xtask bench");
    if quick {
        command.push_str(" --quick");
    }
    if max_services != 30_000 {
        command.push_str(&format!(" --max-services {max_services}"));
    }
    bench::Options {
        quick,
        max_services,
        out: out.unwrap_or_else(|| workspace_root().join(default_out)),
        window: None,
        rounds: None,
        command,
        cold_start_limit: std::time::Duration::from_secs(600),
        contenders: None,
        fleet_nodes: None,
        fleet_outage: None,
    }
}

fn bench_quick(peers: &Path) -> anyhow::Result<()> {
    // SAFETY: no other thread reads the environment while the test command runs this.
    unsafe { std::env::set_var("EPX_PEERS_DIR", peers) };
    setup::sweep_leftovers();
    bench::run(&bench_options(true, 30_000, None))
}

/// The passed and failed counts of a libtest `test result:` line.
pub fn result_counts(line: &str) -> Option<(u64, u64)> {
    let result = line.strip_prefix("test result: ")?;
    let count = |word: &str| -> u64 {
        result
            .split(';')
            .find_map(|part| part.trim().trim_start_matches("ok. ").trim_start_matches("FAILED. ").strip_suffix(word))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    };
    Some((count(" passed"), count(" failed")))
}

fn vm_test(options: &vm::Options) -> anyhow::Result<()> {
    build()?;
    let report = vm::run_tests(options)?;
    vm::print_summary(&report);
    println!("\ntests: {} passed, {} failed", report.passed, report.failed);
    if !report.ok || report.failed > 0 {
        bail!("the tests on kernel {} failed", report.release);
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Task::Setup => setup::ensure(),
        Task::Build => build(),
        Task::Test { args } => test(&args),
        Task::Demo => {
            build()?;
            setup::ensure_runtime()?;
            setup::sweep_leftovers();
            demo::run()
        }
        Task::Cluster { action: ClusterAction::Up { node } } => {
            if node {
                // epx-probe and epx-pause go into the node's images.
                build()?;
                setup::ensure_runtime()?;
                setup::ensure_node_tools()?;
            } else {
                setup::ensure()?;
            }
            cluster::up(node)
        }
        Task::Cluster { action: ClusterAction::Down } => cluster::down(),
        Task::Bench { quick, max_services, window, rounds, out, redraw, cold_start_limit, contenders, fleet_nodes, fleet_outage } => {
            if let Some(dir) = redraw {
                return bench::redraw(&dir);
            }
            build()?;
            setup::ensure_runtime()?;
            let peers = peers::run()?;
            // SAFETY: set before any other thread exists; the harness reads it to find the peers.
            unsafe { std::env::set_var("EPX_PEERS_DIR", &peers) };
            setup::sweep_leftovers();
            let mut options = bench_options(quick, max_services, out);
            options.window = window.map(std::time::Duration::from_secs);
            options.rounds = rounds;
            if let Some(window) = window {
                options.command.push_str(&format!(" --window {window}"));
            }
            if let Some(rounds) = rounds {
                options.command.push_str(&format!(" --rounds {rounds}"));
            }
            if cold_start_limit != 600 {
                options.command.push_str(&format!(" --cold-start-limit {cold_start_limit}"));
            }
            options.cold_start_limit = std::time::Duration::from_secs(cold_start_limit);
            if let Some(names) = &contenders {
                options.command.push_str(&format!(" --contenders {}", names.join(",")));
            }
            options.contenders = contenders;
            if let Some(nodes) = fleet_nodes {
                options.command.push_str(&format!(" --fleet-nodes {nodes}"));
            }
            if let Some(outage) = fleet_outage {
                options.command.push_str(&format!(" --fleet-outage {outage}"));
            }
            options.fleet_nodes = fleet_nodes;
            options.fleet_outage = fleet_outage.map(std::time::Duration::from_secs);
            bench::run(&options)
        }
        Task::Peers => peers::run().map(|dir| println!("{}", dir.display())),
        Task::VmTest { kernel, timeout, tests, args } => {
            vm_test(&vm::Options { kernel, tests, args, timeout: std::time::Duration::from_secs(timeout) })
        }
    }
}
