// MoE routing, one warp per token: s = sigmoid(logit); choice = s + bias; groups scored by the
// sum of their two best choices; the best topk_group groups stay eligible (the experts of the
// others rank as -inf); the top_k experts by choice are picked (ties to the lower index), weighted by s / Σs (+1e-20) when
// normalising, times the scaling factor. Values are ordered as Rust's f32::total_cmp orders them
// (a NaN ranks above everything), so a NaN upstream routes exactly as on the CPU reference.
#include "common.cuh"

// sigmoid, with a NaN logit scoring the positive NaN (as the CPU reference does).
__device__ __forceinline__ float expert_score(float x) {
    return x != x ? __int_as_float(0x7fc00000) : 1.0f / (1.0f + expf(-x));
}

// A total order on floats: the bits, with the magnitude flipped for negatives.
__device__ __forceinline__ int total_key(float f) {
    int b = __float_as_int(f);
    return b ^ (int)(((unsigned)(b >> 31)) >> 1);
}

// The better of two candidates: the larger key, or on equal keys the lower index (top-k's tie
// rule). An index of -1 is no candidate.
__device__ __forceinline__ void better(int& key, int& idx, int k2, int i2) {
    if (i2 >= 0 && (idx < 0 || k2 > key || (k2 == key && i2 < idx))) { key = k2; idx = i2; }
}

// The warp's best candidate; every lane gets it.
__device__ __forceinline__ int warp_best(int key, int idx) {
    for (int o = 16; o > 0; o >>= 1) {
        int k2 = __shfl_xor_sync(0xffffffffu, key, o), i2 = __shfl_xor_sync(0xffffffffu, idx, o);
        better(key, idx, k2, i2);
    }
    return idx;
}

// Whether candidate (ka, a) ranks before (kb, b): a larger key, or the lower index on equal keys
// (top-k's tie rule). An index of -1 is no candidate.
__device__ __forceinline__ bool before(int ka, int a, int kb, int b) {
    return a >= 0 && (b < 0 || ka > kb || (ka == kb && a < b));
}

// One warp per token (a block each). Shared memory per token: choice [experts], group score
// [n_group], group kept [n_group], taken [experts]. Output per token: the top_k ids (as floats,
// exact below 2^24), then their weights.
template <typename T>
__device__ void route_warp(const T* logits, const float* bias, u64 tokens, int experts, int n_group, int topk_group,
                           int top_k, int normalise, float scaling, float* out) {
    extern __shared__ float sm[];
    u64 t = blockIdx.x;
    int lane = threadIdx.x & 31;
    if (t >= tokens) return;
    const T* row = logits + t * experts;
    float* choice = sm;
    float* group_score = choice + experts;
    float* kept = group_score + n_group;
    float* taken = kept + n_group;
    float* ids = out + t * (u64)(2 * top_k);
    float* w = ids + top_k;
    int per_group = experts / n_group;
    for (int e = lane; e < experts; e += 32) {
        choice[e] = expert_score(ld(row, e)) + bias[e];
        taken[e] = 0.0f;
    }
    __syncwarp();
    for (int g = 0; g < n_group; g++) {
        // The sum of the group's two best choices (ties to the lower index, as top-k takes
        // them): each lane's best two of its experts, then the warp's.
        int ka = 0, a = -1, kb = 0, b = -1;
        for (int e = g * per_group + lane; e < (g + 1) * per_group; e += 32) {
            int k = total_key(choice[e]);
            if (before(k, e, ka, a)) { kb = ka; b = a; ka = k; a = e; }
            else if (before(k, e, kb, b)) { kb = k; b = e; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            int ka2 = __shfl_xor_sync(0xffffffffu, ka, o), a2 = __shfl_xor_sync(0xffffffffu, a, o);
            int kb2 = __shfl_xor_sync(0xffffffffu, kb, o), b2 = __shfl_xor_sync(0xffffffffu, b, o);
            if (before(ka2, a2, ka, a)) {
                // The other's best leads; the second is the better of ours and its second.
                if (!before(kb2, b2, ka, a)) { kb2 = ka; b2 = a; }
                ka = ka2; a = a2; kb = kb2; b = b2;
            } else if (before(ka2, a2, kb, b)) {
                kb = ka2; b = a2;
            }
        }
        if (lane == 0) {
            group_score[g] = b >= 0 ? choice[a] + choice[b] : choice[a];
            kept[g] = 0.0f;
        }
    }
    __syncwarp();
    if (lane == 0) {
        for (int k = 0; k < topk_group; k++) {
            int best = -1;
            for (int g = 0; g < n_group; g++)
                if (kept[g] == 0.0f && (best < 0 || total_key(group_score[g]) > total_key(group_score[best]))) best = g;
            kept[best] = 1.0f;
        }
    }
    __syncwarp();
    // Experts of dropped groups rank as -inf, as the reference masks them (they stay candidates).
    const int dropped = total_key(-INFINITY);
    for (int k = 0; k < top_k; k++) {
        int key = 0, idx = -1;
        for (int e = lane; e < experts; e += 32)
            if (taken[e] == 0.0f) better(key, idx, kept[e / per_group] != 0.0f ? total_key(choice[e]) : dropped, e);
        idx = warp_best(key, idx);
        if (lane == 0) {
            if (idx >= 0) taken[idx] = 1.0f;
            ids[k] = (float)idx;
        }
        __syncwarp();
    }
    if (lane == 0) {
        float sum = 0.0f;
        for (int k = 0; k < top_k; k++) {
            int e = (int)ids[k];
            float s = e >= 0 ? expert_score(ld(row, e)) : 0.0f;
            w[k] = s;
            sum += s;
        }
        for (int k = 0; k < top_k; k++) {
            float v = w[k];
            if (normalise) v /= sum + 1e-20f;
            w[k] = v * scaling;
        }
    }
}

extern "C" __global__ void route_f32(const float* logits, const float* bias, u64 tokens, int experts, int n_group,
                                     int topk_group, int top_k, int normalise, float scaling, float* out) {
    route_warp(logits, bias, tokens, experts, n_group, topk_group, top_k, normalise, scaling, out);
}

extern "C" __global__ void route_bf16(const bf16_t* logits, const float* bias, u64 tokens, int experts, int n_group,
                                      int topk_group, int top_k, int normalise, float scaling, float* out) {
    route_warp(logits, bias, tokens, experts, n_group, topk_group, top_k, normalise, scaling, out);
}
