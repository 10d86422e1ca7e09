//! Following the event feed live (`GET /events/stream`): a follower reads the feed with
//! its own cursor, exactly as a reader of `GET /events` would, and waits for a signal that
//! some deployment's feed grew instead of polling on its own.
//!
//! - One task per instance ([`Feed::signal_new_events`]) looks at the newest
//!   event of each deployment a few times a second, and only while someone follows.
//! - Each follower hands its events to a queue bounded by count ([`QUEUE`]) and by bytes
//!   ([`QUEUE_BYTES`], by [`Event::weight`]: a few multi-leg transfers weigh as much as
//!   hundreds of openings). A consumer that lets the queue fill is too slow: its
//!   follower stops ([`FollowEnd::FellBehind`]; full in bytes, once the consumer has
//!   taken nothing for [`ROOM_WAIT`], since one page of large events may outweigh the
//!   queue); the consumer reconnects with its last event id and reads on from the feed,
//!   so nothing is lost and the process never holds more than the queue for it.
//! - At most `MAX_EVENT_STREAMS` followers at once, each holding a permit for its life;
//!   and at most `MAX_EVENT_STREAMS_PER_TENANT` of them per scope (a tenant, or the
//!   platform counted as one more), so that one tenant's keys cannot take every place and
//!   deny the feed to the others. A follower's place in its scope's share is held by the
//!   same guard as its permit ([`Place`]): both are given back exactly when the follower
//!   is dropped, whichever way its stream ended, and a scope with no follower left has no
//!   entry (the map holds at most one entry per open follower, never one per tenant ever
//!   seen).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::{Feed, ServiceError, ServiceResult};
use crate::domain::{Event, EventType, FeedCursor, Scope};

/// Events a follower may have waiting for its consumer; one more makes it too slow.
pub const QUEUE: usize = 256;
/// What the events waiting for a consumer may weigh ([`Event::weight`] and the cursor's),
/// at most; one more that does not fit waits for room ([`ROOM_WAIT`]). 256 openings of
/// accounts
/// (some 1.3 KB each with its cursor) fit, so for most feeds the count binds first; 256
/// multi-leg transfers of 16 legs would be some 2 MB, 64 of them fit. Held for each of
/// up to `MAX_EVENT_STREAMS` followers: 128 MiB at most for the default 256.
pub const QUEUE_BYTES: usize = 512 * 1024;
/// How long an event that does not fit in the queue's bytes waits for the consumer to
/// take some before the follower stops: a page of 100 large events (8 KB each) outweighs
/// the queue, so a consumer that keeps reading is paced rather than cut off, and only one
/// that takes nothing for this long (a stalled connection) is too slow.
pub const ROOM_WAIT: Duration = Duration::from_secs(5);
/// Events a follower reads from the feed at a time.
const PAGE: u32 = 100;
/// How often the signal looks at the newest events while someone follows.
const SIGNAL_EVERY: Duration = Duration::from_millis(100);
/// How long a follower waits for the signal before it reads the feed anyway (a signal
/// missed while a deployment did not answer, say).
const READ_AT_LEAST_EVERY: Duration = Duration::from_secs(2);
/// How long a follower waits after a failed read before it reads again.
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// Followers at once unless `MAX_EVENT_STREAMS` says otherwise.
pub const DEFAULT_MAX_FOLLOWERS: usize = 256;

/// What the followers of this process share.
#[derive(Clone)]
pub(super) struct Followers {
    /// Bumped when some deployment's newest event changed.
    signal: Arc<watch::Sender<u64>>,
    /// One permit per follower (`MAX_EVENT_STREAMS`).
    permits: Arc<Semaphore>,
    /// The followers of each scope (`MAX_EVENT_STREAMS_PER_TENANT`).
    shares: Arc<Shares>,
}

