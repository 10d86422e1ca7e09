//! Every definitive answer a client got, against the final state: each on its own
//! ([`check_answer`]), all those about one hold together ([`check_hold_winners`]), and
//! those answered while a deployment was down ([`check_outage`]).

use std::collections::{HashMap, HashSet};

use serde_json::Value;
use transfer_service::domain::{CancelReason, Timestamp, Transfer, TransferId, TransferState};

use super::Checks;
use super::history::{Answer, ResolveAnswer};
use crate::deployments::Layout;
use crate::nemesis::Outage;
use crate::workload::{Request, Resolve, code_of};

/// How far the test's clock and the database's may disagree when an answer is compared
/// with a hold's `expiresAt` (the same host's clock; the stored times are milliseconds).
const CLOCK_TOLERANCE_MS: i64 = 50;

/// The stored transfer of id `id`, if any.
fn find<'a>(by_id: &HashMap<TransferId, &'a Transfer>, id: &str) -> Option<&'a Transfer> {
    TransferId::parse(id)
        .ok()
        .and_then(|id| by_id.get(&id).copied())
}

/// Compares one definitive answer a client got with the final state. With `same_clock`
/// (the database runs on this host), an answer about a hold is also compared in time
/// with its `expiresAt`.
pub fn check_answer(
    answer: &Answer,
    by_id: &HashMap<TransferId, &Transfer>,
    same_clock: bool,
    checks: &mut Checks,
) {
    match answer {
        Answer::Transfer {
            request,
            status,
            id,
            body,
            ..
        } => check_transfer_answer(request, *status, id, body, by_id, checks),
        Answer::Resolve(resolved) => check_resolve_answer(resolved, by_id, same_clock, checks),
        Answer::Cancel { id, status, body } => {
            check_cancel_answer(id, *status, body, by_id, checks)
        }
    }
}

/// A transfer request's answer (a hold's, see [`check_hold_request_answer`]).
fn check_transfer_answer(
    request: &Request,
    status: u16,
    id: &str,
    body: &Value,
    by_id: &HashMap<TransferId, &Transfer>,
    checks: &mut Checks,
) {
    let found = find(by_id, id);
    checks.check("answered transfer is stored", found.is_some(), || {
        format!("{id}, answered {status} {body}, is not in the database")
    });
    let Some(t) = found else { return };
    checks.check(
        "answered transfer matches its request",
        request.mismatch(t).is_none(),
        || request.mismatch(t).unwrap_or_default(),
    );
    if request.hold.is_some() && check_hold_request_answer(status, id, body, t, checks) {
        return;
    }
    let expected = match (status, code_of(body)) {
        (201, _) => Some((TransferState::Done, None)),
        (409, _) => Some((
            TransferState::Canceled,
            Some(CancelReason::CanceledByRequest),
        )),
        (422, code) => Some((TransferState::Canceled, CancelReason::parse(code))),
        // 202: it only has to be terminal in the end.
        _ => None,
    };
    match expected {
        Some((state, reason)) => checks.check(
            "a transfer answer agrees with the final state",
            t.state == state && t.reason == reason,
            || {
                format!(
                    "{id} answered {status} {body} but ends {} ({:?})",
                    t.state, t.reason
                )
            },
        ),
        None => checks.check("a 202 ends terminal", t.state.is_terminal(), || {
            format!("{id} answered 202 and ends {}", t.state)
        }),
    }
}

/// A hold request's answer, stored as `t`: 201 `held`, 201 `done` (a replay after its
/// capture) and 409 have checks of their own; false for the others (422, 202), which are
/// checked as a transfer's.
fn check_hold_request_answer(
    status: u16,
    id: &str,
    body: &Value,
    t: &Transfer,
    checks: &mut Checks,
) -> bool {
    let answered_state = body["state"].as_str().and_then(TransferState::parse);
    match (status, answered_state) {
        (201, Some(TransferState::Held)) => {
            checks.check(
                "a hold answered held is stored as that hold",
                t.hold.is_some_and(|h| {
                    body["heldAmount"] == h.amount.minor_units()
                        && body["expiresAt"]
                            .as_str()
                            .and_then(|e| e.parse::<Timestamp>().ok())
                            == Some(h.expires_at)
                }),
                || format!("{id} answered {status} {body} but is stored as {t:?}"),
            );
            checks.check(
                "a hold answered held ends captured, voided or expired",
                t.state == TransferState::Done
                    || (t.state == TransferState::Canceled
                        && matches!(t.reason, Some(CancelReason::Voided | CancelReason::Expired))),
                || format!("{id} answered {status} {body} but ends {t:?}"),
            );
            true
        }
        (201, _) => {
            checks.check(
                "a hold answered done ends done with the answered amount",
                t.state == TransferState::Done && body["amount"] == t.amount.minor_units(),
                || format!("{id} answered {status} {body} but ends {t:?}"),
            );
            true
        }
        (409, _) => {
            checks.check(
                "a hold answered canceled ends canceled by request, voided or expired",
                t.state == TransferState::Canceled
                    && matches!(
                        t.reason,
                        Some(
                            CancelReason::CanceledByRequest
                                | CancelReason::Voided
                                | CancelReason::Expired
                        )
                    ),
                || format!("{id} answered {status} {body} but ends {t:?}"),
            );
            true
        }
        _ => false,
    }
}

