"""Where an SFT or RL training step's GPU time goes: the stage's own pieces (model, DeepSpeed strategy, log-probs,
loss) in this process under torch.profiler, kernel time by kind and by host call site (bench_sft_profile).
Writes <dir>/results/sft_profile*.json.

    python bench/grpo_bench.py sft_profile --dir /tmp/bench [--compile] [--no_gc] [--rl_shape] [--per_tensor_check]
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from bench.common import (
    COMPLETION_TOKENS,
    GROUP,
    PROMPT_TOKENS,
    PROMPTS_PER_STEP,
    kernel_events,
    on_gpu,
    save,
    sync,
    train_suffix,
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
