//! Several MongoDB deployments (`DEPLOYMENTS`), each a [`Store`] of its own, and the
//! reads that span them.
//!
//! Where things live, and why (see `docs/scaling.md`):
//! - an account lives on one deployment, chosen when it is opened, for ever;
//! - a transfer is logged on its **source** account's deployment, with its idempotency
//!   key: a transfer touches at most two deployments, and its log is on one of them, so
//!   an outage of a third never stops it;
//! - the **account directory** (`accountDirectory`, on the first deployment listed) holds
//!   every account id with its deployment: the one write that makes an id unique across
//!   deployments, even when two instances open it on two deployments at once. Only
//!   opening an account needs it; transfers never read it.
//!
//! Reads that do not know where to look ask every deployment at once and take the first
//! answer that finds something ([`Deployments::first_found`]): ids are unique across
//! deployments, so the first find is the only one. A read that finds nothing is only
//! trusted when every deployment answered; otherwise the thing may be on the one that did
//! not, and the read fails as unavailable. Listings merge every deployment's page, and
//! fail as unavailable while one does not answer: a page with a hole would hand the
//! client a cursor past transfers it never saw.
//!
//! The account directory is the [`Directory`] view (`store.directory()`), asked only of
//! the first deployment's store.

use std::cmp::Reverse;
use std::sync::Arc;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use mongodb::Collection;
use mongodb::bson::{DateTime, Document, doc};
use tokio_util::sync::CancellationToken;

use super::fields::account_directory;
use super::{Store, StoreError, StoreResult};
use crate::domain::{
    Account, AccountId, DeploymentName, Placement, TenantName, Transfer, TransferFilter, TransferId,
};

/// The longest a watch ping may take before its deployment counts as not answering.
pub const WATCH_PING_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The deployments, in the order `DEPLOYMENTS` lists them; never empty, names unique.
#[derive(Clone, Debug)]
pub struct Deployments {
    stores: Arc<[Store]>,
}

impl From<Store> for Deployments {
    fn from(store: Store) -> Deployments {
        Deployments {
            stores: Arc::from(vec![store]),
        }
    }
}

/// What [`Deployments::reserve_account_id`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reservation {
    /// The id is now, or already was, reserved for the asked deployment: the account may
    /// be written there (its own `_id` decides whether it exists already).
    Reserved,
    /// The id belongs to an account on another deployment (or to one opened before the
    /// directory, which counts the same).
    Taken,
}

impl Deployments {
    /// # Panics
    /// With no store, or two of one name: `config` refuses both.
    pub fn new(stores: Vec<Store>) -> Deployments {
        assert!(!stores.is_empty(), "at least one deployment");
        for (i, s) in stores.iter().enumerate() {
            assert!(
                stores[..i].iter().all(|o| o.deployment() != s.deployment()),
                "deployment {} named twice",
                s.deployment()
            );
        }
        Deployments {
            stores: Arc::from(stores),
        }
    }

    /// Every handle writing for `instance` (see [`Store::named`]).
    pub fn named(&self, instance: &str) -> Deployments {
        Deployments {
            stores: self.stores.iter().map(|s| s.named(instance)).collect(),
        }
    }

    /// The first deployment listed: where accounts are opened unless the request says
    /// otherwise, and the keeper of the account directory.
    pub fn first(&self) -> &Store {
        &self.stores[0]
    }

    pub fn all(&self) -> &[Store] {
        &self.stores
    }

    pub fn get(&self, name: &DeploymentName) -> Option<&Store> {
        self.stores.iter().find(|s| s.deployment() == name)
    }

    /// The store of a deployment that a stored account or transfer names, to write to
    /// it: unavailable at once while it is known not to answer (see [`Deployments::watch`]).
    /// A name no longer configured is a misconfiguration (deployments keep their names):
    /// an error for the log, 500 for the caller, and nothing is moved.
    pub fn of(&self, name: &DeploymentName) -> StoreResult<&Store> {
        let store = self.get(name).ok_or_else(|| {
            StoreError::Misconfigured(
                format!("deployment {name} is named in the data but not in DEPLOYMENTS").into(),
            )
        })?;
        store.check_answering()?;
        Ok(store)
    }

