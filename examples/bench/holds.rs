//! Part 7: holds. At each concurrency, closed loop over random pairs of the uniform
//! accounts, side by side on one service: plain transfers (`201 done`), holds created
//! (`201 held`), then the holds just created captured, all of each (`200 done`). The books
//! are read at the end: every balance conserved, no pending sum left but those of holds
//! not captured (none, when every capture answered).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::driver::{Measured, Outcome, closed_loop};
use crate::service::{Context, open_accounts, post_transfer, random_pair, transfer_body};

/// What the holds part measures.
#[derive(Debug, Clone, Serialize)]
pub struct HoldsPlan {
    pub concurrencies: Vec<usize>,
    pub warmup_s: f64,
    pub window_s: f64,
    pub accounts: usize,
    pub opening_balance: i64,
    pub amount: i64,
    /// How long the holds last: far longer than the part, so that none expires.
    pub expires_in_ms: i64,
}

/// One concurrency: the three loads.
#[derive(Debug, Clone, Serialize)]
pub struct HoldsPoint {
    pub concurrency: usize,
    pub transfers: Measured,
    pub holds_created: Measured,
    pub holds_captured: Measured,
}

#[derive(Debug, Clone, Serialize)]
pub struct HoldsResult {
    pub available: bool,
    pub unavailable_reason: Option<String>,
    pub points: Vec<HoldsPoint>,
    /// The sum of balances before and after, and the pending sums left.
    pub money_before: i64,
    pub money_after: i64,
    pub pending_debits_left: i64,
    pub pending_credits_left: i64,
    pub seconds: f64,
}

impl HoldsResult {
    /// Money created or lost, or a reservation left although every hold was captured.
    pub fn violations(&self) -> Vec<String> {
        let mut found = Vec::new();
        if self.available && self.money_before != self.money_after {
            found.push(format!(
                "holds: money {} before, {} after",
                self.money_before, self.money_after
            ));
        }
        if self.pending_debits_left != self.pending_credits_left {
            found.push(format!(
                "holds: pending debits {} but pending credits {}",
                self.pending_debits_left, self.pending_credits_left
            ));
        }
        found
    }
}

/// POST `url` with an optional JSON body; a success is `status` with `state`.
async fn post_expecting(
    http: reqwest::Client,
    url: String,
    body: Option<Vec<u8>>,
    status: u16,
    state: &'static str,
) -> (Outcome, Option<String>) {
    let mut request = http.post(&url);
    if let Some(body) = body {
        request = request
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body);
    }
    let response = match request.send().await {
        Ok(r) => r,
        Err(e) => {
            let failed = Outcome::Failed {
                kind: "transport".into(),
                detail: e.to_string(),
            };
            return (failed, None);
        }
    };
    let got = response.status().as_u16();
    let text = response.text().await.unwrap_or_default();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    if got == status && json["state"] == state {
        let id = json["id"].as_str().map(str::to_owned);
        return (Outcome::Ok { units: 1 }, id);
    }
    let code = json["code"]
        .as_str()
        .unwrap_or(json["state"].as_str().unwrap_or(""));
    let failed = Outcome::Failed {
        kind: format!("{got} {code}"),
        detail: text,
    };
    (failed, None)
}

/// The sum of balances, of pending debits and of pending credits of the accounts.
async fn books(ctx: &Context, database: &str) -> (i64, i64, i64) {
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
    (sum("balance"), sum("pendingDebits"), sum("pendingCredits"))
}

