//! What this process sent about a transfer and never heard back about. A write whose
//! reply was lost may still land, long after: what is known about it belongs to the
//! process, not to the local variables of the run that sent it, so that every later run
//! of the transfer in this process respects it.
//!
//! Another process needs none of this. It moves a transfer this process owns only once
//! our lease has lapsed (the sweeper), which outlives the deadline every forward step of
//! ours carries, and its claim changes `application`, which refuses our late state
//! changes; or once it has fenced every account (a cancel). A second run in this process
//! (a second cancel driving the same reversal, the sweeper claiming back a transfer of
//! ours, a capture) has the same owner: neither the lease nor `application` stops the
//! late writes of the first. So:
//! - a forward step (debit, credit, reservation) that failed without an answer leaves its
//!   deadline here ([`Unanswered::late_until`]): every run waits until the log's clock has
//!   passed it before pulling or undoing the transfer's markers, or storing a hold
//!   `held`, exactly as the run that sent it would have (a copy landing after the pull
//!   would apply the step a second time);
//! - a state change of the owner that failed without an answer leaves itself here
//!   ([`Unanswered::state_change`]): the next run sends it again before anything else,
//!   so that the first run's decision stands and its late copy, finding the state moved
//!   on, is refused (a late `pending -> canceling` landing after a second run's credit
//!   would roll back a credit that may be spent).
//!
//! Bounded: a step's deadline is forgotten once passed (or two leases after it was
//! noted); a state change once sent again with an answer, and at most
//! [`MAX_STATE_CHANGES`] are kept.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::domain::{Timestamp, TransferEvent, TransferId, TransferState};
use crate::store::transfers::StepFields;

/// Unanswered state changes kept at most; past it the oldest is forgotten, said loudly.
/// Each is one failed write to a database that did not answer: a full table means a long
/// outage, after which the transfers they belong to are claimed by sweepers (ours with
/// this table's help, or another instance's, whose claim fences our late copies).
const MAX_STATE_CHANGES: usize = 100_000;

/// A state change sent without an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct StateChange {
    pub from: TransferState,
    pub event: TransferEvent,
    pub fields: StepFields,
}

#[derive(Debug, Default)]
struct Entry {
    /// Until when (by the clock of the transfer's log) a forward step of ours may land,
    /// and when we noted it (to forget it once surely passed).
    late: Option<(Timestamp, Instant)>,
    /// The state change to send again, and when it was noted (to forget the oldest).
    state_change: Option<(StateChange, Instant)>,
}

/// The unanswered writes of this process, by transfer (see the module's doc).
#[derive(Debug)]
pub(super) struct Unanswered {
    entries: Mutex<HashMap<TransferId, Entry>>,
    /// The lease: a step's deadline is never more than 0.9 of it after the step is sent.
    lease: Duration,
    /// Unanswered state changes kept at most ([`MAX_STATE_CHANGES`]).
    max_state_changes: usize,
}

impl Unanswered {
    pub fn new(lease: Duration) -> Unanswered {
        Unanswered::bounded(lease, MAX_STATE_CHANGES)
    }

