//! The debugger core on glm5-tiny: every injected fault is caught by the detector made for it at
//! the op where it acts, the clean run shows nothing, bisect points at the injected op, the
//! controller steps and stops where it should, and a flag change re-executes only what it must,
//! with results identical to a fresh run.

mod common;

use mladb::backend::cpu::CpuBackend;
use mladb::backend::Backend;
use mladb::debug::bisect::bisect;
use mladb::debug::breakpoint::Breakpoint;
use mladb::debug::compare::compare_runs;
use mladb::debug::controller::{Controller, Stop};
use mladb::debug::detect::{check, CheckOptions, CheckReport, Finding, FindingKind};
use mladb::debug::external::ExternalDump;
use mladb::debug::forensics::attention_chain;
use mladb::debug::runner::Job;
use mladb::debug::tolerance::Tolerances;
use mladb::debug::{Flags, RunRecord};
use mladb::engine::generate::Schedule;
use mladb::engine::trace::{OpKind, Phase};
use mladb::model::Model;
use std::sync::Arc;

fn schedule(model: &Model) -> Schedule {
    Schedule {
        prompt: common::prompt(model.layout.vocab_size, 12),
        prefill_len: 9,
        decode_steps: 2,
    }
}

fn with_job<T>(f: impl FnOnce(&Job) -> T) -> T {
    let model = common::synthetic("glm5-tiny", 21);
    let schedule = schedule(&model);
    let layers = 0..model.layout.num_layers;
    let job = Job {
        model: &model,
        backend: &CpuBackend,
        schedule: &schedule,
        layers: &layers,
        poison: true,
    };
    f(&job)
}

fn flags(text: &str) -> Flags {
    Flags::parse(text).unwrap()
}

fn verdict(job: &Job, fault: &str, reference: Option<ExternalDump>) -> CheckReport {
    let options = CheckOptions {
        tolerance: None,
        reference,
    };
    check(job, flags(&format!("inject={fault}")), &options).unwrap()
}

fn findings(job: &Job, fault: &str, reference: Option<ExternalDump>) -> Vec<Finding> {
    verdict(job, fault, reference).findings
}

