//! What every command runs when not told otherwise (one schedule, with decode steps that cross
//! the DSA top-k), `VLLM_MLA_DISABLE`, and the report of flags that had nothing to act on, as
//! the real binary prints them.

mod common;

use clap::Parser;
use common::{stderr, stdout};
use mladb::cli::{Cli, Command as Sub};
use mladb::debug::Flags;
use mladb::engine::generate::Schedule;
use std::process::{Command, Output};

fn mladb_env(args: &[&str], mla_disable: Option<&str>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mladb"));
    c.args(args).env_remove("VLLM_MLA_DISABLE");
    if let Some(v) = mla_disable {
        c.env("VLLM_MLA_DISABLE", v);
    }
    c.output().expect("the mladb binary runs")
}

fn mladb(args: &[&str]) -> Output {
    mladb_env(args, None)
}

fn json_lines(o: &Output) -> Vec<serde_json::Value> {
    stdout(o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// The schedule a command line runs: prompt, prefill, decode steps.
fn schedule_of(args: &[&str]) -> (Vec<u32>, usize, usize) {
    let cli = Cli::try_parse_from(args).unwrap();
    let setup = match cli.command.unwrap() {
        Sub::Run(a) => a.setup,
        Sub::Check(a) => a.setup,
        Sub::Bisect(a) => a.setup,
        Sub::Tui(a) => a.setup,
        other => panic!("{other:?}"),
    };
    parts(setup.prepare(&Flags::default()).unwrap().schedule)
}

fn parts(s: Schedule) -> (Vec<u32>, usize, usize) {
    (s.prompt, s.prefill_len, s.decode_steps)
}

#[test]
fn every_command_runs_one_default_schedule_with_decode_steps() {
    let bare_tui = parts(
        mladb::tui::TuiArgs::default_demo()
            .setup
            .prepare(&Flags::default())
            .unwrap()
            .schedule,
    );
    let bare_run = parts(
        mladb::cli::run::RunArgs::default_demo()
            .setup
            .prepare(&Flags::default())
            .unwrap()
            .schedule,
    );
    assert_eq!(bare_tui, bare_run);
    for args in [
        &["mladb", "run"][..],
        &["mladb", "check"],
        &["mladb", "tui"],
        &["mladb", "bisect", "--a", "", "--b", ""],
    ] {
        assert_eq!(schedule_of(args), bare_run, "{args:?}");
    }
    // glm5-tiny's DSA top-k is 8: decode starts below it and ends above it.
    let (prompt, prefill, decode) = bare_run;
    assert!(decode > 0);
    assert!(prefill < 8);
    assert!(prompt.len() + decode > 8);
    // What is given is run as given, `--decode 0` included.
    let s = schedule_of(&["mladb", "run", "--tokens", "3,141,59", "--decode", "0"]);
    assert_eq!(s, (vec![3, 141, 59], 3, 0));
    let (prompt, prefill, decode) =
        schedule_of(&["mladb", "check", "--prefill", "9", "--decode", "2"]);
    assert_eq!((prompt.len(), prefill, decode), (12, 9, 2));
}

#[test]
fn run_decodes_by_default_first_dense_then_sparse() {
    let o = mladb(&["run", "--layout", "glm5-tiny", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = json_lines(&o);
    let (summary, ops) = lines.split_last().unwrap();
    assert_eq!(summary["generated"].as_array().unwrap().len(), 4);
    // Layer 0's attention probabilities per decode step: [heads, 1, context]; the DSA keeps 8
    // keys, so the others are zero once the context exceeds 8.
    let probs: Vec<&serde_json::Value> = ops
        .iter()
        .filter(|op| {
            op["phase"].as_str().unwrap().starts_with("decode.")
                && op["name"] == "model.layers.0.self_attn.attn_probs"
        })
        .collect();
    let context = |op: &serde_json::Value| op["shape"][2].as_u64().unwrap();
    let zeros = |op: &serde_json::Value| op["stats"]["zeros"].as_u64().unwrap();
    let (first, last) = (probs[0], probs[probs.len() - 1]);
    assert!(context(first) <= 8 && zeros(first) == 0, "dense: {first}");
    assert!(context(last) > 8 && zeros(last) > 0, "sparse: {last}");
}

#[test]
fn check_catches_the_decode_faults_by_default_and_nothing_on_a_clean_run() {
    for layout in ["glm5-tiny", "deepseek-v3-tiny"] {
        let clean = mladb(&["check", "--layout", layout]);
        assert_eq!(clean.status.code(), Some(0), "{layout}: {}", stdout(&clean));
        assert!(stdout(&clean).contains("no findings"));
    }
    for fault in [
        "output-buffer-disconnect@decode",
        "skip-padded-rows",
        "kv-cache-off-by-one",
    ] {
        let o = mladb(&["check", "--layout", "glm5-tiny", "--inject", fault]);
        assert_eq!(o.status.code(), Some(1), "{fault}: {}", stdout(&o));
        assert!(stdout(&o).contains("decode."), "{fault}: {}", stdout(&o));
    }
}

#[test]
fn vllm_mla_disable_in_the_environment_turns_mla_disable_on_and_says_so() {
    let summary = |o: &Output| json_lines(o).pop().unwrap();
    let on = mladb_env(&["run", "--layout", "glm5-tiny", "--json"], Some("1"));
    assert!(on.status.success(), "{}", stderr(&on));
    assert_eq!(summary(&on)["flags"]["mla_disable"], true);
    assert!(stderr(&on).contains("VLLM_MLA_DISABLE"), "{}", stderr(&on));
    let off = mladb_env(&["run", "--layout", "glm5-tiny", "--json"], Some("0"));
    assert_eq!(summary(&off)["flags"]["mla_disable"], false);
    assert!(
        !stderr(&off).contains("VLLM_MLA_DISABLE"),
        "{}",
        stderr(&off)
    );
    let check = mladb_env(&["check", "--layout", "glm5-tiny"], Some("1"));
    assert!(
        stdout(&check).contains("mla-disable on"),
        "{}",
        stdout(&check)
    );
    assert!(stderr(&check).contains("VLLM_MLA_DISABLE"));

    for (value, extra, needle) in [
        ("true", &[][..], "VLLM_MLA_DISABLE='true' is not an integer"),
        ("", &[], "VLLM_MLA_DISABLE='' is not an integer"),
        (
            "1",
            &["--decode-path", "absorbed"],
            "VLLM_MLA_DISABLE=1 makes every path naive: it contradicts --decode-path absorbed",
        ),
    ] {
        let mut args = vec!["run", "--layout", "glm5-tiny"];
        args.extend_from_slice(extra);
        let o = mladb_env(&args, Some(value));
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{value}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.starts_with("error: ") && err.contains(needle), "{err}");
    }
    let o = mladb_env(
        &[
            "run",
            "--layout",
            "glm5-tiny",
            "--mla-disable",
            "--prefill-path",
            "absorbed",
        ],
        None,
    );
    assert!(stderr(&o).contains("--mla-disable makes every path naive"));
}

#[test]
fn flags_with_nothing_to_act_on_are_reported_by_run_and_check() {
    let no_decode = [
        "run",
        "--layout",
        "glm5-tiny",
        "--tokens",
        "1,2,3",
        "--decode",
        "0",
        "--inject",
        "kv-cache-off-by-one",
    ];
    let o = mladb(&no_decode);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "note: inject kv-cache-off-by-one had nothing to act on: it acts in decode, and the run has no decode steps"
        ),
        "{}",
        stderr(&o)
    );
    let mut json = no_decode.to_vec();
    json.push("--json");
    let o = mladb(&json);
    let summary = json_lines(&o).pop().unwrap();
    let idle = summary["idle"].as_array().unwrap();
    assert_eq!(idle.len(), 1, "{summary}");
    assert_eq!(idle[0]["flag"], "inject kv-cache-off-by-one");
    assert!(
        !stderr(&o).contains("nothing to act on"),
        "in the summary instead"
    );

    let o = mladb(&["run", "--layout", "glm5-tiny", "--force-dequant"]);
    let err = stderr(&o);
    let notes = err
        .lines()
        .filter(|l| l.contains("force-dequant had nothing to act on"))
        .count();
    assert_eq!(notes, 1, "said once: {err}");

    for (args, note) in [
        (
            &["--mla-disable", "--inject", "softmax-scale-latent"][..],
            "inject softmax-scale-latent had nothing to act on: MLA disable makes every path naive",
        ),
        (
            &["--inject", "q4k-scale-unpack"],
            "inject q4k-scale-unpack had nothing to act on: kv_b_proj is not Q4_K in this model (plain)",
        ),
        (
            &["--tokens", "1,2,3", "--decode", "2", "--inject", "lse-base-mismatch"],
            "inject lse-base-mismatch had nothing to act on: no context on the absorbed path spanned two split-KV blocks",
        ),
    ] {
        let mut all = vec!["check", "--layout", "glm5-tiny"];
        all.extend_from_slice(args);
        let o = mladb(&all);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stdout(&o));
        assert!(stdout(&o).contains(&format!("note: {note}")), "{args:?}: {}", stdout(&o));
    }
}
