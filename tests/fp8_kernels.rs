//! The fp8_ds_mla latent cache's kernels on the GPU: the write kernel's bytes against the CPU
//! codec's (ties, saturation, zero rows, NaN and infinity, every fault, f32 and bf16 rows), and
//! every FP8-cache decode variant against the f64 reference over the decoded rows, and bit for
//! bit against its bf16 twin over a bf16 copy of them. GPU only: ignored by default, run by
//! `tools/gpu_check.sh` with `--include-ignored`.

mod common;

use mladb::backend::cuda::device::{DevBuf, Elem, Gpu};
use mladb::backend::cuda::fast::{self, DecodeShape, DecodeWork, LATENT, PAGE, ROPE};
use mladb::engine::StorageDtype;
use mladb::ops::kv_fp8::{self, E4M3_MAX, TILE, TOKEN_BYTES};
use mladb::ops::Fp8Faults;

const WIDTH: usize = LATENT + ROPE;

/// Every E4M3 value from 0 up, in order.
fn e4m3_grid() -> Vec<f32> {
    let mut v: Vec<f32> = (0..=0x7Eu8).map(kv_fp8::e4m3_to_f32).collect();
    v.sort_by(f32::total_cmp);
    v
}

/// Rows that exercise the codec's edges, then random rows of varied magnitudes.
fn test_rows(rng: &mut common::Lcg, random: usize) -> Vec<Vec<f32>> {
    let grid = e4m3_grid();
    let mut rows = Vec::new();
    // All zeros (scale at its floor), and negative zeros.
    rows.push(vec![0.0; WIDTH]);
    rows.push(vec![-0.0; WIDTH]);
    // Exact ties: a tile whose amax is 448·2^k has scale 2^k, so midpoints of the grid stay
    // midpoints after the division; both parities, subnormals included, both signs.
    for k in [-12, -3, 0, 5] {
        let s = 2f32.powi(k);
        let mut row = vec![0f32; WIDTH];
        for (i, v) in row.iter_mut().enumerate().take(LATENT) {
            let j = 1 + i % (grid.len() - 2);
            let mid = (grid[j] + grid[j + 1]) / 2.0;
            let sign = if (i / 7) % 2 == 0 { 1.0 } else { -1.0 };
            *v = sign * mid * s;
        }
        for t in 0..LATENT / TILE {
            row[t * TILE] = E4M3_MAX * s; // the tile's amax
        }
        for (i, v) in row[LATENT..].iter_mut().enumerate() {
            *v = (i as f32 - 31.5) * 0.37;
        }
        rows.push(row);
    }
    // NaN and infinity in a tile, values below half the smallest subnormal, huge values.
    let mut odd = vec![1e-3f32; WIDTH];
    odd[3] = f32::NAN;
    odd[TILE + 5] = f32::INFINITY;
    odd[2 * TILE] = 3e38;
    odd[2 * TILE + 1] = 1e-30;
    odd[3 * TILE + 9] = -1e-12;
    odd[LATENT + 1] = f32::NAN;
    rows.push(odd);
    // Values past 448 (they saturate under fp8-scale-default).
    rows.push((0..WIDTH).map(|i| (i as f32 - 288.0) * 3.1).collect());
    for _ in 0..random {
        let row = (0..WIDTH)
            .map(|i| {
                let tile_mag = 10f32.powi((i / TILE) as i32 * 2 - 4);
                (rng.next_f32() * 2.0 - 1.0) * tile_mag * 10f32.powf(rng.next_f32() * 2.0 - 1.0)
            })
            .collect();
        rows.push(row);
    }
    rows
}

