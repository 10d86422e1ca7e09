//! The search: each worker takes jobs from a shared queue ([`work`]): an exhaustive
//! scenario, enumerated depth-first within a preemption bound ([`explore_exhaustively`]),
//! a random seed, or a schedule to replay; and what the workers found ([`Report`]).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::checker::{Run, describe};
use crate::nemesis::{Chooser, Decision};
use crate::scenario::{CrashPoints, LayoutPoints, Prelude, Scenario, random_scenario};
use crate::worker::Worker;
use crate::workload::Kind;

pub enum Job {
    /// Every ordering of the scenario, depth-first.
    Exhaustive(Scenario),
    /// One random schedule.
    Random(u64),
    /// One given schedule.
    Replay(Scenario, Vec<usize>),
}

#[derive(Default)]
pub struct Report {
    pub exhaustive: u64,
    pub random: u64,
    /// Of those, the multi-leg ones (`legs:`), and of these the multi-leg holds
    /// (`hold:legs:`).
    pub legs_exhaustive: u64,
    pub legs_random: u64,
    pub legs_hold_exhaustive: u64,
    pub legs_hold_random: u64,
    /// Schedules run per exhaustive scenario.
    pub per_scenario: Vec<(String, u64, bool)>,
    pub violations: Vec<String>,
    /// Checks of the ledger over every schedule, and the entries they read.
    pub ledger_checks: u64,
    pub ledger_entries: usize,
    /// Parts of actors that reached their points late (see `nemesis`), over every
    /// schedule.
    pub late_parts: u64,
    /// Schedules with a stop split (see `nemesis`), exhaustive and random, and the stops
    /// split over every schedule.
    pub split_exhaustive: u64,
    pub split_random: u64,
    pub splits: u64,
    /// Actors found still running after a split once taken to be at rest.
    pub late_splits: u64,
}

impl Report {
    /// Adds the ledger checks of `run`.
    fn tally(&mut self, run: &Run) {
        self.ledger_checks += run.ledger_checks;
        self.ledger_entries += run.ledger_entries;
        self.late_parts += run.late_parts;
        self.splits += run.splits;
        self.late_splits += run.late_splits;
    }

    /// Prints the schedules run per exhaustive scenario, the totals and every violation.
    pub fn print(&self, search: &Search, all_points: bool, started: Instant) {
        let bound = |b: usize| {
            if b == usize::MAX {
                "none".to_string()
            } else {
                b.to_string()
            }
        };
        let mut per = self.per_scenario.clone();
        per.sort();
        for (scenario, count, complete) in &per {
            let note = if *complete { "" } else { " (truncated)" };
            println!("  exhaustive {scenario}: {count} schedules{note}");
        }
        println!(
            "explored {} exhaustive (preemption bound {}, splits included) + {} random schedules ({} points) in {:.1?}; {} violations",
            self.exhaustive,
            bound(search.preemption_bound),
            self.random,
            if all_points { "all" } else { "write" },
            started.elapsed(),
            self.violations.len()
        );
        println!(
            "multi-leg schedules among them: {} exhaustive + {} random; of those multi-leg holds: {} exhaustive + {} random",
            self.legs_exhaustive,
            self.legs_random,
            self.legs_hold_exhaustive,
            self.legs_hold_random
        );
        println!(
            "ledger: {} checks over {} entries read at the ends of the schedules",
            self.ledger_checks, self.ledger_entries
        );
        println!(
            "schedules with a split stop: {} exhaustive + {} random ({} stops split; actors still running after a split once taken to be at rest: {})",
            self.split_exhaustive, self.split_random, self.splits, self.late_splits
        );
        println!(
            "parts of an actor at once that reached their points late: {}",
            self.late_parts
        );
        for v in &self.violations {
            println!("VIOLATION {v}");
        }
    }
}

/// How the workers search: the crash points of each layout, the schedules per
/// exhaustive scenario at most (0: no limit), the preemptions per exhaustive schedule at
/// most (splits included), and whether every random schedule is printed.
#[derive(Clone, Copy)]
pub struct Search {
    pub crash_points: LayoutPoints,
    pub dfs_limit: u64,
    pub preemption_bound: usize,
    pub verbose: bool,
}

