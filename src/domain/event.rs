//! Events: what the service tells its users happened (`docs/events.md`), and the feed's
//! order and cursor.
//!
//! An event is recorded when a transfer reaches `held`, `done` or `canceled`, and when an
//! account is opened. Each happens at most once to its subject, so the event's id is
//! made of its type and its subject alone ([`event_id`]): every instance, every
//! recording and every delivery gives the same event the same id.
//!
//! The feed of one deployment is in [`Position`] order: the database's cluster time of
//! the change the event reports, then the event's id. A [`FeedCursor`] holds one
//! position per deployment: how far the reader has read each one's events.

use std::collections::BTreeMap;
use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use super::{Account, DeploymentName, ParseError, Timestamp, Transfer, TransferState};

/// What an event reports. Stored and shown as `account.opened`, `transfer.held`, ...
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EventType {
    AccountOpened,
    /// A hold reserves its amount and waits for a capture, a void or its expiry.
    TransferHeld,
    /// A transfer, a capture (the hold's own `done`) or a reversal (the compensating
    /// transfer's `done`) finished.
    TransferDone,
    /// A transfer was rolled back or refused, or a hold voided or expired: the reason
    /// says which.
    TransferCanceled,
}

impl EventType {
    pub const ALL: [EventType; 4] = [
        EventType::AccountOpened,
        EventType::TransferHeld,
        EventType::TransferDone,
        EventType::TransferCanceled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventType::AccountOpened => "account.opened",
            EventType::TransferHeld => "transfer.held",
            EventType::TransferDone => "transfer.done",
            EventType::TransferCanceled => "transfer.canceled",
        }
    }

    pub fn parse(raw: &str) -> Result<EventType, ParseError> {
        EventType::ALL
            .into_iter()
            .find(|t| t.as_str() == raw)
            .ok_or_else(|| {
                ParseError(format!(
                    "must be one of {}",
                    EventType::ALL.map(EventType::as_str).join(", ")
                ))
            })
    }

    /// The event a transfer reaching `state` records, if any.
    pub fn of_state(state: TransferState) -> Option<EventType> {
        match state {
            TransferState::Held => Some(EventType::TransferHeld),
            TransferState::Done => Some(EventType::TransferDone),
            TransferState::Canceled => Some(EventType::TransferCanceled),
            _ => None,
        }
    }

    /// The state whose arrival this event reports (none for an account's opening).
    pub fn state(self) -> Option<TransferState> {
        match self {
            EventType::AccountOpened => None,
            EventType::TransferHeld => Some(TransferState::Held),
            EventType::TransferDone => Some(TransferState::Done),
            EventType::TransferCanceled => Some(TransferState::Canceled),
        }
    }
}

impl fmt::Display for EventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The id of the event of type `kind` about `subject` (an account id or a transfer id):
/// `transfer.done:6b0619d67d0e8af2ac0b1adf`, `account.opened:alice`. The same on every
/// instance and every delivery, because each happens once to its subject.
pub fn event_id(kind: EventType, subject: &str) -> String {
    format!("{kind}:{subject}")
}

/// What an event is about, as it was when the event happened.
#[derive(Debug, Clone, PartialEq)]
pub enum EventData {
    Account(Account),
    Transfer(Transfer),
}

/// One event of the feed.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// [`event_id`] of its type and subject.
    pub id: String,
    pub kind: EventType,
    /// When the change it reports landed, by the database's clock.
    pub at: Timestamp,
    pub data: EventData,
    /// The deployment whose change it reports.
    pub deployment: DeploymentName,
    /// Where it stands in its deployment's feed.
    pub position: Position,
}

impl Transfer {
    /// This transfer as it was when it reached `state` (the data of the event reporting
    /// it), from a copy read at that moment or later: what only a later change sets is
    /// left out. A hold's amount was the held amount until its capture; a cancel's reason
    /// and a reversal's link come later than `held`; a reversal is claimed only after the
    /// transfer is `done`, so a `done` transfer had no `reversedBy` yet. `last_modified`
    /// is the stamp of the change that reached `state`, when the change says it.
    pub fn as_it_reached(
        mut self,
        state: TransferState,
        last_modified: Option<Timestamp>,
    ) -> Transfer {
        if state != self.state {
            if let (TransferState::Held, Some(hold)) = (state, &self.hold) {
                self.amount = hold.amount;
            }
            self.reason = None;
        }
        if let Some(at) = last_modified {
            self.last_modified = at;
        }
        self.state = state;
        self.reversed_by = None;
        self.reversing = false;
        self
    }
}

/// Where an event stands in its deployment's feed: the cluster time (seconds and
/// increment) of the change it reports, then its id for the changes that share a cluster
/// time (those of one native transaction, or of several shards).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Position {
    pub seconds: u32,
    pub increment: u32,
    pub id: String,
}

impl Position {
    /// Before every event: where a reader of a feed nothing was removed from starts.
    pub fn start() -> Position {
        Position {
            seconds: 0,
            increment: 0,
            id: String::new(),
        }
    }
}

