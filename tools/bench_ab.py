#!/usr/bin/env python3
"""Sets the timed rows of `mladb bench --device cuda` outputs side by side: the runs of the
shipped kernels (A) against those of a kernel change (B), alternated in one call by
tools/gpu_kernel_ab.sh. A row is named by its table and its leading fields (heads, batch,
context; cache and top-k; tokens) and its kernel where it names one; its first two timed fields
(the stream's and the graph's µs, bf16 and FP8 µs, stream and lone-call µs, prefill ms) are
given for every run, A then B, so that a change is read against the spread of its own machine.

Usage: tools/bench_ab.py --a A1.txt A2.txt ... --b B1.txt B2.txt ..."""
import re
import sys

NUMBER = re.compile(r"^-?\d+\.\d+$")  # a timed field: a decimal point, no exponent (errors have one)
ERROR = re.compile(r"^-?\d+\.\d+e-?\d+$")  # a relative error, which ends a row's timed fields
LEADING = re.compile(r"^(\d+|[a-z][a-z0-9_]*)$")  # a row's naming fields: counts and cache names


def rows(path):
    """{(table, row name): [first timed fields]} of one bench output, in the file's order."""
    table, found = "", {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            words = line.split()
            if not words:
                continue
            if not (LEADING.match(words[0]) and any(NUMBER.match(w) for w in words)):
                # A table's title line names it up to its first parenthesis or semicolon; column
                # headers (indented) and notes are skipped.
                if line[0] != " " and not line.startswith("note"):
                    table = re.split(r"[(;]", line)[0].strip()[:60]
                continue
            name = []
            for w in words:
                if NUMBER.match(w) or ERROR.match(w):
                    break
                name.append(w)
            rest = words[len(name):]
            times = [w for w in rest if NUMBER.match(w)][:2]
            kernel = [w for w in rest if w.startswith("mla_") or w == "(forced)"]
            found[(table, " ".join(name + kernel))] = times
    return found


def fail(why):
    print(f"error: {why}", file=sys.stderr)
    sys.exit(2)


def main(argv):
    if "--a" not in argv or "--b" not in argv:
        fail("usage: bench_ab.py --a A1.txt ... --b B1.txt ...")
    i, j = argv.index("--a"), argv.index("--b")
    a_files = argv[i + 1 : j] if i < j else argv[i + 1 :]
    b_files = argv[j + 1 : i] if j < i else argv[j + 1 :]
    if not a_files or not b_files:
        fail("give at least one bench output for each of A and B")
    try:
        a_runs, b_runs = [rows(p) for p in a_files], [rows(p) for p in b_files]
    except OSError as e:
        fail(f"{e.filename}: {e.strerror}")
    keys = []
    for run in a_runs + b_runs:
        keys += [k for k in run if k not in keys]
    table = None
    for key in keys:
        if key[0] != table:
            table = key[0]
            print(f"\n{table}")
        cells = []
        for runs in (a_runs, b_runs):
            per_field = list(zip(*[r[key] for r in runs if key in r and r[key]]))
            cells.append(" | ".join(" ".join(field) for field in per_field) or "-")
        print(f"  {key[1]:<44} A {cells[0]:<36} B {cells[1]}")


if __name__ == "__main__":
    main(sys.argv[1:])
