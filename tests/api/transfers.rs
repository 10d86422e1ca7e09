//! `POST /transfers`, `GET /transfers/{id}` and `GET /transfers`.
//!
//! Invariants protected here: a transfer moves exactly its amount from source to
//! destination or nothing at all; the total of all balances never changes; no account
//! is left with a pending marker; a refusal that recorded a transfer names it
//! (`transferId`) and the record says why it was canceled.

use std::time::Duration;

use serde_json::{Value, json};

use crate::{assert_problem, get_json, walk_pages};
use support::{TestApp, spawn_app};

const MAX_MONEY: i64 = 9_007_199_254_740_991;

/// How many transfers are stored, read straight from the database.
async fn stored_transfers(app: &TestApp) -> usize {
    app.store
        .transfers()
        .list_transfers(&Default::default(), 1_000)
        .await
        .unwrap()
        .len()
}

/// Sends `body` to `POST /transfers` as JSON.
async fn post_transfer(app: &TestApp, body: Value) -> reqwest::Response {
    app.post_json("/transfers", body).await
}

/// A transfer request with `body` is refused as an invalid `field`; nothing is recorded
/// and no balance moves.
async fn assert_refused_field(app: &TestApp, body: Value, field: &str) {
    let total = app.total_balance().await;
    let response = post_transfer(app, body.clone()).await;
    let problem = assert_problem(response, 422, "invalid_field").await;
    assert_eq!(problem["field"], field, "for {body}: {problem}");
    assert_eq!(stored_transfers(app).await, 0, "{body} recorded a transfer");
    assert_eq!(app.total_balance().await, total);
}

#[tokio::test]
async fn a_transfer_moves_the_amount_and_ends_done() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let (status, body) = app.transfer("alice", "bob", 300).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["state"], "done");
    assert_eq!(app.balance("alice").await, 700);
    assert_eq!(app.balance("bob").await, 300);
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test]
async fn a_done_transfer_answers_201_with_its_location_and_reads_back_the_same() {
    let app = spawn_app().await;
    app.open_account_in("alice", 1_000, "EUR").await;
    app.open_account_in("bob", 50, "EUR").await;

    let response = post_transfer(
        &app,
        json!({ "source": "alice", "destination": "bob", "amount": 250, "reference": "invoice 42" }),
    )
    .await;

    assert_eq!(response.status(), 201);
    let location = response.headers()["location"].to_str().unwrap().to_owned();
    let body: Value = response.json().await.unwrap();
    let id = body["id"].as_str().expect("an id").to_owned();
    assert_eq!(id.len(), 24, "{id}");
    assert!(id.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
    assert_eq!(location, format!("/transfers/{id}"));
    assert_eq!(body["state"], "done");
    assert_eq!(body["amount"], 250);
    assert_eq!(body["currency"], "EUR");
    assert_eq!(body["source"], "alice");
    assert_eq!(body["destination"], "bob");
    assert_eq!(body["reference"], "invoice 42");
    assert!(body.get("reason").is_none(), "{body}");

    let (status, fetched) = get_json(&app, &location).await;
    assert_eq!(status, 200, "{fetched}");
    assert_eq!(fetched, body, "the answer is the stored transfer");

    assert_eq!(app.balance("alice").await, 750);
    assert_eq!(app.balance("bob").await, 300);
    assert_eq!(app.total_balance().await, 1_050);
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test]
async fn a_transfer_naming_an_unknown_account_is_refused_and_inserts_nothing() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;

    for (source, destination, unknown) in [("ghost", "alice", "ghost"), ("alice", "ghost", "ghost")]
    {
        let response = post_transfer(
            &app,
            json!({ "source": source, "destination": destination, "amount": 10 }),
        )
        .await;
        let problem = assert_problem(response, 422, "unknown_account").await;
        assert!(
            problem["detail"].as_str().unwrap().contains(unknown),
            "{problem}"
        );
        assert!(problem.get("transferId").is_none(), "{problem}");
    }

    assert_eq!(stored_transfers(&app).await, 0);
    assert_eq!(app.balance("alice").await, 1_000);
}

#[tokio::test]
async fn a_transfer_to_the_same_account_is_refused() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;

    let response = post_transfer(
        &app,
        json!({ "source": "alice", "destination": "alice", "amount": 10 }),
    )
    .await;

    assert_problem(response, 422, "same_account").await;
    assert_eq!(stored_transfers(&app).await, 0);
    assert_eq!(app.balance("alice").await, 1_000);
}

