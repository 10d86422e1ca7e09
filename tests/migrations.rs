//! The versioned migrations (`migrations/`, `store::migrations`) against a real database:
//! each applied once and recorded; a run that died before recording is taken up again;
//! a failure or a changed file stops start-up and records nothing it did not finish.

use mongodb::Collection;
use mongodb::bson::{Document, doc};
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
