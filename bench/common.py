"""What every benchmark in bench/ shares: the work (the model shapes, PROMPT_TOKENS-token prompts, GROUP
completions of COMPLETION_TOKENS tokens for each of PROMPTS_PER_STEP prompts a step), the bench folder's setup
(random-weight model, tokenizer, prompts), the FLOP counts behind MFU, and the helpers that run one of our stages
as a subprocess and save a result as <dir>/results/<name>.json, and GPUPeak, the GPU memory peak while a block runs.

    python bench/grpo_bench.py setup --dir /tmp/bench [--shape qwen2-0.5b|qwen2.5-1.5b|tiny] [--eos_cap N]   # setup()
    from bench.common import COMPLETION_TOKENS, grpo_args, run_stage, save   # repo root on sys.path
    from common import COMPLETION_TOKENS, save                               # a script that puts bench/ on sys.path
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import threading
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
    # Qwen2.5-7B's shape: 7.62 B parameters, untied embeddings, head dim 128 (issue 52's 7B LoRA and full-weight rows).
    "qwen2.5-7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
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
SHAPE_SUFFIX = {"qwen2-0.5b": "", "qwen2.5-1.5b": "_1p5b", "qwen2.5-7b": "_7b", "tiny": ""}
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


def phase_medians(records: list[dict]) -> dict:
    """A stage's per-step phase times (metrics.jsonl's time_<phase>_s, time_step_s among them) as medians named
    <phase>_s: step_s, generate_s, train_s, …"""
    keys = [k for k in records[0] if k.startswith("time_") and k.endswith("_s") and k != "time_s"]
    return {k.removeprefix("time_"): round(statistics.median(r[k] for r in records), 3) for k in keys}


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
        vocab=vocab,
        merges=[],
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token=None,
        bos_token=None,
        padding_side="left",
        model_max_length=4096,
    )


def random_model(model_class, config, on_gpu: bool):
    """model_class(config) with seed 0's random weights, on the host. `on_gpu`: initialised on the GPU in bf16, as a
    float32 init of billions of parameters on the host takes minutes and tens of GB."""
    import torch

    torch.manual_seed(0)
    if not on_gpu:
        return model_class(config)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = model_class(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.cpu()


def setup(bench_dir: Path, shape: str, eos_cap: int = 0, eos_mean: float = 1000) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = SHAPES[shape]
    tokenizer = build_tokenizer(cfg["vocab_size"])
    config = Qwen2Config(
        **cfg,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    # The 7B on the GPU; the other shapes keep their host init, whose weights the recorded EOS calibrations
    # (bench/eos_model.py) were made on.
    on_gpu = shape == "qwen2.5-7b" and torch.cuda.is_available()
    model = random_model(Qwen2ForCausalLM, config, on_gpu).to(torch.bfloat16)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
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

        record = build(
            bench_dir / "model",
            bench_dir / f"model_eos{eos_cap}",
            eos_mean,
            eos_cap,
            temperature=1.0,
            prompts_file=bench_dir / "prompts.jsonl",
        )
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


# ---------------------------------------------------------------------------- our stages


def train_suffix(checkpointing: bool, zero_stage: int) -> str:
    """A run's name ends in what its training differs in from the default (gradient checkpointing, ZeRO-2)."""
    return ("" if checkpointing else "_nogc") + ("" if zero_stage == 2 else f"_zero{zero_stage}")


def run_stage(module: str, args: dict, log: Path) -> None:
    argv = [sys.executable, "-m", module] + [
        x for k, v in args.items() for x in ((f"--{k}", str(v)) if v is not True else (f"--{k}",))
    ]
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


# ---------------------------------------------------------------------------- profiles


def kernel_events(prof) -> list:
    """The profile's GPU kernels, averaged by name. Kernels only: torch 2.11 also gives the ops that launch them
    (aten::mm, …) their kernels' device time, which counted each kernel twice."""
    from torch.autograd import DeviceType

    return [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]


class GPUPeak:
    """The GPU's largest memory in use while the block runs, every process counted (nvidia-smi, once a second)."""

    def __enter__(self):
        self.peak_mib, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop.wait(1.0):
            try:
                used = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                )
                self.peak_mib = max([self.peak_mib, *(int(x) for x in used.stdout.split())])
            except (OSError, ValueError, subprocess.TimeoutExpired):
                return

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def gb(self) -> float | None:
        return round(self.peak_mib / 1024, 1) if self.peak_mib else None
