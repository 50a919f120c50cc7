// MLA prefill for Hopper (sm_90a only; flash_prefill.cu's mma.sync kernels run everywhere else,
// and for head dims other than 256/256): the same causal flash attention over decompressed K/V,
// with Q, K and V brought in by TMA (zero-filled past the sequence's end) and the two products
// done by warpgroup MMAs reading shared memory, P passed from the S accumulators to P·V in
// registers.
//
// q, k: [n, heads, 256] bf16; v: [n, heads, 256] bf16; out: [n, heads, 256] bf16, lse: [n, heads]
// f32 (natural log; may be null). Block = (tile of 128 queries, head), two warpgroups of 64
// query rows each; every K/V tile of 64 keys is shared by both. Query tiles run longest-first
// (common.cuh, longest_first).
// Shared memory (all in TMA's 128-byte swizzle, boxes of 64 rows × 64 dims): Q 2 × 32 KB,
// two stages of K and V (32 KB each) = 192 KB.
// Per tile and warpgroup: S = Q·Kᵀ (16 MMAs of 64×64×16), the causal and end-of-sequence mask
// (only on the tiles that need it: the loop is split in two), the online softmax, then
// O += P·V (4 MMAs of 64×256×16 with P from registers), left in flight while the next tile's S
// is issued. A stage is reloaded (tile j + 1 into the stage of tile j − 1) once all eight warps
// have finished that tile's P·V: each counts itself done on the stage's counter and the last
// one issues the copies, so neither warpgroup waits for the other.
// Every wgmma's accumulators are touched only between a wait and the next fence, and with no
// path around the tile loop: ptxas serialises all of a kernel's wgmma otherwise (its notes
// C7514/C7515 in `mladb kernels --arch sm_90`), which cost this kernel a third of its speed.
#include "common.cuh"
#include "mma.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "variants.cuh"

#define FP_D 256
#define FP_ROWS 128
#define FP_TILE 64
#define FP_BOX (64 * 128)              // one box: 64 rows × 64 dims
#define FP_Q_BYTES (4 * FP_BOX)        // 64 rows × 256 dims, per warpgroup
#define FP_KV_BYTES (4 * FP_BOX)       // 64 keys × 256 dims
// Q (two warpgroups' rows), two stages of K and V, three TMA barriers, the stages' two done
// counters, 1 KB of alignment slack: the bytes of the kernel's row in variants.cuh.
static_assert(flash_prefill_wgmma_d256_v.rows == FP_ROWS && flash_prefill_wgmma_d256_v.tile == FP_TILE &&
                  flash_prefill_wgmma_d256_v.stages == 2 &&
                  2 * FP_Q_BYTES + 4 * FP_KV_BYTES + 3 * 8 + 2 * 4 + 1024 == flash_prefill_wgmma_d256_v.shared,
              "flash_prefill_wgmma_d256: variants.cuh and the layout differ");

extern "C" __global__ void __launch_bounds__(256, 1) flash_prefill_wgmma_d256(const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap k_map,
                                                                            const __grid_constant__ TmaMap v_map, bf16_t* out, float* lse, int n,
                                                                            int heads, float scale_log2) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    const unsigned sQ = smem_addr(smem), sK = sQ + 2 * FP_Q_BYTES, sV = sK + 2 * FP_KV_BYTES;
    const unsigned bars = sV + 2 * FP_KV_BYTES;  // [0]: Q landed, [1 + s]: stage s landed
    // [s]: warps done with stage s's tiles so far (the eighth of a tile refills the stage).
    int* const done = (int*)(smem + (bars - sQ) + 3 * 8);

    const LongestFirst block = longest_first();
    const int q0 = block.q_tile * FP_ROWS, h = block.head;
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, qd = lane % 4;
    const int kv_end = min(n, q0 + FP_ROWS);
    const int n_tiles = (kv_end + FP_TILE - 1) / FP_TILE;
    const int r_lo = q0 + 64 * wg;          // this warpgroup's first query row
    const int row0 = r_lo + 16 * warp + g;  // this thread's rows: row0 and row0 + 8

    auto issue_kv = [&](int j) {  // one thread
        const int s = j % 2;
        mbar_expect_bytes(bars + 8 * (1 + s), 2 * FP_KV_BYTES);
#pragma unroll
        for (int c = 0; c < 4; c++) {
            tma_load_3d(sK + s * FP_KV_BYTES + c * FP_BOX, &k_map, bars + 8 * (1 + s), c * 64, h, j * FP_TILE);
            tma_load_3d(sV + s * FP_KV_BYTES + c * FP_BOX, &v_map, bars + 8 * (1 + s), c * 64, h, j * FP_TILE);
        }
    };
    if (threadIdx.x == 0) {
        for (int i = 0; i < 3; i++) mbar_init(bars + 8 * i, 1);
        done[0] = done[1] = 0;
        mbar_init_fence();
        mbar_expect_bytes(bars, 2 * FP_Q_BYTES);
        for (int w = 0; w < 2; w++)
#pragma unroll
            for (int c = 0; c < 4; c++) tma_load_3d(sQ + w * FP_Q_BYTES + c * FP_BOX, &q_map, bars, c * 64, h, q0 + 64 * w);
        issue_kv(0);
        if (n_tiles > 1) issue_kv(1);
    }
    __syncthreads();

    float o[128];  // 64 rows × 256 dims: element 4·n + e is row (e < 2 ? row0 : row0 + 8), dim 8·n + 2·qd + e % 2
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};  // scaled (base-2) maxima
    unsigned pa[16];
    const bool active = r_lo < n;
    __builtin_assume(n_tiles > 0);  // no path around the loop that sets o (note C7515)
    mbar_wait(bars, 0);
    const u64 dq = wg_desc_sw128(sQ + wg * FP_Q_BYTES, 16, 1024);

    // Tile j of this warpgroup; `masked` (Const<1>) compiles the causal and end-of-sequence mask
    // in. ptxas turns the mask into predicated instructions rather than a branch, a third of the
    // softmax's instructions, so the tiles that need none run a copy of the body without it.
    auto tile = [&](int j, auto masked) {
        const int s = j % 2, t0 = j * FP_TILE;
        mbar_wait(bars + 8 * (1 + s), (j / 2) & 1);
        const bool work = active && t0 <= r_lo + 63;  // warpgroup-uniform
        // Tile j − 1's P·V done in this warp: the last of the eight refills that stage with
        // tile j + 1. Called as soon as that is known (before the softmax): a refill issued
        // after P·V instead landed too late for tile j + 1 (12–23% slower at 4k and 8k on an H100).
        auto release = [&]() {
#pragma unroll
            for (int i = 0; i < 128; i++) wg_hold(o[i]);
            if (j >= 1 && j + 1 < n_tiles) {
                __syncwarp();
                if (lane == 0) {
                    unsigned before;  // acquire-release at the block's scope, no full fence
                    asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], 1;\n"
                                 : "=r"(before)
                                 : "r"(smem_addr(&done[(j - 1) % 2]))
                                 : "memory");
                    if ((before & 7) == 7) issue_kv(j + 1);
                }
            }
        };
        if (!work) {  // no row of this warpgroup sees these keys (or it has no rows)
            wg_wait<0>();
            release();
            return;
        }
        float sc[32];
