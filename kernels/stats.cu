// One pass over up to STATS_JOBS tensors for every statistic of the trace, in one launch: the
// grid's blocks are shared out among the tensors (a range of blocks each). Each block reduces a
// strided share of its tensor; the order-free statistics (min, max and abs-max as ordered
// integers, and the counts of finite, NaN, +Inf, -Inf, zero and still-poisoned (unwritten)
// elements) go into the tensor's accumulator by integer atomics, the two sums (of the values and
// of their squares, in f64) into a row per block, and the last block of the tensor to finish
// adds those rows in a fixed order (so that a tensor's statistics are the same every time) and
// writes the tensor's result: 11 doubles (sum, sum of squares, min, max, abs-max over the finite
// elements, then the six counts), leaving the accumulator as it found it. A tensor of one block
// (the launcher gives small ones one) writes its result directly.
#include "common.cuh"

#define STATS 11
#define STATS_THREADS 256
#define STATS_WARPS (STATS_THREADS / 32)
#define STATS_JOBS 16
#define INT_MAX_ 0x7fffffff
#define INT_MIN_ (-INT_MAX_ - 1)

// The tensors of one launch, passed by value. Tensor j owns blocks
// [first_block[j], first_block[j + 1]) and result row j.
struct StatsJobs {
    u64 ptr[STATS_JOBS];
    u64 n[STATS_JOBS];
    unsigned int first_block[STATS_JOBS + 1];
    unsigned int bf16_mask;  // bit j: tensor j holds bf16 values, else f32
    unsigned int count;
};

// A result row: the statistics, then the accumulator of the launch in flight (identity between
// launches: min_key INT_MAX, max_key INT_MIN, the rest zero).
struct StatsRow {
    double stats[STATS];
    int min_key, max_key;
    unsigned int abs_max_bits, unused;
    unsigned long long counts[6];  // finite, NaN, +Inf, -Inf, zero, unwritten
    unsigned long long blocks_done;
};

// f32 bits as an int whose signed order is the floats' order (finite values), and back.
__device__ __forceinline__ int order_key(unsigned int bits) { return (int)(bits ^ ((unsigned int)((int)bits >> 31) & 0x7fffffffu)); }
__device__ __forceinline__ float key_value(int key) { return __uint_as_float((unsigned int)(key ^ ((key >> 31) & 0x7fffffff))); }

// One thread's running statistics.
struct Acc {
    double sum = 0, sum_sq = 0;
    int min_key = INT_MAX_, max_key = INT_MIN_;
    unsigned int abs_max = 0, counts[6] = {0, 0, 0, 0, 0, 0};
    // Adds the value whose f32 bits are `bits` (poisoned: its storage bits were the poison).
    __device__ __forceinline__ void add(unsigned int bits, bool poison) {
        const unsigned int mag = bits & 0x7fffffffu;
        if (mag > 0x7f800000u) {
            counts[1] += 1;
            counts[5] += poison;
        } else if (mag == 0x7f800000u) {
            if (bits >> 31) counts[3] += 1;
            else counts[2] += 1;
        } else {
            const double d = __uint_as_float(bits);
            counts[0] += 1;
            counts[4] += mag == 0;
            sum += d;
            sum_sq = fma(d, d, sum_sq);
            const int key = order_key(bits);
            min_key = min(min_key, key);
            max_key = max(max_key, key);
            abs_max = max(abs_max, mag);
        }
    }
    __device__ __forceinline__ void add_bf16(unsigned int raw) { add(raw << 16, raw == POISON_BF16); }
    __device__ __forceinline__ void add_f32(unsigned int bits) { add(bits, bits == POISON_F32); }
};

// This thread's share of tensor `x` (n values) when it is thread t of `threads` over it: whole
// 16-byte vectors first (buffers are allocation-aligned), then the tail one by one.
__device__ __forceinline__ void add_words(Acc& acc, uint4 w, bool bf16) {
    const unsigned int words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        if (bf16) {
            acc.add_bf16(words[k] & 0xffffu);
            acc.add_bf16(words[k] >> 16);
        } else {
            acc.add_f32(words[k]);
        }
    }
}

// Vectors loaded this many at a time before any is added (loads in flight, not one at a time).
#define STATS_UNROLL 4

