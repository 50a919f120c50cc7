// One pass over up to STATS_JOBS tensors for every statistic of the trace, in one launch: the
// grid's blocks are shared out among the tensors (a range of blocks each), each block reduces a
// strided share of its tensor into 11 doubles (sum, sum of squares, min, max, abs-max over the
// finite elements, then the counts of finite, NaN, +Inf, -Inf, zero and still-poisoned
// (unwritten) elements), and the last block of a tensor to finish merges its blocks' rows into
// the tensor's result row. The statistics of an attention call's outputs so cost one launch and
// one copy back.
#include "common.cuh"

#define STATS 11
#define STATS_THREADS 256
#define STATS_JOBS 16

// The tensors of one launch, passed by value. Tensor j owns blocks
// [first_block[j], first_block[j + 1]) and result row j (STATS values, then its block counter).
struct StatsJobs {
    u64 ptr[STATS_JOBS];
    u64 n[STATS_JOBS];
    unsigned int first_block[STATS_JOBS + 1];
    unsigned int bf16_mask;  // bit j: tensor j holds bf16 values, else f32
    unsigned int count;
};

// How two partial values of statistic k combine: min for k = 2, max for max and abs-max, else a sum.
__device__ __forceinline__ double combine(int k, double a, double b) {
    return k == 2 ? fmin(a, b) : (k == 3 || k == 4) ? fmax(a, b) : a + b;
}

// What combining with changes nothing: +Inf for min, -Inf for max, else 0.
__device__ __forceinline__ double identity(int k) { return k == 2 ? INFINITY : k == 3 ? -INFINITY : 0.0; }

// One thread's running statistics.
struct Acc {
    double v[STATS];
    __device__ Acc() {
#pragma unroll
        for (int k = 0; k < STATS; k++) v[k] = identity(k);
    }
    // Adds value x, whose storage bits are the poison pattern when `poison`.
    __device__ __forceinline__ void add(float x, bool poison) {
        if (isnan(x)) {
            v[6] += 1;
            if (poison) v[10] += 1;
        } else if (isinf(x)) {
            if (x > 0) v[7] += 1;  // (constant indices keep v in registers)
            else v[8] += 1;
        } else {
            double d = x;
            v[5] += 1;
            v[0] += d;
            v[1] = fma(d, d, v[1]);
            v[2] = fmin(v[2], d);
            v[3] = fmax(v[3], d);
            v[4] = fmax(v[4], fabs(d));
            if (x == 0.0f) v[9] += 1;
        }
    }
    __device__ __forceinline__ void add_bf16(unsigned int bits) {
        add(__uint_as_float(bits << 16), bits == POISON_BF16);
    }
    __device__ __forceinline__ void add_f32(unsigned int bits) { add(__uint_as_float(bits), bits == POISON_F32); }
};

// The block's rows `mine` reduced over its threads into `out` (by thread 0): each warp by
// shuffles, then the warps' rows by the first warp.
__device__ __forceinline__ void block_reduce_to(const double* mine, double* out) {
    __shared__ double warps[STATS][STATS_THREADS / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    double v[STATS];
#pragma unroll
    for (int k = 0; k < STATS; k++) {
        v[k] = mine[k];
        for (int d = 16; d > 0; d /= 2) v[k] = combine(k, v[k], __shfl_down_sync(0xffffffffu, v[k], d));
    }
    __syncthreads();  // a previous call's reads of `warps` are done
    if (lane == 0)
#pragma unroll
        for (int k = 0; k < STATS; k++) warps[k][warp] = v[k];
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int k = 0; k < STATS; k++) {
            v[k] = lane < nwarps ? warps[k][lane] : identity(k);
            for (int d = 16; d > 0; d /= 2) v[k] = combine(k, v[k], __shfl_down_sync(0xffffffffu, v[k], d));
        }
        if (lane == 0)
#pragma unroll
            for (int k = 0; k < STATS; k++) out[k] = v[k];
    }
}

// This thread's share of tensor `x` (n values) when it is thread t of `threads` over it: whole
// 16-byte vectors first (buffers are allocation-aligned), then the tail one by one.
__device__ __forceinline__ void accumulate(Acc& acc, u64 x, u64 n, bool bf16, u64 t, u64 threads) {
    const u64 per_vec = bf16 ? 8 : 4, vecs = n / per_vec;
    const uint4* v = reinterpret_cast<const uint4*>(x);
    for (u64 i = t; i < vecs; i += threads) {
        const uint4 w = __ldcs(v + i);
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
    for (u64 i = vecs * per_vec + t; i < n; i += threads) {
        if (bf16) acc.add_bf16(reinterpret_cast<const unsigned short*>(x)[i]);
        else acc.add_f32(reinterpret_cast<const unsigned int*>(x)[i]);
    }
}

// partials: one row of STATS per block of the grid; results: one row of STATS + 1 per tensor,
// the last value its block counter (zero between launches: the last block resets it).
extern "C" __global__ void __launch_bounds__(STATS_THREADS) stats_many(const __grid_constant__ StatsJobs jobs,
                                                                         double* partials, double* results) {
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
    Acc acc;
    accumulate(acc, x, n, bf16, (u64)(blockIdx.x - first) * blockDim.x + threadIdx.x, (u64)blocks * blockDim.x);
    block_reduce_to(acc.v, partials + (u64)blockIdx.x * STATS);
    // The last block of the tensor to arrive merges its rows (their writes made visible by the
    // fences).
    double* result = results + (u64)j * (STATS + 1);
    unsigned long long* done = reinterpret_cast<unsigned long long*>(result + STATS);
    __shared__ bool last;
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(done, 1ull) == blocks - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    double merged[STATS];
#pragma unroll
    for (int k = 0; k < STATS; k++) merged[k] = identity(k);
    for (unsigned int r = threadIdx.x; r < blocks; r += blockDim.x)
#pragma unroll
        for (int k = 0; k < STATS; k++) merged[k] = combine(k, merged[k], __ldcg(partials + (u64)(first + r) * STATS + k));
    block_reduce_to(merged, result);
    if (threadIdx.x == 0) *done = 0;
}
