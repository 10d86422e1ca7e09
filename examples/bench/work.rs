//! What one transfer costs the database, from the database's own counters
//! (`serverStatus`: commands by name, documents inserted and updated, journal bytes and
//! syncs) and the CPU of the service and of the daemon, read before and after a load and
//! divided by the transfers answered. The database counts, not the service: the same
//! figures come out of any build of the service, before or after a change, and include
//! what runs beside the requests (group commit's batches, the ledger's entry mover).

use std::collections::BTreeMap;

use mongodb::Client;
use mongodb::bson::{Bson, Document, doc};
use serde::Serialize;

use crate::procs::sample;

/// The commands that read or write data; the rest (`hello`, `ping`, `serverStatus`) are
/// the driver's and the benchmark's.
const DATA_COMMANDS: [&str; 8] = [
    "insert",
    "update",
    "delete",
    "find",
    "getMore",
    "aggregate",
    "findAndModify",
    "count",
];

/// The service's count of ledger entries it moved out of account documents (absent
/// before the ledger existed).
const ENTRIES_MOVED: &str = "ledger_entries_moved_total";

/// The kinds of operation `top` times per collection.
const TOP_KINDS: [&str; 6] = [
    "queries", "getmore", "insert", "update", "remove", "commands",
];

/// The counters at one moment.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    commands: BTreeMap<&'static str, f64>,
    /// `top`, for the service's database: (count, microseconds) by `"collection kind"`,
    /// and the time its collections held the write lock.
    top: BTreeMap<String, (f64, f64)>,
    write_lock_us: f64,
    inserted: f64,
    updated: f64,
    journal_bytes: f64,
    journal_syncs: f64,
    entries_moved: Option<f64>,
    service_cpu_s: Option<f64>,
    database_cpu_s: Option<f64>,
    at: Option<std::time::Instant>,
}

/// Per transfer answered, over one load.
#[derive(Debug, Clone, Serialize)]
pub struct Work {
    /// Transfer requests answered over the load, warm-up and drain included.
    pub transfers: u64,
    /// Data commands the database ran (all clients: the service and its background
    /// tasks), per transfer.
    pub commands_per_transfer: f64,
    /// The same by command name (`insert`, `update`, `find`, ...), those that ran.
    pub commands_by_name_per_transfer: BTreeMap<String, f64>,
    /// Documents inserted plus documents updated, per transfer.
    pub documents_written_per_transfer: f64,
    pub documents_inserted_per_transfer: f64,
    pub documents_updated_per_transfer: f64,
    /// `top` for the service's database, per transfer: operations and the database's
    /// microseconds in them, by collection and kind (`accounts update`, `entries
    /// insert`, `transactions queries`, ...); a write command counts once however many
    /// documents it writes.
    pub operations_per_transfer: BTreeMap<String, f64>,
    pub operation_us_per_transfer: BTreeMap<String, f64>,
    /// Microseconds its collections' writes took (`top`'s `writeLock`, which counts a
    /// write's wait for the journal too), per transfer, and over the load's wall-clock
    /// time: the writes in flight on average.
    pub write_lock_us_per_transfer: f64,
    pub writes_in_flight: f64,
    /// WiredTiger's `log bytes written` and `log sync operations`, per transfer.
    pub journal_bytes_per_transfer: f64,
    pub journal_syncs_per_transfer: f64,
    /// Ledger entries the service moved to `entries`, per transfer (None: the service
    /// has no ledger).
    pub entries_moved_per_transfer: Option<f64>,
    /// CPU milliseconds of the service and of the database daemon, per transfer.
    pub service_cpu_ms_per_transfer: Option<f64>,
    pub database_cpu_ms_per_transfer: Option<f64>,
}

fn number(b: Option<&Bson>) -> f64 {
    match b {
        Some(Bson::Int32(v)) => f64::from(*v),
        Some(Bson::Int64(v)) => *v as f64,
        Some(Bson::Double(v)) => *v,
        _ => 0.0,
    }
}

fn path<'a>(d: &'a Document, keys: &[&str]) -> Option<&'a Bson> {
    let (last, parents) = keys.split_last()?;
    let mut at = d;
    for k in parents {
        at = at.get_document(k).ok()?;
    }
    at.get(last)
}

/// A counter of the service's `/metrics` (the sum of its series), None if absent.
pub async fn service_counter(http: &reqwest::Client, base: &str, name: &str) -> Option<f64> {
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    let values: Vec<f64> = text
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with([' ', '{']))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// `top`'s counts and times for the collections of `database`, and their write lock.
async fn top(mongo: &Client, database: &str) -> (BTreeMap<String, (f64, f64)>, f64) {
    let answer = mongo
        .database("admin")
        .run_command(doc! { "top": 1 })
        .await
        .unwrap_or_default();
    let mut found = BTreeMap::new();
    let mut write_lock_us = 0.0;
    let Ok(totals) = answer.get_document("totals") else {
        return (found, write_lock_us);
    };
    let prefix = format!("{database}.");
    for (namespace, stats) in totals {
        let (Some(collection), Bson::Document(stats)) = (namespace.strip_prefix(&prefix), stats)
        else {
            continue;
        };
        write_lock_us += number(path(stats, &["writeLock", "time"]));
        for kind in TOP_KINDS {
            let count = number(path(stats, &[kind, "count"]));
            let time = number(path(stats, &[kind, "time"]));
            found.insert(format!("{collection} {kind}"), (count, time));
        }
    }
    (found, write_lock_us)
}

