//! Liveness and readiness for orchestrators and load balancers.

use axum::Json;
use axum::extract::State;
use serde::Serialize;
use utoipa::ToSchema;

use super::AppState;
use super::problem::{ApiError, Problem};

/// The answer of the health and readiness checks.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"status": "ok"}))]
pub struct Status {
    /// Always `ok`.
    pub status: &'static str,
}

/// Liveness: the process is serving HTTP.
#[utoipa::path(
    get, path = "/health", tag = "operations",
    responses((status = 200, description = "The process is alive.", body = Status))
)]
pub async fn health() -> Json<Status> {
    Json(Status { status: "ok" })
}

/// Readiness: the database answers and the instance admits new transfers.
#[utoipa::path(
    get, path = "/ready", tag = "operations",
    responses(
        (status = 200, description = "The database answers; the instance can serve.", body = Status),
        (status = 503, description = "`database_unavailable` or `request_timeout`: the database does not answer; `overloaded`: the instance has as many transfers in flight as it admits. Send no traffic here for now.", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn ready(State(state): State<AppState>) -> Result<Json<Status>, ApiError> {
    if state.bank.is_overloaded() {
        return Err(ApiError::Overloaded);
    }
    state.bank.ping().await?;
    Ok(Json(Status { status: "ok" }))
}
