//! Sizes and durations as every subcommand reads them from the command line: one reading, so
//! that `1M` means the same in `bench` and in `store serve`.
//!
//! Sizes are read by `parse-size`: K, M, G, T (or KB, MB, ...) are powers of 1000, KiB, MiB,
//! GiB, TiB (or Ki, Mi, ...) powers of 1024, in any case, with fractions (`1.5GiB`) as long as
//! they come to whole bytes: `parse-size` rounds `1.5B` to 2 bytes, which would serve a size
//! nobody asked for, so a fraction of a byte is refused instead. Sizes are printed with
//! indicatif's `DecimalBytes`. Durations are seconds, whole or decimal.

use std::time::Duration;

/// The size units, as messages and `--help` name them.
pub(crate) const SIZE_UNITS: &str = "K, M, G, T are powers of 1000; KiB, MiB, GiB, TiB powers of 1024";

/// A number of bytes, with an optional unit ([`SIZE_UNITS`]). Every size option of every
/// subcommand reads its value here, so all of them refuse the same things.
///
/// A fraction is fine where the unit makes it whole bytes (`1.5K` is 1500, `0.5KiB` 512) and
/// refused where it does not (`1.5B`, `0.3`, `1.0001K`): `parse-size` would round those to the
/// nearest byte, and a capacity or a buffer of a size the user did not write is a surprise
/// found much later.
pub(crate) fn parse_bytes(s: &str) -> Result<u64, String> {
    let text = s.trim();
    let bytes = parse_size::parse_size(text).map_err(|e| match e {
        parse_size::Error::PosOverflow => format!("`{s}` is more bytes than a size can be (2^64 - 1)"),
        _ => format!("`{s}` is not a number of bytes, as in 500M, 2G or 1GiB ({SIZE_UNITS})"),
    })?;
    if !is_whole_bytes(text) {
        return Err(format!(
            "`{s}` is not a whole number of bytes, and a size cannot hold part of a byte: \
             write whole bytes, or a fraction the unit makes whole (1.5K is 1500 bytes, 0.5KiB 512)"
        ));
    }
    Ok(bytes)
}

/// Whether `text`, a size `parse_size::parse_size` accepted, is a whole number of bytes before
/// that function rounds it.
///
/// Done exactly, on decimal digits, because floating point cannot tell `1.0000000000000000001`
/// from 1 and `parse-size` itself drops digits past 64 bits. The value is
/// `mantissa * unit / 10^scale`, where `mantissa` is every digit written and `scale` the digits
/// after the point less the exponent; it is whole when `scale <= 0` or the last `scale` digits
/// of `mantissa * unit` are zeros. The suffix is split off with `parse-size`'s own rules: a
/// final `B`, then a final `i` (binary), then one unit letter (K M G T P E).
fn is_whole_bytes(text: &str) -> bool {
    let mut src = text.as_bytes();
    if let [init @ .., b'b' | b'B'] = src {
        src = init;
    }
    let binary = match src {
        [init @ .., b'i' | b'I'] => {
            src = init;
            true
        }
        _ => false,
    };
    let mut unit: u64 = 1;
    if let [init @ .., prefix] = src {
        let power = match prefix.to_ascii_uppercase() {
            b'K' => 1,
            b'M' => 2,
            b'G' => 3,
            b'T' => 4,
            b'P' => 5,
            b'E' => 6,
            _ => 0,
        };
        if power > 0 {
            unit = if binary { 1u64 << (10 * power) } else { 1000u64.pow(power) };
            src = init;
        }
    }

    // The mantissa's digits, least significant first, and the scale.
    let mut digits: Vec<u8> = Vec::with_capacity(src.len());
    let (mut after_point, mut in_fraction) = (0i64, false);
    let (mut exponent, mut exponent_sign, mut in_exponent) = (0i64, 1i64, false);
    for &b in src {
        match b {
            b'0'..=b'9' if in_exponent => exponent = exponent.saturating_mul(10).saturating_add(i64::from(b - b'0')),
            b'0'..=b'9' => {
                digits.push(b - b'0');
                after_point += i64::from(in_fraction);
            }
            b'.' => in_fraction = true,
            b'e' | b'E' => in_exponent = true,
            b'-' => exponent_sign = -1,
            _ => {} // `_`, ` ` and `+`, which parse-size skips
        }
    }
    let scale = after_point.saturating_sub(exponent.saturating_mul(exponent_sign));
    if scale <= 0 {
        return true;
    }
    digits.reverse();

    // mantissa * unit, digit by digit (`unit` < 2^61, so the carry stays well inside u128).
    let mut product = Vec::with_capacity(digits.len() + 20);
    let mut carry: u128 = 0;
    for d in digits {
        let t = u128::from(d) * u128::from(unit) + carry;
        product.push((t % 10) as u8);
        carry = t / 10;
    }
    while carry > 0 {
        product.push((carry % 10) as u8);
        carry /= 10;
    }
    // Where `scale` is past the product's last digit, this asks that every digit be zero: the
    // product is then under 10^scale, and only 0 divides into whole bytes.
    let scale = usize::try_from(scale).unwrap_or(usize::MAX);
    product.iter().take(scale).all(|&d| d == 0)
}

