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
//! position per deployment: how far the reader has read each one's events. A client's
//! cursor is read with [`FeedCursor::parse_for`]: it holds at most a position per
//! deployment served, each an event's, so that what is built from it is bounded by the
//! deployments, never by what was sent.

use std::collections::BTreeMap;
use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use super::{
    Account, AccountId, DeploymentName, ParseError, TenantName, Timestamp, Transfer, TransferState,
};

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

    pub const fn as_str(self) -> &'static str {
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

/// What an event holds besides its strings: its fixed-size fields, its allocations'
/// bookkeeping, and room for the small fields a later version adds.
const EVENT_FIXED_BYTES: usize = 1024;
/// What each item of a list in an event holds besides its strings.
const ITEM_FIXED_BYTES: usize = 64;

impl Event {
    /// An upper bound of the memory the event holds (its strings' lengths and generous
    /// constants for the rest), and so of its JSON: what a queue of events counts to be
    /// bounded by bytes. Some 1.2 KB for an account's opening, up to some 8 KB for a
    /// multi-leg transfer of 16 legs between 64-character account ids.
    pub fn weight(&self) -> usize {
        let data = match &self.data {
            EventData::Account(a) => {
                a.id.as_str().len()
                    + a.deployment.as_str().len()
                    + a.name.as_ref().map_or(0, |n| n.as_str().len())
                    + (a.pending_transactions.len() + a.fenced_transactions.len())
                        * ITEM_FIXED_BYTES
            }
            EventData::Transfer(t) => {
                let legs = t.legs.as_deref().map_or(0, |l| {
                    let legs: usize = l
                        .legs()
                        .iter()
                        .map(|g| g.source.as_str().len() + g.destination.as_str().len())
                        .sum();
                    let parties: usize = l
                        .parties()
                        .iter()
                        .map(|p| p.account.as_str().len() + p.deployment.as_str().len())
                        .sum();
                    legs + parties + (l.legs().len() + l.parties().len()) * ITEM_FIXED_BYTES
                });
                t.source.as_str().len()
                    + t.destination.as_str().len()
                    + t.source_deployment.as_str().len()
                    + t.destination_deployment.as_str().len()
                    + legs
                    + t.owner.as_ref().map_or(0, String::len)
                    + t.refused_account.as_ref().map_or(0, |a| a.as_str().len())
                    + t.reference.as_ref().map_or(0, |r| r.as_str().len())
                    + t.idempotency_key
                        .as_ref()
                        .map_or(0, |k| k.key.as_str().len())
                    + t.request_hash.as_ref().map_or(0, String::len)
            }
        };
        EVENT_FIXED_BYTES
            + self.id.len()
            + self.deployment.as_str().len()
            + self.position.id.len()
            + data
    }
}

impl Event {
    /// Whether `tenant` sees it: one of its transfer's tenants, or its account's.
    pub fn is_seen_by(&self, tenant: &TenantName) -> bool {
        match &self.data {
            EventData::Transfer(t) => t.tenants.names().contains(tenant),
            EventData::Account(a) => a.tenant.as_ref() == Some(tenant),
        }
    }
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
/// time (those of one native transaction, or of several shards). With an empty id, the
/// start of a cluster time, before every event of it: a position that names no event,
/// where a reader without one starts (`docs/events.md`).
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

/// Deployments a cursor may name beyond those the instance reading it serves, each at the
/// start of its feed: a deployment is added by a rolling restart (`docs/scaling.md`),
/// before any account is opened on it, so while it runs an instance that already has it
/// gives cursors naming it at [`Position::start`] to readers whose next request may reach
/// an instance that does not have it yet. Such a position says nothing read and is left
/// out of the cursor read. More than this many: no cursor of this service.
pub const ADDED_AT_ONCE: usize = 4;

/// The longest id an event has: its type, `:` and its subject, an account id for
/// `account.opened` and a transfer id (24 hexadecimal digits) for the others.
const LONGEST_EVENT_ID: usize = {
    let mut longest = 0;
    let mut i = 0;
    while i < EventType::ALL.len() {
        let subject = match EventType::ALL[i] {
            EventType::AccountOpened => AccountId::MAX_LEN,
            _ => 24,
        };
        let n = EventType::ALL[i].as_str().len() + 1 + subject;
        if n > longest {
            longest = n;
        }
        i += 1;
    }
    longest
};

impl Position {
    /// The longest id a position of a real cursor holds (an event's, see
    /// [`event_id`]).
    pub const MAX_ID_LEN: usize = LONGEST_EVENT_ID;

