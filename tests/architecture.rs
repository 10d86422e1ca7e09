//! The import rule of the crate map (`src/lib.rs`), checked on the source: imports go
//! http -> service -> store -> domain, the domain names no framework and no driver,
//! metrics, called from every layer, names none of them, and `store` is the only module
//! that names the driver or BSON. `config` and `telemetry`, at the composition edge, name
//! none of the layers built from them, and `error_chain` and `retry`, which every layer
//! logs and retries with, name no module at all. A module that starts naming what it may
//! not fails here, with the file and line. Above all the rules, the modules import one
//! another without a cycle: the graph of every `crate::` path in `src/` is checked whole,
//! and a cycle fails spelled out (`a -> b -> a`) with the line behind each edge. So
//! is the graph of the files, where `super::` and `self::` paths count too (a folder's
//! `mod.rs` reaching its own files aside).
//! The tasks under a lease name no service (the lease, the event recorder), and of the
//! webhook deliverer's files only the dispatcher and its wiring name the service's parts
//! (the feed and the webhooks, never the rest). Between the types of `src/service/`, the
//! uses (a field that holds another type, a method that names one) are checked against a
//! declared graph without a cycle, and each `impl` against the files listed for its
//! type.
//! Last, no function of `src/` runs over 70 lines (named steps instead).

use std::collections::BTreeMap;
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
    // `config` and `telemetry` sit at the composition edge: `main` reads the settings and
    // sets up the logs before anything else exists, and `startup` builds the layers from
    // the settings. So they name none of the layers built from them (a setting is a value
    // of the domain, or of their own, never a type of the layer that uses it); the one
    // way back would close a cycle through `startup`, as `config` -> `service::Strategy`
    // did. `telemetry` takes its format from `config`, so `config` does not name it.
    (
        "config.rs",
        &[
            "crate::startup",
            "crate::http",
            "crate::service",
            "crate::store",
            "crate::sweeper",
            "crate::telemetry",
        ],
    ),
    (
        "telemetry.rs",
        &[
            "crate::startup",
            "crate::http",
            "crate::service",
            "crate::store",
            "crate::sweeper",
        ],
    ),
    // The background tasks under a lease (`lease.rs`): the lease names only the store
    // that keeps it, never a task that holds it; the event recorder reads and writes
    // through the store alone.
    (
        "lease.rs",
        &[
            "axum",
            "mongodb::",
            "bson",
            "crate::service",
            "crate::http",
            "crate::recorder",
            "crate::deliverer",
        ],
    ),
    (
        "recorder.rs",
        &["axum", "mongodb::", "bson", "crate::service", "crate::http"],
    ),
    // The webhook deliverer: its body comes rendered from `startup`, so it names no HTTP
    // layer; only its dispatcher (and the wiring in `mod.rs`) names the service, for the
    // feed and the webhook settings (`Feed`, `WebhookBook`: see
    // `the_deliverer_and_the_sweeper_hold_only_their_parts`). Signing and the address
    // rules name no store either.
    (
        "deliverer",
        &["axum", "mongodb::", "bson", "crate::http", "crate::sweeper"],
    ),
    ("deliverer/pages.rs", &["crate::service"]),
    ("deliverer/firsts.rs", &["crate::service"]),
    ("deliverer/handover.rs", &["crate::service"]),
    ("deliverer/slots.rs", &["crate::service", "crate::store"]),
    ("deliverer/sender.rs", &["crate::service"]),
    ("deliverer/attempt.rs", &["crate::service"]),
    ("deliverer/attempt_log.rs", &["crate::service"]),
    ("deliverer/signing.rs", &["crate::service", "crate::store"]),
    (
        "deliverer/addresses.rs",
        &["crate::service", "crate::store"],
    ),
    // Every layer logs its errors with `Chain`: whatever it named, every layer would name
    // through it.
    ("error_chain.rs", &["crate::"]),
    // Every layer retries with the named policies: the same.
    ("retry.rs", &["crate::"]),
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

/// No module of `src/` imports itself through others. Every `crate::` path in a file
/// counts (in `use` groups, in code, in `#[cfg(test)]` code, which the test build
/// compiles into the same crate, and in comments, whose doc links name modules too). A
/// folder module (`src/store/` and its files) is one node, each other file of `src/` is
/// one (`lib.rs` too, for the `$crate::` paths of its macros); `main.rs` is the binary,
/// another crate, which names the library as `transfer_service::`. `super::` paths are
/// not read: inside a folder they stay in its node, and as the code stands no top-level
/// module names the root or a sibling through them.
#[test]
fn the_modules_import_one_another_without_a_cycle() {
    let graph = import_graph();
    // The crate map's downward edges are found, so a parser that finds nothing cannot pass.
    for (from, to) in [
        ("http", "service"),
        ("service", "store"),
        ("store", "domain"),
        ("startup", "config"),
        ("telemetry", "config"),
    ] {
        assert!(
            graph[from].contains_key(to),
            "no edge {from} -> {to}: {graph:#?}"
        );
    }
    assert_no_cycle(&graph, "import cycle");
}

