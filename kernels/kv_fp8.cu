// The fp8_ds_mla latent cache write: rows of 576 values (512 latent, 64 RoPE; f32 or bf16)
// quantized into the 656-byte slots of a paged byte cache, each at its given physical slot,
// bit for bit as the CPU codec (src/ops/kv_fp8.rs) writes them. Block = one row at a time
// (grid-stride), four warps: warp w takes latent tile w (four values a lane, its amax by
// shuffles), warps 0 and 1 the RoPE values. `faults` plants the codec's scale faults.
#include "common.cuh"
#include "mma.cuh"
#include "tma.cuh"
#include "kv_fp8.cuh"

template <typename T>
__device__ void kv_fp8_write(const T* rows, const int* slots, unsigned char* cache, int n, int faults) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        const T* x = rows + (u64)r * (FP8_LATENT + FP8_ROPE);
        unsigned char* dst = cache + (u64)slots[r] * FP8_TOKEN_BYTES;
        float v[FP8_TILE / 32];
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < FP8_TILE / 32; j++) {
            v[j] = ld(x, warp * FP8_TILE + lane + 32 * j);
            amax = fmaxf(amax, fabsf(v[j]));  // fmaxf passes over NaN, as the codec's max does
        }
        const float scale = fp8_tile_scale(warp_max(amax), faults);
#pragma unroll
        for (int j = 0; j < FP8_TILE / 32; j++) dst[warp * FP8_TILE + lane + 32 * j] = e4m3_from_f32(v[j] / scale);
        if (lane == 0) *(float*)(dst + FP8_SCALES_AT + 4 * warp) = scale;
        if (warp < FP8_ROPE / 32) {
            const int i = warp * 32 + lane;
            *(bf16_t*)(dst + FP8_ROPE_AT + 2 * i) = f32_to_bf16(ld(x, FP8_LATENT + i));
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) kv_fp8_write_f32(const float* rows, const int* slots, unsigned char* cache, int n,
                                                                  int faults) {
    kv_fp8_write<float>(rows, slots, cache, n, faults);
}

extern "C" __global__ void __launch_bounds__(128) kv_fp8_write_bf16(const bf16_t* rows, const int* slots, unsigned char* cache,
                                                                   int n, int faults) {
    kv_fp8_write<bf16_t>(rows, slots, cache, n, faults);
}
