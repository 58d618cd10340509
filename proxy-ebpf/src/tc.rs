//! Packet-level load balancing on the node's external interfaces: `epx_tc_ingress` and
//! `epx_tc_egress` (tc/tcx classifiers).
//!
//! Ingress: an IPv4 TCP/UDP packet to an external frontend (NodePort on a node address,
//! externalIP, LoadBalancer IP: the `SCOPE_EXTERNAL` entries of the service map) is DNATed to a
//! backend. A tracked flow keeps its backend (conntrack is looked up before a new pick; a UDP
//! flow only while that backend exists); a frontend without backends is answered with ICMP port
//! unreachable.
//! A flow to a backend on another node (and no `Local` policy) is also SNATed to a node
//! address:a free port (the NodePort's address, or that of the interface the packet arrived on)
//! and sent out by the program itself (see `route`); its replies come back to that address on an
//! ingress and are sent on to the client.
//! Egress: replies of DNAT-only flows (backend -> client) leave as frontend -> client.
//! Everything else passes untouched; every verdict other than "not ours" is counted.
//!
//! ICMP errors about translated flows are translated too (outer and quoted headers).
//!
//! A new flow's backend comes from, in order: session affinity, the frontend's Maglev table
//! (`--lb-algorithm maglev`), a random slot.
//!
//! IPv6 frames are handed to `tc6`, which does the same with the IPv6 maps.

use core::ffi::{c_long, c_void};

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    helpers::{bpf_get_prandom_u32, bpf_loop},
    macros::classifier,
    maps::HashMap,
    programs::TcContext,
};
use proxy_abi::{
    backend_flags, ct, maglev, stat, svc_flags, BackendId, CtEntry4, CtKey4, ServiceKey4, ServiceValue4, IPPROTO_TCP,
    SCOPE_EXTERNAL,
};

use crate::ct::{
    claim, forward_key, forward_key_of, new_state, now_ns, observe, record, reply_key, reply_key_of, share_state, Packet,
    PortSearch,
};
use crate::affinity;
use crate::maps::{count, BACKENDS4, CT4, IFADDR4, MAGLEV4, SERVICES4};
use crate::packet::{
    parse, rewrite_addr, rewrite_inner_addr, rewrite_inner_port, rewrite_outer_daddr, rewrite_port, Flow,
    IcmpError, Parsed, ETH_P_IP, IP_DADDR_OFF, IP_SADDR_OFF, TCP_ACK, TCP_SYN,
};
use crate::packet6::ETH_P_IPV6;
use crate::route::{Hop, NotSent};
use crate::{failure, reject, route};

const PASS: i32 = TC_ACT_OK as i32;
const DROP: i32 = TC_ACT_SHOT as i32;

#[classifier]
pub fn epx_tc_ingress(ctx: TcContext) -> i32 {
    match ethertype(&ctx) {
        Some(ETH_P_IP) => ingress(&ctx),
        Some(ETH_P_IPV6) => crate::tc6::ingress6(&ctx),
        _ => PASS,
    }
}

#[classifier]
pub fn epx_tc_egress(ctx: TcContext) -> i32 {
    match ethertype(&ctx) {
        Some(ETH_P_IP) => egress(&ctx),
        Some(ETH_P_IPV6) => crate::tc6::egress6(&ctx),
        _ => PASS,
    }
}

/// The frame's ethertype, read once per packet: the family's parser trusts it.
#[inline(always)]
fn ethertype(ctx: &TcContext) -> Option<u16> {
    ctx.load::<u16>(12).ok().map(u16::from_be)
}

/// The verdict for a packet that is not a TCP/UDP flow (nor an ICMP error about one): it
/// passes untouched, counted when it is malformed or a fragment.
#[inline(always)]
fn pass_counted(parsed: &Parsed) -> i32 {
    match parsed {
        Parsed::BadHeader => count(stat::TC_BAD_HEADER),
        Parsed::Fragment(_) => count(stat::TC_FRAGMENT),
        Parsed::NotOurs | Parsed::Flow(_) | Parsed::IcmpError(_) => {}
    }
    PASS
}

/// Where a packet of a flow goes, and the source it gets when it is SNATed.
struct Target {
    addr_be: u32,
    port_be: u16,
    snat: Option<(u32, u16)>,
}

