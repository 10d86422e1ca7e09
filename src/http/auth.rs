//! Access control: optional API keys (and how the OpenAPI document describes them), and
//! the CORS policy for browsers.
//!
//! With `API_KEYS` set, every request needs `Authorization: Bearer <key>` except the
//! public operational routes ([`is_public`]): `/health`, `/ready`, `/metrics`,
//! `/openapi.json` and the documentation under `/docs`. The key is one of `API_KEYS`
//! (platform keys) or one made through `/api-keys` ([`KeyBook`], `docs/tenants.md`). A
//! missing, unknown or revoked key is 401 `unauthorized` with `WWW-Authenticate: Bearer`;
//! a read-only key on anything but a safe method (GET, HEAD, OPTIONS, TRACE) or on
//! `/webhooks`, and a key that is not an admin on `/api-keys`, is 403 `forbidden`.
//! Without `API_KEYS` the layer lets everything through as a platform admin and the
//! header is ignored (`startup` says so loudly).
//!
//! The layer also says, in the request's extensions, whose idempotency keys a request
//! sends ([`KeyScope`]: the id of the API key that authenticated it, or the shared scope
//! without `API_KEYS`) and what exists for it ([`Scope`]: its key's tenant, or the
//! platform's everything).
//!
//! The layer runs after routing, so it decides on the matched route template, never on
//! the raw path: a path that only looks public (`/docs/../transfers`) matches no public
//! route. A path that matches no route at all is 401 without a valid key and 404 with
//! one, so that callers without a key learn nothing about which routes exist.
//!
//! With `CORS_ALLOWED_ORIGINS` set, a request from one of those exact origins gets
//! `Access-Control-Allow-Origin` and the exposed headers, and a preflight is answered by
//! the CORS layer, outside the key check (browsers send no credentials on a preflight).
//! Other origins get no `Access-Control-Allow-Origin`, so browsers refuse them (tower-http
//! still sends `Vary` and the exposed names, which grant nothing). Unset: no CORS layer.
//!
//! Invariants: a key is compared in constant time, as SHA-256 digests of equal length,
//! against every configured key without stopping at a match; no key, nor any part of
//! the `Authorization` header, is ever logged or put in a response.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{MatchedPath, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, LOCATION};
use axum::http::{HeaderName, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::{Choice, ConditionallySelectable, ConstantTimeEq};
use tower_http::cors::{AllowOrigin, CorsLayer};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{Ref, RefOr};

use super::problem::ApiError;
use crate::config::{ApiKey, Role};
use crate::domain::{ApiKeyId, KeyScope, Scope};
use crate::service::KeyBook;

/// The name of the security scheme in the OpenAPI document.
pub const SCHEME: &str = "bearerAuth";

/// How long a browser may cache a preflight answer.
const PREFLIGHT_MAX_AGE: Duration = Duration::from_secs(600);

/// Who may call the API, from the settings.
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// `API_KEYS`; empty: no key is needed.
    pub api_keys: Vec<ApiKey>,
    /// `CORS_ALLOWED_ORIGINS`, validated and lowercase; empty: no CORS headers.
    pub cors_allowed_origins: Vec<String>,
}

/// The state of [`require_api_key`]: the keys of the settings, and those made through
/// the API.
#[derive(Clone)]
pub struct Gate {
    configured: Arc<[ApiKey]>,
    book: KeyBook,
}

impl Access {
    /// The state of [`require_api_key`], with `book` for the keys made through the API.
    pub fn gate(&self, book: KeyBook) -> Gate {
        Gate {
            configured: self.api_keys.as_slice().into(),
            book,
        }
    }

    /// The CORS layer, when origins are configured.
    pub fn cors_layer(&self) -> Option<CorsLayer> {
        let origins: Vec<HeaderValue> = self
            .cors_allowed_origins
            .iter()
            .filter_map(|origin| HeaderValue::from_str(origin).ok())
            .collect();
        if origins.is_empty() {
            return None;
        }
        let name = HeaderName::from_static;
        Some(
            CorsLayer::new()
                .allow_origin(AllowOrigin::list(origins))
                .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
                .allow_headers([
                    CONTENT_TYPE,
                    AUTHORIZATION,
                    name("idempotency-key"),
                    name("prefer"),
                    name("x-request-id"),
                ])
                .expose_headers([
                    LOCATION,
                    name("idempotent-replayed"),
                    name("preference-applied"),
                    name("x-request-id"),
                ])
                .max_age(PREFLIGHT_MAX_AGE),
        )
    }
}

