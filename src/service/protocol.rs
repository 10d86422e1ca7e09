//! The two-phase commit, one function per step, the same code for a fresh transfer and
//! for one the sweeper resumes.
//!
//! [`Driver::run`] looks at the stored state and takes the next step until the
//! transfer is terminal:
//!
//! | state       | steps taken                                                     |
//! |-------------|-----------------------------------------------------------------|
//! | `initial`   | 2. `initial -> pending`, setting `application`                  |
//! | `pending`   | 3. prepare every party, 4. `pending -> applied`: the commit point |
//! | `applied`   | 5. settle every party, 6. `applied -> done`                     |
//! | `canceling` | undo every prepared party, `canceling -> canceled`              |
//!
//! A new transfer is inserted `pending`, owned by the instance that inserts it (step 1,
//! `create.rs`), so only a reversal's compensation, or a transfer inserted before issue
//! 35, takes step 2.
//!
//! The steps on the accounts are the same for every transfer, one leg or many
//! (`protocol/parties.rs`): they move each account of it once, by its net change.
//!
//! A hold (`docs/holds.md`) takes the same path with reservations for step 3
//! (`pendingDebits`, `pendingCredits` instead of the balances) and stops at `held`
//! (`pending -> held`); a capture moves it to `capturing`, whose steps move the captured
//! amount and release the reservations, then `done`; a void moves it to `canceling`,
//! whose steps release the reservations.
//!
//! Every step is one guarded write per account, so running it again is a no-op. A
//! guarded write that loses means another actor moved the transfer (a cancel, another
//! instance): we re-read and carry on from whatever state it is in now. A prepare that is
//! refused for lack of funds, for overflow, or because the account is gone rolls the
//! transfer back with that reason. The rollback never takes money back from a receiving
//! party: nothing is paid in before the commit point (see `cancel.rs` for the fences
//! that keep a late prepare from landing once a client cancels).

mod parties;

use super::Driver;
use super::driving::Driving;
use super::unanswered::StateChange;
use crate::domain::Side;
use crate::domain::{
    Account, AccountId, CancelReason, Timestamp, Transfer, TransferEvent, TransferState,
};
use crate::store::transfers::{Mover, StepFields};
use crate::store::{Store, StoreError, StoreResult};

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
    account: Option<&Account>,
    transfer: &Transfer,
    fits: impl Fn(&Account) -> bool,
) -> Refusal {
    let Some(account) = account else {
        return Refusal::Missing;
    };
    if account.pending_transactions.contains(&transfer.id) {
        Refusal::AlreadyApplied
    } else if account.fenced_transactions.contains(&transfer.id) {
        Refusal::Fenced
    } else if !fits(account) {
        Refusal::Balance
    } else {
        Refusal::Retry
    }
}

/// Where the copy of a transfer that a run starts from comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// Inserted `pending` and owned (step 1) by the run's own request, stamp included,
    /// under the drive lock the run holds, taken before the insert. That copy is what is
    /// stored, unless another actor moved the transfer since: no task of this process can
    /// have (the lock), a cancel fences the accounts before it takes the transfer over,
    /// and the sweeper claims it only once its lease, which every step of the run carries
    /// as a deadline, has lapsed. Every step the run takes is refused then, as the steps
    /// after a won `initial -> pending` are, so the run starts without reading the
    /// transfer back.
    Inserted,
    /// Read, or handed over by a caller: it may be stale.
    Read,
}

impl Driver {
    /// Drives a transfer from its stored state to `done` or `canceled`.
    ///
    /// Returns early only on a database error; the transfer is then left where it is,
    /// every step so far durable, for a later call or the sweeper to resume.
    pub async fn run(&self, transfer: Transfer) -> StoreResult<Transfer> {
        let driving = self.lock_drive(transfer.id).await;
        self.run_holding(driving, transfer, Origin::Read).await
    }

    /// [`Driver::run`] under `driving`, the transfer's drive lock, from `transfer` as
    /// `origin` says it came.
    pub(crate) async fn run_holding(
        &self,
        driving: Driving,
        transfer: Transfer,
        origin: Origin,
    ) -> StoreResult<Transfer> {
        let ended = self.drive(transfer, origin).await;
        self.let_go(driving).await;
        ended
    }

