//! Webhooks (`docs/webhooks.md`): registering endpoints, reading their deliveries,
//! retrying a failed one; and the rule on where a delivery may connect, which the
//! `deliverer` applies again at each attempt.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use super::{ServiceError, ServiceResult, WebhookBook};
use crate::domain::{
    Delivery, DeliveryState, EventType, MAX_ROTATION_OVERLAP, Scope, Timestamp, Webhook,
    WebhookSecret, WebhookUrl, is_public_address,
};
use crate::store::Store;

pub use crate::domain::WebhookSettings;

/// Why a URL is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlRefusal {
    #[error("{0} does not resolve")]
    Unresolved(String),
    #[error("{host} resolves to {address}, which is not a public address")]
    NotPublic { host: String, address: IpAddr },
}

/// The addresses a delivery to `url` may connect to: every address its host resolves
/// to, all of which must be public unless `allow_private`. Refused if none, or if any is
/// not public (a name that resolves to one private address among public ones is refused
/// whole: which one a connection takes is not ours to choose).
pub async fn allowed_addresses(
    url: &WebhookUrl,
    allow_private: bool,
) -> Result<Vec<SocketAddr>, UrlRefusal> {
    let (host, port) = url.host_and_port();
    let found: Vec<SocketAddr> = match host.parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => tokio::net::lookup_host((host.as_str(), port))
            .await
            .map_err(|_| UrlRefusal::Unresolved(host.clone()))?
            .collect(),
    };
    if found.is_empty() {
        return Err(UrlRefusal::Unresolved(host));
    }
    if !allow_private {
        if let Some(bad) = found.iter().find(|a| !is_public_address(a.ip())) {
            return Err(UrlRefusal::NotPublic {
                host,
                address: bad.ip(),
            });
        }
    }
    Ok(found)
}

/// What a registration asks for.
pub struct NewWebhook {
    pub url: WebhookUrl,
    pub types: Vec<EventType>,
    pub description: Option<String>,
    /// Who registers it (`docs/tenants.md`): a tenant's webhook is sent its tenant's
    /// events only, and counts against its tenant's `MAX_WEBHOOKS` (and, as every
    /// webhook, against `MAX_WEBHOOKS_TOTAL`).
    pub scope: Scope,
}

impl WebhookBook {
    /// Webhooks are configured with `settings` (`WEBHOOK_*`).
    pub fn with_webhook_settings(self, settings: WebhookSettings) -> WebhookBook {
        WebhookBook {
            webhook_settings: settings,
            ..self
        }
    }

    pub fn webhook_settings(&self) -> WebhookSettings {
        self.webhook_settings
    }

    /// Where webhooks and deliveries live: the first deployment (the deliverer's store).
    pub fn store(&self) -> &Store {
        self.deployments.first()
    }

    /// [`WebhookBook::store`], while it is known to answer.
    fn webhook_home(&self) -> ServiceResult<&Store> {
        let store = self.deployments.first();
        store.check_answering()?;
        Ok(store)
    }

    /// Registers an endpoint, after checking where it resolves, unless as many are
    /// registered as `MAX_WEBHOOKS` allows its scope, or `MAX_WEBHOOKS_TOTAL` all
    /// together (decided in the write itself:
    /// [`crate::store::Webhooks::insert_webhook_capped`]); it is sent the events recorded from now on. Its
    /// secret is in the answer, and only there.
    pub async fn register_webhook(&self, new: NewWebhook) -> ServiceResult<Webhook> {
        allowed_addresses(&new.url, self.webhook_settings.allow_private)
            .await
            .map_err(ServiceError::WebhookUrlNotAllowed)?;
        let store = self.webhook_home()?;
        // Each deployment's position first, then the write: an event a deployment
        // records after the answer is after its position, whatever its clock.
        let mut registered_at = std::collections::BTreeMap::new();
        for deployment in self.deployments.all() {
            deployment.check_answering()?;
            if let Some(at) = deployment.events().cluster_time().await? {
                registered_at.insert(deployment.deployment().clone(), (at.time, at.increment));
            }
        }
        let webhook = Webhook {
            id: format!("wh_{}", mongodb_free_id()),
            url: new.url,
            types: new.types,
            description: new.description,
            tenant: new.scope.tenant().cloned(),
            secret: WebhookSecret::random(),
            previous: None,
            created_at: store.server_time_lower_bound().await?,
            registered_at,
        };
        let (cap, total) = (
            self.webhook_settings.max_webhooks,
            self.webhook_settings.max_webhooks_total,
        );
        store
            .webhooks()
            .insert_webhook_capped(&webhook, cap, total)
            .await?
            .map_err(ServiceError::TooManyWebhooks)?;
        tracing::info!(webhook = %webhook.id, url = %webhook.url.as_str(), "webhook registered");
        Ok(webhook)
    }

