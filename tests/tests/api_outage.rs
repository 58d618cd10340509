//! What happens to Services when the master fails: the real kube-apiserver is stopped, then
//! black-holed, under steady traffic; and objects change while the agent is down.

use std::time::{Duration, Instant};

use e2e::agent::http_get;
use e2e::audit::Audit;
use e2e::kube_scenario::{service, slice, KubeEnv, OTHER_VIP, VIP};
use e2e::probe::SteadyTraffic;

fn healthz(env: &KubeEnv) -> (u16, serde_json::Value) {
    let (status, body) = http_get(env.agent.healthz_port, "/healthz").expect("healthz");
    (status, serde_json::from_str(&body).expect("healthz json"))
}

/// Waits up to `limit` for /healthz to answer `status`; returns the body.
fn wait_healthz(env: &KubeEnv, status: u16, limit: Duration) -> serde_json::Value {
    let started = Instant::now();
    loop {
        let (got, body) = healthz(env);
        if got == status {
            return body;
        }
        assert!(started.elapsed() < limit, "/healthz still {got} {body} after {limit:?}\n{}", env.agent.log_text());
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn api_server_stopped_then_black_holed_costs_no_connection() {
    let mut env = KubeEnv::new();
    let outage = Duration::from_secs(60);
    let traffic = SteadyTraffic::start(
        &env.topo,
        "client",
        &format!("{VIP}:80"),
        &format!("{VIP}:53"),
        20,
        2,
        outage * 2 + Duration::from_secs(25),
    )
    .expect("steady traffic");
    std::thread::sleep(Duration::from_secs(2));

    // 1. The API server process is gone for 60 s.
    env.api.stop_apiserver().expect("stop apiserver");
    let stale = wait_healthz(&env, 503, Duration::from_secs(15));
    assert_eq!(stale["stale"], true, "{stale}");
    assert_eq!(http_get(env.agent.healthz_port, "/livez").expect("livez").0, 200, "liveness must not fail");
    std::thread::sleep(outage.saturating_sub(Duration::from_secs(5)));
    env.api.start_apiserver().expect("start apiserver");
    wait_healthz(&env, 200, Duration::from_secs(30));

    // 2. The API server is there but its packets vanish (black hole / half-open connection):
    //    the agent notices within its stated 15 s (probe interval + timeout), reports stale, and
    //    keeps serving.
    env.api.forwarder().set_blackhole(true);
    let started = Instant::now();
    let stale = wait_healthz(&env, 503, Duration::from_secs(20));
    eprintln!("black hole detected after {:?}: {stale}", started.elapsed());
    std::thread::sleep(outage.saturating_sub(started.elapsed()));
    env.api.forwarder().set_blackhole(false);
    wait_healthz(&env, 200, Duration::from_secs(60));

    let seen = traffic.finish().expect("traffic");
    eprintln!("{seen:?}");
    assert_eq!(seen.failed(), 0, "connections failed while the API was down: {seen:?}");
    assert!(seen.tcp.ok > 1500 && seen.udp.ok > 1500, "traffic did not really run: {seen:?}");
    assert_eq!(seen.streams.ok, 2, "long-lived streams must survive: {seen:?}");
    // Both backends kept serving throughout: the last state was never emptied.
    assert!(seen.tcp.answered_by("be1") > 300 && seen.tcp.answered_by("be2") > 300, "{seen:?}");
}

#[test]
fn changes_made_while_the_agent_is_down_are_applied_when_it_returns() {
    let mut env = KubeEnv::new();
    env.api
        .apply(&format!("{}---\n{}", service("other", OTHER_VIP), slice("other", &["10.244.1.12"])))
        .expect("create other");
    env.within(Duration::from_secs(1), "creating Service other", |e| e.frontends().contains(&format!("{OTHER_VIP}:80/TCP")));

    env.agent.stop().expect("stop agent");
    env.api.apply(&slice("web", &["10.244.1.11"])).expect("remove be2 from web");
    env.api.delete("v1", "Service", "demo", "other").expect("delete other");
    // Nothing changes while no agent runs: the datapath still has both.
    assert!(env.frontends().contains(&format!("{OTHER_VIP}:80/TCP")));

    env.agent.restart().expect("agent back");
    assert!(!env.frontends().iter().any(|f| f.starts_with(OTHER_VIP)), "{:?}", env.frontends());
    let web = env.tcp(&format!("{VIP}:80"), 50);
    assert_eq!((web.failed, web.answered_by("be2")), (0, 0), "{web:?}");
}

#[test]
fn changes_made_while_the_api_is_black_holed_for_the_agent_are_applied_when_it_answers() {
    let env = KubeEnv::with_agent_access();
    env.api
        .apply(&format!("{}---\n{}", service("other", OTHER_VIP), slice("other", &["10.244.1.12"])))
        .expect("create other");
    env.within(Duration::from_secs(1), "creating Service other", |e| e.frontends().contains(&format!("{OTHER_VIP}:80/TCP")));
    let traffic = SteadyTraffic::start(&env.topo, "client", &format!("{VIP}:80"), &format!("{VIP}:53"), 20, 2, Duration::from_secs(40))
        .expect("steady traffic");
    env.api.forwarder().reset_connections();

    // Only the agent's packets to the API vanish; the API itself works for everybody else.
    env.agent_access.as_ref().expect("agent access").set_blackhole(true);
    let stale = wait_healthz(&env, 503, Duration::from_secs(20));
    eprintln!("black hole seen: {stale}");
    env.api.apply(&slice("web", &["10.244.1.11"])).expect("remove be2 from web");
    env.api.delete("v1", "Service", "demo", "other").expect("delete other");
    // The agent cannot know yet: it keeps serving its last state, both backends included.
    std::thread::sleep(Duration::from_secs(3));
    assert!(env.frontends().contains(&format!("{OTHER_VIP}:80/TCP")), "{:?}", env.frontends());

    env.agent_access.as_ref().expect("agent access").set_blackhole(false);
    let took = env.within(Duration::from_secs(30), "applying the changes made during the black hole", |e| {
        !e.frontends().iter().any(|f| f.starts_with(OTHER_VIP)) && e.backends_of(&format!("{VIP}:80")) == ["10.244.1.11:8080"]
    });
    eprintln!("changes applied {took:?} after the black hole ended");
    wait_healthz(&env, 200, Duration::from_secs(30));
    let web = env.tcp(&format!("{VIP}:80"), 50);
    assert_eq!((web.failed, web.answered_by("be2")), (0, 0), "be2 must be gone from web: {web:?}");

    let seen = traffic.finish().expect("traffic");
    eprintln!("{seen:?}");
    assert_eq!(seen.failed(), 0, "connections failed around the black hole: {seen:?}");
    assert_eq!(seen.streams.ok, 2, "long-lived streams must survive: {seen:?}");
}

/// Frontend count of the datapath, sampled every few milliseconds on a thread until stopped.
struct FrontendSampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<usize>>,
}

impl FrontendSampler {
    fn start(bpffs: std::path::PathBuf) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut counts = Vec::new();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let dump = e2e::agent::dump(&bpffs).expect("dump");
                counts.push(dump["services"].as_array().map_or(0, Vec::len));
                std::thread::sleep(Duration::from_millis(10));
            }
            counts
        });
        Self { stop, thread }
    }

    fn finish(self) -> Vec<usize> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().expect("sampler")
    }
}

