//! Parts 2 to 5: the service as a separate release process, loaded through its HTTP API
//! (closed loop over uniform and hot accounts, then the seed scenario open loop), and
//! what it cost in CPU and memory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use mongodb::Client;
use mongodb::bson::{DateTime, Document, doc};
use rand::Rng;
use serde::Serialize;

use crate::driver::{Measured, OpenMeasured, Outcome, closed_loop, open_loop};
use crate::procs::{ProcSample, Server, StartError, reset_peak_rss, sample};
use crate::work::{Work, snapshot};

/// Everything a strategy run needs from the benchmark.
pub struct Context {
    pub server_binary: PathBuf,
    pub uri: String,
    pub db_prefix: String,
    pub out: PathBuf,
    /// The database daemon, when the benchmark started it (its CPU is measured too).
    pub daemon_pid: Option<u32>,
    pub mongo: Client,
    pub http: reqwest::Client,
}

impl Context {
    /// Starts a two-phase service on `database`, logging to `log`, with `env` added to
    /// its environment; `Err` says why it did not start.
    pub async fn start_service(
        &self,
        database: &str,
        log: &Path,
        env: &[(&str, String)],
    ) -> Result<Server, String> {
        Server::start(
            &self.server_binary,
            &self.uri,
            database,
            "two-phase",
            log,
            env,
        )
        .await
        .map_err(|(StartError::Rejected(said) | StartError::Failed(said))| {
            format!("the service did not start: {said}")
        })
    }
}

pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(2048)
        .pool_idle_timeout(Duration::from_secs(300))
        .tcp_nodelay(true)
        .timeout(Duration::from_secs(300))
        .build()
        .expect("http client")
}

