//! The feed kept in the documents (`docs/events.md`, "How events are recorded"). Each
//! write that makes a transfer `held`, `done` or `canceled`, and each account's insert,
//! marks its event due in the document it writes (`eventsDue`, `guards::moved`), so no
//! change stream is needed and none can be lost. The recorder, one lease holder per
//! deployment, gives due events their places in the feed in rounds:
//!
//! 1. it finds due events (index `eventsDue.type`), puts them in order, and gives each a
//!    tick of its own after the feed's bound (`recordedThrough`), from the database's
//!    clock or just past the bound, whichever is later;
//! 2. it writes the round (its first tick and the events' ids in order) into its own
//!    document, guarded by its lease;
//! 3. it inserts the events at their keys, in order (a second copy is refused by `_id`);
//! 4. it raises the bound to the round's last key and clears the round, guarded by its
//!    lease;
//! 5. it takes the due marks of the round's events off their documents.
//!
//! A crash or a lost lease between 2 and 4 leaves the round written: the next holder
//! first inserts the same events at the same keys, so that a late insert of the old
//! holder is refused as a copy or lands where the new one puts it, never below a bound
//! already raised. Anything else the old holder sends late is refused by the lease's
//! guard (2, 4), or takes off marks of events already recorded (5): an event happens
//! once to its subject, so a mark of the same type is the same event. A crash between 4
//! and 5 leaves marks of recorded events: the next round's inserts are refused as copies
//! and it takes them off.

use futures::TryStreamExt;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::{self, Bson, DateTime, Document, doc};
use std::collections::HashMap;

use mongodb::Collection;

use super::{
    AccountDoc, EventDoc, Events, MAX_RECORDED, RECORDER_ID, StoreError, StoreResult, Tick,
    TransferDoc, Unreadable, key_tick, stored, tick, tick_start,
};
use crate::domain::{DeploymentName, EventType, Position, TransferState, event_id};
use crate::store::documents::{EventDue, Stored};
use crate::store::fields::{event_due, recorder};
use crate::store::guards::due_doc;

/// The recorder's rounds over one deployment's due events (from
/// [`Events::rounds`]): the feed's own collections, and `transactions` and `accounts`
/// for the marks.
#[derive(Clone, Copy, Debug)]
pub struct Rounds<'s> {
    pub(super) events: Events<'s>,
}

/// A round written but not finished (step 2): its first tick and its events in order,
/// the `n`th at the first tick plus `n`.
#[derive(Debug, Clone, PartialEq)]
pub struct Round {
    first: Tick,
    ids: Vec<String>,
}

impl Round {
    /// The condition that it is the round left in the recorder's document.
    fn left(&self) -> Document {
        let first = format!("{}.{}", recorder::ROUND, recorder::ROUND_FIRST);
        doc! { first: super::tick_key(self.first) }
    }

    /// Its last tick.
    fn last(&self) -> Tick {
        let n = u64::try_from(self.ids.len()).unwrap_or(u64::MAX);
        self.first.saturating_add(n.saturating_sub(1))
    }
}

/// What the recorder knows of its feed while it holds the lease: read once when it
/// takes the lease, then kept by its own rounds.
#[derive(Debug)]
pub struct Due {
    /// `recordedThrough`'s tick: every round's ticks come after it.
    bound: Tick,
    /// A round the last holder left unfinished, finished first.
    left: Option<Round>,
}

/// A document with due events, as read: the events are made from it one by one, so
/// that one that cannot be read is a gap of its own rather than a recorder stuck.
struct Subject {
    /// Whether it is an account (else a transfer).
    account: bool,
    /// Its `_id`: an account's id, a transfer's in hex.
    id: String,
    /// Its `_id` as stored.
    raw_id: Bson,
    doc: Document,
    dues: Vec<EventDue>,
    /// The marks no event can be made of (not a mark, a type this version does not know
    /// or of the other collection, a transfer whose `_id` is no transfer's): taken off
    /// as they are found, so that they cannot hold up the recorder.
    strays: Vec<Bson>,
}

