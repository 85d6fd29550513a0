//! The offloader's index file: which extent of the offload file holds each key's bytes.
//!
//! A header line (`aio-offload-index 2 <body bytes> <crc32 of the body>`), then a JSON body
//! `{"version": 2, "align": 4096, "entries": {KEY: [offset, extent length, bytes stored]}}`.
//! It is replaced as a whole ([`crate::replace_file`], durably), so a reader sees an old or a
//! new index; a damaged, torn or foreign one is refused.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

use serde_json::{Map, Value, json};

use crate::extent::{EXTENT_ALIGN, Extent, ExtentAllocator};

/// Index files larger than this are refused before they are read.
const MAX_INDEX_BYTES: u64 = 256 << 20;
/// The first word of an index file.
const INDEX_MAGIC: &str = "aio-offload-index";
/// The index format written and read.
const INDEX_VERSION: u64 = 2;
/// The header line is at most this long (magic, version, two numbers, spaces, newline).
const MAX_HEADER_BYTES: usize = 80;

/// Where one key's bytes are.
#[derive(Clone, Copy, Debug)]
pub(super) struct Slot {
    pub(super) extent: Extent,
    /// Bytes stored (the extent is rounded up to 4 KiB).
    pub(super) len: u64,
}

/// The index file's bytes for `index`: header line and body.
pub(super) fn encode(index: &BTreeMap<String, Slot>) -> io::Result<Vec<u8>> {
    let mut entries = Map::new();
    for (key, slot) in index {
        entries.insert(key.clone(), json!([slot.extent.offset, slot.extent.len, slot.len]));
    }
    let body = serde_json::to_vec(&json!({"version": INDEX_VERSION, "align": EXTENT_ALIGN, "entries": entries}))
        .map_err(io::Error::other)?;
    Ok(frame_index(&body))
}

/// The header line and the body.
fn frame_index(body: &[u8]) -> Vec<u8> {
    let mut out = format!("{INDEX_MAGIC} {INDEX_VERSION} {} {:08x}\n", body.len(), crc32fast::hash(body)).into_bytes();
    out.extend_from_slice(body);
    out
}

/// Checks the header line (magic, version, length, checksum) and returns the body.
fn unframe_index(bytes: &[u8]) -> Result<&[u8], String> {
    let head_len = bytes.iter().take(MAX_HEADER_BYTES).position(|&b| b == b'\n').ok_or_else(|| {
        if bytes.is_empty() { "empty file".to_owned() } else { format!("no `{INDEX_MAGIC}` header line") }
    })?;
    let head = std::str::from_utf8(&bytes[..head_len]).map_err(|_| "the header line is not text".to_owned())?;
    let body = &bytes[head_len + 1..];
    let fields: Vec<&str> = head.split(' ').collect();
    let [magic, version, len, crc] = fields[..] else {
        return Err(format!("bad header line `{}`", head.escape_debug()));
    };
    if magic != INDEX_MAGIC {
        return Err(format!("no `{INDEX_MAGIC}` header line"));
    }
    if version != INDEX_VERSION.to_string() {
        return Err(format!("index format {} is not supported (this reads {INDEX_VERSION})", version.escape_debug()));
    }
    let len: u64 = len.parse().map_err(|_| format!("bad body length `{}`", len.escape_debug()))?;
    let crc = u32::from_str_radix(crc, 16).map_err(|_| format!("bad checksum `{}`", crc.escape_debug()))?;
    // Only the one spelling this writes (no `+`, no leading zeros, lowercase hex).
    if head != format!("{INDEX_MAGIC} {INDEX_VERSION} {len} {crc:08x}") {
        return Err(format!("bad header line `{}`", head.escape_debug()));
    }
    if body.len() as u64 != len {
        return Err(format!(
            "the header announces {len} bytes of entries, the file holds {} (torn write?)",
            body.len()
        ));
    }
    let actual = crc32fast::hash(body);
    if actual != crc {
        return Err(format!("checksum mismatch (header {crc:08x}, entries {actual:08x})"));
    }
    Ok(body)
}

