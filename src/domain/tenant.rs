//! Tenants (`docs/tenants.md`): who owns an account, and what a caller may see.
//!
//! A [`TenantName`] owns accounts; an API key belongs to one tenant or is a platform key.
//! The [`Scope`] of a request says which accounts, transfers, events and webhooks exist
//! for it: a tenant's own, or (a platform key, or a service run without keys) all of
//! them. Everything outside a scope answers as if it did not exist.
//!
//! Invariants: an account's tenant is set when it is opened and never changes, and so is
//! a transfer's list of tenants (the tenants of its accounts, [`Tenants::of`]): a check
//! of either against a scope, made on a read, still holds when the write it guards lands.

use std::fmt;

use super::Timestamp;
use super::values::{ApiKeyId, ParseError};

/// A tenant's name: 1 to 64 characters from `a-z`, `0-9`, `_` and `-`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantName(String);

impl TenantName {
    pub const MAX_LEN: usize = 64;

    pub fn parse(raw: &str) -> Result<Self, ParseError> {
        let allowed = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || "_-".contains(c);
        if raw.is_empty() || raw.len() > Self::MAX_LEN || !raw.chars().all(allowed) {
            return Err(ParseError(
                "must be 1 to 64 characters from a-z, 0-9, _ and -".to_owned(),
            ));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TenantName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The tenants a transfer touches: those of its accounts, each once, in name order. An
/// account with no tenant adds none, so a transfer between such accounts has none and is
/// seen by platform keys only.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tenants(Vec<TenantName>);

impl Tenants {
    /// The tenants of accounts whose tenants are `each`.
    pub fn of<'a>(each: impl IntoIterator<Item = Option<&'a TenantName>>) -> Tenants {
        let mut names: Vec<TenantName> = each.into_iter().flatten().cloned().collect();
        names.sort();
        names.dedup();
        Tenants(names)
    }

    pub fn names(&self) -> &[TenantName] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A tenant's scope asked to make something of another tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OtherTenant;

/// What an API key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `ro`: safe methods only (GET, HEAD, OPTIONS), and not `/webhooks`.
    ReadOnly,
    /// `rw`: reads and writes.
    ReadWrite,
    /// `admin`: what `rw` may, and managing API keys (`/api-keys`).
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::ReadOnly => "ro",
            Role::ReadWrite => "rw",
            Role::Admin => "admin",
        }
    }

    pub fn parse(raw: &str) -> Result<Role, ParseError> {
        match raw {
            "ro" => Ok(Role::ReadOnly),
            "rw" => Ok(Role::ReadWrite),
            "admin" => Ok(Role::Admin),
            _ => Err(ParseError("must be ro, rw or admin".to_owned())),
        }
    }

    /// Whether this role may write (any unsafe method, and `/webhooks`).
    pub fn writes(self) -> bool {
        matches!(self, Role::ReadWrite | Role::Admin)
    }
}

/// What exists for a request: everything (a platform key, or no keys configured), or
/// one tenant's own.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Scope {
    Platform,
    Tenant(TenantName),
}

impl Scope {
    /// Whether an account of `tenant` exists for this scope.
    pub fn sees_account(&self, tenant: Option<&TenantName>) -> bool {
        match self {
            Scope::Platform => true,
            Scope::Tenant(mine) => tenant == Some(mine),
        }
    }

    /// Whether a transfer (or an event, or anything else) touching `tenants` exists for
    /// this scope: for a tenant, when one of them is its own.
    pub fn sees(&self, tenants: &Tenants) -> bool {
        match self {
            Scope::Platform => true,
            Scope::Tenant(mine) => tenants.0.contains(mine),
        }
    }

