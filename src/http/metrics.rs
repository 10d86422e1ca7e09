//! `GET /metrics` and the middleware that counts and times every request.
//!
//! The middleware runs after routing (it is installed with `Router::layer`, which wraps
//! each route and the fallback), so it labels a request with axum's [`MatchedPath`], the
//! route template, and never with the raw path: the number of series stays bounded.

use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::http::header::CONTENT_TYPE;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The media type of the Prometheus text exposition format.
pub const CONTENT_TYPE_PROMETHEUS: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Prometheus metrics of this process.
///
/// The Prometheus text exposition format, version 0.0.4
/// (`text/plain; version=0.0.4`). Families: `http_requests_total{method,route,status}`,
/// `http_request_duration_seconds{method,route}`, `transfers_total{state,reason}`,
/// `transfers_in_flight`, `sweeper_recoveries_total`, `holds_total{outcome}`,
/// `ledger_entries_moved_total` and `db_operation_duration_seconds{command,outcome}`.
/// `route` is the matched route
/// template, such as `/transfers/{id}`, or `unmatched`. Never needs an API key.
#[utoipa::path(
    get, path = "/metrics", tag = "operations",
    responses(
        (status = 200, description = "The metrics, in the Prometheus text format version 0.0.4.", body = String, content_type = "text/plain"),
    )
)]
pub async fn metrics() -> Response {
    (
        [(CONTENT_TYPE, CONTENT_TYPE_PROMETHEUS)],
        crate::metrics::render(),
    )
        .into_response()
}

/// Counts and times every request by method, route template and status.
pub async fn count_and_time(request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_owned());
    let response = next.run(request).await;
    crate::metrics::http_request(
        method.as_str(),
        route.as_deref(),
        response.status().as_u16(),
        started.elapsed(),
    );
    response
}
