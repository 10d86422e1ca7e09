//! The checker: what each actor got back ([`Answer`]), the record of a schedule
//! ([`Run`]), the invariants checked at its end ([`check`]), and how a violating
//! schedule is told ([`describe`]).
//!
//! After a schedule everything is let finish, a lease is let pass (by ageing the
//! schedule's transfers, which is safe once no actor is left, so no write is in flight)
//! and a sweep runs; then the invariants are checked over the schedule's accounts (a
//! and b; a, b and c in a multi-leg scenario): conservation, balances from the log (a
//! done hold moved its captured amount, a done multi-leg transfer each party's net), no
//! fences, no room of a multi-leg transfer left (`incoming`), at most one reversal,
//! mirroring its original (a multi-leg one every leg the other way round), and answers
//! that agree with the final state. For a transfer scenario also: no markers, every
//! transfer terminal; for a multi-leg one, every transfer multi-leg (the reversal too),
//! its parties the schedule's accounts, each named with the deployment that keeps it.
//! For a hold scenario instead: `pendingDebits` and `pendingCredits` of each account
//! are the held amounts of the holds still `held` out of and into it, its markers
//! exactly theirs, its available balance not negative, every other transfer terminal;
//! at most one hold, whose end is one a scenario's actor may have made (a capture for
//! `done`, and of all of it; an expiry for `expired`; a void or a cancel for `voided`
//! and `canceled_by_request`; only a cancel reverses a captured hold); a capture
//! answered with the hold means `done` with that amount, a void answered with it means
//! `canceled`, `AlreadyCaptured` means `done`, `Voided` means `canceled` voided or by
//! request, `Expired` means `canceled` expired, and an expiry whose sweep expired a
//! hold means `canceled` expired. A multi-leg hold (`hold:legs:`) the same, with each
//! party's reservation on its side (a paying party's net out, a receiving party's in, a
//! party whose net is zero its marker alone); and, told from the hold alone, each
//! party's balance moved by its net if the hold was captured (whole) and not reversed,
//! otherwise not at all, and nothing reserved on any party once it is no longer `held`.
//! A hold left `held` is voided after the check, so that no later schedule of the worker
//! sees it expire.
//!
//! And the ledger of the accounts (`support::ledger`): entries numbered without gaps,
//! each the one before plus its changes, the last one the account's amounts and `seq`;
//! no step of a transfer entered twice on an account, and no undo, release or capture
//! before its forward step; every transfer's entries those its state calls for, with its
//! amounts (a done transfer its debit and its credit, a rollback its debit and its undo
//! or nothing, a hold its reservations and their capture or release, a multi-leg
//! transfer one entry per party: a paying party's debit, undone by a rollback, a
//! receiving party's credit after the commit point); the latest balances summing to what
//! the accounts opened with.

use std::collections::HashMap;

use support::ledger::{self, Ledger};
use transfer_service::domain::{
    Account, AccountId, CancelReason, Transfer, TransferId, TransferState,
};
use transfer_service::service::{HoldConflict, ServiceError};

use crate::nemesis::Decision;
use crate::scenario::Scenario;
use crate::workload::{Kind, OPENING};

/// What an actor got back.
#[derive(Debug)]
pub enum Answer {
    Owner(Result<Transfer, String>),
    /// `None`: nothing recorded yet to cancel (so also for `Capture` and `Void`).
    Cancel(Result<Option<Transfer>, String>),
    Capture(Result<Option<Transfer>, Refused>),
    Void(Result<Option<Transfer>, Refused>),
    /// How many holds the sweep after the expiry expired (and saw released).
    Expire(Result<usize, String>),
    Sweep(Result<(), String>),
    /// How many held-back writes the network sent.
    Net(usize),
    /// An owner or a cancel answered that the database is unavailable (503): right for
    /// the actor whose step is held back (`held`), whose run failed; for any other a
    /// violation.
    Unavailable {
        held: bool,
        error: String,
    },
    Stuck,
}

/// Why a capture or a void was refused.
#[derive(Debug)]
pub enum Refused {
    Conflict(HoldConflict, TransferId),
    Other(String),
}

