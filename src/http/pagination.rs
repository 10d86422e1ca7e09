//! Keyset pagination shared by the listings of accounts, transfers and API keys, in the
//! one form every listing answers (`docs/api.md#pages`): `limit` (1 to 100, default 20)
//! and an opaque `after`, what the previous page's `next` said; `next` is null on the
//! last page. `cursor`, the name `after` had before, is still read as a deprecated alias
//! of it; the answer has `next` only.
//!
//! A value of `next` is the listing's name and the last item's key, in base64url: a
//! value of one listing is refused by another, and any value not handed out is a 400
//! `invalid_parameter` naming the parameter the client sent, never a 500.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};
use utoipa::IntoParams;

use super::problem::ApiError;
use crate::domain::Timestamp;

pub const DEFAULT_LIMIT: u32 = 20;
pub const MAX_LIMIT: u32 = 100;

/// The paging parameters, as sent.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PageParams {
    /// How many items to return, 1 to 100. Default 20.
    #[param(value_type = Option<u32>, minimum = 1, maximum = 100, example = 20)]
    pub limit: Option<String>,
    /// The `next` of the previous page of the same listing: the items after it. Opaque.
    /// Absent: from the first item.
    #[param(min_length = 1, pattern = "^[A-Za-z0-9_-]+$")]
    pub after: Option<String>,
    /// The old name of `after`, still read for clients generated before it was renamed.
    /// Send `after`.
    #[param(min_length = 1, pattern = "^[A-Za-z0-9_-]+$")]
    #[deprecated = "send `after`"]
    pub cursor: Option<String>,
}

/// A validated page request: the limit and the key of the last item of the previous
/// page.
pub struct PageRequest<K> {
    pub limit: u32,
    pub after: Option<K>,
}

/// What every keyset listing answers. Each listing documents (and serializes) it as its
/// own concrete type, `AccountPage` or `TransferPage`, so that the OpenAPI document
/// refers to the item schema instead of repeating it inline.
#[derive(Debug, Serialize)]
pub struct Page<T> {
    pub items: Vec<T>,
    /// Pass as `after` to get the next page; null on the last page.
    pub next: Option<String>,
}

// `cursor` is deprecated for clients; the service still reads it.
#[allow(deprecated)]
impl PageParams {
    /// Validates the parameters. `kind` tags the value of `after` so that one of another
    /// listing is refused; `key` reads the listing's key out of it (`None`: not one this
    /// listing could have handed out).
    pub fn parse<K>(
        &self,
        kind: &str,
        key: impl Fn(&str) -> Option<K>,
    ) -> Result<PageRequest<K>, ApiError> {
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
        let after = match (&self.after, &self.cursor) {
            (None, None) => None,
            (Some(raw), None) => Some(after(kind, "after", raw, key)?),
            (None, Some(raw)) => Some(after(kind, "cursor", raw, key)?),
            (Some(_), Some(_)) => {
                return Err(ApiError::InvalidParameter {
                    field: "cursor".into(),
                    detail: "cursor is the old name of after: send after only".into(),
                });
            }
        };
        Ok(PageRequest { limit, after })
    }
}

/// The key in `raw`, the value of the parameter `name` of listing `kind`: refused unless
/// it is one this listing handed out as `next`.
pub fn after<K>(
    kind: &str,
    name: &str,
    raw: &str,
    key: impl Fn(&str) -> Option<K>,
) -> Result<K, ApiError> {
    decode(kind, raw)
        .as_deref()
        .and_then(key)
        .ok_or_else(|| ApiError::InvalidParameter {
            field: name.into(),
            detail: format!("{name} is not a next this listing handed out"),
        })
}

/// The key of an item of a listing in creation order: its creation time in
/// milliseconds and its id (unique, so two items made in one millisecond keep an order).
pub fn time_and_id(created_at: Timestamp, id: &str) -> String {
    format!("{}:{id}", created_at.timestamp_millis())
}

/// The longest id a [`time_and_id`] key carries: longer than any id the service makes
/// (a delivery's, `<webhook id>:<event id>`, is under 200 bytes).
const MAX_KEY_ID_BYTES: usize = 256;

/// Reads a [`time_and_id`] key; `None` for anything else.
pub fn read_time_and_id(key: &str) -> Option<(Timestamp, String)> {
    let (millis, id) = key.split_once(':')?;
    let at = chrono::DateTime::from_timestamp_millis(millis.parse().ok()?)?;
    let fits =
        !id.is_empty() && id.len() <= MAX_KEY_ID_BYTES && id.bytes().all(|b| b.is_ascii_graphic());
    fits.then(|| (at, id.to_owned()))
}

pub fn encode(kind: &str, key: &str) -> String {
    URL_SAFE_NO_PAD.encode(format!("{kind}:{key}"))
}

fn decode(kind: &str, raw: &str) -> Option<String> {
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
    let next = if more {
        fetched.last().map(|last| encode(kind, &key(last)))
    } else {
        None
    };
    Page {
        items: fetched.into_iter().map(to_item).collect(),
        next,
    }
}

#[cfg(test)]
#[allow(deprecated)]
mod tests {
    use super::*;

    fn any(key: &str) -> Option<String> {
        Some(key.to_owned())
    }

    #[test]
    fn cursors_round_trip_and_are_bound_to_their_listing() {
        let c = encode("accounts", "alice");
        let params = PageParams {
            after: Some(c.clone()),
            ..PageParams::default()
        };
        assert_eq!(
            params.parse("accounts", any).ok().and_then(|p| p.after),
            Some("alice".to_owned())
        );
        assert!(params.parse("transfers", any).is_err());
    }

    #[test]
    fn the_old_name_cursor_is_read_as_after_but_not_both() {
        let c = encode("accounts", "alice");
        let old = PageParams {
            cursor: Some(c.clone()),
            ..PageParams::default()
        };
        assert_eq!(
            old.parse("accounts", any).ok().and_then(|p| p.after),
            Some("alice".to_owned())
        );
        let both = PageParams {
            after: Some(c.clone()),
            cursor: Some(c),
            ..PageParams::default()
        };
        assert!(both.parse("accounts", any).is_err());
    }

    #[test]
    fn a_time_and_id_key_round_trips_and_nothing_else_reads_as_one() {
        let at = chrono::DateTime::from_timestamp_millis(1_764_000_000_123).unwrap();
        let key = time_and_id(at, "wh_1:transfer.done:6b06");
        assert_eq!(
            read_time_and_id(&key),
            Some((at, "wh_1:transfer.done:6b06".to_owned()))
        );
        let long = format!("1:{}", "a".repeat(MAX_KEY_ID_BYTES + 1));
        for bad in [
            "",
            "1",
            "1:",
            "x:wh_1",
            "1:a b",
            long.as_str(),
            "99999999999999999:a",
        ] {
            assert_eq!(read_time_and_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn limits_outside_one_to_a_hundred_are_refused() {
        for bad in ["0", "101", "-1", "ten"] {
            let params = PageParams {
                limit: Some(bad.into()),
                ..PageParams::default()
            };
            assert!(params.parse("accounts", any).is_err(), "{bad}");
        }
    }
}
