//! The boot path: a static pod that restores the datapath from the checkpoint when the node
//! starts and the API server does not answer.
//!
//! kubelet starts a DaemonSet's pod only once it has read it from the API server; after a reboot
//! during a master outage it never does, and a node whose pins went with the reboot would have
//! no Service routing (DNS to the cluster DNS ClusterIP fails). Static pods are started from
//! kubelet's manifest directory without the API. The DaemonSet's init container
//! `install-boot-pod` runs `ebpf-proxy boot-pod`, which reads its own pod from the API and
//! writes there a static pod made of the DaemonSet pod's own parts: the same image, hostPath
//! volumes, init containers (the bpffs mount) and the agent container's arguments with
//! `--restore-only` added, as its last init container. That container attaches the datapath,
//! programs it from `<state-dir>/checkpoint.v1` if the pinned maps are empty, and exits; if an
//! agent already holds the node lock it steps aside at once. The DaemonSet's agent adopts what
//! it left once kubelet can start it. The pod's one container then only idles: with
//! `restartPolicy: Always`, kubelet runs the init containers again whenever it makes the pod's
//! sandbox anew, which is what a reboot makes it do. (With `OnFailure` and a container that
//! exited 0, kubelet finds that container in the runtime after the reboot, counts the pod as
//! done and starts nothing: containerd keeps its containers' records across reboots.)

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use k8s_openapi::api::core::v1::{Capabilities, Container, EnvVar, Pod, PodSpec, SecurityContext, Volume};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::Api;

/// The static pod's name (kubelet's mirror pod adds `-<node name>`).
pub const NAME: &str = "ebpf-proxy-boot";
/// The static pod's `app.kubernetes.io/name` label: not the DaemonSet's, so that its selector
/// and `kubectl -l` for the agent never match the mirror pod.
pub const LABEL: &str = "ebpf-proxy-boot";
/// How long `boot-pod` waits for the API server before it keeps the manifest on disk as it is.
const API_TIMEOUT: Duration = Duration::from_secs(15);

/// `ebpf-proxy boot-pod`: writes the static pod for `namespace/pod` (this pod) to `manifest`,
/// unless the file already holds exactly that. When the API server cannot be reached (the pod
/// restarted during an outage), the manifest already on disk is kept and this is no error: the
/// agent must start anyway.
pub async fn install(manifest: &Path, namespace: &str, pod: &str, agent_container: &str, kubeconfig: Option<&Path>) -> anyhow::Result<()> {
    let read = async {
        let client = crate::source::kube::client(kubeconfig).await?;
        Api::<Pod>::namespaced(client, namespace).get(pod).await.with_context(|| format!("reading pod {namespace}/{pod}"))
    };
    let own = match tokio::time::timeout(API_TIMEOUT, read).await {
        Ok(Ok(own)) => own,
        Ok(Err(error)) => return keep(manifest, &error),
        Err(_) => return keep(manifest, &anyhow::anyhow!("the API server did not answer within {API_TIMEOUT:?}")),
    };
    let text = serde_yaml::to_string(&static_pod(&own, agent_container)?)?;
    let text = format!(
        "# Written by `ebpf-proxy boot-pod` (the DaemonSet's init container install-boot-pod) from\n\
         # pod {namespace}/{pod}: restores the datapath from the checkpoint at boot, before the API\n\
         # server answers. Removed by deploy/uninstall.yaml.\n{text}"
    );
    if std::fs::read_to_string(manifest).ok().as_deref() == Some(text.as_str()) {
        tracing::info!(manifest = %manifest.display(), "the static boot pod is up to date");
        return Ok(());
    }
    // kubelet ignores files whose names start with a dot: it never reads a half-written one.
    let dir = manifest.parent().context("--manifest has no directory")?;
    let name = manifest.file_name().context("--manifest has no file name")?;
    let temporary = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    std::fs::write(&temporary, &text).with_context(|| format!("writing {}", temporary.display()))?;
    std::fs::rename(&temporary, manifest).with_context(|| format!("renaming {} to {}", temporary.display(), manifest.display()))?;
    tracing::info!(manifest = %manifest.display(), "wrote the static boot pod");
    Ok(())
}

fn keep(manifest: &Path, error: &anyhow::Error) -> anyhow::Result<()> {
    let state = if manifest.is_file() { "keeping the one on disk" } else { "there is none on disk yet" };
    tracing::warn!(manifest = %manifest.display(), "cannot write the static boot pod ({state}): {error:#}");
    Ok(())
}

