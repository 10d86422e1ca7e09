//! The alternative to the two-phase commit (`TRANSFER_STRATEGY=native`): one transfer as
//! one MongoDB multi-document transaction, what a user would otherwise pick. It writes the
//! same documents the two-phase path ends with (a `done` transfer, the two balances), so
//! the API answers the same, and it serves as the benchmark's comparison.
//!
//! Retries follow the driver specification: the whole transaction is run again on an
//! error labelled `TransientTransactionError` (a write conflict on a hot account, say),
//! and only the commit is retried on `UnknownTransactionCommitResult`. Both are bounded.
//! Nothing is ever half-applied: until the commit, nothing is visible.

use std::time::Duration;

use mongodb::ClientSession;
use mongodb::bson::{DateTime, doc};
use mongodb::error::{TRANSIENT_TRANSACTION_ERROR, UNKNOWN_TRANSACTION_COMMIT_RESULT};
use mongodb::options::{ReadConcern, TransactionOptions};
use rand::Rng;

use super::{Store, StoreError, StoreResult, TransferDoc, majority_journaled};
use crate::domain::{CancelReason, MAX_MONEY, TransferState};

/// Runs of the whole transaction before giving up (the caller answers 503; nothing moved).
const TRANSACTION_ATTEMPTS: u32 = 60;
/// Retries of a commit whose outcome is unknown.
const COMMIT_ATTEMPTS: u32 = 10;

/// How an atomic transfer ended.
#[derive(Debug)]
pub enum AtomicOutcome {
    /// Committed: the transfer as stored, `done`.
    Done(Box<TransferDoc>),
    /// Nothing was written: the accounts refused it for this reason.
    Refused(CancelReason),
}

impl Store {
    /// Records `transfer` as `done` and moves its money in one transaction, or, if an
    /// account refuses, writes nothing and says why. A taken idempotency key is
    /// [`StoreError::DuplicateKey`], as for an insert.
    pub async fn transfer_atomically(
        &self,
        transfer: &TransferDoc,
        owner: &str,
    ) -> StoreResult<AtomicOutcome> {
        let done = TransferDoc {
            state: TransferState::Done,
            application: Some(owner.to_owned()),
            last_modified: self.server_time_lower_bound().await?,
            ..transfer.clone()
        };
        let options = TransactionOptions::builder()
            .write_concern(majority_journaled())
            .read_concern(ReadConcern::snapshot())
            .build();
        let mut session = self.db.client().start_session().await?;
        for attempt in 0..TRANSACTION_ATTEMPTS {
            session
                .start_transaction()
                .with_options(options.clone())
                .await?;
            let refused = match self.atomic_steps(&mut session, &done).await {
                Ok(refused) => refused,
                Err(e) => {
                    let _ = session.abort_transaction().await;
                    if e.contains_label(TRANSIENT_TRANSACTION_ERROR) {
                        backoff(attempt).await;
                        continue;
                    }
                    return Err(e.into());
                }
            };
            if let Some(reason) = refused {
                session.abort_transaction().await?;
                return Ok(AtomicOutcome::Refused(reason));
            }
            match commit(&mut session).await {
                Ok(()) => return Ok(AtomicOutcome::Done(Box::new(done))),
                Err(e) if e.contains_label(TRANSIENT_TRANSACTION_ERROR) => {
                    backoff(attempt).await;
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(StoreError::Unavailable(
            format!("transfer {}: transaction kept conflicting", transfer.id).into(),
        ))
    }

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
        let now = DateTime::now();
        let debited = self
            .accounts
            .update_one(
                doc! { "_id": &t.source, "balance": { "$gte": t.value } },
                doc! { "$inc": { "balance": -t.value }, "$set": { "updatedAt": now } },
            )
            .session(&mut *session)
            .await?;
        if debited.matched_count == 0 {
            let exists = self.account_exists(session, &t.source).await?;
            return Ok(Some(if exists {
                CancelReason::InsufficientFunds
            } else {
                CancelReason::AccountNotFound
            }));
        }
        let credited = self
            .accounts
            .update_one(
                doc! { "_id": &t.destination, "balance": { "$lte": MAX_MONEY - t.value } },
                doc! { "$inc": { "balance": t.value }, "$set": { "updatedAt": now } },
            )
            .session(&mut *session)
            .await?;
        if credited.matched_count == 0 {
            let exists = self.account_exists(session, &t.destination).await?;
            return Ok(Some(if exists {
                CancelReason::BalanceOverflow
            } else {
                CancelReason::AccountNotFound
            }));
        }
        Ok(None)
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

/// Commits, retrying only the commit while its outcome is unknown.
async fn commit(session: &mut ClientSession) -> mongodb::error::Result<()> {
    let mut attempt = 0;
    loop {
        match session.commit_transaction().await {
            Ok(()) => return Ok(()),
            Err(e) if e.contains_label(UNKNOWN_TRANSACTION_COMMIT_RESULT) => {
                attempt += 1;
                if attempt >= COMMIT_ATTEMPTS {
                    return Err(e);
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// A short random pause before running a conflicting transaction again, growing with the
/// attempts, so that transactions on a hot account stop colliding in lockstep.
async fn backoff(attempt: u32) {
    let ceiling_ms = 1u64 << attempt.min(6);
    let ms = rand::rng().random_range(0..=ceiling_ms);
    tokio::time::sleep(Duration::from_millis(ms)).await;
}