pub async fn run(ctx: &Context, plan: &HoldsPlan) -> HoldsResult {
    let started = Instant::now();
    let database = format!("{}_holds", ctx.db_prefix);
    let log = ctx.out.join("server-holds.log");
    let mut result = HoldsResult {
        available: false,
        unavailable_reason: None,
        points: Vec::new(),
        money_before: 0,
        money_after: 0,
        pending_debits_left: 0,
        pending_credits_left: 0,
        seconds: 0.0,
    };
    eprintln!("[holds] starting the service (database {database})");
    let server = match ctx.start_service(&database, &log, &[]).await {
        Ok(server) => server,
        Err(said) => {
            result.unavailable_reason = Some(said);
            return result;
        }
    };
    let ids: Arc<Vec<String>> = Arc::new((0..plan.accounts).map(|i| format!("h-{i:05}")).collect());
    if let Err(e) = open_accounts(&ctx.http, &server.base, &ids, plan.opening_balance).await {
        result.unavailable_reason = Some(format!("could not open the accounts: {e}"));
        return result;
    }
    result.available = true;
    result.money_before = books(ctx, &database).await.0;
    let transfers_url: Arc<str> = format!("{}/transfers", server.base).into();
    let (warmup, window) = (
        Duration::from_secs_f64(plan.warmup_s),
        Duration::from_secs_f64(plan.window_s),
    );
    for &c in &plan.concurrencies {
        let (http, url, accounts) = (
            ctx.http.clone(),
            Arc::clone(&transfers_url),
            Arc::clone(&ids),
        );
        let amount = plan.amount;
        let transfers = closed_loop(c, warmup, window, move |_, _| {
            let (a, b) = random_pair(&accounts);
            post_transfer(http.clone(), Arc::clone(&url), transfer_body(a, b, amount))
        })
        .await;

        let created: Arc<Mutex<Vec<String>>> = Arc::default();
        let (http, base, accounts) = (ctx.http.clone(), server.base.clone(), Arc::clone(&ids));
        let (sink, expires) = (Arc::clone(&created), plan.expires_in_ms);
        let holds_created = closed_loop(c, warmup, window, move |_, _| {
            let (a, b) = random_pair(&accounts);
            let body = serde_json::to_vec(&serde_json::json!({
                "source": a, "destination": b, "amount": amount,
                "hold": { "expiresInMs": expires },
            }))
            .expect("json");
            let (http, url, sink) = (http.clone(), format!("{base}/transfers"), Arc::clone(&sink));
            async move {
                let (outcome, id) = post_expecting(http, url, Some(body), 201, "held").await;
                if let Some(id) = id {
                    sink.lock().unwrap().push(id);
                }
                outcome
            }
        })
        .await;

        let (http, base) = (ctx.http.clone(), server.base.clone());
        let queue = Arc::clone(&created);
        // Half the window, so that the holds created above (over warm-up and window) last.
        let holds_captured = closed_loop(c, Duration::ZERO, window / 2, move |_, _| {
            let next = queue.lock().unwrap().pop();
            let (http, base) = (http.clone(), base.clone());
            async move {
                let Some(id) = next else {
                    // Every hold captured: idle until the window ends.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    return Outcome::Failed {
                        kind: "no hold left".into(),
                        detail: String::new(),
                    };
                };
                let url = format!("{base}/transfers/{id}/capture");
                post_expecting(http, url, None, 200, "done").await.0
            }
        })
        .await;
        let left = created.lock().unwrap().len();
        eprintln!(
            "[holds] c={c:<3} transfers {:>7.1}/s p99 {:>6.1} ms | holds created {:>7.1}/s p99 {:>6.1} ms | captured {:>7.1}/s p99 {:>6.1} ms ({left} not captured)",
            transfers.units_per_s,
            transfers.latency.as_ref().map_or(f64::NAN, |l| l.p99_ms),
            holds_created.units_per_s,
            holds_created
                .latency
                .as_ref()
                .map_or(f64::NAN, |l| l.p99_ms),
            holds_captured.units_per_s,
            holds_captured
                .latency
                .as_ref()
                .map_or(f64::NAN, |l| l.p99_ms),
        );
        result.points.push(HoldsPoint {
            concurrency: c,
            transfers,
            holds_created,
            holds_captured,
        });
    }
    let (money, debits, credits) = books(ctx, &database).await;
    result.money_after = money;
    result.pending_debits_left = debits;
    result.pending_credits_left = credits;
    drop(server);
    result.seconds = started.elapsed().as_secs_f64();
    result
}
