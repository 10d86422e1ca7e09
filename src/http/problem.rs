//! The one error type of the HTTP layer and its mapping to RFC 9457
//! `application/problem+json`. Every refusal a client can meet is a variant here with its
//! status and stable `code`; [`From<ServiceError>`] is the single place where service and
//! storage failures become HTTP. Bodies of 5xx answers are opaque: the cause goes to the
//! log, inside the request's span, never to the client.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::domain::{AccountId, CancelReason, Side, Transfer, TransferId};
use crate::error_chain::Chain;
use crate::service::{HoldConflict, ServiceError};

/// The media type of every error answer, and of its documentation.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// An RFC 9457 problem document.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(example = json!({
    "type": "urn:transfer-service:problem:insufficient_funds",
    "title": "Insufficient funds",
    "status": 422,
    "detail": "account alice cannot fund a transfer of 5000",
    "code": "insufficient_funds",
    "transferId": "65a1b2c3d4e5f60718293a4b"
}))]
pub struct Problem {
    /// A URI naming the kind of problem: `urn:transfer-service:problem:<code>`.
    #[serde(rename = "type")]
    pub problem_type: String,
    /// A short summary of the kind of problem, the same for every occurrence.
    pub title: String,
    /// The HTTP status code.
    #[schema(minimum = 400, maximum = 599)]
    pub status: u16,
    /// What went wrong this time, for a person to read.
    pub detail: String,
    /// A stable, machine-readable code; switch on this, not on `title` or `detail`.
    pub code: String,
    /// The request field or parameter at fault, for `invalid_field` and `invalid_parameter`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The transfer the problem is about, when one was recorded (a transfer refused for
    /// insufficient funds is recorded and ends `canceled`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transfer_id: Option<String>,
    /// The account at fault, for `insufficient_funds`, `balance_overflow` and (when
    /// known) `unknown_account`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
}

