//! What operators see: `GET /metrics` in the Prometheus text format, and JSON logs in
//! which every event of a request carries its request id and every state change of a
//! transfer its transfer id.
//!
//! Invariants protected here: metrics are labelled by route template, never by raw path
//! (so ids never become series); every family is exposed from the start; a log line is
//! one JSON object.
//!
//! The metrics are per process and this binary runs its tests concurrently, so counts
//! are compared before and after, as lower bounds.

use std::cell::RefCell;
use std::io::Write;
use std::sync::{Arc, Mutex, Once};

use mongodb::bson::oid::ObjectId;
use serde_json::Value;
use tracing_subscriber::fmt::MakeWriter;
use transfer_service::config::LogFormat;
use transfer_service::domain::DeploymentName;
use transfer_service::store::{Store, new_transfer_id};

use support::values::{account, from_now};
use support::{TestApp, spawn_app};

/// Every family `/metrics` must expose, with its type.
const FAMILIES: [(&str, &str); 8] = [
    ("http_requests_total", "counter"),
    ("http_request_duration_seconds", "histogram"),
    ("transfers_total", "counter"),
    ("transfers_in_flight", "gauge"),
    ("sweeper_recoveries_total", "counter"),
    ("db_operation_duration_seconds", "histogram"),
    ("holds_total", "counter"),
    ("ledger_entries_moved_total", "counter"),
];

/// `GET /metrics` as text, after checking its status and media type.
pub async fn scrape(app: &TestApp) -> String {
    let response = app.get("/metrics").await;
    assert_eq!(response.status(), 200);
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    response.text().await.unwrap()
}

/// The value of the sample `series` (name and labels exactly as exposed); 0 if absent.
pub fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Log lines written while a test runs, in the service's JSON format.
#[derive(Clone, Default)]
pub struct CapturedLogs(Arc<Mutex<Vec<u8>>>);

thread_local! {
    /// Where this thread's log lines go while a test captures them.
    static CAPTURE: RefCell<Option<CapturedLogs>> = const { RefCell::new(None) };
}

/// Stops the capture of this thread's log lines when dropped.
pub struct CaptureGuard(());

impl Drop for CaptureGuard {
    fn drop(&mut self) {
        CAPTURE.with(|c| c.borrow_mut().take());
    }
}

impl CapturedLogs {
    /// Captures every event this thread logs at `debug` and above, in the service's JSON
    /// format, until the guard drops. `#[tokio::test]` runs the test, the service it
    /// spawns and the driver on one thread, so this sees that service and no other
    /// test's.
    ///
    /// The subscriber is the process's global one, installed once, writing to whichever
    /// capture the current thread has (or nowhere). A thread-local subscriber would not
    /// do: tracing caches whether a callsite is enabled the first time any thread hits
    /// it, and with a single scoped subscriber it asks only that thread's.
    pub fn start() -> (CapturedLogs, CaptureGuard) {
        static INSTALL: Once = Once::new();
        INSTALL.call_once(|| {
            let subscriber =
                transfer_service::telemetry::subscriber(LogFormat::Json, "debug", ThreadWriter);
            tracing::subscriber::set_global_default(subscriber)
                .expect("no other global subscriber in the api tests");
        });
        let logs = CapturedLogs::default();
        CAPTURE.with(|c| *c.borrow_mut() = Some(logs.clone()));
        (logs, CaptureGuard(()))
    }

    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }

    /// Every line, each of which must be one JSON object.
    pub fn lines(&self) -> Vec<Value> {
        self.text()
            .lines()
            .map(|line| {
                let value: Value = serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("a log line is not JSON ({e}): {line}"));
                assert!(value.is_object(), "{line}");
                value
            })
            .collect()
    }
}

/// Writes to the capture of the thread that logs, if it has one.
struct ThreadWriter;

impl Write for ThreadWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        CAPTURE.with(|c| {
            if let Some(logs) = c.borrow().as_ref() {
                logs.0.lock().unwrap().extend_from_slice(bytes);
            }
        });
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for ThreadWriter {
    type Writer = ThreadWriter;

    fn make_writer(&'a self) -> ThreadWriter {
        ThreadWriter
    }
}

/// The `request_id` of the request span an event was logged in, if any.
pub fn request_id_of(line: &Value) -> Option<&str> {
    line["spans"]
        .as_array()?
        .iter()
        .find(|span| span["name"] == "request")?["request_id"]
        .as_str()
}

