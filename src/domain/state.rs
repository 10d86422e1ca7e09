//! The transfer state machine of the MongoDB tutorial "Perform Two Phase Commits".
//!
//! ```text
//!                 Start               MarkApplied            MarkDone
//!   initial ────────────▶ pending ────────────▶ applied ────────────▶ done
//!      │                   │   │                                       ▲
//!      │                   │   │ Hold                                  │ MarkDone
//!      │                   │   ▼          Capture                      │
//!      │                   │  held ─────────────────────▶ capturing ───┘
//!      │                   │   │
//!      │ Abandon           │   │ Void
//!      │     BeginRollback ▼   ▼
//!      │                 canceling ──────────▶ canceled
//!      └──────────────────────────────────────▶    ▲     FinishRollback
//! ```
//!
//! - `initial`: the transfer is inserted; no account has been touched, and none can be
//!   until some instance wins `initial -> pending`.
//! - `pending`: the owner applies the transfer to the two accounts, each change guarded
//!   by `pendingTransactions: {$ne: id}` so that a retry never applies it twice.
//! - `applied`: both accounts carry the change; from here the transfer only goes forward
//!   (the tutorial's rule: an applied transfer is reversed by a compensating transfer,
//!   never rolled back).
//! - `done`: the markers are pulled from both accounts. Terminal.
//! - `canceling`: the rollback undoes whatever the accounts carry. Terminal once
//!   `canceled`.
//! - `held` (a hold only): both accounts carry the reservation (`pendingDebits` on the
//!   source, `pendingCredits` on the destination); it waits for a capture, a void or its
//!   expiry. A void releases it through `canceling`.
//! - `capturing` (a hold only): the capture won; the captured amount moves and both
//!   reservations are released, then `done`. Like `applied`, it only goes forward.
//!
//! `initial -> canceled` skips `canceling` because there is nothing to undo: account
//! steps only run after `initial -> pending`, and that guarded write can no longer win.

use std::fmt;

/// Where a transfer is in the protocol. Stored and shown as the lowercase name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransferState {
    Initial,
    Pending,
    Applied,
    Done,
    Canceling,
    Canceled,
    Held,
    Capturing,
}

/// What moves a transfer from one state to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferEvent {
    /// `initial -> pending`: an instance takes the transfer and may touch accounts.
    Start,
    /// `pending -> applied`: both accounts carry the change.
    MarkApplied,
    /// `applied -> done`: both accounts' markers are pulled.
    MarkDone,
    /// `pending -> canceling`: the transfer cannot or must not complete; undo it.
    BeginRollback,
    /// `canceling -> canceled`: both accounts are back where they were.
    FinishRollback,
    /// `initial -> canceled`: dropped before any account was touched.
    Abandon,
    /// `pending -> held`: both accounts carry a hold's reservation.
    Hold,
    /// `held -> capturing`: a capture won the hold, before its expiry.
    Capture,
    /// `held -> canceling`: a void, an expiry or a cancel won the hold; release it.
    Void,
}

/// A transition the state machine does not have. Expected, not a bug: it is what a
/// guarded write that lost a race reports once we re-read the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a transfer in state {from} cannot take {event:?}")]
pub struct InvalidTransition {
    pub from: TransferState,
    pub event: TransferEvent,
}

impl TransferState {
    pub const ALL: [TransferState; 8] = [
        TransferState::Initial,
        TransferState::Pending,
        TransferState::Applied,
        TransferState::Done,
        TransferState::Canceling,
        TransferState::Canceled,
        TransferState::Held,
        TransferState::Capturing,
    ];

    /// The state `event` leads to from `self`, or why it cannot be taken.
    pub fn transition(self, event: TransferEvent) -> Result<TransferState, InvalidTransition> {
        use TransferEvent::*;
        use TransferState::*;
        let next = match (self, event) {
            (Initial, Start) => Pending,
            (Initial, Abandon) => Canceled,
            (Pending, MarkApplied) => Applied,
            (Pending, BeginRollback) => Canceling,
            (Applied, MarkDone) => Done,
            (Canceling, FinishRollback) => Canceled,
            (Pending, Hold) => Held,
            (Held, Capture) => Capturing,
            (Held, Void) => Canceling,
            (Capturing, MarkDone) => Done,
            (from, event) => return Err(InvalidTransition { from, event }),
        };
        debug_assert!(!self.is_terminal(), "terminal states have no transitions");
        Ok(next)
    }

    /// `done` and `canceled` never change again.
    pub fn is_terminal(self) -> bool {
        matches!(self, TransferState::Done | TransferState::Canceled)
    }

    /// At rest: nothing is left for the protocol to do, the transfer is terminal, or a
    /// hold `held` until its client captures or voids it (or it expires).
    pub fn is_at_rest(self) -> bool {
        self.is_terminal() || self == TransferState::Held
    }

    /// The name stored in the `state` field and shown in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            TransferState::Initial => "initial",
            TransferState::Pending => "pending",
            TransferState::Applied => "applied",
            TransferState::Done => "done",
            TransferState::Canceling => "canceling",
            TransferState::Canceled => "canceled",
            TransferState::Held => "held",
            TransferState::Capturing => "capturing",
        }
    }

    pub fn parse(raw: &str) -> Option<TransferState> {
        TransferState::ALL.into_iter().find(|s| s.as_str() == raw)
    }
}

