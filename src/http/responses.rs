//! The error answers of the OpenAPI document, named once and shared by the routes: each
//! type here is one `components.responses` entry, a [`Problem`] sent as
//! `application/problem+json`, for one status and one set of `code`s. A route lists
//! them as `(status = 404, response = TransferNotFound)`.
//!
//! Each description names its codes in backticks: [`super::docs::complete`] adds an
//! example of each from the [`ApiError`](super::ApiError) the server answers with, and
//! its tests check that every code belongs to the status the route documents it at.
//! What one route alone promises (why its 503 is safe to retry, say) is in the route's
//! own description, so that the shared text stays true on every route that uses it.
//!
//! The types are never built: they exist for the document. Each is registered in
//! [`super::ApiDoc`]; a test fails on one that a route refers to and the document lacks,
//! and on one that no route uses.

use utoipa::ToResponse;

use super::problem::{PROBLEM_JSON, Problem};

// 400

#[derive(ToResponse)]
#[response(
    description = "`malformed_json`: the body is not JSON.",
    content_type = PROBLEM_JSON
)]
pub struct MalformedJson(pub Problem);

#[derive(ToResponse)]
#[response(
    description = "`invalid_parameter`: a query parameter is invalid; `field` names it.",
    content_type = PROBLEM_JSON
)]
pub struct InvalidParameter(pub Problem);

// 401, 403: added to every operation that is not public by `auth::SecurityDoc`.

#[derive(ToResponse)]
#[response(
    description = "`unauthorized`: no API key, or not a valid one (only when the server is configured with API keys).",
    content_type = PROBLEM_JSON,
    headers(("WWW-Authenticate" = String, description = "The scheme to authenticate with: `Bearer`."))
)]
pub struct Unauthorized(pub Problem);

#[derive(ToResponse)]
#[response(
    description = "`forbidden`: the API key's role does not allow this: a read-only key on a write or on `/webhooks`, a key that is not an admin on `/api-keys`, a tenant's admin key making a key for another tenant, or a tenant's key capturing, voiding or cancelling a transfer it sees that moves accounts not its tenant's.",
    content_type = PROBLEM_JSON
)]
pub struct Forbidden(pub Problem);

// 404

#[derive(ToResponse)]
#[response(
    description = "`account_not_found`: no such account.",
    content_type = PROBLEM_JSON
)]
pub struct AccountNotFound(pub Problem);

#[derive(ToResponse)]
#[response(
    description = "`transfer_not_found`: no such transfer.",
    content_type = PROBLEM_JSON
)]
pub struct TransferNotFound(pub Problem);

// 409

#[derive(ToResponse)]
#[response(
    description = "`account_exists`: an account with this id exists.",
    content_type = PROBLEM_JSON
)]
pub struct AccountExists(pub Problem);

/// `POST /transfers`: the replay of a transfer canceled by request.
#[derive(ToResponse)]
#[response(
    description = "`transfer_canceled`: a retry with the same Idempotency-Key, of a transfer that was canceled by request before it completed; `transferId` names it.",
    content_type = PROBLEM_JSON,
    headers(
        ("Location" = String, description = "The URL of the transfer: /transfers/{id}."),
        ("Idempotent-Replayed" = Option<String>, description = "`true` when this answers a retry with the same Idempotency-Key."),
    )
)]
pub struct TransferCanceled(pub Problem);

/// `POST /transfers/{id}/cancel`: the compensating transfer was canceled.
#[derive(ToResponse)]
#[response(
    description = "`transfer_canceled`: the compensating transfer (`transferId`) was itself canceled by request; nothing changed.",
    content_type = PROBLEM_JSON
)]
pub struct ReversalCanceled(pub Problem);

/// `POST /transfers/{id}/capture`: a capture the hold cannot take.
#[derive(ToResponse)]
#[response(
    description = "`not_a_hold`; `hold_already_captured` (with another amount); `hold_voided`; `hold_expired`; `hold_pending` (still being reserved: retry shortly). `transferId` names the hold.",
    content_type = PROBLEM_JSON
)]
pub struct CaptureRefused(pub Problem);

/// `POST /transfers/{id}/void`: a void the hold cannot take.
#[derive(ToResponse)]
#[response(
    description = "`not_a_hold`; `hold_already_captured`. `transferId` names the hold.",
    content_type = PROBLEM_JSON
)]
pub struct VoidRefused(pub Problem);

