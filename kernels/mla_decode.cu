// MLA decode on tensor cores: absorbed attention of one query token per sequence over the paged
// latent cache (rows of 512 c_kv + 64 k_pe in bf16), split-KV with a log-sum-exp merge, as
// FlashMLA and vLLM's Triton decode kernel do it, written with mma.sync/ldmatrix/cp.async only
// so that it runs on every architecture from sm_80 (Blackwell sm_120 included).
//
// Variants: mla_decode_ks3/ks2 (below; Hopper, B200) split the work so that far less shared
// memory is read per tile; mla_decode_t32/t16 (A100; 99 KB parts such as sm_86/89/120) follow.
// Block = (split, sequence, group of 64 heads), 8 warps. The 64×576 query block stays in shared
// memory; KV tiles of TILE tokens stream through (double-buffered with cp.async when STAGES = 2).
// Warp w owns heads 16·(w%4).. of the block and, for S = Q·Kᵀ, tokens of half (w/4) of the tile;
// for O += P·V, output dims of half (w/4). Softmax runs in base 2 on the fly (online softmax);
// each split writes its normalised output and natural-log LSE, and mla_decode_combine weighs the
// splits by exp(lse_split − lse_total).
#include "common.cuh"
#include "mma.cuh"
#include "tma.cuh"

#define HEADS 64
#define DQK 576
#define DV 512
#define STRIDE 584   // shared row stride in bf16: 1168 bytes shifts rows by 4 banks
#define PAGE 64
#define THREADS 256
#define NT_OF(TILE) ((TILE) / 2 / 8)

