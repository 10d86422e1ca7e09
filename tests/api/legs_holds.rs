//! Multi-leg holds (`docs/legs.md`): every paying party's net reserved and every
//! receiving party's kept room for, until the hold is captured whole, voided or expires.
//! Every amount is read back through the API.

use std::time::Duration;

use serde_json::{Value, json};

use crate::{assert_problem, get_json};
use support::{TestApp, spawn_app, spawn_app_with};

fn leg(source: &str, destination: &str, amount: i64) -> Value {
    json!({ "source": source, "destination": destination, "amount": amount })
}

/// `POST /transfers` with these legs as a hold expiring in `expires_in_ms`.
async fn hold(app: &TestApp, legs: &Value, expires_in_ms: i64) -> (u16, Value) {
    let body = json!({ "legs": legs, "hold": { "expiresInMs": expires_in_ms } });
    let response = app.post_json("/transfers", body).await;
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

async fn post(app: &TestApp, path: &str, body: Option<Value>) -> reqwest::Response {
    match body {
        Some(body) => app.post_json(path, body).await,
        None => app.post_json(path, json!({})).await,
    }
}

/// (balance, availableBalance, pendingDebits, pendingCredits) as the API shows them.
async fn amounts(app: &TestApp, account: &str) -> (i64, i64, i64, i64) {
    let (status, a) = get_json(app, &format!("/accounts/{account}")).await;
    assert_eq!(status, 200, "{a}");
    let field = |name: &str| a[name].as_i64().unwrap_or_else(|| panic!("{name} in {a}"));
    (
        field("balance"),
        field("availableBalance"),
        field("pendingDebits"),
        field("pendingCredits"),
    )
}

/// The kinds of `account`'s entries, oldest first.
async fn entry_kinds(app: &TestApp, account: &str) -> Vec<String> {
    let (status, page) = get_json(app, &format!("/accounts/{account}/entries")).await;
    assert_eq!(status, 200, "{page}");
    page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_owned())
        .collect()
}

/// No account carries a marker, a reservation or room.
async fn assert_nothing_pending(app: &TestApp) {
    for a in app
        .store
        .accounts()
        .list_accounts(None, None, 1_000)
        .await
        .unwrap()
    {
        assert!(a.pending_transactions.is_empty(), "marker left on {a:?}");
        assert_eq!(
            (a.pending_debits, a.pending_credits, a.incoming),
            (0, 0, 0),
            "{a:?}"
        );
    }
}

/// The marketplace payment of `docs/legs.md`, held: the buyer's 100.00 reserved, the
/// seller's, platform's and authority's nets kept room for.
fn payment() -> Value {
    json!([
        leg("buyer", "seller", 10_000),
        leg("seller", "platform", 300),
        leg("seller", "tax", 1_900),
    ])
}

async fn open_payment_accounts(app: &TestApp) {
    for (id, balance) in [
        ("buyer", 20_000),
        ("seller", 0),
        ("platform", 0),
        ("tax", 0),
    ] {
        app.open_account(id, balance).await;
    }
}

