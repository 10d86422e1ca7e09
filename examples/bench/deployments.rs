//! Part 8: deployments. One service over two deployments (`DEPLOYMENTS=eu=...,us=...`:
//! the run's database and a second SecantusDB daemon started for this part), half the
//! accounts on each. At each concurrency, closed loop: transfers within one deployment
//! (both accounts on `eu`), then transfers across (one account on each, either way). The
//! database commands each kind costs come from the service's own
//! `db_operation_duration_seconds` counts, per deployment, before and after each load:
//! the extra round trips of a transfer across. Last, the second daemon is killed and the
//! transfers within `eu` are measured again at the highest concurrency: an outage of
//! one deployment should leave the others at their usual speed. The books are read on
//! `eu` before and after that, and on both deployments before the kill: every balance
//! conserved.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng;
use serde::Serialize;

use crate::driver::{Measured, closed_loop};
use crate::procs::{Daemon, secantusd_binary};
use crate::service::{Context, open_accounts_on, post_transfer, random_pair, transfer_body};

/// What the deployments part measures.
#[derive(Debug, Clone, Serialize)]
pub struct DeploymentsPlan {
    pub concurrencies: Vec<usize>,
    pub warmup_s: f64,
    pub window_s: f64,
    /// Accounts on each of the two deployments.
    pub accounts_per_deployment: usize,
    pub opening_balance: i64,
    pub amount: i64,
}

/// One load at one concurrency.
#[derive(Debug, Clone, Serialize)]
pub struct DeploymentsLoad {
    pub measured: Measured,
    /// Database commands per transfer answered, on each deployment (eu, us), counted by
    /// the service over warm-up and window.
    pub commands_per_transfer: [f64; 2],
}

#[derive(Debug, Clone, Serialize)]
pub struct DeploymentsPoint {
    pub concurrency: usize,
    pub within: DeploymentsLoad,
    pub across: DeploymentsLoad,
}

#[derive(Debug, Clone, Serialize)]
pub struct DeploymentsResult {
    pub available: bool,
    pub unavailable_reason: Option<String>,
    pub points: Vec<DeploymentsPoint>,
    /// Transfers within `eu` at the highest concurrency while `us` is down, with the
    /// same load measured while it was up.
    pub within_while_us_down: Option<DeploymentsLoad>,
    pub money_before: i64,
    pub money_after: i64,
    pub seconds: f64,
}

impl DeploymentsResult {
    /// Money created or lost.
    pub fn violations(&self) -> Vec<String> {
        if self.available && self.money_before != self.money_after {
            vec![format!(
                "deployments: money {} before, {} after",
                self.money_before, self.money_after
            )]
        } else {
            Vec::new()
        }
    }
}

const NAMES: [&str; 2] = ["eu", "us"];

