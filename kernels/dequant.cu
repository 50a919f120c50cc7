// Dequantization of ggml block types on the GPU, and the quantized matmul kv_b_proj runs
// through (its blocks decoded inside the kernel, as a production GGUF backend's kernel does).
//
// Every value is decoded on its own from its block (`dq_<type>(block, i)`), with the products
// formed in ggml's order and without contraction (__fmul_rn / __fadd_rn / __fsub_rn), so the
// results are bit-identical to the CPU codec (src/gguf), which matches gguf-py. All multi-byte
// fields are read byte by byte: block sizes such as 18 or 22 bytes leave them unaligned.
//
// FAULT q4k-scale-unpack (`fault` = 1): Q4_K sub-blocks 4..7 take the 6-bit scale/min unpacking
// of sub-blocks 0..3.
#include "common.cuh"

typedef unsigned char u8;

__device__ __forceinline__ float f16_bits_to_f32(unsigned h) {
    u32 s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        float f = __fmul_rn((float)m, 5.9604644775390625e-8f);  // m · 2^-24, exact
        return s ? -f : f;
    }
    if (e == 31) return __uint_as_float(s | 0x7f800000u | (m << 13));
    return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
}
__device__ __forceinline__ float f16_at(const u8* p) { return f16_bits_to_f32((unsigned)p[0] | ((unsigned)p[1] << 8)); }
__device__ __forceinline__ u32 u32_at(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

// ---- legacy 32-value blocks ----
__device__ float dq_q8_0(const u8* b, int i, int) { return __fmul_rn((float)(signed char)b[2 + i], f16_at(b)); }
__device__ float dq_q4_0(const u8* b, int i, int) {
    int q = i < 16 ? (b[2 + i] & 0xF) : (b[2 + i - 16] >> 4);
    return __fmul_rn((float)(q - 8), f16_at(b));
}
__device__ float dq_q4_1(const u8* b, int i, int) {
    int q = i < 16 ? (b[4 + i] & 0xF) : (b[4 + i - 16] >> 4);
    return __fadd_rn(__fmul_rn((float)q, f16_at(b)), f16_at(b + 2));
}
__device__ float dq_q5_0(const u8* b, int i, int) {
    u32 qh = u32_at(b + 2);
    int lo = i < 16 ? (b[6 + i] & 0xF) : (b[6 + i - 16] >> 4);
    int hi = (qh >> i) & 1;
    return __fmul_rn((float)((lo | (hi << 4)) - 16), f16_at(b));
}
__device__ float dq_q5_1(const u8* b, int i, int) {
    u32 qh = u32_at(b + 4);
    int lo = i < 16 ? (b[8 + i] & 0xF) : (b[8 + i - 16] >> 4);
    int hi = (qh >> i) & 1;
    return __fadd_rn(__fmul_rn((float)(lo | (hi << 4)), f16_at(b)), f16_at(b + 2));
}

// ---- K-quants: 256-value super-blocks ----
// Q2_K: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin. Value i: run r = i/16
// (scale byte r), 128-half h = i/128, 2-bit field (r%8)/2 of byte 32h + 16(r%2) + i%16.
__device__ float dq_q2_k(const u8* b, int i, int) {
    int r = i / 16, h = i / 128, l = i % 16;
    int sc = b[r];
    int q = (b[16 + 32 * h + 16 * (r % 2) + l] >> (2 * ((r % 8) / 2))) & 3;
    float dl = __fmul_rn(f16_at(b + 80), (float)(sc & 0xF));
    float ml = __fmul_rn(f16_at(b + 82), (float)(sc >> 4));
    return __fsub_rn(__fmul_rn(dl, (float)q), ml);
}
// Q3_K: hmask[32], qs[64], scales[12] (6-bit, +32), d. Run r = i/16 of 16 values.
__device__ float dq_q3_k(const u8* b, int i, int) {
    int r = i / 16, half = r / 8, k = (r % 8) / 2, l = 16 * (r % 2) + i % 16;
    const u8* s = b + 96;
    int lo = r < 8 ? (s[r] & 0xF) : (s[r - 8] >> 4);
    int hi = (s[8 + r % 4] >> (2 * (r / 4))) & 3;
    int sc = (int)(signed char)(u8)(lo | (hi << 4)) - 32;
    int q = (b[32 + 32 * half + l] >> (2 * k)) & 3;
    int hb = (b[l] >> (4 * half + k)) & 1 ? 0 : 4;
    float dl = __fmul_rn(f16_at(b + 108), (float)sc);
    return __fmul_rn(dl, (float)(q - hb));
}
__device__ __forceinline__ void scale_min_k4(int j, const u8* s, int fault, int* sc, int* m) {
    if (j < 4 || fault) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}
// Q4_K: d, dmin, scales[12], qs[128]. Sub-block j = i/32: chunk c = j/2, low nibble for even j.
__device__ float dq_q4_k(const u8* b, int i, int fault) {
    int j = i / 32, c = j / 2, l = i % 32, sc, m;
    scale_min_k4(j, b + 4, fault && j >= 4, &sc, &m);
    int byte = b[16 + 32 * c + l];
    int q = j % 2 ? byte >> 4 : byte & 0xF;
    float d1 = __fmul_rn(f16_at(b), (float)sc), m1 = __fmul_rn(f16_at(b + 2), (float)m);
    return __fsub_rn(__fmul_rn(d1, (float)q), m1);
}
// Q5_K: d, dmin, scales[12], qh[32], qs[128]; bit j of qh[l] is the 5th bit of sub-block j.
__device__ float dq_q5_k(const u8* b, int i, int) {
    int j = i / 32, c = j / 2, l = i % 32, sc, m;
    scale_min_k4(j, b + 4, 0, &sc, &m);
    int byte = b[48 + 32 * c + l];
    int q = (j % 2 ? byte >> 4 : byte & 0xF) | (((b[16 + l] >> j) & 1) << 4);
    float d1 = __fmul_rn(f16_at(b), (float)sc), m1 = __fmul_rn(f16_at(b + 2), (float)m);
    return __fsub_rn(__fmul_rn(d1, (float)q), m1);
}
// Q6_K: ql[128], qh[64], scales[16] (i8), d. In each 128-half, run = (i%128)/32: runs 0/1 take
// low nibbles of ql bytes l / l+32, runs 2/3 the high nibbles; qh bits 2·run.
__device__ float dq_q6_k(const u8* b, int i, int) {
    int half = i / 128, run = (i % 128) / 32, l = i % 32;
    const u8* ql = b + 64 * half;
    const u8* qh = b + 128 + 32 * half;
    int lowb = ql[l + 32 * (run % 2)];
    int lo = run < 2 ? lowb & 0xF : lowb >> 4;
    int q = (lo | (((qh[l] >> (2 * run)) & 3) << 4)) - 32;
    float scale = (float)(signed char)b[192 + 8 * half + l / 16 + 2 * run];
    return __fmul_rn(__fmul_rn(f16_at(b + 208), scale), (float)q);
}
__device__ float dq_f16(const u8* b, int, int) { return f16_at(b); }
__device__ float dq_bf16(const u8* b, int, int) { return bf16_to_f32((bf16_t)((unsigned)b[0] | ((unsigned)b[1] << 8))); }

// out[e] = value e of the blocks, for `n` values.
template <float (*DQ)(const u8*, int, int), int BS, int TS, typename T>
__device__ void dequant_k(const u8* blocks, T* out, u64 n, int fault) {
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x)
        st(out, e, DQ(blocks + (e / BS) * TS, (int)(e % BS), fault));
}

