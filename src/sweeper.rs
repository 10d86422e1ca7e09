//! The recovery sweeper: finishes or rolls back what a crashed (or stuck) instance left
//! behind.
//!
//! [`sweep_once`] is one pass: find unfinished transfers whose owner's lease has lapsed
//! (no state change for `STALE_AFTER_MS` by the database's clock), claim each with one
//! guarded findAndModify, and drive it with the same step functions as a fresh transfer
//! ([`Bank::run`]): `initial` and `pending` go forward (a `pending` one whose debit or
//! credit is now refused rolls back with the reason), `applied` finishes its pulls,
//! `canceling` finishes its undo. Batches are bounded.
//!
//! A stale `initial` transfer is processed, not canceled: it was durably recorded with
//! the client's intent, a `Prefer: respond-async` client was told it would run, and a
//! client that lost the answer and retries with its idempotency key is answered with the
//! outcome. Only a cancel request cancels a transfer that has not failed.
//!
//! Each pass also keeps house, with the same bounded batches:
//! - It finishes reversals a crash interrupted (a done transfer whose `reversedBy` was
//!   claimed but whose compensation never finished), through the same code as a cancel.
//! - It drops the account fences of canceled transfers ([`collect_fences`]).
//! - It expires the holds past their `expiresAt` (`held -> canceling`, reason `expired`,
//!   then their release), by the database's clock.
//!
//! [`run`] does one pass at once at start-up, then a pass every `SWEEP_INTERVAL_MS` with
//! ±20% jitter so that instances started together do not sweep in lockstep. It stops
//! between transfers when cancelled. A restarted instance has a new owner name (see
//! [`Bank::owner`]) and takes its old transfers back like any other instance, once their
//! lease has lapsed: writes of the dead process may still be on their way until then.
//!
//! One transfer that fails (the database refused a step, say) is logged and left for the
//! next pass; the pass goes on with the others and with its housekeeping.
//!
//! With several deployments, a pass sweeps every deployment's log at once, each by its
//! own clock (a lease is judged by the clock of the deployment that logs the transfer).
//! A deployment that does not answer is skipped until the next pass; the others are swept
//! as usual.

use std::time::Duration;

use rand::Rng;
use tokio_util::sync::CancellationToken;

use crate::domain::Timestamp;
use crate::service::{Bank, ServiceError};
use crate::store::accounts::Side;
use crate::store::{Store, StoreResult};
use crate::telemetry::Chain;

/// Transfers claimed in one pass, at most.
pub const BATCH: u32 = 100;

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    /// Unfinished transfers found.
    pub found: usize,
    /// Of those, the ones this instance claimed (another may have claimed the rest).
    pub claimed: usize,
    /// Of those, the ones driven to `done` or `canceled`.
    pub finished: usize,
    /// Interrupted reversals brought to their end (compensation done, or claim released).
    pub reversals_finished: usize,
    /// Finished transfers whose account fences were dropped.
    pub fences_dropped: usize,
    /// Holds past their `expiresAt` that this pass expired and released.
    pub holds_expired: usize,
}

impl std::ops::AddAssign for SweepReport {
    fn add_assign(&mut self, other: SweepReport) {
        self.found += other.found;
        self.claimed += other.claimed;
        self.finished += other.finished;
        self.reversals_finished += other.reversals_finished;
        self.fences_dropped += other.fences_dropped;
        self.holds_expired += other.holds_expired;
    }
}

/// One pass of the sweeper over every deployment's log at once. Stops early, between
/// transfers, when `shutdown` is cancelled. Fails only if every deployment's pass failed.
pub async fn sweep_once(bank: &Bank, shutdown: &CancellationToken) -> StoreResult<SweepReport> {
    let passes = bank
        .deployments()
        .all()
        .iter()
        .map(|log| sweep_log(bank, log, shutdown));
    let passes = if one_at_a_time(bank) {
        let mut done = Vec::new();
        for pass in passes {
            done.push(pass.await);
        }
        done
    } else {
        futures::future::join_all(passes).await
    };
    let mut report = SweepReport::default();
    let mut failure = None;
    let mut swept = false;
    for (log, pass) in bank.deployments().all().iter().zip(passes) {
        match pass {
            Ok(one) => {
                report += one;
                swept = true;
            }
            Err(e) => {
                tracing::warn!(deployment = %log.deployment(), error = %Chain(&e), "sweep of a deployment failed; next pass");
                failure = failure.or(Some(e));
            }
        }
    }
    match failure {
        Some(e) if !swept => Err(e),
        _ => Ok(report),
    }
}

