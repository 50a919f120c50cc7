// The fp8_ds_mla latent cache (the CPU codec, src/ops/kv_fp8.rs, is the reference these match
// bit for bit): 656 bytes per token, the 512 latent values as E4M3 over their tile's f32 scale
// (four tiles of 128; the scales at bytes 512..528), then the 64 RoPE values in bf16
// (528..656). The conversions are written out in integer and exact float steps rather than
// taken from cuda_fp8.h, so that rounding (to nearest, ties to even), saturation (±448) and NaN
// are those of the codec on every architecture. Needs common.cuh, mma.cuh and tma.cuh before it.
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
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst), "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]) : "memory");
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst + 16), "r"(p[4]), "r"(p[5]), "r"(p[6]), "r"(p[7]) : "memory");
}

// A decode's KV tile from an fp8_ds_mla cache comes in two steps, so that its global loads are
// asynchronous like a bf16 cache's and overlap the compute of earlier tiles:
// - fp8_issue_tile (the stage's loader) copies each row's 656 raw bytes by cp.async into the
//   tail of the row's shared bf16 row (bytes FP8_RAW_AT.. of its STRIDE·2 = 1168) and zeroes
//   the rows from `valid` on;
// - fp8_expand_tile (after the stage's wait and barrier) dequantizes each row in place: E4M3 ×
//   the tile's scale rounded to bf16 (what a bf16 copy of the decoded row holds) into bytes
//   0..1024, the bf16 RoPE part moved to 1024..1152. The raw bytes overlap the bf16 ones of the
//   same row only, so one warp takes a row: every lane reads its part, the warp syncs, then
//   every lane writes. A barrier must follow before the tile is read.
#define FP8_RAW_AT 512

template <int TILE, int STRIDE_, int THREADS_>
__device__ __forceinline__ void fp8_issue_tile(unsigned dst, const unsigned char* cache, u64 row0, int valid) {
    constexpr int RAW_CHUNKS = FP8_TOKEN_BYTES / 16;     // 41 16-byte chunks of a cache row
    constexpr int CHUNKS = (FP8_LATENT + FP8_ROPE) / 8;  // 72 of a bf16 row
    static_assert(FP8_TOKEN_BYTES % 16 == 0 && FP8_RAW_AT + FP8_TOKEN_BYTES <= STRIDE_ * 2 && STRIDE_ % 8 == 0,
                  "raw rows fit, 16-byte aligned, in the tails of the bf16 rows");
    const int n = min(TILE, valid);
    const unsigned char* src = cache + row0 * FP8_TOKEN_BYTES;
    for (int c = threadIdx.x; c < n * RAW_CHUNKS; c += THREADS_) {
        const int r = c / RAW_CHUNKS, j = c % RAW_CHUNKS;
        cp_async16(dst + r * STRIDE_ * 2 + FP8_RAW_AT + 16 * j, src + (u64)r * FP8_TOKEN_BYTES + 16 * j);
    }
    for (int c = n * CHUNKS + threadIdx.x; c < TILE * CHUNKS; c += THREADS_)
        st_shared_zero16(dst + ((c / CHUNKS) * STRIDE_ + (c % CHUNKS) * 8) * 2);
}

__device__ __forceinline__ uint4 fp8_ld_shared16(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}

template <int TILE, int STRIDE_, int THREADS_>
__device__ __forceinline__ void fp8_expand_tile(unsigned dst, int valid) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n = min(TILE, valid);
    static_assert(FP8_LATENT == 32 * 16 && FP8_ROPE * 2 == 8 * 16, "lane l: latent bytes 16l.., lanes < 8: a RoPE chunk");
