//! `/webhooks`: registering endpoints that are sent events, and their deliveries
//! (`docs/webhooks.md`). Every route here needs a read-write API key (when keys are
//! configured), reads too: a webhook's list says where the service's events go.

use std::time::Duration;

use axum::Json;
use axum::extract::{Extension, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::IntoResponse;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::AppState;
use super::events::EventTypeSchema;
use super::extract::{ApiJson, OptionalApiJson};
use super::pagination::{PageParams, after, page, read_time_and_id, time_and_id};
use super::problem::{ApiError, field};
use super::responses::{
    DeliveryNotFailed, DeliveryNotFound, InvalidParameter, InvalidRotation, MalformedJson,
    PayloadTooLarge, Unavailable, UnsupportedMediaType, WebhookLimitReached, WebhookNotFound,
    WebhookRefused,
};
use crate::domain::{
    Attempt, DEFAULT_ROTATION_OVERLAP, Delivery, DeliveryState, EventType, MAX_ROTATION_OVERLAP,
    ParseError, Scope, Webhook, WebhookUrl,
};
use crate::service::NewWebhook;

/// Deliveries listed unless `limit` says otherwise.
pub const DEFAULT_DELIVERIES: u32 = 100;
/// The most deliveries listed at once.
pub const MAX_DELIVERIES: u32 = 1000;
/// The longest description.
const MAX_DESCRIPTION_CHARS: usize = 500;

/// A request to register an endpoint.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"url": "https://example.com/hooks/payments", "types": ["transfer.done", "transfer.canceled"], "description": "payments backend"}))]
pub struct CreateWebhookRequest {
    /// An `http` or `https` URL, at most 2048 bytes, without credentials, whose host
    /// resolves to public addresses only (unless the server sets
    /// `WEBHOOK_ALLOW_PRIVATE=true`): checked when it is registered, so a host that does
    /// not resolve is refused (422 `webhook_url_not_allowed`).
    #[schema(
        max_length = 2048,
        pattern = r"^[hH][tT][tT][pP][sS]?://([A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*|\[[0-9A-Fa-f]{0,4}(:[0-9A-Fa-f]{0,4}){2,7}\])(:(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4}))?([/?#][!-~]*)?$",
        example = "https://example.com/hooks/payments"
    )]
    pub url: String,
    /// The types it is sent; absent or empty: every type.
    #[schema(value_type = Option<Vec<EventTypeSchema>>)]
    pub types: Option<Vec<String>>,
    /// For people, at most 500 characters, no control characters.
    #[schema(max_length = 500, pattern = r"^[^\u0000-\u001F\u007F-\u009F]*$")]
    pub description: Option<String>,
}

/// A registered endpoint. Its `Debug` leaves the secret out.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(example = json!({"id": "wh_6b0619d67d0e8af2ac0b1adf", "url": "https://example.com/hooks/payments", "types": ["transfer.done"], "tenant": "acme", "createdAt": "2026-11-26T13:00:00Z"}))]
pub struct WebhookResponse {
    pub id: String,
    pub url: String,
    /// The types it is sent; empty: every type.
    pub types: Vec<EventTypeSchema>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub description: Option<String>,
    /// The tenant whose key registered it, sent only that tenant's events
    /// (`docs/tenants.md`); null for a platform webhook, sent every event.
    #[schema(required = true)]
    pub tenant: Option<String>,
    pub created_at: DateTime<Utc>,
    /// The signing secret (`whsec_<base64>`, the Standard Webhooks form): in the answer
    /// to the registration, or to the rotation that made it, only; never again.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub secret: Option<String>,
    /// During a rotation's overlap: until when deliveries are also signed with the
    /// secret the rotation replaced (each `webhook-signature` then has two signatures).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub previous_secret_expires_at: Option<DateTime<Utc>>,
}

impl std::fmt::Debug for WebhookResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookResponse")
            .field("id", &self.id)
            .field("url", &self.url)
            .field("types", &self.types)
            .field("tenant", &self.tenant)
            .field("created_at", &self.created_at)
            .field("secret", &self.secret.as_ref().map(|_| ".."))
            .finish_non_exhaustive()
    }
}

impl WebhookResponse {
    fn of(w: Webhook, with_secret: bool) -> WebhookResponse {
        WebhookResponse {
            secret: with_secret.then(|| w.secret.expose()),
            previous_secret_expires_at: w.previous.as_ref().map(|(_, until)| *until),
            id: w.id,
            url: w.url.as_str().to_owned(),
            types: w.types.into_iter().map(EventTypeSchema::from).collect(),
            description: w.description,
            tenant: w.tenant.map(|t| t.to_string()),
            created_at: w.created_at,
        }
    }
}

