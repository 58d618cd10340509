//! A real UDP protocol with state across datagrams, through a ClusterIP: SIP calls placed by
//! `sipp` (Debian's sip-tester, installed by `cargo xtask setup`) from a client pod to a Service
//! with two `sipp` user agent servers behind it. sipp sends every request of every call from one
//! unconnected UDP socket (sendto), so each call's INVITE, ACK and BYE must reach the same backend,
//! as kube-proxy's conntrack entry for the 5-tuple keeps them. The servers run with sipp's
//! default behaviours and retransmissions off: a call whose ACK went elsewhere gets no answer to
//! its BYE (by default sipp would answer it 200 OK and close the call, hiding the lost ACK, or
//! retransmit its 200 OK until a resent ACK happened to reach it).

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use e2e::agent::{Agent, AgentDir};
use e2e::topology::Topology;

const SIP_VIP: &str = "10.96.0.50";
const SIPP: &str = "/usr/bin/sipp";

fn manifest() -> String {
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: sip, namespace: demo}}
spec:
  clusterIP: {SIP_VIP}
  ports: [{{name: sip, port: 5060, targetPort: 5060, protocol: UDP}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: sip-abc
  namespace: demo
  labels: {{kubernetes.io/service-name: sip}}
addressType: IPv4
endpoints:
- addresses: [10.244.1.11]
  conditions: {{ready: true}}
- addresses: [10.244.1.12]
  conditions: {{ready: true}}
ports: [{{name: sip, port: 5060, protocol: UDP}}]
"#
    )
}

/// A `sipp` user agent server in a pod; killed on drop.
struct Uas(Child);

impl Drop for Uas {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts sipp's built-in UAS scenario in `pod` on `ip`:5060 and waits until it listens.
fn uas(topo: &Topology, pod: &str, ip: &str) -> Uas {
    let child = topo
        .command_in(pod, Path::new(SIPP))
        .expect("uas command")
        .args(["-sn", "uas", "-i", ip, "-p", "5060", "-nostdin", "-nr", "-default_behaviors", "none"])
        .current_dir(std::env::temp_dir())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start sipp uas");
    let server = Uas(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let listening = topo.pod(pod).netns.exec(&["ss", "-Hlun", "sport = :5060"]).expect("ss");
        if !String::from_utf8_lossy(&listening.stdout).trim().is_empty() {
            return server;
        }
        assert!(Instant::now() < deadline, "sipp uas in {pod} did not listen on 5060 within 10 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sip_calls_through_a_cluster_ip_complete() {
    e2e::require_root();
    assert!(Path::new(SIPP).exists(), "{SIPP} is missing: `cargo xtask setup` installs it (Debian package sip-tester)");
    let mut topo = Topology::new().expect("topology");
    topo.add_pod("client", 2).expect("client pod");
    topo.add_pod("be1", 11).expect("be1 pod");
    topo.add_pod("be2", 12).expect("be2 pod");
    let dir = AgentDir::new(&topo.id).expect("agent dir");
    dir.write_manifest(&manifest()).expect("manifest");
    let agent = Agent::start(&topo, &dir).expect("agent");
    let _servers = [uas(&topo, "be1", "10.244.1.11"), uas(&topo, "be2", "10.244.1.12")];

    // 40 calls, one at a time. Retransmissions off (-nr): a request sent to the wrong backend is
    // not retried until it happens to reach the right one, and a call without its answer fails
    // after -recv_timeout instead of hanging. Per-datagram balancing sends a call's ACK or BYE
    // to the other server half the time (measured before the fix: 20 of 40 calls failed).
    let calls = "40";
    let output = topo
        .command_in("client", Path::new(SIPP))
        .expect("uac command")
        .args(["-sn", "uac", &format!("{SIP_VIP}:5060"), "-i", "10.244.1.2", "-p", "5061"])
        .args(["-m", calls, "-l", "1", "-r", "10", "-nr", "-recv_timeout", "2000", "-timeout", "60s", "-timeout_error"])
        .arg("-nostdin")
        .current_dir(std::env::temp_dir())
        .output()
        .expect("run sipp uac");
    let screen = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "sipp uac exited with {} (0: every call completed)\n{screen}\n{}\nagent log:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr),
        agent.log_text()
    );
    // All calls come from one socket and source port: one 5-tuple, so one backend for all of
    // them, as with kube-proxy; new sockets spread (socket_lb.rs).
    let counters = agent.dump().expect("dump")["counters"].clone();
    assert!(counters["sock_flow_hit"].as_u64().unwrap_or(0) >= 80, "ACK and BYE of each call followed its INVITE: {counters}");
}
