//! Fault injection for the recovery tests, compiled only with the `failpoints` feature,
//! which every test, example and bench build turns on (the package's dev-dependency on
//! itself, Cargo.toml) and `cargo build` never does.
//! Each step of the protocol calls [`hit`] right after it completes: `after_insert`,
//! `after_pending`, `after_debit`, `after_credit`, `after_applied`, `after_pull` (both
//! markers, one write), `after_canceling`, `after_undo_destination`, `after_undo_source`;
//! for a hold, `after_debit` and `after_credit` follow its reservations, then
//! `after_held`, `after_settle` (a capture, void or expiry won `held`),
//! `after_capture_source`, `after_capture_destination`, and a void's releases are
//! `after_undo_source`, `after_undo_destination` (the source's first); `after_take_key` (an
//! idempotency key taken, its transfer not recorded yet), `after_reserve_account` (an
//! account id reserved in the directory, the account not written yet),
//! `waiting_for_admission` (a request found every admission permit taken and is about to
//! wait for one) and `after_drive` (a run let go of its transfer's drive lock: another
//! task of the process may drive it now). A run that finds its transfer driven by another
//! task of its process waits at `wait_drive`, and only under a [`Hook`] (see [`hooked`]):
//! it tries the lock again each time it is let go, so that a scheduler sees it wait. Each
//! write of the store calls it right before the write is sent, so that a test can hold a
//! write back and let it reach the server late:
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
//! - Held back: [`hold_back`] makes every debit, every credit, or every state change of
//!   an owner (`before_debit`, `before_credit`, `before_transition`) of an instance fail
//!   without being sent, as a partition would, until [`let_through`]: each attempt is
//!   told it failed, so the step fails, and is kept; [`send_held`] sends what was kept,
//!   as the late landings of requests stuck in the network.
//! - Recorded twice: [`record_twice`] makes the next transfer an instance records be
//!   sent twice, as a driver's retry of an insert whose reply was lost would be on a
//!   server that does not recognise the retry: the instance sees the second answer, a
//!   duplicate key.
//! - Clocks: [`set_clocks`] makes the next resolving writes of a hold (capture, void,
//!   expiry) of an instance judge it by the given times, one per write, instead of the
//!   server's `$$NOW`: a clock that goes backwards between two commands.
//! - Lagging reads: [`lag_reads`] makes the next reads of the transfer log by an
//!   instance (a transfer or an idempotency key's record, by id) find nothing, as a read
//!   with majority read concern does while what it looks for is on the primary but not
//!   yet on a majority (a single-node server never lags so).
//! - Scheduler: [`install_hook`] routes every point of one instance to a [`Hook`], which
//!   decides when that instance may go on (`tests/explorer/` runs several instances
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

/// Whether a hook is installed for `instance`. A hook runs the instance as one sequence
/// of points, so then the instance neither blocks where the hook cannot see it (a run
/// waiting for another task of its process parks at `wait_drive` and tries again when
/// let go) nor runs two parts of itself at once (a sweep does one thing at a time).
pub fn hooked(instance: &str) -> bool {
    HOOKS_INSTALLED.load(Ordering::Acquire) > 0
        && hooks()
            .lock()
            .expect("failpoint hooks")
            .contains_key(instance)
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

/// The writes of each instance that [`hold_back`] holds back, by point.
fn held_back_steps() -> &'static Mutex<Vec<(String, &'static str)>> {
    static HELD: OnceLock<Mutex<Vec<(String, &'static str)>>> = OnceLock::new();
    HELD.get_or_init(Default::default)
}

/// Makes every attempt of `step` (`before_debit` or `before_credit`, a hold's reservations
/// included, or `before_transition`, an owner's state change) of `instance` fail without
/// being sent, until [`let_through`].
pub fn hold_back(instance: &str, step: &'static str) {
    held_back_steps()
        .lock()
        .expect("held-back steps")
        .push((instance.to_owned(), step));
}

/// Undoes [`hold_back`].
pub fn let_through(instance: &str, step: &'static str) {
    held_back_steps()
        .lock()
        .expect("held-back steps")
        .retain(|(i, s)| (i.as_str(), *s) != (instance, step));
}

/// Called by the store before each attempt of a forward step or an owner's state change:
/// whether to hold it back (then the store [`keep`]s it).
pub fn held_back(instance: &str, step: &'static str) -> bool {
    held_back_steps()
        .lock()
        .expect("held-back steps")
        .iter()
        .any(|(i, s)| (i.as_str(), *s) == (instance, step))
}

/// A write held back, to be sent by [`send_held`].
pub type HeldWrite = Pin<Box<dyn Future<Output = ()> + Send>>;

fn kept_writes() -> &'static Mutex<Vec<(String, HeldWrite)>> {
    static KEPT: OnceLock<Mutex<Vec<(String, HeldWrite)>>> = OnceLock::new();
    KEPT.get_or_init(Default::default)
}

