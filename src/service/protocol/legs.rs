//! The steps of a multi-leg transfer (`docs/legs.md`), the same code for a fresh transfer
//! and for one the sweeper or a cancel resumes:
//!
//! | state       | steps taken                                                        |
//! |-------------|--------------------------------------------------------------------|
//! | `pending`   | 3. prepare every party (debit a paying one, make room on a receiving one), 4. `pending -> applied`: the commit point |
//! | `applied`   | 5. settle every party (pay a receiving one in, pull every marker), 6. `-> done` |
//! | `canceling` | undo every prepared party, `canceling -> canceled`                 |
//!
//! The parties' writes of a step are sent together, so that the store gathers them (and
//! those of concurrent transfers) into one write per deployment. Each is one guarded
//! write on one account, as in the one-leg protocol.

use super::{ACCOUNT_STEP_ATTEMPTS, Refusal, TransferService, classify, contended};
use crate::domain::Side;
use crate::domain::{
    Account, Amount, CancelReason, Legs, MAX_MONEY, Party, Transfer, TransferEvent,
};
use crate::store::StoreResult;
use crate::store::transfers::StepFields;

/// What one party's prepare came to.
enum Prepared {
    /// The party carries the transfer's marker: prepared, by this write or an earlier one.
    Yes,
    /// Refused, for this reason: the transfer rolls back.
    Refused(CancelReason),
    /// Not applied, and nothing refuses it now: the account changed between the write
    /// and the read, or the lease ran out. Worth another round once the lease is renewed.
    Again,
    /// Refused for funds or room, but holds past their expiry reserved some of them, and
    /// were released: worth another round.
    Freed,
}

/// The legs of `transfer`, which the caller knows is a multi-leg transfer.
fn legs_of(transfer: &Transfer) -> &Legs {
    transfer
        .legs
        .as_deref()
        .unwrap_or_else(|| panic!("bug: transfer {} has no legs", transfer.id))
}

/// The first error of `results`, once all of them have ended.
fn first_error<T>(results: Vec<StoreResult<T>>) -> StoreResult<Vec<T>> {
    results.into_iter().collect()
}

impl TransferService {
    /// Steps 3 and 4: prepare every party, then `pending -> applied`, the commit point;
    /// or, if a party refuses, `pending -> canceling` with its reason and account.
    pub(super) async fn prepare_and_commit(&self, mut t: Transfer) -> StoreResult<Transfer> {
        let legs = legs_of(&t).clone();
        let mut waiting: Vec<&Party> = legs.parties().iter().collect();
        for _ in 0..ACCOUNT_STEP_ATTEMPTS {
            // Every attempt of the round has ended before anything is decided: a
            // rollback never starts while one of them may still land unseen.
            let rounds =
                futures::future::join_all(waiting.iter().map(|p| self.prepare_party(&t, p))).await;
            let outcomes = first_error(rounds)?;
            let mut again = Vec::new();
            let mut renew = false;
            for (party, outcome) in waiting.iter().zip(outcomes) {
                match outcome {
                    Prepared::Yes => {}
                    Prepared::Refused(reason) => {
                        let account = party.account.clone();
                        return self.begin_rollback_at(t, reason, Some(account)).await;
                    }
                    Prepared::Again => {
                        renew = true;
                        again.push(*party);
                    }
                    Prepared::Freed => again.push(*party),
                }
            }
            if again.is_empty() {
                failpoint!(self, AfterDebit);
                if t.hold.is_some() {
                    // As for one leg: no copy of a reservation may land after `held`.
                    self.wait_until_quiet(&t).await?;
                    return self
                        .advance(t, TransferEvent::Hold, StepFields::default())
                        .await;
                }
                return self
                    .advance(t, TransferEvent::MarkApplied, StepFields::default())
                    .await;
            }
            if renew && !self.renew(&mut t).await? {
                return self.reload(&t).await; // taken over
            }
            waiting = again;
        }
        Err(contended(&t))
    }

    /// One party's prepare, and if it did not land, why (read back from the account).
    /// An attempt that failed without an answer leaves in `unanswered` the deadline until
    /// which it may still land.
    async fn prepare_party(&self, t: &Transfer, party: &Party) -> StoreResult<Prepared> {
        let (log, store) = (self.log_store(t)?, self.deployments.of(&party.deployment)?);
        let deadline = self.lease_deadline(t);
        let deadline_there = log
            .deadline_on(deadline, store, self.clock_allowance())
            .await?;
        let (account, net) = (&party.account, party.net);
        let step = if t.hold.is_some() {
            store.reserve(account, t.id, net, deadline_there).await
        } else {
            store.prepare(account, t.id, net, deadline_there).await
        };
        let step = match step {
            Ok(step) => step,
            Err(e) => {
                self.unanswered.note_late(t.id, deadline);
                return Err(e);
            }
        };
        if step.uncertain_until.is_some() {
            self.unanswered.note_late(t.id, deadline);
        }
        if step.applied {
            return Ok(Prepared::Yes);
        }
        let found = store.account(&party.account).await?;
        let fits = |a: &Account| {
            if party.pays() {
                a.balance - a.pending_debits >= -party.net
            } else {
                a.balance + a.pending_credits + a.incoming <= MAX_MONEY - party.net
            }
        };
        Ok(match classify(found.as_ref(), t, fits) {
            Refusal::AlreadyApplied => Prepared::Yes,
            Refusal::Retry => Prepared::Again,
            Refusal::Fenced => Prepared::Refused(CancelReason::CanceledByRequest),
            Refusal::Missing => Prepared::Refused(CancelReason::AccountNotFound),
            // The expired holds reserving on the party's side, on any deployment's log.
            Refusal::Balance
                if self
                    .expire_holds_reserving(store, found.as_ref(), party_side(party))
                    .await? =>
            {
                Prepared::Freed
            }
            Refusal::Balance if party.pays() => Prepared::Refused(CancelReason::InsufficientFunds),
            Refusal::Balance => Prepared::Refused(CancelReason::BalanceOverflow),
        })
    }

