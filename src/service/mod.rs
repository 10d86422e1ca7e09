//! The service layer: what the HTTP handlers (and the recovery sweeper) ask for, in
//! domain terms. It validates against the stored accounts, inserts transfers, runs the
//! two-phase commit ([`protocol`]) and answers with the domain's
//! [`Transfer`](crate::domain::Transfer) and [`Account`](crate::domain::Account), as
//! stored.
//!
//! - [`AccountBook::open_account`], [`AccountBook::account`],
//!   [`AccountBook::accounts`]: the account book.
//! - [`Requests::transfer`]: insert a transfer and run it (or start it in the
//!   background), with idempotency keys: a replay returns the existing transfer, never a
//!   second one.
//! - [`Requests::cancel`]: roll back a transfer that has not been applied, or
//!   reverse one that has with a compensating transfer.
//!
//! Each transfer request (and the sweeper's recoveries) is admitted first
//! (`admission.rs`: at most `MAX_TRANSFERS_IN_FLIGHT` at once; beyond, a request waits
//! its turn up to `ADMISSION_WAIT_MS`, then is refused), before anything is inserted.
//!
//! The service is split into types that each hold only what they use (see
//! `docs/architecture.md`, "The service's types"; `tests/architecture.rs` checks who
//! holds or names whom, and that nobody does in a cycle):
//! - [`Requests`] takes transfer requests and holds a [`Driver`] and an [`AccountBook`];
//! - [`Driver`] drives transfers, and knows nothing of requests;
//! - [`AccountBook`], [`Feed`] and [`WebhookBook`] hold only the deployments they read
//!   (and the placement cache, the followers, the webhook settings);
//! - [`Recovery`] is what the sweeper holds: the driver and admission;
//! - [`TransferService`] composes them and hands them out; it does no work itself.
//!
//! This file holds the types, their fields and their construction; each concern has a
//! file of its own, whose `impl` blocks are of the type named first:
//! - `error.rs`: [`ServiceError`], and the one mapping of a storage error onto it;
//! - `admission.rs` (Requests, Recovery): the permits of admission control, and the ways
//!   in;
//! - `accounts.rs` (AccountBook): the account book; `placement.rs` (AccountBook): where
//!   each account lives, found once and remembered; `ledger.rs` (AccountBook): an
//!   account's entries and its amounts as of a moment; `events.rs` (Feed): the event feed
//!   across the deployments; `follow.rs` (Feed): following it live, for the event stream
//!   and the webhook dispatcher; `webhooks.rs` (WebhookBook): registering endpoints, their
//!   deliveries, and where a delivery may connect;
//! - `create.rs` (Requests): a new transfer, inserted and run; `idempotency.rs`
//!   (Requests): its idempotency key, and replays;
//! - `reads.rs` (Requests, Driver): transfers as they stand now, and waiting for one to
//!   come to rest (the driver's, for the cancels and the reversals it finishes);
//! - `protocol.rs` (Driver): the two-phase commit, one function per step; `driving.rs`
//!   (Driver): the drive locks (one task per transfer in a process); `unanswered.rs`:
//!   what a run sent without an answer, which every later run respects; `routing.rs`
//!   (Driver): the store each write of a transfer goes to;
//! - `cancel.rs` (Requests, Driver): cancels and reversals (finishing an interrupted
//!   reversal is the driver's: the sweeper does it too); `holds.rs` (Requests, Driver):
//!   capturing and voiding holds, and expiring them (the driver's: a step that needs
//!   what an expired hold reserves expires it, and so does the sweeper). Cancel and holds
//!   call each other, so both are `Requests`;
//! - `readiness.rs` (Driver): each deployment's ping, for `/ready`;
//! - `tenancy.rs` (Requests, AccountBook): what a caller's scope sees; anything else is
//!   not found.
//!
//! Beside it, [`KeyBook`] (`api_keys.rs`), a type of its own that shares nothing with
//! transfers: the API keys made through the API.

