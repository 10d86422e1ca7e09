//! Serves HTTP/1.1 connections within two bounds: `MAX_CONNECTIONS` and
//! `HTTP_IDLE_TIMEOUT_MS`.
//!
//! Admission control bounds the transfers in flight, but every open connection also
//! costs memory (hyper's buffers and a task, see `docs/benchmark/decisions.md`) and a
//! place, and a burst from thousands of clients opens thousands of them. So:
//! - at most `max_connections` connections are served at once. One beyond them is
//!   answered a single 503 `overloaded` (with `Retry-After`, `Connection: close`) and
//!   closed; at most [`REFUSING_AT_ONCE`] are being answered so at a time, and one beyond
//!   those too is closed unanswered. Nothing waits unanswered in the kernel's accept
//!   queue, which held clients until they timed out.
//! - the places are shared with admission control ([`places`]): a request waits for a
//!   transfer permit only while a place is free, so that once the bound is reached the
//!   requests on the connections served are refused at once, and their connections can
//!   carry the clients' next requests, rather than held while new connections are
//!   refused here.
//! - a connection must send each request's headers within `idle_timeout` of being
//!   opened or answered: a quiet keep-alive connection is closed and gives its place
//!   back, so clients that go quiet cannot lock the others out.
//! - a write to the client must be taken by the socket within `write_timeout`
//!   ([`super::write_limit`]): a client that stops reading (an event stream's, above all)
//!   is closed, and gives its place and its response's (a stream's) back. Its socket's
//!   send buffer is capped ([`SEND_BUFFER`]), so that a write waits after a bounded
//!   amount sent to a client that does not read.
//! - at shutdown, connections still open [`CLOSE_WITHIN`] after it began (a response
//!   still being written to a client that does not read) are closed: a shutdown ends
//!   within a bounded time whatever the clients do.
//!
//! - a request is copied out of the buffer it was read into as it arrives
//!   ([`super::detached`]): a request waiting for a transfer permit holds no read buffer.
//!
//! This is hyper's own HTTP/1 connection with its header-read timer (`axum::serve` runs
//! it without a timer, so it has no such time-out) and hyper-util's graceful shutdown.
//! HTTP/2 without TLS (prior knowledge) is not served: hyper has no idle time-out for it.

use std::convert::Infallible;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::util::MapRequest;

use super::detached::detached;
use super::problem::ApiError;
use super::write_limit::WriteLimited;

/// The send buffer asked of the kernel for each client connection (`SO_SNDBUF`; Linux
/// books twice this, half of it for its own overhead). Left to itself the kernel grows a
/// connection's send buffer with the bursts written to it, up to `tcp_wmem`'s maximum
/// (4 MB by default): an event stream whose reader had stopped reading took a whole
/// recorder's round of 1.9 MB into its buffer without a write waiting, so the write
/// limit never began to count, and the stream kept its `MAX_EVENT_STREAMS` place while
/// nothing more was written. Capped, a client that stops reading makes a write wait
/// after a bounded amount (this, the client's own buffers and the response's queue), and
/// each connection holds a bounded amount of kernel memory. One connection's throughput
/// is then at most this a round trip: 2.5 MB/s at 100 ms, far above what a page or a
/// stream needs.
pub const SEND_BUFFER: usize = 256 * 1024;

/// Connections served at once unless `MAX_CONNECTIONS` says otherwise.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Connections beyond the bound being answered 503 at once, at most.
pub const REFUSING_AT_ONCE: usize = 64;
/// How long a refused connection may take to send its request's headers.
const REFUSAL_READ_TIMEOUT: Duration = Duration::from_secs(1);
/// The `route` label of the requests answered so, in `http_requests_total`.
pub const REFUSED_ROUTE: &str = "(beyond MAX_CONNECTIONS)";
/// How long answering a refused connection may take in all.
const REFUSAL_TIME_LIMIT: Duration = Duration::from_secs(2);
/// How long a shutdown lets the connections finish what they are answering before it
/// closes them. A request takes milliseconds and an event stream ends at once with its
/// final comment, so only a client that does not read is still open after it; well
/// within a Kubernetes pod's 30 s grace, with the 10 s that background transfers are
/// then given (`startup.rs`).
pub const CLOSE_WITHIN: Duration = Duration::from_secs(5);

