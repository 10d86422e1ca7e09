//! The front of the feed (`docs/events.md`, `docs/tenants.md`): where a reader without a
//! cursor starts once the retention has removed events, and what the cursors it is
//! handed carry.
//!
//! Invariants protected here: a cursor handed to a tenant's key never carries the id of
//! an event the tenant does not see (the front of the feed is the last event removed,
//! whoever's it was), on `GET /events`, its pages, and the stream's `id:` lines; and a
//! reader that starts from the front, whatever the removals before and after (rounds of
//! this version, which remove whole cluster times, and of an older one, which stopped at
//! a count inside one), never skips an event it sees, reads none twice, and is refused
//! 410 `cursor_expired` only when an event after its cursor was removed since it was
//! handed that cursor.
//!
//! `FRONT_SEED` replays one exploration (it is printed at the start and in every
//! failure); `FRONT_SEEDS` sets how many run (default [`SEEDS`]).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use futures::TryStreamExt;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::{self, Bson, Document, doc};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use reqwest::Method;
use serde_json::{Value, json};
use support::{TestApp, database_uris, eventually, spawn_app_with};
use transfer_service::config::{Deployment, parse_api_keys};
use transfer_service::domain::DeploymentName;
use transfer_service::store::Store;
use transfer_service::store::events::MAX_TRIMMED;

const WITHIN: Duration = Duration::from_secs(20);
const POLL_EVERY: Duration = Duration::from_millis(25);

async fn call(
    app: &TestApp,
    key: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut request = app.http.request(method, app.url(path)).bearer_auth(key);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("request");
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    let body = if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"))
    };
    (status, body)
}

async fn made(app: &TestApp, key: &str, path: &str, body: Value) -> Value {
    let (status, answer) = call(app, key, Method::POST, path, Some(body)).await;
    assert_eq!(status, 201, "POST {path}: {answer}");
    answer
}

/// Makes a key of `tenant` with `admin`: its secret.
async fn tenant_key(app: &TestApp, admin: &str, tenant: &str) -> String {
    let key = made(
        app,
        admin,
        "/api-keys",
        json!({ "tenant": tenant, "role": "rw" }),
    )
    .await;
    key["key"].as_str().unwrap().to_owned()
}

/// The positions a cursor holds: deployment, then `[seconds, increment, id]`.
fn positions(cursor: &str) -> serde_json::Map<String, Value> {
    let bytes = URL_SAFE_NO_PAD
        .decode(cursor)
        .unwrap_or_else(|e| panic!("a cursor is base64url ({e}): {cursor}"));
    let json: Value = serde_json::from_slice(&bytes).unwrap();
    json["p"].as_object().cloned().unwrap_or_default()
}

/// Asserts that no position of `cursor` names any of `others` (ids of events, accounts
/// or transfers the reader does not see).
fn assert_carries_none_of(cursor: &str, others: &[String], which: &str) {
    for (deployment, at) in positions(cursor) {
        let id = at[2].as_str().unwrap_or_default();
        for other in others {
            assert!(
                !id.contains(other.as_str()),
                "{which}: the cursor's position on {deployment} names {other}, which the reader does not see: {at}"
            );
        }
    }
}

