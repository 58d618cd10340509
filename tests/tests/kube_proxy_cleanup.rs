//! Switching from kube-proxy: `ebpf-proxy cleanup --kube-proxy` (and its kube-proxy spelling
//! `ebpf-proxy --cleanup --kube-proxy`) removes what the real kube-proxy v1.34 (`cargo xtask
//! peers`) programmed in its iptables mode and in its nftables mode, and leaves every other rule
//! of the namespace exactly as it was.
//!
//! Each test has a node namespace of its own (a veth holding the node address and the
//! default route), where kube-proxy runs against the real kube-apiserver until its rules for
//! three Services (with endpoints, NodePort, without endpoints) are in place; it is then killed,
//! as when its DaemonSet is deleted, which leaves its rules behind.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use e2e::control_plane::ControlPlane;
use e2e::kube_proxy::{self, KubeProxy, Mode};
use e2e::kube_scenario::{node_port_service, service, slice};
use e2e::topology::{enter_netns_on_exec, run, Netns, Topology};
use k8s_openapi::api::core::v1::{Node, NodeAddress, NodeStatus};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};

const NODE_IP: &str = "192.168.240.1";
const VIP: &str = "10.96.0.10";
const NODE_PORT_VIP: &str = "10.96.0.20";
const NO_ENDPOINTS_VIP: &str = "10.96.0.30";

/// Rules of others in the node namespace: a chain of their own with a jump from INPUT, a
/// masquerade, a mangle mark, an IPv6 rule, and an nftables table.
const OTHER_RULES_V4: &str = "*filter
:MINE - [0:0]
-A INPUT -p tcp --dport 2222 -j MINE
-A MINE -s 10.1.0.0/16 -j ACCEPT
-A FORWARD -d 10.96.0.0/16 -j ACCEPT
COMMIT
*nat
-A POSTROUTING -s 10.244.0.0/16 ! -d 10.244.0.0/16 -j MASQUERADE
COMMIT
*mangle
-A PREROUTING -p udp --dport 4789 -j MARK --set-mark 0x40
COMMIT
";
const OTHER_RULES_V6: &str = "*filter
-A INPUT -p tcp --dport 2222 -j ACCEPT
COMMIT
";
const OTHER_NFT: &str = "table inet epxt-mine {
  chain input {
    type filter hook input priority 0; policy accept;
    tcp dport 2223 counter accept
  }
}
";

#[test]
fn cleanup_kube_proxy_removes_the_iptables_mode_rules_and_nothing_else() {
    switching_from_kube_proxy(Mode::Iptables, &["cleanup", "--kube-proxy"]);
}

#[test]
fn the_cleanup_flag_removes_the_nftables_mode_tables_and_nothing_else() {
    switching_from_kube_proxy(Mode::Nftables, &["--cleanup", "--kube-proxy"]);
}

fn switching_from_kube_proxy(mode: Mode, cleanup: &[&str]) {
    let mut api_topology = Topology::new().expect("topology");
    let api = ControlPlane::start(&mut api_topology).expect("control plane");
    let id = e2e::unique_id();
    let node = Netns::create(&format!("{}-{id}-kp", e2e::PREFIX)).expect("node namespace");
    for argv in [
        // A veth, not a dummy: the dummy module is not loaded on every machine (CI's is not).
        &["ip", "link", "add", "eth0", "type", "veth", "peer", "name", "eth0-peer"][..],
        &["ip", "addr", "add", &format!("{NODE_IP}/24"), "dev", "eth0"],
        &["ip", "link", "set", "eth0", "up"],
        &["ip", "route", "add", "default", "dev", "eth0"],
    ] {
        node.exec(argv).expect("node network");
    }
    let node_name = format!("kp-{id}");
    create_node(&api, &node_name);
    api.apply(&format!(
        "{}---\n{}---\n{}---\n{}",
        service("web", VIP),
        slice("web", &["10.244.1.11", "10.244.1.12"]),
        node_port_service("np", NODE_PORT_VIP, 30080),
        slice("np", &["10.244.1.13"]),
    ))
    .expect("Services with endpoints");
    api.apply(&service("quiet", NO_ENDPOINTS_VIP)).expect("Service without endpoints");

    let (_access, kubeconfig) = api.access_from(&node.path(), &format!("kube-proxy-{id}")).expect("access");
    let mut proxy = KubeProxy::start(kube_proxy::Config {
        mode,
        netns: node.path(),
        kubeconfig,
        node_name,
        cluster_cidr: "10.244.0.0/16".into(),
        nodeport_addresses: "192.168.240.0/24".into(),
        log: api.dir.join(format!("kube-proxy-{}.log", mode.flag())),
    })
    .expect("kube-proxy");
    proxy.wait_healthy(Duration::from_secs(60)).expect("kube-proxy healthy");
    // Its rules for all three Services are in place (a DNAT to an endpoint, the NodePort, the
    // reject of the Service without endpoints).
    let programmed = || match mode {
        Mode::Iptables => {
            let v4 = save(&node, "iptables-save");
            ["KUBE-SEP-", "KUBE-NODEPORTS", "--to-destination 10.244.1.13:8080", NO_ENDPOINTS_VIP]
                .iter()
                .all(|needle| v4.contains(needle))
        }
        Mode::Nftables => {
            let table = node.exec(&["nft", "list", "table", "ip", "kube-proxy"]).map(|out| String::from_utf8_lossy(&out.stdout).into_owned());
            table.is_ok_and(|t| [VIP, NODE_PORT_VIP, NO_ENDPOINTS_VIP, "10.244.1.13"].iter().all(|needle| t.contains(needle)))
        }
    };
    wait_for(Duration::from_secs(60), "kube-proxy's rules for the three Services", || {
        proxy.check_running().expect("kube-proxy runs");
        programmed()
    });
    // Stopped as when its DaemonSet goes: its rules stay behind.
    proxy.kill();
    assert!(programmed(), "kube-proxy's rules are there before the cleanup");

    run(Command::new("ip").args(["netns", "exec", &node.name, "iptables-restore", "--noflush"]).stdin_text(OTHER_RULES_V4))
        .expect("other IPv4 rules");
    run(Command::new("ip").args(["netns", "exec", &node.name, "ip6tables-restore", "--noflush"]).stdin_text(OTHER_RULES_V6))
        .expect("other IPv6 rules");
    run(Command::new("ip").args(["netns", "exec", &node.name, "nft", "-f", "-"]).stdin_text(OTHER_NFT)).expect("other nftables table");

    let before = Ruleset::read(&node);
    match mode {
        Mode::Iptables => assert!(before.iptables.contains("KUBE-SVC-"), "{}", before.iptables),
        Mode::Nftables => assert!(before.nft_tables.contains("kube-proxy"), "{}", before.nft_tables),
    }

    let report = ebpf_proxy_in(&node, cleanup, &id);
    eprintln!("{report}");
    let after = Ruleset::read(&node);
    for (family, text) in [("iptables", &after.iptables), ("ip6tables", &after.ip6tables)] {
        let left: Vec<&str> = text.lines().filter(|line| line.contains("KUBE-")).collect();
        assert!(left.is_empty(), "{family}: kube-proxy's chains or jumps remain after `{}`:\n{}", cleanup.join(" "), left.join("\n"));
    }
    assert!(!after.nft_tables.contains("kube-proxy"), "nftables: {}", after.nft_tables);
    // Everything else is exactly as it was.
    assert_eq!(after.iptables, without_kube(&before.iptables), "other IPv4 rules changed");
    assert_eq!(after.ip6tables, without_kube(&before.ip6tables), "other IPv6 rules changed");
    assert_eq!(after.nft_mine, before.nft_mine, "another nftables table changed");
    assert!(after.iptables.contains("-A INPUT -p tcp -m tcp --dport 2222 -j MINE"), "{}", after.iptables);

    // A second run finds nothing left.
    let again = ebpf_proxy_in(&node, cleanup, &id);
    assert!(again.contains("nothing of kube-proxy's was left"), "{again}");
}

