// MLA decode for Hopper (sm_90a only; the portable kernels of mla_decode.cu run everywhere else):
// the same absorbed attention of one query token per sequence over the paged latent cache, with
// the same split-KV outputs and merge, but with the KV tiles brought in by TMA and multiplied by
// warpgroup MMAs (wgmma) that read their operands from shared memory.
//
// Why TMA: three kernels with very different compute (mla_decode_ks3, and this one with two
// stages of 64 tokens or four of 32, loaded by cp.async) all stopped at 38–45% of the copy
// bandwidth on the H200 with one block per multiprocessor; the same kernel with its tiles
// loaded by TMA (one thread issues nine box copies per tile, the copy engine of the
// multiprocessor does the rest and signals a shared-memory barrier) reaches 85–94%.
//
// Block = (split, sequence, group of 64 heads), two warpgroups, one block per multiprocessor
// (Q 72 KB + four 36 KB stages of 32 tokens + P 4 KB = 220 KB of shared memory). Q comes by TMA
// too, in nine swizzled boxes of 64 rows × 64 dims: as 128 threads' cp.async chunks it took
// 4 µs to land, a fifth of a batch-1 decode (on the H200, stamped with %globaltimer). The last group
// of a head count off a multiple of 64 is padded as in mla_decode.cu: zero query rows, whose
// results are never written.
//   Warpgroup 0: S = Q·Kᵀ (64 heads × 32 tokens, 36 MMAs over the 576 dims; the first 16 take
//     Q from registers, the rest from shared memory), the online softmax (exact row maxima: it
//     holds the whole tile's S), P in bf16 to shared memory with each row's rescale factor, then
//     O[:, 0:256] += P·V with P straight from its registers.
//   Warpgroup 1: issues the TMA copies (one thread), then per tile rescales O[:, 256:512] and
//     adds P·V from shared memory.
// So warpgroup 1's P·V of tile j runs beside warpgroup 0's S and softmax of tile j+1, and
// warpgroup 0's own P·V of tile j is still in flight when it issues S of tile j+1. Tile j + 3
// is copied into the stage of tile j − 1 while tile j is computed: two to three tiles in flight.
//
// Shared layouts. KV tiles: as TMA's 128-byte swizzle writes them, nine boxes of 32 tokens × 64
// dims (128-byte rows, 16-byte chunks permuted within 8-row atoms); the same tile is K-major B
// for S (tokens = N, dims = K) and N-major B for P·V (tokens = K, dims = N). Q the same way in
// boxes of 64 rows (K-major A for S). The box of a group of fewer than 64 heads holds the next
// sequence's rows (or TMA's zeros past the last): those rows are computed, never written. P: 8×8
// core matrices (8 rows of 8 bf16, 128 contiguous bytes) without swizzling.
// Rows of a split's last tile past its end are zeroed after the copy lands (P = 0 there, and
// 0 · NaN would still be NaN).
//
// The sparse twin (mla_sparse_wgmma) walks sequence b's key list (entries of row b of `indices`,
// token positions, -1 padding) instead of its first tokens. TMA cannot gather rows on Hopper:
// one-row boxes land where the 32-row box would have put them (the 128-byte swizzle follows the
// shared-memory address), but nine per row ran at 13% of the copy bandwidth, and even four rows
// of a tile by TMA beside cp.async for the rest slowed the kernel by a quarter (the copy engine
// takes about a hundred cycles per box). So warpgroup 1 copies a tile's rows itself: 16-byte
// cp.async chunks written to where TMA's 128-byte swizzle would have put them, each thread's
// copies arriving on the stage's barrier as they complete (cp.async.mbarrier.arrive.noinc),
// never waited for by it.
// Padding entries and entries past the list's end come as zeros (zero-fill copies); their
// scores are masked by the tile's key bits, which thread 0 writes beside the stage and publishes
// with one more arrival. Every warp looks the 32 rows of a tile up a tile ahead (lane r: row r;
// list entry two tiles ahead, page one tile ahead), so the lookups never stall.
//
// Handshakes:
//   full[s]  (TMA barrier) tile in stage s landed: both warpgroups wait on its phase
//   EMPTY[s] warpgroup 0 is done with stage s   (0 arrives, 1 waits before reloading it)
//   P_FULL   P and the rescale factors written   (0 arrives, 1 waits)
//   P_EMPTY  warpgroup 1's P·V has read P       (1 arrives, 0 waits before writing the next)
//   TAIL     a short tile's tail is zeroed       (1 arrives, 0 waits)
//   MERGED   a pair's merged rows are staged     (the merging warpgroup, before its bulk stores)
// (named barriers: the side that waits uses bar.sync, the other bar.arrive).
#include "common.cuh"
#include "mma.cuh"
#include "tma.cuh"
#include "kv_fp8.cuh"
#include "wgmma.cuh"
#include "variants.cuh"