#pragma unroll
        for (int i = 0; i < 32; i++) sc[i] = 0.0f;
        wg_fence();
#pragma unroll
        for (int i = 0; i < 32; i++) wg_hold(sc[i]);
        const u64 dk = wg_desc_sw128(sK + s * FP_KV_BYTES, 16, 1024);
#pragma unroll
        for (int kk = 0; kk < FP_D / 16; kk++) {
            const u64 off = (kk / 4) * (FP_BOX / 16) + (kk % 4) * 2;
            wgmma_m64n64_ss(sc, dq + off, dk + off, kk > 0);
        }
        wg_commit();
        wg_wait<0>();  // this S and the previous P·V (waiting for the P·V alone serialises)
        release();
#pragma unroll
        for (int i = 0; i < 32; i++) wg_hold(sc[i]);

        if constexpr (decltype(masked)::value) {
            // Key t0 + 2·qd + c (c = 8·(i / 4) + i % 2 for element i) is seen by a row up to
            // the row itself and the sequence's last key: c ≤ last[row].
            int last[2];
#pragma unroll
            for (int r = 0; r < 2; r++) last[r] = min(row0 + 8 * r, n - 1) - t0 - 2 * qd;
#pragma unroll
            for (int i = 0; i < 32; i++)
                if (8 * (i / 4) + (i & 1) > last[(i >> 1) & 1]) sc[i] = -INFINITY;
        }
        float alpha[2];
        wg_online_softmax<8>(sc, scale_log2, m_run, l_run, o, pa, alpha);
        // V as N-major B: 64-dim boxes FP_BOX apart, 8-key row groups 1024 apart.
        const u64 dv = wg_desc_sw128(sV + s * FP_KV_BYTES, FP_BOX, 1024);
        wg_fence();
#pragma unroll
        for (int i = 0; i < 128; i++) wg_hold(o[i]);
#pragma unroll
        for (int ks = 0; ks < 4; ks++) wgmma_m64n256_rs(o, pa + 4 * ks, dv + ks * (2048 / 16), 1);
        wg_commit();
    };
    // Tiles before n_plain lie wholly at or below this warpgroup's first row and inside the
    // sequence; the rest (one or two: the diagonal and the end) are masked. The second loop
    // always runs, so no path goes around both (note C7515).
    const int n_plain = min(n_tiles - 1, min(r_lo + 1, n) / FP_TILE);
    for (int j = 0; j < n_plain; j++) tile(j, Const<0>{});
    for (int j = n_plain; j < n_tiles; j++) tile(j, Const<1>{});
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < 128; i++) wg_hold(o[i]);

#pragma unroll
    for (int r = 0; r < 2; r++) {
        float l = l_run[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int row = row0 + 8 * r;
        if (row >= n) continue;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        bf16_t* dst = out + ((u64)row * heads + h) * FP_D + 2 * qd;
#pragma unroll
        for (int nb = 0; nb < 32; nb++)
            *(unsigned*)(dst + 8 * nb) = pack_bf16(o[4 * nb + 2 * r] * inv, o[4 * nb + 2 * r + 1] * inv);
        if (qd == 0 && lse) lse[(u64)row * heads + h] = l > 0.0f ? (m_run[r] + log2f(l)) * 0.6931471805599453f : -INFINITY;
    }
}
