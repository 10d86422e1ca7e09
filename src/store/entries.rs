//! Ledger entries (`docs/ledger.md`): how each change to an account's amounts is numbered
//! and kept, and how the ledger is read.
//!
//! Where an entry lives:
//! - **First in its account's document**, in `recentEntries`, appended by the very
//!   write that changes the amounts: the same pipeline numbers it (`seq + 1`) and
//!   computes the values it leaves ([`changed_with_entry`], and the group-committed
//!   form in `store::batch`). No retry, crash, takeover or concurrent step can then
//!   make a gap, a repeat or a running balance that disagrees with the balance: there
//!   is no second write to lose.
//! - **Then in `entries`** (`{account, seq}` unique), copied there by the
//!   [`EntryCopier`] of the instance that made the change, a few milliseconds later, in
//!   one `insertMany` for many accounts. Once the copies are acknowledged the copier
//!   remembers them ([`Moved`]), and the next write that changes the account, which
//!   rewrites its document anyway, leaves them out ([`kept`]). What the next entry and a
//!   read of "now" need of the last one stays in the document anyway: its number
//!   (`seq`), its amounts (the account's own) and its time (`lastEntryAt`).
//!
//! Every entry is thus in the account's document, in `entries`, or in both, at every
//! moment: an entry leaves the document only after its copy is durable. A reader reads
//! the document first, then `entries` below the document's oldest entry; anything
//! left out before the first read was copied before it too. Copying twice (two
//! instances, or a lost reply) is refused by the unique index and ignored: an entry
//! never changes once written, so both copies are the same.
//!
//! An instance killed before it moved its entries leaves them in the documents, where
//! they are read as well; the next change to such an account, by any instance, has them
//! moved with its own. An account not changed again keeps its last entries in its
//! document, copied or not.
//!
//! The reads are the [`Entries`] view (`store.entries()`), which holds `entries` and reads
//! `accounts`; the copier is the [`EntryCopier`], one per store, in its batches.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures::TryStreamExt;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::error::ErrorKind;
use mongodb::options::FindOptions;
use mongodb::{Collection, Database};
use serde::Deserialize;
use tokio::sync::Semaphore;

use super::documents::AccountDoc;
use super::documents::{EntryDoc, transfer_id};
use super::fields::{account, entry, path};
use super::guards::Amounts;
use super::{StoreError, StoreResult};
use crate::domain::{
    self, AccountId, BalanceAt, DeploymentName, Entry, EntryKind, Finality, Timestamp,
};

/// How long the copier waits, after the first change it was told of, before it moves
/// what has gathered: long enough to move many accounts' entries in one command, short
/// enough that the documents stay small.
const MOVE_INTERVAL: Duration = Duration::from_millis(50);

/// Accounts moved in one round, at most; the rest wait for the next round.
const MAX_ACCOUNTS_PER_MOVE: usize = 256;

/// Accounts the copier remembers to move, at most. Beyond it a change is not remembered:
/// its entries stay in the document (read from there), until the next change to the
/// account moves them.
const MAX_REMEMBERED: usize = 100_000;

impl EntryDoc {
    fn into_domain(self, account: &AccountId) -> StoreResult<Entry> {
        let seq = u64::try_from(self.seq).map_err(|_| {
            StoreError::Malformed(
                format!("account {account}: stored entry seq {}", self.seq).into(),
            )
        })?;
        Ok(Entry {
            account: account.clone(),
            seq,
            kind: self.kind,
            transfer_id: self.transfer_id.map(transfer_id),
            change: domain::Amounts {
                balance: self.balance_change,
                pending_debits: self.pending_debits_change,
                pending_credits: self.pending_credits_change,
            },
            after: self.after(),
            at: self.at.to_chrono(),
            carried_forward: self.carried_forward,
        })
    }

    fn after(&self) -> domain::Amounts {
        domain::Amounts {
            balance: self.balance,
            pending_debits: self.pending_debits,
            pending_credits: self.pending_credits,
        }
    }
}

