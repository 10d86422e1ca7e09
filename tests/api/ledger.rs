//! The ledger (`GET /accounts/{id}/entries`, `GET /accounts/{id}/balance`): every change
//! to an account's `balance`, `pendingDebits` or `pendingCredits` is an entry, numbered
//! per account from 1.
//!
//! Invariants protected here: an account's entries are numbered `1..=seq` without a gap
//! or a repeat, `seq` being the account's own; each entry's values are the previous
//! entry's (zeros before the first) plus its changes; the last entry's values are the
//! account's; each step of a transfer makes exactly one entry, of its kind, naming the
//! transfer; a step refused makes none; an entry is readable as soon as the request that
//! made it was answered, and reads the same once the copier has taken it out of the
//! account's document; the balance as of a moment is the one the last entry at or before
//! it left.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, TimeDelta, Utc};
use mongodb::bson::{Document, doc};
use serde_json::{Value, json};
use transfer_service::domain::EntryKind;

use crate::{assert_problem, get_json};
use support::{TestApp, eventually, spawn_app};

/// The largest balance an account may hold (2^53 - 1).
const MAX_MONEY: i64 = 9_007_199_254_740_991;

/// One page of `account`'s entries: `GET /accounts/{account}/entries{query}`, asserted 200.
async fn entry_page(app: &TestApp, account: &str, query: &str) -> Value {
    let path = format!("/accounts/{account}/entries{query}");
    let (status, page) = get_json(app, &path).await;
    assert_eq!(status, 200, "GET {path}: {page}");
    page
}

/// Every entry of `account` (up to 1000, one page), oldest first.
async fn entries(app: &TestApp, account: &str) -> Vec<Value> {
    let page = entry_page(app, account, "?limit=1000").await;
    page["items"]
        .as_array()
        .unwrap_or_else(|| panic!("a page has items: {page}"))
        .clone()
}

/// `GET /accounts/{account}`, asserted 200.
async fn account_json(app: &TestApp, account: &str) -> Value {
    let (status, body) = get_json(app, &format!("/accounts/{account}")).await;
    assert_eq!(status, 200, "{body}");
    body
}

/// `GET /accounts/{account}/balance`, at `at` when given, asserted 200.
async fn balance_at(app: &TestApp, account: &str, at: Option<&str>) -> Value {
    let path = match at {
        Some(at) => format!("/accounts/{account}/balance?at={at}"),
        None => format!("/accounts/{account}/balance"),
    };
    let (status, body) = get_json(app, &path).await;
    assert_eq!(status, 200, "GET {path}: {body}");
    body
}

fn int(value: &Value, name: &str) -> i64 {
    value[name]
        .as_i64()
        .unwrap_or_else(|| panic!("{name} is an integer in {value}"))
}

fn seq(entry: &Value) -> i64 {
    int(entry, "seq")
}

fn kinds(entries: &[Value]) -> Vec<&str> {
    entries
        .iter()
        .map(|e| e["kind"].as_str().expect("a kind"))
        .collect()
}

fn at(entry: &Value) -> DateTime<Utc> {
    entry["at"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("at is an RFC 3339 time in {entry}"))
}

/// A time as a query value, to the microsecond.
fn rfc3339(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// (balance, pendingDebits, pendingCredits) of an entry or an account.
fn amounts(value: &Value) -> (i64, i64, i64) {
    (
        int(value, "balance"),
        int(value, "pendingDebits"),
        int(value, "pendingCredits"),
    )
}

/// (balanceChange, pendingDebitsChange, pendingCreditsChange) of an entry.
fn changes(entry: &Value) -> (i64, i64, i64) {
    (
        int(entry, "balanceChange"),
        int(entry, "pendingDebitsChange"),
        int(entry, "pendingCreditsChange"),
    )
}

/// Asserts the ledger invariants on `account`'s entries as read now: numbered 1, 2, ...
/// without a gap; each entry's values the previous ones (zeros before the first) plus its
/// changes, with `availableBalance = balance - pendingDebits`; times that never go back;
/// and the last entry's values and number those of `GET /accounts/{account}`. Returns
/// the entries.
async fn assert_ledger(app: &TestApp, account: &str) -> Vec<Value> {
    let entries = entries(app, account).await;
    let mut before = (0, 0, 0);
    let mut previous_at = None;
    for (i, entry) in entries.iter().enumerate() {
        assert_eq!(entry["account"], account, "{entry}");
        assert_eq!(
            seq(entry),
            i as i64 + 1,
            "numbered without gaps: {entries:#?}"
        );
        let (db, dd, dc) = changes(entry);
        let expected = (before.0 + db, before.1 + dd, before.2 + dc);
        assert_eq!(
            amounts(entry),
            expected,
            "values = previous + change: {entry}"
        );
        assert_eq!(
            int(entry, "availableBalance"),
            expected.0 - expected.1,
            "{entry}"
        );
        let this_at = at(entry);
        assert!(
            previous_at.is_none_or(|p| p <= this_at),
            "at never goes back: {entries:#?}"
        );
        before = expected;
        previous_at = Some(this_at);
    }
    let stored = account_json(app, account).await;
    let last = entries.last().expect("an account has its opening entry");
    assert_eq!(
        stored["seq"], last["seq"],
        "account seq = last entry's: {stored}"
    );
    assert_eq!(
        amounts(&stored),
        amounts(last),
        "last entry = account: {stored}"
    );
    entries
}

/// Asserts that `entry` is of `kind`, made by `transfer` (none: no `transferId`), with
/// these changes.
fn assert_entry(entry: &Value, kind: &str, transfer: Option<&str>, change: (i64, i64, i64)) {
    assert_eq!(entry["kind"], kind, "{entry}");
    match transfer {
        Some(id) => assert_eq!(entry["transferId"], id, "{entry}"),
        None => assert!(entry.get("transferId").is_none(), "{entry}"),
    }
    assert_eq!(changes(entry), change, "{entry}");
    assert!(entry.get("carriedForward").is_none(), "{entry}");
}

/// A transfer asserted done; its id.
async fn done(app: &TestApp, source: &str, destination: &str, amount: i64) -> String {
    let (status, body) = app.transfer(source, destination, amount).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["state"], "done", "{body}");
    body["id"].as_str().expect("an id").to_owned()
}

