// RMSNorm and LayerNorm over the last dimension, one block per row, statistics in float.
#include "common.cuh"

template <typename T> __device__ void rmsnorm_k(const T* x, const T* w, T* out, u64 cols, float eps) {
    __shared__ float scratch[32];
    const T* row = x + blockIdx.x * cols;
    float ss = 0.0f;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = ld(row, c);
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss, scratch) / (float)cols + eps);
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x)
        st(out, blockIdx.x * cols + c, ld(w, c) * (ld(row, c) * inv));
}
extern "C" __global__ void rmsnorm_f32(const float* x, const float* w, float* o, u64 cols, float eps) { rmsnorm_k(x, w, o, cols, eps); }
extern "C" __global__ void rmsnorm_bf16(const bf16_t* x, const bf16_t* w, bf16_t* o, u64 cols, float eps) { rmsnorm_k(x, w, o, cols, eps); }

template <typename T> __device__ void layernorm_k(const T* x, const T* w, const T* b, T* out, u64 cols, float eps) {
    __shared__ float scratch[32];
    const T* row = x + blockIdx.x * cols;
    float s = 0.0f;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) s += ld(row, c);
    float mean = block_sum(s, scratch) / (float)cols;
    float v = 0.0f;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        float d = ld(row, c) - mean;
        v += d * d;
    }
    float inv = rsqrtf(block_sum(v, scratch) / (float)cols + eps);
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x)
        st(out, blockIdx.x * cols + c, (ld(row, c) - mean) * inv * ld(w, c) + ld(b, c));
}
extern "C" __global__ void layernorm_f32(const float* x, const float* w, const float* b, float* o, u64 cols, float eps) { layernorm_k(x, w, b, o, cols, eps); }
extern "C" __global__ void layernorm_bf16(const bf16_t* x, const bf16_t* w, const bf16_t* b, bf16_t* o, u64 cols, float eps) { layernorm_k(x, w, b, o, cols, eps); }
