//! The stored field names of `accounts` (with their entries, also in `entries`), of
//! `transactions`, and of every other collection the store writes, one list per
//! collection, so that a filter, an update, a pipeline, a
//! projection, an index or a sort cannot misspell one and the list cannot drift from the
//! documents: its tests serialize each document of `store::documents` whole and check
//! that every key serde writes is here and every constant here is a key serde writes.
//!
//! How they are written, one rule each:
//! - a key in `doc!` is the constant as it is: `doc! { account::PENDING: id }` (the macro
//!   takes any expression before the `:` as the key);
//! - a reference to a field's value in a pipeline (`"$pendingTransactions"`) is
//!   [`path`]`(account::PENDING)`;
//! - a dotted path into an array of subdocuments has its own constant here
//!   (`transfer::PARTIES_ACCOUNT`), checked against its two halves by the tests.
//!
//! `_id`, the names of a pipeline's own variables (`$$this`, `"$_entry.b"`, `"in"`,
//! `"as"`) and the operators are MongoDB's or the pipeline's, not the document's, and
//! stay literal. So do the commands of the migrations (`migrations/*.json`), which
//! are data, read as written.

/// `"$field"`: the value of `field` in a pipeline expression.
pub fn path(field: &str) -> String {
    format!("${field}")
}

/// A document of `accounts` (`documents::AccountDoc`).
pub mod account {
    pub const TENANT: &str = "tenant";
    pub const NAME: &str = "name";
    pub const BALANCE: &str = "balance";
    pub const PENDING_DEBITS: &str = "pendingDebits";
    pub const PENDING_CREDITS: &str = "pendingCredits";
    pub const INCOMING: &str = "incoming";
    pub const CURRENCY: &str = "currency";
    /// The markers of the transfers applied here and not settled yet.
    pub const PENDING: &str = "pendingTransactions";
    /// The transfers whose forward steps are refused here.
    pub const FENCED: &str = "fencedTransactions";
    pub const SEQ: &str = "seq";
    /// The entries not moved to `entries` yet.
    pub const RECENT: &str = "recentEntries";
    pub const LAST_ENTRY_AT: &str = "lastEntryAt";
    pub const CREATED_AT: &str = "createdAt";
    pub const UPDATED_AT: &str = "updatedAt";
    /// The events its writes made due and the recorder has not recorded yet.
    pub const EVENTS_DUE: &str = "eventsDue";

    /// Every field, for the test against serde's names.
    #[cfg(test)]
    pub const ALL: &[&str] = &[
        TENANT,
        NAME,
        BALANCE,
        PENDING_DEBITS,
        PENDING_CREDITS,
        INCOMING,
        CURRENCY,
        PENDING,
        FENCED,
        SEQ,
        RECENT,
        LAST_ENTRY_AT,
        CREATED_AT,
        UPDATED_AT,
        EVENTS_DUE,
    ];
}

/// An entry (`documents::EntryDoc`), in an account's `recentEntries` and in `entries`.
/// Its keys are short on purpose (`docs/ledger.md`).
pub mod entry {
    /// In `entries` only.
    pub const ACCOUNT: &str = "account";
    pub const SEQ: &str = "seq";
    pub const KIND: &str = "k";
    pub const TRANSFER: &str = "tx";
    pub const BALANCE_CHANGE: &str = "db";
    pub const PENDING_DEBITS_CHANGE: &str = "dpd";
    pub const PENDING_CREDITS_CHANGE: &str = "dpc";
    pub const BALANCE: &str = "b";
    pub const PENDING_DEBITS: &str = "pd";
    pub const PENDING_CREDITS: &str = "pc";
    pub const AT: &str = "at";
    pub const CARRIED_FORWARD: &str = "cf";

    #[cfg(test)]
    pub const ALL: &[&str] = &[
        ACCOUNT,
        SEQ,
        KIND,
        TRANSFER,
        BALANCE_CHANGE,
        PENDING_DEBITS_CHANGE,
        PENDING_CREDITS_CHANGE,
        BALANCE,
        PENDING_DEBITS,
        PENDING_CREDITS,
        AT,
        CARRIED_FORWARD,
    ];
}

