//! The event feed (`GET /events`): what happened, recorded from the database's change
//! stream by a background recorder, read with a cursor.
//!
//! Invariants protected here: every account opened and every transfer that reaches
//! `held`, `done` or `canceled` is in the feed exactly once, as `<type>:<subject id>`, its
//! data the subject as `GET` answered it at that moment (a hold's `held` event keeps the
//! held amount after a capture; a `done` event never names a later reversal), also when
//! the recorder reads the change only after later ones landed, and whichever strategy
//! made the transfer; nothing else is in the feed; a reader that follows `next`, at any
//! page size, reads every event exactly once, and every cursor a run gave (an empty
//! page's too, even before the first event) resumes with exactly the events after it; a
//! type filter keeps the feed's order; a parameter the feed cannot read is a 400
//! `invalid_parameter`, never a 500, and so is a cursor no instance of the service could
//! have given (bounded by the deployments served, each bound tested at its edge); a cursor whose next events the retention removed
//! answers 410 `cursor_expired` (one with nothing removed after it stays good), while a
//! read without one starts at the oldest event kept; and instances sharing a database,
//! each running a recorder, record each event once, also across a recorder that stops
//! and another that takes over.
//!
//! The recorder is asynchronous: tests wait for events with [`eventually`]. It inserts
//! events in the order of their changes, an event visible only once every earlier one
//! is, so once the event of a change made after all the others is in the feed
//! ([`whole_feed`]), the feed is complete: an event missing or extra then is a real one, not
//! a late one.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use futures::TryStreamExt;
use mongodb::bson::{Document, doc};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use transfer_service::domain::{Strategy, TransferState};

use crate::{assert_problem, get_json};
use support::{TestApp, eventually, spawn_app, spawn_app_with};

/// How long the recorder may take to record an event (a few hundred ms as a rule).
const RECORDED_WITHIN: Duration = Duration::from_secs(10);
const POLL_EVERY: Duration = Duration::from_millis(25);
/// The types an event may have.
const TYPES: [&str; 4] = [
    "account.opened",
    "transfer.held",
    "transfer.done",
    "transfer.canceled",
];

/// `GET /events{query}`, asserted 200 with an array of items and a string `next`.
async fn events_page(app: &TestApp, query: &str) -> (Vec<Value>, String) {
    let path = format!("/events{query}");
    let (status, page) = get_json(app, &path).await;
    assert_eq!(status, 200, "GET {path}: {page}");
    let items = page["items"]
        .as_array()
        .unwrap_or_else(|| panic!("GET {path}: items is an array: {page}"))
        .clone();
    let next = page["next"]
        .as_str()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| panic!("GET {path}: next is a string, on every page: {page}"))
        .to_owned();
    (items, next)
}

/// The whole feed, in one read.
async fn feed(app: &TestApp) -> Vec<Value> {
    events_page(app, "?limit=1000").await.0
}

fn event_id(event: &Value) -> String {
    event["id"]
        .as_str()
        .unwrap_or_else(|| panic!("an event has an id: {event}"))
        .to_owned()
}

fn ids(events: &[Value]) -> Vec<String> {
    events.iter().map(event_id).collect()
}

/// Asserts that no id is there twice.
fn assert_unique(ids: &[String]) {
    let mut seen = HashSet::new();
    for id in ids {
        assert!(seen.insert(id), "{id} is in the feed twice: {ids:#?}");
    }
}

/// Opens `id` with `balance` as a barrier, and waits until its event is in the feed
/// read through `app`: the recorder records in the order of the changes, so every event
/// of a change made before it is there too. The whole feed then.
async fn whole_feed(app: &TestApp, barrier: &str) -> Vec<Value> {
    open(app, barrier, 0).await;
    let wanted = format!("account.opened:{barrier}");
    eventually(
        &format!("{wanted} is recorded"),
        RECORDED_WITHIN,
        POLL_EVERY,
        async || {
            let events = feed(app).await;
            ids(&events).contains(&wanted).then_some(events)
        },
    )
    .await
}

/// Asserts what every event is: one of the four types, its id `<type>:<data.id>`, `at`
/// an RFC 3339 time, and a transfer's data in the state its type reports.
fn assert_well_formed(event: &Value) {
    let kind = event["type"].as_str().unwrap_or("");
    assert!(TYPES.contains(&kind), "type: {event}");
    let subject = event["data"]["id"].as_str().unwrap_or("");
    assert_eq!(event_id(event), format!("{kind}:{subject}"), "{event}");
    assert!(
        event["at"]
            .as_str()
            .is_some_and(|at| at.parse::<chrono::DateTime<chrono::Utc>>().is_ok()),
        "at is an RFC 3339 time: {event}"
    );
    if let Some(state) = kind.strip_prefix("transfer.") {
        assert_eq!(event["data"]["state"], state, "{event}");
    }
}

/// Opens an account, asserted 201; the account as answered.
async fn open(app: &TestApp, id: &str, balance: i64) -> Value {
    let response = app
        .post_json("/accounts", json!({ "id": id, "balance": balance }))
        .await;
    let status = response.status();
    let body: Value = response.json().await.expect("a JSON body");
    assert_eq!(status, 201, "opening {id}: {body}");
    body
}

fn id_of(transfer: &Value) -> String {
    transfer["id"]
        .as_str()
        .unwrap_or_else(|| panic!("a transfer has an id: {transfer}"))
        .to_owned()
}

/// A transfer asserted done; the transfer as answered.
async fn done(app: &TestApp, source: &str, destination: &str, amount: i64) -> Value {
    let (status, body) = app.transfer(source, destination, amount).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["state"], "done", "{body}");
    body
}

/// A transfer asserted refused for insufficient funds; its id.
async fn refused(app: &TestApp, source: &str, destination: &str, amount: i64) -> String {
    let (status, body) = app.transfer(source, destination, amount).await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["code"], "insufficient_funds", "{body}");
    body["transferId"]
        .as_str()
        .expect("a transferId")
        .to_owned()
}

/// A hold for `expires_ms`, asserted held; the hold as answered.
async fn hold(
    app: &TestApp,
    source: &str,
    destination: &str,
    amount: i64,
    expires_ms: u64,
) -> Value {
    let response = app
        .post_json(
            "/transfers",
            json!({
                "source": source, "destination": destination, "amount": amount,
                "hold": { "expiresInMs": expires_ms },
            }),
        )
        .await;
    let status = response.status();
    let body: Value = response.json().await.expect("a JSON body");
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["state"], "held", "{body}");
    body
}

/// `POST {path}` (with `body` as JSON when given), asserted 200; the transfer answered.
async fn post_ok(app: &TestApp, path: &str, body: Option<Value>) -> Value {
    let request = app.http.post(app.url(path));
    let request = match body {
        Some(body) => request.json(&body),
        None => request,
    };
    let response = request.send().await.expect("request");
    let status = response.status();
    let text = response.text().await.expect("a body");
    assert_eq!(status, 200, "POST {path}: {text}");
    serde_json::from_str(&text).expect("a JSON body")
}

