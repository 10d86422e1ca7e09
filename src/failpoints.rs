//! Fault injection for the crash-recovery tests, compiled only with the `failpoints`
//! feature. `CRASH_AT=<step>` makes the process abort, as kill -9 would (no destructors,
//! no flushing, no graceful shutdown), right after that step completes for the first
//! transfer that reaches it. Steps: `after_insert`, `after_pending`, `after_debit`,
//! `after_credit`, `after_applied`, `after_pull_source`, `after_pull_destination`,
//! `after_canceling`, `after_undo_destination`, `after_undo_source`.

use std::sync::OnceLock;

/// Called by the `failpoint!` macro after each step.
pub fn hit(step: &str) {
    static TARGET: OnceLock<Option<String>> = OnceLock::new();
    let target = TARGET.get_or_init(|| std::env::var("CRASH_AT").ok().filter(|s| !s.is_empty()));
    if target.as_deref() == Some(step) {
        eprintln!("failpoint {step}: aborting");
        std::process::abort();
    }
}
