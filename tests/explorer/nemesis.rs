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
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use transfer_service::failpoints::{self, Hook, HookFuture, Point};
use transfer_service::service::{Completion, NewTransfer, TransferService};

use crate::checker::{Answer, Run};
use crate::scenario::Scenario;
use crate::workload::{Kind, Setup, act};

/// How long one actor may run between two of its points before the schedule is
/// declared stuck: far longer than the longest wait an actor makes without a point (a
/// second run waiting out a first run's deadline, a `lapse`), a lease.
const STEP_LIMIT: Duration = Duration::from_secs(30);

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

enum Event {
    Parked(usize, Stop),
    /// An actor let go of a drive lock: the actors blocked at [`Point::WaitDrive`] may try
    /// again.
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
    fn park(&self, actor: usize, stop: Stop) -> HookFuture {
        let (tx, rx) = oneshot::channel();
        self.resumes.lock().unwrap()[actor] = Some(tx);
        let _ = self.events.send(Event::Parked(actor, stop));
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
}

pub fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The owner of a `crash<k>:` prelude (its instance id `id`) runs `new_transfer` alone
/// until its k-th point (counting every point, from 0), then crashes there: its future
/// is dropped, so the write it was about to send never is. Returns whether it crashed;
/// if not, `run` says why and the schedule is over.
pub async fn crash_owner(
    owner: TransferService,
    id: &str,
    new_transfer: NewTransfer,
    k: usize,
    run: &mut Run,
) -> bool {
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let sched = Arc::new(Scheduler {
        actors: HashMap::from([(id.to_owned(), 0)]),
        all_points: true,
        events: events_tx.clone(),
        resumes: Mutex::new(vec![None]),
    });
    failpoints::install_hook(id, sched.clone());
    let task = tokio::spawn(async move {
        let r = owner.transfer(new_transfer, None, Completion::Wait).await;
        let _ = events_tx.send(Event::Finished(0));
        r
    });
    let mut reached = 0;
    let crashed = loop {
        match tokio::time::timeout(STEP_LIMIT, events.recv()).await {
            Ok(Some(Event::Released)) => {}
            Ok(Some(Event::Parked(_, stop))) => {
                run.trace.push(format!("owner@{stop}"));
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
    /// Where each actor is parked, if it is.
    parked: Vec<Option<Stop>>,
    /// Parked at [`Point::WaitDrive`] since the last release of a drive lock: not ready.
    blocked: Vec<bool>,
    finished: Vec<bool>,
    /// The actors let go that have not reached a point nor finished yet.
    waiting_for: usize,
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
            resumes: Mutex::new(scenario.actors.iter().map(|_| None).collect()),
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
            parked: vec![None; n],
            blocked: vec![false; n],
            finished: vec![false; n],
            // Every actor parks at `start` first; then one runs at a time.
            waiting_for: n,
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
            if let Some(stuck) = self.wait().await {
                return Some(stuck);
            }
            let ready = self.ready(scenario);
            if ready.is_empty() {
                return self.deadlock();
            }
            self.let_go(ready, scenario, chooser, run);
        }
    }

    /// Waits until every actor let go has reached a point or finished; why the schedule
    /// is stuck if one did neither within [`STEP_LIMIT`].
    async fn wait(&mut self) -> Option<String> {
        while self.waiting_for > 0 {
            match tokio::time::timeout(STEP_LIMIT, self.events.recv()).await {
                Ok(Some(Event::Parked(i, stop))) => {
                    self.parked[i] = Some(stop);
                    self.blocked[i] = stop == Stop::At(Point::WaitDrive);
                    self.waiting_for -= 1;
                }
                Ok(Some(Event::Released)) => self.blocked.fill(false),
                Ok(Some(Event::Finished(i))) => {
                    self.finished[i] = true;
                    self.waiting_for -= 1;
                }
                Ok(None) => break,
                Err(_) => {
                    let running: Vec<&String> = (0..self.names.len())
                        .filter(|&i| self.parked[i].is_none() && !self.finished[i])
                        .map(|i| &self.names[i])
                        .collect();
                    return Some(format!(
                        "stuck: {running:?} did not reach a point nor finish within {STEP_LIMIT:?}"
                    ));
                }
            }
        }
        None
    }

    /// The actors ready to go on: parked and not blocked; the network only once something
    /// is held back, or when nobody else is ready.
    fn ready(&self, scenario: &Scenario) -> Vec<usize> {
        let mut ready: Vec<usize> = (0..self.parked.len())
            .filter(|&i| self.parked[i].is_some() && !self.blocked[i])
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
            run.decisions.push((ready.len(), c, preemptive));
            c
        };
        let actor = ready[pick];
        self.last = Some(actor);
        let stop = self.parked[actor].take().unwrap();
        if scenario
            .held
            .is_some_and(|(i, h)| i == actor && Stop::At(h.point()) == stop)
        {
            self.something_held = true;
        }
        run.trace.push(format!("{}@{stop}", self.names[actor]));
        self.sched.resume(actor);
        self.waiting_for = 1;
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
