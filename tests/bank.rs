//! The bank test, after Jepsen's bank workload: several instances of the service on one
//! database, clients making many concurrent transfers among a dozen accounts (three of
//! them hot) with cancels, asynchronous transfers, idempotent retries and holds mixed in,
//! while a nemesis kills instances with SIGKILL and restarts them, and restarts the
//! database process once in the middle. About a fifth of the requests are holds (the
//! same accounts, references and idempotency keys as transfers) that expire within
//! [`HOLD_EXPIRES_MS`]; after a random short delay each is captured in full, captured in
//! part, voided, or left to expire (and now and then captured or voided after its
//! expiry, or its request replayed), by requests to random live instances that are
//! retried like the others.
//!
//! It runs on two layouts of the accounts ([`Layout`]), with the same load, nemesis and
//! checks:
//!
//! - on one deployment (`MONGODB_URI`): the nemesis restarts that database server, down
//!   for a second;
//! - across three (`DEPLOYMENTS=eu=...,us=...,cn=...`, three database servers): account
//!   `i` lives on the `i % 3`th, so each hot account is on a deployment of its own and
//!   about two transfers in three cross deployments (each logged on its source's), the
//!   others staying within one. The nemesis restarts one deployment's server, chosen at
//!   random, down for four seconds (longer than the driver's server selection time-out,
//!   so that what touches it is refused meanwhile); meanwhile a probe client moves money
//!   between the accounts of the two others ([`probe_while_down`]), and at least one
//!   transfer between those (the probe's or another client's) must be made and answered
//!   `done` while it is down.
//!
//! The test owns its database servers (SecantusDB daemons, each in a temporary folder of
//! its own, restarted on the same port and folder); with `MONGODB_URI` set it uses the
//! servers the test support names (`MONGODB_URIS` for the further deployments) and
//! restarts none. The two tests take turns ([`ONE_BANK_AT_A_TIME`]). The instances do
//! not have it easy either:
//!
//! - a bad network: the instances of the slots in [`PROXIED`] (the first) reach each
//!   deployment's database server through a TCP proxy of its own on the loopback
//!   (`support::proxy`) that delays every chunk it forwards, in either direction, by 0 to
//!   [`PROXY_DELAY_MAX_MS`] ms (uniformly), or with a chance of [`PROXY_SLOW_CHANCE`] by up
//!   to [`PROXY_SLOW_DELAY_MAX_MS`] ms, and resets each connection (an RST to both sides)
//!   with a chance of about [`PROXY_RESETS_PER_SECOND`] in any second of its life; each
//!   holds at most [`PROXY_MAX_CONNECTIONS`] at once and forwards across its server's
//!   restart (the connections made while it is down are closed at once);
//! - wrong clocks: each slot's instances run with their wall clock [`CLOCK_SKEWS`] seconds
//!   off (+7 s and -7 s, several leases), under libfaketime, which must be installed (the
//!   `faketime` apt package; `scripts/test.sh` installs it); the database and the test
//!   keep the real clock, and every start checks the skew took;
//! - cancels of transfers being recovered: right after each kill, up to
//!   [`RECOVERY_CANCELS_PER_KILL`] unfinished transfers of the dead instance (those it
//!   owned, holds it was reserving or capturing among them, and those recorded for the
//!   requests that were outstanding on it) are
//!   canceled on the surviving instances, some twice at once, each within
//!   [`RECOVERY_CANCEL_WITHIN_MS`] ms of the kill, while the sweepers take them over.
//!
//! The proxied instance answers more 503s and loses more connections; those are retried
//! or counted as unknown outcomes like the others. Then, once everything is quiet, it
//! reads every deployment (accounts, transfer log, idempotency keys) and checks, over all
//! of them at once:
//!
//! - every account is stored once, on the deployment it was opened on; every transfer is
//!   in one log only, its source account's deployment's, and names its destination's
//!   deployment (transfer ids are unique across the logs);
//! - the total balance is unchanged and no balance is negative;
//! - every transfer is terminal (every hold captured, voided or expired: they all expire
//!   within seconds) and no `pendingTransactions` entry is left;
//! - every balance equals its opening balance plus the `done` transfers into it minus the
//!   `done` transfers out of it (a captured hold moved its captured `amount`), so no money
//!   moved outside a finished transfer;
//! - no account keeps `pendingDebits` or `pendingCredits`, and the two sums are equal;
//! - during the run, every [`SAMPLE_EVERY_MS`] ms, every account read straight from its
//!   deployment (each read on its own, so that one down leaves the others sampled) has a non-negative balance and pending sums, an available balance
//!   (`balance - pendingDebits`) that is not negative, and `balance + pendingCredits` at
//!   most 2^53-1 (the two sums are written in two account writes, so their equality is
//!   only checked at the end);
//! - no idempotency key was answered with two transfers or recorded twice in a log (a key
//!   is unique per source deployment; as no client uses a key with two sources, none is
//!   recorded in two logs either), every key answered with a transfer is recorded on that
//!   very transfer in its source's log, and every recorded key is taken
//!   (`idempotencyKeys`) in the same log for that transfer;
//! - every transfer was asked for by a client (each request carries a unique `reference`)
//!   and matches that request (a hold: `heldAmount` is the amount asked for, and its
//!   `amount` is the held one, or once captured the captured one, at most the held one);
//!   no request made two transfers;
//! - reversals: each points to an original that is `done`, mirrors it (same amount,
//!   accounts swapped), and once `done` is the original's `reversedBy`; an original has at
//!   most one `done` reversal, and its `reversedBy` names a `done` reversal of it; no
//!   transfer is left `reversing`;
//! - every `canceled` transfer has a `reason`;
//! - once a whole lease and a few sweeps have passed, no account keeps a
//!   `fencedTransactions` entry and no transfer keeps its `fenced` flag;
//! - every answer a client got agrees with the final state: 201 is `done`; 422 with a
//!   `transferId` is `canceled` with that reason; 409 `transfer_canceled` is `canceled` by
//!   request; a cancel answered `canceled` is `canceled` with the answered reason; a
//!   cancel answered `done` with `reversedBy` has that reversal `done`; a cancel refused
//!   with `insufficient_funds` leaves the original `done` and not reversed by the refused
//!   attempt; a 202 ends terminal;
//! - every answer about a hold agrees with the final state: 201 `held` is stored as that
//!   hold (held amount, `expiresAt`) and ends captured, voided or expired; a replay
//!   answered 201 `done` ends `done` with the answered amount; 409 `transfer_canceled`
//!   ends `canceled` by request, voided or expired; a capture answered 200 with amount M
//!   ends `done` with amount M, and was sent before `expiresAt`; a void answered 200 ends
//!   `canceled` with the answered reason (`voided` or `expired`); 409
//!   `hold_already_captured` ends `done` (for a capture: with another amount than the one
//!   it asked for, so a retried capture answers its own result); `hold_voided` ends
//!   `canceled` (`voided`); `hold_expired` ends `canceled` (`expired`) and was answered
//!   after `expiresAt`; and all the answers about one hold name at most one winner
//!   (captured with one amount, voided, expired or canceled);
//! - only the problem codes this scenario can legitimately produce are answered (any
//!   other 4xx or 5xx is a violation), and requests that never got a definitive answer are
//!   counted and looked up at the end (their transfer, if recorded, must be terminal);
//! - while a database server was down (from its kill to its restart), no transfer request
//!   touching its deployment was answered `done` unless as a replay (which reads only the
//!   source's log), and, across three deployments, transfers between the two others
//!   were.
//!
//! Each test runs for `BANK_TEST_SECONDS` (default 30) of load and prints what it did
//! (holds by plan and by outcome among them, transfers by log and how many cross
//! deployments, what was answered while a deployment was down), with the proxies' counts
//! and the skews in its summary line.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use mongodb::bson::{Document, doc};
use rand::Rng;
use rand::seq::{IndexedRandom, SliceRandom};
use serde_json::{Value, json};
use support::process::{Instance, InstanceConfig, clock_offset, faketime_env};
use support::proxy::{Faults, Proxy};
use support::{Daemon, fresh_database_name};
use tokio_util::sync::CancellationToken;
use transfer_service::domain::{
    Account, CancelReason, DeploymentName, MAX_MONEY, Timestamp, Transfer, TransferId,
    TransferState,
};
use transfer_service::store::Store;

const ACCOUNTS: usize = 12;
const HOT: usize = 3;
const OPENING_BALANCE: i64 = 1_000;
const INSTANCES: usize = 3;
const CLIENTS: usize = 12;
const STALE_AFTER_MS: u64 = 1000;
const SWEEP_INTERVAL_MS: u64 = 200;
/// Attempts of a transfer request with an idempotency key (one without a key is sent
/// once: a retry could make a second transfer).
const KEYED_ATTEMPTS: usize = 8;
/// The instances (by slot) that reach the database through a fault-injecting proxy.
const PROXIED: [bool; INSTANCES] = [true, false, false];
/// Each instance's wall-clock skew in seconds, under libfaketime (0: the real clock).
const CLOCK_SKEWS: [i64; INSTANCES] = [0, 7, -7];
/// The proxy delays each chunk it forwards (either direction) by 0 to this...
const PROXY_DELAY_MAX_MS: u64 = 50;
/// ...or, with this chance, by up to [`PROXY_SLOW_DELAY_MAX_MS`].
const PROXY_SLOW_CHANCE: f64 = 0.02;
const PROXY_SLOW_DELAY_MAX_MS: u64 = 400;
/// Each proxied connection is reset with about this chance in any second of its life.
const PROXY_RESETS_PER_SECOND: f64 = 0.2;
/// Connections the proxy holds at once, at most.
const PROXY_MAX_CONNECTIONS: usize = 256;
/// After each kill, at most this many of the dead instance's unfinished transfers are
/// canceled on the survivors...
const RECOVERY_CANCELS_PER_KILL: usize = 8;
/// ...each at a random moment within this long after the kill (a lease and a half: some
/// before the sweepers may take it over, some while they do, some after).
const RECOVERY_CANCEL_WITHIN_MS: u64 = 1500;
/// Percent of the client requests that are holds.
const HOLD_PERCENT: u32 = 20;
/// A hold's `expiresInMs`, drawn from this range: short, so that some captures and voids
/// lose the race with the expiry and every hold left alone expires during the run.
const HOLD_EXPIRES_MS: std::ops::RangeInclusive<u64> = 1000..=4000;
/// How far the test's clock and the database's may disagree when an answer is compared
/// with a hold's `expiresAt` (the same host's clock; the stored times are milliseconds).
const CLOCK_TOLERANCE_MS: i64 = 50;
/// How often the sampler reads every account during the run.
const SAMPLE_EVERY_MS: u64 = 200;

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

