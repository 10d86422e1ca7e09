//! Group commit (`store::batch`): one database command writes the steps of many
//! transfers, and each must still get exactly the answer its own guarded write would
//! have had. These call the batch writers directly with hand-made batches.

use mongodb::bson::{DateTime, Document, doc};
use transfer_service::domain::{
    EntryKind, IdempotencyKey, ScopedKey, Transfer, TransferId, TransferState,
};
use transfer_service::store::accounts::FenceWhen;
use transfer_service::store::new_transfer_id;
use transfer_service::store::testing::{
    AccountChange, Pull, Settle, TransferDoc, Transition, change_accounts,
    change_accounts_after_a_move, insert_transfers, object_id, pull_markers, settle_parties,
    transition_all,
};
use transfer_service::store::transfers::{Mover, StepFields};

use support::values::{account, amount, from_now, initial};
use support::{TestApp, spawn_app};

fn in_a_minute() -> DateTime {
    DateTime::from_millis(DateTime::now().timestamp_millis() + 60_000)
}

fn change(account: &str, tx: TransferId, delta: i64) -> AccountChange {
    AccountChange {
        account: account.to_owned(),
        tx: object_id(tx),
        delta,
        debits: 0,
        credits: 0,
        incoming: 0,
        deadline: in_a_minute(),
        kind: Some(if delta < 0 {
            EntryKind::Debit
        } else {
            EntryKind::Credit
        }),
    }
}

/// Whether the debit of `tx` from `source` landed, with a minute of lease.
async fn debit(app: &TestApp, source: &str, tx: TransferId, value: i64) -> bool {
    let source = account(source);
    let step = app
        .store
        .accounts()
        .prepare(&source, tx, -value, from_now(60_000));
    step.await.unwrap().applied
}

/// Whether the credit of `tx` to `destination` landed, with a minute of lease.
async fn credit(app: &TestApp, destination: &str, tx: TransferId, value: i64) -> bool {
    let destination = account(destination);
    let step = app
        .store
        .accounts()
        .apply_credit(&destination, tx, amount(value), from_now(60_000));
    step.await.unwrap().applied
}

fn accounts(app: &TestApp) -> mongodb::Collection<Document> {
    app.store.database().collection("accounts")
}

