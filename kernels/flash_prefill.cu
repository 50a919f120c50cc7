// MLA prefill on tensor cores: causal flash attention over the decompressed K/V (the path the
// MLA papers run for prompts: q·k over nope+rope dims, softmax, ·v), tiled with an online softmax
// in the FlashAttention-2 manner, written with mma.sync/ldmatrix/cp.async only so that it runs on
// every architecture from sm_80 (Blackwell sm_120 included).
//
// q, k: [n, heads, DQK] bf16; v: [n, heads, DV] bf16; out: [n, heads, DV] bf16, lse: [n, heads]
// f32 (natural log). Block = (tile of ROWS queries, head), ROWS/16 warps, each warp owning 16
// query rows and every key of the KV tile, so the softmax needs no cross-warp exchange and P goes
// from the S accumulators straight into the A operand of P·V. Query tiles run longest-first
// (common.cuh, longest_first).
#include "common.cuh"
#include "mma.cuh"
#include "tma.cuh"
#include "variants.cuh"

// With TMA (flash_prefill_k…: sm_90 and later), K and V tiles come by TMA as boxes of TILE keys ×
// 64 dims in the 128-byte swizzle (chunk c of row r at r·128 + ((c ^ r % 8) · 16): conflict-free
// ldmatrix without padding; keys past n are zero-filled by the copy), issued by one thread and
// waited for on a shared-memory barrier per stage, which frees the load/store pipe that cp.async
// shares with ldmatrix. A second barrier per stage counts the warps done with it, so no
// block-wide barrier is left in the loop: warps with less causal work run ahead.
// The shared memory of flash_prefill_k, as byte offsets from the (TMA: 1024-aligned) base: Q,
// the K stages, the V stages, then (TMA) two barriers per stage. BYTES (with TMA's 1 KB of
// alignment slack) is checked against the variant's row in variants.cuh.
template <int ROWS, int TILE, int STAGES, int DQK, int DV, bool TMA> struct PrefillSmem {
    static constexpr unsigned K_STAGE = TMA ? TILE * DQK * 2 : TILE * (DQK + 8) * 2;
    static constexpr unsigned V_STAGE = TMA ? TILE * DV * 2 : TILE * (DV + 8) * 2;
    static constexpr unsigned Q = 0;
    static constexpr unsigned K = Q + ROWS * (DQK + 8) * 2;  // a multiple of 1024 for the TMA shapes
    static constexpr unsigned V = K + STAGES * K_STAGE;
    static constexpr unsigned BARS = V + STAGES * V_STAGE;
    static constexpr unsigned BYTES = BARS + (TMA ? 2 * STAGES * 8 + 1024 : 0);
};

