//! A TCP forwarder from the host's loopback into a network namespace, with nothing configured in
//! the host's namespace.
//!
//! ```text
//!   client ──> 127.0.0.1:PORT (host netns, listener)
//!                  │  accepted socket
//!                  ▼
//!   one task per connection: a socket made in the target netns ── connect ──> TARGET
//!                  │                                         (e.g. 10.244.1.250:6443)
//!                  ▼
//!   the task copies both ways (tokio, on the forwarder's own runtime thread)
//! ```
//! A socket belongs to the network namespace it was created in, and the namespace is per thread
//! in Linux: only the onward socket is created in the target namespace (on a short-lived thread,
//! [`crate::topology::in_netns`]); the process and every other thread stay in the host's.
//!
//! [`Forwarder::set_blackhole`] simulates a black-holed path: while it is on, no byte passes in
//! either direction and new connections are accepted but not connected onwards; nothing is
//! closed, so clients see a half-open connection rather than a refusal.
//! [`Forwarder::set_rate_limit`] simulates a slow or overloaded API server: what the target
//! sends passes at most that many bytes a second, on the connections made while it is set.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;

/// How long a connection waits for the target to accept it.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What the tests switch; every connection task watches it.
struct Control {
    blackhole: watch::Sender<bool>,
    /// Bumped by [`Forwarder::reset_connections`]: the connections open then end.
    resets: watch::Sender<u64>,
    shutdown: watch::Sender<bool>,
    /// Bytes a second from the target to the client, on connections made while it is set.
    rate_limit: watch::Sender<Option<u32>>,
    /// Connections accepted so far.
    accepted: AtomicU64,
}

/// Forwards connections to `127.0.0.1:<port>` in the host namespace to a target address as seen
/// from inside another network namespace. Stops (closing every connection) on drop.
pub struct Forwarder {
    addr: SocketAddr,
    target: SocketAddr,
    control: Arc<Control>,
    runtime: Option<JoinHandle<()>>,
}

impl Forwarder {
    /// Listens on a free port of 127.0.0.1 and forwards to `target`, connecting from inside the
    /// network namespace whose file is `netns` (e.g. `/run/netns/NAME`).
    pub fn start(netns: &Path, target: SocketAddr) -> anyhow::Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").context("binding the forwarder on 127.0.0.1")?;
        Self::start_on(listener, netns, target)
    }

    /// As [`Forwarder::start`], but listening on the loopback of the network namespace
    /// `listen_netns` (e.g. a node namespace whose processes reach the API server this way).
    pub fn start_in(listen_netns: &Path, netns: &Path, target: SocketAddr) -> anyhow::Result<Self> {
        let listener = crate::topology::in_netns(listen_netns, || std::net::TcpListener::bind("127.0.0.1:0"))
            .and_then(|bound| bound)
            .with_context(|| format!("binding a forwarder on 127.0.0.1 in {}", listen_netns.display()))?;
        Self::start_on(listener, netns, target)
    }

    fn start_on(listener: std::net::TcpListener, netns: &Path, target: SocketAddr) -> anyhow::Result<Self> {
        // The target namespace is checked now, so that a wrong path fails here and not per connection.
        crate::topology::in_netns(netns, || ()).with_context(|| format!("entering network namespace {}", netns.display()))?;
        let addr = listener.local_addr().context("forwarder address")?;
        listener.set_nonblocking(true).context("forwarder listener")?;
        let control = Arc::new(Control {
            blackhole: watch::Sender::new(false),
            resets: watch::Sender::new(0),
            shutdown: watch::Sender::new(false),
            rate_limit: watch::Sender::new(None),
            accepted: AtomicU64::new(0),
        });
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().context("the forwarder's runtime")?;
        let (netns, serving) = (netns.to_owned(), control.clone());
        let runtime = std::thread::Builder::new()
            .name(format!("fwd-{}", addr.port()))
            // The tasks still running when `serve` returns are dropped with the runtime, on this
            // thread: their sockets close.
            .spawn(move || runtime.block_on(serve(listener, netns, target, serving)))
            .context("spawning the forwarder's thread")?;
        Ok(Self { addr, target, control, runtime: Some(runtime) })
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
        self.control.blackhole.send_replace(on);
    }

    /// Connections connected onwards from now on pass what the target sends at most `bytes` a
    /// second (`None`: as fast as it comes), with small socket buffers, so that little waits
    /// unsent: a short answer sent after a long one (e.g. `GET /version` on the HTTP/2 connection
    /// of a long list) waits about as long as it would behind a slow server. Connections open
    /// already keep their pace.
    pub fn set_rate_limit(&self, bytes: Option<u32>) {
        self.control.rate_limit.send_replace(bytes);
    }

    /// Connections accepted so far: while the target is down, each is one attempt of a client to
    /// reach it (a request, a watch, a probe), as a load balancer in front of it would count.
    pub fn connections(&self) -> u64 {
        self.control.accepted.load(Ordering::Relaxed)
    }

    /// Closes every connection open through the forwarder, as a load balancer in front of the
    /// API that restarts would; new connections are forwarded as before.
    pub fn reset_connections(&self) {
        self.control.resets.send_modify(|generation| *generation += 1);
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.control.shutdown.send_replace(true);
        if let Some(runtime) = self.runtime.take() {
            let _ = runtime.join();
        }
    }
}

