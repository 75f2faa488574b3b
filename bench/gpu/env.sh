# Source on the GPU machine before anything runs: the installed packages, the arch DeepSpeed's op builder
# can parse, scratch dirs in /tmp, and a Ray head on loopback.
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="/tmp/site/bin:$PATH"
export TORCH_CUDA_ARCH_LIST=9.0
export TORCH_EXTENSIONS_DIR=/tmp/torch-ext TORCHINDUCTOR_CACHE_DIR=/tmp/inductor HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export WANDB_MODE=offline WANDB_DIR=/tmp/wandb
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
# Ray 2.60 turns token auth on by itself once ~/.ray/auth_token exists (a local ray.init() writes one), so
# a head started after a test could refuse the stages' drivers. This machine reaches no network and Ray
# binds to loopback: say "disabled" outright, for every process alike.
export RAY_AUTH_MODE=disabled
# NVLink multicast stays off on the shared multi-GPU hosts (device KINDS.md): it can take the host's GPUs out of
# service. Set here so that Ray's workers and vLLM's processes inherit it too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The CLI through this python (the one with torch): pip --target wrote /tmp/site/bin/ray for /usr/bin/python3,
# which on 2026-11-30 stopped finding msgpack, then protobuf. A head left over from an earlier call that ran
# out of time goes first.
ray_cli() { python -m ray.scripts.scripts "$@"; }
start_ray() {
  ray_cli stop --force >/dev/null 2>&1
  ray_cli start --head --node-ip-address 127.0.0.1 --port 6390 --num-gpus "$(nvidia-smi -L | wc -l)" \
    --temp-dir /tmp/ray --include-dashboard false --disable-usage-stats >/tmp/ray-start.log 2>&1 || { cat /tmp/ray-start.log; return 1; }
  export RAY_ADDRESS=127.0.0.1:6390
}
