//! The service layer: what the HTTP handlers (and the recovery sweeper) ask for, in
//! domain terms. It validates against the stored accounts, records transfers, runs the
//! two-phase commit ([`protocol`]) and answers with the domain's [`Transfer`] and
//! [`Account`], as stored.
//!
//! - [`Bank::open_account`], [`Bank::account`], [`Bank::accounts`]: the account book.
//! - [`Bank::transfer`]: record a transfer and run it (or start it in the background),
//!   with idempotency keys: a replay returns the existing transfer, never a second one.
//! - [`Bank::cancel`]: roll back a transfer that has not been applied, or reverse one
//!   that has with a compensating transfer.

mod cancel;
mod holds;
pub mod protocol;

pub use holds::HoldConflict;

use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio_util::task::TaskTracker;

use crate::telemetry::Chain;

use crate::domain::{
    Account, AccountId, AccountName, Amount, CancelReason, Currency, Hold, IdempotencyKey,
    OpeningBalance, Reference, Transfer, TransferFilter, TransferId, TransferState,
};
use crate::store::native::AtomicOutcome;
use crate::store::{Store, StoreError, StoreResult};

/// The end of a protocol run started with [`Bank::spawn_run`].
async fn joined(run: tokio::task::JoinHandle<StoreResult<Transfer>>) -> ServiceResult<Transfer> {
    match run.await {
        Ok(result) => Ok(result?),
        // Only a panic gets here (runs are never aborted): a bug, said as one.
        Err(e) => Err(StoreError::Other(format!("protocol run failed: {e}").into()).into()),
    }
}

/// How long a replayed request waits for the original to finish before answering with
/// the transfer as it stands (202). The original normally finishes in milliseconds; this
/// only matters when its instance died and the sweeper must take over.
const REPLAY_WAIT: Duration = Duration::from_secs(5);
const REPLAY_POLL: Duration = Duration::from_millis(20);

/// An account to open.
#[derive(Debug, Clone)]
pub struct NewAccount {
    pub id: Option<AccountId>,
    pub name: Option<AccountName>,
    pub balance: OpeningBalance,
    pub currency: Currency,
}

/// A transfer to make.
#[derive(Debug, Clone)]
pub struct NewTransfer {
    pub source: AccountId,
    pub destination: AccountId,
    pub amount: Amount,
    pub reference: Option<Reference>,
    /// A hold instead of a transfer: reserve `amount` now, until this long from now,
    /// for a capture or a void (`docs/holds.md`).
    pub hold: Option<Duration>,
}

impl NewTransfer {
    /// What identifies "the same request" for an idempotency key: every field the client
    /// sent. Separated by NUL, which none of the fields may contain.
    fn fingerprint(&self) -> String {
        let mut hash = Sha256::new();
        hash.update(self.source.as_str());
        hash.update([0]);
        hash.update(self.destination.as_str());
        hash.update([0]);
        hash.update(self.amount.minor_units().to_be_bytes());
        hash.update([0]);
        if let Some(r) = &self.reference {
            hash.update(r.as_str());
        }
        if let Some(expires_in) = self.hold {
            hash.update([0]);
            hash.update(b"hold");
            hash.update(expires_in.as_millis().to_be_bytes());
        }
        hex::encode(hash.finalize())
    }
}

/// How a transfer is carried out (`TRANSFER_STRATEGY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Strategy {
    /// The tutorial's two-phase commit: guarded single-document writes, recoverable at
    /// every step.
    #[default]
    TwoPhase,
    /// One MongoDB multi-document transaction per transfer (`store::native`), for
    /// comparison. It writes the same documents; `Prefer: respond-async` is ignored (the
    /// transaction is the whole transfer), and cancels reverse with two-phase transfers.
    Native,
}

/// Whether the caller waits for the protocol to finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// Run the protocol to a terminal state before answering.
    Wait,
    /// Record the transfer, answer at once, and run the protocol in the background
    /// (`Prefer: respond-async`).
    Background,
}

/// The answer to a transfer request: the transfer as it stands, and whether it was made
/// by an earlier request with the same idempotency key.
#[derive(Debug, Clone)]
pub struct TransferOutcome {
    pub transfer: Transfer,
    pub replayed: bool,
}

