//! Group commit: the protocol writes of concurrent transfers, gathered into one database
//! command per kind of step, so that one journal flush serves many transfers.
//!
//! Each caller still asks for its own guarded write and gets its own answer; only the
//! transport is shared. While one batch of a kind is being written, the next callers
//! queue; when it is done, all of them (up to [`MAX_BATCH`]) go out together. Under no
//! load a batch holds one write and nothing waits. The writes one transfer's step makes
//! on a deployment (its prepare, or its settle, of every party there) are queued as one
//! unit ([`Batcher::submit_all`]), which goes out whole in one batch: a transfer's two
//! accounts are one write, not two whenever the writer's task happens to wake between
//! the two submissions. Across all kinds, at most
//! `GROUP_COMMIT_WRITES` batches (default [`DEFAULT_GROUP_COMMIT_WRITES`]) are in flight at once:
//! a kind's task takes a slot before it gathers its batch, so whatever queues while the
//! slots are taken joins that batch.
//!
//! Why one statement and not a multi-statement `update` command: a single `updateMany`
//! wrote several times the documents a second (`docs/benchmark/decisions.md`). So every
//! batched kind is one statement:
//!
//! | step | one statement for the batch |
//! |---|---|
//! | insert | `insertMany`, unordered; a taken idempotency key fails only its own document |
//! | state change | `updateMany {_id: {$in}, state: from, application: owner}`, one per (owner, from, to), written at once |
//! | prepare (debit, room, reservation; an older transfer's credit) | `updateMany` with a pipeline that applies each transfer's change in order, each under its own guards |
//! | settle | `updateMany` with a pipeline that pays each receiving party in and pulls every party's marker, each where its marker is |
//! | pulls | `updateMany` with a pipeline that rids each account of its own pulls' markers |
//!
//! Every document is still updated atomically under its own guards, exactly as the
//! single-document step would be, and a crash in the middle of a batch leaves each
//! transfer either stepped or not, which its guards and markers tell apart on a retry.
//! When a batched update does not report every document changed, the documents are read
//! back to learn which callers' writes took effect. A prepare batch leaves a document
//! none of whose changes landed exactly as it was, so with one change per account (a lone
//! transfer's two accounts) the count alone says when all did.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::future::Future;
use std::sync::Arc;

use futures::TryStreamExt;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::error::ErrorKind;
use mongodb::{Collection, Database};
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::entries::{
    EntryCopier, Marker, Moved, changed_with_entry, entry_expr, entry_time, kept, room_changed,
    unless_zero,
};
use super::fields::{account, path, transfer};
use super::guards::{Amounts, forward_step_allowed, moved, owned_by};
use super::{StoreError, StoreResult, TransferDoc, timed, writing_to};
use crate::domain::{DeploymentName, EntryKind, TransferState};

/// Writes in one batch, at most: bounds the size of one command (and of the pipeline's
/// per-account table).
pub const MAX_BATCH: usize = 256;

/// Group-commit writes in flight to the database at once, across all kinds, unless
/// `GROUP_COMMIT_WRITES` says otherwise. SecantusDB runs write commands one after another,
/// so more writes in flight only wait there, each holding a batch that closed too early.
/// With two, one write runs while the next waits, and everything that queues meanwhile
/// joins the next batch; of the settings measured, two kept latency lowest
/// (`docs/benchmark/decisions.md`). A real replica set, whose journal serves concurrent
/// writers with one flush, may like more.
pub const DEFAULT_GROUP_COMMIT_WRITES: usize = 2;

type Reply<Out> = oneshot::Sender<StoreResult<Out>>;

/// Operations that go out in one batch: one, or all of one transfer's on a deployment
/// (see [`Batcher::submit_all`]).
type Unit<Op, Out> = Vec<(Op, Reply<Out>)>;

/// A queue of one kind of write, drained by one task that writes a batch at a time,
/// holding one of the shared writer slots (if given) while it gathers and writes it.
pub struct Batcher<Op, Out> {
    queue: mpsc::UnboundedSender<Unit<Op, Out>>,
}

