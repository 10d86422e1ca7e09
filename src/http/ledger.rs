//! `/accounts/{id}/entries` and `/accounts/{id}/balance`: an account's ledger, its
//! numbered entries and its amounts as of a moment (`docs/ledger.md`).

use axum::Json;
use axum::extract::{Extension, Path, Query, State};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::AppState;
use super::accounts::path_account;
use super::problem::ApiError;
use super::responses::{AccountNotFound, InvalidParameter, InvalidTime, Unavailable};
use crate::domain::{BalanceAt, Entry, EntryKind, Finality, Scope};

/// Entries a page holds unless `limit` says otherwise.
pub const DEFAULT_ENTRIES: u32 = 100;
/// The most entries a page holds.
pub const MAX_ENTRIES: u32 = 1000;

/// What changed the account (`docs/ledger.md`): `opened`; a transfer's `debit` of its
/// source and `credit` of its destination; a rollback's `debit_undone` (and
/// `credit_undone`, never expected: nothing is credited before the commit point); a hold's
/// reservations `debit_reserved` and `credit_reserved`, their release by a void, an
/// expiry or a rollback (`debit_released`, `credit_released`), and a capture
/// (`debit_captured`, `credit_captured`: the captured amount moves and the reservation
/// goes, in one entry).
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EntryKindSchema {
    Opened,
    Debit,
    Credit,
    DebitUndone,
    CreditUndone,
    DebitReserved,
    CreditReserved,
    DebitReleased,
    CreditReleased,
    DebitCaptured,
    CreditCaptured,
}

impl From<EntryKind> for EntryKindSchema {
    fn from(kind: EntryKind) -> Self {
        match kind {
            EntryKind::Opened => EntryKindSchema::Opened,
            EntryKind::Debit => EntryKindSchema::Debit,
            EntryKind::Credit => EntryKindSchema::Credit,
            EntryKind::DebitUndone => EntryKindSchema::DebitUndone,
            EntryKind::CreditUndone => EntryKindSchema::CreditUndone,
            EntryKind::DebitReserved => EntryKindSchema::DebitReserved,
            EntryKind::CreditReserved => EntryKindSchema::CreditReserved,
            EntryKind::DebitReleased => EntryKindSchema::DebitReleased,
            EntryKind::CreditReleased => EntryKindSchema::CreditReleased,
            EntryKind::DebitCaptured => EntryKindSchema::DebitCaptured,
            EntryKind::CreditCaptured => EntryKindSchema::CreditCaptured,
        }
    }
}

/// One numbered change to an account's amounts, with the amounts it left.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(example = json!({
    "account": "alice", "seq": 2, "transferId": "6b0619d67d0e8af2ac0b1adf", "kind": "debit",
    "balanceChange": -2500, "pendingDebitsChange": 0, "pendingCreditsChange": 0,
    "balance": 7500, "pendingDebits": 0, "pendingCredits": 0, "availableBalance": 7500,
    "at": "2026-11-24T23:12:22.950Z"
}))]
pub struct EntryResponse {
    pub account: String,
    /// The entry's number: 1 for the opening, then one more for each change, without
    /// gaps.
    #[schema(minimum = 1)]
    pub seq: u64,
    /// The transfer whose step made the change; absent on `opened`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transfer_id: Option<String>,
    pub kind: EntryKindSchema,
    /// What the change added to `balance` (negative: taken out).
    pub balance_change: i64,
    /// What the change added to `pendingDebits`.
    pub pending_debits_change: i64,
    /// What the change added to `pendingCredits`.
    pub pending_credits_change: i64,
    /// `balance` after the change.
    #[schema(minimum = 0, maximum = 9007199254740991_i64)]
    pub balance: i64,
    /// `pendingDebits` after the change.
    #[schema(minimum = 0, maximum = 9007199254740991_i64)]
    pub pending_debits: i64,
    /// `pendingCredits` after the change.
    #[schema(minimum = 0, maximum = 9007199254740991_i64)]
    pub pending_credits: i64,
    /// `balance - pendingDebits` after the change.
    #[schema(minimum = 0, maximum = 9007199254740991_i64)]
    pub available_balance: i64,
    /// The database's time when the change landed; never before the previous entry's.
    pub at: DateTime<Utc>,
    /// True on the `opened` entry a migration gave an account opened before entries
    /// existed: it carries the account's amounts at the migration's time, not its real
    /// opening. Absent otherwise.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub carried_forward: bool,
}

