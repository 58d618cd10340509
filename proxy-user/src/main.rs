//! `ebpf-proxy`: the node agent that fills the kernel's load-balancing maps, and its tools.

mod agent;
mod boot_pod;
mod checkpoint;
mod desired;
mod dump;
mod healthcheck;
mod http;
mod ipparse;
mod kernel;
mod kube_proxy_cleanup;
mod kube_proxy_config;
mod lbmap;
mod metrics;
mod netif;
mod reconcile;
mod maglev;
#[cfg(test)]
mod memory_probe;
mod snat_ports;
mod sockdestroy;
mod source;

#[cfg(test)]
#[global_allocator]
static ALLOCATOR: memory_probe::Counting = memory_probe::Counting;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "ebpf-proxy", version, about = "eBPF Service load balancing that replaces kube-proxy")]
#[command(arg_required_else_help = true, args_conflicts_with_subcommands = true)]
struct Cli {
    /// kube-proxy's flag: the same as the `cleanup` command (`ebpf-proxy --cleanup
    /// [--kube-proxy] [--bpffs DIR]`), for scripts and manifests written for kube-proxy.
    #[arg(long)]
    cleanup: bool,
    /// With `--cleanup`: as `cleanup --bpffs`.
    #[arg(long = "bpffs", value_name = "BPFFS", requires = "cleanup", default_value = DEFAULT_BPFFS)]
    cleanup_bpffs: PathBuf,
    /// With `--cleanup`: as `cleanup --kube-proxy`.
    #[arg(long = "kube-proxy", requires = "cleanup")]
    cleanup_kube_proxy: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node agent: fill the pinned maps from the source and keep them in sync.
    Agent(AgentArgs),
    /// Print the services and backends the kernel is using, from the pinned maps.
    Dump {
        #[arg(long, default_value = DEFAULT_BPFFS)]
        bpffs: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Detach and unpin everything the agent created. Service traffic stops being translated.
    /// With `--kube-proxy`, also remove what kube-proxy left behind (as `kube-proxy --cleanup`).
    Cleanup(CleanupArgs),
    /// Write the static pod that restores the datapath at boot, before the API server answers
    /// (the DaemonSet's init container `install-boot-pod` runs this): made of this pod's own
    /// image, hostPath volumes and agent arguments, read from the API; rewritten only when it
    /// changes, kept as it is when the API server does not answer.
    BootPod(BootPodArgs),
}

#[derive(Args, Clone, Debug)]
struct BootPodArgs {
    /// The file to write, in kubelet's static pod directory (`staticPodPath`).
    #[arg(long, default_value = "/etc/kubernetes/manifests/ebpf-proxy-boot.yaml")]
    manifest: PathBuf,
    /// This pod's name (downward API `metadata.name`).
    #[arg(long, env = "POD_NAME")]
    pod: Option<String>,
    /// This pod's namespace (downward API `metadata.namespace`).
    #[arg(long, env = "POD_NAMESPACE")]
    namespace: Option<String>,
    /// The container of this pod that runs `ebpf-proxy agent`.
    #[arg(long, default_value = "agent")]
    agent_container: String,
    /// Kubeconfig (default: in-cluster config, then $KUBECONFIG, ~/.kube/config).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
}

#[derive(Args, Clone, Debug)]
struct CleanupArgs {
    #[arg(long, default_value = DEFAULT_BPFFS)]
    bpffs: PathBuf,
    /// Also remove kube-proxy's rules: its iptables chains (`KUBE-*`, both iptables backends,
    /// IPv4 and IPv6) and the jumps to them, its nftables tables (`ip`/`ip6 kube-proxy`), and
    /// its IPVS state (the Services bound to `kube-ipvs0`, that device, its `KUBE-*` ipsets).
    /// Other rules are left as they are.
    #[arg(long)]
    kube_proxy: bool,
}

const DEFAULT_BPFFS: &str = "/sys/fs/bpf/ebpf-proxy";

#[derive(Args, Clone, Debug)]
pub struct AgentArgs {
    /// kube-proxy's configuration file (a `KubeProxyConfiguration`, kubeproxy.config.k8s.io/v1alpha1,
    /// such as `config.conf` of kube-proxy's ConfigMap): hostnameOverride, bindAddress,
    /// healthzBindAddress, metricsBindAddress, nodePortAddresses and clientConnection.kubeconfig
    /// are used; flags given on the command line override them, as in kube-proxy.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Where Services and EndpointSlices come from: `kube` (the Kubernetes API) or `file:PATH`
    /// (a manifest file or a directory of them).
    #[arg(long, default_value = "kube", value_parser = parse_source)]
    pub source: SourceKind,
    /// Kubeconfig for `--source kube` (default: in-cluster config, then $KUBECONFIG, ~/.kube/config).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// This node's name (endpoints' nodeName are compared with it).
    #[arg(long, env = "NODE_NAME", default_value_t = default_node_name())]
    pub node_name: String,
    /// cgroup v2 directory whose processes get socket-level load balancing (default: the root).
    #[arg(long)]
    pub cgroup: Option<PathBuf>,
    /// bpffs directory for the pinned maps and links.
    #[arg(long, default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    /// Interfaces for the packet-level datapath (NodePort, externalIPs, LoadBalancer IPs for
    /// traffic from outside the node), comma-separated; `none` for none. Default: every interface
    /// holding one of the node's non-loopback IPv4 addresses.
    #[arg(long, value_delimiter = ',')]
    pub interfaces: Vec<String>,
    /// How the packet-level programs are attached: `auto` (tcx on kernels that have it, ≥ 6.6;
    /// a clsact qdisc filter otherwise), `tcx`, or `legacy` (clsact filter).
    #[arg(long, default_value = "auto", value_parser = kernel::tc::AttachMode::parse)]
    pub tc_attach: kernel::tc::AttachMode,
    /// Which node addresses get NodePorts: comma-separated CIDRs (the node's addresses inside
    /// them), or `primary` (the Node object's primary InternalIP/ExternalIP per family), as
    /// kube-proxy's flag. Default: every address of the node's interfaces (loopback and IPv6
    /// link-local excepted), as kube-proxy's iptables mode.
    #[arg(long, default_value = "", value_parser = desired::NodePortAddresses::parse)]
    pub nodeport_addresses: desired::NodePortAddresses,
    /// How the packet path picks the backend of a new flow from outside the node: `random` (as
    /// kube-proxy), or `maglev` (consistent hashing of the client's address and port: every node
    /// sends the same flow to the same backend; one backend change of N moves about 1/N of the
    /// flows). Connections from local sockets always pick at random.
    #[arg(long, value_enum, default_value_t = reconcile::LbAlgorithm::Random)]
    pub lb_algorithm: reconcile::LbAlgorithm,
    /// Directory for the agent's own state (checkpoint, lock).
    #[arg(long, default_value = "/var/lib/ebpf-proxy")]
    pub state_dir: PathBuf,
    /// Address for /healthz and /livez (as kube-proxy).
    #[arg(long, default_value = "0.0.0.0:10256")]
    pub healthz_bind: SocketAddr,
    /// Address for /metrics (as kube-proxy).
    #[arg(long, default_value = "127.0.0.1:10249")]
    pub metrics_bind: SocketAddr,
    /// /healthz fails when an API change has not reached the datapath after this long (e.g. a
    /// full map refuses it). kube-proxy uses 2 × its 30 s sync period; so does the default.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub healthz_stale_after: Duration,
    /// How often a file source is checked for changes.
    #[arg(long, default_value = "200ms", value_parser = parse_duration)]
    pub poll_interval: Duration,
    /// Capacity of the service map: one entry per frontend (Service IP × port × scope: every
    /// address is a frontend for the node's own sockets and for traffic from outside) and one
    /// per backend slot, frontends × (1 + backends). The default holds about 3 000 Services
    /// with 10 endpoints; 30 000 single-port Services with 10 endpoints need 660 000 entries,
    /// e.g. `--map-size-services 1048576` (the kernel reserves a hash map's memory when it is
    /// created, so the default stays small).
    #[arg(long, default_value_t = proxy_abi::capacity::SERVICES4)]
    pub map_size_services: u32,
    /// Capacity of the backend map: one entry per distinct endpoint address and port, however
    /// many Services share it (30 000 Services of 10 pods each of their own: 300 000, e.g.
    /// `--map-size-backends 524288`).
    #[arg(long, default_value_t = proxy_abi::capacity::BACKENDS4)]
    pub map_size_backends: u32,
    /// Capacity of the reverse-NAT map (one entry per frontend).
    #[arg(long, default_value_t = proxy_abi::capacity::REV_NAT4)]
    pub map_size_rev_nat: u32,
    /// Capacity of the socket reverse-translation LRU.
    #[arg(long, default_value_t = proxy_abi::capacity::REV_SOCK4)]
    pub map_size_rev_sock: u32,
    /// Capacity of the connection-tracking LRU of the packet-level datapath (two entries per flow).
    #[arg(long, default_value_t = proxy_abi::capacity::CT4)]
    pub map_size_ct: u32,
    /// Capacity of the IPv6 socket reverse-translation LRU.
    #[arg(long, default_value_t = proxy_abi::capacity::REV_SOCK6)]
    pub map_size_rev_sock6: u32,
    /// Capacity of the IPv6 connection-tracking LRU (two entries per flow).
    #[arg(long, default_value_t = proxy_abi::capacity::CT6)]
    pub map_size_ct6: u32,
    /// Capacity of the session-affinity LRU (client × frontend with `sessionAffinity: ClientIP`).
    #[arg(long, default_value_t = proxy_abi::capacity::AFFINITY4)]
    pub map_size_affinity: u32,
    /// Source ports for SNAT (traffic from outside to a backend on another node), per node
    /// address, backend and protocol. The node's own ephemeral range
    /// (`net.ipv4.ip_local_port_range`) is left out, so no SNATed flow takes the tuple of one
    /// of the node's connections, and so is `--service-node-port-range`: 33,512 ports with the
    /// defaults. A port is free again once its flow has ended (10 s after a close, 65 s when
    /// the backend closed first and holds the tuple in TIME_WAIT) or timed out.
    #[arg(long, default_value = "1024-65535", value_parser = snat_ports::PortRange::parse)]
    pub snat_port_range: snat_ports::PortRange,
    /// The cluster's NodePort range: the kube-apiserver's flag of the same name (its default
    /// here too). No SNAT port is taken from it: a backend's reply to node address:NodePort
    /// can be taken for a new connection to that NodePort on the backend's node.
    #[arg(long, default_value = "30000-32767", value_parser = snat_ports::PortRange::parse)]
    pub service_node_port_range: snat_ports::PortRange,
    /// How often conntrack entries past their timeout are deleted (the kernel already ignores
    /// them; this keeps the LRU and `dump` to live flows).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub conntrack_gc_interval: Duration,
    /// Load the kernel programs from this eBPF object file instead of the one built into the
    /// binary (a hotfix or an upgrade test). The attached programs are swapped atomically.
    #[arg(long)]
    pub bpf_object: Option<PathBuf>,
    /// Attach the datapath, program it from the checkpoint if the pinned maps are empty (a
    /// reboot), and exit without contacting the source: the boot path, run before the API server
    /// answers (the static pod of `boot-pod`). When another agent holds the node lock it steps
    /// aside at once (exit 0): that agent serves the node. The agent that starts later adopts
    /// what it left.
    #[arg(long)]
    pub restore_only: bool,
}

#[derive(Clone, Debug)]
pub enum SourceKind {
    Kube,
    File(PathBuf),
}

fn parse_source(text: &str) -> Result<SourceKind, String> {
    match text {
        "kube" => Ok(SourceKind::Kube),
        _ => match text.strip_prefix("file:") {
            Some(path) if !path.is_empty() => Ok(SourceKind::File(PathBuf::from(path))),
            _ => Err(format!("unsupported source {text:?}: use kube or file:PATH")),
        },
    }
}

fn default_node_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default()
}

