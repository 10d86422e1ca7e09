//! What a run writes: `results.json` (everything), `results.md` (the tables with the
//! ratios) and `plot.svg` (throughput and p99 against concurrency).

use std::fmt::Write as _;

use serde::Serialize;

use crate::deployments::DeploymentsResult;
use crate::events::EventsResult;
use crate::holds::HoldsResult;
use crate::ledger::LedgerResult;
use crate::legs::LegsResult;
use crate::limit::LimitResult;
use crate::overload::{OverloadResult, answers_brief};
use crate::service::{ClosedPlan, Point, SeedPlan, StrategyResult};
use crate::stats::Failures;
use crate::storm::StormResult;

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub nproc: usize,
    pub cpu_model: String,
    pub memory_gib: f64,
    pub kernel: String,
    pub rustc: String,
    pub git_commit: String,
    /// The working tree had uncommitted changes.
    pub git_dirty: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct DatabaseInfo {
    /// `secantusd-rs started by the benchmark` or `MONGODB_URI`.
    pub kind: String,
    pub binary: Option<String>,
    /// `buildInfo.version` as the server reports it.
    pub version: String,
}

/// The figures published for the seed scenario on MongoDB 3.0 with WiredTiger.
#[derive(Debug, Clone, Serialize)]
pub struct Published {
    pub source: &'static str,
    pub transfers: u64,
    pub completion_s: f64,
    pub mean_s: f64,
    pub p95_s: f64,
    pub p99_s: f64,
}

pub const PUBLISHED: Published = Published {
    source: "MongoDB schema simulator, account scenario, MongoDB 3.0 + WiredTiger",
    transfers: 25_000,
    completion_s: 46.7,
    mean_s: 8.7,
    p95_s: 19.9,
    p99_s: 30.0,
};

#[derive(Debug, Clone, Serialize)]
pub struct Results {
    pub benchmark: &'static str,
    pub command: String,
    pub started_at: String,
    pub finished_at: String,
    pub quick: bool,
    pub parts: Vec<String>,
    pub machine: Machine,
    pub database: DatabaseInfo,
    pub limit: Option<LimitResult>,
    pub limit_error: Option<String>,
    pub strategies: Vec<StrategyResult>,
    pub published_seed: Published,
    pub closed_plan: ClosedPlan,
    pub seed_plan: SeedPlan,
    /// Part 6, when it ran.
    pub overload: Option<OverloadResult>,
    /// Part 6b, the retry storm, when it ran.
    pub storm: Option<StormResult>,
    /// Part 7, when it ran.
    pub holds: Option<HoldsResult>,
    pub deployments: Option<DeploymentsResult>,
    /// Part 9, when it ran.
    pub ledger: Option<LedgerResult>,
    /// Part 10, when it ran.
    pub events: Option<EventsResult>,
    /// Part 11, when it ran.
    pub legs: Option<LegsResult>,
    /// Wall-clock seconds of each part in the order run (build, limit, two-phase, native;
    /// a strategy's time includes its seed scenario, which is also listed alone).
    pub part_seconds: Vec<(String, f64)>,
    pub total_seconds: f64,
    pub notes: Vec<String>,
}

pub fn num(v: f64) -> String {
    if !v.is_finite() {
        return "–".into();
    }
    let digits = if v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else {
        2
    };
    let s = format!("{v:.digits$}");
    // Thousands separators on the integer part.
    let (int, frac) = s.split_once('.').map_or((s.as_str(), ""), |(i, f)| (i, f));
    let (sign, int) = int.strip_prefix('-').map_or(("", int), |i| ("-", i));
    let mut grouped = String::new();
    for (i, ch) in int.chars().enumerate() {
        if i > 0 && (int.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(ch);
    }
    if frac.is_empty() {
        format!("{sign}{grouped}")
    } else {
        format!("{sign}{grouped}.{frac}")
    }
}

fn ratio(a: f64, b: f64) -> String {
    if !(a.is_finite() && b.is_finite() && b > 0.0) {
        return "–".into();
    }
    let r = a / b;
    if r >= 0.1 || r == 0.0 {
        format!("{r:.2}")
    } else {
        format!("{r:.4}")
    }
}

fn tps(p: Option<&Point>) -> f64 {
    p.map_or(f64::NAN, |p| p.measured.units_per_s)
}

fn lat(p: Option<&Point>, f: impl Fn(&crate::stats::Latency) -> f64) -> f64 {
    p.and_then(|p| p.measured.latency.as_ref())
        .map_or(f64::NAN, f)
}

fn failed(p: Option<&Point>) -> String {
    p.map_or("–".into(), |p| p.measured.failures.total.to_string())
}

fn strategy<'a>(r: &'a Results, name: &str) -> Option<&'a StrategyResult> {
    r.strategies.iter().find(|s| s.strategy == name)
}

fn point<'a>(s: Option<&'a StrategyResult>, workload: &str, c: usize) -> Option<&'a Point> {
    s?.points
        .iter()
        .find(|p| p.workload == workload && p.measured.concurrency == c)
}

fn concurrencies(r: &Results) -> Vec<usize> {
    let mut cs: Vec<usize> = r
        .strategies
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.measured.concurrency))
        .collect();
    cs.sort_unstable();
    cs.dedup();
    cs
}

fn ceiling(r: &Results) -> f64 {
    r.limit
        .as_ref()
        .map_or(f64::NAN, |l| l.transfer_ceiling_per_s)
}

