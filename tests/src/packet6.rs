//! Hand-built Ethernet/IPv6/TCP/UDP frames for packet tests (the IPv6 counterpart of
//! `packet`), with checksums computed from scratch, and a reader for what a program gives back.

use std::net::{Ipv6Addr, SocketAddrV6};

use crate::packet::{
    checksum, l4_segment, set_l4_checksum, CLIENT_MAC, ETH_HLEN, IPPROTO_TCP, IPPROTO_UDP, L4, NODE_MAC, TCP_ACK,
};

pub const IPPROTO_ICMPV6: u8 = 58;
pub const NEXTHDR_DEST: u8 = 60;
pub const NEXTHDR_FRAGMENT: u8 = 44;

/// An extension header between the IPv6 header and L4.
#[derive(Clone, Debug)]
pub enum Ext {
    /// Destination options with one PadN option (8 bytes).
    DestOptions,
    /// A Fragment header: offset (8-byte units) and more-fragments flag.
    Fragment { offset: u16, more: bool },
}

/// An Ethernet + IPv6 + TCP/UDP frame.
#[derive(Clone, Debug)]
pub struct Frame6 {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub src: SocketAddrV6,
    pub dst: SocketAddrV6,
    pub l4: L4,
    pub payload: Vec<u8>,
    pub ext: Vec<Ext>,
    pub hop_limit: u8,
}

impl Frame6 {
    pub fn tcp(src: SocketAddrV6, dst: SocketAddrV6, flags: u8) -> Self {
        Self::new(src, dst, L4::Tcp { flags, seq: 1000, ack: if flags & TCP_ACK != 0 { 2000 } else { 0 } })
    }

    pub fn udp(src: SocketAddrV6, dst: SocketAddrV6) -> Self {
        Self::new(src, dst, L4::Udp { checksum: true })
    }

    fn new(src: SocketAddrV6, dst: SocketAddrV6, l4: L4) -> Self {
        Self { src_mac: CLIENT_MAC, dst_mac: NODE_MAC, src, dst, l4, payload: b"hello".to_vec(), ext: Vec::new(), hop_limit: 64 }
    }

    pub fn with_ext(mut self, ext: Ext) -> Self {
        self.ext.push(ext);
        self
    }

    fn proto(&self) -> u8 {
        match self.l4 {
            L4::Tcp { .. } => IPPROTO_TCP,
            L4::Udp { .. } => IPPROTO_UDP,
        }
    }

    pub fn build(&self) -> Vec<u8> {
        let l4 = self.l4_bytes();
        let mut exts = Vec::new();
        let mut next_of = Vec::new();
        for ext in &self.ext {
            next_of.push(match ext {
                Ext::DestOptions => NEXTHDR_DEST,
                Ext::Fragment { .. } => NEXTHDR_FRAGMENT,
            });
        }
        for (i, ext) in self.ext.iter().enumerate() {
            let next = next_of.get(i + 1).copied().unwrap_or(self.proto());
            match ext {
                // 8 bytes: next header, length 0, and one PadN option filling the other 6.
                Ext::DestOptions => exts.extend_from_slice(&[next, 0, 1, 4, 0, 0, 0, 0]),
                Ext::Fragment { offset, more } => {
                    let field = (offset << 3) | u16::from(*more);
                    exts.extend_from_slice(&[next, 0]);
                    exts.extend_from_slice(&field.to_be_bytes());
                    exts.extend_from_slice(&0x1234_5678u32.to_be_bytes());
                }
            }
        }
        let first = next_of.first().copied().unwrap_or(self.proto());
        let mut frame = Vec::new();
        frame.extend_from_slice(&self.dst_mac);
        frame.extend_from_slice(&self.src_mac);
        frame.extend_from_slice(&0x86ddu16.to_be_bytes());
        frame.extend_from_slice(&ipv6_header(*self.src.ip(), *self.dst.ip(), first, self.hop_limit, exts.len() + l4.len()));
        frame.extend_from_slice(&exts);
        frame.extend_from_slice(&l4);
        frame
    }

