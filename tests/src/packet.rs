//! Hand-built Ethernet/IPv4/TCP/UDP frames for packet tests, with checksums computed from
//! scratch, and a reader for the frames a program gives back.
//!
//! Frames are described by [`Frame`] and turned into bytes by [`Frame::build`]; a test builds
//! the input and the expected output the same way, so comparing bytes also proves that the
//! program's incremental checksum updates equal a full recomputation.

use std::net::{Ipv4Addr, SocketAddrV4};

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
        assert!(self.ip_options.len() % 4 == 0 && self.ip_options.len() <= 40, "bad IP options length");
        let l4 = self.l4_bytes();
        let ip_hlen = 20 + self.ip_options.len();
        let tot_len = ip_hlen + l4.len();
        let mut frame = Vec::with_capacity(ETH_HLEN + tot_len);
        frame.extend_from_slice(&self.dst_mac);
        frame.extend_from_slice(&self.src_mac);
        frame.extend_from_slice(&0x0800u16.to_be_bytes());
        let mut ip = vec![0u8; 20];
        ip[0] = 0x40 | (ip_hlen / 4) as u8;
        ip[2..4].copy_from_slice(&(tot_len as u16).to_be_bytes());
        ip[4..6].copy_from_slice(&self.ip_id.to_be_bytes());
        ip[6..8].copy_from_slice(&self.frag_off.to_be_bytes());
        ip[8] = self.ttl;
        ip[9] = self.proto();
        ip[12..16].copy_from_slice(&self.src.ip().octets());
        ip[16..20].copy_from_slice(&self.dst.ip().octets());
        ip.extend_from_slice(&self.ip_options);
        let csum = checksum(&[&ip]);
        ip[10..12].copy_from_slice(&csum.to_be_bytes());
        frame.extend_from_slice(&ip);
        frame.extend_from_slice(&l4);
        frame
    }

    fn proto(&self) -> u8 {
        match self.l4 {
            L4::Tcp { .. } => IPPROTO_TCP,
            L4::Udp { .. } => IPPROTO_UDP,
        }
    }

    fn l4_bytes(&self) -> Vec<u8> {
        let (mut l4, csum_at) = l4_segment(&self.l4, self.src.port(), self.dst.port(), &self.payload);
        if !matches!(self.l4, L4::Udp { checksum: false }) {
            let csum = l4_checksum(*self.src.ip(), *self.dst.ip(), self.proto(), &l4);
            set_l4_checksum(&mut l4, csum_at, csum, self.proto());
        }
        l4
    }
}

/// A TCP or UDP segment (header and `payload`) with its checksum field zero, and where that
/// field is. Shared by the IPv4 and IPv6 frame builders.
pub fn l4_segment(l4: &L4, sport: u16, dport: u16, payload: &[u8]) -> (Vec<u8>, usize) {
    let mut segment = Vec::new();
    segment.extend_from_slice(&sport.to_be_bytes());
    segment.extend_from_slice(&dport.to_be_bytes());
    let csum_at = match *l4 {
        L4::Tcp { flags, seq, ack } => {
            segment.extend_from_slice(&seq.to_be_bytes());
            segment.extend_from_slice(&ack.to_be_bytes());
            segment.push(5 << 4);
            segment.push(flags);
            segment.extend_from_slice(&64240u16.to_be_bytes());
            segment.extend_from_slice(&[0, 0, 0, 0]);
            16
        }
        L4::Udp { .. } => {
            segment.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
            segment.extend_from_slice(&[0, 0]);
            6
        }
    };
    segment.extend_from_slice(payload);
    (segment, csum_at)
}

/// Writes a computed checksum; for UDP a computed 0 goes out as 0xffff (0 means "none").
pub fn set_l4_checksum(segment: &mut [u8], csum_at: usize, csum: u16, proto: u8) {
    let csum = if csum == 0 && proto == IPPROTO_UDP { 0xffff } else { csum };
    segment[csum_at..csum_at + 2].copy_from_slice(&csum.to_be_bytes());
}

