# What every GPU-machine script needs before it runs mladb's binaries (sourced by gpu_check.sh,
# gpu_verdicts.sh and gpu_kernel_ab.sh, from the repository's root): the CUDA libraries that
# NVRTC and cuBLAS load from on the library path, the fixtures' build path, the binaries of
# .device-bin (unpacked where tools/pack_device_bin.sh packed them) and mladb where the tests
# look for it.
for lib in libnvrtc.so.13 libcublas.so.13; do
  lib_dir=$(dirname "$(find /usr/local/cuda* /usr/lib /opt -name "$lib*" 2>/dev/null | head -1)" 2>/dev/null)
  [ -n "$lib_dir" ] && export LD_LIBRARY_PATH="$lib_dir:${LD_LIBRARY_PATH:-}"
done
unset lib lib_dir  # the sourcing script may use these names
# The tests find their fixtures under the path they were built at.
mkdir -p /work && [ -e /work/main ] || ln -s "$PWD" /work/main
[ -f .device-bin/bin.tar.xz ] && tar -C .device-bin -xJf .device-bin/bin.tar.xz
# Tests that run the binary look for it where cargo built it (CARGO_BIN_EXE_mladb).
mkdir -p target/release && cp .device-bin/mladb target/release/mladb