/// What kube-apiserver answers a watch from a compacted resource version (410, reason Expired).
const EXPIRED: &str = "The resourceVersion for the provided watch is too old";

#[test]
fn an_expired_watch_410_gone_relists_without_removing_any_service() {
    // Without the API server's watch cache, watches are served by etcd, so a watch that resumes
    // from a compacted resource version gets `410 Gone`, as after a long disconnection in a
    // real cluster.
    let env = KubeEnv::with_apiserver_args(&["--watch-cache=false"]);
    let mut objects = Vec::new();
    for i in 1..=10 {
        let name = format!("svc{i}");
        objects.push(service(&name, &format!("10.96.1.{i}")));
        objects.push(slice(&name, &["10.244.1.11", "10.244.1.12"]));
    }
    env.api.apply(&objects.join("---\n")).expect("create 10 Services");
    env.within(Duration::from_secs(5), "programming 10 more Services", |e| {
        (1..=10).all(|i| e.frontends().contains(&format!("10.96.1.{i}:53/UDP")))
    });
    let expected = env.agent.dump().expect("dump")["services"].as_array().map_or(0, Vec::len);
    let writes_before = env.agent.map_writes().expect("metrics");

    // Writes the agent does not watch move etcd's revision past its watches' resource versions;
    // compaction then forgets them. The agent's connection is then cut (as by a load balancer
    // in front of the API restarting): each watch resumes from its old version and gets 410.
    for i in 0..5 {
        env.api
            .apply(&format!("apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: bump, namespace: demo}}\ndata: {{a: \"{i}\"}}\n"))
            .expect("bump the revision");
    }
    let revision = env.api.compact_etcd().expect("compact etcd");
    eprintln!("etcd compacted at revision {revision}");
    let sampler = FrontendSampler::start(env.agent.bpffs.clone());
    let traffic = SteadyTraffic::start(&env.topo, "client", &format!("{VIP}:80"), &format!("{VIP}:53"), 20, 2, Duration::from_secs(40))
        .expect("steady traffic");
    env.api.forwarder().reset_connections();
    env.within(Duration::from_secs(45), "a 410 Gone and the relist after it", |e| {
        let log = e.agent.log_text();
        let gone = log.find(EXPIRED);
        gone.is_some_and(|at| log[at..].contains("every watch is confirmed again"))
    });
    std::thread::sleep(Duration::from_secs(1));
    let counts = sampler.finish();
    let seen = traffic.finish().expect("traffic");
    eprintln!("{seen:?}");
    assert_eq!(seen.failed(), 0, "connections failed around the 410 and relist: {seen:?}");
    assert_eq!(seen.streams.ok, 2, "long-lived streams must survive: {seen:?}");

    let log = env.agent.log_text();
    for line in log.lines().filter(|l| l.contains("watch failed")) {
        eprintln!("{line}");
    }
    assert!(
        log.lines().any(|l| l.contains("watch failed") && l.contains(EXPIRED)),
        "the agent's watches did not expire, so this test proved nothing:\n{log}"
    );
    assert!(counts.len() > 50, "too few samples: {}", counts.len());
    assert!(
        counts.iter().all(|c| *c == expected),
        "a Service was transiently removed during the relist: min {:?} of {expected}",
        counts.iter().min()
    );
    // Every sync after the relist found the datapath right: nothing was deleted and re-added.
    let writes = env.agent.map_writes().expect("metrics") - writes_before;
    assert_eq!(writes, 0, "the relist rewrote the datapath ({writes} map entries)");
    // And the relisted watches work: a change after it still arrives.
    env.api.delete("v1", "Service", "demo", "svc1").expect("delete svc1");
    env.within(Duration::from_secs(2), "deleting svc1 after the relist", |e| {
        !e.frontends().iter().any(|f| f.starts_with("10.96.1.1:"))
    });
}

