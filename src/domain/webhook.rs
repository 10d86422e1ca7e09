//! Webhooks (`docs/webhooks.md`): an endpoint a user registers to be sent the events of
//! some types, and each delivery of an event to it, signed as the Standard Webhooks
//! specification says so that its libraries verify it.

use std::net::IpAddr;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use std::collections::BTreeMap;

use super::{DeploymentName, Event, EventType, ParseError, TenantName, Timestamp};

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
/// (`WEBHOOK_ALLOW_PRIVATE`): what a server-side request forgery would aim at (this host,
/// its network, the cloud's metadata at 169.254.169.254) or what is no unicast address
/// of the internet is refused.
///
/// IPv4: "this network" (0.0.0.0/8), loopback, private (RFC 1918), link-local, shared
/// (100.64.0.0/10, carrier NAT), IETF protocol assignments (192.0.0.0/24), benchmarking
/// (198.18.0.0/15), documentation, multicast and reserved (240.0.0.0/4, the broadcast
/// address in it). IPv6: unspecified, loopback, multicast, unique-local (fc00::/7),
/// link-local (fe80::/10), site-local (fec0::/10, deprecated but still routed by some
/// networks), documentation (2001:db8::/32); and the forms that carry an IPv4 address,
/// judged by that address: IPv4-mapped (`::ffff:a.b.c.d`), IPv4-compatible
/// (`::a.b.c.d`), NAT64 (`64:ff9b::a.b.c.d`) and 6to4 (`2002:AABB:CCDD::/48` for
/// `A.B.C.D`). The local-use NAT64 prefix (`64:ff9b:1::/48`, a network's own) is
/// refused whole.
pub fn is_public_address(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = embedded_ipv4(v6) {
                return is_public_v4(v4);
            }
            let first = v6.segments()[0];
            let second = v6.segments()[1];
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
                || (first & 0xffc0) == 0xfec0
                || (first == 0x2001 && second == 0x0db8)
                || (first == 0x64 && second == 0xff9b && v6.segments()[2] == 1))
        }
    }
}

fn is_public_v4(v4: std::net::Ipv4Addr) -> bool {
    let [a, b, c, _] = v4.octets();
    !(v4.is_loopback()
        || v4.is_private()
        || v4.is_link_local()
        || v4.is_unspecified()
        || v4.is_broadcast()
        || v4.is_multicast()
        || v4.is_documentation()
        || a == 0
        || (a == 100 && (64..128).contains(&b))
        || (a == 192 && b == 0 && c == 0)
        || (a == 198 && (18..20).contains(&b))
        || a >= 240)
}

/// The IPv4 address an IPv6 address carries, when it is of a form that reaches it:
/// IPv4-mapped, IPv4-compatible (`::a.b.c.d`, but not `::` nor `::1`), NAT64 (well-known
/// `64:ff9b::/96`) or 6to4 (`2002::/16`).
fn embedded_ipv4(v6: std::net::Ipv6Addr) -> Option<std::net::Ipv4Addr> {
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    let s = v6.segments();
    let low = std::net::Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    let compatible = s[..6].iter().all(|x| *x == 0) && (s[6] != 0 || s[7] > 1);
    let nat64 = s[0] == 0x64 && s[1] == 0xff9b && s[2..6].iter().all(|x| *x == 0);
    if compatible || nat64 {
        return Some(low);
    }
    if s[0] == 0x2002 {
        return Some(std::net::Ipv4Addr::new(
            (s[1] >> 8) as u8,
            s[1] as u8,
            (s[2] >> 8) as u8,
            s[2] as u8,
        ));
    }
    None
}

/// `MAX_WEBHOOKS` when unset: enough for every integration of a service, small enough
/// that the dispatcher's list of webhooks stays a few megabytes.
pub const DEFAULT_MAX_WEBHOOKS: usize = 1000;

/// `MAX_WEBHOOKS_TOTAL` when unset: ten tenants' worth of [`DEFAULT_MAX_WEBHOOKS`]. The
/// dispatcher and every sender read the whole list, so it is bounded in all, not only
/// per tenant, whatever the number of tenants.
pub const DEFAULT_MAX_WEBHOOKS_TOTAL: usize = 10_000;

/// Which cap a registration met: what it counts, and how many it allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WebhookCap {
    /// The registering scope's own webhooks (its tenant's, or the platform's):
    /// `MAX_WEBHOOKS`.
    Scope(usize),
    /// Every webhook of every tenant and the platform: `MAX_WEBHOOKS_TOTAL`.
    Total(usize),
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
    /// The most webhooks of one tenant (or of the platform) registered at once
    /// (`MAX_WEBHOOKS`); one more is refused.
    pub max_webhooks: usize,
    /// The most webhooks registered at once in all (`MAX_WEBHOOKS_TOTAL`), every
    /// tenant's and the platform's; one more is refused. At most 100,000 as a setting:
    /// a sender's claim names every webhook it has room for in one `$in` (`wh_` and 24
    /// digits, about 40 bytes each with the array's framing: about 4 MB at 100,000,
    /// under the 16 MiB of a MongoDB command).
    pub max_webhooks_total: usize,
}

