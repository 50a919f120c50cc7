// MoE routing, one thread per token: s = sigmoid(logit); choice = s + bias; groups scored by the
// sum of their two best choices; the best topk_group groups stay eligible; the top_k eligible
// experts by choice are picked (ties to the lower index), weighted by s / Σs (+1e-20) when
// normalising, times the scaling factor. Values are ordered as Rust's f32::total_cmp orders them
// (a NaN ranks above everything), so a NaN upstream routes exactly as on the CPU reference.
#include "common.cuh"

// A total order on floats: the bits, with the magnitude flipped for negatives.
__device__ __forceinline__ int total_key(float f) {
    int b = __float_as_int(f);
    return b ^ (int)(((unsigned)(b >> 31)) >> 1);
}

extern "C" __global__ void route_f32(const float* logits, const float* bias, u64 tokens, int experts, int n_group,
                                     int topk_group, int top_k, int normalise, float scaling, int* out_ids,
                                     float* out_w, float* scratch) {
    u64 t = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    const float* row = logits + t * experts;
    // Per token: choice [experts], group score [n_group], flags [experts] (1 = eligible).
    float* choice = scratch + t * (u64)(2 * experts + n_group);
    float* group_score = choice + experts;
    float* eligible = group_score + n_group;
    int per_group = experts / n_group;
    for (int e = 0; e < experts; e++) choice[e] = 1.0f / (1.0f + expf(-row[e])) + bias[e];
    for (int g = 0; g < n_group; g++) {
        // The sum of the group's two best choices (ties to the lower index, as top-k takes them).
        int a = -1, b = -1;
        for (int e = g * per_group; e < (g + 1) * per_group; e++) {
            if (a < 0 || total_key(choice[e]) > total_key(choice[a])) { b = a; a = e; }
            else if (b < 0 || total_key(choice[e]) > total_key(choice[b])) b = e;
        }
        group_score[g] = b >= 0 ? choice[a] + choice[b] : choice[a];
    }
    for (int e = 0; e < experts; e++) eligible[e] = 0.0f;
    for (int kept = 0; kept < topk_group; kept++) {
        int best = -1;
        for (int g = 0; g < n_group; g++)
            if (eligible[g * per_group] == 0.0f && (best < 0 || total_key(group_score[g]) > total_key(group_score[best]))) best = g;
        for (int e = best * per_group; e < (best + 1) * per_group; e++) eligible[e] = 1.0f;
    }
    float sum = 0.0f;
    for (int k = 0; k < top_k; k++) {
        int best = -1;
        for (int e = 0; e < experts; e++)
            if (eligible[e] == 1.0f && (best < 0 || total_key(choice[e]) > total_key(choice[best]))) best = e;
        out_ids[t * top_k + k] = best;
        eligible[best] = 2.0f;  // taken
        float s = 1.0f / (1.0f + expf(-row[best]));
        out_w[t * top_k + k] = s;
        sum += s;
    }
    for (int k = 0; k < top_k; k++) {
        float w = out_w[t * top_k + k];
        if (normalise) w /= sum + 1e-20f;
        out_w[t * top_k + k] = w * scaling;
    }
}
