// One pass over a tensor for every statistic of the trace. Each block reduces a grid-strided
// share into 11 doubles: sum, sum of squares, min, max, abs-max over the finite elements, then
// the counts of finite, NaN, +Inf, -Inf, zero and still-poisoned (unwritten) elements.
// stats_merge adds up the blocks on the device.
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

// The block's rows `mine` reduced over its threads into `out` (by thread 0).
__device__ void block_reduce_to(const double* mine, double* out) {
    __shared__ double acc[STATS][STATS_THREADS];
    const int t = threadIdx.x;
    for (int k = 0; k < STATS; k++) acc[k][t] = mine[k];
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (t < stride)
            for (int k = 0; k < STATS; k++) acc[k][t] = combine(k, acc[k][t], acc[k][t + stride]);
        __syncthreads();
    }
    if (t == 0)
        for (int k = 0; k < STATS; k++) out[k] = acc[k][0];
}

template <typename T> __device__ void stats_k(const T* x, u64 n, double* partials) {
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
}
// Partials of `rows` blocks merged into row 0 by one block (reads first, then one write).
extern "C" __global__ void stats_merge(double* partials, int rows) {
    double mine[STATS] = {0, 0, INFINITY, -INFINITY, 0, 0, 0, 0, 0, 0, 0};
    for (int r = threadIdx.x; r < rows; r += blockDim.x)
        for (int k = 0; k < STATS; k++) mine[k] = combine(k, mine[k], partials[r * STATS + k]);
    block_reduce_to(mine, partials);  // every read is done before its first barrier
}

extern "C" __global__ void stats_f32(const float* x, u64 n, double* p) { stats_k(x, n, p); }
extern "C" __global__ void stats_bf16(const bf16_t* x, u64 n, double* p) { stats_k(x, n, p); }