#[tokio::test]
async fn a_transfer_between_currencies_is_refused() {
    let app = spawn_app().await;
    app.open_account_in("alice", 1_000, "USD").await;
    app.open_account_in("bob", 1_000, "EUR").await;

    let response = post_transfer(
        &app,
        json!({ "source": "alice", "destination": "bob", "amount": 10 }),
    )
    .await;

    assert_problem(response, 422, "currency_mismatch").await;
    assert_eq!(stored_transfers(&app).await, 0);
    assert_eq!(app.balance("alice").await, 1_000);
    assert_eq!(app.balance("bob").await, 1_000);
}

#[tokio::test]
async fn a_transfer_with_insufficient_funds_is_canceled_and_balances_are_untouched() {
    let app = spawn_app().await;
    app.open_account("alice", 100).await;
    app.open_account("bob", 5).await;

    let response = post_transfer(
        &app,
        json!({ "source": "alice", "destination": "bob", "amount": 101 }),
    )
    .await;

    let problem = assert_problem(response, 422, "insufficient_funds").await;
    let id = problem["transferId"]
        .as_str()
        .expect("the canceled transfer is named");
    let (status, transfer) = get_json(&app, &format!("/transfers/{id}")).await;
    assert_eq!(status, 200, "{transfer}");
    assert_eq!(transfer["state"], "canceled");
    assert_eq!(transfer["reason"], "insufficient_funds");
    assert_eq!(transfer["amount"], 101);

    assert_eq!(app.balance("alice").await, 100);
    assert_eq!(app.balance("bob").await, 5);
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test]
async fn a_transfer_of_the_whole_balance_empties_the_source() {
    let app = spawn_app().await;
    app.open_account("alice", 100).await;
    app.open_account("bob", 0).await;

    let (status, body) = app.transfer("alice", "bob", 100).await;

    assert_eq!(status, 201, "{body}");
    assert_eq!(app.balance("alice").await, 0);
    assert_eq!(app.balance("bob").await, 100);
}

#[tokio::test]
async fn an_amount_that_is_not_a_positive_safe_integer_is_refused_naming_amount() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;

    for bad in [
        json!(0),
        json!(-1),
        json!(1.5),
        json!("5"),
        json!(9_007_199_254_740_992_i64),
        json!(null),
        json!(1e30),
    ] {
        assert_refused_field(
            &app,
            json!({ "source": "alice", "destination": "bob", "amount": bad }),
            "amount",
        )
        .await;
    }
    assert_eq!(app.balance("alice").await, 1_000);
}

#[tokio::test]
async fn a_transfer_without_an_amount_is_refused_naming_amount() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    assert_refused_field(
        &app,
        json!({ "source": "alice", "destination": "bob" }),
        "amount",
    )
    .await;
    assert_refused_field(&app, json!({ "destination": "bob", "amount": 5 }), "source").await;
    assert_refused_field(
        &app,
        json!({ "source": "alice", "destination": "bob", "amount": 5, "memo": "x" }),
        "memo",
    )
    .await;
    assert_refused_field(
        &app,
        json!({ "source": "a b", "destination": "bob", "amount": 5 }),
        "source",
    )
    .await;
}

#[tokio::test]
async fn the_largest_safe_amount_is_accepted_when_funded() {
    let app = spawn_app().await;
    app.open_account("whale", MAX_MONEY).await;
    app.open_account("bob", 0).await;

    let (status, body) = app.transfer("whale", "bob", MAX_MONEY).await;

    assert_eq!(status, 201, "{body}");
    assert_eq!(body["amount"], MAX_MONEY);
    assert_eq!(app.balance("whale").await, 0);
    assert_eq!(app.balance("bob").await, MAX_MONEY);
    assert_eq!(app.total_balance().await, MAX_MONEY);
}

#[tokio::test]
async fn a_credit_past_the_largest_balance_is_canceled_and_balances_are_untouched() {
    let app = spawn_app().await;
    app.open_account("alice", 10).await;
    app.open_account("full", MAX_MONEY).await;

    let response = post_transfer(
        &app,
        json!({ "source": "alice", "destination": "full", "amount": 1 }),
    )
    .await;

    let problem = assert_problem(response, 422, "balance_overflow").await;
    let id = problem["transferId"]
        .as_str()
        .expect("the canceled transfer is named");
    let (status, transfer) = get_json(&app, &format!("/transfers/{id}")).await;
    assert_eq!(status, 200, "{transfer}");
    assert_eq!(transfer["state"], "canceled");
    assert_eq!(transfer["reason"], "balance_overflow");

    assert_eq!(app.balance("alice").await, 10);
    assert_eq!(app.balance("full").await, MAX_MONEY);
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test]
async fn a_body_that_is_not_json_is_400_malformed_json() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    for raw in [
        r#"{"source": "alice", "destination": "bob", "amount": 5"#,
        "not json",
        "",
    ] {
        let response = app
            .http
            .post(app.url("/transfers"))
            .header("content-type", "application/json")
            .body(raw)
            .send()
            .await
            .unwrap();
        assert_problem(response, 400, "malformed_json").await;
    }
    assert_eq!(stored_transfers(&app).await, 0);
    assert_eq!(app.balance("alice").await, 1_000);
}

