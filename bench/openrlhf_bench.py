"""GPU benchmark: OpenRLHF 0.11.2's GRPO (`python -m openrlhf.cli.train_ppo_ray`, advantage estimator group_norm) on
the work of bench/grpo_bench.py's `ours`: the bench model, 8 prompts of 128 tokens × 8 completions of exactly 256
tokens a step, one optimizer update a step, KL off (no reference model), actor lr 1e-6, ZeRO-2, bf16, gradient
checkpointing, flash-attn, one vLLM engine colocated on the GPU (gpu_memory_utilization 0.3), bench/reward.py's reward.

    python bench/openrlhf_bench.py --dir /tmp/bench [--steps 12] [--micro 16] [--vllm_sleep] [--timeout_s 480]
    python bench/openrlhf_bench.py --dir /tmp/bench --print_command   # the command line alone

It needs `bash bench/gpu/openrlhf.sh install` (OpenRLHF in /tmp/site-openrlhf) and a Ray head whose PYTHONPATH starts
with that folder: Ray's workers take the raylet's environment, not the driver's. bench/gpu/run.sh's `openrlhf` phase
starts one. The step time is the wall time between OpenRLHF's per-step log lines ("Global step N: {...}", step 1
from its own timing/step_total), the median after the first two steps; OpenRLHF's own split (timing/generation,
make_experience, ppo_train, broadcast) comes from the same lines. Writes <dir>/results/openrlhf.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import COMPLETION_TOKENS, GROUP, PROMPT_TOKENS, PROMPTS_PER_STEP, REWARD_FILE, save  # noqa: E402
from peer_run import fail_unless_ran, run_stamped, step_summary  # noqa: E402

STEP_LINE = re.compile(r"Global step (\d+): (\{.*\})")
# OpenRLHF's timing keys -> ours (stage_bench.bench_ours's time_*_s)
SPLIT = {
    "generation": "time_generate_s",
    "make_experience": "time_make_experience_s",
    "ppo_train": "time_train_s",
    "broadcast": "time_weight_sync_s",
    "step_total": "time_step_total_s",
}
# OpenRLHF 0.11.2's remote reward file must return a dict; bench/reward.py's reward_func returns the tensor alone.
REWARD_ADAPTER = '''"""Written by bench/openrlhf_bench.py: bench/reward.py's reward_func, unchanged, in OpenRLHF's dict."""
import importlib.util

_spec = importlib.util.spec_from_file_location("bench_reward", {path!r})
_reward = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_reward)


def reward_func(queries, prompts, labels):
    rewards = _reward.reward_func(queries, prompts, labels)
    return {{"rewards": rewards, "scores": rewards, "extra_logs": {{}}}}
'''


def openrlhf_command(bench_dir: Path, steps: int, micro: int, vllm_sleep: bool, work: dict | None = None) -> list[str]:
    """OpenRLHF's command line for the bench's work; `work` replaces or adds flags (bench/realistic_peers.py's shape)."""
    out = bench_dir / "out" / "openrlhf"
    args = {
        "actor.model_name_or_path": bench_dir / "model",
        "data.prompt_dataset": bench_dir / "prompts.jsonl",
        "data.input_key": "prompt",
        "data.max_samples": steps * PROMPTS_PER_STEP,  # one pass over these: `steps` steps, then it stops
        "data.max_len": PROMPT_TOKENS + COMPLETION_TOKENS,
        "rollout.max_new_tokens": COMPLETION_TOKENS,
        "rollout.batch_size": PROMPTS_PER_STEP,
        "rollout.n_samples_per_prompt": GROUP,
        "rollout.micro_batch_size": micro,
        "train.batch_size": PROMPTS_PER_STEP * GROUP,  # one optimizer update a step
        "train.micro_batch_size": micro,
        "train.max_epochs": 1,
        "train.num_episodes": 1,
        "algo.advantage.estimator": "group_norm",
        "algo.kl.init_coef": 0,  # no reference model
        "actor.adam.lr": 1e-6,
        "actor.lr_scheduler": "constant",
        "actor.lr_warmup_ratio": 0,
        "ds.zero_stage": 2,
        "ds.param_dtype": "bf16",
        "actor.gradient_checkpointing_enable": True,
        "ds.attn_implementation": "flash_attention_2",
        "actor.num_nodes": 1,
        "actor.num_gpus_per_node": 1,
        "vllm.num_engines": 1,
        "vllm.tensor_parallel_size": 1,
        "vllm.gpu_memory_utilization": 0.3,
        "vllm.enable_sleep": vllm_sleep,
        "train.colocate_all": True,
        "reward.remote_url": bench_dir / "openrlhf_reward.py",
        "logger.logging_steps": 1,
        "ckpt.output_dir": out,
        "ckpt.path": out / "ckpt",
    }
    args.update(work or {})
    flags = [x for k, v in args.items() if v is not False for x in ((f"--{k}",) if v is True else (f"--{k}", str(v)))]
    return [sys.executable, "-m", "openrlhf.cli.train_ppo_ray", *flags]


def parse_steps(stamped: list[tuple[float, str]]) -> list[dict]:
    """One record per "Global step N: {...}" line: its arrival time and OpenRLHF's numbers (timing/*, rollout/*, loss)."""
    records = []
    for stamp, line in stamped:
        if match := STEP_LINE.search(line):
            numbers = {k: float(v) for k, v in re.findall(r"'([\w/]+)': (-?[0-9.]+(?:e[-+]?\d+)?)", match.group(2))}
            records.append({"step": int(match.group(1)), "t": stamp, **numbers})
    return records


def bench_openrlhf(
    bench_dir: Path, steps: int = 12, micro: int = 16, vllm_sleep: bool = False, timeout_s: float = 480
) -> None:
    if importlib.util.find_spec("openrlhf") is None:
        raise SystemExit(
            "openrlhf is not importable: bash bench/gpu/openrlhf.sh install, and PYTHONPATH=/tmp/site-openrlhf:$PYTHONPATH"
        )
    name = "openrlhf" + ("" if micro == 16 else f"_m{micro}") + ("_sleep" if vllm_sleep else "")
    (bench_dir / "openrlhf_reward.py").write_text(REWARD_ADAPTER.format(path=str(REWARD_FILE)))
    argv = openrlhf_command(bench_dir, steps, micro, vllm_sleep)
    print(shlex.join(argv), flush=True)
    log = bench_dir / f"{name}.log"
    returncode, stamped, start = run_stamped(argv, log, marker="Global step", timeout_s=timeout_s)
    records = parse_steps(stamped)
    fail_unless_ran("train_ppo_ray", returncode, records, log)
    save(
        bench_dir,
        name,
        {
            **step_summary(
                records,
                records[0].get("timing/step_total", 0.0),
                start,
                prefix="timing/",
                split=SPLIT,
                returncode=returncode,
            ),
            "response_length_mean": [r.get("rollout/response_length_mean") for r in records],
            "reward_curve": [round(r["rollout/reward_mean"], 4) for r in records if "rollout/reward_mean" in r],
            "micro_batch": micro,
            "vllm_sleep": vllm_sleep,
            "openrlhf": importlib.metadata.version("openrlhf"),
            "patches": [
                "samples_generator: SamplingParams(ignore_eos=True) (bench/gpu/openrlhf.sh)",
                "reward: bench/reward.py wrapped in a dict",
            ],
            "command": shlex.join(argv),
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--micro", type=int, default=16, help="sequences per forward/backward (train and rollout micro-batch)"
    )
    parser.add_argument(
        "--vllm_sleep", action="store_true", help="--vllm.enable_sleep: vLLM frees its memory while the actor trains"
    )
    parser.add_argument("--timeout_s", type=float, default=480, help="kill the run after this many seconds")
    parser.add_argument("--print_command", action="store_true", help="print the command line and stop")
    a = parser.parse_args()
    if a.print_command:
        print(shlex.join(openrlhf_command(a.dir, a.steps, a.micro, a.vllm_sleep)))
        return
    bench_openrlhf(a.dir, a.steps, a.micro, a.vllm_sleep, a.timeout_s)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
