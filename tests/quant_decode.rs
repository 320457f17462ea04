//! Decoder and format-resolution tests against an independent scalar reference
//! written from `docs/colibri-format.md` §3.2 / §3.3, and against the spec's tables.

use glm_stream::quant::{
    DecodeError, FormatError, FormatQuery, FormatSource, QuantFormat, UnsupportedFormat,
    decode_row, decode_rows, resolve_format, scales_from_le_bytes,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod common;
use common::reference;

const ALL_GS: [u32; 8] = [16, 32, 48, 64, 96, 128, 192, 256];

fn random_scales(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            // Non-zero, mixed sign and magnitude, including subnormal-ish products.
            let mag = 10f32.powi(rng.random_range(-12..3)) * rng.random_range(0.5f32..2.0);
            if rng.random_bool(0.2) { -mag } else { mag }
        })
        .collect()
}

fn assert_bits_eq(fast: &[f32], reference: &[f32], what: &str) {
    assert_eq!(fast.len(), reference.len(), "{what}: length");
    for (k, (a, b)) in fast.iter().zip(reference).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "{what}: element {k}: fast {a} vs reference {b}"
        );
    }
}

fn check_format(rng: &mut ChaCha8Rng, format: QuantFormat) {
    let mut w = vec![0u8; format.weight_bytes()];
    rng.fill(&mut w[..]);
    let s = random_scales(rng, format.scale_count());
    let want = reference(
        format.bits,
        format.group_size.map(|g| g as usize),
        format.rows,
        format.cols,
        &w,
        &s,
    );
    let mut got = vec![f32::NAN; format.numel()];
    decode_rows(&format, &w, &s, 0, format.rows, &mut got).unwrap();
    assert_bits_eq(&got, &want, &format.to_string());

    // A sub-range of rows, and every row alone through decode_row.
    if format.rows > 2 {
        let (first, n) = (1, format.rows - 2);
        let mut part = vec![0f32; n * format.cols];
        decode_rows(&format, &w, &s, first, n, &mut part).unwrap();
        assert_bits_eq(
            &part,
            &want[first * format.cols..(first + n) * format.cols],
            "row range",
        );
    }
    let stride = format.row_stride_bytes();
    let groups = format.groups_per_row();
    for r in 0..format.rows {
        let mut row = vec![0f32; format.cols];
        decode_row(
            &format,
            &w[r * stride..(r + 1) * stride],
            &s[r * groups..(r + 1) * groups],
            &mut row,
        )
        .unwrap();
        assert_bits_eq(
            &row,
            &want[r * format.cols..(r + 1) * format.cols],
            "decode_row",
        );
    }
}

#[test]
fn int8_row_matches_reference_random() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for &cols in &[1usize, 2, 3, 7, 64, 67, 129, 6144] {
        for &rows in &[1usize, 3, 5] {
            check_format(&mut rng, QuantFormat::int8_row(rows, cols));
        }
    }
}

#[test]
fn int8_extremes() {
    let f = QuantFormat::int8_row(1, 4);
    let w = [0x80u8, 0x7F, 0x00, 0xFF];
    let s = [0.5f32];
    let mut out = [0f32; 4];
    decode_rows(&f, &w, &s, 0, 1, &mut out).unwrap();
    assert_eq!(out, [-64.0, 63.5, 0.0, -0.5]);
    assert_bits_eq(&out, &reference(8, None, 1, 4, &w, &s), "int8 extremes");
}

#[test]
fn int4_row_matches_reference_random() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for &cols in &[1usize, 2, 3, 15, 64, 67, 129, 2048] {
        for &rows in &[1usize, 4, 7] {
            check_format(&mut rng, QuantFormat::int4_row(rows, cols));
        }
    }
}

#[test]
fn int4_grouped_matches_reference_every_gs() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for gs in ALL_GS {
        for &cols in &[1usize, 3, 16, 47, 67, 96, 129, 257, 512, 6144] {
            check_format(&mut rng, QuantFormat::int4_grouped(3, cols, gs));
        }
    }
}

#[test]
fn int4_nibble_extremes_and_odd_padding() {
    // Columns: 0 → low nibble 0 (−8), 1 → high nibble 15 (+7), 2 → low 15, final
    // byte's high nibble is padding (set to 0xF here to prove it is ignored).
    let f = QuantFormat::int4_row(1, 3);
    let w = [0xF0u8, 0xFF];
    let s = [2.0f32];
    let mut out = [0f32; 3];
    decode_rows(&f, &w, &s, 0, 1, &mut out).unwrap();
    assert_eq!(out, [-16.0, 14.0, 14.0]);
    assert_bits_eq(&out, &reference(4, None, 1, 3, &w, &s), "nibble extremes");
}