/// Every error answer the API gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiError {
    /// 400: the body is not JSON, or not the JSON shape expected at all.
    MalformedJson(String),
    /// 400: a query parameter is invalid.
    InvalidParameter { field: String, detail: String },
    /// 401: no or wrong API key.
    Unauthorized,
    /// 403: the API key's role does not allow this (a read-only key on a write or on
    /// `/webhooks`, a key that is not an admin on `/api-keys`, a tenant's admin naming
    /// another tenant).
    Forbidden,
    /// 403 `forbidden`: a tenant's key capturing, voiding or cancelling a transfer it
    /// sees that moves accounts not its tenant's (`docs/tenants.md`).
    TransferNotOwned(String),
    /// 404: no such account.
    AccountNotFound(String),
    /// 404: no such transfer.
    TransferNotFound(String),
    /// 404: no such route.
    RouteNotFound(String),
    /// 404: no such webhook.
    WebhookNotFound(String),
    /// 404: no such API key (or one of another tenant).
    ApiKeyNotFound(String),
    /// 404: no such delivery of the webhook.
    DeliveryNotFound(String),
    /// 409: a manual retry of a delivery that has not failed.
    DeliveryNotFailed(String),
    /// 422: the webhook URL resolves to an address deliveries may not go to.
    WebhookUrlNotAllowed(String),
    /// 409: as many webhooks are registered as `MAX_WEBHOOKS` allows the caller's
    /// tenant (or the platform), or `MAX_WEBHOOKS_TOTAL` all together (this cap).
    WebhookLimitReached(crate::domain::WebhookCap),
    /// 405: the route exists, the method does not.
    MethodNotAllowed,
    /// 409: the account id is taken.
    AccountExists(String),
    /// 409: the transfer was canceled by request before it completed.
    TransferCanceled { transfer_id: String, detail: String },
    /// 410: the events after the feed cursor were removed after the retention.
    CursorExpired,
    /// 413: the body is over the limit.
    PayloadTooLarge,
    /// 415: the body is not `application/json`.
    UnsupportedMediaType,
    /// 422: a field is well-formed JSON but invalid.
    InvalidField { field: String, detail: String },
    /// 422: a header is invalid.
    InvalidHeader { header: String, detail: String },
    /// 422: an account names a deployment that is not configured.
    UnknownDeployment(String),
    /// 422: a transfer names an account that does not exist (`account`, when known).
    UnknownAccount {
        detail: String,
        transfer_id: Option<String>,
        account: Option<String>,
    },
    /// 422: source equals destination.
    SameAccount,
    /// 422: the accounts hold different currencies.
    CurrencyMismatch(String),
    /// 422: the idempotency key was used with another request body.
    IdempotencyKeyReused,
    /// 422: the source cannot fund the transfer (or the destination its reversal).
    InsufficientFunds {
        detail: String,
        transfer_id: Option<String>,
        account: String,
    },
    /// 422: the credit would take `account` past the largest balance.
    BalanceOverflow {
        transfer_id: String,
        account: String,
    },
    /// 503: the database does not answer; retry later.
    DatabaseUnavailable,
    /// 503: these deployments do not answer (`/ready`).
    DeploymentsUnavailable(Vec<String>),
    /// 503: the request kept losing to concurrent writers (a hot account, a transfer
    /// moving under a cancel or capture, another request with the same idempotency key);
    /// retry after `Retry-After` seconds. `transfer_id` names the transfer when one is
    /// inserted: what was inserted stands, and the transfer is finished by its driver or
    /// the sweeper.
    Contended { transfer_id: Option<String> },
    /// 503: this instance has as many transfers in flight as it admits; retry after
    /// `Retry-After` seconds. Nothing was inserted.
    Overloaded,
    /// 503: as many event streams are open as `MAX_EVENT_STREAMS` allows, or as the
    /// caller's tenant may hold (`MAX_EVENT_STREAMS_PER_TENANT`).
    TooManyStreams(crate::service::FollowerLimit),
    /// 503: the request took longer than the server allows.
    Timeout,
    /// 500: a bug. The body says nothing more; the log has the cause.
    Internal,
    /// 409: a capture or void the hold cannot take; `transfer_id` names the hold.
    Hold {
        conflict: HoldConflict,
        transfer_id: String,
    },
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        use ApiError::*;
        match self {
            MalformedJson(_) | InvalidParameter { .. } => StatusCode::BAD_REQUEST,
            Unauthorized => StatusCode::UNAUTHORIZED,
            Forbidden | TransferNotOwned(_) => StatusCode::FORBIDDEN,
            AccountNotFound(_) | TransferNotFound(_) | RouteNotFound(_) | WebhookNotFound(_)
            | ApiKeyNotFound(_) | DeliveryNotFound(_) => StatusCode::NOT_FOUND,
            DeliveryNotFailed(_) | WebhookLimitReached(_) => StatusCode::CONFLICT,
            WebhookUrlNotAllowed(_) => StatusCode::UNPROCESSABLE_ENTITY,
            MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            AccountExists(_) | TransferCanceled { .. } | Hold { .. } => StatusCode::CONFLICT,
            CursorExpired => StatusCode::GONE,
            PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            InvalidField { .. }
            | InvalidHeader { .. }
            | UnknownAccount { .. }
            | UnknownDeployment(_)
            | SameAccount
            | CurrencyMismatch(_)
            | IdempotencyKeyReused
            | InsufficientFunds { .. }
            | BalanceOverflow { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            DatabaseUnavailable
            | DeploymentsUnavailable(_)
            | Contended { .. }
            | Overloaded
            | TooManyStreams(_)
            | Timeout => StatusCode::SERVICE_UNAVAILABLE,
            Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The stable machine-readable code and its title.
    pub fn code_and_title(&self) -> (&'static str, &'static str) {
        use ApiError::*;
        match self {
            MalformedJson(_) => ("malformed_json", "Malformed JSON"),
            InvalidParameter { .. } => ("invalid_parameter", "Invalid parameter"),
            Unauthorized => ("unauthorized", "Unauthorized"),
            Forbidden | TransferNotOwned(_) => ("forbidden", "Forbidden"),
            AccountNotFound(_) => ("account_not_found", "Account not found"),
            TransferNotFound(_) => ("transfer_not_found", "Transfer not found"),
            RouteNotFound(_) => ("not_found", "Not found"),
            WebhookNotFound(_) => ("webhook_not_found", "Webhook not found"),
            ApiKeyNotFound(_) => ("api_key_not_found", "API key not found"),
            DeliveryNotFound(_) => ("delivery_not_found", "Delivery not found"),
            DeliveryNotFailed(_) => ("delivery_not_failed", "Delivery not failed"),
            WebhookUrlNotAllowed(_) => ("webhook_url_not_allowed", "Webhook URL not allowed"),
            WebhookLimitReached(_) => ("webhook_limit_reached", "Webhook limit reached"),
            MethodNotAllowed => ("method_not_allowed", "Method not allowed"),
            AccountExists(_) => ("account_exists", "Account already exists"),
            TransferCanceled { .. } => ("transfer_canceled", "Transfer canceled"),
            CursorExpired => ("cursor_expired", "Cursor expired"),
            PayloadTooLarge => ("payload_too_large", "Payload too large"),
            UnsupportedMediaType => ("unsupported_media_type", "Unsupported media type"),
            InvalidField { .. } => ("invalid_field", "Invalid field"),
            InvalidHeader { .. } => ("invalid_header", "Invalid header"),
            UnknownAccount { .. } => ("unknown_account", "Unknown account"),
            UnknownDeployment(_) => ("unknown_deployment", "Unknown deployment"),
            SameAccount => ("same_account", "Same account"),
            CurrencyMismatch(_) => ("currency_mismatch", "Currency mismatch"),
            IdempotencyKeyReused => ("idempotency_key_reused", "Idempotency key reused"),
            InsufficientFunds { .. } => ("insufficient_funds", "Insufficient funds"),
            BalanceOverflow { .. } => ("balance_overflow", "Balance overflow"),
            DatabaseUnavailable | DeploymentsUnavailable(_) => {
                ("database_unavailable", "Database unavailable")
            }
            Contended { .. } => ("contended", "Contended"),
            Overloaded => ("overloaded", "Overloaded"),
            TooManyStreams(_) => ("too_many_streams", "Too many event streams"),
            Timeout => ("request_timeout", "Request timeout"),
            Internal => ("internal_error", "Internal server error"),
            Hold { conflict, .. } => match conflict {
                HoldConflict::NotAHold => ("not_a_hold", "Not a hold"),
                HoldConflict::AlreadyCaptured => ("hold_already_captured", "Hold already captured"),
                HoldConflict::Voided => ("hold_voided", "Hold voided"),
                HoldConflict::Expired => ("hold_expired", "Hold expired"),
                HoldConflict::Pending => ("hold_pending", "Hold pending"),
            },
        }
    }

    fn detail(&self) -> String {
        use ApiError::*;
        match self {
            MalformedJson(d) => format!("the request body is not valid JSON: {d}"),
            InvalidParameter { detail, .. } | InvalidField { detail, .. } => detail.clone(),
            InvalidHeader { header, detail } => format!("{header} {detail}"),
            Unauthorized => "send a valid API key as Authorization: Bearer <key>".into(),
            Forbidden => "this API key's role does not allow this request".into(),
            TransferNotOwned(id) => format!(
                "transfer {id} moves accounts of another tenant or of none: only a platform key may capture, void or cancel it"
            ),
            AccountNotFound(id) => format!("there is no account {id}"),
            TransferNotFound(id) => format!("there is no transfer {id}"),
            RouteNotFound(path) => format!("there is no resource at {path}"),
            WebhookNotFound(id) => format!("there is no webhook {id}"),
            ApiKeyNotFound(id) => format!("there is no API key {id}"),
            DeliveryNotFound(id) => format!("there is no delivery {id} of this webhook"),
            DeliveryNotFailed(state) => {
                format!("this delivery is {state}; only a failed delivery is retried by hand")
            }
            WebhookUrlNotAllowed(why) => format!(
                "the webhook URL is not allowed: {why} (only public addresses unless the server sets WEBHOOK_ALLOW_PRIVATE=true)"
            ),
            WebhookLimitReached(cap) => webhook_limit_reached(*cap),
            MethodNotAllowed => "this resource does not support that method".into(),
            AccountExists(id) => format!("an account with id {id} already exists"),
            TransferCanceled { detail, .. }
            | UnknownAccount { detail, .. }
            | InsufficientFunds { detail, .. } => detail.clone(),
            CursorExpired => "events after this cursor were removed after the retention (EVENT_RETENTION_MS), or could not be recorded; you may have missed some: read again from the oldest retained event, without a cursor".into(),
            PayloadTooLarge => "the request body is larger than the server accepts".into(),
            UnsupportedMediaType => "send the body as Content-Type: application/json".into(),
            SameAccount => "source and destination must be different accounts".into(),
            UnknownDeployment(name) => format!("there is no deployment {name}"),
            CurrencyMismatch(d) => d.clone(),
            IdempotencyKeyReused => {
                "this Idempotency-Key was already used with a different request body".into()
            }
            BalanceOverflow { account, .. } => {
                format!("the credit would take account {account} past a balance of 9007199254740991")
            }
            DatabaseUnavailable => "the database is unavailable; retry later".into(),
            DeploymentsUnavailable(names) => format!(
                "the database is unavailable; these deployments do not answer: {}",
                names.join(", ")
            ),
            Contended { transfer_id } => contended(transfer_id.as_deref()),
            Overloaded => {
                "this instance is at its limit of transfers in flight or of connections; nothing was recorded, retry shortly".into()
            }
            TooManyStreams(limit) => too_many_streams(*limit).into(),
            Timeout => "the request took too long; retry later".into(),
            Internal => "an internal error occurred".into(),
            Hold { conflict, .. } => match conflict {
                HoldConflict::NotAHold => "this transfer is not a hold".into(),
                HoldConflict::AlreadyCaptured => {
                    "this hold was captured already (with another amount, if you sent one)".into()
                }
                HoldConflict::Voided => "this hold was voided; nothing can be captured".into(),
                HoldConflict::Expired => "this hold expired; nothing can be captured".into(),
                HoldConflict::Pending => {
                    "this hold is still being reserved; retry shortly".into()
                }
            },
        }
    }

    pub fn to_problem(&self) -> Problem {
        let (code, title) = self.code_and_title();
        let field = match self {
            ApiError::InvalidField { field, .. } | ApiError::InvalidParameter { field, .. } => {
                Some(field.clone())
            }
            ApiError::InvalidHeader { header, .. } => Some(header.clone()),
            ApiError::UnknownDeployment(_) => Some("deployment".into()),
            _ => None,
        };
        let transfer_id = match self {
            ApiError::TransferCanceled { transfer_id, .. }
            | ApiError::BalanceOverflow { transfer_id, .. } => Some(transfer_id.clone()),
            ApiError::UnknownAccount { transfer_id, .. }
            | ApiError::InsufficientFunds { transfer_id, .. } => transfer_id.clone(),
            ApiError::Hold { transfer_id, .. } => Some(transfer_id.clone()),
            ApiError::Contended { transfer_id } => transfer_id.clone(),
            _ => None,
        };
        let account = match self {
            ApiError::InsufficientFunds { account, .. }
            | ApiError::BalanceOverflow { account, .. } => Some(account.clone()),
            ApiError::UnknownAccount { account, .. } => account.clone(),
            _ => None,
        };
        Problem {
            problem_type: format!("urn:transfer-service:problem:{code}"),
            title: title.to_owned(),
            status: self.status().as_u16(),
            detail: self.detail(),
            code: code.to_owned(),
            field,
            transfer_id,
            account,
        }
    }
}

/// A body field that failed to parse into its domain type, as a 422 naming the field.
pub fn field<T>(name: &str, parsed: Result<T, crate::domain::ParseError>) -> Result<T, ApiError> {
    parsed.map_err(|e| ApiError::InvalidField {
        field: name.to_owned(),
        detail: format!("{name} {e}"),
    })
}

impl Canceled<'_> {
    /// The account that refused: the one a multi-leg transfer stored, else a one-leg
    /// transfer's account on `side`; a reversal names its own.
    fn refused_account(self, side: Side) -> String {
        match self {
            Canceled::Transfer(t) => {
                let one_leg = match side {
                    Side::Source => &t.source,
                    Side::Destination => &t.destination,
                };
                t.refused_account.as_ref().unwrap_or(one_leg).to_string()
            }
            Canceled::Reversal { account, .. } => account.to_string(),
        }
    }
}

