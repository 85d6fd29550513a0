//! Keys: [`KeyPath`] for nested entries, and the mapping of keys to file and folder names.

use std::fmt;

/// A path to an entry: one key per level of nesting, outermost first (`["next", "obs"]`).
///
/// Keys are arbitrary strings and may contain dots, so a path is a list, not a dotted string.
/// The dotted form ([`fmt::Display`]) is for messages and the CLI only.
#[derive(Clone, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct KeyPath(Vec<String>);

impl KeyPath {
    /// A path from its components.
    pub fn new(parts: impl IntoIterator<Item = impl Into<String>>) -> Self {
        KeyPath(parts.into_iter().map(Into::into).collect())
    }

    /// The components, outermost first.
    pub fn parts(&self) -> &[String] {
        &self.0
    }

    /// Number of components.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True for the empty path.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// This path followed by `key`.
    pub fn join(&self, key: &str) -> KeyPath {
        let mut parts = self.0.clone();
        parts.push(key.to_owned());
        KeyPath(parts)
    }

    /// Appends `key` (walks that build a path level by level reuse one path).
    pub(crate) fn push(&mut self, key: &str) {
        self.0.push(key.to_owned());
    }

    /// Removes the last component.
    pub(crate) fn pop(&mut self) {
        self.0.pop();
    }

    /// The first component and the rest, or `None` for the empty path.
    pub fn split_first(&self) -> Option<(&str, &[String])> {
        self.0.split_first().map(|(first, rest)| (first.as_str(), rest))
    }

    /// The path joined with `sep` (`"next.obs"` for `"."`).
    pub fn concat(&self, other: &KeyPath) -> KeyPath {
        KeyPath(self.0.iter().chain(&other.0).cloned().collect())
    }

    /// The parts joined by `sep` (`"next.obs"`).
    pub fn joined(&self, sep: &str) -> String {
        self.0.join(sep)
    }
}

/// The components joined with `.`, control characters escaped (`\n`), so that a message
/// naming a key stays on one line. Use [`KeyPath::joined`] for the raw form.
impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, part) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(".")?;
            }
            for ch in part.chars() {
                if ch.is_control() {
                    write!(f, "{}", ch.escape_default())?;
                } else {
                    write!(f, "{ch}")?;
                }
            }
        }
        Ok(())
    }
}

impl fmt::Debug for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

/// One key: the path of length one. The string is never split (keys may contain dots).
impl From<&str> for KeyPath {
    fn from(key: &str) -> Self {
        KeyPath(vec![key.to_owned()])
    }
}

impl From<String> for KeyPath {
    fn from(key: String) -> Self {
        KeyPath(vec![key])
    }
}

impl From<&String> for KeyPath {
    fn from(key: &String) -> Self {
        KeyPath(vec![key.clone()])
    }
}

impl<const N: usize> From<[&str; N]> for KeyPath {
    fn from(parts: [&str; N]) -> Self {
        KeyPath::new(parts)
    }
}

impl From<&[&str]> for KeyPath {
    fn from(parts: &[&str]) -> Self {
        KeyPath::new(parts.iter().copied())
    }
}

impl From<Vec<String>> for KeyPath {
    fn from(parts: Vec<String>) -> Self {
        KeyPath(parts)
    }
}

impl From<&[String]> for KeyPath {
    fn from(parts: &[String]) -> Self {
        KeyPath(parts.to_vec())
    }
}

impl From<&KeyPath> for KeyPath {
    fn from(path: &KeyPath) -> Self {
        path.clone()
    }
}

/// Names that `meta.json` uses for the node itself. A child with one of these names cannot be
/// written: Python would overwrite it with the node's metadata, or the metadata with it.
pub(crate) const RESERVED_KEYS: [&str; 6] = ["shape", "device", "_type", "_format_version", "_class", "_names"];

/// Node metadata that is never a child when reading. (`_format_version`, `_class` and `_names`
/// are children when their value is an object: Python keeps a leaf of that name and skips the
/// metadata.)
pub(crate) const METADATA_KEYS: [&str; 3] = ["shape", "device", "_type"];

