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
//!   [`EntryMover`] of the instance that made the change, a few milliseconds later, in
//!   one `insertMany` for many accounts; once the copies are acknowledged, one
//!   `updateMany` trims the moved entries out of the account documents. The last entry
//!   always stays in its account's document (it carries the `at` the next entry must not
//!   precede, and answers "now" in one read).
//!
//! Every entry is thus in the account's document, in `entries`, or in both, at every
//! moment: an entry leaves the document only after its copy is durable. A reader reads
//! the document first, then `entries` below the document's oldest entry; anything
//! trimmed before the first read was copied before it too. Copying twice (two
//! instances, or a lost reply) is refused by the unique index and ignored: an entry
//! never changes once written, so both copies are the same.
//!
//! An instance killed before it moved its entries leaves them in the documents, where
//! they are read as well; the next change to such an account, by any instance, moves
//! them with its own.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures::TryStreamExt;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::error::ErrorKind;
use mongodb::options::FindOptions;
use mongodb::{Collection, Database};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use super::documents::transfer_id;
use super::guards::Amounts;
use super::{Store, StoreError, StoreResult};
use crate::domain::{self, AccountId, BalanceAt, Entry, EntryKind, Timestamp};

/// The field of an account document that holds its entries not moved yet.
pub(super) const RECENT: &str = "recentEntries";

/// How long the mover waits, after the first change it was told of, before it moves
/// what has gathered: long enough to move many accounts' entries in one command, short
/// enough that the documents stay small.
const MOVE_INTERVAL: Duration = Duration::from_millis(50);

/// Accounts moved in one round, at most; the rest wait for the next round.
const MAX_ACCOUNTS_PER_MOVE: usize = 256;

/// Accounts the mover remembers to move, at most. Beyond it a change is not remembered:
/// its entries stay in the document (read from there), until the next change to the
/// account moves them.
const MAX_REMEMBERED: usize = 100_000;

/// An entry as stored, in an account's `recentEntries` and in `entries` (which adds
/// `account`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EntryDoc {
    /// In `entries` only: the account the entry belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
    pub seq: i64,
    pub kind: EntryKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_id: Option<ObjectId>,
    pub balance_change: i64,
    pub pending_debits_change: i64,
    pub pending_credits_change: i64,
    pub balance: i64,
    pub pending_debits: i64,
    pub pending_credits: i64,
    pub at: DateTime,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub carried_forward: bool,
}

