//! Webhooks (`docs/webhooks.md`): an endpoint a user registers to be sent the events of
//! some types, and each delivery of an event to it, signed as the Standard Webhooks
//! specification says so that its libraries verify it.

use std::net::IpAddr;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::{EventType, ParseError, Timestamp};

/// Where deliveries are sent: an `http` or `https` URL with a host, at most
/// [`WebhookUrl::MAX_LEN`] bytes. Whether its addresses may be reached is decided where
/// it is resolved (see `deliverer`), at registration and at each delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookUrl(url::Url);

impl WebhookUrl {
    pub const MAX_LEN: usize = 2048;

    pub fn parse(raw: &str) -> Result<WebhookUrl, ParseError> {
        if raw.len() > Self::MAX_LEN {
            return Err(ParseError(format!(
                "must be at most {} bytes",
                Self::MAX_LEN
            )));
        }
        let url = url::Url::parse(raw)
            .map_err(|e| ParseError(format!("must be an absolute http or https URL ({e})")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ParseError("must be an http or https URL".into()));
        }
        if url.host().is_none() {
            return Err(ParseError("must name a host".into()));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(ParseError(
                "must not carry credentials (sign the deliveries instead: each is signed)".into(),
            ));
        }
        Ok(WebhookUrl(url))
    }

    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }

    pub fn url(&self) -> &url::Url {
        &self.0
    }

    /// The host and port to resolve (the port the scheme implies when none is given).
    pub fn host_and_port(&self) -> (String, u16) {
        let host = match self.0.host() {
            Some(url::Host::Ipv6(ip)) => ip.to_string(),
            Some(host) => host.to_string(),
            None => String::new(),
        };
        (host, self.0.port_or_known_default().unwrap_or(80))
    }
}

/// Whether a delivery may connect to `ip` when private addresses are not allowed
/// (`WEBHOOK_ALLOW_PRIVATE`): not loopback, private (RFC 1918), link-local, unique-local
/// (fc00::/7), unspecified, broadcast, multicast, shared (100.64.0.0/10), documentation
/// or an IPv4 address mapped into IPv6 that is one of those. What a server-side request
/// forgery would aim at: this host, its network, the cloud's metadata (169.254.169.254).
pub fn is_public_address(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b)))
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public_address(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80)
        }
    }
}

/// How deliveries are made (`WEBHOOK_*`).
#[derive(Debug, Clone, Copy)]
pub struct WebhookSettings {
    /// The wait after a first failed attempt; doubled after each further one.
    pub retry_base: Duration,
    /// The longest wait between attempts.
    pub retry_max: Duration,
    /// How long after it is made (or retried by hand) a delivery is tried.
    pub give_up_after: Duration,
    /// Whether deliveries may go to loopback, private, link-local and unique-local
    /// addresses (local development and tests).
    pub allow_private: bool,
}

impl Default for WebhookSettings {
    fn default() -> Self {
        WebhookSettings {
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(3600),
            give_up_after: Duration::from_secs(3 * 24 * 3600),
            allow_private: false,
        }
    }
}

/// A registered endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Webhook {
    /// `wh_` and 24 hexadecimal digits.
    pub id: String,
    pub url: WebhookUrl,
    /// The types it is sent; every type when empty.
    pub types: Vec<EventType>,
    pub description: Option<String>,
    /// The signing secret, shown once, at registration.
    pub secret: WebhookSecret,
    pub created_at: Timestamp,
}

impl Webhook {
    /// Whether it is sent events of `kind`.
    pub fn wants(&self, kind: EventType) -> bool {
        self.types.is_empty() || self.types.contains(&kind)
    }
}

/// A signing secret: 24 random bytes, shown as `whsec_<base64>` (the Standard Webhooks
/// form, which its libraries take as is).
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookSecret(Vec<u8>);

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookSecret(..)")
    }
}

impl WebhookSecret {
    pub const PREFIX: &str = "whsec_";

    pub fn random() -> WebhookSecret {
        WebhookSecret(rand::random::<[u8; 24]>().to_vec())
    }

    /// The `whsec_<base64>` form.
    pub fn parse(raw: &str) -> Result<WebhookSecret, ParseError> {
        let refuse = || ParseError("is not a whsec_ secret".into());
        let encoded = raw.strip_prefix(Self::PREFIX).ok_or_else(refuse)?;
        let bytes = STANDARD.decode(encoded).map_err(|_| refuse())?;
        if bytes.is_empty() {
            return Err(refuse());
        }
        Ok(WebhookSecret(bytes))
    }

    pub fn expose(&self) -> String {
        format!("{}{}", Self::PREFIX, STANDARD.encode(&self.0))
    }

