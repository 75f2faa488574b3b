"""GPU benchmark: our GRPO stage against TRL's GRPOTrainer on the same work, plus vLLM's standalone
rollout rate, the decode floor and SFT's MFU. Each measurement runs in its own process, so one's GPU
memory is gone before the next starts; each writes <dir>/results/<name>.json.

    python bench/grpo_bench.py setup  --dir /tmp/bench [--shape qwen2-0.5b|tiny]
    python bench/grpo_bench.py vllm   --dir /tmp/bench        # standalone vLLM at batch 64 / 256 / 1024
    python bench/grpo_bench.py hf_generate --dir /tmp/bench   # our HF rollout engine: eager decode steps vs CUDA graphs
    python bench/grpo_bench.py vocab_passes --dir /tmp/bench  # RL's log-probs and the decode's sampling: compiled vs eager
    python bench/grpo_bench.py sft    --dir /tmp/bench        # our SFT stage, 8 × 2048 tokens, MFU
    python bench/grpo_bench.py sft_profile --dir /tmp/bench   # where that SFT step's GPU time goes
    python bench/grpo_bench.py ours   --dir /tmp/bench        # our GRPO stage, vLLM colocated (Ray head needed)
    python bench/grpo_bench.py trl    --dir /tmp/bench --mode hf|vllm
    python bench/grpo_bench.py report --dir /tmp/bench --out bench/results.json

The work (both sides): a Qwen2-0.5B-shaped model with random weights in bf16; 8 prompts of 128 tokens
× 8 completions = 64 completions of exactly 256 tokens per step (EOS ignored); one optimizer update per
step; no reference model (KL off, TRL's default β = 0); gradient checkpointing; the same reward
function. Step times are medians over the steps after the first two (start-up and compilation).
bench/gpu/run.sh runs the lot on the GPU machine; bench/RESULTS.md says what came out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BF16_PEAK_FLOPS = 790e12  # the H200's measured dense bf16 rate (../shared GPU notes), the MFU denominator
HBM_BYTES_PER_S = 4.3e12  # the H200's memory bandwidth: the decode floor reads every weight once per step
PROMPT_TOKENS, COMPLETION_TOKENS, GROUP, PROMPTS_PER_STEP = 128, 256, 8, 8
SHAPES = {
    # Qwen2-0.5B's shape: 494 M parameters, tied embeddings.
    "qwen2-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    # Qwen2.5-1.5B's shape: 1.54 B parameters, tied embeddings, head dim 128.
    "qwen2.5-1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    # For a dry run of every path on a CPU.
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
}
# A result's name carries its shape, so one results folder (and results.json) holds both shapes' runs.
SHAPE_SUFFIX = {"qwen2-0.5b": "", "qwen2.5-1.5b": "_1p5b", "tiny": ""}
REWARD_FILE = Path(__file__).with_name("reward.py")
AGENTIC_ENV = Path(__file__).with_name("agentic_env.py")
AGENTIC_SLOW_ENV = Path(__file__).with_name("agentic_slow_env.py")  # the same loop, its tool taking 20-200 ms a step
AGENTIC_TURNS, AGENTIC_TURN_TOKENS = 4, 64  # 4 × 64 = COMPLETION_TOKENS: an agentic step samples as many tokens


def on_gpu() -> bool:
    """bf16 and the GPU-only paths; off for a CPU dry run of the script (--shape tiny)."""
    import torch

    return torch.cuda.is_available()


def sync() -> None:
    """Wait for the GPU's queued work before reading a clock (nothing to wait for on the CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def save(bench_dir: Path, name: str, result: dict) -> None:
    name += SHAPE_SUFFIX[json.loads((bench_dir / "model_info.json").read_text())["shape"]]
    out = bench_dir / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({name: result}), flush=True)


def steady_median(times: list[float], skip: int = 2) -> float:
    """Median step time after the first `skip` steps (start-up, compilation, allocator warm-up)."""
    tail = times[skip:] or times
    return statistics.median(tail)