/// The stored `opened` entry of an account opened with `balance`, at `at`.
pub(super) fn opening_entry(balance: i64, at: DateTime) -> EntryDoc {
    EntryDoc {
        account: None,
        seq: 1,
        kind: EntryKind::Opened,
        transfer_id: None,
        balance_change: balance,
        pending_debits_change: 0,
        pending_credits_change: 0,
        balance,
        pending_debits: 0,
        pending_credits: 0,
        at,
        carried_forward: false,
    }
}

/// The time of a new entry, as an expression on the account document: the database's
/// clock, never before the account's last entry (`lastEntryAt`): a clock stepped back, a
/// failover to a member whose clock is behind, or a write that read `$$NOW` before
/// another landed first cannot make entries go back in time.
pub(super) fn entry_time() -> Document {
    doc! { "$max": ["$$NOW", path(account::LAST_ENTRY_AT)] }
}

/// The stored entry, as an expression: numbered `seq`, made by `kind` of `tx`, adding
/// `change` and leaving `after`, at `at` (each an expression or a literal).
pub(super) fn entry_expr(
    seq: impl Into<Bson>,
    kind: impl Into<Bson>,
    tx: impl Into<Bson>,
    change: &Amounts,
    after: &Amounts,
    at: impl Into<Bson>,
) -> Document {
    doc! {
        entry::SEQ: seq.into(),
        entry::KIND: kind.into(),
        entry::TRANSFER: tx.into(),
        entry::BALANCE_CHANGE: change.balance.clone(),
        entry::PENDING_DEBITS_CHANGE: unless_zero(&change.debits),
        entry::PENDING_CREDITS_CHANGE: unless_zero(&change.credits),
        entry::BALANCE: after.balance.clone(),
        entry::PENDING_DEBITS: unless_zero(&after.debits),
        entry::PENDING_CREDITS: unless_zero(&after.credits),
        entry::AT: at.into(),
    }
}

/// `value`, or nothing (the field left out) where it is 0: an entry waiting in an account
/// document is rewritten with every later write of the account, and most entries (those
/// of plain transfers on accounts with no holds) have no pending amounts at all.
pub(super) fn unless_zero(value: &Bson) -> Bson {
    doc! { "$cond": [{ "$eq": [value.clone(), 0_i64] }, "$$REMOVE", value.clone()] }.into()
}

/// What a single-document step does to an account's marker of its transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Marker {
    /// A forward step: the marker is pushed.
    Push,
    /// An undo, a release or a capture: the marker is pulled.
    Pull,
    /// A step of a native transaction (`store::native`), which uses no marker.
    Native,
}

/// The update pipeline of a single-document step of `tx` on an account: add `change`
/// to its amounts, append the entry of it (numbered one after the account's
/// last, with the values it leaves), and push or pull the marker, all in the one write;
/// the entries `moved` says are in `entries` leave the document in the same write.
pub(super) fn changed_with_entry(
    kind: EntryKind,
    tx: ObjectId,
    change: &Amounts,
    marker: Marker,
    moved: Option<Moved>,
) -> Vec<Document> {
    let after = Amounts::stored().after(change);
    let seq = doc! { "$add": [{ "$ifNull": [path(account::SEQ), 0_i64] }, 1_i64] };
    let entry = entry_expr(seq, kind.as_str(), tx, change, &after, entry_time());
    let markers = marked(tx, marker);
    let moved = moved.unwrap_or(Moved::NOTHING);
    let recent = doc! { "$concatArrays": [kept(moved.seq, moved.at), ["$_entry"]] };
    let mut set = doc! {
        account::BALANCE: "$_entry.b",
        account::PENDING_DEBITS: { "$ifNull": ["$_entry.pd", 0_i64] },
        account::PENDING_CREDITS: { "$ifNull": ["$_entry.pc", 0_i64] },
        account::SEQ: "$_entry.seq",
        account::RECENT: recent,
        account::LAST_ENTRY_AT: "$_entry.at",
        account::PENDING: markers,
        account::UPDATED_AT: "$$NOW",
    };
    // Only a multi-leg transfer's settle changes the room (`docs/legs.md`).
    if change.incoming != Bson::Int64(0) {
        set.insert(account::INCOMING, unless_zero(&after.incoming));
    }
    vec![
        doc! { "$set": { "_entry": entry } },
        doc! { "$set": set },
        doc! { "$unset": "_entry" },
    ]
}

