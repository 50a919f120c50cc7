//! The CUDA backend: mladb's own kernels (kernels/*.cu, compiled by NVRTC at run time for the
//! device's compute capability) and cuBLAS GEMMs, through cudarc with dynamic loading so that the
//! crate builds and runs anywhere (no GPU: a clear error, never a panic).
//!
//! Tensors carry their device buffer: inputs found resident are used in place, weights are made
//! or uploaded once and stay with their cached tensor, outputs are computed on the device and
//! stay there, their host copy made when something reads it (the trace's statistics are
//! computed on the device). KV caches keep their device mirrors in their own slot
//! ([`crate::ops::MirrorSlot`]), replaying the cache's writes (rows that are this device's
//! tensors by device copies), so a mirror is freed with its cache. Storage on the device is bf16
//! or f32 (arithmetic is f32 in both).
//!
//! `unsafe` lives in [`device`] alone; this module and its other files deny it.
#![deny(unsafe_code)]

mod attention;
mod constants;
#[allow(unsafe_code)]
pub mod device;
mod experts;
pub mod fast;
mod fast_attention;
mod fast_fp8;
mod fast_prefill;
mod fast_sparse;
mod fast_splits;
mod fp8_cache;
mod made_weights;
mod ranks;
mod stats;

pub use attention::live_cache_mirrors;
pub use device::compile;

use super::checks::{self, same_shape};
use super::{AttnParams, Backend, FastOutcome, KvbSplit, MlaDims, Routing};
use crate::error::{Error, Result};
use crate::model::layout::MoeLayout;
use crate::model::quant::{QuantFaults, QuantTensor};
use crate::ops::{AttnKernels, RopeTable, RowSource, StorageDtype};
use crate::stats::TensorStats;
use crate::tensor::{DeviceBuffer, Tensor};
use device::model_kernels::quant_kernel_name;
use device::{DevBuf, DevI32, Elem, Gpu};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub struct CudaBackend {
    gpu: Arc<Gpu>,
    elem: Elem,
    /// This backend's identity, stamped on the cache mirrors it makes (a cache may meet another
    /// backend after a device or dtype change; that one makes its own mirror).
    id: u64,
    poison_outputs: AtomicBool,
    /// The statistics pass's buffers, allocated once (stats run on every op): for the
    /// backend's own statistics calls, and for the batches it lends the sink.
    stats_scratch: Mutex<Option<stats::StatsScratch>>,
    batch_scratch: Mutex<Option<stats::StatsScratch>>,
    /// The backends of tensor-parallel ranks asked for so far, by rank count (their devices
    /// opened and NCCL set up once).
    ranks: ranks::RanksCache,
    /// Small read-only arrays kept on the device by content (positions, lengths, frequencies).
    constants: constants::Constants,
}

/// Whether a CUDA device can be used, and if not, why.
pub fn probe() -> std::result::Result<(), String> {
    if !device::driver_present() {
        return Err("no CUDA driver (libcuda.so) on this machine".into());
    }
    if !compile::nvrtc_present() {
        return Err(compile::NVRTC_NOT_FOUND.into());
    }
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(()),
        Ok(_) => Err("no CUDA device".into()),
        Err(e) => Err(format!("the CUDA driver reports {e}")),
    }
}

impl CudaBackend {
    pub fn new(storage: StorageDtype) -> Result<CudaBackend> {
        probe().map_err(|why| Error::invalid(format!("--device cuda: {why}")))?;
        let elem = match storage {
            StorageDtype::F32 => Elem::F32,
            StorageDtype::Bf16 => Elem::Bf16,
        };
        Ok(CudaBackend::on(Arc::new(Gpu::open(0)?), elem))
    }

