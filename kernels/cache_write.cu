// The KV cache write: new rows (latent c_kv | k_pe, or a naive-path K/V row) scattered into the
// device cache at the physical slots the slot mapping gives, as a serving engine's
// reshape-and-cache kernel does (the fp8_ds_mla cache has its own, quantizing, in kv_fp8.cu).
// The slot mapping is the engine's (token position → page → physical row); the
// kv-cache-off-by-one fault lives there, so this kernel writes where a wrong mapping says.
// Block = one row at a time (grid-stride), threads over its elements. A slot listed twice gets
// the same row both times (the caller sends each slot's latest row).
#include "common.cuh"

template <typename T>
__device__ void kv_cache_write(const T* rows, const int* slots, T* cache, int n, int width) {
    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        const T* src = rows + (u64)r * width;
        T* dst = cache + (u64)slots[r] * width;
        for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
    }
}

extern "C" __global__ void kv_cache_write_f32(const float* rows, const int* slots, float* cache, int n, int width) {
    kv_cache_write<float>(rows, slots, cache, n, width);
}

extern "C" __global__ void kv_cache_write_bf16(const bf16_t* rows, const int* slots, bf16_t* cache, int n, int width) {
    kv_cache_write<bf16_t>(rows, slots, cache, n, width);
}
