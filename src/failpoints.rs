//! Fault injection for the recovery tests, compiled only with the `failpoints` feature,
//! which every test, example and bench build turns on (the package's dev-dependency on
//! itself, Cargo.toml) and `cargo build` never does.
//!
//! The points are the variants of [`Point`], each documented where it is: one right after
//! each step of the protocol (`after_*`, and a few more places a test needs to stop at),
//! and one right before each write of the store is sent (`before_*`), so that a test can
//! hold a write back and let it reach the server late. The code names a point by its
//! variant (`failpoint!(self, AfterDebit)`), so a misspelt point does not compile; its
//! name ([`Point::name`], `after_debit`) is what `CRASH_AT` takes and what traces show.
//! Each point calls [`hit`] with the instance that reached it.
//!
//! - Crash: `CRASH_AT=<name>` makes the process abort, as kill -9 would (no destructors,
//!   no flushing, no graceful shutdown), at that point of the first transfer reaching it.
//!   A name that is no point's stops the instance at start ([`crash_point`]).
//! - Pause: [`pause`] makes one instance (by `INSTANCE_ID`) stop at a point of the first
//!   transfer reaching it until the test resumes it, so that a test can act in between
//!   (cancel, take over) and then let the paused step go on: deterministic interleavings.
//! - Lost reply: [`lose_reply`] makes the next debit or credit of an instance land but
//!   report a failure, as a dropped connection would, so that it is sent again.
//! - Held back: [`hold_back`] makes every debit, every credit, or every state change of
//!   an owner ([`Point::BeforeDebit`], [`Point::BeforeCredit`],
//!   [`Point::BeforeTransition`]) of an instance fail without being sent, as a partition
//!   would, until [`let_through`]: each attempt is told it failed, so the step fails, and
//!   is kept; [`send_held`] sends what was kept, as the late landings of requests stuck in
//!   the network.
//! - Inserted twice: [`insert_twice`] makes the next transfer an instance inserts be
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
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::oneshot;

