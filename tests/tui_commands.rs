//! The debugger's commands for the schedule, faults, breakpoints and jumps, and what it says
//! about flags that had nothing to act on; driven inline like tests/tui.rs.

mod common;

use clap::Parser;
use mladb::backend::cpu::CpuBackend;
use mladb::debug::runner::Job;
use mladb::debug::Flags;
use mladb::engine::faults::Scope;
use mladb::engine::generate::Schedule;
use mladb::engine::trace::Phase;
use mladb::tui::app::{App, Overlay};
use mladb::tui::ui;
use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use ratatui::Terminal;

fn press(app: &mut App, keys: &str) {
    for c in keys.chars() {
        app.on_key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE));
    }
}

fn key(app: &mut App, code: KeyCode) {
    app.on_key(KeyEvent::new(code, KeyModifiers::NONE));
}

fn command(app: &mut App, line: &str) {
    press(app, ":");
    press(app, line);
    key(app, KeyCode::Enter);
}

fn screen(app: &mut App, w: u16, h: u16) -> String {
    let mut terminal = Terminal::new(TestBackend::new(w, h)).unwrap();
    terminal.draw(|f| ui::draw(f, app)).unwrap();
    terminal.backend().to_string()
}

fn position(app: &App) -> (Phase, String) {
    let e = app.mirror.position().unwrap();
    (e.phase, e.name.clone())
}

fn logged(app: &App, needle: &str) -> bool {
    app.log.iter().any(|l| l.contains(needle))
}

/// The current run equals a fresh run of `schedule`, op by op and bit for bit.
fn assert_fresh(app: &App, schedule: &Schedule) {
    let model = common::synthetic("glm5-tiny", 0);
    let layers = 0..model.layout.num_layers;
    let job = Job {
        model: &model,
        backend: &CpuBackend,
        schedule,
        layers: &layers,
        poison: true,
    };
    let fresh = job.run(app.mirror.flags, None).unwrap();
    let run = app.mirror.current().unwrap();
    assert_eq!(run.len(), fresh.len());
    for (i, (a, b)) in run.outputs.iter().zip(&fresh.outputs).enumerate() {
        let same = a
            .data()
            .iter()
            .zip(b.data())
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same,
            "op {i} {} differs from a fresh run",
            run.events[i].name
        );
    }
}

#[test]
fn set_decode_tokens_and_prefill_recompute_the_run() {
    let mut app = common::tiny_app("");
    press(&mut app, "c");
    let ops = app.mirror.current().unwrap().len();
    let mut schedule = app.mirror.info.as_ref().unwrap().schedule.clone();

    // Two more decode steps: every op so far is kept, the new ones computed.
    command(&mut app, "set decode 4");
    schedule.decode_steps = 4;
    assert_eq!(app.mirror.info.as_ref().unwrap().schedule, schedule);
    assert!(
        logged(
            &app,
            &format!("decode 4: no op so far is affected; {ops} ops reused")
        ),
        "{:?}",
        app.log
    );
    let run = app.mirror.current().unwrap();
    assert!(run.finished() && run.outcome.as_ref().unwrap().generated.len() == 4);
    assert_eq!(app.mirror.comparison, Some(0));
    assert_fresh(&app, &schedule);

    // Another token fed through decode: from that decode step on.
    let mut prompt = schedule.prompt.clone();
    prompt[10] = 5;
    let text: Vec<String> = prompt.iter().map(u32::to_string).collect();
    command(&mut app, &format!("set tokens {}", text.join(",")));
    schedule.prompt = prompt;
    assert!(
        logged(&app, "(decode.1 model.embed_tokens): "),
        "{:?}",
        app.log
    );
    assert_fresh(&app, &schedule);

    // Another prefill: from the start.
    command(&mut app, "set prefill 4");
    schedule.prefill_len = 4;
    assert!(
        logged(&app, "prefill 4: re-executed from the start"),
        "{:?}",
        app.log
    );
    assert_fresh(&app, &schedule);

    // A shorter prompt than the prefill takes the prefill down with it, and says so.
    command(&mut app, "set tokens 3,141,59");
    assert!(logged(&app, "prefill 4 → 3"), "{:?}", app.log);
    schedule = Schedule {
        prompt: vec![3, 141, 59],
        prefill_len: 3,
        decode_steps: 4,
    };
    assert_fresh(&app, &schedule);
    // `--decode 0` works here too.
    command(&mut app, "set decode 0");
    schedule.decode_steps = 0;
    assert_fresh(&app, &schedule);

    for (bad, needle) in [
        (
            "set prefill 9",
            "--prefill 9 is longer than the 3-token prompt",
        ),
        ("set decode many", "'many' is not a whole number"),
        ("set tokens 3,99999", "token id 99999"),
    ] {
        command(&mut app, bad);
        let last = app.log.last().unwrap();
        assert!(
            last.starts_with("error: ") && last.contains(needle),
            "{bad}: {last}"
        );
    }

    // The session keeps each run's schedule: verify recomputes every run as it ran.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("schedules.ron");
    command(&mut app, &format!("save {}", path.display()));
    let session = mladb::session::Session::load(&path).unwrap();
    assert_eq!(session.decode, 0);
    assert!(session.runs[0].schedule.is_some());
    let mut out = Vec::new();
    let mismatch =
        mladb::cli::replay::verify(&session, mladb::cli::args::DeviceArg::Cpu, &mut out).unwrap();
    assert!(mismatch.is_none(), "{}", String::from_utf8_lossy(&out));
}

