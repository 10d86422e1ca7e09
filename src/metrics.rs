//! Prometheus metrics: recorded through the `metrics` facade into this process's one
//! `metrics-exporter-prometheus` recorder, written out by `GET /metrics` in the text
//! exposition format, version 0.0.4.
//!
//! | family | type | labels |
//! |---|---|---|
//! | `http_requests_total` | counter | `method`, `route`, `status` |
//! | `http_request_duration_seconds` | histogram | `method`, `route` |
//! | `transfers_total` | counter | `state` (`done`, `canceled`), `reason` (`none` for done) |
//! | `transfers_in_flight` | gauge | |
//! | `sweeper_recoveries_total` | counter | |
//! | `db_operation_duration_seconds` | histogram | `deployment`, `command`, `outcome` (`ok`, `error`) |
//! | `holds_total` | counter | `outcome` (`captured`, `voided`, `expired`, `refused`) |
//! | `event_feed_gaps_total` | counter | `deployment`, `cause` (`history_lost`, `unreadable_change`) |
//!
//! Invariant: every label value comes from a bounded set, whatever clients send, so the
//! number of series stays bounded. A route is the matched route template
//! (`/transfers/{id}`), never the raw path, and `unmatched` when no route matched; a
//! method outside the standard ones is `other`; states and reasons are the domain's
//! enums; commands are the MongoDB command names this service's own code issues.
//!
//! Invariant: every family is listed from the first scrape, and every terminal outcome
//! of `transfers_total` is a series from the start, at 0.
//!
//! The recorder is process-wide (one set of values per process, as Prometheus expects
//! from a scrape target, however many `Application`s the process runs, as the tests do)
//! and is installed by the first call into this module; the values start at zero when
//! the process starts. This module is a leaf: the code it measures calls it, and it
//! reads nothing of theirs.

use std::sync::LazyLock;
use std::time::Duration;