    /// A backend of its own (own identity, scratch and poison switch) on an opened device.
    fn on(gpu: Arc<Gpu>, elem: Elem) -> CudaBackend {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        CudaBackend {
            gpu,
            elem,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            poison_outputs: AtomicBool::new(false),
            stats_scratch: Mutex::new(None),
            batch_scratch: Mutex::new(None),
            ranks: ranks::RanksCache::default(),
            constants: constants::Constants::default(),
        }
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub fn elem(&self) -> Elem {
        self.elem
    }

    /// The device buffer of `t` in this backend's storage type: its mirror if it has one,
    /// else uploaded now (and attached, so later ops find it).
    fn dev(&self, t: &Tensor) -> Result<Arc<dyn DeviceBuffer>> {
        if let Some(d) = t.device() {
            if self.holds(d, self.elem) {
                return Ok(d.clone());
            }
        }
        let buf: Arc<dyn DeviceBuffer> = Arc::new(self.gpu.upload(t.data(), self.elem)?);
        if t.device().is_none() {
            t.attach_device(buf.clone());
        }
        Ok(buf)
    }

    /// Whether `d` is a buffer of `elem` on this backend's device (not another rank's).
    fn holds(&self, d: &Arc<dyn DeviceBuffer>, elem: Elem) -> bool {
        d.as_any()
            .downcast_ref::<DevBuf>()
            .is_some_and(|b| b.elem() == elem && b.ordinal() == self.gpu.ordinal())
    }

    /// A tensor for a computed device buffer, which stays on the device: its host copy is made
    /// when something reads it.
    fn finish(&self, buf: DevBuf, shape: &[usize]) -> Result<Tensor> {
        if buf.len() != crate::tensor::checked_numel(shape, "device tensor")? {
            return Err(Error::invalid(format!(
                "a device buffer of {} values for a tensor of shape {shape:?}",
                buf.len()
            )));
        }
        Ok(Tensor::from_device(shape, Arc::new(buf)))
    }

    /// An output buffer of `numel` values, poisoned first when asked.
    fn out(&self, numel: usize) -> Result<DevBuf> {
        crate::tensor::checked_numel(&[numel], "device tensor")?;
        let buf = self.gpu.alloc(numel, self.elem)?;
        if self.poison_outputs.load(Ordering::Relaxed) {
            self.gpu.fill(&buf, true)?;
        }
        Ok(buf)
    }

    /// After a kernel wrote `t`'s device buffer `dev` in place: the host copy is out of date and
    /// is made again from the device when read. A buffer `t` does not hold (its mirror was of
    /// another storage type) is copied back now, and the old mirror dropped.
    fn refresh_host(&self, t: &mut Tensor, dev: &Arc<dyn DeviceBuffer>) -> Result<()> {
        if t.device().is_some_and(|d| Arc::ptr_eq(d, dev)) {
            t.host_stale();
        } else {
            let data = self.gpu.download(buf(dev))?;
            t.data_mut().copy_from_slice(&data);
        }
        Ok(())
    }

    /// [`Backend::concat_groups`] left on the device (no host copy): for a kernel's input that
    /// is no op's output, such as the fast decode's query, followed by `zero_rows` rows of zeros
    /// (a padded batch's queries).
    fn concat_on_device(
        &self,
        a: &Tensor,
        b: &Tensor,
        groups: usize,
        zero_rows: usize,
    ) -> Result<DevBuf> {
        let (wa, wb) = (a.cols(), b.cols());
        let rows = a.rows();
        checks::concat_groups(a, b, groups)?;
        let (ad, bd) = (self.dev(a)?, self.dev(b)?);
        let out = self.out((rows + zero_rows) * (wa + wb))?;
        if zero_rows > 0 {
            self.gpu.fill(&out, false)?;
        }
        self.gpu
            .concat_groups(buf(&ad), buf(&bd), &out, rows, wa, wb)?;
        Ok(out)
    }

    fn indices(&self, values: &[usize]) -> Result<Arc<DevI32>> {
        let v: Vec<i32> = values
            .iter()
            .map(|&p| i32::try_from(p).map_err(|_| Error::invalid(format!("index {p} past i32"))))
            .collect::<Result<_>>()?;
        self.constants.i32s(&self.gpu, &v)
    }
}

/// The [`DevBuf`] behind a device mirror that `dev()` returned.
fn buf(d: &Arc<dyn DeviceBuffer>) -> &DevBuf {
    d.as_any()
        .downcast_ref::<DevBuf>()
        .expect("dev() returns DevBufs")
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn has_fast_attention(&self) -> bool {
        true
    }

    fn fast_attention_latent(
        &self,
        q_lat: &Tensor,
        q_pe: &Tensor,
        cache: &dyn RowSource,
        call: AttnParams<'_>,
        out: &mut Tensor,
        kernels: AttnKernels,
    ) -> Result<FastOutcome> {
        self.fast_latent(q_lat, q_pe, cache, call, out, kernels)
    }

    fn fast_attention_naive(
        &self,
        q: &Tensor,
        k: &dyn RowSource,
        v: &dyn RowSource,
        call: AttnParams<'_>,
        out: &mut Tensor,
        kernels: AttnKernels,
    ) -> Result<FastOutcome> {
        self.fast_naive(q, k, v, call, out, kernels)
    }

    fn rank_backends(&self, size: usize) -> Result<Option<super::RankBackends>> {
        self.rank_backends_of(size)
    }

    fn weight_maker(&self) -> Option<Arc<dyn crate::model::weights::WeightMaker>> {
        Some(Arc::new(made_weights::DeviceWeights {
            gpu: self.gpu.clone(),
            elem: self.elem,
        }))
    }

    fn set_poison_outputs(&self, on: bool) {
        self.poison_outputs.store(on, Ordering::Relaxed);
    }

    fn synchronize(&self) -> Result<()> {
        self.gpu.synchronize()
    }

    fn device_memory(&self) -> Option<(usize, usize)> {
        self.gpu.memory().ok()
    }

    fn driver_calls(&self) -> Option<super::DriverCalls> {
        Some(self.gpu.driver_calls())
    }

    fn alloc(&self, shape: &[usize], poison: bool) -> Result<Tensor> {
        let n = crate::tensor::checked_numel(shape, "device tensor")?;
        let buf = self.gpu.alloc(n, self.elem)?;
        self.gpu.fill(&buf, poison)?;
        Ok(Tensor::from_device(shape, Arc::new(buf)))
    }

    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let k = x.cols();
        let out_features = checks::linear(x, w)?;
        let n = x.rows();
        let mut shape = x.shape().to_vec();
        *shape.last_mut().expect("linear input has a shape") = out_features;
        let (xd, wd) = (self.dev(x)?, self.dev(w)?);
        let y = self.out(n * out_features)?;
        self.gpu
            .gemm_xwt(buf(&xd), buf(&wd), &y, n, k, out_features)?;
        if let Some(b) = bias {
            if b.numel() != out_features {
                return Err(Error::invalid(format!(
                    "linear: a bias of {} for {out_features} outputs",
                    b.numel()
                )));
            }
            let bd = self.dev(b)?;
            self.gpu.add_bias(&y, buf(&bd), n, out_features)?;
        }
        self.finish(y, &shape)
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
        let (rows, cols) = checks::norm("rms_norm", x, weight, None)?;
        let (xd, wd) = (self.dev(x)?, self.dev(weight)?);
        let out = self.out(x.numel())?;
        self.gpu
            .rmsnorm(buf(&xd), buf(&wd), &out, rows, cols, eps as f32)?;
        self.finish(out, x.shape())
    }

