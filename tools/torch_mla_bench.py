#!/usr/bin/env python3
"""The MLA decode and prefill shapes of `mladb bench --device cuda`, in plain PyTorch on the same
GPU, for the README's side-by-side table.

decode: absorbed MLA over a dense latent cache [B, ctx, 512+64] (torch gets a contiguous cache,
        no paging): scores = q·cacheᵀ (bmm), softmax in f32, out = P·cache[..., :512] (bmm).
sparse: the same decode over each sequence's top-2048 rows (random positions, sorted, in an
        unpaged cache [B·ctx, 576]) gathered by index_select; beside it the gather alone (rows
        read and written), and a read-only gather of the same rows (a Triton kernel that sums
        them, where Triton is installed): the ceilings a sparse decode's gather is weighed
        against.
prefill: causal scaled_dot_product_attention, 64 heads, head dims 256/256 (torch picks its
        flash/cuDNN kernels).
Times are medians of CUDA-event samples after a warm-up; inputs are random bf16. The caches
rotate among copies, as mladb bench's do (src/cli/bench_timing.rs): enough to cycle through five
times the L2, so that no call reads what an earlier one left there.
Usage: python3 tools/torch_mla_bench.py [--quick] [--prefill-only]
"""
import sys
import torch
import torch.nn.functional as F

HEADS, LATENT, ROPE = 64, 512, 64
ROTATION_BYTES = 5 * (50 << 20)  # five times the L2 of an H100 or H200


