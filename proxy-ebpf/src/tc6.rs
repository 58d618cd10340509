//! The IPv6 half of the TC programs (`tc` hands every IPv6 frame here): the same verdicts as
//! for IPv4 — DNAT to a backend with connection tracking, SNAT to a node address for a backend
//! on another node, reverse NAT of replies on egress, ICMPv6 port unreachable for a frontend
//! without backends, translation of ICMPv6 errors (packet too big above all: IPv6 routers never
//! fragment, so path-MTU discovery depends on it), affinity and Maglev — with the IPv6 maps.
//! The counters are shared with IPv4.
//!
//! IPv6 tuples and conntrack entries are large for BPF's 512-byte stack, which every frame of a
//! call chain shares: the parsed packet, the flow's entry and the lookup keys live in a per-CPU
//! work area ([`Work6`]) and are handled by reference; the stages are separate functions whose
//! frames do not nest more than two deep.

use core::ffi::{c_long, c_void};

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    helpers::{bpf_get_prandom_u32, bpf_loop},
    macros::map,
    maps::PerCpuArray,
    programs::TcContext,
};
use proxy_abi::{
    backend_flags, ct, maglev, stat, svc_flags, Backend6, CtEntry6, CtKey6, ServiceKey6, ServiceValue4, IPPROTO_TCP,
    SCOPE_EXTERNAL,
};

use crate::affinity;
use crate::ct::{claim, new_state, now_ns, observe, reply_key_of6, share_state, Packet, PortSearch};
use crate::maps::{count, BACKENDS6, CT6, IFADDR6, SERVICES6};
use crate::packet::{rewrite_inner_port, TCP_ACK, TCP_SYN};
use crate::packet6::{
    parse6, rewrite_addr6, rewrite_inner_addr6, rewrite_outer_daddr6, rewrite_port6, Flow6,
    Parsed6, Parsed6Out, IP6_DADDR_OFF, IP6_SADDR_OFF,
};
use crate::route::{Hop, NotSent};
use crate::{failure, reject, route};

const PASS: i32 = TC_ACT_OK as i32;
const DROP: i32 = TC_ACT_SHOT as i32;

/// This CPU's state for the packet in hand.
#[repr(C)]
pub struct Work6 {
    pub parsed: Parsed6Out,
    /// The flow's conntrack entry: the one found, or the one being made.
    pub entry: CtEntry6,
    /// A conntrack key being looked up or written.
    pub key: CtKey6,
    pub svc: ServiceKey6,
}

impl Flow6 {
    #[inline(always)]
    fn packet(&self) -> Packet {
        Packet { proto: self.proto, flags: self.tcp_flags, seq: self.seq, seq_end: self.seq_end }
    }
}

#[map(name = "epx_work6")]
static WORK6: PerCpuArray<Work6> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
fn work() -> Option<&'static mut Work6> {
    // SAFETY: this CPU's slot of a per-CPU map; a TC program is not preempted by another on the
    // same CPU while it runs.
    WORK6.get_ptr_mut(0).map(|w| unsafe { &mut *w })
}

#[inline(always)]
fn set_key(key: &mut CtKey6, saddr: &[u32; 4], daddr: &[u32; 4], sport_be: u16, dport_be: u16, proto: u8, dir: u8) {
    key.saddr = *saddr;
    key.daddr = *daddr;
    key.sport_be = sport_be;
    key.dport_be = dport_be;
    key.proto = proto;
    key.dir = dir;
    key.pad = [0; 2];
}

#[inline(always)]
fn pass_counted(parsed: Parsed6) -> i32 {
    match parsed {
        Parsed6::BadHeader => count(stat::TC_BAD_HEADER),
        Parsed6::Fragment => count(stat::TC_FRAGMENT),
        Parsed6::NotOurs | Parsed6::Flow | Parsed6::IcmpError => {}
    }
    PASS
}