/// The counters now: the database's (`serverStatus` and `top` of `database`, through
/// `mongo`), the service's entries moved (its `/metrics` at `base`), and the CPU of both
/// processes.
pub async fn snapshot(
    mongo: &Client,
    database: &str,
    http: &reqwest::Client,
    base: &str,
    service_pid: u32,
    daemon_pid: Option<u32>,
) -> Snapshot {
    let status = mongo
        .database("admin")
        .run_command(doc! { "serverStatus": 1 })
        .await
        .unwrap_or_default();
    let (top, write_lock_us) = top(mongo, database).await;
    Snapshot {
        top,
        write_lock_us,
        at: Some(std::time::Instant::now()),
        commands: DATA_COMMANDS
            .iter()
            .map(|&c| {
                (
                    c,
                    number(path(&status, &["metrics", "commands", c, "total"])),
                )
            })
            .collect(),
        inserted: number(path(&status, &["metrics", "document", "inserted"])),
        updated: number(path(&status, &["metrics", "document", "updated"])),
        journal_bytes: number(path(&status, &["wiredTiger", "log", "log bytes written"])),
        journal_syncs: number(path(&status, &["wiredTiger", "log", "log sync operations"])),
        entries_moved: service_counter(http, base, ENTRIES_MOVED).await,
        service_cpu_s: sample(service_pid).map(|s| s.cpu_seconds),
        database_cpu_s: daemon_pid.and_then(sample).map(|s| s.cpu_seconds),
    }
}

impl Snapshot {
    /// What happened between `before` and this snapshot, per one of `transfers`.
    pub fn since(&self, before: &Snapshot, transfers: u64) -> Work {
        let per = |v: f64| v / transfers.max(1) as f64;
        let by_name: BTreeMap<String, f64> = self
            .commands
            .iter()
            .map(|(name, v)| {
                let b = before.commands.get(name).copied().unwrap_or(0.0);
                ((*name).to_owned(), per(v - b))
            })
            .filter(|(_, v)| *v > 0.0)
            .collect();
        let inserted = per(self.inserted - before.inserted);
        let updated = per(self.updated - before.updated);
        let diff = |a: Option<f64>, b: Option<f64>| Some(a? - b?);
        let (mut operations, mut operation_us) = (BTreeMap::new(), BTreeMap::new());
        for (key, (count, us)) in &self.top {
            let (count_before, us_before) = before.top.get(key).copied().unwrap_or_default();
            if count - count_before > 0.0 {
                operations.insert(key.clone(), per(count - count_before));
                operation_us.insert(key.clone(), per(us - us_before));
            }
        }
        let write_lock_us = self.write_lock_us - before.write_lock_us;
        let wall_s = match (self.at, before.at) {
            (Some(a), Some(b)) => (a - b).as_secs_f64(),
            _ => f64::NAN,
        };
        Work {
            transfers,
            commands_per_transfer: by_name.values().sum(),
            commands_by_name_per_transfer: by_name,
            documents_written_per_transfer: inserted + updated,
            documents_inserted_per_transfer: inserted,
            documents_updated_per_transfer: updated,
            operations_per_transfer: operations,
            operation_us_per_transfer: operation_us,
            write_lock_us_per_transfer: per(write_lock_us),
            writes_in_flight: write_lock_us / 1e6 / wall_s,
            journal_bytes_per_transfer: per(self.journal_bytes - before.journal_bytes),
            journal_syncs_per_transfer: per(self.journal_syncs - before.journal_syncs),
            entries_moved_per_transfer: diff(self.entries_moved, before.entries_moved).map(per),
            service_cpu_ms_per_transfer: diff(self.service_cpu_s, before.service_cpu_s)
                .map(|s| per(s * 1000.0)),
            database_cpu_ms_per_transfer: diff(self.database_cpu_s, before.database_cpu_s)
                .map(|s| per(s * 1000.0)),
        }
    }
}

impl Work {
    /// One line for the console: commands (by name), documents written, journal bytes
    /// and syncs, entries moved and CPU, each per transfer.
    pub fn brief(&self) -> String {
        let by_name: Vec<String> = self
            .commands_by_name_per_transfer
            .iter()
            .map(|(name, v)| format!("{name} {v:.3}"))
            .collect();
        let mut s = format!(
            "{:.3} commands ({}), {:.2} documents written, {:.0} B journal, {:.3} syncs",
            self.commands_per_transfer,
            by_name.join(", "),
            self.documents_written_per_transfer,
            self.journal_bytes_per_transfer,
            self.journal_syncs_per_transfer,
        );
        if let Some(moved) = self.entries_moved_per_transfer {
            s.push_str(&format!(", {moved:.2} entries moved"));
        }
        if let (Some(service), Some(db)) = (
            self.service_cpu_ms_per_transfer,
            self.database_cpu_ms_per_transfer,
        ) {
            s.push_str(&format!(", CPU service {service:.3} + database {db:.3} ms"));
        }
        s
    }

    /// One line for the console: the write lock, and the database's time by collection
    /// and kind of operation (operations and microseconds), each per transfer.
    pub fn brief_time(&self) -> String {
        format!(
            "write lock {:.0} µs ({:.2} in flight); {}",
            self.write_lock_us_per_transfer,
            self.writes_in_flight,
            self.time_by_operation()
        )
    }

    /// `"accounts update 0.21 × 812 µs, ..."`: per transfer, operations and the
    /// microseconds the database spent in them, the costliest first.
    pub fn time_by_operation(&self) -> String {
        let mut items: Vec<(&String, f64, f64)> = self
            .operation_us_per_transfer
            .iter()
            .map(|(k, us)| (k, self.operations_per_transfer[k], *us))
            .collect();
        items.sort_by(|a, b| b.2.total_cmp(&a.2));
        items
            .iter()
            .map(|(k, n, us)| format!("{k} {n:.3} × {us:.0} µs"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}
