//! Idempotency keys and references, against what is stored: one request, at most one
//! transfer, the one answered ([`check_requests`]).

use std::collections::{BTreeMap, HashMap};

use transfer_service::domain::{Transfer, TransferId};

use super::Checks;
use super::history::History;
use crate::deployments::{KeyRecord, Layout};
use crate::workload::Request;

/// The stored transfers by (log, idempotency key) and by reference.
struct Recorded<'a> {
    keys: HashMap<(&'a str, &'a str), Vec<&'a Transfer>>,
    references: HashMap<&'a str, Vec<&'a Transfer>>,
}

/// Idempotency keys and references: one request, at most one transfer, the one
/// answered. A key is unique among the transfers of one log (its source's deployment),
/// and taken there (`idempotencyKeys`) for that very transfer; as no client uses a key
/// with two sources, no key is recorded in two logs either. Then the requests whose
/// outcome the client never learned are looked up (by key in their source's log, or by
/// reference): if recorded, each must have finished. Returns how many of those there
/// were, by kind.
pub fn check_requests(
    layout: Layout,
    transfers: &[Transfer],
    by_id: &HashMap<TransferId, &Transfer>,
    key_records: &[KeyRecord],
    history: &History,
    checks: &mut Checks,
) -> BTreeMap<&'static str, u64> {
    let recorded = recorded(transfers, history, checks);
    check_answered_keys(layout, &recorded, history, checks);
    check_recorded_keys(&recorded, key_records, checks);
    check_taken_keys(by_id, key_records, checks);
    for (reference, ts) in &recorded.references {
        checks.check(
            "a request makes at most one transfer",
            ts.len() == 1,
            || {
                let ids: Vec<String> = ts.iter().map(|t| t.id.to_string()).collect();
                format!("request {reference} made {ids:?}")
            },
        );
    }
    look_up_unanswered(layout, &recorded, history, checks)
}

/// The stored transfers by key and by reference; and each transfer (a reversal aside)
/// was asked for by a request, which it matches.
fn recorded<'a>(transfers: &'a [Transfer], history: &History, checks: &mut Checks) -> Recorded<'a> {
    // By (log, key).
    let mut recorded_keys: HashMap<(&str, &str), Vec<&Transfer>> = HashMap::new();
    let mut recorded_references: HashMap<&str, Vec<&Transfer>> = HashMap::new();
    for t in transfers {
        if let Some(key) = &t.idempotency_key {
            recorded_keys
                .entry((t.source_deployment.as_str(), key.key.as_str()))
                .or_default()
                .push(t);
        }
        if let Some(reference) = &t.reference {
            recorded_references
                .entry(reference.as_str())
                .or_default()
                .push(t);
        }
        if t.reverses.is_none() {
            let request = t
                .reference
                .as_ref()
                .and_then(|r| history.requests.get(r.as_str()));
            checks.check(
                "every transfer was asked for and matches its request",
                request.is_some_and(|r| {
                    r.mismatch(t).is_none()
                        && r.key.as_deref() == t.idempotency_key.as_ref().map(|k| k.key.as_str())
                }),
                || format!("{t:?} was asked for by {request:?}"),
            );
        }
    }
    Recorded {
        keys: recorded_keys,
        references: recorded_references,
    }
}

/// Every key answered with a transfer was answered with one only, recorded on it in
/// its source's log.
fn check_answered_keys(layout: Layout, stored: &Recorded, history: &History, checks: &mut Checks) {
    let requests_by_key: HashMap<&str, &Request> = history
        .requests
        .values()
        .filter_map(|r| r.key.as_deref().map(|k| (k, r)))
        .collect();
    for (key, ids) in &history.keys {
        checks.check(
            "a key is answered with one transfer",
            ids.len() == 1,
            || format!("key {key} answered with {ids:?}"),
        );
        let log = requests_by_key
            .get(key.as_str())
            .map(|r| layout.home_of(&r.source))
            .unwrap_or_default();
        let recorded: Vec<String> = stored
            .keys
            .get(&(log, key.as_str()))
            .map(|ts| ts.iter().map(|t| t.id.to_string()).collect())
            .unwrap_or_default();
        checks.check(
            "a key answered with a transfer is recorded on it, in its source's log",
            ids.iter().all(|id| recorded == [id.clone()]),
            || format!("key {key} answered with {ids:?} but recorded on {recorded:?} in {log}"),
        );
    }
}