/// A document of `transactions` (`documents::TransferDoc`).
pub mod transfer {
    pub const SOURCE: &str = "source";
    pub const DESTINATION: &str = "destination";
    pub const DESTINATION_DEPLOYMENT: &str = "destinationDeployment";
    pub const TENANTS: &str = "tenants";
    pub const VALUE: &str = "value";
    pub const CURRENCY: &str = "currency";
    pub const STATE: &str = "state";
    pub const HELD_AMOUNT: &str = "heldAmount";
    pub const EXPIRES_AT: &str = "expiresAt";
    pub const LAST_MODIFIED: &str = "lastModified";
    pub const CREATED_AT: &str = "createdAt";
    pub const APPLICATION: &str = "application";
    pub const REASON: &str = "reason";
    pub const REFUSED_ACCOUNT: &str = "refusedAccount";
    pub const LEGS: &str = "legs";
    pub const PARTIES: &str = "parties";
    pub const REFERENCE: &str = "reference";
    pub const IDEMPOTENCY_KEY: &str = "idempotencyKey";
    pub const REQUEST_HASH: &str = "requestHash";
    pub const REVERSES: &str = "reverses";
    pub const REVERSED_BY: &str = "reversedBy";
    pub const FENCED: &str = "fenced";
    pub const REVERSING: &str = "reversing";
    /// The events its writes made due and the recorder has not recorded yet.
    pub const EVENTS_DUE: &str = "eventsDue";
    /// `parties.account`: the transfers a party's account is in.
    pub const PARTIES_ACCOUNT: &str = "parties.account";
    /// `parties.deployment`.
    pub const PARTIES_DEPLOYMENT: &str = "parties.deployment";

    #[cfg(test)]
    pub const ALL: &[&str] = &[
        SOURCE,
        DESTINATION,
        DESTINATION_DEPLOYMENT,
        TENANTS,
        VALUE,
        CURRENCY,
        STATE,
        HELD_AMOUNT,
        EXPIRES_AT,
        LAST_MODIFIED,
        CREATED_AT,
        APPLICATION,
        REASON,
        REFUSED_ACCOUNT,
        LEGS,
        PARTIES,
        REFERENCE,
        IDEMPOTENCY_KEY,
        REQUEST_HASH,
        REVERSES,
        REVERSED_BY,
        FENCED,
        REVERSING,
        EVENTS_DUE,
    ];
}

/// A leg of a multi-leg transfer (`documents::LegDoc`), in `transfer::LEGS`.
pub mod leg {
    pub const SOURCE: &str = "source";
    pub const DESTINATION: &str = "destination";
    pub const VALUE: &str = "value";

    #[cfg(test)]
    pub const ALL: &[&str] = &[SOURCE, DESTINATION, VALUE];
}

/// A party of a transfer (`documents::PartyDoc`), in `transfer::PARTIES`.
pub mod party {
    pub const ACCOUNT: &str = "account";
    pub const NET: &str = "net";
    pub const DEPLOYMENT: &str = "deployment";

    #[cfg(test)]
    pub const ALL: &[&str] = &[ACCOUNT, NET, DEPLOYMENT];
}

/// A document of `webhooks` (`webhooks::WebhookDoc`).
pub mod webhook {
    pub const URL: &str = "url";
    pub const TYPES: &str = "types";
    pub const DESCRIPTION: &str = "description";
    pub const TENANT: &str = "tenant";
    pub const SECRET: &str = "secret";
    pub const PREVIOUS_SECRET: &str = "previousSecret";
    pub const PREVIOUS_UNTIL: &str = "previousUntil";
    pub const CREATED_AT: &str = "createdAt";
    pub const REGISTERED_AT: &str = "registeredAt";

    #[cfg(test)]
    pub const ALL: &[&str] = &[
        URL,
        TYPES,
        DESCRIPTION,
        TENANT,
        SECRET,
        PREVIOUS_SECRET,
        PREVIOUS_UNTIL,
        CREATED_AT,
        REGISTERED_AT,
    ];
}

/// A document of `deliveries` (`webhooks::DeliveryDoc`).
pub mod delivery {
    pub const WEBHOOK: &str = "webhook";
    pub const EVENT_ID: &str = "eventId";
    pub const EVENT_TYPE: &str = "eventType";
    pub const BODY: &str = "body";
    pub const STATE: &str = "state";
    pub const ATTEMPTS: &str = "attempts";
    pub const TRIES: &str = "tries";
    pub const NEXT_ATTEMPT_AT: &str = "nextAttemptAt";
    pub const GIVE_UP_AT: &str = "giveUpAt";
    /// The claim: whose it is, and until when.
    pub const OWNER: &str = "owner";
    pub const LEASE_UNTIL: &str = "leaseUntil";
    pub const CREATED_AT: &str = "createdAt";

