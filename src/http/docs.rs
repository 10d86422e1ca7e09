//! The API described for people and tools: the finishing pass over the OpenAPI document
//! that utoipa's attributes cannot express, and Swagger UI, which shows that document at
//! `/docs` from files compiled into the binary (no CDN: it works offline).
//!
//! [`complete`] keeps these promises of the document, in one place, for every response,
//! whether a route states it or refers to a shared one under `components.responses`
//! (see `responses.rs`):
//! - every response declares `x-request-id`, which every answer carries;
//! - a response header declared `Option<String>` in `headers(...)` may be absent, one
//!   declared `String` is always sent (`required: true`, which utoipa 6 cannot set);
//! - every `application/problem+json` response has one example per `code` that its
//!   description names in backticks, built from the [`ApiError`] the server answers
//!   with, so that an example cannot drift from the real body;
//! - a request body described as `Optional: ...` (read with `OptionalApiJson`) is
//!   `required: false`, with the object's schema only: utoipa 6 writes a body of
//!   `Option<T>` as required-less `T` or `null`, but the service reads no body or an
//!   object, never a JSON `null`.

use serde_json::Value;
use utoipa::openapi::example::ExampleBuilder;
use utoipa::openapi::path::{Operation, PathItem};
use utoipa::openapi::schema::{Object, SchemaFormat, SchemaType, Type};
use utoipa::openapi::{Header, OpenApi, Ref, RefOr, Response, Schema};
use utoipa_swagger_ui::{Config, SwaggerUi};

use super::problem::{ApiError, PROBLEM_JSON, field};
use crate::domain::Amount;
use crate::service::{HoldConflict, ServiceError};

/// Where Swagger UI is served; not part of the API, so not in the document.
pub const DOCS_PATH: &str = "/docs";
/// Where the document is served, and what Swagger UI loads.
pub const OPENAPI_PATH: &str = "/openapi.json";

const REQUEST_ID: &str = "x-request-id";
/// The name of the shared `x-request-id` header under `components.headers`.
const REQUEST_ID_COMPONENT: &str = "RequestId";

/// Swagger UI at [`DOCS_PATH`], and `doc` at [`OPENAPI_PATH`] (the route that serves it).
pub fn swagger_ui(doc: OpenApi) -> SwaggerUi {
    SwaggerUi::new(DOCS_PATH)
        .url(OPENAPI_PATH, doc)
        // Swagger UI would otherwise send the document's URL to an online validator.
        .config(Config::new([OPENAPI_PATH]).validator_url("none"))
}

/// Adds to `doc` what the attributes cannot say (see the module documentation).
pub fn complete(doc: &mut OpenApi) {
    let components = doc.components.get_or_insert_with(Default::default);
    components.headers.insert(
        REQUEST_ID_COMPONENT.to_owned(),
        RefOr::T(request_id_header()),
    );
    for response in components.responses.values_mut() {
        if let RefOr::T(response) = response {
            finish_response(None, response);
        }
    }
    for item in doc.paths.paths.values_mut() {
        for operation in operations(item) {
            if let Some(RefOr::T(body)) = operation.request_body.as_mut()
                && body
                    .description
                    .as_deref()
                    .is_some_and(|d| d.starts_with("Optional:"))
            {
                body.required = Some(utoipa::openapi::Required::False);
            }
            for (status, response) in operation.responses.responses.iter_mut() {
                // A reference to a shared response: finished above, where it is.
                let RefOr::T(response) = response else {
                    continue;
                };
                finish_response(Some(status), response);
            }
        }
    }
}

/// Finishes one response: its headers, `x-request-id`, and the examples of its problem
/// codes. `status` is `None` for a shared response, which has no status of its own.
fn finish_response(status: Option<&str>, response: &mut Response) {
    for (name, header) in response.headers.iter_mut() {
        if let RefOr::T(header) = header {
            finish_header(name, header);
        }
    }
    response.headers.insert(
        REQUEST_ID.to_owned(),
        RefOr::Ref(Ref::new(format!(
            "#/components/headers/{REQUEST_ID_COMPONENT}"
        ))),
    );
    add_problem_examples(status, response);
}

fn operations(item: &mut PathItem) -> impl Iterator<Item = &mut Operation> {
    [
        &mut item.get,
        &mut item.put,
        &mut item.post,
        &mut item.delete,
        &mut item.options,
        &mut item.head,
        &mut item.patch,
        &mut item.trace,
        &mut item.query,
    ]
    .into_iter()
    .filter_map(Option::as_mut)
}

