// MLA decode over an fp8_ds_mla cache for up to 8 heads per block (GLM-5 at TP 8), sm_90 and
// later: mla_decode_fp8_h16's scheme (see mla_decode_fp8.cu: raw rows by bulk copy, a warp per
// latent tile, f16 MMAs on operands converted straight from the E4M3 bytes, scales outside the
// MMAs) with the products transposed so that the 8 heads are the MMAs' N instead of half of a
// 16-row M. The 16-row form spends half its MMAs, its softmax and its O registers on padding
// rows at 8 heads; here every MMA row is real:
// - Sᵀ = K·Qᵀ: M = 16 tokens (A: two token rows' bytes per lane, 16 bytes each per 64-dim
//   span, in the same permuted k order as the h16 kernel's B), N = 8 heads (B: the query, per
//   head its power of two into f16), K = the warp's 128 latent dims, then 16 RoPE dims in bf16.
//   The four warps' partial Sᵀ are summed through shared memory (8 floats per lane).
// - Oᵀ = V̂ᵀ·P'ᵀ: M = 16 output dims (8 M-tiles over the warp's 128; A from four token rows'
//   16 bytes per lane, paired by byte permutes, as the h16 kernel's B), N = 8 heads, K = 16
//   tokens. P'ᵀ, P times each token's scale over σ in f16, is the Sᵀ accumulator layout
//   transposed within the warp by movmatrix.
// Sᵀ lanes hold tokens g, g + 8 (of each 16) and heads 2qd, 2qd + 1: the softmax reduces over
// the eight lanes of a quad position (shuffles by 4, 8, 16). Three stages and 8 KB of exchange
// (70 KB) leave room for three blocks per multiprocessor. mla_sparse_fp8_h8 is the sparse form
// (see mla_decode_fp8.cu), with a fifth warp that only issues the copies (32 per tile, one per
// list entry, as mla_sparse_h8 does): each stage once the four compute warps released it.
#include "common.cuh"
#include "mma.cuh"
#include "tma.cuh"
#include "kv_fp8.cuh"
#include "variants.cuh"

#define E_HEADS (mla_decode_fp8_h8_v.rows)      // heads (MMA columns) of a block
#define E_TILE (mla_decode_fp8_h8_v.tile)       // tokens per tile
#define E_STAGES (mla_decode_fp8_h8_v.stages)   // tiles in flight
#define E_THREADS 128                           // a warp per latent tile
#define E_SPARSE_THREADS (E_THREADS + 32)       // and the sparse form's producer warp
#define E_PAGE 64
#define E_STAGE_BYTES (E_TILE * FP8_TOKEN_BYTES)
#define E_XCHG_BYTES (4 * 2 * 32 * 16)  // four warps' partial Sᵀ: two float4 per lane
#define E_O_STRIDE 532                  // floats per head of O put back in order (+1 per 32 dims)

static_assert(E_HEADS == 8 && E_TILE == 32 && FP8_LATENT == 4 * FP8_TILE, "a warp per latent tile, 8-head MMA columns");
static_assert(E_STAGES * E_STAGE_BYTES + 2 * E_XCHG_BYTES + 20 * E_STAGES == mla_decode_fp8_h8_v.shared,
              "mla_decode_fp8_h8: variants.cuh and the layout differ");
static_assert(mla_sparse_fp8_h8_v.shared == mla_decode_fp8_h8_v.shared && mla_sparse_fp8_h8_v.rows == E_HEADS &&
                  mla_sparse_fp8_h8_v.stages == E_STAGES,
              "the sparse form has the dense one's layout");
static_assert(E_HEADS * E_O_STRIDE * 4 <= E_STAGES * E_STAGE_BYTES, "O fits in the stages");