    fn layer_norm(&self, x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
        let (rows, cols) = checks::norm("layer_norm", x, weight, Some(bias))?;
        let (xd, wd, bd) = (self.dev(x)?, self.dev(weight)?, self.dev(bias)?);
        let out = self.out(x.numel())?;
        self.gpu
            .layernorm(buf(&xd), buf(&wd), buf(&bd), &out, rows, cols, eps as f32)?;
        self.finish(out, x.shape())
    }

    fn rope(
        &self,
        x: &Tensor,
        heads: usize,
        table: &RopeTable,
        positions: &[usize],
        interleaved: bool,
    ) -> Result<Tensor> {
        let n = positions.len();
        let d = checks::rope(x, heads, table, n)?;
        let xd = self.dev(x)?;
        let pos = self.indices(positions)?;
        let freq = self.constants.f32s(&self.gpu, &table.inv_freq)?;
        let out = self.out(x.numel())?;
        self.gpu.rope(
            buf(&xd),
            &out,
            (n, heads, d),
            table.inv_freq.len(),
            &pos,
            &freq,
            table.attention_factor,
            interleaved,
        )?;
        self.finish(out, x.shape())
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        same_shape("silu_mul", gate, up)?;
        let (g, u) = (self.dev(gate)?, self.dev(up)?);
        let out = self.out(gate.numel())?;
        self.gpu.silu_mul(buf(&g), buf(&u), &out, gate.numel())?;
        self.finish(out, gate.shape())
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        same_shape("add", a, b)?;
        let (ad, bd) = (self.dev(a)?, self.dev(b)?);
        let out = self.out(a.numel())?;
        self.gpu.add(buf(&ad), buf(&bd), &out, a.numel())?;
        self.finish(out, a.shape())
    }

    fn slice_groups(
        &self,
        x: &Tensor,
        groups: usize,
        start: usize,
        width: usize,
    ) -> Result<Tensor> {
        let rows = x.rows();
        let gw = checks::slice_groups(x, groups, start, width)?;
        let xd = self.dev(x)?;
        let out = self.out(rows * groups * width)?;
        self.gpu
            .slice_groups(buf(&xd), &out, rows, groups, gw, start, width)?;
        let shape = if groups == 1 {
            vec![rows, width]
        } else {
            vec![rows, groups, width]
        };
        self.finish(out, &shape)
    }

