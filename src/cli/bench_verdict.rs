//! `mladb bench --attach-verdict`: what the live comparison of `mladb attach` costs once a tensor
//! has arrived. An engine's run is stood in for by mladb's own run of the schedule (so every
//! verdict passes, as on a clean engine); its steps and tensors go to a fresh comparison as
//! `attach` hands them over, and the bench times mladb's reference step (run when a step frame
//! arrives, while the engine computes the same step) and each tensor's verdict (name map, shards,
//! comparison, judging). The ingest bench (`--attach-ingest`) measures the socket before it.

use std::time::Instant;

use super::args::{default_prompt, parse_layers};
use super::bench::BenchArgs;
use super::Out;
use crate::attach::live::{Comparator, Input, Live};
use crate::attach::wire::Dtype;
use crate::backend::cpu::CpuBackend;
use crate::debug::flags::Flags;
use crate::debug::name_map::NameMap;
use crate::debug::runner::Job;
use crate::engine::generate::Schedule;
use crate::error::{Error, Result};

pub fn run(args: &BenchArgs) -> Result<()> {
    let model = args.model.load()?;
    let layers = parse_layers(&args.layers, model.layout.num_layers)?;
    let prompt = args.prompt.max(1);
    let schedule = Schedule {
        prompt: default_prompt(model.layout.vocab_size, prompt),
        prefill_len: prompt,
        decode_steps: args.decode,
    };
    let flags = Flags::default();
    let job = Job {
        model: &model,
        backend: &CpuBackend,
        schedule: &schedule,
        layers: &layers,
        poison: true,
    };
    let engine_run = job.run(flags, None)?;
    let tokens = engine_run
        .outcome
        .as_ref()
        .map(|o| o.tokens.clone())
        .ok_or_else(|| Error::invalid("bench: the run did not finish"))?;
    writeln!(
        Out,
        "mladb attach, the comparison after arrival: {} layers {}..{}, prompt {prompt} tokens, {} decode steps, CPU reference, f32 tensors",
        model.layout.name, layers.start, layers.end, args.decode
    )?;
    writeln!(
        Out,
        "{:>10} {:>8} {:>14} {:>9} {:>14} {:>12} {:>12} {:>14}  slowest",
        "step", "tensors", "reference ms", "MB", "verdicts ms", "median µs", "max µs", "largest MB"
    )?;
    let mut comparator = Comparator::new(
        &model,
        &CpuBackend,
        flags,
        layers.clone(),
        Some(NameMap::identity()),
        None,
    );
    comparator.take(Input::Hello {
        conn: 0,
        engine: "bench".into(),
        rank: 0,
        world_size: 1,
    });
    let mut findings = 0;
    for (step, phase) in engine_run.phases().into_iter().enumerate() {
        let (toks, start) = match phase {
            crate::engine::trace::Phase::Prefill => (tokens[..prompt].to_vec(), 0),
            crate::engine::trace::Phase::Decode(k) => (vec![tokens[prompt + k]], prompt + k),
        };
        let positions = (start as u32..(start + toks.len()) as u32).collect();
        let began = Instant::now();
        comparator.take(Input::Step {
            conn: 0,
            step: step as u64,
            tokens: toks,
            positions,
        });
        let reference = began.elapsed().as_secs_f64();
        let mut times = Vec::new();
        let mut slowest = (0f64, String::new());
        let (mut bytes, mut largest) = (0usize, 0usize);
        for (i, e) in engine_run.events.iter().enumerate() {
            if e.phase != phase {
                continue;
            }
            let data = engine_run.outputs[i].data().to_vec();
            bytes += data.len() * 4;
            largest = largest.max(data.len() * 4);
            let began = Instant::now();
            let out = comparator.take(Input::Tensor {
                conn: 0,
                module: e.name.clone(),
                dtype: Dtype::F32,
                data,
                ptr: None,
                kernel_out_ptr: None,
                budget: None,
            });
            let us = began.elapsed().as_secs_f64() * 1e6;
            if us > slowest.0 {
                slowest = (us, e.name.clone());
            }
            times.push(us);
            findings += out
                .iter()
                .filter(|l| matches!(l, Live::Finding { .. }))
                .count();
        }
        let total: f64 = times.iter().sum();
        times.sort_by(f64::total_cmp);
        writeln!(
            Out,
            "{:>10} {:>8} {:>14.2} {:>9.2} {:>14.2} {:>12.1} {:>12.1} {:>14.2}  {}",
            phase.to_string(),
            times.len(),
            reference * 1e3,
            bytes as f64 / 1e6,
            total / 1e3,
            times.get(times.len() / 2).copied().unwrap_or(0.0),
            times.last().copied().unwrap_or(0.0),
            largest as f64 / 1e6,
            slowest.1
        )?;
    }
    let t = &comparator.totals;
    writeln!(
        Out,
        "{} compared, {} beyond tolerance, {findings} finding(s) (a clean stand-in engine: there should be none)",
        t.compared, t.divergent
    )?;
    if let Some(peak) = super::bench::peak_rss_bytes() {
        writeln!(Out, "peak resident memory {:.1} MB", peak as f64 / 1e6)?;
    }
    Ok(())
}
