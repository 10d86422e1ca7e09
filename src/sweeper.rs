//! The recovery sweeper: finishes or rolls back what a crashed (or stuck) instance left
//! behind.
//!
//! [`sweep_once`] is one pass: find unfinished transfers whose owner's lease has lapsed (no
//! state change for `STALE_AFTER_MS` by the database's clock), claim each with one guarded
//! findAndModify, and drive it with the same step functions as a fresh transfer
//! ([`Driver::run`](crate::service::Driver::run), through the [`Recovery`] the sweeper
//! holds: the driver, and admission): `initial` and `pending` go forward (a `pending` one
//! whose debit or credit is now refused rolls back with the reason), `applied` finishes its
//! pulls, `canceling` finishes its undo. Batches are bounded.
//!
//! A stale `initial` transfer, or a `pending` one with nothing prepared (a new transfer
//! is inserted `pending`, owned by the instance that inserts it), is processed, not
//! canceled: it was durably inserted with the client's intent, a `Prefer: respond-async`
//! client was told it would run, and a client that lost the answer and retries with its
//! idempotency key is answered with the outcome. Only a cancel request cancels a transfer
//! that has not failed.
//!
//! Each pass also keeps house, with the same bounded batches:
//! - It finishes reversals a crash interrupted (a done transfer whose `reversedBy` was
//!   claimed but whose compensation never finished), through the same code as a cancel.
//! - It drops the account fences of canceled transfers ([`collect_fences`]).
//! - It expires the holds past their `expiresAt` (`held -> canceling`, reason `expired`,
//!   then their release), by the database's clock.
//!
//! [`run`] does one pass at once at start-up, then a pass every `SWEEP_INTERVAL_MS` with
//! ±20% jitter so that instances started together do not sweep in lockstep; each
//! deployment's log on a loop of its own, so that a pass held up by one deployment never
//! delays the others. It stops between transfers when cancelled. A restarted instance has a
//! new owner name (see [`Driver::owner`](crate::service::Driver::owner)) and takes its old
//! transfers back like any other instance, once their lease has lapsed: writes of the dead
//! process may still be on their way until then.
//!
//! One transfer that fails (the database refused a step, say) is logged and left for the
//! next pass; the pass goes on with the others and with its housekeeping.
//!
//! With several deployments, the sweeper sweeps every deployment's log at once, each by
//! its own clock (a lease is judged by the clock of the deployment that logs the
//! transfer) and on a loop of its own (see [`run`]). A deployment that does not answer is
//! skipped until the next pass; the others are swept as usual.
//!
//! A pass never starves behind what it cannot act on. Its scans leave out the transfers
//! into a deployment that does not answer, and page past what they skip for any other
//! reason (a transfer this process is driving, a claim that failed): left in, those would
//! stay the oldest page on every pass and hide every later transfer, so that a transfer
//! between two healthy deployments would wait for a third one's outage to end (see
//! `store::transfers::Scan`). A pass claims at most `BATCH` transfers per log.

use std::time::Duration;

use rand::Rng;
use tokio_util::sync::CancellationToken;

use crate::domain::Side;
use crate::domain::{AccountId, Timestamp, Transfer};
use crate::error_chain::Chain;
use crate::service::{AdmissionPermit, Recovery, ServiceError};
use crate::store::transfers::Scan;
use crate::store::{Store, StoreResult};

