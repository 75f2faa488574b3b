"""Host ops of one SFT step, by phase, on any machine: what the host issues while the GPU waits.

    python bench/host_ops.py                       # ZeRO-2, bf16, compiled blocks
    python bench/host_ops.py --per_tensor_check    # DeepSpeed's per-tensor checks back (inf/NaN, norm)
    python bench/host_ops.py --zero_stage 0 --eager --out host_ops.json

The model has Qwen2-0.5B's layout of parameters (24 layers, 290 tensors, tied embeddings) at a tiny width, so
a CPU runs it in seconds and the counts are what the 0.5B model's step issues: ops are per tensor, not per
element. Each phase (forward, backward, optimizer step) runs once under torch.profiler after 3 warm-up steps;
it prints the aten ops, the waits for a value on the host (`.item()`), and the ops called 20 times or more.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import profile
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import SHAPES  # noqa: E402
from bench.profile_bench import deepspeed_gradient_checks  # noqa: E402
from tasks.common.nn.strategy import DeepSpeedStrategy  # noqa: E402
from tasks.common.nn.supervised import micro_batch_loss  # noqa: E402


def count(prof) -> dict:
    events = prof.key_averages()
    return {
        "aten_ops": sum(e.count for e in events if e.key.startswith("aten::")),
        "item": sum(e.count for e in events if e.key == "aten::_local_scalar_dense"),
        "most_called": {e.key: e.count for e in sorted(events, key=lambda e: -e.count) if e.count >= 20},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zero_stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument(
        "--eager", action="store_true", help="no compiled blocks (the default compiles them, as the GPU bench does)"
    )
    parser.add_argument(
        "--per_tensor_check",
        action="store_true",
        help="ZeRO-1/2's checks of each gradient tensor back (DeepSpeed's inf/NaN pass and norm)",
    )
    parser.add_argument("--out", type=Path, help="also write the counts here (JSON)")
    a = parser.parse_args()

    # The bench's 0.5B shape (its layers, its tied embeddings) at a tiny width.
    config = Qwen2Config(
        **{
            **SHAPES["qwen2-0.5b"],
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
        }
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    strategy = DeepSpeedStrategy(zero_stage=a.zero_stage, bf16=True, micro_batch_size=2, torch_compile=not a.eager)
    engine = strategy.prepare(model, 1e-5, 100)
    if a.per_tensor_check:
        deepspeed_gradient_checks(engine)
    ids = [[(row * 7 + i) % 500 + 2 for i in range(64)] for row in range(2)]
    masks = [[0] * 32 + [1] * 32 for _ in range(2)]
    loss = None

    def forward():
        nonlocal loss
        loss = micro_batch_loss(engine, ids, masks, 0, False, strategy.device, 64.0)

    phases = {"forward": forward, "backward": lambda: engine.backward(loss), "optimizer_step": engine.step}
    for _ in range(3):
        for run in phases.values():
            run()
    counts = {}
    for name, run in phases.items():
        with profile() as prof:
            run()
        counts[name] = count(prof)
    result = {
        "zero_stage": a.zero_stage,
        "compiled_blocks": not a.eager,
        "per_tensor_check": a.per_tensor_check,
        "parameter_tensors": len(list(model.parameters())),
        "optimizer": type(engine.optimizer).__name__,
        **counts,
    }
    print(
        json.dumps(
            {
                k: v if not isinstance(v, dict) else {x: y for x, y in v.items() if x != "most_called"}
                for k, v in result.items()
            }
        )
    )
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
