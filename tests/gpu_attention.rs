//! The production attention kernels in the traced path of a whole forward pass on the GPU
//! (glm5-rank8: GLM-5's head dims, 8 heads as one TP=8 rank holds them): which kernel ran each
//! op, the split partials and log-sum-exps they report, `check` clean with them on every decode
//! variant the device runs (the fast vs reference comparison included), and the wrapper's fault
//! caught around them. Ignored by default (CI has no GPU); `tools/gpu_check.sh` runs them with
//! `--include-ignored` on the H200, where a missing GPU fails them.

mod common;

use common::*;
use mladb::debug::detect::{check, CheckOptions, FindingKind};
use mladb::debug::flags::DeviceFlag;
use mladb::debug::record::RunRecord;
use mladb::debug::runner::Job;
use mladb::debug::Flags;
use mladb::engine::generate::Schedule;
use mladb::engine::trace::{OpKind, Phase};
use mladb::engine::StorageDtype;
use mladb::model::Model;
use mladb::ops::{AttnKernel, DecodeVariant};

fn gpu_flags() -> Flags {
    Flags {
        device: DeviceFlag::Cuda,
        dtype: StorageDtype::Bf16,
        ..Flags::default()
    }
}

fn job<'a>(
    model: &'a Model,
    backend: &'a dyn mladb::backend::Backend,
    schedule: &'a Schedule,
    layers: &'a std::ops::Range<usize>,
) -> Job<'a> {
    Job {
        model,
        backend,
        schedule,
        layers,
        poison: true,
    }
}

