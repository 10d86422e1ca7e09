//! The only module that speaks MongoDB.
//!
//! It owns the stored document shapes ([`documents`]) and the names of their fields
//! ([`fields`], the one list every filter, update and pipeline spells them from), the migrations applied at start-up
//! ([`migrations`]), and one function per database operation of the protocol
//! ([`accounts`], [`transfers`]). Every state change is a single guarded write that
//! reports whether it won; the caller decides what losing means.
//!
//! [`Store`] is one deployment's connection handle: its deployment's name, the database,
//! the clock readings, the group-commit queues, the answering/migrated flags and the
//! instance it writes for. Itself it only connects, pings, reads the clock and applies
//! the migrations; every read or write of documents is a method of a small view it hands
//! out, which holds only its collections and the shared pieces it uses
//! (`tests/architecture.rs` checks that no other method lands on `Store`, that each type's
//! methods live in one file, and that the views never ask for one another):
//!
//! | view | collections | shared pieces |
//! |---|---|---|
//! | [`Store::accounts`] -> [`Accounts`] | `accounts` | clock, batches (and the entry copier), availability, actor |
//! | [`Store::transfers`] -> [`Transfers`] | `transactions`, `idempotencyKeys` (a key is taken with its transfer) | clock, batches, actor |
//! | [`Store::entries`] -> [`Entries`] | `entries`, and `accounts` read for the entries not moved yet | none |
//! | [`Store::events`] -> [`Events`] | `events`, `eventRecorder`; an older feed's change stream | clock |
//! | [`Events::rounds`] -> [`events::Rounds`] | the recorder's rounds: `events`, `eventRecorder`, the marks of due events in `transactions` and `accounts` | clock |
//! | [`Store::webhooks`] -> [`Webhooks`] | `webhooks`, `deliveries`, `webhookDispatcher`, `webhookCaps` | clock |
//! | [`Store::atomic`] -> [`Atomic`] | `transactions` and `accounts` in one transaction (the native strategy) | clock, the entry copier |
//! | [`Store::directory`] -> [`Directory`] | `accountDirectory` (the first deployment's) | none |
//!
//! [`ApiKeyStore`] (`apiKeys`) is a type of its own, built from [`Store::database`]. A
//! view borrows its store and is `Copy`; its methods take it by value, so a future of
//! one (`store.transfers().transfer(id)`) lives as long as the store, not the view.
//!
//! Invariants kept here:
//! - every write goes through a [`mongodb::Database`] handle whose write concern is
//!   majority with journal, so an acknowledged step survives a crash of the database;
//! - every driver error becomes a [`StoreError`] in [`StoreError::from`], the one place
//!   that decides which failures mean "the database is unavailable".

pub mod accounts;
pub mod api_keys;
mod batch;
mod clock;
pub mod deployments;
mod documents;
pub mod entries;
pub mod events;
pub mod fields;
mod guards;
pub mod migrations;
pub mod native;
pub mod transfers;
pub mod webhooks;

use std::time::Duration;

use mongodb::bson::{Document, doc};
use mongodb::error::{ErrorKind, WriteFailure};
use mongodb::event::EventHandler;
use mongodb::event::command::CommandEvent;
use mongodb::options::{Acknowledgment, ClientOptions, DatabaseOptions, ReadConcern, WriteConcern};
use mongodb::{Client, Collection, Database};

use backon::Retryable;

use crate::domain::{DeploymentName, Timestamp, TransferId};
use crate::metrics::DbOutcome;
use crate::retry;

pub use accounts::{Accounts, Preparing};
pub use api_keys::ApiKeyStore;
pub use batch::DEFAULT_GROUP_COMMIT_WRITES;
pub use clock::Clock;
pub use deployments::{Deployments, Directory};
pub use documents::new_transfer_id;
use documents::{AccountDoc, TransferDoc};
pub use entries::Entries;
pub use events::Events;
pub use native::Atomic;
pub use transfers::Transfers;
pub use webhooks::Webhooks;

/// The group-commit writers and the stored shapes, for the tests that call the writers
/// with hand-made batches; built only with the `failpoints` feature, like every other
/// test hook.
#[cfg(feature = "failpoints")]
pub mod testing {
    pub use super::batch::{
        AccountChange, MAX_BATCH, Pull, Settle, Transition, change_accounts,
        change_accounts_after_a_move, insert_transfers, pull_markers, settle_parties,
        transition_all,
    };
    pub use super::documents::{AccountDoc, TransferDoc, object_id, transfer_id};

    use mongodb::bson::Document;
    use mongodb::event::command::CommandEvent;

    /// Every command a store sent: its name and the command document.
    pub type SentCommands = std::sync::Arc<std::sync::Mutex<Vec<(String, Document)>>>;