/// The host's byte cache of `slots` slots (filled with 0xA5) after the CPU codec wrote each row
/// at its slot.
fn host_cache(rows: &[Vec<f32>], at: &[usize], slots: usize, faults: Fp8Faults) -> Vec<u8> {
    let mut cache = vec![0xA5u8; slots * TOKEN_BYTES];
    for (row, &s) in rows.iter().zip(at) {
        let out = &mut cache[s * TOKEN_BYTES..(s + 1) * TOKEN_BYTES];
        kv_fp8::encode_token_with(&row[..LATENT], &row[LATENT..], out, faults).unwrap();
    }
    cache
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn the_write_kernel_writes_the_codec_bytes() {
    let backend = common::cuda_backend(StorageDtype::Bf16);
    let gpu: &Gpu = backend.gpu();
    let seed = common::seed();
    let mut rng = common::Lcg::new(seed ^ 0xf8);
    let rows = test_rows(&mut rng, 300);
    // Scattered over five pages, in a shuffled order, some slots left unwritten.
    let slots = 5 * PAGE;
    let mut order: Vec<usize> = (0..slots).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.next_u64() as usize % (i + 1));
    }
    let at: Vec<usize> = order[..rows.len()].to_vec();
    let d_slots = gpu
        .upload_i32(&at.iter().map(|&s| s as i32).collect::<Vec<_>>())
        .unwrap();
    for bits in 0..4u32 {
        let faults = Fp8Faults {
            scale_default: bits & 1 != 0,
            amax_padded: bits & 2 != 0,
        };
        for elem in [Elem::F32, Elem::Bf16] {
            // bf16 rows are the codec's input rounded to bf16, as the device holds them.
            let input: Vec<Vec<f32>> = rows
                .iter()
                .map(|r| match elem {
                    Elem::F32 => r.clone(),
                    Elem::Bf16 => r
                        .iter()
                        .map(|&v| half::bf16::from_f32(v).to_f32())
                        .collect(),
                })
                .collect();
            let want = host_cache(&input, &at, slots, faults);
            let d_cache = gpu
                .upload_bytes(&vec![0xA5u8; slots * TOKEN_BYTES])
                .unwrap();
            let flat: Vec<f32> = input.concat();
            let d_rows = gpu.upload(&flat, elem).unwrap();
            gpu.kv_fp8_write(&d_rows, &d_slots, &d_cache, rows.len(), faults.bits())
                .unwrap();
            let got = gpu.download_vec(&d_cache, slots * TOKEN_BYTES).unwrap();
            if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
                let (slot, byte) = (i / TOKEN_BYTES, i % TOKEN_BYTES);
                let row = at.iter().position(|&s| s == slot);
                panic!(
                    "{elem:?} rows, faults {faults:?}: slot {slot} (row {row:?}) byte {byte}: \
                     device {:#04x}, codec {:#04x} (seed {seed})",
                    got[i], want[i]
                );
            }
        }
    }
    // Bad arguments are errors, not launches.
    let d_cache = gpu.upload_bytes(&vec![0u8; TOKEN_BYTES * 2]).unwrap();
    let d_rows = gpu.upload(&rows[0], Elem::F32).unwrap();
    assert!(gpu.kv_fp8_write(&d_rows, &d_slots, &d_cache, 1, 0).is_err());
    let one = gpu.upload_i32(&[1]).unwrap();
    assert!(gpu.kv_fp8_write(&d_rows, &one, &d_cache, 2, 0).is_err());
    assert!(gpu.kv_fp8_write(&d_rows, &one, &d_cache, 1, 4).is_err());
}

/// Decodes `bytes` (a whole byte cache) to rows: exactly, or each value rounded to bf16 (what
/// the converting variants' shared tiles hold).
fn decoded(bytes: &[u8], to_bf16: bool) -> Vec<f32> {
    let mut out = Vec::with_capacity(bytes.len() / TOKEN_BYTES * WIDTH);
    for slot in bytes.chunks(TOKEN_BYTES) {
        let (mut l, mut r) = (vec![0f32; LATENT], vec![0f32; ROPE]);
        kv_fp8::decode_token(slot, &mut l, &mut r).unwrap();
        out.extend(l.iter().chain(&r).map(|&v| match to_bf16 {
            true => half::bf16::from_f32(v).to_f32(),
            false => v,
        }));
    }
    out
}