#[test]
fn the_fault_menu_offers_the_scope() {
    let mut app = common::tiny_app("");
    press(&mut app, "i");
    assert_eq!(
        app.overlay,
        Overlay::Inject {
            selected: 0,
            scope: Scope::All
        }
    );
    key(&mut app, KeyCode::Right);
    key(&mut app, KeyCode::Enter);
    assert_eq!(
        app.mirror.flags.faults.to_string(),
        "output-buffer-disconnect@prefill"
    );
    // kv-cache-off-by-one offers decode, its default; one step on is both phases.
    press(&mut app, "jjjjjj");
    assert!(matches!(
        app.overlay,
        Overlay::Inject {
            selected: 6,
            scope: Scope::Decode
        }
    ));
    key(&mut app, KeyCode::Right);
    key(&mut app, KeyCode::Enter);
    assert_eq!(
        app.mirror.flags.faults.to_string(),
        "output-buffer-disconnect@prefill,kv-cache-off-by-one@both"
    );
    let menu = screen(&mut app, 130, 30);
    assert!(
        menu.contains("‹both›") && menu.contains(" prefill "),
        "{menu}"
    );
    // Enter on a fault in the scope it acts in removes it.
    key(&mut app, KeyCode::Enter);
    assert_eq!(
        app.mirror.flags.faults.to_string(),
        "output-buffer-disconnect@prefill"
    );
}

#[test]
fn set_inject_replaces_the_fault_and_says_so() {
    let mut app = common::tiny_app("");
    command(&mut app, "set inject softmax-scale-latent");
    command(&mut app, "set inject absorb-wrong-split@decode");
    assert_eq!(
        app.mirror.flags.faults.to_string(),
        "absorb-wrong-split@decode"
    );
    assert!(logged(
        &app,
        "inject absorb-wrong-split@decode replaces softmax-scale-latent"
    ));
    command(&mut app, "set inject +softmax-scale-latent");
    assert_eq!(
        app.mirror.flags.faults.to_string(),
        "softmax-scale-latent,absorb-wrong-split@decode"
    );
    command(&mut app, "set inject none");
    assert!(app.mirror.flags.faults.is_empty());
}

