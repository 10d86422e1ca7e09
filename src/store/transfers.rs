//! Operations on `transactions`, the transfer log. A state change is one `updateOne`
//! filtered on the expected previous state, so of two instances racing for the same
//! transition exactly one wins, and a step retried after a crash is a no-op.
//!
//! `lastModified` only ever moves forward (`$max`, never `$set`): instances' clocks may
//! disagree, and the lease and fence arithmetic needs every later write of a transfer to
//! carry a time at least as late as every earlier one.
//!
//! All of it is the [`Transfers`] view (`store.transfers()`), which holds `transactions`
//! and `idempotencyKeys` (a transfer and the key it takes are one concern), the
//! database's clock, the group-commit queues and the instance it writes for.

use std::sync::Arc;

use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::options::{FindOptions, ReturnDocument};

use super::accounts::Fence;
use super::batch::{Batches, Transition};
use super::clock::Clock;
use super::documents::{Stored, domain, object_id, stored_key, stored_time, transfer_id};
use super::fields::idempotency_key;
use super::fields::{party, path, transfer};
use super::guards::{due, due_doc, moved, owned_by, stamped, stamped_unset};
use super::{StoreError, StoreResult, TransferDoc};
use crate::domain::{
    AccountId, Amount, CancelReason, DeploymentName, ScopedKey, Side, Timestamp, Transfer,
    TransferFilter, TransferId, TransferState,
};

/// The states the sweeper looks for.
const UNFINISHED: [TransferState; 5] = [
    TransferState::Initial,
    TransferState::Pending,
    TransferState::Applied,
    TransferState::Canceling,
    TransferState::Capturing,
];

fn unfinished_states() -> Vec<&'static str> {
    UNFINISHED.iter().map(|s| s.as_str()).collect()
}

/// The states of a hold that still reserves and that no capture has won: past its
/// `expiresAt`, its reservations no longer count.
fn uncaptured_states() -> Vec<&'static str> {
    [TransferState::Held, TransferState::Canceling]
        .map(TransferState::as_str)
        .to_vec()
}

/// `condition` on a field, with the field present: the form in which every query names
/// `fenced`, `reversing` and `expiresAt`, whose indexes hold only the
/// transfers that have them (`migrations/0014_partial_indexes.json`). MongoDB uses a
/// partial index only for a query that implies its filter, and the filter written out is
/// implied on its face. (SecantusDB read every transfer for `{fenced: true}` alone, 6 ms
/// at 29,000, and the index with the filter written out, 0.4 ms.)
fn present(mut condition: Document) -> Document {
    condition.insert("$exists", true);
    condition
}

fn finished_states() -> Vec<&'static str> {
    TransferState::ALL
        .into_iter()
        .filter(|s| s.is_terminal())
        .map(|s| s.as_str())
        .collect()
}

/// Who may move a transfer on, and why that is safe: **the rule**, kept in this one place
/// (docs/protocol.md, "The rules: leases, fences and the clock", says it for users).
///
/// A transfer's owner may still have forward steps (debits, credits) on their way to the
/// server, sent before a pause, over a slow link or before a failover; each carries the
/// deadline of the owner's lease, checked against the server's clock. So whoever moves a
/// transfer must know that none of those can land afterwards:
/// - its owner, by [`Mover::Owner`]: guarded by `application`, it renews its own lease;
/// - the sweeper, only once the owner's lease has lapsed: [`Transfers::claim`] is guarded by
///   the transfer's `lastModified` being older than a lease, which outlives every
///   deadline the owner's steps carry;
/// - a cancel, which does not wait for the lease, by [`Mover::Cancel`]: only once both
///   accounts refuse the transfer's forward steps ([`Fenced`]), or while the transfer is
///   still `initial` (no step is sent before `initial -> pending`, which the cancel's
///   write makes impossible);
/// - anyone, by [`Mover::Resolver`], from `held` only (a capture, a void, an expiry): the
///   owner stored `held` only once no copy of its reservations could land any more,
///   and sends nothing after it, so no write of an earlier actor is in flight. The state
///   guard makes exactly one of them win; the server's clock, read where the write lands,
///   lets a capture through only before `expiresAt` and an expiry only from then on, and
///   decides whether a void is stored `voided` or `expired` ([`Resolution`]).
#[derive(Debug, Clone, Copy)]
pub enum Mover<'a> {
    /// The owner (for an `initial` transfer: the instance that inserted it, or nobody yet).
    Owner(&'a str),
    /// A cancel taking the transfer over as `owner`.
    Cancel {
        owner: &'a str,
        fenced: Option<Fenced>,
    },
    /// Whoever resolves a `held` hold, becoming its owner, as `by` says.
    Resolver { owner: &'a str, by: Resolution },
}

/// How a `held` hold is resolved, each decided by the server's clock where the write lands
/// (`$$NOW`), in one write: of two commands, the second may read an earlier clock than
/// the first (two routers of a sharded cluster, a failover to a primary whose clock is
/// behind), so no answer may rest on a pair of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// `held -> capturing`, only before `expiresAt`.
    Capture,
    /// `held -> canceling`, whenever: reason `voided` before `expiresAt`, `expired` from
    /// then on. Never loses to the clock.
    Void,
    /// `held -> canceling` with reason `expired`, only from `expiresAt` on.
    Expire,
}

