//! Fault injection for the recovery tests, compiled only with the `failpoints` feature.
//! Each step of the protocol calls [`hit`] right after it completes: `after_insert`,
//! `after_pending`, `after_debit`, `after_credit`, `after_applied`, `after_pull_source`,
//! `after_pull_destination`, `after_canceling`, `after_undo_destination`,
//! `after_undo_source`. Each write of the store calls it right before the write is
//! sent, so that a test can hold a write back and let it reach the server late:
//! `before_insert`, `before_transition`, `before_force`, `before_renew`, `before_claim`,
//! `before_take_over`, `before_claim_reversal`, `before_mark_fenced`, `before_fence`,
//! `before_debit`, `before_credit`, `before_pull`, `before_undo`.
//!
//! - Crash: `CRASH_AT=<step>` makes the process abort, as kill -9 would (no destructors,
//!   no flushing, no graceful shutdown), at that step of the first transfer reaching it.
//! - Pause: [`pause`] makes one instance (by `INSTANCE_ID`) stop at a step of the first
//!   transfer reaching it until the test resumes it, so that a test can act in between
//!   (cancel, take over) and then let the paused step go on: deterministic interleavings.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use tokio::sync::oneshot;

/// Where a pause waits: told when the step is reached, then waits to be resumed.
struct Gate {
    reached: oneshot::Sender<()>,
    resume: oneshot::Receiver<()>,
}

/// Armed pauses, by instance and step. A pause fires once and is removed.
fn gates() -> &'static Mutex<HashMap<(String, &'static str), Gate>> {
    static GATES: OnceLock<Mutex<HashMap<(String, &'static str), Gate>>> = OnceLock::new();
    GATES.get_or_init(Default::default)
}

/// Called by the `failpoint!` macro after each step of `instance`.
pub async fn hit(step: &'static str, instance: &str) {
    static TARGET: OnceLock<Option<String>> = OnceLock::new();
    let target = TARGET.get_or_init(|| std::env::var("CRASH_AT").ok().filter(|s| !s.is_empty()));
    if target.as_deref() == Some(step) {
        eprintln!("failpoint {step}: aborting");
        std::process::abort();
    }
    let gate = gates()
        .lock()
        .expect("failpoint gates")
        .remove(&(instance.to_owned(), step));
    if let Some(gate) = gate {
        let _ = gate.reached.send(());
        // A dropped handle resumes too.
        let _ = gate.resume.await;
    }
}

/// A pause armed by [`pause`], held by the test.
pub struct Paused {
    reached: Option<oneshot::Receiver<()>>,
    resume: Option<oneshot::Sender<()>>,
}

/// Arms a pause: the next transfer of `instance` to complete `step` waits there until
/// [`Paused::resume`] (or until the handle is dropped).
pub fn pause(instance: &str, step: &'static str) -> Paused {
    let (reached_tx, reached_rx) = oneshot::channel();
    let (resume_tx, resume_rx) = oneshot::channel();
    gates().lock().expect("failpoint gates").insert(
        (instance.to_owned(), step),
        Gate {
            reached: reached_tx,
            resume: resume_rx,
        },
    );
    Paused {
        reached: Some(reached_rx),
        resume: Some(resume_tx),
    }
}

impl Paused {
    /// Waits until a transfer has completed the step and stopped there.
    pub async fn reached(&mut self) {
        if let Some(reached) = self.reached.take() {
            reached.await.expect("the paused step was reached");
        }
    }

    /// Lets the paused transfer go on.
    pub fn resume(&mut self) {
        if let Some(resume) = self.resume.take() {
            let _ = resume.send(());
        }
    }
}
