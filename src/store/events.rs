//! Events (`docs/events.md`): recorded from the deployment's change stream into
//! `events`, kept for the retention, and read as the deployment's feed.
//!
//! Recording:
//! - The events come from the database's own change stream: a change reports a transfer
//!   reaching `held`, `done` or `canceled` (an update naming the new `state`, or an
//!   insert or replace of a document in that state) or an account's insert. The stream
//!   gives only majority-committed changes, in the order the deployment applied them,
//!   whichever instance or strategy made them, so no code path can forget an event.
//! - An event's [`Position`] is the change's cluster time, then its id ([`key`]). Both
//!   come from the change: every instance that records it gives it the same key and the
//!   same `_id`, and a second recording is refused by `_id`.
//! - One instance at a time records a deployment's events, under a lease in
//!   `eventRecorder` judged by the database's clock. Two recorders at once (a lease that
//!   ran out under a slow owner) are harmless: each inserts in stream order, and the
//!   second copy of an event is refused.
//! - Each recorder inserts in stream order (ordered inserts): an event is visible only
//!   once every event before it in its deployment's feed is. A reader that has read up
//!   to a position therefore never sees an event appear below it later.
//! - Where the stream resumes (`resumeToken`) is saved after the events before it are
//!   recorded, so a crash or a takeover records some events twice (refused), never
//!   skips one. The first recorder starts from `startAt`, the cluster time taken when
//!   this version first started ([`Store::prepare_feed`]), before it served a request.
//!
//! Keeping: events older than the retention are removed from the front of the feed
//! ([`Store::trim_events`]). `trimmedThrough` is raised before they are deleted; a
//! reader whose position is below it may have missed an event, and is told so.

use std::time::Duration;

use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::{self, Bson, DateTime, Document, doc};
use mongodb::change_stream::ChangeStream;
use mongodb::change_stream::event::{ChangeStreamEvent, OperationType, ResumeToken};
use mongodb::error::ErrorKind;
use mongodb::options::FullDocumentType;
use serde::{Deserialize, Serialize};

use super::documents::{AccountDoc, Stored, TransferDoc, stored_time};
use super::{Store, StoreError, StoreResult};
use crate::domain::{
    Event, EventData, EventType, Position, TenantName, Timestamp, TransferState, event_id,
};

/// The collection of events.
const EVENTS: &str = "events";
/// The collection of the recorder's one document.
const RECORDER: &str = "eventRecorder";
/// The `_id` of that document.
const RECORDER_ID: &str = "recorder";
/// How long the server waits for a change before it answers an empty batch: how long a
/// quiet recorder goes before it checks its lease and the retention.
const MAX_AWAIT: Duration = Duration::from_millis(200);
/// The most changes recorded in one insert.
pub const MAX_RECORDED: usize = 500;
/// How long a recorder gathers changes, from the first, before it records them.
const GATHER_FOR: Duration = Duration::from_millis(20);
/// The most events removed in one round of [`Store::trim_events`]: a round is one
/// `deleteMany`, which holds SecantusDB's write lock for its whole length (about 25 ms
/// for this many), so the rounds stay short and the recorder runs them back to back
/// while there is more to remove.
pub const MAX_TRIMMED: u64 = 1000;

/// A stored event.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct EventDoc {
    /// [`event_id`]: a second recording of the event is refused by it.
    #[serde(rename = "_id")]
    id: String,
    #[serde(rename = "type")]
    kind: String,
    /// The database's time of the change it reports.
    at: DateTime,
    /// Its place in the feed: [`key`] of its [`Position`].
    key: String,
    /// The transfer as it was when it reached the event's state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    transfer: Option<TransferDoc>,
    /// The account as it was opened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    account: Option<AccountDoc>,
    /// The tenants that see it (`docs/tenants.md`): its transfer's, or its account's;
    /// index `tenants_key` walks one tenant's feed without the others' events.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    tenants: Vec<String>,
}

/// A position as the feed stores and compares it: ten digits of seconds, ten of
/// increment, then the id, so that the order of the strings is the order of the
/// positions.
pub fn key(p: &Position) -> String {
    format!("{:010}{:010}{}", p.seconds, p.increment, p.id)
}

