//! The production attention kernels in the traced path of a whole forward pass on the GPU
//! (glm5-rank8: GLM-5's head dims, 8 heads as one TP=8 rank holds them): which kernel ran each
//! op, the split partials and log-sum-exps they report, `check` clean with them on every decode
//! variant the device runs (the fast vs reference comparison included), and the wrapper's fault
//! caught around them. Ignored by default (CI has no GPU); `tools/gpu_check.sh` runs them with
//! `--include-ignored` on the H200, where a missing GPU fails them.

mod common;

use common::*;
use mladb::debug::detect::{check, CheckOptions, CheckReport};
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

/// A model, a prompt of `len` tokens prefilled whole, and `decode` steps, over every layer.
struct Case {
    model: Model,
    schedule: Schedule,
    layers: std::ops::Range<usize>,
}

impl Case {
    fn new(model: Model, len: usize, decode: usize) -> Case {
        Case {
            schedule: Schedule {
                prompt: prompt(model.layout.vocab_size, len),
                prefill_len: len,
                decode_steps: decode,
            },
            layers: 0..model.layout.num_layers,
            model,
        }
    }

    /// The job `check` and the runs take, with poisoned buffers.
    fn job<'a>(&'a self, backend: &'a dyn mladb::backend::Backend) -> Job<'a> {
        Job {
            model: &self.model,
            backend,
            schedule: &self.schedule,
            layers: &self.layers,
            poison: true,
        }
    }
}

/// `check` on `flags` with the default options.
fn check_default(j: &Job, flags: Flags) -> CheckReport {
    let options = CheckOptions {
        tolerance: None,
        reference: None,
    };
    check(j, flags, &options).unwrap()
}

/// `check` with one fault injected (a spec such as `skip-padded-rows@decode`).
fn check_injected(j: &Job, fault: &str) -> CheckReport {
    let mut flags = gpu_flags();
    flags.set("inject", fault).unwrap();
    check_default(j, flags)
}

/// `check` on `flags`, which must find nothing and must have compared the fast kernels with the
/// reference: its note counts the ops compared, none skipped and none that could not be.
fn check_clean(j: &Job, flags: Flags, what: &str) -> CheckReport {
    let report = check_default(j, flags);
    assert!(
        report.findings.is_empty(),
        "{what}: a clean bf16 run has findings: {:#?}\nnotes: {:#?}",
        report.findings,
        report.notes
    );
    let compared = report
        .notes
        .iter()
        .find_map(|n| n.strip_prefix("fast vs reference kernels: "))
        .and_then(|n| n.strip_suffix(" ops compared"))
        .and_then(|n| n.parse::<usize>().ok());
    assert!(
        compared.is_some_and(|n| n > 0),
        "{what}: {:?}",
        report.notes
    );
    report
}

