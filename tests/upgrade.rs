//! The upgrade to one protocol: a one-leg transfer inserted by a version before it
//! (its document names no parties; its destination was credited by its own step, the
//! commit point of that protocol) and left in flight at the upgrade, at each point that
//! version could stop at, is finished by the new binary's sweeper as that version would
//! have finished it: forward to `done` once its credit could have landed, back to
//! `canceled` on a rollback, every balance conserved, no marker left, and the ledger the
//! one its end calls for.
//!
//! The stopped version's documents are written here with the store's own writes, the
//! same ones that version made (its debit and credit, `pending -> applied`, its marker
//! pulls, its undos), by an owner that is gone; then a new instance recovers them. Every
//! case is tried with both accounts on one deployment and across two.

use std::time::{Duration, Instant};

use serde_json::json;
use support::ledger::{self, Ledger};
use support::process::{Instance, InstanceConfig};
use support::values::{account, amount, from_now};
use support::{database_uris, fresh_database_name};
use transfer_service::domain::{CancelReason, DeploymentName, Transfer, TransferId, TransferState};
use transfer_service::store::Store;
use transfer_service::store::transfers::{Mover, StepFields};

const STALE_AFTER_MS: u64 = 1000;
const SWEEP_INTERVAL_MS: u64 = 100;
/// The owner the stopped version wrote.
const OLD: &str = "before-one-protocol/1";

/// Where the last version stopped a transfer of 200 from a (500) to b (0): the points of
/// its one-leg protocol (`after_insert` ... `after_pull`, then a rollback after its
/// credit was refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(clippy::enum_variant_names)] // the names of the points that version had
enum Stopped {
    AfterInsert,
    AfterPending,
    AfterDebit,
    AfterCredit,
    AfterApplied,
    AfterPull,
    /// The credit refused (b gone over its bound, say): `pending -> canceling`, the
    /// debit still on a.
    AfterCanceling,
    /// The rollback gave b's credit back (there was none), not a's debit yet.
    AfterUndoDestination,
    /// The rollback gave a's debit back; `canceling -> canceled` not written.
    AfterUndoSource,
}

struct Books {
    across: bool,
    database: String,
    /// a's deployment, which logs the transfer.
    a: Store,
    b: Store,
}

impl Books {
    async fn new(across: bool) -> Books {
        let database = fresh_database_name();
        let uris = database_uris(2);
        let connect = |name: &str, uri: &str| {
            let (name, uri, database) = (name.to_owned(), uri.to_owned(), database.clone());
            async move {
                Store::connect_with(DeploymentName::parse(&name).unwrap(), &uri, &database, 2)
                    .await
                    .unwrap()
            }
        };
        let (a, b) = if across {
            (connect("us", &uris[1]).await, connect("eu", &uris[0]).await)
        } else {
            let store = connect("default", &uris[0]).await;
            (store.clone(), store)
        };
        Books {
            across,
            database,
            a,
            b,
        }
    }

    async fn start_instance(&self, name: &str) -> Instance {
        let uris = database_uris(2);
        let mut config =
            InstanceConfig::new(support::service_binary!(), &uris[0], &self.database, name);
        if self.across {
            config.deployments = Some(format!("eu={},us={}", uris[0], uris[1]));
        }
        config.stale_after_ms = STALE_AFTER_MS;
        config.sweep_interval_ms = SWEEP_INTERVAL_MS;
        Instance::start(&config).await
    }

    /// Opens a (500) and b (0) through `instance`, each on its deployment.
    async fn open_accounts(&self, instance: &Instance) {
        let http = reqwest::Client::new();
        for (id, balance, deployment) in [("a", 500, "us"), ("b", 0, "eu")] {
            let mut body = json!({ "id": id, "balance": balance });
            if self.across {
                body["deployment"] = json!(deployment);
            }
            let r = http
                .post(format!("{}/accounts", instance.base))
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 201);
        }
    }

    async fn ledger(&self) -> Ledger {
        let mut ledger = ledger::read(self.a.database(), None).await.unwrap();
        if self.across {
            ledger.merge(ledger::read(self.b.database(), None).await.unwrap());
        }
        ledger
    }

    /// The state change `from -> to` as the stopped version's owner made it.
    async fn change(&self, id: TransferId, from: TransferState, to: TransferState) {
        let fields = match to {
            TransferState::Canceling => StepFields {
                reason: Some(CancelReason::BalanceOverflow),
                ..StepFields::default()
            },
            _ => StepFields::default(),
        };
        let changed = self
            .a
            .transfers()
            .change_state(id, from, to, Mover::Owner(OLD), fields)
            .await
            .unwrap();
        assert!(changed.is_some(), "{from} -> {to}");
    }

    /// Writes the transfer and its accounts as the last version left them at `stopped`.
    async fn leave(&self, stopped: Stopped) -> TransferId {
        use Stopped::*;
        use TransferState::*;
        let here = |name: &str| DeploymentName::parse(name).unwrap();
        let (source, destination) = if self.across {
            (here("us"), here("eu"))
        } else {
            (here("default"), here("default"))
        };
        let transfer = Transfer {
            credits_at_prepare: true,
            source_deployment: source,
            destination_deployment: destination,
            ..support::values::initial("a", "b", 200)
        };
        let id = transfer.id;
        self.a.transfers().insert_transfer(&transfer).await.unwrap();
        let rank = stopped as u8;
        if stopped == AfterInsert {
            return id;
        }
        self.change(id, Initial, Pending).await;
        // No copy of a step of the stopped version lands late here: a deadline far
        // away only keeps the writes from being refused while this test makes them.
        let deadline = from_now(60_000);
        if rank >= AfterDebit as u8 {
            let a = account("a");
            let debit = self.a.accounts().prepare(&a, id, -200, deadline).await;
            assert!(debit.unwrap().applied);
        }
        if stopped >= AfterCanceling {
            self.change(id, Pending, Canceling).await;
            if stopped == AfterUndoSource {
                let (a, value) = (account("a"), amount(200));
                let undone = self.a.accounts().undo(&a, id, source_side(), value).await;
                assert!(undone.unwrap());
            }
            return id;
        }
        if rank >= AfterCredit as u8 {
            let (b, value) = (account("b"), amount(200));
            let credit = self
                .b
                .accounts()
                .apply_credit(&b, id, value, deadline)
                .await;
            assert!(credit.unwrap().applied);
        }
        if rank >= AfterApplied as u8 {
            self.change(id, Pending, Applied).await;
        }
        if rank >= AfterPull as u8 {
            self.a
                .accounts()
                .pull_marker(&account("a"), id)
                .await
                .unwrap();
            self.b
                .accounts()
                .pull_marker(&account("b"), id)
                .await
                .unwrap();
        }
        id
    }
}

