//! The ledger as the tests check it: every account's entries read back ([`read`] from a
//! database, as the service reads them; [`read_via_api`] through
//! `GET /accounts/{id}/entries`) and the guarantees of the ledger (`src/domain/entry.rs`,
//! `src/store/entries.rs`) checked on them. The bank test, the interleaving explorer and
//! the crash tests all check through this one module.
//!
//! - [`check_accounts`]: per account, entries numbered `1..=n` without gaps, each the
//!   previous plus its changes ([`Entry::follows`]), the first the opening and no other,
//!   times that never go back, amounts within their bounds after every entry, the last
//!   entry's amounts and number the account's own; and no step of a transfer entered
//!   twice on the account, nor an undo, a release or a capture before its forward step.
//! - [`check_transfers`]: per transfer, the entries its state calls for on each of its
//!   accounts ([`expected_shapes`]), each with the transfer's amounts; and no entry that
//!   names a transfer the log does not have, or an account that is not the side its kind
//!   belongs to.
//! - [`check_conserved`]: the sum of the latest balances is the total the test opened.
//! - [`check_document`]: what one account document says on its own, in one atomic read
//!   (its amounts, its `seq`, its last entry), for samplers while a run goes on.
//! - [`check_balance_at`]: an answer of `GET /accounts/{id}/balance` against the entries.
//! - [`check_same_entries`]: the API's entries against the database's.
//!
//! Each returns [`Findings`]: how many times each invariant was checked and what broke
//! it, a line per violation naming the account, the entry's `seq` and what is wrong.
//!
//! Reading is safe at any moment, but the per-transfer shapes compare the entries with
//! the transfers' states: read the transfers first, and check once nothing moves any
//! more (the end of a run, or while every actor is paused).

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use mongodb::Database;
use mongodb::bson::{Bson, Document, doc};
use serde_json::Value;
use transfer_service::domain::{
    Amounts, Entry, EntryKind, MAX_MONEY, Timestamp, Transfer, TransferId, TransferState,
};

/// Invariants checked, each with how many times, and what broke them.
#[derive(Debug, Default, Clone)]
pub struct Findings {
    pub counts: BTreeMap<&'static str, u64>,
    /// `[invariant] what is wrong`, one per violation.
    pub violations: Vec<String>,
}

impl Findings {
    /// Counts one check of `invariant`; records `violation()` when `holds` is false.
    pub fn check(
        &mut self,
        invariant: &'static str,
        holds: bool,
        violation: impl FnOnce() -> String,
    ) {
        *self.counts.entry(invariant).or_default() += 1;
        if !holds {
            self.violations
                .push(format!("[{invariant}] {}", violation()));
        }
    }

    pub fn extend(&mut self, other: Findings) {
        for (invariant, n) in other.counts {
            *self.counts.entry(invariant).or_default() += n;
        }
        self.violations.extend(other.violations);
    }

    /// Checks made, over every invariant.
    pub fn checked(&self) -> u64 {
        self.counts.values().sum()
    }
}

/// One account's ledger as read.
#[derive(Debug, Clone)]
pub struct AccountLedger {
    pub account: String,
    /// The account document's amounts when it was read...
    pub stored: Amounts,
    /// ...and its `seq`, the number of its last entry.
    pub seq: u64,
    /// Every entry, oldest first: those of `entries` below the document's oldest recent
    /// entry, then the document's.
    pub entries: Vec<Entry>,
}

impl AccountLedger {
    /// The amounts after the last entry, zeros before any.
    pub fn latest(&self) -> Amounts {
        self.entries.last().map(|e| e.after).unwrap_or_default()
    }
}

/// The accounts of one or more databases and their entries.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    pub accounts: BTreeMap<String, AccountLedger>,
    /// What reading found wrong on its own: an entry or a document that does not parse,
    /// a copy in `entries` that differs from the document's, an entry moved beyond the
    /// account's `seq`, an account in two databases.
    pub read: Findings,
}

impl Ledger {
    /// Adds the accounts of another database.
    pub fn merge(&mut self, other: Ledger) {
        self.read.extend(other.read);
        for (id, account) in other.accounts {
            let twice = self.accounts.contains_key(&id);
            self.read
                .check("ledger: an account is in one database only", !twice, || {
                    format!("{id} is in two of the databases read")
                });
            self.accounts.insert(id, account);
        }
    }

    /// Every account, its `seq` and amounts as stored, and its entries a line each: what
    /// a failing test prints.
    pub fn describe(&self) -> String {
        let mut out = String::new();
        for a in self.accounts.values() {
            out += &format!(
                "{}: seq {}, stored {}\n",
                a.account,
                a.seq,
                amounts(&a.stored)
            );
            for e in &a.entries {
                out += &format!("  {}\n", line(e));
            }
        }
        out
    }

    /// Entries over every account.
    pub fn entry_count(&self) -> usize {
        self.accounts.values().map(|a| a.entries.len()).sum()
    }

    /// The sum of the balances the `opened` entries opened with: what the latest balances
    /// must still sum to.
    pub fn opening_total(&self) -> i64 {
        self.accounts
            .values()
            .flat_map(|a| &a.entries)
            .filter(|e| e.kind == EntryKind::Opened)
            .map(|e| e.change.balance)
            .sum()
    }
}

/// The fields of an account document the ledger needs.
fn ledger_projection() -> Document {
    doc! { "balance": 1, "pendingDebits": 1, "pendingCredits": 1, "seq": 1, "recentEntries": 1, "lastEntryAt": 1 }
}

