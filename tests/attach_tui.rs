//! `mladb attach --tui`'s view, without a terminal: the live comparison fed a recorded run of
//! glm5-tiny as an engine would send it (mladb's own op names), its updates shown by the
//! debugger's app. Each step arrives as mladb runs its reference; the engine's values sit beside
//! mladb's in the tree's ref column and the Compare pane; a planted divergence is the first
//! divergent op there and a finding in the log; a clean feed agrees everywhere.

mod common;

use mladb::attach::live::{Comparator, Input};
use mladb::attach::wire::Dtype;
use mladb::backend::cpu::CpuBackend;
use mladb::cli::attach_tui::Feed;
use mladb::debug::name_map::NameMap;
use mladb::debug::{Flags, RunRecord};
use mladb::engine::generate::Schedule;
use mladb::engine::trace::Phase;
use mladb::engine::ForcedSelections;
use mladb::service::{Send, Update};
use mladb::tui::app::App;
use mladb::tui::driver::FeedDriver;
use mladb::tui::keys::Keymap;
use mladb::tui::theme::Theme;
use std::sync::{Arc, Mutex};

const PLANTED: &str = "model.layers.1.self_attn.q_b_proj";

fn recorded(model: &mladb::model::Model) -> RunRecord {
    let schedule = Schedule {
        prompt: vec![3, 14, 15, 92, 65],
        prefill_len: 5,
        decode_steps: 2,
    };
    let layers = 0..model.layout.num_layers;
    let job = mladb::debug::runner::Job {
        model,
        backend: &CpuBackend,
        schedule: &schedule,
        layers: &layers,
        poison: true,
    };
    job.run(Flags::parse("").unwrap(), None).unwrap()
}

/// The app after the comparison took the recorded run as an engine's frames; `plant` scales
/// one op's values in decode step 0.
fn attached_app(plant: bool) -> App {
    let model = common::synthetic("glm5-tiny", 0);
    let run = recorded(&model);
    let tokens = run.outcome.as_ref().unwrap().tokens.clone();
    let p = mladb::setup::RunSpec::with_layout("glm5-tiny")
        .prepare(&Flags::parse("").unwrap())
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<Update>();
    let tx = Mutex::new(tx);
    let send: Send = Arc::new(move |u| {
        let _ = tx.lock().unwrap().send(u);
    });
    let mut feed = Feed::new(send, &p);
    let mut comparator = Comparator::new(
        &p.model,
        p.backend.as_ref(),
        Flags::parse("").unwrap(),
        0..p.model.layout.num_layers,
        Some(NameMap::identity()),
        None,
    );
    comparator.keep_engine = true;
    let mut take = |input: Input, comparator: &mut Comparator, ended: bool| {
        let lives = comparator.take(input);
        feed.sync(comparator, &lives, ended);
    };
    take(
        Input::Hello {
            conn: 0,
            engine: "test".into(),
            rank: 0,
            world_size: 1,
        },
        &mut comparator,
        false,
    );
    for (step, phase) in run.phases().iter().enumerate() {
        let (toks, start) = match phase {
            Phase::Prefill => (tokens[..5].to_vec(), 0),
            Phase::Decode(k) => (vec![tokens[5 + k]], 5 + k),
        };
        let positions = (start as u32..(start + toks.len()) as u32).collect();
        let step_input = Input::Step {
            conn: 0,
            step: step as u64,
            tokens: toks,
            positions,
        };
        take(step_input, &mut comparator, true);
        for (i, e) in run
            .events
            .iter()
            .enumerate()
            .filter(|(_, e)| e.phase == *phase)
        {
            let mut data = run.outputs[i].data().to_vec();
            if plant && *phase == Phase::Decode(0) && e.name == PLANTED {
                data.iter_mut().for_each(|x| *x *= 1.05);
            }
            let tensor = Input::Tensor {
                conn: 0,
                module: e.name.clone(),
                dtype: Dtype::F32,
                data,
                ptr: Some(0x1000 + i as u64),
                kernel_out_ptr: None,
                budget: None,
            };
            take(tensor, &mut comparator, false);
        }
    }
    // A long attachment keeps the outputs of the steps in flight only: the steps the engine
    // has gone past are let go of, the last one is kept.
    let (record, _) = comparator.runs().unwrap();
    for (e, o) in record.events.iter().zip(&record.outputs) {
        let last = e.phase == Phase::Decode(1);
        assert_eq!(o.numel() > 0, last, "{} {}", e.phase, e.name);
    }
    take(Input::Closed { conn: 0 }, &mut comparator, true);
    let mut app = App::new(
        Box::new(FeedDriver::new(rx, "the engine drives this run")),
        Keymap::default(),
        Theme::plain(),
    );
    app.tick();
    app
}