fn source_side() -> transfer_service::domain::Side {
    transfer_service::domain::Side::Source
}

impl PartialOrd for Stopped {
    fn partial_cmp(&self, other: &Stopped) -> Option<std::cmp::Ordering> {
        Some((*self as u8).cmp(&(*other as u8)))
    }
}

/// Leaves a transfer where the last version stopped, recovers it with a new instance,
/// and returns how it ended.
async fn upgrade_and_recover(across: bool, stopped: Stopped) -> TransferState {
    let books = Books::new(across).await;
    let mut opener = books.start_instance("opener").await;
    books.open_accounts(&opener).await;
    opener.kill();
    let id = books.leave(stopped).await;
    let left = books.a.transfers().transfer(id).await.unwrap().unwrap();
    assert!(left.credits_at_prepare, "inserted before one protocol");

    let started = Instant::now();
    let rescuer = books.start_instance("rescuer").await;
    let limit =
        Duration::from_millis(STALE_AFTER_MS + 2 * SWEEP_INTERVAL_MS) + Duration::from_secs(5);
    let left = limit.saturating_sub(started.elapsed());
    let store = &books.a;
    let transfer = support::poll_until(left, Duration::from_millis(50), async || {
        let t = store.transfers().transfer(id).await.unwrap().unwrap();
        if t.state.is_terminal() { Ok(t) } else { Err(t) }
    })
    .await
    .unwrap_or_else(|t| panic!("not recovered within {limit:?}: {:?}", t.state));
    let owner = transfer.owner.as_deref().unwrap_or_default();
    assert!(owner.starts_with("rescuer/"), "{owner}");

    let a = books
        .a
        .accounts()
        .account(&account("a"))
        .await
        .unwrap()
        .unwrap();
    let b = books
        .b
        .accounts()
        .account(&account("b"))
        .await
        .unwrap()
        .unwrap();
    let ended = transfer.state;
    let expected = match ended {
        TransferState::Done => (300, 200),
        _ => (500, 0),
    };
    assert_eq!((a.balance, b.balance), expected, "after {stopped:?}");
    assert_eq!(
        (a.incoming, b.incoming),
        (0, 0),
        "no room left after {stopped:?}"
    );
    assert!(
        a.pending_transactions.is_empty() && b.pending_transactions.is_empty(),
        "markers left after {stopped:?}"
    );
    let transfers = books
        .a
        .transfers()
        .list_transfers(&Default::default(), 10)
        .await
        .unwrap();
    let found = ledger::check_ledger(&books.ledger().await, &transfers, 500);
    assert!(
        found.violations.is_empty(),
        "the ledger after {stopped:?}: {:#?}",
        found.violations
    );
    drop(rescuer);
    ended
}

macro_rules! upgrade_test {
    ($name:ident, $stopped:expr, $expected:expr) => {
        mod $name {
            use super::*;

            #[tokio::test]
            async fn within_one_deployment() {
                assert_eq!(upgrade_and_recover(false, $stopped).await, $expected);
            }

            #[tokio::test]
            async fn across_deployments() {
                assert_eq!(upgrade_and_recover(true, $stopped).await, $expected);
            }
        }
    };
}

upgrade_test!(
    stopped_after_insert_ends_done,
    Stopped::AfterInsert,
    TransferState::Done
);
upgrade_test!(
    stopped_after_pending_ends_done,
    Stopped::AfterPending,
    TransferState::Done
);
upgrade_test!(
    stopped_after_its_debit_ends_done_with_the_credit_it_was_recorded_with,
    Stopped::AfterDebit,
    TransferState::Done
);
upgrade_test!(
    stopped_after_its_credit_ends_done_without_paying_in_again,
    Stopped::AfterCredit,
    TransferState::Done
);
upgrade_test!(
    stopped_after_applied_ends_done_without_paying_in_again,
    Stopped::AfterApplied,
    TransferState::Done
);
upgrade_test!(
    stopped_after_its_pulls_ends_done,
    Stopped::AfterPull,
    TransferState::Done
);
upgrade_test!(
    stopped_after_canceling_ends_canceled_with_its_debit_given_back,
    Stopped::AfterCanceling,
    TransferState::Canceled
);
upgrade_test!(
    stopped_after_undoing_the_destination_ends_canceled,
    Stopped::AfterUndoDestination,
    TransferState::Canceled
);
upgrade_test!(
    stopped_after_undoing_the_source_ends_canceled,
    Stopped::AfterUndoSource,
    TransferState::Canceled
);
