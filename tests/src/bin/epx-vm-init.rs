//! PID 1 of the kernel-matrix VM that `cargo xtask vm-test` boots (see xtask/src/vm.rs).
//!
//! Mounts what the tests expect of a host (proc, sysfs, devtmpfs, tmpfs on /run and /tmp, cgroup2;
//! bpffs is left to the agent, which mounts it itself), loads the kernel modules the initramfs
//! lists, brings up loopback, runs each listed test binary with `--test-threads=1`, prints one
//! `epx-vm: PASS|FAIL NAME (...)` line per binary and a closing `epx-vm: RESULT ...` line on the
//! console, and powers the machine off. Nothing here decides a test's outcome: the binaries do.
//!
//! `/etc/epx-vm/config`, written by xtask, one directive a line:
//! `module PATH` (loaded in order), `env KEY=VALUE`, `test NAME` (runs `/epx/tests/NAME`),
//! `arg ARG` (passed to every test binary), `timeout SECONDS` (per binary).

use std::ffi::CString;
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

const CONFIG: &str = "/etc/epx-vm/config";
const TESTS_DIR: &str = "/epx/tests";

#[derive(Default)]
struct Config {
    modules: Vec<String>,
    env: Vec<(String, String)>,
    tests: Vec<String>,
    args: Vec<String>,
    timeout: Option<Duration>,
}

fn read_config() -> anyhow::Result<Config> {
    let text = fs::read_to_string(CONFIG).with_context(|| format!("reading {CONFIG}"))?;
    let mut config = Config::default();
    for (n, line) in text.lines().enumerate() {
        let Some((directive, value)) = line.split_once(' ') else { continue };
        match directive {
            "module" => config.modules.push(value.to_owned()),
            "env" => {
                let (key, val) = value.split_once('=').with_context(|| format!("{CONFIG}:{}: env needs KEY=VALUE", n + 1))?;
                config.env.push((key.to_owned(), val.to_owned()));
            }
            "test" => config.tests.push(value.to_owned()),
            "arg" => config.args.push(value.to_owned()),
            "timeout" => {
                let secs = value.parse().with_context(|| format!("{CONFIG}:{}: timeout {value:?}", n + 1))?;
                config.timeout = Some(Duration::from_secs(secs));
            }
            other => bail!("{CONFIG}:{}: unknown directive {other:?}", n + 1),
        }
    }
    Ok(config)
}

fn cstr(s: &str) -> CString {
    CString::new(s).expect("no NUL in mount arguments")
}

fn mount(source: &str, target: &str, fstype: &str, data: &str) -> anyhow::Result<()> {
    fs::create_dir_all(target).with_context(|| format!("creating {target}"))?;
    let (source, target_c, fstype_c, data) = (cstr(source), cstr(target), cstr(fstype), cstr(data));
    // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(source.as_ptr(), target_c.as_ptr(), fstype_c.as_ptr(), 0, data.as_ptr().cast())
    };
    if rc != 0 {
        bail!("mounting {fstype} on {target}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

fn mount_filesystems() -> anyhow::Result<()> {
    mount("proc", "/proc", "proc", "")?;
    mount("sysfs", "/sys", "sysfs", "")?;
    mount("devtmpfs", "/dev", "devtmpfs", "mode=0755")?;
    mount("tmpfs", "/run", "tmpfs", "mode=0755")?;
    mount("tmpfs", "/tmp", "tmpfs", "mode=1777")?;
    mount("cgroup2", "/sys/fs/cgroup", "cgroup2", "")?;
    Ok(())
}

/// Loads one module with finit_module(2); one that is already there (built in or loaded) is fine.
fn load_module(path: &str) -> anyhow::Result<()> {
    let file = fs::File::open(path).with_context(|| format!("opening module {path}"))?;
    let params = cstr("");
    // SAFETY: finit_module on an open file with an empty NUL-terminated parameter string.
    let rc = unsafe { libc::syscall(libc::SYS_finit_module, file.as_raw_fd(), params.as_ptr(), 0) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EEXIST) {
            bail!("loading module {path}: {err}");
        }
    }
    Ok(())
}

fn set_hostname(name: &str) {
    // SAFETY: sethostname with a buffer and its length.
    unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) };
}

/// Waits for `pid`, reaping every other child on the way (as PID 1, orphans are ours), and kills
/// it when `timeout` passes. Returns its status and whether it was killed.
fn wait_for(pid: i32, timeout: Option<Duration>) -> (ExitStatus, bool) {
    let start = Instant::now();
    let mut killed = false;
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid status pointer.
        let reaped = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if reaped == pid {
            return (ExitStatus::from_raw(status), killed);
        }
        if reaped > 0 {
            continue;
        }
        if !killed && timeout.is_some_and(|t| start.elapsed() > t) {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn describe(status: ExitStatus, killed: bool, timeout: Option<Duration>) -> String {
    match (status.code(), status.signal()) {
        _ if killed => format!("killed after the {} s timeout", timeout.map_or(0, |t| t.as_secs())),
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => format!("{status}"),
    }
}

fn run() -> anyhow::Result<()> {
    mount_filesystems()?;
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!("epx-vm: kernel {}", release.trim());
    let config = read_config()?;
    // Still one thread: the tests (and `ip` below) inherit PATH and the EPX_* variables.
    for (key, value) in &config.env {
        std::env::set_var(key, value);
    }
    for module in &config.modules {
        load_module(module)?;
    }
    if !config.modules.is_empty() {
        println!("epx-vm: loaded {} modules", config.modules.len());
    }
    set_hostname("epx-vm");
    let lo = Command::new("ip").args(["link", "set", "lo", "up"]).status().context("running ip link set lo up")?;
    if !lo.success() {
        bail!("ip link set lo up failed with {lo}");
    }

    let (mut passed, mut failed) = (0, 0);
    for name in &config.tests {
        println!("epx-vm: RUN {name}");
        let start = Instant::now();
        let child = Command::new(format!("{TESTS_DIR}/{name}"))
            .arg("--test-threads=1")
            .args(&config.args)
            .current_dir("/tmp")
            .spawn();
        let verdict = match child {
            Ok(child) => {
                let (status, killed) = wait_for(child.id() as i32, config.timeout);
                let ok = status.success() && !killed;
                let what = describe(status, killed, config.timeout);
                (ok, what)
            }
            Err(e) => (false, format!("could not start: {e}")),
        };
        let word = if verdict.0 { "PASS" } else { "FAIL" };
        println!("epx-vm: {word} {name} ({}, {:.1} s)", verdict.1, start.elapsed().as_secs_f64());
        if verdict.0 {
            passed += 1;
        } else {
            failed += 1;
        }
    }
    println!("epx-vm: RESULT binaries_passed={passed} binaries_failed={failed}");
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        println!("epx-vm: ERROR {e:#}");
    }
    // SAFETY: sync and reboot(2) with a valid command; this process is PID 1 and ends here.
    unsafe {
        libc::sync();
        libc::reboot(libc::RB_POWER_OFF);
    }
    // reboot only returns on failure; a PID 1 that exits panics the kernel, and `panic=-1`
    // on the command line turns that into a reboot, which `-no-reboot` turns into QEMU exiting.
    println!("epx-vm: power off failed: {}", std::io::Error::last_os_error());
}
