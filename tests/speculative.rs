//! Speculative decoding over mock models: greedy output unchanged on the
//! accept, partial-accept and reject paths; sampling keeps the output
//! distribution (chi-square test, fixed seeds, significance level 0.001);
//! stop rules, `max_tokens`, logits capture and the cache rollback.

use glm_stream::generate::speculative::{DraftPolicyConfig, DraftToken, Drafter};
use glm_stream::generate::{
    FinishReason, GenerateError, GenerateOptions, LanguageModel, SamplingParams, Session,
    SetRateDrafter,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A Markov model: the next-token distribution depends on the id just fed
/// only. `P[t]` are the target probabilities, the logits their logarithms.
#[derive(Debug, Default)]
struct Markov {
    eos: Vec<u32>,
    /// `(ids, cache_len before)` of every forward call.
    calls: Vec<(Vec<u32>, usize)>,
    rollback: bool,
}

const V: usize = 4;
const P: [[f64; V]; V] = [
    [0.1, 0.4, 0.3, 0.2],
    [0.5, 0.1, 0.1, 0.3],
    [0.25, 0.25, 0.4, 0.1],
    [0.05, 0.6, 0.15, 0.2],
];
/// The mock drafter's own (different) proposal distributions.
const Q: [[f64; V]; V] = [
    [0.4, 0.2, 0.2, 0.2],
    [0.1, 0.6, 0.2, 0.1],
    [0.3, 0.1, 0.3, 0.3],
    [0.25, 0.25, 0.25, 0.25],
];

fn logits_row(id: u32) -> Vec<f32> {
    P[id as usize].iter().map(|p| p.ln() as f32).collect()
}

impl LanguageModel for Markov {
    type Cache = Vec<u32>;
    type Error = std::convert::Infallible;

    fn vocab_size(&self) -> usize {
        V
    }
    fn max_positions(&self) -> usize {
        256
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
    ) -> Result<Vec<f32>, Self::Error> {
        self.calls.push((ids.to_vec(), cache.len()));
        cache.extend_from_slice(ids);
        let rows = if all_rows { ids } else { &ids[ids.len() - 1..] };
        Ok(rows.iter().flat_map(|&id| logits_row(id)).collect())
    }
    fn truncate_cache(cache: &mut Vec<u32>, len: usize) -> bool {
        cache.truncate(len);
        true
    }
}

/// A chain of Markov models with rollback, but a mock that only supports it
/// when told to (for the refusal test).
struct NoRollback(Markov);

impl LanguageModel for NoRollback {
    type Cache = Vec<u32>;
    type Error = std::convert::Infallible;
    fn vocab_size(&self) -> usize {
        V
    }
    fn max_positions(&self) -> usize {
        256
    }
    fn eos_token_ids(&self) -> Vec<u32> {
        Vec::new()
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
    ) -> Result<Vec<f32>, Self::Error> {
        self.0.forward(ids, cache, all_rows)
    }
}

/// Draws each draft from `Q[previous]` with its own stream and reports `q`.
struct QDrafter {
    rng: ChaCha8Rng,
    observed: Vec<(Vec<u32>, usize, u32)>,
}

impl QDrafter {
    fn new(seed: u64) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0x5EED),
            observed: Vec::new(),
        }
    }
}

impl Drafter<Markov> for QDrafter {
    fn observe(
        &mut self,
        model: &mut Markov,
        fed: &[u32],
        kept: usize,
        next: u32,
    ) -> Result<(), glm_stream::generate::error::BoxError> {
        assert!(model.rollback || !model.calls.is_empty());
        self.observed.push((fed.to_vec(), kept, next));
        Ok(())
    }

    fn draft(
        &mut self,
        _model: &mut Markov,
        context: &[u32],
        k: usize,
        _sampling: &SamplingParams,
    ) -> Result<Vec<DraftToken>, glm_stream::generate::error::BoxError> {
        let mut prev = *context.last().ok_or("empty context")?;
        let mut out = Vec::new();
        for _ in 0..k {
            let q = Q[prev as usize];
            let u: f64 = self.rng.random();
            let mut cum = 0.0;
            let mut id = V as u32 - 1;
            for (i, p) in q.iter().enumerate() {
                cum += p;
                if u < cum {
                    id = i as u32;
                    break;
                }
            }
            out.push(DraftToken {
                id,
                q: Some(q.iter().enumerate().map(|(i, &p)| (i as u32, p)).collect()),
            });
            prev = id;
        }
        Ok(out)
    }
}

fn opts(max_tokens: usize, sampling: SamplingParams) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        sampling,
        ..GenerateOptions::default()
    }
}

fn plain(model: &mut Markov, prompt: &[u32], o: GenerateOptions) -> Vec<u32> {
    Session::new(model, None, prompt, o)
        .unwrap()
        .run(|_| std::ops::ControlFlow::Continue(()))
        .unwrap()
        .tokens
}

