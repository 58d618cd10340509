//! What the agent keeps of a Service: the fields kube-proxy reads, converted once on arrival.
//! The API's `Service` is about 1 KiB inline (ObjectMeta and ServiceSpec are mostly `Option`s
//! of strings, maps and lists) before its strings: at 30 000 Services it held 31 MiB of the
//! agent's heap; this holds the same answers in about a quarter of that.
//!
//! Values stay as the object wrote them where a rejection must quote them (addresses, port
//! numbers, protocols); what is only compared is reduced to what the comparison needs.

use k8s_openapi::api::core::v1::{Service, ServicePort};

use super::{LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME};

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ServiceInfo {
    /// As the object says ("" when it names none).
    pub namespace: String,
    pub name: String,
    /// Labelled for another proxy or as headless: kube-proxy skips it.
    pub skip_label: bool,
    /// `spec.clusterIP` is unset, empty or `None` (a headless Service, or no spec at all).
    pub headless: bool,
    pub type_: ServiceType,
    /// `spec.clusterIPs`, else `spec.clusterIP`, as written.
    pub cluster_ips: Vec<String>,
    /// `spec.externalIPs`, as written.
    pub external_ips: Vec<String>,
    /// `status.loadBalancer.ingress[].ip` of VIP mode (`ipMode` unset or `VIP`), as written:
    /// kube-proxy programs only those; `ipMode: Proxy` means the load balancer proxies
    /// (pkg/proxy/serviceport.go `newBaseServiceInfo`).
    pub load_balancer_ips: Vec<String>,
    /// `internalTrafficPolicy: Local`.
    pub internal_local: bool,
    /// `externalTrafficPolicy: Local`.
    pub external_local: bool,
    /// `sessionAffinity: ClientIP`, with `sessionAffinityConfig.clientIP.timeoutSeconds` if set.
    pub client_ip_affinity: Option<Option<i32>>,
    pub health_check_node_port: Option<i32>,
    pub ports: Vec<PortInfo>,
}

/// `spec.type`, reduced to the values kube-proxy tells apart.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ServiceType {
    /// `ClusterIP`, unset, or a value the API would refuse.
    #[default]
    ClusterIp,
    NodePort,
    LoadBalancer,
    ExternalName,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct PortInfo {
    /// "" when unnamed.
    pub name: String,
    /// As written; `None` means TCP.
    pub protocol: Option<String>,
    pub port: i32,
    /// 0 when none.
    pub node_port: i32,
}

impl From<Service> for ServiceInfo {
    fn from(service: Service) -> Self {
        let meta = service.metadata;
        let labels = meta.labels.unwrap_or_default();
        let spec = service.spec.unwrap_or_default();
        let type_ = match spec.type_.as_deref() {
            Some("NodePort") => ServiceType::NodePort,
            Some("LoadBalancer") => ServiceType::LoadBalancer,
            Some("ExternalName") => ServiceType::ExternalName,
            _ => ServiceType::ClusterIp,
        };
        let cluster_ips = match spec.cluster_ips {
            Some(ips) if !ips.is_empty() => ips,
            _ => spec.cluster_ip.iter().cloned().collect(),
        };
        let ingress = service.status.and_then(|s| s.load_balancer).and_then(|lb| lb.ingress).unwrap_or_default();
        let load_balancer_ips =
            ingress.into_iter().filter(|i| i.ip_mode.as_deref().is_none_or(|mode| mode == "VIP")).filter_map(|i| i.ip).collect();
        let client_ip_affinity = (spec.session_affinity.as_deref() == Some("ClientIP"))
            .then(|| spec.session_affinity_config.and_then(|c| c.client_ip).and_then(|c| c.timeout_seconds));
        Self {
            namespace: shrink(meta.namespace.unwrap_or_default()),
            name: shrink(meta.name.unwrap_or_default()),
            skip_label: labels.contains_key(LABEL_SERVICE_PROXY_NAME) || labels.contains_key(LABEL_HEADLESS),
            headless: matches!(spec.cluster_ip.as_deref(), None | Some("") | Some("None")),
            type_,
            cluster_ips: strings(cluster_ips),
            external_ips: strings(spec.external_ips.unwrap_or_default()),
            load_balancer_ips: strings(load_balancer_ips),
            internal_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
            external_local: spec.external_traffic_policy.as_deref() == Some("Local"),
            client_ip_affinity,
            health_check_node_port: spec.health_check_node_port,
            ports: {
                // A new Vec, not `collect()`, which would keep the API's larger allocation.
                let ports = spec.ports.unwrap_or_default();
                let mut kept = Vec::with_capacity(ports.len());
                kept.extend(ports.into_iter().map(PortInfo::from));
                kept
            },
        }
    }
}

