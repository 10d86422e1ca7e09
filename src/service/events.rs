//! The event feed (`docs/events.md`): each deployment's events after the reader's
//! position there, merged into one page, and the cursor that resumes after it.
//!
//! Exactly once: a deployment's events are read in its feed order, and the cursor moves
//! a deployment's position only to the last of its events the page returns. A deployment
//! that does not answer is left out of the page, its position kept, so its events appear
//! once it is back. A reader whose position is below what the retention removed may have
//! missed an event: refused, with [`ServiceError::CursorExpired`], never served a gap.

use super::{ServiceError, ServiceResult, TransferService};
use crate::domain::{Event, EventType, FeedCursor, Position, Scope, TenantName};
use crate::store::Store;

/// A page of the feed and the cursor after it.
#[derive(Debug)]
pub struct FeedPage {
    /// Oldest first by the time of their changes; within a deployment, in its feed order.
    pub events: Vec<Event>,
    /// The cursor right after each event (a stream's event id), one per event.
    pub cursors: Vec<FeedCursor>,
    /// Where the next page starts: every deployment's position after this page.
    pub next: FeedCursor,
}

impl TransferService {
    /// Up to `limit` events after `after` (from the oldest retained when `None`), of
    /// `types` (every type when empty), that `scope` sees (`docs/tenants.md`: a tenant's
    /// read walks its own events only).
    pub async fn events(
        &self,
        scope: &Scope,
        after: Option<FeedCursor>,
        limit: u32,
        types: &[EventType],
    ) -> ServiceResult<FeedPage> {
        let mut next = after.unwrap_or_default();
        let mut feeds: Vec<Feed> = Vec::new();
        for store in self.deployments.all() {
            if store.check_answering().is_err() {
                continue;
            }
            match read_one(store, &mut next, limit, types, scope.tenant()).await {
                Ok(feed) => feeds.push(feed),
                Err(ServiceError::Unavailable(e)) => {
                    tracing::warn!(deployment = %store.deployment(), error = %crate::error_chain::Chain(&e), "events of this deployment left out of the page; they come once it answers");
                }
                Err(e) => return Err(e),
            }
        }
        let found = merged(&mut feeds, limit as usize);
        let mut cursors = Vec::with_capacity(found.len());
        for event in &found {
            next.positions
                .insert(event.deployment.clone(), event.position.clone());
            cursors.push(next.clone());
        }
        // A filtered read that returned every match of a deployment (all of them kept in
        // the page) has passed everything up to that deployment's newest event.
        for feed in feeds {
            if let (true, Some(passed)) = (feed.events.is_empty(), feed.passed) {
                let position = next
                    .positions
                    .entry(feed.deployment)
                    .or_insert(passed.clone());
                if *position < passed {
                    *position = passed;
                }
            }
        }
        Ok(FeedPage {
            events: found,
            cursors,
            next,
        })
    }
}

/// What one deployment's read gave.
struct Feed {
    deployment: crate::domain::DeploymentName,
    /// Its events, in its feed's order; those the page did not take stay here.
    events: std::collections::VecDeque<Event>,
    /// With a type or tenant filter and fewer matches than the limit: the last event the
    /// read looked at; every match up to it is in `events`.
    passed: Option<Position>,
}

/// The first `limit` events of the deployments' `feeds`, each in its own order, merged by
/// time (then deployment): a deployment's events are never reordered among themselves,
/// whatever their times say. What is not taken stays in `feeds`.
fn merged(feeds: &mut [Feed], limit: usize) -> Vec<Event> {
    let mut out = Vec::new();
    while out.len() < limit {
        let next = feeds
            .iter_mut()
            .filter(|f| !f.events.is_empty())
            .min_by(|a, b| (a.events[0].at, &a.deployment).cmp(&(b.events[0].at, &b.deployment)));
        match next.and_then(|f| f.events.pop_front()) {
            Some(event) => out.push(event),
            None => break,
        }
    }
    out
}

/// Up to `limit` of `store`'s events after the cursor's position there. With no
/// position (a new reader, or a deployment the cursor does not know yet), from the oldest
/// retained. The cursor then holds a position for the deployment in every case (the
/// front of the feed, or [`Position::start`] when nothing was ever removed), so that a
/// removal after this read is noticed by the next one.
async fn read_one(
    store: &Store,
    cursor: &mut FeedCursor,
    limit: u32,
    types: &[EventType],
    tenant: Option<&TenantName>,
) -> ServiceResult<Feed> {
    let deployment = store.deployment().clone();
    let given = cursor.positions.get(&deployment).cloned();
    // Read before the events: how far they were trimmed, and how far they may be read.
    let state = store.feed_state().await?;
    let trimmed = state.trimmed_through;
    let mut after = match given.clone() {
        Some(p) if trimmed.as_ref().is_some_and(|t| p < *t) => {
            return Err(ServiceError::CursorExpired);
        }
        Some(p) => p,
        None => trimmed.unwrap_or_else(Position::start),
    };
    loop {
        let page = store
            .read_feed(
                Some(&after),
                limit,
                types,
                tenant,
                state.recorded_through.clone(),
            )
            .await?;
        // Read after the events: a removal that took some of them raised it first.
        match page.trimmed_through {
            Some(t) if after < t => {
                if given.is_some() {
                    return Err(ServiceError::CursorExpired);
                }
                // A reader starting from the front raced a removal: it starts from the
                // new front, what it would have been given a moment later.
                after = t;
            }
            _ => {
                let all_matches = page.events.len() < limit as usize;
                cursor.positions.insert(deployment.clone(), after);
                return Ok(Feed {
                    deployment,
                    passed: page
                        .examined
                        .filter(|_| all_matches && (!types.is_empty() || tenant.is_some())),
                    events: page.events.into(),
                });
            }
        }
    }
}