/// How many points the owner passes running alone (every point, not only writes), of a
/// transfer, of a hold, of a multi-leg transfer and of a multi-leg hold, within one
/// deployment and across two: the crash points. Run by `probe`, printed.
pub async fn crash_points(probe: &mut Worker) -> LayoutPoints {
    let mut points = Vec::new();
    for across in [false, true] {
        for (hold, legs) in [(false, false), (true, false), (false, true), (true, true)] {
            let scenario = Scenario {
                hold,
                legs,
                across,
                ..Scenario::new(Prelude::Crash(usize::MAX), &[Kind::Cancel])
            };
            let solo = probe.run(&scenario, &mut Chooser::Fixed(vec![])).await;
            let n = solo.trace.len();
            assert!(n > 5, "owner points: {:?}", solo.trace);
            let what = match (hold, legs) {
                (true, true) => "multi-leg hold",
                (true, _) => "hold",
                (_, true) => "multi-leg transfer",
                _ => "transfer",
            };
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
    let of = |at: usize| CrashPoints {
        transfer: points[at],
        hold: points[at + 1],
        legs: points[at + 2],
        legs_hold: points[at + 3],
    };
    LayoutPoints {
        within: of(0),
        across: of(4),
    }
}

/// Runs `jobs` on `workers` workers at once, the first of them `probe`, the others each
/// with databases of their own on the servers at `uris`; what they found.
pub async fn explore(
    probe: Worker,
    jobs: VecDeque<Job>,
    search: Search,
    workers: usize,
    uris: &[String; 2],
    all_points: bool,
) -> Report {
    let jobs = Arc::new(Mutex::new(jobs));
    let report = Arc::new(Mutex::new(Report::default()));
    let mut handles = vec![tokio::spawn(work(
        probe,
        jobs.clone(),
        report.clone(),
        search,
    ))];
    for i in 1..workers {
        let worker = Worker::new(uris.clone(), i, all_points).await;
        handles.push(tokio::spawn(work(
            worker,
            jobs.clone(),
            report.clone(),
            search,
        )));
    }
    for h in handles {
        h.await.expect("worker");
    }
    Arc::try_unwrap(report).ok().unwrap().into_inner().unwrap()
}

/// Takes jobs from `jobs` until there is none left.
async fn work(
    mut worker: Worker,
    jobs: Arc<Mutex<VecDeque<Job>>>,
    report: Arc<Mutex<Report>>,
    search: Search,
) {
    loop {
        let Some(job) = jobs.lock().unwrap().pop_front() else {
            return;
        };
        match job {
            Job::Exhaustive(scenario) => {
                explore_exhaustively(&mut worker, &scenario, &report, search).await;
            }
            Job::Random(seed) => {
                let scenario = random_scenario(seed, search.crash_points);
                let run = worker.run(&scenario, &mut Chooser::Random(seed)).await;
                if search.verbose {
                    println!("{}", describe(&scenario, &run, Some(seed)));
                }
                let failed = !run.violations.is_empty();
                {
                    let mut r = report.lock().unwrap();
                    r.random += 1;
                    r.legs_random += u64::from(scenario.legs);
                    r.legs_hold_random += u64::from(scenario.legs && scenario.hold);
                    r.split_random += u64::from(run.splits > 0);
                    r.tally(&run);
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
                r.tally(&run);
                if !run.violations.is_empty() {
                    r.violations.push(describe(&scenario, &run, None));
                }
            }
        }
    }
}

/// Every ordering of `scenario` within the preemption bound, depth-first, up to the
/// limit of schedules.
async fn explore_exhaustively(
    worker: &mut Worker,
    scenario: &Scenario,
    report: &Mutex<Report>,
    search: Search,
) {
    let mut prefix: Vec<usize> = Vec::new();
    let mut count = 0u64;
    let complete = loop {
        let run = worker
            .run(scenario, &mut Chooser::Fixed(prefix.clone()))
            .await;
        count += 1;
        {
            let mut r = report.lock().unwrap();
            r.tally(&run);
            r.split_exhaustive += u64::from(run.splits > 0);
        }
        if !run.violations.is_empty() {
            report
                .lock()
                .unwrap()
                .violations
                .push(describe(scenario, &run, None));
            worker.new_database().await;
        }
        let Some(next) = next_prefix(run.decisions, search.preemption_bound) else {
            break true;
        };
        prefix = next;
        if search.dfs_limit > 0 && count >= search.dfs_limit {
            break false;
        }
    };
    let mut r = report.lock().unwrap();
    r.exhaustive += count;
    if scenario.legs {
        r.legs_exhaustive += count;
    }
    if scenario.legs && scenario.hold {
        r.legs_hold_exhaustive += count;
    }
    r.per_scenario.push((scenario.to_string(), count, complete));
}

/// The choices of the next schedule after one that made `decisions`: the last decision
/// with an untried option, moved on, within the preemption bound (any other option of a
/// preemptive decision spends a preemption, and so does a split, see
/// [`Decision::preempts`]). `None` when there is none left.
fn next_prefix(mut decisions: Vec<Decision>, preemption_bound: usize) -> Option<Vec<usize>> {
    let d = &mut decisions;
    while let Some(last) = d.last() {
        let before = d[..d.len() - 1].iter().filter(|d| d.preempts()).count();
        let spends = Decision { chosen: 1, ..*last }.preempts();
        if last.chosen + 1 < last.options && before + usize::from(spends) <= preemption_bound {
            break;
        }
        d.pop();
    }
    let last = d.last_mut()?;
    last.chosen += 1;
    Some(d.iter().map(|d| d.chosen).collect())
}