    /// [`super::Store::connect_with`], also keeping every command it sends (for the
    /// test of the query shapes a sharded cluster needs).
    pub async fn connect_keeping_commands(
        deployment: crate::domain::DeploymentName,
        uri: &str,
        database: &str,
    ) -> super::StoreResult<(super::Store, SentCommands)> {
        let sent = SentCommands::default();
        let sink = sent.clone();
        let handler = mongodb::event::EventHandler::callback(move |event| {
            if let CommandEvent::Started(e) = event {
                let mut sink = sink.lock().unwrap_or_else(|e| e.into_inner());
                sink.push((e.command_name.clone(), e.command.clone()));
            }
        });
        let store = super::Store::connect_observed(
            deployment,
            uri,
            database,
            super::batch::DEFAULT_GROUP_COMMIT_WRITES,
            Some(handler),
        )
        .await?;
        Ok((store, sent))
    }
}

/// How long the driver looks for a usable server before an operation fails. Short, so
/// that a request answers 503 in bounded time while the database is down.
const SERVER_SELECTION_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a write waits for the majority to acknowledge it.
const WRITE_CONCERN_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a read may run on the server (`maxTimeMS`): a read that has not answered
/// by then fails as unavailable instead of holding a connection and its caller.
pub const READ_TIME_LIMIT: Duration = Duration::from_secs(2);
/// Connections per client of an instance (it has two per deployment: the group-commit
/// writers' and the rest's): enough for every concurrent step of a busy instance, bounded
/// so that many instances cannot exhaust the server's connection limit.
const MAX_POOL_SIZE: u32 = 64;