#pragma unroll 1
    for (int r = warp; r < n; r += THREADS_ / 32) {  // the same rows for the whole warp
        const unsigned row = dst + r * STRIDE_ * 2, raw = row + FP8_RAW_AT;
        const uint4 b = fp8_ld_shared16(raw + 16 * lane);
        float s;
        asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(s) : "r"(raw + FP8_SCALES_AT + 4 * (16 * lane / FP8_TILE)) : "memory");
        uint4 rope = make_uint4(0, 0, 0, 0);
        if (lane < 8) rope = fp8_ld_shared16(raw + FP8_ROPE_AT + 16 * lane);
        __syncwarp();
        fp8_store16(row + 32 * lane, b, s);
        if (lane < 8)
            asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(row + 2 * FP8_LATENT + 16 * lane), "r"(rope.x), "r"(rope.y),
                         "r"(rope.z), "r"(rope.w)
                         : "memory");
    }
}

// ---- The FP8-cache decode's own operands (mla_decode_fp8*.cu: f16 MMAs on the raw rows).

// The two E4M3 bytes in the low (HI = 0) or high half of v as f16x2, exactly (byte 0 of the
// half to the low f16). sm_89 and later; the kernels using it run from sm_90 on.
template <int HI> __device__ __forceinline__ unsigned e4m3x2_f16x2(unsigned v) {
    unsigned r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (HI)
        asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %1;\ncvt.rn.f16x2.e4m3x2 %0, h;\n}\n" : "=r"(r) : "r"(v));
    else
        asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %1;\ncvt.rn.f16x2.e4m3x2 %0, l;\n}\n" : "=r"(r) : "r"(v));
#else
    r = 0;
    __trap();
#endif
    return r;
}

__device__ __forceinline__ uint2 fp8_ld_shared8(unsigned addr) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
    return v;
}
__device__ __forceinline__ float fp8_ld_shared_f32(unsigned addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
    return v;
}

// The power of two that brings a query row's largest |value| to about 2^14, so that the row
// uses f16's range (1 for 0, infinity or NaN).
__device__ __forceinline__ float f16_row_factor(float amax) {
    const int e = (int)((__float_as_uint(amax) >> 23) & 0xffu);
    if (amax == 0.0f || e == 0xff) return 1.0f;
    return fp8_pow2(max(-126, min(127, 141 - e)));
}

// The smallest power of two ≥ x > 0 (x itself when it is one; at most 2^127).
__device__ __forceinline__ float pow2_at_least(float x) {
    const u32 bits = __float_as_uint(x);
    const u32 up = (bits & 0x7fffffu) ? ((bits >> 23) + 1) << 23 : bits & 0x7f800000u;
    return __uint_as_float(min(up, 0x7f000000u));
}

