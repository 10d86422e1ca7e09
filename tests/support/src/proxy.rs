//! A TCP proxy on the loopback that injects network faults between an instance of the
//! service and its database: every chunk forwarded, in either direction, waits a random
//! delay first, and every connection is reset (both sides closed with an RST) at a random
//! moment, so that the driver sees slow round trips, lost replies and broken pools.
//!
//! It listens on `127.0.0.1:0` and forwards to one loopback address only. It is bounded
//! (at most [`Faults::max_connections`] connections at once, each with a fixed buffer, and
//! delays of at most [`Faults::slow_delay_max`]) and stops, with every connection it
//! holds, when the [`Proxy`] is dropped (or the test's runtime ends).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use rand::Rng;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::{CancellationToken, DropGuard};

/// The faults a [`Proxy`] injects.
#[derive(Debug, Clone, Copy)]
pub struct Faults {
    /// A chunk usually waits a uniformly random delay in `0..=delay_max`...
    pub delay_max: Duration,
    /// ...but with this chance a delay in `delay_max..=slow_delay_max` instead.
    pub slow_chance: f64,
    pub slow_delay_max: Duration,
    /// The rate at which each connection is reset: in any second of its life a connection
    /// is reset with a chance of about this much (its life is exponentially distributed,
    /// mean `1 / resets_per_second` seconds). 0 for none.
    pub resets_per_second: f64,
    /// Connections beyond this many at once are closed at once.
    pub max_connections: usize,
}

impl Faults {
    /// The delay of one chunk.
    fn delay(&self, rng: &mut impl Rng) -> (Duration, bool) {
        if rng.random_bool(self.slow_chance) {
            let ms = rng.random_range(self.delay_max.as_millis()..=self.slow_delay_max.as_millis());
            (Duration::from_millis(ms as u64), true)
        } else {
            let ms = rng.random_range(0..=self.delay_max.as_millis());
            (Duration::from_millis(ms as u64), false)
        }
    }

    /// How long a new connection lives before it is reset; None: until it ends.
    fn lifetime(&self, rng: &mut impl Rng) -> Option<Duration> {
        (self.resets_per_second > 0.0).then(|| {
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            Duration::from_secs_f64((-u.ln() / self.resets_per_second).min(3600.0))
        })
    }
}

/// What a proxy did so far.
#[derive(Debug, Default, Clone, Copy)]
pub struct ProxyCounts {
    /// Connections accepted and forwarded.
    pub connections: u64,
    /// Connections closed at once: over the limit, or the upstream refused them (the
    /// database is down).
    pub refused: u64,
    /// Chunks forwarded, in both directions.
    pub chunks: u64,
    /// Chunks forwarded after a delay (of at least 1 ms).
    pub delayed: u64,
    /// Chunks that took the slow delay.
    pub slow: u64,
    /// Connections reset by the proxy.
    pub resets: u64,
}

#[derive(Default)]
struct Stats {
    connections: AtomicU64,
    refused: AtomicU64,
    chunks: AtomicU64,
    delayed: AtomicU64,
    slow: AtomicU64,
    resets: AtomicU64,
    open: AtomicUsize,
}

/// A running proxy; stops when dropped.
pub struct Proxy {
    /// Where it listens (`127.0.0.1:<port>`).
    pub addr: SocketAddr,
    pub upstream: SocketAddr,
    stats: Arc<Stats>,
    _stop: DropGuard,
}

impl Proxy {
    /// Listens on `127.0.0.1:0` and forwards every connection to `upstream`, a loopback
    /// address, with `faults`.
    pub async fn start(upstream: SocketAddr, faults: Faults) -> Proxy {
        assert!(
            upstream.ip().is_loopback(),
            "the proxy only forwards to the loopback, not {upstream}"
        );
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().unwrap();
        let stats = Arc::new(Stats::default());
        let stop = CancellationToken::new();
        tokio::spawn(accept(
            listener,
            upstream,
            faults,
            stats.clone(),
            stop.clone(),
        ));
        Proxy {
            addr,
            upstream,
            stats,
            _stop: stop.drop_guard(),
        }
    }

    pub fn counts(&self) -> ProxyCounts {
        let s = &self.stats;
        ProxyCounts {
            connections: s.connections.load(Ordering::Relaxed),
            refused: s.refused.load(Ordering::Relaxed),
            chunks: s.chunks.load(Ordering::Relaxed),
            delayed: s.delayed.load(Ordering::Relaxed),
            slow: s.slow.load(Ordering::Relaxed),
            resets: s.resets.load(Ordering::Relaxed),
        }
    }
}

async fn accept(
    listener: TcpListener,
    upstream: SocketAddr,
    faults: Faults,
    stats: Arc<Stats>,
    stop: CancellationToken,
) {
    loop {
        let client = tokio::select! {
            _ = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => client,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        if stats.open.load(Ordering::Relaxed) >= faults.max_connections {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            drop(client);
            continue;
        }
        stats.open.fetch_add(1, Ordering::Relaxed);
        let stats = stats.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = forward(client, upstream, faults, &stats) => {}
            }
            stats.open.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

/// One connection, until either side closes it or the proxy resets it.
async fn forward(mut client: TcpStream, upstream: SocketAddr, faults: Faults, stats: &Stats) {
    let connected =
        tokio::time::timeout(Duration::from_secs(3), TcpStream::connect(upstream)).await;
    let Ok(Ok(mut server)) = connected else {
        // The database is down (restarting): the client sees its connection closed.
        stats.refused.fetch_add(1, Ordering::Relaxed);
        let _ = client.set_zero_linger();
        return;
    };
    stats.connections.fetch_add(1, Ordering::Relaxed);
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let lifetime = faults.lifetime(&mut rand::rng());
    let reset = async {
        match lifetime {
            Some(lifetime) => tokio::time::sleep(lifetime).await,
            None => std::future::pending().await,
        }
    };
    let reset_now = {
        let (client_read, client_write) = client.split();
        let (server_read, server_write) = server.split();
        tokio::select! {
            _ = pump(client_read, server_write, faults, stats) => false,
            _ = pump(server_read, client_write, faults, stats) => false,
            _ = reset => true,
        }
    };
    if reset_now {
        stats.resets.fetch_add(1, Ordering::Relaxed);
        // An RST on both sides, not a polite FIN.
        let _ = client.set_zero_linger();
        let _ = server.set_zero_linger();
    }
}

/// Copies `from` to `to`, each chunk after its delay, until `from` ends or either fails.
async fn pump(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    faults: Faults,
    stats: &Stats,
) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let (delay, slow) = faults.delay(&mut rand::rng());
        stats.chunks.fetch_add(1, Ordering::Relaxed);
        if !delay.is_zero() {
            stats.delayed.fetch_add(1, Ordering::Relaxed);
            if slow {
                stats.slow.fetch_add(1, Ordering::Relaxed);
            }
            tokio::time::sleep(delay).await;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}
