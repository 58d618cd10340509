//! A real control plane for end-to-end tests: upstream etcd and kube-apiserver (built by
//! `cargo xtask peers`) in a pod of a [`Topology`], reachable from the host's loopback.
//!
//! ```text
//!   host netns                      node netns (br0 10.244.1.1)       pod "apiserver" (10.244.1.250)
//!   127.0.0.1:PORT ── Forwarder ──> connect 10.244.1.250:6443 ──────> kube-apiserver :6443
//!                                                                       └─> etcd 127.0.0.1:2379
//! ```
//! Nothing is configured in the host's namespace: the [`Forwarder`] listens on the host's
//! loopback and connects onwards from a thread inside the node namespace.
//!
//! TLS is verified: a throw-away CA signs the serving certificate (IP SANs 127.0.0.1,
//! 10.244.1.250 and 10.96.0.1, the `kubernetes` Service's ClusterIP), and every kubeconfig written
//! here trusts that CA. Authentication is by static bearer tokens (`--token-auth-file`; the admin
//! is in `system:masters`) or ServiceAccount tokens from [`ControlPlane::service_account_token`].
//!
//! There is no kube-controller-manager: nobody creates EndpointSlices (apply them, with the
//! `kubernetes.io/service-name` label), and deleted namespaces stay `Terminating`. The apiserver
//! itself maintains Service `default/kubernetes` (10.96.0.1:443 -> 10.244.1.250:6443).

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, DeleteParams, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::{self, ApiResource, Scope};
use serde::Deserialize;

use crate::forward::Forwarder;
use crate::topology::{run, Topology};

pub const POD: &str = "apiserver";
pub const POD_HOST: u8 = 250;
pub const APISERVER_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, POD_HOST);
pub const APISERVER_PORT: u16 = 6443;
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// ClusterIP of Service `default/kubernetes` (the first address of [`SERVICE_CIDR`]).
pub const KUBERNETES_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 1);
/// Field manager of [`ControlPlane::apply`].
pub const FIELD_MANAGER: &str = "epx-tests";

const READY_TIMEOUT: Duration = Duration::from_secs(60);
const LOG_TAIL_LINES: usize = 40;

/// The directory with `etcd`, `kube-apiserver` and `kube-proxy`: `$EPX_PEERS_DIR`.
pub fn peers_dir() -> PathBuf {
    let dir = std::env::var_os("EPX_PEERS_DIR")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("EPX_PEERS_DIR is not set: run `cargo xtask peers` or `cargo xtask test`"));
    for bin in ["etcd", "kube-apiserver"] {
        assert!(
            dir.join(bin).is_file(),
            "{} is missing: run `cargo xtask peers` or `cargo xtask test`",
            dir.join(bin).display()
        );
    }
    dir
}

/// etcd and kube-apiserver in pod [`POD`] of a topology, an admin client, and blocking helpers.
/// On drop the processes are killed and the forwarder and the files are removed.
pub struct ControlPlane {
    /// `https://127.0.0.1:PORT` on the host's loopback.
    pub url: String,
    /// A kubeconfig for `url` with the admin token (group `system:masters`).
    pub admin_kubeconfig: PathBuf,
    /// Certificates, tokens, etcd data, logs (`etcd.log`, `kube-apiserver.log`), kubeconfigs.
    pub dir: PathBuf,
    /// The CA that signed the apiserver's serving certificate.
    pub ca_cert: PathBuf,
    etcd: Option<Child>,
    apiserver: Option<Child>,
    /// The node namespace the forwarders connect from.
    node_netns: PathBuf,
    /// The pod namespace etcd listens in (on its loopback).
    etcd_netns: PathBuf,
    /// Kept to start the apiserver again: it enters the pod's namespace and the topology's cgroup.
    apiserver_cmd: Command,
    /// Kept to start etcd again, as `apiserver_cmd`.
    etcd_cmd: Command,
    forwarder: Forwarder,
    client: kube::Client,
    runtime: tokio::runtime::Runtime,
}

impl ControlPlane {
    /// Adds pod [`POD`] at 10.244.1.250 to `topology`, starts etcd (on 127.0.0.1 inside the pod)
    /// and kube-apiserver there, and waits until `/readyz` answers `ok`.
    pub fn start(topology: &mut Topology) -> anyhow::Result<Self> {
        Self::start_with(topology, &[])
    }

