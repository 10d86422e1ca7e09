//! Capturing and voiding holds (`docs/holds.md`).
//!
//! A `held` hold is resolved by one guarded write that anyone may make
//! (`Mover::Resolver`): `held -> capturing` (a capture, before `expiresAt` by the
//! database's clock) or `held -> canceling` (a void, stored `voided` before `expiresAt`
//! and `expired` from then on; an expiry, from then on). Of captures, voids, expiries and
//! cancels racing for one hold, exactly one wins that write; the others read what won
//! and answer it: the same result again when they asked for the same thing, a conflict
//! otherwise. Every answer rests on the stored state, never on the clock of one command
//! compared with another's: the database's clock may go backwards between two commands
//! (two routers, a failover), so a void is one write that cannot lose to the clock, and a
//! capture that lost to it expires the hold before it answers `hold_expired`.

use super::idempotency::REPLAY_WAIT;
use super::{Driver, Requests, ServiceError, ServiceResult};
use crate::domain::Side;
use crate::domain::{
    AccountId, Amount, CancelReason, Transfer, TransferEvent, TransferId, TransferState,
};
use crate::error_chain::Chain;
use crate::store::transfers::{Mover, Resolution, StepFields};
use crate::store::{StoreError, StoreResult};

/// Why a capture or a void cannot be made: the hold has gone another way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldConflict {
    /// The transfer is not a hold.
    NotAHold,
    /// A capture won (a different amount, or a void after it).
    AlreadyCaptured,
    /// A void or a cancel won.
    Voided,
    /// The hold expired before it was captured.
    Expired,
    /// The hold is still being reserved; try again shortly.
    Pending,
}

/// Rounds of a capture or void, at most: each re-reads the hold after another actor
/// moved it.
const ROUNDS: usize = 8;

impl Requests {
    /// Captures `amount` of hold `id` (all of it by default): it moves from the source
    /// to the destination and the rest of the reservation is released. Answers with the
    /// hold once `done`.
    pub async fn capture(&self, id: TransferId, amount: Option<Amount>) -> ServiceResult<Transfer> {
        self.admitted("capture", id, |service| async move {
            service.capture_admitted(id, amount).await
        })
        .await
    }

    /// Voids hold `id`: the whole reservation is released. Answers with the hold once
    /// `canceled` (reason `voided`, or `expired` if it expired first).
    pub async fn void(&self, id: TransferId) -> ServiceResult<Transfer> {
        self.admitted("void", id, |service| async move {
            service.void_admitted(id).await
        })
        .await
    }
}

impl Driver {
    /// Expires `hold`, found `held` past its `expiresAt`: voids it with reason `expired`
    /// and releases it, unless a capture, a void or another expiry won it first. Whether
    /// this call expired it. The sweeper's way; admitted by the caller.
    pub async fn expire(&self, hold: Transfer) -> StoreResult<bool> {
        let fields = StepFields {
            reason: Some(CancelReason::Expired),
            ..StepFields::default()
        };
        if !self
            .resolve_hold(&hold, TransferEvent::Void, Resolution::Expire, fields)
            .await?
        {
            return Ok(false);
        }
        // Boxed: a debit's run expires holds through here, and runs them (recursion).
        let ended = Box::pin(self.run(hold)).await?;
        Ok(ended.state == TransferState::Canceled)
    }

