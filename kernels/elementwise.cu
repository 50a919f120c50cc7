// Elementwise and layout kernels: poison/zero fill, add, bias, scale, SiLU gate, slicing and
// concatenating head groups, gathering rows for an expert and adding them back.
#include "common.cuh"

#define GRID_STRIDE(i, n) for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// The fills let the next kernel on the stream place its blocks at once: launched as a
// dependent (a decode's split kernel after its output's poison fill), it sets up while the
// fill runs and waits for the fill's end before it touches memory. A kernel launched plainly
// is not affected.
extern "C" __global__ void fill_u32(u32* p, u32 v, u64 n) {
    let_dependents_launch();
    GRID_STRIDE(i, n) p[i] = v;
}
extern "C" __global__ void fill_u16(unsigned short* p, u32 v, u64 n) {
    let_dependents_launch();
    GRID_STRIDE(i, n) p[i] = (unsigned short)v;
}

template <typename T> __device__ void add_k(const T* a, const T* b, T* out, u64 n) {
    GRID_STRIDE(i, n) st(out, i, ld(a, i) + ld(b, i));
}
extern "C" __global__ void add_f32(const float* a, const float* b, float* out, u64 n) { add_k(a, b, out, n); }
extern "C" __global__ void add_bf16(const bf16_t* a, const bf16_t* b, bf16_t* out, u64 n) { add_k(a, b, out, n); }

// x[r, c] += bias[c], in place.
template <typename T> __device__ void add_bias_k(T* x, const T* bias, u64 rows, u64 cols) {
    GRID_STRIDE(i, rows * cols) st(x, i, ld(x, i) + ld(bias, i % cols));
}
extern "C" __global__ void add_bias_f32(float* x, const float* b, u64 rows, u64 cols) { add_bias_k(x, b, rows, cols); }
extern "C" __global__ void add_bias_bf16(bf16_t* x, const bf16_t* b, u64 rows, u64 cols) { add_bias_k(x, b, rows, cols); }

template <typename T> __device__ void scale_k(const T* x, float s, T* out, u64 n) {
    GRID_STRIDE(i, n) st(out, i, ld(x, i) * s);
}
extern "C" __global__ void scale_f32(const float* x, float s, float* out, u64 n) { scale_k(x, s, out, n); }
extern "C" __global__ void scale_bf16(const bf16_t* x, float s, bf16_t* out, u64 n) { scale_k(x, s, out, n); }

// SiLU(gate) * up.
template <typename T> __device__ void silu_mul_k(const T* g, const T* u, T* out, u64 n) {
    GRID_STRIDE(i, n) {
        float x = ld(g, i);
        st(out, i, x / (1.0f + expf(-x)) * ld(u, i));
    }
}
extern "C" __global__ void silu_mul_f32(const float* g, const float* u, float* out, u64 n) { silu_mul_k(g, u, out, n); }
extern "C" __global__ void silu_mul_bf16(const bf16_t* g, const bf16_t* u, bf16_t* out, u64 n) { silu_mul_k(g, u, out, n); }

// x [rows, groups, gw] -> out [rows, groups, width], columns start..start+width of each group.
template <typename T> __device__ void slice_groups_k(const T* x, T* out, u64 rows, u64 groups, u64 gw, u64 start, u64 width) {
    GRID_STRIDE(i, rows * groups * width) {
        u64 c = i % width, g = i / width;
        out[i] = x[g * gw + start + c];
    }
}
extern "C" __global__ void slice_groups_f32(const float* x, float* o, u64 r, u64 g, u64 gw, u64 s, u64 w) { slice_groups_k(x, o, r, g, gw, s, w); }
extern "C" __global__ void slice_groups_bf16(const bf16_t* x, bf16_t* o, u64 r, u64 g, u64 gw, u64 s, u64 w) { slice_groups_k(x, o, r, g, gw, s, w); }

// a [rows·groups, wa] and b [rows·groups, wb] -> out [rows·groups, wa + wb]: a block a row at a
// time, its threads along the row (no 64-bit division per element, which took most of the time).
template <typename T> __device__ void concat_groups_k(const T* a, const T* b, T* out, u64 n_groups, u64 wa, u64 wb) {
    const u64 w = wa + wb;
    for (u64 g = blockIdx.x; g < n_groups; g += gridDim.x) {
        T* o = out + g * w;
        for (u64 c = threadIdx.x; c < wa; c += blockDim.x) o[c] = a[g * wa + c];
        for (u64 c = threadIdx.x; c < wb; c += blockDim.x) o[wa + c] = b[g * wb + c];
    }
}
extern "C" __global__ void concat_groups_f32(const float* a, const float* b, float* o, u64 n, u64 wa, u64 wb) { concat_groups_k(a, b, o, n, wa, wb); }
extern "C" __global__ void concat_groups_bf16(const bf16_t* a, const bf16_t* b, bf16_t* o, u64 n, u64 wa, u64 wb) { concat_groups_k(a, b, o, n, wa, wb); }

