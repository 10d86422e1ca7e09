//! The nemesis: the order of things, and what goes wrong between them.
//!
//! - The scheduler: installed with `failpoints::install_hook`, it parks every actor at
//!   its points (right before each write is sent, `before_*`; with `EXPLORE_POINTS=all`
//!   after each protocol step too) and lets exactly one of them run at a time, choosing
//!   which one from a schedule (a vector of choices, [`Chooser`]). Once the choices run
//!   out, the remaining actors run in a fixed order (lowest actor first) to completion. A
//!   write held at a `before_*` point is a write that reaches the server late. A run that
//!   finds its transfer driven by a sibling (`same:` scenarios) parks at `wait_drive` and
//!   is not ready (blocked) until an actor lets go of a drive lock (`after_drive`, told to
//!   the scheduler, never parked at); if only blocked actors are left, the schedule is a
//!   deadlock. Under the scheduler a sweep does one thing at a time (deployments one after
//!   the other, each run before the next claim), so that no part of an actor runs unseen.
//! - Parts of one actor at once: a multi-leg transfer's steps of every party (prepares,
//!   settles, undos, a cancel's fences) are sent together (a `join_all`), each party's
//!   write a part of its actor parked at its own point. The parts that reach their points
//!   in one poll of the task running them are one stop: the actor is at rest once that
//!   poll has ended (each parked part tells it, [`Event::PollEnded`]), and letting it go
//!   lets every part of the stop go at once (the store gathers their writes, one per
//!   deployment, as it would unscheduled), shown `owner1@before_debit+before_credit`. A
//!   part whose point comes after a read of another deployment's clock
//!   (`Store::deadline_on`: a party on the other deployment in an `across:legs:` scenario)
//!   reaches it in a later poll: there the actor is at rest only once nothing more of it
//!   came for [`QUIET`]. A part that reaches its point while its actor is at rest joins
//!   its next stop, and is counted (`Run::late_parts`): its write may then go with or
//!   after those its stop let go, a less exact schedule, never a wrong one (each is an
//!   interleaving that can happen).
//! - A stop split (`split:` scenarios): the store gathers writes into batches per
//!   deployment, so two parties' writes of one step may go in different batches with
//!   another actor's write between them (and parties on different deployments are wholly
//!   independent). So when the actor chosen has a stop of several parts and another actor
//!   is ready, a decision of its own ([`DecisionKind::Split`]) lets all of them go (0, the
//!   default) or only the k-th (in the order they parked); the others stay parked as the
//!   actor's stop, a later choice like any other (and may be split again). Shown with the
//!   part let go in brackets, `owner1@before_debit+[before_credit]+before_credit`, then
//!   `owner1@before_debit+before_credit` when the rest goes. A split preempts its actor
//!   in the middle of a step: it spends one of the schedule's preemptions (the bound of
//!   the exhaustive enumeration counts it as one), and the choice after it is free (no
//!   actor ran last). That keeps the enumeration bounded: with the default bound of one, a
//!   schedule has one preemption or one split followed by a switch to any actor, not
//!   both. A random schedule splits one such stop in [`SPLIT_ODDS`]. After a split, the
//!   part let go sends its write and reads its answer with nothing to tell (no point
//!   comes before the rest of its step), so the actor is at rest once the parts left
//!   parked, which the `join_all` polls at every poll of their task and which tell each
//!   poll ([`Event::Polled`]), stay unpolled for [`SPLIT_QUIET`] after two polls per part
//!   (the write sent, its answer read), [`SPLIT_SLOW`] after fewer; a poll after that is
//!   counted (`Run::late_splits`) and waited for: as for late parts, a less exact
//!   schedule, never a wrong one.
//! - A crash ([`crash_owner`]): in a `crash<k>:` prelude the owner runs alone until its
//!   k-th point and crashes there; its transfer is aged past its lease.
//! - A write held back in the network ([`Held`]): one actor may have a step held back for
//!   the whole schedule (shown after its name, `cancel~credit`: its debits, credits or
//!   state changes as owner, `~debit`, `~credit`, `~transition`, see
//!   `failpoints::hold_back`): each attempt fails unanswered and is kept, so its run fails
//!   and it answers 503, which is right for it alone. The actor `net` sends what is held
//!   back when the scheduler lets it go: a late landing at a moment the schedule chooses.
//!   It waits until a write is held back (before that it would send nothing; it runs then
//!   only if nobody else can); whatever is still held when the actors are done is sent
//!   then, before the final sweep.

