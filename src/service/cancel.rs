//! `POST /transfers/{id}/cancel`, after the tutorial's rule: a transfer that is not yet
//! applied is rolled back; one that is applied is completed and then reversed by a
//! compensating transfer from the destination back to the source.
//!
//! The commit point is the credit of the destination. Before it, the cancel fences both
//! accounts (the destination only if its credit is not there, atomically), and from then
//! on no forward step of the transfer can land on them, even one already in flight from
//! another instance. If the destination's fence fails because the credit is there, the
//! money may already be spent, so the transfer goes forward and is reversed instead.
//!
//! A reversal is claimed on the original (`reversedBy`, set once, guarded) before the
//! compensating transfer is recorded, so two cancels never make two reversals; if the
//! compensation ends `canceled` (the destination spent the money meanwhile), the claim is
//! released and the client is told, with nothing changed.

use mongodb::bson::doc;
use mongodb::bson::oid::ObjectId;

use super::{Bank, ServiceError, ServiceResult};
use crate::domain::{CancelReason, TransferEvent, TransferId, TransferState};
use crate::store::{StoreError, StoreResult, TransferDoc};

impl Bank {
    /// Cancels a transfer; answers with the original transfer as it ends.
    pub async fn cancel(&self, id: TransferId) -> ServiceResult<TransferDoc> {
        let mut transfer = self.find_transfer(id).await?;
        loop {
            transfer = match transfer.state {
                TransferState::Initial => {
                    // No account is touched before `initial -> pending`, which this
                    // write makes impossible: nothing to undo.
                    let set = doc! { "reason": CancelReason::CanceledByRequest.as_str() };
                    self.force(&transfer, TransferEvent::Abandon, set).await?
                }
                TransferState::Pending => self.cancel_pending(transfer).await?,
                TransferState::Applied | TransferState::Canceling => {
                    // Only idempotent pulls or undos remain: safe for us to take over
                    // from any owner, live or not.
                    match self
                        .store()
                        .take_over(self.instance_id(), transfer.id, transfer.state)
                        .await?
                    {
                        Some(mine) => self.run(mine).await?,
                        None => self.reload(&transfer).await?,
                    }
                }
                TransferState::Canceled => return Ok(transfer),
                TransferState::Done => return self.reverse(transfer).await,
            };
        }
    }

    /// Fences the accounts, then rolls back; or, if the credit already landed, goes
    /// forward so that the `Done` branch reverses it.
    async fn cancel_pending(&self, transfer: TransferDoc) -> ServiceResult<TransferDoc> {
        let store = self.store();
        let credit_blocked = store
            .fence_unless_applied(&transfer.destination, transfer.id)
            .await?;
        if !credit_blocked
            && store
                .account(&transfer.destination)
                .await?
                .is_some_and(|a| a.pending_transactions.contains(&transfer.id))
        {
            // Both accounts carry the transfer (every driver debits before it credits),
            // so only `pending -> applied` and the pulls remain. Take it straight to
            // `applied` instead of re-running the debit and credit next to the owner: a
            // second driver's debit after the owner's pull would apply it twice.
            tracing::info!(transfer_id = %transfer.id, "cancel found the credit applied; completing, then reversing");
            let set = doc! { "application": self.instance_id() };
            return Ok(self
                .force(&transfer, TransferEvent::MarkApplied, set)
                .await?);
        }
        store.fence(&transfer.source, transfer.id).await?;
        // Take the transfer over whoever owns it: the fences make every forward step of
        // the old owner a no-op from now on.
        let set = doc! {
            "reason": CancelReason::CanceledByRequest.as_str(),
            "application": self.instance_id(),
            "fenced": true,
        };
        let transfer = self
            .force(&transfer, TransferEvent::BeginRollback, set)
            .await?;
        Ok(self.run(transfer).await?)
    }

