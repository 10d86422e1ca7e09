//! `TRANSFER_STRATEGY=native`: one multi-document transaction per transfer. It must give
//! the same answers and leave the same documents as the two-phase path, keep money
//! conserved under concurrent load on hot accounts (write conflicts are retried), honour
//! idempotency keys, and move nothing when an account refuses or when the transaction
//! keeps conflicting until it gives up.

use std::time::Duration;

use mongodb::bson::{Document, doc};
use serde_json::{Value, json};
use transfer_service::domain::{CancelReason, Strategy, TransferState};
use transfer_service::store::StoreError;
use transfer_service::store::native::AtomicOutcome;

use crate::assert_problem;
use support::values::initial;
use support::{TestApp, spawn_app_with};

async fn native_app() -> TestApp {
    spawn_app_with(|s| s.strategy = Strategy::Native).await
}

#[tokio::test]
async fn a_native_transfer_answers_201_done_and_moves_the_money() {
    let app = native_app().await;
    app.open_account("alice", 1000).await;
    app.open_account("bob", 0).await;
    let (status, body) = app.transfer("alice", "bob", 250).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["state"], "done");
    assert_eq!(body["amount"], 250);
    assert_eq!(app.balance("alice").await, 750);
    assert_eq!(app.balance("bob").await, 250);
    let stored = app
        .store
        .transfers()
        .transfer(body["id"].as_str().unwrap().parse().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored.state, TransferState::Done);
    // Stamped by the database's clock when it was made, as a two-phase transfer is
    // (not left at the epoch an unrecorded transfer carries).
    let stamped_after_creation = stored.last_modified - stored.created_at;
    assert!(
        stamped_after_creation.num_seconds().abs() < 60,
        "created {}, last modified {}",
        stored.created_at,
        stored.last_modified
    );
    let owner = stored.owner.as_deref().unwrap_or_default();
    assert!(
        owner.starts_with(&format!("{}/", app.instance_id)),
        "{owner}"
    );
    assert_eq!(app.accounts_with_pending().await, Vec::<String>::new());
}

/// The setting takes effect: a native transfer never takes a two-phase step. A pause
/// armed at the two-phase debit would stop a two-phase transfer there (and this request
/// with it); the native one is answered without reaching it.
#[tokio::test]
async fn a_native_transfer_takes_no_two_phase_step() {
    use transfer_service::failpoints::{self, Point};
    let app = native_app().await;
    app.open_account("alice", 1000).await;
    app.open_account("bob", 0).await;
    let mut paused = failpoints::pause(&app.instance_id, Point::AfterDebit);
    let (status, body) =
        tokio::time::timeout(Duration::from_secs(20), app.transfer("alice", "bob", 250))
            .await
            .expect("answered: the transfer did not stop at the two-phase debit");
    assert_eq!(status, 201, "{body}");
    paused.resume();
    assert_eq!(app.balance("bob").await, 250);
}

/// The answer is 422 `code` naming the transfer, which is recorded `canceled` for
/// `reason`, as the two-phase path records it.
async fn assert_inserted_canceled(
    app: &TestApp,
    response: reqwest::Response,
    code: &str,
    reason: CancelReason,
) {
    let problem = assert_problem(response, 422, code).await;
    let id = problem["transferId"].as_str().expect("transferId");
    let stored = app
        .store
        .transfers()
        .transfer(id.parse().unwrap())
        .await
        .unwrap();
    let stored = stored.expect("the refused transfer is recorded");
    assert_eq!(stored.state, TransferState::Canceled);
    assert_eq!(stored.reason, Some(reason));
    // Inserted by the instance that refused it (`application`), as the two-phase path
    // records it.
    let owner = stored.owner.as_deref().unwrap_or_default();
    assert!(owner.starts_with(&app.instance_id), "recorded by {owner:?}");
}

#[tokio::test]
async fn a_native_transfer_without_funds_is_inserted_canceled_and_moves_nothing() {
    let app = native_app().await;
    app.open_account("alice", 100).await;
    app.open_account("bob", 0).await;
    let response = app
        .post_json(
            "/transfers",
            json!({ "source": "alice", "destination": "bob", "amount": 101 }),
        )
        .await;
    assert_inserted_canceled(
        &app,
        response,
        "insufficient_funds",
        CancelReason::InsufficientFunds,
    )
    .await;
    assert_eq!(app.balance("alice").await, 100);
    assert_eq!(app.balance("bob").await, 0);
}

