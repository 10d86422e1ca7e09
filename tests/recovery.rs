//! Crash recovery, proven with fault injection: an instance built with the `failpoints`
//! feature aborts (as kill -9 would) right after a given protocol step; another instance
//! must then bring the transfer to its right terminal state, with every balance conserved
//! and no `pendingTransactions` entry left, within STALE_AFTER_MS plus two sweeps. The
//! ledger must tell the same story ([`assert_ledger`]): each step entered once whoever
//! made it, the entries the end calls for, nothing else.
//!
//! Every crash is tried twice: with both accounts on one deployment, and across two
//! deployments (two database servers), the source on the second one listed, so that the
//! transfer is logged where the sweeper must look beyond the first deployment, and each
//! side's steps go to their own server.

use std::time::{Duration, Instant};

use serde_json::json;
use support::ledger::{self, Ledger};
use support::process::{Instance, InstanceConfig};
use support::{database_uris, fresh_database_name};
use transfer_service::domain::DeploymentName;
use transfer_service::failpoints::Point;
use transfer_service::store::Store;

const STALE_AFTER_MS: u64 = 1000;
const SWEEP_INTERVAL_MS: u64 = 100;

/// Where a test's accounts a (the source) and b live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// Both on the one deployment of `MONGODB_URI`.
    OneDeployment,
    /// `DEPLOYMENTS=eu=...,us=...`: a on `us`, b on `eu`.
    Across,
}

/// A test's database on each deployment of its layout.
struct Books {
    layout: Layout,
    database: String,
    /// a's deployment, which logs the transfer.
    a: Store,
    b: Store,
}

impl Books {
    async fn new(layout: Layout) -> Books {
        let database = fresh_database_name();
        let uris = database_uris(2);
        let connect = |name: &str, uri: &str| {
            let (name, uri, database) = (name.to_owned(), uri.to_owned(), database.clone());
            async move {
                Store::connect_with(DeploymentName::parse(&name).unwrap(), &uri, &database, 2)
                    .await
                    .unwrap()
            }
        };
        let (a, b) = match layout {
            Layout::OneDeployment => {
                let store = connect("default", &uris[0]).await;
                (store.clone(), store)
            }
            Layout::Across => (connect("us", &uris[1]).await, connect("eu", &uris[0]).await),
        };
        Books {
            layout,
            database,
            a,
            b,
        }
    }

    async fn start_instance(&self, name: &str, crash_at: Option<Point>) -> Instance {
        let uris = database_uris(2);
        let mut config =
            InstanceConfig::new(support::service_binary!(), &uris[0], &self.database, name);
        if self.layout == Layout::Across {
            config.deployments = Some(format!("eu={},us={}", uris[0], uris[1]));
        }
        config.crash_at = crash_at.map(|point| point.name().to_owned());
        config.stale_after_ms = STALE_AFTER_MS;
        config.sweep_interval_ms = SWEEP_INTERVAL_MS;
        Instance::start(&config).await
    }

    /// Opens a (500) and b (0) through `instance`, each on its deployment.
    async fn open_accounts(&self, http: &reqwest::Client, instance: &Instance) {
        for (id, balance, deployment) in [("a", 500, "us"), ("b", 0, "eu")] {
            let mut body = json!({ "id": id, "balance": balance });
            if self.layout == Layout::Across {
                body["deployment"] = json!(deployment);
            }
            let r = http
                .post(format!("{}/accounts", instance.base))
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 201);
        }
    }

    /// Both accounts' ledgers, each read from its deployment.
    async fn ledger(&self) -> Ledger {
        let mut ledger = ledger::read(self.a.database(), None).await.unwrap();
        if self.layout == Layout::Across {
            ledger.merge(ledger::read(self.b.database(), None).await.unwrap());
        }
        ledger
    }
}

