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

    /// The first component and the rest, or `None` for the empty path.
    pub fn split_first(&self) -> Option<(&str, &[String])> {
        self.0.split_first().map(|(first, rest)| (first.as_str(), rest))
    }

    /// The path joined with `sep` (`"next.obs"` for `"."`).
    pub fn joined(&self, sep: &str) -> String {
        self.0.join(sep)
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.joined("."))
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

/// Names that `meta.json` uses for the node itself; a child with one of these names would be
/// overwritten by (or overwrite) the node's metadata, so such keys cannot be stored.
pub(crate) const RESERVED_KEYS: [&str; 6] = ["shape", "device", "_type", "_format_version", "_class", "_names"];

/// The file or folder name (without `.memmap`) for `key`.
///
/// A key that is a safe single path component is used as is, exactly as Python's tensordict
/// names its files, so each library reads what the other writes. Other keys (empty, `.`, `..`,
/// or holding `/`, NUL or another control character) are percent-encoded (`%XX`, uppercase hex,
/// per UTF-8 byte, `%` included); the empty key becomes `%`. Python cannot write such keys, and
/// an encoded name never leaves its folder. Since plain keys may contain `%` too, two keys of one
/// dict could map to one name; the writer refuses that (see [`check_distinct_names`]).
pub(crate) fn encode_name(key: &str) -> String {
    if is_plain_name(key) {
        return key.to_owned();
    }
    if key.is_empty() {
        return "%".to_owned();
    }
    if key == "." || key == ".." {
        return "%2E".repeat(key.len());
    }
    let mut out = String::with_capacity(key.len() + 8);
    for ch in key.chars() {
        if ch == '%' || needs_escape(ch) {
            let mut buf = [0u8; 4];
            for b in ch.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(ch);
        }
    }
    out
}

/// True when `key` can be a file name as is: non-empty, not `.` or `..`, no `/`, NUL or
/// other control character. Such a name stays inside its folder.
pub(crate) fn is_plain_name(key: &str) -> bool {
    !key.is_empty() && key != "." && key != ".." && !key.chars().any(needs_escape)
}

fn needs_escape(ch: char) -> bool {
    ch == '/' || ch.is_control()
}

/// Fails if two of `keys` map to the same file name (only possible with keys that contain `%`).
pub(crate) fn check_distinct_names<'a>(keys: impl IntoIterator<Item = &'a str>) -> Result<(), (String, String)> {
    let mut seen: std::collections::HashMap<String, &str> = std::collections::HashMap::new();
    for key in keys {
        if let Some(other) = seen.insert(encode_name(key), key) {
            return Err((other.to_owned(), key.to_owned()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_keys_keep_their_names() {
        for key in ["obs", "a.b", "with space", "semi;colon", "unicodé", "UPPER", "x:y", "100%", "back\\slash"] {
            assert_eq!(encode_name(key), key);
        }
    }

    #[test]
    fn hostile_keys_are_encoded_and_stay_in_their_folder() {
        assert_eq!(encode_name(""), "%");
        assert_eq!(encode_name("."), "%2E");
        assert_eq!(encode_name(".."), "%2E%2E");
        assert_eq!(encode_name("../x"), "..%2Fx");
        assert_eq!(encode_name("a/b"), "a%2Fb");
        assert_eq!(encode_name("100%"), "100%");
        assert_eq!(encode_name("50%/x"), "50%25%2Fx");
        assert_eq!(encode_name("nul\0"), "nul%00");
        assert_eq!(encode_name("line\n"), "line%0A");
        for key in ["", ".", "..", "../x", "a/b", "/abs", "\\", "a\0b"] {
            let name = encode_name(key);
            assert!(!name.contains('/') && name != "." && name != ".." && !name.contains('\0'), "{key:?} -> {name}");
        }
    }

    #[test]
    fn colliding_names_are_detected() {
        assert!(check_distinct_names(["a", "b", "100%"]).is_ok());
        assert_eq!(check_distinct_names(["a/b", "a%2Fb"]), Err(("a/b".to_owned(), "a%2Fb".to_owned())));
    }
}
