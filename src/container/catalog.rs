//! The tensor catalog: every tensor of every shard, by name, with its absolute
//! byte range, plus the family classification used by the loaders.
//!
//! Shards are found the way the engine finds them (every file whose last
//! extension is `.safetensors`, sorted; the file names are never parsed), so a
//! re-packed upload with different shard names reads the same.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use safetensors::Dtype;

use super::config::{ExpertProj, Glm52Config, routed_expert_coords, split_layer};
use super::error::{ContainerError, Result};
use super::header::{ShardHeader, read_shard_header, scan_shards};

/// Most shards the engine accepts (`ST_MAX_SHARDS`).
pub const MAX_SHARDS: usize = 512;

/// One shard file.
#[derive(Debug)]
pub struct Shard {
    /// Path of the file.
    pub path: PathBuf,
    /// Size in bytes at open.
    pub file_size: u64,
    /// `N`, the header JSON length.
    pub header_len: u64,
    /// Tensors listed in it.
    pub tensor_count: usize,
    /// Open handle used for positioned reads.
    pub(crate) file: File,
}

/// One stored tensor (a weight, a `.qs` companion or a float tensor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// Tensor name as stored.
    pub name: String,
    /// Index into [`Catalog::shards`].
    pub shard: usize,
    /// Absolute file offset of the first byte (`8 + N + begin`).
    pub offset: u64,
    /// Byte length (`end − begin`).
    pub len: u64,
    /// Stored dtype.
    pub dtype: Dtype,
    /// Stored shape (ignore it for `U8` weights, §2).
    pub shape: Vec<u64>,
}

/// What a tensor is, by name (§3 table). `.qs` companions are not classified:
/// they belong to their weight.
///
/// **MTP:** every tensor of a layer `>= num_hidden_layers` (the nextn layer,
/// including its attention, norms, `eh_proj`, `enorm`/`hnorm`, `shared_head` and its
/// 256 routed experts) is [`TensorFamily::Mtp`], so resident loaders can include or
/// exclude the MTP head as one unit. The streamed-experts path still needs
/// `(layer, expert, proj)` of the MTP experts; [`routed_expert_coords`] gives that
/// for any layer, and [`TensorFamily::classify_ignoring_mtp`] gives the family a
/// layer-78 tensor would have in a regular layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TensorFamily {
    /// `model.embed_tokens.weight`.
    Embedding,
    /// `lm_head.weight`.
    LmHead,
    /// MLA projections `q_a/q_b/kv_a/kv_b/o_proj`.
    Attention,
    /// DSA indexer `wq_b`, `wk`, `weights_proj`, `k_norm`.
    Indexer,
    /// RMSNorm weights (layer norms, q_a/kv_a norms, final norm).
    Norm,
    /// `mlp.gate.weight` (F32).
    Router,
    /// `mlp.gate.e_score_correction_bias` (F32).
    RouterBias,
    /// `mlp.shared_experts.*`.
    SharedExpert,
    /// `mlp.experts.E.*` of a decoder layer.
    RoutedExpert {
        /// Decoder layer.
        layer: usize,
        /// Expert id.
        expert: usize,
        /// Projection.
        proj: ExpertProj,
    },
    /// Dense `mlp.{gate,up,down}_proj` of the first layers.
    DenseMlp,
    /// Anything in an MTP layer (`layer >= num_hidden_layers`).
    Mtp,
    /// A name outside the known GLM layout.
    Other,
}

impl TensorFamily {
    /// Classifies a logical tensor name.
    pub fn classify(name: &str, config: &Glm52Config) -> Self {
        match split_layer(name) {
            Some((layer, _)) if config.is_mtp_layer(layer) => Self::Mtp,
            _ => Self::classify_ignoring_mtp(name),
        }
    }

    /// Classifies by name as if every layer were a regular decoder layer.
    pub fn classify_ignoring_mtp(name: &str) -> Self {
        match name {
            "model.embed_tokens.weight" => return Self::Embedding,
            "lm_head.weight" => return Self::LmHead,
            "model.norm.weight" => return Self::Norm,
            _ => {}
        }
        if let Some((layer, expert, proj)) = routed_expert_coords(name) {
            return Self::RoutedExpert {
                layer,
                expert,
                proj,
            };
        }
        let Some((_, rest)) = split_layer(name) else {
            return Self::Other;
        };
        if rest.starts_with("self_attn.indexer.") {
            return Self::Indexer;
        }
        match rest {
            "input_layernorm.weight"
            | "post_attention_layernorm.weight"
            | "self_attn.q_a_layernorm.weight"
            | "self_attn.kv_a_layernorm.weight"
            | "enorm.weight"
            | "hnorm.weight"
            | "shared_head.norm.weight" => Self::Norm,
            "self_attn.q_a_proj.weight"
            | "self_attn.q_b_proj.weight"
            | "self_attn.kv_a_proj_with_mqa.weight"
            | "self_attn.kv_b_proj.weight"
            | "self_attn.o_proj.weight" => Self::Attention,
            "mlp.gate.weight" => Self::Router,
            "mlp.gate.e_score_correction_bias" => Self::RouterBias,
            "mlp.gate_proj.weight" | "mlp.up_proj.weight" | "mlp.down_proj.weight" => {
                Self::DenseMlp
            }
            _ if rest.starts_with("mlp.shared_experts.") => Self::SharedExpert,
            _ => Self::Other,
        }
    }

