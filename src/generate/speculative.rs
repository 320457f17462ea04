//! Speculative decoding: a [`Drafter`] proposes up to `k` tokens, one forward
//! pass of the main model over `[last, d₁ … d_k]` verifies them, and the
//! caches of rejected positions are rolled back
//! ([`LanguageModel::truncate_cache`]).
//!
//! * **Greedy** (temperature 0 or top-k 1): draft `dᵢ` is accepted while it is
//!   the argmax of verify row `i − 1`; the first mismatch is replaced by that
//!   argmax, and when every draft is accepted the last row gives a bonus
//!   token. The output is exactly the plain greedy output.
//! * **Sampling**: standard speculative sampling. With `p` the target
//!   distribution of a verify row (the session's temperature / top-k / top-p
//!   applied to it, [`candidate_distribution`]) and `q` the distribution the
//!   drafter drew `d` from (a point mass for a deterministic drafter), `d` is
//!   accepted with probability `min(1, p(d)/q(d))`; on rejection the token is
//!   drawn from `norm(max(0, p − q))` and the round ends; after `k`
//!   acceptances a bonus token is drawn from the last row. Every emitted token
//!   is then distributed exactly as plain sampling would draw it. All draws
//!   come from the session's [`Sampler`] stream, so a seed reproduces a run.
//!
//! [`DraftPolicy`] decides `k` per round from the measured acceptance and the
//! measured extra cost (expert bytes read, wall time) of verify rounds over
//! plain steps, and turns drafting off when it does not pay.
//!
//! [`SetRateDrafter`] proposes a known continuation's token with a set
//! probability: tests and benches use it to drive the accept, partial-accept
//! and reject paths, which random tiny models (whose MTP head agrees with
//! the main model almost never) do not reach.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::LanguageModel;
use super::error::{BoxError, GenerateError, Result};
use super::sampling::{Sampler, SamplingParams, candidate_distribution};

/// One proposed token.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftToken {
    /// The proposed id.
    pub id: u32,
    /// The distribution the drafter drew `id` from, as `(id, probability)`
    /// pairs (ids not listed have probability 0); `None` when the drafter
    /// chose `id` deterministically (a point mass on `id`).
    pub q: Option<Vec<(u32, f64)>>,
}

impl DraftToken {
    /// A deterministic proposal.
    pub fn certain(id: u32) -> Self {
        Self { id, q: None }
    }

    /// `q(id)`.
    fn q_of(&self, id: u32) -> f64 {
        match &self.q {
            None => f64::from(u8::from(id == self.id)),
            Some(dist) => dist.iter().find(|(i, _)| *i == id).map_or(0.0, |&(_, p)| p),
        }
    }
}

/// Proposes the tokens that follow a context, for a [`LanguageModel`] `M`.
///
/// The session calls [`observe`](Self::observe) after every main forward
/// pass (prefill, plain step and verify pass alike) and
/// [`draft`](Self::draft) before a verify pass. A drafter that needs the
/// main model's state (the MTP head needs its hidden rows) reads it from
/// `model` in `observe`.
pub trait Drafter<M: LanguageModel> {
    /// A main forward pass ran `fed` at positions `start..`; its first `kept`
    /// ids stay in the cache (the rest were rejected drafts, rolled back) and
    /// `next` is the token chosen after them (not yet run).
    fn observe(
        &mut self,
        model: &mut M,
        fed: &[u32],
        kept: usize,
        next: u32,
    ) -> std::result::Result<(), BoxError>;

    /// Proposes at most `k` tokens to follow `context` (the prompt and every
    /// generated token; the last one is not in the model's cache yet).
    /// `sampling` is the session's token selection: a sampling drafter draws
    /// with it and reports `q`. Fewer than `k` (even none) is allowed.
    fn draft(
        &mut self,
        model: &mut M,
        context: &[u32],
        k: usize,
        sampling: &SamplingParams,
    ) -> std::result::Result<Vec<DraftToken>, BoxError>;
}

