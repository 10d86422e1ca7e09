//! `Idempotency-Key` on `POST /transfers`.
//!
//! The invariant protected here: however often, and however concurrently, a client
//! sends one request under one key, exactly one transfer is recorded and its money
//! moves exactly once; every answer names that one transfer. A key reused for another
//! request is refused and moves nothing. With API keys, a key is the caller's own: no
//! other caller sees or blocks it.

use serde_json::{Value, json};

use crate::{assert_problem, get_json, walk_pages};
use support::{TestApp, spawn_app, spawn_app_with};
use transfer_service::config::parse_api_keys;
use transfer_service::domain::{IdempotencyKey, ScopedKey};

/// `POST /transfers` with an `Idempotency-Key`.
async fn post_with_key(app: &TestApp, key: &str, body: &Value) -> reqwest::Response {
    app.http
        .post(app.url("/transfers"))
        .header("idempotency-key", key)
        .json(body)
        .send()
        .await
        .expect("request")
}

fn replayed(response: &reqwest::Response) -> Option<String> {
    response
        .headers()
        .get("idempotent-replayed")
        .map(|v| v.to_str().unwrap().to_owned())
}

/// Every transfer touching `account`, read through the API.
async fn transfers_of(app: &TestApp, account: &str) -> Vec<String> {
    walk_pages(app, &format!("/transfers?account={account}&limit=100"))
        .await
        .concat()
}

#[tokio::test]
async fn a_retry_with_the_same_key_and_body_returns_the_first_transfer_and_moves_money_once() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let body =
        json!({ "source": "alice", "destination": "bob", "amount": 300, "reference": "inv-7" });

    let first = post_with_key(&app, "order-42", &body).await;
    assert_eq!(first.status(), 201);
    assert_eq!(replayed(&first), None, "the first answer is not a replay");
    let first_location = first.headers()["location"].to_str().unwrap().to_owned();
    let first: Value = first.json().await.unwrap();

    let second = post_with_key(&app, "order-42", &body).await;
    assert_eq!(second.status(), 201);
    assert_eq!(replayed(&second).as_deref(), Some("true"));
    assert_eq!(second.headers()["location"], first_location.as_str());
    let second: Value = second.json().await.unwrap();

    assert_eq!(second["id"], first["id"]);
    assert_eq!(second["state"], "done");
    assert_eq!(app.balance("alice").await, 700);
    assert_eq!(app.balance("bob").await, 300);
    assert_eq!(transfers_of(&app, "alice").await.len(), 1);
}

#[tokio::test]
async fn requests_without_a_key_are_never_deduplicated() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;

    for _ in 0..2 {
        let (status, body) = app.transfer("alice", "bob", 100).await;
        assert_eq!(status, 201, "{body}");
    }

    assert_eq!(app.balance("bob").await, 200);
    assert_eq!(transfers_of(&app, "bob").await.len(), 2);
}

#[tokio::test]
async fn a_key_reused_with_another_body_is_refused_and_moves_nothing() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    app.open_account("carol", 0).await;
    let first = post_with_key(
        &app,
        "order-42",
        &json!({ "source": "alice", "destination": "bob", "amount": 300 }),
    )
    .await;
    assert_eq!(first.status(), 201);

    for other in [
        json!({ "source": "alice", "destination": "bob", "amount": 301 }),
        json!({ "source": "alice", "destination": "carol", "amount": 300 }),
        json!({ "source": "alice", "destination": "bob", "amount": 300, "reference": "x" }),
    ] {
        let response = post_with_key(&app, "order-42", &other).await;
        assert_eq!(replayed(&response), None);
        assert_problem(response, 422, "idempotency_key_reused").await;
    }

    assert_eq!(app.balance("alice").await, 700);
    assert_eq!(app.balance("bob").await, 300);
    assert_eq!(app.balance("carol").await, 0);
    assert_eq!(transfers_of(&app, "alice").await.len(), 1);
}

