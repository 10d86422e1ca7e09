use crate::support::spawn_app;

#[tokio::test]
async fn a_transfer_moves_the_amount_and_ends_done() {
    let app = spawn_app().await;
    app.open_account("alice", 1_000).await;
    app.open_account("bob", 0).await;
    let (status, body) = app.transfer("alice", "bob", 300).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["state"], "done");
    assert_eq!(app.balance("alice").await, 700);
    assert_eq!(app.balance("bob").await, 300);
    assert!(app.accounts_with_pending().await.is_empty());
}