pub fn markdown(r: &Results) -> String {
    let mut md = String::new();
    let m = &r.machine;
    let _ = writeln!(md, "# transfer-service benchmark, {}\n", r.started_at);
    let _ = writeln!(
        md,
        "Machine: {} × {}, {:.0} GiB, Linux {}, {}. Commit {}{}. Database: {} {} (`{}`). Every write w:majority, j:true. Run: `{}`{}, {:.0} s in all.\n",
        m.nproc,
        m.cpu_model,
        m.memory_gib,
        m.kernel,
        m.rustc,
        &m.git_commit[..m.git_commit.len().min(12)],
        if m.git_dirty {
            " with uncommitted changes"
        } else {
            ""
        },
        r.database.kind,
        r.database.version,
        r.database.binary.as_deref().unwrap_or("external"),
        r.command,
        if r.quick {
            " (quick: tiny sizes, not comparable)"
        } else {
            ""
        },
        r.total_seconds,
    );

    // The limit.
    if let Some(l) = &r.limit {
        let _ = writeln!(
            md,
            "## The limit: the database alone through the same driver\n\n| measurement | concurrency | document writes/s | p99 ms per call |\n|---|---:|---:|---:|"
        );
        for s in &l.single {
            let _ = writeln!(
                md,
                "| `update_one` guarded, own document | {} | {} | {} |",
                s.concurrency,
                num(s.units_per_s),
                num(s.latency.as_ref().map_or(f64::NAN, |x| x.p99_ms))
            );
        }
        for b in &l.bulk {
            let _ = writeln!(
                md,
                "| {} N={} | {} | {} | {} |",
                b.method,
                b.batch,
                b.measured.concurrency,
                num(b.measured.units_per_s),
                num(b.measured.latency.as_ref().map_or(f64::NAN, |x| x.p99_ms))
            );
        }
        for u in &l.bulk_unavailable {
            let _ = writeln!(
                md,
                "| {} | – | not available: {} | – |",
                u.method,
                u.error
                    .replace('|', "\\|")
                    .chars()
                    .take(160)
                    .collect::<String>()
            );
        }
        let _ = writeln!(
            md,
            "\nBest single-document: {}. Best bulk: {}.\n\n**Transfer ceiling = {} transfers/s**: the best, {}, divided by the {} document writes of one two-phase transfer ({}).\n",
            l.best_single.as_ref().map_or("–".into(), |b| format!(
                "{} writes/s ({})",
                num(b.doc_writes_per_s),
                b.what
            )),
            l.best_bulk.as_ref().map_or("–".into(), |b| format!(
                "{} writes/s ({})",
                num(b.doc_writes_per_s),
                b.what
            )),
            num(l.transfer_ceiling_per_s),
            l.ceiling_from,
            l.writes_per_transfer,
            l.writes_per_transfer_are,
        );
        let _ = writeln!(
            md,
            "Leaving out `update_many` (one filter and one identical change for all N documents, unlike the protocol's steps, which each carry their own guard and change): {} transfers/s, from {}.\n",
            num(l.distinct_guarded_ceiling_per_s),
            l.distinct_guarded_ceiling_from,
        );
    } else if let Some(e) = &r.limit_error {
        let _ = writeln!(md, "## The limit\n\nFailed: {e}\n");
    }

    // Closed loop.
    let two = strategy(r, "two-phase");
    let native = strategy(r, "native");
    let cs = concurrencies(r);
    if !cs.is_empty() {
        let plan = &r.closed_plan;
        let _ = writeln!(
            md,
            "## Transfers through the HTTP API, closed loop\n\nEach point: {} s of warm-up, then {} s measured. `uniform`: random pairs of {} accounts; `hot`: two accounts, each client alternating directions; amount {}. tx/s counts 201 `done` answers; latency in ms, of those answers; `failed`: answers other than 201 (warm-up included).\n",
            plan.warmup_s,
            plan.window_s,
            num(plan.uniform_accounts as f64),
            plan.amount,
        );
        let _ = writeln!(
            md,
            "| workload | c | two-phase tx/s | p50 | p95 | p99 | failed | native tx/s | p50 | p95 | p99 | failed | two-phase / ceiling | two-phase / native tx/s | two-phase / native p99 |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for workload in ["uniform", "hot"] {
            for &c in &cs {
                let (a, b) = (point(two, workload, c), point(native, workload, c));
                let _ = writeln!(
                    md,
                    "| {workload} | {c} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    num(tps(a)),
                    num(lat(a, |l| l.p50_ms)),
                    num(lat(a, |l| l.p95_ms)),
                    num(lat(a, |l| l.p99_ms)),
                    failed(a),
                    num(tps(b)),
                    num(lat(b, |l| l.p50_ms)),
                    num(lat(b, |l| l.p95_ms)),
                    num(lat(b, |l| l.p99_ms)),
                    failed(b),
                    ratio(tps(a), ceiling(r)),
                    ratio(tps(a), tps(b)),
                    ratio(lat(a, |l| l.p99_ms), lat(b, |l| l.p99_ms)),
                );
            }
        }
        let best = |s: Option<&StrategyResult>, w: &str| {
            s.map_or(f64::NAN, |s| {
                s.points
                    .iter()
                    .filter(|p| p.workload == w)
                    .map(|p| p.measured.units_per_s)
                    .fold(f64::NAN, f64::max)
            })
        };
        let _ = writeln!(
            md,
            "\nBest two-phase: {} tx/s uniform ({} of the ceiling), {} tx/s hot. Best native: {} tx/s uniform, {} tx/s hot.\n",
            num(best(two, "uniform")),
            ratio(best(two, "uniform"), ceiling(r)),
            num(best(two, "hot")),
            num(best(native, "uniform")),
            num(best(native, "hot")),
        );
    }
    work_section(&mut md, r);
    for s in &r.strategies {
        if !s.available {
            let _ = writeln!(
                md,
                "**{}: not available.** {}\n",
                s.strategy,
                s.unavailable_reason.as_deref().unwrap_or("")
            );
        }
    }

    // Seed scenario.
    let seeds: Vec<&StrategyResult> = r.strategies.iter().filter(|s| s.seed.is_some()).collect();
    if !seeds.is_empty() {
        let plan = &r.seed_plan;
        let _ = writeln!(
            md,
            "## Seed scenario: open loop, {} transfers/s for {} s among {} of {} accounts, amount {}\n\nLatency from each transfer's scheduled send time (no coordinated omission); at most {} requests in flight, the rest wait in the client and that wait counts. Completion: first send to last answer.\n",
            num(plan.rate_per_s),
            num(plan.arrivals_s),
            num(plan.active_accounts as f64),
            num(plan.total_accounts as f64),
            plan.amount,
            plan.max_in_flight,
        );
        let _ = writeln!(
            md,
            "| | transfers | completed | completion s | mean s | p95 s | p99 s | completion / published | p99 / published |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        let p = &r.published_seed;
        let _ = writeln!(
            md,
            "| published: MongoDB 3.0 + WiredTiger | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | 1 | 1 |",
            num(p.transfers as f64),
            num(p.transfers as f64),
            p.completion_s,
            p.mean_s,
            p.p95_s,
            p.p99_s
        );
        for s in &seeds {
            let seed = s.seed.as_ref().expect("filtered");
            let m = &seed.measured;
            let l = |f: fn(&crate::stats::Latency) -> f64| {
                m.latency.as_ref().map_or(f64::NAN, |x| f(x) / 1000.0)
            };
            let completion = m.completion_s.unwrap_or(f64::NAN);
            let _ = writeln!(
                md,
                "| {} | {} | {}{} | {} | {:.3} | {:.3} | {:.3} | {} | {} |",
                s.strategy,
                num(m.scheduled as f64),
                num(m.ok as f64),
                if m.failures.total + m.unanswered > 0 {
                    format!(
                        " ({} failed, {} unanswered)",
                        m.failures.total, m.unanswered
                    )
                } else {
                    String::new()
                },
                m.completion_s.map_or(
                    format!("> {}", num(m.arrivals_s + seed.plan.give_up_after_s)),
                    num
                ),
                l(|x| x.mean_ms),
                l(|x| x.p95_ms),
                l(|x| x.p99_ms),
                ratio(completion, p.completion_s),
                ratio(l(|x| x.p99_ms), p.p99_s),
            );
        }
        let _ = writeln!(md);
    }

    // Cost.
    let costs: Vec<&StrategyResult> = r
        .strategies
        .iter()
        .filter(|s| s.cost.is_some() || s.seed.is_some())
        .collect();
    if !costs.is_empty() {
        let _ = writeln!(
            md,
            "## Cost of the service process\n\n| strategy | closed-loop transfers | CPU s / 1,000 transfers | (load only) | peak RSS MiB | database CPU s / 1,000 transfers | seed: CPU s / 1,000 | seed: peak RSS MiB |\n|---|---:|---:|---:|---:|---:|---:|---:|"
        );
        for s in costs {
            let c = s.cost.as_ref();
            let seed = s.seed.as_ref();
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                s.strategy,
                c.map_or("–".into(), |c| num(c.transfers as f64)),
                c.map_or("–".into(), |c| format!(
                    "{:.3}",
                    c.server_cpu_s_per_1k_transfers
                )),
                c.map_or("–".into(), |c| format!(
                    "{:.3}",
                    c.server_cpu_s_per_1k_transfers_load_only
                )),
                c.map_or("–".into(), |c| num(c.server_peak_rss_mib)),
                c.and_then(|c| c.database_cpu_s_per_1k_transfers)
                    .map_or("–".into(), |v| format!("{v:.3}")),
                seed.and_then(|x| x.server_cpu_s_per_1k_transfers)
                    .map_or("–".into(), |v| format!("{v:.3}")),
                seed.and_then(|x| x.server_peak_rss_mib)
                    .map_or("–".into(), num),
            );
        }
        let _ = writeln!(
            md,
            "\nCPU: utime + stime of the server process from its start (migrations, opening the accounts) to the end of its closed-loop load, per 1,000 transfer requests; \"load only\" leaves out the start. Peak RSS: VmHWM. Database CPU: the daemon's, over the same load (local daemon only).\n"
        );
    }

    if let Some(o) = &r.overload {
        overload_section(&mut md, o);
    }
    if let Some(s) = &r.storm {
        storm_section(&mut md, s);
    }
    if let Some(h) = &r.holds {
        holds_section(&mut md, h);
    }
    if let Some(l) = &r.legs {
        legs_section(&mut md, l);
    }
    if let Some(d) = &r.deployments {
        deployments_section(&mut md, d);
    }
    if let Some(l) = &r.ledger {
        ledger_section(&mut md, l);
    }
    if let Some(e) = &r.events {
        events_section(&mut md, e);
    }

    // Failures.
    let mut failure_lines = Vec::new();
    if let Some(l) = &r.limit {
        for m in l
            .single
            .iter()
            .chain(l.bulk.iter().map(|b| &b.measured))
            .filter(|m| m.failures.total > 0)
        {
            failure_lines.push(failure_line(
                &format!("limit c={}", m.concurrency),
                &m.failures,
            ));
        }
    }
    for s in &r.strategies {
        for p in s.points.iter().filter(|p| p.measured.failures.total > 0) {
            failure_lines.push(failure_line(
                &format!("{} {} c={}", s.strategy, p.workload, p.measured.concurrency),
                &p.measured.failures,
            ));
        }
        if let Some(seed) = &s.seed
            && seed.measured.failures.total > 0
        {
            failure_lines.push(failure_line(
                &format!("{} seed", s.strategy),
                &seed.measured.failures,
            ));
        }
    }
    let _ = writeln!(md, "## Failed requests and server log\n");
    if failure_lines.is_empty() {
        let _ = writeln!(
            md,
            "No failed request: every transfer answered 201 `done`.\n"
        );
    } else {
        for line in failure_lines {
            let _ = writeln!(md, "{line}");
        }
        let _ = writeln!(md);
    }
    for s in r.strategies.iter().filter(|s| s.available) {
        let file = std::path::Path::new(&s.server_log)
            .file_name()
            .map_or(String::new(), |f| f.to_string_lossy().into_owned());
        if s.server_log_lines == 0 {
            let _ = writeln!(
                md,
                "- {} server logged nothing at warn or above.",
                s.strategy
            );
            continue;
        }
        let _ = writeln!(
            md,
            "- {} server logged {} lines at warn or above (`{file}`):",
            s.strategy, s.server_log_lines
        );
        let mut kinds: Vec<(&String, &u64)> = s.server_log_kinds.iter().collect();
        kinds.sort_by(|a, b| b.1.cmp(a.1));
        for (kind, n) in kinds.iter().take(8) {
            let _ = writeln!(md, "  - {n} × `{}`", kind.replace('`', "'"));
        }
    }
    let _ = writeln!(md);

    let _ = writeln!(
        md,
        "Time per part: {}.\n",
        r.part_seconds
            .iter()
            .map(|(k, v)| format!("{k} {v:.0} s"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for note in &r.notes {
        let _ = writeln!(md, "- {note}");
    }
    md
}

fn work_section(md: &mut String, r: &Results) {
    let points: Vec<(&str, &Point)> = r
        .strategies
        .iter()
        .flat_map(|s| s.points.iter().map(|p| (s.strategy.as_str(), p)))
        .collect();
    if points.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "### What the database did per transfer

From the database's own counters (`serverStatus`), over each point's warm-up and window, divided by the transfers answered: data commands (whoever sent them: the requests' writes, group commit's batches, the ledger's entry mover), documents inserted plus updated, journal (`log bytes written`) and its flushes; the service's count of ledger entries moved; the CPU of the service and of the database daemon.\n"
    );
    let _ = writeln!(
        md,
        "| strategy | workload | c | tx/s | commands | by command | documents written | journal bytes | journal syncs | entries moved | service CPU ms | database CPU ms |\n|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"
    );
    let opt = |v: Option<f64>| v.map_or("–".into(), |v| format!("{v:.3}"));
    for (strategy, p) in points {
        let w = &p.work;
        let by_name: Vec<String> = w
            .commands_by_name_per_transfer
            .iter()
            .map(|(name, v)| format!("{name} {v:.3}"))
            .collect();
        let _ = writeln!(
            md,
            "| {strategy} | {} | {} | {} | {:.3} | {} | {:.2} | {} | {:.3} | {} | {} | {} |",
            p.workload,
            p.measured.concurrency,
            num(p.measured.units_per_s),
            w.commands_per_transfer,
            by_name.join(", "),
            w.documents_written_per_transfer,
            num(w.journal_bytes_per_transfer),
            w.journal_syncs_per_transfer,
            w.entries_moved_per_transfer
                .map_or("–".into(), |v| format!("{v:.2}")),
            opt(w.service_cpu_ms_per_transfer),
            opt(w.database_cpu_ms_per_transfer),
        );
    }
    let _ = writeln!(
        md,
        "\nWhere the database's time went (`top` of the service's database), per transfer: the time its collections' writes took (`writeLock`, waits for the journal included), and that time over the point's wall-clock time (writes in flight on average), and operations × microseconds by collection and kind, the costliest first (a write command counts once, however many documents it writes).\n"
    );
    let _ = writeln!(
        md,
        "| strategy | workload | c | write lock µs | writes in flight | by collection and kind |\n|---|---|---:|---:|---:|---|"
    );
    for s in &r.strategies {
        for p in &s.points {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.0} | {:.2} | {} |",
                s.strategy,
                p.workload,
                p.measured.concurrency,
                p.work.write_lock_us_per_transfer,
                p.work.writes_in_flight,
                p.work.time_by_operation(),
            );
        }
    }
    let _ = writeln!(md);
}

fn events_section(md: &mut String, e: &EventsResult) {
    md.push_str("\n## Events: a webhook and a stream\n\n");
    if !e.available {
        md.push_str(&format!(
            "Not run: {}\n",
            e.unavailable_reason.as_deref().unwrap_or("unknown")
        ));
        return;
    }
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    md.push_str(&format!(
        "Closed loop, c={} over {} uniform accounts, {} s windows, alternating: with nobody following the events (none), and with one webhook for `transfer.done` (a receiver in the benchmark answering 204) and one event stream open (followed). The event recorder runs in both.\n\n| | transfers/s, each run | mean |\n|---|---|---:|\n| none | {} | {} |\n| followed | {} | {} |\n\nFollowed / none: **{}** (goal: at least 0.9).\n\n",
        e.plan.concurrency,
        e.plan.accounts,
        e.plan.window_s,
        list(&e.none_per_s),
        num(e.none_per_s.iter().sum::<f64>() / e.none_per_s.len().max(1) as f64),
        list(&e.followed_per_s),
        num(e.followed_per_s.iter().sum::<f64>() / e.followed_per_s.len().max(1) as f64),
        e.ratio.map_or("n/a".to_owned(), |r| format!("{r:.2}")),
    ));
    if let Some(d) = &e.webhook_delay {
        md.push_str(&format!(
            "From a transfer's answer to its webhook's arrival, over {} webhooks: p50 {:.1} ms, p95 {:.1} ms, p99 {:.1} ms, max {:.1} ms. {} transfers answered done while followed; {} webhooks arrived, {} missing after {} s, {} came more than once. The stream received {} events.\n",
            d.count, d.p50_ms, d.p95_ms, d.p99_ms, d.max_ms, e.followed_done, e.webhooks_received, e.webhooks_missing, e.plan.settle_timeout_s, e.webhooks_repeated, e.stream_events
        ));
    }
}

fn ledger_section(md: &mut String, l: &LedgerResult) {
    let _ = writeln!(
        md,
        "## Ledger: a statement of 1,000 entries, and what an entry costs\n"
    );
    if !l.available {
        let reason = l.unavailable_reason.as_deref().unwrap_or("unknown");
        let _ = writeln!(md, "Not measured: {reason}.\n");
        return;
    }
    let plan = &l.plan;
    let _ = writeln!(
        md,
        "One account received {} credits through the API from {} funded accounts, {} in flight: {} done in {:.1} s ({} failed); it then had {} entries. Then, one request after the other, {} reads of `GET /accounts/{{id}}/entries?limit={}` (each checked: {} entries numbered from 1) and {} of `GET /accounts/{{id}}/balance?at=` (the time of the page's middle entry; checked against the page). In three states: right after the credits (the entries not yet moved in the account's document: their number at the first read and at the last is in the table); once the entry mover had copied them to `entries` and one more credit had left the copies out of the document, at most one left there ({}); and with all of the account's entries put back into its document, directly in the database (what an instance killed before moving them leaves). Latency in ms.\n",
        num(plan.transfers as f64),
        plan.sources,
        plan.in_flight,
        num(l.transfers_done as f64),
        l.transfers_s,
        l.transfers_failed.total,
        num(l.entries as f64),
        plan.reads,
        plan.page,
        num(plan.page as f64),
        plan.reads,
        l.waited_for_mover_s.map_or(
            "which it had not done within the time allowed".into(),
            |s| format!("after the first reads, {s:.2} s more")
        ),
    );
    let _ = writeln!(
        md,
        "| state | entries in the document (first read, last read) | statement p50 | p99 | max | body KiB | balance at p50 | p99 | max | wrong answers |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let lat = |x: &Option<crate::stats::Latency>, f: fn(&crate::stats::Latency) -> f64| {
        num(x.as_ref().map_or(f64::NAN, f))
    };
    for s in &l.series {
        let _ = writeln!(
            md,
            "| {} | {}, {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            s.state,
            s.in_document_before,
            s.in_document_after,
            lat(&s.statement, |x| x.p50_ms),
            lat(&s.statement, |x| x.p99_ms),
            lat(&s.statement, |x| x.max_ms),
            num(s.statement_body_bytes as f64 / 1024.0),
            lat(&s.balance, |x| x.p50_ms),
            lat(&s.balance, |x| x.p99_ms),
            lat(&s.balance, |x| x.max_ms),
            s.wrong.total,
        );
    }
    if let Some(b) = &l.bytes {
        let indexes: Vec<String> = b
            .index_sizes_bytes
            .iter()
            .map(|(name, v)| format!("`{name}` {}", num(*v as f64)))
            .collect();
        let _ = writeln!(
            md,
            "\nBytes, as the database reports them: an entry in `entries` is {:.0} B (`$bsonSize`, {} of the account's, {} to {} B; `collStats`: {} documents, {} B on average, {} B in all), and its index entries {:.0} B more ({} B of indexes: {}). Waiting in the account's document, one entry more makes it {} B larger ({} B against {} B, the document once the mover moved what it moves); with all {} of its entries in it the document is {} B, {:.0} B an entry. Without the ledger's fields (`seq`, `recentEntries`, `lastEntryAt`), as before the ledger, the document would be {} B.\n",
            b.entry_document_avg_bytes,
            num(b.entry_documents as f64),
            b.entry_document_min_bytes,
            b.entry_document_max_bytes,
            num(b.collection_count as f64),
            num(b.collection_avg_obj_size_bytes),
            num(b.collection_size_bytes as f64),
            b.index_bytes_per_entry,
            num(b.total_index_size_bytes as f64),
            indexes.join(", "),
            b.entry_in_document_bytes,
            num(b.account_document_plus_one_bytes as f64),
            num(b.account_document_bytes as f64),
            num(l.entries as f64),
            b.account_document_all_in_bytes
                .map_or("–".into(), |v| num(v as f64)),
            b.entry_in_document_avg_bytes.unwrap_or(f64::NAN),
            b.account_document_without_ledger_bytes,
        );
    } else if let Some(e) = &l.bytes_error {
        let _ = writeln!(md, "\nBytes not measured: {e}\n");
    }
}

fn holds_section(md: &mut String, h: &HoldsResult) {
    let _ = writeln!(
        md,
        "## Holds: created and captured, beside plain transfers\n"
    );
    if !h.available {
        let reason = h.unavailable_reason.as_deref().unwrap_or("unknown");
        let _ = writeln!(md, "Not measured: {reason}.\n");
        return;
    }
    let _ = writeln!(
        md,
        "One service and database; at each concurrency, closed loop over random pairs of the accounts: plain transfers (201 `done`), then holds created (201 `held`), then the holds just created captured whole (200 `done`, measured over half the window). Per second; latency in ms of the successful answers.\n"
    );
    let _ = writeln!(
        md,
        "| c | transfers/s | p50 | p99 | holds created/s | p50 | p99 | holds captured/s | p50 | p99 |"
    );
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let cells = |m: &crate::driver::Measured| {
        let (p50, p99) = m
            .latency
            .as_ref()
            .map_or((f64::NAN, f64::NAN), |l| (l.p50_ms, l.p99_ms));
        format!("{} | {} | {}", num(m.units_per_s), num(p50), num(p99))
    };
    for p in &h.points {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} |",
            p.concurrency,
            cells(&p.transfers),
            cells(&p.holds_created),
            cells(&p.holds_captured)
        );
    }
    let _ = writeln!(
        md,
        "\nMoney {} before, {} after; pending debits {} and pending credits {} left (holds created but not captured in the window).\n",
        h.money_before, h.money_after, h.pending_debits_left, h.pending_credits_left
    );
}