    #[cfg(test)]
    pub const ALL: &[&str] = &[
        WEBHOOK,
        EVENT_ID,
        EVENT_TYPE,
        BODY,
        STATE,
        ATTEMPTS,
        TRIES,
        NEXT_ATTEMPT_AT,
        GIVE_UP_AT,
        OWNER,
        LEASE_UNTIL,
        CREATED_AT,
    ];
}

/// An attempt of a delivery (`webhooks::AttemptDoc`), in `delivery::ATTEMPTS`.
pub mod attempt {
    pub const AT: &str = "at";
    pub const STATUS: &str = "status";
    pub const ERROR: &str = "error";
    pub const DURATION_MS: &str = "durationMs";

    #[cfg(test)]
    pub const ALL: &[&str] = &[AT, STATUS, ERROR, DURATION_MS];
}

/// The one document of `webhookDispatcher`: the dispatcher's lease and the feed's cursor
/// (written field by field, with no serde shape to check against).
pub mod dispatcher {
    pub const OWNER: &str = "owner";
    pub const LEASE_UNTIL: &str = "leaseUntil";
    pub const CURSOR: &str = "cursor";
    pub const CREATED: &str = "created";
}

/// A document of `webhookCaps`: a scope's count of registered webhooks.
pub mod cap {
    pub const REGISTRATIONS: &str = "registrations";
}

/// A document of `events` (`events::EventDoc`).
/// An element of `eventsDue` (`documents::EventDue`), in an account or a transfer.
pub mod event_due {
    pub const TYPE: &str = "type";
    pub const AT: &str = "at";
    pub const BALANCE: &str = "balance";
    /// `eventsDue.type`: the due events' indexes hold the documents that have one.
    pub const DUE_TYPE: &str = "eventsDue.type";
    /// `eventsDue.at`: what those indexes order them by.
    pub const DUE_AT: &str = "eventsDue.at";

    #[cfg(test)]
    pub const ALL: &[&str] = &[TYPE, AT, BALANCE];
}

pub mod event {
    pub const TYPE: &str = "type";
    pub const AT: &str = "at";
    /// Its place in the feed.
    pub const KEY: &str = "key";
    pub const TRANSFER: &str = "transfer";
    pub const ACCOUNT: &str = "account";
    pub const TENANTS: &str = "tenants";

    #[cfg(test)]
    pub const ALL: &[&str] = &[TYPE, AT, KEY, TRANSFER, ACCOUNT, TENANTS];
}

/// The event recorder's document of `eventRecorder`: its lease and how far it recorded
/// and trimmed (written field by field, with no serde shape to check against).
pub mod recorder {
    pub const OWNER: &str = "owner";
    pub const LEASE_UNTIL: &str = "leaseUntil";
    pub const RECORDED_THROUGH: &str = "recordedThrough";
    pub const TRIMMED_THROUGH: &str = "trimmedThrough";
    pub const RESUME_TOKEN: &str = "resumeToken";
    pub const START_AT: &str = "startAt";
    /// A round of the recorder written and not finished (`store::events::marks`).
    pub const ROUND: &str = "round";
    /// In a round: the key of its first tick, and its events' ids in feed order.
    pub const ROUND_FIRST: &str = "first";
    pub const ROUND_IDS: &str = "ids";
    /// Set once the change stream of a feed an older version recorded has been read to
    /// its end, the probe this version wrote (`streamProbe`).
    pub const STREAM_DONE: &str = "streamDone";
    pub const STREAM_PROBE: &str = "streamProbe";
}

/// A document of `idempotencyKeys`: the transfer a key made (written field by field).
pub mod idempotency_key {
    pub const TRANSFER: &str = "transfer";
    pub const REQUEST_HASH: &str = "requestHash";
    pub const AT: &str = "at";
}

/// A document of `apiKeys` (`api_keys::ApiKeyDoc`).
pub mod api_key {
    pub const SHA256: &str = "sha256";
    pub const TENANT: &str = "tenant";
    pub const ROLE: &str = "role";
    pub const CREATED_AT: &str = "createdAt";
    pub const LAST_USED_AT: &str = "lastUsedAt";

    #[cfg(test)]
    pub const ALL: &[&str] = &[SHA256, TENANT, ROLE, CREATED_AT, LAST_USED_AT];
}

/// A document of `accountDirectory`: the deployment an account lives on.
pub mod account_directory {
    pub const DEPLOYMENT: &str = "deployment";
    pub const AT: &str = "at";
}

