//! The real node of `cargo xtask cluster up --node` ([`e2e::node`]): upstream kubelet,
//! kube-controller-manager and kube-scheduler on Debian's containerd, with locally built images,
//! is a standard node as far as ordinary tooling can tell.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context;
use aya::programs::{SchedClassifier, TcAttachType};
use k8s_openapi::api::apps::v1::DaemonSet;
use serde::Deserialize;

use e2e::control_plane::{ControlPlane, APISERVER_IP, APISERVER_PORT};
use e2e::daemonset::Install;
use e2e::node::{Node, CLUSTER_DNS_IP, NODE_NAME};
use e2e::topology::{ExternalClient, Topology};

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
    e2e::node::host_footprint().expect("host footprint").assert_unchanged_since(&host_before);
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
    e2e::node::host_footprint().expect("host footprint").assert_unchanged_since(&host_before);
}

/// The DaemonSet from `deploy/` on the real node, as a platform engineer would see it (issue 11,
/// items 1, 2, 3 and 5), one node for all phases, each timed. Decisions the test stands on (see
/// e2e::daemonset and the README's "Deploy"):
/// - the image is deploy/Containerfile's runtime stage built with buildah, its build stage
///   replaced by the binary CI built (`--build-context build=DIR`), tagged with the crate version
///   and a hash of the binary, side-loaded into containerd;
/// - the manifests are applied with one substitution (image, API address, hostPath roots: the
///   node's own bpffs directory, pods cgroup and state directory, since this machine is shared);
///   securityContext, capabilities, probes and ports are the manifest's;
/// - the node's bpffs directory has no bpffs before the agent comes: the manifest's privileged
///   init container mounts it with Bidirectional propagation, and the pins outlive the pod.
#[test]
fn the_daemonset_from_deploy_serves_real_pods_through_a_master_failure_a_rollout_and_an_uninstall() {
    let started = Instant::now();
    let host_before = e2e::node::host_footprint().expect("host footprint");
    let mut topology = Topology::new().expect("topology");
    // Before the agent starts: the link to it is one of the node's NodePort addresses.
    let external = topology.add_external_client("ext").expect("external client");
    // "Another node" with a pod that serves a Service and runs a CoreDNS (the reboot phase).
    // It answers the API server's pod network (its CoreDNS reads the API) and this node's own
    // address on their link (a host-network client's source), from its pod address.
    topology.add_remote_pod(NODE2, NODE2_HOST, &["10.244.1.0/24", "192.168.250.1/32"]).expect("another node");
    let mut cp = ControlPlane::start_with(&mut topology, e2e::node::APISERVER_ARGS).expect("control plane");
    let mut node = Node::start(&topology, &cp).expect("node");
    let phase = Phase::new(started, "node and CoreDNS Ready");
    if let Err(e) = daemonset_phases(&topology, &mut cp, &mut node, &external, &phase) {
        panic!("{e:#}\n{}\n{}\n{}", node.logs(), cp.logs(), agent_logs(&node));
    }
    drop(node);
    e2e::node::host_footprint().expect("host footprint").assert_unchanged_since(&host_before);
    eprintln!("whole test {:.1?}", started.elapsed());
}

fn daemonset_phases(topology: &Topology, cp: &mut ControlPlane, node: &mut Node, external: &ExternalClient, phase: &Phase) -> anyhow::Result<()> {
    let agent = DeployedAgent::install(node, topology)?;
    phase.done("agent image built from deploy/Containerfile and imported");
    let bpffs = node.node_view(&agent.install.bpffs)?;
    anyhow::ensure!(!is_bpffs(&bpffs), "{} is a bpffs before the agent came", bpffs.display());
    node.kubectl(&["apply", "-f", &agent.file("rbac.yaml"), "-f", &agent.file("daemonset.yaml")])?;
    let pod = agent.wait_ready(node, None)?;
    phase.done("DaemonSet Ready");

    // The pod runs with the manifest's own securityContext, on the node's bpffs mounted by the
    // init container.
    let running = node.kubectl(&["-n", NAMESPACE, "get", "pod", &pod, "-o", "jsonpath={.spec.containers[0].securityContext}"])?;
    let running: serde_json::Value = serde_json::from_str(&running)?;
    anyhow::ensure!(running == manifest_security_context()?, "the agent runs with securityContext {running}");
    anyhow::ensure!(is_bpffs(&bpffs), "{} is no bpffs with the agent running", bpffs.display());

    cp.apply(&demo_manifest(&node.images.probe))?;
    node.kubectl_until(&["-n", "demo", "get", "deployment", "echo", "-o", "jsonpath={.status.readyReplicas}"], POD_TIMEOUT, |ready| ready == "2")?;
    node.kubectl_until(&["-n", "demo", "get", "pod", "client", "-o", "jsonpath={.status.phase}"], POD_TIMEOUT, |phase| phase == "Running")?;
    let cluster_ip = node.kubectl(&["-n", "demo", "get", "service", "echo", "-o", "jsonpath={.spec.clusterIP}"])?;

    // A pod reaches the Service by name: its resolver asks the cluster DNS ClusterIP (which the
    // agent translates to CoreDNS), then it connects to the ClusterIP.
    let resolved = node.kubectl_until(&["-n", "demo", "exec", "client", "--", PROBE, "dns", "--name", "echo"], SERVICE_TIMEOUT, |out| out.contains(&cluster_ip))?;
    let resolved: serde_json::Value = serde_json::from_str(&resolved)?;
    anyhow::ensure!(resolved == serde_json::json!({"name": "echo.demo.svc.cluster.local", "addresses": [cluster_ip]}), "echo resolved to {resolved}");
    let by_name = service_from_client(node, &cluster_ip, 20)?;
    anyhow::ensure!(by_name.ok == 20 && by_name.answers.len() == 2, "echo from a pod: {by_name:?}");
    phase.done("a pod reached a Service by DNS name");

    // NodePort from outside the node, over the link to the external client.
    let to = format!("{}:{NODE_PORT}", external.node_ip);
    let outside = wait_answers(|| e2e::probe::client_with(external.command(&e2e::bin("epx-probe"))?, "tcp", &to, 20))?;
    anyhow::ensure!(outside.ok == 20 && outside.answers.len() == 2, "NodePort from outside: {outside:?}");
    phase.done("NodePort from the external namespace");

    // The manifest's ports, on the node's network (hostNetwork).
    let (status, body) = agent.http(HEALTHZ_PORT, "/healthz")?;
    anyhow::ensure!(status == 200, "/healthz {status} {body}");
    let (status, _) = agent.http(HEALTHZ_PORT, "/livez")?;
    anyhow::ensure!(status == 200, "/livez {status}");
    let (status, metrics) = agent.http(METRICS_PORT, "/metrics")?;
    anyhow::ensure!(status == 200 && metrics.contains("kubeproxy_sync_proxy_rules_last_timestamp_seconds"), "/metrics {status}: {metrics}");
    let checkpoint = agent.install.state.join("checkpoint.v1");
    wait_until(Duration::from_secs(10), || checkpoint.is_file()).with_context(|| format!("no {}", checkpoint.display()))?;

    // The pod is deleted: the next one finds the pins on the node's bpffs and adopts them.
    let pins = pins_of(&bpffs.join("ebpf-proxy"))?;
    anyhow::ensure!(pins.iter().any(|pin| pin.starts_with("links/")), "no pinned links: {pins:?}");
    node.kubectl(&["-n", NAMESPACE, "delete", "pod", &pod, "--wait=false"])?;
    let next = agent.wait_ready(node, Some(&pod))?;
    phase.done("agent pod deleted and replaced");
    agent.check_adopted(node, &next, true)?;
    anyhow::ensure!(pins_of(&bpffs.join("ebpf-proxy"))? == pins, "the pins changed across the restart");
    let after = service_from_client(node, &cluster_ip, 20)?;
    anyhow::ensure!(after.ok == 20, "echo after the agent's restart: {after:?}");

    stale_udp_socket_of_a_pod_is_aborted(cp, node, &next)?;
    phase.done("a pod's connected UDP socket to a removed backend aborted");

    master_down(topology, cp, node, &agent, &next, &cluster_ip, phase)?;
    let rolled = pod_deleted_and_rolled(topology, node, &agent, &next, &cluster_ip, phase)?;
    reboot_while_master_down(topology, cp, node, &agent, &rolled, phase)?;
    // The node's own pods come back once kubelet reads them from the API again.
    wait_answers(|| service_from_client(node, &cluster_ip, 5)).context("echo after the reboot")?;
    uninstall(topology, node, &agent, external, &cluster_ip)?;
    phase.done("uninstalled as the README says");
    Ok(())
}

