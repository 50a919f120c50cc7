// The pair merge of the Hopper decode (mla_decode_sm90.cu, included there after its layout
// macros W_HEADS, W_DV, W_Q_BYTES, W_STAGES, W_TILE_BYTES and BAR_MERGED): two splits launched
// as a cluster of two blocks merge each other's rows through shared memory. Hopper only.
#pragma once

// Thread-block clusters: the blocks in this one, a barrier over all their threads, and a store
// into the shared memory of block `rank` of the cluster at the place of `addr` in ours.
__device__ __forceinline__ unsigned cluster_ctas() {
    unsigned n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
    return n;
}
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void st_cluster_f32x2(unsigned addr, unsigned rank, float x, float y) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};\n" ::"r"(remote), "f"(x), "f"(y) : "memory");
}
__device__ __forceinline__ void st_cluster_f32(unsigned addr, unsigned rank, float x) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(remote), "f"(x) : "memory");
}

// The merge of a sequence's two splits launched as a cluster of two blocks (the split kernel's
// grid is then split × ...: split s is rank s), instead of partials through global memory and a
// merge kernel: the blocks trade normalised output rows and their log-sum-exps (base 2) through
// their KV stages, free by then, and the merged rows are written from there. Saves the 2 × 64 KB
// of bf16 partials (128 KB of f32 when this was measured) per sequence and head group written
// and read back. Two forms:
//   halves (more than 32 real heads): each block merges half of the columns, block 0 the first
//     256 (its warpgroup 0's slice), block 1 the last 256; each block's other warpgroup sends its
//     slice to the partner, so the two halves cross at once. At 64 heads, batch 64 × 8k, this
//     took 4–5 µs off 171–177 (on the H200) against block 1 sending all its rows one way.
//   one way (a rank's few heads): block 1 sends its real rows, block 0 merges and writes them;
//     at 8 heads the crossed halves were about 1 µs slower (batch 64 × 1k).
// Staged rows: 512 values and 8 (ROW_STRIDE), or 256 and 8 (HALF_STRIDE), so that the 8 rows of
// a warp's store fall in different banks.
#define ROW_STRIDE 520
#define HALF_STRIDE 264
// How a pair weighs its two splits' rows, from their log-sum-exps (base 2): the share of each
// and the merged natural LSE; a row with no keys in either split gives zeros and -inf.
struct PairWeights {
    float own, other, lse;
};
__device__ __forceinline__ PairWeights pair_weights(float own, float other) {
    const float top = fmaxf(own, other);
    const float w_own = top == -INFINITY ? 0.0f : exp2f(own - top), w_other = top == -INFINITY ? 0.0f : exp2f(other - top);
    const float total = w_own + w_other, ln2 = 0.6931471805599453f;
    return {total > 0.0f ? w_own / total : 0.0f, total > 0.0f ? w_other / total : 0.0f, total > 0.0f ? (top + log2f(total)) * ln2 : -INFINITY};
}
static_assert(W_HEADS * ROW_STRIDE * 4 + W_HEADS * 4 <= W_STAGES * W_TILE_BYTES, "the exchange fits the stages");
__device__ __forceinline__ void pair_merge_halves(unsigned char* smem, const float* o, const float* sL, const float* sM, int r0, int r1, int wg,
                                                  int qd, int heads_here, bf16_t* out, float* lse_out) {
    float* xo = (float*)(smem + W_Q_BYTES);  // [64][HALF_STRIDE] the partner's rows of our half
    float* xlse = xo + W_HEADS * HALF_STRIDE; // [64] their log-sum-exps (base 2)
    auto lse2 = [&](int r) { return sL[r] > 0.0f ? sM[r] + log2f(sL[r]) : -INFINITY; };
    const float inv0 = sL[r0] > 0.0f ? 1.0f / sL[r0] : 0.0f, inv1 = sL[r1] > 0.0f ? 1.0f / sL[r1] : 0.0f;
    const unsigned rank = cluster_rank();
    const int col = 2 * qd;
    cluster_sync();  // both blocks are past their tiles: the stages are free
    if (wg != (int)rank) {
#pragma unroll
        for (int n = 0; n < 32; n++) {
            if (r0 < heads_here)
                st_cluster_f32x2(smem_addr(xo + r0 * HALF_STRIDE + col + 8 * n), rank ^ 1, o[4 * n] * inv0, o[4 * n + 1] * inv0);
            if (r1 < heads_here)
                st_cluster_f32x2(smem_addr(xo + r1 * HALF_STRIDE + col + 8 * n), rank ^ 1, o[4 * n + 2] * inv1, o[4 * n + 3] * inv1);
        }
        if (qd == 0) {
            if (r0 < heads_here) st_cluster_f32(smem_addr(xlse + r0), rank ^ 1, lse2(r0));
            if (r1 < heads_here) st_cluster_f32(smem_addr(xlse + r1), rank ^ 1, lse2(r1));
        }
        cluster_sync();  // our half is in the partner
        return;
    }
    cluster_sync();
    float a[2], c[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = r ? r1 : r0;
        const PairWeights w = pair_weights(lse2(row), xlse[row]);
        a[r] = w.own * (r ? inv1 : inv0);
        c[r] = w.other;
        if (rank == 0 && qd == 0 && row < heads_here) lse_out[row] = w.lse;
    }
    // The merged half rows go out through shared memory (Q's, free now) and the copy engine.
    const unsigned staged = smem_addr(smem);
#pragma unroll
    for (int n = 0; n < 32; n++) {
        const float2 x0 = *(const float2*)(xo + r0 * HALF_STRIDE + col + 8 * n), x1 = *(const float2*)(xo + r1 * HALF_STRIDE + col + 8 * n);
        st_shared_u32(staged + (r0 * HALF_STRIDE + col + 8 * n) * 2, pack_bf16(o[4 * n] * a[0] + x0.x * c[0], o[4 * n + 1] * a[0] + x0.y * c[0]));
        st_shared_u32(staged + (r1 * HALF_STRIDE + col + 8 * n) * 2, pack_bf16(o[4 * n + 2] * a[1] + x1.x * c[1], o[4 * n + 3] * a[1] + x1.y * c[1]));
    }
    fence_proxy_async();        // written by st.shared, read by the copy engine
    bar_sync(BAR_MERGED, 128);  // this warpgroup's rows are staged
    if (threadIdx.x % 128 < 32) {
        for (int row = threadIdx.x % 128; row < heads_here; row += 32) bulk_store(out + row * W_DV + wg * 256, staged + row * HALF_STRIDE * 2, 256 * 2);
        bulk_store_wait();
    }
}

