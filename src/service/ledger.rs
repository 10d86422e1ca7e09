//! The ledger of an account (`docs/ledger.md`): its entries, numbered from 1, and its
//! amounts as of any moment, read from the deployment that keeps the account.

use std::time::Duration;

use super::{AccountBook, ServiceError, ServiceResult};
use crate::domain::{AccountId, BalanceAt, Entry, Finality, Timestamp};
use crate::store::Store;

/// How far the deployment's clock must have passed a moment before a balance as of it is
/// answered final (`docs/ledger.md`). An entry is stamped with the clock of the member
/// that is primary when it lands, so the answer for a moment can change while an entry
/// stamped at or before it may still land: one in flight (its time taken, its write not
/// yet majority-committed: a write waits 5 s for the majority), or one stamped by a
/// member whose clock is behind, after a failover. A minute covers both as long as the
/// members' clocks agree within some 50 s, which NTP keeps to milliseconds.
pub const FINAL_AFTER: Duration = Duration::from_secs(60);

/// Whether the answer for moment `at` is final, with the deployment's clock at least
/// `now`.
fn finality(at: Timestamp, now: Timestamp) -> Finality {
    let margin = chrono::TimeDelta::from_std(FINAL_AFTER).unwrap_or(chrono::TimeDelta::MAX);
    match at.checked_add_signed(margin) {
        Some(final_from) if final_from <= now => Finality::Final,
        _ => Finality::Provisional,
    }
}

impl AccountBook {
    /// The entries of `account` numbered after `after`, oldest first, at most `limit`.
    pub async fn entries(
        &self,
        account: &AccountId,
        after: u64,
        limit: u32,
    ) -> ServiceResult<Vec<Entry>> {
        self.home_of(account)
            .await?
            .entries()
            .entries(account, after, limit)
            .await?
            .ok_or_else(|| ServiceError::AccountNotFound(account.to_string()))
    }

    /// `account`'s amounts as of `at` (after its last entry not later than `at`), or as
    /// they are now (after its last entry) when `at` is not given; `at` is then the
    /// database's time. [`Finality::Final`] once the deployment's clock has passed `at` by
    /// [`FINAL_AFTER`], judged by a lower bound of it read before the entries.
    pub async fn balance_at(
        &self,
        account: &AccountId,
        at: Option<Timestamp>,
    ) -> ServiceResult<BalanceAt> {
        let store = self.home_of(account).await?;
        let found = match at {
            Some(at) => {
                let now = store.server_time_lower_bound().await?;
                let finality = finality(at, now);
                store
                    .entries()
                    .balance_at(account, at)
                    .await?
                    .map(|b| BalanceAt { finality, ..b })
            }
            None => {
                let now = store.server_time_lower_bound().await?;
                store.entries().current_balance(account, now).await?
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_moment_is_final_once_the_clock_passed_it_by_the_margin() {
        let now = chrono::Utc::now();
        let margin = chrono::TimeDelta::from_std(FINAL_AFTER).unwrap();
        assert_eq!(finality(now - margin, now), Finality::Final);
        assert_eq!(
            finality(now - margin + chrono::TimeDelta::milliseconds(1), now),
            Finality::Provisional
        );
        assert_eq!(finality(now, now), Finality::Provisional);
        assert_eq!(finality(Timestamp::MAX_UTC, now), Finality::Provisional);
        assert_eq!(finality(Timestamp::MIN_UTC, now), Finality::Final);
    }
}