/// One transfer request as a client meant it. Its `reference` is unique to the request,
/// so that its transfer can be found at the end whatever happened to the answers.
#[derive(Debug, Clone)]
struct Request {
    reference: String,
    key: Option<String>,
    source: String,
    destination: String,
    amount: i64,
    /// A hold's `expiresInMs`; `None` for a plain transfer.
    hold: Option<u64>,
}

impl Request {
    fn body(&self) -> Value {
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
    fn mismatch(&self, t: &Transfer) -> Option<String> {
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
        let same = t.source.as_str() == self.source
            && t.destination.as_str() == self.destination
            && amounts
            && t.reference.as_ref().map(|r| r.as_str()) == Some(self.reference.as_str())
            && t.reverses.is_none();
        (!same).then(|| format!("transfer {t:?} does not match its request {self:?}"))
    }
}

/// What a client does with a hold it was answered `held` for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum HoldPlan {
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
    fn label(self) -> &'static str {
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
enum Settle {
    /// A capture of `amount` (`None`: no body, so the whole hold).
    Capture {
        amount: Option<i64>,
    },
    Void,
}

impl Settle {
    fn path(self) -> &'static str {
        match self {
            Settle::Capture { .. } => "capture",
            Settle::Void => "void",
        }
    }
}

/// A hold as its 201 `held` answer described it.
#[derive(Debug, Clone)]
struct HeldHold {
    id: String,
    held: i64,
    expires_at: Timestamp,
}

/// A definitive answer a client got, kept to be compared with the final state.
#[derive(Debug)]
enum Answer {
    /// A transfer request answered 201, 202, 409 or 422, naming transfer `id`; `replayed`
    /// when the answer said so; the attempt that got it was `sent` and `answered` then.
    Transfer {
        request: Request,
        status: u16,
        id: String,
        body: Value,
        replayed: bool,
        sent: Instant,
        answered: Instant,
    },
    /// A cancel of transfer `id` answered 200 or 422.
    Cancel {
        id: String,
        status: u16,
        body: Value,
    },
    /// A capture or a void of `hold` answered 200 or 409; `first_sent` is when its first
    /// attempt left, `answered` when this answer came (the test's clock, the database's).
    Settle {
        hold: HeldHold,
        settle: Settle,
        first_sent: Timestamp,
        answered: Timestamp,
        status: u16,
        body: Value,
    },
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
    /// Answers by operation, status and code.
    answers: BTreeMap<String, u64>,
    /// Statuses and codes a client must never see.
    violations: Vec<String>,
    /// Every definitive answer, to compare with the final state.
    seen: Vec<Answer>,
    /// Every request sent at least once, by reference.
    requests: HashMap<String, Request>,
    /// Idempotency keys sent at least once, to tell a genuine replay from a stray one.
    sent_keys: HashSet<String>,
    /// Requests sent at least once that never got a definitive answer (all attempts lost
    /// their connection or were answered 503): their outcome is unknown to the client.
    unanswered: Vec<Request>,
    /// Requests never sent: no live instance to send them to.
    unsent: u64,
    /// Cancels whose outcome the client does not know (connection lost, 503).
    cancels_unknown: u64,
    /// Transfer requests being sent right now, by reference, with the slot of the
    /// instance they were sent to.
    in_flight: HashMap<String, usize>,
    /// The killed instances' unfinished transfers canceled on the survivors, by the state
    /// they were found in.
    recovery_targets: BTreeMap<String, u64>,
    /// Holds answered `held`, by what their client did with them.
    hold_plans: BTreeMap<HoldPlan, u64>,
    /// Captures and voids whose outcome the client never learned (every attempt lost its
    /// connection or was answered 503).
    settles_unknown: u64,
    /// The requests (by reference) answered with what they must never be: their
    /// transfers are shown at the end.
    suspects: Vec<String>,
}

impl History {
    fn count(&mut self, what: &str) {
        *self.answers.entry(what.to_owned()).or_default() += 1;
    }
}

/// The live instances' base URLs, for clients to pick from.
type Bases = Arc<Mutex<Vec<Option<String>>>>;

/// A live instance: its slot and base URL.
fn live_base(bases: &Bases, rng: &mut impl Rng) -> Option<(usize, String)> {
    live_base_except(bases, rng, usize::MAX)
}

/// A live instance other than the one in slot `except`.
fn live_base_except(bases: &Bases, rng: &mut impl Rng, except: usize) -> Option<(usize, String)> {
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
fn code_of(answer: &Value) -> &str {
    answer["code"].as_str().unwrap_or("")
}

/// The answers a transfer request may get and go on, with a retry, to another one.
fn retryable(status: u16, code: &str) -> bool {
    status == 503 && matches!(code, "database_unavailable" | "request_timeout")
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
        let mut http_request = http.post(format!("{base}/transfers")).json(&request.body());
        let mut sent_before = false;
        {
            let mut h = history.lock().unwrap();
            h.requests
                .entry(request.reference.clone())
                .or_insert_with(|| request.clone());
            if let Some(key) = &request.key {
                sent_before = !h.sent_keys.insert(key.clone());
            }
            h.in_flight.insert(request.reference.clone(), slot);
        }
        if let Some(key) = &request.key {
            http_request = http_request.header("idempotency-key", key);
        }
        if respond_async {
            http_request = http_request.header("prefer", "respond-async");
        }
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
        if record(history, request, &this, status, replayed, &answer) {
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

/// One attempt of a transfer request: its number (0 for the first), whether its
/// idempotency key had been sent before, and when it left.
struct Attempt {
    number: usize,
    sent_before: bool,
    sent: Instant,
}

/// Records one transfer answer, got by `attempt`; false when it asks for a retry (503).
fn record(
    history: &Mutex<History>,
    request: &Request,
    attempt: &Attempt,
    status: u16,
    replayed: bool,
    answer: &Value,
) -> bool {
    let answered = Instant::now();
    let code = code_of(answer);
    let id = match status {
        201 | 202 => answer["id"].as_str(),
        _ => answer["transferId"].as_str(),
    }
    .map(str::to_owned);
    let state = answer["state"].as_str().and_then(TransferState::parse);
    let mut h = history.lock().unwrap();
    h.count(&format!(
        "{}: {status}{}{}{}{}",
        if request.hold.is_some() {
            "hold"
        } else {
            "transfer"
        },
        match (status, state) {
            (201, Some(state)) if request.hold.is_some() => format!(" {state}"),
            _ => String::new(),
        },
        if code.is_empty() {
            String::new()
        } else {
            format!(" {code}")
        },
        if replayed { " replayed" } else { "" },
        if attempt.number > 0 { " (retry)" } else { "" }
    ));
    if retryable(status, code) {
        return false;
    }
    // The answers this scenario can legitimately produce; everything else is a
    // violation (no account is ever missing, no balance can come near overflowing, no
    // key is reused with another body, every request is well formed). A hold is
    // answered `held`, or, replayed after its capture, `done`.
    let legitimate = match (status, code) {
        (201, "") => match request.hold {
            None => state == Some(TransferState::Done),
            Some(_) => {
                state == Some(TransferState::Held)
                    || (replayed && state == Some(TransferState::Done))
            }
        },
        (202, "") => state.is_some_and(|s| !s.is_terminal() && s != TransferState::Held),
        (409, "transfer_canceled") | (422, "insufficient_funds") => true,
        _ => false,
    };
    if !legitimate || id.is_none() {
        h.violations.push(format!(
            "transfer {} answered {status}{} at {} (attempt {}, sent {:?} before): {answer}; \
             request {request:?}",
            request.reference,
            if replayed { " (replayed)" } else { "" },
            chrono::Utc::now(),
            attempt.number,
            answered - attempt.sent,
        ));
        h.suspects.push(request.reference.clone());
        return true;
    }
    if replayed && !attempt.sent_before {
        h.violations.push(format!(
            "transfer {} answered as a replay of a key never sent before: {answer}",
            request.reference
        ));
    }
    let id = id.unwrap();
    if status == 201 && state == Some(TransferState::Done) {
        h.done.insert(id.clone());
    }
    if let Some(key) = &request.key {
        h.keys.entry(key.clone()).or_default().insert(id.clone());
    }
    h.ids.push(id.clone());
    h.seen.push(Answer::Transfer {
        request: request.clone(),
        status,
        id,
        body: answer.clone(),
        replayed,
        sent: attempt.sent,
        answered,
    });
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
        let Some((_, base)) = live_base(bases, &mut rng) else {
            return;
        };
        (base, id)
    };
    cancel_one(http, &base, id, history, "cancel").await;
}

/// One cancel of transfer `id` at `base`; its answer is counted under `label`.
async fn cancel_one(
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
    let mut h = history.lock().unwrap();
    let Some(answer) = answer else {
        h.count(&format!("{label}: connection lost"));
        h.cancels_unknown += 1;
        return;
    };
    let code = code_of(&answer);
    let state = answer["state"].as_str().and_then(TransferState::parse);
    h.count(&format!(
        "{label}: {status} {}",
        match (status, state) {
            (200, Some(state)) => state.as_str(),
            _ => code,
        }
    ));
    if retryable(status, code) {
        h.cancels_unknown += 1;
        return;
    }
    let legitimate = match (status, code) {
        // Rolled back (or canceled before, for any reason), or reversed.
        (200, "") => match state {
            Some(TransferState::Canceled) => answer["reason"].is_string(),
            Some(TransferState::Done) => answer["reversedBy"].is_string(),
            _ => false,
        },
        // The reversal is under way on another instance (it may still be refused).
        (202, "") => state == Some(TransferState::Done) && answer["reversedBy"].is_string(),
        // The destination cannot fund the reversal.
        (422, "insufficient_funds") => true,
        _ => false,
    };
    if legitimate && (status == 422 || answer["id"] == id.as_str()) {
        h.seen.push(Answer::Cancel {
            id,
            status,
            body: answer,
        });
    } else {
        h.violations
            .push(format!("cancel of {id} answered {status}: {answer}"));
    }
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
    let settle = match plan {
        HoldPlan::CaptureAll | HoldPlan::CapturePart | HoldPlan::ExpireThenCapture => {
            Some(Settle::Capture { amount: part })
        }
        HoldPlan::Void | HoldPlan::ExpireThenVoid => Some(Settle::Void),
        HoldPlan::Expire => None,
    };
    if let Some(settle) = settle {
        settle_hold(http, bases, history, &hold, settle).await;
    }
    if request.key.is_some() && rand::rng().random_bool(0.25) {
        transfer(http, bases, history, request, false).await;
    }
}

/// One capture or void of `hold`, retried on a random live instance (the same amount)
/// when the connection is lost or the database is unavailable.
async fn settle_hold(
    http: &reqwest::Client,
    bases: &Bases,
    history: &Mutex<History>,
    hold: &HeldHold,
    settle: Settle,
) {
    let label = settle.path();
    let first_sent = chrono::Utc::now();
    for attempt in 0..KEYED_ATTEMPTS {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let Some((_, base)) = live_base(bases, &mut rand::rng()) else {
            continue;
        };
        let mut http_request = http.post(format!("{base}/transfers/{}/{label}", hold.id));
        if let Settle::Capture {
            amount: Some(amount),
        } = settle
        {
            http_request = http_request.json(&json!({ "amount": amount }));
        }
        let retry = if attempt > 0 { " (retry)" } else { "" };
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
        let answered = chrono::Utc::now();
        let code = code_of(&answer);
        let mut h = history.lock().unwrap();
        h.count(&format!(
            "{label}: {status} {}{retry}",
            match status {
                200 => answer["state"].as_str().unwrap_or("?"),
                _ => code,
            }
        ));
        if retryable(status, code) {
            continue;
        }
        let wanted = match settle {
            Settle::Capture { amount } => amount.unwrap_or(hold.held),
            Settle::Void => 0,
        };
        let state = answer["state"].as_str().and_then(TransferState::parse);
        let reason = answer["reason"].as_str().and_then(CancelReason::parse);
        // What a capture or a void of a hold that was `held` may answer.
        let legitimate = match (settle, status, code) {
            (Settle::Capture { .. }, 200, "") => {
                answer["id"] == hold.id.as_str()
                    && matches!(state, Some(TransferState::Done | TransferState::Capturing))
                    && answer["amount"] == wanted
                    && answer["heldAmount"] == hold.held
            }
            (
                Settle::Capture { .. },
                409,
                "hold_already_captured" | "hold_voided" | "hold_expired",
            )
            | (Settle::Void, 409, "hold_already_captured") => {
                answer["transferId"] == hold.id.as_str()
            }
            (Settle::Void, 200, "") => {
                answer["id"] == hold.id.as_str()
                    && matches!(
                        state,
                        Some(TransferState::Canceled | TransferState::Canceling)
                    )
                    && matches!(reason, Some(CancelReason::Voided | CancelReason::Expired))
            }
            _ => false,
        };
        if legitimate {
            h.seen.push(Answer::Settle {
                hold: hold.clone(),
                settle,
                first_sent,
                answered,
                status,
                body: answer,
            });
        } else {
            h.violations.push(format!(
                "{label} {settle:?} of hold {} answered {status}: {answer}",
                hold.id
            ));
        }
        return;
    }
    let mut h = history.lock().unwrap();
    h.count(&format!("{label}: no definitive answer"));
    h.settles_unknown += 1;
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
            };
            (rng.random_range(0..100), request)
        };
        match choice {
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
                let request = Request {
                    hold: Some(rand::rng().random_range(HOLD_EXPIRES_MS)),
                    ..request
                };
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
async fn probe_while_down(
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
            }
        };
        transfer(&http, &bases, &history, &request, false).await;
    }
}

