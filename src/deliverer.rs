//! Webhook deliveries (`docs/webhooks.md`): two tasks per instance.
//!
//! - The **dispatcher** follows the event feed with a cursor kept in the database and, for
//!   each event, records a delivery to every webhook that wants its type and was
//!   registered before it (`store::webhooks`). One instance at a time dispatches, under a
//!   lease; a dispatch repeated after a crash or a takeover is refused by the delivery's
//!   id, so each event reaches each endpoint through one delivery.
//! - Every delivery is sent under a **claim** (a lease per delivery, by the database's
//!   clock): `POST`ed, signed as Standard Webhooks say, then its attempt recorded if the
//!   claim still holds. The dispatcher makes the deliveries its instance has room for
//!   already claimed, and starts them at once; the **sender** of every instance claims
//!   the others when due (retries, those no dispatcher had room for, those whose claim
//!   ran out). A killed instance's claim runs out and another instance sends the delivery
//!   again: at least once, with the same `webhook-id`.
//!
//! Claims and records are batched: a round claims what is due with one `updateMany`, and
//! finished attempts are recorded many to a command, each guarded by its claim.
//!
//! Bounds: [`MAX_SENDING`] attempts at once per instance and [`PER_ENDPOINT`] per
//! endpoint, each at most [`ATTEMPT_TIMEOUT`]: a slow or failing endpoint holds at most
//! its share of the senders, never a transfer (deliveries share nothing with transfers
//! but the database). [`MAX_HELD`] claimed deliveries per instance, whatever the number
//! of endpoints.
//!
//! Bounded by bytes, whatever the number of webhooks: a page covers at most
//! [`PAGE_PAIRS`] deliveries, made in batches of at most [`COMMAND_BYTES`] as stored
//! ([`batch`]), so that no command the dispatcher sends passes MongoDB's 16 MiB (which
//! SecantusDB does not enforce: `tests/webhook_dispatch.rs` records every command and
//! checks it); each event's body is rendered once and shared by its deliveries in
//! memory; at most [`FIRSTS`] attempts of a batch go out before their deliveries are
//! written.
//!
//! Where a delivery may connect is checked at each attempt against the address actually
//! connected to: the client resolves names through [`CheckedResolver`], which drops
//! addresses that are not public (unless `WEBHOOK_ALLOW_PRIVATE`), follows no redirect and
//! uses no proxy; a URL whose host is an address is checked before sending.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::timeout_at;
use tokio_util::sync::CancellationToken;

use crate::domain::{
    self, Attempt, Event, FeedCursor, Scope, Webhook, backoff_ms, is_public_address,
};
use crate::error_chain::Chain;
use crate::service::{TransferService, WebhookSettings};
use crate::store::webhooks::{
    AttemptOutcome, Claimed, Made, NewDelivery, claim_token, stored_bytes,
};
use crate::store::{Store, StoreResult};

/// How an event is sent: the body of every attempt, rendered once when its deliveries are
/// made (the feed's JSON of the event, from the HTTP layer).
pub type Render = Arc<dyn Fn(&Event) -> String + Send + Sync>;

/// The dispatcher's lease, by the database's clock.
const LEASE: Duration = Duration::from_secs(10);
const RENEW_EVERY: Duration = Duration::from_secs(3);
const CLAIM_INTERVAL: Duration = Duration::from_secs(2);
/// Events the dispatcher reads at a time, at most (fewer with many webhooks:
/// [`page_limit`]).
const PAGE: u32 = 500;
/// Deliveries a page makes at most (events times the webhooks that want them): 20 of
/// them to each of 1,000 webhooks. Bounds the work of a page, which a takeover repeats.
pub const PAGE_PAIRS: usize = 20_000;
/// The most bytes of the deliveries made in one batch, as
/// [`stored_bytes`](crate::store::webhooks::stored_bytes) counts them: each command that
/// makes a batch (the read of those made already, the insert) stays well under the 16 MiB
/// a MongoDB command may be, and what the dispatcher holds of a batch is bounded by it.
pub const COMMAND_BYTES: usize = 4 << 20;
/// Deliveries made in one batch, at most, whatever their size.
pub const BATCH: usize = 5_000;
/// The most first attempts the dispatcher starts for one batch before its deliveries
/// are made ([`MAX_SENDING`] at a time, more as earlier ones end, within
/// [`FIRST_WAIT`]): what a crash at that moment sends again without a record.
pub const FIRSTS: usize = 256;
/// How long the dispatcher waits for new events before it reads anyway.
const DISPATCH_IDLE: Duration = Duration::from_millis(250);
/// How long an attempt may take before it counts as failed (no answer within 5 s).
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// A claim on a delivery: well over an attempt, so that only a dead sender loses it.
const CLAIM_LEASE: Duration = Duration::from_secs(30);
/// Attempts in flight at once on this instance.
pub const MAX_SENDING: usize = 64;
/// Attempts in flight at once to one endpoint from this instance.
pub const PER_ENDPOINT: usize = 16;
/// Deliveries of one endpoint this instance holds claimed at most (waiting for their
/// turn or in flight): claims are made for many at once, and at [`PER_ENDPOINT`] at a
/// time and 5 s at most each, the last of them starts well within its claim's lease.
pub const CLAIMED_AHEAD: usize = 64;
/// Deliveries this instance holds claimed at most, of all endpoints together (each
/// endpoint [`CLAIMED_AHEAD`] at most): at [`MAX_SENDING`] at a time and 5 s at most
/// each, the last of them starts within its claim's lease.
pub const MAX_HELD: usize = 4 * MAX_SENDING;
/// How long the list of webhooks is used before it is read again.
const HOOKS_FRESH_FOR: Duration = Duration::from_millis(200);
/// Attempts recorded in one command, at most: the command's pipeline looks each
/// delivery's record up in the batch, so its cost grows with the square of the batch.
const RECORD_BATCH: usize = 64;
/// How long the recorder of attempts waits for more after the first.
const RECORD_WAIT: Duration = Duration::from_millis(10);
/// How long the sender waits when nothing is due.
const SEND_IDLE: Duration = Duration::from_millis(200);
/// How often the age of the oldest pending delivery is measured.
const GAUGE_EVERY: Duration = Duration::from_secs(5);