/// Proof that every account of a transfer refuses its forward steps (see
/// [`super::Accounts::fence`]); only [`Fenced::all`] makes one.
#[derive(Debug, Clone, Copy)]
pub struct Fenced(());

impl Fenced {
    /// Every account of a transfer fenced, or gone (which refuses every step as well);
    /// `None` if one is not.
    pub fn all(fences: impl IntoIterator<Item = Fence>) -> Option<Fenced> {
        fences
            .into_iter()
            .all(|fence| matches!(fence, Fence::Placed | Fence::Missing))
            .then_some(Fenced(()))
    }
}

/// What an idempotency key stands for: the transfer it made (or is about to make: the
/// key is taken first) and the digest of the request, to tell a retry from a reuse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    pub transfer: TransferId,
    pub request_hash: Option<String>,
}

/// What a state change stores besides the state and the owner.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepFields {
    /// Why the transfer is being canceled (`pending -> canceling`, `initial -> canceled`).
    pub reason: Option<CancelReason>,
    /// The account whose step refused a multi-leg transfer, with `reason`.
    pub refused_account: Option<AccountId>,
    /// The accounts were fenced against the transfer: the sweeper drops the fences once
    /// it is finished.
    pub fenced: bool,
    /// The amount a capture takes (`held -> capturing`): the transfer's new `value`.
    pub captured: Option<Amount>,
}

/// One of the sweeper's scans of a log for stale transfers (unfinished ones, unfinished
/// reversals, fenced finished ones), a page at a time, least recently modified first.
///
/// Two things keep a scan from starving behind what the sweeper cannot act on, which
/// would otherwise stay the oldest page on every pass (and `BATCH` of them would hide
/// every later one):
/// - the query leaves out transfers whose destination, or any of whose multi-leg parties,
///   lives on a deployment that does not answer (`destinationDeployment`,
///   `parties.deployment`; absent means the log's own deployment, which `$nin` keeps):
///   nothing can drive them until it is back;
/// - each page starts past the transfers the earlier pages returned, so that what is
///   skipped for another reason (a transfer this process is driving, a race) is passed
///   over. Transfers may share one `lastModified` (a burst stamped in one millisecond),
///   so the position is the last time returned and the ids already returned at it.
#[derive(Debug, Clone)]
pub struct Scan {
    /// Last modified before this, by the clock of the log's deployment: stale.
    stale_before: Timestamp,
    /// Deployments that do not answer: transfers that touch their accounts are left out.
    unreachable: Vec<DeploymentName>,
    /// The `lastModified` of the last transfer returned, once a page was read.
    at: Option<Timestamp>,
    /// The transfers already returned whose `lastModified` is `at`.
    seen_at: Vec<TransferId>,
}

impl Scan {
    /// A scan from the start of what was modified before `stale_before`, leaving out
    /// what touches `unreachable`.
    pub fn new(stale_before: Timestamp, unreachable: Vec<DeploymentName>) -> Scan {
        Scan {
            stale_before,
            unreachable,
            at: None,
            seen_at: Vec::new(),
        }
    }

    /// Moves past `page`, the last page this scan returned (in `lastModified` order).
    pub fn past(&mut self, page: &[Transfer]) {
        for t in page {
            if self.at != Some(t.last_modified) {
                self.at = Some(t.last_modified);
                self.seen_at.clear();
            }
            self.seen_at.push(t.id);
        }
    }

    /// `filter` narrowed to this scan's next page.
    fn narrowed(&self, mut filter: Document) -> Document {
        let mut last_modified = doc! { "$lt": stored_time(self.stale_before) };
        if let Some(at) = self.at {
            last_modified.insert("$gte", stored_time(at));
            let seen: Vec<_> = self.seen_at.iter().map(|id| object_id(*id)).collect();
            filter.insert("_id", doc! { "$nin": seen });
        }
        filter.insert(transfer::LAST_MODIFIED, last_modified);
        if !self.unreachable.is_empty() {
            let names: Vec<&str> = self.unreachable.iter().map(|d| d.as_str()).collect();
            filter.insert(transfer::DESTINATION_DEPLOYMENT, doc! { "$nin": &names });
            // A multi-leg transfer: any party there (the first leg's destination is one).
            filter.insert(transfer::PARTIES_DEPLOYMENT, doc! { "$nin": names });
        }
        filter
    }
}

