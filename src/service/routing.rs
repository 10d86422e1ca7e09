//! Routing: which deployment's store a transfer's writes go to. A transfer is logged on
//! its source's deployment (`docs/scaling.md`), and each account step goes to the
//! deployment that keeps that account.

use super::TransferService;
use crate::domain::Side;
use crate::domain::{AccountId, Transfer};
use crate::store::{Store, StoreResult};

impl TransferService {
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

    /// The deployments of `transfer`'s accounts, each with the accounts it keeps, for a
    /// write on both accounts: one entry with both where one deployment keeps both (one
    /// write serves them), else one per deployment, its one account named twice.
    pub(crate) fn by_deployment<'t>(
        &self,
        transfer: &'t Transfer,
    ) -> StoreResult<Vec<(&Store, [&'t AccountId; 2])>> {
        let (source, destination) = (
            self.store_of(transfer, Side::Source)?,
            self.store_of(transfer, Side::Destination)?,
        );
        let (a, b) = (&transfer.source, &transfer.destination);
        Ok(if source.deployment() == destination.deployment() {
            vec![(source, [a, b])]
        } else {
            vec![(source, [a, a]), (destination, [b, b])]
        })
    }

    /// Every account of `transfer` (its parties, for a multi-leg transfer), grouped by
    /// the deployment that keeps them.
    pub(crate) fn accounts_by_deployment<'t>(
        &self,
        transfer: &'t Transfer,
    ) -> StoreResult<Vec<(&Store, Vec<&'t AccountId>)>> {
        let Some(legs) = transfer.legs.as_deref() else {
            return Ok(self
                .by_deployment(transfer)?
                .into_iter()
                .map(|(store, accounts)| (store, accounts.to_vec()))
                .collect());
        };
        let mut grouped: Vec<(&Store, Vec<&AccountId>)> = Vec::new();
        for party in legs.parties() {
            let store = self.deployments.of(&party.deployment)?;
            match grouped
                .iter_mut()
                .find(|(s, _)| s.deployment() == store.deployment())
            {
                Some((_, accounts)) => accounts.push(&party.account),
                None => grouped.push((store, vec![&party.account])),
            }
        }
        Ok(grouped)
    }
}
