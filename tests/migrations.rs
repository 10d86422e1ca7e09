//! The versioned migrations (`migrations/`, `store::migrations`) against a real database:
//! each applied once and recorded; a run that died before recording is taken up again;
//! a failure or a changed file stops start-up and records nothing it did not finish.

use mongodb::Collection;
use mongodb::bson::{Document, doc};
use serde_json::json;
use support::{database_uri, fresh_database_name};
use transfer_service::store::Store;
use transfer_service::store::migrations::MIGRATIONS;

async fn fresh_store() -> Store {
    Store::connect(&database_uri(), &fresh_database_name())
        .await
        .unwrap()
}

fn every_name() -> Vec<String> {
    MIGRATIONS
        .iter()
        .map(|(name, _)| (*name).to_owned())
        .collect()
}

/// The records of the applied migrations.
fn records(store: &Store) -> Collection<Document> {
    store.database().collection("migrations")
}

/// The distinct values of `field` among the records, in order.
async fn recorded_values(store: &Store, field: &str) -> Vec<String> {
    let mut values: Vec<String> = records(store)
        .distinct(field, doc! {})
        .await
        .unwrap()
        .into_iter()
        .filter_map(|b| b.as_str().map(str::to_owned))
        .collect();
    values.sort();
    values
}

async fn recorded(store: &Store) -> Vec<String> {
    recorded_values(store, "_id").await
}

#[tokio::test]
async fn each_migration_is_applied_once_and_recorded() {
    let store = fresh_store().await;
    assert_eq!(store.migrate().await.unwrap(), every_name());
    assert_eq!(recorded(&store).await, every_name());
    assert_eq!(store.migrate().await.unwrap(), Vec::<String>::new());
    // Each record carries its file's SHA-256, which tells every file apart.
    let sums = recorded_values(&store, "checksum").await;
    for sum in &sums {
        assert!(
            sum.len() == 64 && sum.bytes().all(|b| b.is_ascii_hexdigit()),
            "{sum}"
        );
    }
    assert_eq!(sums.len(), MIGRATIONS.len(), "one checksum per file");
}

/// An instance that died after running a migration's commands and before recording it
/// (or lost the race to record it): the next start runs the same commands again, the
/// collections they create already there, and records them.
#[tokio::test]
async fn migrations_run_but_not_recorded_are_run_again_over_what_they_made() {
    let store = fresh_store().await;
    store.migrate().await.unwrap();
    records(&store).delete_many(doc! {}).await.unwrap();
    assert_eq!(store.migrate().await.unwrap(), every_name());
    assert_eq!(recorded(&store).await, every_name());
    // The driver's timing of each command, failed ones (the creates, this time) too.
    let metrics = transfer_service::metrics::render();
    for series in [
        r#"db_operation_duration_seconds_count{deployment="default",command="create",outcome="error"}"#,
        r#"db_operation_duration_seconds_count{deployment="default",command="insert",outcome="ok"}"#,
    ] {
        assert!(metrics.contains(series), "no {series} in\n{metrics}");
    }
}

/// A command that fails stops the migration: the error reaches start-up, and the
/// migration is not recorded, so that the next start runs it again once the cause is
/// fixed. Here two transfers already share an idempotency key when the unique index on
/// it is to be built.
#[tokio::test]
async fn a_migration_whose_command_fails_is_not_recorded_and_fails_the_start() {
    let store = fresh_store().await;
    let transactions = store.database().collection::<Document>("transactions");
    for _ in 0..2 {
        transactions
            .insert_one(doc! { "idempotencyKey": "twice" })
            .await
            .unwrap();
    }
    let failed = store.migrate().await;
    assert!(failed.is_err(), "{failed:?}");
    assert_eq!(recorded(&store).await, ["0001_collections"]);
    transactions
        .delete_many(doc! { "idempotencyKey": "twice" })
        .await
        .unwrap();
    assert_eq!(store.migrate().await.unwrap(), every_name()[1..]);
}

/// Migrations are append-only: a recorded one whose file no longer matches its checksum
/// stops start-up.
#[tokio::test]
async fn a_recorded_migration_whose_file_changed_is_refused() {
    let store = fresh_store().await;
    store.migrate().await.unwrap();
    records(&store)
        .update_one(
            doc! { "_id": "0003_housekeeping" },
            doc! { "$set": { "checksum": "0".repeat(64) } },
        )
        .await
        .unwrap();
    let refused = format!("{:?}", store.migrate().await.unwrap_err());
    assert!(
        refused.contains("0003_housekeeping was changed after it was applied"),
        "{refused}"
    );
}

