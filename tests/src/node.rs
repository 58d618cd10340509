//! A real single-node Kubernetes without kube-proxy, for end-to-end tests and
//! `cargo xtask cluster up --node`: kube-controller-manager and kube-scheduler next to the
//! [`ControlPlane`]'s etcd and kube-apiserver, and a kubelet on containerd, runc and the CNI
//! plugins from Debian's packages, all upstream and configured by files, not patched.
//!
//! ```text
//!   pod "apiserver" 10.244.1.250          node netns: br0 10.244.1.1 ── cni0 10.244.64.1/24 ── pods
//!   etcd, kube-apiserver,          <───   containerd, kubelet (:10250), hostNetwork pods
//!   kube-controller-manager, kube-scheduler
//! ```
//!
//! What this module owns, and removes on drop (also after a failure, and `sweep` after a kill):
//! - the temporary directory `<tmp>/epxt-<id>-node` (containerd's root, state and socket, the
//!   kubelet's root dir, pod logs, CNI config and IPAM state, the images' build storage);
//! - the cgroups `<hierarchy>/epxt-<id>-node` (kubelet's `cgroupRoot`: every pod) and
//!   `<hierarchy>/epxt-<id>-noded` (containerd, its shims, kubelet) in every hierarchy;
//! - the kernel settings kubelet changes (`vm.overcommit_memory`, `kernel.panic`, ...): saved to
//!   `host-state.json` before kubelet starts, written back on drop;
//! - the host directories containerd and kubelet insist on (`/run/containerd`, `/var/lib/cni`,
//!   `/var/log/pods`, `/var/log/containers`) and `/run/netns`: containerd and kubelet run in a
//!   mount namespace of their own where each is a bind mount of a directory under the temporary
//!   directory, so nothing lands on the host's copies; those that did not exist are created
//!   (empty) and removed again. Every mount they make (rootfs overlays, volume tmpfs, netns pins)
//!   lives only in that mount namespace and dies with its last process.
//!
//! Service traffic is not proxied here: that is what the agent under test is for. CoreDNS reaches
//! the API server at its own address ([`APISERVER_IP`]), not through the `kubernetes` Service, so
//! DNS does not depend on the proxy under test (`KUBERNETES_SERVICE_HOST` in its Deployment).

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Node as NodeObject;
use kube::api::Api;
use serde::{Deserialize, Serialize};

use crate::control_plane::{peers_dir, ControlPlane, APISERVER_IP, APISERVER_PORT, POD, SERVICE_CIDR};
use crate::topology::{run, Topology};

/// The Node object's name.
pub const NODE_NAME: &str = "epx-node";
/// The node's address (br0 in the node namespace); kubelet serves on it.
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 1);
/// Pod addresses handed out by kube-controller-manager; the node gets the first /24.
pub const CLUSTER_CIDR: &str = "10.244.64.0/18";
/// This node's pod subnet: the first /24 of [`CLUSTER_CIDR`], on CNI bridge `cni0`.
pub const POD_CIDR: &str = "10.244.64.0/24";
/// The `kube-dns` Service's ClusterIP (kubelet's `clusterDNS`).
pub const CLUSTER_DNS_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
pub const CLUSTER_DOMAIN: &str = "cluster.local";

const CONTAINERD: &str = "/usr/bin/containerd";
const CTR: &str = "/usr/bin/ctr";
/// Debian's containernetworking-plugins.
const CNI_BIN_DIR: &str = "/usr/lib/cni";
/// containerd's CRI plugin keeps its images in this containerd namespace.
const CRI_NAMESPACE: &str = "k8s.io";
/// Written by kubelet at start (`setupKernelTunables`), global to the host: saved and restored.
const KUBELET_SYSCTLS: &[&str] = &[
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];
/// Host paths containerd, its shims, CNI and kubelet use whatever their configuration says; in
/// their mount namespace each is a bind mount of `<dir>/host/<name>`.
const PRIVATE_HOST_DIRS: &[(&str, &str)] = &[
    ("/run/containerd", "run-containerd"),
    // kubelet's device-plugin socket directory is fixed (`/var/lib/kubelet/device-plugins`),
    // whatever its `--root-dir`.
    ("/var/lib/kubelet", "var-lib-kubelet"),
    // buildah (containers/image) keeps its blob-info cache there when run as root, whatever its
    // `--root`.
    ("/var/lib/containers", "var-lib-containers"),
    // buildah's lock for short-name aliases (`FROM debian:bookworm`).
    ("/var/cache/containers", "var-cache-containers"),
    ("/run/netns", "run-netns"),
    ("/var/lib/cni", "var-lib-cni"),
    ("/var/log/pods", "var-log-pods"),
    ("/var/log/containers", "var-log-containers"),
];
/// The master's processes besides etcd and kube-apiserver ([`ControlPlane`]'s).
const CONTROLLERS: [&str; 2] = ["kube-controller-manager", "kube-scheduler"];
const NODE_READY_TIMEOUT: Duration = Duration::from_secs(120);
const COREDNS_READY_TIMEOUT: Duration = Duration::from_secs(120);
const LOG_TAIL_LINES: usize = 30;

/// kube-apiserver flags a node needs on top of [`ControlPlane::start`]'s (give them to
/// [`ControlPlane::start_with`]): kubelet is reached at its InternalIP (its hostname resolves
/// nowhere), and privileged pods are allowed as in any standard cluster.
pub const APISERVER_ARGS: &[&str] = &["--kubelet-preferred-address-types=InternalIP", "--allow-privileged=true"];