/// Whether verify row `p` accepts `draft`: `Ok(None)` when accepted, else
/// the replacement token drawn from `norm(max(0, p − q))`. Draws from
/// `sampler` only when the outcome is random (never for greedy `p`).
pub fn verify_draft(
    sampler: &mut Sampler,
    p: &[(u32, f64)],
    draft: &DraftToken,
) -> Result<Option<u32>> {
    let p_d = p
        .iter()
        .find(|(i, _)| *i == draft.id)
        .map_or(0.0, |&(_, x)| x);
    let q_d = draft.q_of(draft.id);
    let accept = if q_d <= 0.0 {
        // A drafter that reports q(d) = 0 for its own draft: treat it as a
        // point mass (the draft was certain to it).
        p_d >= 1.0
    } else {
        let ratio = p_d / q_d;
        if ratio >= 1.0 {
            true
        } else if ratio <= 0.0 {
            false
        } else {
            sampler.uniform() < ratio
        }
    };
    if accept {
        return Ok(None);
    }
    let mut residual: Vec<(u32, f64)> = p
        .iter()
        .map(|&(id, x)| {
            let q = if q_d <= 0.0 {
                f64::from(u8::from(id == draft.id))
            } else {
                draft.q_of(id)
            };
            (id, (x - q).max(0.0))
        })
        .filter(|&(_, x)| x > 0.0)
        .collect();
    let total: f64 = residual.iter().map(|(_, x)| x).sum();
    if residual.is_empty() || total <= 0.0 {
        // p ≤ q everywhere yet the draft was rejected: only rounding gets
        // here. Fall back to p itself.
        return sampler.sample_from(p).map(Some);
    }
    for (_, x) in &mut residual {
        *x /= total;
    }
    sampler.sample_from(&residual).map(Some)
}

/// Outcome of one verify pass over `drafts`, from its `drafts.len() + 1`
/// logits rows (`vocab` each): how many drafts were accepted, and the token
/// after them (the replacement of the first rejected draft, or the bonus).
pub fn accept_drafts(
    sampler: &mut Sampler,
    logits: &[f32],
    vocab: usize,
    drafts: &[DraftToken],
) -> Result<(usize, u32)> {
    let params = *sampler.params();
    let row = |i: usize| -> Result<&[f32]> {
        logits
            .get(i * vocab..(i + 1) * vocab)
            .ok_or_else(|| GenerateError::LogitsShape {
                context: "verify pass".into(),
                got: logits.len(),
                expected: (drafts.len() + 1) * vocab,
            })
    };
    for (i, draft) in drafts.iter().enumerate() {
        let p = candidate_distribution(row(i)?, &params)?;
        if let Some(replacement) = verify_draft(sampler, &p, draft)? {
            return Ok((i, replacement));
        }
    }
    let bonus = sampler.sample(row(drafts.len())?)?;
    Ok((drafts.len(), bonus))
}

/// Expected tokens emitted by a round of `k` drafts when each draft is
/// accepted with probability `alpha` independently: `Σ_{i=0..k} αⁱ` (the
/// accepted prefix plus the replacement or bonus token).
pub fn expected_tokens(alpha: f64, k: usize) -> f64 {
    let alpha = alpha.clamp(0.0, 1.0);
    (0..=k).map(|i| alpha.powi(i as i32)).sum()
}

/// Settings of a [`DraftPolicy`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftPolicyConfig {
    /// Most drafts per round (`k`, ≥ 1; 1 by default).
    pub max_draft: usize,
    /// Choose `k` from measurements (`true`, the default) or always draft
    /// `max_draft`.
    pub adaptive: bool,
    /// Storage read rate in bytes per second: a pass costs
    /// `max(wall seconds, bytes read / rate)`, so expert bytes a verify pass
    /// misses count even when their reads overlap compute.
    pub read_bytes_per_second: f64,
    /// While drafting is off, probe with one `k = 1` round after this many
    /// plain steps, to notice when it starts paying.
    pub probe_every: usize,
    /// Weight of a new measurement in the running averages, in `(0, 1]`.
    pub smoothing: f64,
}

impl Default for DraftPolicyConfig {
    fn default() -> Self {
        Self {
            max_draft: 1,
            adaptive: true,
            read_bytes_per_second: 3e9,
            probe_every: 32,
            smoothing: 0.2,
        }
    }
}

impl DraftPolicyConfig {
    /// Always `k` drafts per round.
    pub fn fixed(k: usize) -> Self {
        Self {
            max_draft: k.max(1),
            adaptive: false,
            ..Self::default()
        }
    }
}

/// Chooses the drafts per round from what rounds and plain steps cost.
///
/// It keeps running averages of the cost of a plain step `c₀` and of the
/// extra cost per drafted token `δ` of a verify round (draft passes plus the
/// experts the verify pass misses beyond a plain step's), and a
/// Beta(1, 1)-smoothed estimate `α` of the per-draft acceptance (accepted /
/// (accepted + rejections)). It picks the `k ∈ 0..=max_draft` minimizing the
/// expected cost per emitted token `(c₀ + k·δ) / Σ_{i≤k} αⁱ`; `k = 0` is a
/// plain step. It measures a plain step first, then drafts `max_draft` until
/// `δ` is known; while off it probes every
/// [`probe_every`](DraftPolicyConfig::probe_every) plain steps.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftPolicy {
    config: DraftPolicyConfig,
    accepted: f64,
    trials: f64,
    plain_cost: Option<f64>,
    extra_per_draft: Option<f64>,
    plain_since_round: usize,
}