/// The transfer log, `transactions`, and the idempotency keys, `idempotencyKeys` (from
/// [`super::Store::transfers`]): a transfer's insert and the key it takes are one concern (a
/// replay finds the transfer by its key), so both collections are here.
#[derive(Clone, Copy, Debug)]
pub struct Transfers<'s> {
    pub(super) transactions: &'s Collection<TransferDoc>,
    /// `idempotencyKeys` (see [`super::Store`]'s field).
    pub(super) keys: &'s Collection<Document>,
    /// The group-commit queues of the inserts and state changes.
    pub(super) batches: &'s Arc<Batches>,
    /// Stamps `lastModified` and starts leases.
    pub(super) clock: Clock<'s>,
    /// What a transfer read here says of its place.
    pub(super) deployment: &'s DeploymentName,
    /// Names the pause points of the writes in the tests.
    #[cfg(feature = "failpoints")]
    pub(super) actor: &'s str,
}

#[cfg(feature = "failpoints")]
impl Transfers<'_> {
    /// The instance this view writes for (the name of its pause points).
    fn instance_id(&self) -> &str {
        self.actor
    }

    /// [`super::hold_back`] for this view's instance.
    fn hold_back(
        self,
        point: crate::failpoints::Point,
        write: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> StoreResult<()> {
        super::hold_back(self.actor, point, write)
    }
}

