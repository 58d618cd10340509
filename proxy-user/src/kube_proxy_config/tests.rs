use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;

use super::*;

/// kube-proxy's ConfigMap as `kubeadm init --pod-network-cidr=10.244.0.0/16` v1.34 writes it
/// (`kubeadm init phase addon kube-proxy --print-manifest`): every field, most at their zero value.
const KUBEADM_CONFIGMAP: &str = include_str!("kubeadm-v1.34-kube-proxy-configmap.yaml");

fn kubeadm_config_conf() -> String {
    let configmap: ConfigMap = serde_yaml::from_str(KUBEADM_CONFIGMAP).expect("ConfigMap");
    configmap.data.expect("data")["config.conf"].clone()
}

fn file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("epx-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write config");
    path
}

fn parse_text(text: &str) -> Result<FileSettings, ConfigError> {
    parse(Path::new("config.conf"), text)
}

const HEADER: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

#[test]
fn the_kubeadm_configmap_gives_its_kubeconfig_and_leaves_the_rest_to_the_defaults() {
    let settings = parse_text(&kubeadm_config_conf()).expect("kubeadm's file is accepted");
    assert_eq!(
        settings,
        FileSettings {
            kubeconfig: Some("/var/lib/kube-proxy/kubeconfig.conf".into()),
            bind_address: Some(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
            cluster_cidrs: vec![parse_cidr_sloppy("10.244.0.0/16").unwrap()],
            // Only clusterCIDR is set among the fields without effect here: nothing else to warn about.
            ignored: vec!["clusterCIDR".into()],
            ..FileSettings::default()
        }
    );

    // The agent's effective settings: the file's kubeconfig, kube-proxy's defaults elsewhere
    // (which are also the agent's), as with no file.
    let path = file("kubeadm.conf", &kubeadm_config_conf());
    let config = path.to_str().unwrap();
    let without = crate::agent_args(&["ebpf-proxy", "agent"]).expect("no file");
    let with = crate::agent_args(&["ebpf-proxy", "agent", "--config", config]).expect("kubeadm's file");
    assert_eq!(with.kubeconfig, Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf")));
    assert_eq!(with.healthz_bind, "0.0.0.0:10256".parse::<SocketAddr>().unwrap());
    assert_eq!(with.metrics_bind, "127.0.0.1:10249".parse::<SocketAddr>().unwrap());
    assert_eq!(with.nodeport_addresses, crate::desired::NodePortAddresses::All);
    assert_eq!(with.node_name, without.node_name, "hostnameOverride \"\" keeps the default node name");

    // kubeadm's DaemonSet adds --hostname-override=$(NODE_NAME); ours is --node-name, and flags win.
    let flagged = crate::agent_args(&["ebpf-proxy", "agent", "--config", config, "--node-name", "node-1", "--kubeconfig", "/etc/k.conf"])
        .expect("flags");
    assert_eq!((flagged.node_name.as_str(), flagged.kubeconfig), ("node-1", Some(PathBuf::from("/etc/k.conf"))));
}

#[test]
fn the_file_sets_what_no_flag_on_the_command_line_gives() {
    let path = file(
        "set.conf",
        &format!(
            "{HEADER}hostnameOverride: \" Node-A \"\nhealthzBindAddress: 127.0.0.1:20256\nmetricsBindAddress: 0.0.0.0:10249\n\
             nodePortAddresses: [10.0.0.0/8, fd00::/64]\nclientConnection: {{kubeconfig: /var/lib/kp.conf}}\nconfigSyncPeriod: 15m0s\n"
        ),
    );
    let config = path.to_str().unwrap();
    let args = crate::agent_args(&["ebpf-proxy", "agent", "--config", config, "--metrics-bind", "127.0.0.1:9999"]).expect("args");
    assert_eq!(args.node_name, "node-a", "trimmed and lower-cased, as kube-proxy");
    assert_eq!(args.healthz_bind, "127.0.0.1:20256".parse::<SocketAddr>().unwrap());
    assert_eq!(args.metrics_bind, "127.0.0.1:9999".parse::<SocketAddr>().unwrap(), "the flag wins");
    assert_eq!(args.nodeport_addresses, crate::desired::NodePortAddresses::parse("10.0.0.0/8,fd00::/64").unwrap());
    assert_eq!(args.kubeconfig, Some(PathBuf::from("/var/lib/kp.conf")));
    // A flag given at its default value still wins over the file.
    let args = crate::agent_args(&["ebpf-proxy", "agent", "--config", config, "--healthz-bind", "0.0.0.0:10256"]).expect("args");
    assert_eq!(args.healthz_bind, "0.0.0.0:10256".parse::<SocketAddr>().unwrap());

    let settings = parse_text(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(settings.config_sync_period, Some(Duration::from_secs(900)));
    assert_eq!(settings.ignored, ["configSyncPeriod"]);
}

#[test]
fn an_ipv6_bind_address_gives_ipv6_default_listeners_as_in_kube_proxy() {
    let settings = parse_text(&format!("{HEADER}bindAddress: \"::\"\n")).unwrap();
    assert_eq!(settings.healthz_bind, Some("[::]:10256".parse().unwrap()));
    assert_eq!(settings.metrics_bind, Some("[::1]:10249".parse().unwrap()));
    assert!(settings.ignored.is_empty(), "{:?}", settings.ignored);
    // A specific address is kube-proxy's idea of the node IP: without effect here, so named.
    let settings = parse_text(&format!("{HEADER}bindAddress: 10.0.0.5\nnodePortAddresses: [primary]\n")).unwrap();
    assert_eq!(settings.ignored, ["bindAddress"]);
    assert_eq!(settings.nodeport_addresses, Some(crate::desired::NodePortAddresses::Primary));
}

#[test]
fn settings_of_kube_proxys_own_modes_are_accepted_and_named_by_path() {
    let text = format!(
        "{HEADER}mode: ipvs\nipvs: {{scheduler: rr, strictARP: true, syncPeriod: 0s}}\niptables: {{masqueradeAll: true, masqueradeBit: 14}}\n\
         nftables: {{masqueradeBit: null}}\nconntrack: {{maxPerCore: 32768, min: 0}}\nwinkernel: {{enableDSR: false}}\n\
         featureGates: {{SomeGate: true}}\nclientConnection: {{qps: 5, burst: 10, kubeconfig: /k}}\nlogging: {{verbosity: 2}}\n"
    );
    let settings = parse_text(&text).expect("accepted");
    assert_eq!(
        settings.ignored,
        [
            "mode",
            "iptables.masqueradeAll",
            "iptables.masqueradeBit",
            "ipvs.scheduler",
            "ipvs.strictARP",
            "conntrack.maxPerCore",
            "featureGates.SomeGate",
            "logging.verbosity",
            "clientConnection.qps",
            "clientConnection.burst",
        ]
    );
    assert_eq!(settings.kubeconfig, Some(PathBuf::from("/k")));
}

/// The error's whole chain, as the agent prints it.
fn error_text(text: &str) -> String {
    format!("{:#}", anyhow::Error::from(parse_text(text).expect_err(text)))
}

#[test]
fn unknown_fields_are_errors_naming_their_path() {
    for (text, field) in [
        (format!("{HEADER}bindAdress: 0.0.0.0\n"), "bindAdress"),
        (format!("{HEADER}clientConnection:\n  kubeConfig: /k\n"), "clientConnection.kubeConfig"),
        (format!("{HEADER}iptables: {{masqueradeAl: true}}\n"), "iptables.masqueradeAl"),
        (format!("{HEADER}logging: {{options: {{json: {{infoBufferSize: \"0\", bogus: 1}}}}}}\n"), "logging.options.json.bogus"),
    ] {
        match parse_text(&text) {
            Err(ConfigError::Decode { field: path, .. }) => assert_eq!(path, field, "{text}"),
            other => panic!("{text}: {other:?}"),
        }
        let message = error_text(&text);
        assert!(message.contains(&format!("field `{field}`")) && message.contains("unknown field"), "{message}");
    }
}

#[test]
fn wrong_types_are_errors_naming_the_field() {
    let message = error_text(&format!("{HEADER}clientConnection: {{qps: fast}}\n"));
    assert!(message.contains("field `clientConnection.qps`"), "{message}");
    let message = error_text(&format!("{HEADER}nodePortAddresses: 10.0.0.0/8\n"));
    assert!(message.contains("field `nodePortAddresses`"), "{message}");
}

#[test]
fn another_api_version_or_kind_is_refused() {
    let message = error_text("apiVersion: kubeproxy.config.k8s.io/v1beta1\nkind: KubeProxyConfiguration\n");
    assert!(message.contains("apiVersion is \"kubeproxy.config.k8s.io/v1beta1\", expected \"kubeproxy.config.k8s.io/v1alpha1\""), "{message}");
    let message = error_text("kind: KubeProxyConfiguration\n");
    assert!(message.contains("apiVersion is \"\""), "{message}");
    let message = error_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n");
    assert!(message.contains("kind is \"KubeletConfiguration\", expected \"KubeProxyConfiguration\""), "{message}");
}

#[test]
fn invalid_values_are_errors_naming_the_field_and_value() {
    for (line, field, value) in [
        ("bindAddress: 10.0.0.300", "bindAddress", "10.0.0.300"),
        ("healthzBindAddress: 0.0.0.0", "healthzBindAddress", "0.0.0.0"),
        ("metricsBindAddress: localhost:10249", "metricsBindAddress", "localhost:10249"),
        ("nodePortAddresses: [10.0.0.0/8, 10.1.0.0/33]", "nodePortAddresses[1]", "10.1.0.0/33"),
        ("nodePortAddresses: [localhost]", "nodePortAddresses[0]", "localhost"),
        ("configSyncPeriod: soon", "configSyncPeriod", "soon"),
        ("clusterCIDR: 10.244.0.0/16,banana", "clusterCIDR", "10.244.0.0/16,banana"),
        ("detectLocalMode: Magic", "detectLocalMode", "Magic"),
    ] {
        let text = format!("{HEADER}{line}\n");
        match parse_text(&text) {
            Err(ConfigError::Invalid { field: f, value: v, .. }) => assert_eq!((f.as_str(), v.as_str()), (field, value), "{line}"),
            other => panic!("{line}: {other:?}"),
        }
        let message = error_text(&text);
        assert!(message.contains(&format!("field `{field}`: {value:?}")), "{message}");
    }
}

#[test]
fn a_missing_file_names_its_path() {
    let error = load(Path::new("/nonexistent/kube-proxy.conf")).unwrap_err();
    assert!(format!("{error}").contains("/nonexistent/kube-proxy.conf"), "{error}");
}
