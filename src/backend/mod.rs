//! Backends run the numerical ops of the forward pass. The CPU backend is the reference and is
//! always built; a CUDA backend with mladb's own kernels comes beside it. The engine calls only
//! this trait for arithmetic, so the same op sequence runs on either.

pub mod checks;
mod choice;
pub mod cpu;
pub mod cuda;
pub mod experts;

pub use choice::{select, DeviceChoice};

use crate::error::Result;
use crate::model::layout::MoeLayout;
use crate::model::quant::{QuantFaults, QuantTensor};
use crate::ops::{AttnKernels, KernelFaults, KernelLaunch, RopeTable, RowSource};
use crate::stats::TensorStats;
use crate::tensor::Tensor;

pub use crate::ops::Routing;

/// Which keys each query row may attend to.
#[derive(Debug, Clone)]
pub struct AttnMask {
    /// Absolute position of each query row; query i sees keys 0..=positions[i] (causal).
    pub positions: Vec<usize>,
    /// When present, query i sees only these keys (sorted, each ≤ positions[i]): the DSA
    /// indexer's top-k selection.
    pub selected: Option<Vec<Vec<usize>>>,
}

impl AttnMask {
    pub fn causal(positions: Vec<usize>) -> AttnMask {
        AttnMask {
            positions,
            selected: None,
        }
    }

    /// The keys query `i` attends to.
    pub fn keys(&self, i: usize) -> KeyIter<'_> {
        match &self.selected {
            Some(sel) => KeyIter::Listed(sel[i].iter()),
            None => KeyIter::Prefix(0..self.positions[i] + 1),
        }
    }
}

pub enum KeyIter<'a> {
    Prefix(std::ops::Range<usize>),
    Listed(std::slice::Iter<'a, usize>),
}

impl Iterator for KeyIter<'_> {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        match self {
            KeyIter::Prefix(r) => r.next(),
            KeyIter::Listed(it) => it.next().copied(),
        }
    }
}

/// What an attention call takes beside its query, its key and value rows, and its output: the
/// head dims, which keys each query sees, the softmax scale and the faults the kernel itself
/// carries out. One value for the reference and the production kernels, which are called alike.
#[derive(Debug, Clone, Copy)]
pub struct AttnParams<'a> {
    pub dims: MlaDims,
    pub mask: &'a AttnMask,
    pub scale: f32,
    pub faults: KernelFaults,
}

impl<'a> AttnParams<'a> {
    /// Dims, mask, scale and faults apart, for a kernel body that uses each throughout.
    pub fn parts(self) -> (MlaDims, &'a AttnMask, f32, KernelFaults) {
        (self.dims, self.mask, self.scale, self.faults)
    }
}

/// Head geometry of MLA, as the attention ops need it.
#[derive(Debug, Clone, Copy)]
pub struct MlaDims {
    pub heads: usize,
    /// qk_nope_head_dim (P)
    pub nope: usize,
    /// qk_rope_head_dim (R)
    pub rope: usize,
    /// v_head_dim (V)
    pub v: usize,
    /// kv_lora_rank (L)
    pub latent: usize,
}

/// Where W_UK and W_UV start inside each head's block of kv_b_proj rows ([W_UK (P rows); W_UV
/// (V rows)] in every real checkpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvbSplit {
    pub w_uk_row: usize,
    pub w_uv_row: usize,
}

impl KvbSplit {
    /// The split every real checkpoint uses.
    pub fn correct(dims: MlaDims) -> KvbSplit {
        KvbSplit {
            w_uk_row: 0,
            w_uv_row: dims.nope,
        }
    }
}

/// A device buffer a fast attention kernel read beyond its inputs: the cache's pages on the
/// device, the block table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRead {
    pub id: crate::tensor::BufferId,
    pub address: u64,
    pub bytes: usize,
    pub device_index: usize,
}

/// What a fast (production) attention kernel produced beside the output it wrote.
pub struct FastAttention {
    /// Log-sum-exp (natural log) per query and head, [n, heads] f32.
    pub lse: Tensor,
    /// The split-KV partials before the merge, when the kernel split the keys: each split's
    /// normalised output [n, splits, heads, width] and its log-sum-exp [n, splits, heads].
    pub partials: Option<(Tensor, Tensor)>,
    /// The rows of a padded batch (CUDA-graph capture size) past the real ones, as the kernel
    /// wrote them: [pad, heads, width], zeros when correct; `None` when nothing was padded.
    pub padding: Option<Tensor>,
    /// The launches, in order (the split kernel, then the merge).
    pub launches: Vec<KernelLaunch>,
    /// Device buffers read beyond the inputs.
    pub reads: Vec<DeviceRead>,
}

