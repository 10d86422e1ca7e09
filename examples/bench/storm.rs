//! Part 6b, the retry storm: many connections, each sending `POST /transfers` one after
//! the other (closed loop) and retrying a refused one, either at once (an impatient
//! client: a naive retry loop, a load tool, a buggy frontend, which ignore
//! `Retry-After`) or after the `Retry-After` it was given (a polite one).
//!
//! For each mode (synchronous, `Prefer: respond-async`) it first measures the capacity:
//! the same client at `capacity_connections` (64). Then the storm, with `connections`
//! (1,000) impatient clients, and the same number of polite ones. Each scenario starts a
//! fresh service and database and seeds the accounts; each client, on one connection of
//! its own (kept alive; a new one only when the service closed it, as wrk does), sends a
//! transfer
//! between a random pair, and on a 201 or 202 (or any answer that is not a refusal)
//! sends the next one, on a 503 `overloaded` the same one again. At the burst's end the
//! clients stop sending; the benchmark waits until every request answered and no
//! transfer is open, then makes the checks of the open-loop scenarios (money conserved,
//! no marker left, every accepted transfer recorded and terminal, every 201 `done`,
//! refusals recorded nothing).
//!
//! Reported: transfers done per second of burst (sync: 201 answers received during the
//! burst; respond-async: 202 answers received during the burst whose transfer ended
//! `done`) against the capacity of the same mode, refusals (503 `overloaded`) per
//! second, the service's CPU during the burst, its peak RSS, and the drain (from the
//! burst's end until everything answered and terminal).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use mongodb::Database;
use serde::Serialize;

use crate::overload::{
    account_ids, insert_accounts, money, open_transfers, server_env, start_two_phase,
    transfer_states,
};
use crate::procs::{Server, sample};
use crate::service::{Context, log_summary, mib, random_pair, transfer_body};

#[derive(Debug, Clone, Serialize)]
pub struct StormPlan {
    /// Clients (each with its one connection at a time) of the storm.
    pub connections: usize,
    /// Clients of the capacity measurement.
    pub capacity_connections: usize,
    pub burst_s: f64,
    pub accounts: usize,
    pub opening_balance: i64,
    pub amount: i64,
    /// Given to each service; `admission_wait_ms` unset leaves the service's default.
    pub max_transfers_in_flight: usize,
    pub stale_after_ms: u64,
    pub admission_wait_ms: Option<u64>,
    /// How long after the drain goal the benchmark stops waiting.
    pub give_up_after_goal_s: f64,
    /// Goals (printed, not asserted).
    pub goal_done_fraction: f64,
    pub goal_peak_rss_mib: f64,
}

impl StormPlan {
    /// Everything answered and terminal within this many seconds after the burst: two
    /// leases.
    pub fn drain_goal_s(&self) -> f64 {
        2.0 * self.stale_after_ms as f64 / 1000.0
    }
}

/// What a client does with a 503 `overloaded`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Retry {
    /// Sends it again at once.
    AtOnce,
    /// Waits `Retry-After` seconds, then sends it again.
    AfterRetryAfter,
}

