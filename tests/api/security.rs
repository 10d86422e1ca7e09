//! Who may call the API: optional API keys (`API_KEYS`) and the CORS policy for browsers
//! (`CORS_ALLOWED_ORIGINS`).
//!
//! Invariants protected here: with keys configured nothing but the operational routes
//! and the documentation answers without a valid key; a read-only key never writes; a
//! key never appears in a response or a log line; a browser on an origin that is not
//! listed gets no CORS headers.

use mongodb::bson::oid::ObjectId;
use reqwest::Method;
use serde_json::json;
use transfer_service::config::parse_api_keys;

use crate::assert_problem;
use crate::observability::{CapturedLogs, request_id_of};
use support::values::account as account_id;
use support::{TestApp, spawn_app, spawn_app_with};

/// Random keys, so that finding one in a log or a body cannot be a coincidence.
struct Keys {
    rw: String,
    ro: String,
}

impl Keys {
    fn new() -> Keys {
        Keys {
            rw: format!("rw-{}", ObjectId::new().to_hex()),
            ro: format!("ro-{}", ObjectId::new().to_hex()),
        }
    }
}

async fn spawn_with_keys(keys: &Keys) -> TestApp {
    let raw = format!("rw:{},ro:{}", keys.rw, keys.ro);
    spawn_app_with(|settings| settings.api_keys = parse_api_keys(&raw).unwrap()).await
}

/// Sends `method path` with `Authorization: Bearer <key>` when a key is given.
async fn send(
    app: &TestApp,
    method: Method,
    path: &str,
    key: Option<&str>,
    body: Option<serde_json::Value>,
) -> reqwest::Response {
    let mut request = app.http.request(method, app.url(path));
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    if let Some(body) = body {
        request = request.json(&body);
    }
    request.send().await.expect("request")
}

fn account(id: &str) -> serde_json::Value {
    json!({ "id": id, "balance": 100, "currency": "USD" })
}

async fn assert_unauthorized(response: reqwest::Response) -> serde_json::Value {
    let challenge = response
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    assert!(
        challenge.starts_with("Bearer"),
        "WWW-Authenticate: {challenge:?}"
    );
    assert_problem(response, 401, "unauthorized").await
}