/// A document of `migrations`: one applied migration.
pub mod migration {
    pub const CHECKSUM: &str = "checksum";
    pub const APPLIED_AT: &str = "appliedAt";
}

/// The keys serde writes for `value` (`_id` aside), every optional field filled, beside
/// a list of constants: the same names, or the test that calls it fails.
#[cfg(test)]
pub(super) fn assert_same_keys(list: &[&str], value: &impl serde::Serialize) {
    let stored = mongodb::bson::to_document(value).unwrap();
    let mut listed: Vec<&str> = list.to_vec();
    let mut written: Vec<&str> = stored
        .keys()
        .map(String::as_str)
        .filter(|k| *k != "_id")
        .collect();
    listed.sort();
    written.sort();
    assert_eq!(listed, written);
}

#[cfg(test)]
mod tests {
    use mongodb::bson::DateTime;
    use mongodb::bson::oid::ObjectId;

    use super::super::documents::{AccountDoc, EntryDoc, EventDue, LegDoc, PartyDoc, TransferDoc};
    use super::*;
    use crate::domain::{CancelReason, EntryKind, TransferState};

    fn entry() -> EntryDoc {
        EntryDoc {
            account: Some("alice".into()),
            seq: 2,
            kind: EntryKind::Opened,
            transfer_id: Some(ObjectId::new()),
            balance_change: 1,
            pending_debits_change: 1,
            pending_credits_change: 1,
            balance: 1,
            pending_debits: 1,
            pending_credits: 1,
            at: DateTime::now(),
            carried_forward: true,
        }
    }

    #[test]
    fn the_account_fields_are_the_names_serde_writes() {
        let account = AccountDoc {
            id: "alice".into(),
            tenant: Some("acme".into()),
            name: Some("Alice".into()),
            balance: 1,
            pending_debits: 1,
            pending_credits: 1,
            incoming: 1,
            currency: "USD".into(),
            pending_transactions: vec![ObjectId::new()],
            fenced_transactions: vec![ObjectId::new()],
            seq: 1,
            recent_entries: vec![entry()],
            last_entry_at: Some(DateTime::now()),
            created_at: DateTime::now(),
            updated_at: DateTime::now(),
            events_due: vec![due()],
        };
        assert_same_keys(account::ALL, &account);
    }

    fn due() -> EventDue {
        EventDue {
            kind: "account.opened".into(),
            at: DateTime::now(),
            balance: Some(1),
        }
    }

    #[test]
    fn the_event_due_fields_are_the_names_serde_writes() {
        assert_same_keys(event_due::ALL, &due());
    }

    #[test]
    fn the_entry_fields_are_the_names_serde_writes() {
        assert_same_keys(entry::ALL, &entry());
    }

    #[test]
    fn the_transfer_fields_are_the_names_serde_writes() {
        let leg = LegDoc {
            source: "alice".into(),
            destination: "bob".into(),
            value: 1,
        };
        let party = PartyDoc {
            account: "alice".into(),
            net: -1,
            deployment: Some("eu".into()),
        };
        assert_same_keys(leg::ALL, &leg);
        assert_same_keys(party::ALL, &party);
        let transfer = TransferDoc {
            id: ObjectId::new(),
            source: "alice".into(),
            destination: "bob".into(),
            destination_deployment: Some("eu".into()),
            tenants: vec!["acme".into()],
            value: 1,
            currency: "USD".into(),
            state: TransferState::Initial,
            held_amount: Some(1),
            expires_at: Some(DateTime::now()),
            last_modified: DateTime::now(),
            created_at: DateTime::now(),
            application: Some("instance/1".into()),
            reason: Some(CancelReason::InsufficientFunds),
            refused_account: Some("bob".into()),
            legs: Some(vec![leg]),
            parties: Some(vec![party]),
            reference: Some("invoice 7".into()),
            idempotency_key: Some("k-1".into()),
            request_hash: Some("h".into()),
            reverses: Some(ObjectId::new()),
            reversed_by: Some(ObjectId::new()),
            fenced: true,
            reversing: true,
            events_due: vec![due()],
        };
        assert_same_keys(transfer::ALL, &transfer);
        assert_eq!(
            transfer::PARTIES_ACCOUNT,
            format!("{}.{}", transfer::PARTIES, party::ACCOUNT)
        );
        assert_eq!(
            transfer::PARTIES_DEPLOYMENT,
            format!("{}.{}", transfer::PARTIES, party::DEPLOYMENT)
        );
    }
}
