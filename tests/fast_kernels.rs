//! The tensor-core MLA kernels (decode over the paged latent cache, causal flash prefill)
//! against an f64 reference on fresh random bf16 inputs, outputs poisoned first. GPU only:
//! ignored by default (cargo counts them), run by `tools/gpu_check.sh` with `--include-ignored`.

mod common;

use mladb::backend::cuda::device::{Elem, Gpu};
use mladb::backend::cuda::fast::{self, DecodeShape, DecodeWork, LATENT, PAGE, ROPE};
use mladb::backend::cuda::CudaBackend;
use mladb::engine::StorageDtype;

fn gpu() -> CudaBackend {
    common::cuda_backend(StorageDtype::Bf16)
}

/// Random values in [-1, 1), rounded to bf16 (what the device holds).
fn random_bf16(rng: &mut common::Lcg, n: usize, amp: f32) -> Vec<f32> {
    (0..n)
        .map(|_| half::bf16::from_f32(amp * (rng.next_f32() * 2.0 - 1.0)).to_f32())
        .collect()
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn tensor_core_decode_matches_reference() {
    let backend = gpu();
    let gpu: &Gpu = backend.gpu();
    let seed = common::seed();
    let mut rng = common::Lcg::new(seed);
    eprintln!("seed {seed}");
    let width = LATENT + ROPE;
    // Lengths off the 16/32-token tile grid, one shorter than a tile, and an empty sequence.
    let lens = [1usize, 77, 0, 900, 2100];
    let heads = 128;
    let batch = lens.len();
    let pages_of: Vec<usize> = lens.iter().map(|l| l.div_ceil(PAGE)).collect();
    let total_pages: usize = pages_of.iter().sum::<usize>() + 3;
    let max_pages = *pages_of.iter().max().unwrap();
    // Pages handed out in a shuffled order, as a paged allocator does after churn.
    let mut order: Vec<usize> = (0..total_pages).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.next_u64() as usize % (i + 1));
    }
    let mut table = vec![0i32; batch * max_pages];
    let mut next = 0;
    for (b, &np) in pages_of.iter().enumerate() {
        for p in 0..np {
            table[b * max_pages + p] = order[next] as i32;
            next += 1;
        }
    }
    let cache = random_bf16(&mut rng, total_pages * PAGE * width, 1.0);
    let q = random_bf16(&mut rng, batch * heads * width, 1.0);
    let scale = 1.0 / (192.0f32).sqrt();
    let shape = DecodeShape {
        batch,
        heads,
        max_pages,
        max_len: *lens.iter().max().unwrap(),
    };
    // The f64 reference (output and natural-log LSE per sequence and head), once.
    let mut want = Vec::with_capacity(batch * heads);
    for b in 0..batch {
        let row = |t: usize| {
            let page = table[b * max_pages + t / PAGE] as usize;
            let at = (page * PAGE + t % PAGE) * width;
            &cache[at..at + width]
        };
        for h in 0..heads {
            let qv = &q[(b * heads + h) * width..][..width];
            let out = fast::reference_attention(
                qv,
                (0..lens[b]).map(|t| (row(t), &row(t)[..LATENT])),
                scale as f64,
            );
            let scores: Vec<f64> = (0..lens[b])
                .map(|t| {
                    qv.iter()
                        .zip(row(t))
                        .map(|(&a, &c)| a as f64 * c as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = top + scores.iter().map(|s| (s - top).exp()).sum::<f64>().ln();
            want.push((out, lse));
        }
    }
    let d_cache = gpu.upload(&cache, Elem::Bf16).unwrap();
    let d_q = gpu.upload(&q, Elem::Bf16).unwrap();
    let d_table = gpu.upload_i32(&table).unwrap();
    let d_lens = gpu
        .upload_i32(&lens.iter().map(|&l| l as i32).collect::<Vec<_>>())
        .unwrap();
    let out = gpu.alloc(batch * heads * LATENT, Elem::Bf16).unwrap();
    let lse = gpu.alloc(batch * heads, Elem::F32).unwrap();
    // Every kernel variant the device can run; for each, the split count the device would
    // choose, one split (the kernel writes the result itself), an odd count that leaves some
    // splits of the short sequences empty (merged per row), and 40 (the block-wide merge).
    let chosen = DecodeWork::new(gpu, shape).unwrap().splits;
    for variant in fast::decode_variants_for(gpu) {
        for splits in [chosen, 1, 7, 40] {
            gpu.fill(&out, true).unwrap();
            gpu.fill(&lse, true).unwrap();
            let work = DecodeWork::with_variant(gpu, shape, splits, Some(variant)).unwrap();
            fast::mla_decode(
                gpu, shape, &d_q, &d_cache, &d_table, &d_lens, scale, &out, &lse, &work,
            )
            .unwrap();
            let got = gpu.download(&out).unwrap();
            let got_lse = gpu.download(&lse).unwrap();
            let mut worst: f64 = 0.0;
            for b in 0..batch {
                for h in 0..heads {
                    let got_row = &got[(b * heads + h) * LATENT..][..LATENT];
                    let l = got_lse[b * heads + h] as f64;
                    if lens[b] == 0 {
                        // Nothing to attend to: zeros and an LSE of minus infinity.
                        assert!(
                            got_row.iter().all(|&x| x == 0.0) && l == f64::NEG_INFINITY,
                            "{variant}, {splits} splits: empty sequence {b} head {h} gave lse {l}"
                        );
                        continue;
                    }
                    let (want_out, want_lse) = &want[b * heads + h];
                    worst = worst.max(fast::relative_error(got_row, want_out));
                    assert!(
                        (l - want_lse).abs() < 2e-2 * want_lse.abs().max(1.0),
                        "{variant}, {splits} splits: lse of sequence {b} head {h}: {l} vs {want_lse} (seed {seed})"
                    );
                }
            }
            eprintln!("decode {variant}: worst relative error {worst:.2e} over {batch} sequences × {heads} heads, {splits} splits");
            assert!(
                worst < 1e-2,
                "decode {variant} relative error {worst} with {splits} splits (seed {seed})"
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn tensor_core_prefill_matches_reference() {
    let backend = gpu();
    let gpu: &Gpu = backend.gpu();
    let seed = common::seed();
    let mut rng = common::Lcg::new(seed ^ 0x5eed);
    eprintln!("seed {seed}");
    // A length that ends mid-tile over several blocks, and one shorter than a tile.
    for (n, heads) in [(300usize, 3usize), (45, 2)] {
        for (dqk, dv) in fast::PREFILL_DIMS {
            let q = random_bf16(&mut rng, n * heads * dqk, 1.0);
            let k = random_bf16(&mut rng, n * heads * dqk, 1.0);
            let v = random_bf16(&mut rng, n * heads * dv, 1.0);
            let scale = 1.0 / (dqk as f32).sqrt();
            // The f64 reference: outputs and natural-log LSE per (row, head).
            let mut want = Vec::with_capacity(n * heads);
            let mut want_lse = Vec::with_capacity(n * heads);
            for i in 0..n {
                for h in 0..heads {
                    let qv = &q[(i * heads + h) * dqk..][..dqk];
                    let rows = (0..=i).map(|j| {
                        (
                            &k[(j * heads + h) * dqk..][..dqk],
                            &v[(j * heads + h) * dv..][..dv],
                        )
                    });
                    want.push(fast::reference_attention(qv, rows, scale as f64));
                    let scores: Vec<f64> = (0..=i)
                        .map(|j| {
                            let kv = &k[(j * heads + h) * dqk..][..dqk];
                            qv.iter()
                                .zip(kv)
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum::<f64>()
                                * scale as f64
                        })
                        .collect();
                    let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    want_lse.push(top + scores.iter().map(|s| (s - top).exp()).sum::<f64>().ln());
                }
            }
            let (dq, dk, dvv) = (
                gpu.upload(&q, Elem::Bf16).unwrap(),
                gpu.upload(&k, Elem::Bf16).unwrap(),
                gpu.upload(&v, Elem::Bf16).unwrap(),
            );
            let mut tested = 0;
            for tag in fast::prefill_variants_for(gpu, dqk, dv) {
                let out = gpu.alloc(n * heads * dv, Elem::Bf16).unwrap();
                let lse = gpu.alloc(n * heads, Elem::F32).unwrap();
                gpu.fill(&out, true).unwrap();
                gpu.fill(&lse, true).unwrap();
                fast::flash_prefill_variant(
                    gpu,
                    Some(tag),
                    n,
                    heads,
                    (dqk, dv),
                    &dq,
                    &dk,
                    &dvv,
                    scale,
                    &out,
                    Some(&lse),
                )
                .unwrap();
                let got = gpu.download(&out).unwrap();
                let got_lse = gpu.download(&lse).unwrap();
                let (mut worst, mut worst_lse): (f64, f64) = (0.0, 0.0);
                for (i, w) in want.iter().enumerate() {
                    worst = worst.max(fast::relative_error(&got[i * dv..][..dv], w));
                    let l = got_lse[i];
                    assert!(l.is_finite(), "{tag}: lse of (row, head) {i} unwritten");
                    worst_lse = worst_lse.max((l as f64 - want_lse[i]).abs());
                }
                eprintln!(
                    "prefill {tag} {dqk}/{dv}: worst relative error {worst:.2e}, lse {worst_lse:.2e} \
                     over {n} rows × {heads} heads"
                );
                assert!(
                    worst < 1e-2,
                    "prefill {tag} {dqk}/{dv} n {n} relative error {worst} (seed {seed})"
                );
                assert!(
                    worst_lse < 1e-3,
                    "prefill {tag} {dqk}/{dv} n {n} lse error {worst_lse} (seed {seed})"
                );
                tested += 1;
            }
            assert!(tested > 0, "no prefill variant fits the device");
        }
    }
}