    /// Pings every deployment every `every` until `shutdown`, and marks each answering or
    /// not (a ping that fails or takes longer than [`WATCH_PING_LIMIT`]): while one is not,
    /// what would touch it is refused at once (see [`Deployments::of`]), so that requests
    /// waiting on its time-outs cannot take every admission permit and stop the transfers
    /// between the others. With one deployment nothing is watched: there is nothing else
    /// to keep going, and the database's own answer says the same a little later.
    pub async fn watch(&self, every: std::time::Duration, shutdown: CancellationToken) {
        if self.stores.len() < 2 {
            return;
        }
        loop {
            let pings = self.stores.iter().map(|s| async move {
                let answered = tokio::time::timeout(WATCH_PING_LIMIT, s.ping()).await;
                let answering = matches!(answered, Ok(Ok(())));
                let was = s.set_answering(answering);
                if was != answering {
                    if answering {
                        tracing::info!(deployment = %s.deployment(), "deployment answers again");
                    } else {
                        tracing::warn!(deployment = %s.deployment(), "deployment does not answer; refusing what touches it");
                    }
                }
            });
            futures::future::join_all(pings).await;
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
        }
    }

    /// The deployments known not to answer now, or not migrated yet: what touches them
    /// is refused (see [`Deployments::of`]).
    pub fn silent(&self) -> Vec<DeploymentName> {
        self.stores
            .iter()
            .filter(|s| !s.is_answering())
            .map(|s| s.deployment().clone())
            .collect()
    }

    /// Unavailable at once while a deployment is known not to answer: a listing needs
    /// them all.
    fn check_all_answering(&self) -> StoreResult<()> {
        self.stores.iter().try_for_each(Store::check_answering)
    }

    /// The deployments a read that does not know where to look asks (those answering),
    /// and the error it ends with if it finds nothing there: what it looks for may be on
    /// a deployment that does not answer.
    fn to_ask(&self) -> (Vec<&Store>, Option<StoreError>) {
        let (answering, silent): (Vec<&Store>, Vec<&Store>) =
            self.stores.iter().partition(|s| s.is_answering());
        let failure = silent.first().and_then(|s| s.check_answering().err());
        (answering, failure)
    }

