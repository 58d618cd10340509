//! `cargo xtask vm-test`: the end-to-end tests on a second kernel, in a QEMU VM (TCG; no KVM).
//!
//! The host runs the suite on its own kernel; this boots Debian bookworm's cloud kernel (6.1,
//! which has no tcx, so the packet programs take the clsact path) with an initramfs built here:
//! `tests/src/bin/epx-vm-init.rs` as /init, `ebpf-proxy`, `epx-probe`, the chosen e2e test
//! binaries, `ip` and `sysctl`, every shared library they load, the eBPF objects, and the kernel
//! modules the tests need. The init prints one line per test binary and a closing line on the
//! serial console, which is streamed here and to `target/vm/RELEASE/console.log`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::{ebpf_object, run, step, upgrade_object, workspace_root};

/// Test binaries that need no kube-apiserver, run when none are named.
pub const DEFAULT_TESTS: &[&str] = &[
    "socket_lb",
    "agent_restart",
    "stale_udp",
    "affinity",
    "map_full",
    "service_types",
    "tc_packets",
    "tc_packets6",
    "nodeport_external",
    "ipv6",
    "fragments",
    "vm_kernel_features",
];

/// What the tests need that Debian's cloud kernel builds as modules: veth pairs and the node's
/// bridge, the clsact qdisc (in sch_ingress) and the BPF classifier that the packet programs
/// attach through where the kernel has no tcx, and the socket-diag handlers the agent lists and
/// aborts sockets with. A host's kernel loads these on demand through modprobe; the VM has no
/// modprobe, so its init loads them at boot. Their dependencies come from modules.dep.
const MODULES: &[&str] = &["veth", "bridge", "sch_ingress", "cls_bpf", "tcp_diag", "udp_diag"];

/// The metapackage whose dependency is the kernel under test (Debian 12: the 6.1 series).
const KERNEL_METAPACKAGE: &str = "linux-image-cloud-amd64";

/// The kernel series `cargo xtask test` and `vm-test` boot by default.
pub const DEFAULT_KERNEL: &str = "6.1";

/// The whole VM run (boot, every binary, power-off) at most; measured ≈ 155 s for the default set.
pub const DEFAULT_TIMEOUT_SECS: u64 = 1200;

/// One test binary's run at most this long inside the VM (TCG is several times slower than the host).
const PER_BINARY_TIMEOUT_SECS: u64 = 300;

/// Programs the tests run by name, found on the host's PATH and placed in the VM's /usr/sbin.
const TOOLS: &[&str] = &["ip", "sysctl", "tc"];

pub struct Options {
    pub kernel: String,
    pub tests: Vec<String>,
    pub args: Vec<String>,
    pub timeout: Duration,
}

/// What the VM reported.
pub struct Report {
    pub release: String,
    /// Summed over the test binaries' `test result:` lines; a binary that failed without a
    /// failed test (a crash, a timeout) and a VM that did not report count as one failure each.
    pub passed: u64,
    pub failed: u64,
    /// One `epx-vm: PASS|FAIL ...` line per binary.
    pub binaries: Vec<String>,
    /// The init's closing line was seen and no binary failed.
    pub ok: bool,
    pub problem: Option<String>,
    pub boot: Option<Duration>,
    pub total: Duration,
    pub log: PathBuf,
}

struct Kernel {
    vmlinuz: PathBuf,
    /// `lib/modules/RELEASE` of the extracted package.
    modules: PathBuf,
    release: String,
}

fn cache_dir() -> PathBuf {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    PathBuf::from(home).join(".cache/ebpf-proxy/vm")
}

/// The versioned image package the metapackage depends on (`linux-image-6.1.0-NN-cloud-amd64`),
/// by the current package lists.
fn image_package() -> anyhow::Result<Option<String>> {
    let output = Command::new("apt-cache").args(["depends", KERNEL_METAPACKAGE]).output().context("running apt-cache")?;
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Depends: ").filter(|p| p.starts_with("linux-image-")).map(str::to_owned)))
}

