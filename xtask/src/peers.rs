//! `cargo xtask peers`: the real upstream Kubernetes components, etcd and CoreDNS, built from their
//! Go modules into a per-version cache outside the repository, for tests, benchmarks and the local
//! node (`cargo xtask cluster up --node`).
//!
//! `go install k8s.io/kubernetes/cmd/kube-apiserver@v1.34.4` does not work: k8s.io/kubernetes'
//! go.mod replaces every `k8s.io/*` staging module with `./staging/src/k8s.io/...`, and `go install
//! pkg@version` refuses a module with replace directives. So a small wrapper module requires
//! k8s.io/kubernetes and replaces each staging module with its published release (`k8s.io/api
//! v0.34.4` for Kubernetes v1.34.4); the list is read from the real go.mod, so it follows the version.
//! etcd's server module has replaces too, but a wrapper that merely requires it builds with none;
//! so does CoreDNS's, whose main package the wrapper brings itself to link fewer plugins
//! ([`COREDNS_MAIN_GO`]).
//!
//! Each binary is checked on its own (it must run and report the expected version) and only the
//! missing ones are built, so a cache made before a binary was added here stays valid.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};

use crate::step;

/// Newest 1.34 patch release on the module proxy.
const KUBERNETES_VERSION: &str = "v1.34.4";
/// Newest 3.6 patch release on the module proxy.
const ETCD_VERSION: &str = "v3.6.16";
/// Newest CoreDNS release (its go.mod asks for Go 1.26.0).
const COREDNS_VERSION: &str = "v1.15.0";

const ETCD_MAIN: &str = "go.etcd.io/etcd/server/v3";
const COREDNS_MODULE: &str = "github.com/coredns/coredns";
/// CoreDNS's own `coredns.go` with the plugins of the standard Corefile (kubeadm's and the
/// addon manifest's) and a few light ones often added to it, instead of all 60
/// (`core/plugin`): the cloud back-ends (Route 53, Azure, Cloud DNS), etcd, dnstap, gRPC, QUIC,
/// tracing and DNSSEC signing took most of the compile time, and no test here configures them.
/// The plugins' order is CoreDNS's own (`dnsserver.Directives`), whichever are linked.
const COREDNS_MAIN_GO: &str = r#"package main

import (
	"github.com/coredns/coredns/coremain"

	// The standard Corefile.
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"

	// Light and common additions.
	_ "github.com/coredns/coredns/plugin/autopath"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/debug"
	_ "github.com/coredns/coredns/plugin/hosts"
	_ "github.com/coredns/coredns/plugin/k8s_external"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/rewrite"
	_ "github.com/coredns/coredns/plugin/template"
	_ "github.com/coredns/coredns/plugin/whoami"
)

func main() {
	coremain.Run()
}
"#;
/// Build tags of the upstream release build (hack/lib/golang.sh).
const KUBERNETES_TAGS: &str = "selinux,notest,grpcnotrace";

/// Which Go module a peer comes from: the binaries of one module are built by one `go build`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Source {
    Kubernetes,
    Etcd,
    CoreDns,
}

/// One binary of the cache: its name, the package it is built from, and how it tells its version.
struct Peer {
    name: &'static str,
    source: Source,
    package: &'static str,
    version_args: &'static [&'static str],
    /// Text the version output must contain; a binary of another version is rebuilt.
    expected_version: &'static str,
}

