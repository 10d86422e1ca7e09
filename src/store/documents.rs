//! The stored shapes of `accounts`, their entries and `transactions`, named as in the MongoDB tutorial
//! so that anyone who read it recognises them, and their conversions to and from the
//! domain's [`Transfer`] and [`Account`]; and the stored form of an idempotency key in
//! its scope ([`stored_key`]). These are storage types and never leave the store: the
//! schema and the domain (and the API built on it) change independently.

use mongodb::bson::DateTime;
use mongodb::bson::oid::ObjectId;
use serde::{Deserialize, Serialize};

use super::{StoreError, StoreResult};
use crate::domain::{
    Account, AccountId, AccountName, Amount, ApiKeyId, CancelReason, Currency, DeploymentName,
    EntryKind, Hold, IdempotencyKey, KeyScope, Leg, Legs, ParseError, Reference, ScopedKey,
    TenantName, Tenants, Timestamp, Transfer, TransferId, TransferState,
};

/// How an idempotency key is stored: the `_id` of its `idempotencyKeys` record and the
/// `idempotencyKey` of its transfer. A shared key is stored as sent, as every key was
/// before keys were scoped by API key (so nothing changes without `API_KEYS`); a key of
/// an API key as `<api key id> <key>`. A key is visible ASCII and never holds a space,
/// so the scoped form never equals a shared key, and splits back at its space.
pub fn stored_key(key: &ScopedKey) -> String {
    match &key.scope {
        KeyScope::Shared => key.key.as_str().to_owned(),
        KeyScope::ApiKey(id) => format!("{id} {}", key.key.as_str()),
    }
}

/// The key a [`stored_key`] form stands for.
pub fn scoped_key(stored: &str) -> Result<ScopedKey, ParseError> {
    Ok(match stored.split_once(' ') {
        None => ScopedKey::shared(IdempotencyKey::parse(stored)?),
        Some((id, key)) => ScopedKey {
            scope: KeyScope::ApiKey(ApiKeyId::parse(id)?),
            key: IdempotencyKey::parse(key)?,
        },
    })
}

/// A document of `accounts`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AccountDoc {
    /// The client's account id (see `domain::AccountId`).
    #[serde(rename = "_id")]
    pub id: String,
    /// The tenant that owns the account (`docs/tenants.md`); absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Minor units, always an Int64 in BSON.
    pub balance: i64,
    /// The sum of live holds out of the account (absent on accounts opened before holds:
    /// zero).
    #[serde(default)]
    pub pending_debits: i64,
    /// The sum of live holds into the account (absent before holds: zero).
    #[serde(default)]
    pub pending_credits: i64,
    /// The room multi-leg transfers prepared here and have not paid in yet
    /// (`docs/legs.md`; absent: zero).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub incoming: i64,
    pub currency: String,
    /// Transfers applied to this account whose markers are not pulled yet. A transfer's
    /// id here is what makes applying it a second time a no-op.
    pub pending_transactions: Vec<ObjectId>,
    /// Transfers canceled while pending: their forward steps are refused here, so that a
    /// step still in flight when the cancel ran cannot land after the rollback.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fenced_transactions: Vec<ObjectId>,
    /// The number of the account's last ledger entry (see `store::entries`; 0 on an
    /// account no migration has given entries yet).
    #[serde(default)]
    pub seq: i64,
    /// The account's entries not moved to `entries` yet, oldest first (see
    /// `store::entries`); left out of the reads of the account itself.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recent_entries: Vec<EntryDoc>,
    /// The time of the account's last entry, which the next must not precede.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_entry_at: Option<DateTime>,
    pub created_at: DateTime,
    pub updated_at: DateTime,
    /// `account.opened` until the recorder records it (see [`TransferDoc::events_due`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events_due: Vec<EventDue>,
}

