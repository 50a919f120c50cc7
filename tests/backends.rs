//! Every op of the Backend trait, written once and run on every backend: the CPU always (in
//! CI), CUDA in f32 and in bf16 as `NAME::gpu` tests, ignored where there is no GPU (cargo
//! counts them; `tools/gpu_check.sh` runs them with `--include-ignored`). Each is compared with
//! the CPU reference on fresh random inputs at the tolerance of its precision (mla.md: f32 1e-5
//! per op; bf16 storage 1e-3..1e-2), with every output buffer poisoned first so that an element
//! a kernel leaves unwritten fails the test.

mod common;

use mladb::backend::cpu::CpuBackend;
use mladb::backend::{AttnMask, AttnParams, Backend, KvbSplit, MlaDims};
use mladb::engine::cache::{LatentCache, RowCache};
use mladb::engine::faults::KernelFaults;
use mladb::engine::rope::RopeTable;
use mladb::engine::StorageDtype;
use mladb::model::layout::{MoeLayout, RopeLayout, RopeScaling};
use mladb::model::weights::synthetic::{normalish, tensor_key};
use mladb::tensor::Tensor;

/// A backend under test and the relative L2 error allowed against the CPU reference.
struct Under {
    name: &'static str,
    backend: Box<dyn Backend>,
    tolerance: f64,
}

/// The CPU reference alone, or the CUDA backends in f32 and bf16 (a GPU required).
fn backends(gpu: bool) -> Vec<Under> {
    if !gpu {
        return vec![Under {
            name: "cpu",
            backend: Box::new(CpuBackend),
            tolerance: 0.0,
        }];
    }
    [
        ("cuda-f32", StorageDtype::F32, 2e-5),
        ("cuda-bf16", StorageDtype::Bf16, 2e-2),
    ]
    .into_iter()
    .map(|(name, storage, tolerance)| {
        let b = common::cuda_backend(storage);
        b.set_poison_outputs(true);
        Under {
            name,
            backend: Box::new(b),
            tolerance,
        }
    })
    .collect()
}

fn random(shape: &[usize], name: &str, scale: f32) -> Tensor {
    let key = tensor_key(common::seed(), name);
    let n: usize = shape.iter().product();
    Tensor::from_vec(
        shape,
        (0..n).map(|i| scale * normalish(key, i as u64)).collect(),
    )
}

/// `got` has `want`'s shape and every element written.
fn whole(u: &Under, op: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{} {op}: shape", u.name);
    let stats = u.backend.stats(got);
    assert_eq!(
        stats.unwritten, 0,
        "{} {op}: {} elements unwritten",
        u.name, stats.unwritten
    );
}

fn check(u: &Under, op: &str, got: &Tensor, want: &Tensor) {
    whole(u, op, got, want);
    // Masked scores (−∞ on both sides) agree; NaN and other infinities never do.
    let err = mladb::debug::compare::diff(got.data(), want.data(), got.shape(), None).error();
    assert!(
        err <= u.tolerance,
        "{} {op}: rel L2 {err:.3e} > {:.1e}",
        u.name,
        u.tolerance
    );
}

/// `t` with every value's sign dropped.
fn magnitudes(t: &Tensor) -> Tensor {
    Tensor::from_vec(t.shape(), t.data().iter().map(|v| v.abs()).collect())
}

/// As [`check`], with the error measured against `scale` (same shape) instead of `want`:
/// ‖got − want‖ / ‖scale‖ within the tolerance.
fn check_against_scale(u: &Under, op: &str, got: &Tensor, want: &Tensor, scale: &Tensor) {
    whole(u, op, got, want);
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for ((&g, &w), &s) in got.data().iter().zip(want.data()).zip(scale.data()) {
        diff += (g as f64 - w as f64).powi(2);
        norm += (s as f64).powi(2);
    }
    let err = (diff / norm.max(1e-300)).sqrt();
    assert!(
        err <= u.tolerance,
        "{} {op}: {err:.3e} of the terms' scale > {:.1e}",
        u.name,
        u.tolerance
    );
}

