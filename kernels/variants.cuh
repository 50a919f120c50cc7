// The tensor-core kernel variants of mladb, each described once, here. The kernels take their
// tiles and stages from these rows and check at compile time that their shared-memory layout
// adds up to the bytes given; the Rust launcher (src/backend/cuda/variants.rs) reads the same
// rows, from this file, for the shared memory it requests and the tiles it plans with. A row
// changed here changes both; a layout changed in a kernel without its row fails to compile.
//
// KERNEL_VARIANT(kernel, rows, tile, stages, shared bytes)
//   rows:   query rows of a block (decode: the heads of a group; prefill: query tokens)
//   tile:   keys per tile; stages: tiles in flight
//   shared: dynamic shared memory per block, in bytes (TMA layouts include 1 KB of slack to
//           align their swizzled tiles to 1024 bytes)
// The rows are parsed by the launcher: one per line, plain integers, nothing else on the line.
#pragma once

struct KernelVariant {
    int rows, tile, stages;
    unsigned shared;
};
#define KERNEL_VARIANT(kernel, rows, tile, stages, shared) \
    constexpr KernelVariant kernel##_v{rows, tile, stages, shared};

// The dense decode (mla_decode_sm90.cu, mla_decode_splitk.cu, mla_decode.cu).
KERNEL_VARIANT(mla_decode_wgmma, 64, 32, 4, 227112)
KERNEL_VARIANT(mla_decode_kt3, 64, 32, 3, 226328)
KERNEL_VARIANT(mla_decode_kt16, 32, 16, 4, 85536)
KERNEL_VARIANT(mla_decode_ks3, 64, 32, 3, 226816)
KERNEL_VARIANT(mla_decode_ks2, 64, 32, 2, 189440)
KERNEL_VARIANT(mla_decode_t32, 64, 32, 2, 155904)
KERNEL_VARIANT(mla_decode_t16, 64, 16, 1, 97792)
// The dense decode with the page-index-overflow fault planted (32-bit page offsets).
KERNEL_VARIANT(mla_decode_ks3_o32, 64, 32, 3, 226816)
KERNEL_VARIANT(mla_decode_t16_o32, 64, 16, 1, 97792)
// The sparse decode: its dense twin's layout and a ring of row lookups (sparse.cuh); the
// wgmma one its twin's and the key bits of each stage.
KERNEL_VARIANT(mla_sparse_wgmma, 64, 32, 4, 227128)
KERNEL_VARIANT(mla_sparse_ks3, 64, 32, 3, 228864)
KERNEL_VARIANT(mla_sparse_ks2, 64, 32, 2, 191488)
KERNEL_VARIANT(mla_sparse_t32, 64, 32, 2, 157952)
KERNEL_VARIANT(mla_sparse_t16, 64, 16, 1, 98816)
// The sparse decode for up to 8 heads (mla_sparse_h8.cu): bf16 rows gathered by bulk copies
// into 1168-byte rows, two stages, two exchange buffers, two barriers (full, empty) and the key
// bits per stage.
KERNEL_VARIANT(mla_sparse_h8, 8, 32, 2, 82984)
// The decode over an fp8_ds_mla cache: its bf16 twin's layout (rows converted in place).
KERNEL_VARIANT(mla_decode_fp8_ks3, 64, 32, 3, 226816)
KERNEL_VARIANT(mla_decode_fp8_ks2, 64, 32, 2, 189440)
KERNEL_VARIANT(mla_decode_fp8_t32, 64, 32, 2, 155904)
KERNEL_VARIANT(mla_decode_fp8_t16, 64, 16, 1, 97792)
// The decode over an fp8_ds_mla cache on wgmma (Hopper): its bf16 twin's Q, three bf16 stages,
// two raw stages of 32 rows of 656 bytes with two barriers each and key bits, P, row data, the
// key bits of the bf16 stages; the sparse form the same.
KERNEL_VARIANT(mla_decode_wgmma_fp8, 64, 32, 3, 232276)
KERNEL_VARIANT(mla_sparse_wgmma_fp8, 64, 32, 3, 232276)
// The FP8-cache decode for a rank's few heads (mla_decode_fp8.cu): 16 rows, raw 656-byte rows in
// four stages, the four warps' partial S exchanged through two buffers, a barrier and the key
// bits per stage.
KERNEL_VARIANT(mla_decode_fp8_h16, 16, 32, 4, 100400)
// The same for up to 8 heads with the heads as the MMAs' columns (mla_decode_fp8_h8.cu): three
// stages, two exchange buffers of 4 KB, full and empty barriers (the sparse form's producer).
KERNEL_VARIANT(mla_decode_fp8_h8, 8, 32, 3, 71228)
// Their sparse forms (the rows of a tile gathered by list entry): the same layouts.
KERNEL_VARIANT(mla_sparse_fp8_h16, 16, 32, 4, 100400)
KERNEL_VARIANT(mla_sparse_fp8_h8, 8, 32, 3, 71228)
// The flash prefill (flash_prefill_sm90.cu, flash_prefill.cu), per head dims: d256 is
// 256/256 (GLM-5), d192 is 192/128 (DeepSeek-V3). k*: tiles by TMA; r*: by cp.async.
KERNEL_VARIANT(flash_prefill_wgmma_d256, 128, 64, 2, 197664)
KERNEL_VARIANT(flash_prefill_k128t64_d256, 128, 64, 2, 199712)
KERNEL_VARIANT(flash_prefill_k128t64_d192, 128, 64, 2, 134176)
KERNEL_VARIANT(flash_prefill_r128t64_d256, 128, 64, 2, 202752)
KERNEL_VARIANT(flash_prefill_r128t64_d192, 128, 64, 2, 137216)
KERNEL_VARIANT(flash_prefill_k64t32_d256, 64, 32, 2, 100384)
KERNEL_VARIANT(flash_prefill_k64t32_d192, 64, 32, 2, 67616)
KERNEL_VARIANT(flash_prefill_r64t64_d256, 64, 64, 1, 101376)
KERNEL_VARIANT(flash_prefill_r64t64_d192, 64, 64, 1, 68608)
KERNEL_VARIANT(flash_prefill_r128t32_d256, 128, 32, 2, 135168)
KERNEL_VARIANT(flash_prefill_r128t32_d192, 128, 32, 2, 94208)
KERNEL_VARIANT(flash_prefill_r64t32_d256, 64, 32, 1, 67584)
KERNEL_VARIANT(flash_prefill_r64t32_d192, 64, 32, 1, 47104)