use std::collections::HashMap;
use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use transfer_service::failpoints::{self, Hook, HookFuture, Point};
use transfer_service::service::{Completion, NewTransfer, TransferService};

use crate::checker::{Answer, Run};
use crate::scenario::Scenario;
use crate::workload::{Kind, Setup, act};

/// How long one actor may run between two of its points before the schedule is
/// declared stuck: far longer than the longest wait an actor makes without a point (a
/// second run waiting out a first run's deadline, a `lapse`), a lease.
const STEP_LIMIT: Duration = Duration::from_secs(30);

/// In an `across:legs:` scenario, how long nothing more of an actor must come (no part
/// reaching a point) after parts of it reached theirs before it is taken to be at rest:
/// far longer than the two reads of server clocks a part on the other deployment makes
/// before its point (a few milliseconds here), so that it joins the stop.
const QUIET: Duration = Duration::from_millis(25);

/// After a split, how long an actor whose task was polled twice or more since it was let
/// go (the write its part sent, then the answer) must stay quiet (its task not polled)
/// before it is taken to be at rest: far longer than the read an unapplied step makes
/// after its answer, to learn why.
const SPLIT_QUIET: Duration = Duration::from_millis(50);

/// After a split, how long an actor whose task was polled once only since it was let go
/// must stay quiet: its part's write is most likely in flight, and a part whose write
/// fails at once (held back) ends in that one poll.
const SPLIT_SLOW: Duration = Duration::from_millis(500);

/// A random schedule splits one stop of several parts in this many (when another actor
/// is ready too).
const SPLIT_ODDS: u64 = 3;

/// How long an actor of `scenario` must be quiet once parts of it reached their points
/// ([`QUIET`] where a part may come late, else no time).
pub fn quiet(scenario: &Scenario) -> Duration {
    if scenario.legs && scenario.across {
        QUIET
    } else {
        Duration::ZERO
    }
}

/// A step of one actor held back in the network (`failpoints::hold_back`) for the whole
/// schedule: every attempt of it fails without an answer, so its run fails (a cancel or a
/// transfer answers 503), and is kept; the `net` actor, or the end of the actors, sends
/// what was kept. Shown after the actor's name: `cancel~credit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// Its debits (a hold's reservation out included).
    Debit,
    /// Its credits (a hold's reservation in included).
    Credit,
    /// Its state changes as the owner.
    Transition,
}

impl Held {
    pub fn name(self) -> &'static str {
        match self {
            Held::Debit => "debit",
            Held::Credit => "credit",
            Held::Transition => "transition",
        }
    }

    pub fn parse(s: &str) -> Held {
        match s {
            "debit" => Held::Debit,
            "credit" => Held::Credit,
            "transition" => Held::Transition,
            other => panic!("unknown held step {other}"),
        }
    }

    /// The point `failpoints::hold_back` takes.
    fn point(self) -> Point {
        match self {
            Held::Debit => Point::BeforeDebit,
            Held::Credit => Point::BeforeCredit,
            Held::Transition => Point::BeforeTransition,
        }
    }
}

/// Where an actor is parked: before it starts, or at one of its points.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    Start,
    At(Point),
}

/// As the trace shows it: `start`, or the point's name.
impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stop::Start => f.write_str("start"),
            Stop::At(point) => point.fmt(f),
        }
    }
}

