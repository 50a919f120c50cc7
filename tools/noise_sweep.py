#!/usr/bin/env python3
"""Measures the clean-run noise that mladb check's tolerances are derived from.

Runs `mladb check --json` on clean models (built-in layouts over several seeds and schedules,
and any HF checkpoints given) and prints, per op kind and layer, the largest relative L2 error
any comparison of a clean run produced (the `headroom` of check's JSON summary), beside the
tolerance check applied. With --faults it also runs every fault of the catalogue (the TP faults
at --tp 2, the FP8-cache ones over that cache, the fast kernels' with --device cuda, those only
a reference shows against a dump of mladb's own clean run) and prints whether check caught it.
With --short N it adds N random short-context runs (1 to 40 prompt tokens, 1 to all of them
prefilled, 0 to 11 decode steps, random seeds and flags; --short-seed picks them), where the DSA
indexer scores a few keys with few heads. Exits 1 when a clean run had findings or a fault was
missed.

Usage:
    python3 tools/noise_sweep.py [--mladb target/release/mladb] [--dtype bf16] [--seeds 6]
        [--device cpu|cuda] [--faults] [--model DIR ...] [--random tests/fixtures/random] [--full-size]
        [--short N] [--short-seed S]
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from collections import defaultdict

# A fault run's schedule: nine tokens prefilled, four decoded.
SCHEDULE = ["--prefill", "9", "--decode", "4"]
# The fast GPU kernels' faults need their latent dims (512 + 64: the rank layouts; the tiny ones
# run the reference kernels) and a prompt long enough to fill their tiles.
GPU_SCHEDULE = ["--tokens", ",".join(str(t) for t in range(1, 141)), "--decode", "2"]

# The faults check shows without a reference: (faults, layouts, the run's flags, what the row
# says of them). kv-stride-mismatch needs value rows narrower than key rows (DeepSeek-V3's).
FAULT_GROUPS = [
    (["output-buffer-disconnect", "softmax-scale-latent", "absorb-wrong-split", "lse-base-mismatch",
      "skip-padded-rows", "kv-cache-off-by-one"],
     ["glm5-tiny", "deepseek-v3-tiny"], SCHEDULE, ""),
    (["q4k-scale-unpack"], ["glm5-tiny-wide"], ["--quant", "q4_k", "--decode", "3"], "--quant q4_k"),
    (["tp-head-offset", "tp-missing-allreduce", "tp-double-reduce", "tp-absorb-unsliced"],
     ["glm5-tiny", "deepseek-v3-tiny"], SCHEDULE + ["--tp", "2"], "--tp 2"),
    (["fp8-scale-default", "fp8-amax-padded-rows"],
     ["glm5-rank8", "deepseek-v3-rank16"], SCHEDULE + ["--kv-cache-dtype", "fp8_ds_mla"], "--kv-cache-dtype fp8_ds_mla"),
]
# Those planted in the fast GPU kernels alone (--device cuda).
GPU_FAULT_GROUPS = [
    (["exp2-scale", "page-index-overflow"], ["glm5-rank8", "deepseek-v3-rank16"], GPU_SCHEDULE, "140 tokens"),
    (["kv-stride-mismatch"], ["deepseek-v3-rank16"], GPU_SCHEDULE, "140 tokens"),
]
# Faults that only a reference dump shows (check --reference): every path of mladb shares what
# they corrupt. Each is checked against a dump of mladb's own clean run (`run --dump`) of a
# layout it acts on: (fault, layout, YaRN mscale to set). yarn-mscale needs mscale and
# mscale_all_dim apart, which no built-in layout has: deepseek-v3-tiny with mscale 0.707.
REFERENCE_FAULTS = [
    ("rope-noninterleaved", "glm5-tiny", None),
    ("indexer-rope-layout", "glm5-tiny", None),
    ("yarn-mscale", "deepseek-v3-tiny", 0.707),
]


def status(first):
    """A fault row's verdict: the first finding, or MISSED."""
    return f"{first['kind']} {first['phase']} {first['op']}" if first else "MISSED"


