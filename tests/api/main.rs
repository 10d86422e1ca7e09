//! The HTTP API against a real database server: one test binary, one database per test.

mod accounts;
mod cancel;
mod concurrency;
mod docs;
mod errors;
mod event_gaps;
mod events;
mod events_stream;
mod feed_fronts;
mod group_commit;
mod holds;
mod idempotency;
mod ledger;
mod legs;
mod legs_holds;
mod native;
mod observability;
mod openapi_data;
mod pagination;
mod security;
mod tenant_shares;
mod tenants;
mod tenants_explored;
mod transfers;
mod webhooks;

use serde_json::Value;

/// Asserts that `response` is an RFC 9457 problem document with this HTTP status and
/// `code`: served as `application/problem+json`, with every member a client relies on
/// and a `status` member equal to the HTTP status. Returns the body for further checks.
pub async fn assert_problem(response: reqwest::Response, status: u16, code: &str) -> Value {
    let actual = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap_or_default().to_owned())
        .unwrap_or_default();
    let text = response.text().await.expect("a body");
    assert_eq!(actual, status, "status; body: {text}");
    assert!(
        content_type.starts_with("application/problem+json"),
        "content type {content_type:?}; body: {text}"
    );
    let body: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("a problem body must be JSON ({e}): {text}"));
    assert_eq!(body["code"], code, "code; body: {body}");
    assert_eq!(body["status"], status, "status member; body: {body}");
    assert_eq!(
        body["type"],
        format!("urn:transfer-service:problem:{code}"),
        "type; body: {body}"
    );
    for member in ["title", "detail"] {
        assert!(
            body[member].as_str().is_some_and(|s| !s.is_empty()),
            "{member} must be a non-empty string; body: {body}"
        );
    }
    body
}

/// GET `path`; the status and the JSON body.
pub async fn get_json(app: &support::TestApp, path: &str) -> (u16, Value) {
    let response = app.get(path).await;
    let status = response.status().as_u16();
    let text = response.text().await.expect("a body");
    let body = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("GET {path} answered {status} with non-JSON ({e}): {text}"));
    (status, body)
}

/// The ids of the items of a listing page, in the order given.
pub fn item_ids(page: &Value) -> Vec<String> {
    page["items"]
        .as_array()
        .unwrap_or_else(|| panic!("a page has items: {page}"))
        .iter()
        .map(|item| item["id"].as_str().expect("an item has an id").to_owned())
        .collect()
}

/// The `next` of a page; `None` on the last page (absent or null).
pub fn next_page(page: &Value) -> Option<String> {
    page.get("next").and_then(Value::as_str).map(str::to_owned)
}

/// Follows `next` (as `after`) from `first_path` (which must already carry a `?`) to the last
/// page; the item ids of every page, page by page.
pub async fn walk_pages(app: &support::TestApp, first_path: &str) -> Vec<Vec<String>> {
    let mut pages = Vec::new();
    let mut path = first_path.to_owned();
    loop {
        let (status, page) = get_json(app, &path).await;
        assert_eq!(status, 200, "GET {path}: {page}");
        pages.push(item_ids(&page));
        assert!(pages.len() <= 100, "the listing never ends");
        match next_page(&page) {
            Some(next) => path = format!("{first_path}&after={next}"),
            None => return pages,
        }
    }
}