#[inline(never)]
pub fn ingress6(ctx: &TcContext) -> i32 {
    let Some(w) = work() else { return PASS };
    match parse6(ctx, &mut w.parsed) {
        Parsed6::Flow => {}
        Parsed6::IcmpError => return icmp_error6(ctx, w),
        Parsed6::Fragment => return crate::frag::later6(ctx, &w.parsed.flow, true),
        other => return pass_counted(other),
    }
    let now = now_ns();
    let flow = &w.parsed.flow;
    // Replies to SNATed flows come back to the node address.
    set_key(&mut w.key, &flow.saddr, &flow.daddr, flow.sport_be, flow.dport_be, flow.proto, ct::DIR_REPLY);
    if let Some(entry) = CT6.get_ptr_mut(&w.key) {
        if unsafe { (*entry).nat } & ct::NAT_SNAT != 0 {
            return snat_reply6(ctx, w, now);
        }
    }
    w.svc = ServiceKey6::new(flow.daddr, flow.dport_be, flow.proto, SCOPE_EXTERNAL, 0);
    let Some(frontend) = SERVICES6.get_ptr(&w.svc) else { return PASS };
    let frontend = unsafe { *frontend };

    if tracked6(w, now) {
        count(stat::TC_CT_HIT);
    } else if frontend.count == 0 {
        return reject::no_backend_verdict(reject::port_unreachable6(ctx, w.parsed.flow.l4_off));
    } else if !new_flow6(ctx, w, &frontend, now) {
        return DROP;
    }
    translate6(ctx, w)
}

/// Rewrites the packet to `w.entry`'s backend (and SNAT source), and sends it on.
#[inline(never)]
fn translate6(ctx: &TcContext, w: &mut Work6) -> i32 {
    let flow = &w.parsed.flow;
    let entry = &w.entry;
    // Routed before the rewrite, as in `tc::ingress`.
    let hop = if entry.nat & ct::NAT_SNAT == 0 {
        None
    } else {
        match next_hop6(ctx, flow, &entry.snat_addr, &entry.backend_addr) {
            Ok(hop) => Some(hop),
            Err(verdict) => return verdict,
        }
    };
    let rewritten = rewrite_addr6(ctx, flow, IP6_DADDR_OFF, &flow.daddr, &entry.backend_addr)
        .and_then(|()| rewrite_port6(ctx, flow, flow.l4_off + 2, flow.dport_be, entry.backend_port_be));
    if let Err(failed) = rewritten {
        failure::rewrite(ctx, failed);
        return DROP;
    }
    count(stat::TC_DNAT);
    let Some(hop) = hop else {
        crate::frag::remember6(flow, &flow.saddr, &entry.backend_addr, false);
        return PASS;
    };
    let rewritten = rewrite_addr6(ctx, flow, IP6_SADDR_OFF, &flow.saddr, &entry.snat_addr)
        .and_then(|()| rewrite_port6(ctx, flow, flow.l4_off, flow.sport_be, entry.snat_port_be));
    if let Err(failed) = rewritten {
        failure::rewrite(ctx, failed);
        return DROP;
    }
    count(stat::TC_SNAT);
    crate::frag::remember6(flow, &entry.snat_addr, &entry.backend_addr, true);
    forward_routed6(ctx, hop)
}

/// `w.entry` := the tracked, unexpired entry of the flow (refreshed), as `tc::tracked_backend`.
#[inline(always)]
fn tracked6(w: &mut Work6, now: u64) -> bool {
    let flow = &w.parsed.flow;
    set_key(&mut w.key, &flow.saddr, &flow.daddr, flow.sport_be, flow.dport_be, flow.proto, ct::DIR_FORWARD);
    let Some(entry) = CT6.get_ptr_mut(&w.key) else { return false };
    let entry = unsafe { &mut *entry };
    if ct::is_expired(&entry.state, flow.proto, now) {
        return false;
    }
    let bare_syn = flow.proto == IPPROTO_TCP && flow.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    if bare_syn && entry.state.tcp_seen & (ct::TCP_FIN | ct::TCP_RST) != 0 {
        count(stat::TC_CT_REOPENED);
        return false;
    }
    if flow.proto != IPPROTO_TCP || bare_syn {
        let Some(backend) = BACKENDS6.get_ptr(&entry.backend_id) else { return false };
        let backend = unsafe { &*backend };
        if backend.addr != entry.backend_addr || backend.port_be != entry.backend_port_be {
            return false;
        }
    }
    let shared = observe(&mut entry.state, &flow.packet(), false, now);
    w.entry = *entry;
    if shared {
        w.key = reply_key_of6(&w.entry, flow.proto, flow.saddr, flow.sport_be);
        share_state(&CT6, &w.key, &w.entry);
    }
    true
}

