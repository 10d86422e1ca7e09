//! Operations on `transactions`, the transfer log. A state change is one `updateOne`
//! filtered on the expected previous state, so of two instances racing for the same
//! transition exactly one wins, and a step retried after a crash is a no-op.

use futures::TryStreamExt;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::{DateTime, Document, doc};
use mongodb::options::FindOptions;

use super::{Store, StoreResult, TransferDoc, merge_set};
use crate::domain::TransferState;

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
        self.transactions.insert_one(transfer).await?;
        Ok(())
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
    /// still in `from`. Returns whether this call made the change.
    pub async fn transition(
        &self,
        id: ObjectId,
        from: TransferState,
        to: TransferState,
        extra: Document,
    ) -> StoreResult<bool> {
        let set = merge_set(
            doc! { "state": to.as_str(), "lastModified": DateTime::now() },
            extra,
        );
        let result = self
            .transactions
            .update_one(
                doc! { "_id": id, "state": from.as_str() },
                doc! { "$set": set },
            )
            .await?;
        Ok(result.modified_count == 1)
    }

    /// Claims the one reversal a done transfer may have: sets `reversedBy` only if it is
    /// unset. Returns whether this call claimed it.
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
                doc! { "$set": { "reversedBy": reversal, "lastModified": DateTime::now() } },
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
                doc! { "$unset": { "reversedBy": "" }, "$set": { "lastModified": DateTime::now() } },
            )
            .await?;
        Ok(())
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