/// A multi-leg hold reserves every party's net and moves nothing; a capture of part of
/// it is refused; a capture of the whole moves every leg, each account once.
#[tokio::test]
async fn a_multi_leg_hold_reserves_every_party_and_a_capture_moves_every_leg() {
    let app = spawn_app().await;
    open_payment_accounts(&app).await;
    let (status, body) = hold(&app, &payment(), 60_000).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["state"], "held", "{body}");
    assert_eq!(body["legs"], payment(), "{body}");
    assert_eq!(
        (&body["amount"], &body["heldAmount"]),
        (&json!(10_000), &json!(10_000))
    );
    let id = body["id"].as_str().unwrap().to_owned();
    assert_eq!(amounts(&app, "buyer").await, (20_000, 10_000, 10_000, 0));
    assert_eq!(amounts(&app, "seller").await, (0, 0, 0, 7_800));
    assert_eq!(amounts(&app, "platform").await, (0, 0, 0, 300));
    assert_eq!(amounts(&app, "tax").await, (0, 0, 0, 1_900));

    let capture = format!("/transfers/{id}/capture");
    let part = post(&app, &capture, Some(json!({ "amount": 9_000 }))).await;
    let problem = assert_problem(part, 422, "invalid_field").await;
    assert_eq!(problem["field"], "amount", "{problem}");
    assert_eq!(amounts(&app, "buyer").await, (20_000, 10_000, 10_000, 0));

    let whole = post(&app, &capture, None).await;
    assert_eq!(whole.status(), 200);
    let done: Value = whole.json().await.unwrap();
    assert_eq!(
        (&done["state"], &done["amount"]),
        (&json!("done"), &json!(10_000))
    );
    assert_eq!(amounts(&app, "buyer").await, (10_000, 10_000, 0, 0));
    assert_eq!(amounts(&app, "seller").await, (7_800, 7_800, 0, 0));
    assert_eq!(amounts(&app, "platform").await, (300, 300, 0, 0));
    assert_eq!(amounts(&app, "tax").await, (1_900, 1_900, 0, 0));
    assert_nothing_pending(&app).await;
    // The same capture again answers the same.
    let again = post(&app, &capture, Some(json!({ "amount": 10_000 }))).await;
    assert_eq!(again.status(), 200);
    assert_eq!(
        entry_kinds(&app, "buyer").await,
        ["opened", "debit_reserved", "debit_captured"]
    );
    assert_eq!(
        entry_kinds(&app, "seller").await,
        ["opened", "credit_reserved", "credit_captured"]
    );
}

/// A void releases every party's reservation and moves nothing.
#[tokio::test]
async fn a_voided_multi_leg_hold_releases_every_party() {
    let app = spawn_app().await;
    open_payment_accounts(&app).await;
    let (status, body) = hold(&app, &payment(), 60_000).await;
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_str().unwrap();

    let voided = post(&app, &format!("/transfers/{id}/void"), None).await;
    assert_eq!(voided.status(), 200);
    let voided: Value = voided.json().await.unwrap();
    assert_eq!(
        (&voided["state"], &voided["reason"]),
        (&json!("canceled"), &json!("voided"))
    );
    assert_eq!(amounts(&app, "buyer").await, (20_000, 20_000, 0, 0));
    for account in ["seller", "platform", "tax"] {
        assert_eq!(amounts(&app, account).await, (0, 0, 0, 0), "{account}");
    }
    assert_nothing_pending(&app).await;
    assert_eq!(
        entry_kinds(&app, "buyer").await,
        ["opened", "debit_reserved", "debit_released"]
    );
    assert_eq!(
        entry_kinds(&app, "tax").await,
        ["opened", "credit_reserved", "credit_released"]
    );
    let capture = post(&app, &format!("/transfers/{id}/capture"), None).await;
    assert_problem(capture, 409, "hold_voided").await;
}

/// A paying party short of funds refuses the whole hold, named, and nothing stays
/// reserved anywhere.
#[tokio::test]
async fn a_party_short_of_funds_refuses_the_multi_leg_hold_and_nothing_stays_reserved() {
    let app = spawn_app().await;
    for (id, balance) in [("a", 1_000), ("b", 0), ("c", 499), ("d", 0)] {
        app.open_account(id, balance).await;
    }
    let legs = json!([leg("a", "b", 100), leg("c", "d", 500)]);
    let (status, body) = hold(&app, &legs, 60_000).await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(
        (&body["code"], &body["account"]),
        (&json!("insufficient_funds"), &json!("c"))
    );
    for (account, balance) in [("a", 1_000), ("b", 0), ("c", 499), ("d", 0)] {
        assert_eq!(
            amounts(&app, account).await,
            (balance, balance, 0, 0),
            "{account}"
        );
    }
    assert_nothing_pending(&app).await;
}