// A tile's rows into a stage for the few-heads kernels (FP8, and the bf16 sparse one), by warp 0, with the tile's key bits
// (bit r: row r holds a key) stored at `keys_at` before the copies are armed, so that a thread
// that saw the stage's barrier complete reads them too. Rows that hold no key are not copied:
// the kernels take their bytes as zero and their scores as -inf.
// - Dense: the tile's valid rows are consecutive in one page: one bulk copy by lane 0. With
//   PAGE_AHEAD, lane 0 loads the next tile's page number as it issues this one (the FP8 wgmma
//   decode); without, when it issues (the few-heads kernels: ahead, h16 measured slower).
// - Sparse: row r is list entry t0 + r; lane r copies its 656 bytes, found through the block
//   table. The two dependent loads are pipelined in the lanes' registers: issuing tile k uses the
//   position and page loaded with earlier issues, loads the page of tile k + 1 and the position
//   of tile k + 2, so no issue waits on its own lookups (the first tiles' issues once do).
// ROW bytes of a cache row (an fp8_ds_mla row by default; a bf16 row for mla_sparse_h8), DST
// bytes between rows in the stage (a dense tile needs them packed: one copy).
template <bool SPARSE, int TILE, int ROW = FP8_TOKEN_BYTES, int DST = ROW, bool PAGE_AHEAD = false> struct TileIssuer {
    static_assert(SPARSE || ROW == DST, "a dense tile is one copy of packed rows");
    static_assert(ROW % 16 == 0 && DST % 16 == 0, "bulk copies move 16-byte units");
    const unsigned char* cache;
    const int* bt;    // the sequence's block table row
    const int* list;  // its key list (sparse)
    int t_begin, t_end;
    int pos, page, next_pos;  // sparse: this lane's entry of the next tile to issue, its page, the entry after
                              // (dense with PAGE_AHEAD: `page` is the next tile's)

    __device__ __forceinline__ int entry(int i) const { return i < t_end ? list[i] : -1; }

    __device__ __forceinline__ void start(int lane) {
        if (!SPARSE) {
            if (PAGE_AHEAD) page = lane == 0 && t_begin < t_end ? bt[t_begin / 64] : 0;
            return;
        }
        pos = entry(t_begin + lane);
        page = pos >= 0 ? bt[pos / 64] : 0;
        next_pos = entry(t_begin + TILE + lane);
    }

    __device__ __forceinline__ void issue(int j, unsigned dst, unsigned mb, unsigned keys_at, int lane) {
        const int t0 = t_begin + j * TILE;
        if (!SPARSE) {
            if (lane != 0) return;
            const int valid = min(TILE, t_end - t0);
            const u64 row = (u64)(PAGE_AHEAD ? page : bt[t0 / 64]) * 64 + t0 % 64;
            st_shared_u32(keys_at, valid == 32 ? 0xffffffffu : (1u << valid) - 1u);
            mbar_expect_bytes(mb, valid * ROW);
            bulk_load(dst, cache + row * ROW, valid * ROW, mb);
            if (PAGE_AHEAD && t0 + TILE < t_end) page = bt[(t0 + TILE) / 64];
            return;
        }
        static_assert(TILE == 32, "a lane per row");
        const bool key = pos >= 0;  // entries past the end read as -1
        const u64 row = (u64)page * 64 + pos % 64;
        const unsigned keys = __ballot_sync(0xffffffffu, key);
        if (lane == 0) {
            st_shared_u32(keys_at, keys);
            mbar_expect_bytes(mb, __popc(keys) * ROW);
        }
        __syncwarp();
        if (key) bulk_load(dst + lane * DST, cache + row * ROW, ROW, mb);
        pos = next_pos;
        page = pos >= 0 ? bt[pos / 64] : 0;
        next_pos = entry(t0 + 2 * TILE + lane);
    }
};

// σ, the power of two the few-heads kernels divide the probabilities by (scale / σ ≤ 1 keeps
// the f16 operand of P·V in range), grown to cover a tile whose largest scale is smax. Returns
// the factor O (kept in units of σ) must be multiplied by: 1 when σ stays, 0 the first time.
__device__ __forceinline__ float fp8_sigma_grow(float smax, float& sigma) {
    if (!(smax > sigma)) return 1.0f;
    const float next = pow2_at_least(smax);
    const float grow = sigma / next;
    sigma = next;
    return grow;
}