/// Issue 11 item 5: `kubectl delete -f deploy/daemonset.yaml`, then deploy/uninstall.yaml's
/// clean-up on the node, then `kubectl delete` of it and of rbac.yaml leave no program, pin or
/// checkpoint behind, and Services are no longer translated.
fn uninstall(topology: &Topology, node: &Node, agent: &DeployedAgent, external: &ExternalClient, cluster_ip: &str) -> anyhow::Result<()> {
    node.kubectl(&["delete", "-f", &agent.file("daemonset.yaml")])?;
    node.kubectl_until(&["-n", NAMESPACE, "get", "pods", "-l", "app.kubernetes.io/name=ebpf-proxy", "-o", "name"], POD_TIMEOUT, |pods| pods.trim().is_empty())?;
    // The agent leaves its datapath when it stops (restarts and upgrades cost nothing): Services
    // still work until the clean-up.
    anyhow::ensure!(service_from_client(node, cluster_ip, 5)?.ok == 5, "the datapath went with the agent's pod");
    node.kubectl(&["apply", "-f", &agent.file("uninstall.yaml")])?;
    node.kubectl(&["-n", NAMESPACE, "rollout", "status", "daemonset/ebpf-proxy-uninstall", "--timeout=120s"])?;
    node.kubectl(&["delete", "-f", &agent.file("uninstall.yaml"), "-f", &agent.file("rbac.yaml")])?;

    let pins = node.node_view(&agent.install.bpffs)?.join("ebpf-proxy");
    anyhow::ensure!(!pins.exists(), "pins left: {:?}", pins_of(&pins));
    let boot_manifest = agent.install.static_pods.join(BOOT_MANIFEST);
    anyhow::ensure!(!boot_manifest.exists(), "the static boot pod is left: {}", boot_manifest.display());
    let state: Vec<_> = std::fs::read_dir(&agent.install.state)?.flatten().map(|entry| entry.file_name()).collect();
    anyhow::ensure!(state.is_empty(), "state left in {}: {state:?}", agent.install.state.display());
    let programs = cgroup_programs(&agent.install.cgroup)?;
    anyhow::ensure!(programs == 0, "{programs} programs still attached to the pods' cgroup");
    for interface in ["br0", "cni0", "ext0"] {
        for direction in [TcAttachType::Ingress, TcAttachType::Egress] {
            let (_, programs) = e2e::topology::in_netns(&topology.node.path(), || SchedClassifier::query_tcx(interface, direction))??;
            anyhow::ensure!(programs.is_empty(), "{} tcx programs left on {interface}", programs.len());
        }
    }
    // What a user sees: the ClusterIP is no longer translated, the NodePort is refused.
    let clusterip = service_from_client(node, cluster_ip, 2)?;
    anyhow::ensure!(clusterip.ok == 0, "the ClusterIP still answers after the clean-up: {clusterip:?}");
    let nodeport = e2e::probe::client_with(external.command(&e2e::bin("epx-probe"))?, "tcp", &format!("{}:{NODE_PORT}", external.node_ip), 2)?;
    anyhow::ensure!(nodeport.ok == 0, "the NodePort still answers after the clean-up: {nodeport:?}");
    Ok(())
}

/// How many programs are attached directly to `cgroup` at the socket hooks the agent uses
/// (BPF_PROG_QUERY; aya has no query for these attach types).
fn cgroup_programs(cgroup: &std::path::Path) -> anyhow::Result<u32> {
    #[repr(C)]
    #[derive(Default)]
    struct ProgQuery {
        target_fd: u32,
        attach_type: u32,
        query_flags: u32,
        attach_flags: u32,
        prog_ids: u64,
        prog_cnt: u32,
        _pad: u32,
    }
    // BPF_CGROUP_INET4_CONNECT, _INET6_CONNECT, _UDP4_SENDMSG, _UDP6_SENDMSG, _UDP4_RECVMSG,
    // _UDP6_RECVMSG, _INET4_GETPEERNAME, _INET6_GETPEERNAME (include/uapi/linux/bpf.h).
    const ATTACH_TYPES: [u32; 8] = [10, 11, 14, 15, 19, 20, 29, 30];
    const BPF_PROG_QUERY: libc::c_long = 16;
    let dir = std::fs::File::open(cgroup).with_context(|| format!("opening {}", cgroup.display()))?;
    let mut total = 0;
    for attach_type in ATTACH_TYPES {
        let mut attr = ProgQuery { target_fd: std::os::fd::AsRawFd::as_raw_fd(&dir) as u32, attach_type, ..Default::default() };
        // SAFETY: bpf(2) with a BPF_PROG_QUERY attribute we own and its size; no id buffer.
        let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_QUERY, &mut attr as *mut ProgQuery, std::mem::size_of::<ProgQuery>()) };
        anyhow::ensure!(rc == 0, "BPF_PROG_QUERY on {}: {}", cgroup.display(), std::io::Error::last_os_error());
        total += attr.prog_cnt;
    }
    Ok(total)
}