/// A fast kernel ran, or declined (with why) and the caller runs the reference instead.
pub enum FastOutcome {
    Ran(Box<FastAttention>),
    Declined(String),
}

/// Where the ranks of a tensor-parallel run compute, and what joins them.
#[derive(Clone)]
pub struct RankBackends {
    /// One backend per rank.
    pub backends: Vec<std::sync::Arc<dyn Backend>>,
    /// The all-reduce across the ranks (NCCL across GPUs; the CPU's exact sum in rank order);
    /// `None`: each rank sums the parts itself in rank order (ranks sharing one GPU).
    pub all_reduce: Option<std::sync::Arc<dyn AllReduce>>,
    /// Where the ranks run and what joins them, in a line for the user.
    pub note: String,
}

/// A sum across the devices of a tensor-parallel run's ranks.
pub trait AllReduce: Send + Sync {
    /// The sum of `parts` (rank r's on rank r's device), one tensor per rank on its device.
    fn sum(&self, parts: &[&Tensor]) -> Result<Vec<Tensor>>;

    /// Seconds spent summing so far, from every rank's inputs being ready to every rank's sum
    /// being done (the ranks' own compute is not in it).
    fn seconds(&self) -> f64;
}

/// Time an [`AllReduce`] spends summing, added up over its calls.
#[derive(Default)]
pub struct SumClock(std::sync::atomic::AtomicU64);

impl SumClock {
    /// Runs `f`, counting its wall time.
    pub fn time<T>(&self, f: impl FnOnce() -> T) -> T {
        let start = std::time::Instant::now();
        let out = f();
        let nanos = start.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        self.0
            .fetch_add(nanos, std::sync::atomic::Ordering::Relaxed);
        out
    }

    pub fn seconds(&self) -> f64 {
        self.0.load(std::sync::atomic::Ordering::Relaxed) as f64 * 1e-9
    }
}

/// A kind of call into the device's driver or libraries, as [`DriverCalls`] counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverCall {
    Alloc,
    Launch,
    Gemm,
    Upload,
    Download,
    Copy,
    TensorMap,
    Wait,
}

impl DriverCall {
    pub const ALL: [DriverCall; 8] = [
        DriverCall::Alloc,
        DriverCall::Launch,
        DriverCall::Gemm,
        DriverCall::Upload,
        DriverCall::Download,
        DriverCall::Copy,
        DriverCall::TensorMap,
        DriverCall::Wait,
    ];

    /// The kind in a word, for tables.
    pub fn word(self) -> &'static str {
        match self {
            DriverCall::Alloc => "allocations",
            DriverCall::Launch => "kernel launches",
            DriverCall::Gemm => "cuBLAS GEMMs",
            DriverCall::Upload => "uploads",
            DriverCall::Download => "downloads",
            DriverCall::Copy => "device copies",
            DriverCall::TensorMap => "tensor maps",
            DriverCall::Wait => "waits",
        }
    }
}

/// Calls into the driver and their host time, per [`DriverCall`] kind (indexed by it), added up
/// since the process started (every device): subtract two to charge what happened between them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverCalls {
    pub calls: [u64; DriverCall::ALL.len()],
    pub nanos: [u64; DriverCall::ALL.len()],
}

impl DriverCalls {
    /// What was added between `earlier` and `self`.
    pub fn since(&self, earlier: &DriverCalls) -> DriverCalls {
        let mut d = DriverCalls::default();
        for i in 0..DriverCall::ALL.len() {
            d.calls[i] = self.calls[i].saturating_sub(earlier.calls[i]);
            d.nanos[i] = self.nanos[i].saturating_sub(earlier.nanos[i]);
        }
        d
    }

    /// Adds `other` in.
    pub fn add(&mut self, other: &DriverCalls) {
        for i in 0..DriverCall::ALL.len() {
            self.calls[i] += other.calls[i];
            self.nanos[i] += other.nanos[i];
        }
    }

    /// Every call, and the host seconds of those that issue work: waits and downloads, which
    /// wait for the device, left out.
    pub fn issuing(&self) -> (u64, f64) {
        let (calls, secs) = self.total();
        let waiting: u64 = [DriverCall::Wait, DriverCall::Download]
            .iter()
            .map(|&k| self.nanos[k as usize])
            .sum();
        (calls, secs - waiting as f64 * 1e-9)
    }

    /// Every call, and their host seconds.
    pub fn total(&self) -> (u64, f64) {
        (
            self.calls.iter().sum(),
            self.nanos.iter().sum::<u64>() as f64 * 1e-9,
        )
    }
}

