//! The event recorder: one task per deployment that, while this instance holds the
//! deployment's recorder lease, gives the events marked due in the documents their places
//! in its feed (after what is left of an older version's change stream) and removes those
//! older than the retention (`store::events` says how, and why a missed or repeated event
//! cannot come of it).
//!
//! Every instance runs one per deployment; one instance at a time records each
//! deployment, under the deployment's recorder lease ([`crate::lease`]: its length, its
//! renewal, and how a killed or stopped holder is replaced).

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error_chain::Chain;
use crate::lease::{Lease, RecorderLease, Task};
use crate::store::events::{MAX_RECORDED, MAX_TRIMMED};
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
    /// the lease is given up): first what is left of an older version's change stream,
    /// then the events this version's writes mark due.
    async fn work(&mut self, lease: &mut Lease<RecorderLease>, (): ()) -> StoreResult<()> {
        let owner = lease.owner().to_owned();
        let mut trim = Trim::new(self.retention);
        if self.store.events().stream_left().await?
            && !self.read_stream_to_end(lease, &owner, &mut trim).await?
        {
            return Ok(());
        }
        let store = &self.store;
        let mut due = store.events().rounds().open_due(&owner).await?;
        let mut wait = ROUND_EVERY;
        loop {
            if self.shutdown.is_cancelled() {
                return Ok(());
            }
            if !lease.renew_if_due().await? {
                self.lost();
                return Ok(());
            }
            trim.if_due(store, &owner).await?;
            let Some(recorded) = store.events().rounds().record_due(&mut due, &owner).await? else {
                self.lost();
                return Ok(());
            };
            // A quiet feed is looked at less often, up to QUIET_EVERY.
            wait = match recorded {
                0 => (wait * 2).min(QUIET_EVERY),
                _ => ROUND_EVERY,
            };
            if recorded < MAX_RECORDED {
                // Gathers what comes meanwhile into the next round.
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = self.shutdown.cancelled() => {}
                }
            }
        }
    }

    fn failed(&self, e: &StoreError) {
        tracing::warn!(deployment = %self.store.deployment(), error = %Chain(e), "events not recorded; they wait marked in their documents, tried again");
    }

    fn recovered(&self) {
        tracing::info!(deployment = %self.store.deployment(), "events recorded again");
    }
}

impl Recorder {
    /// Reads the change stream of a feed an older version recorded to its end, as
    /// `owner` (`store::events`, `probe_stream`). Whether it did: not when the lease was
    /// lost or at shutdown.
    async fn read_stream_to_end(
        &self,
        lease: &mut Lease<RecorderLease>,
        owner: &str,
        trim: &mut Trim,
    ) -> StoreResult<bool> {
        let store = &self.store;
        let Some(mut changes) = store.events().open_changes(owner).await? else {
            self.lost();
            return Ok(false);
        };
        let Some(probe) = store.events().probe_stream(owner).await? else {
            self.lost();
            return Ok(false);
        };
        loop {
            if self.shutdown.is_cancelled() {
                return Ok(false);
            }
            if !lease.renew_if_due().await? {
                self.lost();
                return Ok(false);
            }
            trim.if_due(store, owner).await?;
            // Waits up to the stream's await time when nothing happens.
            let reached = store
                .events()
                .record_events(&mut changes, owner, probe)
                .await?;
            if reached {
                break;
            }
        }
        if !store.events().stream_read(owner).await? {
            self.lost();
            return Ok(false);
        }
        tracing::info!(deployment = %store.deployment(), "the change stream an older version recorded from is read to its end; events are recorded from their marks from now on");
        Ok(true)
    }

    fn lost(&self) {
        tracing::info!(deployment = %self.store.deployment(), "recorder lease taken by another instance");
    }
}

/// When the recorder next trims the front of the feed.
struct Trim {
    last: Option<Instant>,
    retention: Duration,
}

impl Trim {
    fn new(retention: Duration) -> Trim {
        Trim {
            last: None,
            retention,
        }
    }

    /// Trims as `owner` if it is time to.
    async fn if_due(&mut self, store: &Store, owner: &str) -> StoreResult<()> {
        if self
            .last
            .is_some_and(|t| t.elapsed() < trim_interval(self.retention))
        {
            return Ok(());
        }
        let removed = store.events().trim_events(owner, self.retention).await?;
        if removed > 0 {
            tracing::debug!(deployment = %store.deployment(), removed, "events past the retention removed");
        }
        // A full round: more are due; the next round comes after this recording one.
        self.last = (removed < MAX_TRIMMED).then(Instant::now);
        Ok(())
    }
}

/// How long the recorder waits after a round that recorded some events and was not
/// full: the events made due meanwhile go into the next round together.
const ROUND_EVERY: Duration = Duration::from_millis(20);
/// How long it waits at most after rounds that found nothing, twice as long after each:
/// an event made in a quiet moment waits that long at most.
const QUIET_EVERY: Duration = Duration::from_millis(100);

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