/// The agent, in its pod, aborts another pod's connected UDP socket whose backend left the
/// Service (the manifest's hostPID and SYS_PTRACE are for this): the client pod's socket,
/// connected while only echo pod X served `echo-udp`, moves to pod Y once X is taken out (X keeps
/// serving, so without the abort the socket would stay on it). Its own target port: the agent
/// aborts sockets to a backend address and port that left every Service, and echo's port 5353
/// stays in `echo`.
fn stale_udp_socket_of_a_pod_is_aborted(cp: &ControlPlane, node: &Node, agent_pod: &str) -> anyhow::Result<()> {
    let pods = node.kubectl(&["-n", "demo", "get", "pods", "-l", "app=echo", "-o", "jsonpath={.items[*].metadata.name}"])?;
    let [x, y] = pods.split_whitespace().collect::<Vec<_>>()[..] else { anyhow::bail!("echo pods: {pods}") };
    node.kubectl(&["-n", "demo", "label", "pod", x, "udp=one"])?;
    cp.apply("apiVersion: v1\nkind: Service\nmetadata: {name: echo-udp, namespace: demo}\nspec:\n  selector: {app: echo, udp: one}\n  ports:\n  - {port: 53, targetPort: 5354, protocol: UDP}\n")?;
    let cluster_ip = node.kubectl(&["-n", "demo", "get", "service", "echo-udp", "-o", "jsonpath={.spec.clusterIP}"])?;
    let backends = |count: usize| {
        node.kubectl_until(&["-n", NAMESPACE, "exec", agent_pod, "-c", "agent", "--", "ebpf-proxy", "dump", "--json"], SERVICE_TIMEOUT, |dump| {
            let Ok(dump) = serde_json::from_str::<serde_json::Value>(dump) else { return false };
            dump["services"].as_array().into_iter().flatten().any(|service| {
                service["ip"] == cluster_ip.as_str() && service["port"] == 53 && service["scope"] == "internal" && service["backends"].as_array().map(Vec::len) == Some(count)
            })
        })
    };
    backends(1)?;
    let to = format!("{cluster_ip}:53");
    let client = std::process::Command::new(e2e::control_plane::peers_dir().join("kubectl"))
        .arg("--kubeconfig")
        .arg(&node.kubeconfig)
        .args(["-n", "demo", "exec", "client", "--", PROBE, "udp-connected", "--to", &to, "--interval-ms", "20", "--duration-ms", "6000"])
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    // The socket talks to X for a while, still while Y joins, then X is taken out.
    std::thread::sleep(Duration::from_secs(1));
    node.kubectl(&["-n", "demo", "label", "pod", y, "udp=one"])?;
    backends(2)?;
    std::thread::sleep(Duration::from_secs(1));
    node.kubectl(&["-n", "demo", "label", "pod", x, "udp-"])?;
    let output = client.wait_with_output()?;
    let result: serde_json::Value = serde_json::from_slice(&output.stdout).with_context(|| format!("udp-connected printed {:?}", String::from_utf8_lossy(&output.stdout)))?;
    let answers: Vec<&str> = result["answers"].as_array().into_iter().flatten().filter_map(|a| a.as_str()).collect();
    let switched = answers.iter().position(|a| a == &y).with_context(|| format!("the socket never reached {y}: {result}"))?;
    anyhow::ensure!(switched > 20 && answers[..switched].iter().all(|a| a == &x), "the socket was not on {x} first: {result}");
    anyhow::ensure!(answers[switched..].iter().all(|a| a == &y) && answers.len() - switched > 20, "back on the removed backend, or too late: {result}");
    anyhow::ensure!(result["reconnects"].as_u64() == Some(1), "exactly one abort, of the stale socket: {result}");
    let logs = node.kubectl(&["-n", NAMESPACE, "logs", agent_pod, "-c", "agent"])?;
    anyhow::ensure!(logs.contains("aborted connected UDP sockets of removed backends"), "{logs}");
    Ok(())
}

/// Issue 11 item 2: etcd, kube-apiserver, kube-controller-manager and kube-scheduler killed for
/// 60 s under steady traffic from a client pod (by ClusterIP, and by name through CoreDNS): no
/// request fails, `/healthz` says stale, `/livez` stays green and kubelet restarts nothing.
fn master_down(topology: &Topology, cp: &mut ControlPlane, node: &mut Node, agent: &DeployedAgent, agent_pod: &str, cluster_ip: &str, phase: &Phase) -> anyhow::Result<()> {
    let outage = Duration::from_secs(60);
    let restarts = restart_count(node, agent_pod)?;
    // Long enough to cover the outage, the master's return and a few seconds after.
    let traffic = SteadyPod::start(node, "steady-master-down", cluster_ip, outage + Duration::from_secs(25))?;
    cp.stop_master()?;
    node.stop_controllers();
    let down = Instant::now();
    let stale = wait_healthz(agent, 503, Duration::from_secs(20))?;
    anyhow::ensure!(stale["stale"] == true, "/healthz during the outage: {stale}");
    eprintln!("/healthz stale {:.1?} after the master went down", down.elapsed());
    while down.elapsed() < outage {
        let (status, _) = agent.http(HEALTHZ_PORT, "/livez")?;
        anyhow::ensure!(status == 200, "/livez {status} while the master is down");
        std::thread::sleep(Duration::from_secs(2));
    }
    cp.start_master()?;
    node.start_controllers_again(topology, cp)?;
    wait_healthz(agent, 200, Duration::from_secs(60))?;
    let seen = traffic.finish(node)?;
    eprintln!("master down {outage:?}: {}", counts(&seen));
    anyhow::ensure!(seen.failed() == 0, "requests failed while the master was down: {}", counts(&seen));
    anyhow::ensure!(seen.tcp.ok > 1000 && seen.udp.ok > 1000 && seen.by_name.ok > 1000, "traffic did not really run: {}", counts(&seen));
    anyhow::ensure!(seen.streams.ok == 2, "long-lived streams must survive: {}", counts(&seen));
    anyhow::ensure!(restart_count(node, agent_pod)? == restarts, "kubelet restarted the agent while the master was down");
    phase.done("master down 60 s under steady traffic");
    Ok(())
}