#[tokio::test]
async fn metrics_are_prometheus_text_exposing_every_family() {
    let app = spawn_app().await;

    let text = scrape(&app).await;

    for (family, kind) in FAMILIES {
        assert!(
            text.contains(&format!("# TYPE {family} {kind}\n")),
            "{family} is not exposed as a {kind}:\n{text}"
        );
    }
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let (_, value) = line.rsplit_once(' ').expect("a sample is `series value`");
        assert!(value.parse::<f64>().is_ok(), "not a sample: {line}");
    }
}

/// A rate over an outcome is defined before the first transfer ends that way: every
/// terminal outcome, the in-flight gauge and the recovery counter are series from the
/// first scrape, before this instance served any request or moved any transfer.
#[tokio::test]
async fn every_outcome_is_a_series_from_the_first_scrape() {
    let app = spawn_app().await;

    let text = scrape(&app).await;

    let mut series = vec![
        "transfers_total{state=\"done\",reason=\"none\"}".to_owned(),
        "transfers_in_flight".to_owned(),
        "sweeper_recoveries_total".to_owned(),
    ];
    for reason in transfer_service::domain::CancelReason::ALL {
        series.push(format!(
            "transfers_total{{state=\"canceled\",reason=\"{}\"}}",
            reason.as_str()
        ));
    }
    for outcome in ["captured", "voided", "expired", "refused"] {
        series.push(format!("holds_total{{outcome=\"{outcome}\"}}"));
    }
    for series in series {
        assert!(
            text.lines().any(|line| line
                .strip_prefix(series.as_str())
                .and_then(|rest| rest.strip_prefix(' '))
                .is_some_and(|value| value.parse::<f64>().is_ok())),
            "{series} is not exposed:\n{text}"
        );
    }
}

#[tokio::test]
async fn metrics_need_no_api_key() {
    let app = support::spawn_app_with(|settings| {
        settings.api_keys =
            transfer_service::config::parse_api_keys("rw:observability-key-0123456789").unwrap();
    })
    .await;
    scrape(&app).await;
}

#[tokio::test]
async fn a_request_is_counted_by_its_route_template_and_status_never_its_path() {
    let app = spawn_app().await;
    let ghost = format!("ghost{}", ObjectId::new().to_hex());
    let nowhere = format!("/nowhere/{}", ObjectId::new().to_hex());
    let by_template = "http_requests_total{method=\"GET\",route=\"/accounts/{id}\",status=\"404\"}";
    let unmatched = "http_requests_total{method=\"GET\",route=\"unmatched\",status=\"404\"}";
    let timed = "http_request_duration_seconds_count{method=\"GET\",route=\"/accounts/{id}\"}";
    let before = scrape(&app).await;

    assert_eq!(app.get(&format!("/accounts/{ghost}")).await.status(), 404);
    assert_eq!(app.get(&nowhere).await.status(), 404);

    let after = scrape(&app).await;
    assert!(
        sample(&after, by_template) >= sample(&before, by_template) + 1.0,
        "{after}"
    );
    assert!(
        sample(&after, unmatched) >= sample(&before, unmatched) + 1.0,
        "{after}"
    );
    assert!(
        sample(&after, timed) >= sample(&before, timed) + 1.0,
        "{after}"
    );
    assert!(
        !after.contains(&ghost) && !after.contains(&nowhere),
        "a raw path became a label"
    );
}

#[tokio::test]
async fn database_commands_are_timed_by_deployment_and_command_name() {
    let app = spawn_app().await;
    let inserts = "db_operation_duration_seconds_count{deployment=\"default\",command=\"insert\",outcome=\"ok\"}";
    let before = scrape(&app).await;

    app.open_account(&format!("acc{}", ObjectId::new().to_hex()), 10)
        .await;

    let after = scrape(&app).await;
    assert!(
        sample(&after, inserts) >= sample(&before, inserts) + 1.0,
        "{after}"
    );
    assert!(
        after.contains(
            "db_operation_duration_seconds_bucket{deployment=\"default\",command=\"insert\",outcome=\"ok\",le=\"+Inf\"}"
        ),
        "{after}"
    );
}

