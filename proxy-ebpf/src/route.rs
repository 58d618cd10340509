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
        bpf_fib_lookup, BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS,
        TC_ACT_REDIRECT,
    },
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};

use crate::packet::ETH_HLEN;

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// The route lookup or the redirect failed (no route, forwarding disabled): the caller drops.
/// Holds the helper's return code (`BPF_FIB_LKUP_RET_*` for the lookup).
pub struct NoRoute(pub i64);

/// Why a packet cannot be sent on.
pub enum NotSent {
    /// The packet is larger than the MTU of the interface the route leaves by (the MTU, for
    /// the ICMP "fragmentation needed" / "packet too big" the caller answers with).
    TooBig(u16),
    Failed(NoRoute),
}

/// Where a packet goes once rewritten: the route's interface, with the next hop's Ethernet
/// address already written into the packet, or still to be resolved by the kernel.
#[derive(Clone, Copy)]
pub enum Hop {
    Resolved(u32),
    Unresolved(u32),
}

/// Looks up the route from `saddr_be` to `daddr_be`, and writes the next hop's Ethernet
/// addresses into the packet (they do not touch what the L3/L4 rewrites change). Called before
/// the packet is rewritten, so that a packet too big for that route can still be answered with
/// an ICMP error quoting it as its sender sent it.
#[inline(always)]
pub fn lookup(ctx: &TcContext, proto: u8, saddr_be: u32, daddr_be: u32) -> Result<Hop, NotSent> {
    // SAFETY: bpf_fib_lookup is plain data; all-zero is its documented "unset" state.
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    params.family = AF_INET;
    params.l4_protocol = proto;
    params.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    params.__bindgen_anon_3.ipv4_src = saddr_be;
    params.__bindgen_anon_4.ipv4_dst = daddr_be;
    fib_lookup_hop(ctx, &mut params)
}

/// [`lookup`] for IPv6.
#[inline(always)]
pub fn lookup6(ctx: &TcContext, proto: u8, saddr: &[u32; 4], daddr: &[u32; 4]) -> Result<Hop, NotSent> {
    // SAFETY: as in `lookup`.
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    params.family = AF_INET6;
    params.l4_protocol = proto;
    params.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    params.__bindgen_anon_3.ipv6_src = *saddr;
    params.__bindgen_anon_4.ipv6_dst = *daddr;
    fib_lookup_hop(ctx, &mut params)
}

/// Redirects the (already rewritten) packet to `hop`.
#[inline(always)]
pub fn send(hop: Hop) -> Result<i32, NoRoute> {
    let verdict = match hop {
        Hop::Resolved(ifindex) => unsafe { bpf_redirect(ifindex, 0) },
        // The next hop's address is not resolved yet: let the kernel's neighbour code do it.
        Hop::Unresolved(ifindex) => unsafe { bpf_redirect_neigh(ifindex, core::ptr::null_mut(), 0, 0) },
    };
    if verdict != i64::from(TC_ACT_REDIRECT) {
        return Err(NoRoute(verdict));
    }
    Ok(verdict as i32)
}

/// [`lookup`] and [`send`] at once, for a packet already rewritten (a later fragment: too big
/// counts as a failure, its first fragment got the ICMP error).
#[inline(always)]
pub fn redirect(ctx: &TcContext, proto: u8, saddr_be: u32, daddr_be: u32) -> Result<i32, NoRoute> {
    send(lookup(ctx, proto, saddr_be, daddr_be)?)
}

/// [`redirect`] for IPv6.
#[inline(always)]
pub fn redirect6(ctx: &TcContext, proto: u8, saddr: &[u32; 4], daddr: &[u32; 4]) -> Result<i32, NoRoute> {
    send(lookup6(ctx, proto, saddr, daddr)?)
}

impl From<NotSent> for NoRoute {
    /// For a packet that can no longer be answered with an ICMP error: too big is a failure.
    #[inline(always)]
    fn from(not_sent: NotSent) -> Self {
        match not_sent {
            NotSent::TooBig(_) => NoRoute(i64::from(BPF_FIB_LKUP_RET_FRAG_NEEDED)),
            NotSent::Failed(failed) => failed,
        }
    }
}

/// With `tot_len`, the helper checks that length against the route's MTU (a route `mtu`, a
/// learnt path MTU, or the device's) before it looks for the next hop's neighbour entry, and
/// returns `BPF_FIB_LKUP_RET_FRAG_NEEDED` with that MTU in `mtu_result` when it does not fit.
/// A GSO packet (TCP segments aggregated by the sender or by GRO) is left to the helper's
/// check without `tot_len`, which counts it forwardable (it may be segmented on the way out),
/// as the kernel's forwarding would check its segments; its segment size is not compared here.
#[inline(always)]
fn fib_lookup_hop(ctx: &TcContext, params: &mut bpf_fib_lookup) -> Result<Hop, NotSent> {
    let skb = unsafe { &*ctx.skb.skb };
    if skb.gso_size == 0 {
        params.__bindgen_anon_1.tot_len = skb.len.saturating_sub(ETH_HLEN as u32) as u16;
    }
    let rc = unsafe {
        fib_lookup(
            ctx.skb.skb.cast(),
            params,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    if rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
        let mut macs = [0u8; 12];
        macs[..6].copy_from_slice(&params.dmac);
        macs[6..].copy_from_slice(&params.smac);
        ctx.store(0, &macs, 0).map_err(|rc| NotSent::Failed(NoRoute(rc)))?;
        Ok(Hop::Resolved(params.ifindex))
    } else if rc == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        Ok(Hop::Unresolved(params.ifindex))
    } else if rc == i64::from(BPF_FIB_LKUP_RET_FRAG_NEEDED) {
        Err(NotSent::TooBig(unsafe { params.__bindgen_anon_1.mtu_result }))
    } else {
        Err(NotSent::Failed(NoRoute(rc)))
    }
}
