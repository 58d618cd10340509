//! A TCP forwarder from the host's loopback into a network namespace, with nothing configured in
//! the host's namespace.
//!
//! ```text
//!   client ──> 127.0.0.1:PORT (host netns, listener)
//!                  │  accepted socket
//!                  ▼
//!   connector thread (setns into the target netns) ── connect ──> TARGET (e.g. 10.244.1.250:6443)
//!                  │  connected socket
//!                  ▼
//!   two copy threads per connection shuttle the bytes
//! ```
//! The network namespace is per thread in Linux, so only the connector thread enters the target
//! namespace; the process and every other thread stay in the host's.
//!
//! [`Forwarder::set_blackhole`] simulates a black-holed path: while it is on, no byte passes in
//! either direction and new connections are accepted but not connected onwards; nothing is
//! closed, so clients see a half-open connection rather than a refusal.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;

/// How long the connector waits for the target to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A request to the connector thread: where to send the connected socket.
type ConnectRequest = mpsc::Sender<std::io::Result<TcpStream>>;

#[derive(Default)]
struct State {
    blackhole: bool,
    shutdown: bool,
    next_id: u64,
    /// Clones of both sockets of every live connection, to shut them down on drop.
    conns: HashMap<u64, Vec<TcpStream>>,
    /// One thread per connection (it joins its own second copy thread).
    threads: Vec<JoinHandle<()>>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A copy thread that panicked must not take the forwarder's shutdown down with it.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Blocks while the black hole is on; false once the forwarder shuts down.
    fn wait_passing(&self) -> bool {
        let mut state = self.lock();
        while state.blackhole && !state.shutdown {
            state = self.changed.wait(state).unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        !state.shutdown
    }

    /// Registers a socket of connection `id`; false (and the socket is shut down) once the
    /// forwarder shuts down.
    fn register(&self, id: u64, stream: &TcpStream) -> bool {
        let mut state = self.lock();
        match stream.try_clone() {
            Ok(clone) if !state.shutdown => {
                state.conns.entry(id).or_default().push(clone);
                true
            }
            _ => {
                let _ = stream.shutdown(Shutdown::Both);
                false
            }
        }
    }
}

/// Forwards connections to `127.0.0.1:<port>` in the host namespace to a target address as seen
/// from inside another network namespace. Stops (closing every connection) on drop.
pub struct Forwarder {
    addr: SocketAddr,
    /// The namespace the listener is in (`None`: the host's).
    listen_netns: Option<PathBuf>,
    target: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
    connector: Option<JoinHandle<()>>,
}

impl Forwarder {
    /// Listens on a free port of 127.0.0.1 and forwards to `target`, connecting from inside the
    /// network namespace whose file is `netns` (e.g. `/run/netns/NAME`).
    pub fn start(netns: &Path, target: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the forwarder on 127.0.0.1")?;
        Self::start_on(listener, None, netns, target)
    }

    /// As [`Forwarder::start`], but listening on the loopback of the network namespace
    /// `listen_netns` (e.g. a node namespace whose processes reach the API server this way).
    pub fn start_in(listen_netns: &Path, netns: &Path, target: SocketAddr) -> anyhow::Result<Self> {
        let listener = crate::topology::in_netns(listen_netns, || TcpListener::bind("127.0.0.1:0"))
            .and_then(|bound| bound)
            .with_context(|| format!("binding a forwarder on 127.0.0.1 in {}", listen_netns.display()))?;
        Self::start_on(listener, Some(listen_netns.to_owned()), netns, target)
    }

    fn start_on(listener: TcpListener, listen_netns: Option<PathBuf>, netns: &Path, target: SocketAddr) -> anyhow::Result<Self> {
        let netns_file = File::open(netns).with_context(|| format!("opening network namespace {}", netns.display()))?;
        let addr = listener.local_addr().context("forwarder address")?;
        let shared = Arc::new(Shared { state: Mutex::new(State::default()), changed: Condvar::new() });

        let (requests, incoming) = mpsc::channel::<ConnectRequest>();
        let (ready_tx, ready_rx) = mpsc::channel::<std::io::Result<()>>();
        let connector = std::thread::Builder::new()
            .name(format!("fwd-connect-{}", addr.port()))
            .spawn(move || connector(netns_file, target, incoming, ready_tx))
            .context("spawning the forwarder's connector thread")?;
        ready_rx
            .recv()
            .context("the forwarder's connector thread died")?
            .with_context(|| format!("entering network namespace {}", netns.display()))?;

        let acceptor_shared = Arc::clone(&shared);
        let acceptor = std::thread::Builder::new()
            .name(format!("fwd-accept-{}", addr.port()))
            .spawn(move || acceptor(listener, acceptor_shared, requests))
            .context("spawning the forwarder's accept thread")?;
        Ok(Self { addr, listen_netns, target, shared, acceptor: Some(acceptor), connector: Some(connector) })
    }

    /// The listening address on the host's loopback.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn target(&self) -> SocketAddr {
        self.target
    }

    /// While on, no byte passes on existing or new connections and new connections are not
    /// connected onwards; nothing is closed. Off resumes where it stopped.
    pub fn set_blackhole(&self, on: bool) {
        self.shared.lock().blackhole = on;
        self.shared.changed.notify_all();
    }