/// A transfer that ended `canceled`, as an answer reports it: which one decides how the
/// answer words the [`CancelReason`] and which transfer its `transferId` names.
#[derive(Debug, Clone, Copy)]
pub enum Canceled<'a> {
    /// The transfer the request asked for: it was inserted, then canceled.
    Transfer(&'a Transfer),
    /// The compensating transfer of a cancel, refused at `account` (the original
    /// destination for a lack of funds, the original source otherwise); `attempt` is its
    /// id when it was inserted. Nothing changed.
    Reversal {
        account: &'a AccountId,
        attempt: Option<TransferId>,
    },
}

impl ApiError {
    /// The answer to a transfer that ended canceled for `reason`, the one mapping of a
    /// [`CancelReason`] to an answer: a business refusal is 422 (`insufficient_funds`,
    /// `balance_overflow`, `unknown_account`), anything else (a cancel by request, and for
    /// holds a void or an expiry; or no stored reason) is 409 `transfer_canceled`.
    pub fn canceled(reason: Option<CancelReason>, canceled: Canceled<'_>) -> ApiError {
        let transfer_id = match canceled {
            Canceled::Transfer(transfer) => Some(transfer.id.to_string()),
            Canceled::Reversal { attempt, .. } => attempt.map(|id| id.to_string()),
        };
        match reason {
            Some(CancelReason::InsufficientFunds) => ApiError::InsufficientFunds {
                detail: match canceled {
                    Canceled::Transfer(transfer) if transfer.legs.is_some() => format!(
                        "account {} cannot fund its share of the legs; the transfer was recorded and canceled",
                        canceled.refused_account(Side::Source),
                    ),
                    Canceled::Transfer(transfer) => format!(
                        "account {} cannot fund {}; the transfer was recorded and canceled",
                        transfer.source,
                        transfer.amount.minor_units()
                    ),
                    Canceled::Reversal { account, .. } => format!(
                        "account {account} cannot fund the compensating transfer; nothing was changed"
                    ),
                },
                account: canceled.refused_account(Side::Source),
                transfer_id,
            },
            Some(CancelReason::BalanceOverflow) => ApiError::BalanceOverflow {
                transfer_id: transfer_id.unwrap_or_default(),
                account: canceled.refused_account(Side::Destination),
            },
            Some(CancelReason::AccountNotFound) => ApiError::UnknownAccount {
                account: match canceled {
                    Canceled::Transfer(t) => t.refused_account.as_ref().map(|a| a.to_string()),
                    Canceled::Reversal { account, .. } => Some(account.to_string()),
                },
                detail: match canceled {
                    Canceled::Transfer(_) => {
                        "an account of this transfer no longer exists; the transfer was canceled"
                            .into()
                    }
                    Canceled::Reversal { account, .. } => format!(
                        "account {account} no longer exists; the compensating transfer was canceled and nothing was changed"
                    ),
                },
                transfer_id,
            },
            // A compensating transfer is never a hold, so never voided or expired; said
            // as canceled by request all the same.
            Some(CancelReason::CanceledByRequest | CancelReason::Voided | CancelReason::Expired)
            | None => ApiError::TransferCanceled {
                transfer_id: transfer_id.unwrap_or_default(),
                detail: match canceled {
                    Canceled::Transfer(_) => {
                        "this transfer was canceled before it completed".into()
                    }
                    Canceled::Reversal { .. } => {
                        "the compensating transfer was itself canceled by request; nothing was changed".into()
                    }
                },
            },
        }
    }
}