fn legs_section(md: &mut String, l: &LegsResult) {
    let _ = writeln!(md, "## Multi-leg transfers beside plain ones\n");
    if !l.available {
        let reason = l.unavailable_reason.as_deref().unwrap_or("unknown");
        let _ = writeln!(md, "Not measured: {reason}.\n");
        return;
    }
    let _ = writeln!(
        md,
        "One service and database; at each concurrency, closed loop: plain transfers, then transfers of 2, 4 and 8 legs (each leg between random accounts: up to twice as many accounts as legs), then of 8 legs out of one account to 8 others (fan-out: 9 accounts). Per transfer: the database's commands, documents written and CPU (its own counters, over warm-up, window and drain). The goal: an 8-leg transfer costs less than 3 plain ones in commands and time.\n"
    );
    let _ = writeln!(
        md,
        "| c | legs | transfers/s | p50 ms | p99 ms | commands | documents written | database CPU ms | 8 legs / plain: commands, database CPU, time (plain/s ÷ these/s) |"
    );
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for p in &l.points {
        let (p50, p99) = p
            .measured
            .latency
            .as_ref()
            .map_or((f64::NAN, f64::NAN), |x| (x.p50_ms, x.p99_ms));
        let ratio = match (p.legs, l.plain(p.concurrency)) {
            (8, Some(plain)) => {
                let cpu = |q: &crate::legs::LegsPoint| {
                    q.work.database_cpu_ms_per_transfer.unwrap_or(f64::NAN)
                };
                format!(
                    "{} × , {} × , {} ×",
                    num(p.work.commands_per_transfer / plain.work.commands_per_transfer),
                    num(cpu(p) / cpu(plain)),
                    num(plain.measured.units_per_s / p.measured.units_per_s),
                )
            }
            _ => String::new(),
        };
        let _ = writeln!(
            md,
            "| {} | {}{} | {} | {} | {} | {} | {} | {} | {} |",
            p.concurrency,
            p.legs,
            if p.fan_out { " fan-out" } else { "" },
            num(p.measured.units_per_s),
            num(p50),
            num(p99),
            num(p.work.commands_per_transfer),
            num(p.work.documents_written_per_transfer),
            num(p.work.database_cpu_ms_per_transfer.unwrap_or(f64::NAN)),
            ratio
        );
    }
    let _ = writeln!(
        md,
        "\nMoney {} before, {} after; room left {}.\n",
        l.money_before, l.money_after, l.incoming_left
    );
}