/// Lists of what a node watches, sent by the agent (user `epx-admin`; the API server's own
/// controllers list Services too, as `system:apiserver`).
const AGENT_REQUESTS: &str = "- level: Metadata\n  users: [epx-admin]\n  verbs: [list, watch]\n  resources:\n  \
                              - {group: \"\", resources: [services, nodes]}\n  - {group: discovery.k8s.io, resources: [endpointslices]}";
const WATCHED: [&str; 3] = ["services", "endpointslices", "nodes"];

/// One of the agent's requests in the audit log.
#[derive(Debug)]
struct Request {
    resource: String,
    verb: String,
    code: u64,
    uri: String,
}

impl Request {
    fn streaming_list(&self) -> bool {
        self.verb == "watch" && self.uri.contains("sendInitialEvents=true")
    }
}

/// The agent's lists and watches made after the first `skip` audit lines, each once (a watch is
/// recorded when it is answered, and again when it ends: a watch made before `skip` may end after).
fn agent_requests(audit: &Audit, skip: usize) -> Vec<Request> {
    let mut seen = std::collections::HashSet::new();
    let events = audit.events_after(0).expect("audit log");
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
    events
        .iter()
        .enumerate()
        .filter(|(i, e)| seen.insert(text(&e["auditID"])) && *i >= skip)
        .map(|(_, e)| Request {
            resource: text(&e["objectRef"]["resource"]),
            verb: text(&e["verb"]),
            code: e["responseStatus"]["code"].as_u64().unwrap_or(0),
            uri: text(&e["requestURI"]),
        })
        .collect()
}

