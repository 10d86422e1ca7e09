//! A bound on open client connections (`MAX_CONNECTIONS`).
//!
//! Admission control bounds the transfers in flight, but every open connection also
//! costs memory (hyper's buffers, a task: about 20 KiB each, measured by the benchmark's
//! overload part), and a burst from thousands of clients opens thousands of them. At the
//! bound the listener simply stops accepting until a connection closes: new ones wait in
//! the kernel's accept queue instead of in this process's memory.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Open connections unless `MAX_CONNECTIONS` says otherwise.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// A [`TcpListener`] that holds at most a fixed number of connections open at once.
pub struct BoundedListener {
    inner: TcpListener,
    /// One permit per open connection, released when the connection is dropped.
    slots: Arc<Semaphore>,
}

impl BoundedListener {
    pub fn new(inner: TcpListener, max_connections: usize) -> BoundedListener {
        BoundedListener {
            inner,
            slots: Arc::new(Semaphore::new(max_connections.max(1))),
        }
    }
}

impl axum::serve::Listener for BoundedListener {
    type Io = Counted;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Counted, SocketAddr) {
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("the connection semaphore is never closed");
        let (stream, addr) = axum::serve::Listener::accept(&mut self.inner).await;
        (
            Counted {
                stream,
                _slot: slot,
            },
            addr,
        )
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// A connection holding its slot until it is dropped.
pub struct Counted {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::serve::Listener;

    use super::*;

    #[tokio::test]
    async fn at_the_bound_a_connection_waits_until_another_one_closes() {
        let inner = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = inner.local_addr().unwrap();
        let mut listener = BoundedListener::new(inner, 1);
        let _first_client = TcpStream::connect(addr).await.unwrap();
        let (first, _) = listener.accept().await;
        let _second_client = TcpStream::connect(addr).await.unwrap();
        let waiting = tokio::time::timeout(Duration::from_millis(200), listener.accept()).await;
        assert!(
            waiting.is_err(),
            "a second connection was accepted at the bound"
        );
        drop(first);
        let accepted = tokio::time::timeout(Duration::from_secs(5), listener.accept()).await;
        assert!(
            accepted.is_ok(),
            "the waiting connection is accepted once a slot frees"
        );
    }
}
