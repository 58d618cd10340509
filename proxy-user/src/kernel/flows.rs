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
        let affinity_flows = flows(affinity, |k, v| Some((k.rev_nat_id, v.backend_id)));
        let udp4 = flows(ct4, |k, v| (k.proto == udp).then_some((v.rev_nat_id, v.backend_id)));
        let udp6 = flows(ct6, |k, v| (k.proto == udp).then_some((v.rev_nat_id, v.backend_id)));
        let sock_flows4 = flows(sock4, |_, v| Some((v.rev_nat_id, v.backend_id)));
        let sock_flows6 = flows(sock6, |_, v| Some((v.rev_nat_id, v.backend_id)));
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
            affinity: remove_stale(affinity, &affinity_flows, &live),
            udp_conntrack: remove_stale(ct4, &udp4, &live) + remove_stale(ct6, &udp6, &live),
            udp_sockets: remove_stale(sock4, &sock_flows4, &live) + remove_stale(sock6, &sock_flows6, &live),
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
/// evicted or expired meanwhile is not counted, and is fine either way).
fn remove_stale<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    flows: &[(K, (RevNatId, BackendId))],
    live: &HashSet<(RevNatId, BackendId)>,
) -> usize {
    flows.iter().filter(|(key, pair)| !live.contains(pair) && map.remove(key).is_ok()).count()
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
/// entry the kernel evicted or expired meanwhile is not counted, and is fine either way.
fn remove_where_counting<K: aya::Pod, V: aya::Pod>(map: &mut HashMap<MapData, K, V>, stale: impl Fn(&K, &V) -> bool) -> (usize, usize) {
    let mut scanned = 0;
    let keys: Vec<K> = map.iter().filter_map(Result::ok).inspect(|_| scanned += 1).filter(|(k, v)| stale(k, v)).map(|(k, _)| k).collect();
    (scanned, keys.iter().filter(|key| map.remove(key).is_ok()).count())
}