    fn concat_groups(&self, a: &Tensor, b: &Tensor, groups: usize) -> Result<Tensor> {
        let out = self.concat_on_device(a, b, groups, 0)?;
        let (rows, width) = (a.rows(), a.cols() + b.cols());
        self.finish(out, &[rows / groups, groups, width])
    }

    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor> {
        let xd = self.dev(x)?;
        let out = self.out(x.numel())?;
        self.gpu.scale(buf(&xd), s, &out, x.numel())?;
        self.finish(out, x.shape())
    }

    fn gather_rows(&self, x: &Tensor, rows: &[usize]) -> Result<Tensor> {
        let c = x.cols();
        checks::gather_rows(x, rows)?;
        let xd = self.dev(x)?;
        let idx = self.indices(rows)?;
        let out = self.out(rows.len() * c)?;
        self.gpu.gather_rows(buf(&xd), &idx, &out, rows.len(), c)?;
        self.finish(out, &[rows.len(), c])
    }

    fn scatter_add_rows(
        &self,
        acc: &mut Tensor,
        rows: &[usize],
        y: &Tensor,
        weights: &[f32],
    ) -> Result<()> {
        let c = acc.cols();
        checks::scatter_add_rows(acc, rows, y, weights)?;
        let (ad, yd) = (self.dev(acc)?, self.dev(y)?);
        let idx = self.indices(rows)?;
        let w = self.gpu.upload(weights, Elem::F32)?;
        self.gpu
            .scatter_add_rows(buf(&ad), &idx, buf(&yd), &w, rows.len(), c)?;
        self.refresh_host(acc, &ad)
    }

    fn routed_experts(
        &self,
        x: &Tensor,
        jobs: &[crate::backend::experts::ExpertJob],
        fetch: &mut crate::backend::experts::FetchExpert,
        each: bool,
    ) -> Result<crate::backend::experts::RoutedOutput> {
        self.experts_together(x, jobs, fetch, each)
    }

    fn route(&self, logits: &Tensor, bias: &Tensor, moe: &MoeLayout) -> Result<Routing> {
        checks::route(logits, bias, moe)?;
        let tokens = logits.rows();
        let k = moe.num_experts_per_tok;
        // The logits stay where the gate wrote them; the bias goes up in f32 (its host values
        // steer the choice, as on the CPU); ids and weights come back in one copy.
        let l = match logits.device() {
            Some(d) if self.holds(d, self.elem) => d.clone(),
            _ => Arc::new(self.gpu.upload(logits.data(), Elem::F32)?),
        };
        let b = self.constants.f32s(&self.gpu, bias.data())?;
        let out = self.gpu.alloc(tokens * 2 * k, Elem::F32)?;
        self.gpu.route(buf(&l), &b, moe, tokens, &out)?;
        let routed = self.gpu.download(&out)?;
        let rows = routed.chunks(2 * k.max(1));
        Ok(Routing {
            experts: rows
                .clone()
                .map(|r| {
                    r[..k]
                        .iter()
                        .map(|&i| if i >= 0.0 { i as usize } else { usize::MAX })
                        .collect()
                })
                .collect(),
            weights: rows.map(|r| r[k..].to_vec()).collect(),
        })
    }

    fn absorb_query(
        &self,
        q_nope: &Tensor,
        kv_b: &Tensor,
        dims: MlaDims,
        split: KvbSplit,
    ) -> Result<Tensor> {
        let n = checks::absorb_query(q_nope, kv_b, dims, split)?;
        self.kv_b_projection(false, q_nope, kv_b, dims, n, split.w_uk_row)
    }

    fn apply_w_uv(
        &self,
        o_lat: &Tensor,
        kv_b: &Tensor,
        dims: MlaDims,
        split: KvbSplit,
    ) -> Result<Tensor> {
        let n = checks::apply_w_uv(o_lat, kv_b, dims, split)?;
        self.kv_b_projection(true, o_lat, kv_b, dims, n, split.w_uv_row)
    }

