//! Namespaces as pods on a node, and a cgroup for the pods' processes.
//!
//! ```text
//!   pod netns (eth0 10.244.1.N/24) ──veth── node netns (br0 10.244.1.1/24) ──veth── pod netns
//! ```
//! [`Topology::add_remote_pod`] adds a pod on a second node (its own namespace and link).
//! An [`ExternalClient`] is a namespace outside the node, linked to the node namespace by its own
//! veth (`ext0` 192.168.240.1/24 on the node, `eth0` 192.168.240.2/24 in the client): traffic
//! that reaches the node from outside, as NodePort/externalIP/LoadBalancer traffic does.
//!
//! Nothing is configured in the host's own namespace: the only host-side objects are the
//! namespace files, one cgroup directory, and (via the agent) one bpffs directory.

use std::fs::{self, File};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{bail, Context};

/// Runs a command and fails with its stderr if it does not succeed.
pub fn run(cmd: &mut Command) -> anyhow::Result<Output> {
    let output = cmd.output().with_context(|| format!("spawning {cmd:?}"))?;
    if !output.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(output)
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    run(Command::new("ip").args(args)).map(|_| ())
}

/// A named network namespace (`/run/netns/NAME`), deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn create(name: &str) -> anyhow::Result<Self> {
        ip(&["netns", "add", name])?;
        let ns = Self { name: name.to_owned() };
        ns.exec(&["ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// Runs `argv` inside this namespace and waits for it.
    pub fn exec(&self, argv: &[&str]) -> anyhow::Result<Output> {
        run(Command::new("ip").args(["netns", "exec", &self.name]).args(argv))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "delete", &self.name]).output();
    }
}

/// The cgroup v2 mount point (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on hybrid hosts).
pub fn cgroup2_root() -> anyhow::Result<PathBuf> {
    let mounts = fs::read_to_string("/proc/mounts")?;
    mounts
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(fields[1]))
        })
        .context("no cgroup2 mount in /proc/mounts")
}

/// A cgroup v2 directory; on drop its processes are killed and it is removed.
pub struct Cgroup {
    pub path: PathBuf,
}

impl Cgroup {
    pub fn create(name: &str) -> anyhow::Result<Self> {
        let path = cgroup2_root()?.join(name);
        fs::create_dir(&path).with_context(|| format!("creating cgroup {}", path.display()))?;
        Ok(Self { path })
    }