/// `POST {path}` with `body` as JSON (none: no body), asserted 200; the transfer as
/// answered.
async fn post_ok(app: &TestApp, path: &str, body: Option<Value>) -> Value {
    let request = app.http.post(app.url(path));
    let request = match body {
        Some(body) => request.json(&body),
        None => request,
    };
    let response = request.send().await.expect("request");
    let status = response.status();
    let text = response.text().await.unwrap();
    assert_eq!(status, 200, "POST {path}: {text}");
    serde_json::from_str(&text).unwrap()
}

/// A hold of `amount` from alice to bob for a minute, asserted held; its id.
async fn hold(app: &TestApp, amount: i64) -> String {
    let body = json!({
        "source": "alice", "destination": "bob", "amount": amount,
        "hold": { "expiresInMs": 60_000 },
    });
    let response = app.post_json("/transfers", body).await;
    let status = response.status();
    let body: Value = response.json().await.unwrap();
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["state"], "held", "{body}");
    body["id"].as_str().expect("an id").to_owned()
}

/// `account`'s document as stored.
async fn account_document(app: &TestApp, account: &str) -> Document {
    app.store
        .database()
        .collection::<Document>("accounts")
        .find_one(doc! { "_id": account })
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{account} is stored"))
}

/// The numbers of the entries still in `account`'s document.
pub(crate) async fn seqs_in_document(app: &TestApp, account: &str) -> Vec<i64> {
    account_document(app, account)
        .await
        .get_array("recentEntries")
        .map_or(Vec::new(), |recent| {
            recent
                .iter()
                .filter_map(|e| e.as_document()?.get_i64("seq").ok())
                .collect()
        })
}

