"""verl and OpenRLHF on bench/realistic.py's work (issue 52, item 6): the EOS-calibrated model, 16 prompts × 8 samples,
EOS live, temperature 1, the cap, one update a step, no KL, lr 1e-9, vLLM colocated at the same memory share as ours,
and each peer's own long-response settings: verl's dynamic batch size with padding removed (its flash-attn varlen path)
and OpenRLHF's packed samples with dynamic batches, at our token budget (8 × (prompt + cap) tokens a micro-batch).

    python bench/realistic_peers.py verl --dir /tmp/bench-qwen2.5-1.5b --cap 4096 --steps 4       # run.sh real_verl4k
    python bench/realistic_peers.py openrlhf --dir /tmp/bench-qwen2.5-1.5b --cap 4096 --steps 4   # … real_openrlhf4k
        [--max_tokens_per_gpu N] [--timeout_s S]   # OpenRLHF's budget (default ours), when to stop the peer

Each needs its peer installed (bench/gpu/verl.sh, openrlhf.sh: after flash_attn.sh) and a Ray head whose PYTHONPATH
starts with the peer's folder; OpenRLHF's install patch keeps EOS live when BENCH_IGNORE_EOS=0 (run.sh sets it).
The step time is the wall time between the peer's step lines, the median after the first (as ours); tokens/s/GPU
is NeMo-RL's count from the peer's own mean response length. Writes <dir>/results/realistic_<shape>_<peer>.json.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # bench/, the repo
import openrlhf_bench  # noqa: E402
import verl_bench  # noqa: E402
from peer_run import fail_unless_ran, run_stamped  # noqa: E402

from bench import common  # noqa: E402
from bench.realistic import GROUP, LR, PROMPTS, calibration, model_dir, save, shape_name  # noqa: E402


def token_budget(cap: int) -> int:
    """Our default micro-batch budget for long responses (RLConfig.token_budget): 8 rows of prompt + cap."""
    return 8 * (common.PROMPT_TOKENS + cap)


def verl_work(bench_dir: Path, cap: int, steps: int, gpu_memory_utilization: float) -> dict:
    return {
        "data.train_max_samples": steps * PROMPTS,
        "data.val_max_samples": PROMPTS,
        "data.train_batch_size": PROMPTS,
        "data.max_response_length": cap,
        "actor_rollout_ref.model.path": model_dir(bench_dir, cap),
        "actor_rollout_ref.actor.optim.lr": LR,
        "actor_rollout_ref.actor.ppo_mini_batch_size": PROMPTS,  # the whole batch: one update a step
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,  # unused with dynamic batches; verl asks for one
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 8,
        # verl's long-response path: micro-batches by token count, padding removed (varlen flash-attn)
        "actor_rollout_ref.model.use_remove_padding": True,
        "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": token_budget(cap),
        "actor_rollout_ref.rollout.n": GROUP,
        "actor_rollout_ref.rollout.ignore_eos": False,
        "actor_rollout_ref.rollout.temperature": 1.0,
        "actor_rollout_ref.rollout.top_p": 1.0,
        "actor_rollout_ref.rollout.top_k": -1,
        "actor_rollout_ref.rollout.enable_prefix_caching": True,
        "actor_rollout_ref.rollout.gpu_memory_utilization": gpu_memory_utilization,
        "trainer.total_training_steps": steps,
        "trainer.experiment_name": "verl_realistic",
    }


def openrlhf_work(bench_dir: Path, cap: int, steps: int, gpu_memory_utilization: float, budget: int = 0) -> dict:
    return {
        "actor.model_name_or_path": model_dir(bench_dir, cap),
        "data.max_samples": steps * PROMPTS,
        "data.max_len": common.PROMPT_TOKENS + cap,
        "rollout.max_new_tokens": cap,
        "rollout.batch_size": PROMPTS,
        "rollout.n_samples_per_prompt": GROUP,
        "rollout.temperature": 1.0,
        "rollout.top_p": 1.0,
        "train.batch_size": PROMPTS * GROUP,  # one optimizer update a step
        "actor.adam.lr": LR,
        # OpenRLHF's long-response path: packed samples, micro-batches by token count
        "ds.packing_samples": True,
        "train.dynamic_batch_enable": True,
        "train.max_tokens_per_gpu": budget or token_budget(cap),
        "rollout.max_tokens_per_gpu": budget or token_budget(cap),
        "vllm.enable_prefix_caching": True,
        "vllm.gpu_memory_utilization": gpu_memory_utilization,
    }


def summarise(records: list[dict], step_key: str, length_mean: str, truncated: str, length_max: str | None) -> dict:
    """Step times from the lines' arrival (the first from the peer's own timer), medians after the first step."""
    times = [records[0][step_key]] + [b["t"] - a["t"] for a, b in zip(records, records[1:])]
    tail, tail_times = records[1:] or records, times[1:] or times
    step = statistics.median(tail_times)
    mean = statistics.mean(r[length_mean] for r in tail)
    return {
        "step_s": round(step, 3),
        "step_times_s": [round(t, 2) for t in times],
        # NeMo-RL's count, as ours: prompt and response tokens over the step time, one GPU
        "tokens_per_s_per_gpu": round(
            statistics.median(
                PROMPTS * GROUP * (common.PROMPT_TOKENS + r[length_mean]) / t for r, t in zip(tail, tail_times)
            )
        ),
        "response_length_mean": round(mean, 1),
        **({"response_length_max": max(r[length_max] for r in tail)} if length_max else {}),
        "truncation_rate": round(statistics.mean(r.get(truncated, 0.0) for r in tail), 4),
        "steps_measured": len(tail),
        "completions_per_step": PROMPTS * GROUP,
    }


def run_peer(bench_dir: Path, cap: int, peer: str, argv: list[str], marker: str, parse, env: dict, timeout_s: float):
    """Run a peer's trainer on the work, its log beside ours; returns (its step records, its exit code, the GPU's
    peak), or stops naming the log when fewer than two steps ran."""
    log = bench_dir / f"realistic_{shape_name(bench_dir, cap, 0)}_{peer}.log"
    print(shlex.join(argv), flush=True)
    with common.GPUPeak() as peak:
        rc, stamped, _ = run_stamped(argv, log, marker=marker, timeout_s=timeout_s, env=env)
    records = parse(stamped)
    fail_unless_ran(f"{peer} {argv[2]}", rc, records, log, min_steps=2)
    return records, rc, peak


def peer_result(records: list[dict], rc: int, peak, keys: tuple, split: dict, prefix: str, cap: int) -> dict:
    """What both peers record: summarise's figures (keys: its step, length-mean, truncation and length-max names),
    the peer's own time split in our names, the GPU peak and the calibration."""
    tail = records[1:] or records
    return {
        **summarise(records, *keys),
        **{
            ours.removeprefix("time_"): round(statistics.median(r[prefix + k] for r in tail), 3)
            for k, ours in split.items()
            if prefix + k in tail[0]
        },
        "gpu_peak_gb": peak.gb,
        "stopped_at_time_limit": rc != 0,
        "cap": cap,
    }


