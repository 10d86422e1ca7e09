//! The history: what the clients saw. Every answer is recorded as it comes and judged on
//! the spot: only the answers this scenario can legitimately produce are (any other 4xx
//! or 5xx is a violation). The definitive ones are kept, to be compared with the final
//! state ([`super::answers`]); the requests and the captures, voids and cancels that
//! never got one are counted as unknown outcomes, the requests looked up at the end
//! ([`super::requests`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::Instant;

use serde_json::Value;
use transfer_service::domain::{CancelReason, Timestamp, TransferState};

use crate::workload::{HeldHold, HoldPlan, Request, Resolve, code_of, retryable};

/// A definitive answer a client got, kept to be compared with the final state.
#[derive(Debug)]
pub enum Answer {
    /// A transfer request answered 201, 202, 409 or 422, naming transfer `id`; `replayed`
    /// when the answer said so; the attempt that got it was `sent` and `answered` then.
    Transfer {
        request: Request,
        status: u16,
        id: String,
        body: Value,
        replayed: bool,
        sent: Instant,
        answered: Instant,
    },
    /// A cancel of transfer `id` answered 200 or 422.
    Cancel {
        id: String,
        status: u16,
        body: Value,
    },
    /// A capture or a void of a hold answered 200 or 409.
    Resolve(ResolveAnswer),
}

/// A capture or a void of `hold` answered 200 or 409; `first_sent` is when its first
/// attempt left, `answered` when this answer came (the test's clock, the database's).
#[derive(Debug)]
pub struct ResolveAnswer {
    pub hold: HeldHold,
    pub resolve: Resolve,
    pub first_sent: Timestamp,
    pub answered: Timestamp,
    pub status: u16,
    pub body: Value,
}

/// What the clients saw.
#[derive(Default)]
pub struct History {
    /// Transfers answered 201 `done`.
    pub done: HashSet<String>,
    /// Per idempotency key, every transfer id it was answered with.
    pub keys: HashMap<String, HashSet<String>>,
    /// Known transfer ids, for cancels.
    pub ids: Vec<String>,
    /// Answers by operation, status and code.
    pub answers: BTreeMap<String, u64>,
    /// Statuses and codes a client must never see.
    pub violations: Vec<String>,
    /// Every definitive answer, to compare with the final state.
    pub seen: Vec<Answer>,
    /// Every request sent at least once, by reference.
    pub requests: HashMap<String, Request>,
    /// Idempotency keys sent at least once, to tell a genuine replay from a stray one.
    pub sent_keys: HashSet<String>,
    /// Requests sent at least once that never got a definitive answer (all attempts lost
    /// their connection or were answered 503): their outcome is unknown to the client.
    pub unanswered: Vec<Request>,
    /// Requests never sent: no live instance to send them to.
    pub unsent: u64,
    /// Cancels whose outcome the client does not know (connection lost, 503).
    pub cancels_unknown: u64,
    /// Transfer requests being sent right now, by reference, with the slot of the
    /// instance they were sent to.
    pub in_flight: HashMap<String, usize>,
    /// The killed instances' unfinished transfers canceled on the survivors, by the state
    /// they were found in.
    pub recovery_targets: BTreeMap<String, u64>,
    /// Holds answered `held`, by what their client did with them.
    pub hold_plans: BTreeMap<HoldPlan, u64>,
    /// Captures and voids whose outcome the client never learned (every attempt lost its
    /// connection or was answered 503).
    pub resolves_unknown: u64,
    /// The requests (by reference) answered with what they must never be: their
    /// transfers are shown at the end.
    pub suspects: Vec<String>,
}

impl History {
    pub fn count(&mut self, what: &str) {
        *self.answers.entry(what.to_owned()).or_default() += 1;
    }

    /// Notes that `request` is being sent to the instance in slot `slot`; returns whether
    /// its idempotency key had been sent before.
    pub fn sending(&mut self, request: &Request, slot: usize) -> bool {
        self.requests
            .entry(request.reference.clone())
            .or_insert_with(|| request.clone());
        let mut sent_before = false;
        if let Some(key) = &request.key {
            sent_before = !self.sent_keys.insert(key.clone());
        }
        self.in_flight.insert(request.reference.clone(), slot);
        sent_before
    }
}