impl Subject {
    fn read(account: bool, doc: Document) -> Option<Subject> {
        let raw_id = doc.get("_id")?.clone();
        let id = match (&raw_id, account) {
            (Bson::ObjectId(id), false) => Some(id.to_hex()),
            (Bson::String(id), true) => Some(id.clone()),
            _ => None,
        };
        let (mut dues, mut strays) = (Vec::new(), Vec::new());
        let marks = doc.get_array(crate::store::fields::transfer::EVENTS_DUE);
        for mark in marks.into_iter().flatten() {
            let due = mark
                .as_document()
                .and_then(|d| bson::from_document::<EventDue>(d.clone()).ok())
                .filter(|d| {
                    EventType::parse(&d.kind)
                        .is_ok_and(|k| (k == EventType::AccountOpened) == account)
                });
            match (due, &id) {
                (Some(due), Some(_)) => dues.push(due),
                _ => strays.push(mark.clone()),
            }
        }
        Some(Subject {
            account,
            id: id.unwrap_or_default(),
            raw_id,
            doc,
            dues,
            strays,
        })
    }

    /// The `at` of its oldest due event.
    fn first_at(&self) -> DateTime {
        self.dues
            .iter()
            .map(|d| d.at)
            .min()
            .unwrap_or(DateTime::MAX)
    }

    /// Its due events, in the order they happened (a hold's `held` first), as
    /// `(id, type, at)`.
    fn due_events(&self) -> Vec<(String, EventType, DateTime)> {
        let mut events: Vec<_> = self
            .dues
            .iter()
            .filter_map(|d| EventType::parse(&d.kind).ok().map(|k| (k, d.at)))
            .map(|(kind, at)| (event_id(kind, &self.id), kind, at))
            .collect();
        events.sort_by_key(|(_, kind, _)| (*kind != EventType::TransferHeld, kind.as_str()));
        events.dedup_by(|a, b| a.0 == b.0);
        events
    }
}

/// The collection of an account's (`account`) or a transfer's documents.
fn collection_name(account: bool) -> &'static str {
    if account { "accounts" } else { "transactions" }
}