use ::metrics::{
    Counter, Gauge, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::domain::{CancelReason, DeploymentName, EventType, TransferState};

const HTTP_REQUESTS: &str = "http_requests_total";
const HTTP_DURATION: &str = "http_request_duration_seconds";
const TRANSFERS: &str = "transfers_total";
const IN_FLIGHT: &str = "transfers_in_flight";
const RECOVERIES: &str = "sweeper_recoveries_total";
const DB_DURATION: &str = "db_operation_duration_seconds";
const HOLDS: &str = "holds_total";
const ENTRIES_MOVED: &str = "ledger_entries_moved_total";
const EVENTS_RECORDED: &str = "events_recorded_total";
const EVENT_GAPS: &str = "event_feed_gaps_total";
const EVENT_STREAMS: &str = "event_streams_open";
const DELIVERIES: &str = "webhook_delivery_attempts_total";
const OLDEST_PENDING: &str = "webhook_oldest_pending_delivery_seconds";
const DELIVERY_OUTCOMES: [&str; 3] = ["succeeded", "retried", "failed"];

/// How a hold can end, as `holds_total` labels it.
const HOLD_OUTCOMES: [&str; 4] = ["captured", "voided", "expired", "refused"];

/// The Prometheus type of a family.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// Every family with its type and HELP text: what dashboards rely on.
const FAMILIES: [(&str, Kind, &str); 13] = [
    (
        HTTP_REQUESTS,
        Kind::Counter,
        "HTTP requests answered, by method, matched route template and status.",
    ),
    (
        HTTP_DURATION,
        Kind::Histogram,
        "Time from receiving a request to its response headers, by method and matched route template.",
    ),
    (
        TRANSFERS,
        Kind::Counter,
        "Transfers this process took to a terminal state, by state and cancel reason.",
    ),
    (
        IN_FLIGHT,
        Kind::Gauge,
        "Transfers this process is driving through the protocol right now.",
    ),
    (
        RECOVERIES,
        Kind::Counter,
        "Unfinished transfers the recovery sweeper of this process took over and finished.",
    ),
    (
        DB_DURATION,
        Kind::Histogram,
        "Round-trip time of database commands as the driver measured it, by deployment, command name and outcome.",
    ),
    (
        HOLDS,
        Kind::Counter,
        "Holds this process took to their end, by outcome: captured, voided, expired, or refused (never held: funds, an account gone, a cancel while reserving).",
    ),
    (
        ENTRIES_MOVED,
        Kind::Counter,
        "Ledger entries this process copied from account documents to the entries collection (docs/ledger.md).",
    ),
    (
        EVENTS_RECORDED,
        Kind::Counter,
        "Events this process recorded into a deployment's feed, by type (docs/events.md); an event another instance recorded first is not counted.",
    ),
    (
        EVENT_GAPS,
        Kind::Counter,
        "Gaps in a deployment's feed this process found, by deployment and cause: changes whose events could not be recorded (history_lost: an older version's change stream could not resume; unreadable_change: a due event or a change could not be made an event). Readers of cursors from before a gap are answered 410 cursor_expired; the error log says what was lost.",
    ),
    (
        EVENT_STREAMS,
        Kind::Gauge,
        "Event streams (GET /events/stream) open on this process; at most MAX_EVENT_STREAMS.",
    ),
    (
        DELIVERIES,
        Kind::Counter,
        "Webhook delivery attempts this process made, by outcome: succeeded (a 2xx), retried (another attempt is due), failed (given up after WEBHOOK_GIVE_UP_AFTER_MS).",
    ),
    (
        OLDEST_PENDING,
        Kind::Gauge,
        "Age of the oldest pending webhook delivery, in seconds (0 when none is pending), as this process last measured it.",
    ),
];

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

/// How often the histograms' raw samples are folded into their buckets when nobody
/// scrapes. The exporter keeps every sample until then (8 bytes each), so without this a
/// process that is never scraped would grow by its database command rate.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// The methods that get their own label value; anything else is `other`, so a client
/// inventing methods cannot create series.
const KNOWN_METHODS: &[&str] = &[
    "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT",
];

/// The `route` label of a request no route matched.
pub const UNMATCHED_ROUTE: &str = "unmatched";

/// The installed recorder and the series without labels, registered once.
struct Installed {
    /// Renders what the recorder holds.
    handle: PrometheusHandle,
    /// `transfers_in_flight`, kept so that a guard does not look it up by name.
    in_flight: Gauge,
    /// `sweeper_recoveries_total`, kept for the same reason.
    recovered: Counter,
}

/// A global recorder can be installed only once per process, and the tests run many
/// applications in one process: so it is installed here, once, on first use, and every
/// function of this module goes through this before it records, so that nothing is
/// recorded into the facade's no-op recorder before ours is in place.
static INSTALLED: LazyLock<Installed> = LazyLock::new(install);

fn installed() -> &'static Installed {
    &INSTALLED
}

