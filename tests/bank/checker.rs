//! The checker: the history of what the clients saw ([`history`]), the invariants
//! checked during the run ([`sample_accounts`]) and, once everything is quiet
//! ([`wait_for_the_end`]), over every deployment at once ([`check_all`]), and the report
//! and verdict of the run ([`report`]). Once quiet, it reads every deployment (accounts,
//! transfer log, idempotency keys) and checks:
//!
//! - every account is stored once, on the deployment it was opened on; every transfer is
//!   in one log only, its source account's deployment's, and names its destination's
//!   deployment (transfer ids are unique across the logs);
//! - the total balance is unchanged and no balance is negative;
//! - every transfer is terminal (every hold captured, voided or expired: they all expire
//!   within seconds) and no `pendingTransactions` entry is left;
//! - every balance equals its opening balance plus the `done` transfers into it minus the
//!   `done` transfers out of it (a captured hold moved its captured `amount`), so no money
//!   moved outside a finished transfer;
//! - no account keeps `pendingDebits` or `pendingCredits`, and the two sums are equal;
//! - during the run, every [`SAMPLE_EVERY_MS`] ms, every account read straight from its
//!   deployment (each read on its own, so that one down leaves the others sampled) has a non-negative balance and pending sums, an available balance
//!   (`balance - pendingDebits`) that is not negative, and `balance + pendingCredits` at
//!   most 2^53-1 (the two sums are written in two account writes, so their equality is
//!   only checked at the end);
//! - no idempotency key was answered with two transfers or recorded twice in a log (a key
//!   is unique per source deployment; as no client uses a key with two sources, none is
//!   recorded in two logs either), every key answered with a transfer is recorded on that
//!   very transfer in its source's log, and every recorded key is taken
//!   (`idempotencyKeys`) in the same log for that transfer;
//! - every transfer was asked for by a client (each request carries a unique `reference`)
//!   and matches that request (a hold: `heldAmount` is the amount asked for, and its
//!   `amount` is the held one, or once captured the captured one, at most the held one);
//!   no request made two transfers;
//! - reversals: each points to an original that is `done`, mirrors it (same amount,
//!   accounts swapped), and once `done` is the original's `reversedBy`; an original has at
//!   most one `done` reversal, and its `reversedBy` names a `done` reversal of it; no
//!   transfer is left `reversing`;
//! - every `canceled` transfer has a `reason`;
//! - once a whole lease and a few sweeps have passed, no account keeps a
//!   `fencedTransactions` entry and no transfer keeps its `fenced` flag;
//! - every answer a client got agrees with the final state: 201 is `done`; 422 with a
//!   `transferId` is `canceled` with that reason; 409 `transfer_canceled` is `canceled` by
//!   request; a cancel answered `canceled` is `canceled` with the answered reason; a
//!   cancel answered `done` with `reversedBy` has that reversal `done`; a cancel refused
//!   with `insufficient_funds` leaves the original `done` and not reversed by the refused
//!   attempt; a 202 ends terminal;
//! - every answer about a hold agrees with the final state: 201 `held` is stored as that
//!   hold (held amount, `expiresAt`) and ends captured, voided or expired; a replay
//!   answered 201 `done` ends `done` with the answered amount; 409 `transfer_canceled`
//!   ends `canceled` by request, voided or expired; a capture answered 200 with amount M
//!   ends `done` with amount M, and was sent before `expiresAt`; a void answered 200 ends
//!   `canceled` with the answered reason (`voided` or `expired`); 409
//!   `hold_already_captured` ends `done` (for a capture: with another amount than the one
//!   it asked for, so a retried capture answers its own result); `hold_voided` ends
//!   `canceled` (`voided`); `hold_expired` ends `canceled` (`expired`) and was answered
//!   after `expiresAt`; and all the answers about one hold name at most one winner
//!   (captured with one amount, voided, expired or canceled);
//! - only the problem codes this scenario can legitimately produce are answered (any
//!   other 4xx or 5xx is a violation), and requests that never got a definitive answer are
//!   counted and looked up at the end (their transfer, if recorded, must be terminal);
//! - while a database server was down (from its kill to its restart), no transfer request
//!   touching its deployment was answered `done` unless as a replay (which reads only the
//!   source's log), and, across three deployments, transfers between the two others
//!   were;
//! - the ledger ([`ledger`], with the checks of `support::ledger`): during the run, every
//!   account document agrees with its last entry in each read, and balances asked as of
//!   a time are kept; at the end, every account's entries are numbered without gaps,
//!   each the one before plus its changes, the last one the account's amounts and `seq`;
//!   no step of a transfer is entered twice on an account, nor an undo, a release or a
//!   capture before its forward step; every transfer has the entries its end calls for,
//!   with its amounts (a done transfer its debit and its credit, a rollback nothing or
//!   its debit and its undo, a hold its reservations and their capture or release); the
//!   latest balances sum to the opening total; every balance asked during the run is what
//!   the entries say for its moment; and the API answers the stored entries;
//! - the event feed ([`events`]), read through the API once it has caught up: every
//!   finished transfer of the logs has one event of its end (`transfer.done` or
//!   `transfer.canceled`) with the transfer as the log ends it, every account one
//!   `account.opened`; `transfer.held` only for holds, at most once, with the held amount;
//!   no event twice, none about anything not in the books; each deployment's events in
//!   the feed in its stored order, every page's `next` at the last of them.