#define W_HEADS 64
#define W_DQK 576
#define W_DV 512
#define W_PAGE 64
#define W_TILE (mla_decode_wgmma_v.tile)      // tokens per tile (half a page of the cache)
#define W_STAGES (mla_decode_wgmma_v.stages)
#define W_SLAB 9216                            // 8 rows of 576
#define W_Q_BYTES (8 * W_SLAB)                 // 64 rows of 576
#define W_QBOX_BYTES (W_HEADS * 128)           // one TMA box of Q: 64 rows × 64 dims
#define W_TILE_BYTES (W_TILE / 8 * W_SLAB)     // W_TILE rows of 576
#define W_P_BYTES (W_HEADS * W_TILE * 2)
#define W_SC (W_TILE / 2)                      // S accumulators per thread
#define W_KS (W_TILE / 16)                     // k-steps of P·V per tile

#define W_BOX_BYTES (W_TILE * 128)             // one TMA box: W_TILE rows × 64 dims
// S's MMAs are m64n32: a tile is 32 tokens (64-token tiles were slower on every shape: see the
// README's third session of 2026-12-06).
static_assert(W_TILE == 32, "mla_decode_wgmma: S is written for 32-token tiles");
#define W_Q_REG_STEPS 16                       // k-steps of S with Q in registers (of 36)

// Q, the KV stages, P, the rescale factors, row sums and row maxima, the TMA barriers (one per
// stage, one for Q), 1 KB of alignment slack: the bytes of the kernel's row in variants.cuh.
static_assert(mla_decode_wgmma_v.rows == W_HEADS &&
                  W_Q_BYTES + W_STAGES * W_TILE_BYTES + W_P_BYTES + 3 * W_HEADS * 4 + (W_STAGES + 1) * 8 + 1024 == mla_decode_wgmma_v.shared,
              "mla_decode_wgmma: variants.cuh and the layout differ");
// The sparse twin: the same, and the key bits of each stage's tile.
static_assert(mla_sparse_wgmma_v.rows == W_HEADS && mla_sparse_wgmma_v.tile == W_TILE && mla_sparse_wgmma_v.stages == W_STAGES &&
                  mla_decode_wgmma_v.shared + 4 * W_STAGES == mla_sparse_wgmma_v.shared,
              "mla_sparse_wgmma: variants.cuh and the layout differ");
// The FP8-cache forms: three bf16 stages, then two raw stages (the bulk copies' 32 rows of 656
// bytes), their two barriers each (landed, read) and key bits, the key bits of the bf16 stages
// (dense too, so that both forms take the same bytes).
#define W_FP8_STAGES (mla_decode_wgmma_fp8_v.stages)
#define W_RAW_STAGES 2
static_assert(mla_decode_wgmma_fp8_v.rows == W_HEADS && mla_decode_wgmma_fp8_v.tile == W_TILE &&
                  W_Q_BYTES + W_FP8_STAGES * W_TILE_BYTES + W_RAW_STAGES * FP8_RAW_TILE_BYTES + W_P_BYTES + 3 * W_HEADS * 4 +
                          (W_FP8_STAGES + 1) * 8 + W_RAW_STAGES * 20 + 4 * W_FP8_STAGES + 1024 ==
                      mla_decode_wgmma_fp8_v.shared &&
                  mla_sparse_wgmma_fp8_v.shared == mla_decode_wgmma_fp8_v.shared && mla_sparse_wgmma_fp8_v.stages == W_FP8_STAGES,
              "mla_decode_wgmma_fp8: variants.cuh and the layout differ");
static_assert(W_HEADS * 520 * 4 <= W_FP8_STAGES * W_TILE_BYTES + W_RAW_STAGES * FP8_RAW_TILE_BYTES, "the partials' rows fit the stages");
#define BAR_EMPTY 1  // + stage
#define BAR_P_FULL (1 + W_STAGES)
#define BAR_P_EMPTY (2 + W_STAGES)
#define BAR_TAIL (3 + W_STAGES)
#define BAR_MERGED (4 + W_STAGES)  // the merging warpgroup of a pair has staged its rows

// A half of an FP8 tile's conversion, as a type (the warpgroups' halves are compiled apart).
template <int H> using Half = Const<H>;

#include "pair_merge_sm90.cuh"

// A 16-byte cp.async that copies zeros instead when `real` is false (nothing is read then), and
// the arrival on a barrier once this thread's earlier cp.async writes have landed.
__device__ __forceinline__ void cp_async16_or_zero(unsigned dst, const void* src, bool real) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(real ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_arrive(unsigned mbar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(mbar) : "memory");
}

// The rows of a sparse tile, looked up ahead by the 32 lanes of a warp (lane r: entry r of each
// tile): the position and page of the next tile to issue, the position of the one after.
struct RowsAhead {
    const int* list;  // the sequence's key list
    const int* bt;    // its block-table row
    int t_begin, t_end, lane;
    int pos, page, pos_next;

