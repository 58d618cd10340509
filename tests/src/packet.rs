//! Ethernet/IPv4/TCP/UDP frames for packet tests, and a reader for the frames a program gives
//! back. Headers and checksums come from etherparse, an implementation independent of the
//! kernel programs'.
//!
//! Frames are described by [`Frame`] and turned into bytes by [`Frame::build`]; a test builds
//! the input and the expected output the same way, so comparing bytes also proves that the
//! program's incremental checksum updates equal a full recomputation.

use std::net::{Ipv4Addr, SocketAddrV4};

use etherparse::{
    EtherType, Ethernet2Header, Icmpv4Header, Icmpv4Type, Icmpv6Type, IpFragOffset, IpNumber, Ipv4Header, Ipv4HeaderSlice, Ipv4Options,
    TcpHeader, TcpHeaderSlice, UdpHeader, UdpHeaderSlice,
};

pub const ETH_HLEN: usize = 14;
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

pub const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
pub const NODE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];

/// The L4 part of a frame.
#[derive(Clone, Debug)]
pub enum L4 {
    Tcp { flags: u8, seq: u32, ack: u32 },
    /// `checksum: false` sends 0 ("no checksum", allowed for UDP over IPv4).
    Udp { checksum: bool },
}

/// An Ethernet + IPv4 + TCP/UDP frame.
#[derive(Clone, Debug)]
pub struct Frame {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub src: SocketAddrV4,
    pub dst: SocketAddrV4,
    pub l4: L4,
    pub payload: Vec<u8>,
    /// IPv4 options (a multiple of 4 bytes), making IHL > 5.
    pub ip_options: Vec<u8>,
    /// The raw `frag_off` field (flags and offset in 8-byte units).
    pub frag_off: u16,
    pub ttl: u8,
    pub ip_id: u16,
}

impl Frame {
    /// A TCP segment from the client's MAC to the node's.
    pub fn tcp(src: SocketAddrV4, dst: SocketAddrV4, flags: u8) -> Self {
        Self::new(src, dst, L4::Tcp { flags, seq: 1000, ack: if flags & TCP_ACK != 0 { 2000 } else { 0 } })
    }

    /// A UDP datagram with a checksum.
    pub fn udp(src: SocketAddrV4, dst: SocketAddrV4) -> Self {
        Self::new(src, dst, L4::Udp { checksum: true })
    }

    fn new(src: SocketAddrV4, dst: SocketAddrV4, l4: L4) -> Self {
        Self {
            src_mac: CLIENT_MAC,
            dst_mac: NODE_MAC,
            src,
            dst,
            l4,
            payload: b"hello".to_vec(),
            ip_options: Vec::new(),
            frag_off: 0x4000, // DF
            ttl: 64,
            ip_id: 0x1234,
        }
    }

    pub fn with_src(mut self, src: SocketAddrV4) -> Self {
        self.src = src;
        self
    }

    pub fn with_dst(mut self, dst: SocketAddrV4) -> Self {
        self.dst = dst;
        self
    }

    pub fn build(&self) -> Vec<u8> {
        let l4 = self.l4_bytes();
        let mut ip = Ipv4Header::new(0, self.ttl, IpNumber(self.proto()), self.src.ip().octets(), self.dst.ip().octets()).expect("no payload yet");
        ip.options = Ipv4Options::try_from(self.ip_options.as_slice()).expect("IPv4 options: a multiple of 4 bytes, at most 40");
        ip.set_payload_len(l4.len()).expect("the payload fits");
        ip.identification = self.ip_id;
        ip.dont_fragment = self.frag_off & 0x4000 != 0;
        ip.more_fragments = self.frag_off & 0x2000 != 0;
        ip.fragment_offset = IpFragOffset::try_new(self.frag_off & 0x1fff).expect("13 bits");
        ip.header_checksum = ip.calc_header_checksum();
        ethernet(self.src_mac, self.dst_mac, EtherType::IPV4, &[&ip.to_bytes(), &l4])
    }

    fn proto(&self) -> u8 {
        match self.l4 {
            L4::Tcp { .. } => IPPROTO_TCP,
            L4::Udp { .. } => IPPROTO_UDP,
        }
    }

    fn l4_bytes(&self) -> Vec<u8> {
        let (src, dst) = (self.src.ip().octets(), self.dst.ip().octets());
        let checksum = match self.l4 {
            L4::Udp { checksum: false } => Checksum::None,
            _ => Checksum::Ipv4(src, dst),
        };
        l4_segment(&self.l4, self.src.port(), self.dst.port(), &self.payload, checksum)
    }
}

