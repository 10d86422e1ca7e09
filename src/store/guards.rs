//! The guards and stamps the protocol's writes carry, each written once and used by the
//! single-document write and by its group-committed form (`batch.rs`) alike:
//! - [`forward_step_allowed`]: when a debit, a credit or a hold's reservation may land
//!   on an account;
//! - [`owned_by`]: who may move a transfer in a state change of its owner;
//! - [`stamped`], [`stamped_unset`]: `lastModified` only ever moves forward;
//! - [`moved`], [`due`]: a write that makes a transfer `held`, `done` or `canceled`
//!   marks its event due in the same write (`store::marks`).

use mongodb::bson::{Bson, DateTime, Document, doc};

use super::documents::EventDue;
use super::fields::{account, event_due, path, transfer};
use crate::domain::{EventType, MAX_MONEY, TransferState};

/// An account's three amounts, or a forward step's changes to them, as aggregation
/// expressions (see `docs/holds.md`).
#[derive(Debug, Clone)]
pub(super) struct Amounts {
    pub balance: Bson,
    /// `pendingDebits`: the holds out of the account.
    pub debits: Bson,
    /// `pendingCredits`: the holds into the account.
    pub credits: Bson,
    /// `incoming`: the room multi-leg transfers prepared for what they will pay in
    /// (`docs/legs.md`). No amount of the account, and no entry, shows it.
    pub incoming: Bson,
}

impl Amounts {
    /// The account's own fields; an account opened before holds has neither pending
    /// field, which counts as zero.
    pub fn stored() -> Amounts {
        Amounts {
            balance: path(account::BALANCE).into(),
            debits: doc! { "$ifNull": [path(account::PENDING_DEBITS), 0_i64] }.into(),
            credits: doc! { "$ifNull": [path(account::PENDING_CREDITS), 0_i64] }.into(),
            incoming: doc! { "$ifNull": [path(account::INCOMING), 0_i64] }.into(),
        }
    }

    /// A change of the three amounts, none of the room.
    pub fn change(balance: i64, debits: i64, credits: i64) -> Amounts {
        Amounts {
            balance: balance.into(),
            debits: debits.into(),
            credits: credits.into(),
            incoming: 0_i64.into(),
        }
    }

    /// What `change` leaves.
    pub fn after(&self, change: &Amounts) -> Amounts {
        let add = |a: &Bson, b: &Bson| Bson::from(doc! { "$add": [a.clone(), b.clone()] });
        Amounts {
            balance: add(&self.balance, &change.balance),
            debits: add(&self.debits, &change.debits),
            credits: add(&self.credits, &change.credits),
            incoming: add(&self.incoming, &change.incoming),
        }
    }
}

/// The guards of a forward step of transfer `tx` (a debit, a credit, or a hold's
/// reservation out or in, or a multi-leg transfer's prepare), as an aggregation
/// expression: the step lands only if `tx` is neither applied here (its marker in
/// `markers`) nor fenced by a cancel, the account keeps both its invariants after
/// `change` (the available balance, `balance - pendingDebits`, not below zero; `balance +
/// pendingCredits + incoming` not above `MAX_MONEY`, so that every hold into it can be
/// captured and every multi-leg transfer prepared here can pay in), and the server's clock has not reached
/// `deadline`, the end of the lease of whoever sent it.
///
/// The arguments are expressions: the single-document write passes the account's own
/// fields and the step's values; the batched pipeline passes the amounts and markers as
/// the batch's earlier steps left them, and the step from its table.
pub(super) fn forward_step_allowed(
    before: &Amounts,
    markers: impl Into<Bson>,
    tx: impl Into<Bson>,
    change: &Amounts,
    deadline: impl Into<Bson>,
) -> Document {
    let tx = tx.into();
    let after = before.after(change);
    doc! { "$and": [
        { "$not": [{ "$in": [tx.clone(), markers.into()] }] },
        { "$not": [{ "$in": [tx, { "$ifNull": [path(account::FENCED), []] }] }] },
        { "$gte": [{ "$subtract": [after.balance.clone(), after.debits] }, 0_i64] },
        // Only a change that adds to the sum is held to MAX_MONEY: an undo may leave an
        // account above it (a debit given back after room was made meanwhile), and its
        // debits must not be refused for that.
        { "$or": [
            { "$lte": [{ "$add": [change.balance.clone(), change.credits.clone(), change.incoming.clone()] }, 0_i64] },
            { "$lte": [{ "$add": [after.balance, after.credits, after.incoming] }, MAX_MONEY] },
        ] },
        { "$lt": ["$$NOW", deadline.into()] },
    ] }
}

/// The update that sets `fields` and stamps the transfer at `at`, a lower bound of the
/// database's clock taken before the write was sent (see [`super::clock`]):
/// `lastModified` moves forward to it, never back. Every write that starts or renews a
/// lease goes through here, so leases are judged by the database's clock alone, and the
/// writer knows the stamp it left without reading it back.
pub(super) fn stamped(fields: Document, at: DateTime) -> Document {
    let mut update = doc! { "$max": { transfer::LAST_MODIFIED: at } };
    if !fields.is_empty() {
        update.insert("$set", fields);
    }
    update
}

/// [`stamped`] for a state change to `to` that sets `fields` too (the new state among
/// them): when `to` has an event, the write marks it due (`eventsDue`), so that the
/// recorder finds it however the change was made.
pub(super) fn moved(to: TransferState, fields: Document, at: DateTime) -> Document {
    let mut update = stamped(fields, at);
    if let Some(due) = due(to, at) {
        update.insert("$push", doc! { transfer::EVENTS_DUE: due_doc(&due) });
    }
    update
}

/// The event a document written in `to` at `at` makes due, if `to` has one.
pub(super) fn due(to: TransferState, at: DateTime) -> Option<EventDue> {
    EventType::of_state(to).map(|kind| EventDue {
        kind: kind.as_str().to_owned(),
        at,
        balance: None,
    })
}

/// `due` as an element of `eventsDue`.
pub(super) fn due_doc(due: &EventDue) -> Document {
    let mut stored = doc! { event_due::TYPE: &due.kind, event_due::AT: due.at };
    if let Some(balance) = due.balance {
        stored.insert(event_due::BALANCE, balance);
    }
    stored
}

/// [`stamped`] for a write that removes `fields`.
pub(super) fn stamped_unset(fields: &[&str], at: DateTime) -> Document {
    let mut update = stamped(doc! {}, at);
    let unset: Document = fields
        .iter()
        .map(|f| (f.to_string(), Bson::from("")))
        .collect();
    update.insert("$unset", unset);
    update
}

/// The `application` condition of an owner's state change: `owner`, or, for a transfer
/// still `initial`, nobody yet.
pub(super) fn owned_by(owner: &str, from: TransferState) -> Document {
    if from == TransferState::Initial {
        doc! { "$in": [Bson::Null, owner] }
    } else {
        doc! { "$eq": owner }
    }
}