/// Dispatches and sends webhooks for this instance (`owner`), until `shutdown`.
pub async fn run(
    service: TransferService,
    owner: String,
    render: Render,
    shutdown: CancellationToken,
) {
    let settings = service.webhook_settings();
    let client = match client(settings.allow_private) {
        Ok(client) => client,
        Err(e) => {
            tracing::error!(error = %Chain(&e), "no HTTP client for webhooks; none will be sent");
            return;
        }
    };
    let store = service.deployments().first().clone();
    let (done, to_record) = tokio::sync::mpsc::channel::<Done>(MAX_SENDING * 2);
    let recorder = tokio::spawn(record(store.clone(), to_record));
    let sending = Arc::new(Sending {
        store,
        client,
        settings,
        slots: Arc::new(Semaphore::new(MAX_SENDING)),
        endpoints: Arc::default(),
        ended: Arc::default(),
        done,
    });
    // Told by this instance's dispatcher when it made deliveries it could not take itself,
    // so that its sender need not wait for its next look (another instance's are found
    // by that look).
    let made = Arc::new(tokio::sync::Notify::new());
    let dispatcher = tokio::spawn(dispatch(
        service.clone(),
        owner.clone(),
        render,
        sending.clone(),
        made.clone(),
        shutdown.clone(),
    ));
    let sender = Sender {
        service,
        owner,
        sending,
        made,
    };
    sender.run(shutdown).await;
    let _ = dispatcher.await;
    // The attempts under way finish and are recorded; those not recorded are sent again
    // once their claims run out.
    let _ = recorder.await;
}

/// The HTTP client of deliveries.
fn client(allow_private: bool) -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(ATTEMPT_TIMEOUT)
        .connect_timeout(ATTEMPT_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .user_agent(concat!(
            "transfer-service/",
            env!("CARGO_PKG_VERSION"),
            " webhooks"
        ))
        .dns_resolver(Arc::new(CheckedResolver { allow_private }))
        .build()
}

/// Resolves names as the system does, keeping only the addresses a delivery may connect
/// to: the connection then goes to a checked address, whatever the name resolves to by
/// the time of the attempt.
struct CheckedResolver {
    allow_private: bool,
}

impl reqwest::dns::Resolve for CheckedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let allow_private = self.allow_private;
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let found: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
                .await?
                .filter(|a| allow_private || is_public_address(a.ip()))
                .collect();
            if found.is_empty() {
                return Err(format!("{host} resolves to no public address").into());
            }
            let addrs: reqwest::dns::Addrs = Box::new(found.into_iter());
            Ok(addrs)
        })
    }
}

/// The dispatcher's task: takes the lease when free, dispatches while it holds it.
async fn dispatch(
    service: TransferService,
    owner: String,
    render: Render,
    sending: Arc<Sending>,
    made: Arc<tokio::sync::Notify>,
    shutdown: CancellationToken,
) {
    let store = service.deployments().first().clone();
    let mut failing = false;
    while !shutdown.is_cancelled() {
        let outcome = match store.claim_dispatcher(&owner, LEASE).await {
            Ok(Some(cursor)) => {
                let ctx = Dispatching {
                    service: &service,
                    store: &store,
                    owner: &owner,
                    render: &render,
                    sending: &sending,
                    made: &made,
                };
                ctx.run(cursor, &shutdown).await
            }
            Ok(None) => Ok(()),
            Err(e) => Err(e.into()),
        };
        match outcome {
            Ok(()) => failing = false,
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %Chain(&e), "webhook deliveries not dispatched; tried again");
                }
                failing = true;
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(CLAIM_INTERVAL) => {}
        }
    }
}

/// What the dispatcher works with while it holds the lease.
struct Dispatching<'a> {
    service: &'a TransferService,
    store: &'a Store,
    owner: &'a str,
    render: &'a Render,
    sending: &'a Sending,
    made: &'a tokio::sync::Notify,
}

impl Dispatching<'_> {
    async fn run(
        &self,
        saved: Option<String>,
        shutdown: &CancellationToken,
    ) -> Result<(), crate::service::ServiceError> {
        let (service, store, owner) = (self.service, self.store, self.owner);
        let mut cursor = saved.as_deref().and_then(|c| FeedCursor::parse(c).ok());
        let mut signal = service.feed_signal();
        let mut lease = Lease {
            renewed: tokio::time::Instant::now(),
        };
        let give_up_after = chrono::TimeDelta::from_std(service.webhook_settings().give_up_after)
            .unwrap_or(chrono::TimeDelta::MAX);
        // How many deliveries one event made at most for the webhooks the last page saw
        // ([`fan_out`]): the next page's events are as many as [`PAGE_PAIRS`] allows for
        // that many (the first page reads the list first).
        let mut hooks_seen = fan_out(&store.webhooks_all().await?);
        loop {
            if shutdown.is_cancelled() {
                store.release_dispatcher(owner).await?;
                return Ok(());
            }
            if !lease.renew_if_due(store, owner).await? {
                return Ok(());
            }
            let limit = page_limit(hooks_seen);
            let Some(page) = self.read(&mut cursor, limit).await? else {
                continue;
            };
            if !page.events.is_empty() {
                match self
                    .dispatch_page(&page.events, give_up_after, &mut lease)
                    .await?
                {
                    Some(hooks) => hooks_seen = hooks,
                    None => return Ok(()),
                }
            }
            let full = page.events.len() >= limit as usize;
            if cursor.as_ref() != Some(&page.next) {
                if !store
                    .save_dispatcher_cursor(owner, &page.next.encode())
                    .await?
                {
                    return Ok(());
                }
                cursor = Some(page.next);
            }
            if !full {
                // On shutdown, round the loop: its top gives the lease up, so that another
                // instance goes on at once rather than when the lease runs out.
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = signal.changed() => {}
                    _ = tokio::time::sleep(DISPATCH_IDLE) => {}
                }
            }
        }
    }
}

