//! The OpenAPI document as a fuzzer reads it (Schemathesis in `scripts/check-api.sh`):
//! its examples are accepted by the service, a request body it calls optional is one, and
//! every operation on an id is reached by a link from the operation that makes that id,
//! so a stateful run calls it with real ids instead of guessing them into 404s.

use std::collections::BTreeMap;

use serde_json::Value;
use support::spawn_app;

async fn document(app: &support::TestApp) -> Value {
    app.get("/openapi.json").await.json().await.unwrap()
}

/// Every operation of the document by its `operationId`.
fn operations(doc: &Value) -> BTreeMap<String, &Value> {
    let mut found = BTreeMap::new();
    for item in doc["paths"].as_object().unwrap().values() {
        for operation in item.as_object().unwrap().values() {
            if let Some(id) = operation["operationId"].as_str() {
                found.insert(id.to_owned(), operation);
            }
        }
    }
    found
}

#[tokio::test]
async fn the_documents_examples_open_accounts_and_move_money_between_them() {
    let app = spawn_app().await;
    let doc = document(&app).await;
    let ops = operations(&doc);
    let media = &ops["create_account"]["requestBody"]["content"]["application/json"];
    let examples: Vec<&Value> = match media["examples"].as_object() {
        Some(named) => named.values().map(|e| &e["value"]).collect(),
        None => vec![&doc["components"]["schemas"]["CreateAccountRequest"]["example"]],
    };
    assert!(!examples.is_empty());
    for example in examples {
        let response = app.post_json("/accounts", example.clone()).await;
        let status = response.status().as_u16();
        let body = response.text().await.unwrap();
        assert_eq!(status, 201, "POST /accounts {example}: {body}");
    }
    // A transfer and a hold between the accounts the examples opened (the multi-leg
    // example names accounts of its own).
    let examples =
        &ops["create_transfer"]["requestBody"]["content"]["application/json"]["examples"];
    for name in ["transfer", "hold"] {
        let example = &examples[name]["value"];
        let response = app.post_json("/transfers", example.clone()).await;
        let status = response.status().as_u16();
        let body = response.text().await.unwrap();
        assert_eq!(status, 201, "POST /transfers {example}: {body}");
    }
}

#[tokio::test]
async fn an_optional_request_body_is_documented_optional_and_never_null() {
    let app = spawn_app().await;
    let doc = document(&app).await;
    for (id, operation) in operations(&doc) {
        let body = &operation["requestBody"];
        if body.is_null() {
            continue;
        }
        let schema = &body["content"]["application/json"]["schema"];
        let alternatives = schema["oneOf"].as_array().cloned().unwrap_or_default();
        assert!(
            !alternatives.iter().any(|s| s["type"] == "null"),
            "{id}: the service refuses a JSON null body, the document allows one: {body}"
        );
        let optional = body["description"]
            .as_str()
            .is_some_and(|d| d.starts_with("Optional:"));
        assert_eq!(
            body["required"].as_bool().unwrap_or(false),
            !optional,
            "{id}: {body}"
        );
    }
}

#[tokio::test]
async fn every_operation_on_an_id_is_reached_by_a_link_that_names_what_it_takes() {
    let app = spawn_app().await;
    let doc = document(&app).await;
    let ops = operations(&doc);
    let mut linked = BTreeMap::new();
    for (source, operation) in &ops {
        for (status, response) in operation["responses"].as_object().unwrap() {
            let Some(links) = response["links"].as_object() else {
                continue;
            };
            for (name, link) in links {
                let what = format!("{source} {status} link {name}");
                let target_id = link["operationId"].as_str().expect("an operationId");
                let target = ops
                    .get(target_id)
                    .unwrap_or_else(|| panic!("{what}: no operation {target_id}"));
                let parameters: Vec<&str> = target["parameters"]
                    .as_array()
                    .map(|ps| ps.iter().filter_map(|p| p["name"].as_str()).collect())
                    .unwrap_or_default();
                for (parameter, expression) in link["parameters"].as_object().into_iter().flatten()
                {
                    assert!(
                        parameters.contains(&parameter.as_str()),
                        "{what}: {target_id} has no parameter {parameter}"
                    );
                    assert!(
                        expression.as_str().is_some_and(|e| e.starts_with('$')),
                        "{what}: {expression}"
                    );
                }
                assert!(
                    link.get("requestBody").is_none() || target.get("requestBody").is_some(),
                    "{what}: {target_id} takes no body"
                );
                linked.insert(target_id.to_owned(), what);
            }
        }
    }
    for (id, operation) in &ops {
        let takes_a_path_id = operation["parameters"]
            .as_array()
            .is_some_and(|ps| ps.iter().any(|p| p["in"] == "path"));
        if takes_a_path_id {
            assert!(
                linked.contains_key(id),
                "{id} takes an id in its path and no link gives it one (linked: {linked:?})"
            );
        }
    }
}