impl<Op: Send + 'static, Out: Send + 'static> Batcher<Op, Out> {
    /// Starts the task that writes batches with `write`, which must answer one result per
    /// operation, in order, as a writer of `deployment` (the label of its commands'
    /// timings, see `store::timed`). Must be called inside a tokio runtime; the task ends
    /// when the last handle is dropped.
    pub fn start<F, Fut>(
        deployment: DeploymentName,
        slots: Option<Arc<Semaphore>>,
        write: F,
    ) -> Batcher<Op, Out>
    where
        F: Fn(Vec<Op>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = StoreResult<Vec<StoreResult<Out>>>> + Send,
    {
        let (queue, mut waiting) = mpsc::unbounded_channel::<Unit<Op, Out>>();
        tokio::spawn(writing_to(deployment, async move {
            // A unit that did not fit in the batch before opens the next one.
            let mut carried: Option<Unit<Op, Out>> = None;
            loop {
                let first = match carried.take() {
                    Some(unit) => unit,
                    None => match waiting.recv().await {
                        Some(unit) => unit,
                        None => break,
                    },
                };
                // Take a writer slot before gathering the batch: whatever queues while
                // the other kinds' writes hold the slots joins this batch.
                let _slot = match &slots {
                    Some(slots) => slots.clone().acquire_owned().await.ok(),
                    None => None,
                };
                let mut batch = first;
                while batch.len() < MAX_BATCH {
                    match waiting.try_recv() {
                        Ok(unit) if batch.len() + unit.len() <= MAX_BATCH => batch.extend(unit),
                        Ok(unit) => {
                            carried = Some(unit);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                write_batch(&write, batch).await;
            }
        }));
        Batcher { queue }
    }

    /// Queues `op` and waits for its own result.
    pub async fn submit(&self, op: Op) -> StoreResult<Out> {
        let mut results = self.submit_all(vec![op]).await?;
        results.pop().expect("one result per operation")
    }

    /// Queues `ops` as one unit, which goes out whole in one batch (the batch holds at
    /// most [`MAX_BATCH`] operations, or the unit alone if it is larger), and waits for
    /// each one's result, in order: so that a transfer's step on its two accounts is one
    /// write, not two whenever the writer happens to wake between them.
    pub async fn submit_all(&self, ops: Vec<Op>) -> StoreResult<Vec<StoreResult<Out>>> {
        let stopped = || StoreError::Unavailable("the batch writer has stopped".into());
        let (unit, answers): (Unit<Op, Out>, Vec<_>) = ops
            .into_iter()
            .map(|op| {
                let (reply, answer) = oneshot::channel();
                ((op, reply), answer)
            })
            .unzip();
        self.queue.send(unit).map_err(|_| stopped())?;
        let mut results = Vec::with_capacity(answers.len());
        for answer in answers {
            results.push(answer.await.map_err(|_| stopped())?);
        }
        Ok(results)
    }
}

/// Writes one batch with `write` and answers each operation of it.
async fn write_batch<Op, Out, F, Fut>(write: &F, batch: Vec<(Op, Reply<Out>)>)
where
    F: Fn(Vec<Op>) -> Fut,
    Fut: Future<Output = StoreResult<Vec<StoreResult<Out>>>>,
{
    let (ops, replies): (Vec<Op>, Vec<Reply<Out>>) = batch.into_iter().unzip();
    match write(ops).await {
        Ok(results) => {
            for (reply, result) in replies.into_iter().zip(results) {
                let _ = reply.send(result);
            }
        }
        Err(e) => {
            for reply in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}

/// One guarded forward step of a transfer on an account: a debit or a credit (of the
/// balance), or a hold's reservation (of the pending debits or credits), applied only if
/// the transfer is neither applied here nor fenced, the account keeps its invariants
/// (`guards::forward_step_allowed`), and the database's clock is before `deadline`.
#[derive(Debug, Clone)]
pub struct AccountChange {
    pub account: String,
    pub tx: ObjectId,
    /// Added to `balance`: negative for a debit, positive for a credit.
    pub delta: i64,
    /// Added to `pendingDebits`: a hold's reservation out of the account.
    pub debits: i64,
    /// Added to `pendingCredits`: a hold's reservation into the account.
    pub credits: i64,
    /// Added to `incoming`: the room a multi-leg transfer's receiving party prepares
    /// (`docs/legs.md`).
    pub incoming: i64,
    pub deadline: DateTime,
    /// The entry the change makes if it lands (see `store::entries`); none for a change
    /// of the room alone.
    pub kind: Option<EntryKind>,
}

impl AccountChange {
    /// The change's amounts as literal expressions.
    fn amounts(&self) -> Amounts {
        Amounts {
            incoming: self.incoming.into(),
            ..Amounts::change(self.delta, self.debits, self.credits)
        }
    }

    /// Whether the change lands on its account as stored: the guards of every forward
    /// step (`guards::forward_step_allowed`), as an expression.
    fn allowed(&self) -> Document {
        forward_step_allowed(
            &Amounts::stored(),
            path(account::PENDING),
            self.tx,
            &self.amounts(),
            self.deadline,
        )
    }
}

/// A state change guarded by the expected state and owner.
#[derive(Debug, Clone)]
pub struct Transition {
    pub owner: String,
    pub id: ObjectId,
    pub from: TransferState,
    pub to: TransferState,
    /// A lower bound of the database's clock taken before the change was submitted: the
    /// stamp (see `guards::stamped`).
    pub at: DateTime,
}

/// The marker of one transfer to pull from one account, and from no other: another
/// account may carry the same transfer's marker as a receiving party, which only its
/// settle may take (`docs/protocol.md`).
#[derive(Debug, Clone)]
pub struct Pull {
    pub account: String,
    pub tx: ObjectId,
}

/// A party's settle (`docs/protocol.md`, step 5): a receiving party's `pay_in` paid in
/// out of the room its prepare made, with its credit entry, and the marker pulled; only
/// where the marker is, so a second landing finds nothing.
#[derive(Debug, Clone)]
pub struct Settle {
    pub account: String,
    pub tx: ObjectId,
    /// What a receiving party is paid in (zero or more); `None` for a party that only
    /// loses its marker (a paying party, or one already paid in), so that the settle of
    /// every party of a transfer is one write per deployment.
    pub pay_in: Option<i64>,
}

/// What a transfer reads of an account it has not seen yet: its currency and tenant.
pub type Essentials = (String, Option<String>);

/// The group-commit queues of one store (and one of reads: the accounts' currencies and
/// tenants, which a transfer between accounts this process has not seen yet must read
/// first).
pub struct Batches {
    pub placements: Batcher<[String; 2], [Option<Essentials>; 2]>,
    pub inserts: Batcher<TransferDoc, ()>,
    pub transitions: Batcher<Transition, Option<DateTime>>,
    pub account_changes: Batcher<AccountChange, bool>,
    pub pulls: Batcher<Pull, ()>,
    pub settles: Batcher<Settle, ()>,
    /// Moves the entries the writes append to account documents into `entries`; it
    /// takes a writer slot like any batch.
    pub entry_copier: Arc<EntryCopier>,
}

impl std::fmt::Debug for Batches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Batches")
    }
}

impl Batches {
    /// Starts the queues; at most `group_commit_writes` of their writes are in flight
    /// at once.
    pub fn start(
        db: &Database,
        group_commit_writes: usize,
        deployment: DeploymentName,
    ) -> Arc<Batches> {
        let transactions: Collection<TransferDoc> = db.collection("transactions");
        let accounts: Collection<Document> = db.collection("accounts");
        let slots = Some(Arc::new(Semaphore::new(group_commit_writes.max(1))));
        let entry_copier = EntryCopier::start(db, slots.clone(), deployment.clone());
        Arc::new(Batches {
            placements: Batcher::start(deployment.clone(), None, {
                let accounts = accounts.clone();
                move |ops| read_placements(accounts.clone(), ops)
            }),
            inserts: Batcher::start(deployment.clone(), slots.clone(), {
                let transactions = transactions.clone();
                move |docs| insert_transfers(transactions.clone(), docs)
            }),
            transitions: Batcher::start(deployment.clone(), slots.clone(), {
                let transactions = transactions.clone();
                move |ops| transition_all(transactions.clone(), ops)
            }),
            account_changes: Batcher::start(deployment.clone(), slots.clone(), {
                let (accounts, copier) = (accounts.clone(), entry_copier.clone());
                move |ops| change_accounts_leaving_moved(accounts.clone(), copier.clone(), ops)
            }),
            pulls: Batcher::start(deployment.clone(), slots.clone(), {
                let accounts = accounts.clone();
                move |ops| pull_markers(accounts.clone(), ops)
            }),
            settles: Batcher::start(deployment, slots, {
                let copier = entry_copier.clone();
                move |ops| settle_all(accounts.clone(), copier.clone(), ops)
            }),
            entry_copier,
        })
    }
}

/// One `find` for the currencies and tenants of every account the batch names; `None`
/// for an account that does not exist.
pub async fn read_placements(
    accounts: Collection<Document>,
    ops: Vec<[String; 2]>,
) -> StoreResult<Vec<StoreResult<[Option<Essentials>; 2]>>> {
    let mut ids: Vec<&str> = ops.iter().flatten().map(String::as_str).collect();
    ids.sort_unstable();
    ids.dedup();
    let found = accounts
        .find(doc! { "_id": { "$in": &ids } })
        .max_time(super::READ_TIME_LIMIT)
        .batch_size(whole(ids.len()))
        .projection(doc! { account::CURRENCY: 1, account::TENANT: 1 });
    let found: HashMap<String, Essentials> = timed("find", found)
        .await?
        .try_filter_map(|a| async move {
            let tenant = a.get_str(account::TENANT).ok().map(str::to_owned);
            Ok(match (a.get_str("_id"), a.get_str(account::CURRENCY)) {
                (Ok(id), Ok(currency)) => Some((id.to_owned(), (currency.to_owned(), tenant))),
                _ => None,
            })
        })
        .try_collect()
        .await?;
    Ok(ops
        .iter()
        .map(|pair| Ok(pair.each_ref().map(|id| found.get(id).cloned())))
        .collect())
}

/// A cursor's batch size that holds every document of a read by ids (one per id at
/// most) in its first reply, so that no `getMore` follows; one more than their number,
/// so that the server knows the cursor is exhausted.
fn whole(ids: usize) -> u32 {
    u32::try_from(ids + 1).unwrap_or(u32::MAX)
}

/// One `insertMany`, unordered: a document refused (a taken idempotency key) fails alone.
pub async fn insert_transfers(
    transactions: Collection<TransferDoc>,
    docs: Vec<TransferDoc>,
) -> StoreResult<Vec<StoreResult<()>>> {
    let count = docs.len();
    match timed("insert", transactions.insert_many(&docs).ordered(false)).await {
        Ok(_) => Ok(vec![Ok(()); count]),
        Err(e) => {
            let ErrorKind::InsertMany(failure) = e.kind.as_ref() else {
                return Err(e.into());
            };
            if failure.write_concern_error.is_some() {
                return Err(e.into());
            }
            let mut results = vec![Ok(()); count];
            for error in failure.write_errors.iter().flatten() {
                let refused = if error.code == 11000 {
                    StoreError::DuplicateKey(error.message.clone().into())
                } else {
                    StoreError::Refused(error.message.clone().into())
                };
                if let Some(slot) = results.get_mut(error.index) {
                    *slot = Err(refused);
                }
            }
            Ok(results)
        }
    }
}

/// One `updateMany` per (owner, from, to), all issued at once rather than one after
/// another: the groups touch different documents and none needs another's result (one
/// statement for the whole batch, with a `$switch` guard per group in `$expr`, ran at
/// about half the throughput: `docs/benchmark/decisions.md`). A transition won when the
/// document is now in `to` under `owner`:
/// only this owner's one driver of the transfer moves it so.
pub async fn transition_all(
    transactions: Collection<TransferDoc>,
    ops: Vec<Transition>,
) -> StoreResult<Vec<StoreResult<Option<DateTime>>>> {
    let mut groups: HashMap<(&str, TransferState, TransferState), Vec<usize>> = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        groups
            .entry((op.owner.as_str(), op.from, op.to))
            .or_default()
            .push(i);
    }
    // Each group answers its own callers: one group's failure is not another's.
    let written =
        futures::future::join_all(groups.into_iter().map(|((owner, from, to), members)| {
            let ids: Vec<ObjectId> = members.iter().map(|&i| ops[i].id).collect();
            // The latest of the callers' bounds: taken before this write is sent, so still
            // a lower bound of the server's clock when it lands.
            let at = members
                .iter()
                .map(|&i| ops[i].at)
                .max()
                .unwrap_or(DateTime::MIN);
            let transactions = &transactions;
            async move {
                let (won, _) =
                    super::retried(|| transition_group(transactions, owner, from, to, &ids, at))
                        .await;
                (members, won, at)
            }
        }))
        .await;
    let mut results: Vec<StoreResult<Option<DateTime>>> = vec![Ok(None); ops.len()];
    for (members, won, at) in written {
        match won {
            Ok(won) => {
                for (i, won) in members.into_iter().zip(won) {
                    results[i] = Ok(won.then_some(at));
                }
            }
            Err(e) => {
                for i in members {
                    results[i] = Err(e.clone());
                }
            }
        }
    }
    Ok(results)
}

/// Moves the transfers `ids` from `from` to `to` under `owner` in one `updateMany`;
/// answers, per id, whether it is now in `to` under `owner` (read back only when the
/// update did not change them all). Safe to repeat: the read-back tells a change made by
/// an earlier attempt from one that never happened.
async fn transition_group(
    transactions: &Collection<TransferDoc>,
    owner: &str,
    from: TransferState,
    to: TransferState,
    ids: &[ObjectId],
    at: DateTime,
) -> StoreResult<Vec<bool>> {
    let updated = transactions.update_many(
        doc! {
            "_id": { "$in": ids },
            transfer::STATE: from.as_str(),
            transfer::APPLICATION: owned_by(owner, from),
        },
        moved(
            to,
            doc! { transfer::STATE: to.as_str(), transfer::APPLICATION: owner },
            at,
        ),
    );
    let updated = timed("update", updated).await?;
    if updated.modified_count == ids.len() as u64 {
        return Ok(vec![true; ids.len()]);
    }
    let moved = transactions
        .find(doc! { "_id": { "$in": ids } })
        .max_time(super::READ_TIME_LIMIT)
        .batch_size(whole(ids.len()));
    let moved: Vec<TransferDoc> = timed("find", moved).await?.try_collect().await?;
    Ok(ids
        .iter()
        .map(|id| {
            moved
                .iter()
                .any(|t| t.id == *id && t.state == to && t.application.as_deref() == Some(owner))
        })
        .collect())
}

/// One `updateMany` whose pipeline walks, for each account, the batch's changes to it in
/// order and applies each one whose guards hold on the balance as the earlier ones left
/// it; then a read of the accounts: a change took effect iff its marker is there. Every
/// entry stays in the documents ([`change_accounts_leaving_moved`] is the service's).
#[cfg(feature = "failpoints")]
pub async fn change_accounts(
    accounts: Collection<Document>,
    ops: Vec<AccountChange>,
) -> StoreResult<Vec<StoreResult<bool>>> {
    change_accounts_leaving_moved(accounts, Arc::new(EntryCopier::new()), ops).await
}

/// [`change_accounts`] after one round of an entry copier that copies `moved_first`'s
/// entries to `entries`: the batch leaves those out of the documents.
#[cfg(feature = "failpoints")]
pub async fn change_accounts_after_a_move(
    db: &Database,
    moved_first: &[String],
    ops: Vec<AccountChange>,
) -> StoreResult<Vec<StoreResult<bool>>> {
    let copier = Arc::new(EntryCopier::new());
    let accounts: Collection<Document> = db.collection("accounts");
    copier
        .move_entries(&accounts, &db.collection("entries"), moved_first)
        .await?;
    change_accounts_leaving_moved(accounts, copier, ops).await
}

/// [`change_accounts`], where the entries `copier` has copied to `entries` leave the
/// documents in the same write.
async fn change_accounts_leaving_moved(
    accounts: Collection<Document>,
    copier: Arc<EntryCopier>,
    ops: Vec<AccountChange>,
) -> StoreResult<Vec<StoreResult<bool>>> {
    if let [op] = ops.as_slice() {
        let moved = copier.moved(&op.account);
        return Ok(vec![Ok(change_one(&accounts, op, moved).await?)]);
    }
    let per_account = changes_by_account(&ops, &copier);
    let ids: Vec<&str> = per_account.iter().map(|(a, _)| a.as_str()).collect();
    let written = accounts.update_many(
        doc! { "_id": { "$in": &ids } },
        batched_changes(&per_account),
    );
    let written = timed("update", written).await?;
    // A document changes only where one of its changes landed (`batch_results`): with
    // one change per account, a count of every one says each landed, and nothing needs
    // reading back. (A guard in the filter would need `$expr`, which SecantusDB answers
    // by scanning the whole collection.)
    let one_each = per_account.len() == ops.len();
    if one_each && written.modified_count == ops.len() as u64 {
        return Ok(vec![Ok(true); ops.len()]);
    }
    let after = accounts
        .find(doc! { "_id": { "$in": &ids } })
        .max_time(super::READ_TIME_LIMIT)
        .batch_size(whole(ids.len()))
        .projection(doc! { account::PENDING: 1 });
    let after: Vec<Document> = timed("find", after).await?.try_collect().await?;
    let marked = |op: &AccountChange| {
        after.iter().any(|a| {
            a.get_str("_id").ok() == Some(op.account.as_str())
                && a.get_array(account::PENDING)
                    .is_ok_and(|p| p.contains(&Bson::ObjectId(op.tx)))
        })
    };
    Ok(ops.iter().map(|op| Ok(marked(op))).collect())
}

/// The batch's changes, account by account, each account's in the batch's order, with
/// what `copier` knows is in `entries` of it: the table the pipeline of
/// [`batched_changes`] walks, a row `{mv, ma, ops}` per account.
fn changes_by_account(ops: &[AccountChange], copier: &EntryCopier) -> Vec<(String, Document)> {
    let mut per_account: Vec<(&str, Vec<&AccountChange>)> = Vec::new();
    let mut deadlines: HashMap<(&str, ObjectId), DateTime> = HashMap::new();
    for op in ops {
        // The same step twice in one batch (its driver and a recoverer): it is written
        // once, under the later of their deadlines. Written twice, the second would land
        // only if the first did not, for want of time; the read-back answers both alike.
        match deadlines.entry((op.account.as_str(), op.tx)) {
            Entry::Occupied(mut first) => {
                let later = (*first.get()).max(op.deadline);
                first.insert(later);
                continue;
            }
            Entry::Vacant(new) => {
                new.insert(op.deadline);
            }
        }
        match per_account.iter_mut().find(|(a, _)| *a == op.account) {
            Some((_, changes)) => changes.push(op),
            None => per_account.push((op.account.as_str(), vec![op])),
        }
    }
    per_account
        .into_iter()
        .map(|(account, changes)| {
            let changes: Vec<Bson> = changes
                .into_iter()
                .map(|op| {
                    let dl = deadlines[&(account, op.tx)];
                    let mut change = doc! {
                        "tx": op.tx, "d": op.delta, "pd": op.debits, "pc": op.credits,
                        "dl": dl,
                    };
                    match op.kind {
                        Some(kind) => change.insert("k", kind.as_str()),
                        None => change.insert("in", op.incoming),
                    };
                    Bson::Document(change)
                })
                .collect();
            let moved = copier.moved(account).unwrap_or(Moved::NOTHING);
            let row = doc! { "mv": moved.seq, "ma": moved.at, "ops": changes };
            (account.to_owned(), row)
        })
        .collect()
}

/// The update pipeline that applies `per_account`'s changes to each account in order,
/// each only where its guards hold on the amounts the earlier ones left.
///
/// SecantusDB copies a variable whole on every reference to it (`$$value.b` copies all
/// of `$$value`), so the `$reduce` that walks the changes keeps its accumulator small
/// and flat, an array (see [`walk_changes`]); the entries are made from what it left
/// afterwards. An accumulator that carried the entries themselves, and the account's
/// markers, made every step copy them all, which grew with the square of an account's
/// changes in the batch.
fn batched_changes(per_account: &[(String, Document)]) -> Vec<Document> {
    let mut rows: Vec<&(String, Document)> = per_account.iter().collect();
    rows.sort_by(|a, b| a.0.cmp(&b.0));
    let nothing = doc! { "mv": Moved::NOTHING.seq, "ma": Moved::NOTHING.at, "ops": [] };
    vec![
        doc! { "$set": { "_at": entry_time(), "_t": row_of_account(&rows, &nothing) } },
        doc! { "$set": { "_batch": walk_changes() } },
        doc! { "$set": { "_new": new_entries() } },
        batch_results(),
        doc! { "$unset": ["_t", "_batch", "_new", "_at"] },
    ]
}

/// The expression that picks the document's own row out of `rows` (sorted by account),
/// or `otherwise`: a binary search, nested `$cond`s comparing `_id` with the middle row's
/// account, so each document takes about log2(rows) comparisons rather than the half of
/// them a `$switch` takes (strings compare by their bytes, in MongoDB as in Rust).
fn row_of_account(rows: &[&(String, Document)], otherwise: &Document) -> Bson {
    match rows {
        [] => Bson::Document(otherwise.clone()),
        [(account, row)] => doc! { "$cond": [
            { "$eq": ["$_id", account] }, { "$literal": row }, otherwise.clone(),
        ] }
        .into(),
        _ => {
            let middle = rows.len() / 2;
            doc! { "$cond": [
                { "$lt": ["$_id", &rows[middle].0] },
                row_of_account(&rows[..middle], otherwise),
                row_of_account(&rows[middle..], otherwise),
            ] }
            .into()
        }
    }
}

/// Positions in the accumulator of [`walk_changes`]: the amounts as the batch's earlier
/// changes left them, the last entry's number, and per change what it left (`[seq,
/// balance, pendingDebits, pendingCredits]`, `seq` null for a change of the room alone,
/// which makes no entry), or `false` where it did not land; then the room (`incoming`).
const B: i64 = 0;
const PD: i64 = 1;
const PC: i64 = 2;
const S: i64 = 3;
const LEFT: i64 = 4;
const IN: i64 = 5;

/// `$$value`'s element at `i`.
fn acc(i: i64) -> Bson {
    doc! { "$arrayElemAt": ["$$value", i] }.into()
}

/// The `$reduce` over the account's changes in the batch (`_t.ops`): each one whose
/// guards hold on the amounts the earlier ones left lands. Each step reads the
/// accumulator's amounts once, into variables (`$let`), and the guard reads the markers
/// from the document: the batch holds each transfer's step on an account once
/// ([`changes_by_account`]), so no marker of the batch's own can be in the way.
fn walk_changes() -> Document {
    let before = Amounts {
        balance: "$$b".into(),
        debits: "$$pd".into(),
        credits: "$$pc".into(),
        incoming: "$$in".into(),
    };
    // A change of the three amounts (`d`, `pd`, `pc`) carries the kind of its entry
    // (`k`); one of the room alone (`in`) carries no kind, and only that.
    let change = Amounts {
        balance: "$$this.d".into(),
        debits: "$$this.pd".into(),
        credits: "$$this.pc".into(),
        incoming: doc! { "$ifNull": ["$$this.in", 0_i64] }.into(),
    };
    let after = before.after(&change);
    let allowed = forward_step_allowed(
        &before,
        path(account::PENDING),
        "$$this.tx",
        &change,
        "$$this.dl",
    );
    let stored = Amounts::stored();
    let entry = doc! { "$ne": [{ "$ifNull": ["$$this.k", false] }, false] };
    let seq = doc! { "$cond": [entry.clone(), { "$add": ["$$s", 1_i64] }, "$$s"] };
    let numbered = doc! { "$cond": [entry, { "$add": ["$$s", 1_i64] }, Bson::Null] };
    let step = doc! { "$cond": [
        allowed,
        [
            after.balance.clone(),
            after.debits.clone(),
            after.credits.clone(),
            seq,
            { "$concatArrays": [acc(LEFT), [[numbered, after.balance, after.debits, after.credits]]] },
            after.incoming,
        ],
        [
            "$$b", "$$pd", "$$pc", "$$s",
            { "$concatArrays": [acc(LEFT), [false]] },
            "$$in",
        ],
    ] };
    doc! { "$reduce": {
        "input": "$_t.ops",
        "initialValue": [
            stored.balance, stored.debits, stored.credits, { "$ifNull": [path(account::SEQ), 0_i64] }, [],
            stored.incoming,
        ],
        "in": { "$let": {
            "vars": { "b": acc(B), "pd": acc(PD), "pc": acc(PC), "s": acc(S), "in": acc(IN) },
            "in": step,
        } },
    } }
}

/// `_batch`'s element at `i`.
fn walked(i: i64) -> Bson {
    doc! { "$arrayElemAt": ["$_batch", i] }.into()
}

/// The entries of the changes that landed: each change (`_t.ops`) beside what it left
/// (see [`walk_changes`]); all of the batch's entries of an account share one time
/// (`_at`). A change of the room alone that landed leaves `{tx, room: true}`: its
/// marker, and no entry.
fn new_entries() -> Document {
    let left = |i: i64| doc! { "$arrayElemAt": ["$$left", i] };
    let change = Amounts {
        balance: "$$change.d".into(),
        debits: "$$change.pd".into(),
        credits: "$$change.pc".into(),
        incoming: 0_i64.into(),
    };
    let after = Amounts {
        balance: left(1).into(),
        debits: left(2).into(),
        credits: left(3).into(),
        incoming: 0_i64.into(),
    };
    let entry = entry_expr(
        left(0),
        "$$change.k",
        "$$change.tx",
        &change,
        &after,
        "$_at",
    );
    doc! { "$filter": {
        "input": { "$map": {
            "input": { "$zip": { "inputs": ["$_t.ops", walked(LEFT)] } },
            "as": "pair",
            "in": { "$let": {
                "vars": {
                    "change": { "$arrayElemAt": ["$$pair", 0] },
                    "left": { "$arrayElemAt": ["$$pair", 1] },
                },
                "in": { "$cond": [
                    { "$eq": ["$$left", false] },
                    false,
                    { "$cond": [
                        { "$eq": [left(0), Bson::Null] },
                        { "tx": "$$change.tx", "room": true },
                        entry,
                    ] },
                ] },
            } },
        } },
        "cond": { "$ne": ["$$this", false] },
    } }
}

/// The stage that stores what the `$reduce` left in `_batch` and the entries made of it
/// in `_new`: the amounts, the room (left out where it is zero), the markers, the last
/// entry's number, the entries appended (after those known to be in `entries` are left
/// out) and, if any was, their time.
fn batch_results() -> Document {
    let entries =
        doc! { "$filter": { "input": "$_new", "cond": { "$ne": ["$$this.room", true] } } };
    let results = doc! {
        account::BALANCE: walked(B),
        account::PENDING_DEBITS: walked(PD),
        account::PENDING_CREDITS: walked(PC),
        account::INCOMING: unless_zero(&walked(IN)),
        account::PENDING: { "$concatArrays": [
            path(account::PENDING), { "$map": { "input": "$_new", "in": "$$this.tx" } },
        ] },
        account::SEQ: walked(S),
        account::RECENT: { "$concatArrays": [kept("$_t.mv", "$_t.ma"), entries] },
        account::LAST_ENTRY_AT: { "$cond": [
            { "$gt": [walked(S), { "$ifNull": [path(account::SEQ), 0_i64] }] }, "$_at", path(account::LAST_ENTRY_AT),
        ] },
        account::UPDATED_AT: "$$NOW",
    };
    // A document none of whose changes landed is left exactly as it was (not even its
    // entries trimmed, nor a missing amount written as zero), so that the write's
    // modified count is the number of accounts a change landed on.
    let landed = doc! { "$gt": [{ "$size": "$_new" }, 0] };
    let mut set = Document::new();
    for (field, result) in results {
        let unchanged = format!("${field}");
        set.insert(field, doc! { "$cond": [landed.clone(), result, unchanged] });
    }
    doc! { "$set": set }
}

/// A batch of one: the tutorial's guarded `updateOne`, whose result says whether it took
/// effect, with no read-back.
async fn change_one(
    accounts: &Collection<Document>,
    op: &AccountChange,
    moved: Option<Moved>,
) -> StoreResult<bool> {
    let allowed = op.allowed();
    let update = match op.kind {
        Some(kind) => changed_with_entry(kind, op.tx, &op.amounts(), Marker::Push, moved),
        None => room_changed(op.tx, op.incoming, Marker::Push),
    };
    let result = accounts.update_one(doc! { "_id": &op.account, "$expr": allowed }, update);
    let result = timed("update", result).await?;
    Ok(result.modified_count == 1)
}

/// One `updateMany` rid each account of the batch of the markers its own pulls name,
/// and no other: an update pipeline that finds the account's row (its markers to pull)
/// as the forward steps' batch does. Pulling a marker that is not there is a no-op, so
/// this is each pull's own guard.
pub async fn pull_markers(
    accounts: Collection<Document>,
    ops: Vec<Pull>,
) -> StoreResult<Vec<StoreResult<()>>> {
    let mut per_account: Vec<(&str, Vec<ObjectId>)> = Vec::new();
    for op in &ops {
        match per_account.iter_mut().find(|(a, _)| *a == op.account) {
            Some((_, txs)) => txs.push(op.tx),
            None => per_account.push((op.account.as_str(), vec![op.tx])),
        }
    }
    let rows: Vec<(String, Document)> = per_account
        .into_iter()
        .map(|(account, txs)| (account.to_owned(), doc! { "txs": txs }))
        .collect();
    let mut sorted: Vec<&(String, Document)> = rows.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let ids: Vec<&str> = sorted.iter().map(|(a, _)| a.as_str()).collect();
    let txs: Vec<ObjectId> = ops.iter().map(|op| op.tx).collect();
    let own = row_of_account(&sorted, &doc! { "txs": [] });
    let pipeline = vec![doc! { "$set": {
        account::PENDING: { "$let": {
            "vars": { "own": own },
            "in": { "$filter": {
                "input": path(account::PENDING),
                "cond": { "$not": [{ "$in": ["$$this", "$$own.txs"] }] },
            } },
        } },
        account::UPDATED_AT: "$$NOW",
    } }];
    // Repeatable: a pull that lands twice, or late, finds nothing more to pull (nothing
    // adds a marker back once its transfer is applied, see the protocol's rules).
    let (pulled, _) = super::retried(|| async {
        let update = accounts.update_many(
            doc! { "_id": { "$in": &ids }, account::PENDING: { "$in": &txs } },
            pipeline.clone(),
        );
        timed("update", update).await.map_err(StoreError::from)
    })
    .await;
    pulled?;
    Ok(vec![Ok(()); ops.len()])
}

/// [`settle_all`] for tests: every entry stays in the documents.
#[cfg(feature = "failpoints")]
pub async fn settle_parties(
    accounts: Collection<Document>,
    ops: Vec<Settle>,
) -> StoreResult<Vec<StoreResult<()>>> {
    settle_all(accounts, Arc::new(EntryCopier::new()), ops).await
}

/// One `updateMany` settling every receiving party of the batch ([`Settle`]): per
/// account, a walk over its settles in the batch's order, each applied only where its
/// marker is, numbering its credit entry after the ones before; then every settled
/// marker pulled. Repeatable: a settle that landed finds no marker the second time.
async fn settle_all(
    accounts: Collection<Document>,
    copier: Arc<EntryCopier>,
    ops: Vec<Settle>,
) -> StoreResult<Vec<StoreResult<()>>> {
    let mut per_account: Vec<(&str, Vec<Bson>)> = Vec::new();
    for op in &ops {
        let change = match op.pay_in {
            Some(net) => doc! { "tx": op.tx, "d": net, "p": true },
            None => doc! { "tx": op.tx, "d": 0_i64, "p": false },
        };
        let change = Bson::Document(change);
        match per_account.iter_mut().find(|(a, _)| *a == op.account) {
            Some((_, changes)) if !changes.contains(&change) => changes.push(change),
            Some(_) => {}
            None => per_account.push((op.account.as_str(), vec![change])),
        }
    }
    let rows: Vec<(String, Document)> = per_account
        .into_iter()
        .map(|(account, changes)| {
            let moved = copier.moved(account).unwrap_or(Moved::NOTHING);
            let row = doc! { "mv": moved.seq, "ma": moved.at, "ops": changes };
            (account.to_owned(), row)
        })
        .collect();
    let ids: Vec<&str> = rows.iter().map(|(a, _)| a.as_str()).collect();
    let txs: Vec<ObjectId> = ops.iter().map(|op| op.tx).collect();
    let pipeline = settled(&rows);
    let (settled, _) = super::retried(|| async {
        let update = accounts.update_many(
            doc! { "_id": { "$in": &ids }, account::PENDING: { "$in": &txs } },
            pipeline.clone(),
        );
        timed("update", update).await.map_err(StoreError::from)
    })
    .await;
    settled?;
    Ok(vec![Ok(()); ops.len()])
}

/// The update pipeline of [`settle_all`]: each account's settles (`_t.ops`, `{tx, d}`)
/// walked in order, each landing only where its marker is; the entries made from what
/// the walk left (`[seq, balance]` per settle, or `false`).
fn settled(rows: &[(String, Document)]) -> Vec<Document> {
    let mut sorted: Vec<&(String, Document)> = rows.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let nothing = doc! { "mv": Moved::NOTHING.seq, "ma": Moved::NOTHING.at, "ops": [] };
    let settled_txs = doc! { "$map": { "input": "$_t.ops", "in": "$$this.tx" } };
    vec![
        doc! { "$set": { "_at": entry_time(), "_t": row_of_account(&sorted, &nothing) } },
        doc! { "$set": { "_batch": settle_walk() } },
        doc! { "$set": { "_new": settle_entries() } },
        doc! { "$set": {
            account::BALANCE: walked(0),
            account::INCOMING: unless_zero(&walked(2)),
            account::SEQ: walked(1),
            // The settled markers, worked out once for the filter (`$let`), not once per
            // marker the account holds: as a condition of the filter, the `$map` cost a
            // hot account's settle about a third of its write.
            account::PENDING: { "$let": {
                "vars": { "settled": settled_txs },
                "in": { "$filter": {
                    "input": path(account::PENDING),
                    "cond": { "$not": [{ "$in": ["$$this", "$$settled"] }] },
                } },
            } },
            account::RECENT: { "$concatArrays": [kept("$_t.mv", "$_t.ma"), "$_new"] },
            account::LAST_ENTRY_AT: { "$cond": [
                { "$gt": [walked(1), { "$ifNull": [path(account::SEQ), 0_i64] }] },
                "$_at",
                path(account::LAST_ENTRY_AT),
            ] },
            account::UPDATED_AT: "$$NOW",
        } },
        doc! { "$unset": ["_t", "_batch", "_new", "_at"] },
    ]
}

/// The `$reduce` of [`settled`]: `[balance, seq, incoming, left]`, each settle landing
/// only where its marker is.
fn settle_walk() -> Document {
    let stored = Amounts::stored();
    // A settle pays in (and enters) only where it landed and has something to pay in;
    // one that only pulls the marker leaves the amounts and makes no entry.
    let landed = doc! { "$and": [
        { "$in": ["$$this.tx", path(account::PENDING)] },
        "$$this.p",
    ] };
    // Each step reads the accumulator once, into variables (`$let`): SecantusDB copies
    // `$$value` whole on every reference to it (see `batched_changes`).
    let seq = doc! { "$add": ["$$s", 1_i64] };
    let balance = doc! { "$add": ["$$b", "$$this.d"] };
    let step = doc! { "$cond": [
        landed,
        [
            balance.clone(),
            seq.clone(),
            { "$subtract": ["$$in", "$$this.d"] },
            { "$concatArrays": ["$$left", [[seq, balance]]] },
        ],
        ["$$b", "$$s", "$$in", { "$concatArrays": ["$$left", [false]] }],
    ] };
    doc! { "$reduce": {
        "input": "$_t.ops",
        "initialValue": [stored.balance, { "$ifNull": [path(account::SEQ), 0_i64] }, stored.incoming, []],
        "in": { "$let": {
            "vars": { "b": acc(0), "s": acc(1), "in": acc(2), "left": acc(3) },
            "in": step,
        } },
    } }
}

/// The credit entries of the settles that landed (see [`settle_walk`]).
fn settle_entries() -> Document {
    let left = |i: i64| doc! { "$arrayElemAt": ["$$left", i] };
    let change = Amounts::change(0, 0, 0);
    let change = Amounts {
        balance: "$$change.d".into(),
        ..change
    };
    let after = Amounts {
        balance: left(1).into(),
        ..Amounts::stored()
    };
    let entry = entry_expr(
        left(0),
        EntryKind::Credit.as_str(),
        "$$change.tx",
        &change,
        &after,
        "$_at",
    );
    doc! { "$filter": {
        "input": { "$map": {
            "input": { "$zip": { "inputs": ["$_t.ops", walked(3)] } },
            "as": "pair",
            "in": { "$let": {
                "vars": {
                    "change": { "$arrayElemAt": ["$$pair", 0] },
                    "left": { "$arrayElemAt": ["$$pair", 1] },
                },
                "in": { "$cond": [{ "$eq": ["$$left", false] }, false, entry] },
            } },
        } },
        "cond": { "$ne": ["$$this", false] },
    } }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;

    /// While the writer waits for a slot, everything queued meanwhile joins one batch, up
    /// to [`MAX_BATCH`]; each caller gets its own result.
    #[tokio::test]
    async fn what_queues_while_the_writer_waits_goes_out_in_batches_of_at_most_max_batch() {
        let slots = Arc::new(Semaphore::new(1));
        let held = slots.clone().acquire_owned().await.unwrap();
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let seen = sizes.clone();
        let batcher = Batcher::start(
            DeploymentName::default(),
            Some(slots),
            move |ops: Vec<usize>| {
                seen.lock().unwrap().push(ops.len());
                async move { Ok(ops.into_iter().map(|op| Ok(op * 2)).collect()) }
            },
        );
        let total = MAX_BATCH + 10;
        let batcher = Arc::new(batcher);
        let calls: Vec<_> = (0..total)
            .map(|op| {
                let batcher = batcher.clone();
                tokio::spawn(async move { batcher.submit(op).await })
            })
            .collect();
        // Every call queues while the slot is held.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(sizes.lock().unwrap().is_empty(), "written without a slot");
        drop(held);
        for (op, call) in calls.into_iter().enumerate() {
            assert_eq!(call.await.unwrap().unwrap(), op * 2);
        }
        // The writer took the first call, waited for the slot, then gathered the queue.
        assert_eq!(*sizes.lock().unwrap(), vec![MAX_BATCH, total - MAX_BATCH]);
    }

    /// Operations submitted together go out in one batch, never split across two: a
    /// unit that would take the batch past [`MAX_BATCH`] opens the next one, whole.
    #[tokio::test]
    async fn a_unit_of_operations_goes_out_whole_in_one_batch() {
        let slots = Arc::new(Semaphore::new(1));
        let held = slots.clone().acquire_owned().await.unwrap();
        let batches = Arc::new(Mutex::new(Vec::new()));
        let seen = batches.clone();
        let batcher = Arc::new(Batcher::start(
            DeploymentName::default(),
            Some(slots),
            move |ops: Vec<usize>| {
                seen.lock().unwrap().push(ops.clone());
                async move { Ok(ops.into_iter().map(|op| Ok(op + 1)).collect()) }
            },
        ));
        // One operation, then units of 4 until the queue holds more than a batch: the
        // unit that crosses MAX_BATCH (1 + 4 × 63 = 253, then 257) must wait whole.
        let first = tokio::spawn({
            let batcher = batcher.clone();
            async move { batcher.submit(0).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let units: Vec<Vec<usize>> = (0..MAX_BATCH / 4 + 2)
            .map(|u| (1 + 4 * u..5 + 4 * u).collect())
            .collect();
        let calls: Vec<_> = units
            .iter()
            .map(|unit| {
                let (batcher, unit) = (batcher.clone(), unit.clone());
                tokio::spawn(async move { batcher.submit_all(unit).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(held);
        assert_eq!(first.await.unwrap().unwrap(), 1);
        for (unit, call) in units.iter().zip(calls) {
            let answers: Vec<usize> = call
                .await
                .unwrap()
                .unwrap()
                .into_iter()
                .map(|a| a.unwrap())
                .collect();
            let expected: Vec<usize> = unit.iter().map(|op| op + 1).collect();
            assert_eq!(
                answers, expected,
                "each operation of a unit gets its own answer"
            );
        }
        let batches = batches.lock().unwrap();
        assert!(batches.len() >= 2, "{} batches", batches.len());
        for batch in batches.iter() {
            assert!(batch.len() <= MAX_BATCH, "a batch of {}", batch.len());
            for unit in &units {
                let inside = unit.iter().filter(|op| batch.contains(op)).count();
                assert!(
                    inside == 0 || inside == unit.len(),
                    "unit {unit:?} split: {batch:?}"
                );
            }
        }
        let written: usize = batches.iter().map(Vec::len).sum();
        assert_eq!(written, 1 + 4 * units.len(), "every operation written once");
    }
}
