//! The service layer: what the HTTP handlers (and the recovery sweeper) ask for, in
//! domain terms. It validates against the stored accounts, records transfers, runs the
//! two-phase commit ([`protocol`]) and answers with the domain's [`Transfer`] and
//! [`Account`], as stored.
//!
//! - [`Bank::open_account`], [`Bank::account`], [`Bank::accounts`]: the account book.
//! - [`Bank::transfer`]: record a transfer and run it (or start it in the background),
//!   with idempotency keys: a replay returns the existing transfer, never a second one.
//! - [`Bank::cancel`]: roll back a transfer that has not been applied, or reverse one
//!   that has with a compensating transfer.
//!
//! Each of them (and the sweeper's recoveries) is admitted first (`admission.rs`: at most
//! `MAX_TRANSFERS_IN_FLIGHT` at once; beyond, a request waits its turn up to
//! `ADMISSION_WAIT_MS`, then is refused), before anything is recorded.

mod accounts;
mod admission;
mod cancel;
mod driving;
mod error;
mod holds;
mod idempotency;
mod placement;
pub mod protocol;
mod readiness;
mod reads;
mod routing;
mod unanswered;

pub use accounts::NewAccount;
pub(crate) use admission::Admitted;
pub use admission::{DEFAULT_ADMISSION_WAIT, DEFAULT_MAX_IN_FLIGHT};
pub use error::{ServiceError, ServiceResult};
pub use holds::HoldConflict;
use idempotency::{REPLAY_WAIT, Taken, read_majority};
use placement::Placed;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::task::TaskTracker;

use crate::domain::{
    AccountId, Amount, Hold, Reference, ScopedKey, Strategy, Transfer, TransferId, TransferState,
};
use crate::error_chain::Chain;
use crate::store::native::AtomicOutcome;
use crate::store::{Deployments, Store, StoreError, StoreResult};

/// The end of a protocol run started with [`Bank::spawn_run`].
async fn joined(run: tokio::task::JoinHandle<StoreResult<Transfer>>) -> ServiceResult<Transfer> {
    match run.await {
        Ok(result) => Ok(result?),
        // Only a panic gets here (runs are never aborted): a bug, said as one.
        Err(e) => Err(StoreError::Other(format!("protocol run failed: {e}").into()).into()),
    }
}

/// A transfer to make.
#[derive(Debug, Clone)]
pub struct NewTransfer {
    pub source: AccountId,
    pub destination: AccountId,
    pub amount: Amount,
    pub reference: Option<Reference>,
    /// A hold instead of a transfer: reserve `amount` now, until this long from now,
    /// for a capture or a void (`docs/holds.md`).
    pub hold: Option<Duration>,
}

/// Whether the caller waits for the protocol to finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// Run the protocol to a terminal state before answering.
    Wait,
    /// Record the transfer, answer at once, and run the protocol in the background
    /// (`Prefer: respond-async`).
    Background,
}

/// The answer to a transfer request: the transfer as it stands, and whether it was made
/// by an earlier request with the same idempotency key.
#[derive(Debug, Clone)]
pub struct TransferOutcome {
    pub transfer: Transfer,
    pub replayed: bool,
}

/// The bank: accounts, transfers, and the protocol that moves money between them.
#[derive(Clone)]
pub struct Bank {
    /// Every deployment the accounts live on (`DEPLOYMENTS`); see `store::deployments`
    /// for what lives where.
    deployments: Deployments,
    /// `INSTANCE_ID`: names this instance in logs and in its pause points (tests).
    instance_id: Arc<str>,
    /// Written to `application` on the transfers this process owns: the instance id plus
    /// a random incarnation, so that two processes never share a lease, not even a
    /// restart under the same `INSTANCE_ID` while writes of the dead process may still
    /// be on their way to the server (it waits for their lease like any other instance).
    owner: Arc<str>,
    /// Every protocol run and cancel (each in a task of its own, see
    /// [`Bank::spawn_run`]); shutdown waits for them.
    background: TaskTracker,
    /// Transfers this process is driving right now. Two drivers under one owner
    /// would share a lease, and a second driver's debit after the first one's pull would
    /// apply the transfer twice; so within a process one task at a time drives a transfer.
    driving:
        Arc<std::sync::Mutex<std::collections::HashMap<TransferId, Arc<tokio::sync::Mutex<()>>>>>,
    /// The writes of this process whose reply was lost and that may still land: every
    /// later run of their transfer respects them (see [`unanswered`]); the drive lock
    /// alone would let a second run pull the markers under a late step of the first.
    unanswered: Arc<unanswered::Unanswered>,
    /// The lease an instance holds on a transfer it works on, renewed by every state
    /// change; once it lapses (STALE_AFTER_MS) another instance may take over.
    stale_after: Duration,
    /// Two-phase commit or native transactions for new transfers.
    strategy: Strategy,
    /// How long a hold lasts when its request does not say (`HOLD_EXPIRES_MS`).
    default_hold_expiry: Duration,
    /// Admission control (see [`admission`]): one permit per transfer this process
    /// works on (a new one, a cancel, a recovery), held until its run ends. A request
    /// that finds none waits for one, at most `ADMISSION_WAIT_MS`, then is refused
    /// ([`ServiceError::Overloaded`]), having recorded nothing. This bounds every queue
    /// behind it, so that a burst cannot push steps past their deadlines.
    admission: admission::Admission,
    /// The deployment and currency of every account this process has seen, by id.
    /// Neither ever changes and no account is ever deleted through the service, so a
    /// transfer between known accounts is validated and routed without a read. Should an
    /// account vanish behind the service's back, the debit or credit finds it gone and
    /// the transfer rolls back with `account_not_found`: the cache can make an answer less
    /// precise, never move money wrongly.
    known: Arc<std::sync::Mutex<std::collections::HashMap<AccountId, Placed>>>,
}