    fn l4_bytes(&self) -> Vec<u8> {
        let (mut l4, csum_at) = l4_segment(&self.l4, self.src.port(), self.dst.port(), &self.payload);
        let csum = l4_checksum6(*self.src.ip(), *self.dst.ip(), self.proto(), &l4);
        set_l4_checksum(&mut l4, csum_at, csum, self.proto());
        l4
    }
}

fn ipv6_header(src: Ipv6Addr, dst: Ipv6Addr, next: u8, hop_limit: u8, payload_len: usize) -> Vec<u8> {
    let mut ip = vec![0x60, 0, 0, 0];
    ip.extend_from_slice(&(payload_len as u16).to_be_bytes());
    ip.push(next);
    ip.push(hop_limit);
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    ip
}

/// TCP/UDP/ICMPv6 checksum with the IPv6 pseudo-header; 0 when `segment` is correct.
pub fn l4_checksum6(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, segment: &[u8]) -> u16 {
    let mut pseudo = Vec::with_capacity(40);
    pseudo.extend_from_slice(&src.octets());
    pseudo.extend_from_slice(&dst.octets());
    pseudo.extend_from_slice(&(segment.len() as u32).to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, proto]);
    checksum(&[&pseudo, segment])
}

/// An ICMPv6 error from `src` to `dst` (`icmp_type`/`code`, `rest` the header's last 4 bytes,
/// e.g. the MTU of "packet too big") quoting the IPv6 header and first 8 L4 bytes of `about`.
pub fn icmp6_error(src: Ipv6Addr, dst: Ipv6Addr, icmp_type: u8, code: u8, rest: [u8; 4], about: &[u8]) -> Vec<u8> {
    let quote = &about[ETH_HLEN..ETH_HLEN + 48];
    let mut icmp = vec![icmp_type, code, 0, 0];
    icmp.extend_from_slice(&rest);
    icmp.extend_from_slice(quote);
    let csum = l4_checksum6(src, dst, IPPROTO_ICMPV6, &icmp);
    icmp[2..4].copy_from_slice(&csum.to_be_bytes());
    let mut frame = Vec::new();
    frame.extend_from_slice(&NODE_MAC);
    frame.extend_from_slice(&CLIENT_MAC);
    frame.extend_from_slice(&0x86ddu16.to_be_bytes());
    frame.extend_from_slice(&ipv6_header(src, dst, IPPROTO_ICMPV6, 64, icmp.len()));
    frame.extend_from_slice(&icmp);
    frame
}

/// A neighbour solicitation (ICMPv6 type 135): must pass every program untouched.
pub fn neighbour_solicitation(src: Ipv6Addr, target: Ipv6Addr) -> Vec<u8> {
    let mut icmp = vec![135, 0, 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(&target.octets());
    let dst: Ipv6Addr = "ff02::1:ff00:0".parse().expect("static");
    let csum = l4_checksum6(src, dst, IPPROTO_ICMPV6, &icmp);
    icmp[2..4].copy_from_slice(&csum.to_be_bytes());
    let mut frame = vec![0x33, 0x33, 0xff, 0, 0, 0];
    frame.extend_from_slice(&CLIENT_MAC);
    frame.extend_from_slice(&0x86ddu16.to_be_bytes());
    frame.extend_from_slice(&ipv6_header(src, dst, IPPROTO_ICMPV6, 255, icmp.len()));
    frame.extend_from_slice(&icmp);
    frame
}

/// The IPv6 header fields and the L4 segment (no extension headers) of a frame.
#[derive(Debug)]
pub struct Ipv6View {
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub next: u8,
    /// The L4 (or ICMPv6) checksum verifies over the pseudo-header.
    pub l4_checksum_ok: bool,
    pub l4: Vec<u8>,
}

pub fn read_ipv6(frame: &[u8]) -> Option<Ipv6View> {
    if frame.len() < ETH_HLEN + 40 || frame[12..14] != [0x86, 0xdd] {
        return None;
    }
    let ip = &frame[ETH_HLEN..];
    let payload_len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    let l4 = ip.get(40..40 + payload_len)?.to_vec();
    let src = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).ok()?);
    let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[24..40]).ok()?);
    let next = ip[6];
    let l4_checksum_ok = l4_checksum6(src, dst, next, &l4) == 0;
    Some(Ipv6View { src, dst, next, l4_checksum_ok, l4 })
}
