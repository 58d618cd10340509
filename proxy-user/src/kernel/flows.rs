//! The datapath's maps besides the service tables, opened once into [`FlowMaps`]: the per-CPU
//! counters (metrics), the flow tables (conntrack, session affinity, unconnected UDP sockets'
//! backends: purged and garbage-collected in the background), the settings and the interfaces'
//! SNAT source addresses. The agent shares one handle with its metrics collector and its
//! background jobs; `dump` opens one of its own.

use std::collections::{BTreeMap, HashSet};
use std::ffi::CString;
use std::io;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Mutex;

use aya::maps::{Array, HashMap, MapData, PerCpuArray};
use proxy_abi::{
    map_name, AffinityKey4, AffinityValue4, BackendId, CtEntry4, CtEntry6, CtKey4, CtKey6, DatapathConfig, IfAddr4, IfAddr6, RevNatId,
    RevSock4, RevSock6, RevSockKey4, RevSockKey6, SockFlow, SockFlowKey4, SockFlowKey6,
};

use super::{open_pinned_hash, open_pinned_map, DatapathError, KernelMaps};
use crate::lbmap::{MapError, SvcKey};

/// One handle on the pinned maps the agent reads and trims besides the service tables (which
/// the reconciler owns). Each group has its own lock, so a scrape never waits for a purge.
pub struct FlowMaps {
    counters: PerCpuArray<MapData, u64>,
    config: Mutex<Array<MapData, DatapathConfig>>,
    interface_addresses: Mutex<InterfaceAddresses>,
    tables: Mutex<FlowTables>,
}

/// ifindex -> the interface's SNAT source address, per family.
struct InterfaceAddresses {
    v4: HashMap<MapData, u32, IfAddr4>,
    v6: HashMap<MapData, u32, IfAddr6>,
}

struct FlowTables {
    ct4: HashMap<MapData, CtKey4, CtEntry4>,
    ct6: HashMap<MapData, CtKey6, CtEntry6>,
    affinity: HashMap<MapData, AffinityKey4, AffinityValue4>,
    sock4: HashMap<MapData, SockFlowKey4, SockFlow>,
    sock6: HashMap<MapData, SockFlowKey6, SockFlow>,
    rev_sock4: HashMap<MapData, RevSockKey4, RevSock4>,
    rev_sock6: HashMap<MapData, RevSockKey6, RevSock6>,
    /// A reading handle on the service tables: which flows still point at a live backend.
    services: KernelMaps,
}

/// What [`FlowMaps::purge_stale_flows`] deleted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PurgedFlows {
    pub affinity: usize,
    pub udp_conntrack: usize,
    /// Unconnected UDP sockets' remembered backends (`epx_sflow*`).
    pub udp_sockets: usize,
}

/// What one conntrack garbage collection did.
#[derive(Debug, Default, Clone, Copy)]
pub struct ConntrackGc {
    pub scanned: usize,
    pub removed: usize,
}

impl FlowMaps {
    /// Opens the pinned maps under `bpffs` (once the datapath is loaded, or for `dump`).
    pub fn open_pinned(bpffs: &Path) -> Result<Self, DatapathError> {
        let counters = PerCpuArray::try_from(open_pinned_map(bpffs, map_name::STATS)?)
            .map_err(|source| DatapathError::MapLayout { name: map_name::STATS, source })?;
        let config = Array::try_from(open_pinned_map(bpffs, map_name::CONFIG)?)
            .map_err(|source| DatapathError::MapLayout { name: map_name::CONFIG, source })?;
        let interface_addresses =
            InterfaceAddresses { v4: open_pinned_hash(bpffs, map_name::IFADDR4)?, v6: open_pinned_hash(bpffs, map_name::IFADDR6)? };
        let tables = FlowTables {
            ct4: open_pinned_hash(bpffs, map_name::CT4)?,
            ct6: open_pinned_hash(bpffs, map_name::CT6)?,
            affinity: open_pinned_hash(bpffs, map_name::AFFINITY4)?,
            sock4: open_pinned_hash(bpffs, map_name::SOCK_FLOW4)?,
            sock6: open_pinned_hash(bpffs, map_name::SOCK_FLOW6)?,
            rev_sock4: open_pinned_hash(bpffs, map_name::REV_SOCK4)?,
            rev_sock6: open_pinned_hash(bpffs, map_name::REV_SOCK6)?,
            services: KernelMaps::open_pinned(bpffs)?,
        };
        Ok(Self { counters, config: Mutex::new(config), interface_addresses: Mutex::new(interface_addresses), tables: Mutex::new(tables) })
    }