    __device__ __forceinline__ int entry(int j) const {
        const int i = t_begin + j * W_TILE + lane;
        return i < t_end ? list[i] : -1;
    }
    __device__ __forceinline__ void start() {
        pos = entry(0);
        page = pos >= 0 ? bt[pos / W_PAGE] : 0;
        pos_next = entry(1);
    }
    // The cache row of this lane's entry of tile j (the next to issue; -1 for none), then the
    // lookups move a tile on: the page of tile j + 1, the entry of tile j + 2 (loads left in
    // flight until tile j + 1 is issued).
    __device__ __forceinline__ int take(int j) {
        const int row = pos >= 0 ? page * W_PAGE + pos % W_PAGE : -1;
        pos = pos_next;
        page = pos >= 0 ? bt[pos / W_PAGE] : 0;
        pos_next = entry(j + 2);
        return row;
    }
};

// Warpgroup 1's P·V of a tile, issued and committed, not waited for: its slice of O (columns
// 256..511) times the tile's rescale factors, then P (shared memory, descriptor dp) times the V
// columns 256..511 of the stage at `stage`.
__device__ __forceinline__ void second_half_pv(float* o, float alpha0, float alpha1, u64 dp, unsigned stage) {
    wg_rescale_o(o, alpha0, alpha1);
    const u64 dv = wg_desc_sw128(stage + 4 * W_BOX_BYTES, W_BOX_BYTES, 1024);
    wg_fence();
#pragma unroll
    for (int i = 0; i < 128; i++) wg_hold(o[i]);
#pragma unroll
    for (int ks = 0; ks < W_KS; ks++) wgmma_m64n256_ss(o, dp + ks * 16, dv + ks * (2048 / 16), 1);
    wg_commit();
}

