//! Accounts on several deployments (`DEPLOYMENTS`), each a database server of its own:
//! where accounts and transfers live, transfers across deployments and every answer they
//! can get, reads that span the deployments, readiness, metrics and migrations, and an
//! outage of one deployment under load.
//!
//! Invariants protected here: an account id exists on one deployment only; a transfer is
//! logged on its source's deployment and nowhere else; money moves across deployments
//! exactly as within one (the total over every deployment never changes, no marker is
//! left); an outage of one deployment stops only the transfers that touch its accounts,
//! and what it delayed finishes by itself once it is back.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{Daemon, TestApp, database_uris, fresh_database_name, spawn_app_with, values};
use transfer_service::config::{Deployment, Settings};
use transfer_service::domain::{
    AccountId, CancelReason, DeploymentName, Hold, Leg, Legs, Transfer, TransferId, TransferState,
};
use transfer_service::store::Store;
use transfer_service::store::accounts::Forward;
use transfer_service::store::transfers::Scan;

const NAMES: [&str; 3] = ["eu", "us", "cn"];

/// Three deployments over `uris`, one database name on each.
struct Books {
    database: String,
    uris: Vec<String>,
    /// A store per deployment, in `NAMES` order.
    stores: Vec<Store>,
}

impl Books {
    async fn new(uris: Vec<String>) -> Books {
        let database = fresh_database_name();
        let mut stores = Vec::new();
        for (name, uri) in NAMES.iter().zip(&uris) {
            let name = DeploymentName::parse(name).unwrap();
            stores.push(Store::connect_with(name, uri, &database, 2).await.unwrap());
        }
        Books {
            database,
            uris,
            stores,
        }
    }

    /// On the shared database servers of this test process.
    async fn shared() -> Books {
        Books::new(database_uris(3)).await
    }

    fn deployments(&self) -> Vec<Deployment> {
        NAMES
            .iter()
            .zip(&self.uris)
            .map(|(name, uri)| Deployment {
                name: DeploymentName::parse(name).unwrap(),
                uri: uri.clone(),
            })
            .collect()
    }

    /// An instance of the service over the three deployments.
    async fn app(&self) -> TestApp {
        self.app_with(|_| {}).await
    }

    /// [`Books::app`] with its settings adjusted by `adjust`.
    async fn app_with(&self, adjust: impl FnOnce(&mut Settings)) -> TestApp {
        let (deployments, database) = (self.deployments(), self.database.clone());
        spawn_app_with(move |s| {
            s.deployments = deployments;
            s.database = database;
            adjust(s);
        })
        .await
    }

    fn store(&self, deployment: &str) -> &Store {
        &self.stores[NAMES.iter().position(|n| *n == deployment).unwrap()]
    }

    /// The deployments that have account `id`.
    async fn homes_of(&self, id: &str) -> Vec<&'static str> {
        let mut homes = Vec::new();
        for (name, store) in NAMES.iter().zip(&self.stores) {
            if store
                .accounts()
                .account(&values::account(id))
                .await
                .unwrap()
                .is_some()
            {
                homes.push(*name);
            }
        }
        homes
    }

    /// The deployments whose log has transfer `id`.
    async fn logs_of(&self, id: &str) -> Vec<&'static str> {
        let mut logs = Vec::new();
        for (name, store) in NAMES.iter().zip(&self.stores) {
            if store
                .transfers()
                .transfer(values::transfer_id(id))
                .await
                .unwrap()
                .is_some()
            {
                logs.push(*name);
            }
        }
        logs
    }

    /// The balance of account `id`, wherever it lives.
    async fn balance(&self, id: &str) -> i64 {
        for store in &self.stores {
            if let Some(a) = store
                .accounts()
                .account(&values::account(id))
                .await
                .unwrap()
            {
                return a.balance;
            }
        }
        panic!("no account {id} anywhere")
    }

    /// Every balance on every deployment, and how many markers are left.
    async fn totals(&self) -> (i64, usize) {
        let (mut total, mut markers) = (0, 0);
        for store in &self.stores {
            for a in store
                .accounts()
                .list_accounts(None, None, 10_000)
                .await
                .unwrap()
            {
                total += a.balance;
                markers += a.pending_transactions.len();
            }
        }
        (total, markers)
    }
}

async fn open(app: &TestApp, id: &str, balance: i64, deployment: &str) {
    let response = app
        .post_json(
            "/accounts",
            json!({ "id": id, "balance": balance, "deployment": deployment }),
        )
        .await;
    assert_eq!(
        response.status(),
        201,
        "opening {id} on {deployment}: {}",
        response.text().await.unwrap()
    );
}

async fn status_and_json(response: reqwest::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn get(app: &TestApp, path: &str) -> (u16, Value) {
    status_and_json(app.get(path).await).await
}

async fn transfer(app: &TestApp, body: Value) -> (u16, Value) {
    status_and_json(app.post_json("/transfers", body).await).await
}

#[tokio::test]
async fn an_account_lives_on_the_deployment_named_at_opening_the_first_by_default() {
    let books = Books::shared().await;
    let app = books.app().await;
    open(&app, "us-1", 100, "us").await;
    open(&app, "cn-1", 100, "cn").await;
    let response = app.post_json("/accounts", json!({ "id": "eu-1" })).await;
    assert_eq!(response.status(), 201);

    for (id, home) in [("us-1", "us"), ("cn-1", "cn"), ("eu-1", "eu")] {
        assert_eq!(books.homes_of(id).await, [home], "{id}");
        let (status, body) = get(&app, &format!("/accounts/{id}")).await;
        assert_eq!((status, body["deployment"].as_str()), (200, Some(home)));
    }
}

#[tokio::test]
async fn an_unknown_or_malformed_deployment_is_refused_and_nothing_is_opened() {
    let books = Books::shared().await;
    let app = books.app().await;
    let (status, body) = status_and_json(
        app.post_json("/accounts", json!({ "id": "x", "deployment": "mars" }))
            .await,
    )
    .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["code"], "unknown_deployment");
    assert_eq!(body["field"], "deployment");
    let (status, body) = status_and_json(
        app.post_json("/accounts", json!({ "id": "x", "deployment": "EU" }))
            .await,
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (422, Some("invalid_field"))
    );
    assert_eq!(body["field"], "deployment");
    assert!(books.homes_of("x").await.is_empty());
    // Refused before the id was reserved: it can still be opened.
    open(&app, "x", 0, "us").await;
}

#[tokio::test]
async fn an_account_id_is_unique_across_deployments() {
    let books = Books::shared().await;
    let app = books.app().await;
    open(&app, "alice", 100, "us").await;
    for deployment in ["eu", "cn", "us"] {
        let (status, body) = status_and_json(
            app.post_json(
                "/accounts",
                json!({ "id": "alice", "deployment": deployment }),
            )
            .await,
        )
        .await;
        assert_eq!(
            (status, body["code"].as_str()),
            (409, Some("account_exists")),
            "{deployment}: {body}"
        );
    }
    assert_eq!(books.homes_of("alice").await, ["us"]);
    assert_eq!(books.balance("alice").await, 100);
}

/// Two instances open the same ids at the same moment, each on another deployment:
/// exactly one opening of each id wins, and the account exists only where it won.
#[tokio::test]
async fn two_instances_opening_one_id_on_two_deployments_at_once_make_one_account() {
    let books = Books::shared().await;
    let (first, second) = (books.app().await, books.app().await);
    let ids: Vec<String> = (0..20).map(|i| format!("racy-{i}")).collect();
    let attempts = ids.iter().flat_map(|id| {
        [(&first, id, "us"), (&second, id, "cn")].map(|(app, id, deployment)| async move {
            let response = app
                .post_json("/accounts", json!({ "id": id, "deployment": deployment }))
                .await;
            (id.clone(), deployment, response.status().as_u16())
        })
    });
    let answers = futures::future::join_all(attempts).await;
    for id in &ids {
        let won: Vec<_> = answers
            .iter()
            .filter(|(i, _, status)| i == id && *status == 201)
            .collect();
        assert_eq!(won.len(), 1, "{id}: {answers:?}");
        let lost = answers
            .iter()
            .find(|(i, _, status)| i == id && *status != 201)
            .unwrap();
        assert_eq!(lost.2, 409, "{lost:?}");
        assert_eq!(books.homes_of(id).await, [won[0].1], "{id}");
    }
}