    /// Asks every deployment with `query` at once; the first `Some` wins. `None` only
    /// when every deployment answered `None`; otherwise the error of one that failed.
    pub async fn first_found<'a, T, F, Fut>(&'a self, query: F) -> StoreResult<Option<T>>
    where
        F: Fn(&'a Store) -> Fut,
        Fut: std::future::Future<Output = StoreResult<Option<T>>>,
    {
        if let [only] = &self.stores[..] {
            return query(only).await;
        }
        let (answering, mut failure) = self.to_ask();
        let mut asked: FuturesUnordered<_> = answering.into_iter().map(query).collect();
        while let Some(answer) = asked.next().await {
            match answer {
                Ok(Some(found)) => return Ok(Some(found)),
                Ok(None) => {}
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        failure.map_or(Ok(None), Err)
    }

    /// An account, wherever it lives.
    pub async fn find_account(&self, id: &AccountId) -> StoreResult<Option<Account>> {
        self.first_found(|s| s.accounts().account(id)).await
    }

    /// A transfer, wherever it is logged.
    pub async fn find_transfer(&self, id: TransferId) -> StoreResult<Option<Transfer>> {
        self.first_found(|s| s.transfers().transfer(id)).await
    }

    /// The deployment, currency and tenant of two accounts (`None` for one that exists
    /// nowhere), read together with those of concurrent transfers on each deployment.
    /// Answers as soon as both are found, without waiting for a deployment that is down.
    pub async fn locate(&self, accounts: [&AccountId; 2]) -> StoreResult<[Option<Placement>; 2]> {
        let (answering, mut failure) = self.to_ask();
        let mut asked: FuturesUnordered<_> = answering
            .into_iter()
            .map(|s| s.accounts().placements(accounts))
            .collect();
        let mut found: [Option<Placement>; 2] = [None, None];
        while let Some(answer) = asked.next().await {
            match answer {
                Ok(places) => {
                    for (slot, place) in found.iter_mut().zip(places) {
                        if slot.is_none() {
                            *slot = place;
                        }
                    }
                    if found.iter().all(Option::is_some) {
                        return Ok(found);
                    }
                }
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(found),
        }
    }

    /// Accounts in id order after `after`, from every deployment; only `tenant`'s when
    /// given.
    pub async fn list_accounts(
        &self,
        tenant: Option<&TenantName>,
        after: Option<&AccountId>,
        limit: u32,
    ) -> StoreResult<Vec<Account>> {
        self.check_all_answering()?;
        let pages = futures::future::try_join_all(
            self.stores
                .iter()
                .map(|s| s.accounts().list_accounts(tenant, after, limit)),
        )
        .await?;
        Ok(merged(pages, limit, |a| a.id.clone()))
    }

    /// Transfers newest first matching `filter`, from every deployment's log.
    pub async fn list_transfers(
        &self,
        filter: &TransferFilter,
        limit: u32,
    ) -> StoreResult<Vec<Transfer>> {
        self.check_all_answering()?;
        let pages = futures::future::try_join_all(
            self.stores
                .iter()
                .map(|s| s.transfers().list_transfers(filter, limit)),
        )
        .await?;
        Ok(merged(pages, limit, |t| Reverse(t.id)))
    }

    /// Reserves account id `id` for `deployment` in the directory, or reports whom it
    /// belongs to. The directory's unique `_id` makes exactly one of two concurrent
    /// reservations of one id win, whichever deployments they are for.
    ///
    /// A reservation whose account was never written (its instance died in between, or
    /// its deployment was down) keeps the id for that deployment: opening the account
    /// there again completes it.
    pub async fn reserve_account_id(
        &self,
        id: &AccountId,
        deployment: &DeploymentName,
    ) -> StoreResult<Reservation> {
        self.first().check_answering()?;
        self.first().directory().reserve_id(id, deployment).await
    }
}

/// The account directory, `accountDirectory` (from [`Store::directory`]): every
/// account id and the deployment it was reserved for. Only the first deployment's is
/// used (see [`Deployments::reserve_account_id`]).
#[derive(Clone, Copy, Debug)]
pub struct Directory<'s> {
    pub(super) directory: &'s Collection<Document>,
}

impl Directory<'_> {
    /// Reserves `id` for `deployment` (see [`Deployments::reserve_account_id`]): the
    /// one write a reservation makes, then the read that says who won.
    pub async fn reserve_id(
        self,
        id: &AccountId,
        deployment: &DeploymentName,
    ) -> StoreResult<Reservation> {
        let directory = self.directory;
        let entry = doc! { "_id": id.as_str(), account_directory::DEPLOYMENT: deployment.as_str(), account_directory::AT: DateTime::now() };
        match directory.insert_one(entry).await {
            Ok(_) => return Ok(Reservation::Reserved),
            Err(e) => match StoreError::from(e) {
                StoreError::DuplicateKey(_) => {}
                other => return Err(other),
            },
        }
        let found = directory
            .find_one(doc! { "_id": id.as_str() })
            .max_time(super::READ_TIME_LIMIT)
            .await?;
        let owner = found
            .as_ref()
            .and_then(|d| d.get_str(account_directory::DEPLOYMENT).ok());
        Ok(if owner == Some(deployment.as_str()) {
            Reservation::Reserved
        } else {
            Reservation::Taken
        })
    }
}

/// The first `limit` of every deployment's page in `key` order. Each page holds its
/// deployment's first `limit` in that order, so the merge holds the overall first `limit`.
fn merged<T, K: Ord>(pages: Vec<Vec<T>>, limit: u32, key: impl Fn(&T) -> K) -> Vec<T> {
    let mut all: Vec<T> = pages.into_iter().flatten().collect();
    all.sort_by_key(key);
    all.truncate(limit as usize);
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_merge_keeps_the_first_of_all_pages_in_order() {
        let pages = vec![vec![1, 4, 9], vec![2, 3, 10], vec![]];
        assert_eq!(merged(pages, 4, |n| *n), vec![1, 2, 3, 4]);
        let newest_first = vec![vec![9, 4, 1], vec![10, 3, 2]];
        assert_eq!(merged(newest_first, 3, |n| Reverse(*n)), vec![10, 9, 4]);
    }
}
