//! A model directory's tokenizer: `tokenizer.json` through the `tokenizers` crate and
//! the chat template from `chat_template.jinja` or `tokenizer_config.json`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;

use super::detok::IncrementalDecoder;
use super::error::{GenerateError, Result};
use super::template::{ChatMessage, ChatTemplate};

/// Special-token variables that `transformers` passes to chat templates.
const TEMPLATE_TOKEN_VARS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Text ↔ token ids for one model, plus its chat template.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    template: Option<ChatTemplate>,
    config_path: PathBuf,
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` and the chat template: `dir/chat_template.jinja` if
    /// present, else `chat_template` of `dir/tokenizer_config.json` (a string, or a
    /// list of `{name, template}` where `default` is used). A missing template is not
    /// an error until [`Tokenizer::apply_chat_template`] is called.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(GenerateError::MissingFile { path });
        }
        let inner =
            tokenizers::Tokenizer::from_file(&path).map_err(|source| GenerateError::Tokenizer {
                path: path.clone(),
                source,
            })?;
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            read_json(&config_path)?
        } else {
            Value::Null
        };
        let vars: BTreeMap<String, String> = TEMPLATE_TOKEN_VARS
            .iter()
            .filter_map(|&k| token_text(config.get(k)?).map(|v| (k.to_string(), v)))
            .collect();
        let jinja_path = dir.join("chat_template.jinja");
        let template = if jinja_path.is_file() {
            let source =
                std::fs::read_to_string(&jinja_path).map_err(|source| GenerateError::Io {
                    path: jinja_path.clone(),
                    source,
                })?;
            Some(ChatTemplate::new(source, jinja_path, vars)?)
        } else {
            match config_template(&config, &config_path)? {
                Some(source) => Some(ChatTemplate::new(source, config_path.clone(), vars)?),
                None => None,
            }
        };
        Ok(Self {
            inner,
            path,
            template,
            config_path,
        })
    }

    fn error(&self, source: tokenizers::Error) -> GenerateError {
        GenerateError::Tokenizer {
            path: self.path.clone(),
            source,
        }
    }

    /// Token ids of `text`; `add_special` applies the tokenizer's post-processor
    /// (e.g. a BOS). Special-token strings in `text` become their single ids.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, add_special)
            .map_err(|e| self.error(e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`, without the special tokens if `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| self.error(e))
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Id of the token spelled `token` (e.g. `"<|user|>"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The chat template, if the model directory has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// Renders `messages` with the chat template (the text `transformers`'
    /// `apply_chat_template(..., tokenize=False)` gives).
    pub fn apply_chat_template<T: Serialize>(
        &self,
        messages: &[T],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self
            .template
            .as_ref()
            .ok_or_else(|| GenerateError::MissingTemplate {
                path: self.config_path.clone(),
            })?;
        template.render(messages, add_generation_prompt)
    }

    /// Ids of the rendered chat: the template's text encoded without adding special
    /// tokens (the template writes them), as `transformers` does.
    pub fn encode_chat<T: Serialize>(
        &self,
        messages: &[T],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let text = self.apply_chat_template(messages, add_generation_prompt)?;
        self.encode(&text, false)
    }

    /// Ids of a command-line prompt: `raw` encodes `prompt` as is (with the
    /// post-processor's specials); otherwise it is one user turn of the chat template
    /// followed by the assistant's generation prompt.
    pub fn encode_prompt(&self, prompt: &str, raw: bool) -> Result<Vec<u32>> {
        if raw {
            self.encode(prompt, true)
        } else {
            self.encode_chat(&[ChatMessage::user(prompt)], true)
        }
    }

    /// A streaming detokenizer over this tokenizer.
    pub fn incremental_decoder(&self, skip_special: bool) -> IncrementalDecoder<'_> {
        IncrementalDecoder::new(self, skip_special)
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|source| GenerateError::Io {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| GenerateError::Json {
        path: path.to_owned(),
        source,
    })
}

/// A special token given as `"<s>"` or as an added-token map `{"content": "<s>", …}`.
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

fn config_template(config: &Value, path: &Path) -> Result<Option<String>> {
    let bad = |what: &str| GenerateError::InvalidParams(format!("{}: {what}", path.display()));
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(list)) => {
            for entry in list {
                if entry.get("name").and_then(Value::as_str) == Some("default") {
                    return entry
                        .get("template")
                        .and_then(Value::as_str)
                        .map(|s| Some(s.to_owned()))
                        .ok_or_else(|| bad("chat_template 'default' has no template string"));
                }
            }
            Err(bad("chat_template list has no 'default' entry"))
        }
        Some(_) => Err(bad("chat_template must be a string or a list")),
    }
}
