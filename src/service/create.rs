//! A new transfer: inserted (step 1, once its accounts are placed and its idempotency key
//! taken), then run by the two-phase commit in a task of its own, or made in one native
//! transaction where the strategy says so and one deployment keeps both accounts.

use std::time::Duration;

use super::driving::Driving;
use super::idempotency::{REPLAY_WAIT, Taken, read_majority};
use super::placement::Route;
use super::protocol::Origin;
use super::{AdmissionPermit, Requests, ServiceResult};
use crate::domain::{
    AccountId, Amount, Hold, Legs, Reference, Scope, ScopedKey, Strategy, Transfer, TransferState,
};
use crate::error_chain::Chain;
use crate::store::native::AtomicOutcome;
use crate::store::{Store, StoreError, StoreResult};

/// A transfer to make.
#[derive(Debug, Clone)]
pub struct NewTransfer {
    pub source: AccountId,
    pub destination: AccountId,
    pub amount: Amount,
    /// A multi-leg transfer's legs (`docs/legs.md`): then `source` and `destination` are
    /// its first leg's and `amount` the money its legs move ([`NewTransfer::with_legs`]).
    pub legs: Option<Legs>,
    pub reference: Option<Reference>,
    /// A hold instead of a transfer: reserve `amount` now, until this long from now,
    /// for a capture or a void (`docs/holds.md`).
    pub hold: Option<Duration>,
    /// What the caller sees (`docs/tenants.md`): an account outside it is refused as an
    /// unknown one.
    pub scope: Scope,
}

impl NewTransfer {
    /// A multi-leg transfer of `legs`.
    pub fn with_legs(legs: Legs, reference: Option<Reference>) -> NewTransfer {
        let first = &legs.legs()[0];
        NewTransfer {
            source: first.source.clone(),
            destination: first.destination.clone(),
            amount: legs.moved(),
            legs: Some(legs),
            reference,
            hold: None,
            scope: Scope::Platform,
        }
    }
}

/// Whether the caller waits for the protocol to finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// Run the protocol to a terminal state before answering.
    Wait,
    /// Insert the transfer, answer at once, and run the protocol in the background
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

/// The end of a protocol run started with [`Requests::spawn_run`].
async fn joined(run: tokio::task::JoinHandle<StoreResult<Transfer>>) -> ServiceResult<Transfer> {
    match run.await {
        Ok(result) => Ok(result?),
        Err(ended) => super::error::panicked(ended),
    }
}

/// What inserting a new transfer came to.
enum Inserted {
    /// The transfer for this request to drive, from a copy of `Origin`: as this request
    /// inserted it, or as stored by an earlier attempt of this request or by another
    /// request with its key, which nobody drives.
    Run(Transfer, Origin),
    /// The transfer as stored, driven by another request with its key or a sweeper (or
    /// at its end): the answer, once it comes to rest.
    Driven(Transfer),
    /// This request's transfer, whose key is on an older transfer (made by a version
    /// before `idempotencyKeys`): the answer is that one.
    KeyedBefore(Transfer),
}

/// A hold of `amount` that expires `expires_in` from now, by the clock of `log`: the
/// deployment that logs the hold, which judges its expiry.
async fn hold_expiring(log: &Store, amount: Amount, expires_in: Duration) -> StoreResult<Hold> {
    let now = log.server_time_lower_bound().await?;
    let expires_at = chrono::TimeDelta::from_std(expires_in)
        .ok()
        .and_then(|d| now.checked_add_signed(d))
        .unwrap_or_else(|| panic!("bug: a hold of {expires_in:?} passed validation"));
    Ok(Hold { amount, expires_at })
}

impl Requests {
    /// Inserts a transfer and runs the two-phase commit.
    ///
    /// With an idempotency key, a request that repeats an earlier one answers with the
    /// earlier transfer (waiting briefly for it to finish) and moves no money; the same
    /// key with a different request is refused. Concurrent requests with one key make
    /// one transfer: the key is taken first, in `idempotencyKeys` on the deployment that
    /// logs the transfer, whose unique `_id` lets exactly one request take it (see
    /// `Requests::take_key`).
    ///
    /// A key is unique within its scope (the API key that sent it, see
    /// [`KeyScope`](crate::domain::KeyScope)), among the transfers logged on one
    /// deployment, that is among the transfers out of its accounts: the same key from
    /// another API key, or with a source account on another deployment, is another
    /// request (see `docs/scaling.md`).
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

