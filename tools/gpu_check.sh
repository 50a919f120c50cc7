#!/usr/bin/env bash
# Runs mladb's GPU checks on a machine with an NVIDIA GPU and the CUDA runtime libraries
# (NVRTC, cuBLAS): kernels compiled for the device and for Blackwell, every backend op against
# the CPU, whole forward passes and the fault catalogue on the GPU. Binaries are built elsewhere
# (cargo test --release --no-run; strip) and put in .device-bin/.
set -u
for lib in libnvrtc.so.13 libcublas.so.13; do
  dir=$(dirname "$(find /usr/local/cuda* /usr/lib /opt -name "$lib*" 2>/dev/null | head -1)" 2>/dev/null)
  [ -n "$dir" ] && export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
done
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
# The tests find their fixtures under the path they were built at.
mkdir -p /work && [ -e /work/main ] || ln -s "$PWD" /work/main
B=.device-bin
OUT=${OUT:-/tmp}
$B/mladb kernels --arch sm_90,sm_120 > "$OUT/kernels.txt" 2>&1; tail -3 "$OUT/kernels.txt"
$B/backends --test-threads=1 > "$OUT/backends.txt" 2>&1; grep -E "^test |panicked|result|seed|skipped" "$OUT/backends.txt" | head -40
$B/gpu_forward --test-threads=1 > "$OUT/gpu_forward.txt" 2>&1; grep -E "^test |panicked|result|skipped|rel err" "$OUT/gpu_forward.txt" | head -40
$B/mladb run --device cuda --layout glm5-tiny --tokens 1,2,3 --decode 2 > "$OUT/run.txt" 2>&1; tail -4 "$OUT/run.txt"