    /// A page of the webhooks `scope` sees (a tenant's own), oldest first: at most `limit`
    /// after `after` (the creation time and id of the last of the previous page), a
    /// previous secret whose overlap ended left out.
    pub async fn webhooks(
        &self,
        scope: &Scope,
        after: Option<(Timestamp, &str)>,
        limit: u32,
    ) -> ServiceResult<Vec<Webhook>> {
        let store = self.webhook_home()?;
        let found = store
            .webhooks()
            .webhooks_page(scope.tenant(), after, i64::from(limit))
            .await?;
        let now = store.server_time_lower_bound().await?;
        Ok(found.into_iter().map(|w| current(w, now)).collect())
    }

    /// Webhook `id`, if `scope` sees it (a tenant, its own: another's is not found), a
    /// previous secret whose overlap ended left out.
    pub async fn webhook(&self, scope: &Scope, id: &str) -> ServiceResult<Webhook> {
        let store = self.webhook_home()?;
        let found = store
            .webhooks()
            .webhook(id)
            .await?
            .filter(|w| scope.sees_account(w.tenant.as_ref()))
            .ok_or_else(|| ServiceError::WebhookNotFound(id.to_owned()))?;
        Ok(current(found, store.server_time_lower_bound().await?))
    }

    /// Gives webhook `id` a new secret, returned here and never again; deliveries carry
    /// the signatures of both the new and the replaced secret for `overlap` (at most
    /// [`MAX_ROTATION_OVERLAP`]; none when zero), by the database's clock.
    pub async fn rotate_webhook_secret(
        &self,
        scope: &Scope,
        id: &str,
        overlap: Duration,
    ) -> ServiceResult<Webhook> {
        // A webhook's tenant never changes: seen now, it is the same one rotated.
        self.webhook(scope, id).await?;
        let store = self.webhook_home()?;
        let secret = WebhookSecret::random();
        let rotated = store
            .webhooks()
            .rotate_webhook_secret(id, &secret, overlap.min(MAX_ROTATION_OVERLAP))
            .await?
            .ok_or_else(|| ServiceError::WebhookNotFound(id.to_owned()))?;
        tracing::info!(webhook = %id, overlap_s = overlap.as_secs(), "webhook secret rotated");
        Ok(current(rotated, store.server_time_lower_bound().await?))
    }

    /// Deletes an endpoint (one `scope` sees) and its deliveries; nothing more is sent
    /// to it.
    pub async fn delete_webhook(&self, scope: &Scope, id: &str) -> ServiceResult<()> {
        self.webhook(scope, id).await?;
        if !self.webhook_home()?.webhooks().delete_webhook(id).await? {
            return Err(ServiceError::WebhookNotFound(id.to_owned()));
        }
        tracing::info!(webhook = %id, "webhook deleted");
        Ok(())
    }

    /// The deliveries of webhook `id` in `state` (all when `None`), newest first.
    pub async fn deliveries(
        &self,
        scope: &Scope,
        id: &str,
        state: Option<DeliveryState>,
        before: Option<(Timestamp, &str)>,
        limit: u32,
    ) -> ServiceResult<Vec<Delivery>> {
        self.webhook(scope, id).await?;
        Ok(self
            .webhook_home()?
            .webhooks()
            .deliveries_of(id, state, before, i64::from(limit))
            .await?)
    }

    /// Delivers failed delivery `delivery` of webhook `id` again: pending, due now,
    /// tried for `WEBHOOK_GIVE_UP_AFTER_MS` more.
    pub async fn retry_delivery(
        &self,
        scope: &Scope,
        id: &str,
        delivery: &str,
    ) -> ServiceResult<Delivery> {
        self.webhook(scope, id).await?;
        let store = self.webhook_home()?;
        let give_up_at = store.server_time_lower_bound().await?
            + chrono::TimeDelta::from_std(self.webhook_settings.give_up_after)
                .unwrap_or(chrono::TimeDelta::MAX);
        let retried = store
            .webhooks()
            .retry_delivery(id, delivery, give_up_at)
            .await?;
        let found = store
            .webhooks()
            .delivery(id, delivery)
            .await?
            .ok_or_else(|| ServiceError::DeliveryNotFound(delivery.to_owned()))?;
        if !retried {
            return Err(ServiceError::DeliveryNotFailed(found.state));
        }
        Ok(found)
    }
}

/// `w` as it signs at `now`: its previous secret only while its overlap lasts.
fn current(mut w: Webhook, now: crate::domain::Timestamp) -> Webhook {
    if w.previous_until(now).is_none() {
        w.previous = None;
    }
    w
}

/// 24 hexadecimal digits, random.
fn mongodb_free_id() -> String {
    hex::encode(rand::random::<[u8; 12]>())
}
