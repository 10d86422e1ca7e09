//! Newtypes for every value a client sends us. Each `parse` is the only way to build one,
//! so holding a value is proof that it is valid.

use std::fmt;

/// The largest amount or balance we accept, in minor units: 2^53 - 1, the largest integer
/// a JavaScript client (and any IEEE-754 double) represents exactly. A balance never
/// exceeds it, so every number we hand to a frontend survives `JSON.parse`.
pub const MAX_MONEY: i64 = 9_007_199_254_740_991;

/// How long a hold may last, in milliseconds: from one second to 30 days, whether a
/// request says it or `HOLD_EXPIRES_MS` does.
pub const HOLD_EXPIRY_MS: std::ops::RangeInclusive<u64> = 1_000..=2_592_000_000;

/// Why a value was refused; the message is meant for the client and names the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(pub String);

fn refuse(message: impl Into<String>) -> ParseError {
    ParseError(message.into())
}

/// An account's identifier: 1 to 64 characters from `A-Za-z0-9_.:@-`, so it is safe in
/// a URL path segment without escaping and readable in logs.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AccountId(String);

impl AccountId {
    pub const MAX_LEN: usize = 64;

    pub fn parse(raw: &str) -> Result<Self, ParseError> {
        let allowed = |c: char| c.is_ascii_alphanumeric() || "_.:@-".contains(c);
        if raw.is_empty() || raw.len() > Self::MAX_LEN || !raw.chars().all(allowed) {
            return Err(refuse(
                "must be 1 to 64 characters from A-Z, a-z, 0-9 and _ . : @ -",
            ));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for AccountId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A free-text account name, at most 200 characters, shown to people, never used as a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountName(String);

impl AccountName {
    pub const MAX_CHARS: usize = 200;

    pub fn parse(raw: &str) -> Result<Self, ParseError> {
        if raw.chars().count() > Self::MAX_CHARS {
            return Err(refuse("must be at most 200 characters"));
        }
        if raw.chars().any(char::is_control) {
            return Err(refuse("must not contain control characters"));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An ISO-4217 currency code: three uppercase ASCII letters. We do not check the code
/// against the ISO list, which changes; a transfer only needs both sides to agree.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Currency(String);

impl Currency {
    pub fn parse(raw: &str) -> Result<Self, ParseError> {
        if raw.len() != 3 || !raw.chars().all(|c| c.is_ascii_uppercase()) {
            return Err(refuse(
                "must be an ISO-4217 code of three uppercase letters, such as USD",
            ));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn usd() -> Self {
        Self("USD".to_owned())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Currency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The amount of a transfer in minor units: 1 ..= [`MAX_MONEY`]. Never a float.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Amount(i64);

impl Amount {
    pub fn parse(raw: i64) -> Result<Self, ParseError> {
        if !(1..=MAX_MONEY).contains(&raw) {
            return Err(refuse(format!(
                "must be an integer number of minor units from 1 to {MAX_MONEY}"
            )));
        }
        Ok(Self(raw))
    }

    pub fn minor_units(self) -> i64 {
        self.0
    }
}

/// The balance an account is opened with: 0 ..= [`MAX_MONEY`] minor units.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OpeningBalance(i64);

impl OpeningBalance {
    pub fn parse(raw: i64) -> Result<Self, ParseError> {
        if !(0..=MAX_MONEY).contains(&raw) {
            return Err(refuse(format!(
                "must be an integer number of minor units from 0 to {MAX_MONEY}"
            )));
        }
        Ok(Self(raw))
    }

    pub fn minor_units(self) -> i64 {
        self.0
    }
}

/// A transfer's identifier: the 12 bytes of a MongoDB ObjectId, written as 24 lowercase
/// hex digits. Kept as bytes here so the domain does not depend on the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId([u8; 12]);

impl TransferId {
    pub fn parse(raw: &str) -> Result<Self, ParseError> {
        let mut bytes = [0u8; 12];
        if raw.len() != 24 || hex::decode_to_slice(raw, &mut bytes).is_err() {
            return Err(refuse("must be 24 hexadecimal digits"));
        }
        Ok(Self(bytes))
    }

    pub fn from_bytes(bytes: [u8; 12]) -> Self {
        Self(bytes)
    }

    pub fn bytes(self) -> [u8; 12] {
        self.0
    }
}

impl std::str::FromStr for TransferId {
    type Err = ParseError;

    fn from_str(raw: &str) -> Result<Self, ParseError> {
        Self::parse(raw)
    }
}

impl fmt::Display for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

/// A client's `Idempotency-Key`: 1 to 255 visible ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub fn parse(raw: &str) -> Result<Self, ParseError> {
        if raw.is_empty() || raw.len() > 255 || !raw.chars().all(|c| c.is_ascii_graphic()) {
            return Err(refuse("must be 1 to 255 visible ASCII characters"));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Which configured API key sent a request: 32 lowercase hexadecimal digits derived from
/// the key (`config::ApiKey`), never the key itself, so that it may be stored and logged.
/// A rotated key is another API key, with another id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ApiKeyId(String);

impl ApiKeyId {
    pub const LEN: usize = 32;

    pub fn parse(raw: &str) -> Result<Self, ParseError> {
        let lower_hex = |c: char| c.is_ascii_digit() || ('a'..='f').contains(&c);
        if raw.len() != Self::LEN || !raw.chars().all(lower_hex) {
            return Err(refuse("must be 32 lowercase hexadecimal digits"));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ApiKeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whose idempotency keys a request's key is one of. Two requests are retries of one
/// another only with the same key in the same scope.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyScope {
    /// No `API_KEYS`: one scope for every caller, as every key was before keys were
    /// scoped.
    Shared,
    /// The API key the request was authenticated with: no other API key can see or
    /// block its keys.
    ApiKey(ApiKeyId),
}

/// An idempotency key in its scope: what is unique, and what a retry is found by.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ScopedKey {
    pub scope: KeyScope,
    pub key: IdempotencyKey,
}

impl ScopedKey {
    /// `key` in the shared scope (no `API_KEYS`).
    pub fn shared(key: IdempotencyKey) -> ScopedKey {
        ScopedKey {
            scope: KeyScope::Shared,
            key,
        }
    }

    /// The same key in the shared scope, where a version that did not scope keys by API
    /// key took it; `None` for a key that is shared already.
    pub fn as_taken_before_scoping(&self) -> Option<ScopedKey> {
        match self.scope {
            KeyScope::Shared => None,
            KeyScope::ApiKey(_) => Some(ScopedKey::shared(self.key.clone())),
        }
    }
}

/// The name of a MongoDB deployment the service keeps accounts on (`DEPLOYMENTS`): 1 to
/// 32 characters from `a-z`, `0-9`, `_` and `-`. Accounts and transfer logs refer to it
/// for ever, so a deployment keeps its name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeploymentName(String);

impl DeploymentName {
    pub const MAX_LEN: usize = 32;

    pub fn parse(raw: &str) -> Result<Self, ParseError> {
        let allowed = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || "_-".contains(c);
        if raw.is_empty() || raw.len() > Self::MAX_LEN || !raw.chars().all(allowed) {
            return Err(refuse("must be 1 to 32 characters from a-z, 0-9, _ and -"));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// `default`: the one deployment of a service configured with `MONGODB_URI` alone.
impl Default for DeploymentName {
    fn default() -> Self {
        Self("default".to_owned())
    }
}

impl fmt::Display for DeploymentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The client's own label for a transfer (an invoice number, say): at most 140 characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference(String);

impl Reference {
    pub const MAX_CHARS: usize = 140;

    pub fn parse(raw: &str) -> Result<Self, ParseError> {
        if raw.is_empty() || raw.chars().count() > Self::MAX_CHARS {
            return Err(refuse("must be 1 to 140 characters"));
        }
        if raw.chars().any(char::is_control) {
            return Err(refuse("must not contain control characters"));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn account_ids_accept_the_documented_alphabet_only() {
        for ok in ["A", "alice", "acct_1.2:3@x-y", &"a".repeat(64)] {
            assert!(AccountId::parse(ok).is_ok(), "{ok} should parse");
        }
        for bad in ["", &"a".repeat(65), "a b", "a/b", "é", "a\n"] {
            assert!(AccountId::parse(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn amounts_are_between_one_and_two_to_the_53_minus_one() {
        assert!(Amount::parse(0).is_err());
        assert!(Amount::parse(-5).is_err());
        assert_eq!(Amount::parse(1).unwrap().minor_units(), 1);
        assert_eq!(Amount::parse(MAX_MONEY).unwrap().minor_units(), MAX_MONEY);
        assert!(Amount::parse(MAX_MONEY + 1).is_err());
    }

    #[test]
    fn opening_balances_may_be_zero_but_not_negative_or_unsafe() {
        assert!(OpeningBalance::parse(0).is_ok());
        assert!(OpeningBalance::parse(-1).is_err());
        assert!(OpeningBalance::parse(MAX_MONEY + 1).is_err());
    }

    #[test]
    fn currencies_are_three_uppercase_letters() {
        assert!(Currency::parse("EUR").is_ok());
        for bad in ["eur", "EU", "EURO", "E1R", ""] {
            assert!(Currency::parse(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn transfer_ids_round_trip_through_hex() {
        let raw = "65a1b2c3d4e5f60718293a4b";
        let id = TransferId::parse(raw).unwrap();
        assert_eq!(id.to_string(), raw);
        assert!(TransferId::parse("65a1b2c3d4e5f60718293a4").is_err());
        assert!(TransferId::parse("zza1b2c3d4e5f60718293a4b").is_err());
    }

    #[test]
    fn deployment_names_are_short_lowercase_words() {
        for ok in ["eu", "us-east_2", "0", &"d".repeat(32)] {
            assert!(DeploymentName::parse(ok).is_ok(), "{ok} should parse");
        }
        for bad in ["", "EU", "e u", "eu.1", &"d".repeat(33), "é"] {
            assert!(
                DeploymentName::parse(bad).is_err(),
                "{bad:?} should be refused"
            );
        }
        assert_eq!(DeploymentName::default().as_str(), "default");
    }

    #[test]
    fn idempotency_keys_are_bounded_visible_ascii() {
        assert!(IdempotencyKey::parse("order-42").is_ok());
        assert!(IdempotencyKey::parse(&"k".repeat(255)).is_ok());
        assert!(IdempotencyKey::parse(&"k".repeat(256)).is_err());
        assert!(IdempotencyKey::parse("").is_err());
        assert!(IdempotencyKey::parse("has space").is_err());
    }

    #[test]
    fn api_key_ids_are_32_lowercase_hex_digits() {
        assert!(ApiKeyId::parse(&"0a".repeat(16)).is_ok());
        for bad in ["", &"0a".repeat(15), &"0A".repeat(16), &"0g".repeat(16)] {
            assert!(ApiKeyId::parse(bad).is_err(), "{bad:?} should be refused");
        }
    }
}