/// Picks the backend of a new flow to a frontend with backends and records the flow in
/// `w.entry` and the conntrack table; false (counted) when the packet must be dropped.
#[inline(never)]
fn new_flow6(ctx: &TcContext, w: &mut Work6, frontend: &ServiceValue4, now: u64) -> bool {
    let flow = &w.parsed.flow;
    let affinity_key = affinity::key(frontend, || flow.saddr, proxy_abi::affinity::CLIENT_IP6);
    let chosen = match affinity_key.as_ref().and_then(|k| affinity::remembered6(k, frontend)) {
        Some(chosen) => Some(chosen),
        None => match crate::tc::maglev_pick(
            frontend,
            || maglev::flow_hash6(&flow.saddr, flow.sport_be, flow.dport_be, flow.proto),
            &BACKENDS6,
        ) {
            Some(chosen) => Some(chosen),
            None => random_pick6(&mut w.svc, frontend),
        },
    };
    let Some((backend_id, backend)) = chosen else {
        count(stat::TC_LOOKUP_MISS);
        return false;
    };
    if let Some(key) = &affinity_key {
        affinity::remember(key, backend_id);
    }
    let entry = &mut w.entry;
    entry.backend_addr = backend.addr;
    entry.frontend_addr = flow.daddr;
    entry.client_addr = flow.saddr;
    entry.snat_addr = [0; 4];
    entry.backend_port_be = backend.port_be;
    entry.frontend_port_be = flow.dport_be;
    entry.client_port_be = flow.sport_be;
    entry.snat_port_be = 0;
    entry.backend_id = backend_id;
    entry.rev_nat_id = frontend.rev_nat_id;
    entry.nat = ct::NAT_DNAT;
    entry.pad = 0;
    entry.state = new_state(&flow.packet(), now);
    // A backend on another node answers to whoever the packet comes from (see `tc::ingress`).
    if backend.flags & backend_flags::LOCAL == 0 && frontend.flags & svc_flags::LOCAL_ONLY == 0 {
        let ifindex = unsafe { (*ctx.skb.skb).ifindex };
        let snat_addr = if frontend.flags & svc_flags::NODE_PORT != 0 {
            Some(flow.daddr)
        } else {
            IFADDR6.get_ptr(&ifindex).map(|a| unsafe { (*a).addr })
        };
        match snat_addr {
            None => count(stat::TC_REMOTE_BACKEND_NO_SNAT),
            Some(snat_addr) => {
                entry.nat |= ct::NAT_SNAT;
                entry.snat_addr = snat_addr;
                if !claim_snat_port6(w, now) {
                    failure::no_snat_port(ctx, backend.port_be);
                    return false;
                }
            }
        }
    }
    if record6(w) {
        count(stat::TC_CT_NEW);
    } else {
        failure::conntrack_insert(ctx);
    }
    true
}

/// Records the flow of `w.entry`, as `ct::record`: the reply entry (unless the port search
/// claimed it), then the forward entry; both or neither.
#[inline(always)]
fn record6(w: &mut Work6) -> bool {
    let flow = &w.parsed.flow;
    let claimed = w.entry.nat & ct::NAT_SNAT != 0;
    w.key = reply_key_of6(&w.entry, flow.proto, flow.saddr, flow.sport_be);
    if !claimed && CT6.insert(&w.key, &w.entry, 0).is_err() {
        return false;
    }
    // The forward entry knows the client's next sequence number.
    w.entry.state.seq_next = flow.seq_end;
    set_key(&mut w.key, &flow.saddr, &flow.daddr, flow.sport_be, flow.dport_be, flow.proto, ct::DIR_FORWARD);
    if CT6.insert(&w.key, &w.entry, 0).is_ok() {
        return true;
    }
    w.key = reply_key_of6(&w.entry, flow.proto, flow.saddr, flow.sport_be);
    let _ = CT6.remove(&w.key);
    false
}

