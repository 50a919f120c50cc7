// Shared helpers of mladb's kernels. Storage is float or bf16; bf16 is handled as 16-bit
// patterns converted by bit operations, so no CUDA header is needed (NVRTC compiles these files
// on a machine with no toolkit). Arithmetic is always float.
#pragma once

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

// A compile-time value as a type, to pass to a generic lambda that compiles a variant of its
// body for it (`decltype(arg)::value` in an `if constexpr`): a warpgroup's half of a tile, a
// tile with or without its mask, a tile whose rows all hold keys.
template <int V> struct Const {
    static constexpr int value = V;
};

// The poison pattern of unwritten outputs (a signalling NaN: arithmetic never produces it).
#define POISON_F32 0x7FA5A5A5u
#define POISON_BF16 0x7FA5u

__device__ __forceinline__ float bf16_to_f32(bf16_t b) { return __uint_as_float(((u32)b) << 16); }
// The two bf16 of a 32-bit word as memory holds them (the first in the low half), as floats.
__device__ __forceinline__ float bf16_lo(u32 word) { return __uint_as_float(word << 16); }
__device__ __forceinline__ float bf16_hi(u32 word) { return __uint_as_float(word & 0xffff0000u); }

// Round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

template <typename T> struct St;
template <> struct St<float> {
    static __device__ __forceinline__ float ld(const float* p, u64 i) { return p[i]; }
    static __device__ __forceinline__ void st(float* p, u64 i, float v) { p[i] = v; }
};
template <> struct St<bf16_t> {
    static __device__ __forceinline__ float ld(const bf16_t* p, u64 i) { return bf16_to_f32(p[i]); }
    static __device__ __forceinline__ void st(bf16_t* p, u64 i, float v) { p[i] = f32_to_bf16(v); }
};

template <typename T> __device__ __forceinline__ float ld(const T* p, u64 i) { return St<T>::ld(p, i); }
template <typename T> __device__ __forceinline__ void st(T* p, u64 i, float v) { St<T>::st(p, i, v); }

// Storage values a lane loads at once: 16 bytes.
template <typename T> struct Vec16;
template <> struct Vec16<float> {
    static const int N = 4;
    typedef float4 Raw;
    static __device__ __forceinline__ float get(const Raw& r, int i) {
        return i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w;
    }
};
template <> struct Vec16<bf16_t> {
    static const int N = 8;
    typedef uint4 Raw;
    static __device__ __forceinline__ float get(const Raw& r, int i) {
        u32 word = i < 2 ? r.x : i < 4 ? r.y : i < 6 ? r.z : r.w;
        return (i & 1) ? bf16_hi(word) : bf16_lo(word);
    }
};

// The value as the storage type holds it.
template <typename T> __device__ __forceinline__ float stored(float v);
template <> __device__ __forceinline__ float stored<float>(float v) { return v; }
template <> __device__ __forceinline__ float stored<bf16_t>(float v) { return bf16_to_f32(f32_to_bf16(v)); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum / max over blockDim.x (a multiple of 32, at most 1024) threads; every thread
// gets the result. `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : -INFINITY;
    return warp_max(v);
}

// Kernels are templates over the storage type T (float or bf16_t) with one extern "C" entry
// point per type, named NAME_f32 and NAME_bf16: the host side picks one by the storage dtype.

// MLA decode (mla_decode.cu, mla_decode_sm90.cu): the tokens [begin, end) of KV split `split` of
// a sequence of n_tok, in splits of equal length rounded up to whole tiles (some may be empty).
struct DecodeSplit {
    int begin, end;
};
__device__ __forceinline__ DecodeSplit decode_split(int n_tok, int splits, int split, int tile) {
    int chunk = (n_tok + splits - 1) / splits;
    chunk = (chunk + tile - 1) / tile * tile;
    return {split * chunk, min(split * chunk + chunk, n_tok)};
}

// What an empty split (or sequence) leaves for its `rows` heads × dv: zeros and an LSE of -inf,
// in the output itself (one split: `row` of out/lse_out) or in the split's partials (`part_row`).
// `rows` is the block's heads that exist, not its group size: the rows after them belong to the
// next sequence or split, so the last group of a head count off the group size writes fewer.
// Element offset of row `row` of page `page` in a paged cache of `width`-wide bf16 rows (pages
// of 64). WRAP32 plants page-index-overflow: the byte offset computed in 32 bits, as a kernel
// doing its index arithmetic in unsigned int does, wraps for pages past the first 4 GiB of the
// pool and lands 4 GiB early (the launcher only runs it over a pool larger than 4 GiB, so the
// wrapped address stays inside the pool).
template <bool WRAP32> __device__ __forceinline__ u64 paged_row(int page, int row, int width) {
    const u64 bytes = ((u64)page * 64 + row) * width * 2;
    return (WRAP32 ? (u64)(unsigned)bytes : bytes) / 2;
}

// Programmatic dependent launch (sm_90 on; nothing before): a kernel lets the next kernel on
// its stream, launched as a dependent, place its blocks now; that kernel waits for this one's
// end (and its memory) before reading what it wrote.
__device__ __forceinline__ void let_dependents_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prior_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Named barriers: `bar_sync` waits, `bar_arrive` only counts; `n` threads in all complete it.
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }

__device__ __forceinline__ void decode_empty_split(int rows, int dv, int splits, u64 row, u64 part_row, bf16_t* out,
                                                   float* lse_out, bf16_t* part_o, float* part_lse) {
    if (splits == 1) {
        for (int i = threadIdx.x; i < rows * dv; i += blockDim.x) out[row * dv + i] = 0;
        for (int i = threadIdx.x; i < rows; i += blockDim.x) lse_out[row + i] = -INFINITY;
    } else {
        for (int i = threadIdx.x; i < rows * dv; i += blockDim.x) part_o[part_row * dv + i] = 0;
        for (int i = threadIdx.x; i < rows; i += blockDim.x) part_lse[part_row + i] = -INFINITY;
    }
}

// The query tile and head of a causal prefill block (grid: query tiles × heads). The hardware
// starts blocks in the order of their linear index. Each head's tiles run longest first, and
// the heads go in chunks: within a chunk the order is tile by tile across its heads, so the
// chunk's longest tiles start first. Head by head (chunks of one), the last head's longest
// tiles started with little work left beside them and ran on alone (1k and 2k tokens 7% slower
// on the H200); every head at once lost the L2 (8k: 5% slower, each head's K and V being 8 MB).
// A chunk has enough heads that its work spread over the multiprocessors outlasts its longest
// tile: tiles·(tiles + 1)/2 per head against `tiles` on each of the SMs, so 2·SMs/(tiles + 1)
// heads, whose K and V together come to about 2·SMs·128 rows·1 KB, 33 MB on 132 SMs: what L2
// holds.
struct LongestFirst {
    int q_tile, head;
};
__device__ __forceinline__ LongestFirst longest_first() {
    unsigned sms;
    asm("mov.u32 %0, %%nsmid;\n" : "=r"(sms));
    const unsigned tiles = gridDim.x, heads = gridDim.y, lin = blockIdx.x + tiles * blockIdx.y;
    const unsigned most = min(heads, max(1u, (2 * sms + tiles) / (tiles + 1)));
    const unsigned chunks = (heads + most - 1) / most, chunk = (heads + chunks - 1) / chunks;  // even chunks
    const unsigned c = lin / (tiles * chunk), in_chunk = lin - c * tiles * chunk;
    const unsigned here = min(chunk, heads - c * chunk);  // the last chunk may have fewer heads
    return {(int)(tiles - 1 - in_chunk / here), (int)(c * chunk + in_chunk % here)};
}