impl Rounds<'_> {
    /// The collection of accounts (`account`) or of transfers.
    fn collection(self, account: bool) -> Collection<Document> {
        self.events.db.collection(collection_name(account))
    }

    /// What the recorder needs to go on from where the last holder of the lease left
    /// the feed.
    pub async fn open_due(self, owner: &str) -> StoreResult<Due> {
        let state = self
            .events
            .recorder()
            .find_one(doc! { "_id": RECORDER_ID })
            .await?
            .unwrap_or_default();
        // Past the front too: a gap may have moved it beyond the bound.
        let bound = [recorder::RECORDED_THROUGH, recorder::TRIMMED_THROUGH]
            .iter()
            .map(|field| state.get_str(field).map_or(0, key_tick))
            .max()
            .unwrap_or(0);
        let left = match state.get_document(recorder::ROUND) {
            Ok(round) => Some(read_round(round)?),
            Err(_) => None,
        };
        // A round always starts past the bound until it is finished: one at or below it
        // is a late copy of a round write whose answer was lost (and which was never
        // followed by its inserts), written after a later round finished.
        let left = match left {
            Some(round) if round.first <= bound => {
                self.drop_round(&round, owner).await?;
                None
            }
            left => left,
        };
        Ok(Due { bound, left })
    }

    /// Clears `round`, a late copy (see [`Rounds::open_due`]), if it is still the one
    /// left and `owner` holds the lease.
    async fn drop_round(self, round: &Round, owner: &str) -> StoreResult<()> {
        let unset = doc! { "$unset": { recorder::ROUND: "" } };
        self.events.as_owner(owner, round.left(), unset).await?;
        Ok(())
    }

    /// One round as `owner` (the module's steps): the number of events it recorded, or
    /// `None` when `owner` no longer holds the lease (or its round was not the one left,
    /// which the next holder, maybe itself, sorts out).
    pub async fn record_due(self, due: &mut Due, owner: &str) -> StoreResult<Option<usize>> {
        let (round, made) = match due.left.take() {
            // The last holder's: its documents read again, as they are now, and each
            // event at its place in the round.
            Some(round) => {
                let subjects = self.subjects_of(&round.ids).await?;
                let made = make_all(&round.ids, &subjects, self.events.deployment);
                (round, made)
            }
            None => {
                let found = self.find_due(MAX_RECORDED).await?;
                self.take_off_strays(&found).await?;
                let ids = in_feed_order(&found);
                let mut made: Vec<Made> = make_all(&ids, &found, self.events.deployment)
                    .into_iter()
                    .flatten()
                    .collect();
                if made.is_empty() {
                    return Ok(Some(0));
                }
                // Those that cannot be made first: the front moves past them only, not
                // past an event of the round that can.
                made.sort_by_key(|(_, event)| event.is_ok());
                let ids: Vec<String> = made.iter().map(|(id, _)| id.clone()).collect();
                let first = self.next_tick(due.bound, ids.len()).await?;
                let round = Round { first, ids };
                if !self.write_round(&round, owner).await? {
                    return Ok(None);
                }
                (round, made.into_iter().map(Some).collect())
            }
        };
        let (events, lost) = placed(round.first, made);
        self.events.insert_in_order(&events).await?;
        // An event that cannot be made is lost: the front moves past it, so that the
        // cursors below it are refused rather than served the feed without it.
        let gap = self.events.past(&lost).await?;
        let last = events.last().map(|e| e.key.clone());
        if !self
            .finish_round(&round, last.as_deref(), gap.as_deref(), owner)
            .await?
        {
            return Ok(None);
        }
        if let Some(front) = &gap {
            self.events.say_lost(&lost, front);
        }
        // Past every tick of the round, also those whose events an earlier round had
        // recorded: the old holder's late copies may still land there.
        due.bound = due.bound.max(round.last());
        self.take_off(&round.ids).await?;
        Ok(Some(events.len()))
    }

    /// Up to `limit` documents with due events, the oldest first (by their oldest
    /// event's `at`), transfers' and accounts' together: after a long stop, an account's
    /// opening is recorded before the transfers out of it, a transfer before its reversal.
    async fn find_due(self, limit: usize) -> StoreResult<Vec<Subject>> {
        let transfers = self.oldest_due(false, limit).await?;
        let accounts = self.oldest_due(true, limit).await?;
        // Each list holds every due document of its collection up to its last; beyond
        // the last of a full one, the other's may not come before what it left out.
        let full_until = |list: &[Subject]| {
            (list.len() >= limit)
                .then(|| list.last().map(Subject::first_at))
                .flatten()
        };
        let until = [full_until(&transfers), full_until(&accounts)]
            .into_iter()
            .flatten()
            .min();
        let mut found: Vec<Subject> = transfers.into_iter().chain(accounts).collect();
        found.sort_by_key(Subject::first_at);
        found.retain(|s| until.is_none_or(|until| s.first_at() <= until));
        found.truncate(limit);
        Ok(found)
    }

    /// Up to `limit` accounts (`account`) or transfers with due events, the oldest first.
    async fn oldest_due(self, account: bool, limit: usize) -> StoreResult<Vec<Subject>> {
        // `$exists` is the partial index's filter, which MongoDB needs the query to
        // imply; SecantusDB reads an index only for a condition on its key (a sort, or
        // `$exists`, alone read every document: 12 ms at 20,000, against under 2 ms).
        let due = doc! {
            event_due::DUE_AT: { "$gte": DateTime::MIN },
            event_due::DUE_TYPE: { "$exists": true },
        };
        // One batch: what one read of the index found, none left for a later `getMore`.
        let batch = u32::try_from(limit + 1).unwrap_or(u32::MAX);
        let docs: Vec<Document> = self
            .collection(account)
            .find(due)
            .sort(doc! { event_due::DUE_AT: 1 })
            .projection(subject_fields())
            .limit(i64::try_from(limit).unwrap_or(i64::MAX))
            .batch_size(batch)
            .await?
            .try_collect()
            .await?;
        Ok(docs
            .into_iter()
            .filter_map(|d| Subject::read(account, d))
            .collect())
    }

    /// The first of `n` ticks after `bound` and after the deployment's cluster time now:
    /// a place taken from the cluster time before (a webhook's registration, a stream's
    /// start) is below every event made due after it, as it is below every change.
    async fn next_tick(self, bound: Tick, n: usize) -> StoreResult<Tick> {
        let now = match self.events.cluster_time().await? {
            Some(now) => tick(now.time, now.increment),
            // No cluster time (no replica set): the database's clock, as a lower bound.
            None => {
                let now = self.events.clock.server_time_lower_bound().await?;
                tick(u32::try_from(now.timestamp()).unwrap_or(u32::MAX), 0)
            }
        };
        Ok(first_tick(now, bound, n))
    }

    /// Step 2, guarded by `owner`'s lease: whether it still holds it.
    async fn write_round(self, round: &Round, owner: &str) -> StoreResult<bool> {
        let stored = doc! {
            recorder::ROUND_FIRST: super::tick_key(round.first),
            recorder::ROUND_IDS: &round.ids,
        };
        // Only where no round is left: a late copy of this holder's earlier round write
        // cannot replace a round in flight.
        let none_left = doc! { recorder::ROUND: { "$exists": false } };
        let set = doc! { "$set": { recorder::ROUND: stored } };
        self.events.as_owner(owner, none_left, set).await
    }

    /// Step 4, guarded by `owner`'s lease: whether it still holds it.
    async fn finish_round(
        self,
        round: &Round,
        last: Option<&str>,
        gap: Option<&str>,
        owner: &str,
    ) -> StoreResult<bool> {
        let mut update = doc! { "$unset": { recorder::ROUND: "" } };
        if let Some(raised) = super::raised(last, gap) {
            update.insert("$max", raised);
        }
        // Only this round: a late copy of an earlier finish clears no later round.
        self.events.as_owner(owner, round.left(), update).await
    }

    /// The documents of the events `ids`, with their due marks.
    async fn subjects_of(self, ids: &[String]) -> StoreResult<Vec<Subject>> {
        let (transfers, accounts) = subjects_by_collection(ids);
        let mut found: Vec<Subject> = Vec::new();
        for (account, ids) in [(false, transfers), (true, accounts)] {
            if ids.is_empty() {
                continue;
            }
            let docs: Vec<Document> = self
                .collection(account)
                .find(doc! { "_id": { "$in": ids } })
                .projection(subject_fields())
                .await?
                .try_collect()
                .await?;
            found.extend(docs.into_iter().filter_map(|d| Subject::read(account, d)));
        }
        Ok(found)
    }

    /// The marks of `found` no event can be made of, off their documents, with a
    /// warning: something other than this service wrote them.
    async fn take_off_strays(self, found: &[Subject]) -> StoreResult<()> {
        for subject in found.iter().filter(|s| !s.strays.is_empty()) {
            tracing::warn!(
                deployment = %self.events.deployment,
                document = %subject.raw_id,
                marks = ?subject.strays,
                "marks of events that cannot be made taken off; no event recorded for them"
            );
            // The marks kept as they are, only if none came meanwhile (else the next
            // round does it).
            let field = crate::store::fields::transfer::EVENTS_DUE;
            let marks = subject.doc.get(field).cloned().unwrap_or(Bson::Null);
            let kept: Vec<Document> = subject.dues.iter().map(due_doc).collect();
            self.collection(subject.account)
                .update_one(
                    doc! { "_id": &subject.raw_id, field: marks },
                    doc! { "$set": { field: kept } },
                )
                // A document something else wrote may not pass the validator; only the
                // marks change.
                .bypass_document_validation(true)
                .await?;
        }
        Ok(())
    }

    /// Step 5: the marks of the events `ids` off their documents.
    async fn take_off(self, ids: &[String]) -> StoreResult<()> {
        let mut by_kind: Vec<(EventType, Vec<&str>)> = Vec::new();
        for id in ids {
            let Some((kind, subject)) = split_event_id(id) else {
                continue;
            };
            match by_kind.iter_mut().find(|(k, _)| *k == kind) {
                Some((_, subjects)) => subjects.push(subject),
                None => by_kind.push((kind, vec![subject])),
            }
        }
        for (kind, subjects) in by_kind {
            let pull = doc! { "$pull": { crate::store::fields::transfer::EVENTS_DUE: { event_due::TYPE: kind.as_str() } } };
            if kind == EventType::AccountOpened {
                // One account a write: a write to a document a transaction holds (a native
                // transfer's) waits for it to end, and an `updateMany` waiting on one
                // account would hold the others it already wrote meanwhile, refusing every
                // native transaction on them until it gets through (seen with 60 native
                // transfers on three new accounts: 503s after 30 s).
                for account in subjects {
                    self.collection(true)
                        .update_one(doc! { "_id": account }, pull.clone())
                        .bypass_document_validation(true)
                        .await?;
                }
            } else {
                let ids: Vec<ObjectId> = subjects
                    .iter()
                    .filter_map(|s| ObjectId::parse_str(s).ok())
                    .collect();
                // Only the marks change: a document something else wrote, whose event
                // could not be made, may not pass the validator.
                self.collection(false)
                    .update_many(doc! { "_id": { "$in": ids } }, pull)
                    .bypass_document_validation(true)
                    .await?;
            }
        }
        Ok(())
    }
}