/// The namespace's rule sets, normalised for comparison (comments and counters dropped).
struct Ruleset {
    iptables: String,
    ip6tables: String,
    nft_tables: String,
    nft_mine: String,
}

impl Ruleset {
    fn read(node: &Netns) -> Self {
        let nft = |argv: &[&str]| String::from_utf8_lossy(&node.exec(argv).expect("nft").stdout).into_owned();
        Self {
            iptables: save(node, "iptables-save"),
            ip6tables: save(node, "ip6tables-save"),
            nft_tables: nft(&["nft", "list", "tables"]),
            nft_mine: nft(&["nft", "list", "table", "inet", "epxt-mine"]),
        }
    }
}

/// `iptables-save` output without comments and chain counters.
fn save(node: &Netns, program: &str) -> String {
    let out = node.exec(&[program]).expect(program);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|line| !line.starts_with('#'))
        .map(|line| match (line.starts_with(':'), line.rfind(" [")) {
            (true, Some(at)) => &line[..at],
            _ => line,
        })
        .map(|line| format!("{line}\n"))
        .collect()
}

/// A saved ruleset without kube-proxy's chains and the rules that mention them.
fn without_kube(saved: &str) -> String {
    saved.lines().filter(|line| !line.contains("KUBE-")).map(|line| format!("{line}\n")).collect()
}

/// Runs `ebpf-proxy ARGS` in the node namespace (no bpffs of its own: a path that does not exist).
fn ebpf_proxy_in(node: &Netns, args: &[&str], id: &str) -> String {
    let bpffs = format!("/sys/fs/bpf/{}-{id}-none", e2e::PREFIX);
    assert!(!Path::new(&bpffs).exists());
    let mut command = Command::new(e2e::bin("ebpf-proxy"));
    enter_netns_on_exec(&mut command, &node.path()).expect("setns");
    let out = command.args(args).args(["--bpffs", &bpffs]).output().expect("running ebpf-proxy");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "ebpf-proxy {}: {}\n{stdout}{}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr));
    stdout
}

/// The Node object kube-proxy looks up, with its address.
fn create_node(api: &ControlPlane, name: &str) {
    let nodes: Api<Node> = Api::all(api.client());
    api.block_on(async {
        let node = Node { metadata: ObjectMeta { name: Some(name.into()), ..Default::default() }, ..Default::default() };
        nodes.create(&PostParams::default(), &node).await.expect("create Node");
        let status = NodeStatus {
            addresses: Some(vec![NodeAddress { type_: "InternalIP".into(), address: NODE_IP.into() }]),
            ..Default::default()
        };
        nodes
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&serde_json::json!({ "status": status })))
            .await
            .expect("Node address");
    });
}

fn wait_for(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "no {what} after {limit:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `Command` with its standard input from a string.
trait StdinText {
    fn stdin_text(&mut self, text: &str) -> &mut Self;
}

impl StdinText for Command {
    fn stdin_text(&mut self, text: &str) -> &mut Self {
        // `run` waits for the command; a temporary file keeps it free of pipe handling.
        let path = std::env::temp_dir().join(format!("epxt-{}-stdin", e2e::unique_id()));
        std::fs::write(&path, text).expect("stdin file");
        let file = std::fs::File::open(&path).expect("stdin file");
        let _ = std::fs::remove_file(&path);
        self.stdin(file)
    }
}