// Not inlined, like `tc6::ingress6`: each family's path gets its own stack frame (both
// inlined into one program exceed BPF's 512-byte stack).
#[inline(never)]
fn ingress(ctx: &TcContext) -> i32 {
    let flow = match parse(ctx) {
        Parsed::Flow(flow) => flow,
        Parsed::IcmpError(error) => return icmp_error(ctx, &error),
        Parsed::Fragment(fragment) => return crate::frag::later(ctx, &fragment, true),
        other => return pass_counted(&other),
    };
    let now = now_ns();
    // Replies to SNATed flows come back to the node address (DNAT-only replies are handled on
    // egress, and are left alone here).
    if let Some(entry) = CT4.get_ptr_mut(&reply_key(&flow)) {
        let entry = unsafe { &mut *entry };
        if entry.nat & ct::NAT_SNAT != 0 {
            return snat_reply(ctx, &flow, entry, now);
        }
    }
    let mut key = ServiceKey4::new(flow.daddr_be, flow.dport_be, flow.proto, SCOPE_EXTERNAL, 0);
    let Some(frontend) = SERVICES4.get_ptr(&key) else { return PASS };
    let frontend = unsafe { *frontend };

    let target = if let Some(target) = tracked_backend(&flow, now) {
        count(stat::TC_CT_HIT);
        target
    } else {
        if frontend.count == 0 {
            return reject::no_backend_verdict(reject::port_unreachable(ctx, &flow));
        }
        // sessionAffinity: ClientIP, by the client's source address.
        let affinity_key = affinity::key(&frontend, || proxy_abi::affinity::ip4_client(flow.saddr_be), proxy_abi::affinity::CLIENT_IP4);
        let (backend_id, backend) = match affinity_key.as_ref().and_then(|k| affinity::remembered(k, &frontend)) {
            Some(chosen) => chosen,
            None => match maglev_pick(
                &frontend,
                || maglev::flow_hash(flow.saddr_be, flow.sport_be, flow.dport_be, flow.proto),
                &BACKENDS4,
            ) {
                Some(chosen) => chosen,
                None => {
                    key.backend_slot = (unsafe { bpf_get_prandom_u32() } % u32::from(frontend.count)) as u16 + 1;
                    let Some(slot) = SERVICES4.get_ptr(&key) else {
                        count(stat::TC_LOOKUP_MISS);
                        return DROP;
                    };
                    let backend_id = unsafe { (*slot).backend_id };
                    let Some(backend) = BACKENDS4.get_ptr(&backend_id) else {
                        count(stat::TC_LOOKUP_MISS);
                        return DROP;
                    };
                    (backend_id, unsafe { *backend })
                }
            },
        };
        if let Some(key) = &affinity_key {
            affinity::remember(key, backend_id);
        }
        let mut entry = CtEntry4 {
            backend_addr_be: backend.addr_be,
            frontend_addr_be: flow.daddr_be,
            client_addr_be: flow.saddr_be,
            snat_addr_be: 0,
            backend_port_be: backend.port_be,
            frontend_port_be: flow.dport_be,
            client_port_be: flow.sport_be,
            snat_port_be: 0,
            backend_id,
            rev_nat_id: frontend.rev_nat_id,
            nat: ct::NAT_DNAT,
            pad: 0,
            state: new_state(&Packet::of(&flow), now),
        };
        // A backend on another node answers to whoever the packet comes from: unless a `Local`
        // policy keeps the client's address (and then only local backends are listed), the
        // packet must come from this node so that the answer comes back through it.
        if backend.flags & backend_flags::LOCAL == 0 && frontend.flags & svc_flags::LOCAL_ONLY == 0 {
            match snat_address(ctx, &flow, frontend.flags) {
                None => count(stat::TC_REMOTE_BACKEND_NO_SNAT),
                Some(snat_addr_be) => {
                    entry.nat |= ct::NAT_SNAT;
                    entry.snat_addr_be = snat_addr_be;
                    let Some(port_be) = claim_snat_port(&entry, flow.proto, now) else {
                        failure::no_snat_port(ctx, backend.port_be);
                        return DROP;
                    };
                    entry.snat_port_be = port_be;
                }
            }
        }
        // Translate even when the entry cannot be written: the packet is still better served
        // than dropped (an SNATed flow's replies then stay unanswered, as with a full table).
        let claimed = entry.nat & ct::NAT_SNAT != 0;
        match record(&flow, &entry, claimed) {
            Ok(()) => count(stat::TC_CT_NEW),
            Err(()) => failure::conntrack_insert(ctx),
        }
        let snat = (entry.nat & ct::NAT_SNAT != 0).then_some((entry.snat_addr_be, entry.snat_port_be));
        Target { addr_be: backend.addr_be, port_be: backend.port_be, snat }
    };

    // What this program sends on itself (SNAT) is routed before it is rewritten: a packet too
    // big for the next link is answered with an ICMP error quoting it as the client sent it.
    let hop = match target.snat {
        Some((snat_addr_be, _)) => match next_hop(ctx, &flow, snat_addr_be, target.addr_be) {
            Ok(hop) => Some(hop),
            Err(verdict) => return verdict,
        },
        None => None,
    };
    let rewritten = rewrite_addr(ctx, &flow, IP_DADDR_OFF, flow.daddr_be, target.addr_be)
        .and_then(|()| rewrite_port(ctx, &flow, flow.l4_off + 2, flow.dport_be, target.port_be));
    if let Err(failed) = rewritten {
        failure::rewrite(ctx, failed);
        return DROP;
    }
    count(stat::TC_DNAT);
    let (Some((snat_addr_be, snat_port_be)), Some(hop)) = (target.snat, hop) else {
        crate::frag::remember(&flow, flow.saddr_be, target.addr_be, false);
        return PASS;
    };
    let rewritten = rewrite_addr(ctx, &flow, IP_SADDR_OFF, flow.saddr_be, snat_addr_be)
        .and_then(|()| rewrite_port(ctx, &flow, flow.l4_off, flow.sport_be, snat_port_be));
    if let Err(failed) = rewritten {
        failure::rewrite(ctx, failed);
        return DROP;
    }
    count(stat::TC_SNAT);
    crate::frag::remember(&flow, snat_addr_be, target.addr_be, true);
    forward_routed(ctx, hop)
}