fn request_id_header() -> Header {
    let mut header = Header::new(Object::with_type(Type::String));
    header.description = Some(
        "Identifies this request in the service's logs: the client's own `x-request-id` when \
         it sent one, otherwise a new UUID. Quote it when reporting a problem."
            .to_owned(),
    );
    header.example = Some(Value::from("7f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b"));
    mark_required(&mut header);
    header
}

/// Makes a header declared `Option<_>` optional (a header is absent, never null) and any
/// other one required, and pins down the values of the headers whose values are fixed.
fn finish_header(name: &str, header: &mut Header) {
    let mut optional = false;
    if let Some(RefOr::T(Schema::Object(schema))) = &mut header.schema {
        if let SchemaType::Array(types) = &schema.schema_type {
            optional = types.contains(&Type::Null);
            let mut types: Vec<Type> = types
                .iter()
                .filter(|t| **t != Type::Null)
                .cloned()
                .collect();
            schema.schema_type = match types.len() {
                1 => SchemaType::Type(types.remove(0)),
                _ => SchemaType::Array(types),
            };
        }
        match name {
            "Location" => {
                schema.format = Some(SchemaFormat::Custom("uri-reference".to_owned()));
            }
            "Idempotent-Replayed" => schema.enum_values = Some(vec![Value::from("true")]),
            "Preference-Applied" => {
                schema.enum_values = Some(vec![Value::from("respond-async")]);
            }
            _ => {}
        }
    }
    if !optional {
        mark_required(header);
    }
}

/// utoipa 6's `Header` has no `required` member; its extensions are flattened into the
/// header object, so the member is written there.
fn mark_required(header: &mut Header) {
    header
        .extensions
        .get_or_insert_with(Default::default)
        .insert("required".to_owned(), Value::Bool(true));
}

fn add_problem_examples(status: Option<&str>, response: &mut Response) {
    let codes = named_codes(&response.description);
    let Some(RefOr::T(content)) = response.content.get_mut(PROBLEM_JSON) else {
        return;
    };
    for code in codes {
        let Some(error) = sample(code) else {
            continue;
        };
        // A code of another status is a mistake in the description, which a test catches
        // (for a shared response, on each route that refers to it).
        if status.is_some_and(|status| error.status().as_str() != status) {
            continue;
        }
        let problem = error.to_problem();
        let example = ExampleBuilder::new()
            .summary(problem.title.clone())
            .value(Some(
                serde_json::to_value(&problem).expect("a problem serializes"),
            ))
            .build();
        content.examples.insert(code.to_owned(), RefOr::T(example));
    }
}

