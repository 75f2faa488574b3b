"""GPU benchmark: verl 0.9.1's GRPO (`python -m verl.trainer.main_ppo`, algorithm.adv_estimator=grpo, its default v1
trainer in sync mode) on the work of bench/grpo_bench.py's `ours`: the bench model, 8 prompts of 128 tokens × 8
completions of exactly 256 tokens a step (rollout.ignore_eos), one optimizer update a step (ppo_mini_batch_size = the
whole batch, ppo_epochs 1), KL off (no reference model), actor lr 1e-6, FSDP actor in bf16 with gradient checkpointing
and flash-attn, no critic, its vLLM rollout colocated on the GPU (gpu_memory_utilization 0.3), bench/reward.py's reward.

    python bench/verl_bench.py --dir /tmp/bench [--steps 12] [--micro 16] [--vllm_sleep] [--sdpa] [--v0] [--timeout_s 480]
    python bench/verl_bench.py --dir /tmp/bench --print_command   # the command line alone (writes nothing)

It needs `bash bench/gpu/verl.sh install` (verl in /tmp/site-verl) and a Ray head whose PYTHONPATH starts with that
folder: Ray's workers take the raylet's environment, not the driver's. bench/gpu/run.sh's `verl` phase starts one.
The data: <dir>/verl/train.parquet, the bench prompts as one-message chats; the bench tokenizer has no chat template,
so the command gives verl one that renders a message's text alone (the prompt's 128 tokens, nothing around them).
The step time is the wall time between verl's per-step console lines ("step:N - timing_s/step:... - ..."), step 1
from its own timing_s/step, the median after the first two; verl's own split (timing_s/gen, old_log_prob, adv,
update_actor, update_weights) comes from the same lines. Writes <dir>/results/verl.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import COMPLETION_TOKENS, GROUP, PROMPT_TOKENS, PROMPTS_PER_STEP, REWARD_FILE, save  # noqa: E402
from peer_run import fail_unless_ran, run_stamped, step_summary  # noqa: E402

# verl's console logger prints each step's metrics as "step:N - key:value - key:value ..." (numpy scalars as np.float64(x))
STEP_LINE = re.compile(r"(?:^|[\s)])step:(\d+) - (.*)$")
NUMBER = re.compile(r"^(?:np\.\w+\()?(-?(?:[0-9.]+(?:e[-+]?\d+)?|nan|inf))\)?$")
# verl's timing keys (timing_s/<name>) -> ours (stage_bench.bench_ours's time_*_s); the others keep verl's name
SPLIT = {
    "gen": "time_generate_s",
    "reward": "time_reward_s",
    "old_log_prob": "time_old_log_prob_s",
    "adv": "time_advantage_s",
    "update_actor": "time_train_s",
    "update_weights": "time_weight_sync_s",
    "step": "time_step_total_s",
}
# Each message's text and nothing else: the bench prompts are plain token strings, as ours, TRL and OpenRLHF take them.
CHAT_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
# verl calls compute_score(data_source, solution_str, ground_truth, extra_info) on each decoded completion.
REWARD_ADAPTER = '''"""Written by bench/verl_bench.py: bench/reward.py's even_fraction, unchanged, as verl's compute_score."""
import importlib.util

_spec = importlib.util.spec_from_file_location("bench_reward", {path!r})
_reward = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_reward)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return _reward.even_fraction(solution_str)
'''


def write_data(bench_dir: Path) -> Path:
    """The bench prompts in verl's RLHFDataset schema: `prompt` (chat messages), data_source, reward_model, extra_info."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = [
        json.loads(line)["prompt"] for line in (bench_dir / "prompts.jsonl").read_text().splitlines() if line.strip()
    ]
    rows = [
        {
            "data_source": "bench",
            "prompt": [{"role": "user", "content": text}],
            "reward_model": {
                "style": "rule",
                "ground_truth": "",
            },  # the reward needs none, verl's reward loop reads the key
            "extra_info": {"index": i},
        }
        for i, text in enumerate(prompts)
    ]
    path = bench_dir / "verl" / "train.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    (bench_dir / "verl" / "reward.py").write_text(REWARD_ADAPTER.format(path=str(REWARD_FILE)))
    return path