fn assert_found(found: &[Finding], kind: FindingKind, op: &str, phase: Option<Phase>, fault: &str) {
    assert!(
        found
            .iter()
            .any(|f| f.kind == kind && f.op == op && phase.is_none_or(|p| p == f.phase)),
        "{fault}: expected {kind} at {op} {phase:?}; found:\n{}",
        found
            .iter()
            .map(|f| format!("  {} {} {}: {}", f.kind, f.phase, f.op, f.detail))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

const L0: &str = "model.layers.0.self_attn";

#[test]
fn the_clean_run_has_no_findings() {
    with_job(|job| {
        let reference = ExternalDump::from_run(&job.run(Flags::default(), None).unwrap());
        let report = check(
            job,
            Flags::default(),
            &CheckOptions {
                tolerance: None,
                reference: Some(reference),
            },
        )
        .unwrap();
        assert!(report.findings.is_empty(), "{:#?}", report.findings);
        assert!(report
            .notes
            .iter()
            .any(|n| n.contains("quantized kv_b_proj: skipped")));
    });
}

#[test]
fn every_injection_is_caught_at_the_op_where_it_acts() {
    with_job(|job| {
        let d0 = Some(Phase::Decode(0));
        let pre = Some(Phase::Prefill);
        let f = "output-buffer-disconnect";
        let found = findings(job, f, None);
        assert_found(
            &found,
            FindingKind::BufferDisconnect,
            &format!("{L0}.attn_output"),
            pre,
            f,
        );
        assert_found(
            &found,
            FindingKind::Unwritten,
            &format!("{L0}.attn_output"),
            pre,
            f,
        );

        let f = "softmax-scale-latent";
        assert_found(
            &findings(job, f, None),
            FindingKind::AbsorbedNaiveMismatch,
            &format!("{L0}.attn_probs"),
            pre,
            f,
        );

        let f = "absorb-wrong-split";
        assert_found(
            &findings(job, f, None),
            FindingKind::AbsorbedNaiveMismatch,
            &format!("{L0}.attn_probs"),
            pre,
            f,
        );

        let f = "lse-base-mismatch";
        let found = findings(job, f, None);
        assert_found(
            &found,
            FindingKind::AbsorbedNaiveMismatch,
            &format!("{L0}.attn_probs"),
            None,
            f,
        );
        assert_found(
            &found,
            FindingKind::PrefillDecodeMismatch,
            &format!("{L0}.attn_probs"),
            d0,
            f,
        );

        let f = "skip-padded-rows";
        assert_found(
            &findings(job, f, None),
            FindingKind::Unwritten,
            &format!("{L0}.attn_latent"),
            d0,
            f,
        );

        let f = "kv-cache-off-by-one";
        let found = findings(job, f, None);
        assert_found(
            &found,
            FindingKind::PrefillDecodeMismatch,
            &format!("{L0}.attn_probs"),
            d0,
            f,
        );
        assert_found(
            &found,
            FindingKind::NanInf,
            &format!("{L0}.attn_probs"),
            d0,
            f,
        );

        // A RoPE layout mismatch is self-consistent (prefill and decode, absorbed and naive all
        // agree), so only a reference shows it.
        // Without a reference the verdict says so, rather than an unqualified all-clear.
        let f = "rope-noninterleaved";
        let without = verdict(job, f, None);
        assert!(without.findings.is_empty(), "{:#?}", without.findings);
        assert!(
            without
                .notes
                .iter()
                .any(|n| n.starts_with("rope-noninterleaved: only a reference dump shows it")),
            "{:#?}",
            without.notes
        );
        let reference = ExternalDump::from_run(&job.run(Flags::default(), None).unwrap());
        assert_found(
            &findings(job, f, Some(reference)),
            FindingKind::ReferenceMismatch,
            &format!("{L0}.q_rope"),
            pre,
            f,
        );
    });
}

#[test]
fn bisect_points_at_the_injected_op() {
    with_job(|job| {
        let clean = job.run(Flags::default(), None).unwrap();
        for (fault, op, phase) in [
            ("softmax-scale-latent", "attn_probs", Phase::Decode(0)),
            ("absorb-wrong-split", "q_absorbed", Phase::Decode(0)),
            ("rope-noninterleaved", "q_rope", Phase::Prefill),
            ("kv-cache-off-by-one", "attn_probs", Phase::Decode(0)),
            ("output-buffer-disconnect", "attn_output", Phase::Prefill),
        ] {
            let bad = job.run(flags(&format!("inject={fault}")), None).unwrap();
            let tolerances = Tolerances::Table(bad.flags.dtype);
            let b = bisect(
                compare_runs(&bad, &clean, job.model.layout.num_heads, &tolerances),
                bad.len(),
                Vec::new(),
            );
            let first = b
                .first
                .unwrap_or_else(|| panic!("{fault}: nothing diverged"));
            assert_eq!(
                (first.phase, first.name.as_str()),
                (phase, format!("{L0}.{op}").as_str()),
                "{fault}"
            );
            assert!(b.last_good.is_some());
        }
    });
}

#[test]
fn the_attention_chain_shows_the_disconnect() {
    with_job(|job| {
        let bad = job
            .run(flags("inject=output-buffer-disconnect"), None)
            .unwrap();
        let chain = attention_chain(&bad, Phase::Prefill, 0).unwrap();
        assert!(!chain.connected);
        assert_ne!(chain.kernel_wrote.id, chain.returned.id);
        assert_eq!(
            chain.consumer_op.as_deref(),
            Some("model.layers.0.self_attn.o_proj")
        );
        assert_eq!(chain.consumer_read.unwrap().id, chain.returned.id);
        assert!(chain.unwritten > 0);
        assert!(chain.describe().contains("o_proj read"));
        let good = job.run(Flags::default(), None).unwrap();
        let chain = attention_chain(&good, Phase::Decode(1), 3).unwrap();
        assert!(chain.connected && chain.unwritten == 0);
        assert_eq!(chain.kernel_op, "model.layers.3.self_attn.attn_latent");
        // With MLA disabled the attention is served elsewhere: no disconnect.
        let routed = job
            .run(flags("inject=output-buffer-disconnect,mla-disable"), None)
            .unwrap();
        assert!(
            attention_chain(&routed, Phase::Prefill, 0)
                .unwrap()
                .connected
        );
    });
}

fn controller(text: &str) -> Controller {
    let model = Arc::new(common::synthetic("glm5-tiny", 21));
    let s = schedule(&model);
    let layers = 0..model.layout.num_layers;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend);
    Controller::new(model, backend, s, layers, flags(text)).unwrap()
}

#[test]
fn stepping_next_layer_and_breakpoints() {
    let mut c = controller("");
    assert!(c.position().is_none());
    assert_eq!(c.step(), Stop::Stepped);
    assert_eq!(c.position().unwrap().op, "model.embed_tokens");
    assert_eq!(c.next_layer(), Stop::NextLayer);
    assert_eq!(c.position().unwrap().op, "model.layers.0.input_layernorm");
    assert_eq!(c.next_layer(), Stop::NextLayer);
    assert_eq!(c.position().unwrap().op, "model.layers.1.input_layernorm");
    c.add_breakpoint(Breakpoint::parse("op *q_absorbed").unwrap());
    assert_eq!(c.continue_run(), Stop::Breakpoint(0));
    let p = c.position().unwrap();
    assert_eq!(
        (p.phase, p.op.as_str()),
        (Phase::Decode(0), "model.layers.0.self_attn.q_absorbed")
    );
    assert_eq!(c.continue_run(), Stop::Breakpoint(0));
    assert_eq!(c.position().unwrap().layer, Some(1));
    assert!(!c.toggle_breakpoint(Breakpoint::parse("op *q_absorbed").unwrap()));
    assert_eq!(c.continue_run(), Stop::End);
    assert!(c.finished() && c.current().finished());
    assert_eq!(c.step(), Stop::End);

    // A layer breakpoint stops on entering the layer, once per phase.
    c.add_breakpoint(Breakpoint::Layer(2));
    c.restart();
    assert_eq!(c.continue_run(), Stop::Breakpoint(0));
    assert_eq!(c.position().unwrap().op, "model.layers.2.input_layernorm");
    assert_eq!(c.continue_run(), Stop::Breakpoint(0));
    assert_eq!(c.position().unwrap().phase, Phase::Decode(0));
    assert_eq!(c.history().len(), 1, "the finished run is kept");
    assert_eq!(c.run_number(), 1);
}

#[test]
fn condition_breakpoints_stop_at_the_first_bad_op() {
    let mut c = controller("inject=kv-cache-off-by-one");
    c.add_breakpoint(Breakpoint::NanInf);
    assert_eq!(c.continue_run(), Stop::Breakpoint(0));
    let p = c.position().unwrap();
    assert_eq!(
        (p.phase, p.op.as_str()),
        (Phase::Decode(0), "model.layers.0.self_attn.attn_probs")
    );

    // diff>X compares with the previous run: inject a fault, keep the clean run for comparison.
    let mut c = controller("");
    assert_eq!(c.continue_run(), Stop::End);
    c.set_flag("inject", "softmax-scale-latent").unwrap();
    c.restart();
    c.add_breakpoint(Breakpoint::parse("diff>1e-4").unwrap());
    assert_eq!(c.continue_run(), Stop::Breakpoint(0));
    let p = c.position().unwrap();
    assert_eq!(
        (p.phase, p.op.as_str()),
        (Phase::Decode(0), "model.layers.0.self_attn.attn_probs")
    );
    let d = c.op_diff(p.index).unwrap().diff.unwrap();
    assert!(d.rel_l2 > 1e-4 && !d.per_head.is_empty());
}

/// The debugger's comparison of a bf16 run with the f32 run before it is judged by bf16's
/// tolerances: a clean switch of dtype is no divergence (the f32 table flagged the embedding,
/// the first op). A router's choice near a tie may still flip with bf16's rounding (this
/// comparison does not force choices, as `check` does): nothing numeric diverges before one.
#[test]
fn runs_of_two_dtypes_are_compared_by_the_bf16_tolerances() {
    let mut c = controller("");
    assert_eq!(c.continue_run(), Stop::End);
    // f32 → bf16, then back: the current run is bf16 against f32, then f32 against bf16.
    for dtype in ["bf16", "f32"] {
        c.set_flag("dtype", dtype).unwrap();
        assert_eq!(c.continue_run(), Stop::End);
        let diffs = c.diff_runs();
        assert!(diffs.len() > 100, "{} ops compared", diffs.len());
        assert!(
            diffs.iter().any(|d| d.exceeds(1e-4)),
            "bf16 differs from f32 beyond f32's floor"
        );
        if let Some(first) = diffs.iter().find(|d| d.exceeds_its()) {
            assert!(
                matches!(first.kind, OpKind::Router | OpKind::IndexTopK),
                "now {dtype}: the first op over its tolerance is not a choice: {first:?}"
            );
        }
    }
}

#[test]
fn a_flag_toggle_reexecutes_only_from_the_first_affected_op() {
    let mut c = controller("");
    assert_eq!(c.continue_run(), Stop::End);
    let old_len = c.current().len();
    let first_absorbed = c
        .current()
        .find(Phase::Decode(0), "model.layers.0.self_attn.q_absorbed")
        .unwrap();
    let change = c.set_flag("mla-disable", "on").unwrap();
    let (index, phase, op) = change.first_affected.clone().unwrap();
    assert_eq!(
        (index, phase, op.as_str()),
        (
            first_absorbed,
            Phase::Decode(0),
            "model.layers.0.self_attn.q_absorbed"
        )
    );
    assert_eq!(
        change.replayed, first_absorbed,
        "everything before the first absorbed op is reused"
    );
    let new_len = c.current().len();
    assert!(c.current().finished());
    assert_eq!(
        change.executed,
        new_len - first_absorbed,
        "everything from it on is computed"
    );
    let events = &c.current().events;
    assert!(
        events[..first_absorbed].iter().all(|e| e.replayed),
        "the prefill was not recomputed"
    );
    assert!(events[first_absorbed..].iter().all(|e| !e.replayed));
    assert_eq!(
        new_len, old_len,
        "as many ops: kv_b_proj, kv_cache for q_absorbed, attn_latent"
    );
    assert!(c
        .current()
        .find(Phase::Decode(0), "model.layers.0.self_attn.kv_b_proj")
        .is_some());
    assert!(c
        .current()
        .find(Phase::Decode(0), "model.layers.0.self_attn.q_absorbed")
        .is_none());
    // The re-execution is the run a fresh start gives, to the bit.
    let fresh = with_fresh_run("mla-disable");
    assert_same(c.current(), &fresh, "mla-disable");
    // The diff against the previous run starts at decode.
    let diffs = c.diff_runs();
    let first_diff = diffs.iter().find(|d| d.exceeds(0.0)).unwrap();
    assert!(matches!(first_diff.phase, Phase::Decode(0)));
    // A flag with nothing to act on re-executes nothing.
    let change = c.set_flag("force-dequant", "on").unwrap();
    assert_eq!((change.executed, change.replayed), (0, 0));
    assert!(change.note.unwrap().contains("nothing to act on"));
}

fn with_fresh_run(text: &str) -> RunRecord {
    with_job(|job| job.run(flags(text), None).unwrap())
}

fn assert_same(a: &RunRecord, b: &RunRecord, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: op counts");
    for (i, (ea, eb)) in a.events.iter().zip(&b.events).enumerate() {
        assert_eq!((ea.phase, &ea.name), (eb.phase, &eb.name), "{what}: op {i}");
        let (x, y) = (a.outputs[i].data(), b.outputs[i].data());
        let same = x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(
            same,
            "{what}: op {i} {} {} differs from a fresh run",
            ea.phase, ea.name
        );
    }
}

#[test]
fn reexecution_equals_a_fresh_run_for_every_flag_change() {
    let changes: Vec<(&str, &str)> = vec![
        ("mla-disable", "on"),
        ("decode-path", "naive"),
        ("prefill-path", "absorbed"),
        ("dtype", "bf16"),
        ("inject", "output-buffer-disconnect"),
        ("inject", "softmax-scale-latent"),
        ("inject", "absorb-wrong-split"),
        ("inject", "rope-noninterleaved"),
        ("inject", "lse-base-mismatch"),
        ("inject", "skip-padded-rows"),
        ("inject", "kv-cache-off-by-one"),
    ];
    for (key, value) in changes {
        // Clean → changed, from the end of a run and from the middle of one.
        for stop_after in [None, Some(40)] {
            let mut c = controller("");
            match stop_after {
                None => assert_eq!(c.continue_run(), Stop::End),
                Some(n) => (0..n).for_each(|_| assert_eq!(c.step(), Stop::Stepped)),
            }
            c.set_flag(key, value).unwrap();
            assert_eq!(c.continue_run(), Stop::End);
            let mut new = Flags::default();
            new.set(key, value).unwrap();
            let what = format!("{key}={value} after {stop_after:?}");
            assert_same(
                c.current(),
                &with_job(|job| job.run(new, None).unwrap()),
                &what,
            );
            // And back.
            let text = if key == "inject" {
                format!("-{value}")
            } else {
                "off".into()
            };
            let undo = match key {
                "inject" => text.as_str(),
                "dtype" => "f32",
                "decode-path" => "absorbed",
                "prefill-path" => "naive",
                _ => "off",
            };
            c.set_flag(key, undo).unwrap();
            assert_eq!(c.continue_run(), Stop::End);
            assert_same(c.current(), &with_fresh_run(""), &format!("{what}, undone"));
        }
    }
}
