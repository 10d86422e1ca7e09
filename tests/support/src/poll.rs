//! Waiting for what a test cannot be told about (a transfer a sweeper finishes, a daemon
//! back on its port, a process that exits): one loop for every test, that asks, and asks
//! again after a pause, until the answer comes or the limit has passed.
//!
//! The check is asked at least once, and the limit is looked at only after an answer
//! that is not yet the one awaited: a check that holds when it is asked is never
//! reported as late.

use std::time::{Duration, Instant};

/// Asks `check` every `every` until it answers `Some`, and returns that.
///
/// # Panics
/// With `what` once `within` has passed without a `Some`.
pub async fn eventually<T>(
    what: &str,
    within: Duration,
    every: Duration,
    mut check: impl AsyncFnMut() -> Option<T>,
) -> T {
    match poll_until(within, every, async || check().await.ok_or(())).await {
        Ok(done) => done,
        Err(()) => panic!("{what} (not within {within:?})"),
    }
}

/// [`eventually`] for a wait that reports what it saw last: `check` answers `Ok(done)`, or
/// `Err(seen)` while not yet; once `within` has passed without an `Ok`, the last `seen`
/// is returned, for the caller's own message (or for a caller that does not panic).
pub async fn poll_until<T, S>(
    within: Duration,
    every: Duration,
    mut check: impl AsyncFnMut() -> Result<T, S>,
) -> Result<T, S> {
    let deadline = Instant::now() + within;
    loop {
        match check().await {
            Ok(done) => return Ok(done),
            Err(seen) if Instant::now() >= deadline => return Err(seen),
            Err(_) => tokio::time::sleep(every).await,
        }
    }
}
