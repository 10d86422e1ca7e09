//! Gaps in the event feed: events that cannot be recorded, because a document's due
//! event cannot be made, or because the change stream of a feed an older version
//! recorded cannot resume where it was left.
//!
//! Invariant protected here: a loss of events is never silent. A reader of a cursor from
//! before the gap is answered 410 `cursor_expired` (never a 200 without the lost
//! events), a read without a cursor starts after the gap, `event_feed_gaps_total` counts
//! the gap by its cause, and an error log line says what was lost. The webhook
//! dispatcher, a reader with a cursor too, learns of the gap and goes on after it.
//!
//! The metrics are per process and this binary runs its tests concurrently, so counts
//! are compared before and after, as lower bounds; the logs are this test's own (see
//! [`CapturedLogs`]).

use std::time::Duration;

use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use serde_json::Value;

use crate::observability::{CapturedLogs, sample, scrape};
use crate::{assert_problem, get_json};
use support::{TestApp, eventually, spawn_app, spawn_app_with};

/// How long the recorder may take to record an event, or to take a lease given up (it
/// tries every 2 s).
const WITHIN: Duration = Duration::from_secs(15);
const POLL_EVERY: Duration = Duration::from_millis(25);

/// `GET /events{query}` asserted 200: the ids of its events and its `next`.
async fn page(app: &TestApp, query: &str) -> (Vec<String>, String) {
    let (status, page) = get_json(app, &format!("/events{query}")).await;
    assert_eq!(status, 200, "GET /events{query}: {page}");
    let ids = page["items"]
        .as_array()
        .unwrap_or_else(|| panic!("items: {page}"))
        .iter()
        .map(|e| e["id"].as_str().unwrap_or_default().to_owned())
        .collect();
    (ids, page["next"].as_str().unwrap_or_default().to_owned())
}

async fn open(app: &TestApp, id: &str) {
    let response = app
        .post_json("/accounts", serde_json::json!({ "id": id, "balance": 0 }))
        .await;
    assert_eq!(response.status(), 201, "open {id}");
}

/// Opens each of `ids` and waits until a read without a cursor shows the last: the
/// cursor after it then.
async fn opened_and_read(app: &TestApp, ids: &[&str]) -> String {
    for id in ids {
        open(app, id).await;
    }
    let last = format!("account.opened:{}", ids[ids.len() - 1]);
    eventually(
        &format!("{last} is recorded"),
        WITHIN,
        POLL_EVERY,
        async || {
            let (found, next) = page(app, "?limit=1000").await;
            found.contains(&last).then_some(next)
        },
    )
    .await
}

/// `event_feed_gaps_total` of `cause` on the default deployment.
async fn gaps(app: &TestApp, cause: &str) -> f64 {
    sample(
        &scrape(app).await,
        &format!("event_feed_gaps_total{{deployment=\"default\",cause=\"{cause}\"}}"),
    )
}

/// The error lines the capture holds whose message starts with `start`.
fn errors_saying(logs: &CapturedLogs, start: &str) -> Vec<Value> {
    logs.lines()
        .into_iter()
        .filter(|l| {
            l["level"] == "ERROR" && l["message"].as_str().is_some_and(|m| m.starts_with(start))
        })
        .collect()
}

/// Asserts that every cursor of `cursors` is answered 410 `cursor_expired`.
async fn assert_expired(app: &TestApp, cursors: &[(&str, &str)]) {
    for (cursor, which) in cursors {
        let response = app.get(&format!("/events?after={cursor}")).await;
        let problem = assert_problem(response, 410, "cursor_expired").await;
        assert!(problem.get("field").is_none(), "{which}: {problem}");
    }
}

/// The recorder is stopped (its lease held by an instance that records nothing, as a
/// paused one would) while accounts are opened, and where its stream was left cannot be
/// resumed (as when the oplog no longer reaches back there): the server refuses the
/// saved resume token. The instance that takes the lease then records from where it
/// can, and says that the events in between are lost.
#[tokio::test]
async fn a_stream_the_server_cannot_resume_expires_the_cursors_before_its_gap_and_says_so() {
    // Hex, but no resume token the server knows.
    stream_that_cannot_resume(Bson::Document(doc! { "_data": "82000000010000000100" })).await;
}

/// The same with a saved resume point that is no resume token at all: SecantusDB would
/// start a stream asked to resume from it at its tail, silently skipping the changes
/// made meanwhile.
#[tokio::test]
async fn a_resume_token_that_is_no_token_is_a_gap_too() {
    stream_that_cannot_resume(Bson::String("not a resume token".into())).await;
}