    /// As [`ControlPlane::start`], with extra kube-apiserver flags (e.g. `--watch-cache=false`).
    pub fn start_with(topology: &mut Topology, apiserver_args: &[&str]) -> anyhow::Result<Self> {
        let peers = peers_dir();
        topology.add_pod(POD, POD_HOST)?;
        let dir = std::env::temp_dir().join(format!("{}-{}-cp", crate::PREFIX, topology.id));
        if dir.exists() {
            fs::remove_dir_all(&dir).with_context(|| format!("removing stale {}", dir.display()))?;
        }
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        // From here on, a failure removes the directory through `Cleanup`.
        let mut cleanup = Cleanup { dir: Some(dir.clone()), children: Vec::new() };

        let ca_cert = make_certificates(&dir)?;
        let admin_token = random_token()?;
        fs::write(dir.join("tokens.csv"), format!("{admin_token},epx-admin,epx-admin,\"system:masters\"\n"))?;

        let etcd_log = log_file(&dir.join("etcd.log"))?;
        let mut etcd_cmd = topology.command_in(POD, &peers.join("etcd"))?;
        etcd_cmd
            .args(["--name", "epx"])
            .arg("--data-dir")
            .arg(dir.join("etcd"))
            .args(["--listen-client-urls", "http://127.0.0.1:2379"])
            .args(["--advertise-client-urls", "http://127.0.0.1:2379"])
            .args(["--listen-peer-urls", "http://127.0.0.1:2380"])
            .args(["--initial-advertise-peer-urls", "http://127.0.0.1:2380"])
            .args(["--initial-cluster", "epx=http://127.0.0.1:2380"])
            .args(["--unsafe-no-fsync", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(etcd_log.try_clone()?)
            .stderr(etcd_log);
        cleanup.children.push(etcd_cmd.spawn().context("starting etcd")?);

        let mut apiserver_cmd = topology.command_in(POD, &peers.join("kube-apiserver"))?;
        let path = |name: &str| dir.join(name).into_os_string().into_string().expect("temp dir paths are UTF-8");
        apiserver_cmd
            .arg("--etcd-servers=http://127.0.0.1:2379")
            .arg(format!("--advertise-address={APISERVER_IP}"))
            .arg(format!("--secure-port={APISERVER_PORT}"))
            .arg(format!("--service-cluster-ip-range={SERVICE_CIDR}"))
            .arg(format!("--cert-dir={}", path("certs")))
            .arg(format!("--tls-cert-file={}", path("serving.crt")))
            .arg(format!("--tls-private-key-file={}", path("serving.key")))
            .arg(format!("--token-auth-file={}", path("tokens.csv")))
            // How it authenticates to kubelets (logs, exec): a client certificate of the test CA
            // in group system:masters, which a kubelet trusting that CA authorizes.
            .arg(format!("--kubelet-client-certificate={}", path("kubelet-client.crt")))
            .arg(format!("--kubelet-client-key={}", path("kubelet-client.key")))
            .arg("--authorization-mode=RBAC")
            .arg("--service-account-issuer=https://kubernetes.default.svc.cluster.local")
            .arg(format!("--service-account-key-file={}", path("sa.key")))
            .arg(format!("--service-account-signing-key-file={}", path("sa.key")))
            // Fewer start-up hooks and no background work the tests do not need.
            .arg("--enable-priority-and-fairness=false")
            .arg("--profiling=false")
            .arg("--v=1")
            .args(apiserver_args)
            .stdin(Stdio::null())
            .stdout(log_file(&dir.join("kube-apiserver.log"))?)
            .stderr(log_file(&dir.join("kube-apiserver.log"))?);
        let started = Instant::now();
        let apiserver = apiserver_cmd.spawn().context("starting kube-apiserver")?;
        cleanup.children.push(apiserver);

        let forwarder = Forwarder::start(&topology.node.path(), SocketAddr::from((APISERVER_IP, APISERVER_PORT)))?;
        let url = format!("https://{}", forwarder.addr());
        let admin_kubeconfig = dir.join("admin.kubeconfig");
        write_kubeconfig(&url, &ca_cert, &admin_token, &admin_kubeconfig)?;

        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("control-plane")
            .enable_all()
            .build()
            .context("building the control plane's tokio runtime")?;
        let client = runtime.block_on(client_from(&admin_kubeconfig))?;

        let apiserver = cleanup.children.pop();
        let etcd = cleanup.children.pop();
        cleanup.dir = None;
        let mut cp = Self {
            url,
            admin_kubeconfig,
            dir,
            ca_cert,
            etcd,
            apiserver,
            apiserver_cmd,
            etcd_cmd,
            node_netns: topology.node.path(),
            etcd_netns: topology.pod(POD).netns.path(),
            forwarder,
            client,
            runtime,
        };
        cp.wait_ready()?;
        cp.wait_for_kubernetes_service()?;
        eprintln!("control plane ready in {:.1?} at {}", started.elapsed(), cp.url);
        Ok(cp)
    }

    /// An admin client (group `system:masters`). Its tasks run on this control plane's runtime,
    /// so it works from any thread and inside [`ControlPlane::block_on`].
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// A client that authenticates as `kubeconfig` says (e.g. one from [`Self::kubeconfig_for_token`]).
    pub fn client_for_kubeconfig(&self, kubeconfig: &Path) -> anyhow::Result<kube::Client> {
        self.block_on(client_from(kubeconfig))
    }

    /// Runs a future on this control plane's runtime (for the async `kube` API in sync tests).
    pub fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }

    /// A second way in to the same API server: its own loopback forwarder and an admin
    /// kubeconfig `<dir>/<name>.kubeconfig` for it. Black-holing it cuts off only the client that
    /// uses it (e.g. the agent) while the test keeps changing objects through [`Self::url`].
    pub fn extra_access(&self, name: &str) -> anyhow::Result<(Forwarder, PathBuf)> {
        let forwarder = Forwarder::start(&self.node_netns, SocketAddr::from((APISERVER_IP, APISERVER_PORT)))?;
        let path = self.admin_kubeconfig_for(name, &format!("https://{}", forwarder.addr()))?;
        Ok((forwarder, path))
    }

    /// A way in for processes inside another network namespace `netns` (e.g. a second node's):
    /// a forwarder listening on that namespace's loopback, and an admin kubeconfig
    /// `<dir>/<name>.kubeconfig` that names it (the serving certificate holds 127.0.0.1).
    pub fn access_from(&self, netns: &Path, name: &str) -> anyhow::Result<(Forwarder, PathBuf)> {
        let forwarder = Forwarder::start_in(netns, &self.node_netns, SocketAddr::from((APISERVER_IP, APISERVER_PORT)))?;
        let path = self.admin_kubeconfig_for(name, &format!("https://{}", forwarder.addr()))?;
        Ok((forwarder, path))
    }

    /// An admin kubeconfig `<dir>/<name>.kubeconfig` that names the API server's own address
    /// (10.244.1.250), for clients inside the topology's node namespace (no forwarder between).
    pub fn direct_kubeconfig(&self, name: &str) -> anyhow::Result<PathBuf> {
        self.admin_kubeconfig_for(name, &format!("https://{APISERVER_IP}:{APISERVER_PORT}"))
    }

    /// The admin kubeconfig with another server URL, as `<dir>/<name>.kubeconfig` (e.g. for a
    /// [`Forwarder::start_in`] that listens inside a node namespace).
    pub fn admin_kubeconfig_for(&self, name: &str, url: &str) -> anyhow::Result<PathBuf> {
        let admin = fs::read_to_string(&self.admin_kubeconfig)?;
        anyhow::ensure!(admin.contains(&self.url), "admin kubeconfig does not name {}", self.url);
        let path = self.dir.join(format!("{name}.kubeconfig"));
        fs::write(&path, admin.replace(&self.url, url))?;
        Ok(path)
    }

    /// Compacts etcd's history up to its current revision (as the API server's periodic
    /// compaction does, only now): a watch that resumes from an older resource version and is
    /// not served from the API server's watch cache gets `410 Gone`. Returns the revision.
    pub fn compact_etcd(&self) -> anyhow::Result<u64> {
        // etcd's JSON gateway on its loopback, reached through a forwarder into the pod.
        let etcd = Forwarder::start(&self.etcd_netns, SocketAddr::from((Ipv4Addr::LOCALHOST, 2379)))?;
        // Any key: the answer's header carries the current revision.
        let range = etcd_post(etcd.addr(), "/v3/kv/range", r#"{"key":"AA=="}"#)?;
        let revision: u64 = range["header"]["revision"]
            .as_str()
            .and_then(|r| r.parse().ok())
            .with_context(|| format!("no revision in etcd's answer {range}"))?;
        etcd_post(etcd.addr(), "/v3/kv/compaction", &format!(r#"{{"revision":"{revision}","physical":true}}"#))?;
        Ok(revision)
    }

    /// The forwarder behind [`ControlPlane::url`], e.g. to black-hole the API.
    pub fn forwarder(&self) -> &Forwarder {
        &self.forwarder
    }

    /// Creates or replaces every object of a multi-document YAML by server-side apply (field
    /// manager [`FIELD_MANAGER`], forced). Namespaced objects without a namespace go to
    /// `default`; a missing namespace is created first.
    pub fn apply(&self, yaml: &str) -> anyhow::Result<()> {
        self.apply_with(yaml, PatchParams::apply(FIELD_MANAGER).force())
    }

    /// Server-side apply with `dryRun=All`: the API server validates and admits every object
    /// (RBAC, schema, defaulting) but stores nothing.
    pub fn apply_dry_run(&self, yaml: &str) -> anyhow::Result<()> {
        self.apply_with(yaml, PatchParams::apply(FIELD_MANAGER).force().dry_run())
    }

    fn apply_with(&self, yaml: &str, params: PatchParams) -> anyhow::Result<()> {
        let objects = parse_objects(yaml)?;
        self.block_on(async {
            for object in objects {
                let (api, name) = self.api_for(&object).await?;
                api.patch(&name, &params, &Patch::Apply(&object))
                    .await
                    .with_context(|| format!("applying {}", describe(&object)))?;
            }
            Ok(())
        })
    }

    /// Deletes one object. Objects with finalizers (e.g. Namespaces, which need the absent
    /// kube-controller-manager) are only marked for deletion.
    pub fn delete(&self, api_version: &str, kind: &str, namespace: &str, name: &str) -> anyhow::Result<()> {
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        let gvk = GroupVersionKind::gvk(group, version, kind);
        self.block_on(async {
            let (resource, capabilities) = discovery::pinned_kind(&self.client, &gvk)
                .await
                .with_context(|| format!("looking up {api_version} {kind}"))?;
            let api: Api<DynamicObject> = match capabilities.scope {
                Scope::Namespaced => Api::namespaced_with(self.client.clone(), namespace, &resource),
                Scope::Cluster => Api::all_with(self.client.clone(), &resource),
            };
            api.delete(name, &DeleteParams::default())
                .await
                .with_context(|| format!("deleting {api_version} {kind} {namespace}/{name}"))?;
            Ok(())
        })
    }

    /// kube-apiserver's process id while it runs (its CPU time for the fleet benchmark).
    pub fn apiserver_pid(&self) -> Option<u32> {
        self.apiserver.as_ref().map(Child::id)
    }

    /// kube-apiserver's `/metrics` text (Prometheus format), read with the admin client.
    pub fn metrics_text(&self) -> anyhow::Result<String> {
        let request = http::Request::get("/metrics").body(Vec::new()).context("building GET /metrics")?;
        let client = self.client.clone();
        self.block_on(async { tokio::time::timeout(Duration::from_secs(10), client.request_text(request)).await })
            .context("GET /metrics of kube-apiserver timed out after 10 s")?
            .context("GET /metrics of kube-apiserver")
    }

    /// Kills kube-apiserver (SIGKILL: the master fails, as in a crash or a lost machine); etcd
    /// keeps running.
    pub fn stop_apiserver(&mut self) -> anyhow::Result<()> {
        kill_process(&mut self.apiserver, "kube-apiserver")
    }

    /// Starts kube-apiserver again (same flags, same etcd) and waits until it is ready.
    pub fn start_apiserver(&mut self) -> anyhow::Result<()> {
        if self.apiserver.is_some() {
            bail!("kube-apiserver is already running");
        }
        let started = Instant::now();
        self.apiserver = Some(self.apiserver_cmd.spawn().context("starting kube-apiserver")?);
        self.wait_ready()?;
        eprintln!("kube-apiserver ready again in {:.1?}", started.elapsed());
        Ok(())
    }

    /// Kills etcd and kube-apiserver (SIGKILL, apiserver first): the whole master is gone.
    pub fn stop_master(&mut self) -> anyhow::Result<()> {
        self.stop_apiserver()?;
        kill_process(&mut self.etcd, "etcd")
    }

    /// Starts etcd (same data) and kube-apiserver again after [`ControlPlane::stop_master`], and
    /// waits until the API server is ready.
    pub fn start_master(&mut self) -> anyhow::Result<()> {
        if self.etcd.is_some() {
            bail!("etcd is already running");
        }
        self.etcd = Some(self.etcd_cmd.spawn().context("starting etcd")?);
        self.start_apiserver()
    }

    /// Writes a kubeconfig for [`ControlPlane::url`] that authenticates with `token`.
    pub fn kubeconfig_for_token(&self, token: &str, path: &Path) -> anyhow::Result<()> {
        write_kubeconfig(&self.url, &self.ca_cert, token, path)
    }

    /// A token for ServiceAccount `namespace/name` (created, with its namespace, if missing),
    /// valid for an hour. Give it rights with RBAC objects through [`ControlPlane::apply`].
    pub fn service_account_token(&self, namespace: &str, name: &str) -> anyhow::Result<String> {
        self.block_on(async {
            self.ensure_namespace(namespace).await?;
            let accounts: Api<ServiceAccount> = Api::namespaced(self.client.clone(), namespace);
            if accounts.get_opt(name).await?.is_none() {
                let account = ServiceAccount {
                    metadata: ObjectMeta { name: Some(name.to_owned()), ..ObjectMeta::default() },
                    ..ServiceAccount::default()
                };
                accounts
                    .create(&PostParams::default(), &account)
                    .await
                    .with_context(|| format!("creating ServiceAccount {namespace}/{name}"))?;
            }
            let request = TokenRequest {
                spec: TokenRequestSpec { expiration_seconds: Some(3600), ..TokenRequestSpec::default() },
                ..TokenRequest::default()
            };
            let issued = accounts
                .create_token_request(name, &PostParams::default(), &request)
                .await
                .with_context(|| format!("requesting a token for ServiceAccount {namespace}/{name}"))?;
            issued.status.map(|status| status.token).context("TokenRequest without a token")
        })
    }

    /// The last lines of the etcd and kube-apiserver logs.
    pub fn logs(&self) -> String {
        format!(
            "--- kube-apiserver.log (last {LOG_TAIL_LINES} lines) ---\n{}\n--- etcd.log (last {LOG_TAIL_LINES} lines) ---\n{}",
            tail(&self.dir.join("kube-apiserver.log")),
            tail(&self.dir.join("etcd.log"))
        )
    }

    /// The namespaced or cluster-wide API for `object`, and its name.
    async fn api_for(&self, object: &DynamicObject) -> anyhow::Result<(Api<DynamicObject>, String)> {
        let types = object.types.as_ref().with_context(|| format!("{} has no apiVersion/kind", describe(object)))?;
        let gvk = GroupVersionKind::try_from(types).with_context(|| format!("apiVersion of {}", describe(object)))?;
        let name = object.metadata.name.clone().with_context(|| format!("{} has no metadata.name", describe(object)))?;
        let (resource, capabilities): (ApiResource, _) = discovery::pinned_kind(&self.client, &gvk)
            .await
            .with_context(|| format!("looking up {}", describe(object)))?;
        let api = match capabilities.scope {
            Scope::Namespaced => {
                let namespace = object.metadata.namespace.as_deref().unwrap_or("default");
                self.ensure_namespace(namespace).await?;
                Api::namespaced_with(self.client.clone(), namespace, &resource)
            }
            Scope::Cluster => Api::all_with(self.client.clone(), &resource),
        };
        Ok((api, name))
    }

    /// Creates `namespace` unless it exists (create, not apply: the YAML may apply it too).
    async fn ensure_namespace(&self, namespace: &str) -> anyhow::Result<()> {
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        if namespaces.get_opt(namespace).await?.is_some() {
            return Ok(());
        }
        let object = Namespace {
            metadata: ObjectMeta { name: Some(namespace.to_owned()), ..ObjectMeta::default() },
            ..Namespace::default()
        };
        match namespaces.create(&PostParams::default(), &object).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.is_already_exists() => Ok(()),
            Err(e) => Err(e).with_context(|| format!("creating namespace {namespace}")),
        }
    }

    /// The first of etcd and kube-apiserver that is not running, with how it ended.
    fn exited(&mut self) -> anyhow::Result<Option<(&'static str, String)>> {
        for (name, child) in [("etcd", &mut self.etcd), ("kube-apiserver", &mut self.apiserver)] {
            match child {
                None => return Ok(Some((name, "stopped".to_owned()))),
                Some(child) => {
                    if let Some(status) = child.try_wait()? {
                        return Ok(Some((name, status.to_string())));
                    }
                }
            }
        }
        Ok(None)
    }

    /// Waits until `/readyz` answers `ok`, failing early (with the logs) if a process exits.
    /// `/readyz` can answer before the API server's bootstrap controller has created Service
    /// `default/kubernetes`; a cluster is only complete with it.
    fn wait_for_kubernetes_service(&self) -> anyhow::Result<()> {
        let services: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(self.client.clone(), "default");
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(Some(_)) = self.block_on(services.get_opt("kubernetes")) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("Service default/kubernetes not created after {READY_TIMEOUT:?}\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some((name, status)) = self.exited()? {
                bail!("{name} is not running ({status}) while waiting for readiness\n{}", self.logs());
            }
            let request = http::Request::get("/readyz").body(Vec::new()).context("building GET /readyz")?;
            let client = self.client.clone();
            let answer = self.block_on(async {
                tokio::time::timeout(Duration::from_secs(2), client.request_text(request)).await
            });
            let last = match answer {
                Ok(Ok(body)) if body.trim() == "ok" => return Ok(()),
                Ok(Ok(body)) => body,
                Ok(Err(e)) => format!("{e:#}"),
                Err(_) => "timed out after 2 s".to_owned(),
            };
            if Instant::now() >= deadline {
                bail!("kube-apiserver not ready after {READY_TIMEOUT:?} (last /readyz: {last})\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        for child in [self.apiserver.take(), self.etcd.take()].into_iter().flatten() {
            kill(child);
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Removes what a half-finished [`ControlPlane::start`] created.
struct Cleanup {
    dir: Option<PathBuf>,
    children: Vec<Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for child in self.children.drain(..).rev() {
            kill(child);
        }
        if let Some(dir) = &self.dir {
            let _ = fs::remove_dir_all(dir);
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

fn tail(path: &Path) -> String {
    let mut text = String::new();
    if let Ok(mut file) = File::open(path) {
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = file.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
        let mut bytes = Vec::new();
        let _ = file.read_to_end(&mut bytes);
        text = String::from_utf8_lossy(&bytes).into_owned();
    }
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}

/// 32 hex digits from the kernel's random pool.
fn random_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 16];
    File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)).context("reading /dev/urandom")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

const OPENSSL_CONFIG: &str = "\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = placeholder
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[serving]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
subjectAltName = IP:127.0.0.1,IP:10.244.1.250,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
[client]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
";

/// A CA, a serving certificate it signed (`serving.crt`/`.key`), the ServiceAccount signing
/// key (`sa.key`) and the apiserver's client certificate for kubelets (`kubelet-client.crt`/`.key`),
/// with openssl. Returns the CA certificate's path.
fn make_certificates(dir: &Path) -> anyhow::Result<PathBuf> {
    let config = dir.join("openssl.cnf");
    fs::write(&config, OPENSSL_CONFIG)?;
    let openssl = || {
        let mut cmd = Command::new("openssl");
        cmd.current_dir(dir);
        cmd
    };
    let ok = |cmd: &mut Command| run(cmd).context("openssl is needed for the control plane (run `cargo xtask setup`)");
    ok(openssl().args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=epx-test-ca"])
        .args(["-keyout", "ca.key", "-out", "ca.crt", "-config", "openssl.cnf", "-extensions", "ca"]))?;
    ok(openssl().args(["req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver"])
        .args(["-keyout", "serving.key", "-out", "serving.csr", "-config", "openssl.cnf"]))?;
    ok(openssl().args(["x509", "-req", "-in", "serving.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-set_serial", "2"])
        .args(["-days", "2", "-out", "serving.crt", "-extfile", "openssl.cnf", "-extensions", "serving"]))?;
    ok(openssl().args(["genrsa", "-out", "sa.key", "2048"]))?;
    ok(openssl().args(["req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", "/O=system:masters/CN=kube-apiserver-kubelet-client"])
        .args(["-keyout", "kubelet-client.key", "-out", "kubelet-client.csr", "-config", "openssl.cnf"]))?;
    ok(openssl().args(["x509", "-req", "-in", "kubelet-client.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-set_serial", "3"])
        .args(["-days", "2", "-out", "kubelet-client.crt", "-extfile", "openssl.cnf", "-extensions", "client"]))?;
    Ok(dir.join("ca.crt"))
}

fn write_kubeconfig(url: &str, ca_cert: &Path, token: &str, path: &Path) -> anyhow::Result<()> {
    let kubeconfig = format!(
        "apiVersion: v1
kind: Config
clusters:
- name: epx
  cluster:
    server: {url}
    certificate-authority: {ca}
users:
- name: epx
  user:
    token: {token}
contexts:
- name: epx
  context:
    cluster: epx
    user: epx
current-context: epx
",
        ca = ca_cert.display()
    );
    fs::write(path, kubeconfig).with_context(|| format!("writing {}", path.display()))
}

async fn client_from(kubeconfig: &Path) -> anyhow::Result<kube::Client> {
    let file = kube::config::Kubeconfig::read_from(kubeconfig).with_context(|| format!("reading {}", kubeconfig.display()))?;
    let config = kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
        .await
        .with_context(|| format!("using {}", kubeconfig.display()))?;
    kube::Client::try_from(config).context("building the Kubernetes client")
}

/// The objects of a multi-document YAML (empty documents skipped).
fn parse_objects(yaml: &str) -> anyhow::Result<Vec<DynamicObject>> {
    let mut objects = Vec::new();
    for (index, document) in serde_yaml::Deserializer::from_str(yaml).enumerate() {
        let value = serde_yaml::Value::deserialize(document).with_context(|| format!("YAML document {}", index + 1))?;
        if value.is_null() {
            continue;
        }
        let object: DynamicObject =
            serde_yaml::from_value(value).with_context(|| format!("YAML document {} is not a Kubernetes object", index + 1))?;
        objects.push(object);
    }
    Ok(objects)
}

fn describe(object: &DynamicObject) -> String {
    let kind = object.types.as_ref().map_or("<no kind>", |t| t.kind.as_str());
    let namespace = object.metadata.namespace.as_deref().map(|ns| format!("{ns}/")).unwrap_or_default();
    format!("{kind} {namespace}{}", object.metadata.name.as_deref().unwrap_or("<no name>"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_multi_document_yaml() {
        let objects = parse_objects(
            "---\napiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: demo}\n---\n\
             ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1}\naddressType: IPv4\n",
        )
        .expect("parse");
        assert_eq!(objects.len(), 2);
        assert_eq!(describe(&objects[0]), "Service demo/web");
        assert_eq!(describe(&objects[1]), "EndpointSlice web-1");
        assert!(parse_objects("kind: [").is_err());
    }
}

/// One HTTP/1.1 POST with a JSON body to etcd's gateway; the answer's JSON body.
fn etcd_post(addr: SocketAddr, path: &str, body: &str) -> anyhow::Result<serde_json::Value> {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(addr).with_context(|| format!("connecting to etcd via {addr}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).context("reading etcd's answer")?;
    let (head, body) = answer.split_once("\r\n\r\n").with_context(|| format!("malformed answer from etcd: {answer}"))?;
    anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "etcd {path}: {head}\n{body}");
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        // Size line, data, CRLF, ..., "0".
        let mut data = String::new();
        let mut rest = body;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let size = usize::from_str_radix(size.trim(), 16).with_context(|| format!("bad chunk in {body}"))?;
            if size == 0 || after.len() < size {
                break;
            }
            data.push_str(&after[..size]);
            rest = after[size..].trim_start_matches("\r\n");
        }
        data
    } else {
        body.to_owned()
    };
    serde_json::from_str(body.trim()).with_context(|| format!("etcd {path} answered {body}"))
}

/// SIGKILLs and reaps the process in `slot`, leaving it empty.
fn kill_process(slot: &mut Option<Child>, name: &str) -> anyhow::Result<()> {
    let mut child = slot.take().with_context(|| format!("{name} is not running"))?;
    child.kill().with_context(|| format!("killing {name}"))?;
    child.wait().with_context(|| format!("reaping {name}"))?;
    Ok(())
}
