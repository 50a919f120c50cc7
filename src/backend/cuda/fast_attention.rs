//! The production attention kernels ([`super::fast`]) in the traced path: the absorbed attention
//! of a chunk runs the tensor-core decode over the paged latent cache (each query token a
//! sequence of its own length over the same pages, as a serving batch is, padded to a CUDA-graph
//! capture size with sequences of no keys; with a sparse DSA selection, the sparse decode over
//! each query's own key list), and a whole-sequence naive prefill runs the flash prefill. Each
//! says what it launched, returns its log-sum-exps, split partials and padded rows for the trace,
//! or declines with the reason when the op is one it does not take (head dims it is not built
//! for, f32 storage, a sparse selection on the naive path, a fault planted in the reference
//! kernel), and the engine runs the reference instead.

use super::attention::mirror_buf;
use super::device::fast_kernels::SparseKeys;
use super::device::{DevBuf, Elem};
use super::fast::{
    self, DecodeQuery, DecodeShape, DecodeWork, KeyLists, MergeFaults, LATENT, MAX_SPLITS,
    PREFILL_DIMS, ROPE,
};
use super::fast_fp8::{fp8_kernel_of, fp8_launches};
use super::fp8_cache::fp8_bytes;
use super::{buf, CudaBackend};
use crate::backend::{checks, AttnMask, AttnParams, DeviceRead, FastAttention, FastOutcome};
use crate::error::Result;
use crate::ops::{AttnKernels, KernelFaults, KvCacheDtype, RowSource};
use crate::tensor::{BufferId, DeviceBuffer, Tensor};

/// How many queries of a DSA selection keep fewer than all their keys (0 without one).
fn sparse_queries(mask: &AttnMask) -> usize {
    mask.selected.as_ref().map_or(0, |sel| {
        sel.iter()
            .zip(&mask.positions)
            .filter(|(keys, &p)| keys.len() != p + 1)
            .count()
    })
}

/// Why a fast kernel does not take an op, or `None` when it does; `sparse` says whether it
/// takes a sparse selection (the absorbed path's sparse decode does, the naive prefill not).
fn declines(backend: &CudaBackend, mask: &AttnMask, sparse: bool) -> Option<String> {
    if backend.elem() != Elem::Bf16 {
        return Some("f32 storage (the fast kernels read and write bf16: --dtype bf16)".into());
    }
    let n_sparse = if sparse { 0 } else { sparse_queries(mask) };
    if n_sparse > 0 {
        return Some(format!(
            "a sparse DSA selection ({n_sparse} of {} queries keep fewer than all their keys; \
             the naive path's sparse prefill stays on the reference kernel)",
            mask.positions.len()
        ));
    }
    (mask.positions.is_empty()).then(|| "no queries".into())
}

/// The scale handed to a fast kernel, which converts it for its exp2 softmax. FAULT exp2-scale:
/// it is handed pre-divided by log2 e, so the kernel's exp2 runs on the natural-log scale.
fn kernel_scale(scale: f32, faults: KernelFaults) -> f32 {
    if faults.exp2_scale {
        scale * std::f32::consts::LN_2
    } else {
        scale
    }
}

/// Tokens per split when a fault planted in the decode's merge needs the merge to run.
const FAULT_SPLIT_TOKENS: usize = 64;

/// The batch size a CUDA-graph server (vLLM) captures for a decode batch of `n`: 1, 2, 4, then
/// multiples of 8 up to 512; a larger batch runs eagerly, unpadded.
fn capture_size(n: usize) -> usize {
    match n {
        0..=2 => n,
        3..=4 => 4,
        5..=512 => n.div_ceil(8) * 8,
        _ => n,
    }
}

/// The batch the fast decode launches for `n` queries: padded to its capture size, and under
/// skip-padded-rows to the next one where that pads nothing, so that the fault has a row.
fn padded_batch(n: usize, skip_padded_rows: bool) -> usize {
    match capture_size(n) {
        c if c == n && skip_padded_rows => capture_size(n + 1),
        c => c,
    }
}