#[tokio::test]
async fn a_batch_applies_each_change_under_its_own_guards_in_order() {
    let app = spawn_app().await;
    app.open_account("hot", 100).await;
    app.open_account("cold", 0).await;
    app.open_account("fenced", 50).await;
    let [t1, t2, t3, t4, t5, t6] = [(); 6].map(|_| new_transfer_id());
    app.store
        .accounts()
        .fence(
            &account("fenced"),
            t5,
            FenceWhen::Always,
            from_now(3_600_000),
        )
        .await
        .unwrap();
    let late = AccountChange {
        deadline: DateTime::from_millis(DateTime::now().timestamp_millis() - 1),
        ..change("cold", t6, 5)
    };
    let batch = vec![
        change("hot", t1, -60), // 100 -> 40
        change("hot", t2, -60), // would go negative: refused
        change("cold", t3, 60),
        change("hot", t4, -30),    // 40 -> 10
        change("fenced", t5, -10), // fenced: refused
        change("cold", t3, 60),    // already applied: no second credit, but it is applied
        late,                      // past its deadline: refused
        change("nobody", t2, 1),   // no such account
    ];
    let applied = change_accounts(accounts(&app), batch).await.unwrap();
    let applied: Vec<bool> = applied.into_iter().map(Result::unwrap).collect();
    assert_eq!(
        applied,
        [true, false, true, true, false, true, false, false]
    );
    assert_eq!(app.balance("hot").await, 10);
    assert_eq!(app.balance("cold").await, 60);
    assert_eq!(app.balance("fenced").await, 50);
    let hot = app
        .store
        .accounts()
        .account(&account("hot"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(hot.pending_transactions, vec![t1, t4]);
    let cold = app
        .store
        .accounts()
        .account(&account("cold"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(cold.pending_transactions, vec![t3]);
}

/// A transfer's step twice in one batch (its driver's and a recoverer's, each under its
/// own lease) lands once, if either may: the first past its deadline does not keep the
/// second from landing.
#[tokio::test]
async fn the_same_step_twice_in_a_batch_lands_once_if_either_deadline_allows() {
    let app = spawn_app().await;
    app.open_account("cold", 0).await;
    app.open_account("other", 0).await;
    let [t1, t2] = [(); 2].map(|_| new_transfer_id());
    let late = |c: AccountChange| AccountChange {
        deadline: DateTime::from_millis(DateTime::now().timestamp_millis() - 1),
        ..c
    };
    let batch = vec![
        late(change("cold", t1, 5)),
        change("other", t2, 1),
        change("cold", t1, 5),
        late(change("other", t2, 1)),
    ];
    let applied = change_accounts(accounts(&app), batch).await.unwrap();
    let applied: Vec<bool> = applied.into_iter().map(Result::unwrap).collect();
    assert_eq!(applied, [true, true, true, true]);
    assert_eq!(app.balance("cold").await, 5, "credited once");
    assert_eq!(app.balance("other").await, 1, "credited once");
    let cold = app
        .store
        .accounts()
        .account(&account("cold"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(cold.pending_transactions, vec![t1]);
}

#[tokio::test]
async fn a_credit_in_a_batch_cannot_pass_the_largest_balance() {
    let app = spawn_app().await;
    app.open_account("full", 9_007_199_254_740_000).await;
    app.open_account("other", 0).await;
    let [t1, t2] = [(); 2].map(|_| new_transfer_id());
    let applied = change_accounts(
        accounts(&app),
        vec![
            change("full", t1, 991),
            change("full", t2, 1),
            change("other", t1, 1),
        ],
    )
    .await
    .unwrap();
    let applied: Vec<bool> = applied.into_iter().map(Result::unwrap).collect();
    assert_eq!(applied, [true, false, true]);
    assert_eq!(app.balance("full").await, 9_007_199_254_740_991);
}

/// The guards of a forward step are written once (`store::guards`) and used by the
/// single-document write (a batch of one) and by the batched pipeline: both forms must
/// take the same decision, and leave the same account and the same entry, in every case
/// a guard decides.
#[tokio::test]
async fn a_change_alone_and_the_same_change_in_a_batch_decide_alike() {
    const MAX: i64 = transfer_service::domain::MAX_MONEY;
    let app = spawn_app().await;
    let past = DateTime::from_millis(DateTime::now().timestamp_millis() - 1);
    // (name, opening balance, delta, applied once before, fenced, deadline passed, exists)
    let cases: [(&str, i64, i64, bool, bool, bool, bool); 10] = [
        ("debit", 100, -60, false, false, false, true),
        ("debit-to-zero", 100, -100, false, false, false, true),
        ("debit-too-much", 100, -101, false, false, false, true),
        ("credit", 0, 60, false, false, false, true),
        ("credit-to-max", MAX - 5, 5, false, false, false, true),
        ("credit-past-max", MAX - 5, 6, false, false, false, true),
        ("applied-before", 100, -10, true, false, false, true),
        ("fenced", 100, -10, false, true, false, true),
        ("too-late", 100, -10, false, false, true, true),
        ("missing", 100, -10, false, false, false, false),
    ];
    for (name, balance, delta, applied_before, fenced, late, exists) in cases {
        let mut outcomes = Vec::new();
        for form in ["alone", "batched"] {
            let holder = format!("{name}-{form}");
            let ballast = format!("{name}-{form}-ballast");
            if exists {
                app.open_account(&holder, balance).await;
            }
            app.open_account(&ballast, 0).await;
            let tx = new_transfer_id();
            if applied_before {
                let first = change_accounts(accounts(&app), vec![change(&holder, tx, delta)]);
                assert!(
                    first.await.unwrap()[0].as_ref().unwrap(),
                    "{name}: first landing"
                );
            }
            if fenced {
                app.store
                    .accounts()
                    .fence(
                        &account(&holder),
                        tx,
                        FenceWhen::Always,
                        from_now(3_600_000),
                    )
                    .await
                    .unwrap();
            }
            let mut op = change(&holder, tx, delta);
            if late {
                op.deadline = past;
            }
            let mut batch = vec![op];
            if form == "batched" {
                // A second change, on another account, makes it the pipeline's batch.
                batch.push(change(&ballast, new_transfer_id(), 1));
            }
            let answers = change_accounts(accounts(&app), batch).await.unwrap();
            let applied = *answers[0].as_ref().unwrap();
            assert!(
                answers[1..].iter().all(|a| *a.as_ref().unwrap()),
                "{name} {form}: the ballast's changes land"
            );
            let stored = app
                .store
                .accounts()
                .account(&account(&holder))
                .await
                .unwrap();
            let left = stored.map(|a| (a.balance, a.pending_transactions.len(), a.seq));
            outcomes.push((applied, left, last_entry(&app, &holder).await));
        }
        let [
            (alone, alone_left, alone_entry),
            (batched, batched_left, batched_entry),
        ] = <[_; 2]>::try_from(outcomes).unwrap();
        assert_eq!(
            alone_entry, batched_entry,
            "{name}: the last entry, alone vs batched"
        );
        assert_eq!(
            alone_left, batched_left,
            "{name}: the account left, alone vs batched"
        );
        if applied_before {
            // The one difference, documented on `ForwardStep::applied`: a write alone
            // knows it changed nothing; a batch only sees the marker, already there.
            assert!(
                !alone && batched,
                "{name}: {alone} alone, {batched} batched"
            );
        } else {
            assert_eq!(alone, batched, "{name}: the answer, alone vs batched");
        }
    }
}

/// A batch leaves out of the documents the entries its instance's copier copied to
/// `entries`, in the same write: with one change an account (a and b) and with several
/// (c).
#[tokio::test]
async fn a_batch_leaves_out_of_each_document_the_entries_copied_to_entries() {
    let app = spawn_app().await;
    for name in ["a", "b", "c"] {
        app.open_account(name, 100).await;
    }
    let batches = [
        (
            ["a", "b"].as_slice(),
            vec![
                change("a", new_transfer_id(), -10),
                change("b", new_transfer_id(), 10),
            ],
        ),
        (
            ["c"].as_slice(),
            vec![
                change("c", new_transfer_id(), -10),
                change("c", new_transfer_id(), 5),
            ],
        ),
    ];
    for (moved_first, batch) in batches {
        let moved_first: Vec<String> = moved_first.iter().map(|&a| a.to_owned()).collect();
        let answers = change_accounts_after_a_move(app.store.database(), &moved_first, batch)
            .await
            .unwrap();
        assert!(answers.iter().all(|a| *a.as_ref().unwrap()), "{answers:?}");
    }
    let copied = app
        .store
        .database()
        .collection::<Document>("entries")
        .count_documents(doc! {})
        .await
        .unwrap();
    assert_eq!(copied, 3, "each opening copied");
    for (name, left) in [("a", vec![2]), ("b", vec![2]), ("c", vec![2, 3])] {
        let seqs = crate::ledger::seqs_in_document(&app, name).await;
        assert_eq!(seqs, left, "{name}: the opening left the document");
    }
}

/// The last entry in `holder`'s document, but for its time and transfer (which differ
/// from one form of a change to another).
async fn last_entry(app: &TestApp, holder: &str) -> Option<Document> {
    let stored = accounts(app)
        .find_one(doc! { "_id": holder })
        .await
        .unwrap()?;
    let mut entry = stored
        .get_array("recentEntries")
        .ok()?
        .last()?
        .as_document()?
        .clone();
    entry.remove("at");
    entry.remove("tx");
    Some(entry)
}

#[tokio::test]
async fn a_taken_idempotency_key_fails_only_its_own_insert() {
    let app = spawn_app().await;
    let keyed = |key: &str| Transfer {
        idempotency_key: Some(ScopedKey::shared(IdempotencyKey::parse(key).unwrap())),
        ..initial("a", "b", 1)
    };
    let first = keyed("k1");
    app.store.transfers().insert_transfer(&first).await.unwrap();
    let batch = [keyed("k2"), keyed("k1"), keyed("k3")];
    let ids: Vec<TransferId> = batch.iter().map(|t| t.id).collect();
    let batch = batch.iter().map(TransferDoc::from).collect();
    let results = insert_transfers(app.store.database().collection("transactions"), batch)
        .await
        .unwrap();
    assert!(results[0].is_ok());
    assert!(matches!(
        results[1],
        Err(transfer_service::store::StoreError::DuplicateKey(_))
    ));
    assert!(results[2].is_ok());
    assert!(
        app.store
            .transfers()
            .transfer(ids[0])
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        app.store
            .transfers()
            .transfer(ids[1])
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        app.store
            .transfers()
            .transfer(ids[2])
            .await
            .unwrap()
            .is_some()
    );
}

#[tokio::test]
async fn in_a_batch_of_state_changes_only_the_owners_of_the_expected_state_win() {
    let app = spawn_app().await;
    let mut docs = Vec::new();
    for _ in 0..4 {
        let t = initial("a", "b", 1);
        app.store.transfers().insert_transfer(&t).await.unwrap();
        docs.push(t);
    }
    // The third was taken by another instance, the fourth already moved on.
    for t in &docs[2..] {
        assert!(
            app.store
                .transfers()
                .change_state(
                    t.id,
                    TransferState::Initial,
                    TransferState::Pending,
                    Mover::Owner("other"),
                    StepFields::default(),
                )
                .await
                .unwrap()
                .is_some()
        );
    }
    let ops: Vec<Transition> = docs
        .iter()
        .map(|t| Transition {
            owner: "me".into(),
            id: object_id(t.id),
            from: TransferState::Initial,
            to: TransferState::Pending,
            at: mongodb::bson::DateTime::now(),
        })
        .collect();
    let results = transition_all(app.store.database().collection("transactions"), ops)
        .await
        .unwrap();
    let won: Vec<bool> = results.into_iter().map(|r| r.unwrap().is_some()).collect();
    assert_eq!(won, [true, true, false, false]);
    for (t, owner) in docs.iter().zip(["me", "me", "other", "other"]) {
        let stored = app.store.transfers().transfer(t.id).await.unwrap().unwrap();
        assert_eq!(stored.state, TransferState::Pending);
        assert_eq!(stored.owner.as_deref(), Some(owner));
    }
}

#[tokio::test]
async fn a_batch_of_pulls_removes_exactly_the_markers_of_its_transfers() {
    let app = spawn_app().await;
    app.open_account("a", 100).await;
    app.open_account("b", 0).await;
    let [t1, t2, t3] = [(); 3].map(|_| new_transfer_id());
    for t in [t1, t2, t3] {
        assert!(debit(&app, "a", t, 10).await);
        assert!(credit(&app, "b", t, 10).await);
    }
    let pull = |name: &str, tx| Pull {
        account: name.to_owned(),
        tx: object_id(tx),
    };
    let pulls = [t1, t3]
        .into_iter()
        .flat_map(|t| [pull("a", t), pull("b", t)]);
    pull_markers(accounts(&app), pulls.collect()).await.unwrap();
    for name in ["a", "b"] {
        let stored = app
            .store
            .accounts()
            .account(&account(name))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(stored.pending_transactions, vec![t2], "{name}");
    }
}

/// A paying party is settled by a pull of its own account's marker: in a batch with
/// other pulls, its marker leaves its own account and no other, so a receiving party of
/// the same transfer keeps its marker (and the room behind it) for its own settle. (A
/// pull shared across the batch's accounts took the receiving party's marker too, and
/// its credit was never made.)
#[tokio::test]
async fn an_exact_pull_takes_its_marker_from_its_own_account_only() {
    let app = spawn_app().await;
    for (name, balance) in [("payer", 100), ("receiver", 0), ("x", 100), ("y", 0)] {
        app.open_account(name, balance).await;
    }
    let [legs, plain] = [(); 2].map(|_| new_transfer_id());
    let step = |account: &str, net: i64| {
        let (app, account) = (&app, account.to_owned());
        async move {
            app.store
                .accounts()
                .prepare(
                    &support::values::account(&account),
                    legs,
                    net,
                    from_now(60_000),
                )
                .await
                .unwrap()
                .applied
        }
    };
    assert!(step("payer", -40).await);
    assert!(step("receiver", 40).await);
    assert!(debit(&app, "x", plain, 10).await);
    assert!(credit(&app, "y", plain, 10).await);
    let exact = Pull {
        account: "payer".to_owned(),
        tx: object_id(legs),
    };
    // The one-leg transfer's pulls, of accounts other than the receiving party's, in
    // the same batch.
    let pull = |name: &str| Pull {
        account: name.to_owned(),
        tx: object_id(plain),
    };
    pull_markers(accounts(&app), vec![exact, pull("x"), pull("y")])
        .await
        .unwrap();
    let markers = async |name: &str| {
        let stored = app
            .store
            .accounts()
            .account(&account(name))
            .await
            .unwrap()
            .unwrap();
        stored.pending_transactions
    };
    assert_eq!(markers("payer").await, vec![]);
    assert_eq!(
        markers("receiver").await,
        vec![legs],
        "the receiving party's marker stays"
    );
    assert_eq!(markers("x").await, vec![]);
    assert_eq!(markers("y").await, vec![]);
    let receiver = app
        .store
        .accounts()
        .account(&account("receiver"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(receiver.incoming, 40);
}

/// A batch of settles (`docs/legs.md`, step 5): each receiving party is paid in out of
/// its room, once, where its marker is: two transfers settling on one account in one
/// batch make two credit entries numbered one after the other, each with the balance it
/// left; a settle sent again (a retry, a recoverer) finds no marker and changes nothing;
/// the room is back to zero and the markers gone.
#[tokio::test]
async fn a_batch_of_settles_pays_each_receiving_party_in_once() {
    let app = spawn_app().await;
    for (name, balance) in [("payer", 1_000), ("shop", 5), ("fee", 0)] {
        app.open_account(name, balance).await;
    }
    let [t1, t2] = [(); 2].map(|_| new_transfer_id());
    let prepare = |name: &str, tx: TransferId, net: i64| {
        let (app, name) = (&app, name.to_owned());
        async move {
            app.store
                .accounts()
                .prepare(&account(&name), tx, net, from_now(60_000))
                .await
                .unwrap()
                .applied
        }
    };
    for (name, tx, net) in [
        ("payer", t1, -300),
        ("shop", t1, 290),
        ("fee", t1, 10),
        ("payer", t2, -100),
        ("shop", t2, 100),
    ] {
        assert!(prepare(name, tx, net).await, "{name}");
    }
    let settle = |name: &str, tx: TransferId, net: i64| Settle {
        account: name.to_owned(),
        tx: object_id(tx),
        pay_in: Some(net),
    };
    let batch = vec![
        settle("shop", t1, 290),
        settle("fee", t1, 10),
        settle("shop", t2, 100),
        settle("shop", t1, 290),
    ];
    settle_parties(accounts(&app), batch.clone()).await.unwrap();
    settle_parties(accounts(&app), batch).await.unwrap();
    let shop = app
        .store
        .accounts()
        .account(&account("shop"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((shop.balance, shop.incoming), (395, 0));
    assert_eq!(shop.pending_transactions, Vec::<TransferId>::new());
    let fee = app
        .store
        .accounts()
        .account(&account("fee"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((fee.balance, fee.incoming, fee.seq), (10, 0, 2));
    let (_, page) = crate::get_json(&app, "/accounts/shop/entries").await;
    let entries: Vec<(i64, &str, i64, i64)> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["seq"].as_i64().unwrap(),
                e["kind"].as_str().unwrap(),
                e["balanceChange"].as_i64().unwrap(),
                e["balance"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        entries,
        vec![
            (1, "opened", 5, 5),
            (2, "credit", 290, 295),
            (3, "credit", 100, 395)
        ]
    );
    // The payer's markers are its own settle's to pull, not these.
    let payer = app
        .store
        .accounts()
        .account(&account("payer"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(payer.pending_transactions, vec![t1, t2]);

    // A paying party's settle, in a batch with a receiving one's sent again: its marker
    // goes, and nothing else; no amount changes and no entry is made, on either.
    let pull_only = Settle {
        account: "payer".to_owned(),
        tx: object_id(t1),
        pay_in: None,
    };
    let again = settle("shop", t2, 100);
    settle_parties(accounts(&app), vec![pull_only, again])
        .await
        .unwrap();
    let after = app
        .store
        .accounts()
        .account(&account("payer"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(after.pending_transactions, vec![t2]);
    assert_eq!((after.balance, after.seq), (payer.balance, payer.seq));
    let shop = app
        .store
        .accounts()
        .account(&account("shop"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((shop.balance, shop.seq), (395, 3));
}

/// A batch mixing kinds of state change and owners: the groups are written at once, and
/// every caller still gets its own answer, in its own place.
#[tokio::test]
async fn a_batch_of_mixed_transitions_answers_each_caller_in_its_place() {
    use TransferState::{Applied, Done, Initial, Pending};
    let app = spawn_app().await;
    let mut ids = Vec::new();
    for _ in 0..6 {
        let t = initial("a", "b", 1);
        app.store.transfers().insert_transfer(&t).await.unwrap();
        ids.push(t.id);
    }
    // Where each transfer stands before the batch: (owner, state).
    let setup = [
        (None, Initial),
        (Some("me"), Pending),
        (Some("other"), Applied),
        (Some("other"), Pending),
        (Some("me"), Applied),
        (None, Initial),
    ];
    for (id, (owner, state)) in ids.iter().zip(setup) {
        let Some(owner) = owner else { continue };
        let mut at = Initial;
        for next in [Pending, Applied] {
            if at == state {
                break;
            }
            let by = Mover::Owner(owner);
            let moved = app
                .store
                .transfers()
                .change_state(*id, at, next, by, StepFields::default())
                .await;
            assert!(moved.unwrap().is_some());
            at = next;
        }
    }
    let op = |i: usize, owner: &str, from, to| Transition {
        owner: owner.into(),
        id: object_id(ids[i]),
        from,
        to,
        at: mongodb::bson::DateTime::now(),
    };
    let ops = vec![
        op(0, "me", Initial, Pending),
        op(1, "me", Pending, Applied),
        op(2, "other", Applied, Done),
        op(3, "me", Pending, Applied), // owned by "other": refused
        op(4, "me", Applied, Done),
        op(5, "me", Pending, Applied), // still initial: refused
    ];
    let results = transition_all(app.store.database().collection("transactions"), ops)
        .await
        .unwrap();
    let won: Vec<bool> = results.into_iter().map(|r| r.unwrap().is_some()).collect();
    assert_eq!(won, [true, true, true, false, true, false]);
    let expected = [
        ("me", Pending),
        ("me", Applied),
        ("other", Done),
        ("other", Pending),
        ("me", Done),
    ];
    for (id, (owner, state)) in ids.iter().zip(expected) {
        let stored = app.store.transfers().transfer(*id).await.unwrap().unwrap();
        assert_eq!(
            (stored.owner.as_deref(), stored.state),
            (Some(owner), state)
        );
    }
    let untouched = app
        .store
        .transfers()
        .transfer(ids[5])
        .await
        .unwrap()
        .unwrap();
    assert_eq!((untouched.owner, untouched.state), (None, Initial));
}

/// The number of update commands `accounts` has run, from the server's `top`.
async fn account_updates(app: &TestApp) -> i64 {
    let client = app.store.database().client();
    let top = client
        .database("admin")
        .run_command(doc! { "top": 1 })
        .await
        .unwrap();
    let namespace = format!("{}.accounts", app.database);
    let updates = top
        .get_document("totals")
        .and_then(|t| t.get_document(&namespace))
        .and_then(|c| c.get_document("update"))
        .map(|u| u.get("count").cloned());
    match updates {
        Ok(Some(mongodb::bson::Bson::Int64(n))) => n,
        Ok(Some(mongodb::bson::Bson::Int32(n))) => n.into(),
        Ok(Some(mongodb::bson::Bson::Double(n))) => n as i64,
        _ => 0,
    }
}

/// A plain transfer's prepare writes both its accounts in one command, and so does its
/// settle: the store sends a step's parties as one unit of the batch writer
/// (`Batcher::submit_all`), so two account writes a transfer, however the writer's task
/// happens to be scheduled between the two parties' submissions.
#[tokio::test]
async fn a_plain_transfer_writes_its_two_accounts_in_one_command_per_step() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    // The recorder's writes that take the accounts' opening marks off are not counted.
    crate::events::every_due_event_recorded(&app).await;
    let before = account_updates(&app).await;
    const TRANSFERS: i64 = 20;
    for _ in 0..TRANSFERS {
        let (status, body) = app.transfer("alice", "bob", 1).await;
        assert_eq!(status, 201, "{body}");
        assert_eq!(body["state"], "done", "{body}");
    }
    let written = account_updates(&app).await - before;
    assert_eq!(
        written,
        2 * TRANSFERS,
        "account update commands for {TRANSFERS} transfers: one prepare and one settle each"
    );
    assert_eq!(app.balance("bob").await, TRANSFERS);
}
