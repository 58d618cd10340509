//! Health as kube-proxy reports it (`pkg/proxy/healthcheck`):
//!
//! - the `/healthz` verdict, a pure function of times: unhealthy before the first sync, while the
//!   source fails, and when an API change has waited longer than `--healthz-stale-after` without
//!   reaching the datapath (kube-proxy's "oldest pending queued update" rule);
//! - the `healthCheckNodePort` servers of `type: LoadBalancer` Services with
//!   `externalTrafficPolicy: Local`: cloud load balancers probe them to send traffic only to nodes
//!   with a ready local endpoint (200 with the count, 503 without one).
//!
//! Owns neither the datapath nor the source: the agent loop feeds it each new view.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::agent::error_chain;
use crate::desired::{default_namespace, ClusterState, EndpointAddress, ServiceInfo, ServiceType};
use crate::http::{self, Response};

/// How far the datapath is behind the API: the age of the oldest change the source delivered
/// that no sync has fully programmed yet, when that exceeds `stale_after`.
///
/// This is kube-proxy's rule (`QueuedUpdate`/`Updated`): a datapath that is merely old is fine
/// (nothing changed), one that keeps failing to take a change (a full map, a refused write) is not.
pub fn behind_api(oldest_unprogrammed_change: Option<Instant>, now: Instant, stale_after: Duration) -> Option<Duration> {
    let age = now.saturating_duration_since(oldest_unprogrammed_change?);
    (age > stale_after).then_some(age)
}

/// The `/healthz` verdict.
#[derive(Clone, Debug, PartialEq)]
pub struct ProxyHealth {
    pub healthy: bool,
    /// The datapath may not match the API: the source is failing or the datapath is behind.
    pub stale: bool,
    /// How long it has been stale (the longer of the two causes).
    pub stale_for: Option<Duration>,
}

/// Healthy once synced, while the source answers and the datapath keeps up with it.
pub fn proxy_health(synced: bool, source_failing_for: Option<Duration>, behind: Option<Duration>) -> ProxyHealth {
    let stale_for = source_failing_for.max(behind);
    ProxyHealth { healthy: synced && stale_for.is_none(), stale: stale_for.is_some(), stale_for }
}

/// `namespace/name` of a Service.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceName {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for ServiceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One Service that needs a health check server on this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    pub port: u16,
    /// Distinct addresses of ready endpoints on this node (kube-proxy `LocalReadyEndpoints`:
    /// terminating ones do not count, one Pod serving two ports counts once).
    pub local_endpoints: usize,
}

/// The Services kube-proxy opens a `healthCheckNodePort` for (`type: LoadBalancer`,
/// `externalTrafficPolicy: Local`, a port set, and not skipped as headless, labelled for another
/// proxy or without ports), with their local ready endpoint counts. Pure.
pub fn health_checks(
    cluster: &ClusterState,
    node_name: &str,
) -> BTreeMap<ServiceName, HealthCheck> {
    // Borrowed names: this runs on every sync, and at 30 000 Services copying every slice's
    // name to look it up took 10 ms per endpoint change.
    let ports: BTreeMap<(&str, &str), u16> = cluster
        .services
        .iter()
        .filter_map(|service| {
            Some((
                (default_namespace(&service.namespace), service.name.as_str()),
                health_check_port(service)?,
            ))
        })
        .collect();
    if ports.is_empty() {
        return BTreeMap::new();
    }

    let mut local: BTreeMap<(&str, &str), BTreeSet<&EndpointAddress>> = BTreeMap::new();
    for slice in &cluster.slices {
        let Some(service) = slice.service_name.as_ref() else {
            continue;
        };
        let name = (default_namespace(&slice.namespace), service.as_str());
        // kube-proxy keeps endpoints per usable port; a slice without one contributes nothing.
        let has_port = slice
            .ports
            .iter()
            .flatten()
            .any(|p| p.port.is_some_and(|n| n > 0));
        if !ports.contains_key(&name) || slice.address_type == "FQDN" || !has_port {
            continue;
        }
        for endpoint in &slice.endpoints {
            let ready = endpoint.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            let on_this_node = endpoint.node_name.as_deref() == Some(node_name);
            if let (true, true, Some(address)) = (ready, on_this_node, endpoint.address.as_ref()) {
                local.entry(name).or_default().insert(address);
            }
        }
    }
    ports
        .into_iter()
        .map(|(key, port)| {
            let local_endpoints = local.get(&key).map_or(0, BTreeSet::len);
            (
                ServiceName {
                    namespace: key.0.to_owned(),
                    name: key.1.to_owned(),
                },
                HealthCheck {
                    port,
                    local_endpoints,
                },
            )
        })
        .collect()
}