fn deployments_section(md: &mut String, d: &DeploymentsResult) {
    let _ = writeln!(md, "## Deployments: transfers within one and across two\n");
    if !d.available {
        let reason = d.unavailable_reason.as_deref().unwrap_or("unknown");
        let _ = writeln!(md, "Not measured: {reason}.\n");
        return;
    }
    let _ = writeln!(
        md,
        "One service over two deployments (`eu`: the run's database; `us`: a second SecantusDB daemon), half the accounts on each. At each concurrency, closed loop over random pairs: within `eu`, then across (one account on each, either way). Per second; latency in ms of the successful answers; database commands per transfer on each deployment, as the service counted them.\n"
    );
    let _ = writeln!(
        md,
        "| c | within/s | p50 | p99 | commands eu + us | across/s | p50 | p99 | commands eu + us |"
    );
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let cells = |l: &crate::deployments::DeploymentsLoad| {
        let m = &l.measured;
        let (p50, p99) = m
            .latency
            .as_ref()
            .map_or((f64::NAN, f64::NAN), |x| (x.p50_ms, x.p99_ms));
        format!(
            "{} | {} | {} | {:.2} + {:.2}",
            num(m.units_per_s),
            num(p50),
            num(p99),
            l.commands_per_transfer[0],
            l.commands_per_transfer[1]
        )
    };
    for p in &d.points {
        let _ = writeln!(
            md,
            "| {} | {} | {} |",
            p.concurrency,
            cells(&p.within),
            cells(&p.across)
        );
    }
    if let (Some(down), Some(last)) = (&d.within_while_us_down, d.points.last()) {
        let _ = writeln!(
            md,
            "\nThen `us` was killed: transfers within `eu` at c={}: {} while `us` was down, against {} while it was up (p99 {} ms against {} ms); {} of them failed.",
            last.concurrency,
            num(down.measured.units_per_s),
            num(last.within.measured.units_per_s),
            num(down
                .measured
                .latency
                .as_ref()
                .map_or(f64::NAN, |x| x.p99_ms)),
            num(last
                .within
                .measured
                .latency
                .as_ref()
                .map_or(f64::NAN, |x| x.p99_ms)),
            down.measured.failures.total
        );
    }
    let _ = writeln!(
        md,
        "\nMoney {} before, {} after, over both deployments (the transfers within `eu` while `us` was down counted on `eu`).\n",
        d.money_before, d.money_after
    );
}

