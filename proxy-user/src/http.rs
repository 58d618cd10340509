//! The HTTP server of the health, metrics and healthCheckNodePort endpoints, on hyper.
//!
//! Probes and Prometheus send a GET per request; that is all this serves. It must hold under
//! hostile or broken clients, since `/healthz` decides whether kubelet restarts the agent and
//! healthCheckNodePorts face the load balancers' network:
//! - at most [`MAX_CONNECTIONS`] connections at once: past that, new ones wait in the kernel's
//!   accept queue (nothing is spawned for them);
//! - a request head must arrive within [`HEAD_TIMEOUT`], and a connection lives at most
//!   [`CONNECTION_DEADLINE`] (a slow client cannot hold one for minutes);
//! - a head above [`MAX_HEAD_BYTES`] is answered 431 by hyper;
//! - methods other than GET and HEAD are answered 405;
//! - an `accept()` error (EMFILE, ENFILE, ENOMEM...) is logged once and retried after
//!   [`ACCEPT_BACKOFF`], never in a busy loop.
//! Each connection serves one request (`Connection: close`), as kube-proxy's answers say.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderValue, ALLOW, CONNECTION, CONTENT_TYPE};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

pub const MAX_CONNECTIONS: usize = 128;
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
pub const CONNECTION_DEADLINE: Duration = Duration::from_secs(10);
/// hyper's smallest allowed read buffer: a head larger than this is refused with 431.
pub const MAX_HEAD_BYTES: usize = 8192;
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Response {
    pub fn text(status: u16, body: impl Into<String>) -> Self {
        Self { status, content_type: "text/plain; charset=utf-8", body: body.into() }
    }
    pub fn json(status: u16, body: impl Into<String>) -> Self {
        Self { status, content_type: "application/json", body: body.into() }
    }
}

/// `response` as hyper's, with the headers kube-proxy's endpoints send.
fn to_hyper(response: Response, head_only: bool) -> hyper::Response<Full<Bytes>> {
    let body = if head_only { Bytes::new() } else { Bytes::from(response.body) };
    let mut out = hyper::Response::new(Full::new(body));
    *out.status_mut() = StatusCode::from_u16(response.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = out.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(response.content_type));
    headers.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    headers.insert(CONNECTION, HeaderValue::from_static("close"));
    out
}

fn answer<F: Fn(&str) -> Response>(handler: &F, request: &Request<hyper::body::Incoming>) -> hyper::Response<Full<Bytes>> {
    match *request.method() {
        Method::GET => to_hyper(handler(request.uri().path()), false),
        Method::HEAD => to_hyper(handler(request.uri().path()), true),
        _ => {
            let mut out = to_hyper(Response::text(405, "method not allowed"), false);
            out.headers_mut().insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
            out
        }
    }
}

/// Serves `handler(path)` on `bind` until the task is dropped.
pub async fn serve<F>(bind: SocketAddr, handler: F) -> std::io::Result<tokio::task::JoinHandle<()>>
where
    F: Fn(&str) -> Response + Send + Sync + 'static,
{
    let listener = Arc::new(TcpListener::bind(bind).await?);
    let accept = move || {
        let listener = listener.clone();
        async move { listener.accept().await.map(|(stream, _)| stream) }
    };
    Ok(tokio::spawn(accept_loop(accept, Arc::new(handler), bind)))
}

