//! The real node of `cargo xtask cluster up --node` ([`e2e::node`]): upstream kubelet,
//! kube-controller-manager and kube-scheduler on Debian's containerd, with locally built images,
//! is a standard node as far as ordinary tooling can tell.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use e2e::control_plane::{peers_dir, ControlPlane};
use e2e::node::{Node, CLUSTER_DNS_IP, NODE_NAME};
use e2e::topology::Topology;

/// `kubectl` from the peers (Debian's 1.20 is too old), admin kubeconfig; its stdout on success.
fn kubectl(kubeconfig: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(peers_dir().join("kubectl"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .context("running kubectl")?;
    if !out.status.success() {
        bail!("kubectl {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Retries `kubectl args` until its output satisfies `done` (or `timeout`); the last output.
fn kubectl_until(kubeconfig: &Path, args: &[&str], timeout: Duration, done: impl Fn(&str) -> bool) -> anyhow::Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = kubectl(kubeconfig, args);
        if let Ok(out) = &last {
            if done(out) {
                return Ok(out.clone());
            }
        }
        if Instant::now() >= deadline {
            bail!("kubectl {} not as expected after {timeout:?}: {last:?}", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn a_real_node_runs_pods_with_coredns_and_answers_kubectl_logs_and_exec() {
    let started = Instant::now();
    let mut topology = Topology::new().expect("topology");
    let cp = ControlPlane::start_with(&mut topology, e2e::node::APISERVER_ARGS).expect("control plane");
    let node = Node::start(&topology, &cp).expect("node");
    eprintln!("node and CoreDNS Ready {:.1?} after the start", started.elapsed());
    let kubeconfig = cp.admin_kubeconfig.clone();
    let check = || -> anyhow::Result<()> {
        // What `kubectl get nodes` shows a user: Ready, the upstream version, the pod CIDR.
        let nodes = kubectl(&kubeconfig, &["get", "node", NODE_NAME, "-o", "jsonpath={.status.nodeInfo.kubeletVersion} {.spec.podCIDR} {.status.conditions[?(@.type==\"Ready\")].status}"])?;
        anyhow::ensure!(nodes == "v1.34.4 10.244.64.0/24 True", "node: {nodes}");

        // CoreDNS authenticates with its projected ServiceAccount token: Ready means it listed
        // Services and EndpointSlices through the API (its readiness waits for that).
        let dns = kubectl(&kubeconfig, &["-n", "kube-system", "get", "service", "kube-dns", "-o", "jsonpath={.spec.clusterIP}"])?;
        anyhow::ensure!(dns == CLUSTER_DNS_IP.to_string(), "kube-dns ClusterIP {dns}");
        let token_volume = kubectl(&kubeconfig, &["-n", "kube-system", "get", "pods", "-l", "k8s-app=kube-dns", "-o", "jsonpath={.items[0].spec.volumes[*].projected.sources[*].serviceAccountToken.path}"])?;
        anyhow::ensure!(token_volume.contains("token"), "CoreDNS has no projected token: {token_volume}");
        let coredns_logs = kubectl(&kubeconfig, &["-n", "kube-system", "logs", "deploy/coredns"])?;
        anyhow::ensure!(coredns_logs.contains("CoreDNS-"), "CoreDNS logs: {coredns_logs}");

        // A pod of the test image: scheduled, started, its logs and exec through the kubelet.
        let pod = format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: echo, namespace: default}}\nspec:\n  containers:\n  - name: echo\n    image: {}\n    imagePullPolicy: Never\n    args: [serve, --name, echo, --tcp, \"8080\"]\n",
            node.images.probe
        );
        cp.apply(&pod)?;
        kubectl_until(&kubeconfig, &["get", "pod", "echo", "-o", "jsonpath={.status.phase}"], Duration::from_secs(60), |phase| phase == "Running")?;
        kubectl_until(&kubeconfig, &["logs", "echo"], Duration::from_secs(30), |logs| logs.contains("ready"))?;
        let answer = kubectl(&kubeconfig, &["exec", "echo", "--", "/usr/local/bin/epx-probe", "tcp", "--to", "127.0.0.1:8080", "--count", "3"])?;
        anyhow::ensure!(answer.contains("echo"), "exec answer: {answer}");
        Ok(())
    };
    if let Err(e) = check() {
        panic!("{e:#}\n{}\n{}", node.logs(), cp.logs());
    }
    eprintln!("whole test {:.1?}", started.elapsed());
}
