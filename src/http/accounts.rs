//! `/accounts`: open, read and list accounts, and list an account's transfers.

use axum::Json;
use axum::extract::{Extension, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::IntoResponse;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::AppState;
use super::extract::ApiJson;
use super::pagination::{Page, PageParams, page};
use super::problem::{ApiError, field};
use super::responses::{
    AccountExists, AccountNotFound, AccountRefused, InvalidParameter, MalformedJson,
    PayloadTooLarge, Unavailable, UnsupportedMediaType,
};
use super::transfers::{TransferPage, TransferResponse};
use crate::domain::{
    Account, AccountId, AccountName, Currency, DeploymentName, OpeningBalance, Scope, TenantName,
    TransferId,
};
use crate::service::NewAccount;

/// A request to open an account.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schema(example = json!({"id": "alice", "name": "Alice", "balance": 10000, "currency": "EUR"}))]
pub struct CreateAccountRequest {
    /// 1 to 64 characters from `A-Za-z0-9_.:@-`; generated when absent.
    #[schema(pattern = "^[A-Za-z0-9_.:@-]{1,64}$")]
    pub id: Option<String>,
    /// A name for people, at most 200 characters, no control characters.
    #[schema(max_length = 200, pattern = r"^[^\u0000-\u001F\u007F-\u009F]*$")]
    pub name: Option<String>,
    /// Opening balance in minor units (cents for EUR). Default 0.
    #[schema(minimum = 0, maximum = 9007199254740991_i64)]
    pub balance: Option<i64>,
    /// ISO-4217 code, three uppercase letters. Default `USD`.
    #[schema(pattern = "^[A-Z]{3}$")]
    pub currency: Option<String>,
    /// The deployment (`DEPLOYMENTS`) that keeps the account, for ever: 1 to 32
    /// characters from `a-z0-9_-`. Default: the first deployment configured.
    #[schema(pattern = "^[a-z0-9_-]{1,32}$")]
    pub deployment: Option<String>,
    /// The tenant that owns the account, for ever (`docs/tenants.md`): 1 to 64
    /// characters from `a-z0-9_-`. A tenant's API key opens accounts into its own tenant
    /// (leave it out, or name that one); a platform key names it, or leaves it out for an
    /// account of no tenant, which only platform keys see.
    #[schema(pattern = "^[a-z0-9_-]{1,64}$")]
    pub tenant: Option<String>,
}

/// An account.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(example = json!({
    "id": "alice", "name": "Alice", "balance": 10000, "availableBalance": 7500,
    "pendingDebits": 2500, "pendingCredits": 0, "currency": "EUR", "pendingTransactions": [], "seq": 3, "deployment": "eu", "tenant": "acme", "createdAt": "2026-11-22T10:00:00Z", "updatedAt": "2026-11-22T10:00:00Z"
}))]
pub struct AccountResponse {
    /// 1 to 64 characters from `A-Za-z0-9_.:@-`.
    pub id: String,
    /// The deployment that keeps the account (`default` unless `DEPLOYMENTS` names
    /// several).
    pub deployment: String,
    /// The tenant that owns the account; null for an account of no tenant.
    #[schema(required = true)]
    pub tenant: Option<String>,
    /// The name given at opening; null when none was.
    #[schema(required = true)]
    pub name: Option<String>,
    /// The posted balance in minor units, 0 to 9007199254740991. Includes transfers
    /// applied but not yet finished; holds change it only once captured.
    #[schema(minimum = 0, maximum = 9007199254740991_i64)]
    pub balance: i64,
    /// What the account may spend: `balance - pendingDebits`, never below zero.
    #[schema(minimum = 0, maximum = 9007199254740991_i64)]
    pub available_balance: i64,
    /// The sum of the live holds out of the account.
    #[schema(minimum = 0, maximum = 9007199254740991_i64)]
    pub pending_debits: i64,
    /// The sum of the live holds into the account (not spendable until captured).
    #[schema(minimum = 0, maximum = 9007199254740991_i64)]
    pub pending_credits: i64,
    /// ISO-4217 code.
    pub currency: String,
    /// Ids of transfers applied to this account whose protocol has not finished.
    pub pending_transactions: Vec<String>,
    /// The number of the account's last ledger entry (`GET /accounts/{id}/entries`).
    #[schema(minimum = 1)]
    pub seq: u64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// A page of accounts, in id order.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(example = json!({
    "items": [{
        "id": "alice", "name": "Alice", "balance": 10000, "availableBalance": 10000,
        "pendingDebits": 0, "pendingCredits": 0, "currency": "EUR", "pendingTransactions": [], "seq": 3, "deployment": "eu", "tenant": "acme", "createdAt": "2026-11-22T10:00:00Z", "updatedAt": "2026-11-22T10:00:00Z"
    }],
    "next": "YWNjb3VudHM6YWxpY2U"
}))]
pub struct AccountPage {
    pub items: Vec<AccountResponse>,
    /// Pass as `after` to get the next page; null on the last page.
    #[schema(required = true)]
    pub next: Option<String>,
}