template <bool SPARSE>
__device__ __forceinline__ void fp8_h8(const bf16_t* q, const unsigned char* cache, const int* block_table, int max_pages, const int* indices,
                                        int topk, const int* seq_lens, float scale_log2, bf16_t* part_o, float* part_lse, int splits,
                                        int total_heads, bf16_t* out, float* lse_out) {
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned sKV = smem_addr(smem), sX = sKV + E_STAGES * E_STAGE_BYTES, mbar = sX + 2 * E_XCHG_BYTES;
    const unsigned empty = mbar + 8 * E_STAGES;  // [stages] released by the compute warps (sparse)
    const unsigned sKeys = empty + 8 * E_STAGES;  // [stages] the key bits of the tile in each
    constexpr bool PRODUCER = SPARSE;             // a fifth warp issues the copies
    if (blockDim.x != (PRODUCER ? E_SPARSE_THREADS : E_THREADS)) __trap();  // as the launcher's PRODUCER_WARP

    let_dependents_launch();  // the merge may take its place now; it waits for our end

    const FewHeadsBlock blk = few_heads_block<E_HEADS, E_TILE>(seq_lens, splits, total_heads);
    const int b = blk.b, head0 = blk.head0, heads_here = blk.heads_here, t_begin = blk.t_begin, t_end = blk.t_end;
    const u64 out_row = blk.out_row;
    if (t_begin >= t_end) {
        decode_empty_split(heads_here, FP8_LATENT, splits, (u64)b * total_heads + head0, out_row, out, lse_out, part_o, part_lse);
        return;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qd = lane % 4;
    const int n_tiles = (t_end - t_begin + E_TILE - 1) / E_TILE;
    const int* bt = block_table + (u64)b * max_pages;

    if (PRODUCER) init_empty_barriers(empty, E_STAGES, 4);
    init_stage_barriers(mbar, E_STAGES);
    TileIssuer<SPARSE, E_TILE> issuer{cache, bt, indices + (u64)b * topk, t_begin, t_end};
    auto issue_tile = [&](int j) {
        const int st = j % E_STAGES;
        issuer.issue(j, sKV + st * E_STAGE_BYTES, mbar + 8 * st, sKeys + 4 * st, lane);
    };
    if (PRODUCER && warp == 4) {
        issuer.start(lane);
        produce_tiles(n_tiles, E_STAGES, empty, issue_tile);
    } else if (!PRODUCER && warp == 0) {
        issuer.start(lane);
        for (int j = 0; j < E_STAGES && j < n_tiles; j++) issue_tile(j);
    }
    if (!PRODUCER || warp < 4) {  // the compute warps

    // Qᵀ as B fragments (column g = head g): latent dims 128·warp + 64·span + 16·qd + 4i.. for
    // k-step 4·span + i, times the head's power of two; RoPE dims 16·warp + 4·qd.. in bf16.
    unsigned qb[8][2], qrb[2];
    float unscale[2];  // of the accumulator columns' heads, 2qd and 2qd + 1
    {
        float v[32];
        const bf16_t* src = q + ((u64)b * total_heads + head0 + g) * (FP8_LATENT + FP8_ROPE);
#pragma unroll
        for (int span = 0; span < 2; span++) fp8_query16(src + FP8_TILE * warp + 64 * span + 16 * qd, g < heads_here, v + 16 * span);
        const uint2 rope = g < heads_here ? *(const uint2*)(src + FP8_LATENT + 16 * warp + 4 * qd) : make_uint2(0, 0);
        float amax = 0.0f;
#pragma unroll
        for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(v[k]));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const float f = f16_row_factor(amax);
#pragma unroll
        for (int ks = 0; ks < 8; ks++) {
            const int at = 16 * (ks / 4) + 4 * (ks % 4);
            qb[ks][0] = pack_f16(v[at] * f, v[at + 1] * f);
            qb[ks][1] = pack_f16(v[at + 2] * f, v[at + 3] * f);
        }
        qrb[0] = rope.x;
        qrb[1] = rope.y;
        // Head h's factor lives in the lanes 4h..4h + 3.
        unscale[0] = 1.0f / __shfl_sync(0xffffffffu, f, 8 * qd);
        unscale[1] = 1.0f / __shfl_sync(0xffffffffu, f, 8 * qd + 4);
    }

    // Oᵀ: M-tile mt, rows g and g + 8 are dims 128·warp + 16g + mt (+ 8), columns heads 2qd..
    float o[8][4];
#pragma unroll
    for (int mt = 0; mt < 8; mt++) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f}, sigma = 0.0f;

    for (int j = 0; j < n_tiles; j++) {
        const unsigned kv = sKV + (j % E_STAGES) * E_STAGE_BYTES;
        mbar_wait(mbar + 8 * (j % E_STAGES), (j / E_STAGES) & 1);
        unsigned keys;  // bit r: row r of the tile holds a key
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(keys) : "r"(sKeys + 4 * (j % E_STAGES)));
        auto is_key = [&](int r) { return (keys >> r) & 1u; };

        // This warp's part of Sᵀ: M-tile mt is tokens 16mt.., the lane's rows g and g + 8.
        float sc[2][4], ts[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            const int ta = 16 * mt + g, tb = ta + 8;
            const unsigned ra = kv + ta * FP8_TOKEN_BYTES, rb = kv + tb * FP8_TOKEN_BYTES;
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, accr[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int span = 0; span < 2; span++) {
                const unsigned off = FP8_TILE * warp + 64 * span + 16 * qd;
                const uint4 ka = fp8_ld_shared16(ra + off), kb = fp8_ld_shared16(rb + off);
                const u32 wa[4] = {ka.x, ka.y, ka.z, ka.w}, wb[4] = {kb.x, kb.y, kb.z, kb.w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const unsigned afr[4] = {e4m3x2_f16x2<0>(wa[i]), e4m3x2_f16x2<0>(wb[i]), e4m3x2_f16x2<1>(wa[i]), e4m3x2_f16x2<1>(wb[i])};
                    mma_f16(acc, afr, qb[4 * span + i]);
                }
            }
            const unsigned roff = FP8_ROPE_AT + 2 * (16 * warp + 4 * qd);
            const uint2 pa = fp8_ld_shared8(ra + roff), pb = fp8_ld_shared8(rb + roff);
            const unsigned ar[4] = {pa.x, pb.x, pa.y, pb.y};
            mma_bf16(accr, ar, qrb);
            ts[mt][0] = is_key(ta) ? fp8_ld_shared_f32(ra + FP8_SCALES_AT + 4 * warp) : 0.0f;
            ts[mt][1] = is_key(tb) ? fp8_ld_shared_f32(rb + FP8_SCALES_AT + 4 * warp) : 0.0f;
            sc[mt][0] = acc[0] * unscale[0] * ts[mt][0] + accr[0];
            sc[mt][1] = acc[1] * unscale[1] * ts[mt][0] + accr[1];
            sc[mt][2] = acc[2] * unscale[0] * ts[mt][1] + accr[2];
            sc[mt][3] = acc[3] * unscale[1] * ts[mt][1] + accr[3];
        }
        // The four warps' parts summed in one order: M-tile mt of warp w's lane l as a float4 at
        // ((w·2 + mt)·32 + l)·16.
        const unsigned x = sX + (j & 1) * E_XCHG_BYTES;
#pragma unroll
        for (int mt = 0; mt < 2; mt++) xchg_store<2>(x, warp, lane, mt, sc[mt]);
        if (PRODUCER)
            bar_sync(1, E_THREADS);
        else
            __syncthreads();
        // Everyone is done with tile j − 1: its stage takes tile j − 1 + E_STAGES.
        if (!PRODUCER && warp == 0 && j > 0 && j - 1 + E_STAGES < n_tiles) {
            fence_proxy_async();
            issue_tile(j - 1 + E_STAGES);
        }
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            const float4 sum = xchg_sum<2>(x, lane, mt);
            const int ta = 16 * mt + g;
            sc[mt][0] = is_key(ta) ? sum.x * scale_log2 : -INFINITY;
            sc[mt][1] = is_key(ta) ? sum.y * scale_log2 : -INFINITY;
            sc[mt][2] = is_key(ta + 8) ? sum.z * scale_log2 : -INFINITY;
            sc[mt][3] = is_key(ta + 8) ? sum.w * scale_log2 : -INFINITY;
        }

        // Online softmax per head (column) in base 2; σ grows to cover this tile's scales.
        float alpha[2], smax = fmaxf(fmaxf(ts[0][0], ts[0][1]), fmaxf(ts[1][0], ts[1][1]));
        column_softmax<true>(sc, m_run, l_run, alpha, &smax);
        const float grow = fp8_sigma_grow(smax, sigma);
        const float inv_sigma = sigma > 0.0f ? 1.0f / sigma : 0.0f;  // 0: all scales 0 so far