#[derive(Debug, Clone, Serialize)]
pub struct StormGoals {
    /// None for the capacity measurement itself.
    pub done_met: Option<bool>,
    pub drain_met: bool,
    pub peak_rss_met: Option<bool>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StormScenario {
    /// `sync, 64 connections (capacity)`, `respond-async, 1000 impatient`, ...
    pub name: String,
    pub respond_async: bool,
    pub connections: usize,
    pub retry: Retry,
    /// Whether this is the capacity measurement of its mode.
    pub capacity: bool,
    pub database: String,
    pub server_log: String,
    pub burst_s: f64,
    /// Requests sent (all during the burst; the last ones may be answered after it).
    pub sent: u64,
    /// Every answer, by status and problem `code` (`201`, `503 overloaded`, ...), and
    /// transport failures.
    pub answers: BTreeMap<String, u64>,
    /// The first body of each kind of answer other than 201, 202 and 503 `overloaded`
    /// (for a transport failure, the error).
    pub answer_samples: BTreeMap<String, String>,
    pub overloaded_without_retry_after: u64,
    /// 503 `overloaded` answers received during the burst, and per second of it.
    pub refused_in_burst: u64,
    pub refused_per_s: f64,
    /// Transfers done during the burst (see the module), and per second of it.
    pub done_in_burst: u64,
    pub done_per_s: f64,
    /// `done_per_s` over the capacity of the same mode; None for the capacity itself.
    pub done_over_capacity: Option<f64>,
    pub accepted: u64,
    pub accepted_end_states: BTreeMap<String, u64>,
    pub recorded: u64,
    pub recorded_by_state: BTreeMap<String, u64>,
    /// From the burst's end until every request answered and no transfer was open;
    /// None: still not when the benchmark gave up.
    pub drain_s: Option<f64>,
    pub last_answer_after_s: Option<f64>,
    /// The service's CPU seconds per second of burst (2.0 = both cores of this machine),
    /// and this benchmark's own (the client shares the machine).
    pub server_cpu_per_s: Option<f64>,
    pub client_cpu_per_s: Option<f64>,
    pub peak_rss_mib: Option<f64>,
    pub sampled_max_rss_mib: Option<f64>,
    pub money_before: i64,
    pub money_after: i64,
    pub accounts_with_pending: u64,
    pub goals: StormGoals,
    pub violations: Vec<String>,
    pub server_log_lines: usize,
    pub server_log_kinds: BTreeMap<String, u64>,
    pub seconds: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct StormResult {
    pub plan: StormPlan,
    pub scenarios: Vec<StormScenario>,
    pub error: Option<String>,
}

impl StormResult {
    /// Every violation of every scenario, each prefixed by its scenario.
    pub fn violations(&self) -> Vec<String> {
        self.scenarios
            .iter()
            .flat_map(|s| s.violations.iter().map(move |v| format!("{}: {v}", s.name)))
            .collect()
    }
}

/// Runs part 6b: per mode, the capacity, then the impatient and the polite storm.
pub async fn run(ctx: &Context, plan: &StormPlan) -> StormResult {
    let mut result = StormResult {
        plan: plan.clone(),
        scenarios: Vec::new(),
        error: None,
    };
    for respond_async in [false, true] {
        let mut capacity = None;
        let runs = [
            (plan.capacity_connections, Retry::AtOnce, true),
            (plan.connections, Retry::AtOnce, false),
            (plan.connections, Retry::AfterRetryAfter, false),
        ];
        for (connections, retry, is_capacity) in runs {
            let name = scenario_name(respond_async, connections, retry, is_capacity);
            let shape = Shape {
                name: name.clone(),
                respond_async,
                connections,
                retry,
                is_capacity,
                capacity: if is_capacity { None } else { capacity },
            };
            match scenario(ctx, plan, &shape).await {
                Ok(s) => {
                    if is_capacity {
                        capacity = Some(s.done_per_s);
                    }
                    result.scenarios.push(s);
                }
                Err(e) => {
                    eprintln!("[storm] {name} failed: {e}");
                    result
                        .error
                        .get_or_insert_with(|| format!("{name} failed: {e}"));
                }
            }
        }
    }
    result
}

fn scenario_name(respond_async: bool, connections: usize, retry: Retry, capacity: bool) -> String {
    let mode = if respond_async {
        "respond-async"
    } else {
        "sync"
    };
    if capacity {
        return format!("{mode}, {connections} connections (capacity)");
    }
    let client = match retry {
        Retry::AtOnce => "impatient (retry at once)",
        Retry::AfterRetryAfter => "polite (Retry-After)",
    };
    format!("{mode}, {connections} {client}")
}

/// One scenario's client: how many, what they ask for and how they retry.
struct Shape {
    name: String,
    respond_async: bool,
    connections: usize,
    retry: Retry,
    /// Whether this is the capacity measurement of its mode.
    is_capacity: bool,
    /// Done per second at the capacity measurement of this mode, when it ran.
    capacity: Option<f64>,
}

async fn scenario(ctx: &Context, plan: &StormPlan, shape: &Shape) -> Result<StormScenario, String> {
    let clock = Instant::now();
    let slug: String = shape
        .name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let database = format!("{}_storm_{}", ctx.db_prefix, slug);
    let database: String = database.chars().take(63).collect();
    let log = ctx.out.join(format!("server-storm-{slug}.log"));
    eprintln!(
        "[storm] {}: {} clients for {} s",
        shape.name, shape.connections, plan.burst_s
    );
    let env = server_env(
        plan.max_transfers_in_flight,
        plan.stale_after_ms,
        plan.admission_wait_ms,
    );
    let server = start_two_phase(ctx, &database, &log, &env).await?;
    let pid = server.pid();
    let db = ctx.mongo.database(&database);

    // RSS sampled every 100 ms for as long as the service lives.
    let stop_sampling = Arc::new(AtomicBool::new(false));
    let max_rss_kib = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (stop, max) = (Arc::clone(&stop_sampling), Arc::clone(&max_rss_kib));
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Some(s) = sample(pid) {
                    max.fetch_max(s.rss_kib, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let outcome = storm_and_check(ctx, plan, shape, &server, &db).await;
    let peak = sample(pid).map(|s| mib(s.peak_rss_kib));
    stop_sampling.store(true, Ordering::Relaxed);
    let _ = sampler.await;
    server.stop().await;
    let _ = db.drop().await;
    let mut s = outcome?;
    s.database = database;
    s.server_log = log.display().to_string();
    s.peak_rss_mib = peak;
    let sampled = max_rss_kib.load(Ordering::Relaxed);
    s.sampled_max_rss_mib = (sampled > 0).then(|| mib(sampled));
    s.goals.peak_rss_met = peak.map(|p| p < plan.goal_peak_rss_mib);
    (s.server_log_lines, s.server_log_kinds) = log_summary(&log);
    s.seconds = clock.elapsed().as_secs_f64();
    let met = |m: bool| if m { "met" } else { "MISSED" };
    eprintln!(
        "[storm] {}: done {:.1}/s{}; refused {:.0}/s; service CPU {}/s; drain {} (goal ≤ {} s: {}); peak RSS {} MiB (goal < {}: {}); answers: {}",
        s.name,
        s.done_per_s,
        s.done_over_capacity.map_or(String::new(), |r| format!(
            " = {r:.2} of capacity (goal ≥ {:.2}: {})",
            plan.goal_done_fraction,
            met(r >= plan.goal_done_fraction)
        )),
        s.refused_per_s,
        s.server_cpu_per_s.map_or("?".into(), |c| format!("{c:.2}")),
        s.drain_s
            .map_or("never (gave up)".into(), |t| format!("{t:.1} s")),
        plan.drain_goal_s(),
        met(s.goals.drain_met),
        peak.map_or("?".into(), |p| format!("{p:.1}")),
        plan.goal_peak_rss_mib,
        s.goals.peak_rss_met.map_or("?", met),
        crate::overload::answers_brief(&s.answers),
    );
    for v in &s.violations {
        eprintln!("[storm] {}: VIOLATION: {v}", s.name);
    }
    Ok(s)
}

/// What one client saw, merged into the scenario's at the end (no channel, no lock:
/// the client must cost as little CPU as it can, since it shares the machine).
#[derive(Default)]
struct Seen {
    answers: HashMap<String, u64>,
    samples: BTreeMap<String, String>,
    overloaded_without_retry_after: u64,
    /// (answer time, status, id) of every 201 and 202.
    accepted: Vec<(Instant, u16, String)>,
    /// 422s that recorded a transfer (they carry `transferId`).
    recorded_canceled: u64,
    /// Answers that say nothing about whether a transfer was recorded.
    unknown: u64,
    refused_in_burst: u64,
    sent: u64,
    last_answer: Option<Instant>,
}

impl Seen {
    /// A request that got no answer (`kind`, and the error): it may or may not have
    /// recorded a transfer.
    fn unanswered(&mut self, kind: &str, error: String) {
        self.last_answer = Some(Instant::now());
        *self.answers.entry(kind.into()).or_default() += 1;
        self.unknown += 1;
        self.samples
            .entry(kind.into())
            .or_insert_with(|| error.chars().take(600).collect());
    }

    fn merge(&mut self, other: Seen) {
        for (k, n) in other.answers {
            *self.answers.entry(k).or_default() += n;
        }
        for (k, v) in other.samples {
            self.samples.entry(k).or_insert(v);
        }
        self.overloaded_without_retry_after += other.overloaded_without_retry_after;
        self.accepted.extend(other.accepted);
        self.recorded_canceled += other.recorded_canceled;
        self.unknown += other.unknown;
        self.refused_in_burst += other.refused_in_burst;
        self.sent += other.sent;
        self.last_answer = match (self.last_answer, other.last_answer) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
}

/// What one request came to, for the client's next move.
enum Next {
    /// Accepted or refused for good: the next transfer.
    Another,
    /// Refused for now (503 `overloaded`), or not answered: the same one again, after
    /// this pause.
    Again(Duration),
}

/// Where the clients send their transfers.
#[derive(Clone)]
struct Target {
    address: std::net::SocketAddr,
    /// `Host`: `127.0.0.1:port`.
    host: Arc<str>,
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

/// Opens one connection to `target`; its driver runs in a task of its own until the
/// sender is dropped or the service closes it.
async fn connect(target: &Target) -> Result<Sender, String> {
    let stream = tokio::net::TcpStream::connect(target.address)
        .await
        .map_err(|e| format!("{e}"))?;
    let _ = stream.set_nodelay(true);
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("{e}"))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// One client: one connection at a time (a new one only once the service closed it),
/// transfers one after the other until `stop`, each sent again after a 503
/// `overloaded` as `retry` says.
#[allow(clippy::too_many_arguments)]
async fn client(
    target: Target,
    ids: Arc<Vec<String>>,
    amount: i64,
    respond_async: bool,
    retry: Retry,
    start: Instant,
    stop: Instant,
) -> Seen {
    let mut seen = Seen::default();
    let new_body = || {
        let (a, b) = random_pair(&ids);
        Bytes::from(transfer_body(a, b, amount))
    };
    let mut body = new_body();
    let mut connection: Option<Sender> = None;
    tokio::time::sleep_until(start.into()).await;
    while Instant::now() < stop {
        let sender = match connection.as_mut() {
            Some(sender) => sender,
            None => match connect(&target).await {
                Ok(sender) => connection.insert(sender),
                Err(e) => {
                    seen.unanswered("transport: connect", e);
                    pause_until(Duration::from_millis(100), stop).await;
                    continue;
                }
            },
        };
        let mut request = hyper::Request::post("/transfers")
            .header(hyper::header::HOST, &*target.host)
            .header(hyper::header::CONTENT_TYPE, "application/json");
        if respond_async {
            request = request.header("prefer", "respond-async");
        }
        let request = request
            .body(Full::new(body.clone()))
            .expect("a valid request");
        seen.sent += 1;
        let sent = match sender.ready().await {
            Ok(()) => sender.send_request(request).await,
            Err(e) => Err(e),
        };
        let next = match sent {
            Err(e) => {
                connection = None;
                seen.unanswered("transport: request", e.to_string());
                Next::Again(Duration::from_millis(100))
            }
            Ok(response) => {
                let (parts, incoming) = response.into_parts();
                if parts
                    .headers
                    .get(hyper::header::CONNECTION)
                    .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"))
                {
                    connection = None;
                }
                match incoming.collect().await {
                    Ok(collected) => {
                        answered(&mut seen, &parts, &collected.to_bytes(), retry, stop)
                    }
                    Err(e) => {
                        connection = None;
                        seen.unanswered("transport: body", e.to_string());
                        Next::Again(Duration::from_millis(100))
                    }
                }
            }
        };
        match next {
            Next::Another => body = new_body(),
            Next::Again(pause) => pause_until(pause, stop).await,
        }
    }
    seen
}

/// Sleeps `pause`, but not past `stop`.
async fn pause_until(pause: Duration, stop: Instant) {
    if !pause.is_zero() {
        tokio::time::sleep_until((Instant::now() + pause).min(stop).into()).await;
    }
}

/// Tallies one answer; what the client does next.
fn answered(
    seen: &mut Seen,
    parts: &hyper::http::response::Parts,
    body: &[u8],
    retry: Retry,
    stop: Instant,
) -> Next {
    let at = Instant::now();
    seen.last_answer = Some(at);
    let status = parts.status.as_u16();
    // The refusals are most answers of a storm: told apart without parsing JSON.
    if status == 503 && contains(body, br#""code":"overloaded""#) {
        let retry_after = parts
            .headers
            .get(hyper::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        *seen.answers.entry("503 overloaded".into()).or_default() += 1;
        if at <= stop {
            seen.refused_in_burst += 1;
        }
        if retry_after.is_none() {
            seen.overloaded_without_retry_after += 1;
        }
        return Next::Again(match retry {
            Retry::AtOnce => Duration::ZERO,
            Retry::AfterRetryAfter => Duration::from_secs(retry_after.unwrap_or(1)),
        });
    }
    let json: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let field = |name: &str| json[name].as_str().map(str::to_owned);
    let kind = match (status, field("id")) {
        (201 | 202, Some(id)) => {
            seen.accepted.push((at, status, id));
            status.to_string()
        }
        (201 | 202, None) => {
            seen.unknown += 1;
            format!("{status} without id")
        }
        _ => {
            if field("transferId").is_some() {
                seen.recorded_canceled += 1;
            } else if !(400..500).contains(&status) {
                seen.unknown += 1;
            }
            format!("{status} {}", field("code").unwrap_or_default())
        }
    };
    if status != 201 && status != 202 && !seen.samples.contains_key(&kind) {
        let text = String::from_utf8_lossy(body).chars().take(600).collect();
        seen.samples.insert(kind.clone(), text);
    }
    *seen.answers.entry(kind).or_default() += 1;
    if status >= 500 {
        // Another 5xx (a time-out, the database): the same transfer, after a pause.
        return Next::Again(Duration::from_millis(100));
    }
    Next::Another
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

async fn storm_and_check(
    ctx: &Context,
    plan: &StormPlan,
    shape: &Shape,
    server: &Server,
    db: &Database,
) -> Result<StormScenario, String> {
    let ids = Arc::new(account_ids(plan.accounts));
    insert_accounts(&ctx.mongo, db.name(), &ids, plan.opening_balance)
        .await
        .map_err(|e| format!("inserting the accounts: {e}"))?;
    let (money_before, accounts_before, _) = money(db)
        .await
        .map_err(|e| format!("reading the balances: {e}"))?;

    let host = server.base.trim_start_matches("http://");
    let target = Target {
        address: host
            .parse()
            .map_err(|e| format!("the service's address {host}: {e}"))?,
        host: host.into(),
    };
    // Every client starts at once, after they are all spawned.
    let start = Instant::now() + Duration::from_millis(200);
    let stop = start + Duration::from_secs_f64(plan.burst_s);
    let clients: Vec<_> = (0..shape.connections)
        .map(|_| {
            tokio::spawn(client(
                target.clone(),
                Arc::clone(&ids),
                plan.amount,
                shape.respond_async,
                shape.retry,
                start,
                stop,
            ))
        })
        .collect();
    tokio::time::sleep_until(start.into()).await;
    let (server_cpu_0, client_cpu_0) = (
        sample(server.pid()).map(|s| s.cpu_seconds),
        sample(std::process::id()).map(|s| s.cpu_seconds),
    );
    tokio::time::sleep_until(stop.into()).await;
    let (server_cpu_1, client_cpu_1) = (
        sample(server.pid()).map(|s| s.cpu_seconds),
        sample(std::process::id()).map(|s| s.cpu_seconds),
    );
    let per_s = |a: Option<f64>, b: Option<f64>| Some((b? - a?) / plan.burst_s);

    // Wait until every client stopped (its last request answered) and no transfer is
    // open.
    let give_up = stop + Duration::from_secs_f64(plan.drain_goal_s() + plan.give_up_after_goal_s);
    let mut drained = None;
    let mut last_report = Instant::now();
    loop {
        let idle = clients.iter().all(|c| c.is_finished());
        let open = open_transfers(db)
            .await
            .map_err(|e| format!("polling the transfers: {e}"))?;
        if idle && open == 0 {
            drained = Some(Instant::now());
            break;
        }
        if Instant::now() >= give_up {
            break;
        }
        if last_report.elapsed() >= Duration::from_secs(5) {
            let busy = clients.iter().filter(|c| !c.is_finished()).count();
            eprintln!(
                "[storm] {}: {:.0} s after the burst, {busy} clients waiting for an answer, {open} transfers open",
                shape.name,
                stop.elapsed().as_secs_f64(),
            );
            last_report = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut seen = Seen::default();
    let mut unfinished = 0;
    for c in clients {
        if c.is_finished() {
            seen.merge(c.await.map_err(|e| format!("a client: {e}"))?);
        } else {
            unfinished += 1;
            c.abort();
        }
    }

    // The checks.
    let mut violations = Vec::new();
    let states = transfer_states(db)
        .await
        .map_err(|e| format!("reading the transfers: {e}"))?;
    let (money_after, accounts_after, accounts_with_pending) = money(db)
        .await
        .map_err(|e| format!("reading the balances: {e}"))?;
    if money_after != money_before {
        violations.push(format!(
            "money not conserved: the balances summed to {money_before} before and {money_after} after ({:+})",
            money_after - money_before
        ));
    }
    if accounts_after != accounts_before {
        violations.push(format!(
            "{accounts_before} accounts before, {accounts_after} after"
        ));
    }
    if accounts_with_pending > 0 {
        violations.push(format!(
            "{accounts_with_pending} accounts keep pendingTransactions at the end"
        ));
    }
    if drained.is_none() {
        let open = states
            .values()
            .filter(|s| crate::overload::OPEN_STATES.contains(&s.as_str()))
            .count();
        violations.push(format!(
            "not drained {:.0} s after the burst: {open} transfers open, {unfinished} clients without an answer",
            plan.drain_goal_s() + plan.give_up_after_goal_s,
        ));
    }
    let mut recorded_by_state: BTreeMap<String, u64> = BTreeMap::new();
    for end in states.values() {
        *recorded_by_state.entry(end.clone()).or_default() += 1;
    }
    let mut accepted_end_states: BTreeMap<String, u64> = BTreeMap::new();
    let (mut missing, mut created_not_done, mut done_in_burst) = (0u64, 0u64, 0u64);
    for (at, status, id) in &seen.accepted {
        let end = states.get(id).map(String::as_str);
        *accepted_end_states
            .entry(format!("{status} {}", end.unwrap_or("missing")))
            .or_default() += 1;
        match end {
            None => missing += 1,
            Some(e) if *status == 201 && e != "done" => created_not_done += 1,
            _ => {}
        }
        let in_burst = *at >= start && *at <= stop;
        let counts = if shape.respond_async {
            *status == 202 && end == Some("done")
        } else {
            *status == 201
        };
        if in_burst && counts {
            done_in_burst += 1;
        }
    }
    if missing > 0 {
        violations.push(format!(
            "{missing} accepted transfers (201/202) are not in the database"
        ));
    }
    if created_not_done > 0 {
        violations.push(format!(
            "{created_not_done} transfers answered 201 are not done in the database"
        ));
    }
    // Refusals record nothing: every recorded transfer was accepted, answered as
    // recorded-and-canceled, or had an answer that says nothing.
    let explained = seen.accepted.len() as u64 + seen.recorded_canceled + seen.unknown;
    if states.len() as u64 > explained {
        violations.push(format!(
            "{} transfers recorded, more than the {explained} answers that may have recorded one: refused requests recorded transfers",
            states.len(),
        ));
    }
    let done_per_s = done_in_burst as f64 / plan.burst_s;
    let done_over_capacity = shape.capacity.map(|c| done_per_s / c);
    let drain_s = drained.map(|t| t.saturating_duration_since(stop).as_secs_f64());
    Ok(StormScenario {
        name: shape.name.clone(),
        respond_async: shape.respond_async,
        connections: shape.connections,
        retry: shape.retry,
        capacity: shape.is_capacity,
        database: String::new(),
        server_log: String::new(),
        burst_s: plan.burst_s,
        sent: seen.sent,
        answers: seen.answers.into_iter().collect(),
        answer_samples: seen.samples,
        overloaded_without_retry_after: seen.overloaded_without_retry_after,
        refused_in_burst: seen.refused_in_burst,
        refused_per_s: seen.refused_in_burst as f64 / plan.burst_s,
        done_in_burst,
        done_per_s,
        done_over_capacity,
        accepted: seen.accepted.len() as u64,
        accepted_end_states,
        recorded: states.len() as u64,
        recorded_by_state,
        drain_s,
        last_answer_after_s: seen
            .last_answer
            .map(|l| l.saturating_duration_since(stop).as_secs_f64()),
        server_cpu_per_s: per_s(server_cpu_0, server_cpu_1),
        client_cpu_per_s: per_s(client_cpu_0, client_cpu_1),
        peak_rss_mib: None,
        sampled_max_rss_mib: None,
        money_before,
        money_after,
        accounts_with_pending,
        goals: StormGoals {
            done_met: done_over_capacity.map(|r| r >= plan.goal_done_fraction),
            drain_met: drain_s.is_some_and(|t| t <= plan.drain_goal_s()),
            peak_rss_met: None,
        },
        violations,
        server_log_lines: 0,
        server_log_kinds: BTreeMap::new(),
        seconds: 0.0,
    })
}