#[tokio::test]
async fn a_replayed_insufficient_funds_request_names_the_same_canceled_transfer() {
    let app = spawn_app().await;
    app.open_account("alice", 100).await;
    app.open_account("bob", 0).await;
    let body = json!({ "source": "alice", "destination": "bob", "amount": 500 });

    let first = post_with_key(&app, "too-much", &body).await;
    assert_eq!(replayed(&first), None);
    let first = assert_problem(first, 422, "insufficient_funds").await;
    let id = first["transferId"]
        .as_str()
        .expect("a transfer id")
        .to_owned();

    // Funding the source afterwards does not turn the replay into a new attempt.
    app.open_account("carol", 1_000).await;
    let (status, funding) = app.transfer("carol", "alice", 1_000).await;
    assert_eq!(status, 201, "{funding}");
    let second = post_with_key(&app, "too-much", &body).await;
    assert_eq!(replayed(&second).as_deref(), Some("true"));
    let second = assert_problem(second, 422, "insufficient_funds").await;
    assert_eq!(second["transferId"], id.as_str());

    let (_, stored) = get_json(&app, &format!("/transfers/{id}")).await;
    assert_eq!(stored["state"], "canceled");
    assert_eq!(stored["reason"], "insufficient_funds");
    assert_eq!(app.balance("alice").await, 1_100);
    assert_eq!(app.balance("bob").await, 0);
}

