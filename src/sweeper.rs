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
//! [`run`] does one pass at once at start-up, in which an instance also takes back its
//! own unfinished transfers whatever their age (a restart with the same `INSTANCE_ID`),
//! then a pass every `SWEEP_INTERVAL_MS` with ±20% jitter so that instances started
//! together do not sweep in lockstep. It stops between transfers when cancelled.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rand::Rng;
use tokio_util::sync::CancellationToken;

use crate::service::Bank;
use crate::store::StoreResult;

/// Transfers claimed in one pass, at most.
pub const BATCH: u32 = 100;

/// Transfers recovered by this process since it started.
pub static RECOVERED_TOTAL: AtomicU64 = AtomicU64::new(0);

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    /// Unfinished transfers found.
    pub found: usize,
    /// Of those, the ones this instance claimed (another may have claimed the rest).
    pub claimed: usize,
    /// Of those, the ones driven to `done` or `canceled`.
    pub finished: usize,
}

/// Which transfers a pass looks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every transfer whose lease has lapsed.
    Stale,
    /// This instance's own unfinished transfers, whatever their age (start-up).
    Own,
}

/// One pass of the sweeper. Stops early, between transfers, when `shutdown` is cancelled.
pub async fn sweep_once(
    bank: &Bank,
    scope: Scope,
    shutdown: &CancellationToken,
) -> StoreResult<SweepReport> {
    let store = bank.store();
    let me = bank.instance_id();
    let lease_ms = bank.stale_after().as_millis() as i64;
    // By the database's clock; the claim re-checks it atomically.
    let now = store.server_time().await?;
    let stale_before = mongodb::bson::DateTime::from_millis(now.timestamp_millis() - lease_ms);
    let found = store
        .unfinished(me, stale_before, scope == Scope::Own, BATCH)
        .await?;
    let mut report = SweepReport {
        found: found.len(),
        ..SweepReport::default()
    };
    for candidate in found {
        if shutdown.is_cancelled() {
            break;
        }
        let Some(claimed) = store.claim(me, &candidate, stale_before).await? else {
            continue;
        };
        report.claimed += 1;
        let from = claimed.state;
        let previous_owner = candidate.application.as_deref().unwrap_or("-").to_owned();
        let finished = bank.run(claimed).await?;
        if finished.state.is_terminal() {
            report.finished += 1;
            RECOVERED_TOTAL.fetch_add(1, Ordering::Relaxed);
        }
        tracing::info!(
            transfer_id = %finished.id,
            from = %from,
            to = %finished.state,
            previous_owner = %previous_owner,
            "transfer recovered"
        );
    }
    Ok(report)
}

/// Runs passes until `shutdown` is cancelled.
pub async fn run(bank: Bank, interval: Duration, shutdown: CancellationToken) {
    let mut scope = Scope::Own;
    loop {
        for pass in [scope, Scope::Stale] {
            if let Err(e) = sweep_once(&bank, pass, &shutdown).await {
                tracing::warn!(error = %e, "sweep failed; retrying at the next interval");
            }
        }
        scope = Scope::Stale;
        let jitter = rand::rng().random_range(0.8..1.2);
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(interval.mul_f64(jitter)) => {}
        }
    }
    tracing::info!("sweeper stopped");
}