impl From<Entry> for EntryResponse {
    fn from(e: Entry) -> Self {
        EntryResponse {
            account: e.account.to_string(),
            seq: e.seq,
            transfer_id: e.transfer_id.map(|id| id.to_string()),
            kind: e.kind.into(),
            balance_change: e.change.balance,
            pending_debits_change: e.change.pending_debits,
            pending_credits_change: e.change.pending_credits,
            balance: e.after.balance,
            pending_debits: e.after.pending_debits,
            pending_credits: e.after.pending_credits,
            available_balance: e.after.available_balance(),
            at: e.at,
            carried_forward: e.carried_forward,
        }
    }
}

/// A page of an account's entries, oldest first.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct EntryPage {
    pub items: Vec<EntryResponse>,
    /// Pass as `after` for the entries after this page: the `seq` of its last entry, in
    /// decimal. Null when the page is empty (nothing after `after` yet): keep your
    /// `after` and ask again later.
    #[schema(required = true, pattern = "^[1-9][0-9]{0,18}$", example = "17")]
    pub next: Option<String>,
}

/// The paging of an account's entries, as sent.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EntryParams {
    /// A page's `next`: the entries after it, those with a greater `seq` (it is the
    /// last one's `seq`, in decimal; any `seq` or 0 is read the same way). Absent or 0:
    /// from the first entry.
    #[param(pattern = "^[0-9]{1,19}$", example = "17")]
    pub after: Option<String>,
    /// How many entries to return, 1 to 1000. Default 100.
    #[param(value_type = Option<u32>, minimum = 1, maximum = 1000, example = 100)]
    pub limit: Option<String>,
}

impl EntryParams {
    fn parse(&self) -> Result<(u64, u32), ApiError> {
        let after = match self.after.as_deref() {
            None => 0,
            Some(raw) => raw
                .parse::<u64>()
                .ok()
                .filter(|&n| n <= i64::MAX as u64)
                .ok_or_else(|| ApiError::InvalidParameter {
                    field: "after".into(),
                    detail: "after must be a page's next: an entry's seq, or 0".into(),
                })?,
        };
        let limit = match self.limit.as_deref() {
            None => DEFAULT_ENTRIES,
            Some(raw) => raw
                .parse::<u32>()
                .ok()
                .filter(|n| (1..=MAX_ENTRIES).contains(n))
                .ok_or_else(|| ApiError::InvalidParameter {
                    field: "limit".into(),
                    detail: format!("limit must be a whole number from 1 to {MAX_ENTRIES}"),
                })?,
        };
        Ok((after, limit))
    }
}

