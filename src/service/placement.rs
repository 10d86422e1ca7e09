//! Placement: where each account lives (its deployment) and its currency, as a new
//! transfer needs them to be validated and routed, found once and then remembered by the
//! process (see the `known` field of [`Bank`]).

use super::{Bank, NewTransfer, ServiceError, ServiceResult};
use crate::domain::{AccountId, Currency, DeploymentName};

/// Where an account lives, and its currency.
pub(super) type Placed = (DeploymentName, Currency);

/// Where a new transfer goes: the deployments of its accounts, and its currency.
#[derive(Debug, Clone)]
pub(super) struct Route {
    pub(super) source: DeploymentName,
    pub(super) destination: DeploymentName,
    pub(super) currency: Currency,
}

/// Accounts whose place [`Bank`] remembers, at most; the memory is simply emptied when
/// full.
const KNOWN_ACCOUNTS_MAX: usize = 100_000;

impl Bank {
    /// Checks what the stored accounts must agree to; returns where the transfer goes.
    pub(super) async fn check_accounts(&self, new: &NewTransfer) -> ServiceResult<Route> {
        if new.source == new.destination {
            return Err(ServiceError::SameAccount);
        }
        let ((source, source_currency), (destination, destination_currency)) = match (
            self.known_place(&new.source),
            self.known_place(&new.destination),
        ) {
            (Some(s), Some(d)) => (s, d),
            _ => self.locate(new).await?,
        };
        if source_currency != destination_currency {
            return Err(ServiceError::CurrencyMismatch {
                source_currency: source_currency.to_string(),
                destination_currency: destination_currency.to_string(),
            });
        }
        Ok(Route {
            source,
            destination,
            currency: source_currency,
        })
    }

    /// Where an account lives and its currency, if this process has seen it.
    pub(super) fn known_place(&self, id: &AccountId) -> Option<Placed> {
        let known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        known.get(id).cloned()
    }

    /// Finds both accounts (with concurrent transfers' accounts, in one round trip per
    /// deployment) and remembers where they are.
    async fn locate(&self, new: &NewTransfer) -> ServiceResult<(Placed, Placed)> {
        let [source, destination] = self
            .deployments
            .locate([&new.source, &new.destination])
            .await?;
        let source = source.ok_or_else(|| ServiceError::AccountNotFound(new.source.to_string()))?;
        let destination = destination
            .ok_or_else(|| ServiceError::AccountNotFound(new.destination.to_string()))?;
        self.remember([
            (new.source.clone(), source.clone()),
            (new.destination.clone(), destination.clone()),
        ]);
        Ok((source, destination))
    }

    /// Remembers where two accounts live; at most [`KNOWN_ACCOUNTS_MAX`] are remembered.
    fn remember(&self, places: [(AccountId, Placed); 2]) {
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        if known.len() + places.len() > KNOWN_ACCOUNTS_MAX {
            known.clear();
        }
        known.extend(places);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::service::tests::offline_bank;

    /// The places of accounts are remembered up to [`KNOWN_ACCOUNTS_MAX`] and no
    /// further: the memory fills to the bound, and is emptied when it would pass it.
    #[tokio::test]
    async fn the_places_of_accounts_are_remembered_up_to_the_bound() {
        let bank = offline_bank(Duration::from_secs(1)).await;
        let place = |i: usize| {
            let id = AccountId::parse(&format!("a{i}")).unwrap();
            let at = (DeploymentName::parse("main").unwrap(), Currency::usd());
            (id, at)
        };
        let known = || bank.known.lock().unwrap().len();
        bank.known
            .lock()
            .unwrap()
            .extend((0..KNOWN_ACCOUNTS_MAX - 2).map(place));
        bank.remember([place(KNOWN_ACCOUNTS_MAX - 2), place(KNOWN_ACCOUNTS_MAX - 1)]);
        assert_eq!(known(), KNOWN_ACCOUNTS_MAX, "filled to the bound");
        bank.remember([place(KNOWN_ACCOUNTS_MAX), place(KNOWN_ACCOUNTS_MAX + 1)]);
        assert_eq!(known(), 2, "emptied rather than passing the bound");
    }
}