/// Routes open without a key: what orchestrators, scrapers and people reading the
/// documentation need. `route` is a matched route template.
pub fn is_public(route: &str) -> bool {
    matches!(route, "/health" | "/ready" | "/metrics" | "/openapi.json")
        || route == "/docs"
        || route.starts_with("/docs/")
}

/// Routes a read-only key may not use at all, reads included: where the service's events
/// are sent is for whoever may change it (`/webhooks...`).
pub fn needs_read_write(route: &str) -> bool {
    route == "/webhooks" || route.starts_with("/webhooks/")
}

/// Routes only an admin key may use, reads included: who may call the API (`/api-keys...`).
pub fn needs_admin(route: &str) -> bool {
    route == "/api-keys" || route.starts_with("/api-keys/")
}

/// The key a request presented, when it is one made through the API, which may be
/// revoked while the request is still answered: a stream checks it again
/// (`events::stream_events`). Never logged.
#[derive(Clone)]
pub struct RevocableKey(String);

impl RevocableKey {
    pub fn secret(&self) -> &str {
        &self.0
    }
}

/// Who sent a request: its key's id, role and what it sees.
struct Caller {
    id: ApiKeyId,
    role: Role,
    scope: Scope,
    /// Set for a key made through the API.
    revocable: Option<RevocableKey>,
}

/// The configured key presented, if it is one of `keys`. Compares the SHA-256 of the
/// presented key with every configured digest in constant time and visits all of them,
/// remembering the position of a match by a constant-time select, so the time taken says
/// nothing about which key, or how much of one, matched. (`parse_api_keys` refuses a key
/// listed twice: at most one matches.)
pub fn authenticate<'k>(keys: &'k [ApiKey], presented: &str) -> Option<&'k ApiKey> {
    let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
    let mut matched = Choice::from(0);
    let mut position = 0u64;
    for (i, key) in (0u64..).zip(keys) {
        let same = key.sha256.ct_eq(&digest);
        matched |= same;
        position.conditional_assign(&i, same);
    }
    let position = usize::try_from(position).expect("a position in the list");
    bool::from(matched).then(|| &keys[position])
}

/// The token of `Authorization: Bearer <token>`; the scheme is case-insensitive.
fn bearer_token(request: &Request) -> Option<&str> {
    let value = request.headers().get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The middleware; with no keys configured it lets everything through.
pub async fn require_api_key(
    State(gate): State<Gate>,
    mut request: Request,
    next: Next,
) -> Response {
    if gate.configured.is_empty() {
        request.extensions_mut().insert(KeyScope::Shared);
        request.extensions_mut().insert(Scope::Platform);
        return next.run(request).await;
    }
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_owned());
    if route.as_deref().is_some_and(is_public) {
        return next.run(request).await;
    }
    let Some(token) = bearer_token(&request) else {
        tracing::debug!("refused: no API key");
        return ApiError::Unauthorized.into_response();
    };
    let caller = match authenticate(&gate.configured, token) {
        Some(key) => Caller {
            id: key.id.clone(),
            role: key.role,
            scope: Scope::Platform,
            revocable: None,
        },
        None => match gate.book.authenticate(token).await {
            Ok(Some(key)) => Caller {
                scope: key.scope(),
                id: key.id,
                role: key.role,
                revocable: Some(RevocableKey(token.to_owned())),
            },
            Ok(None) => {
                tracing::info!("refused: unknown API key");
                return ApiError::Unauthorized.into_response();
            }
            // The keys cannot be read: neither let in nor turned away as unknown.
            Err(e) => return ApiError::from(e).into_response(),
        },
    };
    // An unmatched path goes on to its 404 whatever the role.
    if let Some(route) = route.as_deref() {
        let writes = !request.method().is_safe() || needs_read_write(route);
        if writes && !caller.role.writes() {
            tracing::info!(api_key = %caller.id, method = %request.method(), "refused: read-only API key on a write");
            return ApiError::Forbidden.into_response();
        }
        if needs_admin(route) && caller.role != Role::Admin {
            tracing::info!(api_key = %caller.id, "refused: an API key that is not an admin on /api-keys");
            return ApiError::Forbidden.into_response();
        }
    }
    request.extensions_mut().insert(KeyScope::ApiKey(caller.id));
    request.extensions_mut().insert(caller.scope);
    if let Some(key) = caller.revocable {
        request.extensions_mut().insert(key);
    }
    next.run(request).await
}

