// One pass over a tensor for every statistic of the trace. Each block reduces a grid-strided
// share into 11 doubles: sum, sum of squares, min, max, abs-max over the finite elements, then
// the counts of finite, NaN, +Inf, -Inf, zero and still-poisoned (unwritten) elements. The last
// block to finish merges every block's row into the result, in the same launch: one launch per
// tensor, and the statistics of several tensors come back in one copy.
#include "common.cuh"

#define STATS 11
#define STATS_THREADS 256

template <typename T> __device__ __forceinline__ bool is_poison(const T* x, u64 i);
template <> __device__ __forceinline__ bool is_poison<float>(const float* x, u64 i) {
    return __float_as_uint(x[i]) == POISON_F32;
}
template <> __device__ __forceinline__ bool is_poison<bf16_t>(const bf16_t* x, u64 i) { return x[i] == POISON_BF16; }

// How two partial values of statistic k combine: min for k = 2, max for max and abs-max, else a sum.
__device__ __forceinline__ double combine(int k, double a, double b) {
    return k == 2 ? fmin(a, b) : (k == 3 || k == 4) ? fmax(a, b) : a + b;
}

// What combining with changes nothing: +Inf for min, -Inf for max, else 0.
__device__ __forceinline__ double identity(int k) { return k == 2 ? INFINITY : k == 3 ? -INFINITY : 0.0; }

// The block's rows `mine` reduced over its threads into `out` (by thread 0): each warp by
// shuffles, then the warps' rows by the first warp.
__device__ void block_reduce_to(const double* mine, double* out) {
    __shared__ double warps[STATS][STATS_THREADS / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    double v[STATS];
    for (int k = 0; k < STATS; k++) {
        v[k] = mine[k];
        for (int d = 16; d > 0; d /= 2) v[k] = combine(k, v[k], __shfl_down_sync(0xffffffffu, v[k], d));
    }
    __syncthreads();  // a previous call's reads of `warps` are done
    if (lane == 0)
        for (int k = 0; k < STATS; k++) warps[k][warp] = v[k];
    __syncthreads();
    if (warp == 0) {
        for (int k = 0; k < STATS; k++) {
            v[k] = lane < nwarps ? warps[k][lane] : identity(k);
            for (int d = 16; d > 0; d /= 2) v[k] = combine(k, v[k], __shfl_down_sync(0xffffffffu, v[k], d));
        }
        if (lane == 0)
            for (int k = 0; k < STATS; k++) out[k] = v[k];
    }
}

// How many blocks of this launch have written their partial row: a counter beside the result
// row, zero between launches (the last block resets it).
__device__ __forceinline__ unsigned long long* blocks_done(double* result) {
    return reinterpret_cast<unsigned long long*>(result + STATS);
}

// Statistics of x[0..n) into result[0..STATS) (partials: one row per block, scratch); result
// holds STATS + 1 doubles, the last the zeroed block counter.
template <typename T> __device__ void stats_k(const T* x, u64 n, double* partials, double* result) {
    double s = 0, s2 = 0, mn = INFINITY, mx = -INFINITY, am = 0, fin = 0, nan = 0, pinf = 0, ninf = 0, zero = 0, unw = 0;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float v = ld(x, i);
        if (isnan(v)) {
            nan += 1;
            if (is_poison(x, i)) unw += 1;
        } else if (isinf(v)) {
            if (v > 0) pinf += 1; else ninf += 1;
        } else {
            double d = v;
            fin += 1;
            s += d;
            s2 += d * d;
            mn = fmin(mn, d);
            mx = fmax(mx, d);
            am = fmax(am, fabs(d));
            if (v == 0.0f) zero += 1;
        }
    }
    double mine[STATS] = {s, s2, mn, mx, am, fin, nan, pinf, ninf, zero, unw};
    block_reduce_to(mine, partials + blockIdx.x * STATS);
    // The last block to arrive merges the rows (their writes made visible by the fences).
    __shared__ bool last;
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(blocks_done(result), 1ull) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    double merged[STATS];
    for (int k = 0; k < STATS; k++) merged[k] = identity(k);
    for (int r = threadIdx.x; r < (int)gridDim.x; r += blockDim.x)
        for (int k = 0; k < STATS; k++) merged[k] = combine(k, merged[k], __ldcg(partials + r * STATS + k));
    block_reduce_to(merged, result);
    if (threadIdx.x == 0) *blocks_done(result) = 0;
}

extern "C" __global__ void stats_f32(const float* x, u64 n, double* partials, double* result) {
    stats_k(x, n, partials, result);
}
extern "C" __global__ void stats_bf16(const bf16_t* x, u64 n, double* partials, double* result) {
    stats_k(x, n, partials, result);
}
