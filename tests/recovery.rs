//! Crash recovery, proven with fault injection: an instance built with the `failpoints`
//! feature aborts (as kill -9 would) right after a given protocol step; another instance
//! must then bring the transfer to its right terminal state, with every balance conserved
//! and no `pendingTransactions` entry left, within STALE_AFTER_MS plus two sweeps.

#![cfg(feature = "failpoints")]

use std::time::{Duration, Instant};

use serde_json::json;
use support::process::{Instance, InstanceConfig};
use support::{database_uri, fresh_database_name};
use transfer_service::store::Store;

const STALE_AFTER_MS: u64 = 1000;
const SWEEP_INTERVAL_MS: u64 = 100;

async fn start_instance(database: &str, name: &str, crash_at: Option<&str>) -> Instance {
    let mut config =
        InstanceConfig::new(support::service_binary!(), &database_uri(), database, name);
    config.crash_at = crash_at.map(str::to_owned);
    config.stale_after_ms = STALE_AFTER_MS;
    config.sweep_interval_ms = SWEEP_INTERVAL_MS;
    Instance::start(&config).await
}

/// Crashes an instance at `step` during a transfer of `amount` from a (balance 500) to
/// b (balance 0), recovers with a second instance, and returns the final transfer state.
async fn crash_and_recover(step: &str, amount: i64) -> String {
    let database = fresh_database_name();
    let http = reqwest::Client::new();
    let mut doomed = start_instance(&database, "doomed", Some(step)).await;
    for (id, balance) in [("a", 500), ("b", 0)] {
        let r = http
            .post(format!("{}/accounts", doomed.base))
            .json(&json!({ "id": id, "balance": balance }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
    }
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

    let store = Store::connect(&database_uri(), &database).await.unwrap();
    let stuck = store.list_transfers(&Default::default(), 10).await.unwrap();
    assert_eq!(stuck.len(), 1, "one transfer recorded");
    assert!(
        !stuck[0].state.is_terminal(),
        "crash at {step} left it unfinished"
    );
    let id = stuck[0].id;

    let started = Instant::now();
    let _rescuer = start_instance(&database, "rescuer", None).await;
    let limit =
        Duration::from_millis(STALE_AFTER_MS + 2 * SWEEP_INTERVAL_MS) + Duration::from_secs(5);
    let transfer = loop {
        let t = store.transfer(id).await.unwrap().unwrap();
        if t.state.is_terminal() {
            break t;
        }
        assert!(
            started.elapsed() < limit,
            "not recovered within {limit:?}: {:?}",
            t.state
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let owner = transfer.owner.as_deref().unwrap_or_default();
    assert!(owner.starts_with("rescuer/"), "{owner}");

    let a = store
        .account(&support::values::account("a"))
        .await
        .unwrap()
        .unwrap();
    let b = store
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
    transfer.state.to_string()
}

macro_rules! crash_test {
    ($name:ident, $step:literal, $amount:expr, $expected:literal) => {
        #[tokio::test]
        async fn $name() {
            assert_eq!(crash_and_recover($step, $amount).await, $expected);
        }
    };
}

// Forward: once recorded, a transfer the client asked for is carried through.
crash_test!(
    a_crash_after_insert_is_carried_through_to_done,
    "after_insert",
    200,
    "done"
);
crash_test!(
    a_crash_after_pending_is_carried_through_to_done,
    "after_pending",
    200,
    "done"
);
crash_test!(
    a_crash_after_debit_is_carried_through_to_done,
    "after_debit",
    200,
    "done"
);
crash_test!(
    a_crash_after_credit_is_carried_through_to_done,
    "after_credit",
    200,
    "done"
);
crash_test!(
    a_crash_after_applied_ends_done,
    "after_applied",
    200,
    "done"
);
crash_test!(
    a_crash_after_pulling_both_markers_ends_done,
    "after_pull",
    200,
    "done"
);
// Rollback: a transfer the source cannot fund rolls back; a crash mid-rollback is finished.
crash_test!(
    a_crash_after_canceling_ends_canceled,
    "after_canceling",
    900,
    "canceled"
);
crash_test!(
    a_crash_after_undo_destination_ends_canceled,
    "after_undo_destination",
    900,
    "canceled"
);
crash_test!(
    a_crash_after_undo_source_ends_canceled,
    "after_undo_source",
    900,
    "canceled"
);
