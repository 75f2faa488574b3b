#!/usr/bin/env bash
# On the GPU machine: run benchmark phases in order, each in its own process, logs and results to $OUT.
#
#   bash bench/gpu/run.sh setup vllm sft          # one device call
#   bash bench/gpu/run.sh setup vllm_probe        # where vLLM's time goes at the eval shape (bench/vllm_probe.py)
#   bash bench/gpu/run.sh setup hf_generate       # our HF rollout engine: eager decode steps against CUDA graphs (and with
#                                                 # transformers' SDPA, with the forward compiled, and compiled with the sibling
#                                                 # projections fused), one step's kernels profiled; HF_GENERATE_VARIANTS picks some
#   bash bench/gpu/run.sh vocab_passes            # RL's log-probs and entropy, and the decode's sampling: compiled against eager
#   bash bench/gpu/run.sh sft_compile sft_profile_compile   # SFT with --torch_compile, and its kernel profile
#   bash bench/gpu/run.sh sft sft_noliger ours64 ours64_noliger   # Liger's kernels (the default on CUDA) on, then off
#   bash bench/gpu/run.sh ours64 ours64_lora       # LoRA (rank 64, the adapter alone synced to vLLM) beside full weights
#   bash bench/gpu/run.sh sft sft_sdpa ours64 ours64_sdpa    # flash-attn (flash_attn.sh installed it) against SDPA
#   bash bench/gpu/run.sh sft sft_nogc sft_zero0 sft_profile_nogc ours64 ours64_nogc ours64_zero0 ours64_nogc_zero0   # the training phase's costs
#   bash bench/gpu/run.sh sft_compile sft_compile_nogc sft_profile_compile_nogc ours64_compile ours64_compile_nogc   # compiled blocks, with and without the recomputed forward
#   bash bench/gpu/run.sh rl_profile rl_profile_compile_nogc   # the RL training phase's micro-batch profiled (default; compiled, no recompute)
#   bash bench/gpu/run.sh sft_profile_compile_nogc sft_profile_compile_nogc_per_tensor_check   # what ZeRO-2's per-tensor gradient checks cost a step
#   SHAPE=qwen2.5-1.5b bash bench/gpu/run.sh setup sft ours64  # the 1.5B shape in /tmp/bench-qwen2.5-1.5b; names end in _1p5b
#   bash bench/gpu/run.sh ours trl_vllm trl_hf report
#   bash bench/gpu/run.sh ours64 ours64_hf trl_vllm   # rollouts from vLLM, from the actor's own decode loop (CUDA graphs), and TRL's
#   bash bench/gpu/run.sh ours64_hf ours64_hf_compile ours64_hf_nogc ours64_hf_compile_nogc   # that loop with --torch_compile; without checkpointing; both
#   bash bench/gpu/run.sh setup openrlhf report     # OpenRLHF 0.11.2's GRPO, same work (bench/gpu/openrlhf.sh install first)
#   bash bench/gpu/run.sh setup verl                # verl 0.9.1's GRPO, same work (bench/gpu/verl.sh install first; a call of its own)
#   bash bench/gpu/run.sh tests_stages               # the gpu-marked tests; tests_learn: the learning check
#   SHAPE=qwen2.5-1.5b bash bench/gpu/run.sh setup eos4k real_vllm4k real_ours4k   # realistic RL work (bench/realistic.py)
#   SHAPE=qwen2.5-1.5b bash bench/gpu/run.sh real_vllm4k_in_process   # vLLM alone, its engine core in-process as ours
#   SHAPE=qwen2.5-1.5b bash bench/gpu/run.sh real_verl4k   # or real_openrlhf4k: the peers on it (after their install)
#   SHAPE=qwen2.5-vl-3b bash bench/gpu/run.sh vlm_setup vlm_ours vlm_ours_frozen vlm_ours_lora   # vision-language GRPO (bench/vlm.py)
#
# /tmp/bench (model, data, results) outlives a call while the machine is warm; with $OUT set (a device call) the
# results of every shape and the logs go back in $OUT/bundle.tgz, the report in $OUT/results.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/gpu/env.sh
out="${OUT:-/tmp/out}"; mkdir -p "$out/logs"
shape=${SHAPE:-qwen2-0.5b}
dir=/tmp/bench; [ "$shape" = qwen2-0.5b ] || dir=/tmp/bench-$shape
ray_up=""
for phase in "$@"; do
  t0=$(date +%s)
  case "$phase" in
    setup) [ -f $dir/model_info.json ] || python bench/grpo_bench.py setup --dir $dir --shape $shape ;;
    vllm) python bench/grpo_bench.py vllm --dir $dir ;;
    vllm_probe) python bench/vllm_probe.py --dir $dir ;;
    hf_generate) python bench/grpo_bench.py hf_generate --dir $dir ;;
    vocab_passes) python bench/grpo_bench.py vocab_passes --dir $dir ;;
    sft_profile) python bench/grpo_bench.py sft_profile --dir $dir ;;
    sft_profile_compile) python bench/grpo_bench.py sft_profile --dir $dir --compile ;;
    sft_profile_nogc) python bench/grpo_bench.py sft_profile --dir $dir --no_gc ;;
    sft_profile_compile_nogc) python bench/grpo_bench.py sft_profile --dir $dir --compile --no_gc ;;
    # The same with ZeRO-2's checks of each gradient tensor back (DeepSpeed's; strategy.fuse_zero_step_checks fuses them).
    sft_profile_compile_nogc_per_tensor_check) python bench/grpo_bench.py sft_profile --dir $dir --compile --no_gc --per_tensor_check ;;
    # The same profile on the RL training phase's micro-batch (64 x 384 tokens): where its time goes.
    rl_profile) python bench/grpo_bench.py sft_profile --dir $dir --rl_shape ;;
    rl_profile_compile_nogc) python bench/grpo_bench.py sft_profile --dir $dir --rl_shape --compile --no_gc ;;
    sft|sft_noliger|sft_sdpa|sft_compile|sft_nogc|sft_compile_nogc|sft_zero0|ours64_nogc|ours64_zero0|ours64_nogc_zero0|ours64_compile|ours64_compile_nogc|ours|ours32|ours64|ours64_noliger|ours64_sdpa|ours64_hf_compile|ours64_hf_nogc|ours64_hf_compile_nogc|ours64_hf_compile_nogc_sdpa|ours64_lora|ours64_lora_sdpa|ours_hf|ours64_hf|ours_async|ours_2gpu_kl|ours_agentic|ours_agentic_slow_tool|ours_agentic_separate|ours_agentic_async|eval_vllm|eval_hf|tests_stages|tests_learn)
      if [ -z "$ray_up" ]; then start_ray && ray_up=1; fi
      case "$phase" in
        sft) python bench/grpo_bench.py sft --dir $dir ;;
        sft_compile) python bench/grpo_bench.py sft --dir $dir --compile ;;
        # Liger's kernels are on by default on CUDA: the same runs with them off (eager kernels, full logits).
        sft_noliger) python bench/grpo_bench.py sft --dir $dir --no_liger ;;
        sft_sdpa) python bench/grpo_bench.py sft --dir $dir --sdpa ;;
        # Where the training phase's time goes (issue 23): without gradient checkpointing (no recomputed forward;
        # memory allows it at these shapes), and with ZeRO stage 0 (one GPU: no partitioning bookkeeping).
        sft_nogc) python bench/grpo_bench.py sft --dir $dir --no_gc ;;
        sft_compile_nogc) python bench/grpo_bench.py sft --dir $dir --compile --no_gc ;;
        sft_zero0) python bench/grpo_bench.py sft --dir $dir --zero_stage 0 ;;
        ours64_nogc) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 64 --no_gc ;;
        ours64_zero0) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 64 --zero_stage 0 ;;
        ours64_nogc_zero0) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 64 --no_gc --zero_stage 0 ;;
        ours64_compile) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 64 --compile ;;
        ours64_compile_nogc) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 64 --compile --no_gc ;;
        ours64_sdpa) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 64 --sdpa ;;
        ours64_noliger) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 64 --no_liger ;;
        # LoRA rank 64 on every linear layer: vLLM generates through the adapter, synced alone after each update.
        ours64_lora) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 64 --lora_rank 64 ;;
        ours64_lora_sdpa) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 64 --lora_rank 64 --sdpa ;;
        ours) python bench/grpo_bench.py ours --dir $dir --mode vllm ;;
        ours32) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 32 ;;
        ours64) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 64 ;;
        ours_async) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 64 --layout async --steps 24 --lr 1e-5 ;;
        ours_2gpu_kl) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 64 --layout actor_ref_vllm --steps 10 ;;
        ours_hf) python bench/grpo_bench.py ours --dir $dir --mode hf --steps 5 ;;
        # The actor's own decode loop (static cache, CUDA graphs) in place of vLLM, at ours64's micro-batch
        ours64_hf) python bench/grpo_bench.py ours --dir $dir --mode hf --micro 64 ;;
        # The same with --torch_compile (blocks compiled for training, and the decode forward compiled inside the
        # captured step: fused elementwise kernels); and without gradient checkpointing (the training phase's recompute).
        ours64_hf_compile) python bench/grpo_bench.py ours --dir $dir --mode hf --micro 64 --compile ;;
        ours64_hf_nogc) python bench/grpo_bench.py ours --dir $dir --mode hf --micro 64 --no_gc ;;
        ours64_hf_compile_nogc) python bench/grpo_bench.py ours --dir $dir --mode hf --micro 64 --compile --no_gc ;;
        # The same on SDPA: training, and the decode, which with flash-attn goes through its kv-cache kernel.
        ours64_hf_compile_nogc_sdpa) python bench/grpo_bench.py ours --dir $dir --mode hf --micro 64 --compile --no_gc --sdpa ;;
        ours_agentic) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 64 --layout agentic --steps 8 ;;
        # The same with a tool of 20-200 ms a step: each episode's next turn joins vLLM's running batch when its step returns.
        ours_agentic_slow_tool) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 64 --layout agentic_slow_tool --steps 8 ;;
        # Two GPUs: the engine on its own, on-policy, then asynchronous with partial rollouts.
        ours_agentic_separate) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 64 --layout agentic_separate --steps 8 ;;
        ours_agentic_async) python bench/grpo_bench.py ours --dir $dir --mode vllm --micro 64 --layout agentic_async --steps 10 ;;
        # The eval stage, 1,000 prompts x 256 new tokens: vLLM on its worker's GPU, then the transformers engine there.
        eval_vllm) python bench/grpo_bench.py eval --dir $dir --mode vllm ;;
        eval_hf) python bench/grpo_bench.py eval --dir $dir --mode hf ;;
        # The GPU tests (tests/e2e/test_gpu.py, the vLLM engine's text and vision-language tests), on this Ray head;
        # the learning check's preferred-style rates land in results/gpu_learning.json.
        tests_stages) python -m pytest -m gpu -s -p no:cacheprovider tests/unit/tasks/common/nn/engines/test_vllm_engine.py \
          tests/unit/tasks/common/nn/engines/test_vllm_vision.py tests/e2e/test_gpu.py -k "${TESTS_K:-not learns}" ;;
        tests_learn) python -m pytest -m gpu -s -p no:cacheprovider tests/e2e/test_gpu.py -k "${TESTS_K:-learns}" \
                       && mkdir -p $dir/results && cp .scratch/test/gpu/learning.json $dir/results/gpu_learning.json ;;
      esac ;;
    # OpenRLHF (bench/openrlhf_bench.py): /tmp/site-openrlhf first on PYTHONPATH for this phase alone, its Ray head
    # included (Ray's workers take the raylet's environment, not the driver's); the head goes with the phase.
    # openrlhf_sleep: the same with --vllm.enable_sleep (vLLM started alone, before the actor loads).
    # OPENRLHF_ARGS adds openrlhf_bench.py's options (e.g. "--steps 8 --timeout_s 390" to leave room in a call).
    openrlhf|openrlhf_sleep)
      ( export PYTHONPATH=/tmp/site-openrlhf:$PYTHONPATH
        start_ray && python bench/openrlhf_bench.py --dir $dir $([ "$phase" = openrlhf_sleep ] && echo --vllm_sleep) ${OPENRLHF_ARGS:-} )
      rc=$?; ray_cli stop --force >/dev/null 2>&1; ray_up=""; (exit $rc) ;;
    # verl 0.9.1 (bench/verl_bench.py), the same way: /tmp/site-verl (verl, its transformers 5.10.4) first on PYTHONPATH
    # for this phase and its Ray head alone. verl_sleep: verl's default free_cache_engine (vLLM sleeps while the actor trains).
    # VERL_ARGS adds verl_bench.py's options (e.g. "--sdpa --steps 8 --timeout_s 270" without flash-attn, on a short lease).
    verl|verl_sleep)
      ( export PYTHONPATH=/tmp/site-verl:$PYTHONPATH
        start_ray && python bench/verl_bench.py --dir $dir $([ "$phase" = verl_sleep ] && echo --vllm_sleep) ${VERL_ARGS:-} )
      rc=$?; ray_cli stop --force >/dev/null 2>&1; ray_up=""; (exit $rc) ;;
    # Realistic RL work (bench/realistic.py, issue 52): EOS at a calibrated hazard (bench/eos_model.py), mean about
    # 1,000 tokens, capped at 4k (…4k) or 8k (…8k); 16 prompts x 8 samples a step. eos4k/eos8k build the model once.
    eos4k|eos8k)
      cap=$([ "$phase" = eos4k ] && echo 4096 || echo 8192)
      [ -f $dir/model_eos$cap/config.json ] || python -m bench.eos_model --model $dir/model --out $dir/model_eos$cap \
        --target_mean ${EOS_MEAN:-1000} --cap $cap --temperature 1.0 --samples ${EOS_SAMPLES:-64} --verify 0 ${EOS_ARGS:-}
      mkdir -p $dir/results && cp $dir/model_eos$cap/eos_calibration.json $dir/results/eos_calibration_$cap.json ;;
    # verl and OpenRLHF on the same work, with their own long-response settings (bench/realistic_peers.py); each
    # its own call of 600 s. Their folders first on PYTHONPATH for the phase and its Ray head, as verl/openrlhf above;
    # BENCH_IGNORE_EOS=0 keeps EOS live in OpenRLHF (openrlhf.sh's patch).
    real_verl4k|real_openrlhf4k)
      peer=${phase#real_}; peer=${peer%4k}
      ( export PYTHONPATH=/tmp/site-$peer:$PYTHONPATH BENCH_IGNORE_EOS=0
        start_ray && python bench/realistic_peers.py $peer --dir $dir --cap 4096 --steps ${REAL_STEPS:-4} ${PEER_ARGS:-} )
      rc=$?; ray_cli stop --force >/dev/null 2>&1; ray_up=""; (exit $rc) ;;
    real_vllm4k|real_vllm8k) python bench/realistic.py vllm --dir $dir --cap $([ "$phase" = real_vllm4k ] && echo 4096 || echo 8192) ;;
    real_vllm4k_in_process) python bench/realistic.py vllm --dir $dir --cap 4096 --in_process ;;
    real_trl4k) python bench/realistic.py trl --dir $dir --cap 4096 --steps ${REAL_STEPS:-4} --micro 4 ;;
    real_ours4k|real_ours4k_budget|real_ours4k_padded|real_ours4k_oversample|real_ours8k|real_ours8k_padded|real_ours4k_hf|real_ours4k_lora|real_ours4k_full_offload)
      if [ -z "$ray_up" ]; then start_ray && ray_up=1; fi
      case "$phase" in
        real_ours4k) python bench/realistic.py ours --dir $dir --cap 4096 --steps ${REAL_STEPS:-5} ;;
        # The same with training micro-batches by token budget (--max_tokens_per_gpu: 8 rows of 4,096 tokens' worth).
        real_ours4k_budget) python bench/realistic.py ours --dir $dir --cap 4096 --steps ${REAL_STEPS:-5} --max_tokens_per_gpu 32768 ;;
        # By default each micro-batch's rows run as one sequence (--packing_samples unset: packed where flash-attn
        # runs); the same padded to their longest row, for the comparison.
        real_ours4k_padded) python bench/realistic.py ours --dir $dir --cap 4096 --steps ${REAL_STEPS:-5} --padded ;;
        # 20 prompt groups started, the first 16 to finish trained on, the rest aborted (--over_sampling_batch_size).
        real_ours4k_oversample) python bench/realistic.py ours --dir $dir --cap 4096 --steps ${REAL_STEPS:-5} --over_sampling_batch_size ${OVERSAMPLE:-20} ;;
        real_ours8k) python bench/realistic.py ours --dir $dir --cap 8192 --steps ${REAL_STEPS:-4} --micro 4 ;;
        real_ours8k_padded) python bench/realistic.py ours --dir $dir --cap 8192 --steps ${REAL_STEPS:-4} --micro 4 --padded ;;
        real_ours4k_hf) python bench/realistic.py ours --dir $dir --cap 4096 --engine transformers --steps ${REAL_STEPS:-2} ;;
        real_ours4k_lora) python bench/realistic.py ours --dir $dir --cap 4096 --lora_rank 64 --steps ${REAL_STEPS:-4} ;;
        # Full weights with ZeRO-3 and Adam in host memory (the 7B shape: what fits on one GPU, issue 52)
        real_ours4k_full_offload) python bench/realistic.py ours --dir $dir --cap 4096 --zero_stage 3 --adam_offload --steps ${REAL_STEPS:-3} ;;
      esac ;;
    # Vision-language RL (bench/vlm.py, issue 54): SHAPE=qwen2.5-vl-3b, 16 prompts x 8 of one 448 px image each. Full
    # weights with Adam in host memory (3.75 B parameters' optimizer state beside vLLM is over 80 GB), the tower
    # trained or frozen; or LoRA rank 64 with everything on the GPU.
    vlm_setup) [ -f $dir/model_info.json ] || python bench/vlm.py setup --dir $dir --shape $shape ;;
    vlm_ours|vlm_ours_frozen|vlm_ours_lora)
      if [ -z "$ray_up" ]; then start_ray && ray_up=1; fi
      case "$phase" in
        vlm_ours) python bench/vlm.py ours --dir $dir --steps ${VLM_STEPS:-4} --adam_offload ;;
        vlm_ours_frozen) python bench/vlm.py ours --dir $dir --steps ${VLM_STEPS:-4} --adam_offload --freeze_visual_encoder ;;
        vlm_ours_lora) python bench/vlm.py ours --dir $dir --steps ${VLM_STEPS:-4} --lora_rank 64 ;;
      esac ;;
    trl_hf) python bench/grpo_bench.py trl --dir $dir --mode hf --steps 8 ;;
    trl_vllm) python bench/grpo_bench.py trl --dir $dir --mode vllm ;;
    # Earlier sessions' results (bench/runs/) fill in what this machine did not run; its own runs win.
    # The other shape's runs on this machine, then earlier sessions' (bench/runs/) for what it did not run.
    report) mkdir -p $dir/results && cp /tmp/bench*/results/*.json $dir/results/ 2>/dev/null
            for f in $(ls -r bench/runs/*/*.json); do cp -n "$f" $dir/results/; done
            python bench/grpo_bench.py report --dir $dir --out "$out/results.json" --command "bash bench/gpu/run.sh $*" ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac > "$out/logs/$phase.log" 2>&1
  rc=$?
  echo "phase $phase: rc=$rc in $(( $(date +%s) - t0 )) s"
  [ $rc -eq 0 ] || tail -25 "$out/logs/$phase.log"
  cp $dir/*.log "$out/logs/" 2>/dev/null || true
done
# A device call brings back 8 files at most: every shape's results and this call's logs go back as one archive.
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/bundle.tgz" -C / $(cd / && ls -d tmp/bench*/results 2>/dev/null) -C "$out" logs && rm -rf "$out/logs"
else
  mkdir -p "$out/results"; cp $dir/results/*.json "$out/results/" 2>/dev/null || true
fi
[ -n "$ray_up" ] && ray_cli stop --force >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