/// A failed database operation, classified for the caller; what went wrong underneath is
/// its source ([`Cause`]), for the log.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached or cannot accept the write now (no primary, network
    /// failure, shutdown, time-out). Retrying later may succeed; HTTP says 503.
    #[error("the database is unavailable")]
    Unavailable(#[source] Cause),
    /// A step kept losing to concurrent writers of the same documents until its caller's
    /// rounds ran out: other requests' steps on a hot account, a transfer or hold that
    /// kept moving under a cancel or a capture, another request with the same idempotency
    /// key whose write is not readable yet, a native transaction that kept meeting write
    /// conflicts. Nothing is wrong with the database, and what was inserted stands:
    /// `transfer`, when there is one, is finished by its driver or the sweeper. Retrying
    /// shortly may succeed; HTTP says 503 `contended`, with `Retry-After`.
    #[error("kept losing to concurrent writers")]
    Contended {
        /// The transfer the step was on, when one is inserted (the answer names it).
        transfer: Option<TransferId>,
        #[source]
        cause: Cause,
    },
    /// A unique index refused the write (an `_id` or idempotency key already taken).
    #[error("a unique index refused the write")]
    DuplicateKey(#[source] Cause),
    /// What the database holds or answered is not what this version reads: a stored
    /// value the domain refuses (a document written by hand, or by a version that allowed
    /// what this one does not), stored data that breaks an invariant (entries with a
    /// hole), a reply without a field it always has. HTTP says 500, opaquely.
    #[error("the database holds or answered what this version cannot read")]
    Malformed(#[source] Cause),
    /// The database refused the operation for a reason that retrying does not change (a
    /// command error that is neither about availability nor a duplicate key: not
    /// authorized, a document too large, a feature the server lacks). HTTP says 500,
    /// opaquely.
    #[error("the database refused the operation")]
    Refused(#[source] Cause),
    /// This instance's settings or build do not match the database: a deployment the
    /// data names but `DEPLOYMENTS` does not, a URI that does not parse, a migration
    /// changed after it was applied. HTTP says 500, opaquely.
    #[error("the settings do not match the database")]
    Misconfigured(#[source] Cause),
}

impl StoreError {
    /// [`StoreError::Contended`] on `transfer` (when one is inserted), for `what`.
    pub fn contended(transfer: Option<TransferId>, what: impl Into<Cause>) -> StoreError {
        StoreError::Contended {
            transfer,
            cause: what.into(),
        }
    }

    /// The transfer the error is about, when it names one (only
    /// [`StoreError::Contended`] does): what its answer names.
    pub fn transfer(&self) -> Option<TransferId> {
        match self {
            StoreError::Contended { transfer, .. } => *transfer,
            _ => None,
        }
    }
}

/// The cause of a [`StoreError`]: the driver's error, with its own sources, or what the
/// code found wrong itself.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Cause {
    #[error(transparent)]
    Driver(#[from] mongodb::error::Error),
    #[error("{0}")]
    Found(String),
}

impl From<String> for Cause {
    fn from(what: String) -> Cause {
        Cause::Found(what)
    }
}

impl From<&str> for Cause {
    fn from(what: &str) -> Cause {
        Cause::Found(what.to_owned())
    }
}

/// MongoDB error codes that mean "not now" rather than "never": shutdown, failover and
/// time-outs. https://www.mongodb.com/docs/manual/reference/error-codes/
const UNAVAILABLE_CODES: &[i32] = &[
    6,     // HostUnreachable
    7,     // HostNotFound
    50,    // MaxTimeMSExpired
    64,    // WriteConcernFailed (wtimeout)
    89,    // NetworkTimeout
    91,    // ShutdownInProgress
    189,   // PrimarySteppedDown
    262,   // ExceededTimeLimit
    9001,  // SocketException
    10107, // NotWritablePrimary
    11600, // InterruptedAtShutdown
    11602, // InterruptedDueToReplStateChange
    13435, // NotPrimaryNoSecondaryOk
    13436, // NotPrimaryOrSecondary
];

impl From<mongodb::error::Error> for StoreError {
    fn from(err: mongodb::error::Error) -> Self {
        match err.kind.as_ref() {
            ErrorKind::ServerSelection { .. }
            | ErrorKind::Io(_)
            | ErrorKind::ConnectionPoolCleared { .. }
            | ErrorKind::Shutdown => StoreError::Unavailable(err.into()),
            ErrorKind::Write(WriteFailure::WriteError(e)) if e.code == 11000 => {
                StoreError::DuplicateKey(err.into())
            }
            ErrorKind::Write(WriteFailure::WriteError(e))
                if UNAVAILABLE_CODES.contains(&e.code) =>
            {
                StoreError::Unavailable(err.into())
            }
            ErrorKind::Write(WriteFailure::WriteConcernError(_)) => {
                StoreError::Unavailable(err.into())
            }
            // A batched insert: the primary may have it, the majority did not say so.
            ErrorKind::InsertMany(f) if f.write_concern_error.is_some() => {
                StoreError::Unavailable(err.into())
            }
            ErrorKind::InsertMany(f) => {
                let codes: Vec<i32> = f.write_errors.iter().flatten().map(|e| e.code).collect();
                if codes.iter().any(|c| UNAVAILABLE_CODES.contains(c)) {
                    StoreError::Unavailable(err.into())
                } else if !codes.is_empty() && codes.iter().all(|&c| c == 11000) {
                    StoreError::DuplicateKey(err.into())
                } else {
                    StoreError::Refused(err.into())
                }
            }
            ErrorKind::Command(e) if e.code == 11000 => StoreError::DuplicateKey(err.into()),
            ErrorKind::Command(e) if UNAVAILABLE_CODES.contains(&e.code) => {
                StoreError::Unavailable(err.into())
            }
            _ if err.contains_label("RetryableWriteError")
                || err.contains_label("TransientTransactionError") =>
            {
                StoreError::Unavailable(err.into())
            }
            _ => StoreError::Refused(err.into()),
        }
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

/// One deployment's collections, with majority+journal writes.
#[derive(Clone, Debug)]
pub struct Store {
    /// The deployment this handle speaks to (`DEPLOYMENTS`): what its accounts and log
    /// lines say when read, and the label of its metrics.
    deployment: DeploymentName,
    db: Database,
    accounts: Collection<AccountDoc>,
    transactions: Collection<TransferDoc>,
    /// `idempotencyKeys`: one document per key, `_id` the key in its scope
    /// (`documents::stored_key`), naming the transfer it made. Its own `_id` makes a key unique, so the guarantee holds when `transactions`
    /// is sharded (a unique index there must start with the shard key).
    keys: Collection<Document>,
    /// `entries`: the ledger entries moved out of the account documents (see
    /// [`entries`]).
    entries: Collection<documents::EntryDoc>,
    /// `accountDirectory`: every account id and its deployment (see [`deployments`]);
    /// used on the first deployment only.
    directory: Collection<Document>,
    /// Group commit of the protocol's writes (see [`batch`]).
    batches: std::sync::Arc<batch::Batches>,
    /// The database's clock as last read (see [`clock`]), shared by every clone.
    clock: std::sync::Arc<clock::ServerClock>,
    /// The instance this handle writes for; names its pause points in the tests
    /// (`failpoints`). Empty for a handle that belongs to no instance.
    actor: std::sync::Arc<str>,
    /// Whether the deployment may be asked now (see [`Availability`]), shared by every
    /// clone.
    availability: std::sync::Arc<Availability>,
}

/// Whether a deployment may be asked now: the guard a view consults before it sends a
/// write again ([`Store::is_answering`]).
#[derive(Debug)]
pub(crate) struct Availability {
    /// False while [`Deployments::watch`] finds the deployment not answering: the service
    /// then refuses at once what would touch it, instead of holding a request, an
    /// admission permit and a connection for the driver's time-outs. Only a shortcut to
    /// the answer the database would give: not sending a write is always safe.
    answering: std::sync::atomic::AtomicBool,
    /// False while the migrations of this deployment have not been applied (it did not
    /// answer at start-up, see `startup`): refused like a deployment that does not answer.
    migrated: std::sync::atomic::AtomicBool,
}

impl Availability {
    /// Whether the deployment answered the last time it was watched and its migrations
    /// are applied; true when nothing watches it.
    pub(crate) fn is_answering(&self) -> bool {
        self.answering.load(std::sync::atomic::Ordering::Relaxed)
            && self.migrated.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Store {
    /// Builds the client. Does not wait for the server: the driver connects lazily, and
    /// the first operation fails with [`StoreError::Unavailable`] if nothing answers.
    /// The handle is the `default` deployment.
    pub async fn connect(uri: &str, database: &str) -> StoreResult<Store> {
        Store::connect_with(
            DeploymentName::default(),
            uri,
            database,
            batch::DEFAULT_GROUP_COMMIT_WRITES,
        )
        .await
    }

    /// [`Store::connect`] to the deployment `deployment`, with at most
    /// `group_commit_writes` batched writes in flight.
    pub async fn connect_with(
        deployment: DeploymentName,
        uri: &str,
        database: &str,
        group_commit_writes: usize,
    ) -> StoreResult<Store> {
        Store::connect_observed(deployment, uri, database, group_commit_writes, None).await
    }

    /// [`Store::connect_with`], with `observer` seeing every command instead of the
    /// metrics' timer (a test hook).
    async fn connect_observed(
        deployment: DeploymentName,
        uri: &str,
        database: &str,
        group_commit_writes: usize,
        observer: Option<EventHandler<CommandEvent>>,
    ) -> StoreResult<Store> {
        // The driver's message may quote the URI, which may carry a password: not echoed.
        let mut options = ClientOptions::parse(uri).await.map_err(|_| {
            StoreError::Misconfigured(
                format!("the URI of deployment {deployment} is not valid").into(),
            )
        })?;
        options
            .app_name
            .get_or_insert_with(|| "transfer-service".to_owned());
        options.server_selection_timeout = Some(SERVER_SELECTION_TIMEOUT);
        options
            .connect_timeout
            .get_or_insert(Duration::from_secs(3));
        options.max_pool_size.get_or_insert(MAX_POOL_SIZE);
        // The group-commit writers have a client of their own, which times its commands
        // itself (`timed`): with a command event handler the driver copies every command
        // and reply into a `Document` for it, and the writers' pipelines are the largest
        // commands the service sends (without those copies, the service spent a fifth less
        // CPU per transfer at 128 clients: `docs/benchmark/decisions.md`). A test's
        // observer sees both clients' commands. Each client opens connections as it needs
        // them, up to the pool's bound.
        let mut writer_options = options.clone();
        writer_options.command_event_handler = observer.clone();
        options.command_event_handler =
            Some(observer.unwrap_or_else(|| command_timer(deployment.clone())));
        let client = Client::with_options(options).map_err(StoreError::from)?;
        let writers = Client::with_options(writer_options).map_err(StoreError::from)?;
        let database_options = DatabaseOptions::builder()
            .write_concern(majority_journaled())
            .read_concern(ReadConcern::majority())
            .build();
        Ok(Store::new(
            deployment,
            group_commit_writes,
            client.database_with_options(database, database_options.clone()),
            writers.database_with_options(database, database_options),
        ))
    }

    /// Must run inside a tokio runtime: it starts the group-commit tasks.
    fn new(
        deployment: DeploymentName,
        group_commit_writes: usize,
        db: Database,
        writers: Database,
    ) -> Store {
        Store {
            batches: batch::Batches::start(&writers, group_commit_writes, deployment.clone()),
            deployment,
            accounts: db.collection("accounts"),
            transactions: db.collection("transactions"),
            keys: db.collection("idempotencyKeys"),
            entries: db.collection("entries"),
            directory: db.collection("accountDirectory"),
            clock: Default::default(),
            actor: "".into(),
            availability: std::sync::Arc::new(Availability {
                answering: std::sync::atomic::AtomicBool::new(true),
                migrated: std::sync::atomic::AtomicBool::new(true),
            }),
            db,
        }
    }

    /// This handle, writing for `instance`: its pause points carry that name.
    pub fn named(&self, instance: &str) -> Store {
        Store {
            actor: instance.into(),
            ..self.clone()
        }
    }

    /// The instance this handle writes for (the name of its pause points).
    pub fn instance_id(&self) -> &str {
        &self.actor
    }

    /// The deployment this handle speaks to.
    pub fn deployment(&self) -> &DeploymentName {
        &self.deployment
    }

    pub fn database(&self) -> &Database {
        &self.db
    }

    /// The database's clock as this deployment's views read it.
    fn clock(&self) -> Clock<'_> {
        Clock {
            db: &self.db,
            clock: &self.clock,
            deployment: &self.deployment,
        }
    }

    /// The account book's `accounts`: the protocol's steps on an account, its fences,
    /// its reads.
    pub fn accounts(&self) -> Accounts<'_> {
        Accounts {
            accounts: &self.accounts,
            batches: &self.batches,
            clock: self.clock(),
            deployment: &self.deployment,
            availability: &self.availability,
            #[cfg(feature = "failpoints")]
            actor: &self.actor,
        }
    }

    /// The transfer log, `transactions`, with the idempotency keys.
    pub fn transfers(&self) -> Transfers<'_> {
        Transfers {
            transactions: &self.transactions,
            keys: &self.keys,
            batches: &self.batches,
            clock: self.clock(),
            deployment: &self.deployment,
            #[cfg(feature = "failpoints")]
            actor: &self.actor,
        }
    }

    /// The ledger's reads: `entries` and the entries not moved yet out of `accounts`.
    pub fn entries(&self) -> Entries<'_> {
        Entries {
            entries: &self.entries,
            accounts: &self.accounts,
        }
    }

    /// The event feed and its recorder.
    pub fn events(&self) -> Events<'_> {
        Events {
            db: &self.db,
            clock: self.clock(),
            deployment: &self.deployment,
        }
    }

    /// The webhooks, their deliveries, the dispatcher and the registration caps.
    pub fn webhooks(&self) -> Webhooks<'_> {
        Webhooks {
            db: &self.db,
            clock: self.clock(),
        }
    }

    /// The native strategy's transaction on `transactions` and `accounts`.
    pub fn atomic(&self) -> Atomic<'_> {
        Atomic {
            db: &self.db,
            transactions: &self.transactions,
            accounts: &self.accounts,
            batches: &self.batches,
            clock: self.clock(),
            deployment: &self.deployment,
        }
    }

    /// The account directory, `accountDirectory` (the first deployment's is the one used).
    pub fn directory(&self) -> Directory<'_> {
        Directory {
            directory: &self.directory,
        }
    }

    /// Whether the deployment answered the last time it was watched and its migrations
    /// are applied (see [`Availability`]); true when nothing watches it.
    pub fn is_answering(&self) -> bool {
        self.availability.is_answering()
    }

    /// Marks this deployment's migrations applied or not (see [`Store::is_answering`]).
    pub fn set_migrated(&self, migrated: bool) {
        self.availability
            .migrated
            .store(migrated, std::sync::atomic::Ordering::Relaxed);
    }

    /// [`StoreError::Unavailable`] at once while the deployment is known not to answer.
    pub fn check_answering(&self) -> StoreResult<()> {
        if self.is_answering() {
            Ok(())
        } else {
            Err(StoreError::Unavailable(
                format!("deployment {} does not answer", self.deployment).into(),
            ))
        }
    }

    fn set_answering(&self, answering: bool) -> bool {
        self.availability
            .answering
            .swap(answering, std::sync::atomic::Ordering::Relaxed)
    }

    /// One round trip to the server; used by `/ready`.
    pub async fn ping(&self) -> StoreResult<()> {
        self.db.run_command(doc! { "ping": 1 }).await?;
        Ok(())
    }

    /// The database server's clock, from `hello.localTime` (see [`Clock::server_time`]).
    pub async fn server_time(&self) -> StoreResult<Timestamp> {
        self.clock().server_time().await
    }

    /// A time the database's clock has certainly reached (see
    /// [`Clock::server_time_lower_bound`]).
    pub async fn server_time_lower_bound(&self) -> StoreResult<Timestamp> {
        self.clock().server_time_lower_bound().await
    }

    /// `deadline`, a time by this deployment's clock, as a time by the clock of
    /// `other`'s deployment that is reached no later (in real time) than this clock
    /// reaches `deadline`: a step checked against `other`'s `$$NOW` before the returned
    /// time reaches it before this deployment's clock reaches `deadline`. The time left
    /// is measured pessimistically (from an upper bound of this clock) and added to a
    /// lower bound of the other, so each side's uncertainty only makes it earlier. The
    /// readings may be up to [`clock::MAX_READING_AGE`] old: should either clock be
    /// stepped in between (NTP, a failover to a member whose clock differs), the two
    /// would no longer agree as the readings say, so `allowance` more is taken off: it
    /// is the relative jump of the two clocks this tolerates. The same deployment:
    /// `deadline` itself (one clock judges both the lease and the step).
    pub async fn deadline_on(
        &self,
        deadline: Timestamp,
        other: &Store,
        allowance: Duration,
    ) -> StoreResult<Timestamp> {
        if other.deployment == self.deployment {
            return Ok(deadline);
        }
        let allowance = chrono::TimeDelta::from_std(allowance).unwrap_or(chrono::TimeDelta::MAX);
        // The other's bound first: time passing between the two readings then only
        // shortens what is left.
        let there = other.clock().stamp_time().await?.to_chrono();
        let here = self.clock().upper_bound_time().await?.to_chrono();
        Ok(there + (deadline - here) - allowance)
    }

    /// Applies the migrations in `migrations/` that this database has not applied yet,
    /// then makes sure the event feed has its start ([`Events::prepare_feed`]): done
    /// before the instance serves, so that none of its changes precedes the feed.
    pub async fn migrate(&self) -> StoreResult<Vec<String>> {
        let applied = migrations::apply_all(&self.db).await?;
        self.events().prepare_feed().await?;
        Ok(applied)
    }
}