/// The bounds on client connections.
#[derive(Debug, Clone)]
pub struct Limits {
    /// One permit per connection served at once (`MAX_CONNECTIONS`), from [`places`].
    pub places: Arc<Semaphore>,
    /// Longest wait for a request's headers, from the connection's opening or its
    /// previous answer.
    pub idle_timeout: Duration,
    /// Longest wait of a write for the client's socket to take any of it
    /// (`HTTP_WRITE_TIMEOUT_MS`, 20 s by default). The kernel lets a write in again once
    /// about half of the socket's send buffer has drained, so a client is closed once it
    /// has taken less than that for this long (the buffer is [`SEND_BUFFER`]): it has
    /// stopped reading, or reads so slowly that an event stream could only
    /// fall further behind (it resumes with `Last-Event-ID`). Above the 15 s of an event
    /// stream's keep-alive, so that a proxy that forwards in bursts is not cut, and under
    /// the minute that nginx gives (`send_timeout`), since a stalled stream holds one of
    /// `MAX_EVENT_STREAMS` places meanwhile. A setting, because what a client or a proxy
    /// in front may need varies, and tests need both ends.
    pub write_timeout: Duration,
}

impl Limits {
    /// The bounds `settings` give, with the connection places `places` (from [`places`]).
    pub fn new(places: Arc<Semaphore>, settings: &crate::config::Settings) -> Limits {
        Limits {
            places,
            idle_timeout: settings.http_idle_timeout,
            write_timeout: settings.http_write_timeout,
        }
    }
}

/// The places of `max_connections` connections: one permit each, held while a
/// connection is served.
pub fn places(max_connections: usize) -> Arc<Semaphore> {
    Arc::new(Semaphore::new(max_connections.max(1)))
}

/// Serves `app` on `listener` until `shutdown` is cancelled, then stops accepting, lets
/// every request in progress finish (for [`CLOSE_WITHIN`] at most, then closes what is
/// still open), closes idle connections and returns.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let places = limits.places;
    let refusing = Arc::new(Semaphore::new(REFUSING_AT_ONCE));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.idle_timeout);
    let graceful = GracefulShutdown::new();
    // Cancelled once the shutdown's grace has run out: every connection still open closes.
    let closing = CancellationToken::new();
    let connections = TaskTracker::new();
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => with_send_buffer_capped(stream),
                Err(e) => {
                    accept_failed(e).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        match places.clone().try_acquire_owned() {
            Ok(place) => {
                let app = MapRequest::new(app.clone(), detached::<Incoming>);
                let service = TowerToHyperService::new(app);
                let io = TokioIo::new(WriteLimited::new(stream, limits.write_timeout));
                let connection = graceful.watch(http.serve_connection(io, service));
                let closing = closing.clone();
                connections.spawn(async move {
                    tokio::select! {
                        ended = connection => if let Err(e) = ended {
                            tracing::trace!(error = %e, "connection ended with an error");
                        },
                        () = closing.cancelled() => {}
                    }
                    drop(place);
                });
            }
            Err(_) => match refusing.clone().try_acquire_owned() {
                Ok(permit) => {
                    tokio::spawn(async move {
                        refuse(stream).await;
                        drop(permit);
                    });
                }
                Err(_) => drop(stream),
            },
        }
    }
    drop(listener);
    if tokio::time::timeout(CLOSE_WITHIN, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            grace = ?CLOSE_WITHIN,
            open = connections.len(),
            "connections still answering after the shutdown's grace (clients not reading); closing them"
        );
        closing.cancel();
    }
    connections.close();
    connections.wait().await;
    Ok(())
}

/// `stream`, with a send buffer of [`SEND_BUFFER`] asked of the kernel.
fn with_send_buffer_capped(stream: TcpStream) -> TcpStream {
    if let Err(e) = socket2::SockRef::from(&stream).set_send_buffer_size(SEND_BUFFER) {
        tracing::debug!(error = %e, "setting a connection's send buffer failed");
    }
    stream
}

/// Answers the connection's first request 503 `overloaded` and closes it.
async fn refuse(stream: TcpStream) {
    let answer = hyper::service::service_fn(|request: hyper::Request<_>| {
        crate::metrics::http_request(
            request.method().as_str(),
            Some(REFUSED_ROUTE),
            503,
            Duration::ZERO,
        );
        async { Ok::<_, Infallible>(refusal()) }
    });
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(REFUSAL_READ_TIMEOUT)
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), answer);
    // The client's to lose: a slow or broken one is simply dropped.
    let _ = tokio::time::timeout(REFUSAL_TIME_LIMIT, connection).await;
}

/// The answer to a connection beyond the bound.
fn refusal() -> Response {
    let mut response = ApiError::Overloaded.into_response();
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// A failed accept: the client went away (nothing to do), or the process is out of
/// file descriptors or memory, which a pause may cure; the loop goes on either way.
async fn accept_failed(e: io::Error) {
    use io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    tracing::error!(error = %e, "accepting a connection failed; pausing 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}
