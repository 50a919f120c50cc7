// RoPE: x [n, heads, d]; the first 2·half elements of each head are rotated for the token's
// position, the rest copied. Interleaved pairs (x0,x1),(x2,x3).. or split halves (x_j, x_{j+half}).
// The angle is formed in float as HF does (inv_freq · position), its sine and cosine in double.
#include "common.cuh"

template <typename T> __device__ void rope_k(const T* x, T* out, u64 n, u64 heads, u64 d, u64 half,
                                             const int* positions, const float* inv_freq, float attention_factor,
                                             int interleaved) {
    u64 total = n * heads * d;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 c = i % d, row = i / d, token = row / heads;
        u64 base = row * d;
        if (c >= 2 * half) {
            out[i] = x[i];
            continue;
        }
        u64 j, a, b;
        bool first;
        if (interleaved) {
            j = c / 2;
            a = 2 * j;
            b = 2 * j + 1;
            first = (c % 2) == 0;
        } else {
            j = c < half ? c : c - half;
            a = j;
            b = j + half;
            first = c < half;
        }
        float angle = inv_freq[j] * (float)positions[token];
        double s, co;
        sincos((double)angle, &s, &co);
        float cs = (float)co * attention_factor, sn = (float)s * attention_factor;
        float x0 = ld(x, base + a), x1 = ld(x, base + b);
        st(out, i, first ? x0 * cs - x1 * sn : x1 * cs + x0 * sn);
    }
}
extern "C" __global__ void rope_f32(const float* x, float* o, u64 n, u64 h, u64 d, u64 half, const int* p, const float* f, float af, int il) { rope_k(x, o, n, h, d, half, p, f, af, il); }
extern "C" __global__ void rope_bf16(const bf16_t* x, bf16_t* o, u64 n, u64 h, u64 d, u64 half, const int* p, const float* f, float af, int il) { rope_k(x, o, n, h, d, half, p, f, af, il); }