#[test]
fn greedy_output_is_unchanged_on_accept_partial_and_reject_paths() {
    let mut m = Markov {
        rollback: true,
        ..Markov::default()
    };
    // Greedy on P from token 2 cycles 2 → 2 → … ; from 0 goes 0 → 1 → 0 → 1.
    let prompt = [3u32, 0];
    let want = plain(&mut m, &prompt, opts(20, SamplingParams::greedy()));
    assert_eq!(want.len(), 20);
    for (rate, k) in [(1.0, 3), (0.0, 2), (0.5, 1), (0.5, 4), (0.8, 3)] {
        let mut m = Markov {
            rollback: true,
            ..Markov::default()
        };
        let drafter = SetRateDrafter::new(prompt.len(), want.clone(), V, rate, 7);
        let session = Session::new(&mut m, None, &prompt, opts(20, SamplingParams::greedy()))
            .unwrap()
            .with_drafter(drafter, DraftPolicyConfig::fixed(k))
            .unwrap();
        let g = session
            .run(|_| std::ops::ControlFlow::Continue(()))
            .unwrap();
        assert_eq!(g.tokens, want, "rate {rate}, k {k}");
        assert_eq!(g.finish, FinishReason::MaxTokens);
        let s = g.stats;
        assert!(s.rounds > 0 && s.drafted > 0);
        if rate == 1.0 {
            assert_eq!(s.accepted, s.drafted);
            // 19 decode tokens in rounds of k + 1 = 4: 5 forwards.
            assert_eq!(s.decode_forwards, 19usize.div_ceil(k + 1));
        } else if rate == 0.0 {
            assert_eq!(s.accepted, 0);
            assert_eq!(s.decode_forwards, 19);
            assert_eq!(s.tokens_per_forward(), Some(1.0));
        } else {
            assert!(s.accepted > 0 && s.accepted < s.drafted, "{s:?}");
        }
    }
}

#[test]
fn rollback_keeps_exactly_the_committed_tokens() {
    let prompt = [3u32, 0];
    let mut m = Markov {
        rollback: true,
        ..Markov::default()
    };
    let want = plain(&mut m, &prompt, opts(12, SamplingParams::greedy()));
    let mut m = Markov {
        rollback: true,
        ..Markov::default()
    };
    let drafter = SetRateDrafter::new(prompt.len(), want.clone(), V, 0.5, 3);
    let mut session = Session::new(&mut m, None, &prompt, opts(12, SamplingParams::greedy()))
        .unwrap()
        .with_drafter(drafter, DraftPolicyConfig::fixed(3))
        .unwrap();
    let mut got = Vec::new();
    for t in session.by_ref() {
        got.push(t.unwrap().id);
    }
    assert_eq!(got, want);
    let cache_len = session.cache_len();
    drop(session);
    // Each call starts where the committed tokens end: the prompt, then
    // every generated token but the ones still to be fed.
    let mut committed: Vec<u32> = prompt.to_vec();
    for (ids, len_before) in &m.calls[1..] {
        assert_eq!(*len_before, committed.len(), "call {ids:?}");
        // The first id fed is always the last chosen token.
        committed.push(ids[0]);
        let accepted = ids[1..]
            .iter()
            .zip(&want[committed.len() - prompt.len()..])
            .take_while(|(a, b)| a == b)
            .count();
        committed.extend_from_slice(&ids[1..1 + accepted]);
    }
    assert!(cache_len >= committed.len() && cache_len <= committed.len() + 3);
    assert_eq!(
        committed[prompt.len()..],
        want[..committed.len() - prompt.len()]
    );
}

