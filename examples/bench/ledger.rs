//! Part 9: the ledger. One account receives `transfers` credits through the API, from a
//! few funded accounts, `in_flight` at a time, so that it has more entries than a
//! statement page holds. Then, one request after the other, its statement is read
//! `reads` times (`GET /accounts/{id}/entries?limit=1000`, each page checked: 1,000
//! entries numbered 1 to 1,000) and its balance as of its 500th entry's time as often
//! (`GET /accounts/{id}/balance?at=`, checked against that page). In three states:
//! right after the transfers (what the instance's entry mover has not moved yet is
//! still in the account's document), once the mover has copied them to `entries` and one
//! more credit has left them out of the document (at most one entry left there), and
//! with every entry put back into the document, directly in the
//! database (what an instance killed before it moved them, or a mover far behind,
//! leaves). Between the second and third: what an entry costs in bytes, from the
//! database (`collStats` of `entries` with its indexes, `$bsonSize` of the account's
//! entries there, and of its document with one entry more).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures::{StreamExt, TryStreamExt};
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};
use serde::Serialize;

use crate::driver::Outcome;
use crate::service::{Context, open_accounts, post_transfer, transfer_body};
use crate::stats::{Failures, Latency, summarize};

/// What the ledger part measures.
#[derive(Debug, Clone, Serialize)]
pub struct LedgerPlan {
    /// Credits into the account read: its entries are these and its `opened`.
    pub transfers: usize,
    /// Funded accounts the credits come from, in turn.
    pub sources: usize,
    /// Transfers in flight at once while making them.
    pub in_flight: usize,
    /// Reads timed of each kind in each state, one after the other.
    pub reads: usize,
    /// Entries a statement read asks for: the API's most.
    pub page: usize,
    pub opening_balance: i64,
    pub amount: i64,
    /// How long the mover may take to copy the entries, and one more change to leave one
    /// entry in the document.
    pub settle_timeout_s: f64,
}

/// The reads of one state of the account.
#[derive(Debug, Clone, Serialize)]
pub struct ReadSeries {
    pub state: &'static str,
    /// Entries in the account's document (`recentEntries`) before the first read and
    /// after the last.
    pub in_document_before: usize,
    pub in_document_after: usize,
    /// `GET /accounts/{id}/entries?limit=1000`, ms.
    pub statement: Option<Latency>,
    /// Size of one page's JSON body.
    pub statement_body_bytes: usize,
    /// `GET /accounts/{id}/balance?at=`, ms.
    pub balance: Option<Latency>,
    /// Answers that were not 200 or not what the ledger holds.
    pub wrong: Failures,
}

