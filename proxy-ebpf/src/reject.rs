//! Answering a packet for a frontend without backends: an ICMP port unreachable, built in place
//! and sent back out of the interface the packet came in on.
//!
//! kube-proxy's REJECT rule answers TCP and UDP alike with ICMP port unreachable (iptables'
//! default `--reject-with`); a TCP client in SYN_SENT turns it into ECONNREFUSED, a connected UDP
//! socket into ECONNREFUSED on its next call. Never silence: a black hole would make clients wait
//! for their timeouts.

use aya_ebpf::{
    bindings::TC_ACT_REDIRECT,
    helpers::{bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};

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
