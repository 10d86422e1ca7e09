//! `POST /transfers/{id}/cancel`, from every state a transfer can be found in.
//!
//! A transfer that is not applied yet is rolled back; one that is applied (or done) is
//! completed and reversed by one compensating transfer. The invariants protected here:
//! after a cancel every balance is back where it started, the total never changes, no
//! account keeps a pending marker, a transfer is reversed at most once, and once a
//! cancel rolled a transfer back no late step of its old owner can move money.
//!
//! The states a client cannot produce through the API (a crashed instance's transfer
//! left `initial`, `pending`, `applied` or `canceling`) are built by writing to the store
//! directly, exactly as that instance would have before dying.

use std::time::Duration;

use mongodb::bson::doc;
use mongodb::bson::oid::ObjectId;
use serde_json::Value;
use transfer_service::domain::{CancelReason, Timestamp, TransferId, TransferState};
use transfer_service::store::transfers::{Mover, StepFields};

use crate::{assert_problem, get_json, walk_pages};
use support::values::{account, amount, from_now, initial};
use support::{TestApp, spawn_app};

/// The owner written on transfers left behind by the "crashed" instance.
const DEAD_INSTANCE: &str = "dead-instance";

/// Records a transfer in `initial`, as step 1 of an instance that then died.
async fn insert_initial(app: &TestApp, source: &str, destination: &str, value: i64) -> TransferId {
    let transfer = initial(source, destination, value);
    app.store
        .transfers()
        .insert_transfer(&transfer)
        .await
        .unwrap();
    transfer.id
}

/// Step 5 as the dead instance: `pending -> applied`; whether it was made.
async fn mark_applied_as_the_dead_instance(app: &TestApp, id: TransferId) -> bool {
    let by = Mover::Owner(DEAD_INSTANCE);
    let (pending, applied) = (TransferState::Pending, TransferState::Applied);
    let moved = app
        .store
        .transfers()
        .change_state(id, pending, applied, by, StepFields::default());
    moved.await.unwrap().is_some()
}

/// Records a transfer and takes it `initial -> pending` as the dead instance (step 2).
async fn insert_pending(app: &TestApp, source: &str, destination: &str, value: i64) -> TransferId {
    let id = insert_initial(app, source, destination, value).await;
    start_as_the_dead_instance(app, id).await;
    id
}

/// As [`insert_pending`], a transfer inserted by a version before one protocol: its
/// document names no parties, and its destination is credited by its prepare, the
/// commit point of that protocol.
async fn insert_pending_before_one_protocol(
    app: &TestApp,
    source: &str,
    destination: &str,
    value: i64,
) -> TransferId {
    let transfer = transfer_service::domain::Transfer {
        credits_at_prepare: true,
        ..initial(source, destination, value)
    };
    app.store
        .transfers()
        .insert_transfer(&transfer)
        .await
        .unwrap();
    start_as_the_dead_instance(app, transfer.id).await;
    transfer.id
}

async fn start_as_the_dead_instance(app: &TestApp, id: TransferId) {
    let started = app
        .store
        .transfers()
        .change_state(
            id,
            TransferState::Initial,
            TransferState::Pending,
            Mover::Owner(DEAD_INSTANCE),
            StepFields::default(),
        )
        .await
        .unwrap()
        .is_some();
    assert!(started, "the dead instance takes the transfer");
}

/// The end of the dead instance's lease as it believes it to be: far in the future, so
/// that only the protocol's own guards (markers and fences) can refuse its steps.
fn unexpired_lease() -> Timestamp {
    from_now(60_000)
}

/// The dead instance's prepare of the source: its debit. Whether it landed.
async fn try_debit(app: &TestApp, source: &str, id: TransferId, value: i64) -> bool {
    app.store
        .accounts()
        .prepare(&account(source), id, -value, unexpired_lease())
        .await
        .unwrap()
        .applied
}