    /// The `webhook-signature` header of a delivery: `v1,<base64 of HMAC-SHA256 of
    /// "<id>.<timestamp>.<body>">`.
    pub fn sign(&self, id: &str, timestamp: i64, body: &str) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key");
        mac.update(format!("{id}.{timestamp}.").as_bytes());
        mac.update(body.as_bytes());
        format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
    }
}

/// Where a delivery stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeliveryState {
    /// Not acknowledged yet: tried again until it is, or until the give-up time.
    Pending,
    /// An attempt was answered 2xx.
    Succeeded,
    /// Given up after `WEBHOOK_GIVE_UP_AFTER_MS`; a manual retry makes it pending again.
    Failed,
}

impl DeliveryState {
    pub const ALL: [DeliveryState; 3] = [
        DeliveryState::Pending,
        DeliveryState::Succeeded,
        DeliveryState::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryState::Pending => "pending",
            DeliveryState::Succeeded => "succeeded",
            DeliveryState::Failed => "failed",
        }
    }

    pub fn parse(raw: &str) -> Result<DeliveryState, ParseError> {
        DeliveryState::ALL
            .into_iter()
            .find(|s| s.as_str() == raw)
            .ok_or_else(|| ParseError("must be pending, succeeded or failed".into()))
    }
}

/// One attempt to deliver.
#[derive(Debug, Clone, PartialEq)]
pub struct Attempt {
    pub at: Timestamp,
    /// The HTTP status answered, if one was.
    pub status: Option<u16>,
    /// Why there was no 2xx answer (connection refused, time-out, an address not
    /// allowed), if there was none.
    pub error: Option<String>,
    pub duration_ms: u64,
}

/// An event on its way to one webhook.
#[derive(Debug, Clone, PartialEq)]
pub struct Delivery {
    /// `<webhook id>:<event id>`: one delivery per event and webhook.
    pub id: String,
    pub webhook: String,
    pub event_id: String,
    pub event_type: EventType,
    pub state: DeliveryState,
    pub attempts: Vec<Attempt>,
    /// When the next attempt is due, while pending.
    pub next_attempt_at: Option<Timestamp>,
    pub created_at: Timestamp,
}

/// The wait before attempt `n + 1` after `n` failed attempts (`n >= 1`): `base * 2^(n-1)`,
/// at most `max`, then a random 50 to 100 % of it (jitter, so that endpoints back up
/// after an outage are not all tried at once).
pub fn backoff_ms(failed: u32, base_ms: u64, max_ms: u64, random: f64) -> u64 {
    let doubled = base_ms.saturating_mul(1u64 << failed.saturating_sub(1).min(40));
    let capped = doubled.min(max_ms);
    let jittered = capped as f64 * (0.5 + 0.5 * random.clamp(0.0, 1.0));
    jittered as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_is_the_standard_webhooks_one() {
        // The example of the Standard Webhooks specification's reference libraries.
        let secret = WebhookSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = r#"{"test": 2432232314}"#;
        assert_eq!(
            secret.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
        assert_eq!(secret.expose(), "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw");
    }

    #[test]
    fn only_http_and_https_urls_with_a_host_are_taken() {
        for good in ["https://example.com/hooks", "http://10.0.0.1:8080/x?y=1"] {
            assert!(WebhookUrl::parse(good).is_ok(), "{good}");
        }
        for bad in [
            "ftp://example.com/",
            "file:///etc/passwd",
            "example.com/hooks",
            "https://user:pw@example.com/",
            "gopher://x",
            "",
        ] {
            assert!(WebhookUrl::parse(bad).is_err(), "{bad}");
        }
        let long = format!("https://example.com/{}", "a".repeat(3000));
        assert!(WebhookUrl::parse(&long).is_err());
    }

    #[test]
    fn private_and_local_addresses_are_not_public() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::",
        ] {
            assert!(!is_public_address(private.parse().unwrap()), "{private}");
        }
        for public in ["93.184.216.34", "1.1.1.1", "2606:4700:4700::1111"] {
            assert!(is_public_address(public.parse().unwrap()), "{public}");
        }
    }

    #[test]
    fn the_backoff_doubles_up_to_its_cap_with_jitter() {
        assert_eq!(backoff_ms(1, 1000, 3_600_000, 1.0), 1000);
        assert_eq!(backoff_ms(2, 1000, 3_600_000, 1.0), 2000);
        assert_eq!(backoff_ms(3, 1000, 3_600_000, 0.0), 2000);
        assert_eq!(backoff_ms(30, 1000, 3_600_000, 1.0), 3_600_000);
        assert_eq!(backoff_ms(100, 1000, 3_600_000, 1.0), 3_600_000);
    }
}
