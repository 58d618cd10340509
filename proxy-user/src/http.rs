//! A minimal HTTP/1.1 responder for the health and metrics endpoints.
//!
//! Probes and Prometheus send one GET per connection; that is all this serves. It lives off the
//! packet path and holds no lock while writing.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

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

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        404 => "Not Found",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// Serves `handler(path)` on `bind` until the task is dropped.
pub async fn serve<F>(bind: SocketAddr, handler: F) -> std::io::Result<tokio::task::JoinHandle<()>>
where
    F: Fn(&str) -> Response + Send + Sync + 'static,
{
    let listener = TcpListener::bind(bind).await?;
    let handler = Arc::new(handler);
    Ok(tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else { continue };
            let handler = handler.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut len = 0;
                // Read until the end of the request head (or the buffer is full).
                while len < buf.len() {
                    match tokio::time::timeout(std::time::Duration::from_secs(5), stream.read(&mut buf[len..])).await {
                        Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
                        Ok(Ok(n)) => len += n,
                    }
                    if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                let head = String::from_utf8_lossy(&buf[..len]);
                let path = head.split_whitespace().nth(1).unwrap_or("/");
                let path = path.split('?').next().unwrap_or(path);
                let response = handler(path);
                let out = format!(
                    "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nX-Content-Type-Options: nosniff\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
                    response.status,
                    reason(response.status),
                    response.content_type,
                    response.body.len(),
                    response.body
                );
                let _ = stream.write_all(out.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    }))
}