impl Dispatching<'_> {
    /// The next page of up to `limit` events after `cursor`; none when the events after
    /// it are gone (removed after the retention): `cursor` is then the front, and what is
    /// kept is dispatched from there (deliveries already made are refused by their ids).
    async fn read(
        &self,
        cursor: &mut Option<FeedCursor>,
        limit: u32,
    ) -> Result<Option<crate::service::FeedPage>, crate::service::ServiceError> {
        let read = self
            .service
            .events(&Scope::Platform, cursor.clone(), limit, &[]);
        match read.await {
            Ok(page) => Ok(Some(page)),
            Err(crate::service::ServiceError::CursorExpired) => {
                tracing::error!(
                    "webhook dispatch fell behind the event retention; events were removed before they were dispatched"
                );
                *cursor = None;
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}

/// The dispatcher's lease, renewed between pages and between the batches of a page.
struct Lease {
    renewed: tokio::time::Instant,
}

impl Lease {
    /// Renews the lease if [`RENEW_EVERY`] passed; whether it is still held.
    async fn renew_if_due(&mut self, store: &Store, owner: &str) -> StoreResult<bool> {
        if self.renewed.elapsed() < RENEW_EVERY {
            return Ok(true);
        }
        if store.claim_dispatcher(owner, LEASE).await?.is_none() {
            return Ok(false);
        }
        self.renewed = tokio::time::Instant::now();
        Ok(true)
    }
}

/// How many deliveries one event can make for `hooks` (one at least): every platform
/// webhook, and those of the two tenants with the most (an event is seen by its
/// transfer's tenants: one, or two for a transfer a platform key made across tenants).
/// Tenants' webhooks that no event of a page goes to then do not shrink its page; a
/// multi-leg transfer across more tenants may make more, its batches still bounded by
/// bytes ([`COMMAND_BYTES`]).
fn fan_out(hooks: &[Webhook]) -> usize {
    let mut per_tenant: HashMap<&domain::TenantName, usize> = HashMap::new();
    let mut platform = 0;
    for hook in hooks {
        match &hook.tenant {
            None => platform += 1,
            Some(tenant) => *per_tenant.entry(tenant).or_default() += 1,
        }
    }
    let mut counts: Vec<usize> = per_tenant.into_values().collect();
    counts.sort_unstable_by(|a, b| b.cmp(a));
    (platform + counts.iter().take(2).sum::<usize>()).max(1)
}

/// The events of a page read for `hooks` deliveries an event: [`PAGE`] at most, and no more than
/// [`PAGE_PAIRS`] deliveries' worth (one at least), so that a page is made within a few
/// batches whatever the number of webhooks, and a page dispatched again after a crash or
/// a takeover repeats a bounded amount of work.
fn page_limit(hooks: usize) -> u32 {
    let events = PAGE_PAIRS / hooks.max(1);
    u32::try_from(events.clamp(1, PAGE as usize)).unwrap_or(PAGE)
}

/// The deliveries to make for a page: each event to each webhook that wants it, in the
/// order of the events, made lazily so that only one batch is held at a time.
fn pairs<'a>(
    events: &'a [Event],
    bodies: &'a HashMap<&'a str, Arc<str>>,
    hooks: &'a [Webhook],
    give_up_at: crate::domain::Timestamp,
) -> impl Iterator<Item = NewDelivery<'a>> + 'a {
    events.iter().flat_map(move |event| {
        hooks
            .iter()
            .filter(move |h| wants(h, event))
            .filter_map(move |hook| {
                Some(NewDelivery {
                    webhook: &hook.id,
                    event_id: &event.id,
                    event_type: event.kind,
                    body: bodies.get(event.id.as_str())?.clone(),
                    give_up_at,
                    made: Made::Unclaimed,
                })
            })
    })
}

/// The next batch of `pairs`: as many as fit in `budget` bytes by
/// [`stored_bytes`](crate::store::webhooks::stored_bytes) under a claim of `token` (one at
/// least, whatever its size), at most [`BATCH`]. Every command that makes a batch (the
/// read of those made already, the insert) is then at most `budget` and a little
/// framing: the bound of what the dispatcher sends, and of what it holds.
pub fn batch<'a>(
    pairs: &mut std::iter::Peekable<impl Iterator<Item = NewDelivery<'a>>>,
    token: &str,
    budget: usize,
) -> Vec<NewDelivery<'a>> {
    let mut batch = Vec::new();
    let mut bytes = 0;
    while batch.len() < BATCH {
        let Some(next) = pairs.peek() else { break };
        let size = stored_bytes(next, token);
        if !batch.is_empty() && bytes + size > budget {
            break;
        }
        bytes += size;
        batch.extend(pairs.next());
    }
    batch
}