/// Downloads `package` and extracts it to `dir`; never installs it.
fn download(package: &str, dir: &Path) -> anyhow::Result<()> {
    step(&format!("downloading {package} into {} (extracted, not installed)", cache_dir().display()));
    let download = cache_dir().join("download");
    let _ = fs::remove_dir_all(&download);
    fs::create_dir_all(&download)?;
    run(Command::new("apt-get").current_dir(&download).args(["download", "-q", package]))?;
    let deb = fs::read_dir(&download)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .with_context(|| format!("apt-get download left no .deb in {}", download.display()))?;
    let extracted = cache_dir().join(format!("{package}.partial"));
    let _ = fs::remove_dir_all(&extracted);
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&extracted))?;
    fs::rename(&extracted, dir)?;
    fs::remove_dir_all(&download)?;
    Ok(())
}

/// The kernel `version` (a series such as "6.1") from the cache, downloaded the first time.
fn kernel(version: &str) -> anyhow::Result<Kernel> {
    let cached = image_package()?.map(|p| (cache_dir().join(&p), p)).filter(|(dir, _)| dir.join("boot").is_dir());
    let (dir, package) = match cached {
        Some(found) => found,
        None => {
            // Lists older than the mirror name a build it no longer has: refresh them first.
            step("apt-get update (before downloading the VM kernel)");
            run(Command::new("apt-get").args(["update", "-q"]))?;
            let package = image_package()?
                .with_context(|| format!("apt-cache knows no {KERNEL_METAPACKAGE}: this needs Debian 12's package lists"))?;
            (cache_dir().join(&package), package)
        }
    };
    if !package.starts_with(&format!("linux-image-{version}.")) {
        bail!("--kernel {version}: this machine's {KERNEL_METAPACKAGE} is {package}; only that kernel can be tested here");
    }
    if !dir.join("boot").is_dir() {
        download(&package, &dir)?;
    }
    let vmlinuz = fs::read_dir(dir.join("boot"))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-")))
        .with_context(|| format!("no boot/vmlinuz-* in {}", dir.display()))?;
    let release = vmlinuz.file_name().expect("found by name").to_string_lossy()["vmlinuz-".len()..].to_owned();
    let modules = dir.join("lib/modules").join(&release);
    if !modules.join("modules.dep").exists() {
        // The package leaves modules.dep to the installing system's depmod.
        run(Command::new("depmod").arg("-b").arg(&dir).arg(&release))?;
    }
    Ok(Kernel { vmlinuz, modules, release })
}

fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.split(".ko").next().unwrap_or(file).replace('-', "_")
}

/// The module files (relative to `lib/modules/RELEASE`) for `wanted`, each after its
/// dependencies; modules built into the kernel are left out.
fn module_files(modules: &Path, wanted: &[&str]) -> anyhow::Result<Vec<String>> {
    let dep_file = modules.join("modules.dep");
    let deps_text = fs::read_to_string(&dep_file).with_context(|| format!("reading {}", dep_file.display()))?;
    let deps: BTreeMap<String, Vec<String>> = deps_text
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(module, deps)| (module.to_owned(), deps.split_whitespace().map(str::to_owned).collect()))
        .collect();
    let by_name: BTreeMap<String, &String> = deps.keys().map(|k| (module_name(k), k)).collect();
    let builtin: BTreeSet<String> = fs::read_to_string(modules.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .map(module_name)
        .collect();

    fn visit(module: &str, deps: &BTreeMap<String, Vec<String>>, order: &mut Vec<String>) {
        if order.iter().any(|m| m == module) {
            return;
        }
        for dep in deps.get(module).into_iter().flatten() {
            visit(dep, deps, order);
        }
        order.push(module.to_owned());
    }
    let mut order = Vec::new();
    for name in wanted {
        match by_name.get(*name) {
            Some(path) => visit(path, &deps, &mut order),
            None if builtin.contains(*name) => {}
            None => bail!("kernel module {name} is neither built in nor in {}", dep_file.display()),
        }
    }
    if let Some(compressed) = order.iter().find(|m| !m.ends_with(".ko")) {
        bail!("{compressed} is compressed; the VM's init loads only plain .ko files");
    }
    Ok(order)
}

