//! Applies the versioned migrations in the top-level `migrations/` folder.
//!
//! Each migration is a JSON list of database commands, embedded in the binary at build
//! time. A migration not yet recorded in the `migrations` collection is run and then
//! recorded. Its commands are idempotent, so two instances starting at once may both run
//! it; the second record insert then fails on `_id` and is ignored. A recorded migration
//! whose file changed since is refused: migrations are append-only.

use mongodb::Database;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::error::ErrorKind;
use sha2::{Digest, Sha256};

use super::fields::migration;
use super::{StoreError, StoreResult};

/// Every migration, in the order it is applied. Add new files at the end.
pub const MIGRATIONS: &[(&str, &str)] = &[
    (
        "0001_collections",
        include_str!("../../migrations/0001_collections.json"),
    ),
    (
        "0002_indexes",
        include_str!("../../migrations/0002_indexes.json"),
    ),
    (
        "0003_housekeeping",
        include_str!("../../migrations/0003_housekeeping.json"),
    ),
    (
        "0004_validators_without_regex",
        include_str!("../../migrations/0004_validators_without_regex.json"),
    ),
    (
        "0005_holds",
        include_str!("../../migrations/0005_holds.json"),
    ),
    (
        "0006_deployments",
        include_str!("../../migrations/0006_deployments.json"),
    ),
    (
        "0007_entries",
        include_str!("../../migrations/0007_entries.json"),
    ),
    (
        "0008_events",
        include_str!("../../migrations/0008_events.json"),
    ),
    (
        "0009_webhooks",
        include_str!("../../migrations/0009_webhooks.json"),
    ),
    ("0010_legs", include_str!("../../migrations/0010_legs.json")),
    (
        "0011_tenants",
        include_str!("../../migrations/0011_tenants.json"),
    ),
    (
        "0012_webhook_caps",
        include_str!("../../migrations/0012_webhook_caps.json"),
    ),
    (
        "0013_event_marks",
        include_str!("../../migrations/0013_event_marks.json"),
    ),
    (
        "0014_partial_indexes",
        include_str!("../../migrations/0014_partial_indexes.json"),
    ),
];

/// MongoDB's NamespaceExists: `create` on a collection that is already there.
const NAMESPACE_EXISTS: i32 = 48;
/// MongoDB's IndexNotFound: `dropIndexes` of an index that is not there (dropped by an
/// earlier run, or by another instance's).
const INDEX_NOT_FOUND: i32 = 27;

fn checksum(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// The commands of migration `name`. Its text is compiled in, and a test reads every
/// one: a text that does not parse is a bug of the build.
fn commands(name: &str, text: &str) -> Vec<Document> {
    let bad = |why: &dyn std::fmt::Display| -> ! { panic!("bug: migration {name}: {why}") };
    let json: serde_json::Value = serde_json::from_str(text).unwrap_or_else(|e| bad(&e));
    let list = json
        .get("commands")
        .and_then(|c| c.as_array())
        .unwrap_or_else(|| bad(&"has no \"commands\" list"));
    list.iter()
        .map(|c| match Bson::try_from(c.clone()) {
            Ok(Bson::Document(d)) => d,
            Ok(_) => bad(&"a command is not an object"),
            Err(e) => bad(&e),
        })
        .collect()
}

/// The error code that says `command` had already been done (by an earlier run, or by
/// another instance's): a `create` of a collection that is there, a `dropIndexes` of an
/// index that is not.
fn done_before(command: &Document) -> Option<i32> {
    if command.contains_key("create") {
        Some(NAMESPACE_EXISTS)
    } else if command.contains_key("dropIndexes") {
        Some(INDEX_NOT_FOUND)
    } else {
        None
    }
}

/// Runs the migrations this database lacks; returns the names it applied.
pub async fn apply_all(db: &Database) -> StoreResult<Vec<String>> {
    let records = db.collection::<Document>("migrations");
    let mut applied = Vec::new();
    for (name, text) in MIGRATIONS {
        let sum = checksum(text);
        if let Some(record) = records.find_one(doc! { "_id": *name }).await? {
            if record.get_str(migration::CHECKSUM).ok() != Some(sum.as_str()) {
                return Err(StoreError::Misconfigured(format!(
                    "migration {name} was changed after it was applied; add a new migration instead"
                ).into()));
            }
            continue;
        }
        for command in commands(name, text) {
            let done_before = done_before(&command);
            match db.run_command(command).await {
                Ok(_) => {}
                Err(e) if matches!(e.kind.as_ref(), ErrorKind::Command(c) if Some(c.code) == done_before) =>
                    {}
                Err(e) => return Err(e.into()),
            }
        }
        let record =
            doc! { "_id": *name, migration::CHECKSUM: sum, migration::APPLIED_AT: DateTime::now() };
        match records.insert_one(record).await {
            Ok(_) => applied.push((*name).to_owned()),
            Err(e) => match StoreError::from(e) {
                // Another instance recorded it first: it ran the same idempotent commands.
                StoreError::DuplicateKey(_) => {}
                other => return Err(other),
            },
        }
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_migration_parses_into_commands() {
        for (name, text) in MIGRATIONS {
            let list = commands(name, text);
            assert!(!list.is_empty(), "{name} has no commands");
        }
    }

    #[test]
    fn migrations_are_listed_in_name_order() {
        let names: Vec<_> = MIGRATIONS.iter().map(|(n, _)| *n).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
    }
}
