//! The production attention kernels ([`super::fast`]) in the traced path: the absorbed attention
//! of a chunk runs the tensor-core decode over the paged latent cache (each query token a
//! sequence of its own length over the same pages, as a serving batch is), and a whole-sequence
//! naive prefill runs the flash prefill. Each says what it launched, returns its log-sum-exps and
//! split partials for the trace, or declines with the reason when the op is one it does not take
//! (head dims it is not built for, f32 storage, a sparse selection, a fault planted in the
//! reference kernel), and the engine runs the reference instead.

use super::attention::mirror_buf;
use super::device::{DevBuf, Elem};
use super::fast::{self, DecodeShape, DecodeWork, LATENT, PREFILL_DIMS, ROPE};
use super::fast_fp8::fp8_kernel_of;
use super::fp8_cache::fp8_bytes;
use super::{buf, CudaBackend};
use crate::backend::{checks, AttnMask, Backend, DeviceRead, FastAttention, FastOutcome, MlaDims};
use crate::error::Result;
use crate::ops::{AttnKernels, KernelFaults, KvCacheDtype, RowSource};
use crate::tensor::{BufferId, DeviceBuffer, Tensor};

/// Why a fast kernel does not take an op, or `None` when it does.
fn declines(backend: &CudaBackend, faults: KernelFaults, mask: &AttnMask) -> Option<String> {
    if backend.elem() != Elem::Bf16 {
        return Some("f32 storage (the fast kernels read and write bf16: --dtype bf16)".into());
    }
    if faults.lse_base_mismatch {
        return Some("lse-base-mismatch is planted in the reference kernel".into());
    }
    if faults.skip_padded_rows {
        return Some("skip-padded-rows is planted in the reference kernel".into());
    }
    if let Some(sel) = &mask.selected {
        let sparse = sel
            .iter()
            .zip(&mask.positions)
            .filter(|(keys, &p)| keys.len() != p + 1)
            .count();
        if sparse > 0 {
            return Some(format!(
                "a sparse DSA selection ({sparse} of {} queries keep fewer than all their keys; \
                 the sparse kernels are not built yet)",
                sel.len()
            ));
        }
    }
    (mask.positions.is_empty()).then(|| "no queries".into())
}