/// The numerical ops of the forward pass. Shapes are row-major; "[n, ...]" means one row per token.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;

    /// The backends of `size` tensor-parallel ranks and what joins them (`None` for one rank;
    /// a backend without its own plan runs every rank itself, each summing the parts).
    fn rank_backends(&self, _size: usize) -> Result<Option<RankBackends>> {
        Ok(None)
    }

    /// Where the weights a source generates are made for this backend (`None`: on the host,
    /// and uploaded if the backend needs them elsewhere).
    fn weight_maker(&self) -> Option<std::sync::Arc<dyn crate::model::weights::WeightMaker>> {
        None
    }

    /// Fill every output buffer with the poison pattern before the op writes it, so that
    /// elements an op leaves unwritten show (buffer forensics, kernel tests). Host backends build
    /// their outputs element by element and ignore it.
    fn set_poison_outputs(&self, _on: bool) {}

    /// The device's free and total memory in bytes (`None`: a host backend).
    fn device_memory(&self) -> Option<(usize, usize)> {
        None
    }

    /// The calls into the device's driver so far, and their host time (`None`: no device).
    fn driver_calls(&self) -> Option<DriverCalls> {
        None
    }

    /// Waits until the work queued on the backend's device is done (a host backend has none).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// An output buffer for an op that writes into a buffer it is handed: filled with the poison
    /// pattern when `poison` is set (so unwritten elements can be counted), zeros otherwise.
    fn alloc(&self, shape: &[usize], poison: bool) -> Result<Tensor>;

    /// y = x·Wᵀ (+ b): x [n, in], w [out, in] → [n, out].
    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor>;

    /// y = x·Wᵀ with W stored quantized [out, in]: blocks are decoded a slab of rows at a time
    /// (never the whole weight at once), as a quantized matmul kernel does.
    fn linear_quant(&self, x: &Tensor, w: &QuantTensor, faults: QuantFaults) -> Result<Tensor> {
        linear_quant_host(x, w, faults)
    }

    /// A quantized weight decoded into a plain [rows, cols] tensor (force-dequantize).
    fn dequantize(&self, w: &QuantTensor, faults: QuantFaults) -> Result<Tensor> {
        Ok(Tensor::from_vec(&[w.rows, w.cols], w.dequantize(faults)?))
    }

    /// RMSNorm over the last dimension, computed in f32 as HF does.
    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor>;

    /// LayerNorm (with weight and bias) over the last dimension.
    fn layer_norm(&self, x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor>;

    /// x viewed as [n, heads, head_dim]: rotates the first 2·table.inv_freq.len() elements of
    /// each head for the row's position; the rest is copied.
    fn rope(
        &self,
        x: &Tensor,
        heads: usize,
        table: &RopeTable,
        positions: &[usize],
        interleaved: bool,
    ) -> Result<Tensor>;

    /// SiLU(gate) · up.
    fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor>;

    /// a + b, same shapes.
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor>;

    /// x viewed as [n, groups, group_width] → [n, groups, width] taking columns start..start+width
    /// of every group (splits q into q_nope | q_pe, kv_a into c_kv | k_pe).
    fn slice_groups(&self, x: &Tensor, groups: usize, start: usize, width: usize)
        -> Result<Tensor>;

    /// a [n, groups, wa] and b [n, groups, wb] → [n, groups, wa + wb] (q_nope | q_pe per head).
    fn concat_groups(&self, a: &Tensor, b: &Tensor, groups: usize) -> Result<Tensor>;

    /// x · s.
    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor>;

    /// Rows `rows` of x [n, c] → [rows.len(), c] (tokens routed to one expert).
    fn gather_rows(&self, x: &Tensor, rows: &[usize]) -> Result<Tensor>;

    /// acc[rows[i]] += weights[i] · y[i] (an expert's weighted output back to its tokens).
    fn scatter_add_rows(
        &self,
        acc: &mut Tensor,
        rows: &[usize],
        y: &Tensor,
        weights: &[f32],
    ) -> Result<()>;

    /// The routed experts of an MoE layer: each job's tokens of x through its gated MLP,
    /// weighted and summed per token in expert order (each job's output kept too when `each`).
    /// A device backend runs them together.
    fn routed_experts(
        &self,
        x: &Tensor,
        jobs: &[experts::ExpertJob],
        fetch: &mut experts::FetchExpert,
        each: bool,
    ) -> Result<experts::RoutedOutput> {
        let mut out = experts::experts_one_by_one(self, x, jobs, fetch)?;
        if !each {
            out.per_job.clear();
        }
        Ok(out)
    }

    /// MoE routing from router logits [n, experts]: sigmoid scores, bias for the choice only,
    /// group-limited top-k. Returns per token the chosen experts and their weights.
    fn route(&self, logits: &Tensor, bias: &Tensor, moe: &MoeLayout) -> Result<Routing>;

    /// Absorbed path: q_lat[t,h] = W_UK[h]ᵀ·q_nope[t,h], W_UK[h] = kv_b rows of head h, 0..P.
    /// q_nope [n, heads, P] → [n, heads, L].
    fn absorb_query(
        &self,
        q_nope: &Tensor,
        kv_b: &Tensor,
        dims: MlaDims,
        split: KvbSplit,
    ) -> Result<Tensor>;

    /// Absorbed path: o[t,h] = W_UV[h]·o_lat[t,h], W_UV[h] = kv_b rows of head h, P..P+V.
    /// o_lat [n, heads, L] → [n, heads·V].
    fn apply_w_uv(
        &self,
        o_lat: &Tensor,
        kv_b: &Tensor,
        dims: MlaDims,
        split: KvbSplit,
    ) -> Result<Tensor>;

    /// Naive path: decompressed kv [n, heads·(P+V)] and roped k_pe [n, R] → per-head
    /// K [n, heads·(P+R)] (k_nope | k_pe) and V [n, heads·V].
    fn assemble_kv(&self, kv: &Tensor, k_pe: &Tensor, dims: MlaDims) -> Result<(Tensor, Tensor)>;

    /// Multi-head attention over cached per-head K/V rows. q [n, heads, P+R]. Writes the output
    /// into `out` [n, heads·V] and returns the probabilities [heads, n, context].
    fn attention_naive(
        &self,
        q: &Tensor,
        k: &dyn RowSource,
        v: &dyn RowSource,
        call: AttnParams<'_>,
        out: &mut Tensor,
    ) -> Result<Tensor>;

    /// MQA over the latent cache (rows c_kv | k_pe): score = q_lat·c_kv + q_pe·k_pe, value = c_kv.
    /// q_lat [n, heads, L], q_pe [n, heads, R]. Writes o_lat into `out` [n, heads, L] and returns
    /// the probabilities [heads, n, context].
    fn attention_latent(
        &self,
        q_lat: &Tensor,
        q_pe: &Tensor,
        cache: &dyn RowSource,
        call: AttnParams<'_>,
        out: &mut Tensor,
    ) -> Result<Tensor>;

    /// Whether this backend has production attention kernels (the `fast_*` methods); the CPU
    /// has the reference alone.
    fn has_fast_attention(&self) -> bool {
        false
    }

    /// [`Backend::attention_latent`] on the production kernel (the tensor-core decode over the
    /// paged latent cache, split-KV with a merge): writes `out` and returns the log-sum-exps,
    /// the partials and the launches, or declines (shape, dtype, mask or fault it does not
    /// take) without touching `out`.
    fn fast_attention_latent(
        &self,
        _q_lat: &Tensor,
        _q_pe: &Tensor,
        _cache: &dyn RowSource,
        _call: AttnParams<'_>,
        _out: &mut Tensor,
        _kernels: AttnKernels,
    ) -> Result<FastOutcome> {
        Ok(FastOutcome::Declined(format!(
            "the {} backend has the reference kernels alone",
            self.name()
        )))
    }

    /// [`Backend::attention_naive`] on the production kernel (the flash prefill of a whole
    /// sequence), or declined as [`Backend::fast_attention_latent`] is.
    fn fast_attention_naive(
        &self,
        _q: &Tensor,
        _k: &dyn RowSource,
        _v: &dyn RowSource,
        _call: AttnParams<'_>,
        _out: &mut Tensor,
        _kernels: AttnKernels,
    ) -> Result<FastOutcome> {
        Ok(FastOutcome::Declined(format!(
            "the {} backend has the reference kernels alone",
            self.name()
        )))
    }

    /// DSA indexer scores: s[t, j] = Σ_h w[t,h]·ReLU(q[t,h]·key[j]·scale) for causal j, −∞
    /// elsewhere. q [n, heads, D], w [n, heads] → [n, context].
    fn index_scores(
        &self,
        q: &Tensor,
        weights: &Tensor,
        keys: &dyn RowSource,
        positions: &[usize],
        scale: f32,
    ) -> Result<Tensor>;

    /// DSA top-k: for each query row t of `scores` [n, context], the `k` largest scores among
    /// its causal keys j ≤ positions[t] (all of them when there are no more than k), in the
    /// total order of f32 with ties to the lower index; each row's keys in ascending order.
    fn index_topk(
        &self,
        scores: &Tensor,
        positions: &[usize],
        k: usize,
    ) -> Result<Vec<Vec<usize>>> {
        index_topk_host(scores, positions, k)
    }

    /// Statistics of a tensor (one pass).
    fn stats(&self, t: &Tensor) -> TensorStats;

    /// Statistics of several tensors (a kernel call's outputs); a device backend brings them
    /// back together, with one wait instead of one per tensor.
    fn stats_many(&self, ts: &[&Tensor]) -> Vec<TensorStats> {
        ts.iter().map(|t| self.stats(t)).collect()
    }

    /// A batch of statistics started as ops finish and collected many at a time (a device
    /// backend waits once for the lot instead of once per op); a host backend computes them at
    /// once.
    fn stats_batch(&self) -> Box<dyn StatsBatch + '_> {
        Box::new(ImmediateStats {
            backend: self,
            done: Vec::new(),
        })
    }
}

