#!/usr/bin/env bash
# The verdict checks of issue 12 on a GPU machine, from binaries built elsewhere and put in
# .device-bin/ (mladb, and the test binaries verdicts and gpu_forward). tests/verdicts.rs runs
# every case on the GPU too where there is one: clean tiny layouts over seeds and the 20 random
# HF checkpoints report no findings with the CUDA backend in f32 and bf16, every fault is caught
# in bf16. Then full-size GLM-5 and DeepSeek-V3 (layers 0..4) checked on the device, and the
# cost of check against a plain run. Usage: tools/gpu_verdicts.sh
set -u
. "$(dirname "$0")/gpu_setup.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
B=.device-bin
OUT=${OUT:-/tmp}
for t in verdicts gpu_forward; do
  timeout 400 $B/$t --include-ignored --test-threads=1 --nocapture > "$OUT/$t.txt" 2>&1; echo "$t: exit $?"
  grep -E "^test |test result|panicked|skipped" "$OUT/$t.txt" | head -20
done
for layout in glm5-tiny deepseek-v3-tiny glm5-tiny-wide; do
  $B/mladb check --device cuda --layout $layout > "$OUT/check_$layout.txt" 2>&1; echo "check --device cuda --layout $layout: exit $?"; tail -1 "$OUT/check_$layout.txt"
done
python3 tools/noise_sweep.py --mladb $B/mladb --device cuda --seeds 0 --full-size > "$OUT/sweep_full.txt" 2>&1
echo "full-size sweep: exit $?"; grep -E "clean runs|FINDINGS|   " "$OUT/sweep_full.txt" | head; sed -n '/^kind/,$p' "$OUT/sweep_full.txt"
for args in "--layout glm5-tiny --prompt 12 --decode 4" "--layout deepseek-v3-tiny --seed 1 --prompt 12 --decode 4" "--layout glm5 --layers 0..4 --prompt 12 --decode 2 --weight-cache-mb 60000"; do
  timeout 300 $B/mladb bench --device cuda --no-kernels --check $args > "$OUT/bench_check.txt" 2>&1
  echo "bench $args: exit $?"; grep -E "^check" "$OUT/bench_check.txt"
done