template <int ROWS, int TILE, int STAGES, int DQK, int DV, bool TMA = false>
__device__ void flash_prefill_k(const bf16_t* q, const bf16_t* k, const bf16_t* v, bf16_t* out, float* lse, int n,
                                int heads, float scale_log2, int v_drift, const TmaMap* k_map = nullptr,
                                const TmaMap* v_map = nullptr) {
    constexpr int THREADS = ROWS * 2;  // ROWS / 16 warps
    constexpr int SQ = DQK + 8, SV = DV + 8;
    constexpr int NT = TILE / 8;
    constexpr int QC = DQK / 8, VC = DV / 8;  // 16-byte chunks per row
    constexpr int BOX = TILE * 128;           // one TMA box: TILE keys × 64 dims
    using L = PrefillSmem<ROWS, TILE, STAGES, DQK, DV, TMA>;
    constexpr int K_BYTES = L::K_STAGE, V_BYTES = L::V_STAGE;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // The swizzled TMA stages need 1024-byte alignment; the host gives 1 KB of slack for it.
    unsigned char* smem = TMA ? smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023) : smem_raw;
    const unsigned sQ = smem_addr(smem) + L::Q;
    const unsigned sK = smem_addr(smem) + L::K;
    const unsigned sV = smem_addr(smem) + L::V;
    const unsigned mbar = smem_addr(smem) + L::BARS;  // [STAGES] copies landed, [STAGES] stage released

    const LongestFirst block = longest_first();
    const int q0 = block.q_tile * ROWS, h = block.head;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, qd = lane % 4, mi = lane / 8;
    const u64 kstride = (u64)heads * DQK, vstride = (u64)heads * DV;
    const int kv_end = min(n, q0 + ROWS);
    const int row0 = q0 + warp * 16;

    if (TMA) {
        if (threadIdx.x == 0) {
            for (int st = 0; st < STAGES; st++) {
                mbar_init(mbar + 8 * st, 1);
                mbar_init(mbar + 8 * (STAGES + st), THREADS / 32);
            }
            mbar_init_fence();
        }
        __syncthreads();
    }
    const bf16_t* qh = q + (u64)h * DQK;
    for (int c = threadIdx.x; c < ROWS * QC; c += THREADS) {
        int r = c / QC, d = (c % QC) * 8;
        if (q0 + r < n)
            cp_async16(sQ + (r * SQ + d) * 2, qh + (u64)(q0 + r) * kstride + d);
        else
            st_shared_zero16(sQ + (r * SQ + d) * 2);
    }
    cp_async_commit();

    const bf16_t* kh = k + (u64)h * DQK;
    const bf16_t* vh = v + (u64)h * DV;
    // FAULT kv-stride-mismatch (v_drift; 0 in every real run): the value loop steps its tiles by
    // the keys' row width (DQK) where the values' (DV) belongs, so from the second tile on the
    // values come from later rows than the keys (no drift when DQK = DV; rows past n read as 0).
    auto load_kv = [&](int t0, int stage) {
        const int tv = v_drift ? t0 * DQK / DV : t0;
        if (TMA) {  // by one thread; the fence orders earlier generic reads of the stage first
            if (threadIdx.x == 0) {
                const unsigned mb = mbar + 8 * stage;
                fence_proxy_async();
                mbar_expect_bytes(mb, K_BYTES + V_BYTES);
#pragma unroll
                for (int c = 0; c < DQK / 64; c++) tma_load_3d(sK + stage * K_BYTES + c * BOX, k_map, mb, c * 64, h, t0);
#pragma unroll
                for (int c = 0; c < DV / 64; c++) tma_load_3d(sV + stage * V_BYTES + c * BOX, v_map, mb, c * 64, h, tv);
            }
            return;
        }
        const unsigned dk = sK + stage * K_BYTES, dv = sV + stage * V_BYTES;
#pragma unroll
        for (int i = 0; i < (TILE * QC + THREADS - 1) / THREADS; i++) {
            int c = threadIdx.x + i * THREADS;
            if (c < TILE * QC) {
                int r = c / QC, d = (c % QC) * 8;
                if (t0 + r < kv_end)
                    cp_async16(dk + (r * SQ + d) * 2, kh + (u64)(t0 + r) * kstride + d);
                else
                    st_shared_zero16(dk + (r * SQ + d) * 2);
            }
        }
#pragma unroll
        for (int i = 0; i < (TILE * VC + THREADS - 1) / THREADS; i++) {
            int c = threadIdx.x + i * THREADS;
            if (c < TILE * VC) {
                int r = c / VC, d = (c % VC) * 8;
                if (t0 + r < kv_end && tv + r < n)
                    cp_async16(dv + (r * SV + d) * 2, vh + (u64)(tv + r) * vstride + d);
                else
                    st_shared_zero16(dv + (r * SV + d) * 2);
            }
        }
        cp_async_commit();
    };

    // Per-lane ldmatrix offsets (bytes).
    const unsigned q_lane = sQ + ((warp * 16 + (mi % 2) * 8 + lane % 8) * SQ + (mi / 2) * 8) * 2;
    const unsigned k_lane = (((mi / 2) * 8 + lane % 8) * SQ + (mi % 2) * 8) * 2;
    const unsigned v_lane = (((mi % 2) * 8 + lane % 8) * SV + (mi / 2) * 8) * 2;
    // With TMA: K rows nt·8 + (mi/2)·8 + lane%8, chunk 2·kk + mi%2; V rows ks·16 + (mi%2)·8 +
    // lane%8, chunk nt + mi/2; each chunk swizzled with the row's lane % 8.
    const int sw = lane & 7;
    auto k_addr = [&](unsigned kbase, int nt, int kk) {
        if (!TMA) return kbase + k_lane + (nt * 8 * SQ + kk * 16) * 2;
        const int c = 2 * kk + mi % 2;
        return kbase + (c / 8) * BOX + (nt * 8 + (mi / 2) * 8 + lane % 8) * 128 + (((c & 7) ^ sw) << 4);
    };
    auto v_addr = [&](unsigned vbase, int ks, int nt) {
        if (!TMA) return vbase + v_lane + (ks * 16 * SV + nt * 8) * 2;
        const int c = nt + mi / 2;
        return vbase + (c / 8) * BOX + (ks * 16 + (mi % 2) * 8 + lane % 8) * 128 + (((c & 7) ^ sw) << 4);
    };

    float o[DV / 8][4];
