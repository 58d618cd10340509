//! Aborting local UDP sockets that are connected to a backend that is gone.
//!
//! The socket hooks translate a connected UDP socket once, at `connect()`; its later datagrams
//! go straight to that backend without passing a hook again. When the backend is removed, such a
//! socket would keep sending into the void (or to whatever reuses the address). Like Cilium's
//! socket LB, the agent then destroys those sockets through `sock_diag` (`SOCK_DESTROY`, kernel
//! option `CONFIG_INET_DIAG_DESTROY`): the application sees `ECONNABORTED`, reconnects, and
//! the hook picks a live backend. TCP is left alone: a TCP connection to a dead backend fails
//! by itself, and kube-proxy does not cut TCP connections either.
//!
//! Sockets belong to network namespaces; the ones that matter are those of the processes under
//! the managed cgroup (those the hooks translate for). Each such namespace is entered by a
//! short-lived thread of its own, so the agent's other threads never change namespace.

use std::collections::{BTreeSet, HashSet};
use std::fs;
use std::io;
use std::mem::size_of;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

const NETLINK_SOCK_DIAG: libc::c_int = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct NlMsgHdr {
    len: u32,
    kind: u16,
    flags: u16,
    seq: u32,
    pid: u32,
}

/// `struct inet_diag_sockid`: ports and addresses in network byte order.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct InetDiagSockId {
    sport: [u8; 2],
    dport: [u8; 2],
    src: [u8; 16],
    dst: [u8; 16],
    ifindex: u32,
    cookie: [u32; 2],
}

/// `struct inet_diag_req_v2`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct InetDiagReqV2 {
    family: u8,
    protocol: u8,
    ext: u8,
    pad: u8,
    states: u32,
    id: InetDiagSockId,
}

/// `struct inet_diag_msg` (the part we read).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct InetDiagMsg {
    family: u8,
    state: u8,
    timer: u8,
    retrans: u8,
    id: InetDiagSockId,
    expires: u32,
    rqueue: u32,
    wqueue: u32,
    uid: u32,
    inode: u32,
}

const _: () = assert!(size_of::<NlMsgHdr>() == 16);
const _: () = assert!(size_of::<InetDiagSockId>() == 48);
const _: () = assert!(size_of::<InetDiagReqV2>() == 56);
const _: () = assert!(size_of::<InetDiagMsg>() == 72);

#[derive(Debug, thiserror::Error)]
pub enum SockDestroyError {
    #[error("reading the processes of cgroup {path}")]
    Cgroup { path: PathBuf, #[source] source: io::Error },
    #[error("in the network namespace of pid {pid}: {action}")]
    Netns { pid: u32, action: &'static str, #[source] source: io::Error },
}

/// Destroys every UDP socket, in the namespaces of `cgroup`'s processes, whose peer is one of
/// `backends`. Returns how many were destroyed.
pub fn destroy_udp_connected_to(cgroup: &Path, backends: &BTreeSet<SocketAddr>) -> Result<usize, SockDestroyError> {
    if backends.is_empty() {
        return Ok(0);
    }
    let mut destroyed = 0;
    for (pid, netns) in namespaces_of(cgroup)? {
        let backends = backends.clone();
        let result = std::thread::scope(|scope| {
            scope
                .spawn(move || -> Result<usize, SockDestroyError> {
                    let err = |action| move |source| SockDestroyError::Netns { pid, action, source };
                    // SAFETY: setns on this thread only; the thread ends when the scope does.
                    if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                        return Err(err("entering it")(io::Error::last_os_error()));
                    }
                    let mut count = 0;
                    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
                        let diag = Diag::open().map_err(err("opening sock_diag"))?;
                        let victims: Vec<InetDiagSockId> = diag
                            .udp_sockets(family)
                            .map_err(err("listing UDP sockets"))?
                            .into_iter()
                            .filter(|id| backends.contains(&peer(family, id)))
                            .collect();
                        for id in victims {
                            match diag.destroy_udp(family, id) {
                                Ok(()) => count += 1,
                                // Closed meanwhile.
                                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                                Err(e) => return Err(err("destroying a socket")(e)),
                            }
                        }
                    }
                    Ok(count)
                })
                .join()
                .expect("the socket-destroy thread does not panic")
        });
        destroyed += result?;
    }
    Ok(destroyed)
}

/// One process per distinct network namespace among `cgroup`'s processes (recursively), with an
/// open handle on that namespace.
fn namespaces_of(cgroup: &Path) -> Result<Vec<(u32, OwnedFd)>, SockDestroyError> {
    let mut seen = HashSet::new();
    let mut found = Vec::new();
    let mut dirs = vec![cgroup.to_owned()];
    while let Some(dir) = dirs.pop() {
        let procs = match fs::read_to_string(dir.join("cgroup.procs")) {
            Ok(procs) => procs,
            // A child cgroup removed while walking.
            Err(e) if e.kind() == io::ErrorKind::NotFound && dir != cgroup => continue,
            Err(source) => return Err(SockDestroyError::Cgroup { path: dir, source }),
        };
        for pid in procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
            let path = format!("/proc/{pid}/ns/net");
            // Processes come and go; one that is gone has no sockets left to fix.
            let Ok(meta) = fs::metadata(&path) else { continue };
            if !seen.insert((meta.dev(), meta.ino())) {
                continue;
            }
            if let Ok(file) = fs::File::open(&path) {
                found.push((pid, OwnedFd::from(file)));
            }
        }
        if let Ok(entries) = fs::read_dir(&dir) {
            dirs.extend(entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()));
        }
    }
    Ok(found)
}