impl Transfers<'_> {
    /// Step 1: insert the transfer. Fails with `DuplicateKey` when its idempotency key is
    /// taken, or when it is a second reversal of the same transfer.
    ///
    /// `lastModified` is stamped by the database's clock (a lower bound of it, see
    /// [`super::clock`]), whatever the caller's copy says: another instance compares it
    /// with the database's time to decide when the transfer is stale.
    /// Returns that stamp.
    pub async fn insert_transfer(self, transfer: &Transfer) -> StoreResult<Timestamp> {
        let at = self.clock.stamp_time().await?;
        let stamped = TransferDoc {
            last_modified: at,
            events_due: due(transfer.state, at).into_iter().collect(),
            ..TransferDoc::from(transfer)
        };
        failpoint!(self, BeforeInsert);
        #[cfg(feature = "failpoints")]
        if crate::failpoints::recorded_twice(self.instance_id()) {
            let _ = self.batches.inserts.submit(stamped.clone()).await;
        }
        self.batches.inserts.submit(stamped).await?;
        Ok(at.to_chrono())
    }

    pub async fn transfer(self, id: TransferId) -> StoreResult<Option<Transfer>> {
        #[cfg(feature = "failpoints")]
        if crate::failpoints::read_lags(self.instance_id()) {
            return Ok(None);
        }
        self.find_transfer(doc! { "_id": object_id(id) }).await
    }

    /// The transfer that carries idempotency key `key` (a transfer inserted by a version
    /// before `idempotencyKeys` has no record). Not by `_id`: on a sharded log this
    /// query goes to every shard, so it is only for rare paths.
    pub async fn transfer_by_idempotency_key(
        self,
        key: &ScopedKey,
    ) -> StoreResult<Option<Transfer>> {
        self.find_transfer(doc! { transfer::IDEMPOTENCY_KEY: stored_key(key) })
            .await
    }

    /// The record of idempotency key `key` on this deployment: the transfer it made and
    /// the digest of the request that made it.
    pub async fn idempotency_record(self, key: &ScopedKey) -> StoreResult<Option<KeyRecord>> {
        #[cfg(feature = "failpoints")]
        if crate::failpoints::read_lags(self.instance_id()) {
            return Ok(None);
        }
        let id = stored_key(key);
        let found = self
            .keys
            .find_one(doc! { "_id": &id })
            .max_time(super::READ_TIME_LIMIT)
            .await?;
        let Some(found) = found else {
            return Ok(None);
        };
        let bad =
            |why: String| StoreError::Malformed(format!("idempotency key {id}: {why}").into());
        Ok(Some(KeyRecord {
            transfer: transfer_id(
                found
                    .get_object_id(idempotency_key::TRANSFER)
                    .map_err(|e| bad(e.to_string()))?,
            ),
            request_hash: found
                .get_str(idempotency_key::REQUEST_HASH)
                .ok()
                .map(str::to_owned),
        }))
    }

    /// Takes idempotency key `key` for transfer `record.transfer`, before that transfer
    /// is inserted. Fails with `DuplicateKey` when the key is taken: exactly one of two
    /// concurrent requests with one key gets it.
    pub async fn take_idempotency_key(
        self,
        key: &ScopedKey,
        record: &KeyRecord,
    ) -> StoreResult<()> {
        let mut entry = doc! {
            "_id": stored_key(key),
            idempotency_key::TRANSFER: object_id(record.transfer),
            idempotency_key::AT: DateTime::now(),
        };
        if let Some(hash) = &record.request_hash {
            entry.insert(idempotency_key::REQUEST_HASH, hash);
        }
        failpoint!(self, BeforeTakeKey);
        self.keys.insert_one(entry).await?;
        Ok(())
    }

    /// Makes the record of `key` name `actual`, a transfer inserted with the key earlier
    /// (by a version before `idempotencyKeys`, or before keys were scoped by API key),
    /// where it names `stale` (a transfer that will never be inserted: the request that
    /// took the key answers with `actual` instead), or where there is none.
    pub async fn repair_idempotency_record(
        self,
        key: &ScopedKey,
        stale: Option<TransferId>,
        actual: &Transfer,
    ) -> StoreResult<()> {
        let id = stored_key(key);
        let mut filter = doc! { "_id": &id };
        if let Some(stale) = stale {
            filter.insert(idempotency_key::TRANSFER, object_id(stale));
        }
        let mut set = doc! { idempotency_key::TRANSFER: object_id(actual.id) };
        match &actual.request_hash {
            Some(hash) => set.insert(idempotency_key::REQUEST_HASH, hash),
            None => set.insert(idempotency_key::REQUEST_HASH, Bson::Null),
        };
        self.keys
            .update_one(
                filter,
                doc! { "$set": set, "$setOnInsert": { idempotency_key::AT: DateTime::now() } },
            )
            .upsert(stale.is_none())
            .await?;
        tracing::info!(key = %id, transfer_id = %actual.id, "idempotency key record made to name the transfer inserted with the key earlier");
        Ok(())
    }

    async fn find_transfer(self, filter: Document) -> StoreResult<Option<Transfer>> {
        let found = self
            .transactions
            .find_one(filter)
            .max_time(super::READ_TIME_LIMIT)
            .await?;
        found.map(|d| d.into_domain(self.deployment)).transpose()
    }

    /// Claims the one reversal a done transfer may have: sets `reversedBy` only if it is
    /// unset, and `reversing` until the compensation has finished, so that the sweeper
    /// finishes a reversal whose instance crashed. Returns whether this call claimed it.
    pub async fn claim_reversal(
        self,
        original: TransferId,
        reversal: TransferId,
    ) -> StoreResult<bool> {
        failpoint!(self, BeforeClaimReversal);
        let at = self.clock.stamp_time().await?;
        let reversal = object_id(reversal);
        let result = self
            .transactions
            .update_one(
                doc! {
                    "_id": object_id(original),
                    transfer::STATE: TransferState::Done.as_str(),
                    transfer::REVERSED_BY: { "$exists": false },
                },
                stamped(
                    doc! { transfer::REVERSED_BY: reversal, transfer::REVERSING: true },
                    at,
                ),
            )
            .await?;
        Ok(result.modified_count == 1)
    }

    /// Releases a claim whose compensating transfer ended `canceled`, so that a later
    /// cancel may try again. The canceled compensation stays in the log.
    pub async fn release_reversal(
        self,
        original: TransferId,
        reversal: TransferId,
    ) -> StoreResult<()> {
        let at = self.clock.stamp_time().await?;
        self.transactions
            .update_one(
                doc! { "_id": object_id(original), transfer::REVERSED_BY: object_id(reversal) },
                stamped_unset(&[transfer::REVERSED_BY, transfer::REVERSING], at),
            )
            .await?;
        Ok(())
    }

    /// Marks the reversal of `original` finished (its compensation is `done`).
    pub async fn reversal_finished(
        self,
        original: TransferId,
        reversal: TransferId,
    ) -> StoreResult<()> {
        let at = self.clock.stamp_time().await?;
        let (original, reversal) = (object_id(original), object_id(reversal));
        self.transactions
            .update_one(
                doc! { "_id": original, transfer::REVERSED_BY: reversal, transfer::REVERSING: true },
                stamped_unset(&[transfer::REVERSING], at),
            )
            .await?;
        Ok(())
    }

    /// Done transfers whose reversal was claimed before the scan's `stale_before` and has
    /// not finished: its instance crashed between the claim and the end of the
    /// compensation. The next page of `scan`.
    pub async fn unfinished_reversals(self, scan: &Scan, limit: u32) -> StoreResult<Vec<Transfer>> {
        self.stale(
            doc! { transfer::REVERSING: present(doc! { "$eq": true }) },
            scan,
            limit,
        )
        .await
    }

    /// Marks an unfinished transfer `fenced` before anyone fences its accounts, so that
    /// whoever finishes it, and however, the sweeper later finds and drops the fences.
    /// Stamps the transfer (the fences' deadlines count from here). Returns the start of
    /// that window (a lower bound of the stamp), or `None` if the transfer is already
    /// finished: then nothing needs fencing.
    pub async fn mark_fenced(self, id: TransferId) -> StoreResult<Option<Timestamp>> {
        let since = self.clock.stamp_time().await?;
        failpoint!(self, BeforeMarkFenced);
        let result = self
            .transactions
            .update_one(
                doc! { "_id": object_id(id), transfer::STATE: { "$in": unfinished_states() } },
                stamped(doc! { transfer::FENCED: true }, since),
            )
            .await?;
        Ok((result.matched_count == 1).then_some(since.to_chrono()))
    }

    /// Finished transfers whose account fences may still be in place, last modified
    /// before the scan's `stale_before`. The next page of `scan`.
    pub async fn fenced_finished(self, scan: &Scan, limit: u32) -> StoreResult<Vec<Transfer>> {
        let filter = doc! {
            transfer::FENCED: present(doc! { "$eq": true }),
            transfer::STATE: { "$in": finished_states() },
        };
        self.stale(filter, scan, limit).await
    }

    /// Holds still `held` whose `expiresAt` is not after `now` (a time by the database's
    /// clock), soonest expired first.
    pub async fn expired_holds(self, now: Timestamp, limit: u32) -> StoreResult<Vec<Transfer>> {
        let filter = doc! {
            transfer::STATE: TransferState::Held.as_str(),
            transfer::EXPIRES_AT: present(doc! { "$lte": stored_time(now) }),
        };
        self.find_sorted(filter, doc! { transfer::EXPIRES_AT: 1 }, limit)
            .await
    }

    /// Holds among `markers` (the transfers whose marker the account carries) reserving
    /// on `account`'s `side` (out of it as their source or a paying party, into it as
    /// their destination or a receiving party) whose reservation reads no longer count
    /// (see [`Transfers::expired_holds_touching`]), soonest expired first. By the markers, so
    /// that holds already released there (a multi-leg hold stays `canceling` while another
    /// party's deployment does not answer) cannot fill the page.
    pub async fn expired_holds_reserving(
        self,
        account: &AccountId,
        side: Side,
        markers: &[TransferId],
        now: Timestamp,
        limit: u32,
    ) -> StoreResult<Vec<Transfer>> {
        let markers: Vec<ObjectId> = markers.iter().map(|&id| object_id(id)).collect();
        let (one_leg, net) = match side {
            Side::Source => (transfer::SOURCE, doc! { "$lt": 0_i64 }),
            Side::Destination => (transfer::DESTINATION, doc! { "$gt": 0_i64 }),
        };
        let filter = doc! {
            "_id": { "$in": markers },
            transfer::STATE: { "$in": uncaptured_states() },
            transfer::EXPIRES_AT: present(doc! { "$lte": stored_time(now) }),
            "$or": [
                { one_leg: account.as_str(), transfer::LEGS: { "$exists": false } },
                // A multi-leg hold's party on that side (its first leg's source may
                // receive, its first leg's destination pay).
                { transfer::PARTIES: { "$elemMatch": { party::ACCOUNT: account.as_str(), party::NET: net } } },
            ],
        };
        self.find_sorted(filter, doc! { transfer::EXPIRES_AT: 1 }, limit)
            .await
    }

    /// Holds touching any of `accounts` that are past their `expiresAt` at `now` and not
    /// captured (`held`, or `canceling` while released).
    pub async fn expired_holds_touching(
        self,
        accounts: &[&AccountId],
        now: Timestamp,
    ) -> StoreResult<Vec<Transfer>> {
        let ids: Vec<&str> = accounts.iter().map(|a| a.as_str()).collect();
        let filter = doc! {
            transfer::STATE: { "$in": uncaptured_states() },
            transfer::EXPIRES_AT: present(doc! { "$lte": stored_time(now) }),
            "$or": [
                { transfer::SOURCE: { "$in": &ids } },
                { transfer::DESTINATION: { "$in": &ids } },
                { transfer::PARTIES_ACCOUNT: { "$in": &ids } },
            ],
        };
        let cursor = self
            .transactions
            .find(filter)
            .max_time(super::READ_TIME_LIMIT)
            .await?;
        domain(cursor.try_collect().await?, self.deployment)
    }

    /// Forgets that a finished transfer's accounts are fenced, once the fences are gone.
    pub async fn unmark_fenced(self, id: TransferId) -> StoreResult<()> {
        self.transactions
            .update_one(
                doc! { "_id": object_id(id), transfer::STATE: { "$in": finished_states() }, transfer::FENCED: true },
                doc! { "$unset": { transfer::FENCED: "" } },
            )
            .await?;
        Ok(())
    }

    /// The next page of `scan` (at most `limit` transfers matching `filter`), least
    /// recently modified first.
    async fn stale(self, filter: Document, scan: &Scan, limit: u32) -> StoreResult<Vec<Transfer>> {
        self.find_sorted(
            scan.narrowed(filter),
            doc! { transfer::LAST_MODIFIED: 1 },
            limit,
        )
        .await
    }

    /// At most `limit` transfers matching `filter`, in `sort` order.
    async fn find_sorted(
        self,
        filter: Document,
        sort: Document,
        limit: u32,
    ) -> StoreResult<Vec<Transfer>> {
        let options = FindOptions::builder()
            .sort(sort)
            .limit(i64::from(limit))
            .build();
        let cursor = self
            .transactions
            .find(filter)
            .with_options(options)
            .max_time(super::READ_TIME_LIMIT)
            .await?;
        domain(cursor.try_collect().await?, self.deployment)
    }

    /// Transfers newest first, by keyset on `_id` (an ObjectId grows with time).
    pub async fn list_transfers(
        self,
        filter: &TransferFilter,
        limit: u32,
    ) -> StoreResult<Vec<Transfer>> {
        let mut query = Document::new();
        if let Some(state) = filter.state {
            query.insert(transfer::STATE, state.as_str());
        }
        if filter.unexpired {
            let now = self.clock.stamp_time().await?;
            query.insert(transfer::EXPIRES_AT, present(doc! { "$gt": now }));
        }
        if let Some(account) = filter.account.as_ref().map(|a| a.as_str()) {
            // A multi-leg transfer's accounts are its parties (`parties_account_id`).
            query.insert(
                "$or",
                vec![
                    doc! { transfer::SOURCE: account },
                    doc! { transfer::DESTINATION: account },
                    doc! { transfer::PARTIES_ACCOUNT: account },
                ],
            );
        }
        if let Some(before) = filter.before {
            query.insert("_id", doc! { "$lt": object_id(before) });
        }
        // Index `tenants_id`: a tenant's listing walks its own transfers only.
        if let Some(tenant) = &filter.tenant {
            query.insert(transfer::TENANTS, tenant.as_str());
        }
        self.find_sorted(query, doc! { "_id": -1 }, limit).await
    }
}

