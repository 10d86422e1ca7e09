//! The bank test, after Jepsen's bank workload: several instances of the service on one
//! database, clients making many concurrent transfers among a dozen accounts (three of
//! them hot) with cancels, asynchronous transfers, idempotent retries and holds mixed in,
//! while a nemesis kills instances with SIGKILL and restarts them, and restarts the
//! database process once in the middle. About a fifth of the requests are holds (the
//! same accounts, references and idempotency keys as transfers) that expire within
//! [`HOLD_EXPIRES_MS`](workload::HOLD_EXPIRES_MS); after a random short delay each is
//! captured in full, captured in part, voided, or left to expire (and now and then
//! captured or voided after its expiry, or its request replayed), by requests to random
//! live instances that are retried like the others.
//!
//! It runs on two layouts of the accounts ([`Layout`]), with the same load, nemesis and
//! checks:
//!
//! - on one deployment (`MONGODB_URI`): the nemesis restarts that database server, down
//!   for a second;
//! - across three (`DEPLOYMENTS=eu=...,us=...,cn=...`, three database servers): account
//!   `i` lives on the `i % 3`th, so each hot account is on a deployment of its own and
//!   about two transfers in three cross deployments (each logged on its source's), the
//!   others staying within one. The nemesis restarts one deployment's server, chosen at
//!   random, down for four seconds (longer than the driver's server selection time-out,
//!   so that what touches it is refused meanwhile); meanwhile a probe client moves money
//!   between the accounts of the two others
//!   ([`probe_while_down`](workload::probe_while_down)), and at least one transfer
//!   between those (the probe's or another client's) must be made and answered `done`
//!   while it is down.
//!
//! The test owns its database servers (SecantusDB daemons, each in a temporary folder of
//! its own, restarted on the same port and folder); with `MONGODB_URI` set it uses the
//! servers the test support names (`MONGODB_URIS` for the further deployments) and
//! restarts none. The two tests take turns ([`ONE_BANK_AT_A_TIME`]). The instances do
//! not have it easy either: a bad network, wrong clocks, and cancels of the transfers
//! being recovered after each kill ([`nemesis`]).
//!
//! The proxied instance answers more 503s and loses more connections; those are retried
//! or counted as unknown outcomes like the others. Then, once everything is quiet, it
//! reads every deployment (accounts, transfer log, idempotency keys) and checks, over all
//! of them at once, the invariants listed in [`checker`]: no money made or lost, every
//! transfer finished and placed where it belongs, every answer a client got true to the
//! final state; and it reads the event feed through the API until it has caught up, and
//! checks it against the books (an event for every transfer it finished).
//!
//! Each test runs for `BANK_TEST_SECONDS` (default 30) of load and prints what it did
//! (holds by plan and by outcome among them, transfers by log and how many cross
//! deployments, what was answered while a deployment was down), with the proxies' counts
//! and the skews in its summary line.
//!
//! The test by role, a module each:
//!
//! - [`workload`]: what the clients do (transfers, cancels, holds and what follows them,
//!   the probe while a deployment is down) and the accounts they drive;
//! - [`nemesis`]: the faults (killed instances, a database server restarted, the faulty
//!   network, the skewed clocks, cancels racing the recovery);
//! - [`checker`]: the history of what the clients saw, the invariants checked (during the
//!   run and at the end; the ledger's among them), the report and the verdict;
//! - [`deployments`]: where the accounts live ([`Layout`]) and the test's own connections
//!   to read them back ([`Books`]);
//! - here: the two tests and the run that wires the others together ([`run_bank`]).

mod checker;
mod deployments;
mod nemesis;
mod workload;

use std::time::Duration;

use checker::report::Report;
use deployments::{Books, Layout};
use nemesis::{Nemesis, Network, Servers, Slots};
use support::fresh_database_name;
use tokio_util::sync::CancellationToken;
use workload::Clients;

/// The instances of the service, one per slot, all running at once (the nemesis kills
/// and restarts them one at a time).
const INSTANCES: usize = 3;
/// Every instance's lease and sweep interval: short, so that the survivors' sweepers
/// take a killed instance's transfers over within the run.
const STALE_AFTER_MS: u64 = 1000;
const SWEEP_INTERVAL_MS: u64 = 200;

/// One bank test at a time: each runs three instances, its database servers, a dozen
/// clients and a proxy, about what two cores can take; two at once would mostly test the
/// machine.
static ONE_BANK_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bank_keeps_its_money_through_killed_instances_and_a_database_restart() {
    run_bank(Layout::OneDeployment).await;
}

/// The same across three deployments, each account on one of them, where one
/// deployment's server is killed and restarted in the middle: meanwhile the transfers
/// between the two others must go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bank_keeps_its_money_across_three_deployments_and_serves_two_while_the_third_restarts()
{
    run_bank(Layout::ThreeDeployments).await;
}

/// The scenario of the module doc, with the accounts on `layout`'s deployments: set up,
/// load under the nemesis, wait for the end, check, report.
async fn run_bank(layout: Layout) {
    let _alone = ONE_BANK_AT_A_TIME.lock().await;
    let seconds: u64 = std::env::var("BANK_TEST_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    // Its own database servers, so that the nemesis can restart one; with MONGODB_URI
    // set, the servers named there are used and left alone.
    let mut servers = Servers::start(layout);
    let database = fresh_database_name();
    let network = Network::start(layout, &servers.uris).await;
    let slots = Slots::new(layout, &network, &database);
    let mut instances = slots.start_all().await;
    workload::open_accounts(layout, &instances).await;
    let books = Books::connect(layout, &servers.uris, &database).await;
    let sampling = CancellationToken::new();
    let sampler = tokio::spawn(checker::sample_accounts(books.clone(), sampling.clone()));
    let mut clients = Clients::start(&instances);
    let watcher = tokio::spawn(checker::ledger::watch(
        layout,
        books.clone(),
        clients.bases.clone(),
        sampling.clone(),
    ));

    let nemesis = Nemesis::new(&mut servers, &slots, &mut instances, &clients, &books);
    let mut havoc = nemesis.run(Duration::from_secs(seconds)).await;
    clients.finish().await;
    havoc.finish().await;

    let end = checker::wait_for_the_end(&books).await;
    let key_records = books.key_records().await;
    sampling.cancel();
    let sampled = sampler.await.unwrap();
    let watched = watcher.await.unwrap();
    // After the transfers `end` holds: the entries are read once they no longer move.
    let ledger = checker::ledger::read_end(&books, &clients.bases, watched).await;
    // And the event feed, once its recorders have caught up with the transfers `end` holds.
    let events = checker::events::read_end(&books, &clients.bases, &end).await;
    let history = clients.history.lock().unwrap();
    let report = Report {
        layout,
        seconds,
        havoc: &havoc,
        network: &network,
        end: &end,
        history: &history,
    };
    let happened = report.what_happened(&sampled);
    checker::ledger::describe(&ledger);
    checker::events::describe(&events);
    // The database servers run on this host (their clock is the test's) unless
    // MONGODB_URI is set.
    let same_clock = servers.owned();
    let checked = checker::check_all(&report, &key_records, sampled, &ledger, &events, same_clock);
    report.summary(&checked);
    report.verdict(&happened, &checked);
}