fn linear_norms_rope_and_elementwise_ops(gpu: bool) {
    let cpu = CpuBackend;
    let x = random(&[7, 96], "x", 1.0);
    let w = random(&[130, 96], "w", 0.1);
    let bias = random(&[130], "b", 0.1);
    let nw = random(&[96], "nw", 0.1);
    let nb = random(&[96], "nb", 0.1);
    let g = random(&[7, 96], "g", 1.0);
    let table = RopeTable::new(
        &RopeLayout {
            theta: 10000.0,
            interleaved: true,
            scaling: RopeScaling::None,
        },
        16,
    );
    let q = random(&[7, 4, 24], "q", 1.0);
    let positions: Vec<usize> = (3..10).collect();
    for u in backends(gpu) {
        let b = &*u.backend;
        check(
            &u,
            "linear",
            &b.linear(&x, &w, None).unwrap(),
            &cpu.linear(&x, &w, None).unwrap(),
        );
        check(
            &u,
            "linear+bias",
            &b.linear(&x, &w, Some(&bias)).unwrap(),
            &cpu.linear(&x, &w, Some(&bias)).unwrap(),
        );
        check(
            &u,
            "rms_norm",
            &b.rms_norm(&x, &nw, 1e-6).unwrap(),
            &cpu.rms_norm(&x, &nw, 1e-6).unwrap(),
        );
        check(
            &u,
            "layer_norm",
            &b.layer_norm(&x, &nw, &nb, 1e-6).unwrap(),
            &cpu.layer_norm(&x, &nw, &nb, 1e-6).unwrap(),
        );
        for interleaved in [true, false] {
            let want = cpu.rope(&q, 4, &table, &positions, interleaved).unwrap();
            check(
                &u,
                "rope",
                &b.rope(&q, 4, &table, &positions, interleaved).unwrap(),
                &want,
            );
        }
        check(
            &u,
            "silu_mul",
            &b.silu_mul(&x, &g).unwrap(),
            &cpu.silu_mul(&x, &g).unwrap(),
        );
        check(
            &u,
            "add",
            &b.add(&x, &g).unwrap(),
            &cpu.add(&x, &g).unwrap(),
        );
        check(
            &u,
            "scale",
            &b.scale(&x, 0.37).unwrap(),
            &cpu.scale(&x, 0.37).unwrap(),
        );
        check(
            &u,
            "slice_groups",
            &b.slice_groups(&x, 4, 8, 16).unwrap(),
            &cpu.slice_groups(&x, 4, 8, 16).unwrap(),
        );
        let a2 = random(&[7, 4, 8], "a2", 1.0);
        let b2 = random(&[7, 4, 16], "b2", 1.0);
        check(
            &u,
            "concat_groups",
            &b.concat_groups(&a2, &b2, 4).unwrap(),
            &cpu.concat_groups(&a2, &b2, 4).unwrap(),
        );
        let rows = [5usize, 0, 3];
        check(
            &u,
            "gather_rows",
            &b.gather_rows(&x, &rows).unwrap(),
            &cpu.gather_rows(&x, &rows).unwrap(),
        );
        let y = random(&[3, 96], "y", 1.0);
        let (mut got, mut want) = (x.clone(), x.clone());
        b.scatter_add_rows(&mut got, &rows, &y, &[0.5, 1.5, -2.0])
            .unwrap();
        cpu.scatter_add_rows(&mut want, &rows, &y, &[0.5, 1.5, -2.0])
            .unwrap();
        check(&u, "scatter_add_rows", &got, &want);
    }
}

/// Linear layers of few rows, as decode steps run them (the device takes up to 8 rows through
/// its own weight-streaming kernel instead of cuBLAS), against the CPU: every row count from 1
/// to 9, inner sizes that fill a 16-byte vector and one that does not (cuBLAS in bf16), output
/// counts that leave a warp's band of rows part empty, and enough of them that 4, 2 and 1 warps
/// share a band.
fn linear_of_few_rows(gpu: bool) {
    let cpu = CpuBackend;
    for u in backends(gpu) {
        let b = &*u.backend;
        for (k, out) in [
            (8, 1),
            (96, 5),
            (200, 33),
            (20, 70),
            (6152, 300),
            (64, 3000),
            (24, 5000),
            (16, 9000),
        ] {
            let w = random(&[out, k], "few.w", 0.1);
            for n in 1..=9 {
                let x = random(&[n, k], "few.x", 1.0);
                // Against the sums of |x|·|w|, the scale of the rounding: a short dot product
                // can cancel to near zero (8 terms to one output), and then its own size
                // measures nothing but the inputs' rounding.
                check_against_scale(
                    &u,
                    &format!("linear {n}×{k} → {out}"),
                    &b.linear(&x, &w, None).unwrap(),
                    &cpu.linear(&x, &w, None).unwrap(),
                    &cpu.linear(&magnitudes(&x), &magnitudes(&w), None).unwrap(),
                );
            }
        }
    }
}