#[tokio::test]
async fn a_native_retry_with_the_same_key_replays_and_moves_money_once() {
    let app = native_app().await;
    app.open_account("alice", 1000).await;
    app.open_account("bob", 0).await;
    let body = json!({ "source": "alice", "destination": "bob", "amount": 100 });
    let mut ids = Vec::new();
    for attempt in 0..2 {
        let response = app
            .http
            .post(app.url("/transfers"))
            .header("idempotency-key", "native-1")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        assert_eq!(
            response.headers().contains_key("idempotent-replayed"),
            attempt == 1
        );
        let answer: Value = response.json().await.unwrap();
        ids.push(answer["id"].as_str().unwrap().to_owned());
    }
    assert_eq!(ids[0], ids[1]);
    assert_eq!(app.balance("bob").await, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_native_transfers_on_hot_accounts_keep_the_total() {
    let app = native_app().await;
    for id in ["a", "b", "c"] {
        app.open_account(id, 300).await;
    }
    let mut tasks = Vec::new();
    for i in 0..60 {
        let (source, destination) = [("a", "b"), ("b", "c"), ("c", "a"), ("b", "a")][i % 4];
        let http = app.http.clone();
        let url = app.url("/transfers");
        tasks.push(tokio::spawn(async move {
            http.post(url)
                .json(&json!({ "source": source, "destination": destination, "amount": 40 }))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }));
    }
    let mut done = 0;
    for task in tasks {
        let status = task.await.unwrap();
        assert!(matches!(status, 201 | 422), "status {status}");
        done += usize::from(status == 201);
    }
    assert!(done > 0);
    assert_eq!(app.total_balance().await, 900);
    for id in ["a", "b", "c"] {
        assert!(app.balance(id).await >= 0);
    }
    let transfers = app
        .store
        .transfers()
        .list_transfers(&Default::default(), 100)
        .await
        .unwrap();
    assert_eq!(transfers.len(), 60, "every request is recorded once");
    let done_stored = transfers
        .iter()
        .filter(|t| t.state == TransferState::Done)
        .count();
    assert_eq!(done_stored, done);
}

#[tokio::test]
async fn a_native_transfer_is_cancelled_by_a_reversal() {
    let app = native_app().await;
    app.open_account("alice", 1000).await;
    app.open_account("bob", 0).await;
    let (_, body) = app.transfer("alice", "bob", 300).await;
    let id = body["id"].as_str().unwrap();
    let response = app
        .http
        .post(app.url(&format!("/transfers/{id}/cancel")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let original: Value = response.json().await.unwrap();
    assert!(original["reversedBy"].is_string(), "{original}");
    assert_eq!(app.balance("alice").await, 1000);
    assert_eq!(app.balance("bob").await, 0);
}

#[tokio::test]
async fn a_native_transfer_to_an_account_that_vanished_is_refused_as_unknown_and_moves_nothing() {
    // The service remembers the accounts' currencies, so a transfer to an account deleted
    // behind its back reaches the transaction, whose credit finds no account: the
    // transfer is recorded canceled with `account_not_found` and the debit is undone.
    let app = native_app().await;
    app.open_account("alice", 1000).await;
    app.open_account("bob", 0).await;
    let (status, body) = app.transfer("alice", "bob", 100).await;
    assert_eq!(status, 201, "{body}");
    app.store
        .database()
        .collection::<Document>("accounts")
        .delete_one(doc! { "_id": "bob" })
        .await
        .unwrap();

    let response = app
        .post_json(
            "/transfers",
            json!({ "source": "alice", "destination": "bob", "amount": 200 }),
        )
        .await;

    assert_inserted_canceled(
        &app,
        response,
        "unknown_account",
        CancelReason::AccountNotFound,
    )
    .await;
    assert_eq!(app.balance("alice").await, 900, "the debit is not kept");
}

#[tokio::test]
async fn a_native_transfer_past_the_largest_balance_is_refused_and_moves_nothing() {
    let app = native_app().await;
    app.open_account("alice", 10).await;
    app.open_account("full", transfer_service::domain::MAX_MONEY)
        .await;

    let response = app
        .post_json(
            "/transfers",
            json!({ "source": "alice", "destination": "full", "amount": 1 }),
        )
        .await;

    assert_inserted_canceled(
        &app,
        response,
        "balance_overflow",
        CancelReason::BalanceOverflow,
    )
    .await;
    assert_eq!(app.balance("alice").await, 10);
    assert_eq!(
        app.balance("full").await,
        transfer_service::domain::MAX_MONEY
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_native_requests_with_one_key_make_exactly_one_transfer() {
    // The losers' inserts meet the winner's key inside their transactions (as a write
    // conflict, retried, or as a duplicate key): each is answered with the winner's
    // transfer, and the money moves once.
    let app = native_app().await;
    app.open_account("alice", 1000).await;
    app.open_account("bob", 0).await;
    let body = json!({ "source": "alice", "destination": "bob", "amount": 250 });
    let requests = (0..20).map(|_| {
        let http = app.http.clone();
        let url = app.url("/transfers");
        let body = body.clone();
        tokio::spawn(async move {
            let response = http
                .post(url)
                .header("idempotency-key", "native-same-for-all")
                .json(&body)
                .send()
                .await
                .expect("request");
            let status = response.status().as_u16();
            let text = response.text().await.unwrap();
            (status, text)
        })
    });

    let mut ids = Vec::new();
    for answer in futures::future::join_all(requests).await {
        let (status, text) = answer.expect("task");
        assert_eq!(status, 201, "{text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(body["state"], "done", "{body}");
        ids.push(body["id"].as_str().unwrap().to_owned());
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "every answer names one transfer: {ids:?}");
    assert_eq!(app.balance("alice").await, 750);
    assert_eq!(app.balance("bob").await, 250);
    assert_eq!(app.total_balance().await, 1000);
}

#[tokio::test]
async fn a_native_transaction_that_keeps_conflicting_gives_up_contended_and_moves_nothing() {
    // Another transaction holds an uncommitted write on the source account, so every run
    // of the transfer's transaction meets a write conflict. The driver retries it; past
    // the time limit the transfer gives up as contended (503 `contended`: a lost race,
    // not a database that is down) and nothing of it is stored. Once the other
    // transaction ends, the same transfer goes through.
    let app = native_app().await;
    app.open_account("alice", 1000).await;
    app.open_account("bob", 0).await;
    // The recorder takes the accounts' opening marks off first: a write outside a
    // transaction to a document the transaction has written waits for it to end (and on
    // SecantusDB, which writes one command at a time, every write waits behind it).
    crate::events::every_due_event_recorded(&app).await;
    let accounts = app.store.database().collection::<Document>("accounts");
    let mut holder = app.store.database().client().start_session().await.unwrap();
    holder.start_transaction().await.unwrap();
    accounts
        .update_one(doc! { "_id": "alice" }, doc! { "$set": { "held": true } })
        .session(&mut holder)
        .await
        .unwrap();
    let transfer = initial("alice", "bob", 100);

    let started = std::time::Instant::now();
    let gave_up = app
        .store
        .atomic()
        .transfer_atomically_within(&transfer, "test", Duration::from_millis(500))
        .await;

    assert!(
        matches!(gave_up, Err(StoreError::Contended { transfer: None, .. })),
        "{gave_up:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "gave up after {:?}",
        started.elapsed()
    );
    assert!(
        app.store
            .transfers()
            .transfer(transfer.id)
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(app.balance("alice").await, 1000);
    assert_eq!(app.balance("bob").await, 0);

    holder.abort_transaction().await.unwrap();
    let outcome = app
        .store
        .atomic()
        .transfer_atomically(&transfer, "test")
        .await
        .unwrap();
    assert!(matches!(outcome, AtomicOutcome::Done(_)), "{outcome:?}");
    assert_eq!(app.balance("alice").await, 900);
    assert_eq!(app.balance("bob").await, 100);
}

/// Held money is not spendable through the native strategy either: its debit keeps the
/// same invariant as the two-phase one (available balance, not balance).
#[tokio::test]
async fn a_native_transfer_cannot_spend_held_money() {
    let app = native_app().await;
    app.open_account("alice", 1000).await;
    app.open_account("bob", 0).await;
    let hold = json!({ "source": "alice", "destination": "bob", "amount": 800, "hold": {} });
    let response = app.post_json("/transfers", hold).await;
    assert_eq!(response.status(), 201);

    let refused = app
        .post_json(
            "/transfers",
            json!({ "source": "alice", "destination": "bob", "amount": 300 }),
        )
        .await;

    assert_inserted_canceled(
        &app,
        refused,
        "insufficient_funds",
        CancelReason::InsufficientFunds,
    )
    .await;
    assert_eq!(app.balance("alice").await, 1000);
    let (status, body) = app.transfer("alice", "bob", 200).await;
    assert_eq!(status, 201, "the rest is spendable: {body}");
}

/// The ledger of a native transfer: one `debit` and one `credit` entry each, numbered
/// without gaps, each the previous values plus its change, the last equal to the stored
/// account; also after the entry copier moved the older entries out of the account
/// documents and a reversal (two-phase steps) joined them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn native_transfers_keep_a_ledger_numbered_without_gaps() {
    let app = native_app().await;
    for id in ["a", "b"] {
        app.open_account(id, 10_000).await;
    }
    let mut tasks = Vec::new();
    for i in 0..40 {
        let (source, destination) = if i % 2 == 0 { ("a", "b") } else { ("b", "a") };
        let http = app.http.clone();
        let url = app.url("/transfers");
        tasks.push(tokio::spawn(async move {
            let response = http
                .post(url)
                .json(&json!({ "source": source, "destination": destination, "amount": 10 + i }))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 201);
            let body: Value = response.json().await.unwrap();
            body["id"].as_str().unwrap().to_owned()
        }));
    }
    let mut ids = Vec::new();
    for task in tasks {
        ids.push(task.await.unwrap());
    }
    let reversed = &ids[0];
    let response = app
        .http
        .post(app.url(&format!("/transfers/{reversed}/cancel")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let reversal: Value = response.json().await.unwrap();
    let reversal = reversal["reversedBy"].as_str().unwrap().to_owned();
    ids.push(reversal);
    for account in ["a", "b"] {
        let page: Value = app
            .get(&format!("/accounts/{account}/entries?limit=1000"))
            .await
            .json()
            .await
            .unwrap();
        let entries = page["items"].as_array().unwrap();
        assert_eq!(
            entries.len(),
            1 + 41,
            "{account}: the opening and one per transfer"
        );
        let mut before = (0_i64, 0_i64, 0_i64);
        for (i, e) in entries.iter().enumerate() {
            assert_eq!(e["seq"], i as u64 + 1, "{account}: {e}");
            let after = (
                before.0 + e["balanceChange"].as_i64().unwrap(),
                before.1 + e["pendingDebitsChange"].as_i64().unwrap(),
                before.2 + e["pendingCreditsChange"].as_i64().unwrap(),
            );
            let stored = (
                e["balance"].as_i64().unwrap(),
                e["pendingDebits"].as_i64().unwrap(),
                e["pendingCredits"].as_i64().unwrap(),
            );
            assert_eq!(stored, after, "{account}: {e}");
            before = after;
        }
        for id in &ids {
            let of_it = entries.iter().filter(|e| e["transferId"] == *id).count();
            assert_eq!(of_it, 1, "{account}: transfer {id} has one entry here");
        }
        let stored: Value = app
            .get(&format!("/accounts/{account}"))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(stored["balance"], before.0);
        assert_eq!(stored["seq"], entries.len());
    }
    let moved = app
        .store
        .database()
        .collection::<Document>("entries")
        .count_documents(doc! {})
        .await
        .unwrap();
    assert!(moved >= 32, "the entry copier moved their entries: {moved}");
}

/// An account that native transactions do not change (here bob, touched only by holds,
/// which take the two-phase steps under every strategy) still has its entries moved out
/// of its document, as are those of native transfers, also on an account both change at
/// once (alice): no document grows with its account's history (it would reach MongoDB's
/// 16 MiB, and every write to it fail), and no transaction stalls on the copier.
#[tokio::test]
async fn under_native_the_documents_of_accounts_touched_by_holds_stay_small() {
    let app = native_app().await;
    app.open_account("alice", 100_000).await;
    app.open_account("bob", 0).await;
    app.open_account("carol", 100_000).await;
    let hold_and_void = async |n: i64| {
        let hold = json!({ "source": "alice", "destination": "bob", "amount": n, "hold": {} });
        let response = app.post_json("/transfers", hold).await;
        assert_eq!(response.status(), 201);
        let body: Value = response.json().await.unwrap();
        let id = body["id"].as_str().unwrap().to_owned();
        let voided = app
            .http
            .post(app.url(&format!("/transfers/{id}/void")))
            .send()
            .await
            .unwrap();
        assert_eq!(voided.status(), 200);
    };
    for n in 1..=30 {
        let (_, (status, body)) =
            futures::future::join(hold_and_void(n), app.transfer("carol", "alice", n)).await;
        assert_eq!(status, 201, "{body}");
    }
    // Two entries a hold on each side, one a native transfer on each: 91, 61 and 31.
    // Once the copier has copied them, the next change leaves them out.
    let small = |seqs: &[i64]| seqs.len() <= 8;
    let mut last = Vec::new();
    for n in 1..=20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        hold_and_void(100 + n).await;
        let (status, body) = app.transfer("carol", "alice", 100 + n).await;
        assert_eq!(status, 201, "{body}");
        last = Vec::new();
        for account in ["alice", "bob", "carol"] {
            last.push((
                account,
                crate::ledger::seqs_in_document(&app, account).await,
            ));
        }
        if last.iter().all(|(_, seqs)| small(seqs)) {
            break;
        }
    }
    assert!(
        last.iter().all(|(_, seqs)| small(seqs)),
        "the entries in the documents: {last:?}"
    );
    // And every entry is still read, numbered without a gap.
    for (account, _) in &last {
        let page: Value = app
            .get(&format!("/accounts/{account}/entries?limit=1000"))
            .await
            .json()
            .await
            .unwrap();
        let seqs: Vec<u64> = page["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["seq"].as_u64().unwrap())
            .collect();
        let stored: Value = app
            .get(&format!("/accounts/{account}"))
            .await
            .json()
            .await
            .unwrap();
        let seq = stored["seq"].as_u64().unwrap();
        assert!(seq > 30, "{account}: {seq}");
        assert_eq!(seqs, (1..=seq).collect::<Vec<_>>(), "{account}");
    }
}
