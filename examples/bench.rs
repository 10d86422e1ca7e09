//! The benchmark: `cargo run --release --example bench [-- --quick] [--out DIR]
//! [--parts limit,twophase,native,seed,overload,storm,holds,deployments,ledger,events,legs]
//! [--admission-wait-ms N]`.
//!
//! In one run, against one database server started for it (a SecantusDB daemon with
//! `--sync-on-commit`, or the server of `MONGODB_URI`), it measures side by side:
//!
//! 1. the limit: guarded single-document updates and bulk document updates per second
//!    through the same driver and write concern, and from them the transfer ceiling;
//! 2. this service with `TRANSFER_STRATEGY=two-phase`, a separate release process, under
//!    closed-loop HTTP load at concurrency 1, 8, 32, 128 over uniform and hot accounts;
//! 3. the same with `TRANSFER_STRATEGY=native` (reported "not available" if the service
//!    refuses it);
//! 4. the seed scenario of the MongoDB schema simulator, open loop, per strategy;
//! 5. the cost: the server's CPU seconds per thousand transfers and its peak RSS;
//! 6. overload: two-phase offered 2 and 5 times its capacity, open loop, answering
//!    synchronously or with `Prefer: respond-async` (goodput, answers, time until every
//!    accepted transfer is terminal, peak RSS, money conserved); and (`storm`) 1,000
//!    connections that retry a refused transfer at once, ignoring `Retry-After`, beside
//!    1,000 that honour it, each mode against its capacity at 64 connections (transfers
//!    done per second, refusals per second, the service's CPU, peak RSS, drain);
//! 7. holds: plain transfers, holds created and holds captured per second and their
//!    latency, side by side at each concurrency (money conserved, no reservation left);
//! 8. deployments: transfers within one deployment and across two (a second SecantusDB
//!    daemon), per second, their latency and the database commands each costs;
//! 9. the ledger: a statement of 1,000 entries and a balance as of a past time, read
//!    right after the transfers that made them, once the entry mover has moved them, and
//!    with all of them in the account's document; and what an entry costs in bytes;
//! 10. events: transfers per second with one webhook and one event stream following the
//!     events, against none, and the delay from a transfer's answer to its webhook;
//! 11. multi-leg transfers: plain transfers beside transfers of 2, 4 and 8 legs, per
//!     second, their latency and what each costs the database.
//!
//! Each closed-loop point of parts 2 and 3 also reports what the database did per
//! transfer, from its own counters: commands by name, documents written, journal bytes.
//!
//! It writes `results.json`, `results.md` and `plot.svg` into the results folder
//! (default `results/<UTC timestamp>`) and prints the Markdown at the end.

#[path = "bench/deployments.rs"]
mod deployments;
#[path = "bench/driver.rs"]
mod driver;
#[path = "bench/events.rs"]
mod events;
#[path = "bench/holds.rs"]
mod holds;
#[path = "bench/ledger.rs"]
mod ledger;
#[path = "bench/legs.rs"]
mod legs;
#[path = "bench/limit.rs"]
mod limit;
#[path = "bench/overload.rs"]
mod overload;
#[path = "bench/procs.rs"]
mod procs;
#[path = "bench/report.rs"]
mod report;
#[path = "bench/service.rs"]
mod service;
#[path = "bench/stats.rs"]
mod stats;
#[path = "bench/storm.rs"]
mod storm;
#[path = "bench/work.rs"]
mod work;

use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use clap::{Parser, ValueEnum};
use mongodb::bson::doc;

use crate::deployments::DeploymentsPlan;
use crate::events::EventsPlan;
use crate::holds::HoldsPlan;
use crate::ledger::LedgerPlan;
use crate::legs::LegsPlan;
use crate::limit::LimitPlan;
use crate::overload::OverloadPlan;
use crate::procs::{Daemon, project_root};
use crate::report::{DatabaseInfo, Machine, PUBLISHED, Results};
use crate::service::{ClosedPlan, Context, SeedPlan};
use crate::storm::StormPlan;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Part {
    Limit,
    Twophase,
    Native,
    Seed,
    Overload,
    Storm,
    Holds,
    Deployments,
    Ledger,
    Events,
    Legs,
}