#[inline(always)]
fn random_pick6(svc: &mut ServiceKey6, frontend: &ServiceValue4) -> Option<(u32, Backend6)> {
    // `checked_rem`: no division by zero (a panic path the verifier refuses) in the code.
    svc.backend_slot = unsafe { bpf_get_prandom_u32() }.checked_rem(u32::from(frontend.count))? as u16 + 1;
    let slot = SERVICES6.get_ptr(svc)?;
    let backend_id = unsafe { (*slot).backend_id };
    let backend = BACKENDS6.get_ptr(&backend_id)?;
    Some((backend_id, unsafe { *backend }))
}

/// Sets `w.entry.snat_port_be` to a port on `w.entry.snat_addr` claimed for the new flow by
/// inserting its reply entry: `tc::claim_snat_port` for IPv6.
#[inline(always)]
fn claim_snat_port6(w: &mut Work6, now: u64) -> bool {
    let proto = w.parsed.flow.proto;
    let Some(mut search) = PortSearch::start(proto, now) else { return false };
    w.key = reply_key_of6(&w.entry, proto, [0; 4], 0);
    let callback: unsafe extern "C" fn(u64, *mut c_void) -> c_long = try_snat_port6;
    unsafe { bpf_loop(search.ports, callback as *mut c_void, (&raw mut search).cast(), 0) };
    search.found != 0
}

/// One step of [`claim_snat_port6`]. The entry and key are this CPU's work area, looked up again
/// (a map value cannot be `bpf_loop`'s context).
unsafe extern "C" fn try_snat_port6(index: u64, search: *mut c_void) -> c_long {
    let search = unsafe { &mut *search.cast::<PortSearch>() };
    let (Some(w), Some(port_be)) = (work(), search.port_be(index)) else { return 1 };
    w.entry.snat_port_be = port_be;
    w.key.dport_be = port_be;
    let claimed = claim(&CT6, &w.key, &w.entry, search.proto, search.now);
    search.after(claimed)
}

/// `tc::next_hop` for IPv6: a packet too big gets an ICMPv6 packet too big.
#[inline(always)]
fn next_hop6(ctx: &TcContext, flow: &Flow6, saddr: &[u32; 4], daddr: &[u32; 4]) -> Result<Hop, i32> {
    route::lookup6(ctx, flow.proto, saddr, daddr).map_err(|not_sent| match not_sent {
        NotSent::TooBig(mtu) => reject::too_big6(ctx, flow.l4_off, mtu),
        NotSent::Failed(failed) => {
            failure::route(ctx, failed);
            DROP
        }
    })
}

#[inline(always)]
fn forward_routed6(ctx: &TcContext, hop: Hop) -> i32 {
    match route::send(hop) {
        Ok(verdict) => verdict,
        Err(failed) => {
            failure::route(ctx, failed);
            DROP
        }
    }
}

/// backend:port -> node:SNAT port becomes frontend -> client (the entry is at `w.key`).
#[inline(never)]
fn snat_reply6(ctx: &TcContext, w: &mut Work6, now: u64) -> i32 {
    let Some(entry) = CT6.get_ptr_mut(&w.key) else { return PASS };
    let entry = unsafe { &mut *entry };
    let shared = observe(&mut entry.state, &w.parsed.flow.packet(), true, now);
    w.entry = *entry;
    if shared {
        share_with_forward6(w);
    }
    let flow = &w.parsed.flow;
    let entry = &w.entry;
    let hop = match next_hop6(ctx, flow, &entry.frontend_addr, &entry.client_addr) {
        Ok(hop) => hop,
        Err(verdict) => return verdict,
    };
    let rewritten = rewrite_addr6(ctx, flow, IP6_SADDR_OFF, &flow.saddr, &entry.frontend_addr)
        .and_then(|()| rewrite_port6(ctx, flow, flow.l4_off, flow.sport_be, entry.frontend_port_be))
        .and_then(|()| rewrite_addr6(ctx, flow, IP6_DADDR_OFF, &flow.daddr, &entry.client_addr))
        .and_then(|()| rewrite_port6(ctx, flow, flow.l4_off + 2, flow.dport_be, entry.client_port_be));
    if let Err(failed) = rewritten {
        failure::rewrite(ctx, failed);
        return DROP;
    }
    count(stat::TC_SNAT_REPLY);
    crate::frag::remember6(flow, &entry.frontend_addr, &entry.client_addr, true);
    forward_routed6(ctx, hop)
}