enum Entry {
    Dir,
    File { data: Vec<u8>, mode: u32 },
    Symlink(String),
    CharDevice(u32, u32),
}

/// The initramfs's contents, by path without the leading `/`.
#[derive(Default)]
struct Initramfs {
    entries: BTreeMap<String, Entry>,
}

impl Initramfs {
    fn add(&mut self, path: &str, entry: Entry) {
        let path = path.trim_start_matches('/');
        let mut parent = String::new();
        for part in path.split('/').rev().skip(1).collect::<Vec<_>>().into_iter().rev() {
            parent = if parent.is_empty() { part.to_owned() } else { format!("{parent}/{part}") };
            self.entries.entry(parent.clone()).or_insert(Entry::Dir);
        }
        self.entries.insert(path.to_owned(), entry);
    }

    fn text(&mut self, path: &str, text: &str) {
        self.add(path, Entry::File { data: text.as_bytes().to_vec(), mode: 0o644 });
    }

    fn copy(&mut self, dest: &str, source: &Path) -> anyhow::Result<()> {
        let data = fs::read(source).with_context(|| format!("reading {}", source.display()))?;
        let mode = fs::metadata(source)?.permissions().mode() & 0o777;
        self.add(dest, Entry::File { data, mode });
        Ok(())
    }

    /// An executable and, at their host paths, the libraries it loads.
    fn binary(&mut self, dest: &str, source: &Path) -> anyhow::Result<()> {
        self.copy(dest, source)?;
        for library in e2e::shared_libraries(source)? {
            let key = library.to_string_lossy().trim_start_matches('/').to_owned();
            if !self.entries.contains_key(&key) {
                self.copy(&key, &library)?;
            }
        }
        Ok(())
    }

    /// Writes a newc ("070701") cpio archive; parents sort before their children.
    fn write(&self, out: &Path) -> anyhow::Result<()> {
        let mut file = std::io::BufWriter::new(fs::File::create(out).with_context(|| format!("creating {}", out.display()))?);
        let pad = |file: &mut std::io::BufWriter<fs::File>, len: usize| file.write_all(&[0; 3][..(4 - len % 4) % 4]);
        let mut write_entry = |ino: usize, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]| -> std::io::Result<()> {
            let fields = [ino, mode as usize, 0, 0, 1, 0, data.len(), 0, 0, rdev.0 as usize, rdev.1 as usize, name.len() + 1, 0];
            let mut header = String::from("070701");
            for field in fields {
                header.push_str(&format!("{field:08x}"));
            }
            file.write_all(header.as_bytes())?;
            file.write_all(name.as_bytes())?;
            file.write_all(&[0])?;
            pad(&mut file, header.len() + name.len() + 1)?;
            file.write_all(data)?;
            pad(&mut file, data.len())
        };
        for (ino, (name, entry)) in self.entries.iter().enumerate() {
            match entry {
                Entry::Dir => write_entry(ino + 1, name, 0o040755, (0, 0), &[])?,
                Entry::File { data, mode } => write_entry(ino + 1, name, 0o100000 | mode, (0, 0), data)?,
                Entry::Symlink(target) => write_entry(ino + 1, name, 0o120777, (0, 0), target.as_bytes())?,
                Entry::CharDevice(major, minor) => write_entry(ino + 1, name, 0o020600, (*major, *minor), &[])?,
            }
        }
        write_entry(0, "TRAILER!!!", 0, (0, 0), &[])?;
        file.flush()?;
        Ok(())
    }
}

