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
//! at a `before_*` point is a write that reaches the server late. The writes a
//! multi-leg step sends for every party at once are one stop of their actor, let go
//! together, or in a `split:` scenario one part at a time if the schedule says so, with
//! other actors between them (see [`nemesis`]).
//!
//! A scenario is a transfer scenario (the owner transfers AMOUNT from a to b), a hold
//! scenario (named with the prefix `hold:`), a multi-leg scenario (prefix `legs:`: the
//! owner's transfer has legs a->b AMOUNT and b->c AMOUNT/2 over a third account c, so a
//! pays and b and c receive; its reversal has b and c pay and a receive) or a multi-leg
//! hold scenario (prefix `hold:legs:`: a hold of those legs, a reserving its net out and
//! b and c theirs in, captured whole, voided, expired or canceled), after a
//! prelude (`crash<k>:` the owner
//! crashed at its k-th point, `done:` the transfer done, `held:` the hold held). In a
//! scenario with the prefix `same:` (issue 17, item 1) the actors are tasks of one
//! process, one of them with a step held back in the network, which the actor `net`
//! sends late; the actor `lapse` waits until a lease lapses, then sweeps. `same:`
//! scenarios use `SAME_LEASE`, shorter than `LEASE`, as most of their schedules wait most
//! of a lease: a second run waits until a first run's unanswered step can no longer land.
//!
//! Exploration:
//! 1. every ordering with at most `EXPLORE_PREEMPTIONS` preemptions (CHESS-style bound,
//!    default 1; `all` for every ordering; depth-first over the decision tree) of the
//!    pairs {owner, cancel},
//!    {recoverer after a crash at point k, cancel} for every point k the owner passes,
//!    and {cancel, cancel} of a done transfer; the same three for a multi-leg transfer
//!    (its crash points are its owner's stops: the parts of one step are one), across
//!    deployments with its stops split (`split:`; a split spends a preemption; of the
//!    crashes only those at even points, right before a write, see
//!    [`scenario::exhaustive_scenarios`]); and for a
//!    hold: every pair of {capture,
//!    void, expire, cancel} (two of a kind included) of a held hold, {owner creating it,
//!    each of those four}, and {recoverer after a crash at point k of creating it,
//!    cancel} for every point k; the same three for a multi-leg hold (`hold:legs:`, its
//!    crash points counted as a multi-leg transfer's), across deployments with its stops
//!    split where a multi-leg transfer's are ({owner, cancel}, the crashes at even
//!    points, {cancel, cancel}) and in {capture, capture} and {capture, cancel} (see
//!    `scenario::legs_hold_scenarios`); and of one process: {cancel with its reversal's credit held back, cancel, net} and the
//!    same with the debit held back, of a done transfer, and {owner with its credit held
//!    back, cancel or lapse, net};
//! 2. `EXPLORE_SCHEDULES` seeded random orderings of three actors; by the seed, a quarter
//!    of them `same:` scenarios (a cancel of a done transfer or an owner, with its debit,
//!    credit or state change held back; a cancel or a lapse; net), a quarter of the others
//!    multi-leg scenarios (owner or recoverer, cancel, and a second cancel or a sweeper,
//!    or a third of them all four: owner or recoverer, two cancels and the sweeper; their
//!    stops split, one in three, `split:`), and
//!    of the rest half transfer scenarios (owner or recoverer, cancel, and a second cancel
//!    or a sweeper), half hold scenarios (three actors drawn from {capture, void, expire,
//!    cancel, sweeper} after a held prelude, or owner or recoverer and two of those), a
//!    third of these multi-leg holds (`hold:legs:`, their stops split, one in three, as
//!    the multi-leg ones').
//!
//! Every scenario runs in two layouts: every account on one deployment, and (prefix
//! `across:`) b on a second deployment, a second database server, so that the credit,
//! the destination's fence and a reversal's log are on another server than the
//! transfer's log, each write checked by its own server's clock (c stays on the first:
//! a multi-leg transfer's parties, and its reversal's, span both). The exhaustive
//! scenarios are enumerated in both layouts; half the random ones are `across:`.
//!
//! Each schedule runs from scratch on fresh accounts, in one of `EXPLORE_WORKERS`
//! databases (schedules of different workers run concurrently). After it, everything is
//! let finish, and the invariants are checked (conservation, balances from the log, for
//! a multi-leg transfer each party's net, no fences, no room left (`incoming`), at most
//! one reversal mirroring its original, answers that agree with the final state, for
//! holds their reservations and who won them, for a multi-leg hold each party's net
//! moved if and only if it was captured, each party's reservation on its side and none
//! left once it ended, and the ledger's entries, none entered twice; see [`checker`]).
//!
//! A violation prints the schedule as `EXPLORE_REPLAY='<scenario>/<choices>'` (random
//! ones also as `EXPLORE_SEED=<seed>`) with the points it reached; either variable replays
//! just that schedule, printing its trace.
//! `EXPLORE_PREEMPTIONS` bounds the preemptions of an exhaustive schedule, splits
//! included (default 1; `all`: every ordering); `EXPLORE_DFS_LIMIT` the schedules per exhaustive scenario
//! (default: none); `EXPLORE_SCHEDULES` the random ones (default 300); `EXPLORE_WORKERS`
//! the concurrent databases (default 6); `EXPLORE_POINTS=all` parks after steps too;
//! `EXPLORE_FILTER=<text>` runs only the scenarios (exhaustive, and random by their seed)
//! whose name contains it, `same:` say.
//!
//! The explorer by role, a module each:
//!
//! - [`workload`]: the actors and what each does, on the schedule's accounts;
//! - [`nemesis`]: the scheduler that orders them (the parts of one actor at once among
//!   them), the crash of a prelude, the writes held back in the network;
//! - [`checker`]: what each actor got back, the invariants checked after a schedule, and
//!   how a violating one is told;
//! - [`scenario`]: the scenarios, their names, and which are explored;
//! - [`worker`]: one schedule's run, wiring the three together, in a worker's databases;
//! - [`exploration`]: the workers, the depth-first search, the random and replayed
//!   schedules, and the report;
//! - here: the two tests, and the settings read from the environment.

