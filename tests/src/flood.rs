//! Hostile traffic for the end-to-end tests: spoofed SYNs from random sources, malformed frames,
//! spoofed RSTs. Frames are built with etherparse (an implementation independent of the
//! datapath's) and written to an interface inside a test namespace with an AF_PACKET socket, so
//! they go nowhere but over that namespace's veth. Spoofed sources come from 198.18.0.0/15 (the
//! benchmarking range): nothing routes it, so the backend's answers to them are dropped at the
//! node (counted as `tc_fib_fail`), inside the test's namespaces.

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use etherparse::PacketBuilder;

/// A small deterministic generator (xorshift64*): reproducible floods without a dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn u32(&mut self) -> u32 {
        (self.next() >> 32) as u32
    }
}

/// A random source in 198.18.0.0/15, port 1024-65535.
fn spoofed_source(rng: &mut Rng) -> SocketAddrV4 {
    let host = rng.u32() & 0x0001_ffff;
    SocketAddrV4::new(Ipv4Addr::from(0xc612_0000 | host), 1024 + (rng.u32() % 64_512) as u16)
}

/// The link-layer ends of a frame sent from one side of a veth to the other.
#[derive(Clone, Copy, Debug)]
pub struct Link {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
}

/// An interface's MAC address, read with `ip` inside the namespace at `netns`.
pub fn mac_of(netns: &Path, interface: &str) -> anyhow::Result<[u8; 6]> {
    let mut cmd = std::process::Command::new("ip");
    crate::topology::enter_netns_on_exec(&mut cmd, netns)?;
    let output = crate::topology::run(cmd.args(["-o", "link", "show", "dev", interface]))?;
    let text = String::from_utf8_lossy(&output.stdout);
    let mac = text
        .split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .with_context(|| format!("no MAC address for {interface} in {text:?}"))?;
    let bytes: Vec<u8> = mac.split(':').map(|b| u8::from_str_radix(b, 16)).collect::<Result<_, _>>()?;
    bytes.try_into().map_err(|_| anyhow::anyhow!("bad MAC {mac}"))
}

fn tcp_frame(link: Link, src: SocketAddrV4, dst: SocketAddrV4, build: impl FnOnce(etherparse::PacketBuilderStep<etherparse::TcpHeader>) -> etherparse::PacketBuilderStep<etherparse::TcpHeader>, seq: u32) -> Vec<u8> {
    let builder = PacketBuilder::ethernet2(link.src_mac, link.dst_mac)
        .ipv4(src.ip().octets(), dst.ip().octets(), 64)
        .tcp(src.port(), dst.port(), seq, 64_240);
    let builder = build(builder);
    let mut frame = Vec::with_capacity(builder.size(0));
    builder.write(&mut frame, &[]).expect("writing to a Vec");
    frame
}

/// `count` SYNs to `dst`, each from a random spoofed source.
pub fn spoofed_syns(link: Link, dst: SocketAddrV4, count: usize, rng: &mut Rng) -> Vec<Vec<u8>> {
    (0..count)
        .map(|_| {
            let seq = rng.u32();
            tcp_frame(link, spoofed_source(rng), dst, |b| b.syn(), seq)
        })
        .collect()
}

/// `count` malformed frames to `dst` from spoofed sources, of every kind the parser must pass
/// untouched: IHL below 5, a total length beyond the frame, a TCP data offset below 5, a TCP
/// header cut short, a non-first fragment.
pub fn malformed(link: Link, dst: SocketAddrV4, count: usize, rng: &mut Rng) -> Vec<Vec<u8>> {
    const IP: usize = 14;
    (0..count)
        .map(|i| {
            let seq = rng.u32();
            let mut frame = tcp_frame(link, spoofed_source(rng), dst, |b| b.syn(), seq);
            match i % 5 {
                0 => frame[IP] = 0x43,
                1 => frame[IP + 2..IP + 4].copy_from_slice(&4000u16.to_be_bytes()),
                2 => frame[IP + 20 + 12] = 0x30,
                3 => {
                    frame.truncate(IP + 20 + 10);
                    frame[IP + 2..IP + 4].copy_from_slice(&30u16.to_be_bytes());
                }
                _ => frame[IP + 6..IP + 8].copy_from_slice(&(0x2000u16 | 185).to_be_bytes()),
            }
            frame
        })
        .collect()
}

/// A SYN from `src` to `dst`.
pub fn syn(link: Link, src: SocketAddrV4, dst: SocketAddrV4, seq: u32) -> Vec<u8> {
    tcp_frame(link, src, dst, |b| b.syn(), seq)
}

/// A RST+ACK from `src` to `dst` with the given sequence and acknowledgement numbers.
pub fn rst_ack(link: Link, src: SocketAddrV4, dst: SocketAddrV4, seq: u32, ack: u32) -> Vec<u8> {
    tcp_frame(link, src, dst, |b| b.rst().ack(ack), seq)
}

/// An AF_PACKET socket bound to `interface` of the namespace at `netns` (the socket stays in
/// that namespace for its life).
pub struct RawSender {
    fd: OwnedFd,
}

impl RawSender {
    pub fn open(netns: &Path, interface: &str) -> anyhow::Result<Self> {
        let interface = std::ffi::CString::new(interface)?;
        let fd = crate::topology::in_netns(netns, move || -> io::Result<OwnedFd> {
            // SAFETY: plain socket(2)/if_nametoindex(3)/bind(2) calls with valid arguments; the
            // descriptor is owned at once.
            unsafe {
                let raw = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from((libc::ETH_P_ALL as u16).to_be()));
                if raw < 0 {
                    return Err(io::Error::last_os_error());
                }
                let fd = OwnedFd::from_raw_fd(raw);
                let index = libc::if_nametoindex(interface.as_ptr());
                if index == 0 {
                    return Err(io::Error::last_os_error());
                }
                let mut addr: libc::sockaddr_ll = std::mem::zeroed();
                addr.sll_family = libc::AF_PACKET as u16;
                addr.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
                addr.sll_ifindex = index as i32;
                let len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
                if libc::bind(fd.as_raw_fd(), (&raw const addr).cast(), len) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(fd)
            }
        })??;
        Ok(Self { fd })
    }

    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: a valid buffer and length on a socket we own.
        let sent = unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        if sent < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
    }

    /// Sends `frames` at about `per_second` (in bursts every 10 ms, so the receiving veth's
    /// backlog never overflows and only the datapath is tested); returns how many went out.
    pub fn send_paced(&self, frames: &[Vec<u8>], per_second: u32) -> io::Result<usize> {
        let burst = (per_second / 100).max(1) as usize;
        let started = Instant::now();
        for (i, chunk) in frames.chunks(burst).enumerate() {
            for frame in chunk {
                self.send(frame)?;
            }
            let due = started + Duration::from_millis(10 * (i as u64 + 1));
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        Ok(frames.len())
    }
}