/// One pass over the transfers logged on `store`'s deployment.
async fn sweep_log(
    bank: &Bank,
    store: &Store,
    shutdown: &CancellationToken,
) -> StoreResult<SweepReport> {
    store.check_answering()?;
    let me = bank.owner();
    let lease_ms = bank.stale_after().as_millis() as i64;
    // By the database's clock; the claim re-checks it atomically.
    let now = store.server_time().await?;
    let stale_before = now - chrono::TimeDelta::milliseconds(lease_ms);
    let found = store.unfinished(stale_before, BATCH).await?;
    let mut report = SweepReport {
        found: found.len(),
        ..SweepReport::default()
    };
    // Each claimed transfer is driven in a task of its own, under the same admission
    // control as new transfers (waiting for a permit rather than being refused), so a
    // backlog is recovered as fast as the database allows, never faster than it admits.
    let mut runs = tokio::task::JoinSet::new();
    let sequential = one_at_a_time(bank);
    for candidate in found {
        if shutdown.is_cancelled() {
            break;
        }
        if bank.is_driving(candidate.id) {
            continue;
        }
        // Its other account's deployment does not answer (or is not migrated yet) for
        // this instance: claiming it would only renew a lease it cannot use, and keep an
        // instance that can from taking it.
        if bank.on(&candidate, Side::Destination).is_err() {
            continue;
        }
        let permit = bank.admit_waiting().await;
        let claimed = match store.claim(me, &candidate, stale_before).await {
            Ok(Some(claimed)) => claimed,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(transfer_id = %candidate.id, error = %Chain(&e), "claim failed; next pass");
                continue;
            }
        };
        report.claimed += 1;
        let bank = bank.clone();
        runs.spawn(async move {
            let _permit = permit;
            let from = claimed.state;
            let previous_owner = candidate.owner.unwrap_or_else(|| "-".into());
            match bank.run(claimed).await {
                Ok(finished) => {
                    tracing::info!(
                        transfer_id = %finished.id,
                        from = %from,
                        to = %finished.state,
                        previous_owner = %previous_owner,
                        "transfer recovered"
                    );
                    finished.state.is_terminal()
                }
                Err(e) => {
                    tracing::warn!(transfer_id = %candidate.id, error = %Chain(&e), "recovery interrupted; next pass");
                    false
                }
            }
        });
        if sequential {
            count_recovered(runs.join_next().await, &mut report);
        }
    }
    while let Some(ended) = runs.join_next().await {
        count_recovered(Some(ended), &mut report);
    }
    if !shutdown.is_cancelled() {
        match finish_reversals(bank, store, stale_before, shutdown).await {
            Ok(n) => report.reversals_finished = n,
            Err(e) => tracing::warn!(error = %Chain(&e), "finishing reversals failed; next pass"),
        }
        match collect_fences(bank, store, stale_before, shutdown).await {
            Ok(n) => report.fences_dropped = n,
            Err(e) => tracing::warn!(error = %Chain(&e), "collecting fences failed; next pass"),
        }
        match expire_holds(bank, store, now, shutdown).await {
            Ok(n) => report.holds_expired = n,
            Err(e) => tracing::warn!(error = %Chain(&e), "expiring holds failed; next pass"),
        }
    }
    Ok(report)
}

/// Counts a claimed transfer's run that `ended` (`true`: at its end) in `report`.
fn count_recovered(ended: Option<Result<bool, tokio::task::JoinError>>, report: &mut SweepReport) {
    if let Some(Ok(true)) = ended {
        report.finished += 1;
        crate::metrics::transfer_recovered();
    }
}

/// Whether a pass does one thing at a time: the deployments one after the other, and
/// each claimed transfer's run before the next claim. Only under a test's scheduler
/// (`failpoints::hooked`), which runs each actor as one sequence of points and lets one
/// point go at a time: two parts of one actor running at once would escape it.
fn one_at_a_time(bank: &Bank) -> bool {
    #[cfg(feature = "failpoints")]
    return crate::failpoints::hooked(bank.instance_id());
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = bank;
        false
    }
}

