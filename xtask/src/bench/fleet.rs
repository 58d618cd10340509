//! The fleet: many nodes' proxies against one kube-apiserver, seen from the API server's side.
//!
//! Each simulated node is a network namespace with only its loopback, a forwarder to the API
//! server on that loopback, a Node object of its own (`fleet-i`), and one proxy: the agent
//! (socket-level programs on a cgroup of its own, no interface, small flow tables) or a real
//! kube-proxy (what it programs stays in its namespace). No traffic flows: what is measured is
//! what the nodes ask of the API server, and when each has the cluster's state.
//!
//! Per proxy: the requests the nodes' start caused; the API server's requests/s and CPU at
//! steady state; then the API server is killed for the outage and started again (same etcd), a
//! new Service is created as soon as it is ready, and each node is timed until that Service is
//! in its datapath (convergence). The requests the API server served from its start until the
//! last node converged (the relist herd) and its CPU meanwhile. A run with no node first gives
//! the API server's own share of each figure (its loopback clients, its start).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use e2e::agent::{Agent, AgentDir};
use e2e::audit::Audit;
use e2e::control_plane::ControlPlane;
use e2e::forward::Forwarder;
use e2e::kube_proxy::{self, KubeProxy, Mode};
use e2e::topology::{Cgroup, Netns};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, PostParams};
use serde::{Deserialize, Serialize};

use super::{check_interrupted, cpu_seconds, Progress, CLUSTER_CIDR, NAMESPACE, NODEPORT_CIDR};

/// Small flow tables: a simulated node carries no traffic, and a hundred agents with the
/// default tables would hold gigabytes of kernel memory (LRU maps are allocated whole).
const AGENT_ARGS: &[&str] =
    &["--map-size-ct=1024", "--map-size-ct6=1024", "--map-size-rev-sock=1024", "--map-size-rev-sock6=1024", "--map-size-affinity=1024"];

/// Non-resource paths the bench itself asks for (and the API server's readiness): left out of
/// the requests counted.
const OWN_PATHS: &[&str] = &["/metrics", "/readyz", "/livez", "/healthz"];

/// ClusterIP of the Service created once the API server is back (one per proxy's run).
const MARKER_IP: &str = "10.96.250.1";
const MARKER: &str = "fleet-marker";

/// kube-apiserver's audit log of `GET /version` (non-resource requests are not in
/// `apiserver_request_total`): a policy that records only those, one line per request.
pub fn version_audit() -> anyhow::Result<Audit> {
    Audit::new("- level: Metadata\n  nonResourceURLs: [/version, /version/*]")
}

/// `GET /version` requests answered so far, every kube-apiserver process included.
fn versions(audit: &Audit) -> anyhow::Result<f64> {
    Ok(audit.lines()?.iter().filter(|line| line.contains("\"/version")).count() as f64)
}

/// What the fleet part runs.
pub struct Plan {
    pub nodes: usize,
    /// Services (10 endpoints each) in the API while it runs.
    pub services: usize,
    pub steady: Duration,
    pub outage: Duration,
    /// Nodes not converged this long after the API server is back are counted as such.
    pub converge_limit: Duration,
    /// Idle time after the nodes have started, before the steady-state window.
    pub settle: Duration,
    pub kinds: Vec<Kind>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The API server alone: its own share of every figure.
    None,
    Ebpf,
    /// kube-proxy in nftables mode (its informers, hence its requests, are the same in
    /// iptables mode; nftables programs 1 000 Services in a fraction of iptables' time).
    KubeProxy,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::None => "none",
            Kind::Ebpf => "ebpf-proxy",
            Kind::KubeProxy => "kube-proxy-nftables",
        }
    }
}