/// Right after the instance in slot `victim`, `owner`, was killed: cancels, on the
/// surviving instances, the transfers it left unfinished (those it owned, and those
/// recorded for the requests that were outstanding on it; holds it was reserving or
/// capturing among them; reversals aside), each at a
/// random moment within [`RECOVERY_CANCEL_WITHIN_MS`], some twice at once, so that the
/// cancels race the sweepers taking the same transfers over.
async fn cancel_recovering(
    books: Books,
    bases: Bases,
    history: Arc<Mutex<History>>,
    victim: usize,
    owner: String,
    references: Vec<String>,
) {
    let filter = doc! {
        "state": { "$in": ["initial", "pending", "applied", "canceling", "capturing"] },
        "reverses": { "$exists": false },
        "$or": [
            // Names are [a-z0-9-]: nothing to escape.
            { "application": { "$regex": format!("^{owner}/") } },
            { "reference": { "$in": references } },
        ],
    };
    // In every log (a deployment restarting gives no targets this time).
    let found = books.find_in_logs(filter).await;
    // (id, state) of each.
    let mut targets: Vec<(String, String)> = found
        .iter()
        .filter_map(|t| {
            let id = t.get_object_id("_id").ok()?.to_hex();
            Some((id, t.get_str("state").ok()?.to_owned()))
        })
        .collect();
    targets.shuffle(&mut rand::rng());
    targets.truncate(RECOVERY_CANCELS_PER_KILL);
    {
        let mut h = history.lock().unwrap();
        for (_, state) in &targets {
            *h.recovery_targets.entry(state.clone()).or_default() += 1;
        }
    }
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut cancels = Vec::new();
    for (id, _) in targets {
        let copies = if rand::rng().random_bool(0.3) { 2 } else { 1 };
        for _ in 0..copies {
            let (http, bases, history) = (http.clone(), bases.clone(), history.clone());
            let id = id.clone();
            let delay = rand::rng().random_range(0..=RECOVERY_CANCEL_WITHIN_MS);
            cancels.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(delay)).await;
                let Some((_, base)) = live_base_except(&bases, &mut rand::rng(), victim) else {
                    return;
                };
                cancel_one(&http, &base, id, &history, "cancel (recovering)").await;
            }));
        }
    }
    for c in cancels {
        c.await.unwrap();
    }
}

/// What every instance started in a slot shares: where it reaches each deployment (the
/// slot's proxies for a proxied slot) and its clock skew.
struct Slots {
    layout: Layout,
    /// Per slot, the URI of each deployment, in the layout's order.
    uris: Vec<Vec<String>>,
    database: String,
}

impl Slots {
    fn config(&self, slot: usize, name: &str) -> InstanceConfig {
        let uris = &self.uris[slot];
        let mut config =
            InstanceConfig::new(support::service_binary!(), &uris[0], &self.database, name);
        config.deployments = self.layout.deployments_variable(uris);
        config.stale_after_ms = STALE_AFTER_MS;
        config.sweep_interval_ms = SWEEP_INTERVAL_MS;
        config.env = faketime_env(CLOCK_SKEWS[slot]);
        config
    }

    /// Starts an instance in `slot` and checks that its clock is skewed as it should be,
    /// so that a libfaketime that did not take cannot pass unnoticed.
    async fn start(&self, slot: usize, name: &str) -> Instance {
        let instance = Instance::start(&self.config(slot, name)).await;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let off = clock_offset(&http, &instance).await;
        assert!(
            (off - CLOCK_SKEWS[slot]).abs() <= 2,
            "instance {name} should run {:+} s off the real clock, its Date header says {off:+} s",
            CLOCK_SKEWS[slot]
        );
        instance
    }
}

/// The database's address in `uri` (its first host), which must be on the loopback.
fn upstream_of(uri: &str) -> std::net::SocketAddr {
    use std::net::ToSocketAddrs;
    let authority = uri
        .strip_prefix("mongodb://")
        .unwrap_or_else(|| panic!("the proxy needs a mongodb:// URI, not {uri}"));
    let authority = authority.split('/').next().unwrap_or_default();
    let hosts = authority.rsplit('@').next().unwrap_or_default();
    let host = hosts.split(',').next().unwrap_or_default();
    let host = if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:27017")
    };
    host.to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.find(|a| a.ip().is_loopback()))
        .unwrap_or_else(|| {
            panic!("the bank test proxies the database only on the loopback; {uri} is not")
        })
}

/// `uri` with its hosts replaced by the proxy's address, and `directConnection=true`.
fn proxied_uri(uri: &str, proxy: std::net::SocketAddr) -> String {
    let rest = uri.strip_prefix("mongodb://").unwrap_or(uri);
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let credentials = match authority.rfind('@') {
        Some(i) => &authority[..=i],
        None => "",
    };
    let path = if path.contains("directConnection=") {
        path.replace("directConnection=false", "directConnection=true")
    } else if path.contains('?') {
        format!("{path}&directConnection=true")
    } else {
        format!("{path}?directConnection=true")
    };
    format!("mongodb://{credentials}{proxy}{path}")
}

/// The invariants checked, each with how many times, and what broke them.
#[derive(Default)]
struct Checks {
    counts: BTreeMap<&'static str, u64>,
    violations: Vec<String>,
}

impl Checks {
    /// Counts one check of `invariant`; records `violation()` when `holds` is false.
    fn check(&mut self, invariant: &'static str, holds: bool, violation: impl FnOnce() -> String) {
        *self.counts.entry(invariant).or_default() += 1;
        if !holds {
            self.violations
                .push(format!("[{invariant}] {}", violation()));
        }
    }
}

/// Where the accounts live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// `MONGODB_URI` alone: every account on the one deployment, `default`.
    OneDeployment,
    /// `DEPLOYMENTS=eu=...,us=...,cn=...`, account `i` on the `i % 3`th: each hot account
    /// on a deployment of its own, four accounts on each.
    ThreeDeployments,
}