/// The ledger once the recovery is over (`support::ledger`): a's and b's entries
/// numbered without gaps, each following the one before, the last one the account's
/// amounts; the transfer's entries those its end calls for, none entered twice, whoever
/// made them; the 500 opened with still there; and the rescuer's API answers the same
/// entries, a page of one at a time.
async fn assert_ledger(books: &Books, rescuer: &Instance, step: Point) {
    let transfers = books
        .a
        .transfers()
        .list_transfers(&Default::default(), 10)
        .await
        .unwrap();
    let ledger = books.ledger().await;
    let mut found = ledger::check_ledger(&ledger, &transfers, 500);
    let http = reqwest::Client::new();
    for account in ["a", "b"] {
        let answered = ledger::read_via_api(&http, &rescuer.base, account, 1)
            .await
            .unwrap();
        found.extend(answered.paging);
        found.extend(ledger::check_same_entries(
            &ledger,
            account,
            &answered.entries,
        ));
    }
    assert!(
        found.violations.is_empty(),
        "the ledger after a crash at {step} and its recovery: {:#?}\n{}",
        found.violations,
        ledger.describe()
    );
}

/// Crashes an instance at `step` during a transfer of `amount` from a (balance 500) to
/// b (balance 0), recovers with a second instance, and returns the final transfer state.
async fn crash_and_recover(layout: Layout, step: Point, amount: i64) -> String {
    let books = Books::new(layout).await;
    let http = reqwest::Client::new();
    let mut doomed = books.start_instance("doomed", Some(step)).await;
    books.open_accounts(&http, &doomed).await;
    // The instance dies mid-request: the client sees the connection drop.
    let answer = http
        .post(format!("{}/transfers", doomed.base))
        .json(&json!({ "source": "a", "destination": "b", "amount": amount }))
        .send()
        .await;
    assert!(
        answer.is_err(),
        "the instance should have crashed at {step}, answered {answer:?}"
    );
    let status = doomed.child.wait().unwrap();
    assert!(!status.success(), "crashed instance exited {status}");

    let store = &books.a;
    let stuck = store
        .transfers()
        .list_transfers(&Default::default(), 10)
        .await
        .unwrap();
    assert_eq!(
        stuck.len(),
        1,
        "one transfer inserted, on the source's deployment"
    );
    assert!(
        !stuck[0].state.is_terminal(),
        "crash at {step} left it unfinished"
    );
    let id = stuck[0].id;

    let started = Instant::now();
    let rescuer = books.start_instance("rescuer", None).await;
    let limit =
        Duration::from_millis(STALE_AFTER_MS + 2 * SWEEP_INTERVAL_MS) + Duration::from_secs(5);
    // The limit counts from before the rescuer's start.
    let left = limit.saturating_sub(started.elapsed());
    let transfer = support::poll_until(left, Duration::from_millis(50), async || {
        let t = store.transfers().transfer(id).await.unwrap().unwrap();
        if t.state.is_terminal() { Ok(t) } else { Err(t) }
    })
    .await
    .unwrap_or_else(|t| panic!("not recovered within {limit:?}: {:?}", t.state));
    let owner = transfer.owner.as_deref().unwrap_or_default();
    assert!(owner.starts_with("rescuer/"), "{owner}");

    let a = books
        .a
        .accounts()
        .account(&support::values::account("a"))
        .await
        .unwrap()
        .unwrap();
    let b = books
        .b
        .accounts()
        .account(&support::values::account("b"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        a.balance + b.balance,
        500,
        "money created or lost after a crash at {step}"
    );
    assert!(a.balance >= 0 && b.balance >= 0);
    assert!(
        a.pending_transactions.is_empty() && b.pending_transactions.is_empty(),
        "markers left after {step}"
    );
    if transfer.state == transfer_service::domain::TransferState::Done {
        assert_eq!((a.balance, b.balance), (500 - amount, amount));
    } else {
        assert_eq!((a.balance, b.balance), (500, 0));
    }
    assert_ledger(&books, &rescuer, step).await;
    transfer.state.to_string()
}

macro_rules! crash_test {
    ($name:ident, $step:expr, $amount:expr, $expected:literal) => {
        mod $name {
            use super::*;

            #[tokio::test]
            async fn within_one_deployment() {
                let ended = crash_and_recover(Layout::OneDeployment, $step, $amount).await;
                assert_eq!(ended, $expected);
            }

            #[tokio::test]
            async fn across_deployments() {
                let ended = crash_and_recover(Layout::Across, $step, $amount).await;
                assert_eq!(ended, $expected);
            }
        }
    };
}

// Forward: once recorded, a transfer the client asked for is carried through.
crash_test!(
    a_crash_after_insert_is_carried_through_to_done,
    Point::AfterInsert,
    200,
    "done"
);
crash_test!(
    a_crash_after_pending_is_carried_through_to_done,
    Point::AfterPending,
    200,
    "done"
);
crash_test!(
    a_crash_after_debit_is_carried_through_to_done,
    Point::AfterDebit,
    200,
    "done"
);
crash_test!(
    a_crash_after_credit_is_carried_through_to_done,
    Point::AfterCredit,
    200,
    "done"
);
crash_test!(
    a_crash_after_applied_ends_done,
    Point::AfterApplied,
    200,
    "done"
);
crash_test!(
    a_crash_after_pulling_both_markers_ends_done,
    Point::AfterPull,
    200,
    "done"
);
// Rollback: a transfer the source cannot fund rolls back; a crash mid-rollback is finished.
crash_test!(
    a_crash_after_canceling_ends_canceled,
    Point::AfterCanceling,
    900,
    "canceled"
);
crash_test!(
    a_crash_after_undo_destination_ends_canceled,
    Point::AfterUndoDestination,
    900,
    "canceled"
);
crash_test!(
    a_crash_after_undo_source_ends_canceled,
    Point::AfterUndoSource,
    900,
    "canceled"
);

/// What the crashing instance was doing with a hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HoldStep {
    /// Creating it (recording, reserving): recovered to `held`.
    Create,
    /// Capturing 150 of its 200: recovered to `done`.
    Capture,
    /// Voiding it: recovered to `canceled`, `voided`.
    Void,
    /// Its own sweeper expiring it: recovered to `canceled`, `expired`.
    Expire,
}

