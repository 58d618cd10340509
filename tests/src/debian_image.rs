//! The `debian:<suite>` base image, made on this machine since no registry is reachable: a
//! debootstrap `minbase` root file system with the official image's APT sources, kept as a tar
//! in `~/.cache/ebpf-proxy/images/` keyed by suite and debootstrap version, and committed into a
//! buildah storage under the official names (`docker.io/library/debian:<suite>` and
//! `-slim`), so that `FROM debian:bookworm` in deploy/Containerfile is built unchanged.
//!
//! It differs from the official image in what a minbase install has (no docs trimming, a few more
//! or fewer packages), not in what a Containerfile relies on: Debian's archive, `apt-get`, a
//! shell, the release's security and updates suites.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

use crate::topology::run;

pub const SUITE: &str = "bookworm";
const MIRROR: &str = "http://deb.debian.org/debian";

/// `/etc/apt/sources.list.d/debian.sources` as the official `debian:<suite>` image has it.
pub fn official_sources(suite: &str) -> String {
    format!(
        "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: {suite} {suite}-updates\nComponents: main\n\
         Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n\
         Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: {suite}-security\nComponents: main\n\
         Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )
}

/// The names the image is committed under: those `FROM debian:<suite>` and
/// `FROM debian:<suite>-slim` resolve to.
pub fn image_names(suite: &str) -> [String; 2] {
    [format!("docker.io/library/debian:{suite}"), format!("docker.io/library/debian:{suite}-slim")]
}

/// The cached root file system tar of `suite`, made with debootstrap if missing (about 2 min).
pub fn rootfs_tar(suite: &str) -> anyhow::Result<PathBuf> {
    let home = std::env::var_os("HOME").filter(|home| !home.is_empty()).context("HOME is not set")?;
    let dir = Path::new(&home).join(".cache/ebpf-proxy/images");
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let tar = dir.join(format!("debian-{suite}-minbase-debootstrap-{}.tar", debootstrap_version()?));
    let lock = fs::File::create(dir.join(".lock")).with_context(|| format!("creating {}", dir.join(".lock").display()))?;
    lock.lock().with_context(|| format!("locking {}", dir.join(".lock").display()))?;
    if tar.is_file() {
        return Ok(tar);
    }
    let rootfs = dir.join(format!("debian-{suite}.rootfs.partial"));
    if rootfs.exists() {
        fs::remove_dir_all(&rootfs).with_context(|| format!("removing {}", rootfs.display()))?;
    }
    eprintln!("making the debian:{suite} base image with debootstrap --variant=minbase into {}", tar.display());
    // In a mount namespace of its own: the /proc and /sys it mounts in the target die with it,
    // also when it is killed.
    run(Command::new("unshare")
        .args(["--mount", "--propagation", "private", "--", "debootstrap", "--variant=minbase", suite])
        .arg(&rootfs)
        .arg(MIRROR))?;
    let apt = rootfs.join("etc/apt");
    fs::remove_file(apt.join("sources.list")).with_context(|| format!("removing {}", apt.join("sources.list").display()))?;
    fs::write(apt.join("sources.list.d/debian.sources"), official_sources(suite))?;
    // As in the official image: no package lists or downloaded packages in the layer.
    for cache in ["var/lib/apt/lists", "var/cache/apt/archives"] {
        for entry in fs::read_dir(rootfs.join(cache))?.flatten() {
            if entry.file_type()?.is_file() {
                fs::remove_file(entry.path())?;
            }
        }
    }
    let partial = tar.with_extension("tar.partial");
    run(Command::new("tar").args(["--numeric-owner", "-C"]).arg(&rootfs).arg("-cf").arg(&partial).arg("."))?;
    fs::rename(&partial, &tar).with_context(|| format!("moving {} to {}", partial.display(), tar.display()))?;
    fs::remove_dir_all(&rootfs).with_context(|| format!("removing {}", rootfs.display()))?;
    Ok(tar)
}

fn debootstrap_version() -> anyhow::Result<String> {
    let out = run(Command::new("dpkg-query").args(["-W", "-f", "${Version}", "debootstrap"]))?;
    let version = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if version.is_empty() {
        bail!("debootstrap is not installed");
    }
    Ok(version.replace(['+', '~', ':'], "_"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_sources_are_the_official_images() {
        assert_eq!(image_names("bookworm"), ["docker.io/library/debian:bookworm", "docker.io/library/debian:bookworm-slim"]);
        let sources = official_sources("bookworm");
        assert!(sources.contains("Suites: bookworm bookworm-updates\n"));
        assert!(sources.contains("Suites: bookworm-security\n"));
    }
}