    fn bounded(lease: Duration, max_state_changes: usize) -> Unanswered {
        Unanswered {
            entries: Mutex::default(),
            lease,
            max_state_changes,
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<TransferId, Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A forward step of `id` failed without an answer: a copy may land until `until`.
    pub fn note_late(&self, id: TransferId, until: Timestamp) {
        let mut entries = self.entries();
        self.forget_passed(&mut entries);
        let late = &mut entries.entry(id).or_default().late;
        let until = late.map_or(until, |(noted, _)| noted.max(until));
        *late = Some((until, Instant::now()));
    }

    /// Until when a forward step of `id` sent by this process may still land, if one
    /// failed without an answer.
    pub fn late_until(&self, id: TransferId) -> Option<Timestamp> {
        self.entries().get(&id)?.late.map(|(until, _)| until)
    }

    /// The log's clock has passed `until`: no copy noted up to it can land any more.
    pub fn passed(&self, id: TransferId, until: Timestamp) {
        let mut entries = self.entries();
        if let Some(entry) = entries.get_mut(&id)
            && entry.late.is_some_and(|(noted, _)| noted <= until)
        {
            entry.late = None;
            if entry.state_change.is_none() {
                entries.remove(&id);
            }
        }
    }

    /// A state change of `id` failed without an answer.
    pub fn note_state_change(&self, id: TransferId, change: StateChange) {
        let mut entries = self.entries();
        let kept = entries
            .values()
            .filter(|e| e.state_change.is_some())
            .count();
        if kept >= self.max_state_changes
            && let Some(oldest) = entries
                .iter()
                .filter_map(|(id, e)| e.state_change.as_ref().map(|(_, at)| (*id, *at)))
                .min_by_key(|(_, at)| *at)
                .map(|(id, _)| id)
        {
            tracing::error!(transfer_id = %oldest, "too many unanswered state changes: the oldest is forgotten; a late copy of it could still land");
            if let Some(entry) = entries.get_mut(&oldest) {
                entry.state_change = None;
            }
        }
        entries.entry(id).or_default().state_change = Some((change, Instant::now()));
    }

    /// The state change of `id` that failed without an answer, if any.
    pub fn state_change(&self, id: TransferId) -> Option<StateChange> {
        self.entries()
            .get(&id)?
            .state_change
            .as_ref()
            .map(|(c, _)| c.clone())
    }

    /// `change` was sent again and answered (or can no longer land): forget it.
    pub fn answered(&self, id: TransferId, change: StateChange) {
        let mut entries = self.entries();
        if let Some(entry) = entries.get_mut(&id)
            && entry
                .state_change
                .as_ref()
                .is_some_and(|(c, _)| *c == change)
        {
            entry.state_change = None;
            if entry.late.is_none() {
                entries.remove(&id);
            }
        }
    }

    /// Forgets the steps' deadlines noted over two leases ago: passed by any clock.
    fn forget_passed(&self, entries: &mut HashMap<TransferId, Entry>) {
        let old = self.lease * 2;
        entries.retain(|_, e| {
            if e.late.is_some_and(|(_, at)| at.elapsed() > old) {
                e.late = None;
            }
            e.late.is_some() || e.state_change.is_some()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> TransferId {
        TransferId::from_bytes([n; 12])
    }

    fn at(second: i64) -> Timestamp {
        Timestamp::from_timestamp(1_800_000_000 + second, 0).expect("in range")
    }

    fn change(event: TransferEvent) -> StateChange {
        StateChange {
            from: TransferState::Pending,
            event,
            fields: StepFields::default(),
        }
    }

    #[test]
    fn a_deadline_is_forgotten_once_the_clock_has_reached_it_not_before() {
        let unanswered = Unanswered::new(Duration::from_secs(60));
        unanswered.note_late(id(1), at(10));
        unanswered.passed(id(1), at(9));
        assert_eq!(unanswered.late_until(id(1)), Some(at(10)));
        unanswered.passed(id(1), at(10));
        assert_eq!(unanswered.late_until(id(1)), None);
        assert!(
            unanswered.entries().is_empty(),
            "nothing left of the transfer"
        );
    }

    /// A run waiting for the first deadline must not forget one noted meanwhile by
    /// another run of the transfer: a copy of that step may land after the first.
    #[test]
    fn the_latest_deadline_stands_and_passing_an_earlier_one_keeps_it() {
        let unanswered = Unanswered::new(Duration::from_secs(60));
        unanswered.note_late(id(1), at(10));
        unanswered.note_late(id(1), at(5));
        assert_eq!(unanswered.late_until(id(1)), Some(at(10)));
        unanswered.note_late(id(1), at(20));
        unanswered.passed(id(1), at(10));
        assert_eq!(unanswered.late_until(id(1)), Some(at(20)));
        assert_eq!(unanswered.late_until(id(2)), None, "another transfer's own");
    }

    #[test]
    fn a_state_change_is_kept_until_that_very_change_is_answered() {
        let unanswered = Unanswered::new(Duration::from_secs(60));
        let rollback = change(TransferEvent::BeginRollback);
        unanswered.note_state_change(id(1), rollback.clone());
        assert_eq!(unanswered.state_change(id(1)), Some(rollback.clone()));
        unanswered.answered(id(1), change(TransferEvent::MarkApplied));
        assert_eq!(unanswered.state_change(id(1)), Some(rollback.clone()));
        unanswered.answered(id(2), rollback.clone());
        assert_eq!(unanswered.state_change(id(1)), Some(rollback.clone()));
        unanswered.answered(id(1), rollback.clone());
        assert_eq!(unanswered.state_change(id(1)), None);
        assert!(
            unanswered.entries().is_empty(),
            "nothing left of the transfer"
        );
    }

    #[test]
    fn a_deadline_and_a_state_change_of_one_transfer_are_forgotten_each_on_its_own() {
        let unanswered = Unanswered::new(Duration::from_secs(60));
        let applied = change(TransferEvent::MarkApplied);
        unanswered.note_late(id(1), at(10));
        unanswered.note_state_change(id(1), applied.clone());
        unanswered.answered(id(1), applied.clone());
        assert_eq!(unanswered.late_until(id(1)), Some(at(10)));
        unanswered.note_state_change(id(1), applied.clone());
        unanswered.passed(id(1), at(10));
        assert_eq!(unanswered.state_change(id(1)), Some(applied.clone()));
        assert_eq!(unanswered.late_until(id(1)), None);
    }

    #[test]
    fn past_the_bound_only_the_oldest_state_change_is_forgotten() {
        let unanswered = Unanswered::bounded(Duration::from_secs(60), 3);
        let applied = change(TransferEvent::MarkApplied);
        for n in 1..=3 {
            unanswered.note_state_change(id(n), applied.clone());
            std::thread::sleep(Duration::from_millis(2));
        }
        for n in 1..=3 {
            assert_eq!(
                unanswered.state_change(id(n)),
                Some(applied.clone()),
                "below the bound"
            );
        }
        unanswered.note_state_change(id(4), applied.clone());
        assert_eq!(unanswered.state_change(id(1)), None, "the oldest");
        for n in 2..=4 {
            assert_eq!(unanswered.state_change(id(n)), Some(applied.clone()));
        }
    }

    /// By the instance's clock, not the log's: two leases after it was noted, a step's
    /// deadline (at most 0.9 of a lease after it was sent) has passed by any clock.
    #[test]
    fn a_deadline_is_forgotten_two_leases_after_it_was_noted_not_one() {
        let lease = Duration::from_secs(1);
        let unanswered = Unanswered::new(lease);
        let applied = change(TransferEvent::MarkApplied);
        unanswered.note_late(id(1), at(10));
        unanswered.note_late(id(2), at(10));
        unanswered.note_state_change(id(2), applied.clone());
        std::thread::sleep(lease * 3 / 2);
        unanswered.note_late(id(3), at(10));
        assert_eq!(
            unanswered.late_until(id(1)),
            Some(at(10)),
            "one and a half leases"
        );
        std::thread::sleep(lease);
        unanswered.note_late(id(3), at(10));
        assert_eq!(unanswered.late_until(id(1)), None, "two and a half leases");
        assert_eq!(unanswered.late_until(id(2)), None);
        assert_eq!(
            unanswered.state_change(id(2)),
            Some(applied.clone()),
            "kept on its own"
        );
        assert_eq!(unanswered.late_until(id(3)), Some(at(10)));
        assert_eq!(unanswered.entries().len(), 2, "the first transfer is gone");
    }
}
