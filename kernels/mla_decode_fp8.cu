// MLA decode over an fp8_ds_mla cache for the head counts of a tensor-parallel rank (up to 16
// heads per block: GLM-5 at TP 8 holds 8, DeepSeek-V3 16), sm_90 and later (bulk copies and the
// hardware E4M3 conversion). Same work and outputs as the other decode kernels: one query token
// per sequence, split-KV partials and LSEs merged by mla_decode_combine(_rows).
//
// Why its own kernel: the other FP8 variants turn each tile into a bf16 copy in shared memory
// and then run their bf16 twin's 64-row MMAs. At 8 heads, 56 of those 64 rows are padding, and
// the copy costs a barrier and a second pass over shared memory per tile. Here the raw 656-byte
// rows stay as they came, and each warp builds its MMA operands straight from them:
// - A tile (32 tokens, half a page, contiguous in the cache) comes by one bulk copy of
//   valid·656 bytes (sparse: a copy per list entry), which completes a shared-memory barrier;
//   four stages in flight.
// - Warp w owns latent tile w (dims 128w..128w+127, one E4M3 scale per token) and RoPE dims
//   16w..16w+15. S = Q·Kᵀ is summed over the four warps' dims through shared memory (a
//   barrier per tile, which also frees the stage read two tiles ago), each warp summing only
//   the four rows it owns and running their online softmax; their P and rescale factors go
//   back through the same buffer (a second barrier), so every warp then holds P of all 16 rows
//   for its P·V. (With every warp summing and exponentiating all 16 rows, a tile took a sixth
//   more instructions.)
// - MMAs in f16 (m16n8k16), which holds every E4M3 value exactly (the conversion is one
//   instruction per pair): K and V enter unscaled, and the scales are applied outside the
//   MMAs, in f32: S_w = scale_w(token) · (q_w · k̂_w) + q_rope · k_rope (the RoPE part in bf16,
//   as the cache stores it), and O_w += (P · scale_w(token) / σ_w) · v̂_w, σ_w a power of two
//   at least the largest scale seen so far (so the f16 operand stays ≤ 1; O is rescaled when
//   σ_w grows, with the softmax's own rescale). The query's latent part is scaled by a power of
//   two per row (its largest value to about 2^14) to use f16's range, and unscaled in S.
// - Operand layout: the dims inside an MMA's k are permuted so that a lane loads 16 bytes of one
//   token row for four k-steps of S (dims 16·qd.. of a 64-dim span: k-step i takes bytes
//   4i..4i+3), and the output dims inside the 16 n-blocks of P·V are permuted so that a lane
//   loads 16 bytes of each of its four token rows (n-block j, column n is dim 16n + j of the
//   warp's tile). Q is loaded in the matching order; O is put back in order through shared
//   memory at the end, then written out coalesced.
// Rows past a split's end (and, sparse, list entries of padding) hold no key: S is -inf there,
// and their V bytes and scales are taken as zero (the stage may hold anything there, and
// 0 · NaN is NaN). Padding heads (rows ≥ the heads that exist) have zero queries and are never
// written. mla_sparse_fp8_h16 is the sparse form: sequence b attends to the positions its key
// list names (the DSA indexer's top-k), a tile's rows gathered by one copy per entry.
#include "common.cuh"
#include "mma.cuh"
#include "tma.cuh"
#include "kv_fp8.cuh"
#include "variants.cuh"

#define H_ROWS (mla_decode_fp8_h16_v.rows)      // query rows (heads) of a block
#define H_TILE (mla_decode_fp8_h16_v.tile)      // tokens per tile
#define H_STAGES (mla_decode_fp8_h16_v.stages)  // tiles in flight
#define H_THREADS 128                           // a warp per latent tile
#define H_PAGE 64
#define H_STAGE_BYTES (H_TILE * FP8_TOKEN_BYTES)
#define H_XCHG_BYTES (4 * 16 * 32 * 4)  // four warps' partial S: 16 floats per lane
#define H_O_STRIDE 532                  // floats per row of O put back in order (+1 per 32 dims)

static_assert(H_ROWS == 16 && H_TILE == 32 && FP8_LATENT == 4 * FP8_TILE, "a warp per latent tile, 16-row MMAs");
static_assert(H_STAGES * H_STAGE_BYTES + 2 * H_XCHG_BYTES + 12 * H_STAGES == mla_decode_fp8_h16_v.shared,
              "mla_decode_fp8_h16: variants.cuh and the layout differ");
