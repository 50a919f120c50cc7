// MLA decode on tensor cores: absorbed attention of one query token per sequence over the paged
// latent cache (rows of 512 c_kv + 64 k_pe in bf16), split-KV with a log-sum-exp merge, as
// FlashMLA and vLLM's Triton decode kernel do it, written with mma.sync/ldmatrix/cp.async only
// so that it runs on every architecture from sm_80 (Blackwell sm_120 included).
//
// Variants: mla_decode_ks3/ks2 (mla_decode_splitk.cu; Hopper, B200) split the work so that far less shared
// memory is read per tile; mla_decode_t32/t16 (A100; 99 KB parts such as sm_86/89) follow, and
// sm_120 (99 KB with TMA) runs mla_decode_kt16 there, 32 heads a block.
// Block = (split, sequence, group of 64 heads), 8 warps. Any head count runs (a tensor-parallel
// rank holds 64/TP or 128/TP heads): the last group's rows past the last head are padding, zero
// queries in shared memory whose results are never written, since in the outputs those rows
// belong to the next sequence or split. The 64×576 query block stays in shared memory; KV tiles
// of TILE tokens stream through (double-buffered with cp.async when STAGES = 2).
// Warp w owns heads 16·(w%4).. of the block and, for S = Q·Kᵀ, tokens of half (w/4) of the tile;
// for O += P·V, output dims of half (w/4). Softmax runs in base 2 on the fly (online softmax);
// each split writes its normalised output (bf16) and natural-log LSE (f32), and
// mla_decode_combine weighs the splits by exp(lse_split − lse_total), summing in f32.
//
// The sparse twins (mla_sparse_t32/t16 here, mla_sparse_ks3/ks2 in mla_decode_splitk.cu: what
// GLM-5 runs over the DSA indexer's top-k) are the same templates with SPARSE set: sequence b
// attends to the keys indices[b, 0..lens[b]] (token positions, mapped to cache rows through its
// block-table row; -1 is padding, anywhere in the list), the splits divide the list, and each
// tile is gathered row by row, its rows looked up tiles ahead (sparse.cuh). Padding and entries
// past the split's end get zeroed rows AND scores of -inf; a sequence whose entries are all
// padding ends with l = 0, i.e. zeros and an LSE of -inf, like an empty split.
#include "common.cuh"
#include "mma.cuh"
#include "tma.cuh"
#include "kv_fp8.cuh"
#include "sparse.cuh"
#include "variants.cuh"

#define HEADS 64
#define DQK 576
#define DV 512
#define STRIDE 584   // shared row stride in bf16: 1168 bytes shifts rows by 4 banks
#define PAGE 64
#define THREADS 256
#define NT_OF(TILE) ((TILE) / 2 / 8)

// The shared memory of mla_decode_k, as byte offsets: Q, the KV stages, P, the maxima and sums
// ([2][HEADS] each, and HEADS floats spare), then (SPARSE) the ring of row lookups. BYTES is
// checked against the variant's row in variants.cuh.
template <int TILE, int STAGES, bool SPARSE> struct TiledSmem {
    static constexpr unsigned Q = 0;
    static constexpr unsigned KV = Q + HEADS * STRIDE * 2;
    static constexpr unsigned P = KV + STAGES * TILE * STRIDE * 2;
    static constexpr unsigned SUMS = P + HEADS * (TILE + 8) * 2;
    static constexpr unsigned RING = SUMS + 5 * HEADS * 4;
    static constexpr unsigned BYTES = RING + (SPARSE ? SPARSE_RING_BYTES(TILE) : 0);
};