/// `use crate::{a, b::{c, d}}` names `a` and `b`; so does every other spelling of a
/// `crate::` path, and nothing else does.
#[test]
fn the_import_parser_finds_the_module_of_every_crate_path() {
    let text = "use crate::{a, b::{c, d}};
use crate::{
    self,
    e::F as G,
    f::*, // g::H
};
let x = crate::h::now();
$crate::i::hit($step);
pub(crate) fn j() {}
use my_crate::k;
use crate ::l;
use crate::{m::{n, o::{p}}, q};";
    assert_eq!(
        crate_paths(text),
        [
            (1, "a".to_string()),
            (1, "b".into()),
            (4, "e".into()),
            (5, "f".into()),
            (7, "h".into()),
            (8, "i".into()),
            (11, "l".into()),
            (12, "m".into()),
            (12, "q".into()),
        ]
    );
}

/// A cycle is found and spelled from where the search entered it back to there; a graph
/// that only goes down has none.
#[test]
fn a_cycle_is_found_and_spelled_out() {
    let graph = |edges: &[(&str, &str)]| {
        let mut graph: Graph = BTreeMap::new();
        for (from, to) in edges {
            graph.entry(to.to_string()).or_default();
            graph
                .entry(from.to_string())
                .or_default()
                .insert(to.to_string(), String::new());
        }
        graph
    };
    let down = graph(&[("a", "b"), ("a", "c"), ("b", "c")]);
    assert_eq!(find_cycle(&down), None);
    let around = graph(&[("a", "b"), ("b", "c"), ("c", "d"), ("d", "b")]);
    assert_eq!(
        find_cycle(&around).unwrap().join(" -> "),
        "b -> c -> d -> b"
    );
}

/// Each node and the nodes it names, each with the first place (`src/file.rs:line`)
/// that names it.
type Graph = BTreeMap<String, BTreeMap<String, String>>;

/// The import graph of `src/`.
fn import_graph() -> Graph {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = root.join("src");
    let mut files: Vec<(String, PathBuf)> = rust_files(&src)
        .into_iter()
        .filter(|f| f != &src.join("main.rs"))
        .map(|f| (node_of(&src, &f), f))
        .collect();
    files.sort();
    let mut graph: Graph = files
        .iter()
        .map(|(node, _)| (node.clone(), BTreeMap::new()))
        .collect();
    for (node, file) in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let shown = file.strip_prefix(root).unwrap().display().to_string();
        for (line, named) in crate_paths(&text) {
            assert!(
                graph.contains_key(&named),
                "{shown}:{line} names crate::{named}, which is no module of src/: the graph cannot place it"
            );
            if named != *node {
                graph
                    .get_mut(node)
                    .unwrap()
                    .entry(named)
                    .or_insert_with(|| format!("{shown}:{line}"));
            }
        }
    }
    graph
}

/// `src/store/batch.rs` is `store`, `src/config.rs` is `config`.
fn node_of(src: &Path, file: &Path) -> String {
    let relative = file.strip_prefix(src).unwrap();
    let mut parts = relative.iter();
    let first = Path::new(parts.next().unwrap());
    match parts.next() {
        Some(_) => first.to_str().unwrap().to_owned(),
        None => first.file_stem().unwrap().to_str().unwrap().to_owned(),
    }
}

/// Fails with `what`, the cycle and the reason behind each of its edges, if `graph` has
/// a cycle.
fn assert_no_cycle(graph: &Graph, what: &str) {
    if let Some(cycle) = find_cycle(graph) {
        let because: Vec<String> = cycle
            .windows(2)
            .map(|pair| {
                format!(
                    "  {} -> {}: {}",
                    pair[0], pair[1], graph[&pair[0]][&pair[1]]
                )
            })
            .collect();
        panic!("{what}: {}\n{}", cycle.join(" -> "), because.join("\n"));
    }
}

/// The first cycle a depth-first search meets, as its nodes from the first back to it
/// (`[a, b, a]`); `None` if the graph has none.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    /// Nodes on the path from the search's start (open) or wholly searched (done).
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }

    fn visit<'g>(
        node: &'g str,
        graph: &'g Graph,
        marks: &mut BTreeMap<&'g str, Mark>,
        path: &mut Vec<&'g str>,
    ) -> Option<Vec<String>> {
        marks.insert(node, Mark::Open);
        path.push(node);
        for next in graph[node].keys() {
            match marks.get(next.as_str()) {
                Some(Mark::Open) => {
                    let start = path.iter().position(|n| n == next).unwrap();
                    let mut cycle: Vec<String> =
                        path[start..].iter().map(|n| n.to_string()).collect();
                    cycle.push(next.clone());
                    return Some(cycle);
                }
                Some(Mark::Done) => {}
                None => {
                    if let Some(cycle) = visit(next, graph, marks, path) {
                        return Some(cycle);
                    }
                }
            }
        }
        path.pop();
        marks.insert(node, Mark::Done);
        None
    }

    let mut marks = BTreeMap::new();
    for node in graph.keys() {
        if !marks.contains_key(node.as_str()) {
            let found = visit(node, graph, &mut marks, &mut Vec::new());
            if found.is_some() {
                return found;
            }
        }
    }
    None
}

/// The module each `crate::` path of `text` names (its first segment; every head of a
/// `use crate::{...}` group), with the line it is on. `$crate::` counts, `pub(crate)`
/// and `my_crate::` do not.
fn crate_paths(text: &str) -> Vec<(usize, String)> {
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    let line_of = |at: usize| text[..at].matches('\n').count() + 1;
    let mut found = Vec::new();
    for (at, _) in text.match_indices("crate") {
        let after = at + "crate".len();
        if text[..at].ends_with(is_word) || text[after..].starts_with(is_word) {
            continue;
        }
        let rest = text[after..].trim_start();
        let Some(rest) = rest.strip_prefix("::") else {
            continue;
        };
        let rest = rest.trim_start();
        let offset = text.len() - rest.len();
        if let Some(group) = rest.strip_prefix('{') {
            let offset = offset + 1;
            for (at, name) in group_heads(group) {
                found.push((line_of(offset + at), name.to_owned()));
            }
        } else if let Some(name) = identifier(rest) {
            found.push((line_of(offset), name.to_owned()));
        }
    }
    found
}

