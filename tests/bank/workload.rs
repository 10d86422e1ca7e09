//! The workload: what the clients do. [`CLIENTS`] clients make many concurrent requests,
//! each to a random live instance, among [`ACCOUNTS`] accounts (the first [`HOT`] of them
//! hot: half the accounts drawn are one of those), each opened with
//! [`OPENING_BALANCE`]: transfers, some with an idempotency key (retried on another
//! instance with the same key when the answer is lost or the database is unavailable,
//! up to [`KEYED_ATTEMPTS`] times), some asynchronous (`Prefer: respond-async`), some
//! sent twice with the same key (a client retrying a request whose answer it already
//! had); cancels of transfers answered before; and holds ([`HOLD_PERCENT`] of the
//! requests: the same accounts, references and idempotency keys as transfers) that
//! expire within [`HOLD_EXPIRES_MS`], some of them multi-leg. After a random short delay
//! each hold answered `held` is captured in full, captured in part (a multi-leg hold is
//! captured whole instead), voided, or left to expire (and now and
//! then captured or voided after its expiry, or its request replayed) ([`HoldPlan`]), by
//! requests to random live instances that are retried like the others. While a
//! deployment is down, one more client moves money between the others
//! ([`probe_while_down`]).
//!
//! Every request carries a `reference` unique to it, so that its transfer can be found
//! at the end whatever happened to the answers. Every answer goes to the
//! [`History`], which judges it on the spot and keeps it for the checks.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::Rng;
use rand::seq::IndexedRandom;
use serde_json::{Value, json};
use support::process::Instance;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use transfer_service::domain::{Timestamp, Transfer, TransferState};

use crate::checker::history::{
    Attempt, History, ResolveAttempt, record_cancel, record_resolve, record_transfer,
};
use crate::deployments::Layout;
use crate::nemesis::PROXIED;

pub const ACCOUNTS: usize = 12;
const HOT: usize = 3;
pub const OPENING_BALANCE: i64 = 1_000;
pub const CLIENTS: usize = 12;
/// Attempts of a transfer request with an idempotency key (one without a key is sent
/// once: a retry could make a second transfer).
const KEYED_ATTEMPTS: usize = 8;
/// Percent of the client requests that are holds.
const HOLD_PERCENT: u32 = 20;
/// A hold's `expiresInMs`, drawn from this range: short, so that some captures and voids
/// lose the race with the expiry and every hold left alone expires during the run.
pub const HOLD_EXPIRES_MS: std::ops::RangeInclusive<u64> = 1000..=4000;

pub fn account(i: usize) -> String {
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

/// One transfer request as a client meant it. Its `reference` is unique to the request,
/// so that its transfer can be found at the end whatever happened to the answers.
#[derive(Debug, Clone)]
pub struct Request {
    pub reference: String,
    pub key: Option<String>,
    pub source: String,
    pub destination: String,
    pub amount: i64,
    /// A hold's `expiresInMs`; `None` for a plain transfer.
    pub hold: Option<u64>,
    /// A multi-leg transfer's legs (`source`, `destination`, `amount` each): then the
    /// request sends these instead, and `source`, `destination` and `amount` are its
    /// first leg's and the money the legs move (`docs/legs.md`).
    pub legs: Option<Vec<(String, String, i64)>>,
}

impl Request {
    pub fn body(&self) -> Value {
        if let Some(legs) = &self.legs {
            let legs: Vec<Value> = legs
                .iter()
                .map(|(s, d, a)| json!({ "source": s, "destination": d, "amount": a }))
                .collect();
            let mut body = json!({ "legs": legs, "reference": self.reference });
            if let Some(expires_in_ms) = self.hold {
                body["hold"] = json!({ "expiresInMs": expires_in_ms });
            }
            return body;
        }
        let mut body = json!({
            "source": self.source,
            "destination": self.destination,
            "amount": self.amount,
            "reference": self.reference,
        });
        if let Some(expires_in_ms) = self.hold {
            body["hold"] = json!({ "expiresInMs": expires_in_ms });
        }
        body
    }

    /// Why `t` is not the transfer this request asked for, if it is not. A hold reserved
    /// the amount asked for; its `amount` is the held one until a capture makes it the
    /// captured one, which is at most the held one.
    pub fn mismatch(&self, t: &Transfer) -> Option<String> {
        let amounts = match (self.hold, t.hold) {
            (None, None) => t.amount.minor_units() == self.amount,
            (Some(_), Some(hold)) => {
                hold.amount.minor_units() == self.amount
                    && t.amount <= hold.amount
                    && (matches!(t.state, TransferState::Done | TransferState::Capturing)
                        || t.amount == hold.amount)
            }
            _ => false,
        };
        let legs = match (&self.legs, t.legs.as_deref()) {
            (None, None) => true,
            (Some(asked), Some(made)) => {
                asked.len() == made.legs().len()
                    && asked.iter().zip(made.legs()).all(|((s, d, a), l)| {
                        l.source.as_str() == s
                            && l.destination.as_str() == d
                            && l.amount.minor_units() == *a
                    })
            }
            _ => false,
        };
        let same = t.source.as_str() == self.source
            && t.destination.as_str() == self.destination
            && legs
            && amounts
            && t.reference.as_ref().map(|r| r.as_str()) == Some(self.reference.as_str())
            && t.reverses.is_none();
        (!same).then(|| format!("transfer {t:?} does not match its request {self:?}"))
    }
}

/// What a client does with a hold it was answered `held` for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum HoldPlan {
    CaptureAll,
    CapturePart,
    Void,
    /// Left alone until its expiry...
    Expire,
    /// ...then captured, too late...
    ExpireThenCapture,
    /// ...or voided, too late.
    ExpireThenVoid,
}

