//! The HTTP API: routes, request and response types (separate from the stored
//! documents), the problem+json error type, and the OpenAPI document.
//!
//! Handlers only translate: they parse the request into domain values, call the part of
//! the [`TransferService`] their resource needs (its requests, account book, feed or
//! webhooks), and turn the answer (or the [`ApiError`]) into a response.

pub mod accounts;
pub mod api_keys;
pub mod auth;
pub mod connections;
pub mod detached;
pub mod docs;
pub mod events;
pub mod extract;
pub mod health;
pub mod ledger;
pub mod metrics;
pub mod pagination;
pub mod problem;
pub mod responses;
pub mod transfers;
pub mod webhooks;
pub mod write_limit;

use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::extract::rejection::QueryRejection;
use axum::http::{HeaderName, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnFailure, TraceLayer};
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::service::{KeyBook, TransferService};
pub use problem::{ApiError, PROBLEM_JSON, Problem};

/// The largest request body accepted. A transfer request is well under 1 KiB.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// What every handler gets.
#[derive(Clone)]
pub struct AppState {
    pub service: TransferService,
    /// The API keys made through the API (`/api-keys`, and the key check).
    pub keys: KeyBook,
    /// Cancelled at shutdown: ends the event streams, which would otherwise keep their
    /// connections (and the graceful shutdown) open for ever.
    pub shutdown: tokio_util::sync::CancellationToken,
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "transfer-service",
        description = "Moves money between accounts stored in MongoDB with the two-phase-commit pattern. Amounts are integers in minor units. Errors are RFC 9457 application/problem+json.",
        license(name = "MIT", identifier = "MIT"),
    ),
    servers((url = "/", description = "The host that serves this document.")),
    tags(
        (name = "accounts", description = "Open and read accounts."),
        (name = "transfers", description = "Move money, read and cancel transfers."),
        (name = "events", description = "What happened: transfers that reached held, done or canceled, and accounts opened."),
        (name = "webhooks", description = "Endpoints sent the events, signed (Standard Webhooks), and their deliveries. A read-write key is needed, to read too."),
        (name = "api-keys", description = "API keys made, listed and revoked through the API; a tenant's key sees only its tenant. An admin key is needed."),
        (name = "operations", description = "Health and readiness."),
    ),
    components(
        schemas(Problem),
        // Every shared error answer a route refers to (see `responses`).
        responses(
            responses::MalformedJson,
            responses::InvalidParameter,
            responses::Unauthorized,
            responses::Forbidden,
            responses::AccountNotFound,
            responses::TransferNotFound,
            responses::AccountExists,
            responses::TransferCanceled,
            responses::ReversalCanceled,
            responses::CaptureRefused,
            responses::VoidRefused,
            responses::PayloadTooLarge,
            responses::UnsupportedMediaType,
            responses::AccountRefused,
            responses::InvalidTime,
            responses::CursorExpired,
            responses::TooManyStreams,
            responses::WebhookRefused,
            responses::WebhookNotFound,
            responses::ApiKeyNotFound,
            responses::ApiKeyRefused,
            responses::DeliveryNotFound,
            responses::DeliveryNotFailed,
            responses::WebhookLimitReached,
            responses::InvalidRotation,
            responses::TransferRefused,
            responses::ReversalRefused,
            responses::InvalidCaptureAmount,
            responses::Unavailable,
            responses::UnavailableOrOverloaded,
            responses::TransferUnavailable,
            responses::NotReady,
        )
    )
)]
pub struct ApiDoc;

fn x_request_id() -> HeaderName {
    HeaderName::from_static("x-request-id")
}