    fn tables(&self) -> std::sync::MutexGuard<'_, FlowTables> {
        self.tables.lock().expect("flow tables lock")
    }

    /// Per-CPU counters summed over CPUs, by `proxy_abi::stat` index.
    pub fn counters(&self) -> Result<Vec<u64>, DatapathError> {
        let name = map_name::STATS;
        (0..proxy_abi::stat::COUNT)
            .map(|i| self.counters.get(&i, 0).map(|values| values.iter().sum()).map_err(|source| DatapathError::MapLayout { name, source }))
            .collect()
    }

    /// Writes the agent's settings for the kernel programs (`epx_cfg_v1`); programs read them
    /// per packet, so a change applies to the next new flow.
    pub fn write_config(&self, config: &DatapathConfig) -> Result<(), DatapathError> {
        let mut array = self.config.lock().expect("config lock");
        array.set(0, config, 0).map_err(|source| DatapathError::MapWrite { name: map_name::CONFIG, source })
    }

    /// Number of live entries in the socket reverse-translation LRUs (both families).
    pub fn rev_sock_entries(&self) -> usize {
        let tables = self.tables();
        tables.rev_sock4.keys().filter(Result::is_ok).count() + tables.rev_sock6.keys().filter(Result::is_ok).count()
    }

    /// The IPv4 conntrack entries of the packet-level datapath (forward and reply).
    pub fn conntrack_entries4(&self) -> Vec<(CtKey4, CtEntry4)> {
        // Entries may be evicted while iterating (LRU): skip what vanished under us.
        self.tables().ct4.iter().filter_map(Result::ok).collect()
    }

    /// The IPv6 conntrack entries (forward and reply).
    pub fn conntrack_entries6(&self) -> Vec<(CtKey6, CtEntry6)> {
        self.tables().ct6.iter().filter_map(Result::ok).collect()
    }

    /// The session-affinity entries.
    pub fn affinity_entries(&self) -> Vec<(AffinityKey4, AffinityValue4)> {
        self.tables().affinity.iter().filter_map(Result::ok).collect()
    }

    /// Deletes the session-affinity entries, the UDP conntrack entries and the unconnected UDP
    /// sockets' remembered backends that point at a backend which is no longer one of its
    /// frontend's backends, so that those clients and flows pick a live backend at their next
    /// packet. What is live is read from the pinned service map itself. TCP conntrack is kept:
    /// an established TCP connection to a removed (terminating) backend goes on until it ends,
    /// as with kube-proxy, which flushes conntrack for UDP only.
    pub fn purge_stale_flows(&self) -> Result<PurgedFlows, DatapathError> {
        let mut guard = self.tables();
        let FlowTables { ct4, ct6, affinity, sock4, sock6, services, .. } = &mut *guard;
        // The flows that may be stale, each with the (reverse-NAT id, backend id) it points at:
        // usually few, and then the service map (at 30 000 Services, 660 000 entries) is not read.
        let udp = proxy_abi::IPPROTO_UDP;
        let affinity_pair = |k: &AffinityKey4, v: &AffinityValue4| Some((k.rev_nat_id, v.backend_id));
        let udp_pair4 = |k: &CtKey4, v: &CtEntry4| (k.proto == udp).then_some((v.rev_nat_id, v.backend_id));
        let udp_pair6 = |k: &CtKey6, v: &CtEntry6| (k.proto == udp).then_some((v.rev_nat_id, v.backend_id));
        fn sock_pair<K>(_: &K, v: &SockFlow) -> Option<(RevNatId, BackendId)> {
            Some((v.rev_nat_id, v.backend_id))
        }
        let affinity_flows = flows(affinity, affinity_pair);
        let udp4 = flows(ct4, udp_pair4);
        let udp6 = flows(ct6, udp_pair6);
        let sock_flows4 = flows(sock4, sock_pair);
        let sock_flows6 = flows(sock6, sock_pair);
        let pointed: HashSet<(RevNatId, BackendId)> = affinity_flows
            .iter()
            .map(|f| f.1)
            .chain(sock_flows4.iter().map(|f| f.1))
            .chain(sock_flows6.iter().map(|f| f.1))
            .chain(udp4.iter().map(|f| f.1))
            .chain(udp6.iter().map(|f| f.1))
            .collect();
        if pointed.is_empty() {
            return Ok(PurgedFlows::default());
        }
        let live = live_pairs(services, &pointed).map_err(DatapathError::ReadServices)?;
        Ok(PurgedFlows {
            affinity: remove_stale(affinity, &affinity_flows, &live, affinity_pair),
            udp_conntrack: remove_stale(ct4, &udp4, &live, udp_pair4) + remove_stale(ct6, &udp6, &live, udp_pair6),
            udp_sockets: remove_stale(sock4, &sock_flows4, &live, sock_pair) + remove_stale(sock6, &sock_flows6, &live, sock_pair),
        })
    }

    /// Deletes the conntrack entries of both families that are past their timeout
    /// (`ct::is_expired`, the rule the kernel programs apply too): the kernel already treats
    /// them as gone, this keeps the LRU and `dump` to live flows. Costs two map syscalls per
    /// entry held and one per entry removed (aya 0.14 has no batch lookup).
    pub fn remove_expired_flows(&self) -> ConntrackGc {
        let now = crate::dump::monotonic_now_ns();
        let mut tables = self.tables();
        let (scanned4, removed4) = remove_where_counting(&mut tables.ct4, |k, v| proxy_abi::ct::is_expired(&v.state, k.proto, now));
        let (scanned6, removed6) = remove_where_counting(&mut tables.ct6, |k, v| proxy_abi::ct::is_expired(&v.state, k.proto, now));
        ConntrackGc { scanned: scanned4 + scanned6, removed: removed4 + removed6 }
    }

    /// Writes each interface's IPv4 and IPv6 address (the lowest of each family, if it has
    /// several; IPv6 link-local ones left out) into `epx_ifaddr4_v1` and `epx_ifaddr6_v1`: the
    /// SNAT source for externalIP/LoadBalancer traffic arriving there. Entries of other
    /// interfaces are removed. Called when the programs are attached, and again whenever the
    /// node's addresses change.
    pub fn record_interface_addresses(&self, interfaces: &[String]) -> Result<(), DatapathError> {
        let addresses = crate::netif::interface_addresses()
            .map_err(|source| DatapathError::InterfaceAddress { interface: interfaces.join(","), source })?;
        let mut indexed = Vec::new();
        for interface in interfaces {
            let c_name = CString::new(interface.as_str())
                .map_err(|e| DatapathError::InterfaceAddress { interface: interface.clone(), source: io::Error::other(e) })?;
            // SAFETY: if_nametoindex reads a NUL-terminated string.
            let ifindex = unsafe { libc::if_nametoindex(c_name.as_ptr()) };
            if ifindex != 0 {
                let own = addresses.iter().filter(|(owner, _)| owner == interface).map(|(_, addr)| *addr);
                indexed.push((ifindex, own.collect::<Vec<IpAddr>>()));
            }
        }
        let mut maps = self.interface_addresses.lock().expect("interface addresses lock");
        write_interface_addresses(&mut maps.v4, map_name::IFADDR4, &indexed, |addr| match addr {
            IpAddr::V4(v4) => Some(IfAddr4 { addr_be: u32::from(v4).to_be() }),
            IpAddr::V6(_) => None,
        })?;
        write_interface_addresses(&mut maps.v6, map_name::IFADDR6, &indexed, |addr| match addr {
            IpAddr::V6(v6) if crate::netif::is_node_address(addr) => Some(IfAddr6 { addr: crate::reconcile::ipv6_words(v6) }),
            _ => None,
        })
    }
}