/// The dead instance's prepare of the destination: room for what it will be paid in.
/// Whether it landed.
async fn try_room(app: &TestApp, destination: &str, id: TransferId, value: i64) -> bool {
    app.store
        .accounts()
        .prepare(&account(destination), id, value, unexpired_lease())
        .await
        .unwrap()
        .applied
}

/// The credit of a transfer inserted before one protocol, as its dead instance's prepare
/// of the destination made it. Whether it landed.
async fn try_credit(app: &TestApp, destination: &str, id: TransferId, value: i64) -> bool {
    app.store
        .accounts()
        .apply_credit(&account(destination), id, amount(value), unexpired_lease())
        .await
        .unwrap()
        .applied
}

async fn apply_debit(app: &TestApp, source: &str, id: TransferId, value: i64) {
    assert!(try_debit(app, source, id, value).await, "debit {id}");
}

async fn make_room(app: &TestApp, destination: &str, id: TransferId, value: i64) {
    assert!(try_room(app, destination, id, value).await, "room {id}");
}

async fn apply_credit(app: &TestApp, destination: &str, id: TransferId, value: i64) {
    assert!(try_credit(app, destination, id, value).await, "credit {id}");
}

/// `POST /transfers/{id}/cancel`. A cancel takes milliseconds; one that has not
/// answered in 10 s is stuck, and the test says so rather than wait for the server's
/// own 30 s time-out.
async fn cancel(app: &TestApp, id: &str) -> reqwest::Response {
    app.http
        .post(app.url(&format!("/transfers/{id}/cancel")))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .unwrap_or_else(|e| panic!("cancel {id} did not answer: {e}"))
}

/// Cancels `id`, asserting 200; the transfer as answered.
async fn cancel_ok(app: &TestApp, id: &str) -> Value {
    let response = cancel(app, id).await;
    let status = response.status();
    let text = response.text().await.unwrap();
    assert_eq!(status, 200, "cancel {id}: {text}");
    serde_json::from_str(&text).unwrap()
}

async fn get_transfer(app: &TestApp, id: &str) -> Value {
    let (status, body) = get_json(app, &format!("/transfers/{id}")).await;
    assert_eq!(status, 200, "{body}");
    body
}

/// Every transfer stored, through the API.
async fn all_transfers(app: &TestApp) -> Vec<String> {
    walk_pages(app, "/transfers?limit=100").await.concat()
}

/// Asserts that `original` is done and reversed by a done compensating transfer of the
/// same amount in the opposite direction; returns the compensating transfer's id.
async fn assert_reversed(app: &TestApp, original: &Value) -> String {
    assert_eq!(original["state"], "done", "{original}");
    let reversal_id = original["reversedBy"]
        .as_str()
        .unwrap_or_else(|| panic!("a reversed transfer names its reversal: {original}"))
        .to_owned();
    let reversal = get_transfer(app, &reversal_id).await;
    assert_eq!(reversal["state"], "done", "{reversal}");
    assert_eq!(reversal["reverses"], original["id"]);
    assert_eq!(reversal["source"], original["destination"]);
    assert_eq!(reversal["destination"], original["source"]);
    assert_eq!(reversal["amount"], original["amount"]);
    assert_eq!(reversal["currency"], original["currency"]);
    reversal_id
}

#[tokio::test]
async fn cancelling_an_unknown_transfer_is_404() {
    let app = spawn_app().await;
    let unknown = ObjectId::new().to_hex();
    assert_problem(cancel(&app, &unknown).await, 404, "transfer_not_found").await;
    assert_problem(cancel(&app, "not-hex").await, 404, "transfer_not_found").await;
}

#[tokio::test]
async fn cancelling_a_canceled_transfer_answers_it_unchanged() {
    let app = spawn_app().await;
    app.open_account("alice", 100).await;
    app.open_account("bob", 0).await;
    let (status, problem) = app.transfer("alice", "bob", 500).await;
    assert_eq!(status, 422, "{problem}");
    let id = problem["transferId"].as_str().unwrap().to_owned();
    let before = get_transfer(&app, &id).await;

    let answered = cancel_ok(&app, &id).await;

    assert_eq!(answered["state"], "canceled");
    assert_eq!(answered["reason"], "insufficient_funds");
    assert_eq!(get_transfer(&app, &id).await, before, "nothing changed");
    assert_eq!(app.balance("alice").await, 100);
    assert_eq!(app.balance("bob").await, 0);
    assert_eq!(all_transfers(&app).await, vec![id]);
}