/// Every documented route; the OpenAPI document is derived from the same list.
fn api_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(accounts::create_account, accounts::list_accounts))
        .routes(routes!(accounts::get_account))
        .routes(routes!(accounts::list_account_transfers))
        .routes(routes!(ledger::list_entries))
        .routes(routes!(ledger::get_balance))
        .routes(routes!(
            transfers::create_transfer,
            transfers::list_transfers
        ))
        .routes(routes!(transfers::get_transfer))
        .routes(routes!(transfers::cancel_transfer))
        .routes(routes!(transfers::capture_transfer))
        .routes(routes!(transfers::void_transfer))
        .routes(routes!(events::list_events))
        .routes(routes!(events::stream_events))
        .routes(routes!(webhooks::create_webhook, webhooks::list_webhooks))
        .routes(routes!(webhooks::get_webhook, webhooks::delete_webhook))
        .routes(routes!(webhooks::list_deliveries))
        .routes(routes!(webhooks::retry_delivery))
        .routes(routes!(webhooks::rotate_secret))
        .routes(routes!(api_keys::create_api_key, api_keys::list_api_keys))
        .routes(routes!(api_keys::delete_api_key))
        .routes(routes!(health::health))
        .routes(routes!(health::ready))
        .routes(routes!(metrics::metrics))
}

/// The OpenAPI document, built without a database: what `/openapi.json` serves and what
/// `openapi/openapi.json` must equal.
pub fn openapi() -> utoipa::openapi::OpenApi {
    let (_, mut doc) = api_routes().split_for_parts();
    doc.info.version = env!("CARGO_PKG_VERSION").to_owned();
    utoipa::Modify::modify(&auth::SecurityDoc, &mut doc);
    docs::complete(&mut doc);
    doc
}

/// The whole application: routes, OpenAPI, fallbacks and middleware.
///
/// Every layer is installed with `Router::layer`, which wraps each route and the
/// fallback, so they all run after routing and see the matched route template. From the
/// outside in: metrics, request id, trace span, CORS (which answers preflights itself,
/// without a key), API keys, then the error shaping and limits around the handlers.
pub fn app(state: AppState, request_timeout: Duration, access: auth::Access) -> Router {
    let (router, _) = api_routes().split_for_parts();
    let doc = openapi();
    let keys = state.keys.clone();
    let router = router
        .with_state(state)
        .merge(docs::swagger_ui(doc))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(RequestBodyLimitLayer::new(MAX_BODY_BYTES))
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            request_timeout,
        ))
        .layer(axum::middleware::from_fn(problem_for_bare_errors))
        .layer(CatchPanicLayer::custom(|_| {
            ApiError::Internal.into_response()
        }))
        .layer(axum::middleware::from_fn_with_state(
            access.gate(keys),
            auth::require_api_key,
        ));
    let router = match access.cors_layer() {
        Some(cors) => router.layer(cors),
        None => router,
    };
    router
        .layer(PropagateRequestIdLayer::new(x_request_id()))
        .layer(
            TraceLayer::new_for_http().make_span_with(|request: &Request| {
                let id = request
                    .headers()
                    .get("x-request-id")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("-");
                tracing::info_span!("request", method = %request.method(), uri = %request.uri().path(), request_id = %id)
            })
            // A 5xx is logged where its cause is known (the store's errors); an
            // `overloaded` answer is a decision, counted in the metrics, and a burst of
            // them must not turn into a burst of log lines.
            .on_failure(DefaultOnFailure::new().level(tracing::Level::DEBUG)),
        )
        .layer(SetRequestIdLayer::new(x_request_id(), MakeRequestUuid))
        .layer(axum::middleware::from_fn(metrics::count_and_time))
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::RouteNotFound(uri.path().chars().take(200).collect())
}

async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

/// Middleware answers (body too large, time-out) come without a body; give them the
/// problem+json body every other error has.
async fn problem_for_bare_errors(request: Request, next: axum::middleware::Next) -> Response {
    let response = next.run(request).await;
    let is_problem = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(PROBLEM_JSON.as_bytes()));
    if is_problem {
        return response;
    }
    match response.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge.into_response(),
        StatusCode::SERVICE_UNAVAILABLE => ApiError::Timeout.into_response(),
        _ => response,
    }
}

/// Query-string parse failures (a repeated parameter, say) as problem+json.
pub(crate) fn query<T>(
    query: Result<axum::extract::Query<T>, QueryRejection>,
) -> Result<T, ApiError> {
    query.map(|q| q.0).map_err(|e| ApiError::InvalidParameter {
        field: "query".into(),
        detail: format!("the query string is invalid: {}", e.body_text()),
    })
}
