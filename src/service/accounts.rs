//! The account book: opening an account (its id reserved in the directory across every
//! deployment first), and reading accounts as they stand now, without the reservations
//! of holds past their expiry.

use super::{AccountBook, ServiceError, ServiceResult};
use crate::domain::{
    Account, AccountId, AccountName, Currency, DeploymentName, OpeningBalance, Scope, TenantName,
};
use crate::error_chain::Chain;
use crate::store::deployments::Reservation;
use crate::store::{StoreError, StoreResult};

/// An account to open.
#[derive(Debug, Clone)]
pub struct NewAccount {
    pub id: Option<AccountId>,
    /// The tenant that owns it (`docs/tenants.md`); `None`: no tenant.
    pub tenant: Option<TenantName>,
    /// Where to keep it; the first deployment listed when not given.
    pub deployment: Option<DeploymentName>,
    pub name: Option<AccountName>,
    pub balance: OpeningBalance,
    pub currency: Currency,
}

impl AccountBook {
    pub async fn open_account(&self, new: NewAccount) -> ServiceResult<Account> {
        let id = match new.id {
            Some(id) => id,
            None => AccountId::parse(&format!("acc_{}", crate::store::new_transfer_id()))
                .expect("acc_ and 24 hex digits make an account id"),
        };
        let store = match &new.deployment {
            Some(name) => self
                .deployments
                .get(name)
                .ok_or_else(|| ServiceError::UnknownDeployment(name.clone()))?,
            None => self.deployments.first(),
        };
        store.check_answering()?;
        let exists = |id: &AccountId| ServiceError::AccountExists(id.to_string());
        // An account a version before the directory opened (on its only deployment,
        // now the first) has no entry there when it was opened after the directory's
        // migration ran, during a rolling upgrade: look for it where it can be.
        let first = self.deployments.first();
        if first.deployment() != store.deployment()
            && first.accounts().account(&id).await?.is_some()
        {
            return Err(exists(&id));
        }
        let now = crate::domain::now();
        let account = Account {
            id,
            deployment: store.deployment().clone(),
            tenant: new.tenant,
            name: new.name,
            balance: new.balance.minor_units(),
            pending_debits: 0,
            pending_credits: 0,
            incoming: 0,
            currency: new.currency,
            pending_transactions: Vec::new(),
            fenced_transactions: Vec::new(),
            seq: 1,
            created_at: now,
            updated_at: now,
        };
        // The id first, in the directory: unique across every deployment.
        match self
            .deployments
            .reserve_account_id(&account.id, &account.deployment)
            .await?
        {
            Reservation::Reserved => {}
            Reservation::Taken => return Err(exists(&account.id)),
        }
        failpoint!(self, AfterReserveAccount);
        match store.accounts().insert_account(&account).await {
            Ok(()) => Ok(account),
            Err(StoreError::DuplicateKey(_)) => Err(exists(&account.id)),
            Err(e) => Err(e.into()),
        }
    }

    /// An account as it stands now: holds past their `expiresAt` no longer count in its
    /// pending sums, whether or not a sweeper has released them yet.
    pub async fn account(&self, id: &AccountId) -> ServiceResult<Account> {
        let known = self.placements.get(id);
        let found = match known.and_then(|place| self.deployments.get(&place.deployment)) {
            Some(store) => {
                store.check_answering()?;
                store.accounts().account(id).await?
            }
            None => self.deployments.find_account(id).await?,
        };
        let account = found.ok_or_else(|| ServiceError::AccountNotFound(id.to_string()))?;
        Ok(self.as_of_now(vec![account]).await?.remove(0))
    }

    /// Accounts in id order, as they stand now (see [`AccountBook::account`]): those
    /// `scope` sees.
    pub async fn accounts(
        &self,
        scope: &Scope,
        after: Option<&AccountId>,
        limit: u32,
    ) -> ServiceResult<Vec<Account>> {
        let accounts = self
            .deployments
            .list_accounts(scope.tenant(), after, limit)
            .await?;
        Ok(self.as_of_now(accounts).await?)
    }

    /// `accounts`, read just before, without the reservations of expired holds. Read
    /// after the accounts, so that a hold released in between is still subtracted from
    /// the copy that still carried it (its marker says so), never twice.
    async fn as_of_now(&self, accounts: Vec<Account>) -> StoreResult<Vec<Account>> {
        let holding: Vec<&AccountId> = accounts
            .iter()
            .filter(|a| a.pending_debits > 0 || a.pending_credits > 0)
            .map(|a| &a.id)
            .collect();
        if holding.is_empty() {
            return Ok(accounts);
        }
        // A hold is logged on its source's deployment and expires by that one's clock:
        // holds into these accounts may be logged on any deployment. One that does not
        // answer leaves its holds counted, unless it keeps one of these accounts.
        let homes: Vec<&DeploymentName> = accounts.iter().map(|a| &a.deployment).collect();
        let asked = self.deployments.all().iter().map(|s| {
            let holding = &holding;
            async move {
                s.check_answering()?;
                let now = s.server_time_lower_bound().await?;
                s.transfers().expired_holds_touching(holding, now).await
            }
        });
        let mut expired = Vec::new();
        for (store, found) in self
            .deployments
            .all()
            .iter()
            .zip(futures::future::join_all(asked).await)
        {
            match found {
                Ok(mut found) => expired.append(&mut found),
                Err(e) if homes.contains(&store.deployment()) => return Err(e),
                Err(e) => {
                    tracing::warn!(deployment = %store.deployment(), error = %Chain(&e), "expired holds not read; they still count");
                }
            }
        }
        Ok(accounts.into_iter().map(|a| a.without(&expired)).collect())
    }
}