/// Reads the accounts of `db` (those of `only`, or all) and their entries as the service
/// does: each account document first, then `entries`. An entry leaves a document only
/// once its copy is in `entries`, so none is missed; where both copies are read they
/// must be equal. An entry of `entries` numbered beyond the document's `seq` as read may
/// have been made (and moved) since; the account is read again, and its `seq` must now
/// reach it.
pub async fn read(db: &Database, only: Option<&[&str]>) -> mongodb::error::Result<Ledger> {
    let filter = match only {
        Some(ids) => doc! { "_id": { "$in": ids } },
        None => doc! {},
    };
    let documents = find_all(db, "accounts", filter.clone(), ledger_projection(), None).await?;
    let mut ledger = Ledger::default();
    for d in &documents {
        match parse_document(d) {
            Ok((account, recent)) => {
                ledger.accounts.insert(
                    account.account.clone(),
                    AccountLedger {
                        entries: recent,
                        ..account
                    },
                );
            }
            Err(e) => ledger
                .read
                .check("ledger: every document parses", false, || e),
        }
    }
    let ids: Vec<&str> = ledger.accounts.keys().map(String::as_str).collect();
    let moved = find_all(
        db,
        "entries",
        doc! { "account": { "$in": &ids } },
        doc! { "_id": 0 },
        Some(doc! { "account": 1, "seq": 1 }),
    )
    .await?;
    let mut moved_by_account: HashMap<String, Vec<Entry>> = HashMap::new();
    for d in &moved {
        let account = d.get_str("account").unwrap_or_default().to_owned();
        match parse_entry(&account, d) {
            Ok(e) => moved_by_account.entry(account).or_default().push(e),
            Err(e) => ledger.read.check("ledger: every entry parses", false, || {
                format!("{account} in entries: {e}: {d}")
            }),
        }
    }
    let mut beyond: Vec<(String, u64)> = Vec::new();
    for (id, account) in ledger.accounts.iter_mut() {
        let moved = moved_by_account.remove(id).unwrap_or_default();
        let first_recent = account.entries.first().map_or(u64::MAX, |e| e.seq);
        let mut below = Vec::new();
        for e in moved {
            if e.seq < first_recent {
                below.push(e);
            } else if let Some(copy) = account.entries.iter().find(|r| r.seq == e.seq) {
                ledger.read.check(
                    "ledger: an entry moved to entries is the document's",
                    *copy == e,
                    || {
                        format!(
                            "{id} seq {}: in entries {}, in the document {}",
                            e.seq,
                            line(&e),
                            line(copy)
                        )
                    },
                );
            } else if e.seq > account.seq {
                beyond.push((id.clone(), e.seq));
            }
        }
        below.append(&mut account.entries);
        account.entries = below;
    }
    if !beyond.is_empty() {
        let ids: Vec<&str> = beyond.iter().map(|(id, _)| id.as_str()).collect();
        let again = find_all(
            db,
            "accounts",
            doc! { "_id": { "$in": ids } },
            doc! { "seq": 1 },
            None,
        )
        .await?;
        for (id, seq) in beyond {
            let now = again
                .iter()
                .find(|d| d.get_str("_id") == Ok(id.as_str()))
                .and_then(|d| d.get_i64("seq").ok());
            ledger.read.check(
                "ledger: no entry in entries beyond its account's seq",
                now.is_some_and(|now| now >= seq as i64),
                || format!("{id} seq {seq} is in entries, the account's seq is {now:?}"),
            );
        }
    }
    Ok(ledger)
}

/// Every document `filter` matches in `collection`, with `projection`, in `sort` order.
async fn find_all(
    db: &Database,
    collection: &str,
    filter: Document,
    projection: Document,
    sort: Option<Document>,
) -> mongodb::error::Result<Vec<Document>> {
    let collection = db.collection::<Document>(collection);
    let mut find = collection.find(filter).projection(projection);
    if let Some(sort) = sort {
        find = find.sort(sort);
    }
    let mut cursor = find.await?;
    let mut found = Vec::new();
    while cursor.advance().await? {
        found.push(cursor.deserialize_current()?);
    }
    Ok(found)
}

/// An account document: its amounts and `seq` (with no entries yet), and the entries in
/// its `recentEntries`.
fn parse_document(d: &Document) -> Result<(AccountLedger, Vec<Entry>), String> {
    let id = d
        .get_str("_id")
        .map_err(|e| format!("an account without a string _id ({e}): {d}"))?
        .to_owned();
    let int = |field: &str, absent: Option<i64>| match (d.get(field), absent) {
        (None, Some(absent)) => Ok(absent),
        _ => d
            .get_i64(field)
            .map_err(|e| format!("account {id}: {field} ({e})")),
    };
    let stored = Amounts {
        balance: int("balance", None)?,
        pending_debits: int("pendingDebits", Some(0))?,
        pending_credits: int("pendingCredits", Some(0))?,
    };
    let seq = u64::try_from(int("seq", None)?).map_err(|e| format!("account {id}: seq ({e})"))?;
    let recent = match d.get("recentEntries") {
        None => Vec::new(),
        Some(Bson::Array(recent)) => recent
            .iter()
            .map(|e| match e {
                Bson::Document(e) => parse_entry(&id, e),
                other => Err(format!("not a document: {other}")),
            })
            .collect::<Result<Vec<Entry>, String>>()
            .map_err(|e| format!("account {id}: recentEntries: {e}"))?,
        Some(other) => return Err(format!("account {id}: recentEntries is {other}")),
    };
    let account = AccountLedger {
        account: id,
        stored,
        seq,
        entries: Vec::new(),
    };
    Ok((account, recent))
}

