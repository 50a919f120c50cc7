#!/usr/bin/env bash
# A kernel change against the shipped kernels, alternated on one GPU machine in one call (the
# device tool's METHOD.md: compare only figures of the same machine and run). Runs `mladb bench
# --device cuda` RUNS times with the kernel files of DIR (MLADB_KERNEL_SRC: the files there
# replace the embedded ones of the same name) and RUNS times without, in turn, then sets every
# timed row of both side by side (tools/bench_ab.py). With TESTS=1 the tensor-core kernels'
# tests and the verdicts' run first with DIR. Binaries as for tools/gpu_check.sh (.device-bin, from
# tools/pack_device_bin.sh). Make DIR on the build machine from a commit's kernels with
#   mkdir -p .device-bin/k && git archive REV kernels | tar -x -C .device-bin/k --strip-components=1
# In place of DIR, env:VAR=VALUE runs B with that environment setting and the binary's own
# kernels (a launch choice behind a switch, such as env:MLADB_DECODE_PAIR_MERGE=0).
# Usage: tools/gpu_kernel_ab.sh DIR|env:VAR=VALUE [RUNS] [bench flags]
#   (flags default: --no-layers --quick)
set -u
dir=${1:?usage: tools/gpu_kernel_ab.sh DIR|env:VAR=VALUE [RUNS] [bench flags]}
runs=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))
flags=${*:---no-layers --quick}
if [[ $dir == env:* ]]; then
  b_env=${dir#env:}
  [[ $b_env =~ ^[A-Z_][A-Z0-9_]*=[^[:space:]]*$ ]] || { echo "error: env:VAR=VALUE, not $dir"; exit 2; }
else
  [ -d "$dir" ] || { echo "error: no kernel folder $dir"; exit 2; }
  b_env=MLADB_KERNEL_SRC=$dir
fi
[[ $runs =~ ^[1-9][0-9]?$ ]] || { echo "error: RUNS is a count from 1 to 99, not $runs"; exit 2; }
. "$(dirname "$0")/gpu_setup.sh"
export MLADB_CACHE_DIR=${MLADB_CACHE_DIR:-/tmp/kc} NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
B=.device-bin
if [ "${TESTS:-0}" = 1 ]; then
  for t in fast_kernels fp8_kernels gpu_attention verdicts; do
    env "$b_env" timeout 300 $B/$t --include-ignored --test-threads=1 > "$OUT/ab_test_$t.txt" 2>&1
    echo "$t with $dir: exit $?"; grep -E "test result|FAILED|panicked" "$OUT/ab_test_$t.txt" | head -5
  done
fi
a=() b=()
for i in $(seq "$runs"); do
  # shellcheck disable=SC2086 # the flags are words
  timeout 300 $B/mladb bench --device cuda $flags > "$OUT/ab_a_$i.txt" 2>&1 || echo "shipped run $i: exit $?"
  env "$b_env" timeout 300 $B/mladb bench --device cuda $flags > "$OUT/ab_b_$i.txt" 2>&1 || echo "$dir run $i: exit $?"
  a+=("$OUT/ab_a_$i.txt") b+=("$OUT/ab_b_$i.txt")
done
echo "A: the shipped kernels; B: $b_env; each run's figure in turn"
python3 tools/bench_ab.py --a "${a[@]}" --b "${b[@]}"