/// How the API server under test serves a kind's initial state.
#[derive(Clone, Copy, PartialEq)]
enum Server {
    /// Streaming lists (Kubernetes 1.34's default).
    Streams,
    /// The `WatchList` feature gate is off (Kubernetes 1.33's default): streaming lists are
    /// refused with 422.
    RefusesStreams,
}

/// Each watched kind's state came in exactly one answered request from the API server's cache
/// (`resourceVersion=0`): a streaming list, or a list in one page where streams are refused, after
/// `refusals` refused streaming lists.
fn assert_one_request_each(requests: &[Request], server: Server, refusals: usize, when: &str) {
    for resource in WATCHED {
        let of_kind = || requests.iter().filter(move |r| r.resource == resource);
        let streams: Vec<_> = of_kind().filter(|r| r.streaming_list() && r.code == 200).collect();
        let lists: Vec<_> = of_kind().filter(|r| r.verb == "list" && r.code == 200).collect();
        let refused = of_kind().filter(|r| r.streaming_list() && r.code == 422).count();
        let answered = match server {
            Server::Streams => {
                assert!(lists.is_empty(), "{when}: {resource} listed besides its streaming list: {requests:#?}");
                streams
            }
            Server::RefusesStreams => {
                assert!(streams.is_empty(), "{when}: {resource}: a streaming list answered by a server that refuses them");
                lists
            }
        };
        assert_eq!(answered.len(), 1, "{when}: {resource} fetched in {} answered requests: {requests:#?}", answered.len());
        assert_eq!(refused, refusals, "{when}: {resource}: streaming lists refused: {requests:#?}");
        let uri = &answered[0].uri;
        assert!(
            uri.contains("resourceVersion=0") && !uri.contains("limit="),
            "{when}: {resource} not fetched from the cache in one response: {uri}"
        );
    }
}

fn programmed(env: &KubeEnv) -> usize {
    env.agent.metric("ebpf_proxy_services_programmed").expect("metrics") as usize
}

/// Creates `count` Services `many<i>` with a slice each, and waits until the agent has them all.
fn create_many(env: &KubeEnv, count: usize) {
    let objects: Vec<String> = (0..count)
        .flat_map(|i| {
            let name = format!("many{i}");
            [service(&name, &format!("10.96.{}.{}", 100 + i / 250, 1 + i % 250)), slice(&name, &["10.244.1.11"])]
        })
        .collect();
    env.api.apply(&objects.join("---\n")).unwrap_or_else(|e| panic!("creating {count} Services: {e:#}"));
    // web and the API server's own kubernetes Service besides.
    env.within(Duration::from_secs(60), &format!("programming {count} more Services"), |e| programmed(e) == count + 2);
}