async fn get_transfer(app: &TestApp, id: &str) -> Value {
    let (status, body) = get_json(app, &format!("/transfers/{id}")).await;
    assert_eq!(status, 200, "{body}");
    body
}

/// Follows `next` from a read without a cursor, `limit` events a page (and `filter`,
/// `&type=...` or empty), until an empty page. Each page's ids and the `next` it gave,
/// the last page being the empty one.
async fn walk(app: &TestApp, limit: usize, filter: &str) -> Vec<(Vec<String>, String)> {
    let mut pages = Vec::new();
    let mut query = format!("?limit={limit}{filter}");
    loop {
        let (items, next) = events_page(app, &query).await;
        assert!(
            items.len() <= limit,
            "GET /events{query} gave {} events",
            items.len()
        );
        let empty = items.is_empty();
        pages.push((ids(&items), next.clone()));
        assert!(pages.len() <= 1_000, "following next never ends");
        if empty {
            return pages;
        }
        query = format!("?limit={limit}{filter}&after={next}");
    }
}

/// Opens alice (1000), bob and carol, then makes six transfers, two refusals and two
/// captured holds: 15 events.
async fn fifteen_events(app: &TestApp) {
    open(app, "alice", 1_000).await;
    open(app, "bob", 0).await;
    open(app, "carol", 0).await;
    for amount in 1..=6 {
        done(app, "alice", "bob", amount).await;
    }
    refused(app, "carol", "bob", 1).await;
    refused(app, "bob", "carol", 1_000).await;
    for amount in [10, 20] {
        let held = id_of(&hold(app, "alice", "carol", amount, 60_000).await);
        post_ok(app, &format!("/transfers/{held}/capture"), None).await;
    }
}

/// What [`one_of_each`] made: each event expected, with the data it must carry (those
/// known when made; the others are read once the feed is whole), and the subjects.
struct OneOfEach {
    expected: HashMap<String, Value>,
    plain: String,
    insufficient: String,
    captured: String,
    voided: String,
    expired: String,
    reversed: String,
    reversal: String,
}

/// Makes, through `app`, one of each way an event comes about: accounts opened, a plain
/// transfer, a refusal for want of funds, a hold captured for less than it held, a hold
/// voided, a hold expired (by the sweeper), a done transfer reversed.
async fn one_of_each(app: &TestApp) -> OneOfEach {
    let mut expected: HashMap<String, Value> = HashMap::new();
    for (id, balance) in [("alice", 1_000), ("bob", 0), ("carol", 50)] {
        let account = open(app, id, balance).await;
        expected.insert(format!("account.opened:{id}"), account);
    }
    let plain = id_of(&done(app, "alice", "bob", 100).await);
    let insufficient = refused(app, "carol", "bob", 500).await;
    let captured_hold = hold(app, "alice", "bob", 300, 60_000).await;
    let captured = id_of(&captured_hold);
    let capture = json!({ "amount": 120 });
    let answer = post_ok(
        app,
        &format!("/transfers/{captured}/capture"),
        Some(capture),
    )
    .await;
    assert_eq!(
        (&answer["state"], &answer["amount"]),
        (&json!("done"), &json!(120))
    );
    let voided_hold = hold(app, "alice", "bob", 200, 60_000).await;
    let voided = id_of(&voided_hold);
    let answer = post_ok(app, &format!("/transfers/{voided}/void"), None).await;
    assert_eq!(answer["reason"], "voided", "{answer}");
    let expiring_hold = hold(app, "alice", "bob", 30, 1_000).await;
    let expired = id_of(&expiring_hold);
    let original = done(app, "alice", "bob", 50).await;
    let reversed = id_of(&original);
    let answer = post_ok(app, &format!("/transfers/{reversed}/cancel"), None).await;
    let reversal = answer["reversedBy"]
        .as_str()
        .unwrap_or_else(|| panic!("a canceled done transfer is reversed: {answer}"))
        .to_owned();
    // A read shows a hold expired from `expiresAt` on; its event comes when the sweeper
    // writes it so.
    let stored = support::values::transfer_id(&expired);
    eventually(
        "the sweeper expires the hold",
        Duration::from_secs(10),
        POLL_EVERY,
        async || {
            let now = app
                .store
                .transfers()
                .transfer(stored)
                .await
                .unwrap()
                .expect("stored");
            (now.state == TransferState::Canceled).then_some(())
        },
    )
    .await;

    // A hold's held event is the hold as answered when made: held, the held amount.
    expected.insert(format!("transfer.held:{captured}"), captured_hold);
    expected.insert(format!("transfer.held:{voided}"), voided_hold);
    expected.insert(format!("transfer.held:{expired}"), expiring_hold);
    // The reversed transfer's done event is the transfer as answered when it was done,
    // before its reversal named itself on it.
    assert!(original.get("reversedBy").is_none(), "{original}");
    expected.insert(format!("transfer.done:{reversed}"), original);
    OneOfEach {
        expected,
        plain,
        insufficient,
        captured,
        voided,
        expired,
        reversed,
        reversal,
    }
}

/// Asserts that the feed holds exactly the events of what [`one_of_each`] made, each
/// once, each one's data the subject as `GET` answered it at that moment, in the order
/// they happened.
async fn assert_each_event_once_as_it_was_then(app: &TestApp, made: OneOfEach) {
    let OneOfEach {
        mut expected,
        plain,
        insufficient,
        captured,
        voided,
        expired,
        reversed,
        reversal,
    } = made;

    let events = whole_feed(app, "barrier").await;

    let barrier = get_json(app, "/accounts/barrier").await.1;
    expected.insert("account.opened:barrier".into(), barrier);
    for (kind, id) in [
        ("done", &plain),
        ("canceled", &insufficient),
        ("done", &captured),
        ("canceled", &voided),
        ("canceled", &expired),
        ("done", &reversal),
    ] {
        let now = get_transfer(app, id).await;
        expected.insert(format!("transfer.{kind}:{id}"), now);
    }
    assert_eq!(get_transfer(app, &reversed).await["reversedBy"], reversal);

    let found = ids(&events);
    assert_unique(&found);
    let mut wanted: Vec<&String> = expected.keys().collect();
    let mut got: Vec<&String> = found.iter().collect();
    wanted.sort();
    got.sort();
    assert_eq!(got, wanted, "the feed holds these events and no other");
    for event in &events {
        assert_well_formed(event);
        let id = event_id(event);
        assert_eq!(
            event["data"], expected[&id],
            "{id}: the data is the subject as it was then"
        );
    }
    let by_id: HashMap<String, &Value> = events.iter().map(|e| (event_id(e), e)).collect();
    let data = |id: String| by_id[&id]["data"].clone();
    let canceled = |id: &str| data(format!("transfer.canceled:{id}"))["reason"].clone();
    assert_eq!(canceled(&insufficient), "insufficient_funds");
    assert_eq!(canceled(&voided), "voided");
    assert_eq!(canceled(&expired), "expired");
    let held = data(format!("transfer.held:{captured}"));
    assert_eq!(
        (&held["amount"], &held["state"]),
        (&json!(300), &json!("held"))
    );
    assert!(held.get("reason").is_none(), "{held}");
    assert_eq!(data(format!("transfer.done:{captured}"))["amount"], 120);
    assert!(
        data(format!("transfer.done:{reversed}"))
            .get("reversedBy")
            .is_none()
    );
    assert_eq!(
        data(format!("transfer.done:{reversal}"))["reverses"],
        reversed
    );
    // What happened later is later in the feed.
    let place = |id: String| found.iter().position(|f| *f == id).unwrap();
    for (before, after) in [
        (
            "account.opened:alice".to_owned(),
            format!("transfer.done:{plain}"),
        ),
        (
            format!("transfer.held:{captured}"),
            format!("transfer.done:{captured}"),
        ),
        (
            format!("transfer.held:{voided}"),
            format!("transfer.canceled:{voided}"),
        ),
        (
            format!("transfer.held:{expired}"),
            format!("transfer.canceled:{expired}"),
        ),
        (
            format!("transfer.done:{reversed}"),
            format!("transfer.done:{reversal}"),
        ),
    ] {
        assert!(
            place(before.clone()) < place(after.clone()),
            "{before} before {after}: {found:#?}"
        );
    }
}

