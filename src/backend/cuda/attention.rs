//! The attention ops on the device (naive over expanded K/V, absorbed over the paged latent
//! cache, the DSA indexer's scores and top-k) and the device mirrors of the KV caches they read.
//!
//! A cache's mirror lives in the cache's own [`MirrorSlot`](crate::ops::MirrorSlot): it is freed
//! with the cache, so engines made and dropped by restarts and flag changes leave no device
//! memory behind.

use super::device::mla_kernels::{LatentAttention, NaiveAttention};
use super::device::{DevBuf, DevBytes, DevI32, Elem};
use super::{buf, CudaBackend};
use crate::backend::{checks, AttnMask, AttnParams};
use crate::error::Result;
use crate::ops::{RowSource, PAGE_SIZE};
use crate::tensor::{DeviceBuffer, Tensor};
use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, MutexGuard};

/// Cache mirrors alive in this process, and their device bytes.
static LIVE_MIRRORS: AtomicUsize = AtomicUsize::new(0);
static LIVE_MIRROR_BYTES: AtomicUsize = AtomicUsize::new(0);

/// How many KV-cache mirrors are alive on the device, and their bytes (for the leak tests).
pub fn live_cache_mirrors() -> (usize, usize) {
    (
        LIVE_MIRRORS.load(Ordering::Relaxed),
        LIVE_MIRROR_BYTES.load(Ordering::Relaxed),
    )
}

/// What a cache's mirror slot holds for this backend: the copy of its rows, and for an
/// fp8_ds_mla cache the byte cache the write kernel fills ([`super::fp8_cache`]). A cache may
/// need both in one run (the fast decode reads the bytes, the reference kernel the rows).
#[derive(Default)]
pub(super) struct Mirrors {
    rows: Option<CacheMirror>,
    pub(super) fp8: Option<super::fp8_cache::Fp8Mirror>,
    /// The fast decode's last block table (see [`CudaBackend::batch_block_table`]).
    table: Option<BatchTable>,
}

/// A decode batch's block table on the device: `row` (the cache's pages) repeated for each of
/// `batch` queries.
struct BatchTable {
    row: Vec<usize>,
    batch: usize,
    table: Arc<DevI32>,
}

/// The mirrors in a slot, taken out of it (empty when it held none, or another kind).
pub(super) fn take_mirrors(slot: &mut Mirror) -> Mirrors {
    slot.take()
        .and_then(|m| m.downcast::<Mirrors>().ok())
        .map_or_else(Mirrors::default, |m| *m)
}

/// Mirrors alive, counted for the leak tests: a new one of `bytes`.
pub(super) fn count_mirror(bytes: usize) {
    LIVE_MIRRORS.fetch_add(1, Ordering::Relaxed);
    LIVE_MIRROR_BYTES.fetch_add(bytes, Ordering::Relaxed);
}

/// One of `bytes` dropped.
pub(super) fn uncount_mirror(bytes: usize) {
    LIVE_MIRRORS.fetch_sub(1, Ordering::Relaxed);
    LIVE_MIRROR_BYTES.fetch_sub(bytes, Ordering::Relaxed);
}

/// A device copy of a KV cache, kept in step with the host cache's writes.
struct CacheMirror {
    /// The backend that made it (its buffer belongs to that backend's context and dtype).
    backend: u64,
    buf: DevBuf,
    /// Rows the buffer holds.
    rows: usize,
    /// Writes of the host cache already applied.
    applied: usize,
}

impl CacheMirror {
    fn new(backend: u64, buf: DevBuf, rows: usize, applied: usize) -> CacheMirror {
        count_mirror(buf.bytes());
        CacheMirror {
            backend,
            buf,
            rows,
            applied,
        }
    }
}

impl Drop for CacheMirror {
    fn drop(&mut self) {
        uncount_mirror(self.buf.bytes());
    }
}

/// A cache's mirror slot, locked, holding this backend's up-to-date mirror.
pub(super) type Mirror<'a> = MutexGuard<'a, Option<Box<dyn Any + Send + Sync>>>;

pub(super) fn mirror_buf<'a>(slot: &'a Mirror) -> &'a DevBuf {
    &slot
        .as_ref()
        .and_then(|m| m.downcast_ref::<Mirrors>())
        .and_then(|m| m.rows.as_ref())
        .expect("sync_cache leaves a mirror")
        .buf
}

impl CudaBackend {
    /// The block table of a decode batch of `batch` queries that all read the pages `row` of
    /// `cache`: kept with the cache's mirrors and made again only when the pages or the batch
    /// change (a new page every 64 tokens), so that a decode step uploads nothing for it.
    pub(super) fn batch_block_table(
        &self,
        cache: &dyn RowSource,
        row: &[usize],
        batch: usize,
    ) -> Result<Arc<DevI32>> {
        let mut slot = cache.mirror().lock();
        let mut mirrors = take_mirrors(&mut slot);
        let kept = mirrors
            .table
            .take()
            .filter(|t| t.batch == batch && t.row == row);
        let kept = match kept {
            Some(kept) => kept,
            None => BatchTable {
                row: row.to_vec(),
                batch,
                table: Arc::new(self.gpu.repeat_rows_i32(&*self.indices(row)?, batch)?),
            },
        };
        let table = kept.table.clone();
        mirrors.table = Some(kept);
        *slot = Some(Box::new(mirrors));
        Ok(table)
    }

