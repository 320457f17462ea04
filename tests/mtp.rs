//! The MTP head and speculative decoding on a tiny converted GLM model
//! (float32 on the CPU): the head loads with its indexer and streamed int8
//! experts; greedy decoding with MTP drafts (and with set-rate drafters on
//! the accept, partial-accept and reject paths) gives exactly the plain
//! greedy tokens; after a rejection the main and MTP caches give the logits
//! of a run that never drafted.

mod common;

use common::tiny_model::{Fixture, build, prompt, row_rel_error, test_options};
use glm_stream::convert::ConvertOptions;
use glm_stream::generate::speculative::Drafter;
use glm_stream::generate::{
    DraftPolicyConfig, GenerateOptions, Generation, SamplingParams, Session, SetRateDrafter,
};
use glm_stream::model::mtp::MtpDrafter;
use glm_stream::model::{Glm52Model, ModelError, ModelOptions};
use glm_stream::tiny::TinyModelSpec;

const PROMPT: usize = 12;
const TOKENS: usize = 14;

fn fixture() -> Fixture {
    build(
        &TinyModelSpec::default(),
        101,
        &ConvertOptions::default(),
        |_| {},
    )
}

fn open(f: &Fixture) -> Glm52Model {
    Glm52Model::open(
        &f.model,
        &ModelOptions {
            include_mtp: true,
            ..test_options()
        },
    )
    .unwrap()
}

fn greedy(max_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        sampling: SamplingParams::greedy(),
        ..GenerateOptions::default()
    }
}

fn run_plain(model: &mut Glm52Model, ids: &[u32]) -> Generation {
    Session::new(model, None, ids, greedy(TOKENS))
        .unwrap()
        .run(|_| std::ops::ControlFlow::Continue(()))
        .unwrap()
}

#[test]
fn mtp_head_loads_and_streams_its_experts() {
    let f = fixture();
    let mut plain = Glm52Model::open(&f.model, &test_options()).unwrap();
    assert!(plain.mtp_head().is_none());
    assert!(matches!(
        MtpDrafter::new(&mut plain, 0),
        Err(ModelError::NoMtp(_))
    ));

    let mut model = open(&f);
    let head = model.mtp_head().unwrap();
    assert_eq!(head.index(), f.spec.num_hidden_layers);
    assert!(head.has_indexer(), "the converter writes the MTP indexer");

    model.set_keep_hidden(true);
    let ids = prompt(PROMPT, f.spec.vocab_size, 2);
    let mut cache = model.new_cache();
    model.forward(&ids, &mut cache, false).unwrap();
    let width = f.spec.hidden_size;
    assert_eq!(model.last_hidden().len(), PROMPT * width);

    let mut mtp = model.new_mtp_cache().unwrap();
    let before = model.expert_stats();
    let mut tokens = ids[1..].to_vec();
    tokens.push(5);
    let hidden = model.last_hidden().to_vec();
    let out = model.mtp_forward(&tokens, &hidden, &mut mtp).unwrap();
    assert_eq!(out.logits.len(), f.spec.vocab_size);
    assert_eq!(out.hidden.len(), width);
    assert_eq!(mtp.len(), PROMPT);
    let after = model.expert_stats();
    assert!(after.hits + after.misses > before.hits + before.misses);
    // Bad inputs are refused before any work and leave the cache as it was.
    assert!(model.mtp_forward(&[1], &[0.0; 3], &mut mtp).is_err());
    assert!(
        model
            .mtp_forward(&[f.spec.vocab_size as u32], &vec![0.0; width], &mut mtp)
            .is_err()
    );
    assert_eq!(mtp.len(), PROMPT);
}

#[test]
fn greedy_with_drafts_gives_exactly_the_plain_tokens() {
    let f = fixture();
    let mut model = open(&f);
    let ids = prompt(PROMPT, f.spec.vocab_size, 3);
    let want = run_plain(&mut model, &ids).tokens;
    assert_eq!(want.len(), TOKENS);

    for k in [1usize, 3] {
        let drafter = MtpDrafter::new(&mut model, 0).unwrap();
        let g = Session::new(&mut model, None, &ids, greedy(TOKENS))
            .unwrap()
            .with_drafter(drafter, DraftPolicyConfig::fixed(k))
            .unwrap()
            .run(|_| std::ops::ControlFlow::Continue(()))
            .unwrap();
        assert_eq!(g.tokens, want, "MTP k = {k}");
        assert!(g.stats.rounds > 0 && g.stats.drafted > 0);
        eprintln!(
            "MTP k={k}: acceptance {:?}, tokens/forward {:?}",
            g.stats.acceptance_rate(),
            g.stats.tokens_per_forward()
        );
    }

    for (rate, k) in [(1.0, 3usize), (0.0, 2), (0.6, 3)] {
        let drafter = SetRateDrafter::new(ids.len(), want.clone(), f.spec.vocab_size, rate, 5);
        let g = Session::new(&mut model, None, &ids, greedy(TOKENS))
            .unwrap()
            .with_drafter(drafter, DraftPolicyConfig::fixed(k))
            .unwrap()
            .run(|_| std::ops::ControlFlow::Continue(()))
            .unwrap();
        assert_eq!(g.tokens, want, "set rate {rate}, k = {k}");
        let s = g.stats;
        match rate {
            1.0 => {
                assert_eq!(s.accepted, s.drafted);
                assert_eq!(s.decode_forwards, (TOKENS - 1).div_ceil(k + 1));
            }
            0.0 => assert_eq!((s.accepted, s.decode_forwards), (0, TOKENS - 1)),
            _ => assert!(s.accepted > 0 && s.accepted < s.drafted, "{s:?}"),
        }
    }
}