/// The backend of a new flow from the frontend's Maglev table (`--lb-algorithm maglev`), for
/// both families: the same flow hash gives the same backend on every node that has the same
/// backend set. None when the frontend does not use Maglev (the hash is not computed then), or
/// (counted) when its table or the backend is missing mid-update.
#[inline(always)]
pub(crate) fn maglev_pick<B: Copy>(
    frontend: &ServiceValue4,
    hash: impl FnOnce() -> u32,
    backends: &HashMap<BackendId, B>,
) -> Option<(u32, B)> {
    if frontend.flags & svc_flags::MAGLEV == 0 {
        return None;
    }
    let hash = hash();
    let chosen = MAGLEV4.get_ptr(&u32::from(frontend.rev_nat_id)).and_then(|table| {
        // The compiler turns `% TABLE_SIZE` into a multiply-and-shift whose bound the verifier
        // cannot follow, and then drops the bound check as redundant: hiding the slot from the
        // optimiser keeps the check, which the verifier does follow.
        let slot = maglev::slot(hash);
        let slot = unsafe { core::ptr::read_volatile(&slot) };
        let backend_id = *unsafe { &(*table).backend_ids }.get(slot)?;
        let backend = backends.get_ptr(&backend_id)?;
        Some((backend_id, unsafe { *backend }))
    });
    count(if chosen.is_some() { stat::TC_MAGLEV_PICK } else { stat::TC_MAGLEV_MISS });
    chosen
}

/// The next hop of `flow`'s packet once translated to `saddr_be -> daddr_be`, or the verdict
/// when there is none: an ICMP "fragmentation needed" for a packet too big for it
/// (`reject::too_big`), a drop when there is no route.
#[inline(always)]
fn next_hop(ctx: &TcContext, flow: &Flow, saddr_be: u32, daddr_be: u32) -> Result<Hop, i32> {
    route::lookup(ctx, flow.proto, saddr_be, daddr_be).map_err(|not_sent| match not_sent {
        NotSent::TooBig(mtu) => reject::too_big(ctx, flow, mtu),
        NotSent::Failed(failed) => {
            failure::route(ctx, failed);
            DROP
        }
    })
}

/// Sends a packet whose source is a node address on its way to `hop` (the kernel would refuse
/// it).
#[inline(always)]
fn forward_routed(ctx: &TcContext, hop: Hop) -> i32 {
    match route::send(hop) {
        Ok(verdict) => verdict,
        Err(failed) => {
            failure::route(ctx, failed);
            DROP
        }
    }
}

/// The node address an SNATed flow comes from: a NodePort's own (it is a node address), else the
/// address of the interface the packet arrived on, as the agent recorded it.
#[inline(always)]
fn snat_address(ctx: &TcContext, flow: &Flow, frontend_flags: u8) -> Option<u32> {
    if frontend_flags & svc_flags::NODE_PORT != 0 {
        return Some(flow.daddr_be);
    }
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    IFADDR4.get_ptr(&ifindex).map(|a| unsafe { (*a).addr_be })
}