/// A duration as humantime reads it (`200ms`, `10s`, `1m 30s`); a bare number is seconds, as
/// the flags always took it.
fn parse_duration(text: &str) -> Result<Duration, String> {
    if let Ok(seconds) = text.parse::<u64>() {
        return Ok(Duration::from_secs(seconds));
    }
    humantime::parse_duration(text).map_err(|error| format!("invalid duration {text:?}: {error}"))
}

/// The cgroup v2 mount point, from /proc/mounts (`/sys/fs/cgroup` or, on hybrid hosts,
/// `/sys/fs/cgroup/unified`).
fn cgroup2_root() -> anyhow::Result<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (_, mount_point, fs_type) = (fields.next()?, fields.next()?, fields.next()?);
            (fs_type == "cgroup2").then(|| PathBuf::from(mount_point))
        })
        .next()
        .context("no cgroup2 filesystem is mounted; ebpf-proxy needs cgroup v2 (kernel ≥ 4.17)")
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|error| error.exit());
    let command = match cli.command {
        Some(command) => command,
        // Only `--cleanup` parses without a command (every other top-level flag requires it).
        None => Command::Cleanup(CleanupArgs { bpffs: cli.cleanup_bpffs, kube_proxy: cli.cleanup_kube_proxy }),
    };
    match command {
        Command::Agent(args) => {
            let agent_matches = matches.subcommand_matches("agent").context("agent arguments")?;
            let mut args = with_config_file(args, agent_matches)?;
            if args.cgroup.is_none() {
                args.cgroup = Some(cgroup2_root()?);
            }
            // The agent's loop is the future `block_on` polls on this (the main) thread, which
            // is none of the runtime's workers: the sync's blocking map syscalls never hold up
            // the tasks on the workers (the watches, /metrics, /healthz, health checks). The
            // jobs that scan flow tables go to the blocking pool (`spawn_blocking`).
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?
                .block_on(agent::run(args))
        }
        Command::Dump { bpffs, json } => {
            let dump = dump::collect(&bpffs)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&dump)?);
            } else {
                dump::print_text(&dump);
            }
            Ok(())
        }
        Command::BootPod(args) => {
            let pod = args.pod.context("no --pod and no $POD_NAME: give the container its pod's name through the downward API")?;
            let namespace = args
                .namespace
                .context("no --namespace and no $POD_NAMESPACE: give the container its pod's namespace through the downward API")?;
            tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(boot_pod::install(
                &args.manifest,
                &namespace,
                &pod,
                &args.agent_container,
                args.kubeconfig.as_deref(),
            ))
        }
        Command::Cleanup(CleanupArgs { bpffs, kube_proxy }) => {
            let removed = kernel::cleanup(&bpffs).with_context(|| format!("cleaning up {}", bpffs.display()))?;
            for path in &removed {
                println!("removed {}", path.display());
            }
            println!("{} pinned objects removed; Service translation is off (socket and packet level)", removed.len());
            if kube_proxy {
                let report = kube_proxy_cleanup::run().context("removing kube-proxy's rules")?;
                for line in report.lines() {
                    println!("{line}");
                }
            }
            Ok(())
        }
    }
}

