// MLA decode on tensor cores, the split-k variants (mla_decode_ks3/ks2 with cp.async,
// mla_decode_kt3 with TMA; mla_decode_kt16, 32 heads a block, for 99 KB parts): the same block, work and output as mla_decode_t32/t16 in
// mla_decode.cu (see the top of that file; the last head group is padded the same way), with the
// work inside a block divided so that far less shared memory is read per tile. The splits are
// merged by mla_decode_combine(_rows) there. mla_sparse_ks3/ks2 are the sparse twins of
// mla_decode_ks3/ks2 (SPARSE: see the top of mla_decode.cu; cp.async only, since TMA boxes
// cannot gather rows).
#include "common.cuh"
#include "mma.cuh"
#include "tma.cuh"
#include "kv_fp8.cuh"
#include "sparse.cuh"
#include "variants.cuh"

#define DQK 576
#define DV 512
#define STRIDE 584   // shared row stride in bf16: 1168 bytes shifts rows by 4 banks
#define PAGE 64
#define THREADS 256

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
//
// The 32-head form (mla_decode_kt16; TMA only): 32 heads × 16-token tiles, for the 99 KB of
// shared memory of sm_86/89/120 parts. Its query block lives in registers, not shared memory:
// warp (mh, kq) only ever reads its own 16 heads × 144 dims of Q for S, 36 registers a lane,
// which leaves four TMA stages in 84 KB. A 16-token tile has two n-tiles for four k-quarters,
// so the exchange hands out (n-tile, row half) pieces: warp (mh, kq) owns rows g + 8·(kq % 2)
// of its 16 heads over n-tile kq / 2. P rows are 16 + 8 bf16 (48 bytes: conflict-free too).