/// One decision of a schedule: among how many options, which was taken, and what it
/// chose.
#[derive(Clone, Copy, Debug)]
pub struct Decision {
    pub options: usize,
    pub chosen: usize,
    pub kind: DecisionKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecisionKind {
    /// Which ready actor goes; `preemptive` when option 0 is the actor that ran last
    /// (still ready), so that any other choice preempts it.
    Actor { preemptive: bool },
    /// Which parts of the chosen actor's stop go: 0 all of them, `k` only its k-th
    /// (from 1, in the order they parked).
    Split,
}

impl Decision {
    /// Whether the decision spends a preemption of the schedule's budget: another actor
    /// than the one that ran last and is still ready, or a split (which preempts its
    /// actor in the middle of a step).
    pub fn preempts(&self) -> bool {
        let preemptive = match self.kind {
            DecisionKind::Actor { preemptive } => preemptive,
            DecisionKind::Split => true,
        };
        preemptive && self.chosen > 0
    }
}

enum Event {
    Parked(usize, Stop),
    /// The poll of a task of the actor in which a part of it parked has ended: every part
    /// that parked in that poll (the siblings of a `join_all`) has told so.
    PollEnded(usize),
    /// An actor let go of a drive lock: the actors blocked at [`Point::WaitDrive`] may try
    /// again.
    Released,
    /// A part parked since an earlier poll was polled again: told by every part still
    /// parked at each poll of the task running them (a `join_all` polls each part), so
    /// after a split the part let go goes on; the actor is at rest only once the parts
    /// left parked stay unpolled (see the module doc).
    Polled(usize),
    Finished(usize),
}

/// The hook of one schedule's actors: parks an actor at each of its points and tells the
/// driver, which resumes exactly one actor at a time (every part of it parked).
struct Scheduler {
    actors: HashMap<String, usize>,
    all_points: bool,
    events: mpsc::UnboundedSender<Event>,
    /// Each actor's parked parts, each waiting to be resumed.
    resumes: Mutex<Vec<Vec<oneshot::Sender<()>>>>,
}

impl Scheduler {
    /// Parks a part of `actor` at `stop` until [`Scheduler::resume`], and tells the driver
    /// so, then, once the poll of its task that parked it has ended, that too: it wakes its
    /// task at once, and its next poll is in the next poll of the task, after every
    /// sibling part of the same poll has parked.
    fn park(&self, actor: usize, stop: Stop) -> HookFuture {
        let (tx, mut rx) = oneshot::channel();
        self.resumes.lock().unwrap()[actor].push(tx);
        let _ = self.events.send(Event::Parked(actor, stop));
        let events = self.events.clone();
        let mut polls = 0;
        Box::pin(std::future::poll_fn(move |cx| {
            if Pin::new(&mut rx).poll(cx).is_ready() {
                return Poll::Ready(());
            }
            polls += 1;
            match polls {
                1 => cx.waker().wake_by_ref(),
                2 => {
                    let _ = events.send(Event::PollEnded(actor));
                }
                // Polled again while parked: a sibling part let go alone goes on.
                _ => {
                    let _ = events.send(Event::Polled(actor));
                }
            }
            Poll::Pending
        }))
    }

    /// Lets every parked part of `actor` go.
    fn resume(&self, actor: usize) {
        let parts = std::mem::take(&mut self.resumes.lock().unwrap()[actor]);
        for tx in parts {
            let _ = tx.send(());
        }
    }

    /// Lets only the parked part `at` (in the order they parked) of `actor` go.
    fn resume_part(&self, actor: usize, at: usize) {
        let tx = self.resumes.lock().unwrap()[actor].remove(at);
        let _ = tx.send(());
    }
}

/// The points of one stop, as the trace shows them: `before_debit+before_credit`.
fn show(stops: &[Stop]) -> String {
    let names: Vec<String> = stops.iter().map(Stop::to_string).collect();
    names.join("+")
}

/// The points of a stop of which only the part `at` is let go, that one in brackets:
/// `before_debit+[before_credit]+before_credit`.
fn show_part(stops: &[Stop], at: usize) -> String {
    let names: Vec<String> = stops
        .iter()
        .enumerate()
        .map(|(i, stop)| {
            if i == at {
                format!("[{stop}]")
            } else {
                stop.to_string()
            }
        })
        .collect();
    names.join("+")
}

impl Hook for Scheduler {
    fn hit(&self, point: Point, instance: &str) -> HookFuture {
        let Some(&actor) = self.actors.get(instance) else {
            return Box::pin(async {});
        };
        // Told, not parked at: the release is the last thing a run does, and neither a
        // switch nor a crash there differs from one at the actor's next point.
        if point == Point::AfterDrive {
            let _ = self.events.send(Event::Released);
            return Box::pin(async {});
        }
        // A wait for a drive lock is always parked at: the actor cannot go on by itself.
        if point != Point::WaitDrive && !self.all_points && !point.precedes_a_write() {
            return Box::pin(async {});
        }
        self.park(actor, Stop::At(point))
    }
}

/// Picks among the actors ready to run.
pub enum Chooser {
    /// Follows `prefix`, then always the first (depth-first enumeration).
    Fixed(Vec<usize>),
    /// Seeded random choices (splitmix64).
    Random(u64),
}

impl Chooser {
    pub fn choose(&mut self, decision: usize, options: usize) -> usize {
        match self {
            Chooser::Fixed(prefix) => prefix.get(decision).copied().unwrap_or(0).min(options - 1),
            Chooser::Random(state) => (splitmix(state) % options as u64) as usize,
        }
    }

