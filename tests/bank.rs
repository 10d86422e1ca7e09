//! The bank test, after Jepsen's bank workload: several instances of the service on one
//! database, clients making many concurrent transfers among a dozen accounts (three of
//! them hot) with cancels, asynchronous transfers and idempotent retries mixed in, while
//! a nemesis kills instances with SIGKILL and restarts them, and restarts the database
//! process once in the middle. Then, once everything is quiet, it checks:
//!
//! - the total balance is unchanged and no balance is negative;
//! - every transfer is terminal and no `pendingTransactions` entry is left;
//! - every balance equals its opening balance plus the `done` transfers into it minus the
//!   `done` transfers out of it (so no money moved outside a finished transfer);
//! - every transfer answered 201 `done` is still `done`;
//! - no idempotency key was answered with two transfers or recorded twice.
//!
//! It runs for `BANK_TEST_SECONDS` (default 30) of load and prints what it did.

#[path = "support/mod.rs"]
mod support;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mongodb::bson::oid::ObjectId;
use rand::Rng;
use rand::seq::IndexedRandom;
use serde_json::{Value, json};
use support::process::{Instance, InstanceConfig};
use support::{Daemon, fresh_database_name};
use tokio_util::sync::CancellationToken;
use transfer_service::domain::TransferState;
use transfer_service::store::Store;

const ACCOUNTS: usize = 12;
const HOT: usize = 3;
const OPENING_BALANCE: i64 = 1_000;
const INSTANCES: usize = 3;
const CLIENTS: usize = 12;
const STALE_AFTER_MS: u64 = 1000;
const SWEEP_INTERVAL_MS: u64 = 200;

fn account(i: usize) -> String {
    format!("acct-{i:02}")
}

/// A random account, half the time one of the hot ones.
fn pick_account(rng: &mut impl Rng) -> usize {
    if rng.random_bool(0.5) {
        rng.random_range(0..HOT)
    } else {
        rng.random_range(0..ACCOUNTS)
    }
}

/// What the clients saw.
#[derive(Default)]
struct History {
    /// Transfers answered 201 `done`.
    done: HashSet<String>,
    /// Per idempotency key, every transfer id it was answered with.
    keys: HashMap<String, HashSet<String>>,
    /// Known transfer ids, for cancels.
    ids: Vec<String>,
    /// Answers by operation and status.
    answers: BTreeMap<String, u64>,
    /// Statuses a client must never see.
    violations: Vec<String>,
}

impl History {
    fn count(&mut self, what: &str) {
        *self.answers.entry(what.to_owned()).or_default() += 1;
    }
}

/// The live instances' base URLs, for clients to pick from.
type Bases = Arc<Mutex<Vec<Option<String>>>>;

fn live_base(bases: &Bases, rng: &mut impl Rng) -> Option<String> {
    let bases = bases.lock().unwrap();
    let live: Vec<&String> = bases.iter().flatten().collect();
    live.choose(rng).map(|s| (*s).clone())
}