/// The first segment of each item of a `{...}` group, from just after its `{`, with its
/// offset: `a, b::{c, d}}` gives `a` and `b`. `self` names the group's parent, not a module.
fn group_heads(group: &str) -> Vec<(usize, &str)> {
    let mut heads = Vec::new();
    let mut depth = 1;
    let mut item_starts = true;
    // Where the name just read ends.
    let mut read_to = 0;
    for (at, c) in group.char_indices() {
        if at < read_to || c.is_whitespace() {
            continue;
        }
        if depth == 1
            && item_starts
            && let Some(name) = identifier(&group[at..])
        {
            if name != "self" {
                heads.push((at, name));
            }
            item_starts = false;
            read_to = at + name.len();
            continue;
        }
        match c {
            '{' => depth += 1,
            '}' if depth == 1 => break,
            '}' => depth -= 1,
            ',' if depth == 1 => {
                item_starts = true;
                continue;
            }
            _ => {}
        }
        item_starts = false;
    }
    heads
}

/// The identifier `text` starts with, if it starts with one.
fn identifier(text: &str) -> Option<&str> {
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    let name = &text[..end];
    name.starts_with(|c: char| c.is_alphabetic() || c == '_')
        .then_some(name)
}

/// The longest a function of `src/` may be, from its `fn` line to its closing brace: a
/// longer one is split into named steps (docs/architecture.md). Declarative tables
/// would be named here as exceptions; there are none.
const LONGEST_FUNCTION: usize = 70;

#[test]
fn no_function_in_src_is_longer_than_the_limit() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut long = Vec::new();
    for file in rust_files(&src) {
        let text = std::fs::read_to_string(&file).unwrap();
        for (line, name, length) in function_lengths(&text) {
            if length > LONGEST_FUNCTION {
                long.push(format!("{}:{line} {name}: {length} lines", file.display()));
            }
        }
    }
    assert!(long.is_empty(), "over {LONGEST_FUNCTION} lines: {long:#?}");
}

#[test]
fn function_lengths_count_from_the_fn_line_to_the_closing_brace() {
    let text = "fn one() {\n    let s = \"}\"; // }\n}\n\npub async fn two(\n    a: u8,\n) -> u8 {\n    if a > 0 { a } else { 0 }\n}\nfn declared();\n";
    assert_eq!(
        function_lengths(text),
        [(1, "one".to_owned(), 3), (5, "two".to_owned(), 5)]
    );
}

/// Each function of `text`: the line of its `fn`, its name, and its length in lines.
/// Braces in string literals and in `//` comments are not counted; a declaration
/// without a body (a trait's) is left out.
fn function_lengths(text: &str) -> Vec<(usize, String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let Some(name) = fn_name(line) else { continue };
        let mut depth = 0i32;
        let mut opened = false;
        for (offset, body) in lines[start..].iter().enumerate() {
            let code = without_strings_and_comments(body);
            if !opened && code.contains(';') && !code.contains('{') {
                break; // no body
            }
            for c in code.chars() {
                match c {
                    '{' => (depth, opened) = (depth + 1, true),
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if opened && depth == 0 {
                found.push((start + 1, name.to_owned(), offset + 1));
                break;
            }
        }
    }
    found
}

/// The name of the function a line starts, if it starts one.
fn fn_name(line: &str) -> Option<&str> {
    let mut words = line.split_whitespace().peekable();
    while let Some(word) = words.next() {
        match word {
            "pub" | "async" | "const" | "unsafe" => continue,
            w if w.starts_with("pub(") => continue,
            "fn" => return words.next().and_then(identifier),
            _ => return None,
        }
    }
    None
}

/// `line` with string literals emptied and a trailing `//` comment cut.
fn without_strings_and_comments(line: &str) -> String {
    let mut code = String::new();
    let (mut in_string, mut escaped) = (false, false);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '/' if chars.peek() == Some(&'/') => break,
            _ => code.push(c),
        }
    }
    code
}

/// No file of `src/` imports itself through others: the graph of its files, where a file
/// names another by any `crate::`, `super::` or `self::` path (test code and comments
/// included, as above), has no cycle. A path is followed to the deepest file it reaches
/// (`crate::store::documents::transfer_id` names `store/documents.rs`, `super::Store` in
/// `store/entries.rs` names `store/mod.rs`); inside an inline module (`mod tests { use
/// super::*; }`) `super::` is the file itself. A parent naming a file beneath it (a
/// folder's `mod.rs`, or `lib.rs`, by a bare `entries::move_entries` or by a path like
/// `super::batch::X` in its inline `testing` module) is not an edge: that is how Rust
/// declares and re-exports a child, and every child names its parent back
/// (`super::StoreError`). Every other edge counts, between siblings, from a child to its
/// parent and across folders.
#[test]
fn the_files_import_one_another_without_a_cycle() {
    let graph = file_graph();
    // Edges inside a folder and across folders are both found.
    for (from, to) in [
        ("store/entries.rs", "store/mod.rs"),
        ("store/entries.rs", "store/guards.rs"),
        ("store/accounts.rs", "domain/mod.rs"),
    ] {
        assert!(
            graph[from].contains_key(to),
            "no edge {from} -> {to}: {graph:#?}"
        );
    }
    assert_no_cycle(&graph, "import cycle between files");
}