/// Needs `metrics::transfer_finished` called where a transfer's terminal state change
/// wins (src/service/protocol.rs `advance`, and the abandon in cancel.rs).
#[tokio::test]
async fn a_finished_transfer_is_counted_by_its_outcome() {
    let app = spawn_app().await;
    let done = "transfers_total{state=\"done\",reason=\"none\"}";
    let short = "transfers_total{state=\"canceled\",reason=\"insufficient_funds\"}";
    app.open_account("alice", 100).await;
    app.open_account("bob", 0).await;
    let before = scrape(&app).await;

    let (status, _) = app.transfer("alice", "bob", 60).await;
    assert_eq!(status, 201);
    let (status, _) = app.transfer("alice", "bob", 60).await;
    assert_eq!(status, 422);

    let after = scrape(&app).await;
    assert!(
        sample(&after, done) >= sample(&before, done) + 1.0,
        "{after}"
    );
    assert!(
        sample(&after, short) >= sample(&before, short) + 1.0,
        "{after}"
    );
}

/// Needs `metrics::hold_finished` called where a hold's terminal state change wins.
#[tokio::test]
async fn a_finished_hold_is_counted_by_its_outcome() {
    let app = spawn_app().await;
    let captured = "holds_total{outcome=\"captured\"}";
    let voided = "holds_total{outcome=\"voided\"}";
    app.open_account("alice", 100).await;
    app.open_account("bob", 0).await;
    let before = scrape(&app).await;
    let mut holds = Vec::new();
    for _ in 0..2 {
        let body = serde_json::json!({ "source": "alice", "destination": "bob", "amount": 10, "hold": {} });
        let response = app.post_json("/transfers", body).await;
        assert_eq!(response.status(), 201);
        let hold: serde_json::Value = response.json().await.unwrap();
        holds.push(hold["id"].as_str().unwrap().to_owned());
    }

    for (hold, action) in holds.iter().zip(["capture", "void"]) {
        let url = app.url(&format!("/transfers/{hold}/{action}"));
        let response = app.http.post(url).send().await.unwrap();
        assert_eq!(response.status(), 200, "{action}");
    }

    let after = scrape(&app).await;
    for series in [captured, voided] {
        assert!(
            sample(&after, series) >= sample(&before, series) + 1.0,
            "{series}: {after}"
        );
    }
}

