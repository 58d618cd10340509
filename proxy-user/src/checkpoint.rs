//! The on-disk checkpoint of the last desired state, for a node that reboots while the API server
//! is unreachable: bpffs is empty then, and without it the node would have no Service routing
//! (not even the cluster DNS Service) until the API answers.
//!
//! Written after every successful sync: atomically (temp file, fsync, rename), versioned, and
//! checksummed. A checkpoint that is corrupt, of another format, or of another version is
//! reported and ignored, never trusted.
//!
//! Format versions (in the header): 1 had ClusterIP frontends only; 2 adds the frontend kind,
//! the traffic-policy and affinity settings, backend locality, and IPv6 addresses. Version 1 is
//! still read (its entries are ClusterIPs without those settings, exactly what an agent of
//! that version programmed), so a newer agent restores an older one's checkpoint; an older agent
//! refuses version 2 as foreign instead of misreading it. The file name stays the same across
//! versions for that reason.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::desired::{
    Backend, BackendAddr, DesiredState, Frontend, FrontendKind, FrontendSpec, Proto, Scope, ServicePortName,
};

const MAGIC: &str = "ebpf-proxy-checkpoint";
const VERSION: u32 = 2;
/// Versions `load` understands.
const READABLE_VERSIONS: [u32; 2] = [1, 2];
pub const FILE_NAME: &str = "checkpoint.v1";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not an ebpf-proxy checkpoint of format 1 or {VERSION} (header {header:?})")]
    Foreign { path: PathBuf, header: String },
    #[error("{path} is corrupt: checksum {found:016x}, header says {expected:016x}")]
    Checksum { path: PathBuf, found: u64, expected: u64 },
    #[error("{path} is corrupt: {reason}")]
    Corrupt { path: PathBuf, reason: String },
}

/// One frontend entry. Fields added after format 1 default to what format 1 meant.
#[derive(Serialize, Deserialize, PartialEq, Debug)]
struct Entry {
    ip: IpAddr,
    port: u16,
    protocol: u8,
    scope: u8,
    namespace: String,
    name: String,
    port_name: String,
    backends: Vec<(IpAddr, u16)>,
    #[serde(default)]
    kind: FrontendKind,
    #[serde(default)]
    local_only: bool,
    #[serde(default)]
    affinity_timeout: Option<u32>,
    /// The backends (of `backends`) whose endpoint runs on this node.
    #[serde(default)]
    local_backends: Vec<(IpAddr, u16)>,
}

/// FNV-1a, 64 bit: detects torn or edited files; this is not a defence against tampering (the
/// state directory is root's).
fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv1a64_continue(FNV_OFFSET, bytes)
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv1a64_continue(hash: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(hash, |hash, b| (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// Passes bytes on and folds them into the checksum.
struct Checksummed<W> {
    inner: W,
    hash: u64,
}

impl<W: Write> Write for Checksummed<W> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let written = self.inner.write(bytes)?;
        self.hash = fnv1a64_continue(self.hash, &bytes[..written]);
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// [`Entry`] as serialised, borrowed from the state: the same JSON without a copy of it. (At
/// 30 000 Services the copy, the JSON text and the file's contents were each tens of MiB, the
/// agent's peak memory.)
#[derive(Serialize)]
struct EntryRef<'a> {
    ip: IpAddr,
    port: u16,
    protocol: u8,
    scope: u8,
    namespace: &'a str,
    name: &'a str,
    port_name: &'a str,
    backends: Backends<'a>,
    kind: FrontendKind,
    local_only: bool,
    affinity_timeout: Option<u32>,
    local_backends: Backends<'a>,
}

/// Backends as `(address, port)` pairs; only the local ones when `local_only`.
struct Backends<'a> {
    backends: &'a [Backend],
    local_only: bool,
}

impl Serialize for Backends<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let local_only = self.local_only;
        serializer.collect_seq(self.backends.iter().filter(|b| b.local || !local_only).map(|b| (b.addr.addr, b.addr.port)))
    }
}

struct Entries<'a>(&'a DesiredState);

impl Serialize for Entries<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.frontends.iter().map(|(f, spec)| EntryRef {
            ip: f.addr,
            port: f.port,
            protocol: f.proto.number(),
            scope: f.scope.number(),
            namespace: &spec.service.namespace,
            name: &spec.service.name,
            port_name: &spec.service.port,
            backends: Backends { backends: &spec.backends, local_only: false },
            kind: spec.kind,
            local_only: spec.local_only,
            affinity_timeout: spec.affinity_timeout,
            local_backends: Backends { backends: &spec.backends, local_only: true },
        }))
    }
}

pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(FILE_NAME)
}

fn header(checksum: u64) -> String {
    format!("{MAGIC} {VERSION} {checksum:016x}\n")
}

/// Writes `state` to `state_dir` atomically, streaming it: the header's checksum is written
/// last, over a placeholder of the same length.
pub fn save(state_dir: &Path, state: &DesiredState) -> Result<(), CheckpointError> {
    use std::io::{Seek, SeekFrom};
    let target = path(state_dir);
    let tmp = state_dir.join(format!(".{FILE_NAME}.tmp"));
    let err = |source| CheckpointError::Write { path: target.clone(), source };
    let file = fs::File::create(&tmp).map_err(err)?;
    let mut out = std::io::BufWriter::with_capacity(1 << 16, file);
    out.write_all(header(0).as_bytes()).map_err(err)?;
    let mut payload = Checksummed { inner: out, hash: FNV_OFFSET };
    serde_json::to_writer(&mut payload, &Entries(state)).map_err(|e| err(e.into()))?;
    let (mut out, checksum) = (payload.inner, payload.hash);
    out.write_all(b"\n").map_err(err)?;
    let mut file = out.into_inner().map_err(|e| err(e.into_error()))?;
    file.seek(SeekFrom::Start(0)).map_err(err)?;
    file.write_all(header(checksum).as_bytes()).map_err(err)?;
    file.sync_all().map_err(err)?;
    fs::rename(&tmp, &target).map_err(err)?;
    // The rename itself must survive a power cut too.
    fs::File::open(state_dir).and_then(|dir| dir.sync_all()).map_err(err)?;
    Ok(())
}

