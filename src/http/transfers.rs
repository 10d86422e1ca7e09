//! `/transfers`: make, read, list and cancel transfers.
//!
//! A transfer request answers with the transfer as the protocol left it, and its status
//! says how it ended: 201 `done`; 422 when it was inserted but canceled for a business
//! reason (insufficient funds, overflow, account gone), with `transferId`; 409 when it was
//! canceled by request; 202 while it is still running (`Prefer: respond-async`, or a
//! replay whose original has not finished).

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::AppState;
use super::extract::{ApiJson, OptionalApiJson};
use super::pagination::{Page, PageParams, page};
use super::problem::{ApiError, Canceled, field};
use super::responses::{
    CaptureRefused, InvalidCaptureAmount, InvalidParameter, MalformedJson, PayloadTooLarge,
    ReversalCanceled, ReversalRefused, TransferCanceled, TransferNotFound, TransferRefused,
    TransferUnavailable, Unavailable, UnavailableOrOverloaded, UnsupportedMediaType, VoidRefused,
};
use crate::domain::{
    AccountId, Amount, CancelReason, HOLD_EXPIRY_MS, IdempotencyKey, KeyScope, Leg, Legs,
    LegsError, Reference, Scope, ScopedKey, Transfer, TransferFilter, TransferId, TransferState,
};
use crate::service::{Completion, NewTransfer, TransferOutcome};

pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
const PREFERENCE_APPLIED: HeaderName = HeaderName::from_static("preference-applied");

/// A request to move money: one leg (`source`, `destination`, `amount`), or several
/// that move together or not at all (`legs`).
#[derive(Debug, ToSchema)]
#[serde(untagged)]
pub enum TransferRequest {
    OneLeg(CreateTransferRequest),
    MultiLeg(CreateMultiLegTransferRequest),
}

/// The body of `POST /transfers` as it is read: either form of [`TransferRequest`],
/// told apart and checked by [`new_transfer`].
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TransferRequestBody {
    source: Option<String>,
    destination: Option<String>,
    amount: Option<i64>,
    legs: Option<Vec<TransferLeg>>,
    reference: Option<String>,
    hold: Option<HoldRequest>,
}

/// A request to move money from one account to another.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schema(example = json!({"source": "alice", "destination": "bob", "amount": 2500, "reference": "invoice 42"}))]
pub struct CreateTransferRequest {
    /// The account to debit.
    #[schema(pattern = "^[A-Za-z0-9_.:@-]{1,64}$")]
    pub source: String,
    /// The account to credit; must differ from `source` and hold the same currency.
    #[schema(pattern = "^[A-Za-z0-9_.:@-]{1,64}$")]
    pub destination: String,
    /// Minor units, 1 to 9007199254740991.
    #[schema(minimum = 1, maximum = 9007199254740991_i64)]
    pub amount: i64,
    /// Your own label, 1 to 140 characters, no control characters.
    #[schema(
        min_length = 1,
        max_length = 140,
        pattern = r"^[^\u0000-\u001F\u007F-\u009F]*$"
    )]
    pub reference: Option<String>,
    /// Makes this a hold: the amount is reserved out of the source's available balance
    /// until it is captured (`POST /transfers/{id}/capture`), voided
    /// (`POST /transfers/{id}/void`) or expires. Neither balance changes until a capture.
    #[schema(nullable = false)]
    pub hold: Option<HoldRequest>,
}