tokio::task_local! {
    /// The deployment whose group-commit writer runs the current task: the label [`timed`]
    /// gives its commands.
    static WRITING_TO: DeploymentName;
}

/// Runs `task` as a writer of `deployment`: [`timed`] labels its commands so.
fn writing_to<F: std::future::Future>(
    deployment: DeploymentName,
    task: F,
) -> impl std::future::Future<Output = F::Output> {
    WRITING_TO.scope(deployment, task)
}

/// Sends one command of a group-commit writer (`command` is its name, as the driver's
/// events would name it) and feeds `db_operation_duration_seconds` with how long it took,
/// as [`command_timer`] does for the commands of the main client.
async fn timed<T>(
    command: &'static str,
    operation: impl std::future::IntoFuture<Output = mongodb::error::Result<T>>,
) -> mongodb::error::Result<T> {
    let started = std::time::Instant::now();
    let result = operation.await;
    // A command answered with write errors (a taken key, a refused document) or a
    // write concern error succeeded as a command, as the driver's events count it.
    let outcome = match &result {
        Ok(_) => DbOutcome::Succeeded,
        Err(e) if matches!(*e.kind, ErrorKind::InsertMany(_) | ErrorKind::Write(_)) => {
            DbOutcome::Succeeded
        }
        Err(_) => DbOutcome::Failed,
    };
    let elapsed = started.elapsed();
    let _ = WRITING_TO.try_with(|d| crate::metrics::db_operation(d, command, outcome, elapsed));
    result
}