/// One transfer request, retried on another instance with the same idempotency key when
/// the answer is lost (a killed instance) or the database is unavailable.
async fn transfer(
    http: &reqwest::Client,
    bases: &Bases,
    history: &Mutex<History>,
    key: Option<String>,
    body: Value,
    respond_async: bool,
) {
    let attempts = if key.is_some() { 8 } else { 1 };
    for attempt in 0..attempts {
        let Some(base) = live_base(bases, &mut rand::rng()) else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let mut request = http.post(format!("{base}/transfers")).json(&body);
        if let Some(key) = &key {
            request = request.header("idempotency-key", key);
        }
        if respond_async {
            request = request.header("prefer", "respond-async");
        }
        let response = match request.send().await {
            Ok(r) => r,
            Err(_) => {
                history.lock().unwrap().count("transfer: connection lost");
                continue;
            }
        };
        let status = response.status().as_u16();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        if record(history, status, replayed, attempt, &answer, key.as_deref()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Records one transfer answer; false when it asks for a retry (503).
fn record(
    history: &Mutex<History>,
    status: u16,
    replayed: bool,
    attempt: usize,
    answer: &Value,
    key: Option<&str>,
) -> bool {
    let id = answer["id"]
        .as_str()
        .or(answer["transferId"].as_str())
        .map(str::to_owned);
    let mut h = history.lock().unwrap();
    h.count(&format!(
        "transfer: {status}{}{}",
        if replayed { " replayed" } else { "" },
        if attempt > 0 { " (retry)" } else { "" }
    ));
    match status {
        201 | 202 | 409 | 422 => {}
        503 => return false,
        other => h
            .violations
            .push(format!("transfer answered {other}: {answer}")),
    }
    if let Some(id) = id {
        if status == 201 {
            if answer["state"] != "done" {
                h.violations.push(format!("201 with {answer}"));
            }
            h.done.insert(id.clone());
        }
        if let Some(key) = key {
            h.keys.entry(key.to_owned()).or_default().insert(id.clone());
        }
        h.ids.push(id);
    }
    true
}

async fn cancel(http: &reqwest::Client, bases: &Bases, history: &Mutex<History>) {
    let (base, id) = {
        let mut rng = rand::rng();
        let h = history.lock().unwrap();
        // Half the time one of the latest, likely still running; else any.
        let latest = &h.ids[h.ids.len().saturating_sub(3)..];
        let pool = if rng.random_bool(0.5) {
            latest
        } else {
            &h.ids[..]
        };
        let Some(id) = pool.choose(&mut rng).cloned() else {
            return;
        };
        drop(h);
        let Some(base) = live_base(bases, &mut rng) else {
            return;
        };
        (base, id)
    };
    let response = http
        .post(format!("{base}/transfers/{id}/cancel"))
        .send()
        .await;
    let mut h = history.lock().unwrap();
    match response {
        Ok(r) => {
            let status = r.status().as_u16();
            h.count(&format!("cancel: {status}"));
            if !matches!(status, 200 | 422 | 503) {
                h.violations
                    .push(format!("cancel of {id} answered {status}"));
            }
        }
        Err(_) => h.count("cancel: connection lost"),
    }
}

async fn client(seed: usize, bases: Bases, history: Arc<Mutex<History>>, stop: CancellationToken) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut n = 0u64;
    while !stop.is_cancelled() {
        n += 1;
        let (choice, body, key) = {
            let mut rng = rand::rng();
            let source = pick_account(&mut rng);
            let mut destination = pick_account(&mut rng);
            if destination == source {
                destination = (source + 1) % ACCOUNTS;
            }
            let body = json!({
                "source": account(source),
                "destination": account(destination),
                "amount": rng.random_range(1..=300),
            });
            let key = rng
                .random_bool(0.5)
                .then(|| format!("client-{seed}-op-{n}"));
            (rng.random_range(0..100), body, key)
        };
        match choice {
            0..=9 => cancel(&http, &bases, &history).await,
            10..=14 => transfer(&http, &bases, &history, key, body, true).await,
            15..=24 => {
                // A client retrying a request whose answer it already had.
                let key = format!("client-{seed}-replayed-{n}");
                for _ in 0..2 {
                    transfer(
                        &http,
                        &bases,
                        &history,
                        Some(key.clone()),
                        body.clone(),
                        false,
                    )
                    .await;
                }
            }
            _ => transfer(&http, &bases, &history, key, body, false).await,
        }
    }
}

fn instance_config(uri: &str, database: &str, name: &str) -> InstanceConfig {
    let mut config = InstanceConfig::new(uri, database, name);
    config.stale_after_ms = STALE_AFTER_MS;
    config.sweep_interval_ms = SWEEP_INTERVAL_MS;
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bank_keeps_its_money_through_killed_instances_and_a_database_restart() {
    let seconds: u64 = std::env::var("BANK_TEST_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    // Its own database server, so that the nemesis can restart it; with MONGODB_URI
    // set, that server is used and left alone.
    let storage = tempfile::tempdir().unwrap();
    let external = std::env::var("MONGODB_URI")
        .ok()
        .filter(|u| !u.trim().is_empty());
    let mut daemon = match external {
        Some(_) => None,
        None => Some(Daemon::start(storage.path().to_path_buf(), 0)),
    };
    let uri = external.unwrap_or_else(|| daemon.as_ref().unwrap().uri.clone());
    let database = fresh_database_name();

    let mut instances: Vec<Instance> = Vec::new();
    for i in 0..INSTANCES {
        instances
            .push(Instance::start(&instance_config(&uri, &database, &format!("bank-{i}"))).await);
    }
    let http = reqwest::Client::new();
    for i in 0..ACCOUNTS {
        let r = http
            .post(instances[0].url("/accounts"))
            .json(&json!({ "id": account(i), "balance": OPENING_BALANCE }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
    }
    let bases: Bases = Arc::new(Mutex::new(
        instances.iter().map(|i| Some(i.base.clone())).collect(),
    ));
    let history = Arc::new(Mutex::new(History::default()));
    let stop = CancellationToken::new();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|seed| tokio::spawn(client(seed, bases.clone(), history.clone(), stop.clone())))
        .collect();

    // The nemesis.
    let started = Instant::now();
    let run_for = Duration::from_secs(seconds);
    let mut killed = 0;
    let mut renamed = 0;
    let mut database_restarts = 0;
    let mut generation = 0;
    while started.elapsed() < run_for {
        let pause_ms = rand::rng().random_range(800..2000);
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        if database_restarts == 0 && started.elapsed() >= run_for / 2 {
            if let Some(d) = daemon.as_mut() {
                let port = d.port;
                d.kill();
                tokio::time::sleep(Duration::from_millis(1000)).await;
                *d = Daemon::start(storage.path().to_path_buf(), port);
                database_restarts += 1;
                println!("nemesis: database restarted");
                continue;
            }
        }
        let victim = rand::rng().random_range(0..INSTANCES);
        bases.lock().unwrap()[victim] = None;
        instances[victim].kill();
        killed += 1;
        tokio::time::sleep(Duration::from_millis(rand::rng().random_range(100..800))).await;
        // Half the time it comes back under its old name (and takes back its own
        // transfers at once), half the time as a new instance.
        generation += 1;
        let name = if rand::rng().random_bool(0.5) {
            format!("bank-{victim}")
        } else {
            renamed += 1;
            format!("bank-{victim}-{generation}")
        };
        let config = instance_config(&uri, &database, &name);
        instances[victim] = Instance::start(&config).await;
        bases.lock().unwrap()[victim] = Some(instances[victim].base.clone());
    }
    stop.cancel();
    for c in clients {
        c.await.unwrap();
    }

    // Quiescence: every transfer terminal (a lease, a few sweeps, and the backlog).
    let store = Store::connect(&uri, &database).await.unwrap();
    let quiet_deadline = Instant::now() + Duration::from_secs(60);
    let transfers = loop {
        let transfers = store
            .list_transfers(&Default::default(), 1_000_000)
            .await
            .unwrap();
        if transfers.iter().all(|t| t.state.is_terminal()) {
            break transfers;
        }
        assert!(
            Instant::now() < quiet_deadline,
            "transfers still unfinished a minute after the load stopped"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let accounts = store.list_accounts(None, 1000).await.unwrap();
    let history = history.lock().unwrap();

    // What happened.
    let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
    for t in &transfers {
        let outcome = match (t.state, t.reason, t.reverses) {
            (TransferState::Done, _, Some(_)) => "done (reversal)".to_owned(),
            (TransferState::Done, _, None) => "done".to_owned(),
            (state, Some(reason), _) => format!("{state} ({reason})"),
            (state, None, _) => state.to_string(),
        };
        *outcomes.entry(outcome).or_default() += 1;
    }
    println!(
        "bank test: {seconds} s of load, {CLIENTS} clients, {INSTANCES} instances; \
         {killed} instances killed with SIGKILL and restarted ({renamed} under a new name), \
         {database_restarts} database restart(s)"
    );
    println!("transfers by outcome: {outcomes:?}");
    println!("client answers: {:?}", history.answers);

    // The checks.
    let mut violations = history.violations.clone();
    let total: i64 = accounts.iter().map(|a| a.balance).sum();
    if total != OPENING_BALANCE * ACCOUNTS as i64 {
        violations.push(format!("total balance {total}"));
    }
    let mut expected: HashMap<&str, i64> = accounts
        .iter()
        .map(|a| (a.id.as_str(), OPENING_BALANCE))
        .collect();
    for t in transfers.iter().filter(|t| t.state == TransferState::Done) {
        *expected.get_mut(t.source.as_str()).unwrap() -= t.value;
        *expected.get_mut(t.destination.as_str()).unwrap() += t.value;
    }
    for a in &accounts {
        if a.balance < 0 {
            violations.push(format!("{} is negative: {}", a.id, a.balance));
        }
        if !a.pending_transactions.is_empty() {
            violations.push(format!(
                "{} keeps markers {:?}",
                a.id, a.pending_transactions
            ));
        }
        if a.balance != expected[a.id.as_str()] {
            violations.push(format!(
                "{} holds {} but its done transfers say {}",
                a.id,
                a.balance,
                expected[a.id.as_str()]
            ));
        }
    }
    let by_id: HashMap<ObjectId, &_> = transfers.iter().map(|t| (t.id, t)).collect();
    for id in &history.done {
        let state = by_id.get(&id.parse().unwrap()).map(|t| t.state);
        if state != Some(TransferState::Done) {
            violations.push(format!("{id} was answered done and is now {state:?}"));
        }
    }
    let mut recorded_keys: HashMap<&str, u32> = HashMap::new();
    for t in &transfers {
        if let Some(key) = &t.idempotency_key {
            *recorded_keys.entry(key.as_str()).or_default() += 1;
        }
    }
    for (key, ids) in &history.keys {
        if ids.len() > 1 {
            violations.push(format!("key {key} answered with {ids:?}"));
        }
    }
    for (key, count) in recorded_keys {
        if count > 1 {
            violations.push(format!("key {key} recorded {count} times"));
        }
    }
    println!(
        "{} transfers, {} answered done, {} idempotency keys, {} violations",
        transfers.len(),
        history.done.len(),
        history.keys.len(),
        violations.len()
    );
    assert!(
        outcomes.get("done").copied().unwrap_or(0) > 50,
        "the load made too few transfers to mean anything: {outcomes:?}"
    );
    assert!(killed >= 3, "the nemesis killed too few instances");
    assert!(violations.is_empty(), "violations: {violations:#?}");
}