fn install() -> Installed {
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(HTTP_DURATION.to_owned()),
            HTTP_BUCKETS_SECONDS,
        )
        .and_then(|builder| {
            builder
                .set_buckets_for_metric(Matcher::Full(DB_DURATION.to_owned()), DB_BUCKETS_SECONDS)
        })
        .expect("the bucket lists are constants and not empty")
        .build_recorder();
    let handle = recorder.handle();
    if let Err(e) = ::metrics::set_global_recorder(recorder) {
        // Only code embedding this crate could have installed one first. Transfers must
        // not fail for it: /metrics then lists the families without their series.
        tracing::error!(error = %e, "another metrics recorder is installed; GET /metrics will miss this service's series");
    }

    for (name, kind, help) in FAMILIES {
        match kind {
            Kind::Counter => describe_counter!(name, help),
            Kind::Gauge => describe_gauge!(name, help),
            Kind::Histogram => describe_histogram!(name, help),
        }
    }
    // Every terminal outcome is listed from the start, at 0, so that a rate over it is
    // defined before the first transfer ends that way.
    counter!(TRANSFERS, "state" => TransferState::Done.as_str(), "reason" => "none").increment(0);
    for reason in CancelReason::ALL {
        counter!(TRANSFERS, "state" => TransferState::Canceled.as_str(), "reason" => reason.as_str())
            .increment(0);
    }
    for outcome in HOLD_OUTCOMES {
        counter!(HOLDS, "outcome" => outcome).increment(0);
    }
    let in_flight = gauge!(IN_FLIGHT);
    in_flight.set(0.0);
    let recovered = counter!(RECOVERIES);
    recovered.increment(0);
    counter!(ENTRIES_MOVED).increment(0);
    for kind in EventType::ALL {
        counter!(EVENTS_RECORDED, "type" => kind.as_str()).increment(0);
    }
    gauge!(EVENT_STREAMS).set(0.0);
    for outcome in DELIVERY_OUTCOMES {
        counter!(DELIVERIES, "outcome" => outcome).increment(0);
    }
    gauge!(OLDEST_PENDING).set(0.0);

    let upkeep = handle.clone();
    let spawned = std::thread::Builder::new()
        .name("metrics-upkeep".into())
        .spawn(move || {
            loop {
                std::thread::sleep(UPKEEP_INTERVAL);
                upkeep.run_upkeep();
            }
        });
    if let Err(e) = spawned {
        // Scrapes drain the samples too; only an unscraped process grows.
        tracing::warn!(error = %e, "no metrics upkeep thread; histogram samples pile up between scrapes");
    }

    Installed {
        handle,
        in_flight,
        recovered,
    }
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
    installed();
    let method = method_label(method);
    let route = route.unwrap_or(UNMATCHED_ROUTE).to_owned();
    counter!(HTTP_REQUESTS, "method" => method, "route" => route.clone(), "status" => status.to_string())
        .increment(1);
    histogram!(HTTP_DURATION, "method" => method, "route" => route).record(elapsed);
}

/// Records a transfer that this process took to a terminal state: call it once, where
/// the guarded write to `done` or `canceled` won. Non-terminal states are ignored.
pub fn transfer_finished(state: TransferState, reason: Option<CancelReason>) {
    installed();
    let reason = match state {
        TransferState::Done => "none",
        TransferState::Canceled => reason.map_or("unknown", CancelReason::as_str),
        _ => return,
    };
    counter!(TRANSFERS, "state" => state.as_str(), "reason" => reason).increment(1);
}

/// Records a hold that this process took to its end (`done` or `canceled`): call it
/// where the guarded write won, with the reason it was canceled for.
pub fn hold_finished(state: TransferState, reason: Option<CancelReason>) {
    installed();
    let outcome = match (state, reason) {
        (TransferState::Done, _) => "captured",
        (TransferState::Canceled, Some(CancelReason::Voided)) => "voided",
        (TransferState::Canceled, Some(CancelReason::Expired)) => "expired",
        (TransferState::Canceled, _) => "refused",
        _ => return,
    };
    counter!(HOLDS, "outcome" => outcome).increment(1);
}

/// Records `count` ledger entries moved out of account documents (see
/// `store::entries`).
pub fn entries_moved(count: usize) {
    installed();
    counter!(ENTRIES_MOVED).increment(count as u64);
}

/// Records an event of type `kind` recorded into a feed (see `store::events`).
pub fn event_recorded(kind: EventType) {
    installed();
    counter!(EVENTS_RECORDED, "type" => kind.as_str()).increment(1);
}

/// Why a deployment's feed has a gap (`event_feed_gaps_total`'s `cause`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedGap {
    /// `history_lost`: the change stream could not resume where the last recorder left
    /// it (its history is gone, or where it left it cannot be read).
    HistoryLost,
    /// `unreadable_change`: a change that should be an event could not be made one.
    UnreadableChange,
}

impl FeedGap {
    pub fn as_str(self) -> &'static str {
        match self {
            FeedGap::HistoryLost => "history_lost",
            FeedGap::UnreadableChange => "unreadable_change",
        }
    }
}

/// Records a gap in `deployment`'s feed (see `store::events`).
pub fn feed_gap(deployment: &DeploymentName, cause: FeedGap) {
    installed();
    counter!(EVENT_GAPS, "deployment" => deployment.to_string(), "cause" => cause.as_str())
        .increment(1);
}