#[tokio::test]
async fn every_opened_account_and_ended_transfer_is_one_event_carrying_it_as_it_was_then() {
    let app = spawn_app().await;
    let made = one_of_each(&app).await;
    assert_each_event_once_as_it_was_then(&app, made).await;
}

/// A transfer of the native strategy is inserted already `done` or `canceled`, in one
/// transaction: a change of another kind, the same events.
#[tokio::test]
async fn native_transfers_are_the_same_events() {
    let app = spawn_app_with(|s| s.strategy = Strategy::Native).await;
    let made = one_of_each(&app).await;
    assert_each_event_once_as_it_was_then(&app, made).await;
}

/// A recorder that lags reads a change after later ones landed: the capture after the
/// hold, the reversal after the transfer it reverses, the void and the expiry after the
/// holds. Each event still carries its subject as it was at that moment. Here no one
/// records while the changes are made: the lease is held by an instance that records
/// nothing (as a paused one would), then given up, and the instance left takes over.
#[tokio::test]
async fn events_recorded_late_still_carry_each_subject_as_it_was_then() {
    let first = spawn_app().await;
    let database = first.database.clone();
    let lease = first
        .store
        .database()
        .collection::<Document>("eventRecorder");
    drop(first);
    pause_recording(&lease).await;
    let app = spawn_app_with(|s| s.database = database).await;

    let made = one_of_each(&app).await;
    assert!(
        feed(&app).await.is_empty(),
        "no one records while the lease is held"
    );
    resume_recording(&lease).await;

    assert_each_event_once_as_it_was_then(&app, made).await;
}

#[tokio::test]
async fn a_reader_following_next_reads_each_event_once_and_every_cursor_resumes_right_after_it() {
    let app = spawn_app().await;
    let (nothing_yet, before_any) = events_page(&app, "").await;
    assert!(
        nothing_yet.is_empty(),
        "a new database has no events: {nothing_yet:?}"
    );
    fifteen_events(&app).await;
    let full = ids(&whole_feed(&app, "barrier").await);
    assert_eq!(full.len(), 16, "{full:#?}");
    assert_unique(&full);

    let (all, _) = events_page(&app, &format!("?after={before_any}&limit=1000")).await;
    assert_eq!(
        ids(&all),
        full,
        "the empty feed's next gives every event made since"
    );
    let mut ends = Vec::new();
    for limit in [1, 4] {
        let pages = walk(&app, limit, "").await;
        let read: Vec<String> = pages.iter().flat_map(|(page, _)| page.clone()).collect();
        assert_eq!(
            read, full,
            "limit={limit}: following next reads the feed once"
        );
        let mut seen = 0;
        for (page, next) in &pages {
            seen += page.len();
            let (rest, _) = events_page(&app, &format!("?after={next}&limit=1000")).await;
            assert_eq!(
                ids(&rest),
                full[seen..],
                "limit={limit}: the cursor after {seen} events resumes right after them"
            );
        }
        ends.push(pages.last().expect("a last, empty page").1.clone());
    }

    // The empty page's next still works: what comes later comes after it, only once.
    open(&app, "dave", 0).await;
    let later = format!(
        "transfer.done:{}",
        id_of(&done(&app, "alice", "dave", 7).await)
    );
    let new = vec!["account.opened:dave".to_owned(), later];
    for end in ends {
        let read = eventually(
            "the new events are recorded",
            RECORDED_WITHIN,
            POLL_EVERY,
            async || {
                let (items, _) = events_page(&app, &format!("?after={end}&limit=1000")).await;
                (items.len() >= new.len()).then(|| ids(&items))
            },
        )
        .await;
        assert_eq!(
            read, new,
            "after the end of the feed: the new events, nothing old"
        );
    }
}

/// The feed is read in windows of cluster time (SecantusDB reads every match of a find
/// before its limit), so a read must cross any gap and any crowd: events decades apart,
/// hundreds in one second, none between. Events put straight into `events`, at crafted
/// places of a real one's copy, then real ones after them: every walk, at any page size
/// and with a type filter, reads the stored order exactly once.
#[tokio::test]
async fn the_feed_reads_events_far_apart_and_crowded_in_time_each_once_in_order() {
    let app = spawn_app().await;
    open(&app, "alice", 1_000).await;
    whole_feed(&app, "bob").await;
    let events = app.store.database().collection::<Document>("events");
    let model = events
        .find_one(doc! { "_id": "account.opened:alice" })
        .await
        .unwrap()
        .expect("alice's event is stored");
    let now = model.get_str("key").unwrap()[..10].parse::<u32>().unwrap();
    // (seconds, how many at increments 1, 2, ...): the dawn of time, a crowd, a day's
    // steps back, the second before now.
    let mut places: Vec<(u32, u32)> = vec![(1, 1), (10, 2), (1_000_000, 300), (1_000_001, 1)];
    places.extend((1..=5).map(|days| (now - days * 86_400, 3)));
    places.push((now - 2, 250));
    let mut crafted = Vec::new();
    for (seconds, count) in places {
        for increment in 1..=count {
            let id = format!("account.opened:w{seconds}-{increment}");
            let mut event = model.clone();
            event.insert("_id", &id);
            event.insert("key", format!("{seconds:010}{increment:010}{id}"));
            crafted.push(event);
        }
    }
    let made = crafted.len();
    events.insert_many(crafted).await.unwrap();
    let paid = format!(
        "transfer.done:{}",
        id_of(&done(&app, "alice", "bob", 5).await)
    );
    whole_feed(&app, "carol").await;

    let stored: Vec<Document> = events
        .find(doc! {})
        .sort(doc! { "key": 1 })
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let order: Vec<String> = stored
        .iter()
        .map(|e| e.get_str("_id").unwrap().to_owned())
        .collect();
    // Those crafted, alice, bob, the transfer and carol.
    assert_eq!(order.len(), made + 4, "{order:#?}");
    for limit in [7, 100, 1000] {
        let read: Vec<String> = walk(&app, limit, "")
            .await
            .into_iter()
            .flat_map(|(page, _)| page)
            .collect();
        assert_eq!(read, order, "limit={limit}");
    }
    let opened: Vec<String> = order.iter().filter(|id| **id != paid).cloned().collect();
    for (filter, wanted) in [("account.opened", opened), ("transfer.done", vec![paid])] {
        for limit in [3, 1000] {
            let read: Vec<String> = walk(&app, limit, &format!("&type={filter}"))
                .await
                .into_iter()
                .flat_map(|(page, _)| page)
                .collect();
            assert_eq!(read, wanted, "type={filter}, limit={limit}");
        }
    }
}