/// Every path's full module path, from the file's module (`[store, entries]`), with its
/// line; inline modules push their name, `super::` pops one, `self::` stays.
#[test]
fn the_path_reader_resolves_crate_super_and_self_paths() {
    let text = "use super::{Store, documents::{transfer_id, Doc}};
use crate::domain::{self, Amount};
let x = self::inner::f();
pub(super) fn g() {}
mod tests {
    use super::*;
    use super::super::guards::Amounts;
}
let y = crate :: metrics::hit();";
    let here = vec!["store".to_owned(), "entries".to_owned()];
    let read: Vec<(usize, String)> = module_paths(text, &here)
        .into_iter()
        .map(|(line, path)| (line, path.join("::")))
        .collect();
    assert_eq!(
        read,
        [
            (1, "store::Store".to_owned()),
            (1, "store::documents::Doc".into()),
            (1, "store::documents::transfer_id".into()),
            (2, "domain".into()),
            (2, "domain::Amount".into()),
            (3, "store::entries::inner::f".into()),
            (6, "store::entries".into()),
            (7, "store::guards::Amounts".into()),
            (9, "metrics::hit".into()),
        ]
    );
}

/// The file graph of `src/`: each file (`store/entries.rs`, `lib.rs`) and the files it names.
fn file_graph() -> Graph {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = root.join("src");
    let mut files: Vec<(String, Vec<String>, PathBuf)> = rust_files(&src)
        .into_iter()
        .filter(|f| f != &src.join("main.rs"))
        .map(|f| {
            let relative = f.strip_prefix(&src).unwrap();
            let node = relative.to_str().unwrap().replace('\\', "/");
            let mut module: Vec<String> = relative
                .with_extension("")
                .iter()
                .map(|s| s.to_str().unwrap().to_owned())
                .collect();
            if matches!(module.last().map(String::as_str), Some("mod" | "lib")) {
                module.pop();
            }
            (node, module, f)
        })
        .collect();
    files.sort();
    let by_module: BTreeMap<Vec<String>, String> = files
        .iter()
        .map(|(node, module, _)| (module.clone(), node.clone()))
        .collect();
    let mut graph: Graph = files
        .iter()
        .map(|(node, _, _)| (node.clone(), BTreeMap::new()))
        .collect();
    for (node, module, file) in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let shown = file.strip_prefix(root).unwrap().display().to_string();
        for (line, path) in module_paths(&text, module) {
            // The deepest prefix of the path that is a file of its own.
            let (reached, named) = (0..=path.len())
                .rev()
                .find_map(|k| by_module.get_key_value(&path[..k]))
                .unwrap();
            // A parent reaching its own children (`pub mod testing { pub use
            // super::batch::...; }` in `store/mod.rs`) declares or re-exports them.
            let below = reached.len() > module.len() && reached.starts_with(module);
            if named != node && !below {
                graph
                    .get_mut(node)
                    .unwrap()
                    .entry(named.clone())
                    .or_insert_with(|| format!("{shown}:{line}"));
            }
        }
    }
    graph
}

/// Each `crate::`, `super::` and `self::` path of `text`, a file of module `module`, as
/// the full module path it names (every leaf of a `{...}` group), with its line.
fn module_paths(text: &str, module: &[String]) -> Vec<(usize, Vec<String>)> {
    let line_of = |at: usize| text[..at].matches('\n').count() + 1;
    let inline = inline_modules(text);
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    let mut found = Vec::new();
    for keyword in ["crate", "super", "self"] {
        for (at, _) in text.match_indices(keyword) {
            let after = at + keyword.len();
            let before = text[..at].trim_end();
            if text[..at].ends_with(is_word)
                || text[..at].ends_with('$') && keyword != "crate"
                || text[after..].starts_with(is_word)
                || before.ends_with("::")
                || before.ends_with('{')
                || before.ends_with(',') && keyword == "self"
            {
                continue;
            }
            let Some(mut rest) = text[after..].trim_start().strip_prefix("::") else {
                continue;
            };
            let mut base: Vec<String> = match keyword {
                "crate" => Vec::new(),
                _ => {
                    let mut base = module.to_vec();
                    base.extend(inline(line_of(at)));
                    if keyword == "super" {
                        base.pop();
                    }
                    base
                }
            };
            if keyword != "crate" {
                // `super::super::`
                while let Some(more) = rest.trim_start().strip_prefix("super") {
                    let Some(more) = more.trim_start().strip_prefix("::") else {
                        break;
                    };
                    base.pop();
                    rest = more;
                }
            }
            let offset = text.len() - rest.len();
            for (at, path) in path_leaves(text, offset, base) {
                found.push((line_of(at), path));
            }
        }
    }
    found.sort();
    found
}

