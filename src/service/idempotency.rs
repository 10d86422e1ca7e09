//! Idempotency keys: a request that repeats an earlier one (same key, same request)
//! answers with the earlier transfer and moves no money; the same key for another request
//! is refused. The key is taken first, in `idempotencyKeys` on the deployment that logs
//! the transfer, whose unique `_id` lets exactly one of two concurrent requests take it;
//! keys taken before they were scoped by API key, and transfers inserted before
//! `idempotencyKeys` existed, answer their retries too.

use std::time::Duration;

use backon::Retryable;
use sha2::{Digest, Sha256};

use super::{NewTransfer, Requests, ServiceError, ServiceResult, TransferOutcome};
use crate::domain::{KeyScope, ScopedKey, Transfer, TransferId};
use crate::retry;
use crate::store::transfers::KeyRecord;
use crate::store::{Store, StoreError, StoreResult};

/// Reads that follow a write another request made, whose answer (a duplicate key) came
/// from the primary: with majority read concern they may not see it for a moment. Tried
/// again while "not there" ([`retry::majority_read`]) before that is believed; an error
/// ends it at once.
pub(super) async fn read_majority<T, F, Fut>(read: F) -> StoreResult<Option<T>>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = StoreResult<Option<T>>>,
{
    // `Err(None)`: not there yet, worth another read; `Err(Some(_))`: failed.
    let found = (|| async {
        match read().await {
            Ok(Some(found)) => Ok(found),
            Ok(None) => Err(None),
            Err(e) => Err(Some(e)),
        }
    })
    .retry(retry::majority_read())
    .when(Option::is_none)
    .await;
    match found {
        Ok(found) => Ok(Some(found)),
        Err(None) => Ok(None),
        Err(Some(e)) => Err(e),
    }
}

/// What [`Requests::take_key`] found.
pub(super) enum Taken {
    /// The key is ours now, for a transfer of this id.
    New(TransferId),
    /// The key was taken by the same request, whose transfer is not inserted yet:
    /// insert it under this id.
    NotInserted(TransferId),
    /// The transfer the key made.
    Replay(Box<Transfer>),
}

/// How long a replayed request waits for the original to finish before answering with
/// the transfer as it stands (202). The original normally finishes in milliseconds; this
/// only matters when its instance died and the sweeper must take over.
pub(super) const REPLAY_WAIT: Duration = Duration::from_secs(5);

impl NewTransfer {
    /// What identifies "the same request" for an idempotency key: every field the client
    /// sent. Separated by NUL, which none of the fields may contain.
    pub(super) fn fingerprint(&self) -> String {
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
        // Every leg: the first leg and the sum alone are not the request.
        for leg in self.legs.iter().flat_map(|l| l.legs()) {
            hash.update([0]);
            hash.update(b"leg");
            hash.update(leg.source.as_str());
            hash.update([0]);
            hash.update(leg.destination.as_str());
            hash.update([0]);
            hash.update(leg.amount.minor_units().to_be_bytes());
        }
        hex::encode(hash.finalize())
    }
}

impl Requests {
    /// Answers with the transfer that took `transfer`'s idempotency key first.
    pub(super) async fn replay_by_key(
        &self,
        transfer: &Transfer,
        fingerprint: &str,
    ) -> ServiceResult<TransferOutcome> {
        let key = transfer.idempotency_key.as_ref().unwrap_or_else(|| {
            panic!(
                "bug: transfer {} has no idempotency key to replay",
                transfer.id
            )
        });
        // The key was taken (the insert met it) by a request whose transfer no majority
        // read finds yet: that request's write is not acknowledged yet.
        let taken =
            || StoreError::contended(None, "idempotency key taken but no transfer carries it");
        let log = self.driver.log_store(transfer)?;
        let record = read_majority(|| log.transfers().idempotency_record(key)).await?;
        let existing = match &record {
            Some(record) => read_majority(|| log.transfers().transfer(record.transfer)).await?,
            None => None,
        };
        let existing = match existing {
            Some(existing) => existing,
            // Inserted by a version before `idempotencyKeys` (its unique index on
            // `transactions` refused this insert): the record, ours, names a transfer
            // that will never exist; it is made to name the one that does.
            None => {
                let legacy = log
                    .transfers()
                    .transfer_by_idempotency_key(key)
                    .await?
                    .ok_or_else(taken)?;
                log.transfers()
                    .repair_idempotency_record(key, record.map(|r| r.transfer), &legacy)
                    .await?;
                legacy
            }
        };
        self.replay(existing, fingerprint).await
    }