// y[t, r] = Σ_k x[t, k] · W[r, k] with W stored as blocks, `row_bytes` per row. Block = one
// weight row decoded into shared memory (k floats), then each warp takes tokens; lanes stride
// over k and the warp adds up. Grid (rows, token chunks).
#define QM_TOKENS 64
template <float (*DQ)(const u8*, int, int), int BS, int TS, typename T>
__device__ void linear_q_k(const T* x, const u8* w, T* y, u64 n, u64 k, u64 rows, u64 row_bytes, int fault) {
    extern __shared__ float wrow[];
    const u64 r = blockIdx.x;
    const u8* src = w + r * row_bytes;
    for (u64 i = threadIdx.x; i < k; i += blockDim.x) wrow[i] = DQ(src + (i / BS) * TS, (int)(i % BS), fault);
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const u64 t0 = (u64)blockIdx.y * QM_TOKENS, t1 = min(t0 + QM_TOKENS, n);
    for (u64 t = t0 + warp; t < t1; t += warps) {
        const T* xr = x + t * k;
        float acc = 0.0f;
        for (u64 i = lane; i < k; i += 32) acc += ld(xr, i) * wrow[i];
        for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) st(y, t * rows + r, acc);
    }
}

#define QTYPE(name, BS, TS)                                                                              \
    extern "C" __global__ void dequant_##name##_f32(const u8* b, float* o, u64 n, int f) {                \
        dequant_k<dq_##name, BS, TS>(b, o, n, f);                                                          \
    }                                                                                                      \
    extern "C" __global__ void dequant_##name##_bf16(const u8* b, bf16_t* o, u64 n, int f) {              \
        dequant_k<dq_##name, BS, TS>(b, o, n, f);                                                          \
    }                                                                                                      \
    extern "C" __global__ void linear_##name##_f32(const float* x, const u8* w, float* y, u64 n, u64 k,   \
                                                   u64 rows, u64 rb, int f) {                              \
        linear_q_k<dq_##name, BS, TS>(x, w, y, n, k, rows, rb, f);                                         \
    }                                                                                                      \
    extern "C" __global__ void linear_##name##_bf16(const bf16_t* x, const u8* w, bf16_t* y, u64 n, u64 k, \
                                                    u64 rows, u64 rb, int f) {                             \
        linear_q_k<dq_##name, BS, TS>(x, w, y, n, k, rows, rb, f);                                         \
    }

QTYPE(q8_0, 32, 34)
QTYPE(q4_0, 32, 18)
QTYPE(q4_1, 32, 20)
QTYPE(q5_0, 32, 22)
QTYPE(q5_1, 32, 24)
QTYPE(q2_k, 256, 84)
QTYPE(q3_k, 256, 110)
QTYPE(q4_k, 256, 144)
QTYPE(q5_k, 256, 176)
QTYPE(q6_k, 256, 210)
QTYPE(f16, 1, 2)
QTYPE(bf16, 1, 2)
