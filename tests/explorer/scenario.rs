//! Scenarios: which actors a schedule runs, after which prelude, in which layout, with
//! which step held back; each named so that `EXPLORE_REPLAY` reads it back
//! ([`Scenario::parse`]), and drawn by seed ([`random_scenario`]) or enumerated
//! ([`exhaustive_scenarios`]).

use std::fmt;
use std::time::Duration;

use crate::nemesis::{Held, splitmix};
use crate::workload::Kind;

/// The lease of every actor. Long, so that no lease lapses by itself while a schedule
/// runs (which would make schedules depend on timing); the lapses the scenarios need are
/// made by ageing `lastModified` when no write can be in flight.
pub const LEASE: Duration = Duration::from_secs(5);
/// The lease of the banks of a `same:` scenario. A second run of a transfer in the
/// process whose first run's step failed without an answer waits until that step's
/// deadline has passed (up to 0.9 of a lease), and a `lapse` actor waits a lease: real
/// waits, in most of these schedules. Shorter than `LEASE` so that they cost less. Nothing
/// of these scenarios takes a transfer over by a lapsed lease but a `lapse` actor, which
/// waits for it; a deadline that passes while an actor is parked (a sibling waiting out
/// a step makes it pass) only makes that actor renew its lease and try again.
const SAME_LEASE: Duration = Duration::from_secs(1);