/// What ran the first latent attention of `phase` (layer 0's).
fn latent_kernel(run: &RunRecord, phase: Phase) -> mladb::ops::KernelInfo {
    run.events
        .iter()
        .find(|e| e.kind == OpKind::AttentionLatent && e.phase == phase)
        .and_then(|e| e.kernel.clone())
        .unwrap_or_else(|| panic!("no latent attention of {phase} ran a kernel"))
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
    let case = Case::new(model, 300, 2);
    let j = case.job(&gpu);
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
    assert_eq!(partials.shape, vec![1, splits, 8, 512]);
    let partial_lse = event(&fast, Phase::Decode(0), "attn_partials_lse");
    assert_eq!(partial_lse.shape, vec![1, splits, 8]);
    assert_eq!(partial_lse.stats.unwritten + partial_lse.stats.nan, 0);
    assert_eq!(partials.stats.unwritten, 0);
    assert_eq!(partials.stats.nan + partials.stats.pos_inf, 0);
    // The merge: its own launch, and the buffer it wrote is the one the wrapper returns.
    let merge = event(&fast, Phase::Decode(0), "attn_merge");
    let merge_info = merge.kernel.as_ref().unwrap();
    assert_eq!(merge_info.launches.len(), 1, "{merge_info}");
    assert!(merge_info.launches[0]
        .kernel
        .starts_with("mla_decode_combine"));
    assert_eq!(merge.shape, decode.shape);
    assert_eq!(merge.output.id, decode.output.id);
    assert_eq!(merge.stats.unwritten, 0);
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

    // The seed's bug in the fast decode: the merge writes a phantom buffer, fully and right;
    // the wrapper returns its own, unwritten, and that is what the next op reads.
    let mut disconnected = gpu_flags();
    disconnected
        .set("inject", "output-buffer-disconnect@decode")
        .unwrap();
    let broken = j.run(disconnected, None).unwrap();
    let merge = event(&broken, Phase::Decode(0), "attn_merge");
    let latent = event(&broken, Phase::Decode(0), "attn_latent");
    assert_eq!(merge.stats.unwritten, 0);
    assert_eq!(latent.stats.unwritten, latent.stats.count);
    assert_eq!(latent.kernel_wrote.unwrap().id, merge.output.id);
    assert_ne!(latent.output.id, merge.output.id);
    let merged = |run: &RunRecord| {
        let name = "model.layers.0.self_attn.attn_merge";
        run.output(Phase::Decode(0), name).unwrap().data().to_vec()
    };
    assert_eq!(
        merged(&broken),
        merged(&fast),
        "the phantom holds the right answer"
    );

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
    let case = Case::new(model, 140, 2);
    let j = case.job(&gpu);
    let variants = mladb::backend::cuda::fast::decode_variants_for(gpu.gpu());
    assert!(!variants.is_empty(), "no decode variant runs on this GPU");
    for kernel in variants {
        let mut flags = gpu_flags();
        flags.kernels.decode = Some(kernel.parse::<DecodeVariant>().unwrap());
        let report = check_clean(&j, flags, kernel);
        let decoded = latent_kernel(&report.run, Phase::Decode(0));
        assert_eq!(decoded.launches[0].kernel, kernel, "{decoded}");
        eprintln!("{kernel}: clean; {decoded}");
    }
}

/// The faults that live in the fast kernels (the merge's two, the exp2 scale) and around them
/// (the wrapper's output buffer) act there and are caught: each finding's op ran a fast kernel,
/// by the detector that can see it.
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn faults_in_the_fast_kernels_are_caught_where_they_act() {
    let gpu = cuda_backend(StorageDtype::Bf16);
    let model = synthetic("glm5-rank8", 4);
    let case = Case::new(model, 140, 2);
    let j = case.job(&gpu);
    // The disconnect in both phases (its default) shows first at the flash prefill's wrapper; in
    // decode alone, at the tensor-core decode's.
    for (fault, kind, phase) in [
        (
            "output-buffer-disconnect",
            "buffer-disconnect",
            Phase::Prefill,
        ),
        (
            "output-buffer-disconnect@decode",
            "buffer-disconnect",
            Phase::Decode(0),
        ),
        (
            "lse-base-mismatch@decode",
            "absorbed-naive-mismatch",
            Phase::Decode(0),
        ),
        ("skip-padded-rows", "unwritten", Phase::Decode(0)),
        ("exp2-scale", "kernel-mismatch", Phase::Prefill),
    ] {
        let report = check_injected(&j, fault);
        let found = report
            .findings
            .iter()
            .find(|f| f.kind.to_string() == kind)
            .unwrap_or_else(|| panic!("{fault}: no {kind}: {:#?}", report.findings));
        assert_eq!(found.phase, phase, "{fault}: {found:?}");
        // The op it names, or the attention op before it, ran a fast kernel.
        let ran_fast = report.run.events[..=found.index]
            .iter()
            .rev()
            .find_map(|e| e.kernel.clone())
            .unwrap_or_else(|| panic!("{fault}: no attention op before {}", found.op));
        assert!(!ran_fast.launches.is_empty(), "{fault}: {ran_fast}");
        if kind == "buffer-disconnect" {
            let e = &report.run.events[found.index];
            assert_ne!(e.kernel_wrote.unwrap().id, e.output.id);
        }
        if fault.starts_with("lse") || fault.starts_with("skip") {
            assert!(
                ran_fast.launches.len() == 2,
                "{fault}: the merge ran: {ran_fast}"
            );
        }
        // The decode step's batch of 1 padded to 2 under it: the padded row left unwritten,
        // the real one whole.
        if fault.starts_with("skip") {
            let e = &report.run.events[found.index];
            assert!(e.name.ends_with("self_attn.attn_padding"), "{found:?}");
            assert_eq!(e.shape, vec![1, 8, 512]);
            assert_eq!(e.stats.unwritten, e.stats.count, "{found:?}");
            let latent = event(&report.run, Phase::Decode(0), "attn_latent");
            assert_eq!(latent.stats.unwritten, 0);
        }
        eprintln!(
            "{fault}: {kind} at {} {} ({ran_fast})",
            found.phase, found.op
        );
    }
}