/// Everything that can refuse a request, as the caller should see it.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("account {0} already exists")]
    AccountExists(String),
    #[error("account {0} does not exist")]
    AccountNotFound(String),
    #[error("transfer {0} does not exist")]
    TransferNotFound(TransferId),
    #[error("source and destination are the same account")]
    SameAccount,
    #[error(
        "source account is in {source_currency}, destination account in {destination_currency}"
    )]
    CurrencyMismatch {
        source_currency: String,
        destination_currency: String,
    },
    #[error("this idempotency key was used for a different request")]
    IdempotencyKeyReused,
    /// A reversal was refused and nothing changed: its compensating transfer (`attempt`,
    /// when one was recorded) ended `canceled` for `reason`. `account` is the account at
    /// fault: the original destination for a lack of funds, the original source for an
    /// overflow or a vanished account.
    #[error("the reversal was refused ({reason}) at account {account}")]
    ReversalRefused {
        reason: CancelReason,
        account: AccountId,
        attempt: Option<TransferId>,
    },
    /// A capture or a void the hold cannot take (see [`HoldConflict`]).
    #[error("hold {hold} cannot take this: {conflict:?}")]
    Hold {
        conflict: HoldConflict,
        hold: TransferId,
    },
    /// A capture of more than the hold reserved.
    #[error("a capture may take at most the held amount, {}", held.minor_units())]
    CaptureExceedsHold { held: Amount },
    /// Too many transfers in flight in this instance: refused before anything was
    /// recorded; retry shortly (or on another instance).
    #[error("too many transfers in flight; retry shortly")]
    Overloaded,
    /// The database cannot be reached or cannot take the write now; retry later.
    #[error(transparent)]
    Unavailable(StoreError),
    /// A bug or a misconfigured database: nothing the caller can do about it.
    #[error(transparent)]
    Internal(StoreError),
}

impl From<StoreError> for ServiceError {
    fn from(err: StoreError) -> ServiceError {
        match err {
            StoreError::Unavailable(_) => ServiceError::Unavailable(err),
            StoreError::DuplicateKey(_) | StoreError::Other(_) => ServiceError::Internal(err),
        }
    }
}

pub type ServiceResult<T> = Result<T, ServiceError>;

/// The bank: accounts, transfers, and the protocol that moves money between them.
#[derive(Clone)]
pub struct Bank {
    store: Store,
    /// `INSTANCE_ID`: names this instance in logs and in its pause points (tests).
    instance_id: Arc<str>,
    /// Written to `application` on the transfers this process owns: the instance id plus
    /// a random incarnation, so that two processes never share a lease, not even a
    /// restart under the same `INSTANCE_ID` while writes of the dead process may still
    /// be on their way to the server (it waits for their lease like any other instance).
    owner: Arc<str>,
    /// Every protocol run and cancel (each in a task of its own, see
    /// [`Bank::spawn_run`]); shutdown waits for them.
    background: TaskTracker,
    /// Transfers this process is driving right now. Two drivers under one owner
    /// would share a lease, and a second driver's debit after the first one's pull would
    /// apply the transfer twice; so within a process one task at a time drives a transfer.
    driving:
        Arc<std::sync::Mutex<std::collections::HashMap<TransferId, Arc<tokio::sync::Mutex<()>>>>>,
    /// The lease an instance holds on a transfer it works on, renewed by every state
    /// change; once it lapses (STALE_AFTER_MS) another instance may take over.
    stale_after: Duration,
    /// Two-phase commit or native transactions for new transfers.
    strategy: Strategy,
    /// How long a hold lasts when its request does not say (`HOLD_EXPIRES_MS`).
    default_hold_expiry: Duration,
    /// Admission control: one permit per transfer this process works on (a new one, a
    /// cancel, a recovery), held until the protocol run ends. A request that finds none
    /// is refused at once ([`ServiceError::Overloaded`]) and records nothing. This bounds
    /// every queue behind it: each transfer has at most one write waiting in the group
    /// commit, so a batch waits behind at most `permits / MAX_BATCH` others, milliseconds
    /// against a lease of seconds, and a burst cannot push steps past their deadlines.
    admission: Arc<tokio::sync::Semaphore>,
    /// The currency of every account this process has seen, by id. An account's currency
    /// never changes and no account is ever deleted through the service, so a transfer
    /// between known accounts is validated without a read. Should an account vanish
    /// behind the service's back, the debit or credit finds it gone and the transfer rolls
    /// back with `account_not_found`: the cache can make an answer less precise, never
    /// move money wrongly.
    currencies: Arc<std::sync::Mutex<std::collections::HashMap<AccountId, Currency>>>,
}

