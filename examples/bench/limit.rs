//! Part 1, the limit: what the database itself does through the same driver and write
//! concern (majority + journal), with no service in between.
//!
//! (a) Conditional single-document updates (`update_one` guarded by a filter, `$inc`),
//! each worker on its own document. (b) Document updates through bulk writes: one
//! `update_many` over N documents, one `update` command carrying N guarded statements
//! (what other drivers' bulk API sends), and the driver's `Client::bulk_write` (the
//! MongoDB 8.0 `bulkWrite` command) when the server has it.

use std::sync::Arc;
use std::time::Duration;

use mongodb::bson::{Bson, Document, doc};
use mongodb::options::{Acknowledgment, ClientOptions, UpdateOneModel, WriteConcern};
use mongodb::{Client, Collection, Database};
use serde::Serialize;

use crate::driver::{Measured, Outcome, closed_loop};

/// Document writes one two-phase transfer makes (src/service/protocol.rs): 1 insert
/// `initial`, 2 `-> pending`, 3 debit, 4 credit, 5 `-> applied`, 6 and 7 pull the
/// marker from the source and from the destination (one command for both since group
/// commit, still two documents written), 8 `-> done`.
pub const WRITES_PER_TRANSFER: u32 = 8;
pub const WRITES_PER_TRANSFER_LIST: &str = "insert initial, ->pending, debit, credit, ->applied, pull the source's and the destination's markers (two documents, one command), ->done";

pub fn majority_journal() -> WriteConcern {
    WriteConcern::builder()
        .w(Acknowledgment::Majority)
        .journal(true)
        .build()
}

/// A client whose every write is majority + journal.
pub async fn connect(uri: &str, max_pool_size: u32) -> mongodb::error::Result<Client> {
    let mut options = ClientOptions::parse(uri).await?;
    options.app_name = Some("transfer-service-bench".into());
    options.max_pool_size = Some(max_pool_size);
    options.write_concern = Some(majority_journal());
    Client::with_options(options)
}

/// Sizes and durations of part 1.
#[derive(Debug, Clone, Serialize)]
pub struct LimitPlan {
    pub concurrencies: Vec<usize>,
    pub warmup_s: f64,
    pub window_s: f64,
    pub bulk_batches: Vec<usize>,
    pub bulk_concurrencies: Vec<usize>,
    pub bulk_warmup_s: f64,
    pub bulk_window_s: f64,
    pub max_pool_size: u32,
}

#[derive(Debug, Clone, Serialize)]
pub struct BulkPoint {
    pub method: &'static str,
    pub batch: usize,
    /// `units_per_s` is documents updated per second; latency is per call.
    pub measured: Measured,
}