#[tokio::test]
async fn cancelling_a_done_transfer_reverses_it_and_restores_the_balances() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 20).await;
    let (status, original) = app.transfer("alice", "bob", 300).await;
    assert_eq!(status, 201, "{original}");
    let id = original["id"].as_str().unwrap().to_owned();

    let answered = cancel_ok(&app, &id).await;

    assert_eq!(answered["id"], id.as_str());
    let reversal_id = assert_reversed(&app, &answered).await;
    let stored = get_transfer(&app, &id).await;
    assert_eq!(stored["reversedBy"], reversal_id.as_str());
    assert_eq!(stored["state"], "done");

    assert_eq!(app.balance("alice").await, 1_000);
    assert_eq!(app.balance("bob").await, 20);
    assert_eq!(app.total_balance().await, 1_020);
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test]
async fn cancelling_a_reversed_transfer_again_makes_no_second_reversal() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let (_, original) = app.transfer("alice", "bob", 300).await;
    let id = original["id"].as_str().unwrap().to_owned();
    let first = cancel_ok(&app, &id).await;
    let reversal_id = assert_reversed(&app, &first).await;

    for _ in 0..3 {
        let again = cancel_ok(&app, &id).await;
        assert_eq!(again["reversedBy"], reversal_id.as_str());
    }

    assert_eq!(app.balance("alice").await, 1_000);
    assert_eq!(app.balance("bob").await, 0);
    assert_eq!(
        all_transfers(&app).await.len(),
        2,
        "the original and one reversal"
    );
}

#[tokio::test]
async fn a_done_transfer_whose_destination_spent_the_money_is_not_reversed_until_funded() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    app.open_account("carol", 0).await;
    let (_, original) = app.transfer("alice", "bob", 300).await;
    let id = original["id"].as_str().unwrap().to_owned();
    let (status, spent) = app.transfer("bob", "carol", 200).await;
    assert_eq!(status, 201, "{spent}");

    let refused = cancel(&app, &id).await;

    let problem = assert_problem(refused, 422, "insufficient_funds").await;
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("bob"),
        "names the account that cannot pay: {detail}"
    );
    assert_eq!(app.balance("alice").await, 700);
    assert_eq!(app.balance("bob").await, 100);
    assert_eq!(app.balance("carol").await, 200);
    let stored = get_transfer(&app, &id).await;
    assert_eq!(stored["state"], "done");
    assert!(stored.get("reversedBy").is_none(), "{stored}");
    assert!(app.accounts_with_pending().await.is_empty());

    // Once bob holds the amount again, a new cancel reverses the transfer.
    let (status, refund) = app.transfer("carol", "bob", 200).await;
    assert_eq!(status, 201, "{refund}");
    let answered = cancel_ok(&app, &id).await;
    assert_reversed(&app, &answered).await;
    assert_eq!(app.balance("alice").await, 1_000);
    assert_eq!(app.balance("bob").await, 0);
    assert_eq!(app.balance("carol").await, 0);
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test]
async fn cancelling_an_initial_transfer_cancels_it_without_touching_balances() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let id = insert_initial(&app, "alice", "bob", 300).await;

    let answered = cancel_ok(&app, &id.to_string()).await;

    assert_eq!(answered["state"], "canceled");
    assert_eq!(answered["reason"], "canceled_by_request");
    let stored = get_transfer(&app, &id.to_string()).await;
    assert_eq!(stored["state"], "canceled");
    assert_eq!(stored["reason"], "canceled_by_request");
    // The instance that recorded it can no longer start it.
    let started = app
        .store
        .transfers()
        .change_state(
            id,
            TransferState::Initial,
            TransferState::Pending,
            Mover::Owner(DEAD_INSTANCE),
            StepFields::default(),
        )
        .await
        .unwrap()
        .is_some();
    assert!(!started);
    assert_eq!(app.balance("alice").await, 1_000);
    assert_eq!(app.balance("bob").await, 0);
}