/// The search for an SNAT port (`bpf_loop`'s context): the flow's reply entry, tried with one
/// port after the other.
#[repr(C)]
struct PortSearch4 {
    entry: CtEntry4,
    key: CtKey4,
    search: PortSearch,
}

/// Claims a source port on `entry.snat_addr_be` for a new flow to `entry`'s backend by inserting
/// the flow's reply entry (see `ct::claim`), and returns it. The search starts at a random port
/// of the range (`DatapathConfig`) and goes on through the whole range while ports are held by
/// live flows; None only when every port is (or the map refuses). Its cost grows with how full
/// the range is: one failed insert and one lookup per held port.
#[inline(always)]
fn claim_snat_port(entry: &CtEntry4, proto: u8, now: u64) -> Option<u16> {
    let search = PortSearch::start(proto, now)?;
    let ports = search.ports;
    let mut search = PortSearch4 { entry: *entry, key: reply_key_of(entry, proto, 0, 0), search };
    // The reply entry learns the backend's sequence numbers from its first answer.
    search.entry.state.seq_next = 0;
    let callback: unsafe extern "C" fn(u64, *mut c_void) -> c_long = try_snat_port;
    unsafe { bpf_loop(ports, callback as *mut c_void, (&raw mut search).cast(), 0) };
    (search.search.found != 0).then_some(search.entry.snat_port_be)
}

/// One step of [`claim_snat_port`].
unsafe extern "C" fn try_snat_port(index: u64, search: *mut c_void) -> c_long {
    let s = unsafe { &mut *search.cast::<PortSearch4>() };
    let Some(port_be) = s.search.port_be(index) else { return 1 };
    s.entry.snat_port_be = port_be;
    s.key.dport_be = port_be;
    let claimed = claim(&CT4, &s.key, &s.entry, s.search.proto, s.search.now);
    s.search.after(claimed)
}

/// backend:port -> node:SNAT port becomes frontend -> client, sent on to the client.
#[inline(always)]
fn snat_reply(ctx: &TcContext, flow: &Flow, entry: &mut CtEntry4, now: u64) -> i32 {
    if observe(&mut entry.state, &Packet::of(flow), true, now) {
        share_state(&CT4, &forward_key_of(entry, flow.proto), entry);
    }
    let entry = *entry;
    let hop = match next_hop(ctx, flow, entry.frontend_addr_be, entry.client_addr_be) {
        Ok(hop) => hop,
        Err(verdict) => return verdict,
    };
    let rewritten = rewrite_addr(ctx, flow, IP_SADDR_OFF, flow.saddr_be, entry.frontend_addr_be)
        .and_then(|()| rewrite_port(ctx, flow, flow.l4_off, flow.sport_be, entry.frontend_port_be))
        .and_then(|()| rewrite_addr(ctx, flow, IP_DADDR_OFF, flow.daddr_be, entry.client_addr_be))
        .and_then(|()| rewrite_port(ctx, flow, flow.l4_off + 2, flow.dport_be, entry.client_port_be));
    if let Err(failed) = rewritten {
        failure::rewrite(ctx, failed);
        return DROP;
    }
    count(stat::TC_SNAT_REPLY);
    crate::frag::remember(flow, entry.frontend_addr_be, entry.client_addr_be, true);
    forward_routed(ctx, hop)
}

/// An ICMP error about a packet we translated, so that path-MTU discovery and unreachable
/// errors reach the socket they are about:
/// - about a reply that left as frontend -> client: it goes to the backend, about backend -> client;
/// - about a request we SNATed (node:SNAT port -> backend on another node): it goes to the
///   client, about client -> frontend, the packet the client sent.
/// Anything else passes untouched (an error about the node's own traffic).
#[inline(always)]
fn icmp_error(ctx: &TcContext, error: &IcmpError) -> i32 {
    let inner = error.inner;
    // The quoted packet went out, so its reverse is what our tables know.
    let mut key = CtKey4 {
        saddr_be: inner.daddr_be,
        daddr_be: inner.saddr_be,
        sport_be: inner.dport_be,
        dport_be: inner.sport_be,
        proto: inner.proto,
        dir: ct::DIR_FORWARD,
        pad: [0; 2],
    };
    let mut entry = CT4.get_ptr(&key).map(|e| unsafe { *e }).filter(|e| e.nat & ct::NAT_SNAT == 0);
    let mut snat = false;
    if entry.is_none() {
        key.dir = ct::DIR_REPLY;
        entry = CT4.get_ptr(&key).map(|e| unsafe { *e }).filter(|e| e.nat & ct::NAT_SNAT != 0);
        snat = true;
    }
    let Some(entry) = entry else { return PASS };
    // Where the error goes, and the quoted packet as that side sent it.
    let (to, src, sport, dst, dport) = if snat {
        (entry.client_addr_be, entry.client_addr_be, entry.client_port_be, entry.frontend_addr_be, entry.frontend_port_be)
    } else {
        (entry.backend_addr_be, entry.backend_addr_be, entry.backend_port_be, inner.daddr_be, inner.dport_be)
    };
    let rewritten = rewrite_inner_addr(ctx, error, error.inner_saddr_off(), inner.saddr_be, src)
        .and_then(|()| rewrite_inner_port(ctx, error.csum_off(), error.inner_sport_off(), inner.sport_be, sport))
        .and_then(|()| rewrite_inner_addr(ctx, error, error.inner_daddr_off(), inner.daddr_be, dst))
        .and_then(|()| rewrite_inner_port(ctx, error.csum_off(), error.inner_dport_off(), inner.dport_be, dport))
        .and_then(|()| rewrite_outer_daddr(ctx, error.daddr_be, to));
    if let Err(failed) = rewritten {
        failure::rewrite(ctx, failed);
        return DROP;
    }
    count(stat::TC_ICMP_ERROR_XLATE);
    // The outer source is whoever reported the error, not a node address: the kernel can route
    // it like any forwarded packet.
    PASS
}