/// A stored entry (in `recentEntries` or in `entries`) of `account`.
fn parse_entry(account: &str, d: &Document) -> Result<Entry, String> {
    let int = |field: &str| d.get_i64(field).map_err(|e| format!("{field} ({e})"));
    // In an account document a zero pending change or amount is left out.
    let pending = |field: &str| match d.get(field) {
        None => Ok(0),
        Some(_) => int(field),
    };
    let seq = u64::try_from(int("seq")?).map_err(|e| format!("seq ({e})"))?;
    let kind = d.get_str("k").map_err(|e| format!("k, the kind ({e})"))?;
    let kind = EntryKind::parse(kind).ok_or_else(|| format!("kind {kind:?}"))?;
    let transfer_id = match d.get("tx") {
        None | Some(Bson::Null) => None,
        Some(Bson::ObjectId(id)) => Some(TransferId::from_bytes(id.bytes())),
        Some(other) => return Err(format!("tx, the transfer id {other}")),
    };
    if let Some(Bson::String(stored)) = d.get("account") {
        if stored != account {
            return Err(format!("account {stored:?} in an entry of {account}"));
        }
    }
    Ok(Entry {
        account: transfer_service::domain::AccountId::parse(account)
            .map_err(|e| format!("account id {account:?} ({e:?})"))?,
        seq,
        kind,
        transfer_id,
        change: Amounts {
            balance: int("db")?,
            pending_debits: pending("dpd")?,
            pending_credits: pending("dpc")?,
        },
        after: Amounts {
            balance: int("b")?,
            pending_debits: pending("pd")?,
            pending_credits: pending("pc")?,
        },
        at: d
            .get_datetime("at")
            .map_err(|e| format!("at ({e})"))?
            .to_chrono(),
        carried_forward: d.get_bool("cf").unwrap_or(false),
    })
}

/// Amounts as every write must leave them: none negative, the available balance not
/// negative, and room for every reserved credit to land (`docs/holds.md`).
fn within_bounds(a: &Amounts) -> bool {
    a.balance >= 0
        && a.pending_debits >= 0
        && a.pending_credits >= 0
        && a.balance - a.pending_debits >= 0
        && a.balance
            .checked_add(a.pending_credits)
            .is_some_and(|s| s <= MAX_MONEY)
}

/// Amounts as a violation shows them: (balance, pendingDebits, pendingCredits).
fn amounts(a: &Amounts) -> String {
    format!(
        "({}, {}, {})",
        a.balance, a.pending_debits, a.pending_credits
    )
}

/// Changes as a violation shows them.
fn change(a: &Amounts) -> String {
    format!(
        "({:+}, {:+}, {:+})",
        a.balance, a.pending_debits, a.pending_credits
    )
}

/// An entry as a violation shows it: its number, kind and transfer, its changes, the
/// amounts it left and its time.
pub fn line(e: &Entry) -> String {
    format!(
        "seq {} {} {} -> {} at {}{}",
        e.seq,
        step(e),
        change(&e.change),
        amounts(&e.after),
        e.at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        if e.carried_forward {
            " (carried forward)"
        } else {
            ""
        }
    )
}

fn maybe_line(e: Option<&Entry>) -> String {
    e.map_or_else(|| "none".to_owned(), line)
}

/// An entry's kind and transfer, as a violation names them.
fn step(e: &Entry) -> String {
    match e.transfer_id {
        Some(t) => format!("{} of {t}", e.kind.as_str()),
        None => e.kind.as_str().to_owned(),
    }
}

fn show(kinds: &[EntryKind]) -> String {
    let names: Vec<&str> = kinds.iter().map(|k| k.as_str()).collect();
    format!("[{}]", names.join(", "))
}

/// Whether `kind` may follow `before`, the previous entry of the same transfer on the
/// same account (none: its first): a forward step first, then at most one undo, release
/// or capture of that very step. Anything else enters a step twice or out of order.
fn may_follow(before: Option<EntryKind>, kind: EntryKind) -> bool {
    use EntryKind::*;
    matches!(
        (before, kind),
        (None, Debit | Credit | DebitReserved | CreditReserved)
            | (Some(Debit), DebitUndone)
            | (Some(Credit), CreditUndone)
            | (Some(DebitReserved), DebitReleased | DebitCaptured)
            | (Some(CreditReserved), CreditReleased | CreditCaptured)
    )
}

/// The per-account invariants of the module doc, over every account of `ledger` (what
/// reading found included).
pub fn check_accounts(ledger: &Ledger) -> Findings {
    let mut f = ledger.read.clone();
    for account in ledger.accounts.values() {
        check_account(account, &mut f);
    }
    f
}

