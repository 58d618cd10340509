//! Reading and rewriting Ethernet/IPv4/TCP/UDP headers for the TC programs.
//!
//! Every access goes through `bpf_skb_load_bytes`/`bpf_skb_store_bytes` (`ctx.load`/`ctx.store`),
//! which also work on non-linear skbs and leave the bounds checks to the kernel; the explicit
//! length checks here are about the packet lying (IHL or total length beyond the data), not about
//! memory safety. Checksums are updated incrementally with `bpf_l3_csum_replace` and
//! `bpf_l4_csum_replace`, which also handle CHECKSUM_PARTIAL skbs from local veths.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use proxy_abi::{IPPROTO_TCP, IPPROTO_UDP};

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
const IPV4_MIN_HLEN: usize = 20;
pub const IP_CSUM_OFF: usize = ETH_HLEN + 10;
pub const IP_SADDR_OFF: usize = ETH_HLEN + 12;
pub const IP_DADDR_OFF: usize = ETH_HLEN + 16;
const TCP_MIN_HLEN: usize = 20;
const UDP_HLEN: usize = 8;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// A TCP or UDP packet over IPv4, with the fields the load balancer needs. Addresses and ports
/// are kept in network byte order, exactly as in the packet and in the maps.
#[derive(Clone, Copy)]
pub struct Flow {
    pub saddr_be: u32,
    pub daddr_be: u32,
    pub sport_be: u16,
    pub dport_be: u16,
    pub proto: u8,
    /// Offset of the L4 header (Ethernet + IHL).
    pub l4_off: usize,
    /// TCP flags byte (0 for UDP).
    pub tcp_flags: u8,
    /// IPv4 header length in bytes (20 without options).
    pub ip_hlen: usize,
    /// TCP sequence number and the one after this segment (host byte order; 0 for UDP).
    pub seq: u32,
    pub seq_end: u32,
    /// The IP identification, and whether more fragments follow (this is a first fragment):
    /// its translation is then recorded for the later ones (`frag`).
    pub ip_id_be: u16,
    pub more_fragments: bool,
}

impl Flow {
    /// Offset of the L4 checksum field.
    #[inline(always)]
    pub fn l4_csum_off(&self) -> usize {
        self.l4_off + if self.proto == IPPROTO_TCP { 16 } else { 6 }
    }

    /// Flags for `bpf_l4_csum_replace`: a UDP checksum of 0 means "none" and must stay 0, and a
    /// computed 0 must be written as 0xffff.
    #[inline(always)]
    fn l4_csum_flags(&self) -> u64 {
        if self.proto == IPPROTO_UDP { u64::from(BPF_F_MARK_MANGLED_0) } else { 0 }
    }
}

/// What a frame is, as far as the load balancer cares.
pub enum Parsed {
    /// Not IPv4 (ARP, IPv6, VLAN, ...), or IPv4 but neither TCP nor UDP: not ours.
    NotOurs,
    /// An IPv4 header that is truncated or lies about its lengths.
    BadHeader,
    /// A later IPv4 fragment (offset > 0): no ports; it follows its first fragment (`frag`).
    Fragment(LaterFragment),
    Flow(Flow),
    /// An ICMP error (destination unreachable, e.g. "fragmentation needed", time exceeded,
    /// parameter problem) quoting a TCP/UDP packet.
    IcmpError(IcmpError),
}

/// A fragment without the L4 header: what identifies its datagram.
#[derive(Clone, Copy)]
pub struct LaterFragment {
    pub saddr_be: u32,
    pub daddr_be: u32,
    pub id_be: u16,
    pub proto: u8,
}

/// `frag_off`'s More Fragments bit, and its offset bits.
const IP_MF: u16 = 0x2000;
const IP_OFFSET_MASK: u16 = 0x1fff;

const IPPROTO_ICMP: u8 = 1;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETERPROB: u8 = 12;
const ICMP_HLEN: usize = 8;

/// An ICMP error and the packet it quotes (the packet as it was sent, so its source is the
/// error's destination).
#[derive(Clone, Copy)]
pub struct IcmpError {
    pub daddr_be: u32,
    /// Offset of the ICMP header.
    pub icmp_off: usize,
    /// The quoted packet's tuple.
    pub inner: Flow,
}