#[tokio::test]
async fn the_request_id_is_answered_and_carried_by_the_logs_of_the_request() {
    let (logs, _guard) = CapturedLogs::start();
    let app = spawn_app().await;
    app.open_account("alice", 100).await;
    app.open_account("bob", 0).await;
    let request_id = format!("obs-{}", ObjectId::new().to_hex());

    let response = app
        .http
        .post(app.url("/transfers"))
        .header("x-request-id", &request_id)
        .json(&serde_json::json!({ "source": "alice", "destination": "bob", "amount": 25 }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()["x-request-id"], request_id.as_str());
    assert_eq!(response.status(), 201);
    let body: Value = response.json().await.unwrap();
    let transfer_id = body["id"].as_str().expect("a transfer id");

    // Without an x-request-id, the service makes one up and answers with it.
    let generated = app.get("/health").await.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(!generated.is_empty());

    let lines = logs.lines();
    let of_request: Vec<&Value> = lines
        .iter()
        .filter(|line| request_id_of(line) == Some(request_id.as_str()))
        .collect();
    assert!(
        of_request
            .iter()
            .any(|l| l["message"] == "finished processing request"),
        "the request's own trace events carry its id: {}",
        logs.text()
    );
    let changes: Vec<&&Value> = of_request
        .iter()
        .filter(|l| l["message"] == "transfer state changed" && l["transfer_id"] == transfer_id)
        .collect();
    let reached: Vec<&str> = changes.iter().filter_map(|l| l["to"].as_str()).collect();
    // Inserted `pending` (its own line, below): the state changes are the run's.
    assert_eq!(reached, ["applied", "done"], "{}", logs.text());
    assert!(
        of_request
            .iter()
            .any(|l| l["message"] == "transfer inserted" && l["transfer_id"] == transfer_id),
        "{}",
        logs.text()
    );
}

/// A transfer refused for its funds is rolled back, which finds nothing to undo on the
/// destination: no error is logged (the "invariant broken" error is kept for a credit
/// found there, and an alert on it must not fire on every refusal). Found by cargo
/// mutants: the undoing write's answer made its opposite went unnoticed.
#[tokio::test]
async fn a_transfer_refused_for_its_funds_logs_no_error() {
    let (logs, _guard) = CapturedLogs::start();
    let app = spawn_app().await;
    app.open_account("alice", 100).await;
    app.open_account("bob", 0).await;
    let response = app
        .http
        .post(app.url("/transfers"))
        .json(&serde_json::json!({ "source": "alice", "destination": "bob", "amount": 250 }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 422);
    let lines = logs.lines();
    assert!(
        lines
            .iter()
            .any(|l| l["message"] == "transfer state changed" && l["to"] == "canceled"),
        "the refusal is rolled back: {}",
        logs.text()
    );
    let errors: Vec<&Value> = lines.iter().filter(|l| l["level"] == "ERROR").collect();
    assert!(errors.is_empty(), "{errors:?}");
}

#[test]
fn metrics_are_documented_as_plain_text_in_the_operations_tag() {
    let doc = serde_json::to_value(transfer_service::http::openapi()).unwrap();
    let operation = &doc["paths"]["/metrics"]["get"];
    assert_eq!(operation["tags"][0], "operations", "{operation}");
    assert!(
        operation["responses"]["200"]["content"]["text/plain"].is_object(),
        "{operation}"
    );
    assert_eq!(operation["security"], serde_json::json!([]), "{operation}");
}

#[tokio::test]
async fn a_transfer_run_in_the_background_logs_in_the_span_of_its_request() {
    let (logs, _guard) = CapturedLogs::start();
    let app = spawn_app().await;
    app.open_account("alice", 100).await;
    app.open_account("bob", 0).await;
    let request_id = format!("async-{}", ObjectId::new().to_hex());

    let response = app
        .http
        .post(app.url("/transfers"))
        .header("x-request-id", &request_id)
        .header("prefer", "respond-async")
        .json(&serde_json::json!({ "source": "alice", "destination": "bob", "amount": 25 }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
    let body: Value = response.json().await.unwrap();
    let transfer_id = body["id"].as_str().expect("a transfer id").to_owned();
    let within = std::time::Duration::from_secs(10);
    let every = std::time::Duration::from_millis(20);
    support::poll_until(within, every, async || {
        let (_, transfer) = crate::get_json(&app, &format!("/transfers/{transfer_id}")).await;
        if transfer["state"] == "done" {
            Ok(())
        } else {
            Err(transfer)
        }
    })
    .await
    .unwrap_or_else(|transfer| panic!("never done: {transfer}"));

    let lines = logs.lines();
    assert!(
        lines
            .iter()
            .any(|l| l["message"] == "transfer state changed"
                && l["transfer_id"] == transfer_id.as_str()
                && l["to"] == "done"
                && request_id_of(l) == Some(request_id.as_str())),
        "{}",
        logs.text()
    );
}

/// The group-commit writers have a client of their own, with no command events, and
/// time their commands themselves: a debit and a read written through a store of a
/// deployment no other test names are counted under that name.
#[tokio::test]
async fn the_group_commit_writers_time_their_own_commands_under_their_deployment() {
    let app = spawn_app().await;
    app.open_account("alice", 100).await;
    let name = format!("writers-{}", &ObjectId::new().to_hex()[12..]);
    let deployment = DeploymentName::parse(&name).unwrap();
    let store = Store::connect_with(deployment, &support::database_uri(), &app.database, 2)
        .await
        .unwrap();
    let updates = format!(
        "db_operation_duration_seconds_count{{deployment=\"{name}\",command=\"update\",outcome=\"ok\"}}"
    );
    let finds = format!(
        "db_operation_duration_seconds_count{{deployment=\"{name}\",command=\"find\",outcome=\"ok\"}}"
    );

    let alice = account("alice");
    let debit = store
        .accounts()
        .prepare(&alice, new_transfer_id(), -10, from_now(60_000));
    assert!(debit.await.unwrap().applied);
    let placed = store.accounts().placements([&alice, &alice]).await.unwrap();
    assert!(placed[0].is_some());

    let metrics = transfer_service::metrics::render();
    assert_eq!(sample(&metrics, &updates), 1.0, "{metrics}");
    assert!(sample(&metrics, &finds) >= 1.0, "{metrics}");
}
