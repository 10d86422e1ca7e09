//! The dispatcher: one instance at a time, under the dispatcher's lease
//! ([`crate::lease`]), follows the event feed from a cursor kept in the database and,
//! page by page, makes a delivery of each event to each webhook that wants it
//! ([`super::pages`]), sending first what its instance has room for
//! ([`super::firsts`]).
//!
//! Exactly one delivery per event and endpoint: a page dispatched again (after a crash,
//! or by the next holder after a takeover) is refused by the deliveries' ids, which the
//! insert and the read of those made already both check. The cursor is saved after the
//! page, guarded by the lease's owner: a holder that lost the lease saves nothing, and
//! the next one starts from the last page saved. Who may act between a page's read and
//! its writes: the next holder (the same deliveries, refused by their ids), a deletion
//! of a webhook (its deliveries removed after the page: [`Dispatching::dispatch_page`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::domain::{Event, FeedCursor, Scope, Webhook};
use crate::error_chain::Chain;
use crate::lease::{DispatcherLease, Lease, Task};
use crate::service::{Feed, FeedPage, ServiceError, WebhookBook};
use crate::store::Store;
use crate::store::webhooks::{NewDelivery, claim_token};

use super::firsts::send_first;
use super::handover::{First, Told};
use super::pages::{COMMAND_BYTES, batch, fan_out, ids_of, page_limit, pairs, wants};
use super::sender::Sending;
use super::{CLAIM_LEASE, Render};

/// How long the dispatcher waits for new events before it reads anyway.
const DISPATCH_IDLE: std::time::Duration = std::time::Duration::from_millis(250);

/// The dispatcher's task: takes the lease when free, dispatches while it holds it.
///
/// `feed` is read for its pages and its signal; `webhooks` gives where webhooks and
/// deliveries live, and how long a delivery is tried.
pub async fn run(
    feed: Feed,
    webhooks: WebhookBook,
    owner: String,
    render: Render,
    sending: Arc<Sending>,
    made: Arc<tokio::sync::Notify>,
    shutdown: CancellationToken,
) {
    let store = webhooks.store().clone();
    let mut lease = Lease::new(DispatcherLease(store.clone()), owner);
    let mut dispatcher = Dispatcher {
        feed,
        give_up_after: webhooks.webhook_settings().give_up_after,
        store,
        render,
        sending,
        made,
        shutdown: shutdown.clone(),
    };
    lease.hold(&shutdown, &mut dispatcher).await;
}

/// The dispatcher of this instance, while it holds the lease.
struct Dispatcher {
    /// The feed: its pages and its signal.
    feed: Feed,
    /// How long a delivery is tried (`WEBHOOK_GIVE_UP_AFTER_MS`).
    give_up_after: std::time::Duration,
    /// Where webhooks and deliveries live (the first deployment).
    store: Store,
    render: Render,
    sending: Arc<Sending>,
    /// Told when deliveries were made unclaimed, for this instance's sender.
    made: Arc<tokio::sync::Notify>,
    shutdown: CancellationToken,
}

impl Task<DispatcherLease> for Dispatcher {
    type Error = ServiceError;

    async fn work(
        &mut self,
        lease: &mut Lease<DispatcherLease>,
        cursor: Option<String>,
    ) -> Result<(), ServiceError> {
        self.dispatch(lease, cursor).await
    }

    fn failed(&self, e: &ServiceError) {
        tracing::warn!(error = %Chain(e), "webhook deliveries not dispatched; tried again");
    }
}