// 413

#[derive(ToResponse)]
#[response(
    description = "`payload_too_large`: the body is over 64 KiB.",
    content_type = PROBLEM_JSON
)]
pub struct PayloadTooLarge(pub Problem);

// 415

#[derive(ToResponse)]
#[response(
    description = "`unsupported_media_type`: the body is not sent as application/json.",
    content_type = PROBLEM_JSON
)]
pub struct UnsupportedMediaType(pub Problem);

// 422

/// `POST /accounts`: the request is refused.
#[derive(ToResponse)]
#[response(
    description = "`invalid_field`: a field is invalid; `field` names it. `unknown_deployment`: no deployment has that name.",
    content_type = PROBLEM_JSON
)]
pub struct AccountRefused(pub Problem);

/// `GET /accounts/{id}/balance`: the moment asked about is not a time.
#[derive(ToResponse)]
#[response(
    description = "`invalid_field`: `at` is not an RFC 3339 time; `field` names it.",
    content_type = PROBLEM_JSON
)]
pub struct InvalidTime(pub Problem);

/// `POST /transfers`: refused before anything was recorded, or recorded and canceled.
#[derive(ToResponse)]
#[response(
    description = "Refused, nothing recorded: `invalid_field` (`field` names it), `invalid_header`, `unknown_account`, `same_account`, `currency_mismatch`, `idempotency_key_reused`. Or recorded and canceled, with `transferId` and a Location: `insufficient_funds`, `balance_overflow`, or `unknown_account` when an account vanished meanwhile.",
    content_type = PROBLEM_JSON,
    headers(
        ("Location" = Option<String>, description = "The URL of the transfer, when one was recorded: /transfers/{id}."),
        ("Idempotent-Replayed" = Option<String>, description = "`true` when this answers a retry with the same Idempotency-Key."),
    )
)]
pub struct TransferRefused(pub Problem);

/// `POST /transfers/{id}/cancel`: the reversal is refused.
#[derive(ToResponse)]
#[response(
    description = "The reversal was refused and nothing changed: `insufficient_funds` (the destination cannot fund it), `balance_overflow` (it would take the source past the largest balance) or `unknown_account` (the source no longer exists); `transferId` names the compensating transfer when one was recorded.",
    content_type = PROBLEM_JSON
)]
pub struct ReversalRefused(pub Problem);

/// `POST /transfers/{id}/capture`: the amount is refused.
#[derive(ToResponse)]
#[response(
    description = "`invalid_field`: `amount` is not an integer from 1 to the held amount, or, for a multi-leg hold, not the held amount.",
    content_type = PROBLEM_JSON
)]
pub struct InvalidCaptureAmount(pub Problem);

// 503

/// Routes not admitted against the limit of transfers in flight: the reads, and opening
/// an account.
/// `POST /webhooks`: refused, nothing registered.
#[derive(ToResponse)]
#[response(
    description = "Refused, nothing registered: `invalid_field` (`field` names it: `url`, `types`, `description`), or `webhook_url_not_allowed` (the URL is, or resolves to, an address that is not public: loopback, private, link-local, unique-local, site-local, shared, reserved, benchmarking, documentation, or an IPv6 form of one of those; or to none).",
    content_type = PROBLEM_JSON
)]
pub struct WebhookRefused(pub Problem);

#[derive(ToResponse)]
#[response(
    description = "`webhook_not_found`: no such webhook.",
    content_type = PROBLEM_JSON
)]
pub struct WebhookNotFound(pub Problem);

#[derive(ToResponse)]
#[response(
    description = "`api_key_not_found`: no such API key (a key of another tenant is not found either).",
    content_type = PROBLEM_JSON
)]
pub struct ApiKeyNotFound(pub Problem);

#[derive(ToResponse)]
#[response(
    description = "`invalid_field`: `role` or `tenant` is missing or not valid.",
    content_type = PROBLEM_JSON
)]
pub struct ApiKeyRefused(pub Problem);

#[derive(ToResponse)]
#[response(
    description = "`webhook_not_found` or `delivery_not_found`: no such webhook, or no such delivery of it.",
    content_type = PROBLEM_JSON
)]
pub struct DeliveryNotFound(pub Problem);

