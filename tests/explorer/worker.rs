//! A worker: one database of its own on each of two servers, where it runs schedules one
//! after the other ([`Worker::run`]), each from scratch on fresh accounts: the workload's
//! actors, driven by the nemesis, then everything let finish and checked.

use std::sync::atomic::{AtomicU64, Ordering};

use mongodb::bson::{DateTime, Document, doc};
use support::ledger::Ledger;
use tokio_util::sync::CancellationToken;
use transfer_service::domain::{
    Account, AccountId, DeploymentName, Transfer, TransferFilter, TransferState,
};
use transfer_service::service::TransferService;
use transfer_service::store::{DEFAULT_GROUP_COMMIT_WRITES, Deployments, Store};

use crate::checker::{self, Run};
use crate::nemesis::{self, Actors, Chooser, crash_owner};
use crate::scenario::{LEASE, Prelude, Scenario};
use crate::workload::{Kind, run_alone, set_up};

/// A worker: one database of its own on each of two servers (two deployments), so that
/// its sweeps see only its schedules.
pub struct Worker {
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

/// The two deployments' names: a (and c) lives on the first, b on the second in
/// `across:` scenarios.
pub const DEPLOYMENTS: [&str; 2] = ["one", "two"];

pub fn account_id(s: &str) -> AccountId {
    AccountId::parse(s).unwrap()
}

impl Worker {
    pub async fn new(uris: [String; 2], index: usize, all_points: bool) -> Worker {
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
    pub async fn new_database(&mut self) {
        self.stores = fresh_stores(&self.uris).await;
        self.databases += 1;
    }

    fn bank(&self, id: &str) -> TransferService {
        TransferService::new(Deployments::new(self.stores.to_vec()), id.to_owned(), LEASE)
    }

    /// The bank of the actor (or prelude owner) of instance id `id`: a sibling of
    /// `process` in a `same:` scenario, else an instance of its own.
    fn bank_of(&self, process: Option<&TransferService>, id: &str) -> TransferService {
        match process {
            Some(process) => process.sibling(id),
            None => self.bank(id),
        }
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

    /// Every transfer touching any of `accounts` (as a party too), once each.
    async fn transfers_of(&self, accounts: &[&str]) -> Vec<Transfer> {
        let mut found: Vec<Transfer> = Vec::new();
        for account in accounts {
            let filter = TransferFilter {
                account: Some(AccountId::parse(account).unwrap()),
                ..TransferFilter::default()
            };
            for store in &self.stores {
                let listed = store.transfers().list_transfers(&filter, 10_000).await;
                for t in listed.expect("read transfers") {
                    if found.iter().all(|f| f.id != t.id) {
                        found.push(t);
                    }
                }
            }
        }
        found
    }

    /// The accounts' ledgers, each read from the deployment that keeps it.
    async fn ledger_of(&self, accounts: &[&str]) -> Ledger {
        let mut ledger = Ledger::default();
        for store in &self.stores {
            let read = support::ledger::read(store.database(), Some(accounts)).await;
            ledger.merge(read.expect("read the ledger"));
        }
        ledger
    }

    async fn account(&self, id: &str) -> Account {
        let id = AccountId::parse(id).unwrap();
        for store in &self.stores {
            if let Some(account) = store.accounts().account(&id).await.unwrap() {
                return account;
            }
        }
        panic!("no account {id}")
    }

    /// Runs one schedule of `scenario` with choices from `chooser`: its accounts, its
    /// prelude, its actors under the scheduler, then everything let finish and checked.
    pub async fn run(&mut self, scenario: &Scenario, chooser: &mut Chooser) -> Run {
        self.schedules += 1;
        let tag = format!("w{}s{}", self.index, self.schedules);
        let setup = set_up(&self.bank(&format!("{tag}-setup")), &tag, scenario).await;
        let a = &setup.a;
        let mut run = Run::default();
        // In a `same:` scenario, the one process whose tasks the actors are.
        let process = scenario.same.then(|| {
            TransferService::new(
                Deployments::new(self.stores.to_vec()),
                format!("{tag}-process"),
                scenario.lease(),
            )
        });
        match scenario.prelude {
            Prelude::Nothing => {}
            Prelude::Done | Prelude::Held => {
                let owner = self.bank_of(process.as_ref(), &format!("{tag}-owner0"));
                let answer = run_alone(&owner, setup.new_transfer.clone()).await;
                run.answers.push((Kind::Owner, answer));
            }
            Prelude::Crash(k) => {
                let id = format!("{tag}-owner0");
                let owner = self.bank(&id);
                let at = (k, nemesis::quiet(scenario));
                if !crash_owner(owner, &id, setup.new_transfer.clone(), at, &mut run).await {
                    return run;
                }
                // Nothing of the owner's is in flight: the lease may lapse at once.
                self.age(doc! { "source": a }).await;
            }
        }

        let bank_of = |id: &str| self.bank_of(process.as_ref(), id);
        let mut actors = Actors::spawn(scenario, &tag, self.all_points, &setup, bank_of);
        let stuck = actors.drive(scenario, chooser, &mut run).await;
        actors.finish(scenario, stuck.as_ref(), &mut run).await;
        if stuck.is_some() {
            return run;
        }

        let cleaner = self.bank(&format!("{tag}-cleaner"));
        let ids = setup.accounts();
        self.let_everything_finish(&cleaner, &ids, &mut run).await;
        let mut accounts = Vec::new();
        for id in &ids {
            accounts.push(self.account(id).await);
        }
        let transfers = self.transfers_of(&ids).await;
        let ledger = self.ledger_of(&ids).await;
        checker::check(scenario, &accounts, &transfers, &ledger, &mut run);
        if scenario.hold {
            self.void_holds_left_held(&cleaner, &ids, &mut run).await;
        }
        run
    }

    /// Lets everything finish: a lease passes (no actor is left, so nothing is in
    /// flight), then a sweep finishes what is unfinished, collects fences and finishes
    /// interrupted reversals. Twice, as a sweep may leave work for the next one.
    async fn let_everything_finish(&self, cleaner: &TransferService, ids: &[&str], run: &mut Run) {
        for round in 0..2 {
            if round > 0 && self.clean(ids).await {
                break;
            }
            self.age(doc! { "$or": [
                { "source": { "$in": ids } },
                { "destination": { "$in": ids } },
                { "parties.account": { "$in": ids } },
            ] })
            .await;
            if let Err(e) = transfer_service::sweeper::sweep_once(
                &cleaner.recovery(),
                &CancellationToken::new(),
            )
            .await
            {
                run.violations.push(format!("final sweep failed: {e}"));
            }
        }
    }

    /// A hold left `held` would expire (`HOLD_EXPIRY`) during a later schedule of this
    /// worker, whose sweeps would then expire it: foreign writes in that schedule, and
    /// a wrong count in its expiry's answer. Voided now, once checked.
    async fn void_holds_left_held(&self, cleaner: &TransferService, ids: &[&str], run: &mut Run) {
        for t in self.transfers_of(ids).await {
            if t.state == TransferState::Held {
                if let Err(e) = cleaner.requests().void(t.id).await {
                    run.violations
                        .push(format!("voiding hold {} left held failed: {e:?}", t.id));
                }
            }
        }
    }

    /// Whether nothing of the schedule is left for a sweep to do (a hold `held` waits
    /// for its client, not for a sweep).
    async fn clean(&self, ids: &[&str]) -> bool {
        let transfers = self.transfers_of(ids).await;
        transfers
            .iter()
            .all(|t| t.state.is_at_rest() && !t.fenced && !t.reversing)
    }
}
