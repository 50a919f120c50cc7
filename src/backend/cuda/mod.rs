//! The CUDA backend: mladb's own kernels (kernels/*.cu, compiled by NVRTC at run time for the
//! device's compute capability) and cuBLAS GEMMs, through cudarc with dynamic loading so that the
//! crate builds and runs anywhere (no GPU: a clear error, never a panic).
//!
//! Tensors keep a host copy (the trace, the debugger and the TUI read it) and carry their device
//! buffer as a mirror: inputs found resident are used in place, weights are uploaded once and
//! stay with their cached tensor, outputs are computed on the device and copied back. KV caches
//! get device mirrors that replay the host cache's writes. Storage on the device is bf16 or f32
//! (arithmetic is f32 in both).

pub mod compile;
pub mod device;
pub mod fast;

use super::checks::{self, same_shape};
use super::{AttnMask, Backend, KvbSplit, MlaDims, Routing};
use crate::engine::cache::{RowSource, PAGE_SIZE};
use crate::engine::faults::KernelFaults;
use crate::engine::rope::RopeTable;
use crate::engine::StorageDtype;
use crate::error::{Error, Result};
use crate::gguf::GgmlType;
use crate::model::layout::MoeLayout;
use crate::model::quant::{QuantFaults, QuantTensor};
use crate::stats::TensorStats;
use crate::tensor::{BufferId, DType, DeviceBuffer, Tensor};
use device::{grid, Arg, DevBuf, Elem, Gpu};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// A device copy of a KV cache, kept in step with the host cache's writes.
struct CacheMirror {
    buf: DevBuf,
    /// Rows the buffer holds.
    rows: usize,
    /// Writes of the host cache already applied.
    applied: usize,
}

pub struct CudaBackend {
    gpu: Gpu,
    elem: Elem,
    caches: Mutex<HashMap<BufferId, CacheMirror>>,
    poison_outputs: AtomicBool,
    /// The statistics kernels' per-block partials, allocated once (stats run on every op).
    stats_scratch: Mutex<Option<DevBuf>>,
}

/// Whether a CUDA device can be used, and if not, why.
pub fn probe() -> std::result::Result<(), String> {
    // SAFETY: only tries to open libcuda.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda.so) on this machine".into());
    }
    if !compile::nvrtc_present() {
        return Err("NVRTC (libnvrtc.so) is not on the library path".into());
    }
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(()),
        Ok(_) => Err("no CUDA device".into()),
        Err(e) => Err(format!("the CUDA driver reports {e:?}")),
    }
}

const ATTN_THREADS: u32 = 128;
const SPLIT_KV_BLOCK: usize = 8;