__device__ __forceinline__ void st_shared_f4(unsigned addr, float a, float b, float c, float d) {
    asm volatile("st.shared.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d));
}

__device__ __forceinline__ float2 ld_shared_f2(unsigned addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
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
// The shared memory of mla_decode_ks, as byte offsets from the (TMA: 1024-aligned) base: Q, the
// KV stages, the partial-S exchange, P, the maxima and sums ([4][BH] each), then the TMA
// barriers or (SPARSE) the ring of row lookups. BYTES (with TMA's 1 KB of alignment slack) is
// checked against the variant's row in variants.cuh.
// BH: heads of a block (64, or 32 with Q in registers); TILE: tokens per tile (32, or 16).
template <int BH, int TILE, int STAGES, bool TMA, bool SPARSE> struct SplitKSmem {
    static_assert((BH == 64 && TILE == 32) || (BH == 32 && TILE == 16 && TMA && !SPARSE),
                  "the split-k layouts: 64 heads × 32 tokens, or 32 × 16 fed by TMA");
    static constexpr bool QREG = BH == 32;                 // Q in registers (no shared copy)
    static constexpr int MT_S = BH / 32;                   // m-tiles of a warp's S rows
    static constexpr int OWN_R = TILE == 32 ? 2 : 1;       // row halves a lane owns after the exchange
    static constexpr unsigned STAGE = TMA ? TILE * DQK * 2 : TILE * STRIDE * 2;
    static constexpr unsigned Q = 0;
    static constexpr unsigned KV = Q + (QREG ? 0 : BH * STRIDE * 2);
    static constexpr unsigned X = KV + STAGES * STAGE;     // [mh 2][owner 4][source 4][mt] × 32 lanes
    static constexpr unsigned P = X + 2 * 4 * 4 * MT_S * 32 * OWN_R * 8;
    static constexpr unsigned SUMS = P + BH * (TILE + 8) * 2;
    static constexpr unsigned TAIL = SUMS + 8 * BH * 4;
    static constexpr unsigned BYTES = TAIL + (TMA ? STAGES * 8 + 1024 : 0) + (SPARSE ? SPARSE_RING_BYTES(TILE) : 0);
};

template <int BH, int TILE, int STAGES, bool TMA, bool SPARSE, bool FP8 = false, bool WRAP32 = false>
__device__ void mla_decode_ks(const TmaMap* cache_map, const bf16_t* q, const bf16_t* cache, const int* block_table,
                              int max_pages, const int* indices, int topk, const int* seq_lens, float scale_log2, bf16_t* part_o, float* part_lse,
                              int splits, int total_heads, bf16_t* out, float* lse_out) {
    static_assert(!(TMA && SPARSE), "the sparse tiles are gathered by cp.async");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // The swizzled TMA stages need 1024-byte alignment; the host gives 1 KB of slack for it.
    unsigned char* smem = TMA ? smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023) : smem_raw;
    using L = SplitKSmem<BH, TILE, STAGES, TMA, SPARSE>;
    constexpr bool QREG = L::QREG;
    constexpr int MT_S = L::MT_S, OWN_R = L::OWN_R, MT_O = BH / 16, NT = TILE / 8, PSTRIDE = TILE + 8;
    constexpr int CHUNKS = DQK / 8;  // 16-byte chunks per row
    constexpr int STAGE_BYTES = L::STAGE;
    constexpr int BOX = TILE * 128;  // one TMA box: TILE rows × 64 dims
    bf16_t* sQ = (bf16_t*)(smem + L::Q);
    bf16_t* sKV = (bf16_t*)(smem + L::KV);
    unsigned char* sX = smem + L::X;  // [mh 2][nt 4][kq 4][mt 2] × 512 B
    bf16_t* sP = (bf16_t*)(smem + L::P);
    float* sMax = (float*)(smem + L::SUMS);  // [4][BH]
    float* sSum = sMax + 4 * BH;             // [4][BH]
    const unsigned sQ_a = smem_addr(sQ), sKV_a = smem_addr(sKV), sX_a = smem_addr(sX), sP_a = smem_addr(sP);
    const unsigned mbar = smem_addr(smem + L::TAIL);  // [STAGES] TMA barriers
    int* ring = (int*)(smem + L::TAIL);               // SPARSE: the row lookups (sparse.cuh)

    const int split = blockIdx.x, b = blockIdx.y, head0 = blockIdx.z * BH;
    const int heads_here = min(BH, total_heads - head0);  // the rest of the group is padding
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int mh = warp & 1, kq = warp >> 1;
    const int g = lane / 4, qd = lane % 4, mi = lane / 8;
    let_dependents_launch();  // the merge may take its place now; it waits for our end
    const DecodeSplit range = decode_split(seq_lens[b], splits, split, TILE);
    const int t_begin = range.begin, t_end = range.end;
    const u64 out_row = ((u64)b * splits + split) * total_heads + head0;

    if (t_begin >= t_end) {  // an empty split (or sequence): nothing to attend to
        decode_empty_split(heads_here, DV, splits, (u64)b * total_heads + head0, out_row, out, lse_out, part_o, part_lse);
        return;
    }

    if (TMA) {
        if (threadIdx.x == 0) {
            for (int st = 0; st < STAGES; st++) mbar_init(mbar + 8 * st, 1);
            mbar_init_fence();
        }
        __syncthreads();
    }
    // The query block; padding rows are zeros (never read past the last head of q).
    const bf16_t* qb = q + ((u64)b * total_heads + head0) * DQK;
    if constexpr (!QREG) load_rows_zero_padded<BH, DQK, STRIDE, THREADS>(sQ_a, qb, heads_here);

    const int* bt = block_table + (u64)b * max_pages;
    const int* list = SPARSE ? indices + (u64)b * topk : nullptr;
    // Issuing tile j, the groups up to tile j − LAG are complete and behind a barrier.
    constexpr int LAG = STAGES - 1;
    if constexpr (SPARSE) {
        if (warp == 0) sparse_ring_start<TILE, LAG>(ring, list, bt, t_begin, t_end, lane);
        __syncthreads();
    }
    auto load_tile = [&](int t0, int stage) {
        if constexpr (SPARSE) {
            // Lane r of each warp reads the row of entry t0 + r; a chunk takes it by shuffle.
            const int mine = sparse_ring_row<TILE>(ring, t0, lane);
            const unsigned dst = sKV_a + stage * STAGE_BYTES;
#pragma unroll
            for (int i = 0; i < TILE * CHUNKS / THREADS; i++) {
                int c = threadIdx.x + i * THREADS;
                int r = c / CHUNKS, k = (c % CHUNKS) * 8;
                const int row = __shfl_sync(0xffffffffu, mine, r);
                if (row >= 0)
                    cp_async16(dst + (r * STRIDE + k) * 2, cache + (u64)row * DQK + k);
                else
                    st_shared_zero16(dst + (r * STRIDE + k) * 2);
            }
            if (warp == 0) sparse_ring_ahead<TILE, LAG>(ring, list, bt, t0, t_end, lane);
            cp_async_commit();
            return;
        }
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
        if (FP8) {  // an fp8_ds_mla cache: rows of 656 bytes, raw into the stage (kv_fp8.cuh)
            fp8_issue_tile<TILE, STRIDE, THREADS>(sKV_a + stage * STAGE_BYTES, (const unsigned char*)cache,
                                                  (u64)bt[t0 / PAGE] * PAGE + t0 % PAGE, t_end - t0);
            cp_async_commit();
            return;
        }
        const bf16_t* src = cache + paged_row<WRAP32>(bt[t0 / PAGE], t0 % PAGE, DQK);  // WRAP32: see common.cuh
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

    // Per-lane byte addresses. S: A = Q rows of heads (BH/2)·mh.., B = K rows of tokens (two
    // n-tiles per ldmatrix.x4), both at dims 144·kq... P·V: A = P rows, B = V (transposed) at
    // dims 64·w.
    const unsigned q_lane = sQ_a + ((mh * (BH / 2) + (mi % 2) * 8 + lane % 8) * STRIDE + kq * 144 + (mi / 2) * 8) * 2;
    const unsigned k_lane = (((mi / 2) * 8 + lane % 8) * STRIDE + kq * 144 + (mi % 2) * 8) * 2;
    const unsigned p_lane = sP_a + (((mi % 2) * 8 + lane % 8) * PSTRIDE + (mi / 2) * 8) * 2;
    const unsigned v_lane = (((mi % 2) * 8 + lane % 8) * STRIDE + warp * 64 + (mi / 2) * 8) * 2;
    const unsigned x_lane = sX_a + lane * 8 * OWN_R;
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
    // After the exchange a lane owns, per m-tile of its S rows, OWN_R row halves (r_own(j)) of
    // n-tile nt_own: all of n-tile kq (32-token tiles), or half kq % 2 of n-tile kq / 2 (16).
    const int nt_own = NT == 4 ? kq : kq >> 1;
    auto r_own = [&](int j) { return OWN_R == 2 ? j : (kq & 1); };
    // This lane's running maximum of O row 16·i + g + 8·r, for S's m-tile mt (i = MT_S·mh + mt).
    auto m_of = [&](const float (&m)[MT_O][2], int mt, int r) {
        return mh ? (r ? m[MT_S + mt][1] : m[MT_S + mt][0]) : (r ? m[mt][1] : m[mt][0]);
    };

    float o[MT_O][8][4];
#pragma unroll
    for (int i = 0; i < MT_O; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.0f;
    float m_run[MT_O][2];  // rows 16·i + g + 8·r of the block (the O rows of this thread)
#pragma unroll
    for (int i = 0; i < MT_O; i++) m_run[i][0] = m_run[i][1] = -INFINITY;
    float l_part[MT_S][OWN_R];  // S rows (BH/2)·mh + 16·mt + g + 8·r_own(j), own tokens
#pragma unroll
    for (int mt = 0; mt < MT_S; mt++)
#pragma unroll
        for (int j = 0; j < OWN_R; j++) l_part[mt][j] = 0.0f;

    load_tile(t_begin, 0);
    if (TMA) {
#pragma unroll
        for (int st = 1; st < STAGES - 1; st++)
            if (t_begin + st * TILE < t_end) load_tile(t_begin + st * TILE, st);
    } else if (STAGES == 3) {
        if (t_begin + TILE < t_end)
            load_tile(t_begin + TILE, 1);
        else
            cp_async_commit();
    }
    // QREG: warp (mh, kq)'s A fragments of Q (rows 16·mh + g (+8), dims 144·kq + 16·kk + 2·qd
    // (+8)), straight from global memory while the first tiles land.
    unsigned qf[QREG ? DQK / 16 / 4 : 1][4];
    if constexpr (QREG) {
        const int r0 = mh * 16 + g, r1 = r0 + 8;
        const bf16_t* q0 = qb + (u64)r0 * DQK + kq * 144 + qd * 2;
        const bf16_t* q1 = qb + (u64)r1 * DQK + kq * 144 + qd * 2;
#pragma unroll
        for (int kk = 0; kk < DQK / 16 / 4; kk++) {
            qf[kk][0] = r0 < heads_here ? *(const unsigned*)(q0 + kk * 16) : 0u;
            qf[kk][1] = r1 < heads_here ? *(const unsigned*)(q1 + kk * 16) : 0u;
            qf[kk][2] = r0 < heads_here ? *(const unsigned*)(q0 + kk * 16 + 8) : 0u;
            qf[kk][3] = r1 < heads_here ? *(const unsigned*)(q1 + kk * 16 + 8) : 0u;
        }
    }
    if (TMA) cp_async_wait<0>();  // Q (the only cp.async group; none with QREG)
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
        if constexpr (FP8) {  // the landed raw rows to bf16, in place (kv_fp8.cuh)
            fp8_expand_tile<TILE, STRIDE, THREADS>(sKV_a + stage * STAGE_BYTES, t_end - t0);
            __syncthreads();
        }
        const unsigned kv = sKV_a + stage * STAGE_BYTES;
        // Which of this thread's two tokens of S are keys; loaded ahead of the mma.
        const unsigned keys = SPARSE ? sparse_keys(list, t0 + nt_own * 8 + qd * 2, t_end, 2) : 3u;

        // Partial S over this warp's quarter of the dims: BH/2 heads × TILE tokens.
        float s[MT_S][NT][4];
#pragma unroll
        for (int i = 0; i < MT_S; i++)
#pragma unroll
            for (int j = 0; j < NT; j++) s[i][j][0] = s[i][j][1] = s[i][j][2] = s[i][j][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < DQK / 16 / 4; kk++) {
            unsigned a[MT_S][4], bk[NT / 2][4];
#pragma unroll
            for (int mt = 0; mt < MT_S; mt++) {
                if constexpr (QREG) {
#pragma unroll
                    for (int e = 0; e < 4; e++) a[mt][e] = qf[kk][e];
                } else {
                    ldsm_x4(a[mt], q_lane + mt * 16 * STRIDE * 2 + kk * 32);
                }
            }
#pragma unroll
            for (int h = 0; h < NT / 2; h++) ldsm_x4(bk[h], k_addr(kv, kk, 16 * h));
#pragma unroll
            for (int mt = 0; mt < MT_S; mt++)
#pragma unroll
                for (int h = 0; h < NT / 2; h++) {
                    mma_bf16(s[mt][2 * h], a[mt], bk[h]);
                    mma_bf16(s[mt][2 * h + 1], a[mt], bk[h] + 2);
                }
        }

        // Exchange: keep the owned piece, hand the others to their owners, add theirs. v[mt] holds
        // tokens 2·qd, 2·qd + 1 of each owned row half j at 2j, 2j + 1.
        float v[MT_S][2 * OWN_R];
        if constexpr (OWN_R == 2) {  // whole n-tiles: n-tile nt belongs to kq = nt
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int mt = 0; mt < MT_S; mt++)
                    if (nt != kq)
                        st_shared_f4(x_lane + (((mh * 4 + nt) * 4 + kq) * MT_S + mt) * 512, s[mt][nt][0], s[mt][nt][1],
                                     s[mt][nt][2], s[mt][nt][3]);
            // Selects, not s[mt][kq]: a register array indexed at run time goes to local memory.
#pragma unroll
            for (int mt = 0; mt < MT_S; mt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    v[mt][e] = kq == 0 ? s[mt][0][e] : kq == 1 ? s[mt][1][e] : kq == 2 ? s[mt][2][e] : s[mt][3][e];
        } else {  // (n-tile, row half) pieces: (nt, r) belongs to kq = 2·nt + r
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int mt = 0; mt < MT_S; mt++) {
                        const int owner = 2 * nt + r;
                        if (owner == kq) {
                            v[mt][0] = s[mt][nt][2 * r];
                            v[mt][1] = s[mt][nt][2 * r + 1];
                        } else {
                            st_shared_f2(x_lane + (((mh * 4 + owner) * 4 + kq) * MT_S + mt) * 256, s[mt][nt][2 * r],
                                         s[mt][nt][2 * r + 1]);
                        }
                    }
        }
        __syncthreads();
#pragma unroll
        for (int src = 0; src < 4; src++)
            if (src != kq) {
#pragma unroll
                for (int mt = 0; mt < MT_S; mt++) {
                    const unsigned at = x_lane + (((mh * 4 + kq) * 4 + src) * MT_S + mt) * 256 * OWN_R;
                    if constexpr (OWN_R == 2) {
                        float4 x = ld_shared_f4(at);
                        v[mt][0] += x.x;
                        v[mt][1] += x.y;
                        v[mt][2] += x.z;
                        v[mt][3] += x.w;
                    } else {
                        float2 x = ld_shared_f2(at);
                        v[mt][0] += x.x;
                        v[mt][1] += x.y;
                    }
                }
            }

        // Scores in base 2, P against the running maxima, speculatively.
        const int tok = t0 + nt_own * 8 + qd * 2;
        float mr[MT_S][OWN_R];
#pragma unroll
        for (int mt = 0; mt < MT_S; mt++)
#pragma unroll
            for (int j = 0; j < OWN_R; j++) mr[mt][j] = m_of(m_run, mt, r_own(j));
        bool grow = false;
#pragma unroll
        for (int mt = 0; mt < MT_S; mt++)
#pragma unroll
            for (int e = 0; e < 2 * OWN_R; e++) {
                float x = tok + (e % 2) < t_end && (keys >> (e % 2) & 1u) ? v[mt][e] * scale_log2 : -INFINITY;
                v[mt][e] = x;
                grow |= x - mr[mt][e / 2] > 8.0f;
            }
        float p[MT_S][2 * OWN_R];
        auto write_p = [&]() {
#pragma unroll
            for (int mt = 0; mt < MT_S; mt++)
#pragma unroll
                for (int j = 0; j < OWN_R; j++) {
                    const float m_use = mr[mt][j] == -INFINITY ? 0.0f : mr[mt][j];
                    p[mt][2 * j] = fast_exp2(v[mt][2 * j] - m_use);
                    p[mt][2 * j + 1] = fast_exp2(v[mt][2 * j + 1] - m_use);
                    *(unsigned*)(sP + (mh * (BH / 2) + mt * 16 + g + 8 * r_own(j)) * PSTRIDE + nt_own * 8 + qd * 2) =
                        pack_bf16(p[mt][2 * j], p[mt][2 * j + 1]);
                }
        };
        write_p();
        if (__syncthreads_or(grow)) {
            // Some row grew: its maximum over the tile goes through shared memory (from the
            // lanes that own its pieces), every thread moves the maxima of its rows alike,
            // rescales, and P is written again.
#pragma unroll
            for (int mt = 0; mt < MT_S; mt++)
#pragma unroll
                for (int j = 0; j < OWN_R; j++) {
                    float mx = fmaxf(v[mt][2 * j], v[mt][2 * j + 1]);
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    if (qd == 0) sMax[kq * BH + mh * (BH / 2) + mt * 16 + g + 8 * r_own(j)] = mx;
                }
            __syncthreads();
#pragma unroll
            for (int i = 0; i < MT_O; i++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const int row = i * 16 + g + 8 * r;
                    // Row half r's owners: every k-quarter (32-token tiles), or kq = r and r + 2.
                    const float m_tile = OWN_R == 2
                        ? fmaxf(fmaxf(sMax[row], sMax[BH + row]), fmaxf(sMax[2 * BH + row], sMax[3 * BH + row]))
                        : fmaxf(sMax[r * BH + row], sMax[(r + 2) * BH + row]);
                    const float alpha = raise_max(m_run[i][r], m_tile);
#pragma unroll
                    for (int nt = 0; nt < 8; nt++) {
                        o[i][nt][2 * r] *= alpha;
                        o[i][nt][2 * r + 1] *= alpha;
                    }
                    if (i / MT_S == mh)
#pragma unroll
                        for (int j = 0; j < OWN_R; j++)
                            if (r_own(j) == r) l_part[i % MT_S][j] *= alpha;
                }
#pragma unroll
            for (int mt = 0; mt < MT_S; mt++)
#pragma unroll
                for (int j = 0; j < OWN_R; j++) mr[mt][j] = m_of(m_run, mt, r_own(j));
            write_p();
            __syncthreads();
        }
#pragma unroll
        for (int mt = 0; mt < MT_S; mt++)
#pragma unroll
            for (int j = 0; j < OWN_R; j++) l_part[mt][j] += p[mt][2 * j] + p[mt][2 * j + 1];

        // O += P·V: BH heads × this warp's 64 dims.
#pragma unroll
        for (int ks = 0; ks < TILE / 16; ks++) {
            unsigned a[MT_O][4];
#pragma unroll
            for (int i = 0; i < MT_O; i++) ldsm_x4(a[i], p_lane + (i * 16 * PSTRIDE + ks * 16) * 2);
#pragma unroll
            for (int nt = 0; nt < 8; nt += 2) {
                unsigned bb[4];
                ldsm_x4_trans(bb, v_addr(kv, ks, nt));
#pragma unroll
                for (int i = 0; i < MT_O; i++) {
                    mma_bf16(o[i][nt], a[i], bb);
                    mma_bf16(o[i][nt + 1], a[i], bb + 2);
                }
            }
        }
        stage = stage + 1 == STAGES ? 0 : stage + 1;
    }

    // Row sums: this thread's tokens, its quad, then the pieces' owners.
#pragma unroll
    for (int mt = 0; mt < MT_S; mt++)
#pragma unroll
        for (int j = 0; j < OWN_R; j++) {
            float l = l_part[mt][j];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            if (qd == 0) sSum[kq * BH + mh * (BH / 2) + mt * 16 + g + 8 * r_own(j)] = l;
        }
    __syncthreads();
    const float ln2 = 0.6931471805599453f;
#pragma unroll
    for (int i = 0; i < MT_O; i++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = i * 16 + g + 8 * r;
            const float l = OWN_R == 2 ? (sSum[row] + sSum[BH + row]) + (sSum[2 * BH + row] + sSum[3 * BH + row])
                                       : sSum[r * BH + row] + sSum[(r + 2) * BH + row];
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            const float lse = l > 0.0f ? (m_run[i][r] + log2f(l)) * ln2 : -INFINITY;
            if (row >= heads_here) continue;  // padding: not written
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
                    *(unsigned*)(part_o + (out_row + row) * DV + warp * 64 + nt * 8 + qd * 2) =
                        pack_bf16(o[i][nt][2 * r] * inv, o[i][nt][2 * r + 1] * inv);
                if (warp == 0 && qd == 0) part_lse[out_row + row] = lse;
            }
        }
}

