//! Sending a packet on ourselves: a FIB lookup, new Ethernet addresses, and a redirect to the
//! egress of the interface the route names.
//!
//! Needed for SNATed packets: their source (or, for replies, their destination's reply source)
//! is one of the node's own addresses, which the kernel's input routing rejects as a martian
//! source. The lookup is the one the kernel's forwarding would make for a packet arriving on this
//! interface (so it needs forwarding enabled, as any router), minus the source check.
//! (`BPF_FIB_LOOKUP_OUTPUT` would pin the output device to the ingress interface.)

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_REDIRECT,
    },
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// The route lookup or the redirect failed (no route, forwarding disabled, too big): the caller
/// drops. Holds the helper's return code (`BPF_FIB_LKUP_RET_*` for the lookup).
pub struct NoRoute(pub i64);

/// Redirects the (already rewritten) packet from `saddr_be` to `daddr_be` out of the interface
/// the node's routing table picks, with that route's next hop as the Ethernet destination.
#[inline(always)]
pub fn redirect(ctx: &TcContext, proto: u8, saddr_be: u32, daddr_be: u32) -> Result<i32, NoRoute> {
    // SAFETY: bpf_fib_lookup is plain data; all-zero is its documented "unset" state.
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    params.family = AF_INET;
    params.l4_protocol = proto;
    params.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    params.__bindgen_anon_3.ipv4_src = saddr_be;
    params.__bindgen_anon_4.ipv4_dst = daddr_be;
    lookup_and_redirect(ctx, &mut params)
}

/// [`redirect`] for IPv6.
#[inline(always)]
pub fn redirect6(ctx: &TcContext, proto: u8, saddr: &[u32; 4], daddr: &[u32; 4]) -> Result<i32, NoRoute> {
    // SAFETY: as in `redirect`.
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    params.family = AF_INET6;
    params.l4_protocol = proto;
    params.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    params.__bindgen_anon_3.ipv6_src = *saddr;
    params.__bindgen_anon_4.ipv6_dst = *daddr;
    lookup_and_redirect(ctx, &mut params)
}

#[inline(always)]
fn lookup_and_redirect(ctx: &TcContext, params: &mut bpf_fib_lookup) -> Result<i32, NoRoute> {
    let rc = unsafe {
        fib_lookup(
            ctx.skb.skb.cast(),
            params,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    let verdict = if rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
        let mut macs = [0u8; 12];
        macs[..6].copy_from_slice(&params.dmac);
        macs[6..].copy_from_slice(&params.smac);
        ctx.store(0, &macs, 0).map_err(NoRoute)?;
        unsafe { bpf_redirect(params.ifindex, 0) }
    } else if rc == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        // The next hop's address is not resolved yet: let the kernel's neighbour code do it.
        unsafe { bpf_redirect_neigh(params.ifindex, core::ptr::null_mut(), 0, 0) }
    } else {
        return Err(NoRoute(rc));
    };
    if verdict != i64::from(TC_ACT_REDIRECT) {
        return Err(NoRoute(verdict));
    }
    Ok(verdict as i32)
}