fn check_account(account: &AccountLedger, f: &mut Findings) {
    let id = &account.account;
    let entries = &account.entries;
    f.check(
        "ledger: an account has entries, its opening first",
        entries.first().is_some_and(|e| e.kind == EntryKind::Opened),
        || format!("{id}: first entry {}", maybe_line(entries.first())),
    );
    let mut previous: Option<&Entry> = None;
    // Per transfer, the kinds of its entries on this account so far.
    let mut steps: HashMap<TransferId, Vec<EntryKind>> = HashMap::new();
    for e in entries {
        let seq = e.seq;
        f.check(
            "ledger: entries numbered 1..n without gaps, each the previous plus its changes",
            e.follows(previous),
            || format!("{id}: {} does not follow {}", line(e), maybe_line(previous)),
        );
        if let Some(p) = previous {
            f.check("ledger: entry times never go back", e.at >= p.at, || {
                format!(
                    "{id} seq {seq} ({}) at {} before seq {} ({}) at {}",
                    step(e),
                    e.at,
                    p.seq,
                    step(p),
                    p.at
                )
            });
        }
        f.check(
            "ledger: amounts within their bounds after every entry",
            within_bounds(&e.after),
            || format!("{id}: {}", line(e)),
        );
        let opening = e.kind == EntryKind::Opened;
        f.check(
            "ledger: the first entry opens the account, every other names its transfer",
            opening == (previous.is_none()) && opening == e.transfer_id.is_none(),
            || format!("{id}: {}", line(e)),
        );
        if let Some(t) = e.transfer_id {
            let before = steps.entry(t).or_default();
            let again = before.contains(&e.kind);
            f.check(
                "ledger: no transfer step entered twice on an account",
                !again,
                || {
                    format!(
                        "{id} seq {seq}: {} of {t} again, after {}",
                        e.kind.as_str(),
                        show(before)
                    )
                },
            );
            if !again {
                f.check(
                    "ledger: an undo, a release or a capture only after its forward step",
                    may_follow(before.last().copied(), e.kind),
                    || {
                        format!(
                            "{id} seq {seq}: {} of {t} after {}",
                            e.kind.as_str(),
                            show(before)
                        )
                    },
                );
            }
            before.push(e.kind);
        }
        previous = Some(e);
    }
    let last = entries.last();
    f.check(
        "ledger: the last entry's amounts and seq are the account's",
        last.map(|e| (e.seq, e.after)) == Some((account.seq, account.stored))
            && entries.len() as u64 == account.seq,
        || {
            format!(
                "{id}: seq {} with {} stored; {} entries, the last {}",
                account.seq,
                amounts(&account.stored),
                entries.len(),
                maybe_line(last)
            )
        },
    );
}

/// Which account of a transfer an entry of `kind` is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    Source,
    Destination,
}

fn side_of(kind: EntryKind) -> Option<Side> {
    use EntryKind::*;
    match kind {
        Opened => None,
        Debit | DebitUndone | DebitReserved | DebitReleased | DebitCaptured => Some(Side::Source),
        Credit | CreditUndone | CreditReserved | CreditReleased | CreditCaptured => {
            Some(Side::Destination)
        }
    }
}

/// The entries `t` may have on `side` in its state, each allowed sequence of kinds
/// oldest first (`docs/protocol.md`, `docs/holds.md`). A plain transfer: its debit from
/// the start on, undone only by a rollback; its credit only on the way to `done` (the
/// credit lands after the commit point: a `credit_undone` is never expected). A hold: its
/// reservations, then their capture (`done`) or release (`canceled`; a rollback before
/// the destination's reservation releases the source's alone). An unfinished transfer
/// may be anywhere on the way to the ends its state leads to. Empty: no state a
/// transfer of its kind can be in.
pub fn expected_shapes(t: &Transfer, side: Side) -> &'static [&'static [EntryKind]] {
    use EntryKind::*;
    use TransferState::*;
    match (t.hold.is_some(), side, t.state) {
        (_, _, Initial) => &[&[]],
        (false, Side::Source, Pending) => &[&[], &[Debit]],
        (false, Side::Source, Applied | Done) => &[&[Debit]],
        (false, Side::Source, Canceling) => &[&[], &[Debit], &[Debit, DebitUndone]],
        (false, Side::Source, Canceled) => &[&[], &[Debit, DebitUndone]],
        (false, Side::Destination, Pending) => &[&[], &[Credit]],
        (false, Side::Destination, Applied | Done) => &[&[Credit]],
        (false, Side::Destination, Canceling | Canceled) => &[&[]],
        (true, Side::Source, Pending) => &[&[], &[DebitReserved]],
        (true, Side::Source, Held) => &[&[DebitReserved]],
        (true, Side::Source, Capturing) => &[&[DebitReserved], &[DebitReserved, DebitCaptured]],
        (true, Side::Source, Done) => &[&[DebitReserved, DebitCaptured]],
        (true, Side::Source, Canceling) => {
            &[&[], &[DebitReserved], &[DebitReserved, DebitReleased]]
        }
        (true, Side::Source, Canceled) => &[&[], &[DebitReserved, DebitReleased]],
        (true, Side::Destination, Pending) => &[&[], &[CreditReserved]],
        (true, Side::Destination, Held) => &[&[CreditReserved]],
        (true, Side::Destination, Capturing) => {
            &[&[CreditReserved], &[CreditReserved, CreditCaptured]]
        }
        (true, Side::Destination, Done) => &[&[CreditReserved, CreditCaptured]],
        (true, Side::Destination, Canceling) => {
            &[&[], &[CreditReserved], &[CreditReserved, CreditReleased]]
        }
        (true, Side::Destination, Canceled) => &[&[], &[CreditReserved, CreditReleased]],
        (false, _, Held | Capturing) | (true, _, Applied) => &[],
    }
}

/// What an entry of `kind` of `t` changes: a plain step moves `amount`; a reservation or
/// its release moves the held amount; a capture moves the captured `amount` and releases
/// the held one.
fn expected_change(t: &Transfer, kind: EntryKind) -> Amounts {
    use EntryKind::*;
    let v = t.amount.minor_units();
    let h = t.hold.map_or(0, |h| h.amount.minor_units());
    let (balance, pending_debits, pending_credits) = match kind {
        Opened => (0, 0, 0),
        Debit | CreditUndone => (-v, 0, 0),
        Credit | DebitUndone => (v, 0, 0),
        DebitReserved => (0, h, 0),
        CreditReserved => (0, 0, h),
        DebitReleased => (0, -h, 0),
        CreditReleased => (0, 0, -h),
        DebitCaptured => (-v, -h, 0),
        CreditCaptured => (v, 0, -h),
    };
    Amounts {
        balance,
        pending_debits,
        pending_credits,
    }
}