pub mod answers;
pub mod events;
pub mod history;
pub mod ledger;
pub mod report;
pub mod requests;
pub mod stored;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use transfer_service::domain::{Account, MAX_MONEY, Transfer, TransferId};

use crate::deployments::{Books, KeyRecord};
use crate::{STALE_AFTER_MS, SWEEP_INTERVAL_MS};
use answers::{WhileDown, check_answer, check_hold_winners, check_outage};
use ledger::LedgerSeen;
use report::Report;
use requests::check_requests;
use stored::{check_balances, check_ends, check_placement, check_reversals};

/// How often the sampler reads every account during the run.
const SAMPLE_EVERY_MS: u64 = 200;

/// The invariants checked, each with how many times, and what broke them: the ledger's
/// checks (`support::ledger`) and the bank's own are counted and worded alike.
pub use support::ledger::Findings as Checks;

/// What the sampler checked during the run ([`sample_accounts`]).
pub struct Sampled {
    pub checks: Checks,
    /// Reads of a deployment's accounts that were complete...
    pub samples: u64,
    /// ...and those that failed (the database restarting).
    pub failed: u64,
}

/// Reads every account straight from the store every [`SAMPLE_EVERY_MS`] until `stop`,
/// and checks what must hold of each at every moment: the balance and the pending sums
/// are not negative, the available balance is not negative, and every capture could land
/// (`balance + pendingCredits <= MAX_MONEY`). The two sums are written by two account
/// writes, so their equality is left to the end. Each deployment is read on its own, so
/// that one restarting leaves the others sampled.
pub async fn sample_accounts(books: Books, stop: CancellationToken) -> Sampled {
    let mut checks = Checks::default();
    let (mut samples, mut failed) = (0, 0);
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(Duration::from_millis(SAMPLE_EVERY_MS)) => {}
        }
        let reads = books.stores.iter().map(|store| {
            tokio::time::timeout(
                Duration::from_secs(2),
                store.accounts().list_accounts(None, None, 1000),
            )
        });
        let mut accounts = Vec::new();
        for read in futures::future::join_all(reads).await {
            match read {
                Ok(Ok(read)) => {
                    samples += 1;
                    accounts.extend(read);
                }
                _ => failed += 1,
            }
        }
        for a in &accounts {
            check_sampled(a, &mut checks);
        }
    }
    Sampled {
        checks,
        samples,
        failed,
    }
}

/// What must hold of account `a` at every moment of the run.
fn check_sampled(a: &Account, checks: &mut Checks) {
    checks.check(
        "sampled during the run: no negative balance or pending sum",
        a.balance >= 0 && a.pending_debits >= 0 && a.pending_credits >= 0,
        || format!("{a:?}"),
    );
    checks.check(
        "sampled during the run: available balance never negative",
        a.balance - a.pending_debits >= 0,
        || {
            format!(
                "{} has balance {} and pendingDebits {}: {a:?}",
                a.id, a.balance, a.pending_debits
            )
        },
    );
    checks.check(
        "sampled during the run: balance + pendingCredits <= 2^53-1",
        a.balance
            .checked_add(a.pending_credits)
            .is_some_and(|sum| sum <= MAX_MONEY),
        || {
            format!(
                "{} has balance {} and pendingCredits {}: {a:?}",
                a.id, a.balance, a.pending_credits
            )
        },
    );
}

/// What is stored once the load stopped and everything is quiet, and how long that took.
pub struct End {
    pub transfers: Vec<Transfer>,
    pub accounts: Vec<Account>,
    /// From the load's stop until every transfer was terminal...
    pub terminal_after: Duration,
    /// ...and from then until nothing was left moving (or the deadline).
    pub at_rest_after: Duration,
}

