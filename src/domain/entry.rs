//! Ledger entries: every change to an account's `balance`, `pendingDebits` or
//! `pendingCredits`, numbered per account from 1 with no gap and no repeat, with the
//! values it left (see `docs/ledger.md`).
//!
//! Invariants, kept by the store's writes (each entry is decided in the same
//! single-document write that changes the amounts):
//! - an account's entries are numbered `1..=seq`, `seq` being the account's own;
//! - each entry's values are the previous entry's (zeros before the first) plus its
//!   changes ([`Entry::follows`]);
//! - the last entry's values are the account's stored values;
//! - `at` never goes back from one entry of an account to the next.

use serde::{Deserialize, Serialize};

use super::{AccountId, Timestamp, TransferId};

/// What changed an account: the step of the protocol (or the opening) behind an entry.
/// Its stored and API name is [`EntryKind::as_str`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    /// The account was opened with its opening balance (0 included). The entry a
    /// migration gives an account opened before entries existed is also `opened`,
    /// marked [`Entry::carried_forward`].
    Opened,
    /// A transfer's debit of the source (step 3).
    Debit,
    /// A transfer's credit of the destination (step 4).
    Credit,
    /// A rollback gave the source its debit back.
    DebitUndone,
    /// A rollback took a credit back from the destination (never expected: the credit
    /// is the commit point).
    CreditUndone,
    /// A hold reserved money out of the source (`pendingDebits`).
    DebitReserved,
    /// A hold reserved room in the destination (`pendingCredits`).
    CreditReserved,
    /// A void, an expiry or a rollback released the source's reservation.
    DebitReleased,
    /// A void, an expiry or a rollback released the destination's reservation.
    CreditReleased,
    /// A capture took the captured amount out of the source and released its
    /// reservation.
    DebitCaptured,
    /// A capture paid the captured amount into the destination and released its
    /// reservation.
    CreditCaptured,
}

impl EntryKind {
    pub const ALL: [EntryKind; 11] = [
        EntryKind::Opened,
        EntryKind::Debit,
        EntryKind::Credit,
        EntryKind::DebitUndone,
        EntryKind::CreditUndone,
        EntryKind::DebitReserved,
        EntryKind::CreditReserved,
        EntryKind::DebitReleased,
        EntryKind::CreditReleased,
        EntryKind::DebitCaptured,
        EntryKind::CreditCaptured,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EntryKind::Opened => "opened",
            EntryKind::Debit => "debit",
            EntryKind::Credit => "credit",
            EntryKind::DebitUndone => "debit_undone",
            EntryKind::CreditUndone => "credit_undone",
            EntryKind::DebitReserved => "debit_reserved",
            EntryKind::CreditReserved => "credit_reserved",
            EntryKind::DebitReleased => "debit_released",
            EntryKind::CreditReleased => "credit_released",
            EntryKind::DebitCaptured => "debit_captured",
            EntryKind::CreditCaptured => "credit_captured",
        }
    }

    pub fn parse(s: &str) -> Option<EntryKind> {
        EntryKind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// An account's three amounts, or the changes an entry made to them, in minor units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Amounts {
    pub balance: i64,
    pub pending_debits: i64,
    pub pending_credits: i64,
}

impl Amounts {
    /// `balance - pendingDebits`: what the account may spend.
    pub fn available_balance(&self) -> i64 {
        self.balance - self.pending_debits
    }

    /// These amounts after `change`, or `None` if a sum leaves `i64`.
    pub fn plus(&self, change: &Amounts) -> Option<Amounts> {
        Some(Amounts {
            balance: self.balance.checked_add(change.balance)?,
            pending_debits: self.pending_debits.checked_add(change.pending_debits)?,
            pending_credits: self.pending_credits.checked_add(change.pending_credits)?,
        })
    }
}

/// One numbered change to an account.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub account: AccountId,
    /// 1 for the opening, then one more for each change, without gaps.
    pub seq: u64,
    pub kind: EntryKind,
    /// The transfer whose step made the change; none for [`EntryKind::Opened`].
    pub transfer_id: Option<TransferId>,
    /// What the change added to each amount.
    pub change: Amounts,
    /// The amounts it left.
    pub after: Amounts,
    /// The database's time when the change landed (never before the previous entry's).
    pub at: Timestamp,
    /// Set on the `opened` entry a migration gave an account opened before entries
    /// existed: it carries the account's amounts as they were then, at the migration's
    /// time, not the account's real opening.
    pub carried_forward: bool,
}

impl Entry {
    /// Whether this entry follows `previous` (none: this is the first): the next number,
    /// and the previous values (zeros before the first) plus its changes.
    pub fn follows(&self, previous: Option<&Entry>) -> bool {
        let (seq, before) = match previous {
            Some(p) => (p.seq, p.after),
            None => (0, Amounts::default()),
        };
        self.seq == seq + 1 && before.plus(&self.change) == Some(self.after)
    }
}

/// An account's amounts as of a moment: after its last entry whose `at` is not later
/// than the moment (`seq` 0 and zeros before its first).
#[derive(Debug, Clone, PartialEq)]
pub struct BalanceAt {
    pub account: AccountId,
    /// The moment asked about.
    pub at: Timestamp,
    /// The number of the last entry at or before `at`; 0 before the opening.
    pub seq: u64,
    pub amounts: Amounts,
    /// Whether a later read may answer otherwise for the same moment.
    pub finality: Finality,
}

/// Whether an answer about a moment can still change (`docs/ledger.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finality {
    /// The deployment's clock has passed the moment by the margin: no entry can be
    /// stamped at or before it any more, so the same question gets the same answer.
    Final,
    /// The moment is now, in the future, or within the margin of the deployment's clock:
    /// an entry still in flight, or stamped by a member whose clock is behind after a
    /// failover, may yet land at or before it.
    Provisional,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64, change: (i64, i64, i64), after: (i64, i64, i64)) -> Entry {
        Entry {
            account: AccountId::parse("alice").unwrap(),
            seq,
            kind: EntryKind::Debit,
            transfer_id: None,
            change: Amounts {
                balance: change.0,
                pending_debits: change.1,
                pending_credits: change.2,
            },
            after: Amounts {
                balance: after.0,
                pending_debits: after.1,
                pending_credits: after.2,
            },
            at: crate::domain::now(),
            carried_forward: false,
        }
    }

    #[test]
    fn an_entry_follows_only_the_entry_before_it_with_its_changes_added() {
        let opened = entry(1, (100, 0, 0), (100, 0, 0));
        assert!(opened.follows(None));
        let reserved = entry(2, (0, 30, 0), (100, 30, 0));
        assert!(reserved.follows(Some(&opened)));
        // A gap, a repeat, or values that are not the sum.
        assert!(!entry(3, (0, 30, 0), (100, 30, 0)).follows(Some(&opened)));
        assert!(!entry(1, (0, 30, 0), (100, 30, 0)).follows(Some(&opened)));
        assert!(!entry(2, (0, 30, 0), (100, 31, 0)).follows(Some(&opened)));
        assert!(!entry(2, (100, 0, 0), (100, 0, 0)).follows(None));
    }

    #[test]
    fn every_kind_has_one_name_that_parses_back() {
        for kind in EntryKind::ALL {
            assert_eq!(EntryKind::parse(kind.as_str()), Some(kind));
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.as_str()));
        }
        assert_eq!(EntryKind::parse("refund"), None);
    }
}
