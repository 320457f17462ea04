//! The decode loop over a mock model: greedy loop, stop rules, logits-dump layout,
//! validation before any model work, iterator vs callback.

use std::ops::ControlFlow;

use glm_stream::container::GenerationConfig;
use glm_stream::container::config::TokenIds;
use glm_stream::generate::{
    FinishReason, GenerateError, GenerateOptions, LanguageModel, SamplingParams, Session,
};

const VOCAB: usize = 24;

/// Logits are a fixed function of the id just fed and its position: a spike at
/// `next(id, pos)` over hashed noise in [-1, 1).
#[derive(Debug, Default)]
struct Mock {
    max_positions: usize,
    eos: Vec<u32>,
    /// `(ids, all_rows, cache_len before)` of every forward call.
    calls: Vec<(Vec<u32>, bool, usize)>,
    /// Fail the forward call with this index.
    fail_at: Option<usize>,
    /// Return one logit too few from the forward call with this index.
    short_at: Option<usize>,
}

#[derive(Debug)]
struct MockError;

impl std::fmt::Display for MockError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("mock failure")
    }
}

impl std::error::Error for MockError {}

fn next(id: u32, pos: usize) -> u32 {
    (id * 7 + pos as u32 * 3 + 1) % VOCAB as u32
}

fn noise(id: u32, pos: usize, v: usize) -> f32 {
    let mut h = (u64::from(id) << 32) ^ ((pos as u64) << 8) ^ v as u64;
    h = h.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    h ^= h >> 29;
    (h % 2000) as f32 / 1000.0 - 1.0
}

fn row(id: u32, pos: usize) -> Vec<f32> {
    (0..VOCAB)
        .map(|v| {
            if v == next(id, pos) as usize {
                5.0
            } else {
                noise(id, pos, v)
            }
        })
        .collect()
}

impl Mock {
    fn new(max_positions: usize, eos: &[u32]) -> Self {
        Self {
            max_positions,
            eos: eos.to_vec(),
            ..Self::default()
        }
    }
}

impl LanguageModel for Mock {
    type Cache = Vec<u32>;
    type Error = MockError;

    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn max_positions(&self) -> usize {
        self.max_positions
    }
    fn eos_token_ids(&self) -> Vec<u32> {
        self.eos.clone()
    }
    fn new_cache(&self) -> Vec<u32> {
        Vec::new()
    }
    fn cache_len(cache: &Vec<u32>) -> usize {
        cache.len()
    }
    fn forward(
        &mut self,
        ids: &[u32],
        cache: &mut Vec<u32>,
        all_rows: bool,
    ) -> Result<Vec<f32>, MockError> {
        let call = self.calls.len();
        self.calls.push((ids.to_vec(), all_rows, cache.len()));
        if self.fail_at == Some(call) {
            return Err(MockError);
        }
        let start = cache.len();
        cache.extend_from_slice(ids);
        let first = if all_rows { 0 } else { ids.len() - 1 };
        let mut out: Vec<f32> = (first..ids.len())
            .flat_map(|i| row(ids[i], start + i))
            .collect();
        if self.short_at == Some(call) {
            out.pop();
        }
        Ok(out)
    }
}

/// The greedy continuation computed directly from `next`.
fn reference(prompt: &[u32], n: usize, eos: &[u32]) -> Vec<u32> {
    let mut out = Vec::new();
    let mut last = *prompt.last().expect("prompt");
    let mut pos = prompt.len() - 1;
    while out.len() < n {
        let id = next(last, pos);
        out.push(id);
        if eos.contains(&id) {
            break;
        }
        last = id;
        pos += 1;
    }
    out
}

fn opts(max_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        ..GenerateOptions::default()
    }
}

fn collect_ids<M: LanguageModel>(session: Session<'_, M>) -> Result<Vec<u32>, GenerateError> {
    session.map(|t| t.map(|t| t.id)).collect()
}

