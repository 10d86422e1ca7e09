//! The alternative to the two-phase commit (`TRANSFER_STRATEGY=native`): one transfer as
//! one MongoDB multi-document transaction, what a user would otherwise pick. It writes the
//! same documents the two-phase path ends with (a `done` transfer, the two balances), so
//! the API answers the same, and it serves as the benchmark's comparison.
//!
//! The transaction runs through the driver's convenient transaction API
//! (`start_transaction().and_run2(..)`), as a user would write it: the driver runs the
//! whole callback again on an error labelled `TransientTransactionError` (a write conflict
//! on a hot account, say), with its own jittered exponential backoff between runs, and
//! retries only the commit on `UnknownTransactionCommitResult`. The one thing added here
//! is a shorter time limit than the driver's own 120 s (see [`TRANSACTION_TIME_LIMIT`]).
//!
//! Invariants: nothing is ever half-applied (until the commit, nothing is visible); a
//! refused transfer writes nothing; giving up writes nothing.
//!
//! It is the [`Atomic`] view (`store.atomic()`): it writes `transactions` and `accounts`,
//! the one view over two collections' documents in one write, since the transaction is the
//! operation.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mongodb::bson::oid::ObjectId;
use mongodb::bson::{Document, doc};
use mongodb::error::{ErrorKind, WriteFailure};
use mongodb::options::ReadConcern;
use mongodb::{ClientSession, Collection, Database};

use super::batch::Batches;
use super::clock::Clock;
use super::documents::{AccountDoc, Stored};
use super::entries::{EntryCopier, Marker, changed_with_entry};
use super::fields::{account, path};
use super::guards::{Amounts, due};
use super::{StoreError, StoreResult, TransferDoc, majority_journaled};
use crate::domain::{
    AccountId, CancelReason, DeploymentName, EntryKind, MAX_MONEY, Transfer, TransferState,
};

/// How long a transfer may keep starting new runs of its transaction before it gives up
/// (the caller answers 503, `contended` if the last run lost to a write conflict; nothing
/// moved). The driver's own limit is 120 s, four times the service's request timeout
/// (`startup::REQUEST_TIMEOUT`, 30 s): left alone, a transfer on a hot account would be
/// cut by that timeout at an arbitrary point, perhaps inside its commit. A `tokio::time::timeout` around the run would have the same flaw,
/// so the limit is checked where the callback starts, before any write of that run:
/// giving up never leaves a commit in doubt. It leaves 20 s of the request for the last
/// run and its commit (a commit whose result is unknown the driver sends again; that,
/// like every request, ends at the request timeout at the latest).
const TRANSACTION_TIME_LIMIT: Duration = Duration::from_secs(10);

/// How an atomic transfer ended.
#[derive(Debug)]
pub enum AtomicOutcome {
    /// Committed: the transfer as stored, `done`.
    Done(Box<Transfer>),
    /// Nothing was written: the accounts refused it for this reason.
    Refused(CancelReason),
}

/// The callback's own error: the time limit passed before a new run of the transaction
/// started. Not labelled transient, so the driver aborts and hands it back at once.
#[derive(Debug)]
struct TimeLimitReached;

/// The native strategy's one write (from [`super::Store::atomic`]): a transfer inserted into
/// `transactions` and its money moved on `accounts`, in one transaction. It writes both
/// collections because the transaction is the whole operation.
#[derive(Clone, Copy, Debug)]
pub struct Atomic<'s> {
    pub(super) db: &'s Database,
    pub(super) transactions: &'s Collection<TransferDoc>,
    pub(super) accounts: &'s Collection<AccountDoc>,
    /// The entry copier, told of the entries the transaction appended.
    pub(super) batches: &'s Arc<Batches>,
    /// Stamps the transfer's `lastModified`.
    pub(super) clock: Clock<'s>,
    /// What the transfer read back says of its place.
    pub(super) deployment: &'s DeploymentName,
}

/// What a run of the transaction writes with, owned: the callback is run again by the
/// driver and must not borrow the request (see [`Atomic::transfer_atomically_within`]).
#[derive(Clone)]
struct InTransaction {
    transactions: Collection<TransferDoc>,
    accounts: Collection<AccountDoc>,
    copier: Arc<EntryCopier>,
}

