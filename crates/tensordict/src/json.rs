//! JSON as Python's `json` module reads and writes it, so `meta.json` files round-trip byte for
//! byte.
//!
//! - [`parse`] reads any valid JSON plus the tokens Python writes for non-finite floats
//!   (`NaN`, `Infinity`, `-Infinity`). Integers of any size and floats keep their exact text
//!   (serde_json's `arbitrary_precision`).
//! - [`to_python_json`] writes like `json.dumps(value)` (`", "` and `": "` separators),
//!   [`to_python_json_compact`] like `json.dumps(value, separators=(",", ":"))`; both escape
//!   everything outside printable ASCII as `\uXXXX` (`ensure_ascii`), write integers as they
//!   are and floats as Python's `repr` does (`1e+16`, `1e-05`, `0.0001`, `2.0`).
//!
//! **Non-finite floats.** A `serde_json::Value` number cannot be NaN or infinite, so such a float
//! is held as an object with the single key [`NON_FINITE_KEY`] and the Python token as its
//! value: `{"$tensordict.float": "NaN"}` (also `"Infinity"`, `"-Infinity"`). [`json_float`]
//! makes one from an `f64` and [`json_as_f64`] reads either form back. The writers write that
//! object as the bare token, as Python writes `float("nan")`. (So an object of exactly that
//! shape cannot be stored as itself.) A float literal too large for `f64` (`1e400`) is read as
//! `Infinity`, as Python reads it.
//!
//! Numbers keep their text, so `==` on values compares that text: `1e-05` read from a file is
//! not `==` to `json!(0.00001)`; compare floats with [`json_as_f64`].

use serde_json::{Map, Number, Value};

/// The key of the object that stands for a non-finite float (see the module docs).
pub const NON_FINITE_KEY: &str = "$tensordict.float";

/// `x` as a JSON value: a number when finite, otherwise the object that stands for `NaN`,
/// `Infinity` or `-Infinity` (see [`NON_FINITE_KEY`]).
pub fn json_float(x: f64) -> Value {
    match Number::from_f64(x) {
        Some(n) => Value::Number(n),
        None => {
            let token = if x.is_nan() {
                "NaN"
            } else if x > 0.0 {
                "Infinity"
            } else {
                "-Infinity"
            };
            let mut obj = Map::new();
            obj.insert(NON_FINITE_KEY.to_owned(), Value::String(token.to_owned()));
            Value::Object(obj)
        }
    }
}

/// The float a JSON value holds: a number (an integer too, rounded; a literal too large for
/// `f64` is infinite) or a non-finite float's object. `None` for anything else.
pub fn json_as_f64(value: &Value) -> Option<f64> {
    match value {
        Value::Number(n) => n.as_str().parse::<f64>().ok(),
        other => non_finite_token(other).and_then(|t| match t {
            "NaN" => Some(f64::NAN),
            "Infinity" => Some(f64::INFINITY),
            "-Infinity" => Some(f64::NEG_INFINITY),
            _ => None,
        }),
    }
}

/// The token of a non-finite float's object, if `value` is one.
fn non_finite_token(value: &Value) -> Option<&'static str> {
    let obj = value.as_object()?;
    if obj.len() != 1 {
        return None;
    }
    match obj.get(NON_FINITE_KEY)?.as_str()? {
        "NaN" => Some("NaN"),
        "Infinity" => Some("Infinity"),
        "-Infinity" => Some("-Infinity"),
        _ => None,
    }
}

/// Parses JSON text as Python's `json.loads` does: standard JSON plus the bare tokens `NaN`,
/// `Infinity` and `-Infinity`, which become non-finite floats' objects. Nesting deeper than
/// serde_json's limit (128 levels) is an error, not a stack overflow.
pub fn parse(text: &[u8]) -> serde_json::Result<Value> {
    let mut value = serde_json::from_slice(&rewrite_non_finite(text))?;
    // A float literal too large for f64 is infinite to Python: hold it as such, so that reading
    // what we write gives the same value.
    let mut pending = vec![&mut value];
    while let Some(v) = pending.pop() {
        match v {
            Value::Number(n) => {
                if let Ok(x) = n.as_str().parse::<f64>()
                    && x.is_infinite()
                    && !n.as_str().bytes().all(|b| b.is_ascii_digit() || b == b'-')
                {
                    *v = json_float(x);
                }
            }
            Value::Array(items) => pending.extend(items.iter_mut()),
            Value::Object(map) => pending.extend(map.values_mut()),
            _ => {}
        }
    }
    Ok(value)
}

