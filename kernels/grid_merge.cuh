// The merge of a split decode by the split kernel's own blocks (mla_decode_sm90.cu's bf16
// forms), for grids that fit the device at once: each block writes its split's partials as
// always, counts itself in on its (sequence, head group)'s counter, waits until every split of
// the group has, then merges a share of the group's rows from every split's partials. No merge
// kernel follows, so a small decode (batch 1 × 8k: 64 blocks) saves the second launch and the
// hand-over between the kernels. An earlier form of this (a cooperative launch) lost the
// programmatic launch that lets the split kernel's blocks start while the kernel before ends;
// this one keeps it.
//
// Why it cannot deadlock: a block waits only for blocks of its own grid, and the launcher runs
// it only where the whole grid fits the multiprocessors at once (one block each: the kernel's
// shared memory), so every block it waits for is placed once the kernels before it leave. The
// wait is bounded all the same (a trap after two seconds: an error, never a hang).
//
// The counter goes back to 0 before the kernel ends (the last block to leave the wait resets
// it), so a launch with another split count finds it at 0; it is zeroed once when allocated.
#pragma once

__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}

// Where a group's partials and merged rows lie: `rows` real heads (padding rows are neither
// merged nor written), split s's row r at part_o[(s · split_rows + r) · 512] and
// part_lse[s · split_rows + r] (natural log-sum-exps), the merged row r at out[r · 512] and
// lse_out[r].
struct GridMergeRows {
    const bf16_t* part_o;
    const float* part_lse;
    bf16_t* out;
    float* lse_out;
    int rows, split_rows;
};