    fn assemble_kv(&self, kv: &Tensor, k_pe: &Tensor, dims: MlaDims) -> Result<(Tensor, Tensor)> {
        let n = checks::assemble_kv(kv, k_pe, dims)?;
        let (kvd, ped) = (self.dev(kv)?, self.dev(k_pe)?);
        let kw = dims.heads * (dims.nope + dims.rope);
        let vw = dims.heads * dims.v;
        let k = self.out(n * kw)?;
        let v = self.out(n * vw)?;
        self.gpu.assemble_kv(
            buf(&kvd),
            buf(&ped),
            &k,
            &v,
            (n, dims.heads, dims.nope, dims.rope, dims.v),
        )?;
        Ok((self.finish(k, &[n, kw])?, self.finish(v, &[n, vw])?))
    }

    fn attention_naive(
        &self,
        q: &Tensor,
        k: &dyn RowSource,
        v: &dyn RowSource,
        call: AttnParams<'_>,
        out: &mut Tensor,
    ) -> Result<Tensor> {
        self.naive_attention(q, k, v, call, out)
    }

    fn attention_latent(
        &self,
        q_lat: &Tensor,
        q_pe: &Tensor,
        cache: &dyn RowSource,
        call: AttnParams<'_>,
        out: &mut Tensor,
    ) -> Result<Tensor> {
        self.latent_attention(q_lat, q_pe, cache, call, out)
    }

    fn index_scores(
        &self,
        q: &Tensor,
        weights: &Tensor,
        keys: &dyn RowSource,
        positions: &[usize],
        scale: f32,
    ) -> Result<Tensor> {
        self.indexer_scores(q, weights, keys, positions, scale)
    }

    fn linear_quant(&self, x: &Tensor, w: &QuantTensor, faults: QuantFaults) -> Result<Tensor> {
        if quant_kernel_name(w.ty).is_none() || x.cols() * 4 > self.gpu.max_shared_per_block() {
            // No kernel for the type, or a decoded row does not fit a block's shared memory.
            return crate::backend::linear_quant_host(x, w, faults);
        }
        let shape = checks::linear_quant(x, w)?;
        let (n, k) = (x.rows(), x.cols());
        let xd = self.dev(x)?;
        let wd = self.gpu.upload_bytes(w.bytes())?;
        let y = self.out(n * w.rows)?;
        self.gpu.linear_quant(
            w.ty,
            buf(&xd),
            &wd,
            &y,
            (n, k, w.rows),
            w.row_bytes(),
            faults.q4k_scale_unpack,
        )?;
        self.finish(y, &shape)
    }

    fn dequantize(&self, w: &QuantTensor, faults: QuantFaults) -> Result<Tensor> {
        if quant_kernel_name(w.ty).is_none() {
            return Ok(Tensor::from_vec(&[w.rows, w.cols], w.dequantize(faults)?));
        }
        let n = crate::tensor::checked_numel(&[w.rows, w.cols], "dequantized weight")?;
        let wd = self.gpu.upload_bytes(w.bytes())?;
        let out = self.out(n)?;
        self.gpu
            .dequant(w.ty, &wd, &out, n, faults.q4k_scale_unpack)?;
        self.finish(out, &[w.rows, w.cols])
    }

    fn index_topk(
        &self,
        scores: &Tensor,
        positions: &[usize],
        k: usize,
    ) -> Result<Vec<Vec<usize>>> {
        self.indexer_topk(scores, positions, k)
    }

    fn stats(&self, t: &Tensor) -> TensorStats {
        self.tensor_stats(t)
    }

    fn stats_many(&self, ts: &[&Tensor]) -> Vec<TensorStats> {
        self.tensors_stats(ts)
    }

    fn stats_batch(&self) -> Box<dyn crate::backend::StatsBatch + '_> {
        Box::new(stats::DeviceStatsBatch::new(self, &self.batch_scratch))
    }
}

impl CudaBackend {
    /// absorb_query (`apply` false) or apply_w_uv (`apply` true) on n·heads rows of `x`.
    fn kv_b_projection(
        &self,
        apply: bool,
        x: &Tensor,
        kv_b: &Tensor,
        dims: MlaDims,
        n: usize,
        w_row: usize,
    ) -> Result<Tensor> {
        let (xd, wd) = (self.dev(x)?, self.dev(kv_b)?);
        let (width, shape) = if apply {
            (dims.v, vec![n, dims.heads * dims.v])
        } else {
            (dims.latent, vec![n, dims.heads, dims.latent])
        };
        let out = self.out(n * dims.heads * width)?;
        self.gpu.kv_b_projection(
            apply,
            buf(&xd),
            buf(&wd),
            &out,
            (n, dims.heads, dims.nope, dims.v, dims.latent),
            w_row,
        )?;
        self.finish(out, &shape)
    }
}
