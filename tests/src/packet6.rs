//! Ethernet/IPv6/TCP/UDP frames for packet tests (the IPv6 counterpart of `packet`), and a
//! reader for what a program gives back. Headers and checksums come from etherparse.

use std::net::{Ipv6Addr, SocketAddrV6};

use etherparse::{EtherType, Icmpv6Header, Icmpv6Type, IpFragOffset, IpNumber, Ipv6FlowLabel, Ipv6FragmentHeader, Ipv6Header, Ipv6HeaderSlice, Ipv6RawExtHeader};

use crate::packet::{ethernet, l4_checksum_verifies, l4_segment, Checksum, CLIENT_MAC, ETH_HLEN, IPPROTO_TCP, IPPROTO_UDP, L4, NODE_MAC, TCP_ACK};

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
        let next_of: Vec<u8> = self
            .ext
            .iter()
            .map(|ext| match ext {
                Ext::DestOptions => NEXTHDR_DEST,
                Ext::Fragment { .. } => NEXTHDR_FRAGMENT,
            })
            .collect();
        let mut exts = Vec::new();
        for (i, ext) in self.ext.iter().enumerate() {
            let next = IpNumber(next_of.get(i + 1).copied().unwrap_or(self.proto()));
            match ext {
                // 8 bytes: next header, length 0, and one PadN option filling the other 6.
                Ext::DestOptions => {
                    exts.extend_from_slice(&Ipv6RawExtHeader::new_raw(next, &[1, 4, 0, 0, 0, 0]).expect("6 bytes").to_bytes())
                }
                Ext::Fragment { offset, more } => {
                    let offset = IpFragOffset::try_new(*offset).expect("13 bits");
                    exts.extend_from_slice(&Ipv6FragmentHeader::new(next, offset, *more, 0x1234_5678).to_bytes());
                }
            }
        }
        let first = next_of.first().copied().unwrap_or(self.proto());
        let ip = ipv6_header(*self.src.ip(), *self.dst.ip(), first, self.hop_limit, exts.len() + l4.len());
        ethernet(self.src_mac, self.dst_mac, EtherType::IPV6, &[&ip, &exts, &l4])
    }

    fn l4_bytes(&self) -> Vec<u8> {
        let checksum = Checksum::Ipv6(self.src.ip().octets(), self.dst.ip().octets());
        l4_segment(&self.l4, self.src.port(), self.dst.port(), &self.payload, checksum)
    }
}

fn ipv6_header(src: Ipv6Addr, dst: Ipv6Addr, next: u8, hop_limit: u8, payload_len: usize) -> Vec<u8> {
    let header = Ipv6Header {
        traffic_class: 0,
        flow_label: Ipv6FlowLabel::ZERO,
        payload_length: u16::try_from(payload_len).expect("payload fits"),
        next_header: IpNumber(next),
        hop_limit,
        source: src.octets(),
        destination: dst.octets(),
    };
    header.to_bytes().to_vec()
}

/// An ICMPv6 message from `src` to `dst` (`icmp_type`/`code`, `rest` the header's last 4 bytes)
/// carrying `body`, with its checksum.
fn icmp6(src: Ipv6Addr, dst: Ipv6Addr, icmp_type: u8, code: u8, rest: [u8; 4], body: &[u8]) -> Vec<u8> {
    let icmp_type = Icmpv6Type::Unknown { type_u8: icmp_type, code_u8: code, bytes5to8: rest };
    let header = Icmpv6Header::with_checksum(icmp_type, src.octets(), dst.octets(), body).expect("fits");
    [&header.to_bytes()[..], body].concat()
}

/// An ICMPv6 error from `src` to `dst` (`icmp_type`/`code`, `rest` the header's last 4 bytes,
/// e.g. the MTU of "packet too big") quoting the IPv6 header and first 8 L4 bytes of `about`.
pub fn icmp6_error(src: Ipv6Addr, dst: Ipv6Addr, icmp_type: u8, code: u8, rest: [u8; 4], about: &[u8]) -> Vec<u8> {
    let icmp = icmp6(src, dst, icmp_type, code, rest, &about[ETH_HLEN..ETH_HLEN + 48]);
    let ip = ipv6_header(src, dst, IPPROTO_ICMPV6, 64, icmp.len());
    ethernet(CLIENT_MAC, NODE_MAC, EtherType::IPV6, &[&ip, &icmp])
}

/// A neighbour solicitation (ICMPv6 type 135): must pass every program untouched.
pub fn neighbour_solicitation(src: Ipv6Addr, target: Ipv6Addr) -> Vec<u8> {
    let dst: Ipv6Addr = "ff02::1:ff00:0".parse().expect("static");
    let icmp = icmp6(src, dst, 135, 0, [0; 4], &target.octets());
    let ip = ipv6_header(src, dst, IPPROTO_ICMPV6, 255, icmp.len());
    ethernet(CLIENT_MAC, [0x33, 0x33, 0xff, 0, 0, 0], EtherType::IPV6, &[&ip, &icmp])
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
    let header = Ipv6HeaderSlice::from_slice(&frame[ETH_HLEN..]).ok()?;
    let start = ETH_HLEN + Ipv6Header::LEN;
    let l4 = frame.get(start..start + usize::from(header.payload_length()))?.to_vec();
    let (src, dst, next) = (header.source_addr(), header.destination_addr(), header.next_header().0);
    let l4_checksum_ok = l4_checksum_verifies(&l4, next, Checksum::Ipv6(src.octets(), dst.octets()));
    Some(Ipv6View { src, dst, next, l4_checksum_ok, l4 })
}