mod checker;
mod exploration;
mod nemesis;
mod scenario;
mod worker;
mod workload;

use std::collections::VecDeque;
use std::time::Instant;

use exploration::{Job, Search};
use scenario::{
    CrashPoints, LayoutPoints, Prelude, Scenario, exhaustive_scenarios, random_scenario,
};
use worker::Worker;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A scenario's name is what `EXPLORE_REPLAY` takes: every scenario the explorer runs
/// reads back as itself.
#[test]
fn every_scenario_reads_back_from_its_name() {
    let points = CrashPoints {
        transfer: 14,
        hold: 10,
        legs: 18,
        legs_hold: 16,
    };
    let points = LayoutPoints {
        within: points,
        across: points,
    };
    let exhaustive = exhaustive_scenarios(points);
    let random: Vec<Scenario> = (1..2_000)
        .map(|seed| random_scenario(seed, points))
        .collect();
    // Multi-leg holds, exhaustive and random, in both layouts: the pairs of a held one,
    // its owner's, and a recoverer's after a crash at each point; split across
    // deployments.
    let legs_hold = |s: &Scenario| s.hold && s.legs;
    for across in [false, true] {
        let exhaustive = exhaustive
            .iter()
            .filter(|s| legs_hold(s) && s.across == across);
        let preludes: Vec<Prelude> = exhaustive.map(|s| s.prelude).collect();
        let count = |prelude| preludes.iter().filter(|p| **p == prelude).count();
        // Every pair of {capture, void, expire, cancel} of a held one, and the owner
        // with each of them.
        let pairs = (count(Prelude::Held), count(Prelude::Nothing));
        assert_eq!(pairs, (10, 4), "across: {across}");
        for k in 0..points.within.legs_hold {
            assert!(preludes.contains(&Prelude::Crash(k)), "across: {across}");
        }
        assert!(
            random.iter().any(|s| legs_hold(s) && s.across == across),
            "across: {across}"
        );
    }
    assert!(
        exhaustive
            .iter()
            .any(|s| legs_hold(s) && s.split && s.across && s.prelude == Prelude::Held)
    );
    let all: Vec<Scenario> = exhaustive.into_iter().chain(random).collect();
    assert!(all.iter().any(|s| s.same && s.held.is_some()));
    // Multi-leg ones, exhaustive and random, in both layouts, four actors among them.
    assert!(
        all.iter()
            .any(|s| s.legs && s.across && s.prelude == Prelude::Done)
    );
    assert!(
        all.iter()
            .any(|s| s.legs && !s.across && s.actors.len() == 4)
    );
    // Split ones, exhaustive across deployments and random in both layouts.
    assert!(
        all.iter()
            .any(|s| s.split && s.across && s.prelude == Prelude::Done)
    );
    assert!(all.iter().any(|s| s.split && !s.across));
    for scenario in all {
        let name = scenario.to_string();
        assert_eq!(Scenario::parse(&name), scenario, "{name}");
    }
}

/// The violations a run found, as the test's error: a test that returns an error ends
/// with its `Debug` text and no backtrace after it, so the last lines of a failing run's
/// output (all that a CI log may keep) name the schedules to replay.
struct Violations(Vec<String>);

impl std::fmt::Debug for Violations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{} schedules violated an invariant:", self.0.len())?;
        for v in &self.0 {
            writeln!(f, "VIOLATION {v}")?;
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explore_interleavings() -> Result<(), Violations> {
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

    // The points the owner passes running alone: the crash points, of a transfer, of a
    // hold, of a multi-leg transfer and of a multi-leg hold.
    let mut probe = Worker::new(uris.clone(), 0, all_points).await;
    let crash_points = exploration::crash_points(&mut probe).await;
    let (jobs, verbose) = jobs(crash_points, random);
    let search = Search {
        crash_points,
        dfs_limit,
        preemption_bound,
        verbose,
    };
    let report = exploration::explore(probe, jobs, search, workers, &uris, all_points).await;
    report.print(&search, all_points, started);
    if report.violations.is_empty() {
        Ok(())
    } else {
        Err(Violations(report.violations))
    }
}

/// The jobs of this run: the schedule `EXPLORE_REPLAY` names, or the random one of
/// `EXPLORE_SEED` (printed: the second value), or every exhaustive scenario and `random`
/// random ones from `EXPLORE_SEED_BASE` on (default 1), those whose name contains
/// `EXPLORE_FILTER` only.
fn jobs(crash_points: LayoutPoints, random: u64) -> (VecDeque<Job>, bool) {
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
    (jobs, verbose)
}