#[test]
fn spec_worked_examples() {
    // §3.2: byte 0x9F at (2j, 2j+1) → low 15 → +7s, high 9 → +1s.
    let s = 0.25f32;
    let f = QuantFormat::int4_row(1, 2);
    let mut out = [0f32; 2];
    decode_rows(&f, &[0x9F], &[s], 0, 1, &mut out).unwrap();
    assert_eq!(out, [7.0 * s, 1.0 * s]);
    // An all-0x88 row is zeros, in every int4 layout.
    for f in [
        QuantFormat::int4_row(2, 128),
        QuantFormat::int4_grouped(2, 128, 64),
    ] {
        let w = vec![0x88u8; f.weight_bytes()];
        let sc = vec![3.5f32; f.scale_count()];
        let mut out = vec![1f32; f.numel()];
        decode_rows(&f, &w, &sc, 0, 2, &mut out).unwrap();
        assert!(out.iter().all(|v| *v == 0.0), "{f}");
    }
    // Tie row from §8b: `88 6A 6A 4C 4C 2E 2E 1F` at scale 1 is
    // 0,0, +2,−2, +2,−2, +4,−4, +4,−4, +6,−6, +6,−6, +7,−7.
    let w = [0x88u8, 0x6A, 0x6A, 0x4C, 0x4C, 0x2E, 0x2E, 0x1F];
    let f = QuantFormat::int4_row(1, 16);
    let mut out = [0f32; 16];
    decode_rows(&f, &w, &[1.0], 0, 1, &mut out).unwrap();
    let want = [
        0., 0., 2., -2., 2., -2., 4., -4., 4., -4., 6., -6., 6., -6., 7., -7.,
    ];
    assert_eq!(out, want);
}

#[test]
fn decode_rejects_bad_lengths_without_panicking() {
    let f = QuantFormat::int4_grouped(4, 130, 64);
    let w = vec![0u8; f.weight_bytes()];
    let s = vec![1f32; f.scale_count()];
    let mut out = vec![0f32; f.numel()];
    assert!(matches!(
        decode_rows(&f, &w[1..], &s, 0, 4, &mut out),
        Err(DecodeError::WeightLength {
            expected: 260,
            got: 259,
            ..
        })
    ));
    assert!(matches!(
        decode_rows(&f, &w, &s[1..], 0, 4, &mut out),
        Err(DecodeError::ScaleLength {
            expected: 12,
            got: 11,
            ..
        })
    ));
    assert!(matches!(
        decode_rows(&f, &w, &s, 0, 4, &mut out[1..]),
        Err(DecodeError::OutputLength { .. })
    ));
    assert!(matches!(
        decode_rows(&f, &w, &s, 3, 2, &mut out),
        Err(DecodeError::RowRange { .. })
    ));
    assert!(matches!(
        decode_rows(&f, &w, &s, usize::MAX, 2, &mut out),
        Err(DecodeError::RowRange { .. })
    ));
    assert!(matches!(
        decode_row(&f, &w[..64], &s[..3], &mut out[..130]),
        Err(DecodeError::WeightLength { .. })
    ));
    let bad = QuantFormat {
        bits: 3,
        group_size: None,
        rows: 1,
        cols: 1,
    };
    assert!(matches!(
        decode_rows(&bad, &[0], &[1.0], 0, 1, &mut [0.0]),
        Err(DecodeError::Format(_))
    ));
    let zero_gs = QuantFormat::int4_grouped(1, 2, 0);
    assert!(decode_row(&zero_gs, &[0], &[1.0], &mut [0.0; 2]).is_err());
}

#[test]
fn scales_from_bytes() {
    let bytes: Vec<u8> = [1.5f32, -2.0, 1e-8]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(scales_from_le_bytes(&bytes).unwrap(), vec![1.5, -2.0, 1e-8]);
    assert_eq!(
        scales_from_le_bytes(&bytes[..5]),
        Err(DecodeError::ScaleBytes { len: 5 })
    );
    // The converter's floor scale is 0x322BCC77.
    assert_eq!(1e-8f32.to_bits(), 0x322B_CC77);
}

// ---------------------------------------------------------------- resolution

fn query(tensor: &str, nb: u64, ns: u64, rows: usize, cols: usize) -> FormatQuery<'_> {
    FormatQuery {
        tensor,
        weight_bytes: nb,
        scale_bytes: ns,
        rows,
        cols,
        group_size_hint: None,
        stamp: None,
    }
}