impl HoldPlan {
    pub fn label(self) -> &'static str {
        match self {
            HoldPlan::CaptureAll => "capture all",
            HoldPlan::CapturePart => "capture part",
            HoldPlan::Void => "void",
            HoldPlan::Expire => "left to expire",
            HoldPlan::ExpireThenCapture => "left to expire, then captured",
            HoldPlan::ExpireThenVoid => "left to expire, then voided",
        }
    }
}

/// A capture or a void of a hold, as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolve {
    /// A capture of `amount` (`None`: no body, so the whole hold).
    Capture {
        amount: Option<i64>,
    },
    Void,
}

impl Resolve {
    pub fn path(self) -> &'static str {
        match self {
            Resolve::Capture { .. } => "capture",
            Resolve::Void => "void",
        }
    }
}

/// A hold as its 201 `held` answer described it.
#[derive(Debug, Clone)]
pub struct HeldHold {
    pub id: String,
    pub held: i64,
    pub expires_at: Timestamp,
}

/// The live instances' base URLs, for clients to pick from.
pub type Bases = Arc<Mutex<Vec<Option<String>>>>;

/// The clients of a run: the live instances they pick from, what they saw, and what
/// stops them.
pub struct Clients {
    /// Shared with the nemesis, which takes an instance out while it is down.
    pub bases: Bases,
    pub history: Arc<Mutex<History>>,
    /// Cancelled when the load is over; a probe stops with it too.
    pub stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Clients {
    /// Starts [`CLIENTS`] clients against `instances`.
    pub fn start(instances: &[Instance]) -> Clients {
        let bases: Bases = Arc::new(Mutex::new(
            instances.iter().map(|i| Some(i.base.clone())).collect(),
        ));
        let history = Arc::new(Mutex::new(History::default()));
        let stop = CancellationToken::new();
        let tasks = (0..CLIENTS)
            .map(|seed| tokio::spawn(client(seed, bases.clone(), history.clone(), stop.clone())))
            .collect();
        Clients {
            bases,
            history,
            stop,
            tasks,
        }
    }

    /// Stops the clients and waits until each has finished (the holds it follows too).
    pub async fn finish(&mut self) {
        self.stop.cancel();
        for c in self.tasks.drain(..) {
            c.await.unwrap();
        }
    }
}

/// Opens every account with [`OPENING_BALANCE`], on its layout's deployment, through an
/// instance with a direct connection: no fault may refuse them.
pub async fn open_accounts(layout: Layout, instances: &[Instance]) {
    let http = reqwest::Client::new();
    let opener = PROXIED
        .iter()
        .position(|p| !p)
        .expect("an unproxied instance");
    for i in 0..ACCOUNTS {
        let mut body = json!({ "id": account(i), "balance": OPENING_BALANCE });
        if layout != Layout::OneDeployment {
            body["deployment"] = json!(layout.deployments()[layout.home(i)]);
        }
        let r = http
            .post(instances[opener].url("/accounts"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
    }
}

/// A live instance: its slot and base URL.
pub fn live_base(bases: &Bases, rng: &mut impl Rng) -> Option<(usize, String)> {
    live_base_except(bases, rng, usize::MAX)
}

/// A live instance other than the one in slot `except`.
pub fn live_base_except(
    bases: &Bases,
    rng: &mut impl Rng,
    except: usize,
) -> Option<(usize, String)> {
    let bases = bases.lock().unwrap();
    let live: Vec<(usize, &String)> = bases
        .iter()
        .enumerate()
        .filter(|(slot, _)| *slot != except)
        .filter_map(|(slot, base)| base.as_ref().map(|b| (slot, b)))
        .collect();
    live.choose(rng)
        .map(|(slot, base)| (*slot, (*base).clone()))
}

/// The problem `code` of an answer, "" when there is none.
pub fn code_of(answer: &Value) -> &str {
    answer["code"].as_str().unwrap_or("")
}

/// The answers a transfer request may get and go on, with a retry, to another one.
pub fn retryable(status: u16, code: &str) -> bool {
    status == 503
        && matches!(
            code,
            "database_unavailable" | "contended" | "request_timeout"
        )
}

/// One transfer request, retried on another instance with the same idempotency key when
/// the answer is lost (a killed instance) or the database is unavailable. The definitive
/// answer, if one came (its status and body).
async fn transfer(
    http: &reqwest::Client,
    bases: &Bases,
    history: &Mutex<History>,
    request: &Request,
    respond_async: bool,
) -> Option<(u16, Value)> {
    let attempts = if request.key.is_some() {
        KEYED_ATTEMPTS
    } else {
        1
    };
    let mut sent = false;
    for attempt in 0..attempts {
        let Some((slot, base)) = live_base(bases, &mut rand::rng()) else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let http_request = transfer_request(http, &base, request, respond_async);
        let sent_before = history.lock().unwrap().sending(request, slot);
        sent = true;
        let this = Attempt {
            number: attempt,
            sent_before,
            sent: Instant::now(),
        };
        let response = match http_request.send().await {
            Ok(r) => r,
            Err(_) => {
                let mut h = history.lock().unwrap();
                h.in_flight.remove(&request.reference);
                h.count("transfer: connection lost");
                continue;
            }
        };
        let status = response.status().as_u16();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let answer = response.json::<Value>().await;
        history.lock().unwrap().in_flight.remove(&request.reference);
        let answer = match answer {
            Ok(answer) => answer,
            Err(_) => {
                // The instance died while sending the body: as good as no answer.
                history.lock().unwrap().count("transfer: body lost");
                continue;
            }
        };
        if record_transfer(history, request, &this, status, replayed, &answer) {
            return Some((status, answer));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut h = history.lock().unwrap();
    if sent {
        h.count("transfer: no definitive answer");
        h.unanswered.push(request.clone());
    } else {
        h.count("transfer: never sent");
        h.unsent += 1;
    }
    None
}

/// `request` as sent to the instance at `base`: its idempotency key, if any, and the
/// preference for an asynchronous answer, if asked for.
fn transfer_request(
    http: &reqwest::Client,
    base: &str,
    request: &Request,
    respond_async: bool,
) -> reqwest::RequestBuilder {
    let mut http_request = http.post(format!("{base}/transfers")).json(&request.body());
    if let Some(key) = &request.key {
        http_request = http_request.header("idempotency-key", key);
    }
    if respond_async {
        http_request = http_request.header("prefer", "respond-async");
    }
    http_request
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
        let Some((_, base)) = live_base(bases, &mut rng) else {
            return;
        };
        (base, id)
    };
    cancel_one(http, &base, id, history, "cancel").await;
}

/// One cancel of transfer `id` at `base`; its answer is counted under `label`.
pub async fn cancel_one(
    http: &reqwest::Client,
    base: &str,
    id: String,
    history: &Mutex<History>,
    label: &str,
) {
    let response = http
        .post(format!("{base}/transfers/{id}/cancel"))
        .send()
        .await;
    let (status, answer) = match response {
        Ok(r) => {
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.ok())
        }
        Err(_) => (0, None),
    };
    record_cancel(history, id, label, status, answer);
}

/// A hold request; if it is answered `held`, what its client does with the hold (after a
/// short random delay: capture all or part, void, or leave it to expire) goes on in a
/// task of its own, returned, so that the client makes its next request meanwhile.
async fn hold(
    http: &reqwest::Client,
    bases: &Bases,
    history: &Arc<Mutex<History>>,
    request: &Request,
) -> Option<tokio::task::JoinHandle<()>> {
    let (status, answer) = transfer(http, bases, history, request, false).await?;
    if status != 201 || answer["state"] != "held" {
        return None;
    }
    let held = HeldHold {
        id: answer["id"].as_str()?.to_owned(),
        held: answer["heldAmount"].as_i64()?,
        expires_at: answer["expiresAt"].as_str()?.parse().ok()?,
    };
    let (http, bases, history) = (http.clone(), bases.clone(), history.clone());
    let request = request.clone();
    Some(tokio::spawn(async move {
        follow_hold(&http, &bases, &history, &request, held).await;
    }))
}

/// What a client does with a hold it was answered `held` for (see [`HoldPlan`]); then,
/// now and then, it replays the hold's request with its idempotency key.
async fn follow_hold(
    http: &reqwest::Client,
    bases: &Bases,
    history: &Mutex<History>,
    request: &Request,
    hold: HeldHold,
) {
    let expires_in_ms = request.hold.expect("a hold request");
    let (plan, delay_ms, part) = {
        let mut rng = rand::rng();
        let plan = match rng.random_range(0..100) {
            0..=29 => HoldPlan::CaptureAll,
            // A multi-leg hold is captured whole only.
            30..=54 if request.legs.is_some() => HoldPlan::CaptureAll,
            30..=54 => HoldPlan::CapturePart,
            55..=79 => HoldPlan::Void,
            80..=89 => HoldPlan::Expire,
            90..=94 => HoldPlan::ExpireThenCapture,
            _ => HoldPlan::ExpireThenVoid,
        };
        let delay_ms = match plan {
            // Mostly before the expiry; the slowest race it.
            HoldPlan::CaptureAll | HoldPlan::CapturePart | HoldPlan::Void => {
                rng.random_range(0..=expires_in_ms * 3 / 4)
            }
            // Past the expiry by the test's clock (the database's).
            _ => {
                let left = (hold.expires_at - chrono::Utc::now())
                    .num_milliseconds()
                    .max(0) as u64;
                left + rng.random_range(100..=800)
            }
        };
        let part = match plan {
            // Half the time with no body, half with the whole amount in it.
            HoldPlan::CaptureAll | HoldPlan::ExpireThenCapture => {
                rng.random_bool(0.5).then_some(hold.held)
            }
            _ => Some(rng.random_range(1..=hold.held)),
        };
        (plan, delay_ms, part)
    };
    *history.lock().unwrap().hold_plans.entry(plan).or_default() += 1;
    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
    let resolve = match plan {
        HoldPlan::CaptureAll | HoldPlan::CapturePart | HoldPlan::ExpireThenCapture => {
            Some(Resolve::Capture { amount: part })
        }
        HoldPlan::Void | HoldPlan::ExpireThenVoid => Some(Resolve::Void),
        HoldPlan::Expire => None,
    };
    if let Some(resolve) = resolve {
        resolve_hold(http, bases, history, &hold, resolve).await;
    }
    if request.key.is_some() && rand::rng().random_bool(0.25) {
        transfer(http, bases, history, request, false).await;
    }
}

/// One capture or void of `hold`, retried on a random live instance (the same amount)
/// when the connection is lost or the database is unavailable.
async fn resolve_hold(
    http: &reqwest::Client,
    bases: &Bases,
    history: &Mutex<History>,
    hold: &HeldHold,
    resolve: Resolve,
) {
    let label = resolve.path();
    let first_sent = chrono::Utc::now();
    for attempt in 0..KEYED_ATTEMPTS {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let Some((_, base)) = live_base(bases, &mut rand::rng()) else {
            continue;
        };
        let mut http_request = http.post(format!("{base}/transfers/{}/{label}", hold.id));
        if let Resolve::Capture {
            amount: Some(amount),
        } = resolve
        {
            http_request = http_request.json(&json!({ "amount": amount }));
        }
        let response = match http_request.send().await {
            Ok(r) => r,
            Err(_) => {
                history
                    .lock()
                    .unwrap()
                    .count(&format!("{label}: connection lost"));
                continue;
            }
        };
        let status = response.status().as_u16();
        let Ok(answer) = response.json::<Value>().await else {
            history
                .lock()
                .unwrap()
                .count(&format!("{label}: body lost"));
            continue;
        };
        let this = ResolveAttempt {
            hold,
            resolve,
            first_sent,
            retry: attempt > 0,
        };
        if record_resolve(history, &this, status, answer) {
            return;
        }
    }
    let mut h = history.lock().unwrap();
    h.count(&format!("{label}: no definitive answer"));
    h.resolves_unknown += 1;
}

/// `request` made a multi-leg transfer of 2 to 6 legs among the accounts (hot ones half
/// the time, so accounts repeat across legs and across transfers; an account may pay on
/// one leg and receive on another), its first leg `request`'s own.
fn with_legs(request: Request, rng: &mut impl Rng) -> Request {
    let mut legs = vec![(
        request.source.clone(),
        request.destination.clone(),
        request.amount,
    )];
    for _ in 1..rng.random_range(2..=6) {
        let source = pick_account(rng);
        let mut destination = pick_account(rng);
        if destination == source {
            destination = (source + 1) % ACCOUNTS;
        }
        legs.push((
            account(source),
            account(destination),
            rng.random_range(1..=200),
        ));
    }
    // Legs in which every account gets back what it pays move nothing and are refused.
    if moved_by(&legs) == 0 {
        legs[0].2 += 1;
    }
    Request {
        amount: moved_by(&legs),
        legs: Some(legs),
        ..request
    }
}

/// The money `legs` move, a multi-leg transfer's `amount`: what the accounts that pay
/// more than they receive pay on balance (`domain::Legs::moved`).
fn moved_by(legs: &[(String, String, i64)]) -> i64 {
    let mut nets: Vec<(&str, i64)> = Vec::new();
    for (source, destination, amount) in legs {
        for (account, change) in [(source, -amount), (destination, *amount)] {
            match nets.iter_mut().find(|(a, _)| *a == account.as_str()) {
                Some((_, net)) => *net += change,
                None => nets.push((account.as_str(), change)),
            }
        }
    }
    nets.iter()
        .filter(|(_, net)| *net < 0)
        .map(|(_, net)| -net)
        .sum()
}

/// Whether a request asks for an asynchronous answer: now and then.
fn rng_async() -> bool {
    rand::rng().random_bool(0.2)
}

async fn client(seed: usize, bases: Bases, history: Arc<Mutex<History>>, stop: CancellationToken) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut n = 0u64;
    let mut holds = Vec::new();
    while !stop.is_cancelled() {
        n += 1;
        let (choice, request) = {
            let mut rng = rand::rng();
            let source = pick_account(&mut rng);
            let mut destination = pick_account(&mut rng);
            if destination == source {
                destination = (source + 1) % ACCOUNTS;
            }
            let reference = format!("client-{seed}-op-{n}");
            let key = rng.random_bool(0.5).then(|| reference.clone());
            let request = Request {
                reference,
                key,
                source: account(source),
                destination: account(destination),
                amount: rng.random_range(1..=300),
                hold: None,
                legs: None,
            };
            (rng.random_range(0..100), request)
        };
        match choice {
            25..=34 => {
                // A multi-leg transfer, keyed half the time as the others.
                let request = with_legs(request, &mut rand::rng());
                transfer(&http, &bases, &history, &request, rng_async()).await;
            }
            0..=9 => cancel(&http, &bases, &history).await,
            10..=14 => {
                transfer(&http, &bases, &history, &request, true).await;
            }
            15..=24 => {
                // A client retrying a request whose answer it already had.
                let request = Request {
                    key: Some(format!("client-{seed}-replayed-{n}")),
                    ..request
                };
                for _ in 0..2 {
                    transfer(&http, &bases, &history, &request, false).await;
                }
            }
            c if c >= 100 - HOLD_PERCENT => {
                let mut request = Request {
                    hold: Some(rand::rng().random_range(HOLD_EXPIRES_MS)),
                    ..request
                };
                // A multi-leg hold now and then (`docs/legs.md`).
                if rand::rng().random_bool(0.3) {
                    request = with_legs(request, &mut rand::rng());
                }
                holds.extend(hold(&http, &bases, &history, &request).await);
            }
            _ => {
                transfer(&http, &bases, &history, &request, false).await;
            }
        }
    }
    for h in holds {
        h.await.unwrap();
    }
}

/// While deployment `down` is down (until `stop`), one more client moves money between
/// the accounts of the other deployments only (within one, or across the two), one keyed
/// transfer after another, as any client would: the random clients soon all wait on a
/// request that touches the deployment that is down (a keyed one is retried for as long
/// as eight attempts of the driver's three-second server selection), so without it the
/// transfers that go on meanwhile would be few, and now and then none.
pub async fn probe_while_down(
    layout: Layout,
    down: usize,
    bases: Bases,
    history: Arc<Mutex<History>>,
    stop: CancellationToken,
) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let elsewhere: Vec<usize> = (0..ACCOUNTS).filter(|i| layout.home(*i) != down).collect();
    let mut n = 0;
    while !stop.is_cancelled() {
        n += 1;
        let request = {
            let mut rng = rand::rng();
            let mut pair = elsewhere.choose_multiple(&mut rng, 2);
            let (source, destination) = (*pair.next().unwrap(), *pair.next().unwrap());
            let reference = format!("probe-{down}-op-{n}");
            Request {
                key: Some(reference.clone()),
                reference,
                source: account(source),
                destination: account(destination),
                amount: rng.random_range(1..=100),
                hold: None,
                legs: None,
            }
        };
        transfer(&http, &bases, &history, &request, false).await;
    }
}
