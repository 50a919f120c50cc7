//! The report of flags and faults that had nothing to act on, checked against what the runs did:
//! a flag reported idle leaves every op's output bit for bit as it is without it, and a flag
//! not reported changes some op. Every fault of the catalogue appears, idle and acting.

mod common;

use mladb::backend::cpu::CpuBackend;
use mladb::cli::args::schedule_with_defaults;
use mladb::debug::idle::{idle_flags, KvBStorage, Subject};
use mladb::debug::runner::Job;
use mladb::debug::{Flags, RunRecord};
use mladb::engine::faults::Fault;
use mladb::engine::generate::Schedule;
use mladb::gguf::GgmlType;
use mladb::model::{Layout, Model};

fn model(layout: &str, quant: Option<GgmlType>) -> Model {
    Model::synthetic_quantized(Layout::resolve(layout).unwrap(), 3, quant, common::BUDGET).unwrap()
}

fn run(model: &Model, schedule: &Schedule, flags: Flags) -> RunRecord {
    let layers = 0..model.layout.num_layers;
    let job = Job {
        model,
        backend: &CpuBackend,
        schedule,
        layers: &layers,
        poison: true,
    };
    job.run(flags, None).unwrap()
}

fn identical(a: &RunRecord, b: &RunRecord) -> bool {
    a.len() == b.len()
        && a.events
            .iter()
            .zip(&b.events)
            .all(|(x, y)| (x.phase, &x.name) == (y.phase, &y.name))
        && a.outputs.iter().zip(&b.outputs).all(|(x, y)| {
            let (x, y) = (x.data(), y.data());
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
        })
}

/// Runs `flags` and the same flags without `subject`, and checks the idle report against them:
/// idle exactly when the two runs are the same. Returns the reason given, if idle.
fn verdict(model: &Model, schedule: &Schedule, text: &str, subject: Subject) -> Option<String> {
    let flags = Flags::parse(text).unwrap();
    let mut without = flags;
    match subject {
        Subject::MlaDisable => without.mla_disable = false,
        Subject::PrefillPath => without.prefill_path = Flags::default().prefill_path,
        Subject::DecodePath => without.decode_path = Flags::default().decode_path,
        Subject::ForceDequant => without.force_dequant = false,
        Subject::Fault(f) => without.faults = without.faults.without(f),
    }
    let with_it = run(model, schedule, flags);
    let kv_b = KvBStorage::of(model, &(0..model.layout.num_layers)).unwrap();
    let idle = idle_flags(&flags, &kv_b, &with_it.events, true);
    let why = idle
        .iter()
        .find(|i| i.subject == subject)
        .map(|i| i.why.clone());
    let same = identical(&with_it, &run(model, schedule, without));
    assert_eq!(
        why.is_some(),
        same,
        "{text} on {} {schedule:?}: reported {}, and the run {} the run without it",
        model.layout.name,
        match &why {
            Some(w) => format!("idle ({w})"),
            None => "acting".to_string(),
        },
        if same { "equals" } else { "differs from" }
    );
    why
}

fn schedule(prompt: usize, prefill: usize, decode: usize) -> Schedule {
    Schedule {
        prompt: common::prompt(2048, prompt),
        prefill_len: prefill,
        decode_steps: decode,
    }
}