mod accounts;
mod admission;
pub mod api_keys;
mod cancel;
mod create;
mod driving;
mod error;
mod events;
mod follow;
mod holds;
mod idempotency;
mod ledger;
mod placement;
pub mod protocol;
mod readiness;
mod reads;
mod routing;
mod tenancy;
mod unanswered;
mod webhooks;

pub use accounts::NewAccount;
pub(crate) use admission::AdmissionPermit;
pub use admission::{DEFAULT_ADMISSION_WAIT, DEFAULT_MAX_IN_FLIGHT};
pub use api_keys::{KeyBook, MadeKey};
pub use create::{Completion, NewTransfer, TransferOutcome};
pub use error::{ServiceError, ServiceResult};
pub use events::FeedPage;
pub use follow::{
    DEFAULT_MAX_FOLLOWERS, FollowEnd, Follower, FollowerLimit, QUEUE as FOLLOWER_QUEUE,
    QUEUE_BYTES as FOLLOWER_QUEUE_BYTES,
};
pub use holds::HoldConflict;
pub use ledger::FINAL_AFTER;
use placement::Placements;
pub use webhooks::{NewWebhook, UrlRefusal, WebhookSettings, allowed_addresses};

use std::sync::Arc;
use std::time::Duration;

use tokio_util::task::TaskTracker;

use crate::domain::{Strategy, TransferId};
use crate::store::{Deployments, Store};

/// The transfer service, as composed by start-up: the parts below, each holding only
/// what it uses, handed out to whoever needs them ([`TransferService::requests`],
/// [`TransferService::book`], [`TransferService::feed`], [`TransferService::webhooks`],
/// [`TransferService::driver`], [`TransferService::recovery`]). It does no work of its
/// own; it builds the parts and configures them.
#[derive(Clone)]
pub struct TransferService {
    /// Takes transfer requests; holds the [`Driver`] and the [`AccountBook`] it uses.
    requests: Requests,
    /// The event feed and its live followers.
    feed: Feed,
    /// Registered webhooks and their deliveries.
    webhooks: WebhookBook,
}

/// Drives transfers through the two-phase commit (`protocol.rs`, `protocol/parties.rs`):
/// [`Driver::run`] takes a stored transfer to its end, a fresh one as a recovered one,
/// and with it the hold expiries a step runs into (`holds.rs`) and the reversals a crash
/// interrupted (`cancel.rs`). Holds what a process shares between the tasks that drive:
/// the drive locks (`driving.rs`), the unanswered writes (`unanswered.rs`), the lease, and
/// the routing of each write to its deployment (`routing.rs`). Knows nothing of requests
/// (admission, idempotency, tenants).
#[derive(Clone)]
pub struct Driver {
    /// Every deployment the accounts live on (`DEPLOYMENTS`); see `store::deployments`
    /// for what lives where.
    deployments: Deployments,
    /// `INSTANCE_ID`: names this instance in logs and in its pause points (tests).
    instance_id: Arc<str>,
    /// Written to `application` on the transfers this process owns: the instance id plus
    /// a random incarnation, so that two processes never share a lease, not even a
    /// restart under the same `INSTANCE_ID` while writes of the dead process may still
    /// be on their way to the server (it waits for their lease like any other instance).
    owner: Arc<str>,
    /// Every protocol run and cancel (each in a task of its own, see
    /// `Requests::spawn_run`); shutdown waits for them.
    background: TaskTracker,
    /// Transfers this process is driving right now. Two drivers under one owner
    /// would share a lease, and a second driver's debit after the first one's pull would
    /// apply the transfer twice; so within a process one task at a time drives a transfer.
    driving:
        Arc<std::sync::Mutex<std::collections::HashMap<TransferId, Arc<tokio::sync::Mutex<()>>>>>,
    /// The writes of this process whose reply was lost and that may still land: every
    /// later run of their transfer respects them (see [`unanswered`]); the drive lock
    /// alone would let a second run pull the markers under a late step of the first.
    unanswered: Arc<unanswered::Unanswered>,
    /// The lease an instance holds on a transfer it works on, renewed by every state
    /// change; once it lapses (STALE_AFTER_MS) another instance may take over.
    stale_after: Duration,
}

