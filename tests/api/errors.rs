//! What every client meets whatever it asks: problem+json errors with a stable shape,
//! a request id on every response, and the operational endpoints.
//!
//! The invariant protected here: no error answer, from a handler or from middleware,
//! leaves the server without a problem+json body whose `status` equals the HTTP status.

use serde_json::json;

use crate::assert_problem;
use support::spawn_app;

#[tokio::test]
async fn an_unknown_route_is_404_not_found_as_problem_json() {
    let app = spawn_app().await;
    for path in ["/nope", "/accounts/alice/nope", "/transfers/x/y/z"] {
        let problem = assert_problem(app.get(path).await, 404, "not_found").await;
        assert!(problem.get("field").is_none(), "{problem}");
    }
}

#[tokio::test]
async fn a_method_a_route_does_not_support_is_405_as_problem_json() {
    let app = spawn_app().await;
    let cases = [
        (reqwest::Method::DELETE, "/accounts"),
        (reqwest::Method::PUT, "/transfers"),
        (reqwest::Method::DELETE, "/accounts/alice"),
        (
            reqwest::Method::GET,
            "/transfers/65a1b2c3d4e5f60718293a4b/cancel",
        ),
        (reqwest::Method::POST, "/health"),
    ];
    for (method, path) in cases {
        let response = app
            .http
            .request(method.clone(), app.url(path))
            .send()
            .await
            .unwrap();
        let problem = assert_problem(response, 405, "method_not_allowed").await;
        assert!(problem["detail"].is_string(), "{method} {path}: {problem}");
    }
}

#[tokio::test]
async fn a_body_over_64_kib_is_413_payload_too_large_as_problem_json() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let padding = "x".repeat(70 * 1024);
    let body =
        json!({ "source": "alice", "destination": "bob", "amount": 5, "reference": padding });

    let response = app.post_json("/transfers", body).await;

    assert_problem(response, 413, "payload_too_large").await;
    assert_eq!(app.balance("alice").await, 1_000);
    assert_eq!(app.balance("bob").await, 0);
}

#[tokio::test]
async fn a_body_just_under_the_limit_is_read_and_judged_on_its_fields() {
    // The body is read (not refused for size); its over-long reference is what is refused.
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let padding = "x".repeat(60 * 1024);
    let body =
        json!({ "source": "alice", "destination": "bob", "amount": 5, "reference": padding });

    let response = app.post_json("/transfers", body).await;

    let problem = assert_problem(response, 422, "invalid_field").await;
    assert_eq!(problem["field"], "reference");
}

#[tokio::test]
async fn every_error_answer_is_a_complete_problem_document() {
    let app = spawn_app().await;
    app.open_account("alice", 10).await;
    app.open_account_in("euro", 10, "EUR").await;
    app.open_account("bob", 0).await;
    let post = |path: &'static str, body: serde_json::Value| {
        let request = app.http.post(app.url(path)).json(&body);
        async move { request.send().await.unwrap() }
    };

    // One answer for each code a client can meet without a broken database.
    let answers = vec![
        (app.get("/accounts/nobody").await, 404, "account_not_found"),
        (
            app.get("/transfers/65a1b2c3d4e5f60718293a4b").await,
            404,
            "transfer_not_found",
        ),
        (app.get("/nowhere").await, 404, "not_found"),
        (app.get("/accounts?limit=0").await, 400, "invalid_parameter"),
        (
            post("/accounts", json!({ "id": "alice" })).await,
            409,
            "account_exists",
        ),
        (
            post("/accounts", json!({ "id": "a b" })).await,
            422,
            "invalid_field",
        ),
        (
            post(
                "/transfers",
                json!({ "source": "alice", "destination": "ghost", "amount": 1 }),
            )
            .await,
            422,
            "unknown_account",
        ),
        (
            post(
                "/transfers",
                json!({ "source": "alice", "destination": "alice", "amount": 1 }),
            )
            .await,
            422,
            "same_account",
        ),
        (
            post(
                "/transfers",
                json!({ "source": "alice", "destination": "euro", "amount": 1 }),
            )
            .await,
            422,
            "currency_mismatch",
        ),
        (
            post(
                "/transfers",
                json!({ "source": "alice", "destination": "bob", "amount": 11 }),
            )
            .await,
            422,
            "insufficient_funds",
        ),
        (
            app.http
                .post(app.url("/transfers"))
                .header("content-type", "application/json")
                .body("{")
                .send()
                .await
                .unwrap(),
            400,
            "malformed_json",
        ),
        (
            app.http
                .post(app.url("/transfers"))
                .header("content-type", "text/plain")
                .body("{}")
                .send()
                .await
                .unwrap(),
            415,
            "unsupported_media_type",
        ),
    ];
    for (response, status, code) in answers {
        assert_problem(response, status, code).await;
    }
}

