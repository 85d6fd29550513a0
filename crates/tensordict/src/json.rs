//! JSON written the way Python's `json.dump` writes it (`", "` and `": "` separators, non-ASCII
//! escaped as `\uXXXX`), so `meta.json` files match Python's byte for byte where values allow.

use std::io;

use serde_json::Value;
use serde_json::ser::Formatter;

/// `value` serialised like Python's `json.dumps(value)`.
pub(crate) fn to_python_json(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
    serde::Serialize::serialize(value, &mut ser).expect("serialising a JSON value into memory cannot fail");
    out
}

struct PythonFormatter;

impl Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + io::Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        if first { Ok(()) } else { writer.write_all(b", ") }
    }

    fn begin_object_key<W: ?Sized + io::Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        if first { Ok(()) } else { writer.write_all(b", ") }
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        writer.write_all(b": ")
    }

    /// Python escapes everything outside printable ASCII (`' '..='~'`); serde_json already
    /// escapes quotes, backslashes and the control characters below `' '` before this is called.
    fn write_string_fragment<W: ?Sized + io::Write>(&mut self, writer: &mut W, fragment: &str) -> io::Result<()> {
        let printable = |ch: char| (' '..='~').contains(&ch);
        if fragment.chars().all(printable) {
            return writer.write_all(fragment.as_bytes());
        }
        for ch in fragment.chars() {
            if printable(ch) {
                writer.write_all(&[ch as u8])?;
            } else {
                let mut units = [0u16; 2];
                for unit in ch.encode_utf16(&mut units) {
                    write!(writer, "\\u{unit:04x}")?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_python_json_dumps() {
        let v: Value = serde_json::from_str(
            r#"{"b": [1, 2.5, "x"], "a": {"k": null, "t": true}, "é": "日本😀", "d": "\u007f\t"}"#,
        )
        .unwrap();
        // json.dumps({"b": [1, 2.5, "x"], "a": {"k": None, "t": True}, "é": "日本😀", "d": "\x7f\t"})
        let expected = r#"{"b": [1, 2.5, "x"], "a": {"k": null, "t": true}, "\u00e9": "\u65e5\u672c\ud83d\ude00", "d": "\u007f\t"}"#;
        assert_eq!(String::from_utf8(to_python_json(&v)).unwrap(), expected);
    }
}