/// A read never passes a place where an event may still appear. An event that another
/// one follows in the feed but that becomes visible only after it (in the real feed: a
/// change recorded while a reader is between two of its windows) is still read once, in
/// its place: a read goes only as far as the recorder has seen every event visible.
/// Here the later event is put into `events` first, and the earlier one after a read.
#[tokio::test]
async fn an_event_that_becomes_visible_after_a_later_one_is_still_read_in_its_place() {
    let app = spawn_app().await;
    open(&app, "alice", 0).await;
    let feed_now = whole_feed(&app, "bob").await;
    let (_, after_bob) = events_page(&app, "?limit=1000").await;
    assert_eq!(
        ids(&feed_now),
        ["account.opened:alice", "account.opened:bob"]
    );
    let events = app.store.database().collection::<Document>("events");
    let model = events
        .find_one(doc! { "_id": "account.opened:bob" })
        .await
        .unwrap()
        .expect("bob's event is stored");
    let bob_key = model.get_str("key").unwrap().to_owned();
    // Just after bob's change, before any change made from now on.
    let (seconds, increment): (u32, u32) = (
        bob_key[..10].parse().unwrap(),
        bob_key[10..20].parse().unwrap(),
    );
    let place = |step: u32, name: &str| {
        let id = format!("account.opened:{name}");
        let mut event = model.clone();
        event.insert("_id", &id);
        event.insert("key", format!("{seconds:010}{:010}{id}", increment + step));
        event
    };
    events.insert_one(place(2, "later")).await.unwrap();
    let (early, cursor) = events_page(&app, &format!("?after={after_bob}&limit=1000")).await;
    events.insert_one(place(1, "earlier")).await.unwrap();
    // Carol's event comes after both: its tick is the database's second, or past the bound.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    open(&app, "carol", 0).await;
    let mut read = ids(&early);
    let (rest, _) = read_after(&app, &cursor, 3 - read.len()).await;
    read.extend(rest);
    assert_eq!(
        read,
        [
            "account.opened:earlier",
            "account.opened:later",
            "account.opened:carol"
        ],
        "each once, in the feed's order"
    );
}

/// A recorder that wrote its round (the round's first place and its events) and inserted
/// its events, and lost its lease before it raised the bound: none of them is read
/// before the bound passes them, and the next holder finishes that round first, at the
/// same places, so that a copy the old holder inserts however late is refused and
/// nothing appears below the bound.
#[tokio::test]
async fn a_round_its_recorder_left_unfinished_is_finished_by_the_next_at_the_same_places() {
    let first = spawn_app().await;
    let database = first.database.clone();
    open(&first, "alice", 0).await;
    whole_feed(&first, "bob").await;
    let db = first.store.database().clone();
    let (recorder, events) = (
        db.collection::<Document>("eventRecorder"),
        db.collection::<Document>("events"),
    );
    drop(first);
    pause_recording(&recorder).await;
    let app = spawn_app_with(|s| s.database = database).await;
    open(&app, "carol", 0).await;

    // The paused holder's round: carol's event one second past the bound, inserted.
    let bound = recorded_through(&recorder).await;
    let seconds: u32 = bound[..10].parse().unwrap();
    let round_first = format!("{:010}{:010}", seconds + 1, 0);
    let carol = "account.opened:carol";
    recorder
        .update_one(
            doc! { "_id": "recorder" },
            doc! { "$set": { "round": { "first": &round_first, "ids": [carol] } } },
        )
        .await
        .unwrap();
    let mut copy = events
        .find_one(doc! { "_id": "account.opened:alice" })
        .await
        .unwrap()
        .unwrap();
    copy.insert("_id", carol);
    copy.insert("key", format!("{round_first}{carol}"));
    copy.get_document_mut("account")
        .unwrap()
        .insert("_id", "carol");
    events.insert_one(copy.clone()).await.unwrap();
    assert_eq!(
        ids(&feed(&app).await),
        ["account.opened:alice", "account.opened:bob"],
        "not read before the bound passes it"
    );

    resume_recording(&recorder).await;
    let read = whole_feed(&app, "dave").await;
    assert_eq!(
        ids(&read),
        [
            "account.opened:alice",
            "account.opened:bob",
            carol,
            "account.opened:dave"
        ],
        "each once, in its place"
    );
    let stored = events
        .find_one(doc! { "_id": carol })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        stored.get_str("key").unwrap(),
        format!("{round_first}{carol}")
    );
    let state = recorder
        .find_one(doc! { "_id": "recorder" })
        .await
        .unwrap()
        .unwrap();
    assert!(
        !state.contains_key("round"),
        "the round is finished: {state:?}"
    );
    let marked = db
        .collection::<Document>("accounts")
        .count_documents(doc! { "eventsDue.type": { "$exists": true } })
        .await
        .unwrap();
    assert_eq!(marked, 0, "every recorded event's mark is taken off");
    let late = events.insert_one(copy).await;
    assert!(late.is_err(), "a late copy of the old holder is refused");
}

/// A round left at or below the bound can only be a late copy of a round write whose
/// answer was lost, landing after a later round finished: the next holder drops it and
/// records its events past the bound, never below a place a reader has passed.
#[tokio::test]
async fn a_round_left_below_the_bound_is_a_late_copy_and_its_events_are_recorded_past_it() {
    let first = spawn_app().await;
    let database = first.database.clone();
    whole_feed(&first, "alice").await;
    let db = first.store.database().clone();
    let recorder = db.collection::<Document>("eventRecorder");
    drop(first);
    pause_recording(&recorder).await;
    let app = spawn_app_with(|s| s.database = database).await;
    let (_, after_alice) = events_page(&app, "?limit=1000").await;
    open(&app, "carol", 0).await;
    let bound = recorded_through(&recorder).await;
    let below: u32 = bound[..10].parse::<u32>().unwrap() - 1;
    let carol = "account.opened:carol";
    recorder
        .update_one(
            doc! { "_id": "recorder" },
            doc! { "$set": { "round": { "first": format!("{below:010}{:010}", 0), "ids": [carol] } },
                   "$unset": { "leaseUntil": "" } },
        )
        .await
        .unwrap();

    let (read, _) = read_after(&app, &after_alice, 1).await;
    assert_eq!(read, [carol], "read after the place the reader had passed");
    let stored = db
        .collection::<Document>("events")
        .find_one(doc! { "_id": carol })
        .await
        .unwrap()
        .unwrap();
    assert!(
        stored.get_str("key").unwrap() > bound.as_str(),
        "{stored:?}"
    );
}

