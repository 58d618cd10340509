//! Answering a packet for a frontend without backends: an ICMP port unreachable, built in place
//! and sent back out of the interface the packet came in on.
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
    if flow.ip_hlen != IPV4_HLEN {
        return Err(NoReply);
    }
    let macs: [u8; 12] = ctx.load(0).map_err(|_| NoReply)?;
    let quote: [u8; QUOTE_LEN] = ctx.load(ETH_HLEN).map_err(|_| NoReply)?;

    let mut reply = [0u8; REPLY_LEN];
    // Ethernet: back to where it came from.
    reply[0..6].copy_from_slice(&macs[6..12]);
    reply[6..12].copy_from_slice(&macs[0..6]);
    reply[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    // IPv4: from the frontend (the original destination) to the client.
    let ip = ETH_HLEN;
    reply[ip] = 0x45;
    reply[ip + 2..ip + 4].copy_from_slice(&((REPLY_LEN - ETH_HLEN) as u16).to_be_bytes());
    reply[ip + 8] = 64;
    reply[ip + 9] = IPPROTO_ICMP;
    reply[ip + 12..ip + 16].copy_from_slice(&quote[16..20]);
    reply[ip + 16..ip + 20].copy_from_slice(&quote[12..16]);
    let ip_csum = csum_finish(csum_add(0, &reply[ip..ip + IPV4_HLEN]));
    reply[ip + 10..ip + 12].copy_from_slice(&ip_csum);
    // ICMP destination unreachable / port unreachable, quoting the packet.
    let icmp = ip + IPV4_HLEN;
    reply[icmp] = ICMP_DEST_UNREACH;
    reply[icmp + 1] = ICMP_PORT_UNREACH;
    reply[icmp + ICMP_HLEN..].copy_from_slice(&quote);
    let icmp_csum = csum_finish(csum_add(0, &reply[icmp..]));
    reply[icmp + 2..icmp + 4].copy_from_slice(&icmp_csum);

    // SAFETY: the skb pointer is the program's own context.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, REPLY_LEN as u32, 0) } != 0 {
        return Err(NoReply);
    }
    ctx.store(0, &reply, 0).map_err(|_| NoReply)?;
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // From tc ingress, a redirect without BPF_F_INGRESS transmits on the device's egress.
    let verdict = unsafe { bpf_redirect(ifindex, 0) } as i32;
    if verdict != TC_ACT_REDIRECT as i32 {
        return Err(NoReply);
    }
    Ok(verdict)
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

/// Scratch space for the quoted packet of an IPv6 reply: next to the IPv6 path, the BPF stack
/// has no room for it.
#[map(name = "epx_scratch")]
static SCRATCH: PerCpuArray<[u8; QUOTE6_LEN]> = PerCpuArray::with_max_entries(1, 0);

/// [`port_unreachable`] for IPv6: an ICMPv6 destination unreachable (port unreachable) from the
/// frontend to the client. Only for packets without extension headers.
#[inline(never)]
pub fn port_unreachable6(ctx: &TcContext, l4_off: usize) -> Result<i32, NoReply> {
    if l4_off != ETH_HLEN + IPV6_HLEN {
        return Err(NoReply);
    }
    let scratch = SCRATCH.get_ptr_mut(0).ok_or(NoReply)?;
    // The quote (the packet's IPv6 header and 8 bytes of L4), straight into the scratch slot.
    // SAFETY: a QUOTE6_LEN-byte destination of this CPU's slot; nothing else runs on it meanwhile.
    if unsafe { bpf_skb_load_bytes(ctx.skb.skb.cast(), ETH_HLEN as u32, scratch.cast(), QUOTE6_LEN as u32) } != 0 {
        return Err(NoReply);
    }
    let quote: &[u8; QUOTE6_LEN] = unsafe { &*scratch };
    let macs: [u8; 12] = ctx.load(0).map_err(|_| NoReply)?;
    let client: [u8; 16] = ctx.load(ETH_HLEN + 8).map_err(|_| NoReply)?;
    let frontend: [u8; 16] = ctx.load(ETH_HLEN + 24).map_err(|_| NoReply)?;

    let mut eth = [0u8; ETH_HLEN];
    eth[0..6].copy_from_slice(&macs[6..12]);
    eth[6..12].copy_from_slice(&macs[0..6]);
    eth[12] = 0x86;
    eth[13] = 0xdd;
    // Version, traffic class and flow label; payload length; next header; hop limit.
    let mut ip_head = [0x60u8, 0, 0, 0, 0, 0, IPPROTO_ICMPV6, 64];
    ip_head[4..6].copy_from_slice(&(ICMPV6_LEN as u16).to_be_bytes());
    let mut icmp_head = [ICMPV6_DEST_UNREACH, ICMPV6_PORT_UNREACH, 0, 0, 0, 0, 0, 0];
    // The checksum covers a pseudo-header (both addresses, the length, the next header), the
    // ICMPv6 header and the quote. The reply goes from the frontend to the client.
    let mut sum = csum_add(csum_add(0, &frontend), &client);
    sum += ICMPV6_LEN as u32 + u32::from(IPPROTO_ICMPV6);
    sum = csum_add(csum_add(sum, &icmp_head), quote);
    let icmp_csum = csum_finish(sum);
    icmp_head[2] = icmp_csum[0];
    icmp_head[3] = icmp_csum[1];

    // SAFETY: the skb pointer is the program's own context.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, REPLY6_LEN as u32, 0) } != 0 {
        return Err(NoReply);
    }
    let ip = ETH_HLEN;
    let icmp = ip + IPV6_HLEN;
    let stored = ctx
        .store(0, &eth, 0)
        .and_then(|()| ctx.store(ip, &ip_head, 0))
        .and_then(|()| ctx.store(ip + 8, &frontend, 0))
        .and_then(|()| ctx.store(ip + 24, &client, 0))
        .and_then(|()| ctx.store(icmp, &icmp_head, 0))
        .and_then(|()| ctx.store(icmp + ICMPV6_HLEN, quote, 0));
    stored.map_err(|_| NoReply)?;
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let verdict = unsafe { bpf_redirect(ifindex, 0) } as i32;
    if verdict != TC_ACT_REDIRECT as i32 {
        return Err(NoReply);
    }
    Ok(verdict)
}