// Each entry point's stages come from its row in variants.cuh; its layout must add up to the
// row's bytes.
#define CHECK_SPLIT_K(V, BH, TILE, TMA, SPARSE)                                                          \
    static_assert(V.rows == BH && V.tile == TILE && SplitKSmem<BH, TILE, V.stages, TMA, SPARSE>::BYTES == V.shared, \
                  #V ": variants.cuh and the layout differ");
CHECK_SPLIT_K(mla_decode_ks3_v, 64, 32, false, false)
CHECK_SPLIT_K(mla_decode_ks2_v, 64, 32, false, false)
CHECK_SPLIT_K(mla_decode_kt3_v, 64, 32, true, false)
CHECK_SPLIT_K(mla_decode_kt16_v, 32, 16, true, false)
CHECK_SPLIT_K(mla_sparse_ks3_v, 64, 32, false, true)
CHECK_SPLIT_K(mla_sparse_ks2_v, 64, 32, false, true)
CHECK_SPLIT_K(mla_decode_fp8_ks3_v, 64, 32, false, false)
CHECK_SPLIT_K(mla_decode_fp8_ks2_v, 64, 32, false, false)
CHECK_SPLIT_K(mla_decode_ks3_o32_v, 64, 32, false, false)

extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_ks3(const bf16_t* q, const bf16_t* cache, const int* bt, int max_pages, const int* lens, float scale_log2,
               bf16_t* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_ks<64, 32, mla_decode_ks3_v.stages, false, false>(nullptr, q, cache, bt, max_pages, nullptr, 0, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_ks2(const bf16_t* q, const bf16_t* cache, const int* bt, int max_pages, const int* lens, float scale_log2,
               bf16_t* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_ks<64, 32, mla_decode_ks2_v.stages, false, false>(nullptr, q, cache, bt, max_pages, nullptr, 0, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

// mla_decode_ks3 with the page-index-overflow fault planted (WRAP32: its page offsets in 32
// bits, common.cuh), which the debugger runs in its place when the fault is injected.
extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_ks3_o32(const bf16_t* q, const bf16_t* cache, const int* bt, int max_pages, const int* lens, float scale_log2,
               bf16_t* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_ks<64, 32, mla_decode_ks3_o32_v.stages, false, false, false, true>(nullptr, q, cache, bt, max_pages, nullptr, 0, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

// The same over an fp8_ds_mla cache (kernels/kv_fp8.cuh), as mla_decode_fp8_t32/t16 are.
extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_fp8_ks3(const bf16_t* q, const unsigned char* cache, const int* bt, int max_pages, const int* lens, float scale_log2,
               bf16_t* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_ks<64, 32, mla_decode_fp8_ks3_v.stages, false, false, true>(nullptr, q, (const bf16_t*)cache, bt, max_pages, nullptr, 0, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_fp8_ks2(const bf16_t* q, const unsigned char* cache, const int* bt, int max_pages, const int* lens, float scale_log2,
               bf16_t* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_ks<64, 32, mla_decode_fp8_ks2_v.stages, false, false, true>(nullptr, q, (const bf16_t*)cache, bt, max_pages, nullptr, 0, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

// The split-k kernel fed by TMA: for sm_90 and later (Hopper, B200, sm_120), where cp.async
// loads held the portable kernels to under half the copy bandwidth on the H200. The host never
// launches it below sm_90 (there it is a trap).
extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_kt3(const __grid_constant__ TmaMap cache_map, const bf16_t* q, const bf16_t* cache, const int* bt,
               int max_pages, const int* lens, float scale_log2, bf16_t* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    mla_decode_ks<64, 32, mla_decode_kt3_v.stages, true, false>(&cache_map, q, cache, bt, max_pages, nullptr, 0, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
#else
    __trap();
#endif
}

// The 32-head form fed by TMA, with Q in registers (84 KB of shared memory): for the 99 KB
// parts with TMA (sm_120), where the 64-head kernels' query block and stages do not fit. Heads
// go in groups of 32, so 64 heads read each tile twice (once per group, the second mostly from
// L2), and a rank's 8 or 16 heads pad 32 rows instead of 64.
extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_kt16(const __grid_constant__ TmaMap cache_map, const bf16_t* q, const bf16_t* cache, const int* bt,
               int max_pages, const int* lens, float scale_log2, bf16_t* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    mla_decode_ks<32, 16, mla_decode_kt16_v.stages, true, false>(&cache_map, q, cache, bt, max_pages, nullptr, 0, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
#else
    __trap();
#endif
}

// The sparse twins of mla_decode_ks3/ks2: lens[b] is the length of sequence b's list,
// indices[b, 0..lens[b]] (≤ topk).
extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_sparse_ks3(const bf16_t* q, const bf16_t* cache, const int* bt, int max_pages, const int* indices, int topk,
               const int* lens, float scale_log2, bf16_t* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_ks<64, 32, mla_sparse_ks3_v.stages, false, true>(nullptr, q, cache, bt, max_pages, indices, topk, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_sparse_ks2(const bf16_t* q, const bf16_t* cache, const int* bt, int max_pages, const int* indices, int topk,
               const int* lens, float scale_log2, bf16_t* part_o, float* part_lse, int splits, int heads, bf16_t* out, float* lse_out) {
    mla_decode_ks<64, 32, mla_sparse_ks2_v.stages, false, true>(nullptr, q, cache, bt, max_pages, indices, topk, lens, scale_log2, part_o, part_lse, splits, heads, out, lse_out);
}