def hydra_value(value) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, str) and re.search(r"[\s{}\[\]%,'=:]", value):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def verl_command(
    bench_dir: Path, steps: int, micro: int, vllm_sleep: bool, sdpa: bool, v0: bool, work: dict | None = None
) -> list[str]:
    """verl's command line for the bench's work; `work` replaces or adds settings (bench/realistic_peers.py's shape)."""
    data, out = bench_dir / "verl" / "train.parquet", bench_dir / "out" / "verl"
    args = {
        "algorithm.adv_estimator": "grpo",
        "algorithm.use_kl_in_reward": False,
        "data.train_files": data,
        "data.val_files": data,  # built but never run (no validation); verl has no "none" here
        "data.val_max_samples": PROMPTS_PER_STEP,
        "data.train_max_samples": steps * PROMPTS_PER_STEP,  # one pass over these: `steps` steps
        "data.shuffle": False,
        "data.train_batch_size": PROMPTS_PER_STEP,  # prompts a step; verl multiplies by rollout.n
        "data.max_prompt_length": PROMPT_TOKENS,
        "data.max_response_length": COMPLETION_TOKENS,
        "actor_rollout_ref.model.path": bench_dir / "model",
        "actor_rollout_ref.model.custom_chat_template": CHAT_TEMPLATE,
        "actor_rollout_ref.model.enable_gradient_checkpointing": True,
        "actor_rollout_ref.actor.strategy": "fsdp",
        "actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16",
        "actor_rollout_ref.actor.optim.lr": 1e-6,
        "actor_rollout_ref.actor.ppo_mini_batch_size": PROMPTS_PER_STEP,  # the whole batch: one update a step
        "actor_rollout_ref.actor.ppo_epochs": 1,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": micro,
        "actor_rollout_ref.actor.use_kl_loss": False,
        "actor_rollout_ref.actor.entropy_coeff": 0,
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.n": GROUP,
        "actor_rollout_ref.rollout.ignore_eos": True,  # completions of exactly max_response_length, as ours, TRL's, OpenRLHF's
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        "actor_rollout_ref.rollout.gpu_memory_utilization": 0.3,
        "actor_rollout_ref.rollout.dtype": "bfloat16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": micro,
        # verl's default frees vLLM's weights and KV cache while the actor trains; the bench's other runs keep them
        "actor_rollout_ref.rollout.free_cache_engine": vllm_sleep,
        "+actor_rollout_ref.rollout.enable_sleep_mode": vllm_sleep,
        "reward.custom_reward_function.path": bench_dir / "verl" / "reward.py",
        "reward.custom_reward_function.name": "compute_score",
        "trainer.use_v1": not v0,
        "trainer.n_gpus_per_node": 1,
        "trainer.nnodes": 1,
        "trainer.total_epochs": 1,
        "trainer.total_training_steps": steps,
        "trainer.logger": ["console"],
        "trainer.val_before_train": False,
        "trainer.test_freq": -1,
        "trainer.save_freq": -1,
        "trainer.resume_mode": "disable",
        "trainer.project_name": "bench",
        "trainer.experiment_name": "verl",
        "trainer.default_local_dir": out / "ckpt",
        "hydra.run.dir": out / "hydra",  # else hydra writes outputs/<date>/ into the repo
    }
    if sdpa:  # without flash-attn: SDPA, and padded rows (verl's remove-padding path packs rows for flash-attn's varlen kernel)
        args.update(
            {
                "+actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
                "actor_rollout_ref.model.use_remove_padding": False,
            }
        )
    args.update(work or {})
    return [sys.executable, "-m", "verl.trainer.main_ppo", *(f"{k}={hydra_value(v)}" for k, v in args.items())]


