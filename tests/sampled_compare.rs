//! Comparisons over what a replay holds: a session saved without its tensors keeps a 32-value
//! sample of each output, so comparisons must use the samples where both sides have the same
//! elements, say that they need the full tensors where not, and never index past the values.

mod common;

use mladb::backend::cpu::CpuBackend;
use mladb::debug::compare::{compare_runs, prefill_vs_decode};
use mladb::debug::runner::Job;
use mladb::debug::sample::{sample_indices, NEEDS_TENSORS};
use mladb::debug::tolerance::Tolerances;
use mladb::debug::{Flags, RunRecord};
use mladb::engine::generate::Schedule;
use mladb::engine::StorageDtype;
use mladb::session::recorded::{RecordedRun, RunRole};
use std::sync::Arc;

/// The run as a replay without tensors holds it: every output a sample.
fn sampled(run: &RunRecord) -> RunRecord {
    RecordedRun::of(run, RunRole::Main, true).to_record(None)
}

struct Runs {
    stepped: RunRecord,
    whole: RunRecord,
    naive: RunRecord,
    heads: usize,
}

/// glm5-tiny, 12 tokens of which 9 are prefilled, then 2 decode steps; the whole sequence
/// prefilled at once; and the stepped run with MLA disabled.
fn runs() -> Runs {
    let model = common::synthetic("glm5-tiny", 0);
    let prompt = common::prompt(model.layout.vocab_size, 12);
    let schedule = Schedule {
        prompt: prompt.clone(),
        prefill_len: 9,
        decode_steps: 2,
    };
    let layers = 0..model.layout.num_layers;
    let job = Job {
        model: &model,
        backend: &CpuBackend,
        schedule: &schedule,
        layers: &layers,
        poison: true,
    };
    let stepped = job.run(Flags::default(), None).unwrap();
    let tokens = stepped.outcome.as_ref().unwrap().tokens.clone();
    let whole_schedule = Schedule {
        prefill_len: tokens.len(),
        prompt: tokens.clone(),
        decode_steps: 0,
    };
    let whole = job
        .run_schedule(Flags::default(), &whole_schedule, None)
        .unwrap();
    let forced = Schedule {
        prompt: tokens,
        prefill_len: 9,
        decode_steps: 0,
    };
    let naive = job
        .run_schedule(Flags::parse("mla-disable").unwrap(), &forced, None)
        .unwrap();
    Runs {
        stepped,
        whole,
        naive,
        heads: model.layout.num_heads,
    }
}

/// Regression: prefill vs decode over samples indexed the prefill's attention probabilities
/// past the 32 values held ("range start index 99 out of range for slice of length 32").
#[test]
fn prefill_vs_decode_over_samples_says_it_needs_the_tensors() {
    let r = runs();
    let full = prefill_vs_decode(
        &r.stepped,
        &r.whole,
        r.heads,
        &Tolerances::Table(StorageDtype::F32),
    );
    assert!(full.iter().all(|c| c.diff.is_ok()), "whole outputs compare");
    let (a, b) = (sampled(&r.stepped), sampled(&r.whole));
    let list = prefill_vs_decode(&a, &b, r.heads, &Tolerances::Table(StorageDtype::F32));
    assert_eq!(list.len(), full.len(), "every op is listed");
    for c in &list {
        let e = &a.events[c.index];
        let numel: usize = e.shape.iter().product();
        let whole_numel: usize = b.events[b.find(mladb::engine::Phase::Prefill, &e.name).unwrap()]
            .shape
            .iter()
            .product();
        if numel > 32 || whole_numel > 32 {
            assert_eq!(c.diff, Err(NEEDS_TENSORS.to_string()), "{}", c.name);
        }
    }
    // A sampled side against a whole one is no comparison either.
    let mixed = prefill_vs_decode(
        &r.stepped,
        &b,
        r.heads,
        &Tolerances::Table(StorageDtype::F32),
    );
    assert!(mixed
        .iter()
        .all(|c| c.diff == Err(NEEDS_TENSORS.to_string())));
}

/// Two samples of outputs of one size hold the same elements: compared value for value, the
/// largest difference placed at its element of the output, no per-head figures.
#[test]
fn run_comparisons_over_samples_compare_the_same_elements() {
    let r = runs();
    let (a, b) = (sampled(&r.stepped), sampled(&r.naive));
    let list = compare_runs(&a, &b, r.heads, &Tolerances::Table(StorageDtype::F32));
    assert!(!list.is_empty());
    let mut differing = 0;
    for c in &list {
        let e = &a.events[c.index];
        let j = b.find(e.phase, &e.name).unwrap();
        let d = c
            .diff
            .as_ref()
            .unwrap_or_else(|why| panic!("{}: {why}", c.name));
        let (x, y) = (a.outputs[c.index].data(), b.outputs[j].data());
        if e.name.ends_with("topk_weights") && x.len() == e.shape.iter().product::<usize>() {
            // Whole routing weights are compared expert by expert, not slot by slot.
            continue;
        }
        let biggest = x
            .iter()
            .zip(y)
            .map(|(p, q)| (*p as f64 - *q as f64).abs())
            .filter(|v| !v.is_nan())
            .fold(0.0, f64::max);
        assert_eq!(d.max_abs, biggest, "{}", c.name);
        let numel: usize = e.shape.iter().product();
        if numel > 32 {
            assert!(
                d.per_head.is_empty(),
                "{}: per-head figures from a sample",
                c.name
            );
            let flat = d
                .max_abs_at
                .iter()
                .zip(&e.shape)
                .fold(0, |acc, (i, n)| acc * n + i);
            assert!(
                sample_indices(numel).contains(&flat),
                "{}: {:?} is not a sampled element",
                c.name,
                d.max_abs_at
            );
        }
        differing += usize::from(d.max_abs > 0.0);
    }
    assert!(differing > 0, "MLA disable changes some decode outputs");

    // A sampled run against a whole one: no figures, the reason instead.
    for c in compare_runs(&a, &r.naive, r.heads, &Tolerances::Table(StorageDtype::F32)) {
        let numel: usize = a.events[c.index].shape.iter().product();
        if numel > 32 {
            assert_eq!(c.diff, Err(NEEDS_TENSORS.to_string()), "{}", c.name);
        }
    }
}

/// Regression: samples of outputs of different sizes hold different elements; they were
/// compared value for value because both held 32 values.
#[test]
fn samples_of_different_sizes_are_not_compared() {
    let r = runs();
    let a = sampled(&r.stepped);
    let mut b = RunRecord::new(a.flags);
    for (e, o) in a.events.iter().zip(&a.outputs) {
        let mut e = e.clone();
        e.shape[0] *= 2;
        b.push(e, Arc::clone(o));
    }
    for c in compare_runs(&a, &b, r.heads, &Tolerances::Table(StorageDtype::F32)) {
        let numel: usize = a.events[c.index].shape.iter().product();
        if numel > 32 {
            let why = c.diff.expect_err("samples of other elements compared");
            assert!(why.starts_with("shapes differ"), "{why}");
        }
    }
}
