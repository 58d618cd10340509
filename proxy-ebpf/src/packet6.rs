//! Reading and rewriting Ethernet/IPv6/TCP/UDP headers for the TC programs: the IPv6
//! counterpart of `packet`.
//!
//! Extension headers (hop-by-hop, routing, destination options, fragment) before TCP/UDP are
//! skipped, up to a few; a later fragment (no L4 header) is reported as such, for `frag`. IPv6 has
//! no header checksum, so a rewrite only fixes the L4 checksum (through the pseudo-header for
//! addresses), with `bpf_csum_diff` over the 16-byte addresses.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    helpers::{bpf_csum_diff, bpf_skb_load_bytes},
    programs::TcContext,
};
use proxy_abi::{IPPROTO_TCP, IPPROTO_UDP};

use crate::packet::{l4_header, RewriteFailed, ETH_HLEN};

pub const ETH_P_IPV6: u16 = 0x86dd;
pub const IPV6_HLEN: usize = 40;
pub const IP6_SADDR_OFF: usize = ETH_HLEN + 8;
pub const IP6_DADDR_OFF: usize = ETH_HLEN + 24;
const NEXTHDR_HOP: u8 = 0;
const NEXTHDR_ROUTING: u8 = 43;
const NEXTHDR_FRAGMENT: u8 = 44;
const NEXTHDR_DEST: u8 = 60;
pub const IPPROTO_ICMPV6: u8 = 58;
/// Extension headers skipped before giving up (and passing the packet untouched).
const MAX_EXT_HEADERS: usize = 4;
const ICMPV6_HLEN: usize = 8;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PKT_TOOBIG: u8 = 2;
const ICMPV6_TIME_EXCEED: u8 = 3;
const ICMPV6_PARAMPROB: u8 = 4;

/// A TCP or UDP packet over IPv6. Addresses are four words in network byte order, as in the
/// packet and the maps.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Flow6 {
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    pub sport_be: u16,
    pub dport_be: u16,
    pub proto: u8,
    /// Offset of the L4 header (after any extension headers).
    pub l4_off: usize,
    /// TCP flags byte (0 for UDP).
    pub tcp_flags: u8,
    /// TCP sequence numbers (see `packet::Segment`).
    pub seq: u32,
    pub seq_end: u32,
    /// A Fragment header's identification, and whether more fragments follow (this is a first
    /// fragment; `frag` records its translation). For a later fragment ([`Parsed6::Fragment`])
    /// only the addresses, `proto` and this are set.
    pub frag_id_be: u32,
    pub more_fragments: bool,
}

impl Flow6 {
    #[inline(always)]
    pub fn l4_csum_off(&self) -> usize {
        self.l4_off + if self.proto == IPPROTO_TCP { 16 } else { 6 }
    }

    #[inline(always)]
    fn l4_csum_flags(&self) -> u64 {
        if self.proto == IPPROTO_UDP { u64::from(BPF_F_MARK_MANGLED_0) } else { 0 }
    }
}

/// An ICMPv6 error (destination unreachable, packet too big, time exceeded, parameter problem)
/// quoting a TCP/UDP packet whose IPv6 header has no extension headers.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IcmpError6 {
    pub daddr: [u32; 4],
    pub icmp_off: usize,
    pub inner: Flow6,
}

impl IcmpError6 {
    #[inline(always)]
    pub fn csum_off(&self) -> usize {
        self.icmp_off + 2
    }
    #[inline(always)]
    pub fn inner_saddr_off(&self) -> usize {
        self.icmp_off + ICMPV6_HLEN + 8
    }
    #[inline(always)]
    pub fn inner_daddr_off(&self) -> usize {
        self.icmp_off + ICMPV6_HLEN + 24
    }
}

/// What a frame is; the details of `Flow` and `IcmpError` are written into a [`Parsed6Out`]
/// (kept in a per-CPU map by the caller: the BPF stack has no room for them).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Parsed6 {
    /// Neither TCP, UDP nor an ICMPv6 error about them (neighbour discovery, echo, ...), or
    /// more extension headers than we look through.
    NotOurs,
    /// Truncated, or the payload length lies.
    BadHeader,
    /// A later fragment (offset > 0): `out.flow` holds its addresses, `proto` and `frag_id_be`.
    Fragment,
    /// `out.flow` holds the packet's tuple.
    Flow,
    /// `out.icmp` holds the error and the packet it quotes.
    IcmpError,
}

/// Where [`parse6`] writes what it read.
#[repr(C)]
pub struct Parsed6Out {
    pub flow: Flow6,
    pub icmp: IcmpError6,
}