impl EntryDoc {
    fn into_domain(self, account: &AccountId) -> StoreResult<Entry> {
        let seq = u64::try_from(self.seq).map_err(|_| {
            StoreError::Other(format!("account {account}: stored entry seq {}", self.seq).into())
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
/// clock, never before the account's last entry (a clock stepped back, or a failover to
/// a member whose clock is behind, cannot make entries go back in time; nor can a write
/// that read `$$NOW` before another landed first).
///
/// The last entry's `at` is read through `$let`: SecantusDB does not resolve a path
/// through an array of documents (`"$recentEntries.at"`), which MongoDB answers with the
/// array of their times; with it, the `$max` compared with nothing, and the bank test
/// saw entries on hot accounts go back by a few milliseconds.
pub(super) fn entry_time() -> Document {
    doc! { "$max": ["$$NOW", { "$let": {
        "vars": { "last": { "$arrayElemAt": [format!("${RECENT}"), -1] } },
        "in": "$$last.at",
    } }] }
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
        "seq": seq.into(),
        "kind": kind.into(),
        "transferId": tx.into(),
        "balanceChange": change.balance.clone(),
        "pendingDebitsChange": change.debits.clone(),
        "pendingCreditsChange": change.credits.clone(),
        "balance": after.balance.clone(),
        "pendingDebits": after.debits.clone(),
        "pendingCredits": after.credits.clone(),
        "at": at.into(),
    }
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
/// to its amounts, append the entry that records it (numbered one after the account's
/// last, with the values it leaves), and push or pull the marker, all in the one write.
pub(super) fn changed_with_entry(
    kind: EntryKind,
    tx: ObjectId,
    change: &Amounts,
    marker: Marker,
) -> Vec<Document> {
    let after = Amounts::stored().after(change);
    let seq = doc! { "$add": [{ "$ifNull": ["$seq", 0_i64] }, 1_i64] };
    let entry = entry_expr(seq, kind.as_str(), tx, change, &after, entry_time());
    let markers: Bson = match marker {
        Marker::Push => doc! { "$concatArrays": ["$pendingTransactions", [tx]] }.into(),
        Marker::Pull => doc! { "$filter": {
            "input": "$pendingTransactions", "cond": { "$ne": ["$$this", tx] },
        } }
        .into(),
        Marker::Native => "$pendingTransactions".into(),
    };
    let recent = doc! { "$concatArrays": [{ "$ifNull": [format!("${RECENT}"), []] }, ["$_entry"]] };
    vec![
        doc! { "$set": { "_entry": entry } },
        doc! { "$set": {
            "balance": "$_entry.balance",
            "pendingDebits": "$_entry.pendingDebits",
            "pendingCredits": "$_entry.pendingCredits",
            "seq": "$_entry.seq",
            RECENT: recent,
            "pendingTransactions": markers,
            "updatedAt": "$$NOW",
        } },
        doc! { "$unset": "_entry" },
    ]
}

/// The update pipeline that removes from an account document its entries numbered up
/// to `up_to` (an expression or a literal), once they are in `entries`.
pub(super) fn trimmed(up_to: impl Into<Bson>) -> Vec<Document> {
    vec![doc! { "$set": { RECENT: { "$filter": {
        "input": format!("${RECENT}"),
        "cond": { "$gt": ["$$this.seq", up_to.into()] },
    } } } }]
}

/// A page of an account's entries, oldest first.
#[derive(Debug, Clone, PartialEq)]
pub struct EntryPage {
    pub entries: Vec<Entry>,
}

impl Store {
    /// The entries of `account` numbered after `after`, oldest first, at most `limit`;
    /// `None` when the account does not exist.
    pub async fn entries(
        &self,
        account: &AccountId,
        after: u64,
        limit: u32,
    ) -> StoreResult<Option<Vec<Entry>>> {
        // The document first: an entry trimmed from it before this read was copied to
        // `entries` before that, so the read of `entries` below finds it.
        let Some(recent) = self.recent_entries(account).await? else {
            return Ok(None);
        };
        let limit = limit as usize;
        let first_recent = recent.first().map_or(u64::MAX, |e| e.seq);
        let mut found = Vec::with_capacity(limit.min(1024));
        if after + 1 < first_recent {
            let seq_below = i64::try_from(first_recent).unwrap_or(i64::MAX);
            let filter = doc! {
                "account": account.as_str(),
                "seq": { "$gt": seq_i64(after), "$lt": seq_below },
            };
            let options = FindOptions::builder()
                .sort(doc! { "seq": 1 })
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
        for e in recent {
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
        &self,
        account: &AccountId,
        at: Timestamp,
    ) -> StoreResult<Option<BalanceAt>> {
        let Some(recent) = self.recent_entries(account).await? else {
            return Ok(None);
        };
        let as_of = |e: Option<&Entry>| BalanceAt {
            account: account.clone(),
            at,
            seq: e.map_or(0, |e| e.seq),
            amounts: e.map(|e| e.after).unwrap_or_default(),
        };
        // `at` never goes back along an account's entries: the last at or before the
        // moment is in the document when the document's first is.
        if recent.first().is_some_and(|e| e.at <= at) {
            return Ok(Some(as_of(recent.iter().rev().find(|e| e.at <= at))));
        }
        let options = FindOptions::builder()
            .sort(doc! { "at": -1, "seq": -1 })
            .limit(1)
            .build();
        let found: Vec<EntryDoc> = self
            .entries
            .find(doc! { "account": account.as_str(), "at": { "$lte": DateTime::from_chrono(at) } })
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

    /// `account`'s amounts now: after its last entry, always in its document (an entry
    /// that landed after a lower bound of the database's clock was read belongs to "now"
    /// too, so the answer is the last entry, not one as of `now`). `at` is `now`, or the
    /// last entry's time if later. `None` when the account does not exist.
    pub async fn current_balance(
        &self,
        account: &AccountId,
        now: Timestamp,
    ) -> StoreResult<Option<BalanceAt>> {
        let Some(recent) = self.recent_entries(account).await? else {
            return Ok(None);
        };
        let last = recent.last();
        Ok(Some(BalanceAt {
            account: account.clone(),
            at: last.map_or(now, |e| e.at.max(now)),
            seq: last.map_or(0, |e| e.seq),
            amounts: last.map(|e| e.after).unwrap_or_default(),
        }))
    }

    /// The entries still in `account`'s document, oldest first; `None` when the account
    /// does not exist.
    async fn recent_entries(&self, account: &AccountId) -> StoreResult<Option<Vec<Entry>>> {
        #[derive(Deserialize)]
        struct Recent {
            #[serde(rename = "recentEntries", default)]
            recent: Vec<EntryDoc>,
        }
        let found = self
            .accounts
            .clone_with_type::<Recent>()
            .find_one(doc! { "_id": account.as_str() })
            .projection(doc! { RECENT: 1 })
            .max_time(super::READ_TIME_LIMIT)
            .await?;
        found
            .map(|r| {
                r.recent
                    .into_iter()
                    .map(|e| e.into_domain(account))
                    .collect()
            })
            .transpose()
    }

    /// Tells this store's [`EntryMover`] that `accounts` have new entries.
    pub(super) fn entries_added<'a>(&self, accounts: impl IntoIterator<Item = &'a str>) {
        self.batches.entry_mover.touched(accounts);
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
            return Err(StoreError::Other(
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

/// Moves entries out of account documents into `entries` (see the module's doc): the
/// accounts this instance changed are remembered, and every [`MOVE_INTERVAL`] one round
/// moves them, many accounts in three commands (a `find`, an `insertMany`, an
/// `updateMany`), holding one of the group-commit writer slots like any batch.
pub struct EntryMover {
    touched: Mutex<BTreeSet<String>>,
}

impl EntryMover {
    /// Starts the task that moves entries; it ends once the mover is dropped.
    pub(super) fn start(db: &Database, slots: Option<Arc<Semaphore>>) -> Arc<EntryMover> {
        let mover = Arc::new(EntryMover {
            touched: Mutex::new(BTreeSet::new()),
        });
        let weak = Arc::downgrade(&mover);
        let accounts: Collection<Document> = db.collection("accounts");
        let entries: Collection<EntryDoc> = db.collection("entries");
        tokio::spawn(move_entries_until_dropped(weak, accounts, entries, slots));
        mover
    }

    fn touched<'a>(&self, accounts: impl IntoIterator<Item = &'a str>) {
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

    fn take(&self) -> Vec<String> {
        let mut touched = self.touched.lock().unwrap_or_else(|e| e.into_inner());
        let mut taken = Vec::new();
        while taken.len() < MAX_ACCOUNTS_PER_MOVE {
            match touched.pop_first() {
                Some(account) => taken.push(account),
                None => break,
            }
        }
        taken
    }

    /// Gives back accounts a failed round could not move, to try again.
    fn retake(&self, accounts: Vec<String>) {
        self.touched(accounts.iter().map(String::as_str));
    }
}

async fn move_entries_until_dropped(
    mover: Weak<EntryMover>,
    accounts: Collection<Document>,
    entries: Collection<EntryDoc>,
    slots: Option<Arc<Semaphore>>,
) {
    // Whether the last round failed: said once when the mover starts failing and once
    // when it moves again, not every round.
    let mut failing = false;
    loop {
        tokio::time::sleep(MOVE_INTERVAL).await;
        let Some(live) = mover.upgrade() else { return };
        let taken = live.take();
        if taken.is_empty() {
            continue;
        }
        let _slot = match &slots {
            Some(slots) => slots.clone().acquire_owned().await.ok(),
            None => None,
        };
        match move_entries(&accounts, &entries, &taken).await {
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

/// One round: copy every entry but the last of each account in `ids` to `entries`,
/// then trim what was copied out of the documents.
pub async fn move_entries(
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
    let found: Vec<Recent> = accounts
        .clone_with_type::<Recent>()
        .find(doc! { "_id": { "$in": ids }, "recentEntries.1": { "$exists": true } })
        .projection(doc! { RECENT: 1 })
        .max_time(super::READ_TIME_LIMIT)
        .await?
        .try_collect()
        .await?;
    let mut copies = Vec::new();
    let mut moved_up_to: HashMap<String, i64> = HashMap::new();
    for account in found {
        let Some((_last, older)) = account.recent.split_last() else {
            continue;
        };
        let Some(up_to) = older.last().map(|e| e.seq) else {
            continue;
        };
        for e in older {
            copies.push(EntryDoc {
                account: Some(account.id.clone()),
                ..e.clone()
            });
        }
        moved_up_to.insert(account.id, up_to);
    }
    if copies.is_empty() {
        return Ok(0);
    }
    let count = copies.len();
    insert_ignoring_copies(entries, &copies).await?;
    // Only what is now durably in `entries` leaves a document: entries numbered up to
    // what was copied, never the last. Safe to repeat, and safe to land late: what it
    // removes is in `entries` for ever.
    let branches: Vec<Document> = moved_up_to
        .iter()
        .map(|(id, up_to)| doc! { "case": { "$eq": ["$_id", id] }, "then": up_to })
        .collect();
    let ids: Vec<&String> = moved_up_to.keys().collect();
    let (trimmed, _) = super::retried(|| async {
        accounts
            .update_many(
                doc! { "_id": { "$in": &ids } },
                trimmed(doc! { "$switch": { "branches": branches.clone(), "default": 0_i64 } }),
            )
            .await
            .map_err(StoreError::from)
    })
    .await;
    trimmed?;
    crate::metrics::entries_moved(count);
    Ok(count)
}

/// `insertMany`, unordered, of entries that may have been copied already (by another
/// instance, or an attempt whose reply was lost): a duplicate is the same entry.
async fn insert_ignoring_copies(
    entries: &Collection<EntryDoc>,
    copies: &[EntryDoc],
) -> StoreResult<()> {
    let (inserted, _) = super::retried(|| async {
        match entries.insert_many(copies).ordered(false).await {
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
            assert!(matches!(err, StoreError::Other(_)), "{hole:?}: {err:?}");
        }
    }

    #[test]
    fn the_mover_remembers_each_account_once_up_to_its_bound_and_hands_out_rounds() {
        let mover = EntryMover {
            touched: Mutex::new(BTreeSet::new()),
        };
        mover.touched(["b", "a", "b"]);
        assert_eq!(mover.take(), vec!["a".to_owned(), "b".to_owned()]);
        assert!(mover.take().is_empty());
        let many: Vec<String> = (0..MAX_REMEMBERED + 10)
            .map(|i| format!("{i:06}"))
            .collect();
        mover.touched(many.iter().map(String::as_str));
        let remembered = mover.touched.lock().unwrap().len();
        assert_eq!(remembered, MAX_REMEMBERED);
        assert_eq!(mover.take().len(), MAX_ACCOUNTS_PER_MOVE);
        mover.retake(vec!["000000".to_owned()]);
        assert_eq!(mover.take().first().map(String::as_str), Some("000000"));
    }
}
