//! Placement: where each account lives (its deployment), its currency and its tenant, as
//! a new transfer needs them to be validated and routed, found once and then remembered
//! by the process in [`Placements`], a bounded cache. A new transfer names only accounts
//! its caller's [`Scope`] sees: any other is refused as an unknown one.

use std::sync::Arc;

use quick_cache::sync::{Cache, DefaultLifecycle};
use quick_cache::{DefaultHashBuilder, OptionsBuilder, UnitWeighter};

use super::{AccountBook, NewTransfer, ServiceError, ServiceResult};
use crate::domain::{AccountId, Currency, DeploymentName, Legs, Placement, Scope, Tenants};

/// Where a new transfer goes: the deployments of its accounts, its currency, and the
/// tenants of its accounts.
#[derive(Debug, Clone)]
pub(super) struct Route {
    pub(super) source: DeploymentName,
    pub(super) destination: DeploymentName,
    pub(super) currency: Currency,
    pub(super) tenants: Tenants,
}

/// `place` of `account` (`None`: it exists nowhere), if `scope` sees the account; an
/// account it does not see is refused exactly as one that does not exist. Judged only
/// once every account of a request was looked up, in the request's order, so that which
/// account a refusal names does not depend on whether another tenant's account exists.
fn seen(scope: &Scope, account: &AccountId, place: Option<Placement>) -> ServiceResult<Placement> {
    match place {
        Some(place) if scope.sees_account(place.tenant.as_ref()) => Ok(place),
        _ => Err(ServiceError::AccountNotFound(account.to_string())),
    }
}

/// Accounts whose place the [`AccountBook`] remembers, at most.
pub(super) const KNOWN_ACCOUNTS_MAX: usize = 100_000;

/// The shards of the cache behind [`Placements`], each behind a lock of its own, so that
/// concurrent requests seldom wait for one another. A power of two: see
/// [`Placements::bounded`].
const SHARDS: usize = 8;

/// The deployment, currency and tenant of every account this process has seen, by id,
/// up to a bound. None ever changes and no account is ever deleted through the service, so a
/// transfer between known accounts is validated and routed without a read. Should an
/// account vanish behind the service's back, the debit or credit finds it gone and the
/// transfer rolls back with `account_not_found`: the cache can make an answer less
/// precise, never move money wrongly.
#[derive(Clone)]
pub(super) struct Placements {
    /// Shared by every clone of the service (a sibling too). Full, it makes room for a
    /// new place by forgetting one (S3-FIFO: first one seen once and not asked for
    /// since), so that the places in use stay.
    cache: Arc<Cache<AccountId, Placement>>,
}

impl Placements {
    /// A memory of the places of `bound` accounts at most (rounded down to a multiple of
    /// the shards, from eight accounts on).
    pub(super) fn bounded(bound: usize) -> Placements {
        // The cache gives each shard its share of the capacity rounded up, so the
        // capacity is made a multiple of the shards: never past the bound. (With few
        // accounts it merges shards, by halves, to keep 32 in each, or one shard for
        // all: still a power of two that divides it.)
        let capacity = if bound < SHARDS {
            bound
        } else {
            bound - bound % SHARDS
        };
        let options = OptionsBuilder::new()
            .shards(SHARDS)
            .estimated_items_capacity(capacity)
            .weight_capacity(capacity as u64)
            .build()
            .expect("both capacities are set");
        let cache = Cache::with_options(
            options,
            UnitWeighter,
            DefaultHashBuilder::default(),
            DefaultLifecycle::default(),
        );
        Placements {
            cache: Arc::new(cache),
        }
    }

    /// Where account `id` lives and its currency, if remembered.
    pub(super) fn get(&self, id: &AccountId) -> Option<Placement> {
        self.cache.get(id)
    }

    /// Remembers where accounts live.
    fn remember(&self, places: impl IntoIterator<Item = (AccountId, Placement)>) {
        for (id, place) in places {
            self.cache.insert(id, place);
        }
    }
}

