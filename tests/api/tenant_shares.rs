//! What every tenant shares, no tenant may take whole (`docs/tenants.md`).
//!
//! Invariants protected here: a tenant's keys (and the platform's, counted as one more
//! tenant) hold at most `MAX_EVENT_STREAMS_PER_TENANT` of an instance's live streams: one
//! more is 503 `too_many_streams` with `Retry-After`, while another tenant still gets a
//! stream; a place of the share is usable again once one of its streams ends.

use std::time::Duration;

use mongodb::bson::oid::ObjectId;
use serde_json::{Value, json};
use transfer_service::config::{Settings, parse_api_keys};

use crate::assert_problem;
use support::{TestApp, eventually, spawn_app_with};

/// A service with one platform admin key in `API_KEYS`, adjusted by `adjust`: the app and
/// the admin key.
async fn spawn_with_admin(adjust: impl FnOnce(&mut Settings)) -> (TestApp, String) {
    let admin = format!("admin-{}", ObjectId::new().to_hex());
    let keys = parse_api_keys(&format!("admin:{admin}")).unwrap();
    let app = spawn_app_with(|s| {
        s.api_keys = keys;
        adjust(s);
    })
    .await;
    (app, admin)
}

/// Makes a key of `tenant` with `role`: its secret.
async fn make_key(app: &TestApp, admin: &str, tenant: &str, role: &str) -> String {
    let made = app
        .http
        .post(app.url("/api-keys"))
        .bearer_auth(admin)
        .json(&json!({ "tenant": tenant, "role": role }))
        .send()
        .await
        .unwrap();
    assert_eq!(made.status(), 201);
    let made: Value = made.json().await.unwrap();
    made["key"].as_str().expect("the secret").to_owned()
}

/// `GET /events/stream` with `key`: the answer, whatever it is.
async fn connect(app: &TestApp, key: &str) -> reqwest::Response {
    app.http
        .get(app.url("/events/stream"))
        .bearer_auth(key)
        .send()
        .await
        .expect("request")
}

/// A stream opened with `key` (200, held open until dropped).
async fn open_stream(app: &TestApp, key: &str, what: &str) -> reqwest::Response {
    let response = connect(app, key).await;
    assert_eq!(response.status(), 200, "{what}");
    response
}

/// The detail of a refusal by the instance's limit, and by a tenant's share.
const INSTANCE_FULL: &str = "(MAX_EVENT_STREAMS)";
const SHARE_FULL: &str = "(MAX_EVENT_STREAMS_PER_TENANT;";

/// Asserts a 503 `too_many_streams` with a `Retry-After` and a detail naming `limit`.
async fn assert_refused(response: reqwest::Response, limit: &str) {
    // The status first: a stream answered 200 has a body that never ends.
    assert_eq!(response.status(), 503, "refused by {limit}");
    let retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let problem = assert_problem(response, 503, "too_many_streams").await;
    assert!(
        retry_after.is_some_and(|s| s.parse::<u64>().is_ok_and(|s| s > 0)),
        "a Retry-After: {problem}"
    );
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(detail.contains(limit), "names {limit}: {problem}");
}

/// One tenant's keys cannot take every place of the live stream: beyond its share (2 of
/// 4 here) it is refused, while another tenant and the platform still get a stream; once
/// one of its streams ends (the client drops the connection) its place is usable again.
/// Before, the tenant took all four and every other caller was refused.
#[tokio::test]
async fn a_tenant_holds_its_share_of_the_stream_places_and_the_others_still_get_theirs() {
    let (app, admin) = spawn_with_admin(|s| {
        s.max_event_streams = 4;
        s.max_event_streams_per_tenant = Some(2);
    })
    .await;
    let acme = make_key(&app, &admin, "acme", "ro").await;
    let bolt = make_key(&app, &admin, "bolt", "ro").await;

    let first = open_stream(&app, &acme, "acme's first").await;
    let _second = open_stream(&app, &acme, "acme's second").await;
    assert_refused(connect(&app, &acme).await, SHARE_FULL).await;
    let _bolts = open_stream(&app, &bolt, "bolt's, with acme at its share").await;
    let _platforms = open_stream(&app, &admin, "the platform's").await;
    // Four open: the instance's own limit now refuses everyone, bolt within its share.
    assert_refused(connect(&app, &bolt).await, INSTANCE_FULL).await;

    drop(first);
    // The server learns that the reader left when it next writes to the connection or
    // polls it (as for the instance's places, tests/api/events_stream.rs).
    let _again = eventually(
        "acme's closed stream gives its place in acme's share back",
        Duration::from_secs(5),
        Duration::from_millis(50),
        async || {
            let response = connect(&app, &acme).await;
            match response.status().as_u16() {
                200 => Some(response),
                503 => {
                    assert_refused(response, SHARE_FULL).await;
                    None
                }
                other => panic!("{other}: {}", response.text().await.unwrap_or_default()),
            }
        },
    )
    .await;
    assert_refused(connect(&app, &acme).await, SHARE_FULL).await;
}