static_assert(mla_sparse_fp8_h16_v.shared == mla_decode_fp8_h16_v.shared && mla_sparse_fp8_h16_v.rows == H_ROWS &&
                  mla_sparse_fp8_h16_v.stages == H_STAGES,
              "the sparse form has the dense one's layout");
static_assert(H_ROWS * H_O_STRIDE * 4 <= H_STAGES * H_STAGE_BYTES, "O fits in the stages");

// The exchange item in buffer x where the owner of rows g and g + 8 (warp g / 2, lane
// 4·(g % 2)) leaves two floats for them: warp 1's item 0 of its own lane, read only by it.
__device__ __forceinline__ unsigned owned_rows_slot(unsigned x, int g) { return x + (4 * 32 + 8 * (g / 2) + 4 * (g % 2)) * 16; }

template <bool SPARSE>
__device__ __forceinline__ void fp8_h16(const bf16_t* q, const unsigned char* cache, const int* block_table, int max_pages, const int* indices,
                                        int topk, const int* seq_lens, float scale_log2, bf16_t* part_o, float* part_lse, int splits,
                                        int total_heads, bf16_t* out, float* lse_out) {
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned sKV = smem_addr(smem), sX = sKV + H_STAGES * H_STAGE_BYTES, mbar = sX + 2 * H_XCHG_BYTES;
    const unsigned sKeys = mbar + 8 * H_STAGES;  // [stages] the key bits of the tile in each

    let_dependents_launch();  // the merge may take its place now; it waits for our end

    const FewHeadsBlock blk = few_heads_block<H_ROWS, H_TILE>(seq_lens, splits, total_heads);
    const int b = blk.b, head0 = blk.head0, heads_here = blk.heads_here, t_begin = blk.t_begin, t_end = blk.t_end;
    const u64 out_row = blk.out_row;
    if (t_begin >= t_end) {
        decode_empty_split(heads_here, FP8_LATENT, splits, (u64)b * total_heads + head0, out_row, out, lse_out, part_o, part_lse);
        return;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qd = lane % 4;
    const int n_tiles = (t_end - t_begin + H_TILE - 1) / H_TILE;
    const int* bt = block_table + (u64)b * max_pages;

    init_stage_barriers(mbar, H_STAGES);
    // Tile j's rows by warp 0 (kv_fp8.cuh: one bulk copy of a page's consecutive rows, or a
    // copy per list entry), its key bits beside.
    TileIssuer<SPARSE, H_TILE> issuer{cache, bt, indices + (u64)b * topk, t_begin, t_end};
    auto issue_tile = [&](int j) {
        const int st = j % H_STAGES;
        issuer.issue(j, sKV + st * H_STAGE_BYTES, mbar + 8 * st, sKeys + 4 * st, lane);
    };
    if (warp == 0) {
        issuer.start(lane);
        for (int j = 0; j < H_STAGES && j < n_tiles; j++) issue_tile(j);
    }

    // Q as A fragments: latent dims 128·warp + 64·span + 16·qd + 4i.. for k-step 4·span + i
    // (rows g and g + 8, each times its power of two), RoPE dims 16·warp + 4·qd.. in bf16.
    unsigned qa[8][4], qr[4];
    float unscale[2];
    {
        float v[2][32];
        uint2 rope[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = g + 8 * r;
            const bf16_t* src = q + ((u64)b * total_heads + head0 + row) * (FP8_LATENT + FP8_ROPE);
#pragma unroll
            for (int span = 0; span < 2; span++) fp8_query16(src + FP8_TILE * warp + 64 * span + 16 * qd, row < heads_here, v[r] + 16 * span);
            rope[r] = row < heads_here ? *(const uint2*)(src + FP8_LATENT + 16 * warp + 4 * qd) : make_uint2(0, 0);
        }
        float f[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float amax = 0.0f;
#pragma unroll
            for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(v[r][k]));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
            f[r] = f16_row_factor(amax);
            unscale[r] = 1.0f / f[r];
        }
#pragma unroll
        for (int ks = 0; ks < 8; ks++) {
            const int at = 16 * (ks / 4) + 4 * (ks % 4);
            qa[ks][0] = pack_f16(v[0][at] * f[0], v[0][at + 1] * f[0]);
            qa[ks][1] = pack_f16(v[1][at] * f[1], v[1][at + 1] * f[1]);
            qa[ks][2] = pack_f16(v[0][at + 2] * f[0], v[0][at + 3] * f[0]);
            qa[ks][3] = pack_f16(v[1][at + 2] * f[1], v[1][at + 3] * f[1]);
        }
        qr[0] = rope[0].x;
        qr[1] = rope[1].x;
        qr[2] = rope[0].y;
        qr[3] = rope[1].y;
    }

    // O of rows g, g + 8: n-block j, columns 2qd, 2qd + 1 (dims 128·warp + 16·n + j).
    float o[16][4];
#pragma unroll
    for (int j = 0; j < 16; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f}, sigma = 0.0f;

    // Tile j, whose rows hold keys where `keys` has bits. FULL: all 32 do (every tile of a dense
    // split but its last), so no row is tested: compiled apart, that body has an eighth fewer
    // instructions (the tests, and the address arithmetic of the loads they guard).
    auto tile = [&](int j, unsigned keys, auto full) {
        constexpr bool FULL = decltype(full)::value;
        const unsigned kv = sKV + (j % H_STAGES) * H_STAGE_BYTES;
        auto is_key = [&](int r) { return FULL || ((keys >> r) & 1u); };

        // This warp's part of S for the tile: n-block nb is tokens 8nb.., lane's B column g.
        float sc[4][4], ts[4][2];
#pragma unroll
        for (int nb = 0; nb < 4; nb++) {
            const unsigned row = kv + (8 * nb + g) * FP8_TOKEN_BYTES;
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, accr[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int span = 0; span < 2; span++) {
                const uint4 kb = fp8_ld_shared16(row + FP8_TILE * warp + 64 * span + 16 * qd);
                const u32 w[4] = {kb.x, kb.y, kb.z, kb.w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const unsigned bfr[2] = {e4m3x2_f16x2<0>(w[i]), e4m3x2_f16x2<1>(w[i])};
                    mma_f16(acc, qa[4 * span + i], bfr);
                }
            }
            const uint2 kr = fp8_ld_shared8(row + FP8_ROPE_AT + 2 * (16 * warp + 4 * qd));
            const unsigned br[2] = {kr.x, kr.y};
            mma_bf16(accr, qr, br);
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int tok = 8 * nb + 2 * qd + c;
                ts[nb][c] = is_key(tok) ? fp8_ld_shared_f32(kv + tok * FP8_TOKEN_BYTES + FP8_SCALES_AT + 4 * warp) : 0.0f;
                sc[nb][c] = acc[c] * unscale[0] * ts[nb][c] + accr[c];
                sc[nb][2 + c] = acc[2 + c] * unscale[1] * ts[nb][c] + accr[2 + c];
            }
        }
        // The four warps' parts summed in one order, each warp for the rows it owns: rows
        // 2·warp + (lane / 4) % 2 and that + 8, tokens 8·(lane / 8) + 2·(lane % 4) + {0, 1},
        // i.e. item lane / 8 of lane 8·warp + lane % 8 of the exchange (four lanes' loads
        // instead of sixteen, and a quarter of the softmax each).
        const unsigned x = sX + (j & 1) * H_XCHG_BYTES;
#pragma unroll
        for (int nb = 0; nb < 4; nb++) xchg_store<4>(x, warp, lane, nb, sc[nb]);
        __syncthreads();
        // Everyone is done with tile j − 1: its stage takes tile j − 1 + H_STAGES.
        if (warp == 0 && j > 0 && j - 1 + H_STAGES < n_tiles) {
            fence_proxy_async();
            issue_tile(j - 1 + H_STAGES);
        }
        const int own_nb = lane / 8, own_lane = 8 * warp + lane % 8;
        float p[4];
        {
            const float4 sum = xchg_sum<4>(x, own_lane, own_nb);
            const int tok = 8 * own_nb + 2 * qd;
            p[0] = is_key(tok) ? sum.x * scale_log2 : -INFINITY;
            p[1] = is_key(tok + 1) ? sum.y * scale_log2 : -INFINITY;
            p[2] = is_key(tok) ? sum.z * scale_log2 : -INFINITY;
            p[3] = is_key(tok + 1) ? sum.w * scale_log2 : -INFINITY;
        }
        // Online softmax in base 2 over the owned rows: a row's 32 scores lie in the 16 lanes
        // that share bit 2 of the lane.
        float mx[2] = {fmaxf(p[0], p[1]), fmaxf(p[2], p[3])}, own_alpha[2];
#pragma unroll
        for (int sh = 1; sh <= 16; sh <<= 1) {
            if (sh == 4) continue;
            mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], sh));
            mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], sh));
        }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            own_alpha[r] = raise_max(m_run[r], mx[r]);
            const float m_use = exp_base(m_run[r]);
            p[2 * r] = fast_exp2(p[2 * r] - m_use);
            p[2 * r + 1] = fast_exp2(p[2 * r + 1] - m_use);
            l_run[r] = l_run[r] * own_alpha[r] + (p[2 * r] + p[2 * r + 1]);
        }
        // P goes back where its scores came from (warp 0's item own_nb of lane own_lane, which
        // only this lane read); lanes 0 and 4 leave the owned rows' factors in their
        // owned_rows_slot (own_lane is 8·warp + 4·(g % 2) there).
        asm volatile("st.shared.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(x + (own_nb * 32 + own_lane) * 16), "f"(p[0]), "f"(p[1]), "f"(p[2]),
                     "f"(p[3]));
        if ((lane & ~4) == 0)
            asm volatile("st.shared.v2.f32 [%0], {%1,%2};\n" ::"r"(x + (4 * 32 + own_lane) * 16), "f"(own_alpha[0]), "f"(own_alpha[1]));
        __syncthreads();
        // This lane's P in the accumulators' layout (rows g, g + 8), and those rows' factors.