/// The e2e test binaries by name, built with `cargo test --no-run` for the same packages as
/// `cargo xtask test` (so that after it nothing is rebuilt).
fn test_binaries() -> anyhow::Result<BTreeMap<String, PathBuf>> {
    step("building the end-to-end test binaries");
    let output = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(workspace_root())
        .env("EPX_EBPF_OBJECT", ebpf_object())
        .args(["test", "--release", "--package", "proxy-user", "--package", "e2e", "--package", "xtask", "--tests"])
        .args(["--no-run", "--message-format=json"])
        .stderr(Stdio::inherit())
        .output()
        .context("spawning cargo test --no-run")?;
    if !output.status.success() {
        bail!("cargo test --no-run failed with {}", output.status);
    }
    // One JSON object a line; the target's "name" is the first "name" key of an artifact line.
    let string_after = |line: &str, key: &str| -> Option<String> {
        let rest = line[line.find(key)? + key.len()..].strip_prefix('"')?;
        let value = &rest[..rest.find('"')?];
        (!value.contains('\\')).then(|| value.to_owned())
    };
    let e2e_manifest = format!(r#""manifest_path":"{}""#, workspace_root().join("tests/Cargo.toml").display());
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| l.contains(r#""reason":"compiler-artifact""#) && l.contains(r#""kind":["test"]"#))
        .filter(|l| l.contains(&e2e_manifest))
        .filter_map(|l| Some((string_after(l, r#""name":"#)?, PathBuf::from(string_after(l, r#""executable":"#)?))))
        .collect())
}

fn host_tool(name: &str) -> anyhow::Result<PathBuf> {
    std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .chain(["/usr/sbin", "/sbin"])
        .map(|dir| Path::new(dir).join(name))
        .find(|p| p.is_file())
        .with_context(|| format!("{name} is not installed on this host (cargo xtask setup installs it)"))
}

fn build_initramfs(kernel: &Kernel, tests: &[(String, PathBuf)], args: &[String], out: &Path) -> anyhow::Result<()> {
    let release_dir = workspace_root().join("target/release");
    let mut fs = Initramfs::default();
    fs.add("dev/console", Entry::CharDevice(5, 1));
    for dir in ["proc", "sys", "run", "tmp", "root", "var/lib"] {
        fs.add(dir, Entry::Dir);
    }
    fs.add("var/run", Entry::Symlink("../run".into()));
    fs.text("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n");
    fs.text("etc/group", "root:x:0:\n");
    fs.text("etc/hosts", "127.0.0.1 localhost\n::1 localhost\n");
    fs.text("etc/hostname", "epx-vm\n");
    fs.binary("init", &release_dir.join("epx-vm-init"))?;
    for bin in ["ebpf-proxy", "epx-probe"] {
        fs.binary(&format!("epx/bin/{bin}"), &release_dir.join(bin))?;
    }
    for tool in TOOLS {
        fs.binary(&format!("usr/sbin/{tool}"), &host_tool(tool)?)?;
    }
    fs.copy("epx/bpf/proxy-ebpf", &ebpf_object())?;
    fs.copy("epx/bpf/proxy-ebpf-upgrade.o", &upgrade_object())?;
    let mut config = String::new();
    for (key, value) in [
        ("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        ("HOME", "/root"),
        ("RUST_BACKTRACE", "1"),
        ("EPX_BIN_DIR", "/epx/bin"),
        ("EPX_EBPF_OBJECT", "/epx/bpf/proxy-ebpf"),
        ("EPX_EBPF_UPGRADE_OBJECT", "/epx/bpf/proxy-ebpf-upgrade.o"),
    ] {
        config.push_str(&format!("env {key}={value}\n"));
    }
    config.push_str(&format!("timeout {PER_BINARY_TIMEOUT_SECS}\n"));
    for module in module_files(&kernel.modules, MODULES)? {
        let dest = format!("lib/modules/{}/{module}", kernel.release);
        fs.copy(&dest, &kernel.modules.join(&module))?;
        config.push_str(&format!("module /{dest}\n"));
    }
    for (name, path) in tests {
        fs.binary(&format!("epx/tests/{name}"), path)?;
        config.push_str(&format!("test {name}\n"));
    }
    for arg in args {
        if arg.contains('\n') {
            bail!("test argument {arg:?} contains a newline");
        }
        config.push_str(&format!("arg {arg}\n"));
    }
    fs.text("etc/epx-vm/config", &config);
    fs.write(out)
}

/// Boots the VM and follows its console until the init's closing line, power-off, or `timeout`.
fn boot(kernel: &Kernel, initramfs: &Path, log_path: &Path, timeout: Duration) -> anyhow::Result<Report> {
    step(&format!("booting {} in QEMU (TCG, 2 vCPUs, 1 GiB); console log: {}", kernel.release, log_path.display()));
    let start = Instant::now();
    let mut child = Command::new("qemu-system-x86_64")
        .args(["-machine", "accel=tcg", "-m", "1024", "-smp", "2", "-nographic", "-no-reboot", "-nic", "none"])
        .arg("-kernel")
        .arg(&kernel.vmlinuz)
        .arg("-initrd")
        .arg(initramfs)
        .args(["-append", "console=ttyS0 panic=-1 loglevel=4"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .context("spawning qemu-system-x86_64 (cargo xtask setup installs qemu-system-x86)")?;
    let stdout = child.stdout.take().context("qemu stdout")?;
    let (lines_tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut buf = Vec::new();
        while reader.read_until(b'\n', &mut buf).map(|n| n > 0).unwrap_or(false) {
            let line = String::from_utf8_lossy(&buf).trim_end_matches(['\r', '\n']).to_owned();
            buf.clear();
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut log = fs::File::create(log_path).with_context(|| format!("creating {}", log_path.display()))?;
    let mut report = Report {
        release: kernel.release.clone(),
        passed: 0,
        failed: 0,
        binaries: Vec::new(),
        ok: false,
        problem: None,
        boot: None,
        total: Duration::ZERO,
        log: log_path.to_owned(),
    };
    let mut result_seen = false;
    let mut failed_before_binary = 0;
    loop {
        let left = timeout.saturating_sub(start.elapsed());
        match lines.recv_timeout(left) {
            Ok(line) => {
                println!("{line}");
                writeln!(log, "{line}")?;
                if let Some((passed, failed)) = crate::result_counts(&line) {
                    report.passed += passed;
                    report.failed += failed;
                }
                // The init's lines; the first may follow the firmware's escape codes.
                let init = line.find("epx-vm: ").map_or("", |at| &line[at + "epx-vm: ".len()..]);
                if init.starts_with("kernel ") {
                    report.boot = Some(start.elapsed());
                } else if init.starts_with("RUN ") {
                    failed_before_binary = report.failed;
                } else if init.starts_with("PASS ") || init.starts_with("FAIL ") {
                    if init.starts_with("FAIL ") && report.failed == failed_before_binary {
                        report.failed += 1;
                    }
                    report.binaries.push(init.to_owned());
                } else if init.starts_with("RESULT ") {
                    result_seen = true;
                    report.ok = init.ends_with(" binaries_failed=0");
                } else if let Some(error) = init.strip_prefix("ERROR ") {
                    report.problem = Some(format!("the VM's init failed: {error}"));
                } else if line.contains("Kernel panic") && report.problem.is_none() {
                    report.problem = Some(format!("the VM kernel panicked: {line}"));
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                report.problem = Some(format!("the VM did not finish within {} s; killed", timeout.as_secs()));
                break;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let status = child.wait()?;
    report.total = start.elapsed();
    if !result_seen && report.problem.is_none() {
        report.problem = Some(format!("QEMU ended ({status}) before the VM reported a result"));
    }
    if report.problem.is_some() {
        report.ok = false;
        report.failed += 1;
    }
    Ok(report)
}

/// Builds the initramfs for `options` and runs the tests in the VM. `crate::build()` must have run.
pub fn run_tests(options: &Options) -> anyhow::Result<Report> {
    crate::setup::ensure_vm_tools()?;
    let kernel = kernel(&options.kernel)?;
    let built = test_binaries()?;
    let names: Vec<String> =
        if options.tests.is_empty() { DEFAULT_TESTS.iter().map(|s| s.to_string()).collect() } else { options.tests.clone() };
    let mut tests = Vec::new();
    for name in names {
        let path = built.get(&name).with_context(|| {
            format!("no e2e test binary {name:?}; there are: {}", built.keys().cloned().collect::<Vec<_>>().join(", "))
        })?;
        tests.push((name, path.clone()));
    }
    let dir = workspace_root().join("target/vm").join(&kernel.release);
    fs::create_dir_all(&dir)?;
    let initramfs = dir.join("initramfs.cpio");
    step(&format!("assembling {}", initramfs.display()));
    build_initramfs(&kernel, &tests, &options.args, &initramfs)?;
    boot(&kernel, &initramfs, &dir.join("console.log"), options.timeout)
}

/// Prints the per-binary lines, boot and total time, and any problem.
pub fn print_summary(report: &Report) {
    println!("\nkernel {} (VM):", report.release);
    for line in &report.binaries {
        println!("  {line}");
    }
    if let Some(boot) = report.boot {
        println!("  booted to init in {:.1} s; whole VM run {:.1} s", boot.as_secs_f64(), report.total.as_secs_f64());
    }
    if let Some(problem) = &report.problem {
        println!("  {problem} (console log: {})", report.log.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_names_ignore_directories_suffixes_and_dashes() {
        assert_eq!(module_name("kernel/net/sched/sch_ingress.ko"), "sch_ingress");
        assert_eq!(module_name("kernel/drivers/net/veth.ko.xz"), "veth");
        assert_eq!(module_name("kernel/net/802/nf-conntrack.ko"), "nf_conntrack");
    }

    #[test]
    fn modules_come_after_their_dependencies_and_built_ins_are_skipped() {
        let dir = std::env::temp_dir().join(format!("epx-vm-modules-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("modules.dep"),
            "kernel/net/bridge/bridge.ko: kernel/net/802/stp.ko kernel/net/llc/llc.ko\n\
             kernel/net/802/stp.ko: kernel/net/llc/llc.ko\nkernel/net/llc/llc.ko:\nkernel/drivers/net/veth.ko:\n",
        )
        .unwrap();
        fs::write(dir.join("modules.builtin"), "kernel/net/sched/cls_bpf.ko\n").unwrap();
        let order = module_files(&dir, &["bridge", "veth", "cls_bpf"]).unwrap();
        let missing = module_files(&dir, &["sch_ingress"]).unwrap_err().to_string();
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(order, ["kernel/net/llc/llc.ko", "kernel/net/802/stp.ko", "kernel/net/bridge/bridge.ko", "kernel/drivers/net/veth.ko"]);
        assert!(missing.contains("sch_ingress"), "{missing}");
    }

    #[test]
    fn the_cpio_archive_is_newc_with_parents_first_and_a_trailer() {
        let mut fs = Initramfs::default();
        fs.text("etc/epx-vm/config", "test a\n");
        let path = std::env::temp_dir().join(format!("epx-vm-{}.cpio", std::process::id()));
        fs.write(&path).unwrap();
        let data = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let text = String::from_utf8_lossy(&data);
        let names: Vec<&str> = ["etc\0", "etc/epx-vm\0", "etc/epx-vm/config\0", "TRAILER!!!\0"]
            .into_iter()
            .filter(|n| text.contains(n))
            .collect();
        assert_eq!(names.len(), 4, "{text:?}");
        assert!(text.find("etc\0").unwrap() < text.find("etc/epx-vm/config\0").unwrap());
        assert!(data.starts_with(b"070701"));
        assert_eq!(data.len() % 4, 0);
        // The file's header: mode 0100644, size 7.
        let header_at = text.find("etc/epx-vm/config").unwrap() - 110;
        assert_eq!(&text[header_at + 14..header_at + 22], "000081a4");
        assert_eq!(&text[header_at + 54..header_at + 62], "00000007");
    }
}
