//! The event recorder: one task per deployment that, while this instance holds the
//! deployment's recorder lease, copies the events of its change stream into its feed and
//! removes those older than the retention (`store::events` says how, and why a missed or
//! repeated event cannot come of it).
//!
//! Every instance runs one per deployment; one instance at a time records each
//! deployment. The others try the lease every [`CLAIM_INTERVAL`], so a killed recorder
//! is replaced within [`LEASE`] plus that; one stopped by a shutdown gives its lease up.

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error_chain::Chain;
use crate::store::events::MAX_TRIMMED;
use crate::store::{Deployments, Store, StoreResult};

/// How long an event stays in the feed unless `EVENT_RETENTION_MS` says otherwise.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(30 * 24 * 3600);
/// How long a recorder's lease lasts, by the database's clock, from its last renewal.
pub const LEASE: Duration = Duration::from_secs(10);
/// How often the holder renews its lease: well within it.
const RENEW_EVERY: Duration = Duration::from_secs(3);
/// How often an instance without the lease tries to take it, and a recorder that failed
/// tries again.
pub const CLAIM_INTERVAL: Duration = Duration::from_secs(2);

/// Records the events of every deployment of `deployments` while this instance, named
/// `owner`, holds its lease, and keeps them for `retention`, until `shutdown`.
pub async fn run(
    deployments: Deployments,
    owner: String,
    retention: Duration,
    shutdown: CancellationToken,
) {
    let tasks: Vec<_> = deployments
        .all()
        .iter()
        .map(|store| {
            tokio::spawn(record_deployment(
                store.clone(),
                owner.clone(),
                retention,
                shutdown.clone(),
            ))
        })
        .collect();
    for task in tasks {
        let _ = task.await;
    }
}

/// One deployment's recorder: takes the lease when it is free, records while it holds
/// it, and tries again after a failure or a lost lease.
async fn record_deployment(
    store: Store,
    owner: String,
    retention: Duration,
    shutdown: CancellationToken,
) {
    // Said once when recording starts failing, and once when it works again.
    let mut failing = false;
    while !shutdown.is_cancelled() {
        let outcome = match store.claim_recorder(&owner, LEASE).await {
            Ok(true) => record_while_owner(&store, &owner, retention, &shutdown).await,
            Ok(false) => Ok(()),
            Err(e) => Err(e),
        };
        match outcome {
            Ok(()) if failing => {
                failing = false;
                tracing::info!(deployment = %store.deployment(), "events recorded again");
            }
            Ok(()) => {}
            Err(e) => {
                if !failing {
                    tracing::warn!(deployment = %store.deployment(), error = %Chain(&e), "events not recorded; their changes wait in the database's change stream, tried again");
                }
                failing = true;
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(CLAIM_INTERVAL) => {}
        }
    }
}

/// Records until the lease is lost, a database call fails, or `shutdown` (then gives
/// the lease up).
async fn record_while_owner(
    store: &Store,
    owner: &str,
    retention: Duration,
    shutdown: &CancellationToken,
) -> StoreResult<()> {
    let Some(mut changes) = store.open_changes(owner).await? else {
        tracing::info!(deployment = %store.deployment(), "recorder lease taken by another instance");
        return Ok(());
    };
    let trim_every = trim_interval(retention);
    let mut renewed = Instant::now();
    let mut trimmed: Option<Instant> = None;
    loop {
        if shutdown.is_cancelled() {
            return store.release_recorder(owner).await;
        }
        if renewed.elapsed() >= RENEW_EVERY {
            if !store.claim_recorder(owner, LEASE).await? {
                tracing::info!(deployment = %store.deployment(), "recorder lease taken by another instance");
                return Ok(());
            }
            renewed = Instant::now();
        }
        if trimmed.is_none_or(|t| t.elapsed() >= trim_every) {
            let removed = store.trim_events(owner, retention).await?;
            if removed > 0 {
                tracing::debug!(deployment = %store.deployment(), removed, "events past the retention removed");
            }
            // A full round: more are due; the next round comes after this recording one.
            trimmed = (removed < MAX_TRIMMED).then(Instant::now);
        }
        // Waits up to the stream's await time when nothing happens, so the loop turns a
        // few times a second when quiet.
        store.record_events(&mut changes, owner).await?;
    }
}

/// How often the feed's front is trimmed: a tenth of the retention, at most a minute,
/// at least a tenth of a second.
fn trim_interval(retention: Duration) -> Duration {
    (retention / 10).clamp(Duration::from_millis(100), Duration::from_secs(60))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_front_is_trimmed_often_enough_for_the_retention() {
        assert_eq!(
            trim_interval(Duration::from_secs(1)),
            Duration::from_millis(100)
        );
        assert_eq!(trim_interval(DEFAULT_RETENTION), Duration::from_secs(60));
        assert_eq!(
            trim_interval(Duration::from_millis(1000) / 100),
            Duration::from_millis(100)
        );
    }
}