/// The first of `n` ticks after both `now` and `bound`, all in one second: the
/// increments of a second run out at 2^32, and a round that would pass it starts at the
/// next second.
fn first_tick(now: Tick, bound: Tick, n: usize) -> Tick {
    let first = now.max(bound) + 1;
    let n = u64::try_from(n).unwrap_or(u64::MAX);
    if (first & 0xffff_ffff).saturating_add(n) > 0xffff_ffff {
        return ((first >> 32) + 1) << 32;
    }
    first
}

/// The due events of `found`, in feed order: each document's in the order they
/// happened, the documents by the time of their first.
fn in_feed_order(found: &[Subject]) -> Vec<String> {
    let mut per_subject: Vec<Vec<(String, EventType, DateTime)>> =
        found.iter().map(Subject::due_events).collect();
    per_subject.retain(|events| !events.is_empty());
    per_subject.sort_by(|a, b| {
        let first = |events: &[(String, EventType, DateTime)]| {
            events.iter().map(|e| e.2).min().unwrap_or(DateTime::MAX)
        };
        (first(a), &a[0].0).cmp(&(first(b), &b[0].0))
    });
    per_subject
        .into_iter()
        .flatten()
        .map(|(id, _, _)| id)
        .collect()
}

/// An event of a round made from its document, before its place is known: the event,
/// or why it cannot be made.
type Made = (String, Result<EventDoc, Unreadable>);

