//! Session affinity (`sessionAffinity: ClientIP`), shared by the socket hooks and the TC
//! programs: a client that used a frontend within its timeout gets the same backend again.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use proxy_abi::{stat, svc_flags, AffinityKey4, AffinityValue4, Backend4, Backend6, ServiceValue4};

use crate::maps::{count, AFFINITY4, BACKENDS4, BACKENDS6};

/// The client's affinity entry for a frontend, when the frontend has affinity on.
#[inline(always)]
pub fn key(frontend: &ServiceValue4, client: impl FnOnce() -> [u32; 4], kind: u8) -> Option<AffinityKey4> {
    // `client` runs only for a frontend with affinity (a helper call saved on every other
    // connection).
    (frontend.flags & svc_flags::AFFINITY != 0).then(|| AffinityKey4 {
        client: client(),
        rev_nat_id: frontend.rev_nat_id,
        kind,
        pad: [0; 5],
    })
}

/// The backend this client used last for this frontend, if within the frontend's timeout
/// (slot 0's `backend_id`, in seconds) and still present. The agent deletes entries whose
/// backend left the frontend, so a present backend is one of the frontend's.
#[inline(always)]
pub fn remembered(key: &AffinityKey4, frontend: &ServiceValue4) -> Option<(u32, Backend4)> {
    let backend_id = remembered_id(key, frontend)?;
    let backend = unsafe { *BACKENDS4.get_ptr(&backend_id)? };
    count(stat::AFFINITY_HIT);
    Some((backend_id, backend))
}

/// As [`remembered`], for an IPv6 frontend (its backends are in the IPv6 backend map; the
/// affinity map is shared, keyed by the frontend's reverse-NAT id).
#[inline(always)]
pub fn remembered6(key: &AffinityKey4, frontend: &ServiceValue4) -> Option<(u32, Backend6)> {
    let backend_id = remembered_id(key, frontend)?;
    let backend = unsafe { *BACKENDS6.get_ptr(&backend_id)? };
    count(stat::AFFINITY_HIT);
    Some((backend_id, backend))
}

/// The backend id of the client's entry, if used within the frontend's timeout.
#[inline(always)]
fn remembered_id(key: &AffinityKey4, frontend: &ServiceValue4) -> Option<u32> {
    let entry = unsafe { *AFFINITY4.get_ptr(key)? };
    let now = unsafe { bpf_ktime_get_ns() };
    if now.saturating_sub(entry.last_used_ns) > u64::from(frontend.backend_id) * 1_000_000_000 {
        return None;
    }
    Some(entry.backend_id)
}

/// Records (or refreshes) the client's backend for the frontend.
#[inline(always)]
pub fn remember(key: &AffinityKey4, backend_id: u32) {
    let value = AffinityValue4 { last_used_ns: unsafe { bpf_ktime_get_ns() }, backend_id, pad: [0; 4] };
    if let Err(rc) = AFFINITY4.insert(key, &value, 0) {
        crate::failure::map_insert(stat::AFFINITY_RECORD_FAIL, "the session-affinity map", rc);
    }
}