// out[i] = x[rows[i]] for rows of `cols` elements.
template <typename T> __device__ void gather_rows_k(const T* x, const int* rows, T* out, u64 n, u64 cols) {
    GRID_STRIDE(i, n * cols) out[i] = x[(u64)rows[i / cols] * cols + i % cols];
}
extern "C" __global__ void gather_rows_f32(const float* x, const int* r, float* o, u64 n, u64 c) { gather_rows_k(x, r, o, n, c); }
extern "C" __global__ void gather_rows_bf16(const bf16_t* x, const int* r, bf16_t* o, u64 n, u64 c) { gather_rows_k(x, r, o, n, c); }

// `total / width` copies of one i32 row one after another (the block table of a batch whose
// sequences share their pages).
extern "C" __global__ void repeat_rows_i32(const int* row, int* out, u64 width, u64 total) {
    GRID_STRIDE(i, total) out[i] = row[i % width];
}

// acc[rows[i]] += w[i] * y[i]; the rows of one call are distinct (one expert's tokens).
template <typename T> __device__ void scatter_add_rows_k(T* acc, const int* rows, const T* y, const float* w, u64 n, u64 cols) {
    GRID_STRIDE(i, n * cols) {
        u64 r = i / cols, c = i % cols;
        u64 at = (u64)rows[r] * cols + c;
        st(acc, at, ld(acc, at) + w[r] * ld(y, i));
    }
}
extern "C" __global__ void scatter_add_rows_f32(float* a, const int* r, const float* y, const float* w, u64 n, u64 c) { scatter_add_rows_k(a, r, y, w, n, c); }
extern "C" __global__ void scatter_add_rows_bf16(bf16_t* a, const int* r, const bf16_t* y, const float* w, u64 n, u64 c) { scatter_add_rows_k(a, r, y, w, n, c); }

// Uniform values in [-amp, amp) from a counter hash (seed, index), for benchmark inputs that
// are neither zeros nor one repeated value.
__device__ __forceinline__ float hash_uniform(u64 seed, u64 i) {
    u64 x = seed * 0x9E3779B97F4A7C15ull + i;
    x ^= x >> 30; x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27; x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    return (float)(x >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
}
extern "C" __global__ void fill_random_bf16(bf16_t* p, u64 seed, float amp, u64 n) {
    GRID_STRIDE(i, n) p[i] = f32_to_bf16(amp * hash_uniform(seed, i));
}
extern "C" __global__ void fill_random_f32(float* p, u64 seed, float amp, u64 n) {
    GRID_STRIDE(i, n) p[i] = amp * hash_uniform(seed, i);
}

// Synthetic weights, the values of the CPU generator (src/model/weights/synthetic.rs) bit for
// bit: element `first + i` of the tensor whose key is `key`, as offset + scale · normalish. The
// integer mix is exact; the f64 and f32 steps are the CPU's, rounded to nearest one at a time
// (no fused multiply-add, which the CPU does not use).
__device__ __forceinline__ u64 synthetic_mix64(u64 x) {
    x ^= x >> 30; x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27; x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}
__device__ __forceinline__ float synthetic_value(u64 key, u64 index, float offset, float scale) {
    u64 h = synthetic_mix64(key + index * 0x9E3779B97F4A7C15ull);
    u64 sum = (h & 0xFFFF) + ((h >> 16) & 0xFFFF) + ((h >> 32) & 0xFFFF) + (h >> 48);
    double u = __ddiv_rn((double)sum + 2.0, 65536.0);
    double root3 = __longlong_as_double(0x3FFBB67AE8584CAAll);  // sqrt(3), correctly rounded
    float v = __double2float_rn(__dmul_rn(__dsub_rn(u, 2.0), root3));
    return __fadd_rn(offset, __fmul_rn(scale, v));
}
template <typename T> __device__ void synthetic_fill_k(T* p, u64 key, u64 first, float offset, float scale, u64 n) {
    GRID_STRIDE(i, n) st(p, i, synthetic_value(key, first + i, offset, scale));
}
extern "C" __global__ void synthetic_fill_f32(float* p, u64 key, u64 first, float offset, float scale, u64 n) { synthetic_fill_k(p, key, first, offset, scale, n); }
extern "C" __global__ void synthetic_fill_bf16(bf16_t* p, u64 key, u64 first, float offset, float scale, u64 n) { synthetic_fill_k(p, key, first, offset, scale, n); }
