//! Admission control: how many transfers this process works on at once
//! (`MAX_TRANSFERS_IN_FLIGHT`), and how long a request beyond them waits for a place before
//! it is refused (`ADMISSION_WAIT_MS`). [`Admission`] holds the permits;
//! [`Requests::admit`] (a request's way in) and [`Recovery::admit_waiting`]
//! (the sweeper's) take them.
//!
//! Invariants it keeps:
//! - Work in flight is bounded: one permit per transfer worked on (a new one, a cancel, a
//!   capture or void, a recovery), held until its run ends. Each admitted transfer has at
//!   most one write waiting in the group commit, so a batch waits behind at most
//!   `permits / MAX_BATCH` others, milliseconds against a lease of seconds: however many
//!   requests wait here, no admitted step is pushed past its deadline by queueing.
//! - Nothing is inserted before a permit is held: a request that waited and was refused
//!   leaves no trace, so retrying it (here or elsewhere) is always safe.
//! - Waiting is bounded in time (`wait`) and in number. A request waits in the HTTP
//!   handler that serves its connection, and a connection carries one request at a time
//!   (HTTP/1.1; hyper answers pipelined requests one after the other), so at most
//!   `MAX_CONNECTIONS` requests wait, plus the sweeper, which waits for one permit at a
//!   time. A client that hangs up drops its wait, and with it its place in the queue.
//! - Waiting stops when the connections are at their bound. A waiting request holds its
//!   connection; once every place under `MAX_CONNECTIONS` is taken, a client that
//!   multiplexes requests over a pool (a gateway, a frontend server) can only open new
//!   connections, to be refused at the connection level, a TCP connection each time (and
//!   beyond 64 at once, not even answered). So a request waits only while a place is
//!   free ([`Room`], shared by the HTTP layer); at the bound it is refused at once, on
//!   its kept-alive connection, which its client can use again. Clients with one
//!   connection each, however many retry at once, wait as long as they are within the
//!   bound.
//! - First come, first served: tokio's semaphore hands a freed permit to the oldest
//!   waiter, and `try_acquire` does not overtake waiters, so the sweeper's recoveries
//!   queue with new work instead of starving behind it.
//!
//! Why wait at all: a refusal costs the service a request's parsing and answer, and
//! many real clients retry at once, whatever `Retry-After` says. Refused in
//! microseconds, every connection beyond the limit turns into a loop of refusals that
//! takes the CPU from the admitted work (issue 17: at 1,000 connections, 36,000 refusals
//! a second left 28% of the capacity for transfers). A request that waits costs nothing
//! while it waits, and most get a permit within the wait.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{Recovery, Requests, ServiceError, ServiceResult};

/// A permit of admission control, held for as long as a transfer is worked on.
pub(crate) type AdmissionPermit = OwnedSemaphorePermit;

/// Transfers in flight per process unless `MAX_TRANSFERS_IN_FLIGHT` says otherwise.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 512;

/// How long a request waits for a permit unless `ADMISSION_WAIT_MS` says otherwise.
///
/// Long enough that a burst within `MAX_CONNECTIONS` (1,024 by default) is queued rather
/// than refused: at the ~1,500 transfers a second of a small machine, the last of 1,024
/// waiters gets its permit in about 0.7 s. Short against the time-outs of clients and
/// of this service's own requests (30 s), so that overload is still answered, with a
/// 503 the client can act on, in about a second.
pub const DEFAULT_ADMISSION_WAIT: Duration = Duration::from_millis(1000);

/// The connection places the HTTP layer has left: a request waits only while one is
/// free.
#[derive(Clone)]
pub(crate) struct Room {
    /// One permit per connection that may still be served (`MAX_CONNECTIONS` in all).
    pub(crate) places: Arc<Semaphore>,
}

/// The permits, and how long a request may wait for one.
#[derive(Clone)]
pub(crate) struct Admission {
    /// One permit per transfer worked on; never closed.
    permits: Arc<Semaphore>,
    /// How long a request waits for a permit before it is refused; zero refuses at once.
    wait: Duration,
    /// The connection places, when the HTTP layer shares them; without, a request
    /// always may wait.
    room: Option<Room>,
}

impl Admission {
    pub(crate) fn new(limit: usize, wait: Duration) -> Admission {
        Admission {
            permits: Arc::new(Semaphore::new(limit.max(1))),
            wait,
            room: None,
        }
    }

    /// `limit` permits instead, the rest unchanged.
    pub(crate) fn limited(self, limit: usize) -> Admission {
        Admission {
            permits: Arc::new(Semaphore::new(limit.max(1))),
            ..self
        }
    }

    /// The same permits, with requests waiting `wait` for one.
    pub(crate) fn waiting(self, wait: Duration) -> Admission {
        Admission { wait, ..self }
    }

    /// The same permits, with requests waiting only while `room` has places left.
    pub(crate) fn within(self, room: Room) -> Admission {
        Admission {
            room: Some(room),
            ..self
        }
    }

    /// A permit now, if one is free and nobody waits for it.
    pub(crate) fn now(&self) -> Option<AdmissionPermit> {
        self.permits.clone().try_acquire_owned().ok()
    }

    /// A permit within the request's wait, in turn behind those waiting already; `None`
    /// when the wait ran out first, or at once when every connection place is taken.
    pub(crate) async fn within_wait(&self) -> Option<AdmissionPermit> {
        let at_the_bound = self
            .room
            .as_ref()
            .is_some_and(|room| room.places.available_permits() == 0);
        if self.wait.is_zero() || at_the_bound {
            return None;
        }
        let permit = self.permits.clone().acquire_owned();
        match tokio::time::timeout(self.wait, permit).await {
            Ok(permit) => Some(permit.expect("the admission semaphore is never closed")),
            Err(_) => None,
        }
    }

    /// A permit, however long it takes: the sweeper's way in, so that recoveries queue
    /// with new work instead of being refused.
    pub(crate) async fn unbounded(&self) -> AdmissionPermit {
        self.permits
            .clone()
            .acquire_owned()
            .await
            .expect("the admission semaphore is never closed")
    }

    /// Whether every permit is taken.
    pub(crate) fn is_full(&self) -> bool {
        self.permits.available_permits() == 0
    }
}

impl Requests {
    /// A permit to work on one more transfer: at once, or within the admission wait,
    /// else [`ServiceError::Overloaded`]. Called before anything is inserted.
    pub(super) async fn admit(&self) -> ServiceResult<AdmissionPermit> {
        if let Some(permit) = self.admission.now() {
            return Ok(permit);
        }
        failpoint!(self, WaitingForAdmission);
        self.admission
            .within_wait()
            .await
            .ok_or(ServiceError::Overloaded)
    }
}

impl Recovery {
    /// A permit, waiting for one as long as it takes: the sweeper's way in, so that
    /// recoveries queue with new work (first come, first served) instead of being refused.
    pub(crate) async fn admit_waiting(&self) -> AdmissionPermit {
        self.admission.unbounded().await
    }
}

impl Requests {
    /// Whether every permit is taken: `/ready` then says so.
    pub fn is_overloaded(&self) -> bool {
        self.admission.is_full()
    }
}
