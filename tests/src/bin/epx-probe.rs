//! `epx-probe`: the traffic generator of the end-to-end tests.
//!
//! `serve` answers every TCP connection and UDP datagram with its name; `tcp` and `udp` make
//! requests to an address and print one JSON summary line: how many were answered, by whom, and
//! how many failed with which error. A failed connection is never retried or hidden.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use anyhow::Context;
use e2e::dns::ResolvConf;
use e2e::probe::{Load, Rate, Steady, Summary};
use hdrhistogram::Histogram;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Answer with NAME on every TCP port and UDP port given (all addresses).
    Serve {
        #[arg(long)]
        name: String,
        #[arg(long)]
        tcp: Vec<u16>,
        #[arg(long)]
        udp: Vec<u16>,
        /// TCP ports that answer `NAME from CLIENT_IP` (the source address this server saw).
        #[arg(long)]
        tcp_peer: Vec<u16>,
        /// TCP ports that answer HTTP/1 requests with NAME (for standard load tools).
        #[arg(long)]
        http: Vec<u16>,
    },
    /// Make COUNT TCP connections to ADDR, one after another; read the server's name from each.
    Tcp(ClientArgs),
    /// Resolve NAME to IPv4 addresses as a pod's libc does: the search domains and `ndots` of
    /// /etc/resolv.conf, its first nameserver unless SERVER is given. Prints
    /// `{"name": FQDN, "addresses": [...]}` of the first name that has addresses; exits 1 if none.
    Dns {
        #[arg(long)]
        name: String,
        #[arg(long)]
        server: Option<SocketAddr>,
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
    },
    /// Send COUNT UDP requests to ADDR, each from a new socket; read the name from each reply.
    Udp(ClientArgs),
    /// Steady traffic for a while: short TCP connections and UDP requests at a fixed rate, plus
    /// long-lived TCP streams that exchange a message every 100 ms. Counts every failure.
    Steady {
        #[arg(long)]
        tcp: SocketAddr,
        #[arg(long)]
        udp: SocketAddr,
        /// Short connections (and UDP requests) per second.
        #[arg(long, default_value_t = 50)]
        rate: u32,
        #[arg(long, default_value_t = 2)]
        streams: u32,
        #[arg(long)]
        duration_ms: u64,
        /// Also short TCP connections to NAME:PORT at RATE, NAME looked up before each one
        /// through /etc/resolv.conf (as `dns`), as a client that caches no DNS answer.
        #[arg(long, value_name = "NAME:PORT")]
        tcp_name: Option<String>,
        /// Ask this DNS server for `--tcp-name` instead of /etc/resolv.conf's (a host process
        /// that uses the cluster DNS ClusterIP).
        #[arg(long)]
        dns_server: Option<SocketAddr>,
        /// End early, as at the deadline, once this file exists.
        #[arg(long)]
        stop_file: Option<std::path::PathBuf>,
    },
    /// CLIENTS clients (threads), each making COUNT requests of KIND (`tcp`: connect, read the
    /// server's name, close; `udp`: a datagram from a new socket, so a new flow, and its answer)
    /// to ADDR at RATE per second (0: as fast as it goes). Prints a `Load` summary.
    Load {
        #[arg(long)]
        kind: String,
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 1)]
        clients: u32,
        #[arg(long)]
        count: u32,
        #[arg(long, default_value_t = 0)]
        rate: u32,
        #[arg(long, default_value_t = 1000)]
        timeout_ms: u64,
        /// Failures are counted per this many requests of each client.
        #[arg(long, default_value_t = 500)]
        block: u32,
    },
    /// Benchmark traffic for DURATION: CLIENTS threads making short TCP connections (connect,
    /// read the server's name, close) as fast as they go, timing each connect(); or, with
    /// RR_RATE, one long-lived connection per client exchanging RR_RATE requests per second,
    /// timing each answer. Prints a `Rate` summary (rate, p50/p99 latency, failures).
    Rate {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 1)]
        clients: u32,
        #[arg(long)]
        duration_ms: u64,
        #[arg(long)]
        rr_rate: Option<u32>,
        #[arg(long, default_value_t = 3000)]
        timeout_ms: u64,
    },
    /// Try a TCP connection to ADDR (connect, read the answer) every 5 ms until one is answered;
    /// exit 0 then, 1 after LIMIT. For timing when a Service starts to answer.
    Wait {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long)]
        limit_ms: u64,
        /// Wait until this server answers (default: any).
        #[arg(long)]
        name: Option<String>,
    },
    /// Short connections to ADDR at RATE per second; once NAME has answered, print `seen`; when
    /// NAME has then not answered for QUIET_MS (or after LIMIT_MS), print a JSON line with the
    /// wall-clock time (µs since the epoch) of NAME's last answer. For timing how long a
    /// removed endpoint still gets new connections.
    LastAnswer {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long)]
        name: String,
        #[arg(long, default_value_t = 2000)]
        rate: u32,
        #[arg(long, default_value_t = 1500)]
        quiet_ms: u64,
        #[arg(long, default_value_t = 30000)]
        limit_ms: u64,
    },
    /// One connected UDP socket to ADDR, a request every INTERVAL for DURATION, as a client
    /// that keeps its socket (DNS resolvers, QUIC, game clients). On an error it reconnects.
    /// Prints the answers in order, the errors, and how often it reconnected.
    UdpConnected {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 20)]
        interval_ms: u64,
        #[arg(long)]
        duration_ms: u64,
    },
}

