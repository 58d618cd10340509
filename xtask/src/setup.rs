//! `cargo xtask setup`: checks the machine and installs what is missing, idempotently.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context};

use crate::{run, step};

pub const DEBIAN_CARGO: &str = "/usr/bin/cargo";
pub const DEBIAN_RUSTC: &str = "/usr/bin/rustc";

/// Debian packages: the eBPF toolchain (rustc-web with its std sources, LLVM 22 for
/// bpf-linker) and the tools the tests drive (iproute2 for namespaces, util-linux for nsenter,
/// openssl for the test control plane's certificates and keys, iptables for the tests that
/// compare the packet path with the kernel's own NAT).
const PACKAGES: &[&str] = &[
    "rustc-web",
    "cargo-web",
    "rust-web-src",
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "iproute2",
    "util-linux",
    "openssl",
    "iptables",
    // The benchmark: kube-proxy's nftables mode runs `nft`; `ab` cross-checks the connection
    // rate; the report's plots are drawn with DejaVu Sans.
    "nftables",
    "apache2-utils",
    // The long-stream window.
    "iperf3",
    "fonts-dejavu-core",
];

/// Debian packages for `cargo xtask vm-test`: QEMU (TCG) boots the second kernel, kmod's depmod
/// orders its modules; the kernel itself is downloaded with `apt-get download` and extracted,
/// never installed.
const VM_PACKAGES: &[&str] = &["qemu-system-x86", "kmod"];

/// Debian packages for `cargo xtask cluster up --node`: the container runtime and its pieces
/// (containerd 1.6, runc, the CNI plugins in /usr/lib/cni), buildah, which builds the node's
/// images locally since no registry is reachable, and debootstrap, which makes their Debian base.
const NODE_PACKAGES: &[&str] = &["containerd", "runc", "containernetworking-plugins", "buildah", "debootstrap"];

/// Debian packages the tests run as real protocol peers: `sipp` (sip-tester) places SIP calls
/// over unconnected UDP sockets through a ClusterIP (tests/tests/sip.rs).
const TEST_PEER_PACKAGES: &[&str] = &["sip-tester"];

const BPF_LINKER_VERSION: &str = "0.13";

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

fn bpf_linker_ok() -> bool {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    Command::new(Path::new(&home).join(".cargo/bin/bpf-linker"))
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains(&format!("bpf-linker {BPF_LINKER_VERSION}")))
        .unwrap_or(false)
}

fn mounted(fs_type: &str) -> bool {
    std::fs::read_to_string("/proc/mounts")
        .unwrap_or_default()
        .lines()
        .any(|line| line.split_whitespace().nth(2) == Some(fs_type))
}

/// Makes the machine ready, installing only what is missing.
pub fn ensure() -> anyhow::Result<()> {
    ensure_build_tools()?;
    ensure_runtime()
}

/// What running the programs and tests needs on top of building them: cgroup v2, bpffs, and the
/// protocol peers the tests drive.
pub fn ensure_runtime() -> anyhow::Result<()> {
    if !mounted("cgroup2") {
        bail!("no cgroup v2 filesystem is mounted (/proc/mounts has no cgroup2 line); the socket-level datapath needs one");
    }
    if !mounted("bpf") {
        step("mounting bpffs at /sys/fs/bpf");
        run(Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]))
            .context("bpffs is not mounted and could not be mounted at /sys/fs/bpf")?;
    }
    install_missing(TEST_PEER_PACKAGES).context("installing the tests' protocol peers (sipp, from sip-tester)")
}

/// What `cargo xtask build` needs, and nothing it would not: deploy/Containerfile runs it in an
/// image build, where bpffs cannot be mounted and no cgroup v2 need be.
pub fn ensure_build_tools() -> anyhow::Result<()> {
    if !is_root() {
        bail!("run as root: installing packages, loading eBPF programs and creating namespaces need it");
    }
    install_missing(PACKAGES)?;
    for tool in [DEBIAN_CARGO, DEBIAN_RUSTC] {
        if !Path::new(tool).exists() {
            bail!("{tool} is missing although cargo-web/rustc-web are installed");
        }
    }

    if bpf_linker_ok() {
        eprintln!("setup: bpf-linker {BPF_LINKER_VERSION} present");
    } else {
        step(&format!("installing bpf-linker {BPF_LINKER_VERSION} (built against LLVM 22; takes a few minutes)"));
        run(Command::new("cargo")
            .env("LLVM_PREFIX", "/usr/lib/llvm-22")
            .args(["install", "bpf-linker", "--version", &format!("^{BPF_LINKER_VERSION}")])
            .args(["--no-default-features", "--features", "llvm-22"]))?;
    }
    Ok(())
}

/// Installs those of `packages` that are missing, saying which.
fn install_missing(packages: &[&str]) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        eprintln!("setup: Debian packages present ({})", packages.join(", "));
        return Ok(());
    }
    step(&format!("installing Debian packages: {}", missing.join(" ")));
    run(Command::new("apt-get").arg("update").arg("-q"))?;
    run(Command::new("apt-get")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&missing))
}

/// What `cargo xtask vm-test` needs beyond `ensure`: QEMU. Idempotent.
pub fn ensure_vm_tools() -> anyhow::Result<()> {
    install_missing(VM_PACKAGES)
}

/// What `cargo xtask cluster up --node` needs beyond `ensure`. Idempotent. The Debian package
/// starts no containerd here (no systemd); the node runs its own with its own config and socket.
pub fn ensure_node_tools() -> anyhow::Result<()> {
    install_missing(NODE_PACKAGES)
}

/// Removes namespaces, cgroups and bpffs directories left by an earlier test run that was killed
/// before its guards ran. Only names with the tests' prefix are touched, and of those only the
/// ones whose test process is gone ([`e2e::owner_alive`]).
pub fn sweep_leftovers() {
    let prefix = format!("{}-", e2e::PREFIX);
    // Nodes first: their pods, containerd and kubelet die, the kernel settings kubelet changed
    // are restored, before their namespaces and directories go below.
    e2e::node::sweep();
    if let Ok(entries) = std::fs::read_dir("/run/netns") {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(&prefix) && !e2e::owner_alive(&name) {
                let _ = Command::new("ip").args(["netns", "delete", &name]).status();
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir("/sys/fs/bpf") {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(&prefix) && !e2e::owner_alive(&name) {
                let _ = Command::new(crate::workspace_root().join("target/release/ebpf-proxy"))
                    .args(["cleanup", "--bpffs"])
                    .arg(entry.path())
                    .output();
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(&prefix) && !e2e::owner_alive(&name) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    if let Ok(root) = e2e::topology::cgroup2_root() {
        if let Ok(entries) = std::fs::read_dir(&root) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with(&prefix) && !e2e::owner_alive(&name) {
                    drop(e2e::topology::Cgroup { path: entry.path() });
                }
            }
        }
    }
}
