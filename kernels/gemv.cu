// A linear layer of few rows (a decode step's tokens): y [n, out] = x [n, k] · Wᵀ (W [out, k]),
// f32 accumulation, for n up to GEMV_TOKENS. Every weight is read once, so this is a weight
// stream: each warp takes GEMV_ROWS rows of W (a band) and walks k 16 bytes a lane, two steps in
// flight, against the n input rows (read through L1: they are small and every warp reads them). It
// replaces cuBLAS for these shapes, whose host call cost several times a kernel launch.
// The launcher guarantees k a multiple of the 16-byte vector and 16-byte aligned buffers.
#include "common.cuh"

#define GEMV_TOKENS 8
#define GEMV_ROWS 4
#define GEMV_THREADS 256

template <typename T, int NT>
__device__ void gemv_k(const T* x, const T* w, T* y, u64 n, u64 k, u64 out, u64 parts) {
    typedef Vec16<T> V;
    typedef typename V::Raw Raw;
    const int N = V::N;
    // Each row sum's share from every warp of its band, for the band's first warp to add up.
    __shared__ float shares[GEMV_THREADS / 32][GEMV_ROWS * NT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const int part = warp % parts, band = warp / parts;
    const u64 row0 = ((u64)blockIdx.x * (GEMV_THREADS / 32 / parts) + band) * GEMV_ROWS;
    const bool live = row0 < out;
    float acc[GEMV_ROWS][NT];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[r][t] = 0.f;
    // Rows past `out` read row0's again (in bounds) and are not stored.
    const T* rows[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) rows[r] = w + (row0 + r < out ? row0 + r : row0) * k;
    const u64 step = parts * 32 * N;
#pragma unroll 2
    for (u64 kk = ((u64)part * 32 + lane) * N; live && kk < k; kk += step) {
        Raw raw[GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) raw[r] = __ldg((const Raw*)(rows[r] + kk));
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t >= n) break;
            Raw xr = __ldg((const Raw*)(x + t * k + kk));
#pragma unroll
            for (int v = 0; v < N; ++v) {
                float xv = V::get(xr, v);
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r) acc[r][t] = fmaf(V::get(raw[r], v), xv, acc[r][t]);
            }
        }
    }
    // Lane r·NT + t holds row r's sum for token t (this warp's share).
    float mine = 0.f;
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            float s = warp_sum(acc[r][t]);
            if (lane == r * NT + t) mine = s;
        }
    if (parts > 1) {
        if (lane < GEMV_ROWS * NT) shares[warp][lane] = mine;
        __syncthreads();
        if (part != 0 || lane >= GEMV_ROWS * NT) return;
        mine = 0.f;
        for (int p = 0; p < parts; ++p) mine += shares[warp + p][lane];
    }
    const int r = lane / NT, t = lane % NT;
    if (lane < GEMV_ROWS * NT && t < n && row0 + r < out) st(y, t * out + row0 + r, mine);
}
// One token (a decode step of one sequence), and up to GEMV_TOKENS; `parts` warps (1, 2, 4 or
// 8) share each band of rows, each a share of k, so that a layer of few rows still fills the GPU.
extern "C" __global__ void gemv1_f32(const float* x, const float* w, float* y, u64 n, u64 k, u64 out, u64 parts) { gemv_k<float, 1>(x, w, y, n, k, out, parts); }
extern "C" __global__ void gemv1_bf16(const bf16_t* x, const bf16_t* w, bf16_t* y, u64 n, u64 k, u64 out, u64 parts) { gemv_k<bf16_t, 1>(x, w, y, n, k, out, parts); }
extern "C" __global__ void gemv8_f32(const float* x, const float* w, float* y, u64 n, u64 k, u64 out, u64 parts) { gemv_k<float, GEMV_TOKENS>(x, w, y, n, k, out, parts); }
extern "C" __global__ void gemv8_bf16(const bf16_t* x, const bf16_t* w, bf16_t* y, u64 n, u64 k, u64 out, u64 parts) { gemv_k<bf16_t, GEMV_TOKENS>(x, w, y, n, k, out, parts); }