/// What an entry costs in bytes, as the database reports it.
#[derive(Debug, Clone, Serialize)]
pub struct EntryBytes {
    /// `collStats` of `entries` (every account's, the sources' included).
    pub collection_count: u64,
    pub collection_size_bytes: u64,
    pub collection_avg_obj_size_bytes: f64,
    pub total_index_size_bytes: u64,
    pub index_sizes_bytes: BTreeMap<String, u64>,
    /// `totalIndexSize / count`: the index entries' share of one entry.
    pub index_bytes_per_entry: f64,
    /// `$bsonSize` of the read account's documents in `entries`.
    pub entry_documents: u64,
    pub entry_document_avg_bytes: f64,
    pub entry_document_min_bytes: i64,
    pub entry_document_max_bytes: i64,
    /// `$bsonSize` of the account's document once the mover moved its entries, of the
    /// same with its last entry (read from `entries`) appended to `recentEntries`, and
    /// the difference: one more entry waiting in a document.
    pub account_document_bytes: i64,
    pub account_document_plus_one_bytes: i64,
    pub entry_in_document_bytes: i64,
    /// The account's document without the ledger's fields ([`LEDGER_FIELDS`]), as before
    /// (its BSON length, computed here).
    pub account_document_without_ledger_bytes: usize,
    /// `$bsonSize` of the account's document with all its entries in it (the third
    /// state), and from it the average entry in the document.
    pub account_document_all_in_bytes: Option<i64>,
    pub entry_in_document_avg_bytes: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LedgerResult {
    pub available: bool,
    pub unavailable_reason: Option<String>,
    pub plan: LedgerPlan,
    /// The credits: answered `done`, failed, and how long they took.
    pub transfers_done: u64,
    pub transfers_failed: Failures,
    pub transfers_s: f64,
    /// The account's entries (its `seq`) once the credits were done: one `opened` and
    /// one `credit` per credit done.
    pub entries: u64,
    /// How long the part waited, after the first reads, for the mover to leave at most
    /// one entry in the document (0 when it already had; None when it did not in time).
    pub waited_for_mover_s: Option<f64>,
    pub series: Vec<ReadSeries>,
    pub bytes: Option<EntryBytes>,
    pub bytes_error: Option<String>,
    pub seconds: f64,
}

impl LedgerResult {
    /// A statement or a balance that disagreed with the ledger, or credits that failed.
    pub fn violations(&self) -> Vec<String> {
        let mut found = Vec::new();
        for s in &self.series {
            if s.wrong.total > 0 {
                found.push(format!(
                    "ledger, {}: {} wrong answers: {}",
                    s.state,
                    s.wrong.total,
                    s.wrong.brief()
                ));
            }
        }
        if self.transfers_failed.total > 0 {
            found.push(format!(
                "ledger: {} credits failed: {}",
                self.transfers_failed.total,
                self.transfers_failed.brief()
            ));
        }
        found
    }
}

const TARGET: &str = "ledger-target";

/// The fields the ledger added to an account document (any of them the build has).
const LEDGER_FIELDS: [&str; 3] = ["seq", "recentEntries", "lastEntryAt"];

/// An entry of a statement page, as far as the checks need it.
struct PageEntry {
    seq: u64,
    balance: i64,
    at: DateTime<Utc>,
}

fn page_entries(body: &serde_json::Value) -> Option<Vec<PageEntry>> {
    body["items"]
        .as_array()?
        .iter()
        .map(|e| {
            Some(PageEntry {
                seq: e["seq"].as_u64()?,
                balance: e["balance"].as_i64()?,
                at: e["at"].as_str()?.parse().ok()?,
            })
        })
        .collect()
}

/// Entries in the account's document now.
async fn in_document(accounts: &Collection<Document>) -> usize {
    let pipeline = vec![
        doc! { "$match": { "_id": TARGET } },
        doc! { "$project": { "n": { "$size": { "$ifNull": ["$recentEntries", []] } } } },
    ];
    let Ok(cursor) = accounts.aggregate(pipeline).await else {
        return 0;
    };
    let docs: Vec<Document> = cursor.try_collect().await.unwrap_or_default();
    docs.first()
        .and_then(|d| d.get("n"))
        .map_or(0, |n| match n {
            Bson::Int32(v) => *v as usize,
            Bson::Int64(v) => *v as usize,
            _ => 0,
        })
}

/// `reads` statement reads, then as many balance reads as of `at` (the time of the
/// page's middle entry, from the first read), each checked.
async fn read_series(
    ctx: &Context,
    base: &str,
    accounts: &Collection<Document>,
    plan: &LedgerPlan,
    state: &'static str,
) -> ReadSeries {
    let in_document_before = in_document(accounts).await;
    let url = format!("{base}/accounts/{TARGET}/entries?limit={}", plan.page);
    let mut wrong = Failures::default();
    let mut statement = Vec::with_capacity(plan.reads);
    let mut first: Option<Vec<PageEntry>> = None;
    let mut body_bytes = 0;
    for _ in 0..plan.reads {
        let sent = Instant::now();
        let answer = match ctx.http.get(&url).send().await {
            Ok(r) => {
                let status = r.status().as_u16();
                r.text().await.map(|t| (status, t))
            }
            Err(e) => Err(e),
        };
        let took = sent.elapsed();
        let (status, text) = match answer {
            Ok(a) => a,
            Err(e) => {
                wrong.add("statement: transport", &e.to_string());
                continue;
            }
        };
        let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let entries = page_entries(&json).unwrap_or_default();
        let numbered = entries
            .iter()
            .enumerate()
            .all(|(i, e)| e.seq == i as u64 + 1);
        if status != 200 || entries.len() != plan.page || !numbered {
            let kind = format!("statement: {status}, {} entries", entries.len());
            wrong.add(&kind, &text.chars().take(300).collect::<String>());
            continue;
        }
        statement.push(took);
        body_bytes = text.len();
        first.get_or_insert(entries);
    }
    let mut balance = Vec::with_capacity(plan.reads);
    if let Some(page) = &first {
        let at = page[page.len() / 2 - 1].at;
        // The last entry at or before `at`: later entries of the same batch share its time.
        let expected = page.iter().rposition(|e| e.at <= at).map_or(0, |i| i + 1);
        let url = format!("{base}/accounts/{TARGET}/balance");
        let at_param = at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        for _ in 0..plan.reads {
            let sent = Instant::now();
            let answer = ctx.http.get(&url).query(&[("at", &at_param)]).send().await;
            let (status, text) = match answer {
                Ok(r) => {
                    let status = r.status().as_u16();
                    (status, r.text().await.unwrap_or_default())
                }
                Err(e) => {
                    wrong.add("balance: transport", &e.to_string());
                    continue;
                }
            };
            let took = sent.elapsed();
            let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            let seq = json["seq"].as_u64().unwrap_or(0) as usize;
            let right = status == 200
                && (seq == expected || (expected == page.len() && seq > expected))
                && page
                    .get(seq.wrapping_sub(1))
                    .is_none_or(|e| json["balance"].as_i64() == Some(e.balance));
            if right {
                balance.push(took);
            } else {
                let kind = format!("balance: {status}, seq {seq} where {expected} expected");
                wrong.add(&kind, &text.chars().take(300).collect::<String>());
            }
        }
    }
    ReadSeries {
        state,
        in_document_before,
        in_document_after: in_document(accounts).await,
        statement: summarize(statement),
        statement_body_bytes: body_bytes,
        balance: summarize(balance),
        wrong,
    }
}

fn number(b: Option<&Bson>) -> f64 {
    match b {
        Some(Bson::Int32(v)) => f64::from(*v),
        Some(Bson::Int64(v)) => *v as f64,
        Some(Bson::Double(v)) => *v,
        _ => f64::NAN,
    }
}

/// The first document `pipeline` gives on `collection`.
async fn aggregate_one(
    collection: &Collection<Document>,
    pipeline: Vec<Document>,
) -> mongodb::error::Result<Document> {
    let docs: Vec<Document> = collection.aggregate(pipeline).await?.try_collect().await?;
    Ok(docs.into_iter().next().unwrap_or_default())
}

/// What an entry costs in bytes (see [`EntryBytes`]), with one entry in the account's
/// document.
async fn entry_bytes(ctx: &Context, database: &str) -> mongodb::error::Result<EntryBytes> {
    let db = ctx.mongo.database(database);
    let stats = db.run_command(doc! { "collStats": "entries" }).await?;
    let count = number(stats.get("count"));
    let total_index = number(stats.get("totalIndexSize"));
    let index_sizes = stats
        .get_document("indexSizes")
        .map(|d| {
            d.iter()
                .map(|(k, v)| (k.clone(), number(Some(v)) as u64))
                .collect()
        })
        .unwrap_or_default();
    let entries: Collection<Document> = db.collection("entries");
    let sizes = aggregate_one(
        &entries,
        vec![
            doc! { "$match": { "account": TARGET } },
            doc! { "$group": {
                "_id": Bson::Null,
                "n": { "$sum": 1 },
                "avg": { "$avg": { "$bsonSize": "$$ROOT" } },
                "min": { "$min": { "$bsonSize": "$$ROOT" } },
                "max": { "$max": { "$bsonSize": "$$ROOT" } },
            } },
        ],
    )
    .await?;
    let accounts: Collection<Document> = db.collection("accounts");
    // The account's last moved entry, as it would stand in the document.
    let last = entries
        .find_one(doc! { "account": TARGET })
        .sort(doc! { "seq": -1 })
        .projection(doc! { "_id": 0, "account": 0 })
        .await?
        .unwrap_or_default();
    let document = aggregate_one(
        &accounts,
        vec![
            doc! { "$match": { "_id": TARGET } },
            doc! { "$project": {
                "full": { "$bsonSize": "$$ROOT" },
                "plusOne": { "$bsonSize": { "$mergeObjects": ["$$ROOT", {
                    "recentEntries": { "$concatArrays": [
                        { "$ifNull": ["$recentEntries", []] },
                        [{ "$literal": last }],
                    ] },
                }] } },
            } },
        ],
    )
    .await?;
    let mut plain = accounts
        .find_one(doc! { "_id": TARGET })
        .await?
        .unwrap_or_default();
    for field in LEDGER_FIELDS {
        plain.remove(field);
    }
    let plain_len = mongodb::bson::to_vec(&plain).map_or(0, |v| v.len());
    let (full, plus_one) = (
        number(document.get("full")) as i64,
        number(document.get("plusOne")) as i64,
    );
    Ok(EntryBytes {
        collection_count: count as u64,
        collection_size_bytes: number(stats.get("size")) as u64,
        collection_avg_obj_size_bytes: number(stats.get("avgObjSize")),
        total_index_size_bytes: total_index as u64,
        index_sizes_bytes: index_sizes,
        index_bytes_per_entry: total_index / count.max(1.0),
        entry_documents: number(sizes.get("n")) as u64,
        entry_document_avg_bytes: number(sizes.get("avg")),
        entry_document_min_bytes: number(sizes.get("min")) as i64,
        entry_document_max_bytes: number(sizes.get("max")) as i64,
        account_document_bytes: full,
        account_document_plus_one_bytes: plus_one,
        entry_in_document_bytes: plus_one - full,
        account_document_without_ledger_bytes: plain_len,
        account_document_all_in_bytes: None,
        entry_in_document_avg_bytes: None,
    })
}

/// Puts every entry of the account moved to `entries` back into its document, in
/// order before the one left there, and removes them from `entries`: the state an
/// instance killed before moving them leaves. Returns the entries in the document.
async fn put_back(ctx: &Context, database: &str) -> mongodb::error::Result<usize> {
    let db = ctx.mongo.database(database);
    let entries: Collection<Document> = db.collection("entries");
    let accounts: Collection<Document> = db.collection("accounts");
    let moved: Vec<Document> = entries
        .find(doc! { "account": TARGET })
        .sort(doc! { "seq": 1 })
        .projection(doc! { "_id": 0, "account": 0 })
        .await?
        .try_collect()
        .await?;
    let account = accounts
        .find_one(doc! { "_id": TARGET })
        .await?
        .unwrap_or_default();
    let mut all: Vec<Bson> = moved.into_iter().map(Bson::Document).collect();
    all.extend(
        account
            .get_array("recentEntries")
            .cloned()
            .unwrap_or_default(),
    );
    let n = all.len();
    accounts
        .update_one(
            doc! { "_id": TARGET },
            doc! { "$set": { "recentEntries": all } },
        )
        .await?;
    entries.delete_many(doc! { "account": TARGET }).await?;
    Ok(n)
}

pub async fn run(ctx: &Context, plan: &LedgerPlan) -> LedgerResult {
    let started = Instant::now();
    let database = format!("{}_ledger", ctx.db_prefix);
    let log = ctx.out.join("server-ledger.log");
    let mut result = LedgerResult {
        available: false,
        unavailable_reason: None,
        plan: plan.clone(),
        transfers_done: 0,
        transfers_failed: Failures::default(),
        transfers_s: 0.0,
        entries: 0,
        waited_for_mover_s: None,
        series: Vec::new(),
        bytes: None,
        bytes_error: None,
        seconds: 0.0,
    };
    eprintln!("[ledger] starting the service (database {database})");
    let server = match ctx.start_service(&database, &log, &[]).await {
        Ok(server) => server,
        Err(said) => {
            result.unavailable_reason = Some(said);
            return result;
        }
    };
    let sources: Vec<String> = (0..plan.sources)
        .map(|i| format!("ledger-source-{i:02}"))
        .collect();
    let mut all = sources.clone();
    all.push(TARGET.to_owned());
    if let Err(e) = open_accounts(&ctx.http, &server.base, &all, plan.opening_balance).await {
        result.unavailable_reason = Some(format!("could not open the accounts: {e}"));
        return result;
    }
    let probe = ctx
        .http
        .get(format!("{}/accounts/{TARGET}/entries?limit=1", server.base))
        .send()
        .await
        .map(|r| r.status().as_u16());
    if !matches!(probe, Ok(200)) {
        result.unavailable_reason = Some(format!(
            "GET /accounts/{{id}}/entries answered {probe:?}: a service without the ledger"
        ));
        return result;
    }
    result.available = true;
    let accounts: Collection<Document> = ctx.mongo.database(&database).collection("accounts");

    eprintln!(
        "[ledger] {} credits into {TARGET} from {} accounts, {} in flight",
        plan.transfers, plan.sources, plan.in_flight
    );
    let url: std::sync::Arc<str> = format!("{}/transfers", server.base).into();
    let sending = Instant::now();
    let outcomes: Vec<Outcome> = futures::stream::iter(0..plan.transfers)
        .map(|i| {
            let body = transfer_body(&sources[i % sources.len()], TARGET, plan.amount);
            post_transfer(ctx.http.clone(), std::sync::Arc::clone(&url), body)
        })
        .buffer_unordered(plan.in_flight)
        .collect()
        .await;
    result.transfers_s = sending.elapsed().as_secs_f64();
    for outcome in outcomes {
        match outcome {
            Outcome::Ok { .. } => result.transfers_done += 1,
            Outcome::Failed { kind, detail } => result.transfers_failed.add(&kind, &detail),
        }
    }
    result.entries = accounts
        .find_one(doc! { "_id": TARGET })
        .await
        .ok()
        .flatten()
        .and_then(|d| d.get_i64("seq").ok())
        .map_or(0, |seq| seq as u64);
    eprintln!(
        "[ledger] {} credits done in {:.1} s, failed: {}",
        result.transfers_done,
        result.transfers_s,
        result.transfers_failed.brief()
    );

    let show = |s: &ReadSeries| {
        let l = |x: &Option<Latency>, f: fn(&Latency) -> f64| x.as_ref().map_or(f64::NAN, f);
        eprintln!(
            "[ledger] {:<26} statement of {}: p50 {:.1} p99 {:.1} max {:.1} ms | balance at: p50 {:.1} p99 {:.1} ms | in the document {} -> {} | wrong: {}",
            s.state,
            plan.page,
            l(&s.statement, |x| x.p50_ms),
            l(&s.statement, |x| x.p99_ms),
            l(&s.statement, |x| x.max_ms),
            l(&s.balance, |x| x.p50_ms),
            l(&s.balance, |x| x.p99_ms),
            s.in_document_before,
            s.in_document_after,
            s.wrong.brief(),
        );
    };
    let series = read_series(
        ctx,
        &server.base,
        &accounts,
        plan,
        "right after the transfers",
    )
    .await;
    show(&series);
    result.series.push(series);

    // The mover copies the entries to `entries`; they leave the document with the
    // account's next change: one more credit, once every entry is copied.
    let waiting = Instant::now();
    let deadline = waiting + Duration::from_secs_f64(plan.settle_timeout_s);
    let copied = ctx
        .mongo
        .database(&database)
        .collection::<Document>("entries");
    let made = result.entries;
    let mut changed_again = false;
    while Instant::now() < deadline {
        if !changed_again {
            let n = copied
                .count_documents(doc! { "account": TARGET })
                .await
                .unwrap_or(0);
            if n >= made {
                let body = transfer_body(&sources[0], TARGET, plan.amount);
                let url = format!("{}/transfers", server.base).into();
                post_transfer(ctx.http.clone(), url, body).await;
                changed_again = true;
            }
        } else if in_document(&accounts).await <= 1 {
            result.waited_for_mover_s = Some(waiting.elapsed().as_secs_f64());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let series = read_series(ctx, &server.base, &accounts, plan, "moved").await;
    show(&series);
    result.series.push(series);

    match entry_bytes(ctx, &database).await {
        Ok(bytes) => result.bytes = Some(bytes),
        Err(e) => result.bytes_error = Some(e.to_string()),
    }
    let left_in_document = in_document(&accounts).await;
    match put_back(ctx, &database).await {
        Ok(n) => {
            let full = aggregate_one(
                &accounts,
                vec![
                    doc! { "$match": { "_id": TARGET } },
                    doc! { "$project": { "full": { "$bsonSize": "$$ROOT" } } },
                ],
            )
            .await
            .map(|d| number(d.get("full")) as i64);
            let put_in = n.saturating_sub(left_in_document);
            if let (Some(bytes), Ok(full)) = (&mut result.bytes, full) {
                bytes.account_document_all_in_bytes = Some(full);
                bytes.entry_in_document_avg_bytes =
                    Some((full - bytes.account_document_bytes) as f64 / put_in.max(1) as f64);
            }
            let series =
                read_series(ctx, &server.base, &accounts, plan, "all in the document").await;
            show(&series);
            result.series.push(series);
        }
        Err(e) => {
            result
                .bytes_error
                .get_or_insert(format!("putting the entries back: {e}"));
        }
    }
    if let Some(b) = &result.bytes {
        eprintln!(
            "[ledger] bytes: an entry in `entries` {:.0} B (+ {:.0} B of index), in the document {} B; the account document {} B once moved, {} B without the ledger",
            b.entry_document_avg_bytes,
            b.index_bytes_per_entry,
            b.entry_in_document_bytes,
            b.account_document_bytes,
            b.account_document_without_ledger_bytes,
        );
    }
    server.stop().await;
    let _ = ctx.mongo.database(&database).drop().await;
    result.seconds = started.elapsed().as_secs_f64();
    result
}