#[derive(serde::Serialize, Default)]
struct ConnectedUdp {
    answers: Vec<String>,
    errors: BTreeMap<String, u32>,
    reconnects: u32,
}

fn udp_connected(to: SocketAddr, interval: Duration, duration: Duration) -> ConnectedUdp {
    let connect = || -> std::io::Result<UdpSocket> {
        let socket = udp_client_socket(to, 0)?;
        socket.set_read_timeout(Some(Duration::from_millis(500)))?;
        socket.connect(to)?;
        Ok(socket)
    };
    let mut result = ConnectedUdp::default();
    let mut socket = connect().ok();
    let until = Instant::now() + duration;
    while Instant::now() < until {
        let answer = match &socket {
            Some(s) => s.send(b"ping").and_then(|_| {
                let mut buf = [0u8; 2048];
                let n = s.recv(&mut buf)?;
                Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
            }),
            None => Err(std::io::Error::other("not connected")),
        };
        match answer {
            Ok(name) => result.answers.push(name),
            Err(error) => {
                *result.errors.entry(error_name(&error)).or_default() += 1;
                socket = connect().ok();
                result.reconnects += 1;
            }
        }
        std::thread::sleep(interval);
    }
    result
}

#[derive(clap::Args)]
struct ClientArgs {
    #[arg(long)]
    to: SocketAddr,
    #[arg(long, default_value_t = 1)]
    count: u32,
    #[arg(long, default_value_t = 1000)]
    timeout_ms: u64,
    /// UDP: send request i from source port SOURCE_PORT + i (each a new flow with a known
    /// tuple), instead of a port the kernel picks. TCP: every connection from SOURCE_PORT
    /// (with `--reset`, so that the port can be used again at once).
    #[arg(long)]
    source_port: Option<u16>,
    /// TCP: close each connection with a RST (SO_LINGER 0) instead of a FIN, leaving no
    /// TIME_WAIT behind on the client.
    #[arg(long)]
    reset: bool,
    /// UDP: send datagrams of this many bytes (larger than the MTU: fragments); the server
    /// answers with as many, and an answer of another size counts as failed.
    #[arg(long)]
    size: Option<usize>,
    /// UDP: send every request from one unconnected socket (sendto, as DNS resolvers and SIP
    /// agents do) instead of a new socket each.
    #[arg(long)]
    one_socket: bool,
    /// UDP with `--one-socket`: pause this long between requests.
    #[arg(long, default_value_t = 0)]
    interval_ms: u64,
}

