//! Running the real `ebpf-proxy` agent for a topology: its own bpffs directory, the topology's
//! cgroup, a manifest file as source, health on a free loopback port.

use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::topology::Topology;

/// Two distinct free loopback ports (both held until chosen, so they cannot be the same).
fn free_ports() -> (u16, u16) {
    let bind = || TcpListener::bind("127.0.0.1:0").expect("free port");
    let (a, b) = (bind(), bind());
    let port = |l: &TcpListener| l.local_addr().expect("local addr").port();
    (port(&a), port(&b))
}

/// `GET path` on 127.0.0.1:port; returns (status, body).
pub fn http_get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    Ok((status, body))
}

/// The agent's files: manifest, log. Removed on drop.
pub struct AgentDir {
    pub dir: PathBuf,
}

impl AgentDir {
    pub fn new(id: &str) -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!("{}-{id}", crate::PREFIX));
        fs::create_dir_all(&dir)?;
        Ok(Self { dir })
    }
    pub fn manifest(&self) -> PathBuf {
        self.dir.join("manifest.yaml")
    }
    /// Replaces the manifest atomically (write + rename), as an editor or a ConfigMap update would.
    pub fn write_manifest(&self, yaml: &str) -> anyhow::Result<()> {
        let tmp = self.dir.join(".manifest.tmp");
        fs::write(&tmp, yaml)?;
        fs::rename(&tmp, self.manifest())?;
        Ok(())
    }
}

impl Drop for AgentDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Where an agent of its own node keeps its pins, log and state.
struct Files {
    bpffs: PathBuf,
    log: PathBuf,
    state_dir: PathBuf,
}

/// A running agent. On drop it is killed and everything it pinned is removed.
pub struct Agent {
    child: Option<Child>,
    pub bpffs: PathBuf,
    pub cgroup: PathBuf,
    pub healthz_port: u16,
    pub metrics_port: u16,
    pub log: PathBuf,
    pub state_dir: PathBuf,
    /// `--source ...` (and `--kubeconfig ...`) arguments.
    pub source_args: Vec<String>,
    /// Extra command-line arguments for the next (re)starts.
    pub extra_args: Vec<String>,
    /// The network namespace the agent runs in (`None`: the test's own). Its health and metrics
    /// listen on that namespace's loopback.
    pub netns: Option<PathBuf>,
    /// `--node-name` (`node-1` unless started as another node).
    pub node_name: String,
    starts: u32,
}

impl Agent {
    /// Starts the agent for `topology` on `dir`'s manifest and waits until it has synced once.
    pub fn start(topology: &Topology, dir: &AgentDir) -> anyhow::Result<Self> {
        Self::start_file_with_args(topology, dir, &[])
    }

    /// As [`Agent::start`], with extra command-line arguments from the first start on.
    pub fn start_file_with_args(topology: &Topology, dir: &AgentDir, extra_args: &[&str]) -> anyhow::Result<Self> {
        let source = vec![format!("--source=file:{}", dir.manifest().display())];
        Self::start_with_source(topology, dir, source, extra_args.iter().map(ToString::to_string).collect())
    }

    /// Starts the agent on the Kubernetes API behind `kubeconfig` and waits until it has synced.
    pub fn start_kube(topology: &Topology, dir: &AgentDir, kubeconfig: &Path) -> anyhow::Result<Self> {
        let source = vec!["--source=kube".into(), format!("--kubeconfig={}", kubeconfig.display())];
        Self::start_with_source(topology, dir, source, Vec::new())
    }

    /// As [`Agent::start_kube`], but inside the topology's node namespace (so NodePorts exist on
    /// the node address 10.244.1.1); `kubeconfig` must name an API address reachable from there.
    pub fn start_kube_in_node(topology: &Topology, dir: &AgentDir, kubeconfig: &Path) -> anyhow::Result<Self> {
        let source = vec!["--source=kube".into(), format!("--kubeconfig={}", kubeconfig.display())];
        Self::start_in(topology, dir, source, Vec::new(), Some(topology.node.path()))
    }

    /// As [`Agent::start_kube_in_node`], with extra command-line arguments.
    pub fn start_kube_in_node_with(topology: &Topology, dir: &AgentDir, kubeconfig: &Path, extra_args: &[&str]) -> anyhow::Result<Self> {
        let source = vec!["--source=kube".into(), format!("--kubeconfig={}", kubeconfig.display())];
        let extra = extra_args.iter().map(ToString::to_string).collect();
        Self::start_in(topology, dir, source, extra, Some(topology.node.path()))
    }