/// The static pod made of `own`'s parts (see the module docs). Only what kubelet can run
/// without the API is kept: hostPath volumes, environment from values and the pod's own fields
/// (no ConfigMap, Secret or ServiceAccount token).
pub fn static_pod(own: &Pod, agent_container: &str) -> anyhow::Result<Pod> {
    let spec = own.spec.as_ref().context("the pod has no spec")?;
    let agent = spec
        .containers
        .iter()
        .find(|container| container.name == agent_container)
        .with_context(|| format!("the pod has no container {agent_container}"))?;
    let image = agent.image.clone().with_context(|| format!("container {agent_container} has no image"))?;
    let host_paths: Vec<&Volume> = spec.volumes.iter().flatten().filter(|volume| volume.host_path.is_some()).collect();
    let runnable = |container: &Container| -> Container {
        let mut container = container.clone();
        container.env_from = None;
        container.env = container.env.map(|env| env.into_iter().filter(env_without_api).collect());
        container.volume_mounts = container
            .volume_mounts
            .map(|mounts| mounts.into_iter().filter(|mount| host_paths.iter().any(|volume| volume.name == mount.name)).collect());
        container
    };
    // The bpffs mount (and any other set-up the DaemonSet does first), not this installer.
    let mut init: Vec<Container> = spec
        .init_containers
        .iter()
        .flatten()
        .filter(|container| !invokes_boot_pod(container))
        .map(runnable)
        .collect();
    let mut restore = runnable(agent);
    restore.name = "restore".to_owned();
    let mut args = restore.args.take().unwrap_or_default();
    if !args.iter().any(|arg| arg == "--restore-only") {
        args.push("--restore-only".to_owned());
    }
    restore.args = Some(args);
    restore.image = Some(image);
    // It exits: nothing to probe or to reach.
    restore.liveness_probe = None;
    restore.readiness_probe = None;
    restore.startup_probe = None;
    restore.ports = None;
    init.push(restore);
    let idle = Container {
        name: "idle".to_owned(),
        image: agent.image.clone(),
        // Ends at once on SIGTERM (a plain `sleep` as PID 1 would wait for the grace period).
        command: Some(["/bin/sh", "-c", "trap 'exit 0' TERM; sleep infinity & wait"].map(str::to_owned).to_vec()),
        security_context: Some(SecurityContext {
            capabilities: Some(Capabilities { drop: Some(vec!["ALL".to_owned()]), add: None }),
            allow_privilege_escalation: Some(false),
            ..SecurityContext::default()
        }),
        ..Container::default()
    };
    let used: Vec<String> = init.iter().flat_map(|c| c.volume_mounts.iter().flatten()).map(|m| m.name.clone()).collect();
    let volumes = host_paths.into_iter().filter(|volume| used.contains(&volume.name)).cloned().collect();
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(NAME.to_owned()),
            namespace: own.metadata.namespace.clone(),
            labels: Some([("app.kubernetes.io/name".to_owned(), LABEL.to_owned())].into()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            host_network: spec.host_network,
            host_pid: spec.host_pid,
            priority_class_name: spec.priority_class_name.clone(),
            restart_policy: Some("Always".to_owned()),
            termination_grace_period_seconds: spec.termination_grace_period_seconds,
            init_containers: Some(init),
            containers: vec![idle],
            volumes: Some(volumes),
            ..PodSpec::default()
        }),
        status: None,
    })
}

/// A static pod may not reference API objects: environment from ConfigMaps and Secrets goes,
/// the pod's own fields (`spec.nodeName`) stay. The restore reaches no API server anyway.
fn env_without_api(var: &EnvVar) -> bool {
    var.value_from.as_ref().is_none_or(|from| from.config_map_key_ref.is_none() && from.secret_key_ref.is_none())
}

