//! A client connection whose writes must make progress: a write the socket has not taken
//! any of within a bounded time fails, and hyper then ends the connection.
//!
//! A client that stops reading (its receive window at zero) lets the kernel's buffers
//! fill; hyper's write then waits for the socket for ever, and the response it was
//! writing (an event stream, with its `MAX_EVENT_STREAMS` place) stays alive with it, so a
//! handful of such clients held every stream's place, and a graceful shutdown waited for
//! them for ever. Wrapped in [`WriteLimited`], the connection's write fails once it has
//! waited [`WriteLimited::new`]'s `limit` without the socket taking a byte; the
//! connection's task ends and drops the response, and with it everything it held.
//!
//! Only a write that waits counts: an idle connection (nothing to send) is not stalled,
//! and each time the socket takes something the wait starts afresh. A TCP socket takes
//! more only once about half of its send buffer has drained, so a reader that takes less
//! than that within the limit is closed too.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// A connection whose writes fail after waiting `limit` for the socket.
pub struct WriteLimited<T> {
    inner: T,
    /// How long a write may wait for the socket to take any of it.
    limit: Duration,
    /// Running while a write waits for the socket (since the first `Pending`); dropped
    /// when the socket takes something.
    waiting: Option<Pin<Box<Sleep>>>,
}

impl<T> WriteLimited<T> {
    pub fn new(inner: T, limit: Duration) -> WriteLimited<T> {
        WriteLimited {
            inner,
            limit,
            waiting: None,
        }
    }

    /// `outcome` of a write to the socket, as the caller is to see it: a wait that has
    /// lasted `limit` becomes an error.
    fn limited<R>(
        &mut self,
        cx: &mut Context<'_>,
        outcome: Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        if let Poll::Ready(done) = outcome {
            self.waiting = None;
            return Poll::Ready(done);
        }
        let limit = self.limit;
        let timer = self
            .waiting
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        ready!(timer.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the client took nothing written to it for {limit:?}"),
        )))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteLimited<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteLimited<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let outcome = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.limited(cx, outcome)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let outcome = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.limited(cx, outcome)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let outcome = Pin::new(&mut self.inner).poll_flush(cx);
        self.limited(cx, outcome)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let outcome = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.limited(cx, outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const LIMIT: Duration = Duration::from_millis(300);

    /// A pipe whose reader never reads: the write waits, then fails, not before the
    /// limit.
    #[tokio::test]
    async fn a_write_the_other_end_never_takes_fails_after_the_limit() {
        let (near, _far) = tokio::io::duplex(16);
        let mut near = WriteLimited::new(near, LIMIT);
        near.write_all(&[0; 16])
            .await
            .expect("the pipe's buffer takes these");
        let started = tokio::time::Instant::now();
        let failed = near.write_all(&[0; 1]).await.expect_err("nothing takes it");
        assert_eq!(failed.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= LIMIT, "{:?}", started.elapsed());
    }

    /// A reader that takes a little at a time, in all far slower than the limit but
    /// within it each time: the writes go on.
    #[tokio::test]
    async fn a_slow_reader_that_takes_something_within_the_limit_each_time_is_not_cut() {
        let (near, mut far) = tokio::io::duplex(16);
        let mut near = WriteLimited::new(near, LIMIT);
        let reader = tokio::spawn(async move {
            let mut got = 0;
            let mut buf = [0; 8];
            while got < 128 {
                tokio::time::sleep(LIMIT / 3).await;
                got += far.read(&mut buf).await.unwrap();
            }
            got
        });
        near.write_all(&[0; 128])
            .await
            .expect("each wait is under the limit");
        assert_eq!(reader.await.unwrap(), 128);
    }
}
