//! An interleaving explorer, in the spirit of FoundationDB's simulation and TigerBeetle's
//! VOPR, against the real database.
//!
//! Several actors (a transfer's owner, a recoverer after a crash, cancels, a sweeper; for
//! a hold also captures, voids and expiries), each a `TransferService` with its own instance id, run
//! cooperatively: a scheduler installed with `failpoints::install_hook` parks every actor
//! at its points (right before each write is sent, `before_*`; with `EXPLORE_POINTS=all`
//! after each protocol step too) and lets exactly one of them run at a time, choosing
//! which one from a schedule (a vector of choices). Once the choices run out, the
//! remaining actors run in a fixed order (lowest actor first) to completion. A write held
//! at a `before_*` point is a write that reaches the server late.
//!
//! A scenario is a transfer scenario (the owner transfers AMOUNT from a to b) or a hold
//! scenario (named with the prefix `hold:`: the owner creates a hold of AMOUNT from a to
//! b, expiring in `HOLD_EXPIRY`). The actors of a hold scenario: `capture` captures all of
//! the hold, `void` voids it, `expire` makes the clock reach its `expiresAt` (a raw write
//! sets it into the past, safe at any moment as time passing is) and then sweeps, which
//! expires it if still `held`; `cancel` cancels it (voids it if `held`, rolls it back if
//! pending, reverses it once captured). Each of them answers "nothing recorded yet" when
//! it comes before the hold is recorded. The prelude `held:` runs the hold to `held`
//! first, as `done:` runs a transfer to `done`.
//!
//! Two tasks of one process (issue 17, item 1): in a scenario with the prefix `same:` the
//! actors (and the owner of a `done:` or `held:` prelude) are `TransferService::sibling`s of one
//! process: they share its owner in `application`, its drive locks, its record of
//! unanswered writes and its admission, and each names its points with an instance id of
//! its own, so that the scheduler tells them apart. A run that finds its transfer driven
//! by a sibling parks at `wait_drive` and is not ready (blocked) until an actor lets go of
//! a drive lock (`after_drive`, told to the scheduler, never parked at); if only blocked
//! actors are left, the schedule is a deadlock. One actor may have a step held back for
//! the whole schedule (shown after its name, `cancel~credit`: its debits, credits or
//! state changes as owner, `~debit`, `~credit`, `~transition`, see
//! `failpoints::hold_back`): each attempt fails unanswered and is kept, so its run fails
//! and it answers 503, which is right for it alone. The actor `net` sends what is held
//! back when the scheduler lets it go: a late landing at a moment the schedule chooses.
//! It waits until a write is held back (before that it would send nothing; it runs then
//! only if nobody else can); whatever is still held when the actors are done is sent
//! then, before the final sweep. The actor `lapse` waits (really: time passing is safe at
//! any moment) until the lease of every unfinished transfer has lapsed and then sweeps:
//! the process's own sweeper claiming back a transfer of its own. Under the scheduler a
//! sweep does one thing at a time (deployments one after the other, each run before the
//! next claim), so that no part of an actor runs unseen. `same:` scenarios use
//! `SAME_LEASE`, shorter than `LEASE`, as most of their schedules wait most of a lease:
//! a second run waits until a first run's unanswered step can no longer land.
//!
//! Exploration:
//! 1. every ordering with at most `EXPLORE_PREEMPTIONS` preemptions (CHESS-style bound,
//!    default 1; `all` for every ordering; depth-first over the decision tree) of the
//!    pairs {owner, cancel},
//!    {recoverer after a crash at point k, cancel} for every point k the owner passes,
//!    and {cancel, cancel} of a done transfer; and for a hold: every pair of {capture,
//!    void, expire, cancel} (two of a kind included) of a held hold, {owner creating it,
//!    each of those four}, and {recoverer after a crash at point k of creating it,
//!    cancel} for every point k; and of one process: {cancel with its reversal's credit
//!    held back, cancel, net} and the same with the debit held back, of a done transfer,
//!    and {owner with its credit held back, cancel or lapse, net};
//! 2. `EXPLORE_SCHEDULES` seeded random orderings of three actors; by the seed, a quarter
//!    of them `same:` scenarios (a cancel of a done transfer or an owner, with its debit,
//!    credit or state change held back; a cancel or a lapse; net), and of the others half
//!    transfer scenarios (owner or recoverer, cancel, and a second cancel or a sweeper),
//!    half hold scenarios (three actors drawn from {capture, void, expire, cancel,
//!    sweeper} after a held prelude, or owner or recoverer and two of those).
//!
//! Every scenario runs in two layouts: both accounts on one deployment, and (prefix
//! `across:`) b on a second deployment, a second database server, so that the credit,
//! the destination's fence and a reversal's log are on another server than the
//! transfer's log, each write checked by its own server's clock. The exhaustive
//! scenarios are enumerated in both layouts; half the random ones are `across:`.
//!
//! Each schedule runs from scratch on fresh accounts, in one of `EXPLORE_WORKERS`
//! databases (schedules of different workers run concurrently). After it, everything is
//! let finish, a lease is let pass (by ageing the schedule's transfers, which is safe once
//! no actor is left, so no write is in flight) and a sweep runs; then the invariants are
//! checked: conservation, balances from the log (a done hold moved its captured amount),
//! no fences, at most one reversal, and answers that agree with the final state. For a
//! transfer scenario also: no markers, every transfer terminal. For a hold scenario
//! instead: `pendingDebits` and `pendingCredits` of each account are the held amounts of
//! the holds still `held` out of and into it, its markers exactly theirs, its available
//! balance not negative, every other transfer terminal; at most one hold, whose end is
//! one a scenario's actor may have made (a capture for `done`, and of all of it; an expiry
//! for `expired`; a void or a cancel for `voided` and `canceled_by_request`; only a cancel
//! reverses a captured hold); a capture answered with the hold means `done` with that
//! amount, a void answered with it means `canceled`, `AlreadyCaptured` means `done`,
//! `Voided` means `canceled` voided or by request, `Expired` means `canceled` expired, and
//! an expiry whose sweep expired a hold means `canceled` expired. A hold left `held` is
//! voided after the check, so that no later schedule of the worker sees it expire.
//!
//! A violation prints the schedule as `EXPLORE_REPLAY='<scenario>/<choices>'` (random
//! ones also as `EXPLORE_SEED=<seed>`) with the points it reached; either variable replays
//! just that schedule, printing its trace.
//! `EXPLORE_PREEMPTIONS` bounds the preemptions of an exhaustive schedule (default 1;
//! `all`: every ordering); `EXPLORE_DFS_LIMIT` the schedules per exhaustive scenario
//! (default: none); `EXPLORE_SCHEDULES` the random ones (default 300); `EXPLORE_WORKERS`
//! the concurrent databases (default 6); `EXPLORE_POINTS=all` parks after steps too;
//! `EXPLORE_FILTER=<text>` runs only the scenarios (exhaustive, and random by their seed)
//! whose name contains it, `same:` say.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mongodb::bson::{DateTime, Document, doc};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use transfer_service::domain::{
    Account, AccountId, Amount, CancelReason, Currency, DeploymentName, OpeningBalance, Transfer,
    TransferFilter, TransferId, TransferState,
};
use transfer_service::failpoints::{self, Hook, HookFuture};
use transfer_service::service::{
    Completion, HoldConflict, NewAccount, NewTransfer, ServiceError, TransferService,
};
use transfer_service::store::{DEFAULT_GROUP_COMMIT_WRITES, Deployments, Store};

/// The lease of every actor. Long, so that no lease lapses by itself while a schedule
/// runs (which would make schedules depend on timing); the lapses the scenarios need are
/// made by ageing `lastModified` when no write can be in flight.
const LEASE: Duration = Duration::from_secs(5);
const OPENING: i64 = 1000;
const AMOUNT: i64 = 300;
/// How long a hold of a hold scenario lasts: far longer than a schedule, so that a hold
/// only expires when a `Kind::Expire` actor makes it.
const HOLD_EXPIRY: Duration = Duration::from_secs(60);
/// The lease of the banks of a `same:` scenario. A second run of a transfer in the
/// process whose first run's step failed without an answer waits until that step's
/// deadline has passed (up to 0.9 of a lease), and a `lapse` actor waits a lease: real
/// waits, in most of these schedules. Shorter than `LEASE` so that they cost less. Nothing
/// of these scenarios takes a transfer over by a lapsed lease but a `lapse` actor, which
/// waits for it; a deadline that passes while an actor is parked (a sibling waiting out
/// a step makes it pass) only makes that actor renew its lease and try again.
const SAME_LEASE: Duration = Duration::from_secs(1);
/// How long one actor may run between two of its points before the schedule is
/// declared stuck: far longer than the longest wait an actor makes without a point (a
/// second run waiting out a first run's deadline, a `lapse`), a lease.
const STEP_LIMIT: Duration = Duration::from_secs(30);
/// The point where a run waits for its transfer's drive lock, held by another task of
/// its process (`same:` scenarios): the actor is blocked, not ready, until an actor
/// passes `after_drive` (lets go of a drive lock); then it tries again.
const WAIT_DRIVE: &str = "wait_drive";
/// The point a run passes once it has let go of its transfer's drive lock.
const AFTER_DRIVE: &str = "after_drive";