impl From<ServiceError> for Refused {
    fn from(e: ServiceError) -> Refused {
        match e {
            ServiceError::Hold { conflict, hold } => Refused::Conflict(conflict, hold),
            other => Refused::Other(format!("{other:?}")),
        }
    }
}

/// One schedule's run.
#[derive(Default)]
pub struct Run {
    /// Each real decision: which actor goes (two or more ready; option 0 is the actor
    /// that ran last when it is still ready, and then any other choice preempts it, then
    /// the others by index), and, in a `split:` scenario, which of its parts (option 0:
    /// all of them; see `nemesis`).
    pub decisions: Vec<Decision>,
    /// `actor@point` in the order the actors were let go from those points.
    pub trace: Vec<String>,
    pub answers: Vec<(Kind, Answer)>,
    pub violations: Vec<String>,
    /// Checks of the ledger made at the end, and the entries they read.
    pub ledger_checks: u64,
    pub ledger_entries: usize,
    /// Parts of an actor that reached their points after it was taken to be at rest
    /// (see `nemesis`): where the schedule is less exact than its choices say.
    pub late_parts: u64,
    /// Stops split: let go in part, the other parts left parked (see `nemesis`).
    pub splits: u64,
    /// Actors found still running after a split once taken to be at rest (see `nemesis`):
    /// where the schedule is less exact than its choices say.
    pub late_splits: u64,
}

impl Run {
    fn choices(&self) -> String {
        let c: Vec<String> = self
            .decisions
            .iter()
            .map(|d| d.chosen.to_string())
            .collect();
        c.join(",")
    }
}

/// Checks the end of a schedule of `scenario`, its accounts, their ledger and every
/// transfer touching them (read before the ledger), against what its actors got back;
/// what is wrong goes to `run`.
pub fn check(
    scenario: &Scenario,
    accounts: &[Account],
    transfers: &[Transfer],
    ledger: &Ledger,
    run: &mut Run,
) {
    let opened = accounts.len() as i64 * OPENING;
    let found = ledger::check_ledger(ledger, transfers, opened);
    run.ledger_checks += found.checked();
    run.ledger_entries += ledger.entry_count();
    run.violations.extend(found.violations);
    let v = &mut run.violations;
    check_accounts(scenario, accounts, transfers, v);
    check_legs(scenario, accounts, transfers, v);
    check_legs_hold(scenario, accounts, transfers, v);
    let by_id: HashMap<TransferId, &Transfer> = transfers.iter().map(|t| (t.id, t)).collect();
    check_transfers(transfers, v);
    if scenario.hold {
        check_winner(scenario, transfers, v);
    }
    for (kind, answer) in &run.answers {
        check_answer(*kind, answer, transfers, &by_id, v);
        check_answered_legs(*kind, answer, &by_id, v);
    }
}

/// A transfer an owner or a cancel answered with has the legs (and parties) stored.
fn check_answered_legs(
    kind: Kind,
    answer: &Answer,
    by_id: &HashMap<TransferId, &Transfer>,
    v: &mut Vec<String>,
) {
    let (Answer::Owner(Ok(t)) | Answer::Cancel(Ok(Some(t)))) = answer else {
        return;
    };
    let stored = by_id.get(&t.id).map(|s| &s.legs);
    if stored.is_some_and(|legs| *legs != t.legs) {
        v.push(format!(
            "{} answered {} with legs {:?}, stored {:?}",
            kind.name(),
            t.id,
            t.legs,
            stored
        ));
    }
}

