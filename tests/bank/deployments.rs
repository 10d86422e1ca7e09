//! The deployments of a run: where each account lives ([`Layout`]), and the test's own
//! direct connections to each deployment's database ([`Books`]), to read back what is
//! stored (the nemesis to find a killed instance's transfers, the checker everything).

use futures::TryStreamExt;
use mongodb::bson::{Document, doc};
use transfer_service::domain::{Account, DeploymentName, Transfer, TransferId};
use transfer_service::store::Store;

/// Where the accounts live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `MONGODB_URI` alone: every account on the one deployment, `default`.
    OneDeployment,
    /// `DEPLOYMENTS=eu=...,us=...,cn=...`, account `i` on the `i % 3`th: each hot account
    /// on a deployment of its own, four accounts on each.
    ThreeDeployments,
}

impl Layout {
    /// The deployments' names, in the order `DEPLOYMENTS` lists them.
    pub fn deployments(self) -> &'static [&'static str] {
        match self {
            Layout::OneDeployment => &["default"],
            Layout::ThreeDeployments => &["eu", "us", "cn"],
        }
    }

    /// The deployment (its index) that keeps account `i`.
    pub fn home(self, i: usize) -> usize {
        i % self.deployments().len()
    }

    /// The deployment that keeps the account of id `id` (`acct-NN`).
    pub fn home_of(self, id: &str) -> &'static str {
        let i: usize = id
            .strip_prefix("acct-")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{id} is not an account of the bank test"));
        self.deployments()[self.home(i)]
    }

    /// `DEPLOYMENTS` for `uris`, one per deployment; `None` with one deployment (then
    /// `MONGODB_URI` names it).
    pub fn deployments_variable(self, uris: &[String]) -> Option<String> {
        (self != Layout::OneDeployment).then(|| {
            self.deployments()
                .iter()
                .zip(uris)
                .map(|(name, uri)| format!("{name}={uri}"))
                .collect::<Vec<_>>()
                .join(",")
        })
    }
}

/// The test's own connections (direct, not proxied) to its database on every deployment,
/// in the layout's order, to read what is stored.
#[derive(Clone)]
pub struct Books {
    pub stores: Vec<Store>,
}

/// An idempotency key taken on a deployment (`idempotencyKeys`), for transfer `transfer`.
pub struct KeyRecord {
    pub deployment: String,
    pub key: String,
    pub transfer: Option<TransferId>,
}

impl Books {
    pub async fn connect(layout: Layout, uris: &[String], database: &str) -> Books {
        let mut stores = Vec::new();
        for (name, uri) in layout.deployments().iter().zip(uris) {
            let name = DeploymentName::parse(name).unwrap();
            stores.push(Store::connect_with(name, uri, database, 2).await.unwrap());
        }
        Books { stores }
    }

    /// Everything stored: every log's transfers (each read from its log, so its
    /// `source_deployment` names the log it is on) and every deployment's accounts.
    pub async fn snapshot(&self) -> (Vec<Transfer>, Vec<Account>) {
        let (mut transfers, mut accounts) = (Vec::new(), Vec::new());
        for store in &self.stores {
            transfers.extend(
                store
                    .transfers()
                    .list_transfers(&Default::default(), 1_000_000)
                    .await
                    .unwrap(),
            );
            accounts.extend(
                store
                    .accounts()
                    .list_accounts(None, None, 1000)
                    .await
                    .unwrap(),
            );
        }
        (transfers, accounts)
    }

    /// The transfer documents of every log matching `filter`; a deployment that does not
    /// answer (restarting) gives none.
    pub async fn find_in_logs(&self, filter: Document) -> Vec<Document> {
        let mut found = Vec::new();
        for store in &self.stores {
            let cursor = store
                .database()
                .collection::<Document>("transactions")
                .find(filter.clone())
                .await;
            if let Ok(cursor) = cursor {
                found.extend(cursor.try_collect::<Vec<_>>().await.unwrap_or_default());
            }
        }
        found
    }

    /// Every idempotency key taken, on every deployment.
    pub async fn key_records(&self) -> Vec<KeyRecord> {
        let mut records = Vec::new();
        for store in &self.stores {
            let found: Vec<Document> = store
                .database()
                .collection::<Document>("idempotencyKeys")
                .find(doc! {})
                .await
                .unwrap()
                .try_collect()
                .await
                .unwrap();
            records.extend(found.into_iter().map(|d| {
                KeyRecord {
                    deployment: store.deployment().to_string(),
                    key: d.get_str("_id").unwrap_or_default().to_owned(),
                    transfer: d
                        .get_object_id("transfer")
                        .ok()
                        .and_then(|id| TransferId::parse(&id.to_hex()).ok()),
                }
            }));
        }
        records
    }
}