    /// Short label for summaries (`routed_expert` for every expert coordinate).
    pub fn label(&self) -> &'static str {
        match self {
            Self::Embedding => "embedding",
            Self::LmHead => "lm_head",
            Self::Attention => "attention",
            Self::Indexer => "indexer",
            Self::Norm => "norm",
            Self::Router => "router",
            Self::RouterBias => "router_bias",
            Self::SharedExpert => "shared_expert",
            Self::RoutedExpert { .. } => "routed_expert",
            Self::DenseMlp => "dense_mlp",
            Self::Mtp => "mtp",
            Self::Other => "other",
        }
    }
}

/// Suffix of a scale companion.
pub const SCALES_SUFFIX: &str = ".qs";

/// All shards and tensors of a container directory.
#[derive(Debug, Default)]
pub struct Catalog {
    /// Shards in path order.
    pub shards: Vec<Shard>,
    /// Every stored tensor by name (weights, `.qs`, floats).
    pub tensors: BTreeMap<String, TensorEntry>,
    /// Merged `colibri.fmt` stamps of all shards.
    pub fmt_stamps: HashMap<String, String>,
}

impl Catalog {
    /// Scans `dir`, reads every shard header and builds the name index.
    /// Zero-tensor shards are accepted; a name in two shards is an error.
    pub fn scan(dir: &Path) -> Result<Self> {
        let paths = scan_shards(dir)?;
        if paths.is_empty() {
            return Err(ContainerError::NoShards {
                dir: dir.to_owned(),
            });
        }
        if paths.len() > MAX_SHARDS {
            return Err(ContainerError::TooManyShards {
                dir: dir.to_owned(),
                count: paths.len(),
                max: MAX_SHARDS,
            });
        }
        let mut catalog = Self::default();
        for path in paths {
            let (file, file_size, header) = read_shard_header(&path)?;
            catalog.add_shard(path, file, file_size, header)?;
        }
        Ok(catalog)
    }

    fn add_shard(
        &mut self,
        path: PathBuf,
        file: File,
        file_size: u64,
        header: ShardHeader,
    ) -> Result<()> {
        let index = self.shards.len();
        let data_start = header.data_start();
        for t in &header.tensors {
            if let Some(existing) = self.tensors.get(&t.name) {
                let first = self
                    .shards
                    .get(existing.shard)
                    .map(|s| s.path.clone())
                    .unwrap_or_default();
                return Err(ContainerError::DuplicateTensor {
                    tensor: t.name.clone(),
                    first,
                    second: path,
                });
            }
            let entry = TensorEntry {
                name: t.name.clone(),
                shard: index,
                offset: data_start + t.begin,
                len: t.end - t.begin,
                dtype: t.dtype,
                shape: t.shape.clone(),
            };
            self.tensors.insert(t.name.clone(), entry);
        }
        for (name, stamp) in header.fmt_stamps {
            match self.fmt_stamps.get(&name) {
                Some(prev) if *prev != stamp => {
                    return Err(ContainerError::StampConflict {
                        tensor: name,
                        first: prev.clone(),
                        second: stamp,
                        path,
                    });
                }
                _ => {
                    self.fmt_stamps.insert(name, stamp);
                }
            }
        }
        self.shards.push(Shard {
            tensor_count: header.tensors.len(),
            path,
            file_size,
            header_len: header.header_len,
            file,
        });
        Ok(())
    }

    /// The shard holding `entry`.
    pub fn shard_of(&self, entry: &TensorEntry) -> Option<&Shard> {
        self.shards.get(entry.shard)
    }

    /// The path of the shard holding `entry` (empty if the index is stale).
    pub fn path_of(&self, entry: &TensorEntry) -> PathBuf {
        self.shard_of(entry)
            .map(|s| s.path.clone())
            .unwrap_or_default()
    }
}
