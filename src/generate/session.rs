//! The decode loop over any [`LanguageModel`], as an iterator or with a callback,
//! optionally speculative ([`Session::with_drafter`], see [`super::speculative`]).

use std::collections::VecDeque;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use super::LanguageModel;
use super::detok::IncrementalDecoder;
use super::error::{GenerateError, Result};
use super::npy::LogitsDump;
use super::sampling::{Sampler, SamplingParams};
use super::speculative::{DraftPolicy, DraftPolicyConfig, Drafter, accept_drafts};
use super::tokenizer::Tokenizer;
use crate::container::GenerationConfig;

/// What to generate and how.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// Most new tokens (≥ 1), the stop token included.
    pub max_tokens: usize,
    /// Token selection.
    pub sampling: SamplingParams,
    /// Stop ids on top of [`LanguageModel::eos_token_ids`] (e.g. `generation_config.json`'s).
    pub stop_ids: Vec<u32>,
    /// Capture the logits rows for `--dump-logits` (see [`LogitsDump`]).
    pub dump_logits: bool,
    /// Leave special tokens out of the text deltas.
    pub skip_special: bool,
}

impl Default for GenerateOptions {
    /// 128 greedy tokens, no extra stop ids, no logits capture, specials skipped.
    fn default() -> Self {
        Self {
            max_tokens: 128,
            sampling: SamplingParams::greedy(),
            stop_ids: Vec::new(),
            dump_logits: false,
            skip_special: true,
        }
    }
}

impl GenerateOptions {
    /// Adds the `eos_token_id`s of a `generation_config.json` to the stop ids.
    pub fn with_generation_config(mut self, config: &GenerationConfig) -> Self {
        if let Some(ids) = &config.eos_token_id {
            for id in ids.to_vec() {
                if !self.stop_ids.contains(&id) {
                    self.stop_ids.push(id);
                }
            }
        }
        self
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop id was generated (it is the last generated token).
    Eos(u32),
    /// `max_tokens` were generated.
    MaxTokens,
    /// The callback of [`Session::run`] asked to stop.
    Stopped,
}

/// One generated token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GeneratedToken {
    /// The id.
    pub id: u32,
    /// 0-based index among the generated tokens.
    pub index: usize,
    /// Text that became printable with this token (may be empty: part of a character,
    /// or a skipped special token). Concatenated, the deltas are the decoded output.
    pub text: String,
    /// Set on the last token.
    pub finish: Option<FinishReason>,
}

/// Timing and counts of one generation.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GenerationStats {
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Generated tokens, the stop token included.
    pub generated_tokens: usize,
    /// Prompt forward plus choosing the first token.
    pub prefill: Duration,
    /// All later steps (one forward of the previous token plus sampling each,
    /// or a speculative round).
    pub decode: Duration,
    /// Main-model forward passes after the prefill (plain steps plus verify
    /// passes).
    pub decode_forwards: usize,
    /// Verify passes (speculative rounds).
    pub rounds: usize,
    /// Tokens proposed by the drafter and verified.
    pub drafted: usize,
    /// Drafted tokens accepted.
    pub accepted: usize,
    /// Bytes the model read from storage during rounds (drafting and
    /// verifying), when it reports them ([`LanguageModel::io_bytes_read`]).
    pub round_bytes: u64,
    /// Bytes the model read from storage during plain decode steps.
    pub plain_bytes: u64,
}

impl GenerationStats {
    /// Prompt tokens per second of prefill (0 before it ran).
    pub fn prefill_tok_s(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill)
    }

    /// Decode steps (generated tokens after the first) per second.
    pub fn decode_tok_s(&self) -> f64 {
        rate(self.generated_tokens.saturating_sub(1), self.decode)
    }

    /// `accepted / drafted`; `None` before any draft was verified.
    pub fn acceptance_rate(&self) -> Option<f64> {
        (self.drafted > 0).then(|| self.accepted as f64 / self.drafted as f64)
    }

    /// Generated tokens after the first per main forward pass after the
    /// prefill (1 without drafting); `None` before any decode pass.
    pub fn tokens_per_forward(&self) -> Option<f64> {
        (self.decode_forwards > 0)
            .then(|| self.generated_tokens.saturating_sub(1) as f64 / self.decode_forwards as f64)
    }
}

fn rate(n: usize, d: Duration) -> f64 {
    let s = d.as_secs_f64();
    if n == 0 || s <= 0.0 {
        0.0
    } else {
        n as f64 / s
    }
}

