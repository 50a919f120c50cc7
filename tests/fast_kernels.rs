//! The tensor-core MLA kernels (decode over the paged latent cache, causal flash prefill)
//! against an f64 reference on fresh random bf16 inputs, outputs poisoned first. GPU only:
//! ignored by default (cargo counts them), run by `tools/gpu_check.sh` with `--include-ignored`.

mod common;

use mladb::backend::cuda::device::{DevBuf, DevI32, Elem, Gpu};
use mladb::backend::cuda::fast::{
    self, DecodeQuery, DecodeShape, DecodeWork, MergeFaults, HEAD_GROUP, LATENT, PAGE, ROPE,
};
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

/// Pages for sequences of `lens` tokens handed out in a shuffled order, as a paged allocator
/// does after churn, with a few pages no sequence uses: (block table [batch, max_pages],
/// max_pages, pages in the cache).
fn shuffled_block_table(rng: &mut common::Lcg, lens: &[usize]) -> (Vec<i32>, usize, usize) {
    let pages_of: Vec<usize> = lens.iter().map(|l| l.div_ceil(PAGE)).collect();
    let total_pages: usize = pages_of.iter().sum::<usize>() + 3;
    let max_pages = *pages_of.iter().max().unwrap();
    let mut order: Vec<usize> = (0..total_pages).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.next_u64() as usize % (i + 1));
    }
    let mut table = vec![0i32; lens.len() * max_pages];
    let mut next = 0;
    for (b, &np) in pages_of.iter().enumerate() {
        for p in 0..np {
            table[b * max_pages + p] = order[next] as i32;
            next += 1;
        }
    }
    (table, max_pages, total_pages)
}

/// The f64 reference of a decode of q [batch, heads, 576] over the paged `cache`: the latent
/// output and natural-log LSE per (sequence, head), in that order.
fn decode_reference(
    q: &[f32],
    heads: usize,
    cache: &[f32],
    table: (&[i32], usize),
    lens: &[usize],
    scale: f64,
) -> Vec<(Vec<f64>, f64)> {
    let keys: Vec<Vec<usize>> = lens.iter().map(|&l| (0..l).collect()).collect();
    keys_reference(q, heads, cache, table, &keys, scale)
}