// By all 256 threads of the block of split `split` of `splits`, once the block's partials are
// written (plain stores, and bulk stores issued by the first warp: it waits for their writes
// here). `scratch`: 16 KB and 64 bytes of shared memory free for the block (256 threads).
__device__ __noinline__ void grid_merge(int* counter, int splits, int split, const GridMergeRows g, float* scratch) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    if (threadIdx.x < 32) {
        // The bulk stores' writes done (not only their reads of shared memory), and ordered
        // before the generic proxy's release below.
        asm volatile("cp.async.bulk.wait_group 0;\nfence.proxy.async.global;\n" ::: "memory");
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicAdd(counter, 1);
        const unsigned long long start = global_ns();
        while (ld_acquire_gpu(counter) < splits) {
            if (global_ns() - start > 2000000000ull) __trap();  // a split never came: an error, not a hang
        }
        // Past the wait: count out; the last block out resets the counter for the next launch
        // (a block still waiting sees at least `splits` until then).
        if (atomicAdd(counter, 1) == 2 * splits - 1) atomicExch(counter, 0);
    }
    __syncthreads();
    // Block `split` merges rows split, split + splits, ... of the group, up to `warps` rows a
    // pass, each by a team of warps / rows warps (at batch 1 × 8k, 64 splits of 64 heads: one
    // row, eight warps of eight splits each; at 8 splits of 64 heads: eight rows, a warp each).
    // Warp w of a team sums the team's splits w, w + team, ... over lane l's 16 dims (two
    // 16-byte loads a split, read past L1: other blocks wrote those lines), eight splits a
    // batch, then the team's sums meet in shared memory ([warps][512] floats, then each row's
    // max and total).
    float* info = scratch + warps * 512;
    const int mine = split < g.rows ? (g.rows - 1 - split) / splits + 1 : 0;
    for (int first = 0; first < mine; first += warps) {
        const int in_pass = min(warps, mine - first), team = warps / in_pass, i = warp / team;
        if (i < in_pass) {
            const int row = split + (first + i) * splits, tw = warp % team;
            const float* lse = g.part_lse + row;
            const bf16_t* base = g.part_o + (u64)row * 512 + 16 * lane;
            // A batch: the warp's next BATCH splits s0, s0 + team, ...: every lane's 32 bytes
            // of each one's row (a clamped split past the last is loaded and not used), and
            // lane k's log-sum-exp of the k-th. The first batch is issued with the LSEs the
            // row's maximum needs, so that both take one round trip, not two.
            constexpr int BATCH = 8;
            uint4 part[BATCH][2];
            float own_lse = -INFINITY;
            auto load_batch = [&](int s0) {
#pragma unroll
                for (int k = 0; k < BATCH; k++) {
                    const uint4* src = (const uint4*)(base + (u64)min(s0 + k * team, splits - 1) * g.split_rows * 512);
                    part[k][0] = __ldcg(src);
                    part[k][1] = __ldcg(src + 1);
                }
                const int own = s0 + lane * team;  // lane k < BATCH: the batch's k-th split
                own_lse = lane < BATCH && own < splits ? __ldcg(lse + (u64)own * g.split_rows) : -INFINITY;
            };
            load_batch(tw);
            constexpr int CHUNKS = 8;  // LSEs of splits lane + 32c: up to 256 splits
            static_assert(32 * CHUNKS >= 256, "every split's LSE is held");
            float lv[CHUNKS], top = -INFINITY;
#pragma unroll
            for (int c = 0; c < CHUNKS; c++) {
                const int s = lane + 32 * c;
                lv[c] = s < splits ? __ldcg(lse + (u64)s * g.split_rows) : -INFINITY;
                top = fmaxf(top, lv[c]);
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
            float total = 0.0f;
#pragma unroll
            for (int c = 0; c < CHUNKS; c++) total += lv[c] > -INFINITY ? expf(lv[c] - top) : 0.0f;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
            float acc[16];
#pragma unroll
            for (int k = 0; k < 16; k++) acc[k] = 0.0f;
            for (int s0 = tw; s0 < splits; s0 += BATCH * team) {
                if (s0 != tw) load_batch(s0);
                const float own_w = own_lse > -INFINITY ? expf(own_lse - top) : 0.0f;
#pragma unroll
                for (int k = 0; k < BATCH; k++) {
                    const float w = __shfl_sync(0xffffffffu, own_w, k);
                    if (s0 + k * team < splits && w > 0.0f) {  // a split with no keys adds nothing (not even 0 · NaN)
                        const unsigned words[8] = {part[k][0].x, part[k][0].y, part[k][0].z, part[k][0].w,
                                                   part[k][1].x, part[k][1].y, part[k][1].z, part[k][1].w};
#pragma unroll
                        for (int e = 0; e < 8; e++) {
                            acc[2 * e] += w * __uint_as_float(words[e] << 16);
                            acc[2 * e + 1] += w * __uint_as_float(words[e] & 0xffff0000u);
                        }
                    }
                }
            }
            float4* sums = (float4*)(scratch + warp * 512 + 16 * lane);
#pragma unroll
            for (int k = 0; k < 4; k++) sums[k] = make_float4(acc[4 * k], acc[4 * k + 1], acc[4 * k + 2], acc[4 * k + 3]);
            if (tw == 0 && lane == 0) {
                info[2 * i] = top;
                info[2 * i + 1] = total;
            }
        }
        __syncthreads();
        for (int item = threadIdx.x; item < in_pass * 256; item += blockDim.x) {
            const int r = item / 256, d = 2 * (item % 256), row = split + (first + r) * splits;
            const float top = info[2 * r], total = info[2 * r + 1], inv = total > 0.0f ? 1.0f / total : 0.0f;
            float x = 0.0f, y = 0.0f;
            for (int w = r * team; w < (r + 1) * team; w++) {
                const float2 v = *(const float2*)(scratch + w * 512 + d);
                x += v.x;
                y += v.y;
            }
            *(unsigned*)(g.out + (u64)row * 512 + d) = pack_bf16(x * inv, y * inv);
            if (d == 0) g.lse_out[row] = total > 0.0f ? top + logf(total) : -INFINITY;
        }
        __syncthreads();  // the scratch is read before the next pass writes it
    }
}