template <int TILE, int STAGES>
__device__ void mla_decode_k(const bf16_t* q, const bf16_t* cache, const int* block_table, int max_pages,
                             const int* seq_lens, float scale_log2, float* part_o, float* part_lse, int splits,
                             int total_heads, bf16_t* out, float* lse_out) {
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int PSTRIDE = TILE + 8;
    constexpr int CHUNKS = DQK / 8;  // 16-byte chunks per row
    bf16_t* sQ = (bf16_t*)smem;
    bf16_t* sKV = sQ + HEADS * STRIDE;
    bf16_t* sP = sKV + STAGES * TILE * STRIDE;
    float* sMax = (float*)(sP + HEADS * PSTRIDE);  // [2][HEADS]
    float* sSum = sMax + 2 * HEADS;                // [2][HEADS] (and HEADS floats spare)
    const unsigned sQ_a = smem_addr(sQ), sKV_a = smem_addr(sKV), sP_a = smem_addr(sP);

    const int split = blockIdx.x, b = blockIdx.y, head0 = blockIdx.z * HEADS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int mt = warp % 4, half = warp / 4;
    const int g = lane / 4, qd = lane % 4, mi = lane / 8;
    const DecodeSplit range = decode_split(seq_lens[b], splits, split, TILE);
    const int t_begin = range.begin, t_end = range.end;
    const u64 out_row = ((u64)b * splits + split) * total_heads + head0;

    if (t_begin >= t_end) {  // an empty split (or sequence): nothing to attend to
        decode_empty_split(HEADS, DV, splits, (u64)b * total_heads + head0, out_row, out, lse_out, part_o, part_lse);
        return;
    }

    // The query block.
    const bf16_t* qb = q + ((u64)b * total_heads + head0) * DQK;
    for (int c = threadIdx.x; c < HEADS * CHUNKS; c += THREADS) {
        int r = c / CHUNKS, k = (c % CHUNKS) * 8;
        cp_async16(sQ_a + (r * STRIDE + k) * 2, qb + (u64)r * DQK + k);
    }
    cp_async_commit();

    // One tile of TILE tokens. Tiles start at multiples of TILE (which divides PAGE), so a tile
    // lies in one page: one block-table lookup per tile. Rows past the end are zeroed.
    const int* bt = block_table + (u64)b * max_pages;
    auto load_tile = [&](int t0, int stage) {
        const bf16_t* src = cache + ((u64)bt[t0 / PAGE] * PAGE + t0 % PAGE) * DQK;
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
        const unsigned kv = sKV_a + stage * TILE * STRIDE * 2;

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
                float v = tok < t_end ? (s[nt][e] + s2[nt][e]) * scale_log2 : -INFINITY;
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
                float m_new = fmaxf(m_run[r], m_tile[r]);
                float alpha = m_new == -INFINITY ? 1.0f : fast_exp2(m_run[r] - m_new);
                l_run[r] *= alpha;
                m_run[r] = m_new;
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
    if (splits == 1) {
        // One split: this is the final result (no merge pass).
        const u64 row = (u64)b * total_heads + head0 + mt * 16 + g;
#pragma unroll
        for (int nt = 0; nt < DV / 2 / 8; nt++) {
            int dim = half * (DV / 2) + nt * 8 + qd * 2;
            *(unsigned*)(out + row * DV + dim) = pack_bf16(o[nt][0] * inv0, o[nt][1] * inv0);
            *(unsigned*)(out + (row + 8) * DV + dim) = pack_bf16(o[nt][2] * inv1, o[nt][3] * inv1);
        }
        if (qd == 0 && half == 0) {
            lse_out[row] = lse0;
            lse_out[row + 8] = lse1;
        }
        return;
    }
#pragma unroll
    for (int nt = 0; nt < DV / 2 / 8; nt++) {
        int dim = half * (DV / 2) + nt * 8 + qd * 2;
        *(float2*)(part_o + (out_row + mt * 16 + g) * DV + dim) = make_float2(o[nt][0] * inv0, o[nt][1] * inv0);
        *(float2*)(part_o + (out_row + mt * 16 + g + 8) * DV + dim) = make_float2(o[nt][2] * inv1, o[nt][3] * inv1);
    }
    if (qd == 0 && half == 0) {
        part_lse[out_row + mt * 16 + g] = lse0;
        part_lse[out_row + mt * 16 + g + 8] = lse1;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_t32(const bf16_t* q, const bf16_t* cache, const int* bt, int max_pages, const int* lens, float scale_log2,
               float* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_k<32, 2>(q, cache, bt, max_pages, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_t16(const bf16_t* q, const bf16_t* cache, const int* bt, int max_pages, const int* lens, float scale_log2,
               float* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_k<16, 1>(q, cache, bt, max_pages, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

// ---------------------------------------------------------------------------------------------
// The split-k variant (mla_decode_ks2/ks3): the same function with a work split that reads far
// less shared memory per tile, which (not DRAM) is what limits the variants above. Per 32-token
// tile, ldmatrix traffic ~211 KB instead of ~430 KB (plus 48 KB for the partial-S exchange):
//   S = Q·Kᵀ: warp (mh = w % 2, kq = w / 2) computes a partial S of 32 heads × 32 tokens over a
//     quarter of the 576 dims (32×32 warp tiles instead of 16×16 halve the operand re-reads);
//     the four k-quarters are summed through shared memory (float4 per lane, conflict-free),
//     after which warp (mh, kq) owns the 32 heads × 8 tokens of n-tile kq.
//   O += P·V: warp w owns all 64 heads × output dims 64w..64w+63, so each V element is read by
//     one warp only (P, 4 KB, by all eight).
// Softmax: a lazy running maximum per row (m_run), known to every thread for its rows (S rows
// of a warp are a subset of its O rows). P is written speculatively against m_run; a thread
// whose row grows by more than 2^8 raises a flag that __syncthreads_or (the barrier that
// publishes P anyway) makes block-uniform, and only then do the row maxima go through shared
// memory, O and the partial sums get rescaled and P is rewritten. So the common tile costs three
// barriers: tile landed, partial S exchanged, P written. Row sums stay per thread (partial over
// its tokens) and are added up through shared memory at the end. STAGES = 3 keeps two tiles in
// flight behind the one being computed (227 KB of shared memory: Hopper, B200).
#define KS_TILE 32
#define KS_PSTRIDE (KS_TILE + 8)  // 80-byte rows of P: conflict-free ldmatrix

__device__ __forceinline__ void st_shared_f4(unsigned addr, float a, float b, float c, float d) {
    asm volatile("st.shared.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d));
}

__device__ __forceinline__ float4 ld_shared_f4(unsigned addr) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr));
    return v;
}

// With TMA (mla_decode_kt3; sm_90 and later): the KV tiles come by TMA instead of cp.async, as
// nine boxes of 32 tokens × 64 dims in the 128-byte swizzle (16-byte chunk c of row r of a box
// at r·128 + ((c ^ r % 8) · 16), so the ldmatrix rows of one 8×8 matrix fall in 8 different
// chunks: no bank conflicts without padding). One thread issues a tile's copies; everyone waits
// on the stage's barrier; a split's short last tile gets its rows past the end zeroed.
template <int STAGES, bool TMA>
__device__ void mla_decode_ks(const TmaMap* cache_map, const bf16_t* q, const bf16_t* cache, const int* block_table,
                              int max_pages, const int* seq_lens, float scale_log2, float* part_o, float* part_lse,
                              int splits, int total_heads, bf16_t* out, float* lse_out) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // The swizzled TMA stages need 1024-byte alignment; the host gives 1 KB of slack for it.
    unsigned char* smem = TMA ? smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023) : smem_raw;
    constexpr int TILE = KS_TILE, PSTRIDE = KS_PSTRIDE;
    constexpr int CHUNKS = DQK / 8;  // 16-byte chunks per row
    constexpr int STAGE_BYTES = TMA ? TILE * DQK * 2 : TILE * STRIDE * 2;
    constexpr int BOX = TILE * 128;  // one TMA box: TILE rows × 64 dims
    bf16_t* sQ = (bf16_t*)smem;
    bf16_t* sKV = sQ + HEADS * STRIDE;
    unsigned char* sX = (unsigned char*)sKV + STAGES * STAGE_BYTES;  // [mh 2][nt 4][kq 4][mt 2] × 512 B
    bf16_t* sP = (bf16_t*)(sX + 2 * 4 * 4 * 2 * 512);
    float* sMax = (float*)(sP + HEADS * PSTRIDE);  // [4][HEADS]
    float* sSum = sMax + 4 * HEADS;                // [4][HEADS]
    const unsigned sQ_a = smem_addr(sQ), sKV_a = smem_addr(sKV), sX_a = smem_addr(sX), sP_a = smem_addr(sP);
    const unsigned mbar = smem_addr(sSum + 4 * HEADS);  // [STAGES] TMA barriers

    const int split = blockIdx.x, b = blockIdx.y, head0 = blockIdx.z * HEADS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int mh = warp & 1, kq = warp >> 1;
    const int g = lane / 4, qd = lane % 4, mi = lane / 8;
    const DecodeSplit range = decode_split(seq_lens[b], splits, split, TILE);
    const int t_begin = range.begin, t_end = range.end;
    const u64 out_row = ((u64)b * splits + split) * total_heads + head0;

    if (t_begin >= t_end) {  // an empty split (or sequence): nothing to attend to
        decode_empty_split(HEADS, DV, splits, (u64)b * total_heads + head0, out_row, out, lse_out, part_o, part_lse);
        return;
    }

    if (TMA) {
        if (threadIdx.x == 0) {
            for (int st = 0; st < STAGES; st++) mbar_init(mbar + 8 * st, 1);
            mbar_init_fence();
        }
        __syncthreads();
    }
    const bf16_t* qb = q + ((u64)b * total_heads + head0) * DQK;
    for (int c = threadIdx.x; c < HEADS * CHUNKS; c += THREADS) {
        int r = c / CHUNKS, k = (c % CHUNKS) * 8;
        cp_async16(sQ_a + (r * STRIDE + k) * 2, qb + (u64)r * DQK + k);
    }
    cp_async_commit();

    const int* bt = block_table + (u64)b * max_pages;
    auto load_tile = [&](int t0, int stage) {
        if (TMA) {  // by one thread: nine boxes; a fence orders earlier generic accesses first
            if (threadIdx.x == 0) {
                const int row = bt[t0 / PAGE] * PAGE + t0 % PAGE;
                const unsigned dst = sKV_a + stage * STAGE_BYTES, mb = mbar + 8 * stage;
                fence_proxy_async();
                mbar_expect_bytes(mb, STAGE_BYTES);
#pragma unroll
                for (int c = 0; c < DQK / 64; c++) tma_load_2d(dst + c * BOX, cache_map, mb, c * 64, row);
            }
            return;
        }
        const bf16_t* src = cache + ((u64)bt[t0 / PAGE] * PAGE + t0 % PAGE) * DQK;
        const unsigned dst = sKV_a + stage * STAGE_BYTES;
#pragma unroll
        for (int i = 0; i < TILE * CHUNKS / THREADS; i++) {
            int c = threadIdx.x + i * THREADS;
            int r = c / CHUNKS, k = (c % CHUNKS) * 8;
            if (t0 + r < t_end)
                cp_async16(dst + (r * STRIDE + k) * 2, src + r * DQK + k);
            else
                st_shared_zero16(dst + (r * STRIDE + k) * 2);
        }
        cp_async_commit();
    };

    // Per-lane byte addresses. S: A = Q rows of heads 32·mh.., B = K rows of tokens (two n-tiles
    // per ldmatrix.x4), both at dims 144·kq... P·V: A = P rows, B = V (transposed) at dims 64·w.
    const unsigned q_lane = sQ_a + ((mh * 32 + (mi % 2) * 8 + lane % 8) * STRIDE + kq * 144 + (mi / 2) * 8) * 2;
    const unsigned k_lane = (((mi / 2) * 8 + lane % 8) * STRIDE + kq * 144 + (mi % 2) * 8) * 2;
    const unsigned p_lane = sP_a + (((mi % 2) * 8 + lane % 8) * PSTRIDE + (mi / 2) * 8) * 2;
    const unsigned v_lane = (((mi % 2) * 8 + lane % 8) * STRIDE + warp * 64 + (mi / 2) * 8) * 2;
    const unsigned x_lane = sX_a + lane * 16;
    // With TMA, K and V addresses are made per load from a row part and a swizzled chunk.
    const int sw = lane & 7;                                               // this lane's row % 8
    const unsigned k_row = ((mi / 2) * 8 + lane % 8) * 128;                // + 16 rows for b1
    const int k_chunk = kq * 18 + (mi % 2);                                // + 2 per k-step
    const unsigned v_row = warp * BOX + ((mi % 2) * 8 + lane % 8) * 128;  // + 16 rows per k-step
    auto k_addr = [&](unsigned kv, int kk, int rows) {
        if (!TMA) return kv + k_lane + (rows * STRIDE + kk * 16) * 2;
        const int c = k_chunk + 2 * kk;
        return kv + (c >> 3) * BOX + k_row + rows * 128 + (((c & 7) ^ sw) << 4);
    };
    auto v_addr = [&](unsigned kv, int ks, int nt) {
        if (!TMA) return kv + v_lane + (ks * 16 * STRIDE + nt * 8) * 2;
        return kv + v_row + ks * 16 * 128 + ((((nt + mi / 2) & 7) ^ sw) << 4);
    };

    float o[4][8][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.0f;
    float m_run[4][2];  // rows 16·i + g + 8·r of the block (the O rows of this thread)
#pragma unroll
    for (int i = 0; i < 4; i++) m_run[i][0] = m_run[i][1] = -INFINITY;
    float l_part[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};  // S rows 32·mh + 16·mt + g + 8·r, own tokens

    load_tile(t_begin, 0);
    if (STAGES == 3) {
        if (t_begin + TILE < t_end)
            load_tile(t_begin + TILE, 1);
        else if (!TMA)
            cp_async_commit();
    }
    if (TMA) cp_async_wait<0>();  // Q (the only cp.async group)
    int stage = 0;
    for (int t0 = t_begin; t0 < t_end; t0 += TILE) {
        if (TMA) {
            const int j = (t0 - t_begin) / TILE;
            const unsigned kv = sKV_a + stage * STAGE_BYTES;
            mbar_wait(mbar + 8 * stage, (j / STAGES) & 1);
            const int valid = t_end - t0;
            if (valid < TILE)  // whole 128-byte rows of every box, so the swizzle does not matter
                for (int i = threadIdx.x; i < (TILE - valid) * CHUNKS; i += THREADS)
                    st_shared_zero16(kv + ((i % CHUNKS) / 8) * BOX + (valid + i / CHUNKS) * 128 + (i % 8) * 16);
            __syncthreads();  // tile landed (and zeroed); everyone is done with tile j − 1
            if (t0 + (STAGES - 1) * TILE < t_end) load_tile(t0 + (STAGES - 1) * TILE, (stage + STAGES - 1) % STAGES);
        } else if (STAGES == 3) {
            cp_async_wait<1>();
            __syncthreads();  // tile landed; everyone is done with the previous tile's stage and P
            const int ahead = stage == 0 ? 2 : stage - 1;
            if (t0 + 2 * TILE < t_end)
                load_tile(t0 + 2 * TILE, ahead);
            else
                cp_async_commit();  // an empty group keeps the wait count uniform
        } else {
            cp_async_wait<0>();
            __syncthreads();
            if (t0 + TILE < t_end) load_tile(t0 + TILE, stage ^ 1);
        }
        const unsigned kv = sKV_a + stage * STAGE_BYTES;

        // Partial S over this warp's quarter of the dims: 32 heads × 32 tokens, 8 chains of mma.
        float s[2][4][4];
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) s[i][j][0] = s[i][j][1] = s[i][j][2] = s[i][j][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < DQK / 16 / 4; kk++) {
            unsigned a0[4], a1[4], b0[4], b1[4];
            ldsm_x4(a0, q_lane + kk * 32);
            ldsm_x4(a1, q_lane + 16 * STRIDE * 2 + kk * 32);
            ldsm_x4(b0, k_addr(kv, kk, 0));
            ldsm_x4(b1, k_addr(kv, kk, 16));
            mma_bf16(s[0][0], a0, b0);
            mma_bf16(s[0][1], a0, b0 + 2);
            mma_bf16(s[0][2], a0, b1);
            mma_bf16(s[0][3], a0, b1 + 2);
            mma_bf16(s[1][0], a1, b0);
            mma_bf16(s[1][1], a1, b0 + 2);
            mma_bf16(s[1][2], a1, b1);
            mma_bf16(s[1][3], a1, b1 + 2);
        }

        // Exchange: keep n-tile kq, hand the other three to their owners, add theirs.
        float v[2][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                if (nt == kq) {
#pragma unroll
                    for (int e = 0; e < 4; e++) v[mt][e] = s[mt][nt][e];
                } else {
                    st_shared_f4(x_lane + (((mh * 4 + nt) * 4 + kq) * 2 + mt) * 512, s[mt][nt][0], s[mt][nt][1],
                                 s[mt][nt][2], s[mt][nt][3]);
                }
            }
        __syncthreads();
#pragma unroll
        for (int src = 0; src < 4; src++)
            if (src != kq) {
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    float4 x = ld_shared_f4(x_lane + (((mh * 4 + kq) * 4 + src) * 2 + mt) * 512);
                    v[mt][0] += x.x;
                    v[mt][1] += x.y;
                    v[mt][2] += x.z;
                    v[mt][3] += x.w;
                }
            }

        // Scores in base 2, P against the running maxima, speculatively.
        const int tok = t0 + kq * 8 + qd * 2;
        float mr[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int r = 0; r < 2; r++) mr[mt][r] = mh ? m_run[2 + mt][r] : m_run[mt][r];
        bool grow = false;
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float x = tok + (e % 2) < t_end ? v[mt][e] * scale_log2 : -INFINITY;
                v[mt][e] = x;
                grow |= x - mr[mt][e / 2] > 8.0f;
            }
        float p[2][4];
        auto write_p = [&]() {
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const float m_use = mr[mt][r] == -INFINITY ? 0.0f : mr[mt][r];
                    p[mt][2 * r] = fast_exp2(v[mt][2 * r] - m_use);
                    p[mt][2 * r + 1] = fast_exp2(v[mt][2 * r + 1] - m_use);
                    *(unsigned*)(sP + (mh * 32 + mt * 16 + g + 8 * r) * PSTRIDE + kq * 8 + qd * 2) =
                        pack_bf16(p[mt][2 * r], p[mt][2 * r + 1]);
                }
        };
        write_p();
        if (__syncthreads_or(grow)) {
            // Some row grew: its maximum over the tile goes through shared memory, every thread
            // moves the maxima of its rows alike, rescales, and P is written again.
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    float mx = fmaxf(v[mt][2 * r], v[mt][2 * r + 1]);
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    if (qd == 0) sMax[kq * HEADS + mh * 32 + mt * 16 + g + 8 * r] = mx;
                }
            __syncthreads();
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const int row = i * 16 + g + 8 * r;
                    float m_tile = fmaxf(fmaxf(sMax[row], sMax[HEADS + row]), fmaxf(sMax[2 * HEADS + row], sMax[3 * HEADS + row]));
                    float m_new = fmaxf(m_run[i][r], m_tile);
                    float alpha = m_new == -INFINITY ? 1.0f : fast_exp2(m_run[i][r] - m_new);
                    m_run[i][r] = m_new;
#pragma unroll
                    for (int nt = 0; nt < 8; nt++) {
                        o[i][nt][2 * r] *= alpha;
                        o[i][nt][2 * r + 1] *= alpha;
                    }
                    if ((i >> 1) == mh) l_part[i & 1][r] *= alpha;
                }
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int r = 0; r < 2; r++) mr[mt][r] = mh ? m_run[2 + mt][r] : m_run[mt][r];
            write_p();
            __syncthreads();
        }
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int r = 0; r < 2; r++) l_part[mt][r] += p[mt][2 * r] + p[mt][2 * r + 1];

        // O += P·V: 64 heads × this warp's 64 dims.
