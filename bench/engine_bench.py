"""Rollout engines alone, no training: standalone vLLM's tokens/s against the decode floor (bench_vllm), our HF
rollout engine's decode loop eager against CUDA graphs, compiled and fused (bench_hf_generate), and the passes
over the vocabulary, compiled against eager (bench_vocab_passes). Each writes <dir>/results/<name>.json.

    python bench/grpo_bench.py vllm --dir /tmp/bench           # bench_vllm: batch 64 / 256 / 1024
    python bench/grpo_bench.py hf_generate --dir /tmp/bench    # bench_hf_generate (HF_GENERATE_VARIANTS=name,name: a subset)
    python bench/grpo_bench.py vocab_passes --dir /tmp/bench   # bench_vocab_passes (runs on a CPU too)
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path

from bench.common import (
    COMPLETION_TOKENS,
    GROUP,
    HBM_BYTES_PER_S,
    PROMPT_TOKENS,
    PROMPTS_PER_STEP,
    kernel_events,
    on_gpu,
    parameters,
    save,
    sync,
)


def decode_floor(bench_dir: Path, batch: int) -> float:
    """Tokens/s if each decode step cost only reading the bf16 weights once from HBM."""
    return batch / (2 * parameters(bench_dir) / HBM_BYTES_PER_S)


def bench_vllm(bench_dir: Path, batches=(64, 256, 1024)) -> None:
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(
        model=str(bench_dir / "model"),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        gpu_memory_utilization=0.5,
        max_model_len=PROMPT_TOKENS + COMPLETION_TOKENS,
        seed=0,
    )
    startup = time.time() - t0
    rng = random.Random(1)
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    params = SamplingParams(
        temperature=1.0, max_tokens=COMPLETION_TOKENS, ignore_eos=True, logprobs=0, detokenize=False
    )
    result = {"startup_s": round(startup, 1)}
    for batch in (8,) + tuple(batches):  # 8: warm-up
        prompts = [{"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(PROMPT_TOKENS)]} for _ in range(batch)]
        t = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.time() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if batch != 8:
            result[f"tokens_per_s_{batch}"] = round(tokens / seconds)
            result[f"decode_floor_tokens_per_s_{batch}"] = round(decode_floor(bench_dir, batch))
    save(bench_dir, "vllm", result)


def bench_hf_generate(bench_dir: Path, batch: int = 64) -> None:
    """HFRolloutEngine's tokens/s at `batch` prompts: its decode steps run eagerly against replayed as CUDA graphs,
    replayed with transformers' own SDPA attention in place of the engine's (packed_gqa_sdpa), and replayed with
    the decode forward compiled (compile_decode: fused elementwise kernels inside the graph), and compiled with
    the sibling projections fused (fuse_projections; both are what the RL stage's --torch_compile does), and that
    with flash-attn's kv-cache kernel for attention (what a model loaded with --flash_attn decodes with); where one
    decode step's GPU time goes, per kernel. HF_GENERATE_VARIANTS=name,name runs only those. Without CUDA (a dry run) the same
    calls, on the CPU."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tasks.common.nn.engines.hf_engine import HFRolloutEngine
    from tasks.common.nn.models import load_causal_lm, load_tokenizer

    device = torch.device("cuda" if on_gpu() else "cpu")
    model = load_causal_lm(str(bench_dir / "model")).to(device, torch.bfloat16 if on_gpu() else torch.float32)
    tokenizer = load_tokenizer(str(bench_dir / "model"))
    rng = random.Random(1)
    prompts = [[rng.randrange(2, model.config.vocab_size) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
    result = {"batch": batch, "completion_tokens": COMPLETION_TOKENS}
    variants = (
        ("eager", False, None),
        ("cuda_graphs", True, None),
        ("cuda_graphs_transformers_sdpa", True, "sdpa"),
        ("cuda_graphs_compiled", True, None),
        ("cuda_graphs_compiled_fused", True, None),
        ("cuda_graphs_compiled_fused_flash", True, "kvcache_decode"),
    )
    chosen = os.environ.get("HF_GENERATE_VARIANTS")  # a comma-separated subset, to spare device time
    for name, graphs, attention in variants:
        if chosen and name not in chosen.split(","):
            continue
        # EOS ignored: every completion is COMPLETION_TOKENS long
        compiled, fused = "compiled" in name, "fused" in name
        engine = HFRolloutEngine(
            model,
            tokenizer,
            device,
            cuda_graphs=graphs,
            ignore_eos=True,
            compile_decode=compiled,
            fuse_projections=fused,
        )
        engine.decode_attention = attention or engine.decode_attention

        def timed() -> tuple[float, int]:
            sync()
            t = time.time()
            rollout = engine.generate(prompts, COMPLETION_TOKENS, temperature=1.0, batch_size=batch)
            sync()
            return time.time() - t, int(rollout.response_lengths().sum())

        warmup_s, _ = timed()  # graphs: includes the warm-up steps and the capture (and the compile)
        if graphs:
            result[f"first_call_s_{name}"] = round(warmup_s, 1)
        runs = [timed() for _ in range(3)]
        seconds = statistics.median(s for s, _ in runs)
        assert all(n == batch * COMPLETION_TOKENS for _, n in runs), runs
        result[f"tokens_per_s_{name}"] = round(batch * COMPLETION_TOKENS / seconds)
        if graphs and on_gpu():  # captured False: a step could not be captured and ran eagerly (the log says why)
            result[f"captured_{name}"] = engine.captured()
            # One decode step run outside the graph on the shape's buffers: the kernels its graph replays.
            state = next(iter(engine.states.values()))
            with torch.no_grad(), engine._decoding(), profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine._decode_step(state, 1.0, False)
                sync()
            events = sorted(kernel_events(prof), key=lambda e: -e.self_device_time_total)
            result[f"step_gpu_ms_{name}"] = round(sum(e.self_device_time_total for e in events) / 1e3, 3)
            result[f"step_kernels_{name}"] = sum(e.count for e in events)
            result[f"top_kernels_{name}"] = [
                (e.key[:90], round(e.self_device_time_total / 1e3, 3), e.count) for e in events[:8]
            ]
    save(bench_dir, "hf_generate", result)


def bench_vocab_passes(bench_dir: Path, repeats: int = 10) -> None:
    """The passes over the vocabulary as the stages run them on CUDA (compiled: vocab.token_logprobs,
    token_entropy; rollout.sample_next) against the eager float32 ones they replaced (2026-12-05), on one machine:
    RL's log-probabilities and logged entropy of a training micro-batch's completions (64 x 256 tokens through the
    chunked head, forward and backward), and the decode's sampling of 64 rows, once a token. Random weights of the
    bench model's head shape; without CUDA (a dry run) both sides run the CPU's eager path."""
    import torch
    import torch.nn.functional as F

    from tasks.common.nn import vocab
    from tasks.common.nn.engines.hf_engine import fused_sample, sample_next

    config = json.loads((bench_dir / "model" / "config.json").read_text())
    device = torch.device("cuda" if on_gpu() else "cpu")
    tokens = PROMPTS_PER_STEP * GROUP * COMPLETION_TOKENS
    torch.manual_seed(0)
    hidden = torch.randn(tokens, config["hidden_size"], device=device, dtype=torch.bfloat16, requires_grad=True)
    head = torch.nn.Linear(config["hidden_size"], config["vocab_size"], bias=False, device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, config["vocab_size"], (tokens,), device=device)
    logits = torch.randn(PROMPTS_PER_STEP * GROUP, config["vocab_size"], device=device, dtype=torch.bfloat16)

    def eager_chunk(head, hidden, labels, temperature, return_entropy, entropy_grad=True):  # _chunk_logprobs before
        log_p = F.log_softmax(head(hidden).float() / temperature, dim=-1)
        logprobs = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = -(log_p.exp() * log_p).sum(-1)
        return torch.stack([logprobs, entropy])

    def train_micro_batch():  # the actor's: entropy logged, not trained on
        logprobs, _ = vocab.head_logprobs(hidden, head, labels, 1.0, return_entropy=True, entropy_grad=False)
        logprobs.sum().backward()

    def eager_sample():
        return fused_sample(logits, torch.empty(logits.shape, device=device).exponential_(), 1.0)

    def seconds(fn, n: int) -> float:
        for _ in range(3):
            fn()
        sync()
        t = time.time()
        for _ in range(n):
            fn()
        sync()
        return (time.time() - t) / n

    result = {
        "train_tokens": tokens,
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "sample_rows": logits.size(0),
    }
    result["train_micro_batch_s"] = round(seconds(train_micro_batch, repeats), 4)
    compiled_chunk, vocab._chunk_logprobs = vocab._chunk_logprobs, eager_chunk
    try:
        result["train_micro_batch_s_eager"] = round(seconds(train_micro_batch, repeats), 4)
    finally:
        vocab._chunk_logprobs = compiled_chunk
    result["sample_ms_per_token"] = round(1e3 * seconds(lambda: sample_next(logits), COMPLETION_TOKENS), 4)
    result["sample_ms_per_token_eager"] = round(1e3 * seconds(eager_sample, COMPLETION_TOKENS), 4)
    save(bench_dir, "vocab_passes", result)
