//! `/events`: the event feed (`docs/events.md`), read with a cursor.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Json;
use axum::extract::{Extension, Query, State};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::AppState;
use super::accounts::AccountResponse;
use super::problem::ApiError;
use super::responses::{CursorExpired, InvalidParameter, TooManyStreams, Unavailable};
use super::transfers::TransferResponse;
use crate::domain::{Event, EventData, EventType, FeedCursor, Scope};

/// Events a page holds unless `limit` says otherwise.
pub const DEFAULT_EVENTS: u32 = 100;
/// The most events a page holds.
pub const MAX_EVENTS: u32 = 1000;

/// What an event reports: `account.opened`; a hold's `transfer.held`; `transfer.done`
/// (also a capture, the hold's own, and a reversal, its compensating transfer's, which
/// carries `reverses`); `transfer.canceled` (also a void or an expiry, with the reason).
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub enum EventTypeSchema {
    #[serde(rename = "account.opened")]
    AccountOpened,
    #[serde(rename = "transfer.held")]
    TransferHeld,
    #[serde(rename = "transfer.done")]
    TransferDone,
    #[serde(rename = "transfer.canceled")]
    TransferCanceled,
}

impl From<EventType> for EventTypeSchema {
    fn from(kind: EventType) -> Self {
        match kind {
            EventType::AccountOpened => EventTypeSchema::AccountOpened,
            EventType::TransferHeld => EventTypeSchema::TransferHeld,
            EventType::TransferDone => EventTypeSchema::TransferDone,
            EventType::TransferCanceled => EventTypeSchema::TransferCanceled,
        }
    }
}

/// The account or the transfer the event is about, as `GET` answered it at that moment.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum EventDataResponse {
    Transfer(TransferResponse),
    Account(AccountResponse),
}

/// One event.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({
    "id": "transfer.done:6b0619d67d0e8af2ac0b1adf", "type": "transfer.done",
    "at": "2026-11-26T12:35:03.193Z",
    "data": { "id": "6b0619d67d0e8af2ac0b1adf", "source": "alice", "destination": "bob",
              "amount": 2500, "currency": "EUR", "state": "done",
              "createdAt": "2026-11-26T12:35:03.180Z", "lastModified": "2026-11-26T12:35:03.193Z" }
}))]
pub struct EventResponse {
    /// The same for the same event everywhere and always: `<type>:<account or transfer
    /// id>`.
    pub id: String,
    #[serde(rename = "type")]
    pub kind: EventTypeSchema,
    /// The database's time of the change the event reports.
    pub at: DateTime<Utc>,
    pub data: EventDataResponse,
}

impl From<Event> for EventResponse {
    fn from(e: Event) -> Self {
        EventResponse {
            id: e.id,
            kind: e.kind.into(),
            at: e.at,
            data: match e.data {
                EventData::Transfer(t) => EventDataResponse::Transfer(t.into()),
                EventData::Account(a) => EventDataResponse::Account(a.into()),
            },
        }
    }
}

/// A page of the feed.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventPage {
    pub items: Vec<EventResponse>,
    /// Pass it as `after` for the events after this page, now or later (an empty page
    /// gives it too). Opaque; valid as long as the events after it are retained.
    pub next: String,
}

/// The reading of the feed, as sent.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventParams {
    /// A page's `next`: the events after it. Absent: from the oldest retained event.
    #[param(min_length = 1, pattern = "^[A-Za-z0-9_-]+$")]
    pub after: Option<String>,
    /// How many events to return, 1 to 1000. Default 100.
    #[param(value_type = Option<u32>, minimum = 1, maximum = 1000, example = 100)]
    pub limit: Option<String>,
    /// Only these types, comma-separated (`transfer.done,transfer.canceled`). Absent:
    /// every type.
    #[param(example = "transfer.done,transfer.canceled")]
    #[serde(rename = "type")]
    pub kind: Option<String>,
}

