// The routed experts of an MoE layer in three launches instead of several per expert: gate and
// up projections with the SiLU gate for every expert at once, the down projections, then each
// token's weighted sum over its experts. An expert sees few tokens (one per step when
// decoding), so these are weight-streaming kernels: a block reads a band of one expert's
// weight rows once, 16 bytes a lane, and applies it to a tile of up to EXPERT_TILE tokens
// staged in shared memory. Results are rounded to the storage type where the one-expert-at-a-
// time path stores them (each projection's output, the gate, each addition of the sum).
//
// The tables (`meta`, ints), written by the launcher (src/backend/cuda/device/expert_kernels.rs):
//   [0, 6·jobs)           per job: gate, up and down weight pointers, as u64 (two ints each)
//   tiles_at + 3·i        tile i: job, first slot, token count (1..EXPERT_TILE)
//   tok_at + s            slot s: its token (slots are grouped by job, jobs in expert order)
//   off_at + t .. + t + 1 token t: its range in the list of slots by token
//   by_tok_at + j         that list: each token's slots in expert order
//   w_at + s              slot s: its routing weight (f32 bits)
#include "common.cuh"

#define EXPERT_TILE 8
#define EXPERT_THREADS 256

__device__ __forceinline__ const void* job_weight(const int* meta, int job, int which) {
    return (const void*)((const u64*)meta)[3 * job + which];
}

// This warp's RW rows (from row0) of NW weights [rows, k] of one job, each against the tile's
// tokens: acc[w][r][t] = W_w[row0 + r] · in[row of token t], summed over the warp (every lane
// ends with the sums). Token t's input row is in_rows[first + t] when in_rows is set, else
// first + t. Rows past `rows` give zeros.
template <typename T, int NW, int RW, int TILE>
__device__ __forceinline__ void expert_rows(const T* const (&w)[NW], u64 rows, u64 k, u64 row0,
                                            const T* in, const int* in_rows, int first, int count,
                                            float* xs, float (&acc)[NW][RW][TILE]) {
    typedef Vec16<T> V;
    const int N = V::N, KC = 32 * N;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int a = 0; a < NW; ++a)
#pragma unroll
        for (int r = 0; r < RW; ++r)
#pragma unroll
            for (int t = 0; t < TILE; ++t) acc[a][r][t] = 0.f;
    bool aligned = k % N == 0;
#pragma unroll
    for (int a = 0; a < NW; ++a) aligned = aligned && ((u64)w[a] & 15) == 0;
    for (u64 k0 = 0; k0 < k; k0 += KC) {
        __syncthreads();
        for (int i = threadIdx.x; i < TILE * KC; i += blockDim.x) {
            int t = i / KC;
            u64 kk = k0 + i % KC;
            float v = 0.f;
            if (t < count && kk < k) {
                u64 row = in_rows ? (u64)in_rows[first + t] : (u64)(first + t);
                v = ld(in, row * k + kk);
            }
            xs[i] = v;
        }
        __syncthreads();
        const u64 kk = k0 + (u64)lane * N;
        typename V::Raw raw[NW][RW];
#pragma unroll
        for (int a = 0; a < NW; ++a)
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                u64 o = row0 + r;
                if (aligned && o < rows && kk + N <= k) {
                    raw[a][r] = *(const typename V::Raw*)(w[a] + o * k + kk);
                } else {
                    // The ragged end of a row, or rows not 16-byte aligned: element by element,
                    // into the raw vector's storage values.
                    union {
                        typename V::Raw raw;
                        T part[N];
                    } u;
#pragma unroll
                    for (int v = 0; v < N; ++v) {
                        u.part[v] = 0;
                        if (o < rows && kk + v < k) u.part[v] = w[a][o * k + kk + v];
                    }
                    raw[a][r] = u.raw;
                }
            }
#pragma unroll
        for (int t = 0; t < TILE; ++t) {
            if (t >= count) break;
            float xv[N];
#pragma unroll
            for (int v = 0; v < N; ++v) xv[v] = xs[t * KC + lane * N + v];
#pragma unroll
            for (int a = 0; a < NW; ++a)
#pragma unroll
                for (int r = 0; r < RW; ++r)
#pragma unroll
                    for (int v = 0; v < N; ++v) acc[a][r][t] = fmaf(V::get(raw[a][r], v), xv[v], acc[a][r][t]);
        }
    }
#pragma unroll
    for (int a = 0; a < NW; ++a)
#pragma unroll
        for (int r = 0; r < RW; ++r)
#pragma unroll
            for (int t = 0; t < TILE; ++t)
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) acc[a][r][t] += __shfl_xor_sync(0xffffffffu, acc[a][r][t], off);
}

#define GATE_UP_ROWS 4
#define DOWN_ROWS 8