def verl(bench_dir: Path, cap: int, steps: int, gpu_memory_utilization: float, timeout_s: float, command: str) -> None:
    verl_bench.write_data(bench_dir)
    work = verl_work(bench_dir, cap, steps, gpu_memory_utilization)
    argv = verl_bench.verl_command(bench_dir, steps, 8, False, False, False, work)

    def parse(stamped):
        return [r for r in verl_bench.parse_steps(stamped) if "timing_s/step" in r]

    records, rc, peak = run_peer(bench_dir, cap, "verl", argv, "step:", parse, {"HYDRA_FULL_ERROR": "1"}, timeout_s)
    keys = ("timing_s/step", "response_length/mean", "response_length/clip_ratio", "response_length/max")
    save(
        bench_dir,
        shape_name(bench_dir, cap, 0),
        "verl",
        {
            **peer_result(records, rc, peak, keys, verl_bench.SPLIT, "timing_s/", cap),
            "verl_throughput_tokens_per_s_per_gpu": round(
                statistics.median(r.get("perf/throughput", 0) for r in records[1:] or records)
            ),
            "calibration": calibration(bench_dir, cap),
            "verl": verl_bench.importlib.metadata.version("verl"),
            "command": command,
            "peer_command": shlex.join(argv),
        },
    )


def openrlhf(
    bench_dir: Path,
    cap: int,
    steps: int,
    gpu_memory_utilization: float,
    timeout_s: float,
    command: str,
    budget: int = 0,
) -> None:
    (bench_dir / "openrlhf_reward.py").write_text(openrlhf_bench.REWARD_ADAPTER.format(path=str(common.REWARD_FILE)))
    work = openrlhf_work(bench_dir, cap, steps, gpu_memory_utilization, budget)
    argv = openrlhf_bench.openrlhf_command(bench_dir, steps, 8, False, work)
    env = {"BENCH_IGNORE_EOS": "0"}  # EOS live (bench/gpu/openrlhf.sh's patch)
    records, rc, peak = run_peer(
        bench_dir, cap, "openrlhf", argv, "Global step", openrlhf_bench.parse_steps, env, timeout_s
    )
    keys = ("timing/step_total", "rollout/response_length_mean", "rollout/truncated_rate", None)
    save(
        bench_dir,
        shape_name(bench_dir, cap, 0),
        "openrlhf",
        {
            **peer_result(records, rc, peak, keys, openrlhf_bench.SPLIT, "timing/", cap),
            "calibration": calibration(bench_dir, cap),
            "openrlhf": openrlhf_bench.importlib.metadata.version("openrlhf"),
            "command": command,
            "peer_command": shlex.join(argv),
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer", choices=["verl", "openrlhf"])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--cap", type=int, default=4096, help="max new tokens a response (the EOS model's cap)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.35)
    parser.add_argument("--timeout_s", type=float, default=540, help="stop the peer after this long")
    parser.add_argument(
        "--max_tokens_per_gpu", type=int, default=0, help="openrlhf: its token budget (0: ours, token_budget(cap))"
    )
    a = parser.parse_args()
    command = "python bench/realistic_peers.py " + " ".join(sys.argv[1:])
    if a.peer == "verl":
        verl(a.dir, a.cap, a.steps, a.gpu_memory_utilization, a.timeout_s, command)
    else:
        openrlhf(a.dir, a.cap, a.steps, a.gpu_memory_utilization, a.timeout_s, command, a.max_tokens_per_gpu)


if __name__ == "__main__":
    main()