/// Issue 11 item 3: the agent's pod deleted, then the DaemonSet rolled to a new image version,
/// under steady traffic: no request fails, and each new pod adopts the pins and writes nothing.
fn pod_deleted_and_rolled(topology: &Topology, node: &Node, agent: &DeployedAgent, agent_pod: &str, cluster_ip: &str, phase: &Phase) -> anyhow::Result<String> {
    // A second version of the same image (as a rollout to a new release would bring).
    let next_image = format!("{}-next", agent.install.image);
    node.buildah(topology, &["tag", &agent.install.image, &next_image])?;
    node.import_image(topology, &next_image)?;
    let traffic = SteadyPod::start(node, "steady-rollout", cluster_ip, Duration::from_secs(40))?;
    node.kubectl(&["-n", NAMESPACE, "delete", "pod", agent_pod, "--wait=false"])?;
    let replaced = agent.wait_ready(node, Some(agent_pod))?;
    agent.check_adopted(node, &replaced, true)?;
    node.kubectl(&["-n", NAMESPACE, "set", "image", &format!("daemonset/{}", e2e::daemonset::NAME), &format!("agent={next_image}"), &format!("mount-bpffs={next_image}"), &format!("install-boot-pod={next_image}")])?;
    let rolled = agent.wait_ready(node, Some(&replaced))?;
    let image = node.kubectl(&["-n", NAMESPACE, "get", "pod", &rolled, "-o", "jsonpath={.spec.containers[0].image}"])?;
    anyhow::ensure!(image == next_image, "the rolled pod runs {image}");
    // The static boot pod follows the rollout: a reboot must start the new version.
    let boot = std::fs::read_to_string(agent.install.static_pods.join(BOOT_MANIFEST))?;
    anyhow::ensure!(boot.contains(&format!("image: {next_image}")), "the static boot pod was not rewritten for {next_image}:\n{boot}");
    agent.check_adopted(node, &rolled, true)?;
    let seen = traffic.finish(node)?;
    eprintln!("pod deleted and DaemonSet rolled: {}", counts(&seen));
    anyhow::ensure!(seen.failed() == 0, "requests failed while the agent was replaced: {}", counts(&seen));
    anyhow::ensure!(seen.streams.ok == 2, "long-lived streams must survive: {}", counts(&seen));
    phase.done("agent pod deleted, then DaemonSet rolled to a new image, under steady traffic");
    Ok(rolled)
}