// Sixteen bf16 query values at src (32 bytes, 16-byte aligned) as floats into v, zeros for a
// padding row.
__device__ __forceinline__ void fp8_query16(const bf16_t* src, bool real, float* v) {
    uint4 w[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
    if (real) {
        w[0] = ((const uint4*)src)[0];
        w[1] = ((const uint4*)src)[1];
    }
    const u32 words[8] = {w[0].x, w[0].y, w[0].z, w[0].w, w[1].x, w[1].y, w[1].z, w[1].w};
#pragma unroll
    for (int k = 0; k < 8; k++) {
        v[2 * k] = bf16_lo(words[k]);
        v[2 * k + 1] = bf16_hi(words[k]);
    }
}

// The end of a few-heads kernel: the block's O, already put in dim order in shared memory at
// `rows_at` (row r, dim d at float r·stride + d + d/32), out in bf16 for its `rows` real heads:
// into out when the decode did not split, else into the split's partials.
__device__ __forceinline__ void fp8_store_o(unsigned rows_at, int stride, int rows, int splits, bf16_t* out, u64 out_head,
                                            bf16_t* part_o, u64 part_head) {
    for (int i = threadIdx.x; i < rows * FP8_LATENT / 2; i += blockDim.x) {
        const int row = i / (FP8_LATENT / 2), dim = 2 * (i % (FP8_LATENT / 2));
        const unsigned at = rows_at + (row * stride + dim + dim / 32) * 4;
        const float x = fp8_ld_shared_f32(at), y = fp8_ld_shared_f32(at + 4);
        bf16_t* dst = splits == 1 ? out + (out_head + row) * FP8_LATENT : part_o + (part_head + row) * FP8_LATENT;
        *(unsigned*)(dst + dim) = pack_bf16(x, y);
    }
}

// ---- The block of a few-heads kernel (mla_decode_fp8*.cu, mla_sparse_h8.cu).

// Block (split, sequence b, group of ROWS heads): its split's entries [t_begin, t_end) in tiles
// of TILE, the heads that exist, the first row of its partials.
struct FewHeadsBlock {
    int b, head0, heads_here, t_begin, t_end;
    u64 out_row;
};
template <int ROWS, int TILE> __device__ __forceinline__ FewHeadsBlock few_heads_block(const int* seq_lens, int splits, int total_heads) {
    const int split = blockIdx.x, b = blockIdx.y, head0 = blockIdx.z * ROWS;
    const DecodeSplit range = decode_split(seq_lens[b], splits, split, TILE);
    return {b, head0, min(ROWS, total_heads - head0), range.begin, range.end, ((u64)b * splits + split) * total_heads + head0};
}

// A producer warp beside the compute warps (the sparse 8-head kernels): `empty` holds a barrier
// per stage on which each compute warp arrives once it is done with the stage's tile
// (release_stage); the producer puts every tile j into its stage (issue(j)) once the stage's
// previous tile was released. init_empty_barriers goes before init_stage_barriers, whose block
// barrier publishes both.
__device__ __forceinline__ void init_empty_barriers(unsigned empty, int stages, unsigned compute_warps) {
    if (threadIdx.x == 0)
        for (int st = 0; st < stages; st++) mbar_init(empty + 8 * st, compute_warps);
}
template <class Issue> __device__ __forceinline__ void produce_tiles(int n_tiles, int stages, unsigned empty, Issue issue) {
    for (int j = 0; j < n_tiles; j++) {
        if (j >= stages) mbar_wait(empty + 8 * (j % stages), (j / stages - 1) & 1);
        issue(j);
    }
}
__device__ __forceinline__ void release_stage(unsigned empty_at) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(empty_at);
}

// The stages' copy barriers, set up by thread 0 before anyone waits on them.
__device__ __forceinline__ void init_stage_barriers(unsigned mbar, int stages) {
    if (threadIdx.x == 0) {
        for (int st = 0; st < stages; st++) mbar_init(mbar + 8 * st, 1);
        mbar_init_fence();
    }
    __syncthreads();
}

// The partial-S exchange of four warps: N float4 per lane, item i of warp w's lane l at
// ((w·N + i)·32 + l)·16 (conflict-free). Store, then (after a barrier) the four warps' sum of
// item i, added in warp order so that every warp gets the same bits.
template <int N> __device__ __forceinline__ void xchg_store(unsigned x, int warp, int lane, int i, const float* v) {
    asm volatile("st.shared.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(x + ((warp * N + i) * 32 + lane) * 16), "f"(v[0]), "f"(v[1]), "f"(v[2]),
                 "f"(v[3]));
}
template <int N> __device__ __forceinline__ float4 xchg_sum(unsigned x, int lane, int i) {
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < 4; w++) {
        float4 p;
        asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(p.x), "=f"(p.y), "=f"(p.z), "=f"(p.w) : "r"(x + ((w * N + i) * 32 + lane) * 16));
        sum.x += p.x, sum.y += p.y, sum.z += p.z, sum.w += p.w;
    }
    return sum;
}