#[test]
fn an_attached_engine_that_agrees_shows_agreement_beside_every_op() {
    let mut app = attached_app(false);
    let run = app.mirror.current().unwrap();
    assert!(run.len() > 300, "{} ops arrived", run.len());
    let text = common::compare_pane(
        &mut app,
        Phase::Decode(1),
        "model.layers.2.self_attn.o_proj",
    );
    assert!(
        text.contains("vs the reference: another engine's values"),
        "{text}"
    );
    assert!(
        text.contains(" ops agree within their tolerances"),
        "{text}"
    );
    assert!(text.contains("ref "), "{text}");
    let log = app.log.join("\n");
    assert!(!log.contains("finding at"), "{log}");
}

#[test]
fn a_divergence_in_the_engine_is_the_first_divergent_op_and_a_finding() {
    let mut app = attached_app(true);
    let text = common::compare_pane(&mut app, Phase::Decode(0), PLANTED);
    let first = text
        .lines()
        .find(|l| l.contains("first divergent op:"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(first.contains("decode.0 self_attn.q_b_proj"), "{first}");
    let log = app.log.join("\n");
    assert!(
        log.contains("finding at step 1, rank 0: reference-mismatch decode.0 model.layers.1.self_attn.q_b_proj"),
        "{log}"
    );
}

#[test]
fn attach_tui_without_a_model_is_one_clear_error() {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(["attach", "--tui", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    common::assert_clean_error(&o, "give --layout or --model");
}

/// The DSA row of `run` whose best passed-over key scores nearest its last kept key (relative
/// to the row's RMS): (phase, top-k op, row, the keys kept with that key in place of the last,
/// that gap over the RMS).
fn nearest_key_tie(run: &RunRecord) -> (Phase, String, usize, Vec<usize>, f32) {
    let mut best: Option<(Phase, String, usize, Vec<usize>, f32)> = None;
    for (i, ev) in run.events.iter().enumerate() {
        if !ev.name.ends_with("indexer.topk") {
            continue;
        }
        let kept = run.outputs[i].data();
        let scores = run
            .output(ev.phase, &ev.name.replace(".topk", ".scores"))
            .unwrap()
            .data();
        let rows = ev.shape[0];
        let (k, ctx) = (kept.len() / rows, scores.len() / rows);
        for r in 0..rows {
            let row = &scores[r * ctx..(r + 1) * ctx];
            let keys: Vec<usize> = kept[r * k..(r + 1) * k]
                .iter()
                .filter(|&&j| j >= 0.0)
                .map(|&j| j as usize)
                .collect();
            let by = |a: &&usize, b: &&usize| row[**a].total_cmp(&row[**b]);
            let last = keys.iter().min_by(by).copied().unwrap();
            let passed: Vec<usize> = (0..ctx)
                .filter(|j| row[*j].is_finite() && !keys.contains(j))
                .collect();
            let Some(&over) = passed.iter().max_by(by) else {
                continue;
            };
            let finite: Vec<f32> = row.iter().copied().filter(|x| x.is_finite()).collect();
            let rms = (finite.iter().map(|x| x * x).sum::<f32>() / finite.len() as f32).sqrt();
            let gap = (row[last] - row[over]) / rms;
            if best.as_ref().is_none_or(|b| gap < b.4) {
                let chosen = keys
                    .iter()
                    .map(|&j| if j == last { over } else { j })
                    .collect();
                best = Some((ev.phase, ev.name.clone(), r, chosen, gap));
            }
        }
    }
    best.expect("a row with keys passed over")
}

/// An engine that kept other keys than mladb within noise, and attended over its own: the
/// comparison re-runs mladb's reference with the engine's keys, and the debugger's run shows
/// the re-run's values from the choice on (the op recomputed in place), agreeing with the
/// engine's, with no finding.
#[test]
fn a_followed_flip_recomputes_the_ops_the_debugger_shows() {
    let model = common::synthetic("glm5-tiny", 0);
    let p = mladb::setup::RunSpec::with_layout("glm5-tiny")
        .prepare(&Flags::parse("").unwrap())
        .unwrap();
    let schedule = Schedule {
        prompt: (0..24).map(|i| (i * 37 + 5) % 200).collect(),
        prefill_len: 24,
        decode_steps: 1,
    };
    let job = |forced: ForcedSelections| {
        let layers = 0..model.layout.num_layers;
        let job = mladb::debug::runner::Job {
            model: &model,
            backend: &CpuBackend,
            schedule: &schedule,
            layers: &layers,
            poison: true,
        };
        job.run_forced(
            Flags::parse("").unwrap(),
            &schedule,
            &Arc::new(forced),
            None,
        )
        .unwrap()
    };
    let (phase, topk, row, chosen, gap) = nearest_key_tie(&job(ForcedSelections::default()));
    assert!(gap < 0.3, "the nearest key is too far to call a tie: {gap}");
    let mut forced = ForcedSelections::default();
    forced.force(phase, &topk, row, chosen.clone());
    let engine = job(forced);
    let tokens = engine.outcome.as_ref().unwrap().tokens.clone();

    let (tx, rx) = std::sync::mpsc::channel::<Update>();
    let tx = Mutex::new(tx);
    let send: Send = Arc::new(move |u| {
        let _ = tx.lock().unwrap().send(u);
    });
    let mut feed = Feed::new(send, &p);
    let tolerance = (gap / 3.0 * 1.5) as f64;
    let mut comparator = Comparator::new(
        &p.model,
        p.backend.as_ref(),
        Flags::parse("").unwrap(),
        0..p.model.layout.num_layers,
        Some(NameMap::identity()),
        Some(tolerance),
    );
    let mut take = |input: Input, comparator: &mut Comparator| {
        let lives = comparator.take(input);
        feed.sync(comparator, &lives, true);
    };
    let hello = Input::Hello {
        conn: 0,
        engine: "test".into(),
        rank: 0,
        world_size: 1,
    };
    take(hello, &mut comparator);
    for (step, ph) in engine.phases().iter().enumerate() {
        let (toks, start) = match ph {
            Phase::Prefill => (tokens[..24].to_vec(), 0),
            Phase::Decode(k) => (vec![tokens[24 + k]], 24 + k),
        };
        let positions = (start as u32..(start + toks.len()) as u32).collect();
        let step = step as u64;
        take(
            Input::Step {
                conn: 0,
                step,
                tokens: toks,
                positions,
            },
            &mut comparator,
        );
        for (i, e) in engine
            .events
            .iter()
            .enumerate()
            .filter(|(_, e)| e.phase == *ph)
        {
            let tensor = Input::Tensor {
                conn: 0,
                module: e.name.clone(),
                dtype: Dtype::F32,
                data: engine.outputs[i].data().to_vec(),
                ptr: Some(0x1000 + i as u64),
                kernel_out_ptr: None,
                budget: None,
            };
            take(tensor, &mut comparator);
        }
    }
    let mut app = App::new(
        Box::new(FeedDriver::new(rx, "the engine drives this run")),
        Keymap::default(),
        Theme::plain(),
    );
    app.tick();
    let log = app.log.join("\n");
    assert!(
        log.contains(&format!("selection-flip at {topk}")) && log.contains("re-ran its reference"),
        "{log}"
    );
    assert!(!log.contains("finding at"), "{log}");
    // The debugger's run holds the engine's keys at the choice, and the attention after it as
    // the engine computed it.
    let shown = app.mirror.current().unwrap();
    let listing = shown.output(phase, &topk).unwrap();
    let k = listing.numel() / listing.shape()[0];
    let mut kept: Vec<usize> = listing.data()[row * k..(row + 1) * k]
        .iter()
        .filter(|&&j| j >= 0.0)
        .map(|&j| j as usize)
        .collect();
    let mut want = chosen;
    kept.sort_unstable();
    want.sort_unstable();
    assert_eq!(kept, want);
    let layer = topk.trim_end_matches(".self_attn.indexer.topk");
    let out = format!("{layer}.self_attn.attn_output");
    let d = mladb::stats::rel_l2(
        shown.output(phase, &out).unwrap().data(),
        engine.output(phase, &out).unwrap().data(),
    );
    assert!(d < 1e-6, "{out}: {d}");
}