/// One proxy's fleet run (or the API server alone: `proxy` = `none`, `nodes` = 0).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FleetRun {
    pub proxy: String,
    pub nodes: usize,
    pub services: usize,
    /// Requests the nodes' start caused (first node started → every node serving), by verb and
    /// resource (`GET /version` for a non-resource path).
    pub start_requests: BTreeMap<String, f64>,
    pub steady_s: f64,
    /// Requests per second at steady state, by verb and resource.
    pub steady_rps: BTreeMap<String, f64>,
    /// API server CPU seconds per second at steady state.
    pub steady_cpu: f64,
    /// Watches open once the nodes have started (`apiserver_longrunning_requests`).
    pub steady_watches: f64,
    pub outage_s: f64,
    /// Connections the nodes opened to the API server's address while it was down (each an
    /// attempt: a request, a watch, a probe), counted by their forwarders.
    pub outage_connections: f64,
    /// Per converged node: seconds from the API server answering `/readyz` again until the
    /// Service created then is in its datapath.
    pub converge_s: Vec<f64>,
    /// Nodes that had not converged within the limit.
    pub not_converged: usize,
    /// Seconds from the API server's start until the last node converged (or the limit).
    pub recovery_s: f64,
    /// Requests the API server served in that time, by verb and resource.
    pub recovery_requests: BTreeMap<String, f64>,
    /// The most requests in one second from `/readyz` ok until the last node converged (sampled
    /// about every second; what came before readiness is in the total only).
    pub recovery_peak_rps: f64,
    /// API server CPU seconds in that time, its own start included.
    pub recovery_cpu: f64,
    /// Watches open when the last node converged.
    pub recovery_watches: f64,
    /// CPU seconds the nodes' proxies spent from the outage until the last one converged (with
    /// the children they waited for: kube-proxy's `nft`), all nodes together. They share this
    /// machine's cores, so a slow recovery may be their own CPU running out.
    #[serde(default)]
    pub recovery_node_cpu: f64,
}

/// Total of a by-request map.
pub fn total(requests: &BTreeMap<String, f64>) -> f64 {
    requests.values().sum()
}

/// One simulated node. Fields drop in order: the proxy first, the namespace last.
struct Member {
    proxy: MemberProxy,
    access: Forwarder,
    _netns: Netns,
    /// [`Member::programmed`] before the outage.
    before: f64,
}

enum MemberProxy {
    Agent { agent: Agent, _dir: AgentDir, _cgroup: Cgroup },
    KubeProxy(KubeProxy),
}

impl Member {
    /// A figure of the proxy's own `/metrics` that grows once the marker Service is programmed:
    /// the agent's `ebpf_proxy_services_programmed`; kube-proxy's count of
    /// `kubeproxy_network_programming_duration_seconds` (the marker's slice carries a trigger
    /// time; a relist of unchanged slices records nothing). Cheap to read: a hundred `nft`
    /// listings of a 1 000-Service ruleset take too long to poll.
    fn pid(&self) -> Option<u32> {
        match &self.proxy {
            MemberProxy::Agent { agent, .. } => agent.pid(),
            MemberProxy::KubeProxy(proxy) => proxy.pid(),
        }
    }

    fn programmed(&self) -> anyhow::Result<f64> {
        match &self.proxy {
            MemberProxy::Agent { agent, .. } => agent.metric("ebpf_proxy_services_programmed"),
            MemberProxy::KubeProxy(proxy) => Ok(super::programming_duration(&proxy.metrics()?, "kube-proxy")?.1),
        }
    }

    /// Whether the marker Service is in this node's datapath.
    fn converged(&self) -> bool {
        self.programmed().is_ok_and(|now| now > self.before)
    }
}