#pragma unroll
    for (int i = 0; i < DV / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    // Running maxima of the raw scores (unscaled), and running sums.
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.0f, 0.0f};

    load_kv(0, 0);
    if (TMA) cp_async_wait<0>();  // Q (the only cp.async group)
    int stage = 0;
    for (int t0 = 0; t0 < kv_end; t0 += TILE) {
        if (TMA) {
            const int j = t0 / TILE;
            if (STAGES == 2 && t0 + TILE < kv_end) {
                // Tile j + 1 into the stage of tile j − 1 once every warp has released it.
                if (threadIdx.x == 0 && j >= 1) mbar_wait(mbar + 8 * (STAGES + (stage ^ 1)), ((j - 1) / 2) & 1);
                load_kv(t0 + TILE, stage ^ 1);
            }
            mbar_wait(mbar + 8 * stage, (j / STAGES) & 1);
            if (j == 0) __syncthreads();  // every thread's part of Q
        } else {
            if (STAGES == 2 && t0 + TILE < kv_end) {
                load_kv(t0 + TILE, stage ^ 1);
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
        }
        const unsigned kt = sK + stage * K_BYTES;
        const unsigned vt = sV + stage * V_BYTES;

        if (t0 <= row0 + 15) {  // warp-uniform: some of this warp's rows see keys of the tile
            float s[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < DQK / 16; kk++) {
                unsigned a[4];
                ldsm_x4(a, q_lane + kk * 32);
#pragma unroll
                for (int nt = 0; nt < NT; nt += 2) {
                    unsigned bb[4];
                    ldsm_x4(bb, k_addr(kt, nt, kk));
                    mma_bf16(s[nt], a, bb);
                    mma_bf16(s[nt + 1], a, bb + 2);
                }
            }
            unsigned pa[TILE / 16][4];
            // Mask (causal, and keys past n) only on tiles that cross the diagonal or the end.
            if (t0 + TILE - 1 > row0 || t0 + TILE > n) {
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int tok = t0 + nt * 8 + qd * 2 + (e % 2);
                        int row = row0 + g + (e / 2) * 8;
                        if (tok > row || tok >= n) s[nt][e] = -INFINITY;
                    }
            }
            // Online softmax with a lazy maximum: the running maximum (and the rescaling of O
            // and the sums) moves only when some row of the warp grows by more than 2^8, so most
            // tiles skip the rescale; P then stays below 2^8, well inside f32 and bf16.
            float tile_max[2];
            bool grow = false;
#pragma unroll
            for (int r = 0; r < 2; r++) {
                float t = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < NT; nt++) t = fmaxf(t, fmaxf(s[nt][r * 2], s[nt][r * 2 + 1]));
                t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, 1));
                t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, 2));
                tile_max[r] = t;
                grow |= (t - m_run[r]) * scale_log2 > 8.0f;
            }
            if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    float m_new = fmaxf(m_run[r], tile_max[r]);
                    float alpha = m_new == -INFINITY ? 1.0f : fast_exp2((m_run[r] - m_new) * scale_log2);
                    l_run[r] *= alpha;
                    m_run[r] = m_new;
#pragma unroll
                    for (int nt = 0; nt < DV / 8; nt++) {
                        o[nt][r * 2] *= alpha;
                        o[nt][r * 2 + 1] *= alpha;
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < 2; r++) {
                // exp2(s·scale − m·scale) as one FMA and one ex2 per score.
                float m_scaled = m_run[r] == -INFINITY ? 0.0f : m_run[r] * scale_log2;
                float sum = 0.0f;
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    float p0 = fast_exp2(fmaf(s[nt][r * 2], scale_log2, -m_scaled));
                    float p1 = fast_exp2(fmaf(s[nt][r * 2 + 1], scale_log2, -m_scaled));
                    sum += p0 + p1;
                    // P as bf16 pairs, laid out as the A fragments of P·V: the S accumulators
                    // of n-tiles 2j and 2j+1 are k-step j (rows g: regs 0 and 2; g+8: 1 and 3).
                    pa[nt / 2][(nt % 2) * 2 + r] = pack_bf16(p0, p1);
                }
                l_run[r] += sum;  // per-lane partial sums; reduced at the end
            }
            // O += P·V.
#pragma unroll
            for (int ks = 0; ks < TILE / 16; ks++) {
#pragma unroll
                for (int nt = 0; nt < DV / 8; nt += 2) {
                    unsigned bb[4];
                    ldsm_x4_trans(bb, v_addr(vt, ks, nt));
                    mma_bf16(o[nt], pa[ks], bb);
                    mma_bf16(o[nt + 1], pa[ks], bb + 2);
                }
            }
        }
        if (TMA) {
            __syncwarp();
            if (lane == 0) mbar_arrive(mbar + 8 * (STAGES + stage));  // this warp is done with the stage
        } else {
            __syncthreads();  // the stage is free for the next load
        }
        stage ^= (STAGES - 1);
        if (STAGES == 1 && t0 + TILE < kv_end) load_kv(t0 + TILE, 0);
    }

