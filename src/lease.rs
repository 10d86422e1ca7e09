//! One lease type for the background tasks that run on one instance at a time: each
//! deployment's event recorder (`recorder`) and the webhook dispatcher (`deliverer`).
//!
//! A lease is a document in the database, held by one owner (an instance) until a time
//! by the database's clock, never an instance's own: every instance compares against
//! the same clock. [`Kept`] names the store's writes that take, renew and give up each
//! lease; [`Lease`] is one instance's hold on one of them, and [`Lease::hold`] the loop
//! every such [`Task`] runs.
//!
//! - The holder renews it every [`RENEW_EVERY`], well within [`LEASE`], between steps
//!   of its work ([`Lease::renew_if_due`]); a renewal that finds it taken ends the work.
//! - An instance without it tries to take it every [`CLAIM_INTERVAL`]: a killed holder
//!   is replaced within [`LEASE`] plus that.
//! - A holder stopped by a shutdown gives it up, so another instance goes on at once.
//!
//! Who may act between a read and a write: taking and renewing are one guarded write,
//! matched only if the lease is the owner's or has run out by the database's clock, so
//! two instances never both hold it by that clock. A holder whose renewal came too late
//! (paused, cut off) may still be working while another takes it: what it writes is
//! guarded by its owner too (the recorder's progress, the dispatcher's cursor), and its
//! next renewal finds the lease taken and stops it. Giving up is guarded by the owner:
//! a late give-up after another took the lease matches nothing.

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::store::{Store, StoreError, StoreResult};

/// How long a lease lasts, by the database's clock, from its last renewal.
pub const LEASE: Duration = Duration::from_secs(10);
/// How often the holder renews its lease: well within it.
pub const RENEW_EVERY: Duration = Duration::from_secs(3);
/// How often an instance without the lease tries to take it, and a holder that failed
/// tries again.
pub const CLAIM_INTERVAL: Duration = Duration::from_secs(2);

// At least two renewals are due within a lease: one late renewal does not lose it.
const _: () = assert!(RENEW_EVERY.as_millis() * 3 <= LEASE.as_millis());

/// Where a lease is kept: the store's guarded writes that take, renew and give it up.
pub trait Kept: Send + Sync {
    /// What the write that takes the lease reads with it (the dispatcher's cursor in the
    /// feed; nothing for the recorder).
    type Taken: Send;

    /// Takes or renews the lease for `owner`, for `lease` by the database's clock, if it
    /// is `owner`'s or has run out: what came with it, or `None` if another holds it.
    fn take(
        &self,
        owner: &str,
        lease: Duration,
    ) -> impl Future<Output = StoreResult<Option<Self::Taken>>> + Send;

    /// Gives up `owner`'s lease (nothing if another holds it).
    fn give_up(&self, owner: &str) -> impl Future<Output = StoreResult<()>> + Send;
}

/// A deployment's recorder lease (`Events::claim_recorder`).
pub struct RecorderLease(pub Store);

impl Kept for RecorderLease {
    type Taken = ();

    async fn take(&self, owner: &str, lease: Duration) -> StoreResult<Option<()>> {
        Ok(self
            .0
            .events()
            .claim_recorder(owner, lease)
            .await?
            .then_some(()))
    }

    async fn give_up(&self, owner: &str) -> StoreResult<()> {
        self.0.events().release_recorder(owner).await
    }
}

/// The webhook dispatcher's lease, in the deployment that keeps the webhooks
/// (`Webhooks::claim_dispatcher`); its cursor in the feed comes with it.
pub struct DispatcherLease(pub Store);

impl Kept for DispatcherLease {
    /// The dispatcher's cursor, if it saved one.
    type Taken = Option<String>;

    async fn take(&self, owner: &str, lease: Duration) -> StoreResult<Option<Option<String>>> {
        self.0.webhooks().claim_dispatcher(owner, lease).await
    }

    async fn give_up(&self, owner: &str) -> StoreResult<()> {
        self.0.webhooks().release_dispatcher(owner).await
    }
}

