//! A transfer and an account as the service reasons about them: every field a value of
//! the domain, valid by construction. The store converts its documents to and from these
//! (`store::documents`); the HTTP layer builds its responses from them.

use super::{
    AccountId, AccountName, Amount, CancelReason, Currency, IdempotencyKey, Reference, TransferId,
    TransferState,
};

/// A point in time. Every time that another instance compares with another is the
/// database's, never an instance's own clock (see `store::clock`).
pub type Timestamp = chrono::DateTime<chrono::Utc>;

/// This instance's clock, to the millisecond (the precision that is stored and
/// answered, so that an answer and a later read agree). Only for times shown to people
/// (`createdAt`, `updatedAt`), never for one another instance compares with.
pub fn now() -> Timestamp {
    use chrono::SubsecRound;
    chrono::Utc::now().trunc_subsecs(3)
}

/// One transfer and where it is in the two-phase commit: a line of the transfer log.
#[derive(Debug, Clone, PartialEq)]
pub struct Transfer {
    pub id: TransferId,
    pub source: AccountId,
    pub destination: AccountId,
    /// What moves: for a hold, the held amount until a capture sets the captured one.
    pub amount: Amount,
    pub currency: Currency,
    pub state: TransferState,
    /// Set on a hold: what it reserves, and until when.
    pub hold: Option<Hold>,
    /// When the transfer last changed, by the database's clock (`lastModified`, stored as
    /// a lower bound of it, and only ever moving forward): its owner's lease runs from
    /// here, and the sweeper takes it over once that lease has lapsed.
    pub last_modified: Timestamp,
    pub created_at: Timestamp,
    /// The process that drives the transfer (the tutorial's `application`); `None` until
    /// its first step.
    pub owner: Option<String>,
    /// Why it ended `canceled`.
    pub reason: Option<CancelReason>,
    pub reference: Option<Reference>,
    pub idempotency_key: Option<IdempotencyKey>,
    /// A digest of the request that created the transfer, to tell a retry from a reuse of
    /// its idempotency key with another request.
    pub request_hash: Option<String>,
    /// Set on a compensating transfer: the transfer it reverses.
    pub reverses: Option<TransferId>,
    /// Set on a reversed transfer: its compensating transfer.
    pub reversed_by: Option<TransferId>,
    /// A cancel fenced the accounts against this transfer's forward steps, and the fences
    /// have not been collected yet.
    pub fenced: bool,
    /// The reversal was claimed and its compensation has not finished yet.
    pub reversing: bool,
}

impl Transfer {
    /// A transfer as step 1 records it: `initial`, owned by nobody yet. Optional fields
    /// (reference, idempotency key, reversal link) are set by the caller; the store
    /// stamps `last_modified` with the database's clock when it records it.
    pub fn initial(
        id: TransferId,
        source: AccountId,
        destination: AccountId,
        amount: Amount,
        currency: Currency,
    ) -> Transfer {
        let now = now();
        Transfer {
            id,
            source,
            destination,
            amount,
            currency,
            state: TransferState::Initial,
            hold: None,
            last_modified: now,
            created_at: now,
            owner: None,
            reason: None,
            reference: None,
            idempotency_key: None,
            request_hash: None,
            reverses: None,
            reversed_by: None,
            fenced: false,
            reversing: false,
        }
    }
}

/// What a hold reserves (see `docs/holds.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    /// The amount reserved: out of the source's available balance, into the
    /// destination's pending credits, until the hold is captured, voided or expires.
    pub amount: Amount,
    /// When an uncaptured hold expires, by the database's clock.
    pub expires_at: Timestamp,
}

/// An account: its balance in minor units, and the transfers the protocol has applied
/// to it but not settled yet.
#[derive(Debug, Clone, PartialEq)]
pub struct Account {
    pub id: AccountId,
    pub name: Option<AccountName>,
    /// The posted balance in minor units, 0 ..= `MAX_MONEY`.
    pub balance: i64,
    /// The sum of the live holds out of the account; never above `balance`.
    pub pending_debits: i64,
    /// The sum of the live holds into the account; `balance + pending_credits` never
    /// passes `MAX_MONEY`, so every capture can land.
    pub pending_credits: i64,
    pub currency: Currency,
    /// Transfers applied to this account whose markers are not pulled yet (the tutorial's
    /// `pendingTransactions`): applying one of them again is a no-op.
    pub pending_transactions: Vec<TransferId>,
    /// Transfers a cancel fenced: their forward steps are refused here.
    pub fenced_transactions: Vec<TransferId>,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
}

impl Account {
    /// What the account may spend: the posted balance less what its holds reserve.
    pub fn available_balance(&self) -> i64 {
        self.balance - self.pending_debits
    }
}

/// Which transfers a listing returns, newest first.
#[derive(Debug, Clone, Default)]
pub struct TransferFilter {
    pub state: Option<TransferState>,
    /// Transfers whose source or destination is this account.
    pub account: Option<AccountId>,
    /// Keyset cursor: only transfers older than this one.
    pub before: Option<TransferId>,
}