/// Statistics started as ops finish (see [`Backend::stats_batch`]).
pub trait StatsBatch {
    /// Starts the statistics of each of `ts` as its op left it. A device backend holds a tensor
    /// (and so its buffer) until it launches one pass for several, so `ts` must not be written
    /// in place afterwards, which no op output is.
    fn start(&mut self, ts: &[&Tensor]) -> Result<()>;

    /// The statistics of every tensor started since the last collect, in the order started.
    fn collect(&mut self) -> Result<Vec<TensorStats>>;
}

/// A batch whose statistics are computed when started.
struct ImmediateStats<'a, B: ?Sized> {
    backend: &'a B,
    done: Vec<TensorStats>,
}

impl<B: Backend + ?Sized> StatsBatch for ImmediateStats<'_, B> {
    fn start(&mut self, ts: &[&Tensor]) -> Result<()> {
        self.done.extend(self.backend.stats_many(ts));
        Ok(())
    }

    fn collect(&mut self) -> Result<Vec<TensorStats>> {
        Ok(std::mem::take(&mut self.done))
    }
}

/// The reference quantized linear (see `Backend::linear_quant`).
pub fn linear_quant_host(x: &Tensor, w: &QuantTensor, faults: QuantFaults) -> Result<Tensor> {
    const SLAB: usize = 64;
    let shape = checks::linear_quant(x, w)?;
    let (n, k) = (x.rows(), x.cols());
    let mut y = vec![0.0f32; n * w.rows];
    let mut slab = vec![0.0f32; SLAB * k];
    for r0 in (0..w.rows).step_by(SLAB) {
        let rows = SLAB.min(w.rows - r0);
        let slab = &mut slab[..rows * k];
        w.dequantize_rows(r0, slab, faults)?;
        let part = cpu::matmul::matmul_t(x.data(), n, k, slab, rows);
        for (yrow, prow) in y.chunks_mut(w.rows).zip(part.chunks(rows)) {
            yrow[r0..r0 + rows].copy_from_slice(prow);
        }
    }
    Ok(Tensor::from_vec(&shape, y))
}