/// Conservation; each balance from the log; a hold scenario's reservations and markers
/// ([`check_reservations`]), else no markers; no fences; no room of a multi-leg transfer.
fn check_accounts(
    scenario: &Scenario,
    accounts: &[Account],
    transfers: &[Transfer],
    v: &mut Vec<String>,
) {
    let total: i64 = accounts.iter().map(|x| x.balance).sum();
    let opened = accounts.len() as i64 * OPENING;
    if total != opened {
        v.push(format!("total {total} != {opened}"));
    }
    for acc in accounts {
        let mut expected = OPENING;
        for t in transfers.iter().filter(|t| t.state == TransferState::Done) {
            expected += done_change(t, &acc.id);
        }
        if acc.balance != expected {
            v.push(format!(
                "{}: balance {} != opening + done transfers {expected}",
                acc.id, acc.balance
            ));
        }
        if scenario.hold {
            check_reservations(acc, transfers, v);
        } else if !acc.pending_transactions.is_empty() {
            v.push(format!(
                "{}: pendingTransactions left {:?}",
                acc.id, acc.pending_transactions
            ));
        }
        if !acc.fenced_transactions.is_empty() {
            v.push(format!(
                "{}: fencedTransactions left {:?}",
                acc.id, acc.fenced_transactions
            ));
        }
        if acc.incoming != 0 {
            v.push(format!(
                "{}: incoming {} left (room of a multi-leg transfer)",
                acc.id, acc.incoming
            ));
        }
    }
}

/// What the done transfer `t` changed on `account`: a multi-leg transfer the account's
/// net as a party, any other its `amount` (a done hold's is the captured one) out of its
/// source and into its destination.
fn done_change(t: &Transfer, account: &AccountId) -> i64 {
    if let Some(legs) = t.legs.as_deref() {
        return legs.party(account).map_or(0, |p| p.net);
    }
    let mut change = 0;
    if t.source == *account {
        change -= t.amount.minor_units();
    }
    if t.destination == *account {
        change += t.amount.minor_units();
    }
    change
}

/// In a multi-leg scenario every transfer is multi-leg (the reversal too), each of its
/// parties one of the schedule's accounts, named with the deployment that keeps it; in
/// any other scenario none is.
fn check_legs(
    scenario: &Scenario,
    accounts: &[Account],
    transfers: &[Transfer],
    v: &mut Vec<String>,
) {
    for t in transfers {
        let Some(legs) = t.legs.as_deref() else {
            if scenario.legs {
                v.push(format!("transfer {} has no legs in {scenario}", t.id));
            }
            continue;
        };
        if !scenario.legs {
            v.push(format!("transfer {} has legs in {scenario}", t.id));
        }
        for party in legs.parties() {
            match accounts.iter().find(|a| a.id == party.account) {
                None => v.push(format!(
                    "transfer {}: party {} is not an account of the schedule",
                    t.id, party.account
                )),
                Some(a) if a.deployment != party.deployment => v.push(format!(
                    "transfer {}: party {} named on {}, but it lives on {}",
                    t.id, party.account, party.deployment, a.deployment
                )),
                Some(_) => {}
            }
        }
    }
}

/// Every transfer terminal (a hold may wait `held`), none left fenced or reversing, at
/// most one done reversal of each, and a done reversal is its original's `reversedBy`
/// and mirrors it (a multi-leg one has its original's legs each the other way round,
/// `Legs::reversed`, its parties on their deployments).
fn check_transfers(transfers: &[Transfer], v: &mut Vec<String>) {
    for t in transfers {
        // A hold may stay `held`, waiting for its client: nobody won it.
        let waiting = t.hold.is_some() && t.state == TransferState::Held;
        if !t.state.is_terminal() && !waiting {
            v.push(format!("transfer {} left {}", t.id, t.state));
        }
        if t.fenced {
            v.push(format!("transfer {} left fenced", t.id));
        }
        if t.reversing {
            v.push(format!("transfer {} left reversing", t.id));
        }
        if t.reverses.is_some() {
            continue;
        }
        let reversals: Vec<&Transfer> = transfers
            .iter()
            .filter(|r| r.reverses == Some(t.id) && r.state == TransferState::Done)
            .collect();
        if reversals.len() > 1 {
            v.push(format!(
                "transfer {} reversed {} times",
                t.id,
                reversals.len()
            ));
        }
        if let Some(r) = reversals.first() {
            if t.state != TransferState::Done || t.reversed_by != Some(r.id) {
                v.push(format!(
                    "reversal {} done but original {} is {} with reversedBy {:?}",
                    r.id, t.id, t.state, t.reversed_by
                ));
            }
            let legs_mirrored = match (r.legs.as_deref(), t.legs.as_deref()) {
                (None, None) => true,
                (Some(back), Some(legs)) => *back == legs.reversed(),
                _ => false,
            };
            if r.source != t.destination
                || r.destination != t.source
                || r.amount != t.amount
                || !legs_mirrored
            {
                v.push(format!("reversal {} does not mirror {}", r.id, t.id));
            }
        }
    }
}

