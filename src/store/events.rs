//! Events (`docs/events.md`): marked due in the documents they report, given their
//! places in `events` by the recorder (`marks`), kept for the retention, and read as the
//! deployment's feed.
//!
//! Recording:
//! - The write that makes a transfer `held`, `done` or `canceled`, or opens an account,
//!   marks the event due in that document (`eventsDue`, `guards::moved`). One instance at
//!   a time, under a lease in `eventRecorder` judged by the database's clock, gives due
//!   events their places in rounds, each guarded by the lease, so that a recorder that
//!   stops mid-round is finished by the next at the same places (`marks` says how).
//! - An event's [`Position`] is its tick in the feed, then its id ([`key`]); the second
//!   copy of an event is refused by `_id`.
//! - A reader reads only up to `recordedThrough`, raised once a round's events are all
//!   in: a reader that has read up to a position never sees an event appear below it.
//! - A feed an older version recorded from the change stream is read from that stream to
//!   its end, a probe this version writes ([`Events::probe_stream`],
//!   [`Events::record_events`]): there an event's position is its change's cluster time,
//!   the stream's resume point (`resumeToken`) is saved after the events before it are
//!   recorded, and a change's events are inserted in stream order.
//!
//! Keeping: events older than the retention are removed from the front of the feed
//! ([`Events::trim_events`]), whole cluster times at a time. `trimmedThrough` is raised
//! before they are deleted; a reader whose position is below it may have missed an
//! event, and is told so. It is the last event removed, anyone's, so a reader without a
//! position is not handed it: it starts at a position that names no event, after the
//! front's whole cluster time ([`Events::reader_start`]).
//!
//! Gaps: events that cannot be recorded (a due event cannot be made: `marks`; the stream
//! cannot resume where it was saved: [`Events::open_changes`]; a change cannot be made an
//! event: [`Events::record_events`]) are never skipped silently. `trimmedThrough` is
//! raised past them, in the guarded write that finishes the round or moves the stream
//! past them, so that every cursor from before the gap is refused
//! as one from before a removal is; the events left below it are removed by the next
//! trims. An error log says what was lost and `event_feed_gaps_total` counts it.
//!
//! All of it is the [`Events`] view (`store.events()`), which holds the database (the
//! feed's collections, the documents that mark events, and the change stream), its clock
//! and the deployment's name.

use std::time::Duration;

use futures::TryStreamExt;
use mongodb::bson::{self, Bson, DateTime, Document, doc};
use mongodb::change_stream::ChangeStream;
use mongodb::change_stream::event::{ChangeStreamEvent, OperationType, ResumeToken};
use mongodb::error::ErrorKind;
use mongodb::options::FullDocumentType;
use mongodb::{Collection, Database};
use serde::{Deserialize, Serialize};

use super::clock::Clock;
use super::documents::{AccountDoc, Stored, TransferDoc, stored_time};
use super::fields::{event, recorder, transfer};

mod marks;
use super::{StoreError, StoreResult};
use crate::domain::{
    DeploymentName, Event, EventData, EventType, Position, TenantName, Timestamp, TransferState,
    event_id,
};
pub use marks::{Due, Rounds};

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
/// The most events removed in one round of [`Events::trim_events`]: a round is one
/// `deleteMany`, which holds SecantusDB's write lock for its whole length (about 25 ms
/// for this many), so the rounds stay short and the recorder runs them back to back
/// while there is more to remove.
pub const MAX_TRIMMED: u64 = 1000;

/// A stored event (its fields: `fields::event`).
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

/// What [`Events::gather`] read of the stream.
struct Gathered {
    found: Vec<EventDoc>,
    lost: Vec<Unreadable>,
    /// Whether the stream gave any change.
    changed: bool,
    /// Whether it ran dry, or gave the probe.
    drained: bool,
    /// Whether it gave the probe it is read up to (see [`Events::probe_stream`]).
    reached: bool,
}

/// A change that should be an event and cannot be made one.
struct Unreadable {
    /// Its cluster time, if it has one.
    time: Option<bson::Timestamp>,
    /// What it changed: its operation, collection and document key.
    what: String,
    /// Why it cannot be made an event.
    why: String,
}

impl Unreadable {
    fn of(change: &ChangeStreamEvent<Document>, why: String) -> Unreadable {
        let collection = change.ns.as_ref().and_then(|n| n.coll.as_deref());
        Unreadable {
            time: change.cluster_time,
            what: format!(
                "{:?} of {} {}",
                change.operation_type,
                collection.unwrap_or("?"),
                change
                    .document_key
                    .as_ref()
                    .map_or_else(|| "?".to_owned(), |k| k.to_string())
            ),
            why,
        }
    }
}