# ---------------------------------------------------------------------------- setup


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer without merges (Qwen2's class, which AutoTokenizer picks for a qwen2
    config anyway): every character is one token, so a prompt of n letters is n tokens. Ids past the
    256 byte symbols and <eos>/<pad> are fillers the random model may still sample."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    vocab.update({"<eos>": len(vocab), "<pad>": len(vocab) + 1})
    vocab.update({f"<x{i}>": i for i in range(len(vocab), vocab_size)})
    return Qwen2Tokenizer(
        vocab=vocab, merges=[], eos_token="<eos>", pad_token="<pad>", unk_token=None, bos_token=None, padding_side="left", model_max_length=4096
    )


def setup(bench_dir: Path, shape: str, eos_cap: int = 0, eos_mean: float = 1000) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = SHAPES[shape]
    tokenizer = build_tokenizer(cfg["vocab_size"])
    config = Qwen2Config(**cfg, max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.save_pretrained(bench_dir / "model")
    tokenizer.save_pretrained(bench_dir / "model")
    rng = random.Random(0)

    def words(n):  # n letters: n tokens
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))

    with open(bench_dir / "prompts.jsonl", "w") as f:
        for _ in range(512):
            f.write(json.dumps({"prompt": words(PROMPT_TOKENS)}) + "\n")
    # SFT rows of exactly 2048 tokens: 1023 prompt + 1024 response + EOS.
    with open(bench_dir / "sft.jsonl", "w") as f:
        for _ in range(64):
            f.write(json.dumps({"prompt": words(1023), "response": words(1024)}) + "\n")
    params = sum(p.numel() for p in model.parameters())
    (bench_dir / "model_info.json").write_text(json.dumps({"shape": shape, "parameters": params}) + "\n")
    print(f"setup: {shape}, {params / 1e6:.1f} M parameters, in {bench_dir}", flush=True)
    if eos_cap:  # issue 52: a copy that stops, EOS at a calibrated steady hazard (bench/eos_model.py), beside the model
        sys.path.insert(0, str(ROOT))
        from bench.eos_model import build

        record = build(bench_dir / "model", bench_dir / f"model_eos{eos_cap}", eos_mean, eos_cap, temperature=1.0, prompts_file=bench_dir / "prompts.jsonl")
        print(f"setup: model_eos{eos_cap}: {json.dumps(record)}", flush=True)


def parameters(bench_dir: Path) -> int:
    return json.loads((bench_dir / "model_info.json").read_text())["parameters"]


def standard_flops_per_token(bench_dir: Path, seq: int) -> float:
    """Training FLOPs per token as PaLM's appendix B counts them: 6 N for the weight matmuls' forward and
    backward, plus 12 · layers · hidden · seq for attention's two matmuls (the causal mask's skipped half and
    gradient checkpointing's recomputed forward both not counted). N is the matmul weights: every parameter,
    less the input embedding when the output projection is a separate matrix."""
    shape = SHAPES[json.loads((bench_dir / "model_info.json").read_text())["shape"]]
    matmul = parameters(bench_dir) - (0 if shape["tie_word_embeddings"] else shape["vocab_size"] * shape["hidden_size"])
    return 6 * matmul + 12 * shape["num_hidden_layers"] * shape["hidden_size"] * seq


def standard_mfu(bench_dir: Path, tokens: int, seq: int, seconds: float) -> float:
    return round(standard_flops_per_token(bench_dir, seq) * tokens / seconds / BF16_PEAK_FLOPS, 4)


# ---------------------------------------------------------------------------- vLLM alone


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
    params = SamplingParams(temperature=1.0, max_tokens=COMPLETION_TOKENS, ignore_eos=True, logprobs=0, detokenize=False)
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
        engine = HFRolloutEngine(model, tokenizer, device, cuda_graphs=graphs, ignore_eos=True, compile_decode=compiled, fuse_projections=fused)
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
            result[f"top_kernels_{name}"] = [(e.key[:90], round(e.self_device_time_total / 1e3, 3), e.count) for e in events[:8]]
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

    result = {"train_tokens": tokens, "vocab_size": config["vocab_size"], "hidden_size": config["hidden_size"], "sample_rows": logits.size(0)}
    result["train_micro_batch_s"] = round(seconds(train_micro_batch, repeats), 4)
    compiled_chunk, vocab._chunk_logprobs = vocab._chunk_logprobs, eager_chunk
    try:
        result["train_micro_batch_s_eager"] = round(seconds(train_micro_batch, repeats), 4)
    finally:
        vocab._chunk_logprobs = compiled_chunk
    result["sample_ms_per_token"] = round(1e3 * seconds(lambda: sample_next(logits), COMPLETION_TOKENS), 4)
    result["sample_ms_per_token_eager"] = round(1e3 * seconds(eager_sample, COMPLETION_TOKENS), 4)
    save(bench_dir, "vocab_passes", result)


