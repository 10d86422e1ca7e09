//! The guards and stamps the protocol's writes carry, each written once and used by the
//! single-document write and by its group-committed form ([`super::batch`]) alike:
//! - [`forward_step_allowed`]: when a debit or credit may land on an account;
//! - [`owned_by`]: who may move a transfer in a state change of its owner;
//! - [`stamped`], [`stamped_unset`]: `lastModified` only ever moves forward.

use mongodb::bson::{Bson, DateTime, Document, doc};

use crate::domain::{MAX_MONEY, TransferState};

/// The guards of a forward step (a debit or a credit) of transfer `tx`, as an aggregation
/// expression: the step lands only if `tx` is neither applied here (its marker in
/// `markers`) nor fenced by a cancel, the balance (`balance`, before the step) plus
/// `delta` stays within 0..=`MAX_MONEY`, and the server's clock has not reached
/// `deadline`, the end of the lease of whoever sent it.
///
/// The arguments are expressions: the single-document write passes the account's own
/// fields and the step's values; the batched pipeline passes the balance and markers as
/// the batch's earlier steps left them, and the step from its table.
pub(super) fn forward_step_allowed(
    balance: impl Into<Bson>,
    markers: impl Into<Bson>,
    tx: impl Into<Bson>,
    delta: impl Into<Bson>,
    deadline: impl Into<Bson>,
) -> Document {
    let tx = tx.into();
    let new_balance = balance_after(balance, delta);
    doc! { "$and": [
        { "$not": [{ "$in": [tx.clone(), markers.into()] }] },
        { "$not": [{ "$in": [tx, { "$ifNull": ["$fencedTransactions", []] }] }] },
        { "$gte": [new_balance.clone(), 0_i64] },
        { "$lte": [new_balance, MAX_MONEY] },
        { "$lt": ["$$NOW", deadline.into()] },
    ] }
}

/// The balance a forward step leaves, as an aggregation expression over the same
/// arguments as [`forward_step_allowed`].
pub(super) fn balance_after(balance: impl Into<Bson>, delta: impl Into<Bson>) -> Document {
    doc! { "$add": [balance.into(), delta.into()] }
}

/// The update that sets `fields` and stamps the transfer at `at`, a lower bound of the
/// database's clock taken before the write was sent (see [`super::clock`]):
/// `lastModified` moves forward to it, never back. Every write that starts or renews a
/// lease goes through here, so leases are judged by the database's clock alone, and the
/// writer knows the stamp it left without reading it back.
pub(super) fn stamped(fields: Document, at: DateTime) -> Document {
    let mut update = doc! { "$max": { "lastModified": at } };
    if !fields.is_empty() {
        update.insert("$set", fields);
    }
    update
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
