//! `cargo xtask cluster up|down`: a real local control plane (etcd + kube-apiserver from
//! `cargo xtask peers`) in a network namespace, for trying the agent against a real API server.
//!
//! `up` stays in the foreground (the loopback forwarder to the API server lives in this process)
//! and tears everything down on Ctrl-C or SIGTERM; `down` removes what a killed `up` left behind.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use e2e::control_plane::ControlPlane;
use e2e::topology::Topology;

use crate::step;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn request_stop(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

pub fn up() -> anyhow::Result<()> {
    let peers = crate::peers::run()?;
    // SAFETY: set_var before any other thread exists; the harness reads it to find the binaries.
    unsafe { std::env::set_var("EPX_PEERS_DIR", &peers) };
    step("starting etcd and kube-apiserver in a network namespace");
    let mut topology = Topology::new()?;
    let api = ControlPlane::start(&mut topology)?;
    println!("API server:  {}", api.url);
    println!("kubeconfig:  {}", api.admin_kubeconfig.display());
    println!("try:         ebpf-proxy agent --source kube --kubeconfig {}", api.admin_kubeconfig.display());
    println!("Ctrl-C stops the control plane and removes everything it created.");
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, request_stop as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, request_stop as *const () as libc::sighandler_t);
    }
    while !STOP.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(200));
    }
    step("stopping the control plane");
    drop(api);
    drop(topology);
    Ok(())
}

pub fn down() -> anyhow::Result<()> {
    step("removing control-plane and test namespaces, cgroups and pins left behind");
    crate::setup::sweep_leftovers();
    Ok(())
}
