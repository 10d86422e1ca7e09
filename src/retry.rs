//! The retry policies, named: how often, and for how long, each kind of "try again"
//! tries. The loops themselves run on `backon`; which errors are worth another attempt
//! is decided where each policy is used.

use std::time::Duration;

use backon::{ConstantBuilder, ExponentialBuilder};

/// A write that is safe to repeat, sent again after "no answer" (see
/// `store::retried_while`): three attempts at most, 50 ms before the second, doubled
/// before the third. Enough to ride out a replica-set election's first moments, short
/// enough to stay far inside a lease.
pub fn resent_write() -> ExponentialBuilder {
    ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(50))
        .with_factor(2.0)
        .with_max_times(WRITE_ATTEMPTS - 1)
}

/// The attempts [`resent_write`] makes at most.
pub const WRITE_ATTEMPTS: usize = 3;

/// A database that cannot be reached at start-up (not there yet, a failover, a dropped
/// connection): the pause between attempts doubles from 250 ms up to 5 s. How long it
/// keeps trying is the caller's (`STARTUP_PATIENCE_MS`), by the wall clock.
pub fn start_up() -> ExponentialBuilder {
    ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(250))
        .with_factor(2.0)
        .with_max_delay(STARTUP_LONGEST_PAUSE)
        .without_max_times()
}

/// The longest pause of [`start_up`].
pub const STARTUP_LONGEST_PAUSE: Duration = Duration::from_secs(5);

/// A read that follows a write another request made, whose answer (a duplicate key) came
/// from the primary: with majority read concern it may not see that write for a moment.
/// Five reads, 20 ms apart, before a "not there" is believed.
pub fn majority_read() -> ConstantBuilder {
    ConstantBuilder::new()
        .with_delay(Duration::from_millis(20))
        .with_max_times(4)
}

/// Re-reading something another actor moves on, every `every`, for as long as the
/// caller's deadline allows.
pub fn polling(every: Duration) -> ConstantBuilder {
    ConstantBuilder::new().with_delay(every).without_max_times()
}
