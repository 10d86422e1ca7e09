//! Webhook deliveries (`docs/webhooks.md`): two tasks per instance.
//!
//! - The **dispatcher** ([`dispatcher`]) follows the event feed with a cursor kept in the
//!   database and, for each event, makes a delivery to every webhook that wants its type
//!   and was registered before it (`store::webhooks`). One instance at a time
//!   dispatches, under a lease ([`crate::lease`]); a dispatch repeated after a crash or a
//!   takeover is refused by the delivery's id, so each event reaches each endpoint
//!   through one delivery.
//! - Every delivery is sent under a **claim** (a lease per delivery, by the database's
//!   clock): `POST`ed, signed as Standard Webhooks say ([`signing`]), then its attempt
//!   written to the delivery by the **attempt log** ([`attempt_log`]) if the claim still
//!   holds. The dispatcher makes the deliveries its instance has room for already
//!   claimed, and starts them at once ([`firsts`]); the **sender** ([`sender`]) of every
//!   instance claims the others when due (retries, those no dispatcher had room for,
//!   those whose claim ran out). A killed instance's claim runs out and another instance
//!   sends the delivery again: at least once, with the same `webhook-id`.
//!
//! The files, one concern each:
//! - [`addresses`]: the HTTP client and where it may connect.
//! - [`signing`]: the Standard Webhooks headers of an attempt.
//! - [`dispatcher`]: the dispatcher's task, under its lease, page by page.
//! - [`pages`]: what a page of events makes: how many events a page reads, which
//!   webhook wants which event, and the batches, bounded by bytes.
//! - [`firsts`]: the first attempts the dispatcher starts before it makes their
//!   deliveries.
//! - [`handover`]: where a first attempt hands its outcome to the dispatcher.
//! - [`slots`]: this instance's places: attempts in flight, per endpoint and in all, and
//!   deliveries held claimed.
//! - [`sender`]: the claim rounds, and starting an attempt.
//! - [`attempt`]: one attempt: its request, its answer, what it decides.
//! - [`attempt_log`]: finished attempts written to their deliveries, many to a command.
//!
//! Claims and attempts are batched: a round claims what is due with one `updateMany`,
//! and finished attempts are written many to a command, each guarded by its claim.
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
//! SecantusDB does not enforce: `tests/webhook_dispatch.rs` keeps every command and
//! checks it); each event's body is rendered once and shared by its deliveries in
//! memory; at most [`FIRSTS`] attempts of a batch go out before their deliveries are
//! written.
//!
//! Where a delivery may connect is checked at each attempt against the address actually
//! connected to ([`addresses`]).
//!
//! What it holds of the service: the sender, the attempts and the attempt log hold the
//! store of the first deployment (where webhooks and deliveries live) and the webhook
//! settings, both from the [`WebhookBook`]; the dispatcher holds the [`Feed`] too, for
//! its pages and its signal. Nothing here holds the rest of the service (the requests,
//! the driver, the account book).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::domain::Event;
use crate::error_chain::Chain;
use crate::service::{Feed, WebhookBook};

pub mod addresses;
pub mod attempt;
pub mod attempt_log;
pub mod dispatcher;
pub mod firsts;
pub mod handover;
pub mod pages;
pub mod sender;
pub mod signing;
pub mod slots;

pub use firsts::FIRSTS;
pub use pages::{BATCH, COMMAND_BYTES, PAGE_PAIRS, batch};

/// How an event is sent: the body of every attempt, rendered once when its deliveries are
/// made (the feed's JSON of the event, from the HTTP layer).
pub type Render = Arc<dyn Fn(&Event) -> String + Send + Sync>;

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

/// Dispatches and sends webhooks for this instance (`owner`), until `shutdown`.
pub async fn run(
    feed: Feed,
    webhooks: WebhookBook,
    owner: String,
    render: Render,
    shutdown: CancellationToken,
) {
    let settings = webhooks.webhook_settings();
    let client = match addresses::client(settings.allow_private) {
        Ok(client) => client,
        Err(e) => {
            tracing::error!(error = %Chain(&e), "no HTTP client for webhooks; none will be sent");
            return;
        }
    };
    // Where webhooks and deliveries live.
    let store = webhooks.store().clone();
    let (log, to_log) = attempt_log::channel();
    let attempt_log = tokio::spawn(attempt_log::run(store.clone(), to_log));
    let sending = Arc::new(sender::Sending::new(store.clone(), client, settings, log));
    // Told by this instance's dispatcher when it made deliveries it could not take itself,
    // so that its sender need not wait for its next look (another instance's are found
    // by that look).
    let made = Arc::new(tokio::sync::Notify::new());
    let dispatcher = tokio::spawn(dispatcher::run(
        feed,
        webhooks,
        owner.clone(),
        render,
        sending.clone(),
        made.clone(),
        shutdown.clone(),
    ));
    let sender = sender::Sender::new(store, owner, sending, made);
    sender.run(shutdown).await;
    let _ = dispatcher.await;
    // The attempts under way finish and are logged; those not logged are sent again
    // once their claims run out.
    let _ = attempt_log.await;
}