/// The events `ids`, made from `subjects`; `None` for one whose mark is gone (an earlier
/// round recorded it), so that each keeps the place of its id.
fn make_all(
    ids: &[String],
    subjects: &[Subject],
    deployment: &DeploymentName,
) -> Vec<Option<Made>> {
    let by_id: HashMap<(bool, &str), &Subject> = subjects
        .iter()
        .map(|s| ((s.account, s.id.as_str()), s))
        .collect();
    ids.iter()
        .map(|id| {
            let (kind, subject_id) = split_event_id(id)?;
            let subject = by_id.get(&(kind == EventType::AccountOpened, subject_id))?;
            let due = subject.dues.iter().find(|d| d.kind == kind.as_str())?;
            let made =
                event_of(subject, id.clone(), kind, due, deployment).map_err(|why| Unreadable {
                    time: None,
                    what: format!("{} {}", collection_name(subject.account), subject.id),
                    why: crate::error_chain::Chain(&why).to_string(),
                });
            Some((id.clone(), made))
        })
        .collect()
}

/// `made`, the `n`th at tick `first + n`: the events to insert, and those lost.
fn placed(first: Tick, made: Vec<Option<Made>>) -> (Vec<EventDoc>, Vec<Unreadable>) {
    let (mut events, mut lost) = (Vec::with_capacity(made.len()), Vec::new());
    for (n, made) in made.into_iter().enumerate() {
        let Some((id, made)) = made else {
            continue;
        };
        let at = first.saturating_add(u64::try_from(n).unwrap_or(u64::MAX));
        let place = tick_start(at);
        match made {
            Ok(mut event) => {
                event.key = super::key(&Position { id, ..place });
                events.push(event);
            }
            Err(mut unreadable) => {
                unreadable.time = Some(bson::Timestamp {
                    time: place.seconds,
                    increment: place.increment,
                });
                lost.push(unreadable);
            }
        }
    }
    (events, lost)
}

