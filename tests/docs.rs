//! Every relative link in the project's Markdown leads somewhere: the README, every `*.md`
//! at the top level, and every `*.md` under `docs/`, `migrations/` and `openapi/`.
//!
//! The files are parsed as Markdown (pulldown-cmark), so a link inside a code block or a
//! code span is text, not a link. A link (or image) that names no scheme (`https:`,
//! `mailto:`, ...) must reach an existing file or folder, relative to the linking file
//! (or to the repository's root when it starts with `/`). When it carries a `#fragment`
//! and reaches a Markdown file (or is a `#fragment` alone, in the same file), that file
//! must have a heading whose GitHub anchor is the fragment. Raw HTML links are not
//! checked. No database: a moved section or a renamed heading fails here, with every dead
//! link listed as `file: link`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use pulldown_cmark::{Event, LinkType, Options, Parser, Tag, TagEnd};

/// Folders whose Markdown files, at any depth, are checked beside the top level's.
const FOLDERS: &[&str] = &["docs", "migrations", "openapi"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// What a Markdown file offers and asks for.
#[derive(Debug, Default)]
struct Page {
    /// Destinations of its links and images, in order, as written.
    links: Vec<String>,
    /// The anchors GitHub gives its headings, in order.
    anchors: Vec<String>,
}

/// The extensions GitHub renders; a table cell's or a footnote's link is a link too.
fn options() -> Options {
    Options::ENABLE_TABLES
        | Options::ENABLE_FOOTNOTES
        | Options::ENABLE_STRIKETHROUGH
        | Options::ENABLE_TASKLISTS
}

fn parse(text: &str) -> Page {
    let mut page = Page::default();
    let mut seen = HashMap::new();
    // The text of the heading being read, while inside one.
    let mut heading: Option<String> = None;
    for event in Parser::new_ext(text, options()) {
        match event {
            // `<someone@example.com>` is a mail link written without its scheme: not a file.
            Event::Start(Tag::Link {
                link_type,
                dest_url,
                ..
            })
            | Event::Start(Tag::Image {
                link_type,
                dest_url,
                ..
            }) if link_type != LinkType::Email => page.links.push(dest_url.into_string()),
            Event::Start(Tag::Heading { .. }) => heading = Some(String::new()),
            Event::Text(text) | Event::Code(text) => {
                if let Some(heading) = heading.as_mut() {
                    heading.push_str(&text);
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                if let Some(text) = heading.take() {
                    page.anchors.push(unique(slug(&text), &mut seen));
                }
            }
            _ => {}
        }
    }
    page
}

/// GitHub's anchor for a heading's text: lowercase, each space a `-`, every other
/// character that is not a letter, a digit, `-` or `_` dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .chars()
        .flat_map(char::to_lowercase)
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The second heading with the same anchor gets `-1`, the third `-2`, and so on
/// (github-slugger's rule, which also skips an anchor an earlier heading already took).
fn unique(slug: String, seen: &mut HashMap<String, usize>) -> String {
    let mut anchor = slug.clone();
    while seen.contains_key(&anchor) {
        let count = seen.get_mut(&slug).expect("the plain slug was seen first");
        *count += 1;
        anchor = format!("{slug}-{count}");
    }
    seen.insert(anchor.clone(), 0);
    anchor
}

/// `https:`, `mailto:` and every other scheme: not a file of this repository.
fn has_scheme(link: &str) -> bool {
    match link.split_once(':') {
        Some((scheme, _)) => {
            let mut chars = scheme.chars();
            chars.next().is_some_and(|c| c.is_ascii_alphabetic())
                && chars.all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
        }
        None => false,
    }
}

/// `%20` and the like, as a browser decodes them before asking for the file or anchor.
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn is_markdown(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "md")
}

/// The Markdown files this test reads: the top level's and those under [`FOLDERS`].
fn markdown_files(root: &Path) -> Vec<PathBuf> {
    fn walk(folder: &Path, files: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(folder).expect("read a folder of Markdown files") {
            let path = entry.expect("a folder entry").path();
            if path.is_dir() {
                walk(&path, files);
            } else if is_markdown(&path) {
                files.push(path);
            }
        }
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(root).expect("read the repository's root") {
        let path = entry.expect("a folder entry").path();
        if path.is_file() && is_markdown(&path) {
            files.push(path);
        }
    }
    for folder in FOLDERS {
        let folder = root.join(folder);
        if folder.is_dir() {
            walk(&folder, &mut files);
        }
    }
    files.sort();
    files
}

/// Every dead link of `files`, as (file relative to `root`, link as written).
fn dead_links(root: &Path, files: &[PathBuf]) -> Vec<(String, String)> {
    let mut pages: BTreeMap<PathBuf, Page> = BTreeMap::new();
    let mut page_of = |path: &Path| -> Option<Vec<String>> {
        let path = path.canonicalize().ok()?;
        if !pages.contains_key(&path) {
            let text = std::fs::read_to_string(&path).ok()?;
            pages.insert(path.clone(), parse(&text));
        }
        Some(pages[&path].anchors.clone())
    };
    let mut dead = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(file).expect("read a Markdown file");
        let name = file
            .strip_prefix(root)
            .unwrap_or(file)
            .display()
            .to_string();
        for link in parse(&text).links {
            if has_scheme(&link) {
                continue;
            }
            let (path, fragment) = match link.split_once('#') {
                Some((path, fragment)) => (path, Some(fragment)),
                None => (link.as_str(), None),
            };
            let path = path.split('?').next().unwrap_or_default();
            let target = if path.is_empty() {
                file.clone()
            } else if let Some(from_root) = path.strip_prefix('/') {
                root.join(percent_decoded(from_root))
            } else {
                file.parent()
                    .expect("a file has a folder")
                    .join(percent_decoded(path))
            };
            if !target.exists() {
                dead.push((name.clone(), link.clone()));
                continue;
            }
            // A folder's anchors are its README's, as GitHub shows it.
            let target = if target.is_dir() {
                target.join("README.md")
            } else {
                target
            };
            let Some(fragment) = fragment.filter(|f| !f.is_empty()) else {
                continue;
            };
            if !is_markdown(&target) {
                continue; // `#L10` of a source file, say: GitHub's, not the file's.
            }
            let found = page_of(&target)
                .is_some_and(|anchors| anchors.contains(&percent_decoded(fragment)));
            if !found {
                dead.push((name.clone(), link.clone()));
            }
        }
    }
    dead
}

#[test]
fn every_relative_link_in_the_markdown_leads_to_a_file_and_heading_that_exist() {
    let root = root();
    let files = markdown_files(&root);
    // The check cannot pass by reading nothing.
    for expected in ["README.md", "docs/api.md", "docs/protocol.md"] {
        assert!(
            files.contains(&root.join(expected)),
            "{expected} is not among the files read: {files:?}"
        );
    }
    let dead = dead_links(&root, &files);
    let list: Vec<String> = dead
        .iter()
        .map(|(file, link)| format!("{file}: {link}"))
        .collect();
    assert!(
        dead.is_empty(),
        "{} dead links (file: link):\n{}",
        dead.len(),
        list.join("\n")
    );
}

#[test]
fn links_in_code_are_text_and_headings_get_githubs_anchors() {
    let page = parse(concat!(
        "# Third way: `docker compose up`\n",
        "## Group commit: one statement per batch (`src/store/batch.rs`)\n",
        "## Overload\n",
        "## Overload\n",
        "## Overload-1\n",
        "## Ünïcode & snake_case — too\n",
        "```sh\n[not a link](missing.md)\n```\n",
        "    [indented code](missing.md)\n\n",
        "`[a code span](missing.md)` and [a link](present.md#overload-1 \"title\")\n\n",
        "| a | b |\n|---|---|\n| [in a table](table.md) | ![an image](plot.svg) |\n\n",
        "<someone@example.com> <https://example.com>\n",
    ));
    assert_eq!(
        page.anchors,
        [
            "third-way-docker-compose-up",
            "group-commit-one-statement-per-batch-srcstorebatchrs",
            "overload",
            "overload-1",
            "overload-1-1",
            "ünïcode--snake_case--too",
        ]
    );
    assert_eq!(
        page.links,
        [
            "present.md#overload-1",
            "table.md",
            "plot.svg",
            "https://example.com"
        ]
    );
}

#[test]
fn schemes_are_not_files_and_escapes_are_decoded() {
    for external in [
        "https://example.com/a.md",
        "http://x",
        "mailto:a@b.c",
        "ftp:x",
    ] {
        assert!(has_scheme(external), "{external}");
    }
    for relative in [
        "docs/api.md",
        "../README.md#configuration",
        "#overload",
        "a.md#x:y",
    ] {
        assert!(!has_scheme(relative), "{relative}");
    }
    assert_eq!(percent_decoded("a%20b%2"), "a b%2");
}
