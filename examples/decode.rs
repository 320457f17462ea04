//! Single-prompt decode with routed experts streamed from disk.
//!
//! ```text
//! cargo run --release --example decode -- [--model DIR] [--prompt TEXT | --prompt-ids 1,2,3]
//!     [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S] [--raw]
//!     [--ram-budget GB] [--dump-logits FILE.npy] [--mtp[=K]] [--mtp-fixed]
//!     [--routing-trace FILE.jsonl] [--kernels auto|stock|fused|fused-simt]
//! ```
//!
//! `--kernels` pins how routed experts are computed (default `auto`: the
//! fused kernels on a GPU build for decode-sized waves, MLX's
//! `quantized_matmul` otherwise; `fused` fails at open where it cannot run).
//!
//! `--mtp[=K]` decodes speculatively with the model's MTP head, at most `K`
//! drafts per round (1 by default), turned down or off by the expert-aware
//! draft policy when it does not pay; `--mtp-fixed` always drafts `K`. The
//! output is the same as without (greedy: the same tokens).
//!
//! Without `--model` it builds (once, cached) a tiny random GLM model with the
//! crate's generator and converter and decodes on it. The generated text goes
//! to stdout as it is produced; one `summary …` line goes to stderr at the end.
//! Every input is checked before any MLX work: bad ids, an empty prompt, a
//! prompt that with `--max-tokens` would overflow the context, a container that
//! is not `glm_moe_dsa`.
//!
//! `--routing-trace FILE` records the routed experts of every MoE layer of
//! the run (prefill and decode) and saves them as JSON lines
//! ([`glm_stream::experts::RoutingTrace`]) for replay through the residency
//! policies (`glm_stream::experts::replay`).

use std::io::Write;
use std::path::PathBuf;

use glm_stream::container::ColibriContainer;
use glm_stream::generate::{
    self, DraftPolicyConfig, GenerateOptions, SamplingParams, Session, Tokenizer,
};
use glm_stream::kernels::KernelFamily;
use glm_stream::model::mtp::MtpDrafter;
use glm_stream::model::{Glm52Model, ModelOptions};

#[derive(Debug)]
struct Args {
    model: Option<PathBuf>,
    prompt: Option<String>,
    prompt_ids: Option<Vec<u32>>,
    max_tokens: usize,
    temperature: f32,
    top_p: f32,
    top_k: usize,
    seed: u64,
    raw: bool,
    ram_budget_gb: Option<f64>,
    dump_logits: Option<PathBuf>,
    mtp: Option<usize>,
    mtp_fixed: bool,
    routing_trace: Option<PathBuf>,
    kernels: KernelFamily,
}