impl Transfers<'_> {
    /// Moves a transfer from `from` to `to`, setting `fields` too, only if it is still in
    /// `from` and `by` may move it (see [`Mover`]); `by` becomes its owner. Returns the
    /// new `lastModified` (the start of the mover's lease) when this call made the change.
    ///
    /// # Panics
    /// On a cancel that names no fences for a transfer past `initial`: moving it then
    /// could let its owner's forward steps land afterwards. That is a bug in the caller.
    pub async fn change_state(
        self,
        transfer: TransferId,
        from: TransferState,
        to: TransferState,
        by: Mover<'_>,
        fields: StepFields,
    ) -> StoreResult<Option<Timestamp>> {
        let id = object_id(transfer);
        // Taken before the write is sent, so the server stamps the lease at least this late.
        let lease_start = self.clock.stamp_time().await?;
        let (owner, filter) = match by {
            Mover::Owner(owner) => {
                failpoint!(self, BeforeTransition);
                if fields == StepFields::default() {
                    // The common case, group-committed with concurrent transfers' changes.
                    let change = Transition {
                        owner: owner.to_owned(),
                        id,
                        from,
                        to,
                        at: lease_start,
                    };
                    return self.change_state_batched(change).await;
                }
                let guard = owned_by(owner, from);
                (
                    owner,
                    doc! { "_id": id, transfer::STATE: from.as_str(), transfer::APPLICATION: guard },
                )
            }
            Mover::Cancel { owner, fenced } => {
                assert!(
                    fenced.is_some() || from == TransferState::Initial,
                    "bug: a cancel moved transfer {id} from {from} without fencing its accounts"
                );
                failpoint!(self, BeforeForce);
                (owner, doc! { "_id": id, transfer::STATE: from.as_str() })
            }
            Mover::Resolver { owner, by } => {
                assert_eq!(
                    from,
                    TransferState::Held,
                    "bug: transfer {id} resolved from {from}, not held"
                );
                failpoint!(self, BeforeResolve);
                let mut set = doc! { transfer::STATE: to.as_str(), transfer::APPLICATION: owner };
                set.extend(step_fields(fields));
                return self.resolve_held(id, to, set, by, lease_start).await;
            }
        };
        let mut set = doc! { transfer::STATE: to.as_str(), transfer::APPLICATION: owner };
        set.extend(step_fields(fields));
        let update = moved(to, set, lease_start);
        #[cfg(feature = "failpoints")]
        if matches!(by, Mover::Owner(_)) {
            let (transactions, filter, update) =
                (self.transactions.clone(), filter.clone(), update.clone());
            let copy = async move {
                let _ = transactions.update_one(filter, update).await;
            };
            self.hold_back(crate::failpoints::Point::BeforeTransition, copy)?;
        }
        let result = self.transactions.update_one(filter, update).await?;
        Ok((result.modified_count == 1).then_some(lease_start.to_chrono()))
    }
}

