// The fp8_ds_mla latent cache (the CPU codec, src/ops/kv_fp8.rs, is the reference these match
// bit for bit): 656 bytes per token, the 512 latent values as E4M3 over their tile's f32 scale
// (four tiles of 128; the scales at bytes 512..528), then the 64 RoPE values in bf16
// (528..656). The conversions are written out in integer and exact float steps rather than
// taken from cuda_fp8.h, so that rounding (to nearest, ties to even), saturation (±448) and NaN
// are those of the codec on every architecture. Needs common.cuh and mma.cuh before it.
#pragma once

#define FP8_TOKEN_BYTES 656
#define FP8_LATENT 512
#define FP8_ROPE 64
#define FP8_TILE 128
#define FP8_SCALES_AT 512
#define FP8_ROPE_AT 528
#define FP8_MAX 448.0f
#define FP8_MIN_NORMAL 0.015625f   // 2^-6: below it E4M3 steps by 2^-9
#define FP8_PADDING_AMAX 1.0e4f    // what fp8-amax-padded-rows finds in the padding

// The value of an E4M3 byte: 2^(e-7)·(1 + m/8), or m·2^-9 for e = 0; 0x7F and 0xFF are NaN.
// Exponent and mantissa placed in a float's (e = 0 giving an f32 subnormal) make the value
// times 2^-120, and the product by 2^120 is exact (no flush to zero: the kernels are compiled
// without -ftz), so no branch is taken per byte.
__device__ __forceinline__ float e4m3_to_f32(unsigned b) {
    const u32 sign = (b & 0x80u) << 24;
    if ((b & 0x7fu) == 0x7fu) return __uint_as_float(sign | 0x7fc00000u);
    return __uint_as_float(sign | ((b & 0x7fu) << 20)) * __uint_as_float(247u << 23);
}

// 2^k as a float (k within the normal range).
__device__ __forceinline__ float fp8_pow2(int k) { return __uint_as_float((u32)(127 + k) << 23); }

// The E4M3 byte nearest x (ties to even), ±448 and beyond saturating to ±448, NaN to 0x7F.
__device__ __forceinline__ unsigned char e4m3_from_f32(float x) {
    const u32 bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7F;
    const unsigned sign = (bits >> 24) & 0x80u;
    const float a = fabsf(x);
    if (a >= FP8_MAX) return (unsigned char)(sign | 0x7Eu);
    // The step of a's binade is 2^(e-3); below 2^-6 it stays 2^-9. Scaling by powers of two
    // and floor are exact, so the rounding below is exactly the codec's.
    const int e = a < FP8_MIN_NORMAL ? -6 : (int)((__float_as_uint(a) >> 23) & 0xffu) - 127;
    const float q = a * fp8_pow2(3 - e);
    float m = floorf(q);
    const float frac = q - m;
    if (frac > 0.5f || (frac == 0.5f && ((int)m & 1))) m += 1.0f;
    const float rounded = m * fp8_pow2(e - 3);
    if (rounded >= FP8_MAX) return (unsigned char)(sign | 0x7Eu);
    if (rounded < FP8_MIN_NORMAL) return (unsigned char)(sign | (unsigned)m);  // e = -6: m·2^-9
    const u32 r = __float_as_uint(rounded);  // rounding may have carried into the next binade
    const int e2 = (int)((r >> 23) & 0xffu) - 127;
    return (unsigned char)(sign | (unsigned)((e2 + 7) << 3) | ((r >> 20) & 7u));
}

// A tile's scale from its largest magnitude, as ops::kv_fp8::tile_scale_with: bit 0 of
// `faults` is fp8-scale-default (1.0), bit 1 fp8-amax-padded-rows.
__device__ __forceinline__ float fp8_tile_scale(float amax, int faults) {
    if (faults & 1) return 1.0f;
    if (faults & 2) amax = fmaxf(amax, FP8_PADDING_AMAX);
    return fmaxf(amax / FP8_MAX, 1.17549435e-38f);
}

