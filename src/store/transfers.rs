//! Operations on `transactions`, the transfer log. A state change is one `updateOne`
//! filtered on the expected previous state, so of two instances racing for the same
//! transition exactly one wins, and a step retried after a crash is a no-op.
//!
//! `lastModified` only ever moves forward (`$max`, never `$set`): instances' clocks may
//! disagree, and the lease and fence arithmetic needs every later write of a transfer to
//! carry a time at least as late as every earlier one.

use futures::TryStreamExt;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::options::{FindOptions, ReturnDocument};

use super::batch::Transition;
use super::{Store, StoreResult, TransferDoc, merge_set};
use crate::domain::TransferState;

/// The states the sweeper looks for.
const UNFINISHED: [TransferState; 4] = [
    TransferState::Initial,
    TransferState::Pending,
    TransferState::Applied,
    TransferState::Canceling,
];

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
    pub async fn insert_transfer(&self, transfer: &TransferDoc) -> StoreResult<()> {
        self.batches.inserts.submit(transfer.clone()).await
    }

    pub async fn transfer(&self, id: ObjectId) -> StoreResult<Option<TransferDoc>> {
        Ok(self.transactions.find_one(doc! { "_id": id }).await?)
    }

    pub async fn transfer_by_idempotency_key(&self, key: &str) -> StoreResult<Option<TransferDoc>> {
        Ok(self
            .transactions
            .find_one(doc! { "idempotencyKey": key })
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
        let set = merge_set(doc! { "state": to.as_str() }, extra);
        let result = self
            .transactions
            .update_one(
                doc! { "_id": id, "state": from.as_str() },
                doc! { "$set": set, "$max": touched(DateTime::now()) },
            )
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
        let result = self
            .transactions
            .update_one(
                doc! {
                    "_id": original,
                    "state": TransferState::Done.as_str(),
                    "reversedBy": { "$exists": false },
                },
                doc! {
                    "$set": { "reversedBy": reversal, "reversing": true },
                    "$max": touched(DateTime::now()),
                },
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
        self.transactions
            .update_one(
                doc! { "_id": original, "reversedBy": reversal },
                doc! {
                    "$unset": { "reversedBy": "", "reversing": "" },
                    "$max": touched(DateTime::now()),
                },
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
        self.transactions
            .update_one(
                doc! { "_id": original, "reversedBy": reversal, "reversing": true },
                doc! { "$unset": { "reversing": "" }, "$max": touched(DateTime::now()) },
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

    /// Transfers canceled while pending whose account fences are still in place, last
    /// modified before `stale_before`.
    pub async fn fenced_canceled(
        &self,
        stale_before: DateTime,
        limit: u32,
    ) -> StoreResult<Vec<TransferDoc>> {
        self.older_than(
            doc! { "fenced": true, "state": TransferState::Canceled.as_str() },
            stale_before,
            limit,
        )
        .await
    }

    /// Forgets that a canceled transfer's accounts are fenced, once the fences are gone.
    pub async fn unmark_fenced(&self, id: ObjectId) -> StoreResult<()> {
        self.transactions
            .update_one(
                doc! { "_id": id, "state": TransferState::Canceled.as_str(), "fenced": true },
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
        let cursor = self.transactions.find(filter).with_options(options).await?;
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
        let cursor = self.transactions.find(query).with_options(options).await?;
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
        if extra.is_empty() {
            // The common case, group-committed with concurrent transfers' changes.
            let change = Transition {
                owner: owner.to_owned(),
                id,
                from,
                to,
            };
            return self.batches.transitions.submit(change).await;
        }
        let now = DateTime::now();
        let set = merge_set(doc! { "state": to.as_str(), "application": owner }, extra);
        let result = self
            .transactions
            .update_one(
                doc! { "_id": id, "state": from.as_str(), "application": owned_by(owner, from) },
                doc! { "$set": set, "$max": touched(now) },
            )
            .await?;
        Ok((result.modified_count == 1).then_some(now))
    }

    /// Renews `owner`'s lease on a transfer still in `state`: a fresh `lastModified`.
    pub async fn renew_lease(
        &self,
        owner: &str,
        id: ObjectId,
        state: TransferState,
    ) -> StoreResult<Option<DateTime>> {
        let now = DateTime::now();
        let result = self
            .transactions
            .update_one(
                doc! { "_id": id, "state": state.as_str(), "application": owner },
                doc! { "$max": touched(now) },
            )
            .await?;
        Ok((result.modified_count == 1).then_some(now))
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
        Ok(self
            .transactions
            .find_one_and_update(
                doc! { "_id": id, "state": state.as_str() },
                doc! { "$set": { "application": owner }, "$max": touched(DateTime::now()) },
            )
            .return_document(ReturnDocument::After)
            .await?)
    }

    /// Unfinished transfers last modified before `stale_before` (a time by the
    /// database's clock, see [`Store::server_time`]), oldest first, or (with `mine`) every
    /// unfinished transfer `owner` owns.
    pub async fn unfinished(
        &self,
        owner: &str,
        stale_before: DateTime,
        mine: bool,
        limit: u32,
    ) -> StoreResult<Vec<TransferDoc>> {
        let states: Vec<&str> = UNFINISHED.iter().map(|s| s.as_str()).collect();
        let unfinished = doc! { "state": { "$in": states } };
        if mine {
            let mut filter = unfinished;
            filter.insert("application", owner);
            return self.oldest_first(filter, limit).await;
        }
        self.older_than(unfinished, stale_before, limit).await
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
            .find_one_and_update(
                filter,
                doc! { "$set": { "application": owner }, "$max": touched(DateTime::now()) },
            )
            .return_document(ReturnDocument::After)
            .await?)
    }
}

/// The `$max` operand that moves `lastModified` forward to `now`, never back.
pub(super) fn touched(now: DateTime) -> Document {
    doc! { "lastModified": now }
}

/// The `application` condition of an owner's state change: `owner`, or, for a transfer
/// still `initial`, nobody yet.
pub(super) fn owned_by(owner: &str, from: TransferState) -> Document {
    if from == TransferState::Initial {
        doc! { "$in": [Bson::Null, owner] }
    } else {
        doc! { "$eq": owner }
    }
}
