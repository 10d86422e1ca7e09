//! The webhook dispatcher's commands stay within MongoDB's limits whatever the number of
//! webhooks and the size of the events (issue 33): a page of events times the webhooks
//! is made in batches bounded by bytes (`deliverer::batch`), never in one command.
//!
//! SecantusDB answers commands larger than a real MongoDB takes (16 MiB), so the bound is
//! checked here, on every command the service's store sends, recorded by the driver's
//! command monitoring: the dispatcher and the sender run as in production (with the event
//! recorder), over a store that records, with 20 webhooks and 500 events of 8 KB bodies
//! (80 MB of deliveries). Before the batches, one page made them in one insert, which the
//! driver split only at its 48 MB message limit; and the read of those made already was
//! one `$in` of every id of the page. Every delivery is then sent, once.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode, Uri};
use mongodb::bson::Document;
use support::{database_uri, eventually, fresh_database_name, values};
use tokio_util::sync::CancellationToken;
use transfer_service::domain::{
    Currency, DeploymentName, Event, OpeningBalance, Scope, WebhookSettings, WebhookUrl,
};
use transfer_service::service::{NewAccount, NewWebhook, TransferService};
use transfer_service::store::Deployments;
use transfer_service::store::testing::connect_keeping_commands;

/// What a MongoDB server takes in one command at most (`maxBsonObjectSize`).
const MONGODB_MAX_COMMAND_BYTES: usize = 16 * 1024 * 1024;
const HOOKS: usize = 20;
const EVENTS: usize = 500;
const BODY_BYTES: usize = 8 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_command_of_the_dispatcher_passes_16_mib_and_every_delivery_is_sent_once() {
    let database = fresh_database_name();
    let name = DeploymentName::parse("main").unwrap();
    let (store, recorded) = connect_keeping_commands(name, &database_uri(), &database)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let service = TransferService::new(
        Deployments::new(vec![store.clone()]),
        "dispatch",
        Duration::from_secs(10),
    )
    .with_webhook_settings(WebhookSettings {
        allow_private: true,
        ..WebhookSettings::default()
    });

    // The endpoint: every request's path and `webhook-id`.
    let got: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let sink = got.clone();
    let router = axum::Router::new().fallback(move |uri: Uri, headers: HeaderMap| {
        let sink = sink.clone();
        async move {
            let id = headers
                .get("webhook-id")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            sink.lock().unwrap().push((uri.path().to_owned(), id));
            StatusCode::NO_CONTENT
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    for i in 0..HOOKS {
        let url = WebhookUrl::parse(&format!("http://{addr}/h{i}")).unwrap();
        service
            .webhooks()
            .register_webhook(NewWebhook {
                url,
                types: Vec::new(),
                description: None,
                scope: transfer_service::domain::Scope::Platform,
            })
            .await
            .unwrap();
    }

    let shutdown = CancellationToken::new();
    let recorder = tokio::spawn(transfer_service::recorder::run(
        service.deployments().clone(),
        "dispatch".to_owned(),
        Duration::from_secs(3600),
        shutdown.clone(),
    ));
    for i in 0..EVENTS {
        service
            .book()
            .open_account(NewAccount {
                id: Some(values::account(&format!("a{i}"))),
                tenant: None,
                name: None,
                balance: OpeningBalance::parse(0).unwrap(),
                currency: Currency::usd(),
                deployment: None,
            })
            .await
            .unwrap();
    }
    // Every event recorded before the dispatcher starts: one page holds them all.
    eventually(
        &format!("the {EVENTS} events are recorded"),
        Duration::from_secs(60),
        Duration::from_millis(100),
        async || {
            let page = service
                .feed()
                .events(&Scope::Platform, None, 1000, &[])
                .await
                .ok()?;
            (page.events.len() >= EVENTS).then_some(())
        },
    )
    .await;
    // Bodies of 8 KB: what each delivery's document carries.
    let render = Arc::new(|event: &Event| {
        format!(
            "{{\"id\":\"{}\",\"pad\":\"{}\"}}",
            event.id,
            "x".repeat(BODY_BYTES)
        )
    });
    let deliverer = tokio::spawn(transfer_service::deliverer::run(
        service.feed().clone(),
        service.webhooks().clone(),
        "dispatch".to_owned(),
        render,
        shutdown.clone(),
    ));

    let expected: HashSet<(String, String)> = (0..HOOKS)
        .flat_map(|h| (0..EVENTS).map(move |e| (format!("/h{h}"), format!("account.opened:a{e}"))))
        .collect();
    let largest = |recorded: &Mutex<Vec<(String, Document)>>| -> (usize, String) {
        let recorded = recorded.lock().unwrap();
        recorded
            .iter()
            .filter(|(_, command)| {
                ["insert", "find", "update", "delete"]
                    .iter()
                    .any(|name| command.get_str(*name) == Ok("deliveries"))
            })
            .map(|(name, command)| {
                let bytes = mongodb::bson::to_vec(command).map_or(usize::MAX, |b| b.len());
                (bytes, name.clone())
            })
            .max()
            .unwrap_or_default()
    };
    eventually(
        &format!("{} deliveries are sent", expected.len()),
        Duration::from_secs(180),
        Duration::from_millis(250),
        async || {
            let (bytes, name) = largest(&recorded);
            assert!(
                bytes <= MONGODB_MAX_COMMAND_BYTES,
                "a {name} on deliveries of {bytes} bytes, over MongoDB's {MONGODB_MAX_COMMAND_BYTES}"
            );
            let sent: HashSet<(String, String)> = got.lock().unwrap().iter().cloned().collect();
            expected.is_subset(&sent).then_some(())
        },
    )
    .await;
    shutdown.cancel();
    let _ = tokio::join!(recorder, deliverer);

    let (bytes, name) = largest(&recorded);
    println!("the largest command on deliveries: a {name} of {bytes} bytes");
    assert!(
        bytes <= MONGODB_MAX_COMMAND_BYTES,
        "a {name} of {bytes} bytes"
    );
    // And within the dispatcher's own bound, with the command's framing.
    let bound = transfer_service::deliverer::COMMAND_BYTES + 64 * 1024;
    assert!(bytes <= bound, "a {name} of {bytes} bytes, over {bound}");
    let sent = got.lock().unwrap().clone();
    let distinct: HashSet<(String, String)> = sent.iter().cloned().collect();
    assert_eq!(distinct, expected, "each delivery, and nothing else");
    assert_eq!(sent.len(), expected.len(), "each once");
}