/// The position [`key`] made, if `raw` is one.
pub fn position(raw: &str) -> Option<Position> {
    let (seconds, rest) = (raw.get(..10)?, raw.get(10..)?);
    let (increment, id) = (rest.get(..10)?, rest.get(10..)?);
    Some(Position {
        seconds: seconds.parse().ok()?,
        increment: increment.parse().ok()?,
        id: id.to_owned(),
    })
}

/// A deployment's change stream, opened by its recorder.
pub struct Changes {
    stream: ChangeStream<ChangeStreamEvent<Document>>,
    /// Where the stream was last saved, and when: a quiet stream's position still moves
    /// (the server's empty batches carry it), and is saved every [`SAVE_QUIET_EVERY`], so
    /// that a restart never resumes from further back than the oplog keeps.
    saved: Option<(ResumeToken, std::time::Instant)>,
    /// The newest event recorded whose cluster time may still have events to come in
    /// the stream (the batch was cut, not drained): published as `recordedThrough` once
    /// the stream has run dry or moved past its time.
    unpublished: Option<String>,
}

/// How often a stream that reported no change saves its moving position.
const SAVE_QUIET_EVERY: Duration = Duration::from_secs(10);

/// MongoDB's ChangeStreamHistoryLost: the stream's resume point is older than the oplog.
const HISTORY_LOST: i32 = 286;

/// What the recorder's document says of the feed.
#[derive(Debug, Clone, Default)]
pub struct FeedState {
    /// The position of the last event removed after the retention, if any was.
    pub trimmed_through: Option<Position>,
    /// The key of the newest event a recorder has seen visible with every event before
    /// it: where a read of the feed may go up to, as nothing will appear below it.
    pub recorded_through: Option<String>,
}

/// A page of one deployment's feed.
#[derive(Debug)]
pub struct FeedPage {
    /// The events after the position asked, in feed order.
    pub events: Vec<Event>,
    /// The position of the last event removed after the retention, read after the events:
    /// a reader below it may have missed an event.
    pub trimmed_through: Option<Position>,
    /// The last event the read looked at, of any type: every event of the types asked
    /// up to it is in `events`. With a type filter and fewer matches than the limit, a
    /// reader may move there (events appear in feed order, so none will appear below it).
    pub examined: Option<Position>,
}

/// Cluster time as one number (seconds, then increment): what the feed's windows are
/// measured in.
type Tick = u64;

fn tick(seconds: u32, increment: u32) -> Tick {
    (u64::from(seconds) << 32) | u64::from(increment)
}

/// The start of [`key`]s at `t`: every event at `t` or later sorts after it (an id is
/// never empty), every event before `t` below it.
fn tick_key(t: Tick) -> String {
    format!("{:010}{:010}", t >> 32, t & 0xffff_ffff)
}

/// The first window of a read of the feed: a second of cluster time. A window holding
/// the most a read may return halves the next; an empty one makes the next four times
/// as long, so a reader far behind a sparse feed gets there in few reads.
const FIRST_WINDOW: Tick = 1 << 32;
/// The most events of any type a window of a type-filtered read gives.
const FILTERED_WINDOW: usize = 500;

impl Store {
    fn events(&self) -> Collection<EventDoc> {
        self.db.collection(EVENTS)
    }

    fn recorder(&self) -> Collection<Document> {
        self.db.collection(RECORDER)
    }

    /// Makes the recorder's document if there is none, with `startAt` the database's
    /// cluster time now: the first recorder records every change from here on. Called at
    /// start-up, after the migrations and before the instance serves, so that no change
    /// this version makes precedes the feed's start. Nothing may be read yet
    /// (`recordedThrough` below every event) until the first recorder says how far.
    pub async fn prepare_feed(&self) -> StoreResult<()> {
        let now = self.cluster_time().await?;
        let mut start = doc! { "recordedThrough": tick_key(0) };
        match now {
            Some(now) => {
                start.insert("startAt", now);
            }
            None => {
                tracing::warn!(deployment = %self.deployment, "the database gave no cluster time; the feed starts when its first recorder does")
            }
        }
        self.recorder()
            .update_one(doc! { "_id": RECORDER_ID }, doc! { "$setOnInsert": start })
            .upsert(true)
            .await?;
        Ok(())
    }