/// Two deployments (`default` and `eu`); bolt's accounts and transfers on both are
/// removed by the retention, so that the front of each feed is one of bolt's events;
/// then acme, with no event of its own, reads the feed from its start, follows the
/// stream, opens accounts and pays on `default` only, and pages through. No cursor acme
/// is handed names anything of bolt's: before, each named the last of bolt's events
/// removed on each deployment where acme's page took none of its own.
#[tokio::test]
async fn no_cursor_a_tenant_is_handed_names_another_tenants_event_removed_at_the_front() {
    let uris = database_uris(2);
    let admin = format!("admin-{}", ObjectId::new().to_hex());
    let keys = parse_api_keys(&format!("admin:{admin}")).unwrap();
    let app = spawn_app_with(|s| {
        s.deployments = vec![
            Deployment {
                name: DeploymentName::default(),
                uri: uris[0].clone(),
            },
            Deployment {
                name: DeploymentName::parse("eu").unwrap(),
                uri: uris[1].clone(),
            },
        ];
        s.api_keys = keys;
        s.event_retention = Duration::from_secs(2);
    })
    .await;
    let eu = Store::connect(&uris[1], &app.database).await.unwrap();
    let (acme, bolt) = (
        tenant_key(&app, &admin, "acme").await,
        tenant_key(&app, &admin, "bolt").await,
    );
    let mut bolts = Vec::new();
    for (deployment, a, b) in [
        ("default", "bolt-one", "bolt-two"),
        ("eu", "bolt-three", "bolt-four"),
    ] {
        for (id, balance) in [(a, 100), (b, 0)] {
            let body = json!({ "id": id, "balance": balance, "currency": "EUR", "deployment": deployment });
            made(&app, &bolt, "/accounts", body).await;
            bolts.push(id.to_owned());
        }
        let paid = made(
            &app,
            &bolt,
            "/transfers",
            json!({ "source": a, "destination": b, "amount": 5 }),
        )
        .await;
        bolts.push(paid["id"].as_str().unwrap().to_owned());
    }
    // The precondition: each feed's front is one of bolt's events, and none is left.
    for store in [&app.store, &eu] {
        let recorder = store.database().collection::<Document>("eventRecorder");
        eventually(
            "the retention removes bolt's events, the last of them at the front",
            WITHIN,
            POLL_EVERY,
            async || {
                let state = recorder
                    .find_one(doc! { "_id": "recorder" })
                    .await
                    .unwrap()?;
                let front = state.get_str("trimmedThrough").ok()?;
                let left = store
                    .database()
                    .collection::<Document>("events")
                    .count_documents(doc! {})
                    .await
                    .unwrap();
                (left == 0 && bolts.iter().any(|b| front.contains(b.as_str()))).then_some(())
            },
        )
        .await;
    }

    // From the start, nothing of acme's in the feed.
    let (status, page) = call(&app, &acme, Method::GET, "/events", None).await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["items"], json!([]));
    let first = page["next"].as_str().unwrap().to_owned();
    assert_carries_none_of(&first, &bolts, "the next of acme's first read");
    assert_eq!(
        positions(&first).len(),
        2,
        "a position on each deployment: {first}"
    );

    // The stream, from the start: the id of acme's first event.
    let mut stream = app
        .http
        .get(app.url("/events/stream"))
        .bearer_auth(&acme)
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    made(
        &app,
        &acme,
        "/accounts",
        json!({ "id": "acme-one", "balance": 100, "currency": "EUR" }),
    )
    .await;
    made(
        &app,
        &acme,
        "/accounts",
        json!({ "id": "acme-two", "balance": 0, "currency": "EUR" }),
    )
    .await;
    made(
        &app,
        &acme,
        "/transfers",
        json!({ "source": "acme-one", "destination": "acme-two", "amount": 7 }),
    )
    .await;
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + WITHIN;
    while !text.lines().any(|l| l.starts_with("id: ")) {
        let chunk = tokio::time::timeout_at(deadline, stream.chunk())
            .await
            .expect("acme's first event streamed in time")
            .unwrap()
            .expect("the stream goes on");
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(stream);
    let streamed: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("id: "))
        .collect();
    for id in &streamed {
        assert_carries_none_of(id, &bolts, "a stream's id");
    }

    // Paging through acme's own events, one a page, from the start and from the first
    // cursor: every page's next.
    for from in [None, Some(first.clone())] {
        let mut cursor = from;
        let mut read = Vec::new();
        for _ in 0..10 {
            let path = match &cursor {
                Some(c) => format!("/events?limit=1&after={c}"),
                None => "/events?limit=1".to_owned(),
            };
            let (status, page) = call(&app, &acme, Method::GET, &path, None).await;
            assert_eq!(status, 200, "{path}: {page}");
            let next = page["next"].as_str().unwrap().to_owned();
            assert_carries_none_of(&next, &bolts, "a page's next");
            let items = page["items"].as_array().unwrap();
            read.extend(items.iter().map(|e| e["id"].as_str().unwrap().to_owned()));
            cursor = Some(next);
            if items.is_empty() && read.len() >= 3 {
                break;
            }
        }
    }
}

