//! The agent's DaemonSet from `deploy/` on a [`Node`]: its image built from
//! `deploy/Containerfile`, its manifests applied with one documented substitution.
//!
//! - **Image**: the Containerfile's runtime stage, with its `build` stage replaced by a directory
//!   holding the binary `cargo xtask build` made (`buildah bud --build-context build=DIR`, which
//!   takes precedence over the stage of that name, so the 23-minute build stage does not run);
//!   tagged `<crate version>-<12 hex digits of the binary's SHA-256>`, never `latest`, and
//!   side-loaded into the node's containerd (the manifest's default pull policy for a tagged
//!   image, IfNotPresent, then finds it).
//! - **Substitution** ([`manifests`]): the image of every container, the API server's address
//!   (the ConfigMap), and the roots of the four hostPath volumes. This machine is shared, so the
//!   node's equivalents replace the host's: a bpffs directory of the node's own for
//!   `/sys/fs/bpf`, the node's pods cgroup for `/sys/fs/cgroup` (the host's root would catch every
//!   process on the machine), a directory under the node's for `/var/lib/ebpf-proxy`, and the
//!   node's kubelet `staticPodPath` for `/etc/kubernetes/manifests`.
//!   Everything else (securityContext, capabilities, probes, ports, propagation) is the
//!   manifest's own.

use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::ConfigMap;
use serde::Deserialize;

use crate::node::Node;
use crate::topology::{run, Topology};

/// The manifests that install the agent, in the order they are applied.
pub const INSTALL: [&str; 2] = ["rbac.yaml", "daemonset.yaml"];
/// The DaemonSet that removes what the agent left on each node (after `kubectl delete`).
pub const UNINSTALL: [&str; 1] = ["uninstall.yaml"];
pub const NAMESPACE: &str = "ebpf-proxy";
pub const NAME: &str = "ebpf-proxy";
/// The static boot pod the DaemonSet installs (its mirror pod adds `-<node>`).
pub const BOOT_POD: &str = "ebpf-proxy-boot";

/// What [`manifests`] puts in place of the manifests' defaults.
#[derive(Clone, Debug)]
pub struct Install {
    pub image: String,
    pub api_server: SocketAddr,
    /// For volume `bpffs` (hostPath `/sys/fs/bpf`).
    pub bpffs: PathBuf,
    /// For volume `cgroup` (hostPath `/sys/fs/cgroup`): a cgroup v2 directory.
    pub cgroup: PathBuf,
    /// For volume `state` (hostPath `/var/lib/ebpf-proxy`).
    pub state: PathBuf,
    /// For volume `static-pods` (hostPath `/etc/kubernetes/manifests`): kubelet's staticPodPath.
    pub static_pods: PathBuf,
}

pub fn deploy_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// `deploy/`'s `files` with [`Install`]'s values substituted, as one multi-document YAML.
pub fn manifests(install: &Install, files: &[&str]) -> anyhow::Result<String> {
    let mut out = String::new();
    for file in files {
        let path = deploy_dir().join(file);
        let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        for document in serde_yaml::Deserializer::from_str(&text) {
            let value = serde_yaml::Value::deserialize(document).with_context(|| format!("parsing {}", path.display()))?;
            let value = match value.get("kind").and_then(|kind| kind.as_str()) {
                Some("DaemonSet") => serde_yaml::to_value(substitute_daemonset(serde_yaml::from_value(value)?, install)?)?,
                Some("ConfigMap") => serde_yaml::to_value(substitute_config_map(serde_yaml::from_value(value)?, install)?)?,
                _ => value,
            };
            out.push_str("---\n");
            out.push_str(&serde_yaml::to_string(&value)?);
        }
    }
    Ok(out)
}

fn substitute_daemonset(mut daemonset: DaemonSet, install: &Install) -> anyhow::Result<DaemonSet> {
    let pod = daemonset.spec.as_mut().and_then(|spec| spec.template.spec.as_mut()).context("the DaemonSet has no pod spec")?;
    for container in pod.containers.iter_mut().chain(pod.init_containers.iter_mut().flatten()) {
        container.image = Some(install.image.clone());
    }
    for volume in pod.volumes.iter_mut().flatten() {
        let Some(host_path) = volume.host_path.as_mut() else { continue };
        // By the volume's name, the manifest's contract (the paths are what is replaced).
        host_path.path = match volume.name.as_str() {
            "bpffs" => &install.bpffs,
            "cgroup" => &install.cgroup,
            "state" => &install.state,
            "static-pods" => &install.static_pods,
            other => bail!("hostPath volume {other} ({}) has no substitute", host_path.path),
        }
        .display()
        .to_string();
    }
    Ok(daemonset)
}

fn substitute_config_map(mut config_map: ConfigMap, install: &Install) -> anyhow::Result<ConfigMap> {
    let data = config_map.data.as_mut().context("the ConfigMap has no data")?;
    for (key, value) in [("KUBERNETES_SERVICE_HOST", install.api_server.ip().to_string()), ("KUBERNETES_SERVICE_PORT", install.api_server.port().to_string())] {
        let entry = data.get_mut(key).with_context(|| format!("the ConfigMap has no {key}"))?;
        *entry = value;
    }
    Ok(config_map)
}