/// `text` with the tokens `NaN`, `Infinity` and `-Infinity` outside strings replaced by the
/// JSON of their objects; everything else, valid or not, is copied as it is (the parser
/// reports what is wrong). One pass, no recursion.
fn rewrite_non_finite(text: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    const TOKENS: [(&[u8], &str); 3] = [(b"-Infinity", "-Infinity"), (b"Infinity", "Infinity"), (b"NaN", "NaN")];
    if !text.iter().any(|&b| b == b'N' || b == b'I') {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = Vec::with_capacity(text.len() + 64);
    let mut strings = Strings::default();
    let mut i = 0;
    'bytes: while let Some(&b) = text.get(i) {
        if strings.is_outside(b) {
            for (token, name) in TOKENS {
                if text[i..].starts_with(token) {
                    out.extend_from_slice(format!("{{\"{NON_FINITE_KEY}\":\"{name}\"}}").as_bytes());
                    i += token.len();
                    continue 'bytes;
                }
            }
        }
        out.push(b);
        i += 1;
    }
    std::borrow::Cow::Owned(out)
}

/// Tells, byte by byte, whether JSON text is outside its strings (tokens that are not JSON do
/// not confuse it: it only follows quotes and escapes).
#[derive(Default)]
pub(crate) struct Strings {
    inside: bool,
    escaped: bool,
}

impl Strings {
    /// Takes the next byte: true if it is outside every string (a quote counts as inside).
    pub(crate) fn is_outside(&mut self, b: u8) -> bool {
        if self.inside {
            match (self.escaped, b) {
                (true, _) => self.escaped = false,
                (false, b'\\') => self.escaped = true,
                (false, b'"') => self.inside = false,
                _ => {}
            }
            false
        } else {
            self.inside = b == b'"';
            !self.inside
        }
    }
}

/// `value` serialised like Python's `json.dumps(value)`.
pub fn to_python_json(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    write_value(&mut out, value, b", ", b": ");
    out
}

/// `value` serialised like Python's `json.dumps(value, separators=(",", ":"))`.
pub(crate) fn to_python_json_compact(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    write_value(&mut out, value, b",", b":");
    out
}

fn write_value(out: &mut Vec<u8>, value: &Value, item_sep: &[u8], key_sep: &[u8]) {
    if let Some(token) = non_finite_token(value) {
        out.extend_from_slice(token.as_bytes());
        return;
    }
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Value::Number(n) => out.extend_from_slice(python_number(n.as_str()).as_bytes()),
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            out.push(b'[');
            for (k, item) in items.iter().enumerate() {
                if k > 0 {
                    out.extend_from_slice(item_sep);
                }
                write_value(out, item, item_sep, key_sep);
            }
            out.push(b']');
        }
        Value::Object(map) => {
            out.push(b'{');
            for (k, (key, item)) in map.iter().enumerate() {
                if k > 0 {
                    out.extend_from_slice(item_sep);
                }
                write_string(out, key);
                out.extend_from_slice(key_sep);
                write_value(out, item, item_sep, key_sep);
            }
            out.push(b'}');
        }
    }
}

/// A string as Python's `json` writes it with `ensure_ascii`: printable ASCII as is, `"` and
/// `\` and the usual control characters escaped short, everything else as `\uXXXX` (UTF-16).
fn write_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    for ch in s.chars() {
        match ch {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            '\u{8}' => out.extend_from_slice(b"\\b"),
            '\u{c}' => out.extend_from_slice(b"\\f"),
            ' '..='~' => out.push(ch as u8),
            _ => {
                let mut units = [0u16; 2];
                for unit in ch.encode_utf16(&mut units) {
                    out.extend_from_slice(format!("\\u{unit:04x}").as_bytes());
                }
            }
        }
    }
    out.push(b'"');
}

/// A JSON number's text as Python writes the value it reads from it: an integer as is (of any
/// size; `-0` is `0`), a float as `repr(float)`, one too large for `f64` as `Infinity`.
fn python_number(text: &str) -> String {
    let digits = text.strip_prefix('-').unwrap_or(text);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        return if digits.bytes().all(|b| b == b'0') { "0".to_owned() } else { text.to_owned() };
    }
    match text.parse::<f64>() {
        Ok(x) if x.is_infinite() => if x > 0.0 { "Infinity" } else { "-Infinity" }.to_owned(),
        Ok(x) => python_float_repr(x),
        // Not reachable for a serde_json number; keep the text rather than lose it.
        Err(_) => text.to_owned(),
    }
}