// One tile's online softmax in base 2 for the kernels whose heads are the MMAs' columns (the Sᵀ
// accumulators of two 16-token M-tiles: lanes hold tokens g, g + 8 and heads 2qd, 2qd + 1, so a
// head's maximum is over the eight lanes of a quad position). sc becomes the unnormalised P;
// m_run and l_run advance; alpha is what O must be multiplied by. With EXTRA, `extra` is
// maximised over the same lanes alongside (the FP8 kernel's largest token scale).
template <bool EXTRA = false>
__device__ __forceinline__ void column_softmax(float (&sc)[2][4], float* m_run, float* l_run, float* alpha, float* extra = nullptr) {
    float mx[2] = {fmaxf(fmaxf(sc[0][0], sc[0][2]), fmaxf(sc[1][0], sc[1][2])),
                   fmaxf(fmaxf(sc[0][1], sc[0][3]), fmaxf(sc[1][1], sc[1][3]))};
#pragma unroll
    for (int sh = 4; sh <= 16; sh <<= 1) {
        mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], sh));
        mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], sh));
        if (EXTRA) *extra = fmaxf(*extra, __shfl_xor_sync(0xffffffffu, *extra, sh));
    }
    float m_use[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int h = 0; h < 2; h++) {
        alpha[h] = raise_max(m_run[h], mx[h]);
        m_use[h] = exp_base(m_run[h]);
    }
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            sc[mt][c] = fast_exp2(sc[mt][c] - m_use[c & 1]);
            sum[c & 1] += sc[mt][c];
        }
#pragma unroll
    for (int h = 0; h < 2; h++) l_run[h] = l_run[h] * alpha[h] + sum[h];
}

// Oᵀ (eight M-tiles, columns heads 2qd, 2qd + 1) times alpha per column, skipped when no lane
// of the warp changed (most tiles change no maximum).
__device__ __forceinline__ void column_rescale(float (&o)[8][4], const float* alpha) {
    if (__all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f)) return;
#pragma unroll
    for (int mt = 0; mt < 8; mt++) {
        o[mt][0] *= alpha[0];
        o[mt][1] *= alpha[1];
        o[mt][2] *= alpha[0];
        o[mt][3] *= alpha[1];
    }
}

// The log-sum-exps of a kernel whose heads are the MMAs' columns (lanes 0–3 of warp 0 hold
// heads 2qd, 2qd + 1): into lse_out when the decode did not split, else the split's partials.
__device__ __forceinline__ void column_lse_store(const float* m_run, const float* l_run, int heads_here, int splits, float* lse_out,
                                                 u64 out_head, float* part_lse, u64 part_head) {
    const int qd = threadIdx.x % 4;
    if (threadIdx.x >= 4) return;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int head = 2 * qd + h;
        if (head >= heads_here) continue;  // padding: not written
        const float lse = l_run[h] > 0.0f ? (m_run[h] + log2f(l_run[h])) * 0.6931471805599453f : -INFINITY;
        if (splits == 1)
            lse_out[out_head + head] = lse;
        else
            part_lse[part_head + head] = lse;
    }
}

// ---- The FP8-cache decode on warpgroup MMAs (mla_decode_sm90.cu, sm_90a): a warpgroup turns
// each tile's raw rows into the bf16 tile that TMA writes for the bf16 kernel, so the MMAs, and
// their results bit for bit, are that kernel's over a bf16 copy of the decoded rows.

#define FP8_RAW_TILE_BYTES (32 * FP8_TOKEN_BYTES)  // a raw tile of 32 rows, packed as in the cache

// What one thread (warp w of a warpgroup's four, lane l) of the warpgroup converting half H of a
// raw tile of 32 rows holds: row l's latent chunks w + 4k (16 bytes, 16 values) for k = 4H ..
// 4H + 3 (half 0 the dims 0..255, half 1 256..511) with the scales of their two tiles, and its
// RoPE chunk w + 4H (8 bf16 values). Lanes take rows, so a warp's 16-byte loads (rows 656 bytes
// apart) and its swizzled stores hit distinct banks.
struct Fp8HalfSlice {
    uint4 latent[4];
    float2 scales;
    uint4 rope;
};