/// The file or folder name (without `.memmap`) for `key`, as Python's tensordict writes it:
/// the characters `/ < > : " | ? * \`, space, `%` and the control characters (bytes 0–31 and
/// 127) become `%XX` (uppercase hex); the empty key is `%`; `.` and `..` are `%2E` and
/// `%2E%2E`. Everything else, non-ASCII included, is kept. The result is one path component
/// that cannot leave its folder, and different keys get different names.
pub(crate) fn encode_name(key: &str) -> String {
    match key {
        "" => return "%".to_owned(),
        "." => return "%2E".to_owned(),
        ".." => return "%2E%2E".to_owned(),
        _ => {}
    }
    let mut out = String::with_capacity(key.len() + 8);
    for ch in key.chars() {
        if needs_escape(ch) {
            out.push_str(&format!("%{:02X}", u32::from(ch)));
        } else {
            out.push(ch);
        }
    }
    out
}

fn needs_escape(ch: char) -> bool {
    matches!(ch, '/' | '<' | '>' | ':' | '"' | '|' | '?' | '*' | '\\' | ' ' | '%') || ch.is_ascii_control()
}

/// The names to look for, in order, when reading `key` from a folder: the encoded name, then
/// (as Python does, for folders written without key encoding) the raw key, but only when it is
/// a single safe path component.
pub(crate) fn candidate_names(key: &str, is_folder: bool) -> Vec<String> {
    let encoded = encode_name(key);
    let unsafe_raw = key.contains(['/', '\\', '\0']) || (is_folder && matches!(key, "" | "." | ".."));
    if unsafe_raw || key == encoded { vec![encoded] } else { vec![encoded, key.to_owned()] }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_python_tensordict() {
        // The table observed from tensordict 0.15.3 (tools/python/README.md).
        let cases = [
            ("a.b", "a.b"),
            ("with space", "with%20space"),
            ("semi;colon", "semi;colon"),
            ("unicodé", "unicodé"),
            ("percent%", "percent%25"),
            ("x/y", "x%2Fy"),
            ("", "%"),
            (".", "%2E"),
            ("..", "%2E%2E"),
            ("tab\t", "tab%09"),
            ("line\nfeed", "line%0Afeed"),
            ("nul\0", "nul%00"),
            ("del\u{7f}", "del%7F"),
            ("q?", "q%3F"),
            ("star*", "star%2A"),
            ("colon:", "colon%3A"),
            ("quote\"", "quote%22"),
            ("pipe|", "pipe%7C"),
            ("lt<gt>", "lt%3Cgt%3E"),
            ("back\\slash", "back%5Cslash"),
            ("plus+tilde~&=,'()[]{}!@#$^", "plus+tilde~&=,'()[]{}!@#$^"),
        ];
        for (key, name) in cases {
            assert_eq!(encode_name(key), name, "{key:?}");
        }
    }

    #[test]
    fn encoded_names_stay_in_their_folder() {
        for key in ["", ".", "..", "../x", "a/b", "/abs", "\\", "a\0b", "../../etc/passwd"] {
            let name = encode_name(key);
            assert!(!name.contains('/') && name != "." && name != ".." && !name.contains('\0'), "{key:?} -> {name}");
        }
    }

    #[test]
    fn raw_names_are_tried_only_when_safe() {
        assert_eq!(candidate_names("obs", false), vec!["obs"]);
        assert_eq!(candidate_names("with space", false), vec!["with%20space", "with space"]);
        assert_eq!(candidate_names("../x", false), vec!["..%2Fx"]);
        assert_eq!(candidate_names("..", true), vec!["%2E%2E"]);
        assert_eq!(candidate_names("..", false), vec!["%2E%2E", ".."]);
    }

    #[test]
    fn displayed_paths_stay_on_one_line() {
        assert_eq!(KeyPath::from(["next", "line\nfeed", "tab\t"]).to_string(), "next.line\\nfeed.tab\\t");
        assert_eq!(KeyPath::from(["a.b", "c"]).joined("."), "a.b.c");
    }
}
