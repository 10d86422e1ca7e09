//! Tenants explored (`docs/tenants.md`): seeded random batches of concurrent requests by
//! many keys (three tenants' read-only, read-write and admin keys, platform keys, keys
//! made and revoked on the way), each answer checked against a model, in the manner of
//! a small VOPR.
//!
//! The model knows every account's tenant and currency, every transfer's accounts, and
//! every key's tenant, role and whether it was revoked. Each request's answer is
//! predicted from the model as it stood before its batch (a batch never uses what it
//! makes or revokes itself) and must be exactly that class: what the key sees answers
//! 2xx (or a business refusal any account may meet, `insufficient_funds`); what it does
//! not see answers exactly as an id nobody has (404, or 422 `unknown_account` naming the
//! same account a request of nobody's accounts would name); a read-only key's write 403;
//! a key that is not an admin on `/api-keys` 403; a revoked key 401. Listings and the
//! feed show only what the key sees while the batches run, and, once all is quiet,
//! exactly what it sees. At the end: no money made or lost in any currency, every
//! transfer inserted with the tenants of its accounts, and no tenant's key ever moved
//! an account that is not its tenant's.
//!
//! `TENANT_SEED` replays a run (it is printed at the start and in every failure);
//! `TENANT_ROUNDS` sets how many batches run (default [`ROUNDS`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::future::join_all;
use mongodb::bson::oid::ObjectId;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use reqwest::Method;
use serde_json::{Value, json};
use support::{TestApp, spawn_app_with};
use transfer_service::config::parse_api_keys;
use transfer_service::domain::TransferId;

/// Batches run by default: a few seconds on a loaded two-core machine.
const ROUNDS: usize = 50;

/// Pages a listing or a read of the feed follows while the batches run (all of them
/// once all is quiet).
const PAGES: usize = 3;

/// Requests sent at once in a batch.
const BATCH: usize = 8;

const TENANTS: [&str; 3] = ["acme", "bolt", "cusp"];

const CURRENCIES: [&str; 2] = ["EUR", "USD"];

/// Accounts nobody opens: what "does not exist" answers.
const GHOST_ACCOUNTS: [&str; 2] = ["ghost-0", "ghost-1"];

/// A transfer id nobody has.
const GHOST_TRANSFER: &str = "0000000000000000000000aa";

/// An API key id nobody has.
const GHOST_KEY: &str = "00000000000000000000000000000000";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Ro,
    Rw,
    Admin,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Role::Ro => "ro",
            Role::Rw => "rw",
            Role::Admin => "admin",
        }
    }

    fn writes(self) -> bool {
        self != Role::Ro
    }
}

/// A key the run holds.
#[derive(Debug, Clone)]
struct Key {
    secret: String,
    /// Its public id; `None` for the bootstrap key of `API_KEYS`.
    id: Option<String>,
    /// `None`: a platform key.
    tenant: Option<String>,
    role: Role,
    revoked: bool,
    /// Made during the run: a candidate for revocation (the keys of the setup stay).
    made_in_run: bool,
}

impl Key {
    fn name(&self) -> String {
        format!(
            "{}:{}{}",
            self.tenant.as_deref().unwrap_or("platform"),
            self.role.as_str(),
            if self.revoked { " (revoked)" } else { "" }
        )
    }
}

#[derive(Debug, Clone)]
struct Account {
    tenant: Option<String>,
    currency: &'static str,
}

/// What the run knows, as of the start of a batch.
#[derive(Debug, Clone, Default)]
struct Model {
    accounts: BTreeMap<String, Account>,
    /// The sum of the opening balances, per currency: the total no transfer changes.
    opened: BTreeMap<&'static str, i64>,
    /// Every transfer the run learnt of: its accounts.
    transfers: BTreeMap<String, Vec<String>>,
    keys: Vec<Key>,
    /// Account ids handed out so far.
    next_account: usize,
}

impl Model {
    /// Whether `key` sees the account `id` (which must exist).
    fn sees_account(&self, key: &Key, id: &str) -> bool {
        match self.accounts.get(id) {
            None => false,
            Some(account) => key.tenant.is_none() || account.tenant == key.tenant,
        }
    }

    /// The tenants of a transfer between `accounts`.
    fn tenants_of<'a>(&self, accounts: impl IntoIterator<Item = &'a String>) -> BTreeSet<String> {
        accounts
            .into_iter()
            .filter_map(|a| self.accounts.get(a).and_then(|a| a.tenant.clone()))
            .collect()
    }

    fn sees_transfer(&self, key: &Key, accounts: &[String]) -> bool {
        match &key.tenant {
            None => true,
            Some(own) => self.tenants_of(accounts).contains(own),
        }
    }

    /// Whether every account of the transfer is `key`'s tenant's (a platform key owns
    /// everything).
    fn owns_transfer(&self, key: &Key, accounts: &[String]) -> bool {
        match &key.tenant {
            None => true,
            Some(own) => accounts
                .iter()
                .all(|a| self.accounts.get(a).and_then(|a| a.tenant.as_ref()) == Some(own)),
        }
    }
}

