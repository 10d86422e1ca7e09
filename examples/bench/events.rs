//! Part 10: events. Transfers per second at `concurrency` over uniform accounts, with
//! nobody following the events ("none"), then with one webhook registered (for
//! `transfer.done`, to a receiver in this process that answers 204 at once) and one event
//! stream open from the feed's end and read ("followed"); the two alternate `rounds` times, each round's
//! webhook and stream removed before the next "none". For each "followed" run, once its
//! transfers' webhooks have all arrived (or `settle_timeout_s` passed): the delay from a
//! transfer's answer to its webhook's arrival (p50, p99), webhooks that never came, and
//! events that came twice. The event recorder runs in both (it always does).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::driver::{Outcome, closed_loop};
use crate::service::{Context, open_accounts, random_pair, transfer_body};
use crate::stats::{Latency, summarize};
use crate::work::snapshot;

#[derive(Debug, Clone, Serialize)]
pub struct EventsPlan {
    pub concurrency: usize,
    pub accounts: usize,
    pub warmup_s: f64,
    pub window_s: f64,
    /// "none" and "followed" runs, alternating, this many of each.
    pub rounds: usize,
    pub opening_balance: i64,
    pub amount: i64,
    /// How long, after a "followed" run, its webhooks may take to arrive.
    pub settle_timeout_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct EventsResult {
    pub available: bool,
    pub unavailable_reason: Option<String>,
    pub plan: EventsPlan,
    /// Transfers/s of each run, in the order run.
    pub none_per_s: Vec<f64>,
    pub followed_per_s: Vec<f64>,
    /// Mean of "followed" over mean of "none" (the goal: at least 0.9).
    pub ratio: Option<f64>,
    /// From a transfer's 201 to its webhook's arrival, over every "followed" run.
    pub webhook_delay: Option<Latency>,
    /// Transfers answered `done` in the "followed" runs, and their webhooks received.
    pub followed_done: u64,
    pub webhooks_received: u64,
    /// Done transfers whose webhook had not come by the settle time-out.
    pub webhooks_missing: u64,
    /// Webhooks received more than once (delivery is at least once).
    pub webhooks_repeated: u64,
    /// Events the open stream received.
    pub stream_events: u64,
    pub failed_requests: u64,
    pub seconds: f64,
}

impl EventsResult {
    /// Webhooks that never came.
    pub fn violations(&self) -> Vec<String> {
        if self.webhooks_missing > 0 {
            vec![format!(
                "events: {} done transfers' webhooks did not arrive within {} s",
                self.webhooks_missing, self.plan.settle_timeout_s
            )]
        } else {
            Vec::new()
        }
    }
}

/// When each transfer was answered, and each webhook arrived (by `webhook-id`).
#[derive(Default)]
struct Times {
    answered: HashMap<String, Instant>,
    arrived: HashMap<String, Vec<Instant>>,
}

pub async fn run(ctx: &Context, plan: &EventsPlan) -> EventsResult {
    let started = Instant::now();
    let mut result = EventsResult {
        available: false,
        unavailable_reason: None,
        plan: plan.clone(),
        none_per_s: Vec::new(),
        followed_per_s: Vec::new(),
        ratio: None,
        webhook_delay: None,
        followed_done: 0,
        webhooks_received: 0,
        webhooks_missing: 0,
        webhooks_repeated: 0,
        stream_events: 0,
        failed_requests: 0,
        seconds: 0.0,
    };
    let database = format!("{}_events", ctx.db_prefix);
    let log = ctx.out.join("server-events.log");
    eprintln!("[events] starting the service (database {database})");
    let env = [("WEBHOOK_ALLOW_PRIVATE", "true".to_owned())];
    let server = match ctx.start_service(&database, &log, &env).await {
        Ok(server) => server,
        Err(said) => {
            result.unavailable_reason = Some(said);
            return result;
        }
    };
    let ids: Arc<Vec<String>> = Arc::new(
        (0..plan.accounts)
            .map(|i| format!("events-{i:05}"))
            .collect(),
    );
    if let Err(e) = open_accounts(&ctx.http, &server.base, &ids, plan.opening_balance).await {
        result.unavailable_reason = Some(format!("could not open the accounts: {e}"));
        return result;
    }
    let times = Arc::new(Mutex::new(Times::default()));
    let receiver = match receive(times.clone()).await {
        Ok(address) => address,
        Err(e) => {
            result.unavailable_reason = Some(format!("no webhook receiver: {e}"));
            return result;
        }
    };
    result.available = true;
    let url: Arc<str> = format!("{}/transfers", server.base).into();
    let mut delays = Vec::new();
    let mut end: Option<String> = None;
    for round in 0..plan.rounds {
        let none = load(
            ctx,
            plan,
            &url,
            &ids,
            None,
            (&database, &server.base, server.pid()),
        )
        .await;
        result.failed_requests += none.1;
        result.none_per_s.push(none.0);
        eprintln!(
            "[events] round {round}: none      {:.1} transfers/s",
            none.0
        );

        let hook = match register(ctx, &server.base, receiver).await {
            Ok(hook) => hook,
            Err(e) => {
                result.unavailable_reason = Some(e);
                break;
            }
        };
        // The stream follows live events, as a frontend's does: it opens at the feed's
        // end (a stream from the front would first replay every earlier round).
        end = feed_end(ctx, &server.base, end).await;
        let counted = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let stream = follow(
            ctx.http.clone(),
            match &end {
                Some(cursor) => format!("{}/events/stream?after={cursor}", server.base),
                None => format!("{}/events/stream", server.base),
            },
            counted.clone(),
        );
        let followed = load(
            ctx,
            plan,
            &url,
            &ids,
            Some(times.clone()),
            (&database, &server.base, server.pid()),
        )
        .await;
        result.failed_requests += followed.1;
        result.followed_per_s.push(followed.0);
        eprintln!(
            "[events] round {round}: followed  {:.1} transfers/s",
            followed.0
        );
        // Every webhook of the run, or the time-out.
        let deadline = Instant::now() + Duration::from_secs_f64(plan.settle_timeout_s);
        loop {
            let all = {
                let t = times.lock().unwrap();
                t.answered
                    .keys()
                    .all(|id| t.arrived.contains_key(&format!("transfer.done:{id}")))
            };
            if all || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stream.abort();
        result.stream_events += counted.load(std::sync::atomic::Ordering::Relaxed);
        let t = std::mem::take(&mut *times.lock().unwrap());
        result.followed_done += t.answered.len() as u64;
        for (id, answered) in &t.answered {
            match t.arrived.get(&format!("transfer.done:{id}")) {
                Some(arrivals) => {
                    result.webhooks_received += 1;
                    if arrivals.len() > 1 {
                        result.webhooks_repeated += 1;
                    }
                    delays.push(arrivals[0].saturating_duration_since(*answered));
                }
                None => result.webhooks_missing += 1,
            }
        }
        let _ = ctx
            .http
            .delete(format!("{}/webhooks/{hook}", server.base))
            .send()
            .await;
    }
    let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    if let (Some(n), Some(f)) = (mean(&result.none_per_s), mean(&result.followed_per_s)) {
        result.ratio = Some(f / n);
    }
    result.webhook_delay = summarize(delays);
    let l = |f: fn(&Latency) -> f64| result.webhook_delay.as_ref().map_or(f64::NAN, f);
    eprintln!(
        "[events] followed / none {:.2}; webhook delay p50 {:.1} p99 {:.1} ms; {} done, {} webhooks, {} missing, {} repeated; the stream got {} events",
        result.ratio.unwrap_or(f64::NAN),
        l(|x| x.p50_ms),
        l(|x| x.p99_ms),
        result.followed_done,
        result.webhooks_received,
        result.webhooks_missing,
        result.webhooks_repeated,
        result.stream_events,
    );
    server.stop().await;
    result.seconds = started.elapsed().as_secs_f64();
    result
}

/// One closed-loop run; transfers/s and failed requests. With `times`, each done
/// transfer's answer time is kept.
async fn load(
    ctx: &Context,
    plan: &EventsPlan,
    url: &Arc<str>,
    ids: &Arc<Vec<String>>,
    times: Option<Arc<Mutex<Times>>>,
    (database, base, pid): (&str, &str, u32),
) -> (f64, u64) {
    let counted = snapshot(&ctx.mongo, database, &ctx.http, base, pid, ctx.daemon_pid).await;
    let client_cpu = crate::procs::sample(std::process::id()).map(|s| s.cpu_seconds);
    let (http, url, ids, amount) = (ctx.http.clone(), url.clone(), ids.clone(), plan.amount);
    let measured = closed_loop(
        plan.concurrency,
        Duration::from_secs_f64(plan.warmup_s),
        Duration::from_secs_f64(plan.window_s),
        move |_, _| {
            let (http, url, ids, times) = (http.clone(), url.clone(), ids.clone(), times.clone());
            async move {
                let (source, destination) = random_pair(&ids);
                let body = transfer_body(source, destination, amount);
                let answer = http
                    .post(&*url)
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .body(body)
                    .send()
                    .await;
                let response = match answer {
                    Ok(r) => r,
                    Err(e) => {
                        return Outcome::Failed {
                            kind: "transport".into(),
                            detail: e.to_string(),
                        };
                    }
                };
                let status = response.status().as_u16();
                let at = Instant::now();
                let body: serde_json::Value = response.json().await.unwrap_or_default();
                if status != 201 {
                    return Outcome::Failed {
                        kind: format!("{status}"),
                        detail: body.to_string(),
                    };
                }
                if let (Some(times), Some(id)) = (times, body["id"].as_str()) {
                    times.lock().unwrap().answered.insert(id.to_owned(), at);
                }
                Outcome::Ok { units: 1 }
            }
        },
    )
    .await;
    let work = snapshot(&ctx.mongo, database, &ctx.http, base, pid, ctx.daemon_pid)
        .await
        .since(&counted, measured.sent);
    let client_cpu = crate::procs::sample(std::process::id())
        .zip(client_cpu)
        .map(|(now, then)| (now.cpu_seconds - then) * 1000.0 / measured.sent.max(1) as f64);
    eprintln!(
        "[events]   {}, CPU of this benchmark's process {:.3} ms",
        work.brief(),
        client_cpu.unwrap_or(f64::NAN)
    );
    eprintln!("[events]   {}", work.brief_time());
    (measured.units_per_s, measured.failures.total)
}

/// Registers a webhook for `transfer.done` to the receiver; its id.
async fn register(
    ctx: &Context,
    base: &str,
    receiver: std::net::SocketAddr,
) -> Result<String, String> {
    let answer = ctx
        .http
        .post(format!("{base}/webhooks"))
        .json(&serde_json::json!({
            "url": format!("http://{receiver}/hooks"),
            "types": ["transfer.done"],
        }))
        .send()
        .await
        .map_err(|e| format!("POST /webhooks: {e}"))?;
    let status = answer.status().as_u16();
    let body: serde_json::Value = answer.json().await.unwrap_or_default();
    match (status, body["id"].as_str()) {
        (201, Some(id)) => Ok(id.to_owned()),
        _ => Err(format!("POST /webhooks answered {status}: {body}")),
    }
}

/// The cursor at the feed's end now, read page by page from `from` (the front when
/// `None`).
async fn feed_end(ctx: &Context, base: &str, from: Option<String>) -> Option<String> {
    let mut cursor = from;
    loop {
        let url = match &cursor {
            Some(c) => format!("{base}/events?limit=1000&after={c}"),
            None => format!("{base}/events?limit=1000"),
        };
        let page: serde_json::Value = ctx.http.get(url).send().await.ok()?.json().await.ok()?;
        let read = page["items"].as_array().map_or(0, Vec::len);
        cursor = page["next"].as_str().map(str::to_owned).or(cursor);
        if read < 1000 {
            return cursor;
        }
    }
}

/// Reads the event stream until the task is aborted, counting the events in `counted`.
fn follow(
    http: reqwest::Client,
    url: String,
    counted: Arc<std::sync::atomic::AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let Ok(mut response) = http.get(url).send().await else {
            return;
        };
        while let Ok(Some(chunk)) = response.chunk().await {
            let events = chunk
                .split(|&b| b == b'\n')
                .filter(|l| l.starts_with(b"event:"))
                .count();
            counted.fetch_add(events as u64, std::sync::atomic::Ordering::Relaxed);
        }
    })
}

/// A receiver of webhooks on a free local port: records each arrival by `webhook-id`
/// and answers 204 at once.
async fn receive(times: Arc<Mutex<Times>>) -> std::io::Result<std::net::SocketAddr> {
    use axum::http::{HeaderMap, StatusCode};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/hooks",
        axum::routing::post(move |headers: HeaderMap| {
            let times = times.clone();
            async move {
                let at = Instant::now();
                if let Some(id) = headers.get("webhook-id").and_then(|v| v.to_str().ok()) {
                    times
                        .lock()
                        .unwrap()
                        .arrived
                        .entry(id.to_owned())
                        .or_default()
                        .push(at);
                }
                StatusCode::NO_CONTENT
            }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(address)
}