/// The result of [`Session::run`].
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Generated ids, the stop token included.
    pub tokens: Vec<u32>,
    /// Their text (the concatenated deltas; empty without a tokenizer).
    pub text: String,
    /// Why it ended.
    pub finish: FinishReason,
    /// Counts and timing.
    pub stats: GenerationStats,
    /// The captured logits when [`GenerateOptions::dump_logits`] was set.
    pub logits: Option<LogitsDump>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// The prompt has not been run.
    Start,
    /// The last generated token is chosen but not yet fed.
    Running,
    /// Finished or failed.
    Done,
}

/// One generation in progress: validated on creation, runs lazily as it is iterated.
///
/// Iterating yields each generated token (the stop token last); after an error the
/// iterator ends.
pub struct Session<'a, M: LanguageModel> {
    model: &'a mut M,
    decoder: Option<IncrementalDecoder<'a>>,
    cache: M::Cache,
    prompt: Vec<u32>,
    generated: Vec<u32>,
    opts: GenerateOptions,
    stop_ids: Vec<u32>,
    sampler: Sampler,
    vocab: usize,
    state: State,
    stats: GenerationStats,
    logits: Option<Vec<f32>>,
    finish: Option<FinishReason>,
    spec: Option<Speculation<'a, M>>,
    queue: VecDeque<u32>,
}

/// The drafter and policy of a speculative session.
struct Speculation<'a, M: LanguageModel> {
    drafter: Box<dyn Drafter<M> + 'a>,
    policy: DraftPolicy,
}

impl<M: LanguageModel> std::fmt::Debug for Session<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("prompt_tokens", &self.prompt.len())
            .field("generated", &self.generated)
            .field("state", &self.state)
            .field("finish", &self.finish)
            .finish_non_exhaustive()
    }
}

impl<'a, M: LanguageModel> Session<'a, M> {
    /// Validates `prompt` and `opts` against `model` without running it: the prompt
    /// must be non-empty with every id below the vocabulary size, `max_tokens` ≥ 1,
    /// `prompt.len() + max_tokens` ≤ the model's positions, and the sampling
    /// parameters in range. `tokenizer` (optional) produces the text deltas.
    pub fn new(
        model: &'a mut M,
        tokenizer: Option<&'a Tokenizer>,
        prompt: &[u32],
        opts: GenerateOptions,
    ) -> Result<Self> {
        if opts.max_tokens == 0 {
            return Err(GenerateError::InvalidParams(
                "max_tokens must be >= 1".into(),
            ));
        }
        let sampler = Sampler::new(opts.sampling)?;
        if prompt.is_empty() {
            return Err(GenerateError::EmptyPrompt);
        }
        let vocab = model.vocab_size();
        if let Some((index, &id)) = prompt
            .iter()
            .enumerate()
            .find(|(_, id)| usize::try_from(**id).map_or(true, |i| i >= vocab))
        {
            return Err(GenerateError::TokenOutOfRange { index, id, vocab });
        }
        let max_positions = model.max_positions();
        if prompt
            .len()
            .checked_add(opts.max_tokens)
            .is_none_or(|n| n > max_positions)
        {
            return Err(GenerateError::ContextOverflow {
                prompt: prompt.len(),
                max_tokens: opts.max_tokens,
                max_positions,
            });
        }
        let mut stop_ids = model.eos_token_ids();
        for &id in &opts.stop_ids {
            if !stop_ids.contains(&id) {
                stop_ids.push(id);
            }
        }
        let cache = model.new_cache();
        Ok(Self {
            decoder: tokenizer.map(|t| t.incremental_decoder(opts.skip_special)),
            cache,
            prompt: prompt.to_vec(),
            generated: Vec::with_capacity(opts.max_tokens),
            stop_ids,
            sampler,
            vocab,
            state: State::Start,
            stats: GenerationStats {
                prompt_tokens: prompt.len(),
                ..GenerationStats::default()
            },
            logits: opts.dump_logits.then(Vec::new),
            finish: None,
            spec: None,
            queue: VecDeque::new(),
            opts,
            model,
        })
    }

    /// Turns on speculative decoding with `drafter`, drafts per round chosen
    /// by a [`DraftPolicy`] with `policy`. The output is the same as without
    /// (greedy: the same tokens; sampling: the same distribution).
    ///
    /// Fails when the session has started or when the model cannot roll its
    /// cache back ([`LanguageModel::truncate_cache`]).
    pub fn with_drafter(
        mut self,
        drafter: impl Drafter<M> + 'a,
        policy: DraftPolicyConfig,
    ) -> Result<Self> {
        if self.state != State::Start {
            return Err(GenerateError::InvalidParams(
                "a drafter can only be set before generation starts".into(),
            ));
        }
        if !M::truncate_cache(&mut self.cache, 0) {
            return Err(GenerateError::InvalidParams(
                "speculative decoding needs a model that can roll back its cache".into(),
            ));
        }
        self.spec = Some(Speculation {
            drafter: Box::new(drafter),
            policy: DraftPolicy::new(policy),
        });
        Ok(self)
    }

