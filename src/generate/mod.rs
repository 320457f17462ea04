//! Text generation over any [`LanguageModel`]: tokenizer and chat template, sampling,
//! stop rules, the decode loop (iterator or callback), timing stats and logits capture.
//!
//! The layer only needs the small [`LanguageModel`] trait, so it runs the same over the
//! streamed GLM model and over a mock.
//!
//! ```
//! use glm_stream::generate::{GenerateOptions, LanguageModel, Session};
//!
//! /// Always predicts `last id + 1`, and stops on id 3.
//! struct Counter;
//!
//! impl LanguageModel for Counter {
//!     type Cache = Vec<u32>;
//!     type Error = std::convert::Infallible;
//!     fn vocab_size(&self) -> usize { 8 }
//!     fn max_positions(&self) -> usize { 256 }
//!     fn eos_token_ids(&self) -> Vec<u32> { vec![3] }
//!     fn new_cache(&self) -> Vec<u32> { Vec::new() }
//!     fn cache_len(cache: &Vec<u32>) -> usize { cache.len() }
//!     fn forward(&mut self, ids: &[u32], cache: &mut Vec<u32>, all_rows: bool)
//!         -> Result<Vec<f32>, Self::Error> {
//!         cache.extend_from_slice(ids);
//!         let rows = if all_rows { ids } else { &ids[ids.len() - 1..] };
//!         Ok(rows.iter().flat_map(|&id| (0..8).map(move |v| f32::from(v == (id + 1) % 8))).collect())
//!     }
//! }
//!
//! let mut model = Counter;
//! let session = Session::new(&mut model, None, &[0], GenerateOptions::default())?;
//! let ids: Vec<u32> = session.map(|t| t.map(|t| t.id)).collect::<Result<_, _>>()?;
//! assert_eq!(ids, [1, 2, 3]);
//! # Ok::<(), glm_stream::generate::GenerateError>(())
//! ```

pub mod detok;
pub mod error;
pub mod model_dir;
pub mod npy;
pub mod sampling;
pub mod session;
pub mod speculative;
pub mod template;
pub mod tokenizer;

pub use detok::IncrementalDecoder;
pub use error::{GenerateError, Result};
pub use model_dir::{default_model_dir, tiny_model_dir_in};
pub use npy::{LogitsDump, write_npy_f32};
pub use sampling::{Sampler, SamplingParams};
pub use session::{
    FinishReason, GenerateOptions, GeneratedToken, Generation, GenerationStats, Session,
};
pub use speculative::{
    DraftPolicy, DraftPolicyConfig, DraftToken, Drafter, SetRateDrafter, accept_drafts,
    expected_tokens, verify_draft,
};
pub use template::{ChatMessage, ChatTemplate};
pub use tokenizer::Tokenizer;

/// A causal language model with a KV cache: what the generation layer drives.
pub trait LanguageModel {
    /// Per-sequence state (KV cache, positions).
    type Cache;
    /// The model's error.
    type Error: std::error::Error + Send + Sync + 'static;
    /// Number of logits per row.
    fn vocab_size(&self) -> usize;
    /// Most positions a sequence may use.
    fn max_positions(&self) -> usize;
    /// Ids that end a generation.
    fn eos_token_ids(&self) -> Vec<u32>;
    /// An empty cache.
    fn new_cache(&self) -> Self::Cache;
    /// Tokens held in `cache`.
    fn cache_len(cache: &Self::Cache) -> usize;
    /// Runs `ids` at positions cache_len.. and appends them to the cache. Returns float32 logits:
    /// all rows `[ids.len() × vocab]` row-major if `all_rows`, else only the last row `[vocab]`.
    fn forward(
        &mut self,
        ids: &[u32],
        cache: &mut Self::Cache,
        all_rows: bool,
    ) -> Result<Vec<f32>, Self::Error>;
    /// Rolls `cache` back to its first `len` positions (speculative decoding
    /// drops rejected drafts with it). Returns `false` when the model cannot
    /// roll back (the default), which rules out speculative decoding.
    fn truncate_cache(cache: &mut Self::Cache, len: usize) -> bool {
        let _ = (cache, len);
        false
    }
    /// Bytes read from storage so far (streamed experts), for the draft
    /// policy; `None` (the default) when the model does not stream.
    fn io_bytes_read(&self) -> Option<u64> {
        None
    }
}