#[derive(Debug, Clone, Serialize)]
pub struct Unavailable {
    pub method: &'static str,
    pub error: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Best {
    pub what: String,
    pub doc_writes_per_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct LimitResult {
    pub plan: LimitPlan,
    /// `units_per_s` is guarded single-document updates per second.
    pub single: Vec<Measured>,
    pub best_single: Option<Best>,
    pub bulk: Vec<BulkPoint>,
    pub bulk_unavailable: Vec<Unavailable>,
    pub best_bulk: Option<Best>,
    pub writes_per_transfer: u32,
    pub writes_per_transfer_are: &'static str,
    /// Best of `best_single` and `best_bulk`, divided by `writes_per_transfer`.
    pub transfer_ceiling_per_s: f64,
    pub ceiling_from: String,
    /// The same leaving out `update_many`, whose N documents all get one and the same
    /// update under one filter: the ceiling for writes that each carry their own guard
    /// and change, as the protocol's steps do.
    pub distinct_guarded_ceiling_per_s: f64,
    pub distinct_guarded_ceiling_from: String,
}

const METHOD_UPDATE_MANY: &str = "update_many (N ids, one filter)";
const METHOD_UPDATE_COMMAND: &str = "update command (N guarded statements, unordered)";
const METHOD_BULK_WRITE: &str = "Client::bulk_write (bulkWrite, MongoDB 8.0+)";

fn driver_failure(e: &mongodb::error::Error) -> Outcome {
    let text = e.to_string();
    Outcome::Failed {
        kind: format!(
            "driver error: {}",
            text.chars().take(120).collect::<String>()
        ),
        detail: text,
    }
}

fn short_count(what: &str, expected: usize, got: i64) -> Outcome {
    Outcome::Failed {
        kind: format!("{what}: fewer documents than asked"),
        detail: format!("expected {expected}, got {got}"),
    }
}

pub async fn run(
    uri: &str,
    database: &str,
    plan: LimitPlan,
) -> mongodb::error::Result<LimitResult> {
    let client = connect(uri, plan.max_pool_size).await?;
    let db = client.database(database);
    let docs: Collection<Document> = db.collection("docs");
    let max_batch = plan.bulk_batches.iter().copied().max().unwrap_or(1);
    let max_bulk_c = plan.bulk_concurrencies.iter().copied().max().unwrap_or(1);
    let max_c = plan.concurrencies.iter().copied().max().unwrap_or(1);
    let n_docs = (max_batch * max_bulk_c).max(max_c);
    let seed: Vec<Document> = (0..n_docs as i32)
        .map(|i| doc! { "_id": i, "v": 0_i64 })
        .collect();
    docs.insert_many(seed).await?;
    let warmup = Duration::from_secs_f64(plan.warmup_s);
    let window = Duration::from_secs_f64(plan.window_s);

    let mut single = Vec::new();
    for &c in &plan.concurrencies {
        let docs = docs.clone();
        let m = closed_loop(c, warmup, window, move |worker, _| {
            let docs = docs.clone();
            async move {
                match docs
                    .update_one(
                        doc! { "_id": worker as i32, "v": { "$gte": 0 } },
                        doc! { "$inc": { "v": 1_i64 } },
                    )
                    .await
                {
                    Ok(r) if r.modified_count == 1 => Outcome::Ok { units: 1 },
                    Ok(r) => short_count("update_one", 1, r.modified_count as i64),
                    Err(e) => driver_failure(&e),
                }
            }
        })
        .await;
        eprintln!(
            "[limit] update_one c={c:<3} {:>9.0} updates/s  p99 {:.1} ms{}",
            m.units_per_s,
            m.latency.as_ref().map_or(f64::NAN, |l| l.p99_ms),
            failures_note(&m)
        );
        single.push(m);
    }
    let best_single = single
        .iter()
        .filter(|m| m.failures.total == 0)
        .max_by(|a, b| a.units_per_s.total_cmp(&b.units_per_s))
        .map(|m| Best {
            what: format!("update_one at concurrency {}", m.concurrency),
            doc_writes_per_s: m.units_per_s,
        });

    let mut bulk = Vec::new();
    let mut bulk_unavailable = Vec::new();
    let bulk_warmup = Duration::from_secs_f64(plan.bulk_warmup_s);
    let bulk_window = Duration::from_secs_f64(plan.bulk_window_s);
    for method in [METHOD_UPDATE_MANY, METHOD_UPDATE_COMMAND, METHOD_BULK_WRITE] {
        // One small call first: a server without the command says so here.
        if let Err(e) = bulk_call(method, &client, &db, &docs, &[0, 1]).await {
            eprintln!("[limit] {method}: not available: {e}");
            bulk_unavailable.push(Unavailable { method, error: e });
            continue;
        }
        for &batch in &plan.bulk_batches {
            for &c in &plan.bulk_concurrencies {
                let ids: Arc<Vec<Vec<i32>>> = Arc::new(
                    (0..c)
                        .map(|w| ((w * batch) as i32..((w + 1) * batch) as i32).collect())
                        .collect(),
                );
                let (client, db, docs) = (client.clone(), db.clone(), docs.clone());
                let m = closed_loop(c, bulk_warmup, bulk_window, move |worker, _| {
                    let (client, db, docs, ids) =
                        (client.clone(), db.clone(), docs.clone(), Arc::clone(&ids));
                    async move {
                        match bulk_call(method, &client, &db, &docs, &ids[worker]).await {
                            Ok(()) => Outcome::Ok {
                                units: ids[worker].len() as u64,
                            },
                            Err(e) => Outcome::Failed {
                                kind: e.chars().take(120).collect(),
                                detail: e,
                            },
                        }
                    }
                })
                .await;
                eprintln!(
                    "[limit] {method} N={batch} c={c}: {:>9.0} docs/s{}",
                    m.units_per_s,
                    failures_note(&m)
                );
                bulk.push(BulkPoint {
                    method,
                    batch,
                    measured: m,
                });
            }
        }
    }
    let best_bulk = bulk
        .iter()
        .filter(|p| p.measured.failures.total == 0)
        .max_by(|a, b| a.measured.units_per_s.total_cmp(&b.measured.units_per_s))
        .map(|p| Best {
            what: format!(
                "{} with N={} at concurrency {}",
                p.method, p.batch, p.measured.concurrency
            ),
            doc_writes_per_s: p.measured.units_per_s,
        });
    let best = [&best_single, &best_bulk]
        .into_iter()
        .flatten()
        .max_by(|a, b| a.doc_writes_per_s.total_cmp(&b.doc_writes_per_s));
    let (ceiling, from) = match best {
        Some(b) => (
            b.doc_writes_per_s / f64::from(WRITES_PER_TRANSFER),
            b.what.clone(),
        ),
        None => (0.0, "nothing succeeded".into()),
    };
    let distinct = single
        .iter()
        .filter(|m| m.failures.total == 0)
        .map(|m| {
            (
                m.units_per_s,
                format!("update_one at concurrency {}", m.concurrency),
            )
        })
        .chain(
            bulk.iter()
                .filter(|p| p.method != METHOD_UPDATE_MANY && p.measured.failures.total == 0)
                .map(|p| {
                    (
                        p.measured.units_per_s,
                        format!(
                            "{} with N={} at concurrency {}",
                            p.method, p.batch, p.measured.concurrency
                        ),
                    )
                }),
        )
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap_or((0.0, "nothing succeeded".into()));
    let _ = db.drop().await;
    Ok(LimitResult {
        distinct_guarded_ceiling_per_s: distinct.0 / f64::from(WRITES_PER_TRANSFER),
        distinct_guarded_ceiling_from: distinct.1,
        plan,
        single,
        best_single,
        bulk,
        bulk_unavailable,
        best_bulk,
        writes_per_transfer: WRITES_PER_TRANSFER,
        writes_per_transfer_are: WRITES_PER_TRANSFER_LIST,
        transfer_ceiling_per_s: ceiling,
        ceiling_from: from,
    })
}

fn failures_note(m: &Measured) -> String {
    if m.failures.total == 0 {
        String::new()
    } else {
        format!("  FAILURES: {}", m.failures.brief())
    }
}

/// Updates the documents `ids` (each guarded by `v >= 0`, `$inc v`) in one call of
/// `method`; an error unless every one was modified.
async fn bulk_call(
    method: &str,
    client: &Client,
    db: &Database,
    docs: &Collection<Document>,
    ids: &[i32],
) -> Result<(), String> {
    let n = ids.len() as i64;
    let modified = match method {
        METHOD_UPDATE_MANY => {
            docs.update_many(
                doc! { "_id": { "$in": ids }, "v": { "$gte": 0 } },
                doc! { "$inc": { "v": 1_i64 } },
            )
            .await
            .map_err(|e| e.to_string())?
            .modified_count as i64
        }
        METHOD_UPDATE_COMMAND => {
            let updates: Vec<Bson> = ids
                .iter()
                .map(|id| {
                    Bson::Document(doc! {
                        "q": { "_id": id, "v": { "$gte": 0 } },
                        "u": { "$inc": { "v": 1_i64 } },
                    })
                })
                .collect();
            let reply = db
                .run_command(doc! {
                    "update": docs.name(),
                    "updates": updates,
                    "ordered": false,
                    "writeConcern": { "w": "majority", "j": true },
                })
                .await
                .map_err(|e| e.to_string())?;
            if let Some(errors) = reply.get("writeErrors") {
                return Err(format!("writeErrors: {errors}"));
            }
            if let Some(error) = reply.get("writeConcernError") {
                return Err(format!("writeConcernError: {error}"));
            }
            match reply.get("nModified") {
                Some(Bson::Int32(v)) => i64::from(*v),
                Some(Bson::Int64(v)) => *v,
                other => return Err(format!("no nModified in the reply: {other:?}")),
            }
        }
        _ => {
            let models: Vec<UpdateOneModel> = ids
                .iter()
                .map(|id| {
                    UpdateOneModel::builder()
                        .namespace(docs.namespace())
                        .filter(doc! { "_id": id, "v": { "$gte": 0 } })
                        .update(doc! { "$inc": { "v": 1_i64 } })
                        .build()
                })
                .collect();
            client
                .bulk_write(models)
                .ordered(false)
                .write_concern(majority_journal())
                .await
                .map_err(|e| e.to_string())?
                .modified_count
        }
    };
    if modified == n {
        Ok(())
    } else {
        Err(format!("modified {modified} of {n} documents"))
    }
}