    /// The agent process's id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn start_with_source(
        topology: &Topology,
        dir: &AgentDir,
        source_args: Vec<String>,
        extra_args: Vec<String>,
    ) -> anyhow::Result<Self> {
        Self::start_in(topology, dir, source_args, extra_args, None)
    }

    /// Starts the agent inside the topology's node namespace (where the packet-level programs
    /// attach to the node's interfaces, e.g. `--interfaces ext0`) on `dir`'s manifest, and waits
    /// until it has synced once.
    pub fn start_file_in_node(topology: &Topology, dir: &AgentDir, extra_args: &[&str]) -> anyhow::Result<Self> {
        let source = vec![format!("--source=file:{}", dir.manifest().display())];
        let extra = extra_args.iter().map(ToString::to_string).collect();
        Self::start_in(topology, dir, source, extra, Some(topology.node.path()))
    }

    /// Starts the agent in `netns` (`None`: the test's own namespace) and waits until it synced.
    fn start_in(
        topology: &Topology,
        dir: &AgentDir,
        source_args: Vec<String>,
        extra_args: Vec<String>,
        netns: Option<PathBuf>,
    ) -> anyhow::Result<Self> {
        let (healthz_port, metrics_port) = free_ports();
        let mut agent = Self {
            child: None,
            bpffs: PathBuf::from(format!("/sys/fs/bpf/{}-{}", crate::PREFIX, topology.id)),
            cgroup: topology.cgroup.path.clone(),
            healthz_port,
            metrics_port,
            log: dir.dir.join("agent.log"),
            state_dir: dir.dir.join("state"),
            source_args,
            extra_args,
            netns,
            node_name: "node-1".into(),
            starts: 0,
        };
        agent.restart()?;
        Ok(agent)
    }

    /// The agent of a second node, `node_name`, on the same manifest as `first`: it runs in
    /// `netns` (that node's namespace) and balances the sockets of `cgroup` (that node's pods),
    /// with its own bpffs directory, state, ports and log, and `extra_args`. Waits until it has
    /// synced.
    pub fn start_other_node(
        first: &Agent,
        node_name: &str,
        cgroup: &Path,
        netns: &Path,
        extra_args: &[&str],
    ) -> anyhow::Result<Self> {
        let files = Files {
            bpffs: PathBuf::from(format!("{}-{node_name}", first.bpffs.display())),
            log: first.log.with_extension(format!("{node_name}.log")),
            state_dir: first.state_dir.with_extension(node_name),
        };
        let mut agent = Self::of_node(node_name, netns, cgroup, files, first.source_args.clone(), extra_args);
        agent.restart()?;
        Ok(agent)
    }

    /// The agent of node `node_name` on the Kubernetes API behind `kubeconfig`, alone in `netns`
    /// (e.g. one of many simulated nodes): it balances the sockets of `cgroup`, with its own
    /// bpffs directory (named after `dir`), state and log under `dir`, and `extra_args`. Waits
    /// until it has synced.
    pub fn start_kube_as(
        node_name: &str,
        netns: &Path,
        cgroup: &Path,
        dir: &AgentDir,
        kubeconfig: &Path,
        extra_args: &[&str],
    ) -> anyhow::Result<Self> {
        let dir_name = dir.dir.file_name().context("agent directory without a name")?.to_string_lossy();
        let files =
            Files { bpffs: PathBuf::from(format!("/sys/fs/bpf/{dir_name}")), log: dir.dir.join("agent.log"), state_dir: dir.dir.join("state") };
        let source_args = vec!["--source=kube".into(), format!("--kubeconfig={}", kubeconfig.display())];
        let mut agent = Self::of_node(node_name, netns, cgroup, files, source_args, extra_args);
        agent.restart()?;
        Ok(agent)
    }

    /// An agent, not started yet, of node `node_name` in `netns` balancing the sockets of
    /// `cgroup`, with its own ports.
    fn of_node(node_name: &str, netns: &Path, cgroup: &Path, files: Files, source_args: Vec<String>, extra_args: &[&str]) -> Self {
        let (healthz_port, metrics_port) = free_ports();
        Self {
            child: None,
            bpffs: files.bpffs,
            cgroup: cgroup.to_owned(),
            healthz_port,
            metrics_port,
            log: files.log,
            state_dir: files.state_dir,
            source_args,
            extra_args: extra_args.iter().map(ToString::to_string).collect(),
            netns: Some(netns.to_owned()),
            node_name: node_name.to_owned(),
            starts: 0,
        }
    }

    /// The value of metric `name` in `/metrics` (summed over its series, if it has labels).
    pub fn metric(&self, name: &str) -> anyhow::Result<f64> {
        let (status, text) = self.get(true, "/metrics")?;
        anyhow::ensure!(status == 200, "/metrics answered {status}: {text}");
        crate::metrics::sum(&crate::metrics::parse(&text, "the agent")?, name, |_| true)
            .with_context(|| format!("no sample {name} in /metrics:\n{text}"))
    }

    /// Map entries this agent process's syncs wrote or deleted (`/metrics`).
    pub fn map_writes(&self) -> anyhow::Result<u64> {
        Ok(self.metric("ebpf_proxy_sync_map_writes_total")? as u64)
    }

    /// `GET path` on the agent's healthz (`metrics: false`) or metrics port, in its namespace.
    pub fn get(&self, metrics: bool, path: &str) -> std::io::Result<(u16, String)> {
        let port = if metrics { self.metrics_port } else { self.healthz_port };
        match &self.netns {
            None => http_get(port, path),
            Some(netns) => crate::topology::in_netns(netns, || http_get(port, path))?,
        }
    }

    /// A second agent for the same node (same bpffs, cgroup, source and state dir), other
    /// ports and log. Spawned but not waited for.
    pub fn spawn_second(&self) -> anyhow::Result<Self> {
        let mut second = self.second();
        second.spawn()?;
        Ok(second)
    }

    /// As [`Agent::spawn_second`], not started yet (its arguments may still change).
    pub fn second(&self) -> Self {
        let (healthz_port, metrics_port) = free_ports();
        Self {
            child: None,
            bpffs: self.bpffs.clone(),
            cgroup: self.cgroup.clone(),
            healthz_port,
            metrics_port,
            log: self.log.with_extension("second.log"),
            state_dir: self.state_dir.clone(),
            source_args: self.source_args.clone(),
            extra_args: self.extra_args.clone(),
            netns: self.netns.clone(),
            node_name: self.node_name.clone(),
            starts: 0,
        }
    }

    /// Starts the agent process again (after `stop` or `kill`) and waits until it has synced.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.spawn()?;
        self.wait_healthy(Duration::from_secs(10))
    }

    /// Starts the agent process without waiting for it to become healthy.
    pub fn spawn(&mut self) -> anyhow::Result<()> {
        self.starts += 1;
        let log = fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let mut command = Command::new(crate::bin("ebpf-proxy"));
        command.arg("agent");
        if let Some(netns) = &self.netns {
            crate::topology::enter_netns_on_exec(&mut command, netns)?;
        }
        // The packet-level programs go only where a test asks for them, never on the host's
        // own interfaces (the agent's default).
        if !self.extra_args.iter().any(|a| a.starts_with("--interfaces")) {
            command.arg("--interfaces=none");
        }
        let child = command
            .args(&self.source_args)
            .arg("--cgroup")
            .arg(&self.cgroup)
            .arg("--bpffs")
            .arg(&self.bpffs)
            .arg(format!("--healthz-bind=127.0.0.1:{}", self.healthz_port))
            .arg(format!("--metrics-bind=127.0.0.1:{}", self.metrics_port))
            .arg(format!("--node-name={}", self.node_name))
            .arg("--state-dir")
            .arg(&self.state_dir)
            .args(&self.extra_args)
            .env("RUST_LOG", std::env::var("EPX_AGENT_LOG").unwrap_or_else(|_| "info".into()))
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawning ebpf-proxy")?;
        self.child = Some(child);
        Ok(())
    }

    /// Spawns the agent and expects it to exit on its own (a refused start); returns its status.
    pub fn start_expecting_exit(&mut self, timeout: Duration) -> anyhow::Result<std::process::ExitStatus> {
        self.spawn()?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.as_mut().expect("spawned").try_wait()? {
                self.child = None;
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!("ebpf-proxy still running after {timeout:?}:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn is_healthy(&self) -> bool {
        matches!(self.get(false, "/healthz"), Ok((200, _)))
    }

    /// Waits until /healthz answers 200 (the agent has programmed the datapath at least once).
    pub fn wait_healthy(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok((200, _)) = self.get(false, "/healthz") {
                return Ok(());
            }
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    bail!("ebpf-proxy exited with {status}:\n{}", self.log_text());
                }
            }
            if Instant::now() > deadline {
                bail!("ebpf-proxy not healthy after {timeout:?}:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn signal(&mut self, signal: i32) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on our own child process.
            unsafe { libc::kill(child.id() as i32, signal) };
            child.wait()?;
        }
        Ok(())
    }

    /// SIGTERM and wait: the datapath must stay attached.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        self.signal(libc::SIGTERM)
    }

    /// SIGKILL and wait: as a crash or an OOM kill.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        self.signal(libc::SIGKILL)
    }

    /// A node reboot, as the datapath sees it: the agent is gone and bpffs is empty (every pinned
    /// program and map removed). The state directory survives, as a host path does.
    pub fn simulate_reboot(&mut self) -> anyhow::Result<()> {
        self.kill()?;
        crate::topology::run(Command::new(crate::bin("ebpf-proxy")).arg("cleanup").arg("--bpffs").arg(&self.bpffs))?;
        Ok(())
    }

    /// `ebpf-proxy dump --json`, which reads only the pinned maps.
    pub fn dump(&self) -> anyhow::Result<serde_json::Value> {
        dump(&self.bpffs)
    }

    /// Waits (up to 5 s) until the external frontend `ip:port` (a NodePort on a node address, an
    /// externalIP, a LoadBalancer IP) of any protocol is in the maps; panics with the dump and
    /// the agent's log otherwise.
    pub fn wait_for_external_frontend(&self, ip: &str, port: u16) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let dump = self.dump().expect("dump");
            let mut services = dump["services"].as_array().into_iter().flatten();
            if services.any(|s| s["ip"] == ip && s["port"] == port && s["scope"] == "external") {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no external frontend {ip}:{port} after 5 s: {dump:#}\n{}",
                self.log_text()
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// Waits (up to 5 s) until the agent's log contains `text`; panics with the log otherwise.
    pub fn wait_for_log(&self, text: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !self.log_text().contains(text) {
            assert!(std::time::Instant::now() < deadline, "no {text:?} in the log after 5 s:\n{}", self.log_text());
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// The dump's service entries for `ip:port/PROTOCOL`, one per scope.
    pub fn entries(&self, ip: &str, port: u16, protocol: &str) -> Vec<serde_json::Value> {
        let dump = self.dump().expect("dump");
        let services = dump["services"].as_array().cloned().unwrap_or_default();
        services.into_iter().filter(|s| s["ip"] == ip && s["port"] == port && s["protocol"] == protocol).collect()
    }
}

/// The datapath counter `name` in a `dump`; panics (showing the counters) when there is none.
pub fn counter(dump: &serde_json::Value, name: &str) -> u64 {
    dump["counters"][name].as_u64().unwrap_or_else(|| panic!("no counter {name}: {:#}", dump["counters"]))
}

/// Asserts that the packet path SNATed at least `packets` packets to a backend on another node
/// and reverse-translated as many replies, with no remote flow left un-SNATed and no route
/// lookup failed.
pub fn assert_snated(dump: &serde_json::Value, packets: u64) {
    let counters = &dump["counters"];
    assert!(counter(dump, "tc_snat") >= packets && counter(dump, "tc_snat_reply") >= packets, "{counters:#}");
    assert_eq!(counter(dump, "tc_remote_backend_no_snat"), 0, "{counters:#}");
    assert_eq!(counter(dump, "tc_fib_fail"), 0, "{counters:#}");
}

pub fn dump(bpffs: &Path) -> anyhow::Result<serde_json::Value> {
    let output = crate::topology::run(Command::new(crate::bin("ebpf-proxy")).arg("dump").arg("--json").arg("--bpffs").arg(bpffs))?;
    Ok(serde_json::from_slice(&output.stdout)?)
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.kill();
        let _ = Command::new(crate::bin("ebpf-proxy"))
            .arg("cleanup")
            .arg("--bpffs")
            .arg(&self.bpffs)
            .stdout(Stdio::null())
            .output();
        if std::thread::panicking() {
            eprintln!("--- ebpf-proxy log ({} starts) ---\n{}", self.starts, self.log_text());
        }
    }
}

/// Creates a pinned LRU hash map at `path` with the given layout, as an agent of an earlier
/// build left it (aya 0.14 creates maps only from an object).
pub fn pin_lru_map(path: &std::path::Path, name: &str, key_size: u32, value_size: u32, max_entries: u32) {
    use std::os::unix::ffi::OsStrExt;
    const BPF_MAP_CREATE: libc::c_long = 0;
    const BPF_OBJ_PIN: libc::c_long = 6;
    const BPF_MAP_TYPE_LRU_HASH: u32 = 9;
    let mut attr = [0u8; 128];
    for (offset, value) in [(0, BPF_MAP_TYPE_LRU_HASH), (4, key_size), (8, value_size), (12, max_entries)] {
        attr[offset..offset + 4].copy_from_slice(&value.to_ne_bytes());
    }
    attr[28..28 + name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: bpf(2) with a zeroed attribute block of the size the kernel accepts.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_CREATE, attr.as_ptr(), attr.len() as u32) };
    assert!(fd >= 0, "BPF_MAP_CREATE: {}", std::io::Error::last_os_error());
    let path = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("path");
    let mut attr = [0u8; 128];
    attr[0..8].copy_from_slice(&(path.as_ptr() as u64).to_ne_bytes());
    attr[8..12].copy_from_slice(&(fd as u32).to_ne_bytes());
    // SAFETY: as above; `path` outlives the call.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_PIN, attr.as_ptr(), attr.len() as u32) };
    assert_eq!(rc, 0, "BPF_OBJ_PIN: {}", std::io::Error::last_os_error());
    // SAFETY: our descriptor; the pin holds the map.
    unsafe { libc::close(fd as i32) };
}
