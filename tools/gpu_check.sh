#!/usr/bin/env bash
# Runs mladb's GPU checks and benchmarks on a machine with an NVIDIA GPU and the CUDA runtime
# libraries (NVRTC, cuBLAS): kernels compiled for the device and for Blackwell, every backend op
# against the CPU, the tensor-core MLA kernels against the f64 reference, whole forward passes
# and the fault catalogue on the GPU, then `mladb bench --device cuda` and the PyTorch
# comparison. Binaries are built elsewhere (tools/pack_device_bin.sh: cargo test --release
# --no-run, stripped, packed into .device-bin/bin.tar.xz, unpacked here) or put in .device-bin/
# as they are. Usage: tools/gpu_check.sh [tests|bench|all]
set -u
what=${1:-all}
. "$(dirname "$0")/gpu_setup.sh"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
B=.device-bin
# The logs go to a folder of their own and come back as one archive in $OUT (the device tool
# returns a few files a call, not one per log).
OUT=${OUT:-/tmp}
LOG=$(mktemp -d)
trap 'tar -C "$LOG" -czf "$OUT/gpu_check_logs.tar.gz" . && echo "logs: $OUT/gpu_check_logs.tar.gz"' EXIT
ngpu=$(nvidia-smi -L | grep -c '^GPU')
export NCCL_NVLS_ENABLE=0
if [ "$what" != bench ]; then
  # The two-GPU tensor-parallel test needs a host with two; say so where it is skipped.
  skip=""
  if [ "$ngpu" -lt 2 ]; then
    skip="--skip on_two_gpus"
    echo "skipped: tp's on_two_gpus_tp2_runs_a_rank_per_device_through_nccl needs two GPUs (this host has $ngpu)"
  fi
  $B/mladb kernels --arch sm_90,sm_120 > "$LOG/kernels.txt" 2>&1; tail -1 "$LOG/kernels.txt"
  . "$(dirname "$0")/gpu_tests.sh"
  for t in $GPU_TESTS; do
    timeout 420 $B/$t --include-ignored --test-threads=1 $skip > "$LOG/$t.txt" 2>&1 || echo "$t: exit $? (124 = timed out)"
    grep -E "^test |panicked|test result|skipped|worst" "$LOG/$t.txt" | head -30
  done
  $B/mladb run --device cuda --layout glm5-tiny --tokens 1,2,3 --decode 2 > "$LOG/run.txt" 2>&1; tail -2 "$LOG/run.txt"
  # The fast kernels in the traced path, each attention op with the kernel that ran it.
  $B/mladb run --device cuda --layout glm5-rank8 --tokens $(seq -s, 1 200) --decode 2 > "$LOG/run_rank8.txt" 2>&1; grep -E "↳" "$LOG/run_rank8.txt" | head -8; tail -1 "$LOG/run_rank8.txt"
  # A quantized kv_b_proj on the GPU: the two W_UK/W_UV routes per head, and the Q4_K fault.
  $B/mladb run --device cuda --layout glm5-tiny-wide --quant q4_k --decode 2 > "$LOG/run_q4k.txt" 2>&1; tail -7 "$LOG/run_q4k.txt"
  $B/mladb check --device cuda --layout glm5-tiny-wide --quant q4_k --inject q4k-scale-unpack > "$LOG/check_q4k.txt" 2>&1; tail -3 "$LOG/check_q4k.txt"
  # The hook's buffer watch on modules shaped like vLLM's and SGLang's MLA attention.
  python3 tools/hook_engine_check.py --mladb $B/mladb > "$LOG/hook_engines.txt" 2>&1; tail -1 "$LOG/hook_engines.txt"
  # The FP8 latent cache: its write kernel and decode variants in the traced path, clean.
  $B/mladb check --device cuda --layout glm5-rank8 --kv-cache-dtype fp8_ds_mla --tokens $(seq -s, 1 200) --decode 2 > "$LOG/check_fp8.txt" 2>&1; tail -3 "$LOG/check_fp8.txt"
  # Tensor parallelism (a rank per GPU through NCCL where the host has two, else the ranks
  # share this one): GLM-5 at TP 8 holds 8 heads a rank, the few-heads decode's shape.
  $B/mladb check --device cuda --layout glm5-rank8 --tp 2 --tokens $(seq -s, 1 200) --decode 2 > "$LOG/check_tp.txt" 2>&1; tail -3 "$LOG/check_tp.txt"
  if [ "$ngpu" -ge 2 ]; then
    # Full-size GLM-5, its first four layers (three dense, one MoE) at TP=2 against TP=1, then
    # with a rank's kv_b_proj slice taken from its neighbour.
    $B/mladb check --device cuda --layout glm5 --layers 0..4 --tp 2 --tokens $(seq -s, 1 16) --decode 2 --weight-cache-mb 60000 > "$LOG/check_tp_glm5.txt" 2>&1; tail -3 "$LOG/check_tp_glm5.txt"
    $B/mladb check --device cuda --layout glm5 --layers 0..4 --tp 2 --tokens $(seq -s, 1 16) --decode 2 --weight-cache-mb 60000 --inject tp-head-offset > "$LOG/check_tp_glm5_fault.txt" 2>&1; grep -m2 -E "tp-mismatch" "$LOG/check_tp_glm5_fault.txt"; tail -1 "$LOG/check_tp_glm5_fault.txt"
  fi
fi
if [ "$what" != tests ]; then
  python3 tools/torch_mla_bench.py ${QUICK:+--quick} > "$LOG/torch_bench.txt" 2>&1
  # Whole full-size layers; at TP=2 beside TP=1 where the host has two GPUs.
  tp=1; [ "$ngpu" -ge 2 ] && tp=2
  $B/mladb bench --device cuda ${QUICK:+--quick} --layout glm5 --layers 3 --prompt ${PROMPT:-128} --decode 4 --weight-cache-mb 60000 --tp $tp > "$LOG/bench.txt" 2>&1
  cat "$LOG/torch_bench.txt" "$LOG/bench.txt"
  # The other kernel variants on the same device, for comparison: the decode kernels that are
  # not the default here, then the prefill ones.
  for v in ${DECODE_VARIANTS:-kt3 ks3}; do
    $B/mladb bench --device cuda ${QUICK:+--quick} --no-layers --decode-variant $v --prefill-lengths 1024 > "$LOG/bench_decode_$v.txt" 2>&1
    sed -n '/MLA decode/,/^$/p' "$LOG/bench_decode_$v.txt"
  done
  for v in ${PREFILL_VARIANTS:-k128t64 r128t64}; do
    $B/mladb bench --device cuda ${QUICK:+--quick} --no-layers --prefill-variant $v --decode-shapes 1:1024 > "$LOG/bench_prefill_$v.txt" 2>&1
    echo "prefill variant $v"; sed -n '/MLA prefill/,$p' "$LOG/bench_prefill_$v.txt"
  done
fi
