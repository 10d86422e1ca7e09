//! Operations on `transactions`, the transfer log. A state change is one `updateOne`
//! filtered on the expected previous state, so of two instances racing for the same
//! transition exactly one wins, and a step retried after a crash is a no-op.
//!
//! `lastModified` only ever moves forward (`$max`, never `$set`): instances' clocks may
//! disagree, and the lease and fence arithmetic needs every later write of a transfer to
//! carry a time at least as late as every earlier one.

use futures::TryStreamExt;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::{DateTime, Document, doc};
use mongodb::options::{FindOptions, ReturnDocument};

use super::batch::Transition;
use super::guards::{owned_by, stamped, stamped_unset};
use super::{Store, StoreResult, TransferDoc, merge_set};
use crate::domain::TransferState;

/// The states the sweeper looks for.
const UNFINISHED: [TransferState; 4] = [
    TransferState::Initial,
    TransferState::Pending,
    TransferState::Applied,
    TransferState::Canceling,
];

fn unfinished_states() -> Vec<&'static str> {
    UNFINISHED.iter().map(|s| s.as_str()).collect()
}

fn finished_states() -> Vec<&'static str> {
    TransferState::ALL
        .into_iter()
        .filter(|s| s.is_terminal())
        .map(|s| s.as_str())
        .collect()
}

/// Which transfers a listing returns.
#[derive(Debug, Clone, Default)]
pub struct TransferFilter {
    pub state: Option<TransferState>,
    /// Transfers whose source or destination is this account.
    pub account: Option<String>,
    /// Keyset cursor: only transfers older than this id.
    pub before: Option<ObjectId>,
}

impl Store {
    /// Step 1: record the transfer. Fails with `DuplicateKey` when its idempotency key is
    /// taken, or when it is a second reversal of the same transfer.
    ///
    /// `lastModified` is stamped by the database's clock (a lower bound of it, see
    /// [`super::clock`]), whatever the caller's copy says: another instance compares it
    /// with the database's time to decide when the transfer is stale.
    /// Returns that stamp.
    pub async fn insert_transfer(&self, transfer: &TransferDoc) -> StoreResult<DateTime> {
        let at = self.server_time_lower_bound().await?;
        let stamped = TransferDoc {
            last_modified: at,
            ..transfer.clone()
        };
        failpoint!(self, "before_insert");
        self.batches.inserts.submit(stamped).await?;
        Ok(at)
    }

    pub async fn transfer(&self, id: ObjectId) -> StoreResult<Option<TransferDoc>> {
        Ok(self
            .transactions
            .find_one(doc! { "_id": id })
            .max_time(super::READ_TIME_LIMIT)
            .await?)
    }

    pub async fn transfer_by_idempotency_key(&self, key: &str) -> StoreResult<Option<TransferDoc>> {
        Ok(self
            .transactions
            .find_one(doc! { "idempotencyKey": key })
            .max_time(super::READ_TIME_LIMIT)
            .await?)
    }

    /// Moves a transfer from `from` to `to`, setting `extra` fields too, only if it is
    /// still in `from`, whoever owns it. Used by a cancel, which takes the transfer over
    /// (its fences make that safe). Returns whether this call made the change.
    pub async fn transition(
        &self,
        id: ObjectId,
        from: TransferState,
        to: TransferState,
        extra: Document,
    ) -> StoreResult<bool> {
        failpoint!(self, "before_force");
        let at = self.server_time_lower_bound().await?;
        let set = merge_set(doc! { "state": to.as_str() }, extra);
        let result = self
            .transactions
            .update_one(doc! { "_id": id, "state": from.as_str() }, stamped(set, at))
            .await?;
        Ok(result.modified_count == 1)
    }

    /// Claims the one reversal a done transfer may have: sets `reversedBy` only if it is
    /// unset, and `reversing` until the compensation has finished, so that the sweeper
    /// finishes a reversal whose instance crashed. Returns whether this call claimed it.
    pub async fn claim_reversal(
        &self,
        original: ObjectId,
        reversal: ObjectId,
    ) -> StoreResult<bool> {
        failpoint!(self, "before_claim_reversal");
        let at = self.server_time_lower_bound().await?;
        let result = self
            .transactions
            .update_one(
                doc! {
                    "_id": original,
                    "state": TransferState::Done.as_str(),
                    "reversedBy": { "$exists": false },
                },
                stamped(doc! { "reversedBy": reversal, "reversing": true }, at),
            )
            .await?;
        Ok(result.modified_count == 1)
    }

