#!/usr/bin/env bash
# Download what the GPU machine lacks (wheels.txt, cp312) plus DeepSpeed's sdist, bundle it into one
# tar and split it into parts a device call can carry (64 MiB each at most).
#
#   bash bench/gpu/pack.sh            # -> .scratch/gpu/parts/part_aa, part_ab, …
#
# Then, one device call per part: `bash bench/gpu/receive.sh` with carry [".scratch/gpu/parts/part_XX"];
# the last part's call also runs `bash bench/gpu/install.sh` (see bench/gpu/README.md).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="$root/.scratch/gpu"
mkdir -p "$out/wheels" "$out/parts"
pip="${PIP:-$root/.venv/bin/pip}"
grep -v '^\s*#' "$root/bench/gpu/wheels.txt" | grep -v '^\s*$' > "$out/requirements.txt"
"$pip" download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform any \
  -d "$out/wheels" -r "$out/requirements.txt"
"$pip" download --quiet --no-deps --no-binary=:all: --no-build-isolation -d "$out/wheels" "deepspeed==${DEEPSPEED_VERSION:-0.19.8}" \
  || "$pip" download --quiet --no-deps --no-binary=deepspeed -d "$out/wheels" "deepspeed==${DEEPSPEED_VERSION:-0.19.8}"
rm -f "$out/parts"/part_*
tar -C "$out" -cf - wheels | split -b 56M - "$out/parts/part_"  # 56 MiB: the call also carries the working tree (4 MiB on 2026-12-07)
ls -la "$out/parts"
