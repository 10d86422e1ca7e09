//! `/api-keys`: API keys made, listed and revoked through the API (`docs/tenants.md`).
//! Only admin keys may call these routes (`auth`); a tenant's admin key manages its own
//! tenant's keys only, and another tenant's key is not found.

use axum::Json;
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::AppState;
use super::extract::ApiJson;
use super::pagination::{Page, PageParams, page};
use super::problem::{ApiError, field};
use super::responses::{
    ApiKeyNotFound, ApiKeyRefused, Forbidden, InvalidParameter, MalformedJson, PayloadTooLarge,
    Unavailable, UnsupportedMediaType,
};
use crate::domain::{ApiKeyId, KeyRecord, Role, Scope, TenantName};

/// A request to make an API key.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"tenant": "acme", "role": "rw"}))]
pub struct CreateApiKeyRequest {
    /// The tenant whose key it is: 1 to 64 characters from `a-z0-9_-`. Left out: a
    /// platform key (a platform admin key only); a tenant's admin key makes keys of its
    /// own tenant, whether it names it or not.
    #[schema(pattern = "^[a-z0-9_-]{1,64}$")]
    pub tenant: Option<String>,
    /// `ro` reads, `rw` reads and writes, `admin` also manages keys.
    #[schema(value_type = String, pattern = "^(ro|rw|admin)$", example = "rw")]
    pub role: String,
}

/// An API key, as listed: never its secret.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(example = json!({"id": "4f1c2a0e9b7d6c5a4f1c2a0e9b7d6c5a", "tenant": "acme", "role": "rw", "createdAt": "2026-11-28T10:00:00Z", "lastUsedAt": null}))]
pub struct ApiKeyResponse {
    /// The key's public id (32 hexadecimal digits), for logs and listings.
    pub id: String,
    /// Its tenant; null for a platform key.
    #[schema(required = true)]
    pub tenant: Option<String>,
    /// `ro`, `rw` or `admin`.
    pub role: String,
    pub created_at: DateTime<Utc>,
    /// About when it was last used (noted at most once a minute); null if never.
    #[schema(required = true)]
    pub last_used_at: Option<DateTime<Utc>>,
}

/// A key just made: the listed fields, and its secret, shown this once.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(example = json!({"id": "4f1c2a0e9b7d6c5a4f1c2a0e9b7d6c5a", "key": "tsk_3q2-7wHf9XcM0xZyQqk1Jv8cS5dE6fG7hI8jK9lM0nO", "tenant": "acme", "role": "rw", "createdAt": "2026-11-28T10:00:00Z", "lastUsedAt": null}))]
pub struct CreatedApiKey {
    #[serde(flatten)]
    pub listed: ApiKeyResponse,
    /// The secret to send as `Authorization: Bearer <key>`. Shown only in this answer:
    /// the service keeps only its digest.
    pub key: String,
}

/// A page of API keys, in id order.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApiKeyPage {
    pub items: Vec<ApiKeyResponse>,
    /// Pass as `after` to get the next page; null on the last page.
    #[schema(required = true)]
    pub next: Option<String>,
}

impl From<Page<ApiKeyResponse>> for ApiKeyPage {
    fn from(page: Page<ApiKeyResponse>) -> Self {
        ApiKeyPage {
            items: page.items,
            next: page.next,
        }
    }
}

impl From<KeyRecord> for ApiKeyResponse {
    fn from(k: KeyRecord) -> Self {
        ApiKeyResponse {
            id: k.id.to_string(),
            tenant: k.tenant.map(|t| t.to_string()),
            role: k.role.as_str().to_owned(),
            created_at: k.created_at,
            last_used_at: k.last_used_at,
        }
    }
}

/// Make an API key.
///
/// The answer carries the key's secret, once: the service stores only its digest. The
/// key works on every instance at once.
#[utoipa::path(
    post, path = "/api-keys", tag = "api-keys",
    request_body = CreateApiKeyRequest,
    responses(
        (status = 201, description = "The key was made; `key` is its secret, shown only here.", body = CreatedApiKey,
            links(("DeleteApiKey" = (operation_id = "delete_api_key", parameters(("id" = "$response.body#/id")), description = "Revoke it.")))),
        (status = 400, response = MalformedJson),
        (status = 403, response = Forbidden),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, response = ApiKeyRefused),
        (status = 503, response = Unavailable),
    )
)]
pub async fn create_api_key(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    ApiJson(body): ApiJson<CreateApiKeyRequest>,
) -> Result<(StatusCode, Json<CreatedApiKey>), ApiError> {
    let role = field("role", Role::parse(&body.role))?;
    let tenant = body
        .tenant
        .as_deref()
        .map(|raw| field("tenant", TenantName::parse(raw)))
        .transpose()?;
    // A tenant's admin makes keys of its own tenant only.
    let tenant = scope
        .tenant_of_new(tenant)
        .map_err(|_| ApiError::Forbidden)?;
    let made = state.keys.make(tenant, role).await?;
    Ok((
        StatusCode::CREATED,
        Json(CreatedApiKey {
            listed: made.record.into(),
            key: made.secret,
        }),
    ))
}

/// List API keys in id order (a tenant's admin key: its tenant's only).
#[utoipa::path(
    get, path = "/api-keys", tag = "api-keys",
    params(PageParams),
    responses(
        (status = 200, description = "A page of API keys, without their secrets.", body = ApiKeyPage,
            links(("NextPage" = (operation_id = "list_api_keys", parameters(("after" = "$response.body#/next")), description = "The next page, while `next` is not null.")))),
        (status = 400, response = InvalidParameter),
        (status = 403, response = Forbidden),
        (status = 503, response = Unavailable),
    )
)]
pub async fn list_api_keys(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: Result<Query<PageParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<ApiKeyPage>, ApiError> {
    let request = super::query(query)?.parse("api-keys", |key| ApiKeyId::parse(key).ok())?;
    let fetched = state
        .keys
        .list(scope.tenant(), request.after.as_ref(), request.limit + 1)
        .await?;
    Ok(Json(
        page(
            fetched,
            request.limit,
            "api-keys",
            |k| k.id.to_string(),
            ApiKeyResponse::from,
        )
        .into(),
    ))
}

/// Revoke an API key.
///
/// Refused from then on: at once by this instance, within about a second by every other.
#[utoipa::path(
    delete, path = "/api-keys/{id}", tag = "api-keys",
    params(("id" = String, Path, description = "The key's id, 32 hexadecimal digits.", pattern = "^[0-9a-f]{32}$", example = "4f1c2a0e9b7d6c5a4f1c2a0e9b7d6c5a")),
    responses(
        (status = 204, description = "The key is revoked."),
        (status = 403, response = Forbidden),
        (status = 404, response = ApiKeyNotFound),
        (status = 503, response = Unavailable),
    )
)]
pub async fn delete_api_key(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let id = ApiKeyId::parse(&id)
        .map_err(|_| ApiError::ApiKeyNotFound(id.chars().take(80).collect()))?;
    state.keys.revoke(&id, scope.tenant()).await?;
    Ok(StatusCode::NO_CONTENT)
}