/// One instance's hold on a lease kept by `K`.
pub struct Lease<K> {
    /// Where the lease is kept.
    kept: K,
    /// Who takes it: this instance.
    owner: String,
    /// When this instance last took or renewed it, by its own clock: only to decide when
    /// to renew (when it runs out is decided by the database's clock).
    renewed: Instant,
}

impl<K: Kept> Lease<K> {
    /// `owner`'s hold on the lease kept by `kept`, not taken yet.
    pub fn new(kept: K, owner: impl Into<String>) -> Lease<K> {
        Lease {
            kept,
            owner: owner.into(),
            renewed: Instant::now(),
        }
    }

    /// Who takes it.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// Takes the lease if it is free or this instance's already, for [`LEASE`]: what
    /// came with it, or `None` if another instance holds it.
    pub async fn take(&mut self) -> StoreResult<Option<K::Taken>> {
        let taken = self.kept.take(&self.owner, LEASE).await?;
        if taken.is_some() {
            self.renewed = Instant::now();
        }
        Ok(taken)
    }

    /// Renews the lease now; whether this instance still holds it.
    pub async fn renew(&mut self) -> StoreResult<bool> {
        Ok(self.take().await?.is_some())
    }

    /// Renews the lease if [`RENEW_EVERY`] passed since it was taken or renewed; whether
    /// this instance still holds it (as far as it knows, when no renewal was due).
    pub async fn renew_if_due(&mut self) -> StoreResult<bool> {
        if self.renewed.elapsed() < RENEW_EVERY {
            return Ok(true);
        }
        self.renew().await
    }

    /// Gives the lease up, so that another instance takes it at once.
    pub async fn give_up(&self) -> StoreResult<()> {
        self.kept.give_up(&self.owner).await
    }