/// What the tests and the benchmark need come first; the rest make the local node.
const PEERS: &[Peer] = &[
    Peer { name: "kube-apiserver", source: Source::Kubernetes, package: "k8s.io/kubernetes/cmd/kube-apiserver", version_args: &["--version"], expected_version: KUBERNETES_VERSION },
    Peer { name: "kube-proxy", source: Source::Kubernetes, package: "k8s.io/kubernetes/cmd/kube-proxy", version_args: &["--version"], expected_version: KUBERNETES_VERSION },
    Peer { name: "etcd", source: Source::Etcd, package: ETCD_MAIN, version_args: &["--version"], expected_version: "etcd Version: 3.6.16" },
    Peer { name: "kubelet", source: Source::Kubernetes, package: "k8s.io/kubernetes/cmd/kubelet", version_args: &["--version"], expected_version: KUBERNETES_VERSION },
    Peer { name: "kube-controller-manager", source: Source::Kubernetes, package: "k8s.io/kubernetes/cmd/kube-controller-manager", version_args: &["--version"], expected_version: KUBERNETES_VERSION },
    Peer { name: "kube-scheduler", source: Source::Kubernetes, package: "k8s.io/kubernetes/cmd/kube-scheduler", version_args: &["--version"], expected_version: KUBERNETES_VERSION },
    Peer { name: "kubectl", source: Source::Kubernetes, package: "k8s.io/kubernetes/cmd/kubectl", version_args: &["version", "--client"], expected_version: KUBERNETES_VERSION },
    Peer { name: "coredns", source: Source::CoreDns, package: COREDNS_MODULE, version_args: &["-version"], expected_version: "CoreDNS-1.15.0" },
];

/// Where a build puts its binaries before they are renamed into the cache.
const PARTIAL: &str = ".partial";
/// Held (flock) while the cache is checked and built, so two builds never share `.partial`.
const LOCK: &str = ".lock";

/// Makes sure every peer exists and returns the directory holding them: `$KUBEBUILDER_ASSETS` if
/// it has all of them, else the cache, where only the missing ones are built.
pub fn run() -> anyhow::Result<PathBuf> {
    if let Some(assets) = std::env::var_os("KUBEBUILDER_ASSETS").filter(|dir| !dir.is_empty()) {
        let assets = PathBuf::from(assets);
        let missing = missing(&assets);
        if missing.is_empty() {
            step(&format!("using the peers in KUBEBUILDER_ASSETS={}", assets.display()));
            return Ok(assets);
        }
        step(&format!(
            "KUBEBUILDER_ASSETS={} lacks a working {}; using the cache",
            assets.display(),
            names(&missing)
        ));
    }

    let dir = cache_dir()?;
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let lock = fs::File::create(dir.join(LOCK)).with_context(|| format!("creating {}", dir.join(LOCK).display()))?;
    if lock.try_lock().is_err() {
        step(&format!("another peers build holds {}; waiting for it", dir.join(LOCK).display()));
        lock.lock().with_context(|| format!("locking {}", dir.join(LOCK).display()))?;
    }

    let wanted = missing(&dir);
    if wanted.is_empty() {
        step(&format!("peers cached in {}", dir.display()));
        return Ok(dir);
    }

    let go = find_go()?;
    let started = Instant::now();
    step(&format!(
        "building {} (Kubernetes {KUBERNETES_VERSION}, etcd {ETCD_VERSION}, CoreDNS {COREDNS_VERSION}) into {}; \
         a cold build of everything takes 20-40 min on 2 cores",
        names(&wanted),
        dir.display()
    ));
    let partial = dir.join(PARTIAL);
    if partial.exists() {
        fs::remove_dir_all(&partial).with_context(|| format!("removing {}", partial.display()))?;
    }
    fs::create_dir_all(&partial).with_context(|| format!("creating {}", partial.display()))?;

    for source in [Source::Kubernetes, Source::Etcd, Source::CoreDns] {
        let packages: Vec<&str> = wanted.iter().filter(|peer| peer.source == source).map(|peer| peer.package).collect();
        if packages.is_empty() {
            continue;
        }
        let source_started = Instant::now();
        match source {
            Source::Kubernetes => build_kubernetes(&go, &dir.join("src/kubernetes"), &partial, &packages)?,
            Source::Etcd => build_wrapped(&go, &dir.join("src/etcd"), &partial, ETCD_MAIN, ETCD_VERSION, None, "etcd")?,
            Source::CoreDns => {
                build_wrapped(&go, &dir.join("src/coredns"), &partial, COREDNS_MODULE, COREDNS_VERSION, Some(COREDNS_MAIN_GO), "coredns")?
            }
        }
        eprintln!("{source:?}: {} built in {}", packages.join(" "), minutes(source_started));
    }

    for peer in &wanted {
        let built = partial.join(peer.name);
        check(peer, &built).with_context(|| format!("the freshly built {} does not work", peer.name))?;
        let target = dir.join(peer.name);
        fs::rename(&built, &target).with_context(|| format!("moving {} to {}", built.display(), target.display()))?;
    }
    fs::remove_dir_all(&partial).with_context(|| format!("removing {}", partial.display()))?;

    for peer in PEERS {
        eprintln!("{}: {}", peer.name, version(peer, &dir.join(peer.name))?);
    }
    step(&format!("{} built in {}: {}", names(&wanted), minutes(started), dir.display()));
    Ok(dir)
}