fn health_check_port(service: &ServiceInfo) -> Option<u16> {
    let wanted = service.type_ == ServiceType::LoadBalancer
        && service.external_local
        && !service.skip_label
        && !service.headless
        && !service.ports.is_empty();
    if !wanted {
        return None;
    }
    u16::try_from(service.health_check_node_port?).ok().filter(|p| *p != 0)
}

/// kube-proxy's answer, byte for byte (`hcHandler.ServeHTTP`): 200 when the Service has a ready
/// local endpoint and the proxy is healthy, else 503; the same JSON either way.
pub fn service_health_response(name: &ServiceName, local_endpoints: usize, proxy_healthy: bool) -> Response {
    let quote = |s: &str| serde_json::Value::from(s).to_string();
    let body = format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {local_endpoints},\n\t\"serviceProxyHealthy\": {proxy_healthy}\n}}",
        quote(&name.namespace),
        quote(&name.name)
    );
    Response::json(if local_endpoints != 0 && proxy_healthy { 200 } else { 503 }, body)
}

struct Listener {
    port: u16,
    local_endpoints: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

/// The running `healthCheckNodePort` listeners, one per Service, on all addresses of the
/// agent's network namespace (kube-proxy listens on 0.0.0.0 unless `nodePortAddresses` is set).
pub struct HealthCheckServers {
    listeners: BTreeMap<ServiceName, Listener>,
    /// Ports that could not be bound, by Service: logged once, retried on every sync.
    unbound: BTreeMap<ServiceName, u16>,
    proxy_healthy: Arc<dyn Fn() -> bool + Send + Sync>,
}

impl HealthCheckServers {
    pub fn new(proxy_healthy: Arc<dyn Fn() -> bool + Send + Sync>) -> Self {
        Self { listeners: BTreeMap::new(), unbound: BTreeMap::new(), proxy_healthy }
    }

    pub fn open_ports(&self) -> usize {
        self.listeners.len()
    }

