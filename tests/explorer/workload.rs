//! The workload: the actors of a schedule and what each does ([`act`]), on two accounts
//! a and b opened for the schedule, and a third, c, for a multi-leg one ([`set_up`]).
//!
//! A scenario is a transfer scenario (the owner transfers [`AMOUNT`] from a to b), a
//! hold scenario (named with the prefix `hold:`: the owner creates a hold of [`AMOUNT`]
//! from a to b, expiring in [`HOLD_EXPIRY`]), a multi-leg scenario (prefix `legs:`:
//! the owner makes the multi-leg transfer of [`legs`], a pays b [`AMOUNT`] and b pays c
//! half of it; its reversal has two paying parties, b and c, and one receiving, a) or a
//! multi-leg hold scenario (prefix `hold:legs:`: the owner creates a hold of those legs,
//! expiring in [`HOLD_EXPIRY`]: a reserves its net out, b and c theirs in; captured
//! whole, its reversal is the multi-leg transfer's). The actors of a hold scenario: `capture` captures all of the hold, `void` voids it,
//! `expire` makes the clock reach its `expiresAt` (a raw write sets it into the past,
//! safe at any moment as time passing is) and then sweeps, which expires it if still
//! `held`; `cancel` cancels it (voids it if `held`, rolls it back if pending, reverses
//! it once captured). Each of them answers "nothing recorded yet" when it comes before
//! the hold is recorded. The prelude `held:` runs the hold to `held` first, as `done:`
//! runs a transfer to `done`.
//!
//! Each actor is a `TransferService` with its own instance id; in a `same:` scenario the actors (and
//! the owner of a `done:` or `held:` prelude) are `TransferService::sibling`s of one process: they
//! share its owner in `application`, its drive locks, its record of unanswered writes and
//! its admission, and each names its points with an instance id of its own, so that the
//! scheduler tells them apart. The actor `lapse` waits (really: time passing is safe at
//! any moment) until the lease of every unfinished transfer has lapsed and then sweeps:
//! the process's own sweeper claiming back a transfer of its own. The actor `net` sends
//! what is held back (see [`crate::nemesis`]).

use std::time::Duration;

use mongodb::bson::{DateTime, Document, doc};
use tokio_util::sync::CancellationToken;
use transfer_service::domain::{
    AccountId, Amount, Currency, DeploymentName, Leg, Legs, OpeningBalance, Scope, Transfer,
    TransferFilter,
};
use transfer_service::failpoints;
use transfer_service::service::{
    Completion, NewAccount, NewTransfer, ServiceError, TransferService,
};

use crate::checker::{Answer, Refused};
use crate::scenario::Scenario;
use crate::worker::{DEPLOYMENTS, account_id};