/// Issue 11 item 4: the node reboots while the master is down. kubelet cannot start the
/// DaemonSet's pod without the API, and the reboot emptied bpffs: the static boot pod that the
/// DaemonSet's init container wrote to kubelet's manifest directory restores the datapath from
/// the checkpoint. A host-network client on the node (a process in the node's network namespace
/// and, as every host process on a real node where the agent attaches at the cgroup root, below
/// the agent's cgroup) then resolves a name through the cluster DNS ClusterIP and reaches a
/// Service whose endpoints, and the CoreDNS that answers, live on "another node" (a namespace of
/// its own, outside this kubelet). When the master returns, the DaemonSet's pod starts again and
/// adopts the datapath, under steady traffic from that client: no request fails.
fn reboot_while_master_down(topology: &Topology, cp: &mut ControlPlane, node: &mut Node, agent: &DeployedAgent, agent_pod: &str, phase: &Phase) -> anyhow::Result<()> {
    let boot_manifest = agent.install.static_pods.join(BOOT_MANIFEST);
    anyhow::ensure!(boot_manifest.is_file(), "the DaemonSet installed no static boot pod at {}", boot_manifest.display());
    let node2 = Node2::start(topology, cp, node)?;
    cp.apply(&remote_manifest())?;
    // CoreDNS runs on the other node only (as a cluster whose DNS pods are elsewhere): this
    // node's replica is scaled away, so kube-dns's endpoints are the other node's CoreDNS.
    node.kubectl(&["-n", "kube-system", "scale", "deployment", "coredns", "--replicas=0"])?;
    let remote_ip = node.kubectl(&["-n", "demo", "get", "service", "remote", "-o", "jsonpath={.spec.clusterIP}"])?;
    let only_node2 = |ip: &str, port: u16, protocol: &str| {
        let (ip, protocol) = (ip.to_owned(), protocol.to_owned());
        move |dump: &serde_json::Value| {
            dump["services"].as_array().into_iter().flatten().any(|service| {
                service["ip"] == ip.as_str()
                    && service["port"] == port
                    && service["protocol"] == protocol.as_str()
                    && service["scope"] == "internal"
                    && service["backends"].as_array().is_some_and(|b| b.len() == 1 && b[0]["ip"] == NODE2_POD_IP)
            })
        }
    };
    wait_dump(node, agent_pod, only_node2(&remote_ip, 80, "TCP"))?;
    wait_dump(node, agent_pod, only_node2(&CLUSTER_DNS_IP.to_string(), 53, "UDP"))?;
    // What the reboot will restore is on disk.
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.healthz()?["checkpointCurrent"] != true {
        anyhow::ensure!(Instant::now() < deadline, "the checkpoint does not catch up: {}", agent.healthz()?);
        std::thread::sleep(Duration::from_millis(200));
    }
    let before = agent_container(node, agent_pod)?;
    let host = HostClient { netns: topology.node.path(), cgroup: node.pods_cgroup_v2.join("host-client") };
    let resolved = host.resolve("remote.demo.svc.cluster.local")?;
    anyhow::ensure!(resolved == remote_ip, "before the reboot, remote resolved to {resolved}");
    phase.done("Service and CoreDNS on another node; checkpoint written");

    cp.stop_master()?;
    node.stop_controllers();
    node.power_off()?;
    // What a reboot does to the datapath: the pins went with bpffs, and with them every program.
    for interface in ["br0", "cni0"] {
        let (_, programs) = e2e::topology::in_netns(&topology.node.path(), || SchedClassifier::query_tcx(interface, TcAttachType::Ingress))??;
        anyhow::ensure!(programs.is_empty(), "{} tcx programs still on {interface} after the power cut", programs.len());
    }
    let down = host.tcp(&format!("{remote_ip}:80"), 2)?;
    anyhow::ensure!(down.ok == 0, "the ClusterIP answered with the node off: {down:?}");
    node.power_on(topology, cp)?;
    let booted = Instant::now();
    // With the API still down: only the static pod can have brought the datapath back.
    let deadline = booted + POD_TIMEOUT;
    let back = loop {
        let resolved = host.resolve("remote.demo.svc.cluster.local");
        let answers = host.tcp(&format!("{remote_ip}:80"), 10);
        match (&resolved, &answers) {
            (Ok(ip), Ok(summary)) if *ip == remote_ip && summary.ok == 10 => break summary.clone(),
            _ if Instant::now() >= deadline => {
                // `{:#}`, not `{:?}`: an error's Debug form carries its whole backtrace.
                let resolved = resolved.as_ref().map_err(|e| format!("{e:#}"));
                let answers = answers.as_ref().map_err(|e| format!("{e:#}"));
                anyhow::bail!(
                    // The boot pod's own logs first (what its restore did): CI shows a failure's
                    // first and last lines only.
                    "no Service routing {POD_TIMEOUT:?} after the boot: DNS {resolved:?}, TCP {answers:?}\n{}\n--- kubelet on the boot pod ---\n{}",
                    node.pod_logs(&format!("{NAMESPACE}_{}", e2e::daemonset::BOOT_POD)),
                    node.kubelet_log("ebpf-proxy-boot", 12)
                )
            }
            _ => std::thread::sleep(Duration::from_millis(500)),
        }
    };
    anyhow::ensure!(back.answers.keys().all(|name| name == NODE2), "answered by {:?}", back.answers);
    eprintln!("Services answered {:.1?} after the boot, with the master down", booted.elapsed());
    phase.done("node rebooted with the master down: DNS and Services back from the static pod");

    // The master returns; the DaemonSet's pod starts again and takes over, under traffic.
    let stop = node.dir.join("steady-reboot.stop");
    let traffic = host
        .command(&e2e::bin("epx-probe"))?
        .args(["steady", "--tcp", &format!("{remote_ip}:80"), "--udp", &format!("{remote_ip}:53"), "--tcp-name", "remote.demo.svc.cluster.local:80"])
        .args(["--dns-server", &format!("{CLUSTER_DNS_IP}:53"), "--rate", "20", "--streams", "2", "--duration-ms", "600000"])
        .arg("--stop-file")
        .arg(&stop)
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let traffic = KillOnDrop(Some(traffic));
    std::thread::sleep(Duration::from_secs(2));
    cp.start_master()?;
    node.start_controllers_again(topology, cp)?;
    let listing = node.kubectl_until(
        &["-n", NAMESPACE, "get", "pods", "-l", AGENT_LABEL, "-o", "jsonpath={range .items[*]}{.metadata.name} {.status.containerStatuses[0].containerID} {.status.containerStatuses[0].ready}{\"\\n\"}{end}"],
        POD_TIMEOUT,
        |out| out.lines().any(|line| line.ends_with(" true") && !line.contains(&before)),
    )?;
    let pod = listing.lines().find(|line| line.ends_with(" true") && !line.contains(&before)).and_then(|line| line.split_whitespace().next()).context("no new agent")?.to_owned();
    agent.check_adopted(node, &pod, false)?;
    eprintln!("the DaemonSet's agent took over {:.1?} after the boot", booted.elapsed());
    // A few seconds of its own service before the traffic ends.
    std::thread::sleep(Duration::from_secs(3));
    std::fs::write(&stop, "")?;
    let output = traffic.wait_with_output()?;
    let seen: e2e::probe::Steady = serde_json::from_slice(&output.stdout).with_context(|| format!("steady printed {:?}", String::from_utf8_lossy(&output.stdout)))?;
    eprintln!("reboot takeover: {}", counts(&seen));
    anyhow::ensure!(seen.failed() == 0, "requests failed while the DaemonSet's agent took over: {}", counts(&seen));
    anyhow::ensure!(seen.tcp.ok > 100 && seen.udp.ok > 100 && seen.by_name.ok > 100, "traffic did not really run: {}", counts(&seen));
    anyhow::ensure!(seen.streams.ok == 2, "long-lived streams must survive the takeover: {}", counts(&seen));
    drop(node2);
    phase.done("master back: the DaemonSet's agent took over with no failed request");
    Ok(())
}

const BOOT_MANIFEST: &str = "ebpf-proxy-boot.yaml";

/// The container ID of `pod`'s agent container.
fn agent_container(node: &Node, pod: &str) -> anyhow::Result<String> {
    let id = node.kubectl(&["-n", NAMESPACE, "get", "pod", pod, "-o", "jsonpath={.status.containerStatuses[0].containerID}"])?;
    anyhow::ensure!(!id.is_empty(), "{pod} has no container ID");
    Ok(id)
}

/// Waits until `ebpf-proxy dump --json` in `agent_pod` satisfies `done`.
fn wait_dump(node: &Node, agent_pod: &str, done: impl Fn(&serde_json::Value) -> bool) -> anyhow::Result<()> {
    node.kubectl_until(&["-n", NAMESPACE, "exec", agent_pod, "-c", "agent", "--", "ebpf-proxy", "dump", "--json"], SERVICE_TIMEOUT, |dump| {
        serde_json::from_str::<serde_json::Value>(dump).is_ok_and(|dump| done(&dump))
    })
    .map(drop)
}

/// Service `remote` (TCP 80, UDP 53) whose only endpoint is the pod on the other node, and a
/// second EndpointSlice of `kube-dns` naming the CoreDNS there (both managed by the test, as a
/// controller on that node's behalf would).
fn remote_manifest() -> String {
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: remote, namespace: demo}}
spec:
  ports:
  - {{name: tcp, port: 80, targetPort: 8080, protocol: TCP}}
  - {{name: udp, port: 53, targetPort: 5353, protocol: UDP}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: remote-{NODE2}
  namespace: demo
  labels: {{kubernetes.io/service-name: remote, endpointslice.kubernetes.io/managed-by: epx-tests}}
addressType: IPv4
endpoints:
- {{addresses: ["{NODE2_POD_IP}"], conditions: {{ready: true}}, nodeName: {NODE2}}}
ports:
- {{name: tcp, port: 8080, protocol: TCP}}
- {{name: udp, port: 5353, protocol: UDP}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kube-dns-{NODE2}
  namespace: kube-system
  labels: {{kubernetes.io/service-name: kube-dns, endpointslice.kubernetes.io/managed-by: epx-tests}}
addressType: IPv4
endpoints:
- {{addresses: ["{NODE2_POD_IP}"], conditions: {{ready: true}}, nodeName: {NODE2}}}
ports:
- {{name: dns, port: 53, protocol: UDP}}
- {{name: dns-tcp, port: 53, protocol: TCP}}
"#
    )
}