    /// The body of [`Driver::run`], under the transfer's drive lock.
    async fn drive(&self, mut transfer: Transfer, origin: Origin) -> StoreResult<Transfer> {
        let _in_flight = crate::metrics::InFlightTransfer::enter();
        // The caller's copy may be stale (another task finished the transfer and pulled
        // its markers, so a re-run prepare would apply again): start from the stored
        // state. Not needed for the copy this run inserted (see [`Origin::Inserted`]),
        // nor for a copy in `initial` (inserted by a reversal, or by an earlier version):
        // its first step, `initial -> pending`, is guarded, and if the transfer moved on,
        // it loses and re-reads.
        match origin {
            // Inserted `pending`: where a transfer inserted `initial` is after step 2.
            Origin::Inserted => failpoint!(self, AfterPending),
            Origin::Read if transfer.state != TransferState::Initial => {
                transfer = self.reload(&transfer).await?;
            }
            Origin::Read => {}
        }
        transfer = self.send_unanswered_state_change(transfer).await?;
        loop {
            if !self.may_drive(&transfer) {
                // Another instance owns it now (it took it over, or a cancel did).
                return Ok(transfer);
            }
            transfer = match transfer.state {
                TransferState::Initial => self.start(transfer).await?,
                TransferState::Pending => self.prepare_and_commit(transfer).await?,
                TransferState::Applied => {
                    self.wait_until_quiet(&transfer).await?;
                    self.settle_and_finish(transfer).await?
                }
                TransferState::Canceling => {
                    self.wait_until_quiet(&transfer).await?;
                    self.roll_back(transfer).await?
                }
                TransferState::Capturing => self.capture_and_finish(transfer).await?,
                // A hold waits for a capture, a void or its expiry.
                TransferState::Held => return Ok(transfer),
                TransferState::Done | TransferState::Canceled => return Ok(transfer),
            };
        }
    }

    /// Whether this instance may take the next step: it owns the transfer, or nobody
    /// does yet (`initial`).
    fn may_drive(&self, transfer: &Transfer) -> bool {
        match transfer.owner.as_deref() {
            Some(owner) => owner == self.owner(),
            None => transfer.state == TransferState::Initial,
        }
    }

    /// The end of this instance's lease on `transfer`, as the server will judge it: a
    /// forward account step must reach the server before it. It ends a tenth of the lease
    /// before a takeover becomes possible, so the two never overlap.
    fn lease_deadline(&self, transfer: &Transfer) -> Timestamp {
        self.lease_deadline_from(transfer.last_modified)
    }

    /// The deadline of a lease that started at `start` (by the database's clock): a tenth
    /// of the lease before anyone may take the transfer over or collect its fences.
    pub(super) fn lease_deadline_from(&self, start: Timestamp) -> Timestamp {
        let lease_ms = self.stale_after.as_millis() as i64;
        start + chrono::TimeDelta::milliseconds(lease_ms - lease_ms / 10)
    }

    /// How far two deployments' clocks may jump against each other between two readings
    /// and still keep a step from landing after the lease it was sent under (see
    /// `Store::deadline_on`): a tenth of the lease.
    pub(super) fn clock_allowance(&self) -> std::time::Duration {
        self.stale_after / 10
    }

    /// Step 2: `initial -> pending`, taking ownership.
    async fn start(&self, transfer: Transfer) -> StoreResult<Transfer> {
        self.advance(transfer, TransferEvent::Start, StepFields::default())
            .await
    }

    /// Sends again the state change of `transfer` that a run of this process sent without
    /// an answer (see [`super::unanswered`]), if the transfer is still where that run
    /// left it, so that the decision stands and the late copy is refused; then carries on
    /// from the stored state.
    async fn send_unanswered_state_change(&self, transfer: Transfer) -> StoreResult<Transfer> {
        let Some(change) = self.unanswered.state_change(transfer.id) else {
            return Ok(transfer);
        };
        if transfer.state != change.from || !self.may_drive(&transfer) {
            // It moved on, or another instance claimed it (which changed `application`):
            // the late copy will be refused by its own guards.
            self.unanswered.answered(transfer.id, change);
            return Ok(transfer);
        }
        tracing::info!(transfer_id = %transfer.id, from = %change.from, event = ?change.event, "sending again a state change whose answer was lost");
        let transfer = self
            .advance(transfer, change.event, change.fields.clone())
            .await?;
        self.unanswered.answered(transfer.id, change);
        Ok(transfer)
    }