    fn pids(&self) -> Vec<i32> {
        fs::read_to_string(self.path.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            let pids = self.pids();
            if pids.is_empty() && fs::remove_dir(&self.path).is_ok() {
                return;
            }
            for pid in pids {
                // SAFETY: plain kill(2) on processes this test put into its own cgroup.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

/// A pod: a namespace with one address on the node's bridge (and an IPv6 one once the
/// topology has IPv6).
pub struct Pod {
    pub name: String,
    pub ip: String,
    /// fd00:10:244:1::`host`, after [`Topology::enable_ipv6`].
    pub ip6: Option<String>,
    pub netns: Netns,
}

/// Waits until no IPv6 address in `netns` is still tentative (duplicate address detection of the
/// link-local addresses of fresh interfaces takes about a second; until then neighbour discovery,
/// and so the first packets, can stall).
fn wait_ipv6_ready(netns: &Netns) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let out = netns.exec(&["ip", "-6", "addr", "show", "tentative"])?;
        if out.stdout.iter().all(u8::is_ascii_whitespace) {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            bail!("IPv6 addresses in {} still tentative: {}", netns.name, String::from_utf8_lossy(&out.stdout));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// The node's IPv6 address on br0 (with [`Topology::enable_ipv6`]), inside the pods' /64.
pub const NODE_IP6: &str = "fd00:10:244:1::1";

/// A node namespace with a bridge, its pods, and the cgroup whose sockets are load balanced.
pub struct Topology {
    pub id: String,
    pub pods: Vec<Pod>,
    pub cgroup: Cgroup,
    pub node: Netns,
    /// Pods and br0 also get IPv6 addresses (fd00:10:244:1::/64).
    pub ipv6: bool,
}

impl Topology {
    /// Creates the node namespace (bridge `br0`, 10.244.1.1/24) and the cgroup.
    pub fn new() -> anyhow::Result<Self> {
        crate::require_root();
        let id = crate::unique_id();
        let node = Netns::create(&format!("{}-{id}-node", crate::PREFIX))?;
        node.exec(&["ip", "link", "add", "br0", "type", "bridge"])?;
        node.exec(&["ip", "addr", "add", "10.244.1.1/24", "dev", "br0"])?;
        node.exec(&["ip", "link", "set", "br0", "up"])?;
        let cgroup = Cgroup::create(&format!("{}-{id}", crate::PREFIX))?;
        Ok(Self { id, pods: Vec::new(), cgroup, node, ipv6: false })
    }

    /// Gives br0 [`NODE_IP6`]/64 and every pod, present and future, fd00:10:244:1::`host`/64 with
    /// a default route via the node: a dual-stack node. (No duplicate address detection, so the
    /// addresses work at once.)
    pub fn enable_ipv6(&mut self) -> anyhow::Result<()> {
        self.node.exec(&["ip", "-6", "addr", "add", &format!("{NODE_IP6}/64"), "dev", "br0", "nodad"])?;
        // Interfaces made from now on (the node's side of each pod's veth) skip duplicate address
        // detection, so their link-local addresses are usable at once.
        self.node.exec(&["sysctl", "-qw", "net.ipv6.conf.default.accept_dad=0"])?;
        self.ipv6 = true;
        for pod in &mut self.pods {
            let host = pod.ip.rsplit('.').next().context("pod address")?.to_owned();
            pod.ip6 = Some(Self::pod_ipv6(&pod.netns, &host)?);
        }
        wait_ipv6_ready(&self.node)?;
        for pod in &self.pods {
            wait_ipv6_ready(&pod.netns)?;
        }
        Ok(())
    }

    fn pod_ipv6(netns: &Netns, host: &str) -> anyhow::Result<String> {
        let ip6 = format!("fd00:10:244:1::{host}");
        netns.exec(&["ip", "-6", "addr", "add", &format!("{ip6}/64"), "dev", "eth0", "nodad"])?;
        netns.exec(&["ip", "-6", "route", "add", "default", "via", NODE_IP6])?;
        Ok(ip6)
    }

    /// Adds a pod named `name` at 10.244.1.`host`.
    pub fn add_pod(&mut self, name: &str, host: u8) -> anyhow::Result<&Pod> {
        let netns = Netns::create(&format!("{}-{}-{name}", crate::PREFIX, self.id))?;
        let ip = format!("10.244.1.{host}");
        let host_side = format!("v{host}");
        self.node.exec(&["ip", "link", "add", &host_side, "type", "veth", "peer", "name", "eth0", "netns", &netns.name])?;
        self.node.exec(&["ip", "link", "set", &host_side, "master", "br0", "up"])?;
        netns.exec(&["ip", "addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
        if self.ipv6 {
            // No duplicate address detection for the link-local address either: usable at once.
            netns.exec(&["sysctl", "-qw", "net.ipv6.conf.eth0.accept_dad=0"])?;
        }
        netns.exec(&["ip", "link", "set", "eth0", "up"])?;
        netns.exec(&["ip", "route", "add", "default", "via", "10.244.1.1"])?;
        let ip6 = if self.ipv6 {
            let ip6 = Self::pod_ipv6(&netns, &host.to_string())?;
            wait_ipv6_ready(&netns)?;
            wait_ipv6_ready(&self.node)?;
            Some(ip6)
        } else {
            None
        };
        self.pods.push(Pod { name: name.to_owned(), ip, ip6, netns });
        Ok(self.pods.last().expect("just pushed"))
    }

    /// Adds a second pod subnet on the node: bridge `bridge` with `prefix`.1/24 (e.g. `10.244.3`),
    /// routed to and from br0's pods through the node (not bridged with them).
    pub fn add_subnet(&self, bridge: &str, prefix: &str) -> anyhow::Result<()> {
        self.node.exec(&["ip", "link", "add", bridge, "type", "bridge"])?;
        self.node.exec(&["ip", "addr", "add", &format!("{prefix}.1/24"), "dev", bridge])?;
        self.node.exec(&["ip", "link", "set", bridge, "up"])?;
        self.node.exec(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]).map(|_| ())
    }

    /// Adds a pod named `name` at `prefix`.`host` on a subnet made by [`Topology::add_subnet`]
    /// (IPv4 only).
    pub fn add_pod_on(&mut self, name: &str, bridge: &str, prefix: &str, host: u8) -> anyhow::Result<&Pod> {
        let netns = Netns::create(&format!("{}-{}-{name}", crate::PREFIX, self.id))?;
        let ip = format!("{prefix}.{host}");
        let host_side = format!("{bridge}v{host}");
        self.node.exec(&["ip", "link", "add", &host_side, "type", "veth", "peer", "name", "eth0", "netns", &netns.name])?;
        self.node.exec(&["ip", "link", "set", &host_side, "master", bridge, "up"])?;
        netns.exec(&["ip", "addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
        netns.exec(&["ip", "link", "set", "eth0", "up"])?;
        netns.exec(&["ip", "route", "add", "default", "via", &format!("{prefix}.1")])?;
        self.pods.push(Pod { name: name.to_owned(), ip, ip6: None, netns });
        Ok(self.pods.last().expect("just pushed"))
    }

    pub fn pod(&self, name: &str) -> &Pod {
        self.pods.iter().find(|p| p.name == name).unwrap_or_else(|| panic!("no pod {name}"))
    }

    /// A command that runs inside `pod`'s network namespace and inside this topology's cgroup,
    /// so its sockets see the agent's socket-level load balancing. Uses setns(2) directly, since
    /// `ip netns exec` would remount /sys and hide the cgroup and bpffs mounts.
    pub fn command_in(&self, pod: &str, program: &Path) -> anyhow::Result<Command> {
        self.command_in_cgroup(pod, program, &self.cgroup.path)
    }

    /// As [`Topology::command_in`], but in `cgroup` (another node's, whose agent balances it).
    pub fn command_in_cgroup(&self, pod: &str, program: &Path, cgroup: &Path) -> anyhow::Result<Command> {
        let netns = File::open(self.pod(pod).netns.path())?;
        let procs = fs::OpenOptions::new().write(true).open(cgroup.join("cgroup.procs"))?;
        let mut cmd = Command::new(program);
        // SAFETY: only async-signal-safe calls (setns, write) between fork and exec; the files
        // are moved into the closure and stay open until exec.
        unsafe {
            cmd.pre_exec(move || {
                let mut procs = &procs;
                procs.write_all(b"0")?;
                if libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(cmd)
    }
}

/// Runs `f` on a thread that has entered the network namespace at `netns` (only that thread
/// changes namespace), and returns its result.
pub fn in_netns<T: Send>(netns: &Path, f: impl FnOnce() -> T + Send) -> std::io::Result<T> {
    let file = File::open(netns)?;
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                // SAFETY: setns(2) on a namespace file we hold open; affects this thread only.
                if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(f())
            })
            .join()
            .map_err(|_| std::io::Error::other("thread in the namespace panicked"))?
    })
}

/// Makes `cmd` run inside the network namespace at `netns` (setns between fork and exec, so
/// mounts such as /sys/fs/bpf and the cgroup tree stay as they are, unlike `ip netns exec`).
pub fn enter_netns_on_exec(cmd: &mut Command, netns: &Path) -> std::io::Result<()> {
    let file = File::open(netns)?;
    // SAFETY: only setns (async-signal-safe) between fork and exec; the file stays open in the
    // closure until exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}

/// A client outside the node (see the module docs). Its processes are in no load-balanced
/// cgroup: whatever reaches the node from here is translated by the node's packet-level programs
/// or not at all.
pub struct ExternalClient {
    pub netns: Netns,
    /// The client's address.
    pub ip: String,
    /// The node's address on the link to this client (a NodePort address).
    pub node_ip: String,
    /// The node's interface towards this client.
    pub node_interface: String,
}

impl ExternalClient {
    /// Routes `cidr` (addresses that are not on the link, such as externalIPs or LoadBalancer
    /// IPs) through the node, inside the client's namespace.
    pub fn route_via_node(&self, cidr: &str) -> anyhow::Result<()> {
        self.netns.exec(&["ip", "route", "add", cidr, "via", &self.node_ip]).map(|_| ())
    }

    /// A command that runs inside the client's namespace.
    pub fn command(&self, program: &Path) -> anyhow::Result<Command> {
        let mut cmd = Command::new(program);
        enter_netns_on_exec(&mut cmd, &self.netns.path())?;
        Ok(cmd)
    }
}

impl Topology {
    /// Adds an external client named `name`, linked to the node by `ext0`, and lets the node
    /// forward between that link and its pods (inside the node namespace only).
    pub fn add_external_client(&self, name: &str) -> anyhow::Result<ExternalClient> {
        let netns = Netns::create(&format!("{}-{}-{name}", crate::PREFIX, self.id))?;
        let node_interface = "ext0";
        self.node.exec(&["ip", "link", "add", node_interface, "type", "veth", "peer", "name", "eth0", "netns", &netns.name])?;
        self.node.exec(&["ip", "addr", "add", "192.168.240.1/24", "dev", node_interface])?;
        self.node.exec(&["ip", "link", "set", node_interface, "up"])?;
        self.node.exec(&["sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
        netns.exec(&["ip", "addr", "add", "192.168.240.2/24", "dev", "eth0"])?;
        netns.exec(&["ip", "link", "set", "eth0", "up"])?;
        // A client host with a wide ephemeral range: with Linux's default one, its own connect()
        // slows down among tens of thousands of TIME_WAIT sockets (measured with no proxy at all:
        // 569 connections/s over 20,000, against 5,212/s with this range).
        netns.exec(&["sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65535"])?;
        Ok(ExternalClient {
            netns,
            ip: "192.168.240.2".into(),
            node_ip: "192.168.240.1".into(),
            node_interface: node_interface.into(),
        })
    }
}

/// The node's and the external client's IPv6 addresses on their link, after
/// [`Topology::enable_external_ipv6`].
pub const EXT_NODE_IP6: &str = "fd00:192:168:240::1";
pub const EXT_CLIENT_IP6: &str = "fd00:192:168:240::2";

impl Topology {
    /// Gives the link to `client` IPv6 addresses ([`EXT_NODE_IP6`] on the node's side,
    /// [`EXT_CLIENT_IP6`] on the client's) and lets the node forward IPv6 (inside its namespace).
    pub fn enable_external_ipv6(&self, client: &ExternalClient) -> anyhow::Result<()> {
        let node_side = format!("{EXT_NODE_IP6}/64");
        self.node.exec(&["ip", "-6", "addr", "add", &node_side, "dev", &client.node_interface, "nodad"])?;
        self.node.exec(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"])?;
        client.netns.exec(&["ip", "-6", "addr", "add", &format!("{EXT_CLIENT_IP6}/64"), "dev", "eth0", "nodad"])?;
        wait_ipv6_ready(&self.node)?;
        wait_ipv6_ready(&client.netns)
    }
}

impl Topology {
    /// Adds a pod named `name` on "another node": one namespace that is both that node and its
    /// pod (address 10.244.2.`host` on its loopback), reached from this node through its own link
    /// (`n2` 192.168.250.1/24 here, 192.168.250.2/24 there) by a route for 10.244.2.0/24. That
    /// node routes back only to `reachable` (CIDRs via this node): what it answers must be
    /// addressed to those. With [`Topology::enable_ipv6`] the same in IPv6 too: the pod has
    /// fd00:10:244:2::`host`, the link fd00:192:168:250::1 and ::2, and IPv6 CIDRs in `reachable`
    /// are routed back that way.
    pub fn add_remote_pod(&mut self, name: &str, host: u8, reachable: &[&str]) -> anyhow::Result<&Pod> {
        let netns = Netns::create(&format!("{}-{}-{name}", crate::PREFIX, self.id))?;
        let ip = format!("10.244.2.{host}");
        self.node.exec(&["ip", "link", "add", "n2", "type", "veth", "peer", "name", "eth0", "netns", &netns.name])?;
        self.node.exec(&["ip", "addr", "add", "192.168.250.1/24", "dev", "n2"])?;
        self.node.exec(&["ip", "link", "set", "n2", "up"])?;
        self.node.exec(&["ip", "route", "add", "10.244.2.0/24", "via", "192.168.250.2"])?;
        self.node.exec(&["sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
        netns.exec(&["ip", "addr", "add", "192.168.250.2/24", "dev", "eth0"])?;
        if self.ipv6 {
            netns.exec(&["sysctl", "-qw", "net.ipv6.conf.eth0.accept_dad=0"])?;
        }
        netns.exec(&["ip", "link", "set", "eth0", "up"])?;
        netns.exec(&["ip", "addr", "add", &format!("{ip}/32"), "dev", "lo"])?;
        let ip6 = if self.ipv6 {
            let ip6 = format!("fd00:10:244:2::{host}");
            self.node.exec(&["ip", "-6", "addr", "add", "fd00:192:168:250::1/64", "dev", "n2", "nodad"])?;
            self.node.exec(&["ip", "-6", "route", "add", "fd00:10:244:2::/64", "via", "fd00:192:168:250::2"])?;
            self.node.exec(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"])?;
            netns.exec(&["ip", "-6", "addr", "add", "fd00:192:168:250::2/64", "dev", "eth0", "nodad"])?;
            netns.exec(&["ip", "-6", "addr", "add", &format!("{ip6}/128"), "dev", "lo", "nodad"])?;
            wait_ipv6_ready(&netns)?;
            wait_ipv6_ready(&self.node)?;
            Some(ip6)
        } else {
            None
        };
        for cidr in reachable {
            // From the pod address, as from a pod whose only interface holds it (a UDP server
            // bound to 0.0.0.0 answers from the route's source).
            match (cidr.contains(':'), &ip6) {
                (false, _) => netns.exec(&["ip", "route", "add", cidr, "via", "192.168.250.1", "src", &ip])?,
                (true, Some(ip6)) => netns.exec(&["ip", "-6", "route", "add", cidr, "via", "fd00:192:168:250::1", "src", ip6])?,
                (true, None) => bail!("an IPv6 route back ({cidr}) needs Topology::enable_ipv6 first"),
            };
        }
        self.pods.push(Pod { name: name.to_owned(), ip, ip6, netns });
        Ok(self.pods.last().expect("just pushed"))
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        // Pods first (their veths go with them), then the node; the cgroup kills stragglers.
        self.pods.clear();
    }
}
