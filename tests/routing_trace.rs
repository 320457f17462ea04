//! The routing trace recorded by `Glm52Model`: its shape, its file round
//! trip, and that replaying it through the residency policy at the model's
//! slot count reproduces the pool's own hit and miss counts.

mod common;

use common::tiny_model::{build, prompt, test_options};
use glm_stream::convert::ConvertOptions;
use glm_stream::experts::replay::{belady, lru, replay_policy};
use glm_stream::experts::{PolicyConfig, RoutingTrace};
use glm_stream::model::Glm52Model;
use glm_stream::tiny::TinyModelSpec;

#[test]
fn recorded_trace_replays_to_the_pools_counts() {
    let spec = TinyModelSpec::default();
    let f = build(&spec, 11, &ConvertOptions::default(), |_| {});
    let mut model = Glm52Model::open(&f.model, &test_options()).unwrap();
    let moe_layers: Vec<u32> = (0..spec.num_hidden_layers)
        .filter(|&l| model.config().is_moe_layer(l))
        .map(|l| l as u32)
        .collect();
    let top_k = spec.num_experts_per_tok;
    let mut cache = model.new_cache();

    // Not recording: nothing is kept.
    let ids = prompt(3, spec.vocab_size, 1);
    model.forward(&ids, &mut cache, false).unwrap();
    assert!(model.routing_trace().unwrap().is_empty());
    let before = model.expert_stats();

    // A 5-token prefill in chunks of 2 (3 passes), then 4 decode steps.
    model.set_routing_trace(true);
    model.set_prefill_chunk(2);
    let ids = prompt(5, spec.vocab_size, 2);
    let mut logits = model.forward(&ids, &mut cache, false).unwrap();
    for _ in 0..4 {
        let next = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap();
        logits = model.forward(&[next], &mut cache, false).unwrap();
    }
    model.set_routing_trace(false);
    let after = model.expert_stats();
    let stats_traced = (after.hits - before.hits, after.misses - before.misses);
    model.forward(&[1], &mut cache, false).unwrap();
    assert_eq!(
        model.routing_trace().unwrap().len(),
        (3 + 4) * moe_layers.len(),
        "nothing recorded once off"
    );

    let trace = model.routing_trace().unwrap().clone();
    assert_eq!(trace.top_k(), top_k);
    assert_eq!(trace.experts() as usize, spec.n_routed_experts);
    assert_eq!(trace.len(), (3 + 4) * moe_layers.len());
    assert_eq!(trace.rows(), (5 + 4) * moe_layers.len());
    let layers: Vec<u32> = trace.records()[..moe_layers.len()]
        .iter()
        .map(|r| r.layer)
        .collect();
    assert_eq!(layers, moe_layers);
    let calls: Vec<u64> = trace.records().iter().map(|r| r.call).collect();
    assert_eq!(calls.first(), Some(&0));
    assert_eq!(calls.last(), Some(&4));
    assert_eq!(trace.records()[0].ids.len(), 2 * top_k);

    // The pool served exactly these requests from the state the untraced
    // first call left, so replay the whole run: the untraced calls are
    // recorded again on a fresh model with the same options.
    let mut fresh = Glm52Model::open(&f.model, &test_options()).unwrap();
    fresh.set_routing_trace(true);
    let mut cache = fresh.new_cache();
    fresh
        .forward(&prompt(3, spec.vocab_size, 1), &mut cache, false)
        .unwrap();
    let head = fresh.take_routing_trace().unwrap();
    assert!(fresh.routing_trace().unwrap().is_empty());
    let mut whole = RoutingTrace::new(trace.experts(), top_k).unwrap();
    for r in head.records() {
        whole.push(r.call, r.layer, r.ids.clone()).unwrap();
    }
    for r in trace.records() {
        whole.push(r.call + 1, r.layer, r.ids.clone()).unwrap();
    }
    let slots = model.expert_stats().slots;
    let replay = replay_policy(&whole, slots, &PolicyConfig::new(1, 1, 1)).unwrap();
    let head_replay = replay_policy(&head, slots, &PolicyConfig::new(1, 1, 1)).unwrap();
    assert_eq!(
        (
            replay.hits - head_replay.hits,
            replay.misses - head_replay.misses
        ),
        stats_traced,
        "replaying the trace reproduces the pool's counts"
    );
    let b = belady(&whole, slots).unwrap();
    assert!(b.hits >= replay.hits);
    assert!(b.hits >= lru(&whole, slots).unwrap().hits);

    // File round trip.
    let path = f.dir.path().join("trace.jsonl");
    trace.save(&path).unwrap();
    assert_eq!(RoutingTrace::load(&path).unwrap(), trace);
}