fn error_name(error: &std::io::Error) -> String {
    match error.raw_os_error() {
        Some(libc::ECONNREFUSED) => "ECONNREFUSED".into(),
        Some(libc::ETIMEDOUT) => "ETIMEDOUT".into(),
        Some(libc::EHOSTUNREACH) => "EHOSTUNREACH".into(),
        Some(libc::ENETUNREACH) => "ENETUNREACH".into(),
        Some(libc::EPERM) => "EPERM".into(),
        Some(libc::EAGAIN) => "TIMEOUT".into(),
        Some(code) => format!("errno{code}"),
        None => match error.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => "TIMEOUT".into(),
            std::io::ErrorKind::UnexpectedEof => "EOF".into(),
            kind => format!("{kind:?}"),
        },
    }
}

/// Binds `[::]:port` (IPv4 and IPv6 on one socket, Linux's default), or `0.0.0.0:port` where
/// the namespace has no IPv6.
fn bind_any<T>(port: u16, bind: impl Fn(SocketAddr) -> std::io::Result<T>) -> T {
    bind(SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)))
        .or_else(|_| bind(SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, port))))
        .unwrap_or_else(|e| panic!("bind port {port}: {e}"))
}

/// HTTP/1 on `port`: every request gets `name` as its body (hyper, on a current-thread runtime
/// of its own thread).
fn serve_http(name: String, port: u16) {
    let listener = bind_any(port, TcpListener::bind);
    listener.set_nonblocking(true).expect("non-blocking listener");
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
            let body = bytes::Bytes::from(format!("{name}\n"));
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let body = body.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |_request| {
                        let body = body.clone();
                        async move { Ok::<_, std::convert::Infallible>(hyper::Response::new(http_body_util::Full::new(body))) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
    });
}

fn serve(name: String, tcp: Vec<u16>, udp: Vec<u16>, tcp_peer: Vec<u16>, http: Vec<u16>) -> ! {
    for port in http {
        serve_http(name.clone(), port);
    }
    let ports = tcp.into_iter().map(|p| (p, false)).chain(tcp_peer.into_iter().map(|p| (p, true)));
    for (port, tell_peer) in ports {
        let listener = bind_any(port, TcpListener::bind);
        let name = name.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let name = name.clone();
                std::thread::spawn(move || {
                    let mut stream = stream;
                    let answer = match stream.peer_addr() {
                        // An IPv4 client on the dual-stack socket shows as ::ffff:a.b.c.d.
                        Ok(peer) if tell_peer => format!("{name} from {}", peer.ip().to_canonical()),
                        _ => name,
                    };
                    let _ = stream.write_all(format!("{answer}\n").as_bytes());
                    // Long-lived streams: echo until the client closes.
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = stream.read(&mut buf) {
                        if n == 0 || stream.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                });
            }
        });
    }
    for port in udp {
        let socket = bind_any(port, UdpSocket::bind);
        let name = name.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 65_536];
            while let Ok((n, from)) = socket.recv_from(&mut buf) {
                // A large request gets an answer as large (its name, padded with spaces), so
                // that the answer is fragmented too.
                let mut answer = name.clone().into_bytes();
                if n > 1000 {
                    answer.resize(n.max(answer.len()), b' ');
                }
                let _ = socket.send_to(&answer, from);
            }
        });
    }
    println!("ready");
    let _ = std::io::stdout().flush();
    loop {
        std::thread::park();
    }
}

fn tcp_once(to: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    tcp_once_from(None, false, to, timeout)
}

/// A connection to `to`, from `source_port` if given, closed with a RST if `reset`.
fn tcp_connect(source_port: Option<u16>, reset: bool, to: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(to), Type::STREAM, None)?;
    if let Some(port) = source_port {
        socket.set_reuse_address(true)?;
        let any: SocketAddr = if to.is_ipv6() { (std::net::Ipv6Addr::UNSPECIFIED, port).into() } else { (std::net::Ipv4Addr::UNSPECIFIED, port).into() };
        socket.bind(&any.into())?;
    }
    if reset {
        socket.set_linger(Some(Duration::ZERO))?;
    }
    socket.connect_timeout(&to.into(), timeout)?;
    Ok(socket.into())
}