impl Layout {
    /// The deployments' names, in the order `DEPLOYMENTS` lists them.
    fn deployments(self) -> &'static [&'static str] {
        match self {
            Layout::OneDeployment => &["default"],
            Layout::ThreeDeployments => &["eu", "us", "cn"],
        }
    }

    /// The deployment (its index) that keeps account `i`.
    fn home(self, i: usize) -> usize {
        i % self.deployments().len()
    }

    /// The deployment that keeps the account of id `id` (`acct-NN`).
    fn home_of(self, id: &str) -> &'static str {
        let i: usize = id
            .strip_prefix("acct-")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{id} is not an account of the bank test"));
        self.deployments()[self.home(i)]
    }

    /// `DEPLOYMENTS` for `uris`, one per deployment; `None` with one deployment (then
    /// `MONGODB_URI` names it).
    fn deployments_variable(self, uris: &[String]) -> Option<String> {
        (self != Layout::OneDeployment).then(|| {
            self.deployments()
                .iter()
                .zip(uris)
                .map(|(name, uri)| format!("{name}={uri}"))
                .collect::<Vec<_>>()
                .join(",")
        })
    }

    /// How long the nemesis keeps a database server down: across three deployments, longer
    /// than the driver's server selection time-out (3 s), so that the transfers touching
    /// it are refused while the others go on.
    fn down_for(self) -> Duration {
        match self {
            Layout::OneDeployment => Duration::from_millis(1000),
            Layout::ThreeDeployments => Duration::from_millis(4000),
        }
    }
}

/// The database servers of a run, one per deployment of its layout: SecantusDB daemons of
/// the test's own, each in a temporary folder of its own, which the nemesis may restart;
/// or, with `MONGODB_URI` set, the servers the test support names (`MONGODB_URIS` for the
/// further ones), left alone.
struct Servers {
    uris: Vec<String>,
    /// The test's daemons and their folders; `None` with external servers.
    daemons: Option<Vec<(Daemon, tempfile::TempDir)>>,
}

/// A deployment's database server down: which one, and when it surely was (from the
/// moment its kill returned to the moment its restart began, by the test's clock).
struct Outage {
    deployment: &'static str,
    from: Instant,
    until: Instant,
}

impl Servers {
    fn start(layout: Layout) -> Servers {
        let n = layout.deployments().len();
        let external = std::env::var("MONGODB_URI")
            .ok()
            .filter(|u| !u.trim().is_empty());
        if external.is_some() {
            return Servers {
                uris: support::database_uris(n),
                daemons: None,
            };
        }
        let daemons: Vec<(Daemon, tempfile::TempDir)> = (0..n)
            .map(|_| {
                let storage = tempfile::tempdir().unwrap();
                (Daemon::start(storage.path().to_path_buf(), 0), storage)
            })
            .collect();
        Servers {
            uris: daemons.iter().map(|(d, _)| d.uri.clone()).collect(),
            daemons: Some(daemons),
        }
    }

    /// Whether the test owns the servers (and so may restart them, and they keep its
    /// clock).
    fn owned(&self) -> bool {
        self.daemons.is_some()
    }

    /// Kills the server of deployment `d` (kill -9); returns when it is dead.
    fn kill(&mut self, d: usize) -> Instant {
        let (daemon, _) = &mut self.daemons.as_mut().expect("servers of the test")[d];
        daemon.kill();
        Instant::now()
    }

    /// Starts the server of deployment `d` again, on its port and with its folder.
    fn revive(&mut self, d: usize) {
        let (daemon, storage) = &mut self.daemons.as_mut().expect("servers of the test")[d];
        *daemon = Daemon::start(storage.path().to_path_buf(), daemon.port);
    }
}

/// The test's own connections (direct, not proxied) to its database on every deployment,
/// in the layout's order, to read what is stored.
#[derive(Clone)]
struct Books {
    stores: Vec<Store>,
}

/// An idempotency key taken on a deployment (`idempotencyKeys`), for transfer `transfer`.
struct KeyRecord {
    deployment: String,
    key: String,
    transfer: Option<TransferId>,
}

impl Books {
    async fn connect(layout: Layout, uris: &[String], database: &str) -> Books {
        let mut stores = Vec::new();
        for (name, uri) in layout.deployments().iter().zip(uris) {
            let name = DeploymentName::parse(name).unwrap();
            stores.push(Store::connect_with(name, uri, database, 2).await.unwrap());
        }
        Books { stores }
    }

    /// Everything stored: every log's transfers (each read from its log, so its
    /// `source_deployment` names the log it is on) and every deployment's accounts.
    async fn snapshot(&self) -> (Vec<Transfer>, Vec<Account>) {
        let (mut transfers, mut accounts) = (Vec::new(), Vec::new());
        for store in &self.stores {
            transfers.extend(
                store
                    .list_transfers(&Default::default(), 1_000_000)
                    .await
                    .unwrap(),
            );
            accounts.extend(store.list_accounts(None, 1000).await.unwrap());
        }
        (transfers, accounts)
    }

    /// The transfer documents of every log matching `filter`; a deployment that does not
    /// answer (restarting) gives none.
    async fn find_in_logs(&self, filter: Document) -> Vec<Document> {
        let mut found = Vec::new();
        for store in &self.stores {
            let cursor = store
                .database()
                .collection::<Document>("transactions")
                .find(filter.clone())
                .await;
            if let Ok(cursor) = cursor {
                found.extend(cursor.try_collect::<Vec<_>>().await.unwrap_or_default());
            }
        }
        found
    }

    /// Every idempotency key taken, on every deployment.
    async fn key_records(&self) -> Vec<KeyRecord> {
        let mut records = Vec::new();
        for store in &self.stores {
            let found: Vec<Document> = store
                .database()
                .collection::<Document>("idempotencyKeys")
                .find(doc! {})
                .await
                .unwrap()
                .try_collect()
                .await
                .unwrap();
            records.extend(found.into_iter().map(|d| {
                KeyRecord {
                    deployment: store.deployment().to_string(),
                    key: d.get_str("_id").unwrap_or_default().to_owned(),
                    transfer: d
                        .get_object_id("transfer")
                        .ok()
                        .and_then(|id| TransferId::parse(&id.to_hex()).ok()),
                }
            }));
        }
        records
    }
}

/// What must be true once the sweepers have had a whole lease and a few passes after the
/// last transfer finished; empty when everything is settled.
fn unsettled(transfers: &[Transfer], accounts: &[Account]) -> Vec<String> {
    let mut left = Vec::new();
    for t in transfers {
        if !t.state.is_terminal() {
            left.push(format!("transfer {} is {}", t.id, t.state));
        }
        if t.reversing {
            left.push(format!("transfer {} is still reversing", t.id));
        }
        if t.fenced {
            left.push(format!("transfer {} is still marked fenced", t.id));
        }
    }
    for a in accounts {
        if !a.fenced_transactions.is_empty() {
            left.push(format!("{} keeps fences {:?}", a.id, a.fenced_transactions));
        }
        if !a.pending_transactions.is_empty() {
            left.push(format!(
                "{} keeps markers {:?}",
                a.id, a.pending_transactions
            ));
        }
        if a.pending_debits != 0 || a.pending_credits != 0 {
            left.push(format!(
                "{} keeps pendingDebits {} and pendingCredits {}",
                a.id, a.pending_debits, a.pending_credits
            ));
        }
    }
    left
}

/// Reads every account straight from the store every [`SAMPLE_EVERY_MS`] until `stop`,
/// and checks what must hold of each at every moment: the balance and the pending sums
/// are not negative, the available balance is not negative, and every capture could land
/// (`balance + pendingCredits <= MAX_MONEY`). The two sums are written by two account
/// writes, so their equality is left to the end. Each deployment is read on its own, so
/// that one restarting leaves the others sampled. Returns the checks, the number of
/// reads of a deployment's accounts that were complete and of those that failed (the
/// database restarting).
async fn sample_accounts(books: Books, stop: CancellationToken) -> (Checks, u64, u64) {
    let mut checks = Checks::default();
    let (mut samples, mut failed) = (0, 0);
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(Duration::from_millis(SAMPLE_EVERY_MS)) => {}
        }
        let reads = books.stores.iter().map(|store| {
            tokio::time::timeout(Duration::from_secs(2), store.list_accounts(None, 1000))
        });
        let mut accounts = Vec::new();
        for read in futures::future::join_all(reads).await {
            match read {
                Ok(Ok(read)) => {
                    samples += 1;
                    accounts.extend(read);
                }
                _ => failed += 1,
            }
        }
        for a in &accounts {
            checks.check(
                "sampled during the run: no negative balance or pending sum",
                a.balance >= 0 && a.pending_debits >= 0 && a.pending_credits >= 0,
                || format!("{a:?}"),
            );
            checks.check(
                "sampled during the run: available balance never negative",
                a.balance - a.pending_debits >= 0,
                || {
                    format!(
                        "{} has balance {} and pendingDebits {}: {a:?}",
                        a.id, a.balance, a.pending_debits
                    )
                },
            );
            checks.check(
                "sampled during the run: balance + pendingCredits <= 2^53-1",
                a.balance
                    .checked_add(a.pending_credits)
                    .is_some_and(|sum| sum <= MAX_MONEY),
                || {
                    format!(
                        "{} has balance {} and pendingCredits {}: {a:?}",
                        a.id, a.balance, a.pending_credits
                    )
                },
            );
        }
    }
    (checks, samples, failed)
}