    /// Opens, closes and updates listeners to match `wanted`. Never fails: a port that cannot be
    /// bound is logged (once) naming the Service, and the other Services are served.
    pub async fn sync(&mut self, wanted: &BTreeMap<ServiceName, HealthCheck>) {
        let closing: Vec<ServiceName> = self
            .listeners
            .iter()
            .filter(|(name, l)| wanted.get(*name).is_none_or(|w| w.port != l.port))
            .map(|(name, _)| name.clone())
            .collect();
        for name in closing {
            if let Some(listener) = self.listeners.remove(&name) {
                listener.task.abort();
                tracing::info!(service = %name, port = listener.port, "closed healthCheckNodePort");
            }
        }
        self.unbound.retain(|name, port| wanted.get(name).is_some_and(|w| w.port == *port));

        for (name, check) in wanted {
            if let Some(listener) = self.listeners.get(name) {
                listener.local_endpoints.store(check.local_endpoints, Ordering::Relaxed);
                continue;
            }
            let local_endpoints = Arc::new(AtomicUsize::new(check.local_endpoints));
            let handler = {
                let (name, count, healthy) = (name.clone(), local_endpoints.clone(), self.proxy_healthy.clone());
                move |_path: &str| service_health_response(&name, count.load(Ordering::Relaxed), healthy())
            };
            let bind = SocketAddr::from((Ipv4Addr::UNSPECIFIED, check.port));
            match http::serve(bind, handler).await {
                Ok(task) => {
                    if self.unbound.remove(name).is_some() {
                        tracing::info!(service = %name, port = check.port, "healthCheckNodePort can be bound now");
                    }
                    tracing::info!(service = %name, port = check.port, "opened healthCheckNodePort");
                    self.listeners.insert(name.clone(), Listener { port: check.port, local_endpoints, task });
                }
                Err(error) => {
                    if self.unbound.insert(name.clone(), check.port) != Some(check.port) {
                        tracing::error!(
                            "cannot listen on healthCheckNodePort {bind} of Service {name}: {}; load balancers will see this node as unhealthy for it",
                            error_chain(&error)
                        );
                    }
                }
            }
        }
    }
}

impl Drop for HealthCheckServers {
    fn drop(&mut self) {
        for listener in self.listeners.values() {
            listener.task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(yaml: &str) -> ClusterState {
        let (state, rejections) = crate::source::file::parse_manifests(&std::collections::BTreeMap::from([(
            std::path::PathBuf::from("t.yaml"),
            yaml.as_bytes().to_vec(),
        )]));
        assert!(rejections.is_empty(), "{rejections:?}");
        state
    }

    fn service(name: &str, extra: &str) -> String {
        format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: demo}}\n\
             spec: {{clusterIP: 10.96.0.50, ports: [{{name: http, port: 80, protocol: TCP}}], {extra}}}\n"
        )
    }

