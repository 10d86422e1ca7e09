//! One pagination form for every listing (`docs/api.md#pages`): `after` is what the
//! previous page's `next` said, `next` is null on the last page; `cursor`, the old name
//! of `after`, is still read; anything not handed out is a 400, never a 500.

use std::time::Duration;

use serde_json::{Value, json};
use support::{eventually, spawn_app};

use crate::{assert_problem, get_json, item_ids};

/// Follows `next` as `after` from `first_path` (which carries a `?`) until `next` is
/// null; every item id, in order. A page must not carry the old `nextCursor`.
async fn follow_next(app: &support::TestApp, first_path: &str, id: &str) -> Vec<String> {
    let mut seen = Vec::new();
    let mut path = first_path.to_owned();
    for _ in 0..50 {
        let (status, page) = get_json(app, &path).await;
        assert_eq!(status, 200, "GET {path}: {page}");
        assert!(page.get("nextCursor").is_none(), "GET {path}: {page}");
        assert!(page.get("next").is_some(), "every page says next: {page}");
        let items = page["items"].as_array().expect("items");
        seen.extend(items.iter().map(|i| match &i[id] {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        }));
        match page["next"].as_str() {
            Some(next) => path = format!("{first_path}&after={next}"),
            None => return seen,
        }
    }
    panic!("{first_path}: the listing never ends (seen {seen:?})");
}

#[tokio::test]
async fn every_listing_pages_with_after_and_answers_next() {
    let app = spawn_app().await;
    for id in ["a", "b", "c", "d", "e"] {
        app.open_account(id, 100).await;
    }
    let mut transfers = Vec::new();
    for (source, destination) in [("a", "b"), ("a", "c"), ("b", "a"), ("a", "d"), ("e", "a")] {
        let (status, body) = app.transfer(source, destination, 1).await;
        assert_eq!(status, 201, "{body}");
        transfers.push(body["id"].as_str().unwrap().to_owned());
    }
    let newest_first: Vec<String> = transfers.iter().rev().cloned().collect();

    assert_eq!(
        follow_next(&app, "/accounts?limit=2", "id").await,
        ["a", "b", "c", "d", "e"]
    );
    assert_eq!(
        follow_next(&app, "/transfers?limit=2", "id").await,
        newest_first
    );
    assert_eq!(
        follow_next(&app, "/accounts/a/transfers?limit=2", "id").await,
        newest_first
    );
    // The entries of a: its opening and five transfers; `next` is null once a page
    // comes back empty (more may come later: keep the last `after`).
    assert_eq!(
        follow_next(&app, "/accounts/a/entries?limit=2", "seq").await,
        ["1", "2", "3", "4", "5", "6"]
    );
}

#[tokio::test]
async fn the_old_name_cursor_still_reads_as_after() {
    let app = spawn_app().await;
    for id in ["a", "b", "c"] {
        app.open_account(id, 0).await;
    }
    let (_, first) = get_json(&app, "/accounts?limit=2").await;
    let next = first["next"].as_str().expect("a second page");
    let (status, by_after) = get_json(&app, &format!("/accounts?limit=2&after={next}")).await;
    assert_eq!(status, 200, "{by_after}");
    let (status, by_cursor) = get_json(&app, &format!("/accounts?limit=2&cursor={next}")).await;
    assert_eq!(status, 200, "{by_cursor}");
    assert_eq!(item_ids(&by_after), ["c"]);
    assert_eq!(by_cursor, by_after);

    let response = app
        .get(&format!("/accounts?after={next}&cursor={next}"))
        .await;
    let problem = assert_problem(response, 400, "invalid_parameter").await;
    assert_eq!(problem["field"], "cursor", "{problem}");
}

#[tokio::test]
async fn an_after_not_handed_out_is_400_on_every_listing() {
    let app = spawn_app().await;
    app.open_account("a", 0).await;
    // base64url of "accounts:a b" (no such id can exist), "transfers:zz" (not a
    // transfer id), "accounts:" and 65 letters (longer than any id), and a long value.
    let long = "A".repeat(4000);
    for listing in [
        "/accounts",
        "/transfers",
        "/accounts/a/transfers",
        "/accounts/a/entries",
    ] {
        for forged in [
            "garbage!!",
            "YWNjb3VudHM6YSBi",
            "dHJhbnNmZXJzOnp6",
            "YWNjb3VudHM6YWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWE",
            long.as_str(),
            "-1",
            "99999999999999999999",
        ] {
            let response = app.get(&format!("{listing}?after={forged}")).await;
            let problem = assert_problem(response, 400, "invalid_parameter").await;
            assert_eq!(problem["field"], "after", "{listing}?after={forged}");
        }
    }
}

/// A URL on 127.0.0.1 nothing listens on: registered (the test service allows private
/// addresses), its deliveries fail and stay listed.
fn nowhere() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!(
        "http://127.0.0.1:{}/hook",
        listener.local_addr().unwrap().port()
    )
}

#[tokio::test]
async fn webhooks_and_their_deliveries_page_with_after_and_next() {
    let app = spawn_app().await;
    let mut hooks = Vec::new();
    for _ in 0..5 {
        let response = app
            .post_json(
                "/webhooks",
                json!({ "url": nowhere(), "types": ["account.opened"] }),
            )
            .await;
        assert_eq!(response.status(), 201);
        let body: Value = response.json().await.unwrap();
        hooks.push(body["id"].as_str().unwrap().to_owned());
    }
    assert_eq!(
        follow_next(&app, "/webhooks?limit=2", "id").await,
        hooks,
        "every webhook once, oldest first"
    );

    for id in ["a", "b", "c", "d", "e"] {
        app.open_account(id, 0).await;
    }
    let hook = &hooks[0];
    let all: Vec<String> = eventually(
        "five deliveries",
        Duration::from_secs(30),
        Duration::from_millis(100),
        async || {
            let (_, page) = get_json(&app, &format!("/webhooks/{hook}/deliveries")).await;
            let ids = item_ids(&page);
            (ids.len() == 5).then_some(ids)
        },
    )
    .await;
    assert_eq!(
        follow_next(&app, &format!("/webhooks/{hook}/deliveries?limit=2"), "id").await,
        all,
        "every delivery once, newest first"
    );
    for forged in ["garbage!!", "YWNjb3VudHM6YSBi", "ZGVsaXZlcmllczp4"] {
        let response = app
            .get(&format!("/webhooks/{hook}/deliveries?after={forged}"))
            .await;
        let problem = assert_problem(response, 400, "invalid_parameter").await;
        assert_eq!(problem["field"], "after", "{forged}: {problem}");
        let response = app.get(&format!("/webhooks?after={forged}")).await;
        let problem = assert_problem(response, 400, "invalid_parameter").await;
        assert_eq!(problem["field"], "after", "{forged}: {problem}");
    }
}