    /// Which of the `parts` parked parts of an actor's stop to let go: 0 all of them, `k`
    /// only the k-th (from 1). A random schedule splits one stop in [`SPLIT_ODDS`], letting
    /// a part drawn at random go.
    pub fn split(&mut self, decision: usize, parts: usize) -> usize {
        match self {
            Chooser::Fixed(prefix) => prefix.get(decision).copied().unwrap_or(0).min(parts),
            Chooser::Random(state) => {
                if splitmix(state) % SPLIT_ODDS == 0 {
                    1 + (splitmix(state) % parts as u64) as usize
                } else {
                    0
                }
            }
        }
    }
}

pub fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The owner of a `crash<k>:` prelude (its instance id `id`) runs `new_transfer` alone
/// until its k-th stop (counting every point, from 0; the parts of a multi-leg step
/// parked at once are one stop, see the module doc, `quiet` as for [`quiet`]), then
/// crashes there: its future is dropped, so the writes it was about to send never are.
/// Returns whether it crashed; if not, `run` says why and the schedule is over.
pub async fn crash_owner(
    owner: TransferService,
    id: &str,
    new_transfer: NewTransfer,
    (k, quiet): (usize, Duration),
    run: &mut Run,
) -> bool {
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let sched = Arc::new(Scheduler {
        actors: HashMap::from([(id.to_owned(), 0)]),
        all_points: true,
        events: events_tx.clone(),
        resumes: Mutex::new(vec![vec![]]),
    });
    failpoints::install_hook(id, sched.clone());
    let task = tokio::spawn(async move {
        let r = owner
            .requests()
            .transfer(new_transfer, None, Completion::Wait)
            .await;
        let _ = events_tx.send(Event::Finished(0));
        r
    });
    let mut reached = 0;
    // The parts parked, and once the poll that parked them ended, when the owner is at
    // rest at them if nothing more comes.
    let mut parts = Vec::new();
    let mut at_rest: Option<Instant> = None;
    let crashed = loop {
        let deadline = at_rest.unwrap_or_else(|| Instant::now() + STEP_LIMIT);
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(Event::Released | Event::Polled(_))) => {}
            Ok(Some(Event::Parked(_, stop))) => parts.push(stop),
            Ok(Some(Event::PollEnded(_))) => {
                if !parts.is_empty() {
                    at_rest = Some(Instant::now() + quiet);
                }
            }
            Ok(Some(Event::Finished(_))) | Ok(None) => break false,
            Err(_) if at_rest.is_some() => {
                at_rest = None;
                run.trace.push(format!("owner@{}", show(&parts)));
                parts.clear();
                if reached == k {
                    break true;
                }
                reached += 1;
                sched.resume(0);
            }
            Err(_) => {
                run.violations
                    .push("the owner got stuck running alone".into());
                break true;
            }
        }
    };
    task.abort();
    let _ = task.await;
    failpoints::remove_hook(id);
    if !crashed {
        run.violations
            .push(format!("the owner finished before its point {k}"));
        return false;
    }
    run.trace.push("owner crashed".into());
    true
}