/// A database migrated up to, but not including, `name`: a record of `name` with a
/// checksum no file has stops the run right there, after every migration before it;
/// the record is then removed, so that the next run applies `name` (and what follows).
async fn store_migrated_before(name: &str) -> Store {
    let store = fresh_store().await;
    let blocker = doc! { "_id": name, "checksum": "0".repeat(64) };
    records(&store).insert_one(blocker).await.unwrap();
    let stopped = format!("{:?}", store.migrate().await.unwrap_err());
    assert!(stopped.contains(name), "{stopped}");
    let before: Vec<String> = every_name().into_iter().take_while(|n| n != name).collect();
    records(&store)
        .delete_one(doc! { "_id": name })
        .await
        .unwrap();
    assert_eq!(recorded(&store).await, before);
    store
}

/// An account as an instance before 0007 stored it: no `seq`, no `recentEntries`; and,
/// when opened before 0005, no `pendingDebits` or `pendingCredits` either.
fn account_before_entries(id: &str, balance: i64, pending: Option<(i64, i64)>) -> Document {
    let now = mongodb::bson::DateTime::now();
    let mut account = doc! {
        "_id": id, "balance": balance, "currency": "USD", "pendingTransactions": [],
        "createdAt": now, "updatedAt": now,
    };
    if let Some((debits, credits)) = pending {
        account.insert("pendingDebits", debits);
        account.insert("pendingCredits", credits);
    }
    account
}

/// Migration 0007 gives every account opened before entries existed one `opened` entry,
/// marked `carriedForward`, that carries its amounts as they were (absent pending sums
/// count as zero), numbered 1; run again, it changes nothing; and the account's ledger
/// goes on from there: its next change is entry 2, after the carried amounts.
#[tokio::test]
async fn an_account_opened_before_entries_is_carried_forward_as_entry_1_and_goes_on_from_it() {
    let store = store_migrated_before("0007_entries").await;
    let accounts = store.database().collection::<Document>("accounts");
    accounts
        .insert_one(account_before_entries("legacy", 700, Some((200, 50))))
        .await
        .unwrap();
    accounts
        .insert_one(account_before_entries("older", 30, None))
        .await
        .unwrap();
    let migrating = chrono::Utc::now();

    assert_eq!(
        store.migrate().await.unwrap(),
        [
            "0007_entries",
            "0008_events",
            "0009_webhooks",
            "0010_legs",
            "0011_tenants",
            "0012_webhook_caps",
            "0013_event_marks",
            "0014_partial_indexes"
        ]
    );
    records(&store)
        .delete_one(doc! { "_id": "0007_entries" })
        .await
        .unwrap();
    assert_eq!(
        store.migrate().await.unwrap(),
        ["0007_entries"],
        "run again"
    );

    let app = support::spawn_app_with(|s| s.database = store.database().name().to_owned()).await;
    let ledger = async |id: &str| -> Vec<serde_json::Value> {
        let response = app.get(&format!("/accounts/{id}/entries")).await;
        assert_eq!(response.status(), 200, "{id}");
        let page: serde_json::Value = response.json().await.unwrap();
        page["items"].as_array().expect("items").clone()
    };
    for (id, amounts) in [("legacy", (700, 200, 50)), ("older", (30, 0, 0))] {
        let entries = ledger(id).await;
        assert_eq!(
            entries.len(),
            1,
            "one entry, however often 0007 ran: {entries:#?}"
        );
        let opened = &entries[0];
        assert_eq!(opened["seq"], 1, "{opened}");
        assert_eq!(opened["kind"], "opened", "{opened}");
        assert_eq!(opened["carriedForward"], true, "{opened}");
        assert!(opened.get("transferId").is_none(), "{opened}");
        let (balance, debits, credits) = amounts;
        for (field, value) in [
            ("balanceChange", balance),
            ("pendingDebitsChange", debits),
            ("pendingCreditsChange", credits),
            ("balance", balance),
            ("pendingDebits", debits),
            ("pendingCredits", credits),
            ("availableBalance", balance - debits),
        ] {
            assert_eq!(opened[field], value, "{field}: {opened}");
        }
        let at: chrono::DateTime<chrono::Utc> = opened["at"].as_str().unwrap().parse().unwrap();
        let off = (at - migrating).num_seconds().abs();
        assert!(off <= 60, "at the migration's time, not {at}: {opened}");
        let response = app.get(&format!("/accounts/{id}")).await;
        let account: serde_json::Value = response.json().await.unwrap();
        assert_eq!(account["seq"], 1, "{account}");
    }

    app.open_account("bob", 0).await;
    let (status, transfer) = app.transfer("legacy", "bob", 100).await;
    assert_eq!(status, 201, "{transfer}");

    let entries = ledger("legacy").await;
    assert_eq!(entries.len(), 2, "{entries:#?}");
    let debit = &entries[1];
    assert_eq!(debit["seq"], 2, "{debit}");
    assert_eq!(debit["kind"], "debit", "{debit}");
    assert_eq!(debit["transferId"], transfer["id"], "{debit}");
    assert_eq!(debit["balanceChange"], -100, "{debit}");
    assert_eq!(
        (
            &debit["balance"],
            &debit["pendingDebits"],
            &debit["pendingCredits"]
        ),
        (&600.into(), &200.into(), &50.into()),
        "the carried amounts plus the debit: {debit}"
    );
    let response = app.get("/accounts/legacy").await;
    let account: serde_json::Value = response.json().await.unwrap();
    assert_eq!(account["seq"], 2, "{account}");
    assert_eq!(account["balance"], 600, "{account}");
}

