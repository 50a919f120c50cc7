//! The cache writes of attention: the latent cache (c_kv | k_pe of every new token, at the slot
//! the slot mapping gives; with an fp8_ds_mla cache, each row as the format gives it back) and
//! the naive path's expanded per-head cache.

use super::{Chunk, LayerCtx};
use crate::engine::cache::{ExpandedCache, LayerCache, RowCache};
use crate::engine::faults::Fault;
use crate::engine::sink::Sink;
use crate::engine::trace::{BufferRef, OpKind};
use crate::error::Result;
use crate::ops::{kv_fp8, KvCacheDtype};
use crate::tensor::Tensor;

/// The latent cache gets c_kv | k_pe of every new token. FAULT kv-cache-off-by-one: decode maps
/// each token to the slot before its own. With an fp8_ds_mla cache each row is stored as the
/// codec's round trip (FAULTS fp8-scale-default and fp8-amax-padded-rows act in the codec's tile
/// scale), the op reports the rows so stored, and they are returned as (c_kv, k_pe) for the
/// attention that follows; with a bf16 cache, `None`.
pub(super) fn write_latent(
    ctx: &LayerCtx,
    chunk: &Chunk,
    cache: &mut LayerCache,
    sink: &mut Sink,
) -> Result<Option<(Tensor, Tensor)>> {
    let dims = ctx.dims();
    let b = ctx.backend;
    let written = b.concat_groups(&chunk.c_kv, &chunk.k_pe, 1)?;
    let width = dims.latent + dims.rope;
    let written = written.reshaped(&[ctx.positions.len(), width]);
    let fp8 = ctx.kv_cache == KvCacheDtype::Fp8DsMla;
    let slots: Vec<usize> = ctx
        .positions
        .iter()
        .map(|&pos| {
            if ctx.fault(Fault::KvCacheOffByOne) {
                pos.saturating_sub(1)
            } else {
                pos
            }
        })
        .collect();
    let reads = vec![BufferRef::of(&chunk.c_kv), BufferRef::of(&chunk.k_pe)];
    let (report, cached) = if fp8 {
        // The format's round trip is the CPU codec's: the rows come to the host for it.
        let faults = ctx.faults.fp8(ctx.phase);
        let mut rows = Vec::with_capacity(written.numel());
        for t in 0..slots.len() {
            rows.extend(kv_fp8::round_trip(written.row(t), faults)?);
        }
        let stored = Tensor::from_vec(&[slots.len(), width], rows);
        cache
            .latent
            .push_fp8_rows(stored.alias(), &written, faults, &slots)?;
        let c_kv = b.slice_groups(&stored, 1, 0, dims.latent)?;
        let k_pe = b.slice_groups(&stored, 1, dims.latent, dims.rope)?;
        (stored, Some((c_kv, k_pe)))
    } else {
        cache.latent.push_rows_at(written.alias(), &slots)?;
        (written, None)
    };
    sink.report(
        Some(ctx.layer),
        &ctx.name("self_attn.latent_cache"),
        OpKind::CacheWrite,
        &report,
        latent_ref(cache),
        reads,
    )?;
    Ok(cached)
}

pub(super) fn latent_ref(cache: &LayerCache) -> BufferRef {
    BufferRef::cache(
        cache.latent.id(),
        cache.latent.address(),
        cache.latent.bytes(),
    )
}

/// Appends decompressed tokens to the expanded cache: kv [n, heads·(P+V)] from kv_b_proj and
/// their roped k_pe [n, R] become per-head K (k_nope | k_pe) and V rows. Reported as a cache
/// write of the rows K | V.
pub(super) fn append_expanded(
    ctx: &LayerCtx,
    expanded: &mut ExpandedCache,
    kv: &Tensor,
    k_pe: &Tensor,
    op: &str,
    reads: Vec<BufferRef>,
    sink: &mut Sink,
) -> Result<()> {
    let b = ctx.backend;
    let (k_rows, v_rows) = b.assemble_kv(kv, k_pe, ctx.dims())?;
    push_rows(&mut expanded.k, &k_rows)?;
    push_rows(&mut expanded.v, &v_rows)?;
    let written = b.concat_groups(&k_rows, &v_rows, 1)?;
    let written = written.reshaped(&[k_rows.rows(), k_rows.cols() + v_rows.cols()]);
    let buffer = BufferRef::cache(expanded.id(), expanded.address(), expanded.bytes());
    sink.report(
        Some(ctx.layer),
        &ctx.name(op),
        OpKind::CacheWrite,
        &written,
        buffer,
        reads,
    )
}

/// Appends each row of `rows` to a row cache (where they are: a device's stay there).
pub(super) fn push_rows(cache: &mut RowCache, rows: &Tensor) -> Result<()> {
    cache.push_rows(rows.alias())
}