/// Compares one definitive answer a client got with the final state. With `same_clock`
/// (the database runs on this host), an answer about a hold is also compared in time
/// with its `expiresAt`.
fn check_answer(
    answer: &Answer,
    by_id: &HashMap<TransferId, &Transfer>,
    same_clock: bool,
    checks: &mut Checks,
) {
    let find = |id: &str| -> Option<&Transfer> {
        TransferId::parse(id)
            .ok()
            .and_then(|id| by_id.get(&id).copied())
    };
    match answer {
        Answer::Transfer {
            request,
            status,
            id,
            body,
            ..
        } => {
            let found = find(id);
            checks.check("answered transfer is stored", found.is_some(), || {
                format!("{id}, answered {status} {body}, is not in the database")
            });
            let Some(t) = found else { return };
            checks.check(
                "answered transfer matches its request",
                request.mismatch(t).is_none(),
                || request.mismatch(t).unwrap_or_default(),
            );
            let answered_state = body["state"].as_str().and_then(TransferState::parse);
            if request.hold.is_some() {
                match (*status, answered_state) {
                    (201, Some(TransferState::Held)) => {
                        checks.check(
                            "a hold answered held is stored as that hold",
                            t.hold.is_some_and(|h| {
                                body["heldAmount"] == h.amount.minor_units()
                                    && body["expiresAt"]
                                        .as_str()
                                        .and_then(|e| e.parse::<Timestamp>().ok())
                                        == Some(h.expires_at)
                            }),
                            || format!("{id} answered {status} {body} but is stored as {t:?}"),
                        );
                        checks.check(
                            "a hold answered held ends captured, voided or expired",
                            t.state == TransferState::Done
                                || (t.state == TransferState::Canceled
                                    && matches!(
                                        t.reason,
                                        Some(CancelReason::Voided | CancelReason::Expired)
                                    )),
                            || format!("{id} answered {status} {body} but ends {t:?}"),
                        );
                        return;
                    }
                    (201, _) => {
                        checks.check(
                            "a hold answered done ends done with the answered amount",
                            t.state == TransferState::Done
                                && body["amount"] == t.amount.minor_units(),
                            || format!("{id} answered {status} {body} but ends {t:?}"),
                        );
                        return;
                    }
                    (409, _) => {
                        checks.check(
                            "a hold answered canceled ends canceled by request, voided or expired",
                            t.state == TransferState::Canceled
                                && matches!(
                                    t.reason,
                                    Some(
                                        CancelReason::CanceledByRequest
                                            | CancelReason::Voided
                                            | CancelReason::Expired
                                    )
                                ),
                            || format!("{id} answered {status} {body} but ends {t:?}"),
                        );
                        return;
                    }
                    _ => {}
                }
            }
            let expected = match (*status, code_of(body)) {
                (201, _) => Some((TransferState::Done, None)),
                (409, _) => Some((
                    TransferState::Canceled,
                    Some(CancelReason::CanceledByRequest),
                )),
                (422, code) => Some((TransferState::Canceled, CancelReason::parse(code))),
                // 202: it only has to be terminal in the end.
                _ => None,
            };
            match expected {
                Some((state, reason)) => checks.check(
                    "a transfer answer agrees with the final state",
                    t.state == state && t.reason == reason,
                    || {
                        format!(
                            "{id} answered {status} {body} but ends {} ({:?})",
                            t.state, t.reason
                        )
                    },
                ),
                None => checks.check("a 202 ends terminal", t.state.is_terminal(), || {
                    format!("{id} answered 202 and ends {}", t.state)
                }),
            }
        }
        Answer::Settle {
            hold,
            settle,
            first_sent,
            answered,
            status,
            body,
        } => {
            let id = &hold.id;
            let found = find(id);
            checks.check(
                "a captured or voided hold is stored",
                found.is_some(),
                || format!("{id}, answered {status} {body}, is not in the database"),
            );
            let Some(t) = found else { return };
            let code = code_of(body);
            let reason = body["reason"].as_str().and_then(CancelReason::parse);
            let past = |at: &Timestamp| (*at - hold.expires_at).num_milliseconds();
            let ends = |state, reason| t.state == state && t.reason == reason;
            let violation = || {
                format!(
                    "{} {settle:?} of hold {id} (held {}, expires at {}) first sent at \
                     {first_sent}, answered {status} {body} at {answered}, but it ends {t:?}",
                    settle.path(),
                    hold.held,
                    hold.expires_at
                )
            };
            match (settle, *status, code) {
                (Settle::Capture { amount }, 200, _) => {
                    checks.check(
                        "a capture answered done ends done with the captured amount",
                        ends(TransferState::Done, None)
                            && t.amount.minor_units() == amount.unwrap_or(hold.held),
                        violation,
                    );
                    if same_clock {
                        checks.check(
                            "nothing is captured after expiresAt",
                            past(first_sent) < CLOCK_TOLERANCE_MS,
                            violation,
                        );
                    }
                }
                (Settle::Capture { amount }, 409, "hold_already_captured") => checks.check(
                    "a capture refused as already captured lost to another amount",
                    ends(TransferState::Done, None)
                        && t.amount.minor_units() != amount.unwrap_or(hold.held),
                    violation,
                ),
                (Settle::Void, 409, "hold_already_captured") => checks.check(
                    "a void refused as already captured ends done",
                    ends(TransferState::Done, None),
                    violation,
                ),
                (_, 409, "hold_voided") => checks.check(
                    "a capture refused as voided ends voided",
                    ends(TransferState::Canceled, Some(CancelReason::Voided)),
                    violation,
                ),
                (_, 409, _) => {
                    checks.check(
                        "a capture refused as expired ends expired",
                        ends(TransferState::Canceled, Some(CancelReason::Expired)),
                        violation,
                    );
                    if same_clock {
                        checks.check(
                            "a hold is answered expired only from expiresAt on",
                            past(answered) > -CLOCK_TOLERANCE_MS,
                            violation,
                        );
                    }
                }
                _ => {
                    checks.check(
                        "a void answered canceled ends canceled with that reason",
                        ends(TransferState::Canceled, reason),
                        violation,
                    );
                    if same_clock && reason == Some(CancelReason::Expired) {
                        checks.check(
                            "a hold is answered expired only from expiresAt on",
                            past(answered) > -CLOCK_TOLERANCE_MS,
                            violation,
                        );
                    }
                }
            }
        }
        Answer::Cancel { id, status, body } => {
            let found = find(id);
            checks.check("canceled transfer is stored", found.is_some(), || {
                format!("{id}, canceled with {status} {body}, is not in the database")
            });
            let Some(original) = found else { return };
            let answered_state = body["state"].as_str().and_then(TransferState::parse);
            match (*status, answered_state) {
                (200, Some(TransferState::Canceled)) => {
                    let reason = body["reason"].as_str().and_then(CancelReason::parse);
                    checks.check(
                        "a cancel answered canceled ends canceled with that reason",
                        original.state == TransferState::Canceled && original.reason == reason,
                        || {
                            format!(
                                "cancel of {id} answered {body} but it ends {} ({:?})",
                                original.state, original.reason
                            )
                        },
                    );
                }
                (202, _) => {
                    // Under way: whatever the reversal's outcome, the original stays done.
                    checks.check(
                        "a cancel answered under way leaves the original done",
                        original.state == TransferState::Done,
                        || {
                            format!(
                                "cancel of {id} answered {body}, but it ends {}",
                                original.state
                            )
                        },
                    );
                }
                (200, _) => {
                    // Done, with `reversedBy`: the reversal the client was told of ends
                    // done, and the original names it.
                    let reversal_id = body["reversedBy"].as_str().unwrap_or_default();
                    let reversal = find(reversal_id);
                    checks.check(
                        "a cancel answered reversed ends reversed by that reversal",
                        original.state == TransferState::Done
                            && original.reversed_by.map(|r| r.to_string()).as_deref()
                                == Some(reversal_id)
                            && reversal.is_some_and(|r| {
                                r.state == TransferState::Done && r.reverses == Some(original.id)
                            }),
                        || {
                            format!(
                                "cancel of {id} answered {body}, but the original ends {} \
                                 reversedBy {:?} and the reversal is {reversal:?}",
                                original.state, original.reversed_by
                            )
                        },
                    );
                }
                _ => {
                    // 422 insufficient_funds: nothing changed, the original stays done;
                    // the refused attempt, when named, ends canceled and is not its
                    // reversal.
                    let attempt = body["transferId"].as_str();
                    let attempt_doc = attempt.and_then(find);
                    checks.check(
                        "a refused reversal leaves the original done and not reversed by it",
                        original.state == TransferState::Done
                            && attempt.is_none_or(|a| {
                                original.reversed_by.map(|r| r.to_string()).as_deref() != Some(a)
                                    && attempt_doc.is_some_and(|r| {
                                        r.state == TransferState::Canceled
                                            && r.reason == Some(CancelReason::InsufficientFunds)
                                            && r.reverses == Some(original.id)
                                    })
                            }),
                        || {
                            format!(
                                "cancel of {id} answered {body}, but the original ends {} \
                                 reversedBy {:?} and the attempt is {attempt_doc:?}",
                                original.state, original.reversed_by
                            )
                        },
                    );
                }
            }
        }
    }
}

/// What an answer says about how a hold ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Claim {
    /// Captured, with this amount if the answer says.
    Captured(Option<i64>),
    /// Canceled for this reason.
    Canceled(CancelReason),
    /// Canceled, for a reason the answer does not give.
    NotCaptured,
}

