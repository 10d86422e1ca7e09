//! Prometheus metrics: counters and histograms kept in this process's memory, written
//! out by `GET /metrics` in the text exposition format, version 0.0.4.
//!
//! Hand-written rather than pulled from a metrics crate: six families with fixed
//! buckets, and the format is a few lines of text.
//!
//! | family | type | labels |
//! |---|---|---|
//! | `http_requests_total` | counter | `method`, `route`, `status` |
//! | `http_request_duration_seconds` | histogram | `method`, `route` |
//! | `transfers_total` | counter | `state` (`done`, `canceled`), `reason` (`none` for done) |
//! | `transfers_in_flight` | gauge | |
//! | `sweeper_recoveries_total` | counter | |
//! | `db_operation_duration_seconds` | histogram | `command`, `outcome` (`ok`, `error`) |
//!
//! Invariant: every label value comes from a bounded set, whatever clients send, so the
//! number of series stays bounded. A route is the matched route template
//! (`/transfers/{id}`), never the raw path, and `unmatched` when no route matched; a
//! method outside the standard ones is `other`; states and reasons are the domain's
//! enums; commands are the MongoDB command names this service's own code issues.
//!
//! The values are process-wide (one set per process, as Prometheus expects from a
//! scrape target) and start at zero when the process starts.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard};
use std::time::Duration;

use crate::domain::{CancelReason, TransferState};

/// Upper bounds of the HTTP latency buckets, in seconds. A transfer answers in
/// milliseconds; the top bucket is the request time-out.
const HTTP_BUCKETS_SECONDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Upper bounds of the database latency buckets, in seconds. A majority+journal write
/// takes about a millisecond on one node; the top buckets catch fail-overs.
const DB_BUCKETS_SECONDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// The methods that get their own label value; anything else is `other`, so a client
/// inventing methods cannot create series.
const KNOWN_METHODS: &[&str] = &[
    "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT",
];

/// The `route` label of a request no route matched.
pub const UNMATCHED_ROUTE: &str = "unmatched";

/// Observations bucketed by fixed upper bounds.
#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    /// Observations per bucket, not cumulative: `counts[i]` holds those in
    /// `(bounds[i-1], bounds[i]]`, the last one those above every bound.
    counts: Vec<u64>,
    sum_seconds: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum_seconds: 0.0,
        }
    }

    fn observe(&mut self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        let bucket = self
            .bounds
            .iter()
            .position(|&bound| seconds <= bound)
            .unwrap_or(self.bounds.len());
        self.counts[bucket] += 1;
        self.sum_seconds += seconds;
    }

    /// Writes the `_bucket`, `_sum` and `_count` lines; `labels` is `a="x",b="y"`.
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (i, count) in self.counts.iter().enumerate() {
            cumulative += count;
            let le = match self.bounds.get(i) {
                Some(bound) => bound.to_string(),
                None => "+Inf".to_owned(),
            };
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum_seconds);
        let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
    }
}