impl Dispatcher {
    /// Dispatches from `saved` until the lease is lost, a call fails, or shutdown.
    async fn dispatch(
        &self,
        lease: &mut Lease<DispatcherLease>,
        saved: Option<String>,
    ) -> Result<(), ServiceError> {
        let (store, shutdown) = (&self.store, &self.shutdown);
        let mut cursor = saved.as_deref().and_then(|c| FeedCursor::parse(c).ok());
        let mut signal = self.feed.feed_signal();
        let give_up_after =
            chrono::TimeDelta::from_std(self.give_up_after).unwrap_or(chrono::TimeDelta::MAX);
        // How many deliveries one event made at most for the webhooks the last page saw
        // (`fan_out`): the next page's events are as many as `PAGE_PAIRS` allows for
        // that many (the first page reads the list first).
        let mut hooks_seen = fan_out(&store.webhooks().webhooks_all().await?);
        loop {
            if shutdown.is_cancelled() {
                // The lease is given up by [`Lease::hold`].
                return Ok(());
            }
            if !lease.renew_if_due().await? {
                return Ok(());
            }
            let limit = page_limit(hooks_seen);
            let Some(page) = self.read(&mut cursor, limit).await? else {
                continue;
            };
            if !page.events.is_empty() {
                match self
                    .dispatch_page(&page.events, give_up_after, lease)
                    .await?
                {
                    Some(hooks) => hooks_seen = hooks,
                    None => return Ok(()),
                }
            }
            let full = page.events.len() >= limit as usize;
            if cursor.as_ref() != Some(&page.next) {
                if !store
                    .webhooks()
                    .save_dispatcher_cursor(lease.owner(), &page.next.encode())
                    .await?
                {
                    return Ok(());
                }
                cursor = Some(page.next);
            }
            if !full {
                // On shutdown, round the loop: its top ends the work and the lease is
                // given up, so that another instance goes on at once rather than when
                // the lease runs out.
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = signal.changed() => {}
                    _ = tokio::time::sleep(DISPATCH_IDLE) => {}
                }
            }
        }
    }

    /// The next page of up to `limit` events after `cursor`; none when the events after
    /// it are gone (removed after the retention): `cursor` is then the front, and what is
    /// kept is dispatched from there (deliveries already made are refused by their ids).
    async fn read(
        &self,
        cursor: &mut Option<FeedCursor>,
        limit: u32,
    ) -> Result<Option<FeedPage>, ServiceError> {
        let read = self
            .feed
            .events(&Scope::Platform, cursor.clone(), limit, &[]);
        match read.await {
            Ok(page) => Ok(Some(page)),
            Err(ServiceError::CursorExpired) => {
                tracing::error!(
                    "webhook dispatch fell behind the event retention; events were removed before they were dispatched"
                );
                *cursor = None;
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Makes a delivery of each of `events` to each webhook that wants it, batch by
    /// batch ([`batch`], within [`COMMAND_BYTES`]), renewing the lease between batches.
    /// Each event's body is rendered once and shared by its deliveries. The number of
    /// webhooks, or `None` if the lease was lost.
    ///
    /// The webhooks are read after the page, once: one missing from the list was
    /// registered after every event of the page was recorded. After the page, only
    /// whether the webhooks it made deliveries for still exist is read (their ids).
    async fn dispatch_page(
        &self,
        events: &[Event],
        give_up_after: chrono::TimeDelta,
        lease: &mut Lease<DispatcherLease>,
    ) -> Result<Option<usize>, ServiceError> {
        let hooks = &self.store.webhooks().webhooks_all().await?;
        let give_up_at = self.store.server_time_lower_bound().await? + give_up_after;
        let bodies: HashMap<&str, Arc<str>> = events
            .iter()
            .filter(|e| hooks.iter().any(|h| wants(h, e)))
            .map(|e| (e.id.as_str(), Arc::from((self.render)(e))))
            .collect();
        let by_id: HashMap<&str, &Webhook> = hooks.iter().map(|h| (h.id.as_str(), h)).collect();
        let token = claim_token(lease.owner());
        let mut pairs = pairs(events, &bodies, hooks, give_up_at).peekable();
        let mut made_for = HashSet::new();
        while pairs.peek().is_some() {
            if !lease.renew_if_due().await? {
                return Ok(None);
            }
            let new = batch(&mut pairs, &token, COMMAND_BYTES);
            made_for.extend(new.iter().map(|d| d.webhook));
            self.deliver(new, &by_id, &token).await?;
        }
        // Deliveries made for a webhook deleted meanwhile are removed. A deletion removes
        // the webhook, then its deliveries: read before the first, the webhook is there
        // and the deletion's second write removes what this page made for it (made
        // before this read); read after it, the webhook is missing and they are removed
        // here. Only the webhooks the page made deliveries for are read, by id: the list
        // itself is read once per page.
        if !made_for.is_empty() {
            let made_for: Vec<&str> = made_for.into_iter().collect();
            let live = self.store.webhooks().webhooks_among(&made_for).await?;
            for gone in made_for.iter().filter(|h| !live.contains(**h)) {
                self.store.webhooks().delete_deliveries_of(gone).await?;
            }
        }
        Ok(Some(fan_out(hooks)))
    }

    /// Makes the deliveries `new` (one batch).
    ///
    /// Those this instance has room for, [`FIRSTS`](super::FIRSTS) at most, are sent
    /// first, and made once their attempts end, with what they decided: most deliveries
    /// are written once, never claimed nor logged. The wait is bounded
    /// ([`FIRST_WAIT`](super::firsts::FIRST_WAIT)): an attempt still under way then is
    /// made under this instance's claim and logged when it ends, as a claimed one is.
    /// The rest are made unclaimed, for any instance's sender. A crash after an attempt
    /// and before its delivery is made leaves the cursor before the event: it is sent
    /// again (at least once), [`FIRSTS`](super::FIRSTS) such attempts at most.
    async fn deliver(
        &self,
        mut new: Vec<NewDelivery<'_>>,
        hooks: &HashMap<&str, &Webhook>,
        token: &str,
    ) -> Result<(), ServiceError> {
        // Those made already are left out: those the last dispatcher made past the
        // cursor it saved, or made while its lease ran out under it.
        if !new.is_empty() {
            let there = self
                .store
                .webhooks()
                .deliveries_made(&ids_of(&new), None)
                .await?;
            new.retain(|d| !there.contains(&format!("{}:{}", d.webhook, d.event_id)));
        }
        if new.is_empty() {
            return Ok(());
        }
        let firsts = send_first(&self.sending, &new, hooks, token).await;
        let unclaimed = new.len() - firsts.len();
        for (at, first, _) in &firsts {
            new[*at].made = first.seal();
        }
        self.make(new, token, &firsts).await?;
        if unclaimed > 0 {
            self.made.notify_one();
        }
        Ok(())
    }

    /// Makes `new` in one insert, and tells each first attempt whether its delivery was
    /// made under the claim `token` (after a failed insert, what is under the claim is
    /// read: some may have been made all the same).
    async fn make(
        &self,
        new: Vec<NewDelivery<'_>>,
        token: &str,
        firsts: &[(usize, Arc<First>, Told)],
    ) -> Result<(), ServiceError> {
        let store = &self.store;
        let ids = ids_of(&new);
        let inserted = store
            .webhooks()
            .insert_deliveries(new, (token, CLAIM_LEASE))
            .await;
        let mine = match &inserted {
            Ok(_) => None,
            Err(_) => store
                .webhooks()
                .deliveries_made(&ids, Some(token))
                .await
                .ok(),
        };
        for (at, _, told) in firsts {
            let made = match (&inserted, &mine) {
                (Ok(refused), _) => !refused.contains(&ids[*at]),
                (Err(_), Some(mine)) => mine.contains(&ids[*at]),
                (Err(_), None) => false,
            };
            told.send_replace(Some(made));
        }
        inserted?;
        Ok(())
    }
}