// ---------------------------------------------------------------------------------
// The exploration.

/// Explorations run by default.
const SEEDS: u64 = 3;
/// Steps (removals, reads, the bound raised) of one exploration.
const STEPS: usize = 60;
/// Events a feed of one exploration holds: several rounds of [`MAX_TRIMMED`].
const EVENTS: usize = 2 * MAX_TRIMMED as usize + 700;
/// The owner of the recorder's lease while the test drives the feed.
const EXPLORER: &str = "front-explorer";
/// cusp has a few recent events only: its reads meet fronts of others' events alone.
const TENANTS: [&str; 3] = ["acme", "bolt", "cusp"];

/// Who reads: a tenant, or the platform (every event).
type Scope = Option<&'static str>;

/// One event of the model.
#[derive(Debug, Clone)]
struct Ev {
    key: String,
    id: String,
    /// Its tenant (none: the platform's only).
    tenant: Scope,
    old: bool,
}

fn key(seconds: u64, increment: u64, id: &str) -> String {
    format!("{seconds:010}{increment:010}{id}")
}

fn tick_of(key: &str) -> &str {
    &key[..20]
}

/// The feed as it stands between two steps.
#[derive(Debug, Clone, Default)]
struct Now {
    /// The keys of the events stored.
    stored: HashSet<String>,
    front: String,
    recorded: String,
}

impl Now {
    /// Stored above the front: not removed.
    fn kept(&self, e: &Ev) -> bool {
        self.stored.contains(&e.key) && e.key > self.front
    }
    /// Kept and readable.
    fn live(&self, e: &Ev) -> bool {
        self.kept(e) && e.key <= self.recorded
    }
}

/// A reader: a scope and the cursor it follows.
struct Reader {
    scope: Scope,
    key: String,
    /// Its cursor, and the feed as it stood when it was handed it; none before its first
    /// read (and after a 410: it starts again).
    cursor: Option<(String, Now)>,
    /// The keys of the events it read, in order.
    seen: Vec<String>,
}

struct Explorer<'a> {
    app: &'a TestApp,
    seed: u64,
    events: mongodb::Collection<Document>,
    recorder: mongodb::Collection<Document>,
    model: Vec<Ev>,
    by_id: HashMap<String, usize>,
    log: Vec<String>,
    /// How many reads without a cursor met each kind of front: what the run explored.
    fronts: std::collections::BTreeMap<&'static str, usize>,
}

