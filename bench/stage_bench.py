"""Our training stages, each run as the user runs it (`python -m tasks.sft` / `tasks.rl` in a subprocess) or its
pieces in this process: SFT's step time and MFU (bench_sft), where an SFT or RL training step's GPU time goes, by
kernel kind and host call site (bench_sft_profile), and our GRPO stage on the bench work in each layout
(bench_ours: colocated vLLM, async, KL on two GPUs, agentic, the hf engine). Each writes <dir>/results/<name>.json.

    python bench/grpo_bench.py sft --dir /tmp/bench [--compile] [--no_liger] [--sdpa] [--no_gc] [--zero_stage N]
    python bench/grpo_bench.py sft_profile --dir /tmp/bench [--compile] [--no_gc] [--rl_shape] [--per_tensor_check]
    python bench/grpo_bench.py ours --dir /tmp/bench --mode vllm|hf [--micro 64] [--layout ...]   # Ray head needed
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

from bench.common import (
    AGENTIC_ENV,
    AGENTIC_SLOW_ENV,
    AGENTIC_TURN_TOKENS,
    AGENTIC_TURNS,
    BF16_PEAK_FLOPS,
    COMPLETION_TOKENS,
    GROUP,
    PROMPT_TOKENS,
    PROMPTS_PER_STEP,
    grpo_args,
    kernel_events,
    on_gpu,
    parameters,
    run_stage,
    save,
    standard_mfu,
    steady_median,
    step_times,
    sync,
    train_suffix,
)


def bench_sft(
    bench_dir: Path,
    steps: int = 12,
    batch: int = 8,
    seq: int = 2048,
    compile_blocks: bool = False,
    liger: bool = True,
    flash: bool = True,
    checkpointing: bool = True,
    zero_stage: int = 2,
) -> None:
    name = (
        ("sft_compile" if compile_blocks else "sft")
        + ("" if liger else "_noliger")
        + ("" if flash else "_sdpa")
        + train_suffix(checkpointing, zero_stage)
    )
    out = bench_dir / "out" / name
    run_stage(
        "tasks.sft",
        {
            "pretrain": bench_dir / "model",
            "dataset": bench_dir / "sft.jsonl",
            "output": out,
            "max_steps": steps,
            "train_batch_size": batch,
            "micro_train_batch_size": batch,
            "max_len": seq,
            "learning_rate": 1e-5,
            "lr_warmup_steps": 0,
            "logging_steps": 1,
            "bf16": on_gpu(),
            "zero_stage": zero_stage,
            "gradient_checkpointing": checkpointing,
            "flash_attn": flash,
            "torch_compile": compile_blocks,
            "use_liger_kernel": liger,
        },
        bench_dir / f"{name}.log",
    )
    seconds = steady_median(step_times(out / "metrics.jsonl"))
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    tokens = batch * seq
    # 6 N per token for forward + backward, and 2 N more for the forward gradient checkpointing recomputes.
    flops = (8 if checkpointing else 6) * parameters(bench_dir) * tokens
    save(
        bench_dir,
        name,
        {
            "step_s": round(seconds, 4),
            "tokens_per_s": round(tokens / seconds),
            "mfu": round(flops / seconds / BF16_PEAK_FLOPS, 4),
            "mfu_standard": standard_mfu(bench_dir, tokens, seq, seconds),
            "batch": batch,
            "seq_len": seq,
            "zero_stage": zero_stage,
            "gradient_checkpointing": checkpointing,
            "torch_compile": compile_blocks,
            "liger": liger,
            "gpu_peak_gb": last.get("gpu_peak_gb"),
            "loss_last": last.get("loss"),
            "attention": _attention_kernel(bench_dir / f"{name}.log", flash),
            "recompile_limit_hits": _recompile_limit_hits(bench_dir / f"{name}.log"),
        },
    )


KERNEL_KINDS = (  # (kind, substrings of a CUDA kernel's name), first match wins
    ("fused by torch.compile", ("triton",)),
    ("optimizer", ("adam", "multi_tensor")),
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul")),
    ("log_softmax and loss", ("softmax", "logsumexp", "nll", "cross_entropy", "gather")),
    ("communication", ("nccl",)),
    ("copies", ("memcpy", "memset", "copy")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "elementwise and other")


def bench_sft_profile(
    bench_dir: Path,
    steps: int = 3,
    compile_blocks: bool = False,
    checkpointing: bool = True,
    zero_stage: int = 2,
    rl_shape: bool = False,
    per_tensor_check: bool = False,
) -> None:
    """Where an SFT step's GPU time goes: the stage's own pieces (model loading with its kernels, DeepSpeed
    strategy, log-probabilities, loss) in this process, `steps` steps under torch.profiler after 3 warm-up steps;
    kernel time per step by kind, the busiest kernels, and how much of the step no kernel ran. SFT's rows are
    8 x 2048 tokens, half of them in the loss; with `rl_shape`, the RL training phase's micro-batch instead:
    64 rows of 128 prompt and 256 completion tokens, the completion in the loss. `step_s` times 5 steps without
    the profiler. With `per_tensor_check`, ZeRO-1/2's step checks the gradients tensor by tensor, as DeepSpeed does
    (inf/NaN, then the norm) where strategy.fuse_zero_step_checks does it in a few kernels: what that cost."""
    import torch
    from torch._C._profiler import _ExperimentalConfig
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    from tasks.common.nn.losses import policy_loss
    from tasks.common.nn.models import load_causal_lm, use_liger
    from tasks.common.nn.strategy import DeepSpeedStrategy
    from tasks.common.nn.supervised import micro_batch_loss
    from tasks.rl.experience import response_logprobs

    batch, seq, prompt = (
        (PROMPTS_PER_STEP * GROUP, PROMPT_TOKENS + COMPLETION_TOKENS, PROMPT_TOKENS) if rl_shape else (8, 2048, 1024)
    )
    strategy = DeepSpeedStrategy(
        zero_stage=zero_stage,
        bf16=on_gpu(),
        micro_batch_size=batch,
        gradient_checkpointing=checkpointing,
        torch_compile=compile_blocks,
    )
    liger = use_liger(True)
    engine = strategy.prepare(
        load_causal_lm(str(bench_dir / "model"), flash_attn=True, liger=liger, torch_compile=compile_blocks), 1e-5, 100
    )
    engine.train()
    if per_tensor_check:
        deepspeed_gradient_checks(engine)
    rng = random.Random(0)
    ids = [[rng.randrange(2, 500) for _ in range(seq)] for _ in range(batch)]
    masks = [[0] * prompt + [1] * (seq - prompt) for _ in range(batch)]
    tokens = float(sum(map(sum, masks)))
    counters.clear()

    if rl_shape:  # the actor's micro-batch: completions' log-probabilities, the entropy logged, the clipped policy loss
        sequences = torch.tensor(ids, device=strategy.device)
        action_mask = torch.ones(batch, seq - prompt, device=strategy.device)
        advantages = torch.randn(batch, seq - prompt, device=strategy.device)

    def step():
        if rl_shape:
            logprobs, _ = response_logprobs(
                engine, sequences, torch.ones_like(sequences), prompt, return_entropy=True, entropy_grad=False
            )
            engine.backward(policy_loss(logprobs, logprobs.detach(), advantages, action_mask)[0])
        else:
            engine.backward(micro_batch_loss(engine, ids, masks, 0, False, strategy.device, tokens))
        engine.step()

    for _ in range(3):
        step()
    sync()
    t0 = time.time()
    for _ in range(5):
        step()
    sync()
    unprofiled_s = (time.time() - t0) / 5
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu() else [ProfilerActivity.CPU]
    t0 = time.time()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    step_s = (time.time() - t0) / steps
    events = kernel_events(prof)
    by_kind: dict[str, float] = {}
    for e in events:
        by_kind[kernel_kind(e.key)] = by_kind.get(kernel_kind(e.key), 0.0) + e.self_device_time_total / 1e6 / steps
    busy = sum(by_kind.values())
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:12]
    # What the host does while the GPU waits: the ops with the most time of their own on the CPU, and how often.
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    # Where the host waits for the GPU, by call site: one more step, with Python stacks recorded (slower, so it is
    # kept out of the timed steps above). A value read on the host (.item(), `if tensor`) or a data-dependent shape.
    with profile(
        activities=activities, with_stack=True, experimental_config=_ExperimentalConfig(verbose=True)
    ) as traced:  # verbose: the stacks
        step()
        sync()
    waits = host_call_sites(traced, ("aten::_local_scalar_dense", "aten::nonzero"))
    save(
        bench_dir,
        ("sft_profile_compile" if compile_blocks else "sft_profile")
        + ("_rl_shape" if rl_shape else "")
        + train_suffix(checkpointing, zero_stage)
        + ("_per_tensor_check" if per_tensor_check else ""),
        {
            "step_s": round(unprofiled_s, 4),
            "step_s_profiled": round(step_s, 4),
            "kernel_s_per_step": round(busy, 4),
            "idle_s_per_step": round(step_s - busy, 4),
            "kernel_s_by_kind": {k: round(v, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms_per_step": {e.key[:100]: round(e.self_device_time_total / 1e3 / steps, 2) for e in top},
            "top_host_ops_ms_and_calls_per_step": {
                e.key[:100]: [round(e.self_cpu_time_total / 1e3 / steps, 2), e.count // steps] for e in host
            },
            "host_waits_by_call_site": waits,
            "batch": batch,
            "seq_len": seq,
            "zero_stage": zero_stage,
            "gradient_checkpointing": checkpointing,
            "torch_compile": compile_blocks,
            "liger": liger,
            "per_tensor_check": per_tensor_check,
            "loss": "the actor's: response_logprobs, policy_loss"
            if rl_shape
            else "micro_batch_loss (SFT's path: Liger's fused linear cross-entropy on CUDA)",
            "compiled_graphs": counters["stats"]["unique_graphs"],
        },
    )


def deepspeed_gradient_checks(engine) -> None:
    """ZeRO-1/2's step checks the gradients tensor by tensor again (inf/NaN, then the norm), with DeepSpeed's own
    methods in place of strategy.fuse_zero_step_checks': the before of a before/after on one machine."""
    if "check_overflow" not in vars(engine.optimizer):
        raise SystemExit(
            f"--per_tensor_check: {type(engine.optimizer).__name__} checks as DeepSpeed does already (bf16 ZeRO-1/2 is what it changes)"
        )
    del engine.optimizer.check_overflow, engine.optimizer.get_grad_norm_direct