    /// Until `shutdown`: takes the lease when it is free and, while this instance holds
    /// it, runs `task`'s work with what came with it; then tries again every
    /// [`CLAIM_INTERVAL`]. The work renews the lease ([`Lease::renew_if_due`]) between
    /// its steps and returns when it is lost, when a call fails, or at shutdown; the
    /// lease is then given up.
    pub async fn hold<T: Task<K>>(&mut self, shutdown: &CancellationToken, task: &mut T) {
        // Said once when the turns start failing, and once when one works again.
        let mut failing = false;
        while !shutdown.is_cancelled() {
            let outcome = match self.take().await {
                Ok(Some(taken)) => {
                    let worked = task.work(self, taken).await;
                    if shutdown.is_cancelled() {
                        // Guarded by the owner: nothing if another took it meanwhile.
                        let given_up = self.give_up().await;
                        worked.and(given_up.map_err(T::Error::from))
                    } else {
                        worked
                    }
                }
                Ok(None) => Ok(()),
                Err(e) => Err(e.into()),
            };
            match outcome {
                Ok(()) if failing => {
                    failing = false;
                    task.recovered();
                }
                Ok(()) => {}
                Err(e) => {
                    if !failing {
                        task.failed(&e);
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
}

/// A task that works while its instance holds a lease kept by `K` ([`Lease::hold`]).
pub trait Task<K: Kept>: Send {
    /// Why a turn failed: a store error at least (taking the lease).
    type Error: From<StoreError> + Send;

    /// Works while this instance holds `lease`, taken with `taken`: renews it between
    /// steps ([`Lease::renew_if_due`]), and returns when it is lost, when a call fails,
    /// or once shutdown is asked for (leaving the lease to be given up).
    fn work(
        &mut self,
        lease: &mut Lease<K>,
        taken: K::Taken,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// The first error of a run of failed turns (the next are not said).
    fn failed(&self, error: &Self::Error);

    /// A turn worked again after failed ones.
    fn recovered(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh database of the test server, migrated (its recorder's document made).
    async fn store() -> Store {
        let store = Store::connect(&support::database_uri(), &support::fresh_database_name())
            .await
            .unwrap();
        store.migrate().await.unwrap();
        store
    }

    /// One instance holds a lease at a time; a renewal says whether it still does; one
    /// given up is taken at once by another, and the first's late give-up or renewal
    /// takes nothing from the new holder.
    #[tokio::test]
    async fn one_instance_holds_a_lease_at_a_time_and_a_given_up_one_is_taken_at_once() {
        let store = store().await;
        let mut a = Lease::new(RecorderLease(store.clone()), "a");
        let mut b = Lease::new(RecorderLease(store.clone()), "b");
        assert!(a.take().await.unwrap().is_some(), "free: taken");
        assert!(b.take().await.unwrap().is_none(), "held by a");
        assert!(a.renew().await.unwrap(), "a renews its own");
        assert!(b.take().await.unwrap().is_none(), "still a's");
        a.give_up().await.unwrap();
        assert!(
            b.take().await.unwrap().is_some(),
            "given up: b takes it at once"
        );
        assert!(!a.renew().await.unwrap(), "a's renewal finds it b's");
        a.give_up().await.unwrap();
        assert!(
            b.renew().await.unwrap(),
            "a late give-up takes nothing from b"
        );
        assert!(a.take().await.unwrap().is_none());
    }

    /// A holder that stops renewing loses the lease once it runs out by the database's
    /// clock, and another takes it then.
    #[tokio::test]
    async fn a_lease_that_ran_out_is_taken_by_another() {
        let store = store().await;
        let kept = RecorderLease(store.clone());
        assert!(
            kept.take("a", Duration::from_millis(1))
                .await
                .unwrap()
                .is_some()
        );
        let mut b = Lease::new(RecorderLease(store), "b");
        let mut taken = false;
        for _ in 0..1000 {
            if b.take().await.unwrap().is_some() {
                taken = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(taken, "a lease of 1 ms is still held after 10 s");
        assert!(kept.take("a", LEASE).await.unwrap().is_none(), "now b's");
    }

    /// The dispatcher's lease brings its cursor: the one its last holder saved, which
    /// only the holder may save.
    #[tokio::test]
    async fn the_dispatchers_lease_brings_the_cursor_its_last_holder_saved() {
        let store = store().await;
        let mut a = Lease::new(DispatcherLease(store.clone()), "a");
        let mut b = Lease::new(DispatcherLease(store.clone()), "b");
        assert_eq!(a.take().await.unwrap(), Some(None), "no cursor yet");
        assert!(
            store
                .webhooks()
                .save_dispatcher_cursor("a", "c1")
                .await
                .unwrap()
        );
        assert_eq!(b.take().await.unwrap(), None);
        assert!(
            !store
                .webhooks()
                .save_dispatcher_cursor("b", "c2")
                .await
                .unwrap()
        );
        a.give_up().await.unwrap();
        assert_eq!(b.take().await.unwrap(), Some(Some("c1".to_owned())));
        assert!(
            !store
                .webhooks()
                .save_dispatcher_cursor("a", "c3")
                .await
                .unwrap()
        );
    }

    /// A task that works once, then asks for shutdown, as a stopped instance does.
    struct StopsAfterOne {
        shutdown: CancellationToken,
        turns: usize,
    }

    impl Task<RecorderLease> for StopsAfterOne {
        type Error = StoreError;

        async fn work(&mut self, lease: &mut Lease<RecorderLease>, (): ()) -> StoreResult<()> {
            self.turns += 1;
            assert!(lease.renew_if_due().await?, "held while working");
            self.shutdown.cancel();
            Ok(())
        }

        fn failed(&self, e: &StoreError) {
            panic!("no turn fails here: {e}");
        }
    }

    /// [`Lease::hold`] works while the lease is held and gives it up at shutdown, so
    /// that another instance takes it at once rather than when it runs out.
    #[tokio::test]
    async fn a_holder_stopped_by_shutdown_gives_the_lease_up() {
        let store = store().await;
        let shutdown = CancellationToken::new();
        let mut task = StopsAfterOne {
            shutdown: shutdown.clone(),
            turns: 0,
        };
        let mut a = Lease::new(RecorderLease(store.clone()), "a");
        a.hold(&shutdown, &mut task).await;
        assert_eq!(task.turns, 1);
        let mut b = Lease::new(RecorderLease(store), "b");
        assert!(b.take().await.unwrap().is_some(), "given up at shutdown");
    }
}
