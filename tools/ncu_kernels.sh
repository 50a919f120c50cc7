#!/usr/bin/env bash
# Hardware counters of the tensor-core MLA kernels (decode at batch 64 × 8k, prefill at 4k) with
# Nsight Compute, clocks left alone: tensor-pipe activity, stall reasons, shared-memory bank
# conflicts. Needs ncu on the PATH (the device machine's CUDA image has it) and .device-bin/mladb.
set -u
OUT=${OUT:-/tmp}
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
stalls=""
for r in barrier long_scoreboard short_scoreboard math_pipe_throttle mio_throttle wait not_selected lg_throttle dispatch_stall no_instruction branch_resolving membar sleeping selected; do
  stalls="$stalls,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
done
metrics="sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum$stalls"
# The kernels a Hopper runs by default (set KERNELS for others: mla_decode_t32 and
# flash_prefill_r128t64_d256 are an A100's).
for k in ${KERNELS:-mla_decode_wgmma flash_prefill_wgmma_d256}; do
  echo "== $k"
  timeout 200 "$NCU" --clock-control none -k "regex:$k" --launch-skip 5 -c 1 --metrics "$metrics" \
    .device-bin/mladb bench --device cuda --no-layers --decode-shapes 64:8192 --prefill-lengths 4096 > "$OUT/ncu_$k.txt" 2>&1
  grep -E "^ +[a-z_]+__" "$OUT/ncu_$k.txt" | sed -e 's/smsp__average_warps_issue_stalled_//' -e 's/_per_issue_active.ratio//' | awk '{print $1, $(NF)}'
done