/// Keeps a write of `instance` that was held back (called by the store).
pub fn keep(instance: &str, write: HeldWrite) {
    kept_writes()
        .lock()
        .expect("kept writes")
        .push((instance.to_owned(), write));
}

/// Sends the writes of `instance` held back so far, one after the other in the order
/// they were attempted: they reach the server now. How many there were.
pub async fn send_held(instance: &str) -> usize {
    let writes: Vec<HeldWrite> = {
        let mut kept = kept_writes().lock().expect("kept writes");
        let (mine, others) = std::mem::take(&mut *kept)
            .into_iter()
            .partition(|(i, _)| i == instance);
        *kept = others;
        mine.into_iter().map(|(_, w)| w).collect()
    };
    let sent = writes.len();
    for write in writes {
        write.await;
    }
    sent
}

fn clocks()
-> &'static Mutex<HashMap<String, std::collections::VecDeque<chrono::DateTime<chrono::Utc>>>> {
    static CLOCKS: OnceLock<
        Mutex<HashMap<String, std::collections::VecDeque<chrono::DateTime<chrono::Utc>>>>,
    > = OnceLock::new();
    CLOCKS.get_or_init(Default::default)
}

/// Makes the next resolving writes of a hold by `instance` take these times for the
/// server's clock, one per write, in order; then `$$NOW` again.
pub fn set_clocks(instance: &str, times: impl IntoIterator<Item = chrono::DateTime<chrono::Utc>>) {
    clocks()
        .lock()
        .expect("clocks")
        .insert(instance.to_owned(), times.into_iter().collect());
}

/// Called by the store for each resolving write: the time it must take for the server's
/// clock, if a test set one.
pub fn next_clock(instance: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    clocks()
        .lock()
        .expect("clocks")
        .get_mut(instance)?
        .pop_front()
}

/// Instances whose next reads of the log find nothing, and how many ([`lag_reads`]).
fn lagging_reads() -> &'static Mutex<HashMap<String, usize>> {
    static LAGGING: OnceLock<Mutex<HashMap<String, usize>>> = OnceLock::new();
    LAGGING.get_or_init(Default::default)
}

/// Makes the next `reads` reads of the transfer log by `instance` (a transfer or an
/// idempotency key's record, by id) find nothing, as a majority read that lags behind
/// the primary would (see the module's doc); 0 ends a lag armed before.
pub fn lag_reads(instance: &str, reads: usize) {
    lagging_reads()
        .lock()
        .expect("lagging reads")
        .insert(instance.to_owned(), reads);
}

/// Called by the store before it reads the log by id: whether this read lags (once per
/// read armed by [`lag_reads`]).
pub fn read_lags(instance: &str) -> bool {
    let mut lagging = lagging_reads().lock().expect("lagging reads");
    match lagging.get_mut(instance) {
        Some(left) if *left > 0 => {
            *left -= 1;
            true
        }
        _ => false,
    }
}