    /// Takes idempotency key `key` on `log` for a new transfer, or finds what took it.
    ///
    /// The key is taken before the transfer is inserted, naming the transfer's id: of
    /// two requests with one key, one takes it, the other finds it. A key found taken
    /// for the same request but with no transfer inserted yet (its request is between
    /// the two writes, or died there) is completed under the same id: the log's unique
    /// `_id` then lets exactly one of the two inserts win, and the loser replays.
    ///
    /// A key of an API key may have been taken before keys were scoped, as a shared key
    /// ([`Requests::made_before_scoping`]): a retry of that request is answered with
    /// its transfer, whichever way this request found its own key, and never inserts a new
    /// one. Of two retries at once, the one that took the key may not have made its record
    /// name the earlier transfer yet when the other reads it: the other then finds a record
    /// naming nothing, and the earlier transfer decides for it too.
    pub(super) async fn take_key(
        &self,
        log: &Store,
        key: &ScopedKey,
        fingerprint: &str,
    ) -> ServiceResult<Taken> {
        // Taken first, read only if someone had it: a new key costs one write (and, for a
        // key of an API key, one read sent with it).
        let record = KeyRecord {
            transfer: crate::store::new_transfer_id(),
            request_hash: Some(fingerprint.to_owned()),
        };
        let (took, earlier) = tokio::join!(
            log.transfers().take_idempotency_key(key, &record),
            self.made_before_scoping(log, key, fingerprint),
        );
        let taken = match took {
            Ok(()) => {
                failpoint!(self, AfterTakeKey);
                return match earlier? {
                    Some(earlier) => self.adopt(log, key, record.transfer, earlier).await,
                    None => Ok(Taken::New(record.transfer)),
                };
            }
            Err(StoreError::DuplicateKey(_)) => {
                read_majority(|| log.transfers().idempotency_record(key))
                    .await?
                    .ok_or_else(|| {
                        // Taken on the primary, not yet on the majority this read asks for:
                        // by a request with this key whose write is not acknowledged yet.
                        StoreError::contended(None, "idempotency key taken but not readable yet")
                    })?
            }
            Err(e) => return Err(e.into()),
        };
        // The replay compares the request with the transfer's.
        if let Some(existing) = read_majority(|| log.transfers().transfer(taken.transfer)).await? {
            return Ok(Taken::Replay(Box::new(existing)));
        }
        // No transfer under the key's id: the request that took it may be answering
        // with one made before keys were scoped (above).
        if let Some(earlier) = earlier? {
            return self.adopt(log, key, taken.transfer, earlier).await;
        }
        // Or one inserted with this key by a version before `idempotencyKeys` may exist
        // (a rolling upgrade): the record is made to name it, and it answers. Only here,
        // off the hot path: on a sharded log this query goes to every shard. (No such
        // version scoped keys: a key of an API key is looked for as it took it, above.)
        if key.scope == KeyScope::Shared
            && let Some(legacy) = log.transfers().transfer_by_idempotency_key(key).await?
        {
            log.transfers()
                .repair_idempotency_record(key, Some(taken.transfer), &legacy)
                .await?;
            return Ok(Taken::Replay(Box::new(legacy)));
        }
        if taken.request_hash.as_deref() != Some(fingerprint) {
            return Err(ServiceError::IdempotencyKeyReused);
        }
        Ok(Taken::NotInserted(taken.transfer))
    }

    /// For a key of an API key: the transfer this very request made before keys were
    /// scoped by API key, when the same key was taken in the shared scope (a version
    /// that did not scope keys, or an instance without `API_KEYS`) for the same request
    /// (its fingerprint). Such a transfer answers the request's retry.
    ///
    /// A shared key taken for another request is not this caller's concern: the
    /// service cannot tell which API key took it (nothing stored that), so it refuses
    /// no one. A shared key whose request never inserted its transfer moved no money:
    /// the retry makes it. One read by `_id` when no shared key was taken, the common
    /// case; none for a shared key.
    async fn made_before_scoping(
        &self,
        log: &Store,
        key: &ScopedKey,
        fingerprint: &str,
    ) -> ServiceResult<Option<Transfer>> {
        let Some(shared) = key.as_taken_before_scoping() else {
            return Ok(None);
        };
        // Taken before this version ran, long majority-committed: one read decides.
        let Some(record) = log.transfers().idempotency_record(&shared).await? else {
            return Ok(None);
        };
        let earlier = match log.transfers().transfer(record.transfer).await? {
            Some(earlier) => Some(earlier),
            // Inserted by a version before `idempotencyKeys`, after migration 0006
            // copied the keys: it carries the key itself.
            None => log.transfers().transfer_by_idempotency_key(&shared).await?,
        };
        Ok(earlier.filter(|t| t.request_hash.as_deref() == Some(fingerprint)))
    }

    /// Makes the record of `key`, taken for transfer `taken` (never to be inserted now),
    /// name `earlier`, the transfer the same request made before keys were scoped, so
    /// that later retries find it directly; `earlier` answers.
    async fn adopt(
        &self,
        log: &Store,
        key: &ScopedKey,
        taken: TransferId,
        earlier: Transfer,
    ) -> ServiceResult<Taken> {
        log.transfers()
            .repair_idempotency_record(key, Some(taken), &earlier)
            .await?;
        Ok(Taken::Replay(Box::new(earlier)))
    }

    pub(super) async fn replay(
        &self,
        existing: Transfer,
        fingerprint: &str,
    ) -> ServiceResult<TransferOutcome> {
        if existing.request_hash.as_deref() != Some(fingerprint) {
            return Err(ServiceError::IdempotencyKeyReused);
        }
        let transfer = self
            .driver
            .wait_until_at_rest(existing, REPLAY_WAIT)
            .await?;
        Ok(TransferOutcome {
            transfer,
            replayed: true,
        })
    }
}