// ---------------------------------------------------------------------------------------
// Scenarios

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `bank.transfer` of AMOUNT from a to b (a hold, in a hold scenario).
    Owner,
    /// `sweep_once` after the owner crashed.
    Recoverer,
    /// `bank.cancel` of the transfer (if recorded by then).
    Cancel,
    /// `sweep_once`: housekeeping.
    Sweeper,
    /// `bank.capture` of the whole hold (if recorded by then).
    Capture,
    /// `bank.void` of the hold (if recorded by then).
    Void,
    /// The clock reaches the hold's `expiresAt` (a raw write sets it into the past),
    /// then `sweep_once`, which expires it if it is still `held`.
    Expire,
    /// Time passes until the lease of every unfinished transfer of the schedule has
    /// lapsed by its log's clock (a real wait: safe at any moment, as time passing is),
    /// then `sweep_once`, which claims them (in a `same:` scenario, under the process's
    /// own owner) unless a task of its process is driving them.
    Lapse,
    /// The network: sends every write held back so far (see [`Held`]), which reaches the
    /// server now, late.
    Net,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Owner => "owner",
            Kind::Recoverer => "recoverer",
            Kind::Cancel => "cancel",
            Kind::Sweeper => "sweeper",
            Kind::Capture => "capture",
            Kind::Void => "void",
            Kind::Expire => "expire",
            Kind::Lapse => "lapse",
            Kind::Net => "net",
        }
    }

    fn parse(s: &str) -> Kind {
        match s {
            "owner" => Kind::Owner,
            "recoverer" => Kind::Recoverer,
            "cancel" => Kind::Cancel,
            "sweeper" => Kind::Sweeper,
            "capture" => Kind::Capture,
            "void" => Kind::Void,
            "expire" => Kind::Expire,
            "lapse" => Kind::Lapse,
            "net" => Kind::Net,
            other => panic!("unknown actor {other}"),
        }
    }
}

/// A step of one actor held back in the network (`failpoints::hold_back`) for the whole
/// schedule: every attempt of it fails without an answer, so its run fails (a cancel or a
/// transfer answers 503), and is kept; the `net` actor, or the end of the actors, sends
/// what was kept. Shown after the actor's name: `cancel~credit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    /// Its debits (a hold's reservation out included).
    Debit,
    /// Its credits (a hold's reservation in included).
    Credit,
    /// Its state changes as the owner.
    Transition,
}

impl Held {
    fn name(self) -> &'static str {
        match self {
            Held::Debit => "debit",
            Held::Credit => "credit",
            Held::Transition => "transition",
        }
    }

    fn parse(s: &str) -> Held {
        match s {
            "debit" => Held::Debit,
            "credit" => Held::Credit,
            "transition" => Held::Transition,
            other => panic!("unknown held step {other}"),
        }
    }

    /// The point `failpoints::hold_back` takes.
    fn point(self) -> &'static str {
        match self {
            Held::Debit => "before_debit",
            Held::Credit => "before_credit",
            Held::Transition => "before_transition",
        }
    }
}

/// What happens before the actors run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Prelude {
    Nothing,
    /// The owner runs alone until its k-th point (counting every point, from 0), then
    /// crashes there (its future is dropped: the write it was about to send never is),
    /// and its transfer is aged past its lease.
    Crash(usize),
    /// The owner runs the transfer alone to `done`.
    Done,
    /// The owner runs the hold alone to `held` (hold scenarios only).
    Held,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Scenario {
    /// b lives on a second deployment (a second database server), a on the first: the
    /// transfer is logged with a, its credit (and a reversal's log) is on the other
    /// server, each step checked by its own server's clock. Shown as the prefix `across:`.
    across: bool,
    /// The actors, and the owner of a `done:` or `held:` prelude, are tasks of one
    /// process (`TransferService::sibling`): one owner in `application`, one set of drive locks, one
    /// record of unanswered writes, one admission; each names its points with an instance
    /// id of its own, so that the scheduler tells them apart. Shown as the prefix `same:`.
    same: bool,
    /// The owner creates a hold of AMOUNT (expiring in `HOLD_EXPIRY`) instead of a
    /// transfer. Shown as the prefix `hold:`.
    hold: bool,
    prelude: Prelude,
    actors: Vec<Kind>,
    /// The actor (by index) whose step is held back for the whole schedule, if any.
    held: Option<(usize, Held)>,
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.across {
            write!(f, "across:")?;
        }
        if self.same {
            write!(f, "same:")?;
        }
        if self.hold {
            write!(f, "hold:")?;
        }
        match self.prelude {
            Prelude::Nothing => {}
            Prelude::Crash(k) => write!(f, "crash{k}:")?,
            Prelude::Done => write!(f, "done:")?,
            Prelude::Held => write!(f, "held:")?,
        }
        let names: Vec<String> = self
            .actors
            .iter()
            .enumerate()
            .map(|(i, k)| match self.held {
                Some((at, held)) if at == i => format!("{}~{}", k.name(), held.name()),
                _ => k.name().to_string(),
            })
            .collect();
        write!(f, "{}", names.join("+"))
    }
}

impl Scenario {
    fn new(prelude: Prelude, actors: &[Kind]) -> Scenario {
        Scenario {
            across: false,
            same: false,
            hold: false,
            prelude,
            actors: actors.to_vec(),
            held: None,
        }
    }

    /// A scenario whose actors are tasks of one process, the first of them with `held`
    /// held back.
    fn same(prelude: Prelude, actors: &[Kind], held: Held) -> Scenario {
        Scenario {
            same: true,
            held: Some((0, held)),
            ..Scenario::new(prelude, actors)
        }
    }

    /// The lease of the scenario's banks: `SAME_LEASE` when the actors are one process,
    /// else `LEASE`.
    fn lease(&self) -> Duration {
        if self.same { SAME_LEASE } else { LEASE }
    }

    /// A hold scenario.
    fn hold(prelude: Prelude, actors: &[Kind]) -> Scenario {
        Scenario {
            hold: true,
            ..Scenario::new(prelude, actors)
        }
    }

    /// The same scenario with b on the second deployment.
    fn across(self) -> Scenario {
        Scenario {
            across: true,
            ..self
        }
    }

