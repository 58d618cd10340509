//! The real node of `cargo xtask cluster up --node` ([`e2e::node`]): upstream kubelet,
//! kube-controller-manager and kube-scheduler on Debian's containerd, with locally built images,
//! is a standard node as far as ordinary tooling can tell.

use std::time::{Duration, Instant};

use anyhow::Context;

use e2e::control_plane::ControlPlane;
use e2e::node::{Node, CLUSTER_DNS_IP, NODE_NAME};
use e2e::topology::Topology;

#[test]
fn a_real_node_runs_pods_with_coredns_and_answers_kubectl_logs_and_exec() {
    let started = Instant::now();
    let host_before = e2e::node::host_footprint().expect("host footprint");
    let mut topology = Topology::new().expect("topology");
    let cp = ControlPlane::start_with(&mut topology, e2e::node::APISERVER_ARGS).expect("control plane");
    let node = Node::start(&topology, &cp).expect("node");
    eprintln!("node and CoreDNS Ready {:.1?} after the start", started.elapsed());
    let check = || -> anyhow::Result<()> {
        // What `kubectl get nodes` shows a user: Ready, the upstream version, the pod CIDR.
        let nodes = node.kubectl(&["get", "node", NODE_NAME, "-o", "jsonpath={.status.nodeInfo.kubeletVersion} {.spec.podCIDR} {.status.conditions[?(@.type==\"Ready\")].status}"])?;
        anyhow::ensure!(nodes == "v1.34.4 10.244.64.0/24 True", "node: {nodes}");

        // CoreDNS authenticates with its projected ServiceAccount token: Ready means it listed
        // Services and EndpointSlices through the API (its readiness waits for that).
        let dns = node.kubectl(&["-n", "kube-system", "get", "service", "kube-dns", "-o", "jsonpath={.spec.clusterIP}"])?;
        anyhow::ensure!(dns == CLUSTER_DNS_IP.to_string(), "kube-dns ClusterIP {dns}");
        let token_volume = node.kubectl(&["-n", "kube-system", "get", "pods", "-l", "k8s-app=kube-dns", "-o", "jsonpath={.items[0].spec.volumes[*].projected.sources[*].serviceAccountToken.path}"])?;
        anyhow::ensure!(token_volume.contains("token"), "CoreDNS has no projected token: {token_volume}");
        let coredns_logs = node.kubectl(&["-n", "kube-system", "logs", "deploy/coredns"])?;
        anyhow::ensure!(coredns_logs.contains("CoreDNS-"), "CoreDNS logs: {coredns_logs}");

        // A pod of the test image: scheduled, started, its logs and exec through the kubelet.
        let pod = format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: echo, namespace: default}}\nspec:\n  containers:\n  - name: echo\n    image: {}\n    imagePullPolicy: Never\n    args: [serve, --name, echo, --tcp, \"8080\"]\n",
            node.images.probe
        );
        cp.apply(&pod)?;
        node.kubectl_until(&["get", "pod", "echo", "-o", "jsonpath={.status.phase}"], Duration::from_secs(60), |phase| phase == "Running")?;
        node.kubectl_until(&["logs", "echo"], Duration::from_secs(30), |logs| logs.contains("ready"))?;
        let answer = node.kubectl(&["exec", "echo", "--", "/usr/local/bin/epx-probe", "tcp", "--to", "127.0.0.1:8080", "--count", "3"])?;
        anyhow::ensure!(answer.contains("echo"), "exec answer: {answer}");

        // CoreDNS answers a pod for a Service name, through the pod's own search domains (kubelet's
        // resolv.conf); asked at its pod address, since no Service proxy runs yet.
        let coredns_ip = node.kubectl(&["-n", "kube-system", "get", "pods", "-l", "k8s-app=kube-dns", "-o", "jsonpath={.items[0].status.podIP}"])?;
        let server = format!("{coredns_ip}:53");
        let resolved = node.kubectl(&["exec", "echo", "--", "/usr/local/bin/epx-probe", "dns", "--server", &server, "--name", "kube-dns.kube-system"])?;
        let resolved: serde_json::Value = serde_json::from_str(&resolved).with_context(|| format!("epx-probe dns printed {resolved:?}"))?;
        anyhow::ensure!(
            resolved == serde_json::json!({"name": "kube-dns.kube-system.svc.cluster.local", "addresses": [CLUSTER_DNS_IP.to_string()]}),
            "kube-dns.kube-system resolved to {resolved}"
        );
        Ok(())
    };
    if let Err(e) = check() {
        panic!("{e:#}\n{}\n{}", node.logs(), cp.logs());
    }
    drop(node);
    // kubelet changed kernel settings, containerd and kubelet mounted and made cgroups: all undone.
    assert_eq!(e2e::node::host_footprint().expect("host footprint"), host_before, "the node left the host changed");
    eprintln!("whole test {:.1?}", started.elapsed());
}

/// deploy/Containerfile starts `FROM debian:bookworm`, which cannot be pulled here: the node's
/// buildah gets the debootstrap-made base under that very name, and a Containerfile naming it
/// builds with `--pull=never`, running Debian's own apt-get inside with the release's sources.
#[test]
fn a_containerfile_from_debian_builds_on_the_node_without_a_registry() {
    let host_before = e2e::node::host_footprint().expect("host footprint");
    let mut topology = Topology::new().expect("topology");
    let cp = ControlPlane::start_with(&mut topology, e2e::node::APISERVER_ARGS).expect("control plane");
    let node = Node::start(&topology, &cp).expect("node");
    let check = || -> anyhow::Result<()> {
        let started = Instant::now();
        let names = node.import_debian_base(&topology, e2e::debian_image::SUITE)?;
        eprintln!("{} and {} imported in {:.1?}", names[0], names[1], started.elapsed());
        let context = node.dir.join("containerfile-check");
        std::fs::create_dir_all(&context)?;
        std::fs::write(
            context.join("Containerfile"),
            "FROM debian:bookworm-slim\n\
             RUN . /etc/os-release && test \"$VERSION_CODENAME\" = bookworm\n\
             RUN grep -qx 'Suites: bookworm-security' /etc/apt/sources.list.d/debian.sources && apt-get --version\n",
        )?;
        let context = context.display().to_string();
        node.buildah(&topology, &["bud", "--pull=never", "--isolation=chroot", "-t", "localhost/epx-check/debian:0.1.0", &context])?;
        let images = node.buildah(&topology, &["images", "--format", "{{.Name}}:{{.Tag}}"])?;
        anyhow::ensure!(images.lines().any(|line| line == "localhost/epx-check/debian:0.1.0"), "images: {images}");
        Ok(())
    };
    if let Err(e) = check() {
        panic!("{e:#}\n{}", node.logs());
    }
    drop(node);
    assert_eq!(e2e::node::host_footprint().expect("host footprint"), host_before, "the node left the host changed");
}
