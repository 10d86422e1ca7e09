//! What every tenant shares, no tenant may take whole (`docs/tenants.md`).
//!
//! Invariants protected here: a tenant's keys (and the platform's, counted as one more
//! tenant) hold at most `MAX_EVENT_STREAMS_PER_TENANT` of an instance's live streams: one
//! more is 503 `too_many_streams` with `Retry-After`, while another tenant still gets a
//! stream; a place of the share is usable again once one of its streams ends (its client
//! left, or its key was revoked). Webhooks
//! are bounded in all (`MAX_WEBHOOKS_TOTAL`), not only per tenant, also against
//! registrations of every tenant at once, and every webhook registered is served; which
//! of a list of webhooks exist is read in bounded reads however long the list.

use std::collections::BTreeSet;
use std::time::Duration;

use mongodb::bson::oid::ObjectId;
use serde_json::{Value, json};
use transfer_service::config::{Settings, parse_api_keys};

use crate::assert_problem;
use crate::webhooks::{Answer, Receiver};
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
    make_key_with_id(app, admin, tenant, role).await.0
}

/// Makes a key of `tenant` with `role`: its secret and its public id.
async fn make_key_with_id(
    app: &TestApp,
    admin: &str,
    tenant: &str,
    role: &str,
) -> (String, String) {
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
    let secret = made["key"].as_str().expect("the secret").to_owned();
    (secret, made["id"].as_str().expect("the id").to_owned())
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
/// A stream of `key`'s, opened once its tenant's share has a place again (`what` says
/// whose place is expected back); until then every answer is the share's refusal.
async fn served_once_a_place_is_back(app: &TestApp, key: &str, what: &str) -> reqwest::Response {
    eventually(
        what,
        Duration::from_secs(5),
        Duration::from_millis(50),
        async || {
            let response = connect(app, key).await;
            match response.status().as_u16() {
                200 => Some(response),
                503 => {
                    assert_refused(response, SHARE_FULL).await;
                    None
                }
                code => panic!("{code}: {}", response.text().await.unwrap_or_default()),
            }
        },
    )
    .await
}

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
    let _again = served_once_a_place_is_back(
        &app,
        &acme,
        "acme's closed stream gives its place in acme's share back",
    )
    .await;
    assert_refused(connect(&app, &acme).await, SHARE_FULL).await;
}

/// Registers a webhook at `url` with `key`: the answer, whatever it is.
async fn register(app: &TestApp, key: &str, url: &str) -> reqwest::Response {
    app.http
        .post(app.url("/webhooks"))
        .bearer_auth(key)
        .json(&json!({ "url": url }))
        .send()
        .await
        .expect("request")
}

/// Asserts a 409 `webhook_limit_reached` naming `MAX_WEBHOOKS_TOTAL`.
async fn assert_total_reached(response: reqwest::Response) {
    let problem = assert_problem(response, 409, "webhook_limit_reached").await;
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|d| d.contains("MAX_WEBHOOKS_TOTAL")),
        "{problem}"
    );
}

