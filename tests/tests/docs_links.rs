//! The book (`docs/`) and the READMEs hold no broken link: every relative link names a file that
//! exists, every `#anchor` a heading of that page (as mdBook spells heading ids), every chapter
//! is listed in `docs/src/SUMMARY.md`, and every `{{#include}}` names a file with the lines it
//! takes. External links (`http…`) are not fetched.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The pages checked: every Markdown file of the book, and the READMEs a reader starts from.
fn pages() -> Vec<PathBuf> {
    let mut pages = Vec::new();
    let mut dirs = vec![root().join("docs/src")];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).expect("docs/src is readable") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                pages.push(path);
            }
        }
    }
    pages.push(root().join("README.md"));
    for entry in fs::read_dir(root().join("crates")).expect("crates/ is readable") {
        let readme = entry.expect("an entry").path().join("README.md");
        if readme.is_file() {
            pages.push(readme);
        }
    }
    pages.sort();
    pages
}

/// `text` with every `{{#include PATH[:FROM[:TO]]}}` replaced by those lines of `PATH` (relative
/// to `dir`), as mdBook includes them; an include of a missing file or of no lines is an error.
fn expand_includes(text: &str, dir: &Path, page: &Path, problems: &mut Vec<String>) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("{{#include ") {
        out.push_str(&rest[..at]);
        let Some(end) = rest[at..].find("}}") else { break };
        let spec = rest[at + "{{#include ".len()..at + end].trim();
        let mut parts = spec.split(':');
        let file = dir.join(parts.next().unwrap_or_default());
        let from = parts.next().and_then(|n| n.parse::<usize>().ok()).unwrap_or(1);
        let to = parts.next().and_then(|n| n.parse::<usize>().ok());
        match fs::read_to_string(&file) {
            Ok(included) => {
                let lines: Vec<&str> = included.lines().collect();
                let to = to.unwrap_or(lines.len()).min(lines.len());
                if from == 0 || from > to {
                    problems.push(format!("{}: `{spec}` takes no lines", page.display()));
                } else {
                    out.push_str(&lines[from - 1..to].join("\n"));
                }
            }
            Err(e) => problems.push(format!("{}: `{spec}`: {e}", page.display())),
        }
        rest = &rest[at + end + 2..];
    }
    out.push_str(rest);
    out
}

/// The page's lines outside fenced code blocks.
fn outside_fences(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut fence: Option<String> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        let marker: String = trimmed.chars().take_while(|&c| c == '`' || c == '~').collect();
        if marker.len() >= 3 {
            match &fence {
                None => fence = Some(marker),
                Some(open) if marker.starts_with(open.as_str()) && trimmed[marker.len()..].trim().is_empty() => {
                    fence = None;
                }
                Some(_) => {}
            }
            continue;
        }
        if fence.is_none() {
            out.push(line);
        }
    }
    out
}

/// The page's text outside fenced code blocks and inline code (which never holds a link).
fn prose(text: &str) -> String {
    let mut out = String::new();
    for line in outside_fences(text) {
        for (i, piece) in line.split('`').enumerate() {
            if i % 2 == 0 {
                out.push_str(piece);
            }
        }
        out.push('\n');
    }
    out
}

/// mdBook's id of a heading: lower case, spaces to `-`, other punctuation dropped.
fn heading_id(heading: &str) -> String {
    heading
        .trim()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c.to_ascii_lowercase()),
            _ => None,
        })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    outside_fences(text)
        .into_iter()
        .filter_map(|l| l.strip_prefix('#').map(|h| h.trim_start_matches('#')))
        .map(heading_id)
        .collect()
}

/// Every `](target)` of the page's prose.
fn links(text: &str) -> Vec<String> {
    let prose = prose(text);
    let mut out = Vec::new();
    let mut rest = prose.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        out.push(after[..end].trim().to_owned());
        rest = &after[end..];
    }
    out
}

#[test]
fn the_book_and_the_readmes_have_no_broken_links() {
    let mut problems = Vec::new();
    for page in pages() {
        let dir = page.parent().expect("a page has a folder").to_owned();
        let text = expand_includes(&fs::read_to_string(&page).expect("a page is readable"), &dir, &page, &mut problems);
        for link in links(&text) {
            if link.starts_with("http://") || link.starts_with("https://") || link.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = link.split_once('#').unwrap_or((link.as_str(), ""));
            let target = if file.is_empty() { page.clone() } else { dir.join(file) };
            if !target.exists() {
                problems.push(format!("{}: `{link}`: {} does not exist", page.display(), target.display()));
                continue;
            }
            if !anchor.is_empty() && target.extension().is_some_and(|e| e == "md") {
                let target_text = fs::read_to_string(&target).expect("a page is readable");
                let target_text =
                    expand_includes(&target_text, target.parent().unwrap_or(&dir), &target, &mut problems);
                if !anchors(&target_text).contains(anchor) {
                    problems.push(format!("{}: `{link}`: no heading with id `{anchor}`", page.display()));
                }
            }
        }
    }
    assert!(problems.is_empty(), "broken links:\n{}", problems.join("\n"));
}

#[test]
fn every_chapter_is_in_the_summary() {
    let src = root().join("docs/src");
    let summary = fs::read_to_string(src.join("SUMMARY.md")).expect("docs/src/SUMMARY.md");
    let listed: BTreeSet<String> = links(&summary).into_iter().collect();
    for page in pages().into_iter().filter(|p| p.starts_with(&src)) {
        let relative = page.strip_prefix(&src).expect("inside docs/src").to_string_lossy().into_owned();
        if relative != "SUMMARY.md" {
            assert!(listed.contains(&relative), "{relative} is not listed in docs/src/SUMMARY.md");
        }
    }
}

#[test]
fn heading_ids_are_mdbooks() {
    assert_eq!(heading_id("Several nodes, one shared filesystem"), "several-nodes-one-shared-filesystem");
    assert_eq!(heading_id("A tour of `tensordict`"), "a-tour-of-tensordict");
    assert_eq!(heading_id("GPUs (feature `cuda`)"), "gpus-feature-cuda");
}