/// 600 Services and slices (more than kube-rs' default page of 500 objects): the agent fetches
/// each kind in one request when it starts and again after the API server restarts.
fn one_request_per_kind(server: Server) {
    let audit = Audit::new(AGENT_REQUESTS).expect("audit policy");
    let mut args = audit.apiserver_args();
    if server == Server::RefusesStreams {
        args.push("--feature-gates=WatchList=false".into());
    }
    let mut env = KubeEnv::with_apiserver_args(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let count = 600;
    create_many(&env, count);

    // A node that starts fetches each kind once (where streams are refused: after one refusal each).
    let skip = audit.lines().expect("audit log").len();
    env.agent.stop().expect("stop agent");
    env.agent.restart().expect("agent back");
    let at_start = agent_requests(&audit, skip);
    eprintln!("requests at start: {at_start:#?}");
    let refusals = usize::from(server == Server::RefusesStreams);
    assert_one_request_each(&at_start, server, refusals, "agent start");
    let failed: Vec<_> = at_start.iter().filter(|r| r.code != 200 && r.code != 422).collect();
    assert!(failed.is_empty(), "requests that failed at start: {failed:#?}");

    // The API server restarts (SIGKILL): its cache is filled again from etcd while the node
    // fetches again. A request that comes before the cache is ready is refused (429) and retried;
    // a refused streaming list is not tried again.
    let skip = audit.lines().expect("audit log").len();
    env.api.stop_apiserver().expect("stop apiserver");
    wait_healthz(&env, 503, Duration::from_secs(15));
    env.api.start_apiserver().expect("start apiserver");
    wait_healthz(&env, 200, Duration::from_secs(60));
    let again = agent_requests(&audit, skip);
    eprintln!("requests after the restart: {again:#?}");
    assert_one_request_each(&again, server, 0, "after the restart");
    assert_eq!(programmed(&env), count + 2);
    let web = env.tcp(&format!("{VIP}:80"), 20);
    assert_eq!(web.failed, 0, "{web:?}");
}

#[test]
fn each_kind_comes_in_one_streaming_list_at_start_and_after_the_api_server_restarts() {
    one_request_per_kind(Server::Streams);
}

#[test]
fn a_server_that_refuses_streaming_lists_is_listed_in_one_request_per_kind() {
    one_request_per_kind(Server::RefusesStreams);
}

/// After an outage the API answers, but slowly (a relist herd: every node lists at once): each
/// kind's streaming list takes longer than the probe's 2-3 s. The probe must leave a list under
/// way to finish; starting it over at each probe meant that none ever ended and the agent never
/// saw the changes made meanwhile (100 agents after a 60 s outage: none converged in 5 min).
#[test]
fn a_relist_slower_than_the_probe_interval_is_left_to_finish() {
    let audit = Audit::new(AGENT_REQUESTS).expect("audit policy");
    let args = audit.apiserver_args();
    let mut env = KubeEnv::with_agent_access_and_apiserver_args(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let count = 600;
    create_many(&env, count);

    // The API server restarts: its watch cache starts over, so every kind is listed again.
    env.api.stop_apiserver().expect("stop apiserver");
    wait_healthz(&env, 503, Duration::from_secs(15));
    env.within(Duration::from_secs(30), "a probe finding no answer", |e| e.agent.log_text().contains("does not answer"));
    // 600 Services and 600 slices are more than a megabyte of watch events: several probe
    // intervals at 128 kB/s. (Not much slower: the API server's send buffer holds about 400 kB
    // that an HTTP/2 PING's answer waits behind, and the connection is closed when that takes
    // more than 5 s.)
    env.agent_access.as_ref().expect("agent access").set_rate_limit(Some(128 * 1024));
    let skip = audit.lines().expect("audit log").len();
    env.api.start_apiserver().expect("start apiserver");
    let started = Instant::now();
    env.api.apply(&slice("web", &["10.244.1.11"])).expect("remove be2 from web");
    env.api.delete("v1", "Service", "demo", "many0").expect("delete many0");
    while healthz(&env).0 != 200 {
        if started.elapsed() > Duration::from_secs(120) {
            let requests = agent_requests(&audit, skip);
            panic!("not every watch confirmed 120 s after the API server was back; the agent's requests since: {requests:#?}\n{}", env.agent.log_text());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let took = started.elapsed();
    eprintln!("every watch confirmed {took:?} after the API server was back");
    // The scenario held: the lists took longer than a few probe intervals.
    assert!(took > Duration::from_secs(6), "the relists took only {took:?}: the rate limit did not slow them");
    // A kind's watch may also resume where it was, without a list.
    let requests = agent_requests(&audit, skip);
    let lists = |resource: &str| requests.iter().filter(|r| r.resource == resource && r.streaming_list() && r.code == 200).count();
    for resource in WATCHED {
        assert!(lists(resource) <= 1, "{resource}: its list was started over ({} lists): {requests:#?}", lists(resource));
    }
    assert!(lists("services") + lists("endpointslices") > 0, "nothing large was listed again: {requests:#?}");
    // Made after the restart: in the lists, or in the watch that follows them.
    env.within(Duration::from_secs(30), "applying the changes made after the restart", |e| {
        e.backends_of(&format!("{VIP}:80")) == ["10.244.1.11:8080"] && programmed(e) == count + 1
    });
}
