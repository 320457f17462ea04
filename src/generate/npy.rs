//! Captured logits and a minimal `.npy` writer (version 1.0, C order, `<f4`).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use super::error::{GenerateError, Result};

/// Logits rows `[rows, vocab]`, row-major float32.
///
/// From a generation with `P` prompt and `G` generated tokens there are `P + G − 1`
/// rows: row `i < P` holds the logits after prompt position `i` (row `P − 1` is the
/// distribution of generated token 0), row `P + j` the logits after feeding generated
/// token `j` (the distribution of token `j + 1`), for `j < G − 1`. The last generated
/// token is never fed.
#[derive(Debug, Clone, PartialEq)]
pub struct LogitsDump {
    /// Row width.
    pub vocab: usize,
    /// `rows × vocab` values.
    pub data: Vec<f32>,
}

impl LogitsDump {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.data.len().checked_div(self.vocab).unwrap_or(0)
    }

    /// Row `i`, if present.
    pub fn row(&self, i: usize) -> Option<&[f32]> {
        let start = i.checked_mul(self.vocab)?;
        self.data.get(start..start.checked_add(self.vocab)?)
    }

    /// Writes the rows as a `[rows, vocab]` float32 `.npy` file.
    pub fn write_npy(&self, path: &Path) -> Result<()> {
        write_npy_f32(path, &[self.rows(), self.vocab], &self.data)
    }
}

/// The `.npy` v1.0 header for a C-order little-endian float32 array of `shape`,
/// padded with spaces and a newline so the data starts at a multiple of 64 bytes.
pub fn npy_header(shape: &[usize]) -> Vec<u8> {
    let dims = match shape {
        [n] => format!("({n},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {dims}, }}");
    // magic (6) + version (2) + header length (2) + dict + padding + '\n'
    let unpadded = 10 + dict.len() + 1;
    let total = unpadded.div_ceil(64) * 64;
    let header_len = total - 10;
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    // A dict this short always fits the v1.0 u16 length field.
    out.extend_from_slice(&(u16::try_from(header_len).unwrap_or(u16::MAX)).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out.resize(total - 1, b' ');
    out.push(b'\n');
    out
}

/// Writes `data` (C order) as a float32 `.npy` array of `shape`.
pub fn write_npy_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    let count = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    if count != Some(data.len()) {
        return Err(GenerateError::InvalidParams(format!(
            "npy shape {shape:?} does not hold {} values",
            data.len()
        )));
    }
    let io = |source| GenerateError::Io {
        path: path.to_owned(),
        source,
    };
    let mut w = BufWriter::new(File::create(path).map_err(io)?);
    w.write_all(&npy_header(shape)).map_err(io)?;
    for x in data {
        w.write_all(&x.to_le_bytes()).map_err(io)?;
    }
    w.into_inner()
        .map_err(|e| io(e.into_error()))?
        .sync_all()
        .map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_aligned_and_parsable() {
        for shape in [vec![3usize, 5], vec![7], vec![123_456, 154_880]] {
            let h = npy_header(&shape);
            assert_eq!(h.len() % 64, 0);
            assert_eq!(&h[..8], b"\x93NUMPY\x01\x00");
            assert_eq!(usize::from(u16::from_le_bytes([h[8], h[9]])), h.len() - 10);
            assert_eq!(h.last(), Some(&b'\n'));
            let text = String::from_utf8_lossy(&h[10..]).to_string();
            assert!(text.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': ("));
        }
        assert!(String::from_utf8_lossy(&npy_header(&[7])).contains("'shape': (7,), }"));
    }

    #[test]
    fn write_rejects_wrong_shape_and_rows_are_indexed() {
        let dir = std::env::temp_dir().join(format!("glm-npy-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("x.npy");
        assert!(write_npy_f32(&path, &[2, 2], &[1.0; 3]).is_err());
        let dump = LogitsDump {
            vocab: 2,
            data: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        };
        assert_eq!(dump.rows(), 3);
        assert_eq!(dump.row(2), Some(&[5.0f32, 6.0][..]));
        assert_eq!(dump.row(3), None);
        dump.write_npy(&path).expect("write");
        let bytes = std::fs::read(&path).expect("read");
        let h = npy_header(&[3, 2]).len();
        assert_eq!(bytes.len(), h + 24);
        assert_eq!(&bytes[h..h + 4], &1.0f32.to_le_bytes());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
