//! The ledger of the run (`support::ledger`, the checks every test binary shares):
//! watched while the load runs ([`watch`]), read back once everything is quiet
//! ([`read_end`]) and checked ([`check`]).
//!
//! While the load runs, every [`WATCH_EVERY_MS`] ms, every account document of every
//! deployment is read (a deployment at a time, so that one restarting leaves the others
//! watched) and checked on its own: its amounts, its `seq` and its last entry agree in
//! that one read. Every [`ASK_EVERY`]th round, [`ASKED_PER_ROUND`] accounts chosen at
//! random (at most [`ASKED_MAX`] in the run) have their balance asked of a random live
//! instance (`GET /accounts/{id}/balance`, half the time `?at=` the test's now, half the
//! time without: the database's now, as the instance knows it), each between two reads
//! of the account's `seq` straight from its deployment; the answers are kept.
//!
//! At the end, over the entries of every deployment: the per-account, per-transfer and
//! conservation checks of `support::ledger`; every balance asked during the run against
//! the entries; and every account's entries read through the API, in pages, the same as
//! the stored ones.
//!
//! Why a balance asked during the run can be checked exactly: no clock of the test or of
//! an instance (they run skewed) is compared with anything, only the answer's own `at`
//! with the entries' `at`. The answer names the last entry at or before its `at`; an
//! entry after that one may also be at or before it and still be missing from the answer
//! when it landed after the service read (a write whose `$$NOW` was taken before the
//! read, or one in the same millisecond). The two reads of `seq` bound this: entries up
//! to the first existed when the service read, so the one after the answer's, if among
//! them, must be after `at`; none beyond the second existed, so the answer cannot name
//! one. What is left, an entry numbered between the two reads, at or before `at` and
//! after the answer's, is counted (it landed late), not judged.

use std::time::Duration;

use chrono::SecondsFormat;
use mongodb::bson::{Document, doc};
use rand::Rng;
use support::ledger::{self, ApiEntries, BalanceSeen, Findings, Ledger};
use tokio_util::sync::CancellationToken;
use transfer_service::domain::Transfer;
use transfer_service::store::Store;

use super::Checks;
use crate::deployments::{Books, Layout};
use crate::workload::{ACCOUNTS, Bases, OPENING_BALANCE, account, live_base};

/// How often the account documents are read during the run.
const WATCH_EVERY_MS: u64 = 500;
/// Balances are asked every this many rounds...
const ASK_EVERY: u64 = 4;
/// ...of this many accounts...
const ASKED_PER_ROUND: usize = 2;
/// ...and of at most this many in the run.
const ASKED_MAX: usize = 64;
/// Entries per page when reading them back through the API: several pages for the hot
/// accounts.
const PAGE: u32 = 250;
/// Attempts at reading an account's entries through the API, each on a random live
/// instance (the proxied one loses connections).
const API_ATTEMPTS: usize = 5;

/// What the watch saw while the load ran.
#[derive(Default)]
pub struct Watched {
    /// The checks of the account documents, each read on its own.
    pub documents: Findings,
    /// Reads of a deployment's account documents that were complete...
    pub samples: u64,
    /// ...and those that failed (the database restarting).
    pub failed: u64,
    /// The balances asked, with the reads of `seq` around them.
    pub balances: Vec<BalanceSeen>,
    /// Balances asked that got no answer (an instance killed, the database restarting).
    pub unanswered: u64,
    /// Answers no balance can be (a status other than 200 or 503, a body that is not a
    /// balance).
    pub wrong: Vec<String>,
}

/// The ledger once everything is quiet, and the run's watch.
pub struct LedgerSeen {
    pub during: Watched,
    /// Every deployment's accounts and entries, read after the transfers.
    pub ledger: Ledger,
    /// Per account, the entries the API answered, with the paging's own checks; `Err`
    /// when no attempt got them.
    pub answered: Vec<(String, Result<ApiEntries, String>)>,
}

/// Watches the ledger until `stop` (see the module doc).
pub async fn watch(layout: Layout, books: Books, bases: Bases, stop: CancellationToken) -> Watched {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let mut watched = Watched::default();
    for round in 1.. {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(Duration::from_millis(WATCH_EVERY_MS)) => {}
        }
        for store in &books.stores {
            let read = tokio::time::timeout(
                Duration::from_secs(2),
                ledger::sample_documents(store.database()),
            );
            match read.await {
                Ok(Ok(found)) => {
                    watched.samples += 1;
                    watched.documents.extend(found);
                }
                _ => watched.failed += 1,
            }
        }
        if round % ASK_EVERY != 0 {
            continue;
        }
        for _ in 0..ASKED_PER_ROUND {
            let asked = watched.balances.len() + watched.unanswered as usize;
            if asked >= ASKED_MAX {
                break;
            }
            let i = rand::rng().random_range(0..ACCOUNTS);
            let store = &books.stores[layout.home(i)];
            match ask_balance(&http, store, &bases, &account(i)).await {
                Asked::Answered(seen) => watched.balances.push(seen),
                Asked::Unanswered => watched.unanswered += 1,
                Asked::Wrong(what) => watched.wrong.push(what),
            }
        }
    }
    watched
}