    /// Closes every connection open through the forwarder, as a load balancer in front of the
    /// API that restarts would; new connections are forwarded as before.
    pub fn reset_connections(&self) {
        let state = self.shared.lock();
        for stream in state.conns.values().flatten() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// Connections currently open through the forwarder.
    pub fn connections(&self) -> usize {
        self.shared.lock().conns.len()
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        {
            let mut state = self.shared.lock();
            state.shutdown = true;
            for stream in state.conns.values().flatten() {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
        self.shared.changed.notify_all();
        // Wake the blocking accept(); the acceptor sees `shutdown` and returns.
        let wake = || TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        let _ = match &self.listen_netns {
            None => wake(),
            Some(netns) => crate::topology::in_netns(netns, wake).and_then(|woken| woken),
        };
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        let threads = std::mem::take(&mut self.shared.lock().threads);
        for thread in threads {
            let _ = thread.join();
        }
        // Every request sender is gone now, so the connector's loop ends.
        if let Some(connector) = self.connector.take() {
            let _ = connector.join();
        }
    }
}

/// Enters the target namespace, then connects on request until every requester is gone.
fn connector(
    netns: File,
    target: SocketAddr,
    incoming: mpsc::Receiver<ConnectRequest>,
    ready: mpsc::Sender<std::io::Result<()>>,
) {
    // SAFETY: setns(2) on an open namespace fd; it changes only this thread's network namespace.
    let entered = if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    };
    let ok = entered.is_ok();
    let _ = ready.send(entered);
    drop(netns);
    if !ok {
        return;
    }
    for reply in incoming {
        let _ = reply.send(TcpStream::connect_timeout(&target, CONNECT_TIMEOUT));
    }
}

fn acceptor(listener: TcpListener, shared: Arc<Shared>, requests: mpsc::Sender<ConnectRequest>) {
    for client in listener.incoming() {
        let mut state = shared.lock();
        if state.shutdown {
            return;
        }
        let Ok(client) = client else { continue };
        state.threads.retain(|t| !t.is_finished());
        let id = state.next_id;
        state.next_id += 1;
        drop(state);

        let conn_shared = Arc::clone(&shared);
        let requests = requests.clone();
        let thread = std::thread::Builder::new()
            .name(format!("fwd-conn-{id}"))
            .spawn(move || connection(id, client, conn_shared, requests));
        if let Ok(thread) = thread {
            shared.lock().threads.push(thread);
        }
    }
}

/// One connection: waits out a black hole, gets the onward socket, copies both ways.
fn connection(id: u64, client: TcpStream, shared: Arc<Shared>, requests: mpsc::Sender<ConnectRequest>) {
    let _ = client.set_nodelay(true);
    if !shared.register(id, &client) || !shared.wait_passing() {
        forget(&shared, id);
        return;
    }
    let (reply, connected) = mpsc::channel();
    let upstream = match requests.send(reply).ok().and_then(|()| connected.recv().ok()) {
        Some(Ok(upstream)) => upstream,
        // Refused or unreachable: close the client's side, as a failed proxy would.
        _ => {
            let _ = client.shutdown(Shutdown::Both);
            forget(&shared, id);
            return;
        }
    };
    drop(requests);
    let _ = upstream.set_nodelay(true);
    if !shared.register(id, &upstream) {
        let _ = client.shutdown(Shutdown::Both);
        forget(&shared, id);
        return;
    }

    let back = match (upstream.try_clone(), client.try_clone()) {
        (Ok(from), Ok(to)) => {
            let back_shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("fwd-back-{id}"))
                .spawn(move || copy(&from, &to, &back_shared))
                .ok()
        }
        _ => None,
    };
    if back.is_some() {
        copy(&client, &upstream, &shared);
    }
    if let Some(back) = back {
        let _ = back.join();
    }
    let _ = client.shutdown(Shutdown::Both);
    let _ = upstream.shutdown(Shutdown::Both);
    forget(&shared, id);
}

fn forget(shared: &Shared, id: u64) {
    shared.lock().conns.remove(&id);
}

/// Copies `from` to `to` until EOF (then half-closes `to`) or an error (then closes both).
fn copy(mut from: &TcpStream, mut to: &TcpStream, shared: &Shared) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if !shared.wait_passing() {
            break;
        }
        let n = match from.read(&mut buf) {
            Ok(0) => {
                let _ = to.shutdown(Shutdown::Write);
                return;
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        // Bytes read just before a black hole went on are held, not delivered.
        if !shared.wait_passing() || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Forwards within the current namespace (our own netns file) to an echo server.
    #[test]
    fn forwards_holds_while_blackholed_and_stops_on_drop() {
        let server = TcpListener::bind("127.0.0.1:0").expect("bind echo server");
        let target = server.local_addr().expect("echo address");
        std::thread::spawn(move || {
            for conn in server.incoming().flatten() {
                std::thread::spawn(move || {
                    let (mut r, mut w) = (&conn, &conn);
                    let _ = std::io::copy(&mut r, &mut w);
                });
            }
        });
        let fwd = Forwarder::start(Path::new("/proc/self/ns/net"), target).expect("forwarder");
        let mut conn = TcpStream::connect(fwd.addr()).expect("connect to forwarder");
        conn.set_read_timeout(Some(Duration::from_millis(300))).expect("timeout");
        let mut buf = [0u8; 5];
        conn.write_all(b"hello").expect("write");
        conn.read_exact(&mut buf).expect("echo");
        assert_eq!(&buf, b"hello");

        fwd.set_blackhole(true);
        conn.write_all(b"again").expect("write while blackholed");
        let held = conn.read(&mut buf);
        assert!(held.is_err(), "bytes passed through the black hole: {held:?}");
        fwd.set_blackhole(false);
        conn.set_read_timeout(Some(Duration::from_secs(2))).expect("timeout");
        conn.read_exact(&mut buf).expect("echo after the black hole");
        assert_eq!(&buf, b"again");

        drop(fwd);
        let mut rest = Vec::new();
        let closed = conn.read_to_end(&mut rest);
        assert!(matches!(closed, Ok(0)) || closed.is_err(), "connection still open after drop: {closed:?}");
    }
}
