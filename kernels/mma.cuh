// Tensor-core building blocks that every architecture from sm_80 on has (Ampere, Hopper,
// Blackwell including sm_120): mma.sync m16n8k16 with bf16 operands and f32 accumulators,
// ldmatrix to load operand fragments from shared memory, cp.async for global -> shared copies,
// cvt to bf16x2 and ex2.approx. Shared-memory operands are 32-bit shared-window addresses
// (computed once per thread, then offset by constants), which keeps address arithmetic out of
// the inner loops.
#pragma once

// D = A·B + D for a 16×16 (A, row-major) by 16×8 (B, column-major) bf16 tile, f32 accumulators.
__device__ __forceinline__ void mma_bf16(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// D = A·B + D for a 16×16 by 16×8 f16 tile, f32 accumulators (f16 holds every E4M3 value
// exactly: the FP8-cache decode's operands).
__device__ __forceinline__ void mma_f16(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two floats as f16 (round to nearest even) in one register: low half = a.
__device__ __forceinline__ unsigned pack_f16(float a, float b) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(b), "f"(a));
    return r;
}

// The 8×8 b16 matrix whose fragments the warp holds (lane l: row l/4, columns 2(l%4)..), transposed.
__device__ __forceinline__ unsigned movmatrix_trans(unsigned a) {
    unsigned r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(a));
    return r;
}

// Bytes of a and b picked by `sel` (PTX prmt: nibble i of sel names byte i of the result, 0–3
// from a, 4–7 from b).
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned r;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// Four 8×8 b16 matrices; lane l gives the row address of matrix l/8, row l%8.
__device__ __forceinline__ void ldsm_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x2(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// 16-byte asynchronous copy global -> shared (bypassing L1).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// 4-byte asynchronous copy global -> shared, through L1 (the only way for 4 bytes).
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void st_shared_zero16(unsigned dst) {
    asm volatile("st.shared.v4.u32 [%0], {%1,%1,%1,%1};\n" ::"r"(dst), "r"(0));
}
__device__ __forceinline__ unsigned ld_shared_u32(unsigned src) {
    unsigned x;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(x) : "r"(src) : "memory");
    return x;
}
__device__ __forceinline__ void st_shared_u32(unsigned dst, unsigned x) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(dst), "r"(x) : "memory");
}
__device__ __forceinline__ void st_shared_f2(unsigned addr, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1,%2};\n" ::"r"(addr), "f"(a), "f"(b));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ROWS rows of WIDTH bf16 from global memory (row r at src + r·WIDTH) into shared memory rows
// STRIDE bf16 apart at dst, by cp.async over THREADS threads, as one committed group; rows from
// `valid` on are zeroed instead of read (a decode block's query rows past the last head).
template <int ROWS, int WIDTH, int STRIDE, int THREADS>
__device__ __forceinline__ void load_rows_zero_padded(unsigned dst, const bf16_t* src, int valid) {
    constexpr int CHUNKS = WIDTH / 8;  // 16-byte chunks per row
    for (int c = threadIdx.x; c < ROWS * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, k = (c % CHUNKS) * 8;
        if (r < valid)
            cp_async16(dst + (r * STRIDE + k) * 2, src + (u64)r * WIDTH + k);
        else
            st_shared_zero16(dst + (r * STRIDE + k) * 2);
    }
    cp_async_commit();
}

// Two floats as bf16 (round to nearest even) in one register: low half = a.
__device__ __forceinline__ unsigned pack_bf16(float a, float b) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(b), "f"(a));
    return r;
}

// 2^x, approximate (2 ulp), flushing denormals; 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// The online softmax's running maximum of a row (base 2) raised to cover a tile's maximum `mx`:
// returns what the row's running sum and O must be multiplied by (1 while the row has seen no
// finite score, whose maximum stays -inf).
__device__ __forceinline__ float raise_max(float& m_run, float mx) {
    const float m_new = fmaxf(m_run, mx);
    const float alpha = m_new == -INFINITY ? 1.0f : fast_exp2(m_run - m_new);
    m_run = m_new;
    return alpha;
}
// The same raised lazily (the Hopper kernels, wgmma.cuh): only when `mx` passes the maximum by
// more than `slack`, so the factor is exactly 1 on most tiles and the scores may be
// exponentiated against a maximum up to `slack` below theirs. -inf + slack is -inf: a row's
// first finite score always raises it (factor 0).
__device__ __forceinline__ float raise_max_lazy(float& m_run, float mx, float slack) {
    if (!(mx > m_run + slack)) return 1.0f;
    const float alpha = fast_exp2(m_run - mx);
    m_run = mx;
    return alpha;
}
// The maximum a row's scores are exponentiated against: 0 while it is -inf, so that a masked
// score gives 2^-inf = 0 rather than NaN.
__device__ __forceinline__ float exp_base(float m_run) { return m_run == -INFINITY ? 0.0f : m_run; }