/// The event `id` of `subject`, made due by `due`.
fn event_of(
    subject: &Subject,
    id: String,
    kind: EventType,
    due: &EventDue,
    deployment: &DeploymentName,
) -> StoreResult<EventDoc> {
    // Its place is given when the round is made (`placed`).
    let time = bson::Timestamp {
        time: 0,
        increment: 0,
    };
    let bad = |e: bson::de::Error| StoreError::Malformed(e.to_string().into());
    if subject.account {
        let account: AccountDoc = bson::from_document(subject.doc.clone()).map_err(bad)?;
        // As it was opened: its opening balance, nothing pending, its first entry.
        let account = AccountDoc {
            balance: due.balance.unwrap_or(account.balance),
            pending_debits: 0,
            pending_credits: 0,
            incoming: 0,
            seq: 1,
            updated_at: account.created_at,
            recent_entries: Vec::new(),
            last_entry_at: None,
            pending_transactions: Vec::new(),
            fenced_transactions: Vec::new(),
            events_due: Vec::new(),
            ..account
        };
        return Ok(stored(id, kind, due.at, time, None, Some(account)));
    }
    let state: TransferState = kind
        .state()
        .ok_or_else(|| StoreError::Malformed(format!("{id}: no transfer's event").into()))?;
    let transfer: TransferDoc = bson::from_document(subject.doc.clone()).map_err(bad)?;
    let transfer = transfer.into_domain(deployment)?;
    let transfer = transfer.as_it_reached(state, Some(due.at.to_chrono()));
    let data = TransferDoc::from(&transfer);
    Ok(stored(id, kind, due.at, time, Some(data), None))
}

/// The type and subject of an event id (`<type>:<subject>`).
fn split_event_id(id: &str) -> Option<(EventType, &str)> {
    let (kind, subject) = id.split_once(':')?;
    Some((EventType::parse(kind).ok()?, subject))
}

/// The subjects of the events `ids` as stored: transfers' `_id`s, accounts' `_id`s.
fn subjects_by_collection(ids: &[String]) -> (Vec<Bson>, Vec<Bson>) {
    let (mut transfers, mut accounts) = (Vec::new(), Vec::new());
    for (kind, subject) in ids.iter().filter_map(|id| split_event_id(id)) {
        if kind == EventType::AccountOpened {
            accounts.push(Bson::String(subject.to_owned()));
        } else if let Ok(id) = ObjectId::parse_str(subject) {
            transfers.push(Bson::ObjectId(id));
        }
    }
    (transfers, accounts)
}

/// What a round reads of a document with due events: all but an account's recent
/// entries, which no event shows.
fn subject_fields() -> Document {
    doc! { crate::store::fields::account::RECENT: 0 }
}