/// Marks no event can be made of (written by something else: a type this version does
/// not know, an account's event on a transfer), more than a round takes and older than
/// every real one, are taken off as they are found: the recorder goes on (before, it
/// found the same 500 every round and recorded nothing more).
#[tokio::test]
async fn marks_that_name_no_event_are_taken_off_and_hold_up_nothing() {
    let app = spawn_app().await;
    let long_ago = mongodb::bson::DateTime::from_millis(1_000);
    let strays: Vec<Document> = (0..600)
        .map(|n| {
            let kind = if n % 2 == 0 {
                "transfer.exploded"
            } else {
                "account.opened"
            };
            doc! { "state": "done", "eventsDue": [{ "type": kind, "at": long_ago }] }
        })
        .collect();
    let transactions = app.store.database().collection::<Document>("transactions");
    transactions
        .insert_many(strays)
        .bypass_document_validation(true)
        .await
        .unwrap();
    let read = whole_feed(&app, "alice").await;
    assert_eq!(ids(&read), ["account.opened:alice"]);
    every_due_event_recorded(&app).await;
}

/// A feed an older version recorded, without `recordedThrough`, is read up to its newest
/// event, as that version read it; the first recorder of this version bounds it there
/// before it records anything, and every event stays readable, once, in its place.
#[tokio::test]
async fn a_feed_recorded_by_an_older_version_is_read_whole_and_then_bounded() {
    let older = spawn_app().await;
    let database = older.database.clone();
    open(&older, "alice", 0).await;
    whole_feed(&older, "bob").await;
    // As an older version left it (its recorder is quiet: it writes the bound only with
    // new events).
    let recorder = older
        .store
        .database()
        .collection::<Document>("eventRecorder");
    recorder
        .update_one(
            doc! { "_id": "recorder" },
            doc! { "$unset": { "recordedThrough": "", "streamDone": "" } },
        )
        .await
        .unwrap();
    let all = ["account.opened:alice", "account.opened:bob"];
    assert_eq!(ids(&feed(&older).await), all, "read up to the newest");
    let bob_key = older
        .store
        .database()
        .collection::<Document>("events")
        .find_one(doc! { "_id": all[1] })
        .await
        .unwrap()
        .expect("bob's event")
        .get_str("key")
        .unwrap()
        .to_owned();
    drop(older);

    let newer = spawn_app_with(|s| s.database = database.clone()).await;
    eventually(
        "the new recorder bounds the feed at its newest event before recording",
        RECORDED_WITHIN,
        POLL_EVERY,
        async || {
            let lease = recorder_lease(&newer).await;
            let bound = lease.get_str("recordedThrough").ok() == Some(bob_key.as_str());
            (owner(&lease) == newer.instance_id && bound).then_some(())
        },
    )
    .await;
    assert_eq!(ids(&feed(&newer).await), all);
    let read = whole_feed(&newer, "carol").await;
    assert_eq!(ids(&read), [all[0], all[1], "account.opened:carol"]);
}

#[tokio::test]
async fn a_type_filter_gives_only_those_types_in_the_feeds_order() {
    let app = spawn_app().await;
    fifteen_events(&app).await;
    let voided = id_of(&hold(&app, "alice", "bob", 5, 60_000).await);
    post_ok(&app, &format!("/transfers/{voided}/void"), None).await;
    let events = whole_feed(&app, "barrier").await;
    let present: HashSet<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(present.len(), 4, "every type is in the feed: {events:#?}");

    for filter in [
        "transfer.done",
        "transfer.held,transfer.canceled",
        "account.opened",
        "transfer.canceled,transfer.done,transfer.done",
        "transfer.held,transfer.canceled,account.opened,transfer.done",
    ] {
        let types: Vec<&str> = filter.split(',').collect();
        let wanted: Vec<String> = events
            .iter()
            .filter(|e| types.contains(&e["type"].as_str().unwrap_or("")))
            .map(event_id)
            .collect();
        assert!(!wanted.is_empty());
        let (items, _) = events_page(&app, &format!("?limit=1000&type={filter}")).await;
        assert_eq!(ids(&items), wanted, "type={filter}");
        let pages = walk(&app, 2, &format!("&type={filter}")).await;
        let read: Vec<String> = pages.into_iter().flat_map(|(page, _)| page).collect();
        assert_eq!(read, wanted, "type={filter}, following next two at a time");
    }
}