#[tokio::test]
async fn cancelling_a_pending_transfer_with_nothing_applied_cancels_it() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let id = insert_pending(&app, "alice", "bob", 300).await;

    let answered = cancel_ok(&app, &id.to_string()).await;

    assert_eq!(answered["state"], "canceled");
    assert_eq!(answered["reason"], "canceled_by_request");
    assert!(!try_debit(&app, "alice", id, 300).await);
    assert!(!try_room(&app, "bob", id, 300).await);
    assert_eq!(app.balance("alice").await, 1_000);
    assert_eq!(app.balance("bob").await, 0);
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test]
async fn cancelling_a_half_applied_transfer_refunds_the_source_and_fences_out_the_dead_owner() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let id = insert_pending(&app, "alice", "bob", 300).await;
    apply_debit(&app, "alice", id, 300).await;
    assert_eq!(app.balance("alice").await, 700);

    let answered = cancel_ok(&app, &id.to_string()).await;

    assert_eq!(answered["state"], "canceled");
    assert_eq!(answered["reason"], "canceled_by_request");
    assert_eq!(
        get_transfer(&app, &id.to_string()).await["state"],
        "canceled"
    );
    assert_eq!(app.balance("alice").await, 1_000);
    assert_eq!(app.balance("bob").await, 0);
    assert!(app.accounts_with_pending().await.is_empty());

    // The dead instance wakes up and carries on where it stopped: every step is refused.
    assert!(
        !try_room(&app, "bob", id, 300).await,
        "a late prepare landed after the rollback"
    );
    assert!(
        !try_debit(&app, "alice", id, 300).await,
        "a late debit landed after the rollback"
    );
    let marked_applied = mark_applied_as_the_dead_instance(&app, id).await;
    assert!(!marked_applied);
    assert_eq!(app.balance("alice").await, 1_000);
    assert_eq!(app.balance("bob").await, 0);
    assert_eq!(app.total_balance().await, 1_000);
    assert!(app.accounts_with_pending().await.is_empty());
}

/// A transfer inserted before one protocol commits by its credit: a cancel that finds it
/// landed completes the transfer and reverses it.
#[tokio::test]
async fn cancelling_a_pending_transfer_whose_credit_landed_completes_and_reverses_it() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let id = insert_pending_before_one_protocol(&app, "alice", "bob", 300).await;
    apply_debit(&app, "alice", id, 300).await;
    apply_credit(&app, "bob", id, 300).await;

    let answered = cancel_ok(&app, &id.to_string()).await;

    assert_reversed(&app, &answered).await;
    assert_eq!(get_transfer(&app, &id.to_string()).await["state"], "done");
    assert_eq!(app.balance("alice").await, 1_000);
    assert_eq!(app.balance("bob").await, 0);
    assert!(app.accounts_with_pending().await.is_empty());
}

/// A transfer commits by `pending -> applied`: one whose every party is prepared but that
/// is still `pending` is rolled back by a cancel, its room on the destination given back.
#[tokio::test]
async fn cancelling_a_pending_transfer_whose_parties_are_all_prepared_rolls_it_back() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let id = insert_pending(&app, "alice", "bob", 300).await;
    apply_debit(&app, "alice", id, 300).await;
    make_room(&app, "bob", id, 300).await;

    let answered = cancel_ok(&app, &id.to_string()).await;

    assert_eq!(answered["state"], "canceled", "{answered}");
    assert_eq!(answered["reason"], "canceled_by_request", "{answered}");
    assert!(answered.get("reversedBy").is_none(), "{answered}");
    assert!(!mark_applied_as_the_dead_instance(&app, id).await);
    assert_eq!(app.balance("alice").await, 1_000);
    assert_eq!(app.balance("bob").await, 0);
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test]
async fn cancelling_an_applied_transfer_completes_and_reverses_it() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let id = insert_pending(&app, "alice", "bob", 300).await;
    apply_debit(&app, "alice", id, 300).await;
    make_room(&app, "bob", id, 300).await;
    let applied = mark_applied_as_the_dead_instance(&app, id).await;
    assert!(applied);

    let answered = cancel_ok(&app, &id.to_string()).await;

    assert_reversed(&app, &answered).await;
    assert_eq!(app.balance("alice").await, 1_000);
    assert_eq!(app.balance("bob").await, 0);
    assert!(app.accounts_with_pending().await.is_empty());
}

