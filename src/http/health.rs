//! Liveness and readiness for orchestrators and load balancers.

use axum::Json;
use axum::extract::State;
use serde::Serialize;
use utoipa::ToSchema;

use super::AppState;
use super::problem::ApiError;
use super::responses::NotReady;

/// The answer of the health and readiness checks.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(example = json!({"status": "degraded", "unavailableDeployments": ["us"]}))]
pub struct Status {
    /// `ok`; for `/ready`, `degraded` while some deployments (not all) do not answer.
    pub status: &'static str,
    /// The deployments that do not answer: transfers touching their accounts are refused
    /// (503) until they are back; the others go on. Absent when every one answers.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unavailable_deployments: Vec<String>,
}

/// Liveness: the process is serving HTTP.
#[utoipa::path(
    get, path = "/health", tag = "operations",
    responses((status = 200, description = "The process is alive.", body = Status))
)]
pub async fn health() -> Json<Status> {
    Json(Status {
        status: "ok",
        unavailable_deployments: Vec::new(),
    })
}

/// Readiness: the deployments answer and the instance admits new transfers.
///
/// With several deployments, one that does not answer only stops the transfers that
/// touch its accounts, so the instance stays ready (`degraded`, naming it) while any
/// deployment answers: every instance sees the same outage, and a load balancer that took
/// them all out would stop the transfers that could go on.
#[utoipa::path(
    get, path = "/ready", tag = "operations",
    responses(
        (status = 200, description = "`ok`: every deployment answers; `degraded`: the ones in `unavailableDeployments` do not, and only transfers touching their accounts are refused. The instance can serve.", body = Status),
        (status = 503, response = NotReady),
    )
)]
pub async fn ready(State(state): State<AppState>) -> Result<Json<Status>, ApiError> {
    if state.service.requests().is_overloaded() {
        return Err(ApiError::Overloaded);
    }
    let down = state.service.driver().unavailable_deployments().await;
    let names: Vec<String> = down.iter().map(ToString::to_string).collect();
    if down.len() == state.service.deployments().all().len() {
        return Err(ApiError::DeploymentsUnavailable(names));
    }
    Ok(Json(Status {
        status: if names.is_empty() { "ok" } else { "degraded" },
        unavailable_deployments: names,
    }))
}