/// Waits until the copier has copied `account`'s `count` entries to `entries`, then makes
/// one more, a credit of 1 from `from`: the write that leaves the copied ones out of the
/// document. Checks that it did, and answers the newest entry's number. (The copier
/// remembers a copy just after `entries` shows it: should the credit come in between,
/// the next one leaves them out; a few are allowed.)
async fn move_out_of_document(app: &TestApp, account: &str, from: &str, count: usize) -> i64 {
    let copied = async || {
        app.store
            .database()
            .collection::<Document>("entries")
            .count_documents(doc! { "account": account })
            .await
            .unwrap()
    };
    eventually(
        &format!("the copier copies {account}'s entries to `entries`"),
        Duration::from_secs(10),
        Duration::from_millis(20),
        async || (copied().await >= count as u64).then_some(()),
    )
    .await;
    assert!(
        !seqs_in_document(app, account).await.is_empty(),
        "copied entries stay in the document until the next change"
    );
    let mut newest = count as i64;
    for _ in 0..5 {
        done(app, from, account, 1).await;
        newest += 1;
        if seqs_in_document(app, account).await == [newest] {
            return newest;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "the changes left the copied entries in {account}'s document: {:?}",
        seqs_in_document(app, account).await
    );
}

async fn alice_and_bob(app: &TestApp, alice: i64, bob: i64) {
    app.open_account("alice", alice).await;
    app.open_account("bob", bob).await;
}

#[tokio::test]
async fn opening_an_account_is_its_entry_1_opened_with_the_opening_balance() {
    let app = spawn_app().await;
    for (id, balance) in [("alice", 1_000), ("empty", 0)] {
        app.open_account(id, balance).await;

        let entries = assert_ledger(&app, id).await;

        assert_eq!(entries.len(), 1, "{entries:#?}");
        assert_eq!(seq(&entries[0]), 1);
        assert_entry(&entries[0], "opened", None, (balance, 0, 0));
        assert_eq!(amounts(&entries[0]), (balance, 0, 0));
        assert_eq!(account_json(&app, id).await["seq"], 1);
    }
}

#[tokio::test]
async fn a_done_transfer_is_one_debit_of_the_source_and_one_credit_of_the_destination() {
    let app = spawn_app().await;
    alice_and_bob(&app, 1_000, 50).await;

    let id = done(&app, "alice", "bob", 300).await;

    let alice = assert_ledger(&app, "alice").await;
    assert_eq!(kinds(&alice), ["opened", "debit"]);
    assert_entry(&alice[1], "debit", Some(&id), (-300, 0, 0));
    assert_eq!(amounts(&alice[1]), (700, 0, 0));
    let bob = assert_ledger(&app, "bob").await;
    assert_eq!(kinds(&bob), ["opened", "credit"]);
    assert_entry(&bob[1], "credit", Some(&id), (300, 0, 0));
    assert_eq!(amounts(&bob[1]), (350, 0, 0));
    assert_eq!(account_json(&app, "alice").await["seq"], 2);
}

#[tokio::test]
async fn a_transfer_refused_for_insufficient_funds_leaves_no_entry() {
    let app = spawn_app().await;
    alice_and_bob(&app, 100, 0).await;

    let (status, problem) = app.transfer("alice", "bob", 500).await;

    assert_eq!(status, 422, "{problem}");
    assert_eq!(problem["code"], "insufficient_funds");
    assert_eq!(kinds(&assert_ledger(&app, "alice").await), ["opened"]);
    assert_eq!(kinds(&assert_ledger(&app, "bob").await), ["opened"]);
}

/// A credit that would take the destination past the largest balance is refused after
/// the source's debit landed: the rollback gives the debit back, and both show.
#[tokio::test]
async fn a_rollback_after_the_debit_shows_the_debit_then_its_undo() {
    let app = spawn_app().await;
    app.open_account("alice", 10).await;
    app.open_account("full", MAX_MONEY).await;

    let response = app
        .post_json(
            "/transfers",
            json!({ "source": "alice", "destination": "full", "amount": 4 }),
        )
        .await;

    let problem = assert_problem(response, 422, "balance_overflow").await;
    let id = problem["transferId"]
        .as_str()
        .expect("the transfer is named");
    let alice = assert_ledger(&app, "alice").await;
    assert_eq!(kinds(&alice), ["opened", "debit", "debit_undone"]);
    assert_entry(&alice[1], "debit", Some(id), (-4, 0, 0));
    assert_entry(&alice[2], "debit_undone", Some(id), (4, 0, 0));
    assert_eq!(amounts(&alice[2]), (10, 0, 0));
    assert_eq!(kinds(&assert_ledger(&app, "full").await), ["opened"]);
}

#[tokio::test]
async fn a_hold_reserves_and_its_capture_moves_the_captured_amount_and_ends_the_reservation() {
    let app = spawn_app().await;
    alice_and_bob(&app, 1_000, 0).await;
    let id = hold(&app, 300).await;

    let alice = assert_ledger(&app, "alice").await;
    assert_eq!(kinds(&alice), ["opened", "debit_reserved"]);
    assert_entry(&alice[1], "debit_reserved", Some(&id), (0, 300, 0));
    let bob = assert_ledger(&app, "bob").await;
    assert_eq!(kinds(&bob), ["opened", "credit_reserved"]);
    assert_entry(&bob[1], "credit_reserved", Some(&id), (0, 0, 300));

    let captured = post_ok(
        &app,
        &format!("/transfers/{id}/capture"),
        Some(json!({ "amount": 200 })),
    )
    .await;

    assert_eq!(captured["state"], "done", "{captured}");
    let alice = assert_ledger(&app, "alice").await;
    assert_eq!(
        kinds(&alice),
        ["opened", "debit_reserved", "debit_captured"]
    );
    assert_entry(&alice[2], "debit_captured", Some(&id), (-200, -300, 0));
    assert_eq!(amounts(&alice[2]), (800, 0, 0));
    let bob = assert_ledger(&app, "bob").await;
    assert_eq!(
        kinds(&bob),
        ["opened", "credit_reserved", "credit_captured"]
    );
    assert_entry(&bob[2], "credit_captured", Some(&id), (200, 0, -300));
    assert_eq!(amounts(&bob[2]), (200, 0, 0));
}

#[tokio::test]
async fn a_void_releases_both_reservations() {
    let app = spawn_app().await;
    alice_and_bob(&app, 1_000, 0).await;
    let id = hold(&app, 300).await;

    let voided = post_ok(&app, &format!("/transfers/{id}/void"), None).await;

    assert_eq!(voided["state"], "canceled", "{voided}");
    let alice = assert_ledger(&app, "alice").await;
    assert_eq!(
        kinds(&alice),
        ["opened", "debit_reserved", "debit_released"]
    );
    assert_entry(&alice[2], "debit_released", Some(&id), (0, -300, 0));
    assert_eq!(amounts(&alice[2]), (1_000, 0, 0));
    let bob = assert_ledger(&app, "bob").await;
    assert_eq!(
        kinds(&bob),
        ["opened", "credit_reserved", "credit_released"]
    );
    assert_entry(&bob[2], "credit_released", Some(&id), (0, 0, -300));
    assert_eq!(amounts(&bob[2]), (0, 0, 0));
}

#[tokio::test]
async fn a_reversal_is_the_compensating_transfers_own_debit_and_credit() {
    let app = spawn_app().await;
    alice_and_bob(&app, 1_000, 20).await;
    let id = done(&app, "alice", "bob", 300).await;

    let canceled = post_ok(&app, &format!("/transfers/{id}/cancel"), None).await;

    let reversal = canceled["reversedBy"]
        .as_str()
        .unwrap_or_else(|| panic!("a done transfer is reversed: {canceled}"));
    assert_ne!(reversal, id);
    let alice = assert_ledger(&app, "alice").await;
    assert_eq!(kinds(&alice), ["opened", "debit", "credit"]);
    assert_entry(&alice[1], "debit", Some(&id), (-300, 0, 0));
    assert_entry(&alice[2], "credit", Some(reversal), (300, 0, 0));
    let bob = assert_ledger(&app, "bob").await;
    assert_eq!(kinds(&bob), ["opened", "credit", "debit"]);
    assert_entry(&bob[1], "credit", Some(&id), (300, 0, 0));
    assert_entry(&bob[2], "debit", Some(reversal), (-300, 0, 0));
    assert_eq!(amounts(&bob[2]), (20, 0, 0));
}

/// No sleep between the answer and the read: the entry is made by the write that
/// changed the amounts, not later.
#[tokio::test]
async fn entries_are_readable_as_soon_as_the_request_that_made_them_is_answered() {
    let app = spawn_app().await;
    alice_and_bob(&app, 1_000, 0).await;

    for n in 1..=10_i64 {
        let id = done(&app, "alice", "bob", n).await;

        let page = entry_page(&app, "alice", &format!("?after={n}")).await;
        let items = page["items"].as_array().expect("items");
        assert_eq!(items.len(), 1, "transfer {n}'s debit is there: {page}");
        assert_eq!(items[0]["transferId"], id.as_str(), "{page}");
        assert_eq!(seq(&items[0]), n + 1);
        assert_eq!(page["next"], (n + 1).to_string(), "{page}");
        let bob = entry_page(&app, "bob", &format!("?after={n}")).await;
        assert_eq!(bob["items"][0]["transferId"], id.as_str(), "{bob}");
        assert_eq!(bob["items"][0]["kind"], "credit", "{bob}");
    }
    assert_eq!(assert_ledger(&app, "alice").await.len(), 11);
}

/// alice opened with 1 000 and sent 24 transfers to bob, one at a time: 25 entries.
async fn alice_with_25_entries(app: &TestApp) -> Vec<Value> {
    alice_and_bob(app, 1_000, 0).await;
    for n in 1..=24 {
        done(app, "alice", "bob", n).await;
    }
    let entries = assert_ledger(app, "alice").await;
    assert_eq!(entries.len(), 25);
    entries
}

#[tokio::test]
async fn paging_by_next_yields_every_entry_once_in_order_then_an_empty_page() {
    let app = spawn_app().await;
    let all = alice_with_25_entries(&app).await;

    let mut walked = Vec::new();
    let mut sizes = Vec::new();
    let mut after = "0".to_owned();
    loop {
        let page = entry_page(&app, "alice", &format!("?after={after}&limit=7")).await;
        let items = page["items"].as_array().expect("items").clone();
        if items.is_empty() {
            assert_eq!(
                page["next"],
                Value::Null,
                "an empty page has no next: {page}"
            );
            break;
        }
        let last = seq(items.last().unwrap());
        assert_eq!(page["next"], last.to_string(), "{page}");
        after = page["next"].as_str().unwrap().to_owned();
        sizes.push(items.len());
        walked.extend(items);
        assert!(sizes.len() <= 10, "the paging never ends: {sizes:?}");
    }

    assert_eq!(sizes, [7, 7, 7, 4]);
    assert_eq!(walked, all, "every entry once, in order");
    let default = entry_page(&app, "alice", "").await;
    assert_eq!(
        default["items"],
        json!(all),
        "after 0 and limit 100 by default"
    );
    let largest = entry_page(&app, "alice", "?after=20&limit=1000").await;
    assert_eq!(largest["items"], json!(all[20..]));
    assert_eq!(largest["next"], "25");
}

#[tokio::test]
async fn a_bad_after_or_limit_is_400_invalid_parameter() {
    let app = spawn_app().await;
    app.open_account("alice", 10).await;
    for (query, field) in [
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=-1", "limit"),
        ("limit=x", "limit"),
        ("after=x", "after"),
        ("after=-1", "after"),
    ] {
        let response = app.get(&format!("/accounts/alice/entries?{query}")).await;
        let problem = assert_problem(response, 400, "invalid_parameter").await;
        assert_eq!(problem["field"], field, "for {query}: {problem}");
    }
}

#[tokio::test]
async fn entries_read_the_same_after_the_copier_took_them_out_of_the_account_document() {
    let app = spawn_app().await;
    let before = alice_with_25_entries(&app).await;
    let page_before = entry_page(&app, "alice", "?after=3&limit=7").await;

    let newest = move_out_of_document(&app, "alice", "bob", before.len()).await;

    let all = entries(&app, "alice").await;
    assert_eq!(all[..before.len()], before[..], "the whole ledger");
    assert_eq!(seq(all.last().unwrap()), newest, "then the new entries");
    let page_after = entry_page(&app, "alice", "?after=3&limit=7").await;
    assert_eq!(page_after, page_before, "a page from `entries`");
    let across = entry_page(&app, "alice", "?after=20&limit=7").await;
    assert_eq!(
        across["items"],
        json!(all[20..all.len().min(27)]),
        "`entries` then the document"
    );
    assert_ledger(&app, "alice").await;
}

/// The moments to ask a balance at, for alice's entries: before her opening, each
/// entry's own time, and a microsecond before and after it.
fn moments(entries: &[Value]) -> Vec<String> {
    let mut moments = vec![rfc3339(at(&entries[0]) - TimeDelta::milliseconds(1))];
    for entry in entries {
        let t = at(entry);
        for m in [
            t - TimeDelta::microseconds(1),
            t,
            t + TimeDelta::microseconds(1),
        ] {
            moments.push(rfc3339(m));
        }
    }
    moments
}

#[tokio::test]
async fn the_balance_at_a_moment_reads_the_same_after_the_copier_trimmed_the_document() {
    let app = spawn_app().await;
    let entries = alice_with_25_entries(&app).await;
    let mut before = Vec::new();
    for moment in moments(&entries) {
        before.push(balance_at(&app, "alice", Some(&moment)).await);
    }

    move_out_of_document(&app, "alice", "bob", entries.len()).await;

    for (moment, answer) in moments(&entries).iter().zip(&before) {
        let after = balance_at(&app, "alice", Some(moment)).await;
        assert_eq!(&after, answer, "at {moment}");
    }
    assert_eq!(before[0]["seq"], 0, "before the opening: {}", before[0]);
}

/// An instance remembers which of an account's entries it copied to `entries`; an account
/// made again under the same name while it runs (its documents and entries deleted, as
/// when a database is emptied and filled again) numbers its entries from 1 again, and
/// none of them may leave its document uncopied on the strength of that memory.
#[tokio::test]
async fn an_account_made_again_under_the_same_name_keeps_every_entry() {
    let app = spawn_app().await;
    let first = alice_with_25_entries(&app).await;
    move_out_of_document(&app, "alice", "bob", first.len()).await;
    let db = app.store.database();
    for (collection, filter) in [
        ("accounts", doc! { "_id": { "$in": ["alice", "bob"] } }),
        ("entries", doc! {}),
        ("transactions", doc! {}),
    ] {
        db.collection::<Document>(collection)
            .delete_many(filter)
            .await
            .unwrap();
    }

    alice_and_bob(&app, 1_000, 0).await;
    for n in 1..=30 {
        done(&app, "alice", "bob", n).await;
    }
    let again = assert_ledger(&app, "alice").await;
    assert_eq!(again.len(), 31, "opened and 30 debits: {again:#?}");
    assert_eq!(int(&again[30], "balance"), 1_000 - (1..=30).sum::<i64>());
}

/// An account document restored from a backup (numbered below what the instance has
/// copied since, with entries the restored `entries` lacks) keeps every entry: what the
/// instance remembers of the account is of another history.
#[tokio::test]
async fn an_account_document_restored_from_a_backup_keeps_every_entry() {
    let app = spawn_app().await;
    alice_and_bob(&app, 1_000, 0).await;
    // The backup must hold entries. A copier round that lands between a transfer's debit
    // and its settle leaves none in the document (the settle, a write on alice, leaves the
    // copied ones out), so transfers are made until it holds some.
    let mut debits = 0;
    while debits < 10 || seqs_in_document(&app, "alice").await.is_empty() {
        assert!(debits < 30, "alice's document never kept an entry");
        debits += 1;
        done(&app, "alice", "bob", debits).await;
    }
    let backup = account_document(&app, "alice").await;
    let first_in_backup = seqs_in_document(&app, "alice").await[0];
    for n in 1..=10 {
        done(&app, "alice", "bob", n).await;
    }
    let in_backup = 1 + debits as usize;
    let newest = move_out_of_document(&app, "alice", "bob", in_backup + 10).await;
    // The copier done with alice (everything copied, and a few of its rounds since): a
    // round still in flight could copy the old entries again after the restore, the case
    // no instance can tell apart (`docs/operations.md`: restart after a restore).
    let copied = async || {
        let entries = app.store.database().collection::<Document>("entries");
        entries
            .count_documents(doc! { "account": "alice" })
            .await
            .unwrap()
    };
    eventually(
        "the copier copies every entry of alice",
        Duration::from_secs(10),
        Duration::from_millis(20),
        async || (copied().await >= newest as u64).then_some(()),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The restore: the document as it was, and `entries` without what was copied after.
    let accounts = app.store.database().collection::<Document>("accounts");
    accounts
        .replace_one(doc! { "_id": "alice" }, backup)
        .await
        .unwrap();
    app.store
        .database()
        .collection::<Document>("entries")
        .delete_many(doc! { "account": "alice", "seq": { "$gte": first_in_backup } })
        .await
        .unwrap();
    for n in 1..=3 {
        done(&app, "alice", "bob", n).await;
    }
    let after = assert_ledger(&app, "alice").await;
    assert_eq!(
        after.len(),
        in_backup + 3,
        "the backup's {in_backup} and 3 debits: {after:#?}"
    );
}

/// An entry waiting in its account's document leaves out a zero pending change or amount
/// (most entries have none, and the document is rewritten with each write until the
/// entry moves); the API and `entries` have every field all the same.
#[tokio::test]
async fn an_entry_in_the_document_leaves_out_its_zero_pending_amounts() {
    let app = spawn_app().await;
    alice_and_bob(&app, 100, 0).await;
    app.open_account("carol", 0).await;
    hold(&app, 30).await;
    done(&app, "alice", "carol", 10).await;
    // Each account's last entry, which stays in its document until its next change.
    let last_keys = async |account: &str| {
        let stored = account_document(&app, account).await;
        let seq = stored.get_i64("seq").unwrap();
        let recent = stored.get_array("recentEntries").unwrap();
        let last = recent
            .iter()
            .filter_map(|e| e.as_document())
            .find(|e| e.get_i64("seq") == Ok(seq))
            .unwrap_or_else(|| panic!("the last entry in {stored}"));
        let mut keys: Vec<String> = last.keys().cloned().collect();
        keys.sort_unstable();
        keys
    };
    assert_eq!(
        last_keys("carol").await,
        ["at", "b", "db", "k", "seq", "tx"],
        "a credit, no holds"
    );
    assert_eq!(
        last_keys("alice").await,
        ["at", "b", "db", "k", "pd", "seq", "tx"],
        "a debit, 30 held"
    );
    assert_eq!(
        last_keys("bob").await,
        ["at", "b", "db", "dpc", "k", "pc", "seq", "tx"],
        "a reservation in"
    );
    let carol = assert_ledger(&app, "carol").await;
    assert_eq!(carol[1]["pendingDebitsChange"], 0, "{}", carol[1]);
    assert_eq!(carol[1]["pendingCredits"], 0, "{}", carol[1]);
    let alice = assert_ledger(&app, "alice").await;
    assert_eq!(alice[2]["pendingDebits"], 30, "{}", alice[2]);
}

/// The expected answer to a balance at `moment`: the values of the last entry whose `at`
/// is not later, or seq 0 and zeros.
fn expected_balance(entries: &[Value], moment: DateTime<Utc>) -> (i64, (i64, i64, i64)) {
    entries
        .iter()
        .rev()
        .find(|e| at(e) <= moment)
        .map_or((0, (0, 0, 0)), |e| (seq(e), amounts(e)))
}

fn answered_balance(answer: &Value) -> (i64, (i64, i64, i64)) {
    assert_eq!(
        int(answer, "availableBalance"),
        int(answer, "balance") - int(answer, "pendingDebits"),
        "{answer}"
    );
    (seq(answer), amounts(answer))
}

/// An answer for a moment can change while an entry may still be stamped at or before
/// it: one in flight, or one stamped by a member whose clock is behind after a failover.
/// It says whether it is final: only once the database's clock passed the moment by
/// the margin (a minute), never for now, the future, or a moment within the margin.
#[tokio::test]
async fn a_balance_is_final_only_for_a_moment_the_databases_clock_passed_by_the_margin() {
    let app = spawn_app().await;
    alice_and_bob(&app, 1_000, 0).await;
    done(&app, "alice", "bob", 10).await;
    let entries = assert_ledger(&app, "alice").await;
    let last = at(entries.last().unwrap());

    let current = balance_at(&app, "alice", None).await;
    assert_eq!(current["final"], false, "the amounts now: {current}");
    let now: DateTime<Utc> = current["at"].as_str().unwrap().parse().unwrap();
    let margin = TimeDelta::from_std(transfer_service::service::FINAL_AFTER).unwrap();
    assert_eq!(
        margin,
        TimeDelta::minutes(1),
        "the margin docs/ledger.md states"
    );
    for (moment, expected, which) in [
        (now + TimeDelta::hours(1), false, "in the future"),
        (last, false, "the last entry's, just made"),
        (
            now - margin + TimeDelta::seconds(10),
            false,
            "within the margin",
        ),
        (
            now - margin - TimeDelta::seconds(10),
            true,
            "past the margin",
        ),
        ("2000-01-01T00:00:00Z".parse().unwrap(), true, "long ago"),
    ] {
        let answer = balance_at(&app, "alice", Some(&rfc3339(moment))).await;
        assert_eq!(answer["final"], expected, "{which}: {answer}");
    }
}

#[tokio::test]
async fn the_balance_at_a_moment_is_what_the_last_entry_at_or_before_it_left() {
    let app = spawn_app().await;
    alice_and_bob(&app, 1_000, 0).await;
    // A pause between the requests, so that some entries of alice's differ in time by a
    // few milliseconds.
    for n in 1..=4 {
        tokio::time::sleep(Duration::from_millis(5)).await;
        done(&app, "alice", "bob", n * 10).await;
    }
    hold(&app, 100).await;
    let entries = assert_ledger(&app, "alice").await;
    assert_eq!(entries.len(), 6);

    // Before the opening: nothing yet.
    let opened = at(&entries[0]);
    for early in [
        opened - TimeDelta::milliseconds(1),
        "2000-01-01T00:00:00Z".parse().unwrap(),
    ] {
        let answer = balance_at(&app, "alice", Some(&rfc3339(early))).await;
        assert_eq!(answered_balance(&answer), (0, (0, 0, 0)), "{answer}");
        assert_eq!(answer["account"], "alice");
        assert_eq!(
            answer["at"]
                .as_str()
                .unwrap()
                .parse::<DateTime<Utc>>()
                .unwrap(),
            early
        );
    }
    // Exactly at each entry's time: the last entry with that time.
    for entry in &entries {
        let t = at(entry);
        let answer = balance_at(&app, "alice", Some(&rfc3339(t))).await;
        let last_with_that_time = entries.iter().filter(|e| at(e) == t).map(seq).max();
        assert_eq!(Some(seq(&answer)), last_with_that_time, "at {t}: {answer}");
        assert_eq!(
            answered_balance(&answer),
            expected_balance(&entries, t),
            "at {t}"
        );
    }
    // Between two entries whose times differ: the earlier one's.
    let mut between = 0;
    for pair in entries.windows(2) {
        let (earlier, later) = (at(&pair[0]), at(&pair[1]));
        if later - earlier < TimeDelta::milliseconds(2) {
            continue;
        }
        for moment in [
            earlier + TimeDelta::milliseconds(1),
            later - TimeDelta::microseconds(1),
        ] {
            let answer = balance_at(&app, "alice", Some(&rfc3339(moment))).await;
            assert_eq!(
                answered_balance(&answer),
                (seq(&pair[0]), amounts(&pair[0])),
                "between entries {} and {}, at {moment}: {answer}",
                pair[0]["seq"],
                pair[1]["seq"]
            );
        }
        between += 1;
    }
    assert!(
        between >= 2,
        "entries a few ms apart to ask between: {entries:#?}"
    );
}

/// A time in the future answers the current amounts, right after the request that made
/// the latest entry; so does no time (also checked across instances by
/// `the_balance_without_a_time_includes_an_entry_acknowledged_just_before_the_request`).
#[tokio::test]
async fn the_balance_in_the_future_is_the_current_one() {
    let app = spawn_app().await;
    alice_and_bob(&app, 1_000, 0).await;
    let future = rfc3339(Utc::now() + TimeDelta::days(1));

    // Each right after the request that made the latest entry, with no pause.
    for n in 1..=10 {
        if n % 2 == 0 {
            hold(&app, n).await;
        } else {
            done(&app, "alice", "bob", n).await;
        }
        let stored = account_json(&app, "alice").await;
        let current = (int(&stored, "seq"), amounts(&stored));

        let later = balance_at(&app, "alice", Some(&future)).await;
        assert_eq!(answered_balance(&later), current, "in the future: {later}");
        let now = balance_at(&app, "alice", None).await;
        let asked: DateTime<Utc> = now["at"]
            .as_str()
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("without a time, the time used: {now}"));
        let entries = entries(&app, "alice").await;
        assert_eq!(
            answered_balance(&now),
            expected_balance(&entries, asked),
            "without a time: {now}"
        );
    }
}

#[tokio::test]
async fn a_malformed_time_is_422_invalid_field_at() {
    let app = spawn_app().await;
    app.open_account("alice", 10).await;
    for raw in ["nope", "2026-13-01T00:00:00Z", "2026-10-31"] {
        let response = app.get(&format!("/accounts/alice/balance?at={raw}")).await;
        let problem = assert_problem(response, 422, "invalid_field").await;
        assert_eq!(problem["field"], "at", "for {raw}: {problem}");
    }
}

#[tokio::test]
async fn an_unknown_account_has_neither_entries_nor_a_balance() {
    let app = spawn_app().await;
    app.open_account("alice", 10).await;
    for path in [
        "/accounts/nobody/entries",
        "/accounts/nobody/entries?after=0&limit=10",
        "/accounts/nobody/balance",
        "/accounts/nobody/balance?at=2026-10-31T23:59:59.999Z",
    ] {
        assert_problem(app.get(path).await, 404, "account_not_found").await;
    }
}

/// 40 transfers at once, half out of and half into one account, spread over four
/// others: the group commit puts several of them in one write, which must number each
/// entry after the one before it all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_transfers_on_one_hot_account_number_its_entries_without_gaps_or_repeats() {
    const OTHERS: [&str; 4] = ["bob", "carol", "dave", "erin"];
    let app = spawn_app().await;
    app.open_account("hot", 10_000).await;
    for id in OTHERS {
        app.open_account(id, 10_000).await;
    }
    let opening_total = 50_000;

    let requests = (0..40).map(|i| {
        let other = OTHERS[i % OTHERS.len()];
        let (source, destination) = if i % 2 == 0 {
            ("hot", other)
        } else {
            (other, "hot")
        };
        let amount = 10 + i as i64;
        let http = app.http.clone();
        let url = app.url("/transfers");
        let body = json!({ "source": source, "destination": destination, "amount": amount });
        tokio::spawn(async move {
            let response = http.post(url).json(&body).send().await.expect("request");
            let status = response.status().as_u16();
            let answer: Value = response.json().await.expect("json");
            assert_eq!(status, 201, "{body}: {answer}");
            answer
        })
    });
    let answers: Vec<Value> = futures::future::join_all(requests)
        .await
        .into_iter()
        .map(|joined| joined.expect("task"))
        .collect();

    let mut ledgers = std::collections::HashMap::new();
    for id in std::iter::once("hot").chain(OTHERS) {
        let entries = assert_ledger(&app, id).await;
        let mut steps = HashSet::new();
        for entry in &entries[1..] {
            let step = (entry["transferId"].clone(), entry["kind"].clone());
            assert!(
                steps.insert(step),
                "one entry per transfer and kind: {entry}"
            );
        }
        ledgers.insert(id, entries);
    }
    assert_eq!(
        ledgers["hot"].len(),
        41,
        "the opening and one entry per transfer"
    );
    for answer in &answers {
        assert_eq!(answer["state"], "done", "{answer}");
        for (account, kind, sign) in [("source", "debit", -1), ("destination", "credit", 1)] {
            let ledger = &ledgers[answer[account].as_str().unwrap()];
            let made: Vec<&Value> = ledger
                .iter()
                .filter(|e| e["transferId"] == answer["id"])
                .collect();
            assert_eq!(
                made.len(),
                1,
                "one entry of {answer} on its {account}: {made:?}"
            );
            assert_entry(
                made[0],
                kind,
                answer["id"].as_str(),
                (sign * int(answer, "amount"), 0, 0),
            );
        }
    }
    let total: i64 = ledgers
        .values()
        .map(|entries| int(entries.last().unwrap(), "balance"))
        .sum();
    assert_eq!(
        total, opening_total,
        "the last balances add up to the opening total"
    );
    // Entries of one group-committed write share a time: a balance at it is the last.
    let hot = &ledgers["hot"];
    for entry in hot {
        let t = at(entry);
        let answer = balance_at(&app, "hot", Some(&rfc3339(t))).await;
        assert_eq!(
            answered_balance(&answer),
            expected_balance(hot, t),
            "at {t}"
        );
    }
}