#[tokio::test]
async fn without_a_key_every_api_route_is_401_unauthorized() {
    let keys = Keys::new();
    let app = spawn_with_keys(&keys).await;
    let cases = [
        (Method::GET, "/accounts"),
        (Method::GET, "/accounts/alice"),
        (Method::GET, "/transfers"),
        (Method::POST, "/transfers"),
        (Method::POST, "/accounts"),
    ];
    for (method, path) in cases {
        let body = (method == Method::POST).then(|| account("alice"));
        assert_unauthorized(send(&app, method, path, None, body).await).await;
    }
    assert!(
        app.store
            .accounts()
            .account(&account_id("alice"))
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn a_wrong_key_or_another_scheme_is_401_unauthorized() {
    let keys = Keys::new();
    let app = spawn_with_keys(&keys).await;
    let almost = &keys.rw[..keys.rw.len() - 1];
    for key in [
        "not-a-key-at-all-0000",
        almost,
        &format!("{}x", keys.rw),
        &keys.rw.to_uppercase(),
    ] {
        assert_unauthorized(send(&app, Method::GET, "/accounts", Some(key), None).await).await;
    }
    let basic = app
        .http
        .get(app.url("/accounts"))
        .basic_auth("rw", Some(&keys.rw))
        .send()
        .await
        .unwrap();
    assert_unauthorized(basic).await;
}

#[tokio::test]
async fn a_read_only_key_reads_but_a_write_is_403_forbidden() {
    let keys = Keys::new();
    let app = spawn_with_keys(&keys).await;

    let read = send(&app, Method::GET, "/accounts", Some(&keys.ro), None).await;
    assert_eq!(read.status(), 200);
    let write = send(
        &app,
        Method::POST,
        "/accounts",
        Some(&keys.ro),
        Some(account("carol")),
    )
    .await;
    assert_problem(write, 403, "forbidden").await;
    let cancel = send(
        &app,
        Method::POST,
        "/transfers/65a1b2c3d4e5f60718293a4b/cancel",
        Some(&keys.ro),
        None,
    )
    .await;
    assert_problem(cancel, 403, "forbidden").await;

    assert!(
        app.store
            .accounts()
            .account(&account_id("carol"))
            .await
            .unwrap()
            .is_none(),
        "a read-only key wrote"
    );
}

#[tokio::test]
async fn a_read_write_key_opens_accounts_and_moves_money() {
    let keys = Keys::new();
    let app = spawn_with_keys(&keys).await;

    for id in ["alice", "bob"] {
        let opened = send(
            &app,
            Method::POST,
            "/accounts",
            Some(&keys.rw),
            Some(account(id)),
        )
        .await;
        assert_eq!(opened.status(), 201, "{}", opened.text().await.unwrap());
    }
    let transfer = json!({ "source": "alice", "destination": "bob", "amount": 40 });
    let moved = send(
        &app,
        Method::POST,
        "/transfers",
        Some(&keys.rw),
        Some(transfer),
    )
    .await;
    assert_eq!(moved.status(), 201, "{}", moved.text().await.unwrap());
    let read = send(&app, Method::GET, "/accounts/bob", Some(&keys.rw), None).await;
    assert_eq!(read.status(), 200);

    assert_eq!(app.balance("alice").await, 60);
    assert_eq!(app.balance("bob").await, 140);
    assert_eq!(app.total_balance().await, 200);
}

#[tokio::test]
async fn operational_routes_and_the_documentation_need_no_key() {
    let keys = Keys::new();
    let app = spawn_with_keys(&keys).await;
    for path in ["/health", "/ready", "/metrics", "/openapi.json", "/docs/"] {
        let response = app.get(path).await;
        assert_eq!(response.status(), 200, "GET {path}");
    }
}

#[tokio::test]
async fn an_unknown_route_is_401_without_a_key_and_404_with_one() {
    let keys = Keys::new();
    let app = spawn_with_keys(&keys).await;
    for path in ["/nope", "/docsx", "/health/x"] {
        assert_unauthorized(send(&app, Method::GET, path, None, None).await).await;
        let known = send(&app, Method::GET, path, Some(&keys.ro), None).await;
        assert_problem(known, 404, "not_found").await;
    }
}

#[tokio::test]
async fn without_api_keys_the_api_is_open_and_the_header_ignored() {
    let app = spawn_app().await;
    let response = send(
        &app,
        Method::GET,
        "/accounts",
        Some("anything-at-all-here"),
        None,
    )
    .await;
    assert_eq!(response.status(), 200);
    let response = send(&app, Method::POST, "/accounts", None, Some(account("dave"))).await;
    assert_eq!(response.status(), 201);
}

#[tokio::test]
async fn a_key_never_appears_in_a_log_line_or_a_response() {
    let (logs, _guard) = CapturedLogs::start();
    let keys = Keys::new();
    let wrong = format!("wrong-{}", ObjectId::new().to_hex());
    let app = spawn_with_keys(&keys).await;
    let mut bodies = String::new();
    let attempts = [
        (Method::GET, "/accounts", Some(keys.rw.as_str()), None),
        (
            Method::POST,
            "/accounts",
            Some(keys.ro.as_str()),
            Some(account("erin")),
        ),
        (
            Method::POST,
            "/accounts",
            Some(wrong.as_str()),
            Some(account("erin")),
        ),
        (Method::GET, "/nope", Some(wrong.as_str()), None),
    ];
    let mut refused_ids = Vec::new();
    for (method, path, key, body) in attempts {
        let response = send(&app, method, path, key, body).await;
        let status = response.status().as_u16();
        let request_id = response.headers()["x-request-id"]
            .to_str()
            .unwrap()
            .to_owned();
        if status == 401 || status == 403 {
            refused_ids.push(request_id);
        }
        for (name, value) in response.headers() {
            bodies.push_str(&format!("{name}: {}\n", value.to_str().unwrap_or_default()));
        }
        bodies.push_str(&response.text().await.unwrap());
    }

    let text = logs.text();
    for secret in [&keys.rw, &keys.ro, &wrong] {
        assert!(
            !bodies.contains(secret.as_str()),
            "a response carries a key:\n{bodies}"
        );
        assert!(
            !text.contains(secret.as_str()),
            "a log line carries a key:\n{text}"
        );
    }
    assert_eq!(refused_ids.len(), 3, "{bodies}");
    let lines = logs.lines();
    for id in refused_ids {
        assert!(
            lines.iter().any(|l| request_id_of(l) == Some(id.as_str())
                && l["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("refused"))),
            "the refusal of request {id} is logged in its span:\n{text}"
        );
    }
}

#[test]
fn the_document_declares_the_optional_bearer_scheme_and_its_refusals() {
    let doc = serde_json::to_value(transfer_service::http::openapi()).unwrap();
    let scheme = &doc["components"]["securitySchemes"]["bearerAuth"];
    // The refusals, shared by every operation that needs a key.
    let shared = &doc["components"]["responses"];
    for name in ["Unauthorized", "Forbidden"] {
        assert!(
            shared[name]["content"]["application/problem+json"].is_object(),
            "{name}: {}",
            shared[name]
        );
    }
    assert!(
        shared["Unauthorized"]["headers"]["WWW-Authenticate"].is_object(),
        "{}",
        shared["Unauthorized"]
    );
    assert_eq!(scheme["type"], "http", "{scheme}");
    assert_eq!(scheme["scheme"], "bearer", "{scheme}");
    let paths = doc["paths"].as_object().unwrap();
    for (path, item) in paths {
        for (method, operation) in item.as_object().unwrap() {
            let responses = &operation["responses"];
            if ["/health", "/ready", "/metrics"].contains(&path.as_str()) {
                assert_eq!(operation["security"], json!([]), "{method} {path}");
                assert!(responses.get("401").is_none(), "{method} {path}");
                continue;
            }
            assert_eq!(
                operation["security"],
                json!([{ "bearerAuth": [] }, {}]),
                "{method} {path}"
            );
            assert_eq!(
                responses["401"]["$ref"], "#/components/responses/Unauthorized",
                "{method} {path}"
            );
            // A write refuses a read-only key; so does every route of `/webhooks`, reads
            // too (where the events go is for whoever may change it), and of `/api-keys`
            // (admin keys only).
            let read_write_only =
                method != "get" || path.starts_with("/webhooks") || path.starts_with("/api-keys");
            assert_eq!(
                responses.get("403").map(|r| &r["$ref"]),
                read_write_only.then_some(&json!("#/components/responses/Forbidden")),
                "{method} {path}"
            );
        }
    }
}

/// An app with keys and one allowed origin.
async fn spawn_with_cors(keys: &Keys) -> TestApp {
    let raw = format!("rw:{},ro:{}", keys.rw, keys.ro);
    spawn_app_with(|settings| {
        settings.api_keys = parse_api_keys(&raw).unwrap();
        settings.cors_allowed_origins = vec!["https://app.example.com".to_owned()];
    })
    .await
}

fn header(response: &reqwest::Response, name: &str) -> Option<String> {
    response
        .headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_ascii_lowercase())
}

#[tokio::test]
async fn an_allowed_origin_gets_cors_headers_even_on_a_refusal() {
    let keys = Keys::new();
    let app = spawn_with_cors(&keys).await;
    for key in [Some(keys.ro.as_str()), None] {
        let mut request = app
            .http
            .get(app.url("/accounts"))
            .header("origin", "https://app.example.com");
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), if key.is_some() { 200 } else { 401 });
        assert_eq!(
            header(&response, "access-control-allow-origin").as_deref(),
            Some("https://app.example.com")
        );
        let exposed = header(&response, "access-control-expose-headers").unwrap_or_default();
        for name in [
            "location",
            "idempotent-replayed",
            "preference-applied",
            "x-request-id",
        ] {
            assert!(exposed.contains(name), "{name} not exposed: {exposed}");
        }
    }
}

#[tokio::test]
async fn another_origin_is_not_allowed() {
    let keys = Keys::new();
    let app = spawn_with_cors(&keys).await;
    let response = app
        .http
        .get(app.url("/accounts"))
        .header("origin", "https://evil.example.com")
        .bearer_auth(&keys.ro)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // Without Access-Control-Allow-Origin a browser hides the answer from the page; the
    // other CORS headers tower-http always sends (`Vary`, the exposed names) grant nothing.
    assert_eq!(header(&response, "access-control-allow-origin"), None);
    assert_eq!(header(&response, "access-control-allow-credentials"), None);
}

#[tokio::test]
async fn a_preflight_is_answered_without_a_key() {
    let keys = Keys::new();
    let app = spawn_with_cors(&keys).await;
    let response = app
        .http
        .request(Method::OPTIONS, app.url("/transfers"))
        .header("origin", "https://app.example.com")
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "authorization,content-type,idempotency-key,prefer,x-request-id",
        )
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success(), "{}", response.status());
    assert_eq!(
        header(&response, "access-control-allow-origin").as_deref(),
        Some("https://app.example.com")
    );
    let methods = header(&response, "access-control-allow-methods").unwrap_or_default();
    for method in ["get", "post", "options"] {
        assert!(methods.contains(method), "{methods}");
    }
    let allowed = header(&response, "access-control-allow-headers").unwrap_or_default();
    for name in [
        "authorization",
        "content-type",
        "idempotency-key",
        "prefer",
        "x-request-id",
    ] {
        assert!(allowed.contains(name), "{name} not allowed: {allowed}");
    }
}

#[tokio::test]
async fn without_allowed_origins_there_are_no_cors_headers() {
    let app = spawn_app().await;
    let response = app
        .http
        .get(app.url("/health"))
        .header("origin", "https://app.example.com")
        .send()
        .await
        .unwrap();
    assert_eq!(header(&response, "access-control-allow-origin"), None);
    let preflight = app
        .http
        .request(Method::OPTIONS, app.url("/transfers"))
        .header("origin", "https://app.example.com")
        .header("access-control-request-method", "POST")
        .send()
        .await
        .unwrap();
    assert_eq!(header(&preflight, "access-control-allow-origin"), None);
    assert_problem(preflight, 405, "method_not_allowed").await;
}