/// All the answers about one hold name at most one winner: captured (with one amount),
/// or canceled for one reason (voided, expired, by request, for funds).
fn check_hold_winners(
    seen: &[Answer],
    by_id: &HashMap<TransferId, &Transfer>,
    checks: &mut Checks,
) {
    let mut claims: HashMap<String, Vec<(Claim, String)>> = HashMap::new();
    let is_hold = |id: &str| {
        TransferId::parse(id)
            .ok()
            .and_then(|id| by_id.get(&id))
            .is_some_and(|t| t.hold.is_some())
    };
    for answer in seen {
        let (id, claim, said) = match answer {
            Answer::Transfer {
                request,
                status,
                id,
                body,
                ..
            } => {
                let claim = match (request.hold, *status) {
                    (None, _) => continue,
                    (Some(_), 201) if body["state"] == "done" => {
                        Claim::Captured(body["amount"].as_i64())
                    }
                    (Some(_), 409) => Claim::NotCaptured,
                    (Some(_), 422) => Claim::Canceled(CancelReason::InsufficientFunds),
                    _ => continue,
                };
                (id, claim, format!("request answered {status} {body}"))
            }
            Answer::Settle {
                hold,
                settle,
                status,
                body,
                ..
            } => {
                let reason = body["reason"].as_str().and_then(CancelReason::parse);
                let claim = match (*status, code_of(body), reason) {
                    (200, _, None) => Claim::Captured(body["amount"].as_i64()),
                    (200, _, Some(reason)) => Claim::Canceled(reason),
                    (_, "hold_already_captured", _) => Claim::Captured(None),
                    (_, "hold_voided", _) => Claim::Canceled(CancelReason::Voided),
                    _ => Claim::Canceled(CancelReason::Expired),
                };
                (
                    &hold.id,
                    claim,
                    format!("{} answered {status} {body}", settle.path()),
                )
            }
            Answer::Cancel { id, status, body } => {
                if !is_hold(id) {
                    continue;
                }
                let reason = body["reason"].as_str().and_then(CancelReason::parse);
                let claim = match (*status, body["state"].as_str(), reason) {
                    (200, Some("canceled"), Some(reason)) => Claim::Canceled(reason),
                    // Reversed, being reversed, or not reversed for funds: it was captured.
                    _ => Claim::Captured(None),
                };
                (id, claim, format!("cancel answered {status} {body}"))
            }
        };
        claims.entry(id.clone()).or_default().push((claim, said));
    }
    for (id, claims) in &claims {
        let amounts: HashSet<i64> = claims
            .iter()
            .filter_map(|(c, _)| match c {
                Claim::Captured(amount) => *amount,
                _ => None,
            })
            .collect();
        let reasons: HashSet<CancelReason> = claims
            .iter()
            .filter_map(|(c, _)| match c {
                Claim::Canceled(reason) => Some(*reason),
                _ => None,
            })
            .collect();
        let captured = claims.iter().any(|(c, _)| matches!(c, Claim::Captured(_)));
        let canceled = claims.iter().any(|(c, _)| !matches!(c, Claim::Captured(_)));
        checks.check(
            "the answers about a hold name at most one winner",
            amounts.len() <= 1 && reasons.len() <= 1 && !(captured && canceled),
            || {
                let said: Vec<&String> = claims.iter().map(|(_, said)| said).collect();
                format!("hold {id}: {said:#?}")
            },
        );
    }
}

/// The reversal invariants, over every stored transfer.
fn check_reversals(
    transfers: &[Transfer],
    by_id: &HashMap<TransferId, &Transfer>,
    checks: &mut Checks,
) {
    let mut done_reversals: HashMap<TransferId, Vec<TransferId>> = HashMap::new();
    for r in transfers {
        let Some(original_id) = r.reverses else {
            continue;
        };
        let original = by_id.get(&original_id).copied();
        checks.check(
            "a reversal reverses a done original",
            original.is_some_and(|o| o.state == TransferState::Done),
            || format!("reversal {r:?} reverses {original:?}"),
        );
        let Some(original) = original else { continue };
        checks.check(
            "a reversal mirrors its original",
            r.amount == original.amount
                && r.source == original.destination
                && r.destination == original.source
                && r.currency == original.currency,
            || format!("reversal {r:?} of {original:?}"),
        );
        if r.state == TransferState::Done {
            checks.check(
                "a done reversal is its original's reversedBy",
                original.reversed_by == Some(r.id),
                || format!("done reversal {} but its original is {original:?}", r.id),
            );
            done_reversals.entry(original_id).or_default().push(r.id);
        }
    }
    for t in transfers {
        let done = done_reversals.get(&t.id).map_or(0, Vec::len);
        checks.check("at most one done reversal per transfer", done <= 1, || {
            format!("{} reversed by {:?}", t.id, done_reversals[&t.id])
        });
        if let Some(reversal_id) = t.reversed_by {
            let reversal = by_id.get(&reversal_id).copied();
            checks.check(
                "reversedBy names a done reversal of the transfer",
                reversal
                    .is_some_and(|r| r.state == TransferState::Done && r.reverses == Some(t.id)),
                || format!("{t:?} is reversed by {reversal:?}"),
            );
        }
        checks.check("no transfer left reversing", !t.reversing, || {
            format!("{t:?} is still reversing")
        });
        if t.state == TransferState::Canceled {
            checks.check(
                "a canceled transfer has a reason",
                t.reason.is_some(),
                || format!("{t:?} is canceled without a reason"),
            );
        }
    }
}

/// Where every stored thing is: each account once, on the deployment the layout puts it
/// on; each transfer in one log only, its source's, naming its destination's deployment.
fn check_placement(
    layout: Layout,
    transfers: &[Transfer],
    accounts: &[Account],
    checks: &mut Checks,
) {
    let mut stored: HashMap<&str, Vec<&str>> = HashMap::new();
    for a in accounts {
        stored
            .entry(a.id.as_str())
            .or_default()
            .push(a.deployment.as_str());
    }
    for i in 0..ACCOUNTS {
        let id = account(i);
        let home = layout.home_of(&id);
        let on = stored.get(id.as_str()).cloned().unwrap_or_default();
        checks.check(
            "every account is stored once, on the deployment it was opened on",
            on == [home],
            || format!("{id}, opened on {home}, is stored on {on:?}"),
        );
    }
    let mut logs: HashMap<TransferId, Vec<&str>> = HashMap::new();
    for t in transfers {
        logs.entry(t.id)
            .or_default()
            .push(t.source_deployment.as_str());
        checks.check(
            "a transfer is logged on its source's deployment",
            t.source_deployment.as_str() == layout.home_of(t.source.as_str()),
            || {
                format!(
                    "{} from {} (on {}) is logged on {}",
                    t.id,
                    t.source,
                    layout.home_of(t.source.as_str()),
                    t.source_deployment
                )
            },
        );
        checks.check(
            "a transfer names its destination's deployment",
            t.destination_deployment.as_str() == layout.home_of(t.destination.as_str()),
            || format!("{t:?}"),
        );
    }
    for (id, on) in &logs {
        checks.check(
            "a transfer id is in one log only, once",
            on.len() == 1,
            || format!("{id} is logged on {on:?}"),
        );
    }
}

/// The money: the total is unchanged; every balance is its opening balance plus the
/// `done` transfers into it minus those out of it; no balance is negative; nothing is
/// left pending, marked or fenced on any account.
fn check_balances(transfers: &[Transfer], accounts: &[Account], checks: &mut Checks) {
    let total: i64 = accounts.iter().map(|a| a.balance).sum();
    checks.check(
        "total balance unchanged",
        total == OPENING_BALANCE * ACCOUNTS as i64,
        || format!("total balance {total}"),
    );
    let mut expected: HashMap<&str, i64> = accounts
        .iter()
        .map(|a| (a.id.as_str(), OPENING_BALANCE))
        .collect();
    for t in transfers.iter().filter(|t| t.state == TransferState::Done) {
        *expected.get_mut(t.source.as_str()).unwrap() -= t.amount.minor_units();
        *expected.get_mut(t.destination.as_str()).unwrap() += t.amount.minor_units();
    }
    for a in accounts {
        checks.check("no negative balance", a.balance >= 0, || {
            format!("{} is negative: {}", a.id, a.balance)
        });
        checks.check(
            "no pendingTransactions left",
            a.pending_transactions.is_empty(),
            || format!("{} keeps markers {:?}", a.id, a.pending_transactions),
        );
        checks.check(
            "no pendingDebits or pendingCredits left",
            a.pending_debits == 0 && a.pending_credits == 0,
            || {
                format!(
                    "{} keeps pendingDebits {} and pendingCredits {}",
                    a.id, a.pending_debits, a.pending_credits
                )
            },
        );
        checks.check(
            "no fencedTransactions left after a lease and a few sweeps",
            a.fenced_transactions.is_empty(),
            || format!("{} keeps fences {:?}", a.id, a.fenced_transactions),
        );
        checks.check(
            "balance equals opening plus done transfers",
            a.balance == expected[a.id.as_str()],
            || {
                format!(
                    "{} holds {} but its done transfers say {}",
                    a.id,
                    a.balance,
                    expected[a.id.as_str()]
                )
            },
        );
    }
    let (pending_debits, pending_credits): (i64, i64) = accounts
        .iter()
        .map(|a| (a.pending_debits, a.pending_credits))
        .fold((0, 0), |(d, c), (ad, ac)| (d + ad, c + ac));
    checks.check(
        "the pendingDebits sum equals the pendingCredits sum",
        pending_debits == pending_credits,
        || format!("pendingDebits sum to {pending_debits}, pendingCredits to {pending_credits}"),
    );
}

/// Every transfer ended: terminal, a hold captured (at most what it held) or canceled,
/// no `fenced` flag left; and every transfer answered `done` still is.
fn check_ends(
    transfers: &[Transfer],
    by_id: &HashMap<TransferId, &Transfer>,
    done: &HashSet<String>,
    checks: &mut Checks,
) {
    for t in transfers {
        checks.check("every transfer terminal", t.state.is_terminal(), || {
            format!("{t:?} is not terminal")
        });
        if let Some(hold) = t.hold {
            checks.check(
                "a hold ends captured (at most what it held) or canceled (its amount the held one)",
                match t.state {
                    TransferState::Done => t.amount <= hold.amount,
                    TransferState::Canceled => t.amount == hold.amount && t.reason.is_some(),
                    _ => false,
                },
                || format!("{t:?}"),
            );
        }
        checks.check(
            "no transfer left marked fenced after a lease and a few sweeps",
            !t.fenced,
            || format!("{t:?} is still marked fenced"),
        );
    }
    for id in done {
        let state = by_id.get(&id.parse().unwrap()).map(|t| t.state);
        checks.check(
            "answered done is still done",
            state == Some(TransferState::Done),
            || format!("{id} was answered done and is now {state:?}"),
        );
    }
}