// FP8 (mla_decode_wgmma_fp8, mla_sparse_wgmma_fp8): the cache is fp8_ds_mla rows (656 bytes),
// copied raw into two raw stages by bulk copies (warp 0 of warpgroup 1, kv_fp8.cuh's
// TileIssuer), and each tile is turned into the bf16 tile TMA writes for the bf16 kernel
// (fp8_slice_*: E4M3 × scale rounded to bf16, as FlashMLA's FP8 decode also computes on bf16),
// two tiles ahead of its use, half by each warpgroup while its own MMAs run. The MMAs are then
// the bf16 kernel's, bit for bit. Three bf16 stages fit beside the raw ones. On the H200 this
// is bound by shared memory, not by the cache's bytes: each tile's S re-reads Q (72 KB) and
// the conversion adds the raw tile's reads and the bf16 tile's stores (57 KB) to the MMAs'
// 144 KB; with no copies at all it took 197 µs at batch 64 × 8k, 64 heads (the bf16 kernel
// 166 µs with its whole cache traffic).
template <bool SPARSE, bool FP8>
__device__ __forceinline__ void decode_wgmma(const TmaMap* cache_map, const TmaMap* q_map, const TmaMap* qpe_map, const void* cache_bytes, const int* block_table, int max_pages,
                                             const int* indices, int topk, const int* seq_lens, float scale_log2, bf16_t* part_o,
                                             float* part_lse, int splits, int total_heads, bf16_t* out, float* lse_out) {
    // The swizzled stages need 1024-byte alignment; the host gives 1 KB of slack for it.
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    constexpr int STAGES = FP8 ? W_FP8_STAGES : W_STAGES;
    constexpr unsigned RAW_BYTES = FP8 ? W_RAW_STAGES * FP8_RAW_TILE_BYTES : 0;
    const bf16_t* cache = (const bf16_t*)cache_bytes;
    const unsigned sQ = smem_addr(smem), sKV = sQ + W_Q_BYTES, sRaw = sKV + STAGES * W_TILE_BYTES, sP = sRaw + RAW_BYTES;
    unsigned char* p_base = smem + (sP - sQ);
    float* sAlpha = (float*)(p_base + W_P_BYTES);  // [64] rescale factors of the tile
    float* sL = sAlpha + W_HEADS;                  // [64] row sums at the end
    float* sM = sL + W_HEADS;                      // [64] row maxima (base 2) at the end
    const unsigned mbar = smem_addr(sM + W_HEADS); // [STAGES] 8-byte TMA barriers
    const unsigned mbar_q = mbar + 8 * STAGES;     // Q's TMA barrier
    // FP8, [W_RAW_STAGES] each: the raw stages' copies landed, read by all 256 threads, their
    // tiles' key bits. SPARSE: [STAGES] the key bits of each bf16 stage's tile.
    const unsigned mbar_raw = mbar_q + 8, mbar_raw_read = mbar_raw + 8 * W_RAW_STAGES;
    const unsigned sRawKeys = mbar_raw + (FP8 ? 16 * W_RAW_STAGES : 0);
    const unsigned sKeys = sRawKeys + (FP8 ? 4 * W_RAW_STAGES : 0);

    const int split = blockIdx.x, b = blockIdx.y, head0 = blockIdx.z * W_HEADS;
    const int heads_here = min(W_HEADS, total_heads - head0);  // the rest of the group is padding
    let_dependents_launch();  // the merge may take its place now; it waits for our end
    // The query's copy first: it needs neither the length nor the block table, whose loads the
    // tiles' copies wait for.
    if (threadIdx.x == 0) {
        prefetch_tensormap(q_map);
        prefetch_tensormap(qpe_map);
        if (!SPARSE && !FP8) prefetch_tensormap(cache_map);
        // Dense: the TMA issuer's arrival. Sparse: warpgroup 1's 128 copy arrivals and thread 0's.
        // FP8: all 256 threads' arrivals once converted; a raw stage: its copy issuer's, and
        // all 256 threads' once they have read it.
        for (int st = 0; st < STAGES; st++) mbar_init(mbar + 8 * st, FP8 ? 256 : SPARSE ? 129 : 1);
        for (int st = 0; FP8 && st < W_RAW_STAGES; st++) {
            mbar_init(mbar_raw + 8 * st, 1);
            mbar_init(mbar_raw_read + 8 * st, 256);
        }
        mbar_init(mbar_q, 1);
        mbar_init_fence();
        // Launched as a dependent of the kernel before (the previous call's merge, say), the
        // block was placed and set up while that kernel finished; nothing it may have written
        // is read before this.
        wait_for_prior_kernel();
        // Q: the group's 64 rows of this sequence, from row b·heads + head0 of the latent part
        // [rows, 512] (eight boxes) and the RoPE part [rows, 64] (the ninth), wherever the two lie.
        mbar_expect_bytes(mbar_q, W_Q_BYTES);
#pragma unroll
        for (int c = 0; c < W_DQK / 64; c++) {
            const bool rope = c >= W_DV / 64;
            tma_load_2d(sQ + c * W_QBOX_BYTES, rope ? qpe_map : q_map, mbar_q, rope ? 0 : c * 64, b * total_heads + head0);
        }
    }
    wait_for_prior_kernel();
    const DecodeSplit range = decode_split(seq_lens[b], splits, split, W_TILE);
    const int t_begin = range.begin, t_end = range.end;
    const u64 out_row = ((u64)b * splits + split) * total_heads + head0;

    // Two splits launched as a cluster merge each other's results (see the end); an empty one
    // still takes part, with no tiles.
    const bool pair = cluster_ctas() == 2;
    if (pair && splits != 2) __trap();  // the launcher pairs exactly two splits
    if (t_begin >= t_end && !pair) {  // an empty split (or sequence): nothing to attend to
        decode_empty_split(heads_here, W_DV, splits, (u64)b * total_heads + head0, out_row, out, lse_out, part_o, part_lse);
        if (threadIdx.x == 0) mbar_wait(mbar_q, 0);  // the query's copy lands before the block leaves
        return;
    }

    __syncthreads();

    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, qd = lane % 4;
    const int r0 = 16 * warp + g, r1 = r0 + 8;  // the two rows (heads) of this thread
    const int n_tiles = (t_end - t_begin + W_TILE - 1) / W_TILE;
    const int* bt = block_table + (u64)b * max_pages;
    // Whether tile j is the split's last and ends before its 32 rows do (the rows past the end
    // are zeroed by warpgroup 1 after the copy lands, and warpgroup 0 waits for that).
    // (Sparse tiles have no tail: their missing rows come as zeros, masked by the key bits.)
    auto short_tile = [&](int j) { return !SPARSE && !FP8 && t_end - (t_begin + j * W_TILE) < W_TILE; };

    // This warpgroup's 64 × 256 slice of O: element 4·n + e is row (e < 2 ? r0 : r1), column
    // 8·n + 2·qd + e % 2 of the slice.
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

    // FP8: raw tile c into raw stage c % W_RAW_STAGES by warp 0 of warpgroup 1 (kv_fp8.cuh's
    // TileIssuer: dense, lane 0 copies the tile's valid rows, one page whose number it loaded a
    // tile ahead; sparse, a row per list entry, its lookups ahead), with its key bits, and its
    // conversion into bf16 stage c % STAGES, half H by warpgroup H:
    // warpgroup 0 the dims its own P·V reads (and half the RoPE), while its S of the tile two
    // before runs; warpgroup 1 the rest, while its P·V of that tile runs. A raw stage is
    // refilled with tile c + W_RAW_STAGES once all 256 threads have read tile c.
    const unsigned char* cache8 = (const unsigned char*)cache_bytes;
    TileIssuer<SPARSE, W_TILE, FP8_TOKEN_BYTES, FP8_TOKEN_BYTES, true> issuer{cache8, bt, SPARSE ? indices + (u64)b * topk : nullptr, t_begin,
                                                                               t_end};
    auto issue_raw = [&](int c) {  // warp 0 of warpgroup 1
        const int rs = c % W_RAW_STAGES;
        issuer.issue(c, sRaw + rs * FP8_RAW_TILE_BYTES, mbar_raw + 8 * rs, sRawKeys + 4 * rs, lane);
    };
    auto convert = [&](int c, auto half) {  // the caller knows bf16 stage c % STAGES is free
        constexpr int H = decltype(half)::value;
        const int rs = c % W_RAW_STAGES, st = c % STAGES, phase = (c / W_RAW_STAGES) & 1;
        mbar_wait(mbar_raw + 8 * rs, phase);
        unsigned keys;
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(keys) : "r"(sRawKeys + 4 * rs) : "memory");
        const Fp8HalfSlice slice = fp8_slice_load<H>(sRaw + rs * FP8_RAW_TILE_BYTES, warp, lane, (keys >> lane) & 1u);
        // The copy engine (the async proxy) refills the stage: these reads are ordered first.
        fence_proxy_async();
        mbar_arrive(mbar_raw_read + 8 * rs);
        if (H == 1 && c + W_RAW_STAGES < n_tiles && warp == 0) {
            mbar_wait(mbar_raw_read + 8 * rs, phase);
            issue_raw(c + W_RAW_STAGES);
        }
        fp8_slice_store<W_BOX_BYTES, H>(sKV + st * W_TILE_BYTES, slice, warp, lane);
        if (SPARSE && H == 0 && tid == 0) st_shared_u32(sKeys + 4 * st, keys);
        fence_proxy_async();  // written by st.shared, read by wgmma
        mbar_arrive(mbar + 8 * st);
    };

    if (wg == 0) {
        if constexpr (FP8)
            for (int c = 0; c < STAGES - 1 && c < n_tiles; c++) convert(c, Half<0>{});
        mbar_wait(mbar_q, 0);  // Q landed
        const u64 dq = wg_desc_sw128(sQ, 16, 1024);
        // The first W_Q_REG_STEPS k-steps of S take Q from registers (the A fragments of rows
        // r0 and r1, read once from the swizzled boxes), so that for them each tile's S reads
        // only K from shared memory: a tile's shared-memory traffic (Q 72 KB, K 36 KB, V and P
        // 40 KB, the copy's 36 KB) is most of its time. 16 is what fits: 250 registers, where
        // 18 spills and 20 makes ptxas serialise the MMAs (C7512). The FP8 forms have no room.
        constexpr int QR = FP8 ? 0 : W_Q_REG_STEPS;
        unsigned qa[4 * (QR > 0 ? QR : 1)];
#pragma unroll
        for (int kk = 0; kk < QR; kk++) {
            const unsigned box = sQ + (kk / 4) * W_QBOX_BYTES, c = 2 * (kk % 4);
            const unsigned a0 = box + r0 * 128 + 4 * qd, a1 = box + r1 * 128 + 4 * qd;
            qa[4 * kk] = ld_shared_u32(a0 + ((c ^ (r0 % 8)) << 4));
            qa[4 * kk + 1] = ld_shared_u32(a1 + ((c ^ (r1 % 8)) << 4));
            qa[4 * kk + 2] = ld_shared_u32(a0 + (((c + 1) ^ (r0 % 8)) << 4));
            qa[4 * kk + 3] = ld_shared_u32(a1 + (((c + 1) ^ (r1 % 8)) << 4));
        }
        unsigned pa[4 * W_KS];  // P as the A operand of the k-steps of P·V
        for (int j = 0; j < n_tiles; j++) {
            const int s = j % STAGES, t0 = t_begin + j * W_TILE;
            const unsigned kv = sKV + s * W_TILE_BYTES;
            mbar_wait(mbar + 8 * s, (j / STAGES) & 1);
            if (short_tile(j)) bar_sync(BAR_TAIL, 256);
            unsigned keys = 0;  // SPARSE: bit r set where row r of the tile is a key
            if constexpr (SPARSE) {
                asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(keys) : "r"(sKeys + 4 * s));
                fence_proxy_async();  // the stage was written by cp.async; wgmma reads it
            }
            float sc[W_SC];
#pragma unroll
            for (int i = 0; i < W_SC; i++) sc[i] = 0.0f;
            wg_fence();
#pragma unroll
            for (int i = 0; i < W_SC; i++) wg_hold(sc[i]);
            // K: box kk/4 (64 dims), 32 bytes per k-step inside its 128-byte rows.
            const u64 dk = wg_desc_sw128(kv, 16, 1024);
#pragma unroll
            for (int kk = 0; kk < W_DQK / 16; kk++) {
                const u64 dkk = dk + (kk / 4) * (W_BOX_BYTES / 16) + (kk % 4) * 2;
                const u64 dqk = dq + (kk / 4) * (W_QBOX_BYTES / 16) + (kk % 4) * 2;
                if (kk < QR)
                    wgmma_m64n32_rs(sc, qa + 4 * kk, dkk, kk > 0);
                else
                    wgmma_m64n32_ss(sc, dqk, dkk, kk > 0);
            }
            wg_commit();
            if (j > 0) {
                wg_wait<1>();  // the previous tile's P·V is done: its stage may be reloaded
#pragma unroll
                for (int i = 0; i < 128; i++) wg_hold(o[i]);
                if (j + STAGES - 1 < n_tiles) bar_arrive(BAR_EMPTY + (j - 1) % STAGES, 256);
            }
            // FP8: this warpgroup's half of tile j + 2 into the stage of tile j − 1, whose reads by
            // this warpgroup are done (the other's P·V reads only the other half).
            if constexpr (FP8)
                if (j + STAGES - 1 < n_tiles) convert(j + STAGES - 1, Half<0>{});
            wg_wait<0>();
#pragma unroll
            for (int i = 0; i < W_SC; i++) wg_hold(sc[i]);

            // Online softmax in base 2 over this tile (tokens past the end are -inf).
#pragma unroll
            for (int i = 0; i < W_SC; i++) {
                const int r = 8 * (i / 4) + 2 * qd + (i & 1);
                const bool key = SPARSE ? (keys >> r) & 1u : t0 + r < t_end;
                if (!key) sc[i] = -INFINITY;
            }
            float alpha[2];
            wg_online_softmax<W_TILE / 8>(sc, scale_log2, m_run, l_run, o, pa, alpha);

            // P (and the rescale factors) for warpgroup 1, once it has read the previous P.
            // P is K-major A: byte (r/8)·(W_TILE·16) + (t/8)·128 + (r%8)·16 + (t%8)·2.
            if (j > 0) bar_sync(BAR_P_EMPTY, 256);
            unsigned char* p_rows = p_base + (2 * warp) * (W_TILE * 16) + g * 16 + 4 * qd;
#pragma unroll
            for (int n = 0; n < W_TILE / 8; n++) {
                *(unsigned*)(p_rows + n * 128) = pa[4 * (n >> 1) + 2 * (n & 1)];
                *(unsigned*)(p_rows + W_TILE * 16 + n * 128) = pa[4 * (n >> 1) + 2 * (n & 1) + 1];
            }
            if (qd == 0) {
                sAlpha[r0] = alpha[0];
                sAlpha[r1] = alpha[1];
            }
            fence_proxy_async();
            bar_arrive(BAR_P_FULL, 256);

            // O[:, 0:256] += P·V (left in flight; waited for after the next tile's S is issued).
            // V as N-major B: 64-dim boxes W_BOX_BYTES apart, 8-token row groups 1024 apart.
            const u64 dv = wg_desc_sw128(kv, W_BOX_BYTES, 1024);
            wg_fence();
#pragma unroll
            for (int i = 0; i < 128; i++) wg_hold(o[i]);
#pragma unroll
            for (int ks = 0; ks < W_KS; ks++) wgmma_m64n256_rs(o, pa + 4 * ks, dv + ks * (2048 / 16), 1);
            wg_commit();
        }
        wg_wait<0>();