__device__ __forceinline__ void pair_merge_one_way(unsigned char* smem, const float* o, const float* sL, const float* sM, int r0, int r1, int wg,
                                           int qd, int heads_here, bf16_t* out, float* lse_out) {
    float* xo = (float*)(smem + W_Q_BYTES);  // [64][ROW_STRIDE] block 1's rows, in block 0
    float* xlse = xo + W_HEADS * ROW_STRIDE; // [64] their log-sum-exps (base 2)
    auto lse2 = [&](int r) { return sL[r] > 0.0f ? sM[r] + log2f(sL[r]) : -INFINITY; };
    const float inv0 = sL[r0] > 0.0f ? 1.0f / sL[r0] : 0.0f, inv1 = sL[r1] > 0.0f ? 1.0f / sL[r1] : 0.0f;
    const int col0 = wg * 256 + 2 * qd;
    cluster_sync();  // both blocks are past their tiles: block 0's stages are free
    if (cluster_rank() == 1) {
        // Only the group's real rows: block 0 merges no padding row (a rank's 8 heads are an
        // eighth of the exchange).
#pragma unroll
        for (int n = 0; n < 32; n++) {
            if (r0 < heads_here)
                st_cluster_f32x2(smem_addr(xo + r0 * ROW_STRIDE + col0 + 8 * n), 0, o[4 * n] * inv0, o[4 * n + 1] * inv0);
            if (r1 < heads_here)
                st_cluster_f32x2(smem_addr(xo + r1 * ROW_STRIDE + col0 + 8 * n), 0, o[4 * n + 2] * inv1, o[4 * n + 3] * inv1);
        }
        if (wg == 0 && qd == 0) {
            if (r0 < heads_here) st_cluster_f32(smem_addr(xlse + r0), 0, lse2(r0));
            if (r1 < heads_here) st_cluster_f32(smem_addr(xlse + r1), 0, lse2(r1));
        }
        cluster_sync();  // block 1's rows are in block 0
        return;
    }
    cluster_sync();
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = r ? r1 : r0;
        if (row >= heads_here) continue;  // padding: not written
        const PairWeights w = pair_weights(lse2(row), xlse[row]);
        const float inv = (r ? inv1 : inv0) * w.own, c = w.other;
        const float* theirs = xo + row * ROW_STRIDE + col0;
#pragma unroll
        for (int n = 0; n < 32; n++) {
            const float2 t = *(const float2*)(theirs + 8 * n);
            *(unsigned*)(out + row * W_DV + col0 + 8 * n) =
                pack_bf16(o[4 * n + 2 * r] * inv + t.x * c, o[4 * n + 2 * r + 1] * inv + t.y * c);
        }
        if (wg == 0 && qd == 0) lse_out[row] = w.lse;
    }
}
