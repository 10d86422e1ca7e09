//! API keys made through the API (`docs/tenants.md`), kept in `apiKeys` on the first
//! deployment (one list for the whole service, like `accountDirectory`).
//!
//! A document per key: `_id` its public id, `sha256` the digest of its secret (the
//! secret itself is never stored), its `tenant` (absent: a platform key), its `role`,
//! `createdAt` and `lastUsedAt`. The unique index `sha256` finds a presented key in one
//! read. A revoked key is deleted: from then on no read finds it.
//!
//! [`ApiKeyStore`] holds this collection only: the keys share nothing with transfers.

use futures::TryStreamExt;
use mongodb::bson::{DateTime, Document, doc};
use mongodb::options::FindOptions;
use mongodb::{Collection, Database};
use serde::{Deserialize, Serialize};

use super::documents::stored_time;
use super::fields::api_key;
use super::{StoreError, StoreResult};
use crate::domain::{ApiKeyId, KeyRecord, ParseError, Role, TenantName};

const API_KEYS: &str = "apiKeys";

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ApiKeyDoc {
    #[serde(rename = "_id")]
    id: String,
    /// Lowercase hexadecimal SHA-256 of the secret.
    sha256: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tenant: Option<String>,
    role: String,
    created_at: DateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    last_used_at: Option<DateTime>,
}

impl ApiKeyDoc {
    fn into_domain(self) -> StoreResult<KeyRecord> {
        let bad = |field: &str, why: ParseError| {
            StoreError::Malformed(
                format!("api key {}: stored {field} is not valid: {why}", self.id).into(),
            )
        };
        Ok(KeyRecord {
            id: ApiKeyId::parse(&self.id).map_err(|e| bad("_id", e))?,
            tenant: self
                .tenant
                .as_deref()
                .map(TenantName::parse)
                .transpose()
                .map_err(|e| bad("tenant", e))?,
            role: Role::parse(&self.role).map_err(|e| bad("role", e))?,
            created_at: self.created_at.to_chrono(),
            last_used_at: self.last_used_at.map(DateTime::to_chrono),
        })
    }
}

/// The stored API keys of the service.
#[derive(Clone, Debug)]
pub struct ApiKeyStore {
    keys: Collection<ApiKeyDoc>,
}

impl ApiKeyStore {
    /// The keys kept in `db` (the first deployment's, with its majority concerns).
    pub fn new(db: &Database) -> ApiKeyStore {
        ApiKeyStore {
            keys: db.collection(API_KEYS),
        }
    }

    /// Stores a new key whose secret digests to `sha256`.
    pub async fn insert(&self, key: &KeyRecord, sha256: &[u8; 32]) -> StoreResult<()> {
        let stored = ApiKeyDoc {
            id: key.id.to_string(),
            sha256: hex::encode(sha256),
            tenant: key.tenant.as_ref().map(|t| t.to_string()),
            role: key.role.as_str().to_owned(),
            created_at: stored_time(key.created_at),
            last_used_at: None,
        };
        self.keys.insert_one(stored).await?;
        Ok(())
    }

    /// The key whose secret digests to `sha256`, if one is stored (not revoked).
    pub async fn by_digest(&self, sha256: &[u8; 32]) -> StoreResult<Option<KeyRecord>> {
        self.keys
            .find_one(doc! { "sha256": hex::encode(sha256) })
            .max_time(super::READ_TIME_LIMIT)
            .await?
            .map(ApiKeyDoc::into_domain)
            .transpose()
    }

    /// Keys in id order after `after`, at most `limit`; only `tenant`'s when given.
    pub async fn list(
        &self,
        tenant: Option<&TenantName>,
        after: Option<&ApiKeyId>,
        limit: u32,
    ) -> StoreResult<Vec<KeyRecord>> {
        let mut filter = Document::new();
        if let Some(tenant) = tenant {
            filter.insert(api_key::TENANT, tenant.as_str());
        }
        if let Some(after) = after {
            filter.insert("_id", doc! { "$gt": after.as_str() });
        }
        let options = FindOptions::builder()
            .sort(doc! { "_id": 1 })
            .limit(i64::from(limit))
            .build();
        let found: Vec<ApiKeyDoc> = self
            .keys
            .find(filter)
            .with_options(options)
            .max_time(super::READ_TIME_LIMIT)
            .await?
            .try_collect()
            .await?;
        found.into_iter().map(ApiKeyDoc::into_domain).collect()
    }

    /// Revokes key `id` (only if it is `tenant`'s, when given): true when this call
    /// removed it.
    pub async fn revoke(&self, id: &ApiKeyId, tenant: Option<&TenantName>) -> StoreResult<bool> {
        let mut filter = doc! { "_id": id.as_str() };
        if let Some(tenant) = tenant {
            filter.insert(api_key::TENANT, tenant.as_str());
        }
        Ok(self.keys.delete_one(filter).await?.deleted_count == 1)
    }

    /// Notes that key `id` was used now, by the database's clock.
    pub async fn touch(&self, id: &ApiKeyId) -> StoreResult<()> {
        self.keys
            .update_one(
                doc! { "_id": id.as_str() },
                vec![doc! { "$set": { api_key::LAST_USED_AT: "$$NOW" } }],
            )
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each field of `apiKeys` named in `store::fields` is the name serde writes, and
    /// each name serde writes is there.
    #[test]
    fn the_api_key_fields_are_the_names_serde_writes() {
        let stored = ApiKeyDoc {
            id: "key_1".into(),
            sha256: "00".into(),
            tenant: Some("acme".into()),
            role: "admin".into(),
            created_at: DateTime::now(),
            last_used_at: Some(DateTime::now()),
        };
        super::super::fields::assert_same_keys(api_key::ALL, &stored);
    }
}