/// A request to rotate a webhook's secret.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"overlapSeconds": 86400}))]
pub struct RotateSecretRequest {
    /// How long deliveries are still signed with the secret replaced too, in seconds, 0
    /// to 604800 (7 days). Absent: 86400 (24 hours).
    #[schema(minimum = 0, maximum = 604800)]
    pub overlap_seconds: Option<u64>,
}

/// A page of the registered endpoints, oldest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookList {
    pub items: Vec<WebhookResponse>,
    /// Pass as `after` to get the next page; null on the last page.
    #[schema(required = true)]
    pub next: Option<String>,
}

/// Where a delivery stands.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum DeliveryStateSchema {
    Pending,
    Succeeded,
    Failed,
}

impl From<DeliveryState> for DeliveryStateSchema {
    fn from(s: DeliveryState) -> Self {
        match s {
            DeliveryState::Pending => DeliveryStateSchema::Pending,
            DeliveryState::Succeeded => DeliveryStateSchema::Succeeded,
            DeliveryState::Failed => DeliveryStateSchema::Failed,
        }
    }
}

/// One attempt to deliver.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AttemptResponse {
    pub at: DateTime<Utc>,
    /// The HTTP status the endpoint answered, if it answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub status: Option<u16>,
    /// Why there was no 2xx answer, if there was none (refused, time-out, address not
    /// allowed).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub error: Option<String>,
    pub duration_ms: u64,
}

impl From<Attempt> for AttemptResponse {
    fn from(a: Attempt) -> Self {
        AttemptResponse {
            at: a.at,
            status: a.status,
            error: a.error,
            duration_ms: a.duration_ms,
        }
    }
}

/// An event on its way to an endpoint.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryResponse {
    /// `<webhook id>:<event id>`.
    pub id: String,
    /// The event's id: the `webhook-id` header of every attempt.
    pub event_id: String,
    pub event_type: EventTypeSchema,
    pub state: DeliveryStateSchema,
    /// Oldest first (the latest 100 are kept).
    pub attempts: Vec<AttemptResponse>,
    /// When the next attempt is due, while pending.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
}

impl From<Delivery> for DeliveryResponse {
    fn from(d: Delivery) -> Self {
        DeliveryResponse {
            id: d.id,
            event_id: d.event_id,
            event_type: d.event_type.into(),
            state: d.state.into(),
            attempts: d.attempts.into_iter().map(AttemptResponse::from).collect(),
            next_attempt_at: d.next_attempt_at,
            created_at: d.created_at,
        }
    }
}

/// A page of a webhook's deliveries, newest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct DeliveryList {
    pub items: Vec<DeliveryResponse>,
    /// Pass as `after` to get the older deliveries; null on the last page.
    #[schema(required = true)]
    pub next: Option<String>,
}

/// The listing of deliveries, as sent.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DeliveryParams {
    /// Only deliveries in this state.
    #[param(value_type = Option<DeliveryStateSchema>)]
    pub state: Option<String>,
    /// How many to return, 1 to 1000. Default 100.
    #[param(value_type = Option<u32>, minimum = 1, maximum = 1000, example = 100)]
    pub limit: Option<String>,
    /// The `next` of the previous page (with the same `state`): the deliveries older
    /// than it. Opaque. Absent: from the newest.
    #[param(min_length = 1, pattern = "^[A-Za-z0-9_-]+$")]
    pub after: Option<String>,
}