/// The words of `text` written in backticks.
fn named_codes(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// [`sample`] of the webhook routes' codes.
fn webhook_sample(code: &str) -> Option<ApiError> {
    const WEBHOOK_ID: &str = "wh_6b0619d67d0e8af2ac0b1adf";
    Some(match code {
        "webhook_not_found" => ServiceError::WebhookNotFound(WEBHOOK_ID.into()).into(),
        "api_key_not_found" => {
            ServiceError::ApiKeyNotFound("4f1c2a0e9b7d6c5a4f1c2a0e9b7d6c5a".into()).into()
        }
        "delivery_not_found" => {
            ServiceError::DeliveryNotFound(format!("{WEBHOOK_ID}:account.opened:alice")).into()
        }
        "delivery_not_failed" => {
            ServiceError::DeliveryNotFailed(crate::domain::DeliveryState::Succeeded).into()
        }
        "webhook_limit_reached" => {
            let cap = crate::domain::WebhookCap::Scope(crate::domain::DEFAULT_MAX_WEBHOOKS);
            ServiceError::TooManyWebhooks(cap).into()
        }
        "webhook_url_not_allowed" => {
            ServiceError::WebhookUrlNotAllowed(crate::service::UrlRefusal::NotPublic {
                host: "localhost".into(),
                address: std::net::Ipv4Addr::LOCALHOST.into(),
            })
            .into()
        }
        _ => return None,
    })
}

/// An error with this `code` as a client would meet it; `None` for anything else.
fn sample(code: &str) -> Option<ApiError> {
    const TRANSFER_ID: &str = "65a1b2c3d4e5f60718293a4b";
    let hold = |conflict| ApiError::Hold {
        conflict,
        transfer_id: TRANSFER_ID.into(),
    };
    let error = match code {
        "malformed_json" => ApiError::MalformedJson("EOF while parsing an object".into()),
        "invalid_parameter" => ApiError::InvalidParameter {
            field: "limit".into(),
            detail: "limit must be a whole number from 1 to 100".into(),
        },
        "unauthorized" => ApiError::Unauthorized,
        "forbidden" => ApiError::Forbidden,
        "account_not_found" => ApiError::AccountNotFound("alice".into()),
        "transfer_not_found" => ApiError::TransferNotFound(TRANSFER_ID.into()),
        "not_found" => ApiError::RouteNotFound("/nowhere".into()),
        "method_not_allowed" => ApiError::MethodNotAllowed,
        "account_exists" => ServiceError::AccountExists("alice".into()).into(),
        "transfer_canceled" => ApiError::TransferCanceled {
            transfer_id: TRANSFER_ID.into(),
            detail: "this transfer was canceled before it completed".into(),
        },
        "cursor_expired" => ServiceError::CursorExpired.into(),
        "payload_too_large" => ApiError::PayloadTooLarge,
        "unsupported_media_type" => ApiError::UnsupportedMediaType,
        "invalid_field" => field("amount", Amount::parse(0)).expect_err("0 is no amount"),
        "invalid_header" => ApiError::InvalidHeader {
            header: "Idempotency-Key".into(),
            detail: "must be 1 to 255 visible ASCII characters".into(),
        },
        "unknown_account" => {
            ApiError::naming_accounts_of_a_request(ServiceError::AccountNotFound("bob".into()))
        }
        "same_account" => ServiceError::SameAccount.into(),
        "currency_mismatch" => ServiceError::CurrencyMismatch {
            source_currency: "USD".into(),
            destination_currency: "EUR".into(),
        }
        .into(),
        "idempotency_key_reused" => ServiceError::IdempotencyKeyReused.into(),
        "insufficient_funds" => ApiError::InsufficientFunds {
            detail: "account alice cannot fund 5000; the transfer was recorded and canceled".into(),
            transfer_id: Some(TRANSFER_ID.into()),
            account: "alice".into(),
        },
        "balance_overflow" => ApiError::BalanceOverflow {
            transfer_id: TRANSFER_ID.into(),
            account: "bob".into(),
        },
        "database_unavailable" => ApiError::DatabaseUnavailable,
        "contended" => ApiError::Contended {
            transfer_id: Some(TRANSFER_ID.into()),
        },
        "overloaded" => ApiError::Overloaded,
        "too_many_streams" => {
            ServiceError::TooManyFollowers(crate::service::FollowerLimit::Instance).into()
        }
        "request_timeout" => ApiError::Timeout,
        "internal_error" => ApiError::Internal,
        "not_a_hold" => hold(HoldConflict::NotAHold),
        "hold_already_captured" => hold(HoldConflict::AlreadyCaptured),
        "hold_voided" => hold(HoldConflict::Voided),
        "hold_expired" => hold(HoldConflict::Expired),
        "hold_pending" => hold(HoldConflict::Pending),
        _ => return webhook_sample(code),
    };
    Some(error)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// Every code an [`ApiError`] can carry.
    const CODES: &[&str] = &[
        "malformed_json",
        "invalid_parameter",
        "unauthorized",
        "forbidden",
        "account_not_found",
        "transfer_not_found",
        "not_found",
        "webhook_not_found",
        "api_key_not_found",
        "delivery_not_found",
        "delivery_not_failed",
        "webhook_limit_reached",
        "webhook_url_not_allowed",
        "method_not_allowed",
        "account_exists",
        "transfer_canceled",
        "cursor_expired",
        "too_many_streams",
        "payload_too_large",
        "unsupported_media_type",
        "invalid_field",
        "invalid_header",
        "unknown_account",
        "same_account",
        "currency_mismatch",
        "idempotency_key_reused",
        "insufficient_funds",
        "balance_overflow",
        "database_unavailable",
        "contended",
        "overloaded",
        "request_timeout",
        "internal_error",
        "not_a_hold",
        "hold_already_captured",
        "hold_voided",
        "hold_expired",
        "hold_pending",
    ];

    /// `(operation, status, response)` for every response of the served document, a
    /// reference to a shared response replaced by the response it names.
    fn responses() -> Vec<(String, String, Response)> {
        let mut doc = crate::http::openapi();
        let shared = doc
            .components
            .as_ref()
            .map(|components| components.responses.clone())
            .unwrap_or_default();
        let mut all = Vec::new();
        for (path, item) in doc.paths.paths.iter_mut() {
            for operation in operations(item) {
                let name = format!(
                    "{} {path}",
                    operation.operation_id.clone().unwrap_or_default()
                );
                for (status, response) in &operation.responses.responses {
                    let response = match response {
                        RefOr::T(response) => response,
                        RefOr::Ref(reference) => {
                            let shared = reference
                                .ref_location
                                .strip_prefix("#/components/responses/")
                                .and_then(|key| shared.get(key));
                            match shared {
                                Some(RefOr::T(response)) => response,
                                _ => panic!(
                                    "{name} {status} refers to {}, which the document does not have",
                                    reference.ref_location
                                ),
                            }
                        }
                    };
                    all.push((name.clone(), status.clone(), response.clone()));
                }
            }
        }
        assert!(all.len() > 20, "{} responses", all.len());
        all
    }

    #[test]
    fn every_shared_response_is_used_by_a_route() {
        let doc = serde_json::to_value(crate::http::openapi()).unwrap();
        let text = doc["paths"].to_string();
        let shared = doc["components"]["responses"].as_object().unwrap();
        assert!(!shared.is_empty());
        for key in shared.keys() {
            assert!(
                text.contains(&format!("\"#/components/responses/{key}\"")),
                "no route refers to the shared response {key}"
            );
        }
    }

    #[test]
    fn each_sample_carries_the_code_it_stands_for() {
        for code in CODES {
            let error = sample(code).unwrap_or_else(|| panic!("no sample for {code}"));
            assert_eq!(error.code_and_title().0, *code);
        }
        assert!(sample("transferId").is_none());
    }

    #[test]
    fn every_problem_response_names_its_codes_and_shows_an_example_of_each() {
        for (operation, status, response) in responses() {
            let Some(RefOr::T(content)) = response.content.get(PROBLEM_JSON) else {
                continue;
            };
            let codes: Vec<&str> = named_codes(&response.description)
                .into_iter()
                .filter(|word| CODES.contains(word))
                .collect();
            assert!(
                !codes.is_empty(),
                "{operation} {status}: the description names no problem code in backticks"
            );
            for code in codes {
                let error = sample(code).unwrap();
                assert_eq!(
                    error.status().as_str(),
                    status,
                    "{operation} {status} names `{code}`, which is another status"
                );
                let example = match content.examples.get(code) {
                    Some(RefOr::T(example)) => example.value.clone(),
                    _ => panic!("{operation} {status}: no example of `{code}`"),
                };
                assert_eq!(
                    example,
                    Some(serde_json::to_value(error.to_problem()).unwrap())
                );
            }
        }
    }

    #[test]
    fn every_response_declares_the_request_id() {
        for (operation, status, response) in responses() {
            assert!(
                matches!(response.headers.get(REQUEST_ID), Some(RefOr::Ref(_))),
                "{operation} {status} does not declare {REQUEST_ID}"
            );
        }
    }

    #[test]
    fn a_header_declared_optional_may_be_absent_and_any_other_is_required() {
        let doc = serde_json::to_value(crate::http::openapi()).unwrap();
        let responses = &doc["paths"]["/transfers"]["post"]["responses"];
        let done = &responses["201"]["headers"];
        assert_eq!(done["Location"]["required"], true, "{done}");
        assert_eq!(done["Location"]["schema"]["type"], "string", "{done}");
        assert_eq!(done["Idempotent-Replayed"].get("required"), None, "{done}");
        assert_eq!(
            done["Idempotent-Replayed"]["schema"],
            json!({"type": "string", "enum": ["true"]})
        );
        assert_eq!(
            responses["422"]["$ref"],
            "#/components/responses/TransferRefused"
        );
        let refused = &doc["components"]["responses"]["TransferRefused"]["headers"];
        assert_eq!(refused["Location"].get("required"), None, "{refused}");
        assert_eq!(refused["Location"]["schema"]["type"], "string", "{refused}");
        assert_eq!(
            doc["components"]["headers"][REQUEST_ID_COMPONENT]["required"],
            true
        );
    }
}