fn tcp_once_from(source_port: Option<u16>, reset: bool, to: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    let stream = tcp_connect(source_port, reset, to, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line)?;
    if line.is_empty() {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    // The application must see the address it asked for, never the backend's.
    let peer = stream.peer_addr()?;
    if peer != to {
        return Err(std::io::Error::other(format!("getpeername says {peer}, expected {to}")));
    }
    Ok(line.trim().to_owned())
}

/// A UDP socket of `to`'s family, bound to `source_port` (0: any).
fn udp_client_socket(to: SocketAddr, source_port: u16) -> std::io::Result<UdpSocket> {
    if to.is_ipv6() {
        UdpSocket::bind((std::net::Ipv6Addr::UNSPECIFIED, source_port))
    } else {
        UdpSocket::bind((std::net::Ipv4Addr::UNSPECIFIED, source_port))
    }
}

/// One new UDP flow of `epx-probe load`: the request is sent up to three times on the same
/// socket, a third of `timeout` apart. Returns the answer and how many resends it took.
fn udp_flow(to: SocketAddr, timeout: Duration) -> std::io::Result<(String, u32)> {
    const TRIES: u32 = 3;
    let socket = udp_client_socket(to, 0)?;
    socket.set_read_timeout(Some(timeout / TRIES))?;
    let mut buf = [0u8; 2048];
    for resent in 0..TRIES {
        socket.send_to(b"ping", to)?;
        match socket.recv_from(&mut buf) {
            Ok((n, from)) if from == to => return Ok((String::from_utf8_lossy(&buf[..n]).trim_end().to_owned(), resent)),
            Ok((_, from)) => return Err(std::io::Error::other(format!("reply came from {from}, expected {to}"))),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::from(std::io::ErrorKind::TimedOut))
}

fn udp_once(to: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    udp_once_from(0, to, timeout)
}

fn udp_once_from(source_port: u16, to: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    udp_sized_from(source_port, None, to, timeout)
}

/// One request from `source_port` (0: any), of `size` bytes if given (answered by as many).
fn udp_sized_from(source_port: u16, size: Option<usize>, to: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    udp_request(&udp_client_socket(to, source_port)?, size, to, timeout)
}

/// One request on `socket` (unconnected: sent with sendto) and its answer.
fn udp_request(socket: &UdpSocket, size: Option<usize>, to: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    socket.set_read_timeout(Some(timeout))?;
    let request = size.map_or_else(|| b"ping".to_vec(), |n| vec![b'x'; n]);
    socket.send_to(&request, to)?;
    let mut buf = vec![0u8; 65_536];
    let (n, from) = socket.recv_from(&mut buf)?;
    // The reply must appear to come from the Service address (reverse translation).
    if from != to {
        return Err(std::io::Error::other(format!("reply came from {from}, expected {to}")));
    }
    if let Some(size) = size.filter(|s| *s > 1000 && n != *s) {
        return Err(std::io::Error::other(format!("answer of {n} bytes to a request of {size}")));
    }
    Ok(String::from_utf8_lossy(&buf[..n]).trim_end().to_owned())
}

fn run_requests(count: u32, mut once: impl FnMut() -> std::io::Result<String>) -> Summary {
    let started = Instant::now();
    let mut summary = Summary { total: count, ..Default::default() };
    let mut answers: BTreeMap<String, u32> = BTreeMap::new();
    for _ in 0..count {
        match once() {
            Ok(name) => {
                summary.ok += 1;
                summary.sequence.push(name.clone());
                *answers.entry(name).or_default() += 1;
            }
            Err(error) => {
                summary.failed += 1;
                summary.sequence.push(format!("error:{}", error_name(&error)));
                *summary.errors.entry(error_name(&error)).or_default() += 1;
            }
        }
    }
    summary.answers = answers;
    summary.elapsed_ms = started.elapsed().as_millis() as u64;
    summary
}

/// Set once `steady --stop-file` exists: every paced loop and stream ends as at its deadline.
static STOPPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Before `until`, and not stopped early.
fn running(until: Instant) -> bool {
    Instant::now() < until && !STOPPED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Requests at `rate` per second until `until`, each judged by `once`.
fn paced(rate: u32, until: Instant, mut once: impl FnMut() -> std::io::Result<String>) -> Summary {
    let period = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
    let mut next = Instant::now();
    let mut results = Vec::new();
    while running(until) {
        results.push(once());
        next += period;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    let mut iter = results.into_iter();
    run_requests(iter.len() as u32, || iter.next().expect("one result per request"))
}

/// One long-lived connection: a message every 100 ms must come back. Ok(backend) if it lived
/// until `until`.
fn stream(to: SocketAddr, until: Instant) -> std::io::Result<String> {
    let stream = TcpStream::connect_timeout(&to, Duration::from_secs(1))?;
    stream.set_read_timeout(Some(Duration::from_secs(1)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut name = String::new();
    reader.read_line(&mut name)?;
    let mut writer = stream;
    let mut n = 0u64;
    while running(until) {
        n += 1;
        writer.write_all(format!("{n}\n").as_bytes())?;
        let mut echo = String::new();
        reader.read_line(&mut echo)?;
        if echo.trim() != n.to_string() {
            return Err(std::io::Error::other(format!("stream answered {echo:?} to {n}")));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(name.trim().to_owned())
}

/// `epx-probe load`: see the subcommand's help.
fn load(kind: &str, to: SocketAddr, clients: u32, count: u32, rate: u32, timeout: Duration, block: u32) -> Load {
    let udp = match kind {
        "tcp" => false,
        "udp" => true,
        other => panic!("unknown load kind {other:?}: use tcp or udp"),
    };
    let started = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            std::thread::spawn(move || {
                let period = (rate > 0).then(|| Duration::from_secs_f64(1.0 / f64::from(rate)));
                let mut next = Instant::now();
                (0..count)
                    .map(|_| {
                        let result = if udp { udp_flow(to, timeout) } else { tcp_once(to, timeout).map(|name| (name, 0)) };
                        if let Some(period) = period {
                            next += period;
                            if let Some(wait) = next.checked_duration_since(Instant::now()) {
                                std::thread::sleep(wait);
                            }
                        }
                        result
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let block = block.max(1);
    let mut summary = Load { total: clients * count, block, ..Default::default() };
    summary.failed_per_block = vec![0; count.div_ceil(block) as usize];
    for thread in threads {
        for (i, result) in thread.join().expect("load client").into_iter().enumerate() {
            match result {
                Ok((name, resent)) => {
                    summary.retried += resent;
                    summary.ok += 1;
                    *summary.answers.entry(name).or_default() += 1;
                }
                Err(error) => {
                    summary.failed += 1;
                    summary.failed_per_block[i / block as usize] += 1;
                    *summary.errors.entry(error_name(&error)).or_default() += 1;
                }
            }
        }
    }
    summary.elapsed_ms = started.elapsed().as_millis() as u64;
    summary.per_second = f64::from(summary.total) / started.elapsed().as_secs_f64().max(1e-9);
    summary
}

/// One client's share of `epx-probe rate`.
struct RateShare {
    ok: u64,
    errors: BTreeMap<String, u64>,
    latency: Histogram<u64>,
}

fn latency_histogram() -> Histogram<u64> {
    // 1 µs to 100 s, 3 significant digits.
    Histogram::new_with_bounds(1, 100_000_000, 3).expect("valid histogram bounds")
}

/// Short connections until `until`, timing each connect().
fn rate_connect(to: SocketAddr, until: Instant, timeout: Duration) -> RateShare {
    let mut share = RateShare { ok: 0, errors: BTreeMap::new(), latency: latency_histogram() };
    while Instant::now() < until {
        let started = Instant::now();
        let result = tcp_connect(None, false, to, timeout).and_then(|stream| {
            let connected = started.elapsed();
            stream.set_read_timeout(Some(timeout))?;
            let mut line = String::new();
            BufReader::new(&stream).read_line(&mut line)?;
            if line.is_empty() {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            Ok(connected)
        });
        match result {
            Ok(connected) => {
                share.ok += 1;
                share.latency.saturating_record(connected.as_micros().max(1) as u64);
            }
            Err(error) => *share.errors.entry(error_name(&error)).or_default() += 1,
        }
    }
    share
}

/// One long-lived connection, `per_second` paced requests until `until`, timing each answer.
fn rate_rr(to: SocketAddr, per_second: u32, until: Instant, timeout: Duration) -> RateShare {
    let mut share = RateShare { ok: 0, errors: BTreeMap::new(), latency: latency_histogram() };
    let exchange = |share: &mut RateShare| -> std::io::Result<()> {
        let stream = TcpStream::connect_timeout(&to, timeout)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut name = String::new();
        reader.read_line(&mut name)?;
        let mut writer = stream;
        let period = Duration::from_secs_f64(1.0 / f64::from(per_second.max(1)));
        let mut next = Instant::now();
        let mut echo = String::new();
        while Instant::now() < until {
            let started = Instant::now();
            writer.write_all(b"ping\n")?;
            echo.clear();
            reader.read_line(&mut echo)?;
            if echo != "ping\n" {
                return Err(std::io::Error::other(format!("answer {echo:?} to ping")));
            }
            share.ok += 1;
            share.latency.saturating_record(started.elapsed().as_micros().max(1) as u64);
            next += period;
            if let Some(wait) = next.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        Ok(())
    };
    // A broken connection is one failure; the client connects again and goes on.
    while Instant::now() < until {
        if let Err(error) = exchange(&mut share) {
            *share.errors.entry(error_name(&error)).or_default() += 1;
        }
    }
    share
}

/// `epx-probe rate`: see the subcommand's help.
fn rate(to: SocketAddr, clients: u32, duration: Duration, rr_rate: Option<u32>, timeout: Duration) -> Rate {
    let started = Instant::now();
    let until = started + duration;
    let threads: Vec<_> = (0..clients.max(1))
        .map(|_| {
            std::thread::spawn(move || match rr_rate {
                Some(per_second) => rate_rr(to, per_second, until, timeout),
                None => rate_connect(to, until, timeout),
            })
        })
        .collect();
    let mut latency = latency_histogram();
    let mut summary = Rate { mode: if rr_rate.is_some() { "rr" } else { "connect" }.into(), clients: clients.max(1), ..Default::default() };
    for thread in threads {
        let share = thread.join().expect("rate client");
        summary.ok += share.ok;
        for (name, n) in share.errors {
            summary.failed += n;
            *summary.errors.entry(name).or_default() += n;
        }
        latency.add(&share.latency).expect("same histogram bounds");
    }
    let elapsed = started.elapsed();
    summary.elapsed_ms = elapsed.as_millis() as u64;
    summary.per_second = summary.ok as f64 / elapsed.as_secs_f64().max(1e-9);
    summary.p50_us = latency.value_at_quantile(0.50);
    summary.p99_us = latency.value_at_quantile(0.99);
    summary.max_us = latency.max();
    summary
}

#[derive(serde::Serialize)]
struct LastAnswer {
    /// Wall-clock time of NAME's last answer, µs since the epoch (None: it never answered).
    last_us: Option<u64>,
    connections: u64,
    failed: u64,
    /// Whether it stopped because NAME was quiet for the whole quiet window (not the limit).
    quiet: bool,
}

fn unix_micros() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

/// `epx-probe last-answer`: see the subcommand's help.
fn last_answer(to: SocketAddr, name: &str, rate: u32, quiet: Duration, limit: Duration) -> LastAnswer {
    let started = Instant::now();
    let period = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
    let mut result = LastAnswer { last_us: None, connections: 0, failed: 0, quiet: false };
    let mut last_seen: Option<Instant> = None;
    let mut next = Instant::now();
    while started.elapsed() < limit {
        result.connections += 1;
        match tcp_once(to, Duration::from_secs(1)) {
            Ok(answer) if answer == name => {
                if last_seen.is_none() {
                    println!("seen");
                    let _ = std::io::stdout().flush();
                }
                last_seen = Some(Instant::now());
                result.last_us = Some(unix_micros());
            }
            Ok(_) => {}
            Err(_) => result.failed += 1,
        }
        if last_seen.is_some_and(|seen| seen.elapsed() >= quiet) {
            result.quiet = true;
            break;
        }
        next += period;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    result
}

fn steady(tcp: SocketAddr, udp: SocketAddr, rate: u32, streams: u32, duration: Duration, tcp_name: Option<String>, dns_server: Option<SocketAddr>, stop_file: Option<std::path::PathBuf>) -> Steady {
    let until = Instant::now() + duration;
    if let Some(stop_file) = stop_file {
        std::thread::spawn(move || {
            while !stop_file.exists() {
                std::thread::sleep(Duration::from_millis(100));
            }
            STOPPED.store(true, std::sync::atomic::Ordering::Relaxed);
        });
    }
    let stream_threads: Vec<_> = (0..streams).map(|_| std::thread::spawn(move || stream(tcp, until))).collect();
    let udp_thread = std::thread::spawn(move || paced(rate, until, || udp_once(udp, Duration::from_secs(1))));
    let by_name_thread = tcp_name.map(|to| std::thread::spawn(move || paced(rate, until, || tcp_by_name(&to, dns_server, Duration::from_secs(1)))));
    let tcp_summary = paced(rate, until, || tcp_once(tcp, Duration::from_secs(1)));
    let mut results = stream_threads.into_iter().map(|t| t.join().expect("stream thread"));
    Steady {
        tcp: tcp_summary,
        udp: udp_thread.join().expect("udp thread"),
        streams: run_requests(streams, || results.next().expect("one result per stream")),
        by_name: by_name_thread.map(|thread| thread.join().expect("by-name thread")).unwrap_or_default(),
    }
}

/// `NAME:PORT` looked up through /etc/resolv.conf (at `server` if given), then one TCP request
/// to its first address.
fn tcp_by_name(to: &str, server: Option<SocketAddr>, timeout: Duration) -> std::io::Result<String> {
    let (name, port) = to.rsplit_once(':').ok_or_else(|| std::io::Error::other(format!("{to} is not NAME:PORT")))?;
    let port: u16 = port.parse().map_err(std::io::Error::other)?;
    let (_, addresses) = dns(name, server, timeout).map_err(|e| std::io::Error::other(format!("DNS: {e:#}")))?;
    let address = addresses.first().ok_or_else(|| std::io::Error::other("DNS: no address"))?;
    tcp_once(SocketAddr::from((*address, port)), timeout)
}

/// `epx-probe dns`: see the subcommand's help.
fn dns(name: &str, server: Option<SocketAddr>, timeout: Duration) -> anyhow::Result<(String, Vec<std::net::Ipv4Addr>)> {
    let conf = ResolvConf::parse(&std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default());
    let server = match server {
        Some(server) => server,
        None => SocketAddr::from((*conf.nameservers.first().context("no nameserver in /etc/resolv.conf")?, 53)),
    };
    let mut failures = Vec::new();
    for candidate in conf.candidates(name) {
        match e2e::dns::resolve(server, &candidate, timeout) {
            Ok(addresses) if !addresses.is_empty() => return Ok((candidate, addresses)),
            Ok(_) => failures.push(format!("{candidate}: no A record")),
            Err(e) => failures.push(format!("{candidate}: {:#}", anyhow::Error::from(e))),
        }
    }
    anyhow::bail!("{name} not resolved through {server}: {}", failures.join("; "))
}

fn main() {
    let cli = Cli::parse();
    if let Cmd::Steady { tcp, udp, rate, streams, duration_ms, tcp_name, dns_server, stop_file } = cli.command {
        let result = steady(tcp, udp, rate, streams, Duration::from_millis(duration_ms), tcp_name, dns_server, stop_file);
        println!("{}", serde_json::to_string(&result).expect("serialisable"));
        return;
    }
    if let Cmd::Load { kind, to, clients, count, rate, timeout_ms, block } = cli.command {
        let result = load(&kind, to, clients, count, rate, Duration::from_millis(timeout_ms), block);
        println!("{}", serde_json::to_string(&result).expect("serialisable"));
        return;
    }
    if let Cmd::Rate { to, clients, duration_ms, rr_rate, timeout_ms } = cli.command {
        let result = rate(to, clients, Duration::from_millis(duration_ms), rr_rate, Duration::from_millis(timeout_ms));
        println!("{}", serde_json::to_string(&result).expect("serialisable"));
        return;
    }
    if let Cmd::LastAnswer { to, name, rate, quiet_ms, limit_ms } = cli.command {
        let result = last_answer(to, &name, rate, Duration::from_millis(quiet_ms), Duration::from_millis(limit_ms));
        println!("{}", serde_json::to_string(&result).expect("serialisable"));
        return;
    }
    if let Cmd::Wait { to, limit_ms, name } = cli.command {
        let deadline = Instant::now() + Duration::from_millis(limit_ms);
        let answered = |result: std::io::Result<String>| match (&name, result) {
            (_, Err(_)) => false,
            (None, Ok(_)) => true,
            (Some(name), Ok(answer)) => &answer == name,
        };
        while !answered(tcp_once(to, Duration::from_millis(200))) {
            if Instant::now() > deadline {
                eprintln!("epx-probe wait: {to} did not answer within {limit_ms} ms");
                std::process::exit(1);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        return;
    }
    if let Cmd::Dns { name, server, timeout_ms } = &cli.command {
        match dns(name, *server, Duration::from_millis(*timeout_ms)) {
            Ok((name, addresses)) => println!("{}", serde_json::json!({ "name": name, "addresses": addresses })),
            Err(e) => {
                eprintln!("epx-probe dns: {e:#}");
                std::process::exit(1);
            }
        }
        return;
    }
    if let Cmd::UdpConnected { to, interval_ms, duration_ms } = cli.command {
        let result = udp_connected(to, Duration::from_millis(interval_ms), Duration::from_millis(duration_ms));
        println!("{}", serde_json::to_string(&result).expect("serialisable"));
        return;
    }
    let summary = match cli.command {
        Cmd::Steady { .. } | Cmd::UdpConnected { .. } | Cmd::Load { .. } | Cmd::Rate { .. } | Cmd::Wait { .. } | Cmd::LastAnswer { .. } | Cmd::Dns { .. } => {
            unreachable!("handled above")
        }
        Cmd::Serve { name, tcp, udp, tcp_peer, http } => serve(name, tcp, udp, tcp_peer, http),
        Cmd::Tcp(a) => run_requests(a.count, || tcp_once_from(a.source_port, a.reset, a.to, Duration::from_millis(a.timeout_ms))),
        Cmd::Udp(a) if a.one_socket => match udp_client_socket(a.to, a.source_port.unwrap_or(0)) {
            Ok(socket) => run_requests(a.count, || {
                let answer = udp_request(&socket, a.size, a.to, Duration::from_millis(a.timeout_ms));
                std::thread::sleep(Duration::from_millis(a.interval_ms));
                answer
            }),
            Err(error) => {
                eprintln!("epx-probe: cannot open a UDP socket: {error}");
                std::process::exit(1);
            }
        },
        Cmd::Udp(a) => {
            let mut next_port = a.source_port;
            run_requests(a.count, || {
                let port = next_port.unwrap_or(0);
                next_port = next_port.map(|p| p.wrapping_add(1));
                udp_sized_from(port, a.size, a.to, Duration::from_millis(a.timeout_ms))
            })
        }
    };
    println!("{}", serde_json::to_string(&summary).expect("summary is serialisable"));
}