    /// Releases a claim whose compensating transfer ended `canceled`, so that a later
    /// cancel may try again. The canceled compensation stays in the log.
    pub async fn release_reversal(
        &self,
        original: ObjectId,
        reversal: ObjectId,
    ) -> StoreResult<()> {
        let at = self.server_time_lower_bound().await?;
        self.transactions
            .update_one(
                doc! { "_id": original, "reversedBy": reversal },
                stamped_unset(&["reversedBy", "reversing"], at),
            )
            .await?;
        Ok(())
    }

    /// Marks the reversal of `original` finished (its compensation is `done`).
    pub async fn reversal_finished(
        &self,
        original: ObjectId,
        reversal: ObjectId,
    ) -> StoreResult<()> {
        let at = self.server_time_lower_bound().await?;
        self.transactions
            .update_one(
                doc! { "_id": original, "reversedBy": reversal, "reversing": true },
                stamped_unset(&["reversing"], at),
            )
            .await?;
        Ok(())
    }

    /// Done transfers whose reversal was claimed before `stale_before` and has not
    /// finished: its instance crashed between the claim and the end of the compensation.
    pub async fn unfinished_reversals(
        &self,
        stale_before: DateTime,
        limit: u32,
    ) -> StoreResult<Vec<TransferDoc>> {
        self.older_than(doc! { "reversing": true }, stale_before, limit)
            .await
    }

    /// Marks an unfinished transfer `fenced` before anyone fences its accounts, so that
    /// whoever finishes it, and however, the sweeper later finds and drops the fences.
    /// Stamps the transfer (the fences' deadlines count from here). Returns the start of
    /// that window (a lower bound of the stamp), or `None` if the transfer is already
    /// finished: then nothing needs fencing.
    pub async fn mark_fenced(&self, id: ObjectId) -> StoreResult<Option<DateTime>> {
        let since = self.server_time_lower_bound().await?;
        failpoint!(self, "before_mark_fenced");
        let result = self
            .transactions
            .update_one(
                doc! { "_id": id, "state": { "$in": unfinished_states() } },
                stamped(doc! { "fenced": true }, since),
            )
            .await?;
        Ok((result.matched_count == 1).then_some(since))
    }

    /// Finished transfers whose account fences may still be in place, last modified
    /// before `stale_before`.
    pub async fn fenced_finished(
        &self,
        stale_before: DateTime,
        limit: u32,
    ) -> StoreResult<Vec<TransferDoc>> {
        self.older_than(
            doc! { "fenced": true, "state": { "$in": finished_states() } },
            stale_before,
            limit,
        )
        .await
    }

    /// Forgets that a finished transfer's accounts are fenced, once the fences are gone.
    pub async fn unmark_fenced(&self, id: ObjectId) -> StoreResult<()> {
        self.transactions
            .update_one(
                doc! { "_id": id, "state": { "$in": finished_states() }, "fenced": true },
                doc! { "$unset": { "fenced": "" } },
            )
            .await?;
        Ok(())
    }

    /// Transfers matching `filter` last modified before `before`, oldest first.
    async fn older_than(
        &self,
        mut filter: Document,
        before: DateTime,
        limit: u32,
    ) -> StoreResult<Vec<TransferDoc>> {
        filter.insert("lastModified", doc! { "$lt": before });
        self.oldest_first(filter, limit).await
    }

    /// At most `limit` transfers matching `filter`, least recently modified first.
    async fn oldest_first(&self, filter: Document, limit: u32) -> StoreResult<Vec<TransferDoc>> {
        let options = FindOptions::builder()
            .sort(doc! { "lastModified": 1 })
            .limit(i64::from(limit))
            .build();
        let cursor = self
            .transactions
            .find(filter)
            .with_options(options)
            .max_time(super::READ_TIME_LIMIT)
            .await?;
        Ok(cursor.try_collect().await?)
    }

    /// Transfers newest first, by keyset on `_id` (an ObjectId grows with time).
    pub async fn list_transfers(
        &self,
        filter: &TransferFilter,
        limit: u32,
    ) -> StoreResult<Vec<TransferDoc>> {
        let mut query = Document::new();
        if let Some(state) = filter.state {
            query.insert("state", state.as_str());
        }
        if let Some(account) = &filter.account {
            query.insert(
                "$or",
                vec![doc! { "source": account }, doc! { "destination": account }],
            );
        }
        if let Some(before) = filter.before {
            query.insert("_id", doc! { "$lt": before });
        }
        let options = FindOptions::builder()
            .sort(doc! { "_id": -1 })
            .limit(i64::from(limit))
            .build();
        let cursor = self
            .transactions
            .find(query)
            .with_options(options)
            .max_time(super::READ_TIME_LIMIT)
            .await?;
        Ok(cursor.try_collect().await?)
    }
}