#[derive(ToResponse)]
#[response(
    description = "`delivery_not_failed`: only a failed delivery is retried by hand; this one is pending or succeeded.",
    content_type = PROBLEM_JSON
)]
pub struct DeliveryNotFailed(pub Problem);

/// `POST /webhooks/{id}/rotate-secret`: the overlap is refused.
#[derive(ToResponse)]
#[response(
    description = "`invalid_field` (`field` is `overlapSeconds`): not a whole number from 0 to 604800; nothing rotated.",
    content_type = PROBLEM_JSON
)]
pub struct InvalidRotation(pub Problem);

/// `POST /webhooks`: the cap is reached.
#[derive(ToResponse)]
#[response(
    description = "`webhook_limit_reached`: as many webhooks are registered as the server allows the caller's tenant, or the platform's keys (`MAX_WEBHOOKS`, 1000 by default), or as it allows all together (`MAX_WEBHOOKS_TOTAL`, 10000 by default); nothing registered. Delete one first.",
    content_type = PROBLEM_JSON
)]
pub struct WebhookLimitReached(pub Problem);

/// `GET /events`: the cursor is too old.
#[derive(ToResponse)]
#[response(
    description = "`cursor_expired`: events after the cursor were removed after the retention (`EVENT_RETENTION_MS`), or lost (the recorder could not record them: `event_feed_gaps_total`); read again from the oldest retained event, without `after`.",
    content_type = PROBLEM_JSON
)]
pub struct CursorExpired(pub Problem);

/// `GET /events/stream`: no room for another stream.
#[derive(ToResponse)]
#[response(
    description = "`too_many_streams`: as many event streams are open on this instance as `MAX_EVENT_STREAMS` allows, or as many of the caller's tenant as `MAX_EVENT_STREAMS_PER_TENANT` allows (the platform's keys count as one tenant); retry after `Retry-After` seconds, or read `GET /events`. Or `database_unavailable`.",
    content_type = PROBLEM_JSON,
    headers(("Retry-After" = Option<String>, description = "Seconds to wait before retrying."))
)]
pub struct TooManyStreams(pub Problem);

#[derive(ToResponse)]
#[response(
    description = "`database_unavailable` or `request_timeout`: try again later.",
    content_type = PROBLEM_JSON
)]
pub struct Unavailable(pub Problem);

/// A change to an existing transfer, admitted against the limit of transfers in flight;
/// each such route answers the same when sent again.
#[derive(ToResponse)]
#[response(
    description = "`database_unavailable`, `request_timeout`, `overloaded` (with `Retry-After`) or `contended` (with `Retry-After`: the transfer kept changing under the request, which stopped trying; `transferId` names it): sending the same request again is safe.",
    content_type = PROBLEM_JSON,
    headers(("Retry-After" = Option<String>, description = "Seconds to wait before retrying, with `overloaded` and `contended`."))
)]
pub struct UnavailableOrOverloaded(pub Problem);

/// `POST /transfers`: safe to retry only with the same Idempotency-Key.
#[derive(ToResponse)]
#[response(
    description = "`database_unavailable` or `request_timeout`: retry with the same Idempotency-Key. `overloaded` (with `Retry-After`): nothing was recorded; retry after that many seconds. `contended` (with `Retry-After`): the request kept losing to concurrent ones (on the same account, or with the same Idempotency-Key); with `transferId` the transfer is recorded and will be finished (read it, or retry with the same Idempotency-Key to be answered with it; without a key a retry makes another transfer); without `transferId` this request recorded nothing: retry after that many seconds, with the same Idempotency-Key if it had one.",
    content_type = PROBLEM_JSON,
    headers(("Retry-After" = Option<String>, description = "Seconds to wait before retrying, with `overloaded` and `contended`."))
)]
pub struct TransferUnavailable(pub Problem);

/// `GET /ready`: the instance should get no traffic for now.
#[derive(ToResponse)]
#[response(
    description = "`database_unavailable` or `request_timeout`: no deployment answers (`detail` names them); `overloaded`: the instance has as many transfers in flight as it admits. Send no traffic here for now.",
    content_type = PROBLEM_JSON
)]
pub struct NotReady(pub Problem);