/// An entry as stored, in an account's `recentEntries` and in `entries` (which adds
/// `account`). Its keys are short (`docs/ledger.md` names each): every entry is written
/// into a document that every later step on the account rewrites until it is moved, so
/// its bytes are paid on the hot path; the API names them in full. In the document a
/// zero pending change or amount is left out (`entries::unless_zero`); `entries` has them all.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EntryDoc {
    /// In `entries` only: the account the entry belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
    pub seq: i64,
    #[serde(rename = "k")]
    pub kind: EntryKind,
    #[serde(rename = "tx", default, skip_serializing_if = "Option::is_none")]
    pub transfer_id: Option<ObjectId>,
    /// The changes: to `balance`, `pendingDebits`, `pendingCredits`.
    #[serde(rename = "db")]
    pub balance_change: i64,
    #[serde(rename = "dpd", default)]
    pub pending_debits_change: i64,
    #[serde(rename = "dpc", default)]
    pub pending_credits_change: i64,
    /// The amounts after it.
    #[serde(rename = "b")]
    pub balance: i64,
    #[serde(rename = "pd", default)]
    pub pending_debits: i64,
    #[serde(rename = "pc", default)]
    pub pending_credits: i64,
    pub at: DateTime,
    #[serde(rename = "cf", default, skip_serializing_if = "std::ops::Not::not")]
    pub carried_forward: bool,
}

/// A document of `transactions`: one transfer and where it is in the protocol.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TransferDoc {
    #[serde(rename = "_id")]
    pub id: ObjectId,
    pub source: String,
    pub destination: String,
    /// The deployment of the destination account, when it is not the one that keeps this
    /// document. Nothing names the source's: a transfer is logged where its source lives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_deployment: Option<String>,
    /// The tenants of its accounts (`docs/tenants.md`), in name order; absent: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<String>,
    /// The amount in minor units (the tutorial's name).
    pub value: i64,
    pub currency: String,
    /// One of `initial`, `pending`, `applied`, `done`, `canceling`, `canceled`, and for
    /// a hold `held`, `capturing`.
    pub state: TransferState,
    /// A hold's reserved amount (`value` is the captured one once captured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_amount: Option<i64>,
    /// When an uncaptured hold expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<DateTime>,
    /// When the state last changed; the sweeper's staleness clock.
    pub last_modified: DateTime,
    pub created_at: DateTime,
    /// The instance that owns the transfer (the tutorial's multi-application marker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub application: Option<String>,
    /// Why it ended `canceled`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<CancelReason>,
    /// The account that refused a multi-leg transfer's step, with `reason`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused_account: Option<String>,
    /// A multi-leg transfer's legs, as sent (`docs/legs.md`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub legs: Option<Vec<LegDoc>>,
    /// A multi-leg transfer's parties: each account once, with its net change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parties: Option<Vec<PartyDoc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// SHA-256 of the request that created the transfer, to tell a retry from a reuse of
    /// its idempotency key with another body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_hash: Option<String>,
    /// Set on a compensating transfer: the transfer it reverses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reverses: Option<ObjectId>,
    /// Set on a reversed transfer: its compensating transfer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reversed_by: Option<ObjectId>,
    /// True once a cancel fenced the accounts against this transfer's forward steps,
    /// until the sweeper drops the fences.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fenced: bool,
    /// True from the claim of a reversal (`reversedBy`) until its compensation is `done`,
    /// so that the sweeper finishes a reversal whose instance crashed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reversing: bool,
    /// The events of this transfer's state changes not in the feed yet: each write that
    /// makes it `held`, `done` or `canceled` adds one, and the recorder takes it off once
    /// the event is recorded (`store::marks`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events_due: Vec<EventDue>,
}

/// An event a document's write made due (`eventsDue`): its type, and the stamp of the
/// write (the event's `at`; a `held` event's transfer is turned back to it).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EventDue {
    #[serde(rename = "type")]
    pub kind: String,
    pub at: DateTime,
    /// An account's opening balance (`account.opened`): the event shows the account as
    /// it was opened, whatever moved it before the event is recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balance: Option<i64>,
}

/// A stored leg of a multi-leg transfer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LegDoc {
    pub source: String,
    pub destination: String,
    pub value: i64,
}

