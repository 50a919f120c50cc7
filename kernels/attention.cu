// The attention kernels the engine runs, both of which also produce the probabilities the trace
// shows. Keys a query may see: those whose mask byte is set when a mask (the DSA selection) is
// given, else every key up to the query's position (causal).
//
// * attn_naive: multi-head attention over the expanded per-head K/V cache (head dim P+R, value
//   dim V), one block per (query, head): scores, softmax, weighted sum of V.
// * attn_latent_partial + attn_latent_merge: absorbed MLA over the paged latent cache (rows
//   c_kv | k_pe of L+R), split-KV as decode kernels do it: each block of SPLIT positions yields a
//   partial output with its running max and sum; the merge weighs the partials by
//   exp(lse_split - lse_total). The lse-base-mismatch fault reports partial LSEs in log2 while the
//   merge reads them as natural logs; skip-padded-rows leaves the last head's rows unwritten.
#include "common.cuh"

#define PAGE 64
#define SPLIT 8

__device__ __forceinline__ bool key_allowed(const unsigned char* mask, const int* positions, u64 i, u64 j, u64 context) {
    return mask ? mask[i * context + j] != 0 : (long long)j <= positions[i];
}

template <typename T> __device__ void attn_naive_k(const T* q, const T* k, const T* v, const int* positions,
                                                   const unsigned char* mask, T* out, float* probs, u64 n, u64 heads,
                                                   u64 d, u64 dv, u64 context, float scale, int skip_last_head) {
    __shared__ float scratch[32];
    u64 i = blockIdx.x / heads, h = blockIdx.x % heads;
    if (skip_last_head && h + 1 == heads) return;
    float* prow = probs + (h * n + i) * context;
    const T* qh = q + (i * heads + h) * d;
    float mx = -INFINITY;
    for (u64 j = threadIdx.x; j < context; j += blockDim.x) {
        float s = -INFINITY;
        if (key_allowed(mask, positions, i, j, context)) {
            const T* kr = k + (j * heads + h) * d;
            float dot = 0.0f;
            for (u64 c = 0; c < d; c++) dot += ld(qh, c) * ld(kr, c);
            s = dot * scale;
        }
        prow[j] = s;
        mx = fmaxf(mx, s);
    }
    mx = block_max(mx, scratch);
    float sum = 0.0f;
    for (u64 j = threadIdx.x; j < context; j += blockDim.x)
        if (prow[j] > -INFINITY) sum += expf(prow[j] - mx);
    sum = block_sum(sum, scratch);
    for (u64 j = threadIdx.x; j < context; j += blockDim.x)
        prow[j] = prow[j] > -INFINITY ? expf(prow[j] - mx) / sum : 0.0f;
    __syncthreads();
    for (u64 c = threadIdx.x; c < dv; c += blockDim.x) {
        float acc = 0.0f;
        for (u64 j = 0; j < context; j++) {
            float p = prow[j];
            if (p != 0.0f) acc += p * ld(v, (j * heads + h) * dv + c);
        }
        st(out, (i * heads + h) * dv + c, acc);
    }
}
extern "C" __global__ void attn_naive_f32(const float* q, const float* k, const float* v, const int* pos, const unsigned char* mask, float* out, float* probs, u64 n, u64 h, u64 d, u64 dv, u64 ctx, float scale, int skip) { attn_naive_k(q, k, v, pos, mask, out, probs, n, h, d, dv, ctx, scale, skip); }
extern "C" __global__ void attn_naive_bf16(const bf16_t* q, const bf16_t* k, const bf16_t* v, const int* pos, const unsigned char* mask, bf16_t* out, float* probs, u64 n, u64 h, u64 d, u64 dv, u64 ctx, float scale, int skip) { attn_naive_k(q, k, v, pos, mask, out, probs, n, h, d, dv, ctx, scale, skip); }

// Row of key j in the paged cache pool.
__device__ __forceinline__ u64 cache_row(const int* block_table, u64 j) { return (u64)block_table[j / PAGE] * PAGE + j % PAGE; }