impl CudaBackend {
    /// FAULT page-index-overflow: the cache's pages copied past the first 4 GiB of a zeroed
    /// pool larger than that (page p at [`fast::OVERFLOW_PAGE`] + p), as the pages of a busy
    /// server's large pool lie, where the planted kernel's 32-bit offsets wrap to pages 4 GiB
    /// early.
    fn overflow_pool(&self, pages: &DevBuf) -> Result<DevBuf> {
        let at = fast::OVERFLOW_PAGE * fast::PAGE * (LATENT + ROPE);
        let pool = self.gpu().alloc(at + pages.len(), pages.elem())?;
        self.gpu().fill(&pool, false)?;
        self.gpu().copy(pages, 0, &pool, at, pages.len())?;
        Ok(pool)
    }

    /// A fast kernel's output buffer, poisoned so that what the kernel skips shows.
    fn poisoned(&self, len: usize, elem: Elem) -> Result<DevBuf> {
        let buf = self.gpu().alloc(len, elem)?;
        self.gpu().fill(&buf, true)?;
        Ok(buf)
    }

    /// Elements `from..from + len` of `src` in a buffer of their own (`src` itself when whole).
    fn part(&self, src: DevBuf, from: usize, len: usize) -> Result<DevBuf> {
        if from == 0 && len == src.len() {
            return Ok(src);
        }
        let dst = self.gpu().alloc(len, src.elem())?;
        self.gpu().copy(&src, from, &dst, 0, len)?;
        Ok(dst)
    }