/// Waits until every transfer is terminal (a lease, a few sweeps, and the backlog; every
/// hold left held expires within seconds), then until the housekeeping is done
/// ([`not_at_rest`]); reads what is stored then.
pub async fn wait_for_the_end(books: &Books) -> End {
    let load_stopped = Instant::now();
    let quiet_deadline = load_stopped + Duration::from_secs(60);
    loop {
        let (transfers, _) = books.snapshot().await;
        if transfers.iter().all(|t| t.state.is_terminal()) {
            break;
        }
        assert!(
            Instant::now() < quiet_deadline,
            "transfers still unfinished a minute after the load stopped"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let terminal_after = load_stopped.elapsed();
    // Then the housekeeping: within a whole lease and a few sweeps (with their jitter)
    // the sweepers finish interrupted reversals and drop every fence. Bounded; what is
    // left at the deadline is a violation below.
    let rest_for = Duration::from_millis(STALE_AFTER_MS + 5 * SWEEP_INTERVAL_MS * 6 / 5)
        + Duration::from_secs(1);
    let rest_started = Instant::now();
    let (transfers, accounts) = loop {
        let (transfers, accounts) = books.snapshot().await;
        let left = not_at_rest(&transfers, &accounts);
        if left.is_empty() || rest_started.elapsed() >= rest_for {
            if !left.is_empty() {
                println!(
                    "still not at rest {:?} after the load stopped: {left:#?}",
                    load_stopped.elapsed()
                );
            }
            break (transfers, accounts);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    End {
        transfers,
        accounts,
        terminal_after,
        at_rest_after: rest_started.elapsed(),
    }
}

/// What must be true once the sweepers have had a whole lease and a few passes after the
/// last transfer finished; empty when everything is at rest.
fn not_at_rest(transfers: &[Transfer], accounts: &[Account]) -> Vec<String> {
    let mut left = Vec::new();
    for t in transfers {
        if !t.state.is_terminal() {
            left.push(format!("transfer {} is {}", t.id, t.state));
        }
        if t.reversing {
            left.push(format!("transfer {} is still reversing", t.id));
        }
        if t.fenced {
            left.push(format!("transfer {} is still marked fenced", t.id));
        }
    }
    for a in accounts {
        if !a.fenced_transactions.is_empty() {
            left.push(format!("{} keeps fences {:?}", a.id, a.fenced_transactions));
        }
        if !a.pending_transactions.is_empty() {
            left.push(format!(
                "{} keeps markers {:?}",
                a.id, a.pending_transactions
            ));
        }
        if a.pending_debits != 0 || a.pending_credits != 0 {
            left.push(format!(
                "{} keeps pendingDebits {} and pendingCredits {}",
                a.id, a.pending_debits, a.pending_credits
            ));
        }
    }
    left
}

/// What the checks found: every invariant checked and what broke them, the requests
/// whose outcome the clients never learned (by kind), and what was answered while a
/// deployment was down.
pub struct Checked {
    pub checks: Checks,
    pub unknown: BTreeMap<&'static str, u64>,
    pub while_down: Option<WhileDown>,
}

/// Every check of the module doc over what the run's end found and what its clients
/// saw, with what the sampler found during the run, the ledger and the event feed. With
/// `same_clock` (the database servers run on this host) answers about holds are also
/// compared in time with their `expiresAt`.
pub fn check_all(
    report: &Report,
    key_records: &[KeyRecord],
    sampled: Sampled,
    ledger: &LedgerSeen,
    events: &events::EventsSeen,
    same_clock: bool,
) -> Checked {
    let (layout, history) = (report.layout, report.history);
    let (transfers, accounts) = (&report.end.transfers, &report.end.accounts);
    let mut checks = Checks {
        violations: history.violations.clone(),
        ..Checks::default()
    };
    for (invariant, n) in sampled.checks.counts {
        *checks.counts.entry(invariant).or_default() += n;
    }
    checks.violations.extend(sampled.checks.violations);
    check_placement(layout, transfers, accounts, &mut checks);
    check_balances(transfers, accounts, &mut checks);
    // An id in two logs is a violation above (check_placement); here one copy stands.
    let by_id: HashMap<TransferId, &Transfer> = transfers.iter().map(|t| (t.id, t)).collect();
    check_ends(transfers, &by_id, &history.done, &mut checks);
    check_reversals(transfers, &by_id, &mut checks);
    for answer in &history.seen {
        check_answer(answer, &by_id, same_clock, &mut checks);
    }
    check_hold_winners(&history.seen, &by_id, &mut checks);
    ledger::check(ledger, transfers, &mut checks);
    events::check(events, layout, transfers, accounts, &mut checks);
    let unknown = check_requests(layout, transfers, &by_id, key_records, history, &mut checks);
    let while_down = report
        .havoc
        .outage
        .as_ref()
        .map(|o| check_outage(layout, o, &history.seen, &mut checks));
    Checked {
        checks,
        unknown,
        while_down,
    }
}