#[test]
fn every_fault_acts_in_the_default_schedule_and_idles_where_it_cannot() {
    let tiny = model("glm5-tiny", None);
    let default = schedule_with_defaults(&tiny.layout, None, None, None);
    let no_decode = schedule(12, 12, 0);
    let short = schedule(3, 3, 2);
    let fault = |f| Subject::Fault(f);

    for f in Fault::ALL {
        let why = verdict(&tiny, &default, &format!("inject={}", f.name()), fault(f));
        if f == Fault::Q4kScaleUnpack {
            assert!(why.unwrap().contains("not Q4_K"));
        } else if [
            Fault::Exp2Scale,
            Fault::KvStrideMismatch,
            Fault::PageIndexOverflow,
        ]
        .contains(&f)
        {
            assert!(why.unwrap().contains("fast GPU"), "{}", f.name());
        } else if f == Fault::YarnMscale {
            assert!(why.unwrap().contains("YaRN"));
        } else if f.needs_fp8_cache() {
            // glm5-tiny's latent rows do not fit fp8_ds_mla; the cache is bf16.
            assert!(why.unwrap().contains("--kv-cache-dtype fp8_ds_mla"));
        } else if f.needs_tp() {
            assert!(why.unwrap().contains("--tp 2 or more"), "{}", f.name());
        } else {
            assert!(why.is_none(), "{} acts by default", f.name());
        }
    }
    // Faults of decode without decode steps.
    for spec in [
        "skip-padded-rows",
        "kv-cache-off-by-one",
        "output-buffer-disconnect@decode",
        "softmax-scale-latent@decode",
        "rope-noninterleaved@decode",
    ] {
        let f = spec.split('@').next().unwrap().parse().unwrap();
        let why = verdict(&tiny, &no_decode, &format!("inject={spec}"), fault(f)).unwrap();
        assert!(why.contains("no decode steps"), "{spec}: {why}");
    }
    // Faults of the absorbed path with MLA disabled, and of the MLA backend routed around.
    for f in [
        Fault::SoftmaxScaleLatent,
        Fault::AbsorbWrongSplit,
        Fault::LseBaseMismatch,
        Fault::OutputBufferDisconnect,
        Fault::SkipPaddedRows,
    ] {
        let text = format!("mla-disable, inject={}", f.name());
        assert!(
            verdict(&tiny, &default, &text, fault(f)).is_some(),
            "{text}"
        );
    }
    // The absorbed path only in decode, and no decode.
    let why = verdict(
        &tiny,
        &no_decode,
        "inject=softmax-scale-latent",
        fault(Fault::SoftmaxScaleLatent),
    );
    assert!(why.unwrap().contains("absorbed"));
    // No context spans two split-KV blocks; then one does.
    let why = verdict(
        &tiny,
        &short,
        "inject=lse-base-mismatch",
        fault(Fault::LseBaseMismatch),
    );
    assert!(why.unwrap().contains("two split-KV blocks"));
    assert!(verdict(
        &tiny,
        &schedule(9, 9, 1),
        "inject=lse-base-mismatch",
        fault(Fault::LseBaseMismatch)
    )
    .is_none());
    // One slot early from position 0 is position 0.
    let why = verdict(
        &tiny,
        &schedule(1, 1, 0),
        "inject=kv-cache-off-by-one@prefill",
        fault(Fault::KvCacheOffByOne),
    );
    assert!(why.unwrap().contains("position 0"));
    // Written one slot early, but only naive attention ran, which reads its own cache.
    let why = verdict(
        &tiny,
        &schedule(3, 3, 0),
        "inject=kv-cache-off-by-one@prefill",
        fault(Fault::KvCacheOffByOne),
    );
    assert!(why.unwrap().contains("no op read the latent cache"));
    let why = verdict(
        &tiny,
        &default,
        "mla-disable, inject=kv-cache-off-by-one",
        fault(Fault::KvCacheOffByOne),
    );
    assert!(why.unwrap().contains("no op read the latent cache"));
    assert!(verdict(
        &tiny,
        &schedule(3, 3, 1),
        "inject=kv-cache-off-by-one@prefill",
        fault(Fault::KvCacheOffByOne)
    )
    .is_none());
    // The absorbed path over a single key: any softmax scale gives 1.
    let why = verdict(
        &tiny,
        &schedule(1, 0, 0),
        "inject=softmax-scale-latent",
        fault(Fault::SoftmaxScaleLatent),
    );
    assert!(why.unwrap().contains("single key"));
    // A prefill-only fault with nothing prefilled.
    let why = verdict(
        &tiny,
        &schedule(3, 0, 1),
        "inject=rope-noninterleaved@prefill",
        fault(Fault::RopeNoninterleaved),
    );
    assert!(why.unwrap().contains("prefilled nothing"));
}

#[test]
fn flags_idle_where_nothing_differs() {
    let tiny = model("glm5-tiny", None);
    let default = schedule_with_defaults(&tiny.layout, None, None, None);
    let no_decode = schedule(12, 12, 0);
    // MLA disable turns only absorbed decode naive: nothing to do without decode steps.
    assert!(verdict(&tiny, &default, "mla-disable", Subject::MlaDisable).is_none());
    let why = verdict(&tiny, &no_decode, "mla-disable", Subject::MlaDisable).unwrap();
    assert!(why.contains("no decode steps"), "{why}");
    assert!(verdict(
        &tiny,
        &default,
        "mla-disable, decode-path=naive",
        Subject::MlaDisable
    )
    .is_some());
    // ... but it does keep the MLA backend's faults out of prefill.
    assert!(verdict(
        &tiny,
        &no_decode,
        "mla-disable, inject=output-buffer-disconnect",
        Subject::MlaDisable
    )
    .is_none());
    assert!(verdict(&tiny, &default, "decode-path=naive", Subject::DecodePath).is_none());
    assert!(verdict(&tiny, &no_decode, "decode-path=naive", Subject::DecodePath).is_some());
    assert!(verdict(
        &tiny,
        &default,
        "prefill-path=absorbed",
        Subject::PrefillPath
    )
    .is_none());
    assert!(verdict(
        &tiny,
        &schedule(3, 0, 1),
        "prefill-path=absorbed",
        Subject::PrefillPath
    )
    .is_some());
    let why = verdict(&tiny, &default, "force-dequant", Subject::ForceDequant).unwrap();
    assert!(why.contains("not quantized"), "{why}");
    // Across schedules, with the faults MLA disable routes around.
    for s in [
        default,
        no_decode,
        schedule(3, 3, 2),
        schedule(1, 0, 0),
        schedule(3, 0, 2),
    ] {
        for others in [
            "",
            "inject=output-buffer-disconnect@prefill",
            "inject=skip-padded-rows",
            "decode-path=naive",
        ] {
            verdict(
                &tiny,
                &s,
                &format!("mla-disable, {others}"),
                Subject::MlaDisable,
            );
        }
        verdict(&tiny, &s, "prefill-path=absorbed", Subject::PrefillPath);
        verdict(&tiny, &s, "decode-path=naive", Subject::DecodePath);
    }
}

