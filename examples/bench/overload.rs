//! Part 6, overload: the two-phase service offered 2 and 5 times its capacity, open loop,
//! answering synchronously or with `Prefer: respond-async`.
//!
//! Capacity is the best closed-loop throughput the run measured for two-phase over
//! uniform accounts (or, when that part did not run, a short closed loop at 128 clients).
//! Each scenario then starts a fresh service and database, seeds the accounts, and sends
//! `POST /transfers` by the clock at the offered rate for the burst, never waiting for
//! answers (at most `client_max_in_flight` requests in flight: a send that finds no slot
//! is not made and counts as `client_dropped`). After the burst it waits until every
//! request has answered and no transfer is in `initial`, `pending`, `applied` or
//! `canceling`, then checks that money is conserved, that no account keeps a
//! `pendingTransactions` marker, that every accepted transfer (201, 202) is in the
//! database and terminal, that every 201 is `done`, and that the refused requests
//! recorded nothing.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::{Client, Database};
use serde::Serialize;
use tokio::sync::Semaphore;

use crate::driver::{Measured, closed_loop};
use crate::procs::{Server, StartError, sample};
use crate::service::{
    Context, http_client, log_summary, mib, post_transfer, random_pair, transfer_body,
};

/// The states a transfer is not finished in.
pub const OPEN_STATES: [&str; 4] = ["initial", "pending", "applied", "canceling"];

#[derive(Debug, Clone, Serialize)]
pub struct OverloadPlan {
    /// Offered rates, as multiples of the capacity.
    pub multiples: Vec<f64>,
    pub burst_s: f64,
    pub accounts: usize,
    pub opening_balance: i64,
    pub amount: i64,
    /// Requests the benchmark client keeps in flight at most; beyond, a send is dropped.
    pub client_max_in_flight: usize,
    /// Given to each service (`MAX_TRANSFERS_IN_FLIGHT`, `STALE_AFTER_MS`, and
    /// `ADMISSION_WAIT_MS` when set; unset, the service's default).
    pub max_transfers_in_flight: usize,
    pub stale_after_ms: u64,
    pub admission_wait_ms: Option<u64>,
    /// The capacity measurement, when the two-phase part did not run.
    pub capacity_clients: usize,
    pub capacity_warmup_s: f64,
    pub capacity_window_s: f64,
    /// How long after the goal for "all terminal" the benchmark stops waiting.
    pub give_up_after_goal_s: f64,
    /// Goals (printed, not asserted).
    pub goal_goodput_fraction: f64,
    pub goal_peak_rss_mib: f64,
}