fn resolve(nb: u64, ns: u64, rows: usize, cols: usize) -> Result<QuantFormat, FormatError> {
    resolve_format(&query("t", nb, ns, rows, cols)).map(|r| r.format)
}

/// Every row of the §3.1 table: (name, O, I, int8 nb/ns, int4-row nb/ns, g64 nb/ns).
#[allow(clippy::type_complexity)]
const TABLE: &[(
    &str,
    usize,
    usize,
    [u64; 2],
    Option<[u64; 2]>,
    Option<[u64; 2]>,
)] = &[
    (
        "embed/lm_head",
        154880,
        6144,
        [951_582_720, 619_520],
        Some([475_791_360, 619_520]),
        Some([475_791_360, 59_473_920]),
    ),
    (
        "q_a_proj",
        2048,
        6144,
        [12_582_912, 8_192],
        Some([6_291_456, 8_192]),
        Some([6_291_456, 786_432]),
    ),
    (
        "q_b_proj",
        16384,
        2048,
        [33_554_432, 65_536],
        Some([16_777_216, 65_536]),
        Some([16_777_216, 2_097_152]),
    ),
    (
        "kv_a_proj_with_mqa",
        576,
        6144,
        [3_538_944, 2_304],
        Some([1_769_472, 2_304]),
        Some([1_769_472, 221_184]),
    ),
    (
        "kv_b_proj",
        28672,
        512,
        [14_680_064, 114_688],
        Some([7_340_032, 114_688]),
        Some([7_340_032, 917_504]),
    ),
    (
        "o_proj",
        6144,
        16384,
        [100_663_296, 24_576],
        Some([50_331_648, 24_576]),
        Some([50_331_648, 6_291_456]),
    ),
    (
        "dense gate/up",
        12288,
        6144,
        [75_497_472, 49_152],
        Some([37_748_736, 49_152]),
        Some([37_748_736, 4_718_592]),
    ),
    (
        "dense down",
        6144,
        12288,
        [75_497_472, 24_576],
        Some([37_748_736, 24_576]),
        Some([37_748_736, 4_718_592]),
    ),
    (
        "expert gate/up",
        2048,
        6144,
        [12_582_912, 8_192],
        Some([6_291_456, 8_192]),
        Some([6_291_456, 786_432]),
    ),
    (
        "expert down",
        6144,
        2048,
        [12_582_912, 24_576],
        Some([6_291_456, 24_576]),
        Some([6_291_456, 786_432]),
    ),
    ("eh_proj", 6144, 12288, [75_497_472, 24_576], None, None),
    ("indexer wq_b", 4096, 2048, [8_388_608, 16_384], None, None),
    ("indexer wk", 128, 6144, [786_432, 512], None, None),
    ("indexer weights_proj", 32, 6144, [196_608, 128], None, None),
];

#[test]
fn glm52_table_resolves_and_matches_descriptors() {
    for &(name, o, i, int8, int4, g64) in TABLE {
        let f8 = QuantFormat::int8_row(o, i);
        assert_eq!(
            [f8.weight_bytes() as u64, f8.scale_bytes() as u64],
            int8,
            "{name} int8 sizes"
        );
        assert_eq!(resolve(int8[0], int8[1], o, i), Ok(f8), "{name} int8");
        if let Some(int4) = int4 {
            let f = QuantFormat::int4_row(o, i);
            assert_eq!(
                [f.weight_bytes() as u64, f.scale_bytes() as u64],
                int4,
                "{name} int4 sizes"
            );
            assert_eq!(resolve(int4[0], int4[1], o, i), Ok(f), "{name} int4-row");
        }
        if let Some(g64) = g64 {
            let f = QuantFormat::int4_grouped(o, i, 64);
            assert_eq!(
                [f.weight_bytes() as u64, f.scale_bytes() as u64],
                g64,
                "{name} g64 sizes"
            );
            assert_eq!(resolve(g64[0], g64[1], o, i), Ok(f), "{name} g64");
        }
    }
}

#[test]
fn every_group_size_resolves_on_glm_shapes() {
    // §3.3: for GLM-5.2 shapes every candidate gives a distinct count.
    for &(name, o, i, ..) in TABLE {
        for gs in ALL_GS {
            let f = QuantFormat::int4_grouped(o, i, gs);
            let got = resolve(f.weight_bytes() as u64, f.scale_bytes() as u64, o, i);
            assert_eq!(got, Ok(f), "{name} gs {gs}");
        }
    }
}

