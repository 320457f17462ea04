//! MTP speculative decoding against plain decoding on the cached tiny random
//! GLM model (the one `examples/decode` uses without `--model`), greedy.
//!
//! Modes, each on a freshly opened model (cold expert pool):
//! * `plain`: no drafting;
//! * `mtp k=1 adaptive`: the MTP drafter under the default draft policy;
//! * `mtp k=1 fixed`, `mtp k=3 fixed`: the MTP drafter, always drafting;
//! * `set-rate p=0.8 k=3`: a drafter that proposes the plain run's own token
//!   with probability 0.8 (the acceptance a trained MTP head reaches is not
//!   available on a random model, whose MTP head almost never agrees with
//!   it), to show what the verify path gives when drafts are accepted.
//!
//! Every mode must reproduce the plain tokens (asserted). Reported per mode:
//! tokens per main forward, acceptance rate, decode tok/s, the expert hit
//! rate over the whole run, and expert bytes read per decoded token (plain
//! steps and rounds, drafting included).
//!
//! Environment: `GLM_BENCH_TOKENS` (default 96) new tokens after a 16-token
//! prompt; `GLM_BENCH_REPEATS` (default 3) runs per mode, the best decode
//! time kept. Run: `cargo bench --bench mtp_decode`.

use std::time::Duration;

use glm_stream::generate::{
    self, DraftPolicyConfig, GenerateOptions, Generation, SamplingParams, Session, SetRateDrafter,
};
use glm_stream::model::mtp::MtpDrafter;
use glm_stream::model::{Glm52Model, ModelOptions};

#[derive(Debug, Clone, Copy)]
enum Mode {
    Plain,
    Mtp { k: usize, adaptive: bool },
    SetRate { rate: f64, k: usize },
}

impl Mode {
    fn label(self) -> String {
        match self {
            Self::Plain => "plain".into(),
            Self::Mtp { k, adaptive } => {
                format!("mtp k={k} {}", if adaptive { "adaptive" } else { "fixed" })
            }
            Self::SetRate { rate, k } => format!("set-rate p={rate} k={k}"),
        }
    }
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let tokens = env("GLM_BENCH_TOKENS", 96).max(2);
    let repeats = env("GLM_BENCH_REPEATS", 3).max(1);
    let dir = generate::default_model_dir()?;
    let opts = ModelOptions {
        include_mtp: true,
        io_threads: 2,
        direct_io: false,
        ..ModelOptions::default()
    };
    let probe = Glm52Model::open(&dir, &opts)?;
    let vocab = probe.config().vocab_size;
    drop(probe);
    let prompt: Vec<u32> = (0..16).map(|i| ((i * 37 + 5) % vocab) as u32).collect();
    let gen_opts = GenerateOptions {
        max_tokens: tokens,
        sampling: SamplingParams::greedy(),
        ..GenerateOptions::default()
    };

    let modes = [
        Mode::Plain,
        Mode::Mtp {
            k: 1,
            adaptive: true,
        },
        Mode::Mtp {
            k: 1,
            adaptive: false,
        },
        Mode::Mtp {
            k: 3,
            adaptive: false,
        },
        Mode::SetRate { rate: 0.8, k: 3 },
    ];
    println!(
        "{:<22} {:>10} {:>10} {:>12} {:>9} {:>14}",
        "mode", "tok/fwd", "accept", "decode tok/s", "hit rate", "KB read/token"
    );
    let mut reference: Option<Vec<u32>> = None;
    for mode in modes {
        let mut best: Option<(Duration, Generation, f64)> = None;
        for _ in 0..repeats {
            let mut model = Glm52Model::open(&dir, &opts)?;
            let mtp = match mode {
                Mode::Mtp { .. } => Some(MtpDrafter::new(&mut model, 0)?),
                _ => None,
            };
            let session = Session::new(&mut model, None, &prompt, gen_opts.clone())?;
            let session = match (mode, mtp) {
                (Mode::Mtp { k, adaptive }, Some(d)) => {
                    let policy = if adaptive {
                        DraftPolicyConfig {
                            max_draft: k,
                            ..DraftPolicyConfig::default()
                        }
                    } else {
                        DraftPolicyConfig::fixed(k)
                    };
                    session.with_drafter(d, policy)?
                }
                (Mode::SetRate { rate, k }, _) => {
                    let want = reference.clone().ok_or("plain runs first")?;
                    let d = SetRateDrafter::new(prompt.len(), want, vocab, rate, 1);
                    session.with_drafter(d, DraftPolicyConfig::fixed(k))?
                }
                _ => session,
            };
            let g = session.run(|_| std::ops::ControlFlow::Continue(()))?;
            let hit = model.expert_stats().hit_rate.unwrap_or(f64::NAN);
            if best.as_ref().is_none_or(|(d, _, _)| g.stats.decode < *d) {
                best = Some((g.stats.decode, g, hit));
            }
        }
        let Some((_, g, hit)) = best else {
            continue;
        };
        match &reference {
            None => reference = Some(g.tokens.clone()),
            Some(want) => assert_eq!(&g.tokens, want, "{} changed the output", mode.label()),
        }
        let s = g.stats;
        let decoded = s.generated_tokens.saturating_sub(1).max(1) as f64;
        let bytes = (s.plain_bytes + s.round_bytes) as f64 / decoded;
        println!(
            "{:<22} {:>10.3} {:>10} {:>12.1} {:>9.3} {:>14.1}",
            mode.label(),
            s.tokens_per_forward().unwrap_or(f64::NAN),
            s.acceptance_rate()
                .map_or("-".into(), |a| format!("{a:.3}")),
            s.decode_tok_s(),
            hit,
            bytes / 1e3,
        );
    }
    Ok(())
}
