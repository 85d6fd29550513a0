//! What the offloader tests share: values whose bytes tell which write they came from.

/// The bytes of `key` at `version`: the version and the length, then a pattern of both, so that
/// a reader can tell exactly which write a key's bytes come from. Lengths vary with key and
/// version, up to `16 + max_extra` bytes.
pub(crate) fn content(key: &str, version: u64, max_extra: u64) -> Vec<u8> {
    let seed = key.bytes().fold(version.wrapping_mul(0x9e37_79b9_7f4a_7c15), |h, b| h.rotate_left(7) ^ u64::from(b));
    let len = 16 + (seed % max_extra) as usize;
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(len as u64).to_le_bytes());
    let mut x = seed | 1;
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push(x as u8);
    }
    out
}

/// The version whose bytes `bytes` are (made with the same `max_extra`), if they are exactly
/// those of one.
pub(crate) fn version_of(key: &str, bytes: &[u8], max_extra: u64) -> Option<u64> {
    let version = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    (content(key, version, max_extra) == bytes).then_some(version)
}
