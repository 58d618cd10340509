//! Reusable pieces for end-to-end tests, the demo and (later) benchmarks.
//!
//! - [`topology`]: a node as a network namespace with a bridge, pods as namespaces on it, and a
//!   cgroup v2 directory for the processes that get socket-level load balancing.
//! - [`probe`]: the `epx-probe` traffic generator (servers that answer with their name, clients
//!   that count answers and failed connections), run inside pods.
//! - [`agent`]: runs `ebpf-proxy` against a manifest file with its own bpffs and cgroup.
//! - [`kube_scenario`]: the same on the real kube-apiserver, with the agent watching the API.
//! - [`scenario`]: a client, two backends behind a Service, and the agent, ready to use.
//! - [`control_plane`]: real etcd + kube-apiserver (from `cargo xtask peers`, `$EPX_PEERS_DIR`)
//!   in a pod of a topology, reachable from the host's loopback, with blocking apply/delete.
//! - [`node`]: a real single-node Kubernetes on that control plane: kube-controller-manager,
//!   kube-scheduler, kubelet on containerd/runc/CNI, locally built images, CoreDNS as kube-dns.
//! - [`daemonset`]: the agent's DaemonSet from `deploy/` on a [`node`]: the image from
//!   deploy/Containerfile's runtime stage, the manifests with one documented substitution.
//! - [`debian_image`]: the `debian:<suite>` base image made with debootstrap, under its official name.
//! - [`dns`]: a minimal DNS client and resolv.conf reader (`epx-probe dns` in pods).
//! - [`kube_proxy`]: the real upstream kube-proxy (iptables or nftables mode) in a node namespace.
//! - [`audit`]: kube-apiserver's audit log, to count requests by who sent them and how.
//! - [`metrics`]: Prometheus `/metrics` text, parsed.
//! - [`forward`]: a TCP forwarder from the host's loopback into a namespace, which can black-hole.
//! - [`packet`]: hand-built Ethernet/IPv4/TCP/UDP frames and a checksum-verifying reader.
//! - [`bpf_test_run`]: the built TC programs run on such frames with `BPF_PROG_TEST_RUN`.
//! - [`flood`]: hostile frames (spoofed SYNs, malformed headers, spoofed RSTs) sent into a
//!   namespace's interface with an AF_PACKET socket.
//!
//! Everything is created with unique names and removed on drop, also when a test fails. Traffic
//! never leaves the namespaces created here.

pub mod agent;
pub mod audit;
pub mod bpf_test_run;
pub mod control_plane;
pub mod daemonset;
pub mod debian_image;
pub mod dns;
pub mod flood;
pub mod forward;
pub mod kube_proxy;
pub mod probe;
pub mod kube_scenario;
pub mod metrics;
pub mod node;
pub mod packet;
pub mod packet6;
pub mod scenario;
pub mod topology;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

/// Prefix of every namespace, cgroup and bpffs directory the tests create.
pub const PREFIX: &str = "epxt";

/// A short id unique to this process and call: namespaces and cgroups are named after it.
/// `<pid>p<n>`: a sweep after a killed run can tell whose a leftover is ([`owner_alive`]).
pub fn unique_id() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{}p{n}", std::process::id())
}

/// Whether the resource named `name` (`epxt-<id>...`, `<id>` from [`unique_id`]) belongs to a
/// process still running: a sweep leaves those alone, so one run never tears down another's
/// namespaces (two developers, or a test binary run by hand during `cargo xtask test`). A name
/// without an id of that form is a leftover.
pub fn owner_alive(name: &str) -> bool {
    let Some(rest) = name.strip_prefix(PREFIX).and_then(|r| r.strip_prefix('-')) else { return false };
    let id = rest.split('-').next().unwrap_or_default();
    let Some((pid, n)) = id.split_once('p') else { return false };
    let (Ok(pid), Ok(_)) = (pid.parse::<u32>(), n.parse::<u32>()) else { return false };
    pid != 0 && std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Where `ebpf-proxy` and `epx-probe` are: `$EPX_BIN_DIR`, else `target/release`.
pub fn bin_dir() -> PathBuf {
    std::env::var_os("EPX_BIN_DIR").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release")
    })
}

pub fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(path.exists(), "{} is missing: build with `cargo xtask build` (or run `cargo xtask test`)", path.display());
    path
}

/// The eBPF object with changed code that `cargo xtask build` leaves for the upgrade test:
/// `$EPX_EBPF_UPGRADE_OBJECT`, else `target/bpf/proxy-ebpf-upgrade.o`.
pub fn upgrade_object() -> PathBuf {
    let path = std::env::var_os("EPX_EBPF_UPGRADE_OBJECT").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bpf/proxy-ebpf-upgrade.o")
    });
    assert!(path.exists(), "{} is missing: build with `cargo xtask build`", path.display());
    path
}

/// Panics with a clear message unless running as root (namespaces, cgroups and bpffs need it).
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert!(euid == 0, "end-to-end tests need root (namespaces, cgroups, bpffs): run `sudo cargo xtask test`");
}

/// The shared libraries and dynamic loader `binary` needs, as `ldd` resolves them on this host
/// (none for a static binary): what an image or a VM's root file system must hold besides it.
pub fn shared_libraries(binary: &std::path::Path) -> anyhow::Result<Vec<PathBuf>> {
    use anyhow::Context;
    let output = std::process::Command::new("ldd").arg(binary).output().context("running ldd")?;
    if !output.status.success() {
        // A static binary: ldd says "not a dynamic executable" and fails.
        return Ok(Vec::new());
    }
    let mut libraries = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines().map(str::trim) {
        let path = match line.split_once("=> ") {
            Some((name, _)) if line.contains("not found") => anyhow::bail!("{}: {name} not found by ldd", binary.display()),
            Some((_, rest)) => rest.split(" (").next().unwrap_or(""),
            None => line.split(" (").next().unwrap_or(""),
        };
        if path.starts_with('/') {
            libraries.push(PathBuf::from(path));
        }
    }
    Ok(libraries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sweep_knows_the_resources_of_running_tests_from_leftovers() {
        let mine = format!("{PREFIX}-{}-node", unique_id());
        assert!(owner_alive(&mine), "{mine}");
        assert!(owner_alive(&format!("{PREFIX}-{}", unique_id())));
        // pid_max is at most 2^22: no process has this pid.
        assert!(!owner_alive(&format!("{PREFIX}-99999999p0-node")));
        for leftover in ["epxt-123450-node", "epxt-mem0", "epxt-", "other-1p0", "epxt-p1", "epxt-0p1"] {
            assert!(!owner_alive(leftover), "{leftover}");
        }
    }
}