/// A request to move money along several legs, all or nothing: each account changes
/// once, by its net amount over the legs (`docs/legs.md`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schema(example = json!({"legs": [
    {"source": "buyer", "destination": "seller", "amount": 10000},
    {"source": "seller", "destination": "platform", "amount": 300},
    {"source": "seller", "destination": "tax", "amount": 1900}
], "reference": "order 7"}))]
pub struct CreateMultiLegTransferRequest {
    /// 2 to 16 legs between accounts of one currency.
    #[schema(min_items = 2, max_items = 16)]
    pub legs: Vec<TransferLeg>,
    /// Your own label, 1 to 140 characters, no control characters.
    #[schema(
        min_length = 1,
        max_length = 140,
        pattern = r"^[^\u0000-\u001F\u007F-\u009F]*$"
    )]
    pub reference: Option<String>,
    /// Makes this a multi-leg hold: every paying account's net is reserved out of its
    /// available balance (and every receiving account's kept room for) until the hold is
    /// captured whole (`POST /transfers/{id}/capture`), voided
    /// (`POST /transfers/{id}/void`) or expires. No balance changes until a capture.
    #[schema(nullable = false)]
    pub hold: Option<HoldRequest>,
}

/// One leg of a multi-leg transfer.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schema(example = json!({"source": "seller", "destination": "platform", "amount": 300}))]
pub struct TransferLeg {
    /// The account the leg pays from.
    #[schema(pattern = "^[A-Za-z0-9_.:@-]{1,64}$")]
    pub source: String,
    /// The account the leg pays to; not the leg's `source`.
    #[schema(pattern = "^[A-Za-z0-9_.:@-]{1,64}$")]
    pub destination: String,
    /// Minor units, 1 to 9007199254740991.
    #[schema(minimum = 1, maximum = 9007199254740991_i64)]
    pub amount: i64,
}

/// How long a hold lasts.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schema(example = json!({"expiresInMs": 900000}))]
pub struct HoldRequest {
    /// Milliseconds until an uncaptured hold expires, 1000 to 2592000000 (30 days);
    /// `HOLD_EXPIRES_MS` (default 7 days) when left out.
    #[schema(minimum = 1000, maximum = 2592000000_i64, nullable = false)]
    pub expires_in_ms: Option<i64>,
}

/// A request to capture a hold.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schema(example = json!({"amount": 1800}))]
pub struct CaptureRequest {
    /// Minor units to capture, 1 to the held amount; all of it when left out.
    #[schema(minimum = 1, maximum = 9007199254740991_i64, nullable = false)]
    pub amount: Option<i64>,
}

/// The state of a transfer in the two-phase commit.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum TransferStateSchema {
    Initial,
    Pending,
    Applied,
    Done,
    Canceling,
    Canceled,
    Held,
    Capturing,
}

/// Why a transfer ended `canceled`.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CancelReasonSchema {
    InsufficientFunds,
    BalanceOverflow,
    AccountNotFound,
    CanceledByRequest,
    Voided,
    Expired,
}

/// A transfer.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(example = json!({
    "id": "65a1b2c3d4e5f60718293a4b", "source": "alice", "destination": "bob", "amount": 2500,
    "currency": "EUR", "state": "done", "reference": "invoice 42",
    "createdAt": "2026-11-22T10:00:00Z", "lastModified": "2026-11-22T10:00:00.012Z"
}))]
pub struct TransferResponse {
    /// 24 hexadecimal digits.
    pub id: String,
    /// The account debited; absent on a multi-leg transfer (see `legs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub source: Option<String>,
    /// The account credited; absent on a multi-leg transfer (see `legs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub destination: Option<String>,
    /// On a multi-leg transfer: its legs, as sent.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub legs: Option<Vec<TransferLeg>>,
    /// Minor units, 1 to 9007199254740991: what moves (for a hold, the held amount until
    /// a capture, then the captured amount; for a multi-leg transfer, the money its legs
    /// move: what its paying accounts pay, which is what its receiving accounts receive,
    /// not the sum of the legs).
    #[schema(minimum = 1, maximum = 9007199254740991_i64)]
    pub amount: i64,
    /// ISO-4217 code, the currency of both accounts.
    pub currency: String,
    #[schema(value_type = TransferStateSchema)]
    pub state: TransferState,
    /// On a hold: the amount it reserves.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 9007199254740991_i64, nullable = false)]
    pub held_amount: Option<i64>,
    /// On a hold: when it expires if not captured.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub expires_at: Option<DateTime<Utc>>,
    /// Why it was canceled; only on `canceled` transfers.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<CancelReasonSchema>, nullable = false)]
    pub reason: Option<CancelReason>,
    /// The client's label, when it gave one.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub reference: Option<String>,
    pub created_at: DateTime<Utc>,
    pub last_modified: DateTime<Utc>,
    /// On a compensating transfer: the transfer it reverses.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub reverses: Option<String>,
    /// On a reversed transfer: its compensating transfer.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub reversed_by: Option<String>,
}

