//! Sizes and durations as every subcommand reads them from the command line: one reading, so
//! that `1M` means the same in `bench` and in `store serve`.
//!
//! Sizes are read by `parse-size`: K, M, G, T (or KB, MB, ...) are powers of 1000, KiB, MiB,
//! GiB, TiB (or Ki, Mi, ...) powers of 1024, in any case, with fractions (`1.5GiB`). Sizes are
//! printed with indicatif's `DecimalBytes`. Durations are seconds, whole or decimal.

use std::time::Duration;

/// The size units, as messages and `--help` name them.
pub(crate) const SIZE_UNITS: &str = "K, M, G, T are powers of 1000; KiB, MiB, GiB, TiB powers of 1024";

/// A number of bytes, with an optional unit ([`SIZE_UNITS`]).
pub(crate) fn parse_bytes(s: &str) -> Result<u64, String> {
    parse_size::parse_size(s.trim()).map_err(|e| match e {
        parse_size::Error::PosOverflow => format!("`{s}` is more bytes than a size can be (2^64 - 1)"),
        _ => format!("`{s}` is not a number of bytes, as in 500M, 2G or 1GiB ({SIZE_UNITS})"),
    })
}

/// Seconds, as a whole or decimal number.
pub(crate) fn parse_seconds(s: &str) -> Result<Duration, String> {
    let secs: f64 = s.trim().parse().map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if secs.is_nan() || secs < 0.0 {
        return Err(format!("`{s}` is not zero or more seconds"));
    }
    Duration::try_from_secs_f64(secs).map_err(|_| format!("`{s}` seconds is too long"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_in_decimal_and_binary_units() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("500M"), Ok(500_000_000));
        assert_eq!(parse_bytes("1M"), Ok(1_000_000));
        assert_eq!(parse_bytes("1MiB"), Ok(1 << 20));
        assert_eq!(parse_bytes("2G"), Ok(2_000_000_000));
        assert_eq!(parse_bytes("2gb"), Ok(2_000_000_000));
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("1.5K"), Ok(1500));
        assert_eq!(parse_bytes("0.5KiB"), Ok(512));
        assert_eq!(parse_bytes(" 3 MiB "), Ok(3 << 20));
        assert!(parse_bytes("16EiB").unwrap_err().contains("more bytes"));
        assert!(parse_bytes("20000000T").unwrap_err().contains("more bytes"));
        assert!(parse_bytes("99999999999999999999999999999999999999999").unwrap_err().contains("more bytes"));
        for bad in ["", "M", ".", "1.2.3G", "-1", "G1", "12XB", "ten"] {
            let err = parse_bytes(bad).unwrap_err();
            assert!(err.contains("KiB"), "{bad}: {err}");
        }
    }

    #[test]
    fn seconds() {
        assert_eq!(parse_seconds("0"), Ok(Duration::ZERO));
        assert_eq!(parse_seconds("2.5"), Ok(Duration::from_millis(2500)));
        assert!(parse_seconds("-1").is_err());
        assert!(parse_seconds("NaN").is_err());
        assert!(parse_seconds("inf").is_err());
        assert!(parse_seconds("1e30").is_err());
    }
}