fn statistics_count_everything_on_every_backend(gpu: bool) {
    let mut t = random(&[1000], "s", 3.0);
    t.data_mut()[10] = f32::NAN;
    t.data_mut()[20] = f32::INFINITY;
    t.data_mut()[30] = f32::NEG_INFINITY;
    t.data_mut()[40] = 0.0;
    t.data_mut()[50] = f32::from_bits(mladb::tensor::POISON_BITS);
    let want = mladb::stats::TensorStats::of(t.data());
    for u in backends(gpu) {
        // Through an op so that the tensor lives on the device: x · 1.
        let on = u.backend.scale(&t, 1.0).unwrap();
        let s = u.backend.stats(&on);
        assert_eq!(
            (s.nan, s.pos_inf, s.neg_inf, s.unwritten),
            (want.nan, 1, 1, 0),
            "{}",
            u.name
        );
        assert!(s.zeros >= 1 && s.count == 1000, "{}", u.name);
        let tol = u.tolerance.max(1e-6);
        for (a, b) in [
            (s.mean, want.mean),
            (s.std, want.std),
            (s.l2, want.l2),
            (s.abs_max, want.abs_max),
        ] {
            assert!(
                (a - b).abs() <= tol * b.abs().max(1.0) * 10.0,
                "{}: {a} vs {b}",
                u.name
            );
        }
        // Poison written by nobody is counted as unwritten (the CPU keeps it as it was given).
        let fresh = u.backend.alloc(&[64], true).unwrap();
        assert_eq!(u.backend.stats(&fresh).unwritten, 64, "{}", u.name);
    }
}

