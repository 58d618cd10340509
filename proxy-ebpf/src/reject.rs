//! Answering a packet with an ICMP error built in place and sent back out of the interface the
//! packet came in on: port unreachable for a frontend without backends, and "fragmentation
//! needed" (ICMPv6 "packet too big") for a packet this node must send on itself (SNAT) that is
//! larger than the next link's MTU, so that the sender's path-MTU discovery works through the
//! node as through any router. The error comes from the packet's destination (the frontend, or
//! for a reply the node's SNAT address) and quotes the packet as its sender sent it.
//!
//! kube-proxy's REJECT rule answers TCP and UDP alike with ICMP port unreachable (iptables'
//! default `--reject-with`); a TCP client in SYN_SENT turns it into ECONNREFUSED, a connected UDP
//! socket into ECONNREFUSED on its next call. Never silence: a black hole would make clients wait
//! for their timeouts.

use aya_ebpf::{
    bindings::{TC_ACT_REDIRECT, TC_ACT_SHOT},
    helpers::{bpf_redirect, bpf_skb_change_tail, bpf_skb_load_bytes},
    macros::map,
    maps::PerCpuArray,
    programs::TcContext,
};

use proxy_abi::stat;

use crate::maps::count;
use crate::packet::{csum_add, csum_finish, Flow, ETH_HLEN};

const IPV4_HLEN: usize = 20;
const ICMP_HLEN: usize = 8;
/// The offending packet's IP header and its first 8 bytes of payload (RFC 792): enough for the
/// client's stack to find the socket (ports, and the TCP sequence number it checks).
const QUOTE_LEN: usize = IPV4_HLEN + 8;
const REPLY_LEN: usize = ETH_HLEN + IPV4_HLEN + ICMP_HLEN + QUOTE_LEN;
const IPPROTO_ICMP: u8 = 1;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
const ICMP_FRAG_NEEDED: u8 = 4;

/// Could not build the reply (IP options, or a helper failed): the caller drops the packet.
pub struct NoReply;

/// The verdict for a new flow to a frontend without backends, either family: the reply built by
/// `port_unreachable`/`port_unreachable6`, or a drop when none could be built. Both are counted.
#[inline(always)]
pub fn no_backend_verdict(reply: Result<i32, NoReply>) -> i32 {
    match reply {
        Ok(verdict) => {
            count(stat::TC_NO_BACKEND_REJECT);
            verdict
        }
        Err(NoReply) => {
            count(stat::TC_NO_BACKEND_DROP);
            TC_ACT_SHOT as i32
        }
    }
}

/// Rewrites the packet into an ICMP port unreachable from the frontend to the client and
/// redirects it out of the ingress interface. Only for packets without IP options (the quote
/// would not fit the fixed-size reply).
#[inline(always)]
pub fn port_unreachable(ctx: &TcContext, flow: &Flow) -> Result<i32, NoReply> {
    reply(ctx, flow, ICMP_PORT_UNREACH, 0)
}

/// The verdict for a packet with DF set that is larger than `mtu`, the MTU of the link the
/// route to its (translated) destination leaves by: an ICMP destination unreachable /
/// fragmentation needed with that next-hop MTU (RFC 1191) back to its sender. Without DF it is
/// dropped: the program sends on what it translates itself, and no helper fragments. Both are
/// counted; the drop is logged. Inlined: a call of its own would add its frame to the
/// ingress path's, past BPF's 512-byte stack.
#[inline(always)]
pub fn too_big(ctx: &TcContext, flow: &Flow, mtu: u16) -> i32 {
    const IP_DF: u16 = 0x4000;
    let dont_fragment = ctx.load::<u16>(ETH_HLEN + 6).is_ok_and(|frag_off| u16::from_be(frag_off) & IP_DF != 0);
    if dont_fragment {
        if let Ok(verdict) = reply(ctx, flow, ICMP_FRAG_NEEDED, mtu) {
            count(stat::TC_FRAG_NEEDED);
            return verdict;
        }
    }
    crate::failure::too_big(ctx, ctx.len(), mtu);
    TC_ACT_SHOT as i32
}