impl CudaBackend {
    pub fn new(storage: StorageDtype) -> Result<CudaBackend> {
        probe().map_err(|why| Error::invalid(format!("--device cuda: {why}")))?;
        let gpu = Gpu::open(0)?;
        Ok(CudaBackend {
            gpu,
            elem: match storage {
                StorageDtype::F32 => Elem::F32,
                StorageDtype::Bf16 => Elem::Bf16,
            },
            caches: Mutex::new(HashMap::new()),
            poison_outputs: AtomicBool::new(false),
            stats_scratch: Mutex::new(None),
        })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub fn elem(&self) -> Elem {
        self.elem
    }

    fn k(&self, name: &str) -> String {
        format!("{name}_{}", self.elem.suffix())
    }

    /// The device buffer of `t` in this backend's storage type: its mirror if it has one,
    /// else uploaded now (and attached, so later ops find it).
    fn dev(&self, t: &Tensor) -> Result<Arc<dyn DeviceBuffer>> {
        if let Some(d) = t.device() {
            if d.as_any()
                .downcast_ref::<DevBuf>()
                .is_some_and(|b| b.elem == self.elem)
            {
                return Ok(d.clone());
            }
        }
        let buf: Arc<dyn DeviceBuffer> = Arc::new(self.gpu.upload(t.data(), self.elem)?);
        if t.device().is_none() {
            t.attach_device(buf.clone());
        }
        Ok(buf)
    }

    fn ptr(b: &Arc<dyn DeviceBuffer>) -> u64 {
        b.address()
    }

    /// A tensor for a computed device buffer: copies it back and attaches it.
    fn finish(&self, buf: DevBuf, shape: &[usize]) -> Result<Tensor> {
        let data = self.gpu.download(&buf)?;
        let t = Tensor::from_vec(shape, data);
        t.attach_device(Arc::new(buf));
        Ok(t)
    }

    fn out(&self, numel: usize) -> Result<DevBuf> {
        crate::tensor::checked_numel(&[numel], "device tensor")?;
        let buf = self.gpu.alloc(numel, self.elem)?;
        if self.poison_outputs.load(Ordering::Relaxed) {
            self.gpu.fill(&buf, true)?;
        }
        Ok(buf)
    }

    /// Brings a cache's device mirror up to date; returns its device pointer.
    fn sync_cache(&self, src: &dyn RowSource) -> Result<u64> {
        let mut caches = self.caches.lock().unwrap_or_else(|p| p.into_inner());
        let width = src.width();
        let physical = |slot: usize| match src.block_table() {
            Some(bt) => bt[slot / PAGE_SIZE] * PAGE_SIZE + slot % PAGE_SIZE,
            None => slot,
        };
        let needed = match src.block_table() {
            Some(bt) => (bt.iter().max().map_or(0, |m| m + 1)) * PAGE_SIZE,
            None => src.len(),
        }
        .max(1);
        let mirror = match caches.remove(&src.id()) {
            Some(m) if m.rows >= needed => m,
            old => {
                let rows = needed.max(old.as_ref().map_or(0, |m| m.rows * 2));
                let mut buf = self.gpu.alloc(rows * width, self.elem)?;
                self.gpu.fill(&buf, src.poisoned())?;
                let applied = match &old {
                    Some(m) => {
                        self.gpu.copy(&m.buf, 0, &mut buf, 0, m.rows * width)?;
                        m.applied
                    }
                    None => 0,
                };
                CacheMirror { buf, rows, applied }
            }
        };
        let mut mirror = mirror;
        // Replay the new writes, uploading runs of consecutive slots at once.
        let writes = &src.writes()[mirror.applied..];
        let mut i = 0;
        while i < writes.len() {
            let mut j = i + 1;
            while j < writes.len()
                && writes[j] == writes[j - 1] + 1
                && physical(writes[j]) == physical(writes[j - 1]) + 1
            {
                j += 1;
            }
            let rows: Vec<f32> = writes[i..j]
                .iter()
                .flat_map(|&s| src.row(s).to_vec())
                .collect();
            self.gpu
                .write(&mut mirror.buf, physical(writes[i]) * width, &rows)?;
            i = j;
        }
        mirror.applied = src.writes().len();
        let ptr = mirror.buf.ptr;
        caches.insert(src.id(), mirror);
        Ok(ptr)
    }

    /// The mask as bytes [n, context] (1 = the query may see the key), or a null pointer for
    /// plain causal masking.
    fn mask_bytes(&self, mask: &AttnMask, context: usize) -> Result<Option<DevBuf>> {
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

    /// After a kernel wrote `t`'s device buffer in place: copies it back into the host copy,
    /// keeping the device buffer attached.
    fn refresh_host(&self, t: &mut Tensor, dev: &Arc<dyn DeviceBuffer>) -> Result<()> {
        let buf = dev
            .as_any()
            .downcast_ref::<DevBuf>()
            .expect("dev() returns DevBufs");
        let data = self.gpu.download(buf)?;
        t.data_mut_keeping_device().copy_from_slice(&data);
        Ok(())
    }

    /// absorb_query and apply_w_uv: one kernel over n·heads rows of `x` and the kv_b rows of
    /// each head starting at `w_row` (the two kernels take the same arguments).
    #[allow(clippy::too_many_arguments)]
    fn kv_b_projection(
        &self,
        kernel: &str,
        x: &Tensor,
        kv_b: &Tensor,
        dims: MlaDims,
        n: usize,
        out_width: usize,
        w_row: usize,
        shape: &[usize],
    ) -> Result<Tensor> {
        let (xd, wd) = (self.dev(x)?, self.dev(kv_b)?);
        let total = n * dims.heads * out_width;
        let out = self.out(total)?;
        self.gpu.launch(
            &self.k(kernel),
            grid(total as u64),
            256,
            0,
            &[
                Self::ptr(&xd).into(),
                Self::ptr(&wd).into(),
                out.ptr.into(),
                n.into(),
                dims.heads.into(),
                dims.nope.into(),
                dims.v.into(),
                dims.latent.into(),
                w_row.into(),
            ],
        )?;
        self.finish(out, shape)
    }

    fn positions(&self, positions: &[usize]) -> Result<DevBuf> {
        let p: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        self.gpu.upload_i32(&p)
    }

    fn elementwise(
        &self,
        name: &str,
        inputs: &[&Tensor],
        extra: &[Arg],
        shape: &[usize],
    ) -> Result<Tensor> {
        let n = shape.iter().product::<usize>();
        let out = self.out(n)?;
        let bufs: Vec<Arc<dyn DeviceBuffer>> =
            inputs.iter().map(|t| self.dev(t)).collect::<Result<_>>()?;
        // Kernel argument order: inputs, extra scalars, out, n (see elementwise.cu).
        let mut ordered: Vec<Arg> = bufs.iter().map(|b| Arg::U64(Self::ptr(b))).collect();
        ordered.extend_from_slice(extra);
        ordered.push(Arg::U64(out.ptr));
        ordered.push(Arg::U64(n as u64));
        self.gpu
            .launch(&self.k(name), grid(n as u64), 256, 0, &ordered)?;
        self.finish(out, shape)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn set_poison_outputs(&self, on: bool) {
        self.poison_outputs.store(on, Ordering::Relaxed);
    }

    fn alloc(&self, shape: &[usize], poison: bool) -> Result<Tensor> {
        let n = crate::tensor::checked_numel(shape, "device tensor")?;
        let buf = self.gpu.alloc(n, self.elem)?;
        self.gpu.fill(&buf, poison)?;
        let host = Tensor::alloc(shape, poison)?;
        host.attach_device(Arc::new(buf));
        Ok(host)
    }

    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let k = x.cols();
        let out_features = checks::linear(x, w)?;
        let n = x.rows();
        let mut shape = x.shape().to_vec();
        *shape.last_mut().expect("linear input has a shape") = out_features;
        let (xd, wd) = (self.dev(x)?, self.dev(w)?);
        let y = self.out(n * out_features)?;
        // SAFETY: dev() and out() give live buffers of n·k, out·k and n·out elements of this
        // backend's storage type.
        unsafe {
            self.gpu.gemm_xwt(
                xd.address(),
                wd.address(),
                y.ptr,
                n,
                k,
                out_features,
                self.elem,
            )?
        };
        if let Some(b) = bias {
            let bd = self.dev(b)?;
            self.gpu.launch(
                &self.k("add_bias"),
                grid((n * out_features) as u64),
                256,
                0,
                &[
                    y.ptr.into(),
                    Self::ptr(&bd).into(),
                    n.into(),
                    out_features.into(),
                ],
            )?;
        }
        self.finish(y, &shape)
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
        let (rows, cols) = (x.rows(), x.cols());
        let (xd, wd) = (self.dev(x)?, self.dev(weight)?);
        let out = self.out(x.numel())?;
        self.gpu.launch(
            &self.k("rmsnorm"),
            (rows.max(1) as u32, 1, 1),
            256,
            0,
            &[
                Self::ptr(&xd).into(),
                Self::ptr(&wd).into(),
                out.ptr.into(),
                cols.into(),
                (eps as f32).into(),
            ],
        )?;
        self.finish(out, x.shape())
    }

    fn layer_norm(&self, x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
        let (rows, cols) = (x.rows(), x.cols());
        let (xd, wd, bd) = (self.dev(x)?, self.dev(weight)?, self.dev(bias)?);
        let out = self.out(x.numel())?;
        self.gpu.launch(
            &self.k("layernorm"),
            (rows.max(1) as u32, 1, 1),
            256,
            0,
            &[
                Self::ptr(&xd).into(),
                Self::ptr(&wd).into(),
                Self::ptr(&bd).into(),
                out.ptr.into(),
                cols.into(),
                (eps as f32).into(),
            ],
        )?;
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
        let half = table.inv_freq.len();
        let xd = self.dev(x)?;
        let pos = self.positions(positions)?;
        let freq = self.gpu.upload(&table.inv_freq, Elem::F32)?;
        let out = self.out(x.numel())?;
        self.gpu.launch(
            &self.k("rope"),
            grid(x.numel() as u64),
            256,
            0,
            &[
                Self::ptr(&xd).into(),
                out.ptr.into(),
                n.into(),
                heads.into(),
                d.into(),
                half.into(),
                (&pos).into(),
                (&freq).into(),
                table.attention_factor.into(),
                (interleaved as i32).into(),
            ],
        )?;
        self.finish(out, x.shape())
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        same_shape("silu_mul", gate, up)?;
        self.elementwise("silu_mul", &[gate, up], &[], gate.shape())
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        same_shape("add", a, b)?;
        self.elementwise("add", &[a, b], &[], a.shape())
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
        let n = rows * groups * width;
        let out = self.out(n)?;
        self.gpu.launch(
            &self.k("slice_groups"),
            grid(n as u64),
            256,
            0,
            &[
                Self::ptr(&xd).into(),
                out.ptr.into(),
                rows.into(),
                groups.into(),
                gw.into(),
                start.into(),
                width.into(),
            ],
        )?;
        let shape = if groups == 1 {
            vec![rows, width]
        } else {
            vec![rows, groups, width]
        };
        self.finish(out, &shape)
    }

    fn concat_groups(&self, a: &Tensor, b: &Tensor, groups: usize) -> Result<Tensor> {
        let (wa, wb) = (a.cols(), b.cols());
        let rows = a.rows();
        checks::concat_groups(a, b, groups)?;
        let (ad, bd) = (self.dev(a)?, self.dev(b)?);
        let out = self.out(rows * (wa + wb))?;
        self.gpu.launch(
            &self.k("concat_groups"),
            grid((rows * (wa + wb)) as u64),
            256,
            0,
            &[
                Self::ptr(&ad).into(),
                Self::ptr(&bd).into(),
                out.ptr.into(),
                rows.into(),
                wa.into(),
                wb.into(),
            ],
        )?;
        self.finish(out, &[rows / groups, groups, wa + wb])
    }

    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor> {
        self.elementwise("scale", &[x], &[s.into()], x.shape())
    }

    fn gather_rows(&self, x: &Tensor, rows: &[usize]) -> Result<Tensor> {
        let c = x.cols();
        checks::gather_rows(x, rows)?;
        let xd = self.dev(x)?;
        let idx = self
            .gpu
            .upload_i32(&rows.iter().map(|&r| r as i32).collect::<Vec<_>>())?;
        let out = self.out(rows.len() * c)?;
        self.gpu.launch(
            &self.k("gather_rows"),
            grid((rows.len() * c) as u64),
            256,
            0,
            &[
                Self::ptr(&xd).into(),
                (&idx).into(),
                out.ptr.into(),
                rows.len().into(),
                c.into(),
            ],
        )?;
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
        let idx = self
            .gpu
            .upload_i32(&rows.iter().map(|&r| r as i32).collect::<Vec<_>>())?;
        let w = self.gpu.upload(weights, Elem::F32)?;
        self.gpu.launch(
            &self.k("scatter_add_rows"),
            grid((rows.len() * c) as u64),
            256,
            0,
            &[
                Self::ptr(&ad).into(),
                (&idx).into(),
                Self::ptr(&yd).into(),
                (&w).into(),
                rows.len().into(),
                c.into(),
            ],
        )?;
        self.refresh_host(acc, &ad)?;
        Ok(())
    }

    fn route(&self, logits: &Tensor, bias: &Tensor, moe: &MoeLayout) -> Result<Routing> {
        let tokens = logits.rows();
        let e = moe.n_routed_experts;
        let k = moe.num_experts_per_tok;
        let l = self.gpu.upload(logits.data(), Elem::F32)?;
        let b = self.gpu.upload(bias.data(), Elem::F32)?;
        let ids = self.gpu.alloc(tokens * k, Elem::F32)?;
        let w = self.gpu.alloc(tokens * k, Elem::F32)?;
        let scratch = self.gpu.alloc(tokens * (2 * e + moe.n_group), Elem::F32)?;
        self.gpu.launch(
            "route_f32",
            grid(tokens as u64),
            256,
            0,
            &[
                (&l).into(),
                (&b).into(),
                tokens.into(),
                (e as i32).into(),
                (moe.n_group as i32).into(),
                (moe.topk_group as i32).into(),
                (k as i32).into(),
                (moe.norm_topk_prob as i32).into(),
                (moe.routed_scaling_factor as f32).into(),
                (&ids).into(),
                (&w).into(),
                (&scratch).into(),
            ],
        )?;
        let id_bytes = self.gpu.download_bytes(&ids, tokens * k * 4)?;
        let weights = self.gpu.download(&w)?;
        let ids: Vec<usize> = id_bytes
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .collect();
        Ok(Routing {
            experts: ids.chunks(k).map(<[usize]>::to_vec).collect(),
            weights: weights.chunks(k).map(<[f32]>::to_vec).collect(),
        })
    }

    fn absorb_query(
        &self,
        q_nope: &Tensor,
        kv_b: &Tensor,
        dims: MlaDims,
        split: KvbSplit,
    ) -> Result<Tensor> {
        let n = q_nope.numel() / (dims.heads * dims.nope);
        let shape = [n, dims.heads, dims.latent];
        self.kv_b_projection(
            "absorb_query",
            q_nope,
            kv_b,
            dims,
            n,
            dims.latent,
            split.w_uk_row,
            &shape,
        )
    }

    fn apply_w_uv(
        &self,
        o_lat: &Tensor,
        kv_b: &Tensor,
        dims: MlaDims,
        split: KvbSplit,
    ) -> Result<Tensor> {
        let n = o_lat.numel() / (dims.heads * dims.latent);
        let shape = [n, dims.heads * dims.v];
        self.kv_b_projection(
            "apply_w_uv",
            o_lat,
            kv_b,
            dims,
            n,
            dims.v,
            split.w_uv_row,
            &shape,
        )
    }

    fn assemble_kv(&self, kv: &Tensor, k_pe: &Tensor, dims: MlaDims) -> Result<(Tensor, Tensor)> {
        let n = kv.rows();
        let (kvd, ped) = (self.dev(kv)?, self.dev(k_pe)?);
        let kw = dims.heads * (dims.nope + dims.rope);
        let vw = dims.heads * dims.v;
        let k = self.out(n * kw)?;
        let v = self.out(n * vw)?;
        self.gpu.launch(
            &self.k("assemble_kv"),
            grid((n * (kw + vw)) as u64),
            256,
            0,
            &[
                Self::ptr(&kvd).into(),
                Self::ptr(&ped).into(),
                k.ptr.into(),
                v.ptr.into(),
                n.into(),
                dims.heads.into(),
                dims.nope.into(),
                dims.rope.into(),
                dims.v.into(),
            ],
        )?;
        Ok((self.finish(k, &[n, kw])?, self.finish(v, &[n, vw])?))
    }

    fn attention_naive(
        &self,
        q: &Tensor,
        k: &dyn RowSource,
        v: &dyn RowSource,
        dims: MlaDims,
        mask: &AttnMask,
        scale: f32,
        out: &mut Tensor,
        faults: KernelFaults,
    ) -> Result<Tensor> {
        let n = mask.positions.len();
        let context = k.len();
        let heads = dims.heads;
        checks::attention_out(out, n, dims, dims.v)?;
        let qd = self.dev(q)?;
        let (kp, vp) = (self.sync_cache(k)?, self.sync_cache(v)?);
        let od = self.dev(out)?;
        let pos = self.positions(&mask.positions)?;
        let m = self.mask_bytes(mask, context)?;
        let probs = self.gpu.alloc(heads * n * context, Elem::F32)?;
        self.gpu.fill(&probs, false)?;
        self.gpu.launch(
            &self.k("attn_naive"),
            ((n * heads) as u32, 1, 1),
            ATTN_THREADS,
            0,
            &[
                Self::ptr(&qd).into(),
                kp.into(),
                vp.into(),
                (&pos).into(),
                m.as_ref().map_or(0u64, |b| b.ptr).into(),
                Self::ptr(&od).into(),
                (&probs).into(),
                n.into(),
                heads.into(),
                (dims.nope + dims.rope).into(),
                dims.v.into(),
                context.into(),
                scale.into(),
                (faults.skip_padded_rows as i32).into(),
            ],
        )?;
        self.refresh_host(out, &od)?;
        self.finish(probs, &[heads, n, context])
    }

    fn attention_latent(
        &self,
        q_lat: &Tensor,
        q_pe: &Tensor,
        cache: &dyn RowSource,
        dims: MlaDims,
        mask: &AttnMask,
        scale: f32,
        out: &mut Tensor,
        faults: KernelFaults,
    ) -> Result<Tensor> {
        let n = mask.positions.len();
        let context = cache.len();
        let (heads, l, r) = (dims.heads, dims.latent, dims.rope);
        checks::attention_out(out, n, dims, l)?;
        let (qld, qpd) = (self.dev(q_lat)?, self.dev(q_pe)?);
        let cp = self.sync_cache(cache)?;
        let table: Vec<i32> = cache
            .block_table()
            .unwrap_or(&[])
            .iter()
            .map(|&p| p as i32)
            .collect();
        let bt = self
            .gpu
            .upload_i32(if table.is_empty() { &[0] } else { &table })?;
        let od = self.dev(out)?;
        let pos = self.positions(&mask.positions)?;
        let m = self.mask_bytes(mask, context)?;
        let splits = context.div_ceil(SPLIT_KV_BLOCK).max(1);
        let acc = self.gpu.alloc(n * heads * splits * l, Elem::F32)?;
        let maxes = self.gpu.alloc(n * heads * splits, Elem::F32)?;
        let sums = self.gpu.alloc(n * heads * splits, Elem::F32)?;
        let probs = self.gpu.alloc(heads * n * context, Elem::F32)?;
        self.gpu.fill(&probs, false)?;
        let mask_ptr = m.as_ref().map_or(0u64, |b| b.ptr);
        self.gpu.launch(
            &self.k("attn_latent_partial"),
            ((n * heads) as u32, splits as u32, 1),
            64,
            0,
            &[
                Self::ptr(&qld).into(),
                Self::ptr(&qpd).into(),
                cp.into(),
                (&bt).into(),
                (&pos).into(),
                mask_ptr.into(),
                (&acc).into(),
                (&maxes).into(),
                (&sums).into(),
                (&probs).into(),
                n.into(),
                heads.into(),
                l.into(),
                r.into(),
                context.into(),
                splits.into(),
                scale.into(),
                (faults.skip_padded_rows as i32).into(),
            ],
        )?;
        self.gpu.launch(
            &self.k("attn_latent_merge"),
            ((n * heads) as u32, 1, 1),
            ATTN_THREADS,
            (splits * 4) as u32,
            &[
                (&acc).into(),
                (&maxes).into(),
                (&sums).into(),
                (&pos).into(),
                mask_ptr.into(),
                Self::ptr(&od).into(),
                (&probs).into(),
                n.into(),
                heads.into(),
                l.into(),
                context.into(),
                splits.into(),
                (faults.lse_base_mismatch as i32).into(),
                (faults.skip_padded_rows as i32).into(),
            ],
        )?;
        self.refresh_host(out, &od)?;
        self.finish(probs, &[heads, n, context])
    }

    fn index_scores(
        &self,
        q: &Tensor,
        weights: &Tensor,
        keys: &dyn RowSource,
        positions: &[usize],
        scale: f32,
    ) -> Result<Tensor> {
        let n = positions.len();
        let heads = weights.cols();
        let d = q.numel() / (n * heads).max(1);
        let context = keys.len();
        let (qd, wd) = (self.dev(q)?, self.dev(weights)?);
        let kp = self.sync_cache(keys)?;
        let pos = self.positions(positions)?;
        let out = self.gpu.alloc(n * context, Elem::F32)?;
        self.gpu.launch(
            &self.k("index_scores"),
            grid((n * context) as u64),
            256,
            0,
            &[
                Self::ptr(&qd).into(),
                Self::ptr(&wd).into(),
                kp.into(),
                (&pos).into(),
                (&out).into(),
                n.into(),
                heads.into(),
                d.into(),
                context.into(),
                scale.into(),
            ],
        )?;
        self.finish(out, &[n, context])
    }

    fn linear_quant(&self, x: &Tensor, w: &QuantTensor, faults: QuantFaults) -> Result<Tensor> {
        let Some(ty) = quant_kernel_name(w.ty) else {
            return crate::backend::linear_quant_host(x, w, faults);
        };
        let shape = checks::linear_quant(x, w)?;
        let (n, k) = (x.rows(), x.cols());
        // One decoded weight row per block in shared memory.
        let shared = k * 4;
        if shared > self.gpu.max_shared_per_block() {
            return crate::backend::linear_quant_host(x, w, faults);
        }
        let xd = self.dev(x)?;
        let wd = self.gpu.upload_bytes(w.bytes())?;
        let y = self.out(n * w.rows)?;
        self.gpu.launch(
            &self.k(&format!("linear_{ty}")),
            (w.rows as u32, n.div_ceil(64) as u32, 1),
            256,
            shared as u32,
            &[
                Self::ptr(&xd).into(),
                (&wd).into(),
                y.ptr.into(),
                n.into(),
                k.into(),
                w.rows.into(),
                w.row_bytes().into(),
                (faults.q4k_scale_unpack as i32).into(),
            ],
        )?;
        self.finish(y, &shape)
    }

    fn dequantize(&self, w: &QuantTensor, faults: QuantFaults) -> Result<Tensor> {
        let Some(ty) = quant_kernel_name(w.ty) else {
            return Ok(Tensor::from_vec(&[w.rows, w.cols], w.dequantize(faults)?));
        };
        let n = crate::tensor::checked_numel(&[w.rows, w.cols], "dequantized weight")?;
        let wd = self.gpu.upload_bytes(w.bytes())?;
        let out = self.out(n)?;
        self.gpu.launch(
            &self.k(&format!("dequant_{ty}")),
            grid(n as u64),
            256,
            0,
            &[
                (&wd).into(),
                out.ptr.into(),
                n.into(),
                (faults.q4k_scale_unpack as i32).into(),
            ],
        )?;
        self.finish(out, &[w.rows, w.cols])
    }

    fn index_topk(
        &self,
        scores: &Tensor,
        positions: &[usize],
        k: usize,
    ) -> Result<Vec<Vec<usize>>> {
        crate::backend::checks::index_topk(scores, positions)?;
        let (n, context) = (scores.rows(), scores.cols());
        if n == 0 || context == 0 {
            return Ok(vec![Vec::new(); n]);
        }
        // The scores as f32 on the device: index_scores leaves them there.
        let on_device = scores.device().filter(|d| {
            d.as_any()
                .downcast_ref::<DevBuf>()
                .is_some_and(|b| b.elem == Elem::F32)
        });
        let scores_dev: Arc<dyn DeviceBuffer> = match on_device {
            Some(d) => d.clone(),
            None => Arc::new(self.gpu.upload(scores.data(), Elem::F32)?),
        };
        let pos = self.positions(positions)?;
        let cells = crate::tensor::checked_numel(&[n, context], "top-k selection")?;
        let selected = self.gpu.alloc(cells.div_ceil(4), Elem::F32)?;
        self.gpu.launch(
            "topk_select",
            (n as u32, 1, 1),
            256,
            0,
            &[
                Self::ptr(&scores_dev).into(),
                (&pos).into(),
                (&selected).into(),
                context.into(),
                k.into(),
            ],
        )?;
        let flags = self.gpu.download_bytes(&selected, cells)?;
        Ok(flags
            .chunks(context)
            .map(|row| (0..context).filter(|&j| row[j] != 0).collect())
            .collect())
    }

    fn stats(&self, t: &Tensor) -> TensorStats {
        // Small tensors are summed from their host copy (downloaded from the device, poison
        // included): a kernel launch and its wait would cost more than the pass.
        const DEVICE_STATS_FROM: usize = 1 << 14;
        match t.device().and_then(|d| d.as_any().downcast_ref::<DevBuf>()) {
            Some(buf) if t.dtype() == DType::F32 && t.numel() >= DEVICE_STATS_FROM => self
                .device_stats(buf)
                .unwrap_or_else(|_| TensorStats::of_unordered(t.data())),
            // Device runs are checked within a tolerance: the faster, reordered pass will do.
            _ => TensorStats::of_unordered(t.data()),
        }
    }
}

/// The name part of the dequantization kernels of a ggml type (kernels/dequant.cu).
pub fn quant_kernel_name(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q2_K => "q2_k",
        GgmlType::Q3_K => "q3_k",
        GgmlType::Q4_K => "q4_k",
        GgmlType::Q5_K => "q5_k",
        GgmlType::Q6_K => "q6_k",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        _ => return None,
    })
}