/// One family's map of [`FlowMaps::record_interface_addresses`]: ifindex -> the lowest address
/// `convert` accepts.
fn write_interface_addresses<V: aya::Pod + PartialEq>(
    map: &mut HashMap<MapData, u32, V>,
    name: &'static str,
    interfaces: &[(u32, Vec<IpAddr>)],
    convert: impl Fn(IpAddr) -> Option<V>,
) -> Result<(), DatapathError> {
    let mut wanted = BTreeMap::new();
    for (ifindex, addresses) in interfaces {
        let mut own: Vec<IpAddr> = addresses.iter().copied().filter(|a| convert(*a).is_some()).collect();
        own.sort();
        if let Some((addr, value)) = own.first().and_then(|a| Some((*a, convert(*a)?))) {
            wanted.insert(*ifindex, (addr, value));
        }
    }
    let write_err = |source| DatapathError::MapWrite { name, source };
    let stale: Vec<u32> = map.keys().filter_map(Result::ok).filter(|ifindex| !wanted.contains_key(ifindex)).collect();
    for ifindex in stale {
        map.remove(&ifindex).map_err(write_err)?;
    }
    for (ifindex, (addr, value)) in wanted {
        if map.get(&ifindex, 0).ok() != Some(value) {
            map.insert(ifindex, value, 0).map_err(write_err)?;
            tracing::info!(ifindex, %addr, "SNAT source address of the interface recorded");
        }
    }
    Ok(())
}