/// `EntryKindSchema` (the OpenAPI document's copy of the kinds) is written out by hand
/// next to the domain's `EntryKind`: a kind added to one and not the other shows here.
#[tokio::test]
async fn the_openapi_entry_kinds_are_exactly_the_domains() {
    let doc = serde_json::to_value(transfer_service::http::openapi()).unwrap();
    let schemas = &doc["components"]["schemas"];
    let kind = &schemas["EntryResponse"]["properties"]["kind"];
    let resolved = match kind["$ref"].as_str() {
        Some(reference) => {
            let name = reference.rsplit('/').next().unwrap();
            &schemas[name]
        }
        None => kind,
    };
    let listed: HashSet<&str> = resolved["enum"]
        .as_array()
        .unwrap_or_else(|| panic!("the kind is an enum: {resolved}"))
        .iter()
        .map(|k| k.as_str().expect("a name"))
        .collect();
    let domain: HashSet<&str> = EntryKind::ALL.iter().map(|k| k.as_str()).collect();
    assert_eq!(listed, domain);
    assert_eq!(
        resolved["enum"].as_array().unwrap().len(),
        EntryKind::ALL.len(),
        "no name twice"
    );
    // And the document served is that one.
    let app = spawn_app().await;
    let (status, served) = get_json(&app, "/openapi.json").await;
    assert_eq!(status, 200);
    assert_eq!(served["components"]["schemas"], *schemas);
}