#[test]
fn quantized_kv_b_faults_and_flags_follow_the_storage_type() {
    let wide_q4k = model("glm5-tiny-wide", Some(GgmlType::Q4_K));
    let default = schedule_with_defaults(&wide_q4k.layout, None, None, None);
    let q4k = Subject::Fault(Fault::Q4kScaleUnpack);
    assert!(verdict(&wide_q4k, &default, "inject=q4k-scale-unpack", q4k).is_none());
    assert!(verdict(&wide_q4k, &default, "force-dequant", Subject::ForceDequant).is_none());
    // Force-dequantized once, in prefill: decode uses the plain weight, so a decode-only
    // unpacking fault has no block decoding left to corrupt.
    let why = verdict(
        &wide_q4k,
        &default,
        "force-dequant, inject=q4k-scale-unpack@decode",
        q4k,
    );
    assert!(why.unwrap().contains("no op decoded"));
    // Without force-dequantize, decode's absorbed path decodes the blocks itself.
    assert!(verdict(&wide_q4k, &default, "inject=q4k-scale-unpack@decode", q4k).is_none());
    // glm5-tiny's kv_b_proj rows are not whole Q4_K super-blocks: they fall back to Q4_0.
    let tiny_q4k = model("glm5-tiny", Some(GgmlType::Q4_K));
    let why = verdict(&tiny_q4k, &default, "inject=q4k-scale-unpack", q4k).unwrap();
    assert!(why.contains("Q4_0"), "{why}");
}

/// Every fault in every scope, over schedules with and without prefill, decode steps and long
/// contexts, and over both paths and MLA disable: reported idle exactly when the run equals
/// the run without it.
#[test]
fn idle_exactly_when_nothing_differs_across_schedules_paths_and_scopes() {
    let tiny = model("glm5-tiny", None);
    let kv_b = KvBStorage::of(&tiny, &(0..tiny.layout.num_layers)).unwrap();
    let schedules = [
        schedule_with_defaults(&tiny.layout, None, None, None),
        schedule(12, 12, 0),
        schedule(3, 3, 2),
        schedule(1, 0, 0),
        schedule(3, 0, 2),
    ];
    let mut checked = 0;
    for s in &schedules {
        for base in [
            "",
            "mla-disable",
            "prefill-path=absorbed, decode-path=naive",
            "tp=2",
        ] {
            let clean = run(&tiny, s, Flags::parse(base).unwrap());
            for f in Fault::ALL
                .into_iter()
                .filter(|f| *f != Fault::Q4kScaleUnpack)
            {
                for scope in ["", "@prefill", "@decode"] {
                    let text = format!("{base}, inject={}{scope}", f.name());
                    let flags = Flags::parse(&text).unwrap();
                    let with_it = run(&tiny, s, flags);
                    let idle = idle_flags(&flags, &kv_b, &with_it.events, true)
                        .into_iter()
                        .find(|i| i.subject == Subject::Fault(f));
                    assert_eq!(
                        idle.is_some(),
                        identical(&with_it, &clean),
                        "{text} on {s:?}: reported {idle:?}"
                    );
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 5 * 4 * (Fault::ALL.len() - 1) * 3);
}

/// yarn-mscale takes YaRN's `mscale` where `mscale_all_dim` belongs: idle without YaRN and
/// where the two are equal (deepseek-v3-tiny, as DeepSeek-V3 itself), acting where they differ.
#[test]
fn yarn_mscale_acts_only_where_the_two_mscales_differ() {
    let s = schedule(8, 6, 2);
    let fault = Subject::Fault(Fault::YarnMscale);
    let why = verdict(&model("glm5-tiny", None), &s, "inject=yarn-mscale", fault).unwrap();
    assert!(why.contains("YaRN"), "{why}");
    let equal = model("deepseek-v3-tiny", None);
    let why = verdict(&equal, &s, "inject=yarn-mscale", fault).unwrap();
    assert!(why.contains("equal"), "{why}");
    let mut layout = Layout::resolve("deepseek-v3-tiny").unwrap();
    if let mladb::model::layout::RopeScaling::Yarn { mscale, .. } = &mut layout.rope.scaling {
        *mscale = Some(0.707);
    }
    let differ = Model::synthetic_quantized(layout, 3, None, common::BUDGET).unwrap();
    assert_eq!(verdict(&differ, &s, "inject=yarn-mscale", fault), None);
}