/// Idempotency keys and references: one request, at most one transfer, the one
/// answered. A key is unique among the transfers of one log (its source's deployment),
/// and taken there (`idempotencyKeys`) for that very transfer; as no client uses a key
/// with two sources, no key is recorded in two logs either. Then the requests whose
/// outcome the client never learned are looked up (by key in their source's log, or by
/// reference): if recorded, each must have finished. Returns how many of those there
/// were, by kind.
fn check_requests(
    layout: Layout,
    transfers: &[Transfer],
    by_id: &HashMap<TransferId, &Transfer>,
    key_records: &[KeyRecord],
    history: &History,
    checks: &mut Checks,
) -> BTreeMap<&'static str, u64> {
    // By (log, key).
    let mut recorded_keys: HashMap<(&str, &str), Vec<&Transfer>> = HashMap::new();
    let mut recorded_references: HashMap<&str, Vec<&Transfer>> = HashMap::new();
    for t in transfers {
        if let Some(key) = &t.idempotency_key {
            recorded_keys
                .entry((t.source_deployment.as_str(), key.key.as_str()))
                .or_default()
                .push(t);
        }
        if let Some(reference) = &t.reference {
            recorded_references
                .entry(reference.as_str())
                .or_default()
                .push(t);
        }
        if t.reverses.is_none() {
            let request = t
                .reference
                .as_ref()
                .and_then(|r| history.requests.get(r.as_str()));
            checks.check(
                "every transfer was asked for and matches its request",
                request.is_some_and(|r| {
                    r.mismatch(t).is_none()
                        && r.key.as_deref() == t.idempotency_key.as_ref().map(|k| k.key.as_str())
                }),
                || format!("{t:?} was asked for by {request:?}"),
            );
        }
    }
    let requests_by_key: HashMap<&str, &Request> = history
        .requests
        .values()
        .filter_map(|r| r.key.as_deref().map(|k| (k, r)))
        .collect();
    for (key, ids) in &history.keys {
        checks.check(
            "a key is answered with one transfer",
            ids.len() == 1,
            || format!("key {key} answered with {ids:?}"),
        );
        let log = requests_by_key
            .get(key.as_str())
            .map(|r| layout.home_of(&r.source))
            .unwrap_or_default();
        let recorded: Vec<String> = recorded_keys
            .get(&(log, key.as_str()))
            .map(|ts| ts.iter().map(|t| t.id.to_string()).collect())
            .unwrap_or_default();
        checks.check(
            "a key answered with a transfer is recorded on it, in its source's log",
            ids.iter().all(|id| recorded == [id.clone()]),
            || format!("key {key} answered with {ids:?} but recorded on {recorded:?} in {log}"),
        );
    }
    let mut logs_of_key: HashMap<&str, Vec<&str>> = HashMap::new();
    for ((log, key), ts) in &recorded_keys {
        checks.check("a key is recorded once in a log", ts.len() == 1, || {
            format!("key {key} recorded {} times in {log}", ts.len())
        });
        logs_of_key.entry(key).or_default().push(log);
        let taken: Vec<Option<TransferId>> = key_records
            .iter()
            .filter(|r| r.deployment == *log && r.key == *key)
            .map(|r| r.transfer)
            .collect();
        checks.check(
            "a recorded key is taken in its log, for its transfer",
            ts.iter().all(|t| taken == [Some(t.id)]),
            || format!("key {key} recorded in {log} on {ts:?} but taken there for {taken:?}"),
        );
    }
    for (key, logs) in &logs_of_key {
        checks.check(
            "a key used with one source only is recorded in one log only",
            logs.len() == 1,
            || format!("key {key} recorded in {logs:?}"),
        );
    }
    for record in key_records {
        // A key taken for a transfer never recorded (its request died or was refused in
        // between) names no stored transfer: that is allowed.
        let Some(t) = record.transfer.and_then(|id| by_id.get(&id)) else {
            continue;
        };
        checks.check(
            "a key is taken for a transfer of its own log that carries it",
            t.source_deployment.as_str() == record.deployment
                // No API keys here: every key is shared, stored as sent.
                && t.idempotency_key.as_ref().map(|k| k.key.as_str()) == Some(record.key.as_str()),
            || {
                format!(
                    "key {} taken in {} for {t:?}",
                    record.key, record.deployment
                )
            },
        );
    }
    for (reference, ts) in &recorded_references {
        checks.check(
            "a request makes at most one transfer",
            ts.len() == 1,
            || {
                let ids: Vec<String> = ts.iter().map(|t| t.id.to_string()).collect();
                format!("request {reference} made {ids:?}")
            },
        );
    }

    let mut unknown: BTreeMap<&'static str, u64> = BTreeMap::new();
    for request in &history.unanswered {
        let found = match &request.key {
            Some(key) => recorded_keys.get(&(layout.home_of(&request.source), key.as_str())),
            None => recorded_references.get(request.reference.as_str()),
        }
        .and_then(|ts| ts.first().copied());
        let kind = match (&request.key, found) {
            (Some(_), Some(_)) => "keyed, recorded",
            (Some(_), None) => "keyed, never recorded",
            (None, Some(_)) => "keyless, recorded",
            (None, None) => "keyless, never recorded",
        };
        *unknown.entry(kind).or_default() += 1;
        if let Some(t) = found {
            checks.check(
                "an unanswered request's transfer ends terminal",
                t.state.is_terminal(),
                || format!("{request:?} never answered and its transfer is {t:?}"),
            );
        }
    }
    unknown
}

/// What the clients were answered 201 while a deployment was down (sent after its kill,
/// answered before its restart), between accounts of the other deployments.
#[derive(Debug, Default)]
struct WhileDown {
    /// Transfers made and answered `done` then...
    transfers: u64,
    /// ...of which asked for by the probe ([`probe_while_down`]).
    by_probe: u64,
    /// Holds made and answered `held` then.
    holds: u64,
    /// Replays of a key, answered with what an earlier request made.
    replays: u64,
}

/// Checks that nothing touching the deployment that was down was answered `done` while
/// it was (a replay aside, which reads the source's log only: it may answer with a
/// transfer finished before), and counts what the others got done meanwhile.
fn check_outage(
    layout: Layout,
    outage: &Outage,
    seen: &[Answer],
    checks: &mut Checks,
) -> WhileDown {
    let mut while_down = WhileDown::default();
    for answer in seen {
        let Answer::Transfer {
            request,
            status: 201,
            body,
            replayed,
            sent,
            answered,
            ..
        } = answer
        else {
            continue;
        };
        if *sent < outage.from || *answered > outage.until {
            continue;
        }
        let touches = [&request.source, &request.destination]
            .iter()
            .any(|a| layout.home_of(a) == outage.deployment);
        if request.hold.is_none() && !replayed {
            checks.check(
                "nothing touching a deployment that is down is answered done (replays aside)",
                !touches,
                || {
                    format!(
                        "{request:?} answered 201 {body} while {} was down",
                        outage.deployment
                    )
                },
            );
        }
        if touches {
            continue;
        }
        match (request.hold, replayed) {
            (_, true) => while_down.replays += 1,
            (None, false) => {
                while_down.transfers += 1;
                if request.reference.starts_with("probe-") {
                    while_down.by_probe += 1;
                }
            }
            (Some(_), false) => while_down.holds += 1,
        }
    }
    while_down
}

/// One bank test at a time: each runs three instances, its database servers, a dozen
/// clients and a proxy, about what two cores can take; two at once would mostly test the
/// machine.
static ONE_BANK_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bank_keeps_its_money_through_killed_instances_and_a_database_restart() {
    run_bank(Layout::OneDeployment).await;
}

/// The same across three deployments, each account on one of them, where one
/// deployment's server is killed and restarted in the middle: meanwhile the transfers
/// between the two others must go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bank_keeps_its_money_across_three_deployments_and_serves_two_while_the_third_restarts()
{
    run_bank(Layout::ThreeDeployments).await;
}