/// An ICMP error from `src` to `dst` (`icmp_type`/`code`, `rest` the header's last 4 bytes, e.g.
/// the next-hop MTU of "fragmentation needed") quoting the IP header and first 8 L4 bytes of the
/// Ethernet frame `about`, as a router sends it.
pub fn icmp_error(src: Ipv4Addr, dst: Ipv4Addr, icmp_type: u8, code: u8, rest: [u8; 4], about: &[u8]) -> Vec<u8> {
    let quote = &about[ETH_HLEN..ETH_HLEN + 28];
    let mut icmp = vec![icmp_type, code, 0, 0];
    icmp.extend_from_slice(&rest);
    icmp.extend_from_slice(quote);
    let csum = checksum(&[&icmp]);
    icmp[2..4].copy_from_slice(&csum.to_be_bytes());
    let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0, 0, 64, IPPROTO_ICMP, 0, 0];
    ip[2..4].copy_from_slice(&((20 + icmp.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    let csum = checksum(&[&ip]);
    ip[10..12].copy_from_slice(&csum.to_be_bytes());
    let mut frame = Vec::new();
    frame.extend_from_slice(&NODE_MAC);
    frame.extend_from_slice(&CLIENT_MAC);
    frame.extend_from_slice(&0x0800u16.to_be_bytes());
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&icmp);
    frame
}

/// An ARP request (not IPv4: must pass every program untouched).
pub fn arp_request(sender: Ipv4Addr, target: Ipv4Addr) -> Vec<u8> {
    let mut frame = Vec::new();
    frame.extend_from_slice(&[0xff; 6]);
    frame.extend_from_slice(&CLIENT_MAC);
    frame.extend_from_slice(&0x0806u16.to_be_bytes());
    frame.extend_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 1]);
    frame.extend_from_slice(&CLIENT_MAC);
    frame.extend_from_slice(&sender.octets());
    frame.extend_from_slice(&[0; 6]);
    frame.extend_from_slice(&target.octets());
    frame
}

/// The Internet checksum of the concatenated parts.
pub fn checksum(parts: &[&[u8]]) -> u16 {
    let bytes: Vec<u8> = parts.concat();
    let mut sum: u32 = bytes.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// TCP/UDP checksum with the IPv4 pseudo-header; 0 when `segment` (checksum field included)
/// is correct.
pub fn l4_checksum(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, segment: &[u8]) -> u16 {
    let mut pseudo = Vec::with_capacity(12);
    pseudo.extend_from_slice(&src.octets());
    pseudo.extend_from_slice(&dst.octets());
    pseudo.extend_from_slice(&[0, proto]);
    pseudo.extend_from_slice(&(segment.len() as u16).to_be_bytes());
    checksum(&[&pseudo, segment])
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
    let ip = &frame[ETH_HLEN..];
    let ip_hlen = usize::from(ip[0] & 0x0f) * 4;
    let tot_len = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let header = ip.get(..ip_hlen)?;
    let l4 = ip.get(ip_hlen..tot_len)?.to_vec();
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let proto = ip[9];
    let csum_at = match proto {
        IPPROTO_TCP => Some(16),
        IPPROTO_UDP => Some(6),
        _ => None,
    };
    let l4_checksum_zero = proto == IPPROTO_UDP && l4.get(6..8) == Some(&[0, 0]);
    let l4_checksum_ok = match (proto, csum_at) {
        (_, Some(_)) if l4_checksum_zero => true,
        (IPPROTO_ICMP, _) => checksum(&[&l4]) == 0,
        (_, Some(_)) => l4_checksum(src, dst, proto, &l4) == 0,
        _ => false,
    };
    Some(Ipv4View { src, dst, proto, ip_checksum_ok: checksum(&[header]) == 0, l4_checksum_ok, l4_checksum_zero, l4 })
}