impl Dispatching<'_> {
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
        lease: &mut Lease,
    ) -> Result<Option<usize>, crate::service::ServiceError> {
        let hooks = &self.store.webhooks_all().await?;
        let give_up_at = self.store.server_time_lower_bound().await? + give_up_after;
        let bodies: HashMap<&str, Arc<str>> = events
            .iter()
            .filter(|e| hooks.iter().any(|h| wants(h, e)))
            .map(|e| (e.id.as_str(), Arc::from((self.render)(e))))
            .collect();
        let by_id: HashMap<&str, &Webhook> = hooks.iter().map(|h| (h.id.as_str(), h)).collect();
        let token = claim_token(self.owner);
        let mut pairs = pairs(events, &bodies, hooks, give_up_at).peekable();
        let mut made_for = std::collections::HashSet::new();
        while pairs.peek().is_some() {
            if !lease.renew_if_due(self.store, self.owner).await? {
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
            let live = self.store.webhooks_among(&made_for).await?;
            for gone in made_for.iter().filter(|h| !live.contains(**h)) {
                self.store.delete_deliveries_of(gone).await?;
            }
        }
        Ok(Some(fan_out(hooks)))
    }

    /// Makes the deliveries `new` (one batch).
    ///
    /// Those this instance has room for, [`FIRSTS`] at most, are sent first, and made once
    /// their attempts end, with what they decided: most deliveries are written once, never
    /// claimed nor recorded. The wait is bounded ([`FIRST_WAIT`]): an attempt still under
    /// way then is made under this instance's claim and recorded when it ends, as a
    /// claimed one is. The rest are made unclaimed, for any instance's sender. A crash
    /// after an attempt and before its delivery is made leaves the cursor before the
    /// event: it is sent again (at least once), [`FIRSTS`] such attempts at most.
    async fn deliver(
        &self,
        mut new: Vec<NewDelivery<'_>>,
        hooks: &HashMap<&str, &Webhook>,
        token: &str,
    ) -> Result<(), crate::service::ServiceError> {
        // Those made already are left out: those the last dispatcher made past the
        // cursor it saved, or made while its lease ran out under it.
        if !new.is_empty() {
            let there = self.store.deliveries_made(&ids_of(&new), None).await?;
            new.retain(|d| !there.contains(&format!("{}:{}", d.webhook, d.event_id)));
        }
        if new.is_empty() {
            return Ok(());
        }
        let firsts = self.send_first(&new, hooks, token).await;
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

    /// Starts the first attempts of `new` (deliveries of `hooks`) as this instance's
    /// places allow, [`FIRSTS`] at most, more as earlier ones end, until each has one or
    /// [`FIRST_WAIT`] is over; then waits for them until then. Those started, by their
    /// place in `new`.
    async fn send_first(
        &self,
        new: &[NewDelivery<'_>],
        hooks: &HashMap<&str, &Webhook>,
        token: &str,
    ) -> Vec<(usize, Arc<First>, Told)> {
        let sending = self.sending;
        let deadline = tokio::time::Instant::now() + FIRST_WAIT;
        let (ended, mut endings) = tokio::sync::mpsc::channel::<()>(FIRSTS);
        let mut firsts = Vec::new();
        let mut started = vec![false; new.len()];
        // Endpoints found without room in this round: not asked again until the next.
        let mut full: std::collections::HashSet<&str> = std::collections::HashSet::new();
        loop {
            full.clear();
            for (at, d) in new.iter().enumerate() {
                if firsts.len() >= FIRSTS {
                    break;
                }
                let Some(hook) = hooks.get(d.webhook) else {
                    continue;
                };
                if started[at] || full.contains(d.webhook) {
                    continue;
                }
                if sending.reserve(d.webhook, 1) == 0 {
                    full.insert(d.webhook);
                    continue;
                }
                started[at] = true;
                let (first, told) = First::new(ended.clone());
                sending.start(
                    (*hook).clone(),
                    first_claim(d, token),
                    Report::First(first.clone()),
                );
                firsts.push((at, first, told));
            }
            // An attempt's end gives its place back.
            let all = firsts.len() >= FIRSTS || started.iter().all(|s| *s);
            if all || !matches!(timeout_at(deadline, endings.recv()).await, Ok(Some(()))) {
                break;
            }
        }
        drop(ended);
        let _ = timeout_at(deadline, async { while endings.recv().await.is_some() {} }).await;
        firsts
    }

    /// Makes `new` in one insert, and tells each first attempt whether its delivery was
    /// made under the claim `token` (after a failed insert, what is under the claim is
    /// read: some may have been made all the same).
    async fn make(
        &self,
        new: Vec<NewDelivery<'_>>,
        token: &str,
        firsts: &[(usize, Arc<First>, Told)],
    ) -> Result<(), crate::service::ServiceError> {
        let store = self.store;
        let ids = ids_of(&new);
        let inserted = store.insert_deliveries(new, (token, CLAIM_LEASE)).await;
        let mine = match &inserted {
            Ok(_) => None,
            Err(_) => store.deliveries_made(&ids, Some(token)).await.ok(),
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

/// The ids of deliveries `new`.
fn ids_of(new: &[NewDelivery<'_>]) -> Vec<String> {
    new.iter()
        .map(|d| format!("{}:{}", d.webhook, d.event_id))
        .collect()
}

/// The claim a first attempt of `d` runs under: `token`'s, made with the delivery.
fn first_claim(d: &NewDelivery<'_>, token: &str) -> Claimed {
    Claimed {
        owner: token.to_owned(),
        id: format!("{}:{}", d.webhook, d.event_id),
        webhook: d.webhook.to_owned(),
        event_id: d.event_id.to_owned(),
        body: d.body.clone(),
        tries: 0,
        give_up_at: d.give_up_at,
        // The claim starts when the delivery is made, after the wait.
        claimed_until: std::time::Instant::now() + CLAIM_LEASE / 2,
    }
}

/// How long the dispatcher waits for the first attempts it started before it makes
/// their deliveries (those still under way are made claimed).
const FIRST_WAIT: Duration = Duration::from_millis(250);

/// A first attempt started before its delivery is made.
struct First {
    phase: Mutex<Phase>,
    /// Set by the dispatcher once it made the deliveries: whether this one was made under
    /// the claim (an attempt that ends after the seal is recorded only then). A
    /// dispatcher that stopped before saying so (its sender dropped) means no.
    made: tokio::sync::watch::Receiver<Option<bool>>,
}

/// The dispatcher's side of [`First::made`].
type Told = tokio::sync::watch::Sender<Option<bool>>;

impl First {
    /// A first attempt under way, that tells `ended` when it ends; and the dispatcher's
    /// side of its [`First::made`].
    fn new(ended: tokio::sync::mpsc::Sender<()>) -> (Arc<First>, Told) {
        let (told, made) = tokio::sync::watch::channel(None);
        let first = Arc::new(First {
            phase: Mutex::new(Phase::Running(ended)),
            made,
        });
        (first, told)
    }

    /// Seals it: how its delivery is made, with its attempt if it ended, under the claim
    /// if it is still under way (it is recorded when it ends).
    fn seal(&self) -> Made {
        let mut phase = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        match std::mem::replace(&mut *phase, Phase::Sealed) {
            Phase::Ended(attempt, outcome) => Made::Attempted(attempt, outcome),
            _ => Made::Claimed,
        }
    }
}

enum Phase {
    /// Under way; tells the dispatcher when it ends.
    Running(tokio::sync::mpsc::Sender<()>),
    /// Ended before the seal: made with its attempt.
    Ended(Attempt, AttemptOutcome),
    /// Sealed by the dispatcher while under way (or after its attempt was taken).
    Sealed,
}

/// Whether `hook` is sent `event`: a type it wants, after it was registered (by the
/// event's deployment's position, not by its clock), and one its tenant sees.
fn wants(hook: &Webhook, event: &Event) -> bool {
    hook.wants(event.kind) && hook.registered_before(event) && hook.sees(event)
}

/// What this instance's attempts share: the bounds, and where finished ones go to be
/// recorded. Its claim rounds and its dispatcher both start attempts through it.
struct Sending {
    store: Store,
    client: reqwest::Client,
    settings: WebhookSettings,
    /// One permit per attempt in flight on this instance ([`MAX_SENDING`]).
    slots: Arc<Semaphore>,
    /// Per endpoint: its attempts in flight ([`PER_ENDPOINT`] permits), and how many of
    /// its deliveries this instance holds claimed (waiting or in flight, at most
    /// [`CLAIMED_AHEAD`]).
    endpoints: Arc<Mutex<HashMap<String, Endpoint>>>,
    /// Told when an attempt ends: its place may let the next round claim more.
    ended: Arc<tokio::sync::Notify>,
    /// Where finished attempts go to be recorded.
    done: tokio::sync::mpsc::Sender<Done>,
}

impl Sending {
    /// How many deliveries this instance holds claimed, of every endpoint.
    fn held(&self) -> usize {
        let held = self.endpoints.lock().unwrap_or_else(|e| e.into_inner());
        held.values().map(|e| e.claimed).sum()
    }

    /// How many more of `hook`'s deliveries this instance may hold claimed.
    fn free(&self, hook: &str) -> usize {
        let held = self.endpoints.lock().unwrap_or_else(|e| e.into_inner());
        CLAIMED_AHEAD.saturating_sub(held.get(hook).map_or(0, |e| e.claimed))
    }

    /// Takes up to `wanted` of the places of `hook`'s claimed deliveries; how many it took.
    /// Each is given back by the end of its attempt ([`Sending::start`]) or by
    /// [`Sending::unreserve`].
    fn reserve(&self, hook: &str, wanted: usize) -> usize {
        let mut held = self.endpoints.lock().unwrap_or_else(|e| e.into_inner());
        let endpoint = held.entry(hook.to_owned()).or_insert_with(Endpoint::new);
        let taken = wanted.min(CLAIMED_AHEAD.saturating_sub(endpoint.claimed));
        endpoint.claimed += taken;
        if endpoint.claimed == 0 {
            held.remove(hook);
        }
        taken
    }

    /// Gives back `n` places of `hook` that no attempt took.
    fn unreserve(&self, hook: &str, n: usize) {
        for _ in 0..n {
            release(&self.endpoints, hook);
        }
    }

    /// Starts the attempt of `claimed`, a delivery of `hook` whose place is taken: it
    /// waits for its endpoint's place, then for one of this instance's; its outcome goes
    /// where `report` says.
    fn start(&self, hook: Webhook, claimed: Claimed, report: Report) {
        let in_flight = {
            let mut held = self.endpoints.lock().unwrap_or_else(|e| e.into_inner());
            // Its place is taken ([`Sending::reserve`]), so its endpoint is held.
            held.entry(hook.id.clone())
                .or_insert_with(Endpoint::new)
                .in_flight
                .clone()
        };
        let attempt = Attempting {
            store: self.store.clone(),
            client: self.client.clone(),
            settings: self.settings,
            hook,
            claimed,
            endpoints: self.endpoints.clone(),
            done: self.done.clone(),
            ended: self.ended.clone(),
            report,
        };
        let slots = self.slots.clone();
        tokio::spawn(async move {
            // The endpoint's place first: an attempt waiting for a slow endpoint holds
            // none of the places the other endpoints need.
            let Ok(place) = in_flight.acquire_owned().await else {
                return;
            };
            let Ok(permit) = slots.acquire_owned().await else {
                return;
            };
            attempt.run((place, permit)).await;
        });
    }
}

/// The claiming side: finds due deliveries (retries, those another instance's dispatcher
/// had no room for, those whose claim ran out) and starts their attempts.
struct Sender {
    service: TransferService,
    owner: String,
    sending: Arc<Sending>,
    /// Told when this instance's dispatcher made deliveries it did not take.
    made: Arc<tokio::sync::Notify>,
}

/// What this instance holds of one endpoint's deliveries.
struct Endpoint {
    in_flight: Arc<Semaphore>,
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

/// An attempt made and what it decided, on its way to be recorded.
type Done = (Claimed, Attempt, AttemptOutcome);

impl Sender {
    async fn run(self, shutdown: CancellationToken) {
        let store = self.service.deployments().first().clone();
        let mut gauged: Option<tokio::time::Instant> = None;
        let mut hooks: (HashMap<String, Webhook>, Option<tokio::time::Instant>) =
            (HashMap::new(), None);
        let mut failing = false;
        while !shutdown.is_cancelled() {
            if gauged.is_none_or(|g| g.elapsed() >= GAUGE_EVERY) {
                if let (Ok(oldest), Ok(now)) = (
                    store.oldest_pending_delivery().await,
                    store.server_time().await,
                ) {
                    let age = oldest.map_or(0.0, |t| (now - t).as_seconds_f64().max(0.0));
                    crate::metrics::oldest_pending_delivery(age);
                }
                gauged = Some(tokio::time::Instant::now());
            }
            let (started, short) = match self.round(&store, &mut hooks).await {
                Ok(round) => {
                    failing = false;
                    round
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %Chain(&e), "webhook deliveries not sent; tried again");
                    }
                    failing = true;
                    (0, false)
                }
            };
            if started == 0 {
                // An attempt's end wakes the next round only if this one lacked room for
                // some endpoint: otherwise the ends of the dispatcher's own attempts,
                // hundreds a second, would each make a round that finds nothing.
                let ended = async {
                    match short {
                        true => self.sending.ended.notified().await,
                        false => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = ended => {}
                    _ = self.made.notified() => {}
                    _ = tokio::time::sleep(SEND_IDLE) => {}
                }
            }
        }
    }

    /// Claims, for each endpoint with room for at least half of [`CLAIMED_AHEAD`] more,
    /// what is due (one claim for all of them), and starts an attempt for each. How many
    /// it claimed, and whether some endpoint had too little room to be claimed for.
    async fn round(
        &self,
        store: &Store,
        hooks: &mut (HashMap<String, Webhook>, Option<tokio::time::Instant>),
    ) -> StoreResult<(usize, bool)> {
        refresh(store, hooks).await?;
        let sending = &self.sending;
        // The instance holds [`MAX_HELD`] claimed deliveries at most, whatever the number
        // of endpoints: what it holds in memory, and what it can send before the claims
        // run out.
        let left = MAX_HELD.saturating_sub(sending.held());
        if left < MAX_HELD / 4 {
            return Ok((0, true));
        }
        let short = hooks.0.keys().any(|h| sending.free(h) < CLAIMED_AHEAD / 2);
        let room: HashMap<String, usize> = hooks
            .0
            .keys()
            .filter(|h| sending.free(h) >= CLAIMED_AHEAD / 2)
            .map(|h| (h.clone(), sending.reserve(h, CLAIMED_AHEAD)))
            .filter(|(_, n)| *n > 0)
            .collect();
        if room.is_empty() {
            return Ok((0, short));
        }
        let limit = i64::try_from(room.values().sum::<usize>().min(left)).unwrap_or(i64::MAX);
        let claimed = store
            .claim_due(&self.owner, CLAIM_LEASE, &room, limit)
            .await;
        let mut unused = room.clone();
        let claimed = match claimed {
            Ok(claimed) => claimed,
            Err(e) => {
                for (hook, n) in unused {
                    sending.unreserve(&hook, n);
                }
                return Err(e);
            }
        };
        let count = claimed.len();
        for claimed in claimed {
            let (Some(hook), Some(n)) = (
                hooks.0.get(&claimed.webhook),
                unused.get_mut(&claimed.webhook).filter(|n| **n > 0),
            ) else {
                continue;
            };
            *n -= 1;
            sending.start(hook.clone(), claimed, Report::Record);
        }
        for (hook, n) in unused {
            sending.unreserve(&hook, n);
        }
        Ok((count, short))
    }
}

/// Reads the webhooks again if `hooks` is older than [`HOOKS_FRESH_FOR`].
async fn refresh(
    store: &Store,
    hooks: &mut (HashMap<String, Webhook>, Option<tokio::time::Instant>),
) -> StoreResult<()> {
    if hooks.1.is_none_or(|at| at.elapsed() >= HOOKS_FRESH_FOR) {
        hooks.0 = store
            .webhooks_all()
            .await?
            .into_iter()
            .map(|h| (h.id.clone(), h))
            .collect();
        hooks.1 = Some(tokio::time::Instant::now());
    }
    Ok(())
}

/// Records the attempts as they finish, many in one command: up to [`RECORD_BATCH`],
/// or what came within [`RECORD_WAIT`] of the first.
async fn record(store: Store, mut to_record: tokio::sync::mpsc::Receiver<Done>) {
    while let Some(first) = to_record.recv().await {
        let mut batch = vec![first];
        let until = tokio::time::Instant::now() + RECORD_WAIT;
        while batch.len() < RECORD_BATCH {
            match tokio::time::timeout_at(until, to_record.recv()).await {
                Ok(Some(done)) => batch.push(done),
                _ => break,
            }
        }
        match store.record_attempts(&batch).await {
            Ok(_) => {
                for (_, _, outcome) in &batch {
                    crate::metrics::delivery_attempted(match outcome {
                        AttemptOutcome::Succeeded => "succeeded",
                        AttemptOutcome::Retry(_) => "retried",
                        AttemptOutcome::GaveUp => "failed",
                    });
                }
            }
            Err(e) => {
                tracing::warn!(attempts = batch.len(), error = %Chain(&e), "webhook attempts not recorded; those deliveries are sent again once their claims run out");
            }
        }
    }
}

/// One claimed delivery of `hook` is over here (its attempt ended).
fn release(endpoints: &Mutex<HashMap<String, Endpoint>>, hook: &str) {
    let mut held = endpoints.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(endpoint) = held.get_mut(hook) {
        endpoint.claimed = endpoint.claimed.saturating_sub(1);
        if endpoint.claimed == 0 {
            held.remove(hook);
        }
    }
}

/// Where an attempt's outcome goes.
enum Report {
    /// To be recorded: its delivery is made, under its claim.
    Record,
    /// To the dispatcher, which makes the delivery with it if it ends in time, and is
    /// recorded once the delivery is made under its claim otherwise.
    First(Arc<First>),
}

/// One attempt of one claimed delivery.
struct Attempting {
    store: Store,
    client: reqwest::Client,
    settings: WebhookSettings,
    hook: Webhook,
    claimed: Claimed,
    endpoints: Arc<Mutex<HashMap<String, Endpoint>>>,
    done: tokio::sync::mpsc::Sender<Done>,
    ended: Arc<tokio::sync::Notify>,
    report: Report,
}

impl Attempting {
    /// Sends, holding `places` (its endpoint's and one of the instance's) until the
    /// answer, then reports. An attempt that could not end before its claim runs out
    /// (it waited too long for its places) is not made: the claim runs out, and the
    /// delivery is sent by whoever claims it next.
    async fn run(self, places: (OwnedSemaphorePermit, OwnedSemaphorePermit)) {
        if std::time::Instant::now() + ATTEMPT_TIMEOUT > self.claimed.claimed_until {
            drop(places);
            release(&self.endpoints, &self.hook.id);
            self.ended.notify_one();
            tracing::warn!(delivery = %self.claimed.id, "a webhook attempt waited too long for its place to end within its claim; not made, its delivery is sent again once the claim runs out");
            return;
        }
        let at = domain::now();
        let started = std::time::Instant::now();
        let answer = self.send().await;
        let duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        drop(places);
        release(&self.endpoints, &self.hook.id);
        self.ended.notify_one();
        let (status, error) = match answer {
            Ok(status) => (Some(status), None),
            Err(why) => (None, Some(why)),
        };
        let succeeded = status.is_some_and(|s| (200..300).contains(&s));
        let attempt = Attempt {
            at,
            status,
            error,
            duration_ms,
        };
        let outcome = match self.outcome(succeeded).await {
            Ok(outcome) => outcome,
            Err(e) => {
                tracing::warn!(delivery = %self.claimed.id, error = %Chain(&e), "a webhook attempt not recorded; the delivery is sent again once its claim runs out");
                return;
            }
        };
        if let Report::First(first) = &self.report {
            {
                let mut phase = first.phase.lock().unwrap_or_else(|e| e.into_inner());
                if let Phase::Running(told) = &*phase {
                    let _ = told.try_send(());
                    *phase = Phase::Ended(attempt, outcome);
                    return;
                }
            }
            // Sealed while under way: recorded once made under the claim, if it was.
            let mut made = first.made.clone();
            let Ok(made) = made.wait_for(Option::is_some).await.map(|m| *m) else {
                return;
            };
            if made != Some(true) {
                return;
            }
        }
        let _ = self.done.send((self.claimed, attempt, outcome)).await;
    }

    /// Sends the delivery; the status answered, or why there was none.
    async fn send(&self) -> Result<u16, String> {
        let (host, _) = self.hook.url.host_and_port();
        if let Ok(ip) = host.trim_matches(['[', ']']).parse::<IpAddr>() {
            if !self.settings.allow_private && !is_public_address(ip) {
                return Err(format!("{ip} is not a public address"));
            }
        }
        // The database's clock, not this instance's: every instance stamps by the same
        // clock, and a receiver that refuses old timestamps judges them all alike.
        let now = match self.store.server_time_lower_bound().await {
            Ok(now) => now,
            Err(e) => return Err(format!("no time from the database: {}", Chain(&e))),
        };
        let timestamp = now.timestamp();
        let signature =
            self.hook
                .signature(&self.claimed.event_id, timestamp, &self.claimed.body, now);
        let sent = self
            .client
            .post(self.hook.url.url().clone())
            .header("content-type", "application/json")
            .header("webhook-id", &self.claimed.event_id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .body(self.claimed.body.to_string())
            .send()
            .await;
        match sent {
            Ok(response) => Ok(response.status().as_u16()),
            Err(e) if e.is_timeout() => Err(format!(
                "no answer within {} ms",
                ATTEMPT_TIMEOUT.as_millis()
            )),
            Err(e) => Err(Chain(&e).to_string()),
        }
    }

    /// What follows the attempt: done, another attempt after the backoff, or failed once
    /// past the give-up time.
    async fn outcome(&self, succeeded: bool) -> StoreResult<AttemptOutcome> {
        if succeeded {
            return Ok(AttemptOutcome::Succeeded);
        }
        let wait = backoff_ms(
            self.claimed.tries + 1,
            millis(self.settings.retry_base),
            millis(self.settings.retry_max),
            rand::random::<f64>(),
        );
        let next = self.store.server_time_lower_bound().await?
            + chrono::TimeDelta::milliseconds(i64::try_from(wait).unwrap_or(i64::MAX));
        Ok(if next > self.claimed.give_up_at {
            AttemptOutcome::GaveUp
        } else {
            AttemptOutcome::Retry(next)
        })
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::EventType;
    use crate::store::webhooks::tests::{encoded_bytes, read_bytes};

    /// The deliveries of `events` events to `hooks` webhooks, with ids as long as they
    /// may be and bodies of `body_len` bytes shared per event.
    fn all_pairs(hooks: &[String], events: &[(String, Arc<str>)]) -> Vec<NewDelivery<'static>> {
        let (hooks, events): (&'static [String], &'static [(String, Arc<str>)]) = (
            Box::leak(hooks.to_vec().into_boxed_slice()),
            Box::leak(events.to_vec().into_boxed_slice()),
        );
        events
            .iter()
            .flat_map(|(event, body)| {
                hooks.iter().map(move |hook| NewDelivery {
                    webhook: hook,
                    event_id: event,
                    event_type: EventType::TransferDone,
                    body: body.clone(),
                    give_up_at: chrono::Utc::now(),
                    made: Made::Unclaimed,
                })
            })
            .collect()
    }

    /// Issue 33: 900 webhooks and a page of 500 events made one read of 450,000 ids (past
    /// the driver's 48 MB, and MongoDB's 16 MiB) and copied each body 900 times. Cut by
    /// bytes, each batch's commands, as they are encoded, stay within the bound, however
    /// many webhooks and however large the bodies, and every delivery is in one batch.
    #[test]
    fn every_batch_of_a_page_fits_the_command_bound_whatever_the_number_of_webhooks() {
        let hooks: Vec<String> = (0..900).map(|i| format!("wh_{i:024x}")).collect();
        let token = claim_token(&"i".repeat(128));
        for body_len in [300, 20_000] {
            let events: Vec<(String, Arc<str>)> = (0..500)
                .map(|i| {
                    let id = format!("transfer.canceled:{:0>64}", i);
                    (id, Arc::from("b".repeat(body_len)))
                })
                .collect();
            let pairs = all_pairs(&hooks, &events);
            let total = pairs.len();
            let mut pairs = pairs.into_iter().peekable();
            let mut seen = 0;
            let mut batches = 0;
            while pairs.peek().is_some() {
                let batch = batch(&mut pairs, &token, COMMAND_BYTES);
                assert!(!batch.is_empty() && batch.len() <= BATCH);
                // By the bound (which bounds each document's encoding: the store's
                // test), and, for the first batch, by the encoding itself.
                let bound: usize = batch.iter().map(|d| stored_bytes(d, &token)).sum();
                assert!(bound <= COMMAND_BYTES, "a batch of {bound} bytes");
                if batches == 0 {
                    let documents: usize = batch.iter().map(|d| encoded_bytes(d, &token)).sum();
                    assert!(
                        documents <= COMMAND_BYTES,
                        "a batch of {} is {documents} bytes encoded, over {COMMAND_BYTES}",
                        batch.len()
                    );
                }
                let read = read_bytes(&ids_of(&batch));
                assert!(read <= COMMAND_BYTES, "the read is {read} bytes");
                seen += batch.len();
                batches += 1;
            }
            assert_eq!(seen, total, "every delivery is in a batch");
            assert!(batches > 1);
        }
    }

    /// Issue 33: the resolver every attempt connects through keeps none of the reserved
    /// ranges, nor an IPv6 form of a private IPv4 address (a name resolving to one is
    /// refused as a literal is).
    #[tokio::test]
    async fn the_resolver_keeps_no_reserved_address_nor_an_ipv6_form_of_a_private_one() {
        use reqwest::dns::Resolve;
        let checked = CheckedResolver {
            allow_private: false,
        };
        for host in [
            "100.64.0.1",
            "192.0.0.8",
            "198.18.0.1",
            "198.19.0.1",
            "240.0.0.1",
            "255.255.255.255",
            "fec0::1",
            "64:ff9b::a00:1",
            "64:ff9b::7f00:1",
            "2002:a00:1::1",
            "2002:7f00:1::",
            "::10.0.0.1",
            "::127.0.0.1",
        ] {
            let name: reqwest::dns::Name = host.parse().unwrap();
            assert!(checked.resolve(name).await.is_err(), "{host} is kept");
        }
        for host in ["93.184.216.34", "64:ff9b::5db8:d822", "2002:5db8:d822::1"] {
            let name: reqwest::dns::Name = host.parse().unwrap();
            assert!(checked.resolve(name).await.is_ok(), "{host} is dropped");
        }
        let open = CheckedResolver {
            allow_private: true,
        };
        assert!(open.resolve("192.0.0.8".parse().unwrap()).await.is_ok());
    }

    #[test]
    fn a_delivery_larger_than_the_budget_is_a_batch_of_its_own() {
        let hooks = vec![format!("wh_{:024x}", 1), format!("wh_{:024x}", 2)];
        let events = vec![("account.opened:a".to_owned(), Arc::from("b".repeat(1000)))];
        let mut pairs = all_pairs(&hooks, &events).into_iter().peekable();
        assert_eq!(batch(&mut pairs, "t", 10).len(), 1);
        assert_eq!(batch(&mut pairs, "t", 10).len(), 1);
        assert!(pairs.peek().is_none());
    }

    #[test]
    fn an_event_goes_to_the_platforms_webhooks_and_two_tenants_at_most() {
        let hook = |tenant: Option<&str>| Webhook {
            id: "wh_000000000000000000000000".into(),
            url: domain::WebhookUrl::parse("https://example.com/h").unwrap(),
            types: Vec::new(),
            description: None,
            tenant: tenant.map(|t| domain::TenantName::parse(t).unwrap()),
            secret: domain::WebhookSecret::random(),
            previous: None,
            created_at: chrono::Utc::now(),
            registered_at: Default::default(),
        };
        assert_eq!(fan_out(&[]), 1);
        // 21 tenants with 1,000 webhooks each and one of the platform: an event reaches
        // at most 2,001, so a page keeps 9 events, not one (20,000 / 21,001).
        let mut hooks = vec![hook(None)];
        for t in 0..21 {
            let name = format!("t{t}");
            hooks.extend((0..1000).map(|_| hook(Some(&name))));
        }
        assert_eq!(fan_out(&hooks), 2001);
        assert_eq!(page_limit(fan_out(&hooks)), 9);
        hooks.extend((0..5).map(|_| hook(Some("big"))));
        assert_eq!(fan_out(&hooks), 2001, "the two largest tenants count");
        hooks.extend((0..1500).map(|_| hook(Some("big"))));
        assert_eq!(fan_out(&hooks), 1 + 1505 + 1000);
    }

    #[test]
    fn a_page_covers_at_most_page_pairs_deliveries_and_one_event_at_least() {
        assert_eq!(page_limit(0), PAGE);
        assert_eq!(page_limit(1), PAGE);
        for hooks in [40, 41, 450, 900, 1000, 10_000, 20_001, 1_000_000] {
            let events = page_limit(hooks) as usize;
            assert!(events >= 1);
            assert!(
                events == 1 || events * hooks <= PAGE_PAIRS,
                "{hooks}: {events}"
            );
        }
    }
}
