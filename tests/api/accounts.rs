use serde_json::json;

use crate::support::spawn_app;

#[tokio::test]
async fn opening_an_account_answers_201_with_location_and_the_account() {
    let app = spawn_app().await;
    let response = app
        .post_json("/accounts", json!({ "id": "alice", "name": "Alice", "balance": 10_000, "currency": "EUR" }))
        .await;
    assert_eq!(response.status(), 201);
    assert_eq!(response.headers()["location"], "/accounts/alice");
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["id"], "alice");
    assert_eq!(body["balance"], 10_000);
    assert_eq!(body["currency"], "EUR");
    assert_eq!(body["pendingTransactions"], json!([]));
    assert_eq!(app.balance("alice").await, 10_000);
}
