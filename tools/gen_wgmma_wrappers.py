#!/usr/bin/env python3
"""Writes the wgmma.mma_async wrappers at the end of kernels/wgmma.cuh.

Each accumulator register of a warpgroup MMA is one inline-asm operand (32 for a 64x64 tile,
128 for 64x256), which is tedious and error-prone by hand. Everything in the file above the
marker line is kept; everything below it is replaced.

    python3 tools/gen_wgmma_wrappers.py
"""
import pathlib

MARKER = "// ---- Written by tools/gen_wgmma_wrappers.py from here on; edit that script, not this part.\n"
PATH = pathlib.Path(__file__).resolve().parent.parent / "kernels" / "wgmma.cuh"


def regs(n, start=0):
    return ", ".join(f"%{i}" for i in range(start, start + n))


def outs(n):
    return ", ".join(f'"+f"(d[{i}])' for i in range(n))


def wrapper(comment, name, params, shape, n_acc, operands, tail, inputs):
    """One wrapper; the accumulate predicate is always the last asm operand."""
    pred = n_acc + len(inputs)
    return f'''// {comment}
__device__ __forceinline__ void {name}(float* d, {params}) {{
    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{pred}, 0;\\n"
        "wgmma.mma_async.sync.aligned.{shape}.f32.bf16.bf16 "
        "{{{regs(n_acc)}}}, {operands}, p, {tail};\\n}}\\n"
        : {outs(n_acc)}
        : {", ".join(inputs)}, "r"(accumulate));
}}
'''


def register_a(comment, n, trans_b):
    """A wrapper whose A (64×16 bf16) is four registers of each thread and B a descriptor;
    trans_b 1 for an N-major B."""
    acc = n // 2
    return wrapper(
        comment, f"wgmma_m64n{n}_rs", "const unsigned* a, u64 desc_b, int accumulate", f"m64n{n}k16", acc,
        f"{{%{acc}, %{acc + 1}, %{acc + 2}, %{acc + 3}}}, %{acc + 4}", f"1, 1, {trans_b}",
        ['"r"(a[0])', '"r"(a[1])', '"r"(a[2])', '"r"(a[3])', '"l"(desc_b)'])


def main():
    text = PATH.read_text()
    head = text[: text.index(MARKER) + len(MARKER)]
    parts = [
        wrapper(
            "D (64×64 f32, 32 per thread) = A·B (+ D if accumulate), A and B K-major in shared memory.",
            "wgmma_m64n64_ss", "u64 desc_a, u64 desc_b, int accumulate", "m64n64k16", 32,
            "%32, %33", "1, 1, 0, 0", ['"l"(desc_a)', '"l"(desc_b)']),
        wrapper(
            "D (64×32 f32, 16 per thread) = A·B (+ D if accumulate), A and B K-major in shared memory.",
            "wgmma_m64n32_ss", "u64 desc_a, u64 desc_b, int accumulate", "m64n32k16", 16,
            "%16, %17", "1, 1, 0, 0", ['"l"(desc_a)', '"l"(desc_b)']),
        register_a(
            "D (64×32 f32, 16 per thread) = A·B (+ D if accumulate), A (64×16) in registers, B K-major in shared memory.",
            32, 0),
        register_a(
            "D (64×256 f32, 128 per thread) (+)= A·B, A (64×16) in registers, B N-major in shared memory.",
            256, 1),
        wrapper(
            "D (64×256 f32) (+)= A·B, A K-major and B N-major in shared memory.",
            "wgmma_m64n256_ss", "u64 desc_a, u64 desc_b, int accumulate", "m64n256k16", 128,
            "%128, %129", "1, 1, 0, 1", ['"l"(desc_a)', '"l"(desc_b)']),
    ]
    PATH.write_text(head + "\n".join(parts))


if __name__ == "__main__":
    main()