/// Seconds, as a whole or decimal number, read as Python's timeouts are
/// ([`tensordict_rpc::seconds`], the one conversion every number of seconds crosses): zero or
/// less is no time at all; NaN is refused, and so is a time without end (`inf`, or more
/// seconds than a `Duration` holds), since the options read here need an end.
pub(crate) fn parse_seconds(s: &str) -> Result<Duration, String> {
    match parse_wait_seconds(s)? {
        Some(duration) => Ok(duration),
        None => Err(format!("`{s}` seconds never ends: give a finite number of seconds")),
    }
}

/// [`parse_seconds`] for a wait, which may be without end: `None` for `inf` (or more seconds
/// than a `Duration` holds).
pub(crate) fn parse_wait_seconds(s: &str) -> Result<Option<Duration>, String> {
    let secs: f64 = s.trim().parse().map_err(|_| format!("`{s}` is not a number of seconds"))?;
    tensordict_rpc::seconds(secs).map_err(|e| format!("`{s}`: {e}"))
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
    fn fractions_that_come_to_whole_bytes_are_sizes() {
        assert_eq!(parse_bytes("1.5K"), Ok(1500));
        assert_eq!(parse_bytes("0.5KiB"), Ok(512));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("1.5 GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("3.000"), Ok(3));
        assert_eq!(parse_bytes("0.0"), Ok(0));
        assert_eq!(parse_bytes("0.001K"), Ok(1));
        assert_eq!(parse_bytes("0.9765625Ki"), Ok(1000));
        assert_eq!(parse_bytes("1.0000000000000000000000000K"), Ok(1000));
        assert_eq!(parse_bytes("1e3"), Ok(1000));
        assert_eq!(parse_bytes("2.5e-1K"), Ok(250));
        assert_eq!(parse_bytes("25E-1k"), Ok(2500));
        assert_eq!(parse_bytes("1.5e"), Ok(1_500_000_000_000_000_000));
        assert_eq!(parse_bytes("18_446_744_073_709_551_615"), Ok(u64::MAX));
        // 2^-60 EiB, exactly: more digits than parse-size keeps, and one byte.
        assert_eq!(parse_bytes("0.000000000000000000867361737988403547205962240695953369140625EiB"), Ok(1));
    }

    #[test]
    fn a_fraction_of_a_byte_is_refused_and_says_why() {
        for bad in [
            "1.5B",
            "1.5",
            "0.3",
            "0.5",
            "1.0001K",
            "0.0001K",
            "1.00000000000000000000001",
            "1.0000000000000000001K",
            "0.1KiB",
            "1.5e-1",
            "0.000000000000000000000000000000000000000001",
            " 2.5 B ",
            "1e-1",
            "0.000000000000000000000000000000000000000000001e-5",
            // 2^-60 EiB and a last digit more: one byte to parse-size, which rounds.
            "0.000000000000000000867361737988403547205962240695953369140626EiB",
        ] {
            let err = parse_bytes(bad).unwrap_err();
            assert!(err.contains("not a whole number of bytes") && err.contains(&format!("`{bad}`")), "{bad}: {err}");
        }
    }

    #[test]
    fn seconds() {
        assert_eq!(parse_seconds("0"), Ok(Duration::ZERO));
        assert_eq!(parse_seconds("2.5"), Ok(Duration::from_millis(2500)));
        assert_eq!(parse_seconds("-1"), Ok(Duration::ZERO));
        assert_eq!(parse_seconds("-inf"), Ok(Duration::ZERO));
        assert!(parse_seconds("NaN").unwrap_err().contains("NaN is not a number of seconds"));
        assert!(parse_seconds("inf").unwrap_err().contains("never ends"));
        assert!(parse_seconds("1e30").unwrap_err().contains("never ends"));
        assert!(parse_seconds("ten").is_err());
        assert_eq!(parse_wait_seconds("inf"), Ok(None));
        assert_eq!(parse_wait_seconds("1e300"), Ok(None));
        assert_eq!(parse_wait_seconds("0.5"), Ok(Some(Duration::from_millis(500))));
    }
}