/// What asking a balance came to.
enum Asked {
    Answered(BalanceSeen),
    Unanswered,
    Wrong(String),
}

/// The balance of `id` asked of a random live instance, between two reads of its `seq`
/// from `store`, its deployment.
async fn ask_balance(http: &reqwest::Client, store: &Store, bases: &Bases, id: &str) -> Asked {
    let Some((_, base)) = live_base(bases, &mut rand::rng()) else {
        return Asked::Unanswered;
    };
    let Some(seq_before) = seq_of(store, id).await else {
        return Asked::Unanswered;
    };
    let url = if rand::rng().random_bool(0.5) {
        let now = chrono::Utc::now().to_rfc3339_opts(SecondsFormat::Millis, true);
        format!("{base}/accounts/{id}/balance?at={now}")
    } else {
        format!("{base}/accounts/{id}/balance")
    };
    let Ok(response) = http.get(&url).send().await else {
        return Asked::Unanswered;
    };
    let status = response.status().as_u16();
    let Ok(body) = response.json::<serde_json::Value>().await else {
        return Asked::Unanswered;
    };
    let Some(seq_after) = seq_of(store, id).await else {
        return Asked::Unanswered;
    };
    match status {
        200 => match BalanceSeen::from_answer(id, &body, seq_before, seq_after) {
            Ok(seen) => Asked::Answered(seen),
            Err(e) => Asked::Wrong(e),
        },
        503 => Asked::Unanswered,
        _ => Asked::Wrong(format!("{url} answered {status}: {body}")),
    }
}

/// The `seq` of account `id`, read straight from its deployment; `None` when it does
/// not answer.
async fn seq_of(store: &Store, id: &str) -> Option<u64> {
    let accounts = store.database().collection::<Document>("accounts");
    let read = accounts
        .find_one(doc! { "_id": id })
        .projection(doc! { "seq": 1 });
    let found = tokio::time::timeout(Duration::from_secs(2), read).await;
    let seq = found.ok()?.ok()??.get_i64("seq").ok()?;
    u64::try_from(seq).ok()
}

/// Reads the ledger of every deployment (after the transfers: everything is quiet), and
/// every account's entries through the API of the live instances.
pub async fn read_end(books: &Books, bases: &Bases, during: Watched) -> LedgerSeen {
    let mut read = Ledger::default();
    for store in &books.stores {
        let found = ledger::read(store.database(), None).await;
        read.merge(found.expect("read the ledger once everything is quiet"));
    }
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut answered = Vec::new();
    for i in 0..ACCOUNTS {
        let id = account(i);
        let mut got = Err(format!("{id}: no live instance"));
        for _ in 0..API_ATTEMPTS {
            let Some((_, base)) = live_base(bases, &mut rand::rng()) else {
                break;
            };
            got = ledger::read_via_api(&http, &base, &id, PAGE).await;
            if got.is_ok() {
                break;
            }
        }
        answered.push((id, got));
    }
    LedgerSeen {
        during,
        ledger: read,
        answered,
    }
}

/// Every check of the module doc, on what `seen` holds and the final `transfers`.
pub fn check(seen: &LedgerSeen, transfers: &[Transfer], checks: &mut Checks) {
    let ledger = &seen.ledger;
    checks.check(
        "ledger: every account's entries read",
        ledger.accounts.len() == ACCOUNTS,
        || format!("entries of {:?} read", ledger.accounts.keys()),
    );
    checks.extend(ledger::check_ledger(
        ledger,
        transfers,
        OPENING_BALANCE * ACCOUNTS as i64,
    ));
    checks.extend(seen.during.documents.clone());
    checks.check(
        "ledger: balances asked during the run",
        !seen.during.balances.is_empty(),
        || "no balance as of a time was answered during the run".into(),
    );
    for asked in &seen.during.balances {
        checks.extend(ledger::check_balance_at(ledger, asked));
    }
    for wrong in &seen.during.wrong {
        checks.check("ledger: a balance is answered as one", false, || {
            wrong.clone()
        });
    }
    for (id, answered) in &seen.answered {
        match answered {
            Ok(answered) => {
                checks.extend(answered.paging.clone());
                checks.extend(ledger::check_same_entries(ledger, id, &answered.entries));
            }
            Err(e) => checks.check(
                "ledger: the API answers every account's entries",
                false,
                || format!("{id}: {e}"),
            ),
        }
    }
}

/// Prints what the ledger held and what the watch did.
pub fn describe(seen: &LedgerSeen) {
    let during = &seen.during;
    let late = during
        .balances
        .iter()
        .filter(|b| ledger::landed_late(&seen.ledger, b))
        .count();
    let read: usize = seen
        .answered
        .iter()
        .filter_map(|(_, a)| a.as_ref().ok())
        .map(|answered| answered.entries.len())
        .sum();
    println!(
        "ledger: {} entries over {} accounts ({read} read back through the API, {PAGE} a \
         page); account documents read {} times a deployment at a time ({} reads failed), \
         {} checks; {} balances as of a time answered during the run ({late} with an entry \
         that landed later at or before their moment), {} unanswered",
        seen.ledger.entry_count(),
        seen.ledger.accounts.len(),
        during.samples,
        during.failed,
        during.documents.checked(),
        during.balances.len(),
        during.unanswered
    );
}