// act [slots, inter] = SiLU(x·W_gateᵀ) · (x·W_upᵀ) for every tile's tokens; block (b, i) makes
// rows b·8·GATE_UP_ROWS.. of tile i. x [tokens, k] is read through the slots' tokens.
template <typename T, int TILE>
__device__ void experts_gate_up_k(const T* x, const int* meta, u64 tiles_at, u64 tok_at, T* act, u64 k, u64 inter) {
    extern __shared__ float xs[];
    const int* tile = meta + tiles_at + 3 * (u64)blockIdx.y;
    int job = tile[0], first = tile[1], count = tile[2];
    const T* const w[2] = {(const T*)job_weight(meta, job, 0), (const T*)job_weight(meta, job, 1)};
    u64 row0 = ((u64)blockIdx.x * (EXPERT_THREADS / 32) + threadIdx.x / 32) * GATE_UP_ROWS;
    float acc[2][GATE_UP_ROWS][TILE];
    expert_rows<T, 2, GATE_UP_ROWS, TILE>(w, inter, k, row0, x, meta + tok_at, first, count, xs, acc);
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < TILE; ++t) {
        if (t != lane || t >= count) continue;
#pragma unroll
        for (int r = 0; r < GATE_UP_ROWS; ++r) {
            u64 o = row0 + r;
            if (o >= inter) continue;
            float g = stored<T>(acc[0][r][t]), u = stored<T>(acc[1][r][t]);
            st(act, (u64)(first + t) * inter + o, g / (1.0f + expf(-g)) * u);
        }
    }
}
// Tiles of up to EXPERT_TILE tokens, and of one token (decoding: a quarter of the registers, so
// several blocks share an SM and more weight loads are in flight).
extern "C" __global__ void experts_gate_up_f32(const float* x, const int* meta, u64 tiles_at, u64 tok_at, float* act, u64 k, u64 inter) { experts_gate_up_k<float, EXPERT_TILE>(x, meta, tiles_at, tok_at, act, k, inter); }
extern "C" __global__ void experts_gate_up_bf16(const bf16_t* x, const int* meta, u64 tiles_at, u64 tok_at, bf16_t* act, u64 k, u64 inter) { experts_gate_up_k<bf16_t, EXPERT_TILE>(x, meta, tiles_at, tok_at, act, k, inter); }
extern "C" __global__ void experts_gate_up1_f32(const float* x, const int* meta, u64 tiles_at, u64 tok_at, float* act, u64 k, u64 inter) { experts_gate_up_k<float, 1>(x, meta, tiles_at, tok_at, act, k, inter); }
extern "C" __global__ void experts_gate_up1_bf16(const bf16_t* x, const int* meta, u64 tiles_at, u64 tok_at, bf16_t* act, u64 k, u64 inter) { experts_gate_up_k<bf16_t, 1>(x, meta, tiles_at, tok_at, act, k, inter); }

// y [slots, cols] = act · W_downᵀ for every tile's tokens; block (b, i) makes rows
// b·8·DOWN_ROWS.. of tile i.
template <typename T, int TILE>
__device__ void experts_down_k(const T* act, const int* meta, u64 tiles_at, T* y, u64 inter, u64 cols) {
    extern __shared__ float xs[];
    const int* tile = meta + tiles_at + 3 * (u64)blockIdx.y;
    int job = tile[0], first = tile[1], count = tile[2];
    const T* const w[1] = {(const T*)job_weight(meta, job, 2)};
    u64 row0 = ((u64)blockIdx.x * (EXPERT_THREADS / 32) + threadIdx.x / 32) * DOWN_ROWS;
    float acc[1][DOWN_ROWS][TILE];
    expert_rows<T, 1, DOWN_ROWS, TILE>(w, cols, inter, row0, act, nullptr, first, count, xs, acc);
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < TILE; ++t) {
        if (t != lane || t >= count) continue;
#pragma unroll
        for (int r = 0; r < DOWN_ROWS; ++r) {
            u64 o = row0 + r;
            if (o < cols) st(y, (u64)(first + t) * cols + o, acc[0][r][t]);
        }
    }
}
extern "C" __global__ void experts_down_f32(const float* act, const int* meta, u64 tiles_at, float* y, u64 inter, u64 cols) { experts_down_k<float, EXPERT_TILE>(act, meta, tiles_at, y, inter, cols); }
extern "C" __global__ void experts_down_bf16(const bf16_t* act, const int* meta, u64 tiles_at, bf16_t* y, u64 inter, u64 cols) { experts_down_k<bf16_t, EXPERT_TILE>(act, meta, tiles_at, y, inter, cols); }
extern "C" __global__ void experts_down1_f32(const float* act, const int* meta, u64 tiles_at, float* y, u64 inter, u64 cols) { experts_down_k<float, 1>(act, meta, tiles_at, y, inter, cols); }
extern "C" __global__ void experts_down1_bf16(const bf16_t* act, const int* meta, u64 tiles_at, bf16_t* y, u64 inter, u64 cols) { experts_down_k<bf16_t, 1>(act, meta, tiles_at, y, inter, cols); }

// out [tokens, cols]: each token's routing-weighted sum of its slots' rows of y, in expert order
// from zero, rounded to the storage type after each addition (as adding the experts into a
// zeroed output one at a time does).
template <typename T>
__device__ void experts_combine_k(const T* y, const int* meta, u64 off_at, u64 by_tok_at, u64 w_at, T* out, u64 tokens, u64 cols) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < tokens * cols; i += (u64)gridDim.x * blockDim.x) {
        u64 t = i / cols, c = i % cols;
        float acc = 0.f;
        for (int j = meta[off_at + t]; j < meta[off_at + t + 1]; ++j) {
            int s = meta[by_tok_at + j];
            acc = stored<T>(acc + __int_as_float(meta[w_at + s]) * ld(y, (u64)s * cols + c));
        }
        st(out, i, acc);
    }
}
extern "C" __global__ void experts_combine_f32(const float* y, const int* meta, u64 off_at, u64 by_tok_at, u64 w_at, float* out, u64 tokens, u64 cols) { experts_combine_k(y, meta, off_at, by_tok_at, w_at, out, tokens, cols); }
extern "C" __global__ void experts_combine_bf16(const bf16_t* y, const int* meta, u64 off_at, u64 by_tok_at, u64 w_at, bf16_t* out, u64 tokens, u64 cols) { experts_combine_k(y, meta, off_at, by_tok_at, w_at, out, tokens, cols); }