/// The service's count of database commands on each deployment, from `/metrics`.
async fn commands(http: &reqwest::Client, base: &str) -> [f64; 2] {
    let text = match http.get(format!("{base}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    };
    NAMES.map(|name| {
        let prefix = format!("db_operation_duration_seconds_count{{deployment=\"{name}\",");
        text.lines()
            .filter(|l| l.starts_with(&prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    })
}

/// The sum of balances on both deployments.
async fn money(uris: &[String; 2], database: &str) -> i64 {
    use futures::TryStreamExt;
    let mut total = 0;
    for uri in uris {
        let Ok(client) = mongodb::Client::with_uri_str(uri).await else {
            continue;
        };
        let accounts = client
            .database(database)
            .collection::<mongodb::bson::Document>("accounts");
        if let Ok(cursor) = accounts.find(mongodb::bson::doc! {}).await {
            let docs: Vec<mongodb::bson::Document> = cursor.try_collect().await.unwrap_or_default();
            total += docs
                .iter()
                .map(|d| d.get_i64("balance").unwrap_or(0))
                .sum::<i64>();
        }
    }
    total
}

/// One closed-loop load of transfers between pairs `pick` draws, with its command counts.
async fn load(
    ctx: &Context,
    base: &str,
    c: usize,
    plan: &DeploymentsPlan,
    pick: impl Fn() -> (String, String) + Send + Sync + 'static,
) -> DeploymentsLoad {
    let before = commands(&ctx.http, base).await;
    let url: Arc<str> = format!("{base}/transfers").into();
    let (http, amount, pick) = (ctx.http.clone(), plan.amount, Arc::new(pick));
    // Every transfer answered, warm-up included: the commands counted cover them all.
    let answered = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = Arc::clone(&answered);
    let measured = closed_loop(
        c,
        Duration::from_secs_f64(plan.warmup_s),
        Duration::from_secs_f64(plan.window_s),
        move |_, _| {
            let (a, b) = pick();
            let sent = post_transfer(
                http.clone(),
                Arc::clone(&url),
                transfer_body(&a, &b, amount),
            );
            let counter = Arc::clone(&counter);
            async move {
                let outcome = sent.await;
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                outcome
            }
        },
    )
    .await;
    let after = commands(&ctx.http, base).await;
    let transfers = answered.load(std::sync::atomic::Ordering::Relaxed).max(1) as f64;
    DeploymentsLoad {
        commands_per_transfer: [0, 1].map(|i| (after[i] - before[i]) / transfers),
        measured,
    }
}

pub async fn run(ctx: &Context, plan: &DeploymentsPlan) -> DeploymentsResult {
    let started = Instant::now();
    let database = format!("{}_deployments", ctx.db_prefix);
    let mut result = DeploymentsResult {
        available: false,
        unavailable_reason: None,
        points: Vec::new(),
        within_while_us_down: None,
        money_before: 0,
        money_after: 0,
        seconds: 0.0,
    };
    let second = match secantusd_binary().and_then(Daemon::start) {
        Ok(daemon) => daemon,
        Err(e) => {
            result.unavailable_reason = Some(format!("no second database daemon: {e}"));
            return result;
        }
    };
    let uris = [ctx.uri.clone(), second.uri.clone()];
    eprintln!("[deployments] starting the service over eu and us (database {database})");
    let deployments = format!("eu={},us={}", uris[0], uris[1]);
    let log = ctx.out.join("server-deployments.log");
    let server = match ctx
        .start_service(&database, &log, &[("DEPLOYMENTS", deployments)])
        .await
    {
        Ok(server) => server,
        Err(said) => {
            result.unavailable_reason = Some(said);
            return result;
        }
    };
    let ids: [Arc<Vec<String>>; 2] = NAMES.map(|name| {
        Arc::new(
            (0..plan.accounts_per_deployment)
                .map(|i| format!("{name}-{i:05}"))
                .collect(),
        )
    });
    for (name, ids) in NAMES.iter().zip(&ids) {
        let opened = open_accounts_on(
            &ctx.http,
            &server.base,
            ids,
            plan.opening_balance,
            Some(name),
        )
        .await;
        if let Err(e) = opened {
            result.unavailable_reason = Some(format!("could not open the accounts: {e}"));
            return result;
        }
    }
    result.available = true;
    result.money_before = money(&uris, &database).await;
    for &c in &plan.concurrencies {
        let eu = Arc::clone(&ids[0]);
        let within = load(ctx, &server.base, c, plan, move || {
            let (a, b) = random_pair(&eu);
            (a.to_owned(), b.to_owned())
        })
        .await;
        let (eu, us) = (Arc::clone(&ids[0]), Arc::clone(&ids[1]));
        let across = load(ctx, &server.base, c, plan, move || {
            let mut rng = rand::rng();
            let (a, b) = (
                eu[rng.random_range(0..eu.len())].clone(),
                us[rng.random_range(0..us.len())].clone(),
            );
            if rng.random_bool(0.5) { (a, b) } else { (b, a) }
        })
        .await;
        let show = |l: &DeploymentsLoad| {
            format!(
                "{:>7.1}/s p50 {:>5.1} p99 {:>6.1} ms, commands eu {:.2} us {:.2}",
                l.measured.units_per_s,
                l.measured.latency.as_ref().map_or(f64::NAN, |x| x.p50_ms),
                l.measured.latency.as_ref().map_or(f64::NAN, |x| x.p99_ms),
                l.commands_per_transfer[0],
                l.commands_per_transfer[1],
            )
        };
        eprintln!(
            "[deployments] c={c:<3} within {} | across {}",
            show(&within),
            show(&across)
        );
        result.points.push(DeploymentsPoint {
            concurrency: c,
            within,
            across,
        });
    }
    result.money_after = money(&uris, &database).await;
    // us goes away; the service's watch notices within a ping's time limit.
    if let Some(&c) = plan.concurrencies.last() {
        drop(second);
        tokio::time::sleep(Duration::from_secs(3)).await;
        let eu = Arc::clone(&ids[0]);
        let before = money(&[uris[0].clone(), uris[0].clone()], &database).await / 2;
        let down = load(ctx, &server.base, c, plan, move || {
            let (a, b) = random_pair(&eu);
            (a.to_owned(), b.to_owned())
        })
        .await;
        let after = money(&[uris[0].clone(), uris[0].clone()], &database).await / 2;
        if before != after {
            result.money_after = result.money_before + (after - before);
        }
        eprintln!(
            "[deployments] c={c:<3} within eu while us is down {:>7.1}/s p50 {:>5.1} p99 {:>6.1} ms",
            down.measured.units_per_s,
            down.measured
                .latency
                .as_ref()
                .map_or(f64::NAN, |x| x.p50_ms),
            down.measured
                .latency
                .as_ref()
                .map_or(f64::NAN, |x| x.p99_ms),
        );
        result.within_while_us_down = Some(down);
    }
    drop(server);
    result.seconds = started.elapsed().as_secs_f64();
    result
}