impl AccountBook {
    /// Checks what the stored accounts of `new` must agree to (one check for one leg and
    /// many: every account exists and the caller sees it, all in one currency); answers
    /// where the transfer goes (logged where its first leg's source lives) and, for a
    /// multi-leg transfer, its legs with each party placed.
    pub(super) async fn check_accounts(
        &self,
        new: &NewTransfer,
    ) -> ServiceResult<(Route, Option<Legs>)> {
        let accounts: Vec<&AccountId> = match &new.legs {
            Some(legs) => legs.parties().iter().map(|p| &p.account).collect(),
            None if new.source == new.destination => return Err(ServiceError::SameAccount),
            None => vec![&new.source, &new.destination],
        };
        let places = self
            .place_all(&accounts)
            .await?
            .into_iter()
            .zip(&accounts)
            .map(|(place, account)| seen(&new.scope, account, place))
            .collect::<ServiceResult<Vec<Placement>>>()?;
        let currency = &places[0].currency;
        if let Some(other) = places.iter().find(|p| &p.currency != currency) {
            return Err(ServiceError::CurrencyMismatch {
                source_currency: currency.to_string(),
                destination_currency: other.currency.to_string(),
            });
        }
        let place_of = |account: &AccountId| {
            let i = accounts.iter().position(|a| *a == account);
            i.map(|i| places[i].deployment.clone()).unwrap_or_default()
        };
        let route = Route {
            source: place_of(&new.source),
            destination: place_of(&new.destination),
            currency: currency.clone(),
            tenants: Tenants::of(places.iter().map(|p| p.tenant.as_ref())),
        };
        let legs = new.legs.clone().map(|legs| legs.placed(place_of));
        Ok((route, legs))
    }

    /// The places of `accounts`, in their order (`None` for one that exists nowhere):
    /// remembered, or found two at a time (concurrently, with concurrent transfers'
    /// accounts), then remembered.
    async fn place_all(&self, accounts: &[&AccountId]) -> ServiceResult<Vec<Option<Placement>>> {
        let mut places: Vec<Option<Placement>> =
            accounts.iter().map(|a| self.placements.get(a)).collect();
        let unknown: Vec<&AccountId> = accounts
            .iter()
            .zip(&places)
            .filter(|(_, place)| place.is_none())
            .map(|(a, _)| *a)
            .collect();
        let found = futures::future::try_join_all(unknown.chunks(2).map(|pair| {
            let pair = [pair[0], *pair.last().unwrap_or(&pair[0])];
            async move { Ok::<_, ServiceError>((pair, self.deployments.locate(pair).await?)) }
        }))
        .await?;
        for (pair, found) in found {
            for (account, place) in pair.into_iter().zip(found) {
                let Some(place) = place else { continue };
                self.placements.remember([(account.clone(), place.clone())]);
                if let Some(i) = accounts.iter().position(|a| *a == account) {
                    places[i] = Some(place);
                }
            }
        }
        Ok(places)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The places of accounts are remembered up to the bound and no further: the memory
    /// fills to the bound, then makes room for each new place by forgetting another, and
    /// a place just remembered is found. (A small bound, one shard; the service's own
    /// bound is kept exactly across its shards.)
    #[test]
    fn the_places_of_accounts_are_remembered_up_to_the_bound() {
        const BOUND: usize = 16;
        let place = |i: usize| {
            let id = AccountId::parse(&format!("a{i}")).unwrap();
            let at = Placement {
                deployment: DeploymentName::parse("main").unwrap(),
                currency: Currency::usd(),
                tenant: None,
            };
            (id, at)
        };
        let known = Placements::bounded(BOUND);
        known.remember((0..BOUND - 2).map(place));
        known.remember([place(BOUND - 2), place(BOUND - 1)]);
        assert_eq!(known.cache.len(), BOUND, "filled to the bound");
        for i in (BOUND..3 * BOUND).step_by(2) {
            known.remember([place(i), place(i + 1)]);
            assert_eq!(
                known.cache.len(),
                BOUND,
                "room made rather than passing the bound"
            );
            let (id, at) = place(i + 1);
            assert_eq!(
                known.get(&id),
                Some(at),
                "the place just remembered is found"
            );
        }
        let service = Placements::bounded(KNOWN_ACCOUNTS_MAX);
        assert_eq!(service.cache.capacity(), KNOWN_ACCOUNTS_MAX as u64);
    }
}
