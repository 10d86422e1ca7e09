//! The event feed (`docs/events.md`): each deployment's events after the reader's
//! position there, merged into one page, and the cursor that resumes after it.
//!
//! Exactly once: a deployment's events are read in its feed order, and the cursor moves
//! a deployment's position only to the last of its events the page returns. A deployment
//! that does not answer is left out of the page, its position kept, so its events appear
//! once it is back. A reader whose position is below what the retention removed may have
//! missed an event: refused, with [`ServiceError::CursorExpired`], never served a gap.
//!
//! A cursor carries no event the reader does not see (`docs/tenants.md`): a position
//! moves only to an event of the page, to the last event a filtered read of the
//! reader's own looked at, or, for a reader without one, to a start that names no event
//! ([`Events::reader_start`]), never to the front of the feed, which is the last event
//! removed, whoever's it was.

use super::{Feed, ServiceError, ServiceResult};
use crate::domain::{
    DeploymentName, Event, EventType, FeedCursor, ParseError, Position, Scope, TenantName,
};
use crate::store::Store;
use crate::store::events::Start;

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

impl Feed {
    /// A cursor a client sent, read for the deployments this instance serves (see
    /// [`FeedCursor::parse_for`]): refused unless this service could have given it, and
    /// bounded by those deployments whatever was sent.
    pub fn client_cursor(&self, raw: &str) -> Result<FeedCursor, ParseError> {
        let served: Vec<DeploymentName> = self
            .deployments
            .all()
            .iter()
            .map(|s| s.deployment().clone())
            .collect();
        FeedCursor::parse_for(raw, &served)
    }

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
        let mut feeds: Vec<DeploymentRead> = Vec::new();
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
struct DeploymentRead {
    deployment: crate::domain::DeploymentName,
    /// Its events, in its feed's order; those the page did not take stay here.
    events: std::collections::VecDeque<Event>,
    /// With a type or tenant filter and fewer matches than the limit: the last event the
    /// read looked at; every match up to it is in `events`.
    passed: Option<Position>,
    /// A tenant's read that started at the front of the feed, another's event as often
    /// as not ([`Start::AtFront`]): the cursor gets no position for the deployment until
    /// the page takes one of its events (the tenant's own), and the merge keeps a place
    /// for the first. If it takes none (more such deployments than the limit, or the
    /// tenant's events there not readable yet), the deployment is left out of the
    /// cursor, as one that did not answer is, and the next read starts at the front
    /// again.
    owes_first: bool,
}

/// The first `limit` events of the deployments' `feeds`, each in its own order, merged by
/// time (then deployment): a deployment's events are never reordered among themselves,
/// whatever their times say. The feeds that owe their first event get a place kept for
/// it (as many as the limit allows). What is not taken stays in `feeds`.
fn merged(feeds: &mut [DeploymentRead], limit: usize) -> Vec<Event> {
    let mut out = Vec::new();
    while out.len() < limit {
        let owed = feeds
            .iter()
            .filter(|f| f.owes_first && !f.events.is_empty())
            .count();
        let only_owed = owed > 0 && limit - out.len() <= owed;
        let next = feeds
            .iter_mut()
            .filter(|f| !f.events.is_empty() && (f.owes_first || !only_owed))
            .min_by(|a, b| (a.events[0].at, &a.deployment).cmp(&(b.events[0].at, &b.deployment)));
        let Some(feed) = next else {
            break;
        };
        match feed.events.pop_front() {
            Some(event) => {
                feed.owes_first = false;
                out.push(event);
            }
            None => break,
        }
    }
    out
}

/// Up to `limit` of `store`'s events after the cursor's position there. With no
/// position (a new reader, or a deployment the cursor does not know yet), from the front
/// of the feed, at a start that names no event ([`Events::reader_start`]). The cursor then
/// holds a position for the deployment (that start, if the page takes none of its
/// events), so that a removal after this read is noticed by the next one; except for a
/// tenant that starts at a front an older version left inside a cluster time
/// ([`DeploymentRead::owes_first`]).
async fn read_one(
    store: &Store,
    cursor: &mut FeedCursor,
    limit: u32,
    types: &[EventType],
    tenant: Option<&TenantName>,
) -> ServiceResult<DeploymentRead> {
    let deployment = store.deployment().clone();
    let given = cursor.positions.get(&deployment).cloned();
    // Read before the events: how far they were trimmed, and how far they may be read.
    let state = store.events().feed_state().await?;
    let trimmed = state.trimmed_through;
    let mut start = match given.clone() {
        Some(p) if trimmed.as_ref().is_some_and(|t| p < *t) => {
            return Err(ServiceError::CursorExpired);
        }
        Some(p) => Start::Clear(p),
        None => store.events().reader_start(trimmed, tenant).await?,
    };
    loop {
        let (after, owes_first) = match &start {
            Start::Clear(p) => (p.clone(), false),
            // The platform sees every event: the front is no other's to it.
            Start::AtFront(p) => (p.clone(), tenant.is_some()),
        };
        let page = store
            .events()
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
                start = store.events().reader_start(Some(t), tenant).await?;
            }
            _ => {
                let all_matches = page.events.len() < limit as usize;
                if !owes_first {
                    cursor.positions.insert(deployment.clone(), after);
                }
                return Ok(DeploymentRead {
                    deployment,
                    passed: page
                        .examined
                        .filter(|_| all_matches && (!types.is_empty() || tenant.is_some())),
                    events: page.events.into(),
                    owes_first,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Account, AccountId, Currency, EventData};

    fn event(deployment: &DeploymentName, second: i64, id: &str) -> Event {
        let at = chrono::DateTime::from_timestamp(second, 0).unwrap();
        let account = Account {
            id: AccountId::parse(id).unwrap(),
            deployment: deployment.clone(),
            tenant: None,
            name: None,
            balance: 0,
            pending_debits: 0,
            pending_credits: 0,
            incoming: 0,
            currency: Currency::parse("EUR").unwrap(),
            pending_transactions: Vec::new(),
            fenced_transactions: Vec::new(),
            seq: 1,
            created_at: at,
            updated_at: at,
        };
        Event {
            id: format!("account.opened:{id}"),
            kind: EventType::AccountOpened,
            at,
            data: EventData::Account(account),
            deployment: deployment.clone(),
            position: Position {
                seconds: u32::try_from(second).unwrap(),
                increment: 1,
                id: format!("account.opened:{id}"),
            },
        }
    }

    /// Feeds named `a`, `b`, `c`...: each its events at the seconds given, and whether it
    /// owes its first.
    fn feeds(spec: &[(&[i64], bool)]) -> Vec<DeploymentRead> {
        spec.iter()
            .enumerate()
            .map(|(i, (seconds, owes_first))| {
                let name = ["a", "b", "c"][i];
                let deployment = DeploymentName::parse(name).unwrap();
                DeploymentRead {
                    events: seconds
                        .iter()
                        .map(|s| event(&deployment, *s, &format!("{name}{s}")))
                        .collect(),
                    deployment,
                    passed: None,
                    owes_first: *owes_first,
                }
            })
            .collect()
    }

    fn ids(events: &[Event]) -> Vec<&str> {
        events.iter().map(|e| e.id.as_str()).collect()
    }

    #[test]
    fn the_merge_keeps_a_place_for_a_first_event_owed_and_is_by_time_otherwise() {
        // Room for everything: by time, the owed event in its place.
        let mut all = feeds(&[(&[1, 2, 3], false), (&[5], true)]);
        let page = merged(&mut all, 10);
        assert_eq!(
            ids(&page),
            [
                "account.opened:a1",
                "account.opened:a2",
                "account.opened:a3",
                "account.opened:b5"
            ]
        );
        assert!(!all[1].owes_first);
        // Short: the owed event takes the last place, before later ones of others.
        let mut short = feeds(&[(&[1, 2, 3], false), (&[5], true)]);
        let page = merged(&mut short, 2);
        assert_eq!(ids(&page), ["account.opened:a1", "account.opened:b5"]);
        assert!(!short[1].owes_first);
        // More owed than places: the earliest owed first, the other still owed.
        let mut more = feeds(&[(&[1], false), (&[7], true), (&[6], true)]);
        let page = merged(&mut more, 1);
        assert_eq!(ids(&page), ["account.opened:c6"]);
        assert!(more[1].owes_first && !more[2].owes_first);
        // Owed but nothing read: nothing kept for it.
        let mut empty = feeds(&[(&[1, 2], false), (&[], true)]);
        let page = merged(&mut empty, 2);
        assert_eq!(ids(&page), ["account.opened:a1", "account.opened:a2"]);
        assert!(empty[1].owes_first);
    }
}