#[test]
fn greedy_loop_runs_prompt_once_then_one_token_per_step() {
    let prompt = [3, 1, 4, 1, 5];
    let mut model = Mock::new(100, &[]);
    let session = Session::new(&mut model, None, &prompt, opts(12)).expect("valid");
    let ids = collect_ids(session).expect("generate");
    assert_eq!(ids, reference(&prompt, 12, &[]));
    // One prefill call with only the last row, then one call per fed token.
    assert_eq!(model.calls.len(), 12);
    assert_eq!(model.calls[0], (prompt.to_vec(), false, 0));
    for (j, (fed, all_rows, len)) in model.calls[1..].iter().enumerate() {
        assert_eq!(
            (fed.as_slice(), *all_rows, *len),
            (&ids[j..=j], false, 5 + j)
        );
    }
}

#[test]
fn stops_on_model_eos_and_on_generation_config_eos() {
    let prompt = [2, 9];
    let full = reference(&prompt, 20, &[]);
    let stop = full[4];
    let first = full.iter().position(|&t| t == stop).expect("present");
    let expected = full[..=first].to_vec();

    let mut model = Mock::new(100, &[stop]);
    let mut session = Session::new(&mut model, None, &prompt, opts(20)).expect("valid");
    let ids = session
        .by_ref()
        .map(|t| t.map(|t| t.id))
        .collect::<Result<Vec<_>, _>>();
    assert_eq!(ids.expect("generate"), expected);
    assert_eq!(session.finish_reason(), Some(FinishReason::Eos(stop)));
    assert_eq!(session.stats().generated_tokens, expected.len());

    // The same id only in generation_config.json's list (model has a different one).
    let config = GenerationConfig {
        eos_token_id: Some(TokenIds::Many(vec![VOCAB as u32 + 5, stop])),
        ..GenerationConfig::default()
    };
    let mut model = Mock::new(100, &[VOCAB as u32 + 7]);
    let o = opts(20).with_generation_config(&config);
    let generation = Session::new(&mut model, None, &prompt, o)
        .expect("valid")
        .run(|_| ControlFlow::Continue(()))
        .expect("generate");
    assert_eq!(generation.tokens, expected);
    assert_eq!(generation.finish, FinishReason::Eos(stop));

    // Single-id form, through the options' own stop list.
    let config = GenerationConfig {
        eos_token_id: Some(TokenIds::One(stop)),
        ..GenerationConfig::default()
    };
    let mut model = Mock::new(100, &[]);
    let o = opts(20).with_generation_config(&config);
    let ids = collect_ids(Session::new(&mut model, None, &prompt, o).expect("valid"));
    assert_eq!(ids.expect("generate"), expected);
}

#[test]
fn max_tokens_bounds_the_output() {
    for n in [1usize, 2, 7] {
        let mut model = Mock::new(100, &[]);
        let mut session = Session::new(&mut model, None, &[1, 2, 3], opts(n)).expect("valid");
        let tokens: Vec<_> = session
            .by_ref()
            .collect::<Result<_, _>>()
            .expect("generate");
        assert_eq!(tokens.len(), n);
        assert_eq!(
            tokens.last().and_then(|t| t.finish),
            Some(FinishReason::MaxTokens)
        );
        assert!(tokens[..n - 1].iter().all(|t| t.finish.is_none()));
        assert_eq!(session.cache_len(), 3 + n - 1, "the last token is not fed");
        assert!(session.next().is_none(), "fused after the end");
        drop(session);
        assert_eq!(model.calls.len(), n);
    }
}

#[test]
fn dump_logits_rows_follow_the_documented_layout() {
    let prompt = [5, 6, 7, 8];
    let p = prompt.len();
    for (max_tokens, eos) in [(6usize, None), (1, None), (30, Some(4usize))] {
        let full = reference(&prompt, 30, &[]);
        let eos_ids: Vec<u32> = eos.map(|k| vec![full[k]]).unwrap_or_default();
        let mut model = Mock::new(100, &eos_ids);
        let o = GenerateOptions {
            dump_logits: true,
            ..opts(max_tokens)
        };
        let generation = Session::new(&mut model, None, &prompt, o)
            .expect("valid")
            .run(|_| ControlFlow::Continue(()))
            .expect("generate");
        let g = generation.tokens.len();
        let dump = generation.logits.expect("captured");
        assert_eq!((dump.rows(), dump.vocab), (p + g - 1, VOCAB));
        for (i, &id) in prompt.iter().enumerate() {
            assert_eq!(dump.row(i), Some(row(id, i).as_slice()), "prompt row {i}");
        }
        for j in 0..g - 1 {
            let expected = row(generation.tokens[j], p + j);
            assert_eq!(
                dump.row(p + j),
                Some(expected.as_slice()),
                "generated row {j}"
            );
        }
        // Only the prefill asks for every row.
        assert!(model.calls[0].1);
        assert!(model.calls[1..].iter().all(|c| !c.1));
    }
}