/// Feeds `db_operation_duration_seconds` with the driver's own timing of each command.
/// The driver calls it inline; it only bumps a histogram.
fn command_timer(deployment: DeploymentName) -> EventHandler<CommandEvent> {
    EventHandler::callback(move |event| match event {
        CommandEvent::Succeeded(e) => {
            let outcome = DbOutcome::Succeeded;
            crate::metrics::db_operation(&deployment, &e.command_name, outcome, e.duration)
        }
        CommandEvent::Failed(e) => {
            let outcome = DbOutcome::Failed;
            crate::metrics::db_operation(&deployment, &e.command_name, outcome, e.duration)
        }
        _ => {}
    })
}

/// Every write is acknowledged only once a majority has it in its journal.
pub fn majority_journaled() -> WriteConcern {
    WriteConcern::builder()
        .w(Acknowledgment::Majority)
        .journal(true)
        .w_timeout(WRITE_CONCERN_TIMEOUT)
        .build()
}

/// Fault injection (`failpoints::hold_back`): when `point` of `actor` (an instance) is
/// held back, `write` is kept to be sent later, as a request stuck in the network would
/// be, and the attempt fails unanswered.
#[cfg(feature = "failpoints")]
fn hold_back(
    actor: &str,
    point: crate::failpoints::Point,
    write: impl std::future::Future<Output = ()> + Send + 'static,
) -> StoreResult<()> {
    if !crate::failpoints::held_back(actor, point) {
        return Ok(());
    }
    crate::failpoints::keep(actor, Box::pin(write));
    Err(StoreError::Unavailable(
        "failpoint: the request was held back".into(),
    ))
}

