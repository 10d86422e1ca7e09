//! Routing: which deployment's store a transfer's writes go to. A transfer is logged on
//! its source's deployment (`docs/scaling.md`), and each account step goes to the
//! deployment that keeps that account.

use super::Driver;
use crate::domain::Side;
use crate::domain::{AccountId, Transfer};
use crate::store::{Store, StoreResult};

impl Driver {
    /// The store of the deployment that logs `transfer` (its transfer log): its source's.
    pub(crate) fn log_store(&self, transfer: &Transfer) -> StoreResult<&Store> {
        self.deployments.of(&transfer.source_deployment)
    }

    /// The store of the deployment that keeps `transfer`'s account on `side`.
    pub(crate) fn store_of(&self, transfer: &Transfer, side: Side) -> StoreResult<&Store> {
        self.deployments.of(match side {
            Side::Source => &transfer.source_deployment,
            Side::Destination => &transfer.destination_deployment,
        })
    }

    /// Every account of `transfer` (its parties), grouped by the deployment that keeps
    /// them.
    pub(crate) fn accounts_by_deployment(
        &self,
        transfer: &Transfer,
    ) -> StoreResult<Vec<(&Store, Vec<AccountId>)>> {
        let mut grouped: Vec<(&Store, Vec<AccountId>)> = Vec::new();
        for party in transfer.parties().iter() {
            let store = self.deployments.of(&party.deployment)?;
            match grouped
                .iter_mut()
                .find(|(s, _)| s.deployment() == store.deployment())
            {
                Some((_, accounts)) => accounts.push(party.account.clone()),
                None => grouped.push((store, vec![party.account.clone()])),
            }
        }
        Ok(grouped)
    }
}