impl fmt::Display for TransferState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a transfer ended `canceled`. Stored in the `reason` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CancelReason {
    /// The source balance was below the amount when the debit was attempted.
    InsufficientFunds,
    /// Crediting the destination would have taken its balance past `MAX_MONEY`.
    BalanceOverflow,
    /// One of the accounts no longer existed when the protocol reached it.
    AccountNotFound,
    /// A client asked for it through `POST /transfers/{id}/cancel`.
    CanceledByRequest,
    /// A hold voided by `POST /transfers/{id}/void` (or a cancel of a held hold).
    Voided,
    /// A hold that reached its `expiresAt` uncaptured.
    Expired,
}

impl CancelReason {
    pub const ALL: [CancelReason; 6] = [
        CancelReason::InsufficientFunds,
        CancelReason::BalanceOverflow,
        CancelReason::AccountNotFound,
        CancelReason::CanceledByRequest,
        CancelReason::Voided,
        CancelReason::Expired,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CancelReason::InsufficientFunds => "insufficient_funds",
            CancelReason::BalanceOverflow => "balance_overflow",
            CancelReason::AccountNotFound => "account_not_found",
            CancelReason::CanceledByRequest => "canceled_by_request",
            CancelReason::Voided => "voided",
            CancelReason::Expired => "expired",
        }
    }

    pub fn parse(raw: &str) -> Option<CancelReason> {
        CancelReason::ALL.into_iter().find(|r| r.as_str() == raw)
    }
}

impl fmt::Display for CancelReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::TransferEvent::*;
    use super::TransferState::*;
    use super::*;

    const EVENTS: [TransferEvent; 9] = [
        Start,
        MarkApplied,
        MarkDone,
        BeginRollback,
        FinishRollback,
        Abandon,
        Hold,
        Capture,
        Void,
    ];

    #[test]
    fn the_happy_path_runs_initial_pending_applied_done() {
        let mut state = Initial;
        for event in [Start, MarkApplied, MarkDone] {
            state = state.transition(event).unwrap();
        }
        assert_eq!(state, Done);
        assert!(state.is_terminal());
    }

    #[test]
    fn a_pending_transfer_rolls_back_through_canceling() {
        let state = Pending.transition(BeginRollback).unwrap();
        assert_eq!(state, Canceling);
        assert_eq!(state.transition(FinishRollback).unwrap(), Canceled);
    }

    #[test]
    fn an_initial_transfer_is_abandoned_straight_to_canceled() {
        assert_eq!(Initial.transition(Abandon).unwrap(), Canceled);
    }

    #[test]
    fn a_hold_is_held_then_captured_or_voided() {
        let held = Pending.transition(Hold).unwrap();
        assert_eq!(held, Held);
        assert!(!held.is_terminal());
        let capturing = held.transition(Capture).unwrap();
        assert_eq!(capturing.transition(MarkDone).unwrap(), Done);
        let releasing = held.transition(Void).unwrap();
        assert_eq!(releasing.transition(FinishRollback).unwrap(), Canceled);
    }

    #[test]
    fn a_capture_that_won_can_never_be_voided_and_a_hold_never_applies() {
        assert!(Capturing.transition(Void).is_err());
        assert!(Capturing.transition(BeginRollback).is_err());
        assert!(Held.transition(MarkApplied).is_err());
        assert!(Applied.transition(Capture).is_err());
    }

    #[test]
    fn an_applied_transfer_can_never_roll_back() {
        let err = Applied.transition(BeginRollback).unwrap_err();
        assert_eq!(
            err,
            InvalidTransition {
                from: Applied,
                event: BeginRollback
            }
        );
    }

    #[test]
    fn terminal_states_accept_no_event() {
        for state in [Done, Canceled] {
            for event in EVENTS {
                assert!(state.transition(event).is_err(), "{state} took {event:?}");
            }
        }
    }

    #[test]
    fn exactly_the_ten_documented_transitions_exist() {
        let mut allowed: Vec<(TransferState, TransferEvent, TransferState)> = Vec::new();
        for state in TransferState::ALL {
            for event in EVENTS {
                if let Ok(next) = state.transition(event) {
                    allowed.push((state, event, next));
                }
            }
        }
        assert_eq!(
            allowed,
            vec![
                (Initial, Start, Pending),
                (Initial, Abandon, Canceled),
                (Pending, MarkApplied, Applied),
                (Pending, BeginRollback, Canceling),
                (Pending, Hold, Held),
                (Applied, MarkDone, Done),
                (Canceling, FinishRollback, Canceled),
                (Held, Capture, Capturing),
                (Held, Void, Canceling),
                (Capturing, MarkDone, Done),
            ]
        );
    }

    #[test]
    fn no_transition_leads_back_to_an_earlier_state() {
        // The order in which states are reached; every transition must move forward in
        // it, which is why a retried step can never undo progress.
        let rank = |s: TransferState| match s {
            Initial => 0,
            Pending => 1,
            Held => 2,
            Applied | Canceling | Capturing => 3,
            Done | Canceled => 4,
        };
        for state in TransferState::ALL {
            for event in EVENTS {
                if let Ok(next) = state.transition(event) {
                    assert!(rank(next) > rank(state), "{state} -> {next} goes backwards");
                }
            }
        }
    }

    #[test]
    fn names_round_trip() {
        for state in TransferState::ALL {
            assert_eq!(TransferState::parse(state.as_str()), Some(state));
        }
        for reason in CancelReason::ALL {
            assert_eq!(CancelReason::parse(reason.as_str()), Some(reason));
        }
        assert_eq!(TransferState::parse("cancelled"), None);
    }
}