#[test]
fn breakpoints_list_delete_and_phase_patterns() {
    let mut app = common::tiny_app("");
    command(&mut app, "breakpoints");
    assert!(app.log.last().unwrap().contains("no breakpoints"));
    command(&mut app, "break op decode.0/*layers.1.self_attn.attn_probs");
    command(&mut app, "break layer 3");
    command(&mut app, "breakpoints");
    assert!(logged(
        &app,
        "breakpoint 1: op decode.0/*layers.1.self_attn.attn_probs"
    ));
    assert!(app.log.last().unwrap().contains("breakpoint 2: layer 3"));
    command(&mut app, "delete layer 3");
    // The phase in the pattern: not prefill's attention probabilities, decode.0's.
    press(&mut app, "c");
    assert_eq!(
        position(&app),
        (
            Phase::Decode(0),
            "model.layers.1.self_attn.attn_probs".to_string()
        )
    );
    let tree = screen(&mut app, 120, 34);
    assert!(
        tree.contains("▶●· self_attn.attn_probs"),
        "marked in the tree: {tree}"
    );
    press(&mut app, "c");
    assert!(
        app.mirror.current().unwrap().finished(),
        "decode.1 does not match"
    );
    command(&mut app, "break nan");
    command(&mut app, "break zero");
    command(&mut app, "delete");
    assert!(app.mirror.breakpoints.is_empty());
    assert!(logged(&app, "3 breakpoint(s) deleted"));
    command(&mut app, "break nan");
    command(&mut app, "delete all");
    assert!(app.mirror.breakpoints.is_empty());
}

#[test]
fn a_condition_breakpoint_stops_where_the_condition_starts() {
    // The latent row written one slot early leaves its own slot unwritten (poison NaN): the
    // absorbed attention reads it, and every later op of the step inherits the NaN through the
    // residual stream; the next step starts from a clean token and reads a new unwritten slot.
    let mut app = common::tiny_app("inject=kv-cache-off-by-one");
    command(&mut app, "break nan");
    press(&mut app, "c");
    let first = position(&app);
    assert_eq!(
        first,
        (
            Phase::Decode(0),
            "model.layers.0.self_attn.attn_probs".to_string()
        )
    );
    press(&mut app, "c");
    assert_eq!(
        position(&app),
        (
            Phase::Decode(1),
            "model.layers.0.self_attn.attn_probs".to_string()
        ),
        "the next step's fresh unwritten slot, not the ops that inherited the first NaN"
    );
    // diff>X against the comparison run: the first op that differs, not every op after it.
    let mut app = common::tiny_app("");
    press(&mut app, "c");
    command(&mut app, "set inject softmax-scale-latent");
    command(&mut app, "break diff>1e-3");
    command(&mut app, "restart");
    press(&mut app, "c");
    let at = position(&app);
    assert!(at.1.ends_with("self_attn.attn_probs"), "{at:?}");
    let stopped_at = app.mirror.position().unwrap().index;
    press(&mut app, "c");
    let next = app.mirror.position().unwrap().index;
    assert!(
        next > stopped_at + 1,
        "not the very next op: {stopped_at} then {next}"
    );
}

#[test]
fn goto_an_op_or_the_first_divergent_one() {
    let mut app = common::tiny_app("");
    command(&mut app, "goto 40");
    assert_eq!(
        app.mirror.position().unwrap().index,
        40,
        "ran forward to it"
    );
    command(&mut app, "goto 5");
    assert_eq!(app.selected_op().unwrap().0, 5);
    assert_eq!(
        app.mirror.position().unwrap().index,
        40,
        "going back only selects"
    );
    command(&mut app, "goto first-divergent");
    assert!(app
        .log
        .last()
        .unwrap()
        .contains("error: goto first-divergent needs"));
    press(&mut app, "c");
    command(&mut app, "goto 999999");
    assert!(app.log.last().unwrap().starts_with("error: goto 999999"));
    command(&mut app, "set inject softmax-scale-latent");
    command(&mut app, "goto first-divergent");
    let (i, e) = app.selected_op().unwrap();
    assert!(logged(
        &app,
        &format!("goto: first divergent op #{i} {} {}", e.phase, e.name)
    ));
    assert_eq!(
        (e.phase, e.name.as_str()),
        (Phase::Decode(0), "model.layers.0.self_attn.attn_probs")
    );
    command(&mut app, "goto x");
    assert!(app.log.last().unwrap().contains("usage: goto"));
}