impl Explorer<'_> {
    fn fail(&self, what: String) -> ! {
        panic!(
            "FRONT_SEED={}: {what}\nsteps:\n{}",
            self.seed,
            self.log.join("\n")
        )
    }

    async fn now(&self) -> Now {
        let stored = self
            .events
            .find(doc! {})
            .projection(doc! { "key": 1 })
            .await
            .unwrap()
            .try_collect::<Vec<_>>()
            .await
            .unwrap()
            .into_iter()
            .map(|d| d.get_str("key").unwrap().to_owned())
            .collect();
        let state = self
            .recorder
            .find_one(doc! { "_id": "recorder" })
            .await
            .unwrap()
            .unwrap();
        Now {
            stored,
            front: state
                .get_str("trimmedThrough")
                .unwrap_or_default()
                .to_owned(),
            recorded: state.get_str("recordedThrough").unwrap().to_owned(),
        }
    }

    fn sees(scope: Scope, e: &Ev) -> bool {
        scope.is_none() || e.tenant == scope
    }

    /// A round of the retention by an older version: it stops after `count` events,
    /// inside a cluster time or not.
    async fn older_round(&mut self, count: usize) {
        let now = self.now().await;
        let through = self
            .model
            .iter()
            .filter(|e| e.old && now.live(e))
            .take(count)
            .last()
            .map(|e| e.key.clone());
        if let Some(through) = through {
            self.recorder
                .update_one(
                    doc! { "_id": "recorder" },
                    doc! { "$max": { "trimmedThrough": &through } },
                )
                .await
                .unwrap();
            self.events
                .delete_many(doc! { "key": { "$lte": &through } })
                .await
                .unwrap();
            self.log
                .push(format!("older round of {count}: through {through}"));
        }
    }

    /// What the front is to a reader of `scope` without a cursor.
    fn front_kind(&self, now: &Now, scope: Scope) -> &'static str {
        if now.front.is_empty() {
            return "no front";
        }
        if now.front.len() == 20 {
            return "a cluster time's start";
        }
        let inside = |seen: Scope| {
            self.model.iter().any(|e| {
                Self::sees(seen, e) && now.kept(e) && tick_of(&e.key) == tick_of(&now.front)
            })
        };
        match (inside(None), inside(scope)) {
            (false, _) => "the end of a cluster time",
            (true, false) => "inside a cluster time, none of the reader's after it",
            (true, true) => "inside a cluster time, the reader's events after it",
        }
    }

    /// One page for `reader`, checked against the feed as it stood before.
    async fn read(&mut self, reader: &mut Reader, limit: usize) {
        let before = self.now().await;
        let path = match &reader.cursor {
            Some((c, _)) => format!("/events?limit={limit}&after={c}"),
            None => format!("/events?limit={limit}"),
        };
        let (status, page) = call(self.app, &reader.key, Method::GET, &path, None).await;
        let who = reader.scope.unwrap_or("platform");
        if reader.cursor.is_none() {
            let kind = self.front_kind(&before, reader.scope);
            *self.fronts.entry(kind).or_default() += 1;
        }
        // Where it read from: its position; without one, the front.
        let (from, handed) = match &reader.cursor {
            Some((c, then)) => match positions(c).get("default") {
                Some(at) => (
                    key(
                        at[0].as_u64().unwrap(),
                        at[1].as_u64().unwrap(),
                        at[2].as_str().unwrap(),
                    ),
                    Some(then.clone()),
                ),
                None => (before.front.clone(), None),
            },
            None => (before.front.clone(), None),
        };
        if status == 410 {
            // Refused: only if an event after its position was removed since it was
            // handed it.
            let missed = handed.as_ref().and_then(|then| {
                self.model
                    .iter()
                    .find(|e| e.key > from && then.kept(e) && !before.kept(e))
            });
            match missed {
                Some(e) => self
                    .log
                    .push(format!("{who} limit {limit}: 410, it missed {}", e.id)),
                None => self.fail(format!(
                    "{who} from {from} refused 410 though no event after it was removed: {page}"
                )),
            }
            reader.cursor = None;
            reader.seen.clear();
            return;
        }
        if status != 200 {
            self.fail(format!("{who}: GET {path}: {status} {page}"));
        }
        let next = page["next"].as_str().unwrap().to_owned();
        let items: Vec<String> = page["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["id"].as_str().unwrap().to_owned())
            .collect();
        let mut last = from.clone();
        for id in &items {
            let Some(&i) = self.by_id.get(id) else {
                self.fail(format!("{who} read {id}, which is no event of the feed"));
            };
            let e = &self.model[i];
            if !Self::sees(reader.scope, e) {
                self.fail(format!("{who} read {id}, which it does not see"));
            }
            if e.key <= last {
                self.fail(format!(
                    "{who} read {id} after {last}: out of order, or again"
                ));
            }
            if reader.seen.contains(&e.key) {
                self.fail(format!("{who} read {id} twice"));
            }
            last = e.key.clone();
            reader.seen.push(e.key.clone());
        }
        // The position it is handed names nothing it does not see.
        let to = match positions(&next).get("default") {
            Some(at) => {
                let id = at[2].as_str().unwrap();
                if reader.scope.is_some() && !id.is_empty() {
                    let own = self
                        .by_id
                        .get(id)
                        .is_some_and(|&i| Self::sees(reader.scope, &self.model[i]));
                    if !own {
                        self.fail(format!(
                            "{who} is handed a cursor naming {id}, which it does not see"
                        ));
                    }
                }
                Some(key(at[0].as_u64().unwrap(), at[1].as_u64().unwrap(), id))
            }
            None => None,
        };
        // Nothing it sees between where it read from and where it is now was skipped:
        // every such event readable when it was handed its cursor, or now, is in the
        // page.
        if let Some(to) = &to {
            if *to < last {
                self.fail(format!(
                    "{who} is handed {to}, below the last event it read {last}"
                ));
            }
            let skipped = self.model.iter().find(|e| {
                Self::sees(reader.scope, e)
                    && e.key > from
                    && e.key <= *to
                    && !items.contains(&e.id)
                    && (before.live(e) || handed.as_ref().is_some_and(|t| t.live(e)))
            });
            if let Some(e) = skipped {
                self.fail(format!(
                    "{who} read from {from} to {to} and skipped {} ({})",
                    e.id, e.key
                ));
            }
        }
        self.log.push(format!(
            "{who} limit {limit}: {} events, from {from} to {to:?}",
            items.len()
        ));
        reader.cursor = Some((next, before));
    }
}

