//! The query shapes a sharded cluster needs (`docs/scaling.md`): every command of a
//! transfer's hot path (its steps on the log and on the accounts, an idempotency lookup,
//! opening an account) names its collection's shard key, `_id`, by equality or `$in`, so
//! that a router sends it to the shards that own those documents instead of to every
//! shard. The test records every command two deployments' stores send while a bank over
//! them makes transfers (within and across deployments, keyed and replayed), holds that
//! are captured and voided, a reversal, a cancel's fences, and the ledger's reads and
//! moves (`entries` is sharded on `{account, seq}`), and checks each one. Then a
//! tenant's own requests, as the HTTP layer makes them with a tenant's `Scope`: reads of
//! its account (and entries, balance) and transfer, the checks that it sees or owns
//! them, its transfers, holds captured and voided and a cancel, and the lookups of API
//! keys (made, presented, revoked). A tenant's listings filter by tenant, not by `_id`,
//! and go to every shard as the platform's do (`docs/scaling.md`): they are not sent
//! here.

use std::time::Duration;

use mongodb::bson::{Bson, Document};
use support::{database_uris, fresh_database_name, values};
use transfer_service::domain::{
    Amount, ApiKeyId, Currency, DeploymentName, IdempotencyKey, KeyScope, OpeningBalance, Role,
    Scope, ScopedKey, TenantName,
};
use transfer_service::service::{Completion, KeyBook, NewAccount, NewTransfer, TransferService};
use transfer_service::store::accounts::FenceWhen;
use transfer_service::store::testing::{SentCommands, connect_keeping_commands};
use transfer_service::store::{ApiKeyStore, Deployments};

/// Each collection the service writes, and its shard key (`docs/scaling.md`).
const SHARD_KEYS: [(&str, &str); 6] = [
    ("accounts", "_id"),
    ("entries", "account"),
    ("transactions", "_id"),
    ("idempotencyKeys", "_id"),
    ("accountDirectory", "_id"),
    ("apiKeys", "_id"),
];

/// Point reads by a unique index other than the shard key, on a collection that stays
/// unsharded (`docs/scaling.md`): one document, from the one shard that holds the
/// collection. `apiKeys` is found by the SHA-256 of the presented secret.
const UNIQUE_POINT_READS: [(&str, &str); 1] = [("apiKeys", "sha256")];

