//! The two-phase commit, one function per step, the same code for a fresh transfer and
//! for one the sweeper resumes.
//!
//! [`Bank::run`] looks at the stored state and takes the next step until the transfer is
//! terminal:
//!
//! | state       | steps taken                                                     |
//! |-------------|-----------------------------------------------------------------|
//! | `initial`   | 2. `initial -> pending`, setting `application`                  |
//! | `pending`   | 3. debit source, 4. credit destination, 5. `pending -> applied` |
//! | `applied`   | 6. pull source marker, 7. pull destination marker, 8. `-> done` |
//! | `canceling` | undo destination, undo source, `canceling -> canceled`          |
//!
//! Every step is one guarded write, so running it again is a no-op. A guarded write that
//! loses means another actor moved the transfer (a cancel, another instance): we re-read
//! and carry on from whatever state it is in now. A debit or credit that is refused for
//! lack of funds, for overflow, or because the account is gone rolls the transfer back
//! with that reason. The rollback never takes money back from a destination: a transfer
//! only rolls back while its credit is not applied (see `cancel.rs` for the fence that
//! guarantees it when a client cancels).

use mongodb::bson::doc;

use super::Bank;
use crate::domain::{CancelReason, TransferEvent, TransferState};
use crate::store::{AccountDoc, StoreError, StoreResult, TransferDoc};

/// How often an account step is retried when its guard failed but a re-read shows no
/// reason to refuse it (the balance changed in between). Bounded so a pathological race
/// cannot spin forever; the sweeper resumes the transfer later.
const ACCOUNT_STEP_ATTEMPTS: usize = 16;

/// Why a debit or credit was not applied, read back from the account after the guarded
/// write matched nothing.
enum Refusal {
    /// The transfer is already applied to this account: the step is done.
    AlreadyApplied,
    /// A cancel fenced this account: the transfer must roll back.
    Fenced,
    /// The account no longer exists.
    Missing,
    /// The balance refused it (short for a debit, overflowing for a credit).
    Balance,
    /// Nothing now refuses it: the balance changed between the write and the read.
    Retry,
}

fn classify(
    account: Option<AccountDoc>,
    transfer: &TransferDoc,
    balance_ok: impl Fn(i64) -> bool,
) -> Refusal {
    let Some(account) = account else {
        return Refusal::Missing;
    };
    if account.pending_transactions.contains(&transfer.id) {
        Refusal::AlreadyApplied
    } else if account.fenced_transactions.contains(&transfer.id) {
        Refusal::Fenced
    } else if !balance_ok(account.balance) {
        Refusal::Balance
    } else {
        Refusal::Retry
    }
}

/// What an account step concluded.
enum StepResult {
    Applied,
    RollBack(CancelReason),
}

impl Bank {
    /// Drives a transfer from its stored state to `done` or `canceled`.
    ///
    /// Returns early only on a database error; the transfer is then left where it is,
    /// every step so far durable, for a later call or the sweeper to resume.
    pub async fn run(&self, mut transfer: TransferDoc) -> StoreResult<TransferDoc> {
        loop {
            transfer = match transfer.state {
                TransferState::Initial => self.start(transfer).await?,
                TransferState::Pending => self.apply(transfer).await?,
                TransferState::Applied => self.settle(transfer).await?,
                TransferState::Canceling => self.roll_back(transfer).await?,
                TransferState::Done | TransferState::Canceled => return Ok(transfer),
            };
        }
    }

    /// Step 2: `initial -> pending`, taking ownership.
    async fn start(&self, transfer: TransferDoc) -> StoreResult<TransferDoc> {
        let set = doc! { "application": self.instance_id() };
        self.advance(transfer, TransferEvent::Start, set).await
    }

    /// Steps 3 to 5: debit, credit, `pending -> applied`.
    async fn apply(&self, transfer: TransferDoc) -> StoreResult<TransferDoc> {
        match self.debit(&transfer).await? {
            StepResult::Applied => {}
            StepResult::RollBack(reason) => return self.begin_rollback(transfer, reason).await,
        }
        match self.credit(&transfer).await? {
            StepResult::Applied => {}
            StepResult::RollBack(reason) => return self.begin_rollback(transfer, reason).await,
        }
        self.advance(transfer, TransferEvent::MarkApplied, doc! {})
            .await
    }

