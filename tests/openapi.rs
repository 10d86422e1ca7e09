//! The committed OpenAPI document, `openapi/openapi.json`, must be exactly what the code
//! generates, so that clients generated from the file match the running service.
//!
//! Regenerate it after changing the API with:
//!
//! ```text
//! UPDATE_OPENAPI=1 cargo test --test openapi
//! ```

use std::path::PathBuf;

fn committed_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("openapi/openapi.json")
}

fn generated() -> String {
    let doc = transfer_service::http::openapi();
    let mut text = serde_json::to_string_pretty(&doc).expect("the document serializes");
    text.push('\n');
    text
}

#[test]
fn the_committed_openapi_document_is_what_the_code_generates() {
    let generated = generated();
    let path = committed_path();
    if std::env::var_os("UPDATE_OPENAPI").is_some() {
        std::fs::write(&path, &generated).expect("write openapi/openapi.json");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != generated {
        let first_difference = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .map(|i| i + 1)
            .unwrap_or_else(|| committed.lines().count().min(generated.lines().count()) + 1);
        panic!(
            "openapi/openapi.json is out of date (first difference at line {first_difference}); \
             regenerate it with `UPDATE_OPENAPI=1 cargo test --test openapi` and commit it"
        );
    }
}

#[test]
fn the_document_declares_openapi_3_1_and_every_route() {
    let doc: serde_json::Value = serde_json::from_str(&generated()).unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
    let paths = doc["paths"].as_object().expect("paths");
    for path in [
        "/accounts",
        "/accounts/{id}",
        "/accounts/{id}/transfers",
        "/transfers",
        "/transfers/{id}",
        "/transfers/{id}/cancel",
        "/health",
        "/ready",
    ] {
        assert!(paths.contains_key(path), "{path} is not documented");
    }
    // utoipa 6 leaves out an empty response description, which makes the document
    // invalid OpenAPI 3.1: every response must have one. A reference to a shared response
    // (`components.responses`) has it where it points.
    for (path, operations) in paths {
        for (method, operation) in operations.as_object().unwrap() {
            let Some(responses) = operation.get("responses").and_then(|r| r.as_object()) else {
                continue;
            };
            for (status, response) in responses {
                let response = match response["$ref"].as_str() {
                    Some(reference) => {
                        let key = reference
                            .strip_prefix("#/components/responses/")
                            .unwrap_or_else(|| panic!("{method} {path} {status}: {reference}"));
                        &doc["components"]["responses"][key]
                    }
                    None => response,
                };
                assert!(
                    response["description"]
                        .as_str()
                        .is_some_and(|d| !d.is_empty()),
                    "{method} {path} {status} has no description"
                );
            }
        }
    }
}