#[test]
fn stop_id_inside_an_accepted_run_ends_generation_there() {
    let prompt = [3u32, 0];
    let mut m = Markov {
        rollback: true,
        ..Markov::default()
    };
    let want = plain(&mut m, &prompt, opts(12, SamplingParams::greedy()));
    // Stop on the 4th generated token's id.
    let stop = want[3];
    let first = want.iter().position(|&t| t == stop).unwrap();
    let mut m = Markov {
        rollback: true,
        eos: vec![stop],
        ..Markov::default()
    };
    let drafter = SetRateDrafter::new(prompt.len(), want.clone(), V, 1.0, 3);
    let g = Session::new(&mut m, None, &prompt, opts(12, SamplingParams::greedy()))
        .unwrap()
        .with_drafter(drafter, DraftPolicyConfig::fixed(4))
        .unwrap()
        .run(|_| std::ops::ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(g.tokens, want[..=first]);
    assert_eq!(g.finish, FinishReason::Eos(stop));
}

#[test]
fn logits_capture_matches_plain_decoding() {
    let prompt = [1u32, 2, 0];
    let o = GenerateOptions {
        dump_logits: true,
        ..opts(9, SamplingParams::greedy())
    };
    let mut m = Markov {
        rollback: true,
        ..Markov::default()
    };
    let g = Session::new(&mut m, None, &prompt, o.clone())
        .unwrap()
        .run(|_| std::ops::ControlFlow::Continue(()))
        .unwrap();
    let mut m2 = Markov {
        rollback: true,
        ..Markov::default()
    };
    let drafter = SetRateDrafter::new(prompt.len(), g.tokens.clone(), V, 0.6, 11);
    let s = Session::new(&mut m2, None, &prompt, o)
        .unwrap()
        .with_drafter(drafter, DraftPolicyConfig::fixed(2))
        .unwrap()
        .run(|_| std::ops::ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(s.tokens, g.tokens);
    let (a, b) = (g.logits.unwrap(), s.logits.unwrap());
    assert_eq!(a.rows(), b.rows());
    assert_eq!(a.data, b.data);
}

#[test]
fn a_model_without_rollback_is_refused() {
    let mut m = NoRollback(Markov::default());
    let drafter = SetRateDrafter::new(1, vec![], V, 1.0, 0);
    let err = Session::new(&mut m, None, &[0], opts(4, SamplingParams::greedy()))
        .unwrap()
        .with_drafter(drafter, DraftPolicyConfig::default())
        .unwrap_err();
    assert!(matches!(err, GenerateError::InvalidParams(_)), "{err}");
}

/// Chi-square statistic of `counts` against probabilities `expected`.
fn chi_square(counts: &[u64], expected: &[f64]) -> f64 {
    let n: u64 = counts.iter().sum();
    counts
        .iter()
        .zip(expected)
        .map(|(&c, &p)| {
            let e = p * n as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

/// Counts of the 64 possible first three generated tokens after prompt `[0]`
/// over `n` seeds.
fn sequence_counts(n: u64, k: Option<usize>) -> ([u64; 64], usize, usize) {
    let mut counts = [0u64; 64];
    let (mut drafted, mut accepted) = (0, 0);
    let sampling = |seed| SamplingParams {
        temperature: 1.0,
        seed,
        ..SamplingParams::greedy()
    };
    for seed in 0..n {
        let mut m = Markov {
            rollback: true,
            ..Markov::default()
        };
        // Four tokens, so a first round of k = 2 fits; the first three are counted.
        let session = Session::new(&mut m, None, &[0], opts(4, sampling(seed))).unwrap();
        let g = match k {
            Some(k) => session
                .with_drafter(QDrafter::new(seed), DraftPolicyConfig::fixed(k))
                .unwrap()
                .run(|_| std::ops::ControlFlow::Continue(())),
            None => session.run(|_| std::ops::ControlFlow::Continue(())),
        }
        .unwrap();
        drafted += g.stats.drafted;
        accepted += g.stats.accepted;
        let t = &g.tokens;
        counts[(t[0] as usize) * 16 + (t[1] as usize) * 4 + t[2] as usize] += 1;
    }
    (counts, drafted, accepted)
}

#[test]
fn speculative_sampling_keeps_the_output_distribution() {
    // Exact probabilities of every 3-token continuation of [0].
    let mut expected = [0f64; 64];
    for a in 0..V {
        for b in 0..V {
            for c in 0..V {
                expected[a * 16 + b * 4 + c] = P[0][a] * P[a][b] * P[b][c];
            }
        }
    }
    // 63 degrees of freedom; the 0.999 quantile of χ²(63) is 103.44: a
    // correct sampler fails with probability 0.001 per seed set, and the seeds
    // are fixed, so the test is deterministic.
    const CRITICAL: f64 = 103.44;
    const N: u64 = 12_000;
    let (plain_counts, _, _) = sequence_counts(N, None);
    let plain_chi = chi_square(&plain_counts, &expected);
    assert!(plain_chi < CRITICAL, "plain sampling: χ² = {plain_chi}");
    for k in [1usize, 2] {
        let (counts, drafted, accepted) = sequence_counts(N, Some(k));
        let chi = chi_square(&counts, &expected);
        eprintln!("k = {k}: χ² = {chi:.1}, acceptance {accepted}/{drafted}");
        assert!(chi < CRITICAL, "speculative k={k}: χ² = {chi}");
        // Both paths ran many times.
        assert!(accepted > drafted / 5 && accepted < drafted * 4 / 5);
    }
    // The test has power: drafts taken as they come (no rejection) are
    // distributed like Q, not P, and fail it.
    let mut biased = [0u64; 64];
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let draw = |row: &[f64; V], rng: &mut ChaCha8Rng| {
        let u: f64 = rng.random();
        let mut cum = 0.0;
        for (i, p) in row.iter().enumerate() {
            cum += p;
            if u < cum {
                return i;
            }
        }
        V - 1
    };
    for _ in 0..N {
        let a = draw(&P[0], &mut rng);
        let b = draw(&Q[a], &mut rng);
        let c = draw(&P[b], &mut rng);
        biased[a * 16 + b * 4 + c] += 1;
    }
    assert!(chi_square(&biased, &expected) > CRITICAL);
}
