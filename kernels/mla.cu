// The MLA-specific projections around attention. kv_b_proj [H·(P+V), L] holds, per head, a block
// of P+V rows: W_UK at rows uk..uk+P and W_UV at rows uv..uv+V of the block (uk = 0, uv = P in
// every real checkpoint; the absorb-wrong-split fault passes other offsets).
#include "common.cuh"

#define GRID_STRIDE(i, n) for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// q_lat[t,h,l] = Σ_p q_nope[t,h,p] · W_UK[h][p][l]: W_UK folded into the query. Adjacent threads
// read adjacent l of a weight row; eight rows' loads are in flight at once.
template <typename T> __device__ void absorb_query_k(const T* q, const T* w, T* out, u64 n, u64 heads, u64 P, u64 V,
                                                     u64 L, u64 uk) {
    GRID_STRIDE(i, n * heads * L) {
        u64 l = i % L, th = i / L, h = th % heads;
        const T* qh = q + th * P;
        const T* wl = w + (h * (P + V) + uk) * L + l;
        float acc = 0.0f;
#pragma unroll 8
        for (u64 p = 0; p < P; p++) acc += ld(qh, p) * ld(wl, p * L);
        st(out, i, acc);
    }
}
extern "C" __global__ void absorb_query_f32(const float* q, const float* w, float* o, u64 n, u64 h, u64 P, u64 V, u64 L, u64 uk) { absorb_query_k(q, w, o, n, h, P, V, L, uk); }
extern "C" __global__ void absorb_query_bf16(const bf16_t* q, const bf16_t* w, bf16_t* o, u64 n, u64 h, u64 P, u64 V, u64 L, u64 uk) { absorb_query_k(q, w, o, n, h, P, V, L, uk); }

// o[t, h·V + v] = Σ_l W_UV[h][v][l] · o_lat[t,h,l]: W_UV applied after the latent attention. A
// warp per output, its lanes along the weight row (a thread per output read rows L apart).
template <typename T> __device__ void apply_w_uv_k(const T* lat, const T* w, T* out, u64 n, u64 heads, u64 P, u64 V,
                                                   u64 L, u64 uv) {
    const int lane = threadIdx.x & 31;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 i = (blockIdx.x * (u64)blockDim.x + threadIdx.x) >> 5; i < n * heads * V; i += warps) {
        u64 v = i % V, th = i / V, h = th % heads;
        const T* x = lat + th * L;
        const T* wr = w + (h * (P + V) + uv + v) * L;
        float acc = 0.0f;
        for (u64 l = lane; l < L; l += 32) acc += ld(x, l) * ld(wr, l);
        acc = warp_sum(acc);
        if (lane == 0) st(out, i, acc);
    }
}
extern "C" __global__ void apply_w_uv_f32(const float* x, const float* w, float* o, u64 n, u64 h, u64 P, u64 V, u64 L, u64 uv) { apply_w_uv_k(x, w, o, n, h, P, V, L, uv); }
extern "C" __global__ void apply_w_uv_bf16(const bf16_t* x, const bf16_t* w, bf16_t* o, u64 n, u64 h, u64 P, u64 V, u64 L, u64 uv) { apply_w_uv_k(x, w, o, n, h, P, V, L, uv); }

// Decompressed kv [n, H·(P+V)] and roped k_pe [n, R] -> per-head K [n, H·(P+R)] = k_nope | k_pe
// and V [n, H·V].
template <typename T> __device__ void assemble_kv_k(const T* kv, const T* k_pe, T* k, T* v, u64 n, u64 heads, u64 P,
                                                    u64 R, u64 V) {
    u64 kw = P + R;
    GRID_STRIDE(i, n * heads * (kw + V)) {
        u64 c = i % (kw + V), th = i / (kw + V), t = th / heads, h = th % heads;
        const T* src = kv + t * heads * (P + V) + h * (P + V);
        if (c < P) k[th * kw + c] = src[c];
        else if (c < kw) k[th * kw + c] = k_pe[t * R + (c - P)];
        else v[th * V + (c - kw)] = src[P + (c - kw)];
    }
}
extern "C" __global__ void assemble_kv_f32(const float* kv, const float* pe, float* k, float* v, u64 n, u64 h, u64 P, u64 R, u64 V) { assemble_kv_k(kv, pe, k, v, n, h, P, R, V); }
extern "C" __global__ void assemble_kv_bf16(const bf16_t* kv, const bf16_t* pe, bf16_t* k, bf16_t* v, u64 n, u64 h, u64 P, u64 R, u64 V) { assemble_kv_k(kv, pe, k, v, n, h, P, R, V); }
