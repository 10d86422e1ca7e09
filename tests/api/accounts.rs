//! `/accounts`: opening, reading and listing accounts, and an account's transfers.
//!
//! Invariants protected here: a refused request stores nothing; an account is opened
//! once under its id; a listing walked page by page shows every account exactly once.

use serde_json::{Value, json};

use crate::{assert_problem, get_json, walk_pages};
use support::values::account;
use support::{TestApp, spawn_app};

/// How many accounts are stored, read straight from the database.
async fn stored_accounts(app: &TestApp) -> usize {
    app.store
        .accounts()
        .list_accounts(None, None, 1_000)
        .await
        .unwrap()
        .len()
}

/// Opening an account with `body` is refused as an invalid `field`, and nothing is stored.
async fn assert_refused_field(app: &TestApp, body: Value, field: &str) {
    let response = app.post_json("/accounts", body.clone()).await;
    let problem = assert_problem(response, 422, "invalid_field").await;
    assert_eq!(problem["field"], field, "for {body}: {problem}");
    assert_eq!(stored_accounts(app).await, 0, "{body} stored an account");
}

#[tokio::test]
async fn opening_an_account_answers_201_with_location_and_the_account() {
    let app = spawn_app().await;
    let response = app
        .post_json(
            "/accounts",
            json!({ "id": "alice", "name": "Alice", "balance": 10_000, "currency": "EUR" }),
        )
        .await;
    assert_eq!(response.status(), 201);
    assert_eq!(response.headers()["location"], "/accounts/alice");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["id"], "alice");
    assert_eq!(body["name"], "Alice");
    assert_eq!(body["balance"], 10_000);
    assert_eq!(body["currency"], "EUR");
    assert_eq!(body["pendingTransactions"], json!([]));
    assert_eq!(app.balance("alice").await, 10_000);
}

#[tokio::test]
async fn an_account_opened_without_balance_or_currency_holds_zero_usd() {
    let app = spawn_app().await;
    let response = app.post_json("/accounts", json!({ "id": "bare" })).await;
    assert_eq!(response.status(), 201);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["balance"], 0);
    assert_eq!(body["currency"], "USD");

    let stored = app
        .store
        .accounts()
        .account(&account("bare"))
        .await
        .unwrap()
        .expect("stored");
    assert_eq!(stored.balance, 0);
    assert_eq!(stored.currency.as_str(), "USD");
}

#[tokio::test]
async fn an_account_opened_without_an_id_gets_one_and_its_location_serves_it() {
    let app = spawn_app().await;
    let response = app
        .post_json("/accounts", json!({ "balance": 5, "currency": "GBP" }))
        .await;
    assert_eq!(response.status(), 201);
    let location = response.headers()["location"].to_str().unwrap().to_owned();
    let body: Value = response.json().await.unwrap();
    let id = body["id"].as_str().expect("a generated id").to_owned();
    assert!(!id.is_empty());
    assert_eq!(location, format!("/accounts/{id}"));

    let (status, fetched) = get_json(&app, &location).await;
    assert_eq!(status, 200, "{fetched}");
    assert_eq!(fetched["id"], id.as_str());
    assert_eq!(fetched["balance"], 5);
    assert_eq!(fetched["currency"], "GBP");

    // Two accounts opened without ids never collide.
    let second = app.post_json("/accounts", json!({})).await;
    assert_eq!(second.status(), 201);
    let second: Value = second.json().await.unwrap();
    assert_ne!(second["id"], id.as_str());
    assert_eq!(stored_accounts(&app).await, 2);
}

#[tokio::test]
async fn opening_an_existing_account_id_is_409_and_keeps_the_first_account() {
    let app = spawn_app().await;
    app.open_account("alice", 100).await;

    let response = app
        .post_json(
            "/accounts",
            json!({ "id": "alice", "balance": 999_999, "currency": "EUR" }),
        )
        .await;
    assert_problem(response, 409, "account_exists").await;

    let stored = app
        .store
        .accounts()
        .account(&account("alice"))
        .await
        .unwrap()
        .expect("stored");
    assert_eq!(stored.balance, 100);
    assert_eq!(stored.currency.as_str(), "USD");
    assert_eq!(stored_accounts(&app).await, 1);
}

#[tokio::test]
async fn an_account_id_outside_the_allowed_alphabet_or_length_is_refused_naming_id() {
    let app = spawn_app().await;
    for bad in ["a b", "", "a/b", "é"] {
        assert_refused_field(&app, json!({ "id": bad }), "id").await;
    }
    assert_refused_field(&app, json!({ "id": "a".repeat(65) }), "id").await;

    // The longest id is fine.
    let longest = "a".repeat(64);
    let response = app.post_json("/accounts", json!({ "id": longest })).await;
    assert_eq!(response.status(), 201);
}

