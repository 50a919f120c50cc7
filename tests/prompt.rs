//! Text in and out: `--prompt` turns text into ids with the checkpoint's tokenizer.json (the
//! ids HF's Python `tokenizers` gives for it, tools/make_tokenizer.py), the run is the run of
//! those ids, and the generated tokens come back as text in `run`, its JSON, the session it
//! records and the debugger's log. Bad tokenizers and prompts are one clear error.

mod common;

use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use serde_json::Value;
use std::process::Command;
use std::sync::Arc;

const MODEL: &str = "tests/fixtures/hf/glm5-sparse";

fn mladb(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(args)
        .output()
        .unwrap()
}

fn expected() -> Vec<Value> {
    let text = std::fs::read_to_string(format!("{MODEL}/tokenizer-expected.json")).unwrap();
    serde_json::from_str::<Value>(&text)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

fn summary(o: &std::process::Output) -> Value {
    let out = common::stdout(o);
    assert!(o.status.success(), "{out}{}", common::stderr(o));
    let last = out.lines().last().unwrap();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{last}: {e}"))
}

#[test]
fn a_prompt_runs_as_the_ids_the_python_tokenizer_gives() {
    for case in expected() {
        let prompt = case["prompt"].as_str().unwrap();
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let by_text = summary(&mladb(&[
            "run", "--model", MODEL, "--prompt", prompt, "--decode", "3", "--json",
        ]));
        assert_eq!(by_text["prompt"], serde_json::json!(ids), "{prompt}");
        assert_eq!(by_text["prompt_text"], case["decoded"], "{prompt}");
        // The same run by ids: the same tokens generated.
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        let by_ids = summary(&mladb(&[
            "run",
            "--model",
            MODEL,
            "--tokens",
            &list.join(","),
            "--decode",
            "3",
            "--json",
        ]));
        assert_eq!(by_text["generated"], by_ids["generated"], "{prompt}");
        // Each generated id's text is what the tokenizer says of it alone.
        let generated: Vec<u32> = serde_json::from_value(by_text["generated"].clone()).unwrap();
        let pieces = by_text["generated_text"].as_array().unwrap();
        assert_eq!(pieces.len(), generated.len());
        let codec = mladb::model::tokenizer::TextCodec::load(std::path::Path::new(&format!(
            "{MODEL}/tokenizer.json"
        )))
        .unwrap();
        for (id, piece) in generated.iter().zip(pieces) {
            assert_eq!(piece.as_str().unwrap(), codec.decode(&[*id]));
        }
    }
}

#[test]
fn the_prompt_ids_and_pieces_match_the_python_tokenizer() {
    let codec = mladb::model::tokenizer::TextCodec::load(std::path::Path::new(&format!(
        "{MODEL}/tokenizer.json"
    )))
    .unwrap();
    for case in expected() {
        let ids = codec.encode(case["prompt"].as_str().unwrap(), 256).unwrap();
        assert_eq!(serde_json::json!(ids), case["ids"]);
        assert_eq!(serde_json::json!(codec.pieces(&ids)), case["pieces"]);
        assert_eq!(codec.decode(&ids), case["decoded"].as_str().unwrap());
    }
}

#[test]
fn text_is_shown_and_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let session = dir.path().join("s.ron");
    let o = mladb(&[
        "run",
        "--model",
        MODEL,
        "--prompt",
        "Hello world",
        "--decode",
        "2",
        "--record",
        session.to_str().unwrap(),
    ]);
    let out = common::stdout(&o);
    assert!(o.status.success(), "{out}{}", common::stderr(&o));
    let line = out.lines().find(|l| l.starts_with("text: ")).unwrap();
    assert!(line.starts_with("text: \"Hello world\" -> \""), "{line}");
    let saved = std::fs::read_to_string(&session).unwrap();
    assert!(saved.contains("prompt: \"Hello world\""), "{saved}");
    // The debugger's log says the generated tokens as text, live and in the replay.
    let spec = mladb::tui::host::HostSpec {
        text: Some(Arc::new(
            mladb::model::tokenizer::TextCodec::load(std::path::Path::new(&format!(
                "{MODEL}/tokenizer.json"
            )))
            .unwrap(),
        )),
        ..common::live_spec("glm5-tiny", "", 8, 6, 2)
    };
    use mladb::tui::{app::App, driver::InlineDriver, keys::Keymap, theme::Theme};
    let mut app = App::new(
        Box::new(InlineDriver::new(spec).unwrap()),
        Keymap::default(),
        Theme::plain(),
    );
    app.on_key(KeyEvent::new(KeyCode::Char('c'), KeyModifiers::NONE));
    let log = app.log.join("\n");
    let finished = log
        .lines()
        .find(|l| l.contains("run 0 finished: generated ["))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(finished.contains("] (\""), "{finished}");
}

#[test]
fn bad_tokenizers_and_prompts_are_one_clear_error() {
    let o = mladb(&["run", "--layout", "glm5-tiny", "--prompt", "Hello"]);
    common::assert_clean_error(&o, "--prompt needs a tokenizer");
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("tokenizer.json");
    std::fs::write(&junk, "{ not json").unwrap();
    let o = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--prompt",
        "Hello",
        "--tokenizer",
        junk.to_str().unwrap(),
    ]);
    common::assert_clean_error(&o, "not a tokenizer.json");
    // A tokenizer of a bigger vocabulary than the model's.
    let mut tok: Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{MODEL}/tokenizer.json")).unwrap())
            .unwrap();
    tok["added_tokens"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "id": 4000, "content": "<|big|>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    let big = dir.path().join("big.json");
    std::fs::write(&big, tok.to_string()).unwrap();
    let o = mladb(&[
        "run",
        "--model",
        MODEL,
        "--prompt",
        "Hello <|big|>",
        "--tokenizer",
        big.to_str().unwrap(),
    ]);
    common::assert_clean_error(&o, "outside the model's vocabulary of 256");
}