/// A stored party of a multi-leg transfer: an account, its net change over the legs,
/// and its deployment when it is not the log's.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PartyDoc {
    pub account: String,
    pub net: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployment: Option<String>,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// A new transfer id, in the form the log stores it (an ObjectId, growing with time, so
/// that the newest-first listing is an index walk).
pub fn new_transfer_id() -> TransferId {
    transfer_id(ObjectId::new())
}

pub fn object_id(id: TransferId) -> ObjectId {
    ObjectId::from_bytes(id.bytes())
}

pub fn transfer_id(id: ObjectId) -> TransferId {
    TransferId::from_bytes(id.bytes())
}

pub fn stored_time(at: Timestamp) -> DateTime {
    DateTime::from_chrono(at)
}

/// A stored value the domain refuses: a document written by hand, or by a version that
/// allowed what this one does not. Said as what it is, for the log; the caller answers 500.
fn corrupt(
    collection: &str,
    id: &dyn std::fmt::Display,
    field: &str,
    why: impl std::fmt::Display,
) -> StoreError {
    StoreError::Malformed(format!("{collection} {id}: stored {field} is not valid: {why}").into())
}

impl From<&Transfer> for TransferDoc {
    fn from(t: &Transfer) -> TransferDoc {
        TransferDoc {
            id: object_id(t.id),
            source: t.source.to_string(),
            destination: t.destination.to_string(),
            destination_deployment: (t.destination_deployment != t.source_deployment)
                .then(|| t.destination_deployment.to_string()),
            tenants: t.tenants.names().iter().map(|n| n.to_string()).collect(),
            value: t.amount.minor_units(),
            currency: t.currency.to_string(),
            state: t.state,
            held_amount: t.hold.map(|h| h.amount.minor_units()),
            expires_at: t.hold.map(|h| stored_time(h.expires_at)),
            last_modified: stored_time(t.last_modified),
            created_at: stored_time(t.created_at),
            application: t.owner.clone(),
            reason: t.reason,
            refused_account: t.refused_account.as_ref().map(|a| a.to_string()),
            legs: t.legs.as_ref().map(|legs| {
                legs.legs()
                    .iter()
                    .map(|l| LegDoc {
                        source: l.source.to_string(),
                        destination: l.destination.to_string(),
                        value: l.amount.minor_units(),
                    })
                    .collect()
            }),
            // Every transfer's, but one inserted before one protocol, which has none.
            parties: (t.legs.is_some() || !t.credits_at_prepare).then(|| {
                t.parties()
                    .iter()
                    .map(|p| PartyDoc {
                        account: p.account.to_string(),
                        net: p.net,
                        deployment: (p.deployment != t.source_deployment)
                            .then(|| p.deployment.to_string()),
                    })
                    .collect()
            }),
            reference: t.reference.as_ref().map(|r| r.as_str().to_owned()),
            idempotency_key: t.idempotency_key.as_ref().map(stored_key),
            request_hash: t.request_hash.clone(),
            reverses: t.reverses.map(object_id),
            reversed_by: t.reversed_by.map(object_id),
            fenced: t.fenced,
            reversing: t.reversing,
            events_due: Vec::new(),
        }
    }
}

/// A stored document and the domain value it becomes, read from the deployment `here`.
pub trait Stored: Sized {
    type Domain;
    fn into_domain(self, here: &DeploymentName) -> StoreResult<Self::Domain>;
}

impl Stored for TransferDoc {
    type Domain = Transfer;