/// Starts `count` nodes of `kind`; returns when every one serves.
fn start_members(api: &ControlPlane, kind: Kind, count: usize) -> anyhow::Result<Vec<Member>> {
    let mut members = Vec::with_capacity(count);
    for i in 0..count {
        check_interrupted()?;
        let id = e2e::unique_id();
        let node_name = format!("fleet-{i}");
        let netns = Netns::create(&format!("{}-{id}-fleet", e2e::PREFIX))?;
        let (access, kubeconfig) = api.access_from(&netns.path(), &format!("fleet-{}-{i}", kind.name()))?;
        let proxy = match kind {
            Kind::None => unreachable!("no node runs without a proxy"),
            Kind::Ebpf => {
                let cgroup = Cgroup::create(&format!("{}-{id}-fleet", e2e::PREFIX))?;
                let dir = AgentDir::new(&format!("{id}-fleet"))?;
                let agent = Agent::start_kube_as(&node_name, &netns.path(), &cgroup.path, &dir, &kubeconfig, AGENT_ARGS)
                    .with_context(|| format!("starting the agent of {node_name}"))?;
                MemberProxy::Agent { agent, _dir: dir, _cgroup: cgroup }
            }
            Kind::KubeProxy => MemberProxy::KubeProxy(KubeProxy::start(kube_proxy::Config {
                mode: Mode::Nftables,
                netns: netns.path(),
                kubeconfig,
                node_name: node_name.clone(),
                cluster_cidr: CLUSTER_CIDR.into(),
                nodeport_addresses: NODEPORT_CIDR.into(),
                log: api.dir.join(format!("{node_name}-{}.log", kind.name())),
            })?),
        };
        members.push(Member { proxy, access, _netns: netns, before: 0.0 });
    }
    // kube-proxies are all started first, then waited for (each takes a sync).
    for (i, member) in members.iter_mut().enumerate() {
        if let MemberProxy::KubeProxy(proxy) = &mut member.proxy {
            check_interrupted()?;
            proxy.wait_healthy(Duration::from_secs(300)).with_context(|| format!("kube-proxy of fleet-{i}"))?;
        }
    }
    Ok(members)
}

/// `apiserver_request_total` by verb and resource (or non-resource path), the bench's own
/// paths left out.
fn requests(api: &ControlPlane, audit: &Audit) -> anyhow::Result<BTreeMap<String, f64>> {
    let mut by_request = BTreeMap::new();
    let scrape = scrape(api)?;
    // A watch is in `apiserver_request_total` only once it ends: the watches open now stand for
    // the requests that opened them (ebpf-proxy's streaming list is one of them).
    for sample in scrape.samples.iter().filter(|s| s.metric == "apiserver_longrunning_requests") {
        if sample.labels.get("verb") != Some("WATCH") {
            continue;
        }
        let Some(value) = e2e::metrics::value(sample) else { continue };
        let resource = sample.labels.get("resource").unwrap_or_default();
        *by_request.entry(format!("WATCH {resource} (open)")).or_insert(0.0) += value;
    }
    for sample in scrape.samples.iter().filter(|s| s.metric == "apiserver_request_total") {
        let label = |name: &str| sample.labels.get(name).unwrap_or_default();
        let (resource, subresource) = (label("resource"), label("subresource"));
        let what = match (resource, subresource) {
            ("", path) if OWN_PATHS.contains(&path) => continue,
            ("", path) => path.to_owned(),
            (resource, "") => resource.to_owned(),
            (resource, sub) => format!("{resource}/{sub}"),
        };
        let Some(value) = e2e::metrics::value(sample) else { continue };
        *by_request.entry(format!("{} {what}", label("verb"))).or_insert(0.0) += value;
    }
    by_request.insert("GET /version".into(), versions(audit)?);
    Ok(by_request)
}

fn scrape(api: &ControlPlane) -> anyhow::Result<e2e::metrics::Scrape> {
    e2e::metrics::parse(&api.metrics_text()?, "kube-apiserver")
}

/// Watches open now (`apiserver_longrunning_requests{verb="WATCH"}`, summed).
fn open_watches(api: &ControlPlane) -> anyhow::Result<f64> {
    Ok(e2e::metrics::sum(&scrape(api)?, "apiserver_longrunning_requests", |labels| labels.get("verb") == Some("WATCH")).unwrap_or(0.0))
}