/// List an account's entries, oldest first.
///
/// Every change to the account's `balance`, `pendingDebits` or `pendingCredits`, numbered
/// from 1 without gaps, each with the amounts it left. A reader that passes each answer's
/// `next` as `after` sees every entry once; an entry is there by the time the request
/// that made it was answered.
#[utoipa::path(
    get, path = "/accounts/{id}/entries", tag = "accounts",
    params(("id" = String, Path, description = "The account id.", pattern = "^[A-Za-z0-9_.:@-]{1,64}$", example = "alice"), EntryParams),
    responses(
        (status = 200, description = "A page of entries, oldest first.", body = EntryPage,
            links(("NextPage" = (operation_id = "list_entries", parameters(("id" = "$request.path.id"), ("after" = "$response.body#/next")), description = "The entries after this page (none yet when `next` is null).")))),
        (status = 400, response = InvalidParameter),
        (status = 404, response = AccountNotFound),
        (status = 503, response = Unavailable),
    )
)]
pub async fn list_entries(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    query: Result<Query<EntryParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<EntryPage>, ApiError> {
    let id = path_account(&id)?;
    state.service.book().check_account_seen(&scope, &id).await?;
    let (after, limit) = super::query(query)?.parse()?;
    let entries = state.service.book().entries(&id, after, limit).await?;
    let next = entries.last().map(|e| e.seq.to_string());
    Ok(Json(EntryPage {
        items: entries.into_iter().map(EntryResponse::from).collect(),
        next,
    }))
}

/// An account's amounts as of a moment.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(example = json!({
    "account": "alice", "at": "2026-10-31T23:59:59.999Z", "seq": 17,
    "balance": 7500, "pendingDebits": 0, "pendingCredits": 0, "availableBalance": 7500,
    "final": true
}))]
pub struct BalanceResponse {
    pub account: String,
    /// The moment asked about (the database's time when none was).
    pub at: DateTime<Utc>,
    /// The number of the last entry at or before `at`; 0 before the account was opened.
    #[schema(minimum = 0)]
    pub seq: u64,
    #[schema(minimum = 0, maximum = 9007199254740991_i64)]
    pub balance: i64,
    #[schema(minimum = 0, maximum = 9007199254740991_i64)]
    pub pending_debits: i64,
    #[schema(minimum = 0, maximum = 9007199254740991_i64)]
    pub pending_credits: i64,
    /// `balance - pendingDebits`.
    #[schema(minimum = 0, maximum = 9007199254740991_i64)]
    pub available_balance: i64,
    /// Whether this answer is final: true once the deployment's clock has passed `at` by
    /// a minute, and the same question is then answered the same way for ever; false for
    /// a moment in the future, now, or within that minute, where an entry still in flight
    /// (or stamped by a database member whose clock is behind, after a failover) may yet
    /// land at or before `at`. Ask again after `at` plus a minute for the final answer.
    #[serde(rename = "final")]
    pub is_final: bool,
}

impl From<BalanceAt> for BalanceResponse {
    fn from(b: BalanceAt) -> Self {
        BalanceResponse {
            account: b.account.to_string(),
            at: b.at,
            seq: b.seq,
            balance: b.amounts.balance,
            pending_debits: b.amounts.pending_debits,
            pending_credits: b.amounts.pending_credits,
            available_balance: b.amounts.available_balance(),
            is_final: b.finality == Finality::Final,
        }
    }
}

/// The moment of a balance, as sent.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct BalanceParams {
    /// An RFC 3339 time (`2026-10-31T23:59:59.999Z`); now when absent. A time in the
    /// future answers the current amounts.
    #[param(value_type = Option<String>, format = DateTime, example = "2026-10-31T23:59:59.999Z")]
    pub at: Option<String>,
}

/// Read an account's amounts as of a moment.
///
/// The amounts after the account's last entry whose `at` is not later than the moment:
/// `seq` 0 and zeros before the account was opened; the current amounts for a time in the
/// future or none. These are the amounts as stored: unlike `GET /accounts/{id}`, a hold
/// past its expiry still counts until it is released (its release is an entry).
///
/// `final` says whether the answer can still change: it is true once the deployment's
/// clock has passed the moment by a minute, and false for a moment in the future, now, or
/// within that minute (an entry in flight may still land at or before it).
#[utoipa::path(
    get, path = "/accounts/{id}/balance", tag = "accounts",
    params(("id" = String, Path, description = "The account id.", pattern = "^[A-Za-z0-9_.:@-]{1,64}$", example = "alice"), BalanceParams),
    responses(
        (status = 200, description = "The account's amounts as of the moment.", body = BalanceResponse),
        (status = 400, response = InvalidParameter),
        (status = 404, response = AccountNotFound),
        (status = 422, response = InvalidTime),
        (status = 503, response = Unavailable),
    )
)]
pub async fn get_balance(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    query: Result<Query<BalanceParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<BalanceResponse>, ApiError> {
    let id = path_account(&id)?;
    state.service.book().check_account_seen(&scope, &id).await?;
    let at = match super::query(query)?.at.as_deref() {
        None => None,
        Some(raw) => Some(
            DateTime::parse_from_rfc3339(raw)
                .map_err(|_| ApiError::InvalidField {
                    field: "at".into(),
                    detail: "at must be an RFC 3339 time, such as 2026-10-31T23:59:59.999Z".into(),
                })?
                .with_timezone(&Utc),
        ),
    };
    Ok(Json(state.service.book().balance_at(&id, at).await?.into()))
}