/// The entries of a flow map `pair` picks, with the (reverse-NAT id, backend id) each points at.
fn flows<K: aya::Pod, V: aya::Pod>(
    map: &HashMap<MapData, K, V>,
    pair: impl Fn(&K, &V) -> Option<(RevNatId, BackendId)>,
) -> Vec<(K, (RevNatId, BackendId))> {
    map.iter().filter_map(Result::ok).filter_map(|(k, v)| Some((k, pair(&k, &v)?))).collect()
}

/// Removes the flows whose pair is not live; returns how many it removed (one the kernel
/// evicted or expired meanwhile is not counted, and is fine either way). A key the kernel gave
/// to another flow since `flows` was read keeps it ([`take_if`]).
fn remove_stale<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    flows: &[(K, (RevNatId, BackendId))],
    live: &HashSet<(RevNatId, BackendId)>,
    pair: impl Fn(&K, &V) -> Option<(RevNatId, BackendId)>,
) -> usize {
    flows.iter().filter(|(key, read)| !live.contains(read) && take_if(map, key, |now| pair(key, now) == Some(*read))).count()
}

/// Which of `pointed`'s (reverse-NAT id, backend id) pairs the service map holds: a slot's
/// frontend is its slot-0 entry. Streams the map twice instead of copying it.
fn live_pairs(maps: &KernelMaps, pointed: &HashSet<(RevNatId, BackendId)>) -> Result<HashSet<(RevNatId, BackendId)>, MapError> {
    let rev_nat_ids: HashSet<RevNatId> = pointed.iter().map(|(id, _)| *id).collect();
    let mut frontends: std::collections::HashMap<SvcKey, RevNatId> = std::collections::HashMap::new();
    maps.for_each_service(|key, value| {
        if key.slot() == 0 && rev_nat_ids.contains(&value.rev_nat_id) {
            frontends.insert(key, value.rev_nat_id);
        }
    })?;
    let mut live = HashSet::new();
    maps.for_each_service(|key, value| {
        if key.slot() != 0 {
            if let Some(rev_nat_id) = frontends.get(&key.with_slot(0)) {
                if pointed.contains(&(*rev_nat_id, value.backend_id)) {
                    live.insert((*rev_nat_id, value.backend_id));
                }
            }
        }
    })?;
    Ok(live)
}

/// Removes the entries `stale` picks from a live map: (entries looked at, entries removed). An
/// entry the kernel evicted or expired meanwhile is not counted, and is fine either way; one it
/// replaced meanwhile is judged again ([`take_if`]).
fn remove_where_counting<K: aya::Pod, V: aya::Pod>(map: &mut HashMap<MapData, K, V>, stale: impl Fn(&K, &V) -> bool) -> (usize, usize) {
    let mut scanned = 0;
    let keys: Vec<K> = map.iter().filter_map(Result::ok).inspect(|_| scanned += 1).filter(|(k, v)| stale(k, v)).map(|(k, _)| k).collect();
    (scanned, remove_if_still(map, &keys, stale))
}