    /// The deployment's cluster time now, if it gives one (a replica set or a sharded
    /// cluster does): every change made so far is at or before it.
    pub async fn cluster_time(&self) -> StoreResult<Option<bson::Timestamp>> {
        let reply = self.db.run_command(doc! { "ping": 1 }).await?;
        Ok(reply.get_timestamp("operationTime").ok().or_else(|| {
            reply
                .get_document("$clusterTime")
                .ok()
                .and_then(|c| c.get_timestamp("clusterTime").ok())
        }))
    }

    /// Takes or renews the lease of this deployment's recorder for `owner`, for `lease` by
    /// the database's clock, if it is `owner`'s or has run out. Whether `owner` holds it.
    pub async fn claim_recorder(&self, owner: &str, lease: Duration) -> StoreResult<bool> {
        // Both ends by the database's clock, read just before: a lease that ran out by
        // it is free, and the new one runs from a time that clock has surely reached.
        let now = self.server_time().await?;
        let until = self.server_time_lower_bound().await?
            + chrono::TimeDelta::from_std(lease).unwrap_or(chrono::TimeDelta::MAX);
        let filter = doc! { "_id": RECORDER_ID, "$or": [
            { "owner": owner },
            { "leaseUntil": { "$lt": stored_time(now) } },
            { "leaseUntil": { "$exists": false } },
        ] };
        let claim = doc! { "$set": { "owner": owner, "leaseUntil": stored_time(until) } };
        let result = self.recorder().update_one(filter, claim).await?;
        Ok(result.matched_count == 1)
    }

    /// Gives up `owner`'s lease, so that another instance records at once (at shutdown).
    pub async fn release_recorder(&self, owner: &str) -> StoreResult<()> {
        self.recorder()
            .update_one(
                doc! { "_id": RECORDER_ID, "owner": owner },
                doc! { "$unset": { "leaseUntil": "" } },
            )
            .await?;
        Ok(())
    }

    /// Opens the change stream where the last recorder left it. If the oplog no longer
    /// reaches back there (the recorders were stopped for longer than it keeps), the
    /// events in between cannot be recorded any more: says so loudly, and starts again
    /// from now rather than never again.
    pub async fn open_changes(&self) -> StoreResult<Changes> {
        self.bound_the_feed().await?;
        match self.watch_from_saved().await {
            Err(StoreError::Other(cause)) if history_lost(&cause) => {
                tracing::error!(deployment = %self.deployment, "the change stream cannot resume where the last recorder left it (the oplog no longer reaches back there): the events of the changes made since then are lost; recording from now on");
                self.recorder()
                    .update_one(
                        doc! { "_id": RECORDER_ID },
                        doc! { "$unset": { "resumeToken": "", "startAt": "" } },
                    )
                    .await?;
                self.watch_from_saved().await
            }
            opened => opened,
        }
    }

    /// A feed an older version recorded has no `recordedThrough`, and is read up to its
    /// newest event: before this recorder inserts any, the bound is set there, so that
    /// no read passes an event it inserts before it says how far the feed may be read.
    async fn bound_the_feed(&self) -> StoreResult<()> {
        if self.feed_state().await?.recorded_through.is_some() {
            return Ok(());
        }
        let newest = self.newest_event_after(&Position::start()).await?;
        let through = newest.map_or_else(|| tick_key(0), |p| key(&p));
        self.recorder()
            .update_one(
                doc! { "_id": RECORDER_ID, "recordedThrough": { "$exists": false } },
                doc! { "$set": { "recordedThrough": through } },
            )
            .await?;
        Ok(())
    }

    async fn watch_from_saved(&self) -> StoreResult<Changes> {
        let state = self
            .recorder()
            .find_one(doc! { "_id": RECORDER_ID })
            .await?
            .unwrap_or_default();
        let watch = self
            .db
            .watch()
            .pipeline([changes_that_are_events()])
            .full_document(FullDocumentType::UpdateLookup)
            .max_await_time(MAX_AWAIT);
        let stream = match (state.get("resumeToken"), state.get_timestamp("startAt")) {
            (Some(token), _) => {
                let token: ResumeToken = bson::from_bson(token.clone()).map_err(|e| {
                    StoreError::Other(format!("the saved resume token is unreadable: {e}").into())
                })?;
                watch.start_after(token).await?
            }
            (None, Ok(start)) => watch.start_at_operation_time(start).await?,
            (None, Err(_)) => watch.await?,
        };
        Ok(Changes {
            stream,
            saved: None,
            unpublished: None,
        })
    }

