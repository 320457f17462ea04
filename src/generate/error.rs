//! The generation layer's error type.

use std::path::PathBuf;

/// Boxed error of a model, a tokenizer library or the tiny-model builder.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong while tokenizing, rendering a template or generating.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A prompt id is not in the model's vocabulary.
    #[error("prompt token {index} has id {id}, outside the model's vocabulary of {vocab}")]
    TokenOutOfRange {
        /// Position in the prompt.
        index: usize,
        /// The offending id.
        id: u32,
        /// The model's vocabulary size.
        vocab: usize,
    },
    /// The prompt plus the requested new tokens do not fit the model's positions.
    #[error(
        "prompt of {prompt} tokens plus max_tokens {max_tokens} exceeds the model's {max_positions} positions"
    )]
    ContextOverflow {
        /// Prompt length.
        prompt: usize,
        /// Requested new tokens.
        max_tokens: usize,
        /// The model's maximum positions.
        max_positions: usize,
    },
    /// A sampling or generation parameter is out of range.
    #[error("invalid generation parameter: {0}")]
    InvalidParams(String),
    /// The model's forward pass failed.
    #[error("model forward failed ({context})")]
    Model {
        /// What was being run (prefill or the decode step).
        context: String,
        /// The model's error.
        #[source]
        source: BoxError,
    },
    /// The speculative drafter failed.
    #[error("drafter failed ({context})")]
    Drafter {
        /// What was being run.
        context: String,
        /// The drafter's error.
        #[source]
        source: BoxError,
    },
    /// The model returned a logits buffer of the wrong length.
    #[error("model returned {got} logits during {context}, expected {expected}")]
    LogitsShape {
        /// What was being run.
        context: String,
        /// Length returned.
        got: usize,
        /// Length expected.
        expected: usize,
    },
    /// The logits hold NaN or +inf, or every entry is -inf.
    #[error("logits cannot be sampled: {0}")]
    InvalidLogits(String),
    /// A model-directory file is missing.
    #[error("{}: file not found", path.display())]
    MissingFile {
        /// The file.
        path: PathBuf,
    },
    /// An I/O error on a file.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file does not parse or has the wrong shape.
    #[error("{}: invalid JSON: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// The `tokenizers` library rejected the tokenizer file or failed to encode/decode.
    #[error("tokenizer {}: {source}", path.display())]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// The library's error.
        #[source]
        source: BoxError,
    },
    /// `tokenizer_config.json` has no `chat_template`.
    #[error("{}: no chat_template", path.display())]
    MissingTemplate {
        /// The tokenizer config file.
        path: PathBuf,
    },
    /// The chat template does not compile or fails to render.
    #[error("chat template in {}: {source:#}", path.display())]
    Template {
        /// The file holding the template.
        path: PathBuf,
        /// The template engine's error.
        #[source]
        source: minijinja::Error,
    },
    /// `generation_config.json` could not be read.
    #[error(transparent)]
    Config(#[from] crate::container::ContainerError),
    /// Building the cached tiny model failed.
    #[error("building the tiny model in {}: {source}", path.display())]
    TinyModel {
        /// The directory being built.
        path: PathBuf,
        /// The cause.
        #[source]
        source: BoxError,
    },
}

/// Result with a [`GenerateError`].
pub type Result<T, E = GenerateError> = std::result::Result<T, E>;
