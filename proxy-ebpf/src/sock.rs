//! Socket-level load balancing: `cgroup/connect4`, `sendmsg4`, `recvmsg4`, `getpeername4`.
//!
//! A local socket that connects or sends to a frontend (VIP, port, protocol) gets the address of
//! one of its backends instead, before any packet exists; replies and `getpeername` are rewritten
//! back so the application only ever sees the frontend. Addresses that are not frontends are never
//! touched (these hooks fail open): a broken lookup must not take the node's networking with it.

use aya_ebpf::{
    bindings::bpf_sock_addr,
    helpers::{bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_set_retval},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
    EbpfContext,
};
use proxy_abi::{stat, RevSock4, RevSockKey4, ServiceKey4, IPPROTO_TCP, IPPROTO_UDP, SCOPE_INTERNAL};

use crate::affinity;
use crate::maps::{count, BACKENDS4, REV_SOCK4, SERVICES4};

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
    forward(&ctx)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn epx_sendmsg4(ctx: SockAddrContext) -> i32 {
    forward(&ctx)
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

#[inline(always)]
fn forward(ctx: &SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    match try_forward(ctx, sa) {
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
fn try_forward(ctx: &SockAddrContext, sa: *mut bpf_sock_addr) -> Result<(), Refusal> {
    let Some(proto) = l4_proto(sa) else { return Ok(()) };
    let addr_be = unsafe { (*sa).user_ip4 };
    // user_port holds the port in network byte order in its low 16 bits.
    let port_be = unsafe { (*sa).user_port } as u16;

    let mut key = ServiceKey4::new(addr_be, port_be, proto, SCOPE_INTERNAL, 0);
    let Some(frontend) = SERVICES4.get_ptr(&key) else { return Ok(()) };
    let frontend = unsafe { *frontend };
    if frontend.count == 0 {
        return Err(Refusal::NoBackend);
    }

    // sessionAffinity: ClientIP. From a socket the client is its network namespace (a pod, or
    // the node), as Cilium's socket LB does: the source address is not chosen yet at connect().
    let client = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let affinity_key = affinity::key(&frontend, client, proxy_abi::affinity::CLIENT_NETNS);
    let (backend_id, backend) = match affinity_key.as_ref().and_then(|k| affinity::remembered(k, &frontend)) {
        Some(chosen) => chosen,
        None => {
            let random = unsafe { bpf_get_prandom_u32() }.rotate_left(crate::VARIANT_ROTATE);
            let slot = (random % u32::from(frontend.count)) as u16 + 1;
            key.backend_slot = slot;
            let Some(slot_value) = SERVICES4.get_ptr(&key) else { return Err(Refusal::LookupMiss) };
            let backend_id = unsafe { (*slot_value).backend_id };
            let Some(backend) = BACKENDS4.get_ptr(&backend_id) else { return Err(Refusal::LookupMiss) };
            (backend_id, unsafe { *backend })
        }
    };
    if let Some(key) = &affinity_key {
        affinity::remember(key, backend_id);
    }

    // Record the translation first, so the first reply can already be rewritten back.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let rev_key = RevSockKey4 { cookie, addr_be: backend.addr_be, port_be: backend.port_be, pad: [0; 2] };
    let rev = RevSock4 { addr_be, port_be, rev_nat_id: frontend.rev_nat_id };
    if REV_SOCK4.insert(&rev_key, &rev, 0).is_err() {
        count(stat::SOCK_REV_RECORD_FAIL);
    }

    unsafe {
        (*sa).user_ip4 = backend.addr_be;
        (*sa).user_port = u32::from(backend.port_be);
    }
    count(stat::SOCK_XLATE);
    Ok(())
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