// One block per (query, head, split). Writes the split's unnormalised output acc [L], its max and
// sum, and the raw scores of its keys into the probability row.
template <typename T> __device__ void latent_partial_k(const T* q_lat, const T* q_pe, const T* cache,
                                                       const int* block_table, const int* positions,
                                                       const unsigned char* mask, float* acc, float* maxes, float* sums,
                                                       float* probs, u64 n, u64 heads, u64 L, u64 R, u64 context,
                                                       u64 splits, float scale, int skip_last_head) {
    __shared__ float scratch[32];
    __shared__ float scores[SPLIT];
    u64 ih = blockIdx.x, s = blockIdx.y;
    u64 i = ih / heads, h = ih % heads;
    if (skip_last_head && h + 1 == heads) return;
    const T* ql = q_lat + ih * L;
    const T* qp = q_pe + ih * R;
    float* prow = probs + (h * n + i) * context;
    u64 first = s * SPLIT;
    float mx = -INFINITY;
    for (u64 jj = 0; jj < SPLIT; jj++) {
        u64 j = first + jj;
        float score = -INFINITY;
        if (j < context && key_allowed(mask, positions, i, j, context)) {
            const T* row = cache + cache_row(block_table, j) * (L + R);
            float dot = 0.0f;
            for (u64 c = threadIdx.x; c < L; c += blockDim.x) dot += ld(ql, c) * ld(row, c);
            for (u64 c = threadIdx.x; c < R; c += blockDim.x) dot += ld(qp, c) * ld(row, L + c);
            score = block_sum(dot, scratch) * scale;
        }
        if (threadIdx.x == 0) {
            scores[jj] = score;
            if (j < context) prow[j] = score > -INFINITY ? score : 0.0f;
        }
        mx = fmaxf(mx, score);
    }
    __syncthreads();
    float sum = 0.0f;
    for (u64 jj = 0; jj < SPLIT; jj++)
        if (scores[jj] > -INFINITY) sum += expf(scores[jj] - mx);
    float* a = acc + (ih * splits + s) * L;
    for (u64 c = threadIdx.x; c < L; c += blockDim.x) {
        float v = 0.0f;
        for (u64 jj = 0; jj < SPLIT; jj++)
            if (scores[jj] > -INFINITY) v += expf(scores[jj] - mx) * ld(cache, cache_row(block_table, first + jj) * (L + R) + c);
        a[c] = v;
    }
    if (threadIdx.x == 0) {
        maxes[ih * splits + s] = mx;
        sums[ih * splits + s] = sum;
    }
}
extern "C" __global__ void attn_latent_partial_f32(const float* ql, const float* qp, const float* cache, const int* bt, const int* pos, const unsigned char* mask, float* acc, float* mx, float* sm, float* probs, u64 n, u64 h, u64 L, u64 R, u64 ctx, u64 splits, float scale, int skip) { latent_partial_k(ql, qp, cache, bt, pos, mask, acc, mx, sm, probs, n, h, L, R, ctx, splits, scale, skip); }
extern "C" __global__ void attn_latent_partial_bf16(const bf16_t* ql, const bf16_t* qp, const bf16_t* cache, const int* bt, const int* pos, const unsigned char* mask, float* acc, float* mx, float* sm, float* probs, u64 n, u64 h, u64 L, u64 R, u64 ctx, u64 splits, float scale, int skip) { latent_partial_k(ql, qp, cache, bt, pos, mask, acc, mx, sm, probs, n, h, L, R, ctx, splits, scale, skip); }

// One block per (query, head): merges the splits by their log-sum-exp.
template <typename T> __device__ void latent_merge_k(const float* acc, const float* maxes, const float* sums,
                                                     const int* positions, const unsigned char* mask, T* out,
                                                     float* probs, u64 n, u64 heads, u64 L, u64 context, u64 splits,
                                                     int lse_log2, int skip_last_head) {
    extern __shared__ float weight[];  // one per split (launched with splits · 4 bytes)
    u64 ih = blockIdx.x, i = ih / heads, h = ih % heads;
    if (skip_last_head && h + 1 == heads) return;
    const float* mx = maxes + ih * splits;
    const float* sm = sums + ih * splits;
    if (threadIdx.x == 0) {
        // Partial LSEs (only splits holding a key), their total, and each split's weight.
        float top = -INFINITY;
        for (u64 s = 0; s < splits; s++) {
            float lse = -INFINITY;
            if (sm[s] > 0.0f) lse = lse_log2 ? mx[s] * 1.4426950408889634f + log2f(sm[s]) : mx[s] + logf(sm[s]);
            weight[s] = lse;
            top = fmaxf(top, lse);
        }
        float total = 0.0f;
        for (u64 s = 0; s < splits; s++)
            if (sm[s] > 0.0f) total += expf(weight[s] - top);
        total = top + logf(total);
        for (u64 s = 0; s < splits; s++) weight[s] = sm[s] > 0.0f ? expf(weight[s] - total) / sm[s] : 0.0f;
    }
    __syncthreads();
    for (u64 c = threadIdx.x; c < L; c += blockDim.x) {
        float v = 0.0f;
        for (u64 s = 0; s < splits; s++)
            if (sm[s] > 0.0f) v += weight[s] * acc[(ih * splits + s) * L + c];
        st(out, ih * L + c, v);
    }
    float* prow = probs + (h * n + i) * context;
    for (u64 j = threadIdx.x; j < context; j += blockDim.x) {
        u64 s = j / SPLIT;
        bool allowed = key_allowed(mask, positions, i, j, context);
        prow[j] = allowed && sm[s] > 0.0f ? expf(prow[j] - mx[s]) * weight[s] : 0.0f;
    }
}
extern "C" __global__ void attn_latent_merge_f32(const float* acc, const float* mx, const float* sm, const int* pos, const unsigned char* mask, float* out, float* probs, u64 n, u64 h, u64 L, u64 ctx, u64 splits, int lse_log2, int skip) { latent_merge_k(acc, mx, sm, pos, mask, out, probs, n, h, L, ctx, splits, lse_log2, skip); }
extern "C" __global__ void attn_latent_merge_bf16(const float* acc, const float* mx, const float* sm, const int* pos, const unsigned char* mask, bf16_t* out, float* probs, u64 n, u64 h, u64 L, u64 ctx, u64 splits, int lse_log2, int skip) { latent_merge_k(acc, mx, sm, pos, mask, out, probs, n, h, L, ctx, splits, lse_log2, skip); }