/// The other node's processes: an echo server and a CoreDNS (the upstream binary, the standard
/// Corefile's `kubernetes` plugin reading the API server, which it keeps serving from its cache
/// while the API is down), in that node's namespace and the topology's cgroup; killed on drop.
struct Node2 {
    _processes: Vec<KillOnDrop>,
}

impl Node2 {
    fn start(topology: &Topology, cp: &ControlPlane, node: &Node) -> anyhow::Result<Self> {
        let mut processes = Vec::new();
        let log = |name: &str| std::fs::File::create(node.dir.join(format!("{NODE2}-{name}.log")));
        let echo = topology
            .command_in(NODE2, &e2e::bin("epx-probe"))?
            .args(["serve", "--name", NODE2, "--tcp", "8080", "--udp", "5353"])
            .stdout(log("echo")?)
            .stderr(log("echo-err")?)
            .spawn()?;
        processes.push(KillOnDrop(Some(echo)));
        let kubeconfig = cp.direct_kubeconfig("coredns-node2")?;
        let corefile = node.dir.join(format!("{NODE2}-Corefile"));
        std::fs::write(
            &corefile,
            format!(
                ".:53 {{\n    errors\n    kubernetes cluster.local in-addr.arpa ip6.arpa {{\n        kubeconfig {} epx\n        pods insecure\n        fallthrough in-addr.arpa ip6.arpa\n        ttl 30\n    }}\n    cache 30\n}}\n",
                kubeconfig.display()
            ),
        )?;
        let coredns = topology
            .command_in(NODE2, &e2e::control_plane::peers_dir().join("coredns"))?
            .arg("-conf")
            .arg(&corefile)
            .stdout(log("coredns")?)
            .stderr(log("coredns-err")?)
            .spawn()?;
        processes.push(KillOnDrop(Some(coredns)));
        let server = std::net::SocketAddr::from((NODE2_POD_IP.parse::<std::net::Ipv4Addr>()?, 53));
        let deadline = Instant::now() + SERVICE_TIMEOUT;
        loop {
            let answer = e2e::topology::in_netns(&topology.node.path(), || e2e::dns::resolve(server, "kube-dns.kube-system.svc.cluster.local", Duration::from_secs(1)))?;
            match answer {
                Ok(addresses) if addresses == [CLUSTER_DNS_IP] => return Ok(Self { _processes: processes }),
                _ if Instant::now() >= deadline => {
                    let logs = std::fs::read_to_string(node.dir.join(format!("{NODE2}-coredns.log"))).unwrap_or_default();
                    anyhow::bail!("CoreDNS on {NODE2} does not answer: {answer:?}\n{logs}")
                }
                _ => std::thread::sleep(Duration::from_millis(250)),
            }
        }
    }
}

/// A child process killed when dropped (unless waited for).
struct KillOnDrop(Option<std::process::Child>);

