//! Unit tests of the detectors that pair the checked run with another (kept apart: detect.rs
//! is near the length the layering test allows).

use super::*;
use crate::backend::cpu::CpuBackend;
use crate::debug::compare::compare_runs;
use crate::debug::flags::DeviceFlag;
use crate::model::{Layout, Model};
use crate::ops::{KernelInfo, KernelLaunch};
use crate::tensor::Tensor;
use std::sync::Arc;

/// A CPU run of glm5-tiny whose latent attention is marked as run by a fast kernel, flagged as
/// on the GPU: what `kernel_mismatch` is given on a device.
fn fast_run(model: &Model) -> (RunRecord, Flags) {
    let schedule = Schedule {
        prompt: vec![3, 1, 4, 1, 5],
        prefill_len: 5,
        decode_steps: 1,
    };
    let layers = 0..model.layout.num_layers;
    let job = Job {
        model,
        backend: &CpuBackend,
        schedule: &schedule,
        layers: &layers,
        poison: true,
    };
    let mut flags = Flags::default();
    let mut run = job.run(flags, None).unwrap();
    let i = run
        .events
        .iter()
        .position(|e| e.kind == OpKind::AttentionLatent)
        .unwrap();
    run.events[i].kernel = Some(KernelInfo {
        launches: vec![KernelLaunch {
            kernel: "mla_decode_wgmma".into(),
            grid: [1, 1, 1],
            block: [128, 1, 1],
            shared_bytes: 0,
            splits: 1,
            cluster: 1,
        }],
        reference: None,
    });
    flags.device = DeviceFlag::Cuda;
    (run, flags)
}

fn verdicts() -> Verdicts {
    Verdicts {
        findings: Vec::new(),
        notes: Vec::new(),
        selection_notes: Vec::new(),
        headroom: Vec::new(),
        ops: 0,
        reruns: 0,
        tolerances: Tolerances::Table(StorageDtype::F32),
    }
}

fn paired_with(run: &RunRecord, other: RunRecord, model: &Model) -> Paired {
    let tolerances = Tolerances::Table(StorageDtype::F32);
    Paired {
        comparisons: compare_runs(run, &other, model.layout.num_heads, &tolerances),
        flips: Vec::new(),
        clear: Vec::new(),
        other,
        ops_executed: 0,
        reruns: 0,
        gave_up: false,
    }
}

/// An op of the fast kernels that cannot be set beside the reference kernels' (another shape)
/// is a finding, and the note counts what was compared. It used to be passed over: a
/// comparison that compared nothing there read as agreement.
#[test]
fn kernel_ops_that_cannot_be_compared_are_a_mismatch_not_agreement() {
    let model = Model::synthetic(Layout::resolve("glm5-tiny").unwrap(), 0, 1 << 30).unwrap();
    let (run, flags) = fast_run(&model);

    // The same run as its own reference: every op compared, nothing found.
    let mut v = verdicts();
    let same = paired_with(&run, run.clone(), &model);
    let compared = format!(
        "fast vs reference kernels: {} ops compared",
        same.comparisons.len()
    );
    assert!(same.comparisons.len() > 200);
    kernel_mismatch(&mut v, &run, flags, |_| Ok(same)).unwrap();
    assert!(v.findings.is_empty(), "{:#?}", v.findings);
    assert!(v.notes.contains(&compared), "{:?}", v.notes);

    // The reference kernels' output of one attention op has another shape.
    let i = run
        .events
        .iter()
        .position(|e| e.kind == OpKind::Attention)
        .unwrap();
    let mut other = run.clone();
    let n: usize = other.events[i].shape.iter().product();
    other.events[i].shape = vec![n + 1];
    other.outputs[i] = Arc::new(Tensor::from_vec(&[n + 1], vec![0.0; n + 1]));
    let mut v = verdicts();
    kernel_mismatch(&mut v, &run, flags, |_| {
        Ok(paired_with(&run, other, &model))
    })
    .unwrap();
    let f = v
        .findings
        .iter()
        .find(|f| f.kind == FindingKind::KernelMismatch)
        .unwrap_or_else(|| panic!("no finding: {:?}", v.notes));
    assert_eq!(f.index, i);
    assert!(f.detail.contains("shapes differ"), "{}", f.detail);
    assert!(
        v.notes.iter().any(|n| n.ends_with(", 1 could not be")),
        "{:?}",
        v.notes
    );
}
