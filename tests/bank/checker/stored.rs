//! What is stored once everything is quiet, on its own: where each thing is
//! ([`check_placement`]), the money ([`check_balances`]), how every transfer ended
//! ([`check_ends`]) and the reversals ([`check_reversals`]).

use std::collections::{HashMap, HashSet};

use transfer_service::domain::{Account, Transfer, TransferId, TransferState};

use super::Checks;
use crate::deployments::Layout;
use crate::workload::{ACCOUNTS, OPENING_BALANCE, account};

/// Where every stored thing is: each account once, on the deployment the layout puts it
/// on; each transfer in one log only, its source's, naming its destination's deployment.
pub fn check_placement(
    layout: Layout,
    transfers: &[Transfer],
    accounts: &[Account],
    checks: &mut Checks,
) {
    let mut stored: HashMap<&str, Vec<&str>> = HashMap::new();
    for a in accounts {
        stored
            .entry(a.id.as_str())
            .or_default()
            .push(a.deployment.as_str());
    }
    for i in 0..ACCOUNTS {
        let id = account(i);
        let home = layout.home_of(&id);
        let on = stored.get(id.as_str()).cloned().unwrap_or_default();
        checks.check(
            "every account is stored once, on the deployment it was opened on",
            on == [home],
            || format!("{id}, opened on {home}, is stored on {on:?}"),
        );
    }
    let mut logs: HashMap<TransferId, Vec<&str>> = HashMap::new();
    for t in transfers {
        logs.entry(t.id)
            .or_default()
            .push(t.source_deployment.as_str());
        checks.check(
            "a transfer is logged on its source's deployment",
            t.source_deployment.as_str() == layout.home_of(t.source.as_str()),
            || {
                format!(
                    "{} from {} (on {}) is logged on {}",
                    t.id,
                    t.source,
                    layout.home_of(t.source.as_str()),
                    t.source_deployment
                )
            },
        );
        checks.check(
            "a transfer names its destination's deployment",
            t.destination_deployment.as_str() == layout.home_of(t.destination.as_str()),
            || format!("{t:?}"),
        );
        for party in t.legs.iter().flat_map(|l| l.parties()) {
            checks.check(
                "a multi-leg transfer names each party's deployment",
                party.deployment.as_str() == layout.home_of(party.account.as_str()),
                || format!("{t:?}"),
            );
        }
    }
    for (id, on) in &logs {
        checks.check(
            "a transfer id is in one log only, once",
            on.len() == 1,
            || format!("{id} is logged on {on:?}"),
        );
    }
}

/// The money: the total is unchanged; every balance is its opening balance plus the
/// `done` transfers into it minus those out of it; no balance is negative; nothing is
/// left pending, marked or fenced on any account.
pub fn check_balances(transfers: &[Transfer], accounts: &[Account], checks: &mut Checks) {
    let total: i64 = accounts.iter().map(|a| a.balance).sum();
    checks.check(
        "total balance unchanged",
        total == OPENING_BALANCE * ACCOUNTS as i64,
        || format!("total balance {total}"),
    );
    let mut expected: HashMap<&str, i64> = accounts
        .iter()
        .map(|a| (a.id.as_str(), OPENING_BALANCE))
        .collect();
    for t in transfers.iter().filter(|t| t.state == TransferState::Done) {
        match t.legs.as_deref() {
            // Each party by its net.
            Some(legs) => {
                for p in legs.parties() {
                    *expected.get_mut(p.account.as_str()).unwrap() += p.net;
                }
            }
            None => {
                *expected.get_mut(t.source.as_str()).unwrap() -= t.amount.minor_units();
                *expected.get_mut(t.destination.as_str()).unwrap() += t.amount.minor_units();
            }
        }
    }
    for a in accounts {
        checks.check("no negative balance", a.balance >= 0, || {
            format!("{} is negative: {}", a.id, a.balance)
        });
        checks.check(
            "no pendingTransactions left",
            a.pending_transactions.is_empty(),
            || format!("{} keeps markers {:?}", a.id, a.pending_transactions),
        );
        checks.check(
            "no pendingDebits or pendingCredits left",
            a.pending_debits == 0 && a.pending_credits == 0,
            || {
                format!(
                    "{} keeps pendingDebits {} and pendingCredits {}",
                    a.id, a.pending_debits, a.pending_credits
                )
            },
        );
        checks.check(
            "no room of a multi-leg transfer left (incoming)",
            a.incoming == 0,
            || format!("{} keeps incoming {}", a.id, a.incoming),
        );
        checks.check(
            "no fencedTransactions left after a lease and a few sweeps",
            a.fenced_transactions.is_empty(),
            || format!("{} keeps fences {:?}", a.id, a.fenced_transactions),
        );
        checks.check(
            "balance equals opening plus done transfers",
            a.balance == expected[a.id.as_str()],
            || {
                format!(
                    "{} holds {} but its done transfers say {}",
                    a.id,
                    a.balance,
                    expected[a.id.as_str()]
                )
            },
        );
    }
    let (pending_debits, pending_credits): (i64, i64) = accounts
        .iter()
        .map(|a| (a.pending_debits, a.pending_credits))
        .fold((0, 0), |(d, c), (ad, ac)| (d + ad, c + ac));
    checks.check(
        "the pendingDebits sum equals the pendingCredits sum",
        pending_debits == pending_credits,
        || format!("pendingDebits sum to {pending_debits}, pendingCredits to {pending_credits}"),
    );
}

