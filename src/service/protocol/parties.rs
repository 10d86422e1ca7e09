//! The protocol's steps on the accounts of a transfer, its parties ([`Transfer::parties`]:
//! a one-leg transfer's source and destination, a multi-leg transfer's accounts, each
//! once with its net change), the same code for every transfer, for a fresh one and for
//! one the sweeper or a cancel resumes:
//!
//! | state       | steps taken                                                        |
//! |-------------|--------------------------------------------------------------------|
//! | `pending`   | 3. prepare every party (debit a paying one, make room on a receiving one; a hold reserves instead), 4. `pending -> applied` (a hold's `-> held`): the commit point |
//! | `applied`   | 5. settle every party (pay a receiving one in, pull every marker), 6. `-> done` |
//! | `capturing` | a hold's capture: every party's reservation becomes its move, then `-> done` |
//! | `canceling` | undo every prepared party (a hold's: release every reservation), `-> canceled` |
//!
//! The parties' writes of a step are sent together, so that the store gathers them (and
//! those of concurrent transfers) into one write per deployment. Each is one guarded
//! write on one account.
//!
//! A one-leg transfer inserted before this protocol moved every transfer
//! ([`Transfer::pays_in_at_prepare`]) takes its parties in turn, the paying one first: its
//! receiving party's prepare is the credit itself, the commit point of that older
//! protocol, and may only land once the debit has; its settle then only pulls the
//! marker. A one-leg hold takes its parties in turn as well, and its capture moves
//! all or part of what it reserves.

use super::{ACCOUNT_STEP_ATTEMPTS, Driver, Refusal, classify, contended};
use crate::domain::Side;
use crate::domain::{
    Account, Amount, CancelReason, DeploymentName, MAX_MONEY, Party, Transfer, TransferEvent,
};
use crate::store::transfers::StepFields;
use crate::store::{Preparing, StoreResult};

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

/// What preparing a group of parties came to.
enum Round {
    /// Every party of the group is prepared.
    Prepared,
    /// The transfer moved on without us (a refusal rolled it back, another instance took
    /// it over): carry on from here.
    Moved(Box<Transfer>),
}

/// The first error of `results`, once all of them have ended.
fn first_error<T>(results: Vec<StoreResult<T>>) -> StoreResult<Vec<T>> {
    results.into_iter().collect()
}

/// The groups a step takes `t`'s parties in, one after the other: all at once, but for
/// a one-leg transfer that pays in at its prepare (see the module's doc), whose paying
/// party goes first, then its receiving one.
fn in_turn(t: &Transfer) -> Vec<Vec<Party>> {
    let parties = t.parties().into_owned();
    if !t.pays_in_at_prepare() {
        return vec![parties];
    }
    let (paying, receiving) = parties.into_iter().partition(Party::pays);
    vec![paying, receiving]
}