#[tokio::test]
async fn a_body_that_is_not_declared_json_is_415_unsupported_media_type() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let body = r#"{"source": "alice", "destination": "bob", "amount": 5}"#;

    let without = app
        .http
        .post(app.url("/transfers"))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_problem(without, 415, "unsupported_media_type").await;

    for content_type in ["text/plain", "application/x-www-form-urlencoded"] {
        let response = app
            .http
            .post(app.url("/transfers"))
            .header("content-type", content_type)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_problem(response, 415, "unsupported_media_type").await;
    }

    assert_eq!(stored_transfers(&app).await, 0);
    assert_eq!(app.balance("alice").await, 1_000);
}

#[tokio::test]
async fn a_json_body_with_charset_is_accepted() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let response = app
        .http
        .post(app.url("/transfers"))
        .header("content-type", "application/json; charset=utf-8")
        .body(r#"{"source": "alice", "destination": "bob", "amount": 5}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(app.balance("bob").await, 5);
}

#[tokio::test]
async fn a_reference_over_140_characters_is_refused_naming_reference() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let too_long = "r".repeat(141);
    assert_refused_field(
        &app,
        json!({ "source": "alice", "destination": "bob", "amount": 5, "reference": too_long }),
        "reference",
    )
    .await;
    assert_refused_field(
        &app,
        json!({ "source": "alice", "destination": "bob", "amount": 5, "reference": "" }),
        "reference",
    )
    .await;
    assert_refused_field(
        &app,
        json!({ "source": "alice", "destination": "bob", "amount": 5, "reference": "line\nbreak" }),
        "reference",
    )
    .await;

    // 140 characters (not bytes) is the limit.
    let longest = "é".repeat(140);
    let response = post_transfer(
        &app,
        json!({ "source": "alice", "destination": "bob", "amount": 5, "reference": longest }),
    )
    .await;
    assert_eq!(response.status(), 201);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["reference"], longest.as_str());
}

/// Polls `GET path` until the transfer is terminal; panics after 10 s.
async fn poll_until_terminal(app: &TestApp, path: &str) -> Value {
    let (within, every) = (Duration::from_secs(10), Duration::from_millis(20));
    support::poll_until(within, every, async || {
        let (status, body) = get_json(app, path).await;
        assert_eq!(status, 200, "{body}");
        if body["state"] == "done" || body["state"] == "canceled" {
            Ok(body)
        } else {
            Err(body)
        }
    })
    .await
    .unwrap_or_else(|body| panic!("never finished: {body}"))
}

#[tokio::test]
async fn respond_async_answers_202_at_once_and_the_transfer_completes() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;

    let response = app
        .http
        .post(app.url("/transfers"))
        .header("prefer", "respond-async")
        .json(&json!({ "source": "alice", "destination": "bob", "amount": 400 }))
        .send()
        .await
        .unwrap();

    assert_eq!(response.status(), 202);
    assert_eq!(response.headers()["preference-applied"], "respond-async");
    let location = response.headers()["location"].to_str().unwrap().to_owned();
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        location,
        format!("/transfers/{}", body["id"].as_str().unwrap())
    );
    assert_ne!(
        body["state"], "done",
        "202 promises a transfer still running"
    );

    let finished = poll_until_terminal(&app, &location).await;
    assert_eq!(finished["state"], "done");
    assert_eq!(app.balance("alice").await, 600);
    assert_eq!(app.balance("bob").await, 400);
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test]
async fn respond_async_with_insufficient_funds_ends_canceled_with_nothing_moved() {
    let app = spawn_app().await;
    app.open_account("alice", 10).await;
    app.open_account("bob", 0).await;

    let response = app
        .http
        .post(app.url("/transfers"))
        .header("prefer", "respond-async")
        .json(&json!({ "source": "alice", "destination": "bob", "amount": 400 }))
        .send()
        .await
        .unwrap();

    assert_eq!(response.status(), 202);
    let location = response.headers()["location"].to_str().unwrap().to_owned();
    let finished = poll_until_terminal(&app, &location).await;
    assert_eq!(finished["state"], "canceled");
    assert_eq!(finished["reason"], "insufficient_funds");
    assert_eq!(app.balance("alice").await, 10);
    assert_eq!(app.balance("bob").await, 0);
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test]
async fn reading_an_unknown_transfer_is_404_transfer_not_found() {
    let app = spawn_app().await;
    let unknown = mongodb::bson::oid::ObjectId::new().to_hex();
    for path in [
        format!("/transfers/{unknown}"),
        "/transfers/not-a-hex-id".to_owned(),
        "/transfers/zza1b2c3d4e5f60718293a4b".to_owned(),
    ] {
        let response = app.get(&path).await;
        assert_problem(response, 404, "transfer_not_found").await;
    }
}

