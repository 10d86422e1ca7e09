//! The database's clock, as seen from this process.
//!
//! Leases are judged by the database alone: every write that starts or renews a lease
//! stamps `lastModified` with the server's `$$NOW`, a takeover compares `lastModified`
//! with the server's time, and a forward account step carries a deadline the server
//! checks against its own `$$NOW`. The instance's wall clock is never compared with any
//! of them, so an instance whose clock runs behind or ahead is neither unsafe nor stuck.
//!
//! A driver still has to *name* a deadline in its step's filter, and it cannot always
//! read back the `lastModified` its write produced (a batched `updateMany` does not
//! return documents). So it uses a lower bound of the server's time instead: the last
//! `hello.localTime` it saw plus the time elapsed since the reply arrived, measured on
//! the process's monotonic clock (which no NTP step or `date` can move). The server read
//! its clock before the reply arrived, so this is never later than the server's true
//! time; a write sent after it is stamped at least that late; and a deadline computed
//! from it is never later than the one computed from the stored `lastModified`. Being a
//! little early only shortens our own lease, never someone else's.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use mongodb::bson::DateTime;

/// How old the last reading may be before the next lower bound asks the server again.
/// Bounds the drift between the server's clock and ours (at a few hundred parts per
/// million, well under a millisecond).
pub const MAX_READING_AGE: Duration = Duration::from_secs(5);

/// The last reading of the server's clock.
#[derive(Debug, Default)]
pub struct ServerClock {
    /// The server's time, and the moment (on our monotonic clock) its reply arrived.
    reading: Mutex<Option<(DateTime, Instant)>>,
}

impl ServerClock {
    /// Records a reply that carried the server's time `server`, received at `arrived`.
    pub fn observe(&self, server: DateTime, arrived: Instant) {
        let mut reading = self.reading.lock().unwrap_or_else(|e| e.into_inner());
        // The newest reading wins: should the server's clock be set back, the bound
        // follows it at once instead of staying ahead of it.
        if reading.is_none_or(|(_, old)| old <= arrived) {
            *reading = Some((server, arrived));
        }
    }

    /// A time the server's clock has certainly reached, if a fresh enough reading exists.
    pub fn lower_bound(&self) -> Option<DateTime> {
        let reading = *self.reading.lock().unwrap_or_else(|e| e.into_inner());
        let (server, arrived) = reading?;
        let now = Instant::now();
        (now.duration_since(arrived) <= MAX_READING_AGE).then(|| bound((server, arrived), now))
    }
}

fn bound((server, arrived): (DateTime, Instant), at: Instant) -> DateTime {
    let elapsed = at.saturating_duration_since(arrived);
    DateTime::from_millis(server.timestamp_millis() + elapsed.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_moves_with_the_monotonic_clock_from_the_last_reading() {
        let clock = ServerClock::default();
        assert_eq!(clock.lower_bound(), None, "no reading, no bound");
        let arrived = Instant::now() - Duration::from_millis(300);
        clock.observe(DateTime::from_millis(1_000_000), arrived);
        let bound = clock.lower_bound().unwrap().timestamp_millis();
        assert!((1_000_300..1_000_400).contains(&bound), "{bound}");
    }

    #[test]
    fn the_newest_reading_wins_even_if_the_server_clock_went_back() {
        let clock = ServerClock::default();
        let now = Instant::now();
        clock.observe(
            DateTime::from_millis(2_000_000),
            now - Duration::from_millis(10),
        );
        clock.observe(DateTime::from_millis(1_000_000), now);
        let bound = clock.lower_bound().unwrap().timestamp_millis();
        assert!((1_000_000..1_100_000).contains(&bound), "{bound}");
        // A reply that arrived before the one we keep changes nothing.
        clock.observe(
            DateTime::from_millis(3_000_000),
            now - Duration::from_millis(5),
        );
        assert!(clock.lower_bound().unwrap().timestamp_millis() < 1_100_000);
    }

    #[test]
    fn a_stale_reading_gives_no_bound() {
        let clock = ServerClock::default();
        let long_ago = Instant::now() - MAX_READING_AGE - Duration::from_secs(1);
        clock.observe(DateTime::from_millis(1_000_000), long_ago);
        assert_eq!(clock.lower_bound(), None);
    }
}