def reference_faults(mladb, common):
    """(fault, layout shown, the clean run's findings against its own dump, the fault's first
    finding or None) for each of REFERENCE_FAULTS."""
    results = []
    # One clean run, dump and clean check per (layout, mscale), shared by the faults planted in it.
    clean_runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fault, layout, mscale in REFERENCE_FAULTS:
            if (layout, mscale) not in clean_runs:
                clean_runs[(layout, mscale)] = clean_reference(mladb, common, tmp, layout, mscale)
            shown, schedule, dump, clean = clean_runs[(layout, mscale)]
            findings, _ = check(mladb, schedule + ["--reference", dump, "--inject", fault] + common)
            results.append((fault, shown, clean, findings[0] if findings else None))
    return results


def clean_reference(mladb, common, tmp, layout, mscale):
    """(layout shown, the run's flags, a dump of its clean run, that run's findings against its
    own dump) for `layout`, its YaRN mscale set to `mscale` where given."""
    shown = layout
    if mscale is not None:
        ron = subprocess.run([mladb, "layout", "show", layout, "--ron"], capture_output=True, text=True, check=True).stdout
        assert "mscale: Some(1.0)" in ron, f"{layout} has no YaRN mscale of 1.0 to change"
        shown = f"{layout}, mscale {mscale}"
        layout = os.path.join(tmp, f"{layout}-mscale.ron")
        with open(layout, "w") as f:
            f.write(ron.replace("mscale: Some(1.0)", f"mscale: Some({mscale})", 1))
    schedule = ["--layout", layout] + SCHEDULE
    dump = os.path.join(tmp, f"{os.path.basename(layout)}-{mscale}.safetensors")
    out = subprocess.run([mladb, "run", *schedule, "--dump", dump] + common, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"mladb run --dump of {shown} failed: {out.stderr.strip()}")
    clean, _ = check(mladb, schedule + ["--reference", dump] + common)
    return shown, schedule, dump, clean


def short_runs(n, seed):
    """n random short-context runs: few prompt tokens, some prefilled, the rest and more decoded,
    with random flags (the layouts' vocabularies all hold token ids below 200)."""
    rng = random.Random(seed)
    runs = []
    for _ in range(n):
        layout = rng.choice(["glm5-tiny", "glm5-tiny-wide", "glm5-rank8", "deepseek-v3-tiny", "deepseek-v3-rank16"])
        r = ["--layout", layout, "--seed", str(rng.randrange(1000))]
        length = rng.choice([1, 1, 2, 3, rng.randrange(1, 40)])
        r += ["--tokens", ",".join(str(rng.randrange(200)) for _ in range(length))]
        r += ["--prefill", str(rng.randrange(1, length + 1)), "--decode", str(rng.randrange(12))]
        if layout in ("glm5-rank8", "deepseek-v3-rank16") and rng.random() < 0.3:
            r += ["--kv-cache-dtype", "fp8_ds_mla"]
        if rng.random() < 0.25:
            r += ["--quant", rng.choice(["q8_0", "q4_0", "q4_k", "q6_k"])]
        if rng.random() < 0.2:
            r += ["--tp", str(rng.choice([2, 4]))]
        if rng.random() < 0.15:
            r += ["--mla-disable"]
        elif rng.random() < 0.3:
            r += ["--prefill-path", rng.choice(["naive", "absorbed"]), "--decode-path", rng.choice(["naive", "absorbed"])]
        runs.append(r)
    return runs