/// The statistics of an attention call's outputs come back together (`stats_many`): more tensors
/// than one copy brings back, of every size, on the device only or on the host too, poisoned
/// and not, asked twice (the device pass's block counters start again from zero) — each as
/// `stats` alone and as the host computes them.
fn statistics_of_many_tensors_come_back_together(gpu: bool) {
    let sizes = [1usize, 7, 300, 4096, 20_000, 70_000, 1 << 20];
    for u in backends(gpu) {
        let b = &u.backend;
        let mut tensors = Vec::new();
        for (i, &n) in sizes.iter().cycle().take(23).enumerate() {
            let mut t = random(&[n], &format!("m{i}"), 1.0 + i as f32);
            t.data_mut()[n / 2] = f32::from_bits(mladb::tensor::POISON_BITS);
            let on = b.scale(&t, 1.0).unwrap();
            if i % 3 == 0 {
                on.data(); // a host copy made: small ones are summed on the host
            }
            tensors.push(on);
        }
        tensors.push(b.alloc(&[5000], true).unwrap());
        let refs: Vec<&Tensor> = tensors.iter().collect();
        for round in 0..2 {
            let many = b.stats_many(&refs);
            assert_eq!(many.len(), refs.len(), "{}", u.name);
            for (i, (t, s)) in refs.iter().zip(&many).enumerate() {
                let want = mladb::stats::TensorStats::of(t.data());
                let one = b.stats(t);
                let what = format!("{} round {round} tensor {i} of {}", u.name, t.numel());
                assert_eq!(
                    (s.count, s.nan, s.unwritten, s.zeros),
                    (want.count, want.nan, want.unwritten, want.zeros),
                    "{what}"
                );
                assert_eq!((one.count, one.unwritten), (s.count, s.unwritten), "{what}");
                for (a, b) in [(s.mean, want.mean), (s.l2, want.l2), (s.max, want.max)] {
                    // No finite element (the one-element tensor is poison): NaN on both sides.
                    assert!(
                        (a - b).abs() <= 1e-6 * b.abs().max(1.0) || (a.is_nan() && b.is_nan()),
                        "{what}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

/// A statistics batch (started op by op, brought back together) gives each tensor the
/// statistics it had when started, though its buffer is freed and reused at once (the device's
/// pool hands the next output the same memory), and over more tensors than one copy brings back.
fn a_statistics_batch_keeps_each_tensor_as_it_was_when_started(gpu: bool) {
    let sizes = [3usize, 300, 5000, 20_000, 70_000];
    for u in backends(gpu) {
        let b = &u.backend;
        let mut batch = b.stats_batch();
        let mut want = Vec::new();
        for i in 0..1100 {
            let n = sizes[i % sizes.len()];
            let t = b
                .scale(&random(&[n], &format!("b{}", i % 7), 1.0), 1.0 + i as f32)
                .unwrap();
            want.push(b.stats(&t));
            if i % 10 == 9 {
                // Several at once, one of them twice (an alias: summed once).
                let u = b.scale(&t, -2.0).unwrap();
                want.extend([b.stats(&t), b.stats(&u)]);
                batch.start(&[&t, &t.alias(), &u]).unwrap();
            } else {
                batch.start(&[&t]).unwrap();
            }
        }
        let got = batch.collect().unwrap();
        assert_eq!(got.len(), want.len(), "{}", u.name);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let bits = |s: &mladb::stats::TensorStats| {
                [s.mean, s.l2, s.min, s.max, s.std].map(f64::to_bits)
            };
            assert_eq!(
                (g.count, g.nan, g.unwritten, bits(g)),
                (w.count, w.nan, w.unwritten, bits(w)),
                "{} tensor {i}",
                u.name
            );
        }
        assert!(
            batch.collect().unwrap().is_empty(),
            "{}: collected twice",
            u.name
        );
    }
}

fn routing_picks_the_same_experts(gpu: bool) {
    let moe = |e, k, g, kept| MoeLayout {
        n_routed_experts: e,
        num_experts_per_tok: k,
        n_shared_experts: 1,
        moe_intermediate_size: 8,
        n_group: g,
        topk_group: kept,
        routed_scaling_factor: 2.5,
        norm_topk_prob: true,
    };
    // Small groups; GLM-5's 256 experts in one group; DeepSeek-V3's in 8 groups, 4 kept.
    for (case, moe) in [moe(32, 4, 4, 2), moe(256, 8, 1, 1), moe(256, 8, 8, 4)]
        .into_iter()
        .enumerate()
    {
        let e = moe.n_routed_experts;
        let mut logits = random(&[9, e], &format!("logits {case}"), 2.0);
        // Exact ties (top-k keeps the lower index), and NaNs (which rank above everything in a
        // kept group and as -inf in a dropped one).
        let data = logits.data_mut();
        for j in 0..6 {
            data[e + 2 * j] = 1.5;
            data[e + 2 * j + 1] = 1.5;
        }
        data[2 * e + 3] = f32::NAN;
        data[3 * e + e - 1] = f32::NAN;
        let bias = random(&[e], &format!("bias {case}"), 0.1);
        let want = CpuBackend.route(&logits, &bias, &moe).unwrap();
        for u in backends(gpu) {
            // The logits as a host tensor, and as the device tensor a gate op leaves (in the
            // backend's storage type: the reference then routes the stored values).
            let on_device = u.backend.scale(&logits, 1.0).unwrap();
            let want_stored = CpuBackend
                .route(
                    &Tensor::from_vec(logits.shape(), on_device.data().to_vec()),
                    &bias,
                    &moe,
                )
                .unwrap();
            for (input, want) in [(&logits, &want), (&on_device, &want_stored)] {
                let got = u.backend.route(input, &bias, &moe).unwrap();
                assert_eq!(got.experts, want.experts, "{} case {case}", u.name);
                for (a, b) in got
                    .weights
                    .iter()
                    .flatten()
                    .zip(want.weights.iter().flatten())
                {
                    let same = (a - b).abs() < 1e-5 || (a.is_nan() && b.is_nan());
                    assert!(same, "{} case {case}: {a} vs {b}", u.name);
                }
            }
        }
    }
}

fn dims() -> MlaDims {
    MlaDims {
        heads: 4,
        nope: 24,
        rope: 8,
        v: 20,
        latent: 32,
    }
}

fn mla_projections(gpu: bool) {
    let d = dims();
    let cpu = CpuBackend;
    let q_nope = random(&[5, d.heads, d.nope], "qn", 1.0);
    let kv_b = random(&[d.heads * (d.nope + d.v), d.latent], "kvb", 0.2);
    let o_lat = random(&[5, d.heads, d.latent], "ol", 1.0);
    let kv = random(&[5, d.heads * (d.nope + d.v)], "kv", 1.0);
    let k_pe = random(&[5, d.rope], "kpe", 1.0);
    for split in [
        KvbSplit::correct(d),
        KvbSplit {
            w_uk_row: d.v,
            w_uv_row: 0,
        },
    ] {
        for u in backends(gpu) {
            let b = &*u.backend;
            check(
                &u,
                "absorb_query",
                &b.absorb_query(&q_nope, &kv_b, d, split).unwrap(),
                &cpu.absorb_query(&q_nope, &kv_b, d, split).unwrap(),
            );
            check(
                &u,
                "apply_w_uv",
                &b.apply_w_uv(&o_lat, &kv_b, d, split).unwrap(),
                &cpu.apply_w_uv(&o_lat, &kv_b, d, split).unwrap(),
            );
            let (k, v) = b.assemble_kv(&kv, &k_pe, d).unwrap();
            let (wk, wv) = cpu.assemble_kv(&kv, &k_pe, d).unwrap();
            check(&u, "assemble_kv K", &k, &wk);
            check(&u, "assemble_kv V", &v, &wv);
        }
    }
}

/// A latent cache of `t` tokens (over two pages) and per-head K/V caches of the same tokens.
fn caches(t: usize) -> (LatentCache, RowCache, RowCache) {
    let d = dims();
    let mut latent = LatentCache::new(d.latent + d.rope, true);
    let rows = random(&[t, d.latent + d.rope], "latent", 1.0);
    for i in 0..t {
        latent.push(rows.row(i)).unwrap();
    }
    let (mut k, mut v) = (
        RowCache::new(d.heads * (d.nope + d.rope)),
        RowCache::new(d.heads * d.v),
    );
    let kr = random(&[t, d.heads * (d.nope + d.rope)], "k", 1.0);
    let vr = random(&[t, d.heads * d.v], "v", 1.0);
    for i in 0..t {
        k.push(kr.row(i)).unwrap();
        v.push(vr.row(i)).unwrap();
    }
    (latent, k, v)
}

fn masks(t: usize, n: usize) -> Vec<AttnMask> {
    let positions: Vec<usize> = (t - n..t).collect();
    // A sparse selection: every other key, plus the query's own.
    let selected = positions
        .iter()
        .map(|&p| (0..=p).filter(|j| j % 2 == 0 || *j == p).collect())
        .collect();
    vec![
        AttnMask::causal(positions.clone()),
        AttnMask {
            positions,
            selected: Some(selected),
        },
    ]
}

fn attention_both_paths_with_causal_and_sparse_masks(gpu: bool) {
    let d = dims();
    let cpu = CpuBackend;
    // 70 tokens: the latent cache spans two pages and nine split-KV blocks.
    let (latent, k, v) = caches(70);
    let n = 5;
    let q = random(&[n, d.heads, d.nope + d.rope], "qq", 1.0);
    let q_lat = random(&[n, d.heads, d.latent], "ql", 1.0);
    let q_pe = random(&[n, d.heads, d.rope], "qp", 1.0);
    for mask in masks(70, n) {
        for faults in [
            KernelFaults::default(),
            KernelFaults {
                lse_base_mismatch: true,
                ..KernelFaults::default()
            },
        ] {
            let call = AttnParams {
                dims: d,
                mask: &mask,
                scale: 0.125,
                faults,
            };
            let mut want_out = cpu.alloc(&[n, d.heads * d.v], true).unwrap();
            let want_p = cpu
                .attention_naive(&q, &k, &v, call, &mut want_out)
                .unwrap();
            let mut want_lat = cpu.alloc(&[n, d.heads, d.latent], true).unwrap();
            let want_lp = cpu
                .attention_latent(&q_lat, &q_pe, &latent, call, &mut want_lat)
                .unwrap();
            for u in backends(gpu) {
                let b = &*u.backend;
                let mut out = b.alloc(&[n, d.heads * d.v], true).unwrap();
                let p = b.attention_naive(&q, &k, &v, call, &mut out).unwrap();
                check(&u, "attention_naive out", &out, &want_out);
                check(&u, "attention_naive probs", &p, &want_p);
                let mut lat = b.alloc(&[n, d.heads, d.latent], true).unwrap();
                let lp = b
                    .attention_latent(&q_lat, &q_pe, &latent, call, &mut lat)
                    .unwrap();
                check(&u, "attention_latent out", &lat, &want_lat);
                check(&u, "attention_latent probs", &lp, &want_lp);
            }
        }
    }
}

fn a_kernel_that_skips_rows_leaves_them_unwritten_everywhere(gpu: bool) {
    let d = dims();
    let (latent, _, _) = caches(20);
    let q_lat = random(&[1, d.heads, d.latent], "ql", 1.0);
    let q_pe = random(&[1, d.heads, d.rope], "qp", 1.0);
    let faults = KernelFaults {
        skip_padded_rows: true,
        ..KernelFaults::default()
    };
    for u in backends(gpu) {
        let b = &*u.backend;
        let mut out = b.alloc(&[1, d.heads, d.latent], true).unwrap();
        let mask = AttnMask::causal(vec![19]);
        let call = AttnParams {
            dims: d,
            mask: &mask,
            scale: 0.1,
            faults,
        };
        b.attention_latent(&q_lat, &q_pe, &latent, call, &mut out)
            .unwrap();
        assert_eq!(
            b.stats(&out).unwritten,
            d.latent,
            "{}: the last head's row",
            u.name
        );
    }
}

fn indexer_scores(gpu: bool) {
    let n = 6;
    let mut keys = RowCache::new(16);
    let kr = random(&[30, 16], "ik", 1.0);
    for i in 0..30 {
        keys.push(kr.row(i)).unwrap();
    }
    let q = random(&[n, 4, 16], "iq", 1.0);
    let w = random(&[n, 4], "iw", 1.0);
    let positions: Vec<usize> = (24..30).collect();
    let want = CpuBackend
        .index_scores(&q, &w, &keys, &positions, 0.25)
        .unwrap();
    for u in backends(gpu) {
        let got = u
            .backend
            .index_scores(&q, &w, &keys, &positions, 0.25)
            .unwrap();
        check(&u, "index_scores", &got, &want);
    }
}

fn indexer_topk_on_ties_masks_and_short_rows(gpu: bool) {
    // Scores on a coarse grid (many ties), −∞ past each row's position, one row shorter than k.
    let (n, context, k) = (7, 40, 8);
    let base = random(&[n, context], "tk", 4.0);
    let positions = [3usize, 9, 17, 25, 31, 38, 39];
    let mut scores = Tensor::from_vec(
        &[n, context],
        base.data().iter().map(|v| v.round()).collect(),
    );
    for (i, &p) in positions.iter().enumerate() {
        for v in &mut scores.data_mut()[i * context + p + 1..(i + 1) * context] {
            *v = f32::NEG_INFINITY;
        }
    }
    let want = CpuBackend.index_topk(&scores, &positions, k).unwrap();
    assert_eq!(
        want[0],
        vec![0, 1, 2, 3],
        "a row with fewer causal keys than k keeps them all"
    );
    assert!(want[1..].iter().all(|r| r.len() == k));
    for u in backends(gpu) {
        let got = u.backend.index_topk(&scores, &positions, k).unwrap();
        assert_eq!(got, want, "{}: index top-k", u.name);
    }
}

/// Random valid blocks of `ty`: random quant bits, with every f16 scale field a finite value
/// (F16 / BF16 tensors: every value finite).
fn random_blocks(
    ty: mladb::gguf::GgmlType,
    rows: usize,
    cols: usize,
) -> mladb::model::quant::QuantTensor {
    use mladb::gguf::GgmlType as G;
    let mut rng = common::Lcg::new(common::seed() ^ ty as u64);
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let n_blocks = rows * cols / bs;
    let mut bytes: Vec<u8> = (0..n_blocks * ts).map(|_| rng.next_u64() as u8).collect();
    let f16_fields: &[usize] = match ty {
        G::Q8_0 | G::Q4_0 | G::Q5_0 => &[0],
        G::Q4_1 | G::Q5_1 | G::Q4_K | G::Q5_K => &[0, 2],
        G::Q2_K => &[80, 82],
        G::Q3_K => &[108],
        G::Q6_K => &[208],
        G::F16 | G::BF16 => &[0],
        _ => panic!("no block recipe for {ty}"),
    };
    for block in bytes.chunks_mut(ts) {
        for &off in f16_fields {
            let v = rng.next_f32() * 2.0 - 1.0;
            let b = if ty == G::BF16 {
                half::bf16::from_f32(v).to_le_bytes()
            } else {
                half::f16::from_f32(v * 0.05).to_le_bytes()
            };
            block[off..off + 2].copy_from_slice(&b);
        }
    }
    mladb::model::quant::QuantTensor::new(ty, rows, cols, bytes.into()).unwrap()
}

fn dequantization_and_the_quantized_linear_match_the_cpu_codec(gpu: bool) {
    use mladb::gguf::GgmlType as G;
    use mladb::model::quant::QuantFaults;
    let types = [
        G::Q8_0,
        G::Q4_0,
        G::Q4_1,
        G::Q5_0,
        G::Q5_1,
        G::Q2_K,
        G::Q3_K,
        G::Q4_K,
        G::Q5_K,
        G::Q6_K,
        G::F16,
        G::BF16,
    ];
    let fault = QuantFaults {
        q4k_scale_unpack: true,
    };
    let x = random(&[9, 512], "xq", 1.0);
    let cpu = CpuBackend;
    for u in backends(gpu) {
        let b = &*u.backend;
        for ty in types {
            let w = random_blocks(ty, 40, 512);
            for faults in [QuantFaults::default(), fault] {
                let want = Tensor::from_vec(&[40, 512], w.dequantize(faults).unwrap());
                let got = b.dequantize(&w, faults).unwrap();
                let op = format!("dequantize {ty} {faults:?}");
                check(&u, &op, &got, &want);
                if u.tolerance == 0.0 || u.name == "cuda-f32" {
                    // Decoding is exact arithmetic in ggml's order: bit for bit.
                    let same = got
                        .data()
                        .iter()
                        .zip(want.data())
                        .all(|(p, q)| p.to_bits() == q.to_bits());
                    assert!(same, "{} {op}: not bit-identical to the CPU codec", u.name);
                }
                let want = cpu.linear(&x, &want, None).unwrap();
                let got = b.linear_quant(&x, &w, faults).unwrap();
                check(&u, &format!("linear_quant {ty} {faults:?}"), &got, &want);
            }
        }
    }
}

/// A norm weight (or bias) whose length is not the row's is refused by every backend, before any
/// kernel runs: the CPU used to normalise a prefix silently, the GPU to read past the weight.
fn norms_refuse_a_weight_of_the_wrong_length(gpu: bool) {
    let x = random(&[3, 16], "x", 1.0);
    let short = random(&[12], "w", 1.0);
    let long = random(&[20], "w", 1.0);
    let fits = random(&[16], "w", 1.0);
    for u in backends(gpu) {
        for w in [&short, &long] {
            let err = u.backend.rms_norm(&x, w, 1e-6).unwrap_err().to_string();
            assert!(err.contains("rms_norm: weight of"), "{}: {err}", u.name);
            let err = u
                .backend
                .layer_norm(&x, w, &fits, 1e-6)
                .unwrap_err()
                .to_string();
            assert!(err.contains("layer_norm: weight of"), "{}: {err}", u.name);
            let err = u
                .backend
                .layer_norm(&x, &fits, w, 1e-6)
                .unwrap_err()
                .to_string();
            assert!(err.contains("layer_norm: bias of"), "{}: {err}", u.name);
        }
        assert!(u.backend.rms_norm(&x, &fits, 1e-6).is_ok(), "{}", u.name);
    }
}

/// The routed experts of an MoE layer as one call (a device runs them together) against the CPU
/// running them one by one: experts with one token, a tile and one more, exactly the streamed
/// maximum and one past it (cuBLAS), tokens in any order, tokens with no expert (zero rows), and
/// widths whose rows are not whole 16-byte vectors; then inputs the call must refuse.
fn routed_experts_match_the_cpu_one_by_one(gpu: bool) {
    use mladb::backend::experts::{experts_one_by_one, ExpertJob, ExpertWeights};
    use std::sync::Arc;
    let n = 40;
    // Experts of many tokens (tiles of 8, cuBLAS past 32) and none; then one token each, as a
    // decode step routes (the one-token kernels).
    let mixed = [
        (0usize, 1usize),
        (3, 9),
        (5, 0),
        (7, 33),
        (9, 32),
        (11, 3),
        (12, 8),
    ];
    let single = [(2usize, 1usize), (6, 1), (13, 1)];
    for (hidden, inter) in [(64, 48), (512, 256), (516, 36)] {
        for counts in [&mixed[..], &single[..]] {
            let x = random(&[n, hidden], "experts.x", 1.0);
            let weights_of = |e: usize| ExpertWeights {
                gate: Arc::new(random(&[inter, hidden], &format!("e{e}.gate"), 0.2)),
                up: Arc::new(random(&[inter, hidden], &format!("e{e}.up"), 0.2)),
                down: Arc::new(random(&[hidden, inter], &format!("e{e}.down"), 0.2)),
            };
            let jobs: Vec<ExpertJob> = counts
                .iter()
                .map(|&(e, m)| ExpertJob {
                    expert: e,
                    // Tokens 0..38 only (38 and 39 get no expert), in a shuffled order.
                    tokens: (0..m).map(|i| (i * 7 + e) % 38).collect(),
                    weights: (0..m).map(|i| 0.25 + 0.1 * ((i + e) % 5) as f32).collect(),
                })
                .collect();
            let mut fetch_cpu = |e: usize| Ok(weights_of(e));
            let want = experts_one_by_one(&CpuBackend, &x, &jobs, &mut fetch_cpu).unwrap();
            for row in [38, 39] {
                assert!(want.sum.row(row).iter().all(|&v| v == 0.0));
            }
            let fetched_want: Vec<usize> = jobs
                .iter()
                .filter(|j| !j.tokens.is_empty())
                .map(|j| j.expert)
                .collect();
            for u in backends(gpu) {
                let mut fetched = Vec::new();
                let mut fetch = |e: usize| {
                    fetched.push(e);
                    Ok(weights_of(e))
                };
                let got = u
                    .backend
                    .routed_experts(&x, &jobs, &mut fetch, true)
                    .unwrap();
                let what = format!("routed_experts {hidden}x{inter}");
                check(&u, &what, &got.sum, &want.sum);
                assert_eq!(got.per_job.len(), jobs.len(), "{}", u.name);
                for (j, (g, w)) in got.per_job.iter().zip(&want.per_job).enumerate() {
                    assert_eq!(g.shape(), [jobs[j].tokens.len(), hidden], "{}", u.name);
                    check(&u, &format!("{what} expert {}", jobs[j].expert), g, w);
                }
                assert_eq!(fetched, fetched_want, "{}: experts fetched", u.name);
            }
        }
    }
    let x = random(&[4, 64], "experts.x", 1.0);
    let w = |rows, cols| Arc::new(random(&[rows, cols], "experts.w", 0.2));
    let job = |expert, tokens: Vec<usize>| ExpertJob {
        expert,
        weights: vec![1.0; tokens.len()],
        tokens,
    };
    for u in backends(gpu) {
        let mut fetch = |_| {
            Ok(ExpertWeights {
                gate: w(16, 64),
                up: w(16, 64),
                down: w(64, 16),
            })
        };
        let b = &u.backend;
        let err = |jobs: &[ExpertJob], f: &mut mladb::backend::experts::FetchExpert| match b
            .routed_experts(&x, jobs, f, true)
        {
            Ok(_) => panic!("{}: bad jobs were taken", u.name),
            Err(e) => e.to_string(),
        };
        assert!(
            err(&[job(1, vec![4])], &mut fetch).contains("of 4 rows"),
            "{}",
            u.name
        );
        assert!(
            err(&[job(2, vec![0]), job(1, vec![1])], &mut fetch).contains("out of order"),
            "{}",
            u.name
        );
        let mut misshapen = |_| {
            Ok(ExpertWeights {
                gate: w(16, 64),
                up: w(16, 64),
                down: w(16, 64),
            })
        };
        assert!(
            err(&[job(0, vec![0])], &mut misshapen).contains("expert 0: gate"),
            "{}",
            u.name
        );
    }
}

cpu_and_gpu!(
    linear_norms_rope_and_elementwise_ops,
    linear_of_few_rows,
    statistics_count_everything_on_every_backend,
    statistics_of_many_tensors_come_back_together,
    a_statistics_batch_keeps_each_tensor_as_it_was_when_started,
    routing_picks_the_same_experts,
    routed_experts_match_the_cpu_one_by_one,
    mla_projections,
    attention_both_paths_with_causal_and_sparse_masks,
    a_kernel_that_skips_rows_leaves_them_unwritten_everywhere,
    indexer_scores,
    indexer_topk_on_ties_masks_and_short_rows,
    dequantization_and_the_quantized_linear_match_the_cpu_codec,
    norms_refuse_a_weight_of_the_wrong_length,
);

/// The device generator of synthetic weights against the CPU's, bit for bit: every tensor of two
/// tiny layouts from row 0 and from row 1, rows deep in full-size GLM-5's embedding, and indices
/// past 2^32 (f32; bf16 as the CPU's value rounded to bf16).
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn synthetic_weights_made_on_the_device_equal_the_cpus_bit_for_bit() {
    use mladb::backend::cuda::device::{Elem, Gpu};
    use mladb::model::weights::synthetic::SyntheticWeights;
    use mladb::model::weights::WeightSource;
    let gpu = Gpu::open(0).unwrap();
    let same = |what: &str, elem: Elem, got: &[f32], want: &[f32]| {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let w = match elem {
                Elem::F32 => *w,
                Elem::Bf16 => half::bf16::from_f32(*w).to_f32(),
            };
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{what} {elem:?} element {i}: {g} vs {w}"
            );
        }
    };
    let mut checked = 0;
    for (layout, rows) in [
        ("glm5-tiny", None),
        ("deepseek-v3-tiny", None),
        ("glm5", Some(150_000)),
    ] {
        let layout = mladb::model::Layout::resolve(layout).unwrap();
        let source = SyntheticWeights::new(&layout, 7);
        let catalog = mladb::model::catalog::Catalog::new(&layout);
        let names: Vec<String> = match rows {
            None => catalog.iter().map(|(n, _)| n.clone()).collect(),
            Some(_) => vec!["model.embed_tokens.weight".into()],
        };
        for name in names {
            let shape = source.shape(&name).unwrap();
            let cols: usize = shape.iter().skip(1).product::<usize>().max(1);
            let starts = match rows {
                None => vec![0, 1.min(shape[0] - 1)],
                Some(r) => vec![r],
            };
            for start in starts {
                let n_rows = (shape[0] - start).min(64);
                let mut want = vec![0.0f32; n_rows * cols];
                source.read_rows(&name, start, &mut want).unwrap();
                let recipe = source.recipe(&name, start).unwrap();
                for elem in [Elem::F32, Elem::Bf16] {
                    let buf = gpu.alloc(want.len(), elem).unwrap();
                    gpu.synthetic_fill(&buf, recipe).unwrap();
                    same(&name, elem, &gpu.download(&buf).unwrap(), &want);
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 100, "{checked} fills compared");
    // Indices past 2^32, under a projection's scale.
    let (key, first, params) = (tensor_key(3, "x"), (1u64 << 40) + 12345, (0.0, 0.0123f32));
    let want: Vec<f32> = (0..4096)
        .map(|i| params.0 + params.1 * normalish(key, first + i))
        .collect();
    let buf = gpu.alloc(want.len(), Elem::F32).unwrap();
    let recipe = mladb::model::weights::Recipe {
        key,
        first,
        offset: params.0,
        scale: params.1,
    };
    gpu.synthetic_fill(&buf, recipe).unwrap();
    same("past 2^32", Elem::F32, &gpu.download(&buf).unwrap(), &want);
}