/// Runs `attempt` again while it fails with [`StoreError::Unavailable`], a few times:
/// `updateMany` is not a retryable write on a replica set, so a step-down or a dropped
/// connection fails it where the driver would have retried a single-document write. Only
/// for writes that are safe to repeat whatever the first attempt did. Also says whether an
/// attempt failed: that attempt's write may still reach the server later.
pub(crate) async fn retried<T, F, Fut>(attempt: F) -> (StoreResult<T>, bool)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = StoreResult<T>>,
{
    retried_while(|| true, attempt).await
}

/// [`retried`], giving up early once `worth_it` says no more attempt is (the deployment
/// was found not answering: each attempt would only wait for the driver's time-out).
pub(crate) async fn retried_while<T, F, Fut>(
    worth_it: impl Fn() -> bool,
    mut attempt: F,
) -> (StoreResult<T>, bool)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = StoreResult<T>>,
{
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    let failed = &AtomicBool::new(false);
    let outcome = (|| {
        let sent = attempt();
        async move {
            let outcome = sent.await;
            if matches!(outcome, Err(StoreError::Unavailable(_))) {
                failed.store(true, Relaxed);
            }
            outcome
        }
    })
    .retry(retry::resent_write())
    .when(|e| matches!(e, StoreError::Unavailable(_)) && worth_it())
    .notify(|cause, pause| tracing::debug!(%cause, ?pause, "write failed; sending it again"))
    .await;
    (outcome, failed.load(Relaxed))
}