impl OverloadPlan {
    /// Every accepted transfer terminal within this many seconds after the burst.
    pub fn terminal_goal_s(&self) -> f64 {
        self.burst_s + 2.0 * self.stale_after_ms as f64 / 1000.0
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Capacity {
    /// Transfers per second answered 201.
    pub per_s: f64,
    pub source: String,
    /// The measurement made for this part, if it made one.
    pub measured: Option<Measured>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Goals {
    pub goodput_met: bool,
    pub terminal_met: bool,
    pub peak_rss_met: Option<bool>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Scenario {
    /// `2x sync`, `5x respond-async`, ...
    pub name: String,
    pub multiple: f64,
    pub respond_async: bool,
    pub database: String,
    pub server_log: String,
    pub offered_per_s: f64,
    /// Sends due in the burst: `sent + client_dropped`.
    pub scheduled: u64,
    pub sent: u64,
    pub client_dropped: u64,
    /// From the first send to the last one (at least the planned burst).
    pub burst_s: f64,
    /// How late the sender fired after a send's scheduled time, at worst.
    pub sender_max_lag_ms: f64,
    /// Every answer, by status and problem `code` (`201`, `503 overloaded`, ...), and
    /// transport failures (`transport: ...`).
    pub answers: BTreeMap<String, u64>,
    /// The first body of each kind of answer other than 201 and 202.
    pub answer_samples: BTreeMap<String, String>,
    /// `503 overloaded` answers without a `Retry-After` header.
    pub overloaded_without_retry_after: u64,
    /// Transfers that ended `done`, counted as the brief says: 201 answers received
    /// during the burst (sync), or 202 answers received during the burst whose transfer
    /// ended `done` (respond-async).
    pub done_in_burst: u64,
    pub goodput_per_s: f64,
    pub goodput_over_capacity: f64,
    /// 201 and 202 answers, and how their transfers ended in the database.
    pub accepted: u64,
    pub accepted_end_states: BTreeMap<String, u64>,
    /// Transfers in the database at the end, by state (and reason, when canceled).
    pub recorded: u64,
    pub recorded_by_state: BTreeMap<String, u64>,
    /// From the burst's end until every request answered and no transfer was open.
    /// None: still not, when the benchmark gave up.
    pub all_terminal_after_s: Option<f64>,
    /// From the burst's end to the last answer.
    pub last_answer_after_s: Option<f64>,
    /// VmHWM of the service at the end (the process lived for this scenario only), and
    /// the largest VmRSS sampled every 100 ms.
    pub peak_rss_mib: Option<f64>,
    pub sampled_max_rss_mib: Option<f64>,
    pub money_before: i64,
    pub money_after: i64,
    pub accounts_with_pending: u64,
    pub goals: Goals,
    pub violations: Vec<String>,
    pub server_log_lines: usize,
    pub server_log_kinds: BTreeMap<String, u64>,
    pub seconds: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct OverloadResult {
    pub plan: OverloadPlan,
    pub capacity: Option<Capacity>,
    pub error: Option<String>,
    pub scenarios: Vec<Scenario>,
}

impl OverloadResult {
    /// Every violation of every scenario, each prefixed by its scenario.
    pub fn violations(&self) -> Vec<String> {
        self.scenarios
            .iter()
            .flat_map(|s| s.violations.iter().map(move |v| format!("{}: {v}", s.name)))
            .collect()
    }
}

/// Runs part 6. `measured_capacity` is the two-phase part's best uniform point, if any.
pub async fn run(
    ctx: &Context,
    plan: &OverloadPlan,
    measured_capacity: Option<(f64, String)>,
) -> OverloadResult {
    let mut result = OverloadResult {
        plan: plan.clone(),
        capacity: None,
        error: None,
        scenarios: Vec::new(),
    };
    let capacity = match measured_capacity {
        Some((per_s, source)) => Capacity {
            per_s,
            source,
            measured: None,
        },
        None => match measure_capacity(ctx, plan).await {
            Ok(c) => c,
            Err(e) => {
                eprintln!("[overload] capacity measurement failed: {e}");
                result.error = Some(format!("capacity measurement failed: {e}"));
                return result;
            }
        },
    };
    eprintln!(
        "[overload] capacity {:.0} transfers/s ({})",
        capacity.per_s, capacity.source
    );
    if !(capacity.per_s.is_finite() && capacity.per_s >= 1.0) {
        result.error = Some(format!("no usable capacity: {:.1}/s", capacity.per_s));
        result.capacity = Some(capacity);
        return result;
    }
    for &multiple in &plan.multiples {
        for respond_async in [false, true] {
            match scenario(ctx, plan, capacity.per_s, multiple, respond_async).await {
                Ok(s) => result.scenarios.push(s),
                Err(e) => {
                    let name = scenario_name(multiple, respond_async);
                    eprintln!("[overload] {name} failed: {e}");
                    result
                        .error
                        .get_or_insert_with(|| format!("{name} failed: {e}"));
                }
            }
        }
    }
    result.capacity = Some(capacity);
    result
}

fn scenario_name(multiple: f64, respond_async: bool) -> String {
    format!(
        "{multiple}x {}",
        if respond_async {
            "respond-async"
        } else {
            "sync"
        }
    )
}

pub fn account_ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("o-{i:05}")).collect()
}

/// What each service of this part is started with: `MAX_TRANSFERS_IN_FLIGHT`,
/// `STALE_AFTER_MS`, and `ADMISSION_WAIT_MS` when the benchmark was given one.
pub fn server_env(
    max_transfers_in_flight: usize,
    stale_after_ms: u64,
    admission_wait_ms: Option<u64>,
) -> Vec<(&'static str, String)> {
    let mut env = vec![
        (
            "MAX_TRANSFERS_IN_FLIGHT",
            max_transfers_in_flight.to_string(),
        ),
        ("STALE_AFTER_MS", stale_after_ms.to_string()),
    ];
    if let Some(wait) = admission_wait_ms {
        env.push(("ADMISSION_WAIT_MS", wait.to_string()));
    }
    env
}

async fn start_server(
    ctx: &Context,
    plan: &OverloadPlan,
    database: &str,
    log: &Path,
) -> Result<Server, String> {
    let env = server_env(
        plan.max_transfers_in_flight,
        plan.stale_after_ms,
        plan.admission_wait_ms,
    );
    start_two_phase(ctx, database, log, &env).await
}

/// A fresh two-phase service on `database`, logging to `log`.
pub async fn start_two_phase(
    ctx: &Context,
    database: &str,
    log: &Path,
    env: &[(&'static str, String)],
) -> Result<Server, String> {
    match Server::start(
        &ctx.server_binary,
        &ctx.uri,
        database,
        "two-phase",
        log,
        env,
    )
    .await
    {
        Ok(s) => Ok(s),
        Err(StartError::Rejected(said) | StartError::Failed(said)) => {
            Err(format!("the service did not start: {said}"))
        }
    }
}

/// Inserts the accounts straight into the service's `accounts` collection (after its
/// migrations ran), as the service itself stores them.
pub async fn insert_accounts(
    mongo: &Client,
    database: &str,
    ids: &[String],
    balance: i64,
) -> mongodb::error::Result<()> {
    let now = DateTime::now();
    let docs = ids
        .iter()
        .map(|id| crate::service::account_document(id, balance, now));
    mongo
        .database(database)
        .collection::<Document>("accounts")
        .insert_many(docs)
        .ordered(false)
        .await?;
    Ok(())
}

async fn measure_capacity(ctx: &Context, plan: &OverloadPlan) -> Result<Capacity, String> {
    let database = format!("{}_overload_capacity", ctx.db_prefix);
    let log = ctx.out.join("server-overload-capacity.log");
    eprintln!(
        "[overload] measuring capacity: closed loop, {} clients, {} uniform accounts",
        plan.capacity_clients, plan.accounts
    );
    let server = start_server(ctx, plan, &database, &log).await?;
    let ids = Arc::new(account_ids(plan.accounts));
    let outcome = match insert_accounts(&ctx.mongo, &database, &ids, plan.opening_balance).await {
        Err(e) => Err(format!("inserting the accounts: {e}")),
        Ok(()) => {
            let (http, url) = (
                http_client(),
                Arc::<str>::from(format!("{}/transfers", server.base)),
            );
            let amount = plan.amount;
            let measured = closed_loop(
                plan.capacity_clients,
                Duration::from_secs_f64(plan.capacity_warmup_s),
                Duration::from_secs_f64(plan.capacity_window_s),
                move |_, _| {
                    let (a, b) = random_pair(&ids);
                    post_transfer(http.clone(), Arc::clone(&url), transfer_body(a, b, amount))
                },
            )
            .await;
            eprintln!(
                "[overload] capacity run: {:.1} transfers/s, failed: {}",
                measured.units_per_s,
                measured.failures.brief()
            );
            Ok(Capacity {
                per_s: measured.units_per_s,
                source: format!(
                    "closed loop of this part: {} clients, {} uniform accounts, {} s measured",
                    plan.capacity_clients, plan.accounts, plan.capacity_window_s
                ),
                measured: Some(measured),
            })
        }
    };
    server.stop().await;
    let _ = ctx.mongo.database(&database).drop().await;
    outcome
}

/// What one request came to, as the collector keeps it.
enum Recorded {
    /// 201 or 202: the transfer with this id was accepted.
    Accepted(String),
    /// Recorded and canceled (a 422 carrying `transferId`).
    Canceled,
    /// Nothing recorded (`503 overloaded`, a 4xx refusal).
    Nothing,
    /// Unknown: a transport failure or another 5xx; it may have been recorded.
    Unknown,
}

struct Answer {
    at: Instant,
    status: u16,
    kind: String,
    recorded: Recorded,
    retry_after: bool,
    body: String,
}

fn transport_kind(e: &reqwest::Error) -> &'static str {
    if e.is_timeout() {
        "transport: timeout"
    } else if e.is_connect() {
        "transport: connect"
    } else if e.is_request() {
        "transport: request"
    } else {
        "transport: other"
    }
}

async fn send(http: reqwest::Client, url: Arc<str>, body: Vec<u8>, respond_async: bool) -> Answer {
    let mut request = http
        .post(&*url)
        .header(reqwest::header::CONTENT_TYPE, "application/json");
    if respond_async {
        request = request.header("prefer", "respond-async");
    }
    let failed = |e: reqwest::Error| Answer {
        at: Instant::now(),
        status: 0,
        kind: transport_kind(&e).to_owned(),
        recorded: Recorded::Unknown,
        retry_after: false,
        body: format!("{e:?}"),
    };
    let response = match request.body(body).send().await {
        Ok(r) => r,
        Err(e) => return failed(e),
    };
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .contains_key(reqwest::header::RETRY_AFTER);
    let text = match response.text().await {
        Ok(t) => t,
        Err(e) => return failed(e),
    };
    let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let field = |name: &str| json[name].as_str().map(str::to_owned);
    let (kind, recorded) = match status {
        201 | 202 => match field("id") {
            Some(id) => (status.to_string(), Recorded::Accepted(id)),
            None => (format!("{status} without id"), Recorded::Unknown),
        },
        _ => {
            let code = field("code").unwrap_or_default();
            let recorded = if field("transferId").is_some() {
                Recorded::Canceled
            } else if (400..500).contains(&status) || code == "overloaded" {
                Recorded::Nothing
            } else {
                Recorded::Unknown
            };
            (format!("{status} {code}"), recorded)
        }
    };
    Answer {
        at: Instant::now(),
        status,
        kind,
        recorded,
        retry_after,
        body: if status == 201 || status == 202 {
            String::new()
        } else {
            text.chars().take(600).collect()
        },
    }
}

/// The tallies of the answers, kept as they arrive.
#[derive(Default)]
struct Tally {
    answers: BTreeMap<String, u64>,
    samples: BTreeMap<String, String>,
    overloaded_without_retry_after: u64,
    /// (answer time, status, id) of every 201 and 202.
    accepted: Vec<(Instant, u16, String)>,
    recorded_canceled: u64,
    unknown: u64,
    last_answer: Option<Instant>,
}

impl Tally {
    fn add(&mut self, a: Answer) {
        *self.answers.entry(a.kind.clone()).or_default() += 1;
        if a.kind == "503 overloaded" && !a.retry_after {
            self.overloaded_without_retry_after += 1;
        }
        if !a.body.is_empty() && !self.samples.contains_key(&a.kind) {
            self.samples.insert(a.kind.clone(), a.body);
        }
        match a.recorded {
            Recorded::Accepted(id) => self.accepted.push((a.at, a.status, id)),
            Recorded::Canceled => self.recorded_canceled += 1,
            Recorded::Nothing => {}
            Recorded::Unknown => self.unknown += 1,
        }
        self.last_answer = Some(self.last_answer.map_or(a.at, |l| l.max(a.at)));
    }
}

/// Balances summed and markers counted over every account: (money, accounts,
/// accounts with a `pendingTransactions` marker).
pub async fn money(db: &Database) -> mongodb::error::Result<(i64, u64, u64)> {
    let mut cursor = db
        .collection::<Document>("accounts")
        .find(doc! {})
        .projection(doc! { "balance": 1, "pendingTransactions": 1 })
        .await?;
    let (mut total, mut accounts, mut pending) = (0i64, 0u64, 0u64);
    while let Some(account) = cursor.try_next().await? {
        accounts += 1;
        total += match account.get("balance") {
            Some(Bson::Int64(v)) => *v,
            Some(Bson::Int32(v)) => i64::from(*v),
            Some(Bson::Double(v)) => *v as i64,
            _ => 0,
        };
        if account
            .get_array("pendingTransactions")
            .is_ok_and(|a| !a.is_empty())
        {
            pending += 1;
        }
    }
    Ok((total, accounts, pending))
}

/// Transfers not finished yet.
pub async fn open_transfers(db: &Database) -> mongodb::error::Result<u64> {
    let mut cursor = db
        .collection::<Document>("transactions")
        .find(doc! { "state": { "$in": OPEN_STATES.to_vec() } })
        .projection(doc! { "_id": 1 })
        .await?;
    let mut n = 0;
    while cursor.try_next().await?.is_some() {
        n += 1;
    }
    Ok(n)
}

/// Every transfer's id (hex) and end: `done`, `canceled (reason)`, or its open state.
pub async fn transfer_states(db: &Database) -> mongodb::error::Result<HashMap<String, String>> {
    let mut cursor = db
        .collection::<Document>("transactions")
        .find(doc! {})
        .projection(doc! { "state": 1, "reason": 1 })
        .await?;
    let mut out = HashMap::new();
    while let Some(t) = cursor.try_next().await? {
        let id = match t.get("_id") {
            Some(Bson::ObjectId(o)) => o.to_hex(),
            Some(other) => other.to_string(),
            None => continue,
        };
        let state = t.get_str("state").unwrap_or("?");
        let end = match t.get_str("reason") {
            Ok(reason) if state == "canceled" => format!("canceled ({reason})"),
            _ => state.to_owned(),
        };
        out.insert(id, end);
    }
    Ok(out)
}

async fn scenario(
    ctx: &Context,
    plan: &OverloadPlan,
    capacity: f64,
    multiple: f64,
    respond_async: bool,
) -> Result<Scenario, String> {
    let clock = Instant::now();
    let name = scenario_name(multiple, respond_async);
    let slug = name.replace(' ', "-").replace('.', "_");
    let database = format!("{}_overload_{}", ctx.db_prefix, slug.replace('-', "_"));
    let log = ctx.out.join(format!("server-overload-{slug}.log"));
    let rate = capacity * multiple;
    eprintln!(
        "[overload] {name}: {rate:.0} transfers/s offered for {} s",
        plan.burst_s
    );
    let server = start_server(ctx, plan, &database, &log).await?;
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

    let outcome = burst_and_check(
        ctx,
        plan,
        &server,
        &db,
        &name,
        capacity,
        multiple,
        respond_async,
    )
    .await;
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
        "[overload] {name}: goodput {:.1}/s = {:.2} of capacity (goal ≥ {:.2}: {}); all terminal {} after the burst (goal ≤ {} s: {}); peak RSS {} MiB (goal < {}: {}); answers: {}; client_dropped {}",
        s.goodput_per_s,
        s.goodput_over_capacity,
        plan.goal_goodput_fraction,
        met(s.goals.goodput_met),
        s.all_terminal_after_s
            .map_or("never (gave up)".into(), |t| format!("{t:.1} s")),
        plan.terminal_goal_s(),
        met(s.goals.terminal_met),
        peak.map_or("?".into(), |p| format!("{p:.1}")),
        plan.goal_peak_rss_mib,
        s.goals.peak_rss_met.map_or("?", met),
        answers_brief(&s.answers),
        s.client_dropped,
    );
    for v in &s.violations {
        eprintln!("[overload] {name}: VIOLATION: {v}");
    }
    Ok(s)
}

pub fn answers_brief(answers: &BTreeMap<String, u64>) -> String {
    if answers.is_empty() {
        return "none".into();
    }
    answers
        .iter()
        .map(|(k, n)| format!("{k}: {}", crate::report::num(*n as f64)))
        .collect::<Vec<_>>()
        .join(", ")
}

#[allow(clippy::too_many_arguments)]
async fn burst_and_check(
    ctx: &Context,
    plan: &OverloadPlan,
    server: &Server,
    db: &Database,
    name: &str,
    capacity: f64,
    multiple: f64,
    respond_async: bool,
) -> Result<Scenario, String> {
    let ids = Arc::new(account_ids(plan.accounts));
    insert_accounts(&ctx.mongo, db.name(), &ids, plan.opening_balance)
        .await
        .map_err(|e| format!("inserting the accounts: {e}"))?;
    let (money_before, accounts_before, _) = money(db)
        .await
        .map_err(|e| format!("reading the balances: {e}"))?;

    // The burst.
    let rate = capacity * multiple;
    let http = http_client();
    let url: Arc<str> = format!("{}/transfers", server.base).into();
    let slots = Arc::new(Semaphore::new(plan.client_max_in_flight));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Answer>();
    let collector = tokio::spawn(async move {
        let mut tally = Tally::default();
        while let Some(a) = rx.recv().await {
            tally.add(a);
        }
        tally
    });
    let scheduled = (rate * plan.burst_s).round().max(1.0) as u64;
    let mut tasks = tokio::task::JoinSet::new();
    let (mut sent, mut dropped) = (0u64, 0u64);
    let mut max_lag = Duration::ZERO;
    let t0 = Instant::now() + Duration::from_millis(20);
    for i in 0..scheduled {
        let due = t0 + Duration::from_secs_f64(i as f64 / rate);
        if due > Instant::now() {
            tokio::time::sleep_until(due.into()).await;
        }
        max_lag = max_lag.max(Instant::now().saturating_duration_since(due));
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            dropped += 1;
            continue;
        };
        sent += 1;
        let (a, b) = random_pair(&ids);
        let body = transfer_body(a, b, plan.amount);
        let (http, url, tx) = (http.clone(), Arc::clone(&url), tx.clone());
        tasks.spawn(async move {
            let answer = send(http, url, body, respond_async).await;
            let _ = tx.send(answer);
            // The slot goes after the answer is handed over: no slot taken means every
            // answer is in the channel.
            drop(slot);
        });
        // Reap finished tasks now and then, so the set does not grow with the burst.
        while tasks.try_join_next().is_some() {}
    }
    drop(tx);
    let burst_end = Instant::now().max(t0 + Duration::from_secs_f64(plan.burst_s));
    let burst_s = (burst_end - t0).as_secs_f64();

    // Wait until every request answered and no transfer is open.
    let goal = plan.terminal_goal_s();
    let give_up = burst_end + Duration::from_secs_f64(goal + plan.give_up_after_goal_s);
    let mut all_terminal = None;
    let mut last_report = Instant::now();
    loop {
        let idle = slots.available_permits() == plan.client_max_in_flight;
        let open = open_transfers(db)
            .await
            .map_err(|e| format!("polling the transfers: {e}"))?;
        if idle && open == 0 {
            all_terminal = Some(Instant::now());
            break;
        }
        if Instant::now() >= give_up {
            break;
        }
        if last_report.elapsed() >= Duration::from_secs(5) {
            eprintln!(
                "[overload] {name}: {:.0} s after the burst, {} requests in flight, {open} transfers open",
                burst_end.elapsed().as_secs_f64(),
                plan.client_max_in_flight - slots.available_permits()
            );
            last_report = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    let tally = collector.await.map_err(|e| format!("collector: {e}"))?;

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
    let mut recorded_by_state: BTreeMap<String, u64> = BTreeMap::new();
    for end in states.values() {
        *recorded_by_state.entry(end.clone()).or_default() += 1;
    }
    let still_open: u64 = states
        .values()
        .filter(|s| OPEN_STATES.contains(&s.as_str()))
        .count() as u64;
    if all_terminal.is_none() {
        violations.push(format!(
            "not every transfer was terminal {:.0} s after the burst: {still_open} open, {} requests unanswered",
            goal + plan.give_up_after_goal_s,
            plan.client_max_in_flight - slots.available_permits()
        ));
    }
    let mut accepted_end_states: BTreeMap<String, u64> = BTreeMap::new();
    let (mut missing, mut created_not_done, mut done_in_burst) = (0u64, 0u64, 0u64);
    for (at, status, id) in &tally.accepted {
        let end = states.get(id).map(String::as_str);
        *accepted_end_states
            .entry(format!("{status} {}", end.unwrap_or("missing")))
            .or_default() += 1;
        match end {
            None => missing += 1,
            Some(e) if *status == 201 && e != "done" => created_not_done += 1,
            _ => {}
        }
        let in_burst = *at >= t0 && *at <= burst_end;
        let counts = if respond_async {
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
    // Refused requests record nothing: every recorded transfer is one that was
    // accepted, one answered as recorded-and-canceled, or one whose answer says nothing.
    let explained = tally.accepted.len() as u64 + tally.recorded_canceled + tally.unknown;
    if states.len() as u64 > explained {
        violations.push(format!(
            "{} transfers recorded, more than the {} answers that may have recorded one: refused requests recorded transfers",
            states.len(),
            explained
        ));
    }
    let goodput_per_s = done_in_burst as f64 / burst_s;
    let all_terminal_after_s =
        all_terminal.map(|t| t.saturating_duration_since(burst_end).as_secs_f64());
    Ok(Scenario {
        name: name.to_owned(),
        multiple,
        respond_async,
        database: String::new(),
        server_log: String::new(),
        offered_per_s: rate,
        scheduled,
        sent,
        client_dropped: dropped,
        burst_s,
        sender_max_lag_ms: max_lag.as_secs_f64() * 1000.0,
        answers: tally.answers,
        answer_samples: tally.samples,
        overloaded_without_retry_after: tally.overloaded_without_retry_after,
        done_in_burst,
        goodput_per_s,
        goodput_over_capacity: goodput_per_s / capacity,
        accepted: tally.accepted.len() as u64,
        accepted_end_states,
        recorded: states.len() as u64,
        recorded_by_state,
        all_terminal_after_s,
        last_answer_after_s: tally
            .last_answer
            .map(|l| l.saturating_duration_since(burst_end).as_secs_f64()),
        peak_rss_mib: None,
        sampled_max_rss_mib: None,
        money_before,
        money_after,
        accounts_with_pending,
        goals: Goals {
            goodput_met: goodput_per_s >= plan.goal_goodput_fraction * capacity,
            terminal_met: all_terminal_after_s.is_some_and(|t| t <= goal),
            peak_rss_met: None,
        },
        violations,
        server_log_lines: 0,
        server_log_kinds: BTreeMap::new(),
        seconds: 0.0,
    })
}
