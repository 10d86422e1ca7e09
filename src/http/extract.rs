//! Request extractors that turn every malformed input into an [`ApiError`]: a body that
//! is not JSON is a 400 `malformed_json`; JSON of the wrong shape is a 422 naming the
//! field (found with `serde_path_to_error`), never axum's plain-text rejection.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::header;
use serde::de::DeserializeOwned;

use super::problem::ApiError;

/// `Json<T>` with problem+json rejections.
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let is_json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(|mime| {
                let mime = mime.trim().to_ascii_lowercase();
                mime == "application/json"
                    || (mime.starts_with("application/") && mime.ends_with("+json"))
            })
            .unwrap_or(false);
        if !is_json {
            return Err(ApiError::UnsupportedMediaType);
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge
            } else {
                ApiError::MalformedJson("the body could not be read".into())
            }
        })?;
        parse_json(&bytes).map(ApiJson)
    }
}

/// Parses a JSON body, classifying failures as syntax (400) or shape (422).
/// [`ApiJson`] for a body that may be left out: an empty body is `T::default()`, with or
/// without a `Content-Type`; any other body must be JSON, as for [`ApiJson`].
pub struct OptionalApiJson<T>(pub T);

impl<S, T> FromRequest<S> for OptionalApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned + Default,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let empty = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .is_some_and(|length| length.as_bytes() == b"0")
            || (!req.headers().contains_key(header::CONTENT_LENGTH)
                && !req.headers().contains_key(header::TRANSFER_ENCODING));
        if empty {
            return Ok(OptionalApiJson(T::default()));
        }
        let ApiJson(body) = ApiJson::from_request(req, state).await?;
        Ok(OptionalApiJson(body))
    }
}

pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    // Syntax first, on its own: a truncated or invalid document is 400 whatever its shape.
    if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
        return Err(ApiError::MalformedJson(e.to_string()));
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(&mut de).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        let message = inner.to_string();
        // serde reports a missing or unknown field at the enclosing path; name the field.
        let field = if let Some(name) = quoted_after(&message, "missing field ") {
            join_path(&path, &name)
        } else if let Some(name) = quoted_after(&message, "unknown field ") {
            // The path already ends with the unknown field's name.
            if path == name || path.ends_with(&format!(".{name}")) {
                path
            } else {
                join_path(&path, &name)
            }
        } else if path == "." {
            "body".to_owned()
        } else {
            path
        };
        let detail = strip_position(&message);
        ApiError::InvalidField {
            detail: format!("{field}: {detail}"),
            field,
        }
    })
}

fn quoted_after(message: &str, prefix: &str) -> Option<String> {
    let rest = message.strip_prefix(prefix)?;
    let rest = rest.strip_prefix('`')?;
    Some(rest[..rest.find('`')?].to_owned())
}

fn join_path(path: &str, name: &str) -> String {
    if path == "." {
        name.to_owned()
    } else {
        format!("{path}.{name}")
    }
}

/// serde_json appends " at line 1 column 42", which means nothing to a client of a
/// one-line body.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) => message[..i].to_owned(),
        None => message.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Body {
        amount: i64,
        source: String,
    }

    #[test]
    fn broken_json_is_malformed() {
        let err = parse_json::<Body>(b"{\"amount\": 5").unwrap_err();
        assert!(matches!(err, ApiError::MalformedJson(_)), "{err:?}");
    }

    #[test]
    fn a_wrongly_typed_field_is_named() {
        let err = parse_json::<Body>(br#"{"amount": "5", "source": "a"}"#).unwrap_err();
        match err {
            ApiError::InvalidField { field, .. } => assert_eq!(field, "amount"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_missing_field_is_named() {
        let err = parse_json::<Body>(br#"{"amount": 5}"#).unwrap_err();
        match err {
            ApiError::InvalidField { field, .. } => assert_eq!(field, "source"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_unknown_field_is_named() {
        let err = parse_json::<Body>(br#"{"amount": 5, "source": "a", "ammount": 1}"#).unwrap_err();
        match err {
            ApiError::InvalidField { field, .. } => assert_eq!(field, "ammount"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_fractional_amount_is_refused() {
        let err = parse_json::<Body>(br#"{"amount": 1.5, "source": "a"}"#).unwrap_err();
        assert!(
            matches!(err, ApiError::InvalidField { ref field, .. } if field == "amount"),
            "{err:?}"
        );
    }
}