/// Python's `repr` of a finite float: the shortest digits that read back the same, in fixed
/// notation when the decimal point falls within `-4 < decpt <= 16` (with `.0` for a whole
/// number), otherwise as `d.ddde+XX` with at least two exponent digits.
pub(crate) fn python_float_repr(x: f64) -> String {
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0" } else { "0.0" }.to_owned();
    }
    let sci = format!("{:e}", x.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let exp: i64 = exp.parse().unwrap_or(0);
    let decpt = exp + 1;
    let sign = if x < 0.0 { "-" } else { "" };
    let n = i64::try_from(digits.len()).unwrap_or(i64::MAX);
    let body = if -4 < decpt && decpt <= 16 {
        if decpt <= 0 {
            format!("0.{}{digits}", "0".repeat(usize::try_from(-decpt).unwrap_or(0)))
        } else if decpt >= n {
            format!("{digits}{}.0", "0".repeat(usize::try_from(decpt - n).unwrap_or(0)))
        } else {
            let (int, frac) = digits.split_at(usize::try_from(decpt).unwrap_or(0));
            format!("{int}.{frac}")
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() { String::new() } else { format!(".{rest}") };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{first}{frac}e{exp_sign}{:02}", exp.abs())
    };
    format!("{sign}{body}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_python_json_dumps() {
        let v: Value =
            parse(r#"{"b": [1, 2.5, "x"], "a": {"k": null, "t": true}, "é": "日本😀", "d": "\u007f\t"}"#.as_bytes())
                .unwrap();
        // json.dumps({"b": [1, 2.5, "x"], "a": {"k": None, "t": True}, "é": "日本😀", "d": "\x7f\t"})
        let expected = r#"{"b": [1, 2.5, "x"], "a": {"k": null, "t": true}, "\u00e9": "\u65e5\u672c\ud83d\ude00", "d": "\u007f\t"}"#;
        assert_eq!(String::from_utf8(to_python_json(&v)).unwrap(), expected);
    }

    #[test]
    fn floats_print_like_python_repr() {
        // repr() of each, from Python 3.11.
        let cases: [(f64, &str); 14] = [
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (2.0, "2.0"),
            (-1.25, "-1.25"),
            (0.1, "0.1"),
            (1.5e300, "1.5e+300"),
            (5e-324, "5e-324"),
            (-0.0, "-0.0"),
            (123.456, "123.456"),
            (1e22, "1e+22"),
            (f64::MAX, "1.7976931348623157e+308"),
        ];
        for (x, repr) in cases {
            assert_eq!(python_float_repr(x), repr, "{x:e}");
        }
    }

    #[test]
    fn non_finite_tokens_outside_strings_only() {
        let v = parse(br#"{"a": NaN, "b": [Infinity, -Infinity], "s": "NaN Infinity", "e": "\"NaN"}"#).unwrap();
        assert!(json_as_f64(&v["a"]).unwrap().is_nan());
        assert_eq!(json_as_f64(&v["b"][0]), Some(f64::INFINITY));
        assert_eq!(json_as_f64(&v["b"][1]), Some(f64::NEG_INFINITY));
        assert_eq!(v["s"], "NaN Infinity");
        assert_eq!(v["e"], "\"NaN");
        assert_eq!(
            String::from_utf8(to_python_json(&v)).unwrap(),
            r#"{"a": NaN, "b": [Infinity, -Infinity], "s": "NaN Infinity", "e": "\"NaN"}"#
        );
        assert!(parse(b"[NaX]").is_err());
        assert!(parse(b"[nan]").is_err());
    }

    #[test]
    fn big_integers_and_float_text_survive() {
        let text = br#"[123456789012345678901234567890, -99999999999999999999, 1e400, -1e400, 1E5, -0]"#;
        let v = parse(text).unwrap();
        assert_eq!(
            String::from_utf8(to_python_json_compact(&v)).unwrap(),
            "[123456789012345678901234567890,-99999999999999999999,Infinity,-Infinity,100000.0,0]"
        );
    }
}
