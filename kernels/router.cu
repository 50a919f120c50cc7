// MoE routing, one thread per token: s = sigmoid(logit); choice = s + bias; groups scored by the
// sum of their two best choices; the best topk_group groups stay eligible; the top_k eligible
// experts by choice are picked (ties to the lower index), weighted by s / Σs (+1e-20) when
// normalising, times the scaling factor.
#include "common.cuh"

extern "C" __global__ void route_f32(const float* logits, const float* bias, u64 tokens, int experts, int n_group,
                                     int topk_group, int top_k, int normalise, float scaling, int* out_ids,
                                     float* out_w, float* scratch) {
    u64 t = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    const float* row = logits + t * experts;
    float* choice = scratch + t * (u64)(experts + n_group);
    float* group_score = choice + experts;
    int per_group = experts / n_group;
    for (int e = 0; e < experts; e++) choice[e] = 1.0f / (1.0f + expf(-row[e])) + bias[e];
    for (int g = 0; g < n_group; g++) {
        float a = -INFINITY, b = -INFINITY;
        for (int e = g * per_group; e < (g + 1) * per_group; e++) {
            float c = choice[e];
            if (c > a) { b = a; a = c; } else if (c > b) b = c;
        }
        group_score[g] = per_group >= 2 ? a + b : a;
    }
    // Drop all but the best topk_group groups (ties to the lower group).
    for (int kept = 0; kept < topk_group; kept++) {
        int best = -1;
        for (int g = 0; g < n_group; g++)
            if (group_score[g] > -INFINITY && group_score[g] != INFINITY && (best < 0 || group_score[g] > group_score[best])) best = g;
        if (best < 0) break;
        group_score[best] = INFINITY;  // mark kept
    }
    for (int g = 0; g < n_group; g++)
        if (group_score[g] != INFINITY)
            for (int e = g * per_group; e < (g + 1) * per_group; e++) choice[e] = -INFINITY;
    // top_k never exceeds the eligible experts (the layout is validated), so a finite choice is
    // always left; a picked expert is set to -inf.
    float sum = 0.0f;
    for (int k = 0; k < top_k; k++) {
        int best = -1;
        for (int e = 0; e < experts; e++)
            if (choice[e] > -INFINITY && (best < 0 || choice[e] > choice[best])) best = e;
        out_ids[t * top_k + k] = best;
        float s = 1.0f / (1.0f + expf(-row[best]));
        out_w[t * top_k + k] = s;
        sum += s;
        choice[best] = -INFINITY;
    }
    for (int k = 0; k < top_k; k++) {
        float w = out_w[t * top_k + k];
        if (normalise) w /= sum + 1e-20f;
        out_w[t * top_k + k] = w * scaling;
    }
}