/// What [`Events::watch_from_saved`] found.
enum Opened {
    /// Boxed: a change stream is large (some 1.8 KB), the other variant small.
    Changes(Box<Changes>),
    /// The stream cannot resume where it was saved, and why: its events since are lost.
    CannotResume(String),
}

/// How often a stream that reported no change saves its moving position.
const SAVE_QUIET_EVERY: Duration = Duration::from_secs(10);

/// The server's answers to a resume point it cannot resume from, whatever is tried
/// again: FailedToParse (9, a resume token that is not hex), InvalidResumeToken (260),
/// ChangeStreamFatalError (280, the token's event is not in the oplog),
/// ChangeStreamHistoryLost (286, the resume point is older than the oplog) and 40647 (a
/// resume token without its `_data`). The pipeline and options sent with it are
/// constants of this code: only the resume point differs from one opening to the next.
const CANNOT_RESUME: [i32; 5] = [9, 260, 280, 286, 40647];

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

/// The cluster time of a [`key`] (0 for what is no key: below every event's).
fn key_tick(raw: &str) -> Tick {
    position(raw).map_or(0, |p| tick(p.seconds, p.increment))
}

/// The position at the start of `t`: before every event at `t`, after every event
/// before it; it names no event.
fn tick_start(t: Tick) -> Position {
    Position {
        seconds: u32::try_from(t >> 32).unwrap_or(u32::MAX),
        increment: u32::try_from(t & 0xffff_ffff).unwrap_or(u32::MAX),
        id: String::new(),
    }
}

/// Where a reader without a position starts ([`Events::reader_start`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Start {
    /// A position that names no event: the start of the feed, or of a cluster time.
    Clear(Position),
    /// The front itself, an event's position: events of its cluster time that the
    /// reader sees are still kept after it (a front an older version left inside a
    /// cluster time). Read from there; the position is another's event, as often as not.
    AtFront(Position),
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

/// The event feed (from [`super::Store::events`]): `events` and the recorder's document,
/// `eventRecorder`, both named from the database it holds; the change stream the
/// recorder reads is the database's.
#[derive(Clone, Copy, Debug)]
pub struct Events<'s> {
    /// The feed's collections, its change stream and its cluster time.
    pub(super) db: &'s Database,
    /// The recorder's lease, by the database's clock.
    pub(super) clock: Clock<'s>,
    /// Named in the feed's warnings and its events.
    pub(super) deployment: &'s DeploymentName,
}