    /// Whether `id` is one a position of this service holds: empty ([`Position::start`])
    /// or an event's id, `<type>:<subject>`, a subject being an account id or a transfer
    /// id (whose 24 hexadecimal digits are an account id's characters too). The type is
    /// checked by its form (lowercase letters, `.` and `_`), not against the types this
    /// version knows, so that a cursor of a later version that records a new type still
    /// reads here during a rolling upgrade.
    fn is_real_id(id: &str) -> bool {
        if id.is_empty() {
            return true;
        }
        if id.len() > Self::MAX_ID_LEN {
            return false;
        }
        let Some((kind, subject)) = id.split_once(':') else {
            return false;
        };
        let type_char = |c: char| c.is_ascii_lowercase() || c == '.' || c == '_';
        !kind.is_empty() && kind.chars().all(type_char) && AccountId::parse(subject).is_ok()
    }
}

/// A cursor as sent: `{"v": 1, "p": {"<deployment>": [seconds, increment, "<id>"]}}`,
/// nothing more; the positions in the order sent, so that a name sent twice is seen.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire {
    v: u64,
    p: WirePositions,
}

struct WirePositions(Vec<(String, (u32, u32, String))>);

impl<'de> serde::Deserialize<'de> for WirePositions {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = WirePositions;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of deployment names to positions")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<WirePositions, A::Error> {
                let mut found = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    found.push(entry);
                }
                Ok(WirePositions(found))
            }
        }
        d.deserialize_map(Visitor)
    }
}

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

    /// A cursor [`FeedCursor::encode`] made, whichever deployments it names; anything
    /// else is refused (a name twice, a position no event has). For a cursor of this
    /// instance's own making (the dispatcher's); a client's goes through
    /// [`FeedCursor::parse_for`].
    pub fn parse(raw: &str) -> Result<FeedCursor, ParseError> {
        let mut positions = BTreeMap::new();
        for (deployment, position) in Self::positions(raw)? {
            positions.insert(deployment, position);
        }
        Ok(FeedCursor { positions })
    }

    /// A cursor a client sent to an instance that serves `deployments`: refused unless
    /// some instance of this service could have given it. At most
    /// [`FeedCursor::max_encoded_len`] characters; a position per deployment served at
    /// most, each name once, each id an event's ([`Position::MAX_ID_LEN`] at most); a
    /// deployment not served only at its start (at most [`ADDED_AT_ONCE`] of them, left
    /// out). So what the cursor holds, and every cursor made from it, is bounded by the
    /// deployments served, never by what the client sent.
    pub fn parse_for(raw: &str, deployments: &[DeploymentName]) -> Result<FeedCursor, ParseError> {
        let longest = Self::max_encoded_len(deployments);
        if raw.len() > longest {
            return Err(ParseError(format!(
                "is longer than any cursor this service gives ({longest} characters at most)"
            )));
        }
        let mut positions = BTreeMap::new();
        let mut added = 0;
        for (deployment, position) in Self::positions(raw)? {
            if deployments.contains(&deployment) {
                positions.insert(deployment, position);
            } else if position == Position::start() && added < ADDED_AT_ONCE {
                added += 1;
            } else if position == Position::start() {
                return Err(ParseError(format!(
                    "names more deployments than this service serves ({} and {ADDED_AT_ONCE} being added at most)",
                    deployments.len()
                )));
            } else {
                return Err(ParseError(format!(
                    "names deployment {deployment}, which this service does not serve"
                )));
            }
        }
        Ok(FeedCursor { positions })
    }

    /// The length of the longest cursor [`FeedCursor::parse_for`] accepts for
    /// `deployments`: each at the longest position, and [`ADDED_AT_ONCE`] more of the
    /// longest name at the start.
    pub fn max_encoded_len(deployments: &[DeploymentName]) -> usize {
        let longest = Position {
            seconds: u32::MAX,
            increment: u32::MAX,
            id: "x".repeat(Position::MAX_ID_LEN),
        };
        let mut cursor = FeedCursor::default();
        for d in deployments {
            cursor.positions.insert(d.clone(), longest.clone());
        }
        let mut n = 0;
        while cursor.positions.len() < deployments.len() + ADDED_AT_ONCE {
            let name = format!("{n:->width$}", width = DeploymentName::MAX_LEN);
            let name = DeploymentName::parse(&name).expect("a deployment name");
            cursor.positions.entry(name).or_insert_with(Position::start);
            n += 1;
        }
        cursor.encode().len()
    }

    /// An upper bound of the memory the cursor holds (see [`Event::weight`]).
    pub fn weight(&self) -> usize {
        let positions: usize = self
            .positions
            .iter()
            .map(|(d, p)| d.as_str().len() + p.id.len() + ITEM_FIXED_BYTES)
            .sum();
        ITEM_FIXED_BYTES + positions
    }

    /// The positions `raw` holds, in the order sent, each name once, each checked.
    fn positions(raw: &str) -> Result<Vec<(DeploymentName, Position)>, ParseError> {
        let refuse = || ParseError("is not a cursor this service gave".into());
        let bytes = URL_SAFE_NO_PAD.decode(raw).map_err(|_| refuse())?;
        let wire: Wire = serde_json::from_slice(&bytes).map_err(|_| refuse())?;
        if wire.v != CURSOR_VERSION {
            return Err(refuse());
        }
        let mut found: Vec<(DeploymentName, Position)> = Vec::with_capacity(wire.p.0.len());
        let mut seen = std::collections::BTreeSet::new();
        for (name, (seconds, increment, id)) in wire.p.0 {
            let deployment = DeploymentName::parse(&name).map_err(|_| refuse())?;
            if !seen.insert(deployment.clone()) {
                return Err(ParseError(format!("names deployment {deployment} twice")));
            }
            if !Position::is_real_id(&id) {
                return Err(ParseError(format!(
                    "holds a position for {deployment} that is no event's (an event id is at most {} characters)",
                    Position::MAX_ID_LEN
                )));
            }
            let position = Position {
                seconds,
                increment,
                id,
            };
            found.push((deployment, position));
        }
        Ok(found)
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

    fn names(raw: &[&str]) -> Vec<DeploymentName> {
        raw.iter()
            .map(|n| DeploymentName::parse(n).unwrap())
            .collect()
    }

    fn wire(json: &str) -> String {
        URL_SAFE_NO_PAD.encode(json)
    }

    /// The longest cursor a client of an instance serving `served` can hold: each served
    /// deployment at the longest position, and as many deployments being added as may be.
    fn largest(served: &[DeploymentName]) -> (String, FeedCursor) {
        let mut cursor = FeedCursor::default();
        for d in served {
            let id = event_id(EventType::AccountOpened, &"a".repeat(AccountId::MAX_LEN));
            cursor
                .positions
                .insert(d.clone(), position(u32::MAX, u32::MAX, &id));
        }
        let mut sent = cursor.clone();
        for n in 0..ADDED_AT_ONCE {
            let name = format!("{n:z>width$}", width = DeploymentName::MAX_LEN);
            sent.positions
                .insert(DeploymentName::parse(&name).unwrap(), Position::start());
        }
        (sent.encode(), cursor)
    }

    #[test]
    fn a_client_cursor_is_bounded_by_the_deployments_served_and_refused_one_past_each_bound() {
        let served = names(&["default", "eu"]);
        // Length: the largest real cursor is accepted, one character more is not.
        let (raw, read) = largest(&served);
        assert_eq!(raw.len(), FeedCursor::max_encoded_len(&served));
        assert_eq!(FeedCursor::parse_for(&raw, &served).unwrap(), read);
        let longer = format!("{raw}A");
        let refused = FeedCursor::parse_for(&longer, &served).unwrap_err();
        assert!(refused.0.contains("longer than any cursor"), "{refused:?}");

        // An id: an account's of the longest length is accepted, one more is not.
        let subject = "a".repeat(AccountId::MAX_LEN);
        let ok = wire(&format!(
            r#"{{"v":1,"p":{{"eu":[1,2,"account.opened:{subject}"]}}}}"#
        ));
        assert!(FeedCursor::parse_for(&ok, &served).is_ok());
        let too_long = wire(&format!(
            r#"{{"v":1,"p":{{"eu":[1,2,"account.opened:{subject}a"]}}}}"#
        ));
        let refused = FeedCursor::parse_for(&too_long, &served).unwrap_err();
        assert!(refused.0.contains("no event's"), "{refused:?}");

        // Deployments not served: at their start, up to ADDED_AT_ONCE, left out; one more,
        // or one with a position, refused.
        let added = |n: usize| {
            let p: Vec<String> = (0..n).map(|i| format!(r#""new{i}":[0,0,""]"#)).collect();
            wire(&format!(
                r#"{{"v":1,"p":{{"eu":[1,2,""],{}}}}}"#,
                p.join(",")
            ))
        };
        let read = FeedCursor::parse_for(&added(ADDED_AT_ONCE), &served).unwrap();
        assert_eq!(read.positions.len(), 1, "{read:?}");
        let refused = FeedCursor::parse_for(&added(ADDED_AT_ONCE + 1), &served).unwrap_err();
        assert!(refused.0.contains("more deployments"), "{refused:?}");
        let unknown = wire(r#"{"v":1,"p":{"us":[1,2,"transfer.done:6b0619d67d0e8af2ac0b1adf"]}}"#);
        let refused = FeedCursor::parse_for(&unknown, &served).unwrap_err();
        assert!(refused.0.contains("does not serve"), "{refused:?}");
    }

    #[test]
    fn a_cursor_naming_a_deployment_twice_or_holding_what_no_event_has_is_refused() {
        let served = names(&["default", "eu"]);
        let cases = [
            r#"{"v":1,"p":{"eu":[1,2,""],"eu":[3,4,""]}}"#,
            r#"{"v":1,"v":1,"p":{}}"#,
            r#"{"v":1,"p":{},"x":1}"#,
            r#"{"v":1,"p":{"eu":[1,2,"",4]}}"#,
            r#"{"v":1,"p":{"eu":[1,2,"Transfer.Done:6b0619d67d0e8af2ac0b1adf"]}}"#,
            r#"{"v":1,"p":{"eu":[1,2,"transfer.done:al ice"]}}"#,
            r#"{"v":1,"p":{"eu":[1,2,":alice"]}}"#,
            r#"{"v":1,"p":{"eu":[1,2,"account.opened:"]}}"#,
            r#"{"v":1,"p":{"eu":[1,2,"alice"]}}"#,
            r#"{"v":1,"p":{"eu":[-1,2,""]}}"#,
        ];
        for json in cases {
            assert!(
                FeedCursor::parse_for(&wire(json), &served).is_err(),
                "{json} was accepted"
            );
            assert!(
                FeedCursor::parse(&wire(json)).is_err(),
                "{json} was accepted"
            );
        }
        let twice = FeedCursor::parse_for(&wire(cases[0]), &served).unwrap_err();
        assert!(twice.0.contains("twice"), "{twice:?}");
    }

    #[test]
    fn a_position_at_an_event_of_a_type_a_later_version_records_still_reads() {
        let served = names(&["eu"]);
        let later =
            wire(r#"{"v":1,"p":{"eu":[1,2,"transfer.reversed:6b0619d67d0e8af2ac0b1adf"]}}"#);
        let read = FeedCursor::parse_for(&later, &served).unwrap();
        assert_eq!(read.positions.len(), 1);
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