impl From<Page<AccountResponse>> for AccountPage {
    fn from(page: Page<AccountResponse>) -> Self {
        AccountPage {
            items: page.items,
            next: page.next,
        }
    }
}

impl From<Account> for AccountResponse {
    fn from(a: Account) -> Self {
        let available_balance = a.available_balance();
        AccountResponse {
            id: a.id.to_string(),
            deployment: a.deployment.to_string(),
            tenant: a.tenant.map(|t| t.to_string()),
            name: a.name.map(|n| n.as_str().to_owned()),
            balance: a.balance,
            available_balance,
            pending_debits: a.pending_debits,
            pending_credits: a.pending_credits,
            currency: a.currency.to_string(),
            pending_transactions: a
                .pending_transactions
                .iter()
                .map(|id| id.to_string())
                .collect(),
            seq: a.seq,
            created_at: a.created_at,
            updated_at: a.updated_at,
        }
    }
}

/// Parses an account id taken from the path; an id that cannot exist is simply not found.
pub(super) fn path_account(raw: &str) -> Result<AccountId, ApiError> {
    AccountId::parse(raw).map_err(|_| ApiError::AccountNotFound(raw.chars().take(80).collect()))
}

/// Open an account.
///
/// It needs two deployments to answer: the first, which keeps the directory of account
/// ids, and the account's own; while either does not, the answer is 503.
#[utoipa::path(
    post, path = "/accounts", tag = "accounts",
    request_body(content = CreateAccountRequest, examples(
        ("alice" = (summary = "Alice, with 100.00 EUR", value = json!({"id": "alice", "name": "Alice", "balance": 10000, "currency": "EUR"}))),
        ("bob" = (summary = "Bob, in EUR, empty", value = json!({"id": "bob", "name": "Bob", "currency": "EUR"}))),
    )),
    responses(
        (status = 201, description = "The account was opened.", body = AccountResponse,
            headers(("Location" = String, description = "The URL of the new account: /accounts/{id}.")),
            links(
                ("GetAccount" = (operation_id = "get_account", parameters(("id" = "$response.body#/id")), description = "Read the account.")),
                ("ListEntries" = (operation_id = "list_entries", parameters(("id" = "$response.body#/id")), description = "Its ledger.")),
                ("GetBalance" = (operation_id = "get_balance", parameters(("id" = "$response.body#/id")), description = "Its amounts as of a moment.")),
                ("ListAccountTransfers" = (operation_id = "list_account_transfers", parameters(("id" = "$response.body#/id")), description = "The transfers touching it.")),
            )),
        (status = 400, response = MalformedJson),
        (status = 409, response = AccountExists),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, response = AccountRefused),
        (status = 503, response = Unavailable),
    )
)]
pub async fn create_account(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    ApiJson(body): ApiJson<CreateAccountRequest>,
) -> Result<impl IntoResponse, ApiError> {
    let tenant = body
        .tenant
        .as_deref()
        .map(|raw| field("tenant", TenantName::parse(raw)))
        .transpose()?;
    let new = NewAccount {
        tenant: scope
            .tenant_of_new(tenant)
            .map_err(|_| ApiError::InvalidField {
                field: "tenant".into(),
                detail: "tenant: a tenant's API key opens accounts into its own tenant only".into(),
            })?,
        id: body
            .id
            .as_deref()
            .map(|raw| field("id", AccountId::parse(raw)))
            .transpose()?,
        name: body
            .name
            .as_deref()
            .map(|raw| field("name", AccountName::parse(raw)))
            .transpose()?,
        balance: field("balance", OpeningBalance::parse(body.balance.unwrap_or(0)))?,
        currency: match body.currency.as_deref() {
            Some(raw) => field("currency", Currency::parse(raw))?,
            None => Currency::usd(),
        },
        deployment: body
            .deployment
            .as_deref()
            .map(|raw| field("deployment", DeploymentName::parse(raw)))
            .transpose()?,
    };
    let account = state.service.book().open_account(new).await?;
    let mut headers = HeaderMap::new();
    if let Ok(location) = HeaderValue::from_str(&format!("/accounts/{}", account.id)) {
        headers.insert(header::LOCATION, location);
    }
    Ok((
        StatusCode::CREATED,
        headers,
        Json(AccountResponse::from(account)),
    ))
}