    /// Frees what `hold`, past its `expiresAt` and still `held` or `canceling`, keeps
    /// reserved on `account`'s `side`: on its source, for a debit that needs the money; on
    /// its destination, for a credit that needs the room under `MAX_MONEY` (reads already
    /// leave both out: `AccountBook::as_of_now`). Expires it first if it is still
    /// `held`; then releases that account's reservation without waiting for the other
    /// account's, whose deployment may be down, nor for the hold's owner, who may be dead.
    /// Whether `account` no longer carries it (released by this call or by anyone before).
    ///
    /// Why anyone may release an account of a `canceling` hold: the release is guarded by
    /// the hold's marker on the account alone, so of everyone who makes it (its owner, a
    /// recoverer, this call) exactly one lands, and no capture can race it (`canceling`
    /// only ever goes to `canceled`). No copy of a reservation can land after it either: a
    /// hold that came from `held` (expired, voided) had none in flight any more (see
    /// `Mover::Resolver`); one rolled back from `pending` by a cancel has every account
    /// fenced; one rolled back by its owner may still see its reservation land again, but
    /// the owner (or, after its lease, a recoverer) releases it only once no copy can land,
    /// and that later release takes it away again (a destination's only where the room is
    /// still there: a reservation into an account is guarded by `MAX_MONEY` as a credit
    /// is). Releasing a reservation moves no money, so the order of the releases does not
    /// matter.
    ///
    /// `account`'s reservation (a paying party's on the source side, a receiving party's
    /// on the destination side) first, then every other paying party's, as far as their
    /// deployments answer (a failure there is left to the hold's driver); whether
    /// `account` no longer carries it.
    pub(super) async fn free_expired_reservation(
        &self,
        hold: Transfer,
        account: &AccountId,
        side: Side,
    ) -> StoreResult<bool> {
        let reserves = |hold: &Transfer| {
            hold.parties().iter().any(|p| {
                p.account == *account
                    && match side {
                        Side::Source => p.net < 0,
                        Side::Destination => p.net > 0,
                    }
            })
        };
        if !reserves(&hold) {
            return Ok(false);
        }
        let mut hold = hold;
        let mut expired_here = false;
        if hold.state == TransferState::Held {
            let fields = StepFields {
                reason: Some(CancelReason::Expired),
                ..StepFields::default()
            };
            expired_here = self
                .resolve_hold(&hold, TransferEvent::Void, Resolution::Expire, fields)
                .await?;
            if !expired_here {
                hold = self.reload(&hold).await?;
            }
        }
        match hold.state {
            TransferState::Held if expired_here => {}
            TransferState::Canceling => {}
            // Released already.
            TransferState::Canceled => return Ok(true),
            // Captured (the capture takes the reservation), or not expired after all.
            _ => return Ok(false),
        }
        self.release_expired(&hold, account).await?;
        if expired_here {
            tracing::info!(transfer_id = %hold.id, %account, ?side, "hold expired before a step that needed what it reserved");
            // The rest of its release, as its new owner: the destination's deployment may
            // not answer, and then a sweeper finishes it once it does.
            let id = hold.id;
            if let Err(e) = Box::pin(self.run(hold)).await {
                tracing::warn!(transfer_id = %id, error = %Chain(&e), "an expired hold's release is left for the sweeper");
            }
        }
        Ok(true)
    }

    /// The releases of [`Driver::free_expired_reservation`], once `hold` is
    /// `canceling` (or this call expired it): `account`'s reservation, then every other
    /// paying party's, best effort.
    async fn release_expired(&self, hold: &Transfer, account: &AccountId) -> StoreResult<()> {
        let parties = hold.parties();
        if let Some(own) = parties.iter().find(|p| p.account == *account) {
            self.release_party(hold, own).await?;
        }
        for party in parties.iter().filter(|p| p.pays()) {
            if party.account == *account {
                continue;
            }
            if let Err(e) = self.release_party(hold, party).await {
                tracing::warn!(transfer_id = %hold.id, account = %party.account, error = %Chain(&e), "a paying party of an expired hold not released yet; the hold's driver releases it");
            }
        }
        Ok(())
    }
}

impl Requests {
    async fn capture_admitted(
        &self,
        id: TransferId,
        amount: Option<Amount>,
    ) -> ServiceResult<Transfer> {
        let mut transfer = self.driver.find_transfer(id).await?;
        for _ in 0..ROUNDS {
            let hold = transfer.hold.ok_or(ServiceError::Hold {
                conflict: HoldConflict::NotAHold,
                hold: id,
            })?;
            let wanted = amount.unwrap_or(hold.amount);
            if wanted > hold.amount {
                return Err(ServiceError::CaptureExceedsHold { held: hold.amount });
            }
            if transfer.legs.is_some() && wanted != hold.amount {
                return Err(ServiceError::PartialCaptureOfLegs { held: hold.amount });
            }
            transfer = match transfer.state {
                TransferState::Initial | TransferState::Pending => {
                    return Err(ServiceError::Hold {
                        conflict: HoldConflict::Pending,
                        hold: id,
                    });
                }
                TransferState::Held => self.capture_held(transfer, wanted).await?,
                TransferState::Capturing | TransferState::Done => {
                    if transfer.amount != wanted {
                        return Err(ServiceError::Hold {
                            conflict: HoldConflict::AlreadyCaptured,
                            hold: id,
                        });
                    }
                    // The same capture again: its result, once its driver has made it.
                    return self.driver.wait_until_at_rest(transfer, REPLAY_WAIT).await;
                }
                TransferState::Canceling | TransferState::Canceled => {
                    return Err(ServiceError::Hold {
                        conflict: voided_or_expired(&transfer),
                        hold: id,
                    });
                }
                TransferState::Applied => {
                    panic!("bug: hold {id} is applied, a state only a transfer takes")
                }
            };
        }
        // Only a hold that kept moving (or a clock that kept jumping) under the capture
        // gets here: its answer would not be the stored state's.
        Err(StoreError::contended(
            Some(id),
            format!("capture of hold {id}: the hold kept moving under it"),
        )
        .into())
    }