/// One attempt of a transfer request: its number (0 for the first), whether its
/// idempotency key had been sent before, and when it left.
pub struct Attempt {
    pub number: usize,
    pub sent_before: bool,
    pub sent: Instant,
}

/// Records one transfer answer, got by `attempt`; false when it asks for a retry (503).
pub fn record_transfer(
    history: &Mutex<History>,
    request: &Request,
    attempt: &Attempt,
    status: u16,
    replayed: bool,
    answer: &Value,
) -> bool {
    let answered = Instant::now();
    let code = code_of(answer);
    let id = match status {
        201 | 202 => answer["id"].as_str(),
        _ => answer["transferId"].as_str(),
    }
    .map(str::to_owned);
    let state = answer["state"].as_str().and_then(TransferState::parse);
    let mut h = history.lock().unwrap();
    h.count(&transfer_label(
        request, attempt, status, state, code, replayed,
    ));
    if retryable(status, code) {
        return false;
    }
    if !legitimate_transfer(request, status, code, state, replayed) || id.is_none() {
        h.violations.push(format!(
            "transfer {} answered {status}{} at {} (attempt {}, sent {:?} before): {answer}; \
             request {request:?}",
            request.reference,
            if replayed { " (replayed)" } else { "" },
            chrono::Utc::now(),
            attempt.number,
            answered - attempt.sent,
        ));
        h.suspects.push(request.reference.clone());
        return true;
    }
    if replayed && !attempt.sent_before {
        h.violations.push(format!(
            "transfer {} answered as a replay of a key never sent before: {answer}",
            request.reference
        ));
    }
    let id = id.unwrap();
    if status == 201 && state == Some(TransferState::Done) {
        h.done.insert(id.clone());
    }
    if let Some(key) = &request.key {
        h.keys.entry(key.clone()).or_default().insert(id.clone());
    }
    h.ids.push(id.clone());
    h.seen.push(Answer::Transfer {
        request: request.clone(),
        status,
        id,
        body: answer.clone(),
        replayed,
        sent: attempt.sent,
        answered,
    });
    true
}

/// What a transfer answer is counted under: the operation, the status, a hold's
/// answered state, the problem code, and whether it was replayed or got by a retry.
fn transfer_label(
    request: &Request,
    attempt: &Attempt,
    status: u16,
    state: Option<TransferState>,
    code: &str,
    replayed: bool,
) -> String {
    format!(
        "{}: {status}{}{}{}{}",
        if request.hold.is_some() {
            "hold"
        } else {
            "transfer"
        },
        match (status, state) {
            (201, Some(state)) if request.hold.is_some() => format!(" {state}"),
            _ => String::new(),
        },
        if code.is_empty() {
            String::new()
        } else {
            format!(" {code}")
        },
        if replayed { " replayed" } else { "" },
        if attempt.number > 0 { " (retry)" } else { "" }
    )
}

/// The answers this scenario can legitimately produce; everything else is a violation
/// (no account is ever missing, no balance can come near overflowing, no key is reused
/// with another body, every request is well formed). A hold is answered `held`, or,
/// replayed after its capture, `done`.
fn legitimate_transfer(
    request: &Request,
    status: u16,
    code: &str,
    state: Option<TransferState>,
    replayed: bool,
) -> bool {
    match (status, code) {
        (201, "") => match request.hold {
            None => state == Some(TransferState::Done),
            Some(_) => {
                state == Some(TransferState::Held)
                    || (replayed && state == Some(TransferState::Done))
            }
        },
        (202, "") => state.is_some_and(|s| !s.is_terminal() && s != TransferState::Held),
        (409, "transfer_canceled") | (422, "insufficient_funds") => true,
        _ => false,
    }
}