impl KillOnDrop {
    fn wait_with_output(mut self) -> std::io::Result<std::process::Output> {
        self.0.take().expect("not waited for yet").wait_with_output()
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A process on the node's host network: the node's network namespace, and a cgroup below the
/// agent's (`cgroup`, created on first use), as every host process is on a real node where the
/// agent attaches at the cgroup root.
struct HostClient {
    netns: std::path::PathBuf,
    cgroup: std::path::PathBuf,
}

impl HostClient {
    fn command(&self, program: &std::path::Path) -> anyhow::Result<std::process::Command> {
        use std::io::Write as _;
        use std::os::unix::process::CommandExt as _;
        std::fs::create_dir_all(&self.cgroup).with_context(|| format!("creating {}", self.cgroup.display()))?;
        let procs = std::fs::OpenOptions::new().write(true).open(self.cgroup.join("cgroup.procs"))?;
        let mut cmd = std::process::Command::new(program);
        // SAFETY: only write(2) between fork and exec; the file stays open in the closure.
        unsafe {
            cmd.pre_exec(move || {
                let mut procs = &procs;
                procs.write_all(b"0")
            });
        }
        e2e::topology::enter_netns_on_exec(&mut cmd, &self.netns)?;
        Ok(cmd)
    }

    /// `name`'s first address, asked of the cluster DNS ClusterIP.
    fn resolve(&self, name: &str) -> anyhow::Result<String> {
        let out = e2e::topology::run(self.command(&e2e::bin("epx-probe"))?.args(["dns", "--server", &format!("{CLUSTER_DNS_IP}:53"), "--name", name, "--timeout-ms", "1000"]))?;
        let answer: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        answer["addresses"][0].as_str().map(str::to_owned).with_context(|| format!("no address in {answer}"))
    }

    fn tcp(&self, to: &str, count: u32) -> anyhow::Result<e2e::probe::Summary> {
        e2e::probe::client_with(self.command(&e2e::bin("epx-probe"))?, "tcp", to, count)
    }
}

/// What steady traffic saw, without the sequence of answers.
fn counts(seen: &e2e::probe::Steady) -> String {
    let summary = |s: &e2e::probe::Summary| format!("{} ok, {} failed {:?}, by backend {:?}", s.ok, s.failed, s.errors, s.answers);
    format!("TCP {}; UDP {}; TCP by name {}; streams {}", summary(&seen.tcp), summary(&seen.udp), summary(&seen.by_name), summary(&seen.streams))
}

fn restart_count(node: &Node, pod: &str) -> anyhow::Result<String> {
    node.kubectl(&["-n", NAMESPACE, "get", "pod", pod, "-o", "jsonpath={.status.containerStatuses[0].restartCount}"])
}

/// Waits up to `limit` for the agent's /healthz to answer `status`; returns its body.
fn wait_healthz(agent: &DeployedAgent, status: u16, limit: Duration) -> anyhow::Result<serde_json::Value> {
    let deadline = Instant::now() + limit;
    loop {
        let (got, body) = agent.http(HEALTHZ_PORT, "/healthz")?;
        if got == status {
            return Ok(serde_json::from_str(&body)?);
        }
        anyhow::ensure!(Instant::now() < deadline, "/healthz still {got} {body} after {limit:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `epx-probe steady` as a pod of its own in `demo` (not `kubectl exec`, which needs the API):
/// short TCP connections to echo's ClusterIP and to `echo` by name, UDP requests, two long-lived
/// streams; its result is read from its log once it has ended.
struct SteadyPod {
    name: String,
    duration: Duration,
}

impl SteadyPod {
    fn start(node: &Node, name: &str, cluster_ip: &str, duration: Duration) -> anyhow::Result<Self> {
        let pod = format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: demo}}\nspec:\n  restartPolicy: Never\n  containers:\n  - name: steady\n    image: {image}\n    imagePullPolicy: Never\n    args: [steady, --tcp, \"{cluster_ip}:80\", --udp, \"{cluster_ip}:53\", --tcp-name, \"echo:80\", --rate, \"20\", --streams, \"2\", --duration-ms, \"{ms}\"]\n",
            image = node.images.probe,
            ms = duration.as_millis(),
        );
        let file = node.dir.join(format!("{name}.yaml"));
        std::fs::write(&file, pod)?;
        node.kubectl(&["apply", "-f", &file.display().to_string()])?;
        node.kubectl_until(&["-n", "demo", "get", "pod", name, "-o", "jsonpath={.status.phase}"], POD_TIMEOUT, |phase| phase == "Running")?;
        // Its first requests are answered before anything is disturbed.
        std::thread::sleep(Duration::from_secs(2));
        Ok(Self { name: name.to_owned(), duration })
    }

    fn finish(self, node: &Node) -> anyhow::Result<e2e::probe::Steady> {
        let phase = node.kubectl_until(&["-n", "demo", "get", "pod", &self.name, "-o", "jsonpath={.status.phase}"], self.duration + POD_TIMEOUT, |phase| phase == "Succeeded" || phase == "Failed")?;
        let logs = node.kubectl(&["-n", "demo", "logs", &self.name])?;
        anyhow::ensure!(phase == "Succeeded", "{} ended {phase}: {logs}", self.name);
        let json = logs.lines().rev().find(|line| line.starts_with('{')).with_context(|| format!("no result in {logs}"))?;
        serde_json::from_str(json).with_context(|| format!("parsing {json}"))
    }
}

const NAMESPACE: &str = e2e::daemonset::NAMESPACE;
/// The DaemonSet's pods (not the static boot pod's mirror, which has a label of its own).
const AGENT_LABEL: &str = "app.kubernetes.io/name=ebpf-proxy";
/// "Another node" of the reboot phase: one namespace standing for a node and its pod.
const NODE2: &str = "node2";
const NODE2_HOST: u8 = 10;
const NODE2_POD_IP: &str = "10.244.2.10";
const PROBE: &str = "/usr/local/bin/epx-probe";
const NODE_PORT: u16 = 30080;
const HEALTHZ_PORT: u16 = 10256;
const METRICS_PORT: u16 = 10249;
const POD_TIMEOUT: Duration = Duration::from_secs(120);
const SERVICE_TIMEOUT: Duration = Duration::from_secs(30);

/// Each phase's duration, printed as it ends (CI time is watched).
struct Phase {
    last: std::cell::Cell<Instant>,
}

impl Phase {
    fn new(started: Instant, what: &str) -> Self {
        eprintln!("[phase] {what}: {:.1?}", started.elapsed());
        Self { last: std::cell::Cell::new(Instant::now()) }
    }

    fn done(&self, what: &str) {
        eprintln!("[phase] {what}: {:.1?}", self.last.get().elapsed());
        self.last.set(Instant::now());
    }
}

/// The agent installed from deploy/ on a node (see the test's docs).
struct DeployedAgent {
    install: Install,
    /// deploy/ with the substitution applied (the same file names).
    deploy: std::path::PathBuf,
    node_netns: std::path::PathBuf,
}

impl DeployedAgent {
    /// Builds and imports the image, writes the substituted manifests (not applied yet).
    fn install(node: &Node, topology: &Topology) -> anyhow::Result<Self> {
        let image = e2e::daemonset::image_ref(&e2e::bin("ebpf-proxy"))?;
        e2e::daemonset::build_image(node, topology, &image)?;
        let install = Install {
            image,
            api_server: SocketAddr::from((APISERVER_IP, APISERVER_PORT)),
            bpffs: node.dir.join("bpffs"),
            cgroup: node.pods_cgroup_v2.clone(),
            state: node.dir.join("ebpf-proxy-state"),
            static_pods: node.dir.join("manifests"),
        };
        // deploy/ with the substitution, file by file, to be used as the README says.
        let deploy = node.dir.join("deploy");
        std::fs::create_dir_all(&deploy)?;
        for file in e2e::daemonset::INSTALL.iter().chain(&e2e::daemonset::UNINSTALL) {
            std::fs::write(deploy.join(file), e2e::daemonset::manifests(&install, &[file])?)?;
        }
        Ok(Self { install, deploy, node_netns: topology.node.path() })
    }

    fn file(&self, name: &str) -> String {
        self.deploy.join(name).display().to_string()
    }

    /// The name of a Ready agent pod other than `previous`, not being deleted.
    fn wait_ready(&self, node: &Node, previous: Option<&str>) -> anyhow::Result<String> {
        let listing = node.kubectl_until(
            &["-n", NAMESPACE, "get", "pods", "-l", AGENT_LABEL, "-o", "jsonpath={range .items[*]}{.metadata.name} {.status.containerStatuses[0].ready} {.metadata.deletionTimestamp}{\"\\n\"}{end}"],
            POD_TIMEOUT,
            |out| ready_pod(out, previous).is_some(),
        )?;
        Ok(ready_pod(&listing, previous).expect("checked").to_owned())
    }

    /// Checks from `pod`'s `/metrics` (the node's port: hostNetwork) that it adopted the pinned
    /// datapath: it found the frontends in the pinned maps, attached no program anew, and
    /// (`unchanged`: nothing changed in the API meanwhile) its first sync wrote nothing.
    fn check_adopted(&self, node: &Node, pod: &str, unchanged: bool) -> anyhow::Result<()> {
        let value = |metrics: &str, name: &str| -> Option<f64> {
            metrics.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        };
        let deadline = std::time::Instant::now() + SERVICE_TIMEOUT;
        let metrics = loop {
            // The first sync is done once the agent counts one.
            if let Ok((_, metrics)) = self.http(METRICS_PORT, "/metrics") {
                if value(&metrics, "ebpf_proxy_sync_total").is_some_and(|syncs| syncs >= 1.0) {
                    break metrics;
                }
            }
            if std::time::Instant::now() > deadline {
                let logs = node.kubectl(&["-n", NAMESPACE, "logs", pod, "-c", "agent"]).unwrap_or_default();
                anyhow::bail!("{pod} did not sync within {SERVICE_TIMEOUT:?}:\n{logs}");
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        };
        let read = |name: &str| value(&metrics, name).with_context(|| format!("no {name} in {pod}'s /metrics:\n{metrics}"));
        let logs = || node.kubectl(&["-n", NAMESPACE, "logs", pod, "-c", "agent"]).unwrap_or_default();
        let anew = read("ebpf_proxy_programs_attached_anew")?;
        anyhow::ensure!(anew == 0.0, "{pod} attached {anew} programs anew:\n{}", logs());
        let adopted = read("ebpf_proxy_adopted_frontends")?;
        anyhow::ensure!(adopted > 0.0, "{pod} did not adopt the pinned maps:\n{}", logs());
        let writes = read("ebpf_proxy_sync_map_writes_total")?;
        anyhow::ensure!(!unchanged || writes == 0.0, "{pod} wrote {writes} map entries to maps it adopted:\n{}", logs());
        Ok(())
    }

    /// `/healthz`'s body.
    fn healthz(&self) -> anyhow::Result<serde_json::Value> {
        let (_, body) = self.http(HEALTHZ_PORT, "/healthz")?;
        Ok(serde_json::from_str(&body)?)
    }

    /// GET on the agent's port on the node's network.
    fn http(&self, port: u16, path: &str) -> anyhow::Result<(u16, String)> {
        Ok(e2e::topology::in_netns(&self.node_netns, || e2e::agent::http_get(port, path))??)
    }
}

/// `count` connections from the client pod to echo's ClusterIP.
fn service_from_client(node: &Node, cluster_ip: &str, count: u32) -> anyhow::Result<e2e::probe::Summary> {
    let to = format!("{cluster_ip}:80");
    let out = node.kubectl(&["-n", "demo", "exec", "client", "--", PROBE, "tcp", "--to", &to, "--count", &count.to_string()])?;
    serde_json::from_str(out.trim()).with_context(|| format!("epx-probe tcp printed {out:?}"))
}

fn ready_pod<'a>(listing: &'a str, previous: Option<&str>) -> Option<&'a str> {
    listing.lines().find_map(|line| match line.split_whitespace().collect::<Vec<_>>().as_slice() {
        [name, "true"] if Some(*name) != previous => Some(*name),
        _ => None,
    })
}

/// The agent's logs, for a failure message.
fn agent_logs(node: &Node) -> String {
    let logs = node.kubectl(&["-n", NAMESPACE, "logs", "-l", "app.kubernetes.io/name=ebpf-proxy", "--all-containers", "--prefix", "--tail=40"]);
    let pods = node.kubectl(&["-n", NAMESPACE, "get", "pods", "-o", "wide"]);
    let events = node.kubectl(&["-n", NAMESPACE, "get", "events"]);
    format!("--- agent pods ---\n{pods:?}\n--- agent events ---\n{events:?}\n--- agent logs ---\n{logs:?}")
}

fn manifest_security_context() -> anyhow::Result<serde_json::Value> {
    let text = std::fs::read_to_string(e2e::daemonset::deploy_dir().join("daemonset.yaml"))?;
    for document in serde_yaml::Deserializer::from_str(&text) {
        let value = serde_yaml::Value::deserialize(document)?;
        if value.get("kind").and_then(|kind| kind.as_str()) == Some("DaemonSet") {
            let daemonset: DaemonSet = serde_yaml::from_value(value)?;
            let pod = daemonset.spec.and_then(|spec| spec.template.spec).context("no pod spec")?;
            return Ok(serde_json::to_value(&pod.containers[0].security_context)?);
        }
    }
    anyhow::bail!("no DaemonSet in deploy/daemonset.yaml")
}

fn is_bpffs(path: &std::path::Path) -> bool {
    const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
    let Ok(c_path) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: statfs(2) into a zeroed struct we own, with a NUL-terminated path.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    unsafe { libc::statfs(c_path.as_ptr(), &mut stat) == 0 && stat.f_type as i64 == BPF_FS_MAGIC }
}

/// The pinned objects under `dir`, as paths relative to it.
fn pins_of(dir: &std::path::Path) -> anyhow::Result<std::collections::BTreeSet<String>> {
    let mut pins = std::collections::BTreeSet::new();
    let mut dirs = vec![dir.to_owned()];
    while let Some(current) = dirs.pop() {
        for entry in std::fs::read_dir(&current).with_context(|| format!("reading {}", current.display()))? {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                dirs.push(entry.path());
            } else {
                pins.insert(entry.path().strip_prefix(dir)?.display().to_string());
            }
        }
    }
    Ok(pins)
}

fn wait_until(timeout: Duration, done: impl Fn() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !done() {
        anyhow::ensure!(Instant::now() < deadline, "not so after {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Retries `probe` until every request was answered (the Service may not be programmed yet).
fn wait_answers(probe: impl Fn() -> anyhow::Result<e2e::probe::Summary>) -> anyhow::Result<e2e::probe::Summary> {
    let deadline = Instant::now() + SERVICE_TIMEOUT;
    loop {
        let summary = probe();
        match &summary {
            Ok(summary) if summary.failed == 0 => return Ok(summary.clone()),
            _ if Instant::now() >= deadline => return summary,
            _ => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

/// A namespace `demo` with two echo pods behind Service `echo` (ClusterIP and NodePort), and a
/// client pod to exec from.
fn demo_manifest(image: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Namespace
metadata: {{name: demo}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: echo, namespace: demo}}
spec:
  replicas: 2
  selector: {{matchLabels: {{app: echo}}}}
  template:
    metadata: {{labels: {{app: echo}}}}
    spec:
      containers:
      - name: echo
        image: {image}
        imagePullPolicy: Never
        args: [serve, --name, $(POD_NAME), --tcp, "8080", --udp, "5353", --udp, "5354"]
        env:
        - name: POD_NAME
          valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}
        readinessProbe:
          tcpSocket: {{port: 8080}}
          periodSeconds: 1
---
apiVersion: v1
kind: Service
metadata: {{name: echo, namespace: demo}}
spec:
  type: NodePort
  selector: {{app: echo}}
  ports:
  - {{name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: {NODE_PORT}}}
  - {{name: udp, port: 53, targetPort: 5353, protocol: UDP}}
---
apiVersion: v1
kind: Pod
metadata: {{name: client, namespace: demo}}
spec:
  containers:
  - name: client
    image: {image}
    imagePullPolicy: Never
    args: [serve, --name, client, --tcp, "9"]
"#
    )
}
