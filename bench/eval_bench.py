"""The eval stage (`python -m tasks.eval` in a subprocess) on the bench model: EVAL_PROMPTS prompts, both sides
greedy and sampled plus the KL pass, with its worker's transformers engine or vLLM; the seconds per side and where
they went, read from the stage's log. Writes <dir>/results/eval_<engine>.json.

    python bench/grpo_bench.py eval --dir /tmp/bench --mode vllm|hf   # bench_eval (Ray head needed)
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

from bench.common import COMPLETION_TOKENS, on_gpu, run_stage, save

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