    /// [`Requests::transfer`] once admitted, holding `permit`.
    async fn transfer_admitted(
        &self,
        permit: AdmissionPermit,
        new: NewTransfer,
        key: Option<ScopedKey>,
        completion: Completion,
    ) -> ServiceResult<TransferOutcome> {
        let fingerprint = new.fingerprint();
        let (route, legs) = self.route(&new).await?;
        let log = self.driver.deployments.of(&route.source)?;
        let id = match &key {
            None => crate::store::new_transfer_id(),
            Some(key) => match self.take_key(log, key, &fingerprint).await? {
                Taken::New(id) | Taken::NotInserted(id) => id,
                Taken::Replay(existing) => return self.replay(*existing, &fingerprint).await,
            },
        };
        // The destination's deployment must answer too (every party's, for legs):
        // refused at once, before the transfer is inserted, while it is known not to
        // (the transfer would only wait for it). A key taken meanwhile is completed by
        // the request's retry.
        self.driver.deployments.of(&route.destination)?;
        for party in legs.iter().flat_map(|l| l.parties()) {
            self.driver.deployments.of(&party.deployment)?;
        }
        let hold = match new.hold {
            Some(expires_in) => Some(hold_expiring(log, new.amount, expires_in).await?),
            None => None,
        };
        let transfer = Transfer {
            hold,
            legs,
            reference: new.reference,
            request_hash: key.as_ref().map(|_| fingerprint.clone()),
            idempotency_key: key.clone(),
            source_deployment: route.source.clone(),
            destination_deployment: route.destination.clone(),
            tenants: route.tenants.clone(),
            ..Transfer::initial(id, new.source, new.destination, new.amount, route.currency)
        };
        // A hold outlives any multi-document transaction, and no transaction spans two
        // deployments: those are always two-phase, and so are multi-leg transfers (their
        // protocol is the point of them, `docs/legs.md`).
        if self.strategy == Strategy::Native
            && transfer.hold.is_none()
            && transfer.legs.is_none()
            && route.source == route.destination
        {
            return self.transfer_natively(log, transfer, &fingerprint).await;
        }
        self.insert_and_run(log, transfer, &fingerprint, permit, completion)
            .await
    }