impl EventParams {
    fn parse(
        &self,
        service: &crate::service::Feed,
    ) -> Result<(Option<FeedCursor>, u32, Vec<EventType>), ApiError> {
        let after = match self.after.as_deref() {
            None => None,
            Some(raw) => {
                Some(
                    service
                        .client_cursor(raw)
                        .map_err(|e| ApiError::InvalidParameter {
                            field: "after".into(),
                            detail: format!("after {}: pass a page's next", e.0),
                        })?,
                )
            }
        };
        let limit = match self.limit.as_deref() {
            None => DEFAULT_EVENTS,
            Some(raw) => raw
                .parse::<u32>()
                .ok()
                .filter(|n| (1..=MAX_EVENTS).contains(n))
                .ok_or_else(|| ApiError::InvalidParameter {
                    field: "limit".into(),
                    detail: format!("limit must be a whole number from 1 to {MAX_EVENTS}"),
                })?,
        };
        let mut types = Vec::new();
        if let Some(raw) = self.kind.as_deref() {
            for name in raw.split(',') {
                let kind = EventType::parse(name).map_err(|e| ApiError::InvalidParameter {
                    field: "type".into(),
                    detail: format!("each type {}", e.0),
                })?;
                if !types.contains(&kind) {
                    types.push(kind);
                }
            }
        }
        Ok((after, limit, types))
    }
}

/// Read the event feed.
///
/// Events after the cursor, in the order they were recorded: a transfer reaching `held`,
/// `done` or `canceled`, and an account opened. A reader that follows `next` sees every
/// event exactly once, and each only once the change it reports is durable. With several
/// deployments, each one's events come in its own order, merged by time; a deployment that
/// does not answer is skipped and its events come once it is back.
#[utoipa::path(
    get, path = "/events", tag = "events",
    params(EventParams),
    responses(
        (status = 200, description = "A page of events and the cursor after it.", body = EventPage,
            links(("NextPage" = (operation_id = "list_events", parameters(("after" = "$response.body#/next")), description = "The events after this page, now or later.")))),
        (status = 400, response = InvalidParameter),
        (status = 410, response = CursorExpired),
        (status = 503, response = Unavailable),
    )
)]
pub async fn list_events(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: Result<Query<EventParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<EventPage>, ApiError> {
    let (after, limit, types) = super::query(query)?.parse(state.service.feed())?;
    let page = state
        .service
        .feed()
        .events(&scope, after, limit, &types)
        .await?;
    Ok(Json(EventPage {
        items: page.events.into_iter().map(EventResponse::from).collect(),
        next: page.next.encode(),
    }))
}

/// The event stream's start, as sent.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct StreamParams {
    /// A cursor (a page's `next`, or an event's `id:` line): the events after it.
    /// `Last-Event-ID`, when sent, wins. Neither: from the oldest retained event.
    #[param(min_length = 1, pattern = "^[A-Za-z0-9_-]+$")]
    pub after: Option<String>,
    /// Only these types, comma-separated. Absent: every type.
    #[param(example = "transfer.done,transfer.canceled")]
    #[serde(rename = "type")]
    pub kind: Option<String>,
}

/// How often an idle stream sends a comment, so that proxies keep it open.
pub const KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(15);