    /// See [`crate::backend::Backend::fast_attention_latent`].
    pub(super) fn fast_latent(
        &self,
        q_lat: &Tensor,
        q_pe: &Tensor,
        cache: &dyn RowSource,
        call: AttnParams<'_>,
        out: &mut Tensor,
        kernels: AttnKernels,
    ) -> Result<FastOutcome> {
        let (dims, mask, scale, faults) = call.parts();
        let n = checks::attention_latent(q_lat, q_pe, cache, dims, mask)?;
        checks::attention_out(out, n, dims, dims.latent)?;
        if (dims.latent, dims.rope) != (LATENT, ROPE) {
            return Ok(FastOutcome::Declined(format!(
                "latent rows of {}+{} (the decode kernels are built for {LATENT}+{ROPE})",
                dims.latent, dims.rope
            )));
        }
        if let Some(why) = declines(self, mask, true) {
            return Ok(FastOutcome::Declined(why));
        }
        let longest = mask.positions.iter().max().map_or(0, |p| p + 1);
        if faults.lse_base_mismatch && longest <= FAULT_SPLIT_TOKENS {
            return Ok(FastOutcome::Declined(format!(
                "lse-base-mismatch acts in the fast decode's merge, which splits every \
                 {FAULT_SPLIT_TOKENS} tokens under it; this context ({longest}) is one split"
            )));
        }
        // A sparse selection: every query's list, padded with -1 to the longest.
        let forced = kernels.decode.map(|v| v.kernel());
        let overflow = faults.page_index_overflow;
        let fp8 = cache.kv_cache_dtype() == KvCacheDtype::Fp8DsMla;
        let sparse_selection = sparse_queries(mask) > 0;
        if overflow && (fp8 || sparse_selection) {
            return Ok(FastOutcome::Declined(format!(
                "page-index-overflow is planted in the dense bf16 decode, and this op reads {}",
                if fp8 {
                    "an fp8_ds_mla cache"
                } else {
                    "a sparse DSA selection"
                }
            )));
        }
        let lists = match &mask.selected {
            Some(sel) if sparse_selection => {
                let no_sparse_form = |f: &&str| match fp8 {
                    true => fast::sparse_fp8_form(f).is_none(),
                    false => fast::sparse_twin(f).is_none(),
                };
                if let Some(f) = forced.filter(no_sparse_form) {
                    return Ok(FastOutcome::Declined(format!(
                        "a sparse DSA selection, and the forced decode variant {f} has no sparse \
                         form{}",
                        if fp8 { " over an fp8_ds_mla cache" } else { "" }
                    )));
                }
                Some(fast::key_lists(sel)?)
            }
            _ => None,
        };
        let Some(table) = cache.block_table() else {
            return Ok(FastOutcome::Declined("a latent cache without pages".into()));
        };
        let heads = dims.heads;
        // The padded rows: sequences of length 0 (no keys) with zero queries.
        let padded = padded_batch(n, faults.skip_padded_rows);
        let pad = padded - n;
        let lists = lists.map(|l| l.padded(pad));
        let lens: Vec<usize> = (mask.positions.iter().map(|&p| p + 1))
            .chain(std::iter::repeat_n(0, pad))
            .collect();
        let shape = DecodeShape {
            batch: padded,
            heads,
            max_pages: table.len().max(1),
            max_len: match &lists {
                Some(l) => l.topk,
                None => lens.iter().copied().max().unwrap_or(1),
            },
        };
        // Every query reads the same pages: one table row per query, as a batch would hold (the
        // row repeated on the device, and kept with the cache for the next step). FAULT
        // page-index-overflow: the pages sit past the first 4 GiB of the pool (`overflow_pool`).
        let shift = if overflow { fast::OVERFLOW_PAGE } else { 0 };
        let row: Vec<usize> = (table.iter().copied().chain((table.is_empty()).then_some(0)))
            .map(|page| page + shift)
            .collect();
        let block_table = self.batch_block_table(cache, &row, padded)?;
        let block_table = &*block_table;
        let seq_lens = self.indices(&lens)?;
        // An fp8_ds_mla cache is read by the FP8-cache variants from its byte cache (a sparse
        // selection by the few-heads kernels' sparse forms).
        let fp8_kernel = match (fp8, forced.map(fp8_kernel_of).transpose()) {
            (true, Err(why)) => return Ok(FastOutcome::Declined(why.to_string())),
            (_, Ok(kernel)) => kernel,
            (false, Err(_)) => None,
        };
        // A few-heads variant forced over a bf16 cache: only its sparse form reads bf16 pages.
        if let Some(f) = forced.filter(|f| !fp8 && lists.is_none() && fast::fp8_only(f)) {
            return Ok(FastOutcome::Declined(format!(
                "the forced decode variant {f} has no dense form over a bf16 cache (h8 reads one \
                 only through a sparse selection)"
            )));
        }
        let od = self.dev(out)?;
        // A padded batch is written to a buffer of its own, whose first n rows go to `out`.
        let row = heads * LATENT;
        let padded_out = match pad {
            0 => None,
            _ => Some(self.poisoned(padded * row, Elem::Bf16)?),
        };
        let merge_faults = MergeFaults {
            lse_base: faults.lse_base_mismatch,
            skip_empty_rows: faults.skip_padded_rows,
        };
        // With a fault planted in the merge, split so that it runs (every 64 tokens, at least 2).
        let fault_splits = merge_faults.any().then(|| {
            shape
                .max_len
                .div_ceil(FAULT_SPLIT_TOKENS)
                .clamp(2, MAX_SPLITS)
        });
        let scale = kernel_scale(scale, faults);
        // The key lists (on the device until the result is back, as the table is).
        let sparse = match &lists {
            Some(KeyLists {
                indices,
                topk,
                lens,
            }) => Some((
                self.gpu().upload_i32(indices)?,
                *topk,
                self.gpu().upload_i32(lens)?,
            )),
            None => None,
        };
        let mut work = match (fp8, &sparse) {
            (true, None) => DecodeWork::for_fp8(self.gpu(), shape, fp8_kernel, fault_splits)?,
            (true, Some(_)) => {
                DecodeWork::for_fp8_sparse(self.gpu(), shape, fp8_kernel, fault_splits)?
            }
            (false, Some(_)) => DecodeWork::sparse(self.gpu(), shape, fault_splits, forced)?,
            (false, None) if overflow => {
                fast::planted_decode_work(self.gpu(), shape, fault_splits, None)?
            }
            (false, None) => match fault_splits {
                Some(splits) => DecodeWork::with_variant(self.gpu(), shape, splits, forced)?,
                None => DecodeWork::for_variant(self.gpu(), shape, forced)?,
            },
        };
        work.plant_merge_faults(self.gpu(), merge_faults)?;
        // The wgmma kernels read the query's two parts where the engine made them; the others
        // a joined copy, with zero rows for a padded batch.
        let (q_lat_d, q_pe_d) = (self.dev(q_lat)?, self.dev(q_pe)?);
        let joined = match !fp8 && fast::reads_query_by_tma(work.kernel) {
            true => None,
            false => Some(self.concat_on_device(q_lat, q_pe, heads, pad * heads)?),
        };
        let q = match &joined {
            Some(q) => DecodeQuery::Joined(q),
            None => DecodeQuery::Parts {
                latent: buf(&q_lat_d),
                rope: buf(&q_pe_d),
            },
        };
        let o = padded_out.as_ref().unwrap_or(buf(&od));
        // A sparse selection: each sequence's key list, and its length in place of the context.
        let keys = sparse.as_ref().map(|(indices, topk, _)| SparseKeys {
            indices,
            topk: *topk,
        });
        let lens = sparse.as_ref().map_or(&*seq_lens, |(_, _, counts)| counts);
        // The log-sum-exps' poison fill comes last before the launches: the split kernel,
        // launched as the fill's dependent, places its blocks while the fill runs.
        let lse_len = padded * heads;
        let (mirror, pool, launches, address, bytes, lse) = if fp8 {
            let mirror = self.sync_fp8_cache(cache)?;
            let pages = fp8_bytes(&mirror);
            let q = joined
                .as_ref()
                .expect("an FP8 cache's kernels read a joined query");
            let inputs = (q, pages, block_table, lens, keys);
            let lse = self.poisoned(lse_len, Elem::F32)?;
            let launches = fp8_launches(self.gpu(), shape, inputs, scale, (o, &lse), &work)?;
            let (address, bytes) = (pages.address(), pages.bytes());
            (mirror, None, launches, address, bytes, lse)
        } else {
            let mirror = self.sync_cache(cache)?;
            let pool = overflow
                .then(|| self.overflow_pool(mirror_buf(&mirror)))
                .transpose()?;
            let pages = pool.as_ref().unwrap_or_else(|| mirror_buf(&mirror));
            let lse = self.poisoned(lse_len, Elem::F32)?;
            let launches = fast::decode_launches(
                self.gpu(),
                shape,
                q,
                pages,
                block_table,
                lens,
                keys,
                scale,
                o,
                &lse,
                &work,
            )?;
            let (address, bytes) = (pages.address(), pages.bytes());
            (mirror, pool, launches, address, bytes, lse)
        };
        let mut reads = vec![
            DeviceRead {
                id: cache.id(),
                address,
                bytes,
                device_index: self.gpu().ordinal(),
            },
            DeviceRead {
                id: BufferId::fresh_cache(),
                address: block_table.address(),
                bytes: block_table.bytes(),
                device_index: self.gpu().ordinal(),
            },
        ];
        if let Some((indices, _, _)) = &sparse {
            reads.push(DeviceRead {
                id: BufferId::fresh_cache(),
                address: indices.address(),
                bytes: indices.bytes(),
                device_index: self.gpu().ordinal(),
            });
        }
        drop(mirror);
        let padding = match padded_out {
            Some(po) => {
                self.gpu().copy(&po, 0, buf(&od), 0, n * row)?;
                let rows = self.part(po, n * row, pad * row)?;
                Some(self.finish(rows, &[pad, heads, LATENT])?)
            }
            None => None,
        };
        self.refresh_host(out, &od)?;
        drop(pool); // after the launches are done with it
        let splits = work.splits;
        // Splits merged inside the kernel (clusters of two) leave no partials in memory.
        let partials = match work.writes_partials(self.gpu()) {
            false => None,
            true => {
                // Left on the device beside their host copies: statistics run there.
                let (po, pl) = work.into_partials();
                let (po, pl) = (
                    self.part(po, 0, n * splits * row)?,
                    self.part(pl, 0, n * splits * heads)?,
                );
                Some((
                    self.finish(po, &[n, splits, heads, LATENT])?,
                    self.finish(pl, &[n, splits, heads])?,
                ))
            }
        };
        Ok(FastOutcome::Ran(Box::new(FastAttention {
            lse: self.finish(self.part(lse, 0, n * heads)?, &[n, heads])?,
            partials,
            padding,
            launches,
            reads,
        })))
    }