/// The HTTP series, under one lock: a request updates both families at once.
#[derive(Default)]
struct HttpSeries {
    /// (method, route, status) -> requests.
    requests: BTreeMap<(&'static str, String, u16), u64>,
    /// (method, route) -> latency.
    durations: BTreeMap<(&'static str, String), Histogram>,
}

/// Every series with labels. Locks are held only to bump a number or to render.
struct Registry {
    http: Mutex<HttpSeries>,
    /// (state, reason) -> transfers that reached that terminal state in this process.
    transfers: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    /// (command, outcome) -> latency of the driver's commands.
    db: Mutex<BTreeMap<(String, &'static str), Histogram>>,
}

static REGISTRY: LazyLock<Registry> = LazyLock::new(|| {
    // Every terminal outcome is listed from the start, at 0, so that a rate over it
    // is defined before the first transfer ends that way.
    let mut transfers = BTreeMap::new();
    transfers.insert((TransferState::Done.as_str(), "none"), 0);
    for reason in CancelReason::ALL {
        transfers.insert((TransferState::Canceled.as_str(), reason.as_str()), 0);
    }
    Registry {
        http: Mutex::default(),
        transfers: Mutex::new(transfers),
        db: Mutex::default(),
    }
});

/// Transfers this process is driving right now.
static IN_FLIGHT: AtomicI64 = AtomicI64::new(0);

/// A panic elsewhere while a lock was held leaves plain numbers behind, still usable.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

fn method_label(method: &str) -> &'static str {
    KNOWN_METHODS
        .iter()
        .find(|&&known| known == method)
        .copied()
        .unwrap_or("other")
}

/// Records one answered HTTP request. `route` is the matched route template, `None` when
/// no route matched.
pub fn http_request(method: &str, route: Option<&str>, status: u16, elapsed: Duration) {
    let method = method_label(method);
    let route = route.unwrap_or(UNMATCHED_ROUTE);
    let mut http = lock(&REGISTRY.http);
    *http
        .requests
        .entry((method, route.to_owned(), status))
        .or_default() += 1;
    http.durations
        .entry((method, route.to_owned()))
        .or_insert_with(|| Histogram::new(HTTP_BUCKETS_SECONDS))
        .observe(elapsed);
}

/// Records a transfer that this process took to a terminal state: call it once, where
/// the guarded write to `done` or `canceled` won. Non-terminal states are ignored.
pub fn transfer_finished(state: TransferState, reason: Option<CancelReason>) {
    let reason = match state {
        TransferState::Done => "none",
        TransferState::Canceled => reason.map_or("unknown", CancelReason::as_str),
        _ => return,
    };
    *lock(&REGISTRY.transfers)
        .entry((state.as_str(), reason))
        .or_default() += 1;
}

/// Counts a transfer as in flight while it lives: hold one while driving a transfer.
#[must_use = "the transfer counts as in flight only while the guard lives"]
#[derive(Debug)]
pub struct InFlightTransfer(());

impl InFlightTransfer {
    pub fn enter() -> InFlightTransfer {
        IN_FLIGHT.fetch_add(1, Ordering::Relaxed);
        InFlightTransfer(())
    }
}

impl Drop for InFlightTransfer {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Records one database command, as the driver timed it (round trip included).
pub fn db_operation(command: &str, succeeded: bool, elapsed: Duration) {
    let outcome = if succeeded { "ok" } else { "error" };
    lock(&REGISTRY.db)
        .entry((command.to_owned(), outcome))
        .or_insert_with(|| Histogram::new(DB_BUCKETS_SECONDS))
        .observe(elapsed);
}

/// A label value with `\`, `"` and newlines escaped, as the format requires.
fn escape(value: &str) -> String {
    let mut escaped = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => escaped.push_str("\\\\"),
            '"' => escaped.push_str("\\\""),
            '\n' => escaped.push_str("\\n"),
            c => escaped.push(c),
        }
    }
    escaped
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Every family in the Prometheus text format, version 0.0.4.
pub fn render() -> String {
    let mut out = String::with_capacity(8 * 1024);
    {
        let http = lock(&REGISTRY.http);
        header(
            &mut out,
            "http_requests_total",
            "counter",
            "HTTP requests answered, by method, matched route template and status.",
        );
        for ((method, route, status), count) in &http.requests {
            let _ = writeln!(
                out,
                "http_requests_total{{method=\"{method}\",route=\"{}\",status=\"{status}\"}} {count}",
                escape(route)
            );
        }
        header(
            &mut out,
            "http_request_duration_seconds",
            "histogram",
            "Time from receiving a request to its response headers, by method and matched route template.",
        );
        for ((method, route), histogram) in &http.durations {
            let labels = format!("method=\"{method}\",route=\"{}\"", escape(route));
            histogram.render(&mut out, "http_request_duration_seconds", &labels);
        }
    }
    header(
        &mut out,
        "transfers_total",
        "counter",
        "Transfers this process took to a terminal state, by state and cancel reason.",
    );
    for ((state, reason), count) in lock(&REGISTRY.transfers).iter() {
        let _ = writeln!(
            out,
            "transfers_total{{state=\"{state}\",reason=\"{reason}\"}} {count}"
        );
    }
    header(
        &mut out,
        "transfers_in_flight",
        "gauge",
        "Transfers this process is driving through the protocol right now.",
    );
    let _ = writeln!(
        out,
        "transfers_in_flight {}",
        IN_FLIGHT.load(Ordering::Relaxed)
    );
    header(
        &mut out,
        "sweeper_recoveries_total",
        "counter",
        "Unfinished transfers the recovery sweeper of this process took over and finished.",
    );
    let _ = writeln!(
        out,
        "sweeper_recoveries_total {}",
        crate::sweeper::RECOVERED_TOTAL.load(Ordering::Relaxed)
    );
    header(
        &mut out,
        "db_operation_duration_seconds",
        "histogram",
        "Round-trip time of database commands as the driver measured it, by command name and outcome.",
    );
    for ((command, outcome), histogram) in lock(&REGISTRY.db).iter() {
        let labels = format!("command=\"{}\",outcome=\"{outcome}\"", escape(command));
        histogram.render(&mut out, "db_operation_duration_seconds", &labels);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of the sample line that starts with `series ` (name and labels).
    fn sample(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn a_histogram_renders_cumulative_buckets_sum_and_count() {
        let mut histogram = Histogram::new(&[0.1, 1.0]);
        histogram.observe(Duration::from_micros(62_500));
        histogram.observe(Duration::from_millis(500));
        histogram.observe(Duration::from_secs(3));
        let mut out = String::new();
        histogram.render(&mut out, "h", "a=\"b\"");
        assert_eq!(
            out,
            "h_bucket{a=\"b\",le=\"0.1\"} 1\n\
             h_bucket{a=\"b\",le=\"1\"} 2\n\
             h_bucket{a=\"b\",le=\"+Inf\"} 3\n\
             h_sum{a=\"b\"} 3.5625\n\
             h_count{a=\"b\"} 3\n"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn an_invented_method_is_labelled_other() {
        assert_eq!(method_label("GET"), "GET");
        assert_eq!(method_label("BREW"), "other");
    }

    #[test]
    fn every_outcome_is_rendered_before_any_transfer_finished() {
        // The families and their types are checked through GET /metrics in
        // tests/api/observability.rs.
        let text = render();
        assert!(sample(&text, "transfers_total{state=\"done\",reason=\"none\"}").is_some());
    }

    #[test]
    fn the_in_flight_gauge_follows_its_guards() {
        let before = IN_FLIGHT.load(Ordering::Relaxed);
        let guard = InFlightTransfer::enter();
        assert_eq!(IN_FLIGHT.load(Ordering::Relaxed), before + 1);
        drop(guard);
        assert_eq!(IN_FLIGHT.load(Ordering::Relaxed), before);
    }

    #[test]
    fn a_finished_transfer_counts_under_its_state_and_reason() {
        let series = "transfers_total{state=\"canceled\",reason=\"balance_overflow\"}";
        let before = sample(&render(), series).unwrap();
        transfer_finished(TransferState::Canceled, Some(CancelReason::BalanceOverflow));
        transfer_finished(TransferState::Pending, None);
        assert_eq!(sample(&render(), series).unwrap(), before + 1.0);
    }
}