/// Trimming in rounds, this version's and an older one's, interleaved with readers of
/// every scope that start from the front and page on: see the module's invariants. The
/// feed is written by the test (the recorder's lease held by it): events sharing cluster
/// times by the hundred, as a transaction or a sharded cluster makes them (SecantusDB
/// gives every change its own), so that a round of [`MAX_TRIMMED`] ends inside one.
#[tokio::test]
async fn readers_from_the_front_skip_nothing_and_are_refused_only_after_a_removal_in_every_order() {
    let admin = format!("admin-{}", ObjectId::new().to_hex());
    let keys = parse_api_keys(&format!("admin:{admin}")).unwrap();
    let app = spawn_app_with(|s| s.api_keys = keys).await;
    let mut scopes: Vec<(Scope, String)> = vec![(None, admin.clone())];
    for tenant in TENANTS {
        let key = tenant_key(&app, &admin, tenant).await;
        let id = format!("{tenant}-template");
        made(
            &app,
            &key,
            "/accounts",
            json!({ "id": id, "balance": 0, "currency": "EUR" }),
        )
        .await;
        scopes.push((Some(tenant), key));
    }
    let db = app.store.database();
    let events = db.collection::<Document>("events");
    let recorder = db.collection::<Document>("eventRecorder");
    let templates: Vec<Document> = eventually(
        "the templates' events are recorded",
        WITHIN,
        POLL_EVERY,
        async || {
            let found: Vec<Document> = events
                .find(doc! { "account.tenant": { "$in": TENANTS.to_vec() } })
                .sort(doc! { "_id": 1 })
                .await
                .unwrap()
                .try_collect()
                .await
                .unwrap();
            (found.len() == TENANTS.len()).then_some(found)
        },
    )
    .await;
    // The lease is the test's: the instance's recorder stops at its next renewal, and
    // every write it could still make is guarded by the lease.
    recorder
        .update_one(
            doc! { "_id": "recorder" },
            doc! { "$set": {
                "owner": EXPLORER,
                "leaseUntil": bson::DateTime::from_chrono(chrono::Utc::now() + chrono::TimeDelta::hours(1)),
            } },
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;

    let first: u64 = std::env::var("FRONT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let runs: u64 = match std::env::var("FRONT_SEED") {
        Ok(_) => 1,
        Err(_) => std::env::var("FRONT_SEEDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(SEEDS),
    };
    eprintln!("FRONT_SEED={first} FRONT_SEEDS={runs}");
    for seed in first..first + runs {
        explore(&app, seed, &scopes, &templates).await;
    }
}

async fn explore(app: &TestApp, seed: u64, scopes: &[(Scope, String)], templates: &[Document]) {
    let mut rng = StdRng::seed_from_u64(seed);
    let db = app.store.database();
    let mut x = Explorer {
        app,
        seed,
        events: db.collection::<Document>("events"),
        recorder: db.collection::<Document>("eventRecorder"),
        model: Vec::new(),
        by_id: HashMap::new(),
        log: Vec::new(),
        fronts: Default::default(),
    };
    // A feed of its own: old events, then recent ones, in cluster times of one to
    // several hundred events.
    x.events.delete_many(doc! {}).await.unwrap();
    let old_share = rng.random_range(0.5..0.9);
    let (mut seconds, mut increment) = (1_700_000_000u64 + seed % 1000 * 1000, 1u64);
    while x.model.len() < EVENTS {
        let size = *[1, 1, 1, 2, 3, 5, 17, 60, 150, 400, 900]
            .choose(&mut rng)
            .unwrap();
        let old = (x.model.len() as f64) < old_share * EVENTS as f64;
        for _ in 0..size {
            let tenant = if !old && rng.random_bool(0.01) {
                Some("cusp")
            } else {
                *[Some("acme"), Some("bolt"), None].choose(&mut rng).unwrap()
            };
            let id = format!(
                "account.opened:{}-{seed}-{}",
                tenant.unwrap_or("lone"),
                x.model.len()
            );
            x.model.push(Ev {
                key: key(seconds, increment, &id),
                id,
                tenant,
                old,
            });
        }
        if rng.random_bool(0.3) {
            seconds += 1;
            increment = 1;
        } else {
            increment += 1;
        }
    }
    x.model.sort_by(|a, b| a.key.cmp(&b.key));
    x.by_id = x
        .model
        .iter()
        .enumerate()
        .map(|(i, e)| (e.id.clone(), i))
        .collect();
    // 2001-01-01, long past any retention.
    let long_ago = bson::DateTime::from_millis(978_307_200_000);
    let docs: Vec<Document> = x
        .model
        .iter()
        .map(|e| {
            let of = TENANTS
                .iter()
                .position(|t| Some(*t) == e.tenant)
                .unwrap_or(0);
            let mut d = templates[of].clone();
            let subject = e.id.strip_prefix("account.opened:").unwrap();
            let account = d.get_document_mut("account").unwrap();
            account.insert("_id", subject);
            match e.tenant {
                Some(t) => {
                    account.insert("tenant", t);
                }
                None => {
                    account.remove("tenant");
                }
            }
            d.insert("_id", &e.id);
            d.insert("key", &e.key);
            d.insert(
                "tenants",
                Bson::Array(e.tenant.iter().map(|t| Bson::from(*t)).collect()),
            );
            if e.old {
                d.insert("at", long_ago);
            }
            d
        })
        .collect();
    for chunk in docs.chunks(500) {
        x.events.insert_many(chunk.to_vec()).await.unwrap();
    }
    // How far the feed may be read: all of it; the start of a cluster time (a batch cut
    // there); or inside one (a batch that ended there, the rest of its time recorded
    // but not published yet).
    let cut = &x.model[rng.random_range(0..x.model.len())].key;
    let recorded = match rng.random_range(0..3) {
        0 => x.model.last().unwrap().key.clone(),
        1 => tick_of(cut).to_owned(),
        _ => cut.clone(),
    };
    x.recorder
        .update_one(
            doc! { "_id": "recorder" },
            doc! { "$set": { "recordedThrough": &recorded }, "$unset": { "trimmedThrough": "" } },
        )
        .await
        .unwrap();
    x.log.push(format!(
        "{} events, {} old, readable through {recorded}",
        x.model.len(),
        x.model.iter().filter(|e| e.old).count()
    ));

    let mut readers: Vec<Reader> = scopes
        .iter()
        .chain(scopes.iter())
        .map(|(scope, key)| Reader {
            scope: *scope,
            key: key.clone(),
            cursor: None,
            seen: Vec::new(),
        })
        .collect();
    let retention = Duration::from_secs(365 * 24 * 3600);
    for _ in 0..STEPS {
        match rng.random_range(0..20) {
            0..=2 => {
                let before = x.now().await;
                let removed = app
                    .store
                    .events()
                    .trim_events(EXPLORER, retention)
                    .await
                    .unwrap();
                x.log.push(format!("round: {removed} removed"));
                let after = x.now().await;
                // A round of this version moves the front to the end of a cluster time.
                if after.front != before.front && x.front_kind(&after, None).starts_with("inside") {
                    x.fail(format!(
                        "a round left the front inside a cluster time: {}",
                        after.front
                    ));
                }
            }
            3..=5 => {
                let count = *[1, 7, 350, MAX_TRIMMED as usize].choose(&mut rng).unwrap();
                x.older_round(count).await;
            }
            7 => {
                let end = x.model.last().unwrap().key.clone();
                x.recorder
                    .update_one(
                        doc! { "_id": "recorder" },
                        doc! { "$max": { "recordedThrough": &end } },
                    )
                    .await
                    .unwrap();
                x.log.push("everything readable".into());
            }
            8..=9 => {
                let r = rng.random_range(0..readers.len());
                readers[r].cursor = None;
                readers[r].seen.clear();
                x.log.push(format!("reader {r} starts again"));
            }
            _ => {
                let r = rng.random_range(0..readers.len());
                let limit = *[1, 3, 50, 400, 1000].choose(&mut rng).unwrap();
                let mut reader = std::mem::replace(
                    &mut readers[r],
                    Reader {
                        scope: None,
                        key: String::new(),
                        cursor: None,
                        seen: Vec::new(),
                    },
                );
                x.read(&mut reader, limit).await;
                readers[r] = reader;
            }
        }
    }
    // At the end, everything readable and removed as the retention says: every reader
    // reads to the end, and has then read every recent event it sees, once.
    let end = x.model.last().unwrap().key.clone();
    x.recorder
        .update_one(
            doc! { "_id": "recorder" },
            doc! { "$max": { "recordedThrough": &end } },
        )
        .await
        .unwrap();
    while app
        .store
        .events()
        .trim_events(EXPLORER, retention)
        .await
        .unwrap()
        > 0
    {}
    x.log
        .push("the end: everything readable and removed".into());
    eprintln!(
        "FRONT_SEED={seed}: reads without a cursor met {:?}",
        x.fronts
    );
    for reader in &mut readers {
        for _ in 0..10 {
            let before = reader.seen.len();
            x.read(reader, 1000).await;
            if reader.cursor.is_some() && reader.seen.len() == before {
                break;
            }
        }
        let seen: BTreeSet<&String> = reader.seen.iter().collect();
        let now = x.now().await;
        for e in x.model.iter().filter(|e| !e.old) {
            if Explorer::sees(reader.scope, e) && !seen.contains(&e.key) {
                x.fail(format!(
                    "{} never read {}, which is kept",
                    reader.scope.unwrap_or("platform"),
                    e.id
                ));
            }
            assert!(
                now.kept(e),
                "FRONT_SEED={seed}: a recent event was removed: {}",
                e.id
            );
        }
    }
}
