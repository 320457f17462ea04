//! The independent scalar reference decoder of the Colibri formats (spec §3.2).

/// Reference decoder, one element at a time, straight from §3.2:
/// int8: `value = float(int8(w[o·I + i])) · s[o]`;
/// int4: byte `w[o·rb + i/2]`, nibble `(b >> 4·(i%2)) & 15`, `value = float(n − 8) · s[o·ng + i/gs]`.
pub fn reference(
    bits: u8,
    gs: Option<usize>,
    rows: usize,
    cols: usize,
    w: &[u8],
    s: &[f32],
) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * cols);
    for o in 0..rows {
        for i in 0..cols {
            let v = if bits == 8 {
                let q = w[o * cols + i] as i8;
                (q as f32) * s[o]
            } else {
                let rb = cols.div_ceil(2);
                let b = w[o * rb + i / 2];
                let n = (b >> (4 * (i % 2))) & 15;
                let scale = match gs {
                    None => s[o],
                    Some(g) => {
                        let ng = cols.div_ceil(g);
                        s[o * ng + i / g]
                    }
                };
                ((n as i32 - 8) as f32) * scale
            };
            out.push(v);
        }
    }
    out
}