/// A page of transfers, newest first.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(example = json!({
    "items": [{
        "id": "65a1b2c3d4e5f60718293a4b", "source": "alice", "destination": "bob", "amount": 2500,
        "currency": "EUR", "state": "done", "reference": "invoice 42",
        "createdAt": "2026-11-22T10:00:00Z", "lastModified": "2026-11-22T10:00:00.012Z"
    }],
    "next": null
}))]
pub struct TransferPage {
    pub items: Vec<TransferResponse>,
    /// Pass as `after` to get the next page; null on the last page.
    #[schema(required = true)]
    pub next: Option<String>,
}

impl From<Page<TransferResponse>> for TransferPage {
    fn from(page: Page<TransferResponse>) -> Self {
        TransferPage {
            items: page.items,
            next: page.next,
        }
    }
}

impl From<Transfer> for TransferResponse {
    fn from(t: Transfer) -> Self {
        let legs = t.legs.as_ref().map(|legs| {
            legs.legs()
                .iter()
                .map(|l| TransferLeg {
                    source: l.source.to_string(),
                    destination: l.destination.to_string(),
                    amount: l.amount.minor_units(),
                })
                .collect()
        });
        let one_leg = legs.is_none();
        TransferResponse {
            id: t.id.to_string(),
            source: one_leg.then(|| t.source.to_string()),
            destination: one_leg.then(|| t.destination.to_string()),
            legs,
            amount: t.amount.minor_units(),
            currency: t.currency.to_string(),
            state: t.state,
            held_amount: t.hold.map(|h| h.amount.minor_units()),
            expires_at: t.hold.map(|h| h.expires_at),
            reason: t.reason,
            reference: t.reference.map(|r| r.as_str().to_owned()),
            created_at: t.created_at,
            last_modified: t.last_modified,
            reverses: t.reverses.map(|id| id.to_string()),
            reversed_by: t.reversed_by.map(|id| id.to_string()),
        }
    }
}

/// Filters of `GET /transfers`.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TransferQuery {
    /// Only transfers in this state.
    #[param(value_type = Option<TransferStateSchema>)]
    pub state: Option<String>,
    /// Only transfers from or to this account.
    #[param(pattern = "^[A-Za-z0-9_.:@-]{1,64}$", example = "alice")]
    pub account: Option<String>,
}

fn location(id: &TransferId) -> HeaderValue {
    HeaderValue::from_str(&format!("/transfers/{id}")).expect("hex is a valid header")
}

fn path_transfer(raw: &str) -> Result<TransferId, ApiError> {
    TransferId::parse(raw).map_err(|_| ApiError::TransferNotFound(raw.chars().take(80).collect()))
}