#[cfg(test)]
mod tests {
    use mongodb::error::{Error, ErrorKind, InsertManyError};

    use super::*;

    /// A batched insert the primary applied but the majority did not acknowledge in
    /// time: nothing is known to be lost, the caller should retry, so 503 and not 500.
    #[test]
    fn a_write_concern_failure_of_a_batched_insert_means_unavailable() {
        let failure: InsertManyError = mongodb::bson::from_document(doc! {
            "writeConcernError": { "code": 64, "codeName": "WriteConcernFailed", "errmsg": "waiting for replication timed out" },
        })
        .expect("an insertMany failure");
        let err = StoreError::from(Error::from(ErrorKind::InsertMany(failure)));
        assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    }

    /// A batched insert whose only failures are duplicate keys is answered per document
    /// (see `batch::insert_transfers`); as a whole it is a duplicate key, never a 500.
    #[test]
    fn a_batched_insert_refused_for_a_duplicate_key_is_a_duplicate_key() {
        let failure: InsertManyError = mongodb::bson::from_document(doc! {
            "writeErrors": [{ "index": 0, "code": 11000, "errmsg": "E11000 duplicate key" }],
        })
        .expect("an insertMany failure");
        let err = StoreError::from(Error::from(ErrorKind::InsertMany(failure)));
        assert!(matches!(err, StoreError::DuplicateKey(_)), "{err:?}");
    }

    /// A batched insert refused for anything else as well (a document the validator
    /// refuses, code 121) is not a duplicate key: the caller must not take it for a
    /// replay of an idempotency key. Nor is a failure that names no error at all.
    #[test]
    fn a_batched_insert_refused_for_other_reasons_too_is_no_duplicate_key() {
        for errors in [
            vec![doc! { "index": 0, "code": 121, "errmsg": "Document failed validation" }],
            vec![
                doc! { "index": 0, "code": 11000, "errmsg": "E11000 duplicate key" },
                doc! { "index": 1, "code": 121, "errmsg": "Document failed validation" },
            ],
            vec![],
        ] {
            let failure: InsertManyError =
                mongodb::bson::from_document(doc! { "writeErrors": errors.clone() })
                    .expect("an insertMany failure");
            let err = StoreError::from(Error::from(ErrorKind::InsertMany(failure)));
            assert!(matches!(err, StoreError::Refused(_)), "{errors:?}: {err:?}");
        }
    }