/// Finishes the reversals whose instance crashed after claiming them (`reversing` and
/// not touched for a lease). Returns how many reached their end.
async fn finish_reversals(
    bank: &Bank,
    store: &Store,
    stale_before: Timestamp,
    shutdown: &CancellationToken,
) -> StoreResult<usize> {
    let mut finished = 0;
    for original in store.unfinished_reversals(stale_before, BATCH).await? {
        if shutdown.is_cancelled() {
            break;
        }
        let id = original.id;
        match bank.finish_reversal(original).await {
            Ok(after) if !after.reversing => {
                finished += 1;
                tracing::info!(transfer_id = %id, reversed_by = ?after.reversed_by, "interrupted reversal finished");
            }
            Ok(_) => {} // another instance is driving the compensation
            Err(ServiceError::Unavailable(e) | ServiceError::Internal(e)) => {
                tracing::warn!(transfer_id = %id, error = %Chain(&e), "finishing a reversal failed; next pass");
            }
            Err(refused) => {
                finished += 1;
                tracing::info!(transfer_id = %id, reason = %refused, "interrupted reversal refused; claim released");
            }
        }
    }
    Ok(finished)
}

/// Drops the account fences of transfers canceled while pending, once no forward step
/// of theirs can land any more. Returns how many transfers it cleaned.
///
/// Why the fences can go after one lease: every forward account step of a transfer
/// carries the deadline `lastModified + 0.9 x STALE_AFTER_MS` of its driver's lease,
/// judged by the database's clock (`$$NOW`), and `lastModified` never moves backwards, so
/// no lease deadline is later than the canceled transfer's `lastModified` plus 0.9 x the
/// lease. Once the database's clock is past its `lastModified` plus a whole lease, every
/// late step is refused by its deadline, fence or no fence.
///
/// `store` is the deployment that logs the transfers; `stale_before` is by its clock,
/// which judged the fences' deadlines too (each account's deployment checked a deadline
/// carried over to its own clock no later than this one, see `Store::deadline_on`).
pub async fn collect_fences(
    bank: &Bank,
    store: &Store,
    stale_before: Timestamp,
    shutdown: &CancellationToken,
) -> StoreResult<usize> {
    let mut dropped = 0;
    for transfer in store.fenced_finished(stale_before, BATCH).await? {
        if shutdown.is_cancelled() {
            break;
        }
        // Fences first, flag second: a crash in between leaves the flag, and the next
        // pass drops the (already gone) fences again.
        let dropped_here = async {
            for (on, accounts) in bank.by_deployment(&transfer)? {
                on.drop_fences(accounts, transfer.id).await?;
            }
            store.unmark_fenced(transfer.id).await
        };
        match dropped_here.await {
            Ok(()) => dropped += 1,
            Err(e) => {
                tracing::warn!(transfer_id = %transfer.id, error = %Chain(&e), "dropping fences failed; next pass");
            }
        }
    }
    Ok(dropped)
}

/// Expires the holds found `held` past their `expiresAt` by the database's clock (`now`),
/// each under admission control like a recovery. Returns how many this pass expired.
async fn expire_holds(
    bank: &Bank,
    store: &Store,
    now: Timestamp,
    shutdown: &CancellationToken,
) -> StoreResult<usize> {
    let mut expired = 0;
    for hold in store.expired_holds(now, BATCH).await? {
        if shutdown.is_cancelled() {
            break;
        }
        let id = hold.id;
        let _permit = bank.admit_waiting().await;
        match bank.expire(hold).await {
            Ok(true) => {
                expired += 1;
                tracing::info!(transfer_id = %id, "hold expired");
            }
            Ok(false) => {} // captured, voided or expired by someone else first
            Err(e) => {
                tracing::warn!(transfer_id = %id, error = %Chain(&e), "expiring a hold failed; next pass");
            }
        }
    }
    Ok(expired)
}

/// Runs passes until `shutdown` is cancelled.
pub async fn run(bank: Bank, interval: Duration, shutdown: CancellationToken) {
    loop {
        if let Err(e) = sweep_once(&bank, &shutdown).await {
            tracing::warn!(error = %Chain(&e), "sweep failed; retrying at the next interval");
        }
        let jitter = rand::rng().random_range(0.8..1.2);
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(interval.mul_f64(jitter)) => {}
        }
    }
    tracing::info!("sweeper stopped");
}