/// A request of a batch.
#[derive(Debug, Clone)]
enum Action {
    Open {
        id: Option<String>,
        tenant: Option<String>,
        currency: &'static str,
        balance: i64,
    },
    Transfer {
        source: String,
        destination: String,
        amount: i64,
        hold: bool,
    },
    Legs(Vec<(String, String, i64)>),
    /// `capture`, `void` or `cancel`.
    Act(&'static str, String),
    ReadAccount(String, &'static str),
    ReadTransfer(String),
    ListAccounts,
    ListTransfers,
    ListAccountTransfers(String),
    Feed,
    ListKeys,
    MakeKey {
        tenant: Option<String>,
        role: Role,
    },
    Revoke(String),
}

/// What an answer must be.
#[derive(Debug, Clone)]
enum Expect {
    /// This success status, or one of these refusals (status, code).
    Ok(u16, Vec<(u16, &'static str)>),
    /// Exactly this problem; for `unknown_account`, naming this account.
    Problem(u16, &'static str, Vec<String>),
}

/// What a batch's answer teaches the model.
enum Learnt {
    Nothing,
    Account(String, Account, i64),
    /// A transfer, and whether a tenant's key asked for it (its tenant).
    Transfer(String),
    Key(Key),
    Revoked(String),
}

/// The run's one context: every assertion message names the seed.
struct Run {
    app: TestApp,
    seed: u64,
    /// How many answers of each status and code: what the run exercised.
    answers: Mutex<BTreeMap<String, usize>>,
}

impl Run {
    async fn call(
        &self,
        key: &str,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut request = self
            .app
            .http
            .request(method.clone(), self.app.url(path))
            .bearer_auth(key);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request
            .send()
            .await
            .unwrap_or_else(|e| panic!("TENANT_SEED={}: {method} {path}: {e}", self.seed));
        let status = response.status().as_u16();
        let text = response.text().await.unwrap_or_default();
        let body = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        (status, body)
    }

    /// Every item of a listing, following its pages (`limit` a page).
    async fn listed(&self, key: &str, path: &str, limit: usize, what: &str) -> Vec<Value> {
        self.listed_pages(key, path, limit, usize::MAX, what).await
    }

    /// The items of the first `pages` pages of a listing (`limit` a page).
    async fn listed_pages(
        &self,
        key: &str,
        path: &str,
        limit: usize,
        pages: usize,
        what: &str,
    ) -> Vec<Value> {
        let mut items = Vec::new();
        let mut after: Option<String> = None;
        for _ in 0..pages {
            let sep = if path.contains('?') { '&' } else { '?' };
            let url = match &after {
                Some(a) => format!("{path}{sep}limit={limit}&after={a}"),
                None => format!("{path}{sep}limit={limit}"),
            };
            let (status, page) = self.call(key, Method::GET, &url, None).await;
            assert_eq!(
                status, 200,
                "TENANT_SEED={}: {what}: GET {url}: {page}",
                self.seed
            );
            items.extend(page["items"].as_array().cloned().unwrap_or_default());
            match page["next"].as_str() {
                Some(next) => after = Some(next.to_owned()),
                None => break,
            }
        }
        items
    }

    /// The feed as `key` reads it from the oldest event, to its end (`pages` at most).
    async fn feed(&self, key: &str, pages: usize, what: &str) -> Vec<String> {
        let mut ids = Vec::new();
        let mut query = "/events?limit=50".to_owned();
        for _ in 0..pages {
            let (status, page) = self.call(key, Method::GET, &query, None).await;
            assert_eq!(
                status, 200,
                "TENANT_SEED={}: {what}: GET {query}: {page}",
                self.seed
            );
            let items = page["items"].as_array().cloned().unwrap_or_default();
            if items.is_empty() {
                break;
            }
            ids.extend(items.iter().map(|e| e["id"].as_str().unwrap().to_owned()));
            query = format!("/events?limit=50&after={}", page["next"].as_str().unwrap());
        }
        ids
    }

    /// The feed of `key` once the account `barrier` it sees shows in it (the recorder
    /// records in order: whatever came before the barrier is there too).
    async fn feed_to(&self, key: &str, barrier: &str, what: &str) -> BTreeSet<String> {
        let wanted = format!("account.opened:{barrier}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ids: BTreeSet<String> =
                self.feed(key, usize::MAX, what).await.into_iter().collect();
            if ids.contains(&wanted) {
                return ids;
            }
            assert!(
                Instant::now() < deadline,
                "TENANT_SEED={}: {what}: {wanted} never came in the feed",
                self.seed
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The tenant of account `id`: as the model knows it, or as this batch opens it, or
    /// (an id the service made in this batch) as stored.
    async fn tenant_of(
        &self,
        model: &Model,
        opening: &BTreeMap<String, Option<String>>,
        id: &str,
    ) -> Option<String> {
        if let Some(account) = model.accounts.get(id) {
            return account.tenant.clone();
        }
        if let Some(tenant) = opening.get(id) {
            return tenant.clone();
        }
        let stored = self
            .app
            .store
            .accounts()
            .account(&support::values::account(id))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("TENANT_SEED={}: account {id} is stored", self.seed));
        stored.tenant.map(|t| t.to_string())
    }

    /// The accounts of a transfer the model may not know yet (made concurrently), as
    /// stored.
    async fn stored_accounts(&self, id: &str) -> Vec<String> {
        let transfer = self
            .app
            .store
            .transfers()
            .transfer(TransferId::parse(id).unwrap())
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("TENANT_SEED={}: transfer {id} is stored", self.seed));
        accounts_of_stored(&transfer)
    }
}

fn accounts_of_stored(transfer: &transfer_service::domain::Transfer) -> Vec<String> {
    match &transfer.legs {
        Some(legs) => legs
            .parties()
            .iter()
            .map(|p| p.account.to_string())
            .collect(),
        None => vec![
            transfer.source.to_string(),
            transfer.destination.to_string(),
        ],
    }
}

/// The accounts of a transfer as the API answers it.
fn accounts_of(transfer: &Value) -> Vec<String> {
    match transfer["legs"].as_array() {
        Some(legs) => legs
            .iter()
            .flat_map(|l| [l["source"].as_str(), l["destination"].as_str()])
            .map(|a| a.unwrap().to_owned())
            .collect(),
        None => vec![
            transfer["source"].as_str().unwrap().to_owned(),
            transfer["destination"].as_str().unwrap().to_owned(),
        ],
    }
}

/// A random account id: mostly one that exists, sometimes one nobody has.
fn any_account(rng: &mut StdRng, model: &Model) -> String {
    if model.accounts.is_empty() || rng.random_ratio(1, 10) {
        return GHOST_ACCOUNTS.choose(rng).unwrap().to_string();
    }
    let ids: Vec<&String> = model.accounts.keys().collect();
    (*ids.choose(rng).unwrap()).clone()
}

/// A random account `key` sees, mostly; now and then any (or one nobody has).
fn an_account(rng: &mut StdRng, model: &Model, key: &Key) -> String {
    let seen: Vec<&String> = model
        .accounts
        .keys()
        .filter(|a| model.sees_account(key, a))
        .collect();
    if seen.len() < 2 || rng.random_ratio(1, 3) {
        return any_account(rng, model);
    }
    (*seen.choose(rng).unwrap()).clone()
}

/// Two different random accounts, mostly of one currency.
fn two_accounts(rng: &mut StdRng, model: &Model, key: &Key) -> (String, String) {
    loop {
        let a = an_account(rng, model, key);
        let b = an_account(rng, model, key);
        let currency = |id: &String| model.accounts.get(id).map(|a| a.currency);
        let mismatch =
            currency(&a).is_some() && currency(&b).is_some() && currency(&a) != currency(&b);
        if a != b && (!mismatch || rng.random_ratio(1, 5)) {
            return (a, b);
        }
    }
}

fn any_transfer(rng: &mut StdRng, model: &Model) -> String {
    if model.transfers.is_empty() || rng.random_ratio(1, 10) {
        return GHOST_TRANSFER.to_owned();
    }
    let ids: Vec<&String> = model.transfers.keys().collect();
    (*ids.choose(rng).unwrap()).clone()
}

fn any_tenant(rng: &mut StdRng) -> String {
    TENANTS.choose(rng).unwrap().to_string()
}

/// A random request for `key`.
fn action(rng: &mut StdRng, model: &mut Model, key: &Key, revocable: &[Key]) -> Action {
    match rng.random_range(0..100) {
        0..12 => {
            // Into its own tenant, naming it or not, or naming another; the platform into
            // any or none. Now and then an id already taken, or none (the service's).
            let tenant = match rng.random_range(0..3) {
                0 => None,
                1 => key.tenant.clone(),
                _ => Some(any_tenant(rng)),
            };
            let id = match rng.random_range(0..10) {
                0 if !model.accounts.is_empty() => {
                    Some(any_account(rng, model)).filter(|a| !GHOST_ACCOUNTS.contains(&a.as_str()))
                }
                1 => None,
                _ => {
                    model.next_account += 1;
                    let tag = tenant
                        .as_deref()
                        .or(key.tenant.as_deref())
                        .unwrap_or("none");
                    Some(format!("a{:04}-{tag}", model.next_account))
                }
            };
            Action::Open {
                id,
                tenant,
                currency: CURRENCIES.choose(rng).unwrap(),
                balance: rng.random_range(0..1_000),
            }
        }
        12..30 => {
            let (source, destination) = two_accounts(rng, model, key);
            Action::Transfer {
                source,
                destination,
                amount: rng.random_range(1..200),
                hold: rng.random_ratio(1, 3),
            }
        }
        30..38 => {
            let legs = (0..rng.random_range(2..4))
                .map(|_| {
                    let (s, d) = two_accounts(rng, model, key);
                    (s, d, rng.random_range(1..100))
                })
                .collect();
            Action::Legs(legs)
        }
        38..52 => {
            let act = ["capture", "void", "cancel"].choose(rng).unwrap();
            Action::Act(act, any_transfer(rng, model))
        }
        52..64 => {
            let what = ["", "/entries", "/balance"].choose(rng).unwrap();
            Action::ReadAccount(an_account(rng, model, key), what)
        }
        64..70 => Action::ReadTransfer(any_transfer(rng, model)),
        70..75 => Action::ListAccounts,
        75..80 => Action::ListTransfers,
        80..84 => Action::ListAccountTransfers(an_account(rng, model, key)),
        84..89 => Action::Feed,
        89..92 => Action::ListKeys,
        92..96 => Action::MakeKey {
            tenant: match rng.random_range(0..3) {
                0 => None,
                1 => key.tenant.clone(),
                _ => Some(any_tenant(rng)),
            },
            role: *[Role::Ro, Role::Rw, Role::Admin].choose(rng).unwrap(),
        },
        _ => match revocable.choose(rng) {
            Some(victim) if rng.random_ratio(4, 5) => Action::Revoke(victim.id.clone().unwrap()),
            _ => Action::Revoke(GHOST_KEY.to_owned()),
        },
    }
}

/// What `key`'s `action` must answer, by the model.
fn expect(model: &Model, key: &Key, action: &Action, revocable: &[Key]) -> Expect {
    use Expect::{Ok, Problem};
    if key.revoked {
        return Problem(401, "unauthorized", vec![]);
    }
    let writes = matches!(
        action,
        Action::Open { .. }
            | Action::Transfer { .. }
            | Action::Legs(_)
            | Action::Act(..)
            | Action::MakeKey { .. }
            | Action::Revoke(_)
    );
    if writes && !key.role.writes() {
        return Problem(403, "forbidden", vec![]);
    }
    let keys_route = matches!(
        action,
        Action::ListKeys | Action::MakeKey { .. } | Action::Revoke(_)
    );
    if keys_route && key.role != Role::Admin {
        return Problem(403, "forbidden", vec![]);
    }
    let funds = vec![(422, "insufficient_funds")];
    let not_seen = |accounts: &[&String]| -> Vec<String> {
        accounts
            .iter()
            .filter(|a| !model.sees_account(key, a))
            .map(|a| (*a).clone())
            .collect()
    };
    let same_currency = |accounts: &[&String]| {
        let currencies: BTreeSet<&str> = accounts
            .iter()
            .map(|a| model.accounts[*a].currency)
            .collect();
        currencies.len() == 1
    };
    match action {
        Action::Open { id, tenant, .. } => match (&key.tenant, tenant) {
            (Some(own), Some(named)) if own != named => Problem(422, "invalid_field", vec![]),
            _ if id
                .as_ref()
                .is_some_and(|id| model.accounts.contains_key(id)) =>
            {
                Problem(409, "account_exists", vec![])
            }
            _ => Ok(201, vec![]),
        },
        Action::Transfer {
            source,
            destination,
            ..
        } => {
            // Nobody's source is named first, then nobody's destination.
            for account in [source, destination] {
                if !model.sees_account(key, account) {
                    return Problem(422, "unknown_account", vec![account.clone()]);
                }
            }
            if !same_currency(&[source, destination]) {
                return Problem(422, "currency_mismatch", vec![]);
            }
            Ok(201, funds)
        }
        Action::Legs(legs) => {
            // The accounts in the order they first appear: the first nobody's is named.
            let mut accounts: Vec<&String> = Vec::new();
            for account in legs.iter().flat_map(|(s, d, _)| [s, d]) {
                if !accounts.contains(&account) {
                    accounts.push(account);
                }
            }
            // Legs that move no money (every account gets back what it pays) are refused
            // before any account is looked up.
            let net = |account: &String| -> i64 {
                let paid_in: i64 = legs.iter().filter(|l| &l.1 == account).map(|l| l.2).sum();
                let paid_out: i64 = legs.iter().filter(|l| &l.0 == account).map(|l| l.2).sum();
                paid_in - paid_out
            };
            if accounts.iter().all(|a| net(a) == 0) {
                return Problem(422, "invalid_field", vec![]);
            }
            if let Some(first) = not_seen(&accounts).into_iter().next() {
                return Problem(422, "unknown_account", vec![first]);
            }
            if !same_currency(&accounts) {
                return Problem(422, "currency_mismatch", vec![]);
            }
            Ok(201, funds)
        }
        Action::Act(act, id) => match model.transfers.get(id) {
            Some(accounts) if model.sees_transfer(key, accounts) => {
                if !model.owns_transfer(key, accounts) {
                    // Seen (one of its accounts is the tenant's), not the tenant's to move.
                    return Problem(403, "forbidden", vec![]);
                }
                let refusals = match *act {
                    "capture" => vec![
                        (409, "not_a_hold"),
                        (409, "hold_already_captured"),
                        (409, "hold_voided"),
                        (409, "hold_expired"),
                        (409, "hold_pending"),
                    ],
                    "void" => vec![(409, "not_a_hold"), (409, "hold_already_captured")],
                    _ => vec![(409, "transfer_canceled"), (422, "insufficient_funds")],
                };
                Ok(200, refusals)
            }
            _ => Problem(404, "transfer_not_found", vec![]),
        },
        Action::ReadAccount(id, _) | Action::ListAccountTransfers(id) => {
            if model.sees_account(key, id) {
                Ok(200, vec![])
            } else {
                Problem(404, "account_not_found", vec![])
            }
        }
        Action::ReadTransfer(id) => match model.transfers.get(id) {
            Some(accounts) if model.sees_transfer(key, accounts) => Ok(200, vec![]),
            _ => Problem(404, "transfer_not_found", vec![]),
        },
        Action::ListAccounts | Action::ListTransfers | Action::Feed | Action::ListKeys => {
            Ok(200, vec![])
        }
        Action::MakeKey { tenant, .. } => match (&key.tenant, tenant) {
            (Some(own), Some(named)) if own != named => Problem(403, "forbidden", vec![]),
            _ => Ok(201, vec![]),
        },
        Action::Revoke(id) => {
            let victim = revocable.iter().find(|k| k.id.as_ref() == Some(id));
            match victim {
                Some(victim) if key.tenant.is_none() || victim.tenant == key.tenant => {
                    Ok(204, vec![])
                }
                _ => Problem(404, "api_key_not_found", vec![]),
            }
        }
    }
}

/// The request of `action`: method, path and body.
fn request(action: &Action) -> (Method, String, Option<Value>) {
    match action {
        Action::Open {
            id,
            tenant,
            currency,
            balance,
        } => {
            let mut body = json!({ "balance": balance, "currency": currency });
            if let Some(id) = id {
                body["id"] = json!(id);
            }
            if let Some(tenant) = tenant {
                body["tenant"] = json!(tenant);
            }
            (Method::POST, "/accounts".into(), Some(body))
        }
        Action::Transfer {
            source,
            destination,
            amount,
            hold,
        } => {
            let mut body =
                json!({ "source": source, "destination": destination, "amount": amount });
            if *hold {
                body["hold"] = json!({});
            }
            (Method::POST, "/transfers".into(), Some(body))
        }
        Action::Legs(legs) => {
            let legs: Vec<Value> = legs
                .iter()
                .map(|(s, d, a)| json!({ "source": s, "destination": d, "amount": a }))
                .collect();
            (
                Method::POST,
                "/transfers".into(),
                Some(json!({ "legs": legs })),
            )
        }
        Action::Act(act, id) => (Method::POST, format!("/transfers/{id}/{act}"), None),
        Action::ReadAccount(id, what) => (Method::GET, format!("/accounts/{id}{what}"), None),
        Action::ReadTransfer(id) => (Method::GET, format!("/transfers/{id}"), None),
        Action::ListAccounts => (Method::GET, "/accounts?limit=7".into(), None),
        Action::ListTransfers => (Method::GET, "/transfers?limit=7".into(), None),
        Action::ListAccountTransfers(id) => (
            Method::GET,
            format!("/accounts/{id}/transfers?limit=7"),
            None,
        ),
        Action::Feed => (Method::GET, "/events?limit=50".into(), None),
        Action::ListKeys => (Method::GET, "/api-keys?limit=7".into(), None),
        Action::MakeKey { tenant, role } => {
            let mut body = json!({ "role": role.as_str() });
            if let Some(tenant) = tenant {
                body["tenant"] = json!(tenant);
            }
            (Method::POST, "/api-keys".into(), Some(body))
        }
        Action::Revoke(id) => (Method::DELETE, format!("/api-keys/{id}"), None),
    }
}

/// Sends `key`'s `action`, checks its answer against `expected` and what it lists
/// against `model` (plus `opening`, the accounts of this batch), and says what it made.
async fn run_one(
    run: &Run,
    model: &Model,
    opening: &BTreeMap<String, Option<String>>,
    key: &Key,
    action: &Action,
    expected: &Expect,
    at: &str,
) -> Vec<Learnt> {
    let (method, path, body) = request(action);
    let (status, answer) = run
        .call(&key.secret, method.clone(), &path, body.clone())
        .await;
    *run.answers
        .lock()
        .unwrap()
        .entry(format!(
            "{status} {}",
            answer["code"].as_str().unwrap_or("")
        ))
        .or_default() += 1;
    let context = format!(
        "TENANT_SEED={} {at}: {} {method} {path} {}: expected {expected:?}, answered {status} {answer}",
        run.seed,
        key.name(),
        body.map(|b| b.to_string()).unwrap_or_default(),
    );
    match expected {
        Expect::Problem(want, code, named) => {
            assert_eq!(status, *want, "{context}");
            assert_eq!(answer["code"], *code, "{context}");
            if !named.is_empty() {
                let account = answer["account"].as_str().unwrap_or_default();
                assert!(
                    named.iter().any(|n| n == account),
                    "{context}: names {account:?}"
                );
            }
            return vec![Learnt::Nothing];
        }
        Expect::Ok(want, refusals) => {
            let refused = refusals
                .iter()
                .any(|(s, code)| *s == status && answer["code"] == *code);
            assert!(status == *want || refused, "{context}");
            if refused {
                // A refused transfer is still recorded (canceled), seen by whom it touches.
                return match answer["transferId"].as_str() {
                    Some(id) if matches!(action, Action::Transfer { .. } | Action::Legs(_)) => {
                        vec![Learnt::Transfer(id.to_owned())]
                    }
                    _ => vec![Learnt::Nothing],
                };
            }
        }
    }
    // A successful answer: check what it shows, learn what it made.
    let sees_tenant = |tenant: &Option<String>| key.tenant.is_none() || *tenant == key.tenant;
    match action {
        Action::Open {
            tenant,
            currency,
            balance,
            ..
        } => {
            let id = answer["id"].as_str().unwrap().to_owned();
            let tenant = key.tenant.clone().or(tenant.clone());
            assert_eq!(answer["tenant"], json!(tenant), "{context}");
            vec![Learnt::Account(id, Account { tenant, currency }, *balance)]
        }
        Action::Transfer { .. } | Action::Legs(_) => {
            vec![Learnt::Transfer(answer["id"].as_str().unwrap().to_owned())]
        }
        Action::Act(..) => {
            assert!(model.owns_transfer(key, &accounts_of(&answer)), "{context}");
            match answer["reversedBy"].as_str() {
                Some(reversal) => vec![Learnt::Transfer(reversal.to_owned())],
                None => vec![Learnt::Nothing],
            }
        }
        Action::ListAccounts => {
            for item in run
                .listed_pages(&key.secret, "/accounts", 7, PAGES, &context)
                .await
            {
                let id = item["id"].as_str().unwrap();
                let tenant = run.tenant_of(model, opening, id).await;
                assert_eq!(item["tenant"], json!(tenant), "{context}: lists {item}");
                assert!(sees_tenant(&tenant), "{context}: lists {item}");
            }
            vec![Learnt::Nothing]
        }
        Action::ListTransfers | Action::ListAccountTransfers(_) => {
            let path = path.split('?').next().unwrap().to_owned();
            for item in run
                .listed_pages(&key.secret, &path, 7, PAGES, &context)
                .await
            {
                let accounts = accounts_of(&item);
                assert!(
                    model.sees_transfer(key, &accounts),
                    "{context}: lists {item}"
                );
                if let Action::ListAccountTransfers(account) = action {
                    assert!(accounts.contains(account), "{context}: lists {item}");
                }
            }
            vec![Learnt::Nothing]
        }
        Action::Feed => {
            for event in run.feed(&key.secret, PAGES, &context).await {
                let (kind, subject) = event.split_once(':').unwrap();
                let seen = if kind == "account.opened" {
                    sees_tenant(&run.tenant_of(model, opening, subject).await)
                } else {
                    let accounts = match model.transfers.get(subject) {
                        Some(accounts) => accounts.clone(),
                        None => run.stored_accounts(subject).await,
                    };
                    model.sees_transfer(key, &accounts)
                };
                assert!(seen, "{context}: the feed shows {event}");
            }
            vec![Learnt::Nothing]
        }
        Action::ListKeys => {
            for item in run
                .listed_pages(&key.secret, "/api-keys", 7, PAGES, &context)
                .await
            {
                assert!(
                    key.tenant.is_none() || item["tenant"].as_str() == key.tenant.as_deref(),
                    "{context}: lists {item}"
                );
                assert!(
                    item.get("key").is_none(),
                    "{context}: a secret listed: {item}"
                );
            }
            vec![Learnt::Nothing]
        }
        Action::MakeKey { tenant, role } => {
            let tenant = key.tenant.clone().or(tenant.clone());
            assert_eq!(answer["tenant"], json!(tenant), "{context}");
            vec![Learnt::Key(Key {
                secret: answer["key"].as_str().unwrap().to_owned(),
                id: Some(answer["id"].as_str().unwrap().to_owned()),
                tenant,
                role: *role,
                revoked: false,
                made_in_run: true,
            })]
        }
        Action::Revoke(id) => vec![Learnt::Revoked(id.clone())],
        Action::ReadAccount(..) | Action::ReadTransfer(_) => vec![Learnt::Nothing],
    }
}

/// Makes a key with `admin`: the key as the model holds it.
async fn make_key(run: &Run, admin: &str, tenant: Option<&str>, role: Role) -> Key {
    let mut body = json!({ "role": role.as_str() });
    if let Some(tenant) = tenant {
        body["tenant"] = json!(tenant);
    }
    let (status, made) = run.call(admin, Method::POST, "/api-keys", Some(body)).await;
    assert_eq!(status, 201, "TENANT_SEED={}: {made}", run.seed);
    Key {
        secret: made["key"].as_str().unwrap().to_owned(),
        id: Some(made["id"].as_str().unwrap().to_owned()),
        tenant: tenant.map(str::to_owned),
        role,
        revoked: false,
        made_in_run: false,
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(raw) => raw
            .parse()
            .unwrap_or_else(|_| panic!("{name} must be a number: {raw}")),
        Err(_) => default,
    }
}

#[tokio::test]
async fn random_requests_of_many_keys_see_and_move_only_what_their_tenant_owns() {
    let seed: u64 = env_or("TENANT_SEED", rand::random());
    let rounds: usize = env_or("TENANT_ROUNDS", ROUNDS);
    eprintln!("TENANT_SEED={seed} TENANT_ROUNDS={rounds}");
    let mut rng = StdRng::seed_from_u64(seed);
    let bootstrap = format!("admin-{}", ObjectId::new().to_hex());
    let raw = format!("admin:{bootstrap}");
    let app = spawn_app_with(|s| s.api_keys = parse_api_keys(&raw).unwrap()).await;
    let run = Run {
        app,
        seed,
        answers: Mutex::default(),
    };
    let started = Instant::now();

    let mut model = Model::default();
    model.keys.push(Key {
        secret: bootstrap.clone(),
        id: None,
        tenant: None,
        role: Role::Admin,
        revoked: false,
        made_in_run: false,
    });
    for tenant in TENANTS {
        for role in [Role::Rw, Role::Ro, Role::Admin] {
            let key = make_key(&run, &bootstrap, Some(tenant), role).await;
            model.keys.push(key);
        }
    }
    let platform_rw = make_key(&run, &bootstrap, None, Role::Rw).await;
    model.keys.push(platform_rw.clone());

    let mut moved_by: Vec<(String, Key)> = Vec::new();
    let mut requests = 0usize;
    for round in 0..rounds {
        // The keys of this batch: revocations name keys no other request of the batch
        // uses, so that every answer is decided by the model before the batch.
        let revocable: Vec<Key> = model
            .keys
            .iter()
            .filter(|k| k.made_in_run && !k.revoked)
            .cloned()
            .collect();
        let mut planned = Vec::new();
        let mut batch_model = model.clone();
        let mut untouchable: BTreeSet<String> = BTreeSet::new();
        for _ in 0..BATCH {
            // Mostly keys that write; revoked ones now and then.
            let key = loop {
                let key = model.keys.choose(&mut rng).unwrap().clone();
                let untouched = !key.id.as_ref().is_some_and(|id| untouchable.contains(id));
                let likely = match (key.revoked, key.role) {
                    (true, _) => rng.random_ratio(1, 6),
                    (false, Role::Ro) => rng.random_ratio(1, 2),
                    (false, _) => true,
                };
                if untouched && likely {
                    break key;
                }
            };
            let candidates: Vec<Key> = revocable
                .iter()
                .filter(|k| k.id != key.id)
                .filter(|k| {
                    !planned
                        .iter()
                        .any(|(used, _, _): &(Key, Action, Expect)| used.id == k.id)
                })
                .cloned()
                .collect();
            let action = action(&mut rng, &mut batch_model, &key, &candidates);
            if let Action::Revoke(id) = &action {
                if planned
                    .iter()
                    .any(|(_, a, _)| matches!(a, Action::Revoke(other) if other == id))
                {
                    continue;
                }
                untouchable.insert(id.clone());
            }
            let expected = expect(&model, &key, &action, &candidates);
            planned.push((key, action, expected));
        }
        model.next_account = batch_model.next_account;
        // The accounts this batch may open, with their tenant, for listings that show
        // them before their answer comes.
        let opening: BTreeMap<String, Option<String>> = planned
            .iter()
            .filter_map(|(key, action, _)| match action {
                Action::Open {
                    id: Some(id),
                    tenant,
                    ..
                } if !model.accounts.contains_key(id) => {
                    Some((id.clone(), key.tenant.clone().or(tenant.clone())))
                }
                _ => None,
            })
            .collect();
        let learnt = join_all(
            planned
                .iter()
                .enumerate()
                .map(|(i, (key, action, expected))| {
                    let at = format!("round {round} request {i}");
                    let (model, opening) = (&model, &opening);
                    let run = &run;
                    async move { run_one(run, model, opening, key, action, expected, &at).await }
                }),
        )
        .await;
        requests += planned.len();
        for ((key, action, _), learnt) in planned.iter().zip(learnt) {
            for learnt in learnt {
                match learnt {
                    Learnt::Nothing => {}
                    Learnt::Account(id, account, balance) => {
                        *model.opened.entry(account.currency).or_default() += balance;
                        model.accounts.insert(id, account);
                    }
                    Learnt::Transfer(id) => {
                        let accounts = run.stored_accounts(&id).await;
                        if matches!(
                            action,
                            Action::Transfer { .. } | Action::Legs(_) | Action::Act(..)
                        ) {
                            moved_by.push((id.clone(), key.clone()));
                        }
                        model.transfers.insert(id, accounts);
                    }
                    Learnt::Key(new) => model.keys.push(new),
                    Learnt::Revoked(id) => {
                        for k in model.keys.iter_mut().filter(|k| k.id.as_ref() == Some(&id)) {
                            k.revoked = true;
                        }
                    }
                }
            }
        }
    }
    eprintln!(
        "TENANT_SEED={seed}: {requests} requests in {rounds} batches, {:?}; {} accounts, {} transfers, {} keys",
        started.elapsed(),
        model.accounts.len(),
        model.transfers.len(),
        model.keys.len()
    );
    eprintln!("answers: {:?}", run.answers.lock().unwrap());
    check_quiet(&run, &model, &moved_by).await;
}

/// Once all is quiet: the money, the transfers' tenants, who moved what, and every
/// reader's listings and feed exactly as the model says.
async fn check_quiet(run: &Run, model: &Model, moved_by: &[(String, Key)]) {
    let seed = run.seed;
    // No money made or lost, per currency.
    let stored = run
        .app
        .store
        .accounts()
        .list_accounts(None, None, 10_000)
        .await
        .unwrap();
    let mut totals: BTreeMap<&'static str, i64> = BTreeMap::new();
    for account in &stored {
        let currency = CURRENCIES
            .iter()
            .find(|c| **c == account.currency.to_string())
            .unwrap();
        *totals.entry(currency).or_default() += account.balance;
    }
    let opened: BTreeMap<&'static str, i64> = model
        .opened
        .iter()
        .filter(|(_, v)| **v != 0)
        .map(|(k, v)| (*k, *v))
        .collect();
    let totals: BTreeMap<&'static str, i64> = totals.into_iter().filter(|(_, v)| *v != 0).collect();
    assert_eq!(totals, opened, "TENANT_SEED={seed}: the money per currency");
    assert_eq!(
        stored.len(),
        model.accounts.len(),
        "TENANT_SEED={seed}: the accounts"
    );

    // Every transfer inserted with the tenants of its accounts; the platform lists them
    // all, and the model knows each one it learnt of.
    let platform = model
        .keys
        .iter()
        .find(|k| k.tenant.is_none() && k.role == Role::Rw && !k.revoked)
        .unwrap();
    let all: BTreeMap<String, Vec<String>> = run
        .listed(
            &platform.secret,
            "/transfers",
            100,
            "the platform's transfers",
        )
        .await
        .iter()
        .map(|t| (t["id"].as_str().unwrap().to_owned(), accounts_of(t)))
        .collect();
    for id in model.transfers.keys() {
        assert!(
            all.contains_key(id),
            "TENANT_SEED={seed}: {id} is not listed"
        );
    }
    for (id, accounts) in &all {
        let transfer = run
            .app
            .store
            .transfers()
            .transfer(TransferId::parse(id).unwrap())
            .await
            .unwrap()
            .unwrap();
        let tenants: BTreeSet<String> = transfer
            .tenants
            .names()
            .iter()
            .map(|t| t.to_string())
            .collect();
        assert_eq!(
            tenants,
            model.tenants_of(accounts),
            "TENANT_SEED={seed}: {id}'s tenants as recorded"
        );
    }
    // No tenant's key moved an account that is not its tenant's.
    for (id, key) in moved_by {
        let accounts = &model.transfers[id];
        assert!(
            model.owns_transfer(key, accounts),
            "TENANT_SEED={seed}: {} made {id}, which moves {accounts:?}",
            key.name()
        );
    }

    // Every reader: its listings exactly what it sees.
    let mut readers: Vec<&Key> = TENANTS
        .iter()
        .map(|t| {
            model
                .keys
                .iter()
                .find(|k| k.tenant.as_deref() == Some(*t) && !k.revoked && k.role != Role::Ro)
                .unwrap()
        })
        .collect();
    readers.push(platform);
    for key in &readers {
        let who = key.name();
        let accounts: BTreeSet<String> = run
            .listed(&key.secret, "/accounts", 13, &who)
            .await
            .iter()
            .map(|a| a["id"].as_str().unwrap().to_owned())
            .collect();
        let expected: BTreeSet<String> = model
            .accounts
            .keys()
            .filter(|a| model.sees_account(key, a))
            .cloned()
            .collect();
        assert_eq!(accounts, expected, "TENANT_SEED={seed}: {who}'s accounts");
        let transfers: BTreeSet<String> = run
            .listed(&key.secret, "/transfers", 13, &who)
            .await
            .iter()
            .map(|t| t["id"].as_str().unwrap().to_owned())
            .collect();
        let expected: BTreeSet<String> = all
            .iter()
            .filter(|(_, accounts)| model.sees_transfer(key, accounts))
            .map(|(id, _)| id.clone())
            .collect();
        assert_eq!(transfers, expected, "TENANT_SEED={seed}: {who}'s transfers");
    }
    // The keys each admin lists: every live key of its tenant (the platform's: all).
    for tenant in TENANTS.iter().map(|t| Some(t.to_string())).chain([None]) {
        let admin = model
            .keys
            .iter()
            .find(|k| k.tenant == tenant && k.role == Role::Admin && !k.revoked)
            .unwrap();
        let listed: BTreeSet<String> = run
            .listed(&admin.secret, "/api-keys", 13, &admin.name())
            .await
            .iter()
            .map(|k| k["id"].as_str().unwrap().to_owned())
            .collect();
        let expected: BTreeSet<String> = model
            .keys
            .iter()
            .filter(|k| !k.revoked && (tenant.is_none() || k.tenant == tenant))
            .filter_map(|k| k.id.clone())
            .collect();
        assert_eq!(
            listed,
            expected,
            "TENANT_SEED={seed}: {}'s keys",
            admin.name()
        );
    }

    // The feeds: a barrier each, then each reader's feed is the platform's, less what
    // it does not see.
    let mut barriers = Vec::new();
    for key in &readers {
        let barrier = format!("z-{}", key.tenant.as_deref().unwrap_or("none"));
        let (status, body) = run
            .call(
                &key.secret,
                Method::POST,
                "/accounts",
                Some(json!({ "id": barrier, "currency": "EUR" })),
            )
            .await;
        assert_eq!(
            status, 201,
            "TENANT_SEED={seed}: the barrier {barrier}: {body}"
        );
        barriers.push(barrier);
    }
    let everything = run
        .feed_to(&platform.secret, "z-none", "the platform's feed")
        .await;
    let barrier_tenant = |id: &str| -> Option<Option<String>> {
        id.strip_prefix("z-")
            .map(|t| (t != "none").then(|| t.to_owned()))
    };
    for id in model.accounts.keys() {
        let event = format!("account.opened:{id}");
        assert!(
            everything.contains(&event),
            "TENANT_SEED={seed}: {event} is not in the feed"
        );
    }
    for (key, barrier) in readers.iter().zip(&barriers) {
        let who = key.name();
        let feed = run.feed_to(&key.secret, barrier, &who).await;
        let expected: BTreeSet<String> = everything
            .iter()
            .filter(|event| {
                let (kind, subject) = event.split_once(':').unwrap();
                if kind == "account.opened" {
                    let tenant = barrier_tenant(subject)
                        .unwrap_or_else(|| model.accounts[subject].tenant.clone());
                    key.tenant.is_none() || tenant == key.tenant
                } else {
                    let accounts = all.get(subject).unwrap_or_else(|| {
                        panic!("TENANT_SEED={seed}: {event} of a transfer nobody lists")
                    });
                    model.sees_transfer(key, accounts)
                }
            })
            .cloned()
            .collect();
        assert_eq!(feed, expected, "TENANT_SEED={seed}: {who}'s feed");
    }
}