/// What an actor of kind `kind` got back agrees with the end.
fn check_answer(
    kind: Kind,
    answer: &Answer,
    transfers: &[Transfer],
    by_id: &HashMap<TransferId, &Transfer>,
    v: &mut Vec<String>,
) {
    let state_of = |id: TransferId| by_id.get(&id).map(|t| t.state);
    match answer {
        Answer::Owner(Ok(t)) => {
            let now = state_of(t.id);
            if t.state.is_terminal() && now != Some(t.state) {
                v.push(format!(
                    "{} answered {} but it is {now:?}",
                    kind.name(),
                    t.state
                ));
            }
        }
        Answer::Owner(Err(e)) => v.push(format!("{} failed: {e}", kind.name())),
        Answer::Cancel(Ok(None)) => {} // nothing recorded yet to cancel
        Answer::Cancel(Ok(Some(t))) => check_cancel_answer(t, by_id, v),
        Answer::Cancel(Err(e)) => v.push(format!("cancel failed: {e}")),
        Answer::Capture(answer) | Answer::Void(answer) => {
            check_hold_answer(kind, answer, by_id, v);
        }
        Answer::Expire(Ok(expired)) => {
            let hold = transfers.iter().find(|t| t.hold.is_some());
            let ended = hold.map(|h| (h.state, h.reason));
            let expected = (TransferState::Canceled, Some(CancelReason::Expired));
            if *expired > 0 && ended != Some(expected) {
                v.push(format!(
                    "{} expired {expired} holds but the hold ended {ended:?}",
                    kind.name()
                ));
            }
        }
        Answer::Expire(Err(e)) => v.push(format!("{} failed: {e}", kind.name())),
        Answer::Sweep(Ok(())) => {}
        Answer::Sweep(Err(e)) => v.push(format!("{} failed: {e}", kind.name())),
        Answer::Net(_) => {}
        // Its run failed: the transfer is left for a later run, whose end the
        // checks above judge.
        Answer::Unavailable { held: true, .. } => {}
        Answer::Unavailable { held: false, error } => {
            v.push(format!("{} answered unavailable: {error}", kind.name()));
        }
        Answer::Stuck => v.push(format!("{} never answered", kind.name())),
    }
}

/// A cancel answered with the transfer `t`: `canceled` if it ends so, `done` only with a
/// `reversedBy` that is done and that the original names.
fn check_cancel_answer(t: &Transfer, by_id: &HashMap<TransferId, &Transfer>, v: &mut Vec<String>) {
    let state_of = |id: TransferId| by_id.get(&id).map(|t| t.state);
    match t.state {
        TransferState::Canceled => {
            if state_of(t.id) != Some(TransferState::Canceled) {
                v.push(format!(
                    "cancel answered canceled but it is {:?}",
                    state_of(t.id)
                ));
            }
        }
        TransferState::Done => match t.reversed_by {
            Some(r) => {
                if state_of(r) != Some(TransferState::Done) {
                    v.push(format!(
                        "cancel answered done reversed by {r}, which is {:?}",
                        state_of(r)
                    ));
                }
                if by_id.get(&t.id).and_then(|o| o.reversed_by) != Some(r) {
                    v.push(format!(
                        "cancel answered reversed by {r}, the original says {:?}",
                        by_id.get(&t.id).and_then(|o| o.reversed_by)
                    ));
                }
            }
            None => v.push("cancel answered done without reversedBy".into()),
        },
        other => v.push(format!("cancel answered {other}")),
    }
}

