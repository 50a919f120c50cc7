#!/usr/bin/env bash
# Builds mladb and the test binaries that tools/gpu_check.sh runs (release), strips them and
# packs them into .device-bin/bin.tar.xz, which gpu_check.sh unpacks on the GPU machine: the
# device tool carries at most 64 MiB with the working tree, and the stripped binaries are about
# 48 MB (9 MB packed). Usage: tools/pack_device_bin.sh, then run `tools/gpu_check.sh` there with
# .device-bin carried.
set -eu
cargo build --release
cargo test --release --no-run
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp target/release/mladb "$stage/"
. "$(dirname "$0")/gpu_tests.sh"
for t in $GPU_TESTS; do
  # The newest build of each test (cargo leaves older hashes beside it).
  f=$(ls -t target/release/deps/"$t"-* | grep -v '\.d$' | head -1)
  cp "$f" "$stage/$t"
done
strip "$stage"/*
mkdir -p .device-bin
# Unpacked copies from an earlier run would travel beside the archive and overrun the limit.
for f in "$stage"/*; do rm -f ".device-bin/$(basename "$f")"; done
tar -C "$stage" -cJf .device-bin/bin.tar.xz .
ls -l .device-bin/bin.tar.xz