/// The detail of a 409 `webhook_limit_reached`: which cap refused the registration.
fn webhook_limit_reached(cap: crate::domain::WebhookCap) -> String {
    match cap {
        crate::domain::WebhookCap::Scope(n) => format!(
            "{n} webhooks of this tenant (or of the platform's keys) are registered, as many as the server allows one (MAX_WEBHOOKS); delete one first"
        ),
        crate::domain::WebhookCap::Total(n) => format!(
            "{n} webhooks are registered in all, every tenant's together, as many as the server allows (MAX_WEBHOOKS_TOTAL); delete one first"
        ),
    }
}

/// The detail of a 503 `contended`: what stands, and how to retry.
fn contended(transfer_id: Option<&str>) -> String {
    match transfer_id {
        Some(id) => format!(
            "transfer {id} kept losing to concurrent changes (of its accounts, or of the transfer itself) and this request stopped trying; what was recorded stands and the transfer will be finished: read it with GET /transfers/{id}, or send the same request again after Retry-After seconds (a POST /transfers only with the same Idempotency-Key: without one it would make another transfer)"
        ),
        None => "this request kept losing to concurrent requests (on the same account, or with the same Idempotency-Key) and recorded nothing; send it again after Retry-After seconds, with the same Idempotency-Key if it had one".into(),
    }
}