/// A hold scenario's account: its reservations and markers are exactly those of the
/// holds still `held` (every other transfer has ended), and its available balance is
/// not negative.
fn check_reservations(acc: &Account, transfers: &[Transfer], v: &mut Vec<String>) {
    let held: Vec<(TransferId, (i64, i64))> = transfers
        .iter()
        .filter(|t| t.state == TransferState::Held)
        .filter_map(|t| reserved_on(t, &acc.id).map(|r| (t.id, r)))
        .collect();
    let debits: i64 = held.iter().map(|(_, (out, _))| out).sum();
    let credits: i64 = held.iter().map(|(_, (_, into))| into).sum();
    if acc.pending_debits != debits {
        v.push(format!(
            "{}: pendingDebits {} != held holds out of it {debits}",
            acc.id, acc.pending_debits
        ));
    }
    if acc.pending_credits != credits {
        v.push(format!(
            "{}: pendingCredits {} != held holds into it {credits}",
            acc.id, acc.pending_credits
        ));
    }
    if acc.available_balance() < 0 {
        v.push(format!(
            "{}: available balance {} (balance {}, pendingDebits {})",
            acc.id,
            acc.available_balance(),
            acc.balance,
            acc.pending_debits
        ));
    }
    let mut markers = acc.pending_transactions.clone();
    markers.sort();
    let mut expected: Vec<TransferId> = held.iter().map(|(id, _)| *id).collect();
    expected.sort();
    if markers != expected {
        v.push(format!(
            "{}: pendingTransactions {markers:?} != the held holds touching it {expected:?}",
            acc.id
        ));
    }
}

/// What the hold `t` reserves on `account` while it is `held`, out of it and into it
/// (its `pendingDebits` and `pendingCredits`); `None` when it does not touch the
/// account. A one-leg hold: its amount out of its source and into its destination. A
/// multi-leg one: each party's net on its side, a paying party's out and a receiving
/// party's in; a party whose net is zero carries its marker only.
fn reserved_on(t: &Transfer, account: &AccountId) -> Option<(i64, i64)> {
    let held = t.hold?.amount.minor_units();
    match t.legs.as_deref() {
        Some(legs) => legs
            .party(account)
            .map(|p| if p.pays() { (-p.net, 0) } else { (0, p.net) }),
        None => {
            let out = if t.source == *account { held } else { 0 };
            let into = if t.destination == *account { held } else { 0 };
            (t.source == *account || t.destination == *account).then_some((out, into))
        }
    }
}

/// A multi-leg hold scenario: each party's balance moved by its net if the hold was
/// captured (and back if a cancel reversed that), otherwise not at all, told from the
/// hold alone rather than from every transfer's log; a capture took the whole of it;
/// and once the hold is no longer `held`, nothing is reserved on any party.
fn check_legs_hold(
    scenario: &Scenario,
    accounts: &[Account],
    transfers: &[Transfer],
    v: &mut Vec<String>,
) {
    if !(scenario.hold && scenario.legs) {
        return;
    }
    let hold = transfers
        .iter()
        .find(|t| t.hold.is_some() && t.legs.is_some());
    let state = hold.map(|h| h.state);
    let done = |id: TransferId| {
        transfers
            .iter()
            .any(|t| t.id == id && t.state == TransferState::Done)
    };
    let reversed = hold.and_then(|h| h.reversed_by).is_some_and(done);
    let moved = state == Some(TransferState::Done) && !reversed;
    if let Some(h) = hold.filter(|h| h.state == TransferState::Done) {
        let total = h.legs.as_deref().map(|l| l.moved());
        if Some(h.amount) != total {
            v.push(format!(
                "multi-leg hold {} captured {} of its legs' {total:?}",
                h.id,
                h.amount.minor_units()
            ));
        }
    }
    for acc in accounts {
        let party = hold.and_then(|h| h.legs.as_deref()?.party(&acc.id));
        let net = party.map_or(0, |p| p.net);
        let expected = OPENING + if moved { net } else { 0 };
        if acc.balance != expected {
            v.push(format!(
                "{}: balance {} != {expected}: the multi-leg hold ended {state:?} (reversed: {reversed}), its net here {net}",
                acc.id, acc.balance
            ));
        }
        let ended = state != Some(TransferState::Held);
        if ended && (acc.pending_debits != 0 || acc.pending_credits != 0) {
            v.push(format!(
                "{}: pendingDebits {}, pendingCredits {} left once the multi-leg hold ended {state:?}",
                acc.id, acc.pending_debits, acc.pending_credits
            ));
        }
    }
}