impl Store {
    /// Like [`Store::transition`], but only while `owner` owns the transfer (for
    /// `initial`, also while nobody does). An instance whose lease was taken over can no
    /// longer move the transfer. Returns the new `lastModified` (the start of the renewed
    /// lease) when this call made the change.
    pub async fn transition_as(
        &self,
        owner: &str,
        id: ObjectId,
        from: TransferState,
        to: TransferState,
        extra: Document,
    ) -> StoreResult<Option<DateTime>> {
        // Taken before the write is sent, so the server stamps the lease at least this late.
        let lease_start = self.server_time_lower_bound().await?;
        failpoint!(self, "before_transition");
        if extra.is_empty() {
            // The common case, group-committed with concurrent transfers' changes.
            let change = Transition {
                owner: owner.to_owned(),
                id,
                from,
                to,
                at: lease_start,
            };
            return self.batches.transitions.submit(change).await;
        }
        let set = merge_set(doc! { "state": to.as_str(), "application": owner }, extra);
        let result = self
            .transactions
            .update_one(
                doc! { "_id": id, "state": from.as_str(), "application": owned_by(owner, from) },
                stamped(set, lease_start),
            )
            .await?;
        Ok((result.modified_count == 1).then_some(lease_start))
    }

    /// Renews `owner`'s lease on a transfer still in `state`: a fresh `lastModified`.
    pub async fn renew_lease(
        &self,
        owner: &str,
        id: ObjectId,
        state: TransferState,
    ) -> StoreResult<Option<DateTime>> {
        let lease_start = self.server_time_lower_bound().await?;
        failpoint!(self, "before_renew");
        let result = self
            .transactions
            .update_one(
                doc! { "_id": id, "state": state.as_str(), "application": owner },
                stamped(doc! {}, lease_start),
            )
            .await?;
        // Matched, not modified: a stamp already later than ours changes nothing, and
        // the lease is still ours.
        Ok((result.matched_count == 1).then_some(lease_start))
    }

    /// Takes over a transfer in `state` whatever its owner or age: used by a cancel of
    /// an `applied` or `canceling` transfer, whose remaining steps are safe for any
    /// instance to run. Returns the transfer as claimed, if it was still in `state`.
    pub async fn take_over(
        &self,
        owner: &str,
        id: ObjectId,
        state: TransferState,
    ) -> StoreResult<Option<TransferDoc>> {
        failpoint!(self, "before_take_over");
        let at = self.server_time_lower_bound().await?;
        Ok(self
            .transactions
            .find_one_and_update(
                doc! { "_id": id, "state": state.as_str() },
                stamped(doc! { "application": owner }, at),
            )
            .return_document(ReturnDocument::After)
            .await?)
    }

    /// Unfinished transfers last modified before `stale_before` (a time by the
    /// database's clock, see [`Store::server_time`]), oldest first.
    pub async fn unfinished(
        &self,
        stale_before: DateTime,
        limit: u32,
    ) -> StoreResult<Vec<TransferDoc>> {
        self.older_than(
            doc! { "state": { "$in": unfinished_states() } },
            stale_before,
            limit,
        )
        .await
    }

    /// Claims a transfer found by [`Store::unfinished`]: one guarded findAndModify that
    /// wins only if nobody touched the transfer since it was read (same state, owner and
    /// `lastModified`; the owner too, since `lastModified` need not move) and, unless it is
    /// `owner`'s own, it is still stale.
    pub async fn claim(
        &self,
        owner: &str,
        found: &TransferDoc,
        stale_before: DateTime,
    ) -> StoreResult<Option<TransferDoc>> {
        failpoint!(self, "before_claim");
        let at = self.server_time_lower_bound().await?;
        let mut filter = doc! {
            "_id": found.id,
            "state": found.state.as_str(),
            "application": found.application.as_deref(),
            "lastModified": found.last_modified,
        };
        if found.application.as_deref() != Some(owner) {
            filter.insert(
                "lastModified",
                doc! { "$eq": found.last_modified, "$lt": stale_before },
            );
        }
        Ok(self
            .transactions
            .find_one_and_update(filter, stamped(doc! { "application": owner }, at))
            .return_document(ReturnDocument::After)
            .await?)
    }
}