/// The peer of a socket as a canonical address (IPv4-mapped IPv6 becomes IPv4).
fn peer(family: u8, id: &InetDiagSockId) -> SocketAddr {
    let ip = if family == libc::AF_INET as u8 {
        IpAddr::from([id.dst[0], id.dst[1], id.dst[2], id.dst[3]])
    } else {
        Ipv6Addr::from(id.dst).to_canonical()
    };
    SocketAddr::new(ip, u16::from_be_bytes(id.dport))
}

/// A `NETLINK_SOCK_DIAG` socket in the calling thread's network namespace.
struct Diag(OwnedFd);

impl Diag {
    fn open() -> io::Result<Self> {
        // SAFETY: plain socket(2); the fd is owned below.
        let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, NETLINK_SOCK_DIAG) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a new descriptor nobody else owns.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn send(&self, kind: u16, flags: u16, req: InetDiagReqV2) -> io::Result<()> {
        #[repr(C)]
        struct Request {
            header: NlMsgHdr,
            req: InetDiagReqV2,
        }
        let message = Request {
            header: NlMsgHdr { len: size_of::<Request>() as u32, kind, flags, seq: 1, pid: 0 },
            req,
        };
        // SAFETY: message is a plain repr(C) value of the length given.
        let sent = unsafe {
            libc::send(self.0.as_raw_fd(), &message as *const Request as *const libc::c_void, size_of::<Request>(), 0)
        };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Reads answers until DONE or an ACK/error; calls `each` for every diag message.
    fn receive(&self, mut each: impl FnMut(InetDiagMsg)) -> io::Result<()> {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: buf is writable for its length.
            let n = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            let mut rest = &buf[..n as usize];
            while rest.len() >= size_of::<NlMsgHdr>() {
                // SAFETY: at least a header's worth of bytes; read_unaligned copes with alignment.
                let header: NlMsgHdr = unsafe { std::ptr::read_unaligned(rest.as_ptr() as *const NlMsgHdr) };
                let len = header.len as usize;
                if len < size_of::<NlMsgHdr>() || len > rest.len() {
                    return Err(io::Error::other("malformed netlink answer"));
                }
                let payload = &rest[size_of::<NlMsgHdr>()..len];
                match header.kind {
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => {
                        let code = payload.get(..4).map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                        return if code == 0 { Ok(()) } else { Err(io::Error::from_raw_os_error(-code)) };
                    }
                    SOCK_DIAG_BY_FAMILY if payload.len() >= size_of::<InetDiagMsg>() => {
                        // SAFETY: length checked; read_unaligned copes with alignment.
                        each(unsafe { std::ptr::read_unaligned(payload.as_ptr() as *const InetDiagMsg) });
                    }
                    _ => {}
                }
                // Messages are 4-byte aligned.
                let advance = (len + 3) & !3;
                rest = rest.get(advance..).unwrap_or(&[]);
            }
        }
    }

    fn udp_sockets(&self, family: u8) -> io::Result<Vec<InetDiagSockId>> {
        let req = InetDiagReqV2 { family, protocol: libc::IPPROTO_UDP as u8, states: !0, ..Default::default() };
        self.send(SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, req)?;
        let mut ids = Vec::new();
        self.receive(|msg| ids.push(msg.id))?;
        Ok(ids)
    }

    fn destroy_udp(&self, family: u8, id: InetDiagSockId) -> io::Result<()> {
        let req = InetDiagReqV2 { family, protocol: libc::IPPROTO_UDP as u8, states: !0, id, ..Default::default() };
        self.send(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, req)?;
        self.receive(|_| {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;

    /// Needs root (CAP_NET_ADMIN) and a kernel with CONFIG_INET_DIAG_DESTROY; runs in the test's
    /// own cgroup and network namespace, touching only the sockets it creates.
    #[test]
    fn a_connected_udp_socket_to_a_gone_backend_is_aborted_and_others_are_not() {
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        assert_eq!(euid, 0, "this test needs root (CAP_NET_ADMIN, sock_diag): run it as root, or leave it out with --skip a_connected_udp_socket");
        let target = UdpSocket::bind("127.0.0.1:0").unwrap();
        let other = UdpSocket::bind("127.0.0.1:0").unwrap();
        let victim = UdpSocket::bind("127.0.0.1:0").unwrap();
        victim.connect(target.local_addr().unwrap()).unwrap();
        let bystander = UdpSocket::bind("127.0.0.1:0").unwrap();
        bystander.connect(other.local_addr().unwrap()).unwrap();

        let cgroup_line = fs::read_to_string("/proc/self/cgroup").unwrap();
        let own = cgroup_line.lines().find_map(|l| l.strip_prefix("0::")).unwrap().to_owned();
        let root = fs::read_to_string("/proc/mounts")
            .unwrap()
            .lines()
            .find(|l| l.split_whitespace().nth(2) == Some("cgroup2"))
            .and_then(|l| l.split_whitespace().nth(1).map(PathBuf::from))
            .unwrap();
        let cgroup = root.join(own.trim_start_matches('/'));

        let destroyed = destroy_udp_connected_to(&cgroup, &BTreeSet::from([target.local_addr().unwrap()])).unwrap();
        assert_eq!(destroyed, 1);
        victim.set_read_timeout(Some(std::time::Duration::from_millis(100))).unwrap();
        let error = victim.recv(&mut [0u8; 16]).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::ECONNABORTED), "{error}");
        bystander.send(b"x").expect("a socket to a live backend is untouched");
    }
}