/// Reads and checks the index file `file` (at `path`) of an offload file of `data_len` bytes:
/// its framing, its entries, and that every key's bytes are inside the offload file.
pub(super) fn read(file: File, path: &Path, data_len: u64) -> io::Result<(ExtentAllocator, BTreeMap<String, Slot>)> {
    let bad =
        |why: String| io::Error::new(io::ErrorKind::InvalidData, format!("offload index {}: {why}", path.display()));
    let size = file.metadata()?.len();
    if size > MAX_INDEX_BYTES {
        return Err(bad(format!("{size} bytes, over the {MAX_INDEX_BYTES}-byte limit")));
    }
    // Bounded while reading too: the file may grow meanwhile.
    let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    file.take(MAX_INDEX_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_INDEX_BYTES {
        return Err(bad(format!("over the {MAX_INDEX_BYTES}-byte limit")));
    }
    let body = unframe_index(&bytes).map_err(bad)?;
    let value: Value = serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    if value.get("version").and_then(Value::as_u64) != Some(INDEX_VERSION) {
        return Err(bad("unsupported index version".into()));
    }
    if value.get("align").and_then(Value::as_u64) != Some(EXTENT_ALIGN) {
        return Err(bad(format!("extents are not aligned to {EXTENT_ALIGN} bytes")));
    }
    let entries = value.get("entries").and_then(Value::as_object).ok_or_else(|| bad("no entries".into()))?;
    let mut index = BTreeMap::new();
    for (key, v) in entries {
        let nums: Option<Vec<u64>> = v.as_array().and_then(|a| a.iter().map(Value::as_u64).collect());
        let Some([offset, len, data]) = nums.as_deref().and_then(|n| <[u64; 3]>::try_from(n).ok()) else {
            return Err(bad(format!("entry `{key}` is not [offset, length, bytes]")));
        };
        if data > len {
            return Err(bad(format!("entry `{key}` stores {data} bytes in an extent of {len}")));
        }
        if data > 0 && offset.checked_add(data).is_none_or(|end| end > data_len) {
            return Err(bad(format!(
                "key `{key}` has bytes {offset}..{} but the offload file has {data_len} (truncated, or the index \
                 belongs to another file)",
                offset.saturating_add(data)
            )));
        }
        index.insert(key.clone(), Slot { extent: Extent { offset, len }, len: data });
    }
    let alloc = ExtentAllocator::from_used(index.values().map(|s| s.extent))
        .ok_or_else(|| bad("extents are misaligned or overlap".into()))?;
    Ok((alloc, index))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_framing_round_trips_and_refuses_damage() {
        let body = br#"{"version": 2}"#;
        let framed = frame_index(body);
        assert_eq!(unframe_index(&framed), Ok(&body[..]));
        for cut in 0..framed.len() {
            assert!(unframe_index(&framed[..cut]).is_err(), "cut at {cut}");
        }
        for i in 0..framed.len() {
            let mut flipped = framed.clone();
            flipped[i] ^= 0x20;
            assert!(unframe_index(&flipped).is_err(), "byte {i} flipped");
        }
    }

    #[test]
    fn an_encoded_index_reads_back() {
        let mut index = BTreeMap::new();
        index.insert("a".to_owned(), Slot { extent: Extent { offset: 0, len: 8192 }, len: 5000 });
        index.insert("b/é".to_owned(), Slot { extent: Extent { offset: 8192, len: 4096 }, len: 0 });
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index");
        std::fs::write(&path, encode(&index).unwrap()).unwrap();
        let (_, back) = read(File::open(&path).unwrap(), &path, 12288).unwrap();
        let pairs =
            |m: &BTreeMap<String, Slot>| m.iter().map(|(k, s)| (k.clone(), s.extent, s.len)).collect::<Vec<_>>();
        assert_eq!(pairs(&back), pairs(&index));
        // An offload file too short for its keys: the index belongs to another file.
        let short = read(File::open(&path).unwrap(), &path, 4000).unwrap_err();
        assert_eq!(short.kind(), io::ErrorKind::InvalidData);
    }
}