/// The same, for a transfer inserted before one protocol: its destination was credited
/// at its prepare, and its settle only pulls the markers.
#[tokio::test]
async fn cancelling_an_applied_transfer_inserted_before_one_protocol_completes_and_reverses_it() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let id = insert_pending_before_one_protocol(&app, "alice", "bob", 300).await;
    apply_debit(&app, "alice", id, 300).await;
    apply_credit(&app, "bob", id, 300).await;
    let applied = mark_applied_as_the_dead_instance(&app, id).await;
    assert!(applied);

    let answered = cancel_ok(&app, &id.to_string()).await;

    assert_reversed(&app, &answered).await;
    assert_eq!(app.balance("alice").await, 1_000);
    assert_eq!(app.balance("bob").await, 0);
    assert_eq!(app.total_balance().await, 1_000);
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test]
async fn cancelling_a_transfer_stuck_in_canceling_finishes_the_rollback() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let id = insert_pending(&app, "alice", "bob", 300).await;
    apply_debit(&app, "alice", id, 300).await;
    let rolling_back = app
        .store
        .transfers()
        .change_state(
            id,
            TransferState::Pending,
            TransferState::Canceling,
            Mover::Owner(DEAD_INSTANCE),
            StepFields {
                reason: Some(CancelReason::CanceledByRequest),
                ..StepFields::default()
            },
        )
        .await
        .unwrap()
        .is_some();
    assert!(rolling_back);

    let answered = cancel_ok(&app, &id.to_string()).await;

    assert_eq!(answered["state"], "canceled");
    assert_eq!(answered["reason"], "canceled_by_request");
    assert_eq!(
        get_transfer(&app, &id.to_string()).await["state"],
        "canceled"
    );
    assert_eq!(app.balance("alice").await, 1_000);
    assert_eq!(app.balance("bob").await, 0);
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test]
async fn a_compensating_transfer_can_itself_be_reversed() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let (_, original) = app.transfer("alice", "bob", 300).await;
    let first = cancel_ok(&app, original["id"].as_str().unwrap()).await;
    let reversal_id = assert_reversed(&app, &first).await;

    let reversed_reversal = cancel_ok(&app, &reversal_id).await;

    assert_reversed(&app, &reversed_reversal).await;
    assert_eq!(app.balance("alice").await, 700);
    assert_eq!(app.balance("bob").await, 300);
    assert_eq!(app.total_balance().await, 1_000);
}

#[tokio::test]
async fn a_reversal_that_would_overflow_the_original_source_is_refused_as_overflow() {
    // Bob holds the amount, so funds are not the problem: crediting alice back would take
    // her past the largest balance. The client must be told that, and nothing changes.
    let max_money = 9_007_199_254_740_991_i64;
    let app = spawn_app().await;
    app.open_account("alice", 100).await;
    app.open_account("bob", 0).await;
    app.open_account("whale", max_money).await;
    let (_, original) = app.transfer("alice", "bob", 100).await;
    let id = original["id"].as_str().unwrap().to_owned();
    let (status, refill) = app.transfer("whale", "alice", max_money).await;
    assert_eq!(status, 201, "{refill}");

    let refused = cancel(&app, &id).await;

    let problem = assert_problem(refused, 422, "balance_overflow").await;
    assert!(problem.get("transferId").is_some(), "{problem}");
    assert_eq!(app.balance("alice").await, max_money);
    assert_eq!(app.balance("bob").await, 100);
    assert_eq!(app.balance("whale").await, 0);
    let stored = get_transfer(&app, &id).await;
    assert_eq!(stored["state"], "done");
    assert!(stored.get("reversedBy").is_none(), "{stored}");
    assert!(app.accounts_with_pending().await.is_empty());

    // Once alice has room again, a new cancel reverses the transfer.
    let (status, spent) = app.transfer("alice", "whale", 100).await;
    assert_eq!(status, 201, "{spent}");
    let answered = cancel_ok(&app, &id).await;
    assert_reversed(&app, &answered).await;
    assert_eq!(app.balance("alice").await, max_money);
    assert_eq!(app.balance("bob").await, 0);
    assert_eq!(app.total_balance().await, max_money + 100);
}