    /// Step 1, then the run: inserts `transfer` `pending`, owned by this instance, and
    /// runs it (to its end, or in the background, as `completion` says); or, where a
    /// transfer already has its id or its key, answers with what is there.
    async fn insert_and_run(
        &self,
        log: &Store,
        transfer: Transfer,
        fingerprint: &str,
        permit: AdmissionPermit,
        completion: Completion,
    ) -> ServiceResult<TransferOutcome> {
        let keyed = transfer.idempotency_key.is_some();
        // Taken before the insert, so that no other task of this process drives the
        // transfer before this request's run does (see `protocol::Origin::Inserted`).
        // Where the transfer is not this request's to drive, the lock goes before any
        // wait: the task that drives it may be one of this process.
        let driving = self.driver.lock_drive(transfer.id).await;
        let inserted = self
            .insert(log, transfer.started_by(self.driver.owner()))
            .await;
        let (transfer, origin) = match inserted {
            Ok(Inserted::Run(transfer, origin)) => (transfer, origin),
            Ok(Inserted::Driven(stored)) => {
                self.driver.let_go(driving).await;
                let transfer = self.driver.wait_until_at_rest(stored, REPLAY_WAIT).await?;
                return Ok(TransferOutcome {
                    transfer,
                    replayed: keyed,
                });
            }
            Ok(Inserted::KeyedBefore(mine)) => {
                self.driver.let_go(driving).await;
                return self.replay_by_key(&mine, fingerprint).await;
            }
            Err(e) => {
                self.driver.let_go(driving).await;
                return Err(e);
            }
        };
        tracing::info!(transfer_id = %transfer.id, source = %transfer.source, destination = %transfer.destination, value = transfer.amount.minor_units(), "transfer inserted");
        failpoint!(self, AfterInsert);
        let run = self.spawn_run(transfer.clone(), permit, driving, origin);
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

    /// Where `new` goes, checked against its stored accounts; and for a multi-leg
    /// transfer, its legs with every party placed.
    async fn route(&self, new: &NewTransfer) -> ServiceResult<(Route, Option<Box<Legs>>)> {
        let (route, legs) = self.book.check_accounts(new).await?;
        Ok((route, legs.map(Box::new)))
    }

    /// Step 1: inserts `transfer`, for this request to drive; or, where a transfer
    /// already has its id or its key, says what is there.
    async fn insert(&self, log: &Store, mut transfer: Transfer) -> ServiceResult<Inserted> {
        match log.transfers().insert_transfer(&transfer).await {
            Ok(stamp) => {
                transfer.last_modified = stamp;
                Ok(Inserted::Run(transfer, Origin::Inserted))
            }
            Err(StoreError::DuplicateKey(_)) => self.inserted_already(log, transfer).await,
            Err(e) => Err(e.into()),
        }
    }

    /// The insert of `transfer` met a duplicate key: what is stored under its id, or
    /// under its idempotency key.
    async fn inserted_already(&self, log: &Store, transfer: Transfer) -> ServiceResult<Inserted> {
        match read_majority(|| log.transfers().transfer(transfer.id)).await? {
            // This request's own transfer: its id is new, or the one its key
            // names. Its insert landed on an attempt whose answer was lost and
            // the retry was refused for it (a server that does not recognise a
            // driver's retry), or another request with its key inserted it.
            // Nobody drives it yet: this request does.
            Some(stored) if stored.state == TransferState::Initial && stored.owner.is_none() => {
                Ok(Inserted::Run(stored, Origin::Read))
            }
            // Inserted by this process (`pending`, owned by it), and this request holds
            // the transfer's drive lock: no task of it drives the transfer any more.
            Some(stored)
                if stored.state == TransferState::Pending
                    && stored.owner.as_deref() == Some(self.driver.owner()) =>
            {
                Ok(Inserted::Run(stored, Origin::Read))
            }
            // Already driven (by the other request with its key, or a sweeper).
            Some(stored) => Ok(Inserted::Driven(stored)),
            None if transfer.idempotency_key.is_some() => Ok(Inserted::KeyedBefore(transfer)),
            None => {
                // Its `_id` is new: the copy the insert met is its own earlier one, which
                // no majority read finds yet (the database has not made it durable, or a
                // failover rolled it back).
                let said = format!("transfer {}: a duplicate key, but no transfer", transfer.id);
                Err(StoreError::Unavailable(said.into()).into())
            }
        }
    }

    /// The native strategy: one transaction inserts the transfer `done` and moves the
    /// money; if an account refuses, the transfer is inserted `canceled` with the reason
    /// instead, so that the answer and the log are those of the two-phase path.
    async fn transfer_natively(
        &self,
        log: &Store,
        transfer: Transfer,
        fingerprint: &str,
    ) -> ServiceResult<TransferOutcome> {
        let outcome = match log
            .atomic()
            .transfer_atomically(&transfer, self.driver.owner())
            .await
        {
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
                    owner: Some(self.driver.owner().to_owned()),
                    ..transfer
                };
                match log.transfers().insert_transfer(&canceled).await {
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

    /// Runs `transfer` (a copy of `origin`) to its end in a task of its own that holds
    /// `permit` and `driving`, its drive lock: the run goes on even if the caller stops
    /// waiting (a client that hangs up, a request time-out), so admitted work always
    /// finishes or is left, every step durable, for the sweeper.
    fn spawn_run(
        &self,
        transfer: Transfer,
        permit: AdmissionPermit,
        driving: Driving,
        origin: Origin,
    ) -> tokio::task::JoinHandle<StoreResult<Transfer>> {
        let driver = self.driver.clone();
        let work = async move {
            let _permit = permit;
            let id = transfer.id;
            let ended = driver.run_holding(driving, transfer, origin).await;
            if let Err(e) = &ended {
                tracing::warn!(transfer_id = %id, error = %Chain(e), "transfer interrupted; the sweeper will finish it");
            }
            ended
        };
        // In the request's span, so its log lines carry the request id too.
        self.driver
            .background
            .spawn(tracing::Instrument::instrument(
                work,
                tracing::Span::current(),
            ))
    }
}