#[test]
fn flags_with_nothing_to_act_on_are_logged_and_marked_in_the_header() {
    let mut app = common::tiny_app("mla-disable, inject=softmax-scale-latent");
    assert!(logged(
        &app,
        "note: inject softmax-scale-latent had nothing to act on: MLA disable makes every path naive"
    ));
    let top = screen(&mut app, 120, 24)
        .lines()
        .next()
        .unwrap()
        .to_string();
    assert!(top.contains("inject softmax-scale-latent (idle)"), "{top}");
    press(&mut app, "m");
    let top = screen(&mut app, 120, 24)
        .lines()
        .next()
        .unwrap()
        .to_string();
    assert!(!top.contains("(idle)"), "{top}");

    // Decided once the run has finished: no context spans two split-KV blocks here.
    let mut app = common::tiny_app("inject=lse-base-mismatch");
    command(&mut app, "set tokens 3,141,59");
    press(&mut app, "c");
    assert!(logged(
        &app,
        "inject lse-base-mismatch had nothing to act on: no context on the absorbed path"
    ));
    let top = screen(&mut app, 120, 24)
        .lines()
        .next()
        .unwrap()
        .to_string();
    assert!(top.contains("lse-base-mismatch (idle)"), "{top}");

    // VLLM_MLA_DISABLE in the header, when it is what turned MLA disable on.
    let mut app = common::tiny_app("mla-disable");
    app.mla_disable_env = true;
    let top = screen(&mut app, 80, 24).lines().next().unwrap().to_string();
    assert!(
        top.contains("VLLM_MLA_DISABLE=1") && top.contains("inject none"),
        "{top}"
    );
}

#[test]
fn mladb_tui_toggles_mla_on_decode_ops_by_default() {
    let cli = mladb::cli::Cli::try_parse_from(["mladb", "tui"]).unwrap();
    let Some(mladb::cli::Command::Tui(args)) = cli.command else {
        panic!("tui")
    };
    let spec = args.spec().unwrap();
    let driver = mladb::tui::driver::InlineDriver::new(spec).unwrap();
    let mut app = App::new(
        Box::new(driver),
        mladb::tui::keys::Keymap::default(),
        mladb::tui::theme::Theme::plain(),
    );
    press(&mut app, "c");
    press(&mut app, "m");
    assert!(
        logged(&app, "mla-disable on: re-executed from op #"),
        "{:?}",
        app.log
    );
    assert!(!logged(&app, "no op so far is affected"));
    assert!(app.mirror.flags.mla_disable && app.mirror.flags != Flags::default());
}

/// Two runs that chose differently (here the DSA top-k of the run before a flag change, one key
/// of one row swapped for another) say so in the Compare pane, even where every numeric op
/// agrees. The pane used to say "all ops agree": choices are left out of the numeric
/// comparison, so a choice made otherwise was passed over.
#[test]
fn the_compare_pane_names_a_choice_the_two_runs_made_otherwise() {
    use mladb::engine::trace::OpKind;
    let mut app = common::tiny_app("");
    press(&mut app, "c");
    command(&mut app, "set mla-disable on");
    press(&mut app, "c");
    assert_eq!(app.mirror.comparison, Some(0), "{:?}", app.log);
    let agree = common::compare_pane(&mut app, Phase::Decode(1), "model.norm");
    assert!(
        agree.contains("all ") && agree.contains(" ops agree"),
        "{agree}"
    );
    assert!(!agree.contains("choices differ"), "{agree}");

    // Decode step 1 (position 10) chose keys 0..=10 but 8 of them (index_topk): one kept key
    // becomes one it left out.
    let before = &mut app.mirror.runs[0];
    let i = before
        .events
        .iter()
        .position(|e| e.kind == OpKind::IndexTopK && e.phase == Phase::Decode(1))
        .expect("a DSA top-k in decode step 1");
    let mut listing = before.outputs[i].data().to_vec();
    let kept: Vec<usize> = listing.iter().map(|&v| v as usize).collect();
    let left_out = (0..=10)
        .find(|k| !kept.contains(k))
        .expect("a key left out");
    listing[0] = left_out as f32;
    let shape = before.outputs[i].shape().to_vec();
    before.outputs[i] = std::sync::Arc::new(mladb::tensor::Tensor::from_vec(&shape, listing));
    app.divergence_cache.clear();
    let text = common::compare_pane(&mut app, Phase::Decode(1), "model.norm");
    let name = &app.mirror.current().unwrap().events[i].name;
    assert!(name.ends_with(".self_attn.indexer.topk"), "{name}");
    assert!(
        text.contains(&format!(
            "choices differ at #{i} {} self_attn.indexer.topk (1 row(s)): later ops may differ \
             through that choice alone",
            Phase::Decode(1)
        )),
        "{text}"
    );
}