#[tokio::test]
async fn listing_transfers_filters_by_state_and_account_and_pages_newest_first() {
    let app = spawn_app().await;
    app.open_account("alice", 100).await;
    app.open_account("bob", 100).await;
    app.open_account("carol", 100).await;

    let mut done_with_alice = Vec::new();
    for (source, destination, amount, expected) in [
        ("alice", "bob", 10, 201),
        ("bob", "carol", 10, 201),
        ("alice", "carol", 1_000, 422),
        ("carol", "alice", 5, 201),
        ("bob", "alice", 7, 201),
        ("bob", "carol", 1, 201),
    ] {
        let (status, body) = app.transfer(source, destination, amount).await;
        assert_eq!(status, expected, "{body}");
        if status == 201 && (source == "alice" || destination == "alice") {
            done_with_alice.push(body["id"].as_str().unwrap().to_owned());
        }
    }
    done_with_alice.reverse();

    let pages = walk_pages(&app, "/transfers?state=done&account=alice&limit=2").await;
    assert_eq!(pages.len(), 2, "{pages:?}");
    assert_eq!(pages.concat(), done_with_alice);

    let (status, canceled) = get_json(&app, "/transfers?state=canceled").await;
    assert_eq!(status, 200);
    let canceled = canceled["items"].as_array().unwrap();
    assert_eq!(canceled.len(), 1);
    assert_eq!(canceled[0]["reason"], "insufficient_funds");

    let all = walk_pages(&app, "/transfers?limit=4").await.concat();
    assert_eq!(all.len(), 6);
    let mut sorted = all.clone();
    sorted.sort();
    sorted.reverse();
    assert_eq!(all, sorted, "newest (largest id) first");
}

#[tokio::test]
async fn a_bad_transfer_listing_parameter_is_400_invalid_parameter() {
    let app = spawn_app().await;
    for (query, field) in [
        ("state=bogus", "state"),
        ("state=DONE", "state"),
        ("account=a%20b", "account"),
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("limit=abc", "limit"),
        ("after=garbage", "after"),
        ("cursor=garbage", "cursor"),
    ] {
        let response = app.get(&format!("/transfers?{query}")).await;
        let problem = assert_problem(response, 400, "invalid_parameter").await;
        assert_eq!(problem["field"], field, "for {query}: {problem}");
    }
}

/// The service remembers account currencies to skip a read per transfer. An account
/// deleted behind its back (no API deletes one) must still never lose money: the debit or
/// credit finds it gone and the transfer is rolled back as `account_not_found`.
#[tokio::test]
async fn a_transfer_to_an_account_deleted_behind_the_services_back_is_rolled_back() {
    let app = support::spawn_app().await;
    app.open_account("alice", 1000).await;
    app.open_account("bob", 0).await;
    let (status, _) = app.transfer("alice", "bob", 100).await;
    assert_eq!(status, 201);
    app.store
        .database()
        .collection::<mongodb::bson::Document>("accounts")
        .delete_one(mongodb::bson::doc! { "_id": "bob" })
        .await
        .unwrap();

    let response = app
        .post_json(
            "/transfers",
            serde_json::json!({ "source": "alice", "destination": "bob", "amount": 100 }),
        )
        .await;
    let problem = crate::assert_problem(response, 422, "unknown_account").await;
    let id = problem["transferId"]
        .as_str()
        .expect("the transfer was recorded");
    let stored = app
        .store
        .transfers()
        .transfer(id.parse().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        stored.state,
        transfer_service::domain::TransferState::Canceled
    );
    assert_eq!(
        stored.reason,
        Some(transfer_service::domain::CancelReason::AccountNotFound)
    );
    assert_eq!(
        app.balance("alice").await,
        900,
        "the second debit was undone"
    );
    assert_eq!(app.accounts_with_pending().await, Vec::<String>::new());
}