/// A hold scenario has at most one hold, and who won it (what it ended as) is one of the
/// scenario's actors that may: a capture for `done`, an expiry for `expired`, a void or a
/// cancel for `voided` and `canceled_by_request`; only a cancel reverses a captured hold.
fn check_winner(scenario: &Scenario, transfers: &[Transfer], v: &mut Vec<String>) {
    let holds: Vec<&Transfer> = transfers.iter().filter(|t| t.hold.is_some()).collect();
    if holds.len() > 1 {
        v.push(format!("{} holds recorded, not one", holds.len()));
    }
    let Some(h) = holds.first() else { return };
    let has = |kinds: &[Kind]| scenario.actors.iter().any(|k| kinds.contains(k));
    let held = h.hold.map(|x| x.amount);
    if let Some(r) = h.reversed_by {
        if !has(&[Kind::Cancel]) {
            v.push(format!(
                "hold {} captured and then reversed by {r}, but {scenario} has no cancel",
                h.id
            ));
        }
    }
    let may = match (h.state, h.reason) {
        (TransferState::Done, _) => {
            if Some(h.amount) != held {
                v.push(format!(
                    "hold {} captured {} of {held:?}, not all of it",
                    h.id,
                    h.amount.minor_units()
                ));
            }
            has(&[Kind::Capture])
        }
        (TransferState::Canceled, Some(CancelReason::Expired)) => has(&[Kind::Expire]),
        (TransferState::Canceled, Some(CancelReason::Voided | CancelReason::CanceledByRequest)) => {
            has(&[Kind::Void, Kind::Cancel])
        }
        (TransferState::Canceled, reason) => {
            v.push(format!("hold {} canceled for {reason:?}", h.id));
            true
        }
        _ => true, // still held (nobody won), or left unfinished (said above)
    };
    if !may {
        v.push(format!(
            "hold {} ended {} ({:?}) but no actor of {scenario} may have made that",
            h.id, h.state, h.reason
        ));
    }
}

/// A capture's or a void's answer agrees with how the hold ended: a capture answered with
/// the hold means `done` with that amount, a void answered with it means `canceled`; a
/// conflict names what won (`AlreadyCaptured`: `done`, reversed or not; `Voided`:
/// `canceled` voided or by request; `Expired`: `canceled` expired; `Pending`: nothing
/// was done).
fn check_hold_answer(
    kind: Kind,
    answer: &Result<Option<Transfer>, Refused>,
    by_id: &HashMap<TransferId, &Transfer>,
    v: &mut Vec<String>,
) {
    let name = kind.name();
    let ended = |id: &TransferId| by_id.get(id).map(|t| (t.state, t.reason, t.amount));
    match answer {
        Ok(None) => {} // nothing recorded yet
        Ok(Some(t)) => {
            let Some((state, reason, amount)) = ended(&t.id) else {
                v.push(format!("{name} answered {}, which is not recorded", t.id));
                return;
            };
            let agrees = match kind {
                Kind::Capture => {
                    state == TransferState::Done
                        && amount == t.amount
                        && matches!(t.state, TransferState::Capturing | TransferState::Done)
                }
                _ => {
                    state == TransferState::Canceled
                        && matches!(t.state, TransferState::Canceling | TransferState::Canceled)
                        && (t.state != TransferState::Canceled || t.reason == reason)
                }
            };
            if !agrees {
                let reversed = |r: Option<TransferId>| {
                    r.map(|r| format!(", reversed by {r}")).unwrap_or_default()
                };
                let now = by_id.get(&t.id).and_then(|h| h.reversed_by);
                v.push(format!(
                    "{name} answered {} {} ({:?}, amount {}{}) but the hold ended {state} ({reason:?}, amount {}{})",
                    t.id,
                    t.state,
                    t.reason,
                    t.amount.minor_units(),
                    reversed(t.reversed_by),
                    amount.minor_units(),
                    reversed(now),
                ));
            }
        }
        Err(Refused::Conflict(conflict, id)) => {
            let Some((state, reason, _)) = ended(id) else {
                v.push(format!(
                    "{name} answered {conflict:?} for {id}, not recorded"
                ));
                return;
            };
            if !conflict_agrees(*conflict, state, reason) {
                v.push(format!(
                    "{name} answered {conflict:?} but the hold ended {state} ({reason:?})"
                ));
            }
        }
        Err(Refused::Other(e)) => v.push(format!("{name} failed: {e}")),
    }
}