template <int TILE, int STAGES, bool SPARSE, bool FP8 = false, bool WRAP32 = false>
__device__ void mla_decode_k(const bf16_t* q, const bf16_t* cache, const int* block_table, int max_pages,
                             const int* indices, int topk, const int* seq_lens, float scale_log2, bf16_t* part_o, float* part_lse, int splits,
                             int total_heads, bf16_t* out, float* lse_out) {
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int PSTRIDE = TILE + 8;
    constexpr int CHUNKS = DQK / 8;  // 16-byte chunks per row
    using L = TiledSmem<TILE, STAGES, SPARSE>;
    bf16_t* sQ = (bf16_t*)(smem + L::Q);
    bf16_t* sKV = (bf16_t*)(smem + L::KV);
    bf16_t* sP = (bf16_t*)(smem + L::P);
    float* sMax = (float*)(smem + L::SUMS);  // [2][HEADS]
    float* sSum = sMax + 2 * HEADS;          // [2][HEADS]
    int* ring = (int*)(smem + L::RING);      // SPARSE: the row lookups (sparse.cuh)
    const unsigned sQ_a = smem_addr(sQ), sKV_a = smem_addr(sKV), sP_a = smem_addr(sP);

    const int split = blockIdx.x, b = blockIdx.y, head0 = blockIdx.z * HEADS;
    const int heads_here = min(HEADS, total_heads - head0);  // the rest of the group is padding
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int mt = warp % 4, half = warp / 4;
    const int g = lane / 4, qd = lane % 4, mi = lane / 8;
    let_dependents_launch();  // the merge may take its place now; it waits for our end
    const DecodeSplit range = decode_split(seq_lens[b], splits, split, TILE);
    const int t_begin = range.begin, t_end = range.end;
    const u64 out_row = ((u64)b * splits + split) * total_heads + head0;

    if (t_begin >= t_end) {  // an empty split (or sequence): nothing to attend to
        decode_empty_split(heads_here, DV, splits, (u64)b * total_heads + head0, out_row, out, lse_out, part_o, part_lse);
        return;
    }

    // The query block; padding rows are zeros (never read past the last head of q).
    const bf16_t* qb = q + ((u64)b * total_heads + head0) * DQK;
    load_rows_zero_padded<HEADS, DQK, STRIDE, THREADS>(sQ_a, qb, heads_here);

    // One tile of TILE tokens. Tiles start at multiples of TILE (which divides PAGE), so a tile
    // lies in one page: one block-table lookup per tile. Rows past the end are zeroed.
    const int* bt = block_table + (u64)b * max_pages;
    const int* list = SPARSE ? indices + (u64)b * topk : nullptr;
    // Issuing tile j, the groups up to tile j − LAG are complete and behind a barrier: STAGES = 2
    // issues a tile before waiting for the one before it, STAGES = 1 after.
    constexpr int LAG = STAGES;
    if constexpr (SPARSE) {
        if (warp == 0) sparse_ring_start<TILE, LAG>(ring, list, bt, t_begin, t_end, lane);
        __syncthreads();
    }
    auto load_tile = [&](int t0, int stage) {
        if constexpr (SPARSE) {
            // Lane r < TILE of each warp reads the row of entry t0 + r; a chunk takes it by shuffle.
            const int mine = sparse_ring_row<TILE>(ring, t0, lane);
            const unsigned dst = sKV_a + stage * TILE * STRIDE * 2;
#pragma unroll
            for (int i = 0; i < (TILE * CHUNKS + THREADS - 1) / THREADS; i++) {
                int c = threadIdx.x + i * THREADS;
                int r = c / CHUNKS, k = (c % CHUNKS) * 8;
                const int row = __shfl_sync(0xffffffffu, mine, r % 32);
                if (c < TILE * CHUNKS) {
                    if (row >= 0)
                        cp_async16(dst + (r * STRIDE + k) * 2, cache + (u64)row * DQK + k);
                    else
                        st_shared_zero16(dst + (r * STRIDE + k) * 2);
                }
            }
            if (warp == 0) sparse_ring_ahead<TILE, LAG>(ring, list, bt, t0, t_end, lane);
            cp_async_commit();
            return;
        }
        if (FP8) {  // an fp8_ds_mla cache: rows of 656 bytes, raw into the stage (kv_fp8.cuh)
            fp8_issue_tile<TILE, STRIDE, THREADS>(sKV_a + stage * TILE * STRIDE * 2, (const unsigned char*)cache,
                                                  (u64)bt[t0 / PAGE] * PAGE + t0 % PAGE, t_end - t0);
            cp_async_commit();
            return;
        }
        const bf16_t* src = cache + paged_row<WRAP32>(bt[t0 / PAGE], t0 % PAGE, DQK);  // WRAP32: see common.cuh
        const unsigned dst = sKV_a + stage * TILE * STRIDE * 2;
#pragma unroll
        for (int i = 0; i < (TILE * CHUNKS + THREADS - 1) / THREADS; i++) {
            int c = threadIdx.x + i * THREADS;
            if (c < TILE * CHUNKS) {
                int r = c / CHUNKS, k = (c % CHUNKS) * 8;
                if (t0 + r < t_end)
                    cp_async16(dst + (r * STRIDE + k) * 2, src + r * DQK + k);
                else
                    st_shared_zero16(dst + (r * STRIDE + k) * 2);
            }
        }
        cp_async_commit();
    };

    // Per-lane ldmatrix offsets (bytes): A rows of this warp's 16 heads, B rows of its tokens.
    const unsigned q_lane = sQ_a + ((mt * 16 + (mi % 2) * 8 + lane % 8) * STRIDE + (mi / 2) * 8) * 2;
    const int tok_base = half * (TILE / 2);
    const unsigned k_lane = (((NT_OF(TILE) == 2 ? (mi / 2) * 8 : 0) + tok_base + lane % 8) * STRIDE +
                             (NT_OF(TILE) == 2 ? (mi % 2) * 8 : ((lane / 8) % 2) * 8)) * 2;
    const unsigned p_lane = sP_a + ((mt * 16 + (mi % 2) * 8 + lane % 8) * PSTRIDE + (mi / 2) * 8) * 2;
    const unsigned v_lane = (((mi % 2) * 8 + lane % 8) * STRIDE + half * (DV / 2) + (mi / 2) * 8) * 2;

    float o[DV / 2 / 8][4];
#pragma unroll
    for (int i = 0; i < DV / 2 / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.0f, 0.0f};
    constexpr int NT = NT_OF(TILE);  // n-tiles of 8 tokens per warp in S

    load_tile(t_begin, 0);
    int stage = 0;
    for (int t0 = t_begin; t0 < t_end; t0 += TILE) {
        if (STAGES == 2 && t0 + TILE < t_end) {
            load_tile(t0 + TILE, stage ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if constexpr (FP8) {  // the landed raw rows to bf16, in place (kv_fp8.cuh)
            fp8_expand_tile<TILE, STRIDE, THREADS>(sKV_a + stage * TILE * STRIDE * 2, t_end - t0);
            __syncthreads();
        }
        const unsigned kv = sKV_a + stage * TILE * STRIDE * 2;
        // Which of this thread's tokens of S are keys (bit 2·nt + j); loaded ahead of the mma.
        unsigned keys = ~0u;
        if constexpr (SPARSE) {
            keys = 0;
#pragma unroll
            for (int nt = 0; nt < NT; nt++) keys |= sparse_keys(list, t0 + tok_base + nt * 8 + qd * 2, t_end, 2) << (2 * nt);
        }

        // S = Q·Kᵀ for 16 heads × TILE/2 tokens; even and odd k-steps in separate accumulators
        // so that two independent chains of mma hide each other's latency.
        float s[NT][4], s2[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[nt][e] = s2[nt][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < DQK / 16; kk++) {
            unsigned a[4];
            ldsm_x4(a, q_lane + kk * 32);
            unsigned bb[4];
            if (NT == 2)
                ldsm_x4(bb, kv + k_lane + kk * 32);
            else
                ldsm_x2(bb, kv + k_lane + kk * 32);
            if (kk % 2 == 0) {
                mma_bf16(s[0], a, bb);
                if (NT == 2) mma_bf16(s[NT - 1], a, bb + 2);
            } else {
                mma_bf16(s2[0], a, bb);
                if (NT == 2) mma_bf16(s2[NT - 1], a, bb + 2);
            }
        }

        // Online softmax in base 2: rows g and g+8 of this warp's 16 heads.
        float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int tok = t0 + tok_base + nt * 8 + qd * 2 + (e % 2);
                float v = tok < t_end && (keys >> (2 * nt + e % 2) & 1u) ? (s[nt][e] + s2[nt][e]) * scale_log2 : -INFINITY;
                s[nt][e] = v;
                tile_max[e / 2] = fmaxf(tile_max[e / 2], v);
            }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
            if (qd == 0) sMax[half * HEADS + mt * 16 + g + r * 8] = tile_max[r];
        }
        __syncthreads();
        // A lazy running maximum: it (and the rescale of O and the sums) moves only when a row
        // of the warp grows by more than 2^8. Both warps of a head group read the same maxima
        // and history, so they decide alike and write P against the same reference.
        float m_tile[2];
        bool grow = false;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            int row = mt * 16 + g + r * 8;
            m_tile[r] = fmaxf(sMax[row], sMax[HEADS + row]);
            grow |= m_tile[r] - m_run[r] > 8.0f;
        }
        if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const float alpha = raise_max(m_run[r], m_tile[r]);
                l_run[r] *= alpha;
#pragma unroll
                for (int nt = 0; nt < DV / 2 / 8; nt++) {
                    o[nt][r * 2] *= alpha;
                    o[nt][r * 2 + 1] *= alpha;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float m_use = m_run[r] == -INFINITY ? 0.0f : m_run[r];
            float sum = 0.0f;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = r * 2; e < r * 2 + 2; e++) {
                    float p = fast_exp2(s[nt][e] - m_use);
                    s[nt][e] = p;
                    sum += p;
                }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            l_run[r] += sum;
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            int col = tok_base + nt * 8 + qd * 2;
            *(unsigned*)(sP + (mt * 16 + g) * PSTRIDE + col) = pack_bf16(s[nt][0], s[nt][1]);
            *(unsigned*)(sP + (mt * 16 + g + 8) * PSTRIDE + col) = pack_bf16(s[nt][2], s[nt][3]);
        }
        __syncthreads();

        // O += P·V for 16 heads × DV/2 dims; V is the first DV columns of the tile.
#pragma unroll
        for (int ks = 0; ks < TILE / 16; ks++) {
            unsigned a[4];
            ldsm_x4(a, p_lane + ks * 32);
#pragma unroll
            for (int nt = 0; nt < DV / 2 / 8; nt += 2) {
                unsigned bb[4];
                ldsm_x4_trans(bb, kv + v_lane + (ks * 16 * STRIDE + nt * 8) * 2);
                mma_bf16(o[nt], a, bb);
                mma_bf16(o[nt + 1], a, bb + 2);
            }
        }
        __syncthreads();  // the tile and P are free for the next round
        stage ^= (STAGES - 1);
        if (STAGES == 1 && t0 + TILE < t_end) load_tile(t0 + TILE, 0);
    }

    // Both halves' sums per row, then the normalised output and the natural-log LSE.
