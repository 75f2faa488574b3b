#!/usr/bin/env bash
# On the GPU machine, after every part arrived: join, unpack and install into /tmp/site (PYTHONPATH),
# beside the machine's own torch, transformers and numpy. Idempotent: a second call does nothing.
set -euo pipefail
site=/tmp/site
if [ -f "$site/.installed" ]; then echo "installed already"; exit 0; fi
expected="${1:?usage: install.sh <number of parts>}"
have=$(ls /tmp/gpu-parts | wc -l)
[ "$have" -eq "$expected" ] || { echo "have $have of $expected parts: send the rest first"; exit 1; }
cat /tmp/gpu-parts/part_* | tar -C /tmp -xf -
pip install --quiet --no-index --no-deps --target "$site" /tmp/wheels/*.whl
TORCH_CUDA_ARCH_LIST=9.0 DS_BUILD_OPS=0 PYTHONPATH="$site" pip install --quiet --no-index --no-deps --no-build-isolation \
  --target "$site" /tmp/wheels/deepspeed-*.tar.gz
PYTHONPATH="$site" python -c "import ray, deepspeed, vllm, trl, datasets, boto3, liger_kernel; print('ray', ray.__version__, 'deepspeed', deepspeed.__version__, 'vllm', vllm.__version__, 'trl', trl.__version__)"
touch "$site/.installed"
