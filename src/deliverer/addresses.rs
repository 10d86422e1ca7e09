//! Where a delivery may connect, checked at each attempt against the address actually
//! connected to (`docs/webhooks.md`): the HTTP client resolves names through
//! [`CheckedResolver`], which drops addresses that are not public (unless
//! `WEBHOOK_ALLOW_PRIVATE`), follows no redirect and uses no proxy; a URL whose host is
//! an address is checked before sending ([`refused_literal`]), as no resolver sees it.
//!
//! The rule itself (which addresses are public) is the domain's
//! ([`is_public_address`]); the service applies it once more at registration.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use crate::domain::{WebhookUrl, is_public_address};

use super::ATTEMPT_TIMEOUT;

/// The HTTP client of deliveries: every attempt within [`ATTEMPT_TIMEOUT`], connecting
/// only where [`CheckedResolver`] allows, following no redirect, through no proxy.
pub fn client(allow_private: bool) -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(ATTEMPT_TIMEOUT)
        .connect_timeout(ATTEMPT_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .user_agent(concat!(
            "transfer-service/",
            env!("CARGO_PKG_VERSION"),
            " webhooks"
        ))
        .dns_resolver(Arc::new(CheckedResolver { allow_private }))
        .build()
}

/// The address `url` names as its host, if it names one that a delivery may not connect
/// to (unless `allow_private`): such a URL is not sent to, as no resolver sees it.
pub fn refused_literal(url: &WebhookUrl, allow_private: bool) -> Option<IpAddr> {
    let (host, _) = url.host_and_port();
    let ip = host.trim_matches(['[', ']']).parse::<IpAddr>().ok()?;
    (!allow_private && !is_public_address(ip)).then_some(ip)
}

/// Resolves names as the system does, keeping only the addresses a delivery may connect
/// to: the connection then goes to a checked address, whatever the name resolves to by
/// the time of the attempt.
pub struct CheckedResolver {
    /// `WEBHOOK_ALLOW_PRIVATE`: keep every address (tests, and private networks).
    allow_private: bool,
}

impl reqwest::dns::Resolve for CheckedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let allow_private = self.allow_private;
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let found: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
                .await?
                .filter(|a| allow_private || is_public_address(a.ip()))
                .collect();
            if found.is_empty() {
                return Err(format!("{host} resolves to no public address").into());
            }
            let addrs: reqwest::dns::Addrs = Box::new(found.into_iter());
            Ok(addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 33: the resolver every attempt connects through keeps none of the reserved
    /// ranges, nor an IPv6 form of a private IPv4 address (a name resolving to one is
    /// refused as a literal is).
    #[tokio::test]
    async fn the_resolver_keeps_no_reserved_address_nor_an_ipv6_form_of_a_private_one() {
        use reqwest::dns::Resolve;
        let checked = CheckedResolver {
            allow_private: false,
        };
        for host in [
            "100.64.0.1",
            "192.0.0.8",
            "198.18.0.1",
            "198.19.0.1",
            "240.0.0.1",
            "255.255.255.255",
            "fec0::1",
            "64:ff9b::a00:1",
            "64:ff9b::7f00:1",
            "2002:a00:1::1",
            "2002:7f00:1::",
            "::10.0.0.1",
            "::127.0.0.1",
        ] {
            let name: reqwest::dns::Name = host.parse().unwrap();
            assert!(checked.resolve(name).await.is_err(), "{host} is kept");
        }
        for host in ["93.184.216.34", "64:ff9b::5db8:d822", "2002:5db8:d822::1"] {
            let name: reqwest::dns::Name = host.parse().unwrap();
            assert!(checked.resolve(name).await.is_ok(), "{host} is dropped");
        }
        let open = CheckedResolver {
            allow_private: true,
        };
        assert!(open.resolve("192.0.0.8".parse().unwrap()).await.is_ok());
    }

    /// A URL whose host is an address is refused before sending unless the address is
    /// public (or private ones are allowed); a name is left to the resolver.
    #[test]
    fn a_url_naming_a_private_address_is_refused_before_sending_a_public_one_is_not() {
        let url = |raw: &str| WebhookUrl::parse(raw).unwrap();
        for (raw, refused) in [
            ("http://127.0.0.1:8080/h", Some("127.0.0.1")),
            ("http://10.1.2.3/h", Some("10.1.2.3")),
            ("http://[::1]:9000/h", Some("::1")),
            ("http://[fd00::1]/h", Some("fd00::1")),
            ("https://93.184.216.34/h", None),
            ("https://[2606:2800:220:1:248:1893:25c8:1946]/h", None),
            ("https://example.com/h", None),
            ("http://localhost/h", None),
        ] {
            let expected = refused.map(|ip| ip.parse::<IpAddr>().unwrap());
            assert_eq!(refused_literal(&url(raw), false), expected, "{raw}");
            assert_eq!(
                refused_literal(&url(raw), true),
                None,
                "{raw}, private allowed"
            );
        }
    }
}