/// The scenario of the module doc, with the accounts on `layout`'s deployments.
async fn run_bank(layout: Layout) {
    let _alone = ONE_BANK_AT_A_TIME.lock().await;
    let seconds: u64 = std::env::var("BANK_TEST_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    // Its own database servers, so that the nemesis can restart one; with MONGODB_URI
    // set, the servers named there are used and left alone.
    let mut servers = Servers::start(layout);
    let database = fresh_database_name();

    // The faulty network, between the proxied slots and every deployment (a proxy for
    // each); it lives as long as the test (across restarts of the instances and of the
    // database servers).
    let faults = Faults {
        delay_max: Duration::from_millis(PROXY_DELAY_MAX_MS),
        slow_chance: PROXY_SLOW_CHANCE,
        slow_delay_max: Duration::from_millis(PROXY_SLOW_DELAY_MAX_MS),
        resets_per_second: PROXY_RESETS_PER_SECOND,
        max_connections: PROXY_MAX_CONNECTIONS,
    };
    let mut proxies: Vec<(usize, &str, Proxy)> = Vec::new();
    let mut uris = Vec::new();
    for (slot, proxied) in PROXIED.iter().enumerate() {
        let mut reach = Vec::new();
        for (name, uri) in layout.deployments().iter().zip(&servers.uris) {
            if *proxied {
                let proxy = Proxy::start(upstream_of(uri), faults).await;
                reach.push(proxied_uri(uri, proxy.addr));
                proxies.push((slot, name, proxy));
            } else {
                reach.push(uri.clone());
            }
        }
        uris.push(reach);
    }
    let slots = Slots {
        layout,
        uris,
        database: database.clone(),
    };
    let skews: Vec<String> = CLOCK_SKEWS
        .iter()
        .enumerate()
        .map(|(slot, skew)| format!("slot {slot} {skew:+} s"))
        .collect();

    let mut instances: Vec<Instance> = Vec::new();
    for i in 0..INSTANCES {
        instances.push(slots.start(i, &format!("bank-{i}")).await);
    }
    let http = reqwest::Client::new();
    // Opened through an instance with a direct connection: no fault may refuse them.
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
    let bases: Bases = Arc::new(Mutex::new(
        instances.iter().map(|i| Some(i.base.clone())).collect(),
    ));
    let history = Arc::new(Mutex::new(History::default()));
    let books = Books::connect(layout, &servers.uris, &database).await;
    let sampling = CancellationToken::new();
    let sampler = tokio::spawn(sample_accounts(books.clone(), sampling.clone()));
    let stop = CancellationToken::new();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|seed| tokio::spawn(client(seed, bases.clone(), history.clone(), stop.clone())))
        .collect();

    // The nemesis.
    let mut recovery_cancels = Vec::new();
    let started = Instant::now();
    let run_for = Duration::from_secs(seconds);
    let mut killed = 0;
    let mut renamed = 0;
    let mut outage: Option<Outage> = None;
    let mut probes = Vec::new();
    let mut generation = 0;
    while started.elapsed() < run_for {
        let pause_ms = rand::rng().random_range(800..2000);
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        if outage.is_none() && servers.owned() && started.elapsed() >= run_for / 2 {
            // The one deployment's server, or one of the three, at random; across three,
            // a probe moves money between the two others while it is down.
            let d = rand::rng().random_range(0..layout.deployments().len());
            let from = servers.kill(d);
            let probing = stop.child_token();
            if layout.deployments().len() > 1 {
                probes.push(tokio::spawn(probe_while_down(
                    layout,
                    d,
                    bases.clone(),
                    history.clone(),
                    probing.clone(),
                )));
            }
            tokio::time::sleep(layout.down_for()).await;
            probing.cancel();
            let until = Instant::now();
            servers.revive(d);
            println!(
                "nemesis: the database server of deployment {} restarted after {:?} down",
                layout.deployments()[d],
                until - from
            );
            outage = Some(Outage {
                deployment: layout.deployments()[d],
                from,
                until,
            });
            continue;
        }
        let victim = rand::rng().random_range(0..INSTANCES);
        bases.lock().unwrap()[victim] = None;
        instances[victim].kill();
        killed += 1;
        // The requests outstanding on it have lost their answer; cancel what it left
        // while the survivors' sweepers take it over.
        let references: Vec<String> = history
            .lock()
            .unwrap()
            .in_flight
            .iter()
            .filter(|(_, slot)| **slot == victim)
            .map(|(reference, _)| reference.clone())
            .collect();
        recovery_cancels.push(tokio::spawn(cancel_recovering(
            books.clone(),
            bases.clone(),
            history.clone(),
            victim,
            instances[victim].name.clone(),
            references,
        )));
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
        instances[victim] = slots.start(victim, &name).await;
        bases.lock().unwrap()[victim] = Some(instances[victim].base.clone());
    }
    stop.cancel();
    for c in clients {
        c.await.unwrap();
    }
    for c in recovery_cancels.into_iter().chain(probes) {
        c.await.unwrap();
    }

    // Quiescence: every transfer terminal (a lease, a few sweeps, and the backlog; every
    // hold left held expires within seconds).
    let load_stopped = Instant::now();
    let quiet_deadline = load_stopped + Duration::from_secs(60);
    loop {
        let (transfers, _) = books.snapshot().await;
        if transfers.iter().all(|t| t.state.is_terminal()) {
            break;
        }
        assert!(
            Instant::now() < quiet_deadline,
            "transfers still unfinished a minute after the load stopped"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let terminal_after = load_stopped.elapsed();
    // Then the housekeeping: within a whole lease and a few sweeps (with their jitter)
    // the sweepers finish interrupted reversals and drop every fence. Bounded; what is
    // left at the deadline is a violation below.
    let settle_for = Duration::from_millis(STALE_AFTER_MS + 5 * SWEEP_INTERVAL_MS * 6 / 5)
        + Duration::from_secs(1);
    let settle_started = Instant::now();
    let (transfers, accounts) = loop {
        let (transfers, accounts) = books.snapshot().await;
        let left = unsettled(&transfers, &accounts);
        if left.is_empty() || settle_started.elapsed() >= settle_for {
            if !left.is_empty() {
                println!(
                    "still unsettled {:?} after the load stopped: {left:#?}",
                    load_stopped.elapsed()
                );
            }
            break (transfers, accounts);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let settled_after = settle_started.elapsed();
    let key_records = books.key_records().await;
    sampling.cancel();
    let (sampled, samples, failed_samples) = sampler.await.unwrap();
    let history = history.lock().unwrap();

    // What happened.
    let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
    let mut hold_outcomes: BTreeMap<String, u64> = BTreeMap::new();
    for t in &transfers {
        if let Some(hold) = t.hold {
            let outcome = match (t.state, t.reason) {
                (TransferState::Done, _) if t.amount == hold.amount => {
                    "captured in full".to_owned()
                }
                (TransferState::Done, _) => "captured in part".to_owned(),
                (state, Some(reason)) => format!("{state} ({reason})"),
                (state, None) => state.to_string(),
            };
            *hold_outcomes.entry(outcome).or_default() += 1;
            continue;
        }
        let outcome = match (t.state, t.reason, t.reverses) {
            (TransferState::Done, _, Some(_)) => "done (reversal)".to_owned(),
            (TransferState::Done, _, None) => "done".to_owned(),
            (state, Some(reason), Some(_)) => format!("{state} ({reason}, reversal)"),
            (state, Some(reason), None) => format!("{state} ({reason})"),
            (state, None, _) => state.to_string(),
        };
        *outcomes.entry(outcome).or_default() += 1;
    }
    let hold_plans: BTreeMap<&str, u64> = history
        .hold_plans
        .iter()
        .map(|(plan, n)| (plan.label(), *n))
        .collect();
    let restarts = match outage.as_ref().map(|o| o.deployment) {
        Some(deployment) => format!("1 database server restart (deployment {deployment})"),
        None => "no database server restart".to_owned(),
    };
    println!(
        "bank test ({layout:?}, deployments {:?}): {seconds} s of load, {CLIENTS} clients, \
         {INSTANCES} instances; {killed} instances killed with SIGKILL and restarted \
         ({renamed} under a new name), {restarts}; every transfer terminal \
         {terminal_after:?} after the load stopped, settled (reversals, fences) \
         {settled_after:?} later",
        layout.deployments()
    );
    println!("transfers (holds aside) by outcome: {outcomes:?}");
    println!(
        "holds: {} stored, by outcome {hold_outcomes:?}; holds answered held, by plan \
         {hold_plans:?}; captures and voids with an unknown outcome: {}",
        hold_outcomes.values().sum::<u64>(),
        history.settles_unknown
    );
    let cross = transfers
        .iter()
        .filter(|t| t.source_deployment != t.destination_deployment)
        .count();
    let mut per_log: BTreeMap<&str, usize> = BTreeMap::new();
    for t in &transfers {
        *per_log.entry(t.source_deployment.as_str()).or_default() += 1;
    }
    println!(
        "transfers by log {per_log:?}; {cross} of {} across two deployments",
        transfers.len()
    );
    println!(
        "accounts sampled {samples} times, a deployment at a time ({failed_samples} reads \
         failed)"
    );
    println!("client answers: {:?}", history.answers);

    // The checks.
    let mut checks = Checks {
        violations: history.violations.clone(),
        ..Checks::default()
    };
    for (invariant, n) in sampled.counts {
        *checks.counts.entry(invariant).or_default() += n;
    }
    checks.violations.extend(sampled.violations);
    check_placement(layout, &transfers, &accounts, &mut checks);
    check_balances(&transfers, &accounts, &mut checks);
    // An id in two logs is a violation above (check_placement); here one copy stands.
    let by_id: HashMap<TransferId, &Transfer> = transfers.iter().map(|t| (t.id, t)).collect();
    check_ends(&transfers, &by_id, &history.done, &mut checks);
    check_reversals(&transfers, &by_id, &mut checks);
    // The database servers run on this host (their clock is the test's) unless
    // MONGODB_URI is set.
    let same_clock = servers.owned();
    for answer in &history.seen {
        check_answer(answer, &by_id, same_clock, &mut checks);
    }
    check_hold_winners(&history.seen, &by_id, &mut checks);
    let unknown = check_requests(
        layout,
        &transfers,
        &by_id,
        &key_records,
        &history,
        &mut checks,
    );
    let while_down = outage
        .as_ref()
        .map(|o| check_outage(layout, o, &history.seen, &mut checks));
    for reference in &history.suspects {
        let stored: Vec<&Transfer> = transfers
            .iter()
            .filter(|t| t.reference.as_ref().map(|r| r.as_str()) == Some(reference.as_str()))
            .collect();
        println!("request {reference}, answered wrongly, made {stored:#?}");
    }
    println!(
        "requests without a definitive answer: {} ({unknown:?}); never sent: {}; cancels \
         with an unknown outcome: {}",
        history.unanswered.len(),
        history.unsent,
        history.cancels_unknown
    );
    if let (Some(outage), Some(while_down), true) =
        (&outage, &while_down, layout.deployments().len() > 1)
    {
        println!(
            "while deployment {} was down ({:?}), answered 201 between the other \
             deployments' accounts: {while_down:?}",
            outage.deployment,
            outage.until - outage.from
        );
    }
    println!(
        "{} transfers, {} answered done, {} idempotency keys, {} violations",
        transfers.len(),
        history.done.len(),
        history.keys.len(),
        checks.violations.len()
    );
    let answers: u64 = history.answers.values().sum();
    let checked: u64 = checks.counts.values().sum();
    let faults: Vec<String> = proxies
        .iter()
        .map(|(slot, deployment, proxy)| {
            let c = proxy.counts();
            format!(
                "proxy of slot {slot} to {deployment}: {} connections ({} refused), {} of {} \
                 chunks delayed ({} slow), {} resets",
                c.connections, c.refused, c.delayed, c.chunks, c.slow, c.resets
            )
        })
        .collect();
    println!(
        "summary: {answers} client answers {:?}; {checked} checks of {} invariants {:?}; \
         {} violations; faults: {}; clock skews: {}; transfers of killed instances canceled \
         while recovered: {:?}",
        history.answers,
        checks.counts.len(),
        checks.counts,
        checks.violations.len(),
        faults.join(", "),
        skews.join(", "),
        history.recovery_targets
    );
    assert!(
        outcomes.get("done").copied().unwrap_or(0) > 50,
        "the load made too few transfers to mean anything: {outcomes:?}"
    );
    for outcome in [
        "captured in full",
        "captured in part",
        "canceled (voided)",
        "canceled (expired)",
    ] {
        assert!(
            hold_outcomes.get(outcome).copied().unwrap_or(0) > 0,
            "no hold ended {outcome}: {hold_outcomes:?}"
        );
    }
    assert!(killed >= 3, "the nemesis killed too few instances");
    if layout == Layout::ThreeDeployments {
        assert!(
            cross > 0 && cross < transfers.len(),
            "the transfers should mostly cross deployments, and some stay within one: \
             {cross} of {} cross",
            transfers.len()
        );
        if let Some(while_down) = &while_down {
            assert!(
                while_down.transfers > 0,
                "no transfer between the two other deployments was made while one was down"
            );
        }
    }
    assert!(
        checks.violations.is_empty(),
        "violations: {:#?}",
        checks.violations
    );
}