#[test]
fn expert_totals_from_descriptors() {
    let total = |f: fn(usize, usize) -> QuantFormat| -> usize {
        [f(2048, 6144), f(2048, 6144), f(6144, 2048)]
            .iter()
            .map(|q| q.weight_bytes() + q.scale_bytes())
            .sum()
    };
    assert_eq!(
        total(|o, i| QuantFormat::int4_grouped(o, i, 64)),
        21_233_664
    );
    assert_eq!(total(QuantFormat::int4_row), 18_915_328);
    assert_eq!(total(QuantFormat::int8_row), 37_789_696);
}

#[test]
fn o_proj_collision_resolves_to_int8_row() {
    // ceil(6144/128)·ceil(16384/128) = 6144 = O: fp8-b128 F32 scales have the
    // same size as int8 per-row scales. Unstamped → int8-row.
    let r = resolve_format(&query("o_proj", 100_663_296, 24_576, 6144, 16384)).unwrap();
    assert_eq!(r.format, QuantFormat::int8_row(6144, 16384));
    assert_eq!(r.source, FormatSource::ByteCounts);
    // A stamp saying fp8 makes it an (unsupported) fp8 tensor.
    let mut q = query("o_proj", 100_663_296, 24_576, 6144, 16384);
    q.stamp = Some("fp8-e4m3-b128");
    assert_eq!(
        resolve_format(&q),
        Err(FormatError::Unsupported {
            tensor: "o_proj".into(),
            format: UnsupportedFormat::Fp8B128
        })
    );
}

#[test]
fn gs48_vs_gs64_ambiguity_settled_by_params() {
    // I = 80: ceil(80/48) = ceil(80/64) = 2 groups, so byte counts alone pick 48.
    let (o, i) = (10usize, 80usize);
    let f = QuantFormat::int4_grouped(o, i, 64);
    let (nb, ns) = (f.weight_bytes() as u64, f.scale_bytes() as u64);
    assert_eq!(
        resolve(nb, ns, o, i),
        Ok(QuantFormat::int4_grouped(o, i, 48))
    );
    let mut q = query("t", nb, ns, o, i);
    q.group_size_hint = Some(64);
    let r = resolve_format(&q).unwrap();
    assert_eq!(r.format, f);
    assert_eq!(r.source, FormatSource::ParamsGroupSize);
    // A hint that does not fit the bytes is ignored.
    q.group_size_hint = Some(16);
    assert_eq!(
        resolve_format(&q).unwrap().format,
        QuantFormat::int4_grouped(o, i, 48)
    );
    // Also 129..=144: g64 and g48 both give 3 groups.
    let f = QuantFormat::int4_grouped(4, 130, 64);
    let mut q = query("t", f.weight_bytes() as u64, f.scale_bytes() as u64, 4, 130);
    assert_eq!(resolve_format(&q).unwrap().format.group_size, Some(48));
    q.group_size_hint = Some(64);
    assert_eq!(resolve_format(&q).unwrap().format, f);
}