/// How long a hold lasts unless its request or `HOLD_EXPIRES_MS` says otherwise: 7 days.
pub const DEFAULT_HOLD_EXPIRY: Duration = Duration::from_secs(7 * 24 * 3600);

impl Bank {
    /// A bank over one deployment (a [`Store`]) or several ([`Deployments`]).
    pub fn new(
        deployments: impl Into<Deployments>,
        instance_id: impl Into<Arc<str>>,
        stale_after: Duration,
    ) -> Bank {
        let instance_id: Arc<str> = instance_id.into();
        let incarnation = format!("{:08x}", rand::random::<u32>());
        Bank {
            deployments: deployments.into().named(&instance_id),
            owner: format!("{instance_id}/{incarnation}").into(),
            instance_id,
            background: TaskTracker::new(),
            driving: Arc::default(),
            unanswered: Arc::new(unanswered::Unanswered::new(stale_after)),
            stale_after,
            strategy: Strategy::TwoPhase,
            default_hold_expiry: DEFAULT_HOLD_EXPIRY,
            admission: admission::Admission::new(DEFAULT_MAX_IN_FLIGHT, DEFAULT_ADMISSION_WAIT),
            known: Arc::default(),
        }
    }

    /// Fault injection: another task of this same process, as the interleaving explorer
    /// (`tests/explorer.rs`) runs two actors of one process. It shares everything the
    /// process shares between its tasks (the owner written to `application`, the drive
    /// locks, the record of unanswered writes, admission, the account cache, the
    /// background tasks), but names its points, and its store handles' points, with
    /// `instance_id`, so that a scheduler, a pause or a held-back step can tell it from
    /// its siblings.
    #[cfg(feature = "failpoints")]
    pub fn sibling(&self, instance_id: &str) -> Bank {
        Bank {
            deployments: self.deployments.named(instance_id),
            instance_id: instance_id.into(),
            ..self.clone()
        }
    }

    pub fn with_strategy(self, strategy: Strategy) -> Bank {
        Bank { strategy, ..self }
    }

    /// Holds whose request does not say last this long (`HOLD_EXPIRES_MS`).
    pub fn with_default_hold_expiry(self, default_hold_expiry: Duration) -> Bank {
        Bank {
            default_hold_expiry,
            ..self
        }
    }

    pub fn default_hold_expiry(&self) -> Duration {
        self.default_hold_expiry
    }

    /// At most `limit` transfers in flight in this process (`MAX_TRANSFERS_IN_FLIGHT`).
    pub fn with_max_in_flight(self, limit: usize) -> Bank {
        Bank {
            admission: self.admission.clone().limited(limit),
            ..self
        }
    }

    /// A request beyond the limit waits this long for a permit before it is refused
    /// (`ADMISSION_WAIT_MS`); zero refuses it at once.
    pub fn with_admission_wait(self, wait: Duration) -> Bank {
        Bank {
            admission: self.admission.clone().waiting(wait),
            ..self
        }
    }

    /// Requests wait for a permit only while one of the connection places `places`
    /// (one per connection served, `MAX_CONNECTIONS` in all) is free: see [`admission`].
    pub fn with_connection_places(self, places: Arc<tokio::sync::Semaphore>) -> Bank {
        let room = admission::Room { places };
        Bank {
            admission: self.admission.clone().within(room),
            ..self
        }
    }