    /// Takes `event` from the transfer's current state whoever owns it (one write guarded
    /// by the state only, setting `set` too), logs and counts the change if this call made
    /// it, and answers with the transfer as it now stands. A cancel's own transitions; the
    /// protocol's are owner-guarded (`advance`).
    async fn force(
        &self,
        transfer: &TransferDoc,
        event: TransferEvent,
        set: mongodb::bson::Document,
    ) -> StoreResult<TransferDoc> {
        let from = transfer.state;
        let to = from
            .transition(event)
            .map_err(|e| StoreError::Other(e.to_string()))?;
        let reason = set.get_str("reason").ok().and_then(CancelReason::parse);
        if self.store().transition(transfer.id, from, to, set).await? {
            tracing::info!(transfer_id = %transfer.id, from = %from, to = %to, reason = ?reason, "transfer state changed");
            crate::metrics::transfer_finished(to, reason);
        }
        self.reload(transfer).await
    }

    /// Reverses a done transfer with a compensating transfer, at most once.
    async fn reverse(&self, mut original: TransferDoc) -> ServiceResult<TransferDoc> {
        loop {
            if original.reversed_by.is_some() {
                return self.finish_reversal(original).await;
            }
            let funds = self
                .store()
                .account(&original.destination)
                .await?
                .map_or(0, |a| a.balance);
            if funds < original.value {
                return Err(ServiceError::ReversalInsufficientFunds {
                    account: original.destination.clone(),
                    attempt: None,
                });
            }
            let claimed = ObjectId::new();
            if self.store().claim_reversal(original.id, claimed).await? {
                original.reversed_by = Some(claimed);
            } else {
                original = self
                    .find_transfer(TransferId::from_bytes(original.id.bytes()))
                    .await?;
            }
        }
    }

    /// Drives the claimed reversal of `original` to its end: records the compensating
    /// transfer if a crash came between the claim and its insert, runs it, then marks the
    /// reversal finished or, if the compensation was refused (the destination spent the
    /// money between our check and its debit), releases the claim so a later cancel may
    /// try again. Used by a cancel and by the sweeper, for a reversal a crash interrupted.
    ///
    /// If another instance is driving the compensation, returns `original` as it is: that
    /// instance, or the sweeper after it, finishes the reversal.
    pub async fn finish_reversal(&self, original: TransferDoc) -> ServiceResult<TransferDoc> {
        let Some(reversal_id) = original.reversed_by else {
            return Ok(original);
        };
        let reversal = self.claimed_reversal(&original, reversal_id).await?;
        let reversal = self.run(reversal).await?;
        match reversal.state {
            TransferState::Done => {
                self.store()
                    .reversal_finished(original.id, reversal_id)
                    .await?;
                Ok(self.reload(&original).await?)
            }
            TransferState::Canceled => {
                self.store()
                    .release_reversal(original.id, reversal_id)
                    .await?;
                if reversal.reason == Some(CancelReason::BalanceOverflow) {
                    return Err(ServiceError::ReversalOverflow {
                        account: original.source.clone(),
                        attempt: reversal_id,
                    });
                }
                Err(ServiceError::ReversalInsufficientFunds {
                    account: original.destination.clone(),
                    attempt: Some(reversal_id),
                })
            }
            _ => Ok(self.reload(&original).await?),
        }
    }

    /// The compensating transfer claimed as `reversal_id`, recorded now if a crash came
    /// between the claim and the insert.
    async fn claimed_reversal(
        &self,
        original: &TransferDoc,
        reversal_id: ObjectId,
    ) -> ServiceResult<TransferDoc> {
        if let Some(existing) = self.store().transfer(reversal_id).await? {
            return Ok(existing);
        }
        let reversal = TransferDoc {
            reverses: Some(original.id),
            ..TransferDoc::initial(
                reversal_id,
                &original.destination,
                &original.source,
                original.value,
                &original.currency,
            )
        };
        match self.store().insert_transfer(&reversal).await {
            Ok(()) => Ok(reversal),
            // A concurrent cancel recorded it first.
            Err(crate::store::StoreError::DuplicateKey(_)) => Ok(self
                .find_transfer(TransferId::from_bytes(reversal_id.bytes()))
                .await?),
            Err(e) => Err(e.into()),
        }
    }
}
