//! Swagger UI at `/docs`: served from the binary, it loads the document that
//! `/openapi.json` serves, and is not itself part of that document.

use support::spawn_app;

#[tokio::test]
async fn docs_serve_swagger_ui_that_loads_the_served_openapi_document() {
    let app = spawn_app().await;

    // `/docs` redirects to `/docs/`; the client follows it.
    let page = app.get("/docs").await;
    assert_eq!(page.status(), 200);
    assert!(
        page.url().path().starts_with("/docs/"),
        "{} was not redirected under /docs/",
        page.url()
    );
    let content_type = page.headers()["content-type"].to_str().unwrap().to_owned();
    assert!(content_type.starts_with("text/html"), "{content_type}");
    let html = page.text().await.unwrap();
    assert!(html.contains("swagger-ui"), "not Swagger UI: {html}");
    assert!(html.contains("swagger-initializer.js"), "{html}");

    let initializer = app.get("/docs/swagger-initializer.js").await;
    assert_eq!(initializer.status(), 200);
    let script = initializer.text().await.unwrap();
    assert!(
        script.contains(r#""url": "/openapi.json""#),
        "Swagger UI does not load /openapi.json: {script}"
    );
    assert!(
        script.contains(r#""validatorUrl": "none""#),
        "Swagger UI would call an online validator: {script}"
    );

    let document: serde_json::Value = app.get("/openapi.json").await.json().await.unwrap();
    let paths = document["paths"].as_object().expect("paths");
    assert!(paths.contains_key("/transfers/{id}/cancel"), "{paths:?}");
    assert!(
        paths.keys().all(|path| !path.starts_with("/docs")),
        "the documentation is not part of the API: {:?}",
        paths.keys().collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn swagger_ui_assets_are_served_from_the_binary() {
    let app = spawn_app().await;
    for (asset, kind) in [
        ("/docs/swagger-ui-bundle.js", "javascript"),
        ("/docs/swagger-ui.css", "text/css"),
    ] {
        let response = app.get(asset).await;
        assert_eq!(response.status(), 200, "{asset}");
        let content_type = response.headers()["content-type"]
            .to_str()
            .unwrap()
            .to_owned();
        assert!(content_type.contains(kind), "{asset}: {content_type}");
        assert!(!response.bytes().await.unwrap().is_empty(), "{asset}");
    }
}
