//! The maps shared with the agent. Names and layouts come from `proxy_abi`; every map is pinned
//! by name so it outlives the agent, and the agent may resize each one at load time.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
};
use proxy_abi::{
    capacity, stat, DatapathConfig, FragKey4, FragKey6, FragValue4, FragValue6, AffinityKey4, AffinityValue4, Backend4, BackendId, Backend6, CtEntry4, CtEntry6, CtKey4, CtKey6, IfAddr6, IfAddr4, MaglevTable4, RevNat4, RevNat6, RevSock6, RevSockKey6, ServiceKey6, RevNatId, RevSock4,
    RevSockKey4, ServiceKey4, ServiceValue4, SockFlow, SockFlowKey4, SockFlowKey6,
};

// The `name` strings must equal `proxy_abi::map_name::*`; the agent looks each one up by that
// name at start-up and refuses to run if one is missing.
#[map(name = "epx_svc4_v1")]
pub static SERVICES4: HashMap<ServiceKey4, ServiceValue4> =
    HashMap::pinned(capacity::SERVICES4, 0);

#[map(name = "epx_be4_v1")]
pub static BACKENDS4: HashMap<BackendId, Backend4> = HashMap::pinned(capacity::BACKENDS4, 0);

#[map(name = "epx_revnat4_v1")]
pub static REV_NAT4: HashMap<RevNatId, RevNat4> = HashMap::pinned(capacity::REV_NAT4, 0);

#[map(name = "epx_revsk4_v1")]
pub static REV_SOCK4: LruHashMap<RevSockKey4, RevSock4> =
    LruHashMap::pinned(capacity::REV_SOCK4, 0);

#[map(name = "epx_svc6_v1")]
pub static SERVICES6: HashMap<ServiceKey6, ServiceValue4> = HashMap::pinned(capacity::SERVICES6, 0);

#[map(name = "epx_be6_v1")]
pub static BACKENDS6: HashMap<BackendId, Backend6> = HashMap::pinned(capacity::BACKENDS6, 0);

#[map(name = "epx_revnat6_v1")]
pub static REV_NAT6: HashMap<RevNatId, RevNat6> = HashMap::pinned(capacity::REV_NAT6, 0);

#[map(name = "epx_revsk6_v1")]
pub static REV_SOCK6: LruHashMap<RevSockKey6, RevSock6> = LruHashMap::pinned(capacity::REV_SOCK6, 0);

#[map(name = "epx_aff4_v2")]
pub static AFFINITY4: LruHashMap<AffinityKey4, AffinityValue4> =
    LruHashMap::pinned(capacity::AFFINITY4, 0);

#[map(name = "epx_stats_v2")]
pub static STATS: PerCpuArray<u64> = PerCpuArray::pinned(stat::SLOTS, 0);

/// Connection tracking of the packet-level datapath: LRU, so a full table forgets the oldest flow
/// instead of refusing a new one.
#[map(name = "epx_ct4_v2")]
pub static CT4: LruHashMap<CtKey4, CtEntry4> = LruHashMap::pinned(capacity::CT4, 0);

/// ifindex -> that interface's IPv4 address, written by the agent when it attaches.
#[map(name = "epx_ifaddr4_v1")]
pub static IFADDR4: HashMap<u32, IfAddr4> = HashMap::pinned(capacity::IFADDR4, 0);

/// rev_nat_id (as u32) -> the Maglev table of that external frontend. Not preallocated: only
/// frontends of an agent running `--lb-algorithm maglev` have one.
#[map(name = "epx_maglev4_v1")]
pub static MAGLEV4: HashMap<u32, MaglevTable4> = HashMap::pinned(capacity::MAGLEV4, BPF_F_NO_PREALLOC);

/// The IPv6 connection tracking (as `epx_ct4_v2`).
#[map(name = "epx_ct6_v2")]
pub static CT6: LruHashMap<CtKey6, CtEntry6> = LruHashMap::pinned(capacity::CT6, 0);

/// ifindex -> that interface's (first global) IPv6 address, written by the agent when it attaches.
#[map(name = "epx_ifaddr6_v1")]
pub static IFADDR6: HashMap<u32, IfAddr6> = HashMap::pinned(capacity::IFADDR6, 0);

/// First fragment's translation -> the later fragments of the same datagram (`frag`).
#[map(name = "epx_frag4_v1")]
pub static FRAG4: LruHashMap<FragKey4, FragValue4> = LruHashMap::pinned(capacity::FRAG4, 0);

#[map(name = "epx_frag6_v1")]
pub static FRAG6: LruHashMap<FragKey6, FragValue6> = LruHashMap::pinned(capacity::FRAG6, 0);

/// Unconnected UDP socket and frontend -> the backend its datagrams go to (`sock`).
#[map(name = "epx_sflow4_v1")]
pub static SOCK_FLOW4: LruHashMap<SockFlowKey4, SockFlow> = LruHashMap::pinned(capacity::SOCK_FLOW4, 0);

#[map(name = "epx_sflow6_v1")]
pub static SOCK_FLOW6: LruHashMap<SockFlowKey6, SockFlow> = LruHashMap::pinned(capacity::SOCK_FLOW6, 0);

/// The agent's settings (`DatapathConfig`); all zero means the ABI defaults.
#[map(name = "epx_cfg_v1")]
pub static CONFIG: Array<DatapathConfig> = Array::pinned(1, 0);

#[inline(always)]
pub fn count(index: u32) {
    if let Some(counter) = STATS.get_ptr_mut(index) {
        // Per-CPU slot: no other writer can race with this increment.
        unsafe { *counter += 1 };
    }
}