/// Accepts until shutdown; each connection is a task.
async fn serve(listener: std::net::TcpListener, netns: PathBuf, target: SocketAddr, control: Arc<Control>) {
    let Ok(listener) = TcpListener::from_std(listener) else { return };
    let mut shutdown = control.shutdown.subscribe();
    let netns = Arc::new(netns);
    loop {
        tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => return,
            accepted = listener.accept() => {
                if let Ok((client, _)) = accepted {
                    control.accepted.fetch_add(1, Ordering::Relaxed);
                    tokio::spawn(connection(client, netns.clone(), target, control.clone()));
                }
            }
        }
    }
}

/// One connection: waits out a black hole, connects onwards from the target namespace, copies
/// both ways; ends at a reset, an error either way, or EOF both ways.
async fn connection(mut client: TcpStream, netns: Arc<PathBuf>, target: SocketAddr, control: Arc<Control>) {
    let mut resets = control.resets.subscribe();
    let blackhole = control.blackhole.subscribe();
    let _ = client.set_nodelay(true);
    let forward = async {
        passing(&mut blackhole.clone()).await;
        let rate_limit = *control.rate_limit.borrow();
        // Refused or unreachable: the client's side closes (when `client` is dropped), as a
        // failed proxy's would.
        let mut upstream = connect_from(&netns, target, rate_limit.is_some()).await?;
        let _ = upstream.set_nodelay(true);
        let (client_read, client_write) = client.split();
        let (upstream_read, upstream_write) = upstream.split();
        tokio::try_join!(
            copy(client_read, upstream_write, blackhole.clone(), None),
            copy(upstream_read, client_write, blackhole.clone(), rate_limit)
        )
        .map(|_| ())
    };
    tokio::select! {
        _ = forward => {}
        _ = resets.changed() => {}
    }
}

/// A socket made in the namespace `netns`, connected to `target`. With `small` buffers, little
/// of what the target sends waits unsent: a small receive buffer here, and a small segment size,
/// which keeps the target's send buffer small too (Linux sizes it by segments: over loopback a
/// segment is 64 kB, and a megabyte would wait in it).
async fn connect_from(netns: &Path, target: SocketAddr, small: bool) -> io::Result<TcpStream> {
    let socket = crate::topology::in_netns(netns, || if target.is_ipv4() { TcpSocket::new_v4() } else { TcpSocket::new_v6() })??;
    if small {
        socket.set_recv_buffer_size(SMALL_BUFFER as u32)?;
        socket2::SockRef::from(&socket).set_tcp_mss(1400)?;
    }
    tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(target)).await.map_err(|_| io::Error::from(io::ErrorKind::TimedOut))?
}

/// Returns once the black hole is off (at once if it is; also once the forwarder is gone).
async fn passing(blackhole: &mut watch::Receiver<bool>) {
    let _ = blackhole.wait_for(|on| !*on).await;
}