/// Takes a connection slot, accepts, and serves the connection on its own task; backs off
/// after an accept error.
async fn accept_loop<A, Fut, F>(mut accept: A, handler: Arc<F>, bind: SocketAddr)
where
    A: FnMut() -> Fut,
    Fut: Future<Output = std::io::Result<TcpStream>>,
    F: Fn(&str) -> Response + Send + Sync + 'static,
{
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut failing = false;
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else { return };
        let stream = match accept().await {
            Ok(stream) => {
                failing = false;
                stream
            }
            Err(error) => {
                if !failing {
                    tracing::warn!(%bind, "cannot accept connections: {error}; retrying every {ACCEPT_BACKOFF:?}");
                    failing = true;
                }
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let handler = handler.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let response = answer(&*handler, &request);
                async move { Ok::<_, Infallible>(response) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .max_buf_size(MAX_HEAD_BYTES)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_DEADLINE, connection).await;
            drop(slot);
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    async fn server() -> (SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let task = serve(addr, |path| Response::text(200, format!("ok {path}"))).await.unwrap();
        (addr, task)
    }

    /// Sends `request` and reads the whole answer (the server closes).
    async fn exchange(addr: SocketAddr, request: &[u8]) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(request).await.unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
        String::from_utf8_lossy(&answer).into_owned()
    }

    #[tokio::test]
    async fn get_and_head_are_served_other_methods_get_405_and_a_huge_head_431() {
        let (addr, _task) = server().await;
        let ok = exchange(addr, b"GET /healthz?x=1 HTTP/1.1\r\nHost: a\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.ends_with("ok /healthz"), "{ok}");
        assert!(ok.to_ascii_lowercase().contains("connection: close") && ok.contains("nosniff"), "{ok}");
        let head = exchange(addr, b"HEAD /livez HTTP/1.1\r\nHost: a\r\n\r\n").await;
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n") && head.ends_with("\r\n\r\n"), "{head}");
        let post = exchange(addr, b"POST /healthz HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n").await;
        assert!(post.starts_with("HTTP/1.1 405 ") && post.to_ascii_lowercase().contains("allow: get, head"), "{post}");
        let huge = format!("GET / HTTP/1.1\r\nHost: a\r\nX-Big: {}\r\n\r\n", "a".repeat(20_000));
        let answer = exchange(addr, huge.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
    }

    #[tokio::test]
    async fn idle_and_slow_clients_are_capped_and_cut_off_and_the_endpoint_answers_again() {
        let (addr, _task) = server().await;
        // More idle connections than the cap, and one client dribbling its head byte by byte.
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS + 20 {
            idle.push(TcpStream::connect(addr).await.unwrap());
        }
        let slow = tokio::spawn(async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            let started = Instant::now();
            for byte in b"GET /slow HTTP/1.1\r\nHost: a\r\nX-Pad: ".iter().chain(std::iter::repeat(&b'a')) {
                if stream.write_all(&[*byte]).await.is_err() || started.elapsed() > Duration::from_secs(30) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            started.elapsed()
        });
        // The capped ones are closed by the head timeout; then a probe is answered.
        let started = Instant::now();
        for mut stream in idle.drain(..MAX_CONNECTIONS) {
            let mut buf = [0u8; 1];
            let read = tokio::time::timeout(Duration::from_secs(15), stream.read(&mut buf)).await;
            assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "an idle connection must be closed: {read:?}");
        }
        assert!(started.elapsed() < HEAD_TIMEOUT + Duration::from_secs(3), "{:?}", started.elapsed());
        drop(idle);
        let ok = exchange(addr, b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        let held = slow.await.unwrap();
        assert!(held < CONNECTION_DEADLINE + Duration::from_secs(3), "a slow client held its connection {held:?}");
    }

    #[tokio::test]
    async fn accept_errors_back_off_instead_of_spinning() {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let accept = move || {
            counted.fetch_add(1, Ordering::Relaxed);
            async { Err::<TcpStream, _>(std::io::Error::from_raw_os_error(libc::EMFILE)) }
        };
        let handler = Arc::new(|_: &str| Response::text(200, "ok"));
        let task = tokio::spawn(accept_loop(accept, handler, "127.0.0.1:1".parse().unwrap()));
        tokio::time::sleep(Duration::from_secs(1)).await;
        task.abort();
        let calls = calls.load(Ordering::Relaxed);
        // One per back-off at most (fewer on a loaded machine), never a spin.
        assert!((1..=11).contains(&calls), "{calls} accept() calls in 1 s of EMFILE (one per {ACCEPT_BACKOFF:?})");
    }
}