    fn parse(s: &str) -> Scenario {
        let (across, s) = match s.strip_prefix("across:") {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let (same, s) = match s.strip_prefix("same:") {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let (hold, s) = match s.strip_prefix("hold:") {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let (prelude, actors) = match s.split_once(':') {
            Some(("done", rest)) => (Prelude::Done, rest),
            Some(("held", rest)) => (Prelude::Held, rest),
            Some((crash, rest)) => (
                Prelude::Crash(
                    crash
                        .strip_prefix("crash")
                        .and_then(|k| k.parse().ok())
                        .expect("crash<k>"),
                ),
                rest,
            ),
            None => (Prelude::Nothing, s),
        };
        assert!(
            hold || prelude != Prelude::Held,
            "held: is a prelude of hold scenarios only"
        );
        let mut held = None;
        let mut kinds = Vec::new();
        for (i, actor) in actors.split('+').enumerate() {
            let (kind, step) = match actor.split_once('~') {
                Some((kind, step)) => (kind, Some(Held::parse(step))),
                None => (actor, None),
            };
            if let Some(step) = step {
                assert!(held.is_none(), "one actor at most has a step held back");
                held = Some((i, step));
            }
            kinds.push(Kind::parse(kind));
        }
        Scenario {
            across,
            same,
            hold,
            prelude,
            actors: kinds,
            held,
        }
    }
}

// ---------------------------------------------------------------------------------------
// The scheduler

enum Event {
    Parked(usize, &'static str),
    /// An actor let go of a drive lock: the actors blocked at `WAIT_DRIVE` may try again.
    Released,
    Finished(usize),
}

/// The hook of one schedule's actors: parks an actor at each of its points and tells the
/// driver, which resumes exactly one actor at a time.
struct Scheduler {
    actors: HashMap<String, usize>,
    all_points: bool,
    events: mpsc::UnboundedSender<Event>,
    resumes: Mutex<Vec<Option<oneshot::Sender<()>>>>,
}

impl Scheduler {
    fn park(&self, actor: usize, step: &'static str) -> HookFuture {
        let (tx, rx) = oneshot::channel();
        self.resumes.lock().unwrap()[actor] = Some(tx);
        let _ = self.events.send(Event::Parked(actor, step));
        Box::pin(async move {
            let _ = rx.await;
        })
    }

    fn resume(&self, actor: usize) {
        if let Some(tx) = self.resumes.lock().unwrap()[actor].take() {
            let _ = tx.send(());
        }
    }
}

impl Hook for Scheduler {
    fn hit(&self, step: &'static str, instance: &str) -> HookFuture {
        let Some(&actor) = self.actors.get(instance) else {
            return Box::pin(async {});
        };
        // Told, not parked at: the release is the last thing a run does, and neither a
        // switch nor a crash there differs from one at the actor's next point.
        if step == AFTER_DRIVE {
            let _ = self.events.send(Event::Released);
            return Box::pin(async {});
        }
        // A wait for a drive lock is always parked at: the actor cannot go on by itself.
        if step != WAIT_DRIVE && !self.all_points && !step.starts_with("before_") {
            return Box::pin(async {});
        }
        self.park(actor, step)
    }
}

/// Picks among the actors ready to run.
enum Chooser {
    /// Follows `prefix`, then always the first (depth-first enumeration).
    Fixed(Vec<usize>),
    /// Seeded random choices (splitmix64).
    Random(u64),
}

impl Chooser {
    fn choose(&mut self, decision: usize, options: usize) -> usize {
        match self {
            Chooser::Fixed(prefix) => prefix.get(decision).copied().unwrap_or(0).min(options - 1),
            Chooser::Random(state) => (splitmix(state) % options as u64) as usize,
        }
    }
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// What an actor got back.
#[derive(Debug)]
enum Answer {
    Owner(Result<Transfer, String>),
    /// `None`: nothing recorded yet to cancel (so also for `Capture` and `Void`).
    Cancel(Result<Option<Transfer>, String>),
    Capture(Result<Option<Transfer>, Refused>),
    Void(Result<Option<Transfer>, Refused>),
    /// How many holds the sweep after the expiry expired (and saw released).
    Expire(Result<usize, String>),
    Sweep(Result<(), String>),
    /// How many held-back writes the network sent.
    Net(usize),
    /// An owner or a cancel answered that the database is unavailable (503): right for
    /// the actor whose step is held back (`held`), whose run failed; for any other a
    /// violation.
    Unavailable {
        held: bool,
        error: String,
    },
    Stuck,
}

/// Why a capture or a void was refused.
#[derive(Debug)]
enum Refused {
    Conflict(HoldConflict, TransferId),
    Other(String),
}

impl From<ServiceError> for Refused {
    fn from(e: ServiceError) -> Refused {
        match e {
            ServiceError::Hold { conflict, hold } => Refused::Conflict(conflict, hold),
            other => Refused::Other(format!("{other:?}")),
        }
    }
}

/// One schedule's run.
struct Run {
    /// (options, chosen, preemptive) at each real decision (two or more actors ready).
    /// Option 0 is the actor that ran last when it is still ready (`preemptive`: any
    /// other choice preempts it), then the others by index.
    decisions: Vec<(usize, usize, bool)>,
    /// `actor@point` in the order the actors were let go from those points.
    trace: Vec<String>,
    answers: Vec<(Kind, Answer)>,
    violations: Vec<String>,
}

impl Run {
    fn choices(&self) -> String {
        let c: Vec<String> = self
            .decisions
            .iter()
            .map(|(_, c, _)| c.to_string())
            .collect();
        c.join(",")
    }
}

/// A worker: one database of its own on each of two servers (two deployments), so that
/// its sweeps see only its schedules.
struct Worker {
    uris: [String; 2],
    index: usize,
    /// The worker's database on each deployment; both banks and checks see both.
    stores: [Store; 2],
    databases: usize,
    schedules: u64,
    all_points: bool,
}

static NEXT_DB: AtomicU64 = AtomicU64::new(0);

/// A fresh database of the same name on each of the two servers.
async fn fresh_stores(uris: &[String; 2]) -> [Store; 2] {
    let n = NEXT_DB.fetch_add(1, Ordering::Relaxed);
    let name = format!("explorer_{}_{n}", std::process::id());
    let mut stores = Vec::new();
    for (deployment, uri) in DEPLOYMENTS.iter().zip(uris) {
        let deployment = DeploymentName::parse(deployment).unwrap();
        let store = Store::connect_with(deployment, uri, &name, DEFAULT_GROUP_COMMIT_WRITES)
            .await
            .expect("connect");
        store.migrate().await.expect("migrate");
        stores.push(store);
    }
    let [first, second]: [Store; 2] = match stores.try_into() {
        Ok(both) => both,
        Err(_) => unreachable!("one store per deployment"),
    };
    [first, second]
}

/// The two deployments' names: a lives on the first, b on the second in `across:`
/// scenarios.
const DEPLOYMENTS: [&str; 2] = ["one", "two"];

fn account_id(s: &str) -> AccountId {
    AccountId::parse(s).unwrap()
}

impl Worker {
    async fn new(uris: [String; 2], index: usize, all_points: bool) -> Worker {
        let stores = fresh_stores(&uris).await;
        Worker {
            uris,
            index,
            stores,
            databases: 1,
            schedules: 0,
            all_points,
        }
    }

    /// After a violation the database may hold leftovers that later sweeps would pick up.
    async fn new_database(&mut self) {
        self.stores = fresh_stores(&self.uris).await;
        self.databases += 1;
    }

    fn bank(&self, id: &str) -> TransferService {
        TransferService::new(Deployments::new(self.stores.to_vec()), id.to_owned(), LEASE)
    }

    /// Ages the transfers `filter` matches on each deployment, by its own clock.
    async fn age(&self, filter: Document) {
        for store in &self.stores {
            let now = store.server_time().await.expect("server time");
            let past = now - chrono::TimeDelta::milliseconds(2 * LEASE.as_millis() as i64);
            let past = DateTime::from_chrono(past);
            store
                .database()
                .collection::<Document>("transactions")
                .update_many(filter.clone(), doc! { "$set": { "lastModified": past } })
                .await
                .expect("age transfers");
        }
    }

    /// Every transfer touching either account, once each.
    async fn transfers_of(&self, accounts: [&str; 2]) -> Vec<Transfer> {
        let mut found: Vec<Transfer> = Vec::new();
        for account in accounts {
            let filter = TransferFilter {
                account: Some(AccountId::parse(account).unwrap()),
                ..TransferFilter::default()
            };
            for store in &self.stores {
                let listed = store.list_transfers(&filter, 10_000).await;
                for t in listed.expect("read transfers") {
                    if found.iter().all(|f| f.id != t.id) {
                        found.push(t);
                    }
                }
            }
        }
        found
    }

    async fn account(&self, id: &str) -> Account {
        let id = AccountId::parse(id).unwrap();
        for store in &self.stores {
            if let Some(account) = store.account(&id).await.unwrap() {
                return account;
            }
        }
        panic!("no account {id}")
    }

    /// Runs one schedule of `scenario` with choices from `chooser`.
    async fn run(&mut self, scenario: &Scenario, chooser: &mut Chooser) -> Run {
        self.schedules += 1;
        let tag = format!("w{}s{}", self.index, self.schedules);
        let (a, b) = (format!("{tag}-a"), format!("{tag}-b"));
        let setup = self.bank(&format!("{tag}-setup"));
        for (id, deployment) in [
            (&a, DEPLOYMENTS[0]),
            (&b, DEPLOYMENTS[scenario.across as usize]),
        ] {
            setup
                .open_account(NewAccount {
                    id: Some(account_id(id)),
                    name: None,
                    balance: OpeningBalance::parse(OPENING).unwrap(),
                    currency: Currency::usd(),
                    deployment: Some(DeploymentName::parse(deployment).unwrap()),
                })
                .await
                .expect("open account");
        }
        let new_transfer = NewTransfer {
            source: account_id(&a),
            destination: account_id(&b),
            amount: Amount::parse(AMOUNT).unwrap(),
            reference: None,
            hold: scenario.hold.then_some(HOLD_EXPIRY),
        };
        let mut run = Run {
            decisions: Vec::new(),
            trace: Vec::new(),
            answers: Vec::new(),
            violations: Vec::new(),
        };
        // In a `same:` scenario, the one process whose tasks the actors are.
        let process = scenario.same.then(|| {
            TransferService::new(
                Deployments::new(self.stores.to_vec()),
                format!("{tag}-process"),
                scenario.lease(),
            )
        });
        let bank_of = |id: &str| match &process {
            Some(process) => process.sibling(id),
            None => self.bank(id),
        };

        match scenario.prelude {
            Prelude::Nothing => {}
            Prelude::Done | Prelude::Held => {
                let owner = bank_of(&format!("{tag}-owner0"));
                let answer = owner
                    .transfer(new_transfer.clone(), None, Completion::Wait)
                    .await
                    .map(|o| o.transfer)
                    .map_err(|e| format!("{e:?}"));
                run.answers.push((Kind::Owner, Answer::Owner(answer)));
            }
            Prelude::Crash(k) => {
                let id = format!("{tag}-owner0");
                let owner = self.bank(&id);
                let (events_tx, mut events) = mpsc::unbounded_channel();
                let sched = Arc::new(Scheduler {
                    actors: HashMap::from([(id.clone(), 0)]),
                    all_points: true,
                    events: events_tx.clone(),
                    resumes: Mutex::new(vec![None]),
                });
                failpoints::install_hook(&id, sched.clone());
                let new = new_transfer.clone();
                let task = tokio::spawn(async move {
                    let r = owner.transfer(new, None, Completion::Wait).await;
                    let _ = events_tx.send(Event::Finished(0));
                    r
                });
                let mut reached = 0;
                let crashed = loop {
                    match tokio::time::timeout(STEP_LIMIT, events.recv()).await {
                        Ok(Some(Event::Released)) => {}
                        Ok(Some(Event::Parked(_, step))) => {
                            run.trace.push(format!("owner@{step}"));
                            if reached == k {
                                break true;
                            }
                            reached += 1;
                            sched.resume(0);
                        }
                        Ok(Some(Event::Finished(_))) | Ok(None) => break false,
                        Err(_) => {
                            run.violations
                                .push("the owner got stuck running alone".into());
                            break true;
                        }
                    }
                };
                task.abort();
                let _ = task.await;
                failpoints::remove_hook(&id);
                if !crashed {
                    run.violations
                        .push(format!("the owner finished before its point {k}"));
                    return run;
                }
                run.trace.push("owner crashed".into());
                // Nothing of the owner's is in flight: the lease may lapse at once.
                self.age(doc! { "source": &a }).await;
            }
        }

        // The actors.
        let (events_tx, mut events) = mpsc::unbounded_channel();
        let ids: Vec<String> = scenario
            .actors
            .iter()
            .enumerate()
            .map(|(i, k)| format!("{tag}-{}{}", k.name(), i + 1))
            .collect();
        let sched = Arc::new(Scheduler {
            actors: ids
                .iter()
                .cloned()
                .enumerate()
                .map(|(i, id)| (id, i))
                .collect(),
            all_points: self.all_points,
            events: events_tx.clone(),
            resumes: Mutex::new(scenario.actors.iter().map(|_| None).collect()),
        });
        // The held-back step: armed for the whole schedule, under its actor's own id.
        let held = scenario
            .held
            .map(|(i, step)| (ids[i].clone(), step.point()));
        if let Some((id, point)) = &held {
            failpoints::hold_back(id, point);
        }
        let mut tasks = Vec::new();
        for (i, (&kind, id)) in scenario.actors.iter().zip(&ids).enumerate() {
            failpoints::install_hook(id, sched.clone());
            let bank = bank_of(id);
            let start = sched.park(i, "start");
            let events = events_tx.clone();
            let new = new_transfer.clone();
            let (a, b) = (a.clone(), b.clone());
            let holder = held.as_ref().map(|(id, _)| id.clone());
            let is_held = scenario.held.is_some_and(|(at, _)| at == i);
            tasks.push(tokio::spawn(async move {
                start.await;
                let mut answer = act(kind, &bank, new, &a, &b, holder.as_deref()).await;
                if let Answer::Unavailable { held, .. } = &mut answer {
                    *held = is_held;
                }
                let _ = events.send(Event::Finished(i));
                answer
            }));
        }
        drop(events_tx);
        let names: Vec<String> = scenario
            .actors
            .iter()
            .enumerate()
            .map(|(i, k)| format!("{}{}", k.name(), i + 1))
            .collect();
        let mut parked: Vec<Option<&'static str>> = vec![None; scenario.actors.len()];
        // Parked at `WAIT_DRIVE` since the last release of a drive lock: not ready.
        let mut blocked = vec![false; scenario.actors.len()];
        let mut finished = vec![false; scenario.actors.len()];
        // Every actor parks at `start` first; then one runs at a time.
        let mut waiting_for = scenario.actors.len();
        let mut stuck = None;
        let mut last: Option<usize> = None;
        // Whether the held-back actor was let go from its held point, so that a write of
        // it is held back: until then the network has nothing to send, and it runs only
        // when nobody else can (where it runs makes no difference then).
        let mut something_held = false;
        loop {
            while waiting_for > 0 {
                match tokio::time::timeout(STEP_LIMIT, events.recv()).await {
                    Ok(Some(Event::Parked(i, step))) => {
                        parked[i] = Some(step);
                        blocked[i] = step == WAIT_DRIVE;
                        waiting_for -= 1;
                    }
                    Ok(Some(Event::Released)) => blocked.fill(false),
                    Ok(Some(Event::Finished(i))) => {
                        finished[i] = true;
                        waiting_for -= 1;
                    }
                    Ok(None) => break,
                    Err(_) => {
                        let running: Vec<&String> = (0..names.len())
                            .filter(|&i| parked[i].is_none() && !finished[i])
                            .map(|i| &names[i])
                            .collect();
                        stuck = Some(format!(
                            "stuck: {running:?} did not reach a point nor finish within {STEP_LIMIT:?}"
                        ));
                        break;
                    }
                }
            }
            if stuck.is_some() {
                break;
            }
            let mut ready: Vec<usize> = (0..parked.len())
                .filter(|&i| parked[i].is_some() && !blocked[i])
                .collect();
            let is_net = |i: &usize| scenario.actors[*i] == Kind::Net;
            if !something_held && !ready.iter().all(is_net) {
                ready.retain(|i| !is_net(i));
            }
            if ready.is_empty() {
                let waiting: Vec<&String> = (0..names.len())
                    .filter(|&i| blocked[i])
                    .map(|i| &names[i])
                    .collect();
                if !waiting.is_empty() {
                    stuck = Some(format!(
                        "deadlock: {waiting:?} wait for a drive lock that no actor will let go of"
                    ));
                }
                break;
            }
            // The default (choice 0) lets the actor that ran last go on.
            let preemptive = match last.and_then(|l| ready.iter().position(|&i| i == l)) {
                Some(at) => {
                    let current = ready.remove(at);
                    ready.insert(0, current);
                    true
                }
                None => false,
            };
            let pick = if ready.len() == 1 {
                0
            } else {
                let c = chooser.choose(run.decisions.len(), ready.len());
                run.decisions.push((ready.len(), c, preemptive));
                c
            };
            let actor = ready[pick];
            last = Some(actor);
            let step = parked[actor].take().unwrap();
            if scenario
                .held
                .is_some_and(|(i, h)| i == actor && h.point() == step)
            {
                something_held = true;
            }
            run.trace.push(format!("{}@{step}", names[actor]));
            sched.resume(actor);
            waiting_for = 1;
        }
        for id in &ids {
            failpoints::remove_hook(id);
        }
        if let Some(stuck) = &stuck {
            run.violations.push(stuck.clone());
            for t in &tasks {
                t.abort();
            }
        }
        for (task, &kind) in tasks.into_iter().zip(&scenario.actors) {
            let answer = task.await.unwrap_or(Answer::Stuck);
            run.answers.push((kind, answer));
        }
        // What is still held back reaches the server now, the latest a network delivers
        // it: after every actor, before the final sweep.
        if let Some((id, point)) = &held {
            failpoints::let_through(id, point);
            let sent = failpoints::send_held(id).await;
            if sent > 0 {
                run.trace
                    .push(format!("net (after the actors) sent {sent}"));
            }
        }
        if stuck.is_some() {
            return run;
        }

        // Let everything finish: a lease passes (no actor is left, so nothing is in
        // flight), then a sweep finishes what is unfinished, collects fences and finishes
        // interrupted reversals. Twice, as a sweep may leave work for the next one.
        let cleaner = self.bank(&format!("{tag}-cleaner"));
        for round in 0..2 {
            if round > 0 && self.clean(&a, &b).await {
                break;
            }
            self.age(doc! { "$or": [
                { "source": { "$in": [&a, &b] } },
                { "destination": { "$in": [&a, &b] } },
            ] })
            .await;
            if let Err(e) =
                transfer_service::sweeper::sweep_once(&cleaner, &CancellationToken::new()).await
            {
                run.violations.push(format!("final sweep failed: {e}"));
            }
        }
        self.check(scenario, &a, &b, &mut run).await;
        // A hold left `held` would expire (`HOLD_EXPIRY`) during a later schedule of this
        // worker, whose sweeps would then expire it: foreign writes in that schedule, and
        // a wrong count in its expiry's answer. Voided now, once checked.
        if scenario.hold {
            for t in self.transfers_of([&a, &b]).await {
                if t.state == TransferState::Held {
                    if let Err(e) = cleaner.void(t.id).await {
                        run.violations
                            .push(format!("voiding hold {} left held failed: {e:?}", t.id));
                    }
                }
            }
        }
        run
    }

    /// Whether nothing of the schedule is left for a sweep to do (a hold `held` waits
    /// for its client, not for a sweep).
    async fn clean(&self, a: &str, b: &str) -> bool {
        let transfers = self.transfers_of([a, b]).await;
        transfers
            .iter()
            .all(|t| t.state.is_settled() && !t.fenced && !t.reversing)
    }

    async fn check(&self, scenario: &Scenario, a: &str, b: &str, run: &mut Run) {
        let v = &mut run.violations;
        let accounts = [self.account(a).await, self.account(b).await];
        let transfers = self.transfers_of([a, b]).await;
        let total: i64 = accounts.iter().map(|x| x.balance).sum();
        if total != 2 * OPENING {
            v.push(format!("total {total} != {}", 2 * OPENING));
        }
        for acc in &accounts {
            // A done hold moved its `amount`: the captured one.
            let mut expected = OPENING;
            for t in transfers.iter().filter(|t| t.state == TransferState::Done) {
                if t.source == acc.id {
                    expected -= t.amount.minor_units();
                }
                if t.destination == acc.id {
                    expected += t.amount.minor_units();
                }
            }
            if acc.balance != expected {
                v.push(format!(
                    "{}: balance {} != opening + done transfers {expected}",
                    acc.id, acc.balance
                ));
            }
            if scenario.hold {
                check_reservations(acc, &transfers, v);
            } else if !acc.pending_transactions.is_empty() {
                v.push(format!(
                    "{}: pendingTransactions left {:?}",
                    acc.id, acc.pending_transactions
                ));
            }
            if !acc.fenced_transactions.is_empty() {
                v.push(format!(
                    "{}: fencedTransactions left {:?}",
                    acc.id, acc.fenced_transactions
                ));
            }
        }
        let by_id: HashMap<TransferId, &Transfer> = transfers.iter().map(|t| (t.id, t)).collect();
        for t in &transfers {
            // A hold may stay `held`, waiting for its client: nobody won it.
            let waiting = t.hold.is_some() && t.state == TransferState::Held;
            if !t.state.is_terminal() && !waiting {
                v.push(format!("transfer {} left {}", t.id, t.state));
            }
            if t.fenced {
                v.push(format!("transfer {} left fenced", t.id));
            }
            if t.reversing {
                v.push(format!("transfer {} left reversing", t.id));
            }
            if t.reverses.is_some() {
                continue;
            }
            let reversals: Vec<&Transfer> = transfers
                .iter()
                .filter(|r| r.reverses == Some(t.id) && r.state == TransferState::Done)
                .collect();
            if reversals.len() > 1 {
                v.push(format!(
                    "transfer {} reversed {} times",
                    t.id,
                    reversals.len()
                ));
            }
            if let Some(r) = reversals.first() {
                if t.state != TransferState::Done || t.reversed_by != Some(r.id) {
                    v.push(format!(
                        "reversal {} done but original {} is {} with reversedBy {:?}",
                        r.id, t.id, t.state, t.reversed_by
                    ));
                }
                if r.source != t.destination || r.destination != t.source || r.amount != t.amount {
                    v.push(format!("reversal {} does not mirror {}", r.id, t.id));
                }
            }
        }
        if scenario.hold {
            check_winner(scenario, &transfers, v);
        }
        let state_of = |id: TransferId| by_id.get(&id).map(|t| t.state);
        for (kind, answer) in &run.answers {
            match answer {
                Answer::Owner(Ok(t)) => {
                    let now = state_of(t.id);
                    if t.state.is_terminal() && now != Some(t.state) {
                        v.push(format!(
                            "{} answered {} but it is {now:?}",
                            kind.name(),
                            t.state
                        ));
                    }
                }
                Answer::Owner(Err(e)) => v.push(format!("{} failed: {e}", kind.name())),
                Answer::Cancel(Ok(None)) => {} // nothing recorded yet to cancel
                Answer::Cancel(Ok(Some(t))) => match t.state {
                    TransferState::Canceled => {
                        if state_of(t.id) != Some(TransferState::Canceled) {
                            v.push(format!(
                                "cancel answered canceled but it is {:?}",
                                state_of(t.id)
                            ));
                        }
                    }
                    TransferState::Done => match t.reversed_by {
                        Some(r) => {
                            if state_of(r) != Some(TransferState::Done) {
                                v.push(format!(
                                    "cancel answered done reversed by {r}, which is {:?}",
                                    state_of(r)
                                ));
                            }
                            if by_id.get(&t.id).and_then(|o| o.reversed_by) != Some(r) {
                                v.push(format!(
                                    "cancel answered reversed by {r}, the original says {:?}",
                                    by_id.get(&t.id).and_then(|o| o.reversed_by)
                                ));
                            }
                        }
                        None => v.push("cancel answered done without reversedBy".into()),
                    },
                    other => v.push(format!("cancel answered {other}")),
                },
                Answer::Cancel(Err(e)) => v.push(format!("cancel failed: {e}")),
                Answer::Capture(answer) | Answer::Void(answer) => {
                    check_hold_answer(*kind, answer, &by_id, v);
                }
                Answer::Expire(Ok(expired)) => {
                    let hold = transfers.iter().find(|t| t.hold.is_some());
                    let ended = hold.map(|h| (h.state, h.reason));
                    let expected = (TransferState::Canceled, Some(CancelReason::Expired));
                    if *expired > 0 && ended != Some(expected) {
                        v.push(format!(
                            "{} expired {expired} holds but the hold ended {ended:?}",
                            kind.name()
                        ));
                    }
                }
                Answer::Expire(Err(e)) => v.push(format!("{} failed: {e}", kind.name())),
                Answer::Sweep(Ok(())) => {}
                Answer::Sweep(Err(e)) => v.push(format!("{} failed: {e}", kind.name())),
                Answer::Net(_) => {}
                // Its run failed: the transfer is left for a later run, whose end the
                // checks above judge.
                Answer::Unavailable { held: true, .. } => {}
                Answer::Unavailable { held: false, error } => {
                    v.push(format!("{} answered unavailable: {error}", kind.name()));
                }
                Answer::Stuck => v.push(format!("{} never answered", kind.name())),
            }
        }
    }
}

/// A hold scenario's account: its reservations and markers are exactly those of the
/// holds still `held` (every other transfer has settled), and its available balance is
/// not negative.
fn check_reservations(acc: &Account, transfers: &[Transfer], v: &mut Vec<String>) {
    let held: Vec<&Transfer> = transfers
        .iter()
        .filter(|t| t.state == TransferState::Held)
        .collect();
    let sum = |side: fn(&Transfer) -> &AccountId| -> i64 {
        held.iter()
            .filter(|t| side(t) == &acc.id)
            .filter_map(|t| t.hold.map(|h| h.amount.minor_units()))
            .sum()
    };
    let debits = sum(|t| &t.source);
    let credits = sum(|t| &t.destination);
    if acc.pending_debits != debits {
        v.push(format!(
            "{}: pendingDebits {} != held holds out of it {debits}",
            acc.id, acc.pending_debits
        ));
    }
    if acc.pending_credits != credits {
        v.push(format!(
            "{}: pendingCredits {} != held holds into it {credits}",
            acc.id, acc.pending_credits
        ));
    }
    if acc.available_balance() < 0 {
        v.push(format!(
            "{}: available balance {} (balance {}, pendingDebits {})",
            acc.id,
            acc.available_balance(),
            acc.balance,
            acc.pending_debits
        ));
    }
    let mut markers = acc.pending_transactions.clone();
    markers.sort();
    let mut expected: Vec<TransferId> = held
        .iter()
        .filter(|t| t.source == acc.id || t.destination == acc.id)
        .map(|t| t.id)
        .collect();
    expected.sort();
    if markers != expected {
        v.push(format!(
            "{}: pendingTransactions {markers:?} != the held holds touching it {expected:?}",
            acc.id
        ));
    }
}

/// A hold scenario has at most one hold, and who won it (what it ended as) is one of the
/// scenario's actors that may: a capture for `done`, an expiry for `expired`, a void or a
/// cancel for `voided` and `canceled_by_request`; only a cancel reverses a captured hold.
fn check_winner(scenario: &Scenario, transfers: &[Transfer], v: &mut Vec<String>) {
    let holds: Vec<&Transfer> = transfers.iter().filter(|t| t.hold.is_some()).collect();
    if holds.len() > 1 {
        v.push(format!("{} holds recorded, not one", holds.len()));
    }
    let Some(h) = holds.first() else { return };
    let has = |kinds: &[Kind]| scenario.actors.iter().any(|k| kinds.contains(k));
    let held = h.hold.map(|x| x.amount);
    if let Some(r) = h.reversed_by {
        if !has(&[Kind::Cancel]) {
            v.push(format!(
                "hold {} captured and then reversed by {r}, but {scenario} has no cancel",
                h.id
            ));
        }
    }
    let may = match (h.state, h.reason) {
        (TransferState::Done, _) => {
            if Some(h.amount) != held {
                v.push(format!(
                    "hold {} captured {} of {held:?}, not all of it",
                    h.id,
                    h.amount.minor_units()
                ));
            }
            has(&[Kind::Capture])
        }
        (TransferState::Canceled, Some(CancelReason::Expired)) => has(&[Kind::Expire]),
        (TransferState::Canceled, Some(CancelReason::Voided | CancelReason::CanceledByRequest)) => {
            has(&[Kind::Void, Kind::Cancel])
        }
        (TransferState::Canceled, reason) => {
            v.push(format!("hold {} canceled for {reason:?}", h.id));
            true
        }
        _ => true, // still held (nobody won), or left unfinished (said above)
    };
    if !may {
        v.push(format!(
            "hold {} ended {} ({:?}) but no actor of {scenario} may have made that",
            h.id, h.state, h.reason
        ));
    }
}

/// A capture's or a void's answer agrees with how the hold ended: a capture answered with
/// the hold means `done` with that amount, a void answered with it means `canceled`; a
/// conflict names what won (`AlreadyCaptured`: `done`, reversed or not; `Voided`:
/// `canceled` voided or by request; `Expired`: `canceled` expired; `Pending`: nothing
/// was done).
fn check_hold_answer(
    kind: Kind,
    answer: &Result<Option<Transfer>, Refused>,
    by_id: &HashMap<TransferId, &Transfer>,
    v: &mut Vec<String>,
) {
    let name = kind.name();
    let ended = |id: &TransferId| by_id.get(id).map(|t| (t.state, t.reason, t.amount));
    match answer {
        Ok(None) => {} // nothing recorded yet
        Ok(Some(t)) => {
            let Some((state, reason, amount)) = ended(&t.id) else {
                v.push(format!("{name} answered {}, which is not recorded", t.id));
                return;
            };
            let agrees = match kind {
                Kind::Capture => {
                    state == TransferState::Done
                        && amount == t.amount
                        && matches!(t.state, TransferState::Capturing | TransferState::Done)
                }
                _ => {
                    state == TransferState::Canceled
                        && matches!(t.state, TransferState::Canceling | TransferState::Canceled)
                        && (t.state != TransferState::Canceled || t.reason == reason)
                }
            };
            if !agrees {
                let reversed = |r: Option<TransferId>| {
                    r.map(|r| format!(", reversed by {r}")).unwrap_or_default()
                };
                let now = by_id.get(&t.id).and_then(|h| h.reversed_by);
                v.push(format!(
                    "{name} answered {} {} ({:?}, amount {}{}) but the hold ended {state} ({reason:?}, amount {}{})",
                    t.id,
                    t.state,
                    t.reason,
                    t.amount.minor_units(),
                    reversed(t.reversed_by),
                    amount.minor_units(),
                    reversed(now),
                ));
            }
        }
        Err(Refused::Conflict(conflict, id)) => {
            let Some((state, reason, _)) = ended(id) else {
                v.push(format!(
                    "{name} answered {conflict:?} for {id}, not recorded"
                ));
                return;
            };
            let canceled = |reasons: &[CancelReason]| {
                state == TransferState::Canceled && reason.is_some_and(|r| reasons.contains(&r))
            };
            let agrees = match conflict {
                HoldConflict::AlreadyCaptured => state == TransferState::Done,
                HoldConflict::Voided => {
                    canceled(&[CancelReason::Voided, CancelReason::CanceledByRequest])
                }
                HoldConflict::Expired => canceled(&[CancelReason::Expired]),
                HoldConflict::Pending => true,
                HoldConflict::NotAHold => false,
            };
            if !agrees {
                v.push(format!(
                    "{name} answered {conflict:?} but the hold ended {state} ({reason:?})"
                ));
            }
        }
        Err(Refused::Other(e)) => v.push(format!("{name} failed: {e}")),
    }
}

/// The scenario's transfer from a to b, if recorded yet (the oldest: a reversal goes the
/// other way, and only the owner makes a transfer from a to b).
async fn scenario_transfer(
    bank: &TransferService,
    a: &str,
    b: &str,
) -> Result<Option<Transfer>, String> {
    let filter = TransferFilter {
        account: Some(AccountId::parse(a).unwrap()),
        ..TransferFilter::default()
    };
    // Newest first: the last is the oldest.
    bank.store()
        .list_transfers(&filter, 10_000)
        .await
        .map(|all| {
            all.into_iter()
                .rfind(|t| t.source.as_str() == a && t.destination.as_str() == b)
        })
        .map_err(|e| format!("{e:?}"))
}

/// Waits until the lease of every unfinished transfer touching a or b has lapsed by the
/// clock of its log (each deployment logs those out of its accounts): time passing.
async fn lease_lapsed(bank: &TransferService, a: &str, b: &str) -> Result<(), String> {
    let lease = chrono::TimeDelta::from_std(bank.stale_after()).expect("a lease in range");
    loop {
        let mut left = Duration::ZERO;
        for log in bank.deployments().all() {
            let now = log.server_time().await.map_err(|e| format!("{e:?}"))?;
            for account in [a, b] {
                let filter = TransferFilter {
                    account: Some(AccountId::parse(account).unwrap()),
                    ..TransferFilter::default()
                };
                let listed = log.list_transfers(&filter, 10_000).await;
                for t in listed.map_err(|e| format!("{e:?}"))? {
                    let ends = t.last_modified + lease;
                    if !t.state.is_settled() && ends >= now {
                        let until = (ends - now).to_std().unwrap_or_default();
                        left = left.max(until + Duration::from_millis(1));
                    }
                }
            }
        }
        if left.is_zero() {
            return Ok(());
        }
        tokio::time::sleep(left).await;
    }
}

/// What one actor does. `holder`: the actor whose held-back writes the network sends.
async fn act(
    kind: Kind,
    bank: &TransferService,
    new: NewTransfer,
    a: &str,
    b: &str,
    holder: Option<&str>,
) -> Answer {
    let never = CancellationToken::new();
    let sweep = || transfer_service::sweeper::sweep_once(bank, &never);
    // 503: whether that is right depends on the actor (see `Answer::Unavailable`).
    let unavailable = |e: &ServiceError| {
        matches!(e, ServiceError::Unavailable(_)).then(|| Answer::Unavailable {
            held: false,
            error: e.to_string(),
        })
    };
    match kind {
        Kind::Owner => match bank.transfer(new, None, Completion::Wait).await {
            Ok(o) => Answer::Owner(Ok(o.transfer)),
            Err(e) => unavailable(&e).unwrap_or(Answer::Owner(Err(format!("{e:?}")))),
        },
        Kind::Recoverer | Kind::Sweeper => {
            Answer::Sweep(sweep().await.map(|_| ()).map_err(|e| format!("{e:?}")))
        }
        Kind::Cancel => match scenario_transfer(bank, a, b).await {
            Err(e) => Answer::Cancel(Err(e)),
            Ok(None) => Answer::Cancel(Ok(None)),
            Ok(Some(t)) => match bank.cancel(t.id).await {
                Ok(t) => Answer::Cancel(Ok(Some(t))),
                Err(e) => unavailable(&e).unwrap_or(Answer::Cancel(Err(format!("{e:?}")))),
            },
        },
        Kind::Lapse => {
            let lapse = async {
                lease_lapsed(bank, a, b).await?;
                sweep().await.map_err(|e| format!("{e:?}"))
            };
            Answer::Sweep(lapse.await.map(|_| ()))
        }
        Kind::Net => match holder {
            Some(holder) => Answer::Net(failpoints::send_held(holder).await),
            None => Answer::Net(0),
        },
        Kind::Capture | Kind::Void => {
            let answer = match scenario_transfer(bank, a, b).await {
                Err(e) => Err(Refused::Other(e)),
                Ok(None) => Ok(None),
                Ok(Some(t)) if kind == Kind::Capture => bank
                    .capture(t.id, None)
                    .await
                    .map(Some)
                    .map_err(Refused::from),
                Ok(Some(t)) => bank.void(t.id).await.map(Some).map_err(Refused::from),
            };
            match kind {
                Kind::Capture => Answer::Capture(answer),
                _ => Answer::Void(answer),
            }
        }
        Kind::Expire => {
            // The clock reaches `expiresAt`: safe at any moment, as time passing is.
            let expire = async {
                let store = bank.store();
                let now = store.server_time().await.map_err(|e| format!("{e:?}"))?;
                let past = DateTime::from_chrono(now - chrono::TimeDelta::seconds(1));
                store
                    .database()
                    .collection::<Document>("transactions")
                    .update_many(
                        doc! { "source": a, "destination": b, "expiresAt": { "$exists": true } },
                        doc! { "$set": { "expiresAt": past } },
                    )
                    .await
                    .map_err(|e| format!("{e:?}"))?;
                sweep()
                    .await
                    .map(|r| r.holds_expired)
                    .map_err(|e| format!("{e:?}"))
            };
            Answer::Expire(expire.await)
        }
    }
}

// ---------------------------------------------------------------------------------------
// Exploration

enum Job {
    /// Every ordering of the scenario, depth-first.
    Exhaustive(Scenario),
    /// One random schedule.
    Random(u64),
    /// One given schedule.
    Replay(Scenario, Vec<usize>),
}

#[derive(Default)]
struct Report {
    exhaustive: u64,
    random: u64,
    /// Schedules run per exhaustive scenario.
    per_scenario: Vec<(String, u64, bool)>,
    violations: Vec<String>,
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// How many points the owner passes running alone (every point, not only writes): the
/// crash points of a transfer and of a hold.
#[derive(Clone, Copy)]
struct CrashPoints {
    transfer: usize,
    hold: usize,
}

/// The crash points of each layout: across two deployments an owner passes more (the
/// pulls are one write per deployment).
#[derive(Clone, Copy)]
struct LayoutPoints {
    within: CrashPoints,
    across: CrashPoints,
}

/// The scenario of random seed `seed`: half of them (by a stream of their own, so that
/// the transfer scenario of a seed is the one it always was) hold scenarios (see
/// [`random_hold_scenario`]), the others: owner or a recoverer after a crash at a random
/// point, a cancel, and a second cancel or a sweeper.
fn random_scenario(seed: u64, points: LayoutPoints) -> Scenario {
    // Half of them with b on the second deployment, by a stream of their own.
    let mut a = seed ^ 0x0ACE_5D15_7A1C_E000;
    if splitmix(&mut a) % 2 == 1 {
        random_scenario_within(seed, points.across).across()
    } else {
        random_scenario_within(seed, points.within)
    }
}

fn random_scenario_within(seed: u64, points: CrashPoints) -> Scenario {
    // A quarter of them `same:` scenarios, by a stream of their own.
    let mut same = seed ^ 0x5A3E_0000_0DD5_EED5;
    if splitmix(&mut same) % 4 == 0 {
        return random_same_scenario(&mut same);
    }
    let mut h = seed ^ 0x401D_5EED_0BAD_CAFE;
    if splitmix(&mut h) % 2 == 1 {
        return random_hold_scenario(&mut h, points.hold);
    }
    let crash_points = points.transfer;
    let mut s = seed ^ 0xA5A5_5A5A_1234_5678;
    let first = splitmix(&mut s);
    let prelude = if first % 2 == 0 {
        Prelude::Nothing
    } else {
        Prelude::Crash((splitmix(&mut s) % crash_points as u64) as usize)
    };
    let head = if prelude == Prelude::Nothing {
        Kind::Owner
    } else {
        Kind::Recoverer
    };
    let third = if splitmix(&mut s) % 2 == 0 {
        Kind::Cancel
    } else {
        Kind::Sweeper
    };
    Scenario::new(prelude, &[head, Kind::Cancel, third])
}

/// A random `same:` scenario: two tasks of one process and the network. The first, whose
/// debit, credit or state change is held back, is a cancel of a done transfer or the
/// owner of a new one; the second a cancel or the process's sweeper once the lease lapsed.
fn random_same_scenario(s: &mut u64) -> Scenario {
    use Kind::*;
    const HELD: [Held; 3] = [Held::Debit, Held::Credit, Held::Transition];
    let (prelude, first) = if splitmix(s) % 2 == 0 {
        (Prelude::Done, Cancel)
    } else {
        (Prelude::Nothing, Owner)
    };
    let second = if splitmix(s) % 2 == 0 { Cancel } else { Lapse };
    let held = HELD[(splitmix(s) % HELD.len() as u64) as usize];
    Scenario::same(prelude, &[first, second, Net], held)
}

/// A random hold scenario: after the hold is `held`, three actors drawn from capture,
/// void, expire, cancel and sweeper (half of them); else the owner creating the hold, or
/// a recoverer after the owner crashed at a random point of it, and two such actors.
fn random_hold_scenario(s: &mut u64, crash_points: usize) -> Scenario {
    use Kind::*;
    const DRAWN: [Kind; 5] = [Capture, Void, Expire, Cancel, Sweeper];
    let shape = splitmix(s) % 4;
    let prelude = match shape {
        0 | 1 => Prelude::Held,
        2 => Prelude::Nothing,
        _ => Prelude::Crash((splitmix(s) % crash_points as u64) as usize),
    };
    let mut actors = match prelude {
        Prelude::Held => vec![],
        Prelude::Nothing => vec![Owner],
        _ => vec![Recoverer],
    };
    while actors.len() < 3 {
        actors.push(DRAWN[(splitmix(s) % DRAWN.len() as u64) as usize]);
    }
    Scenario::hold(prelude, &actors)
}

/// Every exhaustive scenario, in both layouts: within one deployment, and with b on the
/// second.
fn exhaustive_scenarios(crash_points: LayoutPoints) -> Vec<Scenario> {
    use Kind::*;
    let mut all = Vec::new();
    for (across, points) in [(false, crash_points.within), (true, crash_points.across)] {
        let mut add = |scenario: Scenario| {
            all.push(if across { scenario.across() } else { scenario });
        };
        add(Scenario::new(Prelude::Nothing, &[Owner, Cancel]));
        for k in 0..points.transfer {
            add(Scenario::new(Prelude::Crash(k), &[Recoverer, Cancel]));
        }
        add(Scenario::new(Prelude::Done, &[Cancel, Cancel]));
        // Holds: every pair of those that settle a held hold, two of a kind included.
        let settlers = [Capture, Void, Expire, Cancel];
        for (i, &first) in settlers.iter().enumerate() {
            for &second in &settlers[i..] {
                add(Scenario::hold(Prelude::Held, &[first, second]));
            }
        }
        for settler in settlers {
            add(Scenario::hold(Prelude::Nothing, &[Owner, settler]));
        }
        for k in 0..points.hold {
            add(Scenario::hold(Prelude::Crash(k), &[Recoverer, Cancel]));
        }
        // Two tasks of one process, the first one's step held back so that its run
        // fails, and the network sending the held-back copies when the schedule says: a
        // second cancel driving the reversal whose debit or credit the first cancel could
        // not get an answer for; a cancel, or the process's own sweeper once the lease
        // lapsed, after the owner's credit.
        for held in [Held::Credit, Held::Debit] {
            add(Scenario::same(Prelude::Done, &[Cancel, Cancel, Net], held));
        }
        for second in [Cancel, Lapse] {
            add(Scenario::same(
                Prelude::Nothing,
                &[Owner, second, Net],
                Held::Credit,
            ));
        }
    }
    all
}

fn describe(scenario: &Scenario, run: &Run, seed: Option<u64>) -> String {
    let seed = seed
        .map(|s| format!("EXPLORE_SEED={s} "))
        .unwrap_or_default();
    format!(
        "{seed}EXPLORE_REPLAY='{scenario}/{}'\n    trace: {}\n    answers: {:?}\n    violations:\n      - {}",
        run.choices(),
        run.trace.join(" -> "),
        run.answers
            .iter()
            .map(|(k, a)| format!("{}: {}", k.name(), short(a)))
            .collect::<Vec<_>>(),
        run.violations.join("\n      - ")
    )
}

fn short(a: &Answer) -> String {
    let t = |t: &Transfer| {
        format!(
            "{} {}{}",
            t.id,
            t.state,
            t.reversed_by
                .map(|r| format!(" reversedBy {r}"))
                .unwrap_or_default()
        )
    };
    let t = |x: &Transfer| match (x.state, x.reason) {
        (TransferState::Canceled, Some(reason)) => format!("{} ({reason})", t(x)),
        (TransferState::Done, _) if x.hold.is_some() => {
            format!("{} (captured {})", t(x), x.amount.minor_units())
        }
        _ => t(x),
    };
    match a {
        Answer::Owner(Ok(x)) | Answer::Cancel(Ok(Some(x))) => t(x),
        Answer::Capture(Ok(Some(x))) | Answer::Void(Ok(Some(x))) => t(x),
        Answer::Cancel(Ok(None)) | Answer::Capture(Ok(None)) | Answer::Void(Ok(None)) => {
            "nothing recorded yet".into()
        }
        Answer::Capture(Err(Refused::Conflict(c, _)))
        | Answer::Void(Err(Refused::Conflict(c, _))) => {
            format!("{c:?}")
        }
        Answer::Owner(Err(e))
        | Answer::Cancel(Err(e))
        | Answer::Sweep(Err(e))
        | Answer::Expire(Err(e))
        | Answer::Capture(Err(Refused::Other(e)))
        | Answer::Void(Err(Refused::Other(e))) => e.clone(),
        Answer::Expire(Ok(n)) => format!("ok, expired {n}"),
        Answer::Sweep(Ok(())) => "ok".into(),
        Answer::Net(n) => format!("sent {n} held back"),
        Answer::Unavailable { error, .. } => format!("unavailable: {error}"),
        Answer::Stuck => "stuck".into(),
    }
}

async fn work(
    mut worker: Worker,
    jobs: Arc<Mutex<VecDeque<Job>>>,
    report: Arc<Mutex<Report>>,
    crash_points: LayoutPoints,
    dfs_limit: u64,
    preemption_bound: usize,
    verbose: bool,
) {
    loop {
        let Some(job) = jobs.lock().unwrap().pop_front() else {
            return;
        };
        match job {
            Job::Exhaustive(scenario) => {
                let mut prefix: Vec<usize> = Vec::new();
                let mut count = 0u64;
                let complete = loop {
                    let run = worker
                        .run(&scenario, &mut Chooser::Fixed(prefix.clone()))
                        .await;
                    count += 1;
                    if !run.violations.is_empty() {
                        report
                            .lock()
                            .unwrap()
                            .violations
                            .push(describe(&scenario, &run, None));
                        worker.new_database().await;
                    }
                    // The next schedule: the last decision with an untried option, moved on.
                    // Within the preemption bound.
                    let mut d = run.decisions;
                    let preempting = |d: &[(usize, usize, bool)]| {
                        d.iter().filter(|&&(_, c, p)| p && c > 0).count()
                    };
                    while let Some(&(options, chosen, preemptive)) = d.last() {
                        let before = preempting(&d[..d.len() - 1]);
                        if chosen + 1 < options
                            && before + usize::from(preemptive) <= preemption_bound
                        {
                            break;
                        }
                        d.pop();
                    }
                    let Some(last) = d.last_mut() else {
                        break true;
                    };
                    last.1 += 1;
                    prefix = d.iter().map(|&(_, c, _)| c).collect();
                    if dfs_limit > 0 && count >= dfs_limit {
                        break false;
                    }
                };
                let mut r = report.lock().unwrap();
                r.exhaustive += count;
                r.per_scenario.push((scenario.to_string(), count, complete));
            }
            Job::Random(seed) => {
                let scenario = random_scenario(seed, crash_points);
                let run = worker.run(&scenario, &mut Chooser::Random(seed)).await;
                if verbose {
                    println!("{}", describe(&scenario, &run, Some(seed)));
                }
                let failed = !run.violations.is_empty();
                {
                    let mut r = report.lock().unwrap();
                    r.random += 1;
                    if failed {
                        r.violations.push(describe(&scenario, &run, Some(seed)));
                    }
                }
                if failed {
                    worker.new_database().await;
                }
            }
            Job::Replay(scenario, choices) => {
                let run = worker.run(&scenario, &mut Chooser::Fixed(choices)).await;
                println!("{}", describe(&scenario, &run, None));
                let mut r = report.lock().unwrap();
                if !run.violations.is_empty() {
                    r.violations.push(describe(&scenario, &run, None));
                }
            }
        }
    }
}

/// A scenario's name is what `EXPLORE_REPLAY` takes: every scenario the explorer runs
/// reads back as itself.
#[test]
fn every_scenario_reads_back_from_its_name() {
    let points = CrashPoints {
        transfer: 14,
        hold: 10,
    };
    let points = LayoutPoints {
        within: points,
        across: points,
    };
    let random = (1..2_000).map(|seed| random_scenario(seed, points));
    let all: Vec<Scenario> = exhaustive_scenarios(points)
        .into_iter()
        .chain(random)
        .collect();
    assert!(all.iter().any(|s| s.same && s.held.is_some()));
    for scenario in all {
        let name = scenario.to_string();
        assert_eq!(Scenario::parse(&name), scenario, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explore_interleavings() {
    let started = Instant::now();
    let uris: [String; 2] = support::database_uris(2).try_into().unwrap();
    let all_points = std::env::var("EXPLORE_POINTS").is_ok_and(|p| p == "all");
    let workers = env_usize("EXPLORE_WORKERS", 6).max(1);
    let random = env_usize("EXPLORE_SCHEDULES", 300) as u64;
    let dfs_limit = env_usize("EXPLORE_DFS_LIMIT", 0) as u64;
    // Preemptions per exhaustive schedule, at most (CHESS-style); `EXPLORE_PREEMPTIONS=all`
    // (or any large number) enumerates every ordering.
    let preemption_bound = match std::env::var("EXPLORE_PREEMPTIONS").as_deref() {
        Ok("all") => usize::MAX,
        _ => env_usize("EXPLORE_PREEMPTIONS", 1),
    };

    // The points the owner passes running alone: the crash points, of a transfer and of
    // a hold.
    let mut probe = Worker::new(uris.clone(), 0, all_points).await;
    let mut points = Vec::new();
    for across in [false, true] {
        for hold in [false, true] {
            let scenario = Scenario {
                hold,
                across,
                ..Scenario::new(Prelude::Crash(usize::MAX), &[Kind::Cancel])
            };
            let solo = probe.run(&scenario, &mut Chooser::Fixed(vec![])).await;
            let n = solo.trace.len();
            assert!(n > 5, "owner points: {:?}", solo.trace);
            let what = if hold { "hold" } else { "transfer" };
            let layout = if across {
                "across deployments"
            } else {
                "within one"
            };
            println!(
                "owner's points of a {what}, {layout} ({n}): {}",
                solo.trace.join(" ")
            );
            points.push(n);
        }
    }
    let crash_points = LayoutPoints {
        within: CrashPoints {
            transfer: points[0],
            hold: points[1],
        },
        across: CrashPoints {
            transfer: points[2],
            hold: points[3],
        },
    };

    let mut jobs = VecDeque::new();
    let mut verbose = false;
    if let Ok(replay) = std::env::var("EXPLORE_REPLAY") {
        let (scenario, choices) = replay.split_once('/').unwrap_or((&replay, ""));
        let choices = choices
            .split(',')
            .filter(|c| !c.is_empty())
            .map(|c| c.parse().expect("choice"))
            .collect();
        jobs.push_back(Job::Replay(Scenario::parse(scenario), choices));
    } else if let Ok(seed) = std::env::var("EXPLORE_SEED") {
        jobs.push_back(Job::Random(seed.parse().expect("EXPLORE_SEED")));
        verbose = true;
    } else {
        let filter = std::env::var("EXPLORE_FILTER").unwrap_or_default();
        let wanted = |scenario: &Scenario| scenario.to_string().contains(&filter);
        for scenario in exhaustive_scenarios(crash_points) {
            if wanted(&scenario) {
                jobs.push_back(Job::Exhaustive(scenario));
            }
        }
        let base = env_usize("EXPLORE_SEED_BASE", 1) as u64;
        for seed in base..base + random {
            if wanted(&random_scenario(seed, crash_points)) {
                jobs.push_back(Job::Random(seed));
            }
        }
    }
    let jobs = Arc::new(Mutex::new(jobs));
    let report = Arc::new(Mutex::new(Report::default()));
    let mut handles = vec![tokio::spawn(work(
        probe,
        jobs.clone(),
        report.clone(),
        crash_points,
        dfs_limit,
        preemption_bound,
        verbose,
    ))];
    for i in 1..workers {
        let worker = Worker::new(uris.clone(), i, all_points).await;
        handles.push(tokio::spawn(work(
            worker,
            jobs.clone(),
            report.clone(),
            crash_points,
            dfs_limit,
            preemption_bound,
            verbose,
        )));
    }
    for h in handles {
        h.await.expect("worker");
    }
    let report = Arc::try_unwrap(report).ok().unwrap().into_inner().unwrap();
    let mut per = report.per_scenario;
    per.sort();
    for (scenario, count, complete) in &per {
        let note = if *complete { "" } else { " (truncated)" };
        println!("  exhaustive {scenario}: {count} schedules{note}");
    }
    println!(
        "explored {} exhaustive (preemption bound {}) + {} random schedules ({} points) in {:.1?}; {} violations",
        report.exhaustive,
        if preemption_bound == usize::MAX {
            "none".to_string()
        } else {
            preemption_bound.to_string()
        },
        report.random,
        if all_points { "all" } else { "write" },
        started.elapsed(),
        report.violations.len()
    );
    for v in &report.violations {
        println!("VIOLATION {v}");
    }
    assert!(
        report.violations.is_empty(),
        "{} schedules violated an invariant (see above)",
        report.violations.len()
    );
}