# ---------------------------------------------------------------------------- our stages


def train_suffix(checkpointing: bool, zero_stage: int) -> str:
    """A run's name ends in what its training differs in from the default (gradient checkpointing, ZeRO-2)."""
    return ("" if checkpointing else "_nogc") + ("" if zero_stage == 2 else f"_zero{zero_stage}")


def run_stage(module: str, args: dict, log: Path) -> None:
    argv = [sys.executable, "-m", module] + [x for k, v in args.items() for x in ((f"--{k}", str(v)) if v is not True else (f"--{k}",))]
    print(" ".join(argv), flush=True)
    with open(log, "w") as f:
        done = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = log.read_text().splitlines()[-30:]
        raise SystemExit(f"{module} failed ({done.returncode}); last lines of {log}:\n" + "\n".join(tail))


def step_times(metrics_file: Path) -> list[float]:
    """Per-step seconds from a stage's metrics.jsonl (its `time_s` is time since the tracker started)."""
    stamps = [json.loads(line)["time_s"] for line in metrics_file.read_text().splitlines() if line.strip()]
    return [b - a for a, b in zip(stamps, stamps[1:])]


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
    name = ("sft_compile" if compile_blocks else "sft") + ("" if liger else "_noliger") + ("" if flash else "_sdpa") + train_suffix(checkpointing, zero_stage)
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


def kernel_events(prof) -> list:
    """The profile's GPU kernels, averaged by name. Kernels only: torch 2.11 also gives the ops that launch them
    (aten::mm, …) their kernels' device time, which counted each kernel twice."""
    from torch.autograd import DeviceType

    return [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]


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

    batch, seq, prompt = (PROMPTS_PER_STEP * GROUP, PROMPT_TOKENS + COMPLETION_TOKENS, PROMPT_TOKENS) if rl_shape else (8, 2048, 1024)
    strategy = DeepSpeedStrategy(
        zero_stage=zero_stage, bf16=on_gpu(), micro_batch_size=batch, gradient_checkpointing=checkpointing, torch_compile=compile_blocks
    )
    liger = use_liger(True)
    engine = strategy.prepare(load_causal_lm(str(bench_dir / "model"), flash_attn=True, liger=liger, torch_compile=compile_blocks), 1e-5, 100)
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
            logprobs, _ = response_logprobs(engine, sequences, torch.ones_like(sequences), prompt, return_entropy=True, entropy_grad=False)
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
    with profile(activities=activities, with_stack=True, experimental_config=_ExperimentalConfig(verbose=True)) as traced:  # verbose: the stacks
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
            "top_host_ops_ms_and_calls_per_step": {e.key[:100]: [round(e.self_cpu_time_total / 1e3 / steps, 2), e.count // steps] for e in host},
            "host_waits_by_call_site": waits,
            "batch": batch,
            "seq_len": seq,
            "zero_stage": zero_stage,
            "gradient_checkpointing": checkpointing,
            "torch_compile": compile_blocks,
            "liger": liger,
            "per_tensor_check": per_tensor_check,
            "loss": "the actor's: response_logprobs, policy_loss" if rl_shape else "micro_batch_loss (SFT's path: Liger's fused linear cross-entropy on CUDA)",
            "compiled_graphs": counters["stats"]["unique_graphs"],
        },
    )


def deepspeed_gradient_checks(engine) -> None:
    """ZeRO-1/2's step checks the gradients tensor by tensor again (inf/NaN, then the norm), with DeepSpeed's own
    methods in place of strategy.fuse_zero_step_checks': the before of a before/after on one machine."""
    if "check_overflow" not in vars(engine.optimizer):
        raise SystemExit(f"--per_tensor_check: {type(engine.optimizer).__name__} checks as DeepSpeed does already (bf16 ZeRO-1/2 is what it changes)")
    del engine.optimizer.check_overflow, engine.optimizer.get_grad_norm_direct