/// How long a hold lasts unless its request or `HOLD_EXPIRES_MS` says otherwise: 7 days.
pub const DEFAULT_HOLD_EXPIRY: Duration = Duration::from_secs(7 * 24 * 3600);

/// Transfers in flight per process unless `MAX_TRANSFERS_IN_FLIGHT` says otherwise.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 512;

/// A permit of admission control, held for as long as a transfer is worked on.
pub(crate) type Admitted = tokio::sync::OwnedSemaphorePermit;

/// Accounts whose currency [`Bank`] remembers, at most; the memory is simply emptied
/// when full.
const CURRENCY_CACHE_MAX: usize = 100_000;

impl Bank {
    pub fn new(store: Store, instance_id: impl Into<Arc<str>>, stale_after: Duration) -> Bank {
        let instance_id: Arc<str> = instance_id.into();
        let incarnation = format!("{:08x}", rand::random::<u32>());
        Bank {
            store: store.named(&instance_id),
            owner: format!("{instance_id}/{incarnation}").into(),
            instance_id,
            background: TaskTracker::new(),
            driving: Arc::default(),
            stale_after,
            strategy: Strategy::TwoPhase,
            default_hold_expiry: DEFAULT_HOLD_EXPIRY,
            admission: Arc::new(tokio::sync::Semaphore::new(DEFAULT_MAX_IN_FLIGHT)),
            currencies: Arc::default(),
        }
    }

    pub fn with_strategy(self, strategy: Strategy) -> Bank {
        Bank { strategy, ..self }
    }

    /// Holds whose request does not say last this long (`HOLD_EXPIRES_MS`).
    pub fn with_default_hold_expiry(self, default_hold_expiry: Duration) -> Bank {
        Bank {
            default_hold_expiry,
            ..self
        }
    }

    pub fn default_hold_expiry(&self) -> Duration {
        self.default_hold_expiry
    }

    /// At most `limit` transfers in flight in this process (`MAX_TRANSFERS_IN_FLIGHT`).
    pub fn with_max_in_flight(self, limit: usize) -> Bank {
        Bank {
            admission: Arc::new(tokio::sync::Semaphore::new(limit.max(1))),
            ..self
        }
    }

    /// A permit to work on one more transfer now, or [`ServiceError::Overloaded`].
    pub(super) fn admit(&self) -> ServiceResult<Admitted> {
        self.admission
            .clone()
            .try_acquire_owned()
            .map_err(|_| ServiceError::Overloaded)
    }

    /// A permit, waiting for one: the sweeper's way in, so that recoveries queue behind
    /// new work instead of being refused (and new requests are refused while it waits).
    pub(crate) async fn admit_waiting(&self) -> Admitted {
        self.admission
            .clone()
            .acquire_owned()
            .await
            .expect("the admission semaphore is never closed")
    }

    /// Whether every permit is taken: `/ready` then says so.
    pub fn is_overloaded(&self) -> bool {
        self.admission.available_permits() == 0
    }

    /// Runs `transfer` to its end in a task of its own that holds `permit`: the run goes
    /// on even if the caller stops waiting (a client that hangs up, a request time-out),
    /// so admitted work always finishes or is left, every step durable, for the sweeper.
    fn spawn_run(
        &self,
        transfer: Transfer,
        permit: Admitted,
    ) -> tokio::task::JoinHandle<StoreResult<Transfer>> {
        let bank = self.clone();
        let work = async move {
            let _permit = permit;
            let id = transfer.id;
            let ended = bank.run(transfer).await;
            if let Err(e) = &ended {
                tracing::warn!(transfer_id = %id, error = %Chain(e), "transfer interrupted; the sweeper will finish it");
            }
            ended
        };
        // In the request's span, so its log lines carry the request id too.
        self.background.spawn(tracing::Instrument::instrument(
            work,
            tracing::Span::current(),
        ))
    }

    pub fn stale_after(&self) -> Duration {
        self.stale_after
    }