    /// The draft policy of a speculative session.
    pub fn draft_policy(&self) -> Option<&DraftPolicy> {
        self.spec.as_ref().map(|s| &s.policy)
    }

    /// The stop ids in effect (the model's then the options').
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// Ids generated so far.
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Counts and timing so far.
    pub fn stats(&self) -> &GenerationStats {
        &self.stats
    }

    /// Why generation ended, once it has.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Tokens in the model cache.
    pub fn cache_len(&self) -> usize {
        M::cache_len(&self.cache)
    }

    /// The captured logits so far (see [`LogitsDump`]); `None` unless
    /// [`GenerateOptions::dump_logits`] was set or if already taken.
    pub fn take_logits(&mut self) -> Option<LogitsDump> {
        self.logits.take().map(|data| LogitsDump {
            vocab: self.vocab,
            data,
        })
    }

    /// Runs to the end, calling `on_token` for each token; `ControlFlow::Break` stops
    /// early with [`FinishReason::Stopped`] (text still held back for an incomplete
    /// character then goes only into [`Generation::text`]).
    pub fn run(
        mut self,
        mut on_token: impl FnMut(&GeneratedToken) -> ControlFlow<()>,
    ) -> Result<Generation> {
        let mut text = String::new();
        while let Some(token) = self.next() {
            let token = token?;
            text.push_str(&token.text);
            if on_token(&token).is_break() && token.finish.is_none() {
                self.state = State::Done;
                self.finish = Some(FinishReason::Stopped);
                if let Some(d) = self.decoder.as_mut() {
                    let rest = d.finish()?;
                    text.push_str(&rest);
                }
            }
        }
        Ok(Generation {
            finish: self.finish.unwrap_or(FinishReason::Stopped),
            stats: self.stats,
            logits: self.take_logits(),
            tokens: self.generated,
            text,
        })
    }

    fn forward(&mut self, ids: &[u32], all_rows: bool, context: &str) -> Result<Vec<f32>> {
        let out = self
            .model
            .forward(ids, &mut self.cache, all_rows)
            .map_err(|e| GenerateError::Model {
                context: context.to_owned(),
                source: Box::new(e),
            })?;
        let rows = if all_rows { ids.len() } else { 1 };
        let expected = rows * self.vocab;
        if out.len() != expected {
            return Err(GenerateError::LogitsShape {
                context: context.to_owned(),
                got: out.len(),
                expected,
            });
        }
        Ok(out)
    }

    /// Runs the model for the next token and returns its logits row.
    fn next_logits(&mut self) -> Result<Vec<f32>> {
        let dump = self.logits.is_some();
        let last = match (self.state, self.generated.last()) {
            (State::Running, Some(&last)) => last,
            _ => {
                let prompt = std::mem::take(&mut self.prompt);
                let out = self.forward(&prompt, dump, "prefill");
                self.prompt = prompt;
                let mut out = out?;
                if let Some(rows) = self.logits.as_mut() {
                    rows.extend_from_slice(&out);
                    let start = out.len() - self.vocab;
                    out.drain(..start);
                }
                return Ok(out);
            }
        };
        let context = format!("decode step {}", self.generated.len());
        let out = self.forward(&[last], false, &context)?;
        if let Some(rows) = self.logits.as_mut() {
            rows.extend_from_slice(&out);
        }
        Ok(out)
    }

    /// The next token: queued from the last speculative round, or from a new
    /// round or plain step.
    fn advance(&mut self) -> Result<u32> {
        if let Some(id) = self.queue.pop_front() {
            return Ok(id);
        }
        let decoding = self.state == State::Running;
        let left = self
            .opts
            .max_tokens
            .saturating_sub(self.generated.len() + 1);
        let k = match &self.spec {
            Some(s) if decoding => s.policy.next_k().min(left),
            _ => 0,
        };
        if k > 0 {
            if let Some(mut spec) = self.spec.take() {
                let round = self.round(&mut spec, k);
                self.spec = Some(spec);
                if let Some(id) = round? {
                    return Ok(id);
                }
            }
        }
        let bytes_before = self.model.io_bytes_read();
        let started = Instant::now();
        let logits = self.next_logits()?;
        let id = self.sampler.sample(&logits)?;
        let bytes = bytes_delta(bytes_before, self.model.io_bytes_read());
        if decoding {
            self.stats.decode_forwards += 1;
            self.stats.plain_bytes += bytes;
        }
        if let Some(spec) = self.spec.as_mut() {
            let fed = if decoding {
                self.generated
                    .last()
                    .map(std::slice::from_ref)
                    .unwrap_or(&[])
            } else {
                &self.prompt[..]
            };
            spec.drafter
                .observe(self.model, fed, fed.len(), id)
                .map_err(|source| GenerateError::Drafter {
                    context: "observing a forward pass".into(),
                    source,
                })?;
            if decoding {
                spec.policy
                    .record_plain(bytes, started.elapsed().as_secs_f64());
            }
        }
        Ok(id)
    }

