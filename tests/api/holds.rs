//! Holds (`docs/holds.md`): reserve now, capture (all or part) or void later, expire.
//! Every balance is read back from the API and the invariants checked after each step:
//! money conserved, no available balance below zero, the pending sums equal to the live
//! holds.

use std::time::Duration;

use serde_json::{Value, json};

use crate::{assert_problem, get_json};
use support::{TestApp, spawn_app};

/// `POST /transfers` of a hold: the status and the body.
async fn hold(
    app: &TestApp,
    source: &str,
    destination: &str,
    amount: i64,
    hold: Value,
) -> (u16, Value) {
    let response = app
        .post_json(
            "/transfers",
            json!({ "source": source, "destination": destination, "amount": amount, "hold": hold }),
        )
        .await;
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

/// A hold of `amount` from alice to bob for a minute; its id.
async fn held(app: &TestApp, amount: i64) -> String {
    let (status, body) = hold(
        app,
        "alice",
        "bob",
        amount,
        json!({ "expiresInMs": 60_000 }),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["state"], "held", "{body}");
    body["id"].as_str().unwrap().to_owned()
}

async fn capture(app: &TestApp, id: &str, body: Option<Value>) -> reqwest::Response {
    let request = app.http.post(app.url(&format!("/transfers/{id}/capture")));
    let request = match body {
        Some(body) => request.json(&body),
        None => request,
    };
    request.send().await.unwrap()
}

async fn void(app: &TestApp, id: &str) -> reqwest::Response {
    app.http
        .post(app.url(&format!("/transfers/{id}/void")))
        .send()
        .await
        .unwrap()
}

async fn ok_json(response: reqwest::Response) -> Value {
    let status = response.status();
    let body: Value = response.json().await.unwrap();
    assert_eq!(status, 200, "{body}");
    body
}

/// (balance, availableBalance, pendingDebits, pendingCredits) as the API shows them.
async fn amounts(app: &TestApp, account: &str) -> (i64, i64, i64, i64) {
    let (status, a) = get_json(app, &format!("/accounts/{account}")).await;
    assert_eq!(status, 200, "{a}");
    let field = |name: &str| a[name].as_i64().unwrap_or_else(|| panic!("{name} in {a}"));
    let amounts = (
        field("balance"),
        field("availableBalance"),
        field("pendingDebits"),
        field("pendingCredits"),
    );
    assert_eq!(
        amounts.1,
        amounts.0 - amounts.2,
        "available = balance - pendingDebits: {a}"
    );
    assert!(amounts.1 >= 0, "available balance below zero: {a}");
    amounts
}

/// The sums of pending debits and of pending credits over these accounts agree, and the
/// balances add up to `total`.
async fn assert_books(app: &TestApp, accounts: &[&str], total: i64) {
    let (mut balances, mut debits, mut credits) = (0, 0, 0);
    for account in accounts {
        let (balance, _, d, c) = amounts(app, account).await;
        balances += balance;
        debits += d;
        credits += c;
    }
    assert_eq!(balances, total, "money conserved");
    assert_eq!(debits, credits, "pending debits and credits agree");
}

async fn alice_and_bob(app: &TestApp) {
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
}

#[tokio::test]
async fn a_hold_reserves_the_amount_without_moving_money() {
    let app = spawn_app().await;
    alice_and_bob(&app).await;
    let before = chrono::Utc::now();

    let (status, body) = hold(&app, "alice", "bob", 300, json!({ "expiresInMs": 60_000 })).await;

    assert_eq!(status, 201, "{body}");
    assert_eq!(body["state"], "held");
    assert_eq!(body["amount"], 300);
    assert_eq!(body["heldAmount"], 300);
    let expires: chrono::DateTime<chrono::Utc> =
        body["expiresAt"].as_str().unwrap().parse().unwrap();
    let left = expires - before;
    assert!(
        (55..=65).contains(&left.num_seconds()),
        "expires in {left:?}: {body}"
    );
    assert_eq!(amounts(&app, "alice").await, (1_000, 700, 300, 0));
    assert_eq!(amounts(&app, "bob").await, (0, 0, 0, 300));
    let (_, read) = get_json(
        &app,
        &format!("/transfers/{}", body["id"].as_str().unwrap()),
    )
    .await;
    assert_eq!(read, body, "a read shows the hold as answered");
    assert_books(&app, &["alice", "bob"], 1_000).await;
}

#[tokio::test]
async fn held_money_cannot_be_spent_twice() {
    let app = spawn_app().await;
    alice_and_bob(&app).await;
    app.open_account("carol", 0).await;
    held(&app, 800).await;

    let (status, body) = app.transfer("alice", "carol", 300).await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["code"], "insufficient_funds");
    let (status, body) = hold(&app, "alice", "carol", 300, json!({})).await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["code"], "insufficient_funds");
    let (status, body) = app.transfer("alice", "carol", 200).await;
    assert_eq!(status, 201, "the rest is spendable: {body}");
    // Money on its way in is not spendable either.
    let (status, body) = app.transfer("bob", "carol", 1).await;
    assert_eq!(status, 422, "{body}");

    assert_eq!(amounts(&app, "alice").await, (800, 0, 800, 0));
    assert_books(&app, &["alice", "bob", "carol"], 1_000).await;
}

