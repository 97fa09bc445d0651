//! The book (`book/`, mdBook) and the README hold together: every chapter is in `SUMMARY.md`
//! and every entry of it exists; every relative link of a chapter or of the README reaches a
//! file inside the repository (a chapter's, inside `book/src`), and its `#anchor` a heading of
//! that file (mdBook's ids); every `{{#include path:anchor}}` names an existing file and anchor
//! (so the included Rust, compiled and run by the `book_*` tests, cannot silently vanish); the
//! README's example is byte for byte the anchored region of the compiled quick start; the quick
//! start's Cargo lines are the workspace's; the README stays a landing page (at most 250 lines)
//! and neither text points outside the repository. Std only, no Markdown parser: the book's
//! Markdown is plain enough.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `.md` file under `dir`, sorted.
fn markdown_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// `path` with `.` and `..` resolved lexically (the files may not exist).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// The lines of `text` outside fenced code blocks, with their 1-based numbers.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// `line` without its inline code spans.
fn without_code(line: &str) -> String {
    let mut out = String::new();
    let mut parts = line.split('`');
    while let Some(text) = parts.next() {
        out.push_str(text);
        parts.next(); // the code span
    }
    out
}

/// The targets of the inline links `[text](target)` of `text`'s prose, with their lines. A link
/// may wrap: its text continues on the next line, so the lines of a paragraph are joined.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let lines = prose(text);
    for (k, (number, line)) in lines.iter().enumerate() {
        // The line and the start of the next one, so that a `](` split by a wrap is found on
        // the line where it starts.
        let line = without_code(line);
        let next = lines
            .get(k + 1)
            .map(|(_, l)| without_code(l))
            .unwrap_or_default();
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let target = match after.find(')') {
                Some(end) => after[..end].to_string(),
                None => {
                    let tail = next.split(')').next().unwrap_or_default();
                    format!("{after}{tail}")
                }
            };
            out.push((*number, target.trim().to_string()));
            rest = after;
        }
    }
    out
}

/// mdBook's id of a heading: its text (code spans and link targets dropped), lowercase, spaces
/// to `-`, only alphanumerics, `-` and `_` kept; a repeated id gets `-1`, `-2`, ...
fn heading_ids(text: &str) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for (_, line) in prose(text) {
        let Some(heading) = line.trim_start().strip_prefix('#') else {
            continue;
        };
        let heading = heading.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        // `[text](target)` renders as `text`.
        let mut plain = String::new();
        let mut rest = heading.trim().replace('`', "");
        while let Some(at) = rest.find("](") {
            let end = rest[at..].find(')').map_or(rest.len(), |e| at + e + 1);
            plain.push_str(&rest[..at]);
            rest = rest[end..].to_string();
        }
        plain.push_str(&rest);
        let id: String = plain
            .chars()
            .filter_map(|c| match c {
                c if c.is_alphanumeric() || c == '_' || c == '-' => Some(c.to_ascii_lowercase()),
                c if c.is_whitespace() => Some('-'),
                _ => None,
            })
            .collect();
        let n = seen.entry(id.clone()).or_insert(0);
        ids.insert(match *n {
            0 => id,
            k => format!("{id}-{k}"),
        });
        *n += 1;
    }
    ids
}

/// The `{{#include path[:anchor]}}` directives of `text`: (line, path, anchor).
fn includes(text: &str) -> Vec<(usize, String, Option<String>)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let mut rest = line;
        while let Some(at) = rest.find("{{#include ") {
            let after = &rest[at + "{{#include ".len()..];
            let end = after.find("}}").expect("a closed include");
            let spec = after[..end].trim();
            let (path, anchor) = match spec.split_once(':') {
                Some((path, anchor)) => (path, Some(anchor.to_string())),
                None => (spec, None),
            };
            out.push((i + 1, path.to_string(), anchor));
            rest = &after[end..];
        }
    }
    out
}

/// The lines strictly between `ANCHOR: name` and `ANCHOR_END: name` of `text`, without the
/// other anchors' lines (as mdBook includes them); `None` when the anchor is not there.
fn anchored(text: &str, name: &str) -> Option<String> {
    let is = |line: &str, word: &str| {
        line.trim()
            .trim_start_matches("//")
            .trim()
            .strip_prefix(word)
            .is_some_and(|n| n.trim() == name)
    };
    let start = text.lines().position(|l| is(l, "ANCHOR:"))?;
    let len = text
        .lines()
        .skip(start + 1)
        .position(|l| is(l, "ANCHOR_END:"))?;
    let region: Vec<&str> = text
        .lines()
        .skip(start + 1)
        .take(len)
        .filter(|l| !l.contains("ANCHOR:") && !l.contains("ANCHOR_END:"))
        .collect();
    Some(region.join("\n") + "\n")
}

/// Checks the relative link `target` of `from` (inside `within`); returns the failure.
fn check_link(from: &Path, target: &str, within: &Path) -> Option<String> {
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (file, anchor) = match target.split_once('#') {
        Some((file, anchor)) => (file, Some(anchor)),
        None => (target, None),
    };
    let path = match file {
        "" => from.to_path_buf(),
        file => normalize(&from.parent().expect("a folder").join(file)),
    };
    if !path.starts_with(within) {
        return Some(format!("{target}: outside {}", within.display()));
    }
    if !path.exists() {
        return Some(format!("{target}: no such file"));
    }
    let anchor = anchor?;
    if path.extension().is_none_or(|e| e != "md") {
        return Some(format!(
            "{target}: an anchor into a file that is not a chapter"
        ));
    }
    match heading_ids(&read(&path)).contains(anchor) {
        true => None,
        false => Some(format!("{target}: no heading with the id `{anchor}`")),
    }
}