/// Reads the checkpoint; `Ok(None)` when there is none.
pub fn load(state_dir: &Path) -> Result<Option<DesiredState>, CheckpointError> {
    let path = path(state_dir);
    let contents = match fs::read_to_string(&path) {
        Ok(contents) => contents,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
            return Err(CheckpointError::Corrupt { path, reason: "not UTF-8".into() })
        }
        Err(source) => return Err(CheckpointError::Read { path, source }),
    };
    let (header, payload) = contents.split_once('\n').unwrap_or((&contents, ""));
    let payload = payload.strip_suffix('\n').unwrap_or(payload);
    let fields: Vec<&str> = header.split(' ').collect();
    let expected = match fields.as_slice() {
        [magic, version, checksum]
            if *magic == MAGIC && READABLE_VERSIONS.iter().any(|v| v.to_string() == *version) =>
        {
            u64::from_str_radix(checksum, 16)
                .map_err(|_| CheckpointError::Corrupt { path: path.clone(), reason: "bad checksum field".into() })?
        }
        _ => return Err(CheckpointError::Foreign { path, header: header.chars().take(60).collect() }),
    };
    let found = fnv1a64(payload.as_bytes());
    if found != expected {
        return Err(CheckpointError::Checksum { path, found, expected });
    }
    let entries: Vec<Entry> =
        serde_json::from_str(payload).map_err(|e| CheckpointError::Corrupt { path: path.clone(), reason: e.to_string() })?;
    let mut frontends = BTreeMap::new();
    for entry in entries {
        let bad = |what: &str| CheckpointError::Corrupt { path: path.clone(), reason: format!("unknown {what}") };
        let proto = Proto::from_number(entry.protocol).ok_or_else(|| bad("protocol"))?;
        let scope = Scope::from_number(entry.scope).ok_or_else(|| bad("scope"))?;
        let local: BTreeSet<(IpAddr, u16)> = entry.local_backends.into_iter().collect();
        frontends.insert(
            Frontend { addr: entry.ip, port: entry.port, proto, scope },
            std::sync::Arc::new(FrontendSpec {
                service: ServicePortName { namespace: entry.namespace, name: entry.name, port: entry.port_name },
                kind: entry.kind,
                local_only: entry.local_only,
                affinity_timeout: entry.affinity_timeout,
                backends: entry
                    .backends
                    .into_iter()
                    .map(|(addr, port)| Backend {
                        addr: BackendAddr { addr, port, proto },
                        local: local.contains(&(addr, port)),
                    })
                    .collect(),
            }),
        );
    }
    Ok(Some(DesiredState { frontends, rejections: Vec::new() }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> DesiredState {
        let backend = |addr: &str, local| Backend {
            addr: BackendAddr { addr: addr.parse().unwrap(), port: 53, proto: Proto::Udp },
            local,
        };
        let entry = |addr: &str, port, scope, kind, local_only, affinity_timeout, backends| {
            let frontend = Frontend { addr: addr.parse().unwrap(), port, proto: Proto::Udp, scope };
            let service = ServicePortName { namespace: "kube-system".into(), name: "kube-dns".into(), port: "dns".into() };
            (frontend, std::sync::Arc::new(FrontendSpec { service, kind, local_only, affinity_timeout, backends }))
        };
        let mut state = DesiredState::default();
        state.frontends.extend([
            entry("10.96.0.10", 53, Scope::Internal, FrontendKind::ClusterIp, false, None, vec![backend("10.244.1.5", false)]),
            entry(
                "10.244.1.1",
                30053,
                Scope::External,
                FrontendKind::NodePort,
                true,
                Some(600),
                vec![backend("10.244.1.5", false), backend("10.244.1.6", true)],
            ),
            entry("fd00::10", 53, Scope::Internal, FrontendKind::ClusterIp, false, None, vec![backend("fd00:10:244::5", false)]),
        ]);
        state
    }

    fn dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("epx-checkpoint-test-{}-{:?}", std::process::id(), std::thread::current().id()));
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn round_trips_and_absent_is_none() {
        let dir = dir();
        assert!(load(&dir).unwrap().is_none());
        save(&dir, &state()).unwrap();
        assert_eq!(load(&dir).unwrap().unwrap(), state());
        fs::remove_dir_all(dir).unwrap();
    }

    /// The streamed file is byte for byte what serialising [`Entry`] values gives (the format
    /// older agents of version 2 read), with a checksum `load`'s own check accepts.
    #[test]
    fn the_streamed_file_is_the_entries_json_with_its_checksum() {
        let dir = dir();
        let state = state();
        save(&dir, &state).unwrap();
        let entries: Vec<Entry> = state
            .frontends
            .iter()
            .map(|(f, spec)| Entry {
                ip: f.addr,
                port: f.port,
                protocol: f.proto.number(),
                scope: f.scope.number(),
                namespace: spec.service.namespace.clone(),
                name: spec.service.name.clone(),
                port_name: spec.service.port.clone(),
                backends: spec.backends.iter().map(|b| (b.addr.addr, b.addr.port)).collect(),
                kind: spec.kind,
                local_only: spec.local_only,
                affinity_timeout: spec.affinity_timeout,
                local_backends: spec.backends.iter().filter(|b| b.local).map(|b| (b.addr.addr, b.addr.port)).collect(),
            })
            .collect();
        let payload = serde_json::to_string(&entries).unwrap();
        let expected = format!("{}{payload}\n", header(fnv1a64(payload.as_bytes())));
        assert_eq!(fs::read_to_string(path(&dir)).unwrap(), expected);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn corrupt_and_foreign_files_are_refused_with_the_reason() {
        let dir = dir();
        save(&dir, &state()).unwrap();
        let good = fs::read_to_string(path(&dir)).unwrap();

        fs::write(path(&dir), good.replace("10.244.1.5", "10.244.1.6")).unwrap();
        assert!(matches!(load(&dir), Err(CheckpointError::Checksum { .. })));

        fs::write(path(&dir), &good[..good.len() / 2]).unwrap();
        assert!(load(&dir).is_err());

        fs::write(path(&dir), good.replace("checkpoint 2 ", "checkpoint 3 ")).unwrap();
        assert!(matches!(load(&dir), Err(CheckpointError::Foreign { .. })));

        fs::write(path(&dir), [0xff, 0xfe, 0x00]).unwrap();
        assert!(load(&dir).is_err());
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_format_1_checkpoint_is_still_restored_as_the_cluster_ips_it_held() {
        let dir = dir();
        let payload = r#"[{"ip":"10.96.0.10","port":53,"protocol":17,"scope":1,"namespace":"kube-system","name":"kube-dns","port_name":"dns","backends":[["10.244.1.5",53]]}]"#;
        fs::write(path(&dir), format!("{MAGIC} 1 {:016x}\n{payload}\n", fnv1a64(payload.as_bytes()))).unwrap();
        let mut expected = state();
        expected.frontends.retain(|f, _| f.port == 53 && f.addr.is_ipv4());
        assert_eq!(load(&dir).unwrap().unwrap(), expected);
        fs::remove_dir_all(dir).unwrap();
    }
}