#[tokio::test]
async fn a_full_capture_moves_the_held_amount_and_a_repeat_answers_the_same() {
    let app = spawn_app().await;
    alice_and_bob(&app).await;
    let id = held(&app, 300).await;

    let captured = ok_json(capture(&app, &id, None).await).await;

    assert_eq!(captured["state"], "done", "{captured}");
    assert_eq!(captured["amount"], 300);
    assert_eq!(captured["heldAmount"], 300);
    assert_eq!(amounts(&app, "alice").await, (700, 700, 0, 0));
    assert_eq!(amounts(&app, "bob").await, (300, 300, 0, 0));
    let again = ok_json(capture(&app, &id, Some(json!({ "amount": 300 }))).await).await;
    assert_eq!(again, captured, "the same capture answers the same result");
    let other = capture(&app, &id, Some(json!({ "amount": 100 }))).await;
    let problem = assert_problem(other, 409, "hold_already_captured").await;
    assert_eq!(problem["transferId"], id.as_str());
    assert_problem(void(&app, &id).await, 409, "hold_already_captured").await;
    assert_eq!(amounts(&app, "alice").await, (700, 700, 0, 0));
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test]
async fn a_partial_capture_releases_the_rest() {
    let app = spawn_app().await;
    alice_and_bob(&app).await;
    let id = held(&app, 500).await;

    let captured = ok_json(capture(&app, &id, Some(json!({ "amount": 200 }))).await).await;

    assert_eq!(captured["state"], "done");
    assert_eq!(captured["amount"], 200);
    assert_eq!(captured["heldAmount"], 500);
    assert_eq!(amounts(&app, "alice").await, (800, 800, 0, 0));
    assert_eq!(amounts(&app, "bob").await, (200, 200, 0, 0));
    assert_books(&app, &["alice", "bob"], 1_000).await;
}

#[tokio::test]
async fn a_capture_outside_one_to_the_held_amount_is_refused_and_changes_nothing() {
    let app = spawn_app().await;
    alice_and_bob(&app).await;
    let id = held(&app, 300).await;

    for amount in [301, 0, -5] {
        let refused = capture(&app, &id, Some(json!({ "amount": amount }))).await;
        let problem = assert_problem(refused, 422, "invalid_field").await;
        assert_eq!(problem["field"], "amount", "{amount}: {problem}");
    }
    let (_, still) = get_json(&app, &format!("/transfers/{id}")).await;
    assert_eq!(still["state"], "held");
    assert_eq!(amounts(&app, "alice").await, (1_000, 700, 300, 0));
}

#[tokio::test]
async fn a_void_releases_the_hold_and_a_capture_after_it_is_refused() {
    let app = spawn_app().await;
    alice_and_bob(&app).await;
    let id = held(&app, 300).await;

    let voided = ok_json(void(&app, &id).await).await;

    assert_eq!(voided["state"], "canceled", "{voided}");
    assert_eq!(voided["reason"], "voided");
    assert_eq!(amounts(&app, "alice").await, (1_000, 1_000, 0, 0));
    assert_eq!(amounts(&app, "bob").await, (0, 0, 0, 0));
    assert_eq!(
        ok_json(void(&app, &id).await).await,
        voided,
        "a repeat answers the same"
    );
    assert_problem(capture(&app, &id, None).await, 409, "hold_voided").await;
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test]
async fn a_cancel_of_a_held_hold_voids_it() {
    let app = spawn_app().await;
    alice_and_bob(&app).await;
    let id = held(&app, 300).await;

    let response = app
        .http
        .post(app.url(&format!("/transfers/{id}/cancel")))
        .send()
        .await
        .unwrap();
    let canceled = ok_json(response).await;

    assert_eq!(canceled["state"], "canceled", "{canceled}");
    assert_eq!(canceled["reason"], "voided");
    assert_eq!(amounts(&app, "alice").await, (1_000, 1_000, 0, 0));
}

