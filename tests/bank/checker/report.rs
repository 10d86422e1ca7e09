//! What a run did, told as it ends ([`Report::what_happened`], [`Report::summary`]), and
//! its verdict ([`Report::verdict`]): the load must have meant something, and no
//! invariant may have been broken.

use std::collections::BTreeMap;

use transfer_service::domain::{Transfer, TransferState};

use super::history::History;
use super::{Checked, End, Sampled};
use crate::INSTANCES;
use crate::deployments::Layout;
use crate::nemesis::{Havoc, Network, skews};
use crate::workload::CLIENTS;

/// A run as its report tells it.
pub struct Report<'a> {
    pub layout: Layout,
    /// Of load.
    pub seconds: u64,
    pub havoc: &'a Havoc,
    /// For the proxies' counts.
    pub network: &'a Network,
    pub end: &'a End,
    pub history: &'a History,
}

/// How the stored transfers ended, which the verdict asks of.
pub struct Happened {
    /// Transfers (holds aside) by outcome.
    outcomes: BTreeMap<String, u64>,
    /// Holds by outcome.
    hold_outcomes: BTreeMap<String, u64>,
    /// Transfers across two deployments.
    cross: usize,
}

/// The stored transfers by outcome: the transfers (holds aside), then the holds.
fn outcomes(transfers: &[Transfer]) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
    let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
    let mut hold_outcomes: BTreeMap<String, u64> = BTreeMap::new();
    for t in transfers {
        if let Some(hold) = t.hold {
            let outcome = match (t.state, t.reason) {
                (TransferState::Done, _) if t.amount == hold.amount => {
                    "captured in full".to_owned()
                }
                (TransferState::Done, _) => "captured in part".to_owned(),
                (state, Some(reason)) => format!("{state} ({reason})"),
                (state, None) => state.to_string(),
            };
            // Multi-leg holds apart.
            let outcome = match t.legs {
                Some(_) => format!("{outcome}, multi-leg"),
                None => outcome,
            };
            *hold_outcomes.entry(outcome).or_default() += 1;
            continue;
        }
        let outcome = match (t.state, t.reason, t.reverses) {
            (TransferState::Done, _, Some(_)) => "done (reversal)".to_owned(),
            (TransferState::Done, _, None) => "done".to_owned(),
            (state, Some(reason), Some(_)) => format!("{state} ({reason}, reversal)"),
            (state, Some(reason), None) => format!("{state} ({reason})"),
            (state, None, _) => state.to_string(),
        };
        // Multi-leg transfers apart, with their number of legs.
        let outcome = match t.legs.as_deref() {
            Some(legs) => format!("{outcome}, {} legs", legs.legs().len()),
            None => outcome,
        };
        *outcomes.entry(outcome).or_default() += 1;
    }
    (outcomes, hold_outcomes)
}