/// The update pipeline of a step of `tx` that changes an account's room alone (a
/// multi-leg transfer's receiving party: its prepare, `by` > 0 with the marker pushed,
/// or the undo of it, `by` < 0 with the marker pulled): no amount, so no entry.
pub(super) fn room_changed(tx: ObjectId, by: i64, marker: Marker) -> Vec<Document> {
    let after = Amounts::stored().incoming;
    let after: Bson = doc! { "$add": [after, by] }.into();
    vec![doc! { "$set": {
        account::INCOMING: unless_zero(&after),
        account::PENDING: marked(tx, marker),
        account::UPDATED_AT: "$$NOW",
    } }]
}

/// The account's markers after a step of `tx` that does `marker` to its own.
fn marked(tx: ObjectId, marker: Marker) -> Bson {
    match marker {
        Marker::Push => doc! { "$concatArrays": [path(account::PENDING), [tx]] }.into(),
        Marker::Pull => doc! { "$filter": {
            "input": path(account::PENDING), "cond": { "$ne": ["$$this", tx] },
        } }
        .into(),
        Marker::Native => path(account::PENDING).into(),
    }
}

/// An account's entries still in its document but for those up to its entry `seq`, made
/// at `at` (expressions or literals), which are in `entries`: an entry stays if it is
/// numbered after `seq` or made after `at`; and every entry stays if the document is
/// numbered below `seq`, or at `seq` with another time. These make a stale memory
/// harmless: an account made again under the same name (a database dropped and filled
/// again while an instance runs) numbers its entries from 1 again, but makes them later;
/// a document restored from a backup is numbered below what was copied since, or its
/// entries are other ones. (A restore to a moment after the entries were made but before
/// they were copied cannot be told apart: every instance must be restarted after a
/// restore, `docs/operations.md`.)
pub(super) fn kept(seq: impl Into<Bson>, at: impl Into<Bson>) -> Document {
    let (seq, at) = (seq.into(), at.into());
    let recent = doc! { "$ifNull": [path(account::RECENT), []] };
    let number = doc! { "$ifNull": [path(account::SEQ), 0_i64] };
    let stale = doc! { "$or": [
        { "$lt": [number.clone(), seq.clone()] },
        { "$and": [
            { "$eq": [number, seq.clone()] },
            { "$ne": [path(account::LAST_ENTRY_AT), at.clone()] },
        ] },
    ] };
    doc! { "$cond": [stale, recent.clone(), { "$filter": {
        "input": recent,
        "cond": { "$or": [{ "$gt": ["$$this.seq", seq] }, { "$gt": ["$$this.at", at] }] },
    } }] }
}

/// What an instance knows is in `entries` of one account: every entry up to `seq`,
/// the last of which was made at `at`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Moved {
    pub seq: i64,
    pub at: DateTime,
}

impl Moved {
    /// Nothing known: every entry stays.
    pub const NOTHING: Moved = Moved {
        seq: 0,
        at: DateTime::MIN,
    };

    /// Whether `entry` is one of those known to be in `entries`.
    fn covers(&self, entry: &EntryDoc) -> bool {
        entry.seq <= self.seq && entry.at <= self.at
    }

    /// Whether the entries of a document (`recent`, in order, the last its `seq`) can be
    /// of the history this was learnt from: the document is not numbered below it, and
    /// holds no other entry under its number. Otherwise the account was made again or
    /// restored, and what was learnt of it is forgotten.
    fn agrees_with(&self, recent: &[EntryDoc]) -> bool {
        recent.last().is_some_and(|last| last.seq >= self.seq)
            && recent.iter().all(|e| e.seq != self.seq || e.at == self.at)
    }
}

/// What an account's document says of its ledger, in one read: its last entry's number
/// and the amounts it left (the account's own), that entry's time, and the entries not
/// moved yet.
struct Head {
    seq: u64,
    amounts: domain::Amounts,
    last_at: Option<Timestamp>,
    recent: Vec<Entry>,
}