    /// Runs `transfer` to its end in a task of its own that holds `permit`: the run goes
    /// on even if the caller stops waiting (a client that hangs up, a request time-out),
    /// so admitted work always finishes or is left, every step durable, for the sweeper.
    fn spawn_run(
        &self,
        transfer: Transfer,
        permit: Admitted,
    ) -> tokio::task::JoinHandle<StoreResult<Transfer>> {
        let bank = self.clone();
        let work = async move {
            let _permit = permit;
            let id = transfer.id;
            let ended = bank.run(transfer).await;
            if let Err(e) = &ended {
                tracing::warn!(transfer_id = %id, error = %Chain(e), "transfer interrupted; the sweeper will finish it");
            }
            ended
        };
        // In the request's span, so its log lines carry the request id too.
        self.background.spawn(tracing::Instrument::instrument(
            work,
            tracing::Span::current(),
        ))
    }

    pub fn stale_after(&self) -> Duration {
        self.stale_after
    }

    /// The first deployment's store (the only one, unless `DEPLOYMENTS` lists several).
    pub fn store(&self) -> &Store {
        self.deployments.first()
    }

    pub fn deployments(&self) -> &Deployments {
        &self.deployments
    }

    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// What this process writes to `application`: see [`Bank::owner`]'s field.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The protocol runs and cancels in flight, so that shutdown can wait for them.
    pub fn background_tasks(&self) -> &TaskTracker {
        &self.background
    }

    /// Records a transfer and runs the two-phase commit.
    ///
    /// With an idempotency key, a request that repeats an earlier one answers with the
    /// earlier transfer (waiting briefly for it to finish) and moves no money; the same
    /// key with a different request is refused. Concurrent requests with one key make
    /// one transfer: the key is taken first, in `idempotencyKeys` on the deployment that
    /// logs the transfer, whose unique `_id` lets exactly one request take it (see
    /// `Bank::take_key`).
    ///
    /// A key is unique within its scope (the API key that sent it, see [`KeyScope`]),
    /// among the transfers logged on one deployment, that is among the transfers out of
    /// its accounts: the same key from another API key, or with a source account on
    /// another deployment, is another request (see `docs/scaling.md`).
    pub async fn transfer(
        &self,
        new: NewTransfer,
        key: Option<ScopedKey>,
        completion: Completion,
    ) -> ServiceResult<TransferOutcome> {
        let permit = self.admit().await?;
        // Boxed, so that a request waiting for its permit holds only this small future,
        // not the state of everything that follows (kilobytes, times every connection).
        Box::pin(self.transfer_admitted(permit, new, key, completion)).await
    }

    /// [`Bank::transfer`] once admitted, holding `permit`.
    async fn transfer_admitted(
        &self,
        permit: Admitted,
        new: NewTransfer,
        key: Option<ScopedKey>,
        completion: Completion,
    ) -> ServiceResult<TransferOutcome> {
        let fingerprint = new.fingerprint();
        let route = self.check_accounts(&new).await?;
        let log = self.deployments.of(&route.source)?;
        let id = match &key {
            None => crate::store::new_transfer_id(),
            Some(key) => match self.take_key(log, key, &fingerprint).await? {
                Taken::New(id) | Taken::Unrecorded(id) => id,
                Taken::Replay(existing) => return self.replay(*existing, &fingerprint).await,
            },
        };
        // The destination's deployment must answer too: refused at once, before the
        // transfer is recorded, while it is known not to (the transfer would only wait
        // for it). A key taken meanwhile is completed by the request's retry.
        self.deployments.of(&route.destination)?;
        let hold = match new.hold {
            // Expiry by the clock of the deployment that logs the hold, which judges it.
            Some(expires_in) => {
                let now = log.server_time_lower_bound().await?;
                let expires_at = chrono::TimeDelta::from_std(expires_in)
                    .ok()
                    .and_then(|d| now.checked_add_signed(d))
                    .unwrap_or_else(|| panic!("bug: a hold of {expires_in:?} passed validation"));
                Some(Hold {
                    amount: new.amount,
                    expires_at,
                })
            }
            None => None,
        };
        let transfer = Transfer {
            hold,
            reference: new.reference,
            request_hash: key.as_ref().map(|_| fingerprint.clone()),
            idempotency_key: key.clone(),
            source_deployment: route.source.clone(),
            destination_deployment: route.destination.clone(),
            ..Transfer::initial(id, new.source, new.destination, new.amount, route.currency)
        };
        // A hold outlives any multi-document transaction, and no transaction spans two
        // deployments: those are always two-phase.
        if self.strategy == Strategy::Native
            && transfer.hold.is_none()
            && route.source == route.destination
        {
            return self.transfer_natively(log, transfer, &fingerprint).await;
        }
        let mut transfer = transfer;
        match log.insert_transfer(&transfer).await {
            Ok(stamp) => transfer.last_modified = stamp,
            Err(StoreError::DuplicateKey(_)) => {
                match read_majority(|| log.transfer(transfer.id)).await? {
                    // This request's own transfer: its id is new, or the one its key
                    // names. Its insert landed on an attempt whose answer was lost and
                    // the retry was refused for it (a server that does not recognise a
                    // driver's retry), or another request with its key recorded it.
                    // Nobody drives it yet: this request does.
                    Some(stored)
                        if stored.state == TransferState::Initial && stored.owner.is_none() =>
                    {
                        transfer = stored;
                    }
                    // Already driven (by the other request with its key, or a sweeper).
                    Some(stored) => {
                        let transfer = self.wait_until_settled(stored, REPLAY_WAIT).await?;
                        return Ok(TransferOutcome {
                            transfer,
                            replayed: key.is_some(),
                        });
                    }
                    // The key is on an older transfer (a version before idempotencyKeys).
                    None if key.is_some() => {
                        return self.replay_by_key(&transfer, &fingerprint).await;
                    }
                    None => {
                        let said =
                            format!("transfer {}: a duplicate key, but no transfer", transfer.id);
                        return Err(StoreError::Other(said.into()).into());
                    }
                }
            }
            Err(e) => return Err(e.into()),
        }
        tracing::info!(transfer_id = %transfer.id, source = %transfer.source, destination = %transfer.destination, value = transfer.amount.minor_units(), "transfer recorded");
        failpoint!(self, "after_insert");
        let run = self.spawn_run(transfer.clone(), permit);
        let transfer = match completion {
            Completion::Wait => joined(run).await?,
            // The run goes on by itself; its end is logged there.
            Completion::Background => transfer,
        };
        Ok(TransferOutcome {
            transfer,
            replayed: false,
        })
    }