/// A round as the recorder's document holds it.
fn read_round(stored: &Document) -> StoreResult<Round> {
    let bad = || StoreError::Malformed(format!("the recorder's round is not one: {stored}").into());
    let first = stored.get_str(recorder::ROUND_FIRST).map_err(|_| bad())?;
    let ids = stored
        .get_array(recorder::ROUND_IDS)
        .map_err(|_| bad())?
        .iter()
        .map(|id| match id {
            Bson::String(id) => Ok(id.clone()),
            _ => Err(bad()),
        })
        .collect::<StoreResult<Vec<_>>>()?;
    Ok(Round {
        first: key_tick(first),
        ids,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transfer(id: ObjectId, dues: &[(&str, i64)]) -> Subject {
        let dues: Vec<Bson> = dues
            .iter()
            .map(|(kind, at)| {
                Bson::Document(doc! { "type": *kind, "at": DateTime::from_millis(*at) })
            })
            .collect();
        Subject::read(false, doc! { "_id": id, "eventsDue": dues }).unwrap()
    }

    #[test]
    fn a_round_puts_a_holds_held_first_and_documents_by_their_oldest_event() {
        let (hold, other) = (ObjectId::new(), ObjectId::new());
        // The capture's stamp below the hold's (another instance's lower bound): still
        // `held` first.
        let found = [
            transfer(other, &[("transfer.done", 150)]),
            transfer(hold, &[("transfer.done", 90), ("transfer.held", 100)]),
        ];
        assert_eq!(
            in_feed_order(&found),
            [
                format!("transfer.held:{}", hold.to_hex()),
                format!("transfer.done:{}", hold.to_hex()),
                format!("transfer.done:{}", other.to_hex()),
            ]
        );
    }

    #[test]
    fn a_due_event_marked_twice_is_one_event_and_one_of_another_collection_none() {
        let id = ObjectId::new();
        let found = [transfer(
            id,
            &[
                ("transfer.done", 5),
                ("transfer.done", 5),
                ("account.opened", 1),
            ],
        )];
        assert_eq!(
            in_feed_order(&found),
            [format!("transfer.done:{}", id.to_hex())]
        );
    }

    #[test]
    fn a_rounds_ticks_come_after_the_bound_and_the_cluster_time_in_one_second() {
        let (now, bound) = (tick(100, 7), tick(99, 50));
        assert_eq!(first_tick(now, bound, 3), tick(100, 8));
        assert_eq!(
            first_tick(bound, now, 3),
            tick(100, 8),
            "past the bound too"
        );
        assert_eq!(
            first_tick(tick(100, u32::MAX - 2), 0, 3),
            tick(101, 0),
            "a round that would run out of the second's increments starts at the next"
        );
        assert_eq!(
            first_tick(tick(100, u32::MAX - 3), 0, 2),
            tick(100, u32::MAX - 2)
        );
    }

    #[test]
    fn a_round_left_by_the_last_holder_is_rebuilt_at_its_places_without_what_is_recorded() {
        let (kept, recorded) = (ObjectId::new(), ObjectId::new());
        let round = Round {
            first: tick(100, 1),
            ids: vec![
                format!("transfer.done:{}", recorded.to_hex()),
                format!("transfer.done:{}", kept.to_hex()),
            ],
        };
        // The recorded one's mark was taken off: left out, and the other keeps its place.
        let mut gone = transfer(recorded, &[]);
        gone.doc.insert("state", "done");
        let subjects = [transfer(kept, &[("transfer.done", 5)]), gone];
        let made = make_all(&round.ids, &subjects, &DeploymentName::default());
        let (events, lost) = placed(round.first, made);
        assert_eq!(events.len() + lost.len(), 1);
        let place = lost
            .first()
            .and_then(|l| l.time)
            .map(|t| tick(t.time, t.increment))
            .or_else(|| events.first().map(|e| key_tick(&e.key)));
        assert_eq!(
            place,
            Some(tick(100, 2)),
            "the second of the round: its second tick"
        );
    }
}