/// The filters (or, for an insert, the documents) of a command on one of our
/// collections: the collection, and each filter.
fn filters(name: &str, command: &Document) -> Option<(String, Vec<Document>)> {
    let collection = command.get_str(name).ok()?.to_owned();
    let docs = |field: &str, inner: Option<&str>| -> Vec<Document> {
        command
            .get_array(field)
            .map(|list| {
                list.iter()
                    .filter_map(Bson::as_document)
                    .filter_map(|d| match inner {
                        Some(inner) => d.get_document(inner).ok().cloned(),
                        None => Some(d.clone()),
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let found = match name {
        "find" => vec![command.get_document("filter").cloned().unwrap_or_default()],
        "update" => docs("updates", Some("q")),
        "delete" => docs("deletes", Some("q")),
        "findAndModify" => vec![command.get_document("query").cloned().unwrap_or_default()],
        "insert" => docs("documents", None),
        "aggregate" | "count" | "distinct" => {
            vec![command.get_document("query").cloned().unwrap_or_default()]
        }
        _ => return None,
    };
    Some((collection, found))
}

/// Whether `filter` names `key` by equality or by `$in`, so that a router can target it.
fn targets(filter: &Document, key: &str) -> bool {
    match filter.get(key) {
        None => false,
        Some(Bson::Document(condition)) => {
            condition.keys().count() == 1 && condition.contains_key("$in")
        }
        Some(_) => true,
    }
}

fn checked(recorded: &SentCommands) -> (usize, Vec<String>) {
    let recorded = recorded.lock().unwrap();
    let mut count = 0;
    let mut scattered = Vec::new();
    for (name, command) in recorded.iter() {
        let Some((collection, filters)) = filters(name, command) else {
            continue;
        };
        let Some((_, key)) = SHARD_KEYS.iter().find(|(c, _)| *c == collection) else {
            continue;
        };
        let point = |filter: &Document| {
            UNIQUE_POINT_READS
                .iter()
                .any(|(c, unique)| *c == collection && name == "find" && targets(filter, unique))
        };
        for filter in filters {
            count += 1;
            if !targets(&filter, key) && !point(&filter) {
                scattered.push(format!("{name} on {collection}: {filter}"));
            }
        }
    }
    (count, scattered)
}

#[tokio::test]
async fn every_hot_path_command_names_its_collections_shard_key() {
    let uris = database_uris(2);
    let database = fresh_database_name();
    let mut stores = Vec::new();
    let mut records = Vec::new();
    for (name, uri) in ["eu", "us"].iter().zip(&uris) {
        let (store, recorded) =
            connect_keeping_commands(DeploymentName::parse(name).unwrap(), uri, &database)
                .await
                .unwrap();
        store.migrate().await.unwrap();
        recorded.lock().unwrap().clear();
        stores.push(store);
        records.push(recorded);
    }
    let bank = TransferService::new(
        Deployments::new(stores.clone()),
        "shapes",
        Duration::from_secs(10),
    );
    for (id, deployment) in [("a", "eu"), ("b", "us"), ("c", "eu")] {
        bank.book()
            .open_account(NewAccount {
                tenant: None,
                id: Some(values::account(id)),
                name: None,
                balance: OpeningBalance::parse(10_000).unwrap(),
                currency: Currency::usd(),
                deployment: Some(DeploymentName::parse(deployment).unwrap()),
            })
            .await
            .unwrap();
    }
    let new = |source: &str, destination: &str, amount: i64, hold: bool| NewTransfer {
        source: values::account(source),
        destination: values::account(destination),
        amount: Amount::parse(amount).unwrap(),
        legs: None,
        reference: None,
        hold: hold.then_some(Duration::from_secs(60)),
        scope: Scope::Platform,
    };
    // Keyed: shared (no API keys); then of an API key, for the same request (it finds
    // the shared key taken before and answers with its transfer) and for a new one.
    let key = |raw: &str| IdempotencyKey::parse(raw).unwrap();
    let api_key = KeyScope::ApiKey(ApiKeyId::parse(&"ab".repeat(16)).unwrap());
    let keys = [
        ScopedKey::shared(key("shape-1")),
        ScopedKey {
            scope: api_key.clone(),
            key: key("shape-1"),
        },
        ScopedKey {
            scope: api_key,
            key: key("shape-2"),
        },
    ];
    for key in keys {
        for _ in 0..2 {
            let made = bank
                .requests()
                .transfer(
                    new("a", "b", 100, false),
                    Some(key.clone()),
                    Completion::Wait,
                )
                .await
                .unwrap();
            assert_eq!(made.transfer.state.as_str(), "done");
        }
    }
    bank.requests()
        .transfer(new("a", "c", 50, false), None, Completion::Wait)
        .await
        .unwrap();
    let captured = bank
        .requests()
        .transfer(new("a", "b", 300, true), None, Completion::Wait)
        .await
        .unwrap();
    bank.requests()
        .capture(captured.transfer.id, Some(Amount::parse(200).unwrap()))
        .await
        .unwrap();
    let voided = bank
        .requests()
        .transfer(new("b", "a", 30, true), None, Completion::Wait)
        .await
        .unwrap();
    bank.requests().void(voided.transfer.id).await.unwrap();
    let reversed = bank
        .requests()
        .transfer(new("c", "b", 40, false), None, Completion::Wait)
        .await
        .unwrap();
    let after = bank.requests().cancel(reversed.transfer.id).await.unwrap();
    assert!(after.reversed_by.is_some());
    // A cancel's steps on a transfer it takes over: the mark, the fences, their removal.
    let (eu, us) = (&stores[0], &stores[1]);
    let unfinished = values::initial("c", "b", 1);
    eu.transfers().insert_transfer(&unfinished).await.unwrap();
    let id = unfinished.id;
    let since = eu.transfers().mark_fenced(id).await.unwrap();
    assert!(since.is_some());
    let deadline = values::from_now(5_000);
    eu.accounts()
        .fence(
            &values::account("c"),
            id,
            FenceWhen::UnlessApplied,
            deadline,
        )
        .await
        .unwrap();
    us.accounts()
        .fence(&values::account("b"), id, FenceWhen::Always, deadline)
        .await
        .unwrap();
    us.accounts()
        .drop_fences(&[&values::account("b")], id)
        .await
        .unwrap();
    // The ledger: reads of a statement and of a balance as of a moment, and the moves
    // of entries out of the account documents (by each store's copier, in the background).
    for id in ["a", "b"] {
        let account = values::account(id);
        assert!(bank.book().entries(&account, 0, 1000).await.unwrap().len() > 2);
        bank.book()
            .balance_at(&account, Some(values::from_now(-1_000)))
            .await
            .unwrap();
    }
    // A tenant's own requests, as the HTTP layer makes them for a tenant's key: each
    // read and each check of what the tenant sees or owns names `_id`.
    let acme = Scope::Tenant(TenantName::parse("acme").unwrap());
    for (id, deployment) in [("ta", "eu"), ("tb", "us")] {
        bank.book()
            .open_account(NewAccount {
                tenant: Some(TenantName::parse("acme").unwrap()),
                id: Some(values::account(id)),
                name: None,
                balance: OpeningBalance::parse(10_000).unwrap(),
                currency: Currency::usd(),
                deployment: Some(DeploymentName::parse(deployment).unwrap()),
            })
            .await
            .unwrap();
    }
    let own = |source: &str, destination: &str, amount: i64, hold: bool| NewTransfer {
        scope: acme.clone(),
        ..new(source, destination, amount, hold)
    };
    let paid = bank
        .requests()
        .transfer(own("ta", "tb", 100, false), None, Completion::Wait)
        .await
        .unwrap();
    let held = bank
        .requests()
        .transfer(own("ta", "tb", 300, true), None, Completion::Wait)
        .await
        .unwrap();
    let to_void = bank
        .requests()
        .transfer(own("tb", "ta", 30, true), None, Completion::Wait)
        .await
        .unwrap();
    for made in [&paid, &held, &to_void] {
        let id = made.transfer.id;
        bank.requests().transfer_in(&acme, id).await.unwrap();
        bank.requests()
            .check_transfer_owned(&acme, id)
            .await
            .unwrap();
    }
    bank.requests()
        .capture(held.transfer.id, None)
        .await
        .unwrap();
    bank.requests().void(to_void.transfer.id).await.unwrap();
    let after = bank.requests().cancel(paid.transfer.id).await.unwrap();
    assert!(after.reversed_by.is_some());
    // Read once no hold is pending on them (an account read with holds pending also looks
    // for expired ones: a scatter, `docs/scaling.md`).
    for account in ["ta", "tb"] {
        let account = values::account(account);
        bank.book().account_in(&acme, &account).await.unwrap();
        bank.book()
            .check_account_seen(&acme, &account)
            .await
            .unwrap();
        assert!(bank.book().entries(&account, 0, 1000).await.unwrap().len() > 1);
        bank.book().balance_at(&account, None).await.unwrap();
    }
    // Another tenant's read of them: refused, and still by `_id`.
    let bolt = Scope::Tenant(TenantName::parse("bolt").unwrap());
    assert!(
        bank.book()
            .account_in(&bolt, &values::account("ta"))
            .await
            .is_err()
    );
    assert!(
        bank.requests()
            .transfer_in(&bolt, paid.transfer.id)
            .await
            .is_err()
    );
    // API keys: made, presented (found by the digest of its secret), revoked by `_id`.
    let keys = KeyBook::new(ApiKeyStore::new(stores[0].database()));
    let made = keys
        .make(Some(TenantName::parse("acme").unwrap()), Role::ReadWrite)
        .await
        .unwrap();
    assert!(keys.authenticate(&made.secret).await.unwrap().is_some());
    let nobodys = format!("tsk_{}", "A".repeat(43));
    assert!(keys.authenticate(&nobodys).await.unwrap().is_none());
    keys.revoke(&made.record.id, Some(&TenantName::parse("acme").unwrap()))
        .await
        .unwrap();
    let key_commands = |recorded: &SentCommands| {
        recorded
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, command)| {
                ["insert", "find", "delete"]
                    .iter()
                    .any(|name| command.get_str(name).ok() == Some("apiKeys"))
            })
            .count()
    };
    assert!(
        key_commands(&records[0]) >= 4,
        "the key's insert, lookups and revocation were recorded"
    );
    // A token that has not the form of a made key costs the database nothing.
    let before = key_commands(&records[0]);
    for made_up in ["tsk_nobody", "rw-0123456789abcdef", &format!("{nobodys}x")] {
        assert!(keys.authenticate(made_up).await.unwrap().is_none());
    }
    assert_eq!(
        key_commands(&records[0]),
        before,
        "made-up tokens were looked up"
    );

    let moved_on = |recorded: &SentCommands| {
        recorded.lock().unwrap().iter().any(|(name, command)| {
            name == "insert" && command.get_str("insert").ok() == Some("entries")
        })
    };
    support::eventually(
        "each store's copier moved entries",
        Duration::from_secs(10),
        Duration::from_millis(20),
        async || records.iter().all(moved_on).then_some(()),
    )
    .await;

    let mut total = 0;
    for (name, recorded) in ["eu", "us"].iter().zip(&records) {
        let (count, scattered) = checked(recorded);
        assert!(
            scattered.is_empty(),
            "commands on {name} that would go to every shard:\n{}",
            scattered.join("\n")
        );
        total += count;
    }
    // A transfer alone is a dozen commands: the check looked at all of them.
    assert!(total >= 60, "only {total} commands were checked");
    eprintln!("{total} hot-path commands checked, each names its shard key");
}

#[test]
fn a_filter_without_the_shard_key_or_with_a_range_on_it_is_not_targeted() {
    use mongodb::bson::doc;
    assert!(targets(&doc! { "_id": "alice", "state": "pending" }, "_id"));
    assert!(targets(&doc! { "_id": { "$in": ["a", "b"] } }, "_id"));
    assert!(!targets(&doc! { "source": "alice" }, "_id"));
    assert!(!targets(&doc! { "_id": { "$lt": 5 } }, "_id"));
}
