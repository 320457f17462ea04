//! FP8 E4M3 ("e4m3fn", the `F8_E4M3` safetensors dtype) conversion.
//!
//! Layout of a byte: sign (bit 7), 4 exponent bits (bias 7), 3 mantissa bits. Exponent
//! 0 is subnormal (`m/8 · 2^-6`); there are no infinities; `S.1111.111` is NaN; the
//! largest finite magnitude is 448. Every finite value is exactly representable in
//! `f32`. Written from the OCP 8-bit floating point definition; no crate in the
//! dependency set handles it, and the table is small enough to test exhaustively.

/// Decodes one E4M3 byte to `f32` (NaN for the two NaN codes).
pub fn e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = i32::from((byte >> 3) & 0x0F);
    let man = f32::from(byte & 0x07);
    if exp == 0x0F && byte & 0x07 == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        man / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    };
    sign * magnitude
}

/// A 256-entry decode table (`table[b] == e4m3_to_f32(b)`).
pub fn e4m3_table() -> [f32; 256] {
    let mut table = [0.0f32; 256];
    for (b, slot) in (0u8..=255).zip(table.iter_mut()) {
        *slot = e4m3_to_f32(b);
    }
    table
}

/// Encodes `x` to the nearest E4M3 value (ties to the even code), saturating at ±448.
/// NaN encodes as `0x7F`.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    // Positive finite codes 0x00..=0x7E decode to increasing magnitudes.
    let (mut lo, mut hi) = (0u8, 0x7Eu8);
    if a >= e4m3_to_f32(hi) {
        return sign | hi;
    }
    // Invariant: value(lo) <= a < value(hi).
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if e4m3_to_f32(mid) <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (dl, dh) = (a - e4m3_to_f32(lo), e4m3_to_f32(hi) - a);
    let pick = if dl < dh || (dl == dh && lo % 2 == 0) {
        lo
    } else {
        hi
    };
    sign | pick
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exhaustive_decode_matches_definition() {
        let table = e4m3_table();
        for b in 0u8..=255 {
            let v = table[b as usize];
            let s = if b & 0x80 != 0 { -1.0f64 } else { 1.0 };
            let e = ((b >> 3) & 0xF) as i32;
            let m = (b & 7) as f64;
            if e == 15 && m == 7.0 {
                assert!(v.is_nan(), "{b:#x}");
                continue;
            }
            let expect = if e == 0 {
                s * m * 2f64.powi(-9)
            } else {
                s * (8.0 + m) * 2f64.powi(e - 10)
            };
            assert_eq!(v as f64, expect, "{b:#x}");
        }
        assert_eq!(table[0x7E], 448.0);
        assert_eq!(table[0x01], 2f32.powi(-9));
        assert_eq!(table[0x08], 2f32.powi(-6));
        assert_eq!(table[0xFE], -448.0);
    }

    #[test]
    fn encode_round_trips_every_finite_code() {
        for b in 0u8..=255 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                continue;
            }
            let back = f32_to_e4m3(v);
            // +0 and -0 both round-trip to their own code.
            assert_eq!(back, b, "{b:#x} -> {v}");
        }
        assert_eq!(f32_to_e4m3(1000.0), 0x7E);
        assert_eq!(f32_to_e4m3(-1000.0), 0xFE);
        // Halfway between 1.0 (0x38) and 1.125 (0x39) goes to the even code.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3A);
    }
}
