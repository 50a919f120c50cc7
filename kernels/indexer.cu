// The DSA indexer: scores and top-k selection.
#include "common.cuh"

// s[t, j] = Σ_h w[t,h] · ReLU(q[t,h]·key[j] · scale) for causal j (j ≤ positions[t]), -inf
// beyond. q [n, H, D], w [n, H] (already scaled by H^-0.5), keys [T, D].
template <typename T> __device__ void index_scores_k(const T* q, const T* w, const T* keys, const int* positions,
                                                     float* out, u64 n, u64 heads, u64 d, u64 context, float scale) {
    // One warp per score, its lanes taking the heads in turn (one query token's heads are many
    // dot products of one key row: sequential in one thread, a decode step waited on them).
    const int lane = threadIdx.x & 31;
    u64 total = n * context;
    u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 i = (blockIdx.x * (u64)blockDim.x + threadIdx.x) >> 5; i < total; i += warps) {
        u64 t = i / context, j = i % context;
        if ((long long)j > positions[t]) {
            if (lane == 0) out[i] = -INFINITY;
            continue;
        }
        float s = 0.0f;
        for (u64 h = lane; h < heads; h += 32) {
            float dot = 0.0f;
            for (u64 c = 0; c < d; c++) dot += ld(q, (t * heads + h) * d + c) * ld(keys, j * d + c);
            s += ld(w, t * heads + h) * fmaxf(dot * scale, 0.0f);
        }
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (lane == 0) out[i] = s;
    }
}
extern "C" __global__ void index_scores_f32(const float* q, const float* w, const float* k, const int* p, float* o, u64 n, u64 h, u64 d, u64 c, float s) { index_scores_k(q, w, k, p, o, n, h, d, c, s); }
extern "C" __global__ void index_scores_bf16(const bf16_t* q, const bf16_t* w, const bf16_t* k, const int* p, float* o, u64 n, u64 h, u64 d, u64 c, float s) { index_scores_k(q, w, k, p, o, n, h, d, c, s); }

// Maps a float to an unsigned key with the same order (larger float, larger key).
__device__ __forceinline__ u32 order_key(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Top-k per query row among its causal keys (j ≤ positions[t]): writes selected[t, j] = 1 for the
// k largest scores (ties to the lower index), 0 elsewhere. One block per row: a binary search
// over the order keys finds the k-th largest, then ties are resolved in index order.
extern "C" __global__ void topk_select(const float* scores, const int* positions, unsigned char* selected, u64 context,
                                       u64 k) {
    __shared__ u32 count;
    u64 t = blockIdx.x;
    const float* row = scores + t * context;
    unsigned char* sel = selected + t * context;
    u64 valid = (u64)positions[t] + 1;
    if (valid > context) valid = context;
    for (u64 j = threadIdx.x; j < context; j += blockDim.x) sel[j] = j < valid && valid <= k ? 1 : 0;
    if (valid <= k) return;
    // Largest threshold key with at least k elements >= it.
    // (hi − lo + 1 is taken in 64 bits: in 32 it wraps to 0 on the first step, and the search
    // would never move.)
    u32 lo = 0, hi = 0xffffffffu;
    while (lo < hi) {
        u32 mid = lo + (u32)(((u64)hi - lo + 1) / 2);
        if (threadIdx.x == 0) count = 0;
        __syncthreads();
        u32 mine = 0;
        for (u64 j = threadIdx.x; j < valid; j += blockDim.x) mine += order_key(row[j]) >= mid;
        atomicAdd(&count, mine);
        __syncthreads();
        u32 c = count;
        __syncthreads();
        if (c >= k) lo = mid; else hi = mid - 1;
    }
    // Everything strictly above the threshold, then equal ones by index until k are taken.
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    u32 above = 0;
    for (u64 j = threadIdx.x; j < valid; j += blockDim.x) {
        bool a = order_key(row[j]) > lo;
        sel[j] = a;
        above += a;
    }
    atomicAdd(&count, above);
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 taken = count;
        for (u64 j = 0; j < valid && taken < k; j++)
            if (order_key(row[j]) == lo) {
                sel[j] = 1;
                taken++;
            }
    }
}