#pragma unroll
    for (int r = 0; r < 2; r++)
        if (qd == 0) sSum[half * HEADS + mt * 16 + g + r * 8] = l_run[r];
    __syncthreads();
    float l0 = sSum[mt * 16 + g] + sSum[HEADS + mt * 16 + g];
    float l1 = sSum[mt * 16 + g + 8] + sSum[HEADS + mt * 16 + g + 8];
    float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    const float ln2 = 0.6931471805599453f;
    const float lse0 = l0 > 0.0f ? (m_run[0] + log2f(l0)) * ln2 : -INFINITY;
    const float lse1 = l1 > 0.0f ? (m_run[1] + log2f(l1)) * ln2 : -INFINITY;
    // This thread's two rows of the block; padding rows are not written.
    const bool own0 = mt * 16 + g < heads_here, own1 = mt * 16 + g + 8 < heads_here;
    if (splits == 1) {
        // One split: this is the final result (no merge pass).
        const u64 row = (u64)b * total_heads + head0 + mt * 16 + g;
#pragma unroll
        for (int nt = 0; nt < DV / 2 / 8; nt++) {
            int dim = half * (DV / 2) + nt * 8 + qd * 2;
            if (own0) *(unsigned*)(out + row * DV + dim) = pack_bf16(o[nt][0] * inv0, o[nt][1] * inv0);
            if (own1) *(unsigned*)(out + (row + 8) * DV + dim) = pack_bf16(o[nt][2] * inv1, o[nt][3] * inv1);
        }
        if (qd == 0 && half == 0) {
            if (own0) lse_out[row] = lse0;
            if (own1) lse_out[row + 8] = lse1;
        }
        return;
    }
