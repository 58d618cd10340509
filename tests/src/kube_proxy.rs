//! The real upstream kube-proxy (from `cargo xtask peers`, `$EPX_PEERS_DIR`) as a node's proxy,
//! inside that node's network namespace, for side-by-side comparisons (the benchmark).
//!
//! Everything it programs (iptables or nftables rules, conntrack settings) lives in that
//! namespace and goes with it. What it is given, and why:
//! - `--conntrack-max-per-core=0`: `nf_conntrack_max` is one host-wide value (read-only inside
//!   a network namespace); kube-proxy must not change it. Its per-namespace conntrack timeouts
//!   are left at kube-proxy's defaults.
//! - `--cluster-cidr`: the pods' range, so that traffic from outside it is masqueraded as on a
//!   real node (kube-proxy's default `ClusterCIDR` local-traffic detection).
//! - `--nodeport-addresses`: NodePorts on the node's address towards the external client, as
//!   the agent is given in the same comparison.
//! - metrics and health on the namespace's own loopback (every node namespace has its own).

use std::fs;
use std::path::{Path, PathBuf};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::topology::enter_netns_on_exec;

/// kube-proxy's data-path mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Iptables,
    Nftables,
}

impl Mode {
    pub fn flag(self) -> &'static str {
        match self {
            Mode::Iptables => "iptables",
            Mode::Nftables => "nftables",
        }
    }
}

/// How to start one kube-proxy.
pub struct Config {
    pub mode: Mode,
    pub netns: PathBuf,
    pub kubeconfig: PathBuf,
    pub node_name: String,
    pub cluster_cidr: String,
    pub nodeport_addresses: String,
    /// Its log file.
    pub log: PathBuf,
}

/// A running kube-proxy; killed on drop, and its rules removed (`kube-proxy --cleanup` in its
/// namespace), so that a restart starts cold.
pub struct KubeProxy {
    pub config: Config,
    child: Option<Child>,
    /// Run `kube-proxy --cleanup` on drop (not after [`KubeProxy::kill`]).
    clean_on_drop: bool,
}

/// Where `kube-proxy` is.
pub fn binary() -> PathBuf {
    let path = crate::control_plane::peers_dir().join("kube-proxy");
    assert!(path.is_file(), "{} is missing: run `cargo xtask peers`", path.display());
    path
}

impl KubeProxy {
    /// Starts kube-proxy; returns at once (wait for its rules with traffic).
    pub fn start(config: Config) -> anyhow::Result<Self> {
        let mut proxy = Self { config, child: None, clean_on_drop: true };
        proxy.spawn()?;
        Ok(proxy)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let c = &self.config;
        let log = fs::OpenOptions::new().create(true).append(true).open(&c.log).with_context(|| format!("opening {}", c.log.display()))?;
        let mut command = Command::new(binary());
        enter_netns_on_exec(&mut command, &c.netns)?;
        // It dies with the harness, even a SIGKILLed one (Drop never runs then): a kube-proxy
        // left behind keeps its deleted namespace alive and retries its API forever.
        // SAFETY: prctl(2) is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command
            .arg(format!("--proxy-mode={}", c.mode.flag()))
            .arg(format!("--kubeconfig={}", c.kubeconfig.display()))
            .arg(format!("--hostname-override={}", c.node_name))
            .arg(format!("--cluster-cidr={}", c.cluster_cidr))
            .arg(format!("--nodeport-addresses={}", c.nodeport_addresses))
            .arg("--conntrack-max-per-core=0")
            .arg("--metrics-bind-address=127.0.0.1:10249")
            .arg("--healthz-bind-address=127.0.0.1:10256")
            .arg("--v=1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting kube-proxy")?;
        self.child = Some(child);
        Ok(())
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Fails with the log's tail if kube-proxy has exited.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        if let Some(child) = self.child.as_mut() {
            if let Some(status) = child.try_wait()? {
                bail!("kube-proxy ({}) exited with {status}:\n{}", self.config.mode.flag(), self.log_tail());
            }
        }
        Ok(())
    }

    /// Kills it and removes its rules (`kube-proxy --cleanup`), so the next start is cold.
    pub fn stop_and_clean(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            child.wait()?;
        }
        let mut cleanup = Command::new(binary());
        enter_netns_on_exec(&mut cleanup, &self.config.netns)?;
        let output = cleanup.arg("--cleanup").arg("--v=0").output().context("running kube-proxy --cleanup")?;
        if !output.status.success() {
            bail!("kube-proxy --cleanup failed: {}", String::from_utf8_lossy(&output.stderr).trim());
        }
        Ok(())
    }

    /// Kills it and leaves its rules to go with its namespace (no `--cleanup`, now or on drop:
    /// with a ruleset of tens of thousands of Services that takes minutes).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.clean_on_drop = false;
    }

    /// Starts it again after [`KubeProxy::stop_and_clean`].
    pub fn restart(&mut self) -> anyhow::Result<()> {
        if self.child.is_some() {
            bail!("kube-proxy is running");
        }
        self.spawn()
    }

    /// Waits until its `/healthz` on the namespace's loopback answers 200.
    pub fn wait_healthy(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let answer = crate::topology::in_netns(&self.config.netns, || crate::agent::http_get(10256, "/healthz"))?;
            if let Ok((200, _)) = answer {
                return Ok(());
            }
            self.check_running()?;
            if Instant::now() > deadline {
                bail!("kube-proxy not healthy after {timeout:?}:\n{}", self.log_tail());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Its `/metrics` text.
    pub fn metrics(&self) -> anyhow::Result<String> {
        let (status, body) = crate::topology::in_netns(&self.config.netns, || crate::agent::http_get(10249, "/metrics"))??;
        if status != 200 {
            bail!("kube-proxy /metrics answered {status}");
        }
        Ok(body)
    }

    pub fn log_tail(&self) -> String {
        let text = fs::read_to_string(&self.config.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    pub fn log_path(&self) -> &Path {
        &self.config.log
    }
}

impl Drop for KubeProxy {
    fn drop(&mut self) {
        if self.clean_on_drop {
            let _ = self.stop_and_clean();
        } else {
            self.kill();
        }
    }
}