impl Transfers<'_> {
    /// An owner's state change that stores nothing else, group-committed with those of
    /// concurrent transfers (see `store::batch`). The new `lastModified` when it won.
    async fn change_state_batched(self, change: Transition) -> StoreResult<Option<Timestamp>> {
        #[cfg(feature = "failpoints")]
        {
            let (batches, change) = (self.batches.clone(), change.clone());
            let copy = async move {
                let _ = batches.transitions.submit(change).await;
            };
            self.hold_back(crate::failpoints::Point::BeforeTransition, copy)?;
        }
        let won = self.batches.transitions.submit(change).await?;
        Ok(won.map(DateTime::to_chrono))
    }

    /// A resolver's change of held transfer `id` (see [`Mover::Resolver`]): `set` as `by`
    /// decides by the server's clock where the write lands, stamped `lease_start`. The new
    /// `lastModified` when it won.
    async fn resolve_held(
        self,
        id: ObjectId,
        to: TransferState,
        set: Document,
        by: Resolution,
        lease_start: DateTime,
    ) -> StoreResult<Option<Timestamp>> {
        let filter = doc! { "_id": id, transfer::STATE: TransferState::Held.as_str() };
        let update = resolved_by_the_clock(set, to, by, self.resolving_clock(), lease_start);
        let result = self.transactions.update_one(filter, update).await?;
        Ok((result.modified_count == 1).then_some(lease_start.to_chrono()))
    }
}