/// The amounts a test's accounts hold: (balance, pendingDebits, pendingCredits, markers).
async fn account_amounts(store: &Store, id: &str) -> (i64, i64, i64, usize) {
    let a = store
        .accounts()
        .account(&support::values::account(id))
        .await
        .unwrap()
        .unwrap();
    (
        a.balance,
        a.pending_debits,
        a.pending_credits,
        a.pending_transactions.len(),
    )
}

/// Crashes an instance at `step` while it does `what` with a hold of 200 from a (500) to
/// b (0); a second instance must bring the hold to where `what` leads, with the books
/// exactly right.
async fn crash_hold_and_recover(layout: Layout, step: Point, what: HoldStep) {
    let books = Books::new(layout).await;
    let http = reqwest::Client::new();
    let mut doomed = books.start_instance("doomed", Some(step)).await;
    books.open_accounts(&http, &doomed).await;
    let expires_in_ms = if what == HoldStep::Expire {
        1_000
    } else {
        60_000
    };
    let created = http
        .post(format!("{}/transfers", doomed.base))
        .json(&json!({ "source": "a", "destination": "b", "amount": 200, "hold": { "expiresInMs": expires_in_ms } }))
        .send()
        .await;
    let store = &books.a;
    let listed = store
        .transfers()
        .list_transfers(&Default::default(), 10)
        .await
        .unwrap();
    assert_eq!(
        listed.len(),
        1,
        "one hold inserted, on the source's deployment"
    );
    let id = listed[0].id;
    match what {
        HoldStep::Create => assert!(created.is_err(), "no crash at {step}: {created:?}"),
        HoldStep::Capture | HoldStep::Void => {
            assert_eq!(created.unwrap().status(), 201);
            let (action, body) = match what {
                HoldStep::Capture => ("capture", json!({ "amount": 150 })),
                _ => ("void", json!({})),
            };
            let answer = http
                .post(format!("{}/transfers/{id}/{action}", doomed.base))
                .json(&body)
                .send()
                .await;
            assert!(answer.is_err(), "no crash at {step}: {answer:?}");
        }
        // The doomed instance's own sweeper expires it, and crashes doing so.
        HoldStep::Expire => assert_eq!(created.unwrap().status(), 201),
    }
    let status = doomed.child.wait().unwrap();
    assert!(!status.success(), "crashed instance exited {status}");

    let started = Instant::now();
    let rescuer = books.start_instance("rescuer", None).await;
    let limit =
        Duration::from_millis(STALE_AFTER_MS + 2 * SWEEP_INTERVAL_MS) + Duration::from_secs(5);
    // The limit counts from before the rescuer's start.
    let left = limit.saturating_sub(started.elapsed());
    let ended = support::poll_until(left, Duration::from_millis(50), async || {
        let t = store.transfers().transfer(id).await.unwrap().unwrap();
        if t.state.is_at_rest() { Ok(t) } else { Err(t) }
    })
    .await
    .unwrap_or_else(|t| panic!("not recovered within {limit:?}: {t:?}"));
    use transfer_service::domain::{CancelReason, TransferState};
    let a = account_amounts(&books.a, "a").await;
    let b = account_amounts(&books.b, "b").await;
    match what {
        HoldStep::Create => {
            assert_eq!(ended.state, TransferState::Held, "{ended:?}");
            assert_eq!(a, (500, 200, 0, 1), "a after {step}");
            assert_eq!(b, (0, 0, 200, 1), "b after {step}");
        }
        HoldStep::Capture => {
            assert_eq!(ended.state, TransferState::Done, "{ended:?}");
            assert_eq!(ended.amount.minor_units(), 150);
            assert_eq!(a, (350, 0, 0, 0), "a after {step}");
            assert_eq!(b, (150, 0, 0, 0), "b after {step}");
        }
        HoldStep::Void | HoldStep::Expire => {
            let reason = if what == HoldStep::Void {
                CancelReason::Voided
            } else {
                CancelReason::Expired
            };
            assert_eq!(
                (ended.state, ended.reason),
                (TransferState::Canceled, Some(reason))
            );
            assert_eq!(a, (500, 0, 0, 0), "a after {step}");
            assert_eq!(b, (0, 0, 0, 0), "b after {step}");
        }
    }
    assert_ledger(&books, &rescuer, step).await;
}