    /// What each driver error becomes, and so what HTTP answers: a duplicate key is a
    /// replay, "not now" (failover, shutdown, a write concern not met) is 503 and retried,
    /// anything else is a 500. SecantusDB, one node, never returns the failover or
    /// write-concern errors, so the mapping is checked here on the driver's own types.
    #[test]
    fn each_driver_error_maps_to_what_the_caller_can_do_about_it() {
        fn write_error(code: i32) -> Error {
            let e: mongodb::error::WriteError =
                mongodb::bson::from_document(doc! { "code": code, "errmsg": "refused" })
                    .expect("a write error");
            Error::from(ErrorKind::Write(WriteFailure::WriteError(e)))
        }
        fn write_concern_error(code: i32) -> Error {
            let e: mongodb::error::WriteConcernError =
                mongodb::bson::from_document(doc! { "code": code, "errmsg": "not acknowledged" })
                    .expect("a write concern error");
            Error::from(ErrorKind::Write(WriteFailure::WriteConcernError(e)))
        }
        fn command_error(code: i32) -> Error {
            let e: mongodb::error::CommandError =
                mongodb::bson::from_document(doc! { "code": code, "errmsg": "refused" })
                    .expect("a command error");
            Error::from(ErrorKind::Command(e))
        }
        fn kind(err: Error) -> &'static str {
            match StoreError::from(err) {
                StoreError::Unavailable(_) => "unavailable",
                StoreError::DuplicateKey(_) => "duplicate key",
                StoreError::Refused(_) => "refused",
                other => panic!("no driver error is {other:?}"),
            }
        }
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let cases = [
            (write_error(11000), "duplicate key"),
            (write_error(10107), "unavailable"), // a stepped-down primary
            (write_error(11600), "unavailable"), // interrupted by a shutdown
            (write_error(121), "refused"),       // a validator refused it
            (write_concern_error(64), "unavailable"), // not acknowledged in time
            (command_error(11000), "duplicate key"),
            (command_error(189), "unavailable"), // a stepped-down primary
            (command_error(50), "unavailable"),  // a time-out
            (command_error(2), "refused"),       // a bad value
            (
                Error::from(ErrorKind::Io(std::sync::Arc::new(reset))),
                "unavailable",
            ),
            (Error::from(ErrorKind::Shutdown), "unavailable"),
        ];
        for (err, expected) in cases {
            let what = err.to_string();
            assert_eq!(kind(err), expected, "{what}");
        }
    }

    /// What `retried_while` is told of another attempt, in [`send`].
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Another {
        WorthIt,
        NotWorthIt,
    }

    /// Sends a test write with `retried_while`: it fails unavailable `failures` times,
    /// then succeeds with the number of its attempt. Returns the outcome, whether an
    /// attempt failed, the attempts made and the time they took.
    async fn send(failures: u32, another: Another) -> (StoreResult<u32>, bool, u32, Duration) {
        use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
        let tried = AtomicU32::new(0);
        let started = std::time::Instant::now();
        let (outcome, failed) = retried_while(
            || another == Another::WorthIt,
            || async {
                let attempt = tried.fetch_add(1, Relaxed) + 1;
                if attempt <= failures {
                    Err(StoreError::Unavailable("no answer".into()))
                } else {
                    Ok(attempt)
                }
            },
        )
        .await;
        (outcome, failed, tried.load(Relaxed), started.elapsed())
    }

    #[tokio::test]
    async fn a_write_is_sent_again_while_unavailable_three_times_at_most_pausing_longer_each_time()
    {
        let (outcome, failed, tried, _) = send(0, Another::WorthIt).await;
        assert_eq!((outcome.unwrap(), failed, tried), (1, false, 1), "at once");
        let (outcome, failed, tried, _) = send(1, Another::WorthIt).await;
        assert_eq!(
            (outcome.unwrap(), failed, tried),
            (2, true, 2),
            "the second time"
        );
        let (outcome, failed, tried, took) = send(2, Another::WorthIt).await;
        assert_eq!(
            (outcome.unwrap(), failed, tried),
            (3, true, 3),
            "the third time"
        );
        assert!(
            took >= Duration::from_millis(150),
            "50 ms, then 100 ms: {took:?}"
        );
        let (outcome, failed, tried, _) = send(5, Another::WorthIt).await;
        assert!(
            matches!(outcome, Err(StoreError::Unavailable(_))),
            "{outcome:?}"
        );
        assert_eq!((failed, tried as usize), (true, retry::WRITE_ATTEMPTS));
    }

    #[tokio::test]
    async fn a_write_is_not_sent_again_once_another_attempt_is_not_worth_it() {
        let (outcome, failed, tried, _) = send(5, Another::NotWorthIt).await;
        assert!(
            matches!(outcome, Err(StoreError::Unavailable(_))),
            "{outcome:?}"
        );
        assert_eq!((failed, tried), (true, 1));
        let (outcome, failed, tried, _) = send(0, Another::NotWorthIt).await;
        assert_eq!((outcome.unwrap(), failed, tried), (1, false, 1));
    }

    #[tokio::test]
    async fn only_an_unavailable_write_is_sent_again() {
        let tried = std::sync::atomic::AtomicU32::new(0);
        let (outcome, failed) = retried(|| async {
            tried.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Err::<(), _>(StoreError::DuplicateKey("taken".into()))
        })
        .await;
        assert!(
            matches!(outcome, Err(StoreError::DuplicateKey(_))),
            "{outcome:?}"
        );
        assert_eq!((failed, tried.into_inner()), (false, 1));
    }

    /// One node (SecantusDB) acknowledges any write concern the same way: only this
    /// says what a replica set is asked for.
    #[tokio::test]
    async fn every_write_and_read_of_a_store_waits_for_a_majority() {
        let concern = majority_journaled();
        assert_eq!(concern.w, Some(Acknowledgment::Majority));
        assert_eq!(concern.journal, Some(true));
        assert_eq!(concern.w_timeout, Some(WRITE_CONCERN_TIMEOUT));
        let store = Store::connect("mongodb://127.0.0.1:9/", "unused")
            .await
            .unwrap();
        fn concerns<T: Send + Sync>(
            collection: &Collection<T>,
        ) -> (Option<&WriteConcern>, Option<&ReadConcern>) {
            (collection.write_concern(), collection.read_concern())
        }
        for (name, (write, read)) in [
            ("accounts", concerns(&store.accounts)),
            ("transactions", concerns(&store.transactions)),
            ("keys", concerns(&store.keys)),
            ("directory", concerns(&store.directory)),
        ] {
            assert_eq!(write, Some(&concern), "{name}");
            assert_eq!(read, Some(&ReadConcern::majority()), "{name}");
        }
    }
}
