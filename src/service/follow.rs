//! Following the event feed live (`GET /events/stream`): a follower reads the feed with
//! its own cursor, exactly as a reader of `GET /events` would, and waits for a signal that
//! some deployment's feed grew instead of polling on its own.
//!
//! - One task per instance ([`TransferService::signal_new_events`]) looks at the newest
//!   event of each deployment a few times a second, and only while someone follows.
//! - Each follower hands its events to a bounded queue ([`QUEUE`]). A consumer that lets
//!   the queue fill is too slow: its follower stops ([`FollowEnd::FellBehind`]); the
//!   consumer reconnects with its last event id and reads on from the feed, so nothing is
//!   lost and the process never holds more than the queue for it.
//! - At most `MAX_EVENT_STREAMS` followers at once, each holding a permit for its life.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::{ServiceError, ServiceResult, TransferService};
use crate::domain::{Event, EventType, FeedCursor, Scope};

/// Events a follower may have waiting for its consumer; one more makes it too slow.
pub const QUEUE: usize = 256;
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
}

impl Followers {
    pub(super) fn new(max: usize) -> Followers {
        Followers {
            signal: Arc::new(watch::Sender::new(0)),
            permits: Arc::new(Semaphore::new(max)),
        }
    }
}

/// Why a follower stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FollowEnd {
    /// Its consumer let [`QUEUE`] events wait: too slow to keep up.
    FellBehind,
    /// The events after its cursor were removed after the retention.
    Expired,
    /// The process is shutting down.
    ShuttingDown,
}

/// A live follower of the feed: its events, each with the cursor right after it.
pub struct Follower {
    pub events: mpsc::Receiver<(Event, FeedCursor)>,
    /// Why it stopped, once it has (the queue then ends).
    pub ended: Arc<Mutex<Option<FollowEnd>>>,
    /// Held for the follower's life (`MAX_EVENT_STREAMS`).
    _permit: OwnedSemaphorePermit,
    /// Counts it in `event_streams_open` while it lives.
    _open: crate::metrics::OpenEventStream,
}

impl TransferService {
    /// At most `max` followers at once (`MAX_EVENT_STREAMS`).
    pub fn with_max_followers(self, max: usize) -> TransferService {
        TransferService {
            followers: Followers::new(max),
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
        let permit = self
            .followers
            .permits
            .clone()
            .try_acquire_owned()
            .map_err(|_| ServiceError::TooManyFollowers)?;
        let first = self.events(&scope, after, PAGE, &types).await?;
        let (queue, events) = mpsc::channel(QUEUE);
        let ended = Arc::new(Mutex::new(None));
        let run = Run {
            service: self.clone(),
            scope,
            types,
            queue,
            ended: ended.clone(),
            shutdown,
        };
        tokio::spawn(run.follow_from(first));
        Ok(Follower {
            events,
            ended,
            _permit: permit,
            _open: crate::metrics::OpenEventStream::enter(),
        })
    }

    /// The followers' signal: changes when some deployment's feed may have grown (also
    /// for the webhook dispatcher, which follows the feed too).
    pub fn feed_signal(&self) -> watch::Receiver<u64> {
        self.followers.signal.subscribe()
    }

    /// Bumps the followers' signal whenever some deployment's newest event changes,
    /// looking every [`SIGNAL_EVERY`] while anyone follows, until `shutdown`.
    pub async fn signal_new_events(&self, shutdown: CancellationToken) {
        // Where each deployment's watch starts: a few seconds before the first look, not
        // the front of the feed, whose whole length SecantusDB would read to find the
        // newest (a late event below it is still read within [`READ_AT_LEAST_EVERY`]).
        let mut newest: Vec<Option<crate::domain::Position>> =
            vec![None; self.deployments.all().len()];
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(SIGNAL_EVERY) => {}
            }
            if self.followers.signal.receiver_count() == 0 {
                continue;
            }
            let mut grew = false;
            for (store, seen) in self.deployments.all().iter().zip(newest.iter_mut()) {
                if store.check_answering().is_err() {
                    continue;
                }
                let Some(from) = seen else {
                    if let Ok(now) = store.cluster_time().await {
                        *seen = Some(crate::domain::Position {
                            seconds: now.map_or(0, |t| t.time.saturating_sub(5)),
                            increment: 0,
                            id: String::new(),
                        });
                    }
                    continue;
                };
                if let Ok(Some(now)) = store.newest_event_after(from).await {
                    grew = true;
                    *seen = Some(now);
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

/// One follower's task.
struct Run {
    /// What the follower's caller sees: its events only.
    scope: Scope,
    service: TransferService,
    types: Vec<EventType>,
    queue: mpsc::Sender<(Event, FeedCursor)>,
    ended: Arc<Mutex<Option<FollowEnd>>>,
    shutdown: CancellationToken,
}

impl Run {
    async fn follow_from(self, mut page: super::FeedPage) {
        let mut signal = self.service.followers.signal.subscribe();
        let end = loop {
            let full = page.events.len() >= PAGE as usize;
            let next = page.next.clone();
            let mut behind = false;
            for (event, cursor) in page.events.into_iter().zip(page.cursors) {
                match self.queue.try_send((event, cursor)) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        behind = true;
                        break;
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => return,
                }
            }
            if behind {
                break FollowEnd::FellBehind;
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
                    .service
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

    /// Says why the follower stopped; dropping the queue's sender then ends its events.
    fn stop(self, end: FollowEnd) {
        *self.ended.lock().unwrap_or_else(|e| e.into_inner()) = Some(end);
    }
}