/// Transfers claimed in one pass of a log, at most; also the size of a page of its scans,
/// and the most reversals finished and fenced transfers cleaned in one pass.
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
pub async fn sweep_once(
    recovery: &Recovery,
    shutdown: &CancellationToken,
) -> StoreResult<SweepReport> {
    let passes = recovery
        .driver()
        .deployments()
        .all()
        .iter()
        .map(|log| sweep_log(recovery, log, shutdown));
    let passes = if one_at_a_time(recovery) {
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
    for (log, pass) in recovery.driver().deployments().all().iter().zip(passes) {
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

/// One pass over the transfers logged on `store`'s deployment: its stale transfers
/// recovered, then its housekeeping.
async fn sweep_log(
    recovery: &Recovery,
    store: &Store,
    shutdown: &CancellationToken,
) -> StoreResult<SweepReport> {
    store.check_answering()?;
    let lease_ms = recovery.driver().stale_after().as_millis() as i64;
    // By the database's clock; the claim re-checks it atomically.
    let now = store.server_time().await?;
    let stale_before = now - chrono::TimeDelta::milliseconds(lease_ms);
    // What touches a deployment that does not answer is left out of every scan: nothing
    // can drive it now, and it would hide what comes after it (see `Scan`).
    let scan = Scan::new(stale_before, recovery.driver().deployments().silent());
    let mut report = recover_stale(recovery, store, scan.clone(), stale_before, shutdown).await?;
    if !shutdown.is_cancelled() {
        keep_house(recovery, store, scan, now, shutdown, &mut report).await;
    }
    Ok(report)
}

/// Claims the unfinished transfers of `store`'s log whose owner's lease has lapsed (last
/// modified before `stale_before`), at most `BATCH`, page after page of `unfinished`,
/// and drives each to its end ([`recover`]); waits for those runs.
async fn recover_stale(
    recovery: &Recovery,
    store: &Store,
    mut unfinished: Scan,
    stale_before: Timestamp,
    shutdown: &CancellationToken,
) -> StoreResult<SweepReport> {
    let mut report = SweepReport::default();
    // Each claimed transfer is driven in a task of its own, under the same admission
    // control as new transfers (waiting for a permit rather than being refused), so a
    // backlog is recovered as fast as the database allows, never faster than it admits.
    let mut runs = tokio::task::JoinSet::new();
    let sequential = one_at_a_time(recovery);
    'pages: loop {
        let page = store.transfers().unfinished(&unfinished, BATCH).await?;
        unfinished.past(&page);
        let last_page = page.len() < BATCH as usize;
        report.found += page.len();
        for candidate in page {
            if shutdown.is_cancelled() || report.claimed == BATCH as usize {
                break 'pages;
            }
            if !may_claim(recovery, &candidate) {
                continue;
            }
            let permit = recovery.admit_waiting().await;
            let Some(claimed) = claim(recovery, store, &candidate, stale_before).await else {
                continue;
            };
            report.claimed += 1;
            runs.spawn(recover(recovery.clone(), claimed, candidate.owner, permit));
            if sequential {
                count_recovered(runs.join_next().await, &mut report);
            }
        }
        if last_page {
            break;
        }
    }
    while let Some(ended) = runs.join_next().await {
        count_recovered(Some(ended), &mut report);
    }
    Ok(report)
}

/// Whether a pass may claim `candidate`, found stale.
fn may_claim(recovery: &Recovery, candidate: &Transfer) -> bool {
    // Left to the task driving it: claiming it would renew the lease of a task
    // that may be stuck. The next page goes past it, so that a page of them (a
    // backlog stuck on a slow deployment) never hides the transfers behind it.
    if recovery.driver().is_driving(candidate.id) {
        return false;
    }
    // Its other account's deployment stopped answering since the page was read
    // (or is named in the data but not in `DEPLOYMENTS`): claiming it would only
    // renew a lease it cannot use, and keep an instance that can from taking it.
    recovery
        .driver()
        .store_of(candidate, Side::Destination)
        .is_ok()
}

/// Claims `candidate` for this instance ([`crate::store::Transfers::claim`]); `None` if someone touched it
/// since it was read, or the claim failed (logged; the next pass tries again).
async fn claim(
    recovery: &Recovery,
    store: &Store,
    candidate: &Transfer,
    stale_before: Timestamp,
) -> Option<Transfer> {
    match store
        .transfers()
        .claim(recovery.driver().owner(), candidate, stale_before)
        .await
    {
        Ok(claimed) => claimed,
        Err(e) => {
            tracing::warn!(transfer_id = %candidate.id, error = %Chain(&e), "claim failed; next pass");
            None
        }
    }
}

/// Drives `claimed`, a transfer claimed from `previous_owner`, holding `permit`; whether
/// it reached its end.
async fn recover(
    recovery: Recovery,
    claimed: Transfer,
    previous_owner: Option<String>,
    permit: AdmissionPermit,
) -> bool {
    let _permit = permit;
    let (id, from) = (claimed.id, claimed.state);
    let previous_owner = previous_owner.unwrap_or_else(|| "-".into());
    match recovery.driver().run(claimed).await {
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
            tracing::warn!(transfer_id = %id, error = %Chain(&e), "recovery interrupted; next pass");
            false
        }
    }
}

/// The housekeeping of a pass over `store`'s log: reversals a crash interrupted, the
/// fences of finished transfers, holds past their expiry. Each that fails is logged and
/// left for the next pass.
async fn keep_house(
    recovery: &Recovery,
    store: &Store,
    scan: Scan,
    now: Timestamp,
    shutdown: &CancellationToken,
    report: &mut SweepReport,
) {
    match finish_reversals(recovery, store, scan.clone(), shutdown).await {
        Ok(n) => report.reversals_finished = n,
        Err(e) => tracing::warn!(error = %Chain(&e), "finishing reversals failed; next pass"),
    }
    match collect_fences(recovery, store, scan, shutdown).await {
        Ok(n) => report.fences_dropped = n,
        Err(e) => tracing::warn!(error = %Chain(&e), "collecting fences failed; next pass"),
    }
    match expire_holds(recovery, store, now, shutdown).await {
        Ok(n) => report.holds_expired = n,
        Err(e) => tracing::warn!(error = %Chain(&e), "expiring holds failed; next pass"),
    }
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
fn one_at_a_time(recovery: &Recovery) -> bool {
    #[cfg(feature = "failpoints")]
    return crate::failpoints::hooked(recovery.driver().instance_id());
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = recovery;
        false
    }
}

/// Finishes the reversals whose instance crashed after claiming them (`reversing` and
/// not touched for a lease), at most `BATCH` a pass; pages past those it cannot finish now
/// (another instance drives the compensation, or it failed). Returns how many reached
/// their end.
async fn finish_reversals(
    recovery: &Recovery,
    store: &Store,
    mut scan: Scan,
    shutdown: &CancellationToken,
) -> StoreResult<usize> {
    let mut finished = 0;
    loop {
        let page = store.transfers().unfinished_reversals(&scan, BATCH).await?;
        scan.past(&page);
        let last_page = page.len() < BATCH as usize;
        for original in page {
            if shutdown.is_cancelled() || finished == BATCH as usize {
                return Ok(finished);
            }
            let id = original.id;
            match recovery.driver().finish_reversal(original).await {
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
        if last_page {
            return Ok(finished);
        }
    }
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
/// `store` is the deployment that logs the transfers; the scan's `stale_before` is by
/// its clock, which judged the fences' deadlines too (each account's deployment checked a
/// deadline carried over to its own clock no later than this one, see
/// `Store::deadline_on`). At most `BATCH` a pass; pages past those that fail.
pub async fn collect_fences(
    recovery: &Recovery,
    store: &Store,
    mut scan: Scan,
    shutdown: &CancellationToken,
) -> StoreResult<usize> {
    let mut dropped = 0;
    loop {
        let page = store.transfers().fenced_finished(&scan, BATCH).await?;
        scan.past(&page);
        let last_page = page.len() < BATCH as usize;
        for transfer in page {
            if shutdown.is_cancelled() || dropped == BATCH as usize {
                return Ok(dropped);
            }
            // Fences first, flag second: a crash in between leaves the flag, and the next
            // pass drops the (already gone) fences again.
            let dropped_here = async {
                for (on, accounts) in recovery.driver().accounts_by_deployment(&transfer)? {
                    let accounts: Vec<&AccountId> = accounts.iter().collect();
                    on.accounts().drop_fences(&accounts, transfer.id).await?;
                }
                store.transfers().unmark_fenced(transfer.id).await
            };
            match dropped_here.await {
                Ok(()) => dropped += 1,
                Err(e) => {
                    tracing::warn!(transfer_id = %transfer.id, error = %Chain(&e), "dropping fences failed; next pass");
                }
            }
        }
        if last_page {
            return Ok(dropped);
        }
    }
}

/// Expires the holds found `held` past their `expiresAt` by the database's clock (`now`),
/// each under admission control like a recovery. Returns how many this pass expired.
///
/// Needs no paging past what it skips: a hold it found leaves `held` (expired by this
/// pass, or captured, voided or expired by someone else) unless the log's deployment
/// itself fails, which ends the pass.
async fn expire_holds(
    recovery: &Recovery,
    store: &Store,
    now: Timestamp,
    shutdown: &CancellationToken,
) -> StoreResult<usize> {
    let mut expired = 0;
    for hold in store.transfers().expired_holds(now, BATCH).await? {
        if shutdown.is_cancelled() {
            break;
        }
        let id = hold.id;
        let _permit = recovery.admit_waiting().await;
        match recovery.driver().expire(hold).await {
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

/// Runs passes until `shutdown` is cancelled: each deployment's log on a loop of its own,
/// so that a pass held up by one deployment never holds up the others' next passes. A
/// server that stops answering without closing its connections (frozen, cut off by a
/// network partition) holds what was already sent to it until the driver gives up, about
/// 10 s, before the watch finds it silent; one loop over every log waited for that pass
/// before the next pass of any other, and an expired hold between two deployments that
/// answer, or a transfer a killed instance left, waited with it.
pub async fn run(recovery: Recovery, interval: Duration, shutdown: CancellationToken) {
    let loops = recovery
        .driver()
        .deployments()
        .all()
        .iter()
        .map(|log| sweep_log_until_cancelled(&recovery, log, interval, &shutdown));
    futures::future::join_all(loops).await;
    tracing::info!("sweeper stopped");
}

/// Passes over `log` (one at once, then one every `interval` with jitter) until
/// `shutdown` is cancelled.
async fn sweep_log_until_cancelled(
    recovery: &Recovery,
    log: &Store,
    interval: Duration,
    shutdown: &CancellationToken,
) {
    loop {
        if let Err(e) = sweep_log(recovery, log, shutdown).await {
            tracing::warn!(deployment = %log.deployment(), error = %Chain(&e), "sweep of a deployment failed; retrying at the next interval");
        }
        let jitter = rand::rng().random_range(0.8..1.2);
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(interval.mul_f64(jitter)) => {}
        }
    }
}