/// The actors of one schedule, each a task parked at its points, and where the
/// scheduler has them.
pub struct Actors {
    /// Each actor's instance id, by index...
    ids: Vec<String>,
    /// ...and its name in the trace (`cancel2`).
    names: Vec<String>,
    sched: Arc<Scheduler>,
    events: mpsc::UnboundedReceiver<Event>,
    tasks: Vec<JoinHandle<Answer>>,
    /// The held-back step: its actor's id and its point.
    held: Option<(String, Point)>,
    /// Where each actor's parts are parked (none: it is not parked).
    parked: Vec<Vec<Stop>>,
    /// Parked at [`Point::WaitDrive`] since the last release of a drive lock: not ready.
    blocked: Vec<bool>,
    finished: Vec<bool>,
    /// The actors let go (and at first every actor, until it parks at `start`) that are
    /// not at rest yet: neither finished nor parked with the poll that parked them ended
    /// (and, where parts may come late, quiet since).
    running: Vec<bool>,
    /// A part of the running actor reached a point in its current poll.
    arrived: Vec<bool>,
    /// When a running actor whose parts reached their points is at rest, if it stays
    /// quiet until then.
    at_rest: Vec<Option<Instant>>,
    /// How long an actor must stay quiet after its parts reached their points ([`quiet`]).
    quiet: Duration,
    /// When a running actor last told something: it is stuck [`STEP_LIMIT`] after that.
    heard: Instant,
    /// Whether the scenario splits stops (`split:`).
    split: bool,
    /// The actors let go in part (a split) since they were last let go, each with the
    /// polls of its task since: at rest once quiet ([`SPLIT_QUIET`], [`SPLIT_SLOW`]).
    split_polls: Vec<Option<usize>>,
    /// The actors taken to be at rest after a split: a poll of one of them is a late one
    /// (`Run::late_splits`).
    split_rest: Vec<bool>,
    /// The actor let go last.
    last: Option<usize>,
    /// Whether the held-back actor was let go from its held point, so that a write of
    /// it is held back: until then the network has nothing to send, and it runs only
    /// when nobody else can (where it runs makes no difference then).
    something_held: bool,
}

