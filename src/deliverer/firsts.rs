//! First attempts: the dispatcher sends the deliveries its instance has room for before
//! it makes them ([`send_first`]), and makes each with what its attempt decided if the
//! attempt ended within [`FIRST_WAIT`]: most deliveries are written once, never claimed
//! nor logged.
//!
//! A first attempt and the dispatcher meet in a [`First`] (`handover.rs`). A crash
//! between an attempt and its
//! delivery leaves the feed's cursor before the event: it is sent again (at least once),
//! [`FIRSTS`] attempts of a batch at most.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::timeout_at;

use crate::domain::Webhook;
use crate::store::webhooks::{Claimed, NewDelivery};

use super::CLAIM_LEASE;
use super::attempt::Report;
use super::handover::{First, Told};
use super::sender::Sending;

/// The most first attempts the dispatcher starts for one batch before its deliveries
/// are made ([`MAX_SENDING`](super::MAX_SENDING) at a time, more as earlier ones end,
/// within [`FIRST_WAIT`]): what a crash at that moment sends again without a log.
pub const FIRSTS: usize = 256;
/// How long the dispatcher waits for the first attempts it started before it makes
/// their deliveries (those still under way are made claimed).
pub const FIRST_WAIT: Duration = Duration::from_millis(250);

/// The claim a first attempt of `d` runs under: `token`'s, made with the delivery.
pub fn first_claim(d: &NewDelivery<'_>, token: &str) -> Claimed {
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

/// Starts the first attempts of `new` (deliveries of `hooks`) as `sending`'s places
/// allow, [`FIRSTS`] at most, more as earlier ones end, until each has one or
/// [`FIRST_WAIT`] is over; then waits for them until then. Those started, by their
/// place in `new`.
pub async fn send_first(
    sending: &Sending,
    new: &[NewDelivery<'_>],
    hooks: &HashMap<&str, &Webhook>,
    token: &str,
) -> Vec<(usize, Arc<First>, Told)> {
    let deadline = tokio::time::Instant::now() + FIRST_WAIT;
    let (ended, mut endings) = tokio::sync::mpsc::channel::<()>(FIRSTS);
    let mut firsts = Vec::new();
    let mut started = vec![false; new.len()];
    // Endpoints found without room in this round: not asked again until the next.
    let mut full: HashSet<&str> = HashSet::new();
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
            if sending.slots.reserve(d.webhook, 1) == 0 {
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