#[derive(Debug, Clone, Serialize)]
pub struct ClosedPlan {
    pub concurrencies: Vec<usize>,
    pub warmup_s: f64,
    pub window_s: f64,
    pub uniform_accounts: usize,
    pub opening_balance: i64,
    pub amount: i64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SeedPlan {
    pub total_accounts: usize,
    pub active_accounts: usize,
    pub rate_per_s: f64,
    pub arrivals_s: f64,
    pub amount: i64,
    pub opening_balance: i64,
    pub max_in_flight: usize,
    pub give_up_after_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Point {
    /// `uniform` or `hot`.
    pub workload: &'static str,
    pub measured: Measured,
    /// What the database did for the load, per transfer (its own counters).
    pub work: Work,
}

/// Part 5 for the closed-loop run of one server process.
#[derive(Debug, Clone, Serialize)]
pub struct Cost {
    /// Transfer requests sent (warm-ups included).
    pub transfers: u64,
    /// CPU of the server process from its start (migrations, account creation) to the
    /// end of the closed-loop load.
    pub server_cpu_s: f64,
    pub server_cpu_s_per_1k_transfers: f64,
    /// The same, counting only the transfer load.
    pub server_cpu_s_load_only: f64,
    pub server_cpu_s_per_1k_transfers_load_only: f64,
    /// VmHWM of the server process at the end of the closed-loop load.
    pub server_peak_rss_mib: f64,
    /// CPU of the database daemon over the transfer load (when the benchmark runs it).
    pub database_cpu_s: Option<f64>,
    pub database_cpu_s_per_1k_transfers: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SeedResult {
    pub plan: SeedPlan,
    pub insert_accounts_s: f64,
    pub measured: OpenMeasured,
    pub server_cpu_s: Option<f64>,
    pub server_cpu_s_per_1k_transfers: Option<f64>,
    /// Peak RSS during the seed scenario alone when the kernel let us reset VmHWM,
    /// otherwise the process's peak so far.
    pub server_peak_rss_mib: Option<f64>,
    pub server_peak_rss_reset: bool,
    pub database_cpu_s: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StrategyResult {
    pub strategy: String,
    pub available: bool,
    pub unavailable_reason: Option<String>,
    pub database: String,
    pub server_log: String,
    pub points: Vec<Point>,
    pub cost: Option<Cost>,
    pub seed: Option<SeedResult>,
    /// Lines the server logged at warn or error (its log is next to the results), and
    /// how many of each kind (transfer ids replaced by `<id>`).
    pub server_log_lines: usize,
    pub server_log_kinds: BTreeMap<String, u64>,
    pub part_seconds: BTreeMap<String, f64>,
}

pub fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn transport_failure(e: &reqwest::Error) -> Outcome {
    let kind = if e.is_timeout() {
        "transport: timeout"
    } else if e.is_connect() {
        "transport: connect"
    } else if e.is_request() {
        "transport: request"
    } else {
        "transport: other"
    };
    Outcome::Failed {
        kind: kind.into(),
        detail: format!("{e:?}"),
    }
}

/// POST /transfers; a success is 201 with state `done`.
pub async fn post_transfer(http: reqwest::Client, url: Arc<str>, body: Vec<u8>) -> Outcome {
    let response = match http
        .post(&*url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => return transport_failure(&e),
    };
    let status = response.status().as_u16();
    let text = match response.text().await {
        Ok(t) => t,
        Err(e) => return transport_failure(&e),
    };
    let json: Option<serde_json::Value> = serde_json::from_str(&text).ok();
    let field = |name: &str| {
        json.as_ref()
            .and_then(|j| j[name].as_str())
            .unwrap_or("")
            .to_owned()
    };
    if status == 201 && field("state") == "done" {
        return Outcome::Ok { units: 1 };
    }
    let what = if status == 201 {
        format!("state {}", field("state"))
    } else {
        field("code")
    };
    Outcome::Failed {
        kind: format!("{status} {what}"),
        detail: text,
    }
}

pub fn transfer_body(source: &str, destination: &str, amount: i64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "source": source,
        "destination": destination,
        "amount": amount,
    }))
    .expect("json")
}

/// Two distinct accounts of `ids`, chosen uniformly.
pub fn random_pair(ids: &[String]) -> (&str, &str) {
    let mut rng = rand::rng();
    let a = rng.random_range(0..ids.len());
    let mut b = rng.random_range(0..ids.len() - 1);
    if b >= a {
        b += 1;
    }
    (&ids[a], &ids[b])
}

/// Opens `ids` through POST /accounts, 16 at a time.
pub async fn open_accounts(
    http: &reqwest::Client,
    base: &str,
    ids: &[String],
    balance: i64,
) -> Result<(), String> {
    open_accounts_on(http, base, ids, balance, None).await
}

/// [`open_accounts`] on `deployment` (the service's default when `None`).
pub async fn open_accounts_on(
    http: &reqwest::Client,
    base: &str,
    ids: &[String],
    balance: i64,
    deployment: Option<&str>,
) -> Result<(), String> {
    let url = format!("{base}/accounts");
    let results: Vec<Result<(), String>> = futures::stream::iter(ids.iter().cloned())
        .map(|id| {
            let (http, url) = (http.clone(), url.clone());
            async move {
                let mut body =
                    serde_json::json!({ "id": id, "balance": balance, "currency": "USD" });
                if let Some(deployment) = deployment {
                    body["deployment"] = deployment.into();
                }
                let r = http
                    .post(&url)
                    .json(&body)
                    .send()
                    .await
                    .map_err(|e| format!("opening {id}: {e}"))?;
                let status = r.status();
                let body = r.text().await.unwrap_or_default();
                if status == 201 {
                    Ok(())
                } else {
                    Err(format!("opening {id}: {status} {body}"))
                }
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    results.into_iter().collect()
}

/// Inserts the seed scenario's accounts straight into the service's `accounts`
/// collection (after its migrations ran), as the service itself stores them.
async fn insert_seed_accounts(
    mongo: &Client,
    database: &str,
    plan: &SeedPlan,
) -> mongodb::error::Result<()> {
    let accounts = mongo.database(database).collection::<Document>("accounts");
    let now = DateTime::now();
    let ids: Vec<usize> = (0..plan.total_accounts).collect();
    for chunk in ids.chunks(10_000) {
        let docs = chunk
            .iter()
            .map(|i| account_document(&seed_id(*i), plan.opening_balance, now));
        accounts.insert_many(docs).ordered(false).await?;
    }
    Ok(())
}

/// An account as the service stores it (docs/protocol.md's schema: `balance` an Int64, no
/// pending transfers), for inserting many at once.
pub fn account_document(id: &str, balance: i64, now: DateTime) -> Document {
    // Opened as the service opens one: its ledger's first entry, `opened`
    // (docs/ledger.md; the stored entry's short keys).
    doc! {
        "_id": id,
        "balance": balance,
        "currency": "USD",
        "pendingTransactions": [],
        "seq": 1_i64,
        "lastEntryAt": now,
        "recentEntries": [{
            "seq": 1_i64, "k": "opened", "db": balance, "dpd": 0_i64, "dpc": 0_i64,
            "b": balance, "pd": 0_i64, "pc": 0_i64, "at": now,
        }],
        "createdAt": now,
        "updatedAt": now,
    }
}

fn seed_id(i: usize) -> String {
    format!("sim-{i:06}")
}

/// Replaces every 24-hex word (an ObjectId) with `<id>`, so log lines group by kind.
fn without_ids(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if word.len() == 24 && word.chars().all(|c| c.is_ascii_hexdigit()) {
            out.push_str("<id>");
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for ch in text.chars() {
        if ch.is_ascii_alphanumeric() {
            word.push(ch);
        } else {
            flush(&mut word, &mut out);
            out.push(ch);
        }
    }
    flush(&mut word, &mut out);
    out
}

/// The server's log lines (JSON, warn and above) counted by level, message and cause.
pub fn log_summary(path: &Path) -> (usize, BTreeMap<String, u64>) {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut kinds = BTreeMap::new();
    let mut lines = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        lines += 1;
        let key = match serde_json::from_str::<serde_json::Value>(line) {
            Ok(v) => {
                let field = |k: &str| v[k].as_str().unwrap_or("").to_owned();
                let mut key = format!("{} {}", field("level"), field("message"));
                for extra in ["cause", "error", "classification"] {
                    if let Some(x) = v[extra].as_str() {
                        key.push_str(&format!(" ({extra}: {x})"));
                    }
                }
                key
            }
            Err(_) => line.to_owned(),
        };
        *kinds
            .entry(without_ids(&key).chars().take(300).collect())
            .or_insert(0) += 1;
    }
    (lines, kinds)
}

/// Parts 2/3 (closed loop, when `closed` is set), 5 (cost) and 4 (seed, when `seed` is
/// set) for one strategy, on one server process and one fresh database.
pub async fn run_strategy(
    ctx: &Context,
    strategy: &str,
    closed: Option<&ClosedPlan>,
    seed: Option<&SeedPlan>,
) -> StrategyResult {
    let database = format!("{}_{}", ctx.db_prefix, strategy.replace('-', "_"));
    let log = ctx.out.join(format!("server-{strategy}.log"));
    let mut result = StrategyResult {
        strategy: strategy.to_owned(),
        available: false,
        unavailable_reason: None,
        database: database.clone(),
        server_log: log.display().to_string(),
        points: Vec::new(),
        cost: None,
        seed: None,
        server_log_lines: 0,
        server_log_kinds: BTreeMap::new(),
        part_seconds: BTreeMap::new(),
    };
    eprintln!("[{strategy}] starting the service (database {database})");
    let server =
        match Server::start(&ctx.server_binary, &ctx.uri, &database, strategy, &log, &[]).await {
            Ok(server) => server,
            Err(StartError::Rejected(said)) => {
                eprintln!("[{strategy}] not available: the service refused it: {said}");
                result.unavailable_reason = Some(format!("the service exited with code 2: {said}"));
                return result;
            }
            Err(StartError::Failed(said)) => {
                eprintln!("[{strategy}] the service did not start: {said}");
                result.unavailable_reason = Some(format!("the service did not start: {said}"));
                return result;
            }
        };
    result.available = true;
    let pid = server.pid();
    let url: Arc<str> = format!("{}/transfers", server.base).into();

    if let Some(plan) = closed {
        let started = Instant::now();
        let uniform: Arc<Vec<String>> = Arc::new(
            (0..plan.uniform_accounts)
                .map(|i| format!("u-{i:05}"))
                .collect(),
        );
        let hot: Arc<Vec<String>> = Arc::new(vec!["hot-a".into(), "hot-b".into()]);
        let mut all = uniform.to_vec();
        all.extend(hot.iter().cloned());
        if let Err(e) = open_accounts(&ctx.http, &server.base, &all, plan.opening_balance).await {
            result.unavailable_reason = Some(format!("could not open the accounts: {e}"));
            eprintln!("[{strategy}] could not open the accounts: {e}");
        } else {
            let before = sample(pid);
            let db_before = ctx.daemon_pid.and_then(sample);
            let mut transfers = 0;
            for (workload, ids) in [("uniform", &uniform), ("hot", &hot)] {
                for &c in &plan.concurrencies {
                    let (http, url, ids) = (ctx.http.clone(), Arc::clone(&url), Arc::clone(ids));
                    let amount = plan.amount;
                    let (base, daemon) = (&server.base, ctx.daemon_pid);
                    let counted =
                        snapshot(&ctx.mongo, &database, &ctx.http, base, pid, daemon).await;
                    let measured = closed_loop(
                        c,
                        Duration::from_secs_f64(plan.warmup_s),
                        Duration::from_secs_f64(plan.window_s),
                        move |worker, seq| {
                            let body = if workload == "hot" {
                                // Each worker alternates directions, so neither runs dry.
                                let (a, b) = (&ids[0], &ids[1]);
                                if (worker as u64 + seq) % 2 == 0 {
                                    transfer_body(a, b, amount)
                                } else {
                                    transfer_body(b, a, amount)
                                }
                            } else {
                                let (a, b) = random_pair(&ids);
                                transfer_body(a, b, amount)
                            };
                            post_transfer(http.clone(), Arc::clone(&url), body)
                        },
                    )
                    .await;
                    let work = snapshot(&ctx.mongo, &database, &ctx.http, base, pid, daemon)
                        .await
                        .since(&counted, measured.sent);
                    transfers += measured.sent;
                    eprintln!(
                        "[{strategy}] {workload:<7} c={c:<3} {:>8.1} transfers/s  p50 {:>7.1} p95 {:>7.1} p99 {:>7.1} ms  failed: {}",
                        measured.units_per_s,
                        measured.latency.as_ref().map_or(f64::NAN, |l| l.p50_ms),
                        measured.latency.as_ref().map_or(f64::NAN, |l| l.p95_ms),
                        measured.latency.as_ref().map_or(f64::NAN, |l| l.p99_ms),
                        measured.failures.brief(),
                    );
                    eprintln!(
                        "[{strategy}] {workload:<7} c={c:<3} per transfer: {}",
                        work.brief()
                    );
                    eprintln!(
                        "[{strategy}] {workload:<7} c={c:<3} database time per transfer: {}",
                        work.brief_time()
                    );
                    result.points.push(Point {
                        workload,
                        measured,
                        work,
                    });
                }
            }
            let after = sample(pid);
            let db_after = ctx.daemon_pid.and_then(sample);
            result.cost = cost(transfers, before, after, db_before, db_after);
        }
        result
            .part_seconds
            .insert("closed_loop".into(), started.elapsed().as_secs_f64());
    }

    if let Some(plan) = seed {
        let started = Instant::now();
        match run_seed(ctx, &database, pid, &url, plan).await {
            Ok(seed) => result.seed = Some(seed),
            Err(e) => {
                eprintln!("[{strategy}] seed scenario failed: {e}");
                result
                    .unavailable_reason
                    .get_or_insert_with(|| format!("seed scenario failed: {e}"));
            }
        }
        result
            .part_seconds
            .insert("seed".into(), started.elapsed().as_secs_f64());
    }

    server.stop().await;
    let _ = ctx.mongo.database(&database).drop().await;
    (result.server_log_lines, result.server_log_kinds) = log_summary(&log);
    result
}

fn cost(
    transfers: u64,
    before: Option<ProcSample>,
    after: Option<ProcSample>,
    db_before: Option<ProcSample>,
    db_after: Option<ProcSample>,
) -> Option<Cost> {
    let (before, after) = (before?, after?);
    let per_1k = |cpu: f64| cpu / (transfers.max(1) as f64) * 1000.0;
    let load_cpu = after.cpu_seconds - before.cpu_seconds;
    let db_cpu = match (db_before, db_after) {
        (Some(b), Some(a)) => Some(a.cpu_seconds - b.cpu_seconds),
        _ => None,
    };
    Some(Cost {
        transfers,
        server_cpu_s: after.cpu_seconds,
        server_cpu_s_per_1k_transfers: per_1k(after.cpu_seconds),
        server_cpu_s_load_only: load_cpu,
        server_cpu_s_per_1k_transfers_load_only: per_1k(load_cpu),
        server_peak_rss_mib: mib(after.peak_rss_kib),
        database_cpu_s: db_cpu,
        database_cpu_s_per_1k_transfers: db_cpu.map(per_1k),
    })
}

/// Part 4: the seed scenario of the MongoDB schema simulator.
async fn run_seed(
    ctx: &Context,
    database: &str,
    pid: u32,
    url: &Arc<str>,
    plan: &SeedPlan,
) -> Result<SeedResult, String> {
    eprintln!(
        "[seed] inserting {} accounts into {database}.accounts",
        plan.total_accounts
    );
    let inserting = Instant::now();
    insert_seed_accounts(&ctx.mongo, database, plan)
        .await
        .map_err(|e| format!("inserting the accounts: {e}"))?;
    let insert_accounts_s = inserting.elapsed().as_secs_f64();
    let active: Arc<Vec<String>> = {
        let mut rng = rand::rng();
        Arc::new(
            rand::seq::index::sample(&mut rng, plan.total_accounts, plan.active_accounts)
                .into_iter()
                .map(seed_id)
                .collect(),
        )
    };
    let count = (plan.rate_per_s * plan.arrivals_s).round() as usize;
    eprintln!(
        "[seed] {count} transfers among {} accounts at {} a second",
        plan.active_accounts, plan.rate_per_s
    );
    let reset = reset_peak_rss(pid);
    let before = sample(pid);
    let db_before = ctx.daemon_pid.and_then(sample);
    let (http, url2, amount) = (ctx.http.clone(), Arc::clone(url), plan.amount);
    let measured = open_loop(
        count,
        plan.rate_per_s,
        plan.max_in_flight,
        Duration::from_secs_f64(plan.give_up_after_s),
        move |_| {
            let (a, b) = random_pair(&active);
            post_transfer(http.clone(), Arc::clone(&url2), transfer_body(a, b, amount))
        },
    )
    .await;
    let after = sample(pid);
    let db_after = ctx.daemon_pid.and_then(sample);
    let cpu = match (before, after) {
        (Some(b), Some(a)) => Some(a.cpu_seconds - b.cpu_seconds),
        _ => None,
    };
    eprintln!(
        "[seed] completion {} s, mean {:.1} ms, p95 {:.1} ms, p99 {:.1} ms, ok {}, failed: {}, unanswered {}",
        measured
            .completion_s
            .map_or("(unfinished)".into(), |s| format!("{s:.1}")),
        measured.latency.as_ref().map_or(f64::NAN, |l| l.mean_ms),
        measured.latency.as_ref().map_or(f64::NAN, |l| l.p95_ms),
        measured.latency.as_ref().map_or(f64::NAN, |l| l.p99_ms),
        measured.ok,
        measured.failures.brief(),
        measured.unanswered,
    );
    Ok(SeedResult {
        plan: plan.clone(),
        insert_accounts_s,
        server_cpu_s: cpu,
        server_cpu_s_per_1k_transfers: cpu.map(|c| c / count.max(1) as f64 * 1000.0),
        server_peak_rss_mib: after.map(|a| mib(a.peak_rss_kib)),
        server_peak_rss_reset: reset,
        database_cpu_s: match (db_before, db_after) {
            (Some(b), Some(a)) => Some(a.cpu_seconds - b.cpu_seconds),
            _ => None,
        },
        measured,
    })
}