__device__ __forceinline__ void accumulate(Acc& acc, u64 x, u64 n, bool bf16, u64 t, u64 threads) {
    const u64 per_vec = bf16 ? 8 : 4, vecs = n / per_vec;
    const uint4* v = reinterpret_cast<const uint4*>(x);
    u64 i = t;
    for (; i + (STATS_UNROLL - 1) * threads < vecs; i += STATS_UNROLL * threads) {
        uint4 w[STATS_UNROLL];
#pragma unroll
        for (int u = 0; u < STATS_UNROLL; u++) w[u] = __ldcs(v + i + u * threads);
#pragma unroll
        for (int u = 0; u < STATS_UNROLL; u++) add_words(acc, w[u], bf16);
    }
    for (; i < vecs; i += threads) add_words(acc, __ldcs(v + i), bf16);
    for (u64 i = vecs * per_vec + t; i < n; i += threads) {
        if (bf16) acc.add_bf16(reinterpret_cast<const unsigned short*>(x)[i]);
        else acc.add_f32(reinterpret_cast<const unsigned int*>(x)[i]);
    }
}

// The two sums over the block, in a fixed order, into (*sum, *sum_sq) of thread 0.
__device__ __forceinline__ void block_sums(double& sum, double& sum_sq) {
    __shared__ double warps[2][STATS_WARPS];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int d = 16; d > 0; d /= 2) {
        sum += __shfl_down_sync(0xffffffffu, sum, d);
        sum_sq += __shfl_down_sync(0xffffffffu, sum_sq, d);
    }
    __syncthreads();  // a previous call's reads of `warps` are done
    if (lane == 0) {
        warps[0][warp] = sum;
        warps[1][warp] = sum_sq;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        sum = 0;
        sum_sq = 0;
        for (int w = 0; w < STATS_WARPS; w++) {
            sum += warps[0][w];
            sum_sq += warps[1][w];
        }
    }
}

// A tensor's result: the two sums, min, max and abs-max over the finite elements (infinities
// where there are none), then the six counts.
__device__ __forceinline__ void write_stats(double* out, double sum, double sum_sq, int lo, int hi, unsigned int abs_max,
                                            const unsigned long long* counts) {
    const bool fin = counts[0] != 0;
    out[0] = sum;
    out[1] = sum_sq;
    out[2] = fin ? (double)key_value(lo) : (double)INFINITY;
    out[3] = fin ? (double)key_value(hi) : -(double)INFINITY;
    out[4] = (double)__uint_as_float(abs_max);
    for (int c = 0; c < 6; c++) out[5 + c] = (double)counts[c];
}

