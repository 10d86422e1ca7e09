//! What a caller's [`Scope`] sees (`docs/tenants.md`): a tenant's key sees the accounts of
//! its tenant and the transfers touching one of them; anything else answers exactly as
//! if it did not exist (`account_not_found`, `transfer_not_found`). A platform scope
//! sees everything, and costs no read here.
//!
//! A tenant's key moves (captures, voids, cancels) only a transfer it owns, one whose
//! every account is its tenant's: a transfer a platform key made across tenants, or
//! with an account of no tenant, it sees but may not move ([`ServiceError::TransferNotOwned`],
//! 403), since that would move another tenant's (or the platform's) money.
//!
//! An account's tenant, a transfer's accounts and its tenants never change once
//! written, so a check made on a read still holds when the write it guards (a cancel, a
//! capture) lands.

use super::{AccountBook, Requests, ServiceError, ServiceResult};
use crate::domain::{Account, AccountId, Scope, Transfer, TransferId};

impl AccountBook {
    /// `id`'s account as it stands now, if `scope` sees it.
    pub async fn account_in(&self, scope: &Scope, id: &AccountId) -> ServiceResult<Account> {
        let account = self.account(id).await?;
        if scope.sees_account(account.tenant.as_ref()) {
            Ok(account)
        } else {
            Err(ServiceError::AccountNotFound(id.to_string()))
        }
    }
}

impl Requests {
    /// The transfer `id` as it stands now, if `scope` sees it.
    pub async fn transfer_in(&self, scope: &Scope, id: TransferId) -> ServiceResult<Transfer> {
        let transfer = self.read_transfer(id).await?;
        if scope.sees(&transfer.tenants) {
            Ok(transfer)
        } else {
            Err(ServiceError::TransferNotFound(id))
        }
    }
}

impl AccountBook {
    /// Refuses, as not found, an account `scope` does not see.
    pub async fn check_account_seen(&self, scope: &Scope, id: &AccountId) -> ServiceResult<()> {
        if *scope == Scope::Platform {
            return Ok(());
        }
        let tenant = match self.placements.get(id) {
            Some(place) => place.tenant,
            None => {
                self.deployments
                    .find_account(id)
                    .await?
                    .ok_or_else(|| ServiceError::AccountNotFound(id.to_string()))?
                    .tenant
            }
        };
        if scope.sees_account(tenant.as_ref()) {
            Ok(())
        } else {
            Err(ServiceError::AccountNotFound(id.to_string()))
        }
    }
}

impl Requests {
    /// Refuses, as not found, a transfer `scope` does not see, and one it sees but whose
    /// accounts are not all its tenant's as not owned: what a capture, a void or a cancel
    /// checks before it moves anything.
    pub async fn check_transfer_owned(&self, scope: &Scope, id: TransferId) -> ServiceResult<()> {
        if *scope == Scope::Platform {
            return Ok(());
        }
        let transfer = self.transfer_in(scope, id).await?;
        let accounts: Vec<&AccountId> = match &transfer.legs {
            Some(legs) => legs.parties().iter().map(|p| &p.account).collect(),
            None => vec![&transfer.source, &transfer.destination],
        };
        for account in accounts {
            match self.book.check_account_seen(scope, account).await {
                Ok(()) => {}
                Err(ServiceError::AccountNotFound(_)) => {
                    return Err(ServiceError::TransferNotOwned(id));
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}
