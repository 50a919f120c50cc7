// Sparse MLA decode over the bf16 latent cache for up to 8 heads per block (GLM-5 at TP 8),
// sm_90 and later: mla_decode_fp8_h8's scheme (see mla_decode_fp8_h8.cu and mla_decode_fp8.cu)
// on bf16 rows. The 64-row sparse kernels (mla_sparse_ks3…) gather rows by cp.async, whose
// copies share the load/store pipe with ldmatrix, and at 8 heads 56 of their 64 MMA rows are
// padding. Here:
// - a fifth warp, the producer, gathers a tile's 32 list entries with one bulk copy each (1152
//   bytes: the row's 576 bf16 values) into rows 1168 bytes apart (ldmatrix rows of 8 then fall
//   in 8 different bank groups), the lookups pipelined in its lanes' registers (TileIssuer in
//   kv_fp8.cuh), into a stage as soon as the four compute warps have each released it (an
//   `empty` barrier per stage). When warp 0 issued the copies between its own tiles, the other
//   warps waited for it at every tile's barrier: the producer took the decode at batch 64,
//   top-k 2048 from 54.5 to 53 µs on the H200 (more stages, tiles of 16 keys, or a quarter of
//   the rows by cp.async were all slower);
// - compute warp w owns latent dims 128w.. and RoPE dims 16w..: Sᵀ = K·Qᵀ (M = 16 tokens by ldmatrix,
//   N = the 8 heads from registers, K = its 144 dims), the four partial Sᵀ summed through
//   shared memory, then Oᵀ += Vᵀ·Pᵀ (M = 16 of its output dims by ldmatrix.trans, N = 8 heads,
//   K = 16 tokens; Pᵀ from the Sᵀ accumulators by movmatrix), all in bf16 MMAs with f32
//   accumulators;
// - entries of padding (and past the list's end) are not copied: their scores are -inf, and
//   each warp zeroes its own dims of those rows before reading them, since 0 · NaN is NaN.
// Two stages of 36.5 KB and 8 KB of exchange (81 KB): two blocks per multiprocessor. The split
// partials' merge is launched as a dependent (let_dependents_launch).
#include "common.cuh"
#include "mma.cuh"
#include "tma.cuh"
#include "kv_fp8.cuh"
#include "variants.cuh"

#define S_HEADS (mla_sparse_h8_v.rows)
#define S_TILE (mla_sparse_h8_v.tile)
#define S_STAGES (mla_sparse_h8_v.stages)
#define S_CONSUMERS 4  // warps that compute; warp 4 only copies
#define S_THREADS (32 * S_CONSUMERS + 32)
#define S_DQK 576
#define S_DV 512
#define S_ROW_BYTES (S_DQK * 2)
#define S_STRIDE 1168  // bytes between rows in a stage: 1152 + 16 shifts rows by four banks
#define S_STAGE_BYTES (S_TILE * S_STRIDE)
#define S_XCHG_BYTES (4 * 2 * 32 * 16)
#define S_O_STRIDE 532

static_assert(S_HEADS == 8 && S_TILE == 32, "8-head MMA columns, a lane per row");
static_assert(S_STAGES * S_STAGE_BYTES + 2 * S_XCHG_BYTES + 20 * S_STAGES == mla_sparse_h8_v.shared,
              "mla_sparse_h8: variants.cuh and the layout differ");
static_assert(S_HEADS * S_O_STRIDE * 4 <= S_STAGES * S_STAGE_BYTES, "O fits in the stages");

