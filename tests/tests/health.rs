//! Health and metrics as kube-proxy has them, checked over real HTTP against the running agent:
//! `/healthz` turns stale when an API change cannot reach the datapath, the healthCheckNodePort
//! of an `externalTrafficPolicy: Local` LoadBalancer answers with the local endpoint count, and
//! `/metrics` reports what was programmed, rejected and translated.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use e2e::agent::{Agent, AgentDir};
use e2e::kube_scenario::{slice, KubeEnv};
use e2e::scenario::{client_and_two_backends, manifest, VIP};
use e2e::topology::{in_netns, Topology};
use k8s_openapi::jiff::Timestamp;

fn healthz(agent: &Agent) -> (u16, serde_json::Value) {
    let (status, body) = agent.get(false, "/healthz").expect("healthz");
    (status, serde_json::from_str(&body).unwrap_or_else(|e| panic!("healthz json {e}: {body}")))
}

/// Polls `probe` every 50 ms until it returns `Some`, failing after `limit`.
fn wait_for<T>(agent: &Agent, limit: Duration, what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let started = Instant::now();
    loop {
        if let Some(value) = probe() {
            return value;
        }
        assert!(started.elapsed() < limit, "{what}: not within {limit:?}\n{}", agent.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn healthz_turns_stale_when_an_api_change_cannot_reach_the_datapath_and_recovers() {
    let (topo, _servers) = client_and_two_backends();
    let dir = AgentDir::new(&topo.id).expect("agent dir");
    let base = manifest(&["10.244.1.11", "10.244.1.12"]);
    dir.write_manifest(&base).expect("manifest");
    // be1 and be2, each on TCP 8080 and UDP 5353: 4 backends fill the backend map. A third
    // endpoint for web (a scale-up) cannot be programmed, and the datapath falls behind the API.
    let agent =
        Agent::start_file_with_args(&topo, &dir, &["--map-size-backends=4", "--healthz-stale-after=2s"]).expect("agent");

    let (status, body) = healthz(&agent);
    assert_eq!(status, 200, "{body}");
    assert_eq!((body["stale"].as_bool(), body["pendingChangeSeconds"].is_null()), (Some(false), true), "{body}");
    assert_eq!(body["staleAfterSeconds"], 2.0, "{body}");

    dir.write_manifest(&manifest(&["10.244.1.11", "10.244.1.12", "10.244.1.13"])).expect("manifest with 3 endpoints");
    let written = Instant::now();
    // The change is pending (it keeps failing) but not late yet: still healthy.
    let pending = wait_for(&agent, Duration::from_secs(1), "the change seen as pending", || {
        let (status, body) = healthz(&agent);
        body["pendingChangeSeconds"].is_number().then_some((status, body))
    });
    assert!(written.elapsed() < Duration::from_millis(1800), "too slow to check the grace period");
    assert_eq!(pending.0, 200, "a change younger than --healthz-stale-after is not stale: {}", pending.1);

    let stale = wait_for(&agent, Duration::from_secs(6), "/healthz 503", || {
        let (status, body) = healthz(&agent);
        (status == 503).then_some(body)
    });
    assert!(written.elapsed() >= Duration::from_secs(2), "stale before the threshold: {stale}");
    assert_eq!(stale["stale"], true, "{stale}");
    assert!(stale["staleSeconds"].as_f64().is_some_and(|s| s > 2.0), "{stale}");
    assert!(stale["sourceError"].is_null(), "the source is fine, the datapath is behind: {stale}");
    let error = stale["datapathError"].as_str().unwrap_or_default();
    assert!(error.contains("demo/web") && error.contains("epx_be4_v1 is full"), "the reason names the Service and map: {stale}");
    assert_eq!(agent.get(false, "/livez").expect("livez").0, 200, "liveness must not fail");
    // The agent survives and web keeps its last programmed state (both old backends).
    let web = e2e::probe::tcp(&topo, "client", &format!("{VIP}:80"), 20).expect("probe");
    assert_eq!(web.failed, 0, "{web:?}");
    assert!(web.answered_by("be1") > 0 && web.answered_by("be2") > 0, "{web:?}");

    // Taking the change back lets the datapath catch up: healthy again.
    dir.write_manifest(&base).expect("manifest with 2 endpoints");
    let healthy = wait_for(&agent, Duration::from_secs(2), "/healthz 200 again", || {
        let (status, body) = healthz(&agent);
        (status == 200).then_some(body)
    });
    assert_eq!((healthy["stale"].as_bool(), healthy["datapathError"].is_null()), (Some(false), true), "{healthy}");
}

/// `GET /` on the node's address (10.244.1.1) and `port` from the client pod, as a load
/// balancer's probe reaches a node; the response's head and body. None when nothing listens.
fn probe_node(topo: &Topology, port: u16) -> Option<(u16, String, serde_json::Value)> {
    in_netns(&topo.pod("client").netns.path(), || get_with_headers(NODE_IP, port)).expect("enter the client pod")
}

const NODE_IP: &str = "10.244.1.1";

fn get_with_headers(ip: &str, port: u16) -> Option<(u16, String, serde_json::Value)> {
    let mut stream = TcpStream::connect((ip, port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET / HTTP/1.1\r\nHost: lb-probe\r\nConnection: close\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, head.to_owned(), serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))))
}

fn local_lb(name: &str, vip: &str, health_port: u16) -> String {
    format!(
        r#"---
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: demo}}
spec:
  type: LoadBalancer
  externalTrafficPolicy: Local
  healthCheckNodePort: {health_port}
  allocateLoadBalancerNodePorts: false
  clusterIP: {vip}
  ports: [{{name: http, port: 80, targetPort: 8080, protocol: TCP}}]
"#
    )
}