/// The parties of `parties` that pay (`paying`), or those that receive: the two groups
/// a rollback and a release take one after the other.
fn paying_or_not(parties: &[Party], paying: bool) -> impl Iterator<Item = &Party> {
    parties.iter().filter(move |p| p.pays() == paying)
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

/// `items` gathered by the deployment each names, in the order each deployment first
/// appears: a step's writes on one deployment go out together.
fn by_deployment<'d, T>(
    items: impl IntoIterator<Item = (&'d DeploymentName, T)>,
) -> Vec<(&'d DeploymentName, Vec<T>)> {
    let mut groups: Vec<(&DeploymentName, Vec<T>)> = Vec::new();
    for (deployment, item) in items {
        match groups.iter_mut().find(|(d, _)| *d == deployment) {
            Some((_, same)) => same.push(item),
            None => groups.push((deployment, vec![item])),
        }
    }
    groups
}

/// What `party`'s prepare does: a hold's reserves; the receiving party of a transfer
/// that pays in at its prepare is credited; any other's is debited or makes room.
fn preparing(t: &Transfer, party: &Party) -> Preparing {
    if t.hold.is_some() {
        Preparing::Reserve
    } else if t.pays_in_at_prepare() && !party.pays() {
        Preparing::Credit
    } else {
        Preparing::Prepare
    }
}

/// `minor` units as an amount: a party's net or a captured amount, which the transfer's
/// own checks keep within one (a bug otherwise).
fn amount(t: &Transfer, minor: i64) -> Amount {
    Amount::parse(minor).unwrap_or_else(|e| panic!("bug: transfer {}: a party's amount: {e}", t.id))
}

impl Driver {
    /// Steps 3 and 4: prepare every party, then `pending -> applied`, the commit point
    /// (a hold's `pending -> held`); or, if a party refuses, `pending -> canceling` with
    /// its reason (and, for a multi-leg transfer, its account).
    pub(super) async fn prepare_and_commit(&self, mut t: Transfer) -> StoreResult<Transfer> {
        for group in in_turn(&t) {
            if let Round::Moved(moved) = self.prepare_all(&mut t, &group).await? {
                return Ok(*moved);
            }
            if group.iter().any(Party::pays) {
                failpoint!(self, AfterDebit);
            }
        }
        failpoint!(self, AfterCredit);
        if t.hold.is_some() {
            // No copy of a reservation may land after `held`: whoever resolves the hold
            // moves it by the state guard alone (see `Mover::Resolver`).
            self.wait_until_quiet(&t).await?;
            return self
                .advance(t, TransferEvent::Hold, StepFields::default())
                .await;
        }
        self.advance(t, TransferEvent::MarkApplied, StepFields::default())
            .await
    }

    /// Prepares every party of `group` at once, in rounds until each is prepared or one
    /// refuses.
    async fn prepare_all(&self, t: &mut Transfer, group: &[Party]) -> StoreResult<Round> {
        let mut waiting: Vec<&Party> = group.iter().collect();
        for _ in 0..ACCOUNT_STEP_ATTEMPTS {
            let outcomes = self.prepare_round(t, &waiting).await?;
            let mut again = Vec::new();
            let mut renew = false;
            for (party, outcome) in outcomes {
                match outcome {
                    Prepared::Yes => {}
                    Prepared::Refused(reason) => {
                        // A one-leg transfer's refusal names its account by its reason.
                        let account = t.legs.is_some().then(|| party.account.clone());
                        let t = t.clone();
                        let rolled_back = self.begin_rollback_at(t, reason, account).await?;
                        return Ok(Round::Moved(Box::new(rolled_back)));
                    }
                    Prepared::Again => {
                        renew = true;
                        again.push(party);
                    }
                    Prepared::Freed => again.push(party),
                }
            }
            if again.is_empty() {
                return Ok(Round::Prepared);
            }
            if renew && !self.renew(t).await? {
                return Ok(Round::Moved(Box::new(self.reload(t).await?))); // taken over
            }
            waiting = again;
        }
        Err(contended(t))
    }

    /// One round of `parties`' prepares: those on one deployment in one write, the
    /// deployments' at once; then what each came to. Every write of the round has ended
    /// before anything is decided: a rollback never starts while one of them may still
    /// land unseen.
    async fn prepare_round<'p>(
        &self,
        t: &Transfer,
        parties: &[&'p Party],
    ) -> StoreResult<Vec<(&'p Party, Prepared)>> {
        let groups = by_deployment(parties.iter().map(|p| (&p.deployment, *p)));
        let rounds = groups.iter().map(|(_, same)| self.prepare_on(t, same));
        let rounds = first_error(futures::future::join_all(rounds).await)?;
        Ok(rounds.into_iter().flatten().collect())
    }

    /// The prepares of `parties`, all on one deployment, in one write; and for each one
    /// that did not land, why (read back from the account). A write that failed without
    /// an answer leaves in `unanswered` the deadline until which it may still land,
    /// whether the step then succeeded or failed.
    async fn prepare_on<'p>(
        &self,
        t: &Transfer,
        parties: &[&'p Party],
    ) -> StoreResult<Vec<(&'p Party, Prepared)>> {
        let (log, store) = (
            self.log_store(t)?,
            self.deployments.of(&parties[0].deployment)?,
        );
        // By the log's clock, which judges the lease; the accounts' deployment checks
        // the steps against its own clock (see `Store::deadline_on`).
        let deadline = self.lease_deadline(t);
        let deadline_there = log
            .deadline_on(deadline, store, self.clock_allowance())
            .await?;
        let steps: Vec<_> = parties
            .iter()
            .map(|p| (p.account.clone(), p.net, preparing(t, p)))
            .collect();
        // A copy that may still land does so before the log's clock reaches the lease
        // deadline.
        let sent = match store
            .accounts()
            .prepare_parties(t.id, deadline_there, &steps)
            .await
        {
            Ok(sent) => sent,
            Err(e) => {
                self.unanswered.note_late(t.id, deadline);
                return Err(e);
            }
        };
        if sent.iter().any(|step| step.uncertain_until.is_some()) {
            self.unanswered.note_late(t.id, deadline);
        }
        let mut outcomes = Vec::with_capacity(parties.len());
        for (party, step) in parties.iter().zip(sent) {
            let outcome = if step.applied {
                tracing::debug!(transfer_id = %t.id, account = %party.account, net = party.net, "account changed");
                Prepared::Yes
            } else {
                self.why_not_prepared(t, party).await?
            };
            outcomes.push((*party, outcome));
        }
        Ok(outcomes)
    }

    /// Why `party`'s prepare did not land, read back from its account.
    async fn why_not_prepared(&self, t: &Transfer, party: &Party) -> StoreResult<Prepared> {
        let store = self.deployments.of(&party.deployment)?;
        let found = store.accounts().account(&party.account).await?;
        // The invariants the step's guard keeps (`store::guards`).
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
            // Holds past their expiry no longer reserve anything, even before a sweeper
            // has released them: those on the party's side, on any deployment's log, are
            // released now, and the step tried again.
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
    /// A transfer that credited at its prepare only has its markers pulled.
    pub(super) async fn settle_and_finish(&self, t: Transfer) -> StoreResult<Transfer> {
        // One kind of write for every party, so that a deployment's are one write.
        let parties = t.parties();
        let groups = by_deployment(parties.iter().map(|p| {
            let pay_in = (!p.pays() && !t.pays_in_at_prepare()).then_some(p.net);
            (&p.deployment, (p.account.clone(), pay_in))
        }));
        let settles = futures::future::join_all(groups.iter().map(|(d, parties)| async {
            self.deployments
                .of(d)?
                .accounts()
                .settle_parties(t.id, parties)
                .await
        }))
        .await;
        first_error(settles)?;
        failpoint!(self, AfterPull);
        self.advance(t, TransferEvent::MarkDone, StepFields::default())
            .await
    }

    /// The rollback: undo every party that carries the marker, the receiving ones first
    /// (a receiving one's room given back; a paying one's debit given back, with its undo
    /// entry), then `canceling -> canceled`. A hold's: every reservation released
    /// instead ([`Driver::release`]).
    pub(super) async fn roll_back(&self, t: Transfer) -> StoreResult<Transfer> {
        if t.hold.is_some() {
            return self.release(t).await;
        }
        let parties = t.parties();
        for paying in [false, true] {
            let undos = futures::future::join_all(
                paying_or_not(&parties, paying).map(|p| self.undo_party(&t, p)),
            )
            .await;
            first_error(undos)?;
            failpoint!(self, if paying => AfterUndoSource else AfterUndoDestination);
        }
        self.advance(t, TransferEvent::FinishRollback, StepFields::default())
            .await
    }

    /// Undoes `party`'s prepare, if it carries the marker.
    async fn undo_party(&self, t: &Transfer, party: &Party) -> StoreResult<()> {
        let store = self.deployments.of(&party.deployment)?;
        if party.pays() {
            let paid = amount(t, -party.net);
            store
                .accounts()
                .undo(&party.account, t.id, Side::Source, paid)
                .await?;
        } else if t.pays_in_at_prepare() {
            // Never expected to find anything: that credit was the commit point, so a
            // rollback only began once it was refused (by the owner's own guard, or by a
            // cancel's fence placed only where the credit was not), and nothing can land
            // it afterwards. Kept so that a broken invariant still leaves the books
            // balanced, and said loudly.
            let credited = amount(t, party.net);
            if store
                .accounts()
                .undo(&party.account, t.id, Side::Destination, credited)
                .await?
            {
                tracing::error!(transfer_id = %t.id, "invariant broken: a transfer was rolled back after its credit had landed; the credit was taken back");
            }
        } else {
            store
                .accounts()
                .release_room(&party.account, t.id, party.net)
                .await?;
        }
        Ok(())
    }

    /// A hold's capture, after `held -> capturing`: every party's reservation becomes
    /// its move (a paying one's balance out of its `pendingDebits`, a receiving one's in
    /// out of its `pendingCredits`, each with its entry, the marker pulled; a party whose
    /// net is zero loses its marker), then `capturing -> done`. Nothing refuses one: the
    /// reservation made room for it. A one-leg hold's capture moves its captured amount,
    /// all or part of what it reserves; a multi-leg one's is always whole.
    pub(super) async fn capture_and_finish(&self, t: Transfer) -> StoreResult<Transfer> {
        let parties = t.parties();
        let captures = futures::future::join_all(parties.iter().map(|p| async {
            let store = self.deployments.of(&p.deployment)?;
            match reserved(&t, p) {
                Some((side, held)) => {
                    let captured = amount(&t, t.captured(p));
                    store
                        .accounts()
                        .capture(&p.account, t.id, side, held, captured)
                        .await?;
                    Ok(())
                }
                None => store.accounts().pull_marker(&p.account, t.id).await,
            }
        }))
        .await;
        first_error(captures)?;
        failpoint!(self, AfterCaptureSource);
        failpoint!(self, AfterCaptureDestination);
        self.advance(t, TransferEvent::MarkDone, StepFields::default())
            .await
    }

    /// A hold's void, expiry or rollback: every party's reservation released where it
    /// was made, the paying parties' first (their money is spendable at once, even while
    /// a receiving party's deployment does not answer), then `canceling -> canceled`.
    ///
    /// A reservation moves no money, so the order is free: a party whose release fails
    /// (its deployment does not answer) does not keep the others from being released;
    /// the hold stays `canceling` until every one is.
    async fn release(&self, t: Transfer) -> StoreResult<Transfer> {
        let mut failed = None;
        let parties = t.parties();
        for paying in [true, false] {
            let releases = futures::future::join_all(
                paying_or_not(&parties, paying).map(|p| self.release_party(&t, p)),
            )
            .await;
            if let Err(e) = first_error(releases) {
                failed.get_or_insert(e);
            }
            failpoint!(self, if paying => AfterUndoSource else AfterUndoDestination);
        }
        if let Some(e) = failed {
            return Err(e);
        }
        self.advance(t, TransferEvent::FinishRollback, StepFields::default())
            .await
    }

    /// Releases what hold `t` reserves on `party`, if it carries the marker.
    pub(in crate::service) async fn release_party(
        &self,
        t: &Transfer,
        party: &Party,
    ) -> StoreResult<()> {
        let store = self.deployments.of(&party.deployment)?;
        match reserved(t, party) {
            Some((side, held)) => {
                store
                    .accounts()
                    .release(&party.account, t.id, side, held)
                    .await?;
                Ok(())
            }
            None => store.accounts().pull_marker(&party.account, t.id).await,
        }
    }
}

/// What hold `t` reserves on `party`: the side of the reservation and its amount, or
/// `None` for a party whose net is zero (the marker alone).
fn reserved(t: &Transfer, party: &Party) -> Option<(Side, Amount)> {
    (party.net != 0).then(|| (party_side(party), amount(t, party.net.abs())))
}