/// Describes the keys in the OpenAPI document: the `bearerAuth` scheme; on every
/// operation that is not public a security requirement that makes the key optional
/// (`[{"bearerAuth": []}, {}]`, since a server may run without keys), a 401 response,
/// and a 403 on writes (the shared `Unauthorized` and `Forbidden` of `responses.rs`); on the public ones an explicit `security: []`, which says "no
/// key" rather than leaving it unsaid. Runs on the assembled document, once every route is in it, and
/// before `docs::complete`, which decorates these responses like every other one.
pub struct SecurityDoc;

impl utoipa::Modify for SecurityDoc {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let mut bearer = Http::new(HttpAuthScheme::Bearer);
        bearer.description = Some(
            "An API key, when the server is configured with `API_KEYS`: `rw` keys may \
             read and write, `ro` keys only read (not `/webhooks`, which needs `rw`), \
             `admin` keys also manage keys (`/api-keys`). A tenant's key sees and moves \
             only its tenant's accounts; anything else answers as if it did not exist. \
             Without `API_KEYS` no key is needed."
                .to_owned(),
        );
        doc.components
            .get_or_insert_with(Default::default)
            .add_security_scheme(SCHEME, SecurityScheme::Http(bearer));
        for (path, item) in doc.paths.paths.iter_mut() {
            let public = is_public(path);
            let guarded = needs_read_write(path) || needs_admin(path);
            let operations = [
                (&mut item.get, guarded),
                (&mut item.head, guarded),
                (&mut item.options, guarded),
                (&mut item.trace, guarded),
                (&mut item.post, true),
                (&mut item.put, true),
                (&mut item.patch, true),
                (&mut item.delete, true),
            ];
            for (operation, writes) in operations {
                let Some(operation) = operation.as_mut() else {
                    continue;
                };
                if public {
                    operation.security = Some(Vec::new());
                    continue;
                }
                operation.security = Some(vec![
                    SecurityRequirement::new(SCHEME, Vec::<String>::new()),
                    SecurityRequirement::default(),
                ]);
                let responses = &mut operation.responses.responses;
                responses.insert(
                    "401".to_owned(),
                    RefOr::Ref(Ref::from_response_name("Unauthorized")),
                );
                if writes {
                    responses.insert(
                        "403".to_owned(),
                        RefOr::Ref(Ref::from_response_name("Forbidden")),
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RW: &str = "rw-key-0123456789abcdef";
    const RO: &str = "ro-key-0123456789abcdef";

    fn keys() -> Vec<ApiKey> {
        vec![
            ApiKey::new(Role::ReadOnly, RO),
            ApiKey::new(Role::ReadWrite, RW),
        ]
    }

    #[test]
    fn a_configured_key_authenticates_as_itself_with_its_role() {
        let keys = keys();
        let rw = authenticate(&keys, RW).expect("the rw key");
        let ro = authenticate(&keys, RO).expect("the ro key");
        assert_eq!((rw, ro), (&keys[1], &keys[0]));
        assert_eq!((rw.role, ro.role), (Role::ReadWrite, Role::ReadOnly));
        assert_ne!(rw.id, ro.id);
    }

    #[test]
    fn anything_else_does_not_authenticate() {
        for presented in [
            "",
            "rw-key-0123456789abcde",
            "rw-key-0123456789abcdefX",
            "RW-KEY-0123456789ABCDEF",
        ] {
            assert_eq!(authenticate(&keys(), presented), None, "{presented}");
        }
        assert_eq!(authenticate(&[], RW), None);
    }

    #[test]
    fn only_operational_routes_and_docs_are_public() {
        for route in [
            "/health",
            "/ready",
            "/metrics",
            "/openapi.json",
            "/docs",
            "/docs/",
            "/docs/{*rest}",
        ] {
            assert!(is_public(route), "{route}");
        }
        for route in ["/accounts", "/transfers/{id}", "/docsx", "/metrics/x", "/"] {
            assert!(!is_public(route), "{route}");
        }
    }

    #[test]
    fn the_bearer_token_is_taken_from_the_authorization_header() {
        let with = |value: &str| {
            Request::builder()
                .header(AUTHORIZATION, value)
                .body(axum::body::Body::empty())
                .unwrap()
        };
        assert_eq!(bearer_token(&with("Bearer abc")), Some("abc"));
        assert_eq!(bearer_token(&with("bearer  abc ")), Some("abc"));
        assert_eq!(bearer_token(&with("Basic abc")), None);
        assert_eq!(bearer_token(&with("Bearer ")), None);
        assert_eq!(bearer_token(&with("Bearerabc")), None);
    }
}