/// How an L4 segment's checksum is made.
pub enum Checksum {
    /// 0: "no checksum" (UDP over IPv4 only).
    None,
    /// Over the IPv4 pseudo-header of (source, destination).
    Ipv4([u8; 4], [u8; 4]),
    /// Over the IPv6 pseudo-header of (source, destination).
    Ipv6([u8; 16], [u8; 16]),
}

/// A TCP or UDP segment (header and `payload`) with its checksum. Shared by the IPv4 and IPv6
/// frame builders.
pub fn l4_segment(l4: &L4, sport: u16, dport: u16, payload: &[u8], checksum: Checksum) -> Vec<u8> {
    let header = match *l4 {
        L4::Tcp { flags, seq, ack } => {
            let mut tcp = TcpHeader::new(sport, dport, seq, 64240);
            tcp.acknowledgment_number = ack;
            tcp.fin = flags & TCP_FIN != 0;
            tcp.syn = flags & TCP_SYN != 0;
            tcp.rst = flags & TCP_RST != 0;
            tcp.psh = flags & 0x08 != 0;
            tcp.ack = flags & TCP_ACK != 0;
            tcp.checksum = match checksum {
                Checksum::None => 0,
                Checksum::Ipv4(src, dst) => tcp.calc_checksum_ipv4_raw(src, dst, payload).expect("segment fits"),
                Checksum::Ipv6(src, dst) => tcp.calc_checksum_ipv6_raw(src, dst, payload).expect("segment fits"),
            };
            tcp.to_bytes().to_vec()
        }
        L4::Udp { .. } => {
            let mut udp = UdpHeader::without_ipv4_checksum(sport, dport, payload.len()).expect("datagram fits");
            // etherparse sends a computed 0 as 0xffff (0 means "none").
            udp.checksum = match checksum {
                Checksum::None => 0,
                Checksum::Ipv4(src, dst) => udp.calc_checksum_ipv4_raw(src, dst, payload).expect("datagram fits"),
                Checksum::Ipv6(src, dst) => udp.calc_checksum_ipv6_raw(src, dst, payload).expect("datagram fits"),
            };
            udp.to_bytes().to_vec()
        }
    };
    [header.as_slice(), payload].concat()
}

/// An Ethernet frame of `ether_type` carrying the concatenated `parts`.
pub fn ethernet(src_mac: [u8; 6], dst_mac: [u8; 6], ether_type: EtherType, parts: &[&[u8]]) -> Vec<u8> {
    let header = Ethernet2Header { source: src_mac, destination: dst_mac, ether_type };
    [&header.to_bytes()[..]].into_iter().chain(parts.iter().copied()).collect::<Vec<_>>().concat()
}

/// An ICMP error from `src` to `dst` (`icmp_type`/`code`, `rest` the header's last 4 bytes, e.g.
/// the next-hop MTU of "fragmentation needed") quoting the IP header and first 8 L4 bytes of the
/// Ethernet frame `about`, as a router sends it.
pub fn icmp_error(src: Ipv4Addr, dst: Ipv4Addr, icmp_type: u8, code: u8, rest: [u8; 4], about: &[u8]) -> Vec<u8> {
    let quote = &about[ETH_HLEN..ETH_HLEN + 28];
    let icmp = Icmpv4Header::with_checksum(Icmpv4Type::Unknown { type_u8: icmp_type, code_u8: code, bytes5to8: rest }, quote);
    let icmp = [&icmp.to_bytes()[..], quote].concat();
    let mut ip = Ipv4Header::new(icmp.len() as u16, 64, IpNumber::ICMP, src.octets(), dst.octets()).expect("fits");
    ip.dont_fragment = false;
    ip.header_checksum = ip.calc_header_checksum();
    ethernet(CLIENT_MAC, NODE_MAC, EtherType::IPV4, &[&ip.to_bytes(), &icmp])
}

/// An ARP request (not IPv4: must pass every program untouched).
pub fn arp_request(sender: Ipv4Addr, target: Ipv4Addr) -> Vec<u8> {
    let arp = [&[0, 1, 0x08, 0, 6, 4, 0, 1][..], &CLIENT_MAC, &sender.octets(), &[0; 6], &target.octets()].concat();
    ethernet(CLIENT_MAC, [0xff; 6], EtherType::ARP, &[&arp])
}