/// Webhooks are bounded in all, not only per tenant: two registrations from each of three
/// tenants and the platform, sent at once (each within its tenant's `MAX_WEBHOOKS` of 2),
/// register `MAX_WEBHOOKS_TOTAL` (5) and refuse the rest with 409 naming it (decided in
/// the write: a count read before the insert would let racing ones pass); a deletion
/// makes room for one; a tenant with none of its own is refused too; and every webhook
/// registered is sent its events. Before, each tenant had its own 2 and all 8 were
/// registered: the total grew with the tenants.
#[tokio::test]
async fn webhooks_are_bounded_in_all_whatever_the_number_of_tenants() {
    let (app, admin) = spawn_with_admin(|s| {
        s.webhooks.max_webhooks = 2;
        s.webhooks.max_webhooks_total = 5;
    })
    .await;
    let receiver = Receiver::start(Answer::Status(200)).await;
    let mut keys = vec![("platform", admin.clone())];
    for tenant in ["acme", "bolt", "cusp"] {
        keys.push((tenant, make_key(&app, &admin, tenant, "rw").await));
    }
    let sent: Vec<_> = keys
        .iter()
        .flat_map(|(who, key)| (0..2).map(move |i| (*who, key.clone(), i)))
        .map(|(who, key, i)| {
            let (http, to) = (app.http.clone(), app.url("/webhooks"));
            let url = receiver.url(&format!("/{who}/{i}"));
            tokio::spawn(async move {
                let answer = http
                    .post(to)
                    .bearer_auth(&key)
                    .json(&json!({ "url": url }))
                    .send()
                    .await
                    .unwrap();
                (who, key, answer)
            })
        })
        .collect();
    let (mut registered, mut refused) = (Vec::new(), 0);
    for answer in futures::future::join_all(sent).await {
        let (who, key, answer) = answer.unwrap();
        if answer.status() == 201 {
            let made: Value = answer.json().await.unwrap();
            let url = made["url"].as_str().unwrap().to_owned();
            registered.push((who, key, made["id"].as_str().unwrap().to_owned(), url));
        } else {
            assert_total_reached(answer).await;
            refused += 1;
        }
    }
    assert_eq!((registered.len(), refused), (5, 3), "5 registered in all");

    let (who, key, gone, _) = registered.remove(0);
    let deleted = app
        .http
        .delete(app.url(&format!("/webhooks/{gone}")))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 204);
    let again = register(&app, &key, &receiver.url(&format!("/{who}/again"))).await;
    assert_eq!(again.status(), 201, "the deletion made room for one");
    let made: Value = again.json().await.unwrap();
    let url = made["url"].as_str().unwrap().to_owned();
    registered.push((who, key, made["id"].as_str().unwrap().to_owned(), url));
    let dusk = make_key(&app, &admin, "dusk", "rw").await;
    assert_total_reached(register(&app, &dusk, &receiver.url("/dusk/0")).await).await;

    // Each registered webhook is sent the events its tenant sees: an account of each
    // tenant, opened by the platform (whose webhooks are sent all three).
    for tenant in ["acme", "bolt", "cusp"] {
        let opened = app
            .http
            .post(app.url("/accounts"))
            .bearer_auth(&admin)
            .json(&json!({ "id": format!("{tenant}-a"), "balance": 0, "tenant": tenant }))
            .send()
            .await
            .unwrap();
        assert_eq!(opened.status(), 201);
    }
    let expected: BTreeSet<(String, String)> = registered
        .iter()
        .flat_map(|(who, _, _, url)| {
            let path = url.split_once("//").unwrap().1;
            let path = &path[path.find('/').unwrap()..];
            ["acme", "bolt", "cusp"]
                .into_iter()
                .filter(|t| *who == "platform" || t == who)
                .map(|t| (path.to_owned(), format!("account.opened:{t}-a")))
                .collect::<Vec<_>>()
        })
        .collect();
    eventually(
        "every registered webhook is sent its events",
        Duration::from_secs(30),
        Duration::from_millis(100),
        async || {
            let got: BTreeSet<(String, String)> = receiver
                .received()
                .iter()
                .map(|r| (r.path.clone(), r.json()["id"].as_str().unwrap().to_owned()))
                .collect();
            expected.is_subset(&got).then_some(())
        },
    )
    .await;
}

/// Which of a list of webhooks exist (what the dispatcher reads after a page, instead of
/// the whole list again) is answered for every id however long the list: of 60,000 ids
/// (some 2.5 MB of them, more than one read of `IDS_READ_BYTES` holds), the two that
/// exist, first and last, are found.
#[tokio::test]
async fn which_webhooks_exist_is_read_in_bounded_reads_however_many_are_asked() {
    let (app, admin) = spawn_with_admin(|_| {}).await;
    let mut ids = Vec::new();
    for i in 0..2 {
        let made = register(&app, &admin, &format!("http://127.0.0.1:9/{i}")).await;
        assert_eq!(made.status(), 201);
        let made: Value = made.json().await.unwrap();
        ids.push(made["id"].as_str().unwrap().to_owned());
    }
    let missing: Vec<String> = (0..60_000).map(|i| format!("wh_{i:024x}")).collect();
    let mut asked: Vec<&str> = vec![&ids[0]];
    asked.extend(missing.iter().map(String::as_str));
    asked.push(&ids[1]);
    let found = app.store.webhooks().webhooks_among(&asked).await.unwrap();
    assert_eq!(found, ids.iter().cloned().collect());
}

/// A stream ended by its key's revocation gives its place in its tenant's share back:
/// acme (a share of one) follows with a key that is then revoked; once that stream has
/// ended, acme's other key gets a stream.
#[tokio::test]
async fn a_stream_ended_by_a_revoked_key_gives_its_tenants_place_back() {
    let (app, admin) = spawn_with_admin(|s| {
        s.max_event_streams = 4;
        s.max_event_streams_per_tenant = Some(1);
    })
    .await;
    let (doomed, doomed_id) = make_key_with_id(&app, &admin, "acme", "ro").await;
    let other = make_key(&app, &admin, "acme", "ro").await;
    let mut stream = open_stream(&app, &doomed, "acme's stream").await;
    assert_refused(connect(&app, &other).await, SHARE_FULL).await;

    let deleted = app
        .http
        .delete(app.url(&format!("/api-keys/{doomed_id}")))
        .bearer_auth(&admin)
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 204);
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        while stream.chunk().await.unwrap().is_some() {}
    })
    .await;
    assert!(ended.is_ok(), "the stream ends once its key is revoked");
    let _again = served_once_a_place_is_back(
        &app,
        &other,
        "the revoked key's stream gives acme's place back",
    )
    .await;
}