def host_call_sites(prof, names: tuple[str, ...], frames: int = 4) -> list[list]:
    """[op, calls, the innermost `frames` Python frames outside torch] for the ops named, most called first."""
    sites: dict[tuple, int] = {}
    for e in prof.events():
        if e.name in names:
            own = [f for f in e.stack if not f.startswith(("torch/", "<built-in", "nn.Module:")) and "/torch/" not in f][:frames]
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


def grpo_args(bench_dir: Path, out: Path, steps: int, micro: int) -> dict:
    return {
        "pretrain": bench_dir / "model",
        "prompt_data": bench_dir / "prompts.jsonl",
        "remote_rm_url": REWARD_FILE,
        "output": out,
        "max_steps": steps,
        "advantage_estimator": "group_norm",
        "n_samples_per_prompt": GROUP,
        "rollout_batch_size": PROMPTS_PER_STEP,
        "train_batch_size": PROMPTS_PER_STEP * GROUP,
        "micro_train_batch_size": micro,
        "max_epochs": 1,
        "prompt_max_len": PROMPT_TOKENS,
        "generate_max_len": COMPLETION_TOKENS,
        "ignore_eos": True,
        "init_kl_coef": 0.0,
        "actor_learning_rate": 1e-6,
        "lr_warmup_steps": 0,
        "bf16": on_gpu(),
        "zero_stage": 2,
        "gradient_checkpointing": True,
        "flash_attn": True,
        "colocate_all_models": True,
        "logging_steps": 1,
        # Log-probabilities in chunks too: a 64 × 384 × 152k float32 logits tensor at once is 14 GiB.
        "micro_rollout_batch_size": micro,
    }


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
        args.update(vllm_num_engines=1, vllm_gpu_memory_utilization=0.6, colocate_all_models=False, colocate_actor_ref=True, init_kl_coef=0.01)
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
        for key in ("time_step_s", "time_generate_s", "time_reward_s", "time_inference_s", "time_train_s", "time_weight_sync_s")
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
        "mfu": round((6 + 2 * checkpointing + (4 if layout == "actor_ref_vllm" else 0)) * parameters(bench_dir) * train_tokens / step / BF16_PEAK_FLOPS, 4),
        # the training phase alone, counted the standard way
        "train_mfu_standard": standard_mfu(bench_dir, train_tokens, PROMPT_TOKENS + COMPLETION_TOKENS, split["time_train_s"]),
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
        result.update({key: round(statistics.median(r[key] for r in tail), 4) for key in ("episodes_per_s", "turns_per_episode", "time_env_s")})
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


# ---------------------------------------------------------------------------- eval

EVAL_PROMPTS = 1000


def bench_eval(bench_dir: Path, engine: str) -> None:
    """The eval stage on EVAL_PROMPTS prompts of PROMPT_TOKENS tokens, COMPLETION_TOKENS new tokens each, the
    bench model on both sides (the policy a copy of it; each side: greedy responses, one sample per prompt, the KL pass): its
    worker's transformers engine on the GPU, or --use_vllm. The seconds per side come from the stage's log."""
    rows = [json.loads(line) for line in (bench_dir / "prompts.jsonl").read_text().splitlines()]
    data = bench_dir / "eval_prompts.jsonl"
    data.write_text("".join(json.dumps(rows[i % len(rows)]) + "\n" for i in range(EVAL_PROMPTS)))
    name = f"eval_{engine}"
    log = bench_dir / f"{name}.log"
    # The policy is a copy, not the same path: the stage knows the baseline's own KL to itself is 0 and skips it.
    policy = bench_dir / "policy_model"
    if not policy.exists():
        shutil.copytree(bench_dir / "model", policy)
    started = time.time()
    run_stage(
        "tasks.eval",
        {
            "output": bench_dir / "out" / name,
            "baseline": bench_dir / "model",
            "policy": policy,
            "dataset": data,
            "bf16": on_gpu(),
            "max_samples": EVAL_PROMPTS,
            "generate_max_len": COMPLETION_TOKENS,
            "metrics": "length",
            "bootstrap_resamples": 200,
            "use_vllm": engine == "vllm",
        },
        log,
    )
    lines = re.findall(r"scored the \w+ on \d+ prompts .* in ([0-9.]+) s \(.*?; (.*)\)", log.read_text())
    sides = [float(total) for total, _ in lines]
    # where each side's time went (load, greedy, sampled, kl, reward), from the same lines
    split = [{part: float(s) for part, s in re.findall(r"(\w+) ([0-9.]+) s", parts)} for _, parts in lines]
    save(
        bench_dir,
        name,
        {
            "prompts": EVAL_PROMPTS,
            "new_tokens": COMPLETION_TOKENS,
            "side_s": sides,
            "side_split_s": split,
            "stage_s": round(time.time() - started, 1),
            "tokens_per_s": round(2 * EVAL_PROMPTS * COMPLETION_TOKENS / sides[-1]) if sides else None,
        },
    )