/// From `expiresAt` on, reads leave out what an expired multi-leg hold reserved on every
/// party, and a paying party that is not the first leg's source may spend it before any
/// sweeper comes: its debit expires the hold and frees it.
#[tokio::test]
async fn an_expired_multi_leg_hold_frees_a_paying_party_that_is_not_its_first_source() {
    let app = spawn_app_with(|s| s.sweep_interval = Duration::from_secs(3_600)).await;
    for (id, balance) in [("a", 1_000), ("b", 0), ("c", 500), ("d", 0), ("e", 0)] {
        app.open_account(id, balance).await;
    }
    let legs = json!([leg("a", "b", 100), leg("c", "d", 500)]);
    let (status, body) = hold(&app, &legs, 1_000).await;
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_str().unwrap().to_owned();
    assert_eq!(amounts(&app, "c").await, (500, 0, 500, 0));
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    assert_eq!(
        amounts(&app, "c").await,
        (500, 500, 0, 0),
        "read as expired"
    );
    assert_eq!(amounts(&app, "d").await, (0, 0, 0, 0), "read as expired");

    let (status, body) = app.transfer("c", "e", 500).await;
    assert_eq!(status, 201, "{body}");
    let (_, ended) = get_json(&app, &format!("/transfers/{id}")).await;
    assert_eq!(
        (&ended["state"], &ended["reason"]),
        (&json!("canceled"), &json!("expired"))
    );
    assert_eq!(amounts(&app, "c").await, (0, 0, 0, 0));
    assert_eq!(amounts(&app, "e").await, (500, 500, 0, 0));
    assert_eq!(amounts(&app, "a").await, (1_000, 1_000, 0, 0));
    assert_nothing_pending(&app).await;
}

/// The room an expired multi-leg hold kept in a receiving party that is not the first
/// leg's destination is free before any sweeper comes: a multi-leg transfer that pays
/// into it expires the hold and releases that party's reservation rather than answer
/// `balance_overflow`, as a plain credit does.
#[tokio::test]
async fn the_room_an_expired_multi_leg_hold_kept_in_a_receiving_party_is_free_before_the_sweeper_comes()
 {
    const MAX_MONEY: i64 = transfer_service::domain::MAX_MONEY;
    let app = spawn_app_with(|s| s.sweep_interval = Duration::from_secs(3_600)).await;
    for (id, balance) in [("a", 1_000), ("b", 0), ("c", 1_000)] {
        app.open_account(id, balance).await;
    }
    app.open_account("full", MAX_MONEY - 100).await;
    let legs = json!([leg("a", "b", 10), leg("a", "full", 100)]);
    let (status, body) = hold(&app, &legs, 1_000).await;
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_str().unwrap().to_owned();
    assert_eq!(
        amounts(&app, "full").await,
        (MAX_MONEY - 100, MAX_MONEY - 100, 0, 100)
    );
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    let paid = json!([leg("c", "full", 60), leg("c", "b", 1)]);
    let response = app.post_json("/transfers", json!({ "legs": paid })).await;
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
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
    assert_eq!(amounts(&app, "a").await, (1_000, 1_000, 0, 0));
    assert_eq!(amounts(&app, "c").await, (939, 939, 0, 0));
    assert_nothing_pending(&app).await;
}

/// The sweeper expires a multi-leg hold left past its expiry and releases every party.
#[tokio::test]
async fn a_multi_leg_hold_left_past_its_expiry_is_expired_by_the_sweeper() {
    let app = spawn_app().await;
    open_payment_accounts(&app).await;
    let (status, body) = hold(&app, &payment(), 1_000).await;
    assert_eq!(status, 201, "{body}");
    let id = support::values::transfer_id(body["id"].as_str().unwrap());
    support::poll_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        async || {
            let stored = app.store.transfers().transfer(id).await.unwrap().unwrap();
            match stored.state {
                transfer_service::domain::TransferState::Canceled => Ok(stored),
                _ => Err(stored),
            }
        },
    )
    .await
    .unwrap_or_else(|stored| panic!("not expired: {stored:?}"));
    assert_eq!(amounts(&app, "buyer").await, (20_000, 20_000, 0, 0));
    assert_nothing_pending(&app).await;
}