#pragma unroll
        for (int h = 0; h < 2; h++) alpha[h] *= grow;  // O is also in units of σ
        column_rescale(o, alpha);

        // Oᵀ += V̂ᵀ · P'ᵀ over two k-steps of 16 tokens (k-step kk is Sᵀ's M-tile kk).
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            const float s0 = ts[kk][0] * inv_sigma, s1 = ts[kk][1] * inv_sigma;
            const unsigned pb[2] = {movmatrix_trans(pack_f16(sc[kk][0] * s0, sc[kk][1] * s0)),
                                    movmatrix_trans(pack_f16(sc[kk][2] * s1, sc[kk][3] * s1))};
            // Rows 2qd, 2qd + 1, 2qd + 8, 2qd + 9 of the k-step: 16 bytes each (zero past the end).
            uint4 vr[4];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int tok = 16 * kk + 2 * qd + (k & 1) + 8 * (k >> 1);
                vr[k] = is_key(tok) ? fp8_ld_shared16(kv + tok * FP8_TOKEN_BYTES + FP8_TILE * warp + 16 * g) : make_uint4(0, 0, 0, 0);
            }
            const u32 v0[4] = {vr[0].x, vr[0].y, vr[0].z, vr[0].w}, v1[4] = {vr[1].x, vr[1].y, vr[1].z, vr[1].w};
            const u32 v8[4] = {vr[2].x, vr[2].y, vr[2].z, vr[2].w}, v9[4] = {vr[3].x, vr[3].y, vr[3].z, vr[3].w};
            // Byte e of the lane's 16 (dim 16g + e) of rows 2qd and 2qd + 1 (x01) and of rows
            // 2qd + 8 and 2qd + 9 (x89), paired as f16x2.
            unsigned x01[16], x89[16];