/// The ledger's reads (from [`super::Entries::entries`]): `entries`, and the entries not moved
/// yet out of an account's document in `accounts`, read together. It writes neither:
/// the account steps append entries (the `Accounts` view) and the [`EntryCopier`] moves
/// them.
#[derive(Clone, Copy, Debug)]
pub struct Entries<'s> {
    pub(super) entries: &'s Collection<EntryDoc>,
    /// Read for an account's last entries and amounts, never written here.
    pub(super) accounts: &'s Collection<AccountDoc>,
}

impl Entries<'_> {
    /// The entries of `account` numbered after `after`, oldest first, at most `limit`;
    /// `None` when the account does not exist.
    pub async fn entries(
        self,
        account: &AccountId,
        after: u64,
        limit: u32,
    ) -> StoreResult<Option<Vec<Entry>>> {
        // The document first: an entry trimmed from it before this read was copied to
        // `entries` before that, so the read of `entries` below finds it.
        let Some(head) = self.head(account).await? else {
            return Ok(None);
        };
        let limit = limit as usize;
        let first_recent = head.recent.first().map_or(head.seq + 1, |e| e.seq);
        let mut found = Vec::with_capacity(limit.min(1024));
        if after + 1 < first_recent {
            let filter = doc! {
                entry::ACCOUNT: account.as_str(),
                entry::SEQ: { "$gt": seq_i64(after), "$lt": seq_i64(first_recent) },
            };
            let options = FindOptions::builder()
                .sort(doc! { entry::SEQ: 1 })
                .limit(limit as i64)
                .build();
            let moved: Vec<EntryDoc> = self
                .entries
                .find(filter)
                .with_options(options)
                .max_time(super::READ_TIME_LIMIT)
                .await?
                .try_collect()
                .await?;
            for e in moved {
                found.push(e.into_domain(account)?);
            }
        }
        for e in head.recent {
            if found.len() >= limit {
                break;
            }
            if e.seq > after {
                found.push(e);
            }
        }
        check_numbered(account, after, &found)?;
        Ok(Some(found))
    }

    /// `account`'s amounts after its last entry whose `at` is not later than `at`
    /// (`seq` 0 and zeros before its first); `None` when the account does not exist.
    pub async fn balance_at(
        self,
        account: &AccountId,
        at: Timestamp,
    ) -> StoreResult<Option<BalanceAt>> {
        let Some(head) = self.head(account).await? else {
            return Ok(None);
        };
        let as_of = |e: Option<&Entry>| BalanceAt {
            account: account.clone(),
            at,
            seq: e.map_or(0, |e| e.seq),
            amounts: e.map(|e| e.after).unwrap_or_default(),
            finality: Finality::Provisional,
        };
        // `at` never goes back along an account's entries: the last at or before the
        // moment is the last of all when that one is, and in the document when the
        // document's first is.
        if head.last_at.is_some_and(|last| last <= at) {
            return Ok(Some(BalanceAt {
                seq: head.seq,
                amounts: head.amounts,
                ..as_of(None)
            }));
        }
        if head.recent.first().is_some_and(|e| e.at <= at) {
            return Ok(Some(as_of(head.recent.iter().rev().find(|e| e.at <= at))));
        }
        let options = FindOptions::builder()
            .sort(doc! { entry::AT: -1, entry::SEQ: -1 })
            .limit(1)
            .build();
        let found: Vec<EntryDoc> = self
            .entries
            .find(doc! { entry::ACCOUNT: account.as_str(), entry::AT: { "$lte": DateTime::from_chrono(at) } })
            .with_options(options)
            .max_time(super::READ_TIME_LIMIT)
            .await?
            .try_collect()
            .await?;
        let last = found
            .into_iter()
            .next()
            .map(|e| e.into_domain(account))
            .transpose()?;
        Ok(Some(as_of(last.as_ref())))
    }

    /// `account`'s amounts now: after its last entry, which are the account's own (an
    /// entry that landed after a lower bound of the database's clock was read belongs to
    /// "now" too, so the answer is the account as read, not as of `now`). `at` is `now`,
    /// or the last entry's time if later. `None` when the account does not exist.
    pub async fn current_balance(
        self,
        account: &AccountId,
        now: Timestamp,
    ) -> StoreResult<Option<BalanceAt>> {
        Ok(self.head(account).await?.map(|head| BalanceAt {
            account: account.clone(),
            at: head.last_at.map_or(now, |last| last.max(now)),
            seq: head.seq,
            amounts: head.amounts,
            finality: Finality::Provisional,
        }))
    }

    /// What `account`'s document says of its ledger; `None` when the account does not
    /// exist.
    async fn head(self, account: &AccountId) -> StoreResult<Option<Head>> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Stored {
            #[serde(default)]
            seq: i64,
            balance: i64,
            #[serde(default)]
            pending_debits: i64,
            #[serde(default)]
            pending_credits: i64,
            last_entry_at: Option<DateTime>,
            #[serde(default)]
            recent_entries: Vec<EntryDoc>,
        }
        let found = self
            .accounts
            .clone_with_type::<Stored>()
            .find_one(doc! { "_id": account.as_str() })
            .projection(doc! {
                account::SEQ: 1, account::BALANCE: 1, account::PENDING_DEBITS: 1, account::PENDING_CREDITS: 1,
                account::LAST_ENTRY_AT: 1, account::RECENT: 1,
            })
            .max_time(super::READ_TIME_LIMIT)
            .await?;
        let Some(d) = found else { return Ok(None) };
        let seq = u64::try_from(d.seq).map_err(|_| {
            StoreError::Malformed(format!("account {account}: stored seq {}", d.seq).into())
        })?;
        let recent = d
            .recent_entries
            .into_iter()
            .map(|e| e.into_domain(account))
            .collect::<StoreResult<Vec<Entry>>>()?;
        Ok(Some(Head {
            seq,
            amounts: domain::Amounts {
                balance: d.balance,
                pending_debits: d.pending_debits,
                pending_credits: d.pending_credits,
            },
            last_at: d.last_entry_at.map(|at| at.to_chrono()),
            recent,
        }))
    }
}