/// An instance that died between reserving an id and writing its account leaves the id
/// to that deployment: opening it there completes it, elsewhere it is taken.
#[tokio::test]
async fn an_id_reserved_by_an_opening_that_died_can_be_opened_on_its_deployment_only() {
    let books = Books::shared().await;
    let app = books.app().await;
    let deployments = transfer_service::store::Deployments::new(books.stores.clone());
    let reserved = deployments
        .reserve_account_id(
            &values::account("orphan"),
            &DeploymentName::parse("cn").unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(
        reserved,
        transfer_service::store::deployments::Reservation::Reserved
    );
    let (status, _) = status_and_json(
        app.post_json("/accounts", json!({ "id": "orphan", "deployment": "us" }))
            .await,
    )
    .await;
    assert_eq!(status, 409);
    open(&app, "orphan", 5, "cn").await;
    assert_eq!(books.homes_of("orphan").await, ["cn"]);
}

#[tokio::test]
async fn a_transfer_across_deployments_moves_the_money_and_is_logged_with_its_source() {
    let books = Books::shared().await;
    let app = books.app().await;
    open(&app, "alice", 1_000, "us").await;
    open(&app, "bob", 0, "cn").await;
    let (status, body) = transfer(
        &app,
        json!({ "source": "alice", "destination": "bob", "amount": 300 }),
    )
    .await;
    assert_eq!(
        (status, body["state"].as_str()),
        (201, Some("done")),
        "{body}"
    );
    let id = body["id"].as_str().unwrap();
    assert_eq!(books.logs_of(id).await, ["us"]);
    let logged = books
        .store("us")
        .transfers()
        .transfer(values::transfer_id(id))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(logged.destination_deployment.as_str(), "cn");
    assert_eq!(
        (books.balance("alice").await, books.balance("bob").await),
        (700, 300)
    );
    assert_eq!(books.totals().await, (1_000, 0));
    let (status, read) = get(&app, &format!("/transfers/{id}")).await;
    assert_eq!((status, read["state"].as_str()), (200, Some("done")));
}

#[tokio::test]
async fn a_transfer_across_deployments_gets_every_answer_one_within_a_deployment_gets() {
    let books = Books::shared().await;
    let app = books.app().await;
    open(&app, "alice", 500, "eu").await;
    open(&app, "bob", 0, "us").await;
    let response = app
        .post_json(
            "/accounts",
            json!({ "id": "euro", "currency": "EUR", "deployment": "cn" }),
        )
        .await;
    assert_eq!(response.status(), 201);

    // Insufficient funds: recorded on the source's log, canceled, nothing moved.
    let (status, body) = transfer(
        &app,
        json!({ "source": "alice", "destination": "bob", "amount": 900 }),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (422, Some("insufficient_funds")),
        "{body}"
    );
    let canceled = body["transferId"].as_str().unwrap();
    assert_eq!(books.logs_of(canceled).await, ["eu"]);
    let (_, read) = get(&app, &format!("/transfers/{canceled}")).await;
    assert_eq!(read["state"], "canceled");
    assert_eq!(read["reason"], "insufficient_funds");

    // Currency mismatch and an unknown account: refused before anything is recorded.
    let (status, body) = transfer(
        &app,
        json!({ "source": "alice", "destination": "euro", "amount": 1 }),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (422, Some("currency_mismatch"))
    );
    let (status, body) = transfer(
        &app,
        json!({ "source": "alice", "destination": "nobody", "amount": 1 }),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (422, Some("unknown_account"))
    );

    // Idempotency: a replay answers the same transfer; the key with another body is
    // refused.
    let keyed = |amount: i64| {
        app.http
            .post(app.url("/transfers"))
            .header("Idempotency-Key", "order-7")
            .json(&json!({ "source": "alice", "destination": "bob", "amount": amount }))
            .send()
    };
    let (status, first) = status_and_json(keyed(100).await.unwrap()).await;
    assert_eq!(status, 201, "{first}");
    let (status, again) = status_and_json(keyed(100).await.unwrap()).await;
    assert_eq!((status, &again["id"]), (201, &first["id"]), "{again}");
    let (status, reused) = status_and_json(keyed(101).await.unwrap()).await;
    assert_eq!(
        (status, reused["code"].as_str()),
        (422, Some("idempotency_key_reused"))
    );
    assert_eq!(books.balance("bob").await, 100);

    // Cancel of a done transfer: reversed by a transfer logged on the destination's.
    let id = first["id"].as_str().unwrap();
    let (status, reversed) = status_and_json(
        app.post_json(&format!("/transfers/{id}/cancel"), json!({}))
            .await,
    )
    .await;
    assert_eq!(status, 200, "{reversed}");
    let reversal = reversed["reversedBy"].as_str().unwrap();
    assert_eq!(books.logs_of(reversal).await, ["us"]);
    assert_eq!(
        (books.balance("alice").await, books.balance("bob").await),
        (500, 0)
    );
    assert_eq!(books.totals().await, (500, 0));
}

#[tokio::test]
async fn a_hold_across_deployments_reserves_and_is_captured_or_voided() {
    let books = Books::shared().await;
    let app = books.app().await;
    open(&app, "alice", 1_000, "cn").await;
    open(&app, "bob", 0, "eu").await;
    let hold = |amount: i64| {
        transfer(
            &app,
            json!({ "source": "alice", "destination": "bob", "amount": amount, "hold": {} }),
        )
    };
    let (status, captured) = hold(400).await;
    assert_eq!(
        (status, captured["state"].as_str()),
        (201, Some("held")),
        "{captured}"
    );
    let (status, voided) = hold(300).await;
    assert_eq!(status, 201, "{voided}");
    let (_, alice) = get(&app, "/accounts/alice").await;
    assert_eq!(
        (
            alice["pendingDebits"].as_i64(),
            alice["availableBalance"].as_i64()
        ),
        (Some(700), Some(300))
    );
    let (_, bob) = get(&app, "/accounts/bob").await;
    assert_eq!(bob["pendingCredits"].as_i64(), Some(700));

    let id = captured["id"].as_str().unwrap();
    let (status, done) = status_and_json(
        app.post_json(
            &format!("/transfers/{id}/capture"),
            json!({ "amount": 250 }),
        )
        .await,
    )
    .await;
    assert_eq!(
        (status, done["state"].as_str()),
        (200, Some("done")),
        "{done}"
    );
    let id = voided["id"].as_str().unwrap();
    let (status, canceled) = status_and_json(
        app.post_json(&format!("/transfers/{id}/void"), json!({}))
            .await,
    )
    .await;
    assert_eq!((status, canceled["reason"].as_str()), (200, Some("voided")));
    assert_eq!(
        (books.balance("alice").await, books.balance("bob").await),
        (750, 250)
    );
    for (who, deployment) in [("alice", "cn"), ("bob", "eu")] {
        let a = books
            .store(deployment)
            .accounts()
            .account(&values::account(who))
            .await
            .unwrap()
            .unwrap();
        assert_eq!((a.pending_debits, a.pending_credits), (0, 0), "{who}");
    }
    assert_eq!(books.totals().await, (1_000, 0));
}

/// Follows `next` (as `after`) from `path` with pages of `limit`; every item's `key`.
async fn walk(app: &TestApp, path: &str, limit: u32, key: &str) -> Vec<String> {
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let separator = if path.contains('?') { '&' } else { '?' };
        let mut url = format!("{path}{separator}limit={limit}");
        if let Some(a) = &after {
            url.push_str(&format!("&after={a}"));
        }
        let (status, page) = get(app, &url).await;
        assert_eq!(status, 200, "{url}: {page}");
        let items = page["items"].as_array().unwrap();
        assert!(items.len() <= limit as usize);
        seen.extend(items.iter().map(|i| i[key].as_str().unwrap().to_owned()));
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => return seen,
        }
    }
}

#[tokio::test]
async fn listings_merge_every_deployment_and_their_pages_miss_and_repeat_nothing() {
    let books = Books::shared().await;
    let app = books.app().await;
    let accounts = [
        ("a1", "eu"),
        ("b1", "us"),
        ("c1", "cn"),
        ("a2", "cn"),
        ("b2", "eu"),
        ("c2", "us"),
    ];
    for (id, deployment) in accounts {
        open(&app, id, 1_000, deployment).await;
    }
    let mut made = Vec::new();
    for (i, (source, destination)) in [
        ("a1", "b1"),
        ("b1", "c1"),
        ("c1", "a1"),
        ("a2", "b2"),
        ("b2", "a1"),
        ("c2", "c1"),
        ("a1", "c2"),
    ]
    .into_iter()
    .enumerate()
    {
        let (status, body) = transfer(
            &app,
            json!({ "source": source, "destination": destination, "amount": 10 + i as i64 }),
        )
        .await;
        assert_eq!(status, 201, "{body}");
        made.push(body["id"].as_str().unwrap().to_owned());
    }
    // Newest first, across the three logs, with pages smaller than each log.
    let listed = walk(&app, "/transfers", 2, "id").await;
    let mut newest_first = made.clone();
    newest_first.reverse();
    assert_eq!(listed, newest_first);
    // Accounts in id order across the three deployments.
    let ids = walk(&app, "/accounts", 4, "id").await;
    assert_eq!(ids, ["a1", "a2", "b1", "b2", "c1", "c2"]);
    // An account's history: transfers out (its own log) and in (other logs).
    let history = walk(&app, "/accounts/a1/transfers", 1, "id").await;
    let expected: Vec<String> = [6, 4, 2, 0].iter().map(|i| made[*i].clone()).collect();
    assert_eq!(history, expected);
}

#[tokio::test]
async fn every_deployment_is_migrated_and_its_database_commands_are_labelled_with_it() {
    let books = Books::shared().await;
    let app = books.app().await;
    open(&app, "m", 1, "cn").await;
    for store in &books.stores {
        let recorded: Vec<String> = store
            .database()
            .collection::<mongodb::bson::Document>("migrations")
            .distinct("_id", mongodb::bson::doc! {})
            .await
            .unwrap()
            .into_iter()
            .filter_map(|b| b.as_str().map(str::to_owned))
            .collect();
        assert!(
            recorded.iter().any(|m| m == "0006_deployments"),
            "{}: {recorded:?}",
            store.deployment()
        );
    }
    let metrics = app.get("/metrics").await.text().await.unwrap();
    for name in NAMES {
        assert!(
            metrics.contains(&format!(
                "db_operation_duration_seconds_count{{deployment=\"{name}\""
            )),
            "{name}: {metrics}"
        );
    }
}

/// Three deployments on daemons of this test's own, so that it can kill one.
struct OwnDaemons {
    daemons: Vec<Daemon>,
    folders: Vec<tempfile::TempDir>,
}