/// An absorbed prefill of 3 tokens runs as a CUDA-graph batch of 4 (one padded sequence of no
/// keys): its row is reported as `attn_padding`, all zeros, and `check` stays clean; likewise
/// over an FP8 cache and through the sparse decode (300 queries padded to 304). Decode steps
/// (a batch of 1) pad nothing.
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn a_padded_batch_reports_its_zero_rows_and_check_is_clean() {
    let gpu = cuda_backend(StorageDtype::Bf16);
    let mut sparse = synthetic("glm5-rank8", 12);
    sparse.layout.indexer.as_mut().unwrap().topk = 100;
    let cases = [
        (Case::new(synthetic("glm5-rank8", 12), 3, 2), false, 1),
        (Case::new(synthetic("glm5-rank8", 12), 3, 2), true, 1),
        (Case::new(sparse, 300, 1), false, 4),
    ];
    for (case, fp8, pad) in cases {
        let j = case.job(&gpu);
        let mut flags = gpu_flags();
        flags.prefill_path = mladb::engine::MlaPath::Absorbed;
        if fp8 {
            flags.kv_cache = mladb::ops::KvCacheDtype::Fp8DsMla;
        }
        let what = format!("{} tokens, fp8 {fp8}", case.schedule.prompt.len());
        let report = check_clean(&j, flags, &what);
        let padding = event(&report.run, Phase::Prefill, "attn_padding");
        assert_eq!(padding.shape, vec![pad, 8, 512], "{what}");
        assert_eq!(padding.stats.zeros, padding.stats.count, "{what}");
        let info = padding.kernel.clone().unwrap();
        assert!(
            info.launches[0].kernel.starts_with("mla_"),
            "{what}: {info}"
        );
        assert!(
            !report
                .run
                .events
                .iter()
                .any(|e| e.kind == OpKind::AttentionPadding && e.phase != Phase::Prefill),
            "{what}: a decode batch of 1 pads nothing"
        );
        eprintln!("{what}: {pad} padded rows of zeros; {info}");
    }
}