async fn stream_that_cannot_resume(saved: Bson) {
    let (logs, _capture) = CapturedLogs::start();
    let first = spawn_app().await;
    let before_any = page(&first, "").await.1;
    let after_recorded = opened_and_read(&first, &["alice", "bob"]).await;
    let database = first.database.clone();
    let lease = first
        .store
        .database()
        .collection::<Document>("eventRecorder");
    drop(first);
    // A feed an older version recorded from the change stream, which this version
    // reads up to its own first start.
    let older = doc! { "$set": { "resumeToken": saved }, "$unset": { "streamDone": "" } };
    crate::events::pause_recording_with(&lease, older).await;
    let app = spawn_app_with(|s| s.database = database).await;
    let lost_before = gaps(&app, "history_lost").await;
    open(&app, "carol").await;
    crate::events::resume_recording(&lease).await;

    let said = eventually(
        "the recorder that takes the lease says the events are lost",
        WITHIN,
        POLL_EVERY,
        async || {
            let lines = errors_saying(&logs, "events lost");
            (!lines.is_empty()).then_some(lines)
        },
    )
    .await;
    let line = &said[0];
    for field in ["cause", "lost_after", "lost_before"] {
        assert!(line[field].is_string(), "{field}: {line}");
    }
    assert!(
        line["lost_before"]
            .as_str()
            .is_some_and(|t| t.starts_with("cluster time ")),
        "{line}"
    );
    assert!(
        gaps(&app, "history_lost").await >= lost_before + 1.0,
        "the gap is counted"
    );
    assert_expired(
        &app,
        &[
            (&after_recorded, "the cursor after the last event recorded"),
            (&before_any, "the cursor of the empty feed"),
        ],
    )
    .await;

    // Recording goes on: a read without a cursor starts after the gap and reads what
    // was made since, and its cursor stays good. Carol was opened by this version during
    // the gap: her event was marked in her document, so it is not lost.
    let (front, fresh) = eventually(
        "what this version made during the gap is recorded after it",
        WITHIN,
        POLL_EVERY,
        async || {
            let (front, fresh) = page(&app, "?limit=1000").await;
            front
                .iter()
                .any(|id| id == "account.opened:carol")
                .then_some((front, fresh))
        },
    )
    .await;
    assert!(
        !front
            .iter()
            .any(|id| id.ends_with(":alice") || id.ends_with(":bob")),
        "a read without a cursor starts after the gap: {front:?}"
    );
    let after = opened_and_read(&app, &["dave"]).await;
    let (read, _) = page(&app, &format!("?after={fresh}&limit=1000")).await;
    assert_eq!(read, vec!["account.opened:dave".to_owned()]);
    let (none, _) = page(&app, &format!("?after={after}")).await;
    assert!(none.is_empty(), "{none:?}");
    // What the gap left below the front is removed, as the retention removes events.
    let events = app.store.database().collection::<Document>("events");
    eventually(
        "the events below the front are removed",
        WITHIN,
        POLL_EVERY,
        async || {
            let left = events
                .count_documents(
                    doc! { "_id": { "$in": ["account.opened:alice", "account.opened:bob"] } },
                )
                .await
                .unwrap();
            (left == 0).then_some(())
        },
    )
    .await;
    let recorder = lease.find_one(doc! { "_id": "recorder" }).await.unwrap();
    assert_eq!(
        recorder.as_ref().and_then(|r| r.get_str("owner").ok()),
        Some(app.instance_id.as_str()),
        "{recorder:?}"
    );
}

/// A document whose due event the recorder cannot make (a transfer written `done`
/// without its fields, by something other than this service): its event is lost, so every cursor
/// from before it expires, and the feed goes on after it.
#[tokio::test]
async fn a_change_that_cannot_be_an_event_expires_the_cursors_before_it_and_says_so() {
    let (logs, _capture) = CapturedLogs::start();
    let app = spawn_app().await;
    let lost_before = gaps(&app, "unreadable_change").await;
    let after_recorded = opened_and_read(&app, &["alice", "bob"]).await;
    let broken = ObjectId::new();
    app.store
        .database()
        .collection::<Document>("transactions")
        .insert_one(doc! { "_id": broken, "state": "done", "eventsDue": [{ "type": "transfer.done", "at": mongodb::bson::DateTime::now() }] })
        .bypass_document_validation(true)
        .await
        .unwrap();
    let after_gap = opened_and_read(&app, &["carol"]).await;

    let said = eventually(
        "the recorder says the event is lost",
        WITHIN,
        POLL_EVERY,
        async || {
            let lines = errors_saying(&logs, "event lost");
            (!lines.is_empty()).then_some(lines)
        },
    )
    .await;
    let line = &said[0];
    assert!(
        line["change"]
            .as_str()
            .is_some_and(|c| c.contains("transactions") && c.contains(&broken.to_hex())),
        "the change is named: {line}"
    );
    assert!(
        gaps(&app, "unreadable_change").await >= lost_before + 1.0,
        "the gap is counted"
    );
    assert_expired(
        &app,
        &[(&after_recorded, "the cursor from before the broken change")],
    )
    .await;
    let (front, _) = page(&app, "?limit=1000").await;
    assert_eq!(
        front,
        vec!["account.opened:carol".to_owned()],
        "a read without a cursor starts after the gap"
    );
    let (none, _) = page(&app, &format!("?after={after_gap}")).await;
    assert!(none.is_empty(), "{none:?}");
}

