# The test binaries that run on a GPU machine: tools/pack_device_bin.sh builds and packs them,
# tools/gpu_check.sh runs them (sourced by both).
GPU_TESTS="fast_kernels fp8_kernels gpu_attention backends gpu_forward leaks verdicts tp"
