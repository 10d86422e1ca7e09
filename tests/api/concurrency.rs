//! Many requests at once, on a multi-threaded runtime.
//!
//! The invariants protected here, whatever the interleaving: money is never created or
//! destroyed (the total of all balances never changes), no balance is ever negative,
//! every transfer ends `done` or `canceled` and its answer says which, no account keeps
//! a pending marker, and a transfer is reversed at most once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use mongodb::bson::oid::ObjectId;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use transfer_service::domain::{CancelReason, TransferState};
use transfer_service::service::TransferService;

use crate::walk_pages;
use support::values::transfer_id;
use support::{TestApp, spawn_app, spawn_app_with};

const ACCOUNTS: [&str; 4] = ["alice", "bob", "carol", "dave"];

/// Reads every balance through `GET /accounts` until `stop` is set; returns how many
/// samples it took. Panics on a negative balance.
async fn sample_balances(http: reqwest::Client, url: String, stop: Arc<AtomicBool>) -> usize {
    let mut samples = 0;
    while !stop.load(Ordering::Relaxed) {
        let page: Value = http
            .get(&url)
            .send()
            .await
            .expect("request")
            .json()
            .await
            .expect("json");
        for account in page["items"].as_array().expect("items") {
            let balance = account["balance"].as_i64().expect("balance");
            assert!(balance >= 0, "a balance went negative: {account}");
        }
        samples += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    samples
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_transfers_never_create_or_destroy_money() {
    let app = spawn_app().await;
    for id in ACCOUNTS {
        app.open_account(id, 500).await;
    }
    let total_before = app.total_balance().await;

    let stop = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn(sample_balances(
        app.http.clone(),
        app.url("/accounts?limit=100"),
        stop.clone(),
    ));

    let mut rng = StdRng::seed_from_u64(0x5eed);
    let requests: Vec<_> = (0..80)
        .map(|_| {
            let source = rng.random_range(0..ACCOUNTS.len());
            let hop = rng.random_range(1..ACCOUNTS.len());
            let destination = (source + hop) % ACCOUNTS.len();
            // Up to 400 out of 500: many fit, many do not once the source was drained.
            let amount: i64 = rng.random_range(1..=400);
            let http = app.http.clone();
            let url = app.url("/transfers");
            let body = json!({
                "source": ACCOUNTS[source],
                "destination": ACCOUNTS[destination],
                "amount": amount,
            });
            tokio::spawn(async move {
                let response = http.post(url).json(&body).send().await.expect("request");
                let status = response.status().as_u16();
                let text = response.text().await.unwrap();
                (status, text)
            })
        })
        .collect();
    let answers = futures::future::join_all(requests).await;
    stop.store(true, Ordering::Relaxed);
    let samples = sampler.await.expect("no negative balance was seen");
    assert!(samples > 0);

    let mut done = Vec::new();
    let mut canceled = Vec::new();
    for answer in answers {
        let (status, text) = answer.expect("task");
        let body: Value = serde_json::from_str(&text).unwrap();
        match status {
            201 => {
                assert_eq!(body["state"], "done", "{body}");
                done.push(body["id"].as_str().unwrap().to_owned());
            }
            422 => {
                assert_eq!(body["code"], "insufficient_funds", "{body}");
                canceled.push(body["transferId"].as_str().unwrap().to_owned());
            }
            other => panic!("unexpected answer {other}: {body}"),
        }
    }
    assert!(
        !done.is_empty() && !canceled.is_empty(),
        "the mix exercised both outcomes: {} done, {} canceled",
        done.len(),
        canceled.len()
    );

    for (ids, state) in [
        (&done, TransferState::Done),
        (&canceled, TransferState::Canceled),
    ] {
        for id in ids {
            let stored = app
                .store
                .transfers()
                .transfer(transfer_id(id))
                .await
                .unwrap()
                .expect("stored");
            assert_eq!(stored.state, state, "{stored:?}");
            if state == TransferState::Canceled {
                assert_eq!(stored.reason, Some(CancelReason::InsufficientFunds));
            }
        }
    }
    assert_eq!(
        walk_pages(&app, "/transfers?limit=100")
            .await
            .concat()
            .len(),
        80,
        "every request recorded exactly one transfer"
    );
    assert_eq!(app.total_balance().await, total_before);
    for id in ACCOUNTS {
        assert!(app.balance(id).await >= 0, "{id} is negative");
    }
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_debits_of_one_account_never_overdraw_it() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    for id in ["bob", "carol", "dave"] {
        app.open_account(id, 0).await;
    }

    // Thirty debits of 100 against 1 000: exactly ten can succeed.
    let requests = (0..30).map(|i| {
        let http = app.http.clone();
        let url = app.url("/transfers");
        let destination = ["bob", "carol", "dave"][i % 3];
        tokio::spawn(async move {
            http.post(url)
                .json(&json!({ "source": "alice", "destination": destination, "amount": 100 }))
                .send()
                .await
                .expect("request")
                .status()
                .as_u16()
        })
    });
    let statuses: Vec<u16> = futures::future::join_all(requests)
        .await
        .into_iter()
        .map(|s| s.expect("task"))
        .collect();

    assert_eq!(
        statuses.iter().filter(|s| **s == 201).count(),
        10,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 422).count(),
        20,
        "{statuses:?}"
    );
    assert_eq!(app.balance("alice").await, 0);
    assert_eq!(app.total_balance().await, 1_000);
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_cancels_of_a_done_transfer_reverse_it_exactly_once() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    // Bob holds more than the amount, so that a compensating transfer applied twice
    // would show in the balances instead of being refused for lack of funds.
    app.open_account("bob", 500).await;

    // Several rounds: the race is between requests, so one round may not meet it.
    for round in 1..=8 {
        let (status, original) = app.transfer("alice", "bob", 300).await;
        assert_eq!(status, 201, "{original}");
        let id = original["id"].as_str().unwrap().to_owned();

        let cancels = (0..10).map(|_| {
            let http = app.http.clone();
            let url = app.url(&format!("/transfers/{id}/cancel"));
            tokio::spawn(async move {
                let response = http.post(url).send().await.expect("request");
                let status = response.status().as_u16();
                (status, response.text().await.unwrap())
            })
        });
        let answers = futures::future::join_all(cancels).await;

        let mut reversals = Vec::new();
        for answer in answers {
            let (status, text) = answer.expect("task");
            assert_eq!(status, 200, "round {round}: {text}");
            let body: Value = serde_json::from_str(&text).unwrap();
            reversals.push(body["reversedBy"].as_str().expect("reversedBy").to_owned());
        }
        reversals.sort();
        reversals.dedup();
        assert_eq!(reversals.len(), 1, "round {round}: {reversals:?}");
        let reversal = app
            .store
            .transfers()
            .transfer(transfer_id(&reversals[0]))
            .await
            .unwrap()
            .expect("the reversal is stored");
        let accounts = app
            .store
            .accounts()
            .list_accounts(None, None, 10)
            .await
            .unwrap();
        assert_eq!(
            app.total_balance().await,
            1_500,
            "round {round}: money was created or destroyed\nreversal: {reversal:?}\naccounts: {accounts:?}"
        );
        assert_eq!(app.balance("alice").await, 1_000, "round {round}");
        assert_eq!(app.balance("bob").await, 500, "round {round}");
        assert_eq!(reversal.state, TransferState::Done, "round {round}");
        assert!(
            app.accounts_with_pending().await.is_empty(),
            "round {round}: {accounts:?}"
        );
    }
    assert_eq!(
        walk_pages(&app, "/transfers?limit=100")
            .await
            .concat()
            .len(),
        16,
        "eight transfers and one reversal each"
    );
}

/// Starts a transfer in the background and cancels it at once, racing its owner.
async fn transfer_and_cancel_at_once(app: &TestApp, amount: i64) -> (Value, Value) {
    let response = app
        .http
        .post(app.url("/transfers"))
        .header("prefer", "respond-async")
        .json(&json!({ "source": "alice", "destination": "bob", "amount": amount }))
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 202);
    let started: Value = response.json().await.unwrap();
    let id = started["id"].as_str().unwrap().to_owned();
    let response = app
        .http
        .post(app.url(&format!("/transfers/{id}/cancel")))
        .send()
        .await
        .expect("request");
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    assert_eq!(status, 200, "cancel {id}: {text}");
    (started, serde_json::from_str(&text).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_racing_a_running_transfer_always_leaves_the_money_where_it_started() {
    let app = spawn_app().await;
    app.open_account("alice", 10_000).await;
    app.open_account("bob", 0).await;

    for round in 1..=15 {
        let (_, canceled) = transfer_and_cancel_at_once(&app, round * 10).await;
        match canceled["state"].as_str() {
            // Rolled back before the credit landed.
            Some("canceled") => assert_eq!(canceled["reason"], "canceled_by_request"),
            // Or completed and reversed.
            Some("done") => assert!(canceled["reversedBy"].is_string(), "{canceled}"),
            _ => panic!("a cancel answers a terminal transfer: {canceled}"),
        }
        let id = canceled["id"].as_str().unwrap();
        let stored = app
            .store
            .transfers()
            .transfer(transfer_id(id))
            .await
            .unwrap()
            .unwrap();
        let accounts = app
            .store
            .accounts()
            .list_accounts(None, None, 10)
            .await
            .unwrap();
        assert!(
            app.accounts_with_pending().await.is_empty(),
            "round {round}: markers left after the cancel answered {canceled}\nstored: {stored:?}\naccounts: {accounts:?}"
        );
        assert!(stored.state.is_terminal(), "round {round}: {stored:?}");
        assert_eq!(app.balance("alice").await, 10_000, "round {round}");
        assert_eq!(app.balance("bob").await, 0, "round {round}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_driver_holding_an_outdated_copy_of_a_done_transfer_moves_no_money() {
    // Two tasks of one instance share its lease. The second read the transfer while the
    // first was still applying it, and runs it only once the first has finished (so it
    // never waits on the first's lock): every step it takes must be a no-op, because
    // `run` drives a transfer "from its stored state".
    let instance = format!("inst-{}", ObjectId::new().to_hex());
    let app = spawn_app_with(|settings| settings.instance_id = instance.clone()).await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 500).await;
    let (status, body) = app.transfer("alice", "bob", 300).await;
    assert_eq!(status, 201, "{body}");
    let id = transfer_id(body["id"].as_str().unwrap());
    let mut outdated = app
        .store
        .transfers()
        .transfer(id)
        .await
        .unwrap()
        .expect("stored");
    outdated.state = TransferState::Pending;
    outdated.last_modified = chrono::Utc::now();

    let bank = TransferService::new(app.store.clone(), instance.as_str(), Duration::from_secs(1));
    let finished = bank.driver().run(outdated).await.expect("run");

    assert_eq!(finished.state, TransferState::Done);
    assert_eq!(app.total_balance().await, 1_500);
    assert_eq!(app.balance("alice").await, 700, "debited twice");
    assert_eq!(app.balance("bob").await, 800, "credited twice");
    assert!(app.accounts_with_pending().await.is_empty());
}
