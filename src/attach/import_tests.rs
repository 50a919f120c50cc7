//! Unit tests of the importer (kept apart: import.rs is near the length the layering test
//! allows).

use super::*;

fn hello(rank: u32, world: u32) -> Record {
    Record::Hello {
        engine: "vllm".into(),
        model: "m".into(),
        rank,
        world,
    }
}

fn step(step: u64, tokens: &[u32], first: u32) -> Record {
    step_at(step, tokens, (first..first + tokens.len() as u32).collect())
}

/// A step with the positions given as they are (they need not run on).
fn step_at(step: u64, tokens: &[u32], positions: Vec<u32>) -> Record {
    Record::Step {
        step,
        tokens: tokens.to_vec(),
        positions,
    }
}

fn tensor(module: &str, rows: usize, data: Vec<f32>) -> Record {
    Record::Tensor {
        module: module.into(),
        shape: vec![rows, data.len() / rows],
        data,
        low_precision: true,
        ptr: Some(16),
        kernel_out_ptr: None,
    }
}

/// Asserts that one of the import's notes says `text`.
#[track_caller]
fn assert_noted(notes: &[String], text: &str) {
    assert!(notes.iter().any(|n| n.contains(text)), "{notes:?}");
}

#[test]
fn two_ranks_become_one_dump_with_phases_and_metadata() {
    let layout = Layout::resolve("glm5-tiny").unwrap();
    let mut imp = Importer::new(&layout, None);
    // o_proj is row-parallel in vLLM's map: the ranks' partial sums add up.
    let o = "model.layers.0.self_attn.o_proj";
    for rank in 0..2u32 {
        let mut c = None;
        let src = format!("rank{rank}");
        imp.take(&mut c, hello(rank, 2), &src).unwrap();
        imp.take(&mut c, step(0, &[5, 6], 0), &src).unwrap();
        imp.take(
            &mut c,
            tensor(o, 2, vec![1.0 + rank as f32; 2 * layout.hidden_size]),
            &src,
        )
        .unwrap();
        imp.take(&mut c, step(1, &[7], 2), &src).unwrap();
        imp.take(
            &mut c,
            tensor(o, 1, vec![rank as f32; layout.hidden_size]),
            &src,
        )
        .unwrap();
        // A second sequence is not imported.
        imp.take(&mut c, step(2, &[9, 9], 0), &src).unwrap();
    }
    let out = imp.finish("test").unwrap();
    assert_eq!(out.meta.tokens, vec![5, 6, 7]);
    assert_eq!(out.meta.prefill, 2);
    assert_eq!(out.meta.dtype.as_deref(), Some("bf16"));
    let keys: Vec<&str> = out.tensors.iter().map(|t| t.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "prefill/model.layers.0.self_attn.o_proj",
            "decode.0/model.layers.0.self_attn.o_proj"
        ]
    );
    assert!(out.tensors[0].data.iter().all(|&v| v == 3.0));
    assert!(out.tensors[1].data.iter().all(|&v| v == 1.0));
    assert_noted(&out.notes, "step 2 starts a new sequence");
}

#[test]
fn a_missing_rank_and_a_disconnect_are_reported() {
    let layout = Layout::resolve("glm5-tiny").unwrap();
    let mut imp = Importer::new(&layout, None);
    let mut c = None;
    imp.take(&mut c, hello(0, 2), "r0").unwrap();
    imp.take(&mut c, step(0, &[5, 6], 0), "r0").unwrap();
    imp.take(
        &mut c,
        tensor(
            "model.layers.0.self_attn.o_proj",
            2,
            vec![1.0; 2 * layout.hidden_size],
        ),
        "r0",
    )
    .unwrap();
    imp.take(
        &mut c,
        Record::Tensor {
            module: "model.layers.0.input_layernorm".into(),
            shape: vec![2, layout.hidden_size],
            data: vec![1.0; 2 * layout.hidden_size],
            low_precision: false,
            ptr: Some(32),
            kernel_out_ptr: Some(64),
        },
        "r0",
    )
    .unwrap();
    let out = imp.finish("test").unwrap();
    assert_eq!(out.tensors.len(), 1, "only the replicated norm is whole");
    assert_noted(&out.notes, "lacked some");
    assert_eq!(out.disconnects.len(), 1);
    assert!(
        out.disconnects[0].contains("@0x40"),
        "{}",
        out.disconnects[0]
    );
}

/// Found by the import_sglang fuzz target: positions that run on up to u32::MAX made the
/// run-on test's sum overflow (a panic) instead of a note.
#[test]
fn positions_at_the_end_of_u32_are_noted_not_a_panic() {
    let layout = Layout::resolve("glm5-tiny").unwrap();
    let mut imp = Importer::new(&layout, None);
    let mut c = None;
    imp.take(&mut c, hello(0, 1), "r0").unwrap();
    imp.take(&mut c, step(0, &[5, 6], 0), "r0").unwrap();
    let norm = "model.layers.0.input_layernorm";
    imp.take(
        &mut c,
        tensor(norm, 2, vec![1.0; 2 * layout.hidden_size]),
        "r0",
    )
    .unwrap();
    imp.take(&mut c, step_at(1, &[7, 8], vec![u32::MAX, 0]), "r0")
        .unwrap();
    imp.take(&mut c, step_at(2, &[9], vec![u32::MAX]), "r0")
        .unwrap();
    let out = imp.finish("test").unwrap();
    assert_eq!(out.meta.tokens, vec![5, 6]);
    assert_noted(&out.notes, "step 1 has positions that do not run on");
}

#[test]
fn a_recording_without_a_prefill_is_an_error() {
    let layout = Layout::resolve("glm5-tiny").unwrap();
    let mut imp = Importer::new(&layout, None);
    let mut c = None;
    imp.take(&mut c, hello(0, 1), "r0").unwrap();
    imp.take(&mut c, step(0, &[5], 7), "r0").unwrap();
    let e = imp.finish("test").err().expect("an error").to_string();
    assert!(e.contains("no step at position 0"), "{e}");
    let mut c = None;
    let mut imp = Importer::new(&layout, None);
    assert!(imp.take(&mut c, step(0, &[5], 0), "r0").is_err());
    imp.take(&mut c, hello(0, 1), "r0").unwrap();
    let mut again = None;
    assert!(
        imp.take(&mut again, hello(0, 1), "r1").is_err(),
        "rank 0 twice"
    );
}