/// The fields a state change stores besides the state and the owner.
fn step_fields(fields: StepFields) -> Document {
    let mut set = Document::new();
    if let Some(reason) = fields.reason {
        set.insert(transfer::REASON, reason.as_str());
    }
    if let Some(account) = fields.refused_account {
        set.insert(transfer::REFUSED_ACCOUNT, account.as_str());
    }
    if fields.fenced {
        set.insert(transfer::FENCED, true);
    }
    if let Some(captured) = fields.captured {
        set.insert(transfer::VALUE, captured.minor_units());
    }
    set
}

/// The update of a resolver's change (see [`Mover::Resolver`]): `set` and the stamp, as
/// `by` decides by the server's clock `now` (`$$NOW`, one value for the whole command),
/// as an update pipeline that leaves the document unchanged where it does not resolve, so
/// that the write reports no change; a void's reason is chosen there too. The clock's
/// test is made where the write lands, so a capture that reaches the server late is
/// judged by the time it lands; it is in the pipeline rather than in the filter because
/// SecantusDB scans the whole collection for a filter with `$expr` (5.6 ms against 0.6 ms
/// at 20,000 transfers, measured), while the `_id` filter and the pipeline cost the same
/// on MongoDB.
fn resolved_by_the_clock(
    mut set: Document,
    to: TransferState,
    by: Resolution,
    now: Bson,
    at: DateTime,
) -> Vec<Document> {
    let expired = doc! { "$lte": [path(transfer::EXPIRES_AT), now] };
    let decided = match by {
        Resolution::Capture => doc! { "$not": [expired.clone()] },
        Resolution::Expire => expired.clone(),
        Resolution::Void => {
            let (voided, expiry) = (CancelReason::Voided, CancelReason::Expired);
            let reason = doc! { "$cond": [expired, expiry.as_str(), voided.as_str()] };
            set.insert(transfer::REASON, reason);
            doc! { "$literal": true }
        }
    };
    let mut conditional: Document = set
        .into_iter()
        .map(|(field, value)| {
            let kept = Bson::String(format!("${field}"));
            // A computed value (the void's reason) is an expression; the others literals.
            let value = match value {
                Bson::Document(expression) => Bson::Document(expression),
                literal => Bson::Document(doc! { "$literal": literal }),
            };
            let value = doc! { "$cond": ["$_resolves", value, kept] };
            (field, Bson::Document(value))
        })
        .collect();
    if let Some(due) = due(to, at) {
        let marked = doc! { "$concatArrays": [
            { "$ifNull": [path(transfer::EVENTS_DUE), []] },
            [{ "$literal": due_doc(&due) }],
        ] };
        conditional.insert(
            transfer::EVENTS_DUE,
            doc! { "$cond": ["$_resolves", marked, { "$ifNull": [path(transfer::EVENTS_DUE), "$$REMOVE"] }] },
        );
    }
    conditional.insert(
        transfer::LAST_MODIFIED,
        doc! { "$cond": ["$_resolves", { "$max": [path(transfer::LAST_MODIFIED), at] }, path(transfer::LAST_MODIFIED)] },
    );
    vec![
        doc! { "$set": { "_resolves": decided } },
        doc! { "$set": conditional },
        doc! { "$unset": "_resolves" },
    ]
}