/// The answer to a transfer request, from how the transfer stands.
fn outcome_response(outcome: TransferOutcome) -> Response {
    let TransferOutcome { transfer, replayed } = outcome;
    let id = transfer.id;
    let mut response = match (transfer.state, transfer.reason) {
        (TransferState::Done | TransferState::Held, _) => {
            (StatusCode::CREATED, Json(TransferResponse::from(transfer))).into_response()
        }
        (TransferState::Canceled, reason) => {
            ApiError::canceled(reason, Canceled::Transfer(&transfer)).into_response()
        }
        _ => (StatusCode::ACCEPTED, Json(TransferResponse::from(transfer))).into_response(),
    };
    let headers = response.headers_mut();
    headers.insert(header::LOCATION, location(&id));
    if replayed {
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    response
}

/// How long a requested hold lasts: `expiresInMs`, or the setting when left out.
fn hold_expiry(
    hold: &HoldRequest,
    default: std::time::Duration,
) -> Result<std::time::Duration, ApiError> {
    let Some(ms) = hold.expires_in_ms else {
        return Ok(default);
    };
    u64::try_from(ms)
        .ok()
        .filter(|ms| HOLD_EXPIRY_MS.contains(ms))
        .map(std::time::Duration::from_millis)
        .ok_or_else(|| ApiError::InvalidField {
            field: "hold.expiresInMs".into(),
            detail:
                "hold.expiresInMs must be an integer number of milliseconds from 1000 to 2592000000"
                    .into(),
        })
}

fn wants_async(headers: &HeaderMap) -> bool {
    headers.get_all("prefer").iter().any(|value| {
        value.to_str().is_ok_and(|v| {
            v.split(',').any(|pref| {
                pref.split(';')
                    .next()
                    .is_some_and(|p| p.trim().eq_ignore_ascii_case("respond-async"))
            })
        })
    })
}

fn idempotency_key(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, ApiError> {
    let Some(value) = headers.get(&IDEMPOTENCY_KEY) else {
        return Ok(None);
    };
    let invalid = |detail: String| ApiError::InvalidHeader {
        header: "Idempotency-Key".into(),
        detail,
    };
    let text = value
        .to_str()
        .map_err(|_| invalid("must be visible ASCII".into()))?;
    IdempotencyKey::parse(text)
        .map(Some)
        .map_err(|e| invalid(e.to_string()))
}

/// Move money from one account to another.
#[utoipa::path(
    post, path = "/transfers", tag = "transfers",
    request_body(content = TransferRequest, examples(
        ("transfer" = (summary = "Alice pays Bob 25.00", value = json!({"source": "alice", "destination": "bob", "amount": 2500, "reference": "invoice 42"}))),
        ("hold" = (summary = "Alice holds 18.00 for Bob for 15 minutes", value = json!({"source": "alice", "destination": "bob", "amount": 1800, "hold": {"expiresInMs": 900000}}))),
        ("legs" = (summary = "A buyer pays a seller, who pays a fee and a tax", value = json!({"legs": [
            {"source": "buyer", "destination": "seller", "amount": 10000},
            {"source": "seller", "destination": "platform", "amount": 300},
            {"source": "seller", "destination": "tax", "amount": 1900}
        ], "reference": "order 7"}))),
    )),
    params(
        ("Idempotency-Key" = Option<String>, Header, nullable = false, min_length = 1, max_length = 255, pattern = "^[!-~]{1,255}$", example = "order-42",
            description = "1 to 255 visible ASCII characters. A retry with the same key and body answers with the same transfer and moves no money; the same key with another body is 422 `idempotency_key_reused`. With API keys, a key belongs to the API key that sent it: the same key from another API key is another request, so retry with the same API key."),
        ("Prefer" = Option<String>, Header, nullable = false, example = "respond-async",
            description = "RFC 7240 preferences; `respond-async` answers 202 at once while the transfer runs in the background. Others are ignored."),
    ),
    responses(
        (status = 201, description = "The transfer is done, or held.", body = TransferResponse, headers(
            ("Location" = String, description = "The URL of the transfer: /transfers/{id}."),
            ("Idempotent-Replayed" = Option<String>, description = "`true` when this answers a retry with the same Idempotency-Key.")),
            links(
                ("GetTransfer" = (operation_id = "get_transfer", parameters(("id" = "$response.body#/id")))),
                ("CancelTransfer" = (operation_id = "cancel_transfer", parameters(("id" = "$response.body#/id")), description = "Reverse it.")),
                ("CaptureTransfer" = (operation_id = "capture_transfer", parameters(("id" = "$response.body#/id")), request_body = json!({"amount": "$response.body#/amount"}), description = "Capture all of it, when it is a hold (a held transfer's `amount` is what it holds).")),
                ("VoidTransfer" = (operation_id = "void_transfer", parameters(("id" = "$response.body#/id")), description = "Void it, when it is a hold.")),
            )),
        (status = 202, description = "The transfer is recorded and still running (`Prefer: respond-async`, or a retry whose original has not finished); poll its Location.", body = TransferResponse, headers(
            ("Location" = String, description = "The URL of the transfer: /transfers/{id}."),
            ("Idempotent-Replayed" = Option<String>, description = "`true` when this answers a retry with the same Idempotency-Key."),
            ("Preference-Applied" = Option<String>, description = "`respond-async` when that preference was honoured.")),
            links(
                ("GetTransfer" = (operation_id = "get_transfer", parameters(("id" = "$response.body#/id")), description = "Poll it.")),
                ("CancelTransfer" = (operation_id = "cancel_transfer", parameters(("id" = "$response.body#/id")))),
            )),
        (status = 400, response = MalformedJson),
        (status = 409, response = TransferCanceled),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, response = TransferRefused),
        (status = 503, response = TransferUnavailable),
    )
)]
pub async fn create_transfer(
    State(state): State<AppState>,
    // Put there by `auth::require_api_key`: whose keys this request's key is among, and
    // what it sees.
    Extension(key_scope): Extension<KeyScope>,
    Extension(scope): Extension<Scope>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<TransferRequestBody>,
) -> Result<Response, ApiError> {
    let new = NewTransfer {
        scope,
        ..new_transfer(body, state.service.requests().default_hold_expiry())?
    };
    let key = idempotency_key(&headers)?.map(|key| ScopedKey {
        scope: key_scope,
        key,
    });
    let background = wants_async(&headers);
    let completion = if background {
        Completion::Background
    } else {
        Completion::Wait
    };
    let outcome = state
        .service
        .requests()
        .transfer(new, key, completion)
        .await
        .map_err(ApiError::naming_accounts_of_a_request)?;
    let mut response = outcome_response(outcome);
    if background && response.status() == StatusCode::ACCEPTED {
        response.headers_mut().insert(
            PREFERENCE_APPLIED,
            HeaderValue::from_static("respond-async"),
        );
    }
    Ok(response)
}

