//! The ledger of an account (`docs/ledger.md`): its entries, numbered from 1, and its
//! amounts as of any moment, read from the deployment that keeps the account.

use super::{ServiceError, ServiceResult, TransferService};
use crate::domain::{AccountId, BalanceAt, Entry, Timestamp};
use crate::store::Store;

impl TransferService {
    /// The entries of `account` numbered after `after`, oldest first, at most `limit`.
    pub async fn entries(
        &self,
        account: &AccountId,
        after: u64,
        limit: u32,
    ) -> ServiceResult<Vec<Entry>> {
        self.home_of(account)
            .await?
            .entries(account, after, limit)
            .await?
            .ok_or_else(|| ServiceError::AccountNotFound(account.to_string()))
    }

    /// `account`'s amounts as of `at` (after its last entry not later than `at`), or as
    /// they are now (after its last entry) when `at` is not given; `at` is then the
    /// database's time.
    pub async fn balance_at(
        &self,
        account: &AccountId,
        at: Option<Timestamp>,
    ) -> ServiceResult<BalanceAt> {
        let store = self.home_of(account).await?;
        let found = match at {
            Some(at) => store.balance_at(account, at).await?,
            None => {
                let now = store.server_time_lower_bound().await?;
                store.current_balance(account, now).await?
            }
        };
        found.ok_or_else(|| ServiceError::AccountNotFound(account.to_string()))
    }

    /// The store of the deployment that keeps `account`: where this process remembers it,
    /// or found by asking the deployments.
    async fn home_of(&self, account: &AccountId) -> ServiceResult<&Store> {
        let deployment = match self.placements.get(account) {
            Some(place) => place.deployment,
            None => {
                self.deployments
                    .find_account(account)
                    .await?
                    .ok_or_else(|| ServiceError::AccountNotFound(account.to_string()))?
                    .deployment
            }
        };
        let store = self.deployments.of(&deployment)?;
        store.check_answering()?;
        Ok(store)
    }
}