/// The agent's effective arguments for a command line, as `main` computes them.
#[cfg(test)]
pub(crate) fn agent_args(argv: &[&str]) -> anyhow::Result<AgentArgs> {
    let matches = Cli::command().try_get_matches_from(argv)?;
    let agent_matches = matches.subcommand_matches("agent").context("not an agent command line")?;
    let args = AgentArgs::from_arg_matches(agent_matches)?;
    with_config_file(args, agent_matches)
}

/// `args` with the settings of `--config` filled in where no flag was given on the command line
/// (kube-proxy: "flags override the config file"; a default or `$NODE_NAME` does not).
fn with_config_file(mut args: AgentArgs, matches: &ArgMatches) -> anyhow::Result<AgentArgs> {
    let Some(path) = args.config.clone() else {
        return Ok(args);
    };
    let file = kube_proxy_config::load(&path)?;
    let from_flag = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    if let (Some(name), false) = (file.node_name, from_flag("node_name")) {
        args.node_name = name;
    }
    if let (Some(kubeconfig), false) = (file.kubeconfig, from_flag("kubeconfig")) {
        args.kubeconfig = Some(kubeconfig);
    }
    if let (Some(addr), false) = (file.healthz_bind, from_flag("healthz_bind")) {
        args.healthz_bind = addr;
    }
    if let (Some(addr), false) = (file.metrics_bind, from_flag("metrics_bind")) {
        args.metrics_bind = addr;
    }
    if let (Some(addresses), false) = (file.nodeport_addresses, from_flag("nodeport_addresses")) {
        args.nodeport_addresses = addresses;
    }
    if !file.ignored.is_empty() {
        tracing::warn!(
            config = %path.display(),
            fields = %file.ignored.join(", "),
            "these settings of the config file have no effect on ebpf-proxy: they configure kube-proxy's \
             iptables, IPVS, nftables or winkernel mode or its own process (pod traffic is recognised \
             by its cgroup, not by clusterCIDR; the node's primary IPs come from its Node object)"
        );
    }
    Ok(args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_humantime_and_bare_numbers_as_seconds() {
        assert_eq!(parse_duration("200ms"), Ok(Duration::from_millis(200)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("1m 30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("60"), Ok(Duration::from_secs(60)));
        for bad in ["", "ten", "5 parsecs", "-1s"] {
            let error = parse_duration(bad).unwrap_err();
            assert!(error.contains(&format!("{bad:?}")), "{error}");
        }
    }
}
