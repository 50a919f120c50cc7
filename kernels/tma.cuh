// TMA (the tensor memory accelerator of sm_90 and later: Hopper and both Blackwells) and the
// shared-memory barriers its copies complete. The asm bodies exist for sm_90 and later only, so
// that files including this one still compile for Ampere (whose kernels never call them).
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define TMA_ASM(...) asm volatile(__VA_ARGS__)
#else
#define TMA_ASM(...) __trap()
#endif

// Generic-proxy shared-memory accesses (st.shared, cp.async, ldmatrix) ordered with the async
// proxy's (wgmma reads, TMA writes).
__device__ __forceinline__ void fence_proxy_async() { TMA_ASM("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// A TMA descriptor (CUtensorMap), made by the driver on the host, passed by value.
struct __align__(64) TmaMap {
    u64 opaque[16];
};

// Shared-memory barriers that TMA copies complete (by bytes), waited on by phase parity.
__device__ __forceinline__ void mbar_init(unsigned addr, unsigned count) {
    TMA_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() { TMA_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_bytes(unsigned addr, unsigned bytes) {
    TMA_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(addr), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned addr) {
    TMA_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(addr) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned addr, unsigned parity) {
    TMA_ASM(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(addr),
        "r"(parity)
        : "memory");
}
// One box of a 2-D tensor (column c0, row c1 of the tensor map's coordinates) into shared
// memory at dst, completing `bytes` on the barrier at mbar.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TmaMap* map, unsigned mbar, int c0, int c1) {
    TMA_ASM(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"((u64)map), "r"(c0), "r"(c1), "r"(mbar)
        : "memory");
}

// Fetches a tensor map's descriptor ahead of its first copy.
__device__ __forceinline__ void prefetch_tensormap(const TmaMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"((u64)map) : "memory");
}

// The same for a 3-D tensor (coordinates innermost first).
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TmaMap* map, unsigned mbar, int c0, int c1, int c2) {
    TMA_ASM(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"((u64)map), "r"(c0), "r"(c1), "r"(c2), "r"(mbar)
        : "memory");
}

// `bytes` (a multiple of 16) of contiguous global memory at src (16-byte aligned) into shared
// memory at dst, completing `bytes` on the barrier at mbar: a bulk copy without a tensor map.
__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, unsigned bytes, unsigned mbar) {
    TMA_ASM("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst), "l"((u64)src),
            "r"(bytes), "r"(mbar)
            : "memory");
}

// `bytes` (a multiple of 16) of shared memory at src into global memory at dst (16-byte
// aligned) by the copy engine: whole lines, off the load/store pipe. The issuing thread calls
// bulk_store_wait before the shared memory is reused or its block ends.
__device__ __forceinline__ void bulk_store(void* dst, unsigned src, unsigned bytes) {
    TMA_ASM("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"((u64)dst), "r"(src), "r"(bytes) : "memory");
}
// Commits this thread's bulk stores and waits until they have read their shared memory.
__device__ __forceinline__ void bulk_store_wait() {
    TMA_ASM("cp.async.bulk.commit_group;\ncp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