/// [`requests`], asked again (every 0.2 s, for up to a minute) while the API server is too busy
/// to answer.
fn requests_patiently(api: &ControlPlane, audit: &Audit) -> anyhow::Result<BTreeMap<String, f64>> {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        match requests(api, audit) {
            Ok(by_request) => return Ok(by_request),
            Err(error) if Instant::now() >= until => return Err(error),
            Err(_) => {
                check_interrupted()?;
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

/// `after - before` per request kind, kinds that did not change left out.
fn delta(after: &BTreeMap<String, f64>, before: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    after.iter().map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0))).filter(|(_, v)| *v > 0.0).collect()
}

fn apiserver_cpu(api: &ControlPlane) -> anyhow::Result<f64> {
    cpu_seconds(api.apiserver_pid().context("kube-apiserver is not running")?)
}

/// Waits `duration`, one second at a time, so that Ctrl-C is heard.
fn wait(duration: Duration) -> anyhow::Result<()> {
    let until = Instant::now() + duration;
    while let Some(left) = until.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) {
        check_interrupted()?;
        std::thread::sleep(left.min(Duration::from_secs(1)));
    }
    Ok(())
}

/// The marker Service and its slice (10 endpoints), created once the API server is back.
fn create_marker(api: &ControlPlane) -> anyhow::Result<()> {
    let services: Api<Service> = Api::namespaced(api.client(), NAMESPACE);
    let slices: Api<EndpointSlice> = Api::namespaced(api.client(), NAMESPACE);
    api.block_on(async {
        services
            .create(&PostParams::default(), &super::service(MARKER, MARKER_IP, 8080, None))
            .await
            .context("creating the marker Service")?;
        let mut slice = super::slice(MARKER, 8080);
        slice.metadata.annotations =
            Some([("endpoints.kubernetes.io/last-change-trigger-time".to_owned(), super::trigger_time(super::unix_micros()))].into());
        slices.create(&PostParams::default(), &slice).await.context("creating the marker's slice")?;
        anyhow::Ok(())
    })
}

fn delete_marker(api: &ControlPlane) -> anyhow::Result<()> {
    let services: Api<Service> = Api::namespaced(api.client(), NAMESPACE);
    let slices: Api<EndpointSlice> = Api::namespaced(api.client(), NAMESPACE);
    api.block_on(async {
        services.delete(MARKER, &DeleteParams::default()).await.context("deleting the marker Service")?;
        slices.delete(&format!("{MARKER}-pool"), &DeleteParams::default()).await.context("deleting the marker's slice")?;
        anyhow::Ok(())
    })
}