    /// Records the events of the changes the stream has now, at most [`MAX_RECORDED`]
    /// (waiting up to the stream's await time for a first one), then saves where the
    /// stream is, as `owner`. The events recorded by this call.
    pub async fn record_events(&self, changes: &mut Changes, owner: &str) -> StoreResult<usize> {
        let mut found = Vec::new();
        let mut changed = false;
        // Under steady load the server's batches never come back empty: the changes of
        // [`GATHER_FOR`] are recorded together, so that an event waits that long at most.
        let mut gathering: Option<std::time::Instant> = None;
        let mut drained = false;
        while found.len() < MAX_RECORDED && gathering.is_none_or(|g| g.elapsed() < GATHER_FOR) {
            let Some(change) = changes.stream.next_if_any().await? else {
                drained = true;
                break;
            };
            gathering.get_or_insert_with(std::time::Instant::now);
            changed = true;
            match self.event_of(&change) {
                Ok(Some(event)) => found.push(event),
                Ok(None) => {}
                Err(why) => {
                    tracing::error!(deployment = %self.deployment, error = %why, "a change that should be an event cannot be read; no event recorded for it");
                }
            }
        }
        let recorded = self.insert_in_order(&found).await?;
        let through = Self::publishable(&mut changes.unpublished, &found, drained);
        let token = changes.stream.resume_token();
        let due = token.as_ref().is_some_and(|token| match &changes.saved {
            None => true,
            Some((saved, at)) => *saved != *token && (changed || at.elapsed() >= SAVE_QUIET_EVERY),
        });
        let mut update = doc! {};
        if let (true, Some(token)) = (due, &token) {
            let stored = bson::to_bson(token).map_err(|e| {
                StoreError::Other(format!("a resume token cannot be stored: {e}").into())
            })?;
            update.insert("$set", doc! { "resumeToken": stored });
        }
        if let Some(through) = &through {
            update.insert("$max", doc! { "recordedThrough": through });
        }
        if !update.is_empty() {
            self.recorder()
                .update_one(doc! { "_id": RECORDER_ID, "owner": owner }, update)
                .await?;
            if let (true, Some(token)) = (due, token) {
                changes.saved = Some((token, std::time::Instant::now()));
            }
        }
        Ok(recorded)
    }

    /// How far readers may read once `found` is recorded (`recordedThrough`): every event
    /// of the batch is visible then, and every one before it. But several changes may
    /// share one cluster time (a transaction's; two shards' in a sharded cluster), and
    /// their events sort by id within it, not in the stream's order: while the batch was
    /// cut (not `drained`) more of its last time may still come, so the bound stops
    /// before that time, and reaches the last event once the stream has run dry or moved
    /// past it.
    fn publishable(
        unpublished: &mut Option<String>,
        found: &[EventDoc],
        drained: bool,
    ) -> Option<String> {
        let newest = found
            .iter()
            .map(|e| e.key.clone())
            .max()
            .or(unpublished.take())?;
        if drained {
            return Some(newest);
        }
        let last = position(&newest)?;
        *unpublished = Some(newest);
        Some(tick_key(tick(last.seconds, last.increment)))
    }

