//! `mladb tui --reference DUMP`: the debugger compares every run with another engine's tensors
//! (here transformers' own, tests/fixtures/hf/glm5-sparse/hf-dump.safetensors): a `ref` column
//! in the tree and a section in the Compare pane. A clean run agrees everywhere and says how
//! much it compared; a run with a fault planted shows its first divergent op.

mod common;

use mladb::engine::trace::Phase;
use mladb::setup::{FlagOptions, ModelSpec, RunSpec};
use mladb::tui::app::App;
use mladb::tui::driver::InlineDriver;
use mladb::tui::keys::{Action, Keymap};
use mladb::tui::theme::Theme;
use std::path::PathBuf;

const MODEL: &str = "tests/fixtures/hf/glm5-sparse";

fn app_against_reference(inject: &[&str]) -> App {
    app_against_reference_within(inject, None)
}

fn app_against_reference_within(inject: &[&str], max_memory_gb: Option<f64>) -> App {
    let dump = PathBuf::from(format!("{MODEL}/hf-dump.safetensors"));
    app_against(dump, inject, max_memory_gb)
}

fn app_against(reference: PathBuf, inject: &[&str], max_memory_gb: Option<f64>) -> App {
    let args = mladb::tui::TuiArgs {
        setup: RunSpec {
            max_memory_gb,
            model: ModelSpec {
                layout: None,
                model: Some(PathBuf::from(MODEL)),
                ..ModelSpec::with_layout("glm5-tiny")
            },
            ..RunSpec::with_layout("glm5-tiny")
        },
        flags: FlagOptions {
            inject: inject.iter().map(|s| s.to_string()).collect(),
            ..FlagOptions::default()
        },
        keys: None,
        reference: Some(reference),
        name_map: None,
    };
    let spec = args.spec().unwrap();
    let mut app = App::new(
        Box::new(InlineDriver::new(spec).unwrap()),
        Keymap::default(),
        Theme::plain(),
    );
    app.act(Action::Continue);
    app
}

#[test]
fn a_clean_run_agrees_with_the_reference_in_the_tree_and_the_compare_pane() {
    let mut app = app_against_reference(&[]);
    let reference = app
        .mirror
        .aux(mladb::service::AuxKind::Reference)
        .expect("the reference arrived with the finished run");
    assert!(reference.len() > 500, "{} ops", reference.len());
    let text = common::compare_pane(
        &mut app,
        Phase::Decode(2),
        "model.layers.1.self_attn.o_proj",
    );
    assert!(
        text.contains("vs the reference: another engine's values"),
        "{text}"
    );
    assert!(
        text.contains("the reference: all ") && text.contains(" ops agree within their tolerances"),
        "{text}"
    );
    assert!(text.contains("ref "), "the tree's reference column: {text}");
    assert!(!text.contains("first divergent op"), "{text}");
}

#[test]
fn a_planted_fault_shows_its_first_divergent_op_against_the_reference() {
    let mut app = app_against_reference(&["output-buffer-disconnect"]);
    let text = common::compare_pane(
        &mut app,
        Phase::Decode(0),
        "model.layers.0.self_attn.o_proj",
    );
    assert!(
        text.contains("vs the reference: another engine's values"),
        "{text}"
    );
    let first = text
        .lines()
        .find(|l| l.contains("first divergent op:"))
        .unwrap_or_else(|| panic!("{text}"));
    // The fault hands o_proj a buffer the attention kernel never wrote, from the prefill on.
    assert!(first.contains("prefill self_attn.o_proj"), "{first}");
    assert!(!text.contains("ops agree within"), "{text}");
}

/// A schedule change is held to `--max-memory-gb` beside the reference dump's values (261 kB
/// here), as the start was: under 3.25 MB, `:set decode 100` (a 3.17 MB run alone) is refused.
#[test]
fn a_schedule_change_counts_the_reference_dump_against_max_memory_gb() {
    let answer = |limit: Option<f64>| {
        let mut app = app_against_reference_within(&[], limit);
        common::command(&mut app, "set decode 100");
        app.log.join("\n")
    };
    let held = answer(Some(0.00325));
    assert!(
        held.contains("refusing to allocate")
            && held.contains("the reference dump's values already held 261.46 kB"),
        "{held}"
    );
    let free = answer(None);
    assert!(!free.contains("refusing to allocate"), "{free}");
}

/// A dump whose two names for layer 0's o_proj (HF's `self_attn` and `self_attn.o_proj`)
/// disagree: the tree and the Compare pane show the one farther from the run, whichever it is.
#[test]
fn the_reference_side_is_the_dumps_farthest_name_for_an_op() {
    let dir = tempfile::tempdir().unwrap();
    let wrong = dir.path().join("wrong.safetensors");
    let dump = PathBuf::from(format!("{MODEL}/hf-dump.safetensors"));
    for key in [
        "prefill/model.layers.0.self_attn",
        "prefill/model.layers.0.self_attn.o_proj",
    ] {
        common::scaled_copy(&dump, &wrong, key, 1.5);
        let mut app = app_against(wrong.clone(), &[], None);
        let text =
            common::compare_pane(&mut app, Phase::Prefill, "model.layers.0.self_attn.o_proj");
        let first = text
            .lines()
            .find(|l| l.contains("first divergent op:"))
            .unwrap_or_else(|| panic!("{key}: {text}"));
        assert!(first.contains("prefill self_attn.o_proj"), "{key}: {first}");
    }
}