#pragma unroll
        for (int nb = 0; nb < 4; nb++)
            asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                         : "=f"(sc[nb][0]), "=f"(sc[nb][1]), "=f"(sc[nb][2]), "=f"(sc[nb][3])
                         : "r"(x + (nb * 32 + lane) * 16));
        float alpha[2];
        asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];\n" : "=f"(alpha[0]), "=f"(alpha[1]) : "r"(owned_rows_slot(x, g)));

        // σ grows to cover this tile's scales (this warp's latent tile).
        float smax = 0.0f;
#pragma unroll
        for (int nb = 0; nb < 4; nb++) smax = fmaxf(smax, fmaxf(ts[nb][0], ts[nb][1]));
#pragma unroll
        for (int sh = 1; sh <= 2; sh <<= 1) smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, sh));
        const float grow = fp8_sigma_grow(smax, sigma);
        const float inv_sigma = sigma > 0.0f ? 1.0f / sigma : 0.0f;  // 0: all scales 0 so far
#pragma unroll
        for (int r = 0; r < 2; r++) alpha[r] *= grow;  // O is also in units of σ
        // Most tiles change neither the maxima nor σ: then O stays as it is.
        if (!__all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f))
#pragma unroll
            for (int n = 0; n < 16; n++) {
                o[n][0] *= alpha[0];
                o[n][1] *= alpha[0];
                o[n][2] *= alpha[1];
                o[n][3] *= alpha[1];
            }

        // O += (P · scale / σ) · v̂ over two k-steps of 16 tokens.
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            unsigned pa[4];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int nb = 2 * kk + h;
                const float s0 = ts[nb][0] * inv_sigma, s1 = ts[nb][1] * inv_sigma;
                pa[2 * h] = pack_f16(sc[nb][0] * s0, sc[nb][1] * s1);
                pa[2 * h + 1] = pack_f16(sc[nb][2] * s0, sc[nb][3] * s1);
            }
            // Rows 2qd, 2qd + 1, 2qd + 8, 2qd + 9 of the k-step: 16 bytes each (zero past the end).
            uint4 vr[4];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int tok = 16 * kk + 2 * qd + (k & 1) + 8 * (k >> 1);
                vr[k] = is_key(tok) ? fp8_ld_shared16(kv + tok * FP8_TOKEN_BYTES + FP8_TILE * warp + 16 * g) : make_uint4(0, 0, 0, 0);
            }
            const u32 v0[4] = {vr[0].x, vr[0].y, vr[0].z, vr[0].w}, v1[4] = {vr[1].x, vr[1].y, vr[1].z, vr[1].w};
            const u32 v8[4] = {vr[2].x, vr[2].y, vr[2].z, vr[2].w}, v9[4] = {vr[3].x, vr[3].y, vr[3].z, vr[3].w};