/// Removes each of `keys` whose entry `stale` still picks when it is removed: the second half of
/// a scan-then-remove over a map the kernel writes meanwhile. How many it removed.
fn remove_if_still<K: aya::Pod, V: aya::Pod>(map: &mut HashMap<MapData, K, V>, keys: &[K], stale: impl Fn(&K, &V) -> bool) -> usize {
    keys.iter().filter(|key| take_if(map, key, |value| stale(key, value))).count()
}

/// Removes `key` if its entry is still one `stale` picks, and says whether it did. Between a
/// scan and its removals the kernel may give a key to a new flow: a client port used again, an
/// expired reply entry whose SNAT port a new connection claimed (`ct::claim` deletes the old
/// holder and inserts its own). Removing that key blindly deletes the new flow's entry, and the
/// connection hangs until it times out (the backend's SYN-ACK finds no reply entry): one
/// connection in 20 000 in the load test. So the entry is read and deleted in one step
/// (`BPF_MAP_LOOKUP_AND_DELETE_ELEM`), and what turns out not to be stale is put back unless the
/// kernel wrote the key again in that instant (`BPF_NOEXIST`: its entry is newer).
fn take_if<K: aya::Pod, V: aya::Pod>(map: &mut HashMap<MapData, K, V>, key: &K, stale: impl Fn(&V) -> bool) -> bool {
    use aya::maps::IterableMap;
    use std::os::fd::AsFd;
    let taken = match lookup_and_delete::<K, V>(map.map().fd().as_fd(), key) {
        Ok(Some(value)) => value,
        Ok(None) => return false,
        // A kernel without the command for hash maps (before 5.14): look, then remove.
        Err(_) => return map.get(key, 0).is_ok_and(|value| stale(&value)) && map.remove(key).is_ok(),
    };
    if stale(&taken) {
        return true;
    }
    let _ = map.insert(key, taken, super::BPF_NOEXIST);
    false
}

