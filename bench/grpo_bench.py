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

This file is the command line alone; the benchmarks live beside it: bench/common.py (the work's constants, setup,
saving, running a stage), engine_bench.py (vllm, hf_generate, vocab_passes), stage_bench.py (sft, sft_profile,
ours), eval_bench.py (eval), trl_bench.py (trl) and report.py (report).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # the repo root: `bench.…` below, `tasks.…` in the benchmarks

from bench.common import ROOT, SHAPES, setup  # noqa: E402
from bench.engine_bench import bench_hf_generate, bench_vllm, bench_vocab_passes  # noqa: E402
from bench.eval_bench import bench_eval  # noqa: E402
from bench.profile_bench import bench_sft_profile  # noqa: E402
from bench.report import report  # noqa: E402
from bench.stage_bench import bench_ours, bench_sft  # noqa: E402
from bench.trl_bench import bench_trl  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "what",
        choices=["setup", "vllm", "hf_generate", "vocab_passes", "sft", "sft_profile", "ours", "trl", "eval", "report"],
    )
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench"))
    parser.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    parser.add_argument(
        "--mode",
        default="vllm",
        choices=["hf", "vllm"],
        help="trl: generate with HF generate or vLLM colocate; ours: engine",
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--micro", type=int, default=16, help="ours: sequences per forward/backward and per log-probability pass"
    )
    parser.add_argument(
        "--layout",
        default="colocated",
        choices=[
            "colocated",
            "async",
            "actor_ref_vllm",
            "agentic",
            "agentic_slow_tool",
            "agentic_separate",
            "agentic_async",
        ],
        help="ours: one GPU; two with async rollouts; two with actor+ref on one and vLLM on the other",
    )
    parser.add_argument(
        "--lr", type=float, default=1e-6, help="ours: actor learning rate (a learning check uses a larger one)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    parser.add_argument("--command", default="bash bench/gpu/run.sh", help="recorded in results.json")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="sft, sft_profile, ours: --torch_compile (each transformer block compiled)",
    )
    parser.add_argument(
        "--no_liger",
        action="store_true",
        help="sft, ours: --use_liger_kernel false (the eager kernels and full logits)",
    )
    parser.add_argument(
        "--lora_rank", type=int, default=0, help="ours: LoRA adapters of this rank on every linear layer"
    )
    parser.add_argument("--sdpa", action="store_true", help="sft, ours: --flash_attn false (PyTorch's SDPA kernels)")
    parser.add_argument(
        "--no_gc",
        action="store_true",
        help="sft, sft_profile, ours: --gradient_checkpointing false (activations kept, no recomputed forward)",
    )
    parser.add_argument(
        "--rl_shape",
        action="store_true",
        help="sft_profile: the RL training phase's micro-batch (64 x 384 tokens) in place of SFT's rows",
    )
    parser.add_argument(
        "--per_tensor_check",
        action="store_true",
        help="sft_profile: ZeRO-1/2's checks of each gradient tensor back (DeepSpeed's inf/NaN pass and norm; what they cost)",
    )
    parser.add_argument(
        "--eos_cap",
        type=int,
        default=0,
        help="setup: also <dir>/model_eos<cap>, EOS at a hazard calibrated to --eos_mean under this cap",
    )
    parser.add_argument(
        "--eos_mean",
        type=float,
        default=1000,
        help="setup: the mean response length (tokens) --eos_cap's model is calibrated to",
    )
    parser.add_argument(
        "--zero_stage", type=int, default=2, choices=[0, 1, 2, 3], help="sft, sft_profile, ours: DeepSpeed's ZeRO stage"
    )
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
        bench_sft(
            a.dir,
            a.steps,
            compile_blocks=a.compile,
            liger=not a.no_liger,
            flash=not a.sdpa,
            checkpointing=not a.no_gc,
            zero_stage=a.zero_stage,
        )
    elif a.what == "sft_profile":
        bench_sft_profile(
            a.dir,
            compile_blocks=a.compile,
            checkpointing=not a.no_gc,
            zero_stage=a.zero_stage,
            rl_shape=a.rl_shape,
            per_tensor_check=a.per_tensor_check,
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