impl DraftPolicy {
    /// A policy with no measurements.
    pub fn new(config: DraftPolicyConfig) -> Self {
        Self {
            config: DraftPolicyConfig {
                max_draft: config.max_draft.max(1),
                smoothing: if config.smoothing > 0.0 && config.smoothing <= 1.0 {
                    config.smoothing
                } else {
                    DraftPolicyConfig::default().smoothing
                },
                ..config
            },
            accepted: 0.0,
            trials: 0.0,
            plain_cost: None,
            extra_per_draft: None,
            plain_since_round: 0,
        }
    }

    /// The settings.
    pub fn config(&self) -> &DraftPolicyConfig {
        &self.config
    }

    /// Estimated per-draft acceptance probability.
    pub fn acceptance(&self) -> f64 {
        (self.accepted + 1.0) / (self.trials + 2.0)
    }

    /// Cost of one pass: `max(seconds, bytes / read rate)`.
    pub fn pass_cost(&self, bytes: u64, seconds: f64) -> f64 {
        let rate = self.config.read_bytes_per_second;
        let io = if rate > 0.0 { bytes as f64 / rate } else { 0.0 };
        seconds.max(io)
    }

    /// Drafts for the next round (0: a plain step).
    pub fn next_k(&self) -> usize {
        let max = self.config.max_draft;
        if !self.config.adaptive {
            return max;
        }
        let Some(c0) = self.plain_cost else {
            return 0;
        };
        let Some(delta) = self.extra_per_draft else {
            return max;
        };
        let alpha = self.acceptance();
        let mut best = (0, c0);
        for k in 1..=max {
            let per_token = (c0 + k as f64 * delta) / expected_tokens(alpha, k);
            if per_token < best.1 {
                best = (k, per_token);
            }
        }
        if best.0 == 0 && self.plain_since_round >= self.config.probe_every {
            return 1;
        }
        best.0
    }

    /// Records a plain step that read `bytes` and took `seconds`.
    pub fn record_plain(&mut self, bytes: u64, seconds: f64) {
        let cost = self.pass_cost(bytes, seconds);
        self.plain_cost = Some(self.blend(self.plain_cost, cost));
        self.plain_since_round += 1;
    }

    /// Records a round (drafting plus verify) of `drafted` drafts, `accepted`
    /// of them accepted, that read `bytes` and took `seconds`.
    pub fn record_round(&mut self, drafted: usize, accepted: usize, bytes: u64, seconds: f64) {
        self.plain_since_round = 0;
        if drafted == 0 {
            return;
        }
        let decay = 1.0 - self.config.smoothing / 4.0;
        self.accepted = self.accepted * decay + accepted as f64;
        self.trials =
            self.trials * decay + accepted as f64 + f64::from(u8::from(accepted < drafted));
        if let Some(c0) = self.plain_cost {
            let extra = ((self.pass_cost(bytes, seconds) - c0) / drafted as f64).max(0.0);
            self.extra_per_draft = Some(self.blend(self.extra_per_draft, extra));
        }
    }

    fn blend(&self, old: Option<f64>, new: f64) -> f64 {
        match old {
            Some(o) => o + self.config.smoothing * (new - o),
            None => new,
        }
    }
}

/// A drafter that knows the continuation: at generated position `j` it
/// proposes `reference[j]` with probability `rate`, else
/// `(reference[j] + 1) % vocab`, deterministically (`q = None`).
///
/// With `reference` the model's own greedy continuation of the prompt, each
/// greedy draft that gets verified is accepted exactly when it is the
/// reference token, so with probability `rate`, independent of the model
/// (the session's `accepted / drafted` is lower for `k > 1`: drafts after a
/// round's first rejection count as drafted).
#[derive(Debug, Clone)]
pub struct SetRateDrafter {
    prompt_len: usize,
    reference: Vec<u32>,
    vocab: u32,
    rate: f64,
    rng: ChaCha8Rng,
}

impl SetRateDrafter {
    /// A drafter for a prompt of `prompt_len` tokens whose continuation is
    /// `reference`; `rate` is clamped to `[0, 1]`.
    pub fn new(prompt_len: usize, reference: Vec<u32>, vocab: usize, rate: f64, seed: u64) -> Self {
        Self {
            prompt_len,
            reference,
            vocab: u32::try_from(vocab.max(1)).unwrap_or(u32::MAX),
            rate: rate.clamp(0.0, 1.0),
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }
}

impl<M: LanguageModel> Drafter<M> for SetRateDrafter {
    fn observe(
        &mut self,
        _model: &mut M,
        _fed: &[u32],
        _kept: usize,
        _next: u32,
    ) -> std::result::Result<(), BoxError> {
        Ok(())
    }