#[tokio::test]
async fn a_parameter_the_feed_cannot_read_is_refused_as_invalid() {
    let app = spawn_app().await;
    open(&app, "alice", 10).await;
    let random_json = URL_SAFE_NO_PAD.encode(r#"{"hello":["world",1,2.5],"p":null}"#);
    let wrong_version = URL_SAFE_NO_PAD.encode(r#"{"v":2,"p":{}}"#);
    let no_positions = URL_SAFE_NO_PAD.encode(r#"{"v":1}"#);
    let cases = [
        ("after=garbage".to_owned(), "after"),
        (format!("after={random_json}"), "after"),
        (format!("after={wrong_version}"), "after"),
        (format!("after={no_positions}"), "after"),
        ("after=".to_owned(), "after"),
        ("limit=0".to_owned(), "limit"),
        ("limit=1001".to_owned(), "limit"),
        ("limit=abc".to_owned(), "limit"),
        ("limit=-1".to_owned(), "limit"),
        ("type=transfer.pending".to_owned(), "type"),
        ("type=transfer.done,bogus".to_owned(), "type"),
    ];
    for (query, field) in cases {
        let response = app.get(&format!("/events?{query}")).await;
        let problem = assert_problem(response, 400, "invalid_parameter").await;
        assert_eq!(problem["field"], field, "{query}: {problem}");
    }
    // The ends of the range are fine.
    for query in ["limit=1", "limit=1000", "type=account.opened"] {
        events_page(&app, &format!("?{query}")).await;
    }
}

/// A cursor as the service encodes it, from its JSON.
fn cursor_of(json: &str) -> String {
    URL_SAFE_NO_PAD.encode(json)
}

/// The longest cursor a client of a service with the one deployment `default` can hold:
/// `default` at the last position there can be, with the longest event id, and four
/// deployments being added (the most a cursor may name beyond those served), each at its
/// start, with the longest names.
fn largest_cursor() -> String {
    let id = format!("account.opened:{}", "a".repeat(64));
    let added: Vec<String> = (0..4).map(|i| format!(r#""{i:z>32}":[0,0,""]"#)).collect();
    cursor_of(&format!(
        r#"{{"v":1,"p":{{"default":[4294967295,4294967295,"{id}"],{}}}}}"#,
        added.join(",")
    ))
}

#[tokio::test]
async fn a_forged_cursor_is_refused_400_saying_why_and_a_real_one_still_reads() {
    let app = spawn_app().await;
    open(&app, "alice", 10).await;
    let next = eventually("alice's event", RECORDED_WITHIN, POLL_EVERY, async || {
        let (items, next) = events_page(&app, "").await;
        (!items.is_empty()).then_some(next)
    })
    .await;

    // What the measured attack sent: deployments this service does not have (each kept in
    // every cursor of the page before; 2,998 then, 500 here, as a URL's 64 KiB allow),
    // and an id of tens of KB.
    let many: Vec<String> = (0..500)
        .map(|i| format!(r#""d{i}":[1,0,"account.opened:alice"]"#))
        .collect();
    let many = cursor_of(&format!(r#"{{"v":1,"p":{{{}}}}}"#, many.join(",")));
    let huge_id = cursor_of(&format!(
        r#"{{"v":1,"p":{{"default":[1,0,"account.opened:{}"]}}}}"#,
        "a".repeat(40_000)
    ));
    let txn = "transfer.done:6b0619d67d0e8af2ac0b1adf";
    let cases = [
        (many, "longer than any cursor"),
        (huge_id, "longer than any cursor"),
        (
            cursor_of(&format!(r#"{{"v":1,"p":{{"us":[1,0,"{txn}"]}}}}"#)),
            "names deployment us, which this service does not serve",
        ),
        (
            cursor_of(r#"{"v":1,"p":{"default":[1,0,""],"default":[2,0,""]}}"#),
            "names deployment default twice",
        ),
        (
            cursor_of(&format!(
                r#"{{"v":1,"p":{{"default":[1,0,"account.opened:{}"]}}}}"#,
                "a".repeat(65)
            )),
            "no event's",
        ),
        (
            cursor_of(r#"{"v":1,"p":{"default":[1,0,"hello"]}}"#),
            "no event's",
        ),
        (
            cursor_of(
                r#"{"v":1,"p":{"default":[1,0,""],"a":[0,0,""],"b":[0,0,""],"c":[0,0,""],"d":[0,0,""],"e":[0,0,""]}}"#,
            ),
            "names more deployments than this service serves",
        ),
    ];
    for (cursor, why) in cases {
        let response = app.get(&format!("/events?after={cursor}")).await;
        let problem = assert_problem(response, 400, "invalid_parameter").await;
        assert_eq!(problem["field"], "after", "{problem}");
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(detail.contains(why), "wanted {why:?}: {problem}");
        assert!(
            detail.len() < 300,
            "the detail does not echo the cursor: {problem}"
        );
    }

    // At the edge: the largest cursor a client can hold reads (nothing is after it);
    // one character more is refused for its length.
    let largest = largest_cursor();
    let (items, after_largest) = events_page(&app, &format!("?after={largest}")).await;
    assert!(items.is_empty(), "{items:?}");
    assert!(
        after_largest.len() < largest.len(),
        "the deployments being added are left out of the next cursor"
    );
    let response = app.get(&format!("/events?after={largest}A")).await;
    let problem = assert_problem(response, 400, "invalid_parameter").await;
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|d| d.contains("longer than any cursor")),
        "{problem}"
    );

    // A real cursor still reads, with a deployment being added (at its start) in it too.
    open(&app, "bob", 0).await;
    let (read, _) = read_after(&app, &next, 1).await;
    assert_eq!(read, ["account.opened:bob"]);
    let json = String::from_utf8(URL_SAFE_NO_PAD.decode(&next).unwrap()).unwrap();
    let with_added = cursor_of(&json.replacen(r#""p":{"#, r#""p":{"new":[0,0,""],"#, 1));
    let (read, _) = read_after(&app, &with_added, 1).await;
    assert_eq!(read, ["account.opened:bob"]);
}

/// Reads from `cursor` until `count` events are there (within the recorder's delay);
/// their ids and the page's `next`.
async fn read_after(app: &TestApp, cursor: &str, count: usize) -> (Vec<String>, String) {
    let query = format!("?after={cursor}&limit=1000");
    eventually(
        &format!("{count} events after the cursor"),
        RECORDED_WITHIN,
        POLL_EVERY,
        async || {
            let (items, next) = events_page(app, &query).await;
            (items.len() >= count).then(|| (ids(&items), next))
        },
    )
    .await
}

#[tokio::test]
async fn a_cursor_whose_next_events_were_removed_is_gone_and_a_read_without_one_starts_at_the_oldest_kept()
 {
    let app = spawn_app_with(|s| s.event_retention = Duration::from_secs(1)).await;
    let (nothing_yet, before_any) = events_page(&app, "").await;
    assert!(nothing_yet.is_empty(), "{nothing_yet:?}");
    open(&app, "alice", 1_000).await;
    open(&app, "bob", 0).await;
    let mut made = vec![
        "account.opened:alice".to_owned(),
        "account.opened:bob".to_owned(),
    ];
    for amount in [10, 20] {
        made.push(format!(
            "transfer.done:{}",
            id_of(&done(&app, "alice", "bob", amount).await)
        ));
    }
    // The cursor right after the first event, and the one after the last, taken as soon
    // as they are recorded: while the events after a cursor are kept, it reads them.
    let (first, after_first) = eventually(
        "the first event is recorded",
        RECORDED_WITHIN,
        POLL_EVERY,
        async || {
            let (items, next) = events_page(&app, "?limit=1").await;
            items.first().map(|e| (event_id(e), next))
        },
    )
    .await;
    assert_eq!(first, made[0]);
    let (rest, after_last) = read_after(&app, &after_first, made.len() - 1).await;
    assert_eq!(rest, made[1..]);

    let removed = Duration::from_secs(15);
    eventually(
        "the retention removes the events made",
        removed,
        Duration::from_millis(50),
        async || {
            let kept = ids(&feed(&app).await);
            (!kept.iter().any(|id| made.contains(id))).then_some(())
        },
    )
    .await;

    for (cursor, which) in [
        (&after_first, "after the first event"),
        (&before_any, "of the empty feed"),
    ] {
        let response = app.get(&format!("/events?after={cursor}")).await;
        let problem = assert_problem(response, 410, "cursor_expired").await;
        assert!(
            problem.get("field").is_none(),
            "the cursor {which}: {problem}"
        );
    }
    let (front, fresh) = events_page(&app, "?limit=1000").await;
    assert!(
        front.is_empty(),
        "a read without a cursor starts after what was removed: {front:#?}"
    );
    // Nothing after the last event was removed: that cursor is still good.
    let (still, _) = events_page(&app, &format!("?after={after_last}")).await;
    assert!(still.is_empty(), "{still:#?}");

    open(&app, "carol", 0).await;
    let later = format!(
        "transfer.done:{}",
        id_of(&done(&app, "alice", "carol", 5).await)
    );
    let new = vec!["account.opened:carol".to_owned(), later];
    for (cursor, which) in [
        (&fresh, "a fresh next"),
        (&after_last, "the cursor after the last"),
    ] {
        let (read, _) = read_after(&app, cursor, new.len()).await;
        assert_eq!(read, new, "{which} gives the new events, nothing removed");
    }
    let response = app.get(&format!("/events?after={after_first}")).await;
    assert_problem(response, 410, "cursor_expired").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_sharing_a_database_record_each_event_exactly_once() {
    const ACCOUNTS: [&str; 6] = ["alice", "bob", "carol", "dave", "erin", "frank"];
    let first = spawn_app().await;
    let database = first.database.clone();
    let second = spawn_app_with(|s| s.database = database.clone()).await;
    let third = spawn_app_with(|s| s.database = database.clone()).await;
    let apps = [&first, &second, &third];
    let instances: HashSet<&str> = apps.iter().map(|a| a.instance_id.as_str()).collect();
    assert_eq!(instances.len(), 3, "each instance has its own id");
    for (i, account) in ACCOUNTS.iter().enumerate() {
        open(apps[i % 3], account, 300).await;
    }

    let mut rng = StdRng::seed_from_u64(0xfeed);
    let requests: Vec<_> = (0..60)
        .map(|i| {
            let source = rng.random_range(0..ACCOUNTS.len());
            let destination = (source + rng.random_range(1..ACCOUNTS.len())) % ACCOUNTS.len();
            let body = json!({
                "source": ACCOUNTS[source],
                "destination": ACCOUNTS[destination],
                "amount": rng.random_range(1..=250),
            });
            let app = apps[i % 3];
            let (http, url) = (app.http.clone(), app.url("/transfers"));
            tokio::spawn(async move {
                let response = http.post(url).json(&body).send().await.expect("request");
                let status = response.status().as_u16();
                (status, response.json::<Value>().await.expect("a JSON body"))
            })
        })
        .collect();
    let mut answered: HashMap<String, &str> = HashMap::new();
    for answer in futures::future::join_all(requests).await {
        match answer.expect("task") {
            (201, body) if body["state"] == "done" => answered.insert(id_of(&body), "done"),
            (422, body) if body["code"] == "insufficient_funds" => {
                answered.insert(body["transferId"].as_str().unwrap().to_owned(), "canceled")
            }
            (status, body) => panic!("unexpected answer {status}: {body}"),
        };
    }
    let refusals = answered.values().filter(|s| **s == "canceled").count();
    assert!(
        (1..60).contains(&refusals),
        "the mix has both outcomes: {refusals} refused"
    );

    let events = whole_feed(&second, "barrier").await;

    // The transfer log, as the API lists it.
    let mut logged: HashMap<String, String> = HashMap::new();
    let mut path = "/transfers?limit=100".to_owned();
    loop {
        let (status, page) = get_json(&third, &path).await;
        assert_eq!(status, 200, "{page}");
        for transfer in page["items"].as_array().expect("items") {
            logged.insert(
                id_of(transfer),
                transfer["state"].as_str().unwrap().to_owned(),
            );
        }
        match page["next"].as_str() {
            Some(next) => path = format!("/transfers?limit=100&after={next}"),
            None => break,
        }
    }
    assert_eq!(logged.len(), 60, "every request is one transfer");
    let mut expected: Vec<String> = Vec::new();
    for (id, state) in &logged {
        assert_eq!(answered.get(id).copied(), Some(state.as_str()), "{id}");
        expected.push(format!("transfer.{state}:{id}"));
    }
    for account in ACCOUNTS.iter().chain(&["barrier"]) {
        expected.push(format!("account.opened:{account}"));
    }
    let found = ids(&events);
    assert_unique(&found);
    let mut sorted = found.clone();
    sorted.sort();
    expected.sort();
    assert_eq!(
        sorted, expected,
        "one event for each transfer and account, no other"
    );
    for event in &events {
        assert_well_formed(event);
        if event["type"] != "account.opened" {
            let id = event["data"]["id"].as_str().unwrap();
            assert_eq!(
                event["data"],
                get_transfer(&first, id).await,
                "{}",
                event_id(event)
            );
        }
    }

    // Every instance serves the one feed, and a cursor from one resumes on another.
    for app in apps {
        assert_eq!(ids(&feed(app).await), found, "{}", app.instance_id);
    }
    let mut read = Vec::new();
    let mut query = "?limit=7".to_owned();
    for turn in 0.. {
        assert!(turn < 100, "following next never ends");
        let (items, next) = events_page(apps[turn % 3], &query).await;
        if items.is_empty() {
            break;
        }
        read.extend(ids(&items));
        query = format!("?limit=7&after={next}");
    }
    assert_eq!(read, found, "following next across the instances");
}

/// The recorder's lease (`eventRecorder`): `owner` and, while it holds it, `leaseUntil`.
async fn recorder_lease(app: &TestApp) -> Document {
    app.store
        .database()
        .collection::<Document>("eventRecorder")
        .find_one(doc! { "_id": "recorder" })
        .await
        .unwrap()
        .expect("the recorder's document")
}

/// Waits until the recorder's lease in `recorder` (`eventRecorder`) is held by no one:
/// a stopped instance gave it up.
/// Waits until no document of `app`'s database has an event due: every event made so
/// far has its place in the feed.
pub(crate) async fn every_due_event_recorded(app: &TestApp) {
    let db = app.store.database();
    eventually(
        "every event made so far is recorded",
        RECORDED_WITHIN,
        POLL_EVERY,
        async || {
            let due = doc! { "eventsDue.type": { "$exists": true } };
            let mut left = 0;
            for collection in ["accounts", "transactions"] {
                left += db
                    .collection::<Document>(collection)
                    .count_documents(due.clone())
                    .await
                    .unwrap();
            }
            (left == 0).then_some(())
        },
    )
    .await;
}

/// Waits until the recorder `lease` is given up (its holder stopped), then holds it for
/// an instance that records nothing, as a recorder paused mid-way would: until
/// [`resume_recording`], no instance records.
pub(crate) async fn pause_recording(lease: &mongodb::Collection<Document>) {
    pause_recording_with(lease, doc! {}).await;
}

/// [`pause_recording`], with the recorder's document changed by `change` too (an update
/// whose `$set` gains the paused holder's fields).
pub(crate) async fn pause_recording_with(lease: &mongodb::Collection<Document>, change: Document) {
    recorder_lease_given_up(lease, RECORDED_WITHIN).await;
    let mut paused = change;
    let mut set = paused.get_document("$set").cloned().unwrap_or_default();
    set.insert("owner", "paused-instance");
    set.insert(
        "leaseUntil",
        mongodb::bson::DateTime::from_chrono(chrono::Utc::now() + chrono::TimeDelta::minutes(10)),
    );
    paused.insert("$set", set);
    let taken = lease
        .update_one(
            doc! { "_id": "recorder", "leaseUntil": { "$exists": false } },
            paused,
        )
        .await
        .unwrap();
    assert_eq!(taken.matched_count, 1, "no one else took the lease");
}

/// The feed's `recordedThrough`, as its recorder's document holds it.
async fn recorded_through(recorder: &mongodb::Collection<Document>) -> String {
    let state = recorder
        .find_one(doc! { "_id": "recorder" })
        .await
        .unwrap()
        .expect("the recorder's document");
    state.get_str("recordedThrough").unwrap().to_owned()
}

/// Gives the lease [`pause_recording`] held up: the next instance to try takes it.
pub(crate) async fn resume_recording(lease: &mongodb::Collection<Document>) {
    lease
        .update_one(
            doc! { "_id": "recorder" },
            doc! { "$unset": { "leaseUntil": "" } },
        )
        .await
        .unwrap();
}

pub(crate) async fn recorder_lease_given_up(
    recorder: &mongodb::Collection<Document>,
    within: Duration,
) {
    eventually(
        "the stopped instance gives its lease up",
        within,
        POLL_EVERY,
        async || {
            let now = recorder.find_one(doc! { "_id": "recorder" }).await.unwrap();
            now.is_some_and(|l| !l.contains_key("leaseUntil"))
                .then_some(())
        },
    )
    .await;
}

fn owner(lease: &Document) -> &str {
    lease.get_str("owner").unwrap_or_default()
}

/// The instance that records stops (a shutdown gives its lease up): another takes the
/// lease over, and the changes made while no one recorded, which waited in the change
/// stream, are recorded once each, after the ones before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn when_the_recording_instance_stops_another_records_on_without_a_gap_or_a_repeat() {
    let first = spawn_app().await;
    let database = first.database.clone();
    let second = spawn_app_with(|s| s.database = database.clone()).await;
    open(&first, "alice", 1_000).await;
    open(&second, "bob", 1_000).await;
    let mut made = vec![
        "account.opened:alice".to_owned(),
        "account.opened:bob".to_owned(),
    ];
    for (i, app) in [&first, &second, &first, &second].into_iter().enumerate() {
        let id = id_of(&done(app, "alice", "bob", i as i64 + 1).await);
        made.push(format!("transfer.done:{id}"));
    }
    let before = ids(&whole_feed(&second, "barrier-1").await);
    made.push("account.opened:barrier-1".into());
    assert_eq!(before, made);

    let recording = owner(&recorder_lease(&first).await).to_owned();
    let (stopping, staying) = if recording == first.instance_id {
        (first, second)
    } else {
        assert_eq!(recording, second.instance_id, "one of the two records");
        (second, first)
    };
    drop(stopping);
    // Until the other takes it (it tries every 2 s), the lease given up is held by none.
    eventually(
        "the stopped instance gives its lease up",
        RECORDED_WITHIN,
        POLL_EVERY,
        async || {
            let lease = recorder_lease(&staying).await;
            let free = owner(&lease) == recording && !lease.contains_key("leaseUntil");
            (free || owner(&lease) == staying.instance_id).then_some(())
        },
    )
    .await;
    for amount in [5, 6, 7] {
        let id = id_of(&done(&staying, "bob", "alice", amount).await);
        made.push(format!("transfer.done:{id}"));
    }
    let after = ids(&whole_feed(&staying, "barrier-2").await);
    made.push("account.opened:barrier-2".into());

    assert_eq!(after, made, "every event once, in the order of the changes");
    let lease = recorder_lease(&staying).await;
    assert_eq!(owner(&lease), staying.instance_id, "{lease}");
    assert!(lease.contains_key("leaseUntil"), "{lease}");
}

/// A reader filtering by type that has read every match is past the events of other
/// types too: their removal after the retention does not expire its cursor, while the
/// removal of a match it had not read does.
#[tokio::test]
async fn a_filtered_reader_that_saw_every_match_keeps_its_cursor_when_other_events_go() {
    let app = spawn_app_with(|s| s.event_retention = Duration::from_secs(1)).await;
    open(&app, "alice", 1_000).await;
    open(&app, "bob", 0).await;
    let transfer = id_of(&done(&app, "alice", "bob", 10).await);
    whole_feed(&app, "barrier").await;
    // Every done transfer read: the cursor is past the later account openings too.
    let (read, caught_up) = events_page(&app, "?type=transfer.done&limit=1000").await;
    assert_eq!(ids(&read), [format!("transfer.done:{transfer}")]);
    // A reader that stopped before the match: its cursor is below an event it missed.
    let (_, before_match) = events_page(&app, "?type=account.opened&limit=1").await;
    eventually(
        "the retention removes every event made",
        Duration::from_secs(15),
        Duration::from_millis(50),
        async || feed(&app).await.is_empty().then_some(()),
    )
    .await;
    let (nothing, _) = events_page(&app, &format!("?type=transfer.done&after={caught_up}")).await;
    assert!(nothing.is_empty(), "{nothing:#?}");
    let response = app
        .get(&format!("/events?type=transfer.done&after={before_match}"))
        .await;
    assert_problem(response, 410, "cursor_expired").await;
}

/// A recorder that stopped with its last events recorded but not yet published (its
/// batch was cut while their cluster time could still have had more, and its stream was
/// saved past them) left them above `recordedThrough`: the next recorder, which resumes
/// after them and never sees them again, publishes them once its stream has run dry, not
/// only when a later event comes. (The webhook dispatcher's handover test met this now
/// and then: the last event made never reached the feed.)
#[tokio::test]
async fn the_events_a_stopped_recorder_left_unpublished_are_published_by_the_next() {
    let first = spawn_app().await;
    let database = first.database.clone();
    open(&first, "alice", 0).await;
    whole_feed(&first, "barrier").await;
    let recorder = first
        .store
        .database()
        .collection::<Document>("eventRecorder");
    drop(first);
    // The state a cut batch leaves: the events recorded and the stream saved past them,
    // the bound not raised yet.
    let tick_zero = "0".repeat(20);
    recorder_lease_given_up(&recorder, RECORDED_WITHIN).await;
    recorder
        .update_one(
            doc! { "_id": "recorder" },
            doc! { "$set": { "recordedThrough": &tick_zero }, "$unset": { "streamDone": "" } },
        )
        .await
        .unwrap();
    let next = spawn_app_with(|s| s.database = database).await;
    eventually(
        "the events left unpublished are in the feed",
        RECORDED_WITHIN,
        POLL_EVERY,
        async || {
            let ids: Vec<String> = events_page(&next, "?limit=100")
                .await
                .0
                .iter()
                .map(|e| e["id"].as_str().unwrap().to_owned())
                .collect();
            ids.contains(&"account.opened:barrier".to_owned())
                .then_some(ids)
        },
    )
    .await;
}
