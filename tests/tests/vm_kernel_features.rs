//! What the agent does with the kernel feature that differs across the kernel matrix: tcx (6.6).
//! Runs on the host's kernel (`cargo xtask test`) and on Debian 12's 6.1 in a VM
//! (`cargo xtask vm-test`), and checks whichever behaviour that kernel must show.

use e2e::agent::{Agent, AgentDir};
use e2e::probe::Server;
use e2e::scenario;
use e2e::topology::{ExternalClient, Topology};

/// (major, minor) of the running kernel.
fn kernel_version() -> (u32, u32) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("osrelease");
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit()).map(|p| p.parse().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

fn has_tcx() -> bool {
    kernel_version() >= (6, 6)
}

/// The node with an external client's link, and the agent started with the packet-level
/// programs on that link. Field order is drop order.
struct Env {
    agent: anyhow::Result<Agent>,
    _dir: AgentDir,
    _client: ExternalClient,
    _servers: Vec<Server>,
    _topo: Topology,
}

fn start(extra_args: &[&str]) -> Env {
    let (topo, servers) = scenario::client_and_two_backends();
    let client = topo.add_external_client("ext").expect("external client");
    let dir = AgentDir::new(&topo.id).expect("agent dir");
    dir.write_manifest("apiVersion: v1\nkind: List\nitems: []\n").expect("manifest");
    let interfaces = format!("--interfaces={}", client.node_interface);
    let args: Vec<&str> = [interfaces.as_str()].into_iter().chain(extra_args.iter().copied()).collect();
    let agent = Agent::start_file_in_node(&topo, &dir, &args);
    Env { agent, _dir: dir, _client: client, _servers: servers, _topo: topo }
}

#[test]
fn the_default_attach_mode_uses_tcx_where_the_kernel_has_it_and_a_clsact_filter_before_6_6() {
    let env = start(&[]);
    let log = env.agent.as_ref().expect("the agent starts in the default attach mode on every kernel").log_text();
    let expected = if has_tcx() { "attached (tcx)" } else { "attached (clsact filter; this kernel has no tcx)" };
    assert!(log.contains(expected), "kernel {:?}: the log must say {expected:?}:\n{log}", kernel_version());
}

#[test]
fn tcx_only_mode_fails_before_6_6_naming_tcx_and_the_kernel_version_that_added_it() {
    let env = start(&["--tc-attach=tcx"]);
    match &env.agent {
        Ok(agent) => {
            assert!(has_tcx(), "kernel {:?} has no tcx, yet --tc-attach=tcx started:\n{}", kernel_version(), agent.log_text());
            assert!(agent.log_text().contains("attached (tcx)"), "{}", agent.log_text());
        }
        Err(e) => {
            let text = format!("{e:#}");
            assert!(!has_tcx(), "kernel {:?} has tcx, yet --tc-attach=tcx failed: {text}", kernel_version());
            assert!(text.contains("tcx") && text.contains("6.6"), "the error must name tcx and Linux 6.6: {text}");
        }
    }
}