fn invokes_boot_pod(container: &Container) -> bool {
    container.command.iter().chain(container.args.iter()).flatten().any(|word| word == "boot-pod")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The DaemonSet's pod as kubelet would receive it: deploy/daemonset.yaml's template, with
    /// the namespace set and a ServiceAccount token volume added (as admission does).
    fn daemonset_pod() -> Pod {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/daemonset.yaml")).unwrap();
        let daemonset = serde_yaml::Deserializer::from_str(&text)
            .map(|document| serde_yaml::Value::deserialize(document).unwrap())
            .find(|value| value.get("kind").and_then(|kind| kind.as_str()) == Some("DaemonSet"))
            .unwrap();
        let daemonset: k8s_openapi::api::apps::v1::DaemonSet = serde_yaml::from_value(daemonset).unwrap();
        let template = daemonset.spec.unwrap().template;
        let mut spec = template.spec.unwrap();
        spec.volumes.get_or_insert_with(Vec::new).push(Volume { name: "kube-api-access-x".into(), projected: Some(Default::default()), ..Volume::default() });
        Pod { metadata: ObjectMeta { name: Some("ebpf-proxy-abcde".into()), namespace: Some("ebpf-proxy".into()), ..template.metadata.unwrap() }, spec: Some(spec), status: None }
    }
    use serde::Deserialize;

    #[test]
    fn the_static_pod_restores_with_the_daemonsets_own_image_volumes_and_arguments() {
        let own = daemonset_pod();
        let agent = own.spec.as_ref().unwrap().containers[0].clone();
        let pod = static_pod(&own, "agent").unwrap();
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(pod.metadata.name.as_deref(), Some(NAME));
        assert_eq!(pod.metadata.namespace.as_deref(), Some("ebpf-proxy"));
        // Always: a reboot makes kubelet run the init containers again (see the module docs).
        assert_eq!(spec.restart_policy.as_deref(), Some("Always"));
        assert_eq!(spec.host_network, Some(true));
        // The bpffs mount runs first, then the restore; the installer itself does not come along.
        let init: Vec<&str> = spec.init_containers.iter().flatten().map(|c| c.name.as_str()).collect();
        assert_eq!(init, ["mount-bpffs", "restore"]);
        let restore = &spec.init_containers.as_ref().unwrap()[1];
        let idle: Vec<&str> = spec.containers.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(idle, ["idle"]);
        assert!(spec.containers[0].volume_mounts.is_none() && spec.containers[0].image == agent.image);
        assert_eq!(restore.image, agent.image);
        assert_eq!(restore.security_context, agent.security_context);
        let mut expected_args = agent.args.clone().unwrap();
        expected_args.push("--restore-only".into());
        assert_eq!(restore.args.as_ref(), Some(&expected_args));
        assert!(restore.liveness_probe.is_none() && restore.readiness_probe.is_none() && restore.ports.is_none());
        // Nothing that needs the API: no envFrom, no token volume; the node name stays.
        assert!(restore.env_from.is_none());
        assert_eq!(restore.env.iter().flatten().map(|e| e.name.as_str()).collect::<Vec<_>>(), ["NODE_NAME"]);
        let volumes: Vec<&str> = spec.volumes.iter().flatten().map(|v| v.name.as_str()).collect();
        assert_eq!(volumes, ["bpffs", "cgroup", "state"]);
        assert!(spec.volumes.iter().flatten().all(|v| v.host_path.is_some()));
        // The same path as the DaemonSet's volume of that name (whatever the install set).
        let own_state = own.spec.as_ref().unwrap().volumes.iter().flatten().find(|v| v.name == "state").unwrap();
        let state = spec.volumes.iter().flatten().find(|v| v.name == "state").unwrap();
        assert_eq!(state.host_path, own_state.host_path);
        // Its label is not the DaemonSet's selector.
        assert_ne!(pod.metadata.labels.as_ref().unwrap()["app.kubernetes.io/name"], "ebpf-proxy");
    }

    #[test]
    fn a_pod_without_the_agent_container_is_an_error_naming_it() {
        let error = static_pod(&daemonset_pod(), "proxy").unwrap_err();
        assert!(error.to_string().contains("no container proxy"), "{error}");
    }

    #[tokio::test]
    async fn without_an_api_server_the_manifest_on_disk_is_kept() {
        let dir = std::env::temp_dir().join(format!("epx-boot-pod-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let manifest = dir.join("ebpf-proxy-boot.yaml");
        std::fs::write(&manifest, "kept").unwrap();
        // A kubeconfig naming a port on loopback where nothing listens.
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: 'https://127.0.0.1:9'}\nusers:\n- name: u\n  user: {token: t}\ncontexts:\n- name: c\n  context: {cluster: c, user: u}\ncurrent-context: c\n",
        )
        .unwrap();
        install(&manifest, "ebpf-proxy", "p", "agent", Some(&kubeconfig)).await.unwrap();
        assert_eq!(std::fs::read_to_string(&manifest).unwrap(), "kept");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