impl IcmpError {
    #[inline(always)]
    pub fn csum_off(&self) -> usize {
        self.icmp_off + 2
    }
    #[inline(always)]
    fn inner_ip_off(&self) -> usize {
        self.icmp_off + ICMP_HLEN
    }
    #[inline(always)]
    pub fn inner_saddr_off(&self) -> usize {
        self.inner_ip_off() + 12
    }
    #[inline(always)]
    pub fn inner_daddr_off(&self) -> usize {
        self.inner_ip_off() + 16
    }
    #[inline(always)]
    pub fn inner_sport_off(&self) -> usize {
        self.inner.l4_off
    }
    #[inline(always)]
    pub fn inner_dport_off(&self) -> usize {
        self.inner.l4_off + 2
    }
}

/// The quoted packet of an ICMP error at `l4_off`, if it is one we could have translated: an
/// error type that quotes, an IPv4 header without options, TCP or UDP, not a later fragment.
/// The quote only has the first 8 bytes of L4, so the inner tuple is all that is read.
#[inline(always)]
fn parse_icmp_error(ctx: &TcContext, daddr_be: u32, l4_off: usize, ip_end: usize) -> Parsed {
    let inner_ip = l4_off + ICMP_HLEN;
    if inner_ip + IPV4_MIN_HLEN + 4 > ip_end {
        return Parsed::NotOurs;
    }
    let (Ok(icmp_type), Ok(version_ihl), Ok(frag_off), Ok(proto)) = (
        ctx.load::<u8>(l4_off),
        ctx.load::<u8>(inner_ip),
        ctx.load::<u16>(inner_ip + 6),
        ctx.load::<u8>(inner_ip + 9),
    ) else {
        return Parsed::NotOurs;
    };
    let quotes = matches!(icmp_type, ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAMETERPROB);
    if !quotes
        || version_ihl != 0x45
        || (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
        || u16::from_be(frag_off) & IP_OFFSET_MASK != 0
    {
        return Parsed::NotOurs;
    }
    let inner_l4 = inner_ip + IPV4_MIN_HLEN;
    let (Ok(saddr_be), Ok(inner_daddr_be), Ok(sport_be), Ok(dport_be)) = (
        ctx.load::<u32>(inner_ip + 12),
        ctx.load::<u32>(inner_ip + 16),
        ctx.load::<u16>(inner_l4),
        ctx.load::<u16>(inner_l4 + 2),
    ) else {
        return Parsed::NotOurs;
    };
    let inner = Flow {
        saddr_be,
        daddr_be: inner_daddr_be,
        sport_be,
        dport_be,
        proto,
        l4_off: inner_l4,
        tcp_flags: 0,
        ip_hlen: IPV4_MIN_HLEN,
        seq: 0,
        seq_end: 0,
        ip_id_be: 0,
        more_fragments: false,
    };
    Parsed::IcmpError(IcmpError { daddr_be, icmp_off: l4_off, inner })
}

/// An IPv4 frame (the caller has checked the ethertype).
#[inline(always)]
pub fn parse(ctx: &TcContext) -> Parsed {
    let len = ctx.len() as usize;
    if len < ETH_HLEN + IPV4_MIN_HLEN {
        return Parsed::BadHeader;
    }
    let Ok(version_ihl) = ctx.load::<u8>(ETH_HLEN) else { return Parsed::BadHeader };
    let ip_hlen = usize::from(version_ihl & 0x0f) * 4;
    if version_ihl >> 4 != 4 || ip_hlen < IPV4_MIN_HLEN || ETH_HLEN + ip_hlen > len {
        return Parsed::BadHeader;
    }
    let Ok(tot_len) = ctx.load::<u16>(ETH_HLEN + 2) else { return Parsed::BadHeader };
    let tot_len = usize::from(u16::from_be(tot_len));
    // The frame may be longer (Ethernet padding), never shorter.
    if tot_len < ip_hlen || ETH_HLEN + tot_len > len {
        return Parsed::BadHeader;
    }
    let Ok(frag_off) = ctx.load::<u16>(ETH_HLEN + 6) else { return Parsed::BadHeader };
    let Ok(proto) = ctx.load::<u8>(ETH_HLEN + 9) else { return Parsed::BadHeader };
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP && proto != IPPROTO_ICMP {
        return Parsed::NotOurs;
    }
    let frag_off = u16::from_be(frag_off);
    let Ok(ip_id_be) = ctx.load::<u16>(ETH_HLEN + 4) else { return Parsed::BadHeader };
    if frag_off & IP_OFFSET_MASK != 0 {
        if proto == IPPROTO_ICMP {
            return Parsed::NotOurs;
        }
        let (Ok(saddr_be), Ok(daddr_be)) = (ctx.load::<u32>(IP_SADDR_OFF), ctx.load::<u32>(IP_DADDR_OFF)) else {
            return Parsed::BadHeader;
        };
        return Parsed::Fragment(LaterFragment { saddr_be, daddr_be, id_be: ip_id_be, proto });
    }
    let more_fragments = frag_off & IP_MF != 0;
    let l4_off = ETH_HLEN + ip_hlen;
    let ip_end = ETH_HLEN + tot_len;
    if proto == IPPROTO_ICMP {
        if more_fragments {
            return Parsed::NotOurs;
        }
        let Ok(daddr_be) = ctx.load::<u32>(IP_DADDR_OFF) else { return Parsed::BadHeader };
        return parse_icmp_error(ctx, daddr_be, l4_off, ip_end);
    }
    let Ok(segment) = l4_header(ctx, proto, l4_off, ip_end) else { return Parsed::BadHeader };
    let (Ok(saddr_be), Ok(daddr_be), Ok(sport_be), Ok(dport_be)) = (
        ctx.load::<u32>(IP_SADDR_OFF),
        ctx.load::<u32>(IP_DADDR_OFF),
        ctx.load::<u16>(l4_off),
        ctx.load::<u16>(l4_off + 2),
    ) else {
        return Parsed::BadHeader;
    };
    let Segment { flags: tcp_flags, seq, seq_end } = segment;
    Parsed::Flow(Flow {
        saddr_be,
        daddr_be,
        sport_be,
        dport_be,
        proto,
        l4_off,
        tcp_flags,
        ip_hlen,
        seq,
        seq_end,
        ip_id_be,
        more_fragments,
    })
}

/// What conntrack reads of a TCP segment (all zero for UDP).
#[derive(Clone, Copy, Default)]
pub struct Segment {
    pub flags: u8,
    /// Sequence number, host byte order.
    pub seq: u32,
    /// The sequence number after this segment: data length, SYN and FIN each count.
    pub seq_end: u32,
}

/// Checks that the TCP or UDP header at `l4_off` fits before `ip_end` (TCP: its data offset
/// too) and reads the TCP segment's flags and sequence numbers. Shared by the IPv4 and IPv6
/// parsers.
#[inline(always)]
pub fn l4_header(ctx: &TcContext, proto: u8, l4_off: usize, ip_end: usize) -> Result<Segment, ()> {
    if proto != IPPROTO_TCP {
        return if l4_off + UDP_HLEN > ip_end { Err(()) } else { Ok(Segment::default()) };
    }
    if l4_off + TCP_MIN_HLEN > ip_end {
        return Err(());
    }
    let data_off = ctx.load::<u8>(l4_off + 12).map_err(|_| ())?;
    let tcp_hlen = usize::from(data_off >> 4) * 4;
    if tcp_hlen < TCP_MIN_HLEN || l4_off + tcp_hlen > ip_end {
        return Err(());
    }
    let flags = ctx.load::<u8>(l4_off + 13).map_err(|_| ())?;
    let seq = u32::from_be(ctx.load::<u32>(l4_off + 4).map_err(|_| ())?);
    let data_len = (ip_end - l4_off - tcp_hlen) as u32;
    let seq_end = seq.wrapping_add(data_len).wrapping_add(u32::from(flags & TCP_SYN != 0)).wrapping_add(u32::from(flags & TCP_FIN != 0));
    Ok(Segment { flags, seq, seq_end })
}

/// A helper call failed (its return code); the packet may be partly rewritten and must not be
/// sent on.
pub struct RewriteFailed(pub i32);

impl RewriteFailed {
    /// From a helper's return code (a negative errno).
    #[inline(always)]
    pub fn rc(rc: i64) -> Self {
        Self(rc as i32)
    }
}

/// Replaces the IPv4 address at `addr_off` (source or destination) and fixes both checksums (the
/// L4 checksum covers the address through the pseudo-header).
#[inline(always)]
pub fn rewrite_addr(ctx: &TcContext, flow: &Flow, addr_off: usize, old: u32, new: u32) -> Result<(), RewriteFailed> {
    if old == new {
        return Ok(());
    }
    ctx.store(addr_off, &new, 0).map_err(RewriteFailed::rc)?;
    ctx.l3_csum_replace(IP_CSUM_OFF, u64::from(old), u64::from(new), 4).map_err(RewriteFailed::rc)?;
    let flags = flow.l4_csum_flags() | u64::from(BPF_F_PSEUDO_HDR) | 4;
    ctx.l4_csum_replace(flow.l4_csum_off(), u64::from(old), u64::from(new), flags).map_err(RewriteFailed::rc)
}

/// Replaces the L4 port at `port_off` and fixes the L4 checksum.
#[inline(always)]
pub fn rewrite_port(ctx: &TcContext, flow: &Flow, port_off: usize, old: u16, new: u16) -> Result<(), RewriteFailed> {
    if old == new {
        return Ok(());
    }
    ctx.store(port_off, &new, 0).map_err(RewriteFailed::rc)?;
    let flags = flow.l4_csum_flags() | 2;
    ctx.l4_csum_replace(flow.l4_csum_off(), u64::from(old), u64::from(new), flags).map_err(RewriteFailed::rc)
}

/// Rewrites an address of the packet an ICMP error quotes: the quoted IP header's checksum, and
/// the ICMP checksum (which covers the quote, that checksum included) follow.
#[inline(always)]
pub fn rewrite_inner_addr(ctx: &TcContext, error: &IcmpError, addr_off: usize, old: u32, new: u32) -> Result<(), RewriteFailed> {
    if old == new {
        return Ok(());
    }
    let inner_csum_off = error.inner_ip_off() + 10;
    let old_csum: u16 = ctx.load(inner_csum_off).map_err(RewriteFailed::rc)?;
    ctx.store(addr_off, &new, 0).map_err(RewriteFailed::rc)?;
    ctx.l3_csum_replace(inner_csum_off, u64::from(old), u64::from(new), 4).map_err(RewriteFailed::rc)?;
    let new_csum: u16 = ctx.load(inner_csum_off).map_err(RewriteFailed::rc)?;
    ctx.l4_csum_replace(error.csum_off(), u64::from(old), u64::from(new), 4).map_err(RewriteFailed::rc)?;
    ctx.l4_csum_replace(error.csum_off(), u64::from(old_csum), u64::from(new_csum), 2).map_err(RewriteFailed::rc)
}

/// Rewrites a port of the packet an ICMP or ICMPv6 error quotes, and the error's checksum (at
/// `icmp_csum_off`: a port is not part of ICMPv6's pseudo-header, so both families agree). (The quoted L4
/// checksum, when the quote has one, is left alone: it covers data the quote does not have.)
#[inline(always)]
pub fn rewrite_inner_port(ctx: &TcContext, icmp_csum_off: usize, port_off: usize, old: u16, new: u16) -> Result<(), RewriteFailed> {
    if old == new {
        return Ok(());
    }
    ctx.store(port_off, &new, 0).map_err(RewriteFailed::rc)?;
    ctx.l4_csum_replace(icmp_csum_off, u64::from(old), u64::from(new), 2).map_err(RewriteFailed::rc)
}

/// Rewrites the outer destination of an ICMP error (ICMP has no pseudo-header: only the IP
/// checksum follows).
#[inline(always)]
pub fn rewrite_outer_daddr(ctx: &TcContext, old: u32, new: u32) -> Result<(), RewriteFailed> {
    ctx.store(IP_DADDR_OFF, &new, 0).map_err(RewriteFailed::rc)?;
    ctx.l3_csum_replace(IP_CSUM_OFF, u64::from(old), u64::from(new), 4).map_err(RewriteFailed::rc)
}

/// Ones' complement sum of `bytes` (big-endian 16-bit words) added to `sum`, unfolded.
#[inline(always)]
pub fn csum_add(mut sum: u32, bytes: &[u8]) -> u32 {
    for pair in bytes.chunks_exact(2) {
        sum += u32::from(u16::from_be_bytes([pair[0], pair[1]]));
    }
    sum
}

/// Folds and complements a sum into the checksum to store (big-endian bytes).
#[inline(always)]
pub fn csum_finish(mut sum: u32) -> [u8; 2] {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    (!(sum as u16)).to_be_bytes()
}