/// Measures the database's limit, the service's two strategies and the seed scenario.
#[derive(Debug, Parser)]
#[command(name = "bench")]
struct Cli {
    /// A short smoke run of every part at tiny sizes (numbers not comparable).
    #[arg(long)]
    quick: bool,
    /// Results folder (default: results/<UTC timestamp> in the project).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Which parts to run, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "limit,twophase,native,seed,overload,storm,holds,deployments,ledger,events,legs"
    )]
    parts: Vec<Part>,
    /// `ADMISSION_WAIT_MS` for the services of the overload and storm parts (unset: the
    /// service's default); 0 refuses at once, as before the wait existed.
    #[arg(long)]
    admission_wait_ms: Option<u64>,
    /// Client concurrencies of the closed-loop parts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128")]
    concurrency: Vec<usize>,
    /// Which strategies the seed scenario runs with, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "two-phase,native",
        value_parser = ["two-phase", "native"]
    )]
    seed_strategies: Vec<String>,
    /// Runs this service binary instead of building the project's: to compare two builds
    /// in one session, alternating runs of each.
    #[arg(long)]
    server: Option<PathBuf>,
}

struct Plans {
    limit: LimitPlan,
    closed: ClosedPlan,
    seed: SeedPlan,
    overload: OverloadPlan,
    storm: StormPlan,
    holds: HoldsPlan,
    deployments: DeploymentsPlan,
    ledger: LedgerPlan,
    events: EventsPlan,
    legs: LegsPlan,
}

fn plans(quick: bool, concurrencies: &[usize], admission_wait_ms: Option<u64>) -> Plans {
    let (warmup, window) = if quick { (0.5, 1.5) } else { (2.0, 10.0) };
    Plans {
        limit: LimitPlan {
            concurrencies: concurrencies.to_vec(),
            warmup_s: if quick { 0.3 } else { 1.0 },
            window_s: if quick { 1.0 } else { 5.0 },
            bulk_batches: if quick { vec![100] } else { vec![100, 1000] },
            bulk_concurrencies: vec![1, 8],
            bulk_warmup_s: if quick { 0.3 } else { 1.0 },
            bulk_window_s: if quick { 0.7 } else { 3.0 },
            max_pool_size: 256,
        },
        closed: ClosedPlan {
            concurrencies: concurrencies.to_vec(),
            warmup_s: warmup,
            window_s: window,
            uniform_accounts: if quick { 100 } else { 1000 },
            opening_balance: 1_000_000_000_000,
            amount: 1,
        },
        seed: SeedPlan {
            total_accounts: if quick { 2_000 } else { 100_000 },
            active_accounts: if quick { 200 } else { 10_000 },
            rate_per_s: if quick { 100.0 } else { 1000.0 },
            arrivals_s: if quick { 2.0 } else { 25.0 },
            amount: 100,
            opening_balance: 1_000_000_000,
            max_in_flight: 1024,
            give_up_after_s: if quick { 30.0 } else { 180.0 },
        },
        overload: OverloadPlan {
            multiples: vec![2.0, 5.0],
            burst_s: if quick { 3.0 } else { 20.0 },
            accounts: 1000,
            opening_balance: 1_000_000_000_000,
            amount: 1,
            client_max_in_flight: 4096,
            max_transfers_in_flight: 512,
            stale_after_ms: 10_000,
            admission_wait_ms,
            capacity_clients: 128,
            capacity_warmup_s: if quick { 0.5 } else { 2.0 },
            capacity_window_s: if quick { 1.5 } else { 5.0 },
            give_up_after_goal_s: if quick { 30.0 } else { 60.0 },
            goal_goodput_fraction: 0.8,
            goal_peak_rss_mib: 64.0,
        },
        storm: StormPlan {
            connections: 1000,
            capacity_connections: 64,
            burst_s: if quick { 2.0 } else { 10.0 },
            accounts: 1000,
            opening_balance: 1_000_000_000_000,
            amount: 1,
            max_transfers_in_flight: 512,
            stale_after_ms: 10_000,
            admission_wait_ms,
            give_up_after_goal_s: if quick { 30.0 } else { 60.0 },
            goal_done_fraction: 0.8,
            goal_peak_rss_mib: 64.0,
        },
        holds: HoldsPlan {
            concurrencies: if quick { vec![8] } else { vec![8, 32, 128] },
            warmup_s: warmup,
            window_s: window,
            accounts: if quick { 100 } else { 1000 },
            opening_balance: 1_000_000_000_000,
            amount: 1,
            expires_in_ms: 3_600_000,
        },
        deployments: DeploymentsPlan {
            concurrencies: if quick { vec![8] } else { vec![8, 32, 128] },
            warmup_s: warmup,
            window_s: window,
            accounts_per_deployment: if quick { 50 } else { 500 },
            opening_balance: 1_000_000_000_000,
            amount: 1,
        },
        ledger: LedgerPlan {
            transfers: 1000,
            sources: 8,
            in_flight: 32,
            reads: if quick { 20 } else { 200 },
            page: 1000,
            opening_balance: 1_000_000_000_000,
            amount: 1,
            settle_timeout_s: 10.0,
        },
        events: EventsPlan {
            concurrency: if quick { 8 } else { 128 },
            accounts: if quick { 100 } else { 1000 },
            warmup_s: warmup,
            window_s: window,
            rounds: if quick { 1 } else { 3 },
            opening_balance: 1_000_000_000_000,
            amount: 1,
            settle_timeout_s: 30.0,
        },
        legs: LegsPlan {
            // The closed-loop concurrencies but 1 (where nothing is batched).
            concurrencies: if quick {
                vec![8]
            } else {
                concurrencies.iter().copied().filter(|c| *c > 1).collect()
            },
            legs: vec![(1, false), (2, false), (4, false), (8, false), (8, true)],
            warmup_s: warmup,
            window_s: window,
            accounts: if quick { 100 } else { 1000 },
            opening_balance: 1_000_000_000_000,
            amount: 1,
        },
    }
}

