//! Socket-level load balancing: `cgroup/connect4`, `sendmsg4`, `recvmsg4`, `getpeername4`, and
//! their IPv6 twins. An IPv6 socket that connects to an IPv4-mapped address (`::ffff:a.b.c.d`,
//! a dual-stack socket reaching an IPv4 Service) is translated through the IPv4 maps.
//!
//! A local socket that connects or sends to a frontend (VIP, port, protocol) gets the address of
//! one of its backends instead, before any packet exists; replies and `getpeername` are rewritten
//! back so the application only ever sees the frontend. Addresses that are not frontends are never
//! touched (these hooks fail open): a broken lookup must not take the node's networking with it.

use aya_ebpf::{
    bindings::bpf_sock_addr,
    helpers::{bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_ktime_get_ns, bpf_set_retval},
    macros::cgroup_sock_addr,
    maps::{HashMap, LruHashMap},
    programs::SockAddrContext,
    EbpfContext,
};
use proxy_abi::{
    sock_flow, stat, svc_flags, AffinityKey4, BackendId, RevSock4, RevSock6, RevSockKey4, RevSockKey6, ServiceKey4, ServiceKey6, ServiceValue4,
    SockFlow, SockFlowKey4, SockFlowKey6, IPPROTO_TCP, IPPROTO_UDP, SCOPE_INTERNAL,
};

use crate::affinity;
use crate::maps::{count, BACKENDS4, BACKENDS6, REV_SOCK4, REV_SOCK6, SERVICES4, SERVICES6, SOCK_FLOW4, SOCK_FLOW6};

/// Return value of a cgroup sock_addr program: let the syscall go on.
const SYSCALL_PROCEED: i32 = 1;
/// Return value that fails the syscall with whatever `bpf_set_retval` set.
const SYSCALL_REJECT: i32 = 0;
const ECONNREFUSED: i32 = 111;

/// Why a forward translation did not happen.
enum Refusal {
    /// The frontend exists but has no usable backend: kube-proxy REJECTs, so do we.
    NoBackend,
    /// A slot or backend entry vanished between lookups (agent mid-update).
    LookupMiss,
}

