#!/usr/bin/env bash
# Makes a GLM-5 HF checkpoint with the model's real tensor names and shapes from mladb's
# synthetic weights (`mladb layout export`), then reads it back through the loader and checks
# every value (`mladb layout verify`). No download, no Python: every value is known, so a run
# on the checkpoint can be compared with `mladb run --layout` on the same seed.
#
# Usage: tools/make_glm5_checkpoint.sh PRESET DTYPE OUT_DIR [more `mladb layout export` options]
#
#   PRESET  test  the checkpoint tests/real_scale.rs makes of DTYPE:
#                   fp8:  2 layers (layer 0 dense, layer 1 MoE), 8 routed experts and the shared
#                         one, vocabulary 1024: 0.94 GB in 4 shards of 256 MiB;
#                   bf16: the MoE layer alone (bf16 takes twice the room): 1.05 GB in 8 shards
#                         of 128 MiB.
#           two   the two layers (dense + MoE, 8 experts, vocabulary 1024) in either dtype
#                 (bf16: 1.86 GB; fp8: 0.94 GB), shards of 256 MiB.
#           full  every count of GLM-5: 78 layers (3 dense), 256 routed experts, vocabulary
#                 154880, 7.44e11 parameters without the MTP layer: about 1.49 TB in bf16,
#                 0.75 TB in fp8, shards of 4 GiB (hours of writing; check the disk first).
#   DTYPE   bf16, or fp8 (E4M3 projections with an f32 weight_scale_inv per 128×128 block, as
#           the official GLM-5-FP8 and DeepSeek-V3 checkpoints; norms, router, indexer
#           weights_proj, embeddings and LM head in bf16, the router bias in f32).
#   OUT_DIR a new directory (or an empty one); it appears whole or not at all.
#
# Every tensor keeps GLM-5's full shape whatever the preset (hidden 6144, 64 heads, q_lora 2048,
# kv_lora 512, indexer 32×128, dense intermediate 12288, expert intermediate 2048): presets only
# change how many layers, experts and vocabulary rows there are. Extra options override the
# preset's (`--layers 4 --first-dense 3`, `--shard-mb 1024`, `--seed 0`); `--layout deepseek-v3`
# makes a DeepSeek-V3 checkpoint instead (use `--experts 16` or more: 8 groups of at least 2).
#
# Environment: MLADB, the binary (default target/release/mladb, built when missing); SEED, the
# synthetic weights' seed (default 7, the tests'); VERIFY=0 skips the check.
#
# Then, for example:
#   mladb run --model OUT_DIR --tokens 3,141,59 --decode 2 --dtype bf16
#   mladb layout import OUT_DIR/config.json > small.ron    # the same model, synthetic weights:
#   mladb run --layout small.ron --seed 7 --tokens 3,141,59 --decode 2 --dtype bf16
set -euo pipefail

if [ $# -lt 3 ]; then
    sed -n '2,36p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
preset=$1 dtype=$2 out=$3
shift 3

case "$dtype" in
bf16 | fp8) ;;
*)
    echo "error: DTYPE must be bf16 or fp8, not '$dtype'" >&2
    exit 2
    ;;
esac

case "$preset:$dtype" in
test:fp8 | two:*) counts=(--layers 2 --first-dense 1 --experts 8 --vocab 1024 --shard-mb 256) ;;
test:bf16) counts=(--layers 1 --first-dense 0 --experts 8 --vocab 1024 --shard-mb 128) ;;
full:*) counts=(--shard-mb 4096) ;;
*)
    echo "error: PRESET must be test, two or full, not '$preset'" >&2
    exit 2
    ;;
esac

root=$(cd "$(dirname "$0")/.." && pwd)
mladb=${MLADB:-$root/target/release/mladb}
if [ ! -x "$mladb" ]; then
    (cd "$root" && cargo build --release)
fi

# Options given later win: `layout export` takes the last value of a repeated option.
"$mladb" layout export --layout glm5 --seed "${SEED:-7}" "${counts[@]}" --dtype "$dtype" "$@" "$out"
if [ "${VERIFY:-1}" != 0 ]; then
    "$mladb" layout verify "$out"
fi