#pragma unroll
    for (int nt = 0; nt < DV / 2 / 8; nt++) {
        int dim = half * (DV / 2) + nt * 8 + qd * 2;
        if (own0)
            *(unsigned*)(part_o + (out_row + mt * 16 + g) * DV + dim) = pack_bf16(o[nt][0] * inv0, o[nt][1] * inv0);
        if (own1)
            *(unsigned*)(part_o + (out_row + mt * 16 + g + 8) * DV + dim) = pack_bf16(o[nt][2] * inv1, o[nt][3] * inv1);
    }
    if (qd == 0 && half == 0) {
        if (own0) part_lse[out_row + mt * 16 + g] = lse0;
        if (own1) part_lse[out_row + mt * 16 + g + 8] = lse1;
    }
}

// Each entry point's template arguments come from its row in variants.cuh; its layout must add
// up to the row's bytes.
#define CHECK_TILED(V, SPARSE) \
    static_assert(V.rows == HEADS && TiledSmem<V.tile, V.stages, SPARSE>::BYTES == V.shared, #V ": variants.cuh and the layout differ");
CHECK_TILED(mla_decode_t32_v, false)
CHECK_TILED(mla_decode_t16_v, false)
CHECK_TILED(mla_sparse_t32_v, true)
CHECK_TILED(mla_sparse_t16_v, true)
CHECK_TILED(mla_decode_fp8_t32_v, false)
CHECK_TILED(mla_decode_fp8_t16_v, false)
CHECK_TILED(mla_decode_t16_o32_v, false)

extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_t32(const bf16_t* q, const bf16_t* cache, const int* bt, int max_pages, const int* lens, float scale_log2,
               bf16_t* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_k<mla_decode_t32_v.tile, mla_decode_t32_v.stages, false>(q, cache, bt, max_pages, nullptr, 0, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_t16(const bf16_t* q, const bf16_t* cache, const int* bt, int max_pages, const int* lens, float scale_log2,
               bf16_t* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_k<mla_decode_t16_v.tile, mla_decode_t16_v.stages, false>(q, cache, bt, max_pages, nullptr, 0, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

// mla_decode_t16 with the page-index-overflow fault planted (see mla_decode_ks3_o32).
extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_t16_o32(const bf16_t* q, const bf16_t* cache, const int* bt, int max_pages, const int* lens, float scale_log2,
               bf16_t* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_k<mla_decode_t16_o32_v.tile, mla_decode_t16_o32_v.stages, false, false, true>(q, cache, bt, max_pages, nullptr, 0, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

// The sparse twins: lens[b] is the length of sequence b's list, indices[b, 0..lens[b]] (≤ topk).
extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_sparse_t32(const bf16_t* q, const bf16_t* cache, const int* bt, int max_pages, const int* indices, int topk,
               const int* lens, float scale_log2, bf16_t* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_k<mla_sparse_t32_v.tile, mla_sparse_t32_v.stages, true>(q, cache, bt, max_pages, indices, topk, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_sparse_t16(const bf16_t* q, const bf16_t* cache, const int* bt, int max_pages, const int* indices, int topk,
               const int* lens, float scale_log2, bf16_t* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_k<mla_sparse_t16_v.tile, mla_sparse_t16_v.stages, true>(q, cache, bt, max_pages, indices, topk, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

// The same over an fp8_ds_mla cache (kernels/kv_fp8.cuh): the tile loader dequantizes the
// latent part of each 656-byte row into the same shared bf16 rows, so the MMAs are unchanged.
extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_fp8_t32(const bf16_t* q, const unsigned char* cache, const int* bt, int max_pages, const int* lens, float scale_log2,
               bf16_t* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_k<mla_decode_fp8_t32_v.tile, mla_decode_fp8_t32_v.stages, false, true>(q, (const bf16_t*)cache, bt, max_pages, nullptr, 0, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_fp8_t16(const bf16_t* q, const unsigned char* cache, const int* bt, int max_pages, const int* lens, float scale_log2,
               bf16_t* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_k<mla_decode_fp8_t16_v.tile, mla_decode_fp8_t16_v.stages, false, true>(q, (const bf16_t*)cache, bt, max_pages, nullptr, 0, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

// out[b, h, :] = Σ_s exp(lse_s − lse) · O_s with lse = log Σ_s exp(lse_s). Block = (b, h, a
// quarter of the 512 dims), one warp per split up to 8 (blockDim.x = 32 × warps): the split
// weights go to shared memory once; warp w sums splits w, w + warps, ... with 4 dims (8 bytes
// of bf16) per lane (many loads in flight: with one query per
// sequence and many splits this merge is the larger part of the decode), then the warps' sums
// are added through shared memory.
#define MAX_SPLITS 256
#define COMBINE_WARPS 8
// Faults the debugger plants in the merges (`faults`, a bit set; 0 in every real run):
// FAULT_LSE_BASE (lse-base-mismatch): the splits' log-sum-exps are taken as base 2 where they
// are natural (each scaled by log2 e before weighing), as a merge written against a kernel
// that reports log2 does. FAULT_SKIP_EMPTY_ROWS (skip-padded-rows): the merge returns without
// writing a row whose splits all hold no keys (LSE -inf), such as the zero-length sequences that
// pad a CUDA-graph batch, which then keep whatever the buffer held.
#define FAULT_LSE_BASE 1
#define FAULT_SKIP_EMPTY_ROWS 2
__device__ __forceinline__ float merge_lse(float l, int faults) {
    return (faults & FAULT_LSE_BASE) ? l * 1.4426950408889634f : l;
}

// Four bf16 partials of a lane (8 bytes) as floats.
__device__ __forceinline__ float4 ld_bf16x4(const bf16_t* p) {
    const uint2 u = *(const uint2*)p;
    return make_float4(bf16_lo(u.x), bf16_hi(u.x), bf16_lo(u.y), bf16_hi(u.y));
}

extern "C" __global__ void mla_decode_combine(const bf16_t* part_o, const float* part_lse, bf16_t* out, float* lse_out,
                                              int splits, int heads, int faults) {
    __shared__ float w[MAX_SPLITS];
    __shared__ float scratch[32];
    __shared__ float4 partial[COMBINE_WARPS][32];
    const int b = blockIdx.x, h = blockIdx.y, d0 = blockIdx.z * 128;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    wait_for_prior_kernel();  // launched as a dependent of the split kernel
    let_dependents_launch();  // a next split kernel launched as a dependent waits for our end
    // The first PREFETCH splits of this warp are loaded before their weights are known, so that
    // their latency overlaps the log-sum-exps' (a batch-1 decode waits for this merge).
    const u64 stride = (u64)heads * DV;
    const bf16_t* base = part_o + ((u64)b * splits * heads + h) * DV + d0 + lane * 4;
    constexpr int PREFETCH = 8;
    float4 early[PREFETCH];
#pragma unroll
    for (int i = 0; i < PREFETCH; i++) {
        const int s = warp + i * warps;
        early[i] = s < splits ? ld_bf16x4(base + s * stride) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    float top = -INFINITY;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) top = fmaxf(top, merge_lse(part_lse[((u64)b * splits + s) * heads + h], faults));
    top = block_max(top, scratch);
    if ((faults & FAULT_SKIP_EMPTY_ROWS) && top == -INFINITY) return;  // the whole block: top is uniform
    float total = 0.0f;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) {
        float l = merge_lse(part_lse[((u64)b * splits + s) * heads + h], faults);
        float e = l > -INFINITY ? expf(l - top) : 0.0f;
        w[s] = e;
        total += e;
    }
    total = block_sum(total, scratch);  // its barriers also order the writes of w before the reads
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < PREFETCH; i++) {
        const int s = warp + i * warps;
        const float ws = s < splits ? w[s] : 0.0f;
        if (ws > 0.0f) {
            acc.x += ws * early[i].x;
            acc.y += ws * early[i].y;
            acc.z += ws * early[i].z;
            acc.w += ws * early[i].w;
        }
    }
#pragma unroll 4
    for (int s = warp + PREFETCH * warps; s < splits; s += warps) {
        float ws = w[s];
        if (ws > 0.0f) {
            float4 v = ld_bf16x4(base + s * stride);
            acc.x += ws * v.x;
            acc.y += ws * v.y;
            acc.z += ws * v.z;
            acc.w += ws * v.w;
        }
    }
    partial[warp][lane] = acc;
    __syncthreads();
    if (warp == 0) {
        float4 sum = partial[0][lane];
        for (int i = 1; i < warps; i++) {
            float4 v = partial[i][lane];
            sum.x += v.x;
            sum.y += v.y;
            sum.z += v.z;
            sum.w += v.w;
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        bf16_t* dst = out + ((u64)b * heads + h) * DV + d0 + lane * 4;
        *(uint2*)dst = make_uint2(pack_bf16(sum.x * inv, sum.y * inv), pack_bf16(sum.z * inv, sum.w * inv));
    }
    if (threadIdx.x == 0 && blockIdx.z == 0) lse_out[(u64)b * heads + h] = total > 0.0f ? top + logf(total) : -INFINITY;
}

// The merge for few splits (at most 32; the host uses it up to 16): one warp per (sequence,
// head) row, eight rows per block, no block barriers. Lane s holds split s's LSE; the weights
// and their total come by shuffles; lane l sums dims 4l + 128j (j < 4) over the splits with
// four 8-byte loads (4 bf16 each) per split in flight.
extern "C" __global__ void __launch_bounds__(256) mla_decode_combine_rows(const bf16_t* part_o, const float* part_lse, bf16_t* out,
                                                                          float* lse_out, int splits, int heads, int rows, int faults) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = blockIdx.x * 8 + warp;  // b · heads + h
    if (row >= rows) return;
    const int b = row / heads, h = row % heads;
    wait_for_prior_kernel();  // launched as a dependent of the split kernel
    let_dependents_launch();  // a next split kernel launched as a dependent waits for our end
    const float l = lane < splits ? merge_lse(part_lse[((u64)b * splits + lane) * heads + h], faults) : -INFINITY;
    float top = l;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    if ((faults & FAULT_SKIP_EMPTY_ROWS) && top == -INFINITY) return;  // the whole warp: top is uniform
    const float w = l > -INFINITY ? expf(l - top) : 0.0f;
    float total = w;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    const u64 stride = (u64)heads * DV;
    const bf16_t* base = part_o + ((u64)b * splits * heads + h) * DV + lane * 4;
    float4 acc[4];
#pragma unroll
    for (int j = 0; j < 4; j++) acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
    for (int s = 0; s < splits; s++) {
        const float ws = __shfl_sync(0xffffffffu, w, s);
        if (ws > 0.0f) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float4 v = ld_bf16x4(base + s * stride + 128 * j);
                acc[j].x += ws * v.x;
                acc[j].y += ws * v.y;
                acc[j].z += ws * v.z;
                acc[j].w += ws * v.w;
            }
        }
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    bf16_t* dst = out + (u64)row * DV + lane * 4;
#pragma unroll
    for (int j = 0; j < 4; j++)
        *(uint2*)(dst + 128 * j) =
            make_uint2(pack_bf16(acc[j].x * inv, acc[j].y * inv), pack_bf16(acc[j].z * inv, acc[j].w * inv));
    if (lane == 0) lse_out[row] = total > 0.0f ? top + logf(total) : -INFINITY;
}