fn minutes(since: Instant) -> String {
    let elapsed = since.elapsed().as_secs();
    format!("{}m{:02}s", elapsed / 60, elapsed % 60)
}

fn names(peers: &[&Peer]) -> String {
    peers.iter().map(|peer| peer.name).collect::<Vec<_>>().join(", ")
}

/// The peers that `dir` lacks or holds in a version that does not run or is not the one wanted.
fn missing(dir: &Path) -> Vec<&'static Peer> {
    PEERS.iter().filter(|peer| check(peer, &dir.join(peer.name)).is_err()).collect()
}

fn check(peer: &Peer, bin: &Path) -> anyhow::Result<()> {
    let version = version(peer, bin)?;
    if !version.contains(peer.expected_version) {
        bail!("{} reports {version:?}, not {}", bin.display(), peer.expected_version);
    }
    Ok(())
}

/// `$EPX_PEERS_CACHE`, else `$HOME/.cache/ebpf-proxy/peers/k8s-<version>-etcd-<version>`.
fn cache_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("EPX_PEERS_CACHE").filter(|dir| !dir.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME").filter(|home| !home.is_empty()).context("neither EPX_PEERS_CACHE nor HOME is set")?;
    Ok(Path::new(&home)
        .join(".cache/ebpf-proxy/peers")
        .join(format!("k8s-{KUBERNETES_VERSION}-etcd-{ETCD_VERSION}")))
}

/// The first line `<bin> <version_args>` prints, if it runs and succeeds.
fn version(peer: &Peer, bin: &Path) -> anyhow::Result<String> {
    let out = Command::new(bin)
        .args(peer.version_args)
        .output()
        .with_context(|| format!("running {} {}", bin.display(), peer.version_args.join(" ")))?;
    if !out.status.success() {
        bail!("{} {} failed with {}", bin.display(), peer.version_args.join(" "), out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or_default().trim().to_owned())
}

/// `go` on PATH, else the official tarball's /usr/local/go/bin/go.
fn find_go() -> anyhow::Result<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).map(|dir| dir.join("go")).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain([PathBuf::from("/usr/local/go/bin/go")])
        .find(|go| go.is_file())
        .context("Go not found (neither `go` on PATH nor /usr/local/go/bin/go): install Go >= 1.24 from https://go.dev/dl")
}

/// A `go` command run in `dir`, cgo off (static binaries, no C toolchain needed).
fn go(go: &Path, dir: &Path) -> Command {
    let mut cmd = Command::new(go);
    cmd.current_dir(dir).env("CGO_ENABLED", "0");
    cmd
}