impl Followers {
    /// At most `max` followers, `share` of them per scope (both at least 1).
    pub(super) fn new(max: usize, share: usize) -> Followers {
        Followers {
            signal: Arc::new(watch::Sender::new(0)),
            permits: Arc::new(Semaphore::new(max)),
            shares: Arc::new(Shares {
                share: share.max(1),
                held: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// A place for one more follower of `scope`: one of its scope's share first, then one
    /// of the instance's permits. A refusal holds nothing (what was taken is dropped).
    fn place(&self, scope: &Scope) -> Result<Place, FollowerLimit> {
        let share = self.shares.take(scope).ok_or(FollowerLimit::Share)?;
        let permit = self
            .permits
            .clone()
            .try_acquire_owned()
            .map_err(|_| FollowerLimit::Instance)?;
        Ok(Place {
            _share: share,
            _permit: permit,
        })
    }
}

/// Why a follower was refused (503 `too_many_streams` either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FollowerLimit {
    /// Every place of the instance is taken (`MAX_EVENT_STREAMS`).
    Instance,
    /// The caller's scope (its tenant, or the platform) holds its share of them
    /// (`MAX_EVENT_STREAMS_PER_TENANT`); other scopes may still have room.
    Share,
}

/// How many followers each scope has open, at most `share` each. A scope is in `held`
/// only while it has one: the map never holds more entries than there are followers.
struct Shares {
    share: usize,
    held: Mutex<HashMap<Scope, usize>>,
}

impl Shares {
    /// One of `scope`'s places, if it has one left.
    fn take(self: &Arc<Self>, scope: &Scope) -> Option<SharePlace> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let open = held.get(scope).copied().unwrap_or(0);
        if open >= self.share {
            return None;
        }
        held.insert(scope.clone(), open + 1);
        Some(SharePlace {
            shares: self.clone(),
            scope: scope.clone(),
        })
    }

    /// The scopes with a follower open (for tests: the map's size).
    #[cfg(test)]
    fn scopes(&self) -> usize {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// One place of a scope's share, given back when dropped.
struct SharePlace {
    shares: Arc<Shares>,
    scope: Scope,
}

impl Drop for SharePlace {
    fn drop(&mut self) {
        let mut held = self.shares.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(open) = held.get_mut(&self.scope) {
            *open = open.saturating_sub(1);
            if *open == 0 {
                held.remove(&self.scope);
            }
        }
    }
}

/// What a follower holds for its life: its place in its scope's share and its permit,
/// both given back when it is dropped (its stream ended: the client left, a write timed
/// out, its key was revoked, the process stops), on every path alike.
struct Place {
    _share: SharePlace,
    _permit: OwnedSemaphorePermit,
}

/// Why a follower stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FollowEnd {
    /// Its consumer let [`QUEUE`] events wait: too slow to keep up.
    FellBehind,
    /// Its consumer let events of [`QUEUE_BYTES`] wait (fewer than [`QUEUE`], but
    /// large ones) and took none of them for [`ROOM_WAIT`]: too slow to keep up.
    FellBehindInBytes,
    /// The events after its cursor were removed after the retention.
    Expired,
    /// The process is shutting down.
    ShuttingDown,
}

/// A live follower of the feed: its events, each with the cursor right after it
/// ([`Follower::next`]).
pub struct Follower {
    events: mpsc::Receiver<(Event, FeedCursor)>,
    /// What the events waiting in `events` may still weigh: the follower takes their
    /// weight, [`Follower::next`] gives it back.
    room: Arc<Semaphore>,
    /// Why it stopped, once it has (the queue then ends).
    pub ended: Arc<Mutex<Option<FollowEnd>>>,
    /// Held for the follower's life (`MAX_EVENT_STREAMS`, and its scope's share).
    _place: Place,
    /// Counts it in `event_streams_open` while it lives.
    _open: crate::metrics::OpenEventStream,
}

impl Follower {
    /// The next event and the cursor right after it; `None` once the follower has stopped
    /// ([`Follower::ended`] says why) and every event it queued was taken.
    pub async fn next(&mut self) -> Option<(Event, FeedCursor)> {
        let (event, cursor) = self.events.recv().await?;
        self.room.add_permits(weight(&event, &cursor));
        Some((event, cursor))
    }
}

/// What an event and its cursor weigh in a follower's queue: never more than the whole
/// queue, so that an event always fits in an empty one.
fn weight(event: &Event, cursor: &FeedCursor) -> usize {
    (event.weight() + cursor.weight()).min(QUEUE_BYTES)
}

impl Feed {
    /// At most `max` followers at once (`MAX_EVENT_STREAMS`), `share` of them per scope
    /// (`MAX_EVENT_STREAMS_PER_TENANT`: a tenant, or the platform).
    pub fn with_max_followers(self, max: usize, share: usize) -> Feed {
        Feed {
            followers: Followers::new(max, share),
            ..self
        }
    }

    /// Starts following the feed after `after` (from the oldest retained when `None`),
    /// `types` only (all when empty), until the follower is dropped or `shutdown`. The
    /// first page is read before it returns, so that a bad cursor is refused at once.
    pub async fn follow(
        &self,
        scope: Scope,
        after: Option<FeedCursor>,
        types: Vec<EventType>,
        shutdown: CancellationToken,
    ) -> ServiceResult<Follower> {
        let place = self
            .followers
            .place(&scope)
            .map_err(ServiceError::TooManyFollowers)?;
        let first = self.events(&scope, after, PAGE, &types).await?;
        let (queue, events) = mpsc::channel(QUEUE);
        let ended = Arc::new(Mutex::new(None));
        let room = Arc::new(Semaphore::new(QUEUE_BYTES));
        let run = Run {
            feed: self.clone(),
            scope,
            types,
            queue,
            room: room.clone(),
            ended: ended.clone(),
            shutdown,
        };
        tokio::spawn(run.follow_from(first));
        Ok(Follower {
            events,
            room,
            ended,
            _place: place,
            _open: crate::metrics::OpenEventStream::enter(),
        })
    }

    /// The followers' signal: changes when some deployment's feed may have grown (also
    /// for the webhook dispatcher, which follows the feed too).
    pub fn feed_signal(&self) -> watch::Receiver<u64> {
        self.followers.signal.subscribe()
    }

    /// Bumps the followers' signal whenever some deployment's feed may be read further
    /// (its `recordedThrough` moved: a round of the recorder finished), looking every
    /// [`SIGNAL_EVERY`] while anyone follows, until `shutdown`. (It looked at the newest
    /// event before, which a round inserts before it raises the bound: a follower woken
    /// then read nothing and waited [`READ_AT_LEAST_EVERY`] for the next look.)
    pub async fn signal_new_events(&self, shutdown: CancellationToken) {
        let mut seen: Vec<Option<String>> = vec![None; self.deployments.all().len()];
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(SIGNAL_EVERY) => {}
            }
            if self.followers.signal.receiver_count() == 0 {
                continue;
            }
            let mut grew = false;
            for (store, seen) in self.deployments.all().iter().zip(seen.iter_mut()) {
                if store.check_answering().is_err() {
                    continue;
                }
                let Ok(state) = store.events().feed_state().await else {
                    continue;
                };
                if state.recorded_through != *seen {
                    grew = true;
                    *seen = state.recorded_through;
                }
            }
            if grew {
                self.followers
                    .signal
                    .send_modify(|n| *n = n.wrapping_add(1));
            }
        }
    }
}

/// Whether an event found room in the queue's bytes.
enum Room {
    Taken,
    /// The consumer took nothing for [`ROOM_WAIT`].
    TooSlow,
    /// The consumer is gone.
    Gone,
    ShuttingDown,
}

/// One follower's task.
struct Run {
    /// What the follower's caller sees: its events only.
    scope: Scope,
    feed: Feed,
    types: Vec<EventType>,
    queue: mpsc::Sender<(Event, FeedCursor)>,
    /// The queue's room in bytes, shared with the [`Follower`].
    room: Arc<Semaphore>,
    ended: Arc<Mutex<Option<FollowEnd>>>,
    shutdown: CancellationToken,
}

impl Run {
    async fn follow_from(self, mut page: super::FeedPage) {
        let mut signal = self.feed.followers.signal.subscribe();
        let end = loop {
            let full = page.events.len() >= PAGE as usize;
            let next = page.next.clone();
            let mut stopped = None;
            for (event, cursor) in page.events.into_iter().zip(page.cursors) {
                // The weight is taken before the event is queued and given back once it is
                // taken out, so the queue never weighs more than QUEUE_BYTES.
                let weight = weight(&event, &cursor);
                match self.take_room(weight).await {
                    Room::Taken => {}
                    Room::TooSlow => {
                        stopped = Some(FollowEnd::FellBehindInBytes);
                        break;
                    }
                    Room::ShuttingDown => {
                        stopped = Some(FollowEnd::ShuttingDown);
                        break;
                    }
                    Room::Gone => return,
                }
                match self.queue.try_send((event, cursor)) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        self.room.add_permits(weight);
                        stopped = Some(FollowEnd::FellBehind);
                        break;
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => return,
                }
            }
            if let Some(end) = stopped {
                break end;
            }
            if !full {
                tokio::select! {
                    _ = self.shutdown.cancelled() => break FollowEnd::ShuttingDown,
                    _ = self.queue.closed() => return,
                    _ = signal.changed() => {}
                    _ = tokio::time::sleep(READ_AT_LEAST_EVERY) => {}
                }
            }
            page = loop {
                match self
                    .feed
                    .events(&self.scope, Some(next.clone()), PAGE, &self.types)
                    .await
                {
                    Ok(page) => break page,
                    Err(ServiceError::CursorExpired) => {
                        self.stop(FollowEnd::Expired);
                        return;
                    }
                    Err(e) => {
                        tracing::debug!(error = %crate::error_chain::Chain(&e), "a follower's read failed; it reads again");
                        tokio::select! {
                            _ = self.shutdown.cancelled() => {
                                self.stop(FollowEnd::ShuttingDown);
                                return;
                            }
                            _ = self.queue.closed() => return,
                            _ = tokio::time::sleep(RETRY_AFTER) => {}
                        }
                    }
                }
            };
        };
        self.stop(end);
    }