/// The per-transfer invariants of the module doc: every entry of `ledger` that names a
/// transfer names one of `transfers` and is on the side its kind belongs to, with the
/// transfer's amounts; every transfer has on each of its accounts the entries its state
/// calls for ([`expected_shapes`]), and a destination's only after its source's.
/// `transfers` are every transfer that may touch the accounts of `ledger`, read before it.
pub fn check_transfers(ledger: &Ledger, transfers: &[Transfer]) -> Findings {
    let (legs, one_leg): (Vec<&Transfer>, Vec<&Transfer>) =
        transfers.iter().partition(|t| t.legs.is_some());
    let one_leg: Vec<Transfer> = one_leg.into_iter().cloned().collect();
    let mut f = check_one_leg_transfers(ledger, &one_leg, &legs);
    f.extend(check_multi_leg_transfers(ledger, &legs));
    f
}

/// The entries a multi-leg transfer's party may have in the transfer's state, oldest
/// first (`docs/legs.md`): a paying party's debit from the start on, undone only by a
/// rollback; a receiving party's credit only after the commit point (`applied`), and
/// nothing else ever. A multi-leg hold's party: its reservation (on its side), then its
/// capture (`done`) or release (`canceled`), as a one-leg hold's account; a party whose
/// net is zero, none.
pub fn expected_party_shapes(
    paying: bool,
    hold: bool,
    net: i64,
    state: TransferState,
) -> &'static [&'static [EntryKind]] {
    use EntryKind::*;
    use TransferState::*;
    if hold {
        if net == 0 {
            return &[&[]];
        }
        let side = if paying {
            Side::Source
        } else {
            Side::Destination
        };
        return match (side, state) {
            (_, Initial) => &[&[]],
            (Side::Source, Pending) => &[&[], &[DebitReserved]],
            (Side::Source, Held) => &[&[DebitReserved]],
            (Side::Source, Capturing) => &[&[DebitReserved], &[DebitReserved, DebitCaptured]],
            (Side::Source, Done) => &[&[DebitReserved, DebitCaptured]],
            (Side::Source, Canceling) => &[&[], &[DebitReserved], &[DebitReserved, DebitReleased]],
            (Side::Source, Canceled) => &[&[], &[DebitReserved, DebitReleased]],
            (Side::Destination, Pending) => &[&[], &[CreditReserved]],
            (Side::Destination, Held) => &[&[CreditReserved]],
            (Side::Destination, Capturing) => {
                &[&[CreditReserved], &[CreditReserved, CreditCaptured]]
            }
            (Side::Destination, Done) => &[&[CreditReserved, CreditCaptured]],
            (Side::Destination, Canceling) => {
                &[&[], &[CreditReserved], &[CreditReserved, CreditReleased]]
            }
            (Side::Destination, Canceled) => &[&[], &[CreditReserved, CreditReleased]],
            (_, Applied) => &[],
        };
    }
    match (paying, state) {
        (_, Initial) => &[&[]],
        (true, Pending) => &[&[], &[Debit]],
        (true, Applied | Done) => &[&[Debit]],
        (true, Canceling) => &[&[], &[Debit], &[Debit, DebitUndone]],
        (true, Canceled) => &[&[], &[Debit, DebitUndone]],
        (false, Pending | Canceling | Canceled) => &[&[]],
        (false, Applied) => &[&[], &[Credit]],
        (false, Done) => &[&[Credit]],
        (_, Held | Capturing) => &[],
    }
}

/// [`check_transfers`] for multi-leg transfers: every entry naming one is on one of its
/// parties and changes the party's net (a debit, its undo, or a credit); every party has
/// the entries the transfer's state calls for ([`expected_party_shapes`]).
fn check_multi_leg_transfers(ledger: &Ledger, transfers: &[&Transfer]) -> Findings {
    use EntryKind::*;
    let mut f = Findings::default();
    let by_id: HashMap<TransferId, &Transfer> = transfers.iter().map(|t| (t.id, *t)).collect();
    let mut kinds: HashMap<(TransferId, &str), Vec<EntryKind>> = HashMap::new();
    for account in ledger.accounts.values() {
        let id = account.account.as_str();
        for e in &account.entries {
            let Some(t) = e.transfer_id.and_then(|tid| by_id.get(&tid)) else {
                continue;
            };
            let party = t
                .legs
                .as_deref()
                .and_then(|l| l.parties().iter().find(|p| p.account.as_str() == id));
            f.check(
                "ledger: a multi-leg transfer's entry is on one of its parties",
                party.is_some(),
                || {
                    format!(
                        "{id} seq {}: {} of {}, not a party",
                        e.seq,
                        e.kind.as_str(),
                        t.id
                    )
                },
            );
            let Some(party) = party else { continue };
            let (net, h) = (party.net, party.net.abs());
            let (balance, pending_debits, pending_credits) = match e.kind {
                Debit | Credit => (net, 0, 0),
                DebitUndone => (-net, 0, 0),
                DebitReserved => (0, h, 0),
                DebitCaptured => (net, -h, 0),
                DebitReleased => (0, -h, 0),
                CreditReserved => (0, 0, h),
                CreditCaptured => (net, 0, -h),
                CreditReleased => (0, 0, -h),
                _ => (i64::MIN, 0, 0),
            };
            let expected = Amounts {
                balance,
                pending_debits,
                pending_credits,
            };
            f.check(
                "ledger: an entry changes what its transfer moves",
                e.change == expected,
                || {
                    format!(
                        "{id}: {}, but the multi-leg transfer {} ({}) has a net of {} here",
                        line(e),
                        t.id,
                        t.state,
                        party.net
                    )
                },
            );
            kinds.entry((t.id, id)).or_default().push(e.kind);
        }
    }
    for t in transfers {
        let Some(legs) = t.legs.as_deref() else {
            continue;
        };
        for party in legs.parties() {
            let account = party.account.as_str();
            let found = kinds.get(&(t.id, account)).map_or(&[][..], Vec::as_slice);
            let shapes = expected_party_shapes(party.pays(), t.hold.is_some(), party.net, t.state);
            let read = ledger.accounts.contains_key(account);
            f.check(
                "ledger: a transfer has the entries its state calls for",
                read && shapes.contains(&found),
                || {
                    let shapes: Vec<String> = shapes.iter().map(|s| show(s)).collect();
                    format!(
                        "multi-leg transfer {} ({}{}) has {} on {account} (net {}){}, where its \
                         state calls for one of {}",
                        t.id,
                        t.state,
                        t.reason.map(|r| format!(", {r}")).unwrap_or_default(),
                        show(found),
                        party.net,
                        if read { "" } else { " (an account not read)" },
                        shapes.join(" or ")
                    )
                },
            );
        }
    }
    f
}