    /// Steps 5 and 6, after the commit point: settle every party (a receiving one's
    /// money paid in out of its room, with its credit entry; every marker pulled), then
    /// `applied -> done`. Nothing refuses a settle: each is guarded by its marker alone.
    pub(super) async fn settle_and_finish(&self, t: Transfer) -> StoreResult<Transfer> {
        let legs = legs_of(&t);
        let settles = futures::future::join_all(legs.parties().iter().map(|p| async {
            let store = self.deployments.of(&p.deployment)?;
            if p.pays() {
                store.pull_marker(&p.account, t.id).await
            } else {
                store.settle(&p.account, t.id, p.net).await
            }
        }))
        .await;
        first_error(settles)?;
        failpoint!(self, AfterPull);
        self.advance(t, TransferEvent::MarkDone, StepFields::default())
            .await
    }

    /// The rollback: undo every party that carries the marker (a paying one's debit
    /// given back, with its undo entry; a receiving one's room given back), then
    /// `canceling -> canceled`. A hold's: every reservation released instead.
    pub(super) async fn roll_back_legs(&self, t: Transfer) -> StoreResult<Transfer> {
        if t.hold.is_some() {
            return self.release_legs(t).await;
        }
        let legs = legs_of(&t);
        let undos = futures::future::join_all(legs.parties().iter().map(|p| async {
            let store = self.deployments.of(&p.deployment)?;
            if p.pays() {
                let paid = Amount::parse(-p.net)
                    .unwrap_or_else(|e| panic!("bug: transfer {}: a party's net: {e}", t.id));
                store.undo(&p.account, t.id, Side::Source, paid).await
            } else {
                store.release_room(&p.account, t.id, p.net).await
            }
        }))
        .await;
        first_error(undos)?;
        failpoint!(self, AfterUndoSource);
        self.advance(t, TransferEvent::FinishRollback, StepFields::default())
            .await
    }
}

impl TransferService {
    /// A multi-leg hold's capture, after `held -> capturing` (only ever of the whole):
    /// every party's reservation becomes its move (a paying one's balance out of its
    /// `pendingDebits`, a receiving one's in out of its `pendingCredits`, each with its
    /// entry, the marker pulled; a party whose net is zero loses its marker), then
    /// `capturing -> done`. Nothing refuses one: the reservation made room for it.
    pub(super) async fn capture_legs(&self, t: Transfer) -> StoreResult<Transfer> {
        let legs = legs_of(&t);
        let captures = futures::future::join_all(legs.parties().iter().map(|p| async {
            let store = self.deployments.of(&p.deployment)?;
            match reserved(&t, p)? {
                Some((side, held)) => {
                    store.capture(&p.account, t.id, side, held, held).await?;
                    Ok(())
                }
                None => store.pull_marker(&p.account, t.id).await,
            }
        }))
        .await;
        first_error(captures)?;
        failpoint!(self, AfterCaptureDestination);
        self.advance(t, TransferEvent::MarkDone, StepFields::default())
            .await
    }

    /// A multi-leg hold's void, expiry or rollback: every party's reservation released
    /// where it was made, the paying parties' first (their money is spendable at once,
    /// even while a receiving party's deployment does not answer), then
    /// `canceling -> canceled`.
    ///
    /// A reservation moves no money, so the order is free: a party whose release fails
    /// (its deployment does not answer) does not keep the others' from being released;
    /// the hold stays `canceling` until every one is.
    async fn release_legs(&self, t: Transfer) -> StoreResult<Transfer> {
        let legs = legs_of(&t);
        let mut failed = None;
        for paying in [true, false] {
            let releases = futures::future::join_all(
                legs.parties()
                    .iter()
                    .filter(|p| p.pays() == paying)
                    .map(|p| self.release_party(&t, p)),
            )
            .await;
            if let Err(e) = first_error(releases) {
                failed.get_or_insert(e);
            }
            failpoint!(self, AfterUndoSource);
        }
        if let Some(e) = failed {
            return Err(e);
        }
        self.advance(t, TransferEvent::FinishRollback, StepFields::default())
            .await
    }

    /// Releases what multi-leg hold `t` reserves on `party`, if it carries the marker.
    pub(in crate::service) async fn release_party(
        &self,
        t: &Transfer,
        party: &Party,
    ) -> StoreResult<()> {
        let store = self.deployments.of(&party.deployment)?;
        match reserved(t, party)? {
            Some((side, held)) => {
                store.release(&party.account, t.id, side, held).await?;
                Ok(())
            }
            None => store.pull_marker(&party.account, t.id).await,
        }
    }
}

/// The side `party` takes in the account steps: a paying party's are a source's (funds,
/// `pendingDebits`), a receiving party's a destination's (room, `pendingCredits`).
fn party_side(party: &Party) -> Side {
    if party.pays() {
        Side::Source
    } else {
        Side::Destination
    }
}

/// What a multi-leg hold reserves on `party`: the side of the reservation and its
/// amount, or `None` for a party whose net is zero (the marker alone).
fn reserved(t: &Transfer, party: &Party) -> StoreResult<Option<(Side, Amount)>> {
    if party.net == 0 {
        return Ok(None);
    }
    let side = party_side(party);
    let held = Amount::parse(party.net.abs())
        .unwrap_or_else(|e| panic!("bug: transfer {}: a party's net: {e}", t.id));
    Ok(Some((side, held)))
}
