//! API keys made through the API (`docs/tenants.md`): [`KeyBook`] makes them, lists them,
//! revokes them, and finds the one a request presents.
//!
//! A key's secret is 32 random bytes, shown once when it is made and stored only as its
//! SHA-256 (`store::api_keys`): a presented key is found by its digest. What was found
//! (or that nothing was) is remembered for at most [`REVALIDATE_AFTER`], so a revoked key
//! is refused by every instance within that time plus one read, and a key made on one
//! instance works on every other at once (a key not found is looked for again after
//! the same time).
//!
//! The keys of `API_KEYS` are the settings' (`http::auth`), not these. A presented token
//! that does not have the form of a made key is no key of the book, refused without a
//! read.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use quick_cache::sync::Cache;
use rand::RngCore;
use sha2::{Digest, Sha256};

use super::{ServiceError, ServiceResult};
use crate::domain::{ApiKeyId, KeyRecord, Role, TenantName};
use crate::error_chain::Chain;
use crate::store::ApiKeyStore;

/// How long what a lookup found is used before the key is read again: the most a
/// revocation takes to reach every instance, less one read.
pub const REVALIDATE_AFTER: Duration = Duration::from_secs(1);

/// How often, at most, one instance notes that a key was used.
const TOUCH_EVERY: Duration = Duration::from_secs(60);

/// Presented keys whose lookup this process remembers, at most: a flood of made-up keys
/// evicts one another, never grows the memory.
const REMEMBERED_MAX: usize = 10_000;

/// What every made key starts with, so that a leaked one is recognisable (secret
/// scanners, logs).
pub const KEY_PREFIX: &str = "tsk_";

/// A lookup of a presented key, and when it was made.
#[derive(Clone)]
struct Looked {
    at: Instant,
    found: Option<KeyRecord>,
}

/// The API keys kept in the first deployment, and the memory of recent lookups.
#[derive(Clone)]
pub struct KeyBook {
    store: ApiKeyStore,
    /// SHA-256 of a presented key → what its last lookup found. Shared by every clone.
    looked: Arc<Cache<[u8; 32], Looked>>,
    /// Revocations made by this instance so far: a lookup that read a key before a
    /// revocation here and finished after it is not remembered (it would let this
    /// instance take the revoked key for another [`REVALIDATE_AFTER`]).
    revocations: Arc<AtomicU64>,
    /// When this instance last noted each key's use, by its own monotonic clock.
    touched: Arc<Cache<ApiKeyId, Instant>>,
}

/// Whether `presented` has the form of a key [`KeyBook::make`] makes: anything else is
/// no key of the book, answered without a read (a flood of made-up tokens costs the
/// database nothing).
fn is_made_key(presented: &str) -> bool {
    presented.strip_prefix(KEY_PREFIX).is_some_and(|rest| {
        rest.len() == 43
            && rest
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    })
}

/// A key just made: its record and its secret, which nothing stores.
pub struct MadeKey {
    pub record: KeyRecord,
    pub secret: String,
}

impl KeyBook {
    pub fn new(store: ApiKeyStore) -> KeyBook {
        KeyBook {
            store,
            looked: Arc::new(Cache::new(REMEMBERED_MAX)),
            revocations: Arc::new(AtomicU64::new(0)),
            touched: Arc::new(Cache::new(REMEMBERED_MAX)),
        }
    }

    /// The stored key `presented` is, if any. A lookup younger than
    /// [`REVALIDATE_AFTER`] answers without a read.
    pub async fn authenticate(&self, presented: &str) -> ServiceResult<Option<KeyRecord>> {
        if !is_made_key(presented) {
            return Ok(None);
        }
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        if let Some(looked) = self.looked.get(&digest)
            && looked.at.elapsed() < REVALIDATE_AFTER
        {
            return Ok(looked.found);
        }
        let at = Instant::now();
        let revocations = self.revocations.load(Ordering::SeqCst);
        let found = self.store.by_digest(&digest).await?;
        if self.revocations.load(Ordering::SeqCst) == revocations {
            self.looked.insert(
                digest,
                Looked {
                    at,
                    found: found.clone(),
                },
            );
        }
        if let Some(key) = &found {
            self.note_use(key);
        }
        Ok(found)
    }

    /// Notes in the background that `key` was used, unless this instance noted it in
    /// the last minute (by its monotonic clock; the time written is the database's).
    fn note_use(&self, key: &KeyRecord) {
        if self
            .touched
            .get(&key.id)
            .is_some_and(|at| at.elapsed() < TOUCH_EVERY)
        {
            return;
        }
        self.touched.insert(key.id.clone(), Instant::now());
        let (store, id) = (self.store.clone(), key.id.clone());
        tokio::spawn(async move {
            if let Err(e) = store.touch(&id).await {
                tracing::debug!(api_key = %id, error = %Chain(&e), "last use not noted");
            }
        });
    }

    /// Makes a key of `role` for `tenant` (`None`: a platform key).
    pub async fn make(&self, tenant: Option<TenantName>, role: Role) -> ServiceResult<MadeKey> {
        let mut secret = [0u8; 32];
        let mut id = [0u8; ApiKeyId::LEN / 2];
        rand::rng().fill_bytes(&mut secret);
        rand::rng().fill_bytes(&mut id);
        let secret = format!("{KEY_PREFIX}{}", URL_SAFE_NO_PAD.encode(secret));
        let record = KeyRecord {
            id: ApiKeyId::parse(&hex::encode(id)).expect("16 bytes are 32 hexadecimal digits"),
            tenant,
            role,
            created_at: crate::domain::now(),
            last_used_at: None,
        };
        let digest: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
        self.store.insert(&record, &digest).await?;
        // A lookup of this secret before it existed (none could be made) is forgotten.
        self.looked.remove(&digest);
        tracing::info!(api_key = %record.id, tenant = ?record.tenant.as_ref().map(TenantName::as_str), role = record.role.as_str(), "api key made");
        Ok(MadeKey { record, secret })
    }

    /// Keys in id order after `after`; only `tenant`'s when given.
    pub async fn list(
        &self,
        tenant: Option<&TenantName>,
        after: Option<&ApiKeyId>,
        limit: u32,
    ) -> ServiceResult<Vec<KeyRecord>> {
        Ok(self.store.list(tenant, after, limit).await?)
    }

    /// Revokes key `id`, if it is `tenant`'s when given (another tenant's is not found).
    /// This instance refuses it at once; every other within [`REVALIDATE_AFTER`].
    pub async fn revoke(&self, id: &ApiKeyId, tenant: Option<&TenantName>) -> ServiceResult<()> {
        if !self.store.revoke(id, tenant).await? {
            return Err(ServiceError::ApiKeyNotFound(id.to_string()));
        }
        // Before the memory is cleared: a lookup still under way is then not remembered.
        self.revocations.fetch_add(1, Ordering::SeqCst);
        self.looked
            .retain(|_, looked| looked.found.as_ref().is_none_or(|k| k.id != *id));
        tracing::info!(api_key = %id, "api key revoked");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_token_of_the_made_form_is_looked_up() {
        let made = format!("{KEY_PREFIX}{}", URL_SAFE_NO_PAD.encode([7u8; 32]));
        assert!(is_made_key(&made));
        for other in [
            "",
            "tsk_",
            &made[..made.len() - 1],
            &format!("{made}x"),
            &made.replace("tsk_", "tsx_"),
            &format!("{KEY_PREFIX}{}", "+".repeat(43)),
            "rw-0123456789abcdef0123456789",
        ] {
            assert!(!is_made_key(other), "{other:?}");
        }
    }
}
