//! Everything that touches the kernel: bpffs, loading the embedded object, pinned maps, attaching
//! programs through pinned links, and the `LbMaps` implementation over the pinned maps.
//!
//! The datapath must outlive the agent: maps are pinned by name under `--bpffs`, and each program
//! is attached through a bpf_link pinned under `--bpffs/links`. A restarted or upgraded agent
//! swaps the program inside an existing link atomically (BPF_LINK_UPDATE) instead of detaching.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use aya::maps::{HashMap, Map, MapData, MapType};
use aya::programs::{CgroupAttachMode, CgroupSockAddr, links::FdLink};
use aya::{Ebpf, EbpfLoader};
use proxy_abi::{
    capacity, layout, map_name, Backend4, Backend6, BackendId, CtEntry4, CtEntry6, CtKey4, CtKey6,
    MaglevTable4, RevNat4, RevNat6, RevNatId, ServiceKey4, ServiceKey6, ServiceValue4,
};

use crate::lbmap::{BackendValue, LbMaps, MapError, RevNatValue, SvcKey};

pub mod flows;
pub mod tc;

pub use flows::FlowMaps;

/// The eBPF object, embedded at build time by `cargo xtask build`.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf.o"));

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

/// The socket-LB programs: ELF function name, and the name of its pinned link.
pub const SOCK_PROGRAMS: [&str; 8] = [
    "epx_connect4",
    "epx_sendmsg4",
    "epx_recvmsg4",
    "epx_getpeername4",
    "epx_connect6",
    "epx_sendmsg6",
    "epx_recvmsg6",
    "epx_getpeername6",
];