#[tokio::test]
async fn every_response_carries_a_request_id_and_echoes_the_clients() {
    let app = spawn_app().await;
    for path in ["/health", "/accounts/nobody", "/nowhere"] {
        let response = app.get(path).await;
        let id = response
            .headers()
            .get("x-request-id")
            .unwrap_or_else(|| panic!("{path} answered without x-request-id"));
        assert!(!id.is_empty(), "{path}");
    }
    let first = app.get("/health").await.headers()["x-request-id"].clone();
    let second = app.get("/health").await.headers()["x-request-id"].clone();
    assert_ne!(first, second, "each request gets its own id");

    let echoed = app
        .http
        .get(app.url("/accounts/nobody"))
        .header("x-request-id", "client-chosen-42")
        .send()
        .await
        .unwrap();
    assert_eq!(echoed.headers()["x-request-id"], "client-chosen-42");
}

#[tokio::test]
async fn health_and_readiness_answer_200() {
    let app = spawn_app().await;
    for path in ["/health", "/ready"] {
        let response = app.get(path).await;
        assert_eq!(response.status(), 200, "{path}");
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(body["status"], "ok", "{path}");
    }
}

#[tokio::test]
async fn the_served_openapi_document_is_the_committed_one() {
    let app = spawn_app().await;
    let response = app.get("/openapi.json").await;
    assert_eq!(response.status(), 200);
    let served: serde_json::Value = response.json().await.unwrap();
    let committed: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/openapi.json"))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(served, committed);
}

/// Issue 34: a step that kept losing to concurrent writers is not a database that is
/// down. The store's error on a recorded transfer, through the service's, answers 503
/// `contended` naming the transfer, with `Retry-After`, byte for byte; without a recorded
/// transfer it names none. This is the mapping alone, on the real types: the protocol's
/// own rounds (an account step that loses 16 times) cannot be made to lose without timing;
/// `tests/interleavings.rs` provokes a capture's and an idempotency key's lost races, and
/// `native::a_native_transaction_that_keeps_conflicting_gives_up_contended_and_moves_nothing`
/// a native transaction's, on a real server.
#[test]
fn a_lost_race_answers_503_contended_with_retry_after_byte_for_byte() {
    use axum::response::IntoResponse;
    use transfer_service::domain::TransferId;
    use transfer_service::http::problem::ApiError;
    use transfer_service::service::ServiceError;
    use transfer_service::store::StoreError;

    let answer = |transfer: Option<TransferId>| {
        let service = ServiceError::from(StoreError::contended(transfer, "kept losing"));
        assert!(matches!(service, ServiceError::Contended(_)), "{service:?}");
        let response = ApiError::from(service).into_response();
        let retry_after = response.headers().get("retry-after").cloned();
        let status = response.status().as_u16();
        let body =
            futures::executor::block_on(axum::body::to_bytes(response.into_body(), usize::MAX))
                .unwrap();
        let retry_after = retry_after.map(|v| v.to_str().unwrap().to_owned());
        (
            status,
            retry_after,
            String::from_utf8(body.to_vec()).unwrap(),
        )
    };
    let id = "65a1b2c3d4e5f60718293a4b";
    assert_eq!(
        answer(Some(TransferId::parse(id).unwrap())),
        (
            503,
            Some("1".to_owned()),
            r#"{"type":"urn:transfer-service:problem:contended","title":"Contended","status":503,"detail":"transfer 65a1b2c3d4e5f60718293a4b kept losing to concurrent changes (of its accounts, or of the transfer itself) and this request stopped trying; what was recorded stands and the transfer will be finished: read it with GET /transfers/65a1b2c3d4e5f60718293a4b, or send the same request again after Retry-After seconds (a POST /transfers only with the same Idempotency-Key: without one it would make another transfer)","code":"contended","transferId":"65a1b2c3d4e5f60718293a4b"}"#.to_owned()
        )
    );
    assert_eq!(
        answer(None),
        (
            503,
            Some("1".to_owned()),
            r#"{"type":"urn:transfer-service:problem:contended","title":"Contended","status":503,"detail":"this request kept losing to concurrent requests (on the same account, or with the same Idempotency-Key) and recorded nothing; send it again after Retry-After seconds, with the same Idempotency-Key if it had one","code":"contended"}"#.to_owned()
        )
    );
}