/// Follow the event feed live (Server-Sent Events).
///
/// Each event as `id: <cursor>`, `event: <type>`, `data: <the event's JSON>`, in the
/// feed's order, and a comment every 15 s while idle. A browser's `EventSource` resumes
/// after a drop with `Last-Event-ID` by itself, with no loss and no repeat. A reader too
/// slow to keep up (256 events waiting for it) is disconnected with a final comment saying
/// so, and resumes the same way.
#[utoipa::path(
    get, path = "/events/stream", tag = "events",
    params(
        StreamParams,
        ("Last-Event-ID" = Option<String>, Header, description = "The `id` of the last event received: the stream resumes right after it."),
    ),
    responses(
        (status = 200, description = "The stream, `text/event-stream`.", content_type = "text/event-stream", body = String),
        (status = 400, response = InvalidParameter),
        (status = 410, response = CursorExpired),
        (status = 503, response = TooManyStreams),
    )
)]
pub async fn stream_events(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    revocable: Option<Extension<super::auth::RevocableKey>>,
    headers: axum::http::HeaderMap,
    query: Result<Query<StreamParams>, axum::extract::rejection::QueryRejection>,
) -> Result<axum::response::Response, ApiError> {
    use axum::response::IntoResponse;
    use axum::response::sse::{Event as Sse, KeepAlive};
    use futures::StreamExt;

    let params = super::query(query)?;
    let feed = state.service.feed();
    // The header, when sent, wins (`after` is then not read): a browser's EventSource sends
    // it on reconnecting, with the URL it first opened, whose `after` is older.
    let resume = match headers.get("last-event-id") {
        None => None,
        Some(value) => {
            let refuse = |why: &str| ApiError::InvalidParameter {
                field: "Last-Event-ID".into(),
                detail: format!("Last-Event-ID {why}: pass the id: of the last event received"),
            };
            let raw = value
                .to_str()
                .map_err(|_| refuse("is not an event id this service sent"))?;
            Some(feed.client_cursor(raw).map_err(|e| refuse(&e.0))?)
        }
    };
    let (after, _, types) = EventParams {
        after: if resume.is_some() { None } else { params.after },
        limit: None,
        kind: params.kind,
    }
    .parse(feed)?;
    let after = resume.or(after);
    let follower = feed
        .follow(scope, after, types, state.shutdown.clone())
        .await?;
    let ended = follower.ended.clone();
    let permit_and_queue = follower;
    let events = futures::stream::unfold(permit_and_queue, |mut f| async move {
        let (event, cursor) = f.next().await?;
        Some(((event, cursor), f))
    })
    .map(|(event, cursor)| {
        let kind = event.kind.as_str();
        let body = serde_json::to_string(&EventResponse::from(event)).unwrap_or_default();
        Ok::<_, std::convert::Infallible>(Sse::default().id(cursor.encode()).event(kind).data(body))
    });
    let revoked = Arc::new(AtomicBool::new(false));
    let events = match revocable {
        Some(Extension(key)) => events
            .take_until(until_revoked(state.keys.clone(), key, revoked.clone()))
            .boxed(),
        None => events.boxed(),
    };
    let last = futures::stream::once(async move {
        let end = *ended.lock().unwrap_or_else(|e| e.into_inner());
        let why = if revoked.load(Ordering::SeqCst) {
            "disconnected: this API key was revoked".to_owned()
        } else {
            why_ended(end)
        };
        Ok(Sse::default().comment(why))
    });
    let stream = events.chain(last);
    Ok(axum::response::sse::Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE).text("keep-alive"))
        .into_response())
}

/// Ends when `key` is revoked (setting `revoked`): a stream outlives the check its
/// request passed, so it checks its key again as often as a request would see a
/// revocation ([`crate::service::api_keys::REVALIDATE_AFTER`]). A check the database
/// cannot answer ends nothing: the next one decides.
async fn until_revoked(
    keys: crate::service::KeyBook,
    key: super::auth::RevocableKey,
    revoked: Arc<AtomicBool>,
) {
    loop {
        tokio::time::sleep(crate::service::api_keys::REVALIDATE_AFTER).await;
        if let Ok(None) = keys.authenticate(key.secret()).await {
            revoked.store(true, Ordering::SeqCst);
            return;
        }
    }
}

/// The final comment of a stream whose follower stopped for `end`.
fn why_ended(end: Option<crate::service::FollowEnd>) -> String {
    match end {
        Some(crate::service::FollowEnd::FellBehind) => format!(
            "disconnected: this reader fell {} events behind; reconnect with Last-Event-ID",
            crate::service::FOLLOWER_QUEUE
        ),
        Some(crate::service::FollowEnd::FellBehindInBytes) => format!(
            "disconnected: this reader fell {} KiB of events behind; reconnect with Last-Event-ID",
            crate::service::FOLLOWER_QUEUE_BYTES / 1024
        ),
        Some(crate::service::FollowEnd::Expired) => {
            "disconnected: the events after this stream's position were removed after the retention; read GET /events without a cursor".to_owned()
        }
        Some(crate::service::FollowEnd::ShuttingDown) | None => {
            "disconnected: the server is shutting down; reconnect with Last-Event-ID".to_owned()
        }
    }
}