/// The image references a node has imported (all versioned, never `latest`).
#[derive(Clone, Debug)]
pub struct Images {
    pub pause: String,
    /// `epx-probe` as the entry point: echo servers and clients for tests.
    pub probe: String,
    pub coredns: String,
}

/// What the host looked like before the node changed it; written to `host-state.json` before any
/// change, so a later `sweep` can put it back after a kill.
#[derive(Serialize, Deserialize, Default, Debug)]
struct HostState {
    /// `/proc/sys` path (relative) and its value before kubelet started.
    sysctls: Vec<(String, String)>,
    /// Host directories created (empty) only to be bind-mount targets.
    created_dirs: Vec<PathBuf>,
}

/// A running node. Drop stops every process and restores the host (see the module docs).
pub struct Node {
    pub dir: PathBuf,
    /// Admin kubeconfig for the host's loopback (as [`ControlPlane::admin_kubeconfig`]).
    pub kubeconfig: PathBuf,
    pub images: Images,
    /// kubelet's `cgroupRoot`, the same name in every cgroup hierarchy: every pod is below it.
    pub pods_cgroup: String,
    /// The v2 (unified) directory of [`Node::pods_cgroup`]: where an agent for these pods attaches.
    pub pods_cgroup_v2: PathBuf,
    daemons_cgroup: String,
    /// Started processes, killed in reverse order.
    processes: Vec<(&'static str, Child)>,
    host: HostState,
}

impl Node {
    /// Starts kube-controller-manager and kube-scheduler next to `cp`'s API server, containerd and
    /// kubelet in `topology`'s node namespace, builds and imports the images, runs CoreDNS as
    /// `kube-system/kube-dns`, and waits until the Node and CoreDNS are Ready.
    pub fn start(topology: &Topology, cp: &ControlPlane) -> anyhow::Result<Self> {
        let started = Instant::now();
        let peers = peers_dir();
        for bin in ["kubelet", "kube-controller-manager", "kube-scheduler", "coredns"] {
            if !peers.join(bin).is_file() {
                bail!("{} is missing: run `cargo xtask peers`", peers.join(bin).display());
            }
        }
        for tool in [CONTAINERD, CTR, "/usr/sbin/runc", "/usr/bin/buildah"] {
            if !Path::new(tool).exists() {
                bail!("{tool} is missing: run `cargo xtask setup` (the node needs containerd, runc, containernetworking-plugins and buildah)");
            }
        }
        let dir = std::env::temp_dir().join(format!("{}-{}-node", crate::PREFIX, topology.id));
        if dir.exists() {
            fs::remove_dir_all(&dir).with_context(|| format!("removing stale {}", dir.display()))?;
        }
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let pods_cgroup = format!("{}-{}-node", crate::PREFIX, topology.id);
        let daemons_cgroup = format!("{}-{}-noded", crate::PREFIX, topology.id);
        let mut node = Self {
            kubeconfig: cp.admin_kubeconfig.clone(),
            images: Images { pause: String::new(), probe: String::new(), coredns: String::new() },
            pods_cgroup_v2: crate::topology::cgroup2_root()?.join(&pods_cgroup),
            pods_cgroup,
            daemons_cgroup,
            processes: Vec::new(),
            host: HostState::default(),
            dir,
        };
        // From here on a failure drops `node`, which undoes whatever was done so far.
        node.save_host_state()?;
        for name in [&node.pods_cgroup, &node.daemons_cgroup] {
            create_cgroup_everywhere(name)?;
        }
        node.write_configs(cp)?;

        node.start_controllers(topology, cp, &peers)?;
        node.start_containerd(topology)?;
        node.images = node.build_and_import_images(topology, &peers)?;
        node.start_kubelet(topology, cp, &peers)?;
        node.wait_node_ready(cp)?;
        eprintln!("node {NODE_NAME} Ready after {:.1?}", started.elapsed());
        node.deploy_coredns(cp)?;
        node.wait_coredns_ready(cp)?;
        eprintln!("node {NODE_NAME} with CoreDNS Ready after {:.1?}", started.elapsed());
        Ok(node)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The last lines of every log of this node (containerd, kubelet, controllers).
    pub fn logs(&self) -> String {
        let mut all = String::new();
        for name in ["kube-controller-manager", "kube-scheduler", "containerd", "kubelet"] {
            let log = self.path(&format!("{name}.log"));
            all.push_str(&format!("--- {name}.log (last {LOG_TAIL_LINES} lines) ---\n{}\n", tail(&log, LOG_TAIL_LINES)));
        }
        all
    }

    /// `kubectl` from the peers (Debian's 1.20 is too old) with the admin kubeconfig and its
    /// discovery cache in the node's directory (not `~/.kube/cache`); its stdout on success.
    pub fn kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new(peers_dir().join("kubectl"))
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(self.path("kubectl-cache"))
            .args(args)
            .output()
            .context("running kubectl")?;
        if !out.status.success() {
            bail!("kubectl {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Retries `kubectl args` until its output satisfies `done`; that output, or an error with
    /// the last answer after `timeout`.
    pub fn kubectl_until(&self, args: &[&str], timeout: Duration, done: impl Fn(&str) -> bool) -> anyhow::Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let last = self.kubectl(args);
            if let Ok(out) = &last {
                if done(out) {
                    return Ok(out.clone());
                }
            }
            if Instant::now() >= deadline {
                bail!("kubectl {} not as expected after {timeout:?}: {last:?}", args.join(" "));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn save_host_state(&mut self) -> anyhow::Result<()> {
        for sysctl in KUBELET_SYSCTLS {
            let path = Path::new("/proc/sys").join(sysctl);
            let value = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            self.host.sysctls.push((sysctl.to_string(), value.trim().to_owned()));
        }
        // Written before the directories are made, and again after: a kill in between leaves at
        // worst an empty directory unrecorded, never a changed setting unrecorded.
        self.write_host_state()?;
        for (host_dir, private) in PRIVATE_HOST_DIRS {
            fs::create_dir_all(self.path("host").join(private))?;
            let host_dir = Path::new(host_dir);
            if !host_dir.exists() {
                fs::create_dir_all(host_dir).with_context(|| format!("creating {}", host_dir.display()))?;
                self.host.created_dirs.push(host_dir.to_owned());
                self.write_host_state()?;
            }
        }
        Ok(())
    }

    fn write_host_state(&self) -> anyhow::Result<()> {
        let path = self.path("host-state.json");
        fs::write(&path, serde_json::to_vec_pretty(&self.host)?).with_context(|| format!("writing {}", path.display()))
    }

    fn write_configs(&self, cp: &ControlPlane) -> anyhow::Result<()> {
        let dir = self.dir.display().to_string();
        let containerd = format!(
            r#"version = 2
root = "{dir}/containerd/root"
state = "{dir}/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{dir}/containerd/containerd.sock"

[ttrpc]
  address = "{dir}/containerd/containerd.sock.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{dir}/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  # This machine's root lacks CAP_SYS_RESOURCE: without this RunPodSandbox fails
  # ("can't get final child's PID from pipe: EOF").
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{dir}/cni/net.d"
"#,
            pause = image_ref("pause"),
        );
        fs::create_dir_all(self.path("containerd"))?;
        fs::write(self.path("containerd/config.toml"), containerd)?;

        let cni = format!(
            r#"{{
  "cniVersion": "1.0.0",
  "name": "epx-pods",
  "plugins": [
    {{
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {{
        "type": "host-local",
        "ranges": [[{{"subnet": "{POD_CIDR}"}}]],
        "routes": [{{"dst": "0.0.0.0/0"}}],
        "dataDir": "{dir}/cni/ipam"
      }}
    }}
  ]
}}
"#
        );
        fs::create_dir_all(self.path("cni/net.d"))?;
        fs::write(self.path("cni/net.d/10-epx-pods.conflist"), cni)?;

        // The upstream resolver of pods with `dnsPolicy: Default` (CoreDNS's `forward`): the node's
        // own address, where nothing answers, so no query ever leaves the namespaces.
        fs::write(self.path("resolv.conf"), format!("nameserver {NODE_IP}\n"))?;

        let kubelet = format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This host's cgroup v2 hierarchy carries no cpu/memory controllers: the v1 ones are used.
cgroupDriver: cgroupfs
failCgroupV1: false
cgroupRoot: /{pods_cgroup}
failSwapOn: false
containerRuntimeEndpoint: unix://{dir}/containerd/containerd.sock
address: {NODE_IP}
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {ca}}}
authorization:
  mode: Webhook
clusterDNS: [{CLUSTER_DNS_IP}]
clusterDomain: {CLUSTER_DOMAIN}
resolvConf: {dir}/resolv.conf
staticPodPath: {dir}/manifests
volumePluginDir: {dir}/volume-plugins
serializeImagePulls: false
# A shared CI machine's disk must not evict the test's pods.
evictionHard: {{memory.available: 50Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
"#,
            pods_cgroup = self.pods_cgroup,
            ca = cp.ca_cert.display(),
        );
        fs::create_dir_all(self.path("manifests"))?;
        fs::write(self.path("kubelet.yaml"), kubelet)?;
        Ok(())
    }

    /// kube-controller-manager and kube-scheduler in the API server's network namespace, talking to
    /// it directly, and in the daemons' cgroup: `sweep` kills them with the rest of the node
    /// (kube-controller-manager would otherwise recreate its flex-volume directory meanwhile).
    fn start_controllers(&mut self, topology: &Topology, cp: &ControlPlane, peers: &Path) -> anyhow::Result<()> {
        let kubeconfig = cp.direct_kubeconfig("controllers")?;
        let manager_args = [
            format!("--service-account-private-key-file={}", cp.dir.join("sa.key").display()),
            // Published to every namespace as ConfigMap kube-root-ca.crt, which every projected
            // ServiceAccount token volume includes: without it no pod starts.
            format!("--root-ca-file={}", cp.ca_cert.display()),
            "--allocate-node-cidrs=true".to_owned(),
            format!("--cluster-cidr={CLUSTER_CIDR}"),
            "--node-cidr-mask-size=24".to_owned(),
            format!("--service-cluster-ip-range={SERVICE_CIDR}"),
            // Its default, /usr/libexec/kubernetes/kubelet-plugins/volume/exec, is created at start.
            format!("--flex-volume-plugin-dir={}", self.path("volume-plugins").display()),
        ];
        let controllers: [(&'static str, &[String]); 2] = [(CONTROLLERS[0], &manager_args), (CONTROLLERS[1], &[])];
        for (name, args) in controllers {
            let mut cmd = Command::new(peers.join(name));
            self.enter_node(&mut cmd, &topology.pod(POD).netns.path(), None)?;
            cmd.arg(format!("--kubeconfig={}", kubeconfig.display()))
                .args(["--leader-elect=false", "--bind-address=127.0.0.1", "--v=1"])
                .args(args);
            self.spawn(name, cmd)?;
        }
        Ok(())
    }

    /// Kills kube-controller-manager and kube-scheduler (SIGKILL), as a master failure does.
    pub fn stop_controllers(&mut self) {
        for name in CONTROLLERS {
            if let Some(index) = self.processes.iter().position(|(n, _)| *n == name) {
                kill(self.processes.remove(index).1);
            }
        }
    }

    /// Starts kube-controller-manager and kube-scheduler again after [`Node::stop_controllers`].
    pub fn start_controllers_again(&mut self, topology: &Topology, cp: &ControlPlane) -> anyhow::Result<()> {
        self.start_controllers(topology, cp, &peers_dir())
    }

    /// What a power cut does to this node, as far as one machine shared with the master can
    /// show it: kubelet, every pod, containerd and its shims are killed; the mount namespace they
    /// shared dies with them, and with it the node's bpffs mounts, so every pin, program and map
    /// is gone; the runtime state a reboot empties (`/run`: containerd's state, the pods'
    /// network-namespace pins) is removed. What survives a reboot stays: the network namespace
    /// with its links and addresses, containerd's and kubelet's roots (images, kubelet's
    /// checkpoints), the static pod directory and any state directory on the node's disk.
    /// The master's controllers run in the node's daemons cgroup here: stop them first
    /// ([`Node::stop_controllers`], as a master outage does).
    pub fn power_off(&mut self) -> anyhow::Result<()> {
        if let Some(running) = self.processes.iter().find(|(name, _)| CONTROLLERS.contains(name)) {
            bail!("{} still runs: power_off stands for the node, not the master; stop the controllers first", running.0);
        }
        if let Some(index) = self.processes.iter().position(|(name, _)| *name == "kubelet") {
            kill(self.processes.remove(index).1);
        }
        kill_cgroup_everywhere(&self.pods_cgroup);
        while let Some((_, child)) = self.processes.pop() {
            kill(child);
        }
        kill_cgroup_everywhere(&self.daemons_cgroup);
        for volatile in [self.path("containerd/state"), self.path("host/run-containerd"), self.path("host/run-netns")] {
            if volatile.exists() {
                fs::remove_dir_all(&volatile).with_context(|| format!("emptying {}", volatile.display()))?;
            }
            fs::create_dir_all(&volatile).with_context(|| format!("creating {}", volatile.display()))?;
        }
        Ok(())
    }

    /// The node boots after [`Node::power_off`]: its cgroups, containerd and kubelet start again
    /// (kubelet then starts the static pods from its manifest directory, with or without the
    /// API server, and the API's pods once it answers).
    pub fn power_on(&mut self, topology: &Topology, cp: &ControlPlane) -> anyhow::Result<()> {
        for name in [&self.pods_cgroup, &self.daemons_cgroup] {
            create_cgroup_everywhere(name)?;
        }
        self.start_containerd(topology)?;
        self.start_kubelet(topology, cp, &peers_dir())
    }

    /// The last `lines` lines of kubelet's log that contain `filter`.
    pub fn kubelet_log(&self, filter: &str, lines: usize) -> String {
        let text = fs::read(self.path("kubelet.log")).map(|bytes| String::from_utf8_lossy(&bytes).into_owned()).unwrap_or_default();
        let matching: Vec<&str> = text.lines().filter(|line| line.contains(filter)).collect();
        matching[matching.len().saturating_sub(lines)..].join("\n")
    }

    /// Every container log kubelet wrote for pods whose `<namespace>_<name>` starts with
    /// `pod_prefix` (`/var/log/pods`, kept across restarts and reboots), each with its path.
    pub fn pod_logs(&self, pod_prefix: &str) -> String {
        let mut all = String::new();
        let mut dirs = vec![self.path("host/var-log-pods")];
        while let Some(dir) = dirs.pop() {
            for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
                let path = entry.path();
                let relative = path.strip_prefix(self.path("host/var-log-pods")).unwrap_or(&path).display().to_string();
                if !relative.starts_with(pod_prefix) {
                    continue;
                }
                if path.is_dir() {
                    dirs.push(path);
                } else {
                    all.push_str(&format!("--- {relative} ---\n{}\n", tail(&path, LOG_TAIL_LINES)));
                }
            }
        }
        all
    }

    /// Starts `cmd` with its output in `<dir>/<name>.log`, and keeps it to kill on drop.
    fn spawn(&mut self, name: &'static str, mut cmd: Command) -> anyhow::Result<()> {
        let log = log_file(&self.path(&format!("{name}.log")))?;
        cmd.stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
        let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
        self.processes.push((name, child));
        Ok(())
    }

    fn pid_of(&self, name: &str) -> anyhow::Result<u32> {
        self.processes.iter().find(|(n, _)| *n == name).map(|(_, child)| child.id()).with_context(|| format!("{name} is not running"))
    }

    /// containerd in the node's network namespace and in a new mount namespace (see the module
    /// docs), in the daemons' cgroup; waits until it answers on its socket.
    fn start_containerd(&mut self, topology: &Topology) -> anyhow::Result<()> {
        let mut script = String::from("set -e\n");
        for (host_dir, private) in PRIVATE_HOST_DIRS {
            script.push_str(&format!("mount --bind '{}' '{host_dir}'\n", self.path("host").join(private).display()));
        }
        // The node's directory is a shared mount in this namespace, as `/` is on a systemd host:
        // a pod's `mountPropagation: Bidirectional` volume below it (the agent's bpffs) needs
        // that, and its mounts then reach kubelet and later containers, never the host.
        let dir = self.dir.display();
        script.push_str(&format!("mount --bind '{dir}' '{dir}'\nmount --make-shared '{dir}'\n"));
        script.push_str(&format!("exec {CONTAINERD} --config '{}'\n", self.path("containerd/config.toml").display()));
        let mut cmd = Command::new("unshare");
        // Slave: the host's later mounts (bpffs, cgroups) still show inside, none of ours leak out.
        cmd.args(["--mount", "--propagation", "slave", "--", "sh", "-c", &script]);
        self.enter_node(&mut cmd, &topology.node.path(), None)?;
        // Its temporary mounts (image unpacking) are made under $TMPDIR.
        let tmp = self.path("containerd/tmp");
        fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        cmd.env("TMPDIR", tmp);
        self.spawn("containerd", cmd)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            self.check_running()?;
            if self.ctr(&["version"]).is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("containerd does not answer after 30 s\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Puts `cmd` into the daemons' cgroup (every hierarchy) and the network namespace `netns`,
    /// or into the mount and network namespaces of process `join` when given.
    fn enter_node(&self, cmd: &mut Command, netns: &Path, join: Option<u32>) -> anyhow::Result<()> {
        let mut procs = Vec::new();
        for hierarchy in cgroup_hierarchies()? {
            let path = hierarchy.join(&self.daemons_cgroup).join("cgroup.procs");
            procs.push(OpenOptions::new().write(true).open(&path).with_context(|| format!("opening {}", path.display()))?);
        }
        let (net, mnt) = match join {
            Some(pid) => (File::open(format!("/proc/{pid}/ns/net"))?, Some(File::open(format!("/proc/{pid}/ns/mnt"))?)),
            None => (File::open(netns)?, None),
        };
        // SAFETY: only write(2) and setns(2), both async-signal-safe, between fork and exec; the
        // files are moved into the closure and stay open until exec.
        unsafe {
            use std::os::fd::AsRawFd;
            cmd.pre_exec(move || {
                for mut file in &procs {
                    file.write_all(b"0")?;
                }
                if libc::setns(net.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(mnt) = &mnt {
                    if libc::setns(mnt.as_raw_fd(), libc::CLONE_NEWNS) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// `ctr` against this node's containerd, in the CRI's namespace.
    fn ctr(&self, args: &[&str]) -> anyhow::Result<std::process::Output> {
        let socket = self.path("containerd/containerd.sock");
        let mut cmd = Command::new(CTR);
        cmd.arg("--address").arg(&socket).args(["--namespace", CRI_NAMESPACE]).args(args);
            run(&mut cmd)
    }

    /// The first started process that has exited, as an error with the logs.
    fn check_running(&mut self) -> anyhow::Result<()> {
        for (name, child) in &mut self.processes {
            if let Some(status) = child.try_wait()? {
                let name = *name;
                bail!("{name} exited ({status})\n{}", self.logs());
            }
        }
        Ok(())
    }

    /// `buildah` on the node's image storage (`<dir>/buildah`, vfs), in containerd's mount
    /// namespace, so that what it writes to fixed host paths (its blob-info cache in
    /// /var/lib/containers, a lock in /var/cache/containers) lands in the node's directory; its
    /// stdout on success.
    pub fn buildah(&self, topology: &Topology, args: &[&str]) -> anyhow::Result<String> {
        let storage = self.path("buildah");
        fs::create_dir_all(storage.join("tmp")).with_context(|| format!("creating {}", storage.join("tmp").display()))?;
        let mut cmd = Command::new("buildah");
        self.enter_node(&mut cmd, &topology.node.path(), Some(self.pid_of("containerd")?))?;
        cmd.args(["--storage-driver", "vfs", "--root"])
            .arg(storage.join("root"))
            .arg("--runroot")
            .arg(storage.join("run"))
            .args(args)
            .env("TMPDIR", storage.join("tmp"));
        let out = run(&mut cmd)?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Puts the `debian:<suite>` base image ([`crate::debian_image`]) into the node's buildah
    /// storage under the official names, so that a Containerfile `FROM debian:<suite>` (or
    /// `-slim`) builds here unchanged with `--pull=never`. Returns those names.
    pub fn import_debian_base(&self, topology: &Topology, suite: &str) -> anyhow::Result<[String; 2]> {
        let tar = crate::debian_image::rootfs_tar(suite)?;
        let names = crate::debian_image::image_names(suite);
        let container = self.buildah(topology, &["from", "scratch"])?;
        // ADD of a local tar unpacks it.
        self.buildah(topology, &["add", &container, &tar.display().to_string(), "/"])?;
        self.buildah(topology, &["config", "--cmd", "[\"bash\"]", &container])?;
        self.buildah(topology, &["commit", "--rm", &container, &names[0]])?;
        self.buildah(topology, &["tag", &names[0], &names[1]])?;
        Ok(names)
    }

    /// Images from scratch with buildah (no registry is reachable): the binaries and the shared
    /// libraries `ldd` names, committed, written as OCI archives and imported into containerd.
    fn build_and_import_images(&mut self, topology: &Topology, peers: &Path) -> anyhow::Result<Images> {
        let images = Images { pause: image_ref("pause"), probe: image_ref("probe"), coredns: coredns_ref() };
        let builds: [(&str, PathBuf, &str); 3] = [
            (&images.pause, crate::bin("epx-pause"), "/epx-pause"),
            (&images.probe, crate::bin("epx-probe"), "/usr/local/bin/epx-probe"),
            (&images.coredns, peers.join("coredns"), "/coredns"),
        ];
        let buildah = |args: &[&str]| self.buildah(topology, args);
        for (reference, binary, entrypoint) in builds {
            let container = buildah(&["from", "scratch"])?;
            let mut files = vec![(binary.clone(), PathBuf::from(entrypoint))];
            files.extend(crate::shared_libraries(&binary)?.into_iter().map(|lib| (lib.clone(), lib)));
            for (source, target) in files {
                buildah(&["copy", &container, &source.display().to_string(), &target.display().to_string()])?;
            }
            buildah(&["config", "--entrypoint", &format!("[\"{entrypoint}\"]"), &container])?;
            buildah(&["commit", "--rm", &container, reference])?;
            self.import_image(topology, reference)?;
        }
        Ok(images)
    }

    /// Side-loads `reference` from the node's buildah storage into containerd (as `kind load`):
    /// written as an OCI archive, imported, and checked to be listed.
    pub fn import_image(&self, topology: &Topology, reference: &str) -> anyhow::Result<()> {
        let archive = self.path("buildah").join(format!("{}.tar", reference.replace(['/', ':'], "_")));
        self.buildah(topology, &["push", reference, &format!("oci-archive:{}:{reference}", archive.display())])?;
        self.ctr(&["images", "import", &archive.display().to_string()])?;
        let _ = fs::remove_file(&archive);
        let listed = self.ctr(&["images", "ls", "-q"])?;
        if !String::from_utf8_lossy(&listed.stdout).lines().any(|line| line == reference) {
            bail!("{reference} is not among containerd's images after importing it: {}", String::from_utf8_lossy(&listed.stdout));
        }
        Ok(())
    }

    /// `path` as containerd, kubelet and the pods' hostPath volumes see it: through containerd's
    /// mount namespace, where mounts made for the node (the agent's bpffs) live.
    pub fn node_view(&self, path: &Path) -> anyhow::Result<PathBuf> {
        let relative = path.strip_prefix("/").unwrap_or(path);
        Ok(PathBuf::from(format!("/proc/{}/root", self.pid_of("containerd")?)).join(relative))
    }

    /// kubelet in containerd's network and mount namespaces (its volume mounts must be where
    /// containerd's containers are made).
    fn start_kubelet(&mut self, topology: &Topology, cp: &ControlPlane, peers: &Path) -> anyhow::Result<()> {
        let kubeconfig = cp.direct_kubeconfig("kubelet")?;
        let mut kubelet = Command::new(peers.join("kubelet"));
        kubelet
            .arg(format!("--config={}", self.path("kubelet.yaml").display()))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--root-dir={}", self.path("kubelet").display()))
            .arg(format!("--cert-dir={}", self.path("kubelet/pki").display()))
            .arg(format!("--hostname-override={NODE_NAME}"))
            .arg(format!("--node-ip={NODE_IP}"))
            // Root here lacks CAP_SYS_RESOURCE: kubelet's default -999 would fail.
            .arg("--oom-score-adj=0")
            .arg("--v=2");
        let containerd = self.pid_of("containerd")?;
        self.enter_node(&mut kubelet, &topology.node.path(), Some(containerd))?;
        self.spawn("kubelet", kubelet)
    }

    fn wait_node_ready(&mut self, cp: &ControlPlane) -> anyhow::Result<()> {
        let nodes: Api<NodeObject> = Api::all(cp.client());
        let deadline = Instant::now() + NODE_READY_TIMEOUT;
        loop {
            self.check_running()?;
            let node = cp.block_on(nodes.get_opt(NODE_NAME));
            if let Ok(Some(node)) = node {
                let ready = node
                    .status
                    .and_then(|status| status.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|condition| condition.type_ == "Ready" && condition.status == "True");
                if ready {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                bail!("node {NODE_NAME} not Ready after {NODE_READY_TIMEOUT:?}\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn deploy_coredns(&self, cp: &ControlPlane) -> anyhow::Result<()> {
        let manifest = COREDNS_MANIFEST
            .replace("{image}", &self.images.coredns)
            .replace("{cluster_dns}", &CLUSTER_DNS_IP.to_string())
            .replace("{cluster_domain}", CLUSTER_DOMAIN)
            .replace("{apiserver_ip}", &APISERVER_IP.to_string())
            .replace("{apiserver_port}", &APISERVER_PORT.to_string());
        cp.apply(&manifest).context("applying CoreDNS")
    }

    fn wait_coredns_ready(&mut self, cp: &ControlPlane) -> anyhow::Result<()> {
        let deployments: Api<Deployment> = Api::namespaced(cp.client(), "kube-system");
        let deadline = Instant::now() + COREDNS_READY_TIMEOUT;
        loop {
            self.check_running()?;
            if let Ok(Some(deployment)) = cp.block_on(deployments.get_opt("coredns")) {
                let ready = deployment.status.and_then(|status| status.ready_replicas).unwrap_or(0);
                if ready >= 1 {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                bail!("CoreDNS not Ready after {COREDNS_READY_TIMEOUT:?}\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // kubelet first, so nothing is restarted; then every pod; then containerd and its shims.
        if let Some(index) = self.processes.iter().position(|(name, _)| *name == "kubelet") {
            let (_, child) = self.processes.remove(index);
            kill(child);
        }
        kill_cgroup_everywhere(&self.pods_cgroup);
        while let Some((_, child)) = self.processes.pop() {
            kill(child);
        }
        kill_cgroup_everywhere(&self.daemons_cgroup);
        restore_host(&self.host);
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// `localhost/ebpf-proxy/<name>:<this crate's version>`: versioned, never `latest`.
pub fn image_ref(name: &str) -> String {
    format!("localhost/ebpf-proxy/{name}:{}", env!("CARGO_PKG_VERSION"))
}

/// CoreDNS's image, tagged with the version `coredns -version` reports.
fn coredns_ref() -> String {
    let version = Command::new(peers_dir().join("coredns"))
        .arg("-version")
        .output()
        .ok()
        .and_then(|out| String::from_utf8_lossy(&out.stdout).lines().next().map(str::to_owned))
        .and_then(|line| line.strip_prefix("CoreDNS-").map(|v| format!("v{}", v.trim())))
        .unwrap_or_else(|| "unknown".to_owned());
    format!("localhost/coredns/coredns:{version}")
}

/// Removes what killed nodes left behind (`<tmp>/epxt-*-node`): kills their pods and daemons,
/// restores the kernel settings saved in `host-state.json`, removes the directories and cgroups.
pub fn sweep() {
    let prefix = format!("{}-", crate::PREFIX);
    let mut states = Vec::new();
    if let Ok(entries) = fs::read_dir(std::env::temp_dir()) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(&prefix) && name.ends_with("-node") && !crate::owner_alive(&name) {
                if let Ok(text) = fs::read(entry.path().join("host-state.json")) {
                    if let Ok(state) = serde_json::from_slice::<HostState>(&text) {
                        states.push(state);
                    }
                }
            }
        }
    }
    if let Ok(hierarchies) = cgroup_hierarchies() {
        for hierarchy in hierarchies {
            if let Ok(entries) = fs::read_dir(&hierarchy) {
                for entry in entries.flatten() {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    if name.starts_with(&prefix) && (name.ends_with("-node") || name.ends_with("-noded")) && !crate::owner_alive(&name) {
                        kill_cgroup_everywhere(&name);
                    }
                }
            }
        }
    }
    // The oldest saved state holds the values from before any of these nodes.
    for state in states.iter().rev() {
        restore_host(state);
    }
}

/// What of the host a node changes while it runs, as far as its clean-up must undo it: the kernel
/// settings kubelet writes, which of the host directories it needs exist, the mounts below them
/// (the tests' own `/run/netns/<PREFIX>-*` excepted) and the nodes' cgroups. Equal before a node
/// started and after it was dropped, or the clean-up is broken.
#[derive(Debug, PartialEq, Eq)]
pub struct HostFootprint {
    sysctls: Vec<(String, String)>,
    host_dirs: Vec<(String, bool)>,
    mounts: Vec<String>,
    /// The node cgroups of this process's nodes, and of killed runs.
    cgroups: Vec<PathBuf>,
    /// Another process's node is running: kubelet's host directories and kernel settings are
    /// shared with it, and only this process's cgroups can be compared.
    shared: bool,
}

impl HostFootprint {
    /// Panics, naming what differs, unless the host is as `before` found it.
    pub fn assert_unchanged_since(&self, before: &HostFootprint) {
        if self.shared || before.shared {
            eprintln!("another test process runs a node: only this process's cgroups are compared");
            assert_eq!(self.cgroups, before.cgroups, "the node left cgroups behind");
        } else {
            assert_eq!(self, before, "the node left the host changed");
        }
    }
}

pub fn host_footprint() -> anyhow::Result<HostFootprint> {
    let mut sysctls = Vec::new();
    for sysctl in KUBELET_SYSCTLS {
        let path = Path::new("/proc/sys").join(sysctl);
        let value = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        sysctls.push((sysctl.to_string(), value.trim().to_owned()));
    }
    let host_dirs = PRIVATE_HOST_DIRS.iter().map(|(dir, _)| (dir.to_string(), Path::new(dir).exists())).collect();
    let own_netns = format!("/run/netns/{}-", crate::PREFIX);
    let mounts = fs::read_to_string("/proc/mounts")?
        .lines()
        .filter_map(|line| line.split_whitespace().nth(1))
        .filter(|point| PRIVATE_HOST_DIRS.iter().any(|(dir, _)| Path::new(point).starts_with(dir)) && !point.starts_with(&own_netns))
        .map(str::to_owned)
        .collect();
    let prefix = format!("{}-", crate::PREFIX);
    let (mut cgroups, mut shared) = (Vec::new(), false);
    for hierarchy in cgroup_hierarchies()? {
        for entry in fs::read_dir(&hierarchy)?.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(&prefix) && (name.ends_with("-node") || name.ends_with("-noded")) {
                if crate::owner_alive(&name) && !name.starts_with(&format!("{prefix}{}p", std::process::id())) {
                    shared = true;
                } else {
                    cgroups.push(entry.path());
                }
            }
        }
    }
    Ok(HostFootprint { sysctls, host_dirs, mounts, cgroups, shared })
}

fn restore_host(state: &HostState) {
    for (sysctl, value) in &state.sysctls {
        let path = Path::new("/proc/sys").join(sysctl);
        if let Err(e) = fs::write(&path, value) {
            eprintln!("could not restore {} to {value}: {e}", path.display());
        }
    }
    for dir in &state.created_dirs {
        // Only empty: the node's files were in its own bind mounts, never here.
        let _ = fs::remove_dir(dir);
    }
}

/// The mount points of every cgroup hierarchy (v1 controllers, `name=systemd`, the v2 one).
fn cgroup_hierarchies() -> anyhow::Result<Vec<PathBuf>> {
    let mounts = fs::read_to_string("/proc/mounts")?;
    Ok(mounts
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            matches!(fields.get(2), Some(&"cgroup") | Some(&"cgroup2")).then(|| PathBuf::from(fields[1]))
        })
        .collect())
}

fn create_cgroup_everywhere(name: &str) -> anyhow::Result<()> {
    for hierarchy in cgroup_hierarchies()? {
        let path = hierarchy.join(name);
        fs::create_dir_all(&path).with_context(|| format!("creating cgroup {}", path.display()))?;
        // A new v1 cpuset is empty, and no process can join it until it has CPUs and memory nodes.
        for file in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(parent) = fs::read_to_string(hierarchy.join(file)) {
                fs::write(path.join(file), parent.trim()).with_context(|| format!("writing {}", path.join(file).display()))?;
            }
        }
    }
    Ok(())
}

/// Kills every process in `<hierarchy>/<name>` and below, in every hierarchy, and removes the
/// directories, deepest first.
fn kill_cgroup_everywhere(name: &str) {
    let Ok(hierarchies) = cgroup_hierarchies() else { return };
    for _ in 0..100 {
        let mut remaining = false;
        for hierarchy in &hierarchies {
            let root = hierarchy.join(name);
            if !root.exists() {
                continue;
            }
            remaining = true;
            let mut dirs = Vec::new();
            collect_dirs(&root, &mut dirs);
            for dir in dirs.iter().rev() {
                let pids = fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
                for pid in pids.lines().filter_map(|line| line.trim().parse::<i32>().ok()) {
                    // SAFETY: kill(2) on processes in cgroups this node created.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
                let _ = fs::remove_dir(dir);
            }
        }
        if !remaining {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("some cgroups named {name} could not be removed");
}

fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_owned());
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                collect_dirs(&entry.path(), out);
            }
        }
    }
}

fn kill(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

fn log_file(path: &Path) -> anyhow::Result<File> {
    OpenOptions::new().create(true).append(true).open(path).with_context(|| format!("opening {}", path.display()))
}

fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read(path).map(|bytes| String::from_utf8_lossy(&bytes).into_owned()).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// CoreDNS as upstream's addon manifest (cluster/addons/dns/coredns) has it, with the standard
/// Corefile; only the image is local and the API server is named by address (module docs).
const COREDNS_MANIFEST: &str = r#"
apiVersion: v1
kind: ServiceAccount
metadata: {name: coredns, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: system:coredns
  labels: {kubernetes.io/bootstrapping: rbac-defaults}
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: system:coredns
  labels: {kubernetes.io/bootstrapping: rbac-defaults}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}
subjects:
- {kind: ServiceAccount, name: coredns, namespace: kube-system}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: coredns, namespace: kube-system}
data:
  Corefile: |
    .:53 {
        errors
        health {
            lameduck 5s
        }
        ready
        kubernetes {cluster_domain} in-addr.arpa ip6.arpa {
            pods insecure
            fallthrough in-addr.arpa ip6.arpa
            ttl 30
        }
        prometheus :9153
        forward . /etc/resolv.conf {
            max_concurrent 1000
        }
        cache 30
        loop
        reload
        loadbalance
    }
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: coredns
  namespace: kube-system
  labels: {k8s-app: kube-dns, kubernetes.io/name: CoreDNS}
spec:
  replicas: 1
  selector:
    matchLabels: {k8s-app: kube-dns}
  template:
    metadata:
      labels: {k8s-app: kube-dns}
    spec:
      priorityClassName: system-cluster-critical
      serviceAccountName: coredns
      tolerations:
      - {key: CriticalAddonsOnly, operator: Exists}
      nodeSelector: {kubernetes.io/os: linux}
      containers:
      - name: coredns
        image: {image}
        imagePullPolicy: Never
        args: [-conf, /etc/coredns/Corefile]
        env:
        # The API server itself, not the `kubernetes` Service: DNS must not depend on the
        # Service proxy under test.
        - {name: KUBERNETES_SERVICE_HOST, value: "{apiserver_ip}"}
        - {name: KUBERNETES_SERVICE_PORT, value: "{apiserver_port}"}
        resources:
          limits: {memory: 170Mi}
          requests: {cpu: 100m, memory: 70Mi}
        volumeMounts:
        - {name: config-volume, mountPath: /etc/coredns, readOnly: true}
        ports:
        - {containerPort: 53, name: dns, protocol: UDP}
        - {containerPort: 53, name: dns-tcp, protocol: TCP}
        - {containerPort: 9153, name: metrics, protocol: TCP}
        securityContext:
          allowPrivilegeEscalation: false
          capabilities: {add: [NET_BIND_SERVICE], drop: [ALL]}
          readOnlyRootFilesystem: true
        livenessProbe:
          httpGet: {path: /health, port: 8080, scheme: HTTP}
          initialDelaySeconds: 60
          timeoutSeconds: 5
          successThreshold: 1
          failureThreshold: 5
        readinessProbe:
          httpGet: {path: /ready, port: 8181, scheme: HTTP}
          periodSeconds: 1
      dnsPolicy: Default
      volumes:
      - name: config-volume
        configMap:
          name: coredns
          items:
          - {key: Corefile, path: Corefile}
---
apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels: {k8s-app: kube-dns, kubernetes.io/cluster-service: "true", kubernetes.io/name: CoreDNS}
  annotations: {prometheus.io/port: "9153", prometheus.io/scrape: "true"}
spec:
  selector: {k8s-app: kube-dns}
  clusterIP: {cluster_dns}
  ports:
  - {name: dns, port: 53, protocol: UDP}
  - {name: dns-tcp, port: 53, protocol: TCP}
  - {name: metrics, port: 9153, protocol: TCP}
"#;