/// Register a webhook.
///
/// The endpoint is sent every event of its types recorded from now on, each `POST`ed as
/// Standard Webhooks describe (`webhook-id`, `webhook-timestamp`, `webhook-signature`),
/// retried with exponential backoff until a 2xx answer or the give-up time. The answer
/// carries the signing secret, the only time it is shown.
#[utoipa::path(
    post, path = "/webhooks", tag = "webhooks",
    request_body = CreateWebhookRequest,
    responses(
        (status = 201, description = "Registered; the answer has the secret.", body = WebhookResponse,
            headers(("Location" = String, description = "The URL of the webhook: /webhooks/{id}.")),
            links(
                ("GetWebhook" = (operation_id = "get_webhook", parameters(("id" = "$response.body#/id")))),
                ("ListDeliveries" = (operation_id = "list_deliveries", parameters(("id" = "$response.body#/id")))),
                ("RotateSecret" = (operation_id = "rotate_secret", parameters(("id" = "$response.body#/id")))),
                ("DeleteWebhook" = (operation_id = "delete_webhook", parameters(("id" = "$response.body#/id")))),
            )),
        (status = 400, response = MalformedJson),
        (status = 409, response = WebhookLimitReached),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, response = WebhookRefused),
        (status = 503, response = Unavailable),
    )
)]
pub async fn create_webhook(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    ApiJson(body): ApiJson<CreateWebhookRequest>,
) -> Result<impl IntoResponse, ApiError> {
    let mut types = Vec::new();
    for raw in body.types.unwrap_or_default() {
        let kind = field("types", EventType::parse(&raw))?;
        if !types.contains(&kind) {
            types.push(kind);
        }
    }
    let description = body
        .description
        .map(|d| {
            let fits =
                d.chars().count() <= MAX_DESCRIPTION_CHARS && !d.chars().any(char::is_control);
            field(
                "description",
                fits.then_some(d).ok_or_else(|| {
                    ParseError(format!(
                        "must be at most {MAX_DESCRIPTION_CHARS} characters, no control characters"
                    ))
                }),
            )
        })
        .transpose()?;
    let new = NewWebhook {
        url: field("url", WebhookUrl::parse(&body.url))?,
        types,
        description,
        scope,
    };
    let webhook = state.service.webhooks().register_webhook(new).await?;
    let mut headers = HeaderMap::new();
    if let Ok(location) = HeaderValue::from_str(&format!("/webhooks/{}", webhook.id)) {
        headers.insert(header::LOCATION, location);
    }
    Ok((
        StatusCode::CREATED,
        headers,
        Json(WebhookResponse::of(webhook, true)),
    ))
}

/// List the webhooks, oldest first.
#[utoipa::path(
    get, path = "/webhooks", tag = "webhooks",
    params(PageParams),
    responses(
        (status = 200, description = "A page of webhooks, oldest first, without secrets.", body = WebhookList,
            links(("NextPage" = (operation_id = "list_webhooks", parameters(("after" = "$response.body#/next")), description = "The next page, while `next` is not null.")))),
        (status = 400, response = InvalidParameter),
        (status = 503, response = Unavailable),
    )
)]
pub async fn list_webhooks(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: Result<Query<PageParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<WebhookList>, ApiError> {
    let request = super::query(query)?.parse("webhooks", read_time_and_id)?;
    let after = request.after.as_ref().map(|(at, id)| (*at, id.as_str()));
    let fetched = state
        .service
        .webhooks()
        .webhooks(&scope, after, request.limit + 1)
        .await?;
    let page = page(
        fetched,
        request.limit,
        "webhooks",
        |w| time_and_id(w.created_at, &w.id),
        |w| WebhookResponse::of(w, false),
    );
    Ok(Json(WebhookList {
        items: page.items,
        next: page.next,
    }))
}

/// Read a webhook.
#[utoipa::path(
    get, path = "/webhooks/{id}", tag = "webhooks",
    params(("id" = String, Path, description = "The webhook id.", example = "wh_6b0619d67d0e8af2ac0b1adf")),
    responses(
        (status = 200, description = "The webhook, without its secret.", body = WebhookResponse),
        (status = 404, response = WebhookNotFound),
        (status = 503, response = Unavailable),
    )
)]
pub async fn get_webhook(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Json<WebhookResponse>, ApiError> {
    let webhook = state.service.webhooks().webhook(&scope, &id).await?;
    Ok(Json(WebhookResponse::of(webhook, false)))
}

/// Delete a webhook.
///
/// Nothing more is sent to it, and its deliveries are forgotten.
#[utoipa::path(
    delete, path = "/webhooks/{id}", tag = "webhooks",
    params(("id" = String, Path, description = "The webhook id.", example = "wh_6b0619d67d0e8af2ac0b1adf")),
    responses(
        (status = 204, description = "Deleted."),
        (status = 404, response = WebhookNotFound),
        (status = 503, response = Unavailable),
    )
)]
pub async fn delete_webhook(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    state.service.webhooks().delete_webhook(&scope, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Rotate a webhook's secret.
///
/// The answer carries the new secret, the only time it is shown. For the overlap
/// (`overlapSeconds`, 24 hours by default, 7 days at most, by the database's clock) every
/// delivery carries two signatures in `webhook-signature`, the new secret's and the
/// replaced one's, so a receiver verifies with either while it moves to the new one;
/// after it, the new secret's only. A rotation during an overlap ends that overlap: the
/// secret it replaces (the newest) becomes the previous one.
#[utoipa::path(
    post, path = "/webhooks/{id}/rotate-secret", tag = "webhooks",
    params(("id" = String, Path, description = "The webhook id.", example = "wh_6b0619d67d0e8af2ac0b1adf")),
    request_body(content = RotateSecretRequest, description = "Optional: the overlap."),
    responses(
        (status = 200, description = "Rotated; the answer has the new secret.", body = WebhookResponse),
        (status = 400, response = MalformedJson),
        (status = 404, response = WebhookNotFound),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, response = InvalidRotation),
        (status = 503, response = Unavailable),
    )
)]
pub async fn rotate_secret(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    OptionalApiJson(body): OptionalApiJson<RotateSecretRequest>,
) -> Result<Json<WebhookResponse>, ApiError> {
    let max = MAX_ROTATION_OVERLAP.as_secs();
    let overlap = match body.overlap_seconds {
        None => DEFAULT_ROTATION_OVERLAP,
        Some(seconds) if seconds <= max => Duration::from_secs(seconds),
        Some(_) => {
            return Err(ApiError::InvalidField {
                field: "overlapSeconds".into(),
                detail: format!("overlapSeconds must be a whole number from 0 to {max}"),
            });
        }
    };
    let rotated = state
        .service
        .webhooks()
        .rotate_webhook_secret(&scope, &id, overlap)
        .await?;
    Ok(Json(WebhookResponse::of(rotated, true)))
}