#pragma unroll
            for (int a = 0; a < 4; a++) {
                // Byte e of a row's word a is n-block 4a + e: pair it with the next row's.
                const u32 lo01 = prmt(v0[a], v1[a], 0x5140), hi01 = prmt(v0[a], v1[a], 0x7362);
                const u32 lo89 = prmt(v8[a], v9[a], 0x5140), hi89 = prmt(v8[a], v9[a], 0x7362);
                unsigned bv[2];
                bv[0] = e4m3x2_f16x2<0>(lo01), bv[1] = e4m3x2_f16x2<0>(lo89);
                mma_f16(o[4 * a], pa, bv);
                bv[0] = e4m3x2_f16x2<1>(lo01), bv[1] = e4m3x2_f16x2<1>(lo89);
                mma_f16(o[4 * a + 1], pa, bv);
                bv[0] = e4m3x2_f16x2<0>(hi01), bv[1] = e4m3x2_f16x2<0>(hi89);
                mma_f16(o[4 * a + 2], pa, bv);
                bv[0] = e4m3x2_f16x2<1>(hi01), bv[1] = e4m3x2_f16x2<1>(hi89);
                mma_f16(o[4 * a + 3], pa, bv);
            }
        }
    };
    for (int j = 0; j < n_tiles; j++) {
        mbar_wait(mbar + 8 * (j % H_STAGES), (j / H_STAGES) & 1);
        unsigned keys;  // bit r: row r of the tile holds a key
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(keys) : "r"(sKeys + 4 * (j % H_STAGES)));
        if (keys == 0xffffffffu)
            tile(j, keys, Const<1>{});
        else
            tile(j, keys, Const<0>{});
    }

    // The owned rows' sums over their 16 lanes; their LSEs (lanes 0 and 4); the sums to every
    // warp through the exchange buffer the last tile did not use.
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int sh = 1; sh <= 16; sh <<= 1)
            if (sh != 4) l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], sh);
    const float ln2 = 0.6931471805599453f;
    const unsigned xl = sX + (n_tiles & 1) * H_XCHG_BYTES;
    if ((lane & ~4) == 0) {
        asm volatile("st.shared.v2.f32 [%0], {%1,%2};\n" ::"r"(xl + (4 * 32 + 8 * warp + lane) * 16), "f"(l_run[0]), "f"(l_run[1]));
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = 2 * warp + lane / 4 + 8 * r;
            if (row >= heads_here) continue;  // padding: not written
            const float lse = l_run[r] > 0.0f ? (m_run[r] + log2f(l_run[r])) * ln2 : -INFINITY;
            if (splits == 1)
                lse_out[(u64)b * total_heads + head0 + row] = lse;
            else
                part_lse[out_row + row] = lse;
        }
    }

    // O in dim order through shared memory (the stages are free: every copy issued has landed
    // and been read), then out row by row.
    __syncthreads();
    float l_rows[2];
    asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];\n" : "=f"(l_rows[0]), "=f"(l_rows[1]) : "r"(owned_rows_slot(xl, g)));
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float k = l_rows[r] > 0.0f ? sigma / l_rows[r] : 0.0f;
        const int row = g + 8 * r;