fn overload_section(md: &mut String, o: &OverloadResult) {
    let plan = &o.plan;
    let _ = writeln!(
        md,
        "## Overload: two-phase offered more than its capacity, open loop\n"
    );
    let capacity = o.capacity.as_ref().map_or(f64::NAN, |c| c.per_s);
    if let Some(c) = &o.capacity {
        let _ = writeln!(
            md,
            "Capacity: **{} transfers/s** ({}).\n",
            num(c.per_s),
            c.source
        );
    }
    let _ = writeln!(
        md,
        "Each scenario: a fresh service (`MAX_TRANSFERS_IN_FLIGHT={}`, `STALE_AFTER_MS={}`) and database, {} accounts, amount {}; `POST /transfers` sent by the clock at the offered rate for {} s, whatever the answers, between random pairs, at most {} requests in flight in the client (a send that finds no slot is not made: `client_dropped`). Goodput: transfers that ended `done` per second of burst (sync: 201 answers received during the burst; respond-async: 202 answers received during the burst whose transfer ended `done` in the database). All terminal: from the burst's end until every request answered and no transfer was `initial`, `pending`, `applied` or `canceling`. Peak RSS: the service's VmHWM (its process lived for the scenario only). Goals (not asserted): goodput ≥ {:.0}% of capacity, all terminal within {} s (the burst plus 2 × STALE_AFTER_MS), peak RSS < {} MiB; ✓ met, ✗ missed.\n",
        plan.max_transfers_in_flight,
        plan.stale_after_ms,
        num(plan.accounts as f64),
        plan.amount,
        plan.burst_s,
        num(plan.client_max_in_flight as f64),
        plan.goal_goodput_fraction * 100.0,
        plan.terminal_goal_s(),
        plan.goal_peak_rss_mib,
    );
    if !o.scenarios.is_empty() {
        let _ = writeln!(
            md,
            "| scenario | offered /s | goodput /s | goodput / capacity | answers by status | time to all terminal s | peak RSS MiB |\n|---|---:|---:|---:|---|---:|---:|"
        );
        let mark = |met: bool| if met { "✓" } else { "✗" };
        for s in &o.scenarios {
            let mut answers = answers_brief(&s.answers);
            if s.client_dropped > 0 {
                let _ = write!(answers, ", client_dropped: {}", s.client_dropped);
            }
            let _ = writeln!(
                md,
                "| {} | {} ({}× capacity) | {} | {} {} | {} | {} | {} |",
                s.name,
                num(s.offered_per_s),
                s.multiple,
                num(s.goodput_per_s),
                ratio(s.goodput_per_s, capacity),
                mark(s.goals.goodput_met),
                answers.replace('|', "\\|"),
                s.all_terminal_after_s.map_or(
                    format!(
                        "> {} ✗",
                        num(plan.terminal_goal_s() + plan.give_up_after_goal_s)
                    ),
                    |t| format!("{} {}", num(t), mark(s.goals.terminal_met))
                ),
                s.peak_rss_mib.map_or("–".into(), |p| format!(
                    "{} {}",
                    num(p),
                    s.goals.peak_rss_met.map_or("", mark)
                )),
            );
        }
        let _ = writeln!(md);
        for s in &o.scenarios {
            let _ = writeln!(
                md,
                "- {}: {} sends scheduled, {} sent, sender at most {} ms late, burst {} s; last answer {} s after it; accepted {} ({}); recorded {} ({}); money {} before, {} after; {} accounts with pendingTransactions; {} `503 overloaded` without Retry-After; server log: {} lines at warn or above{}.",
                s.name,
                num(s.scheduled as f64),
                num(s.sent as f64),
                num(s.sender_max_lag_ms),
                num(s.burst_s),
                s.last_answer_after_s.map_or("–".into(), num),
                num(s.accepted as f64),
                answers_brief(&s.accepted_end_states),
                num(s.recorded as f64),
                answers_brief(&s.recorded_by_state),
                s.money_before,
                s.money_after,
                s.accounts_with_pending,
                s.overloaded_without_retry_after,
                s.server_log_lines,
                {
                    let mut kinds: Vec<(&String, &u64)> = s.server_log_kinds.iter().collect();
                    kinds.sort_by(|a, b| b.1.cmp(a.1));
                    kinds
                        .iter()
                        .take(3)
                        .enumerate()
                        .map(|(i, (k, n))| {
                            format!(
                                "{} {} × `{}`",
                                if i == 0 { ":" } else { ";" },
                                num(**n as f64),
                                k.replace('`', "'")
                            )
                        })
                        .collect::<String>()
                },
            );
        }
        let _ = writeln!(md);
    }
    if let Some(e) = &o.error {
        let _ = writeln!(md, "Overload part failed: {e}\n");
    }
    let violations = o.violations();
    if violations.is_empty() {
        if !o.scenarios.is_empty() {
            let _ = writeln!(
                md,
                "No violation: in every scenario money was conserved, no account kept a pendingTransactions marker, every accepted transfer was in the database and terminal (every 201 `done`), and no refused request recorded a transfer.\n"
            );
        }
    } else {
        let _ = writeln!(md, "**VIOLATIONS:**\n");
        for v in violations {
            let _ = writeln!(md, "- **{v}**");
        }
        let _ = writeln!(md);
    }
}