#[test]
fn invalid_requests_fail_before_any_model_call() {
    let cases: Vec<(Vec<u32>, GenerateOptions, &str)> = vec![
        (vec![], opts(4), "EmptyPrompt"),
        (vec![1, VOCAB as u32], opts(4), "TokenOutOfRange"),
        (vec![1, u32::MAX], opts(4), "TokenOutOfRange"),
        (vec![1; 10], opts(7), "ContextOverflow"),
        (vec![1; 10], opts(usize::MAX), "ContextOverflow"),
        (vec![1], opts(0), "InvalidParams"),
        (
            vec![1],
            GenerateOptions {
                sampling: SamplingParams {
                    temperature: -1.0,
                    ..SamplingParams::greedy()
                },
                ..opts(3)
            },
            "InvalidParams",
        ),
        (
            vec![1],
            GenerateOptions {
                sampling: SamplingParams {
                    temperature: 1.0,
                    top_p: 0.0,
                    ..SamplingParams::greedy()
                },
                ..opts(3)
            },
            "InvalidParams",
        ),
    ];
    for (prompt, o, kind) in cases {
        let mut model = Mock::new(16, &[]);
        let err = Session::new(&mut model, None, &prompt, o).expect_err(kind);
        let debug = format!("{err:?}");
        assert!(debug.starts_with(kind), "{kind}: got {debug}");
        assert!(model.calls.is_empty(), "{kind}: the model ran");
    }
    // Exactly filling the positions is allowed.
    let mut model = Mock::new(16, &[]);
    let ids = collect_ids(Session::new(&mut model, None, &[1; 10], opts(6)).expect("fits"));
    assert_eq!(ids.expect("generate").len(), 6);
    match Session::new(&mut Mock::new(16, &[]), None, &[0, 99], opts(1)) {
        Err(GenerateError::TokenOutOfRange { index, id, vocab }) => {
            assert_eq!((index, id, vocab), (1, 99, VOCAB));
        }
        other => panic!("expected TokenOutOfRange, got {other:?}"),
    }
}

#[test]
fn model_errors_and_bad_shapes_end_the_iterator() {
    let mut model = Mock {
        fail_at: Some(2),
        ..Mock::new(100, &[])
    };
    let mut session = Session::new(&mut model, None, &[1, 2], opts(10)).expect("valid");
    assert!(session.next().is_some_and(|t| t.is_ok()));
    assert!(session.next().is_some_and(|t| t.is_ok()));
    match session.next() {
        Some(Err(GenerateError::Model { context, source })) => {
            assert_eq!(context, "decode step 2");
            assert_eq!(source.to_string(), "mock failure");
        }
        other => panic!("expected a model error, got {other:?}"),
    }
    assert!(session.next().is_none());

    let mut model = Mock {
        short_at: Some(0),
        ..Mock::new(100, &[])
    };
    let err = Session::new(&mut model, None, &[1, 2], opts(10))
        .expect("valid")
        .run(|_| ControlFlow::Continue(()))
        .expect_err("short logits");
    assert!(
        matches!(err, GenerateError::LogitsShape { got, expected, .. } if got + 1 == expected),
        "{err:?}"
    );
}