    /// Step 3: take the amount from the source, unless already taken.
    async fn debit(&self, t: &TransferDoc) -> StoreResult<StepResult> {
        for _ in 0..ACCOUNT_STEP_ATTEMPTS {
            if self.store.apply_debit(&t.source, t.id, t.value).await? {
                tracing::debug!(transfer_id = %t.id, account = %t.source, "source debited");
                return Ok(StepResult::Applied);
            }
            let account = self.store.account(&t.source).await?;
            match classify(account, t, |balance| balance >= t.value) {
                Refusal::AlreadyApplied => return Ok(StepResult::Applied),
                Refusal::Fenced => {
                    return Ok(StepResult::RollBack(CancelReason::CanceledByRequest));
                }
                Refusal::Missing => return Ok(StepResult::RollBack(CancelReason::AccountNotFound)),
                Refusal::Balance => {
                    return Ok(StepResult::RollBack(CancelReason::InsufficientFunds));
                }
                Refusal::Retry => continue,
            }
        }
        Err(contended(t))
    }

    /// Step 4: give the amount to the destination, unless already given.
    async fn credit(&self, t: &TransferDoc) -> StoreResult<StepResult> {
        for _ in 0..ACCOUNT_STEP_ATTEMPTS {
            if self
                .store
                .apply_credit(&t.destination, t.id, t.value)
                .await?
            {
                tracing::debug!(transfer_id = %t.id, account = %t.destination, "destination credited");
                return Ok(StepResult::Applied);
            }
            let account = self.store.account(&t.destination).await?;
            let max = crate::domain::MAX_MONEY;
            match classify(account, t, |balance| balance <= max - t.value) {
                Refusal::AlreadyApplied => return Ok(StepResult::Applied),
                Refusal::Fenced => {
                    return Ok(StepResult::RollBack(CancelReason::CanceledByRequest));
                }
                Refusal::Missing => return Ok(StepResult::RollBack(CancelReason::AccountNotFound)),
                Refusal::Balance => return Ok(StepResult::RollBack(CancelReason::BalanceOverflow)),
                Refusal::Retry => continue,
            }
        }
        Err(contended(t))
    }

    /// Steps 6 to 8: pull both markers, then `applied -> done`.
    async fn settle(&self, transfer: TransferDoc) -> StoreResult<TransferDoc> {
        self.store
            .pull_marker(&transfer.source, transfer.id)
            .await?;
        self.store
            .pull_marker(&transfer.destination, transfer.id)
            .await?;
        self.advance(transfer, TransferEvent::MarkDone, doc! {})
            .await
    }

    /// `pending -> canceling`, recording why.
    pub(super) async fn begin_rollback(
        &self,
        transfer: TransferDoc,
        reason: CancelReason,
    ) -> StoreResult<TransferDoc> {
        tracing::info!(transfer_id = %transfer.id, %reason, "rolling back");
        let mut set = doc! { "reason": reason.as_str(), "application": self.instance_id() };
        if reason == CancelReason::CanceledByRequest {
            set.insert("fenced", true);
        }
        self.advance(transfer, TransferEvent::BeginRollback, set)
            .await
    }

    /// Undo whatever each account carries, destination first, then `canceling -> canceled`.
    async fn roll_back(&self, transfer: TransferDoc) -> StoreResult<TransferDoc> {
        self.store
            .undo_change(&transfer.destination, transfer.id, -transfer.value)
            .await?;
        self.store
            .undo_change(&transfer.source, transfer.id, transfer.value)
            .await?;
        self.advance(transfer, TransferEvent::FinishRollback, doc! {})
            .await
    }

    /// Takes `event` with one guarded write. If the write loses, the transfer moved on
    /// without us: re-read it and let the caller continue from its new state.
    pub(super) async fn advance(
        &self,
        mut transfer: TransferDoc,
        event: TransferEvent,
        extra: mongodb::bson::Document,
    ) -> StoreResult<TransferDoc> {
        let from = transfer.state;
        let to = match from.transition(event) {
            Ok(to) => to,
            Err(e) => return Err(StoreError::Other(e.to_string())),
        };
        if self
            .store
            .transition(transfer.id, from, to, extra.clone())
            .await?
        {
            tracing::info!(transfer_id = %transfer.id, from = %from, to = %to, "transfer state changed");
            transfer.state = to;
            if let Ok(app) = extra.get_str("application") {
                transfer.application = Some(app.to_owned());
            }
            if let Some(reason) = extra.get_str("reason").ok().and_then(CancelReason::parse) {
                transfer.reason = Some(reason);
            }
            transfer.fenced |= extra.get_bool("fenced").unwrap_or(false);
            transfer.last_modified = mongodb::bson::DateTime::now();
            return Ok(transfer);
        }
        self.reload(&transfer).await
    }

    pub(super) async fn reload(&self, transfer: &TransferDoc) -> StoreResult<TransferDoc> {
        self.store
            .transfer(transfer.id)
            .await?
            .ok_or_else(|| StoreError::Other(format!("transfer {} vanished", transfer.id)))
    }
}

fn contended(t: &TransferDoc) -> StoreError {
    StoreError::Unavailable(format!(
        "transfer {}: account step kept losing to concurrent updates",
        t.id
    ))
}