fn storm_section(md: &mut String, r: &StormResult) {
    let plan = &r.plan;
    let _ = writeln!(md, "## Overload: a retry storm, closed loop\n");
    let _ = writeln!(
        md,
        "Each scenario: a fresh service (`MAX_TRANSFERS_IN_FLIGHT={}`, `STALE_AFTER_MS={}`, `ADMISSION_WAIT_MS={}`) and database, {} accounts, amount {}; each client, on its own keep-alive connection, sends `POST /transfers` between a random pair and, once answered, the next one, for {} s. A 503 `overloaded` is sent again: at once by the impatient clients (which ignore `Retry-After`, as naive retry loops and load tools do), after `Retry-After` by the polite ones. Capacity: the same client at {} connections, per mode. Done: transfers done per second of burst (sync: 201 answers received during the burst; respond-async: 202 answers received during the burst whose transfer ended `done`). Service CPU: its CPU seconds per second of burst (2 = both cores). Drain: from the burst's end until every request answered and no transfer was open. Goals (not asserted): done ≥ {:.0}% of the capacity of the same mode, drained within {} s (2 × STALE_AFTER_MS), peak RSS < {} MiB; ✓ met, ✗ missed.\n",
        plan.max_transfers_in_flight,
        plan.stale_after_ms,
        plan.admission_wait_ms
            .map_or("the default".to_owned(), |w| w.to_string()),
        num(plan.accounts as f64),
        plan.amount,
        plan.burst_s,
        plan.capacity_connections,
        plan.goal_done_fraction * 100.0,
        plan.drain_goal_s(),
        plan.goal_peak_rss_mib,
    );
    let mark = |met: bool| if met { "✓" } else { "✗" };
    if !r.scenarios.is_empty() {
        let _ = writeln!(
            md,
            "| scenario | done /s | / capacity | refused /s | service CPU /s | drain s | peak RSS MiB | answers |\n|---|---:|---:|---:|---:|---:|---:|---|"
        );
        for s in &r.scenarios {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                s.name,
                num(s.done_per_s),
                s.done_over_capacity
                    .map_or("(capacity)".into(), |c| format!(
                        "{} {}",
                        ratio(c, 1.0),
                        s.goals.done_met.map_or("", mark)
                    )),
                num(s.refused_per_s),
                s.server_cpu_per_s.map_or("–".into(), num),
                s.drain_s.map_or(
                    format!(
                        "> {} ✗",
                        num(plan.drain_goal_s() + plan.give_up_after_goal_s)
                    ),
                    |t| format!("{} {}", num(t), mark(s.goals.drain_met))
                ),
                s.peak_rss_mib.map_or("–".into(), |p| format!(
                    "{} {}",
                    num(p),
                    s.goals.peak_rss_met.map_or("", mark)
                )),
                answers_brief(&s.answers).replace('|', "\\|"),
            );
        }
        let _ = writeln!(md);
        for s in &r.scenarios {
            let _ = writeln!(
                md,
                "- {}: {} requests sent; last answer {} s after the burst; accepted {} ({}); recorded {} ({}); money {} before, {} after; {} accounts with pendingTransactions; {} `503 overloaded` without Retry-After; the benchmark's own CPU {} /s; server log: {} lines at warn or above.",
                s.name,
                num(s.sent as f64),
                s.last_answer_after_s.map_or("–".into(), num),
                num(s.accepted as f64),
                answers_brief(&s.accepted_end_states),
                num(s.recorded as f64),
                answers_brief(&s.recorded_by_state),
                s.money_before,
                s.money_after,
                s.accounts_with_pending,
                s.overloaded_without_retry_after,
                s.client_cpu_per_s.map_or("–".into(), num),
                s.server_log_lines,
            );
        }
        let _ = writeln!(md);
    }
    if let Some(e) = &r.error {
        let _ = writeln!(md, "Storm part failed: {e}\n");
    }
    let violations = r.violations();
    if violations.is_empty() {
        if !r.scenarios.is_empty() {
            let _ = writeln!(
                md,
                "No violation: in every scenario money was conserved, no account kept a pendingTransactions marker, every accepted transfer was in the database and terminal (every 201 `done`), and no refused request recorded a transfer.\n"
            );
        }
    } else {
        let _ = writeln!(md, "**VIOLATIONS:**\n");
        for v in violations {
            let _ = writeln!(md, "- **{v}**");
        }
        let _ = writeln!(md);
    }
}