impl OwnDaemons {
    fn start() -> OwnDaemons {
        let folders: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
        let daemons = folders
            .iter()
            .map(|f| Daemon::start(f.path().to_path_buf(), 0))
            .collect();
        OwnDaemons { daemons, folders }
    }

    fn uris(&self) -> Vec<String> {
        self.daemons.iter().map(|d| d.uri.clone()).collect()
    }
}

/// What the load saw, by the deployments its transfer touched (any account of a
/// multi-leg transfer's).
#[derive(Debug, Default)]
struct Seen {
    /// (touches the killed deployment, answered while it was down, status) per answer.
    answers: Vec<(bool, bool, u16)>,
    ids: HashSet<String>,
}

#[tokio::test]
async fn an_outage_of_one_deployment_stops_only_its_transfers_and_all_finish_after_it() {
    let mut daemons = OwnDaemons::start();
    let books = Books::new(daemons.uris()).await;
    let app = books.app().await;
    let accounts = [
        ("eu-a", "eu"),
        ("eu-b", "eu"),
        ("us-a", "us"),
        ("us-b", "us"),
        ("cn-a", "cn"),
        ("cn-b", "cn"),
    ];
    for (id, deployment) in accounts {
        open(&app, id, 1_000_000, deployment).await;
    }
    let down = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop = tokio_util::sync::CancellationToken::new();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Seen::default()));
    let mut clients = Vec::new();
    for client in 0..6 {
        let (http, url) = (app.http.clone(), app.url("/transfers"));
        let (down, stop, seen) = (down.clone(), stop.clone(), seen.clone());
        clients.push(tokio::spawn(async move {
            let mut n = client;
            while !stop.is_cancelled() {
                n += 7;
                let (source, destination) = (accounts[n % 6].0, accounts[(n / 6 + n + 1) % 6].0);
                if source == destination {
                    continue;
                }
                let amount = 1 + n as i64 % 50;
                // Every third a multi-leg transfer: on to a third account (`docs/legs.md`),
                // which an outage stops only if one of its three accounts is there.
                let third = accounts[(n / 3 + 2) % 6].0;
                let legs = n % 3 == 0 && third != source && third != destination;
                let mut touching = vec![source, destination];
                let body = if legs {
                    touching.push(third);
                    json!({ "legs": [
                        { "source": source, "destination": destination, "amount": amount },
                        { "source": destination, "destination": third, "amount": amount },
                    ] })
                } else {
                    json!({ "source": source, "destination": destination, "amount": amount })
                };
                let touches = touching.iter().any(|a| a.starts_with("cn"));
                let during = down.load(std::sync::atomic::Ordering::SeqCst);
                let answer = http.post(&url).json(&body).send().await;
                let Ok(answer) = answer else { continue };
                let status = answer.status().as_u16();
                let body: Value = answer.json().await.unwrap_or(Value::Null);
                let mut seen = seen.lock().unwrap();
                seen.answers.push((touches, during, status));
                if let Some(id) = body["id"].as_str().or(body["transferId"].as_str()) {
                    seen.ids.insert(id.to_owned());
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    // cn goes away: kill -9, and it stays down for a while.
    let port = daemons.daemons[2].port;
    daemons.daemons[2].kill();
    down.store(true, std::sync::atomic::Ordering::SeqCst);
    let (status, ready) = get(&app, "/ready").await;
    assert_eq!(status, 200, "{ready}");
    assert_eq!(ready["status"], "degraded");
    assert_eq!(ready["unavailableDeployments"], json!(["cn"]));
    // Long enough that the requests caught by the kill (each waits out the driver's
    // server selection, up to 3 s, before the watch marks cn down and refuses the rest
    // at once) leave the clients several seconds of transfers elsewhere: with 5 s, a
    // machine whose disk flushes slowly saw none in some runs.
    tokio::time::sleep(Duration::from_secs(10)).await;
    down.store(false, std::sync::atomic::Ordering::SeqCst);
    daemons.daemons[2] = Daemon::start(daemons.folders[2].path().to_path_buf(), port);
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.cancel();
    for c in clients {
        c.await.unwrap();
    }

    let seen = std::mem::take(&mut *seen.lock().unwrap());
    let elsewhere: Vec<u16> = seen
        .answers
        .iter()
        .filter(|(touches, during, _)| !touches && *during)
        .map(|a| a.2)
        .collect();
    assert!(
        elsewhere.len() >= 10,
        "too few transfers between eu and us while cn was down: {elsewhere:?}"
    );
    assert!(
        elsewhere.iter().all(|s| *s == 201),
        "a transfer between eu and us failed while cn was down: {elsewhere:?}"
    );
    let touched: Vec<u16> = seen
        .answers
        .iter()
        .filter(|(touches, during, _)| *touches && *during)
        .map(|a| a.2)
        .collect();
    assert!(
        touched.iter().all(|s| [201, 503].contains(s)),
        "a transfer touching cn got {touched:?}"
    );
    assert!(
        touched.contains(&503),
        "no transfer touching cn was refused: {touched:?}"
    );
    eprintln!(
        "while cn was down: {} transfers between eu and us (all 201), {} touching cn ({} refused 503)",
        elsewhere.len(),
        touched.len(),
        touched.iter().filter(|s| **s == 503).count()
    );

    // Once cn is back, everything it delayed finishes by itself.
    let (status, ready) = get(&app, "/ready").await;
    assert_eq!(
        (status, ready["status"].as_str()),
        (200, Some("ok")),
        "{ready}"
    );
    let (within, every) = (Duration::from_secs(30), Duration::from_millis(200));
    support::poll_until(within, every, async || {
        let mut unfinished = Vec::new();
        for store in &books.stores {
            for t in store
                .transfers()
                .list_transfers(&Default::default(), 100_000)
                .await
                .unwrap()
            {
                if !t.state.is_terminal() {
                    unfinished.push((t.id, t.state));
                }
            }
        }
        if unfinished.is_empty() {
            Ok(())
        } else {
            Err(unfinished)
        }
    })
    .await
    .unwrap_or_else(|unfinished| panic!("still unfinished after cn came back: {unfinished:?}"));
    assert_eq!(books.totals().await, (6_000_000, 0));
    // Every transfer a client was told about is logged exactly once, on its source's.
    for id in &seen.ids {
        let logs = books.logs_of(id).await;
        assert_eq!(logs.len(), 1, "{id}: {logs:?}");
    }
    let done: usize = {
        let mut n = 0;
        for store in &books.stores {
            n += store
                .transfers()
                .list_transfers(&Default::default(), 100_000)
                .await
                .unwrap()
                .iter()
                .filter(|t| t.state == TransferState::Done)
                .count();
        }
        n
    };
    assert!(done > 0);
}

/// An instance started while one deployment is down serves the others at once, and takes
/// the missing one in (migrations first) once it answers.
#[tokio::test]
async fn an_instance_started_while_a_deployment_is_down_serves_the_others_and_takes_it_in_later() {
    let eu = database_uris(1).remove(0);
    let port = support::process::free_port();
    let folder = tempfile::tempdir().unwrap();
    let us = format!("mongodb://127.0.0.1:{port}/?directConnection=true");
    let database = fresh_database_name();
    let deployments = vec![
        Deployment {
            name: DeploymentName::parse("eu").unwrap(),
            uri: eu,
        },
        Deployment {
            name: DeploymentName::parse("us").unwrap(),
            uri: us.clone(),
        },
    ];
    // With the default patience (60 s): once eu is migrated, us is waited for a few
    // seconds more, not for the whole patience.
    let building = Instant::now();
    let app = spawn_app_with(move |s| {
        s.deployments = deployments;
        s.database = database;
    })
    .await;
    let took = building.elapsed();
    assert!(
        took < Duration::from_secs(20),
        "the instance waited {took:?} for the deployment that is down"
    );
    let (status, ready) = get(&app, "/ready").await;
    assert_eq!(
        (status, ready["status"].as_str()),
        (200, Some("degraded")),
        "{ready}"
    );
    assert_eq!(ready["unavailableDeployments"], json!(["us"]));
    open(&app, "here", 100, "eu").await;
    open(&app, "there", 100, "eu").await;
    let (status, body) = transfer(
        &app,
        json!({ "source": "here", "destination": "there", "amount": 10 }),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = status_and_json(
        app.post_json("/accounts", json!({ "id": "far", "deployment": "us" }))
            .await,
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("database_unavailable")),
        "{body}"
    );

    let _daemon = Daemon::start(folder.path().to_path_buf(), port);
    let (within, every) = (Duration::from_secs(30), Duration::from_millis(200));
    support::poll_until(within, every, async || {
        let (status, ready) = get(&app, "/ready").await;
        if status == 200 && ready["status"] == "ok" {
            Ok(())
        } else {
            Err(ready)
        }
    })
    .await
    .unwrap_or_else(|ready| panic!("us never taken in: {ready}"));
    open(&app, "far", 0, "us").await;
    let (status, body) = transfer(
        &app,
        json!({ "source": "here", "destination": "far", "amount": 5 }),
    )
    .await;
    assert_eq!(
        (status, body["state"].as_str()),
        (201, Some("done")),
        "{body}"
    );
    let store = Store::connect_with(DeploymentName::parse("us").unwrap(), &us, &app.database, 2)
        .await
        .unwrap();
    let migrations = store
        .database()
        .collection::<mongodb::bson::Document>("migrations")
        .count_documents(mongodb::bson::doc! {})
        .await
        .unwrap();
    assert_eq!(
        migrations as usize,
        transfer_service::store::migrations::MIGRATIONS.len()
    );
}

/// An account a version before the directory opened on the first deployment after the
/// directory's migration ran (a rolling upgrade) has no directory entry: the same id is
/// still refused on another deployment.
#[tokio::test]
async fn an_account_opened_by_an_older_version_cannot_be_opened_again_on_another_deployment() {
    let books = Books::shared().await;
    let app = books.app().await;
    open(&app, "carol", 500, "eu").await;
    // What an older version leaves: the account, and no directory entry.
    books
        .store("eu")
        .database()
        .collection::<mongodb::bson::Document>("accountDirectory")
        .delete_one(mongodb::bson::doc! { "_id": "carol" })
        .await
        .unwrap();
    let (status, body) = status_and_json(
        app.post_json("/accounts", json!({ "id": "carol", "deployment": "us" }))
            .await,
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("account_exists")),
        "{body}"
    );
    assert_eq!(books.homes_of("carol").await, ["eu"]);
}

/// While one deployment is down and the watch knows it, `/ready` and the listings answer
/// at once instead of after the driver's time-out (3 s), so a readiness probe with a
/// short time-out (Kubernetes': 1 s) does not take every instance out.
#[tokio::test]
async fn with_a_deployment_known_down_ready_and_listings_answer_without_waiting_for_it() {
    let mut daemons = OwnDaemons::start();
    let books = Books::new(daemons.uris()).await;
    let app = books.app().await;
    open(&app, "x", 5, "eu").await;
    daemons.daemons[1].kill();
    // The watch marks it within a ping's limit (2 s) and an interval (0.5 s).
    tokio::time::sleep(Duration::from_secs(4)).await;
    for path in ["/ready", "/accounts", "/transfers"] {
        let asked = Instant::now();
        let (status, body) = get(&app, path).await;
        let took = asked.elapsed();
        assert!(
            took < Duration::from_secs(2),
            "{path} answered {status} after {took:?}: {body}"
        );
        let expected = if path == "/ready" { 200 } else { 503 };
        assert_eq!(status, expected, "{path}: {body}");
    }
}

/// The watch runs from two deployments on: with two, one down must not hold up the
/// other's requests behind its time-outs (with one there is nothing else to keep going).
#[tokio::test]
async fn with_two_deployments_the_watch_finds_the_one_that_stops_answering() {
    use transfer_service::store::Deployments;
    let mut daemons = OwnDaemons::start();
    let books = Books::new(daemons.uris()).await;
    let two = Deployments::new(books.stores[..2].to_vec());
    let stop = tokio_util::sync::CancellationToken::new();
    let watching = tokio::spawn({
        let (two, stop) = (two.clone(), stop.clone());
        async move { two.watch(Duration::from_millis(200), stop).await }
    });
    daemons.daemons[1].kill();
    let (within, every) = (Duration::from_secs(20), Duration::from_millis(100));
    support::poll_until(within, every, async || {
        let silent: Vec<String> = two.silent().iter().map(|d| d.to_string()).collect();
        if silent == ["us"] {
            Ok(())
        } else {
            Err(silent)
        }
    })
    .await
    .unwrap_or_else(|silent| panic!("the watch never found us down: {silent:?}"));
    stop.cancel();
    watching.await.unwrap();
}

/// Waits until `/ready` names `deployment` among those that do not answer (its own ping
/// failed, or the watch found it silent).
async fn wait_until_known_down(app: &TestApp, deployment: &str) {
    let (within, every) = (Duration::from_secs(20), Duration::from_millis(100));
    support::poll_until(within, every, async || {
        let (_, ready) = get(app, "/ready").await;
        if ready["unavailableDeployments"] == json!([deployment]) {
            Ok(())
        } else {
            Err(ready)
        }
    })
    .await
    .unwrap_or_else(|ready| panic!("{deployment} never found down: {ready}"));
}

/// Sets `lastModified` of transfer `id` on `log` to `ago_ms` before `log`'s clock, as if
/// its owner had been silent that long. Safe here: that owner is gone, nothing of it is in
/// flight.
async fn age_on(log: &Store, id: TransferId, ago_ms: i64) {
    let now = log.server_time().await.unwrap();
    let then = mongodb::bson::DateTime::from_chrono(values::after(now, -ago_ms));
    log.database()
        .collection::<mongodb::bson::Document>("transactions")
        .update_one(
            mongodb::bson::doc! { "_id": mongodb::bson::oid::ObjectId::from_bytes(id.bytes()) },
            mongodb::bson::doc! { "$set": { "lastModified": then } },
        )
        .await
        .unwrap();
}

/// What an instance killed in the middle of `transfer` leaves on `log`, the log of its
/// source: the transfer `pending`, owned by the dead process, its lease lapsed `ago_ms`
/// ago; with `debited`, the source's debit landed before the kill.
async fn left_by_a_killed_instance(
    log: &Store,
    mut transfer: Transfer,
    destination_deployment: &str,
    debited: bool,
    ago_ms: i64,
) -> TransferId {
    transfer.source_deployment = log.deployment().clone();
    transfer.destination_deployment = DeploymentName::parse(destination_deployment).unwrap();
    transfer.state = TransferState::Pending;
    transfer.owner = Some("killed/00000000".into());
    log.transfers().insert_transfer(&transfer).await.unwrap();
    if debited {
        let deadline = values::after(log.server_time().await.unwrap(), 10_000);
        let step = log
            .accounts()
            .forward(
                Forward::Debit,
                &transfer.source,
                transfer.id,
                transfer.amount,
                deadline,
            )
            .await
            .unwrap();
        assert!(step.applied);
    }
    age_on(log, transfer.id, ago_ms).await;
    transfer.id
}

/// The sweeper never starves behind what it cannot drive: more than a page (100) of stale
/// transfers to a deployment that is down, left older than a stale transfer between two
/// that answer, do not keep the latter from being recovered while the outage lasts (it
/// waited for the outage's end: the oldest page was all transfers to the silent one,
/// skipped and never claimed, on every pass).
#[tokio::test]
async fn a_transfer_between_answering_deployments_is_recovered_behind_a_page_of_stale_ones_to_a_silent_one()
 {
    let mut daemons = OwnDaemons::start();
    let books = Books::new(daemons.uris()).await;
    {
        let first = books.app().await;
        open(&first, "eu-a", 1_000, "eu").await;
        open(&first, "us-a", 0, "us").await;
        open(&first, "cn-a", 0, "cn").await;
    }
    daemons.daemons[2].kill();

    let eu = books.store("eu");
    // A burst to cn that cn's outage left unfinished, a minute ago: a page and a half.
    let to_cn: Vec<_> = (0..150)
        .map(|_| {
            left_by_a_killed_instance(eu, values::initial("eu-a", "cn-a", 1), "cn", false, 60_000)
        })
        .collect();
    futures::future::join_all(to_cn).await;
    // Then an instance was killed right after debiting a transfer to us.
    let to_us =
        left_by_a_killed_instance(eu, values::initial("eu-a", "us-a", 5), "us", true, 30_000).await;
    // A fresh instance serves, cn down from its start: known down from the start (a
    // running instance's watch may take a few seconds to find it silent, and meanwhile
    // claim and start transfers to it).
    let app = books.app().await;

    // The sweeper (every 0.1 s, leases of 1 s) takes it over within a few leases.
    let (within, every) = (Duration::from_secs(10), Duration::from_millis(100));
    support::poll_until(within, every, async || {
        let (status, body) = get(&app, &format!("/transfers/{to_us}")).await;
        assert_eq!(status, 200, "{body}");
        if body["state"] == "done" {
            Ok(())
        } else {
            Err(body)
        }
    })
    .await
    .unwrap_or_else(|body| {
        panic!(
            "the transfer between eu and us is still {} while cn is down",
            body["state"]
        )
    });
    assert_eq!(books.balance("us-a").await, 5);
    assert_eq!(books.balance("eu-a").await, 995);
    let waiting = eu
        .transfers()
        .list_transfers(&Default::default(), 1_000)
        .await
        .unwrap()
        .into_iter()
        .filter(|t| t.state == TransferState::Pending)
        .count();
    assert_eq!(waiting, 150, "the transfers to cn wait for it");
}

/// A hold of 100 from alice to bob expiring in `expires_in_ms`, `held`: its id.
async fn hold_from_alice_to_bob(app: &TestApp, expires_in_ms: u64) -> TransferId {
    let (status, hold) = transfer(
        app,
        json!({ "source": "alice", "destination": "bob", "amount": 100, "hold": { "expiresInMs": expires_in_ms } }),
    )
    .await;
    assert_eq!(
        (status, hold["state"].as_str()),
        (201, Some("held")),
        "{hold}"
    );
    values::transfer_id(hold["id"].as_str().unwrap())
}

/// Reads call the money of a hold past its `expiresAt` available (`docs/holds.md`):
/// here it must be spendable while the hold's release waits for the deployment of its
/// destination, which is down. With `sweeping`, the sweeper expired the hold first
/// (`held -> canceling`, reason `expired`), and its release stopped at the destination;
/// without, the hold is still `held` and the debit expires it on the spot.
async fn the_money_of_a_hold_expired_while_its_destination_is_down_is_spendable(sweeping: bool) {
    let mut daemons = OwnDaemons::start();
    let books = Books::new(daemons.uris()).await;
    let app = books
        .app_with(|s| {
            if !sweeping {
                // One pass at start-up, none during the test.
                s.sweep_interval = Duration::from_secs(3600);
            }
        })
        .await;
    open(&app, "alice", 100, "eu").await;
    open(&app, "carol", 0, "eu").await;
    open(&app, "bob", 0, "cn").await;
    let hold = hold_from_alice_to_bob(&app, 2000).await;
    let port = daemons.daemons[2].port;
    daemons.daemons[2].kill();
    wait_until_known_down(&app, "cn").await;

    // Past its expiry, and (with the sweeper) expired in the log.
    let eu = books.store("eu");
    let expected = if sweeping {
        TransferState::Canceling
    } else {
        TransferState::Held
    };
    let (within, every) = (Duration::from_secs(15), Duration::from_millis(100));
    support::poll_until(within, every, async || {
        let stored = eu.transfers().transfer(hold).await.unwrap().unwrap();
        let now = eu.server_time().await.unwrap();
        let expires_at = stored.hold.unwrap().expires_at;
        if stored.state == expected && now > values::after(expires_at, 500) {
            Ok(())
        } else {
            Err((stored.state, now, expires_at))
        }
    })
    .await
    .unwrap_or_else(|(state, now, expires_at)| {
        panic!("the hold is {state} at {now}, expiring at {expires_at}")
    });
    if sweeping {
        // The sweeper's release of the hold freed the source first, before it stopped at
        // the destination.
        let (within, every) = (Duration::from_secs(5), Duration::from_millis(100));
        let what = "the expired hold still reserves alice's money";
        support::eventually(what, within, every, async || {
            let alice = eu
                .accounts()
                .account(&values::account("alice"))
                .await
                .unwrap();
            (alice.unwrap().pending_debits == 0).then_some(())
        })
        .await;
    }
    let (_, alice) = get(&app, "/accounts/alice").await;
    assert_eq!(alice["availableBalance"].as_i64(), Some(100), "{alice}");

    let (status, spent) = transfer(
        &app,
        json!({ "source": "alice", "destination": "carol", "amount": 100 }),
    )
    .await;
    assert_eq!(
        (status, spent["state"].as_str()),
        (201, Some("done")),
        "the money shown available was refused: {spent}"
    );

    // Once cn is back, the hold's release finishes and nothing is left reserved (by a
    // sweeper: this instance's, or with it not sweeping, another's).
    daemons.daemons[2] = Daemon::start(daemons.folders[2].path().to_path_buf(), port);
    let _sweeping = match sweeping {
        true => None,
        false => Some(books.app().await),
    };
    let (within, every) = (Duration::from_secs(30), Duration::from_millis(200));
    let stored = support::poll_until(within, every, async || {
        let stored = eu.transfers().transfer(hold).await.unwrap().unwrap();
        if stored.state == TransferState::Canceled {
            Ok(stored)
        } else {
            Err(stored.state)
        }
    })
    .await
    .unwrap_or_else(|state| panic!("the hold is still {state} after cn came back"));
    assert_eq!(stored.reason, Some(CancelReason::Expired));
    let at_rest = [("alice", "eu", 0), ("carol", "eu", 100), ("bob", "cn", 0)];
    assert_at_rest(&books, &at_rest).await;
}

#[tokio::test]
async fn the_money_of_a_hold_the_sweeper_expired_while_its_destination_is_down_is_spendable() {
    the_money_of_a_hold_expired_while_its_destination_is_down_is_spendable(true).await;
}

#[tokio::test]
async fn the_money_of_a_hold_expired_by_the_debit_while_its_destination_is_down_is_spendable() {
    the_money_of_a_hold_expired_while_its_destination_is_down_is_spendable(false).await;
}

/// The instance that expired a hold was killed before it released anything, while the
/// deployment of the hold's destination is down: nobody may drive the hold on (its lease
/// is fresh, and the sweeper cannot reach the destination), yet reads call its money
/// available, and a debit spends it: the source's release is guarded by the marker alone
/// and no copy of a reservation is in flight after `held`, so the debit may make it.
#[tokio::test]
async fn the_money_of_an_expired_hold_whose_expirer_was_killed_is_spendable_while_its_destination_is_down()
 {
    let mut daemons = OwnDaemons::start();
    let books = Books::new(daemons.uris()).await;
    // A lease far longer than the test: only the debit may release the hold's source.
    let app = books
        .app_with(|s| s.stale_after = Duration::from_secs(600))
        .await;
    open(&app, "alice", 100, "eu").await;
    open(&app, "carol", 0, "eu").await;
    open(&app, "bob", 0, "cn").await;
    let (eu, cn) = (books.store("eu"), books.store("cn"));
    // What the killed expirer left: the hold `canceling` (expired), both reservations in
    // place, its lease fresh.
    let mut hold = values::initial("alice", "bob", 100);
    hold.source_deployment = eu.deployment().clone();
    hold.destination_deployment = cn.deployment().clone();
    hold.hold = Some(Hold {
        amount: values::amount(100),
        expires_at: values::after(eu.server_time().await.unwrap(), -1_000),
    });
    let deadline = |now| values::after(now, 10_000);
    for (store, account, kind) in [
        (eu, "alice", Forward::ReserveOut),
        (cn, "bob", Forward::ReserveIn),
    ] {
        let step = store
            .accounts()
            .forward(
                kind,
                &values::account(account),
                hold.id,
                values::amount(100),
                deadline(store.server_time().await.unwrap()),
            )
            .await
            .unwrap();
        assert!(step.applied);
    }
    hold.state = TransferState::Canceling;
    hold.reason = Some(CancelReason::Expired);
    hold.owner = Some("killed/00000000".into());
    daemons.daemons[2].kill();
    wait_until_known_down(&app, "cn").await;
    eu.transfers().insert_transfer(&hold).await.unwrap();

    let (_, alice) = get(&app, "/accounts/alice").await;
    assert_eq!(alice["availableBalance"].as_i64(), Some(100), "{alice}");
    let (status, spent) = transfer(
        &app,
        json!({ "source": "alice", "destination": "carol", "amount": 100 }),
    )
    .await;
    assert_eq!(
        (status, spent["state"].as_str()),
        (201, Some("done")),
        "the money shown available was refused: {spent}"
    );
    let alice = eu
        .accounts()
        .account(&values::account("alice"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((alice.balance, alice.pending_debits), (0, 0));
    assert!(alice.pending_transactions.is_empty(), "{alice:?}");
}

/// The sweeper's scans page past what they skip: every stale transfer is returned once,
/// in `lastModified` order, even where more than a page share one `lastModified` (a burst
/// stamped in one millisecond); transfers into a deployment named unreachable are left
/// out, and multi-leg ones with any party there, those within the log's own deployment
/// (no `destinationDeployment`) are not.
#[tokio::test]
async fn a_scan_of_stale_transfers_returns_each_once_across_pages_and_leaves_out_unreachable_ones()
{
    let books = Books::shared().await;
    let eu = books.store("eu");
    let now = eu.server_time().await.unwrap();
    // 250 at one instant, 30 a millisecond before and 30 after; 80 touching cn among
    // them: 40 into it, 40 multi-leg ones whose first leg stays in eu and whose last
    // party is there.
    let mut expected = Vec::new();
    let mut to_cn = Vec::new();
    let place = |account: &AccountId| {
        DeploymentName::parse(if account.as_str().starts_with("cn") {
            "cn"
        } else {
            "eu"
        })
        .unwrap()
    };
    for i in 0..310 {
        let ago_ms = match i {
            0..30 => 60_001,
            30..280 => 60_000,
            _ => 59_999,
        };
        let mut t = values::initial("eu-a", "other", 1);
        t.source_deployment = eu.deployment().clone();
        t.destination_deployment =
            DeploymentName::parse(if i % 8 == 0 { "cn" } else { "eu" }).unwrap();
        if i % 4 == 2 {
            let last = if i % 8 == 2 { "cn-b" } else { "eu-b" };
            let legs = Legs::new(vec![
                Leg {
                    source: values::account("eu-a"),
                    destination: values::account("other"),
                    amount: values::amount(1),
                },
                Leg {
                    source: values::account("other"),
                    destination: values::account(last),
                    amount: values::amount(1),
                },
            ])
            .unwrap()
            .placed(place);
            t.amount = values::amount(2);
            t.legs = Some(Box::new(legs));
        }
        let touches_cn = i % 8 == 0 || i % 8 == 2;
        eu.transfers().insert_transfer(&t).await.unwrap();
        let then = mongodb::bson::DateTime::from_chrono(values::after(now, -ago_ms));
        eu.database()
            .collection::<mongodb::bson::Document>("transactions")
            .update_one(
                mongodb::bson::doc! { "_id": mongodb::bson::oid::ObjectId::from_bytes(t.id.bytes()) },
                mongodb::bson::doc! { "$set": { "lastModified": then } },
            )
            .await
            .unwrap();
        if touches_cn {
            to_cn.push(t.id);
        } else {
            expected.push(t.id);
        }
    }
    let cn = DeploymentName::parse("cn").unwrap();
    for (unreachable, expected) in [
        (vec![], [expected.clone(), to_cn].concat()),
        (vec![cn], expected),
    ] {
        let mut scan = Scan::new(values::after(now, -1_000), unreachable.clone());
        let mut seen: Vec<Transfer> = Vec::new();
        let mut pages = 0;
        loop {
            let page = eu.transfers().unfinished(&scan, 100).await.unwrap();
            scan.past(&page);
            pages += 1;
            let last = page.len() < 100;
            seen.extend(page);
            if last {
                break;
            }
        }
        assert!(
            seen.windows(2)
                .all(|w| w[0].last_modified <= w[1].last_modified),
            "not in lastModified order"
        );
        let returned: HashSet<TransferId> = seen.iter().map(|t| t.id).collect();
        let missing = expected.iter().filter(|id| !returned.contains(id)).count();
        assert_eq!(
            (seen.len(), returned.len(), missing),
            (expected.len(), expected.len(), 0),
            "returned, of them distinct, and missing (unreachable: {unreachable:?})"
        );
        assert_eq!(pages, expected.len() / 100 + 1);
    }
}

/// A deployment that stops answering without closing its connections (frozen: SIGSTOP,
/// or cut off by a partition) holds what was sent to it until the driver gives up (about
/// 10 s), before the watch finds it silent. That must not hold up the sweeping of the
/// other logs: a hold from eu into cn that expires meanwhile is expired, and its money
/// freed, at once (it waited for cn's pass to time out before, about 10 s after its
/// expiry, since one pass covered every log).
#[tokio::test]
async fn a_hold_into_a_frozen_deployment_is_expired_without_waiting_for_its_time_outs() {
    let daemons = OwnDaemons::start();
    let books = Books::new(daemons.uris()).await;
    let app = books.app().await;
    open(&app, "alice", 100, "eu").await;
    open(&app, "bob", 0, "cn").await;
    let hold = hold_from_alice_to_bob(&app, 3000).await;
    let eu = books.store("eu");
    let expires_at = eu
        .transfers()
        .transfer(hold)
        .await
        .unwrap()
        .unwrap()
        .hold
        .unwrap()
        .expires_at;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    daemons.daemons[2].signal(libc::SIGSTOP);
    loop {
        let stored = eu.transfers().transfer(hold).await.unwrap().unwrap();
        let alice = eu
            .accounts()
            .account(&values::account("alice"))
            .await
            .unwrap()
            .unwrap();
        let late_ms = (eu.server_time().await.unwrap() - expires_at).num_milliseconds();
        if stored.state == TransferState::Canceling && alice.pending_debits == 0 {
            break;
        }
        assert!(
            late_ms < 3_000,
            "{late_ms} ms after its expiry the hold is {} and reserves {} of alice's",
            stored.state,
            alice.pending_debits
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Thawed, cn takes its release, and nothing is left reserved.
    daemons.daemons[2].signal(libc::SIGCONT);
    let (within, every) = (Duration::from_secs(30), Duration::from_millis(200));
    let what = "the hold never ended after cn was thawed";
    support::eventually(what, within, every, async || {
        let stored = eu.transfers().transfer(hold).await.unwrap().unwrap();
        (stored.state == TransferState::Canceled).then_some(())
    })
    .await;
    let bob = books
        .store("cn")
        .accounts()
        .account(&values::account("bob"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((bob.balance, bob.pending_credits), (0, 0));
    assert_eq!(books.totals().await, (100, 0));
}

/// A pass pages past what it skips, to the last page. The skipped here are more than a
/// page (100) of stale transfers into a deployment the instance does not have (named in
/// the data but not in `DEPLOYMENTS`); the same skip happens to transfers the process is
/// driving and to those whose destination stopped answering since the page was read.
/// Behind them, a stale transfer between two deployments it has is recovered by one pass
/// (a pass that stopped at the first full page left it for ever).
#[tokio::test]
async fn one_pass_pages_past_a_full_page_it_skips_to_the_transfer_behind() {
    use transfer_service::service::TransferService;
    use transfer_service::store::Deployments;
    let books = Books::shared().await;
    {
        let app = books.app().await;
        open(&app, "eu-a", 1_000, "eu").await;
        open(&app, "us-a", 0, "us").await;
        open(&app, "cn-a", 0, "cn").await;
    }
    let eu = books.store("eu");
    let to_cn: Vec<_> = (0..120)
        .map(|_| {
            left_by_a_killed_instance(eu, values::initial("eu-a", "cn-a", 1), "cn", false, 60_000)
        })
        .collect();
    futures::future::join_all(to_cn).await;
    let to_us =
        left_by_a_killed_instance(eu, values::initial("eu-a", "us-a", 5), "us", true, 30_000).await;

    let without_cn = Deployments::new(vec![eu.clone(), books.store("us").clone()]);
    let bank = TransferService::new(without_cn, "sweeper-under-test", Duration::from_secs(1));
    let never = tokio_util::sync::CancellationToken::new();
    let report = transfer_service::sweeper::sweep_once(&bank.recovery(), &never)
        .await
        .unwrap();
    assert_eq!((report.found, report.claimed, report.finished), (121, 1, 1));
    let recovered = eu.transfers().transfer(to_us).await.unwrap().unwrap();
    assert_eq!(recovered.state, TransferState::Done);
    assert_eq!(books.balance("us-a").await, 5);
}

/// One sweep over every deployment (`sweeper::sweep_once`) fails only when every
/// deployment's pass failed: with one deployment down it reports what it did on the
/// others; with all of them down it fails.
#[tokio::test]
async fn one_sweep_fails_only_when_every_deployment_fails() {
    use transfer_service::service::TransferService;
    use transfer_service::store::Deployments;
    let mut daemons = OwnDaemons::start();
    let books = Books::new(daemons.uris()).await;
    {
        let app = books.app().await;
        open(&app, "eu-a", 1_000, "eu").await;
        open(&app, "us-a", 0, "us").await;
    }
    let eu = books.store("eu");
    left_by_a_killed_instance(eu, values::initial("eu-a", "us-a", 5), "us", true, 30_000).await;
    let bank = TransferService::new(
        Deployments::new(books.stores.clone()),
        "sweeper-under-test",
        Duration::from_secs(1),
    );
    let never = tokio_util::sync::CancellationToken::new();

    daemons.daemons[2].kill();
    let report = transfer_service::sweeper::sweep_once(&bank.recovery(), &never).await;
    let report = report.expect("eu and us were swept");
    assert_eq!((report.found, report.finished), (1, 1));

    daemons.daemons[0].kill();
    daemons.daemons[1].kill();
    let failed = transfer_service::sweeper::sweep_once(&bank.recovery(), &never).await;
    assert!(failed.is_err(), "no deployment answered: {failed:?}");
}

/// A pass claims at most a batch (100) of a log's stale transfers, the next pass takes
/// the rest; and a pass asked to stop claims nothing more.
#[tokio::test]
async fn one_pass_claims_at_most_a_batch_and_none_once_stopped() {
    use transfer_service::service::TransferService;
    use transfer_service::store::Deployments;
    let books = Books::shared().await;
    {
        let app = books.app().await;
        open(&app, "eu-a", 1_000, "eu").await;
        open(&app, "us-a", 0, "us").await;
    }
    let eu = books.store("eu");
    let left: Vec<_> = (0..120)
        .map(|_| {
            left_by_a_killed_instance(eu, values::initial("eu-a", "us-a", 1), "us", false, 30_000)
        })
        .collect();
    futures::future::join_all(left).await;
    let bank = TransferService::new(
        Deployments::new(books.stores.clone()),
        "sweeper-under-test",
        Duration::from_secs(1),
    );
    let sweep_once = transfer_service::sweeper::sweep_once;

    let stopped = tokio_util::sync::CancellationToken::new();
    stopped.cancel();
    let report = sweep_once(&bank.recovery(), &stopped).await.unwrap();
    assert_eq!(report.claimed, 0, "{report:?}");

    let never = tokio_util::sync::CancellationToken::new();
    let first = sweep_once(&bank.recovery(), &never).await.unwrap();
    assert_eq!((first.claimed, first.finished), (100, 100), "{first:?}");
    let second = sweep_once(&bank.recovery(), &never).await.unwrap();
    assert_eq!((second.claimed, second.finished), (20, 20), "{second:?}");
    assert_eq!(books.balance("us-a").await, 120);
    assert_eq!(books.balance("eu-a").await, 880);
}

/// What an instance killed in the middle of reversing `transfer` leaves on `log`: the
/// transfer `done`, its reversal claimed (`reversing`) and never run, `ago_ms` ago.
async fn reversal_left_by_a_killed_instance(
    log: &Store,
    mut transfer: Transfer,
    destination_deployment: &str,
    ago_ms: i64,
) -> TransferId {
    transfer.source_deployment = log.deployment().clone();
    transfer.destination_deployment = DeploymentName::parse(destination_deployment).unwrap();
    transfer.state = TransferState::Done;
    transfer.owner = Some("killed/00000000".into());
    log.transfers().insert_transfer(&transfer).await.unwrap();
    let claimed = log
        .transfers()
        .claim_reversal(transfer.id, transfer_service::store::new_transfer_id())
        .await
        .unwrap();
    assert!(claimed);
    age_on(log, transfer.id, ago_ms).await;
    transfer.id
}

/// Interrupted reversals, as stale transfers: a pass pages past a full page of those it
/// cannot finish (into a deployment the instance does not have) to the one behind, and
/// finishes at most a batch (100) of them, the next pass the rest.
#[tokio::test]
async fn one_pass_finishes_interrupted_reversals_past_a_page_it_cannot_and_at_most_a_batch() {
    use transfer_service::service::TransferService;
    use transfer_service::store::Deployments;
    let books = Books::shared().await;
    {
        let app = books.app().await;
        open(&app, "eu-a", 1_000, "eu").await;
        open(&app, "us-a", 1_000, "us").await;
        open(&app, "cn-a", 1_000, "cn").await;
    }
    let eu = books.store("eu");
    let to_cn: Vec<_> = (0..110)
        .map(|_| {
            let done = values::initial("eu-a", "cn-a", 1);
            reversal_left_by_a_killed_instance(eu, done, "cn", 60_000)
        })
        .collect();
    futures::future::join_all(to_cn).await;
    let to_us: Vec<_> = (0..120)
        .map(|_| {
            let done = values::initial("eu-a", "us-a", 1);
            reversal_left_by_a_killed_instance(eu, done, "us", 30_000)
        })
        .collect();
    futures::future::join_all(to_us).await;

    let without_cn = Deployments::new(vec![eu.clone(), books.store("us").clone()]);
    let bank = TransferService::new(without_cn, "sweeper-under-test", Duration::from_secs(1));
    let never = tokio_util::sync::CancellationToken::new();
    let sweep_once = transfer_service::sweeper::sweep_once;
    let first = sweep_once(&bank.recovery(), &never).await.unwrap();
    assert_eq!(first.reversals_finished, 100, "{first:?}");
    let second = sweep_once(&bank.recovery(), &never).await.unwrap();
    assert_eq!(second.reversals_finished, 20, "{second:?}");
    assert_eq!(books.balance("eu-a").await, 1_120);
    assert_eq!(books.balance("us-a").await, 880);
}

/// A pass drives the transfers it claimed at once, not one after the other: one stuck in
/// its run (here paused after its credit) does not hold up the others of the pass.
#[tokio::test]
async fn one_pass_drives_its_claimed_transfers_at_once() {
    use transfer_service::failpoints::{self, Point};
    use transfer_service::service::TransferService;
    use transfer_service::store::Deployments;
    let books = Books::shared().await;
    {
        let app = books.app().await;
        open(&app, "eu-a", 1_000, "eu").await;
        open(&app, "us-a", 0, "us").await;
    }
    let eu = books.store("eu");
    let mut left = Vec::new();
    for _ in 0..2 {
        let transfer = values::initial("eu-a", "us-a", 5);
        left.push(left_by_a_killed_instance(eu, transfer, "us", true, 30_000).await);
    }
    let bank = TransferService::new(
        Deployments::new(books.stores.clone()),
        "sweeper-under-test",
        Duration::from_secs(1),
    );
    let mut paused = failpoints::pause("sweeper-under-test", Point::AfterCredit);
    let pass = tokio::spawn(async move {
        let never = tokio_util::sync::CancellationToken::new();
        transfer_service::sweeper::sweep_once(&bank.recovery(), &never).await
    });
    paused.reached().await;

    let (within, every) = (Duration::from_secs(10), Duration::from_millis(50));
    support::poll_until(within, every, async || {
        let mut states = Vec::new();
        for id in &left {
            states.push(eu.transfers().transfer(*id).await.unwrap().unwrap().state);
        }
        if states.contains(&TransferState::Done) {
            Ok(())
        } else {
            Err(states)
        }
    })
    .await
    .unwrap_or_else(|states| panic!("the other transfer waits for the paused one: {states:?}"));
    paused.resume();
    let report = pass.await.unwrap().unwrap();
    assert_eq!((report.claimed, report.finished), (2, 2), "{report:?}");
    assert_eq!(books.balance("us-a").await, 10);
}

/// A transfer an instance killed long ago canceled while pending, on `log`: `canceled`,
/// still marked `fenced` (its accounts' fences not dropped yet), `ago_ms` ago.
async fn fenced_left_by_a_killed_instance(
    log: &Store,
    mut transfer: Transfer,
    destination_deployment: &str,
    ago_ms: i64,
) -> TransferId {
    transfer.source_deployment = log.deployment().clone();
    transfer.destination_deployment = DeploymentName::parse(destination_deployment).unwrap();
    transfer.state = TransferState::Canceled;
    transfer.reason = Some(transfer_service::domain::CancelReason::CanceledByRequest);
    transfer.owner = Some("killed/00000000".into());
    transfer.fenced = true;
    log.transfers().insert_transfer(&transfer).await.unwrap();
    age_on(log, transfer.id, ago_ms).await;
    transfer.id
}

/// Canceled transfers whose fences are left, as stale transfers: a pass pages past a full
/// page of those it cannot clean (their accounts on a deployment the instance does not
/// have) to those behind, and cleans at most a batch (100), the next pass the rest.
#[tokio::test]
async fn one_pass_drops_fences_past_a_page_it_cannot_and_at_most_a_batch() {
    use transfer_service::service::TransferService;
    use transfer_service::store::Deployments;
    let books = Books::shared().await;
    let eu = books.store("eu");
    let to_cn: Vec<_> = (0..110)
        .map(|_| fenced_left_by_a_killed_instance(eu, values::initial("a", "c", 1), "cn", 60_000))
        .collect();
    futures::future::join_all(to_cn).await;
    let to_us: Vec<_> = (0..120)
        .map(|_| fenced_left_by_a_killed_instance(eu, values::initial("a", "u", 1), "us", 30_000))
        .collect();
    let to_us = futures::future::join_all(to_us).await;

    let without_cn = Deployments::new(vec![eu.clone(), books.store("us").clone()]);
    let bank = TransferService::new(without_cn, "sweeper-under-test", Duration::from_secs(1));
    let never = tokio_util::sync::CancellationToken::new();
    let sweep_once = transfer_service::sweeper::sweep_once;
    let first = sweep_once(&bank.recovery(), &never).await.unwrap();
    assert_eq!(first.fences_dropped, 100, "{first:?}");
    let second = sweep_once(&bank.recovery(), &never).await.unwrap();
    assert_eq!(second.fences_dropped, 20, "{second:?}");
    for id in to_us {
        assert!(!eu.transfers().transfer(id).await.unwrap().unwrap().fenced);
    }
}

/// An account's ledger stays on its own deployment: the entries of a transfer across
/// deployments are written by each account's own write, on its deployment, and moved
/// there into `entries`; none is on another deployment, and the statement read through
/// any deployment's instance is the account's own.
#[tokio::test]
async fn an_accounts_entries_are_kept_on_its_own_deployment() {
    use mongodb::bson::{Document, doc};
    let books = Books::shared().await;
    let app = books.app().await;
    open(&app, "alice", 1_000, "us").await;
    open(&app, "bob", 0, "cn").await;
    for amount in [100, 200, 300] {
        let body = json!({ "source": "alice", "destination": "bob", "amount": amount });
        let (status, body) = transfer(&app, body).await;
        assert_eq!(status, 201, "{body}");
    }
    let entries_of = |name: &'static str, account: &'static str| {
        let store = books.store(name).clone();
        async move {
            store
                .database()
                .collection::<Document>("entries")
                .count_documents(doc! { "account": account })
                .await
                .unwrap()
        }
    };
    // Moved: every entry is in `entries` on its account's deployment.
    support::eventually(
        "the entries were moved",
        Duration::from_secs(10),
        Duration::from_millis(20),
        async || {
            let moved = (
                entries_of("us", "alice").await,
                entries_of("cn", "bob").await,
            );
            (moved == (4, 4)).then_some(())
        },
    )
    .await;
    for (name, account) in [
        ("eu", "alice"),
        ("cn", "alice"),
        ("eu", "bob"),
        ("us", "bob"),
    ] {
        assert_eq!(entries_of(name, account).await, 0, "{account} on {name}");
    }
    for (account, kinds) in [
        ("alice", ["opened", "debit", "debit", "debit"]),
        ("bob", ["opened", "credit", "credit", "credit"]),
    ] {
        let (status, page) = get(&app, &format!("/accounts/{account}/entries")).await;
        assert_eq!(status, 200, "{page}");
        let read: Vec<&str> = page["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["kind"].as_str().unwrap())
            .collect();
        assert_eq!(read, kinds, "{account}");
        assert_eq!(page["next"], "4");
    }
}

/// Each `(account, deployment, balance)` has that balance as stored on its deployment,
/// and no reservation or marker left.
async fn assert_at_rest(books: &Books, accounts: &[(&str, &str, i64)]) {
    for &(account, deployment, balance) in accounts {
        let a = books
            .store(deployment)
            .accounts()
            .account(&values::account(account))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (a.balance, a.pending_debits, a.pending_credits),
            (balance, 0, 0),
            "{a:?}"
        );
        assert!(a.pending_transactions.is_empty(), "{a:?}");
    }
}

/// A multi-leg hold is logged where its first leg's source lives (eu here); a paying
/// party on another deployment (cn) that needs its money once the hold has expired asks
/// every deployment's log, not only its own, and frees it at once, before any sweeper.
#[tokio::test]
async fn the_money_a_multi_leg_hold_logged_elsewhere_reserved_is_spendable_once_it_expired() {
    let books = Books::shared().await;
    // One pass at start-up, none during the test.
    let app = books
        .app_with(|s| s.sweep_interval = Duration::from_secs(3600))
        .await;
    open(&app, "ml-a", 100, "eu").await;
    open(&app, "ml-b", 0, "eu").await;
    open(&app, "ml-c", 500, "cn").await;
    open(&app, "ml-d", 0, "us").await;
    open(&app, "ml-e", 0, "cn").await;
    let body = json!({
        "legs": [
            { "source": "ml-a", "destination": "ml-b", "amount": 100 },
            { "source": "ml-c", "destination": "ml-d", "amount": 500 },
        ],
        "hold": { "expiresInMs": 1_000 },
    });
    let (status, hold) = status_and_json(app.post_json("/transfers", body).await).await;
    assert_eq!(
        (status, hold["state"].as_str()),
        (201, Some("held")),
        "{hold}"
    );
    let id = values::transfer_id(hold["id"].as_str().unwrap());
    assert!(
        books
            .store("eu")
            .transfers()
            .transfer(id)
            .await
            .unwrap()
            .is_some(),
        "logged on eu"
    );
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    let (status, moved) = status_and_json(
        app.post_json(
            "/transfers",
            json!({ "source": "ml-c", "destination": "ml-e", "amount": 500 }),
        )
        .await,
    )
    .await;
    assert_eq!(status, 201, "{moved}");
    let ended = books
        .store("eu")
        .transfers()
        .transfer(id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (ended.state, ended.reason),
        (TransferState::Canceled, Some(CancelReason::Expired)),
        "{ended:?}"
    );
    assert_at_rest(
        &books,
        &[
            ("ml-a", "eu", 100),
            ("ml-b", "eu", 0),
            ("ml-c", "cn", 0),
            ("ml-d", "us", 0),
            ("ml-e", "cn", 500),
        ],
    )
    .await;
}

/// A hold is logged where its source lives (eu here); its destination on another
/// deployment (cn), near `MAX_MONEY`, that needs the room the hold kept once the hold
/// has expired, for a credit logged on cn, asks every deployment's log, not only its own,
/// and frees it at once, before any sweeper, rather than answer `balance_overflow`.
#[tokio::test]
async fn the_room_a_hold_logged_elsewhere_kept_in_its_destination_is_free_once_it_expired() {
    const MAX_MONEY: i64 = transfer_service::domain::MAX_MONEY;
    let books = Books::shared().await;
    let app = books
        .app_with(|s| s.sweep_interval = Duration::from_secs(3600))
        .await;
    open(&app, "rm-a", 1_000, "eu").await;
    open(&app, "rm-full", MAX_MONEY - 100, "cn").await;
    open(&app, "rm-c", 1_000, "cn").await;
    let body = json!({
        "source": "rm-a", "destination": "rm-full", "amount": 100,
        "hold": { "expiresInMs": 1_000 },
    });
    let (status, hold) = status_and_json(app.post_json("/transfers", body).await).await;
    assert_eq!(
        (status, hold["state"].as_str()),
        (201, Some("held")),
        "{hold}"
    );
    let id = values::transfer_id(hold["id"].as_str().unwrap());
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    let credit = json!({ "source": "rm-c", "destination": "rm-full", "amount": 60 });
    let (status, moved) = status_and_json(app.post_json("/transfers", credit).await).await;

    assert_eq!(status, 201, "{moved}");
    let ended = books
        .store("eu")
        .transfers()
        .transfer(id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (ended.state, ended.reason),
        (TransferState::Canceled, Some(CancelReason::Expired)),
        "{ended:?}"
    );
    assert_at_rest(
        &books,
        &[
            ("rm-a", "eu", 1_000),
            ("rm-full", "cn", MAX_MONEY - 40),
            ("rm-c", "cn", 940),
        ],
    )
    .await;
}

/// A multi-leg hold logged on eu reserves three paying parties, one of them (`mp-q`) on
/// cn; its expirer was killed before releasing anything (`canceling`, expired, every
/// reservation in place, its lease fresh), and cn is down. Reads call `mp-p`'s money
/// available, so a debit of `mp-p` must spend it: freeing the hold for it may not wait
/// for another paying party's deployment (it released the paying parties one after the
/// other, in the parties' order, and stopped at `mp-q`'s, never reaching `mp-p`'s).
#[tokio::test]
async fn the_money_an_expired_multi_leg_hold_reserved_is_spendable_while_another_paying_partys_deployment_is_down()
 {
    let mut daemons = OwnDaemons::start();
    let books = Books::new(daemons.uris()).await;
    // A lease far longer than the test: only the debit may release the hold's parties.
    let app = books
        .app_with(|s| s.stale_after = Duration::from_secs(600))
        .await;
    for (id, balance, deployment) in [
        ("mp-a", 100, "eu"),
        ("mp-b", 0, "eu"),
        ("mp-q", 100, "cn"),
        ("mp-p", 100, "eu"),
        ("mp-d", 0, "us"),
        ("mp-e", 0, "eu"),
    ] {
        open(&app, id, balance, deployment).await;
    }
    let eu = books.store("eu");
    let leg = |s: &str, d: &str| Leg {
        source: values::account(s),
        destination: values::account(d),
        amount: values::amount(100),
    };
    let place = |a: &AccountId| {
        DeploymentName::parse(match a.as_str() {
            "mp-q" => "cn",
            "mp-d" => "us",
            _ => "eu",
        })
        .unwrap()
    };
    let legs = Legs::new(vec![
        leg("mp-a", "mp-b"),
        leg("mp-q", "mp-b"),
        leg("mp-p", "mp-d"),
    ])
    .unwrap()
    .placed(place);
    let mut hold = values::initial("mp-a", "mp-b", 300);
    hold.source_deployment = eu.deployment().clone();
    hold.destination_deployment = eu.deployment().clone();
    hold.hold = Some(Hold {
        amount: values::amount(300),
        expires_at: values::after(eu.server_time().await.unwrap(), -1_000),
    });
    for party in legs.parties() {
        let store = books.store(party.deployment.as_str());
        let deadline = values::after(store.server_time().await.unwrap(), 10_000);
        let step = store
            .accounts()
            .reserve(&party.account, hold.id, party.net, deadline)
            .await
            .unwrap();
        assert!(step.applied, "{party:?}");
    }
    hold.legs = Some(Box::new(legs));
    hold.state = TransferState::Canceling;
    hold.reason = Some(CancelReason::Expired);
    hold.owner = Some("killed/00000000".into());
    daemons.daemons[2].kill();
    wait_until_known_down(&app, "cn").await;
    eu.transfers().insert_transfer(&hold).await.unwrap();

    let (_, p) = get(&app, "/accounts/mp-p").await;
    assert_eq!(p["availableBalance"].as_i64(), Some(100), "{p}");
    let (status, spent) = transfer(
        &app,
        json!({ "source": "mp-p", "destination": "mp-e", "amount": 100 }),
    )
    .await;
    assert_eq!(
        (status, spent["state"].as_str()),
        (201, Some("done")),
        "the money shown available was refused: {spent}"
    );
    let p = eu
        .accounts()
        .account(&values::account("mp-p"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((p.balance, p.pending_debits), (0, 0));
    assert!(p.pending_transactions.is_empty(), "{p:?}");
}

/// A step refused on eu, of an account that does reserve something on that side (a live
/// hold), asks the other deployments' logs for expired holds: while cn is frozen and not
/// yet known silent, it passes cn's over after at most a second rather than wait for the
/// driver's time-out (about 15 s, found by a race review), for a credit refused as an
/// overflow as for a debit refused for funds.
#[tokio::test]
async fn a_step_refused_on_eu_of_an_account_with_a_live_hold_is_answered_soon_while_cn_is_frozen() {
    const MAX_MONEY: i64 = transfer_service::domain::MAX_MONEY;
    let daemons = OwnDaemons::start();
    let books = Books::new(daemons.uris()).await;
    let app = books.app().await;
    open(&app, "fz-a", 1_000, "eu").await;
    open(&app, "fz-full", MAX_MONEY - 100, "eu").await;
    let live = json!({
        "source": "fz-a", "destination": "fz-full", "amount": 50,
        "hold": { "expiresInMs": 600_000 },
    });
    let (status, hold) = transfer(&app, live).await;
    assert_eq!(status, 201, "{hold}");
    daemons.daemons[2].signal(libc::SIGSTOP);
    // fz-full receives the live hold (room), fz-a pays it (money): a credit into the one
    // past `MAX_MONEY`, a debit of the other past what is available.
    let mut answers = Vec::new();
    for (amount, code) in [(60, "balance_overflow"), (951, "insufficient_funds")] {
        let body = json!({ "source": "fz-a", "destination": "fz-full", "amount": amount });
        let started = Instant::now();
        let (status, answer) = transfer(&app, body).await;
        answers.push((status, answer, code, started.elapsed()));
    }
    daemons.daemons[2].signal(libc::SIGCONT);
    for (status, answer, code, took) in answers {
        assert_eq!(
            (status, answer["code"].as_str()),
            (422, Some(code)),
            "{answer}"
        );
        // It waits at most 1 s for cn (`OTHER_LOGS_LIMIT`), not the driver's time-out.
        assert!(
            took < Duration::from_secs(5),
            "{code} answered after {took:?}"
        );
    }
}

/// A debit refused for funds on eu, of an account that reserves nothing, has no expired
/// hold to look for, on eu's log or any other: it is answered 422 at once while cn is
/// frozen (it asked every other deployment's log for expired holds out of the account,
/// holds or not, and waited for cn's until the driver gave up, then answered 503).
#[tokio::test]
async fn a_debit_refused_for_funds_on_eu_is_answered_at_once_while_cn_is_frozen() {
    let daemons = OwnDaemons::start();
    let books = Books::new(daemons.uris()).await;
    let app = books.app().await;
    open(&app, "fz-a", 10, "eu").await;
    open(&app, "fz-b", 0, "eu").await;
    daemons.daemons[2].signal(libc::SIGSTOP);
    let started = Instant::now();
    let (status, body) = transfer(
        &app,
        json!({ "source": "fz-a", "destination": "fz-b", "amount": 100 }),
    )
    .await;
    let took = started.elapsed();
    daemons.daemons[2].signal(libc::SIGCONT);
    assert_eq!(
        (status, body["code"].as_str()),
        (422, Some("insufficient_funds")),
        "{body}"
    );
    assert!(took < Duration::from_secs(2), "answered after {took:?}");
}