    /// Inserts `events` in their order, leaving out those already recorded. The number
    /// inserted.
    async fn insert_in_order(&self, events: &[EventDoc]) -> StoreResult<usize> {
        let mut inserted = 0;
        let mut rest: Vec<&EventDoc> = events.iter().collect();
        // Each round inserts up to the first event another recorder inserted meanwhile;
        // the rounds are bounded by the events.
        while !rest.is_empty() {
            let ids: Vec<&str> = rest.iter().map(|e| e.id.as_str()).collect();
            let there: Vec<String> = self
                .events()
                .clone_with_type::<Document>()
                .find(doc! { "_id": { "$in": ids } })
                .projection(doc! { "_id": 1 })
                .await?
                .try_collect::<Vec<_>>()
                .await?
                .into_iter()
                .filter_map(|d| d.get_str("_id").ok().map(str::to_owned))
                .collect();
            rest.retain(|e| !there.contains(&e.id));
            if rest.is_empty() {
                break;
            }
            match self.events().insert_many(rest.iter().copied()).await {
                Ok(_) => {
                    inserted += rest.len();
                    count(rest.iter().copied());
                    break;
                }
                Err(e) => match e.kind.as_ref() {
                    ErrorKind::InsertMany(f)
                        if f.write_concern_error.is_none()
                            && f.write_errors.as_ref().is_some_and(|w| !w.is_empty())
                            && f.write_errors.iter().flatten().all(|w| w.code == 11000) =>
                    {
                        // Ordered: everything before the refused one is in.
                        let first = f
                            .write_errors
                            .iter()
                            .flatten()
                            .map(|w| w.index)
                            .min()
                            .unwrap_or(0);
                        inserted += first;
                        count(rest[..first].iter().copied());
                        rest.drain(..=first.min(rest.len() - 1));
                    }
                    _ => return Err(StoreError::from(e)),
                },
            }
        }
        Ok(inserted)
    }

    /// The event `change` reports, if it reports one.
    fn event_of(&self, change: &ChangeStreamEvent<Document>) -> Result<Option<EventDoc>, String> {
        let collection = change.ns.as_ref().and_then(|n| n.coll.as_deref());
        let Some(time) = change.cluster_time else {
            return Err("a change without a cluster time".into());
        };
        let full = change.full_document.as_ref();
        match (collection, &change.operation_type) {
            (Some("accounts"), OperationType::Insert) => {
                let full = full.ok_or("an account's insert without its document")?;
                let account: AccountDoc =
                    bson::from_document(full.clone()).map_err(|e| e.to_string())?;
                let account = AccountDoc {
                    recent_entries: Vec::new(),
                    last_entry_at: None,
                    pending_transactions: Vec::new(),
                    fenced_transactions: Vec::new(),
                    ..account
                };
                let id = event_id(EventType::AccountOpened, &account.id);
                let at = change.wall_time.unwrap_or(account.created_at);
                Ok(Some(stored(
                    id,
                    EventType::AccountOpened,
                    at,
                    time,
                    None,
                    Some(account),
                )))
            }
            (
                Some("transactions"),
                OperationType::Insert | OperationType::Update | OperationType::Replace,
            ) => {
                let updated = change
                    .update_description
                    .as_ref()
                    .map(|u| &u.updated_fields);
                let state = match (&change.operation_type, updated) {
                    (OperationType::Update, Some(fields)) => fields.get("state"),
                    _ => full.and_then(|d| d.get("state")),
                };
                let Some(state) = state.cloned() else {
                    return Ok(None);
                };
                let state: TransferState = bson::from_bson(state).map_err(|e| e.to_string())?;
                let Some(kind) = EventType::of_state(state) else {
                    return Ok(None);
                };
                let full = full.ok_or("a transfer's change without its document")?;
                let transfer: TransferDoc =
                    bson::from_document(full.clone()).map_err(|e| e.to_string())?;
                let transfer = transfer
                    .into_domain(&self.deployment)
                    .map_err(|e| crate::error_chain::Chain(&e).to_string())?;
                let stamp = updated
                    .and_then(|f| f.get_datetime("lastModified").ok())
                    .map(|t| t.to_chrono());
                let transfer = transfer.as_it_reached(state, stamp);
                let id = event_id(kind, &transfer.id.to_string());
                let at = change
                    .wall_time
                    .unwrap_or_else(|| stored_time(transfer.last_modified));
                let data = TransferDoc::from(&transfer);
                Ok(Some(stored(id, kind, at, time, Some(data), None)))
            }
            _ => Ok(None),
        }
    }