/// Records the answer to a cancel of transfer `id`, counted under `label`: `None` when
/// it was lost (status 0 when the connection was).
pub fn record_cancel(
    history: &Mutex<History>,
    id: String,
    label: &str,
    status: u16,
    answer: Option<Value>,
) {
    let mut h = history.lock().unwrap();
    let Some(answer) = answer else {
        h.count(&format!("{label}: connection lost"));
        h.cancels_unknown += 1;
        return;
    };
    let code = code_of(&answer);
    let state = answer["state"].as_str().and_then(TransferState::parse);
    h.count(&format!(
        "{label}: {status} {}",
        match (status, state) {
            (200, Some(state)) => state.as_str(),
            _ => code,
        }
    ));
    if retryable(status, code) {
        h.cancels_unknown += 1;
        return;
    }
    let legitimate = match (status, code) {
        // Rolled back (or canceled before, for any reason), or reversed.
        (200, "") => match state {
            Some(TransferState::Canceled) => answer["reason"].is_string(),
            Some(TransferState::Done) => answer["reversedBy"].is_string(),
            _ => false,
        },
        // The reversal is under way on another instance (it may still be refused).
        (202, "") => state == Some(TransferState::Done) && answer["reversedBy"].is_string(),
        // The destination cannot fund the reversal.
        (422, "insufficient_funds") => true,
        _ => false,
    };
    if legitimate && (status == 422 || answer["id"] == id.as_str()) {
        h.seen.push(Answer::Cancel {
            id,
            status,
            body: answer,
        });
    } else {
        h.violations
            .push(format!("cancel of {id} answered {status}: {answer}"));
    }
}

/// One attempt of a capture or a void: of which hold, which, when its first attempt
/// left, and whether this one is a retry.
pub struct ResolveAttempt<'a> {
    pub hold: &'a HeldHold,
    pub resolve: Resolve,
    pub first_sent: Timestamp,
    pub retry: bool,
}

/// Records the answer a capture or a void got by `attempt`; false when it asks for a
/// retry (503).
pub fn record_resolve(
    history: &Mutex<History>,
    attempt: &ResolveAttempt,
    status: u16,
    answer: Value,
) -> bool {
    let answered = chrono::Utc::now();
    let (hold, resolve) = (attempt.hold, attempt.resolve);
    let label = resolve.path();
    let retry = if attempt.retry { " (retry)" } else { "" };
    let code = code_of(&answer);
    let mut h = history.lock().unwrap();
    h.count(&format!(
        "{label}: {status} {}{retry}",
        match status {
            200 => answer["state"].as_str().unwrap_or("?"),
            _ => code,
        }
    ));
    if retryable(status, code) {
        return false;
    }
    if legitimate_resolve(hold, resolve, status, &answer) {
        h.seen.push(Answer::Resolve(ResolveAnswer {
            hold: hold.clone(),
            resolve,
            first_sent: attempt.first_sent,
            answered,
            status,
            body: answer,
        }));
    } else {
        h.violations.push(format!(
            "{label} {resolve:?} of hold {} answered {status}: {answer}",
            hold.id
        ));
    }
    true
}

/// What a capture or a void of a hold that was `held` may answer.
fn legitimate_resolve(hold: &HeldHold, resolve: Resolve, status: u16, answer: &Value) -> bool {
    let wanted = match resolve {
        Resolve::Capture { amount } => amount.unwrap_or(hold.held),
        Resolve::Void => 0,
    };
    let state = answer["state"].as_str().and_then(TransferState::parse);
    let reason = answer["reason"].as_str().and_then(CancelReason::parse);
    match (resolve, status, code_of(answer)) {
        (Resolve::Capture { .. }, 200, "") => {
            answer["id"] == hold.id.as_str()
                && matches!(state, Some(TransferState::Done | TransferState::Capturing))
                && answer["amount"] == wanted
                && answer["heldAmount"] == hold.held
        }
        (
            Resolve::Capture { .. },
            409,
            "hold_already_captured" | "hold_voided" | "hold_expired",
        )
        | (Resolve::Void, 409, "hold_already_captured") => answer["transferId"] == hold.id.as_str(),
        (Resolve::Void, 200, "") => {
            answer["id"] == hold.id.as_str()
                && matches!(
                    state,
                    Some(TransferState::Canceled | TransferState::Canceling)
                )
                && matches!(reason, Some(CancelReason::Voided | CancelReason::Expired))
        }
        _ => false,
    }
}