#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    #[error("this binary was built without its eBPF object; build it with `cargo xtask build`")]
    NoObject,
    #[error("{path} is not a cgroup v2 directory (look for the cgroup2 line in /proc/mounts)")]
    NotCgroup2 { path: PathBuf },
    #[error("cannot prepare bpffs directory {path}")]
    Bpffs {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "pinned map {path} has {found}, this build expects {expected}; \
         run `ebpf-proxy cleanup` (drops all service state) or use another --bpffs"
    )]
    IncompatiblePin { path: PathBuf, found: String, expected: String },
    #[error("loading the eBPF object failed")]
    Load(#[source] aya::EbpfError),
    #[error("the eBPF object has no {kind} named {name}")]
    Missing { kind: &'static str, name: &'static str },
    #[error("the kernel rejected program {name}")]
    Program {
        name: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("map {name} does not have the expected layout")]
    MapLayout {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("cannot attach {program} to interface {interface}")]
    Interface {
        program: &'static str,
        interface: String,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("cannot read the service map")]
    ReadServices(#[source] MapError),
    #[error("this kernel lacks {feature}, added in {since}: {hint}")]
    MissingKernelFeature { feature: &'static str, since: &'static str, hint: &'static str },
    #[error("cannot write map {name}")]
    MapWrite {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("cannot read the addresses of interface {interface}")]
    InterfaceAddress {
        interface: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot read the kernel programs' log")]
    KernelLog(#[source] aya_log::Error),
    #[error("cannot wait for the kernel programs' log")]
    KernelLogPoll(#[source] io::Error),
    #[error("cannot {action} link {path}")]
    Link {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Sizes the operator may change (`--map-size-*`).
#[derive(Clone, Copy, Debug)]
pub struct MapCapacities {
    pub services: u32,
    pub backends: u32,
    pub rev_nat: u32,
    pub rev_sock: u32,
    pub ct: u32,
    pub affinity: u32,
    pub rev_sock6: u32,
    pub ct6: u32,
}

impl Default for MapCapacities {
    fn default() -> Self {
        Self {
            services: capacity::SERVICES4,
            backends: capacity::BACKENDS4,
            rev_nat: capacity::REV_NAT4,
            rev_sock: capacity::REV_SOCK4,
            ct: capacity::CT4,
            affinity: capacity::AFFINITY4,
            rev_sock6: capacity::REV_SOCK6,
            ct6: capacity::CT6,
        }
    }
}

impl MapCapacities {
    /// The capacity `size` stands for with these flags.
    pub fn entries(&self, size: layout::Size) -> u32 {
        use layout::Size;
        match size {
            Size::Fixed(entries) => entries,
            Size::Services => self.services,
            Size::Backends => self.backends,
            Size::RevNat => self.rev_nat,
            Size::RevSock => self.rev_sock,
            Size::Ct => self.ct,
            Size::Affinity => self.affinity,
            Size::RevSock6 => self.rev_sock6,
            Size::Ct6 => self.ct6,
        }
    }
}

fn map_type(kind: layout::Kind) -> MapType {
    match kind {
        layout::Kind::Hash => MapType::Hash,
        layout::Kind::Array => MapType::Array,
        layout::Kind::PerCpuArray => MapType::PerCpuArray,
        layout::Kind::LruHash => MapType::LruHash,
    }
}

fn statfs_type(path: &Path) -> io::Result<i64> {
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid NUL-terminated path and a properly sized out-parameter.
    if unsafe { libc::statfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stat.f_type as i64)
}

/// Makes sure `dir` exists on a bpffs, mounting bpffs at /sys/fs/bpf when nothing is mounted
/// there (a fresh node, or a reboot).
pub fn prepare_bpffs(dir: &Path) -> Result<(), DatapathError> {
    let err = |source| DatapathError::Bpffs { path: dir.to_owned(), source };
    let mount_point = Path::new("/sys/fs/bpf");
    if dir.starts_with(mount_point) && statfs_type(mount_point).map_err(err)? != BPF_FS_MAGIC {
        tracing::info!("bpffs is not mounted at /sys/fs/bpf, mounting it");
        let source = CString::new("bpf").expect("static");
        let target = CString::new("/sys/fs/bpf").expect("static");
        // SAFETY: plain mount(2) with static NUL-terminated strings.
        let rc = unsafe {
            libc::mount(source.as_ptr(), target.as_ptr(), source.as_ptr(), 0, std::ptr::null())
        };
        if rc != 0 {
            return Err(err(io::Error::last_os_error()));
        }
    }
    fs::create_dir_all(dir.join("links")).map_err(err)?;
    if statfs_type(dir).map_err(err)? != BPF_FS_MAGIC {
        return Err(err(io::Error::other("not on a bpf filesystem")));
    }
    Ok(())
}

/// Refuses to reuse a pinned map whose type, key, value or capacity differ from this build's.
///
/// aya (before 0.16) would silently reuse it, and the programs would read garbage.
fn check_pinned_layouts(dir: &Path, caps: &MapCapacities) -> Result<(), DatapathError> {
    for spec in &layout::MAPS {
        let path = dir.join(spec.name);
        if !path.exists() {
            continue;
        }
        let info = aya::maps::MapInfo::from_pin(&path)
            .map_err(|source| DatapathError::MapLayout { name: spec.name, source })?;
        let found_type = info.map_type().map_err(|source| DatapathError::MapLayout { name: spec.name, source })?;
        let describe = |t: MapType, k: u32, v: u32, n: u32| format!("type {t:?}, key {k} B, value {v} B, {n} entries");
        let found = describe(found_type, info.key_size(), info.value_size(), info.max_entries());
        let expected = describe(map_type(spec.kind), spec.key_size, spec.value_size, caps.entries(spec.size));
        if found != expected {
            return Err(DatapathError::IncompatiblePin { path, found, expected });
        }
    }
    Ok(())
}

/// The loaded datapath: programs attached, maps pinned.
pub struct Datapath {
    _ebpf: Ebpf,
    /// The service tables, for the reconciler (their only writer).
    pub maps: KernelMaps,
    /// Everything else the agent reads and trims, shared with its metrics and background jobs.
    pub flows: std::sync::Arc<FlowMaps>,
    /// Programs attached through a new link (or filter) rather than swapped into a pinned one:
    /// 0 when the agent took over a running datapath.
    pub attached_anew: usize,
}

impl Datapath {
    /// Prints what the kernel programs log (aya-log: only their rare failure paths, such as a
    /// failed rewrite or route lookup with the helper's return code, or no free SNAT port) as
    /// the agent's own log lines, with the programs' module as target, for as long as the agent
    /// runs. Call once every program is loaded: it takes the log ring buffer out of the object.
    /// Records written while no agent runs stay in the ring until it is full, and are lost with
    /// it when the programs are replaced.
    pub fn forward_kernel_log(&mut self) -> Result<(), DatapathError> {
        let logger = aya_log::EbpfLogger::init(&mut self._ebpf).map_err(DatapathError::KernelLog)?;
        // SAFETY: the descriptor is the ring buffer map's, owned by `logger`, which the AsyncFd
        // owns for its whole life; `as_raw_fd` always returns that one.
        let mut ring = unsafe { tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE) }
            .map_err(|error| DatapathError::KernelLogPoll(error.into_parts().1))?;
        tokio::spawn(async move {
            loop {
                match ring.readable_mut().await {
                    Ok(mut ready) => {
                        ready.get_inner_mut().flush();
                        ready.clear_ready();
                    }
                    Err(error) => {
                        tracing::warn!("stopped reading the kernel programs' log: {error}");
                        return;
                    }
                }
            }
        });
        Ok(())
    }
}

/// Loads the object (reusing pinned maps), attaches every program to `cgroup` through a pinned
/// link (or swaps the program inside the existing link), and hands out the maps.
///
/// `object` replaces the object built into the binary (`--bpf-object`); `None` uses the built-in one.
pub fn load(bpffs: &Path, cgroup: &Path, caps: &MapCapacities, object: Option<&[u8]>) -> Result<Datapath, DatapathError> {
    let object = object.unwrap_or(EBPF_OBJECT);
    if object.is_empty() {
        return Err(DatapathError::NoObject);
    }
    if statfs_type(cgroup).ok() != Some(CGROUP2_SUPER_MAGIC) {
        return Err(DatapathError::NotCgroup2 { path: cgroup.to_owned() });
    }
    prepare_bpffs(bpffs)?;
    check_pinned_layouts(bpffs, caps)?;

    let mut loader = EbpfLoader::new();
    loader.default_map_pin_directory(bpffs);
    for spec in layout::MAPS.iter().filter(|spec| !matches!(spec.size, layout::Size::Fixed(_))) {
        loader.map_max_entries(spec.name, caps.entries(spec.size));
    }
    let mut ebpf = loader.load(object).map_err(DatapathError::Load)?;

    let mut attached_anew = 0;
    let cgroup_dir = fs::File::open(cgroup).map_err(|source| DatapathError::Bpffs { path: cgroup.to_owned(), source })?;
    for name in SOCK_PROGRAMS {
        let program: &mut CgroupSockAddr = ebpf
            .program_mut(name)
            .ok_or(DatapathError::Missing { kind: "program", name })?
            .try_into()
            .map_err(|source| DatapathError::Program { name, source })?;
        program.load().map_err(|source| DatapathError::Program { name, source })?;
        let link_path = bpffs.join("links").join(name);
        let prog_fd = program.fd().map_err(|source| DatapathError::Program { name, source })?;
        let link_err = |action, source| DatapathError::Link { action, path: link_path.clone(), source };
        if link_path.exists() {
            // Atomic replacement: the hook is never without a program, so no connection made
            // during an upgrade misses translation.
            let old_tag = pinned_link_program_id(&link_path).and_then(program_tag);
            let link = bpf_obj_get(&link_path).map_err(|e| link_err("open pinned", e))?;
            bpf_link_update(link.as_fd(), prog_fd.as_fd()).map_err(|e| link_err("update", e))?;
            let new_tag = program.info().ok().map(|info| info.tag());
            if old_tag.is_some() && old_tag == new_tag {
                tracing::debug!(program = name, "replaced the program inside the pinned link (same code)");
            } else {
                // An upgrade: the log names both versions so an operator can tell what runs.
                tracing::info!(
                    program = name,
                    old_tag = %old_tag.map_or_else(|| "unknown".to_owned(), |t| format!("{t:016x}")),
                    new_tag = %new_tag.map_or_else(|| "unknown".to_owned(), |t| format!("{t:016x}")),
                    "upgraded the program inside the pinned link"
                );
            }
        } else {
            // bpf_link_create takes no flags for cgroups: links always coexist with other
            // programs on the same hook (`Single` maps to flags 0).
            let link_id = program
                .attach(&cgroup_dir, CgroupAttachMode::Single)
                .map_err(|source| DatapathError::Program { name, source })?;
            let link = program.take_link(link_id).map_err(|source| DatapathError::Program { name, source })?;
            let link = FdLink::try_from(link).map_err(|e| link_err("convert", io::Error::other(e.to_string())))?;
            link.pin(&link_path).map_err(|e| link_err("pin", io::Error::other(e.to_string())))?;
            tracing::info!(program = name, cgroup = %cgroup.display(), "attached and pinned");
            attached_anew += 1;
        }
    }

    let maps = KernelMaps::from_ebpf(&mut ebpf)?;
    let flows = std::sync::Arc::new(FlowMaps::open_pinned(bpffs)?);
    Ok(Datapath { _ebpf: ebpf, maps, flows, attached_anew })
}

/// `bpf(BPF_OBJ_GET)`: opens a pinned object. (aya 0.14's `PinnedLink::from_pin` opens a link
/// too, but its `FdLink` lends out no file descriptor, and aya has no public link update: the
/// in-place upgrade below needs both.)
fn bpf_obj_get(path: &Path) -> io::Result<OwnedFd> {
    const BPF_OBJ_GET: libc::c_long = 7;
    #[repr(C)]
    struct ObjGetAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
        path_fd: i32,
        pad: u32,
    }
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let attr = ObjGetAttr { pathname: c_path.as_ptr() as u64, bpf_fd: 0, file_flags: 0, path_fd: 0, pad: 0 };
    // SAFETY: attr is a valid, fully initialised bpf_attr prefix for BPF_OBJ_GET.
    let fd = unsafe {
        libc::syscall(libc::SYS_bpf, BPF_OBJ_GET, &attr as *const ObjGetAttr, std::mem::size_of::<ObjGetAttr>())
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new file descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The id of the program a pinned link runs (aya's pinned-link and link-info APIs), for the log.
fn pinned_link_program_id(path: &Path) -> Option<u32> {
    let link = FdLink::from(aya::programs::links::PinnedLink::from_pin(path).ok()?);
    link.info().ok().map(|info| info.program_id())
}

/// The tag (hash of the instructions) of a loaded program, by id.
fn program_tag(id: u32) -> Option<u64> {
    aya::programs::loaded_programs().flatten().find(|p| p.id() == id).map(|p| p.tag())
}

/// `bpf(BPF_LINK_UPDATE)`: swaps the program of a link in place.
fn bpf_link_update(link: BorrowedFd<'_>, program: BorrowedFd<'_>) -> io::Result<()> {
    const BPF_LINK_UPDATE: libc::c_long = 29;
    #[repr(C)]
    struct LinkUpdateAttr {
        link_fd: u32,
        new_prog_fd: u32,
        flags: u32,
        old_prog_fd: u32,
    }
    let attr = LinkUpdateAttr {
        link_fd: link.as_raw_fd() as u32,
        new_prog_fd: program.as_raw_fd() as u32,
        flags: 0,
        old_prog_fd: 0,
    };
    // SAFETY: attr is a valid, fully initialised bpf_attr prefix for BPF_LINK_UPDATE.
    let rc = unsafe {
        libc::syscall(libc::SYS_bpf, BPF_LINK_UPDATE, &attr as *const LinkUpdateAttr, std::mem::size_of::<LinkUpdateAttr>())
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The pinned service, backend and reverse-NAT maps of both families, and the Maglev tables.
pub struct KernelMaps {
    services: HashMap<MapData, ServiceKey4, ServiceValue4>,
    backends: HashMap<MapData, BackendId, Backend4>,
    rev_nats: HashMap<MapData, RevNatId, RevNat4>,
    services6: HashMap<MapData, ServiceKey6, ServiceValue4>,
    backends6: HashMap<MapData, BackendId, Backend6>,
    rev_nats6: HashMap<MapData, RevNatId, RevNat6>,
    maglev: HashMap<MapData, u32, MaglevTable4>,
}

fn typed<K: aya::Pod, V: aya::Pod>(map: Map, name: &'static str) -> Result<HashMap<MapData, K, V>, DatapathError> {
    HashMap::try_from(map).map_err(|source| DatapathError::MapLayout { name, source })
}

impl KernelMaps {
    /// Every entry of both service maps, in the maps' order, without copying them out.
    fn for_each_service(&self, mut f: impl FnMut(SvcKey, ServiceValue4)) -> Result<(), MapError> {
        let iterate = |name, e| MapError::from_io(name, "iterate", aya_io_error(e));
        for entry in self.services.iter() {
            let (key, value) = entry.map_err(|e| iterate(map_name::SERVICES4, e))?;
            f(SvcKey::V4(key), value);
        }
        for entry in self.services6.iter() {
            let (key, value) = entry.map_err(|e| iterate(map_name::SERVICES6, e))?;
            f(SvcKey::V6(key), value);
        }
        Ok(())
    }

    fn from_ebpf(ebpf: &mut Ebpf) -> Result<Self, DatapathError> {
        let mut take = |name: &'static str| ebpf.take_map(name).ok_or(DatapathError::Missing { kind: "map", name });
        Ok(Self {
            services: typed(take(map_name::SERVICES4)?, map_name::SERVICES4)?,
            backends: typed(take(map_name::BACKENDS4)?, map_name::BACKENDS4)?,
            rev_nats: typed(take(map_name::REV_NAT4)?, map_name::REV_NAT4)?,
            services6: typed(take(map_name::SERVICES6)?, map_name::SERVICES6)?,
            backends6: typed(take(map_name::BACKENDS6)?, map_name::BACKENDS6)?,
            rev_nats6: typed(take(map_name::REV_NAT6)?, map_name::REV_NAT6)?,
            maglev: typed(take(map_name::MAGLEV4)?, map_name::MAGLEV4)?,
        })
    }

    /// Opens the pinned maps without loading anything (for `dump`, and the agent-less checks).
    pub fn open_pinned(bpffs: &Path) -> Result<Self, DatapathError> {
        let open = |name| open_pinned_map(bpffs, name);
        Ok(Self {
            services: typed(open(map_name::SERVICES4)?, map_name::SERVICES4)?,
            backends: typed(open(map_name::BACKENDS4)?, map_name::BACKENDS4)?,
            rev_nats: typed(open(map_name::REV_NAT4)?, map_name::REV_NAT4)?,
            services6: typed(open(map_name::SERVICES6)?, map_name::SERVICES6)?,
            backends6: typed(open(map_name::BACKENDS6)?, map_name::BACKENDS6)?,
            rev_nats6: typed(open(map_name::REV_NAT6)?, map_name::REV_NAT6)?,
            maglev: typed(open(map_name::MAGLEV4)?, map_name::MAGLEV4)?,
        })
    }
}

/// Opens one pinned map by its ABI name.
fn open_pinned_map(bpffs: &Path, name: &'static str) -> Result<Map, DatapathError> {
    let data = MapData::from_pin(bpffs.join(name)).map_err(|source| DatapathError::MapLayout { name, source })?;
    Map::from_map_data(data).map_err(|source| DatapathError::MapLayout { name, source })
}

/// A pinned hash or LRU map, typed (key and value sizes checked).
fn open_pinned_hash<K: aya::Pod, V: aya::Pod>(bpffs: &Path, name: &'static str) -> Result<HashMap<MapData, K, V>, DatapathError> {
    HashMap::try_from(open_pinned_map(bpffs, name)?).map_err(|source| DatapathError::MapLayout { name, source })
}

fn dump_map<K: aya::Pod, V: aya::Pod>(
    map: &HashMap<MapData, K, V>,
    name: &'static str,
) -> Result<Vec<(K, V)>, MapError> {
    map.iter()
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| MapError::from_io(name, "iterate", aya_io_error(e)))
}

fn aya_io_error(error: aya::maps::MapError) -> io::Error {
    match error {
        aya::maps::MapError::SyscallError(syscall) => syscall.io_error,
        other => io::Error::other(other.to_string()),
    }
}

fn write_result(name: &'static str, op: &'static str, result: Result<(), aya::maps::MapError>) -> Result<(), MapError> {
    match result {
        Ok(()) => Ok(()),
        // Deleting what is already gone is success: every reconciler step is idempotent.
        Err(aya::maps::MapError::KeyNotFound) if op == "delete" => Ok(()),
        Err(e) => {
            let io = aya_io_error(e);
            if op == "delete" && io.raw_os_error() == Some(libc::ENOENT) {
                return Ok(());
            }
            Err(MapError::from_io(name, op, io))
        }
    }
}

impl LbMaps for KernelMaps {
    fn services(&self) -> Result<Vec<(SvcKey, ServiceValue4)>, MapError> {
        let mut entries = Vec::new();
        self.for_each_service(|key, value| entries.push((key, value)))?;
        Ok(entries)
    }
    fn backends(&self) -> Result<Vec<(BackendId, BackendValue)>, MapError> {
        let v4 = dump_map(&self.backends, map_name::BACKENDS4)?.into_iter().map(|(k, v)| (k, BackendValue::V4(v)));
        let v6 = dump_map(&self.backends6, map_name::BACKENDS6)?.into_iter().map(|(k, v)| (k, BackendValue::V6(v)));
        Ok(v4.chain(v6).collect())
    }
    fn rev_nats(&self) -> Result<Vec<(RevNatId, RevNatValue)>, MapError> {
        let v4 = dump_map(&self.rev_nats, map_name::REV_NAT4)?.into_iter().map(|(k, v)| (k, RevNatValue::V4(v)));
        let v6 = dump_map(&self.rev_nats6, map_name::REV_NAT6)?.into_iter().map(|(k, v)| (k, RevNatValue::V6(v)));
        Ok(v4.chain(v6).collect())
    }
    fn put_service(&mut self, key: &SvcKey, value: &ServiceValue4) -> Result<(), MapError> {
        match key {
            SvcKey::V4(k) => write_result(map_name::SERVICES4, "update", self.services.insert(k, value, 0)),
            SvcKey::V6(k) => write_result(map_name::SERVICES6, "update", self.services6.insert(k, value, 0)),
        }
    }
    fn delete_service(&mut self, key: &SvcKey) -> Result<(), MapError> {
        match key {
            SvcKey::V4(k) => write_result(map_name::SERVICES4, "delete", self.services.remove(k)),
            SvcKey::V6(k) => write_result(map_name::SERVICES6, "delete", self.services6.remove(k)),
        }
    }
    fn put_backend(&mut self, id: BackendId, value: &BackendValue) -> Result<(), MapError> {
        match value {
            BackendValue::V4(v) => write_result(map_name::BACKENDS4, "update", self.backends.insert(id, v, 0)),
            BackendValue::V6(v) => write_result(map_name::BACKENDS6, "update", self.backends6.insert(id, v, 0)),
        }
    }
    fn delete_backend(&mut self, id: BackendId, ipv6: bool) -> Result<(), MapError> {
        if ipv6 {
            write_result(map_name::BACKENDS6, "delete", self.backends6.remove(&id))
        } else {
            write_result(map_name::BACKENDS4, "delete", self.backends.remove(&id))
        }
    }
    fn put_rev_nat(&mut self, id: RevNatId, value: &RevNatValue) -> Result<(), MapError> {
        match value {
            RevNatValue::V4(v) => write_result(map_name::REV_NAT4, "update", self.rev_nats.insert(id, v, 0)),
            RevNatValue::V6(v) => write_result(map_name::REV_NAT6, "update", self.rev_nats6.insert(id, v, 0)),
        }
    }
    fn delete_rev_nat(&mut self, id: RevNatId, ipv6: bool) -> Result<(), MapError> {
        if ipv6 {
            write_result(map_name::REV_NAT6, "delete", self.rev_nats6.remove(&id))
        } else {
            write_result(map_name::REV_NAT4, "delete", self.rev_nats.remove(&id))
        }
    }
    fn maglev_tables(&self) -> Result<Vec<(RevNatId, Vec<BackendId>)>, MapError> {
        let tables = dump_map(&self.maglev, map_name::MAGLEV4)?;
        // A key above u16 was not written by any agent: skipped (and never marked in a slot 0).
        Ok(tables
            .into_iter()
            .filter_map(|(id, table)| Some((RevNatId::try_from(id).ok()?, table.backend_ids.to_vec())))
            .collect())
    }
    fn put_maglev(&mut self, id: RevNatId, table: &[BackendId]) -> Result<(), MapError> {
        let backend_ids = table.try_into().map_err(|_| MapError::Syscall {
            map: map_name::MAGLEV4,
            op: "update",
            source: io::Error::other(format!("a table needs {} slots, not {}", proxy_abi::maglev::TABLE_SIZE, table.len())),
        })?;
        write_result(map_name::MAGLEV4, "update", self.maglev.insert(u32::from(id), MaglevTable4 { backend_ids }, 0))
    }
    fn delete_maglev(&mut self, id: RevNatId) -> Result<(), MapError> {
        write_result(map_name::MAGLEV4, "delete", self.maglev.remove(&u32::from(id)))
    }
}

/// A conntrack value of the layout before `epx_ct4_v2` (the state inline, no sequence number).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtEntry4V1 {
    pub backend_addr_be: u32,
    pub frontend_addr_be: u32,
    pub client_addr_be: u32,
    pub snat_addr_be: u32,
    pub backend_port_be: u16,
    pub frontend_port_be: u16,
    pub client_port_be: u16,
    pub snat_port_be: u16,
    pub backend_id: u32,
    pub rev_nat_id: u16,
    pub nat: u8,
    pub tcp_seen: u8,
    pub last_seen_ns: u64,
}
const _: () = assert!(std::mem::size_of::<CtEntry4V1>() == 40);

/// [`CtEntry4V1`] for IPv6 (`epx_ct6_v1`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtEntry6V1 {
    pub backend_addr: [u32; 4],
    pub frontend_addr: [u32; 4],
    pub client_addr: [u32; 4],
    pub snat_addr: [u32; 4],
    pub backend_port_be: u16,
    pub frontend_port_be: u16,
    pub client_port_be: u16,
    pub snat_port_be: u16,
    pub backend_id: u32,
    pub rev_nat_id: u16,
    pub nat: u8,
    pub tcp_seen: u8,
    pub last_seen_ns: u64,
}
const _: () = assert!(std::mem::size_of::<CtEntry6V1>() == 88);

// SAFETY: repr(C) plain integers without implicit padding (sizes asserted above).
unsafe impl aya::Pod for CtEntry4V1 {}
unsafe impl aya::Pod for CtEntry6V1 {}

/// The state of a v1 entry in the v2 layout: the TCP bits mean the same; the next sequence
/// number is not known (0), so the first RST of either side is believed, as before.
fn state_of_v1(tcp_seen: u8, last_seen_ns: u64) -> proxy_abi::CtState {
    proxy_abi::CtState { last_seen_ns, seq_next: 0, tcp_seen, pad: [0; 3] }
}

impl From<CtEntry4V1> for CtEntry4 {
    fn from(v1: CtEntry4V1) -> Self {
        Self {
            backend_addr_be: v1.backend_addr_be,
            frontend_addr_be: v1.frontend_addr_be,
            client_addr_be: v1.client_addr_be,
            snat_addr_be: v1.snat_addr_be,
            backend_port_be: v1.backend_port_be,
            frontend_port_be: v1.frontend_port_be,
            client_port_be: v1.client_port_be,
            snat_port_be: v1.snat_port_be,
            backend_id: v1.backend_id,
            rev_nat_id: v1.rev_nat_id,
            nat: v1.nat,
            pad: 0,
            state: state_of_v1(v1.tcp_seen, v1.last_seen_ns),
        }
    }
}

impl From<CtEntry6V1> for CtEntry6 {
    fn from(v1: CtEntry6V1) -> Self {
        Self {
            backend_addr: v1.backend_addr,
            frontend_addr: v1.frontend_addr,
            client_addr: v1.client_addr,
            snat_addr: v1.snat_addr,
            backend_port_be: v1.backend_port_be,
            frontend_port_be: v1.frontend_port_be,
            client_port_be: v1.client_port_be,
            snat_port_be: v1.snat_port_be,
            backend_id: v1.backend_id,
            rev_nat_id: v1.rev_nat_id,
            nat: v1.nat,
            pad: 0,
            state: state_of_v1(v1.tcp_seen, v1.last_seen_ns),
        }
    }
}

/// Copies the flows an agent of the previous layout tracked (`epx_ct4_v1`, `epx_ct6_v1`) into
/// this build's conntrack maps, so that an upgrade keeps established connections from outside
/// on their backends and SNAT ports. Called after the new maps exist and before the packet
/// programs are swapped (flows the old programs start in between are not carried over); the old
/// pins go afterwards ([`remove_obsolete_pins`]). Returns how many entries it copied.
pub fn carry_over_v1_conntrack(bpffs: &Path) -> Result<usize, DatapathError> {
    let mut copied = 0;
    if bpffs.join("epx_ct4_v1").exists() {
        let old = open_pinned_hash::<CtKey4, CtEntry4V1>(bpffs, "epx_ct4_v1")?;
        let mut new = open_pinned_hash::<CtKey4, CtEntry4>(bpffs, map_name::CT4)?;
        copied += copy_converted(&old, &mut new, map_name::CT4, |k, v| Some((k, v.into())))?;
    }
    if bpffs.join("epx_ct6_v1").exists() {
        let old = open_pinned_hash::<CtKey6, CtEntry6V1>(bpffs, "epx_ct6_v1")?;
        let mut new = open_pinned_hash::<CtKey6, CtEntry6>(bpffs, map_name::CT6)?;
        copied += copy_converted(&old, &mut new, map_name::CT6, |k, v| Some((k, v.into())))?;
    }
    Ok(copied)
}

/// Copies the entries of a map of an earlier layout into this build's, each through `convert`
/// (`None`: not carried over); returns how many it copied.
fn copy_converted<OldK: aya::Pod, Old: aya::Pod, K: aya::Pod, New: aya::Pod>(
    old: &HashMap<MapData, OldK, Old>,
    new: &mut HashMap<MapData, K, New>,
    name: &'static str,
    convert: impl Fn(OldK, Old) -> Option<(K, New)>,
) -> Result<usize, DatapathError> {
    let mut copied = 0;
    for (key, value) in old.iter().filter_map(Result::ok).filter_map(|(k, v)| convert(k, v)) {
        // BPF_NOEXIST: what the new programs already wrote (a flow they track, a client they
        // placed) keeps its new entry.
        match new.insert(key, value, BPF_NOEXIST) {
            Ok(()) => copied += 1,
            Err(aya::maps::MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {}
            Err(source) => return Err(DatapathError::MapWrite { name, source }),
        }
    }
    Ok(copied)
}

/// A session-affinity key of the layout before `epx_aff4_v2` (the client in 64 bits).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AffinityKey4V1 {
    pub client: u64,
    pub rev_nat_id: u16,
    pub kind: u8,
    pub pad: [u8; 5],
}
const _: () = assert!(std::mem::size_of::<AffinityKey4V1>() == 16);
// SAFETY: repr(C) plain integers with explicit padding (size asserted above).
unsafe impl aya::Pod for AffinityKey4V1 {}

impl AffinityKey4V1 {
    /// The same client in the v2 layout; `None` for an IPv6 client, which v1 folded to 64 bits
    /// (that client picks a backend again at its next connection).
    fn to_v2(self) -> Option<proxy_abi::AffinityKey4> {
        use proxy_abi::affinity::{ip4_client, netns_client, CLIENT_IP4, CLIENT_NETNS};
        let client = match self.kind {
            CLIENT_NETNS => netns_client(self.client),
            CLIENT_IP4 => ip4_client(self.client as u32),
            _ => return None,
        };
        Some(proxy_abi::AffinityKey4 { client, rev_nat_id: self.rev_nat_id, kind: self.kind, pad: [0; 5] })
    }
}

/// Copies the session-affinity entries of the previous layout (`epx_aff4_v1`) into this build's
/// map, so that an upgrade keeps pods and IPv4 clients on their backends; IPv6 clients' entries
/// cannot be unfolded and are left behind. Called, as [`carry_over_v1_conntrack`], before the
/// old map is unpinned; an entry the new programs already wrote is kept. Returns how many it
/// copied.
pub fn carry_over_v1_affinity(bpffs: &Path) -> Result<usize, DatapathError> {
    const OLD: &str = "epx_aff4_v1";
    if !bpffs.join(OLD).exists() {
        return Ok(0);
    }
    let old = open_pinned_hash::<AffinityKey4V1, proxy_abi::AffinityValue4>(bpffs, OLD)?;
    let mut new = open_pinned_hash::<proxy_abi::AffinityKey4, proxy_abi::AffinityValue4>(bpffs, map_name::AFFINITY4)?;
    copy_converted(&old, &mut new, map_name::AFFINITY4, |key, value| Some((key.to_v2()?, value)))
}

/// `BPF_NOEXIST`: insert only where the key is not there yet.
const BPF_NOEXIST: u64 = 1;

/// Unpins the maps of earlier layouts (`map_name::OBSOLETE`) that no program of this build
/// uses; returns the paths removed. Called once this build's programs are attached, so the old
/// programs (the only users of those maps) are gone.
pub fn remove_obsolete_pins(bpffs: &Path) -> Vec<PathBuf> {
    map_name::OBSOLETE
        .iter()
        .map(|name| bpffs.join(name))
        .filter(|path| fs::remove_file(path).is_ok())
        .collect()
}

/// Detaches (by unpinning the links) and unpins everything under `bpffs`. Returns what it removed.
pub fn cleanup(bpffs: &Path) -> io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let links = bpffs.join("links");
    if links.is_dir() {
        for entry in fs::read_dir(&links)? {
            let path = entry?.path();
            // A classic tc filter is not held by its pin: remove it from its interface first.
            if !tc::detach_pin(&path)? {
                fs::remove_file(&path)?;
            }
            removed.push(path);
        }
        fs::remove_dir(&links)?;
    }
    if bpffs.is_dir() {
        for entry in fs::read_dir(bpffs)? {
            let path = entry?.path();
            fs::remove_file(&path)?;
            removed.push(path);
        }
        fs::remove_dir(bpffs)?;
    }
    Ok(removed)
}

#[cfg(test)]
mod layout_tests {
    use super::*;

    /// The kernel object built into this binary declares exactly the maps of the ABI's table,
    /// each with its type, key and value size, default capacity and flags: `maps.rs` (literals,
    /// as `#[map]` wants them) cannot drift from what the agent checks pins against.
    #[test]
    fn the_kernel_object_declares_the_maps_of_the_abi_table() {
        assert!(!EBPF_OBJECT.is_empty(), "no eBPF object is built into this test binary: run `cargo xtask build` first (`cargo xtask test` does)");
        let object = aya_obj::Object::parse(EBPF_OBJECT).expect("parsing the built-in eBPF object");
        // The pinned ones: the programs' private per-CPU scratch space is no part of the ABI.
        let ours: std::collections::BTreeSet<&str> = object
            .maps
            .iter()
            .filter(|(_, map)| map.pinning() == aya_obj::maps::PinningType::ByName)
            .map(|(name, _)| name.as_str())
            .collect();
        let table: std::collections::BTreeSet<&str> = layout::MAPS.iter().map(|spec| spec.name).collect();
        assert_eq!(ours, table, "pinned maps of the kernel object (left) and proxy_abi::layout::MAPS (right)");
        let names: Vec<&str> = layout::MAPS.iter().map(|spec| spec.name).collect();
        assert_eq!(names, map_name::ALL, "the table is in the order of map_name::ALL");
        for spec in &layout::MAPS {
            let map = &object.maps[spec.name];
            let declared = (map.map_type(), map.key_size(), map.value_size(), map.max_entries(), map.map_flags());
            let expected = (spec.kind as u32, spec.key_size, spec.value_size, spec.size.default_entries(), spec.flags);
            assert_eq!(declared, expected, "{}: (type, key, value, entries, flags) in the object and in the table", spec.name);
        }
    }
}