# ---------------------------------------------------------------------------- TRL


def bench_trl(bench_dir: Path, mode: str, steps: int = 12) -> None:
    import importlib.util

    import trl
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("bench_reward", REWARD_FILE)
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)

    class StepClock(TrainerCallback):
        def __init__(self):
            self.stamps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.stamps.append(time.time())

    tokenizer = AutoTokenizer.from_pretrained(bench_dir / "model")
    dataset = load_dataset("json", data_files=str(bench_dir / "prompts.jsonl"), split="train")
    vllm = mode == "vllm"
    args = GRPOConfig(
        output_dir=str(bench_dir / "out" / f"trl_{mode}"),
        max_steps=steps,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
        gradient_accumulation_steps=1,
        num_generations=GROUP,
        max_completion_length=COMPLETION_TOKENS,
        learning_rate=1e-6,
        bf16=on_gpu(),
        use_cpu=not on_gpu(),
        beta=0.0,
        gradient_checkpointing=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        use_vllm=vllm,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        generation_kwargs={"ignore_eos": True} if vllm else {"min_new_tokens": COMPLETION_TOKENS},
    )
    clock = StepClock()
    start = time.time()
    trainer = GRPOTrainer(
        model=str(bench_dir / "model"), reward_funcs=reward.trl_reward, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[clock]
    )
    clock.stamps.append(time.time())
    setup_s = clock.stamps[0] - start
    trainer.train()
    times = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    save(bench_dir, f"trl_{mode}", {"step_s": round(steady_median(times), 4), "setup_s": round(setup_s, 1), "steps": len(times), "trl": trl.__version__})


# ---------------------------------------------------------------------------- report


