//! Reading transfers as they stand now: a hold past its `expiresAt` reads as expired,
//! by the clock of the deployment that logs it; and waiting, without driving it, until a
//! transfer has come to rest.

use std::time::Duration;

use backon::Retryable;

use super::{Driver, Requests, ServiceError, ServiceResult};
use crate::domain::{AccountId, Timestamp, Transfer, TransferFilter, TransferId, TransferState};
use crate::retry;
use crate::store::StoreResult;

/// How often a transfer is read again while waiting for it to come to rest.
const REPLAY_POLL: Duration = Duration::from_millis(20);

impl Requests {
    /// The server time of the deployment that logs `transfer`, to read it as of now.
    async fn now_for(&self, transfer: &Transfer) -> StoreResult<Timestamp> {
        self.driver
            .log_store(transfer)?
            .server_time_lower_bound()
            .await
    }
}

impl Driver {
    /// The stored transfer, for the protocol (no view applied).
    pub async fn find_transfer(&self, id: TransferId) -> ServiceResult<Transfer> {
        self.deployments
            .find_transfer(id)
            .await?
            .ok_or(ServiceError::TransferNotFound(id))
    }
}

impl Requests {
    /// A transfer as it stands now: a hold past its `expiresAt` reads as expired (see
    /// [`Transfer::as_of`]).
    pub async fn read_transfer(&self, id: TransferId) -> ServiceResult<Transfer> {
        let transfer = self.driver.find_transfer(id).await?;
        let now = self.now_for(&transfer).await?;
        Ok(transfer.as_of(now))
    }

    /// Transfers newest first, as they stand now; a listing of `held` ones leaves out
    /// the holds past their expiry.
    pub async fn transfers(
        &self,
        filter: &TransferFilter,
        limit: u32,
    ) -> ServiceResult<Vec<Transfer>> {
        let mut filter = filter.clone();
        if filter.state == Some(TransferState::Held) {
            filter.unexpired = true;
        }
        let listed = self
            .driver
            .deployments
            .list_transfers(&filter, limit)
            .await?;
        let mut now = std::collections::HashMap::new();
        let mut shown = Vec::with_capacity(listed.len());
        for t in listed {
            let at = match now.get(&t.source_deployment) {
                Some(at) => *at,
                None => {
                    let at = self.now_for(&t).await?;
                    now.insert(t.source_deployment.clone(), at);
                    at
                }
            };
            let t = t.as_of(at);
            // A hold listed as `held` may read as expired by now.
            if filter.state.is_none_or(|state| state == t.state) {
                shown.push(t);
            }
        }
        Ok(shown)
    }

    /// The transfers touching an account, newest first; 404 for an unknown account.
    pub async fn account_transfers(
        &self,
        account: &AccountId,
        before: Option<TransferId>,
        limit: u32,
    ) -> ServiceResult<Vec<Transfer>> {
        self.book.account(account).await?;
        let filter = TransferFilter {
            account: Some(account.clone()),
            before,
            ..TransferFilter::default()
        };
        self.transfers(&filter, limit).await
    }
}

impl Driver {
    /// Re-reads a transfer until it is at rest, the protocol having nothing left to do for
    /// it (it is terminal, or a hold is `held`, waiting for its client) or `limit` has
    /// passed. Does not drive it: its owner (or, if the owner died, the sweeper) does.
    pub(super) async fn wait_until_at_rest(
        &self,
        transfer: Transfer,
        limit: Duration,
    ) -> ServiceResult<Transfer> {
        let deadline = tokio::time::Instant::now() + limit;
        let time_left = || tokio::time::Instant::now() < deadline;
        if transfer.state.is_at_rest() || !time_left() {
            return Ok(transfer);
        }
        // The caller has just read it: the first read again only after a pause, as every
        // later one (the policy's attempts start at once).
        tokio::time::sleep(REPLAY_POLL).await;
        // `Err(Ok(_))`: read, not at rest yet; `Err(Err(_))`: the read failed.
        let polled = (|| async {
            match self.reload(&transfer).await {
                Ok(read) if read.state.is_at_rest() => Ok(read),
                read => Err(read),
            }
        })
        .retry(retry::polling(REPLAY_POLL))
        .when(|read| read.is_ok() && time_left())
        .await;
        Ok(match polled {
            Ok(at_rest) => at_rest,
            Err(read) => read?,
        })
    }
}