#[test]
fn candidates_larger_than_width_are_skipped() {
    // I = 20: gs 16 gives 2 groups; gs 32.. would give 1 (= per-row) and are skipped.
    let f = QuantFormat::int4_grouped(3, 20, 16);
    assert_eq!(
        resolve(f.weight_bytes() as u64, f.scale_bytes() as u64, 3, 20),
        Ok(f)
    );
    // 3 scales per row at I = 20 fit no candidate → scale count error naming int4-row.
    let err = resolve(30, 36, 3, 20).unwrap_err();
    assert!(
        matches!(
            err,
            FormatError::ScaleCount {
                format: "int4-row",
                expected_bytes: 12,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn unsupported_formats_are_refused_by_name() {
    let (o, i) = (2048usize, 6144usize);
    let cases: [(u64, u64, UnsupportedFormat); 5] = [
        (
            (o * i.div_ceil(256) * 98) as u64,
            4,
            UnsupportedFormat::E8Lattice,
        ),
        (
            (o * i.div_ceil(4)) as u64,
            (4 * o) as u64,
            UnsupportedFormat::Int2Row,
        ),
        (
            (o * i.div_ceil(64) * 24) as u64,
            (4 * o * i.div_ceil(64)) as u64,
            UnsupportedFormat::Int3G64,
        ),
        (
            (o * i) as u64,
            (4 * o.div_ceil(128) * i.div_ceil(128)) as u64,
            UnsupportedFormat::Fp8B128,
        ),
        (
            (o * i) as u64,
            (o.div_ceil(128) * i.div_ceil(128)) as u64,
            UnsupportedFormat::Fp8Ue8m0,
        ),
    ];
    for (nb, ns, want) in cases {
        let err = resolve_format(&query(
            "model.layers.5.self_attn.q_a_proj.weight",
            nb,
            ns,
            o,
            i,
        ))
        .unwrap_err();
        assert_eq!(
            err,
            FormatError::Unsupported {
                tensor: "model.layers.5.self_attn.q_a_proj.weight".into(),
                format: want
            }
        );
        let msg = err.to_string();
        assert!(
            msg.contains(want.name()) && msg.contains("q_a_proj"),
            "{msg}"
        );
    }
    for (stamp, want) in [
        ("mxfp4", UnsupportedFormat::Mxfp4),
        ("int4-rans256-g0", UnsupportedFormat::Int4Rans256),
        ("e8-iq3-lattice", UnsupportedFormat::E8Lattice),
        ("int2-row", UnsupportedFormat::Int2Row),
        ("int3-g64", UnsupportedFormat::Int3G64),
    ] {
        let mut q = query("w", 6_291_456, 786_432, o, i);
        q.stamp = Some(stamp);
        assert_eq!(
            resolve_format(&q),
            Err(FormatError::Unsupported {
                tensor: "w".into(),
                format: want
            })
        );
    }
}

#[test]
fn no_match_and_bad_scale_counts() {
    let err = resolve(12_345, 8_192, 2048, 6144).unwrap_err();
    assert_eq!(
        err,
        FormatError::NoMatch {
            tensor: "t".into(),
            weight_bytes: 12_345,
            scale_bytes: 8_192,
            rows: 2048,
            cols: 6144
        }
    );
    assert!(err.to_string().contains("12345"));
    // int8 bytes with a scale count that is neither per-row nor a block layout.
    let err = resolve(12_582_912, 8_196, 2048, 6144).unwrap_err();
    assert!(matches!(
        err,
        FormatError::ScaleCount {
            format: "int8-row",
            expected_bytes: 8192,
            ..
        }
    ));
    // int4 bytes with too few scales.
    let err = resolve(6_291_456, 4, 2048, 6144).unwrap_err();
    assert!(matches!(
        err,
        FormatError::ScaleCount {
            format: "int4-row",
            ..
        }
    ));
    // Zero dimension.
    assert!(matches!(
        resolve(0, 0, 0, 5),
        Err(FormatError::EmptyShape { .. })
    ));
    // Huge shapes saturate/overflow and match nothing, without panicking.
    assert!(resolve(u64::MAX, u64::MAX, usize::MAX, usize::MAX).is_err());
}

#[test]
fn stamps_are_verified() {
    let mut q = query("w", 6_291_456, 786_432, 2048, 6144);
    q.stamp = Some("int4-grouped");
    let r = resolve_format(&q).unwrap();
    assert_eq!(
        (r.format, r.source),
        (
            QuantFormat::int4_grouped(2048, 6144, 64),
            FormatSource::Stamp
        )
    );
    q.stamp = Some("int8-row");
    assert!(matches!(
        resolve_format(&q),
        Err(FormatError::StampMismatch { .. })
    ));
    q.stamp = Some("int4-row");
    assert!(matches!(
        resolve_format(&q),
        Err(FormatError::StampMismatch { .. })
    ));
    q.stamp = Some("bogus-format");
    assert!(matches!(
        resolve_format(&q),
        Err(FormatError::UnknownStamp { .. })
    ));
    let mut q = query("w", 6_291_456, 8_192, 2048, 6144);
    q.stamp = Some("int4-row");
    assert_eq!(
        resolve_format(&q).unwrap().format,
        QuantFormat::int4_row(2048, 6144)
    );
}

#[test]
fn descriptor_helpers() {
    let f = QuantFormat::int4_grouped(3, 67, 64);
    assert_eq!(
        (
            f.row_stride_bytes(),
            f.weight_bytes(),
            f.groups_per_row(),
            f.scale_count()
        ),
        (34, 102, 2, 6)
    );
    let f = QuantFormat::int8_row(3, 67);
    assert_eq!(
        (
            f.row_stride_bytes(),
            f.weight_bytes(),
            f.groups_per_row(),
            f.scale_count()
        ),
        (67, 201, 1, 3)
    );
    let f = QuantFormat::int4_row(3, 67);
    assert_eq!(
        (
            f.row_stride_bytes(),
            f.weight_bytes(),
            f.groups_per_row(),
            f.scale_count()
        ),
        (34, 102, 1, 3)
    );
}