fn failure_line(label: &str, f: &Failures) -> String {
    let mut line = format!("- {label}: {}", f.brief());
    for (kind, samples) in &f.samples {
        if let Some(body) = samples.first() {
            let _ = write!(
                line,
                "; first `{kind}` answer: `{}`",
                body.replace('`', "'").replace('\n', " ")
            );
        }
    }
    line
}

// ---------------------------------------------------------------------------------------
// The plot.

struct Panel {
    x: f64,
    y: f64,
    w: f64,
    h: f64,
    lo: f64,
    hi: f64,
    cmin: f64,
    cmax: f64,
}

impl Panel {
    fn px(&self, c: f64) -> f64 {
        let (a, b) = (self.cmin.log2(), self.cmax.log2());
        let (a, b) = if b > a { (a, b) } else { (a - 0.5, b + 0.5) };
        self.x + (c.log2() - a) / (b - a) * self.w
    }

    fn py(&self, v: f64) -> f64 {
        let (a, b) = (self.lo.log10(), self.hi.log10());
        self.y + self.h - (v.max(self.lo).log10() - a) / (b - a) * self.h
    }
}

/// Decade bounds around `values` for a log axis.
fn log_bounds(values: &[f64]) -> (f64, f64) {
    let finite: Vec<f64> = values
        .iter()
        .copied()
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    if finite.is_empty() {
        return (1.0, 10.0);
    }
    let min = finite.iter().copied().fold(f64::INFINITY, f64::min);
    let max = finite.iter().copied().fold(0.0, f64::max);
    let lo = 10f64.powf(min.log10().floor());
    let mut hi = 10f64.powf(max.log10().ceil());
    if hi <= lo {
        hi = lo * 10.0;
    }
    (lo, hi)
}

fn tick_label(v: f64) -> String {
    if v >= 1000.0 {
        let k = v / 1000.0;
        if k.fract() == 0.0 {
            format!("{k:.0}k")
        } else {
            format!("{k}k")
        }
    } else if v >= 1.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn axes(svg: &mut String, p: &Panel, title: &str, ylabel: &str, cs: &[usize]) {
    let _ = writeln!(
        svg,
        r##"<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#333"/>"##,
        p.x, p.y, p.w, p.h
    );
    let _ = writeln!(
        svg,
        r##"<text x="{}" y="{}" text-anchor="middle" font-size="16" font-weight="bold">{}</text>"##,
        p.x + p.w / 2.0,
        p.y - 12.0,
        escape(title)
    );
    let mut decade = p.lo;
    while decade <= p.hi * 1.0001 {
        for m in [1.0, 2.0, 5.0] {
            let v = decade * m;
            if v > p.hi * 1.0001 {
                break;
            }
            let y = p.py(v);
            let _ = writeln!(
                svg,
                r##"<line x1="{}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="{}"/>"##,
                p.x,
                p.x + p.w,
                if m == 1.0 { "#ccc" } else { "#eee" }
            );
            let _ = writeln!(
                svg,
                r##"<text x="{}" y="{:.1}" text-anchor="end" font-size="13">{}</text>"##,
                p.x - 6.0,
                y + 4.0,
                tick_label(v)
            );
        }
        decade *= 10.0;
    }
    for &c in cs {
        let x = p.px(c as f64);
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{}" x2="{x:.1}" y2="{}" stroke="#eee"/>"##,
            p.y,
            p.y + p.h
        );
        let _ = writeln!(
            svg,
            r##"<text x="{x:.1}" y="{}" text-anchor="middle" font-size="13">{c}</text>"##,
            p.y + p.h + 18.0
        );
    }
    let _ = writeln!(
        svg,
        r##"<text x="{}" y="{}" text-anchor="middle" font-size="14">concurrent clients (log scale)</text>"##,
        p.x + p.w / 2.0,
        p.y + p.h + 40.0
    );
    let (lx, ly) = (p.x - 58.0, p.y + p.h / 2.0);
    let _ = writeln!(
        svg,
        r##"<text x="{lx}" y="{ly}" text-anchor="middle" font-size="14" transform="rotate(-90 {lx} {ly})">{}</text>"##,
        escape(ylabel)
    );
}