/// Read an account.
#[utoipa::path(
    get, path = "/accounts/{id}", tag = "accounts",
    params(("id" = String, Path, description = "The account id.", pattern = "^[A-Za-z0-9_.:@-]{1,64}$", example = "alice")),
    responses(
        (status = 200, description = "The account.", body = AccountResponse),
        (status = 404, response = AccountNotFound),
        (status = 503, response = Unavailable),
    )
)]
pub async fn get_account(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Json<AccountResponse>, ApiError> {
    let id = path_account(&id)?;
    Ok(Json(
        state.service.book().account_in(&scope, &id).await?.into(),
    ))
}

/// List accounts in id order.
#[utoipa::path(
    get, path = "/accounts", tag = "accounts",
    params(PageParams),
    responses(
        (status = 200, description = "A page of accounts.", body = AccountPage,
            links(
                ("NextPage" = (operation_id = "list_accounts", parameters(("after" = "$response.body#/next")), description = "The next page, while `next` is not null.")),
            )),
        (status = 400, response = InvalidParameter),
        (status = 503, response = Unavailable),
    )
)]
pub async fn list_accounts(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: Result<Query<PageParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<AccountPage>, ApiError> {
    let params = super::query(query)?;
    let request = params.parse("accounts", |key| AccountId::parse(key).ok())?;
    let fetched = state
        .service
        .book()
        .accounts(&scope, request.after.as_ref(), request.limit + 1)
        .await?;
    Ok(Json(
        page(
            fetched,
            request.limit,
            "accounts",
            |a| a.id.to_string(),
            AccountResponse::from,
        )
        .into(),
    ))
}

/// List the transfers touching an account, newest first.
#[utoipa::path(
    get, path = "/accounts/{id}/transfers", tag = "accounts",
    params(("id" = String, Path, description = "The account id.", pattern = "^[A-Za-z0-9_.:@-]{1,64}$", example = "alice"), PageParams),
    responses(
        (status = 200, description = "A page of transfers, newest first.", body = TransferPage,
            links(("NextPage" = (operation_id = "list_account_transfers", parameters(("id" = "$request.path.id"), ("after" = "$response.body#/next")), description = "The next page, while `next` is not null.")))),
        (status = 400, response = InvalidParameter),
        (status = 404, response = AccountNotFound),
        (status = 503, response = Unavailable),
    )
)]
pub async fn list_account_transfers(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    query: Result<Query<PageParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<TransferPage>, ApiError> {
    let id = path_account(&id)?;
    state.service.book().check_account_seen(&scope, &id).await?;
    let params = super::query(query)?;
    let request = params.parse("transfers", |key| TransferId::parse(key).ok())?;
    let fetched = state
        .service
        .requests()
        .account_transfers(&id, request.after, request.limit + 1)
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
