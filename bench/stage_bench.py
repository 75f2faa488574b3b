"""Our training stages, each run as the user runs it (`python -m tasks.sft` / `tasks.rl` in a subprocess) or its
pieces in this process: SFT's step time and MFU (bench_sft) and our GRPO stage on the bench work in each layout
(bench_ours: colocated vLLM, async, KL on two GPUs, agentic, the hf engine); where a training step's GPU time goes
is profile_bench.py's. Each writes <dir>/results/<name>.json.

    python bench/grpo_bench.py sft --dir /tmp/bench [--compile] [--no_liger] [--sdpa] [--no_gc] [--zero_stage N]
    python bench/grpo_bench.py ours --dir /tmp/bench --mode vllm|hf [--micro 64] [--layout ...]   # Ray head needed
"""

from __future__ import annotations

import json
import statistics
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
    on_gpu,
    parameters,
    run_stage,
    save,
    standard_mfu,
    steady_median,
    step_times,
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