def check(mladb, args):
    out = subprocess.run([mladb, "check", "--json", *args], capture_output=True, text=True)
    if out.returncode not in (0, 1):
        raise SystemExit(f"mladb check {' '.join(args)} failed: {out.stderr.strip()}")
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    findings = [line for line in lines if line.get("type") == "finding"]
    summary = next(line for line in lines if line.get("type") == "summary")
    return findings, summary


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mladb", default="target/release/mladb")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--faults", action="store_true")
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--random", help="a folder of tools/make_random_checkpoints.py (cases.json)")
    ap.add_argument("--full-size", action="store_true", help="also glm5 and deepseek-v3, layers 0..4")
    ap.add_argument("--short", type=int, default=0, help="this many random short-context runs")
    ap.add_argument("--short-seed", type=int, default=0)
    a = ap.parse_args()
    common = ["--dtype", a.dtype, "--device", a.device]

    runs = []
    for layout in ["glm5-tiny", "glm5-tiny-wide", "deepseek-v3-tiny"]:
        for seed in range(a.seeds):
            prefill = [12, 6, 9][seed % 3]
            runs.append(["--layout", layout, "--seed", str(seed), "--prefill", str(prefill), "--decode", "4"])
    runs.append(["--layout", "glm5-tiny-wide", "--quant", "q4_k", "--decode", "4"])
    runs.append(["--layout", "glm5-tiny", "--quant", "q8_0", "--decode", "4"])
    for model in a.model:
        runs.append(["--model", model, "--decode", "4"])
    if a.random:
        for c in json.load(open(f"{a.random}/cases.json")):
            tokens = ",".join(map(str, c["tokens"]))
            runs.append(["--model", f"{a.random}/{c['name']}", "--tokens", tokens, "--prefill", str(c["prefill"]), "--decode", str(c["decode"])])
    # The FP8 latent cache and tensor parallelism, clean.
    for seed in range(min(a.seeds, 3)):
        for layout in ["glm5-rank8", "deepseek-v3-rank16"]:
            runs.append(["--layout", layout, "--seed", str(seed)] + SCHEDULE + ["--kv-cache-dtype", "fp8_ds_mla"])
        for layout in ["glm5-tiny", "deepseek-v3-tiny"]:
            runs.append(["--layout", layout, "--seed", str(seed)] + SCHEDULE + ["--tp", "2"])
    runs += short_runs(a.short, a.short_seed)
    if a.full_size:
        for layout in ["glm5", "deepseek-v3"]:
            runs.append(["--layout", layout, "--layers", "0..4", "--tokens", "1,2,3", "--decode", "2"])

    # Per op kind: the largest error where the inputs agreed (-> floor), the largest gain of
    # error over input error (-> gain), and the op closest to its tolerance.
    floor = defaultdict(float)
    gain = defaultdict(float)
    closest = defaultdict(lambda: (0.0, ""))
    dirty = 0
    flips = 0
    for r in runs:
        findings, summary = check(a.mladb, r + common)
        flips += summary.get("selection_notes", 0)
        if findings:
            dirty += 1
            print(f"FINDINGS on a clean run: {' '.join(r)}")
            for f in findings:
                print(f"   {f['kind']} {f['phase']} {f['op']}: {f['detail'][:200]}")
        for h in summary["headroom"]:
            k = h["kind"]
            floor[k] = max(floor[k], h["floor_error"])
            gain[k] = max(gain[k], h["gain_needed"] if h["gain_needed"] is not None else float("inf"))
            rel = h["rel_l2"] if h["rel_l2"] is not None else float("inf")
            # No tolerance: a comparison of this kind that check does not judge (under --tp).
            ratio = rel / h["tolerance"] if h["tolerance"] else 0.0
            if ratio > closest[k][0]:
                closest[k] = (ratio, f"{' '.join(r)} [{h['comparison']} {h['phase']} {h['op']}] {rel:.2e}/{h['tolerance']:.2e}")
        table = summary["tolerances"]
    print(f"\n{len(runs)} clean runs ({a.dtype}, {a.device}), {dirty} with findings, {flips} selection notes")
    print(f"{'kind':<18} {'floor err':>10} {'floor':>8} {'gain need':>10} {'gain':>6} {'closest':>8}  where")
    for k in sorted(floor):
        t = table[k]
        print(f"{k:<18} {floor[k]:>10.2e} {t['floor']:>8.1e} {gain[k]:>10.2f} {t['gain']:>6.1f} {closest[k][0]:>8.2f}  {closest[k][1][:120]}")

    missed = 0
    if a.faults:
        print("\nfaults:")
        groups = FAULT_GROUPS
        if a.device == "cuda":
            groups = groups + GPU_FAULT_GROUPS
        else:
            gpu_only = [f for faults, _, _, _ in GPU_FAULT_GROUPS for f in faults]
            print(f"  not run on the CPU (planted in the fast GPU kernels): {', '.join(gpu_only)}")
        for faults, layouts, flags, shown in groups:
            for layout in layouts:
                for fault in faults:
                    findings, _ = check(a.mladb, ["--layout", layout, "--inject", fault] + flags + common)
                    first = findings[0] if findings else None
                    missed += first is None
                    print(f"  {layout:<18} {fault:<26} {status(first)} {shown}".rstrip())
        for fault, shown, clean, first in reference_faults(a.mladb, common):
            dirty += bool(clean)
            missed += first is None
            row = status(first)
            if clean:
                row += f"; the clean run had {len(clean)} finding(s) against its own dump"
            print(f"  {shown:<18} {fault:<26} {row} --reference (its own clean run's dump)")
    sys.exit(1 if dirty or missed else 0)


if __name__ == "__main__":
    main()
