//! This instance's places for attempts: [`MAX_SENDING`] in flight at once in all,
//! [`PER_ENDPOINT`] to one endpoint, and [`CLAIMED_AHEAD`] deliveries of one endpoint
//! held claimed (waiting for their turn or in flight).
//!
//! A delivery's place among the claimed is taken before it is claimed or started
//! ([`Slots::reserve`]) and given back when its attempt ends ([`Slots::release`]) or
//! when no attempt took it ([`Slots::unreserve`]); its endpoint's entry is dropped when
//! it holds none, so memory follows what is held, not every endpoint ever sent to.
//! An attempt waits for its endpoint's place first, then for one of the instance's
//! ([`Slots::places`]): one waiting for a slow endpoint holds none of the places the
//! other endpoints need.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{CLAIMED_AHEAD, MAX_SENDING, PER_ENDPOINT};

/// This instance's places.
pub struct Slots {
    /// One permit per attempt in flight on this instance ([`MAX_SENDING`]).
    sending: Arc<Semaphore>,
    /// Per endpoint (by webhook id): its attempts in flight, and how many of its
    /// deliveries this instance holds claimed.
    endpoints: Mutex<HashMap<String, Endpoint>>,
}

/// What this instance holds of one endpoint's deliveries.
struct Endpoint {
    /// One permit per attempt in flight to it ([`PER_ENDPOINT`]).
    in_flight: Arc<Semaphore>,
    /// Its deliveries held claimed, waiting or in flight ([`CLAIMED_AHEAD`] at most).
    claimed: usize,
}

impl Endpoint {
    fn new() -> Endpoint {
        Endpoint {
            in_flight: Arc::new(Semaphore::new(PER_ENDPOINT)),
            claimed: 0,
        }
    }
}

impl Default for Slots {
    fn default() -> Slots {
        Slots {
            sending: Arc::new(Semaphore::new(MAX_SENDING)),
            endpoints: Mutex::default(),
        }
    }
}

impl Slots {
    fn endpoints(&self) -> std::sync::MutexGuard<'_, HashMap<String, Endpoint>> {
        self.endpoints.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many deliveries this instance holds claimed, of every endpoint.
    pub fn held(&self) -> usize {
        self.endpoints().values().map(|e| e.claimed).sum()
    }

    /// How many more of `hook`'s deliveries this instance may hold claimed.
    pub fn free(&self, hook: &str) -> usize {
        CLAIMED_AHEAD.saturating_sub(self.endpoints().get(hook).map_or(0, |e| e.claimed))
    }

    /// Takes up to `wanted` of the places of `hook`'s claimed deliveries; how many it
    /// took. Each is given back by [`Slots::release`] when its attempt ends, or by
    /// [`Slots::unreserve`] if none took it.
    pub fn reserve(&self, hook: &str, wanted: usize) -> usize {
        let mut held = self.endpoints();
        let endpoint = held.entry(hook.to_owned()).or_insert_with(Endpoint::new);
        let taken = wanted.min(CLAIMED_AHEAD.saturating_sub(endpoint.claimed));
        endpoint.claimed += taken;
        if endpoint.claimed == 0 {
            held.remove(hook);
        }
        taken
    }

    /// Gives back `n` places of `hook` that no attempt took.
    pub fn unreserve(&self, hook: &str, n: usize) {
        for _ in 0..n {
            self.release(hook);
        }
    }

    /// One claimed delivery of `hook` is over here (its attempt ended).
    pub fn release(&self, hook: &str) {
        let mut held = self.endpoints();
        if let Some(endpoint) = held.get_mut(hook) {
            endpoint.claimed = endpoint.claimed.saturating_sub(1);
            if endpoint.claimed == 0 {
                held.remove(hook);
            }
        }
    }

    /// Waits for the places of an attempt to `hook`, whose place among the claimed is
    /// taken ([`Slots::reserve`]): its endpoint's first, then one of the instance's.
    /// `None` if the semaphores are closed (never, while the slots live).
    pub async fn places(&self, hook: &str) -> Option<(OwnedSemaphorePermit, OwnedSemaphorePermit)> {
        let in_flight = {
            // Its place is taken, so its endpoint is held; if not, it is made.
            self.endpoints()
                .entry(hook.to_owned())
                .or_insert_with(Endpoint::new)
                .in_flight
                .clone()
        };
        let place = in_flight.acquire_owned().await.ok()?;
        let permit = self.sending.clone().acquire_owned().await.ok()?;
        Some((place, permit))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each endpoint holds at most its share of claimed deliveries, asked for more or
    /// not; what is given back is free again; and an endpoint that holds none is
    /// forgotten (what the instance keeps follows what it holds).
    #[test]
    fn an_endpoint_holds_at_most_its_share_and_is_forgotten_when_it_holds_none() {
        let slots = Slots::default();
        assert_eq!(slots.reserve("a", CLAIMED_AHEAD + 10), CLAIMED_AHEAD);
        assert_eq!(slots.reserve("a", 1), 0, "full");
        assert_eq!(slots.free("a"), 0);
        assert_eq!(slots.reserve("b", 3), 3);
        assert_eq!(slots.held(), CLAIMED_AHEAD + 3);
        slots.release("a");
        assert_eq!(slots.free("a"), 1);
        assert_eq!(slots.reserve("a", 5), 1);
        slots.unreserve("b", 3);
        assert_eq!(slots.held(), CLAIMED_AHEAD);
        assert!(!slots.endpoints().contains_key("b"), "b holds none");
        slots.unreserve("a", CLAIMED_AHEAD);
        assert_eq!(slots.held(), 0);
        assert!(slots.endpoints().is_empty());
        // Giving back what is not held changes nothing.
        slots.release("c");
        assert_eq!(slots.reserve("c", 0), 0);
        assert!(slots.endpoints().is_empty());
    }

    /// One endpoint has at most [`PER_ENDPOINT`] attempts in flight, and a slow one
    /// waiting for its own places takes none of the instance's from the others.
    #[tokio::test]
    async fn an_endpoint_has_at_most_its_attempts_in_flight_and_waits_without_holding_others_places()
     {
        // Unconstrained: tokio's cooperative budget would answer "not yet" after many
        // acquisitions in one poll, which says nothing of the places.
        tokio::task::unconstrained(async {
            let slots = Slots::default();
            let mut slow = Vec::new();
            for _ in 0..PER_ENDPOINT {
                slow.push(slots.places("slow").await.unwrap());
            }
            let waiting = slots.places("slow");
            tokio::pin!(waiting);
            assert!(
                futures::poll!(waiting.as_mut()).is_pending(),
                "a place more than its share"
            );
            assert_eq!(
                slots.sending.available_permits(),
                MAX_SENDING - PER_ENDPOINT
            );
            let mut others = Vec::new();
            for i in 0..(MAX_SENDING - PER_ENDPOINT) {
                others.push(slots.places(&format!("e{i}")).await.unwrap());
            }
            assert_eq!(slots.sending.available_permits(), 0);
            // One of its endpoint's places is free, none of the instance's: still waiting.
            let (place, _kept) = slow.pop().unwrap();
            drop(place);
            assert!(futures::poll!(waiting.as_mut()).is_pending());
            drop(others.pop());
            assert!(futures::poll!(waiting.as_mut()).is_ready());
        })
        .await;
    }
}