#[cgroup_sock_addr(connect4)]
pub fn epx_connect4(ctx: SockAddrContext) -> i32 {
    forward(&ctx, Call::Connect)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn epx_sendmsg4(ctx: SockAddrContext) -> i32 {
    forward(&ctx, Call::SendMsg)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn epx_recvmsg4(ctx: SockAddrContext) -> i32 {
    reverse(&ctx);
    // recvmsg hooks must return 1; they cannot fail the syscall.
    SYSCALL_PROCEED
}

#[cgroup_sock_addr(getpeername4)]
pub fn epx_getpeername4(ctx: SockAddrContext) -> i32 {
    reverse(&ctx);
    SYSCALL_PROCEED
}

#[cgroup_sock_addr(connect6)]
pub fn epx_connect6(ctx: SockAddrContext) -> i32 {
    forward6(&ctx, Call::Connect)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn epx_sendmsg6(ctx: SockAddrContext) -> i32 {
    forward6(&ctx, Call::SendMsg)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn epx_recvmsg6(ctx: SockAddrContext) -> i32 {
    reverse6(&ctx);
    SYSCALL_PROCEED
}

#[cgroup_sock_addr(getpeername6)]
pub fn epx_getpeername6(ctx: SockAddrContext) -> i32 {
    reverse6(&ctx);
    SYSCALL_PROCEED
}

/// Which syscall a forward translation runs for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Call {
    /// connect(): the socket's peer is fixed from now on; translated once.
    Connect,
    /// sendmsg() with a destination on an unconnected UDP socket: translated per datagram, so
    /// the socket's choice for the frontend is remembered (`epx_sflow*`) and its later
    /// datagrams follow it, as kube-proxy keeps a UDP 5-tuple on its conntrack entry's backend.
    /// Protocols with state across datagrams (SIP, media, game servers) need it.
    SendMsg,
}

#[inline(always)]
fn forward(ctx: &SockAddrContext, call: Call) -> i32 {
    verdict(try_forward(ctx, ctx.sock_addr, call))
}

#[inline(always)]
fn forward6(ctx: &SockAddrContext, call: Call) -> i32 {
    verdict(try_forward6(ctx, ctx.sock_addr, call))
}

/// The backend id a socket's earlier datagrams to this frontend went to, if that was within the
/// idle timeout and for this frontend (not one since recreated with another reverse-NAT id).
/// Refreshes the entry's clock in place when it is due, not on every datagram.
#[inline(always)]
fn sticky_backend_id(entry: Option<*mut SockFlow>, frontend: &ServiceValue4, now: u64) -> Option<u32> {
    // SAFETY: a pointer into the map's value, valid for this program run; a racing refresh by
    // another CPU writes a clock value just as good.
    let flow = unsafe { &mut *entry? };
    if flow.rev_nat_id != frontend.rev_nat_id || sock_flow::is_idle(flow.last_used_ns, now) {
        return None;
    }
    if now.saturating_sub(flow.last_used_ns) > sock_flow::REFRESH_NS {
        flow.last_used_ns = now;
    }
    Some(flow.backend_id)
}

/// Whether a datagram of this call to this frontend follows its socket's earlier choice. With
/// session affinity the client's network namespace already decides, for every socket.
#[inline(always)]
fn is_sticky(call: Call, frontend: &ServiceValue4) -> bool {
    call == Call::SendMsg && frontend.flags & svc_flags::AFFINITY == 0
}

/// `::ffff:0:0/96`, the third word of an IPv4-mapped IPv6 address (network byte order).
const V4_MAPPED_WORD: u32 = 0x0000_ffff_u32.to_be();

/// The IPv4 address (network byte order) inside an IPv4-mapped IPv6 address.
#[inline(always)]
fn v4_mapped(addr: &[u32; 4]) -> Option<u32> {
    (addr[0] == 0 && addr[1] == 0 && addr[2] == V4_MAPPED_WORD).then_some(addr[3])
}

#[inline(always)]
fn user_ip6(sa: *mut bpf_sock_addr) -> [u32; 4] {
    // Four 4-byte loads: the only access width the verifier allows on this field.
    unsafe { [(*sa).user_ip6[0], (*sa).user_ip6[1], (*sa).user_ip6[2], (*sa).user_ip6[3]] }
}

#[inline(always)]
fn set_user_ip6(sa: *mut bpf_sock_addr, addr: &[u32; 4]) {
    unsafe {
        (*sa).user_ip6[0] = addr[0];
        (*sa).user_ip6[1] = addr[1];
        (*sa).user_ip6[2] = addr[2];
        (*sa).user_ip6[3] = addr[3];
    }
}

/// IPv6 connect/sendmsg: an IPv6 frontend through the IPv6 maps; an IPv4-mapped address through
/// the IPv4 maps (the backend is written back IPv4-mapped).
#[inline(always)]
fn try_forward6(ctx: &SockAddrContext, sa: *mut bpf_sock_addr, call: Call) -> Result<(), Refusal> {
    let Some(proto) = l4_proto(sa) else { return Ok(()) };
    let addr = user_ip6(sa);
    let port_be = unsafe { (*sa).user_port } as u16;
    if let Some(addr_be) = v4_mapped(&addr) {
        let Some((backend_addr_be, backend_port_be)) = translate4(ctx, addr_be, port_be, proto, call)? else { return Ok(()) };
        set_user_ip6(sa, &[0, 0, V4_MAPPED_WORD, backend_addr_be]);
        unsafe { (*sa).user_port = u32::from(backend_port_be) };
        count(stat::SOCK_XLATE);
        return Ok(());
    }

    let mut key = ServiceKey6::new(addr, port_be, proto, SCOPE_INTERNAL, 0);
    let Some(frontend) = SERVICES6.get_ptr(&key) else { return Ok(()) };
    let frontend = unsafe { *frontend };
    if frontend.count == 0 {
        return Err(Refusal::NoBackend);
    }
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let now = unsafe { bpf_ktime_get_ns() };
    let flow_key = is_sticky(call, &frontend).then_some(SockFlowKey6 { cookie, addr, port_be, pad: [0; 6] });
    let slot_backend = |slot| {
        key.backend_slot = slot;
        SERVICES6.get_ptr(&key).map(|v| unsafe { (*v).backend_id })
    };
    let backend = choose_backend(ctx, &frontend, &SOCK_FLOW6, flow_key.as_ref(), &BACKENDS6, affinity::remembered6, slot_backend, now)?;
    let rev_key = RevSockKey6 { cookie, addr: backend.addr, port_be: backend.port_be, pad: [0; 6] };
    record_reverse(&REV_SOCK6, &rev_key, &RevSock6 { addr, port_be, rev_nat_id: frontend.rev_nat_id });
    set_user_ip6(sa, &backend.addr);
    unsafe { (*sa).user_port = u32::from(backend.port_be) };
    count(stat::SOCK_XLATE);
    Ok(())
}

#[inline(always)]
fn reverse6(ctx: &SockAddrContext) {
    let sa = ctx.sock_addr;
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let addr = user_ip6(sa);
    let port_be = unsafe { (*sa).user_port } as u16;
    if let Some(addr_be) = v4_mapped(&addr) {
        let key = RevSockKey4 { cookie, addr_be, port_be, pad: [0; 2] };
        let Some(rev) = REV_SOCK4.get_ptr(&key) else { return };
        let rev = unsafe { *rev };
        set_user_ip6(sa, &[0, 0, V4_MAPPED_WORD, rev.addr_be]);
        unsafe { (*sa).user_port = u32::from(rev.port_be) };
        count(stat::SOCK_REV_XLATE);
        return;
    }
    let key = RevSockKey6 { cookie, addr, port_be, pad: [0; 6] };
    let Some(rev) = REV_SOCK6.get_ptr(&key) else { return };
    let rev = unsafe { *rev };
    set_user_ip6(sa, &rev.addr);
    unsafe { (*sa).user_port = u32::from(rev.port_be) };
    count(stat::SOCK_REV_XLATE);
}

/// A random backend slot of a frontend with backends (1..=count).
#[inline(always)]
fn random_slot(frontend: &ServiceValue4) -> u16 {
    let random = unsafe { bpf_get_prandom_u32() }.rotate_left(crate::VARIANT_ROTATE);
    (random % u32::from(frontend.count)) as u16 + 1
}

#[inline(always)]
fn verdict(result: Result<(), Refusal>) -> i32 {
    match result {
        Ok(()) => SYSCALL_PROCEED,
        Err(refusal) => {
            count(match refusal {
                Refusal::NoBackend => stat::SOCK_NO_BACKEND,
                Refusal::LookupMiss => stat::SOCK_LOOKUP_MISS,
            });
            // connect() and sendmsg() fail with ECONNREFUSED, as with kube-proxy's REJECT rule,
            // instead of the EPERM a bare `return 0` would give.
            unsafe { bpf_set_retval(-ECONNREFUSED) };
            SYSCALL_REJECT
        }
    }
}

#[inline(always)]
fn l4_proto(sa: *mut bpf_sock_addr) -> Option<u8> {
    match unsafe { (*sa).protocol } {
        p if p == u32::from(IPPROTO_TCP) => Some(IPPROTO_TCP),
        p if p == u32::from(IPPROTO_UDP) => Some(IPPROTO_UDP),
        _ => None,
    }
}

#[inline(always)]
fn try_forward(ctx: &SockAddrContext, sa: *mut bpf_sock_addr, call: Call) -> Result<(), Refusal> {
    let Some(proto) = l4_proto(sa) else { return Ok(()) };
    let addr_be = unsafe { (*sa).user_ip4 };
    // user_port holds the port in network byte order in its low 16 bits.
    let port_be = unsafe { (*sa).user_port } as u16;
    let Some((backend_addr_be, backend_port_be)) = translate4(ctx, addr_be, port_be, proto, call)? else { return Ok(()) };
    unsafe {
        (*sa).user_ip4 = backend_addr_be;
        (*sa).user_port = u32::from(backend_port_be);
    }
    count(stat::SOCK_XLATE);
    Ok(())
}

/// The backend (address, port; network byte order) for a connection to an IPv4 frontend, with
/// the reverse translation recorded; None if the address is no frontend.
#[inline(always)]
fn translate4(
    ctx: &SockAddrContext,
    addr_be: u32,
    port_be: u16,
    proto: u8,
    call: Call,
) -> Result<Option<(u32, u16)>, Refusal> {
    let mut key = ServiceKey4::new(addr_be, port_be, proto, SCOPE_INTERNAL, 0);
    let Some(frontend) = SERVICES4.get_ptr(&key) else { return Ok(None) };
    let frontend = unsafe { *frontend };
    if frontend.count == 0 {
        return Err(Refusal::NoBackend);
    }

    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let now = unsafe { bpf_ktime_get_ns() };
    let flow_key = is_sticky(call, &frontend).then_some(SockFlowKey4 { cookie, addr_be, port_be, pad: [0; 2] });
    let slot_backend = |slot| {
        key.backend_slot = slot;
        SERVICES4.get_ptr(&key).map(|v| unsafe { (*v).backend_id })
    };
    let backend = choose_backend(ctx, &frontend, &SOCK_FLOW4, flow_key.as_ref(), &BACKENDS4, affinity::remembered, slot_backend, now)?;

    // Record the translation first, so the first reply can already be rewritten back.
    let rev_key = RevSockKey4 { cookie, addr_be: backend.addr_be, port_be: backend.port_be, pad: [0; 2] };
    record_reverse(&REV_SOCK4, &rev_key, &RevSock4 { addr_be, port_be, rev_nat_id: frontend.rev_nat_id });
    Ok(Some((backend.addr_be, backend.port_be)))
}

/// The backend of a translation to a frontend with backends: the socket's earlier one (sendmsg,
/// `flow_key`), else the client's under session affinity (`remembered`), else the one of a
/// random slot (`slot_backend` reads a slot's backend id). A new choice is remembered for both.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn choose_backend<K, B: Copy>(
    ctx: &SockAddrContext,
    frontend: &ServiceValue4,
    flows: &LruHashMap<K, SockFlow>,
    flow_key: Option<&K>,
    backends: &HashMap<BackendId, B>,
    remembered: impl FnOnce(&AffinityKey4, &ServiceValue4) -> Option<(u32, B)>,
    slot_backend: impl FnOnce(u16) -> Option<u32>,
    now: u64,
) -> Result<B, Refusal> {
    let sticky = flow_key.and_then(|k| {
        let backend_id = sticky_backend_id(flows.get_ptr_mut(k), frontend, now)?;
        Some(unsafe { *backends.get_ptr(&backend_id)? })
    });
    if let Some(backend) = sticky {
        count(stat::SOCK_FLOW_HIT);
        return Ok(backend);
    }
    // sessionAffinity: ClientIP. From a socket the client is its network namespace (a pod, or
    // the node), as Cilium's socket LB does: the source address is not chosen yet at connect().
    let client = || proxy_abi::affinity::netns_client(unsafe { bpf_get_netns_cookie(ctx.as_ptr()) });
    let affinity_key = affinity::key(frontend, client, proxy_abi::affinity::CLIENT_NETNS);
    let (backend_id, backend) = match affinity_key.as_ref().and_then(|k| remembered(k, frontend)) {
        Some(chosen) => chosen,
        None => {
            let backend_id = slot_backend(random_slot(frontend)).ok_or(Refusal::LookupMiss)?;
            let backend = backends.get_ptr(&backend_id).ok_or(Refusal::LookupMiss)?;
            (backend_id, unsafe { *backend })
        }
    };
    if let Some(key) = &affinity_key {
        affinity::remember(key, backend_id);
    }
    if let Some(key) = flow_key {
        remember_flow(flows, key, backend_id, frontend, now);
    }
    Ok(backend)
}

/// Records a socket's choice of backend for a frontend (a new pick, or the old one timed out).
#[inline(always)]
fn remember_flow<K>(map: &LruHashMap<K, SockFlow>, key: &K, backend_id: u32, frontend: &ServiceValue4, now: u64) {
    let flow = SockFlow { last_used_ns: now, backend_id, rev_nat_id: frontend.rev_nat_id, pad: [0; 2] };
    if let Err(rc) = map.insert(key, &flow, 0) {
        crate::failure::map_insert(stat::SOCK_FLOW_RECORD_FAIL, "the unconnected UDP flow map", rc);
    }
}

/// Records the reverse translation of a socket's backend, unless it is there already: an
/// unconnected socket comes here for every datagram, and an LRU update takes a lock and
/// allocates while a lookup does neither (the lookup also marks the entry as recently used).
#[inline(always)]
fn record_reverse<K, V: PartialEq>(map: &LruHashMap<K, V>, key: &K, rev: &V) {
    if let Some(held) = map.get_ptr(key) {
        if unsafe { &*held } == rev {
            return;
        }
    }
    if let Err(rc) = map.insert(key, rev, 0) {
        crate::failure::map_insert(stat::SOCK_REV_RECORD_FAIL, "the socket reverse-translation map", rc);
    }
}

#[inline(always)]
fn reverse(ctx: &SockAddrContext) {
    let sa = ctx.sock_addr;
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let key = RevSockKey4 {
        cookie,
        addr_be: unsafe { (*sa).user_ip4 },
        port_be: unsafe { (*sa).user_port } as u16,
        pad: [0; 2],
    };
    let Some(rev) = REV_SOCK4.get_ptr(&key) else { return };
    let rev = unsafe { *rev };
    unsafe {
        (*sa).user_ip4 = rev.addr_be;
        (*sa).user_port = u32::from(rev.port_be);
    }
    count(stat::SOCK_REV_XLATE);
}