/// The paths that continue `base` from `text[at..]` (just after a `::`): `a::b` gives
/// `base::a::b`, `{a, b::{c, self}}` gives `base::a`, `base::b::c` and `base::b`; each
/// with the offset of its first segment.
fn path_leaves(text: &str, at: usize, base: Vec<String>) -> Vec<(usize, Vec<String>)> {
    let rest = &text[at..];
    let trimmed = rest.trim_start();
    let at = at + (rest.len() - trimmed.len());
    if let Some(group) = trimmed.strip_prefix('{') {
        let mut leaves = Vec::new();
        let mut depth = 0;
        let mut item = at + 1;
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth > 0 => depth -= 1,
                ',' | '}' if depth == 0 => {
                    if !text[item..at + 1 + i].trim().is_empty() {
                        leaves.extend(path_leaves(text, item, base.clone()));
                    }
                    if c == '}' {
                        break;
                    }
                    item = at + 1 + i + 1;
                }
                _ => {}
            }
        }
        return leaves;
    }
    let Some(name) = identifier(trimmed) else {
        // `*`, or the end of a `use a::b::{...}` head.
        return vec![(at, base)];
    };
    if name == "self" {
        return vec![(at, base)];
    }
    let mut path = base;
    path.push(name.to_owned());
    let after = trimmed[name.len()..].trim_start();
    match after.strip_prefix("::") {
        Some(more) => path_leaves(text, text.len() - more.len(), path),
        None => vec![(at, path)],
    }
}

/// For a line of `text`, the names of the inline modules (`mod tests { ... }`) it lies in.
fn inline_modules(text: &str) -> impl Fn(usize) -> Vec<String> {
    let mut on_line: Vec<Vec<String>> = vec![Vec::new()];
    let mut open: Vec<(String, i32)> = Vec::new();
    let mut depth = 0;
    for line in text.lines() {
        let code = without_strings_and_comments(line);
        let words: Vec<&str> = code
            .split_whitespace()
            .skip_while(|w| w.starts_with("#[") || *w == "pub" || w.starts_with("pub("))
            .collect();
        if words.first() == Some(&"mod") && code.contains('{') {
            let name = identifier(words.get(1).unwrap_or(&"")).unwrap_or("");
            open.push((name.to_owned(), depth));
        }
        on_line.push(open.iter().map(|(name, _)| name.clone()).collect());
        for c in code.chars() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
        }
        while open
            .last()
            .is_some_and(|(_, opened_at)| depth <= *opened_at)
        {
            open.pop();
        }
    }
    move |line| on_line.get(line).cloned().unwrap_or_default()
}

/// The types of `src/service/` and the files their `impl` blocks may live in (`mod.rs`
/// defines every part's struct, and the accessors of the composition): a file
/// holds one concern, and a concern's functions that another type needs (a hold's expiry,
/// which a step runs into; an interrupted reversal, which the sweeper finishes) are an
/// `impl` of that type in the concern's file. Every file of `src/service/` is listed, so
/// that a new one says which types it extends.
const SERVICE_FILES: &[(&str, &[&str])] = &[
    (
        "mod.rs",
        &[
            "TransferService",
            "Driver",
            "Requests",
            "AccountBook",
            "Recovery",
            "Feed",
            "WebhookBook",
        ],
    ),
    ("protocol.rs", &["Driver"]),
    ("protocol/parties.rs", &["Driver"]),
    ("driving.rs", &["Driver"]),
    ("unanswered.rs", &["Driver"]),
    ("routing.rs", &["Driver"]),
    ("readiness.rs", &["Driver"]),
    ("create.rs", &["Requests"]),
    ("idempotency.rs", &["Requests"]),
    ("admission.rs", &["Requests", "Recovery"]),
    ("cancel.rs", &["Requests", "Driver"]),
    ("holds.rs", &["Requests", "Driver"]),
    ("reads.rs", &["Requests", "Driver"]),
    ("tenancy.rs", &["Requests", "AccountBook"]),
    ("accounts.rs", &["AccountBook"]),
    ("ledger.rs", &["AccountBook"]),
    ("placement.rs", &["AccountBook"]),
    ("events.rs", &["Feed"]),
    ("follow.rs", &["Feed"]),
    ("webhooks.rs", &["WebhookBook"]),
    ("api_keys.rs", &["KeyBook"]),
    ("error.rs", &[]),
];

/// Which service type may hold or name which: the whole graph of their dependencies.
/// `TransferService` composes the parts and hands them out; `Requests` validates against
/// the account book and hands the steps to the driver; the sweeper's `Recovery` is the
/// driver and admission. The driver, the account book, the feed and the webhooks depend
/// on no other type.
const SERVICE_USES: &[(&str, &[&str])] = &[
    (
        "TransferService",
        &[
            "Requests",
            "Feed",
            "WebhookBook",
            "Driver",
            "AccountBook",
            "Recovery",
        ],
    ),
    ("Requests", &["Driver", "AccountBook"]),
    ("Recovery", &["Driver"]),
    ("Driver", &[]),
    ("AccountBook", &[]),
    ("Feed", &[]),
    ("WebhookBook", &[]),
    ("KeyBook", &[]),
];