fn seq_i64(seq: u64) -> i64 {
    i64::try_from(seq).unwrap_or(i64::MAX)
}

/// A page must be numbered `after + 1, after + 2, ...`: anything else is a broken
/// invariant, answered as an error (500) rather than as a ledger with a hole in it.
fn check_numbered(account: &AccountId, after: u64, found: &[Entry]) -> StoreResult<()> {
    for (i, e) in found.iter().enumerate() {
        if e.seq != after + 1 + i as u64 {
            return Err(StoreError::Malformed(
                format!(
                    "account {account}: entry {} found where {} was expected",
                    e.seq,
                    after + 1 + i as u64
                )
                .into(),
            ));
        }
    }
    Ok(())
}

/// Moves entries out of account documents into `entries` (see the module's doc).
///
/// The accounts this instance changed are remembered, and every [`MOVE_INTERVAL`] one
/// round copies their new entries, many accounts in two commands (a `find` and an
/// `insertMany`), holding one of the group-commit writer slots like any batch. It then
/// remembers, per account, up to which entry the copies are durable ([`Moved`]); the next
/// write that changes the account, which rewrites its document anyway, leaves those
/// entries out ([`kept`], asked through [`EntryCopier::moved`]). So moving costs no
/// write of the account documents of its own.
pub struct EntryCopier {
    touched: Mutex<BTreeSet<String>>,
    /// Where the next round starts: after the last account the previous one took, so
    /// that accounts a failing round gives back wait their turn behind the others.
    resume_after: Mutex<Option<String>>,
    /// Per account, what this instance copied to `entries`; at most [`MAX_REMEMBERED`]
    /// accounts, forgotten all at once when full (an account forgotten keeps its copied
    /// entries in its document until the copier copies it again, the copies refused as
    /// duplicates, and remembers it).
    moved: Mutex<HashMap<String, Moved>>,
}

impl EntryCopier {
    /// Starts the task that moves entries; it ends once the copier is dropped.
    /// Its commands are timed as `deployment`'s.
    pub(super) fn start(
        db: &Database,
        slots: Option<Arc<Semaphore>>,
        deployment: DeploymentName,
    ) -> Arc<EntryCopier> {
        let copier = Arc::new(EntryCopier::new());
        let weak = Arc::downgrade(&copier);
        let accounts: Collection<Document> = db.collection("accounts");
        let entries: Collection<EntryDoc> = db.collection("entries");
        let moving = move_entries_until_dropped(weak, accounts, entries, slots);
        tokio::spawn(super::writing_to(deployment, moving));
        copier
    }