/// Rewrites the packet into an ICMP destination unreachable with `code` (and `mtu` in the
/// next-hop MTU field, 0 if not "fragmentation needed") from its destination to its source, and
/// redirects it out of the ingress interface. The reply is built in this CPU's scratch slot: on
/// the stack it would push the ingress path past BPF's 512 bytes.
#[inline(never)]
fn reply(ctx: &TcContext, flow: &Flow, code: u8, mtu: u16) -> Result<i32, NoReply> {
    if flow.ip_hlen != IPV4_HLEN {
        return Err(NoReply);
    }
    let ip = ETH_HLEN;
    let icmp = ip + IPV4_HLEN;
    let quote = icmp + ICMP_HLEN;
    let reply: &mut [u8; REPLY_LEN] = start_reply::<REPLY_LEN, QUOTE_LEN>(ctx, quote)?;
    reply[12] = 0x08;
    reply[13] = 0x00;
    // IPv4: from the packet's destination to its source.
    reply[ip] = 0x45;
    reply[ip + 1] = 0;
    reply[ip + 2..ip + 4].copy_from_slice(&((REPLY_LEN - ETH_HLEN) as u16).to_be_bytes());
    reply[ip + 4..ip + 8].copy_from_slice(&[0; 4]);
    reply[ip + 8] = 64;
    reply[ip + 9] = IPPROTO_ICMP;
    reply[ip + 10..ip + 12].copy_from_slice(&[0; 2]);
    for i in 0..4 {
        reply[ip + 12 + i] = reply[quote + 16 + i];
        reply[ip + 16 + i] = reply[quote + 12 + i];
    }
    let ip_csum = csum_finish(csum_add(0, &reply[ip..ip + IPV4_HLEN]));
    reply[ip + 10..ip + 12].copy_from_slice(&ip_csum);
    // ICMP destination unreachable with `code`, quoting the packet.
    reply[icmp] = ICMP_DEST_UNREACH;
    reply[icmp + 1] = code;
    reply[icmp + 2..icmp + 6].copy_from_slice(&[0; 4]);
    reply[icmp + 6..icmp + 8].copy_from_slice(&mtu.to_be_bytes());
    let icmp_csum = csum_finish(csum_add(0, &reply[icmp..]));
    reply[icmp + 2..icmp + 4].copy_from_slice(&icmp_csum);
    send_back(ctx, reply)
}

const IPV6_HLEN: usize = 40;
const ICMPV6_HLEN: usize = 8;
/// The offending packet's IPv6 header and its first 8 bytes of payload.
const QUOTE6_LEN: usize = IPV6_HLEN + 8;
const ICMPV6_LEN: usize = ICMPV6_HLEN + QUOTE6_LEN;
const REPLY6_LEN: usize = ETH_HLEN + IPV6_HLEN + ICMPV6_LEN;
const IPPROTO_ICMPV6: u8 = 58;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PORT_UNREACH: u8 = 4;
const ICMPV6_PACKET_TOO_BIG: u8 = 2;

/// Scratch space for the reply being built (either family): next to the ingress paths, the BPF
/// stack has no room for it. Not pinned (no part of the ABI).
#[map(name = "epx_scratch")]
static SCRATCH: PerCpuArray<[u8; SCRATCH_LEN]> = PerCpuArray::with_max_entries(1, 0);
const SCRATCH_LEN: usize = if REPLY_LEN > REPLY6_LEN { REPLY_LEN } else { REPLY6_LEN };

/// [`port_unreachable`] for IPv6: an ICMPv6 destination unreachable (port unreachable) from the
/// frontend to the client. Only for packets without extension headers.
#[inline(always)]
pub fn port_unreachable6(ctx: &TcContext, l4_off: usize) -> Result<i32, NoReply> {
    reply6(ctx, l4_off, [ICMPV6_DEST_UNREACH, ICMPV6_PORT_UNREACH, 0, 0, 0, 0, 0, 0])
}

/// [`too_big`] for IPv6: an ICMPv6 packet too big with the link's `mtu` (RFC 8201) back to the
/// sender (IPv6 routers never fragment), or a drop, counted and logged, when none can be built.
#[inline(always)]
pub fn too_big6(ctx: &TcContext, l4_off: usize, mtu: u16) -> i32 {
    let [high, low] = mtu.to_be_bytes();
    match reply6(ctx, l4_off, [ICMPV6_PACKET_TOO_BIG, 0, 0, 0, 0, 0, high, low]) {
        Ok(verdict) => {
            count(stat::TC_FRAG_NEEDED);
            verdict
        }
        Err(NoReply) => {
            crate::failure::too_big(ctx, ctx.len(), mtu);
            TC_ACT_SHOT as i32
        }
    }
}