    /// Removes, as `owner`, the events at the front of the feed older than `retention`
    /// by the database's clock (at most [`MAX_TRIMMED`] a call): `trimmedThrough` is
    /// raised first, so that a reader below it learns it may have missed one. The number
    /// removed.
    pub async fn trim_events(&self, owner: &str, retention: Duration) -> StoreResult<u64> {
        let retention = chrono::TimeDelta::from_std(retention).unwrap_or(chrono::TimeDelta::MAX);
        let cutoff = self
            .server_time()
            .await?
            .checked_sub_signed(retention)
            .unwrap_or(Timestamp::MIN_UTC);
        // The front, from the last removal, up to the second after the cut-off (a
        // change's cluster time and its wall time are the same clock's).
        let state = self.feed_state().await?;
        let from = state.trimmed_through.unwrap_or_else(Position::start);
        let cut = tick_key(tick(
            u32::try_from(cutoff.timestamp() + 1).unwrap_or(u32::MAX),
            0,
        ));
        let Some(recorded) = self.read_bound(&from, state.recorded_through).await? else {
            return Ok(0);
        };
        let up_to = recorded.min(cut);
        let (front, _) = self
            .windows(&from, &up_to, MAX_TRIMMED as usize, &[], None)
            .await?;
        let old = front
            .iter()
            .take_while(|d| d.at.to_chrono() < cutoff)
            .map(|d| d.key.as_str())
            .last();
        let Some(through) = old else {
            return Ok(0);
        };
        let raised = self
            .recorder()
            .update_one(
                doc! { "_id": RECORDER_ID, "owner": owner },
                doc! { "$max": { "trimmedThrough": through } },
            )
            .await?;
        if raised.matched_count == 0 {
            return Ok(0);
        }
        let deleted = self
            .events()
            .delete_many(doc! { "key": { "$lte": through } })
            .await?;
        Ok(deleted.deleted_count)
    }

    /// The position of this deployment's newest event after `after`, if there is one:
    /// what the followers' signal watches. A range from `after` rather than a sort of the
    /// whole feed:
    /// SecantusDB materialises every match of a sorted find before its limit (37 ms for
    /// the newest of 40,000 events, 0.4 ms for a range of a few near the end).
    pub async fn newest_event_after(&self, after: &Position) -> StoreResult<Option<Position>> {
        let newest = self
            .events()
            .clone_with_type::<Document>()
            .find_one(doc! { "key": { "$gt": key(after) } })
            .sort(doc! { "key": -1 })
            .projection(doc! { "key": 1 })
            .max_time(super::READ_TIME_LIMIT)
            .await?;
        Ok(newest.and_then(|d| d.get_str("key").ok().and_then(position)))
    }

    /// How far the feed was trimmed, and how far it may be read, in one read.
    pub async fn feed_state(&self) -> StoreResult<FeedState> {
        let state = self
            .recorder()
            .find_one(doc! { "_id": RECORDER_ID })
            .projection(doc! { "trimmedThrough": 1, "recordedThrough": 1 })
            .await?
            .unwrap_or_default();
        Ok(FeedState {
            trimmed_through: state.get_str("trimmedThrough").ok().and_then(position),
            recorded_through: state.get_str("recordedThrough").ok().map(str::to_owned),
        })
    }

    /// The position of the last event removed after the retention, if any was.
    pub async fn trimmed_through(&self) -> StoreResult<Option<Position>> {
        Ok(self.feed_state().await?.trimmed_through)
    }

    /// Up to `limit` events after `after` (from the front when `None`), of `types` (all
    /// when empty), `tenant`'s only when given, in feed order, no further than
    /// `recorded` (the [`FeedState::recorded_through`] read before); and how far the feed
    /// was trimmed once they were read.
    pub async fn read_feed(
        &self,
        after: Option<&Position>,
        limit: u32,
        types: &[EventType],
        tenant: Option<&TenantName>,
        recorded: Option<String>,
    ) -> StoreResult<FeedPage> {
        let start = Position::start();
        let after = after.unwrap_or(&start);
        let end = self.read_bound(after, recorded).await?;
        let (found, examined) = match end {
            Some(end) => {
                self.windows(after, &end, limit as usize, types, tenant)
                    .await?
            }
            None => (Vec::new(), None),
        };
        let events = found
            .into_iter()
            .map(|d| self.event_from(d))
            .collect::<StoreResult<Vec<_>>>()?;
        let trimmed_through = self.trimmed_through().await?;
        Ok(FeedPage {
            events,
            trimmed_through,
            examined: examined.as_deref().and_then(position),
        })
    }