/// Declares [`Point`] from one list, so that its variants, their names and [`Point::ALL`]
/// cannot drift apart.
macro_rules! points {
    ($($(#[doc = $doc:literal])+ $variant:ident = $name:literal,)+) => {
        /// A place where a test may crash, pause or schedule an instance (see the module's
        /// doc): right after a step of the protocol, or right before a write of the store.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Point {
            $($(#[doc = $doc])+ $variant,)+
        }

        impl Point {
            /// Every point, in the order of the list.
            pub const ALL: &[Point] = &[$(Point::$variant,)+];

            /// The name `CRASH_AT` takes and traces show (`after_debit`).
            pub const fn name(self) -> &'static str {
                match self {
                    $(Point::$variant => $name,)+
                }
            }
        }
    };
}

points! {
    /// A new transfer is inserted (`pending`, owned by the instance that inserted it; a
    /// reversal's compensation `initial`, no owner yet); before its run starts.
    AfterInsert = "after_insert",
    /// The run owns the transfer, `pending`, and has sent no account step: right after
    /// the insert of a new transfer (which inserts it so), after `initial -> pending` for
    /// one inserted `initial`.
    AfterPending = "after_pending",
    /// The paying parties are prepared: debited and marked; for a hold, their
    /// reservations made. A transfer's receiving parties are prepared in the same round
    /// (their room made), but for a one-leg transfer inserted before one protocol, whose
    /// destination is credited after this.
    AfterDebit = "after_debit",
    /// Every party is prepared (for a transfer inserted before one protocol, its
    /// destination credited); before the commit (`-> applied`, a hold's `-> held`).
    AfterCredit = "after_credit",
    /// `pending -> applied`.
    AfterApplied = "after_applied",
    /// Every party of an applied transfer is settled: paid in, every marker pulled.
    AfterPull = "after_pull",
    /// A rollback began (`-> canceling`).
    AfterCanceling = "after_canceling",
    /// A rollback gave the receiving parties' room back (before the paying parties'
    /// debits); for a hold, their reservations are released (after the paying parties').
    AfterUndoDestination = "after_undo_destination",
    /// A rollback gave the paying parties' debits back (after the receiving parties');
    /// for a hold, their reservations are released (first).
    AfterUndoSource = "after_undo_source",
    /// A hold's reservations are both made and it is stored `held`.
    AfterHeld = "after_held",
    /// A capture, void or expiry won a `held` hold (`resolve_hold`, the state change of
    /// a `Mover::Resolver`).
    AfterResolve = "after_resolve",
    /// A capture moved the money of every party and released its reservations (one
    /// round for all of them); the next point follows at once.
    AfterCaptureSource = "after_capture_source",
    /// As [`Point::AfterCaptureSource`]; before `capturing -> done`.
    AfterCaptureDestination = "after_capture_destination",
    /// An idempotency key is taken; its transfer is not inserted yet.
    AfterTakeKey = "after_take_key",
    /// An account's id is reserved in the directory; the account is not written yet.
    AfterReserveAccount = "after_reserve_account",
    /// A request found every admission permit taken and is about to wait for one.
    WaitingForAdmission = "waiting_for_admission",
    /// A run let go of its transfer's drive lock: another task of the process may drive
    /// it now.
    AfterDrive = "after_drive",
    /// A run found its transfer driven by another task of its process and waits for the
    /// drive lock. Only under a [`Hook`] (see [`hooked`]): it tries the lock again each
    /// time it is let go, so that a scheduler sees it wait.
    WaitDrive = "wait_drive",
    /// Before a transfer is inserted.
    BeforeInsert = "before_insert",
    /// Before an owner's state change.
    BeforeTransition = "before_transition",
    /// Before a cancel's state change of a transfer it does not own (its accounts
    /// fenced).
    BeforeForce = "before_force",
    /// Before an owner renews its lease.
    BeforeRenew = "before_renew",
    /// Before a sweeper claims a stale transfer.
    BeforeClaim = "before_claim",
    /// Before a cancel takes over an `applied` or `canceling` transfer.
    BeforeTakeOver = "before_take_over",
    /// Before the one reversal of a done transfer is claimed.
    BeforeClaimReversal = "before_claim_reversal",
    /// Before a transfer is marked `fenced`, ahead of the fences of its accounts.
    BeforeMarkFenced = "before_mark_fenced",
    /// Before an account is fenced against a transfer.
    BeforeFence = "before_fence",
    /// Before a debit (a hold's reservation out included) is sent, each attempt.
    BeforeDebit = "before_debit",
    /// Before a credit (a hold's reservation in included) is sent, each attempt.
    BeforeCredit = "before_credit",
    /// Before the markers of an applied transfer are pulled.
    BeforePull = "before_pull",
    /// Before a debit or credit is undone, or a hold's reservation released.
    BeforeUndo = "before_undo",
    /// Before a capture, void or expiry changes a `held` hold (`resolve_hold`).
    BeforeResolve = "before_resolve",
    /// Before a capture's write on one account.
    BeforeCapture = "before_capture",
    /// Before an idempotency key is taken.
    BeforeTakeKey = "before_take_key",
}

impl Point {
    /// Whether the point is right before a write of the store is sent (`before_*`): a
    /// write held there reaches the server late.
    pub fn precedes_a_write(self) -> bool {
        self.name().starts_with("before_")
    }
}

impl fmt::Display for Point {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Point {
    type Err = UnknownPoint;

    /// The point of that name (`after_debit`).
    fn from_str(name: &str) -> Result<Point, UnknownPoint> {
        Point::ALL
            .iter()
            .copied()
            .find(|point| point.name() == name)
            .ok_or_else(|| UnknownPoint(name.to_owned()))
    }
}

/// A name that is no [`Point`]'s; shown with the names there are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownPoint(pub String);

impl fmt::Display for UnknownPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no failpoint is named {:?}; the points are:", self.0)?;
        for point in Point::ALL {
            write!(f, " {point}")?;
        }
        Ok(())
    }
}

impl std::error::Error for UnknownPoint {}

/// The point `CRASH_AT` names, if set, read once. Panics, with the names there are, when
/// it names no point: a misspelt crash point would never fire, and a test that expects
/// the crash would fail far from the cause. `startup` reads it before anything else, so
/// that such an instance stops at start; [`hit`] reads it at every point.
pub fn crash_point() -> Option<Point> {
    static CRASH_AT: OnceLock<Option<Point>> = OnceLock::new();
    *CRASH_AT.get_or_init(|| {
        let name = std::env::var_os("CRASH_AT").filter(|name| !name.is_empty())?;
        match name.to_string_lossy().parse() {
            Ok(point) => Some(point),
            Err(unknown) => panic!("CRASH_AT: {unknown}"),
        }
    })
}

/// Where a pause waits: told when the step is reached, then waits to be resumed.
struct Gate {
    reached: oneshot::Sender<()>,
    resume: oneshot::Receiver<()>,
}

/// Armed pauses, by instance and point. A pause fires once and is removed.
fn gates() -> &'static Mutex<HashMap<(String, Point), Gate>> {
    static GATES: OnceLock<Mutex<HashMap<(String, Point), Gate>>> = OnceLock::new();
    GATES.get_or_init(Default::default)
}