    /// The log of `here` keeps transfers out of its accounts: the source is `here`, and
    /// so is the destination unless the document names another deployment.
    fn into_domain(self, here: &DeploymentName) -> StoreResult<Transfer> {
        let d = self;
        let bad = |field: &str, why: ParseError| corrupt("transfer", &d.id, field, why);
        let hold = stored_hold(&d)?;
        let destination_deployment = match &d.destination_deployment {
            Some(name) => {
                DeploymentName::parse(name).map_err(|e| bad("destinationDeployment", e))?
            }
            None => here.clone(),
        };
        let legs = stored_legs(&d, here)?;
        // A one-leg transfer inserted before one protocol: no parties stored.
        let credits_at_prepare = d.parties.is_none();
        let (amount, hold) = amounts(&d, legs.as_deref(), hold)?;
        let tenants = d
            .tenants
            .iter()
            .map(|name| TenantName::parse(name))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad("tenants", e))?;
        Ok(Transfer {
            tenants: Tenants::of(tenants.iter().map(Some)),
            legs,
            refused_account: d
                .refused_account
                .as_deref()
                .map(AccountId::parse)
                .transpose()
                .map_err(|e| bad("refusedAccount", e))?,
            id: transfer_id(d.id),
            source: AccountId::parse(&d.source).map_err(|e| bad("source", e))?,
            destination: AccountId::parse(&d.destination).map_err(|e| bad("destination", e))?,
            source_deployment: here.clone(),
            destination_deployment,
            amount,
            currency: Currency::parse(&d.currency).map_err(|e| bad("currency", e))?,
            state: d.state,
            hold,
            credits_at_prepare,
            last_modified: d.last_modified.to_chrono(),
            created_at: d.created_at.to_chrono(),
            owner: d.application,
            reason: d.reason,
            reference: d
                .reference
                .as_deref()
                .map(Reference::parse)
                .transpose()
                .map_err(|e| bad("reference", e))?,
            idempotency_key: d
                .idempotency_key
                .as_deref()
                .map(scoped_key)
                .transpose()
                .map_err(|e| bad("idempotencyKey", e))?,
            request_hash: d.request_hash,
            reverses: d.reverses.map(transfer_id),
            reversed_by: d.reversed_by.map(transfer_id),
            fenced: d.fenced,
            reversing: d.reversing,
        })
    }
}

/// The hold `d` stores, if it is one: both its fields or neither.
fn stored_hold(d: &TransferDoc) -> StoreResult<Option<Hold>> {
    let bad = |field: &str, why: ParseError| corrupt("transfer", &d.id, field, why);
    Ok(match (d.held_amount, d.expires_at) {
        (None, None) => None,
        (Some(held), Some(expires_at)) => Some(Hold {
            amount: Amount::parse(held).map_err(|e| bad("heldAmount", e))?,
            expires_at: expires_at.to_chrono(),
        }),
        _ => {
            let why = ParseError("a hold needs both heldAmount and expiresAt".into());
            return Err(bad("hold", why));
        }
    })
}

/// What `d` moves, and its hold: a multi-leg transfer's amount is what its legs move,
/// whatever an older version stored (the legs' sum), and so is its hold's; a one-leg
/// transfer's is its `value`, which its parties, if stored, must agree with.
fn amounts(
    d: &TransferDoc,
    legs: Option<&Legs>,
    hold: Option<Hold>,
) -> StoreResult<(Amount, Option<Hold>)> {
    let Some(legs) = legs else {
        let value = Amount::parse(d.value).map_err(|e| corrupt("transfer", &d.id, "value", e))?;
        one_leg_parties_agree(d)?;
        return Ok((value, hold));
    };
    let moved = legs.moved();
    Ok((moved, hold.map(|h| Hold { amount: moved, ..h })))
}

/// The parties a one-leg transfer's document stores, if any, must be its source paying
/// and its destination receiving what it moves (for a hold, what it reserves), each on
/// its deployment: the protocol moves the parties, the answers show the rest.
fn one_leg_parties_agree(d: &TransferDoc) -> StoreResult<()> {
    let Some(parties) = &d.parties else {
        return Ok(());
    };
    let value = d.held_amount.unwrap_or(d.value);
    let destination_deployment = d.destination_deployment.as_deref();
    let expected = [
        (d.source.as_str(), -value, None),
        (d.destination.as_str(), value, destination_deployment),
    ];
    let agree = parties.len() == 2
        && parties
            .iter()
            .zip(expected)
            .all(|(p, (account, net, place))| {
                p.account == account && p.net == net && p.deployment.as_deref() == place
            });
    if !agree {
        let why = "not the transfer's source and destination";
        return Err(corrupt("transfer", &d.id, "parties", why));
    }
    Ok(())
}