extern "C" __global__ void __launch_bounds__(S_THREADS, 2) mla_sparse_h8(const bf16_t* q, const bf16_t* cache, const int* block_table, int max_pages,
                                                                     const int* indices, int topk, const int* seq_lens, float scale_log2,
                                                                     bf16_t* part_o, float* part_lse, int splits, int total_heads, bf16_t* out,
                                                                     float* lse_out) {
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned sKV = smem_addr(smem), sX = sKV + S_STAGES * S_STAGE_BYTES, mbar = sX + 2 * S_XCHG_BYTES;
    const unsigned empty = mbar + 8 * S_STAGES;  // [stages] the consumer warps are done with it
    const unsigned sKeys = empty + 8 * S_STAGES;  // [stages] the key bits of the tile in each

    if (blockDim.x != S_THREADS) __trap();  // the launcher's block size (PRODUCER_WARP) is ours
    let_dependents_launch();  // the merge may take its place now; it waits for our end

    const FewHeadsBlock blk = few_heads_block<S_HEADS, S_TILE>(seq_lens, splits, total_heads);
    const int b = blk.b, head0 = blk.head0, heads_here = blk.heads_here, t_begin = blk.t_begin, t_end = blk.t_end;
    const u64 out_row = blk.out_row;
    if (t_begin >= t_end) {
        decode_empty_split(heads_here, S_DV, splits, (u64)b * total_heads + head0, out_row, out, lse_out, part_o, part_lse);
        return;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qd = lane % 4;
    const int n_tiles = (t_end - t_begin + S_TILE - 1) / S_TILE;
    const int* bt = block_table + (u64)b * max_pages;

    init_empty_barriers(empty, S_STAGES, S_CONSUMERS);
    init_stage_barriers(mbar, S_STAGES);
    TileIssuer<true, S_TILE, S_ROW_BYTES, S_STRIDE> issuer{(const unsigned char*)cache, bt, indices + (u64)b * topk, t_begin, t_end};
    auto issue_tile = [&](int j) {
        const int st = j % S_STAGES;
        issuer.issue(j, sKV + st * S_STAGE_BYTES, mbar + 8 * st, sKeys + 4 * st, lane);
    };
    float o[8][4];  // Oᵀ: M-tile mt rows g, g + 8 are dims 128·warp + 16mt + g (+ 8); heads 2qd..
    float l_run[2] = {0.0f, 0.0f};
    if (warp == S_CONSUMERS) {
        // The producer: each tile into its stage once the consumers are done with the stage's
        // previous tile.
        issuer.start(lane);
        produce_tiles(n_tiles, S_STAGES, empty, issue_tile);
    } else {

    // Qᵀ as B fragments (column g = head g): latent k-step ks covers dims 128·warp + 16ks..,
    // k-step 8 the RoPE dims 512 + 16·warp..; zeros for padding heads.
    unsigned qb[9][2];
    {
        const bf16_t* src = q + ((u64)b * total_heads + head0 + g) * S_DQK;
        const bool real = g < heads_here;
#pragma unroll
        for (int ks = 0; ks < 9; ks++) {
            const int d = ks < 8 ? FP8_TILE * warp + 16 * ks : S_DV + 16 * warp;
            qb[ks][0] = real ? *(const unsigned*)(src + d + 2 * qd) : 0u;
            qb[ks][1] = real ? *(const unsigned*)(src + d + 2 * qd + 8) : 0u;
        }
    }

#pragma unroll
    for (int mt = 0; mt < 8; mt++) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY};

    for (int j = 0; j < n_tiles; j++) {
        const unsigned kv = sKV + (j % S_STAGES) * S_STAGE_BYTES;
        mbar_wait(mbar + 8 * (j % S_STAGES), (j / S_STAGES) & 1);
        unsigned keys;  // bit r: row r of the tile holds a key
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(keys) : "r"(sKeys + 4 * (j % S_STAGES)));
        auto is_key = [&](int r) { return (keys >> r) & 1u; };
        // Rows without a key: this warp's 256 bytes of latent values zeroed (its P·V reads them).
        if (keys != 0xffffffffu) {
            for (int i = lane; i < S_TILE * 16; i += 32) {
                const int r = i / 16;
                if (!is_key(r)) st_shared_zero16(kv + r * S_STRIDE + 2 * FP8_TILE * warp + 16 * (i % 16));
            }
            __syncwarp();
        }

        // This warp's part of Sᵀ: M-tile mt is tokens 16mt.., ldmatrix rows (lane % 16).
        float sc[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            const unsigned row = kv + (16 * mt + lane % 16) * S_STRIDE + 16 * (lane / 16);
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int ks = 0; ks < 9; ks++) {
                const int d = ks < 8 ? FP8_TILE * warp + 16 * ks : S_DV + 16 * warp;
                unsigned a[4];
                ldsm_x4(a, row + 2 * d);
                mma_bf16(acc, a, qb[ks]);
            }
#pragma unroll
            for (int c = 0; c < 4; c++) sc[mt][c] = acc[c];
        }
        const unsigned x = sX + (j & 1) * S_XCHG_BYTES;
#pragma unroll
        for (int mt = 0; mt < 2; mt++) xchg_store<2>(x, warp, lane, mt, sc[mt]);
        fence_proxy_async();  // this warp's zeroing, before the stage is copied into again
        bar_sync(1, 32 * S_CONSUMERS);
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            const float4 sum = xchg_sum<2>(x, lane, mt);
            const int ta = 16 * mt + g;
            sc[mt][0] = is_key(ta) ? sum.x * scale_log2 : -INFINITY;
            sc[mt][1] = is_key(ta) ? sum.y * scale_log2 : -INFINITY;
            sc[mt][2] = is_key(ta + 8) ? sum.z * scale_log2 : -INFINITY;
            sc[mt][3] = is_key(ta + 8) ? sum.w * scale_log2 : -INFINITY;
        }

        // Online softmax per head (column) in base 2.
        float alpha[2];
        column_softmax(sc, m_run, l_run, alpha);
        column_rescale(o, alpha);

        // Oᵀ += Vᵀ · Pᵀ over two k-steps of 16 tokens (k-step kk is Sᵀ's M-tile kk). ldmatrix.trans
        // of V: lanes 0–7 token rows 0–7 at dims +0, 8–15 the same rows at +8, 16–31 rows 8–15.
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            const unsigned pb[2] = {movmatrix_trans(pack_bf16(sc[kk][0], sc[kk][1])), movmatrix_trans(pack_bf16(sc[kk][2], sc[kk][3]))};
            const unsigned vrow = kv + (16 * kk + lane % 8 + 8 * (lane / 16)) * S_STRIDE + 2 * FP8_TILE * warp + 16 * ((lane / 8) % 2);
#pragma unroll
            for (int mt = 0; mt < 8; mt++) {
                unsigned a[4];
                ldsm_x4_trans(a, vrow + 32 * mt);
                mma_bf16(o[mt], a, pb);
            }
        }
        release_stage(empty + 8 * (j % S_STAGES));
    }

#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int sh = 4; sh <= 16; sh <<= 1) l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], sh);
    column_lse_store(m_run, l_run, heads_here, splits, lse_out, (u64)b * total_heads + head0, part_lse, out_row);

    // O through shared memory (the stages are free: every copy issued has landed and been
    // read), then out head by head.
    bar_sync(1, 32 * S_CONSUMERS);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float k = l_run[h] > 0.0f ? 1.0f / l_run[h] : 0.0f;
        const int head = 2 * qd + h;
#pragma unroll
        for (int mt = 0; mt < 8; mt++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int dim = FP8_TILE * warp + 16 * mt + g + 8 * r;
                asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(sKV + (head * S_O_STRIDE + dim + dim / 32) * 4), "f"(o[mt][2 * r + h] * k));
            }
    }
    }  // the consumers
    __syncthreads();
    fp8_store_o(sKV, S_O_STRIDE, heads_here, splits, out, (u64)b * total_heads + head0, part_o, out_row);
}