impl Transfers<'_> {
    /// What a resolver's write takes for the server's clock: `$$NOW`, where the write
    /// lands; in the tests, the times set with `failpoints::set_clocks`, one per write.
    fn resolving_clock(self) -> Bson {
        #[cfg(feature = "failpoints")]
        if let Some(at) = crate::failpoints::next_clock(self.instance_id()) {
            return Bson::DateTime(DateTime::from_chrono(at));
        }
        Bson::String("$$NOW".into())
    }

    /// Renews `owner`'s lease on a transfer still in `state`: a fresh `lastModified`.
    pub async fn renew_lease(
        self,
        owner: &str,
        id: TransferId,
        state: TransferState,
    ) -> StoreResult<Option<Timestamp>> {
        let lease_start = self.clock.stamp_time().await?;
        failpoint!(self, BeforeRenew);
        let result = self
            .transactions
            .update_one(
                doc! { "_id": object_id(id), transfer::STATE: state.as_str(), transfer::APPLICATION: owner },
                stamped(doc! {}, lease_start),
            )
            .await?;
        // Matched, not modified: a stamp already later than ours changes nothing, and
        // the lease is still ours.
        Ok((result.matched_count == 1).then_some(lease_start.to_chrono()))
    }

    /// Takes over a transfer in `state` whatever its owner or age, once both its accounts
    /// are fenced (see [`Mover::Cancel`]): used by a cancel of an `applied` or `canceling`
    /// transfer, whose remaining steps are safe for any instance to run. Returns the
    /// transfer as claimed, if it was still in `state`.
    pub async fn take_over(
        self,
        owner: &str,
        id: TransferId,
        state: TransferState,
        _fenced: Fenced,
    ) -> StoreResult<Option<Transfer>> {
        failpoint!(self, BeforeTakeOver);
        let at = self.clock.stamp_time().await?;
        let taken = self
            .transactions
            .find_one_and_update(
                doc! { "_id": object_id(id), transfer::STATE: state.as_str() },
                stamped(doc! { transfer::APPLICATION: owner }, at),
            )
            .return_document(ReturnDocument::After)
            .await?;
        taken.map(|d| d.into_domain(self.deployment)).transpose()
    }

    /// Unfinished transfers last modified before the scan's `stale_before` (a time by the
    /// database's clock, see [`super::Store::server_time`]), oldest first. The next page of
    /// `scan`.
    pub async fn unfinished(self, scan: &Scan, limit: u32) -> StoreResult<Vec<Transfer>> {
        let filter = doc! { transfer::STATE: { "$in": unfinished_states() } };
        self.stale(filter, scan, limit).await
    }

    /// Claims a transfer found by [`Transfers::unfinished`]: one guarded findAndModify that
    /// wins only if nobody touched the transfer since it was read (same state, owner and
    /// `lastModified`; the owner too, since `lastModified` need not move) and it is still
    /// stale by the database's clock.
    pub async fn claim(
        self,
        owner: &str,
        found: &Transfer,
        stale_before: Timestamp,
    ) -> StoreResult<Option<Transfer>> {
        failpoint!(self, BeforeClaim);
        let at = self.clock.stamp_time().await?;
        let filter = doc! {
            "_id": object_id(found.id),
            transfer::STATE: found.state.as_str(),
            transfer::APPLICATION: found.owner.as_deref(),
            transfer::LAST_MODIFIED: {
                "$eq": stored_time(found.last_modified),
                "$lt": stored_time(stale_before),
            },
        };
        let claimed = self
            .transactions
            .find_one_and_update(filter, stamped(doc! { transfer::APPLICATION: owner }, at))
            .return_document(ReturnDocument::After)
            .await?;
        claimed.map(|d| d.into_domain(self.deployment)).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The proof is made only when every account refuses: one fence that found the
    /// transfer applied (not placed), or came too late, proves nothing about that account.
    #[test]
    fn only_refusing_accounts_make_a_fence_proof() {
        let refusing = [Fence::Placed, Fence::Missing];
        for a in refusing {
            for b in refusing {
                assert!(Fenced::all([a, b, a]).is_some());
            }
        }
        for open in [Fence::Applied, Fence::TooLate] {
            for other in [
                Fence::Placed,
                Fence::Missing,
                Fence::Applied,
                Fence::TooLate,
            ] {
                assert!(Fenced::all([open, other]).is_none(), "{open:?}, {other:?}");
                assert!(Fenced::all([other, open]).is_none(), "{other:?}, {open:?}");
                let third = [Fence::Placed, other, open];
                assert!(Fenced::all(third).is_none(), "{third:?}");
            }
        }
    }
}