    /// How far a read after `after` may go: the newest event known visible with every
    /// event before it, read before the events (a read must never pass a place where an
    /// event may still appear: one recorded late, below a later one, would be skipped).
    /// `recorded` (`recordedThrough`), or, where no recorder has kept it yet, the newest
    /// event itself.
    async fn read_bound(
        &self,
        after: &Position,
        recorded: Option<String>,
    ) -> StoreResult<Option<String>> {
        match recorded {
            Some(through) => Ok(Some(through)),
            None => Ok(self.newest_event_after(after).await?.map(|p| key(&p))),
        }
    }

    /// The first `limit` events after `after` and up to key `end_key`, of `types`
    /// (all when empty), in feed order, and the key of the last event looked at.
    ///
    /// Read in windows of cluster time rather than in one sorted find: SecantusDB reads
    /// every match of a find before it applies the limit (9 ms for 100 events 5,000
    /// behind the end of a feed of 40,000, against 0.8 ms for a window of a few hundred),
    /// so a reader far behind would pay for the whole rest of the feed at every page.
    /// A type filter is applied here, not in the find, so that the read knows the last
    /// event it passed whatever its type.
    async fn windows(
        &self,
        after: &Position,
        end_key: &str,
        limit: usize,
        types: &[EventType],
        tenant: Option<&TenantName>,
    ) -> StoreResult<(Vec<EventDoc>, Option<String>)> {
        let Some(last) = position(end_key) else {
            return Ok((Vec::new(), None));
        };
        let end = tick(last.seconds, last.increment).saturating_add(1);
        let wanted: Vec<&str> = types.iter().map(|t| t.as_str()).collect();
        let mut found = Vec::new();
        let mut examined: Option<String> = None;
        let mut below = key(after);
        let mut from = tick(after.seconds, after.increment);
        let mut span = FIRST_WINDOW;
        while from < end && found.len() < limit {
            let until = from.saturating_add(span).min(end);
            // A window gives at most what is still wanted; a filtered read's, a page of
            // events of any type (few matches among many must not take a read each).
            let room = if wanted.is_empty() {
                limit - found.len()
            } else {
                limit.max(FILTERED_WINDOW)
            };
            let within = doc! { "$gt": &below, "$lt": tick_key(until), "$lte": end_key };
            let mut filter = doc! { "key": within };
            if let Some(tenant) = tenant {
                filter.insert("tenants", tenant.as_str());
            }
            let window: Vec<EventDoc> = self
                .events()
                .find(filter)
                .sort(doc! { "key": 1 })
                .limit(room as i64)
                .max_time(super::READ_TIME_LIMIT)
                .await?
                .try_collect()
                .await?;
            let full = window.len() >= room;
            let seen = window.len();
            for d in window {
                examined = Some(d.key.clone());
                if wanted.is_empty() || wanted.contains(&d.kind.as_str()) {
                    found.push(d);
                    if found.len() == limit {
                        break;
                    }
                }
            }
            if full {
                // More in this window: go on from the last one looked at, in a shorter one.
                let last = examined.as_deref().and_then(position);
                if let Some(last) = last {
                    below = key(&last);
                    from = tick(last.seconds, last.increment);
                }
                span = (span / 2).max(1);
            } else {
                below = tick_key(until);
                from = until;
                if seen == 0 {
                    span = span.saturating_mul(4);
                }
            }
        }
        Ok((found, examined))
    }

    fn event_from(&self, d: EventDoc) -> StoreResult<Event> {
        let bad = |why: String| StoreError::Other(format!("event {}: {why}", d.id).into());
        let kind = EventType::parse(&d.kind).map_err(|e| bad(e.0))?;
        let position = position(&d.key).ok_or_else(|| bad("its key is unreadable".into()))?;
        let data = match (d.transfer.clone(), d.account.clone()) {
            (Some(t), None) => EventData::Transfer(t.into_domain(&self.deployment)?),
            (None, Some(a)) => EventData::Account(a.into_domain(&self.deployment)?),
            _ => return Err(bad("it has no transfer or account".into())),
        };
        Ok(Event {
            id: d.id,
            kind,
            at: d.at.to_chrono(),
            data,
            deployment: self.deployment.clone(),
            position,
        })
    }
}

/// Whether `cause` is the server saying the stream's history is gone.
fn history_lost(cause: &super::Cause) -> bool {
    match cause {
        super::Cause::Driver(e) => {
            matches!(e.kind.as_ref(), ErrorKind::Command(c) if c.code == HISTORY_LOST)
        }
        super::Cause::Found(_) => false,
    }
}