#pragma unroll
        for (int ks = 0; ks < TILE / 16; ks++) {
            unsigned a[4][4];
#pragma unroll
            for (int i = 0; i < 4; i++) ldsm_x4(a[i], p_lane + (i * 16 * PSTRIDE + ks * 16) * 2);
#pragma unroll
            for (int nt = 0; nt < 8; nt += 2) {
                unsigned bb[4];
                ldsm_x4_trans(bb, v_addr(kv, ks, nt));
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    mma_bf16(o[i][nt], a[i], bb);
                    mma_bf16(o[i][nt + 1], a[i], bb + 2);
                }
            }
        }
        stage = stage + 1 == STAGES ? 0 : stage + 1;
    }

    // Row sums: this thread's tokens, its quad, then the four token quarters.
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float l = l_part[mt][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            if (qd == 0) sSum[kq * HEADS + mh * 32 + mt * 16 + g + 8 * r] = l;
        }
    __syncthreads();
    const float ln2 = 0.6931471805599453f;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = i * 16 + g + 8 * r;
            const float l = (sSum[row] + sSum[HEADS + row]) + (sSum[2 * HEADS + row] + sSum[3 * HEADS + row]);
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            const float lse = l > 0.0f ? (m_run[i][r] + log2f(l)) * ln2 : -INFINITY;
            if (splits == 1) {
                const u64 orow = (u64)b * total_heads + head0 + row;
#pragma unroll
                for (int nt = 0; nt < 8; nt++)
                    *(unsigned*)(out + orow * DV + warp * 64 + nt * 8 + qd * 2) =
                        pack_bf16(o[i][nt][2 * r] * inv, o[i][nt][2 * r + 1] * inv);
                if (warp == 0 && qd == 0) lse_out[orow] = lse;
            } else {
#pragma unroll
                for (int nt = 0; nt < 8; nt++)
                    *(float2*)(part_o + (out_row + row) * DV + warp * 64 + nt * 8 + qd * 2) =
                        make_float2(o[i][nt][2 * r] * inv, o[i][nt][2 * r + 1] * inv);
                if (warp == 0 && qd == 0) part_lse[out_row + row] = lse;
            }
        }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_ks3(const bf16_t* q, const bf16_t* cache, const int* bt, int max_pages, const int* lens, float scale_log2,
               float* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_ks<3, false>(nullptr, q, cache, bt, max_pages, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_ks2(const bf16_t* q, const bf16_t* cache, const int* bt, int max_pages, const int* lens, float scale_log2,
               float* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_ks<2, false>(nullptr, q, cache, bt, max_pages, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

// The split-k kernel fed by TMA: for sm_90 and later (Hopper, B200, sm_120), where cp.async
// loads held the portable kernels to under half the copy bandwidth on the H200. The host never
// launches it below sm_90 (there it is a trap).
extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_kt3(const __grid_constant__ TmaMap cache_map, const bf16_t* q, const bf16_t* cache, const int* bt,
               int max_pages, const int* lens, float scale_log2, float* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    mla_decode_ks<3, true>(&cache_map, q, cache, bt, max_pages, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
#else
    __trap();
#endif
}

// out[b, h, :] = Σ_s exp(lse_s − lse) · O_s with lse = log Σ_s exp(lse_s). Block = (b, h, a
// quarter of the 512 dims), one warp per split up to 8 (blockDim.x = 32 × warps): the split
// weights go to shared memory once; warp w sums splits w, w + warps, ... with a float4 of 4 dims
// per lane (many loads in flight: with one query per
// sequence and many splits this merge is the larger part of the decode), then the warps' sums
// are added through shared memory.
#define MAX_SPLITS 256
#define COMBINE_WARPS 8
extern "C" __global__ void mla_decode_combine(const float* part_o, const float* part_lse, bf16_t* out, float* lse_out,
                                              int splits, int heads) {
    __shared__ float w[MAX_SPLITS];
    __shared__ float scratch[32];
    __shared__ float4 partial[COMBINE_WARPS][32];
    const int b = blockIdx.x, h = blockIdx.y, d0 = blockIdx.z * 128;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    float top = -INFINITY;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) top = fmaxf(top, part_lse[((u64)b * splits + s) * heads + h]);
    top = block_max(top, scratch);
    float total = 0.0f;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) {
        float l = part_lse[((u64)b * splits + s) * heads + h];
        float e = l > -INFINITY ? expf(l - top) : 0.0f;
        w[s] = e;
        total += e;
    }
    total = block_sum(total, scratch);  // its barriers also order the writes of w before the reads
    const u64 stride = (u64)heads * DV;
    const float* base = part_o + ((u64)b * splits * heads + h) * DV + d0 + lane * 4;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
    for (int s = warp; s < splits; s += warps) {
        float ws = w[s];
        if (ws > 0.0f) {
            float4 v = *(const float4*)(base + s * stride);
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
// four float4 loads per split in flight.
extern "C" __global__ void __launch_bounds__(256) mla_decode_combine_rows(const float* part_o, const float* part_lse, bf16_t* out,
                                                                          float* lse_out, int splits, int heads, int rows) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = blockIdx.x * 8 + warp;  // b · heads + h
    if (row >= rows) return;
    const int b = row / heads, h = row % heads;
    const float l = lane < splits ? part_lse[((u64)b * splits + lane) * heads + h] : -INFINITY;
    float top = l;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    const float w = l > -INFINITY ? expf(l - top) : 0.0f;
    float total = w;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    const u64 stride = (u64)heads * DV;
    const float* base = part_o + ((u64)b * splits * heads + h) * DV + lane * 4;
    float4 acc[4];
#pragma unroll
    for (int j = 0; j < 4; j++) acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
    for (int s = 0; s < splits; s++) {
        const float ws = __shfl_sync(0xffffffffu, w, s);
        if (ws > 0.0f) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float4 v = *(const float4*)(base + s * stride + 128 * j);
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
