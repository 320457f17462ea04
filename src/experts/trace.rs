//! The routing of a run: which routed experts every MoE layer asked for, in
//! execution order, so it can be saved and replayed through residency
//! policies ([`super::replay`]).
//!
//! A [`RoutingTrace`] is a list of [`LayerRouting`] records, one per MoE
//! layer per model pass, in the order they ran. Each record holds the layer,
//! the forward call it belongs to and the expert ids of every row (token),
//! row-major, `top_k` per row.
//!
//! # File format
//!
//! JSON lines. The first line is a header, every further non-empty line one
//! record:
//!
//! ```text
//! {"format":"glm-stream-routing-trace","version":1,"experts":256,"top_k":8}
//! {"call":0,"layer":3,"ids":[17,4,250,9,33,120,7,64]}
//! ```
//!
//! `ids.len()` is a multiple of `top_k` (`ids.len() / top_k` rows).

use serde::{Deserialize, Serialize};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

/// The `format` value of a trace file's header.
pub const TRACE_FORMAT: &str = "glm-stream-routing-trace";
/// The version this module writes and reads.
pub const TRACE_VERSION: u32 = 1;

/// An error building, reading or writing a [`RoutingTrace`].
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// A record that does not fit the trace's shape.
    #[error("call {call} layer {layer}: {message}")]
    InvalidRecord {
        /// Forward call of the record.
        call: u64,
        /// Its layer.
        layer: u32,
        /// What is wrong.
        message: String,
    },
    /// A trace shape that cannot hold any routing.
    #[error("invalid trace shape: {0}")]
    InvalidShape(String),
    /// A line of a trace file could not be parsed.
    #[error("{}: line {line}: {message}", path.display())]
    Parse {
        /// The file (or `<reader>`).
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// An I/O error on a trace file.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file (or `<reader>` / `<writer>`).
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// One MoE layer's routing in one model pass.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerRouting {
    /// Index of the forward call (counted by the recorder) this pass belongs to.
    pub call: u64,
    /// The MoE layer.
    pub layer: u32,
    /// Expert ids, `top_k` per row, row-major.
    pub ids: Vec<u32>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    format: String,
    version: u32,
    experts: u32,
    top_k: usize,
}

/// The routing of a run, in execution order (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingTrace {
    experts: u32,
    top_k: usize,
    records: Vec<LayerRouting>,
}

impl RoutingTrace {
    /// An empty trace for layers of `experts` routed experts, `top_k` per row.
    pub fn new(experts: u32, top_k: usize) -> Result<Self, TraceError> {
        if experts == 0 || top_k == 0 || top_k > experts as usize {
            return Err(TraceError::InvalidShape(format!(
                "top-{top_k} of {experts} experts"
            )));
        }
        Ok(Self {
            experts,
            top_k,
            records: Vec::new(),
        })
    }

    /// Routed experts per layer.
    pub fn experts(&self) -> u32 {
        self.experts
    }