/// W [rows, cols] from a quantized linear layer the way vLLM obtains it for weight absorption:
/// the identity matrix I_cols pushed through the layer gives Wᵀ, which is transposed back.
pub fn weight_through_identity(
    b: &dyn Backend,
    w: &QuantTensor,
    faults: QuantFaults,
) -> Result<Tensor> {
    let n = w.cols;
    let mut eye = vec![0.0f32; n * n];
    eye.iter_mut().step_by(n + 1).for_each(|v| *v = 1.0);
    let wt = b.linear_quant(&Tensor::from_vec(&[n, n], eye), w, faults)?;
    let (r, c) = (wt.rows(), wt.cols());
    let mut out = vec![0.0f32; r * c];
    for (i, row) in wt.data().chunks(c).enumerate() {
        for (j, &v) in row.iter().enumerate() {
            out[j * r + i] = v;
        }
    }
    Ok(Tensor::from_vec(&[c, r], out))
}

/// The reference DSA top-k (see `Backend::index_topk`).
pub fn index_topk_host(scores: &Tensor, positions: &[usize], k: usize) -> Result<Vec<Vec<usize>>> {
    checks::index_topk(scores, positions)?;
    Ok(positions
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            let row = &scores.row(i)[..=p];
            let mut chosen = if row.len() > k {
                crate::ops::top_k_indices(row, k)
            } else {
                (0..row.len()).collect()
            };
            chosen.sort_unstable();
            chosen
        })
        .collect())
}
