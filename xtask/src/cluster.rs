//! `cargo xtask cluster up|down`: a real local control plane (etcd + kube-apiserver from
//! `cargo xtask peers`) in a network namespace, for trying the agent against a real API server;
//! with `--node` a real single-node Kubernetes without kube-proxy ([`e2e::node`]): also
//! kube-controller-manager, kube-scheduler, kubelet on containerd, and CoreDNS as kube-dns.
//!
//! `up` stays in the foreground (the loopback forwarder to the API server lives in this process)
//! and tears everything down on Ctrl-C or SIGTERM; `down` removes what a killed `up` left behind.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use e2e::control_plane::ControlPlane;
use e2e::node::Node;
use e2e::topology::Topology;

use crate::step;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn request_stop(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

pub fn up(with_node: bool) -> anyhow::Result<()> {
    let peers = crate::peers::run()?;
    // SAFETY: set_var before any other thread exists; the harness reads it to find the binaries.
    unsafe { std::env::set_var("EPX_PEERS_DIR", &peers) };
    // SAFETY: as above; the node's images take epx-probe and epx-pause from this workspace's build.
    unsafe { std::env::set_var("EPX_BIN_DIR", crate::workspace_root().join("target/release")) };
    step("starting etcd and kube-apiserver in a network namespace");
    let started = std::time::Instant::now();
    let mut topology = Topology::new()?;
    let api = if with_node {
        ControlPlane::start_with(&mut topology, e2e::node::APISERVER_ARGS)?
    } else {
        ControlPlane::start(&mut topology)?
    };
    let node = if with_node {
        step("starting kube-controller-manager, kube-scheduler, containerd and kubelet; building the images; CoreDNS");
        Some(Node::start(&topology, &api)?)
    } else {
        None
    };
    println!("API server:  {}", api.url);
    println!("kubeconfig:  {}", api.admin_kubeconfig.display());
    if let Some(node) = &node {
        println!("node:        {} ({}) Ready, CoreDNS Ready, up in {:.1?}", e2e::node::NODE_NAME, e2e::node::NODE_IP, started.elapsed());
        println!("images:      {} {} {}", node.images.pause, node.images.probe, node.images.coredns);
        println!("logs:        {}/*.log", node.dir.display());
        println!("kubectl:     {}/kubectl --kubeconfig {} get pods -A", peers.display(), api.admin_kubeconfig.display());
        println!("no Service proxy runs: deploy ebpf-proxy (deploy/) for Services, the `kubernetes` one included");
    } else {
        println!("try:         ebpf-proxy agent --source kube --kubeconfig {}", api.admin_kubeconfig.display());
    }
    println!("Ctrl-C stops everything and removes what it created.");
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, request_stop as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, request_stop as *const () as libc::sighandler_t);
    }
    while !STOP.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(200));
    }
    step("stopping the node and the control plane");
    drop(node);
    drop(api);
    drop(topology);
    Ok(())
}

pub fn down() -> anyhow::Result<()> {
    step("removing nodes (pods, containerd, kubelet; kernel settings restored), control-plane and test namespaces, cgroups and pins left behind");
    crate::setup::sweep_leftovers();
    Ok(())
}
