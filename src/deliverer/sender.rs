//! The sender: every instance's claim rounds, which find due deliveries (retries, those
//! no dispatcher had room for, those whose claim ran out), claim them in one write, and
//! start their attempts; and [`Sending`], what every attempt of this instance shares,
//! through which the dispatcher starts its first attempts too.
//!
//! A round claims only for endpoints with room for half their share
//! ([`CLAIMED_AHEAD`]) and only while the instance holds less than [`MAX_HELD`] claimed:
//! what it claims, it can start before the claims run out. A claim is one guarded write
//! by the database's clock, so two instances never both hold a delivery's claim; one that
//! ran out under a slow attempt is refused at its log ([`super::attempt_log`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::domain::{Webhook, WebhookSettings};
use crate::error_chain::Chain;
use crate::store::webhooks::Claimed;
use crate::store::{Store, StoreResult};

use super::attempt::{Attempting, Report};
use super::attempt_log::Log;
use super::slots::Slots;
use super::{CLAIM_LEASE, CLAIMED_AHEAD, MAX_HELD};

/// How long the list of webhooks is used before it is read again.
const HOOKS_FRESH_FOR: Duration = Duration::from_millis(200);
/// How long the sender waits when nothing is due.
const SEND_IDLE: Duration = Duration::from_millis(200);
/// How often the age of the oldest pending delivery is measured.
const GAUGE_EVERY: Duration = Duration::from_secs(5);

/// What this instance's attempts share: the bounds, and where finished ones go to be
/// logged. Its claim rounds and its dispatcher both start attempts through it.
pub struct Sending {
    /// Where webhooks and deliveries live (the first deployment).
    store: Store,
    client: reqwest::Client,
    settings: WebhookSettings,
    /// This instance's places: attempts in flight, deliveries held claimed.
    pub slots: Arc<Slots>,
    /// Told when an attempt ends: its place may let the next round claim more.
    ended: Arc<tokio::sync::Notify>,
    /// Where finished attempts go to be logged.
    log: Log,
}

impl Sending {
    pub fn new(
        store: Store,
        client: reqwest::Client,
        settings: WebhookSettings,
        log: Log,
    ) -> Sending {
        Sending {
            store,
            client,
            settings,
            slots: Arc::default(),
            ended: Arc::default(),
            log,
        }
    }

    /// Starts the attempt of `claimed`, a delivery of `hook` whose place is taken
    /// ([`Slots::reserve`]): it waits for its endpoint's place, then for one of this
    /// instance's; its outcome goes where `report` says.
    pub fn start(&self, hook: Webhook, claimed: Claimed, report: Report) {
        let attempt = Attempting {
            store: self.store.clone(),
            client: self.client.clone(),
            settings: self.settings,
            hook,
            claimed,
            slots: self.slots.clone(),
            log: self.log.clone(),
            ended: self.ended.clone(),
            report,
        };
        tokio::spawn(async move {
            let Some(places) = attempt.slots.places(&attempt.hook.id).await else {
                return;
            };
            attempt.run(places).await;
        });
    }
}

/// The claiming side: finds due deliveries and starts their attempts.
pub struct Sender {
    /// Where webhooks and deliveries live (the first deployment).
    store: Store,
    /// This instance: whose claims it makes.
    owner: String,
    sending: Arc<Sending>,
    /// Told when this instance's dispatcher made deliveries it did not take.
    made: Arc<tokio::sync::Notify>,
}

/// The webhooks by id, and when they were read.
type Hooks = (HashMap<String, Webhook>, Option<tokio::time::Instant>);

impl Sender {
    pub fn new(
        store: Store,
        owner: String,
        sending: Arc<Sending>,
        made: Arc<tokio::sync::Notify>,
    ) -> Sender {
        Sender {
            store,
            owner,
            sending,
            made,
        }
    }

    /// Claim rounds until `shutdown`: one after another while they find work, else
    /// after [`SEND_IDLE`], or sooner when told of new deliveries or of room.
    pub async fn run(self, shutdown: CancellationToken) {
        let store = &self.store;
        let mut gauged: Option<tokio::time::Instant> = None;
        let mut hooks: Hooks = (HashMap::new(), None);
        let mut failing = false;
        while !shutdown.is_cancelled() {
            if gauged.is_none_or(|g| g.elapsed() >= GAUGE_EVERY) {
                if let (Ok(oldest), Ok(now)) = (
                    store.webhooks().oldest_pending_delivery().await,
                    store.server_time().await,
                ) {
                    let age = oldest.map_or(0.0, |t| (now - t).as_seconds_f64().max(0.0));
                    crate::metrics::oldest_pending_delivery(age);
                }
                gauged = Some(tokio::time::Instant::now());
            }
            let (started, short) = match self.round(&mut hooks).await {
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
    async fn round(&self, hooks: &mut Hooks) -> StoreResult<(usize, bool)> {
        let store = &self.store;
        refresh(store, hooks).await?;
        let sending = &self.sending;
        let slots = &sending.slots;
        // The instance holds [`MAX_HELD`] claimed deliveries at most, whatever the number
        // of endpoints: what it holds in memory, and what it can send before the claims
        // run out.
        let left = MAX_HELD.saturating_sub(slots.held());
        if left < MAX_HELD / 4 {
            return Ok((0, true));
        }
        let short = hooks.0.keys().any(|h| slots.free(h) < CLAIMED_AHEAD / 2);
        let room: HashMap<String, usize> = hooks
            .0
            .keys()
            .filter(|h| slots.free(h) >= CLAIMED_AHEAD / 2)
            .map(|h| (h.clone(), slots.reserve(h, CLAIMED_AHEAD)))
            .filter(|(_, n)| *n > 0)
            .collect();
        if room.is_empty() {
            return Ok((0, short));
        }
        let limit = i64::try_from(room.values().sum::<usize>().min(left)).unwrap_or(i64::MAX);
        let claimed = store
            .webhooks()
            .claim_due(&self.owner, CLAIM_LEASE, &room, limit)
            .await;
        let mut unused = room.clone();
        let claimed = match claimed {
            Ok(claimed) => claimed,
            Err(e) => {
                for (hook, n) in unused {
                    slots.unreserve(&hook, n);
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
            sending.start(hook.clone(), claimed, Report::Log);
        }
        for (hook, n) in unused {
            slots.unreserve(&hook, n);
        }
        Ok((count, short))
    }
}

/// Reads the webhooks again if `hooks` is older than [`HOOKS_FRESH_FOR`].
async fn refresh(store: &Store, hooks: &mut Hooks) -> StoreResult<()> {
    if hooks.1.is_none_or(|at| at.elapsed() >= HOOKS_FRESH_FOR) {
        hooks.0 = store
            .webhooks()
            .webhooks_all()
            .await?
            .into_iter()
            .map(|h| (h.id.clone(), h))
            .collect();
        hooks.1 = Some(tokio::time::Instant::now());
    }
    Ok(())
}