impl<'s> Events<'s> {
    /// The recorder's rounds over the events marked due (`marks`).
    pub fn rounds(self) -> Rounds<'s> {
        Rounds { events: self }
    }

    fn events(self) -> Collection<EventDoc> {
        self.db.collection(EVENTS)
    }

    fn recorder(self) -> Collection<Document> {
        self.db.collection(RECORDER)
    }

    /// Makes the recorder's document if there is none, with `recordedThrough` below every
    /// event (nothing is read until the first round says how far) and `streamDone`: this
    /// version's writes mark their events in their documents (`marks`), so a new feed has
    /// no change stream to read. A feed an older version recorded from the change stream
    /// has no `streamDone`, and its stream is read to its end first
    /// ([`Events::probe_stream`]). Called at start-up, after the migrations and before
    /// the instance serves.
    pub async fn prepare_feed(self) -> StoreResult<()> {
        let start = doc! { recorder::RECORDED_THROUGH: tick_key(0), recorder::STREAM_DONE: true };
        self.recorder()
            .update_one(doc! { "_id": RECORDER_ID }, doc! { "$setOnInsert": start })
            .upsert(true)
            .await?;
        Ok(())
    }

    /// Whether the change stream of a feed an older version recorded is still to be
    /// read (to what it holds of that version's changes).
    pub async fn stream_left(self) -> StoreResult<bool> {
        let state = self
            .recorder()
            .find_one(doc! { "_id": RECORDER_ID })
            .projection(doc! { recorder::STREAM_DONE: 1 })
            .await?
            .unwrap_or_default();
        Ok(!state.get_bool(recorder::STREAM_DONE).unwrap_or(false))
    }

    /// Writes, as `owner`, a probe into the recorder's document, once the change stream
    /// of an older version's feed is open: every change the older version made precedes
    /// it (its instances were stopped before this version's started), so once the stream
    /// gives the probe, it has given every one of them. `None` when `owner` no longer
    /// holds the lease.
    pub async fn probe_stream(self, owner: &str) -> StoreResult<Option<bson::oid::ObjectId>> {
        let probe = bson::oid::ObjectId::new();
        let set = doc! { "$set": { recorder::STREAM_PROBE: probe } };
        Ok(self.as_owner(owner, doc! {}, set).await?.then_some(probe))
    }

    /// Says, as `owner`, that the change stream has given its probe: from now on every
    /// event is recorded from the marks. Whether `owner` still holds the lease.
    pub async fn stream_read(self, owner: &str) -> StoreResult<bool> {
        let set = doc! { "$set": { recorder::STREAM_DONE: true } };
        self.as_owner(owner, doc! {}, set).await
    }

    /// Applies `update` to the recorder's document if `owner` holds the lease and the
    /// document matches `also` too. Whether it did.
    async fn as_owner(self, owner: &str, also: Document, update: Document) -> StoreResult<bool> {
        let mut filter = doc! { "_id": RECORDER_ID, recorder::OWNER: owner };
        filter.extend(also);
        let written = self.recorder().update_one(filter, update).await?;
        Ok(written.matched_count == 1)
    }

    /// The deployment's cluster time now, if it gives one (a replica set or a sharded
    /// cluster does): every change made so far is at or before it.
    pub async fn cluster_time(self) -> StoreResult<Option<bson::Timestamp>> {
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
    pub async fn claim_recorder(self, owner: &str, lease: Duration) -> StoreResult<bool> {
        // Both ends by the database's clock, read just before: a lease that ran out by
        // it is free, and the new one runs from a time that clock has surely reached.
        let now = self.clock.server_time().await?;
        let until = self.clock.server_time_lower_bound().await?
            + chrono::TimeDelta::from_std(lease).unwrap_or(chrono::TimeDelta::MAX);
        let filter = doc! { "_id": RECORDER_ID, "$or": [
            { recorder::OWNER: owner },
            { recorder::LEASE_UNTIL: { "$lt": stored_time(now) } },
            { recorder::LEASE_UNTIL: { "$exists": false } },
        ] };
        let claim =
            doc! { "$set": { recorder::OWNER: owner, recorder::LEASE_UNTIL: stored_time(until) } };
        let result = self.recorder().update_one(filter, claim).await?;
        Ok(result.matched_count == 1)
    }

    /// Gives up `owner`'s lease, so that another instance records at once (at shutdown).
    pub async fn release_recorder(self, owner: &str) -> StoreResult<()> {
        self.recorder()
            .update_one(
                doc! { "_id": RECORDER_ID, recorder::OWNER: owner },
                doc! { "$unset": { recorder::LEASE_UNTIL: "" } },
            )
            .await?;
        Ok(())
    }

    /// Opens the change stream where the last recorder left it, as `owner`; `None` when
    /// `owner` no longer holds the lease.
    ///
    /// If it cannot resume there (the oplog no longer reaches back there: the recorders
    /// were stopped for longer than it keeps; or what was saved cannot be read), the
    /// events of the changes since then cannot be recorded any more. That is a gap, never
    /// skipped silently: the front of the feed (`trimmedThrough`) moves up to the cluster
    /// time the stream starts again from, in the same guarded write that makes it start
    /// there, so that every cursor from before the gap is refused (410 `cursor_expired`)
    /// rather than served the feed without the lost events; an error log says which
    /// cluster times were lost and `event_feed_gaps_total` counts it.
    pub async fn open_changes(self, owner: &str) -> StoreResult<Option<Changes>> {
        self.bound_the_feed().await?;
        let why = match self.watch_from_saved().await? {
            Opened::Changes(changes) => return Ok(Some(*changes)),
            Opened::CannotResume(why) => why,
        };
        let recorded = self.feed_state().await?.recorded_through;
        let Some(now) = self.cluster_time().await? else {
            return Err(StoreError::Malformed(
                format!("the change stream cannot resume ({why}), and the database gives no cluster time to start again from").into(),
            ));
        };
        let front = tick_key(tick(now.time, now.increment));
        // Guarded by the lease: another recorder that took it over handles the gap itself.
        // The front only moves up ($max); a late copy of this write moves nothing back.
        let moved = self
            .recorder()
            .update_one(
                doc! { "_id": RECORDER_ID, recorder::OWNER: owner },
                doc! {
                    "$max": { recorder::TRIMMED_THROUGH: &front },
                    "$set": { recorder::START_AT: now },
                    "$unset": { recorder::RESUME_TOKEN: "" },
                },
            )
            .await?;
        if moved.matched_count == 0 {
            return Ok(None);
        }
        crate::metrics::feed_gap(self.deployment, crate::metrics::FeedGap::HistoryLost);
        tracing::error!(
            deployment = %self.deployment,
            cause = %why,
            lost_after = %described(recorded.as_deref()),
            lost_before = %described(Some(&front)),
            "events lost: the change stream cannot resume where the last recorder left it; the events of the changes after the last one recorded and before the cluster time recording starts again from are gone. Readers of cursors from before are answered 410 cursor_expired; recording from now on"
        );
        match self.watch_from_saved().await? {
            Opened::Changes(changes) => Ok(Some(*changes)),
            Opened::CannotResume(why) => Err(StoreError::Refused(
                format!("the change stream cannot start again from now: {why}").into(),
            )),
        }
    }

    /// A feed an older version recorded has no `recordedThrough`, and is read up to its
    /// newest event: before this recorder inserts any, the bound is set there, so that
    /// no read passes an event it inserts before it says how far the feed may be read.
    async fn bound_the_feed(self) -> StoreResult<()> {
        if self.feed_state().await?.recorded_through.is_some() {
            return Ok(());
        }
        let newest = self.newest_event_after(&Position::start()).await?;
        let through = newest.map_or_else(|| tick_key(0), |p| key(&p));
        self.recorder()
            .update_one(
                doc! { "_id": RECORDER_ID, recorder::RECORDED_THROUGH: { "$exists": false } },
                doc! { "$set": { recorder::RECORDED_THROUGH: through } },
            )
            .await?;
        Ok(())
    }

    /// The newest event above `recordedThrough`, which the last recorder recorded but
    /// did not publish (its batch was cut while its time could still have more) before
    /// its stream was saved past it and it stopped or lost its lease: this recorder
    /// resumes after it and would never see it again, so it publishes it once its own
    /// stream has run dry (`publishable`), when every change up to then has been
    /// recorded. Without this, the last events before a handover stayed unreadable
    /// until a later event was recorded.
    async fn left_unpublished(self, state: &Document) -> StoreResult<Option<String>> {
        let Some(through) = state
            .get_str(recorder::RECORDED_THROUGH)
            .ok()
            .and_then(position)
        else {
            return Ok(None);
        };
        Ok(self.newest_event_after(&through).await?.map(|p| key(&p)))
    }

    /// The change stream from where the last recorder left it (`resumeToken`), or from
    /// `startAt`, or from now; or why it cannot resume there.
    async fn watch_from_saved(self) -> StoreResult<Opened> {
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
        let resuming =
            state.contains_key(recorder::RESUME_TOKEN) || state.contains_key(recorder::START_AT);
        let opened = match (
            state.get(recorder::RESUME_TOKEN),
            state.get_timestamp(recorder::START_AT),
        ) {
            (Some(token), _) => {
                let token = match readable_token(token) {
                    Ok(token) => token,
                    Err(why) => return Ok(Opened::CannotResume(why.to_string())),
                };
                watch.start_after(token).await
            }
            (None, Ok(start)) => watch.start_at_operation_time(start).await,
            (None, Err(_)) => watch.await,
        };
        match opened {
            Ok(stream) => Ok(Opened::Changes(Box::new(Changes {
                stream,
                saved: None,
                unpublished: self.left_unpublished(&state).await?,
            }))),
            Err(e) if resuming => match e.kind.as_ref() {
                ErrorKind::Command(c) if CANNOT_RESUME.contains(&c.code) => {
                    Ok(Opened::CannotResume(format!(
                        "the server refused to resume: {} ({}): {}",
                        c.code, c.code_name, c.message
                    )))
                }
                _ => Err(e.into()),
            },
            Err(e) => Err(e.into()),
        }
    }

    /// Records the events of the changes the stream has now, at most [`MAX_RECORDED`]
    /// (waiting up to the stream's await time for a first one), then saves where the
    /// stream is, as `owner`; up to `probe` ([`Events::probe_stream`]). Whether it has
    /// reached the probe: every change before it is recorded.
    pub async fn record_events(
        self,
        changes: &mut Changes,
        owner: &str,
        probe: bson::oid::ObjectId,
    ) -> StoreResult<bool> {
        let Gathered {
            found,
            lost,
            changed,
            drained,
            reached,
        } = self.gather(changes, probe).await?;
        self.insert_in_order(&found).await?;
        // A change that cannot be made an event never will be: the front of the feed moves
        // past its cluster time, in the write that saves the stream past it, so that the
        // cursors below it are refused rather than served the feed without its event.
        let gap_before = self.past(&lost).await?;
        let through = Self::publishable(&mut changes.unpublished, &found, drained);
        let token = changes.stream.resume_token();
        let due = token.as_ref().is_some_and(|token| match &changes.saved {
            None => true,
            Some((saved, at)) => *saved != *token && (changed || at.elapsed() >= SAVE_QUIET_EVERY),
        });
        let mut update = doc! {};
        if let (true, Some(token)) = (due, &token) {
            // A token is a document the server sent: it is BSON already.
            let stored = bson::to_bson(token)
                .unwrap_or_else(|e| panic!("bug: a resume token cannot be stored: {e}"));
            update.insert("$set", doc! { recorder::RESUME_TOKEN: stored });
        }
        if let Some(raised) = raised(through.as_deref(), gap_before.as_deref()) {
            update.insert("$max", raised);
        }
        if !update.is_empty() {
            let written = self
                .recorder()
                .update_one(doc! { "_id": RECORDER_ID, recorder::OWNER: owner }, update)
                .await?;
            if let (true, Some(token)) = (due, token) {
                changes.saved = Some((token, std::time::Instant::now()));
            }
            // The lease lost, nothing was saved: its next holder reads these changes again.
            if let (1, Some(front)) = (written.matched_count, &gap_before) {
                self.say_lost(&lost, front);
            }
        }
        Ok(reached)
    }

    /// The changes the stream has now, made events (at most [`MAX_RECORDED`], waiting up
    /// to the stream's await time for a first one), up to `probe`.
    async fn gather(
        self,
        changes: &mut Changes,
        probe: bson::oid::ObjectId,
    ) -> StoreResult<Gathered> {
        let mut found: Vec<EventDoc> = Vec::new();
        let mut lost: Vec<Unreadable> = Vec::new();
        let mut changed = false;
        // Under steady load the server's batches never come back empty: the changes of
        // [`GATHER_FOR`] are recorded together, so that an event waits that long at most.
        let mut gathering: Option<std::time::Instant> = None;
        let (mut drained, mut reached) = (false, false);
        while found.len() < MAX_RECORDED && gathering.is_none_or(|g| g.elapsed() < GATHER_FOR) {
            let Some(change) = changes.stream.next_if_any().await? else {
                drained = true;
                break;
            };
            // The probe: the stream has given every change before it.
            if let Some(seen) = probed(&change) {
                if seen == probe {
                    (reached, drained) = (true, true);
                    break;
                }
                continue;
            }
            gathering.get_or_insert_with(std::time::Instant::now);
            changed = true;
            match self.event_of(&change) {
                Ok(Some(event)) => found.push(event),
                Ok(None) => {}
                Err(why) => {
                    let why = crate::error_chain::Chain(&why).to_string();
                    lost.push(Unreadable::of(&change, why));
                }
            }
        }
        Ok(Gathered {
            found,
            lost,
            changed,
            drained,
            reached,
        })
    }

    /// The key just past the cluster times of the changes `lost` (up to now for one
    /// without a cluster time), if there are any.
    async fn past(self, lost: &[Unreadable]) -> StoreResult<Option<String>> {
        let time = match lost.iter().map(|l| l.time).max() {
            None => return Ok(None),
            Some(Some(time)) => time,
            Some(None) => self.cluster_time().await?.ok_or_else(|| {
                StoreError::Malformed(
                    "a change without a cluster time, and the database gives none".into(),
                )
            })?,
        };
        Ok(Some(tick_key(
            tick(time.time, time.increment).saturating_add(1),
        )))
    }

    /// Says what the changes `lost` were, whose events could not be recorded, once the
    /// front of the feed moved past them to `front`.
    fn say_lost(self, lost: &[Unreadable], front: &str) {
        for change in lost {
            crate::metrics::feed_gap(self.deployment, crate::metrics::FeedGap::UnreadableChange);
            tracing::error!(
                deployment = %self.deployment,
                change = %change.what,
                cluster_time = %change.time.map_or_else(|| "none".to_owned(), |t| format!("{}.{}", t.time, t.increment)),
                error = %change.why,
                lost_before = %described(Some(front)),
                "event lost: a change that should be an event cannot be made one; no event recorded for it. Readers of cursors from before it are answered 410 cursor_expired"
            );
        }
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
    async fn insert_in_order(self, events: &[EventDoc]) -> StoreResult<usize> {
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

    /// The event `change` reports, if it reports one; [`StoreError::Malformed`] for a
    /// change that should be an event and cannot be made one.
    fn event_of(self, change: &ChangeStreamEvent<Document>) -> StoreResult<Option<EventDoc>> {
        let bad = |why: String| StoreError::Malformed(why.into());
        let collection = change.ns.as_ref().and_then(|n| n.coll.as_deref());
        let Some(time) = change.cluster_time else {
            return Err(bad("a change without a cluster time".into()));
        };
        let full = change.full_document.as_ref();
        match (collection, &change.operation_type) {
            (Some("accounts"), OperationType::Insert) => {
                let full =
                    full.ok_or_else(|| bad("an account's insert without its document".into()))?;
                let account: AccountDoc =
                    bson::from_document(full.clone()).map_err(|e| bad(e.to_string()))?;
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
                    (OperationType::Update, Some(fields)) => fields.get(transfer::STATE),
                    _ => full.and_then(|d| d.get(transfer::STATE)),
                };
                let Some(state) = state.cloned() else {
                    return Ok(None);
                };
                let state: TransferState =
                    bson::from_bson(state).map_err(|e| bad(e.to_string()))?;
                let Some(kind) = EventType::of_state(state) else {
                    return Ok(None);
                };
                let full =
                    full.ok_or_else(|| bad("a transfer's change without its document".into()))?;
                let transfer: TransferDoc =
                    bson::from_document(full.clone()).map_err(|e| bad(e.to_string()))?;
                let transfer = transfer.into_domain(self.deployment)?;
                let stamp = updated
                    .and_then(|f| f.get_datetime(transfer::LAST_MODIFIED).ok())
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
    pub async fn trim_events(self, owner: &str, retention: Duration) -> StoreResult<u64> {
        let retention = chrono::TimeDelta::from_std(retention).unwrap_or(chrono::TimeDelta::MAX);
        let cutoff = self
            .clock
            .server_time()
            .await?
            .checked_sub_signed(retention)
            .unwrap_or(Timestamp::MIN_UTC);
        let state = self.feed_state().await?;
        // What a gap left below the front first: no read goes there, so they go in any
        // order, a bounded round at a time.
        if let Some(front) = &state.trimmed_through {
            let left = self.remove_below(front).await?;
            if left > 0 {
                return Ok(left);
            }
        }
        // The front, from the last removal, up to the second after the cut-off (a
        // change's cluster time and its wall time are the same clock's).
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
            .count();
        let Some(through) = self.whole_ticks(&front[..old], &up_to, cutoff).await? else {
            return Ok(0);
        };
        // Guarded by the lease: an instance that lost it raises nothing. `$max`: a late
        // copy of this write, or another owner's smaller front, moves nothing back; every
        // front this version writes ends a cluster time, so whichever wins does too.
        let raised = self
            .recorder()
            .update_one(
                doc! { "_id": RECORDER_ID, recorder::OWNER: owner },
                doc! { "$max": { recorder::TRIMMED_THROUGH: &through } },
            )
            .await?;
        if raised.matched_count == 0 {
            return Ok(0);
        }
        // At most the window's events: a cluster time that goes on past it (more events
        // than a round removes) is below the front now, and its rest goes in the next
        // rounds (`remove_below`).
        let window_end = front.last().map_or(through.as_str(), |d| d.key.as_str());
        let deleted = self
            .events()
            .delete_many(doc! { event::KEY: { "$lte": through.as_str().min(window_end) } })
            .await?;
        Ok(deleted.deleted_count)
    }

    /// How far a round may move the front, given `old`, the events at its head older than
    /// the retention, and `up_to`, how far it read: to the end of a cluster time, never
    /// inside one, so that a reader starting there may start after that whole time
    /// ([`Events::reader_start`]). The last old event's time is taken whole (one indexed
    /// read of its last event) when all of it is readable (up to `up_to`; a time
    /// `recordedThrough` cuts may still have events to come) and older than `cutoff`
    /// (events sharing a time are as old, as a rule); else the round stops at the end of
    /// the time before, if `old` has one. `None`: nothing to remove yet.
    async fn whole_ticks(
        self,
        old: &[EventDoc],
        up_to: &str,
        cutoff: Timestamp,
    ) -> StoreResult<Option<String>> {
        let Some(last) = old.last() else {
            return Ok(None);
        };
        let t = key_tick(&last.key);
        let end = self
            .events()
            .clone_with_type::<Document>()
            .find_one(
                doc! { event::KEY: { "$gte": &last.key, "$lt": tick_key(t.saturating_add(1)) } },
            )
            .sort(doc! { event::KEY: -1 })
            .projection(doc! { event::KEY: 1, event::AT: 1 })
            .max_time(super::READ_TIME_LIMIT)
            .await?;
        let whole = end.and_then(|e| {
            let key = e.get_str(event::KEY).ok()?.to_owned();
            let at = e.get_datetime(event::AT).ok()?.to_chrono();
            (key.as_str() <= up_to && at < cutoff).then_some(key)
        });
        Ok(whole.or_else(|| {
            old.iter()
                .rev()
                .find(|d| key_tick(&d.key) < t)
                .map(|d| d.key.clone())
        }))
    }

    /// Where a reader without a position starts, in front of a feed trimmed through
    /// `front` (`trimmedThrough`, read before), for `tenant` (every event when `None`).
    ///
    /// The front is the position of the last event removed: another tenant's, as often
    /// as not, so it is never handed out as it is. With none, the start of the feed; a
    /// front that is a cluster time's start (a gap's), the front itself; an event's
    /// position, the start of the next cluster time, after every event of the front's:
    /// this version removes whole cluster times ([`Events::trim_events`]), and no event of
    /// a removed time comes later (a time is removed only once `recordedThrough` is at
    /// its end or past it). That start is above the front, so never refused as expired,
    /// and names no event. One indexed read checks that nothing `tenant` sees of the
    /// front's time is left after it: a front an older version left inside a time (its
    /// rounds stopped at a count) until a round of this version moves it to the time's
    /// end. Then the reader starts at the front itself, [`Start::AtFront`].
    pub async fn reader_start(
        self,
        front: Option<Position>,
        tenant: Option<&TenantName>,
    ) -> StoreResult<Start> {
        let Some(front) = front else {
            return Ok(Start::Clear(Position::start()));
        };
        if front.id.is_empty() {
            return Ok(Start::Clear(front));
        }
        let next = tick(front.seconds, front.increment).saturating_add(1);
        let mut left = doc! { event::KEY: { "$gt": key(&front), "$lt": tick_key(next) } };
        if let Some(tenant) = tenant {
            left.insert(event::TENANTS, tenant.as_str());
        }
        let kept = self
            .events()
            .clone_with_type::<Document>()
            .find_one(left)
            .projection(doc! { "_id": 1 })
            .max_time(super::READ_TIME_LIMIT)
            .await?;
        Ok(match kept {
            None => Start::Clear(tick_start(next)),
            Some(_) => Start::AtFront(front),
        })
    }

    /// Removes up to [`MAX_TRIMMED`] events at or below `front`: those a gap left behind
    /// when it moved the front past them ([`Events::open_changes`]), or a removal that
    /// stopped between raising the front and deleting. The number removed. Nothing reads
    /// below the front, so any instance may remove them at any time.
    async fn remove_below(self, front: &Position) -> StoreResult<u64> {
        let below: Vec<Bson> = self
            .events()
            .clone_with_type::<Document>()
            .find(doc! { event::KEY: { "$lte": key(front) } })
            .projection(doc! { "_id": 1 })
            .limit(MAX_TRIMMED as i64)
            .max_time(super::READ_TIME_LIMIT)
            .await?
            .try_collect::<Vec<_>>()
            .await?
            .into_iter()
            .filter_map(|d| d.get("_id").cloned())
            .collect();
        if below.is_empty() {
            return Ok(0);
        }
        let deleted = self
            .events()
            .delete_many(doc! { "_id": { "$in": below } })
            .await?;
        Ok(deleted.deleted_count)
    }

    /// The position of this deployment's newest event after `after`, if there is one:
    /// what the followers' signal watches. A range from `after` rather than a sort of the
    /// whole feed:
    /// SecantusDB materialises every match of a sorted find before its limit (37 ms for
    /// the newest of 40,000 events, 0.4 ms for a range of a few near the end).
    pub async fn newest_event_after(self, after: &Position) -> StoreResult<Option<Position>> {
        let newest = self
            .events()
            .clone_with_type::<Document>()
            .find_one(doc! { event::KEY: { "$gt": key(after) } })
            .sort(doc! { event::KEY: -1 })
            .projection(doc! { event::KEY: 1 })
            .max_time(super::READ_TIME_LIMIT)
            .await?;
        Ok(newest.and_then(|d| d.get_str(event::KEY).ok().and_then(position)))
    }

    /// How far the feed was trimmed, and how far it may be read, in one read.
    pub async fn feed_state(self) -> StoreResult<FeedState> {
        let state = self
            .recorder()
            .find_one(doc! { "_id": RECORDER_ID })
            .projection(doc! { recorder::TRIMMED_THROUGH: 1, recorder::RECORDED_THROUGH: 1 })
            .await?
            .unwrap_or_default();
        Ok(FeedState {
            trimmed_through: state
                .get_str(recorder::TRIMMED_THROUGH)
                .ok()
                .and_then(position),
            recorded_through: state
                .get_str(recorder::RECORDED_THROUGH)
                .ok()
                .map(str::to_owned),
        })
    }

    /// The position of the last event removed after the retention, if any was.
    pub async fn trimmed_through(self) -> StoreResult<Option<Position>> {
        Ok(self.feed_state().await?.trimmed_through)
    }

    /// Up to `limit` events after `after` (from the front when `None`), of `types` (all
    /// when empty), `tenant`'s only when given, in feed order, no further than
    /// `recorded` (the [`FeedState::recorded_through`] read before); and how far the feed
    /// was trimmed once they were read.
    pub async fn read_feed(
        self,
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
        self,
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
        self,
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
            let mut filter = doc! { event::KEY: within };
            if let Some(tenant) = tenant {
                filter.insert(event::TENANTS, tenant.as_str());
            }
            let window: Vec<EventDoc> = self
                .events()
                .find(filter)
                .sort(doc! { event::KEY: 1 })
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

    fn event_from(self, d: EventDoc) -> StoreResult<Event> {
        let bad = |why: String| StoreError::Malformed(format!("event {}: {why}", d.id).into());
        let kind = EventType::parse(&d.kind).map_err(|e| bad(e.0))?;
        let position = position(&d.key).ok_or_else(|| bad("its key is unreadable".into()))?;
        let data = match (d.transfer.clone(), d.account.clone()) {
            (Some(t), None) => EventData::Transfer(t.into_domain(self.deployment)?),
            (None, Some(a)) => EventData::Account(a.into_domain(self.deployment)?),
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

/// The saved resume token, if it is one: a document with its `_data` a string.
/// SecantusDB starts a stream asked to resume from anything else at its tail, silently.
fn readable_token(saved: &Bson) -> Result<ResumeToken, UnreadableToken> {
    let readable = saved
        .as_document()
        .is_some_and(|d| matches!(d.get("_data"), Some(Bson::String(_))));
    if !readable {
        return Err(UnreadableToken::Shape(saved.clone()));
    }
    Ok(bson::from_bson(saved.clone())?)
}

/// Why a saved resume token cannot be resumed from.
#[derive(Debug, thiserror::Error)]
enum UnreadableToken {
    /// Not a document with its `_data` a string.
    #[error("the saved resume token is unreadable: {0}")]
    Shape(Bson),
    #[error("the saved resume token is unreadable: {0}")]
    Decode(#[from] bson::de::Error),
}

/// A feed key as a log line says it: its cluster time (seconds.increment) and that
/// time's UTC date; "the start of the feed" for none.
fn described(key: Option<&str>) -> String {
    match key.and_then(position) {
        Some(p) if p.seconds > 0 => {
            let date = chrono::DateTime::from_timestamp(i64::from(p.seconds), 0)
                .map_or_else(String::new, |d| d.to_rfc3339());
            format!("cluster time {}.{} ({date})", p.seconds, p.increment)
        }
        _ => "the start of the feed".into(),
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
    let probe = format!("updateDescription.updatedFields.{}", recorder::STREAM_PROBE);
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
            format!("updateDescription.updatedFields.{}", transfer::STATE): { "$in": states.clone() },
        },
        {
            "ns.coll": "transactions",
            "operationType": { "$in": ["insert", "replace"] },
            format!("fullDocument.{}", transfer::STATE): { "$in": states },
        },
        { "ns.coll": RECORDER, "operationType": "update", probe: { "$exists": true } },
    ] } }
}

/// The `$max` that raises the feed's bound to `through` and its front to `front`, if
/// either is given.
fn raised(through: Option<&str>, front: Option<&str>) -> Option<Document> {
    let mut raised = doc! {};
    if let Some(through) = through {
        raised.insert(recorder::RECORDED_THROUGH, through);
    }
    if let Some(front) = front {
        raised.insert(recorder::TRIMMED_THROUGH, front);
    }
    (!raised.is_empty()).then_some(raised)
}

/// The probe `change` writes, if it is one ([`Events::probe_stream`]).
fn probed(change: &ChangeStreamEvent<Document>) -> Option<bson::oid::ObjectId> {
    if change.ns.as_ref().and_then(|n| n.coll.as_deref()) != Some(RECORDER) {
        return None;
    }
    let fields = &change.update_description.as_ref()?.updated_fields;
    fields.get_object_id(recorder::STREAM_PROBE).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each field of `events` named in `store::fields` is the name serde writes, and
    /// each name serde writes is there.
    #[test]
    fn the_event_fields_are_the_names_serde_writes() {
        let stored = EventDoc {
            id: "e".into(),
            kind: "transfer.done".into(),
            at: DateTime::now(),
            key: "k".into(),
            transfer: None,
            account: None,
            tenants: vec!["acme".into()],
        };
        let mut written = bson::to_document(&stored).unwrap();
        // The transfer and the account, each a document of its own collection's fields.
        written.insert(event::TRANSFER, doc! {});
        written.insert(event::ACCOUNT, doc! {});
        super::super::fields::assert_same_keys(event::ALL, &written);
    }

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
        let bound = Events::publishable(&mut unpublished, &cut, false).unwrap();
        assert_eq!(bound, tick_key(tick(8, 2)));
        // An event of the same time with a smaller id, recorded next, is above the bound.
        assert!(key(&position(&event_at(8, 2, "a:b").key).unwrap()) > bound);
        assert!(bound > cut[0].key);
        // The stream ran dry: everything recorded is published.
        let bound = Events::publishable(&mut unpublished, &[], true).unwrap();
        assert_eq!(bound, cut[1].key);
        assert_eq!(Events::publishable(&mut unpublished, &[], true), None);
        let drained = [event_at(9, 1, "a:c")];
        let bound = Events::publishable(&mut unpublished, &drained, true).unwrap();
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