/// `frame` (Ethernet + IPv4) with its IPv4 header checksum computed again (after a test
/// changed the header).
pub fn with_ipv4_checksum(mut frame: Vec<u8>) -> Vec<u8> {
    let header = Ipv4HeaderSlice::from_slice(&frame[ETH_HLEN..]).expect("an IPv4 header").to_header();
    let checksum = header.calc_header_checksum();
    frame[ETH_HLEN + 10..ETH_HLEN + 12].copy_from_slice(&checksum.to_be_bytes());
    frame
}

/// The IPv4 header and L4 segment of a frame, with their checksums verified.
#[derive(Debug)]
pub struct Ipv4View {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub proto: u8,
    pub ip_checksum_ok: bool,
    /// The L4 checksum verifies (always true for UDP with checksum 0, which `l4_checksum_zero` says).
    pub l4_checksum_ok: bool,
    pub l4_checksum_zero: bool,
    /// The bytes after the IPv4 header.
    pub l4: Vec<u8>,
}

/// Reads an Ethernet/IPv4 frame; `None` if it is not one.
pub fn read_ipv4(frame: &[u8]) -> Option<Ipv4View> {
    if frame.len() < ETH_HLEN + 20 || frame[12..14] != [0x08, 0x00] {
        return None;
    }
    let header = Ipv4HeaderSlice::from_slice(&frame[ETH_HLEN..]).ok()?;
    let ip_hlen = header.slice().len();
    let l4 = frame.get(ETH_HLEN + ip_hlen..ETH_HLEN + usize::from(header.total_len()))?.to_vec();
    let (src, dst, proto) = (header.source_addr(), header.destination_addr(), header.protocol().0);
    let ip_checksum_ok = header.to_header().calc_header_checksum() == header.header_checksum();
    let l4_checksum_zero = proto == IPPROTO_UDP && l4.get(6..8) == Some(&[0, 0]);
    let l4_checksum_ok = l4_checksum_zero || l4_checksum_verifies(&l4, proto, Checksum::Ipv4(src.octets(), dst.octets()));
    Some(Ipv4View { src, dst, proto, ip_checksum_ok, l4_checksum_ok, l4_checksum_zero, l4 })
}

/// Whether the TCP, UDP or ICMP(v6) checksum of `l4` verifies (false for other protocols and
/// for data that is not a whole segment).
pub fn l4_checksum_verifies(l4: &[u8], proto: u8, addresses: Checksum) -> bool {
    let verified = match proto {
        IPPROTO_TCP => TcpHeaderSlice::from_slice(l4).ok().and_then(|tcp| {
            let (header, payload) = (tcp.to_header(), &l4[tcp.slice().len()..]);
            let computed = match addresses {
                Checksum::Ipv4(src, dst) => header.calc_checksum_ipv4_raw(src, dst, payload).ok(),
                Checksum::Ipv6(src, dst) => header.calc_checksum_ipv6_raw(src, dst, payload).ok(),
                Checksum::None => None,
            };
            Some(computed? == header.checksum)
        }),
        IPPROTO_UDP => UdpHeaderSlice::from_slice(l4).ok().and_then(|udp| {
            let (header, payload) = (udp.to_header(), &l4[UdpHeader::LEN..]);
            let computed = match addresses {
                Checksum::Ipv4(src, dst) => header.calc_checksum_ipv4_raw(src, dst, payload).ok(),
                Checksum::Ipv6(src, dst) => header.calc_checksum_ipv6_raw(src, dst, payload).ok(),
                Checksum::None => None,
            };
            Some(computed? == header.checksum)
        }),
        // The type, code and bytes 5-8 as they are (not decoded and encoded again).
        IPPROTO_ICMP if l4.len() >= 8 => {
            let icmp_type = Icmpv4Type::Unknown { type_u8: l4[0], code_u8: l4[1], bytes5to8: [l4[4], l4[5], l4[6], l4[7]] };
            Some(icmp_type.calc_checksum(&l4[8..]) == u16::from_be_bytes([l4[2], l4[3]]))
        }
        crate::packet6::IPPROTO_ICMPV6 if l4.len() >= 8 => match addresses {
            Checksum::Ipv6(src, dst) => {
                let icmp_type = Icmpv6Type::Unknown { type_u8: l4[0], code_u8: l4[1], bytes5to8: [l4[4], l4[5], l4[6], l4[7]] };
                icmp_type.calc_checksum(src, dst, &l4[8..]).ok().map(|computed| computed == u16::from_be_bytes([l4[2], l4[3]]))
            }
            _ => None,
        },
        _ => None,
    };
    verified.unwrap_or(false)
}