/// The detail of a 503 `too_many_streams`: which limit refused the stream.
fn too_many_streams(limit: crate::service::FollowerLimit) -> &'static str {
    match limit {
        crate::service::FollowerLimit::Instance => {
            "this instance has as many event streams open as it allows (MAX_EVENT_STREAMS); retry shortly, or read GET /events"
        }
        crate::service::FollowerLimit::Share => {
            "this tenant has as many event streams open on this instance as one tenant may (MAX_EVENT_STREAMS_PER_TENANT; the platform's keys count as one tenant); close one or retry shortly, or read GET /events"
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let problem = self.to_problem();
        let body = serde_json::to_vec(&problem).unwrap_or_default();
        let mut response = (self.status(), body).into_response();
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if matches!(self, ApiError::Overloaded | ApiError::Contended { .. }) {
            // RFC 9110: when to come back. A transfer takes milliseconds; one second
            // lets the burst drain without making clients wait long (a burst of
            // transfers, or of writers on one hot account).
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if matches!(self, ApiError::TooManyStreams(_)) {
            // A stream lasts as long as its reader stays: no hurry.
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("10"));
        }
        if self == ApiError::Unauthorized {
            // RFC 9110: a 401 names the scheme to authenticate with.
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"transfer-service\""),
            );
        }
        response
    }
}