/// A converting kernel's outputs and log-sum-exps ([batch, heads, 512] and [batch, heads]) bit
/// for bit its bf16 `twin`'s over a bf16 copy of the decoded rows; where not, the count of
/// values that differ, the (sequence, head, dim) of the first and the heads they fall in.
fn same_bits(
    what: &str,
    twin: &str,
    heads: usize,
    (out, lse): (&[f32], &[f32]),
    (t_out, t_lse): (&[f32], &[f32]),
) {
    let differs: Vec<usize> = (0..out.len())
        .filter(|&i| out[i].to_bits() != t_out[i].to_bits())
        .collect();
    let lse_differs = (0..lse.len())
        .filter(|&i| lse[i].to_bits() != t_lse[i].to_bits())
        .count();
    assert!(
        differs.is_empty() && lse_differs == 0,
        "{what}: differs from {twin} over the decoded rows: {} values (the first at sequence, \
         head, dim {:?}; heads {:?}), {lse_differs} log-sum-exps",
        differs.len(),
        differs
            .first()
            .map(|&i| (i / (heads * LATENT), i / LATENT % heads, i % LATENT)),
        differs
            .iter()
            .map(|&i| i / LATENT % heads)
            .collect::<std::collections::BTreeSet<_>>(),
    );
}

/// Every FP8-cache decode variant the device runs, at `heads` heads (`all`: every variant, else
/// the few-heads kernels and the wgmma one), over sequences of `lens` tokens and 1, 4 and 40
/// splits: against the f64 reference over the decoded rows, and (the converting variants, the
/// wgmma one among them) bit for bit against the bf16 twin over a bf16 copy of them.
fn fp8_decode_case(gpu: &Gpu, heads: usize, lens: &[usize], all: bool) {
    let seed = common::seed();
    let mut rng = common::Lcg::new(seed ^ 0xdec8 ^ heads as u64);
    let batch = lens.len();
    let longest = lens.iter().copied().max().unwrap();
    // Pages in order, three spare; every slot written: rows of varied tile magnitudes, each row
    // scaled by its own power of ten (so the scales grow and shrink along a sequence), some rows
    // all zero (scales at their floor).
    let max_pages = longest.div_ceil(PAGE);
    let total_pages = batch * max_pages + 3;
    let table: Vec<i32> = (0..batch * max_pages).map(|p| (p + 3) as i32).collect();
    let rows: Vec<Vec<f32>> = (0..total_pages * PAGE)
        .map(|slot| {
            let row_mag = 10f32.powi((rng.next_u64() % 5) as i32 - 2);
            (0..WIDTH)
                .map(|i| match slot % 37 == 5 {
                    true => 0.0,
                    false => {
                        let tile = [1.0, 8.0, 0.05, 0.5, 1.0][i / TILE];
                        (rng.next_f32() * 2.0 - 1.0) * tile * if i < LATENT { row_mag } else { 1.0 }
                    }
                })
                .collect()
        })
        .collect();
    let at: Vec<usize> = (0..rows.len()).collect();
    let bytes = host_cache(&rows, &at, rows.len(), Fp8Faults::default());
    let (exact, rounded) = (decoded(&bytes, false), decoded(&bytes, true));
    // Queries of varied magnitudes per head (the few-heads kernel scales each row into f16).
    let q: Vec<f32> = (0..batch * heads * WIDTH)
        .map(|i| {
            let mag = 10f32.powi(((i / WIDTH) % 4) as i32 - 2);
            half::bf16::from_f32((rng.next_f32() * 2.0 - 1.0) * mag).to_f32()
        })
        .collect();
    let scale = 1.0 / 192f32.sqrt();
    let d_q = gpu.upload(&q, Elem::Bf16).unwrap();
    let d_bytes = gpu.upload_bytes(&bytes).unwrap();
    let d_rounded = gpu.upload(&rounded, Elem::Bf16).unwrap();
    let d_table = gpu.upload_i32(&table).unwrap();
    let d_lens = gpu
        .upload_i32(&lens.iter().map(|&l| l as i32).collect::<Vec<_>>())
        .unwrap();
    let shape = DecodeShape {
        batch,
        heads,
        max_pages,
        max_len: longest,
    };
    let variants: Vec<&str> = fast::fp8_decode_variants_for(gpu)
        .into_iter()
        .filter(|v| all || fast::fp8_twin(v).is_none() || v.contains("wgmma"))
        .collect();
    assert!(
        !variants.is_empty(),
        "no FP8-cache decode variant runs here"
    );
    let outputs = |gpu: &Gpu| {
        let out = gpu.alloc(batch * heads * LATENT, Elem::Bf16).unwrap();
        let lse = gpu.alloc(batch * heads, Elem::F32).unwrap();
        gpu.fill(&out, true).unwrap();
        gpu.fill(&lse, true).unwrap();
        (out, lse)
    };
    let read =
        |gpu: &Gpu, (o, l): &(DevBuf, DevBuf)| (gpu.download(o).unwrap(), gpu.download(l).unwrap());
    for variant in variants {
        for splits in [1, 4, 40] {
            let work = DecodeWork::for_fp8(gpu, shape, Some(variant), Some(splits)).unwrap();
            assert_eq!(work.kernel, variant);
            let got = outputs(gpu);
            fast::mla_decode_fp8(
                gpu, shape, &d_q, &d_bytes, &d_table, &d_lens, scale, &got.0, &got.1, &work,
            )
            .unwrap();
            let (out, lse) = read(gpu, &got);
            let what = format!("{variant}, {heads} heads, {splits} splits (seed {seed})");
            // The converting variants: the same tiles in shared memory, the same MMAs as their
            // twin over the bf16 copy: the same bits. Their reference is that copy.
            let twin = fast::fp8_twin(variant);
            if let Some(twin) = twin {
                let bf16_work = DecodeWork::with_variant(gpu, shape, splits, Some(twin)).unwrap();
                let want = outputs(gpu);
                fast::mla_decode(
                    gpu, shape, &d_q, &d_rounded, &d_table, &d_lens, scale, &want.0, &want.1,
                    &bf16_work,
                )
                .unwrap();
                let (twin_out, twin_lse) = read(gpu, &want);
                same_bits(&what, twin, heads, (&out, &lse), (&twin_out, &twin_lse));
            }
            let cache = if twin.is_some() { &rounded } else { &exact };
            let (mut worst, mut worst_lse): (f64, f64) = (0.0, 0.0);
            for (b, &len) in lens.iter().enumerate() {
                for h in 0..heads {
                    let row = (b * heads + h) * LATENT;
                    if len == 0 {
                        assert!(out[row..row + LATENT].iter().all(|&x| x == 0.0), "{what}");
                        assert_eq!(lse[b * heads + h], f32::NEG_INFINITY, "{what}");
                        continue;
                    }
                    let qv = &q[(b * heads + h) * WIDTH..][..WIDTH];
                    let key = |t: usize| {
                        let page = table[b * max_pages + t / PAGE] as usize;
                        &cache[(page * PAGE + t % PAGE) * WIDTH..][..WIDTH]
                    };
                    let reference = fast::reference_attention(
                        qv,
                        (0..len).map(|t| (key(t), &key(t)[..LATENT])),
                        scale as f64,
                    );
                    worst = worst.max(fast::relative_error(&out[row..row + LATENT], &reference));
                    // The log-sum-exp of the scores, in f64.
                    let scores: Vec<f64> = (0..len)
                        .map(|t| {
                            qv.iter()
                                .zip(key(t))
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum::<f64>()
                                * scale as f64
                        })
                        .collect();
                    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let want = m + scores.iter().map(|s| (s - m).exp()).sum::<f64>().ln();
                    worst_lse = worst_lse
                        .max((lse[b * heads + h] as f64 - want).abs() / want.abs().max(1.0));
                }
            }
            eprintln!("{what}: worst relative error {worst:.2e}, lse {worst_lse:.2e}");
            assert!(worst < 1e-2, "{what}: relative error {worst}");
            assert!(worst_lse < 1e-3, "{what}: lse error {worst_lse}");
        }
    }
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn every_fp8_decode_variant_matches_the_reference_and_its_bf16_twin() {
    let backend = common::cuda_backend(StorageDtype::Bf16);
    let gpu: &Gpu = backend.gpu();
    fp8_decode_case(gpu, 16, &[1, 77, 0, 300, 130], true);
    // The few-heads kernels and the wgmma one at a rank's head counts, and over two groups of
    // either (the last padded).
    for heads in [1, 8, 19, 70] {
        fp8_decode_case(gpu, heads, &[33, 0, 700, 64, 5], false);
    }
    // A variant without an FP8 form is refused by name.
    let shape = DecodeShape {
        batch: 1,
        heads: 8,
        max_pages: 1,
        max_len: 64,
    };
    assert!(DecodeWork::for_fp8(gpu, shape, Some("mla_decode_kt3"), None).is_err());
}

/// The sparse FP8-cache kernels (the few-heads kernels' forms and the wgmma one) at `heads`
/// heads: each sequence attends to its own list of positions (ragged, with -1 padding inside
/// and after, one list of padding alone, one empty, lists shorter and longer than the context
/// they pick from), against the f64 reference over the exactly decoded rows of the listed
/// positions (the wgmma form, which rounds them to bf16 tiles as FlashMLA's FP8 decode does,
/// over those rounded rows, and bit for bit against its bf16 twin over them).
fn sparse_fp8_case(gpu: &Gpu, heads: usize) {
    let seed = common::seed();
    let mut rng = common::Lcg::new(seed ^ 0x5fa8 ^ heads as u64);
    // (context, list length); the lists pick positions < context with repeats allowed.
    let seqs = [
        (300usize, 200usize),
        (90, 3),
        (2048, 700),
        (64, 0),
        (130, 40),
    ];
    let topk = seqs.iter().map(|s| s.1).max().unwrap();
    let batch = seqs.len();
    let max_pages = seqs.iter().map(|s| s.0.div_ceil(PAGE)).max().unwrap();
    let total_pages = batch * max_pages + 2;
    // Pages shuffled through the table, so a list's rows come from scattered pages.
    let mut pages: Vec<i32> = (0..total_pages as i32).collect();
    for i in (1..pages.len()).rev() {
        pages.swap(i, rng.next_u64() as usize % (i + 1));
    }
    let table: Vec<i32> = pages[..batch * max_pages].to_vec();
    let rows: Vec<Vec<f32>> = (0..total_pages * PAGE)
        .map(|_| {
            let mag = 10f32.powi((rng.next_u64() % 5) as i32 - 2);
            (0..WIDTH)
                .map(|i| (rng.next_f32() * 2.0 - 1.0) * if i < LATENT { mag } else { 1.0 })
                .collect()
        })
        .collect();
    let at: Vec<usize> = (0..rows.len()).collect();
    let bytes = host_cache(&rows, &at, rows.len(), Fp8Faults::default());
    let (exact, rounded) = (decoded(&bytes, false), decoded(&bytes, true));
    let mut indices = vec![-1i32; batch * topk];
    for (b, &(context, len)) in seqs.iter().enumerate() {
        for e in 0..len {
            // Every seventh entry padding; the second list all padding.
            let pad = e % 7 == 3 || b == 1;
            indices[b * topk + e] = if pad {
                -1
            } else {
                (rng.next_u64() % context as u64) as i32
            };
        }
    }
    let q: Vec<f32> = (0..batch * heads * WIDTH)
        .map(|_| half::bf16::from_f32(rng.next_f32() * 2.0 - 1.0).to_f32())
        .collect();
    let scale = 1.0 / 192f32.sqrt();
    let d_q = gpu.upload(&q, Elem::Bf16).unwrap();
    let d_bytes = gpu.upload_bytes(&bytes).unwrap();
    let d_rounded = gpu.upload(&rounded, Elem::Bf16).unwrap();
    let d_table = gpu.upload_i32(&table).unwrap();
    let d_indices = gpu.upload_i32(&indices).unwrap();
    let d_lens = gpu
        .upload_i32(&seqs.iter().map(|s| s.1 as i32).collect::<Vec<_>>())
        .unwrap();
    let shape = DecodeShape {
        batch,
        heads,
        max_pages,
        max_len: topk,
    };
    let variants = fast::sparse_fp8_decode_variants_for(gpu);
    assert!(
        !variants.is_empty(),
        "no sparse FP8-cache decode variant runs here"
    );
    for variant in variants {
        for splits in [1, 3, 40] {
            let work = DecodeWork::for_fp8_sparse(gpu, shape, Some(variant), Some(splits)).unwrap();
            assert_eq!(work.kernel, variant);
            let out = gpu.alloc(batch * heads * LATENT, Elem::Bf16).unwrap();
            let lse = gpu.alloc(batch * heads, Elem::F32).unwrap();
            gpu.fill(&out, true).unwrap();
            gpu.fill(&lse, true).unwrap();
            fast::mla_decode_fp8_sparse(
                gpu,
                shape,
                &d_q,
                &d_bytes,
                &d_table,
                (&d_indices, topk),
                &d_lens,
                scale,
                &out,
                &lse,
                &work,
            )
            .unwrap();
            let (out, lse) = (gpu.download(&out).unwrap(), gpu.download(&lse).unwrap());
            let what = format!("{variant}, {heads} heads, {splits} splits (seed {seed})");
            // The wgmma form converts the rows into bf16 tiles: bit for bit its bf16 twin's
            // results over a bf16 copy of the decoded rows, which is then its reference.
            let converts = variant.contains("wgmma");
            if converts {
                let twin =
                    DecodeWork::sparse(gpu, shape, Some(splits), Some("mla_sparse_wgmma")).unwrap();
                let (t_out, t_lse) = (
                    gpu.alloc(batch * heads * LATENT, Elem::Bf16).unwrap(),
                    gpu.alloc(batch * heads, Elem::F32).unwrap(),
                );
                fast::mla_decode_sparse(
                    gpu,
                    shape,
                    &d_q,
                    &d_rounded,
                    &d_table,
                    (&d_indices, topk),
                    &d_lens,
                    scale,
                    &t_out,
                    &t_lse,
                    &twin,
                )
                .unwrap();
                let (t_out, t_lse) = (gpu.download(&t_out).unwrap(), gpu.download(&t_lse).unwrap());
                same_bits(
                    &what,
                    "mla_sparse_wgmma",
                    heads,
                    (&out, &lse),
                    (&t_out, &t_lse),
                );
            }
            let rows = if converts { &rounded } else { &exact };
            let mut worst: f64 = 0.0;
            for (b, &(_, len)) in seqs.iter().enumerate() {
                let keys: Vec<usize> = indices[b * topk..b * topk + len]
                    .iter()
                    .filter(|&&p| p >= 0)
                    .map(|&p| p as usize)
                    .collect();
                for h in 0..heads {
                    let row = (b * heads + h) * LATENT;
                    if keys.is_empty() {
                        assert!(
                            out[row..row + LATENT].iter().all(|&x| x == 0.0),
                            "{what}: b {b}"
                        );
                        assert_eq!(lse[b * heads + h], f32::NEG_INFINITY, "{what}: b {b}");
                        continue;
                    }
                    let qv = &q[(b * heads + h) * WIDTH..][..WIDTH];
                    let key = |t: usize| {
                        let page = table[b * max_pages + t / PAGE] as usize;
                        &rows[(page * PAGE + t % PAGE) * WIDTH..][..WIDTH]
                    };
                    let reference = fast::reference_attention(
                        qv,
                        keys.iter().map(|&t| (key(t), &key(t)[..LATENT])),
                        scale as f64,
                    );
                    worst = worst.max(fast::relative_error(&out[row..row + LATENT], &reference));
                }
            }
            eprintln!("{what}: worst relative error {worst:.2e}");
            assert!(worst < 1e-2, "{what}: relative error {worst}");
        }
    }
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn the_sparse_fp8_decode_matches_the_reference() {
    let backend = common::cuda_backend(StorageDtype::Bf16);
    let gpu: &Gpu = backend.gpu();
    for heads in [1, 8, 16, 19, 70] {
        sparse_fp8_case(gpu, heads);
    }
    // A converting variant has no sparse form.
    let shape = DecodeShape {
        batch: 1,
        heads: 8,
        max_pages: 1,
        max_len: 64,
    };
    assert!(DecodeWork::for_fp8_sparse(gpu, shape, Some("mla_decode_fp8_ks3"), None).is_err());
}
