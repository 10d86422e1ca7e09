//! Load generators: closed loop (N workers, each sends its next request when the last one
//! answered) and open loop (requests sent by the clock, whatever the answers do).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::Semaphore;

use crate::stats::{Failures, Latency, summarize};

/// What one request came to.
pub enum Outcome {
    /// It did what it should; `units` of work (1 for a transfer, N for a bulk write).
    Ok { units: u64 },
    /// Anything else: `kind` is what is tallied (`"422 insufficient_funds"`), `detail`
    /// the answer body or error text.
    Failed { kind: String, detail: String },
}

/// One closed-loop measurement.
#[derive(Debug, Clone, Serialize)]
pub struct Measured {
    pub concurrency: usize,
    pub window_s: f64,
    /// Successful requests that finished inside the window.
    pub ok_in_window: u64,
    /// Units of work of those requests, per second of window.
    pub units_per_s: f64,
    /// Latency of the successful requests that finished inside the window.
    pub latency: Option<Latency>,
    /// Every request sent, warm-up and drain included.
    pub sent: u64,
    /// Every failed request, warm-up and drain included.
    pub failures: Failures,
}

/// `concurrency` workers call `op(worker, seq)` back to back for `warmup + window`;
/// what finishes inside the window is measured. Then the in-flight requests are awaited.
pub async fn closed_loop<F, Fut>(
    concurrency: usize,
    warmup: Duration,
    window: Duration,
    op: F,
) -> Measured
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Outcome> + Send + 'static,
{
    let op = Arc::new(op);
    let start = Instant::now() + warmup;
    let end = start + window;
    let mut workers = Vec::with_capacity(concurrency);
    for worker in 0..concurrency {
        let op = Arc::clone(&op);
        workers.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut units = 0u64;
            let mut failures = Failures::default();
            let mut seq = 0u64;
            while Instant::now() < end {
                let sent_at = Instant::now();
                let outcome = op(worker, seq).await;
                seq += 1;
                let done = Instant::now();
                match outcome {
                    Outcome::Ok { units: u } => {
                        if done >= start && done <= end {
                            latencies.push(done - sent_at);
                            units += u;
                        }
                    }
                    Outcome::Failed { kind, detail } => failures.add(&kind, &detail),
                }
            }
            (latencies, units, failures, seq)
        }));
    }
    let mut latencies = Vec::new();
    let mut units = 0;
    let mut failures = Failures::default();
    let mut sent = 0;
    for worker in workers {
        let (l, u, f, s) = worker.await.expect("worker panicked");
        latencies.extend(l);
        units += u;
        failures.merge(f);
        sent += s;
    }
    Measured {
        concurrency,
        window_s: window.as_secs_f64(),
        ok_in_window: latencies.len() as u64,
        units_per_s: units as f64 / window.as_secs_f64(),
        latency: summarize(latencies),
        sent,
        failures,
    }
}

/// One open-loop run.
#[derive(Debug, Clone, Serialize)]
pub struct OpenMeasured {
    pub scheduled: usize,
    pub rate_per_s: f64,
    /// Time over which the sends were scheduled (count / rate).
    pub arrivals_s: f64,
    pub ok: u64,
    pub failures: Failures,
    /// Requests with no answer when the benchmark gave up waiting.
    pub unanswered: u64,
    /// From the first scheduled send to the last answer; None if some never answered.
    pub completion_s: Option<f64>,
    /// Latency of the successful requests, from their *scheduled* send time (so time
    /// spent queued behind a slow service counts: no coordinated omission).
    pub latency: Option<Latency>,
    /// Requests in flight at most at once (client side); more wait for a slot, and the
    /// wait counts in their latency.
    pub max_in_flight: usize,
    /// How late the sender fired after a request's scheduled time, at worst.
    pub max_send_lag_ms: f64,
}

/// Sends `count` requests at `rate` a second by the clock: request `i` is due at
/// `i / rate` s after the start, whether or not earlier ones answered. Gives up on what
/// has not answered `give_up_after` the last scheduled send.
pub async fn open_loop<F, Fut>(
    count: usize,
    rate: f64,
    max_in_flight: usize,
    give_up_after: Duration,
    op: F,
) -> OpenMeasured
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Outcome> + Send + 'static,
{
    let op = Arc::new(op);
    let slots = Arc::new(Semaphore::new(max_in_flight));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Instant, Outcome)>();
    let t0 = Instant::now() + Duration::from_millis(50);
    let mut tasks = tokio::task::JoinSet::new();
    let mut max_lag = Duration::ZERO;
    for i in 0..count {
        let due = t0 + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(due.into()).await;
        max_lag = max_lag.max(Instant::now().saturating_duration_since(due));
        let (op, slots, tx) = (Arc::clone(&op), Arc::clone(&slots), tx.clone());
        tasks.spawn(async move {
            let _slot = slots.acquire_owned().await.expect("semaphore open");
            let outcome = op(i).await;
            let _ = tx.send((due, Instant::now(), outcome));
        });
    }
    drop(tx);
    let last_due = t0 + Duration::from_secs_f64(count.saturating_sub(1) as f64 / rate);
    let give_up = last_due + give_up_after;
    let mut latencies = Vec::with_capacity(count);
    let mut failures = Failures::default();
    let mut last_answer = t0;
    let mut answered = 0usize;
    while answered < count {
        let Ok(Some((due, done, outcome))) =
            tokio::time::timeout_at(give_up.into(), rx.recv()).await
        else {
            break;
        };
        answered += 1;
        last_answer = last_answer.max(done);
        match outcome {
            Outcome::Ok { .. } => latencies.push(done - due),
            Outcome::Failed { kind, detail } => failures.add(&kind, &detail),
        }
    }
    tasks.abort_all();
    let unanswered = (count - answered) as u64;
    OpenMeasured {
        scheduled: count,
        rate_per_s: rate,
        arrivals_s: count as f64 / rate,
        ok: latencies.len() as u64,
        failures,
        unanswered,
        completion_s: (unanswered == 0).then(|| (last_answer - t0).as_secs_f64()),
        latency: summarize(latencies),
        max_in_flight,
        max_send_lag_ms: max_lag.as_secs_f64() * 1000.0,
    }
}