impl Report<'_> {
    /// Prints what happened: the load, the nemesis, how long the end took, the
    /// transfers and holds by outcome, the logs, the samples and the client answers.
    pub fn what_happened(&self, sampled: &Sampled) -> Happened {
        let (layout, seconds, history) = (self.layout, self.seconds, self.history);
        let (killed, renamed) = (self.havoc.killed, self.havoc.renamed);
        let (terminal_after, at_rest_after) = (self.end.terminal_after, self.end.at_rest_after);
        let transfers = &self.end.transfers;
        let (outcomes, hold_outcomes) = outcomes(transfers);
        let hold_plans: BTreeMap<&str, u64> = history
            .hold_plans
            .iter()
            .map(|(plan, n)| (plan.label(), *n))
            .collect();
        let restarts = match self.havoc.outage.as_ref().map(|o| o.deployment) {
            Some(deployment) => format!("1 database server restart (deployment {deployment})"),
            None => "no database server restart".to_owned(),
        };
        println!(
            "bank test ({layout:?}, deployments {:?}): {seconds} s of load, {CLIENTS} clients, \
             {INSTANCES} instances; {killed} instances killed with SIGKILL and restarted \
             ({renamed} under a new name), {restarts}; every transfer terminal \
             {terminal_after:?} after the load stopped, at rest (reversals, fences) \
             {at_rest_after:?} later",
            layout.deployments()
        );
        println!("transfers (holds aside) by outcome: {outcomes:?}");
        println!(
            "holds: {} stored, by outcome {hold_outcomes:?}; holds answered held, by plan \
             {hold_plans:?}; captures and voids with an unknown outcome: {}",
            hold_outcomes.values().sum::<u64>(),
            history.resolves_unknown
        );
        let cross = transfers
            .iter()
            .filter(|t| t.source_deployment != t.destination_deployment)
            .count();
        let mut per_log: BTreeMap<&str, usize> = BTreeMap::new();
        for t in transfers {
            *per_log.entry(t.source_deployment.as_str()).or_default() += 1;
        }
        println!(
            "transfers by log {per_log:?}; {cross} of {} across two deployments",
            transfers.len()
        );
        println!(
            "accounts sampled {} times, a deployment at a time ({} reads failed)",
            sampled.samples, sampled.failed
        );
        println!("client answers: {:?}", history.answers);
        Happened {
            outcomes,
            hold_outcomes,
            cross,
        }
    }

    /// Prints what the checks found: the transfers of the requests answered wrongly,
    /// the unknown outcomes, what went on while a deployment was down, the counts, and
    /// the summary line (answers, checks, the proxies' faults, the skews, the cancels
    /// that raced the recovery).
    pub fn summary(&self, checked: &Checked) {
        let (history, transfers) = (self.history, &self.end.transfers);
        let checks = &checked.checks;
        for reference in &history.suspects {
            let stored: Vec<&Transfer> = transfers
                .iter()
                .filter(|t| t.reference.as_ref().map(|r| r.as_str()) == Some(reference.as_str()))
                .collect();
            println!("request {reference}, answered wrongly, made {stored:#?}");
        }
        println!(
            "requests without a definitive answer: {} ({:?}); never sent: {}; cancels \
             with an unknown outcome: {}",
            history.unanswered.len(),
            checked.unknown,
            history.unsent,
            history.cancels_unknown
        );
        if let (Some(outage), Some(while_down), true) = (
            &self.havoc.outage,
            &checked.while_down,
            self.layout.deployments().len() > 1,
        ) {
            println!(
                "while deployment {} was down ({:?}), answered 201 between the other \
                 deployments' accounts: {while_down:?}",
                outage.deployment,
                outage.until - outage.from
            );
        }
        println!(
            "{} transfers, {} answered done, {} idempotency keys, {} violations",
            transfers.len(),
            history.done.len(),
            history.keys.len(),
            checks.violations.len()
        );
        let answers: u64 = history.answers.values().sum();
        let checked_count: u64 = checks.counts.values().sum();
        println!(
            "summary: {answers} client answers {:?}; {checked_count} checks of {} invariants {:?}; \
             {} violations; faults: {}; clock skews: {}; transfers of killed instances canceled \
             while recovered: {:?}",
            history.answers,
            checks.counts.len(),
            checks.counts,
            checks.violations.len(),
            self.network.counts().join(", "),
            skews().join(", "),
            history.recovery_targets
        );
    }

    /// The verdict: enough transfers made, every way a hold can end seen, enough
    /// instances killed, (across three deployments) transfers both across and within,
    /// and some made while one was down; and no violation.
    pub fn verdict(&self, happened: &Happened, checked: &Checked) {
        let Happened {
            outcomes,
            hold_outcomes,
            cross,
        } = happened;
        let (cross, transfers) = (*cross, &self.end.transfers);
        let killed = self.havoc.killed;
        let checks = &checked.checks;
        assert!(
            outcomes.get("done").copied().unwrap_or(0) > 50,
            "the load made too few transfers to mean anything: {outcomes:?}"
        );
        for outcome in [
            "captured in full",
            "captured in part",
            "canceled (voided)",
            "canceled (expired)",
        ] {
            assert!(
                hold_outcomes.get(outcome).copied().unwrap_or(0) > 0,
                "no hold ended {outcome}: {hold_outcomes:?}"
            );
        }
        assert!(killed >= 3, "the nemesis killed too few instances");
        if self.layout == Layout::ThreeDeployments {
            assert!(
                cross > 0 && cross < transfers.len(),
                "the transfers should mostly cross deployments, and some stay within one: \
                 {cross} of {} cross",
                transfers.len()
            );
            if let Some(while_down) = &checked.while_down {
                assert!(
                    while_down.transfers > 0,
                    "no transfer between the two other deployments was made while one was down"
                );
            }
        }
        assert!(
            checks.violations.is_empty(),
            "violations: {:#?}",
            checks.violations
        );
    }
}