/// The types of `src/service/` depend on one another exactly as [`SERVICE_USES`]
/// declares, without a cycle: a type uses another when a field of its struct (or of a
/// helper struct of its file) holds it, or when its `impl` blocks name it in code (a
/// parameter, a constructor, a path). Comments, `use` lines and the files' unit tests do
/// not count. Each `impl` of a service type lies in a file [`SERVICE_FILES`] lists for it,
/// and `TransferService`, which only composes, has no `async fn`: it does no work.
#[test]
fn the_service_types_use_one_another_as_declared_and_without_a_cycle() {
    let found = service_uses();
    let declared: Graph = SERVICE_USES
        .iter()
        .map(|(from, to)| {
            let to = to.iter().map(|t| (t.to_string(), String::new())).collect();
            (from.to_string(), to)
        })
        .collect();
    for (from, uses) in &found {
        for (to, at) in uses {
            assert!(
                declared[from].contains_key(to),
                "{at}: {from} uses {to}, which SERVICE_USES does not allow"
            );
        }
    }
    for (from, uses) in &declared {
        for to in uses.keys() {
            assert!(
                found[from].contains_key(to),
                "{from} -> {to} is declared but not found: the parser or the list is stale"
            );
        }
    }
    assert_no_cycle(&declared, "the service types use one another in a cycle");
}

/// `TransferService` composes the parts and configures them; anything that waits on a
/// database (an `async fn`) belongs to a part.
#[test]
fn the_composition_does_no_work() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/service/mod.rs");
    let text = std::fs::read_to_string(path).unwrap();
    let mut composing = false;
    for (number, line) in text.lines().enumerate() {
        if line.starts_with("impl") {
            composing = line == "impl TransferService {";
        }
        assert!(
            !(composing && line.contains("async fn")),
            "src/service/mod.rs:{}: TransferService works itself: {line}",
            number + 1
        );
    }
    assert!(
        text.contains("impl TransferService {"),
        "no impl TransferService found"
    );
}

/// Which service types each type uses, read from the code of `src/service/`, each with
/// the first place that shows it.
fn service_uses() -> Graph {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let service = root.join("src/service");
    let types: Vec<&str> = SERVICE_USES.iter().map(|(t, _)| *t).collect();
    let mut graph: Graph = types
        .iter()
        .map(|t| (t.to_string(), BTreeMap::new()))
        .collect();
    let files = rust_files(&service);
    for file in &files {
        let relative = file.strip_prefix(&service).unwrap().to_str().unwrap();
        let Some((_, allowed)) = SERVICE_FILES.iter().find(|(f, _)| *f == relative) else {
            panic!("src/service/{relative} is not in SERVICE_FILES: say which types it extends");
        };
        let text = std::fs::read_to_string(file).unwrap();
        let shown = file.strip_prefix(root).unwrap().display().to_string();
        for (number, owner, named) in service_names(&text, &types, allowed) {
            let at = format!("{shown}:{number}");
            assert!(
                allowed.contains(&owner.as_str()),
                "{at}: an impl of {owner}, which SERVICE_FILES does not list for this file"
            );
            if owner != named {
                graph.get_mut(&owner).unwrap().entry(named).or_insert(at);
            }
        }
    }
    graph
}

/// Each code line of a service file that names a service type: (its line, the type whose
/// `impl` or struct it is in, the type it names). The line that opens an `impl` block or
/// a struct of a service type names that type itself. Outside those, a line counts for
/// every type of `allowed` (a helper struct or a free function serves its file's types).
fn service_names(text: &str, types: &[&str], allowed: &[&str]) -> Vec<(usize, String, String)> {
    let mut found = Vec::new();
    let mut inside: Option<String> = None;
    let mut in_tests = false;
    for (number, line) in text.lines().enumerate() {
        if line.starts_with("mod tests {") {
            in_tests = true;
        }
        if line == "}" {
            (inside, in_tests) = (None, false);
            continue;
        }
        if in_tests {
            continue;
        }
        let code = without_strings_and_comments(line);
        if let Some(owner) = block_owner(&code, types) {
            if code.trim_end().ends_with('{') {
                inside = Some(owner);
            }
        }
        if code.trim_start().starts_with("use ") || code.trim_start().starts_with("pub use ") {
            continue;
        }
        let owners: Vec<String> = match &inside {
            Some(owner) => vec![owner.clone()],
            None => allowed.iter().map(|t| t.to_string()).collect(),
        };
        for named in words(&code).filter(|w| types.contains(w)) {
            for owner in &owners {
                found.push((number + 1, owner.clone(), named.to_owned()));
            }
        }
    }
    found
}

/// The service type a top-level `impl` block or struct definition on this line is of:
/// `impl Driver {`, `impl<T> Trait for Driver {`, `pub struct Driver {`.
fn block_owner(code: &str, types: &[&str]) -> Option<String> {
    let head = if let Some(rest) = code.strip_prefix("impl") {
        match rest.rsplit_once(" for ") {
            Some((_, of)) => of,
            None => rest.trim_start_matches(|c: char| c != ' ' && c != '{'),
        }
    } else if let Some(rest) = code.split_once("struct ") {
        if !(code.starts_with("pub ") || code.starts_with("struct ")) {
            return None;
        }
        rest.1
    } else {
        return None;
    };
    let name = words(head).next()?;
    types.contains(&name).then(|| name.to_owned())
}

fn words(code: &str) -> impl Iterator<Item = &str> {
    code.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
}