    /// The tenant of something made in this scope with `named` asked for: a tenant
    /// makes things of its own tenant only (naming none is naming its own; naming
    /// another is refused), the platform of the one it names, or of none.
    pub fn tenant_of_new(
        &self,
        named: Option<TenantName>,
    ) -> Result<Option<TenantName>, OtherTenant> {
        match (self, named) {
            (Scope::Platform, named) => Ok(named),
            (Scope::Tenant(own), None) => Ok(Some(own.clone())),
            (Scope::Tenant(own), Some(named)) if named == *own => Ok(Some(named)),
            (Scope::Tenant(_), Some(_)) => Err(OtherTenant),
        }
    }

    /// The tenant, for a tenant's scope.
    pub fn tenant(&self) -> Option<&TenantName> {
        match self {
            Scope::Platform => None,
            Scope::Tenant(name) => Some(name),
        }
    }
}

/// An API key made through the API, as it is stored and listed: never its secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    /// Its public id, for logs and listings; scopes its idempotency keys.
    pub id: ApiKeyId,
    /// Its tenant; `None`: a platform key.
    pub tenant: Option<TenantName>,
    pub role: Role,
    pub created_at: Timestamp,
    /// About when it was last used (noted at most once a minute per instance).
    pub last_used_at: Option<Timestamp>,
}

impl KeyRecord {
    /// What a request made with this key sees.
    pub fn scope(&self) -> Scope {
        match &self.tenant {
            None => Scope::Platform,
            Some(tenant) => Scope::Tenant(tenant.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str) -> TenantName {
        TenantName::parse(name).unwrap()
    }

    #[test]
    fn a_tenant_name_is_1_to_64_of_lowercase_digits_underscore_and_dash() {
        for good in ["a", "acme-eu_2", &"z".repeat(64)] {
            assert!(TenantName::parse(good).is_ok(), "{good}");
        }
        for bad in ["", "Acme", "a b", "a.b", "é", &"z".repeat(65), "a/b"] {
            assert!(TenantName::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_transfers_tenants_are_its_accounts_tenants_once_each_in_order() {
        let (a, b) = (t("acme"), t("bolt"));
        let tenants = Tenants::of([Some(&b), None, Some(&a), Some(&b)]);
        assert_eq!(tenants.names(), &[a.clone(), b.clone()]);
        assert!(Tenants::of([None, None]).is_empty());
    }

    #[test]
    fn a_tenant_sees_only_its_own_and_the_platform_everything() {
        let (a, b) = (t("acme"), t("bolt"));
        let acme = Scope::Tenant(a.clone());
        assert!(acme.sees_account(Some(&a)));
        assert!(!acme.sees_account(Some(&b)));
        assert!(!acme.sees_account(None));
        assert!(Scope::Platform.sees_account(None));
        assert!(Scope::Platform.sees_account(Some(&b)));

        let across = Tenants::of([Some(&a), Some(&b)]);
        assert!(acme.sees(&across));
        assert!(!acme.sees(&Tenants::of([Some(&b)])));
        assert!(!acme.sees(&Tenants::default()));
        assert!(Scope::Platform.sees(&Tenants::default()));
    }

    #[test]
    fn a_tenant_makes_things_of_its_own_tenant_only_and_the_platform_of_any() {
        let (a, b) = (t("acme"), t("bolt"));
        let acme = Scope::Tenant(a.clone());
        assert_eq!(acme.tenant_of_new(None), Ok(Some(a.clone())));
        assert_eq!(acme.tenant_of_new(Some(a.clone())), Ok(Some(a.clone())));
        assert_eq!(acme.tenant_of_new(Some(b.clone())), Err(OtherTenant));
        assert_eq!(Scope::Platform.tenant_of_new(None), Ok(None));
        assert_eq!(Scope::Platform.tenant_of_new(Some(b.clone())), Ok(Some(b)));
    }

    #[test]
    fn roles_parse_from_their_names_and_only_ro_cannot_write() {
        for role in [Role::ReadOnly, Role::ReadWrite, Role::Admin] {
            assert_eq!(Role::parse(role.as_str()).unwrap(), role);
        }
        assert!(Role::parse("root").is_err());
        assert!(!Role::ReadOnly.writes());
        assert!(Role::ReadWrite.writes() && Role::Admin.writes());
    }
}
