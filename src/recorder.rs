//! The event recorder: one task per deployment that, while this instance holds the
//! deployment's recorder lease, copies the events of its change stream into its feed and
//! removes those older than the retention (`store::events` says how, and why a missed or
//! repeated event cannot come of it).
//!
//! Every instance runs one per deployment; one instance at a time records each
//! deployment, under the deployment's recorder lease ([`crate::lease`]: its length, its
//! renewal, and how a killed or stopped holder is replaced).

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error_chain::Chain;
use crate::lease::{Lease, RecorderLease, Task};
use crate::store::events::MAX_TRIMMED;
use crate::store::{Deployments, Store, StoreError, StoreResult};

/// How long an event stays in the feed unless `EVENT_RETENTION_MS` says otherwise.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(30 * 24 * 3600);

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
    let mut lease = Lease::new(RecorderLease(store.clone()), owner);
    let mut recorder = Recorder {
        store,
        retention,
        shutdown: shutdown.clone(),
    };
    lease.hold(&shutdown, &mut recorder).await;
}

/// One deployment's recorder, while its instance holds the lease.
struct Recorder {
    store: Store,
    /// How long events stay in the feed.
    retention: Duration,
    shutdown: CancellationToken,
}

impl Task<RecorderLease> for Recorder {
    type Error = StoreError;

    /// Records until the lease is lost, a database call fails, or shutdown (after which
    /// the lease is given up).
    async fn work(&mut self, lease: &mut Lease<RecorderLease>, (): ()) -> StoreResult<()> {
        let store = &self.store;
        let owner = lease.owner().to_owned();
        let Some(mut changes) = store.events().open_changes(&owner).await? else {
            tracing::info!(deployment = %store.deployment(), "recorder lease taken by another instance");
            return Ok(());
        };
        let trim_every = trim_interval(self.retention);
        let mut trimmed: Option<Instant> = None;
        loop {
            if self.shutdown.is_cancelled() {
                return Ok(());
            }
            if !lease.renew_if_due().await? {
                tracing::info!(deployment = %store.deployment(), "recorder lease taken by another instance");
                return Ok(());
            }
            if trimmed.is_none_or(|t| t.elapsed() >= trim_every) {
                let removed = store.events().trim_events(&owner, self.retention).await?;
                if removed > 0 {
                    tracing::debug!(deployment = %store.deployment(), removed, "events past the retention removed");
                }
                // A full round: more are due; the next round comes after this recording
                // one.
                trimmed = (removed < MAX_TRIMMED).then(Instant::now);
            }
            // Waits up to the stream's await time when nothing happens, so the loop turns
            // a few times a second when quiet.
            store.events().record_events(&mut changes, &owner).await?;
        }
    }

    fn failed(&self, e: &StoreError) {
        tracing::warn!(deployment = %self.store.deployment(), error = %Chain(e), "events not recorded; their changes wait in the database's change stream, tried again");
    }

    fn recovered(&self) {
        tracing::info!(deployment = %self.store.deployment(), "events recorded again");
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
