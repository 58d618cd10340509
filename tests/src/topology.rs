//! Namespaces as pods on a node, and a cgroup for the pods' processes.
//!
//! ```text
//!   pod netns (eth0 10.244.1.N/24) ──veth── node netns (br0 10.244.1.1/24) ──veth── pod netns
//! ```
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

/// A pod: a namespace with one address on the node's bridge.
pub struct Pod {
    pub name: String,
    pub ip: String,
    pub netns: Netns,
}

/// A node namespace with a bridge, its pods, and the cgroup whose sockets are load balanced.
pub struct Topology {
    pub id: String,
    pub pods: Vec<Pod>,
    pub cgroup: Cgroup,
    pub node: Netns,
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
        Ok(Self { id, pods: Vec::new(), cgroup, node })
    }

    /// Adds a pod named `name` at 10.244.1.`host`.
    pub fn add_pod(&mut self, name: &str, host: u8) -> anyhow::Result<&Pod> {
        let netns = Netns::create(&format!("{}-{}-{name}", crate::PREFIX, self.id))?;
        let ip = format!("10.244.1.{host}");
        let host_side = format!("v{host}");
        self.node.exec(&["ip", "link", "add", &host_side, "type", "veth", "peer", "name", "eth0", "netns", &netns.name])?;
        self.node.exec(&["ip", "link", "set", &host_side, "master", "br0", "up"])?;
        netns.exec(&["ip", "addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
        netns.exec(&["ip", "link", "set", "eth0", "up"])?;
        netns.exec(&["ip", "route", "add", "default", "via", "10.244.1.1"])?;
        self.pods.push(Pod { name: name.to_owned(), ip, netns });
        Ok(self.pods.last().expect("just pushed"))
    }

    pub fn pod(&self, name: &str) -> &Pod {
        self.pods.iter().find(|p| p.name == name).unwrap_or_else(|| panic!("no pod {name}"))
    }

    /// A command that runs inside `pod`'s network namespace and inside this topology's cgroup,
    /// so its sockets see the agent's socket-level load balancing. Uses setns(2) directly, since
    /// `ip netns exec` would remount /sys and hide the cgroup and bpffs mounts.
    pub fn command_in(&self, pod: &str, program: &Path) -> anyhow::Result<Command> {
        let netns = File::open(self.pod(pod).netns.path())?;
        let procs = fs::OpenOptions::new().write(true).open(self.cgroup.path.join("cgroup.procs"))?;
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

impl Drop for Topology {
    fn drop(&mut self) {
        // Pods first (their veths go with them), then the node; the cgroup kills stragglers.
        self.pods.clear();
    }
}
