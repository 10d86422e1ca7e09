//! The import rule of the crate map (`src/lib.rs`), checked on the source: imports go
//! http -> service -> store -> domain, the domain names no framework and no driver,
//! metrics, called from every layer, names none of them, and `store` is the only module
//! that names the driver or BSON. A module that starts naming what it may not fails
//! here, with the file and line.

use std::path::{Path, PathBuf};

/// (a file or folder under `src/`, the words its code may not contain)
const RULES: &[(&str, &[&str])] = &[
    (
        "domain",
        &[
            "axum",
            "mongodb",
            "bson",
            "crate::store",
            "crate::service",
            "crate::http",
            "crate::sweeper",
            "crate::metrics",
        ],
    ),
    (
        "metrics.rs",
        &[
            "crate::store",
            "crate::service",
            "crate::http",
            "crate::sweeper",
        ],
    ),
    (
        "store",
        &["axum", "crate::service", "crate::http", "crate::sweeper"],
    ),
    (
        "service",
        &["axum", "mongodb::", "bson", "crate::http", "crate::sweeper"],
    ),
    // The sweeper drives recoveries through the service and finds them through the store.
    ("sweeper.rs", &["axum", "mongodb::", "bson", "crate::http"]),
    (
        "http",
        &["mongodb::", "bson", "crate::store", "crate::sweeper"],
    ),
];

/// Outside `store`, nothing names the driver or BSON (the composition root, `startup.rs`,
/// included: it holds a `Store`, never a driver handle).
#[test]
fn only_the_store_names_the_driver() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let outside = rust_files(&src)
        .into_iter()
        .filter(|f| !f.starts_with(src.join("store")));
    for file in outside {
        let text = std::fs::read_to_string(&file).unwrap();
        for (number, line) in text.lines().enumerate() {
            for word in ["mongodb::", "bson"] {
                assert!(
                    !line.contains(word),
                    "{}:{} names {word}: {line}",
                    file.display(),
                    number + 1
                );
            }
        }
    }
}

fn rust_files(path: &Path) -> Vec<PathBuf> {
    if path.is_file() {
        return vec![path.to_owned()];
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).unwrap() {
        files.extend(rust_files(&entry.unwrap().path()));
    }
    files.retain(|f| f.extension().is_some_and(|e| e == "rs"));
    files
}

#[test]
fn each_module_names_only_the_layers_below_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for (module, forbidden) in RULES {
        let files = rust_files(&src.join(module));
        assert!(!files.is_empty(), "no source found for {module}");
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            for (number, line) in text.lines().enumerate() {
                for word in *forbidden {
                    assert!(
                        !line.contains(word),
                        "{}:{} names {word}: {line}",
                        file.display(),
                        number + 1
                    );
                }
            }
        }
    }
}