impl CudaBackend {
    /// See [`Backend::fast_attention_latent`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fast_latent(
        &self,
        q_lat: &Tensor,
        q_pe: &Tensor,
        cache: &dyn RowSource,
        dims: MlaDims,
        mask: &AttnMask,
        scale: f32,
        out: &mut Tensor,
        kernels: AttnKernels,
        faults: KernelFaults,
    ) -> Result<FastOutcome> {
        let n = checks::attention_latent(q_lat, q_pe, cache, dims, mask)?;
        checks::attention_out(out, n, dims, dims.latent)?;
        if (dims.latent, dims.rope) != (LATENT, ROPE) {
            return Ok(FastOutcome::Declined(format!(
                "latent rows of {}+{} (the decode kernels are built for {LATENT}+{ROPE})",
                dims.latent, dims.rope
            )));
        }
        if let Some(why) = declines(self, faults, mask) {
            return Ok(FastOutcome::Declined(why));
        }
        let Some(table) = cache.block_table() else {
            return Ok(FastOutcome::Declined("a latent cache without pages".into()));
        };
        let heads = dims.heads;
        let q = self.concat_groups(q_lat, q_pe, heads)?;
        let qd = self.dev(&q)?;
        let lens: Vec<usize> = mask.positions.iter().map(|&p| p + 1).collect();
        let shape = DecodeShape {
            batch: n,
            heads,
            max_pages: table.len().max(1),
            max_len: lens.iter().copied().max().unwrap_or(1),
        };
        // Every query reads the same pages: one table row per query, as a batch would hold.
        let rows: Vec<usize> = (0..n)
            .flat_map(|_| table.iter().copied().chain((table.is_empty()).then_some(0)))
            .collect();
        let block_table = self.indices(&rows)?;
        let seq_lens = self.indices(&lens)?;
        let forced = kernels.decode.map(|v| v.kernel());
        // An fp8_ds_mla cache is read by the FP8-cache variants, from its byte cache.
        let fp8 = cache.kv_cache_dtype() == KvCacheDtype::Fp8DsMla;
        let work = if fp8 {
            match forced.map(fp8_kernel_of).transpose() {
                Ok(kernel) => DecodeWork::for_fp8(self.gpu(), shape, kernel, None)?,
                Err(why) => return Ok(FastOutcome::Declined(why.to_string())),
            }
        } else {
            DecodeWork::for_variant(self.gpu(), shape, forced)?
        };
        let od = self.dev(out)?;
        let lse = self.gpu().alloc(n * heads, Elem::F32)?;
        let (mirror, launches, address, bytes) = if fp8 {
            let mirror = self.sync_fp8_cache(cache)?;
            let pages = fp8_bytes(&mirror);
            let (q, lens, o) = (buf(&qd), &seq_lens, buf(&od));
            let launches = fast::mla_decode_fp8(
                self.gpu(),
                shape,
                q,
                pages,
                &block_table,
                lens,
                scale,
                o,
                &lse,
                &work,
            )?;
            let (address, bytes) = (pages.address(), pages.bytes());
            (mirror, launches, address, bytes)
        } else {
            let mirror = self.sync_cache(cache)?;
            let pages = mirror_buf(&mirror);
            let launches = fast::mla_decode(
                self.gpu(),
                shape,
                buf(&qd),
                pages,
                &block_table,
                &seq_lens,
                scale,
                buf(&od),
                &lse,
                &work,
            )?;
            let (address, bytes) = (pages.address(), pages.bytes());
            (mirror, launches, address, bytes)
        };
        let reads = vec![
            DeviceRead {
                id: cache.id(),
                address,
                bytes,
            },
            DeviceRead {
                id: BufferId::fresh_cache(),
                address: block_table.address(),
                bytes: block_table.bytes(),
            },
        ];
        drop(mirror);
        self.refresh_host(out, &od)?;
        let partials = match work.splits {
            1 => None,
            splits => Some(self.partials(&work, n, splits, heads)?),
        };
        Ok(FastOutcome::Ran(FastAttention {
            lse: self.finish(lse, &[n, heads])?,
            partials,
            launches,
            reads,
        }))
    }

    /// The split partials as one host tensor [n, splits, heads, L + 1].
    fn partials(&self, work: &DecodeWork, n: usize, splits: usize, heads: usize) -> Result<Tensor> {
        let (o, lse) = work.partials(self.gpu())?;
        let rows = n * splits * heads;
        let mut data = Vec::with_capacity(rows * (LATENT + 1));
        for r in 0..rows {
            data.extend_from_slice(&o[r * LATENT..][..LATENT]);
            data.push(lse[r]);
        }
        Ok(Tensor::from_vec(&[n, splits, heads, LATENT + 1], data))
    }

    /// See [`Backend::fast_attention_naive`]: the flash prefill of a whole sequence.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fast_naive(
        &self,
        q: &Tensor,
        k: &dyn RowSource,
        v: &dyn RowSource,
        dims: MlaDims,
        mask: &AttnMask,
        scale: f32,
        out: &mut Tensor,
        kernels: AttnKernels,
        faults: KernelFaults,
    ) -> Result<FastOutcome> {
        let n = checks::attention_naive(q, k, v, dims, mask)?;
        checks::attention_out(out, n, dims, dims.v)?;
        let (dqk, dv) = (dims.nope + dims.rope, dims.v);
        if !PREFILL_DIMS.contains(&(dqk, dv)) {
            return Ok(FastOutcome::Declined(format!(
                "head dims {dqk}/{dv} (the prefill kernel is built for {})",
                PREFILL_DIMS.map(|(a, b)| format!("{a}/{b}")).join(" and ")
            )));
        }
        if let Some(why) = declines(self, faults, mask) {
            return Ok(FastOutcome::Declined(why));
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
        let lse = self.gpu().alloc(n * heads, Elem::F32)?;
        let (km, vm) = (self.sync_cache(k)?, self.sync_cache(v)?);
        let (kd, vd): (&DevBuf, &DevBuf) = (mirror_buf(&km), mirror_buf(&vm));
        let variant = kernels.prefill.map(|p| p.tag());
        let launch = fast::flash_prefill_variant(
            self.gpu(),
            variant,
            n,
            heads,
            (dqk, dv),
            buf(&qd),
            kd,
            vd,
            scale,
            buf(&od),
            Some(&lse),
        )?;
        let reads = [(k.id(), kd), (v.id(), vd)]
            .map(|(id, d)| DeviceRead {
                id,
                address: d.address(),
                bytes: d.bytes(),
            })
            .to_vec();
        drop((km, vm));
        self.refresh_host(out, &od)?;
        Ok(FastOutcome::Ran(FastAttention {
            lse: self.finish(lse, &[n, heads])?,
            partials: None,
            launches: launch.into_iter().collect(),
            reads,
        }))
    }
}