    /// One round of a capture of a `held` hold: `held -> capturing` for `wanted`, then
    /// its run; or, if another actor or the clock won, the hold as it now stands.
    async fn capture_held(&self, transfer: Transfer, wanted: Amount) -> StoreResult<Transfer> {
        let fields = StepFields {
            captured: Some(wanted),
            ..StepFields::default()
        };
        if self
            .driver
            .resolve_hold(
                &transfer,
                TransferEvent::Capture,
                Resolution::Capture,
                fields,
            )
            .await?
        {
            return self.driver.run(transfer).await;
        }
        let now = self.driver.reload(&transfer).await?;
        if now.state != TransferState::Held {
            return Ok(now);
        }
        // Still held, so the capture lost to the clock, not to a rival: the hold has
        // expired. It is expired here, so that the answer is the stored state's; if the
        // clock now says otherwise (it went backwards), the next round captures again.
        self.driver.expire(now).await?;
        self.driver.reload(&transfer).await
    }

    async fn void_admitted(&self, id: TransferId) -> ServiceResult<Transfer> {
        let transfer = self.driver.find_transfer(id).await?;
        if transfer.hold.is_none() {
            return Err(ServiceError::Hold {
                conflict: HoldConflict::NotAHold,
                hold: id,
            });
        }
        match transfer.state {
            // Still being reserved: rolled back like a canceled transfer.
            TransferState::Initial | TransferState::Pending => {
                self.cancel_admitted(id, CancelReason::Voided).await
            }
            TransferState::Held => self.void_held(transfer).await,
            TransferState::Capturing | TransferState::Done => Err(ServiceError::Hold {
                conflict: HoldConflict::AlreadyCaptured,
                hold: id,
            }),
            TransferState::Canceling | TransferState::Canceled => {
                self.driver.wait_until_at_rest(transfer, REPLAY_WAIT).await
            }
            TransferState::Applied => {
                panic!("bug: hold {id} is applied, a state only a transfer takes")
            }
        }
    }

    /// Voids a `held` hold (reason `voided`, or `expired` once past its `expiresAt`, as
    /// the write that resolves it finds the clock) and releases it; if a capture won
    /// meanwhile, answers [`HoldConflict::AlreadyCaptured`].
    pub(super) async fn void_held(&self, transfer: Transfer) -> ServiceResult<Transfer> {
        let id = transfer.id;
        if self
            .driver
            .resolve_hold(
                &transfer,
                TransferEvent::Void,
                Resolution::Void,
                StepFields::default(),
            )
            .await?
        {
            return Ok(self.driver.run(transfer).await?);
        }
        // A void loses only to another resolver: the hold is no longer `held`.
        let transfer = self.driver.reload(&transfer).await?;
        match transfer.state {
            TransferState::Capturing | TransferState::Done => Err(ServiceError::Hold {
                conflict: HoldConflict::AlreadyCaptured,
                hold: id,
            }),
            _ => self.driver.wait_until_at_rest(transfer, REPLAY_WAIT).await,
        }
    }
}

impl Driver {
    /// Takes `event` from `held` as whoever resolves the hold ([`Mover::Resolver`]), as
    /// `by` lets it by the database's clock. Whether this call made it.
    async fn resolve_hold(
        &self,
        transfer: &Transfer,
        event: TransferEvent,
        by: Resolution,
        fields: StepFields,
    ) -> StoreResult<bool> {
        let to = super::protocol::next_state(transfer, event);
        let by = Mover::Resolver {
            owner: self.owner(),
            by,
        };
        let moved = self
            .log_store(transfer)?
            .transfers()
            .change_state(transfer.id, TransferState::Held, to, by, fields.clone())
            .await?;
        if moved.is_some() {
            tracing::info!(transfer_id = %transfer.id, from = %TransferState::Held, to = %to, reason = ?fields.reason, captured = ?fields.captured.map(Amount::minor_units), "hold resolved");
            failpoint!(self, AfterResolve);
        }
        Ok(moved.is_some())
    }
}

/// Why a hold that went to `canceling` or `canceled` cannot be captured.
fn voided_or_expired(transfer: &Transfer) -> HoldConflict {
    match transfer.reason {
        Some(CancelReason::Expired) => HoldConflict::Expired,
        _ => HoldConflict::Voided,
    }
}
