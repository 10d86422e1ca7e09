//! transfer-service: moves money between accounts stored in MongoDB with the
//! two-phase-commit pattern of the MongoDB tutorial "Perform Two Phase Commits", and
//! recovers by itself from a crash at any step.
//!
//! The map of the crate, from the outside in:
//! - [`config`]: typed settings from environment variables and flags.
//! - [`startup`]: builds the [`startup::Application`] (database, migrations, listener)
//!   and runs it until a shutdown token is cancelled.
//! - [`http`]: axum routes, request/response types (built from domain types),
//!   problem+json errors, OpenAPI.
//! - [`service`]: what the API asks for, in domain terms, through types that each own
//!   one concern: [`service::Requests`] (new transfers and their idempotency keys,
//!   admission, cancels, holds, reads), [`service::Driver`] (the protocol runs, drive
//!   locks, unanswered writes, the lease), [`service::AccountBook`], [`service::Feed`],
//!   [`service::WebhookBook`]; [`service::TransferService`] composes them
//!   (`service/mod.rs`: the types, their construction, and the list of the files beside
//!   it, one concern each). [`service::KeyBook`], beside it,
//!   keeps the API keys made through the API. [`service::protocol`] is the two-phase
//!   commit itself, one
//!   function per step; what a run sent without an answer is kept for every later run of
//!   the transfer in the process (`service/unanswered.rs`).
//! - [`store`]: the only module that speaks MongoDB or names BSON; one guarded write per
//!   step; its stored documents never leave it (it converts them to domain types). One
//!   [`store::Store`] per deployment, which hands out a view per collection or concern
//!   ([`store::Accounts`], [`store::Transfers`], ...); [`store::Deployments`] holds them
//!   all and reads across them (`docs/scaling.md`: what lives where).
//! - [`domain`]: newtypes that parse instead of validate, [`domain::Transfer`] and
//!   [`domain::Account`], [`domain::Entry`] (a numbered change to an account, written by
//!   the same write as the change: `store/entries.rs`), the transfer state machine, and [`domain::Strategy`] (how a
//!   transfer is carried out: two-phase commit or one native transaction). No axum, no
//!   driver.
//! - [`sweeper`]: the recovery task that finishes or rolls back what a crashed
//!   instance left behind, with the same step functions.
//! - [`lease`]: one lease type for the tasks that run on one instance at a time
//!   ([`lease::Lease`], judged by the database's clock, and the loop they run under it).
//! - [`recorder`]: the task that records each deployment's events from its change
//!   stream into its feed (`store::events`), under a lease, one instance at a time.
//! - [`deliverer`]: the webhook tasks, one file per concern (`deliverer/mod.rs` lists
//!   them): the dispatcher (one instance at a time, under a lease) makes a delivery per
//!   event and endpoint; every instance's sender claims and sends them; the attempt log
//!   writes each attempt to its delivery.
//! - [`telemetry`]: log set-up.
//! - [`error_chain`]: [`error_chain::Chain`], an error and its sources on one line for a
//!   log field; a leaf every layer logs with, naming no module of the crate.
//! - [`metrics`]: the Prometheus counters and histograms behind `GET /metrics`.
//! - [`retry`]: the retry policies, named (a resent write, start-up, a majority read,
//!   polling); a leaf like `error_chain`.
//!
//! Imports go downwards: http -> service -> store -> domain (the sweeper calls the
//! service and reads the store; config and telemetry, at the composition edge with
//! `main` and `startup`, name none of the layers), and no module imports itself through
//! others; `tests/architecture.rs` checks both on the source. Who may move a transfer is
//! decided in one place, `store::transfers::Mover`.
//!
//! Words that name one thing each:
//! - *insert*: step 1 of the protocol, a new transfer written `pending` and owned (a
//!   reversal's compensation `initial`) into its transfer log (`service/create.rs`,
//!   `Transfers::insert_transfer`, the `after_insert` point).
//! - *record*: the event [`recorder`], which records a deployment's changes as events.
//!   A webhook attempt is *logged* (the attempt log); an entry is *copied* out of its
//!   account's document (`store::entries::EntryCopier`).
//! - *mover*: [`store::transfers::Mover`], who may make a transfer's state change.
//! - *settle*: step 5, pay a receiving party in and pull every party's marker. A hold
//!   ends by being *resolved* (a capture, a void, an expiry: `Mover::Resolver`).
//!
//! `docs/architecture.md` draws how a request, a recovery and a cancel flow through
//! these modules.

/// `failpoint!(service, AfterDebit)`: with the `failpoints` feature, the point
/// `failpoints::Point::AfterDebit` of `service`'s instance, where a test may crash it
/// (`CRASH_AT=after_debit`), pause it or schedule it (see [`failpoints`]); a point that
/// does not exist does not compile. Without the feature, expands to nothing.
macro_rules! failpoint {
    ($service:expr, $point:ident) => {{
        #[cfg(feature = "failpoints")]
        $crate::failpoints::hit($crate::failpoints::Point::$point, $service.instance_id()).await;
    }};
    // The first point if `$first`, else the second.
    ($service:expr, if $first:expr => $a:ident else $b:ident) => {{
        #[cfg(feature = "failpoints")]
        {
            use $crate::failpoints::Point;
            let point = if $first { Point::$a } else { Point::$b };
            $crate::failpoints::hit(point, $service.instance_id()).await;
        }
    }};
}

pub mod config;
pub mod deliverer;
pub mod domain;
pub mod error_chain;
#[cfg(feature = "failpoints")]
pub mod failpoints;
pub mod http;
pub mod lease;
pub mod metrics;
pub mod recorder;
pub mod retry;
pub mod service;
pub mod startup;
pub mod store;
pub mod sweeper;
pub mod telemetry;