    fn slice(service: &str, suffix: &str, endpoints: &str) -> String {
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{name: {service}-{suffix}, namespace: demo, labels: {{kubernetes.io/service-name: {service}}}}}\n\
             addressType: IPv4\nendpoints: {endpoints}\nports: [{{name: http, port: 8080, protocol: TCP}}]\n"
        )
    }

    const LOCAL: &str = "type: LoadBalancer, externalTrafficPolicy: Local, healthCheckNodePort: 32000";

    fn counts(yaml: &str) -> Vec<(String, u16, usize)> {
        health_checks(&cluster(yaml), "node-1")
            .into_iter()
            .map(|(name, check)| (name.name, check.port, check.local_endpoints))
            .collect()
    }

    #[test]
    fn only_local_load_balancers_with_a_port_get_a_health_check() {
        let yaml = [
            service("lb-local", LOCAL),
            service("lb-cluster", "type: LoadBalancer, externalTrafficPolicy: Cluster, healthCheckNodePort: 32001"),
            service("nodeport-local", "type: NodePort, externalTrafficPolicy: Local, healthCheckNodePort: 32002"),
            service("lb-local-no-port", "type: LoadBalancer, externalTrafficPolicy: Local"),
            service("headless", "clusterIP: None, type: LoadBalancer, externalTrafficPolicy: Local, healthCheckNodePort: 32003")
                .replace("clusterIP: 10.96.0.50, ", ""),
        ]
        .concat();
        assert_eq!(counts(&yaml), [("lb-local".to_owned(), 32000, 0)]);

        let labelled = service("other-proxy", LOCAL)
            .replace("namespace: demo}", "namespace: demo, labels: {service.kubernetes.io/service-proxy-name: x}}");
        assert_eq!(counts(&labelled), []);
    }

    #[test]
    fn local_endpoints_are_distinct_ready_addresses_on_this_node() {
        let yaml = [
            service("web", LOCAL),
            slice(
                "web",
                "a",
                "[{addresses: [10.244.1.11], nodeName: node-1},
                  {addresses: [10.244.1.12], nodeName: node-1, conditions: {ready: true}},
                  {addresses: [10.244.1.13], nodeName: node-1, conditions: {ready: false, serving: true, terminating: true}},
                  {addresses: [10.244.2.11], nodeName: node-2},
                  {addresses: [10.244.1.14]}]",
            ),
            // The same Pod again in a second slice (slice rebalancing) counts once.
            slice("web", "b", "[{addresses: [10.244.1.11], nodeName: node-1}]"),
            // Another Service's endpoint on this node does not count for web.
            slice("other", "a", "[{addresses: [10.244.1.20], nodeName: node-1}]"),
        ]
        .concat();
        assert_eq!(counts(&yaml), [("web".to_owned(), 32000, 2)]);
    }

    #[test]
    fn only_terminating_or_remote_endpoints_count_as_none() {
        let yaml = [
            service("web", LOCAL),
            slice("web", "a", "[{addresses: [10.244.1.13], nodeName: node-1, conditions: {ready: false, terminating: true}}, {addresses: [10.244.2.1], nodeName: node-2}]"),
        ]
        .concat();
        assert_eq!(counts(&yaml), [("web".to_owned(), 32000, 0)]);
        let no_ports = [service("web", LOCAL), slice("web", "a", "[{addresses: [10.244.1.11], nodeName: node-1}]").replace("ports: [{name: http, port: 8080, protocol: TCP}]", "ports: []")].concat();
        assert_eq!(counts(&no_ports), [("web".to_owned(), 32000, 0)]);
    }

    #[test]
    fn the_answer_is_kube_proxys() {
        let name = ServiceName { namespace: "ns".into(), name: "web".into() };
        let ok = service_health_response(&name, 2, true);
        assert_eq!((ok.status, ok.content_type), (200, "application/json"));
        assert_eq!(
            ok.body,
            "{\n\t\"service\": {\n\t\t\"namespace\": \"ns\",\n\t\t\"name\": \"web\"\n\t},\n\t\"localEndpoints\": 2,\n\t\"serviceProxyHealthy\": true\n}"
        );
        let parsed: serde_json::Value = serde_json::from_str(&ok.body).expect("json");
        assert_eq!(parsed["service"]["name"], "web");
        assert_eq!(service_health_response(&name, 0, true).status, 503);
        let unhealthy = service_health_response(&name, 2, false);
        assert_eq!(unhealthy.status, 503);
        assert!(unhealthy.body.contains("\"serviceProxyHealthy\": false"));
    }

    #[test]
    fn the_datapath_is_stale_only_when_a_change_waited_longer_than_the_threshold() {
        let t0 = Instant::now();
        let limit = Duration::from_secs(60);
        assert_eq!(behind_api(None, t0 + Duration::from_secs(3600), limit), None, "nothing pending: an old datapath is fine");
        assert_eq!(behind_api(Some(t0), t0 + Duration::from_secs(60), limit), None, "exactly at the threshold is not late yet");
        assert_eq!(behind_api(Some(t0), t0 + Duration::from_secs(61), limit), Some(Duration::from_secs(61)));
        assert_eq!(behind_api(Some(t0 + Duration::from_secs(5)), t0, limit), None, "a clock step backwards is not late");
    }

    #[test]
    fn health_combines_sync_source_and_datapath_lag() {
        let s = Duration::from_secs;
        assert!(!proxy_health(false, None, None).healthy, "not before the first sync");
        assert_eq!(proxy_health(true, None, None), ProxyHealth { healthy: true, stale: false, stale_for: None });
        assert_eq!(proxy_health(true, Some(s(5)), None), ProxyHealth { healthy: false, stale: true, stale_for: Some(s(5)) });
        assert_eq!(proxy_health(true, None, Some(s(61))), ProxyHealth { healthy: false, stale: true, stale_for: Some(s(61)) });
        assert_eq!(proxy_health(true, Some(s(5)), Some(s(61))).stale_for, Some(s(61)));
    }
}