/// Without a time, the balance is the current one: it includes every entry acknowledged
/// before the request was sent.
///
/// Without a time the answer is the account's last entry, even one that landed after
/// the instance's lower bound of the database's clock (an answer as of that bound missed
/// it). Instance `b` reaches the database through a proxy that holds every chunk 50 ms,
/// so that its bound trails by about 50 ms.
#[tokio::test]
async fn the_balance_without_a_time_includes_an_entry_acknowledged_just_before_the_request() {
    use support::proxy::{Faults, Proxy};
    let a = spawn_app().await;
    alice_and_bob(&a, 1_000, 0).await;
    let uri = support::database_uri();
    let upstream = uri
        .strip_prefix("mongodb://")
        .and_then(|rest| rest.split('/').next())
        .and_then(|authority| authority.parse().ok())
        .unwrap_or_else(|| panic!("a mongodb://127.0.0.1:<port>/ URI, not {uri}"));
    let slow = Duration::from_millis(50);
    let faults = Faults {
        delay_max: slow,
        slow_chance: 1.0,
        slow_delay_max: slow,
        resets_per_second: 0.0,
        max_connections: 64,
    };
    let proxy = Proxy::start(upstream, faults).await;
    let database = a.database.clone();
    let b = support::spawn_app_with(|s| {
        s.deployments[0].uri = format!("mongodb://{}/?directConnection=true", proxy.addr);
        s.database = database;
    })
    .await;
    // b knows where alice lives and has read the database's clock.
    done(&b, "alice", "bob", 1).await;

    for n in 1..=3 {
        done(&a, "alice", "bob", n).await;
        let stored = account_json(&a, "alice").await;

        let now = balance_at(&b, "alice", None).await;

        assert_eq!(
            answered_balance(&now),
            (int(&stored, "seq"), amounts(&stored)),
            "round {n}: without a time, the current amounts; answered {now}, stored {stored}"
        );
    }
}

