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
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_sock_diag::{
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
    SockDiagMessage, AF_INET, AF_INET6, IPPROTO_UDP,
};
use netlink_sys::{protocols::NETLINK_SOCK_DIAG, Socket};

/// `SOCK_DESTROY` (linux/sock_diag.h): netlink-packet-sock-diag builds the request body
/// (`inet_diag_req_v2`) but knows only `SOCK_DIAG_BY_FAMILY` as its message type.
const SOCK_DESTROY: u16 = 21;

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
                    for family in [AF_INET, AF_INET6] {
                        let diag = Diag::open().map_err(err("opening sock_diag"))?;
                        let victims: Vec<SocketId> = diag
                            .udp_sockets(family)
                            .map_err(err("listing UDP sockets"))?
                            .into_iter()
                            .filter(|id| backends.contains(&peer(id)))
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
fn peer(id: &SocketId) -> SocketAddr {
    SocketAddr::new(id.destination_address.to_canonical(), id.destination_port)
}

/// A `NETLINK_SOCK_DIAG` socket in the calling thread's network namespace.
struct Diag(Socket);

impl Diag {
    fn open() -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
        socket.bind_auto()?;
        socket.connect(&netlink_sys::SocketAddr::new(0, 0))?;
        Ok(Self(socket))
    }

    /// Sends an `inet_diag_req_v2` for UDP sockets of `family` (`id`: one socket, or none for
    /// a dump) as a message of type `kind`.
    fn send(&self, kind: u16, flags: u16, family: u8, id: Option<SocketId>) -> io::Result<()> {
        let socket_id = id.unwrap_or_else(|| if family == AF_INET { SocketId::new_v4() } else { SocketId::new_v6() });
        let request = InetRequest {
            family,
            protocol: IPPROTO_UDP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::all(),
            socket_id,
        };
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        let mut message = NetlinkMessage::new(header, SockDiagMessage::InetRequest(request).into());
        message.finalize();
        // finalize() takes the type from the payload (always SOCK_DIAG_BY_FAMILY).
        message.header.message_type = kind;
        let mut buf = vec![0u8; message.buffer_len()];
        message.serialize(&mut buf);
        self.0.send(&buf, 0)?;
        Ok(())
    }

    /// Reads answers until DONE or an ACK/error; calls `each` for every socket reported.
    fn receive(&self, mut each: impl FnMut(SocketId)) -> io::Result<()> {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = self.0.recv(&mut &mut buf[..], 0)?;
            let mut rest = &buf[..n];
            while !rest.is_empty() {
                let message = NetlinkMessage::<SockDiagMessage>::deserialize(rest).map_err(io::Error::other)?;
                match message.payload {
                    NetlinkPayload::Done(_) => return Ok(()),
                    NetlinkPayload::Error(error) if error.code.is_none() => return Ok(()),
                    NetlinkPayload::Error(error) => return Err(error.to_io()),
                    NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(response)) => each(response.header.socket_id),
                    _ => {}
                }
                // Messages are 4-byte aligned.
                let advance = (message.header.length as usize + 3) & !3;
                if advance == 0 {
                    return Err(io::Error::other("malformed netlink answer"));
                }
                rest = rest.get(advance..).unwrap_or(&[]);
            }
        }
    }

    fn udp_sockets(&self, family: u8) -> io::Result<Vec<SocketId>> {
        self.send(netlink_packet_sock_diag::SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, family, None)?;
        let mut ids = Vec::new();
        self.receive(|id| ids.push(id))?;
        Ok(ids)
    }

    fn destroy_udp(&self, family: u8, id: SocketId) -> io::Result<()> {
        self.send(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, family, Some(id))?;
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