/// The legs a document stores, placed where its parties say (the log's deployment,
/// `here`, unless one names another), or `None` for a one-leg transfer. Refused if they
/// are not legs the service would make, or the parties are not theirs.
fn stored_legs(d: &TransferDoc, here: &DeploymentName) -> StoreResult<Option<Box<Legs>>> {
    let bad = |field: &str, why: String| corrupt("transfer", &d.id, field, why);
    let Some(legs) = &d.legs else {
        return Ok(None);
    };
    let Some(parties) = &d.parties else {
        return Err(bad("legs", "legs and parties go together".into()));
    };
    let parse = |l: &LegDoc| -> Result<Leg, ParseError> {
        Ok(Leg {
            source: AccountId::parse(&l.source)?,
            destination: AccountId::parse(&l.destination)?,
            amount: Amount::parse(l.value)?,
        })
    };
    let legs: Vec<Leg> = legs
        .iter()
        .map(parse)
        .collect::<Result<_, _>>()
        .map_err(|e| bad("legs", e.0))?;
    let legs = Legs::new(legs).map_err(|e| bad("legs", e.to_string()))?;
    let mut places = Vec::with_capacity(parties.len());
    for p in parties {
        let deployment = match &p.deployment {
            Some(name) => DeploymentName::parse(name).map_err(|e| bad("parties", e.0))?,
            None => here.clone(),
        };
        places.push((p.account.as_str(), p.net, deployment));
    }
    let legs = legs.placed(|account| {
        places
            .iter()
            .find(|(a, _, _)| *a == account.as_str())
            .map_or_else(|| here.clone(), |(_, _, d)| d.clone())
    });
    let agree = legs.parties().len() == places.len()
        && legs
            .parties()
            .iter()
            .zip(&places)
            .all(|(p, (a, net, _))| p.account.as_str() == *a && p.net == *net);
    if !agree {
        return Err(bad("parties", "not the parties of the legs".into()));
    }
    Ok(Some(Box::new(legs)))
}

impl From<&Account> for AccountDoc {
    fn from(a: &Account) -> AccountDoc {
        AccountDoc {
            id: a.id.to_string(),
            tenant: a.tenant.as_ref().map(|t| t.to_string()),
            name: a.name.as_ref().map(|n| n.as_str().to_owned()),
            balance: a.balance,
            pending_debits: a.pending_debits,
            pending_credits: a.pending_credits,
            incoming: a.incoming,
            currency: a.currency.to_string(),
            pending_transactions: a
                .pending_transactions
                .iter()
                .copied()
                .map(object_id)
                .collect(),
            fenced_transactions: a
                .fenced_transactions
                .iter()
                .copied()
                .map(object_id)
                .collect(),
            seq: i64::try_from(a.seq).unwrap_or(i64::MAX),
            recent_entries: Vec::new(),
            last_entry_at: None,
            created_at: stored_time(a.created_at),
            updated_at: stored_time(a.updated_at),
            events_due: Vec::new(),
        }
    }
}

impl Stored for AccountDoc {
    type Domain = Account;

    fn into_domain(self, here: &DeploymentName) -> StoreResult<Account> {
        let d = self;
        let bad = |field: &str, why: ParseError| corrupt("account", &d.id, field, why);
        Ok(Account {
            id: AccountId::parse(&d.id).map_err(|e| bad("_id", e))?,
            deployment: here.clone(),
            tenant: d
                .tenant
                .as_deref()
                .map(TenantName::parse)
                .transpose()
                .map_err(|e| bad("tenant", e))?,
            name: d
                .name
                .as_deref()
                .map(AccountName::parse)
                .transpose()
                .map_err(|e| bad("name", e))?,
            balance: d.balance,
            pending_debits: d.pending_debits,
            pending_credits: d.pending_credits,
            incoming: d.incoming,
            currency: Currency::parse(&d.currency).map_err(|e| bad("currency", e))?,
            pending_transactions: d
                .pending_transactions
                .into_iter()
                .map(transfer_id)
                .collect(),
            fenced_transactions: d.fenced_transactions.into_iter().map(transfer_id).collect(),
            seq: u64::try_from(d.seq)
                .map_err(|_| bad("seq", ParseError(format!("{} is negative", d.seq))))?,
            created_at: d.created_at.to_chrono(),
            updated_at: d.updated_at.to_chrono(),
        })
    }
}