#[tokio::test]
async fn a_reversal_whose_source_account_vanished_is_refused_as_unknown_account() {
    // The money cannot go back to an account that no longer exists (deleted behind the
    // service's back): the compensating transfer ends canceled with `account_not_found`,
    // and the client must be told that, not that the destination lacks funds.
    let app = spawn_app().await;
    app.open_account("alice", 100).await;
    app.open_account("bob", 0).await;
    let (_, original) = app.transfer("alice", "bob", 100).await;
    let id = original["id"].as_str().unwrap().to_owned();
    app.store
        .database()
        .collection::<mongodb::bson::Document>("accounts")
        .delete_one(doc! { "_id": "alice" })
        .await
        .unwrap();

    let refused = cancel(&app, &id).await;

    let problem = assert_problem(refused, 422, "unknown_account").await;
    let attempt = problem["transferId"]
        .as_str()
        .expect("the attempt is named");
    let attempt = get_transfer(&app, attempt).await;
    assert_eq!(attempt["state"], "canceled", "{attempt}");
    assert_eq!(attempt["reason"], "account_not_found", "{attempt}");
    assert_eq!(app.balance("bob").await, 100, "nothing changed");
    let stored = get_transfer(&app, &id).await;
    assert!(
        stored.get("reversedBy").is_none(),
        "the claim is released: {stored}"
    );
    assert!(app.accounts_with_pending().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_cancels_of_a_half_applied_transfer_refund_the_source_exactly_once() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;

    for round in 1..=5 {
        let id = insert_pending(&app, "alice", "bob", 300).await;
        apply_debit(&app, "alice", id, 300).await;

        let cancels = (0..10).map(|_| {
            let http = app.http.clone();
            let url = app.url(&format!("/transfers/{id}/cancel"));
            tokio::spawn(async move {
                let response = http.post(url).send().await.expect("request");
                let status = response.status().as_u16();
                (status, response.text().await.unwrap())
            })
        });
        for answer in futures::future::join_all(cancels).await {
            let (status, text) = answer.expect("task");
            assert_eq!(status, 200, "round {round}: {text}");
            let body: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(body["state"], "canceled", "round {round}: {body}");
        }

        assert_eq!(app.balance("alice").await, 1_000, "round {round}");
        assert_eq!(app.balance("bob").await, 0, "round {round}");
        assert!(
            app.accounts_with_pending().await.is_empty(),
            "round {round}"
        );
    }
}

/// The rule (`store::transfers::Mover`): a cancel moves a started transfer only with
/// both its accounts fenced. Asking without is a bug in the caller, refused loudly
/// before anything is written.
#[tokio::test]
#[should_panic(expected = "without fencing its accounts")]
async fn a_cancel_moving_a_started_transfer_without_fences_is_a_bug_said_loudly() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let id = insert_pending(&app, "alice", "bob", 300).await;
    let by = Mover::Cancel {
        owner: "canceler",
        fenced: None,
    };
    let _ = app
        .store
        .transfers()
        .change_state(
            id,
            TransferState::Pending,
            TransferState::Canceling,
            by,
            StepFields::default(),
        )
        .await;
}