    /// The per-transfer lock that makes this process drive a transfer in one task only.
    pub(crate) fn drive_lock(&self, id: TransferId) -> Arc<tokio::sync::Mutex<()>> {
        let mut map = self.driving.lock().unwrap_or_else(|e| e.into_inner());
        // Forget locks nobody holds or waits for, so the map stays as small as the work.
        map.retain(|_, lock| Arc::strong_count(lock) > 1);
        map.entry(id).or_default().clone()
    }

    /// Whether a task of this process is driving `id` right now. The sweeper leaves such
    /// a transfer alone: claiming it would renew the lease of a task that may be stuck,
    /// and keep every other instance from taking it over.
    pub(crate) fn is_driving(&self, id: TransferId) -> bool {
        let map = self.driving.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&id).is_some_and(|lock| Arc::strong_count(lock) > 1)
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// What this process writes to `application`: see [`Bank::owner`]'s field.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The protocol runs and cancels in flight, so that shutdown can wait for them.
    pub fn background_tasks(&self) -> &TaskTracker {
        &self.background
    }

    /// One round trip to the database; `/ready` asks it.
    pub async fn ping(&self) -> ServiceResult<()> {
        Ok(self.store.ping().await?)
    }

    pub async fn open_account(&self, new: NewAccount) -> ServiceResult<Account> {
        let id = match new.id {
            Some(id) => id,
            None => AccountId::parse(&format!("acc_{}", crate::store::new_transfer_id()))
                .expect("acc_ and 24 hex digits make an account id"),
        };
        let now = crate::domain::now();
        let account = Account {
            id,
            name: new.name,
            balance: new.balance.minor_units(),
            pending_debits: 0,
            pending_credits: 0,
            currency: new.currency,
            pending_transactions: Vec::new(),
            fenced_transactions: Vec::new(),
            created_at: now,
            updated_at: now,
        };
        match self.store.insert_account(&account).await {
            Ok(()) => Ok(account),
            Err(StoreError::DuplicateKey(_)) => {
                Err(ServiceError::AccountExists(account.id.to_string()))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// An account as it stands now: holds past their `expiresAt` no longer count in its
    /// pending sums, whether or not a sweeper has released them yet.
    pub async fn account(&self, id: &AccountId) -> ServiceResult<Account> {
        let account = self
            .store
            .account(id)
            .await?
            .ok_or_else(|| ServiceError::AccountNotFound(id.to_string()))?;
        Ok(self.as_of_now(vec![account]).await?.remove(0))
    }

    /// Accounts in id order, as they stand now (see [`Bank::account`]).
    pub async fn accounts(
        &self,
        after: Option<&AccountId>,
        limit: u32,
    ) -> ServiceResult<Vec<Account>> {
        let accounts = self.store.list_accounts(after, limit).await?;
        Ok(self.as_of_now(accounts).await?)
    }

    /// `accounts`, read just before, without the reservations of expired holds. Read
    /// after the accounts, so that a hold released in between is still subtracted from
    /// the copy that still carried it (its marker says so), never twice.
    async fn as_of_now(&self, accounts: Vec<Account>) -> StoreResult<Vec<Account>> {
        let holding: Vec<&AccountId> = accounts
            .iter()
            .filter(|a| a.pending_debits > 0 || a.pending_credits > 0)
            .map(|a| &a.id)
            .collect();
        if holding.is_empty() {
            return Ok(accounts);
        }
        let now = self.store.server_time_lower_bound().await?;
        let expired = self.store.expired_holds_touching(&holding, now).await?;
        Ok(accounts.into_iter().map(|a| a.without(&expired)).collect())
    }

    /// The stored transfer, for the protocol (no view applied).
    pub async fn find_transfer(&self, id: TransferId) -> ServiceResult<Transfer> {
        self.store
            .transfer(id)
            .await?
            .ok_or(ServiceError::TransferNotFound(id))
    }

    /// A transfer as it stands now: a hold past its `expiresAt` reads as expired (see
    /// [`Transfer::as_of`]).
    pub async fn read_transfer(&self, id: TransferId) -> ServiceResult<Transfer> {
        let transfer = self.find_transfer(id).await?;
        let now = self.store.server_time_lower_bound().await?;
        Ok(transfer.as_of(now))
    }

    /// Transfers newest first, as they stand now; a listing of `held` ones leaves out
    /// the holds past their expiry.
    pub async fn transfers(
        &self,
        filter: &TransferFilter,
        limit: u32,
    ) -> ServiceResult<Vec<Transfer>> {
        let now = self.store.server_time_lower_bound().await?;
        let mut filter = filter.clone();
        if filter.state == Some(TransferState::Held) {
            filter.unexpired_at = Some(now);
        }
        let listed = self.store.list_transfers(&filter, limit).await?;
        Ok(listed.into_iter().map(|t| t.as_of(now)).collect())
    }

    /// The transfers touching an account, newest first; 404 for an unknown account.
    pub async fn account_transfers(
        &self,
        account: &AccountId,
        before: Option<TransferId>,
        limit: u32,
    ) -> ServiceResult<Vec<Transfer>> {
        self.account(account).await?;
        let filter = TransferFilter {
            account: Some(account.clone()),
            before,
            ..TransferFilter::default()
        };
        self.transfers(&filter, limit).await
    }

    /// Records a transfer and runs the two-phase commit.
    ///
    /// With an idempotency key, a request that repeats an earlier one answers with the
    /// earlier transfer (waiting briefly for it to finish) and moves no money; the same
    /// key with a different request is refused. Concurrent requests with one key make
    /// one transfer: the unique index on `idempotencyKey` lets exactly one insert win.
    pub async fn transfer(
        &self,
        new: NewTransfer,
        key: Option<IdempotencyKey>,
        completion: Completion,
    ) -> ServiceResult<TransferOutcome> {
        let permit = self.admit()?;
        let fingerprint = new.fingerprint();
        if let Some(key) = &key {
            if let Some(existing) = self.store.transfer_by_idempotency_key(key).await? {
                return self.replay(existing, &fingerprint).await;
            }
        }
        let currency = self.check_accounts(&new).await?;
        let hold = match new.hold {
            // Expiry by the database's clock, which judges it.
            Some(expires_in) => {
                let now = self.store.server_time_lower_bound().await?;
                let expires_at = chrono::TimeDelta::from_std(expires_in)
                    .ok()
                    .and_then(|d| now.checked_add_signed(d))
                    .unwrap_or_else(|| panic!("bug: a hold of {expires_in:?} passed validation"));
                Some(Hold {
                    amount: new.amount,
                    expires_at,
                })
            }
            None => None,
        };
        let transfer = Transfer {
            hold,
            reference: new.reference,
            request_hash: key.as_ref().map(|_| fingerprint.clone()),
            idempotency_key: key.clone(),
            ..Transfer::initial(
                crate::store::new_transfer_id(),
                new.source,
                new.destination,
                new.amount,
                currency,
            )
        };
        // A hold outlives any multi-document transaction: always two-phase.
        if self.strategy == Strategy::Native && transfer.hold.is_none() {
            return self.transfer_natively(transfer, &fingerprint).await;
        }
        let mut transfer = transfer;
        match self.store.insert_transfer(&transfer).await {
            Ok(stamp) => transfer.last_modified = stamp,
            Err(StoreError::DuplicateKey(_)) if key.is_some() => {
                return self.replay_by_key(&transfer, &fingerprint).await;
            }
            Err(e) => return Err(e.into()),
        }
        tracing::info!(transfer_id = %transfer.id, source = %transfer.source, destination = %transfer.destination, value = transfer.amount.minor_units(), "transfer recorded");
        failpoint!(self, "after_insert");
        let run = self.spawn_run(transfer.clone(), permit);
        let transfer = match completion {
            Completion::Wait => joined(run).await?,
            // The run goes on by itself; its end is logged there.
            Completion::Background => transfer,
        };
        Ok(TransferOutcome {
            transfer,
            replayed: false,
        })
    }

    /// The native strategy: one transaction records the transfer `done` and moves the
    /// money; if an account refuses, the transfer is recorded `canceled` with the reason
    /// instead, so that the answer and the log are those of the two-phase path.
    async fn transfer_natively(
        &self,
        transfer: Transfer,
        fingerprint: &str,
    ) -> ServiceResult<TransferOutcome> {
        let outcome = match self
            .store
            .transfer_atomically(&transfer, self.owner())
            .await
        {
            Ok(outcome) => outcome,
            Err(StoreError::DuplicateKey(_)) if transfer.idempotency_key.is_some() => {
                return self.replay_by_key(&transfer, fingerprint).await;
            }
            Err(e) => return Err(e.into()),
        };
        let transfer = match outcome {
            AtomicOutcome::Done(done) => *done,
            AtomicOutcome::Refused(reason) => {
                let canceled = Transfer {
                    state: TransferState::Canceled,
                    reason: Some(reason),
                    owner: Some(self.owner().to_owned()),
                    ..transfer
                };
                match self.store.insert_transfer(&canceled).await {
                    Ok(stamp) => Transfer {
                        last_modified: stamp,
                        ..canceled
                    },
                    Err(StoreError::DuplicateKey(_)) if canceled.idempotency_key.is_some() => {
                        return self.replay_by_key(&canceled, fingerprint).await;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        };
        tracing::info!(transfer_id = %transfer.id, to = %transfer.state, reason = ?transfer.reason, "transfer made in one transaction");
        crate::metrics::transfer_finished(transfer.state, transfer.reason);
        Ok(TransferOutcome {
            transfer,
            replayed: false,
        })
    }

    /// Answers with the transfer that took `transfer`'s idempotency key first.
    async fn replay_by_key(
        &self,
        transfer: &Transfer,
        fingerprint: &str,
    ) -> ServiceResult<TransferOutcome> {
        let taken = || StoreError::Other("idempotency key taken but no transfer carries it".into());
        let key = transfer.idempotency_key.as_ref().ok_or_else(taken)?;
        let existing = self
            .store
            .transfer_by_idempotency_key(key)
            .await?
            .ok_or_else(taken)?;
        self.replay(existing, fingerprint).await
    }

    /// Checks what the stored accounts must agree to; returns the transfer's currency.
    async fn check_accounts(&self, new: &NewTransfer) -> ServiceResult<Currency> {
        if new.source == new.destination {
            return Err(ServiceError::SameAccount);
        }
        let (source, destination) = match self.known_currencies(new) {
            Some(known) => known,
            None => self.read_currencies(new).await?,
        };
        if source != destination {
            return Err(ServiceError::CurrencyMismatch {
                source_currency: source.to_string(),
                destination_currency: destination.to_string(),
            });
        }
        Ok(source)
    }

    /// The currencies of both accounts, if this process has seen both.
    fn known_currencies(&self, new: &NewTransfer) -> Option<(Currency, Currency)> {
        let known = self.currencies.lock().unwrap_or_else(|e| e.into_inner());
        let source = known.get(&new.source)?.clone();
        let destination = known.get(&new.destination)?.clone();
        Some((source, destination))
    }

    /// Reads both accounts' currencies (with those of concurrent transfers, in one
    /// round trip) and remembers them.
    async fn read_currencies(&self, new: &NewTransfer) -> ServiceResult<(Currency, Currency)> {
        let [source, destination] = self
            .store
            .currencies([&new.source, &new.destination])
            .await?;
        let source = source.ok_or_else(|| ServiceError::AccountNotFound(new.source.to_string()))?;
        let destination = destination
            .ok_or_else(|| ServiceError::AccountNotFound(new.destination.to_string()))?;
        let mut known = self.currencies.lock().unwrap_or_else(|e| e.into_inner());
        if known.len() + 2 > CURRENCY_CACHE_MAX {
            known.clear();
        }
        known.insert(new.source.clone(), source.clone());
        known.insert(new.destination.clone(), destination.clone());
        Ok((source, destination))
    }

    async fn replay(
        &self,
        existing: Transfer,
        fingerprint: &str,
    ) -> ServiceResult<TransferOutcome> {
        if existing.request_hash.as_deref() != Some(fingerprint) {
            return Err(ServiceError::IdempotencyKeyReused);
        }
        let transfer = self.wait_until_settled(existing, REPLAY_WAIT).await?;
        Ok(TransferOutcome {
            transfer,
            replayed: true,
        })
    }

    /// Re-reads a transfer until the protocol has nothing left to do for it (it is
    /// terminal, or a hold is `held`, waiting for its client) or `limit` has passed. Does
    /// not drive it: its owner (or, if the owner died, the sweeper) does.
    pub(super) async fn wait_until_settled(
        &self,
        mut transfer: Transfer,
        limit: Duration,
    ) -> ServiceResult<Transfer> {
        let deadline = tokio::time::Instant::now() + limit;
        while !transfer.state.is_settled() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(REPLAY_POLL).await;
            transfer = self.store.transfer(transfer.id).await?.ok_or_else(|| {
                StoreError::Other(format!("transfer {} vanished", transfer.id).into())
            })?;
        }
        Ok(transfer)
    }
}