/// Every transfer ended: terminal, a hold captured (at most what it held) or canceled,
/// no `fenced` flag left; and every transfer answered `done` still is.
pub fn check_ends(
    transfers: &[Transfer],
    by_id: &HashMap<TransferId, &Transfer>,
    done: &HashSet<String>,
    checks: &mut Checks,
) {
    for t in transfers {
        checks.check("every transfer terminal", t.state.is_terminal(), || {
            format!("{t:?} is not terminal")
        });
        if let Some(hold) = t.hold {
            checks.check(
                "a hold ends captured (at most what it held) or canceled (its amount the held one)",
                match t.state {
                    TransferState::Done => t.amount <= hold.amount,
                    TransferState::Canceled => t.amount == hold.amount && t.reason.is_some(),
                    _ => false,
                },
                || format!("{t:?}"),
            );
        }
        checks.check(
            "no transfer left marked fenced after a lease and a few sweeps",
            !t.fenced,
            || format!("{t:?} is still marked fenced"),
        );
    }
    for id in done {
        let state = by_id.get(&id.parse().unwrap()).map(|t| t.state);
        checks.check(
            "answered done is still done",
            state == Some(TransferState::Done),
            || format!("{id} was answered done and is now {state:?}"),
        );
    }
}

/// The reversal invariants, over every stored transfer.
pub fn check_reversals(
    transfers: &[Transfer],
    by_id: &HashMap<TransferId, &Transfer>,
    checks: &mut Checks,
) {
    let mut done_reversals: HashMap<TransferId, Vec<TransferId>> = HashMap::new();
    for r in transfers {
        let Some(original_id) = r.reverses else {
            continue;
        };
        let original = by_id.get(&original_id).copied();
        checks.check(
            "a reversal reverses a done original",
            original.is_some_and(|o| o.state == TransferState::Done),
            || format!("reversal {r:?} reverses {original:?}"),
        );
        let Some(original) = original else { continue };
        let legs_mirrored = match (r.legs.as_deref(), original.legs.as_deref()) {
            (None, None) => true,
            (Some(back), Some(legs)) => *back == legs.reversed(),
            _ => false,
        };
        checks.check(
            "a reversal mirrors its original",
            r.amount == original.amount
                && r.source == original.destination
                && r.destination == original.source
                && legs_mirrored
                && r.currency == original.currency,
            || format!("reversal {r:?} of {original:?}"),
        );
        if r.state == TransferState::Done {
            checks.check(
                "a done reversal is its original's reversedBy",
                original.reversed_by == Some(r.id),
                || format!("done reversal {} but its original is {original:?}", r.id),
            );
            done_reversals.entry(original_id).or_default().push(r.id);
        }
    }
    for t in transfers {
        let done = done_reversals.get(&t.id).map_or(0, Vec::len);
        checks.check("at most one done reversal per transfer", done <= 1, || {
            format!("{} reversed by {:?}", t.id, done_reversals[&t.id])
        });
        if let Some(reversal_id) = t.reversed_by {
            let reversal = by_id.get(&reversal_id).copied();
            checks.check(
                "reversedBy names a done reversal of the transfer",
                reversal
                    .is_some_and(|r| r.state == TransferState::Done && r.reverses == Some(t.id)),
                || format!("{t:?} is reversed by {reversal:?}"),
            );
        }
        checks.check("no transfer left reversing", !t.reversing, || {
            format!("{t:?} is still reversing")
        });
        if t.state == TransferState::Canceled {
            checks.check(
                "a canceled transfer has a reason",
                t.reason.is_some(),
                || format!("{t:?} is canceled without a reason"),
            );
        }
    }
}
