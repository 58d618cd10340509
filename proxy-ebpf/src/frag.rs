//! Fragmented datagrams (UDP larger than the path MTU, mostly): only the first fragment carries
//! the ports, so it is translated as any packet of its flow, and its translation is recorded
//! under the datagram's reassembly key (addresses, IP identification, protocol); each later
//! fragment then gets the same addresses (and is sent on by the program when the first one was).
//! The L4 checksum sits in the first fragment and covers the whole datagram, so the first
//! fragment's incremental update already accounts for every address change.
//!
//! kube-proxy gets this from netfilter's defragmentation before NAT; here nothing is held back
//! or reassembled. A later fragment that arrives before its first one (reordered on the way)
//! finds no translation and passes untouched (`tc_fragment`): that datagram is lost, as it would
//! be to any stateless translator.

use aya_ebpf::{bindings::TC_ACT_OK, programs::TcContext};
use proxy_abi::{ct, stat, FragKey4, FragKey6, FragValue4, FragValue6};

use crate::ct::now_ns;
use crate::maps::{count, FRAG4, FRAG6};
use crate::packet::{Flow, LaterFragment, RewriteFailed, IP_CSUM_OFF, IP_DADDR_OFF, IP_SADDR_OFF};
use crate::packet6::{Flow6, IP6_DADDR_OFF, IP6_SADDR_OFF};
use crate::{failure, route};

const PASS: i32 = TC_ACT_OK as i32;
const DROP: i32 = aya_ebpf::bindings::TC_ACT_SHOT as i32;

/// After `flow`'s packet was translated to `saddr_be -> daddr_be`: if it is a first fragment,
/// the later ones get the same (`redirect`: the program sent it on itself).
#[inline(always)]
pub fn remember(flow: &Flow, saddr_be: u32, daddr_be: u32, redirect: bool) {
    if !flow.more_fragments {
        return;
    }
    let key = FragKey4 { saddr_be: flow.saddr_be, daddr_be: flow.daddr_be, id_be: flow.ip_id_be, proto: flow.proto, pad: 0 };
    let value = FragValue4 { saddr_be, daddr_be, created_ns: now_ns(), redirect: u8::from(redirect), pad: [0; 7] };
    let _ = FRAG4.insert(&key, &value, 0);
}

/// A later IPv4 fragment: the translation of its first fragment, or untouched (counted on
/// ingress; egress also sees what the programs sent on themselves, already translated, and
/// passes unknown fragments as it passes unknown flows). Inlined: its locals share the IPv4
/// ingress frame's slots (a frame of its own on top of that one goes past BPF's 512-byte stack).
#[inline(always)]
pub fn later(ctx: &TcContext, fragment: &LaterFragment, ingress: bool) -> i32 {
    let key = FragKey4 {
        saddr_be: fragment.saddr_be,
        daddr_be: fragment.daddr_be,
        id_be: fragment.id_be,
        proto: fragment.proto,
        pad: 0,
    };
    let value = FRAG4.get_ptr(&key).map(|v| unsafe { *v }).filter(|v| now_ns().saturating_sub(v.created_ns) <= ct::FRAGMENT_TIMEOUT_NS);
    let Some(value) = value else {
        if ingress {
            count(stat::TC_FRAGMENT);
        }
        return PASS;
    };
    let rewritten = rewrite_ip(ctx, IP_SADDR_OFF, fragment.saddr_be, value.saddr_be)
        .and_then(|()| rewrite_ip(ctx, IP_DADDR_OFF, fragment.daddr_be, value.daddr_be));
    if let Err(failed) = rewritten {
        failure::rewrite(ctx, failed);
        return DROP;
    }
    count(stat::TC_FRAGMENT_XLATE);
    if value.redirect == 0 {
        return PASS;
    }
    match route::redirect(ctx, fragment.proto, value.saddr_be, value.daddr_be) {
        Ok(verdict) => verdict,
        Err(failed) => {
            failure::route(ctx, failed);
            DROP
        }
    }
}

/// An IPv4 address of a packet without its L4 header: only the IP checksum follows.
#[inline(always)]
fn rewrite_ip(ctx: &TcContext, off: usize, old: u32, new: u32) -> Result<(), RewriteFailed> {
    if old == new {
        return Ok(());
    }
    ctx.store(off, &new, 0).map_err(RewriteFailed::rc)?;
    ctx.l3_csum_replace(IP_CSUM_OFF, u64::from(old), u64::from(new), 4).map_err(RewriteFailed::rc)
}

/// [`remember`] for IPv6.
#[inline(never)]
pub fn remember6(flow: &Flow6, saddr: &[u32; 4], daddr: &[u32; 4], redirect: bool) {
    if !flow.more_fragments {
        return;
    }
    let key = FragKey6 { saddr: flow.saddr, daddr: flow.daddr, id_be: flow.frag_id_be, proto: flow.proto, pad: [0; 3] };
    let value = FragValue6 { saddr: *saddr, daddr: *daddr, created_ns: now_ns(), redirect: u8::from(redirect), pad: [0; 7] };
    let _ = FRAG6.insert(&key, &value, 0);
}

/// [`later`] for IPv6 (`flow` as `packet6::parse6` leaves it for a later fragment). IPv6 has
/// no header checksum, and the fragment no L4 header: only the addresses change.
#[inline(never)]
pub fn later6(ctx: &TcContext, flow: &Flow6, ingress: bool) -> i32 {
    let key = FragKey6 { saddr: flow.saddr, daddr: flow.daddr, id_be: flow.frag_id_be, proto: flow.proto, pad: [0; 3] };
    let value = FRAG6.get_ptr(&key).filter(|v| now_ns().saturating_sub(unsafe { (**v).created_ns }) <= ct::FRAGMENT_TIMEOUT_NS);
    let Some(value) = value else {
        if ingress {
            count(stat::TC_FRAGMENT);
        }
        return PASS;
    };
    let value = unsafe { &*value };
    if let Err(rc) = ctx.store(IP6_SADDR_OFF, &value.saddr, 0).and_then(|()| ctx.store(IP6_DADDR_OFF, &value.daddr, 0)) {
        failure::rewrite(ctx, RewriteFailed::rc(rc));
        return DROP;
    }
    count(stat::TC_FRAGMENT_XLATE);
    if value.redirect == 0 {
        return PASS;
    }
    match route::redirect6(ctx, flow.proto, &value.saddr, &value.daddr) {
        Ok(verdict) => verdict,
        Err(failed) => {
            failure::route(ctx, failed);
            DROP
        }
    }
}
