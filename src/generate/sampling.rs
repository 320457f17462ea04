//! Next-token selection: greedy argmax or seeded temperature / top-k / top-p sampling.
//!
//! The pipeline matches Hugging Face's `generate`: logits are divided by the
//! temperature, then top-k keeps the `k` largest, then top-p keeps the smallest prefix
//! of the remaining distribution (sorted by descending probability, ties by ascending
//! id) whose cumulative probability reaches `top_p`, always at least one token. All
//! probability arithmetic is in `f64`; the random stream is ChaCha8 seeded with
//! [`SamplingParams::seed`], so a seed reproduces the same tokens for the same logits.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::error::{GenerateError, Result};

/// How to pick the next token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy argmax (ties go to the lowest id).
    pub temperature: f32,
    /// Nucleus mass in `(0, 1]`; `1` disables top-p.
    pub top_p: f32,
    /// Keep only the `k` most likely tokens; `0` disables top-k.
    pub top_k: usize,
    /// Seed of the ChaCha8 random stream.
    pub seed: u64,
}

impl Default for SamplingParams {
    /// Greedy decoding.
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    /// Greedy argmax.
    pub const fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }

    /// Whether these parameters pick the argmax (temperature 0 or top-k 1).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Checks the ranges: temperature finite and ≥ 0, top-p in `(0, 1]`.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(GenerateError::InvalidParams(format!(
                "temperature must be finite and >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(GenerateError::InvalidParams(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// Checks that `logits` can be sampled: no NaN, no +inf, not all -inf, not empty.
fn check_logits(logits: &[f32]) -> Result<()> {
    if let Some(i) = logits
        .iter()
        .position(|x| x.is_nan() || *x == f32::INFINITY)
    {
        return Err(GenerateError::InvalidLogits(format!(
            "entry {i} is {}",
            logits[i]
        )));
    }
    if logits.iter().all(|x| *x == f32::NEG_INFINITY) {
        return Err(GenerateError::InvalidLogits(
            "empty or every entry is -inf".into(),
        ));
    }
    Ok(())
}

/// Index of the largest logit, the lowest index among ties; `None` if `logits` is
/// empty. NaN entries are never chosen.
pub fn argmax(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in logits.iter().enumerate() {
        if x.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.and_then(|(i, _)| u32::try_from(i).ok())
}

/// The distribution that [`Sampler::sample`] draws from: `(id, probability)` pairs of
/// the tokens that survive top-k and top-p, sorted by descending probability (ties by
/// ascending id), probabilities summing to 1. Greedy parameters give the argmax with
/// probability 1.
pub fn candidate_distribution(logits: &[f32], params: &SamplingParams) -> Result<Vec<(u32, f64)>> {
    params.validate()?;
    check_logits(logits)?;
    if params.is_greedy() {
        let id = argmax(logits).ok_or_else(|| GenerateError::InvalidLogits("empty".into()))?;
        return Ok(vec![(id, 1.0)]);
    }
    let t = f64::from(params.temperature);
    let mut ids: Vec<u32> = (0..logits.len())
        .filter(|&i| logits[i] > f32::NEG_INFINITY)
        .filter_map(|i| u32::try_from(i).ok())
        .collect();
    let by_rank = |a: &u32, b: &u32| {
        let (x, y) = (logits[*a as usize], logits[*b as usize]);
        // No NaN reaches here; -0.0 and 0.0 tie like in a plain comparison.
        y.partial_cmp(&x)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(b))
    };
    if params.top_k > 0 && params.top_k < ids.len() {
        ids.select_nth_unstable_by(params.top_k - 1, by_rank);
        ids.truncate(params.top_k);
    }
    ids.sort_unstable_by(by_rank);
    let max = f64::from(logits[ids[0] as usize]) / t;
    let weights: Vec<f64> = ids
        .iter()
        .map(|&i| (f64::from(logits[i as usize]) / t - max).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut out: Vec<(u32, f64)> = ids
        .into_iter()
        .zip(weights)
        .map(|(i, w)| (i, w / total))
        .collect();
    if params.top_p < 1.0 {
        let target = f64::from(params.top_p);
        let mut cum = 0.0;
        let mut keep = out.len();
        for (n, (_, p)) in out.iter().enumerate() {
            cum += p;
            if cum >= target {
                keep = n + 1;
                break;
            }
        }
        out.truncate(keep.max(1));
        let kept: f64 = out.iter().map(|(_, p)| p).sum();
        for (_, p) in &mut out {
            *p /= kept;
        }
    }
    Ok(out)
}

/// A seeded token sampler.
///
/// ```
/// use glm_stream::generate::{Sampler, SamplingParams};
/// let mut greedy = Sampler::new(SamplingParams::greedy()).unwrap();
/// assert_eq!(greedy.sample(&[0.5, 2.0, 2.0, -1.0]).unwrap(), 1);
/// ```
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    /// A sampler for `params` (validated) with its random stream at the start.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Self {
            params,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
        })
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// A uniform draw in `[0, 1)` from the sampler's stream.
    pub fn uniform(&mut self) -> f64 {
        self.rng.random()
    }

    /// Draws an id from `dist` (`(id, probability)` pairs summing to 1, in
    /// the order given) with one uniform draw from the sampler's stream.
    pub fn sample_from(&mut self, dist: &[(u32, f64)]) -> Result<u32> {
        let u = self.uniform();
        let mut cum = 0.0;
        for &(id, p) in dist {
            cum += p;
            if u < cum {
                return Ok(id);
            }
        }
        dist.iter()
            .rev()
            .find(|(_, p)| *p > 0.0)
            .or(dist.last())
            .map(|&(id, _)| id)
            .ok_or_else(|| GenerateError::InvalidLogits("no candidate token".into()))
    }

    /// Picks the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        check_logits(logits)?;
        if self.params.is_greedy() {
            return argmax(logits).ok_or_else(|| GenerateError::InvalidLogits("empty".into()));
        }
        let dist = candidate_distribution(logits, &self.params)?;
        let u: f64 = self.rng.random();
        let mut cum = 0.0;
        for &(id, p) in &dist {
            cum += p;
            if u < cum {
                return Ok(id);
            }
        }
        // Rounding left `u` above the final cumulative sum: take the last candidate.
        dist.last()
            .map(|&(id, _)| id)
            .ok_or_else(|| GenerateError::InvalidLogits("no candidate token".into()))
    }
}