def report(bench_dir: Path, out: Path, command: str) -> None:
    import torch

    results = {p.stem: json.loads(p.read_text()) for p in sorted((bench_dir / "results").glob("*.json"))}

    def get(name, key):
        return results.get(name, {}).get(key)

    versions = {}
    for package in ("torch", "transformers", "vllm", "deepspeed", "ray", "trl", "flash_attn"):
        try:
            versions[package] = __import__(package).__version__
        except Exception:  # noqa: BLE001 - absent is a fact to record
            versions[package] = None
    # Ours at its best micro-batch (sequences per forward/backward): the runs differ only in that.
    candidates = sorted(
        (r["step_s"], name)
        for name, r in results.items()
        if name.startswith("ours_vllm") and not any(k in name for k in ("async", "agentic", "noliger", "lora", "sdpa", "_compile", "_nogc", "_zero", "_1p5b"))
    )
    best = candidates[0][1] if candidates else "ours_vllm"
    ours, trl_hf, trl_vllm = get(best, "step_s"), get("trl_hf", "step_s"), get("trl_vllm", "step_s")

    def fastest(peer: str, shape: str = "") -> tuple[float | None, str | None]:
        """A peer's fastest run on the same work at one shape ("" or "_1p5b"): (step seconds, run name)."""
        runs = ((r["step_s"], n) for n, r in results.items() if n.startswith(peer) and n.endswith("_1p5b") == (shape == "_1p5b"))
        return min(runs, default=(None, None))

    def ratio(slower: float | None, faster: float | None) -> float | None:
        return round(slower / faster, 3) if slower and faster else None

    openrlhf, openrlhf_run = fastest("openrlhf")  # OpenRLHF 0.11.2 (bench/openrlhf_bench.py)
    verl, verl_run = fastest("verl")  # verl 0.9.1 (bench/verl_bench.py)
    ours_1p5b, trl_vllm_1p5b = get("ours_vllm_m64_1p5b", "step_s"), get("trl_vllm_1p5b", "step_s")
    openrlhf_1p5b, openrlhf_1p5b_run = fastest("openrlhf", "_1p5b")
    verl_1p5b, verl_1p5b_run = fastest("verl", "_1p5b")
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "command": command,
        "model": json.loads((bench_dir / "model_info.json").read_text()),
        "work": {
            "prompts_per_step": PROMPTS_PER_STEP,
            "group": GROUP,
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": COMPLETION_TOKENS,
            "updates_per_step": 1,
            "kl": "off (beta 0)",
        },
        "grpo_step_s_ours": ours,
        "grpo_step_s_trl": trl_hf,
        "grpo_step_s_trl_vllm": trl_vllm,
        "speedup_vs_trl_vllm": ratio(trl_vllm, ours),
        "speedup_vs_trl_hf": ratio(trl_hf, ours),
        "grpo_step_s_openrlhf": openrlhf,
        "speedup_vs_openrlhf": ratio(openrlhf, ours),
        "grpo_openrlhf_run": openrlhf_run,
        "grpo_step_s_verl": verl,
        "speedup_vs_verl": ratio(verl, ours),
        "grpo_verl_run": verl_run,
        "grpo_ours_run": best,
        "rollout_tokens_per_s": get(best, "rollout_tokens_per_s"),
        "grpo_step_s_ours_2gpu_async": min((r["step_s"] for n, r in results.items() if "async" in n and "agentic" not in n), default=None),
        # agentic_<key> (colocated, one GPU), agentic_separate_<key> and agentic_async_<key> (the engine on a second GPU)
        **{f"eval_{engine}_{key}": get(f"eval_{engine}", key) for engine in ("vllm", "hf") for key in ("side_s", "stage_s", "tokens_per_s")},
        **{
            "agentic_" + n.split("_agentic")[1].lstrip("_") + ("_" if n.split("_agentic")[1] else "") + key: r.get(key)
            for n, r in results.items()
            if "_agentic" in n
            for key in ("step_s", "episodes_per_s", "turns_per_episode", "time_generate_s", "time_train_s", "time_weight_sync_s")
        },
        "vllm_standalone_tokens_per_s": get("vllm", "tokens_per_s_64"),
        "hf_generate_tokens_per_s": {
            "dynamic": get("hf_generate", "tokens_per_s_dynamic"),
            "static_compiled": get("hf_generate", "tokens_per_s_static_compiled"),
            "eager": get("hf_generate", "tokens_per_s_eager"),
            "cuda_graphs": get("hf_generate", "tokens_per_s_cuda_graphs"),
            "cuda_graphs_transformers_sdpa": get("hf_generate", "tokens_per_s_cuda_graphs_transformers_sdpa"),
            "cuda_graphs_compiled": get("hf_generate", "tokens_per_s_cuda_graphs_compiled"),
            "cuda_graphs_compiled_fused": get("hf_generate", "tokens_per_s_cuda_graphs_compiled_fused"),
        },
        "vllm_standalone_tokens_per_s_by_batch": {b: get("vllm", f"tokens_per_s_{b}") for b in (64, 256, 1024)},
        "decode_floor_tokens_per_s": get("vllm", "decode_floor_tokens_per_s_64"),
        "decode_floor_tokens_per_s_by_batch": {b: get("vllm", f"decode_floor_tokens_per_s_{b}") for b in (64, 256, 1024)},
        "sft_mfu": max((r["mfu"] for n, r in results.items() if n in ("sft", "sft_compile")), default=None),
        "sft_mfu_by_run": {n: results[n]["mfu"] for n in ("sft", "sft_compile") if n in results},
        # 6 N + attention, recomputation not counted (standard_flops_per_token); from step_s for runs recorded before it
        "sft_mfu_standard_by_run": {
            n: r.get("mfu_standard") or standard_mfu(bench_dir, r["batch"] * r["seq_len"], r["seq_len"], r["step_s"])
            for n, r in results.items()
            if n.startswith("sft") and "step_s" in r and "seq_len" in r
        },
        "sft_mfu_standard": max(
            (
                r.get("mfu_standard") or standard_mfu(bench_dir, r["batch"] * r["seq_len"], r["seq_len"], r["step_s"])
                for n, r in results.items()
                # without the recomputed forward too: the standard count leaves it out either way
                if n in ("sft", "sft_compile", "sft_nogc", "sft_compile_nogc")
            ),
            default=None,
        ),
        # Liger's kernels and chunked log-probs (the default on CUDA) against the eager kernels and full logits
        "liger_on_off": {
            key: [get(on, field), get(off, field)]
            for key, on, off, field in (
                ("sft_step_s", "sft", "sft_noliger", "step_s"),
                ("sft_gpu_peak_gb", "sft", "sft_noliger", "gpu_peak_gb"),
                ("sft_loss_last", "sft", "sft_noliger", "loss_last"),
                ("grpo_step_s", "ours_vllm_m64", "ours_vllm_m64_noliger", "step_s"),
                ("grpo_train_s", "ours_vllm_m64", "ours_vllm_m64_noliger", "time_train_s"),
            )
        },
        # LoRA (rank 64, every linear layer, the adapter alone synced to vLLM) beside full fine-tuning, same work
        "lora_vs_full": {
            key: [get("ours_vllm_m64_lora64", key), get("ours_vllm_m64", key)] for key in ("step_s", "time_generate_s", "time_train_s", "time_weight_sync_s")
        },
        # The 1.5B shape (SHAPE=qwen2.5-1.5b; the runs' names end in _1p5b): the same work, LoRA where it should pay in memory
        "grpo_step_s_ours_1p5b": ours_1p5b,
        "grpo_step_s_trl_vllm_1p5b": trl_vllm_1p5b,
        "speedup_vs_trl_vllm_1p5b": ratio(trl_vllm_1p5b, ours_1p5b),
        "grpo_step_s_openrlhf_1p5b": openrlhf_1p5b,
        "speedup_vs_openrlhf_1p5b": ratio(openrlhf_1p5b, ours_1p5b),
        "grpo_openrlhf_1p5b_run": openrlhf_1p5b_run,
        "grpo_step_s_verl_1p5b": verl_1p5b,
        "speedup_vs_verl_1p5b": ratio(verl_1p5b, ours_1p5b),
        "grpo_verl_1p5b_run": verl_1p5b_run,
        # The hf engine (the actor's own decode loop, its steps replayed as CUDA graphs) in place of vLLM, same work
        **{f"grpo_step_s_ours_hf{shape}": get(f"ours_hf_m64{shape}", "step_s") for shape in ("", "_1p5b")},
        **{f"speedup_hf_vs_trl_vllm{shape}": ratio(get(f"trl_vllm{shape}", "step_s"), get(f"ours_hf_m64{shape}", "step_s")) for shape in ("", "_1p5b")},
        "lora_vs_full_1p5b": {
            attention: {
                key: [get(f"ours_vllm_m64_lora64{suffix}_1p5b", key), get(f"ours_vllm_m64{suffix}_1p5b", key)]
                for key in ("step_s", "time_generate_s", "time_train_s", "time_weight_sync_s", "train_gpu_peak_gb")
            }
            for attention, suffix in (("flash_attn", ""), ("sdpa", "_sdpa"))
        },
        # FlashAttention-2 (the package built on the machine, bench/gpu/flash_attn.sh) against PyTorch's SDPA, same host
        "flash_vs_sdpa": {
            f"{key}{shape}": [get(run + shape, field), get(run + "_sdpa" + shape, field)]
            for shape in ("", "_1p5b")
            for key, run, field in (
                ("sft_step_s", "sft", "step_s"),
                ("sft_mfu_standard", "sft", "mfu_standard"),
                ("sft_gpu_peak_gb", "sft", "gpu_peak_gb"),
                ("grpo_step_s", "ours_vllm_m64", "step_s"),
                ("grpo_train_s", "ours_vllm_m64", "time_train_s"),
                ("grpo_train_mfu_standard", "ours_vllm_m64", "train_mfu_standard"),
            )
        },
        "versions": versions,
        "runs": results,
    }
    out.write_text(json.dumps(summary, indent=2) + "\n")
    for key in (
        "grpo_step_s_ours",
        "grpo_step_s_trl_vllm",
        "grpo_step_s_trl",
        "grpo_step_s_openrlhf",
        "grpo_step_s_verl",
        "grpo_step_s_ours_1p5b",
        "grpo_step_s_trl_vllm_1p5b",
        "grpo_step_s_openrlhf_1p5b",
        "grpo_step_s_verl_1p5b",
        "rollout_tokens_per_s",
        "vllm_standalone_tokens_per_s",
        "decode_floor_tokens_per_s",
        "sft_mfu",
        "sft_mfu_standard",
    ):
        print(f"{key:32} {summary[key]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["setup", "vllm", "hf_generate", "vocab_passes", "sft", "sft_profile", "ours", "trl", "eval", "report"])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench"))
    parser.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--mode", default="vllm", choices=["hf", "vllm"], help="trl: generate with HF generate or vLLM colocate; ours: engine")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--micro", type=int, default=16, help="ours: sequences per forward/backward and per log-probability pass")
    parser.add_argument(
        "--layout",
        default="colocated",
        choices=["colocated", "async", "actor_ref_vllm", "agentic", "agentic_slow_tool", "agentic_separate", "agentic_async"],
        help="ours: one GPU; two with async rollouts; two with actor+ref on one and vLLM on the other",
    )
    parser.add_argument("--lr", type=float, default=1e-6, help="ours: actor learning rate (a learning check uses a larger one)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    parser.add_argument("--command", default="bash bench/gpu/run.sh", help="recorded in results.json")
    parser.add_argument("--compile", action="store_true", help="sft, sft_profile, ours: --torch_compile (each transformer block compiled)")
    parser.add_argument("--no_liger", action="store_true", help="sft, ours: --use_liger_kernel false (the eager kernels and full logits)")
    parser.add_argument("--lora_rank", type=int, default=0, help="ours: LoRA adapters of this rank on every linear layer")
    parser.add_argument("--sdpa", action="store_true", help="sft, ours: --flash_attn false (PyTorch's SDPA kernels)")
    parser.add_argument("--no_gc", action="store_true", help="sft, sft_profile, ours: --gradient_checkpointing false (activations kept, no recomputed forward)")
    parser.add_argument("--rl_shape", action="store_true", help="sft_profile: the RL training phase's micro-batch (64 x 384 tokens) in place of SFT's rows")
    parser.add_argument(
        "--per_tensor_check",
        action="store_true",
        help="sft_profile: ZeRO-1/2's checks of each gradient tensor back (DeepSpeed's inf/NaN pass and norm; what they cost)",
    )
    parser.add_argument("--eos_cap", type=int, default=0, help="setup: also <dir>/model_eos<cap>, EOS at a hazard calibrated to --eos_mean under this cap")
    parser.add_argument("--eos_mean", type=float, default=1000, help="setup: the mean response length (tokens) --eos_cap's model is calibrated to")
    parser.add_argument("--zero_stage", type=int, default=2, choices=[0, 1, 2, 3], help="sft, sft_profile, ours: DeepSpeed's ZeRO stage")
    a = parser.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    if a.what == "setup":
        setup(a.dir, a.shape, a.eos_cap, a.eos_mean)
    elif a.what == "vllm":
        bench_vllm(a.dir)
    elif a.what == "hf_generate":
        bench_hf_generate(a.dir)
    elif a.what == "vocab_passes":
        bench_vocab_passes(a.dir)
    elif a.what == "sft":
        bench_sft(a.dir, a.steps, compile_blocks=a.compile, liger=not a.no_liger, flash=not a.sdpa, checkpointing=not a.no_gc, zero_stage=a.zero_stage)
    elif a.what == "sft_profile":
        bench_sft_profile(
            a.dir, compile_blocks=a.compile, checkpointing=not a.no_gc, zero_stage=a.zero_stage, rl_shape=a.rl_shape, per_tensor_check=a.per_tensor_check
        )
    elif a.what == "ours":
        bench_ours(
            a.dir,
            a.steps,
            engine=a.mode,
            micro=a.micro,
            layout=a.layout,
            lr=a.lr,
            liger=not a.no_liger,
            lora_rank=a.lora_rank,
            flash=not a.sdpa,
            checkpointing=not a.no_gc,
            zero_stage=a.zero_stage,
            compile_blocks=a.compile,
        )
    elif a.what == "trl":
        bench_trl(a.dir, a.mode, a.steps)
    elif a.what == "eval":
        bench_eval(a.dir, a.mode)
    else:
        report(a.dir, a.out, a.command)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