    /// A copier that knows of nothing moved and moves nothing until started.
    pub(super) fn new() -> EntryCopier {
        EntryCopier {
            touched: Mutex::new(BTreeSet::new()),
            resume_after: Mutex::new(None),
            moved: Mutex::new(HashMap::new()),
        }
    }

    /// What this instance knows is in `entries` of `account`: the write that changes it
    /// next leaves those entries out of its document.
    pub(super) fn moved(&self, account: &str) -> Option<Moved> {
        let moved = self.moved.lock().unwrap_or_else(|e| e.into_inner());
        moved.get(account).copied()
    }

    fn remember_moved(&self, copied: impl IntoIterator<Item = (String, Moved)>) {
        let mut moved = self.moved.lock().unwrap_or_else(|e| e.into_inner());
        for (account, up_to) in copied {
            if moved.len() >= MAX_REMEMBERED && !moved.contains_key(&account) {
                moved.clear();
            }
            moved.insert(account, up_to);
        }
    }

    pub(super) fn touched<'a>(&self, accounts: impl IntoIterator<Item = &'a str>) {
        let mut touched = self.touched.lock().unwrap_or_else(|e| e.into_inner());
        for account in accounts {
            if touched.len() >= MAX_REMEMBERED {
                break;
            }
            if !touched.contains(account) {
                touched.insert(account.to_owned());
            }
        }
    }

    /// The accounts of the next round, at most [`MAX_ACCOUNTS_PER_MOVE`], taken in turn:
    /// those after where the last round stopped, then from the first.
    fn take(&self) -> Vec<String> {
        use std::ops::Bound::{Excluded, Included, Unbounded};
        let mut touched = self.touched.lock().unwrap_or_else(|e| e.into_inner());
        let mut resume = self.resume_after.lock().unwrap_or_else(|e| e.into_inner());
        let taken: Vec<String> = match resume.as_deref() {
            Some(last) => touched
                .range::<str, _>((Excluded(last), Unbounded))
                .chain(touched.range::<str, _>((Unbounded, Included(last))))
                .take(MAX_ACCOUNTS_PER_MOVE)
                .cloned()
                .collect(),
            None => touched
                .iter()
                .take(MAX_ACCOUNTS_PER_MOVE)
                .cloned()
                .collect(),
        };
        for account in &taken {
            touched.remove(account);
        }
        if let Some(last) = taken.last() {
            *resume = Some(last.clone());
        }
        taken
    }

    /// Gives back accounts a failed round could not move, to try again.
    fn retake(&self, accounts: Vec<String>) {
        self.touched(accounts.iter().map(String::as_str));
    }

    /// One round: copy to `entries` the entries of each account in `ids` not copied
    /// yet, then remember them as moved. Answers how many it copied.
    pub(super) async fn move_entries(
        &self,
        accounts: &Collection<Document>,
        entries: &Collection<EntryDoc>,
        ids: &[String],
    ) -> StoreResult<usize> {
        #[derive(Deserialize)]
        struct Recent {
            #[serde(rename = "_id")]
            id: String,
            #[serde(rename = "recentEntries", default)]
            recent: Vec<EntryDoc>,
        }
        let accounts = accounts.clone_with_type::<Recent>();
        let found = accounts
            .find(doc! { "_id": { "$in": ids }, "recentEntries.0": { "$exists": true } })
            .projection(doc! { account::RECENT: 1 })
            .max_time(super::READ_TIME_LIMIT);
        // Its `getMore`s, if the entries fill more than a reply, are not timed.
        let found: Vec<Recent> = super::timed("find", found).await?.try_collect().await?;
        let mut copies = Vec::new();
        let mut copied = Vec::new();
        for account in found {
            let Some(last) = account.recent.last() else {
                continue;
            };
            let known = self
                .moved(&account.id)
                .filter(|known| known.agrees_with(&account.recent))
                .unwrap_or(Moved::NOTHING);
            if known.covers(last) {
                continue;
            }
            let up_to = Moved {
                seq: last.seq,
                at: last.at,
            };
            for e in account.recent.iter().filter(|e| !known.covers(e)) {
                copies.push(EntryDoc {
                    account: Some(account.id.clone()),
                    ..e.clone()
                });
            }
            copied.push((account.id, up_to));
        }
        if copies.is_empty() {
            return Ok(0);
        }
        let count = copies.len();
        insert_ignoring_copies(entries, &copies).await?;
        // Only now are they durably in `entries`: from here on, a write that changes one
        // of these accounts may leave them out of its document.
        self.remember_moved(copied);
        crate::metrics::entries_moved(count);
        Ok(count)
    }
}