#[test]
fn the_summary_lists_every_chapter_and_every_entry_exists() {
    let src = root().join("book/src");
    let summary = read(&src.join("SUMMARY.md"));
    let listed: BTreeSet<PathBuf> = links(&summary)
        .into_iter()
        .map(|(_, target)| normalize(&src.join(target)))
        .collect();
    let mut failures = Vec::new();
    for path in &listed {
        if !path.exists() {
            failures.push(format!(
                "SUMMARY.md lists {}, which does not exist",
                path.display()
            ));
        }
    }
    for path in markdown_files(&src) {
        if path.file_name().is_some_and(|n| n != "SUMMARY.md") && !listed.contains(&path) {
            failures.push(format!("{} is not in SUMMARY.md", path.display()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(listed.len() >= 20, "the chapters were found: {listed:?}");
}

#[test]
fn every_link_of_the_book_reaches_a_chapter_and_a_heading() {
    let src = root().join("book/src");
    let mut failures = Vec::new();
    let mut count = 0;
    for path in markdown_files(&src) {
        for (line, target) in links(&read(&path)) {
            count += 1;
            if let Some(failure) = check_link(&path, &target, &src) {
                failures.push(format!("{}:{line}: {failure}", path.display()));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(count >= 50, "the links were found ({count})");
}

#[test]
fn every_include_of_the_book_names_a_file_and_an_anchor() {
    let src = root().join("book/src");
    let mut failures = Vec::new();
    let mut count = 0;
    for path in markdown_files(&src) {
        for (line, file, anchor) in includes(&read(&path)) {
            count += 1;
            let target = normalize(&path.parent().expect("a folder").join(&file));
            let at = format!("{}:{line}: {{{{#include {file}}}}}", path.display());
            if !target.starts_with(root()) || !target.is_file() {
                failures.push(format!("{at}: no such file in the repository"));
                continue;
            }
            // A line range (`file:10:20`) is not an anchor; the book uses anchors only.
            if let Some(anchor) = anchor {
                match anchored(&read(&target), &anchor) {
                    Some(region) if !region.trim().is_empty() => {}
                    _ => failures.push(format!("{at}: no anchor `{anchor}` with a body")),
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(count >= 8, "the includes were found ({count})");
}

#[test]
fn the_readme_links_resolve_and_stay_in_the_repository() {
    let root = root();
    let readme_path = root.join("README.md");
    let readme = read(&readme_path);
    let mut failures = Vec::new();
    let mut into_book = 0;
    for (line, target) in links(&readme) {
        into_book += usize::from(target.starts_with("book/src/"));
        if let Some(failure) = check_link(&readme_path, &target, &root) {
            failures.push(format!("README.md:{line}: {failure}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        into_book >= 20,
        "the links into the book were found ({into_book})"
    );
    let lines = readme.lines().count();
    assert!(
        lines <= 250,
        "the README is a landing page of at most 250 lines, not {lines}"
    );
}

#[test]
fn no_text_points_outside_the_repository() {
    let root = root();
    let mut texts = vec![root.join("README.md")];
    texts.extend(markdown_files(&root.join("book/src")));
    let mut failures = Vec::new();
    for path in texts {
        for (i, line) in read(&path).lines().enumerate() {
            for outside in ["../shared", ".gpu/"] {
                if line.contains(outside) {
                    failures.push(format!("{}:{}: {line}", path.display(), i + 1));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The README's example is the compiled quick start's `byo` region, so it cannot rot.
#[test]
fn the_readme_example_is_the_compiled_quick_start() {
    let readme = read(&root().join("README.md"));
    let start = readme.find("```rust\n").expect("the README's Rust example") + "```rust\n".len();
    let end = start + readme[start..].find("```").expect("a closed block");
    let source = read(&root().join("tests/book/quickstart.rs"));
    let region = anchored(&source, "byo").expect("the `byo` anchor of the quick start");
    assert_eq!(
        &readme[start..end],
        region,
        "the README's example differs from tests/book/quickstart.rs's `byo` region: copy it"
    );
    assert_eq!(
        readme.matches("```rust").count(),
        1,
        "the README's only Rust is the checked example"
    );
}

/// The quick start's Cargo lines are the workspace's: Burn's version and features, the edition
/// and the Rust version.
#[test]
fn the_quick_start_cargo_lines_are_the_workspace_s() {
    let manifest = read(&root().join("Cargo.toml"));
    let chapter = read(&root().join("book/src/quickstart.md"));
    let start = chapter.find("```toml\n").expect("the Cargo.toml block") + "```toml\n".len();
    let block = &chapter[start..start + chapter[start..].find("```").expect("a closed block")];
    let line = |text: &str, key: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{key} = ")))
            .unwrap_or_else(|| panic!("no `{key} = ` line"))
            .to_string()
    };
    for key in ["burn", "edition", "rust-version"] {
        assert_eq!(
            line(block, key),
            line(&manifest, key),
            "the quick start's `{key}`"
        );
    }
    for krate in [
        "burn-parallel",
        "burn-zero",
        "burn-moe",
        "burn-parallel-train",
    ] {
        let dep = line(block, krate);
        let path = dep.split('"').nth(1).expect("a path");
        let in_repo = path
            .strip_prefix("../burn-parallel/")
            .expect("a path into the clone beside the project");
        assert!(root().join(in_repo).join("Cargo.toml").is_file(), "{dep}");
    }
}