/// The receive buffer of an onward socket under a rate limit, and the most read at a time.
const SMALL_BUFFER: usize = 16 * 1024;

/// Copies `from` to `to` until EOF (then half-closes `to`) or an error (then the connection
/// ends), at most `rate_limit` bytes a second if set. Bytes read just before a black hole went
/// on are held, not delivered.
async fn copy(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    mut blackhole: watch::Receiver<bool>,
    rate_limit: Option<u32>,
) -> io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    // Read no more than a tenth of a second's worth at a time, so that the pace is even.
    let chunk = rate_limit.map_or(buf.len(), |rate| (rate as usize / 10).clamp(1, SMALL_BUFFER));
    loop {
        passing(&mut blackhole).await;
        let n = from.read(&mut buf[..chunk]).await?;
        if n == 0 {
            let _ = to.shutdown().await;
            return Ok(());
        }
        passing(&mut blackhole).await;
        to.write_all(&buf[..n]).await?;
        if let Some(rate) = rate_limit {
            tokio::time::sleep(Duration::from_secs_f64(n as f64 / f64::from(rate.max(1)))).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// Forwards within the current namespace (our own netns file) to an echo server.
    #[test]
    fn forwards_holds_while_blackholed_resets_and_stops_on_drop() {
        let server = std::net::TcpListener::bind("127.0.0.1:0").expect("bind echo server");
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
        let echo = |conn: &mut std::net::TcpStream, what: &[u8; 5]| {
            conn.write_all(what).expect("write");
            let mut buf = [0u8; 5];
            conn.read_exact(&mut buf).expect("echo");
            assert_eq!(&buf, what);
        };
        let mut conn = std::net::TcpStream::connect(fwd.addr()).expect("connect to forwarder");
        conn.set_read_timeout(Some(Duration::from_secs(2))).expect("timeout");
        echo(&mut conn, b"hello");

        fwd.set_blackhole(true);
        conn.set_read_timeout(Some(Duration::from_millis(300))).expect("timeout");
        conn.write_all(b"again").expect("write while blackholed");
        let mut buf = [0u8; 5];
        let held = conn.read(&mut buf);
        assert!(held.is_err(), "bytes passed through the black hole: {held:?}");
        fwd.set_blackhole(false);
        conn.set_read_timeout(Some(Duration::from_secs(2))).expect("timeout");
        conn.read_exact(&mut buf).expect("echo after the black hole");
        assert_eq!(&buf, b"again");

        fwd.reset_connections();
        let mut rest = Vec::new();
        let closed = conn.read_to_end(&mut rest);
        assert!(matches!(closed, Ok(0)) || closed.is_err(), "connection still open after a reset: {closed:?}");
        let mut conn = std::net::TcpStream::connect(fwd.addr()).expect("connect after the reset");
        conn.set_read_timeout(Some(Duration::from_secs(2))).expect("timeout");
        echo(&mut conn, b"later");
        assert_eq!(fwd.connections(), 2, "two connections were made through the forwarder");

        // Under a rate limit, what comes back takes its time (only a lower bound is checked).
        fwd.set_rate_limit(Some(50_000));
        let mut slow = std::net::TcpStream::connect(fwd.addr()).expect("connect under the rate limit");
        slow.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let sent = vec![7u8; 100_000];
        let started = std::time::Instant::now();
        let writer = {
            let mut slow = slow.try_clone().expect("clone");
            let sent = sent.clone();
            std::thread::spawn(move || slow.write_all(&sent))
        };
        let mut back = vec![0u8; sent.len()];
        slow.read_exact(&mut back).expect("echo under the rate limit");
        writer.join().expect("writer").expect("write");
        assert_eq!(back, sent);
        assert!(started.elapsed() >= Duration::from_millis(1500), "100 kB came back at 50 kB/s in {:?}", started.elapsed());
        fwd.set_rate_limit(None);
        drop(slow);

        let addr = fwd.addr();
        drop(fwd);
        let closed = conn.read_to_end(&mut rest);
        assert!(matches!(closed, Ok(0)) || closed.is_err(), "connection still open after drop: {closed:?}");
        assert!(std::net::TcpStream::connect(addr).is_err(), "the forwarder still listens after drop");
    }
}