/// The same over the listed token positions of each sequence (a sparse decode's keys).
fn keys_reference(
    q: &[f32],
    heads: usize,
    cache: &[f32],
    (table, max_pages): (&[i32], usize),
    keys: &[Vec<usize>],
    scale: f64,
) -> Vec<(Vec<f64>, f64)> {
    let width = LATENT + ROPE;
    let mut want = Vec::with_capacity(keys.len() * heads);
    for (b, keys) in keys.iter().enumerate() {
        let row = |t: usize| {
            let page = table[b * max_pages + t / PAGE] as usize;
            let at = (page * PAGE + t % PAGE) * width;
            &cache[at..at + width]
        };
        for h in 0..heads {
            let qv = &q[(b * heads + h) * width..][..width];
            let rows = keys.iter().map(|&t| (row(t), &row(t)[..LATENT]));
            let out = fast::reference_attention(qv, rows, scale);
            let scores: Vec<f64> = keys
                .iter()
                .map(|&t| {
                    qv.iter()
                        .zip(row(t))
                        .map(|(&a, &c)| a as f64 * c as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = top + scores.iter().map(|s| (s - top).exp()).sum::<f64>().ln();
            want.push((out, lse));
        }
    }
    want
}

/// A decode's inputs on the device.
struct DecodeInputs<'a> {
    /// Joined for every kernel; in parts for those that read the query by TMA.
    q: DecodeQuery<'a>,
    cache: &'a DevBuf,
    table: &'a DevI32,
    /// Tokens per sequence (sparse: entries of its key list).
    lens: &'a DevI32,
    scale: f32,
    /// The key lists [batch, topk] of a sparse decode.
    keys: Option<(&'a DevI32, usize)>,
}

/// A dense decode's device buffers: the joined query, the cache, the block table, the lengths.
struct DenseBufs {
    q: DevBuf,
    cache: DevBuf,
    table: DevI32,
    lens: DevI32,
}

impl DenseBufs {
    fn upload(gpu: &Gpu, q: &[f32], cache: &[f32], table: &[i32], lens: &[usize]) -> Self {
        let lens: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
        DenseBufs {
            q: gpu.upload(q, Elem::Bf16).unwrap(),
            cache: gpu.upload(cache, Elem::Bf16).unwrap(),
            table: gpu.upload_i32(table).unwrap(),
            lens: gpu.upload_i32(&lens).unwrap(),
        }
    }

    fn inputs(&self, scale: f32) -> DecodeInputs<'_> {
        DecodeInputs {
            q: DecodeQuery::Joined(&self.q),
            cache: &self.cache,
            table: &self.table,
            lens: &self.lens,
            scale,
            keys: None,
        }
    }
}

/// Rows after the batch's in the output buffers, holding [`SENTINEL`]: a head group's padding
/// rows (at most `HEAD_GROUP` − 1 of them) written by mistake would land there.
const TAIL_ROWS: usize = HEAD_GROUP;
/// Exact in bf16 and far from anything a decode writes (outputs lie in [-1, 1]).
const SENTINEL: f32 = -1536.0;

/// One decode launch into outputs poisoned first (an unwritten row reads NaN) and followed by
/// [`TAIL_ROWS`] sentinel rows, which it must leave alone: (out, lse) of the batch's rows.
fn run_decode(
    gpu: &Gpu,
    shape: DecodeShape,
    input: &DecodeInputs,
    work: &DecodeWork,
) -> (Vec<f32>, Vec<f32>) {
    let rows = shape.batch * shape.heads;
    let mut out = gpu.alloc((rows + TAIL_ROWS) * LATENT, Elem::Bf16).unwrap();
    let mut lse = gpu.alloc(rows + TAIL_ROWS, Elem::F32).unwrap();
    gpu.fill(&out, true).unwrap();
    gpu.fill(&lse, true).unwrap();
    gpu.write(&mut out, rows * LATENT, &vec![SENTINEL; TAIL_ROWS * LATENT])
        .unwrap();
    gpu.write(&mut lse, rows, &[SENTINEL; TAIL_ROWS]).unwrap();
    let launches = match input.keys {
        None => fast::mla_decode(
            gpu,
            shape,
            input.q,
            input.cache,
            input.table,
            input.lens,
            input.scale,
            &out,
            &lse,
            work,
        ),
        Some(keys) => fast::mla_decode_sparse(
            gpu,
            shape,
            match input.q {
                DecodeQuery::Joined(q) => q,
                DecodeQuery::Parts { .. } => panic!("the sparse decodes here take a joined query"),
            },
            input.cache,
            input.table,
            keys,
            input.lens,
            input.scale,
            &out,
            &lse,
            work,
        ),
    }
    .unwrap();
    // The wgmma kernels at two splits merge them inside the kernel (clusters of two blocks):
    // one launch; other split decodes launch a merge after the split kernel.
    let paired = work.pairs_splits(gpu);
    // (A merge fault keeps them apart: the faults live in the merge kernel.)
    let pairable = !work.merge_faults().any();
    if fast::PAIR_MERGE_KERNELS.contains(&work.kernel) && work.splits == 2 && pairable {
        assert!(
            paired,
            "{}: two splits on this device pair in clusters",
            work.kernel
        );
    }
    let want_launches = if work.splits == 1 || paired { 1 } else { 2 };
    assert_eq!(
        launches.len(),
        want_launches,
        "{}, {} splits: {launches:?}",
        work.kernel,
        work.splits
    );
    let mut got = gpu.download(&out).unwrap();
    let mut got_lse = gpu.download(&lse).unwrap();
    let what = format!(
        "{}, {} heads, {} splits",
        work.kernel, shape.heads, work.splits
    );
    let tail = got.split_off(rows * LATENT);
    let tail_lse = got_lse.split_off(rows);
    if let Some(i) = tail.iter().position(|&x| x != SENTINEL) {
        panic!(
            "{what}: wrote {} past the output's last row (row {} after it)",
            tail[i],
            i / LATENT
        );
    }
    if let Some(i) = tail_lse.iter().position(|&x| x != SENTINEL) {
        panic!(
            "{what}: wrote lse {} past the last row ({i} after it)",
            tail_lse[i]
        );
    }
    (got, got_lse)
}

/// Checks a decode's `out` [batch, heads, 512] and `lse` [batch, heads] against `want(b, h)`
/// (the reference's output and LSE): an empty sequence must give zeros and an LSE of −inf, the
/// others LSEs within 2% (or 0.02); returns the worst relative error of an output row.
fn check_decode<'a>(
    (got, got_lse): (&[f32], &[f32]),
    lens: &[usize],
    heads: usize,
    want: impl Fn(usize, usize) -> &'a (Vec<f64>, f64),
    what: &str,
) -> f64 {
    let mut worst: f64 = 0.0;
    for (b, &len) in lens.iter().enumerate() {
        for h in 0..heads {
            let got_row = &got[(b * heads + h) * LATENT..][..LATENT];
            let l = got_lse[b * heads + h] as f64;
            if len == 0 {
                assert!(
                    got_row.iter().all(|&x| x == 0.0) && l == f64::NEG_INFINITY,
                    "{what}: empty sequence {b} head {h} gave lse {l}"
                );
                continue;
            }
            let (want_out, want_lse) = want(b, h);
            worst = worst.max(fast::relative_error(got_row, want_out));
            assert!(
                (l - want_lse).abs() < 2e-2 * want_lse.abs().max(1.0),
                "{what}: lse of sequence {b} head {h}: {l} vs {want_lse}"
            );
        }
    }
    worst
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
    let (table, max_pages, total_pages) = shuffled_block_table(&mut rng, &lens);
    let cache = random_bf16(&mut rng, total_pages * PAGE * width, 1.0);
    let q = random_bf16(&mut rng, batch * heads * width, 1.0);
    // Every kernel variant the device can run; for each, the split count the device would
    // choose, one split (the kernel writes the result itself), two (as a full batch runs), an
    // odd count that leaves some splits of the short sequences empty (merged per row), and 40
    // (the block-wide merge).
    let what = format!("{batch} sequences × {heads} heads (seed {seed})");
    let case = (&q[..], &cache[..], (&table[..], max_pages), &lens[..]);
    every_variant_matches(gpu, case, heads, &[1, 2, 7, 40], &what);
}

/// A dense decode's host inputs: query, cache, (block table, pages per sequence), lengths.
type DenseCase<'a> = (&'a [f32], &'a [f32], (&'a [i32], usize), &'a [usize]);