#pragma unroll
        for (int i = 0; i < 128; i++) wg_hold(o[i]);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
            l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
        }
        if (qd == 0) {
            sL[r0] = l_run[0];
            sL[r1] = l_run[1];
            sM[r0] = m_run[0];
            sM[r1] = m_run[1];
            const float ln2 = 0.6931471805599453f;
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const float lse = l_run[r] > 0.0f ? (m_run[r] + log2f(l_run[r])) * ln2 : -INFINITY;
                const int row = r ? r1 : r0;
                if (row >= heads_here || pair) continue;  // padding, or merged below: not written
                if (splits == 1)
                    lse_out[(u64)b * total_heads + head0 + row] = lse;
                else
                    part_lse[out_row + row] = lse;
            }
        }
    } else if constexpr (FP8) {
        if (warp == 0) {
            issuer.start(lane);
            for (int c = 0; c < W_RAW_STAGES && c < n_tiles; c++) issue_raw(c);
        }
        for (int c = 0; c < STAGES - 1 && c < n_tiles; c++) convert(c, Half<1>{});
        const u64 dp = wg_desc(sP, 128, W_TILE * 16);
        for (int j = 0; j < n_tiles; j++) {
            const int s = j % STAGES;
            bar_sync(BAR_P_FULL, 256);
            mbar_wait(mbar + 8 * s, (j / STAGES) & 1);  // long done: makes the stores visible here
            second_half_pv(o, sAlpha[r0], sAlpha[r1], dp, sKV + s * W_TILE_BYTES);
            // This warpgroup's half of tile j + 2, while the MMAs run, into the stage of tile
            // j − 1, which warpgroup 0 gave back when it issued S of tile j.
            const int next = j + STAGES - 1;
            if (next < n_tiles) {
                if (j > 0) bar_sync(BAR_EMPTY + (j - 1) % STAGES, 256);
                convert(next, Half<1>{});
            }
            wg_wait<0>();
#pragma unroll
            for (int i = 0; i < 128; i++) wg_hold(o[i]);
            if (j + 1 < n_tiles) bar_arrive(BAR_P_EMPTY, 256);
        }
    } else {
        // Tile j of this split by TMA (one thread): nine boxes of 32 rows × 64 dims, swizzled.
        auto issue_tile = [&](int j) {
            const int t0 = t_begin + j * W_TILE;
            const int row = bt[t0 / W_PAGE] * W_PAGE + t0 % W_PAGE;
            const unsigned dst = sKV + (j % STAGES) * W_TILE_BYTES, mb = mbar + 8 * (j % STAGES);
            mbar_expect_bytes(mb, W_TILE_BYTES);
#pragma unroll
            for (int c = 0; c < W_DQK / 64; c++) tma_load_2d(dst + c * W_BOX_BYTES, cache_map, mb, c * 64, row);
        };
        // SPARSE, by all 128 threads: warp w copies rows 8w.. of tile j, lane l rows 8w + l/8
        // and 8w + l/8 + 4, chunk l%8 of each of their nine 128-byte lines (a warp's copy reads
        // four whole lines).
        RowsAhead ahead{indices + (u64)b * topk, bt, t_begin, t_end, tid % 32, 0, 0, 0};
        auto issue_rows = [&](int j) {
            const int mine = ahead.take(j);
            const unsigned stage = sKV + (j % STAGES) * W_TILE_BYTES, mb = mbar + 8 * (j % STAGES);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = 8 * warp + lane / 8 + 4 * h, row = __shfl_sync(0xffffffffu, mine, r);
                const bf16_t* src = cache + (u64)max(row, 0) * W_DQK + 8 * (lane % 8);
                const unsigned dst = stage + r * 128 + (((lane % 8) ^ (r % 8)) << 4);
#pragma unroll
                for (int box = 0; box < W_DQK / 64; box++) cp_async16_or_zero(dst + box * W_BOX_BYTES, src + 64 * box, row >= 0);
            }
            cp_async_arrive(mb);
            const unsigned keys = __ballot_sync(0xffffffffu, mine >= 0);
            if (tid == 0) {
                st_shared_u32(sKeys + 4 * (j % STAGES), keys);
                mbar_arrive(mb);
            }
        };
        // A short tile, once landed: rows past the end zeroed (whole 128-byte rows of each box,
        // so the swizzle does not matter), published to warpgroup 0.
        auto zero_tail = [&](int j) {
            const int valid = t_end - (t_begin + j * W_TILE);
            const unsigned dst = sKV + (j % STAGES) * W_TILE_BYTES;
            mbar_wait(mbar + 8 * (j % STAGES), (j / STAGES) & 1);
            for (int i = tid; i < (W_TILE - valid) * (W_DQK / 8); i += 128) {
                const int row = valid + i / (W_DQK / 8), box = (i / 8) % (W_DQK / 64), c16 = i % 8;
                st_shared_zero16(dst + box * W_BOX_BYTES + row * 128 + c16 * 16);
            }
            fence_proxy_async();
            bar_arrive(BAR_TAIL, 256);
        };
        if (SPARSE) {
            ahead.start();
            for (int j = 0; j < STAGES - 1 && j < n_tiles; j++) issue_rows(j);
        } else if (!SPARSE && tid == 0) {
            for (int j = 0; j < STAGES - 1 && j < n_tiles; j++) issue_tile(j);
        }
        if (n_tiles > 0 && short_tile(0)) zero_tail(0);
        const u64 dp = wg_desc(sP, 128, W_TILE * 16);
        for (int j = 0; j < n_tiles; j++) {
            const int s = j % STAGES;
            bar_sync(BAR_P_FULL, 256);
            mbar_wait(mbar + 8 * s, (j / STAGES) & 1);  // long done: makes the copy visible here
            if constexpr (SPARSE) fence_proxy_async();     // written by cp.async, read by wgmma
            second_half_pv(o, sAlpha[r0], sAlpha[r1], dp, sKV + s * W_TILE_BYTES);
            wg_wait<0>();
#pragma unroll
            for (int i = 0; i < 128; i++) wg_hold(o[i]);
            if (j + 1 < n_tiles) bar_arrive(BAR_P_EMPTY, 256);
            // Tile j + 3 into the stage of tile j − 1 (fresh for j = 0), which warpgroup 0 gave
            // back when it issued S of tile j (so this never waits long).
            const int next = j + STAGES - 1;
            if (next < n_tiles) {
                if (j > 0) bar_sync(BAR_EMPTY + (j - 1) % STAGES, 256);
                if (SPARSE)
                    issue_rows(next);
                else if (!SPARSE && tid == 0)
                    issue_tile(next);
            }
            if (j + 1 < n_tiles && short_tile(j + 1)) zero_tail(j + 1);
        }
    }
    __syncthreads();  // row sums from warpgroup 0
    if (pair) {
        bf16_t* rows_out = out + ((u64)b * total_heads + head0) * W_DV;
        float* rows_lse = lse_out + (u64)b * total_heads + head0;
        if (heads_here > 32)
            pair_merge_halves(smem, o, sL, sM, r0, r1, wg, qd, heads_here, rows_out, rows_lse);
        else
            pair_merge_one_way(smem, o, sL, sM, r0, r1, wg, qd, heads_here, rows_out, rows_lse);
        return;
    }

    // The rows go out through shared memory (the stages, free now) and the copy engine in whole
    // rows; stored from registers, each warp's store touched 16 rows 32 bytes each. On the H200:
    // batch 16 × 8k at 64 heads (8 splits) 61 → 57.7 µs. A batch-1 block spent about 4 µs
    // (stamped with clock64) on its 128 KB of f32 partials either way, the SM's write rate: the
    // partials are bf16 since 2026-12-06 (64 KB a block; on an H100, batch 1 × 8k 17.8 → 16.7 µs,
    // 1 × 32k 31.8 → 28.5, 4 × 8k 32.0 → 29.3, 16 × 8k 71.7 → 68.0; the merge sums in f32).
    const float inv0 = sL[r0] > 0.0f ? 1.0f / sL[r0] : 0.0f, inv1 = sL[r1] > 0.0f ? 1.0f / sL[r1] : 0.0f;
    const int col = wg * 256 + 2 * qd;
