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
//!
//! With several deployments, a transfer's lease is judged by the clock of the deployment
//! that logs it, while its account steps and fences are checked by the clocks of the
//! accounts' deployments. A deadline is carried from one clock to the other through this
//! process's monotonic clock (see `Store::deadline_on`): it needs an *upper* bound of
//! the first clock as well, the reading plus the time since its request was *sent* (the
//! server read its clock after that).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use mongodb::Database;
use mongodb::bson::{DateTime, doc};

use super::{StoreError, StoreResult};
use crate::domain::{DeploymentName, Timestamp};

/// How old the last reading may be before the next lower bound asks the server again.
/// Bounds the drift between the server's clock and ours (at a few hundred parts per
/// million, well under a millisecond).
pub const MAX_READING_AGE: Duration = Duration::from_secs(5);

/// A move of the server's clock between two readings beyond what elapsed here, in
/// milliseconds, above which it is reported as a jump.
pub const JUMP_MS: i64 = 50;

/// The last reading of the server's clock.
#[derive(Debug, Default)]
pub struct ServerClock {
    /// The last reading.
    reading: Mutex<Option<Reading>>,
}

/// A reading of the server's clock.
#[derive(Debug, Clone, Copy)]
struct Reading {
    /// The server's time, as its reply said.
    server: DateTime,
    /// When (on our monotonic clock) the request was sent: the server read its clock
    /// after this.
    sent: Instant,
    /// When the reply arrived: the server read its clock before this.
    arrived: Instant,
}

impl ServerClock {
    /// Notes a reply that carried the server's time `server`, to a request sent at
    /// `sent` and received at `arrived`. Returns by how many milliseconds the server's
    /// clock jumped since the previous reading, when it moved more than [`JUMP_MS`]
    /// beyond what the time elapsed here allows (a step of its clock, or a failover to a
    /// member whose clock differs), for the caller to report.
    pub fn observe(&self, server: DateTime, sent: Instant, arrived: Instant) -> Option<i64> {
        let mut reading = self.reading.lock().unwrap_or_else(|e| e.into_inner());
        let jump = reading.and_then(|old| {
            let since =
                |from: Instant, to: Instant| to.saturating_duration_since(from).as_millis() as i64;
            let earliest = old.server.timestamp_millis() + since(old.arrived, sent);
            let latest = old.server.timestamp_millis() + since(old.sent, arrived);
            let now = server.timestamp_millis();
            let off = if now < earliest {
                now - earliest
            } else if now > latest {
                now - latest
            } else {
                0
            };
            (off.abs() > JUMP_MS && old.arrived <= sent).then_some(off)
        });
        // The newest reading wins: should the server's clock be set back, the bound
        // follows it at once instead of staying ahead of it.
        if reading.is_none_or(|old| old.arrived <= arrived) {
            *reading = Some(Reading {
                server,
                sent,
                arrived,
            });
        }
        jump
    }

    /// A fresh enough reading, if there is one.
    fn fresh(&self) -> Option<(Reading, Instant)> {
        let reading = (*self.reading.lock().unwrap_or_else(|e| e.into_inner()))?;
        let now = Instant::now();
        (now.duration_since(reading.arrived) <= MAX_READING_AGE).then_some((reading, now))
    }

    /// A time the server's clock has certainly reached, if a fresh enough reading exists.
    pub fn lower_bound(&self) -> Option<DateTime> {
        let (reading, now) = self.fresh()?;
        Some(plus(
            reading.server,
            now.saturating_duration_since(reading.arrived),
        ))
    }

    /// A time the server's clock has certainly not passed yet, if a fresh enough reading
    /// exists.
    pub fn upper_bound(&self) -> Option<DateTime> {
        let (reading, now) = self.fresh()?;
        // Rounded up: the stored times are milliseconds.
        let elapsed = now.saturating_duration_since(reading.sent) + Duration::from_micros(999);
        Some(plus(reading.server, elapsed))
    }
}

fn plus(server: DateTime, elapsed: Duration) -> DateTime {
    DateTime::from_millis(server.timestamp_millis() + elapsed.as_millis() as i64)
}