fn event<'a>(run: &'a RunRecord, phase: Phase, suffix: &str) -> &'a mladb::engine::OpEvent {
    run.events
        .iter()
        .find(|e| e.phase == phase && e.name == format!("model.layers.0.self_attn.{suffix}"))
        .unwrap_or_else(|| panic!("no {phase} op self_attn.{suffix} in layer 0"))
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn the_fast_kernels_run_the_traced_attention_and_say_so() {
    let gpu = cuda_backend(StorageDtype::Bf16);
    let model = synthetic("glm5-rank8", 5);
    // 300 tokens: the prefill is one flash-prefill launch; each decode step's context spans
    // five pages, which the split choice cuts into several splits for one sequence of 8 heads.
    let schedule = Schedule {
        prompt: prompt(model.layout.vocab_size, 300),
        prefill_len: 300,
        decode_steps: 2,
    };
    let layers = 0..model.layout.num_layers;
    let j = job(&model, &gpu, &schedule, &layers);
    let fast = j.run(gpu_flags(), None).unwrap();

    let prefill = event(&fast, Phase::Prefill, "attn_output");
    let info = prefill
        .kernel
        .as_ref()
        .expect("a GPU attention op says which kernel ran");
    assert!(
        info.launches[0].kernel.starts_with("flash_prefill_") && info.reference.is_none(),
        "prefill ran {info}"
    );
    assert_eq!(event(&fast, Phase::Prefill, "attn_lse").shape, vec![300, 8]);
    assert!(
        !fast.events.iter().any(|e| e.kind == OpKind::AttentionProbs),
        "the fast kernels write no probabilities"
    );
    let decode = event(&fast, Phase::Decode(0), "attn_latent");
    let info = decode.kernel.as_ref().unwrap();
    assert!(info.launches[0].kernel.starts_with("mla_decode_"), "{info}");
    let splits = info.launches[0].splits as usize;
    assert!(
        splits > 1,
        "a 301-token context of one sequence splits: {info}"
    );
    assert!(
        info.launches[1].kernel.starts_with("mla_decode_combine"),
        "{info}"
    );
    // The partials: every split of every head written (no poison, finite log-sum-exps).
    let partials = event(&fast, Phase::Decode(0), "attn_partials");
    assert_eq!(partials.shape, vec![1, splits, 8, 513]);
    assert_eq!(partials.stats.unwritten, 0);
    assert_eq!(partials.stats.nan + partials.stats.pos_inf, 0);
    // The kernel read the device copy of the latent cache and the block table.
    assert!(
        decode
            .inputs
            .iter()
            .filter(|b| b.device == mladb::engine::trace::Device::Cuda
                && b.role == mladb::engine::trace::BufferRole::Cache)
            .count()
            >= 2,
        "{:?}",
        decode.inputs
    );
    // Every written element of the output, in every phase.
    for e in fast
        .events
        .iter()
        .filter(|e| e.kind == OpKind::AttentionLatent)
    {
        assert_eq!(e.stats.unwritten, 0, "{} {}", e.phase, e.name);
    }

    // The reference kernels on the same run say why they ran.
    let mut reference = gpu_flags();
    reference.kernels.kernel = AttnKernel::Reference;
    let slow = j.run(reference, None).unwrap();
    let info = event(&slow, Phase::Decode(0), "attn_latent")
        .kernel
        .clone()
        .unwrap();
    assert_eq!(info.reference.as_deref(), Some("--attn-kernel reference"));
    assert!(info.launches.is_empty());
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn check_is_clean_on_the_fast_kernels_of_every_decode_variant() {
    let gpu = cuda_backend(StorageDtype::Bf16);
    let model = synthetic("glm5-rank8", 9);
    let schedule = Schedule {
        prompt: prompt(model.layout.vocab_size, 140),
        prefill_len: 140,
        decode_steps: 2,
    };
    let layers = 0..model.layout.num_layers;
    let j = job(&model, &gpu, &schedule, &layers);
    let variants = mladb::backend::cuda::fast::decode_variants_for(gpu.gpu());
    assert!(!variants.is_empty(), "no decode variant runs on this GPU");
    for kernel in variants {
        let mut flags = gpu_flags();
        flags.kernels.decode = Some(kernel.parse::<DecodeVariant>().unwrap());
        let options = CheckOptions {
            tolerance: None,
            reference: None,
        };
        let report = check(&j, flags, &options).unwrap();
        assert!(
            report.findings.is_empty(),
            "{kernel}: a clean bf16 run has findings: {:#?}\nnotes: {:#?}",
            report.findings,
            report.notes
        );
        // The fast vs reference comparison ran (no note says it was skipped).
        assert!(
            !report.notes.iter().any(|n| n.contains("fast vs reference")),
            "{kernel}: {:?}",
            report.notes
        );
        let decoded = report
            .run
            .events
            .iter()
            .find(|e| e.kind == OpKind::AttentionLatent && e.phase == Phase::Decode(0))
            .and_then(|e| e.kernel.clone())
            .unwrap();
        assert_eq!(decoded.launches[0].kernel, kernel, "{decoded}");
        eprintln!("{kernel}: clean; {decoded}");
    }
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn a_disconnected_output_buffer_around_the_fast_kernels_is_caught() {
    let gpu = cuda_backend(StorageDtype::Bf16);
    let model = synthetic("glm5-rank8", 2);
    let schedule = Schedule {
        prompt: prompt(model.layout.vocab_size, 20),
        prefill_len: 20,
        decode_steps: 2,
    };
    let layers = 0..model.layout.num_layers;
    let j = job(&model, &gpu, &schedule, &layers);
    // In both phases (the default) it shows first at the flash prefill's wrapper; in decode
    // alone, at the tensor-core decode's.
    for (scope, phase, kernel) in [
        ("", Phase::Prefill, "flash_prefill_"),
        ("@decode", Phase::Decode(0), "mla_decode_"),
    ] {
        let mut flags = gpu_flags();
        flags
            .set("inject", &format!("output-buffer-disconnect{scope}"))
            .unwrap();
        let options = CheckOptions {
            tolerance: None,
            reference: None,
        };
        let report = check(&j, flags, &options).unwrap();
        let found = report
            .findings
            .iter()
            .find(|f| f.kind == FindingKind::BufferDisconnect)
            .unwrap_or_else(|| panic!("{scope}: not caught: {:#?}", report.findings));
        assert_eq!(found.phase, phase, "{found:?}");
        let e = &report.run.events[found.index];
        let info = e.kernel.as_ref().unwrap();
        assert!(info.launches[0].kernel.starts_with(kernel), "{info}");
        assert_ne!(e.kernel_wrote.unwrap().id, e.output.id);
    }
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn check_is_clean_on_an_fp8_cache_with_every_fp8_decode_variant() {
    let gpu = cuda_backend(StorageDtype::Bf16);
    let model = synthetic("glm5-rank8", 11);
    // 140 tokens: each decode step's context spans three pages, split several ways.
    let schedule = Schedule {
        prompt: prompt(model.layout.vocab_size, 140),
        prefill_len: 140,
        decode_steps: 2,
    };
    let layers = 0..model.layout.num_layers;
    let j = job(&model, &gpu, &schedule, &layers);
    let variants = mladb::backend::cuda::fast::fp8_decode_variants_for(gpu.gpu());
    assert!(
        !variants.is_empty(),
        "no FP8-cache decode variant runs on this GPU"
    );
    let forced = variants.iter().map(|v| Some(v.replace("fp8_", "")));
    for variant in std::iter::once(None).chain(forced) {
        let mut flags = gpu_flags();
        flags.kv_cache = mladb::ops::KvCacheDtype::Fp8DsMla;
        flags.kernels.decode = variant
            .as_deref()
            .map(|v| v.parse::<DecodeVariant>().unwrap());
        let options = CheckOptions {
            tolerance: None,
            reference: None,
        };
        let report = check(&j, flags, &options).unwrap();
        assert!(
            report.findings.is_empty(),
            "{variant:?}: a clean fp8 run has findings: {:#?}\nnotes: {:#?}",
            report.findings,
            report.notes
        );
        let decoded = report
            .run
            .events
            .iter()
            .find(|e| e.kind == OpKind::AttentionLatent && e.phase == Phase::Decode(0))
            .and_then(|e| e.kernel.clone())
            .unwrap();
        let kernel = &decoded.launches[0].kernel;
        assert!(kernel.starts_with("mla_decode_fp8_"), "{decoded}");
        if let Some(v) = &variant {
            assert_eq!(kernel.replace("fp8_", ""), *v, "{decoded}");
        }
        eprintln!("fp8 cache, {variant:?}: clean; {decoded}");
    }
    // A variant with no FP8 form: the decode declines it, saying why, and the reference runs.
    if gpu.gpu().has_kernel("mla_decode_kt3") {
        let mut flags = gpu_flags();
        flags.kv_cache = mladb::ops::KvCacheDtype::Fp8DsMla;
        flags.kernels.decode = Some(DecodeVariant::Kt3);
        let run = j.run(flags, None).unwrap();
        let info = event(&run, Phase::Decode(0), "attn_latent")
            .kernel
            .clone()
            .unwrap();
        assert!(info.launches.is_empty(), "{info}");
        assert!(info.reference.unwrap().contains("fp8_ds_mla"));
    }
}

#[test]
fn the_cpu_runs_the_reference_kernels_and_records_no_launch() {
    let model = synthetic("glm5-rank8", 3);
    let schedule = Schedule {
        prompt: prompt(model.layout.vocab_size, 6),
        prefill_len: 6,
        decode_steps: 1,
    };
    let layers = 0..model.layout.num_layers;
    let cpu = mladb::backend::cpu::CpuBackend;
    let run = job(&model, &cpu, &schedule, &layers)
        .run(Flags::default(), None)
        .unwrap();
    assert!(run.events.iter().all(|e| e.kernel.is_none()));
    assert!(run.events.iter().any(|e| e.kind == OpKind::AttentionProbs));
}