    /// See [`crate::backend::Backend::fast_attention_naive`]: the flash prefill of a whole sequence.
    pub(super) fn fast_naive(
        &self,
        q: &Tensor,
        k: &dyn RowSource,
        v: &dyn RowSource,
        call: AttnParams<'_>,
        out: &mut Tensor,
        kernels: AttnKernels,
    ) -> Result<FastOutcome> {
        let (dims, mask, scale, faults) = call.parts();
        let n = checks::attention_naive(q, k, v, dims, mask)?;
        checks::attention_out(out, n, dims, dims.v)?;
        let (dqk, dv) = (dims.nope + dims.rope, dims.v);
        if !PREFILL_DIMS.contains(&(dqk, dv)) {
            return Ok(FastOutcome::Declined(format!(
                "head dims {dqk}/{dv} (the prefill kernel is built for {})",
                PREFILL_DIMS.map(|(a, b)| format!("{a}/{b}")).join(" and ")
            )));
        }
        if let Some(why) = declines(self, mask, false) {
            return Ok(FastOutcome::Declined(why));
        }
        if faults.lse_base_mismatch || faults.skip_padded_rows {
            return Ok(FastOutcome::Declined(
                "lse-base-mismatch and skip-padded-rows are planted in the decode's merge and the \
                 reference kernels; the flash prefill has neither"
                    .into(),
            ));
        }
        let whole = mask.positions.iter().enumerate().all(|(i, &p)| i == p) && k.len() == n;
        if !whole || k.block_table().is_some() || v.block_table().is_some() {
            return Ok(FastOutcome::Declined(format!(
                "{n} queries from position {} over {} keys (the flash prefill runs a whole \
                 sequence from position 0)",
                mask.positions[0],
                k.len()
            )));
        }
        let heads = dims.heads;
        let qd = self.dev(q)?;
        let od = self.dev(out)?;
        let lse = self.poisoned(n * heads, Elem::F32)?;
        let (km, vm) = (self.sync_cache(k)?, self.sync_cache(v)?);
        let (kd, vd): (&DevBuf, &DevBuf) = (mirror_buf(&km), mirror_buf(&vm));
        let variant = kernels.prefill.map(|p| p.tag());
        let launch = fast::flash_prefill_planted(
            self.gpu(),
            variant,
            faults.kv_stride_mismatch,
            n,
            heads,
            (dqk, dv),
            (buf(&qd), kd, vd, buf(&od), Some(&lse)),
            kernel_scale(scale, faults),
        )?;
        let reads = [(k.id(), kd), (v.id(), vd)]
            .map(|(id, d)| DeviceRead {
                id,
                address: d.address(),
                bytes: d.bytes(),
                device_index: d.device_index(),
            })
            .to_vec();
        drop((km, vm));
        self.refresh_host(out, &od)?;
        Ok(FastOutcome::Ran(Box::new(FastAttention {
            lse: self.finish(lse, &[n, heads])?,
            partials: None,
            padding: None,
            launches: launch.into_iter().collect(),
            reads,
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_pad_to_cuda_graph_capture_sizes() {
        let sizes: Vec<usize> = [1, 2, 3, 4, 5, 8, 9, 17, 24, 505, 512, 513, 1000]
            .map(capture_size)
            .to_vec();
        assert_eq!(sizes, [1, 2, 4, 4, 8, 8, 16, 24, 24, 512, 512, 513, 1000]);
        // The fault always gets a padded row: the next capture size, or one row past 512.
        assert_eq!(padded_batch(1, false), 1);
        assert_eq!(padded_batch(1, true), 2);
        assert_eq!(padded_batch(3, true), 4);
        assert_eq!(padded_batch(8, true), 16);
        assert_eq!(padded_batch(512, true), 513);
        assert_eq!(padded_batch(600, true), 601);
    }
}