/// The stored event.
fn stored(
    id: String,
    kind: EventType,
    at: DateTime,
    time: bson::Timestamp,
    transfer: Option<TransferDoc>,
    account: Option<AccountDoc>,
) -> EventDoc {
    let position = Position {
        seconds: time.time,
        increment: time.increment,
        id: id.clone(),
    };
    let tenants = match (&transfer, &account) {
        (Some(t), _) => t.tenants.clone(),
        (None, Some(a)) => a.tenant.iter().cloned().collect(),
        (None, None) => Vec::new(),
    };
    EventDoc {
        key: key(&position),
        id,
        kind: kind.as_str().to_owned(),
        at,
        transfer,
        account,
        tenants,
    }
}

/// Counts the events inserted.
fn count<'a>(events: impl Iterator<Item = &'a EventDoc>) {
    for e in events {
        if let Ok(kind) = EventType::parse(&e.kind) {
            crate::metrics::event_recorded(kind);
        }
    }
}

/// The change stream's filter: the changes that may be events, so that the others never
/// leave the server. An update is one only if it sets `state` to a state with an event;
/// an insert or a replace of a transfer, if its document is in such a state (a
/// transfer made in one transaction is inserted `done` or `canceled`; SecantusDB reports
/// an update pipeline as a replace).
fn changes_that_are_events() -> Document {
    let states: Vec<Bson> = [
        TransferState::Held,
        TransferState::Done,
        TransferState::Canceled,
    ]
    .iter()
    .map(|s| Bson::from(s.as_str()))
    .collect();
    doc! { "$match": { "$or": [
        { "ns.coll": "accounts", "operationType": "insert" },
        {
            "ns.coll": "transactions",
            "operationType": "update",
            "updateDescription.updatedFields.state": { "$in": states.clone() },
        },
        {
            "ns.coll": "transactions",
            "operationType": { "$in": ["insert", "replace"] },
            "fullDocument.state": { "$in": states },
        },
    ] } }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event_at(seconds: u32, increment: u32, id: &str) -> EventDoc {
        stored(
            id.to_owned(),
            EventType::AccountOpened,
            DateTime::now(),
            bson::Timestamp {
                time: seconds,
                increment,
            },
            None,
            None,
        )
    }

    /// Events sharing a cluster time sort by id, not in the stream's order: a batch cut
    /// inside a time publishes only up to before it, and the rest once the stream ran dry
    /// (a drained batch, or a later empty one).
    #[test]
    fn recorded_through_stops_before_a_time_whose_events_may_still_come() {
        let mut unpublished = None;
        let cut = [event_at(7, 1, "a:x"), event_at(8, 2, "a:z")];
        let bound = Store::publishable(&mut unpublished, &cut, false).unwrap();
        assert_eq!(bound, tick_key(tick(8, 2)));
        // An event of the same time with a smaller id, recorded next, is above the bound.
        assert!(key(&position(&event_at(8, 2, "a:b").key).unwrap()) > bound);
        assert!(bound > cut[0].key);
        // The stream ran dry: everything recorded is published.
        let bound = Store::publishable(&mut unpublished, &[], true).unwrap();
        assert_eq!(bound, cut[1].key);
        assert_eq!(Store::publishable(&mut unpublished, &[], true), None);
        let drained = [event_at(9, 1, "a:c")];
        let bound = Store::publishable(&mut unpublished, &drained, true).unwrap();
        assert_eq!(bound, drained[0].key);
    }

    #[test]
    fn a_key_reads_back_and_sorts_as_its_position() {
        let a = Position {
            seconds: 9,
            increment: 100,
            id: "transfer.done:6b0619d67d0e8af2ac0b1adf".into(),
        };
        let b = Position {
            seconds: 10,
            increment: 1,
            id: "account.opened:a".into(),
        };
        assert_eq!(position(&key(&a)), Some(a.clone()));
        assert_eq!(a < b, key(&a) < key(&b));
        assert!(key(&a) < key(&b));
        assert_eq!(position("12"), None);
        assert_eq!(position("abcdefghij0000000001x"), None);
    }
}
