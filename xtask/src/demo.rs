//! `cargo xtask demo`: a node with three pods (network namespaces), the agent fed by an embedded
//! Service manifest, and requests to the ClusterIP answered by different backends.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use e2e::agent::{Agent, AgentDir};
use e2e::probe::{self, Summary};
use e2e::topology::Topology;

use crate::step;

const MANIFEST: &str = include_str!("../demo/service.yaml");

fn show(what: &str, summary: &Summary) {
    let answers: Vec<String> = summary.answers.iter().map(|(name, n)| format!("{name}: {n}")).collect();
    let errors: BTreeMap<_, _> = summary.errors.iter().collect();
    println!(
        "    {what}: {} requests, {} answered ({}), {} failed{}",
        summary.total,
        summary.ok,
        if answers.is_empty() { "-".to_owned() } else { answers.join(", ") },
        summary.failed,
        if errors.is_empty() { String::new() } else { format!(" {errors:?}") }
    );
}

pub fn run() -> anyhow::Result<()> {
    step("creating a node namespace with pods: client (10.244.1.2), backend-a (10.244.1.11), backend-b (10.244.1.12)");
    let mut topo = Topology::new()?;
    topo.add_pod("client", 2)?;
    topo.add_pod("backend-a", 11)?;
    topo.add_pod("backend-b", 12)?;
    let _servers = [
        probe::serve(&topo, "backend-a", "backend-a", &[8080], &[5353])?,
        probe::serve(&topo, "backend-b", "backend-b", &[8080], &[5353])?,
    ];

    step("starting the agent: ebpf-proxy agent --source file:<the demo's Service manifest>");
    let dir = AgentDir::new(&topo.id)?;
    dir.write_manifest(MANIFEST)?;
    let mut agent = Agent::start(&topo, &dir)?;
    println!("    manifest: {}\n    bpffs:    {}\n    cgroup:   {}", dir.manifest().display(), agent.bpffs.display(), agent.cgroup.display());

    step("what the kernel now holds (ebpf-proxy dump)");
    let dump = Command::new(e2e::bin("ebpf-proxy")).arg("dump").arg("--bpffs").arg(&agent.bpffs).output()?;
    print!("{}", String::from_utf8_lossy(&dump.stdout));

    step("the client pod talks to the Services");
    show("TCP 10.96.0.10:80 ", &probe::tcp(&topo, "client", "10.96.0.10:80", 100)?);
    show("UDP 10.96.0.10:53 ", &probe::udp(&topo, "client", "10.96.0.10:53", 100)?);
    show("TCP 10.96.0.20:80 (no endpoints)", &probe::tcp(&topo, "client", "10.96.0.20:80", 5)?);

    step("removing backend-b from the EndpointSlice in the manifest file");
    dir.write_manifest(&MANIFEST.replace("- addresses: [10.244.1.12]\n  conditions: {ready: true}\n  nodeName: demo-node\n", ""))?;
    std::thread::sleep(Duration::from_millis(600));
    show("TCP 10.96.0.10:80 ", &probe::tcp(&topo, "client", "10.96.0.10:80", 100)?);

    step("stopping the agent: the datapath stays in the kernel");
    agent.stop()?;
    show("TCP 10.96.0.10:80 (agent stopped)", &probe::tcp(&topo, "client", "10.96.0.10:80", 50)?);

    step("cleaning up (namespaces, cgroup, pinned programs and maps)");
    drop(agent);
    println!(
        "\nWhat happened: the client's connect() and sendto() to the ClusterIP were rewritten in the \
         kernel\n(cgroup/connect4, sendmsg4) to a randomly chosen backend, replies were rewritten back \
         (recvmsg4,\ngetpeername4), the Service without endpoints refused at once (ECONNREFUSED), a \
         removed endpoint\ngot no more connections, and traffic kept flowing with no agent running."
    );
    Ok(())
}
