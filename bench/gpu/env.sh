# Source on the GPU machine before anything runs: the installed packages, the arch DeepSpeed's op builder
# can parse, scratch dirs in /tmp, and a Ray head on loopback.
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="/tmp/site/bin:$PATH"
export TORCH_CUDA_ARCH_LIST=9.0
export TORCH_EXTENSIONS_DIR=/tmp/torch-ext HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export WANDB_MODE=offline WANDB_DIR=/tmp/wandb
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0
start_ray() {
  ray start --head --node-ip-address 127.0.0.1 --port 6390 --num-gpus "$(nvidia-smi -L | wc -l)" \
    --temp-dir /tmp/ray --include-dashboard false --disable-usage-stats >/tmp/ray-start.log 2>&1 || { cat /tmp/ray-start.log; return 1; }
  export RAY_ADDRESS=127.0.0.1:6390
}