/// [`check_transfers`] for one-leg transfers and holds; entries of the multi-leg
/// transfers `others` are theirs to check.
fn check_one_leg_transfers(
    ledger: &Ledger,
    transfers: &[Transfer],
    others: &[&Transfer],
) -> Findings {
    let mut f = Findings::default();
    let by_id: HashMap<TransferId, &Transfer> = transfers.iter().map(|t| (t.id, t)).collect();
    let elsewhere: std::collections::HashSet<TransferId> = others.iter().map(|t| t.id).collect();
    // Per transfer and side, its entries' kinds, oldest first.
    let mut sides: HashMap<(TransferId, Side), Vec<EntryKind>> = HashMap::new();
    for account in ledger.accounts.values() {
        let id = &account.account;
        for e in &account.entries {
            let (Some(tid), Some(side)) = (e.transfer_id, side_of(e.kind)) else {
                continue;
            };
            if elsewhere.contains(&tid) {
                continue;
            }
            let t = by_id.get(&tid).copied();
            let on = t.map(|t| match side {
                Side::Source => t.source.as_str(),
                Side::Destination => t.destination.as_str(),
            });
            f.check(
                "ledger: an entry names a transfer of the log, on the account of its side",
                on == Some(id.as_str()),
                || match t {
                    None => format!(
                        "{id} seq {}: {} of {tid}, which no log has",
                        e.seq,
                        e.kind.as_str()
                    ),
                    Some(t) => format!(
                        "{id} seq {}: {} of {tid} ({} -> {}), an entry of its {side:?}",
                        e.seq,
                        e.kind.as_str(),
                        t.source,
                        t.destination
                    ),
                },
            );
            let Some(t) = t else { continue };
            let expected = expected_change(t, e.kind);
            f.check(
                "ledger: an entry changes what its transfer moves",
                e.change == expected,
                || {
                    format!(
                        "{id}: {}, but the transfer ({}, amount {}, held {:?}) calls for {}",
                        line(e),
                        t.state,
                        t.amount.minor_units(),
                        t.hold.map(|h| h.amount.minor_units()),
                        change(&expected),
                    )
                },
            );
            if on == Some(id.as_str()) {
                sides.entry((tid, side)).or_default().push(e.kind);
            }
        }
    }
    for t in transfers {
        for (side, account) in [
            (Side::Source, t.source.as_str()),
            (Side::Destination, t.destination.as_str()),
        ] {
            let kinds = sides.get(&(t.id, side)).map_or(&[][..], Vec::as_slice);
            let shapes = expected_shapes(t, side);
            let read = ledger.accounts.contains_key(account);
            f.check(
                "ledger: a transfer has the entries its state calls for",
                read && shapes.contains(&kinds),
                || {
                    let shapes: Vec<String> = shapes.iter().map(|s| show(s)).collect();
                    format!(
                        "{} {} ({}{}, {} -> {}) has {} on {account}{}, where its state calls for \
                         one of {}",
                        if t.hold.is_some() { "hold" } else { "transfer" },
                        t.id,
                        t.state,
                        t.reason.map(|r| format!(", {r}")).unwrap_or_default(),
                        t.source,
                        t.destination,
                        show(kinds),
                        if read { "" } else { " (an account not read)" },
                        shapes.join(" or ")
                    )
                },
            );
        }
        let source = sides.get(&(t.id, Side::Source)).map_or(0, Vec::len);
        let destination = sides.get(&(t.id, Side::Destination)).map_or(0, Vec::len);
        f.check(
            "ledger: a transfer's destination moves only after its source",
            destination == 0 || source > 0,
            || {
                format!(
                    "transfer {} ({}) has entries on its destination only",
                    t.id, t.state
                )
            },
        );
    }
    f
}

/// The sum of the latest balances is `total`, what the accounts were opened with.
pub fn check_conserved(ledger: &Ledger, total: i64) -> Findings {
    let mut f = Findings::default();
    let latest: i64 = ledger.accounts.values().map(|a| a.latest().balance).sum();
    f.check(
        "ledger: the sum of the latest balances is conserved",
        latest == total,
        || {
            let each: Vec<String> = ledger
                .accounts
                .values()
                .map(|a| format!("{} {}", a.account, a.latest().balance))
                .collect();
            format!(
                "the latest balances sum to {latest}, not {total}: {}",
                each.join(", ")
            )
        },
    );
    f
}

/// Every check of the module doc on a ledger read once nothing moves, with the
/// transfers read before it, whose accounts opened with `total` in all.
pub fn check_ledger(ledger: &Ledger, transfers: &[Transfer], total: i64) -> Findings {
    let mut f = check_accounts(ledger);
    f.extend(check_transfers(ledger, transfers));
    f.extend(check_conserved(ledger, total));
    f
}