impl Default for WebhookSettings {
    fn default() -> Self {
        WebhookSettings {
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(3600),
            give_up_after: Duration::from_secs(3 * 24 * 3600),
            allow_private: false,
            max_webhooks: DEFAULT_MAX_WEBHOOKS,
            max_webhooks_total: DEFAULT_MAX_WEBHOOKS_TOTAL,
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
    /// The tenant that registered it (`docs/tenants.md`): it is sent only the events
    /// that tenant sees. `None`: a platform webhook, sent every event.
    pub tenant: Option<TenantName>,
    /// The signing secret, shown once, at registration (or at the rotation that made it).
    pub secret: WebhookSecret,
    /// The secret a rotation replaced, and until when (by the database's clock)
    /// deliveries are signed with it too: the overlap in which a receiver moves to the
    /// new secret.
    pub previous: Option<(WebhookSecret, Timestamp)>,
    pub created_at: Timestamp,
    /// Per deployment, its cluster time read at registration (seconds, increment), before
    /// the webhook was written: the deployment's events after it are sent, those at or
    /// before it are not. Judged by each deployment's own order, never by comparing
    /// clocks, so a deployment whose clock runs behind loses nothing.
    pub registered_at: BTreeMap<DeploymentName, (u32, u32)>,
}

impl Webhook {
    /// Whether it is sent events of `kind`.
    pub fn wants(&self, kind: EventType) -> bool {
        self.types.is_empty() || self.types.contains(&kind)
    }

    /// Whether its tenant sees `event` (a platform webhook sees every event).
    pub fn sees(&self, event: &Event) -> bool {
        self.tenant.as_ref().is_none_or(|t| event.is_seen_by(t))
    }

    /// Whether `event` came after its registration: after the position read from the
    /// event's deployment at registration. A webhook registered before positions were
    /// kept, or a deployment it has none of (none was read: a deployment without cluster
    /// times), is judged by `created_at` against the event's time, as before.
    pub fn registered_before(&self, event: &Event) -> bool {
        match self.registered_at.get(&event.deployment) {
            Some(&(seconds, increment)) => {
                (event.position.seconds, event.position.increment) > (seconds, increment)
            }
            None => event.at >= self.created_at,
        }
    }

    /// The `webhook-signature` header of a delivery sent at `now` (the database's time,
    /// whose seconds are `timestamp`): the signature of the secret, then, during a
    /// rotation's overlap, the previous secret's, separated by a space as Standard
    /// Webhooks allow; a receiver that knows either secret verifies it.
    pub fn signature(&self, id: &str, timestamp: i64, body: &str, now: Timestamp) -> String {
        let mut header = self.secret.sign(id, timestamp, body);
        if let Some((previous, until)) = &self.previous {
            if now < *until {
                header.push(' ');
                header.push_str(&previous.sign(id, timestamp, body));
            }
        }
        header
    }

    /// Until when the previous secret signs too, if it still does at `now`.
    pub fn previous_until(&self, now: Timestamp) -> Option<Timestamp> {
        self.previous
            .as_ref()
            .map(|(_, until)| *until)
            .filter(|until| now < *until)
    }
}

/// The longest overlap of a rotation (`POST /webhooks/{id}/rotate-secret`): 7 days.
pub const MAX_ROTATION_OVERLAP: Duration = Duration::from_secs(7 * 24 * 3600);
/// The overlap of a rotation that names none: 24 hours.
pub const DEFAULT_ROTATION_OVERLAP: Duration = Duration::from_secs(24 * 3600);

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

    /// The ranges of issue 33, each at its edges, and the IPv6 forms that carry an IPv4
    /// address judged by that address (a private one refused, a public one let through).
    #[test]
    fn reserved_ranges_and_ipv6_forms_of_private_ipv4_addresses_are_not_public() {
        for refused in [
            // Shared address space (carrier NAT), 100.64.0.0/10.
            "100.64.0.0",
            "100.127.255.255",
            // IETF protocol assignments, 192.0.0.0/24.
            "192.0.0.0",
            "192.0.0.170",
            "192.0.0.255",
            // Benchmarking, 198.18.0.0/15.
            "198.18.0.1",
            "198.19.255.255",
            // Reserved, 240.0.0.0/4 (the broadcast address with it).
            "240.0.0.1",
            "250.1.2.3",
            "255.255.255.254",
            "255.255.255.255",
            // Site-local, fec0::/10.
            "fec0::1",
            "feff:ffff::1",
            // Documentation.
            "2001:db8::1",
            // NAT64 of private and loopback addresses.
            "64:ff9b::7f00:1",
            "64:ff9b::a00:1",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b:1::5db8:d822",
            // 6to4 of private and loopback addresses.
            "2002:7f00:1::",
            "2002:a00:1::1",
            "2002:a9fe:a9fe::1",
            // IPv4-compatible forms of private and loopback addresses.
            "::127.0.0.1",
            "::10.0.0.1",
            "::169.254.169.254",
            "::ffff:10.0.0.1",
        ] {
            assert!(!is_public_address(refused.parse().unwrap()), "{refused}");
        }
        for public in [
            "100.63.255.255",
            "100.128.0.0",
            "192.0.1.1",
            "198.17.255.255",
            "198.20.0.0",
            "223.255.255.255",
            "64:ff9b::5db8:d822",
            "2002:5db8:d822::1",
            "::93.184.216.34",
            "::ffff:93.184.216.34",
            "2606:4700::1111",
        ] {
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