/// Copies the state of `w.entry`, a reply entry, to its flow's forward entry (`ct::share_state`).
#[inline(always)]
fn share_with_forward6(w: &mut Work6) {
    let entry = &w.entry;
    set_key(&mut w.key, &entry.client_addr, &entry.frontend_addr, entry.client_port_be, entry.frontend_port_be, w.parsed.flow.proto, ct::DIR_FORWARD);
    share_state(&CT6, &w.key, &w.entry);
}

/// `tc::icmp_error` for ICMPv6.
#[inline(never)]
fn icmp_error6(ctx: &TcContext, w: &mut Work6) -> i32 {
    let error = &w.parsed.icmp;
    let inner = &error.inner;
    // The quoted packet went out, so its reverse is what our tables know.
    set_key(&mut w.key, &inner.daddr, &inner.saddr, inner.dport_be, inner.sport_be, inner.proto, ct::DIR_FORWARD);
    let mut snat = false;
    let mut found = CT6.get_ptr(&w.key).filter(|e| unsafe { (**e).nat } & ct::NAT_SNAT == 0);
    if found.is_none() {
        w.key.dir = ct::DIR_REPLY;
        found = CT6.get_ptr(&w.key).filter(|e| unsafe { (**e).nat } & ct::NAT_SNAT != 0);
        snat = true;
    }
    let Some(found) = found else { return PASS };
    w.entry = unsafe { *found };
    let entry = &w.entry;
    // Where the error goes, and the quoted packet as that side sent it.
    let (to, src, sport, dst, dport) = if snat {
        (&entry.client_addr, &entry.client_addr, entry.client_port_be, &entry.frontend_addr, entry.frontend_port_be)
    } else {
        (&entry.backend_addr, &entry.backend_addr, entry.backend_port_be, &inner.daddr, inner.dport_be)
    };
    let rewritten = rewrite_inner_addr6(ctx, error, error.inner_saddr_off(), &inner.saddr, src)
        .and_then(|()| rewrite_inner_port(ctx, error.csum_off(), inner.l4_off, inner.sport_be, sport))
        .and_then(|()| rewrite_inner_addr6(ctx, error, error.inner_daddr_off(), &inner.daddr, dst))
        .and_then(|()| rewrite_inner_port(ctx, error.csum_off(), inner.l4_off + 2, inner.dport_be, dport))
        .and_then(|()| rewrite_outer_daddr6(ctx, error, to));
    if let Err(failed) = rewritten {
        failure::rewrite(ctx, failed);
        return DROP;
    }
    count(stat::TC_ICMP_ERROR_XLATE);
    PASS
}

#[inline(never)]
pub fn egress6(ctx: &TcContext) -> i32 {
    let Some(w) = work() else { return PASS };
    match parse6(ctx, &mut w.parsed) {
        Parsed6::Flow => {}
        Parsed6::Fragment => return crate::frag::later6(ctx, &w.parsed.flow, false),
        other => return pass_counted(other),
    }
    let flow = &w.parsed.flow;
    set_key(&mut w.key, &flow.saddr, &flow.daddr, flow.sport_be, flow.dport_be, flow.proto, ct::DIR_REPLY);
    let Some(entry) = CT6.get_ptr_mut(&w.key) else { return PASS };
    let entry = unsafe { &mut *entry };
    if entry.nat & ct::NAT_SNAT != 0 {
        // Replies of SNATed flows are addressed to the node and handled on ingress.
        return PASS;
    }
    let shared = observe(&mut entry.state, &flow.packet(), true, now_ns());
    w.entry = *entry;
    if shared {
        share_with_forward6(w);
    }
    let flow = &w.parsed.flow;
    let entry = &w.entry;
    let rewritten = rewrite_addr6(ctx, flow, IP6_SADDR_OFF, &flow.saddr, &entry.frontend_addr)
        .and_then(|()| rewrite_port6(ctx, flow, flow.l4_off, flow.sport_be, entry.frontend_port_be));
    if let Err(failed) = rewritten {
        failure::rewrite(ctx, failed);
        return DROP;
    }
    count(stat::TC_REV_NAT);
    crate::frag::remember6(flow, &entry.frontend_addr, &flow.daddr, false);
    PASS
}