impl From<ServicePort> for PortInfo {
    fn from(port: ServicePort) -> Self {
        Self {
            name: shrink(port.name.unwrap_or_default()),
            protocol: port.protocol.map(shrink),
            port: port.port,
            node_port: port.node_port.unwrap_or(0),
        }
    }
}

impl ServiceInfo {
    /// (namespace, name), the namespace `default` when the object names none (as a manifest
    /// applied without one would be).
    pub fn object_name(&self) -> (String, String) {
        object_name(&self.namespace, &self.name)
    }

    /// Services kube-proxy does not program: ExternalName (even with a stale clusterIP),
    /// headless, and those labelled for another proxy or as headless.
    pub fn is_ignored(&self) -> bool {
        self.skip_label || self.headless || self.type_ == ServiceType::ExternalName
    }
}

/// (namespace, name) of an object as kept, the namespace `default` when it names none.
pub(super) fn object_name(namespace: &str, name: &str) -> (String, String) {
    (default_namespace(namespace).to_owned(), name.to_owned())
}

/// An object's namespace as the API names it (`default` when the manifest left it out).
pub fn default_namespace(namespace: &str) -> &str {
    if namespace.is_empty() { "default" } else { namespace }
}

/// Strings without spare capacity, in a list without spare capacity.
fn strings(texts: Vec<String>) -> Vec<String> {
    let mut kept = Vec::with_capacity(texts.len());
    kept.extend(texts.into_iter().map(shrink));
    kept
}

/// A string without spare capacity (a deserialized one may have some).
pub(super) fn shrink(mut text: String) -> String {
    text.shrink_to_fit();
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(yaml: &str) -> ServiceInfo {
        serde_yaml::from_str::<Service>(yaml).expect("service").into()
    }

    #[test]
    fn keeps_what_kube_proxy_reads() {
        let service = info(
            "metadata: {name: web, namespace: demo, labels: {app: web}, annotations: {a: b}}\n\
             spec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  clusterIPs: [10.96.0.10, fd00::10]\n  \
             externalIPs: [192.0.2.1]\n  externalTrafficPolicy: Local\n  internalTrafficPolicy: Local\n  \
             healthCheckNodePort: 31000\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n  \
             selector: {app: web}\n  ports: [{name: http, port: 80, protocol: UDP, nodePort: 30080}, {port: 81}]\n\
             status: {loadBalancer: {ingress: [{ip: 198.51.100.1}, {ip: 198.51.100.2, ipMode: Proxy}, {hostname: lb.example}]}}\n",
        );
        assert_eq!(
            service,
            ServiceInfo {
                namespace: "demo".into(),
                name: "web".into(),
                skip_label: false,
                headless: false,
                type_: ServiceType::LoadBalancer,
                cluster_ips: vec!["10.96.0.10".into(), "fd00::10".into()],
                external_ips: vec!["192.0.2.1".into()],
                load_balancer_ips: vec!["198.51.100.1".into()],
                internal_local: true,
                external_local: true,
                client_ip_affinity: Some(Some(60)),
                health_check_node_port: Some(31000),
                ports: vec![
                    PortInfo { name: "http".into(), protocol: Some("UDP".into()), port: 80, node_port: 30080 },
                    PortInfo { name: "".into(), protocol: None, port: 81, node_port: 0 },
                ],
            }
        );
        assert!(!service.is_ignored());
    }

    #[test]
    fn the_cluster_ip_stands_in_for_an_empty_cluster_ips_and_ignored_services_are_known() {
        let service = info("metadata: {name: a}\nspec: {clusterIP: 10.96.0.1, clusterIPs: []}\n");
        assert_eq!((service.object_name(), service.cluster_ips), (("default".into(), "a".into()), vec!["10.96.0.1".to_owned()]));
        assert_eq!(info("metadata: {name: a}\nspec: {sessionAffinity: ClientIP}\n").client_ip_affinity, Some(None));
        for ignored in [
            "metadata: {name: a}\n",
            "metadata: {name: a}\nspec: {clusterIP: None}\n",
            "metadata: {name: a}\nspec: {clusterIP: ''}\n",
            "metadata: {name: a}\nspec: {type: ExternalName, clusterIP: 10.96.0.1}\n",
            "metadata: {name: a, labels: {service.kubernetes.io/headless: ''}}\nspec: {clusterIP: 10.96.0.1}\n",
            "metadata: {name: a, labels: {service.kubernetes.io/service-proxy-name: other}}\nspec: {clusterIP: 10.96.0.1}\n",
        ] {
            assert!(info(ignored).is_ignored(), "{ignored}");
        }
        assert!(size_of::<ServiceInfo>() <= 192, "{}", size_of::<ServiceInfo>());
    }
}