// Half H of row `lane` of the raw tile at `raw`; zeros for a row that holds no key (its bytes
// are stale: a dense tile's rows past the split's end, a sparse tile's padding, never copied).
template <int H> __device__ __forceinline__ Fp8HalfSlice fp8_slice_load(unsigned raw, int warp, int lane, bool key) {
    Fp8HalfSlice s;
    if (!key) {
#pragma unroll
        for (int k = 0; k < 4; k++) s.latent[k] = make_uint4(0, 0, 0, 0);
        s.scales = make_float2(0.0f, 0.0f);
        s.rope = make_uint4(0, 0, 0, 0);
        return s;
    }
    const unsigned row = raw + lane * FP8_TOKEN_BYTES;
#pragma unroll
    for (int k = 0; k < 4; k++) s.latent[k] = fp8_ld_shared16(row + 16 * (warp + 4 * (4 * H + k)));
    asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];\n" : "=f"(s.scales.x), "=f"(s.scales.y) : "r"(row + FP8_SCALES_AT + 8 * H) : "memory");
    s.rope = fp8_ld_shared16(row + FP8_ROPE_AT + 16 * (warp + 4 * H));
    return s;
}

// An f16x2 as two floats (low half first), exactly.
__device__ __forceinline__ float2 f16x2_to_f32x2(unsigned v) {
    float2 r;
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n" : "=f"(r.x), "=f"(r.y) : "r"(v));
    return r;
}

// Half H of the slice into a stage laid out as TMA's 128-byte swizzle lays out a bf16 tile of
// 32 rows of 576: nine boxes of 64 dims, BOX bytes apart; row r's 16-byte chunk c of a box at
// r·128 + (c ^ r%8)·16. Latent values: E4M3 × the tile's scale rounded to bf16 (both
// conversions exact, so the bits of fp8_store16 and of the codec's bf16 copy); RoPE values as
// they are. Half 0 writes boxes 0–3 and half the ninth, half 1 boxes 4–7 and the ninth's rest.
template <int BOX, int H> __device__ __forceinline__ void fp8_slice_store(unsigned stage, const Fp8HalfSlice& s, int warp, int lane) {
    const unsigned row = stage + lane * 128;
    const int sw = lane % 8;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int c = warp + 4 * (4 * H + k);  // dims 16c..16c + 15: box c/4, its chunks 2(c%4) and 2(c%4) + 1
        const float scale = k < 2 ? s.scales.x : s.scales.y;
        const u32 w[4] = {s.latent[k].x, s.latent[k].y, s.latent[k].z, s.latent[k].w};
        unsigned p[8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 lo = f16x2_to_f32x2(e4m3x2_f16x2<0>(w[i])), hi = f16x2_to_f32x2(e4m3x2_f16x2<1>(w[i]));
            p[2 * i] = pack_bf16(lo.x * scale, lo.y * scale);
            p[2 * i + 1] = pack_bf16(hi.x * scale, hi.y * scale);
        }
        const unsigned box = row + (c / 4) * BOX;
        const int at = 2 * (c % 4);
        asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(box + ((at ^ sw) << 4)), "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3])
                     : "memory");
        asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(box + (((at + 1) ^ sw) << 4)), "r"(p[4]), "r"(p[5]), "r"(p[6]),
                     "r"(p[7])
                     : "memory");
    }
    const int c = warp + 4 * H;  // RoPE dims 8c..8c + 7: the ninth box's chunk c
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(row + 8 * BOX + ((c ^ sw) << 4)), "r"(s.rope.x), "r"(s.rope.y), "r"(s.rope.z),
                 "r"(s.rope.w)
                 : "memory");
}