/// A capture's or a void's answer: how the hold ends ([`resolve_ends`]) and, with
/// `same_clock`, when it was sent or answered ([`resolve_timing`]).
fn check_resolve_answer(
    s: &ResolveAnswer,
    by_id: &HashMap<TransferId, &Transfer>,
    same_clock: bool,
    checks: &mut Checks,
) {
    let (id, status, body) = (&s.hold.id, s.status, &s.body);
    let found = find(by_id, id);
    checks.check(
        "a captured or voided hold is stored",
        found.is_some(),
        || format!("{id}, answered {status} {body}, is not in the database"),
    );
    let Some(t) = found else { return };
    let violation = || {
        format!(
            "{} {:?} of hold {id} (held {}, expires at {}) first sent at \
             {}, answered {status} {body} at {}, but it ends {t:?}",
            s.resolve.path(),
            s.resolve,
            s.hold.held,
            s.hold.expires_at,
            s.first_sent,
            s.answered
        )
    };
    let (invariant, holds) = resolve_ends(s, t);
    checks.check(invariant, holds, violation);
    let timing = if same_clock { resolve_timing(s) } else { None };
    if let Some((invariant, holds)) = timing {
        checks.check(invariant, holds, violation);
    }
}

/// How the hold `t` must end after the capture's or the void's answer `s`: the
/// invariant, and whether it holds.
fn resolve_ends(s: &ResolveAnswer, t: &Transfer) -> (&'static str, bool) {
    let reason = s.body["reason"].as_str().and_then(CancelReason::parse);
    let ends = |state, reason| t.state == state && t.reason == reason;
    match (s.resolve, s.status, code_of(&s.body)) {
        (Resolve::Capture { amount }, 200, _) => (
            "a capture answered done ends done with the captured amount",
            ends(TransferState::Done, None)
                && t.amount.minor_units() == amount.unwrap_or(s.hold.held),
        ),
        (Resolve::Capture { amount }, 409, "hold_already_captured") => (
            "a capture refused as already captured lost to another amount",
            ends(TransferState::Done, None)
                && t.amount.minor_units() != amount.unwrap_or(s.hold.held),
        ),
        (Resolve::Void, 409, "hold_already_captured") => (
            "a void refused as already captured ends done",
            ends(TransferState::Done, None),
        ),
        (_, 409, "hold_voided") => (
            "a capture refused as voided ends voided",
            ends(TransferState::Canceled, Some(CancelReason::Voided)),
        ),
        (_, 409, _) => (
            "a capture refused as expired ends expired",
            ends(TransferState::Canceled, Some(CancelReason::Expired)),
        ),
        _ => (
            "a void answered canceled ends canceled with that reason",
            ends(TransferState::Canceled, reason),
        ),
    }
}

/// When the capture's or the void's answer `s` must have been sent or answered, by the
/// hold's `expiresAt` (the same clock): the invariant, and whether it holds; `None` when
/// the answer says nothing about time.
fn resolve_timing(s: &ResolveAnswer) -> Option<(&'static str, bool)> {
    let past = |at: &Timestamp| (*at - s.hold.expires_at).num_milliseconds();
    let answered_expired = (
        "a hold is answered expired only from expiresAt on",
        past(&s.answered) > -CLOCK_TOLERANCE_MS,
    );
    let reason = s.body["reason"].as_str().and_then(CancelReason::parse);
    match (s.resolve, s.status, code_of(&s.body)) {
        (Resolve::Capture { .. }, 200, _) => Some((
            "nothing is captured after expiresAt",
            past(&s.first_sent) < CLOCK_TOLERANCE_MS,
        )),
        (_, 409, "hold_already_captured" | "hold_voided") => None,
        (_, 409, _) => Some(answered_expired),
        _ => (reason == Some(CancelReason::Expired)).then_some(answered_expired),
    }
}