#[tokio::test]
async fn a_negative_or_unsafe_opening_balance_is_refused_naming_balance() {
    let app = spawn_app().await;
    for bad in [
        json!(-1),
        json!(9_007_199_254_740_992_i64),
        json!(1.5),
        json!("10"),
    ] {
        assert_refused_field(&app, json!({ "id": "alice", "balance": bad }), "balance").await;
    }

    // 2^53 - 1 is the largest balance, and it is accepted.
    app.open_account("rich", 9_007_199_254_740_991).await;
    assert_eq!(app.balance("rich").await, 9_007_199_254_740_991);
}

#[tokio::test]
async fn a_currency_that_is_not_three_uppercase_letters_is_refused_naming_currency() {
    let app = spawn_app().await;
    for bad in ["usd", "EURO", "US", "U5D"] {
        assert_refused_field(&app, json!({ "id": "alice", "currency": bad }), "currency").await;
    }
}

#[tokio::test]
async fn an_unknown_field_in_an_account_request_is_refused_naming_it() {
    let app = spawn_app().await;
    assert_refused_field(&app, json!({ "id": "alice", "colour": "blue" }), "colour").await;
    assert_refused_field(&app, json!({ "id": "alice", "Balance": 5 }), "Balance").await;
}

#[tokio::test]
async fn a_name_over_200_characters_or_with_control_characters_is_refused_naming_name() {
    let app = spawn_app().await;
    assert_refused_field(
        &app,
        json!({ "id": "alice", "name": "n".repeat(201) }),
        "name",
    )
    .await;
    assert_refused_field(&app, json!({ "id": "alice", "name": "tab\there" }), "name").await;

    // 200 characters, not bytes, is the limit.
    let longest = "é".repeat(200);
    let response = app
        .post_json("/accounts", json!({ "id": "alice", "name": longest }))
        .await;
    assert_eq!(response.status(), 201);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["name"], longest.as_str());
}

#[tokio::test]
async fn reading_an_account_returns_its_stored_state() {
    let app = spawn_app().await;
    app.open_account_in("alice", 4_200, "EUR").await;

    let (status, body) = get_json(&app, "/accounts/alice").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["id"], "alice");
    assert_eq!(body["balance"], 4_200);
    assert_eq!(body["currency"], "EUR");
    assert_eq!(body["pendingTransactions"], json!([]));
    assert!(body["createdAt"].is_string() && body["updatedAt"].is_string());
}

#[tokio::test]
async fn reading_an_unknown_account_is_404_account_not_found() {
    let app = spawn_app().await;
    assert_problem(app.get("/accounts/nobody").await, 404, "account_not_found").await;
    // An id that could never exist is simply not found, not a different error.
    assert_problem(app.get("/accounts/a%20b").await, 404, "account_not_found").await;
}

#[tokio::test]
async fn listing_accounts_page_by_page_visits_every_account_once_in_id_order() {
    let app = spawn_app().await;
    for id in ["carol", "alice", "eve", "bob", "dave"] {
        app.open_account(id, 10).await;
    }

    let pages = walk_pages(&app, "/accounts?limit=2").await;

    assert_eq!(
        pages,
        vec![
            vec!["alice".to_owned(), "bob".to_owned()],
            vec!["carol".to_owned(), "dave".to_owned()],
            vec!["eve".to_owned()],
        ]
    );
}

#[tokio::test]
async fn a_listing_that_fits_one_page_has_no_next() {
    let app = spawn_app().await;
    let (status, empty) = get_json(&app, "/accounts").await;
    assert_eq!(status, 200);
    assert_eq!(empty["items"], json!([]));
    assert!(crate::next_page(&empty).is_none(), "{empty}");

    for id in ["a", "b"] {
        app.open_account(id, 0).await;
    }
    // Exactly `limit` accounts: no further page to announce.
    let pages = walk_pages(&app, "/accounts?limit=2").await;
    assert_eq!(pages, vec![vec!["a".to_owned(), "b".to_owned()]]);
}

#[tokio::test]
async fn a_bad_limit_or_cursor_on_the_account_listing_is_400_invalid_parameter() {
    let app = spawn_app().await;
    app.open_account("alice", 0).await;
    for (query, field) in [
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("limit=abc", "limit"),
        ("limit=-1", "limit"),
        ("after=garbage!!", "after"),
        ("after=Z2FyYmFnZQ", "after"),
        ("cursor=garbage!!", "cursor"),
    ] {
        let response = app.get(&format!("/accounts?{query}")).await;
        let problem = assert_problem(response, 400, "invalid_parameter").await;
        assert_eq!(problem["field"], field, "for {query}: {problem}");
    }
    // The bounds themselves are accepted.
    for query in ["limit=1", "limit=100"] {
        let (status, body) = get_json(&app, &format!("/accounts?{query}")).await;
        assert_eq!(status, 200, "{query}: {body}");
    }
}