/// The transfer a body asks for, in either form; a body that mixes them, or lacks what
/// its form needs, names the field.
fn new_transfer(
    body: TransferRequestBody,
    default_hold_expiry: std::time::Duration,
) -> Result<NewTransfer, ApiError> {
    let reference = body
        .reference
        .as_deref()
        .map(|raw| field("reference", Reference::parse(raw)))
        .transpose()?;
    let Some(legs) = body.legs else {
        let required = |name: &str| ApiError::InvalidField {
            field: name.to_owned(),
            detail: format!("{name}: missing field `{name}`"),
        };
        let source = body.source.ok_or_else(|| required("source"))?;
        let destination = body.destination.ok_or_else(|| required("destination"))?;
        let amount = body.amount.ok_or_else(|| required("amount"))?;
        return Ok(NewTransfer {
            source: field("source", AccountId::parse(&source))?,
            destination: field("destination", AccountId::parse(&destination))?,
            amount: field("amount", Amount::parse(amount))?,
            legs: None,
            reference,
            hold: body
                .hold
                .map(|hold| hold_expiry(&hold, default_hold_expiry))
                .transpose()?,
            scope: Scope::Platform,
        });
    };
    let mixed = [
        ("source", body.source.is_some()),
        ("destination", body.destination.is_some()),
        ("amount", body.amount.is_some()),
    ];
    if let Some((name, _)) = mixed.iter().find(|(_, sent)| *sent) {
        let why = "send either `legs` or `source`, `destination` and `amount`, not both";
        return Err(ApiError::InvalidField {
            field: (*name).to_owned(),
            detail: format!("{name}: {why}"),
        });
    }
    let hold = body
        .hold
        .map(|hold| hold_expiry(&hold, default_hold_expiry))
        .transpose()?;
    let legs = legs
        .iter()
        .enumerate()
        .map(|(i, leg)| {
            let at = |name: &str| format!("legs[{i}].{name}");
            Ok(Leg {
                source: field(&at("source"), AccountId::parse(&leg.source))?,
                destination: field(&at("destination"), AccountId::parse(&leg.destination))?,
                amount: field(&at("amount"), Amount::parse(leg.amount))?,
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let legs = Legs::new(legs).map_err(|e| match e {
        LegsError::SameAccount(_) => ApiError::SameAccount,
        other => ApiError::InvalidField {
            field: "legs".into(),
            detail: format!("legs {other}"),
        },
    })?;
    Ok(NewTransfer {
        hold,
        ..NewTransfer::with_legs(legs, reference)
    })
}

/// Read a transfer.
#[utoipa::path(
    get, path = "/transfers/{id}", tag = "transfers",
    params(("id" = String, Path, description = "The transfer id, 24 hexadecimal digits.", pattern = "^[0-9a-fA-F]{24}$", example = "65a1b2c3d4e5f60718293a4b")),
    responses(
        (status = 200, description = "The transfer.", body = TransferResponse),
        (status = 404, response = TransferNotFound),
        (status = 503, response = Unavailable),
    )
)]
pub async fn get_transfer(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Json<TransferResponse>, ApiError> {
    let id = path_transfer(&id)?;
    Ok(Json(
        state
            .service
            .requests()
            .transfer_in(&scope, id)
            .await?
            .into(),
    ))
}

/// List transfers, newest first.
#[utoipa::path(
    get, path = "/transfers", tag = "transfers",
    params(TransferQuery, PageParams),
    responses(
        (status = 200, description = "A page of transfers, newest first.", body = TransferPage,
            links(("NextPage" = (operation_id = "list_transfers", parameters(("after" = "$response.body#/next")), description = "The next page, while `next` is not null.")))),
        (status = 400, response = InvalidParameter),
        (status = 503, response = Unavailable),
    )
)]
pub async fn list_transfers(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    filters: Result<Query<TransferQuery>, axum::extract::rejection::QueryRejection>,
    paging: Result<Query<PageParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<TransferPage>, ApiError> {
    let filters = super::query(filters)?;
    let request = super::query(paging)?.parse("transfers", |key| TransferId::parse(key).ok())?;
    let state_filter = filters
        .state
        .as_deref()
        .map(|raw| {
            TransferState::parse(raw).ok_or_else(|| ApiError::InvalidParameter {
                field: "state".into(),
                detail: "state must be one of initial, pending, applied, done, canceling, canceled"
                    .into(),
            })
        })
        .transpose()?;
    let account = filters
        .account
        .as_deref()
        .map(|raw| {
            AccountId::parse(raw).map_err(|e| ApiError::InvalidParameter {
                field: "account".into(),
                detail: format!("account {e}"),
            })
        })
        .transpose()?;
    let filter = TransferFilter {
        state: state_filter,
        account,
        before: request.after,
        tenant: scope.tenant().cloned(),
        ..TransferFilter::default()
    };
    let fetched = state
        .service
        .requests()
        .transfers(&filter, request.limit + 1)
        .await?;
    Ok(Json(
        page(
            fetched,
            request.limit,
            "transfers",
            |t| t.id.to_string(),
            TransferResponse::from,
        )
        .into(),
    ))
}

/// Cancel a transfer.
///
/// A transfer not yet applied is rolled back and ends `canceled` (reason
/// `canceled_by_request`). An applied or done transfer is completed and reversed by a
/// compensating transfer from the destination back to the source; the answer is the
/// original, carrying `reversedBy`. Cancelling again answers the same, and never makes a
/// second reversal.
#[utoipa::path(
    post, path = "/transfers/{id}/cancel", tag = "transfers",
    params(("id" = String, Path, description = "The transfer id, 24 hexadecimal digits.", pattern = "^[0-9a-fA-F]{24}$", example = "65a1b2c3d4e5f60718293a4b")),
    responses(
        (status = 200, description = "The transfer, now `canceled`, or `done` with `reversedBy` (its reversal is done).", body = TransferResponse),
        (status = 202, description = "The transfer, `done` with `reversedBy`: its reversal is under way on another instance and may still be refused; cancel again or read `reversedBy` later.", body = TransferResponse),
        (status = 404, response = TransferNotFound),
        (status = 409, response = ReversalCanceled),
        (status = 422, response = ReversalRefused),
        (status = 503, response = UnavailableOrOverloaded),
    )
)]
pub async fn cancel_transfer(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<TransferResponse>), ApiError> {
    let id = path_transfer(&id)?;
    state
        .service
        .requests()
        .check_transfer_owned(&scope, id)
        .await?;
    let transfer = state.service.requests().cancel(id).await?;
    // `reversing` stays set until the compensating transfer is done.
    let status = if transfer.reversing {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(transfer.into())))
}