def rotation(make, nbytes):
    """Copies of an input of `nbytes` made by `make()`, enough to cycle through ROTATION_BYTES,
    and a function that hands them out in turn."""
    copies = [make() for _ in range(-(-ROTATION_BYTES // max(nbytes, 1 << 20)))]
    turn = [0]

    def next_copy():
        turn[0] = (turn[0] + 1) % len(copies)
        return copies[turn[0]]

    return next_copy


def timed(fn, reps=15):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record(); fn(); end.record(); torch.cuda.synchronize()
    inner = max(1, min(200, int(1.0 / max(start.elapsed_time(end), 1e-3))))
    samples = []
    for _ in range(reps):
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    samples.sort()
    return samples[len(samples) // 2]


def main():
    quick = "--quick" in sys.argv
    dev = torch.device("cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device=dev).uniform_(-1, 1)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src))
    copy = 2 * src.numel() * 2 / (ms * 1e-3) / 1e9
    del src, dst
    a = torch.empty(8192, 8192, dtype=torch.bfloat16, device=dev).uniform_(-1, 1)
    b = torch.empty_like(a).uniform_(-1, 1)
    ms = timed(lambda: a @ b.T)
    gemm = 2 * 8192**3 / (ms * 1e-3) / 1e12
    del a, b
    print(f"ceilings: copy {copy:.0f} GB/s, bf16 GEMM {gemm:.0f} TFLOP/s")

    print("\ntorch MLA decode (bmm, f32 softmax, bmm; dense cache)")
    print(f"{'batch':>6} {'context':>8} {'time us':>10} {'GB/s':>9} {'of copy':>8}")
    scale = (192 + 64) ** -0.5
    batches = [] if "--prefill-only" in sys.argv else [1, 64] if quick else [1, 16, 64, 128]
    for bsz in batches:
        for ctx in ([1024, 8192] if quick else [1024, 2048, 4096, 8192, 16384, 32768]):
            q = torch.empty(bsz, HEADS, LATENT + ROPE, dtype=torch.bfloat16, device=dev).uniform_(-1, 1)
            caches = rotation(
                lambda: torch.empty(bsz, ctx, LATENT + ROPE, dtype=torch.bfloat16, device=dev).uniform_(-1, 1),
                bsz * ctx * (LATENT + ROPE) * 2)

            def decode():
                cache = caches()
                s = torch.bmm(q, cache.transpose(1, 2)).float() * scale
                p = torch.softmax(s, dim=-1).to(torch.bfloat16)
                return torch.bmm(p, cache[:, :, :LATENT])

            ms = timed(decode)
            nbytes = bsz * ctx * (LATENT + ROPE) * 2 + bsz * HEADS * (LATENT + ROPE + LATENT) * 2
            gbs = nbytes / (ms * 1e-3) / 1e9
            print(f"{bsz:>6} {ctx:>8} {ms * 1e3:>10.1f} {gbs:>9.0f} {100 * gbs / copy:>7.0f}%")
            del q, caches

    if "--prefill-only" not in sys.argv:
        sparse(dev, copy, quick, scale)

    print("\ntorch MLA prefill (causal SDPA, 64 heads, 256/256)")
    print(f"{'tokens':>8} {'time ms':>10} {'TFLOP/s':>9} {'of GEMM':>8}")
    for n in ([1024, 4096] if quick else [1024, 2048, 4096, 8192]):
        q = torch.empty(1, HEADS, n, 256, dtype=torch.bfloat16, device=dev).uniform_(-1, 1)
        k = torch.empty_like(q).uniform_(-1, 1)
        v = torch.empty_like(q).uniform_(-1, 1)
        ms = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps=10)
        flops = 2 * HEADS * (256 + 256) * n * (n + 1) / 2
        tf = flops / (ms * 1e-3) / 1e12
        print(f"{n:>8} {ms:>10.3f} {tf:>9.0f} {100 * tf / gemm:>7.0f}%")
        del q, k, v


def read_only_gather():
    """A Triton kernel that reads rows `idx` of a [rows, 576] bf16 cache and sums each block of
    8 rows into one float (nothing else written), or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def gather_sum(cache, idx, out, width: tl.constexpr, rows: tl.constexpr):
        pid = tl.program_id(0)
        r = tl.load(idx + pid * rows + tl.arange(0, rows)).to(tl.int64)
        cols = tl.arange(0, 1024)
        v = tl.load(cache + r[:, None] * width + cols[None, :], mask=cols[None, :] < width, other=0.0)
        tl.store(out + pid, tl.sum(v.to(tl.float32)))

    def run(cache, idx, out):
        gather_sum[(idx.numel() // 8,)](cache, idx, out, LATENT + ROPE, 8)

    return run


def sparse(dev, copy, quick, scale, topk=2048):
    """The sparse decode's torch peer and its gather ceilings (see the module's doc)."""
    gather_sum = read_only_gather()
    print(f"\ntorch sparse MLA decode (top-{topk} rows by index_select, then the decode above; "
          "GB/s of the rows gathered, the query and the output)")
    print(f"{'batch':>6} {'context':>8} {'time us':>10} {'GB/s':>9} {'of copy':>8} "
          f"{'gather us':>10} {'of copy':>8} {'read-only us':>13} {'of copy':>8}")
    width = LATENT + ROPE
    for bsz, ctx in ([(64, 32768)] if quick else [(1, 32768), (64, 8192), (64, 32768)]):
        gen = torch.Generator().manual_seed(bsz + ctx)
        lists = [torch.randperm(ctx, generator=gen)[:topk].sort().values + b * ctx for b in range(bsz)]
        idx = torch.cat(lists).to(dev)
        rows = bsz * topk * width * 2
        # As many copies as the rows a call gathers ask for (batch 1: more than the cache's size would).
        caches = rotation(lambda: torch.empty(bsz * ctx, width, dtype=torch.bfloat16, device=dev).uniform_(-1, 1), rows)
        q = torch.empty(bsz, HEADS, width, dtype=torch.bfloat16, device=dev).uniform_(-1, 1)

        def decode():
            kv = caches().index_select(0, idx).view(bsz, topk, width)
            s = torch.bmm(q, kv.transpose(1, 2)).float() * scale
            p = torch.softmax(s, dim=-1).to(torch.bfloat16)
            return torch.bmm(p, kv[:, :, :LATENT])

        nbytes = rows + bsz * HEADS * (width + LATENT) * 2
        ms = timed(decode)
        gbs = nbytes / (ms * 1e-3) / 1e9
        # The gather alone reads and writes the rows: weighed as a copy of them.
        gather_ms = timed(lambda: caches().index_select(0, idx))
        gather_copy = 2 * rows / (gather_ms * 1e-3) / 1e9 / copy
        read = "-", "-"
        if gather_sum is not None:
            idx32 = idx.to(torch.int32)
            sums = torch.empty(idx.numel() // 8, dtype=torch.float32, device=dev)
            read_ms = timed(lambda: gather_sum(caches(), idx32, sums))
            read = f"{read_ms * 1e3:.1f}", f"{100 * rows / (read_ms * 1e-3) / 1e9 / copy:.0f}%"
        print(f"{bsz:>6} {ctx:>8} {ms * 1e3:>10.1f} {gbs:>9.0f} {100 * gbs / copy:>7.0f}% "
              f"{gather_ms * 1e3:>10.1f} {100 * gather_copy:>7.0f}% {read[0]:>13} {read[1]:>8}")
        del caches, q, idx


if __name__ == "__main__":
    main()
