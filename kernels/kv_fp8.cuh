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
__device__ __forceinline__ float e4m3_to_f32(unsigned b) {
    const unsigned e = (b >> 3) & 15u, m = b & 7u;
    float v;
    if (e == 0)
        v = (float)m * (1.0f / 512.0f);
    else if (e == 15 && m == 7)
        v = __int_as_float(0x7fc00000);
    else
        v = __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -v : v;
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

// Columns k..k+7 of an fp8_ds_mla cache row (656 bytes) into 16 bytes of shared memory as
// bf16, for the decode's tile loaders: a latent chunk lies in one tile, and its bytes are
// dequantized here (E4M3 × the tile's scale, rounded to bf16: what a bf16 copy of the decoded
// row holds); a RoPE chunk is bf16 already and copied asynchronously, as a bf16 cache's is.
__device__ __forceinline__ void fp8_load16(unsigned dst, const unsigned char* cache, u64 row, int k) {
    const unsigned char* t = cache + row * FP8_TOKEN_BYTES;
    if (k >= FP8_LATENT) {
        cp_async16(dst, t + FP8_ROPE_AT + 2 * (k - FP8_LATENT));
        return;
    }
    const uint2 b = *(const uint2*)(t + k);
    const float s = *(const float*)(t + FP8_SCALES_AT + 4 * (k / FP8_TILE));
    unsigned p[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 w = i < 2 ? b.x : b.y;
        const int sh = (i % 2) * 16;
        p[i] = pack_bf16(e4m3_to_f32((w >> sh) & 0xffu) * s, e4m3_to_f32((w >> (sh + 8)) & 0xffu) * s);
    }
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst), "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]));
}

// One tile of a decode's KV loader from an fp8_ds_mla cache: rows row0.. (one page, so
// consecutive slots) as TILE rows of 576 bf16 at a shared row stride of STRIDE elements from
// `dst`; rows from `valid` on are zeroed. Not unrolled: the decode's accumulators are live
// around it, and registers are what the loader must not take.
template <int TILE, int STRIDE_, int THREADS_>
__device__ __forceinline__ void fp8_load_tile(unsigned dst, const unsigned char* cache, u64 row0, int valid) {
    constexpr int CHUNKS = (FP8_LATENT + FP8_ROPE) / 8;  // 16-byte chunks of a bf16 row
#pragma unroll 1
    for (int c = threadIdx.x; c < TILE * CHUNKS; c += THREADS_) {
        const int r = c / CHUNKS, k = (c % CHUNKS) * 8;
        if (r < valid)
            fp8_load16(dst + (r * STRIDE_ + k) * 2, cache, row0 + r, k);
        else
            st_shared_zero16(dst + (r * STRIDE_ + k) * 2);
    }
}