#[tokio::test]
async fn capture_and_void_of_a_plain_transfer_are_refused() {
    let app = spawn_app().await;
    alice_and_bob(&app).await;
    let (status, body) = app.transfer("alice", "bob", 100).await;
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_str().unwrap();

    assert_problem(capture(&app, id, None).await, 409, "not_a_hold").await;
    assert_problem(void(&app, id).await, 409, "not_a_hold").await;
    assert_eq!(amounts(&app, "alice").await, (900, 900, 0, 0));
}

#[tokio::test]
async fn an_expired_hold_cannot_be_captured() {
    let app = spawn_app().await;
    alice_and_bob(&app).await;
    let (status, body) = hold(&app, "alice", "bob", 300, json!({ "expiresInMs": 1_000 })).await;
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_str().unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;

    assert_problem(capture(&app, id, None).await, 409, "hold_expired").await;
    // Voiding it now records how it ended: expired.
    let ended = ok_json(void(&app, id).await).await;
    assert_eq!(ended["reason"], "expired", "{ended}");
    assert_problem(capture(&app, id, None).await, 409, "hold_expired").await;
    assert_eq!(amounts(&app, "alice").await, (1_000, 1_000, 0, 0));
    assert_eq!(amounts(&app, "bob").await, (0, 0, 0, 0));
}

#[tokio::test]
async fn a_hold_outside_its_expiry_range_is_refused_and_an_empty_one_lasts_the_default() {
    let app = spawn_app().await;
    alice_and_bob(&app).await;
    for expires in [json!(999), json!(2_592_000_001_i64), json!("soon")] {
        let (status, body) = hold(&app, "alice", "bob", 1, json!({ "expiresInMs": expires })).await;
        assert_eq!(status, 422, "{expires}: {body}");
        assert_eq!(body["field"], "hold.expiresInMs", "{body}");
    }
    let (status, body) = hold(&app, "alice", "bob", 1, json!({ "until": 5 })).await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(
        amounts(&app, "alice").await,
        (1_000, 1_000, 0, 0),
        "nothing recorded"
    );

    let (status, body) = hold(&app, "alice", "bob", 1, json!({})).await;
    assert_eq!(status, 201, "{body}");
    let expires: chrono::DateTime<chrono::Utc> =
        body["expiresAt"].as_str().unwrap().parse().unwrap();
    let left = expires - chrono::Utc::now();
    assert!(
        (6 * 24 * 3600 + 23 * 3600..=7 * 24 * 3600).contains(&left.num_seconds()),
        "the default is 7 days: {left:?}"
    );
}

/// `HOLD_EXPIRES_MS` sets the default: a hold whose request says nothing lasts that long.
#[tokio::test]
async fn a_hold_that_says_nothing_lasts_the_configured_default() {
    let app = support::spawn_app_with(|s| s.hold_expires = Duration::from_secs(3_600)).await;
    alice_and_bob(&app).await;
    let (status, body) = hold(&app, "alice", "bob", 1, json!({})).await;
    assert_eq!(status, 201, "{body}");
    let expires: chrono::DateTime<chrono::Utc> =
        body["expiresAt"].as_str().unwrap().parse().unwrap();
    let left = expires - chrono::Utc::now();
    assert!(
        (3_500..=3_600).contains(&left.num_seconds()),
        "HOLD_EXPIRES_MS=3600000 gives an hour: {left:?}"
    );
}

