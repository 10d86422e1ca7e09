//! Keyset pagination shared by every listing: `limit` (1 to 100, default 20) and an
//! opaque `cursor` taken from the previous page's `nextCursor`.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};
use utoipa::IntoParams;

use super::problem::ApiError;

pub const DEFAULT_LIMIT: u32 = 20;
pub const MAX_LIMIT: u32 = 100;

/// The paging parameters, as sent.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PageParams {
    /// How many items to return, 1 to 100. Default 20.
    #[param(value_type = Option<u32>, minimum = 1, maximum = 100, example = 20)]
    pub limit: Option<String>,
    /// The `nextCursor` of the previous page of the same listing; opaque.
    pub cursor: Option<String>,
}

/// A validated page request: the limit and the decoded cursor key.
pub struct PageRequest {
    pub limit: u32,
    pub after: Option<String>,
}

/// What every listing answers. Each listing documents (and serializes) it as its own
/// concrete type, `AccountPage` or `TransferPage`, so that the OpenAPI document refers to
/// the item schema instead of repeating it inline.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Page<T> {
    pub items: Vec<T>,
    /// Pass as `cursor` to get the next page; null on the last page.
    pub next_cursor: Option<String>,
}

impl PageParams {
    /// Validates the parameters; `kind` tags the cursor so that a cursor of one listing
    /// is refused by another.
    pub fn parse(&self, kind: &str) -> Result<PageRequest, ApiError> {
        let limit = match &self.limit {
            None => DEFAULT_LIMIT,
            Some(raw) => match raw.parse::<u32>() {
                Ok(n) if (1..=MAX_LIMIT).contains(&n) => n,
                _ => {
                    return Err(ApiError::InvalidParameter {
                        field: "limit".into(),
                        detail: format!("limit must be a whole number from 1 to {MAX_LIMIT}"),
                    });
                }
            },
        };
        let after = match &self.cursor {
            None => None,
            Some(raw) => {
                Some(
                    decode_cursor(kind, raw).ok_or_else(|| ApiError::InvalidParameter {
                        field: "cursor".into(),
                        detail: "cursor is not one this listing handed out".into(),
                    })?,
                )
            }
        };
        Ok(PageRequest { limit, after })
    }
}

pub fn encode_cursor(kind: &str, key: &str) -> String {
    URL_SAFE_NO_PAD.encode(format!("{kind}:{key}"))
}

fn decode_cursor(kind: &str, raw: &str) -> Option<String> {
    let bytes = URL_SAFE_NO_PAD.decode(raw).ok()?;
    let text = String::from_utf8(bytes).ok()?;
    text.strip_prefix(kind)?
        .strip_prefix(':')
        .map(str::to_owned)
}

/// Builds a page from `limit + 1` fetched items: the extra one only says there is more.
pub fn page<D, T>(
    mut fetched: Vec<D>,
    limit: u32,
    kind: &str,
    key: impl Fn(&D) -> String,
    to_item: impl Fn(D) -> T,
) -> Page<T> {
    let more = fetched.len() > limit as usize;
    fetched.truncate(limit as usize);
    let next_cursor = if more {
        fetched.last().map(|last| encode_cursor(kind, &key(last)))
    } else {
        None
    };
    Page {
        items: fetched.into_iter().map(to_item).collect(),
        next_cursor,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_are_bound_to_their_listing() {
        let c = encode_cursor("accounts", "alice");
        let params = PageParams {
            limit: None,
            cursor: Some(c.clone()),
        };
        assert_eq!(
            params.parse("accounts").ok().and_then(|p| p.after),
            Some("alice".to_owned())
        );
        assert!(params.parse("transfers").is_err());
    }

    #[test]
    fn limits_outside_one_to_a_hundred_are_refused() {
        for bad in ["0", "101", "-1", "ten"] {
            let params = PageParams {
                limit: Some(bad.into()),
                cursor: None,
            };
            assert!(params.parse("accounts").is_err(), "{bad}");
        }
    }
}