fn command_output(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program)
        .args(args)
        .current_dir(project_root())
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|rest| rest.split_once(':'))
        .map_or("unknown".into(), |(_, m)| m.trim().to_owned());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: f64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0);
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    Machine {
        nproc: std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model,
        memory_gib: mem_kib / 1024.0 / 1024.0,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_owned(),
        rustc: command_output(&rustc, &["--version"]).unwrap_or_else(|| "unknown".into()),
        git_commit: command_output("git", &["rev-parse", "HEAD"])
            .unwrap_or_else(|| "unknown".into()),
        git_dirty: command_output("git", &["status", "--porcelain"]).is_some_and(|s| !s.is_empty()),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let started_at = chrono::Utc::now();
    let stamp = started_at.format("%Y%m%dT%H%M%SZ").to_string();
    let out = cli
        .out
        .clone()
        .unwrap_or_else(|| project_root().join("results").join(&stamp));
    if let Err(e) = std::fs::create_dir_all(&out) {
        eprintln!("bench: cannot create {}: {e}", out.display());
        return ExitCode::FAILURE;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let code = runtime.block_on(async {
        tokio::select! {
            code = run(cli, out, started_at) => code,
            _ = tokio::signal::ctrl_c() => {
                // Dropping `run` kills the daemon and the service and removes the
                // daemon's folder; a build or install still running dies with us
                // (PR_SET_PDEATHSIG).
                eprintln!("bench: interrupted; stopping the processes it started");
                ExitCode::from(130)
            }
        }
    });
    // Do not wait for a blocking task (a build) to finish.
    runtime.shutdown_background();
    code
}

async fn run(cli: Cli, out: PathBuf, started_at: chrono::DateTime<chrono::Utc>) -> ExitCode {
    let clock = Instant::now();
    let wants = |p: Part| cli.parts.contains(&p);
    let plans = plans(cli.quick, &cli.concurrency, cli.admission_wait_ms);
    let mut part_seconds: Vec<(String, f64)> = Vec::new();
    let mut notes = Vec::new();
    eprintln!("[bench] results go to {}", out.display());

    let needs_server = wants(Part::Twophase)
        || wants(Part::Native)
        || wants(Part::Seed)
        || wants(Part::Overload)
        || wants(Part::Storm)
        || wants(Part::Holds)
        || wants(Part::Deployments)
        || wants(Part::Ledger)
        || wants(Part::Events)
        || wants(Part::Legs);
    let server_binary = if let Some(given) = cli.server.clone().filter(|_| needs_server) {
        Some(given)
    } else if needs_server {
        let t = Instant::now();
        match tokio::task::spawn_blocking(procs::build_server)
            .await
            .expect("build thread")
        {
            Ok(path) => {
                part_seconds.push(("build".to_owned(), t.elapsed().as_secs_f64()));
                Some(path)
            }
            Err(e) => {
                eprintln!("bench: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };

    // The database server: MONGODB_URI, or one daemon for the whole run.
    let external = std::env::var("MONGODB_URI")
        .ok()
        .filter(|u| !u.trim().is_empty());
    let daemon = match &external {
        Some(_) => None,
        None => {
            let started =
                tokio::task::spawn_blocking(|| procs::secantusd_binary().and_then(Daemon::start))
                    .await
                    .expect("daemon thread");
            match started {
                Ok(d) => Some(d),
                Err(e) => {
                    eprintln!("bench: no database: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    };
    let uri = external
        .clone()
        .unwrap_or_else(|| daemon.as_ref().expect("daemon").uri.clone());
    eprintln!(
        "[bench] database: {}",
        if external.is_some() {
            "MONGODB_URI"
        } else {
            &uri
        }
    );
    let mongo = match limit::connect(&uri, 16).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("bench: cannot connect to the database: {e}");
            return ExitCode::FAILURE;
        }
    };
    let version = match mongo
        .database("admin")
        .run_command(doc! { "buildInfo": 1 })
        .await
    {
        Ok(info) => info.get_str("version").unwrap_or("unknown").to_owned(),
        Err(e) => {
            eprintln!("bench: the database does not answer: {e}");
            return ExitCode::FAILURE;
        }
    };
    let database = DatabaseInfo {
        kind: if external.is_some() {
            "MONGODB_URI".into()
        } else {
            "secantusd-rs started by the benchmark (--sync-on-commit)".into()
        },
        binary: daemon.as_ref().map(|d| d.binary.display().to_string()),
        version,
    };
    let db_prefix = format!("bench_{}", started_at.format("%Y%m%d_%H%M%S"));

    // Part 1.
    let mut limit_result = None;
    let mut limit_error = None;
    if wants(Part::Limit) {
        let t = Instant::now();
        eprintln!("[limit] the database alone, w:majority j:true");
        match limit::run(&uri, &format!("{db_prefix}_limit"), plans.limit.clone()).await {
            Ok(l) => {
                eprintln!(
                    "[limit] transfer ceiling {:.0} transfers/s ({} ÷ {})",
                    l.transfer_ceiling_per_s, l.ceiling_from, l.writes_per_transfer
                );
                limit_result = Some(l);
            }
            Err(e) => {
                eprintln!("[limit] failed: {e}");
                limit_error = Some(e.to_string());
            }
        }
        part_seconds.push(("limit".to_owned(), t.elapsed().as_secs_f64()));
    }

    // Parts 2 to 5.
    let mut strategies = Vec::new();
    let ctx = server_binary.map(|server_binary| Context {
        server_binary,
        uri: uri.clone(),
        db_prefix: db_prefix.clone(),
        out: out.clone(),
        daemon_pid: daemon.as_ref().map(Daemon::pid),
        mongo: mongo.clone(),
        http: service::http_client(),
    });
    if let Some(ctx) = &ctx {
        for (part, name) in [(Part::Twophase, "two-phase"), (Part::Native, "native")] {
            let closed = wants(part).then_some(&plans.closed);
            let seed = (wants(Part::Seed) && cli.seed_strategies.iter().any(|s| s == name))
                .then_some(&plans.seed);
            if closed.is_none() && seed.is_none() {
                continue;
            }
            let t = Instant::now();
            let result = service::run_strategy(ctx, name, closed, seed).await;
            part_seconds.push((name.to_owned(), t.elapsed().as_secs_f64()));
            if let Some(s) = result.part_seconds.get("seed") {
                part_seconds.push((format!("{name} seed"), *s));
            }
            strategies.push(result);
        }
    }

    // Part 6.
    let mut overload_result = None;
    if let (Some(ctx), true) = (&ctx, wants(Part::Overload)) {
        let t = Instant::now();
        let measured = strategies
            .iter()
            .find(|s| s.strategy == "two-phase" && s.available)
            .and_then(|s| {
                s.points
                    .iter()
                    .filter(|p| p.workload == "uniform" && p.measured.units_per_s > 0.0)
                    .max_by(|a, b| a.measured.units_per_s.total_cmp(&b.measured.units_per_s))
            })
            .map(|p| {
                (
                    p.measured.units_per_s,
                    format!(
                        "best closed-loop point of the two-phase part: uniform, {} accounts, c={}",
                        plans.closed.uniform_accounts, p.measured.concurrency
                    ),
                )
            });
        overload_result = Some(overload::run(ctx, &plans.overload, measured).await);
        part_seconds.push(("overload".to_owned(), t.elapsed().as_secs_f64()));
    }
    // Part 6b.
    let mut storm_result = None;
    if let (Some(ctx), true) = (&ctx, wants(Part::Storm)) {
        let t = Instant::now();
        storm_result = Some(storm::run(ctx, &plans.storm).await);
        part_seconds.push(("storm".to_owned(), t.elapsed().as_secs_f64()));
    }
    // Part 7.
    let mut holds_result = None;
    if let (Some(ctx), true) = (&ctx, wants(Part::Holds)) {
        let t = Instant::now();
        holds_result = Some(holds::run(ctx, &plans.holds).await);
        part_seconds.push(("holds".to_owned(), t.elapsed().as_secs_f64()));
    }
    // Part 8.
    let mut deployments_result = None;
    if let (Some(ctx), true) = (&ctx, wants(Part::Deployments)) {
        let t = Instant::now();
        deployments_result = Some(deployments::run(ctx, &plans.deployments).await);
        part_seconds.push(("deployments".to_owned(), t.elapsed().as_secs_f64()));
    }
    // Part 9.
    let mut ledger_result = None;
    if let (Some(ctx), true) = (&ctx, wants(Part::Ledger)) {
        let t = Instant::now();
        ledger_result = Some(ledger::run(ctx, &plans.ledger).await);
        part_seconds.push(("ledger".to_owned(), t.elapsed().as_secs_f64()));
    }
    // Part 10.
    let mut events_result = None;
    if let (Some(ctx), true) = (&ctx, wants(Part::Events)) {
        let t = Instant::now();
        events_result = Some(events::run(ctx, &plans.events).await);
        part_seconds.push(("events".to_owned(), t.elapsed().as_secs_f64()));
    }
    // Part 11.
    let mut legs_result = None;
    if let (Some(ctx), true) = (&ctx, wants(Part::Legs)) {
        let t = Instant::now();
        legs_result = Some(legs::run(ctx, &plans.legs).await);
        part_seconds.push(("legs".to_owned(), t.elapsed().as_secs_f64()));
    }
    let mut violations = overload_result
        .as_ref()
        .map_or_else(Vec::new, overload::OverloadResult::violations);
    violations.extend(
        storm_result
            .as_ref()
            .map_or_else(Vec::new, storm::StormResult::violations),
    );
    violations.extend(
        holds_result
            .as_ref()
            .map_or_else(Vec::new, holds::HoldsResult::violations),
    );
    violations.extend(
        deployments_result
            .as_ref()
            .map_or_else(Vec::new, deployments::DeploymentsResult::violations),
    );
    violations.extend(
        ledger_result
            .as_ref()
            .map_or_else(Vec::new, ledger::LedgerResult::violations),
    );
    violations.extend(
        events_result
            .as_ref()
            .map_or_else(Vec::new, events::EventsResult::violations),
    );
    violations.extend(
        legs_result
            .as_ref()
            .map_or_else(Vec::new, legs::LegsResult::violations),
    );

    notes.push(
        "Closed loop: a request counts when it answers inside the measured window. HTTP/1.1 keep-alive, one connection per client.".to_owned(),
    );
    notes.push(
        "The benchmark client, the service and the database share this machine's CPUs.".into(),
    );
    if !cli.quick {
        notes.push("Transfers carry no Idempotency-Key (the service's plain path).".to_owned());
    }

    let results = Results {
        benchmark: "transfer-service examples/bench.rs",
        command: {
            let args: Vec<String> = std::env::args().skip(1).collect();
            if args.is_empty() {
                "cargo run --release --example bench".to_owned()
            } else {
                format!("cargo run --release --example bench -- {}", args.join(" "))
            }
        },
        started_at: started_at.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
        finished_at: chrono::Utc::now()
            .format("%Y-%m-%d %H:%M:%S UTC")
            .to_string(),
        quick: cli.quick,
        parts: cli
            .parts
            .iter()
            .map(|p| format!("{p:?}").to_lowercase())
            .collect(),
        machine: machine(),
        database,
        limit: limit_result,
        limit_error,
        strategies,
        published_seed: PUBLISHED,
        closed_plan: plans.closed.clone(),
        seed_plan: plans.seed.clone(),
        overload: overload_result,
        storm: storm_result,
        holds: holds_result,
        legs: legs_result,
        deployments: deployments_result,
        ledger: ledger_result,
        events: events_result,
        part_seconds,
        total_seconds: clock.elapsed().as_secs_f64(),
        notes,
    };
    let md = report::markdown(&results);
    let written = std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&results).expect("json"),
    )
    .and_then(|()| std::fs::write(out.join("results.md"), &md))
    .and_then(|()| std::fs::write(out.join("plot.svg"), report::plot(&results)));
    drop(daemon);
    if let Err(e) = written {
        eprintln!("bench: cannot write the results: {e}");
        return ExitCode::FAILURE;
    }
    println!("{md}");
    eprintln!(
        "[bench] wrote results.json, results.md and plot.svg to {}",
        out.display()
    );
    if !violations.is_empty() {
        eprintln!(
            "bench: {} VIOLATION(S) (money, markers, accepted transfers, holds or the ledger):",
            violations.len()
        );
        for v in &violations {
            eprintln!("bench: VIOLATION: {v}");
        }
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