/// Converts what a read of `here` found, refusing the whole read if one document is
/// corrupt.
pub fn domain<D: Stored>(docs: Vec<D>, here: &DeploymentName) -> StoreResult<Vec<D::Domain>> {
    docs.into_iter().map(|d| d.into_domain(here)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Amount;

    #[test]
    fn a_transfer_survives_the_trip_through_its_document() {
        // Times included: a new transfer's are already to the millisecond, as stored.
        let mut transfer = Transfer::initial(
            new_transfer_id(),
            AccountId::parse("alice").unwrap(),
            AccountId::parse("bob").unwrap(),
            Amount::parse(250).unwrap(),
            Currency::usd(),
        );
        transfer.owner = Some("instance/1".into());
        transfer.reference = Some(Reference::parse("invoice 7").unwrap());
        transfer.idempotency_key = Some(ScopedKey::shared(IdempotencyKey::parse("k-1").unwrap()));
        transfer.reversed_by = Some(new_transfer_id());
        transfer.reason = Some(CancelReason::InsufficientFunds);
        transfer.fenced = true;

        let stored = TransferDoc::from(&transfer);
        assert_eq!(stored.value, 250);
        assert_eq!(stored.application.as_deref(), Some("instance/1"));
        let here = DeploymentName::default();
        assert_eq!(stored.clone().into_domain(&here).unwrap(), transfer);
        // A transfer into another deployment names it; the source's is where it is read.
        let eu = DeploymentName::parse("eu").unwrap();
        let across = Transfer {
            source_deployment: eu.clone(),
            ..transfer.clone()
        };
        let stored = TransferDoc::from(&across);
        assert_eq!(stored.destination_deployment.as_deref(), Some("default"));
        assert_eq!(stored.into_domain(&eu).unwrap(), across);
    }

    /// A multi-leg transfer keeps its legs as sent and its parties, each on its
    /// deployment (named only where it is not the log's); parties that are not the
    /// legs' are refused as corrupt.
    #[test]
    fn a_multi_leg_transfer_survives_the_trip_and_its_parties_must_be_its_legs() {
        let leg = |s: &str, d: &str, v: i64| Leg {
            source: AccountId::parse(s).unwrap(),
            destination: AccountId::parse(d).unwrap(),
            amount: Amount::parse(v).unwrap(),
        };
        let eu = DeploymentName::parse("eu").unwrap();
        let legs = Legs::new(vec![
            leg("buyer", "seller", 1_000),
            leg("seller", "fee", 30),
        ])
        .unwrap()
        .placed(|a| {
            if a.as_str() == "fee" {
                eu.clone()
            } else {
                DeploymentName::default()
            }
        });
        let transfer = Transfer {
            legs: Some(Box::new(legs)),
            credits_at_prepare: false,
            refused_account: Some(AccountId::parse("seller").unwrap()),
            ..Transfer::initial(
                new_transfer_id(),
                AccountId::parse("buyer").unwrap(),
                AccountId::parse("seller").unwrap(),
                // What the legs move: the buyer's 1000, not their sum.
                Amount::parse(1_000).unwrap(),
                Currency::usd(),
            )
        };
        let stored = TransferDoc::from(&transfer);
        let parties = stored.parties.clone().unwrap();
        assert_eq!(parties.len(), 3);
        assert_eq!((parties[2].account.as_str(), parties[2].net), ("fee", 30));
        assert_eq!(parties[2].deployment.as_deref(), Some("eu"));
        assert_eq!(parties[0].deployment, None);
        let here = DeploymentName::default();
        assert_eq!(stored.clone().into_domain(&here).unwrap(), transfer);

        let mut wrong = stored.clone();
        wrong.parties.as_mut().unwrap()[1].net += 1;
        assert!(wrong.into_domain(&here).is_err());
        let mut half = stored;
        half.parties = None;
        assert!(half.into_domain(&here).is_err());
    }

    /// A one-leg transfer inserted since one protocol stores its two parties (its source
    /// paying what it moves, its destination receiving it, each on its deployment), which
    /// must be those; one inserted before stores none, and comes back as crediting at its
    /// prepare, as it was written to.
    #[test]
    fn a_one_leg_transfer_stores_its_parties_and_one_without_them_credits_at_prepare() {
        let eu = DeploymentName::parse("eu").unwrap();
        let transfer = Transfer {
            destination_deployment: eu,
            credits_at_prepare: false,
            ..Transfer::initial(
                new_transfer_id(),
                AccountId::parse("alice").unwrap(),
                AccountId::parse("bob").unwrap(),
                Amount::parse(250).unwrap(),
                Currency::usd(),
            )
        };
        let stored = TransferDoc::from(&transfer);
        let parties = stored.parties.clone().unwrap();
        let sides: Vec<(&str, i64, Option<&str>)> = parties
            .iter()
            .map(|p| (p.account.as_str(), p.net, p.deployment.as_deref()))
            .collect();
        assert_eq!(sides, vec![("alice", -250, None), ("bob", 250, Some("eu"))]);
        let here = DeploymentName::default();
        assert_eq!(stored.clone().into_domain(&here).unwrap(), transfer);

        let mut wrong = stored.clone();
        wrong.parties.as_mut().unwrap()[1].net = 249;
        assert!(wrong.into_domain(&here).is_err());

        let mut before = stored;
        before.parties = None;
        let old = before.into_domain(&here).unwrap();
        assert!(old.credits_at_prepare && old.pays_in_at_prepare());
        assert_eq!(TransferDoc::from(&old).parties, None, "stays as inserted");
    }

    #[test]
    fn a_key_is_stored_as_sent_when_shared_and_after_its_api_key_id_otherwise() {
        let key = IdempotencyKey::parse("order:42/a").unwrap();
        let shared = ScopedKey::shared(key.clone());
        let id = ApiKeyId::parse(&"5e".repeat(16)).unwrap();
        let scoped = ScopedKey {
            scope: KeyScope::ApiKey(id),
            key,
        };
        assert_eq!(stored_key(&shared), "order:42/a");
        assert_eq!(
            stored_key(&scoped),
            format!("{} order:42/a", "5e".repeat(16))
        );
        for k in [shared, scoped] {
            assert_eq!(scoped_key(&stored_key(&k)).unwrap(), k);
        }
        // A shared key may look like an id: only the space makes a form scoped.
        let hex = "5e".repeat(16);
        assert_eq!(
            scoped_key(&hex).unwrap(),
            ScopedKey::shared(IdempotencyKey::parse(&hex).unwrap())
        );
        assert!(scoped_key("not-an-id order-1").is_err());
    }

    #[test]
    fn a_stored_value_the_domain_refuses_is_an_error_naming_the_field() {
        let transfer = Transfer::initial(
            new_transfer_id(),
            AccountId::parse("alice").unwrap(),
            AccountId::parse("bob").unwrap(),
            Amount::parse(1).unwrap(),
            Currency::usd(),
        );
        let corrupt = TransferDoc {
            value: 0,
            ..TransferDoc::from(&transfer)
        };
        let err = corrupt.into_domain(&DeploymentName::default()).unwrap_err();
        assert!(matches!(err, StoreError::Malformed(_)), "{err:?}");
        let said = crate::error_chain::Chain(&err).to_string();
        assert!(said.contains("stored value is not valid"), "{said}");
    }
}