/// The database's clock as a view of a [`super::Store`] reads it: the readings it keeps
/// ([`ServerClock`]) and the database to read again when they are too old. Every view
/// that stamps a write or starts a lease holds one.
#[derive(Clone, Copy, Debug)]
pub struct Clock<'s> {
    /// Where `hello` is sent when the last reading is too old.
    pub(super) db: &'s Database,
    /// The readings, shared by every clone of the store.
    pub(super) clock: &'s ServerClock,
    /// Named in the warning of a jump.
    pub(super) deployment: &'s DeploymentName,
}

impl Clock<'_> {
    /// The database server's clock, from `hello.localTime`. Leases are judged by this one
    /// clock: an owner's forward steps carry a deadline the server checks against `$$NOW`,
    /// and a takeover needs `lastModified` older than the server's time minus the lease,
    /// so the clocks of the instances never matter.
    pub async fn server_time(self) -> StoreResult<Timestamp> {
        Ok(self.read_server_time().await?.to_chrono())
    }

    async fn read_server_time(self) -> StoreResult<mongodb::bson::DateTime> {
        let sent = std::time::Instant::now();
        let reply = self.db.run_command(doc! { "hello": 1 }).await?;
        let arrived = std::time::Instant::now();
        let time = reply
            .get_datetime("localTime")
            .copied()
            .map_err(|e| StoreError::Malformed(format!("hello has no localTime: {e}").into()))?;
        if let Some(jump_ms) = self.clock.observe(time, sent, arrived) {
            tracing::warn!(deployment = %self.deployment, jump_ms, "the database's clock jumped; steps across deployments tolerate jumps up to a tenth of a lease");
        }
        Ok(time)
    }

    /// A time the database's clock has certainly reached (see [the module's doc](self)): what a driver
    /// takes as the start of a lease it is about to stamp with the server's `$$NOW`.
    /// Reads the server's clock when the last reading is too old.
    pub async fn server_time_lower_bound(self) -> StoreResult<Timestamp> {
        Ok(self.stamp_time().await?.to_chrono())
    }

    /// [`Clock::server_time_lower_bound`] as stored: the time a write stamps (with
    /// `$max`, see `guards::stamped`) and the start of the lease it gives.
    pub(super) async fn stamp_time(self) -> StoreResult<mongodb::bson::DateTime> {
        self.clock_bound(ServerClock::lower_bound).await
    }

    /// A time the database's clock has certainly not passed yet (see [the module's doc](self)).
    pub(super) async fn upper_bound_time(self) -> StoreResult<mongodb::bson::DateTime> {
        self.clock_bound(ServerClock::upper_bound).await
    }

    /// `bound` of the last reading of the database's clock, reading it again first when
    /// the last one is too old.
    async fn clock_bound(
        self,
        bound: fn(&ServerClock) -> Option<mongodb::bson::DateTime>,
    ) -> StoreResult<mongodb::bson::DateTime> {
        if let Some(bound) = bound(self.clock) {
            return Ok(bound);
        }
        self.read_server_time().await?;
        bound(self.clock)
            // Only an instance stalled for longer than a reading stays fresh gets here.
            .ok_or_else(|| {
                StoreError::Unavailable("the server's clock reading is already stale".into())
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_moves_with_the_monotonic_clock_from_the_last_reading() {
        let clock = ServerClock::default();
        assert_eq!(clock.lower_bound(), None, "no reading, no bound");
        let arrived = Instant::now() - Duration::from_millis(300);
        let sent = arrived - Duration::from_millis(40);
        clock.observe(DateTime::from_millis(1_000_000), sent, arrived);
        let bound = clock.lower_bound().unwrap().timestamp_millis();
        assert!((1_000_300..1_000_400).contains(&bound), "{bound}");
        // The upper bound counts from the request: the round trip is the uncertainty.
        let upper = clock.upper_bound().unwrap().timestamp_millis();
        assert!((1_000_340..1_000_440).contains(&upper), "{upper}");
        assert!(upper >= bound + 40, "{upper} {bound}");
    }

    #[test]
    fn the_newest_reading_wins_even_if_the_server_clock_went_back() {
        let clock = ServerClock::default();
        let now = Instant::now();
        let earlier = now - Duration::from_millis(10);
        clock.observe(DateTime::from_millis(2_000_000), earlier, earlier);
        clock.observe(DateTime::from_millis(1_000_000), now, now);
        let bound = clock.lower_bound().unwrap().timestamp_millis();
        assert!((1_000_000..1_100_000).contains(&bound), "{bound}");
        // A reply that arrived before the one we keep changes nothing.
        let between = now - Duration::from_millis(5);
        clock.observe(DateTime::from_millis(3_000_000), between, between);
        assert!(clock.lower_bound().unwrap().timestamp_millis() < 1_100_000);
    }

    #[test]
    fn a_clock_that_moved_more_than_the_time_elapsed_here_is_reported() {
        let clock = ServerClock::default();
        let start = Instant::now() - Duration::from_secs(2);
        assert_eq!(
            clock.observe(DateTime::from_millis(1_000_000), start, start),
            None
        );
        let later = start + Duration::from_secs(1);
        // One second later here, one second later there: no jump.
        let said = clock.observe(DateTime::from_millis(1_001_000), later, later);
        assert_eq!(said, None);
        // Another second here, but three there: a jump of two seconds forward.
        let again = later + Duration::from_secs(1);
        let said = clock.observe(DateTime::from_millis(1_004_000), again, again);
        assert_eq!(said, Some(2_000));
    }

    #[test]
    fn a_clock_set_back_is_reported_as_a_jump_back() {
        let clock = ServerClock::default();
        let start = Instant::now() - Duration::from_secs(2);
        clock.observe(DateTime::from_millis(1_000_000), start, start);
        // One second later here, and the server says one second earlier: two back.
        let later = start + Duration::from_secs(1);
        let said = clock.observe(DateTime::from_millis(999_000), later, later);
        assert_eq!(said, Some(-2_000));
    }

    /// The server read its clock somewhere within each round trip: a new reading may
    /// fall anywhere between the earliest and the latest times the two round trips
    /// allow, and only a move more than [`JUMP_MS`] beyond them is a jump.
    #[test]
    fn only_a_move_beyond_both_round_trips_and_the_allowance_is_a_jump() {
        let start = Instant::now() - Duration::from_secs(2);
        let ms = Duration::from_millis;
        // The first request took 100 ms, so did the second, sent 900 ms after the first
        // reply: the server's clock moved by 900 to 1,100 ms in between.
        let judged = |server: i64| {
            let clock = ServerClock::default();
            clock.observe(DateTime::from_millis(1_000_000), start, start + ms(100));
            clock.observe(
                DateTime::from_millis(server),
                start + ms(1_000),
                start + ms(1_100),
            )
        };
        for server in [1_000_850, 1_000_900, 1_001_000, 1_001_100, 1_001_150] {
            assert_eq!(judged(server), None, "{server}");
        }
        assert_eq!(judged(1_000_849), Some(-51));
        assert_eq!(judged(1_001_151), Some(51));
        assert_eq!(judged(1_005_100), Some(4_000));
    }

    /// Requests in flight at once (a ping and a write, say) may be answered in any
    /// order: a reply to a request sent before the last reply arrived is not compared
    /// with it.
    #[test]
    fn replies_to_requests_in_flight_together_are_not_compared() {
        let clock = ServerClock::default();
        let start = Instant::now() - Duration::from_secs(2);
        let ms = Duration::from_millis;
        clock.observe(DateTime::from_millis(1_000_000), start, start + ms(1_000));
        let said = clock.observe(
            DateTime::from_millis(5_000_000),
            start + ms(500),
            start + ms(1_500),
        );
        assert_eq!(said, None);
    }

    #[test]
    fn a_stale_reading_gives_no_bound() {
        let clock = ServerClock::default();
        let long_ago = Instant::now() - MAX_READING_AGE - Duration::from_secs(1);
        clock.observe(DateTime::from_millis(1_000_000), long_ago, long_ago);
        assert_eq!(clock.lower_bound(), None);
        assert_eq!(clock.upper_bound(), None);
    }
}