/// What one account document says on its own, read in one go: its entries still in the
/// document are consecutive and each follows the one before, the last is numbered `seq`
/// and left the document's amounts, which are within their bounds. True at every moment,
/// whatever runs: the amounts, `seq` and the entry change in one write.
pub fn check_document(d: &Document) -> Findings {
    let mut f = Findings::default();
    let (account, recent) = match parse_document(d) {
        Ok(parsed) => parsed,
        Err(e) => {
            f.check("ledger: every document parses", false, || e);
            return f;
        }
    };
    let id = &account.account;
    for pair in recent.windows(2) {
        f.check(
            "ledger: a document's entries follow one another",
            pair[1].follows(Some(&pair[0])),
            || {
                format!(
                    "{id} seq {} does not follow seq {} in the document",
                    pair[1].seq, pair[0].seq
                )
            },
        );
    }
    // The entries not moved yet are the document's last ones: the last of them is its
    // `seq`, its amounts and its `lastEntryAt`. (With none left, [`sample_documents`]
    // finds the last in `entries`.)
    if let Some(last) = recent.last() {
        let last_at = d.get_datetime("lastEntryAt").ok().map(|t| t.to_chrono());
        f.check(
            "ledger: a document's last entry is its seq and its amounts, in one read",
            last.seq == account.seq && last.after == account.stored && last_at == Some(last.at),
            || {
                format!(
                    "{id}: seq {} and {} stored (last entry at {last_at:?}), last recent entry {}",
                    account.seq,
                    amounts(&account.stored),
                    line(last)
                )
            },
        );
    }
    f.check(
        "ledger: a document's amounts within their bounds",
        within_bounds(&account.stored),
        || format!("{id}: {}", amounts(&account.stored)),
    );
    f
}

/// Every account document of `db`, each checked on its own ([`check_document`]).
pub async fn sample_documents(db: &Database) -> mongodb::error::Result<Findings> {
    let documents = find_all(db, "accounts", doc! {}, ledger_projection(), None).await?;
    let mut f = Findings::default();
    for d in &documents {
        f.extend(check_document(d));
        // A document whose entries all moved: its last entry, in `entries` (copied
        // before it left the document, and never changed), left the amounts it holds.
        if let Ok((account, recent)) = parse_document(d) {
            if recent.is_empty() {
                let found = find_all(
                    db,
                    "entries",
                    doc! { "account": &account.account, "seq": account.seq as i64 },
                    doc! {},
                    None,
                )
                .await?;
                let last = found.first().map(|e| parse_entry(&account.account, e));
                f.check(
                    "ledger: a document's last entry is its seq and its amounts, in one read",
                    matches!(&last, Some(Ok(e)) if e.after == account.stored),
                    || {
                        format!(
                            "{}: seq {} and {} stored, its entry in `entries`: {last:?}",
                            account.account,
                            account.seq,
                            amounts(&account.stored)
                        )
                    },
                );
            }
        }
    }
    Ok(f)
}

/// An answer of `GET /accounts/{id}/balance`, with what the test knew around it.
#[derive(Debug, Clone)]
pub struct BalanceSeen {
    pub account: String,
    /// The moment the answer is for (its `at`: the one asked, or the database's time).
    pub at: Timestamp,
    /// The number of the last entry at or before `at`, and the amounts it left.
    pub seq: u64,
    pub amounts: Amounts,
    /// The account's `seq` read from its database right before the request was sent:
    /// every entry up to it existed when the service read...
    pub seq_before: u64,
    /// ...and right after the answer came: none after it did.
    pub seq_after: u64,
}

impl BalanceSeen {
    /// The answer `body` for `account`, between the two reads of its `seq`.
    pub fn from_answer(
        account: &str,
        body: &Value,
        seq_before: u64,
        seq_after: u64,
    ) -> Result<BalanceSeen, String> {
        let int = |field: &str| {
            body[field]
                .as_i64()
                .ok_or_else(|| format!("balance of {account}: no {field} in {body}"))
        };
        let at = body["at"]
            .as_str()
            .and_then(|at| DateTime::parse_from_rfc3339(at).ok())
            .ok_or_else(|| format!("balance of {account}: no at in {body}"))?
            .with_timezone(&Utc);
        let amounts = Amounts {
            balance: int("balance")?,
            pending_debits: int("pendingDebits")?,
            pending_credits: int("pendingCredits")?,
        };
        if body["account"] != account || int("availableBalance")? != amounts.available_balance() {
            return Err(format!("balance of {account}: {body}"));
        }
        Ok(BalanceSeen {
            account: account.to_owned(),
            at,
            seq: u64::try_from(int("seq")?).map_err(|e| e.to_string())?,
            amounts,
            seq_before,
            seq_after,
        })
    }
}

/// Whether an entry landed after the read, at or before the moment it was about: the
/// answer could not have counted it (a write whose `$$NOW` was taken before the read
/// and that landed after, or the same millisecond). Only entries after the answer's and
/// beyond `seq_before`.
pub fn landed_late(ledger: &Ledger, seen: &BalanceSeen) -> bool {
    ledger.accounts.get(&seen.account).is_some_and(|a| {
        a.entries.iter().any(|e| {
            e.seq > seen.seq.max(seen.seq_before) && e.seq <= seen.seq_after && e.at <= seen.at
        })
    })
}