#[inline(always)]
fn parse_icmp6_error(ctx: &TcContext, out: &mut IcmpError6, icmp_off: usize, ip_end: usize) -> Parsed6 {
    let inner_ip = icmp_off + ICMPV6_HLEN;
    let inner_l4 = inner_ip + IPV6_HLEN;
    if inner_l4 + 4 > ip_end {
        return Parsed6::NotOurs;
    }
    let (Ok(icmp_type), Ok(version), Ok(proto)) =
        (ctx.load::<u8>(icmp_off), ctx.load::<u8>(inner_ip), ctx.load::<u8>(inner_ip + 6))
    else {
        return Parsed6::NotOurs;
    };
    let quotes = matches!(icmp_type, ICMPV6_DEST_UNREACH | ICMPV6_PKT_TOOBIG | ICMPV6_TIME_EXCEED | ICMPV6_PARAMPROB);
    if !quotes || version >> 4 != 6 || (proto != IPPROTO_TCP && proto != IPPROTO_UDP) {
        return Parsed6::NotOurs;
    }
    let (Ok(sport_be), Ok(dport_be)) = (ctx.load::<u16>(inner_l4), ctx.load::<u16>(inner_l4 + 2)) else {
        return Parsed6::NotOurs;
    };
    if load_addr(ctx, IP6_DADDR_OFF, &mut out.daddr).is_err()
        || load_addr(ctx, inner_ip + 8, &mut out.inner.saddr).is_err()
        || load_addr(ctx, inner_ip + 24, &mut out.inner.daddr).is_err()
    {
        return Parsed6::NotOurs;
    }
    out.icmp_off = icmp_off;
    out.inner.sport_be = sport_be;
    out.inner.dport_be = dport_be;
    out.inner.proto = proto;
    out.inner.l4_off = inner_l4;
    out.inner.tcp_flags = 0;
    out.inner.seq = 0;
    out.inner.seq_end = 0;
    out.inner.frag_id_be = 0;
    out.inner.more_fragments = false;
    Parsed6::IcmpError
}

/// Loads 16 bytes at `off` straight into `to` (no copy on the stack).
#[inline(always)]
fn load_addr(ctx: &TcContext, off: usize, to: &mut [u32; 4]) -> Result<(), ()> {
    // SAFETY: a 16-byte destination.
    let rc = unsafe { bpf_skb_load_bytes(ctx.skb.skb.cast(), off as u32, to.as_mut_ptr().cast(), 16) };
    if rc == 0 { Ok(()) } else { Err(()) }
}

#[inline(always)]
pub fn parse6(ctx: &TcContext, out: &mut Parsed6Out) -> Parsed6 {
    let len = ctx.len() as usize;
    if len < ETH_HLEN + IPV6_HLEN {
        return Parsed6::BadHeader;
    }
    let (Ok(version), Ok(payload_len), Ok(first_next)) =
        (ctx.load::<u8>(ETH_HLEN), ctx.load::<u16>(ETH_HLEN + 4), ctx.load::<u8>(ETH_HLEN + 6))
    else {
        return Parsed6::BadHeader;
    };
    let ip_end = ETH_HLEN + IPV6_HLEN + usize::from(u16::from_be(payload_len));
    // A payload length of 0 (a jumbogram) is not handled; the frame may have padding, never less.
    if version >> 4 != 6 || payload_len == 0 || ip_end > len {
        return Parsed6::BadHeader;
    }
    let mut next = first_next;
    let mut l4_off = ETH_HLEN + IPV6_HLEN;
    out.flow.frag_id_be = 0;
    out.flow.more_fragments = false;
    for _ in 0..MAX_EXT_HEADERS {
        match next {
            NEXTHDR_FRAGMENT => {
                // next header, reserved, offset (13 bits) | 2 reserved | M, identification.
                let (Ok(following), Ok(offset_m), Ok(id_be)) =
                    (ctx.load::<u8>(l4_off), ctx.load::<u16>(l4_off + 2), ctx.load::<u32>(l4_off + 4))
                else {
                    return Parsed6::BadHeader;
                };
                let offset_m = u16::from_be(offset_m);
                out.flow.frag_id_be = id_be;
                out.flow.more_fragments = offset_m & 1 != 0;
                next = following;
                if offset_m >> 3 != 0 {
                    let flow = &mut out.flow;
                    if load_addr(ctx, IP6_SADDR_OFF, &mut flow.saddr).is_err() || load_addr(ctx, IP6_DADDR_OFF, &mut flow.daddr).is_err() {
                        return Parsed6::BadHeader;
                    }
                    flow.proto = next;
                    return Parsed6::Fragment;
                }
                l4_off += 8;
                if l4_off > ip_end {
                    return Parsed6::BadHeader;
                }
            }
            NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_DEST => {
                let (Ok(following), Ok(units)) = (ctx.load::<u8>(l4_off), ctx.load::<u8>(l4_off + 1)) else {
                    return Parsed6::BadHeader;
                };
                next = following;
                l4_off += (usize::from(units) + 1) * 8;
                if l4_off > ip_end {
                    return Parsed6::BadHeader;
                }
            }
            _ => break,
        }
    }
    let proto = next;
    if proto == IPPROTO_ICMPV6 {
        if out.flow.more_fragments {
            return Parsed6::NotOurs;
        }
        return parse_icmp6_error(ctx, &mut out.icmp, l4_off, ip_end);
    }
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return Parsed6::NotOurs;
    }
    let Ok(segment) = l4_header(ctx, proto, l4_off, ip_end) else { return Parsed6::BadHeader };
    let (Ok(sport_be), Ok(dport_be)) = (ctx.load::<u16>(l4_off), ctx.load::<u16>(l4_off + 2)) else {
        return Parsed6::BadHeader;
    };
    let flow = &mut out.flow;
    if load_addr(ctx, IP6_SADDR_OFF, &mut flow.saddr).is_err() || load_addr(ctx, IP6_DADDR_OFF, &mut flow.daddr).is_err() {
        return Parsed6::BadHeader;
    }
    flow.sport_be = sport_be;
    flow.dport_be = dport_be;
    flow.proto = proto;
    flow.l4_off = l4_off;
    flow.tcp_flags = segment.flags;
    flow.seq = segment.seq;
    flow.seq_end = segment.seq_end;
    Parsed6::Flow
}

