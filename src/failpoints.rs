//! Fault injection for the recovery tests, compiled only with the `failpoints` feature.
//! Each step of the protocol calls [`hit`] right after it completes: `after_insert`,
//! `after_pending`, `after_debit`, `after_credit`, `after_applied`, `after_pull` (both
//! markers, one write), `after_canceling`, `after_undo_destination`, `after_undo_source`;
//! for a hold, `after_debit` and `after_credit` follow its reservations, then
//! `after_held`, `after_settle` (a capture, void or expiry won `held`),
//! `after_capture_source`, `after_capture_destination`, and a void's releases are
//! `after_undo_source`, `after_undo_destination` (the source's first); `after_take_key` (an idempotency key
//! taken, its transfer not recorded yet) and `after_reserve_account` (an account id
//! reserved in the directory, the account not written yet). Each write of the store calls it right before the write is
//! sent, so that a test can hold a write back and let it reach the server late:
//! `before_insert`, `before_transition`, `before_force`, `before_renew`, `before_claim`,
//! `before_take_over`, `before_claim_reversal`, `before_mark_fenced`, `before_fence`,
//! `before_debit`, `before_credit`, `before_pull`, `before_undo`, `before_settle`,
//! `before_capture`, `before_take_key`.
//!
//! - Crash: `CRASH_AT=<step>` makes the process abort, as kill -9 would (no destructors,
//!   no flushing, no graceful shutdown), at that step of the first transfer reaching it.
//! - Pause: [`pause`] makes one instance (by `INSTANCE_ID`) stop at a step of the first
//!   transfer reaching it until the test resumes it, so that a test can act in between
//!   (cancel, take over) and then let the paused step go on: deterministic interleavings.
//! - Lost reply: [`lose_reply`] makes the next debit or credit of an instance land but
//!   report a failure, as a dropped connection would, so that it is sent again.
//! - Recorded twice: [`record_twice`] makes the next transfer an instance records be
//!   sent twice, as a driver's retry of an insert whose reply was lost would be on a
//!   server that does not recognise the retry: the instance sees the second answer, a
//!   duplicate key.
//! - Scheduler: [`install_hook`] routes every point of one instance to a [`Hook`], which
//!   decides when that instance may go on (`tests/explorer.rs` runs several instances
//!   cooperatively, one at a time, in an order it chooses, to explore interleavings).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

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
    if HOOKS_INSTALLED.load(Ordering::Acquire) > 0 {
        let hook = hooks()
            .lock()
            .expect("failpoint hooks")
            .get(instance)
            .cloned();
        if let Some(hook) = hook {
            hook.hit(step, instance).await;
        }
    }
}

/// What a [`Hook`] returns: resolves when the instance may go on.
pub type HookFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A scheduler of the points of one or more instances: called at every point an
/// instance it was installed for reaches (after the crash and pause checks), and that
/// instance goes on only once the returned future resolves.
pub trait Hook: Send + Sync {
    fn hit(&self, step: &'static str, instance: &str) -> HookFuture;
}

/// How many hooks are installed: lets [`hit`] skip the lock when none is.
static HOOKS_INSTALLED: AtomicUsize = AtomicUsize::new(0);

fn hooks() -> &'static Mutex<HashMap<String, Arc<dyn Hook>>> {
    static HOOKS: OnceLock<Mutex<HashMap<String, Arc<dyn Hook>>>> = OnceLock::new();
    HOOKS.get_or_init(Default::default)
}

/// Routes every point of `instance` to `hook` until [`remove_hook`] (replaces any hook
/// installed for it before).
pub fn install_hook(instance: &str, hook: Arc<dyn Hook>) {
    if hooks()
        .lock()
        .expect("failpoint hooks")
        .insert(instance.to_owned(), hook)
        .is_none()
    {
        HOOKS_INSTALLED.fetch_add(1, Ordering::AcqRel);
    }
}

/// Removes the hook of `instance`: its points run on again.
pub fn remove_hook(instance: &str) {
    if hooks()
        .lock()
        .expect("failpoint hooks")
        .remove(instance)
        .is_some()
    {
        HOOKS_INSTALLED.fetch_sub(1, Ordering::AcqRel);
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

/// Instances whose next forward step (debit or credit) will lose its reply, armed by
/// [`lose_reply`].
fn lost_replies() -> &'static Mutex<Vec<String>> {
    static LOST: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    LOST.get_or_init(Default::default)
}

/// The instances whose next transfer insert is sent twice ([`record_twice`]).
fn doubled_inserts() -> &'static Mutex<Vec<String>> {
    static DOUBLED: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    DOUBLED.get_or_init(Default::default)
}

/// Makes the next transfer `instance` records be sent twice (see the module's doc).
pub fn record_twice(instance: &str) {
    doubled_inserts()
        .lock()
        .expect("doubled inserts")
        .push(instance.to_owned());
}

/// Called by the store before it records a transfer: whether to send it twice (once per
/// [`record_twice`]).
pub fn recorded_twice(instance: &str) -> bool {
    let mut doubled = doubled_inserts().lock().expect("doubled inserts");
    match doubled.iter().position(|i| i == instance) {
        Some(at) => {
            doubled.remove(at);
            true
        }
        None => false,
    }
}

/// Makes the next debit or credit of `instance` lose its reply once: the write lands,
/// but the instance is told it failed as a dropped connection would (and sends it again).
pub fn lose_reply(instance: &str) {
    lost_replies()
        .lock()
        .expect("lost replies")
        .push(instance.to_owned());
}

/// Called by the store after a forward step's write: whether to pretend its reply was
/// lost (once per [`lose_reply`]).
pub async fn reply_lost(instance: &str) -> bool {
    let mut lost = lost_replies().lock().expect("lost replies");
    match lost.iter().position(|i| i == instance) {
        Some(at) => {
            lost.remove(at);
            true
        }
        None => false,
    }
}