/// Capture a hold.
///
/// The captured amount (all of the hold when `amount` is left out) moves from the source
/// to the destination, and the rest of the reservation becomes available to the source
/// again. A multi-leg hold is captured whole: every leg moves. Capturing again with the
/// same amount answers the same result.
#[utoipa::path(
    post, path = "/transfers/{id}/capture", tag = "transfers",
    params(("id" = String, Path, description = "The hold's id, 24 hexadecimal digits.", pattern = "^[0-9a-fA-F]{24}$", example = "65a1b2c3d4e5f60718293a4b")),
    request_body(content = CaptureRequest, description = "Optional: the amount to capture."),
    responses(
        (status = 200, description = "The hold, `done`: `amount` is the captured amount, `heldAmount` what was held.", body = TransferResponse),
        (status = 400, response = MalformedJson),
        (status = 404, response = TransferNotFound),
        (status = 409, response = CaptureRefused),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, response = InvalidCaptureAmount),
        (status = 503, response = UnavailableOrOverloaded),
    )
)]
pub async fn capture_transfer(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    OptionalApiJson(body): OptionalApiJson<CaptureRequest>,
) -> Result<Json<TransferResponse>, ApiError> {
    let id = path_transfer(&id)?;
    state
        .service
        .requests()
        .check_transfer_owned(&scope, id)
        .await?;
    let amount = body
        .amount
        .map(|raw| field("amount", Amount::parse(raw)))
        .transpose()?;
    let transfer = state.service.requests().capture(id, amount).await?;
    Ok(Json(transfer.into()))
}