#pragma unroll
    for (int n = 0; n < 32; n++) {
        st_shared_u32(sKV + (r0 * ROW_STRIDE + col + 8 * n) * 2, pack_bf16(o[4 * n] * inv0, o[4 * n + 1] * inv0));
        st_shared_u32(sKV + (r1 * ROW_STRIDE + col + 8 * n) * 2, pack_bf16(o[4 * n + 2] * inv1, o[4 * n + 3] * inv1));
    }
    fence_proxy_async();  // written by st.shared, read by the copy engine
    __syncthreads();
    if (threadIdx.x < 32) {
        for (int row = threadIdx.x; row < heads_here; row += 32) {  // padding rows are not written
            bf16_t* dst = splits == 1 ? out + ((u64)b * total_heads + head0 + row) * W_DV : part_o + (out_row + row) * W_DV;
            bulk_store(dst, sKV + row * ROW_STRIDE * 2, W_DV * 2);
        }
        bulk_store_wait();
    }
}

extern "C" __global__ void __launch_bounds__(256, 1) mla_decode_wgmma(const __grid_constant__ TmaMap cache_map, const __grid_constant__ TmaMap q_map,
                                                                   const __grid_constant__ TmaMap qpe_map, const bf16_t* cache,
                                                                   const int* block_table, int max_pages, const int* seq_lens, float scale_log2,
                                                                   bf16_t* part_o, float* part_lse, int splits, int total_heads, bf16_t* out,
                                                                   float* lse_out) {
    decode_wgmma<false, false>(&cache_map, &q_map, &qpe_map, cache, block_table, max_pages, nullptr, 0, seq_lens, scale_log2, part_o, part_lse, splits, total_heads, out,
                        lse_out);
}