struct Series<'a> {
    label: String,
    color: &'static str,
    dash: &'static str,
    points: Vec<&'a Point>,
}

fn series(r: &Results) -> Vec<Series<'_>> {
    let mut out = Vec::new();
    for (name, color) in [("two-phase", "#1f5fbf"), ("native", "#d9480f")] {
        let Some(s) = strategy(r, name) else { continue };
        for (workload, dash) in [("uniform", ""), ("hot", "7 5")] {
            let points: Vec<&Point> = s.points.iter().filter(|p| p.workload == workload).collect();
            if !points.is_empty() {
                out.push(Series {
                    label: format!("{name}, {workload} accounts"),
                    color,
                    dash,
                    points,
                });
            }
        }
    }
    out
}

fn polyline(svg: &mut String, p: &Panel, s: &Series, value: impl Fn(&Point) -> f64) {
    let coords: Vec<(f64, f64)> = s
        .points
        .iter()
        .filter(|pt| value(pt).is_finite() && value(pt) > 0.0)
        .map(|pt| (p.px(pt.measured.concurrency as f64), p.py(value(pt))))
        .collect();
    let path: Vec<String> = coords
        .iter()
        .map(|(x, y)| format!("{x:.1},{y:.1}"))
        .collect();
    let _ = writeln!(
        svg,
        r##"<polyline points="{}" fill="none" stroke="{}" stroke-width="2.5" stroke-dasharray="{}"/>"##,
        path.join(" "),
        s.color,
        s.dash
    );
    for (x, y) in coords {
        let _ = writeln!(
            svg,
            r##"<circle cx="{x:.1}" cy="{y:.1}" r="4" fill="{}"/>"##,
            s.color
        );
    }
}

pub fn plot(r: &Results) -> String {
    let cs = concurrencies(r);
    let all = series(r);
    let (cmin, cmax) = (
        cs.first().copied().unwrap_or(1) as f64,
        cs.last().copied().unwrap_or(128) as f64,
    );
    let ceiling = ceiling(r);
    let mut tps_values: Vec<f64> = all
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.measured.units_per_s))
        .collect();
    tps_values.push(ceiling);
    if let Some(l) = &r.limit {
        tps_values.push(l.distinct_guarded_ceiling_per_s);
    }
    let p99_values: Vec<f64> = all
        .iter()
        .flat_map(|s| {
            s.points
                .iter()
                .map(|p| p.measured.latency.as_ref().map_or(f64::NAN, |l| l.p99_ms))
        })
        .collect();
    let (w, h) = (1100.0, 560.0);
    let (t_lo, t_hi) = log_bounds(&tps_values);
    let (l_lo, l_hi) = log_bounds(&p99_values);
    let left = Panel {
        x: 90.0,
        y: 70.0,
        w: 430.0,
        h: 340.0,
        lo: t_lo,
        hi: t_hi,
        cmin,
        cmax,
    };
    let right = Panel {
        x: 640.0,
        lo: l_lo,
        hi: l_hi,
        ..left
    };
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="Helvetica, Arial, sans-serif">"##
    );
    let _ = writeln!(
        svg,
        r##"<rect width="{w}" height="{h}" fill="white"/>
<text x="{}" y="28" text-anchor="middle" font-size="18">transfer-service through its HTTP API, {}{}</text>"##,
        w / 2.0,
        escape(&r.started_at),
        if r.quick { " (quick run)" } else { "" }
    );
    axes(
        &mut svg,
        &left,
        "Throughput",
        "transfers per second (log scale)",
        &cs,
    );
    axes(
        &mut svg,
        &right,
        "p99 latency",
        "milliseconds (log scale)",
        &cs,
    );
    if ceiling.is_finite() && ceiling > 0.0 {
        let y = left.py(ceiling);
        let _ = writeln!(
            svg,
            r##"<line x1="{}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#2b8a3e" stroke-width="2" stroke-dasharray="3 4"/>
<text x="{}" y="{:.1}" text-anchor="end" font-size="13" fill="#2b8a3e">limit: {} transfers/s</text>"##,
            left.x,
            left.x + left.w,
            left.x + left.w - 6.0,
            y - 6.0,
            num(ceiling)
        );
    }
    let distinct = r
        .limit
        .as_ref()
        .map_or(f64::NAN, |l| l.distinct_guarded_ceiling_per_s);
    if distinct.is_finite() && distinct > 0.0 && distinct < ceiling {
        let y = left.py(distinct);
        let _ = writeln!(
            svg,
            r##"<line x1="{}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#8fbf9a" stroke-width="2" stroke-dasharray="2 6"/>
<text x="{}" y="{:.1}" text-anchor="start" font-size="12" fill="#5c8f68">without update_many: {}/s</text>"##,
            left.x,
            left.x + left.w,
            left.x + 6.0,
            y + 15.0,
            num(distinct)
        );
    }
    for s in &all {
        polyline(&mut svg, &left, s, |p| p.measured.units_per_s);
        polyline(&mut svg, &right, s, |p| {
            p.measured.latency.as_ref().map_or(f64::NAN, |l| l.p99_ms)
        });
    }
    // Legend, under both panels.
    let mut entries: Vec<(String, &str, &str)> = all
        .iter()
        .map(|s| (s.label.clone(), s.color, s.dash))
        .collect();
    if ceiling.is_finite() && ceiling > 0.0 {
        entries.push((
            "limit: best database writes/s ÷ 8 writes per transfer".into(),
            "#2b8a3e",
            "3 4",
        ));
    }
    for (i, (label, color, dash)) in entries.iter().enumerate() {
        let x = 90.0 + (i % 2) as f64 * 520.0;
        let y = 485.0 + (i / 2) as f64 * 24.0;
        let _ = writeln!(
            svg,
            r##"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{color}" stroke-width="2.5" stroke-dasharray="{dash}"/>
<text x="{}" y="{}" font-size="14">{}</text>"##,
            x + 40.0,
            x + 50.0,
            y + 5.0,
            escape(label)
        );
    }
    let _ = writeln!(svg, "</svg>");
    svg
}