/// An entry's time never goes back from the account's previous entry, even when the
/// database's clock does (a clock stepped back, a failover to a member whose clock is
/// behind, or a write that read `$$NOW` before another landed first): here the last
/// entry's time (`lastEntryAt`, what the next is stamped from) is set five seconds ahead
/// of the clock, and each kind of write (alone,
/// in a group-committed batch, an undo-like pull) must stamp its entry no earlier.
#[tokio::test]
async fn an_entrys_time_never_goes_back_from_the_previous_one() {
    let app = spawn_app().await;
    alice_and_bob(&app, 1_000, 0).await;
    // To the millisecond, as stored.
    let ahead =
        DateTime::from_timestamp_millis((Utc::now() + TimeDelta::seconds(5)).timestamp_millis())
            .unwrap();
    let accounts = app.store.database().collection::<Document>("accounts");
    for account in ["alice", "bob"] {
        let stamped = accounts
            .update_one(
                doc! { "_id": account },
                doc! { "$set": { "lastEntryAt": mongodb::bson::DateTime::from_chrono(ahead) } },
            )
            .await
            .unwrap();
        assert_eq!(stamped.modified_count, 1);
    }
    // One transfer alone, then several at once (group-committed), then a hold and its
    // capture (a pull of the marker with the change).
    done(&app, "alice", "bob", 10).await;
    let concurrent: Vec<_> = (0..8)
        .map(|_| {
            let http = app.http.clone();
            let url = app.url("/transfers");
            tokio::spawn(async move {
                let body = json!({ "source": "alice", "destination": "bob", "amount": 1 });
                http.post(url).json(&body).send().await.unwrap().status()
            })
        })
        .collect();
    for task in concurrent {
        assert_eq!(task.await.unwrap(), 201);
    }
    let held = hold(&app, 5).await;
    post_ok(&app, &format!("/transfers/{held}/capture"), None).await;
    for account in ["alice", "bob"] {
        let entries = assert_ledger(&app, account).await;
        assert!(entries.len() > 10, "{account}: {entries:#?}");
        for e in &entries[1..] {
            assert!(at(e) >= ahead, "{account}: went back before {ahead}: {e}");
        }
    }
}