/// Takes transfer requests: a new transfer (`create.rs`) with its idempotency key
/// (`idempotency.rs`), cancels and reversals (`cancel.rs`), captures and voids of holds
/// (`holds.rs`), reads of transfers (`reads.rs`) and whether a caller's scope sees or owns
/// one (`tenancy.rs`); each admitted first (`admission.rs`). Validates against the
/// [`AccountBook`] and hands the steps to the [`Driver`].
#[derive(Clone)]
pub struct Requests {
    /// Runs what a request inserted or resolved.
    driver: Driver,
    /// Where a new transfer's accounts live, and whether its caller sees them.
    book: AccountBook,
    /// Two-phase commit or native transactions for new transfers.
    strategy: Strategy,
    /// How long a hold lasts when its request does not say (`HOLD_EXPIRES_MS`).
    default_hold_expiry: Duration,
    /// Admission control (see [`admission`]): one permit per transfer this process
    /// works on (a new one, a cancel, a recovery), held until its run ends. A request
    /// that finds none waits for one, at most `ADMISSION_WAIT_MS`, then is refused
    /// ([`ServiceError::Overloaded`]), having inserted nothing. This bounds every queue
    /// behind it, so that a burst cannot push steps past their deadlines.
    admission: admission::Admission,
}

/// The account book: opening and reading accounts (`accounts.rs`), their entries and
/// amounts as of a moment (`ledger.rs`), where each lives (`placement.rs`), and whether a
/// caller's scope sees one (`tenancy.rs`).
#[derive(Clone)]
pub struct AccountBook {
    /// The deployments the accounts live on.
    deployments: Deployments,
    /// Where the accounts this process has seen live, their currencies and tenants (see
    /// [`Placements`]): a transfer between known accounts is validated and routed
    /// without a read.
    placements: Placements,
}

/// The event feed across the deployments (`events.rs`) and following it live
/// (`follow.rs`): for `GET /events`, the event stream and the webhook dispatcher.
#[derive(Clone)]
pub struct Feed {
    /// The deployments whose feeds are read and merged.
    deployments: Deployments,
    /// The live followers of the feed and their signal (see [`follow`]).
    followers: follow::Followers,
}

/// Webhooks, on the service side (`webhooks.rs`): registering endpoints, their
/// deliveries, and the settings the deliverer sends them with. Named apart from the
/// stored [`Webhook`](crate::domain::Webhook).
#[derive(Clone)]
pub struct WebhookBook {
    /// Webhooks and deliveries live on the first deployment.
    deployments: Deployments,
    /// How webhooks are delivered (`WEBHOOK_*`).
    webhook_settings: WebhookSettings,
}

/// What the recovery sweeper holds: the [`Driver`], which resumes transfers, expires
/// holds and finishes reversals, and admission, so that its recoveries queue with new work
/// for the same permits (`admission.rs`).
#[derive(Clone)]
pub struct Recovery {
    driver: Driver,
    /// The requests' admission, shared.
    admission: admission::Admission,
}

/// How long a hold lasts unless its request or `HOLD_EXPIRES_MS` says otherwise: 7 days.
pub const DEFAULT_HOLD_EXPIRY: Duration = Duration::from_secs(7 * 24 * 3600);