fn lb_slice(name: &str, endpoints: &[(&str, &str)]) -> String {
    let endpoints: String = endpoints
        .iter()
        .map(|(ip, node)| format!("\n- addresses: [{ip}]\n  conditions: {{ready: true}}\n  nodeName: {node}"))
        .collect();
    format!(
        r#"---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-1
  namespace: demo
  labels: {{kubernetes.io/service-name: {name}}}
addressType: IPv4
endpoints:{endpoints}
ports: [{{name: http, port: 8080, protocol: TCP}}]
"#
    )
}

#[test]
fn health_check_node_port_answers_with_the_local_endpoint_count_as_kube_proxy() {
    let (topo, _servers) = client_and_two_backends();
    let dir = AgentDir::new(&topo.id).expect("agent dir");
    let base = manifest(&["10.244.1.11", "10.244.1.12"]);
    // The agent runs in the node's namespace, so it owns these ports there; one is held by
    // someone else: the agent must say which Service it could not serve, and nothing more.
    let (port, taken) = (32000, 32001);
    let squatter = in_netns(&topo.node.path(), || TcpListener::bind(("0.0.0.0", taken)))
        .expect("enter the node")
        .expect("squatter");
    let with = |endpoints: &[(&str, &str)]| {
        format!(
            "{base}{}{}{}",
            local_lb("lb", "10.96.0.60", port),
            lb_slice("lb", endpoints),
            local_lb("lb-taken", "10.96.0.61", taken)
        )
    };
    // The agent runs as node-1 (e2e::agent); one endpoint on another node does not count.
    dir.write_manifest(&with(&[("10.244.1.11", "node-1"), ("10.244.1.12", "node-1"), ("10.244.1.13", "node-2")]))
        .expect("manifest");
    let agent = Agent::start_file_in_node(&topo, &dir, &[]).expect("agent");

    let (status, head, body) =
        wait_for(&agent, Duration::from_secs(2), "healthCheckNodePort listening", || probe_node(&topo, port));
    assert_eq!(status, 200, "{head}\n{body}");
    assert_eq!(
        body,
        serde_json::json!({"service": {"namespace": "demo", "name": "lb"}, "localEndpoints": 2, "serviceProxyHealthy": true})
    );
    let head = head.to_ascii_lowercase();
    assert!(head.contains("content-type: application/json") && head.contains("x-content-type-options: nosniff"), "{head}");

    // The local endpoints move to another node: 503, so the load balancer stops sending here.
    dir.write_manifest(&with(&[("10.244.1.11", "node-2"), ("10.244.1.12", "node-2")])).expect("manifest");
    let (status, _, body) = wait_for(&agent, Duration::from_secs(2), "503 without local endpoints", || {
        probe_node(&topo, port).filter(|(status, _, _)| *status == 503)
    });
    assert_eq!((status, body["localEndpoints"].as_u64(), body["serviceProxyHealthy"].as_bool()), (503, Some(0), Some(true)));

    // One comes back.
    dir.write_manifest(&with(&[("10.244.1.12", "node-1")])).expect("manifest");
    let (_, _, body) = wait_for(&agent, Duration::from_secs(2), "200 with one local endpoint", || {
        probe_node(&topo, port).filter(|(status, _, _)| *status == 200)
    });
    assert_eq!(body["localEndpoints"], 1);

    let log = agent.log_text();
    let complaint = format!("cannot listen on healthCheckNodePort 0.0.0.0:{taken} of Service demo/lb-taken");
    assert_eq!(log.matches(&complaint).count(), 1, "logged once, naming the Service, over several syncs:\n{log}");
    let web = e2e::probe::tcp(&topo, "client", &format!("{VIP}:80"), 10).expect("probe");
    assert_eq!(web.failed, 0, "{web:?}");

    // The Service goes away: so does its listener.
    dir.write_manifest(&base).expect("manifest");
    wait_for(&agent, Duration::from_secs(2), "healthCheckNodePort closed", || {
        let refused = in_netns(&topo.pod("client").netns.path(), || TcpStream::connect((NODE_IP, port)).is_err());
        refused.expect("enter the client pod").then_some(())
    });
    drop(squatter);
}