// The sparse twin: lens[b] is the length of row b of `indices` ([batch, topk] positions, -1
// padding); its rows are copied by cp.async (Q's tensor maps only).
extern "C" __global__ void __launch_bounds__(256, 1) mla_sparse_wgmma(const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap qpe_map, const bf16_t* cache, const int* block_table, int max_pages,
                                                                   const int* indices, int topk, const int* lens, float scale_log2,
                                                                   bf16_t* part_o, float* part_lse, int splits, int total_heads, bf16_t* out,
                                                                   float* lse_out) {
    decode_wgmma<true, false>(nullptr, &q_map, &qpe_map, cache, block_table, max_pages, indices, topk, lens, scale_log2, part_o, part_lse, splits, total_heads, out,
                       lse_out);
}

// The FP8-cache forms (fp8_ds_mla rows converted by warpgroup 1, see decode_wgmma): the query by
// its tensor maps, the byte cache, then as their bf16 twins.
extern "C" __global__ void __launch_bounds__(256, 1) mla_decode_wgmma_fp8(const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap qpe_map,
                                                                       const unsigned char* cache, const int* block_table, int max_pages,
                                                                       const int* seq_lens, float scale_log2, bf16_t* part_o, float* part_lse,
                                                                       int splits, int total_heads, bf16_t* out, float* lse_out) {
    decode_wgmma<false, true>(nullptr, &q_map, &qpe_map, cache, block_table, max_pages, nullptr, 0, seq_lens, scale_log2, part_o, part_lse, splits,
                              total_heads, out, lse_out);
}

extern "C" __global__ void __launch_bounds__(256, 1) mla_sparse_wgmma_fp8(const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap qpe_map,
                                                                       const unsigned char* cache, const int* block_table, int max_pages,
                                                                       const int* indices, int topk, const int* lens, float scale_log2,
                                                                       bf16_t* part_o, float* part_lse, int splits, int total_heads, bf16_t* out,
                                                                       float* lse_out) {
    decode_wgmma<true, true>(nullptr, &q_map, &qpe_map, cache, block_table, max_pages, indices, topk, lens, scale_log2, part_o, part_lse, splits,
                             total_heads, out, lse_out);
}