/// Every key recorded on a transfer is recorded once in its log, in one log only, and
/// taken there for that transfer.
fn check_recorded_keys(recorded: &Recorded, key_records: &[KeyRecord], checks: &mut Checks) {
    let mut logs_of_key: HashMap<&str, Vec<&str>> = HashMap::new();
    for ((log, key), ts) in &recorded.keys {
        checks.check("a key is recorded once in a log", ts.len() == 1, || {
            format!("key {key} recorded {} times in {log}", ts.len())
        });
        logs_of_key.entry(key).or_default().push(log);
        let taken: Vec<Option<TransferId>> = key_records
            .iter()
            .filter(|r| r.deployment == *log && r.key == *key)
            .map(|r| r.transfer)
            .collect();
        checks.check(
            "a recorded key is taken in its log, for its transfer",
            ts.iter().all(|t| taken == [Some(t.id)]),
            || format!("key {key} recorded in {log} on {ts:?} but taken there for {taken:?}"),
        );
    }
    for (key, logs) in &logs_of_key {
        checks.check(
            "a key used with one source only is recorded in one log only",
            logs.len() == 1,
            || format!("key {key} recorded in {logs:?}"),
        );
    }
}

/// Every key taken for a stored transfer is taken in that transfer's log, which carries
/// it.
fn check_taken_keys(
    by_id: &HashMap<TransferId, &Transfer>,
    key_records: &[KeyRecord],
    checks: &mut Checks,
) {
    for record in key_records {
        // A key taken for a transfer never recorded (its request died or was refused in
        // between) names no stored transfer: that is allowed.
        let Some(t) = record.transfer.and_then(|id| by_id.get(&id)) else {
            continue;
        };
        checks.check(
            "a key is taken for a transfer of its own log that carries it",
            t.source_deployment.as_str() == record.deployment
                // No API keys here: every key is shared, stored as sent.
                && t.idempotency_key.as_ref().map(|k| k.key.as_str()) == Some(record.key.as_str()),
            || {
                format!(
                    "key {} taken in {} for {t:?}",
                    record.key, record.deployment
                )
            },
        );
    }
}

/// The requests whose outcome the client never learned, looked up by key in their
/// source's log or by reference: if recorded, each must have finished. Returns how many
/// there were, by kind.
fn look_up_unanswered(
    layout: Layout,
    recorded: &Recorded,
    history: &History,
    checks: &mut Checks,
) -> BTreeMap<&'static str, u64> {
    let mut unknown: BTreeMap<&'static str, u64> = BTreeMap::new();
    for request in &history.unanswered {
        let found = match &request.key {
            Some(key) => recorded
                .keys
                .get(&(layout.home_of(&request.source), key.as_str())),
            None => recorded.references.get(request.reference.as_str()),
        }
        .and_then(|ts| ts.first().copied());
        let kind = match (&request.key, found) {
            (Some(_), Some(_)) => "keyed, recorded",
            (Some(_), None) => "keyed, never recorded",
            (None, Some(_)) => "keyless, recorded",
            (None, None) => "keyless, never recorded",
        };
        *unknown.entry(kind).or_default() += 1;
        if let Some(t) = found {
            checks.check(
                "an unanswered request's transfer ends terminal",
                t.state.is_terminal(),
                || format!("{request:?} never answered and its transfer is {t:?}"),
            );
        }
    }
    unknown
}