#[test]
fn rollback_after_rejection_gives_the_logits_of_a_run_that_never_drafted() {
    let f = fixture();
    let mut model = open(&f);
    model.set_keep_hidden(true);
    let vocab = f.spec.vocab_size;
    let width = f.spec.hidden_size;
    // Longer than index_topk, so the indexer caches are sparse-selected.
    let ids = prompt(PROMPT, vocab, 4);
    let (x, y) = (7u32, 11u32);

    // Never drafted: prompt, x, y.
    let mut clean = model.new_cache();
    model.forward(&ids, &mut clean, false).unwrap();
    let h_prompt = model.last_hidden().to_vec();
    model.forward(&[x], &mut clean, false).unwrap();
    let h_x = model.last_hidden().to_vec();
    let want = model.forward(&[y], &mut clean, false).unwrap();

    // Drafted three tokens after x, all rejected: roll back to prompt + x.
    let mut spec = model.new_cache();
    model.forward(&ids, &mut spec, false).unwrap();
    let rows = model.forward(&[x, 3, 4, 5], &mut spec, true).unwrap();
    assert_eq!(rows.len(), 4 * vocab);
    let h_x_verify = model.last_hidden()[..width].to_vec();
    spec.truncate(ids.len() + 1);
    let got = model.forward(&[y], &mut spec, false).unwrap();
    let rel = row_rel_error(&got, &want);
    assert!(rel <= 1e-4, "main logits after rollback: {rel:e}");
    assert!(row_rel_error(&h_x_verify, &h_x) <= 1e-4);

    // MTP cache: committed pairs, then a chain of drafts rolled back, then
    // the next pair, against the same pairs without the chain.
    let mut pairs: Vec<u32> = ids[1..].to_vec();
    pairs.push(x);
    let mut never = model.new_mtp_cache().unwrap();
    model.mtp_forward(&pairs, &h_prompt, &mut never).unwrap();
    let want = model.mtp_forward(&[y], &h_x, &mut never).unwrap();

    let mut drafted = model.new_mtp_cache().unwrap();
    let out = model.mtp_forward(&pairs, &h_prompt, &mut drafted).unwrap();
    let committed = drafted.len();
    let chain = model.mtp_forward(&[9], &out.hidden, &mut drafted).unwrap();
    model
        .mtp_forward(&[10], &chain.hidden, &mut drafted)
        .unwrap();
    drafted.truncate(committed);
    let got = model.mtp_forward(&[y], &h_x, &mut drafted).unwrap();
    assert_eq!(got.logits, want.logits);
    assert_eq!(got.hidden, want.hidden);
}

#[test]
fn mtp_drafter_keeps_only_committed_entries_between_rounds() {
    let f = fixture();
    let mut model = open(&f);
    let ids = prompt(PROMPT, f.spec.vocab_size, 5);
    let mut drafter = MtpDrafter::new(&mut model, 1).unwrap();
    let mut cache = model.new_cache();
    let logits = model.forward(&ids, &mut cache, false).unwrap();
    let first = glm_stream::generate::sampling::argmax(&logits).unwrap();
    drafter.observe(&mut model, &ids, ids.len(), first).unwrap();
    assert_eq!(drafter.pending(), PROMPT);
    let ctx: Vec<u32> = ids.iter().copied().chain([first]).collect();
    let drafts = drafter
        .draft(&mut model, &ctx, 3, &SamplingParams::greedy())
        .unwrap();
    assert_eq!(drafts.len(), 3);
    // Entries 0..P-1: the prompt's pairs, the last one with the chosen token.
    assert_eq!(drafter.cache().len(), PROMPT);
    assert_eq!(drafter.pending(), 0);
    // Sampling drafts report their distribution.
    drafter
        .observe(&mut model, &ids[..1], 1, first)
        .unwrap_or_else(|e| panic!("{e}"));
    let sampled = drafter
        .draft(
            &mut model,
            &ctx,
            2,
            &SamplingParams {
                temperature: 1.0,
                ..SamplingParams::greedy()
            },
        )
        .unwrap();
    assert!(sampled.iter().all(|d| {
        d.q.as_ref()
            .is_some_and(|q| (q.iter().map(|(_, p)| p).sum::<f64>() - 1.0).abs() < 1e-9)
    }));
}