#[test]
fn iterator_and_callback_agree_when_sampling() {
    let sampling = SamplingParams {
        temperature: 1.3,
        top_p: 0.9,
        top_k: 8,
        seed: 42,
    };
    let o = GenerateOptions {
        sampling,
        dump_logits: true,
        ..opts(40)
    };
    let prompt = [1, 2, 3];
    let mut a = Mock::new(100, &[]);
    let mut session = Session::new(&mut a, None, &prompt, o.clone()).expect("valid");
    let iterated: Vec<_> = session.by_ref().collect::<Result<_, _>>().expect("iterate");
    let iter_logits = session.take_logits();

    let mut b = Mock::new(100, &[]);
    let mut seen = Vec::new();
    let generation = Session::new(&mut b, None, &prompt, o)
        .expect("valid")
        .run(|t| {
            seen.push(t.clone());
            ControlFlow::Continue(())
        })
        .expect("run");
    assert_eq!(iterated, seen);
    assert_eq!(
        generation.tokens,
        iterated.iter().map(|t| t.id).collect::<Vec<_>>()
    );
    assert_eq!(generation.logits, iter_logits);
    // Sampling really departs from greedy on this mock.
    assert_ne!(generation.tokens, reference(&prompt, 40, &[]));
    assert_eq!(generation.stats.prompt_tokens, 3);
    assert_eq!(generation.stats.generated_tokens, 40);
    assert!(generation.stats.decode_tok_s() > 0.0);
}

#[test]
fn callback_can_stop_early() {
    let mut model = Mock::new(100, &[]);
    let generation = Session::new(&mut model, None, &[4], opts(50))
        .expect("valid")
        .run(|t| {
            if t.index == 2 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .expect("run");
    assert_eq!(generation.tokens.len(), 3);
    assert_eq!(generation.finish, FinishReason::Stopped);
    assert_eq!(model.calls.len(), 3);
}

/// Emits a fixed script of ids, one per step, whatever the input.
struct Script {
    script: Vec<u32>,
    prompt_len: usize,
    vocab: usize,
}

impl LanguageModel for Script {
    type Cache = usize;
    type Error = MockError;

    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn max_positions(&self) -> usize {
        1000
    }
    fn eos_token_ids(&self) -> Vec<u32> {
        Vec::new()
    }
    fn new_cache(&self) -> usize {
        0
    }
    fn cache_len(cache: &usize) -> usize {
        *cache
    }
    fn forward(
        &mut self,
        ids: &[u32],
        cache: &mut usize,
        all_rows: bool,
    ) -> Result<Vec<f32>, MockError> {
        *cache += ids.len();
        let rows = if all_rows { ids.len() } else { 1 };
        let mut out = vec![0.0f32; rows * self.vocab];
        let step = *cache - self.prompt_len;
        if let Some(&id) = self.script.get(step) {
            out[(rows - 1) * self.vocab + id as usize] = 1.0;
        }
        Ok(out)
    }
}

#[test]
fn text_deltas_concatenate_to_the_decoded_output() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = glm_stream::tiny::TinyModelSpec::default();
    glm_stream::tiny::generate_hf_checkpoint(
        dir.path(),
        &spec,
        0,
        glm_stream::tiny::SourceDtype::Bf16,
    )
    .expect("tiny checkpoint");
    let tok = glm_stream::generate::Tokenizer::from_model_dir(dir.path()).expect("tokenizer");
    let config = GenerationConfig::load(&dir.path().join("generation_config.json"))
        .expect("generation config");
    let eos = tok.token_to_id("<|endoftext|>").expect("eos id");
    let mut script = tok.encode("héllo the 🙂 wörld", false).expect("encode");
    let text_len = script.len();
    script.push(eos);
    script.push(5);
    let prompt = tok.encode_prompt("hi", false).expect("prompt");
    let mut model = Script {
        script: script.clone(),
        prompt_len: prompt.len(),
        vocab: spec.vocab_size,
    };
    let o = opts(100).with_generation_config(&config);
    let session = Session::new(&mut model, Some(&tok), &prompt, o).expect("valid");
    let tokens: Vec<_> = session.collect::<Result<_, _>>().expect("generate");
    assert_eq!(tokens.len(), text_len + 1, "stops at <|endoftext|>");
    assert_eq!(
        tokens.last().and_then(|t| t.finish),
        Some(FinishReason::Eos(eos))
    );
    let text: String = tokens.iter().map(|t| t.text.as_str()).collect();
    assert_eq!(text, "héllo the 🙂 wörld");
    assert!(tokens.iter().all(|t| !t.text.contains('\u{FFFD}')));
    // The 4-byte emoji arrives whole with its last byte.
    assert!(tokens.iter().any(|t| t.text == "🙂"));
}