#[tokio::test]
async fn a_hold_retried_with_its_idempotency_key_is_made_once() {
    let app = spawn_app().await;
    alice_and_bob(&app).await;
    let body = json!({ "source": "alice", "destination": "bob", "amount": 300, "hold": { "expiresInMs": 60_000 } });
    let send = |body: Value| {
        app.http
            .post(app.url("/transfers"))
            .header("idempotency-key", "hold-1")
            .json(&body)
            .send()
    };

    let first = send(body.clone()).await.unwrap();
    assert_eq!(first.status(), 201);
    let first: Value = first.json().await.unwrap();
    let asked = std::time::Instant::now();
    let again = send(body.clone()).await.unwrap();
    // A held hold waits for its client, not for the protocol: a replay answers at once
    // instead of waiting the 5 s a replay gives an unfinished transfer to end.
    assert!(
        asked.elapsed() < Duration::from_secs(3),
        "the replay waited {:?} for a held hold to end",
        asked.elapsed()
    );
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let again: Value = again.json().await.unwrap();
    assert_eq!(again["id"], first["id"]);
    let plain = json!({ "source": "alice", "destination": "bob", "amount": 300 });
    let reused = send(plain).await.unwrap();
    assert_problem(reused, 422, "idempotency_key_reused").await;
    assert_eq!(
        amounts(&app, "alice").await,
        (1_000, 700, 300, 0),
        "held once"
    );
}

/// Captures and voids of one hold, all at once: exactly one kind wins, every capture
/// answers the same capture or a conflict, and the books balance.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn captures_and_voids_racing_for_one_hold_have_one_winner() {
    let app = spawn_app().await;
    alice_and_bob(&app).await;
    for round in 0..5 {
        let id = held(&app, 100).await;
        let mut racers = Vec::new();
        for i in 0..8 {
            let (http, id) = (app.http.clone(), id.clone());
            let url = if i % 2 == 0 {
                app.url(&format!("/transfers/{id}/capture"))
            } else {
                app.url(&format!("/transfers/{id}/void"))
            };
            racers.push(tokio::spawn(async move {
                let response = http.post(url).send().await.unwrap();
                let status = response.status().as_u16();
                (i % 2 == 0, status, response.json::<Value>().await.unwrap())
            }));
        }
        let mut outcomes = Vec::new();
        for racer in racers {
            outcomes.push(racer.await.unwrap());
        }
        let (_, ended) = get_json(&app, &format!("/transfers/{id}")).await;
        let captured = ended["state"] == "done";
        assert!(
            captured || ended["reason"] == "voided",
            "round {round}: {ended}"
        );
        for (is_capture, status, body) in &outcomes {
            let won_kind = *is_capture == captured;
            if won_kind {
                assert_eq!(*status, 200, "round {round}: {body}");
                assert_eq!(body, &ended, "round {round}");
            } else {
                assert_eq!(*status, 409, "round {round}: {body}");
                let code = if captured {
                    "hold_already_captured"
                } else {
                    "hold_voided"
                };
                assert_eq!(body["code"], code, "round {round}: {body}");
            }
        }
        assert!(
            app.accounts_with_pending().await.is_empty(),
            "round {round}"
        );
    }
    let (alice, _, 0, 0) = amounts(&app, "alice").await else {
        panic!("holds left pending");
    };
    assert_books(&app, &["alice", "bob"], 1_000).await;
    assert_eq!(alice % 100, 0);
}

#[tokio::test]
async fn a_hold_left_past_its_expiry_is_expired_by_the_sweeper() {
    let app = spawn_app().await;
    alice_and_bob(&app).await;
    let (status, body) = hold(&app, "alice", "bob", 300, json!({ "expiresInMs": 1_000 })).await;
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_str().unwrap();

    // As stored, not as read: a read shows it expired from `expiresAt` on anyway.
    let stored_id = support::values::transfer_id(id);
    let (within, every) = (Duration::from_secs(10), Duration::from_millis(100));
    support::poll_until(within, every, async || {
        let stored = app
            .store
            .transfers()
            .transfer(stored_id)
            .await
            .unwrap()
            .unwrap();
        if stored.state == transfer_service::domain::TransferState::Canceled {
            Ok(())
        } else {
            Err(stored)
        }
    })
    .await
    .unwrap_or_else(|stored| panic!("not expired: {stored:?}"));

    let (_, ended) = get_json(&app, &format!("/transfers/{id}")).await;
    assert_eq!(ended["reason"], "expired", "{ended}");
    assert_eq!(amounts(&app, "alice").await, (1_000, 1_000, 0, 0));
    assert_eq!(amounts(&app, "bob").await, (0, 0, 0, 0));
    assert!(app.accounts_with_pending().await.is_empty());
}