/// An empty directory holding a fresh `go.mod` for `module`.
fn wrapper_module(go_bin: &Path, dir: &Path, module: &str) -> anyhow::Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for generated in ["go.mod", "go.sum"] {
        let path = dir.join(generated);
        if path.exists() {
            fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    crate::run(go(go_bin, dir).args(["mod", "init", module]))
}

/// Builds `packages` (commands of k8s.io/kubernetes) into `out`. The wrapper module names every
/// Kubernetes command of [`PEERS`] as a tool, so its go.sum is the same whichever are missing.
fn build_kubernetes(go_bin: &Path, src: &Path, out: &Path, packages: &[&str]) -> anyhow::Result<()> {
    let staging = staging_version(KUBERNETES_VERSION)?;
    let (major, minor) = major_minor(KUBERNETES_VERSION)?;
    wrapper_module(go_bin, src, "ebpf-proxy/peers/kubernetes")?;

    step(&format!("reading k8s.io/kubernetes@{KUBERNETES_VERSION}'s go.mod for its staging replaces"));
    let upstream = upstream_go_mod(go_bin, src, "k8s.io/kubernetes", KUBERNETES_VERSION)?;
    let (replaced, godebug) = parse_go_mod(&upstream);
    if replaced.is_empty() {
        bail!("k8s.io/kubernetes@{KUBERNETES_VERSION}'s go.mod has no `=> ./staging/...` replaces; has the layout changed?");
    }
    eprintln!("{} staging modules -> {staging}; godebug: {}", replaced.len(), godebug.join(" "));

    let mut edit = go(go_bin, src);
    edit.args(["mod", "edit", &format!("-require=k8s.io/kubernetes@{KUBERNETES_VERSION}")]);
    edit.args(godebug.iter().map(|setting| format!("-godebug={setting}")));
    edit.args(replaced.iter().map(|module| format!("-replace={module}={module}@{staging}")));
    edit.args(PEERS.iter().filter(|peer| peer.source == Source::Kubernetes).map(|peer| format!("-tool={}", peer.package)));
    crate::run(&mut edit)?;

    step("resolving the Kubernetes wrapper module (go mod tidy)");
    crate::run(go(go_bin, src).args(["mod", "tidy"]))?;

    step(&format!("compiling {} (the long part)", packages.join(" ")));
    let ldflags = format!(
        "-X k8s.io/component-base/version.gitVersion={KUBERNETES_VERSION} \
         -X k8s.io/component-base/version.gitMajor={major} \
         -X k8s.io/component-base/version.gitMinor={minor}"
    );
    crate::run(go(go_bin, src)
        .args(["build", "-trimpath", "-tags", KUBERNETES_TAGS, "-ldflags", &ldflags, "-o"])
        .arg(dir_arg(out))
        .args(packages))
}

/// Builds `binary` from `module@version` through a wrapper module that merely requires it: its
/// main package `module` itself, or, with `main_go`, the wrapper's own main package.
fn build_wrapped(go_bin: &Path, src: &Path, out: &Path, module: &str, version: &str, main_go: Option<&str>, binary: &str) -> anyhow::Result<()> {
    wrapper_module(go_bin, src, &format!("ebpf-proxy/peers/{binary}"))?;
    let mut edit = go(go_bin, src);
    edit.args(["mod", "edit", &format!("-require={module}@{version}")]);
    let main_file = src.join("main.go");
    let package = match main_go {
        Some(text) => {
            fs::write(&main_file, text).with_context(|| format!("writing {}", main_file.display()))?;
            "."
        }
        None => {
            if main_file.exists() {
                fs::remove_file(&main_file).with_context(|| format!("removing {}", main_file.display()))?;
            }
            edit.arg(format!("-tool={module}"));
            module
        }
    };
    crate::run(&mut edit)?;
    step(&format!("resolving the {binary} wrapper module (go mod tidy)"));
    crate::run(go(go_bin, src).args(["mod", "tidy"]))?;
    step(&format!("compiling {binary} {version}"));
    crate::run(go(go_bin, src).args(["build", "-trimpath", "-o"]).arg(out.join(binary)).arg(package))
}

/// `go build -o DIR/` writes one binary per package into DIR only with the trailing slash.
fn dir_arg(dir: &Path) -> std::ffi::OsString {
    let mut arg = dir.as_os_str().to_owned();
    arg.push(OsStr::new("/"));
    arg
}

/// The text of `module@version`'s go.mod, fetched through the module proxy.
fn upstream_go_mod(go_bin: &Path, dir: &Path, module: &str, version: &str) -> anyhow::Result<String> {
    let out = go(go_bin, dir)
        .args(["mod", "download", "-json", &format!("{module}@{version}")])
        .output()
        .context("running go mod download")?;
    if !out.status.success() {
        bail!(
            "go mod download {module}@{version} failed with {}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let json = String::from_utf8_lossy(&out.stdout);
    let path = json_string_field(&json, "GoMod").with_context(|| format!("no GoMod path in go mod download's output: {json}"))?;
    fs::read_to_string(&path).with_context(|| format!("reading {path}"))
}

/// The value of `"field": "value"` in go's indented JSON output (a path: no escapes to undo but `\\`).
fn json_string_field(json: &str, field: &str) -> Option<String> {
    let key = format!("\"{field}\":");
    let rest = json.lines().find_map(|line| line.trim().strip_prefix(key.as_str()))?;
    let value = rest.trim().trim_end_matches(',').strip_prefix('"')?.strip_suffix('"')?;
    Some(value.replace("\\\\", "\\"))
}

/// From a go.mod: the modules replaced by a `./staging/` directory, and the `godebug` settings.
fn parse_go_mod(go_mod: &str) -> (Vec<String>, Vec<String>) {
    let (mut staging, mut godebug) = (Vec::new(), Vec::new());
    let mut block = "";
    for line in go_mod.lines() {
        let line = line.split("//").next().unwrap_or_default().trim();
        if line == ")" {
            block = "";
            continue;
        }
        let (directive, body) = match line.split_once(char::is_whitespace) {
            Some((word @ ("replace" | "godebug"), rest)) if block.is_empty() => (word, rest.trim()),
            _ => (block, line),
        };
        if body == "(" {
            block = directive;
            continue;
        }
        match directive {
            "replace" => {
                if let Some((old, new)) = body.split_once("=>") {
                    if new.trim().starts_with("./staging/") {
                        if let Some(module) = old.split_whitespace().next() {
                            staging.push(module.to_owned());
                        }
                    }
                }
            }
            "godebug" if !body.is_empty() => godebug.push(body.split_whitespace().collect::<Vec<_>>().join("")),
            _ => {}
        }
    }
    (staging, godebug)
}

/// Staging modules are tagged `v0.X.Y` for Kubernetes `v1.X.Y`.
fn staging_version(kubernetes: &str) -> anyhow::Result<String> {
    kubernetes
        .strip_prefix("v1.")
        .map(|rest| format!("v0.{rest}"))
        .with_context(|| format!("Kubernetes version {kubernetes} is not v1.X.Y"))
}

fn major_minor(version: &str) -> anyhow::Result<(&str, &str)> {
    let mut parts = version.trim_start_matches('v').split('.');
    match (parts.next(), parts.next()) {
        (Some(major), Some(minor)) if !major.is_empty() && !minor.is_empty() => Ok((major, minor)),
        _ => bail!("version {version} is not vX.Y.Z"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_staging_replaces_and_godebug() {
        let go_mod = "module k8s.io/kubernetes\n\ngo 1.24.0\n\ngodebug default=go1.24\n\n\
            require (\n\tk8s.io/api v0.0.0\n)\n\n\
            replace (\n\tk8s.io/api => ./staging/src/k8s.io/api\n\
            \tk8s.io/client-go => ./staging/src/k8s.io/client-go // comment\n\
            \tgithub.com/x/y => github.com/x/y v1.0.0\n)\n\
            replace k8s.io/kms => ./staging/src/k8s.io/kms\n\
            godebug (\n\tasynctimerchan=1\n)\n";
        let (staging, godebug) = parse_go_mod(go_mod);
        assert_eq!(staging, ["k8s.io/api", "k8s.io/client-go", "k8s.io/kms"]);
        assert_eq!(godebug, ["default=go1.24", "asynctimerchan=1"]);
    }

    #[test]
    fn expected_versions_follow_the_pinned_releases() {
        for peer in PEERS {
            let pinned = match peer.source {
                Source::Kubernetes => KUBERNETES_VERSION.to_owned(),
                Source::Etcd => format!("etcd Version: {}", ETCD_VERSION.trim_start_matches('v')),
                Source::CoreDns => format!("CoreDNS-{}", COREDNS_VERSION.trim_start_matches('v')),
            };
            assert_eq!(peer.expected_version, pinned, "{}", peer.name);
        }
    }

    #[test]
    fn versions() {
        assert_eq!(staging_version("v1.34.4").unwrap(), "v0.34.4");
        assert!(staging_version("v2.0.0").is_err());
        assert_eq!(major_minor("v1.34.4").unwrap(), ("1", "34"));
        assert_eq!(json_string_field("{\n\t\"GoMod\": \"/a/b.mod\",\n}", "GoMod").as_deref(), Some("/a/b.mod"));
    }
}
