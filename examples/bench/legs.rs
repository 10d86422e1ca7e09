//! Part 11: multi-leg transfers (`docs/legs.md`). At each concurrency, closed loop on one
//! service, side by side: plain transfers, then transfers of 2, 4 and 8 legs through
//! `legs`, each leg between random accounts of the uniform set (so a transfer of n legs
//! touches up to 2n accounts), and transfers of 8 legs out of one account to 8 others
//! (a payroll, a split: 9 accounts). Per kind: transfers a second, latency, and what one
//! transfer cost the database (commands, documents written, the database's CPU), from
//! its own counters. The goal: an 8-leg transfer costs less than 3 plain ones in
//! commands and in time. The books are read at the end: money conserved, no room left.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::driver::{Measured, closed_loop};
use crate::service::{Context, open_accounts, post_transfer, random_pair, transfer_body};
use crate::work::{Work, snapshot};

/// What the legs part measures.
#[derive(Debug, Clone, Serialize)]
pub struct LegsPlan {
    pub concurrencies: Vec<usize>,
    /// The kinds measured: 1 is a plain transfer, more a multi-leg one of that many legs;
    /// with `true`, all out of one account (a fan-out), else each between random ones.
    pub legs: Vec<(usize, bool)>,
    pub warmup_s: f64,
    pub window_s: f64,
    pub accounts: usize,
    pub opening_balance: i64,
    pub amount: i64,
}

/// One kind at one concurrency.
#[derive(Debug, Clone, Serialize)]
pub struct LegsPoint {
    pub concurrency: usize,
    /// 1: plain transfers; n: transfers of n legs.
    pub legs: usize,
    /// The legs all out of one account.
    pub fan_out: bool,
    pub measured: Measured,
    pub work: Work,
}

#[derive(Debug, Clone, Serialize)]
pub struct LegsResult {
    pub available: bool,
    pub unavailable_reason: Option<String>,
    pub points: Vec<LegsPoint>,
    pub money_before: i64,
    pub money_after: i64,
    pub incoming_left: i64,
    pub seconds: f64,
}

impl LegsResult {
    /// Money created or lost, or room left once every transfer answered.
    pub fn violations(&self) -> Vec<String> {
        let mut found = Vec::new();
        if self.available && self.money_before != self.money_after {
            found.push(format!(
                "legs: money {} before, {} after",
                self.money_before, self.money_after
            ));
        }
        if self.incoming_left != 0 {
            found.push(format!(
                "legs: room left on accounts: {}",
                self.incoming_left
            ));
        }
        found
    }

    /// The point of plain transfers at concurrency `c`.
    pub fn plain(&self, c: usize) -> Option<&LegsPoint> {
        self.points
            .iter()
            .find(|p| p.concurrency == c && p.legs == 1)
    }
}

/// The body of a transfer of `n` legs between random accounts of `ids`; with
/// `fan_out`, all out of one account into `n` others.
fn legs_body(ids: &[String], n: usize, fan_out: bool, amount: i64) -> Vec<u8> {
    let payer = random_pair(ids).0;
    let mut payees: Vec<&str> = Vec::new();
    while fan_out && payees.len() < n {
        let payee = random_pair(ids).0;
        if payee != payer && !payees.contains(&payee) {
            payees.push(payee);
        }
    }
    let legs: Vec<serde_json::Value> = (0..n)
        .map(|i| {
            let (a, b) = if fan_out {
                (payer, payees[i])
            } else {
                random_pair(ids)
            };
            serde_json::json!({ "source": a, "destination": b, "amount": amount })
        })
        .collect();
    serde_json::to_vec(&serde_json::json!({ "legs": legs })).expect("json")
}

/// The sum of balances and of `incoming` of the accounts.
async fn books(ctx: &Context, database: &str) -> (i64, i64) {
    use futures::TryStreamExt;
    let accounts = ctx
        .mongo
        .database(database)
        .collection::<mongodb::bson::Document>("accounts");
    let docs: Vec<mongodb::bson::Document> = match accounts.find(mongodb::bson::doc! {}).await {
        Ok(cursor) => cursor.try_collect().await.unwrap_or_default(),
        Err(_) => Vec::new(),
    };
    let sum = |field: &str| docs.iter().map(|d| d.get_i64(field).unwrap_or(0)).sum();
    (sum("balance"), sum("incoming"))
}

pub async fn run(ctx: &Context, plan: &LegsPlan) -> LegsResult {
    let started = Instant::now();
    let database = format!("{}_legs", ctx.db_prefix);
    let log = ctx.out.join("server-legs.log");
    let mut result = LegsResult {
        available: false,
        unavailable_reason: None,
        points: Vec::new(),
        money_before: 0,
        money_after: 0,
        incoming_left: 0,
        seconds: 0.0,
    };
    eprintln!("[legs] starting the service (database {database})");
    let server = match ctx.start_service(&database, &log, &[]).await {
        Ok(server) => server,
        Err(said) => {
            result.unavailable_reason = Some(said);
            return result;
        }
    };
    let ids: Arc<Vec<String>> = Arc::new((0..plan.accounts).map(|i| format!("l-{i:05}")).collect());
    if let Err(e) = open_accounts(&ctx.http, &server.base, &ids, plan.opening_balance).await {
        result.unavailable_reason = Some(format!("could not open the accounts: {e}"));
        return result;
    }
    result.available = true;
    result.money_before = books(ctx, &database).await.0;
    let url: Arc<str> = format!("{}/transfers", server.base).into();
    let (warmup, window) = (
        Duration::from_secs_f64(plan.warmup_s),
        Duration::from_secs_f64(plan.window_s),
    );
    for &c in &plan.concurrencies {
        for &(n, fan_out) in &plan.legs {
            let before = snapshot(
                &ctx.mongo,
                &database,
                &ctx.http,
                &server.base,
                server.pid(),
                ctx.daemon_pid,
            )
            .await;
            let (http, url, accounts, amount) = (
                ctx.http.clone(),
                Arc::clone(&url),
                Arc::clone(&ids),
                plan.amount,
            );
            let measured = closed_loop(c, warmup, window, move |_, _| {
                let body = if n == 1 {
                    let (a, b) = random_pair(&accounts);
                    transfer_body(a, b, amount)
                } else {
                    legs_body(&accounts, n, fan_out, amount)
                };
                post_transfer(http.clone(), Arc::clone(&url), body)
            })
            .await;
            let work = snapshot(
                &ctx.mongo,
                &database,
                &ctx.http,
                &server.base,
                server.pid(),
                ctx.daemon_pid,
            )
            .await
            .since(&before, measured.sent);
            eprintln!(
                "[legs] c={c:<3} {n} leg(s){}: {:>7.1}/s p50 {:>6.1} p99 {:>6.1} ms; {}",
                if fan_out { " fan-out" } else { "" },
                measured.units_per_s,
                measured.latency.as_ref().map_or(f64::NAN, |l| l.p50_ms),
                measured.latency.as_ref().map_or(f64::NAN, |l| l.p99_ms),
                work.brief(),
            );
            result.points.push(LegsPoint {
                concurrency: c,
                legs: n,
                fan_out,
                measured,
                work,
            });
        }
    }
    let (money, incoming) = books(ctx, &database).await;
    result.money_after = money;
    result.incoming_left = incoming;
    drop(server);
    result.seconds = started.elapsed().as_secs_f64();
    result
}