/// A cancel's answer: how the original (and its reversal, if any) ends.
fn check_cancel_answer(
    id: &str,
    status: u16,
    body: &Value,
    by_id: &HashMap<TransferId, &Transfer>,
    checks: &mut Checks,
) {
    let found = find(by_id, id);
    checks.check("canceled transfer is stored", found.is_some(), || {
        format!("{id}, canceled with {status} {body}, is not in the database")
    });
    let Some(original) = found else { return };
    let answered_state = body["state"].as_str().and_then(TransferState::parse);
    match (status, answered_state) {
        (200, Some(TransferState::Canceled)) => {
            let reason = body["reason"].as_str().and_then(CancelReason::parse);
            checks.check(
                "a cancel answered canceled ends canceled with that reason",
                original.state == TransferState::Canceled && original.reason == reason,
                || {
                    format!(
                        "cancel of {id} answered {body} but it ends {} ({:?})",
                        original.state, original.reason
                    )
                },
            );
        }
        (202, _) => {
            // Under way: whatever the reversal's outcome, the original stays done.
            checks.check(
                "a cancel answered under way leaves the original done",
                original.state == TransferState::Done,
                || {
                    format!(
                        "cancel of {id} answered {body}, but it ends {}",
                        original.state
                    )
                },
            );
        }
        (200, _) => check_reversed_answer(id, body, original, by_id, checks),
        _ => check_refused_reversal(id, body, original, by_id, checks),
    }
}

/// A cancel answered `done` with `reversedBy`: the reversal the client was told of ends
/// done, and the original names it.
fn check_reversed_answer(
    id: &str,
    body: &Value,
    original: &Transfer,
    by_id: &HashMap<TransferId, &Transfer>,
    checks: &mut Checks,
) {
    let reversal_id = body["reversedBy"].as_str().unwrap_or_default();
    let reversal = find(by_id, reversal_id);
    checks.check(
        "a cancel answered reversed ends reversed by that reversal",
        original.state == TransferState::Done
            && original.reversed_by.map(|r| r.to_string()).as_deref() == Some(reversal_id)
            && reversal
                .is_some_and(|r| r.state == TransferState::Done && r.reverses == Some(original.id)),
        || {
            format!(
                "cancel of {id} answered {body}, but the original ends {} \
                 reversedBy {:?} and the reversal is {reversal:?}",
                original.state, original.reversed_by
            )
        },
    );
}

/// A cancel refused with 422 `insufficient_funds`: nothing changed, the original stays
/// done; the refused attempt, when named, ends canceled and is not its reversal.
fn check_refused_reversal(
    id: &str,
    body: &Value,
    original: &Transfer,
    by_id: &HashMap<TransferId, &Transfer>,
    checks: &mut Checks,
) {
    let attempt = body["transferId"].as_str();
    let attempt_doc = attempt.and_then(|a| find(by_id, a));
    checks.check(
        "a refused reversal leaves the original done and not reversed by it",
        original.state == TransferState::Done
            && attempt.is_none_or(|a| {
                original.reversed_by.map(|r| r.to_string()).as_deref() != Some(a)
                    && attempt_doc.is_some_and(|r| {
                        r.state == TransferState::Canceled
                            && r.reason == Some(CancelReason::InsufficientFunds)
                            && r.reverses == Some(original.id)
                    })
            }),
        || {
            format!(
                "cancel of {id} answered {body}, but the original ends {} \
                 reversedBy {:?} and the attempt is {attempt_doc:?}",
                original.state, original.reversed_by
            )
        },
    );
}

/// What an answer says about how a hold ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Claim {
    /// Captured, with this amount if the answer says.
    Captured(Option<i64>),
    /// Canceled for this reason.
    Canceled(CancelReason),
    /// Canceled, for a reason the answer does not give.
    NotCaptured,
}

/// All the answers about one hold name at most one winner: captured (with one amount),
/// or canceled for one reason (voided, expired, by request, for funds).
pub fn check_hold_winners(
    seen: &[Answer],
    by_id: &HashMap<TransferId, &Transfer>,
    checks: &mut Checks,
) {
    let mut claims: HashMap<String, Vec<(Claim, String)>> = HashMap::new();
    let is_hold = |id: &str| find(by_id, id).is_some_and(|t| t.hold.is_some());
    for answer in seen {
        if let Some((id, claim, said)) = claim_of(answer, is_hold) {
            claims.entry(id.clone()).or_default().push((claim, said));
        }
    }
    for (id, claims) in &claims {
        let amounts: HashSet<i64> = claims
            .iter()
            .filter_map(|(c, _)| match c {
                Claim::Captured(amount) => *amount,
                _ => None,
            })
            .collect();
        let reasons: HashSet<CancelReason> = claims
            .iter()
            .filter_map(|(c, _)| match c {
                Claim::Canceled(reason) => Some(*reason),
                _ => None,
            })
            .collect();
        let captured = claims.iter().any(|(c, _)| matches!(c, Claim::Captured(_)));
        let canceled = claims.iter().any(|(c, _)| !matches!(c, Claim::Captured(_)));
        checks.check(
            "the answers about a hold name at most one winner",
            amounts.len() <= 1 && reasons.len() <= 1 && !(captured && canceled),
            || {
                let said: Vec<&String> = claims.iter().map(|(_, said)| said).collect();
                format!("hold {id}: {said:#?}")
            },
        );
    }
}

