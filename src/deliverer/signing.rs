//! The request of an attempt, as Standard Webhooks say (`docs/webhooks.md`, "A delivery"):
//! the event's JSON `POST`ed with `webhook-id` (the event's id, the same at every
//! attempt, so that a receiver drops a repeat), `webhook-timestamp` (the database's
//! time, in seconds) and `webhook-signature` (the secret's signature of the three, and
//! the previous secret's too during a rotation's overlap).
//!
//! The time is the database's, never this instance's: every instance stamps by the
//! same clock, and a receiver that refuses old timestamps judges them all alike. The
//! signature itself is the domain's ([`Webhook::signature`]); this file names no store
//! and no service.

use crate::domain::{Timestamp, Webhook};

/// The request that sends `body`, the event `event_id`, to `hook` at `now` (the
/// database's time), signed.
pub fn signed_request(
    client: &reqwest::Client,
    hook: &Webhook,
    event_id: &str,
    body: &str,
    now: Timestamp,
) -> reqwest::RequestBuilder {
    let timestamp = now.timestamp();
    let signature = hook.signature(event_id, timestamp, body, now);
    client
        .post(hook.url.url().clone())
        .header("content-type", "application/json")
        .header("webhook-id", event_id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signature)
        .body(body.to_owned())
}

#[cfg(test)]
mod tests {
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;
    use hmac::{Hmac, Mac};
    use sha2::Sha256;

    use super::*;
    use crate::domain::{WebhookSecret, WebhookUrl};

    /// Whether `signature` (one `v1,<base64>`) is HMAC-SHA256 of `id.timestamp.body` by
    /// `secret` (its `whsec_` form), as a Standard Webhooks receiver checks it.
    fn verifies(secret: &str, id: &str, timestamp: &str, body: &[u8], signature: &str) -> bool {
        let key = STANDARD
            .decode(secret.strip_prefix("whsec_").unwrap())
            .unwrap();
        let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
        mac.update(format!("{id}.{timestamp}.").as_bytes());
        mac.update(body);
        let Some(encoded) = signature.strip_prefix("v1,") else {
            return false;
        };
        let Ok(given) = STANDARD.decode(encoded) else {
            return false;
        };
        mac.verify_slice(&given).is_ok()
    }

    fn hook(previous: Option<(WebhookSecret, Timestamp)>) -> Webhook {
        Webhook {
            id: "wh_000000000000000000000001".into(),
            url: WebhookUrl::parse("https://example.com/hooks?x=1").unwrap(),
            types: Vec::new(),
            description: None,
            tenant: None,
            secret: WebhookSecret::random(),
            previous,
            created_at: chrono::Utc::now(),
            registered_at: Default::default(),
        }
    }

    fn header<'a>(request: &'a reqwest::Request, name: &str) -> &'a str {
        request
            .headers()
            .get(name)
            .unwrap_or_else(|| panic!("no {name}"))
            .to_str()
            .unwrap()
    }

    /// The request a receiver gets: POST to the URL, the event's id and the time given
    /// in seconds, and a signature of exactly those and the body that a Standard
    /// Webhooks receiver verifies with the secret (and no other).
    #[test]
    fn an_attempt_is_posted_with_the_event_id_the_given_time_and_a_signature_the_secret_verifies() {
        let hook = hook(None);
        let now = chrono::DateTime::parse_from_rfc3339("2026-11-28T10:00:00.750Z")
            .unwrap()
            .to_utc();
        let body = r#"{"id":"transfer.done:t1","type":"transfer.done"}"#;
        let client = reqwest::Client::new();
        let request = signed_request(&client, &hook, "transfer.done:t1", body, now)
            .build()
            .unwrap();
        assert_eq!(request.method(), reqwest::Method::POST);
        assert_eq!(request.url().as_str(), "https://example.com/hooks?x=1");
        assert_eq!(header(&request, "content-type"), "application/json");
        assert_eq!(header(&request, "webhook-id"), "transfer.done:t1");
        assert_eq!(header(&request, "webhook-timestamp"), "1795860000");
        let sent = request.body().and_then(|b| b.as_bytes()).unwrap();
        assert_eq!(sent, body.as_bytes());
        let signature = header(&request, "webhook-signature");
        assert!(!signature.contains(' '), "one secret, one signature");
        let secret = hook.secret.expose();
        assert!(verifies(
            &secret,
            "transfer.done:t1",
            "1795860000",
            sent,
            signature
        ));
        assert!(!verifies(
            &secret,
            "transfer.done:t2",
            "1795860000",
            sent,
            signature
        ));
        assert!(!verifies(
            &secret,
            "transfer.done:t1",
            "1795860001",
            sent,
            signature
        ));
        let other = WebhookSecret::random().expose();
        assert!(!verifies(
            &other,
            "transfer.done:t1",
            "1795860000",
            sent,
            signature
        ));
    }

    /// During a rotation's overlap the request carries both signatures, each verified
    /// by its own secret; after it, only the new secret's.
    #[test]
    fn during_a_rotation_each_secret_verifies_its_signature_and_after_it_only_the_new_one_signs() {
        let previous = WebhookSecret::random();
        let until = chrono::DateTime::parse_from_rfc3339("2026-11-28T12:00:00Z")
            .unwrap()
            .to_utc();
        let hook = hook(Some((previous.clone(), until)));
        let client = reqwest::Client::new();
        let during = until - chrono::TimeDelta::seconds(1);
        let request = signed_request(&client, &hook, "e", "{}", during)
            .build()
            .unwrap();
        let timestamp = header(&request, "webhook-timestamp").to_owned();
        let signatures: Vec<&str> = header(&request, "webhook-signature").split(' ').collect();
        assert_eq!(signatures.len(), 2);
        assert!(verifies(
            &hook.secret.expose(),
            "e",
            &timestamp,
            b"{}",
            signatures[0]
        ));
        assert!(verifies(
            &previous.expose(),
            "e",
            &timestamp,
            b"{}",
            signatures[1]
        ));

        let request = signed_request(&client, &hook, "e", "{}", until)
            .build()
            .unwrap();
        let timestamp = header(&request, "webhook-timestamp").to_owned();
        let signature = header(&request, "webhook-signature");
        assert!(verifies(
            &hook.secret.expose(),
            "e",
            &timestamp,
            b"{}",
            signature
        ));
        assert!(!verifies(
            &previous.expose(),
            "e",
            &timestamp,
            b"{}",
            signature
        ));
    }
}