impl TransferService {
    /// A service over one deployment (a [`Store`]) or several ([`Deployments`]).
    pub fn new(
        deployments: impl Into<Deployments>,
        instance_id: impl Into<Arc<str>>,
        stale_after: Duration,
    ) -> TransferService {
        let instance_id: Arc<str> = instance_id.into();
        let incarnation = format!("{:08x}", rand::random::<u32>());
        let deployments = deployments.into().named(&instance_id);
        let driver = Driver {
            deployments: deployments.clone(),
            owner: format!("{instance_id}/{incarnation}").into(),
            instance_id,
            background: TaskTracker::new(),
            driving: Arc::default(),
            unanswered: Arc::new(unanswered::Unanswered::new(stale_after)),
            stale_after,
        };
        let book = AccountBook {
            deployments: deployments.clone(),
            placements: Placements::bounded(placement::KNOWN_ACCOUNTS_MAX),
        };
        TransferService {
            requests: Requests {
                driver,
                book,
                strategy: Strategy::TwoPhase,
                default_hold_expiry: DEFAULT_HOLD_EXPIRY,
                admission: admission::Admission::new(DEFAULT_MAX_IN_FLIGHT, DEFAULT_ADMISSION_WAIT),
            },
            feed: Feed {
                deployments: deployments.clone(),
                followers: follow::Followers::new(DEFAULT_MAX_FOLLOWERS, DEFAULT_MAX_FOLLOWERS),
            },
            webhooks: WebhookBook {
                deployments,
                webhook_settings: WebhookSettings::default(),
            },
        }
    }

    /// Fault injection: another task of this same process, as the interleaving explorer
    /// (`tests/explorer/`) runs two actors of one process. It shares everything the
    /// process shares between its tasks (the owner written to `application`, the drive
    /// locks, the deadlines of unanswered writes, admission, the account cache, the
    /// background tasks, the feed's followers), but names its points, and its store
    /// handles' points, with `instance_id`, so that a scheduler, a pause or a held-back
    /// step can tell it from its siblings: in every part alike.
    #[cfg(feature = "failpoints")]
    pub fn sibling(&self, instance_id: &str) -> TransferService {
        let deployments = self.deployments().named(instance_id);
        let driver = Driver {
            deployments: deployments.clone(),
            instance_id: instance_id.into(),
            ..self.requests.driver.clone()
        };
        let book = AccountBook {
            deployments: deployments.clone(),
            ..self.requests.book.clone()
        };
        TransferService {
            requests: Requests {
                driver,
                book,
                ..self.requests.clone()
            },
            feed: Feed {
                deployments: deployments.clone(),
                ..self.feed.clone()
            },
            webhooks: WebhookBook {
                deployments,
                ..self.webhooks.clone()
            },
        }
    }

    /// Transfers carried out by `strategy`.
    pub fn with_strategy(mut self, strategy: Strategy) -> TransferService {
        self.requests.strategy = strategy;
        self
    }

    /// Holds whose request does not say last this long (`HOLD_EXPIRES_MS`).
    pub fn with_default_hold_expiry(mut self, default_hold_expiry: Duration) -> TransferService {
        self.requests.default_hold_expiry = default_hold_expiry;
        self
    }

    /// At most `limit` transfers in flight in this process (`MAX_TRANSFERS_IN_FLIGHT`).
    pub fn with_max_in_flight(mut self, limit: usize) -> TransferService {
        self.requests.admission = self.requests.admission.limited(limit);
        self
    }

    /// A request beyond the limit waits this long for a permit before it is refused
    /// (`ADMISSION_WAIT_MS`); zero refuses it at once.
    pub fn with_admission_wait(mut self, wait: Duration) -> TransferService {
        self.requests.admission = self.requests.admission.waiting(wait);
        self
    }

    /// Requests wait for a permit only while one of the connection places `places`
    /// (one per connection served, `MAX_CONNECTIONS` in all) is free: see [`admission`].
    pub fn with_connection_places(
        mut self,
        places: Arc<tokio::sync::Semaphore>,
    ) -> TransferService {
        let room = admission::Room { places };
        self.requests.admission = self.requests.admission.within(room);
        self
    }

    /// At most `max` followers of the feed at once (`MAX_EVENT_STREAMS`), `share` of them
    /// per scope (`MAX_EVENT_STREAMS_PER_TENANT`).
    pub fn with_max_followers(self, max: usize, share: usize) -> TransferService {
        TransferService {
            feed: self.feed.clone().with_max_followers(max, share),
            ..self
        }
    }