/// List a webhook's deliveries.
///
/// Newest first, each with its attempts (time, status or error, duration) and the event it
/// carries.
#[utoipa::path(
    get, path = "/webhooks/{id}/deliveries", tag = "webhooks",
    params(("id" = String, Path, description = "The webhook id.", example = "wh_6b0619d67d0e8af2ac0b1adf"), DeliveryParams),
    responses(
        (status = 200, description = "A page of deliveries, newest first.", body = DeliveryList,
            links(
                ("RetryDelivery" = (operation_id = "retry_delivery",
                    parameters(("id" = "$request.path.id"), ("deliveryId" = "$response.body#/items/0/id")),
                    description = "Deliver the newest again (when it failed).")),
                ("NextPage" = (operation_id = "list_deliveries",
                    parameters(("id" = "$request.path.id"), ("after" = "$response.body#/next")),
                    description = "The older deliveries, while `next` is not null.")),
            )),
        (status = 400, response = InvalidParameter),
        (status = 404, response = WebhookNotFound),
        (status = 503, response = Unavailable),
    )
)]
pub async fn list_deliveries(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    query: Result<Query<DeliveryParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<DeliveryList>, ApiError> {
    let params = super::query(query)?;
    let wanted = params
        .state
        .as_deref()
        .map(|raw| {
            DeliveryState::parse(raw).map_err(|e| ApiError::InvalidParameter {
                field: "state".into(),
                detail: format!("state {e}"),
            })
        })
        .transpose()?;
    let limit = match params.limit.as_deref() {
        None => DEFAULT_DELIVERIES,
        Some(raw) => raw
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=MAX_DELIVERIES).contains(n))
            .ok_or_else(|| ApiError::InvalidParameter {
                field: "limit".into(),
                detail: format!("limit must be a whole number from 1 to {MAX_DELIVERIES}"),
            })?,
    };
    let before = params
        .after
        .as_deref()
        .map(|raw| after("deliveries", "after", raw, read_time_and_id))
        .transpose()?;
    let before = before.as_ref().map(|(at, id)| (*at, id.as_str()));
    let found = state
        .service
        .webhooks()
        .deliveries(&scope, &id, wanted, before, limit + 1)
        .await?;
    let page = page(
        found,
        limit,
        "deliveries",
        |d| time_and_id(d.created_at, &d.id),
        DeliveryResponse::from,
    );
    Ok(Json(DeliveryList {
        items: page.items,
        next: page.next,
    }))
}

/// Deliver a failed delivery again.
///
/// It becomes pending, due at once, and is tried for `WEBHOOK_GIVE_UP_AFTER_MS` more, with
/// the same `webhook-id` and body.
#[utoipa::path(
    post, path = "/webhooks/{id}/deliveries/{deliveryId}/retry", tag = "webhooks",
    params(
        ("id" = String, Path, description = "The webhook id.", example = "wh_6b0619d67d0e8af2ac0b1adf"),
        ("deliveryId" = String, Path, description = "The delivery id.", example = "wh_6b0619d67d0e8af2ac0b1adf:transfer.done:6b0619d67d0e8af2ac0b1ae0"),
    ),
    responses(
        (status = 200, description = "Pending again.", body = DeliveryResponse),
        (status = 404, response = DeliveryNotFound),
        (status = 409, response = DeliveryNotFailed),
        (status = 503, response = Unavailable),
    )
)]
pub async fn retry_delivery(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    Path((id, delivery)): Path<(String, String)>,
) -> Result<Json<DeliveryResponse>, ApiError> {
    let retried = state
        .service
        .webhooks()
        .retry_delivery(&scope, &id, &delivery)
        .await?;
    Ok(Json(retried.into()))
}