/// Parses the exposition text into `name{labels}` -> value, checking every sample's family was
/// declared with HELP and TYPE lines first.
fn scrape(agent: &Agent) -> BTreeMap<String, f64> {
    let (status, text) = agent.get(true, "/metrics").expect("metrics");
    assert_eq!(status, 200, "{text}");
    let mut declared = Vec::new();
    let mut samples = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split_whitespace().next().expect("type name").to_owned();
            assert!(text.contains(&format!("# HELP {name} ")), "no HELP for {name}");
            declared.push(name);
        } else if !line.starts_with('#') && !line.is_empty() {
            let (series, value) = line.rsplit_once(' ').expect("sample line");
            let name = series.split('{').next().expect("name");
            let family = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).filter(|f| declared.iter().any(|d| d == f));
            assert!(declared.iter().any(|d| d == name) || family.is_some(), "sample before its TYPE: {line}");
            samples.insert(series.to_owned(), value.parse().unwrap_or_else(|_| panic!("value of {line}")));
        }
    }
    samples
}

#[test]
fn metrics_report_syncs_programmed_state_rejections_latency_and_datapath_counters() {
    let (topo, _servers) = client_and_two_backends();
    let dir = AgentDir::new(&topo.id).expect("agent dir");
    let base = manifest(&["10.244.1.11", "10.244.1.12"]);
    let bad = "---\napiVersion: v1\nkind: Service\nmetadata: {name: bad, namespace: demo}\n\
               spec: {clusterIP: 10.96.0.999, ports: [{name: http, port: 80, protocol: TCP}]}\n";
    dir.write_manifest(&format!("{base}{bad}")).expect("manifest");
    let agent = Agent::start(&topo, &dir).expect("agent");

    let m = scrape(&agent);
    let get = |m: &BTreeMap<String, f64>, series: &str| *m.get(series).unwrap_or_else(|| panic!("no {series} in {m:#?}"));
    // web (TCP 80, UDP 53) and empty (TCP 80); be1 and be2 on TCP 8080 and UDP 5353.
    assert_eq!(get(&m, "ebpf_proxy_services_programmed"), 2.0);
    assert_eq!(get(&m, "ebpf_proxy_backends_programmed"), 4.0);
    let frontends = agent.dump().expect("dump")["services"].as_array().expect("services").len();
    assert!(frontends >= 3, "every Service port has a frontend");
    assert_eq!(get(&m, "ebpf_proxy_frontends_programmed"), frontends as f64, "as many as the kernel's maps hold");
    assert_eq!(get(&m, r#"ebpf_proxy_rejected_objects_total{kind="Service",reason="invalid_address"}"#), 1.0, "{m:#?}");
    assert_eq!(get(&m, "ebpf_proxy_source_connected"), 1.0);
    let now = Timestamp::now().as_second() as f64;
    let last_sync = get(&m, "ebpf_proxy_last_sync_timestamp_seconds");
    assert!(last_sync <= now + 1.0 && last_sync > now - 30.0, "last sync {last_sync}, now {now}");
    assert!(get(&m, "ebpf_proxy_sync_duration_seconds_count") >= 1.0);
    assert_eq!(
        get(&m, r#"ebpf_proxy_sync_duration_seconds_bucket{le="+Inf"}"#),
        get(&m, "ebpf_proxy_sync_duration_seconds_count")
    );
    assert!(get(&m, r#"ebpf_proxy_sync_duration_seconds_bucket{le="1.024"}"#) >= 1.0, "a sync of 3 Services takes < 1 s");
    assert!(get(&m, "ebpf_proxy_network_programming_duration_seconds_count") >= 1.0);

    // Traffic moves the datapath counters.
    let xlate = r#"ebpf_proxy_datapath_events_total{event="sock_xlate"}"#;
    let before = get(&m, xlate);
    let web = e2e::probe::tcp(&topo, "client", &format!("{VIP}:80"), 20).expect("probe");
    assert_eq!(web.failed, 0, "{web:?}");
    assert!(get(&scrape(&agent), xlate) >= before + 20.0, "20 translated connects must be counted");

    // An EndpointSlice change whose trigger time (set by the EndpointSlice controller when the
    // Pod changed) is 3 s before the agent hears of it: the latency is measured from there.
    std::thread::sleep(Duration::from_millis(1100)); // so the whole-second stamp is after the agent's start
    let trigger = Timestamp::from_second(Timestamp::now().as_second()).expect("timestamp");
    std::thread::sleep(Duration::from_secs(3));
    let programmed = get(&scrape(&agent), "ebpf_proxy_network_programming_duration_seconds_count");
    let annotated = manifest(&["10.244.1.11"]).replace(
        "  name: web-abc\n",
        &format!("  name: web-abc\n  annotations: {{endpoints.kubernetes.io/last-change-trigger-time: \"{trigger}\"}}\n"),
    );
    assert!(annotated.contains("last-change-trigger-time"), "{annotated}");
    dir.write_manifest(&format!("{annotated}{bad}")).expect("manifest");
    let m = wait_for(&agent, Duration::from_secs(2), "the change programmed", || {
        let m = scrape(&agent);
        (get(&m, "ebpf_proxy_network_programming_duration_seconds_count") > programmed).then_some(m)
    });
    let count = get(&m, "ebpf_proxy_network_programming_duration_seconds_count");
    let over = |le: &str| count - get(&m, &format!(r#"ebpf_proxy_network_programming_duration_seconds_bucket{{le="{le}"}}"#));
    assert_eq!((over("2"), over("10")), (1.0, 0.0), "one observation between 2 s and 10 s, from the annotation: {m:#?}");
    assert_eq!(get(&m, "ebpf_proxy_backends_programmed"), 2.0, "be2 removed: TCP and UDP backend gone");
}

#[test]
fn metrics_follow_the_real_api_server_connection_and_its_changes() {
    let mut env = KubeEnv::new();
    let get = |m: &BTreeMap<String, f64>, series: &str| *m.get(series).unwrap_or_else(|| panic!("no {series} in {m:#?}"));
    let m = scrape(&env.agent);
    assert_eq!(get(&m, "ebpf_proxy_source_connected"), 1.0);
    // web and the API server's own `kubernetes` Service.
    assert_eq!(get(&m, "ebpf_proxy_services_programmed"), 2.0, "{m:#?}");
    assert!(get(&m, "ebpf_proxy_network_programming_duration_seconds_count") >= 1.0);

    // A slice written through the API with the trigger time its controller would have set 2 s
    // before: the latency counts from the annotation, not from when the watch delivered it.
    std::thread::sleep(Duration::from_millis(1100)); // so the whole-second stamp is after the agent's start
    let trigger = Timestamp::from_second(Timestamp::now().as_second()).expect("timestamp");
    std::thread::sleep(Duration::from_secs(2));
    let late = |m: &BTreeMap<String, f64>| {
        get(m, "ebpf_proxy_network_programming_duration_seconds_count")
            - get(m, r#"ebpf_proxy_network_programming_duration_seconds_bucket{le="1"}"#)
    };
    let before = late(&scrape(&env.agent));
    let annotated = slice("web", &["10.244.1.11"]).replace(
        "  name: web-abc\n",
        &format!("  name: web-abc\n  annotations: {{endpoints.kubernetes.io/last-change-trigger-time: \"{trigger}\"}}\n"),
    );
    assert!(annotated.contains("last-change-trigger-time"), "{annotated}");
    env.api.apply(&annotated).expect("apply annotated slice");
    let m = wait_for(&env.agent, Duration::from_secs(2), "the change measured", || {
        let m = scrape(&env.agent);
        (late(&m) > before).then_some(m)
    });
    assert_eq!(late(&m) - before, 1.0, "one observation of 2-3 s: {m:#?}");
    assert_eq!(
        get(&m, r#"ebpf_proxy_network_programming_duration_seconds_bucket{le="5"}"#),
        get(&m, "ebpf_proxy_network_programming_duration_seconds_count"),
        "and not more than 5 s"
    );

    // The API server fails: the gauge says so (the API is probed every 10 s), then recovers.
    env.api.stop_apiserver().expect("stop kube-apiserver");
    wait_for(&env.agent, Duration::from_secs(20), "source_connected 0", || {
        (get(&scrape(&env.agent), "ebpf_proxy_source_connected") == 0.0).then_some(())
    });
    env.api.start_apiserver().expect("start kube-apiserver");
    wait_for(&env.agent, Duration::from_secs(30), "source_connected 1", || {
        (get(&scrape(&env.agent), "ebpf_proxy_source_connected") == 1.0).then_some(())
    });
}