const USAGE: &str = "usage: decode [--model DIR] [--prompt TEXT | --prompt-ids 1,2,3] [--max-tokens N] \
[--temperature T] [--top-p P] [--top-k K] [--seed S] [--raw] [--ram-budget GB] [--dump-logits FILE.npy] \
[--mtp[=K]] [--mtp-fixed] \
[--routing-trace FILE.jsonl] [--kernels auto|stock|fused|fused-simt]";

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        model: None,
        prompt: None,
        prompt_ids: None,
        max_tokens: 32,
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        seed: 0,
        raw: false,
        ram_budget_gb: None,
        dump_logits: None,
        mtp: None,
        mtp_fixed: false,
        routing_trace: None,
        kernels: KernelFamily::Auto,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value\n{USAGE}"))
        };
        let num_err = |name: &str, v: &str| format!("{name}: cannot parse {v:?}");
        match flag.as_str() {
            "--model" => a.model = Some(PathBuf::from(value("--model")?)),
            "--prompt" => a.prompt = Some(value("--prompt")?),
            "--prompt-ids" => {
                let v = value("--prompt-ids")?;
                let ids = v
                    .split(',')
                    .map(|s| {
                        s.trim()
                            .parse::<u32>()
                            .map_err(|_| num_err("--prompt-ids", s))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                a.prompt_ids = Some(ids);
            }
            "--max-tokens" => {
                let v = value("--max-tokens")?;
                a.max_tokens = v.parse().map_err(|_| num_err("--max-tokens", &v))?;
            }
            "--temperature" => {
                let v = value("--temperature")?;
                a.temperature = v.parse().map_err(|_| num_err("--temperature", &v))?;
            }
            "--top-p" => {
                let v = value("--top-p")?;
                a.top_p = v.parse().map_err(|_| num_err("--top-p", &v))?;
            }
            "--top-k" => {
                let v = value("--top-k")?;
                a.top_k = v.parse().map_err(|_| num_err("--top-k", &v))?;
            }
            "--seed" => {
                let v = value("--seed")?;
                a.seed = v.parse().map_err(|_| num_err("--seed", &v))?;
            }
            "--ram-budget" => {
                let v = value("--ram-budget")?;
                let gb: f64 = v.parse().map_err(|_| num_err("--ram-budget", &v))?;
                if !(gb.is_finite() && gb > 0.0) {
                    return Err(format!(
                        "--ram-budget must be a positive number of GB, got {v}"
                    ));
                }
                a.ram_budget_gb = Some(gb);
            }
            "--dump-logits" => a.dump_logits = Some(PathBuf::from(value("--dump-logits")?)),
            "--routing-trace" => {
                a.routing_trace = Some(PathBuf::from(value("--routing-trace")?));
            }
            "--kernels" => {
                let v = value("--kernels")?;
                a.kernels = v.parse().map_err(|e| format!("--kernels: {e}"))?;
            }
            "--raw" => a.raw = true,
            "--mtp" => a.mtp = Some(1),
            "--mtp-fixed" => a.mtp_fixed = true,
            f if f.starts_with("--mtp=") => {
                let v = &f["--mtp=".len()..];
                let k: usize = v.parse().map_err(|_| num_err("--mtp", v))?;
                if k == 0 {
                    return Err("--mtp=K needs K >= 1".into());
                }
                a.mtp = Some(k);
            }
            "-h" | "--help" => return Err(USAGE.to_string()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if a.mtp_fixed && a.mtp.is_none() {
        return Err("--mtp-fixed needs --mtp[=K]".into());
    }
    if a.prompt.is_some() && a.prompt_ids.is_some() {
        return Err("give --prompt or --prompt-ids, not both".into());
    }
    Ok(a)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => {
            eprintln!("no --model given: using the cached tiny random model");
            generate::default_model_dir()?
        }
    };

    // Checks that need no MLX: the config, the tokens and the context length.
    let container = ColibriContainer::open(&dir)?;
    let config = container.config().clone();
    if config.model_type != "glm_moe_dsa" {
        return Err(format!(
            "{}: model_type is {:?}, this decoder runs glm_moe_dsa",
            dir.join("config.json").display(),
            config.model_type
        )
        .into());
    }
    let tokenizer = Tokenizer::from_model_dir(&dir)?;
    let prompt: Vec<u32> = match (&args.prompt_ids, &args.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) => tokenizer.encode_prompt(text, args.raw)?,
        (None, None) => tokenizer.encode_prompt("Hello", args.raw)?,
    };
    if prompt.is_empty() {
        return Err("the prompt is empty".into());
    }
    if let Some((i, id)) = prompt
        .iter()
        .enumerate()
        .find(|&(_, &id)| id as usize >= config.vocab_size)
    {
        return Err(format!(
            "prompt token {i} is {id}, outside the vocabulary of {}",
            config.vocab_size
        )
        .into());
    }
    if prompt.len() + args.max_tokens > config.max_position_embeddings {
        return Err(format!(
            "{} prompt tokens + {} new tokens exceed max_position_embeddings {}",
            prompt.len(),
            args.max_tokens,
            config.max_position_embeddings
        )
        .into());
    }
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
    };
    sampling.validate()?;
    let mut opts = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling,
        dump_logits: args.dump_logits.is_some(),
        ..GenerateOptions::default()
    };
    if let Some(g) = container.generation_config() {
        opts = opts.with_generation_config(g);
    }
    drop(container);

    let model_opts = ModelOptions {
        ram_budget_bytes: args.ram_budget_gb.map(|gb| (gb * 1e9) as u64),
        include_mtp: args.mtp.is_some(),
        kernel_family: args.kernels,
        ..ModelOptions::default()
    };
    let mut model = Glm52Model::open(&dir, &model_opts)?;
    let drafter = match args.mtp {
        Some(_) => Some(MtpDrafter::new(&mut model, args.seed)?),
        None => None,
    };
    model.set_routing_trace(args.routing_trace.is_some());
    let before = model.expert_stats();
    let mut session = Session::new(&mut model, Some(&tokenizer), &prompt, opts)?;
    if let (Some(drafter), Some(k)) = (drafter, args.mtp) {
        let policy = if args.mtp_fixed {
            DraftPolicyConfig::fixed(k)
        } else {
            DraftPolicyConfig {
                max_draft: k,
                ..DraftPolicyConfig::default()
            }
        };
        session = session.with_drafter(drafter, policy)?;
    }
    let mut stdout = std::io::stdout();
    for token in session.by_ref() {
        let token = token?;
        write!(stdout, "{}", token.text)?;
        stdout.flush()?;
    }
    writeln!(stdout)?;
    let stats = *session.stats();
    let logits = session.take_logits();
    drop(session);
    if let (Some(path), Some(dump)) = (&args.dump_logits, logits) {
        dump.write_npy(path)?;
        eprintln!("wrote {} logits rows to {}", dump.rows(), path.display());
    }

    if let Some(path) = &args.routing_trace {
        match model.routing_trace() {
            Some(trace) => {
                trace.save(path)?;
                eprintln!(
                    "wrote the routing of {} MoE passes ({} rows) to {}",
                    trace.len(),
                    trace.rows(),
                    path.display()
                );
            }
            None => eprintln!("the model has no routed experts: no routing trace written"),
        }
    }

    let after = model.expert_stats();
    let hits = after.hits - before.hits;
    let misses = after.misses - before.misses;
    let hit_rate = if hits + misses > 0 {
        hits as f64 / (hits + misses) as f64
    } else {
        f64::NAN
    };
    let tokens = stats.generated_tokens.max(1) as f64;
    let disk_gb_per_token = (after.bytes_read - before.bytes_read) as f64 / 1e9 / tokens;
    let mut summary = format!(
        "summary prompt_tokens={} prefill_tok_s={:.2} decode_tok_s={:.2} hit_rate={:.3} disk_gb_per_token={:.4} peak_rss_gb={:.3}",
        stats.prompt_tokens,
        stats.prefill_tok_s(),
        stats.decode_tok_s(),
        hit_rate,
        disk_gb_per_token,
        peak_rss_gb(),
    );
    if let Some(k) = args.mtp {
        summary.push_str(&format!(
            " mtp={k} acceptance_rate={:.3} tokens_per_forward={:.3} drafted={} accepted={}",
            stats.acceptance_rate().unwrap_or(f64::NAN),
            stats.tokens_per_forward().unwrap_or(f64::NAN),
            stats.drafted,
            stats.accepted,
        ));
    }
    eprintln!("{summary}");
    Ok(())
}

/// Peak resident set size of this process in GB (10⁹ bytes), from the kernel's
/// high-water mark; NaN where it cannot be read.
fn peak_rss_gb() -> f64 {
    if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
        if let Some(kb) = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        {
            return kb * 1024.0 / 1e9;
        }
    }
    f64::NAN
}