/// A balance as of a moment against the entries, exactly: the entry it names is at or
/// before the moment and left the answered amounts (none: zeros, and the first entry is
/// after the moment); it is not beyond what existed after the answer; and the entry
/// after it, if it existed before the request, is after the moment. An entry after it at
/// or before the moment is allowed only if it may have landed after the read (numbered
/// beyond `seq_before`).
pub fn check_balance_at(ledger: &Ledger, seen: &BalanceSeen) -> Findings {
    let mut f = Findings::default();
    let id = &seen.account;
    let Some(account) = ledger.accounts.get(id) else {
        f.check(
            "ledger: a balance as of a time is what the entries say",
            false,
            || format!("{id}: no such account in the ledger read"),
        );
        return f;
    };
    let entry = |seq: u64| account.entries.iter().find(|e| e.seq == seq);
    let named = match seen.seq {
        0 => {
            account
                .entries
                .first()
                .is_none_or(|first| first.at > seen.at)
                && seen.amounts == Amounts::default()
        }
        seq => entry(seq).is_some_and(|e| e.at <= seen.at && e.after == seen.amounts),
    };
    let next_missed =
        seen.seq < seen.seq_before && entry(seen.seq + 1).is_some_and(|next| next.at <= seen.at);
    f.check(
        "ledger: a balance as of a time is what the entries say",
        named && seen.seq <= seen.seq_after && !next_missed,
        || {
            format!(
                "{id} as of {} answered seq {} with {} (seq {} before the request, {} after); \
                 the entries there: {}, then {}",
                seen.at,
                seen.seq,
                amounts(&seen.amounts),
                seen.seq_before,
                seen.seq_after,
                maybe_line(entry(seen.seq)),
                maybe_line(entry(seen.seq + 1))
            )
        },
    );
    f
}

/// An account's entries as the API answered them, with the checks of the paging.
#[derive(Debug, Clone)]
pub struct ApiEntries {
    pub entries: Vec<Entry>,
    pub paging: Findings,
}

/// Every entry of `account` through `GET /accounts/{id}/entries` on `base`, `limit` a
/// page, following `next` until an empty page; with the paging's own checks (each
/// page's `next` is its last entry's `seq`, null on the empty page; no page longer than
/// `limit`). `Err` when a request fails (not a 200): the caller may try again.
pub async fn read_via_api(
    http: &reqwest::Client,
    base: &str,
    account: &str,
    limit: u32,
) -> Result<ApiEntries, String> {
    /// Pages at most: bounds a reader that never sees an empty page.
    const MAX_PAGES: usize = 10_000;
    let mut f = Findings::default();
    let mut entries: Vec<Entry> = Vec::new();
    let mut after = 0_u64;
    for _ in 0..MAX_PAGES {
        let url = format!("{base}/accounts/{account}/entries?after={after}&limit={limit}");
        let response = http
            .get(&url)
            .send()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let status = response.status().as_u16();
        let page: Value = response.json().await.map_err(|e| format!("{url}: {e}"))?;
        if status != 200 {
            return Err(format!("{url}: {status} {page}"));
        }
        let items = page["items"].as_array().cloned().unwrap_or_default();
        let last = items.last().and_then(|e| e["seq"].as_u64());
        f.check(
            "ledger: a page of entries names its last as next, and holds at most limit",
            page["next"].as_str().and_then(|n| n.parse::<u64>().ok()) == last
                && items.len() <= limit as usize,
            || {
                format!(
                    "{url}: {} items, last seq {last:?}, next {}",
                    items.len(),
                    page["next"]
                )
            },
        );
        if items.is_empty() {
            return Ok(ApiEntries { entries, paging: f });
        }
        for item in &items {
            entries.push(entry_from_json(account, item)?);
        }
        after = last.unwrap_or(after + items.len() as u64);
    }
    Err(format!("{account}: more than {MAX_PAGES} pages of entries"))
}

/// An entry as the API shows it.
fn entry_from_json(account: &str, e: &Value) -> Result<Entry, String> {
    let bad = || format!("entry of {account}: {e}");
    let int = |field: &str| e[field].as_i64().ok_or_else(bad);
    let transfer_id = match &e["transferId"] {
        Value::Null => None,
        Value::String(id) => Some(TransferId::parse(id).map_err(|_| bad())?),
        _ => return Err(bad()),
    };
    let after = Amounts {
        balance: int("balance")?,
        pending_debits: int("pendingDebits")?,
        pending_credits: int("pendingCredits")?,
    };
    if e["account"] != account || int("availableBalance")? != after.available_balance() {
        return Err(bad());
    }
    Ok(Entry {
        account: transfer_service::domain::AccountId::parse(account).map_err(|_| bad())?,
        seq: e["seq"].as_u64().ok_or_else(bad)?,
        kind: e["kind"]
            .as_str()
            .and_then(EntryKind::parse)
            .ok_or_else(bad)?,
        transfer_id,
        change: Amounts {
            balance: int("balanceChange")?,
            pending_debits: int("pendingDebitsChange")?,
            pending_credits: int("pendingCreditsChange")?,
        },
        after,
        at: e["at"]
            .as_str()
            .and_then(|at| DateTime::parse_from_rfc3339(at).ok())
            .ok_or_else(bad)?
            .with_timezone(&Utc),
        carried_forward: e["carriedForward"].as_bool().unwrap_or(false),
    })
}

/// The entries the API gave for `account` are those of `ledger`, read from the database
/// once nothing moved any more: the same entries, in the same order.
pub fn check_same_entries(ledger: &Ledger, account: &str, api: &[Entry]) -> Findings {
    let mut f = Findings::default();
    let stored = ledger
        .accounts
        .get(account)
        .map_or(&[][..], |a| a.entries.as_slice());
    let differs = stored
        .iter()
        .zip(api)
        .find(|(s, a)| s != a)
        .map(|(s, a)| format!("stored {}, answered {}", line(s), line(a)));
    f.check(
        "ledger: the API's entries are the stored ones",
        stored.len() == api.len() && differs.is_none(),
        || {
            format!(
                "{account}: {} stored, {} answered; {}",
                stored.len(),
                api.len(),
                differs.unwrap_or_else(|| "the shorter is a prefix of the longer".into())
            )
        },
    );
    f
}