/// From `expiresAt` on, a hold's money is the source's again, even before any sweeper
/// has expired it: a transfer needing it expires the hold first, then goes through.
#[tokio::test]
async fn the_money_of_an_expired_hold_is_spendable_before_the_sweeper_comes() {
    let app = support::spawn_app_with(|s| s.sweep_interval = Duration::from_secs(3_600)).await;
    alice_and_bob(&app).await;
    app.open_account("carol", 0).await;
    let (status, body) = hold(&app, "alice", "bob", 800, json!({ "expiresInMs": 1_000 })).await;
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_str().unwrap();
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    let (status, body) = app.transfer("alice", "carol", 500).await;

    assert_eq!(status, 201, "{body}");
    let (_, ended) = get_json(&app, &format!("/transfers/{id}")).await;
    assert_eq!(
        (&ended["state"], &ended["reason"]),
        (&json!("canceled"), &json!("expired"))
    );
    assert_eq!(amounts(&app, "alice").await, (500, 500, 0, 0));
    assert_eq!(amounts(&app, "bob").await, (0, 0, 0, 0));
    assert_books(&app, &["alice", "bob", "carol"], 1_000).await;
}

/// From `expiresAt` on, every read shows the hold expired and its money available, even
/// before any sweeper has written it.
#[tokio::test]
async fn reads_show_an_expired_hold_as_expired_before_the_sweeper_comes() {
    let app = support::spawn_app_with(|s| s.sweep_interval = Duration::from_secs(3_600)).await;
    alice_and_bob(&app).await;
    let live = held(&app, 100).await;
    let (status, body) = hold(&app, "alice", "bob", 300, json!({ "expiresInMs": 1_000 })).await;
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_str().unwrap();
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    let (_, read) = get_json(&app, &format!("/transfers/{id}")).await;
    assert_eq!(
        (&read["state"], &read["reason"]),
        (&json!("canceled"), &json!("expired")),
        "{read}"
    );
    assert_eq!(amounts(&app, "alice").await, (1_000, 900, 100, 0));
    assert_eq!(amounts(&app, "bob").await, (0, 0, 0, 100));
    let (_, listed) = get_json(&app, "/accounts").await;
    let alice = &listed["items"][0];
    assert_eq!(
        (alice["id"].as_str(), alice["availableBalance"].as_i64()),
        (Some("alice"), Some(900))
    );
    let (_, held_now) = get_json(&app, "/transfers?state=held").await;
    let ids: Vec<&str> = held_now["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [live.as_str()], "only the live hold is held");
    let (_, history) = get_json(&app, "/accounts/alice/transfers").await;
    let expired = history["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["id"] == id)
        .expect("the hold is in the history");
    assert_eq!(expired["reason"], "expired", "{expired}");
}

/// Invariant: `balance + pendingCredits` never passes `MAX_MONEY`, so that every hold
/// into an account can be captured in full: money held for an account counts against
/// its largest balance. With a hold of 100 into an account 100 short of the largest
/// balance, a credit of 1 and another hold of 1 into it are refused as an overflow (the
/// balance alone would still have room), and the hold is then captured in full.
#[tokio::test]
async fn money_held_for_an_account_counts_against_its_largest_balance() {
    const MAX_MONEY: i64 = transfer_service::domain::MAX_MONEY;
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("full", MAX_MONEY - 100).await;
    let (status, first) = hold(&app, "alice", "full", 100, json!({ "expiresInMs": 60_000 })).await;
    assert_eq!(
        (status, first["state"].as_str()),
        (201, Some("held")),
        "{first}"
    );
    assert_eq!(
        amounts(&app, "full").await,
        (MAX_MONEY - 100, MAX_MONEY - 100, 0, 100)
    );

    let credit = app
        .post_json(
            "/transfers",
            json!({ "source": "alice", "destination": "full", "amount": 1 }),
        )
        .await;
    assert_problem(credit, 422, "balance_overflow").await;
    let (status, second) = hold(&app, "alice", "full", 1, json!({ "expiresInMs": 60_000 })).await;
    assert_eq!(
        (status, second["code"].as_str()),
        (422, Some("balance_overflow")),
        "{second}"
    );
    assert_eq!(
        amounts(&app, "full").await,
        (MAX_MONEY - 100, MAX_MONEY - 100, 0, 100)
    );
    assert_books(&app, &["alice", "full"], 1_000 + MAX_MONEY - 100).await;

    let id = first["id"].as_str().unwrap();
    let captured = ok_json(capture(&app, id, None).await).await;
    assert_eq!(captured["state"], "done", "{captured}");
    assert_eq!(amounts(&app, "full").await, (MAX_MONEY, MAX_MONEY, 0, 0));
    assert_books(&app, &["alice", "full"], 1_000 + MAX_MONEY - 100).await;
}

/// From `expiresAt` on, the room an expired hold kept in its destination is free again,
/// even before any sweeper has expired it: reads leave its `pendingCredits` out, and so
/// does a credit, which expires the hold and releases the destination's reservation
/// rather than answer `balance_overflow`.
#[tokio::test]
async fn the_room_an_expired_hold_kept_in_its_destination_is_free_before_the_sweeper_comes() {
    const MAX_MONEY: i64 = transfer_service::domain::MAX_MONEY;
    let app = support::spawn_app_with(|s| s.sweep_interval = Duration::from_secs(3_600)).await;
    app.open_account("alice", 1_000).await;
    app.open_account("full", MAX_MONEY - 100).await;
    let (status, body) = hold(&app, "alice", "full", 100, json!({ "expiresInMs": 1_000 })).await;
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_str().unwrap();
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    assert_eq!(
        amounts(&app, "full").await,
        (MAX_MONEY - 100, MAX_MONEY - 100, 0, 0),
        "read as expired"
    );

    let (status, body) = app.transfer("alice", "full", 60).await;

    assert_eq!(status, 201, "{body}");
    let (_, ended) = get_json(&app, &format!("/transfers/{id}")).await;
    assert_eq!(
        (&ended["state"], &ended["reason"]),
        (&json!("canceled"), &json!("expired"))
    );
    assert_eq!(
        amounts(&app, "full").await,
        (MAX_MONEY - 40, MAX_MONEY - 40, 0, 0)
    );
    assert_eq!(amounts(&app, "alice").await, (940, 940, 0, 0));
    assert_books(&app, &["alice", "full"], 1_000 + MAX_MONEY - 100).await;
    assert!(app.accounts_with_pending().await.is_empty());
}

/// Reading an account that reserves nothing asks nothing of the log: only an account
/// with pending sums can be carrying an expired hold, so only then are the holds looked
/// up (and the database's clock read). One read, not three, for most accounts.
#[tokio::test]
async fn reading_an_account_that_reserves_nothing_reads_only_the_account() {
    use transfer_service::domain::DeploymentName;
    use transfer_service::service::TransferService;
    use transfer_service::store::testing::connect_keeping_commands;
    let app = spawn_app().await;
    alice_and_bob(&app).await;
    let (status, body) = hold(&app, "alice", "bob", 300, json!({ "expiresInMs": 60_000 })).await;
    assert_eq!(status, 201, "{body}");
    let (store, recorded) = connect_keeping_commands(
        DeploymentName::default(),
        &support::database_uri(),
        &app.database,
    )
    .await
    .unwrap();
    let bank = TransferService::new(store, "reader", Duration::from_secs(10));
    let commands = |id: &str| {
        let bank = bank.clone();
        let recorded = recorded.clone();
        let id = support::values::account(id);
        async move {
            recorded.lock().unwrap().clear();
            bank.book().account(&id).await.unwrap();
            let sent = recorded.lock().unwrap().clone();
            sent.into_iter()
                .map(|(name, command)| match command.get_str(&name) {
                    Ok(collection) => format!("{name} {collection}"),
                    Err(_) => name,
                })
                .collect::<Vec<_>>()
        }
    };
    let carol = app
        .post_json("/accounts", json!({ "id": "carol", "balance": 5 }))
        .await;
    assert_eq!(carol.status(), 201);
    assert_eq!(commands("carol").await, ["find accounts"]);
    // Alice and Bob carry the hold: the log is asked which of their holds expired.
    for holding in ["alice", "bob"] {
        let sent = commands(holding).await;
        assert!(
            sent.iter().any(|c| c.ends_with("transactions")),
            "{holding}: {sent:?}"
        );
    }
}