/// Called by the `failpoint!` macro at each point `instance` reaches.
pub async fn hit(point: Point, instance: &str) {
    if crash_point() == Some(point) {
        eprintln!("failpoint {point}: aborting");
        std::process::abort();
    }
    let gate = gates()
        .lock()
        .expect("failpoint gates")
        .remove(&(instance.to_owned(), point));
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
            hook.hit(point, instance).await;
        }
    }
}

/// What a [`Hook`] returns: resolves when the instance may go on.
pub type HookFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A scheduler of the points of one or more instances: called at every point an
/// instance it was installed for reaches (after the crash and pause checks), and that
/// instance goes on only once the returned future resolves.
pub trait Hook: Send + Sync {
    fn hit(&self, point: Point, instance: &str) -> HookFuture;
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

/// Arms a pause: the next transfer of `instance` to reach `point` waits there until
/// [`Paused::resume`] (or until the handle is dropped).
pub fn pause(instance: &str, point: Point) -> Paused {
    let (reached_tx, reached_rx) = oneshot::channel();
    let (resume_tx, resume_rx) = oneshot::channel();
    gates().lock().expect("failpoint gates").insert(
        (instance.to_owned(), point),
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
    /// Waits until a transfer has reached the point and stopped there.
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

/// The instances whose next transfer insert is sent twice ([`insert_twice`]).
fn doubled_inserts() -> &'static Mutex<Vec<String>> {
    static DOUBLED: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    DOUBLED.get_or_init(Default::default)
}

/// Makes the next transfer `instance` inserts be sent twice (see the module's doc).
pub fn insert_twice(instance: &str) {
    doubled_inserts()
        .lock()
        .expect("doubled inserts")
        .push(instance.to_owned());
}

/// Called by the store before it inserts a transfer: whether to send it twice (once per
/// [`insert_twice`]).
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
fn held_back_points() -> &'static Mutex<Vec<(String, Point)>> {
    static HELD: OnceLock<Mutex<Vec<(String, Point)>>> = OnceLock::new();
    HELD.get_or_init(Default::default)
}

/// Makes every attempt of the write at `point` ([`Point::BeforeDebit`] or
/// [`Point::BeforeCredit`], a hold's reservations included, or
/// [`Point::BeforeTransition`], an owner's state change) of `instance` fail without being
/// sent, until [`let_through`].
pub fn hold_back(instance: &str, point: Point) {
    held_back_points()
        .lock()
        .expect("held-back points")
        .push((instance.to_owned(), point));
}

/// Undoes [`hold_back`].
pub fn let_through(instance: &str, point: Point) {
    held_back_points()
        .lock()
        .expect("held-back points")
        .retain(|(i, p)| (i.as_str(), *p) != (instance, point));
}

/// Called by the store before each attempt of a forward step or an owner's state change:
/// whether to hold it back (then the store [`keep`]s it).
pub fn held_back(instance: &str, point: Point) -> bool {
    held_back_points()
        .lock()
        .expect("held-back points")
        .iter()
        .any(|(i, p)| (i.as_str(), *p) == (instance, point))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every point's name reads back as that point, and no two points share a name: a
    /// `CRASH_AT` names exactly one.
    #[test]
    fn every_point_is_found_by_its_name_alone() {
        for &point in Point::ALL {
            assert_eq!(point.name().parse(), Ok(point));
            assert_eq!(point.to_string(), point.name());
        }
        let mut names: Vec<_> = Point::ALL.iter().map(|p| p.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Point::ALL.len());
    }

    /// A name that is no point's is refused with the names there are.
    #[test]
    fn an_unknown_name_is_refused_with_the_names_there_are() {
        let unknown = "after_debt".parse::<Point>().unwrap_err();
        let told = unknown.to_string();
        assert!(told.contains("\"after_debt\""), "{told}");
        for point in Point::ALL {
            assert!(told.contains(point.name()), "{told} lacks {point}");
        }
    }

    /// The points a scheduler parks at to let writes land late are those before a write.
    #[test]
    fn only_the_points_before_a_write_precede_one() {
        assert!(Point::BeforeDebit.precedes_a_write());
        assert!(Point::BeforeResolve.precedes_a_write());
        assert!(!Point::AfterDebit.precedes_a_write());
        assert!(!Point::WaitDrive.precedes_a_write());
    }
}