/// Records an unfinished transfer that the recovery sweeper took over and drove to a
/// terminal state.
pub fn transfer_recovered() {
    installed().recovered.increment(1);
}

/// Counts a transfer as in flight while it lives: hold one while driving a transfer.
#[must_use = "the transfer counts as in flight only while the guard lives"]
#[derive(Debug)]
pub struct InFlightTransfer(());

impl InFlightTransfer {
    pub fn enter() -> InFlightTransfer {
        installed().in_flight.increment(1.0);
        InFlightTransfer(())
    }
}

impl Drop for InFlightTransfer {
    fn drop(&mut self) {
        installed().in_flight.decrement(1.0);
    }
}

/// Records a webhook delivery attempt and its `outcome` (see `deliverer`).
pub fn delivery_attempted(outcome: &'static str) {
    installed();
    counter!(DELIVERIES, "outcome" => outcome).increment(1);
}

/// Sets the age of the oldest pending webhook delivery.
pub fn oldest_pending_delivery(age_seconds: f64) {
    installed();
    gauge!(OLDEST_PENDING).set(age_seconds);
}

/// Counts an event stream as open while it lives.
#[must_use = "the stream counts as open only while the guard lives"]
#[derive(Debug)]
pub struct OpenEventStream(());

impl OpenEventStream {
    pub fn enter() -> OpenEventStream {
        installed();
        gauge!(EVENT_STREAMS).increment(1.0);
        OpenEventStream(())
    }
}

impl Drop for OpenEventStream {
    fn drop(&mut self) {
        gauge!(EVENT_STREAMS).decrement(1.0);
    }
}

/// How a database command ended: the `outcome` label of `db_operation_duration_seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbOutcome {
    /// `ok`.
    Succeeded,
    /// `error`.
    Failed,
}

/// Records one database command on `deployment`, as the driver timed it (round trip
/// included).
pub fn db_operation(
    deployment: &DeploymentName,
    command: &str,
    outcome: DbOutcome,
    elapsed: Duration,
) {
    installed();
    let outcome = match outcome {
        DbOutcome::Succeeded => "ok",
        DbOutcome::Failed => "error",
    };
    histogram!(
        DB_DURATION,
        "deployment" => deployment.to_string(),
        "command" => command.to_owned(),
        "outcome" => outcome
    )
    .record(elapsed);
}