/// How far a reader has read the feed: a [`Position`] per deployment whose events it has
/// seen (or whose start it has passed); none for a deployment it has not read yet.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FeedCursor {
    pub positions: BTreeMap<DeploymentName, Position>,
}

/// The cursor's version, the first thing it says: a later encoding can still read an
/// earlier one.
const CURSOR_VERSION: u64 = 1;

impl FeedCursor {
    /// The opaque form a reader is given: unpadded URL-safe base64 of a small JSON
    /// document, safe in a query string and in a `Last-Event-ID` header.
    pub fn encode(&self) -> String {
        let positions: serde_json::Map<String, serde_json::Value> = self
            .positions
            .iter()
            .map(|(d, p)| {
                let at = serde_json::json!([p.seconds, p.increment, p.id]);
                (d.as_str().to_owned(), at)
            })
            .collect();
        let json = serde_json::json!({ "v": CURSOR_VERSION, "p": positions });
        URL_SAFE_NO_PAD.encode(json.to_string())
    }

    /// A cursor [`FeedCursor::encode`] made; anything else is refused.
    pub fn parse(raw: &str) -> Result<FeedCursor, ParseError> {
        let refuse = || ParseError("is not a cursor this service gave".into());
        let bytes = URL_SAFE_NO_PAD.decode(raw).map_err(|_| refuse())?;
        let json: serde_json::Value = serde_json::from_slice(&bytes).map_err(|_| refuse())?;
        if json.get("v").and_then(|v| v.as_u64()) != Some(CURSOR_VERSION) {
            return Err(refuse());
        }
        let Some(found) = json.get("p").and_then(|p| p.as_object()) else {
            return Err(refuse());
        };
        let mut positions = BTreeMap::new();
        for (deployment, at) in found {
            let deployment = DeploymentName::parse(deployment).map_err(|_| refuse())?;
            let position = match at.as_array().map(Vec::as_slice) {
                Some([seconds, increment, id]) => Position {
                    seconds: seconds
                        .as_u64()
                        .and_then(|s| u32::try_from(s).ok())
                        .ok_or_else(refuse)?,
                    increment: increment
                        .as_u64()
                        .and_then(|i| u32::try_from(i).ok())
                        .ok_or_else(refuse)?,
                    id: id.as_str().ok_or_else(refuse)?.to_owned(),
                },
                _ => return Err(refuse()),
            };
            positions.insert(deployment, position);
        }
        Ok(FeedCursor { positions })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn position(seconds: u32, increment: u32, id: &str) -> Position {
        Position {
            seconds,
            increment,
            id: id.into(),
        }
    }

    #[test]
    fn a_cursor_reads_back_as_it_was_encoded() {
        let mut cursor = FeedCursor::default();
        cursor.positions.insert(
            DeploymentName::default(),
            position(1_795_696_519, 12, "transfer.done:6b0619d67d0e8af2ac0b1adf"),
        );
        cursor.positions.insert(
            DeploymentName::parse("eu").unwrap(),
            position(7, 0, "account.opened:a:b@c"),
        );
        assert_eq!(FeedCursor::parse(&cursor.encode()).unwrap(), cursor);
        let empty = FeedCursor::default();
        assert_eq!(FeedCursor::parse(&empty.encode()).unwrap(), empty);
    }

    #[test]
    fn anything_but_a_cursor_is_refused() {
        let bad_version = URL_SAFE_NO_PAD.encode(r#"{"v":2,"p":{}}"#);
        let bad_deployment = URL_SAFE_NO_PAD.encode(r#"{"v":1,"p":{"EU":[1,2,"x"]}}"#);
        let bad_position = URL_SAFE_NO_PAD.encode(r#"{"v":1,"p":{"eu":[1,"x"]}}"#);
        let too_big = URL_SAFE_NO_PAD.encode(r#"{"v":1,"p":{"eu":[4294967296,0,"x"]}}"#);
        for raw in [
            "",
            "not base64!",
            "bm90IGpzb24",
            &bad_version,
            &bad_deployment,
            &bad_position,
            &too_big,
        ] {
            assert!(FeedCursor::parse(raw).is_err(), "{raw:?} was accepted");
        }
    }

    #[test]
    fn positions_order_by_cluster_time_then_id() {
        assert!(position(1, 5, "z") < position(2, 0, "a"));
        assert!(position(2, 0, "z") < position(2, 1, "a"));
        assert!(position(2, 1, "a") < position(2, 1, "b"));
    }

    #[test]
    fn event_types_read_back_and_others_are_refused() {
        for t in EventType::ALL {
            assert_eq!(EventType::parse(t.as_str()).unwrap(), t);
        }
        assert!(EventType::parse("transfer.pending").is_err());
        assert_eq!(
            EventType::of_state(TransferState::Done),
            Some(EventType::TransferDone)
        );
        assert_eq!(EventType::of_state(TransferState::Applied), None);
    }
}