impl Atomic<'_> {
    /// Inserts `transfer` as `done` and moves its money in one transaction, or, if an
    /// account refuses, writes nothing and says why. A taken idempotency key is
    /// [`StoreError::DuplicateKey`], as for an insert; a transaction that keeps failing
    /// for [`TRANSACTION_TIME_LIMIT`] gives up with nothing moved: as
    /// [`StoreError::Contended`] when its last run lost to a write conflict (another
    /// transaction on the same account), else as [`StoreError::Unavailable`].
    pub async fn transfer_atomically(
        self,
        transfer: &Transfer,
        owner: &str,
    ) -> StoreResult<AtomicOutcome> {
        self.transfer_atomically_within(transfer, owner, TRANSACTION_TIME_LIMIT)
            .await
    }

    /// [`Atomic::transfer_atomically`] with its own time limit, for the tests that make a
    /// transaction conflict until it gives up.
    pub async fn transfer_atomically_within(
        self,
        transfer: &Transfer,
        owner: &str,
        time_limit: Duration,
    ) -> StoreResult<AtomicOutcome> {
        let done = done_by(transfer, owner, self.clock.stamp_time().await?);
        let deadline = Instant::now() + time_limit;
        let mut session = self.db.client().start_session().await?;
        // The callback's value is why an account refused, if one did. It then aborts the
        // transaction itself: the driver sees no transaction left open and returns the
        // value without committing or retrying. Errors are only the driver's failures
        // (retried while labelled transient) and `TimeLimitReached`.
        // The callback owns clones (cheap: handles and one document) rather than borrowing
        // `self`: with borrowed captures, rustc cannot prove the request's future `Send`
        // (rust-lang/rust#96865, named in `and_run2`'s documentation).
        let store = InTransaction {
            transactions: self.transactions.clone(),
            accounts: self.accounts.clone(),
            copier: self.batches.entry_copier.clone(),
        };
        let steps_doc = done.clone();
        // Whether the last failed run lost to a write conflict: what giving up says.
        let conflicted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let lost = conflicted.clone();
        let refused = session
            .start_transaction()
            .write_concern(majority_journaled())
            .read_concern(ReadConcern::snapshot())
            .and_run2(async move |session| {
                if Instant::now() >= deadline {
                    return Err(mongodb::error::Error::custom(TimeLimitReached));
                }
                let refused = match store.atomic_steps(session, &steps_doc).await {
                    Ok(refused) => refused,
                    Err(e) => {
                        lost.store(is_write_conflict(&e), Ordering::Relaxed);
                        return Err(e);
                    }
                };
                if refused.is_some() {
                    session.abort_transaction().await?;
                }
                Ok(refused)
            })
            .await;
        match refused {
            Ok(None) => {
                // Committed: the entry copier copies the new entries out of the documents,
                // as after a two-phase step (see `atomic_change`).
                (self.batches.entry_copier)
                    .touched([done.source.as_str(), done.destination.as_str()]);
                Ok(AtomicOutcome::Done(Box::new(
                    done.into_domain(self.deployment)?,
                )))
            }
            Ok(Some(reason)) => Ok(AtomicOutcome::Refused(reason)),
            Err(e) if e.get_custom::<TimeLimitReached>().is_some() => Err(gave_up(
                transfer,
                time_limit,
                conflicted.load(Ordering::Relaxed),
            )),
            Err(e) => Err(e.into()),
        }
    }
}

impl InTransaction {
    /// Insert, debit, credit, inside the session's transaction. Returns why an account
    /// refused, if one did (the caller aborts).
    async fn atomic_steps(
        &self,
        session: &mut ClientSession,
        t: &TransferDoc,
    ) -> mongodb::error::Result<Option<CancelReason>> {
        self.transactions
            .insert_one(t)
            .session(&mut *session)
            .await?;
        // The same invariants as a two-phase step: what holds reserve is not spendable,
        // and pending credits leave room for their capture.
        let debit = doc! {
            "_id": &t.source,
            "$expr": { "$gte": [
                { "$subtract": [path(account::BALANCE), { "$ifNull": [path(account::PENDING_DEBITS), 0_i64] }] },
                t.value,
            ] },
        };
        if !self
            .atomic_change(session, debit, EntryKind::Debit, t.id, -t.value)
            .await?
        {
            let exists = self.account_exists(session, &t.source).await?;
            return Ok(Some(if exists {
                CancelReason::InsufficientFunds
            } else {
                CancelReason::AccountNotFound
            }));
        }
        let credit = doc! {
            "_id": &t.destination,
            "$expr": { "$lte": [
                { "$add": [
                    path(account::BALANCE),
                    { "$ifNull": [path(account::PENDING_CREDITS), 0_i64] },
                    { "$ifNull": [path(account::INCOMING), 0_i64] },
                ] },
                MAX_MONEY - t.value,
            ] },
        };
        if !self
            .atomic_change(session, credit, EntryKind::Credit, t.id, t.value)
            .await?
        {
            let exists = self.account_exists(session, &t.destination).await?;
            return Ok(Some(if exists {
                CancelReason::BalanceOverflow
            } else {
                CancelReason::AccountNotFound
            }));
        }
        Ok(None)
    }