/// What `answer` claims about how a hold ended: the hold, the claim and what was said;
/// `None` when it is not about a hold (`is_hold` tells the ids of holds) or says nothing
/// of its end.
fn claim_of(answer: &Answer, is_hold: impl Fn(&str) -> bool) -> Option<(&String, Claim, String)> {
    match answer {
        Answer::Transfer {
            request,
            status,
            id,
            body,
            ..
        } => {
            let claim = match (request.hold, *status) {
                (None, _) => return None,
                (Some(_), 201) if body["state"] == "done" => {
                    Claim::Captured(body["amount"].as_i64())
                }
                (Some(_), 409) => Claim::NotCaptured,
                (Some(_), 422) => Claim::Canceled(CancelReason::InsufficientFunds),
                _ => return None,
            };
            Some((id, claim, format!("request answered {status} {body}")))
        }
        Answer::Resolve(ResolveAnswer {
            hold,
            resolve,
            status,
            body,
            ..
        }) => {
            let reason = body["reason"].as_str().and_then(CancelReason::parse);
            let claim = match (*status, code_of(body), reason) {
                (200, _, None) => Claim::Captured(body["amount"].as_i64()),
                (200, _, Some(reason)) => Claim::Canceled(reason),
                (_, "hold_already_captured", _) => Claim::Captured(None),
                (_, "hold_voided", _) => Claim::Canceled(CancelReason::Voided),
                _ => Claim::Canceled(CancelReason::Expired),
            };
            Some((
                &hold.id,
                claim,
                format!("{} answered {status} {body}", resolve.path()),
            ))
        }
        Answer::Cancel { id, status, body } => {
            if !is_hold(id) {
                return None;
            }
            let reason = body["reason"].as_str().and_then(CancelReason::parse);
            let claim = match (*status, body["state"].as_str(), reason) {
                (200, Some("canceled"), Some(reason)) => Claim::Canceled(reason),
                // Reversed, being reversed, or not reversed for funds: it was captured.
                _ => Claim::Captured(None),
            };
            Some((id, claim, format!("cancel answered {status} {body}")))
        }
    }
}

/// What the clients were answered 201 while a deployment was down (sent after its kill,
/// answered before its restart), between accounts of the other deployments.
#[derive(Debug, Default)]
pub struct WhileDown {
    /// Transfers made and answered `done` then...
    pub transfers: u64,
    /// ...of which asked for by the probe ([`probe_while_down`]).
    pub by_probe: u64,
    /// Holds made and answered `held` then.
    pub holds: u64,
    /// Replays of a key, answered with what an earlier request made.
    pub replays: u64,
}

/// Checks that nothing touching the deployment that was down was answered `done` while
/// it was (a replay aside, which reads the source's log only: it may answer with a
/// transfer finished before), and counts what the others got done meanwhile.
pub fn check_outage(
    layout: Layout,
    outage: &Outage,
    seen: &[Answer],
    checks: &mut Checks,
) -> WhileDown {
    let mut while_down = WhileDown::default();
    for answer in seen {
        let Answer::Transfer {
            request,
            status: 201,
            body,
            replayed,
            sent,
            answered,
            ..
        } = answer
        else {
            continue;
        };
        if *sent < outage.from || *answered > outage.until {
            continue;
        }
        let mut accounts = vec![&request.source, &request.destination];
        for (source, destination, _) in request.legs.iter().flatten() {
            accounts.extend([source, destination]);
        }
        let touches = accounts
            .iter()
            .any(|a| layout.home_of(a) == outage.deployment);
        if request.hold.is_none() && !replayed {
            checks.check(
                "nothing touching a deployment that is down is answered done (replays aside)",
                !touches,
                || {
                    format!(
                        "{request:?} answered 201 {body} while {} was down",
                        outage.deployment
                    )
                },
            );
        }
        if touches {
            continue;
        }
        match (request.hold, replayed) {
            (_, true) => while_down.replays += 1,
            (None, false) => {
                while_down.transfers += 1;
                if request.reference.starts_with("probe-") {
                    while_down.by_probe += 1;
                }
            }
            (Some(_), false) => while_down.holds += 1,
        }
    }
    while_down
}
