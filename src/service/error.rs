//! What can refuse a request of the service, as its caller should see it:
//! [`ServiceError`], and the one mapping of a storage error onto it (a lost database is
//! [`ServiceError::Unavailable`], a lost race [`ServiceError::Contended`], anything else
//! [`ServiceError::Internal`]).

use super::HoldConflict;
use crate::domain::{AccountId, Amount, CancelReason, DeploymentName, TransferId};
use crate::store::StoreError;

/// Everything that can refuse a request, as the caller should see it.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("account {0} already exists")]
    AccountExists(String),
    #[error("there is no deployment {0}")]
    UnknownDeployment(DeploymentName),
    #[error("account {0} does not exist")]
    AccountNotFound(String),
    #[error("transfer {0} does not exist")]
    TransferNotFound(TransferId),
    /// A tenant's scope sees the transfer (one of its accounts is the tenant's) but does
    /// not own it (another is not): it may read it, never capture, void or cancel it.
    #[error("transfer {0} moves accounts that are not the caller's tenant's")]
    TransferNotOwned(TransferId),
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
    /// when one was inserted) ended `canceled` for `reason`. `account` is the account at
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
    /// A capture of part of a multi-leg hold, which is captured whole only (a part would
    /// not say which legs it takes).
    #[error("a multi-leg hold is captured whole, {}", held.minor_units())]
    PartialCaptureOfLegs { held: Amount },
    /// The feed's events after the cursor were removed after the retention: the reader
    /// may have missed some, and must start again from the oldest retained.
    #[error("the events after this cursor were removed after the retention")]
    CursorExpired,
    /// A webhook's URL resolves to an address deliveries may not go to (or none).
    #[error("the webhook URL is not allowed: {0}")]
    WebhookUrlNotAllowed(super::UrlRefusal),
    #[error("webhook {0} does not exist")]
    WebhookNotFound(String),
    /// As many webhooks are registered as this cap allows (`MAX_WEBHOOKS` of the
    /// caller's scope, or `MAX_WEBHOOKS_TOTAL` in all).
    #[error("as many webhooks are registered as allowed ({0:?})")]
    TooManyWebhooks(crate::domain::WebhookCap),
    #[error("api key {0} does not exist")]
    ApiKeyNotFound(String),
    #[error("delivery {0} does not exist")]
    DeliveryNotFound(String),
    /// Only a failed delivery is retried by hand; this one is in this state.
    #[error("the delivery is {0:?}, not failed")]
    DeliveryNotFailed(crate::domain::DeliveryState),
    /// As many event streams are open as `MAX_EVENT_STREAMS` allows, or as the caller's
    /// tenant may hold (`MAX_EVENT_STREAMS_PER_TENANT`).
    #[error("too many event streams are open ({0:?})")]
    TooManyFollowers(super::FollowerLimit),
    /// Too many transfers in flight in this instance: refused before anything was
    /// inserted; retry shortly (or on another instance).
    #[error("too many transfers in flight; retry shortly")]
    Overloaded,
    /// The database cannot be reached or cannot take the write now; retry later.
    #[error(transparent)]
    Unavailable(StoreError),
    /// The request kept losing to concurrent writers ([`StoreError::Contended`]); what
    /// was inserted stands. Retry shortly.
    #[error(transparent)]
    Contended(StoreError),
    /// Stored data this version cannot read, a database that refuses what it is sent, or
    /// settings that do not match the data: nothing the caller can do about it.
    #[error(transparent)]
    Internal(StoreError),
}

impl From<StoreError> for ServiceError {
    fn from(err: StoreError) -> ServiceError {
        match err {
            StoreError::Unavailable(_) => ServiceError::Unavailable(err),
            StoreError::Contended { .. } => ServiceError::Contended(err),
            StoreError::DuplicateKey(_)
            | StoreError::Malformed(_)
            | StoreError::Refused(_)
            | StoreError::Misconfigured(_) => ServiceError::Internal(err),
        }
    }
}

pub type ServiceResult<T> = Result<T, ServiceError>;

/// The end of a task of ours that gave no result: only a panic gets here (the tasks are
/// never aborted), a bug. The panic goes on in the task that waited for it, so that a
/// request answers as any panic does (500 `internal_error`, `CatchPanicLayer`).
pub(super) fn panicked(ended: tokio::task::JoinError) -> ! {
    match ended.try_into_panic() {
        Ok(panic) => std::panic::resume_unwind(panic),
        Err(ended) => panic!("bug: a task of the service was aborted: {ended}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_chain::Chain;

    /// A store error's log line names its kind and its cause.
    #[test]
    fn a_chain_shows_the_error_and_every_source() {
        let err = StoreError::Unavailable("no primary".into());
        let service = ServiceError::from(err);
        assert_eq!(
            Chain(&service).to_string(),
            "the database is unavailable: no primary"
        );
    }
}
