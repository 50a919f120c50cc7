// MLA prefill on tensor cores: causal flash attention over the decompressed K/V (the path the
// MLA papers run for prompts: q·k over nope+rope dims, softmax, ·v), tiled with an online softmax
// in the FlashAttention-2 manner, written with mma.sync/ldmatrix/cp.async only so that it runs on
// every architecture from sm_80 (Blackwell sm_120 included).
//
// q, k: [n, heads, DQK] bf16; v: [n, heads, DV] bf16; out: [n, heads, DV] bf16, lse: [n, heads]
// f32 (natural log). Block = (tile of ROWS queries, head), ROWS/16 warps, each warp owning 16
// query rows and every key of the KV tile, so the softmax needs no cross-warp exchange and P goes
// from the S accumulators straight into the A operand of P·V. Query tiles run longest-first.
#include "common.cuh"
#include "mma.cuh"

template <int ROWS, int TILE, int STAGES, int DQK, int DV>
__device__ void flash_prefill_k(const bf16_t* q, const bf16_t* k, const bf16_t* v, bf16_t* out, float* lse, int n,
                                int heads, float scale_log2) {
    constexpr int THREADS = ROWS * 2;  // ROWS / 16 warps
    constexpr int SQ = DQK + 8, SV = DV + 8;
    constexpr int NT = TILE / 8;
    constexpr int QC = DQK / 8, VC = DV / 8;  // 16-byte chunks per row
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned sQ = smem_addr(smem);
    const unsigned sK = sQ + ROWS * SQ * 2;
    const unsigned sV = sK + STAGES * TILE * SQ * 2;

    const int q0 = (gridDim.x - 1 - blockIdx.x) * ROWS, h = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, qd = lane % 4, mi = lane / 8;
    const u64 kstride = (u64)heads * DQK, vstride = (u64)heads * DV;
    const int kv_end = min(n, q0 + ROWS);
    const int row0 = q0 + warp * 16;

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
    auto load_kv = [&](int t0, int stage) {
        const unsigned dk = sK + stage * TILE * SQ * 2, dv = sV + stage * TILE * SV * 2;
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
                if (t0 + r < kv_end)
                    cp_async16(dv + (r * SV + d) * 2, vh + (u64)(t0 + r) * vstride + d);
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

    float o[DV / 8][4];
#pragma unroll
    for (int i = 0; i < DV / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    // Running maxima of the raw scores (unscaled), and running sums.
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.0f, 0.0f};

    load_kv(0, 0);
    int stage = 0;
    for (int t0 = 0; t0 < kv_end; t0 += TILE) {
        if (STAGES == 2 && t0 + TILE < kv_end) {
            load_kv(t0 + TILE, stage ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const unsigned kt = sK + stage * TILE * SQ * 2 + k_lane;
        const unsigned vt = sV + stage * TILE * SV * 2 + v_lane;

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
                    ldsm_x4(bb, kt + (nt * 8 * SQ + kk * 16) * 2);
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
                    ldsm_x4_trans(bb, vt + (ks * 16 * SV + nt * 8) * 2);
                    mma_bf16(o[nt], pa[ks], bb);
                    mma_bf16(o[nt + 1], pa[ks], bb + 2);
                }
            }
        }
        __syncthreads();  // the stage is free for the next load
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
#define FLASH_PREFILL(NAME, ROWS, TILE, STAGES, DQK, DV)                                                        \
    extern "C" __global__ void __launch_bounds__(ROWS * 2, 1) NAME(const bf16_t* q, const bf16_t* k,           \
                                                                   const bf16_t* v, bf16_t* out, float* lse,   \
                                                                   int n, int heads, float scale_log2) {       \
        flash_prefill_k<ROWS, TILE, STAGES, DQK, DV>(q, k, v, out, lse, n, heads, scale_log2);                \
    }

FLASH_PREFILL(flash_prefill_r128t64_d256, 128, 64, 2, 256, 256)
FLASH_PREFILL(flash_prefill_r64t64_d256, 64, 64, 1, 256, 256)
FLASH_PREFILL(flash_prefill_r128t32_d256, 128, 32, 2, 256, 256)
FLASH_PREFILL(flash_prefill_r64t32_d256, 64, 32, 1, 256, 256)
FLASH_PREFILL(flash_prefill_r128t64_d192, 128, 64, 2, 192, 128)
FLASH_PREFILL(flash_prefill_r64t64_d192, 64, 64, 1, 192, 128)
FLASH_PREFILL(flash_prefill_r128t32_d192, 128, 32, 2, 192, 128)
FLASH_PREFILL(flash_prefill_r64t32_d192, 64, 32, 1, 192, 128)