macro_rules! hold_crash_test {
    ($name:ident, $step:expr, $what:expr) => {
        mod $name {
            use super::*;

            #[tokio::test]
            async fn within_one_deployment() {
                crash_hold_and_recover(Layout::OneDeployment, $step, $what).await;
            }

            #[tokio::test]
            async fn across_deployments() {
                crash_hold_and_recover(Layout::Across, $step, $what).await;
            }
        }
    };
}

hold_crash_test!(
    a_hold_crashed_after_insert_is_reserved,
    Point::AfterInsert,
    HoldStep::Create
);
hold_crash_test!(
    a_hold_crashed_after_pending_is_reserved,
    Point::AfterPending,
    HoldStep::Create
);
hold_crash_test!(
    a_hold_crashed_after_reserving_out_is_reserved,
    Point::AfterDebit,
    HoldStep::Create
);
hold_crash_test!(
    a_hold_crashed_after_reserving_in_is_reserved,
    Point::AfterCredit,
    HoldStep::Create
);
// Crashed between recording `held` and answering: nothing is left to finish; the hold
// stands with both reservations, for its creator's retry to find.
hold_crash_test!(
    a_hold_crashed_after_held_stays_reserved,
    Point::AfterHeld,
    HoldStep::Create
);
hold_crash_test!(
    a_capture_crashed_after_winning_the_hold_is_finished,
    Point::AfterResolve,
    HoldStep::Capture
);
hold_crash_test!(
    a_capture_crashed_after_the_source_is_finished,
    Point::AfterCaptureSource,
    HoldStep::Capture
);
hold_crash_test!(
    a_capture_crashed_after_the_destination_is_finished,
    Point::AfterCaptureDestination,
    HoldStep::Capture
);
hold_crash_test!(
    a_void_crashed_after_winning_the_hold_is_finished,
    Point::AfterResolve,
    HoldStep::Void
);
hold_crash_test!(
    a_void_crashed_after_releasing_the_destination_is_finished,
    Point::AfterUndoDestination,
    HoldStep::Void
);
hold_crash_test!(
    a_void_crashed_after_releasing_the_source_is_finished,
    Point::AfterUndoSource,
    HoldStep::Void
);
hold_crash_test!(
    an_expiry_crashed_after_winning_the_hold_is_finished,
    Point::AfterResolve,
    HoldStep::Expire
);
hold_crash_test!(
    an_expiry_crashed_after_releasing_the_destination_is_finished,
    Point::AfterUndoDestination,
    HoldStep::Expire
);