def parse_metrics(text: str) -> dict:
    numbers = {}
    for part in text.strip().split(" - "):
        key, _, value = part.rpartition(":")
        if key and (match := NUMBER.match(value.strip())):
            numbers[key.strip()] = float(match.group(1))
        elif value.strip() in ("True", "False"):
            numbers[key.strip()] = float(value.strip() == "True")
    return numbers


def parse_steps(stamped: list[tuple[float, str]]) -> list[dict]:
    """One record per step line: its arrival time and verl's numbers (timing_s/*, critic/score/mean, response_length/*, ...)."""
    records = []
    for stamp, line in stamped:
        if match := STEP_LINE.search(line.rstrip("\n")):
            records.append({"step": int(match.group(1)), "t": stamp, **parse_metrics(match.group(2))})
    return records


def bench_verl(
    bench_dir: Path,
    steps: int = 12,
    micro: int = 16,
    vllm_sleep: bool = False,
    sdpa: bool = False,
    v0: bool = False,
    timeout_s: float = 480,
) -> None:
    if importlib.util.find_spec("verl") is None:
        raise SystemExit(
            "verl is not importable: bash bench/gpu/verl.sh install, and PYTHONPATH=/tmp/site-verl:$PYTHONPATH"
        )
    name = (
        "verl"
        + ("" if micro == 16 else f"_m{micro}")
        + ("_sleep" if vllm_sleep else "")
        + ("_sdpa" if sdpa else "")
        + ("_v0" if v0 else "")
    )
    write_data(bench_dir)
    argv = verl_command(bench_dir, steps, micro, vllm_sleep, sdpa, v0)
    print(shlex.join(argv), flush=True)
    log = bench_dir / f"{name}.log"
    returncode, stamped, start = run_stamped(
        argv, log, marker="step:", timeout_s=timeout_s, env={"HYDRA_FULL_ERROR": "1"}
    )
    records = [r for r in parse_steps(stamped) if "timing_s/step" in r]
    fail_unless_ran("verl main_ppo", returncode, records, log)
    save(
        bench_dir,
        name,
        {
            **step_summary(
                records, records[0]["timing_s/step"], start, prefix="timing_s/", split=SPLIT, returncode=returncode
            ),
            "response_length_mean": [r.get("response_length/mean") for r in records],
            "reward_curve": [round(r["critic/score/mean"], 4) for r in records if "critic/score/mean" in r],
            "micro_batch": micro,
            "vllm_sleep": vllm_sleep,
            "attention": "sdpa" if sdpa else "flash_attention_2",
            "trainer": "v0 (RayPPOTrainer)" if v0 else "v1 sync",
            "verl": importlib.metadata.version("verl"),
            "transformers": importlib.metadata.version("transformers"),
            "patches": [
                "continuous_token_wiring: qwen2 -> the default prompt builder (bench/gpu/verl.sh)",
                "monkey_patch: skips trl's value-head model, which trl 1.16 lacks (bench/gpu/verl.sh)",
                "reward: bench/reward.py's even_fraction as compute_score",
                "chat template: a message's text alone",
            ],
            "command": shlex.join(argv),
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--micro", type=int, default=16, help="sequences per forward/backward (actor update and old log-prob pass)"
    )
    parser.add_argument(
        "--vllm_sleep",
        action="store_true",
        help="verl's default free_cache_engine: vLLM frees its memory while the actor trains",
    )
    parser.add_argument(
        "--sdpa", action="store_true", help="SDPA attention in the actor, rows padded (no flash-attn needed)"
    )
    parser.add_argument(
        "--v0", action="store_true", help="trainer.use_v1=False: the legacy RayPPOTrainer (no TransferQueue)"
    )
    parser.add_argument("--timeout_s", type=float, default=480, help="kill the run after this many seconds")
    parser.add_argument("--print_command", action="store_true", help="print the command line and stop")
    a = parser.parse_args()
    if a.print_command:
        print(shlex.join(verl_command(a.dir, a.steps, a.micro, a.vllm_sleep, a.sdpa, a.v0)))
        return
    bench_verl(a.dir, a.steps, a.micro, a.vllm_sleep, a.sdpa, a.v0, a.timeout_s)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