/// The backend of a tracked, unexpired flow, refreshing the entry.
///
/// As with kube-proxy's conntrack: a TCP connection stays on its backend whatever happens to the
/// Service's endpoints (a terminating pod finishes its connections), while a UDP flow whose
/// backend went away (kube-proxy flushes those entries) gets a new pick, and so does a new
/// connection (a bare SYN) reusing the tuple of a closed one or of one whose backend is gone.
/// (The closed flow's reply entry keeps its SNAT port until it expires: the backend may hold
/// that tuple in TIME_WAIT.)
#[inline(always)]
fn tracked_backend(flow: &Flow, now: u64) -> Option<Target> {
    let entry = CT4.get_ptr_mut(&forward_key(flow))?;
    let entry = unsafe { &mut *entry };
    if ct::is_expired(&entry.state, flow.proto, now) {
        return None;
    }
    let bare_syn = flow.proto == IPPROTO_TCP && flow.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    if bare_syn && entry.state.tcp_seen & (ct::TCP_FIN | ct::TCP_RST) != 0 {
        count(stat::TC_CT_REOPENED);
        return None;
    }
    if flow.proto != IPPROTO_TCP || bare_syn {
        let backend = BACKENDS4.get_ptr(&entry.backend_id)?;
        let backend = unsafe { *backend };
        if backend.addr_be != entry.backend_addr_be || backend.port_be != entry.backend_port_be {
            return None;
        }
    }
    if observe(&mut entry.state, &Packet::of(flow), false, now) {
        share_state(&CT4, &reply_key_of(entry, flow.proto, flow.saddr_be, flow.sport_be), entry);
    }
    let snat = (entry.nat & ct::NAT_SNAT != 0).then_some((entry.snat_addr_be, entry.snat_port_be));
    Some(Target { addr_be: entry.backend_addr_be, port_be: entry.backend_port_be, snat })
}

#[inline(never)]
fn egress(ctx: &TcContext) -> i32 {
    let flow = match parse(ctx) {
        Parsed::Flow(flow) => flow,
        Parsed::Fragment(fragment) => return crate::frag::later(ctx, &fragment, false),
        other => return pass_counted(&other),
    };
    let Some(entry) = CT4.get_ptr_mut(&reply_key(&flow)) else { return PASS };
    let entry = unsafe { &mut *entry };
    if entry.nat & ct::NAT_SNAT != 0 {
        // Replies of SNATed flows are addressed to the node and handled on ingress.
        return PASS;
    }
    if observe(&mut entry.state, &Packet::of(&flow), true, now_ns()) {
        share_state(&CT4, &forward_key_of(entry, flow.proto), entry);
    }
    let (frontend_addr_be, frontend_port_be) = (entry.frontend_addr_be, entry.frontend_port_be);

    let rewritten = rewrite_addr(ctx, &flow, IP_SADDR_OFF, flow.saddr_be, frontend_addr_be)
        .and_then(|()| rewrite_port(ctx, &flow, flow.l4_off, flow.sport_be, frontend_port_be));
    if let Err(failed) = rewritten {
        failure::rewrite(ctx, failed);
        return DROP;
    }
    count(stat::TC_REV_NAT);
    crate::frag::remember(&flow, frontend_addr_be, flow.daddr_be, false);
    PASS
}