/// DeepSeek-V3's head dims (prefill 192/128) and a rank's 16 heads: check is clean on the fast
/// kernels, and kv-stride-mismatch (values stepped by the keys' row width in the flash prefill)
/// is caught there by the fast vs reference comparison; on GLM-5's 256/256 it is idle.
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn deepseek_dims_are_clean_and_a_value_stride_drift_is_caught() {
    let gpu = cuda_backend(StorageDtype::Bf16);
    let model = synthetic("deepseek-v3-rank16", 6);
    let case = Case::new(model, 150, 2);
    let j = case.job(&gpu);
    let report = check_clean(&j, gpu_flags(), "deepseek-v3-rank16");
    let prefill = event(&report.run, Phase::Prefill, "attn_output");
    let info = prefill.kernel.clone().unwrap();
    assert!(info.launches[0].kernel.ends_with("_d192"), "{info}");

    let report = check_injected(&j, "kv-stride-mismatch");
    let first = report
        .findings
        .first()
        .expect("kv-stride-mismatch not caught");
    // At the prefill's output, by the fast vs reference comparison (and by absorbed vs naive,
    // whose naive side is the drifting prefill).
    assert_eq!(first.phase, Phase::Prefill, "{first:?}");
    assert!(first.op.ends_with("self_attn.attn_output"), "{first:?}");
    assert!(
        report
            .findings
            .iter()
            .any(|f| f.kind.to_string() == "kernel-mismatch" && f.index == first.index),
        "{:#?}",
        report.findings
    );

    let case = Case::new(synthetic("glm5-rank8", 6), 150, 2);
    let j = case.job(&gpu);
    let report = check_injected(&j, "kv-stride-mismatch");
    assert!(report.findings.is_empty(), "{:#?}", report.findings);
    assert!(
        report
            .notes
            .iter()
            .any(|n| n.contains("kv-stride-mismatch") && n.contains("256/256")),
        "{:?}",
        report.notes
    );
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn check_is_clean_on_an_fp8_cache_with_every_fp8_decode_variant() {
    let gpu = cuda_backend(StorageDtype::Bf16);
    let model = synthetic("glm5-rank8", 11);
    // 140 tokens: each decode step's context spans three pages, split several ways.
    let case = Case::new(model, 140, 2);
    let j = case.job(&gpu);
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
        let report = check_default(&j, flags);
        assert!(
            report.findings.is_empty(),
            "{variant:?}: a clean fp8 run has findings: {:#?}\nnotes: {:#?}",
            report.findings,
            report.notes
        );
        let decoded = latent_kernel(&report.run, Phase::Decode(0));
        let kernel = &decoded.launches[0].kernel;
        assert!(
            kernel.starts_with("mla_decode_") && kernel.contains("fp8"),
            "{decoded}"
        );
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
    let case = Case::new(synthetic("glm5-rank8", 3), 6, 1);
    let cpu = mladb::backend::cpu::CpuBackend;
    let run = case.job(&cpu).run(Flags::default(), None).unwrap();
    assert!(run.events.iter().all(|e| e.kernel.is_none()));
    assert!(run.events.iter().any(|e| e.kind == OpKind::AttentionProbs));
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn a_sparse_selection_runs_the_sparse_decode_and_check_is_clean() {
    let gpu = cuda_backend(StorageDtype::Bf16);
    let mut model = synthetic("glm5-rank8", 11);
    // An index_topk of 100 makes a 300-token context sparse without a 2048-token prompt.
    model.layout.indexer.as_mut().unwrap().topk = 100;
    let case = Case::new(model, 300, 2);
    let j = case.job(&gpu);
    let variants = mladb::backend::cuda::fast::sparse_decode_variants_for(gpu.gpu());
    assert!(!variants.is_empty(), "no sparse decode variant runs here");
    for sparse in variants {
        // The flag names the dense twin; the sparse selection runs its sparse kernel.
        let dense = sparse.replace("mla_sparse_", "mla_decode_");
        let mut flags = gpu_flags();
        flags.kernels.decode = Some(dense.parse::<DecodeVariant>().unwrap());
        let report = check_clean(&j, flags, sparse);
        let decoded = latent_kernel(&report.run, Phase::Decode(0));
        assert_eq!(decoded.launches[0].kernel, sparse, "{decoded}");
        assert!(decoded.reference.is_none(), "{decoded}");
        // The naive prefill declines the sparse selection and says so.
        let prefill = event(&report.run, Phase::Prefill, "attn_output");
        let info = prefill.kernel.as_ref().unwrap();
        assert!(
            info.reference
                .as_deref()
                .is_some_and(|why| why.contains("sparse prefill")),
            "{info}"
        );
        eprintln!("{sparse}: clean; {decoded}");
    }
    // Over an fp8_ds_mla cache the sparse selection runs the sparse FP8 kernels (the device's
    // choice, then each forced by its variant's tag: h8, h16, wgmma).
    let fp8 = mladb::backend::cuda::fast::sparse_fp8_decode_variants_for(gpu.gpu());
    assert!(
        !fp8.is_empty(),
        "no sparse FP8-cache decode variant runs here"
    );
    let forced = fp8.iter().map(|&v| Some(v));
    for variant in std::iter::once(None).chain(forced) {
        let mut flags = gpu_flags();
        flags.kv_cache = mladb::ops::KvCacheDtype::Fp8DsMla;
        flags.kernels.decode = variant.map(|v| v.parse::<DecodeVariant>().unwrap());
        let report = check_default(&j, flags);
        assert!(
            report.findings.is_empty(),
            "{variant:?}: a clean sparse fp8 run has findings: {:#?}",
            report.findings
        );
        let decoded = latent_kernel(&report.run, Phase::Decode(0));
        let kernel = &decoded.launches[0].kernel;
        assert!(
            kernel.starts_with("mla_sparse_") && kernel.contains("fp8"),
            "{decoded}"
        );
        if let Some(v) = variant {
            assert_eq!(kernel, v, "{decoded}");
        }
        eprintln!("fp8 {variant:?}: clean; {decoded}");
    }
}

/// GLM-5's real index_topk (2048), not a lowered one: a 2046-token prompt whose decode steps
/// cross it (step s attends over 2047 + s keys: steps 0 and 1 are dense, and from step 2 on
/// the indexer picks 2048 of more keys). `check` stays clean over the bf16 and the fp8_ds_mla
/// cache, and the decode runs the sparse kernels once the context passes the top-k.
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn check_is_clean_across_the_real_index_topk() {
    let gpu = cuda_backend(StorageDtype::Bf16);
    let model = synthetic("glm5-rank8", 13);
    assert_eq!(model.layout.indexer.as_ref().unwrap().topk, 2048);
    let case = Case::new(model, 2046, 6);
    let j = case.job(&gpu);
    for kv_cache in [
        mladb::ops::KvCacheDtype::Bf16,
        mladb::ops::KvCacheDtype::Fp8DsMla,
    ] {
        let mut flags = gpu_flags();
        flags.kv_cache = kv_cache;
        let report = check_clean(&j, flags, &format!("{kv_cache:?} cache"));
        let (dense, sparse) = (
            latent_kernel(&report.run, Phase::Decode(1)),
            latent_kernel(&report.run, Phase::Decode(5)),
        );
        assert!(
            dense.reference.is_none() && !dense.launches[0].kernel.starts_with("mla_sparse_"),
            "{kv_cache:?}, 2048 keys: {dense}"
        );
        assert!(
            sparse.reference.is_none() && sparse.launches[0].kernel.starts_with("mla_sparse_"),
            "{kv_cache:?}, 2052 keys: {sparse}"
        );
        eprintln!("{kv_cache:?}: clean; 2048 keys {dense}; 2052 keys {sparse}");
    }
}

/// page-index-overflow, at the kernel: every decode variant reads pages placed past the first
/// 4 GiB of a pool exactly as it reads them at the bottom (its offsets are 64-bit); each planted
/// kernel reads the bottom pages exactly as its unplanted twin, wraps past 4 GiB and gives
/// another answer there, and is refused a pool of at most 4 GiB, where its wrapped offsets could
/// fall outside.
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn decode_pages_past_4_gib_read_alike_and_the_planted_wrap_differs() {
    use mladb::backend::cuda::device::{Elem, Gpu};
    use mladb::backend::cuda::fast::{self, DecodeShape, DecodeWork, LATENT, PAGE, ROPE};
    let backend = cuda_backend(StorageDtype::Bf16);
    let gpu: &Gpu = backend.gpu();
    let (width, heads, lens) = (LATENT + ROPE, 8, [200usize, 70]);
    let mut rng = Lcg::new(41);
    let pages = 6;
    let cache: Vec<f32> = (0..pages * PAGE * width)
        .map(|_| rng.next_f32() * 2.0 - 1.0)
        .collect();
    let q: Vec<f32> = (0..lens.len() * heads * width)
        .map(|_| rng.next_f32() * 2.0 - 1.0)
        .collect();
    // Sequence 0 on pages 3, 0, 5, 1; sequence 1 on 4, 2.
    let table = [3usize, 0, 5, 1, 4, 2, 0, 0];
    let shape = DecodeShape {
        batch: 2,
        heads,
        max_pages: 4,
        max_len: 200,
    };
    let low = gpu.upload(&cache, Elem::Bf16).unwrap();
    let at = fast::OVERFLOW_PAGE * PAGE * width;
    let mut high = gpu.alloc(at + cache.len(), Elem::Bf16).unwrap();
    gpu.fill(&high, false).unwrap();
    gpu.write(&mut high, at, &cache).unwrap();
    // The same pages also at the bottom of the big pool, where nothing wraps.
    gpu.write(&mut high, 0, &cache).unwrap();
    let q = gpu.upload(&q, Elem::Bf16).unwrap();
    let lens_dev = gpu.upload_i32(&lens.map(|l| l as i32)).unwrap();
    let table_at = |shift: usize| {
        let rows: Vec<i32> = table.iter().map(|&p| (p + shift) as i32).collect();
        gpu.upload_i32(&rows).unwrap()
    };
    let (table_low, table_high) = (table_at(0), table_at(fast::OVERFLOW_PAGE));
    let run = |pool, bt, work: &DecodeWork| {
        let out = gpu.alloc(2 * heads * LATENT, Elem::Bf16).unwrap();
        let lse = gpu.alloc(2 * heads, Elem::F32).unwrap();
        let launched =
            fast::mla_decode(gpu, shape, &q, pool, bt, &lens_dev, 0.05, &out, &lse, work);
        launched.map(|_| gpu.download(&out).unwrap())
    };
    let mut reference = None;
    for kernel in fast::decode_variants_for(gpu) {
        let work = DecodeWork::with_variant(gpu, shape, 3, Some(kernel)).unwrap();
        let below = run(&low, &table_low, &work).unwrap();
        let above = run(&high, &table_high, &work).unwrap();
        assert!(
            below == above,
            "{kernel}: pages past 4 GiB read differently from the same pages at the bottom"
        );
        reference.get_or_insert(below);
    }
    let reference = reference.expect("no decode variant runs on this GPU");
    // Every planted kernel (ks3's, and t16's that 99 KB devices get), forced: below 4 GiB it is
    // its unplanted twin exactly, past 4 GiB it reads elsewhere, and a small pool is refused.
    for kernel in fast::PLANTED_DECODE {
        let planted = fast::planted_decode_work(gpu, shape, Some(3), Some(kernel)).unwrap();
        let twin = kernel.trim_end_matches("_o32");
        let unplanted = DecodeWork::with_variant(gpu, shape, 3, Some(twin)).unwrap();
        assert_eq!(
            run(&high, &table_low, &planted).unwrap(),
            run(&low, &table_low, &unplanted).unwrap(),
            "{kernel}: pages below 4 GiB read differently from {twin}"
        );
        let wrapped = run(&high, &table_high, &planted).unwrap();
        let diff = wrapped
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(diff > 0.05, "{kernel}: the wrap changed nothing ({diff})");
        let refused = run(&low, &table_low, &planted).unwrap_err().to_string();
        assert!(refused.contains("page-index-overflow"), "{refused}");
        eprintln!("{kernel}: wrapped past 4 GiB, off by up to {diff}");
    }
}

/// page-index-overflow in the traced path: `check` catches it at the decode's attention by the
/// fast vs reference comparison, on the planted kernel; on the CPU it is idle, with the reason.
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn page_index_overflow_is_caught_by_the_fast_vs_reference_comparison() {
    let gpu = cuda_backend(StorageDtype::Bf16);
    let case = Case::new(synthetic("glm5-rank8", 4), 100, 2);
    let j = case.job(&gpu);
    let report = check_injected(&j, "page-index-overflow");
    let found = report
        .findings
        .iter()
        .find(|f| f.kind.to_string() == "kernel-mismatch")
        .unwrap_or_else(|| panic!("page-index-overflow not caught: {:#?}", report.findings));
    assert_eq!(found.phase, Phase::Decode(0), "{found:?}");
    let info = report.run.events[found.index].kernel.clone().unwrap();
    assert!(
        info.launches.iter().any(|l| l.kernel.ends_with("_o32")),
        "{}: {info}",
        found.op
    );
    eprintln!(
        "page-index-overflow: kernel-mismatch at {} ({info})",
        found.op
    );
}