#pragma unroll
        for (int j = 0; j < 16; j++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int dim = FP8_TILE * warp + 16 * (2 * qd + c) + j;
                asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(sKV + (row * H_O_STRIDE + dim + dim / 32) * 4), "f"(o[j][2 * r + c] * k));
            }
    }
    __syncthreads();
    fp8_store_o(sKV, H_O_STRIDE, heads_here, splits, out, (u64)b * total_heads + head0, part_o, out_row);
}

extern "C" __global__ void __launch_bounds__(H_THREADS, 2) mla_decode_fp8_h16(const bf16_t* q, const unsigned char* cache, const int* block_table,
                                                                          int max_pages, const int* seq_lens, float scale_log2, bf16_t* part_o,
                                                                          float* part_lse, int splits, int total_heads, bf16_t* out,
                                                                          float* lse_out) {
    fp8_h16<false>(q, cache, block_table, max_pages, nullptr, 0, seq_lens, scale_log2, part_o, part_lse, splits, total_heads, out, lse_out);
}

// The sparse form: sequence b attends to the entries 0..seq_lens[b] of row b of `indices`
// ([batch, topk] token positions, -1 padding), the splits and tiles running over the entries.
extern "C" __global__ void __launch_bounds__(H_THREADS, 2) mla_sparse_fp8_h16(const bf16_t* q, const unsigned char* cache, const int* block_table,
                                                                          int max_pages, const int* indices, int topk, const int* seq_lens,
                                                                          float scale_log2, bf16_t* part_o, float* part_lse, int splits,
                                                                          int total_heads, bf16_t* out, float* lse_out) {
    fp8_h16<true>(q, cache, block_table, max_pages, indices, topk, seq_lens, scale_log2, part_o, part_lse, splits, total_heads, out, lse_out);
}