/// Every family in the Prometheus text format, version 0.0.4.
pub fn render() -> String {
    let mut text = installed().handle.render();
    // The exporter lists a family once it has a series. Those still without one (no
    // request answered yet, say) are listed by their HELP and TYPE alone, so that every
    // family is there from the first scrape, as docs/operations.md's table promises.
    for (name, kind, help) in FAMILIES {
        if !text.contains(&format!("# TYPE {name} ")) {
            text.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {}\n",
                kind.as_str()
            ));
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of the sample line that starts with `series ` (name and labels).
    fn sample(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    /// The `le` bounds of the `_bucket` lines of one series, `labels` being `a="x",b="y"`.
    fn bucket_bounds(text: &str, name: &str, labels: &str) -> Vec<String> {
        let prefix = format!("{name}_bucket{{{labels},le=\"");
        text.lines()
            .filter_map(|line| Some(line.strip_prefix(&prefix)?.split_once('"')?.0.to_owned()))
            .collect()
    }

    fn expected_bounds(bounds: &[f64]) -> Vec<String> {
        bounds
            .iter()
            .map(f64::to_string)
            .chain(["+Inf".to_owned()])
            .collect()
    }

    #[test]
    fn an_invented_method_is_labelled_other() {
        assert_eq!(method_label("GET"), "GET");
        assert_eq!(method_label("BREW"), "other");
    }

    #[test]
    fn every_family_is_listed_with_its_type_and_help() {
        // The families are checked through GET /metrics in tests/api/observability.rs too.
        let text = render();
        for (name, kind, help) in FAMILIES {
            assert!(
                text.contains(&format!("# TYPE {name} {}\n", kind.as_str())),
                "{name}:\n{text}"
            );
            assert!(
                text.contains(&format!("# HELP {name} {help}\n")),
                "{name}:\n{text}"
            );
        }
    }

    #[test]
    fn every_outcome_is_a_series_before_any_transfer_finished() {
        let text = render();
        assert!(
            sample(&text, "transfers_total{state=\"done\",reason=\"none\"}").is_some(),
            "{text}"
        );
        for reason in CancelReason::ALL {
            let series = format!(
                "transfers_total{{state=\"canceled\",reason=\"{}\"}}",
                reason.as_str()
            );
            assert!(sample(&text, &series).is_some(), "{series}:\n{text}");
        }
        assert!(sample(&text, "transfers_in_flight").is_some(), "{text}");
        assert!(
            sample(&text, "sweeper_recoveries_total").is_some(),
            "{text}"
        );
    }

    #[test]
    fn the_in_flight_gauge_follows_its_guards() {
        let before = sample(&render(), "transfers_in_flight").unwrap();
        let guard = InFlightTransfer::enter();
        assert_eq!(
            sample(&render(), "transfers_in_flight").unwrap(),
            before + 1.0
        );
        drop(guard);
        assert_eq!(sample(&render(), "transfers_in_flight").unwrap(), before);
    }

    #[test]
    fn a_finished_transfer_counts_under_its_state_and_reason() {
        let series = "transfers_total{state=\"canceled\",reason=\"balance_overflow\"}";
        let before = sample(&render(), series).unwrap();
        transfer_finished(TransferState::Canceled, Some(CancelReason::BalanceOverflow));
        transfer_finished(TransferState::Pending, None);
        assert_eq!(sample(&render(), series).unwrap(), before + 1.0);
    }

    #[test]
    fn a_recovered_transfer_is_counted() {
        let before = sample(&render(), "sweeper_recoveries_total").unwrap();
        transfer_recovered();
        assert!(sample(&render(), "sweeper_recoveries_total").unwrap() >= before + 1.0);
    }

    #[test]
    fn a_database_command_lands_in_the_database_buckets() {
        // A command name of this test's own, so no other test adds to its series.
        let here = DeploymentName::parse("probe").unwrap();
        let ok = DbOutcome::Succeeded;
        db_operation(&here, "bucketProbe", ok, Duration::from_micros(62_500));
        db_operation(&here, "bucketProbe", ok, Duration::from_secs(7));
        let text = render();
        let labels = "deployment=\"probe\",command=\"bucketProbe\",outcome=\"ok\"";
        assert_eq!(
            bucket_bounds(&text, DB_DURATION, labels),
            expected_bounds(DB_BUCKETS_SECONDS),
            "{text}"
        );
        let bucket = |le: &str| {
            sample(
                &text,
                &format!("{DB_DURATION}_bucket{{{labels},le=\"{le}\"}}"),
            )
        };
        assert_eq!(bucket("0.05"), Some(0.0));
        assert_eq!(bucket("0.1"), Some(1.0));
        assert_eq!(bucket("5"), Some(1.0));
        assert_eq!(bucket("+Inf"), Some(2.0));
        assert_eq!(
            sample(&text, &format!("{DB_DURATION}_sum{{{labels}}}")),
            Some(7.0625)
        );
        assert_eq!(
            sample(&text, &format!("{DB_DURATION}_count{{{labels}}}")),
            Some(2.0)
        );
    }

    #[test]
    fn a_request_is_counted_and_lands_in_the_http_buckets() {
        http_request("GET", Some("/bucket-probe"), 200, Duration::from_millis(30));
        let text = render();
        assert_eq!(
            sample(
                &text,
                "http_requests_total{method=\"GET\",route=\"/bucket-probe\",status=\"200\"}"
            ),
            Some(1.0),
            "{text}"
        );
        let labels = "method=\"GET\",route=\"/bucket-probe\"";
        assert_eq!(
            bucket_bounds(&text, HTTP_DURATION, labels),
            expected_bounds(HTTP_BUCKETS_SECONDS),
            "{text}"
        );
        assert_eq!(
            sample(
                &text,
                &format!("{HTTP_DURATION}_bucket{{{labels},le=\"0.05\"}}")
            ),
            Some(1.0)
        );
    }
}