// Sixteen E4M3 bytes times their tile's scale, rounded to bf16 (what a bf16 copy of the decoded
// row holds), as 16 bytes of shared memory at dst and 16 more at dst + 16.
__device__ __forceinline__ void fp8_store16(unsigned dst, uint4 b, float s) {
    const u32 w[4] = {b.x, b.y, b.z, b.w};
    unsigned p[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int sh = (i % 2) * 16;
        p[i] = pack_bf16(e4m3_to_f32((w[i / 2] >> sh) & 0xffu) * s, e4m3_to_f32((w[i / 2] >> (sh + 8)) & 0xffu) * s);
    }
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst), "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]));
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst + 16), "r"(p[4]), "r"(p[5]), "r"(p[6]), "r"(p[7]));
}

// One tile of a decode's KV loader from an fp8_ds_mla cache: rows row0.. (one page, so
// consecutive slots) as TILE rows of 576 bf16 at a shared row stride of STRIDE elements from
// `dst`; rows from `valid` on are zeroed. The RoPE part is bf16 already and copied
// asynchronously, as a bf16 cache's is. The latent part goes in 16-byte chunks (16 values, one
// tile's, so one scale), BATCH chunks per thread at a time: all of a batch's global loads are
// issued before any is converted, so a batch waits for one memory latency rather than one per
// chunk. The batches are not unrolled: the decode's accumulators are live around the loader,
// and BATCH is what each kernel's registers leave room for (a zero row converts to +0, as
// st_shared_zero16 writes).
template <int TILE, int STRIDE_, int THREADS_, int BATCH>
__device__ __forceinline__ void fp8_load_tile(unsigned dst, const unsigned char* cache, u64 row0, int valid) {
    constexpr int ROPE_CHUNKS = FP8_ROPE / 8;     // 16-byte chunks of a row's bf16 RoPE part
    constexpr int LATENT_CHUNKS = FP8_LATENT / 16;  // 16-byte chunks of a row's E4M3 part
    constexpr int PER_THREAD = TILE * LATENT_CHUNKS / THREADS_;
    static_assert(TILE * LATENT_CHUNKS % THREADS_ == 0 && PER_THREAD % BATCH == 0, "whole batches");
    for (int c = threadIdx.x; c < TILE * ROPE_CHUNKS; c += THREADS_) {
        const int r = c / ROPE_CHUNKS, k = (c % ROPE_CHUNKS) * 8;
        const unsigned d = dst + (r * STRIDE_ + FP8_LATENT + k) * 2;
        if (r < valid)
            cp_async16(d, cache + (row0 + r) * FP8_TOKEN_BYTES + FP8_ROPE_AT + 2 * k);
        else
            st_shared_zero16(d);
    }
    // Chunk c = threadIdx.x + i·THREADS: the column is the same for every i (THREADS is a
    // multiple of LATENT_CHUNKS), so is the scale's tile; the row steps by THREADS / 32.
    static_assert(THREADS_ % LATENT_CHUNKS == 0, "one column per thread");
    const int k = (threadIdx.x % LATENT_CHUNKS) * 16, r0 = threadIdx.x / LATENT_CHUNKS;
    constexpr int ROW_STEP = THREADS_ / LATENT_CHUNKS;
    const unsigned char* src = cache + (row0 + r0) * FP8_TOKEN_BYTES;
    const unsigned d0 = dst + (r0 * STRIDE_ + k) * 2;
#pragma unroll 1
    for (int i0 = 0; i0 < PER_THREAD; i0 += BATCH) {
        uint4 b[BATCH];
        float s[BATCH];
#pragma unroll
        for (int j = 0; j < BATCH; j++) {
            const int r = r0 + (i0 + j) * ROW_STEP;
            const unsigned char* t = src + (u64)((i0 + j) * ROW_STEP) * FP8_TOKEN_BYTES;
            if (r < valid) {
                b[j] = __ldg((const uint4*)(t + k));
                s[j] = __ldg((const float*)(t + FP8_SCALES_AT + 4 * (k / FP8_TILE)));
            } else {
                b[j] = make_uint4(0, 0, 0, 0);
                s[j] = 0.0f;
            }
        }
#pragma unroll
        for (int j = 0; j < BATCH; j++) fp8_store16(d0 + (i0 + j) * ROW_STEP * STRIDE_ * 2, b[j], s[j]);
    }
}