impl CudaBackend {
    /// Statistics computed on the device in one pass (partials per block), the partials merged
    /// on the device too, so that one row of 11 doubles comes back.
    pub fn device_stats(&self, buf: &DevBuf) -> Result<TensorStats> {
        const STATS: usize = 11;
        const MAX_BLOCKS: usize = 1024;
        let n = buf.len as u64;
        let blocks = (n.div_ceil(256)).clamp(1, MAX_BLOCKS as u64) as u32;
        let mut scratch = self.stats_scratch.lock().unwrap_or_else(|e| e.into_inner());
        if scratch.is_none() {
            *scratch = Some(self.gpu.alloc(MAX_BLOCKS * STATS * 2, Elem::F32)?);
        }
        let partials = scratch.as_ref().expect("allocated above");
        let name = format!("stats_{}", buf.elem.suffix());
        self.gpu.launch(
            &name,
            (blocks, 1, 1),
            256,
            0,
            &[buf.ptr.into(), n.into(), partials.into()],
        )?;
        self.gpu.launch(
            "stats_merge",
            (1, 1, 1),
            256,
            0,
            &[partials.into(), Arg::I32(blocks as i32)],
        )?;
        let bytes = self.gpu.download_bytes(partials, STATS * 8)?;
        let vals: Vec<f64> = bytes
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect();
        let mut acc = [
            0f64,
            0.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
        ];
        for p in vals.chunks_exact(STATS) {
            acc[0] += p[0];
            acc[1] += p[1];
            acc[2] = acc[2].min(p[2]);
            acc[3] = acc[3].max(p[3]);
            acc[4] = acc[4].max(p[4]);
            for k in 5..STATS {
                acc[k] += p[k];
            }
        }
        let finite = acc[5] as usize;
        let mut s = TensorStats {
            count: buf.len,
            min: f64::NAN,
            max: f64::NAN,
            mean: f64::NAN,
            std: f64::NAN,
            abs_max: 0.0,
            l2: 0.0,
            nan: acc[6] as usize,
            pos_inf: acc[7] as usize,
            neg_inf: acc[8] as usize,
            zeros: acc[9] as usize,
            unwritten: acc[10] as usize,
        };
        if finite > 0 {
            s.min = acc[2];
            s.max = acc[3];
            s.mean = acc[0] / finite as f64;
            s.std = (acc[1] / finite as f64 - s.mean * s.mean).max(0.0).sqrt();
            s.abs_max = acc[4];
            s.l2 = acc[1].sqrt();
        }
        Ok(s)
    }
}