/// The indexes migration 0014 swaps: (before, after).
const PARTIAL_INDEXES: [(&str, &str); 3] = [
    ("fenced_lastModified", "fenced_lastModified_partial"),
    ("reversing_lastModified", "reversing_lastModified_partial"),
    ("state_expiresAt", "state_expiresAt_partial"),
];

/// The names of `transactions`' indexes.
async fn transaction_indexes(store: &Store) -> Vec<String> {
    store
        .database()
        .collection::<Document>("transactions")
        .list_index_names()
        .await
        .unwrap()
}

/// The keys `index` holds, of a `keysPerIndex` report.
fn keys(index: &str, report: &Document) -> i64 {
    match report.get(index) {
        Some(mongodb::bson::Bson::Int32(n)) => i64::from(*n),
        Some(mongodb::bson::Bson::Int64(n)) => *n,
        other => panic!("{index}: {other:?} in {report}"),
    }
}

/// How many keys each of `transactions`' indexes holds (`validate`'s `keysPerIndex`).
async fn keys_per_index(store: &Store) -> Document {
    let report = store
        .database()
        .run_command(doc! { "validate": "transactions" })
        .await
        .unwrap();
    report.get_document("keysPerIndex").unwrap().clone()
}

/// Migration 0014 swaps the housekeeping indexes of `transactions`, which held a key for
/// every transfer (a sparse compound index keeps a document that has any of its fields,
/// and every transfer has `lastModified` and `_id`), for partial ones; run again (as by a
/// second instance starting at once) it finds the old ones gone and changes nothing.
/// After it a plain transfer has a key in none of them (a state change rewrites none),
/// a hold one in `state_expiresAt_partial`.
#[tokio::test]
async fn the_housekeeping_indexes_hold_only_the_transfers_their_scans_look_for() {
    let store = store_migrated_before("0014_partial_indexes").await;
    let before = transaction_indexes(&store).await;
    for (old, new) in PARTIAL_INDEXES {
        assert!(before.iter().any(|n| n == old), "{old} in {before:?}");
        assert!(!before.iter().any(|n| n == new), "{new} in {before:?}");
    }
    assert_eq!(store.migrate().await.unwrap(), ["0014_partial_indexes"]);
    records(&store)
        .delete_one(doc! { "_id": "0014_partial_indexes" })
        .await
        .unwrap();
    assert_eq!(
        store.migrate().await.unwrap(),
        ["0014_partial_indexes"],
        "run again"
    );
    let after = transaction_indexes(&store).await;
    for (old, new) in PARTIAL_INDEXES {
        assert!(!after.iter().any(|n| n == old), "{old} in {after:?}");
        assert!(after.iter().any(|n| n == new), "{new} in {after:?}");
    }

    let app = support::spawn_app_with(|s| s.database = store.database().name().to_owned()).await;
    for (id, balance) in [("a", 1_000), ("b", 0)] {
        app.open_account(id, balance).await;
    }
    let (status, transfer) = app.transfer("a", "b", 100).await;
    assert_eq!(status, 201, "{transfer}");
    let counted = keys_per_index(&store).await;
    assert_eq!(keys("state_lastModified", &counted), 1, "{counted}");
    for (_, new) in PARTIAL_INDEXES {
        assert_eq!(keys(new, &counted), 0, "a plain transfer: {counted}");
    }

    let hold = json!({ "source": "a", "destination": "b", "amount": 50, "hold": { "expiresInMs": 60_000 } });
    let response = app.post_json("/transfers", hold).await;
    assert_eq!(response.status(), 201);
    let counted = keys_per_index(&store).await;
    assert_eq!(keys("state_lastModified", &counted), 2, "{counted}");
    assert_eq!(
        keys("state_expiresAt_partial", &counted),
        1,
        "the hold: {counted}"
    );
    for index in [
        "fenced_lastModified_partial",
        "reversing_lastModified_partial",
    ] {
        assert_eq!(keys(index, &counted), 0, "{counted}");
    }
}