    /// Webhooks are configured with `settings` (`WEBHOOK_*`).
    pub fn with_webhook_settings(self, settings: WebhookSettings) -> TransferService {
        TransferService {
            webhooks: self.webhooks.clone().with_webhook_settings(settings),
            ..self
        }
    }

    /// Transfer requests: create, cancel, capture, void, read.
    pub fn requests(&self) -> &Requests {
        &self.requests
    }

    /// The account book.
    pub fn book(&self) -> &AccountBook {
        &self.requests.book
    }

    /// The event feed and its followers.
    pub fn feed(&self) -> &Feed {
        &self.feed
    }

    /// Webhooks and their deliveries.
    pub fn webhooks(&self) -> &WebhookBook {
        &self.webhooks
    }

    /// What drives transfers (the requests' own).
    pub fn driver(&self) -> &Driver {
        &self.requests.driver
    }

    /// What the recovery sweeper holds.
    pub fn recovery(&self) -> Recovery {
        Recovery {
            driver: self.requests.driver.clone(),
            admission: self.requests.admission.clone(),
        }
    }

    /// Every deployment, which every part reads or writes.
    pub fn deployments(&self) -> &Deployments {
        &self.requests.driver.deployments
    }

    /// The first deployment's store (the only one, unless `DEPLOYMENTS` lists several).
    pub fn store(&self) -> &Store {
        self.deployments().first()
    }
}

impl Driver {
    pub fn stale_after(&self) -> Duration {
        self.stale_after
    }

    pub fn deployments(&self) -> &Deployments {
        &self.deployments
    }

    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// What this process writes to `application`: see [`Driver`]'s `owner`.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The protocol runs and cancels in flight, so that shutdown can wait for them.
    pub fn background_tasks(&self) -> &TaskTracker {
        &self.background
    }
}

impl Requests {
    /// What drives the transfers these requests make.
    pub fn driver(&self) -> &Driver {
        &self.driver
    }

    /// The account book these requests validate against.
    pub fn book(&self) -> &AccountBook {
        &self.book
    }

    pub fn default_hold_expiry(&self) -> Duration {
        self.default_hold_expiry
    }

    /// The driver's: names this instance's pause points.
    #[cfg(feature = "failpoints")]
    fn instance_id(&self) -> &str {
        self.driver.instance_id()
    }
}

impl AccountBook {
    /// Names this instance's pause points: its stores are named after the instance.
    #[cfg(feature = "failpoints")]
    fn instance_id(&self) -> &str {
        self.deployments.first().instance_id()
    }
}

impl Recovery {
    /// What resumes transfers, expires holds and finishes reversals.
    pub fn driver(&self) -> &Driver {
        &self.driver
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A service whose store points at a port nothing listens on: the client connects
    /// lazily, so nothing here reaches a server.
    pub(super) async fn offline_service(stale_after: Duration) -> TransferService {
        let store = Store::connect("mongodb://127.0.0.1:9/", "unused")
            .await
            .unwrap();
        TransferService::new(store, "unit", stale_after)
    }

    /// A sibling (the explorer's second actor of one process) names its points, and its
    /// store handles' points, after itself, so that a pause or a scheduler can tell its
    /// writes from its parent's; and it shares its parent's owner.
    #[cfg(feature = "failpoints")]
    #[tokio::test]
    async fn a_sibling_names_its_points_and_its_stores_points_after_itself() {
        let service = offline_service(Duration::from_secs(1)).await;
        let sibling = service.sibling("unit-2");
        assert_eq!(sibling.driver().instance_id(), "unit-2");
        assert_eq!(sibling.book().instance_id(), "unit-2");
        let parts = [
            &sibling.driver().deployments,
            &sibling.book().deployments,
            &sibling.feed().deployments,
            &sibling.webhooks().deployments,
        ];
        for deployments in parts {
            let names: Vec<_> = deployments.all().iter().map(|s| s.instance_id()).collect();
            assert_eq!(names, ["unit-2"]);
        }
        assert_eq!(sibling.driver().owner(), service.driver().owner());
    }
}