/// Whether a hold that ended `state` (`reason`) is what a capture or a void refused with
/// `conflict` says won it.
fn conflict_agrees(
    conflict: HoldConflict,
    state: TransferState,
    reason: Option<CancelReason>,
) -> bool {
    let canceled = |reasons: &[CancelReason]| {
        state == TransferState::Canceled && reason.is_some_and(|r| reasons.contains(&r))
    };
    match conflict {
        HoldConflict::AlreadyCaptured => state == TransferState::Done,
        HoldConflict::Voided => canceled(&[CancelReason::Voided, CancelReason::CanceledByRequest]),
        HoldConflict::Expired => canceled(&[CancelReason::Expired]),
        HoldConflict::Pending => true,
        HoldConflict::NotAHold => false,
    }
}

pub fn describe(scenario: &Scenario, run: &Run, seed: Option<u64>) -> String {
    let seed = seed
        .map(|s| format!("EXPLORE_SEED={s} "))
        .unwrap_or_default();
    format!(
        "{seed}EXPLORE_REPLAY='{scenario}/{}'\n    trace: {}\n    answers: {:?}\n    violations:\n      - {}",
        run.choices(),
        run.trace.join(" -> "),
        run.answers
            .iter()
            .map(|(k, a)| format!("{}: {}", k.name(), short(a)))
            .collect::<Vec<_>>(),
        run.violations.join("\n      - ")
    )
}

fn short(a: &Answer) -> String {
    let t = |t: &Transfer| {
        format!(
            "{} {}{}",
            t.id,
            t.state,
            t.reversed_by
                .map(|r| format!(" reversedBy {r}"))
                .unwrap_or_default()
        )
    };
    let t = |x: &Transfer| match (x.state, x.reason) {
        (TransferState::Canceled, Some(reason)) => format!("{} ({reason})", t(x)),
        (TransferState::Done, _) if x.hold.is_some() => {
            format!("{} (captured {})", t(x), x.amount.minor_units())
        }
        _ => t(x),
    };
    match a {
        Answer::Owner(Ok(x)) | Answer::Cancel(Ok(Some(x))) => t(x),
        Answer::Capture(Ok(Some(x))) | Answer::Void(Ok(Some(x))) => t(x),
        Answer::Cancel(Ok(None)) | Answer::Capture(Ok(None)) | Answer::Void(Ok(None)) => {
            "nothing recorded yet".into()
        }
        Answer::Capture(Err(Refused::Conflict(c, _)))
        | Answer::Void(Err(Refused::Conflict(c, _))) => {
            format!("{c:?}")
        }
        Answer::Owner(Err(e))
        | Answer::Cancel(Err(e))
        | Answer::Sweep(Err(e))
        | Answer::Expire(Err(e))
        | Answer::Capture(Err(Refused::Other(e)))
        | Answer::Void(Err(Refused::Other(e))) => e.clone(),
        Answer::Expire(Ok(n)) => format!("ok, expired {n}"),
        Answer::Sweep(Ok(())) => "ok".into(),
        Answer::Net(n) => format!("sent {n} held back"),
        Answer::Unavailable { error, .. } => format!("unavailable: {error}"),
        Answer::Stuck => "stuck".into(),
    }
}