    /// The native strategy: one transaction records the transfer `done` and moves the
    /// money; if an account refuses, the transfer is recorded `canceled` with the reason
    /// instead, so that the answer and the log are those of the two-phase path.
    async fn transfer_natively(
        &self,
        log: &Store,
        transfer: Transfer,
        fingerprint: &str,
    ) -> ServiceResult<TransferOutcome> {
        let outcome = match log.transfer_atomically(&transfer, self.owner()).await {
            Ok(outcome) => outcome,
            Err(StoreError::DuplicateKey(_)) if transfer.idempotency_key.is_some() => {
                return self.replay_by_key(&transfer, fingerprint).await;
            }
            Err(e) => return Err(e.into()),
        };
        let transfer = match outcome {
            AtomicOutcome::Done(done) => *done,
            AtomicOutcome::Refused(reason) => {
                let canceled = Transfer {
                    state: TransferState::Canceled,
                    reason: Some(reason),
                    owner: Some(self.owner().to_owned()),
                    ..transfer
                };
                match log.insert_transfer(&canceled).await {
                    Ok(stamp) => Transfer {
                        last_modified: stamp,
                        ..canceled
                    },
                    Err(StoreError::DuplicateKey(_)) if canceled.idempotency_key.is_some() => {
                        return self.replay_by_key(&canceled, fingerprint).await;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        };
        tracing::info!(transfer_id = %transfer.id, to = %transfer.state, reason = ?transfer.reason, "transfer made in one transaction");
        crate::metrics::transfer_finished(transfer.state, transfer.reason);
        Ok(TransferOutcome {
            transfer,
            replayed: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bank whose store points at a port nothing listens on: the client connects
    /// lazily, so nothing here reaches a server.
    pub(super) async fn offline_bank(stale_after: Duration) -> Bank {
        let store = Store::connect("mongodb://127.0.0.1:9/", "unused")
            .await
            .unwrap();
        Bank::new(store, "unit", stale_after)
    }

    /// A sibling (the explorer's second actor of one process) names its points, and its
    /// store handles' points, after itself, so that a pause or a scheduler can tell its
    /// writes from its parent's; and it shares its parent's owner.
    #[cfg(feature = "failpoints")]
    #[tokio::test]
    async fn a_sibling_names_its_points_and_its_stores_points_after_itself() {
        let bank = offline_bank(Duration::from_secs(1)).await;
        let sibling = bank.sibling("unit-2");
        assert_eq!(sibling.instance_id(), "unit-2");
        let names: Vec<_> = sibling
            .deployments()
            .all()
            .iter()
            .map(|s| s.instance_id())
            .collect();
        assert_eq!(names, ["unit-2"]);
        assert_eq!(sibling.owner(), bank.owner());
    }

    /// A step carried over to another deployment's clock takes off a tenth of the lease
    /// for a jump of either clock between two readings (`Store::deadline_on`, whose own
    /// test steps a clock back within the allowance): with none, a clock stepped back
    /// would let a step land after its lease. The allowance is what the protocol and a
    /// cancel's fences pass.
    #[tokio::test]
    async fn the_allowance_for_a_clock_jump_is_a_tenth_of_the_lease() {
        let bank = offline_bank(Duration::from_secs(2)).await;
        assert_eq!(bank.clock_allowance(), Duration::from_millis(200));
    }
}