/// Void a hold.
///
/// The whole reservation becomes available to the source again; the hold ends
/// `canceled` with reason `voided` (or `expired`, if it expired first). Voiding again
/// answers the same result.
#[utoipa::path(
    post, path = "/transfers/{id}/void", tag = "transfers",
    params(("id" = String, Path, description = "The hold's id, 24 hexadecimal digits.", pattern = "^[0-9a-fA-F]{24}$", example = "65a1b2c3d4e5f60718293a4b")),
    responses(
        (status = 200, description = "The hold, `canceled` with reason `voided` (or `expired`).", body = TransferResponse),
        (status = 404, response = TransferNotFound),
        (status = 409, response = VoidRefused),
        (status = 503, response = UnavailableOrOverloaded),
    )
)]
pub async fn void_transfer(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Json<TransferResponse>, ApiError> {
    let id = path_transfer(&id)?;
    state
        .service
        .requests()
        .check_transfer_owned(&scope, id)
        .await?;
    let transfer = state.service.requests().void(id).await?;
    Ok(Json(transfer.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Currency;

    const ID: &str = "65a1b2c3d4e5f60718293a4b";

    /// The answer to a request whose transfer (alice to bob, 5000) ended canceled for
    /// `reason`: status, `Location`, `Idempotent-Replayed`, and the body as sent.
    async fn canceled_answer(
        reason: Option<CancelReason>,
        replayed: bool,
    ) -> (u16, String, Option<String>, String) {
        let mut transfer = Transfer::initial(
            TransferId::parse(ID).unwrap(),
            AccountId::parse("alice").unwrap(),
            AccountId::parse("bob").unwrap(),
            Amount::parse(5000).unwrap(),
            Currency::usd(),
        );
        transfer.state = TransferState::Canceled;
        transfer.reason = reason;
        let response = outcome_response(TransferOutcome { transfer, replayed });
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let header = |name: &str| headers.get(name).map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(
            header("content-type").as_deref(),
            Some("application/problem+json")
        );
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (
            status,
            header("location").unwrap_or_default(),
            header("idempotent-replayed"),
            String::from_utf8(body.to_vec()).unwrap(),
        )
    }

    #[tokio::test]
    async fn a_canceled_transfer_answers_as_its_reason_says_byte_for_byte() {
        let location = format!("/transfers/{ID}");
        let by_request = r#"{"type":"urn:transfer-service:problem:transfer_canceled","title":"Transfer canceled","status":409,"detail":"this transfer was canceled before it completed","code":"transfer_canceled","transferId":"65a1b2c3d4e5f60718293a4b"}"#;
        let cases = [
            (
                Some(CancelReason::InsufficientFunds),
                422,
                r#"{"type":"urn:transfer-service:problem:insufficient_funds","title":"Insufficient funds","status":422,"detail":"account alice cannot fund 5000; the transfer was recorded and canceled","code":"insufficient_funds","transferId":"65a1b2c3d4e5f60718293a4b","account":"alice"}"#,
            ),
            (
                Some(CancelReason::BalanceOverflow),
                422,
                r#"{"type":"urn:transfer-service:problem:balance_overflow","title":"Balance overflow","status":422,"detail":"the credit would take account bob past a balance of 9007199254740991","code":"balance_overflow","transferId":"65a1b2c3d4e5f60718293a4b","account":"bob"}"#,
            ),
            (
                Some(CancelReason::AccountNotFound),
                422,
                r#"{"type":"urn:transfer-service:problem:unknown_account","title":"Unknown account","status":422,"detail":"an account of this transfer no longer exists; the transfer was canceled","code":"unknown_account","transferId":"65a1b2c3d4e5f60718293a4b"}"#,
            ),
            (Some(CancelReason::CanceledByRequest), 409, by_request),
            (Some(CancelReason::Voided), 409, by_request),
            (Some(CancelReason::Expired), 409, by_request),
            (None, 409, by_request),
        ];
        for (reason, status, body) in cases {
            assert_eq!(
                canceled_answer(reason, false).await,
                (status, location.clone(), None, body.to_owned()),
                "{reason:?}"
            );
        }
        assert_eq!(
            canceled_answer(Some(CancelReason::InsufficientFunds), true)
                .await
                .2
                .as_deref(),
            Some("true")
        );
    }

    #[test]
    fn prefer_respond_async_is_recognised_among_other_preferences() {
        let mut headers = HeaderMap::new();
        headers.insert(
            "prefer",
            HeaderValue::from_static("return=minimal, respond-async; wait=5"),
        );
        assert!(wants_async(&headers));
        headers.insert("prefer", HeaderValue::from_static("return=minimal"));
        assert!(!wants_async(&headers));
    }
}