async fn move_entries_until_dropped(
    copier: Weak<EntryCopier>,
    accounts: Collection<Document>,
    entries: Collection<EntryDoc>,
    slots: Option<Arc<Semaphore>>,
) {
    // Whether the last round failed: said once when the copier starts failing and once
    // when it moves again, not every round.
    let mut failing = false;
    loop {
        tokio::time::sleep(MOVE_INTERVAL).await;
        let Some(live) = copier.upgrade() else { return };
        let taken = live.take();
        if taken.is_empty() {
            continue;
        }
        let _slot = match &slots {
            Some(slots) => slots.clone().acquire_owned().await.ok(),
            None => None,
        };
        match live.move_entries(&accounts, &entries, &taken).await {
            Ok(_) if failing => {
                failing = false;
                tracing::info!("entries moving again");
            }
            Ok(_) => {}
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %crate::error_chain::Chain(&e), "entries not moved; they stay readable in the account documents, and are tried again every round");
                }
                failing = true;
                live.retake(taken);
            }
        }
    }
}

/// `insertMany`, unordered, of entries that may have been copied already (by another
/// instance, or an attempt whose reply was lost): a duplicate is the same entry.
async fn insert_ignoring_copies(
    entries: &Collection<EntryDoc>,
    copies: &[EntryDoc],
) -> StoreResult<()> {
    let (inserted, _) = super::retried(|| async {
        match super::timed("insert", entries.insert_many(copies).ordered(false)).await {
            Ok(_) => Ok(()),
            Err(e) => match e.kind.as_ref() {
                ErrorKind::InsertMany(f)
                    if f.write_concern_error.is_none()
                        && f.write_errors.iter().flatten().all(|w| w.code == 11000) =>
                {
                    Ok(())
                }
                _ => Err(StoreError::from(e)),
            },
        }
    })
    .await;
    inserted
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64) -> Entry {
        Entry {
            account: AccountId::parse("alice").unwrap(),
            seq,
            kind: EntryKind::Credit,
            transfer_id: None,
            change: domain::Amounts::default(),
            after: domain::Amounts::default(),
            at: domain::now(),
            carried_forward: false,
        }
    }

    #[test]
    fn a_page_must_be_numbered_from_after_plus_one_without_a_hole() {
        let alice = AccountId::parse("alice").unwrap();
        let page = |seqs: &[u64]| seqs.iter().copied().map(entry).collect::<Vec<_>>();
        assert!(check_numbered(&alice, 0, &page(&[1, 2, 3])).is_ok());
        assert!(check_numbered(&alice, 7, &page(&[8, 9])).is_ok());
        assert!(check_numbered(&alice, 7, &page(&[])).is_ok());
        for hole in [&[1, 3][..], &[2, 3], &[1, 1], &[8]] {
            let err = check_numbered(&alice, 0, &page(hole)).unwrap_err();
            assert!(matches!(err, StoreError::Malformed(_)), "{hole:?}: {err:?}");
        }
    }

    fn stored(seq: i64, at_ms: i64) -> EntryDoc {
        EntryDoc {
            seq,
            at: DateTime::from_millis(at_ms),
            ..opening_entry(0, DateTime::from_millis(at_ms))
        }
    }

    #[test]
    fn what_was_moved_covers_entries_up_to_its_number_and_no_later_than_its_time() {
        let moved = Moved {
            seq: 10,
            at: DateTime::from_millis(5_000),
        };
        assert!(moved.covers(&stored(1, 1_000)));
        assert!(moved.covers(&stored(10, 5_000)));
        assert!(!moved.covers(&stored(11, 5_000)), "numbered after");
        // An account made again under the same name numbers from 1 again, later.
        assert!(!moved.covers(&stored(3, 5_001)), "made after");
        assert!(!Moved::NOTHING.covers(&stored(1, 0)));
    }

    #[test]
    fn what_was_moved_agrees_only_with_a_document_of_the_same_history() {
        let moved = Moved {
            seq: 10,
            at: DateTime::from_millis(5_000),
        };
        assert!(moved.agrees_with(&[stored(9, 4_000), stored(10, 5_000)]));
        assert!(moved.agrees_with(&[stored(11, 6_000), stored(12, 6_000)]));
        assert!(
            !moved.agrees_with(&[stored(8, 4_000), stored(9, 4_500)]),
            "below"
        );
        assert!(!moved.agrees_with(&[stored(10, 7_000)]), "another entry 10");
        assert!(!moved.agrees_with(&[]));
    }

    #[test]
    fn accounts_a_failed_round_gives_back_wait_behind_the_others() {
        let copier = EntryCopier::new();
        let all: Vec<String> = (0..MAX_ACCOUNTS_PER_MOVE + 44)
            .map(|i| format!("a{i:04}"))
            .collect();
        copier.touched(all.iter().map(String::as_str));
        let first = copier.take();
        assert_eq!(first, all[..MAX_ACCOUNTS_PER_MOVE]);
        copier.retake(first.clone());
        let second = copier.take();
        assert_eq!(second.len(), MAX_ACCOUNTS_PER_MOVE);
        assert_eq!(
            second[..44],
            all[MAX_ACCOUNTS_PER_MOVE..],
            "the others first"
        );
        assert_eq!(second[44..], first[..MAX_ACCOUNTS_PER_MOVE - 44]);
        assert_eq!(copier.take(), first[MAX_ACCOUNTS_PER_MOVE - 44..]);
        assert!(copier.take().is_empty());
    }

    #[test]
    fn the_mover_remembers_what_it_moved_and_forgets_it_all_when_full() {
        let copier = EntryCopier::new();
        let moved = |seq| Moved {
            seq,
            at: DateTime::from_millis(seq),
        };
        copier.remember_moved([("a".to_owned(), moved(3)), ("b".to_owned(), moved(4))]);
        copier.remember_moved([("a".to_owned(), moved(7))]);
        assert_eq!(copier.moved("a"), Some(moved(7)));
        assert_eq!(copier.moved("b"), Some(moved(4)));
        assert_eq!(copier.moved("c"), None);
        let many = (0..MAX_REMEMBERED).map(|i| (format!("{i:06}"), moved(1)));
        copier.remember_moved(many);
        let remembered = copier.moved.lock().unwrap().len();
        assert!(remembered <= MAX_REMEMBERED, "{remembered}");
        assert_eq!(copier.moved("a"), None, "forgotten when full");
        assert_eq!(
            copier.moved(&format!("{:06}", MAX_REMEMBERED - 1)),
            Some(moved(1))
        );
    }

    #[test]
    fn the_mover_remembers_each_account_once_up_to_its_bound_and_hands_out_rounds() {
        let copier = EntryCopier::new();
        copier.touched(["b", "a", "b"]);
        assert_eq!(copier.take(), vec!["a".to_owned(), "b".to_owned()]);
        assert!(copier.take().is_empty());
        let many: Vec<String> = (0..MAX_REMEMBERED + 10)
            .map(|i| format!("{i:06}"))
            .collect();
        copier.touched(many.iter().map(String::as_str));
        let remembered = copier.touched.lock().unwrap().len();
        assert_eq!(remembered, MAX_REMEMBERED);
        let round = copier.take();
        assert_eq!(round.len(), MAX_ACCOUNTS_PER_MOVE);
        assert_eq!(round.first().map(String::as_str), Some("000000"));
        copier.retake(vec!["000000".to_owned()]);
        let next = format!("{MAX_ACCOUNTS_PER_MOVE:06}");
        assert_eq!(
            copier.take().first(),
            Some(&next),
            "in turn, after the last round"
        );
        assert!(
            copier.touched.lock().unwrap().contains("000000"),
            "given back"
        );
    }
}