impl Actors {
    /// Spawns the actors of `scenario` for the schedule `tag` on `setup`'s accounts, each
    /// with the bank `bank_of` gives for its instance id, under a scheduler that parks
    /// them at `start` first; arms the held-back step, if any.
    pub fn spawn(
        scenario: &Scenario,
        tag: &str,
        all_points: bool,
        setup: &Setup,
        bank_of: impl Fn(&str) -> TransferService,
    ) -> Actors {
        let (events_tx, events) = mpsc::unbounded_channel();
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
            all_points,
            events: events_tx.clone(),
            resumes: Mutex::new(scenario.actors.iter().map(|_| vec![]).collect()),
        });
        // The held-back step: armed for the whole schedule, under its actor's own id.
        let held = scenario
            .held
            .map(|(i, step)| (ids[i].clone(), step.point()));
        if let Some((id, point)) = &held {
            failpoints::hold_back(id, *point);
        }
        let mut tasks = Vec::new();
        for (i, (&kind, id)) in scenario.actors.iter().zip(&ids).enumerate() {
            failpoints::install_hook(id, sched.clone());
            let bank = bank_of(id);
            let start = sched.park(i, Stop::Start);
            let events = events_tx.clone();
            let new = setup.new_transfer.clone();
            let (a, b) = (setup.a.clone(), setup.b.clone());
            let holder = held.as_ref().map(|(id, _)| id.clone());
            let is_held = scenario.held.is_some_and(|(at, _)| at == i);
            let actor = async move {
                start.await;
                let mut answer = act(kind, &bank, new, &a, &b, holder.as_deref()).await;
                if let Answer::Unavailable { held, .. } = &mut answer {
                    *held = is_held;
                }
                let _ = events.send(Event::Finished(i));
                answer
            };
            tasks.push(tokio::spawn(actor));
        }
        drop(events_tx);
        Actors::new(scenario, ids, sched, events, tasks, held)
    }

    fn new(
        scenario: &Scenario,
        ids: Vec<String>,
        sched: Arc<Scheduler>,
        events: mpsc::UnboundedReceiver<Event>,
        tasks: Vec<JoinHandle<Answer>>,
        held: Option<(String, Point)>,
    ) -> Actors {
        let names: Vec<String> = scenario
            .actors
            .iter()
            .enumerate()
            .map(|(i, k)| format!("{}{}", k.name(), i + 1))
            .collect();
        let n = scenario.actors.len();
        Actors {
            ids,
            names,
            sched,
            events,
            tasks,
            held,
            parked: vec![vec![]; n],
            blocked: vec![false; n],
            finished: vec![false; n],
            // Every actor parks at `start` first; then one runs at a time.
            running: vec![true; n],
            arrived: vec![false; n],
            at_rest: vec![None; n],
            quiet: quiet(scenario),
            heard: Instant::now(),
            split: scenario.split,
            split_polls: vec![None; n],
            split_rest: vec![false; n],
            last: None,
            something_held: false,
        }
    }

    /// Lets one actor at a time go from its point, chosen by `chooser` among those ready,
    /// until none is. Returns why the schedule is stuck, if it is.
    pub async fn drive(
        &mut self,
        scenario: &Scenario,
        chooser: &mut Chooser,
        run: &mut Run,
    ) -> Option<String> {
        loop {
            if let Some(stuck) = self.wait(run).await {
                return Some(stuck);
            }
            let ready = self.ready(scenario);
            if ready.is_empty() {
                return self.deadlock();
            }
            self.let_go(ready, scenario, chooser, run);
        }
    }

    /// Waits until every actor let go is at rest: finished, or parked with the poll that
    /// parked it ended (and quiet since, where parts may come late). Why the schedule is
    /// stuck if one told nothing for [`STEP_LIMIT`].
    async fn wait(&mut self, run: &mut Run) -> Option<String> {
        self.heard = Instant::now();
        loop {
            let now = Instant::now();
            for i in 0..self.running.len() {
                if self.running[i] && self.at_rest[i].is_some_and(|at| at <= now) {
                    self.rest(i);
                }
            }
            if !self.running.iter().any(|&r| r) {
                return None;
            }
            let deadline = (0..self.running.len())
                .filter(|&i| self.running[i])
                .filter_map(|i| self.at_rest[i])
                .min()
                .unwrap_or(self.heard + STEP_LIMIT);
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(event)) => self.note(event, run),
                Ok(None) => return None,
                Err(_) if self.at_rest.iter().any(Option::is_some) => {}
                Err(_) => {
                    let running: Vec<&String> = (0..self.names.len())
                        .filter(|&i| self.running[i])
                        .map(|i| &self.names[i])
                        .collect();
                    return Some(format!(
                        "stuck: {running:?} did not reach a point nor finish within {STEP_LIMIT:?}"
                    ));
                }
            }
        }
    }

    /// What an actor told: a part of it parked, a poll of it ended, a drive lock let go,
    /// or its end.
    fn note(&mut self, event: Event, run: &mut Run) {
        // A poll's end follows a part's park: no progress of its own; a poll of a task is
        // progress only for a split actor, which tells nothing else.
        if !matches!(event, Event::PollEnded(_) | Event::Polled(_)) {
            self.heard = Instant::now();
        }
        match event {
            Event::Parked(i, stop) => {
                self.parked[i].push(stop);
                self.blocked[i] = stop == Stop::At(Point::WaitDrive);
                if stop == Stop::Start {
                    self.running[i] = false;
                } else if self.running[i] {
                    self.arrived[i] = true;
                } else {
                    // Its stop was let go, or it was taken to be at rest, before this
                    // part reached its point.
                    run.late_parts += 1;
                    run.trace
                        .push(format!("({} late at {stop})", self.names[i]));
                }
            }
            Event::PollEnded(i) => {
                if self.running[i] && (self.arrived[i] || self.at_rest[i].is_some()) {
                    self.at_rest[i] = Some(Instant::now() + self.quiet);
                }
            }
            Event::Released => self.blocked.fill(false),
            Event::Polled(i) => self.polled(i, run),
            Event::Finished(i) => {
                self.finished[i] = true;
                self.rest(i);
            }
        }
    }

    /// A part of actor `i` left parked was polled again. Only after a split does it tell
    /// something: the part let go goes on (its write sent, its answer read), so the actor
    /// is at rest only once the parts left parked stay unpolled; a poll of one taken to be
    /// at rest already is late.
    fn polled(&mut self, i: usize, run: &mut Run) {
        let now = Instant::now();
        if self.running[i] {
            let Some(polls) = &mut self.split_polls[i] else {
                return;
            };
            *polls += 1;
            self.heard = now;
            // A part parked again: at rest once that poll ends, as at any stop.
            if !self.arrived[i] {
                // Each part left parked tells each poll.
                let twice = 2 * self.parked[i].len().max(1);
                let quiet = if *polls >= twice {
                    SPLIT_QUIET
                } else {
                    SPLIT_SLOW
                };
                self.at_rest[i] = Some(now + quiet.max(self.quiet));
            }
        } else if self.split_rest[i] {
            run.late_splits += 1;
            run.trace
                .push(format!("({} still running after its split)", self.names[i]));
            self.split_rest[i] = false;
            self.running[i] = true;
            self.heard = now;
            self.at_rest[i] = Some(now + SPLIT_QUIET.max(self.quiet));
        }
    }

    /// Actor `i` is at rest: finished or parked.
    fn rest(&mut self, i: usize) {
        self.running[i] = false;
        self.arrived[i] = false;
        self.at_rest[i] = None;
        self.split_rest[i] = self.split_polls[i].is_some() && !self.finished[i];
    }

    /// The actors ready to go on: parked and not blocked; the network only once something
    /// is held back, or when nobody else is ready.
    fn ready(&self, scenario: &Scenario) -> Vec<usize> {
        let mut ready: Vec<usize> = (0..self.parked.len())
            .filter(|&i| !self.parked[i].is_empty() && !self.blocked[i])
            .collect();
        let is_net = |i: &usize| scenario.actors[*i] == Kind::Net;
        if !self.something_held && !ready.iter().all(is_net) {
            ready.retain(|i| !is_net(i));
        }
        ready
    }

    /// With no actor ready: a deadlock if some wait for a drive lock; else the actors are
    /// done.
    fn deadlock(&self) -> Option<String> {
        let waiting: Vec<&String> = (0..self.names.len())
            .filter(|&i| self.blocked[i])
            .map(|i| &self.names[i])
            .collect();
        (!waiting.is_empty()).then(|| {
            format!("deadlock: {waiting:?} wait for a drive lock that no actor will let go of")
        })
    }

    /// Lets one of the `ready` actors go, as `chooser` says (a decision of `run` when
    /// there are two or more); the default (choice 0) lets the actor that ran last go on.
    /// Every part of its stop goes, or in a `split:` scenario, where its stop has several
    /// parts and another actor is ready, only the one part `chooser` says (a decision of
    /// its own, 0 for all of them).
    fn let_go(
        &mut self,
        mut ready: Vec<usize>,
        scenario: &Scenario,
        chooser: &mut Chooser,
        run: &mut Run,
    ) {
        let preemptive = match self.last.and_then(|l| ready.iter().position(|&i| i == l)) {
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
            run.decisions.push(Decision {
                options: ready.len(),
                chosen: c,
                kind: DecisionKind::Actor { preemptive },
            });
            c
        };
        let actor = ready[pick];
        self.last = Some(actor);
        let parts = self.parked[actor].len();
        let part = if self.split && parts > 1 && ready.len() > 1 {
            let c = chooser.split(run.decisions.len(), parts);
            run.decisions.push(Decision {
                options: parts + 1,
                chosen: c,
                kind: DecisionKind::Split,
            });
            c.checked_sub(1)
        } else {
            None
        };
        let (stops, shown) = match part {
            None => {
                let stops = std::mem::take(&mut self.parked[actor]);
                let shown = show(&stops);
                (stops, shown)
            }
            Some(at) => {
                run.splits += 1;
                let shown = show_part(&self.parked[actor], at);
                (vec![self.parked[actor].remove(at)], shown)
            }
        };
        if let Some((i, h)) = scenario.held {
            if i == actor && stops.contains(&Stop::At(h.point())) {
                self.something_held = true;
            }
        }
        run.trace.push(format!("{}@{shown}", self.names[actor]));
        // The split preempted the actor: the next choice, of any ready actor, is free.
        if part.is_some() {
            self.last = None;
        }
        self.running[actor] = true;
        self.split_polls[actor] = part.map(|_| 0);
        self.split_rest[actor] = false;
        match part {
            None => self.sched.resume(actor),
            Some(at) => self.sched.resume_part(actor, at),
        }
    }

    /// Ends the actors: their hooks removed, their tasks aborted if the schedule is
    /// `stuck` (which `run` then records), each answer recorded (a task that did not
    /// finish answered [`Answer::Stuck`]). What is still held back reaches the server now,
    /// the latest a network delivers it: after every actor, before the final sweep.
    pub async fn finish(self, scenario: &Scenario, stuck: Option<&String>, run: &mut Run) {
        for id in &self.ids {
            failpoints::remove_hook(id);
        }
        if let Some(stuck) = stuck {
            run.violations.push(stuck.clone());
            for t in &self.tasks {
                t.abort();
            }
        }
        for (task, &kind) in self.tasks.into_iter().zip(&scenario.actors) {
            let answer = task.await.unwrap_or(Answer::Stuck);
            run.answers.push((kind, answer));
        }
        if let Some((id, point)) = &self.held {
            failpoints::let_through(id, *point);
            let sent = failpoints::send_held(id).await;
            if sent > 0 {
                run.trace
                    .push(format!("net (after the actors) sent {sent}"));
            }
        }
    }
}