    fn draft(
        &mut self,
        _model: &mut M,
        context: &[u32],
        k: usize,
        _sampling: &SamplingParams,
    ) -> std::result::Result<Vec<DraftToken>, BoxError> {
        // `context` ends with generated token `j − 1`; drafts start at `j`.
        let start = context.len().saturating_sub(self.prompt_len);
        Ok(self
            .reference
            .iter()
            .skip(start)
            .take(k)
            .map(|&id| {
                let hit = self.rng.random::<f64>() < self.rate;
                DraftToken::certain(if hit { id } else { (id + 1) % self.vocab })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_tokens_is_a_geometric_sum() {
        assert_eq!(expected_tokens(0.0, 3), 1.0);
        assert_eq!(expected_tokens(1.0, 3), 4.0);
        assert!((expected_tokens(0.5, 2) - 1.75).abs() < 1e-12);
    }

    #[test]
    fn policy_measures_plain_first_then_drafts_and_turns_off_when_it_does_not_pay() {
        let mut p = DraftPolicy::new(DraftPolicyConfig {
            max_draft: 3,
            probe_every: 4,
            ..DraftPolicyConfig::default()
        });
        assert_eq!(p.next_k(), 0, "measure a plain step first");
        p.record_plain(1_000_000_000, 0.1);
        assert_eq!(p.next_k(), 3, "then draft until the extra cost is known");
        // Rounds that read a lot more than a plain step and accept nothing.
        for _ in 0..20 {
            p.record_round(3, 0, 4_000_000_000, 0.2);
        }
        assert!(p.acceptance() < 0.1);
        assert_eq!(p.next_k(), 0, "drafting does not pay");
        for _ in 0..3 {
            p.record_plain(1_000_000_000, 0.1);
            assert_eq!(p.next_k(), 0);
        }
        p.record_plain(1_000_000_000, 0.1);
        assert_eq!(p.next_k(), 1, "probe after probe_every plain steps");
    }

    #[test]
    fn policy_keeps_drafting_when_cheap_drafts_are_accepted() {
        let mut p = DraftPolicy::new(DraftPolicyConfig {
            max_draft: 3,
            ..DraftPolicyConfig::default()
        });
        p.record_plain(1_000_000_000, 0.1);
        for _ in 0..20 {
            // Verify reads 10% more per draft; 90% of drafts are accepted.
            p.record_round(3, 3, 1_300_000_000, 0.13);
            p.record_round(3, 2, 1_300_000_000, 0.13);
        }
        assert_eq!(p.next_k(), 3);
        let fixed = DraftPolicy::new(DraftPolicyConfig::fixed(2));
        assert_eq!(fixed.next_k(), 2);
    }

    #[test]
    fn greedy_verify_accepts_the_argmax_only_and_draws_nothing() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        let logits = [0.0f32, 3.0, 1.0, /* row 1 */ 2.0, 0.0, 0.0];
        let drafts = [DraftToken::certain(1)];
        assert_eq!(accept_drafts(&mut s, &logits, 3, &drafts).unwrap(), (1, 0));
        let drafts = [DraftToken::certain(2)];
        assert_eq!(accept_drafts(&mut s, &logits, 3, &drafts).unwrap(), (0, 1));
        assert!(accept_drafts(&mut s, &logits[..3], 3, &drafts[..]).is_ok());
        let two = [DraftToken::certain(1), DraftToken::certain(0)];
        assert!(matches!(
            accept_drafts(&mut s, &logits, 3, &two),
            Err(GenerateError::LogitsShape { .. })
        ));
    }

    #[test]
    fn rejection_draws_from_the_residual() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            ..SamplingParams::greedy()
        })
        .unwrap();
        // p = (0.5, 0.5, 0), q = (0, 1, 0) for draft 1: accepted with prob
        // 0.5, else the residual max(0, p − q) = (0.5, 0, 0) gives 0.
        let p = [(0, 0.5), (1, 0.5)];
        let d = DraftToken {
            id: 1,
            q: Some(vec![(1, 1.0)]),
        };
        let mut outcomes = [0usize; 3];
        for _ in 0..2000 {
            match verify_draft(&mut s, &p, &d).unwrap() {
                None => outcomes[2] += 1,
                Some(t) => outcomes[t as usize] += 1,
            }
        }
        assert_eq!(outcomes[1], 0);
        assert!(
            (outcomes[2] as f64 / 2000.0 - 0.5).abs() < 0.05,
            "{outcomes:?}"
        );
    }
}