/// A dense decode on every decode
/// variant the device can run, at the split count the device would choose and each of `splits`,
/// against the f64 reference: each within 1e-2.
fn every_variant_matches(
    gpu: &Gpu,
    (q, cache, (table, max_pages), lens): DenseCase,
    heads: usize,
    splits: &[usize],
    what: &str,
) {
    let scale = 1.0 / (192.0f32).sqrt();
    let shape = DecodeShape {
        batch: lens.len(),
        heads,
        max_pages,
        max_len: *lens.iter().max().unwrap(),
    };
    let want = decode_reference(q, heads, cache, (table, max_pages), lens, scale as f64);
    let bufs = DenseBufs::upload(gpu, q, cache, table, lens);
    let input = bufs.inputs(scale);
    let chosen = DecodeWork::new(gpu, shape).unwrap().splits;
    let variants = fast::decode_variants_for(gpu);
    assert!(!variants.is_empty(), "no decode variant fits the device");
    for variant in variants {
        for &splits in std::iter::once(&chosen).chain(splits) {
            let work = DecodeWork::with_variant(gpu, shape, splits, Some(variant)).unwrap();
            let got = run_decode(gpu, shape, &input, &work);
            let what = format!("{variant}, {splits} splits, {what}");
            let worst = check_decode(
                (&got.0, &got.1),
                lens,
                heads,
                |b, h| &want[b * heads + h],
                &what,
            );
            eprintln!("decode {what}: worst relative error {worst:.2e}");
            assert!(worst < 1e-2, "decode {what}: relative error {worst}");
        }
    }
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn decode_runs_every_head_count() {
    let backend = gpu();
    let gpu: &Gpu = backend.gpu();
    let seed = common::seed();
    let mut rng = common::Lcg::new(seed ^ 0x4ead);
    eprintln!("seed {seed}");
    let width = LATENT + ROPE;
    // A token, a page and a bit, several pages ending mid-tile, one shorter than a tile, a
    // whole page, and two pages and a bit. Six sequences put 96 heads and more on the per-row
    // merge (batch · heads ≥ 512), fewer on the block-wide one.
    let lens = [1usize, 70, 300, 17, 64, 130];
    // The same with the last sequence empty: its blocks then take the empty-split path, whose
    // padding rows would overrun the buffers' end.
    let mut lens_last_empty = lens;
    lens_last_empty[lens.len() - 1] = 0;
    let batch = lens.len();
    let (table, max_pages, total_pages) = shuffled_block_table(&mut rng, &lens);
    let cache = random_bf16(&mut rng, total_pages * PAGE * width, 1.0);
    // Queries of 128 heads; a run with fewer takes each sequence's first ones, so one
    // reference serves every head count.
    let most = 128;
    let q_all = random_bf16(&mut rng, batch * most * width, 1.0);
    let scale = 1.0 / (192.0f32).sqrt();
    let want = decode_reference(
        &q_all,
        most,
        &cache,
        (&table, max_pages),
        &lens,
        scale as f64,
    );
    let d_cache = gpu.upload(&cache, Elem::Bf16).unwrap();
    let d_table = gpu.upload_i32(&table).unwrap();
    let upload_lens = |lens: &[usize]| {
        gpu.upload_i32(&lens.iter().map(|&l| l as i32).collect::<Vec<_>>())
            .unwrap()
    };
    let runs = [
        (lens, upload_lens(&lens)),
        (lens_last_empty, upload_lens(&lens_last_empty)),
    ];
    let variants = fast::decode_variants_for(gpu);
    assert!(!variants.is_empty(), "no decode variant fits the device");
    let mut worst = vec![0.0f64; variants.len()];
    for heads in [1, 2, 3, 5, 8, 16, 24, 32, 48, 63, 64, 65, 96, 127, 128] {
        let q: Vec<f32> = (0..batch)
            .flat_map(|b| q_all[b * most * width..][..heads * width].iter().copied())
            .collect();
        let d_q = gpu.upload(&q, Elem::Bf16).unwrap();
        let shape = DecodeShape {
            batch,
            heads,
            max_pages,
            max_len: *lens.iter().max().unwrap(),
        };
        for (v, variant) in variants.iter().enumerate() {
            // One split (the kernel writes out and lse itself) and five (the last split of the
            // 300-token sequence ends mid-tile; the short sequences leave splits empty).
            for splits in [1, 2, 5] {
                let work = DecodeWork::with_variant(gpu, shape, splits, Some(variant)).unwrap();
                for (lens, d_lens) in &runs {
                    let input = DecodeInputs {
                        q: DecodeQuery::Joined(&d_q),
                        cache: &d_cache,
                        table: &d_table,
                        lens: d_lens,
                        scale,
                        keys: None,
                    };
                    let got = run_decode(gpu, shape, &input, &work);
                    let what = format!(
                        "{variant}, {heads} heads, {splits} splits, lengths {lens:?} (seed {seed})"
                    );
                    let err = check_decode(
                        (&got.0, &got.1),
                        lens,
                        heads,
                        |b, h| &want[b * most + h],
                        &what,
                    );
                    assert!(err < 1e-2, "decode {what}: relative error {err}");
                    worst[v] = worst[v].max(err);
                }
            }
        }
    }
    for (variant, worst) in variants.iter().zip(&worst) {
        eprintln!("decode {variant}: worst relative error {worst:.2e} over heads 1 to 128, 1 and 5 splits");
    }
}

/// A plan holds split partials only where its launch writes them: none at one split, none for
/// two splits merged inside the kernel (the wgmma kernels' clusters of two), all of them at five;
/// and a merge fault planted in a pair (the merge kernel then runs) makes them, the decode still
/// matching the reference. Before, every plan held batch × splits × heads × 512 f32 (16.8 MB at
/// batch 64 × 64 heads, paired) whether read or not.
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn partials_are_made_only_where_the_merge_reads_them() {
    let backend = gpu();
    let gpu: &Gpu = backend.gpu();
    let seed = common::seed();
    let mut rng = common::Lcg::new(seed ^ 0x9a57);
    eprintln!("seed {seed}");
    let width = LATENT + ROPE;
    let lens = [200usize, 64, 131];
    let heads = 64;
    let (table, max_pages, total_pages) = shuffled_block_table(&mut rng, &lens);
    let cache = random_bf16(&mut rng, total_pages * PAGE * width, 1.0);
    let q = random_bf16(&mut rng, lens.len() * heads * width, 1.0);
    let scale = 1.0 / (192.0f32).sqrt();
    let want = decode_reference(&q, heads, &cache, (&table, max_pages), &lens, scale as f64);
    let bufs = DenseBufs::upload(gpu, &q, &cache, &table, &lens);
    let shape = DecodeShape {
        batch: lens.len(),
        heads,
        max_pages,
        max_len: 200,
    };
    let rows = lens.len() * heads;
    // The outputs in bf16 (half the bytes of f32 to write and read back), the log-sum-exps
    // in f32.
    let held = |work: DecodeWork| {
        let (o, l) = work.into_partials();
        assert_eq!((o.elem(), l.elem()), (Elem::Bf16, Elem::F32));
        (o.len(), l.len())
    };
    let mut pairs = 0;
    for variant in fast::decode_variants_for(gpu) {
        for splits in [1, 2, 5] {
            let work = DecodeWork::with_variant(gpu, shape, splits, Some(variant)).unwrap();
            let paired = work.pairs_splits(gpu);
            pairs += usize::from(paired);
            let writes = splits > 1 && !paired;
            assert_eq!(
                work.writes_partials(gpu),
                writes,
                "{variant}, {splits} splits"
            );
            let (o, l) = held(work);
            let what = format!("{variant}, {splits} splits: partials of {o} and {l}");
            if writes {
                assert!(o >= rows * splits * LATENT && l >= rows * splits, "{what}");
            } else {
                assert!(o < LATENT && l < LATENT, "{what}, never read");
            }
            // A merge fault sends every split launch through the merge kernel. With every
            // sequence holding keys, skip-padded-rows changes nothing: the reference's output.
            let mut work = DecodeWork::with_variant(gpu, shape, splits, Some(variant)).unwrap();
            let fault = MergeFaults {
                lse_base: false,
                skip_empty_rows: true,
            };
            work.plant_merge_faults(gpu, fault).unwrap();
            assert_eq!(work.writes_partials(gpu), splits > 1, "{what}, planted");
            let got = run_decode(gpu, shape, &bufs.inputs(scale), &work);
            let what =
                format!("{variant}, {splits} splits, skip-padded-rows planted (seed {seed})");
            let worst = check_decode(
                (&got.0, &got.1),
                &lens,
                heads,
                |b, h| &want[b * heads + h],
                &what,
            );
            assert!(worst < 1e-2, "decode {what}: relative error {worst}");
            assert!(
                held(work).0 >= rows * splits * LATENT || splits == 1,
                "{what}"
            );
        }
    }
    if pairs == 0 {
        eprintln!(
            "note: no plan on this device merges its splits in the kernel (sm_90 wgmma only)"
        );
    }
}

/// Scores that keep rising along a sequence, so that a row's running maximum is raised again
/// and again, by more and by less than the Hopper kernels' lazy-rescale slack (8 in base 2),
/// the rest of the tiles exponentiated against a maximum that is not the latest: every variant
/// against the reference, as fast_kernels' random scores (which settle within a tile or two)
/// cannot show. The ramp lives in the first RoPE dim, so the values stay random in [-1, 1).
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn rising_scores_decode_as_the_reference() {
    let backend = gpu();
    let gpu: &Gpu = backend.gpu();
    let seed = common::seed();
    let mut rng = common::Lcg::new(seed ^ 0x2a3e);
    eprintln!("seed {seed}");
    let width = LATENT + ROPE;
    let lens = [40usize, 300, 1000, 2100];
    let heads = 64;
    let batch = lens.len();
    let (table, max_pages, total_pages) = shuffled_block_table(&mut rng, &lens);
    let mut cache = random_bf16(&mut rng, total_pages * PAGE * width, 1.0);
    let mut q = random_bf16(&mut rng, batch * heads * width, 1.0);
    // Key t of sequence b: -16 at its first token up to 16 at its last (a sawtooth of four
    // teeth in the longest, so the maximum also stays put for a while); the queries' 32 there
    // makes the scores span about 100 in base 2.
    for (b, &len) in lens.iter().enumerate() {
        for t in 0..len {
            let frac = if b == batch - 1 {
                (4 * t % len) as f32 / len as f32
            } else {
                t as f32 / len as f32
            };
            let page = table[b * max_pages + t / PAGE] as usize;
            cache[(page * PAGE + t % PAGE) * width + LATENT] =
                half::bf16::from_f32(-16.0 + 32.0 * frac).to_f32();
        }
        for h in 0..heads {
            q[(b * heads + h) * width + LATENT] = 32.0;
        }
    }
    let what = format!("rising scores (seed {seed})");
    let case = (&q[..], &cache[..], (&table[..], max_pages), &lens[..]);
    every_variant_matches(gpu, case, heads, &[1, 2, 7], &what);
}

/// The wgmma kernels read the query's latent and RoPE parts where the engine made them (no
/// joined copy): the same bits as from the joined query, at head counts whose groups start at
/// other rows, at one, two (paired) and five splits, in a padded batch whose last sequences
/// have no rows in the parts (read as zeros). A kernel that reads the query by pointer refuses
/// the parts.
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn a_query_in_parts_decodes_as_the_joined_one() {
    let backend = gpu();
    let gpu: &Gpu = backend.gpu();
    let seed = common::seed();
    let mut rng = common::Lcg::new(seed ^ 0x9a27);
    eprintln!("seed {seed}");
    let width = LATENT + ROPE;
    // Two sequences of padding at the end: no keys, and no rows in the query's parts.
    let lens = [300usize, 1, 129, 0, 0];
    let real = 3;
    let batch = lens.len();
    let (table, max_pages, total_pages) = shuffled_block_table(&mut rng, &lens);
    let cache = random_bf16(&mut rng, total_pages * PAGE * width, 1.0);
    let d_cache = gpu.upload(&cache, Elem::Bf16).unwrap();
    let d_table = gpu.upload_i32(&table).unwrap();
    let d_lens = gpu
        .upload_i32(&lens.iter().map(|&l| l as i32).collect::<Vec<_>>())
        .unwrap();
    let variants = fast::decode_variants_for(gpu);
    let (by_tma, by_pointer): (Vec<&str>, Vec<&str>) =
        variants.iter().partition(|v| fast::reads_query_by_tma(v));
    if by_tma.is_empty() {
        eprintln!("skipped: no decode kernel on this device reads the query by TMA ({variants:?})");
        return;
    }
    for heads in [8, 64, 128] {
        let rows = real * heads;
        let mut q = random_bf16(&mut rng, batch * heads * width, 1.0);
        q[rows * width..].fill(0.0);
        let latent: Vec<f32> = (0..rows)
            .flat_map(|r| q[r * width..][..LATENT].to_vec())
            .collect();
        let rope: Vec<f32> = (0..rows)
            .flat_map(|r| q[r * width + LATENT..][..ROPE].to_vec())
            .collect();
        let d_q = gpu.upload(&q, Elem::Bf16).unwrap();
        let (d_latent, d_rope) = (
            gpu.upload(&latent, Elem::Bf16).unwrap(),
            gpu.upload(&rope, Elem::Bf16).unwrap(),
        );
        let parts = DecodeQuery::Parts {
            latent: &d_latent,
            rope: &d_rope,
        };
        let shape = DecodeShape {
            batch,
            heads,
            max_pages,
            max_len: *lens.iter().max().unwrap(),
        };
        let input = |q| DecodeInputs {
            q,
            cache: &d_cache,
            table: &d_table,
            lens: &d_lens,
            scale: 0.07,
            keys: None,
        };
        for variant in &by_tma {
            for splits in [1, 2, 5] {
                let work = DecodeWork::with_variant(gpu, shape, splits, Some(variant)).unwrap();
                let joined = run_decode(gpu, shape, &input(DecodeQuery::Joined(&d_q)), &work);
                let apart = run_decode(gpu, shape, &input(parts), &work);
                let what = format!("{variant}, {heads} heads, {splits} splits (seed {seed})");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert!(bits(&joined.0) == bits(&apart.0), "{what}: outputs differ");
                assert!(bits(&joined.1) == bits(&apart.1), "{what}: lse differ");
            }
        }
        for variant in &by_pointer {
            let work = DecodeWork::with_variant(gpu, shape, 1, Some(variant)).unwrap();
            let (out, lse) = (
                gpu.alloc(batch * heads * LATENT, Elem::Bf16).unwrap(),
                gpu.alloc(batch * heads, Elem::F32).unwrap(),
            );
            let r = fast::mla_decode(
                gpu, shape, parts, &d_cache, &d_table, &d_lens, 0.07, &out, &lse, &work,
            );
            assert!(r.is_err(), "{variant} took a query in parts");
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
    // A length that ends mid-tile over several blocks, and one shorter than a tile; then scores
    // that rise along the sequence (a ramp in the first dim: each row's running maximum is
    // raised again and again, by more and by less than the Hopper kernel's lazy-rescale slack);
    // then more heads than one chunk of the block order holds (kernels/common.cuh,
    // `longest_first`: 70 heads of 300 tokens run in two chunks on 132 multiprocessors).
    for (n, heads, rising) in [
        (300usize, 3usize, false),
        (45, 2, false),
        (700, 2, true),
        (300, 70, false),
    ] {
        for (dqk, dv) in fast::PREFILL_DIMS {
            let mut q = random_bf16(&mut rng, n * heads * dqk, 1.0);
            let mut k = random_bf16(&mut rng, n * heads * dqk, 1.0);
            if rising {
                for j in 0..n {
                    for h in 0..heads {
                        q[(j * heads + h) * dqk] = 32.0;
                        let ramp = -16.0 + 32.0 * j as f32 / n as f32;
                        k[(j * heads + h) * dqk] = half::bf16::from_f32(ramp).to_f32();
                    }
                }
            }
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

/// `count` distinct positions of 0..context in random order.
fn random_positions(rng: &mut common::Lcg, context: usize, count: usize) -> Vec<usize> {
    let mut all: Vec<usize> = (0..context).collect();
    for i in (1..all.len()).rev() {
        all.swap(i, rng.next_u64() as usize % (i + 1));
    }
    all.truncate(count);
    all
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn sparse_decode_matches_reference() {
    let backend = gpu();
    let gpu: &Gpu = backend.gpu();
    let seed = common::seed();
    let mut rng = common::Lcg::new(seed ^ 0x5ba5);
    eprintln!("seed {seed}");
    let width = LATENT + ROPE;
    // Rows of 300 entries (off the 16/32-entry tile grid) over contexts longer and shorter than
    // that; `None` marks padding (-1), and a list is read up to its length only.
    let topk = 300;
    let contexts = [3000usize, 100, 700, 40, 64, 64, 2100, 500];
    let mut lists: Vec<Vec<Option<usize>>> = Vec::new();
    let sorted = |mut v: Vec<usize>| {
        v.sort_unstable();
        v.into_iter().map(Some).collect::<Vec<_>>()
    };
    // A full list from a long context, sorted.
    lists.push(sorted(random_positions(&mut rng, 3000, topk)));
    // A whole context shorter than topk, padded at the end.
    let mut short = sorted((0..100).collect());
    short.resize(topk, None);
    lists.push(short);
    // Ragged: padding in the middle (every seventh entry) and at the end.
    let mut ragged = sorted(random_positions(&mut rng, 700, 250));
    for (i, e) in ragged.iter_mut().enumerate() {
        if i % 7 == 3 {
            *e = None;
        }
    }
    ragged.resize(topk, None);
    lists.push(ragged);
    // Shorter than a tile, its length short of topk.
    lists.push(sorted(random_positions(&mut rng, 40, 5)));
    // Padding alone, and an empty list.
    lists.push(vec![None; topk]);
    lists.push(Vec::new());
    // Unsorted, and a single key.
    lists.push(
        random_positions(&mut rng, 2100, topk)
            .into_iter()
            .map(Some)
            .collect(),
    );
    lists.push(vec![Some(499)]);
    let batch = lists.len();
    let (table, max_pages, total_pages) = shuffled_block_table(&mut rng, &contexts);
    let cache = random_bf16(&mut rng, total_pages * PAGE * width, 1.0);
    let most = 128;
    let q_all = random_bf16(&mut rng, batch * most * width, 1.0);
    let scale = 1.0 / (192.0f32).sqrt();
    let keys: Vec<Vec<usize>> = lists
        .iter()
        .map(|l| l.iter().flatten().copied().collect())
        .collect();
    let want = keys_reference(
        &q_all,
        most,
        &cache,
        (&table, max_pages),
        &keys,
        scale as f64,
    );
    let mut indices = vec![-1i32; batch * topk];
    for (b, l) in lists.iter().enumerate() {
        for (i, e) in l.iter().enumerate() {
            indices[b * topk + i] = e.map_or(-1, |p| p as i32);
        }
    }
    let list_lens: Vec<i32> = lists.iter().map(|l| l.len() as i32).collect();
    let key_counts: Vec<usize> = keys.iter().map(Vec::len).collect();
    let d_cache = gpu.upload(&cache, Elem::Bf16).unwrap();
    let d_table = gpu.upload_i32(&table).unwrap();
    let d_indices = gpu.upload_i32(&indices).unwrap();
    let d_lens = gpu.upload_i32(&list_lens).unwrap();
    let variants = fast::sparse_decode_variants_for(gpu);
    assert!(
        !variants.is_empty(),
        "no sparse decode variant fits the device"
    );
    for heads in [8, 64, 128] {
        let q: Vec<f32> = (0..batch)
            .flat_map(|b| q_all[b * most * width..][..heads * width].iter().copied())
            .collect();
        let d_q = gpu.upload(&q, Elem::Bf16).unwrap();
        let shape = DecodeShape {
            batch,
            heads,
            max_pages,
            max_len: topk,
        };
        let input = DecodeInputs {
            q: DecodeQuery::Joined(&d_q),
            cache: &d_cache,
            table: &d_table,
            lens: &d_lens,
            scale,
            keys: Some((&d_indices, topk)),
        };
        let chosen = DecodeWork::sparse(gpu, shape, None, None).unwrap().splits;
        for variant in &variants {
            // The device's choice, one split (written directly), two (merged in clusters by the
            // wgmma kernel), three (the 5-entry list leaves two empty), 16 (per-row merge at 64
            // heads and more) and 40 (block-wide merge).
            for splits in [chosen, 1, 2, 3, 16, 40] {
                let work = DecodeWork::sparse(gpu, shape, Some(splits), Some(variant)).unwrap();
                assert_eq!(work.kernel, *variant);
                let got = run_decode(gpu, shape, &input, &work);
                let what = format!("{variant}, {heads} heads, {splits} splits (seed {seed})");
                let worst = check_decode(
                    (&got.0, &got.1),
                    &key_counts,
                    heads,
                    |b, h| &want[b * most + h],
                    &what,
                );
                eprintln!("sparse decode {what}: worst relative error {worst:.2e}");
                assert!(worst < 1e-2, "sparse decode {what}: relative error {worst}");
            }
        }
    }
}