    /// Takes `weight` bytes of the queue's room for an event, waiting for the consumer to
    /// take some for [`ROOM_WAIT`] at most.
    async fn take_room(&self, weight: usize) -> Room {
        // A weight is at most QUEUE_BYTES (512 KiB), which a u32 holds.
        let weight = u32::try_from(weight).unwrap_or(u32::MAX);
        if let Ok(taken) = self.room.try_acquire_many(weight) {
            taken.forget();
            return Room::Taken;
        }
        tokio::select! {
            taken = tokio::time::timeout(ROOM_WAIT, self.room.acquire_many(weight)) => match taken {
                Ok(Ok(taken)) => {
                    taken.forget();
                    Room::Taken
                }
                Ok(Err(_)) | Err(_) => Room::TooSlow,
            },
            () = self.queue.closed() => Room::Gone,
            () = self.shutdown.cancelled() => Room::ShuttingDown,
        }
    }

    /// Says why the follower stopped; dropping the queue's sender then ends its events.
    fn stop(self, end: FollowEnd) {
        *self.ended.lock().unwrap_or_else(|e| e.into_inner()) = Some(end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::TenantName;

    fn tenant(name: &str) -> Scope {
        Scope::Tenant(TenantName::parse(name).unwrap())
    }

    #[test]
    fn a_scope_holds_its_share_at_most_and_its_entry_goes_with_its_last_place() {
        let followers = Followers::new(4, 2);
        let a1 = followers.place(&tenant("acme")).unwrap();
        let a2 = followers.place(&tenant("acme")).unwrap();
        assert_eq!(
            followers.place(&tenant("acme")).err(),
            Some(FollowerLimit::Share)
        );
        let p = followers.place(&Scope::Platform).unwrap();
        let b = followers.place(&tenant("bolt")).unwrap();
        // Four places in all: the fifth is refused by the instance's limit, and the
        // refusal holds no share (cusp has no entry).
        assert_eq!(
            followers.place(&tenant("cusp")).err(),
            Some(FollowerLimit::Instance)
        );
        assert_eq!(followers.shares.scopes(), 3, "acme, the platform, bolt");
        drop(a1);
        assert_eq!(followers.shares.scopes(), 3);
        drop((b, p));
        let a3 = followers.place(&tenant("acme")).unwrap();
        drop((a2, a3));
        assert_eq!(followers.shares.scopes(), 0, "no entry without a follower");
        assert_eq!(followers.permits.available_permits(), 4);
    }

    #[test]
    fn the_map_of_shares_does_not_grow_with_the_tenants_ever_seen() {
        let followers = Followers::new(2, 1);
        for i in 0..10_000 {
            let place = followers.place(&tenant(&format!("t{i}"))).unwrap();
            drop(place);
        }
        assert_eq!(followers.shares.scopes(), 0);
    }
}