    /// A guarded account step matched nothing and a re-read shows no reason to refuse
    /// it: the balance moved in between, or our lease ran out. Renews the lease and says
    /// whether we still own the transfer.
    async fn renew(&self, t: &mut Transfer) -> StoreResult<bool> {
        match self
            .log_store(t)?
            .transfers()
            .renew_lease(self.owner(), t.id, t.state)
            .await?
        {
            Some(now) => {
                t.last_modified = t.last_modified.max(now);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Frees the reservations that `account` (as read after a step it refused) still
    /// carries on `side` for holds past their `expiresAt` by the database's clock and not
    /// captured: reads no longer count them, so neither may a step. On the source side
    /// that is money a debit or reservation needs (`pendingDebits`), on the destination
    /// side room a credit or reservation needs under `MAX_MONEY` (`pendingCredits`).
    /// Expires those still `held` and releases the account's reservation of each, as the
    /// sweeper would, without waiting for their other accounts (see
    /// `Driver::free_expired_reservation`). Whether any was freed since that read:
    /// the step is worth trying again.
    ///
    /// Holds are asked of `own`, the account's deployment, first (a one-leg hold out of
    /// the account is logged there), then of every other deployment's log at once (a hold
    /// into the account is logged where its source lives, a multi-leg one where its first
    /// leg's source lives), but only for an account that reserves something on that side.
    /// A log that is known not to answer, or does not answer the lookup within
    /// [`OTHER_LOGS_LIMIT`], is passed over (as reads pass it over): a refusal of a step
    /// that touches only answering deployments does not wait for another one's time-outs.
    async fn expire_holds_reserving(
        &self,
        own: &Store,
        account: Option<&Account>,
        side: Side,
    ) -> StoreResult<bool> {
        let reserves = |a: &&Account| match side {
            Side::Source => a.pending_debits > 0,
            Side::Destination => a.pending_credits > 0,
        };
        let Some(account) = account.filter(reserves) else {
            return Ok(false);
        };
        let found = expired_reserving(own, account, side).await?;
        let mut freed = self.free_all(found, account, side).await?;
        let others = self.deployments.all().iter().filter(|store| {
            store.deployment() != own.deployment() && store.check_answering().is_ok()
        });
        let looked = futures::future::join_all(others.map(|store| async move {
            let found =
                tokio::time::timeout(OTHER_LOGS_LIMIT, expired_reserving(store, account, side));
            (store, found.await)
        }));
        for (store, found) in looked.await {
            let freed_here = match found {
                Ok(Ok(holds)) => self.free_all(holds, account, side).await,
                Ok(Err(e)) => Err(e),
                Err(_) => Err(StoreError::Unavailable(
                    format!("no answer within {OTHER_LOGS_LIMIT:?}").into(),
                )),
            };
            match freed_here {
                Ok(here) => freed |= here,
                Err(e) => {
                    tracing::warn!(deployment = %store.deployment(), account = %account.id, error = %crate::error_chain::Chain(&e), "expired holds of this log not looked for; a step may be refused until the sweeper expires them");
                }
            }
        }
        Ok(freed)
    }

    /// Frees `account`'s reservation on `side` of each of `holds` (see
    /// [`Driver::expire_holds_reserving`]); whether any was freed.
    async fn free_all(
        &self,
        holds: Vec<Transfer>,
        account: &Account,
        side: Side,
    ) -> StoreResult<bool> {
        let mut freed = false;
        // The lookup took only holds whose marker the account carries.
        for hold in holds {
            if self
                .free_expired_reservation(hold, &account.id, side)
                .await?
            {
                freed = true;
            }
        }
        Ok(freed)
    }

    /// Waits until no copy of a forward step this process sent earlier, in this run or
    /// another, can land any more (see `Driver::prepare_on`): before a marker is
    /// pulled or undone, a late copy would find nothing to stop it. Waits at most 0.9 of a
    /// lease, only after an attempt that failed without an answer. By the clock of
    /// `transfer`'s log.
    async fn wait_until_quiet(&self, transfer: &Transfer) -> StoreResult<()> {
        let Some(until) = self.unanswered.late_until(transfer.id) else {
            return Ok(());
        };
        let log = self.log_store(transfer)?;
        loop {
            let now = log.server_time_lower_bound().await?;
            if now > until {
                self.unanswered.passed(transfer.id, until);
                return Ok(());
            }
            let left = (until - now).to_std().unwrap_or_default();
            tokio::time::sleep(left + std::time::Duration::from_millis(1)).await;
        }
    }

    /// `pending -> canceling`, storing why, and which account refused a multi-leg
    /// transfer's step.
    pub(super) async fn begin_rollback_at(
        &self,
        transfer: Transfer,
        reason: CancelReason,
        refused_account: Option<AccountId>,
    ) -> StoreResult<Transfer> {
        tracing::info!(transfer_id = %transfer.id, %reason, refused_account = ?refused_account.as_ref().map(AccountId::as_str), "rolling back");
        let fields = StepFields {
            reason: Some(reason),
            refused_account,
            fenced: reason == CancelReason::CanceledByRequest,
            ..StepFields::default()
        };
        self.advance(transfer, TransferEvent::BeginRollback, fields)
            .await
    }

    /// Takes `event` with one write guarded by the expected state and by our ownership
    /// ([`Mover::Owner`]). If it loses, the transfer moved on without us (or was taken
    /// over): re-read it and let the caller continue from its new state.
    pub(super) async fn advance(
        &self,
        mut transfer: Transfer,
        event: TransferEvent,
        fields: StepFields,
    ) -> StoreResult<Transfer> {
        let from = transfer.state;
        let to = next_state(&transfer, event);
        let won = match self
            .log_store(&transfer)?
            .transfers()
            .change_state(
                transfer.id,
                from,
                to,
                Mover::Owner(self.owner()),
                fields.clone(),
            )
            .await
        {
            Ok(won) => won,
            Err(e) => {
                let change = StateChange {
                    from,
                    event,
                    fields,
                };
                self.unanswered.note_state_change(transfer.id, change);
                return Err(e);
            }
        };
        let Some(now) = won else {
            return self.reload(&transfer).await;
        };
        tracing::info!(transfer_id = %transfer.id, from = %from, to = %to, "transfer state changed");
        transfer.state = to;
        transfer.last_modified = transfer.last_modified.max(now);
        transfer.owner = Some(self.owner().to_owned());
        if fields.reason.is_some() {
            transfer.reason = fields.reason;
            transfer.refused_account = fields.refused_account;
        }
        crate::metrics::transfer_finished(to, transfer.reason);
        if transfer.hold.is_some() {
            crate::metrics::hold_finished(to, transfer.reason);
        }
        match to {
            TransferState::Pending => failpoint!(self, AfterPending),
            TransferState::Applied => failpoint!(self, AfterApplied),
            TransferState::Canceling => failpoint!(self, AfterCanceling),
            TransferState::Held => failpoint!(self, AfterHeld),
            _ => {}
        }
        Ok(transfer)
    }

    pub(super) async fn reload(&self, transfer: &Transfer) -> StoreResult<Transfer> {
        let found = self
            .log_store(transfer)?
            .transfers()
            .transfer(transfer.id)
            .await?;
        // A transfer is never deleted, and a step holds only one the majority has.
        Ok(found.unwrap_or_else(|| panic!("bug: transfer {} vanished", transfer.id)))
    }
}

fn contended(t: &Transfer) -> StoreError {
    StoreError::contended(
        Some(t.id),
        format!(
            "transfer {}: account step kept losing to concurrent updates",
            t.id
        ),
    )
}

/// The state `event` takes `transfer` to. The protocol only asks for events its state
/// allows, so anything else is a bug, and said as one (TigerBeetle's assertions).
pub(super) fn next_state(transfer: &Transfer, event: TransferEvent) -> TransferState {
    transfer
        .state
        .transition(event)
        .unwrap_or_else(|e| panic!("bug: transfer {}: {e}", transfer.id))
}

/// How long a refused step waits for another deployment's log to say which expired holds
/// it keeps on the account ([`Driver::expire_holds_reserving`]): half the
/// watcher's ping limit. A healthy log answers the indexed lookup in milliseconds (the
/// bound leaves room for a loaded machine: a log passed over only costs a refusal that
/// the sweeper's expiry would have spared); one frozen since the watcher's last ping would
/// hold the answer until the driver's time-out.
const OTHER_LOGS_LIMIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The holds logged on `store`, past their `expiresAt` by its clock and not captured, of
/// which `account` (as read after the refusal) still carries a reservation on `side`.
async fn expired_reserving(
    store: &Store,
    account: &Account,
    side: Side,
) -> StoreResult<Vec<Transfer>> {
    let now = store.server_time_lower_bound().await?;
    let markers = &account.pending_transactions;
    store
        .transfers()
        .expired_holds_reserving(&account.id, side, markers, now, 100)
        .await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::service::tests::offline_service;

    /// A step carried over to another deployment's clock takes off a tenth of the lease
    /// for a jump of either clock between two readings (`Store::deadline_on`, whose own
    /// test steps a clock back within the allowance): with none, a clock stepped back
    /// would let a step land after its lease. The allowance is what the protocol and a
    /// cancel's fences pass.
    #[tokio::test]
    async fn the_allowance_for_a_clock_jump_is_a_tenth_of_the_lease() {
        let service = offline_service(Duration::from_secs(2)).await;
        assert_eq!(
            service.driver().clock_allowance(),
            Duration::from_millis(200)
        );
    }
}