/// `localhost/ebpf-proxy/agent:<crate version>-<12 hex digits of SHA-256(binary)>`.
pub fn image_ref(binary: &Path) -> anyhow::Result<String> {
    let out = run(Command::new("sha256sum").arg(binary))?;
    let digest = String::from_utf8_lossy(&out.stdout);
    let short = digest.get(..12).context("sha256sum printed too little")?;
    Ok(format!("localhost/ebpf-proxy/agent:{}-{short}", env!("CARGO_PKG_VERSION")))
}

/// Builds deploy/Containerfile's runtime stage on the node's buildah, from the built
/// `ebpf-proxy` in place of its build stage, and imports it into containerd as `reference`.
pub fn build_image(node: &Node, topology: &Topology, reference: &str) -> anyhow::Result<()> {
    node.import_debian_base(topology, crate::debian_image::SUITE)?;
    let context = node.dir.join("agent-image-build-stage");
    fs::create_dir_all(context.join("out")).with_context(|| format!("creating {}", context.display()))?;
    fs::copy(crate::bin("ebpf-proxy"), context.join("out/ebpf-proxy")).context("copying ebpf-proxy")?;
    let repo = deploy_dir().join("..");
    node.buildah(
        topology,
        &[
            "bud",
            "--pull=never",
            "--isolation=chroot",
            "--build-context",
            &format!("build={}", context.display()),
            "-f",
            &deploy_dir().join("Containerfile").display().to_string(),
            "-t",
            reference,
            &repo.display().to_string(),
        ],
    )?;
    node.import_image(topology, reference)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn install() -> Install {
        Install {
            image: "localhost/ebpf-proxy/agent:0.1.0-0123456789ab".to_owned(),
            api_server: "10.244.1.250:6443".parse().unwrap(),
            bpffs: "/tmp/node/bpffs".into(),
            cgroup: "/sys/fs/cgroup/unified/node".into(),
            state: "/tmp/node/state".into(),
            static_pods: "/tmp/node/manifests".into(),
        }
    }

    fn documents(yaml: &str) -> Vec<serde_yaml::Value> {
        serde_yaml::Deserializer::from_str(yaml).map(|d| serde_yaml::Value::deserialize(d).unwrap()).collect()
    }

    /// Substituting the manifests' own values back gives the manifests again: nothing but the
    /// documented fields changes (securityContext, probes, ports, propagation stay as written).
    #[test]
    fn only_the_image_the_api_address_and_the_host_paths_change() {
        let all: Vec<&str> = INSTALL.iter().chain(&UNINSTALL).copied().collect();
        let substituted = documents(&manifests(&install(), &all).unwrap());
        let mut original = Vec::new();
        for file in &all {
            original.extend(documents(&fs::read_to_string(deploy_dir().join(file)).unwrap()));
        }
        assert_eq!(substituted.len(), original.len());
        let manifest_defaults = Install {
            image: "ghcr.io/example/ebpf-proxy:latest".to_owned(),
            api_server: "192.0.2.10:6443".parse().unwrap(),
            bpffs: "/sys/fs/bpf".into(),
            cgroup: "/sys/fs/cgroup".into(),
            state: "/var/lib/ebpf-proxy".into(),
            static_pods: "/etc/kubernetes/manifests".into(),
        };
        for (substituted, original) in substituted.into_iter().zip(original) {
            let back = match substituted.get("kind").and_then(|k| k.as_str()) {
                Some("DaemonSet") => serde_yaml::to_value(substitute_daemonset(serde_yaml::from_value(substituted).unwrap(), &manifest_defaults).unwrap()).unwrap(),
                Some("ConfigMap") => serde_yaml::to_value(substitute_config_map(serde_yaml::from_value(substituted).unwrap(), &manifest_defaults).unwrap()).unwrap(),
                _ => substituted,
            };
            // Through the typed objects both ways, so that only content is compared.
            let original = match original.get("kind").and_then(|k| k.as_str()) {
                Some("DaemonSet") => serde_yaml::to_value(serde_yaml::from_value::<DaemonSet>(original).unwrap()).unwrap(),
                Some("ConfigMap") => serde_yaml::to_value(serde_yaml::from_value::<ConfigMap>(original).unwrap()).unwrap(),
                _ => original,
            };
            assert_eq!(back, original);
        }
        let text = manifests(&install(), &all).unwrap();
        for expected in ["localhost/ebpf-proxy/agent:0.1.0-0123456789ab", "10.244.1.250", "/tmp/node/bpffs", "/sys/fs/cgroup/unified/node", "/tmp/node/state", "/tmp/node/manifests"] {
            assert!(text.contains(expected), "{expected} missing in {text}");
        }
        assert!(!text.contains("latest") && !text.contains("192.0.2.10"), "{text}");
    }
}
