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