/// `bpf(BPF_MAP_LOOKUP_AND_DELETE_ELEM)` on a hash map: the entry at `key`, deleted; None when
/// there is none. (aya 0.14 has the command for queues and stacks only.)
fn lookup_and_delete<K: aya::Pod, V: aya::Pod>(map: std::os::fd::BorrowedFd<'_>, key: &K) -> io::Result<Option<V>> {
    use std::os::fd::AsRawFd;
    const BPF_MAP_LOOKUP_AND_DELETE_ELEM: libc::c_long = 21;
    #[repr(C)]
    struct MapElemAttr {
        map_fd: u32,
        pad: u32,
        key: u64,
        value: u64,
        flags: u64,
    }
    let mut value = std::mem::MaybeUninit::<V>::uninit();
    let attr =
        MapElemAttr { map_fd: map.as_raw_fd() as u32, pad: 0, key: key as *const K as u64, value: value.as_mut_ptr() as u64, flags: 0 };
    // SAFETY: attr is a valid, fully initialised bpf_attr prefix for the command; the kernel reads
    // the key's size from `key` and writes one value (the map's value size, V's) to `value`.
    let rc = unsafe {
        libc::syscall(libc::SYS_bpf, BPF_MAP_LOOKUP_AND_DELETE_ELEM, &attr as *const MapElemAttr, std::mem::size_of::<MapElemAttr>())
    };
    if rc < 0 {
        let error = io::Error::last_os_error();
        return if error.raw_os_error() == Some(libc::ENOENT) { Ok(None) } else { Err(error) };
    }
    // SAFETY: the call succeeded, so the kernel wrote the whole value; V is Pod.
    Ok(Some(unsafe { value.assume_init() }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proxy_abi::{ct, CtState, IPPROTO_TCP, IPPROTO_UDP};

    /// A standalone kernel hash map (needs root), as the pinned flow tables are.
    fn kernel_map<K: aya::Pod, V: aya::Pod>() -> HashMap<MapData, K, V> {
        // SAFETY: geteuid has no preconditions.
        assert_eq!(
            unsafe { libc::geteuid() },
            0,
            "this test needs root (a kernel BPF map): run it as root, or leave it out with --skip kernel::flows"
        );
        HashMap::create(1024, 0).expect("creating a BPF hash map")
    }

    fn reply_key(port: u16) -> CtKey4 {
        CtKey4 {
            saddr_be: 0x0a00_0002u32.to_be(),
            daddr_be: 0x0a00_0001u32.to_be(),
            sport_be: 80u16.to_be(),
            dport_be: port.to_be(),
            proto: IPPROTO_TCP,
            dir: ct::DIR_REPLY,
            pad: [0; 2],
        }
    }

    fn flow(last_seen_ns: u64, backend_id: u32) -> CtEntry4 {
        CtEntry4 { backend_id, rev_nat_id: 1, state: CtState { last_seen_ns, ..CtState::default() }, ..CtEntry4::default() }
    }

    /// The kernel reclaims an expired reply entry for a new connection (a new flow on the same
    /// SNAT port) between the collector's scan and its removals: the new flow's entry stays, the
    /// ones still expired go. (Removing every scanned key deleted the new flows' entries.)
    #[test]
    fn conntrack_collection_keeps_entries_the_kernel_replaced_after_the_scan() {
        let mut map = kernel_map::<CtKey4, CtEntry4>();
        for port in 0..100 {
            map.insert(reply_key(40_000 + port), flow(1, 7), 0).unwrap();
        }
        let now = crate::dump::monotonic_now_ns();
        let stale = |k: &CtKey4, v: &CtEntry4| ct::is_expired(&v.state, k.proto, now);
        let scanned: Vec<CtKey4> = map.iter().filter_map(Result::ok).filter(|(k, v)| stale(k, v)).map(|(k, _)| k).collect();
        assert_eq!(scanned.len(), 100, "every entry is past its timeout");
        for port in (0..100).step_by(2) {
            map.insert(reply_key(40_000 + port), flow(now, 8), 0).unwrap();
        }
        assert_eq!(remove_if_still(&mut map, &scanned, stale), 50);
        let mut left: Vec<(u16, u32)> =
            map.iter().filter_map(Result::ok).map(|(k, v)| (u16::from_be(k.dport_be) - 40_000, v.backend_id)).collect();
        left.sort();
        assert_eq!(left, (0..100).step_by(2).map(|port| (port, 8)).collect::<Vec<_>>(), "the new flows' entries, untouched");
    }

    /// The purge of flows to a removed backend spares a key the kernel gave to a flow to a live
    /// backend after the purge read the map.
    #[test]
    fn the_purge_keeps_a_flow_that_moved_to_a_live_backend_after_the_read() {
        let mut map = kernel_map::<CtKey4, CtEntry4>();
        let udp = |port| CtKey4 { proto: IPPROTO_UDP, dir: ct::DIR_FORWARD, ..reply_key(port) };
        map.insert(udp(1), flow(1, 7), 0).unwrap();
        map.insert(udp(2), flow(1, 7), 0).unwrap();
        let pair = |_: &CtKey4, v: &CtEntry4| Some((v.rev_nat_id, v.backend_id));
        let read = flows(&map, pair);
        map.insert(udp(2), flow(1, 8), 0).unwrap();
        let live: HashSet<(RevNatId, BackendId)> = [(1, 8)].into_iter().collect();
        assert_eq!(remove_stale(&mut map, &read, &live, pair), 1);
        let left: Vec<(u16, u32)> = map.iter().filter_map(Result::ok).map(|(k, v)| (u16::from_be(k.dport_be), v.backend_id)).collect();
        assert_eq!(left, vec![(2, 8)]);
    }

    /// What the removal takes is judged on the entry it took: a fresh one goes back.
    #[test]
    fn take_if_puts_back_what_is_not_stale() {
        let mut map = kernel_map::<CtKey4, CtEntry4>();
        map.insert(reply_key(1), flow(5, 7), 0).unwrap();
        assert!(!take_if(&mut map, &reply_key(1), |v| v.backend_id == 8));
        assert_eq!(map.get(&reply_key(1), 0).unwrap(), flow(5, 7));
        assert!(take_if(&mut map, &reply_key(1), |v| v.backend_id == 7));
        assert!(map.get(&reply_key(1), 0).is_err());
        assert!(!take_if(&mut map, &reply_key(1), |_| true), "nothing to take");
    }
}