def host_call_sites(prof, names: tuple[str, ...], frames: int = 4) -> list[list]:
    """[op, calls, the innermost `frames` Python frames outside torch] for the ops named, most called first."""
    sites: dict[tuple, int] = {}
    for e in prof.events():
        if e.name in names:
            own = [
                f for f in e.stack if not f.startswith(("torch/", "<built-in", "nn.Module:")) and "/torch/" not in f
            ][:frames]
            key = (e.name, " <- ".join(own))
            sites[key] = sites.get(key, 0) + 1
    return [[name, calls, where] for (name, where), calls in sorted(sites.items(), key=lambda kv: -kv[1])[:15]]


def _attention_kernel(log: Path, flash: bool = True) -> str:
    if not flash:
        return "sdpa"
    return "sdpa (flash-attn missing)" if "flash_attn:" in log.read_text() else "flash_attention_2"


def _recompile_limit_hits(log: Path) -> int:
    """How often torch.compile gave up on a function for recompiling past its limit (the rest of its calls ran
    uncompiled): 0 where every compiled block kept its graph. The sixth lease of 2026-12-04 ran with 1 here."""
    return log.read_text().count("hit config.recompile_limit")


def bench_ours(
    bench_dir: Path,
    steps: int = 12,
    engine: str = "vllm",
    micro: int = 16,
    layout: str = "colocated",
    lr: float = 1e-6,
    liger: bool = True,
    lora_rank: int = 0,
    flash: bool = True,
    checkpointing: bool = True,
    zero_stage: int = 2,
    compile_blocks: bool = False,
) -> None:
    """layout: colocated (one GPU: vLLM inside the actor); async (two GPUs: the engine on its own,
    generating the next rollout while the actor trains, one step off-policy); or actor_ref_vllm (two
    GPUs, on-policy, KL on: actor and reference share one, the engine has the other)."""
    name = (
        f"ours_{engine}_m{micro}"
        + ("" if layout == "colocated" else f"_{layout}")
        + ("" if lr == 1e-6 else f"_lr{lr:g}")
        + ("" if liger else "_noliger")
        + (f"_lora{lora_rank}" if lora_rank else "")
        + ("" if flash else "_sdpa")
        + ("_compile" if compile_blocks else "")
        + train_suffix(checkpointing, zero_stage)
    )
    out = bench_dir / "out" / name
    args = grpo_args(bench_dir, out, steps, micro)
    args.update(
        actor_learning_rate=lr,
        use_liger_kernel=liger,
        flash_attn=flash,
        gradient_checkpointing=checkpointing,
        zero_stage=zero_stage,
        torch_compile=compile_blocks,
    )
    if lora_rank:  # adapters on every linear layer; the engine is synced the adapter alone
        args.update(lora_rank=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear")
    args["rollout_engine"] = "vllm" if engine == "vllm" else "transformers"  # the engine measured, never auto's choice
    if engine == "vllm" and layout == "colocated":
        args.update(vllm_num_engines=1, vllm_gpu_memory_utilization=0.3)
    elif engine == "vllm" and layout == "actor_ref_vllm":
        args.update(
            vllm_num_engines=1,
            vllm_gpu_memory_utilization=0.6,
            colocate_all_models=False,
            colocate_actor_ref=True,
            init_kl_coef=0.01,
        )
    elif engine == "vllm" and layout.startswith("agentic"):
        # Multi-turn episodes in a tool loop: AGENTIC_TURNS turns of AGENTIC_TURN_TOKENS tokens, the same tokens a step as above;
        # colocated on one GPU (agentic, or agentic_slow_tool with a tool of 20-200 ms), or the engine on a GPU of its
        # own, on-policy (agentic_separate) or generating the next rollout while the actor trains, new weights
        # reaching running episodes (agentic_async).
        args.update(
            vllm_num_engines=1,
            vllm_gpu_memory_utilization=0.3,
            env_path=AGENTIC_SLOW_ENV if layout == "agentic_slow_tool" else AGENTIC_ENV,
            max_turns=AGENTIC_TURNS,
            generate_max_len=AGENTIC_TURN_TOKENS,
            max_episode_tokens=AGENTIC_TURNS * (AGENTIC_TURN_TOKENS + 16),
        )
        args.pop("remote_rm_url")
        if layout not in ("agentic", "agentic_slow_tool"):
            args.update(colocate_all_models=False, vllm_gpu_memory_utilization=0.6)
        if layout == "agentic_async":
            args.update(async_train=True, max_staleness=1, partial_rollouts=True)
    elif engine == "vllm":
        args.update(vllm_num_engines=1, vllm_gpu_memory_utilization=0.6, async_train=True, colocate_all_models=False)
    run_stage("tasks.rl", args, bench_dir / f"{name}.log")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tail = records[2:] or records
    split = {
        key: round(statistics.median(r[key] for r in tail), 4)
        for key in (
            "time_step_s",
            "time_generate_s",
            "time_reward_s",
            "time_inference_s",
            "time_train_s",
            "time_weight_sync_s",
        )
    }
    step = split["time_step_s"]
    tokens = PROMPTS_PER_STEP * GROUP * COMPLETION_TOKENS
    train_tokens = PROMPTS_PER_STEP * GROUP * (PROMPT_TOKENS + COMPLETION_TOKENS)
    # Async, generation overlaps training: what the step waits for it is no rate.
    rate = None if layout.endswith("async") else round(tokens / split["time_generate_s"])
    result = {
        "step_s": step,
        **split,
        "rollout_tokens_per_s": rate,
        "train_tokens_per_s": round(train_tokens / split["time_train_s"]),
        # forward+backward (6 N) and the recomputed forward (2 N) in training; with KL, one more forward (2 N) each
        # for the old and the reference log-probabilities (without, the actor skips its scoring pass)
        "mfu": round(
            (6 + 2 * checkpointing + (4 if layout == "actor_ref_vllm" else 0))
            * parameters(bench_dir)
            * train_tokens
            / step
            / BF16_PEAK_FLOPS,
            4,
        ),
        # the training phase alone, counted the standard way
        "train_mfu_standard": standard_mfu(
            bench_dir, train_tokens, PROMPT_TOKENS + COMPLETION_TOKENS, split["time_train_s"]
        ),
        # the actor's training phase alone (a colocated engine asleep), torch's allocator, the largest over steps
        "train_gpu_peak_gb": max((r["train_gpu_peak_gb"] for r in records if "train_gpu_peak_gb" in r), default=None),
        "attention": _attention_kernel(bench_dir / f"{name}.log", flash),
        "recompile_limit_hits": _recompile_limit_hits(bench_dir / f"{name}.log"),
        "reward_first": records[0]["reward"],
        "reward_last": records[-1]["reward"],
        "reward_curve": [round(r["reward"], 4) for r in records],
        "steps": len(records),
        "learning_rate": lr,
    }
    if layout.startswith("agentic"):
        result.update(
            {
                key: round(statistics.median(r[key] for r in tail), 4)
                for key in ("episodes_per_s", "turns_per_episode", "time_env_s")
            }
        )
        for key in ("staleness", "partial_fraction", "mismatch_kl"):
            if key in records[-1]:
                result[key] = [round(r[key], 4) for r in records]
    if "engine_logprob_max_diff" in records[-1]:
        result["engine_logprob_max_diff"] = [r["engine_logprob_max_diff"] for r in records]
    save(
        bench_dir,
        name,
        {
            "micro_batch": micro,
            "liger": liger and not compile_blocks,  # --torch_compile takes the place of Liger's block kernels
            "chunked_logprobs": liger,  # the log-probs a chunk of tokens at a time (vocab.head_logprobs), compiled or not
            "torch_compile": compile_blocks,
            "lora_rank": lora_rank,
            "gradient_checkpointing": checkpointing,
            "zero_stage": zero_stage,
            **result,
        },
    )