    /// Experts per row.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The records in execution order.
    pub fn records(&self) -> &[LayerRouting] {
        &self.records
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// True when nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Drops every record.
    pub fn clear(&mut self) {
        self.records.clear();
    }

    /// Keeps the first `len` records.
    pub fn truncate(&mut self, len: usize) {
        self.records.truncate(len);
    }

    /// One past the largest layer recorded (0 when empty).
    pub fn layer_count(&self) -> u32 {
        self.records.iter().map(|r| r.layer + 1).max().unwrap_or(0)
    }

    /// Total rows over all records (tokens × MoE layers for a decode).
    pub fn rows(&self) -> usize {
        self.records.iter().map(|r| r.ids.len() / self.top_k).sum()
    }

    /// Appends the routing of `layer` in forward call `call`: `ids` holds
    /// `top_k` distinct ids `< experts` per row. Calls must not go backwards.
    pub fn push(&mut self, call: u64, layer: u32, ids: Vec<u32>) -> Result<(), TraceError> {
        let record = LayerRouting { call, layer, ids };
        self.check(&record)?;
        self.records.push(record);
        Ok(())
    }

    fn check(&self, r: &LayerRouting) -> Result<(), TraceError> {
        let bad = |message: String| TraceError::InvalidRecord {
            call: r.call,
            layer: r.layer,
            message,
        };
        if let Some(last) = self.records.last() {
            if r.call < last.call {
                return Err(bad(format!("follows call {}", last.call)));
            }
        }
        if r.ids.is_empty() || r.ids.len() % self.top_k != 0 {
            return Err(bad(format!(
                "{} ids are not a positive whole number of rows of {}",
                r.ids.len(),
                self.top_k
            )));
        }
        for (row, ids) in r.ids.chunks_exact(self.top_k).enumerate() {
            for (i, &e) in ids.iter().enumerate() {
                if e >= self.experts {
                    return Err(bad(format!(
                        "row {row}: expert {e} is outside 0..{}",
                        self.experts
                    )));
                }
                if ids[..i].contains(&e) {
                    return Err(bad(format!("row {row}: expert {e} appears twice")));
                }
            }
        }
        Ok(())
    }

    /// Writes the trace as JSON lines (see the module docs).
    pub fn write_jsonl(&self, mut w: impl Write) -> Result<(), TraceError> {
        let io = |source| TraceError::Io {
            path: PathBuf::from("<writer>"),
            source,
        };
        let header = Header {
            format: TRACE_FORMAT.to_owned(),
            version: TRACE_VERSION,
            experts: self.experts,
            top_k: self.top_k,
        };
        serde_json::to_writer(&mut w, &header).map_err(|e| io(e.into()))?;
        w.write_all(b"\n").map_err(io)?;
        for r in &self.records {
            serde_json::to_writer(&mut w, r).map_err(|e| io(e.into()))?;
            w.write_all(b"\n").map_err(io)?;
        }
        w.flush().map_err(io)
    }

    /// Reads a trace written by [`RoutingTrace::write_jsonl`]; every record
    /// is validated as by [`RoutingTrace::push`].
    pub fn read_jsonl(r: impl BufRead) -> Result<Self, TraceError> {
        Self::read_named(r, Path::new("<reader>"))
    }

    fn read_named(r: impl BufRead, path: &Path) -> Result<Self, TraceError> {
        let parse = |line: usize, message: String| TraceError::Parse {
            path: path.to_path_buf(),
            line,
            message,
        };
        let mut trace: Option<Self> = None;
        for (n, line) in r.lines().enumerate() {
            let line = line.map_err(|source| TraceError::Io {
                path: path.to_path_buf(),
                source,
            })?;
            if line.trim().is_empty() {
                continue;
            }
            match &mut trace {
                None => {
                    let h: Header =
                        serde_json::from_str(&line).map_err(|e| parse(n + 1, e.to_string()))?;
                    if h.format != TRACE_FORMAT || h.version != TRACE_VERSION {
                        return Err(parse(
                            n + 1,
                            format!(
                                "header is {:?} version {}, expected {TRACE_FORMAT:?} version {TRACE_VERSION}",
                                h.format, h.version
                            ),
                        ));
                    }
                    trace = Some(
                        Self::new(h.experts, h.top_k).map_err(|e| parse(n + 1, e.to_string()))?,
                    );
                }
                Some(t) => {
                    let rec: LayerRouting =
                        serde_json::from_str(&line).map_err(|e| parse(n + 1, e.to_string()))?;
                    t.check(&rec).map_err(|e| parse(n + 1, e.to_string()))?;
                    t.records.push(rec);
                }
            }
        }
        trace.ok_or_else(|| parse(1, "no header line".into()))
    }

    /// Writes the trace to `path` (a temporary file renamed into place).
    pub fn save(&self, path: &Path) -> Result<(), TraceError> {
        let io = |source| TraceError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let file = std::fs::File::create(&tmp).map_err(io)?;
        self.write_jsonl(std::io::BufWriter::new(file))
            .map_err(|e| match e {
                TraceError::Io { source, .. } => io(source),
                other => other,
            })?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Reads the trace in `path`.
    pub fn load(path: &Path) -> Result<Self, TraceError> {
        let file = std::fs::File::open(path).map_err(|source| TraceError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::read_named(std::io::BufReader::new(file), path)
    }

    /// The requests a pool of `wave_capacity` slots serves for this trace, as
    /// the streamed executor issues them: per record, the distinct experts of
    /// all its rows in ascending id order (the batch union), cut into waves
    /// of at most `wave_capacity` experts (at least 1). A decode step of one
    /// row gives one request of `top_k` experts per MoE layer.
    pub fn requests(&self, wave_capacity: usize) -> Vec<Request> {
        let cap = wave_capacity.max(1);
        let mut out = Vec::new();
        let mut seen = vec![false; self.experts as usize];
        for (record, r) in self.records.iter().enumerate() {
            seen.iter_mut().for_each(|s| *s = false);
            for &e in &r.ids {
                seen[e as usize] = true;
            }
            let union: Vec<u32> = (0..self.experts).filter(|&e| seen[e as usize]).collect();
            for wave in union.chunks(cap) {
                out.push(Request {
                    record,
                    layer: r.layer,
                    experts: wave.to_vec(),
                });
            }
        }
        out
    }
}

/// Experts of one layer that must be resident together (one executor wave).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Index of the [`LayerRouting`] record it comes from.
    pub record: usize,
    /// The layer.
    pub layer: u32,
    /// Distinct expert ids, ascending.
    pub experts: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RoutingTrace {
        let mut t = RoutingTrace::new(8, 2).unwrap();
        t.push(0, 1, vec![3, 1, 1, 5, 0, 3]).unwrap();
        t.push(0, 2, vec![7, 6, 6, 2, 2, 7]).unwrap();
        t.push(1, 1, vec![4, 0]).unwrap();
        t
    }

    #[test]
    fn jsonl_round_trip() {
        let t = sample();
        let mut buf = Vec::new();
        t.write_jsonl(&mut buf).unwrap();
        let text = String::from_utf8(buf.clone()).unwrap();
        assert!(text.starts_with("{\"format\":\"glm-stream-routing-trace\""));
        assert_eq!(text.lines().count(), 4);
        let back = RoutingTrace::read_jsonl(&buf[..]).unwrap();
        assert_eq!(back, t);
        assert_eq!(back.rows(), 3 + 3 + 1);
        assert_eq!(back.layer_count(), 3);
    }

    #[test]
    fn save_and_load() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.jsonl");
        let t = sample();
        t.save(&path).unwrap();
        assert_eq!(RoutingTrace::load(&path).unwrap(), t);
        assert!(matches!(
            RoutingTrace::load(&dir.path().join("missing")),
            Err(TraceError::Io { .. })
        ));
    }

    #[test]
    fn rejects_bad_records_and_files() {
        let mut t = RoutingTrace::new(4, 2).unwrap();
        assert!(t.push(0, 0, vec![1]).is_err(), "partial row");
        assert!(t.push(0, 0, vec![]).is_err(), "empty");
        assert!(t.push(0, 0, vec![1, 4]).is_err(), "id out of range");
        assert!(t.push(0, 0, vec![2, 2]).is_err(), "duplicate");
        t.push(3, 0, vec![0, 1]).unwrap();
        assert!(t.push(2, 0, vec![0, 1]).is_err(), "call going backwards");
        assert_eq!(t.len(), 1);
        assert!(RoutingTrace::new(0, 1).is_err());
        assert!(RoutingTrace::new(4, 5).is_err());

        let bad = [
            "",
            "{\"format\":\"other\",\"version\":1,\"experts\":4,\"top_k\":2}\n",
            "{\"format\":\"glm-stream-routing-trace\",\"version\":1,\"experts\":4,\"top_k\":2}\nnot json\n",
            "{\"format\":\"glm-stream-routing-trace\",\"version\":1,\"experts\":4,\"top_k\":2}\n{\"call\":0,\"layer\":0,\"ids\":[0,9]}\n",
        ];
        for (i, text) in bad.iter().enumerate() {
            let e = RoutingTrace::read_jsonl(text.as_bytes());
            assert!(
                matches!(e, Err(TraceError::Parse { .. })),
                "case {i}: {e:?}"
            );
        }
    }

    #[test]
    fn requests_are_batch_unions_cut_into_waves() {
        let t = sample();
        let r = t.requests(3);
        let got: Vec<(usize, u32, Vec<u32>)> = r
            .into_iter()
            .map(|q| (q.record, q.layer, q.experts))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, 1, vec![0, 1, 3]),
                (0, 1, vec![5]),
                (1, 2, vec![2, 6, 7]),
                (2, 1, vec![0, 4]),
            ]
        );
        assert_eq!(t.requests(0).len(), 4 + 3 + 2);
    }
}