/// Opens the third account of the multi-leg tests, `c` (0), through `doomed`: on `us`
/// across deployments, beside `a`.
async fn open_c(http: &reqwest::Client, doomed: &Instance, layout: Layout) {
    let mut body = json!({ "id": "c", "balance": 0 });
    if layout == Layout::Across {
        body["deployment"] = json!("us");
    }
    let opened = http
        .post(format!("{}/accounts", doomed.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(opened.status(), 201);
}

/// Crashes an instance at `step` during a multi-leg transfer of three accounts
/// (`docs/legs.md`): a (500) pays b 300 and b pays c 100, so a is debited 300 and b and
/// c receive 200 and 100; with `short`, a pays b 900, more than it has, and the transfer
/// rolls back. Across deployments, a and c live on `us` (which logs the transfer) and b on
/// `eu`. A second instance must end it all or nothing: every balance as before or every
/// one moved, no marker and no room left, the ledger one entry per party (or a debit and
/// its undo), whoever made it.
async fn crash_legs_and_recover(layout: Layout, step: Point, short: bool, left_in: &str) -> String {
    let books = Books::new(layout).await;
    let http = reqwest::Client::new();
    let mut doomed = books.start_instance("doomed", Some(step)).await;
    books.open_accounts(&http, &doomed).await;
    open_c(&http, &doomed, layout).await;
    let first = if short { 900 } else { 300 };
    let legs = json!([
        { "source": "a", "destination": "b", "amount": first },
        { "source": "b", "destination": "c", "amount": 100 },
    ]);
    let answer = http
        .post(format!("{}/transfers", doomed.base))
        .json(&json!({ "legs": legs }))
        .send()
        .await;
    assert!(
        answer.is_err(),
        "the instance should have crashed at {step}, answered {answer:?}"
    );
    let status = doomed.child.wait().unwrap();
    assert!(!status.success(), "crashed instance exited {status}");

    let store = &books.a;
    let stuck = store
        .transfers()
        .list_transfers(&Default::default(), 10)
        .await
        .unwrap();
    assert_eq!(stuck.len(), 1, "one transfer inserted, where a lives");
    assert_eq!(
        stuck[0].state.to_string(),
        left_in,
        "the crash at {step} left it there"
    );
    let id = stuck[0].id;

    let started = Instant::now();
    let rescuer = books.start_instance("rescuer", None).await;
    let limit =
        Duration::from_millis(STALE_AFTER_MS + 2 * SWEEP_INTERVAL_MS) + Duration::from_secs(5);
    let left = limit.saturating_sub(started.elapsed());
    let transfer = support::poll_until(left, Duration::from_millis(50), async || {
        let t = store.transfers().transfer(id).await.unwrap().unwrap();
        if t.state.is_terminal() { Ok(t) } else { Err(t) }
    })
    .await
    .unwrap_or_else(|t| panic!("not recovered within {limit:?}: {:?}", t.state));
    let owner = transfer.owner.as_deref().unwrap_or_default();
    assert!(owner.starts_with("rescuer/"), "{owner}");

    let read = async |store: &Store, id: &str| {
        store
            .accounts()
            .account(&support::values::account(id))
            .await
            .unwrap()
            .unwrap()
    };
    let accounts = [
        read(&books.a, "a").await,
        read(&books.b, "b").await,
        read(&books.a, "c").await,
    ];
    for account in &accounts {
        assert!(
            account.pending_transactions.is_empty() && account.incoming == 0,
            "left on {} after {step}: {account:?}",
            account.id
        );
    }
    let balances: Vec<i64> = accounts.iter().map(|a| a.balance).collect();
    let done = transfer.state == transfer_service::domain::TransferState::Done;
    let expected = match (done, short) {
        (true, false) => vec![200, 200, 100],
        (true, true) => panic!("a transfer a cannot fund ended done after {step}"),
        (false, _) => vec![500, 0, 0],
    };
    assert_eq!(balances, expected, "all or nothing after a crash at {step}");

    let ledger = books.ledger().await;
    let found = ledger::check_ledger(&ledger, std::slice::from_ref(&transfer), 500);
    assert!(
        found.violations.is_empty(),
        "the ledger after a crash at {step} and its recovery: {:#?}\n{}",
        found.violations,
        ledger.describe()
    );
    for account in ["a", "b", "c"] {
        let answered = ledger::read_via_api(&http, &rescuer.base, account, 1)
            .await
            .unwrap();
        assert!(
            answered.paging.violations.is_empty(),
            "{:?}",
            answered.paging
        );
        let same = ledger::check_same_entries(&ledger, account, &answered.entries);
        assert!(same.violations.is_empty(), "{:?}", same.violations);
    }
    transfer.state.to_string()
}

macro_rules! legs_crash_test {
    ($name:ident, $step:expr, $short:expr, $left_in:literal, $expected:literal) => {
        mod $name {
            use super::*;

            #[tokio::test]
            async fn within_one_deployment() {
                let layout = Layout::OneDeployment;
                let ended = crash_legs_and_recover(layout, $step, $short, $left_in).await;
                assert_eq!(ended, $expected);
            }

            #[tokio::test]
            async fn across_deployments() {
                let layout = Layout::Across;
                let ended = crash_legs_and_recover(layout, $step, $short, $left_in).await;
                assert_eq!(ended, $expected);
            }
        }
    };
}

// Before the commit point a recoverer carries the transfer through; a crash in the
// middle of the prepares (some sent, some not) included.
legs_crash_test!(
    legs_crashed_after_insert_end_done,
    Point::AfterInsert,
    false,
    // A new transfer is inserted `pending`, owned by the instance that inserts it.
    "pending",
    "done"
);
legs_crash_test!(
    legs_crashed_after_pending_end_done,
    Point::AfterPending,
    false,
    "pending",
    "done"
);
legs_crash_test!(
    legs_crashed_amid_the_prepares_end_done,
    Point::BeforeCredit,
    false,
    "pending",
    "done"
);
legs_crash_test!(
    legs_crashed_after_every_prepare_end_done,
    Point::AfterDebit,
    false,
    "pending",
    "done"
);
// After it, the settles are finished; a crash in the middle of them included.
legs_crash_test!(
    legs_crashed_after_the_commit_end_done,
    Point::AfterApplied,
    false,
    "applied",
    "done"
);
legs_crash_test!(
    legs_crashed_amid_the_settles_end_done,
    Point::BeforeCapture,
    false,
    "applied",
    "done"
);
legs_crash_test!(
    legs_crashed_after_the_settles_end_done,
    Point::AfterPull,
    false,
    "applied",
    "done"
);
// A party short of funds: the rollback is finished, a crash in its middle included.
legs_crash_test!(
    legs_crashed_after_canceling_end_canceled,
    Point::AfterCanceling,
    true,
    "canceling",
    "canceled"
);
legs_crash_test!(
    legs_crashed_amid_the_undos_end_canceled,
    Point::BeforeUndo,
    true,
    "canceling",
    "canceled"
);
legs_crash_test!(
    legs_crashed_after_the_undos_end_canceled,
    Point::AfterUndoSource,
    true,
    "canceling",
    "canceled"
);

/// Crashes an instance at `step` while it does `what` with a multi-leg hold
/// (`docs/legs.md`): a (500) pays b 300 and b pays c 100, so 300 is reserved out of a
/// and room kept for 200 on b and 100 on c. Across deployments, a and c live on `us`
/// (which logs the hold) and b on `eu`. A second instance must bring the hold to where
/// `what` leads (a capture is of the whole), with every party's amounts exactly right
/// and the ledger explaining them.
async fn crash_legs_hold_and_recover(layout: Layout, step: Point, what: HoldStep) {
    use transfer_service::domain::{CancelReason, TransferState};
    let books = Books::new(layout).await;
    let http = reqwest::Client::new();
    let mut doomed = books.start_instance("doomed", Some(step)).await;
    books.open_accounts(&http, &doomed).await;
    open_c(&http, &doomed, layout).await;
    let expires_in_ms = if what == HoldStep::Expire {
        1_000
    } else {
        60_000
    };
    let legs = json!([
        { "source": "a", "destination": "b", "amount": 300 },
        { "source": "b", "destination": "c", "amount": 100 },
    ]);
    let created = http
        .post(format!("{}/transfers", doomed.base))
        .json(&json!({ "legs": legs, "hold": { "expiresInMs": expires_in_ms } }))
        .send()
        .await;
    let store = &books.a;
    let listed = store
        .transfers()
        .list_transfers(&Default::default(), 10)
        .await
        .unwrap();
    assert_eq!(listed.len(), 1, "one hold inserted, where a lives");
    let id = listed[0].id;
    match what {
        HoldStep::Create => assert!(created.is_err(), "no crash at {step}: {created:?}"),
        HoldStep::Capture | HoldStep::Void => {
            assert_eq!(created.unwrap().status(), 201);
            let action = if what == HoldStep::Capture {
                "capture"
            } else {
                "void"
            };
            let answer = http
                .post(format!("{}/transfers/{id}/{action}", doomed.base))
                .json(&json!({}))
                .send()
                .await;
            assert!(answer.is_err(), "no crash at {step}: {answer:?}");
        }
        HoldStep::Expire => assert_eq!(created.unwrap().status(), 201),
    }
    let status = doomed.child.wait().unwrap();
    assert!(!status.success(), "crashed instance exited {status}");

    let started = Instant::now();
    let rescuer = books.start_instance("rescuer", None).await;
    let limit =
        Duration::from_millis(STALE_AFTER_MS + 2 * SWEEP_INTERVAL_MS) + Duration::from_secs(5);
    let left = limit.saturating_sub(started.elapsed());
    let ended = support::poll_until(left, Duration::from_millis(50), async || {
        let t = store.transfers().transfer(id).await.unwrap().unwrap();
        if t.state.is_at_rest() { Ok(t) } else { Err(t) }
    })
    .await
    .unwrap_or_else(|t| panic!("not recovered within {limit:?}: {t:?}"));
    let amounts = [
        account_amounts(&books.a, "a").await,
        account_amounts(&books.b, "b").await,
        account_amounts(&books.a, "c").await,
    ];
    match what {
        HoldStep::Create => {
            assert_eq!(ended.state, TransferState::Held, "{ended:?}");
            let held = [(500, 300, 0, 1), (0, 0, 200, 1), (0, 0, 100, 1)];
            assert_eq!(amounts, held, "after {step}");
        }
        HoldStep::Capture => {
            assert_eq!(ended.state, TransferState::Done, "{ended:?}");
            let moved = [(200, 0, 0, 0), (200, 0, 0, 0), (100, 0, 0, 0)];
            assert_eq!(amounts, moved, "after {step}");
        }
        HoldStep::Void | HoldStep::Expire => {
            let reason = if what == HoldStep::Void {
                CancelReason::Voided
            } else {
                CancelReason::Expired
            };
            assert_eq!(
                (ended.state, ended.reason),
                (TransferState::Canceled, Some(reason))
            );
            let released = [(500, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0)];
            assert_eq!(amounts, released, "after {step}");
        }
    }
    let ledger = books.ledger().await;
    let found = ledger::check_ledger(&ledger, std::slice::from_ref(&ended), 500);
    assert!(
        found.violations.is_empty(),
        "the ledger after a crash at {step} and its recovery: {:#?}\n{}",
        found.violations,
        ledger.describe()
    );
    for account in ["a", "b", "c"] {
        let answered = ledger::read_via_api(&http, &rescuer.base, account, 1)
            .await
            .unwrap();
        let same = ledger::check_same_entries(&ledger, account, &answered.entries);
        assert!(same.violations.is_empty(), "{:?}", same.violations);
    }
}

macro_rules! legs_hold_crash_test {
    ($name:ident, $step:expr, $what:expr) => {
        mod $name {
            use super::*;

            #[tokio::test]
            async fn within_one_deployment() {
                crash_legs_hold_and_recover(Layout::OneDeployment, $step, $what).await;
            }

            #[tokio::test]
            async fn across_deployments() {
                crash_legs_hold_and_recover(Layout::Across, $step, $what).await;
            }
        }
    };
}

// Reserving: a recoverer carries it to `held`, a crash amid the reservations included.
legs_hold_crash_test!(
    a_multi_leg_hold_crashed_after_pending_is_reserved,
    Point::AfterPending,
    HoldStep::Create
);
legs_hold_crash_test!(
    a_multi_leg_hold_crashed_amid_the_reservations_is_reserved,
    Point::BeforeCredit,
    HoldStep::Create
);
legs_hold_crash_test!(
    a_multi_leg_hold_crashed_after_every_reservation_is_reserved,
    Point::AfterDebit,
    HoldStep::Create
);
// Capturing the whole: finished, a crash amid the parties' captures included.
legs_hold_crash_test!(
    a_multi_leg_capture_crashed_after_winning_the_hold_is_finished,
    Point::AfterResolve,
    HoldStep::Capture
);
legs_hold_crash_test!(
    a_multi_leg_capture_crashed_amid_the_captures_is_finished,
    Point::BeforeCapture,
    HoldStep::Capture
);
legs_hold_crash_test!(
    a_multi_leg_capture_crashed_after_every_capture_is_finished,
    Point::AfterCaptureDestination,
    HoldStep::Capture
);
// Voiding or expiring: every release finished, a crash amid them included.
legs_hold_crash_test!(
    a_multi_leg_void_crashed_after_winning_the_hold_is_finished,
    Point::AfterResolve,
    HoldStep::Void
);
legs_hold_crash_test!(
    a_multi_leg_void_crashed_amid_the_releases_is_finished,
    Point::BeforeUndo,
    HoldStep::Void
);
legs_hold_crash_test!(
    a_multi_leg_void_crashed_after_the_paying_releases_is_finished,
    Point::AfterUndoSource,
    HoldStep::Void
);
legs_hold_crash_test!(
    a_multi_leg_expiry_crashed_after_winning_the_hold_is_finished,
    Point::AfterResolve,
    HoldStep::Expire
);

/// A crash point that does not exist (misspelt, or a name a point no longer has) would
/// never fire, and the crash test around it would fail far from the cause: the instance
/// stops at start instead, naming the points there are. No database: it stops before
/// connecting (a short patience bounds the wait if it did not stop).
#[test]
fn an_instance_asked_to_crash_at_an_unknown_point_stops_at_start_naming_the_points() {
    let out = std::process::Command::new(support::service_binary!())
        .env("MONGODB_URI", "mongodb://127.0.0.1:9/")
        .env_remove("DEPLOYMENTS")
        .env("BIND_ADDR", "127.0.0.1:0")
        .env("STARTUP_PATIENCE_MS", "2000")
        .env("CRASH_AT", "after_debt")
        .output()
        .expect("run transfer-service");
    let told = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it started: {told}");
    assert!(told.contains("\"after_debt\""), "{told}");
    for point in Point::ALL {
        assert!(told.contains(point.name()), "{point} not named: {told}");
    }
}