    /// One speculative round of at most `k` drafts: returns the first token
    /// it emits and queues the others, or `None` when the drafter proposed
    /// nothing (nothing ran).
    fn round(&mut self, spec: &mut Speculation<'a, M>, k: usize) -> Result<Option<u32>> {
        let Some(&last) = self.generated.last() else {
            return Ok(None);
        };
        let bytes_before = self.model.io_bytes_read();
        let started = Instant::now();
        let mut context = Vec::with_capacity(self.prompt.len() + self.generated.len());
        context.extend_from_slice(&self.prompt);
        context.extend_from_slice(&self.generated);
        let params = *self.sampler.params();
        let mut drafts = spec
            .drafter
            .draft(self.model, &context, k, &params)
            .map_err(|source| GenerateError::Drafter {
                context: format!("drafting at step {}", self.generated.len()),
                source,
            })?;
        drafts.truncate(k);
        if drafts.is_empty() {
            return Ok(None);
        }
        if let Some(d) = drafts
            .iter()
            .find(|d| usize::try_from(d.id).map_or(true, |i| i >= self.vocab))
        {
            return Err(GenerateError::Drafter {
                context: format!("drafting at step {}", self.generated.len()),
                source: format!("draft id {} outside the vocabulary of {}", d.id, self.vocab)
                    .into(),
            });
        }
        let mut fed = Vec::with_capacity(drafts.len() + 1);
        fed.push(last);
        fed.extend(drafts.iter().map(|d| d.id));
        let start = M::cache_len(&self.cache);
        let context = format!("verify pass at step {}", self.generated.len());
        let logits = self.forward(&fed, true, &context)?;
        let (accepted, next) = accept_drafts(&mut self.sampler, &logits, self.vocab, &drafts)?;
        if !M::truncate_cache(&mut self.cache, start + accepted + 1) {
            return Err(GenerateError::InvalidParams(
                "the model cannot roll back its cache".into(),
            ));
        }
        spec.drafter
            .observe(self.model, &fed, accepted + 1, next)
            .map_err(|source| GenerateError::Drafter {
                context: context.clone(),
                source,
            })?;
        if let Some(rows) = self.logits.as_mut() {
            rows.extend_from_slice(&logits[..(accepted + 1) * self.vocab]);
        }
        let bytes = bytes_delta(bytes_before, self.model.io_bytes_read());
        spec.policy.record_round(
            drafts.len(),
            accepted,
            bytes,
            started.elapsed().as_secs_f64(),
        );
        self.stats.decode_forwards += 1;
        self.stats.rounds += 1;
        self.stats.drafted += drafts.len();
        self.stats.accepted += accepted;
        self.stats.round_bytes += bytes;
        self.queue.extend(&fed[1..=accepted]);
        self.queue.push_back(next);
        Ok(self.queue.pop_front())
    }

    fn step(&mut self) -> Result<GeneratedToken> {
        let started = Instant::now();
        let id = self.advance()?;
        let index = self.generated.len();
        self.generated.push(id);
        let finish = if self.stop_ids.contains(&id) {
            Some(FinishReason::Eos(id))
        } else if self.generated.len() >= self.opts.max_tokens {
            Some(FinishReason::MaxTokens)
        } else {
            None
        };
        let mut text = String::new();
        if let Some(d) = self.decoder.as_mut() {
            text = d.push(id)?;
            if finish.is_some() {
                text.push_str(&d.finish()?);
            }
        }
        let elapsed = started.elapsed();
        if index == 0 {
            self.stats.prefill = elapsed;
        } else {
            self.stats.decode += elapsed;
        }
        self.stats.generated_tokens = self.generated.len();
        self.state = if finish.is_some() {
            State::Done
        } else {
            State::Running
        };
        self.finish = finish;
        Ok(GeneratedToken {
            id,
            index,
            text,
            finish,
        })
    }
}

/// Bytes read between two readings of [`LanguageModel::io_bytes_read`].
fn bytes_delta(before: Option<u64>, after: Option<u64>) -> u64 {
    match (before, after) {
        (Some(b), Some(a)) => a.saturating_sub(b),
        _ => 0,
    }
}

impl<M: LanguageModel> Iterator for Session<'_, M> {
    type Item = Result<GeneratedToken>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.state == State::Done {
            return None;
        }
        let result = self.step();
        if result.is_err() {
            self.state = State::Done;
        }
        Some(result)
    }
}

impl<M: LanguageModel> std::iter::FusedIterator for Session<'_, M> {}
