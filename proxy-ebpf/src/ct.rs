//! Connection tracking for the TC programs: which backend a flow was sent to (forward entries,
//! looked up before the service map so a flow keeps its backend when the backend set changes),
//! and which frontend its replies must come from (reply entries).
//!
//! The table is an LRU of stated size (`epx_ct4_v1`); nothing in userspace garbage-collects it.
//! Timeouts follow what the flow has shown (SYN, established, FIN/RST, non-TCP) and are checked
//! when an entry is used: an expired entry counts as no entry.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use proxy_abi::{ct, CtEntry4, CtEntry6, CtKey4, CtKey6, IPPROTO_TCP};

use crate::maps::CT4;
use crate::packet::{Flow, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};

#[inline(always)]
pub fn now_ns() -> u64 {
    unsafe { bpf_ktime_get_ns() }
}

#[inline(always)]
pub fn forward_key(flow: &Flow) -> CtKey4 {
    CtKey4 {
        saddr_be: flow.saddr_be,
        daddr_be: flow.daddr_be,
        sport_be: flow.sport_be,
        dport_be: flow.dport_be,
        proto: flow.proto,
        dir: ct::DIR_FORWARD,
        pad: [0; 2],
    }
}

/// The key under which a packet is looked up as a reply.
#[inline(always)]
pub fn reply_key(flow: &Flow) -> CtKey4 {
    CtKey4 { dir: ct::DIR_REPLY, ..forward_key(flow) }
}

/// How long an entry lives without traffic, given what the flow has shown.
#[inline(always)]
fn timeout_ns(proto: u8, tcp_seen: u8) -> u64 {
    if proto != IPPROTO_TCP {
        ct::TIMEOUT_NON_TCP_NS
    } else if tcp_seen & (ct::TCP_FIN | ct::TCP_RST) != 0 {
        ct::TIMEOUT_TCP_CLOSING_NS
    } else if tcp_seen & ct::TCP_ESTABLISHED != 0 {
        ct::TIMEOUT_TCP_ESTABLISHED_NS
    } else {
        ct::TIMEOUT_TCP_SYN_NS
    }
}

#[inline(always)]
pub fn is_expired(entry: &CtEntry4, proto: u8, now: u64) -> bool {
    now.wrapping_sub(entry.last_seen_ns) > timeout_ns(proto, entry.tcp_seen)
}

#[inline(always)]
pub fn is_expired6(entry: &CtEntry6, proto: u8, now: u64) -> bool {
    now.wrapping_sub(entry.last_seen_ns) > timeout_ns(proto, entry.tcp_seen)
}

/// The TCP state bits after a packet with `flags`. A bare SYN starts the flow over (a client
/// reusing its port after a close), everything else accumulates.
#[inline(always)]
pub fn tcp_seen_after(seen: u8, proto: u8, flags: u8) -> u8 {
    if proto != IPPROTO_TCP {
        return 0;
    }
    if flags & (TCP_SYN | TCP_ACK) == TCP_SYN {
        return ct::TCP_SYN;
    }
    let mut seen = seen;
    if flags & TCP_SYN == 0 && seen & ct::TCP_SYN != 0 {
        seen |= ct::TCP_ESTABLISHED;
    }
    if flags & TCP_FIN != 0 {
        seen |= ct::TCP_FIN;
    }
    if flags & TCP_RST != 0 {
        seen |= ct::TCP_RST;
    }
    seen
}

/// The key of the replies of a flow: backend -> client, or backend -> node address:SNAT port
/// when the flow is SNATed.
#[inline(always)]
pub fn reply_key_of(entry: &CtEntry4, proto: u8, client_addr_be: u32, client_port_be: u16) -> CtKey4 {
    let snat = entry.nat & ct::NAT_SNAT != 0;
    CtKey4 {
        saddr_be: entry.backend_addr_be,
        daddr_be: if snat { entry.snat_addr_be } else { client_addr_be },
        sport_be: entry.backend_port_be,
        dport_be: if snat { entry.snat_port_be } else { client_port_be },
        proto,
        dir: ct::DIR_REPLY,
        pad: [0; 2],
    }
}

/// Records a new flow: the forward entry and the reply entry. Both or an error; a failed reply
/// entry removes the forward one, so no flow is half-tracked.
#[inline(always)]
pub fn record(flow: &Flow, entry: &CtEntry4) -> Result<(), ()> {
    let forward = forward_key(flow);
    CT4.insert(&forward, entry, 0).map_err(|_| ())?;
    let reply = reply_key_of(entry, flow.proto, flow.saddr_be, flow.sport_be);
    if CT4.insert(&reply, entry, 0).is_err() {
        let _ = CT4.remove(&forward);
        return Err(());
    }
    Ok(())
}

/// [`reply_key_of`] for IPv6.
#[inline(always)]
pub fn reply_key_of6(entry: &CtEntry6, proto: u8, client_addr: [u32; 4], client_port_be: u16) -> CtKey6 {
    let snat = entry.nat & ct::NAT_SNAT != 0;
    CtKey6 {
        saddr: entry.backend_addr,
        daddr: if snat { entry.snat_addr } else { client_addr },
        sport_be: entry.backend_port_be,
        dport_be: if snat { entry.snat_port_be } else { client_port_be },
        proto,
        dir: ct::DIR_REPLY,
        pad: [0; 2],
    }
}