/// Rewrites the packet into an ICMPv6 error with header `icmp_head` (type, code, checksum left
/// 0, and the second word: the MTU of a packet too big) from its destination to its source, and
/// redirects it out of the ingress interface. Only for packets without extension headers.
/// (One array for the header: BPF calls take at most five arguments.)
#[inline(never)]
fn reply6(ctx: &TcContext, l4_off: usize, icmp_head: [u8; ICMPV6_HLEN]) -> Result<i32, NoReply> {
    if l4_off != ETH_HLEN + IPV6_HLEN {
        return Err(NoReply);
    }
    let ip = ETH_HLEN;
    let icmp = ip + IPV6_HLEN;
    let quote = icmp + ICMPV6_HLEN;
    let reply: &mut [u8; REPLY6_LEN] = start_reply::<REPLY6_LEN, QUOTE6_LEN>(ctx, quote)?;
    reply[12] = 0x86;
    reply[13] = 0xdd;
    // Version, traffic class and flow label; payload length; next header; hop limit; then from
    // the packet's destination (the frontend) to its source (the client).
    reply[ip..ip + 8].copy_from_slice(&[0x60, 0, 0, 0, 0, ICMPV6_LEN as u8, IPPROTO_ICMPV6, 64]);
    for i in 0..16 {
        reply[ip + 8 + i] = reply[quote + 24 + i];
        reply[ip + 24 + i] = reply[quote + 8 + i];
    }
    reply[icmp..icmp + ICMPV6_HLEN].copy_from_slice(&icmp_head);
    // The checksum covers a pseudo-header (both addresses, the length, the next header), the
    // ICMPv6 header and the quote.
    let mut sum = csum_add(0, &reply[ip + 8..ip + IPV6_HLEN]);
    sum += ICMPV6_LEN as u32 + u32::from(IPPROTO_ICMPV6);
    sum = csum_add(sum, &reply[icmp..]);
    let icmp_csum = csum_finish(sum);
    reply[icmp + 2..icmp + 4].copy_from_slice(&icmp_csum);
    send_back(ctx, reply)
}

/// This CPU's scratch slot as a reply of `N` bytes, started: the frame's Ethernet addresses
/// swapped (back to where it came from), and the quote (the packet's IP header and 8 bytes of
/// L4, `Q` bytes) already at `quote`, where it goes in the reply.
#[inline(always)]
fn start_reply<const N: usize, const Q: usize>(ctx: &TcContext, quote: usize) -> Result<&'static mut [u8; N], NoReply> {
    const { assert!(N <= SCRATCH_LEN) };
    let scratch = SCRATCH.get_ptr_mut(0).ok_or(NoReply)?;
    // SAFETY: this CPU's slot, at least N bytes; nothing else runs on it meanwhile.
    let reply: &mut [u8; N] = unsafe { &mut *scratch.cast() };
    if quote + Q > N {
        return Err(NoReply);
    }
    // SAFETY: destinations inside the slot, of the lengths given.
    let loaded = unsafe {
        bpf_skb_load_bytes(ctx.skb.skb.cast(), 0, reply.as_mut_ptr().cast(), 12) == 0
            && bpf_skb_load_bytes(ctx.skb.skb.cast(), ETH_HLEN as u32, reply[quote..].as_mut_ptr().cast(), Q as u32) == 0
    };
    if !loaded {
        return Err(NoReply);
    }
    for i in 0..6 {
        reply.swap(i, i + 6);
    }
    Ok(reply)
}

/// Makes the frame `reply` (trimming the packet to its length) and sends it out of the
/// interface the packet came in on.
#[inline(always)]
fn send_back<const N: usize>(ctx: &TcContext, reply: &[u8; N]) -> Result<i32, NoReply> {
    // SAFETY: the skb pointer is the program's own context.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, N as u32, 0) } != 0 {
        return Err(NoReply);
    }
    ctx.store(0, reply, 0).map_err(|_| NoReply)?;
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // From tc ingress, a redirect without BPF_F_INGRESS transmits on the device's egress.
    let verdict = unsafe { bpf_redirect(ifindex, 0) } as i32;
    if verdict != TC_ACT_REDIRECT as i32 {
        return Err(NoReply);
    }
    Ok(verdict)
}