    /// Brings a cache's device mirror up to date and returns its slot, locked (the mirror stays
    /// put while a kernel is queued on it).
    pub(super) fn sync_cache<'a>(&self, src: &'a dyn RowSource) -> Result<Mirror<'a>> {
        let mut slot = src.mirror().lock();
        let width = src.width();
        let physical = |s: usize| match src.block_table() {
            Some(bt) => bt[s / PAGE_SIZE] * PAGE_SIZE + s % PAGE_SIZE,
            None => s,
        };
        let needed = match src.block_table() {
            Some(bt) => (bt.iter().max().map_or(0, |m| m + 1)) * PAGE_SIZE,
            None => src.len(),
        }
        .max(1);
        let mut mirrors = take_mirrors(&mut slot);
        let old = mirrors
            .rows
            .take()
            .filter(|m| m.backend == self.id && m.buf.elem() == self.elem);
        let mut mirror = match old {
            Some(m) if m.rows >= needed => m,
            old => {
                let rows = needed.max(old.as_ref().map_or(0, |m| m.rows * 2));
                let buf = self.gpu.alloc(rows * width, self.elem)?;
                self.gpu.fill(&buf, src.poisoned())?;
                let applied = match &old {
                    Some(m) => {
                        self.gpu.copy(&m.buf, 0, &buf, 0, m.rows * width)?;
                        m.applied
                    }
                    None => 0,
                };
                CacheMirror::new(self.id, buf, rows, applied)
            }
        };
        // The writes since the last sync, by the cache-write kernel: each slot's latest row,
        // scattered to the physical row the slot mapping gives (a slot written twice is sent
        // once).
        let mut fresh: Vec<usize> = src.writes()[mirror.applied..].to_vec();
        fresh.sort_unstable();
        fresh.dedup();
        fresh = self.copy_pushed_rows(src, &fresh, &physical, &mirror.buf)?;
        if !fresh.is_empty() {
            let rows: Vec<f32> = fresh.iter().flat_map(|&s| src.row(s).to_vec()).collect();
            let rows = self.gpu.upload(&rows, self.elem)?;
            let physical: Vec<usize> = fresh.iter().map(|&s| physical(s)).collect();
            let slots = self.indices(&physical)?;
            self.gpu
                .kv_cache_write(&rows, &slots, &mirror.buf, fresh.len(), width)?;
        }
        mirror.applied = src.writes().len();
        mirrors.rows = Some(mirror);
        *slot = Some(Box::new(mirrors));
        Ok(slot)
    }

    /// Copies the rows of a cache that were pushed as this device's tensors into its mirror, on
    /// the device, each to the physical row `physical` gives (runs of rows consecutive in one
    /// tensor and in the mirror in one copy); returns the rows left for the host path.
    fn copy_pushed_rows(
        &self,
        src: &dyn RowSource,
        fresh: &[usize],
        physical: &dyn Fn(usize) -> usize,
        mirror: &DevBuf,
    ) -> Result<Vec<usize>> {
        let width = src.width();
        let mut left = Vec::new();
        let mut i = 0;
        while i < fresh.len() {
            let s = fresh[i];
            let on_device = src.pushed_rows(s).and_then(|(t, r)| {
                let d = t.device().filter(|d| self.holds(d, self.elem))?;
                Some((t, d, r))
            });
            let Some((t, d, r)) = on_device else {
                left.push(s);
                i += 1;
                continue;
            };
            let at = physical(s);
            let mut n = 1;
            while i + n < fresh.len()
                && fresh[i + n] == s + n
                && physical(s + n) == at + n
                && src
                    .pushed_rows(s + n)
                    .is_some_and(|(u, q)| std::ptr::eq(u, t) && q == r + n)
            {
                n += 1;
            }
            self.gpu
                .copy(buf(d), r * width, mirror, at * width, n * width)?;
            i += n;
        }
        Ok(left)
    }

    /// The mask as bytes [n, context] (1 = the query may see the key), or none for plain causal
    /// masking.
    fn mask_bytes(&self, mask: &AttnMask, context: usize) -> Result<Option<DevBytes>> {
        let Some(sel) = &mask.selected else {
            return Ok(None);
        };
        let mut bytes = vec![0u8; sel.len() * context];
        for (i, keys) in sel.iter().enumerate() {
            for &j in keys {
                if j < context {
                    bytes[i * context + j] = 1;
                }
            }
        }
        self.gpu.upload_bytes(&bytes).map(Some)
    }

    pub(super) fn naive_attention(
        &self,
        q: &Tensor,
        k: &dyn RowSource,
        v: &dyn RowSource,
        call: AttnParams<'_>,
        out: &mut Tensor,
    ) -> Result<Tensor> {
        let (dims, mask, scale, faults) = call.parts();
        let n = checks::attention_naive(q, k, v, dims, mask)?;
        let context = k.len();
        let heads = dims.heads;
        checks::attention_out(out, n, dims, dims.v)?;
        let qd = self.dev(q)?;
        let (kd, vd) = (self.sync_cache(k)?, self.sync_cache(v)?);
        let od = self.dev(out)?;
        let pos = self.indices(&mask.positions)?;
        let m = self.mask_bytes(mask, context)?;
        let probs = self.gpu.alloc(heads * n * context, Elem::F32)?;
        self.gpu.fill(&probs, false)?;
        self.gpu.attn_naive(&NaiveAttention {
            q: buf(&qd),
            k: mirror_buf(&kd),
            v: mirror_buf(&vd),
            positions: &pos,
            mask: m.as_ref(),
            out: buf(&od),
            probs: &probs,
            n,
            heads,
            d: dims.nope + dims.rope,
            dv: dims.v,
            context,
            scale,
            skip_padded_rows: faults.skip_padded_rows,
        })?;
        drop((kd, vd));
        self.refresh_host(out, &od)?;
        self.finish(probs, &[heads, n, context])
    }

    pub(super) fn latent_attention(
        &self,
        q_lat: &Tensor,
        q_pe: &Tensor,
        cache: &dyn RowSource,
        call: AttnParams<'_>,
        out: &mut Tensor,
    ) -> Result<Tensor> {
        let (dims, mask, scale, faults) = call.parts();
        let n = checks::attention_latent(q_lat, q_pe, cache, dims, mask)?;
        let context = cache.len();
        let heads = dims.heads;
        checks::attention_out(out, n, dims, dims.latent)?;
        let (qld, qpd) = (self.dev(q_lat)?, self.dev(q_pe)?);
        let cd = self.sync_cache(cache)?;
        // A cache without pages is its own single run of rows: the identity table.
        let table: Vec<usize> = match cache.block_table() {
            Some(bt) => bt.to_vec(),
            None => (0..context.div_ceil(PAGE_SIZE)).collect(),
        };
        let bt = self.indices(if table.is_empty() { &[0] } else { &table })?;
        let od = self.dev(out)?;
        let pos = self.indices(&mask.positions)?;
        let m = self.mask_bytes(mask, context)?;
        let probs = self.gpu.alloc(heads * n * context, Elem::F32)?;
        self.gpu.fill(&probs, false)?;
        self.gpu.attn_latent(&LatentAttention {
            q_lat: buf(&qld),
            q_pe: buf(&qpd),
            cache: mirror_buf(&cd),
            block_table: &bt,
            positions: &pos,
            mask: m.as_ref(),
            out: buf(&od),
            probs: &probs,
            n,
            heads,
            latent: dims.latent,
            rope: dims.rope,
            context,
            scale,
            lse_base_mismatch: faults.lse_base_mismatch,
            skip_padded_rows: faults.skip_padded_rows,
        })?;
        drop(cd);
        self.refresh_host(out, &od)?;
        self.finish(probs, &[heads, n, context])
    }

    pub(super) fn indexer_scores(
        &self,
        q: &Tensor,
        weights: &Tensor,
        keys: &dyn RowSource,
        positions: &[usize],
        scale: f32,
    ) -> Result<Tensor> {
        let (n, heads, d) = checks::index_scores(q, weights, keys, positions)?;
        let context = keys.len();
        let (qd, wd) = (self.dev(q)?, self.dev(weights)?);
        let kd = self.sync_cache(keys)?;
        let pos = self.indices(positions)?;
        let out = self.gpu.alloc(n * context, Elem::F32)?;
        self.gpu.index_scores(
            buf(&qd),
            buf(&wd),
            mirror_buf(&kd),
            &pos,
            &out,
            (n, heads, d, context),
            scale,
        )?;
        drop(kd);
        self.finish(out, &[n, context])
    }

    pub(super) fn indexer_topk(
        &self,
        scores: &Tensor,
        positions: &[usize],
        k: usize,
    ) -> Result<Vec<Vec<usize>>> {
        checks::index_topk(scores, positions)?;
        let (n, context) = (scores.rows(), scores.cols());
        if n == 0 || context == 0 {
            return Ok(vec![Vec::new(); n]);
        }
        // The scores as f32 on the device: index_scores leaves them there.
        let on_device = scores.device().filter(|d| self.holds(d, Elem::F32));
        let scores_dev: Arc<dyn DeviceBuffer> = match on_device {
            Some(d) => d.clone(),
            None => Arc::new(self.gpu.upload(scores.data(), Elem::F32)?),
        };
        let pos = self.indices(positions)?;
        let cells = crate::tensor::checked_numel(&[n, context], "top-k selection")?;
        let selected = self.gpu.alloc_vec::<u8>(cells)?;
        self.gpu
            .topk_select(buf(&scores_dev), &pos, &selected, (n, context), k)?;
        let flags = self.gpu.download_vec(&selected, cells)?;
        Ok(flags
            .chunks(context)
            .map(|row| (0..context).filter(|&j| row[j] != 0).collect())
            .collect())
    }
}