#[tokio::test]
async fn an_idempotency_key_that_is_empty_or_over_255_characters_is_refused() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let body = json!({ "source": "alice", "destination": "bob", "amount": 5 });

    for bad in ["k".repeat(256), String::new(), "has space".to_owned()] {
        let response = post_with_key(&app, &bad, &body).await;
        let problem = assert_problem(response, 422, "invalid_header").await;
        assert_eq!(
            problem["field"]
                .as_str()
                .map(str::to_ascii_lowercase)
                .as_deref(),
            Some("idempotency-key"),
            "{problem}"
        );
    }
    assert_eq!(app.balance("alice").await, 1_000);
    assert!(transfers_of(&app, "alice").await.is_empty());

    // 255 characters is the longest key.
    let longest = post_with_key(&app, &"k".repeat(255), &body).await;
    assert_eq!(longest.status(), 201);
    assert_eq!(app.balance("bob").await, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_with_one_key_make_exactly_one_transfer() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let body = json!({ "source": "alice", "destination": "bob", "amount": 250 });

    let requests = (0..20).map(|_| {
        let http = app.http.clone();
        let url = app.url("/transfers");
        let body = body.clone();
        tokio::spawn(async move {
            let response = http
                .post(url)
                .header("idempotency-key", "same-for-all")
                .json(&body)
                .send()
                .await
                .expect("request");
            let status = response.status().as_u16();
            let replay = replayed(&response);
            let text = response.text().await.unwrap();
            (status, replay, text)
        })
    });
    let answers = futures::future::join_all(requests).await;

    let mut ids = Vec::new();
    let mut originals = 0;
    for answer in answers {
        let (status, replay, text) = answer.expect("task");
        assert_eq!(status, 201, "{text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(body["state"], "done", "{body}");
        ids.push(body["id"].as_str().unwrap().to_owned());
        if replay.is_none() {
            originals += 1;
        }
    }
    ids.sort();
    ids.dedup();
    assert_eq!(
        ids.len(),
        1,
        "every answer names the same transfer: {ids:?}"
    );
    assert_eq!(originals, 1, "exactly one answer is not a replay");

    assert_eq!(app.balance("alice").await, 750);
    assert_eq!(app.balance("bob").await, 250);
    assert_eq!(transfers_of(&app, "alice").await, ids);
    let stored = app
        .store
        .transfers()
        .transfer_by_idempotency_key(&ScopedKey::shared(
            IdempotencyKey::parse("same-for-all").unwrap(),
        ))
        .await
        .unwrap()
        .expect("stored under its key");
    assert_eq!(stored.id.to_string(), ids[0]);
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test]
async fn the_same_key_on_two_different_accounts_pairs_is_still_one_key() {
    // A key is not per account: reusing it for another pair is a reuse (one caller, or
    // no API keys; keys are per API key, below).
    let app = spawn_app().await;
    for id in ["a", "b", "c", "d"] {
        app.open_account(id, 100).await;
    }
    let first = post_with_key(
        &app,
        "k1",
        &json!({ "source": "a", "destination": "b", "amount": 1 }),
    )
    .await;
    assert_eq!(first.status(), 201);
    let second = post_with_key(
        &app,
        "k1",
        &json!({ "source": "c", "destination": "d", "amount": 1 }),
    )
    .await;
    assert_problem(second, 422, "idempotency_key_reused").await;
    assert_eq!(app.balance("c").await, 100);
    assert_eq!(app.balance("d").await, 100);
}

/// What a version before `idempotencyKeys` leaves for a keyed transfer it records during
/// a rolling upgrade, after migration 0006 copied the keys: the transfer carries
/// `idempotencyKey` (its unique index decides), and `idempotencyKeys` has nothing.
async fn as_if_inserted_by_an_older_version(app: &TestApp, key: &str) {
    app.store
        .database()
        .collection::<mongodb::bson::Document>("idempotencyKeys")
        .delete_one(mongodb::bson::doc! { "_id": key })
        .await
        .unwrap();
}

/// The step `docs/scaling.md` asks for before the old unique index is dropped, once
/// every instance runs this version: copy the keys of the transfers recorded meanwhile.
async fn copy_the_keys_again(app: &TestApp) {
    app.store
        .database()
        .run_command(mongodb::bson::doc! {
            "aggregate": "transactions",
            "pipeline": [
                { "$match": { "idempotencyKey": { "$type": "string" } } },
                { "$project": { "_id": "$idempotencyKey", "transfer": "$_id", "requestHash": 1 } },
                { "$merge": { "into": "idempotencyKeys", "on": "_id", "whenMatched": "keepExisting", "whenNotMatched": "insert" } }
            ],
            "cursor": {},
        })
        .await
        .unwrap();
}

async fn drop_the_old_index(app: &TestApp) {
    app.store
        .database()
        .run_command(
            mongodb::bson::doc! { "dropIndexes": "transactions", "index": "idempotencyKey_unique" },
        )
        .await
        .unwrap();
}

/// A retry of a key an older version recorded (only on the transfer) is answered with
/// that transfer: while the old index is there, and after the keys are copied again and
/// the index dropped, as for sharding.
#[tokio::test]
async fn a_retry_of_a_key_an_older_version_inserted_replays_before_and_after_the_index_goes() {
    let app = spawn_app().await;
    app.open_account("a", 1000).await;
    app.open_account("b", 0).await;
    let body = json!({ "source": "a", "destination": "b", "amount": 100 });
    let first: Value = post_with_key(&app, "old-1", &body)
        .await
        .json()
        .await
        .unwrap();
    as_if_inserted_by_an_older_version(&app, "old-1").await;

    let again = post_with_key(&app, "old-1", &body).await;
    assert_eq!(replayed(&again).as_deref(), Some("true"));
    let again: Value = again.json().await.unwrap();
    assert_eq!(again["id"], first["id"]);

    copy_the_keys_again(&app).await;
    drop_the_old_index(&app).await;
    let third = post_with_key(&app, "old-1", &body).await;
    assert_eq!(replayed(&third).as_deref(), Some("true"));
    let third: Value = third.json().await.unwrap();
    assert_eq!(third["id"], first["id"]);
    assert_eq!((app.balance("a").await, app.balance("b").await), (900, 100));
}

/// A different request with a key an older version recorded is refused, and leaves the
/// key naming that transfer: the original request's retry is still replayed.
#[tokio::test]
async fn a_refused_reuse_of_a_key_an_older_version_inserted_leaves_the_original_replayable() {
    let app = spawn_app().await;
    app.open_account("a", 1000).await;
    app.open_account("b", 0).await;
    let original = json!({ "source": "a", "destination": "b", "amount": 10 });
    let first: Value = post_with_key(&app, "old-2", &original)
        .await
        .json()
        .await
        .unwrap();
    as_if_inserted_by_an_older_version(&app, "old-2").await;
    let other = json!({ "source": "a", "destination": "b", "amount": 20 });
    assert_problem(
        post_with_key(&app, "old-2", &other).await,
        422,
        "idempotency_key_reused",
    )
    .await;
    let retry = post_with_key(&app, "old-2", &original).await;
    assert_eq!(
        (retry.status().as_u16(), replayed(&retry).as_deref()),
        (201, Some("true"))
    );
    let retry: Value = retry.json().await.unwrap();
    assert_eq!(retry["id"], first["id"]);
    assert_eq!((app.balance("a").await, app.balance("b").await), (990, 10));
}

// Keys belong to the API key that sent them (`API_KEYS`): the same key from two API keys
// is two keys. Invariant: no caller is answered another caller's transfer or refused
// because of another caller's key, and a retry (same API key, key and body) is still
// answered with its own transfer and moves no money, also for a key taken before keys
// were scoped.

/// Two read-write API keys, random so that one cannot be mistaken for the other.
struct Callers {
    first: String,
    second: String,
}

impl Callers {
    fn new() -> Callers {
        let id = mongodb::bson::oid::ObjectId::new;
        Callers {
            first: format!("first-{}", id().to_hex()),
            second: format!("second-{}", id().to_hex()),
        }
    }
}

/// An instance that knows both callers' API keys; on `database` when given (another
/// instance's), else on a fresh one.
async fn spawn_for(callers: &Callers, database: Option<String>) -> TestApp {
    let raw = format!("rw:{},rw:{}", callers.first, callers.second);
    spawn_app_with(|s| {
        s.api_keys = parse_api_keys(&raw).unwrap();
        if let Some(database) = database {
            s.database = database;
        }
    })
    .await
}

/// An instance with two read-write API keys, and alice (1,000) and bob (0) opened.
async fn spawn_with_two_callers() -> (TestApp, Callers) {
    let callers = Callers::new();
    let app = spawn_for(&callers, None).await;
    for (id, balance) in [("alice", 1_000), ("bob", 0)] {
        let opened = app
            .http
            .post(app.url("/accounts"))
            .bearer_auth(&callers.first)
            .json(&json!({ "id": id, "balance": balance, "currency": "USD" }))
            .send()
            .await
            .unwrap();
        assert_eq!(opened.status(), 201, "{}", opened.text().await.unwrap());
    }
    (app, callers)
}

/// The ids of every stored transfer, read from the database (the API would want a key).
async fn stored_transfers(app: &TestApp) -> Vec<String> {
    let stored = app
        .store
        .transfers()
        .list_transfers(&Default::default(), 100)
        .await
        .unwrap();
    stored.iter().map(|t| t.id.to_string()).collect()
}

/// `POST /transfers` with an `Idempotency-Key`, sent with `api_key`.
async fn post_as(app: &TestApp, api_key: &str, key: &str, body: &Value) -> reqwest::Response {
    app.http
        .post(app.url("/transfers"))
        .bearer_auth(api_key)
        .header("idempotency-key", key)
        .json(body)
        .send()
        .await
        .expect("request")
}

/// The status, whether it is a replay, and the id of the transfer it names.
async fn answer(response: reqwest::Response) -> (u16, Option<String>, String) {
    let status = response.status().as_u16();
    let replay = replayed(&response);
    let body: Value = response.json().await.unwrap();
    let id = body["id"]
        .as_str()
        .or(body["transferId"].as_str())
        .unwrap_or_else(|| panic!("answered {status}, naming no transfer: {body}"))
        .to_owned();
    (status, replay, id)
}

#[tokio::test]
async fn two_api_keys_sending_one_key_and_body_make_two_transfers_and_each_replays_its_own() {
    let (app, callers) = spawn_with_two_callers().await;
    let body = json!({ "source": "alice", "destination": "bob", "amount": 100 });

    let first = answer(post_as(&app, &callers.first, "order-1", &body).await).await;
    let second = answer(post_as(&app, &callers.second, "order-1", &body).await).await;
    assert_eq!((first.0, first.1.as_deref()), (201, None), "{first:?}");
    assert_eq!(
        (second.0, second.1.as_deref()),
        (201, None),
        "the second caller is answered a transfer of its own, not the first's: {second:?}"
    );
    assert_ne!(first.2, second.2);

    let first_again = answer(post_as(&app, &callers.first, "order-1", &body).await).await;
    let second_again = answer(post_as(&app, &callers.second, "order-1", &body).await).await;
    assert_eq!(first_again, (201, Some("true".into()), first.2.clone()));
    assert_eq!(second_again, (201, Some("true".into()), second.2.clone()));

    assert_eq!(
        (app.balance("alice").await, app.balance("bob").await),
        (800, 200)
    );
    let mut made = stored_transfers(&app).await;
    made.sort();
    let mut expected = vec![first.2, second.2];
    expected.sort();
    assert_eq!(made, expected);
}

#[tokio::test]
async fn a_key_one_api_key_used_blocks_no_other_api_key_and_is_still_refused_to_its_own_for_another_body()
 {
    let (app, callers) = spawn_with_two_callers().await;
    let to_bob = |amount: i64| json!({ "source": "alice", "destination": "bob", "amount": amount });

    let first = answer(post_as(&app, &callers.first, "order-2", &to_bob(10)).await).await;
    let second = answer(post_as(&app, &callers.second, "order-2", &to_bob(20)).await).await;
    assert_eq!((first.0, first.1.as_deref()), (201, None), "{first:?}");
    assert_eq!(
        (second.0, second.1.as_deref()),
        (201, None),
        "another caller's key refuses nothing: {second:?}"
    );

    // Each caller's retry is its own transfer; a caller's own reuse is still refused.
    let second_again = answer(post_as(&app, &callers.second, "order-2", &to_bob(20)).await).await;
    assert_eq!(second_again, (201, Some("true".into()), second.2.clone()));
    assert_problem(
        post_as(&app, &callers.first, "order-2", &to_bob(20)).await,
        422,
        "idempotency_key_reused",
    )
    .await;

    assert_eq!(
        (app.balance("alice").await, app.balance("bob").await),
        (970, 30)
    );
    assert_eq!(stored_transfers(&app).await.len(), 2);
}

/// Rewrites what a keyed request stored into the form a version before keys were
/// scoped left: the record `{_id: <key as sent>, transfer, requestHash, at}` and the
/// key as sent on the transfer (`idempotencyKey`). The transfer is replaced whole rather
/// than `$set`, since SecantusDB's unique index would keep the old value (docs/secantusdb.md).
async fn as_taken_before_keys_were_scoped(app: &TestApp, transfer: &str, key: &str) {
    use mongodb::bson::{DateTime, Document, doc, oid::ObjectId};
    let database = app.store.database();
    let transfers = database.collection::<Document>("transactions");
    let keys = database.collection::<Document>("idempotencyKeys");
    let id = ObjectId::parse_str(transfer).unwrap();
    let mut stored = transfers
        .find_one(doc! { "_id": id })
        .await
        .unwrap()
        .expect("the transfer is stored");
    keys.delete_many(doc! { "transfer": id }).await.unwrap();
    let hash = stored.get_str("requestHash").unwrap().to_owned();
    keys.insert_one(
        doc! { "_id": key, "transfer": id, "requestHash": hash, "at": DateTime::now() },
    )
    .await
    .unwrap();
    transfers.delete_one(doc! { "_id": id }).await.unwrap();
    stored.insert("idempotencyKey", key);
    transfers.insert_one(stored).await.unwrap();
}

#[tokio::test]
async fn a_key_taken_before_keys_were_scoped_replays_its_retry_and_blocks_no_other_api_key() {
    let (app, callers) = spawn_with_two_callers().await;
    let to_bob = |amount: i64| json!({ "source": "alice", "destination": "bob", "amount": amount });
    let original = answer(post_as(&app, &callers.first, "order-3", &to_bob(100)).await).await;
    assert_eq!(original.0, 201, "{original:?}");
    as_taken_before_keys_were_scoped(&app, &original.2, "order-3").await;

    // The upgrade: another caller's request with that key is a request of its own.
    let other = answer(post_as(&app, &callers.second, "order-3", &to_bob(5)).await).await;
    assert_eq!(
        (other.0, other.1.as_deref()),
        (201, None),
        "a key taken before the upgrade refuses no other caller: {other:?}"
    );
    assert_ne!(other.2, original.2);
    // The original's retries, before and after the other's, are answered with it.
    for _ in 0..2 {
        let retry = answer(post_as(&app, &callers.first, "order-3", &to_bob(100)).await).await;
        assert_eq!(retry, (201, Some("true".into()), original.2.clone()));
    }
    let other_again = answer(post_as(&app, &callers.second, "order-3", &to_bob(5)).await).await;
    assert_eq!(other_again, (201, Some("true".into()), other.2.clone()));

    assert_eq!(
        (app.balance("alice").await, app.balance("bob").await),
        (895, 105)
    );
    assert_eq!(stored_transfers(&app).await.len(), 2);
}

/// Without `API_KEYS` a key is stored as sent, as before keys were scoped: nothing
/// changes for an installation without API keys, and its keys stay its retries' keys.
#[tokio::test]
async fn without_api_keys_a_key_is_stored_as_sent() {
    use mongodb::bson::{Document, doc};
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let body = json!({ "source": "alice", "destination": "bob", "amount": 1 });
    let (status, _, id) = answer(post_with_key(&app, "as-sent:1", &body).await).await;
    assert_eq!(status, 201);

    let database = app.store.database();
    let record = database
        .collection::<Document>("idempotencyKeys")
        .find_one(doc! {})
        .await
        .unwrap()
        .expect("a record");
    assert_eq!(record.get_str("_id").unwrap(), "as-sent:1");
    assert_eq!(record.get_object_id("transfer").unwrap().to_hex(), id);
    let transfer = database
        .collection::<Document>("transactions")
        .find_one(doc! {})
        .await
        .unwrap()
        .expect("a transfer");
    assert_eq!(transfer.get_str("idempotencyKey").unwrap(), "as-sent:1");
}

/// Two retries of a request made before keys were scoped reach two instances at once.
/// One takes the key of its API key and stops there (paused), before it has looked for
/// the key taken before; the other finds the key of its API key taken, naming a transfer
/// not recorded yet. Recording it would move the money a second time: the key taken
/// before names the original, and both answer with it.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn two_retries_at_once_of_a_request_made_before_keys_were_scoped_both_answer_the_original() {
    use transfer_service::failpoints::{self, Point};
    let (first, callers) = spawn_with_two_callers().await;
    let second = spawn_for(&callers, Some(first.database.clone())).await;
    let body = json!({ "source": "alice", "destination": "bob", "amount": 100 });
    let original = answer(post_as(&first, &callers.first, "order-4", &body).await).await;
    as_taken_before_keys_were_scoped(&first, &original.2, "order-4").await;

    let mut paused = failpoints::pause(&first.instance_id, Point::AfterTakeKey);
    let slow = {
        let request = first
            .http
            .post(first.url("/transfers"))
            .bearer_auth(&callers.first)
            .header("idempotency-key", "order-4")
            .json(&body);
        tokio::spawn(async move { answer(request.send().await.unwrap()).await })
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), paused.reached())
        .await
        .expect("the first retry takes the key of its API key");

    let other = answer(post_as(&second, &callers.first, "order-4", &body).await).await;
    assert_eq!(other, (201, Some("true".into()), original.2.clone()));
    paused.resume();
    let slow = slow.await.unwrap();
    assert_eq!(slow, (201, Some("true".into()), original.2.clone()));

    assert_eq!(
        (first.balance("alice").await, first.balance("bob").await),
        (900, 100)
    );
    assert_eq!(stored_transfers(&first).await, [original.2]);
}