/// The ones' complement difference between two addresses, for a `*_csum_replace` with size 0.
#[inline(always)]
fn addr_diff(old: &[u32; 4], new: &[u32; 4]) -> Result<u64, RewriteFailed> {
    // SAFETY: two 16-byte buffers, sizes given; the helper only reads them (its C signature
    // lacks the const).
    let diff = unsafe { bpf_csum_diff(old.as_ptr().cast_mut(), 16, new.as_ptr().cast_mut(), 16, 0) };
    if diff < 0 {
        return Err(RewriteFailed::rc(diff));
    }
    Ok(diff as u64)
}

/// Replaces the address at `addr_off` (source or destination) and fixes the L4 checksum, which
/// covers it through the pseudo-header.
#[inline(always)]
pub fn rewrite_addr6(ctx: &TcContext, flow: &Flow6, addr_off: usize, old: &[u32; 4], new: &[u32; 4]) -> Result<(), RewriteFailed> {
    match rewrite_addr6_rc(ctx, flow, addr_off, old, new) {
        0 => Ok(()),
        rc => Err(RewriteFailed::rc(rc)),
    }
}

/// [`rewrite_addr6`] as a helper's return code (0: done). Not inlined: a small frame of its own,
/// called often; and a plain integer, because a `Result` would be returned through a sixth
/// argument, which BPF does not have.
#[inline(never)]
fn rewrite_addr6_rc(ctx: &TcContext, flow: &Flow6, addr_off: usize, old: &[u32; 4], new: &[u32; 4]) -> i64 {
    if old == new {
        return 0;
    }
    let diff = match addr_diff(old, new) {
        Ok(diff) => diff,
        Err(failed) => return i64::from(failed.0),
    };
    if let Err(rc) = ctx.store(addr_off, new, 0) {
        return rc;
    }
    let flags = flow.l4_csum_flags() | u64::from(BPF_F_PSEUDO_HDR);
    ctx.l4_csum_replace(flow.l4_csum_off(), 0, diff, flags).err().unwrap_or(0)
}

/// Replaces the L4 port at `port_off` and fixes the L4 checksum.
#[inline(always)]
pub fn rewrite_port6(ctx: &TcContext, flow: &Flow6, port_off: usize, old: u16, new: u16) -> Result<(), RewriteFailed> {
    if old == new {
        return Ok(());
    }
    ctx.store(port_off, &new, 0).map_err(RewriteFailed::rc)?;
    ctx.l4_csum_replace(flow.l4_csum_off(), u64::from(old), u64::from(new), flow.l4_csum_flags() | 2)
        .map_err(RewriteFailed::rc)
}

/// Rewrites an address of the packet an ICMPv6 error quotes (no IPv6 header checksum): the
/// ICMPv6 checksum, which covers the quote, follows.
#[inline(always)]
pub fn rewrite_inner_addr6(ctx: &TcContext, error: &IcmpError6, addr_off: usize, old: &[u32; 4], new: &[u32; 4]) -> Result<(), RewriteFailed> {
    if old == new {
        return Ok(());
    }
    let diff = addr_diff(old, new)?;
    ctx.store(addr_off, new, 0).map_err(RewriteFailed::rc)?;
    ctx.l4_csum_replace(error.csum_off(), 0, diff, 0).map_err(RewriteFailed::rc)
}

/// Rewrites the outer destination of an ICMPv6 error: unlike ICMP, ICMPv6's checksum covers a
/// pseudo-header, so it follows.
#[inline(always)]
pub fn rewrite_outer_daddr6(ctx: &TcContext, error: &IcmpError6, new: &[u32; 4]) -> Result<(), RewriteFailed> {
    if error.daddr == *new {
        return Ok(());
    }
    let diff = addr_diff(&error.daddr, new)?;
    ctx.store(IP6_DADDR_OFF, new, 0).map_err(RewriteFailed::rc)?;
    ctx.l4_csum_replace(error.csum_off(), 0, diff, u64::from(BPF_F_PSEUDO_HDR)).map_err(RewriteFailed::rc)
}