// partials: two doubles (the sums) per block of the grid; rows: one StatsRow per tensor.
extern "C" __global__ void __launch_bounds__(STATS_THREADS) stats_many(const __grid_constant__ StatsJobs jobs,
                                                                         double* partials, double* rows) {
    // This block's tensor, read with constant indices (a computed index into the parameter
    // would copy the table to local memory).
    unsigned int j = 0, first = 0, blocks = 1;
    u64 x = 0, n = 0;
#pragma unroll
    for (unsigned int k = 0; k < STATS_JOBS; k++)
        if (k < jobs.count && blockIdx.x >= jobs.first_block[k] && blockIdx.x < jobs.first_block[k + 1]) {
            j = k;
            first = jobs.first_block[k];
            blocks = jobs.first_block[k + 1] - first;
            x = jobs.ptr[k];
            n = jobs.n[k];
        }
    const bool bf16 = (jobs.bf16_mask >> j) & 1u;
    StatsRow* row = reinterpret_cast<StatsRow*>(rows) + j;
    Acc acc;
    accumulate(acc, x, n, bf16, (u64)(blockIdx.x - first) * blockDim.x + threadIdx.x, (u64)blocks * blockDim.x);

    // The order-free statistics: each warp's in one instruction each, the block's in shared
    // memory, then one atomic per block.
    __shared__ int keys[2];
    __shared__ unsigned int block_abs_max, block_counts[6];
    if (threadIdx.x == 0) {
        keys[0] = INT_MAX_;
        keys[1] = INT_MIN_;
        block_abs_max = 0;
        for (int c = 0; c < 6; c++) block_counts[c] = 0;
    }
    __syncthreads();
    const int min_key = __reduce_min_sync(0xffffffffu, acc.min_key), max_key = __reduce_max_sync(0xffffffffu, acc.max_key);
    const unsigned int abs_max = __reduce_max_sync(0xffffffffu, acc.abs_max);
    unsigned int counts[6];
#pragma unroll
    for (int c = 0; c < 6; c++) counts[c] = __reduce_add_sync(0xffffffffu, acc.counts[c]);
    if (threadIdx.x % 32 == 0) {
        atomicMin(&keys[0], min_key);
        atomicMax(&keys[1], max_key);
        atomicMax(&block_abs_max, abs_max);
#pragma unroll
        for (int c = 0; c < 6; c++) atomicAdd(&block_counts[c], counts[c]);
    }
    double sum = acc.sum, sum_sq = acc.sum_sq;
    block_sums(sum, sum_sq);  // (its barriers also make the shared values whole)
    const int lane = threadIdx.x % 32;
    if (blocks == 1) {
        // A tensor of one block: the block's statistics are the tensor's, written straight to
        // its row (no atomics, fences or partials: a small tensor's pass is all latency).
        if (threadIdx.x == 0) {
            unsigned long long totals[6];
            for (int c = 0; c < 6; c++) totals[c] = block_counts[c];
            write_stats(row->stats, sum, sum_sq, keys[0], keys[1], block_abs_max, totals);
        }
        return;
    }

    // The block's share goes out from lanes of warp 0 side by side (one store or atomic each,
    // instead of one thread's chain): the sums to the block's partial row, the rest into the
    // tensor's accumulator. Then the last block of the tensor to arrive adds the blocks' sums in
    // order and writes the result (the others' writes and atomics made visible by the fences).
    __shared__ bool last;
    if (threadIdx.x < 32) {
        const double s0 = __shfl_sync(0xffffffffu, sum, 0), s1 = __shfl_sync(0xffffffffu, sum_sq, 0);
        if (lane < 2) partials[2 * (u64)blockIdx.x + lane] = lane == 0 ? s0 : s1;
        else if (lane == 2 && keys[0] != INT_MAX_) atomicMin(&row->min_key, keys[0]);
        else if (lane == 3 && keys[1] != INT_MIN_) atomicMax(&row->max_key, keys[1]);
        else if (lane == 4 && block_abs_max != 0) atomicMax(&row->abs_max_bits, block_abs_max);
        else if (lane >= 5 && lane < 11 && block_counts[lane - 5] != 0) atomicAdd(&row->counts[lane - 5], (unsigned long long)block_counts[lane - 5]);
        __threadfence();
        __syncwarp();
        if (lane == 0) last = atomicAdd(&row->blocks_done, 1ull) == blocks - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    sum = 0;
    sum_sq = 0;
    for (unsigned int r = threadIdx.x; r < blocks; r += blockDim.x) {
        sum += __ldcg(partials + 2 * (u64)(first + r));
        sum_sq += __ldcg(partials + 2 * (u64)(first + r) + 1);
    }
    block_sums(sum, sum_sq);
    if (threadIdx.x >= 32) return;
    // Lanes 0-10 read the accumulator's fields at once, lane 0 writes the row, and the
    // accumulator is left at identity for the next launch.
    const double s0 = __shfl_sync(0xffffffffu, sum, 0), s1 = __shfl_sync(0xffffffffu, sum_sq, 0);
    unsigned long long field = 0;
    if (lane == 2) field = (unsigned int)__ldcg(&row->min_key);
    else if (lane == 3) field = (unsigned int)__ldcg(&row->max_key);
    else if (lane == 4) field = __ldcg(&row->abs_max_bits);
    else if (lane >= 5 && lane < 11) field = __ldcg(&row->counts[lane - 5]);
    const int lo = (int)__shfl_sync(0xffffffffu, field, 2), hi = (int)__shfl_sync(0xffffffffu, field, 3);
    const unsigned int abs_bits = (unsigned int)__shfl_sync(0xffffffffu, field, 4);
    unsigned long long totals[6];
#pragma unroll
    for (int c = 0; c < 6; c++) totals[c] = __shfl_sync(0xffffffffu, field, 5 + c);
    if (lane == 0) write_stats(row->stats, s0, s1, lo, hi, abs_bits, totals);
    if (lane == 2) row->min_key = INT_MAX_;
    if (lane == 3) row->max_key = INT_MIN_;
    if (lane == 4) row->abs_max_bits = 0;
    if (lane >= 5 && lane < 11) row->counts[lane - 5] = 0;
    if (lane == 11) row->blocks_done = 0;
}