/// A cancel of a captured multi-leg hold reverses every leg, as for a done transfer.
#[tokio::test]
async fn a_captured_multi_leg_hold_is_reversed_by_a_cancel() {
    let app = spawn_app().await;
    open_payment_accounts(&app).await;
    let (_, body) = hold(&app, &payment(), 60_000).await;
    let id = body["id"].as_str().unwrap().to_owned();
    let captured = post(&app, &format!("/transfers/{id}/capture"), None).await;
    assert_eq!(captured.status(), 200);

    let canceled = post(&app, &format!("/transfers/{id}/cancel"), None).await;
    assert_eq!(canceled.status(), 200);
    let canceled: Value = canceled.json().await.unwrap();
    assert!(canceled["reversedBy"].is_string(), "{canceled}");
    assert_eq!(amounts(&app, "buyer").await, (20_000, 20_000, 0, 0));
    for account in ["seller", "platform", "tax"] {
        assert_eq!(amounts(&app, account).await, (0, 0, 0, 0), "{account}");
    }
    assert_nothing_pending(&app).await;
}

/// What an expirer killed right after `held -> canceling` leaves of a multi-leg hold
/// over `legs` (the first leg's accounts as its `source` and `destination`): the hold
/// `canceling`, reason `expired`, past its `expiresAt`, every party's reservation in
/// place, owned by the dead process (its lease fresh, so nobody drives it). Its id.
async fn left_canceling_by_a_killed_expirer(
    app: &TestApp,
    legs: Vec<(&str, &str, i64)>,
) -> transfer_service::domain::TransferId {
    use support::values;
    use transfer_service::domain::{CancelReason, Hold, Leg, Legs, TransferState};
    let store = &app.store;
    let here = store.deployment().clone();
    let legs = Legs::new(
        legs.iter()
            .map(|(s, d, a)| Leg {
                source: values::account(s),
                destination: values::account(d),
                amount: values::amount(*a),
            })
            .collect(),
    )
    .unwrap()
    .placed(|_| here.clone());
    let (first, total) = (&legs.legs()[0], legs.moved().minor_units());
    let mut hold = values::initial(first.source.as_str(), first.destination.as_str(), total);
    hold.source_deployment = here.clone();
    hold.destination_deployment = here.clone();
    let now = store.server_time().await.unwrap();
    hold.hold = Some(Hold {
        amount: values::amount(total),
        expires_at: values::after(now, -1_000),
    });
    for party in legs.parties() {
        let step = store
            .accounts()
            .reserve(
                &party.account,
                hold.id,
                party.net,
                values::after(now, 10_000),
            )
            .await
            .unwrap();
        assert!(step.applied, "{party:?}");
    }
    hold.legs = Some(Box::new(legs));
    hold.state = TransferState::Canceling;
    hold.reason = Some(CancelReason::Expired);
    hold.owner = Some("killed/00000000".into());
    store.transfers().insert_transfer(&hold).await.unwrap();
    hold.id
}

/// A party that is the first leg's source but receives on net (`a` pays `b` 100 and is
/// paid 300 by `c`) reserves nothing out of its balance: a debit of it refused for funds
/// has nothing of an expired multi-leg hold to free, and is answered 422
/// `insufficient_funds` at once. (It was looked up by `source`, "freed" again and again
/// while its receiving reservation stayed, and the debit ended in 503 after 16 rounds,
/// left `pending`.)
#[tokio::test]
async fn a_first_source_that_receives_on_net_is_refused_for_funds_past_an_expired_multi_leg_hold() {
    let app = spawn_app_with(|s| s.stale_after = Duration::from_secs(600)).await;
    for (id, balance) in [("a", 50), ("b", 0), ("c", 300), ("e", 0)] {
        app.open_account(id, balance).await;
    }
    left_canceling_by_a_killed_expirer(&app, vec![("a", "b", 100), ("c", "a", 300)]).await;
    assert_eq!(amounts(&app, "a").await, (50, 50, 0, 0), "read as expired");

    let (status, body) = app.transfer("a", "e", 100).await;
    assert_eq!(
        (status, &body["code"], &body["state"]),
        (422, &json!("insufficient_funds"), &Value::Null),
        "{body}"
    );
    assert_eq!(app.balance("a").await, 50);
    assert_eq!(app.balance("e").await, 0);
}
