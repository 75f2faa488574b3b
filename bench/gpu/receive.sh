#!/usr/bin/env bash
# On the GPU machine: keep the carried part(s) of the bundle in /tmp, which outlives the call while the
# machine stays warm. Usage (device call, carry [".scratch/gpu/parts/part_aa"]): bash bench/gpu/receive.sh
set -euo pipefail
mkdir -p /tmp/gpu-parts
cp -v .scratch/gpu/parts/part_* /tmp/gpu-parts/
ls /tmp/gpu-parts | tr '\n' ' '; echo