/// What happens before the actors run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prelude {
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
pub struct Scenario {
    /// b lives on a second deployment (a second database server), a (and c) on the
    /// first: the transfer is logged with a, its credit (and a reversal's log) is on the
    /// other server, each step checked by its own server's clock; a multi-leg transfer's
    /// parties span both servers. Shown as the prefix `across:`.
    pub across: bool,
    /// The actors, and the owner of a `done:` or `held:` prelude, are tasks of one
    /// process (`TransferService::sibling`): one owner in `application`, one set of drive locks, one
    /// record of unanswered writes, one admission; each names its points with an instance
    /// id of its own, so that the scheduler tells them apart. Shown as the prefix `same:`.
    pub same: bool,
    /// The scheduler may let only one part of a stop of several parts go (a multi-leg
    /// step's per-party writes, see `nemesis`), the others staying parked: another actor
    /// may then act between two parties' writes of one step. Shown as the prefix `split:`.
    pub split: bool,
    /// The owner creates a hold of AMOUNT (expiring in `HOLD_EXPIRY`) instead of a
    /// transfer. Shown as the prefix `hold:`.
    pub hold: bool,
    /// The owner makes a multi-leg transfer over three accounts instead (`docs/legs.md`):
    /// a pays b AMOUNT and b pays c AMOUNT/2, so a pays and b and c receive (see
    /// `workload::legs`). Shown as the prefix `legs:`. With `hold` too (`hold:legs:`), a
    /// multi-leg hold of those legs: a reserves its net out, b and c theirs in, until a
    /// capture of the whole, a void, an expiry or a cancel.
    pub legs: bool,
    pub prelude: Prelude,
    pub actors: Vec<Kind>,
    /// The actor (by index) whose step is held back for the whole schedule, if any.
    pub held: Option<(usize, Held)>,
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.across {
            write!(f, "across:")?;
        }
        if self.same {
            write!(f, "same:")?;
        }
        if self.split {
            write!(f, "split:")?;
        }
        if self.hold {
            write!(f, "hold:")?;
        }
        if self.legs {
            write!(f, "legs:")?;
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
    pub fn new(prelude: Prelude, actors: &[Kind]) -> Scenario {
        Scenario {
            across: false,
            same: false,
            split: false,
            hold: false,
            legs: false,
            prelude,
            actors: actors.to_vec(),
            held: None,
        }
    }

    /// A scenario whose actors are tasks of one process, the first of them with `held`
    /// held back.
    pub fn same(prelude: Prelude, actors: &[Kind], held: Held) -> Scenario {
        Scenario {
            same: true,
            held: Some((0, held)),
            ..Scenario::new(prelude, actors)
        }
    }

    /// The lease of the scenario's banks: `SAME_LEASE` when the actors are one process,
    /// else `LEASE`.
    pub fn lease(&self) -> Duration {
        if self.same { SAME_LEASE } else { LEASE }
    }

    /// A hold scenario.
    pub fn hold(prelude: Prelude, actors: &[Kind]) -> Scenario {
        Scenario {
            hold: true,
            ..Scenario::new(prelude, actors)
        }
    }

    /// A multi-leg scenario.
    pub fn legs(prelude: Prelude, actors: &[Kind]) -> Scenario {
        Scenario {
            legs: true,
            ..Scenario::new(prelude, actors)
        }
    }

    /// A multi-leg hold scenario (`hold:legs:`).
    pub fn legs_hold(prelude: Prelude, actors: &[Kind]) -> Scenario {
        Scenario {
            hold: true,
            legs: true,
            ..Scenario::new(prelude, actors)
        }
    }

    /// The same scenario, its stops split (`split:`).
    pub fn split(self) -> Scenario {
        Scenario {
            split: true,
            ..self
        }
    }

    /// The same scenario with b on the second deployment.
    pub fn across(self) -> Scenario {
        Scenario {
            across: true,
            ..self
        }
    }

    pub fn parse(s: &str) -> Scenario {
        let (across, s) = match s.strip_prefix("across:") {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let (same, s) = match s.strip_prefix("same:") {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let (split, s) = match s.strip_prefix("split:") {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let (hold, s) = match s.strip_prefix("hold:") {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let (legs, s) = match s.strip_prefix("legs:") {
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
            split,
            hold,
            legs,
            prelude,
            actors: kinds,
            held,
        }
    }
}

/// How many points the owner passes running alone (every point, not only writes): the
/// crash points of a transfer, of a hold, of a multi-leg transfer and of a multi-leg
/// hold.
#[derive(Clone, Copy)]
pub struct CrashPoints {
    pub transfer: usize,
    pub hold: usize,
    pub legs: usize,
    pub legs_hold: usize,
}

/// The crash points of each layout: across two deployments an owner passes more (the
/// pulls are one write per deployment).
#[derive(Clone, Copy)]
pub struct LayoutPoints {
    pub within: CrashPoints,
    pub across: CrashPoints,
}

/// The scenario of random seed `seed`: a quarter of them `same:` scenarios (see
/// [`random_same_scenario`]), a quarter of the others multi-leg ones (see
/// [`random_legs_scenario`]); of the rest (each choice by a stream of its own, so that
/// the transfer scenario of a seed is the one it always was) half hold scenarios (see
/// [`random_hold_scenario`]; a third of them multi-leg holds, `hold:legs:`, split),
/// half: owner or a recoverer after a crash at a random point, a cancel, and a second
/// cancel or a sweeper.
pub fn random_scenario(seed: u64, points: LayoutPoints) -> Scenario {
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
    // A quarter of the others multi-leg scenarios, by a stream of their own.
    let mut legs = seed ^ 0x1E65_0000_5EED_0003;
    if splitmix(&mut legs) % 4 == 0 {
        return random_legs_scenario(&mut legs, points.legs);
    }
    let mut h = seed ^ 0x401D_5EED_0BAD_CAFE;
    if splitmix(&mut h) % 2 == 1 {
        // A third of the hold scenarios multi-leg holds, by a stream of their own: the
        // others are the ones they always were, and these have the same actors and
        // prelude, over the legs, their stops split as the multi-leg ones' are.
        let mut legs_hold = seed ^ 0x401D_1E65_0000_5EED;
        if splitmix(&mut legs_hold) % 3 == 0 {
            let scenario = random_hold_scenario(&mut h, points.legs_hold);
            return Scenario {
                legs: true,
                ..scenario
            }
            .split();
        }
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

/// A random multi-leg scenario: the owner, or a recoverer after the owner crashed at a
/// random point of the transfer, then a cancel and a second cancel or a sweeper; a third
/// of them all four: a recoverer (or the owner), two cancels and a sweeper. Its stops are
/// split (`split:`; the random chooser splits one in `nemesis::SPLIT_ODDS`).
fn random_legs_scenario(s: &mut u64, crash_points: usize) -> Scenario {
    use Kind::*;
    let (prelude, head) = if splitmix(s) % 2 == 0 {
        (Prelude::Nothing, Owner)
    } else {
        let k = (splitmix(s) % crash_points as u64) as usize;
        (Prelude::Crash(k), Recoverer)
    };
    let actors: &[Kind] = match splitmix(s) % 3 {
        0 => &[head, Cancel, Cancel],
        1 => &[head, Cancel, Sweeper],
        _ => &[head, Cancel, Cancel, Sweeper],
    };
    Scenario::legs(prelude, actors).split()
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
/// second (c, of a multi-leg scenario, stays on the first). The multi-leg holds' are
/// [`legs_hold_scenarios`].
pub fn exhaustive_scenarios(crash_points: LayoutPoints) -> Vec<Scenario> {
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
        // Multi-leg transfers: the same pairs. Across deployments, where the parties of
        // a step are wholly independent, their stops split (every ordering without a
        // split is among theirs): another actor between two parties' writes of a step.
        // Of the crash points only the even ones: a crash at a point leaves what one at
        // the next leaves when no write comes between them (see the points printed:
        // after_insert, after_pending and before_debit; after_debit and after_credit,
        // one round; after_applied and before_capture; after_pull and the last
        // before_transition), and the even ones hold one of each such run, so every
        // state a crash can leave is split while the run keeps within its time.
        let legs = |scenario: Scenario, split: bool| {
            if split && across {
                scenario.split()
            } else {
                scenario
            }
        };
        add(legs(
            Scenario::legs(Prelude::Nothing, &[Owner, Cancel]),
            true,
        ));
        for k in 0..points.legs {
            let crashed = Scenario::legs(Prelude::Crash(k), &[Recoverer, Cancel]);
            add(legs(crashed, k % 2 == 0));
        }
        add(legs(Scenario::legs(Prelude::Done, &[Cancel, Cancel]), true));
        // Holds: every pair of those that resolve a held hold, two of a kind included.
        let resolvers = [Capture, Void, Expire, Cancel];
        for (i, &first) in resolvers.iter().enumerate() {
            for &second in &resolvers[i..] {
                add(Scenario::hold(Prelude::Held, &[first, second]));
            }
        }
        for resolver in resolvers {
            add(Scenario::hold(Prelude::Nothing, &[Owner, resolver]));
        }
        for k in 0..points.hold {
            add(Scenario::hold(Prelude::Crash(k), &[Recoverer, Cancel]));
        }
        for scenario in legs_hold_scenarios(points.legs_hold, across) {
            add(scenario);
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

/// The exhaustive multi-leg hold scenarios of one layout (`across` or not): the pairs of
/// a hold, over the legs. Across deployments their stops split where a multi-leg
/// transfer's are (the owner with a cancel, the crashes at even points, two cancels) and
/// where two drivers of the capture's per-party writes meet (a capture with a capture or
/// a cancel). The other pairs are explored unsplit, to keep the run within its time: a
/// void's and an expiry's releases are a cancel's (`held -> canceling`, then every
/// party's release), and random schedules split them.
fn legs_hold_scenarios(crash_points: usize, across: bool) -> Vec<Scenario> {
    use Kind::*;
    let split = |scenario: Scenario, split: bool| {
        if split && across {
            scenario.split()
        } else {
            scenario
        }
    };
    let split_pairs = [(Cancel, Cancel), (Capture, Capture), (Capture, Cancel)];
    let mut all = Vec::new();
    let resolvers = [Capture, Void, Expire, Cancel];
    for (i, &first) in resolvers.iter().enumerate() {
        for &second in &resolvers[i..] {
            let pair = Scenario::legs_hold(Prelude::Held, &[first, second]);
            all.push(split(pair, split_pairs.contains(&(first, second))));
        }
    }
    for resolver in resolvers {
        let created = Scenario::legs_hold(Prelude::Nothing, &[Owner, resolver]);
        all.push(split(created, resolver == Cancel));
    }
    for k in 0..crash_points {
        let crashed = Scenario::legs_hold(Prelude::Crash(k), &[Recoverer, Cancel]);
        all.push(split(crashed, k % 2 == 0));
    }
    all
}