#pragma unroll
            for (int a = 0; a < 4; a++) {
                const u32 lo01 = prmt(v0[a], v1[a], 0x5140), hi01 = prmt(v0[a], v1[a], 0x7362);
                const u32 lo89 = prmt(v8[a], v9[a], 0x5140), hi89 = prmt(v8[a], v9[a], 0x7362);
                x01[4 * a] = e4m3x2_f16x2<0>(lo01), x01[4 * a + 1] = e4m3x2_f16x2<1>(lo01);
                x01[4 * a + 2] = e4m3x2_f16x2<0>(hi01), x01[4 * a + 3] = e4m3x2_f16x2<1>(hi01);
                x89[4 * a] = e4m3x2_f16x2<0>(lo89), x89[4 * a + 1] = e4m3x2_f16x2<1>(lo89);
                x89[4 * a + 2] = e4m3x2_f16x2<0>(hi89), x89[4 * a + 3] = e4m3x2_f16x2<1>(hi89);
            }
#pragma unroll
            for (int mt = 0; mt < 8; mt++) {
                const unsigned afr[4] = {x01[mt], x01[mt + 8], x89[mt], x89[mt + 8]};
                mma_f16(o[mt], afr, pb);
            }
        }
        if (PRODUCER) release_stage(empty + 8 * (j % E_STAGES));  // this warp is done with the stage
    }

#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int sh = 4; sh <= 16; sh <<= 1) l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], sh);
    column_lse_store(m_run, l_run, heads_here, splits, lse_out, (u64)b * total_heads + head0, part_lse, out_row);

    // O in dim order through shared memory (the stages are free: every copy issued has landed
    // and been read), then out head by head.
    if (PRODUCER)
        bar_sync(1, E_THREADS);
    else
        __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float k = l_run[h] > 0.0f ? sigma / l_run[h] : 0.0f;
        const int head = 2 * qd + h;
#pragma unroll
        for (int mt = 0; mt < 8; mt++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int dim = FP8_TILE * warp + 16 * g + mt + 8 * r;
                asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(sKV + (head * E_O_STRIDE + dim + dim / 32) * 4), "f"(o[mt][2 * r + h] * k));
            }
    }
    }  // the compute warps
    __syncthreads();
    fp8_store_o(sKV, E_O_STRIDE, heads_here, splits, out, (u64)b * total_heads + head0, part_o, out_row);
}

extern "C" __global__ void __launch_bounds__(E_THREADS, 3) mla_decode_fp8_h8(const bf16_t* q, const unsigned char* cache, const int* block_table,
                                                                         int max_pages, const int* seq_lens, float scale_log2, bf16_t* part_o,
                                                                         float* part_lse, int splits, int total_heads, bf16_t* out,
                                                                         float* lse_out) {
    fp8_h8<false>(q, cache, block_table, max_pages, nullptr, 0, seq_lens, scale_log2, part_o, part_lse, splits, total_heads, out, lse_out);
}

// The sparse form: sequence b attends to the entries 0..seq_lens[b] of row b of `indices`
// ([batch, topk] token positions, -1 padding), the splits and tiles running over the entries.
extern "C" __global__ void __launch_bounds__(E_SPARSE_THREADS, 3) mla_sparse_fp8_h8(const bf16_t* q, const unsigned char* cache, const int* block_table,
                                                                          int max_pages, const int* indices, int topk, const int* seq_lens,
                                                                          float scale_log2, bf16_t* part_o, float* part_lse, int splits,
                                                                          int total_heads, bf16_t* out, float* lse_out) {
    fp8_h8<true>(q, cache, block_table, max_pages, indices, topk, seq_lens, scale_log2, part_o, part_lse, splits, total_heads, out, lse_out);
}