pub const OPENING: i64 = 1000;
pub const AMOUNT: i64 = 300;
/// How long a hold of a hold scenario lasts: far longer than a schedule, so that a hold
/// only expires when a `Kind::Expire` actor makes it.
const HOLD_EXPIRY: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `bank.transfer` of AMOUNT from a to b (a hold, in a hold scenario; the multi-leg
    /// transfer of [`legs`], in a multi-leg scenario; a hold of those legs, in a
    /// multi-leg hold scenario).
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
    pub fn name(self) -> &'static str {
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

    pub fn parse(s: &str) -> Kind {
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

/// A schedule's accounts, and what its owner asks for: a transfer (or a hold) of
/// [`AMOUNT`] from a to b, or the multi-leg transfer (or hold) of [`legs`] over a, b and
/// c.
pub struct Setup {
    pub a: String,
    pub b: String,
    /// The third account, of a multi-leg scenario only.
    pub c: Option<String>,
    pub new_transfer: NewTransfer,
}

impl Setup {
    /// Every account of the schedule: a, b, and c if there is one.
    pub fn accounts(&self) -> Vec<&str> {
        let mut all = vec![self.a.as_str(), self.b.as_str()];
        all.extend(self.c.as_deref());
        all
    }
}

/// The legs of a multi-leg scenario: a pays b [`AMOUNT`], b pays c half of it. Parties: a
/// -AMOUNT (pays), b +AMOUNT/2 and c +AMOUNT/2 (receive: b is paid more than it passes
/// on); the reversal's: b and c -AMOUNT/2 each (pay), a +AMOUNT (receives). Every
/// account opens with [`OPENING`], enough for all of it.
pub fn legs(a: &str, b: &str, c: &str) -> Legs {
    let leg = |source: &str, destination: &str, amount: i64| Leg {
        source: account_id(source),
        destination: account_id(destination),
        amount: Amount::parse(amount).unwrap(),
    };
    Legs::new(vec![leg(a, b, AMOUNT), leg(b, c, AMOUNT / 2)]).expect("legs")
}

/// Opens the accounts of the schedule `tag` through `setup` with [`OPENING`] each: a on
/// the first deployment, b on the second in an `across:` scenario, c (of a multi-leg
/// scenario) on the first, so that in an `across:` one the parties span both servers,
/// those of the transfer (logged with a) and those of its reversal (logged with b).
pub async fn set_up(setup: &TransferService, tag: &str, scenario: &Scenario) -> Setup {
    let (a, b) = (format!("{tag}-a"), format!("{tag}-b"));
    let c = scenario.legs.then(|| format!("{tag}-c"));
    let mut placed = vec![
        (&a, DEPLOYMENTS[0]),
        (&b, DEPLOYMENTS[scenario.across as usize]),
    ];
    placed.extend(c.as_ref().map(|c| (c, DEPLOYMENTS[0])));
    for (id, deployment) in placed {
        setup
            .book()
            .open_account(NewAccount {
                tenant: None,
                id: Some(account_id(id)),
                name: None,
                balance: OpeningBalance::parse(OPENING).unwrap(),
                currency: Currency::usd(),
                deployment: Some(DeploymentName::parse(deployment).unwrap()),
            })
            .await
            .expect("open account");
    }
    let new_transfer = match &c {
        Some(c) => NewTransfer {
            hold: scenario.hold.then_some(HOLD_EXPIRY),
            ..NewTransfer::with_legs(legs(&a, &b, c), None)
        },
        None => NewTransfer {
            source: account_id(&a),
            destination: account_id(&b),
            amount: Amount::parse(AMOUNT).unwrap(),
            legs: None,
            reference: None,
            hold: scenario.hold.then_some(HOLD_EXPIRY),
            scope: Scope::Platform,
        },
    };
    Setup {
        a,
        b,
        c,
        new_transfer,
    }
}

/// The owner of a `done:` or `held:` prelude, alone: runs the transfer (or the hold) to
/// its end.
pub async fn run_alone(owner: &TransferService, new_transfer: NewTransfer) -> Answer {
    let answer = owner
        .requests()
        .transfer(new_transfer, None, Completion::Wait)
        .await
        .map(|o| o.transfer)
        .map_err(|e| format!("{e:?}"));
    Answer::Owner(answer)
}

/// The scenario's transfer from a to b, if recorded yet (the oldest: a reversal goes the
/// other way, and only the owner makes a transfer from a to b; a multi-leg transfer's
/// `source` and `destination` are its first leg's, a to b, and its reversal's b to a).
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
        .transfers()
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
    let lease = chrono::TimeDelta::from_std(bank.driver().stale_after()).expect("a lease in range");
    loop {
        let mut left = Duration::ZERO;
        for log in bank.deployments().all() {
            let now = log.server_time().await.map_err(|e| format!("{e:?}"))?;
            for account in [a, b] {
                let filter = TransferFilter {
                    account: Some(AccountId::parse(account).unwrap()),
                    ..TransferFilter::default()
                };
                let listed = log.transfers().list_transfers(&filter, 10_000).await;
                for t in listed.map_err(|e| format!("{e:?}"))? {
                    let ends = t.last_modified + lease;
                    if !t.state.is_at_rest() && ends >= now {
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
pub async fn act(
    kind: Kind,
    bank: &TransferService,
    new: NewTransfer,
    a: &str,
    b: &str,
    holder: Option<&str>,
) -> Answer {
    let never = CancellationToken::new();
    let recovery = bank.recovery();
    let sweep = || transfer_service::sweeper::sweep_once(&recovery, &never);
    // 503: whether that is right depends on the actor (see `Answer::Unavailable`).
    let unavailable = |e: &ServiceError| {
        matches!(e, ServiceError::Unavailable(_)).then(|| Answer::Unavailable {
            held: false,
            error: e.to_string(),
        })
    };
    match kind {
        Kind::Owner => match bank.requests().transfer(new, None, Completion::Wait).await {
            Ok(o) => Answer::Owner(Ok(o.transfer)),
            Err(e) => unavailable(&e).unwrap_or(Answer::Owner(Err(format!("{e:?}")))),
        },
        Kind::Recoverer | Kind::Sweeper => {
            Answer::Sweep(sweep().await.map(|_| ()).map_err(|e| format!("{e:?}")))
        }
        Kind::Cancel => match scenario_transfer(bank, a, b).await {
            Err(e) => Answer::Cancel(Err(e)),
            Ok(None) => Answer::Cancel(Ok(None)),
            Ok(Some(t)) => match bank.requests().cancel(t.id).await {
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
        Kind::Capture => Answer::Capture(resolve(kind, bank, a, b).await),
        Kind::Void => Answer::Void(resolve(kind, bank, a, b).await),
        Kind::Expire => Answer::Expire(expire(bank, a, b).await),
    }
}

/// A capture (`kind` [`Kind::Capture`]) or a void of the scenario's hold, if inserted
/// yet.
async fn resolve(
    kind: Kind,
    bank: &TransferService,
    a: &str,
    b: &str,
) -> Result<Option<Transfer>, Refused> {
    match scenario_transfer(bank, a, b).await {
        Err(e) => Err(Refused::Other(e)),
        Ok(None) => Ok(None),
        Ok(Some(t)) if kind == Kind::Capture => bank
            .requests()
            .capture(t.id, None)
            .await
            .map(Some)
            .map_err(Refused::from),
        Ok(Some(t)) => bank
            .requests()
            .void(t.id)
            .await
            .map(Some)
            .map_err(Refused::from),
    }
}

/// The clock reaches the `expiresAt` of the scenario's hold: safe at any moment, as time
/// passing is; then a sweep, which expires it if it is still `held`. How many holds the
/// sweep expired.
async fn expire(bank: &TransferService, a: &str, b: &str) -> Result<usize, String> {
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
    transfer_service::sweeper::sweep_once(&bank.recovery(), &CancellationToken::new())
        .await
        .map(|r| r.holds_expired)
        .map_err(|e| format!("{e:?}"))
}