/// An event that cannot be made and good ones due at the same time go into one round:
/// the lost one takes the first place, so that the front moves past it alone and the
/// others are read after the gap (before, in the round's order, a lost event after them
/// moved the front past them too, and they were never read).
#[tokio::test]
async fn an_event_that_cannot_be_made_loses_no_other_of_its_round() {
    let first = spawn_app().await;
    let database = first.database.clone();
    let after_recorded = opened_and_read(&first, &["alice"]).await;
    let db = first.store.database().clone();
    let lease = db.collection::<Document>("eventRecorder");
    drop(first);
    crate::events::pause_recording(&lease).await;
    let app = spawn_app_with(|s| s.database = database).await;
    open(&app, "bob").await;
    open(&app, "carol").await;
    // Due after bob and carol: by time, the last of the round.
    let broken = ObjectId::new();
    db.collection::<Document>("transactions")
        .insert_one(doc! { "_id": broken, "state": "done", "eventsDue": [{ "type": "transfer.done", "at": mongodb::bson::DateTime::now() }] })
        .bypass_document_validation(true)
        .await
        .unwrap();
    crate::events::resume_recording(&lease).await;

    let read = eventually("the round is recorded", WITHIN, POLL_EVERY, async || {
        let (found, _) = page(&app, "?limit=1000").await;
        (found.len() >= 2).then_some(found)
    })
    .await;
    assert_eq!(
        read,
        ["account.opened:bob", "account.opened:carol"],
        "read after the gap, in the round's order"
    );
    assert_expired(
        &app,
        &[(&after_recorded, "the cursor from before the round")],
    )
    .await;
}

/// The webhook dispatcher follows the feed with a cursor of its own: across a gap it is
/// answered 410 like any reader, logs an error, and goes on from the front after the
/// gap, so that the events recorded after it are still delivered (the lost one never
/// is: it has no event).
#[tokio::test]
async fn the_webhook_dispatcher_goes_on_after_a_gap_and_says_so() {
    let (logs, _capture) = CapturedLogs::start();
    let app = spawn_app().await;
    // Nothing listens there: each delivery is made (and retried), which is all this
    // looks at.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let response = app
        .post_json(
            "/webhooks",
            serde_json::json!({ "url": format!("http://127.0.0.1:{port}/hook") }),
        )
        .await;
    assert_eq!(response.status(), 201);
    let hook: Value = response.json().await.unwrap();
    let hook = hook["id"].as_str().unwrap().to_owned();
    let delivered = async |event: &str| {
        eventually(
            &format!("a delivery of {event} is made"),
            WITHIN,
            POLL_EVERY,
            async || {
                let (status, page) = get_json(&app, &format!("/webhooks/{hook}/deliveries")).await;
                assert_eq!(status, 200, "{page}");
                page["items"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|d| d["eventId"] == event)
                    .then_some(())
            },
        )
        .await
    };
    opened_and_read(&app, &["alice"]).await;
    delivered("account.opened:alice").await;
    app.store
        .database()
        .collection::<Document>("transactions")
        .insert_one(doc! { "_id": ObjectId::new(), "state": "done", "eventsDue": [{ "type": "transfer.done", "at": mongodb::bson::DateTime::now() }] })
        .bypass_document_validation(true)
        .await
        .unwrap();
    opened_and_read(&app, &["carol"]).await;

    delivered("account.opened:carol").await;
    let told = logs
        .lines()
        .into_iter()
        .filter(|l| {
            // The deliverer's files are modules of their own (its dispatcher says it).
            let target = l["target"].as_str().unwrap_or_default();
            l["level"] == "ERROR" && target.starts_with("transfer_service::deliverer")
        })
        .count();
    assert!(told >= 1, "the dispatcher says it passed a gap");
}
