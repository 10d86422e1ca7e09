//! The stored shapes of `accounts` and `transactions`, named as in the MongoDB tutorial
//! so that anyone who read it recognises them. These are storage types: the HTTP layer
//! has its own response types, so the API and the schema can change independently.

use mongodb::bson::DateTime;
use mongodb::bson::oid::ObjectId;
use serde::{Deserialize, Serialize};

use crate::domain::{CancelReason, TransferId, TransferState};

/// A document of `accounts`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AccountDoc {
    /// The client's account id (see `domain::AccountId`).
    #[serde(rename = "_id")]
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Minor units, always an Int64 in BSON.
    pub balance: i64,
    pub currency: String,
    /// Transfers applied to this account whose markers are not pulled yet. A transfer's
    /// id here is what makes applying it a second time a no-op.
    pub pending_transactions: Vec<ObjectId>,
    /// Transfers canceled while pending: their forward steps are refused here, so that a
    /// step still in flight when the cancel ran cannot land after the rollback.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fenced_transactions: Vec<ObjectId>,
    pub created_at: DateTime,
    pub updated_at: DateTime,
}

/// A document of `transactions`: one transfer and where it is in the protocol.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TransferDoc {
    #[serde(rename = "_id")]
    pub id: ObjectId,
    pub source: String,
    pub destination: String,
    /// The amount in minor units (the tutorial's name).
    pub value: i64,
    pub currency: String,
    /// One of `initial`, `pending`, `applied`, `done`, `canceling`, `canceled`.
    pub state: TransferState,
    /// When the state last changed; the sweeper's staleness clock.
    pub last_modified: DateTime,
    pub created_at: DateTime,
    /// The instance that owns the transfer (the tutorial's multi-application marker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub application: Option<String>,
    /// Why it ended `canceled`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<CancelReason>,
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
}

impl TransferDoc {
    /// A transfer as step 1 records it: `initial`, owned by nobody yet. Optional fields
    /// (reference, idempotency key, reversal link) are set by the caller.
    pub fn initial(
        id: ObjectId,
        source: &str,
        destination: &str,
        value: i64,
        currency: &str,
    ) -> TransferDoc {
        let now = DateTime::now();
        TransferDoc {
            id,
            source: source.to_owned(),
            destination: destination.to_owned(),
            value,
            currency: currency.to_owned(),
            state: TransferState::Initial,
            last_modified: now,
            created_at: now,
            application: None,
            reason: None,
            reference: None,
            idempotency_key: None,
            request_hash: None,
            reverses: None,
            reversed_by: None,
            fenced: false,
            reversing: false,
        }
    }

    pub fn transfer_id(&self) -> TransferId {
        TransferId::from_bytes(self.id.bytes())
    }
}

pub fn object_id(id: TransferId) -> ObjectId {
    ObjectId::from_bytes(id.bytes())
}