/// The parts of the service that background tasks take hold only what they use: the
/// webhook deliverer holds the feed and the webhooks (never the requests, the driver or
/// the whole service), the sweeper its `Recovery` (the driver and admission).
#[test]
fn the_deliverer_and_the_sweeper_hold_only_their_parts() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let rules: &[(&str, &[&str])] = &[
        (
            "deliverer",
            &[
                "TransferService",
                "Requests",
                "Driver",
                "AccountBook",
                "Recovery",
            ],
        ),
        (
            "sweeper.rs",
            &[
                "TransferService",
                "Requests",
                "AccountBook",
                "Feed",
                "WebhookBook",
            ],
        ),
    ];
    for (module, forbidden) in rules {
        for file in rust_files(&src.join(module)) {
            let text = std::fs::read_to_string(&file).unwrap();
            for (number, line) in text.lines().enumerate() {
                let code = without_strings_and_comments(line);
                if let Some(named) = words(&code).find(|w| forbidden.contains(w)) {
                    panic!("{}:{} holds {named}: {line}", file.display(), number + 1);
                }
            }
        }
    }
}

/// The reader of service types sees a field that holds a type, a parameter or a path that
/// names one in an `impl`, and a helper of a file serving its file's types; not a
/// comment, a doc link, a `use` line or the file's unit tests.
#[test]
fn the_service_reader_sees_fields_and_code_but_not_comments_uses_or_tests() {
    let text = r#"
use super::{Driver, Feed};

/// Holds the [`Feed`] only in this comment.
pub struct Requests {
    driver: Driver,
}

impl Requests {
    fn feed(&self, feed: &Feed) {} // and a Driver here is a comment
}

struct Helper {
    book: AccountBook,
}

#[cfg(test)]
mod tests {
    fn f(_: Recovery) {}
}

fn after_the_tests(_: Recovery) {}
"#;
    let types = ["Requests", "Driver", "Feed", "AccountBook", "Recovery"];
    let found = service_names(text, &types, &["Requests"]);
    let expected: Vec<(usize, String, String)> = [
        (5, "Requests", "Requests"),
        (6, "Requests", "Driver"),
        (9, "Requests", "Requests"),
        (10, "Requests", "Feed"),
        (14, "Requests", "AccountBook"),
        (22, "Requests", "Recovery"),
    ]
    .into_iter()
    .map(|(line, owner, named)| (line, owner.to_owned(), named.to_owned()))
    .collect();
    assert_eq!(found, expected);
}

/// The store's types (`src/store/mod.rs` says what each owns): the per-deployment handle,
/// the views it hands out, each over its own collections, and the types that hold stores
/// or handles beside them. Each name with the constructor `Store` gives it by, if any.
const STORE_TYPES: &[(&str, Option<&str>)] = &[
    ("Store", None),
    ("Clock", None),
    ("Accounts", Some("accounts")),
    ("Transfers", Some("transfers")),
    ("Entries", Some("entries")),
    ("Events", Some("events")),
    ("Webhooks", Some("webhooks")),
    ("Atomic", Some("atomic")),
    ("Directory", Some("directory")),
    ("Deployments", None),
    ("ApiKeyStore", None),
];

/// What `Store` itself may do: connect, say which deployment and instance it is, its
/// health (ping, answering, migrated), the database's clock, the migrations, and hand out
/// its views. Anything that reads or writes a collection's documents belongs to a view.
const STORE_METHODS: &[&str] = &[
    "connect",
    "connect_with",
    "connect_observed",
    "new",
    "named",
    "instance_id",
    "deployment",
    "database",
    "clock",
    "is_answering",
    "set_migrated",
    "check_answering",
    "set_answering",
    "ping",
    "server_time",
    "server_time_lower_bound",
    "deadline_on",
    "migrate",
    "accounts",
    "transfers",
    "entries",
    "events",
    "webhooks",
    "atomic",
    "directory",
];

/// The `impl` blocks of one file: (line, the type it implements, whether it is inherent,
/// its code lines with strings and comments removed). Only blocks opened at the start of
/// a line (the file's top level) count.
fn impl_blocks(text: &str) -> Vec<(usize, String, bool, Vec<String>)> {
    let mut blocks = Vec::new();
    let mut open: Option<(usize, String, bool, Vec<String>)> = None;
    for (i, raw) in text.lines().enumerate() {
        let code = without_strings_and_comments(raw);
        if let Some(block) = open.as_mut() {
            if code.starts_with('}') {
                blocks.push(open.take().unwrap());
            } else {
                block.3.push(code);
            }
            continue;
        }
        if let Some((name, inherent)) = impl_type(&code) {
            open = Some((i + 1, name, inherent, Vec::new()));
        }
    }
    blocks
}

/// The type an `impl` header implements (`impl<'a> From<&'a X> for Y<'a> {`: `Y`), and
/// whether the block is inherent (no trait).
fn impl_type(code: &str) -> Option<(String, bool)> {
    let rest = code.strip_prefix("impl")?;
    if !(rest.starts_with(' ') || rest.starts_with('<')) {
        return None;
    }
    // Skip the generics of `impl<...>`, nesting included.
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in rest.char_indices() {
        match c {
            '<' => depth += 1,
            '>' => depth -= 1,
            ' ' if depth == 0 => {
                start = i;
                break;
            }
            _ => {}
        }
    }
    let header = rest[start..].trim().trim_end_matches('{').trim();
    let (target, inherent) = match header.rsplit_once(" for ") {
        Some((_, target)) => (target, false),
        None => (header, true),
    };
    let name = target.split(['<', ' ']).next()?.rsplit("::").next()?;
    Some((name.to_owned(), inherent))
}