#pragma unroll
    for (int r = 0; r < 2; r++) {
        float l = l_run[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        int row = row0 + g + r * 8;
        if (row >= n) continue;
        float inv = l > 0.0f ? 1.0f / l : 0.0f;
        bf16_t* dst = out + ((u64)row * heads + h) * DV;
#pragma unroll
        for (int nt = 0; nt < DV / 8; nt++)
            *(unsigned*)(dst + nt * 8 + qd * 2) = pack_bf16(o[nt][r * 2] * inv, o[nt][r * 2 + 1] * inv);
        if (qd == 0 && lse)
            lse[(u64)row * heads + h] = l > 0.0f ? (m_run[r] * scale_log2 + log2f(l)) * 0.6931471805599453f : -INFINITY;
    }
}

// Shapes of block for the shared-memory budgets: 128 rows with 64-key tiles in two stages
// (about 198 KB: Hopper, B200), 64 rows with 64-key tiles in one stage (99 KB, two blocks per
// Hopper multiprocessor), 128 rows with 32-key tiles (about 132 KB: A100), 64 rows with 32-key
// tiles in one stage (about 66 KB: sm_86/89 and sm_120, which allow 99 KB per block).
// NAME##_v, its row in variants.cuh, gives the rows, tile and stages; the layout must add up to
// its bytes.
#define PREFILL_ARGS(V) V.rows, V.tile, V.stages
#define CHECK_PREFILL(V, DQK, DV, TMA)                                                                        \
    static_assert(PrefillSmem<PREFILL_ARGS(V), DQK, DV, TMA>::BYTES == V.shared, #V ": variants.cuh and the layout differ");
#define FLASH_PREFILL(NAME, DQK, DV)                                                                          \
    CHECK_PREFILL(NAME##_v, DQK, DV, false)                                                                  \
    extern "C" __global__ void __launch_bounds__(NAME##_v.rows * 2, 1) NAME(const bf16_t* q, const bf16_t* k, \
                                                                          const bf16_t* v, bf16_t* out,     \
                                                                          float* lse, int n, int heads,     \
                                                                          float scale_log2, int v_drift) {  \
        flash_prefill_k<PREFILL_ARGS(NAME##_v), DQK, DV>(q, k, v, out, lse, n, heads, scale_log2, v_drift);  \
    }

FLASH_PREFILL(flash_prefill_r128t64_d256, 256, 256)
FLASH_PREFILL(flash_prefill_r64t64_d256, 256, 256)
FLASH_PREFILL(flash_prefill_r128t32_d256, 256, 256)
FLASH_PREFILL(flash_prefill_r64t32_d256, 256, 256)
FLASH_PREFILL(flash_prefill_r128t64_d192, 192, 128)
FLASH_PREFILL(flash_prefill_r64t64_d192, 192, 128)
FLASH_PREFILL(flash_prefill_r128t32_d192, 192, 128)
FLASH_PREFILL(flash_prefill_r64t32_d192, 192, 128)

// The variants fed by TMA (sm_90 and later; a trap below, never launched there).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define TMA_BODY(V, DQK, DV) \
    flash_prefill_k<PREFILL_ARGS(V), DQK, DV, true>(q, k, v, out, lse, n, heads, scale_log2, v_drift, &k_map, &v_map);
#else
#define TMA_BODY(V, DQK, DV) __trap();
#endif
#define FLASH_PREFILL_TMA(NAME, DQK, DV)                                                                         \
    CHECK_PREFILL(NAME##_v, DQK, DV, true)                                                                      \
    extern "C" __global__ void __launch_bounds__(NAME##_v.rows * 2, 1) NAME(const __grid_constant__ TmaMap k_map, \
                                                                          const __grid_constant__ TmaMap v_map, \
                                                                          const bf16_t* q, const bf16_t* k,     \
                                                                          const bf16_t* v, bf16_t* out,         \
                                                                          float* lse, int n, int heads,         \
                                                                          float scale_log2, int v_drift) {      \
        TMA_BODY(NAME##_v, DQK, DV)                                                                              \
    }

FLASH_PREFILL_TMA(flash_prefill_k128t64_d256, 256, 256)
FLASH_PREFILL_TMA(flash_prefill_k128t64_d192, 192, 128)
// For 99 KB blocks (sm_120): 64 rows, 32-key tiles in two stages (about 98 KB).
FLASH_PREFILL_TMA(flash_prefill_k64t32_d256, 256, 256)
FLASH_PREFILL_TMA(flash_prefill_k64t32_d192, 192, 128)