    /// Adds `value` to the balance of the account `filter` finds (by its `_id`), with its
    /// entry (`kind` of `tx`), inside the session's transaction; false when the filter
    /// found nothing.
    ///
    /// Its entries are kept as a two-phase step's are (`store::entries`): appended to the
    /// document by this write, which leaves out those the entry copier has copied; the
    /// copier copies the new one once the transaction has committed. The transaction writes
    /// nothing to `entries` itself, so no write of the copier (from outside it, on a key it
    /// also writes) can wait for it while it waits to commit: on SecantusDB, which runs one
    /// write command at a time, that stalled both (a native transfer after a hold timed
    /// out in CI, when transactions copied their accounts' older entries themselves).
    async fn atomic_change(
        &self,
        session: &mut ClientSession,
        filter: Document,
        kind: EntryKind,
        tx: ObjectId,
        value: i64,
    ) -> mongodb::error::Result<bool> {
        let moved = filter
            .get_str("_id")
            .ok()
            .and_then(|id| AccountId::parse(id).ok())
            .and_then(|account| self.copier.moved(account.as_str()));
        let changed = self
            .accounts
            .update_one(
                filter,
                changed_with_entry(kind, tx, &moved_by(value), Marker::Native, moved),
            )
            .session(&mut *session)
            .await?;
        Ok(changed.matched_count == 1)
    }

    async fn account_exists(
        &self,
        session: &mut ClientSession,
        id: &str,
    ) -> mongodb::error::Result<bool> {
        Ok(self
            .accounts
            .find_one(doc! { "_id": id })
            .session(session)
            .await?
            .is_some())
    }
}

/// A change of the balance alone by `value`, as a native transaction's debit (negative)
/// or credit makes.
fn moved_by(value: i64) -> Amounts {
    Amounts::change(value, 0, 0)
}

/// Why a transaction that kept failing for `time_limit` gave up: contended when its last
/// run lost to a write conflict (`conflicted`), else unavailable. Nothing is inserted, so
/// the error names no transfer.
fn gave_up(transfer: &Transfer, time_limit: Duration, conflicted: bool) -> StoreError {
    let said = format!(
        "transfer {}: transaction kept failing for {} ms",
        transfer.id,
        time_limit.as_millis()
    );
    if conflicted {
        StoreError::contended(None, said)
    } else {
        StoreError::Unavailable(said.into())
    }
}

/// MongoDB's WriteConflict: another transaction (or write) changed a document this
/// transaction writes since it started.
const WRITE_CONFLICT: i32 = 112;

/// Whether a run of the transaction failed because it lost to a concurrent writer.
fn is_write_conflict(e: &mongodb::error::Error) -> bool {
    match e.kind.as_ref() {
        ErrorKind::Command(c) => c.code == WRITE_CONFLICT,
        ErrorKind::Write(WriteFailure::WriteError(w)) => w.code == WRITE_CONFLICT,
        _ => false,
    }
}

/// `transfer` as one transaction stores it: `done` under `owner`, stamped `at`, its event
/// marked due.
fn done_by(transfer: &Transfer, owner: &str, at: mongodb::bson::DateTime) -> TransferDoc {
    TransferDoc {
        state: TransferState::Done,
        application: Some(owner.to_owned()),
        last_modified: at,
        events_due: due(TransferState::Done, at).into_iter().collect(),
        ..TransferDoc::from(transfer)
    }
}