#[tokio::test]
async fn a_cursor_of_the_transfer_listing_is_refused_by_the_account_listing() {
    let app = spawn_app().await;
    for id in ["a", "b", "c"] {
        app.open_account(id, 10).await;
    }
    app.transfer("a", "b", 1).await;
    app.transfer("a", "c", 1).await;
    let (_, page) = get_json(&app, "/transfers?limit=1").await;
    let next = crate::next_page(&page).expect("a second page");

    let response = app.get(&format!("/accounts?after={next}")).await;
    let problem = assert_problem(response, 400, "invalid_parameter").await;
    assert_eq!(problem["field"], "after");
}

#[tokio::test]
async fn an_accounts_transfers_are_listed_newest_first_page_by_page() {
    let app = spawn_app().await;
    for id in ["alice", "bob", "carol"] {
        app.open_account(id, 1_000).await;
    }
    let mut ids = Vec::new();
    for (source, destination, amount) in [
        ("alice", "bob", 1),
        ("bob", "carol", 2),
        ("carol", "alice", 3),
        ("alice", "carol", 4),
        ("bob", "carol", 5),
    ] {
        let (status, body) = app.transfer(source, destination, amount).await;
        assert_eq!(status, 201, "{body}");
        ids.push(body["id"].as_str().unwrap().to_owned());
    }

    let pages = walk_pages(&app, "/accounts/alice/transfers?limit=2").await;

    // Alice took part in transfers 0, 2 and 3; newest first.
    assert_eq!(
        pages,
        vec![vec![ids[3].clone(), ids[2].clone()], vec![ids[0].clone()]]
    );
    let (_, page) = get_json(&app, "/accounts/alice/transfers").await;
    for item in page["items"].as_array().unwrap() {
        assert!(
            item["source"] == "alice" || item["destination"] == "alice",
            "{item}"
        );
    }
}

#[tokio::test]
async fn the_transfers_of_an_unknown_account_are_404() {
    let app = spawn_app().await;
    let response = app.get("/accounts/nobody/transfers").await;
    assert_problem(response, 404, "account_not_found").await;
}

#[tokio::test]
async fn an_account_with_no_transfers_lists_an_empty_page() {
    let app = spawn_app().await;
    app.open_account("alice", 0).await;
    let (status, page) = get_json(&app, "/accounts/alice/transfers").await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["items"], json!([]));
    assert!(crate::next_page(&page).is_none());
}

#[tokio::test]
async fn a_bad_limit_or_cursor_on_an_accounts_transfers_is_400_invalid_parameter() {
    let app = spawn_app().await;
    app.open_account("alice", 0).await;
    for (query, field) in [
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("after=garbage", "after"),
        ("cursor=garbage", "cursor"),
    ] {
        let response = app.get(&format!("/accounts/alice/transfers?{query}")).await;
        let problem = assert_problem(response, 400, "invalid_parameter").await;
        assert_eq!(problem["field"], field, "for {query}: {problem}");
    }
}

/// The schema validators guard what money depends on even against writes that bypass the
/// service: a balance stays an Int64 that is never negative, a transfer's state is one of
/// the protocol's, its amount an Int64 of at least one minor unit.
#[tokio::test]
async fn the_database_refuses_writes_that_would_break_money_even_from_outside_the_service() {
    use mongodb::bson::{Document, doc};
    let app = spawn_app().await;
    app.open_account("alice", 100).await;
    let accounts = app.store.database().collection::<Document>("accounts");
    for change in [
        doc! { "$set": { "balance": -1_i64 } },
        doc! { "$set": { "balance": 1.5_f64 } },
        doc! { "$set": { "balance": 7_i32 } },
        doc! { "$set": { "currency": "EURO" } },
        doc! { "$unset": { "pendingTransactions": "" } },
    ] {
        let refused = accounts
            .update_one(doc! { "_id": "alice" }, change.clone())
            .await;
        assert!(refused.is_err(), "{change} was stored");
    }
    assert_eq!(app.balance("alice").await, 100);

    app.open_account("bob", 0).await;
    app.transfer("alice", "bob", 10).await;
    let transactions = app.store.database().collection::<Document>("transactions");
    for change in [
        doc! { "$set": { "state": "committed" } },
        doc! { "$set": { "value": 0_i64 } },
        doc! { "$set": { "value": 2.5_f64 } },
        doc! { "$unset": { "lastModified": "" } },
    ] {
        let refused = transactions.update_one(doc! {}, change.clone()).await;
        assert!(refused.is_err(), "{change} was stored");
    }
}