impl ApiError {
    /// A service error for a request that names accounts in its body (a new transfer):
    /// an account that does not exist is a mistake in the request, 422 `unknown_account`,
    /// not a resource that was not found.
    pub fn naming_accounts_of_a_request(err: ServiceError) -> ApiError {
        match err {
            ServiceError::AccountNotFound(id) => ApiError::UnknownAccount {
                detail: format!("there is no account {id}"),
                transfer_id: None,
                account: Some(id),
            },
            other => other.into(),
        }
    }
}

impl From<ServiceError> for ApiError {
    fn from(err: ServiceError) -> Self {
        match err {
            ServiceError::AccountExists(id) => ApiError::AccountExists(id),
            ServiceError::UnknownDeployment(name) => ApiError::UnknownDeployment(name.to_string()),
            ServiceError::AccountNotFound(id) => ApiError::AccountNotFound(id),
            ServiceError::TransferNotFound(id) => ApiError::TransferNotFound(id.to_string()),
            ServiceError::TransferNotOwned(id) => ApiError::TransferNotOwned(id.to_string()),
            ServiceError::SameAccount => ApiError::SameAccount,
            e @ ServiceError::CurrencyMismatch { .. } => ApiError::CurrencyMismatch(e.to_string()),
            ServiceError::IdempotencyKeyReused => ApiError::IdempotencyKeyReused,
            ServiceError::Hold { conflict, hold } => ApiError::Hold {
                conflict,
                transfer_id: hold.to_string(),
            },
            ServiceError::CaptureExceedsHold { held } => ApiError::InvalidField {
                field: "amount".into(),
                detail: format!(
                    "amount must be at most the held amount, {}",
                    held.minor_units()
                ),
            },
            ServiceError::PartialCaptureOfLegs { held } => ApiError::InvalidField {
                field: "amount".into(),
                detail: format!(
                    "a multi-leg hold is captured whole: leave amount out or send the held amount, {}",
                    held.minor_units()
                ),
            },
            ServiceError::ReversalRefused {
                reason,
                account,
                attempt,
            } => ApiError::canceled(
                Some(reason),
                Canceled::Reversal {
                    account: &account,
                    attempt,
                },
            ),
            ServiceError::Overloaded => ApiError::Overloaded,
            ServiceError::CursorExpired => ApiError::CursorExpired,
            ServiceError::WebhookUrlNotAllowed(why) => {
                ApiError::WebhookUrlNotAllowed(why.to_string())
            }
            ServiceError::WebhookNotFound(id) => ApiError::WebhookNotFound(id),
            ServiceError::TooManyWebhooks(cap) => ApiError::WebhookLimitReached(cap),
            ServiceError::ApiKeyNotFound(id) => ApiError::ApiKeyNotFound(id),
            ServiceError::DeliveryNotFound(id) => ApiError::DeliveryNotFound(id),
            ServiceError::DeliveryNotFailed(state) => {
                ApiError::DeliveryNotFailed(state.as_str().to_owned())
            }
            ServiceError::TooManyFollowers(limit) => ApiError::TooManyStreams(limit),
            ServiceError::Unavailable(e) => {
                tracing::warn!(cause = %Chain(&e), "database unavailable");
                ApiError::DatabaseUnavailable
            }
            ServiceError::Contended(e) => {
                tracing::warn!(cause = %Chain(&e), "gave up on a lost race");
                let transfer_id = e.transfer().map(|id| id.to_string());
                ApiError::Contended { transfer_id }
            }
            ServiceError::Internal(e) => {
                tracing::error!(cause = %Chain(&e), "internal error");
                ApiError::Internal
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{AccountId, TransferId};

    const ID: &str = "65a1b2c3d4e5f60718293a4b";

    /// The body of the answer to a cancel whose reversal `reason` refused at bob, with
    /// or without an inserted compensating transfer.
    fn refused_reversal(reason: CancelReason, attempt: Option<&str>) -> (u16, String) {
        let error = ApiError::from(ServiceError::ReversalRefused {
            reason,
            account: AccountId::parse("bob").unwrap(),
            attempt: attempt.map(|id| TransferId::parse(id).unwrap()),
        });
        (
            error.status().as_u16(),
            serde_json::to_string(&error.to_problem()).unwrap(),
        )
    }

    #[test]
    fn a_refused_reversal_answers_as_its_reason_says_byte_for_byte() {
        let cases = [
            (
                CancelReason::InsufficientFunds,
                Some(ID),
                422,
                r#"{"type":"urn:transfer-service:problem:insufficient_funds","title":"Insufficient funds","status":422,"detail":"account bob cannot fund the compensating transfer; nothing was changed","code":"insufficient_funds","transferId":"65a1b2c3d4e5f60718293a4b","account":"bob"}"#,
            ),
            (
                CancelReason::InsufficientFunds,
                None,
                422,
                r#"{"type":"urn:transfer-service:problem:insufficient_funds","title":"Insufficient funds","status":422,"detail":"account bob cannot fund the compensating transfer; nothing was changed","code":"insufficient_funds","account":"bob"}"#,
            ),
            (
                CancelReason::BalanceOverflow,
                Some(ID),
                422,
                r#"{"type":"urn:transfer-service:problem:balance_overflow","title":"Balance overflow","status":422,"detail":"the credit would take account bob past a balance of 9007199254740991","code":"balance_overflow","transferId":"65a1b2c3d4e5f60718293a4b","account":"bob"}"#,
            ),
            (
                CancelReason::BalanceOverflow,
                None,
                422,
                r#"{"type":"urn:transfer-service:problem:balance_overflow","title":"Balance overflow","status":422,"detail":"the credit would take account bob past a balance of 9007199254740991","code":"balance_overflow","transferId":"","account":"bob"}"#,
            ),
            (
                CancelReason::AccountNotFound,
                Some(ID),
                422,
                r#"{"type":"urn:transfer-service:problem:unknown_account","title":"Unknown account","status":422,"detail":"account bob no longer exists; the compensating transfer was canceled and nothing was changed","code":"unknown_account","transferId":"65a1b2c3d4e5f60718293a4b","account":"bob"}"#,
            ),
            (
                CancelReason::AccountNotFound,
                None,
                422,
                r#"{"type":"urn:transfer-service:problem:unknown_account","title":"Unknown account","status":422,"detail":"account bob no longer exists; the compensating transfer was canceled and nothing was changed","code":"unknown_account","account":"bob"}"#,
            ),
        ];
        for (reason, attempt, status, body) in cases {
            assert_eq!(
                refused_reversal(reason, attempt),
                (status, body.to_owned()),
                "{reason:?} {attempt:?}"
            );
        }
        for reason in [
            CancelReason::CanceledByRequest,
            CancelReason::Voided,
            CancelReason::Expired,
        ] {
            assert_eq!(
                refused_reversal(reason, Some(ID)),
                (
                    409,
                    r#"{"type":"urn:transfer-service:problem:transfer_canceled","title":"Transfer canceled","status":409,"detail":"the compensating transfer was itself canceled by request; nothing was changed","code":"transfer_canceled","transferId":"65a1b2c3d4e5f60718293a4b"}"#.to_owned()
                ),
                "{reason:?}"
            );
            assert_eq!(
                refused_reversal(reason, None),
                (
                    409,
                    r#"{"type":"urn:transfer-service:problem:transfer_canceled","title":"Transfer canceled","status":409,"detail":"the compensating transfer was itself canceled by request; nothing was changed","code":"transfer_canceled","transferId":""}"#.to_owned()
                ),
                "{reason:?}"
            );
        }
    }
}