/// The names a file of `src/store/` declares at its top level (struct, enum, trait, type).
fn declared_types(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    for line in text.lines() {
        let line = line
            .trim_start_matches("pub(crate) ")
            .trim_start_matches("pub(super) ");
        let line = line.trim_start_matches("pub ");
        for keyword in ["struct ", "enum ", "trait ", "type "] {
            if let Some(rest) = line.strip_prefix(keyword) {
                if let Some(name) = identifier(rest) {
                    names.push(name.to_owned());
                }
            }
        }
    }
    names
}

/// Every `impl` block of `src/store/*.rs` belongs to one type `src/store/` declares, and
/// a type's own methods (its inherent blocks) are all in one file: not spread over files,
/// as `Store`'s 127 once were over seven. And `Store` keeps only what its handle is for
/// (`STORE_METHODS`): a method that reads or writes documents goes to the view of its
/// collection.
#[test]
fn each_impl_block_of_the_store_belongs_to_one_declared_type() {
    let store = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/store");
    let texts: Vec<(String, String)> = rust_files(&store)
        .into_iter()
        .map(|f| {
            let shown = f.file_name().unwrap().to_str().unwrap().to_owned();
            (shown, std::fs::read_to_string(&f).unwrap())
        })
        .collect();
    let declared: Vec<String> = texts.iter().flat_map(|(_, t)| declared_types(t)).collect();
    let mut files_of: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    let mut store_methods = Vec::new();
    for (shown, text) in &texts {
        for (line, name, inherent, body) in impl_blocks(text) {
            assert!(
                declared.contains(&name),
                "{shown}:{line}: `impl {name}`, a type src/store/ does not declare"
            );
            if inherent {
                files_of
                    .entry(name.clone())
                    .or_default()
                    .entry(shown.clone())
                    .or_insert(line);
            }
            if name == "Store" {
                store_methods.extend(body.iter().filter_map(|l| fn_name(l).map(str::to_owned)));
            }
        }
    }
    for (name, files) in &files_of {
        assert!(
            files.len() == 1,
            "the methods of {name} are spread over {files:?}: one type, one file"
        );
    }
    for method in &store_methods {
        assert!(
            STORE_METHODS.contains(&method.as_str()),
            "Store::{method} is not connection, health, clock, migrations or a view: move it to the view of the collection it touches"
        );
    }
    assert!(
        store_methods.len() >= STORE_METHODS.len() - 1,
        "{store_methods:?}"
    );
}

/// The calls between the store's types (`STORE_TYPES`): an edge from a type to another
/// whose name its `impl` blocks write (`Accounts { .. }`, `Clock<'_>`), or whose view they
/// ask a store for (`.accounts()`), with the first place that does.
fn store_type_graph(files: &[(String, String)]) -> Graph {
    let mut graph: Graph = STORE_TYPES
        .iter()
        .map(|(name, _)| (name.to_string(), BTreeMap::new()))
        .collect();
    for (shown, text) in files {
        for (line, name, _, body) in impl_blocks(text) {
            if !graph.contains_key(&name) {
                continue;
            }
            for (offset, code) in body.iter().enumerate() {
                for (other, constructor) in STORE_TYPES {
                    let by_name = code
                        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                        .any(|word| word == *other);
                    let by_view = constructor.is_some_and(|c| code.contains(&format!(".{c}()")));
                    if (by_name || by_view) && *other != name {
                        graph
                            .get_mut(&name)
                            .unwrap()
                            .entry(other.to_string())
                            .or_insert_with(|| format!("{shown}:{}", line + 1 + offset));
                    }
                }
            }
        }
    }
    graph
}

/// The store's types call one another without a cycle: `Store` hands out the views, a
/// view uses only its own collections and the shared pieces (`Clock`), and never asks
/// for another view or for the `Store` it came from. A cycle fails spelled out, with the
/// line behind each edge.
#[test]
fn the_stores_types_call_one_another_without_a_cycle() {
    let store = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/store");
    let files: Vec<(String, String)> = rust_files(&store)
        .into_iter()
        .map(|f| {
            let shown = format!("src/store/{}", f.file_name().unwrap().to_str().unwrap());
            (shown, std::fs::read_to_string(&f).unwrap())
        })
        .collect();
    let graph = store_type_graph(&files);
    assert!(
        graph["Store"].contains_key("Accounts") && graph["Deployments"].contains_key("Directory"),
        "the parser no longer sees the views the store hands out: {graph:?}"
    );
    assert_no_cycle(&graph, "the store's types call one another in a cycle");
}

/// The parser of the store's types sees an `impl` header through its generics and its
/// trait, and an edge through a view asked for or a type named; a view asking for the
/// one that asks for it is a cycle.
#[test]
fn the_store_type_parser_finds_impl_blocks_and_the_views_they_ask_for() {
    assert_eq!(
        impl_type("impl Accounts<'_> {"),
        Some(("Accounts".into(), true))
    );
    assert_eq!(
        impl_type("impl<'a> From<&'a Account> for super::AccountDoc {"),
        Some(("AccountDoc".into(), false))
    );
    assert_eq!(impl_type("implied {"), None);
    let text = "impl Accounts<'_> {\n    fn a(self) { store.transfers().claim(); }\n}\n\
                impl Transfers<'_> {\n    fn b(self) -> Accounts<'_> { todo!() }\n}\n";
    let graph = store_type_graph(&[("x.rs".into(), text.into())]);
    assert_eq!(graph["Accounts"]["Transfers"], "x.rs:2");
    assert_eq!(graph["Transfers"]["Accounts"], "x.rs:5");
    assert!(find_cycle(&graph).is_some());
}