/// Runs the fleet part: the API server alone, then each kind of proxy on `plan.nodes` nodes.
/// Each run is added to `runs` as it completes, so that a report written after a failure keeps
/// the runs before it.
pub fn measure(
    api: &mut ControlPlane,
    audit: &Audit,
    plan: &Plan,
    progress: &mut Progress,
    runs: &mut Vec<FleetRun>,
) -> anyhow::Result<()> {
    for i in 0..plan.nodes {
        super::create_node(api, &format!("fleet-{i}"))?;
    }
    for &kind in &plan.kinds {
        let count = if kind == Kind::None { 0 } else { plan.nodes };
        let mut run = FleetRun { proxy: kind.name().into(), nodes: count, services: plan.services, ..Default::default() };
        progress.step(&format!("fleet: {count} × {} against one kube-apiserver (N={}): start, steady state", kind.name(), plan.services));
        let before = requests(api, audit)?;
        let mut members = start_members(api, kind, count)?;
        wait(plan.settle)?;
        run.start_requests = delta(&requests(api, audit)?, &before);
        run.steady_watches = open_watches(api)?;
        eprintln!("    {count} nodes started: {:.0} requests", total(&run.start_requests));

        let (before, cpu_before, t) = (requests(api, audit)?, apiserver_cpu(api)?, Instant::now());
        wait(plan.steady)?;
        let (after, cpu_after) = (requests(api, audit)?, apiserver_cpu(api)?);
        run.steady_s = t.elapsed().as_secs_f64();
        run.steady_rps = delta(&after, &before).into_iter().map(|(k, v)| (k, v / run.steady_s)).collect();
        run.steady_cpu = (cpu_after - cpu_before) / run.steady_s;
        eprintln!("    steady state: {:.2} requests/s, kube-apiserver {:.3} CPU s/s", total(&run.steady_rps), run.steady_cpu);

        progress.step(&format!(
            "fleet: {count} × {}: kube-apiserver down for {:.0} s, then the relist herd",
            kind.name(),
            plan.outage.as_secs_f64()
        ));
        for member in &mut members {
            member.before = member.programmed()?;
        }
        recover(api, audit, plan, &members, &mut run)?;
        eprintln!(
            "    recovery: {}/{count} nodes converged, the last {:.1} s after the API server was ready; {:.0} requests (peak {:.0}/s), kube-apiserver {:.1} CPU s",
            run.converge_s.len(),
            run.converge_s.iter().copied().fold(0.0, f64::max),
            total(&run.recovery_requests),
            run.recovery_peak_rps,
            run.recovery_cpu
        );
        delete_marker(api)?;
        for member in &mut members {
            if let MemberProxy::KubeProxy(proxy) = &mut member.proxy {
                // Its rules go with the namespace; `--cleanup` a hundred times would take minutes.
                proxy.kill();
            }
        }
        drop(members);
        runs.push(run);
    }
    Ok(())
}

/// The outage and what follows it, into `run`.
fn recover(api: &mut ControlPlane, audit: &Audit, plan: &Plan, members: &[Member], run: &mut FleetRun) -> anyhow::Result<()> {
    let connections = || members.iter().map(|m| m.access.connections() as f64).sum::<f64>();
    let versions_before = versions(audit)?;
    let node_cpu = || -> anyhow::Result<f64> { members.iter().filter_map(Member::pid).map(cpu_seconds).sum() };
    let node_cpu_before = node_cpu()?;
    api.stop_apiserver()?;
    let (down, connections_before) = (Instant::now(), connections());
    wait(plan.outage)?;
    run.outage_s = down.elapsed().as_secs_f64();
    run.outage_connections = connections() - connections_before;
    let started = Instant::now();
    api.start_apiserver()?;
    let ready = Instant::now();
    create_marker(api)?;
    let mut pending: Vec<usize> = (0..members.len()).collect();
    // The API server and the machine may be too busy with the herd to answer the bench's own
    // reads at once: a read that fails is skipped (the next covers the longer interval).
    let mut sample = (Instant::now(), total(&requests_patiently(api, audit)?));
    loop {
        check_interrupted()?;
        pending.retain(|&i| {
            let done = members[i].converged();
            if done {
                run.converge_s.push(ready.elapsed().as_secs_f64());
            }
            !done
        });
        let finished = pending.is_empty() || ready.elapsed() >= plan.converge_limit;
        if finished || sample.0.elapsed() >= Duration::from_secs(1) {
            if let Ok(now) = requests(api, audit).map(|r| total(&r)) {
                run.recovery_peak_rps = run.recovery_peak_rps.max((now - sample.1) / sample.0.elapsed().as_secs_f64());
                sample = (Instant::now(), now);
            }
        }
        if finished {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    run.not_converged = pending.len();
    run.recovery_node_cpu = node_cpu()? - node_cpu_before;
    run.recovery_s = started.elapsed().as_secs_f64();
    // The API server is a new process: its counters and CPU time are all this recovery's.
    let mut recovered = requests_patiently(api, audit)?;
    recovered.insert("GET /version".into(), versions(audit)? - versions_before);
    recovered.retain(|_, v| *v > 0.0);
    run.recovery_requests = recovered;
    run.recovery_cpu = apiserver_cpu(api)?;
    run.recovery_watches = open_watches(api)?;
    Ok(())
}
