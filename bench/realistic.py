"""RL work that looks like what users run (issue 52): responses that end at EOS, long-tailed, at least 128 a step.

The bench model (grpo_bench.py setup --eos_cap N) is a copy of the random-weight model whose EOS gets a steady
logit (bench/eos_model.py), calibrated once to a mean length, so every system gets the same lengths from the same
weights and sampling with no patch. Each run writes <dir>/results/realistic_<shape>_<system>.json.

    python bench/realistic.py vllm --dir /tmp/bench-qwen2.5-1.5b --cap 4096                  # standalone vLLM, same requests
    python bench/realistic.py ours --dir /tmp/bench-qwen2.5-1.5b --cap 4096 --engine vllm    # our RL stage (Ray head needed)
    python bench/realistic.py ours --dir … --cap 4096 --engine transformers --steps 2
    python bench/realistic.py trl  --dir … --cap 4096                                       # TRL GRPOTrainer + vLLM colocate
    python bench/realistic_peers.py verl --dir … --cap 4096   # or openrlhf: the peers' long-response settings
    python bench/realistic.py collect --dir <results folder> --machine "H100 80GB"  # into bench/results.json "realistic" (report.py)

The work: PROMPTS × GROUP = 16 × 8 = 128 completions of at most --cap new tokens after 128-token prompts, sampled at
temperature 1; one optimizer update a step, no KL, the bench's reward, ZeRO-2, gradient checkpointing. Per step: the
generate / score / train / sync split, tokens/s/GPU as NeMo-RL counts it (prompt and response tokens over step time ×
GPUs), response length mean / max / truncation, the longest sample's decode rate (its tokens over the generate
phase it spans) and the GPU's peak as nvidia-smi sees it (every process on it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common, report  # noqa: E402
from bench.trl_bench import grpo_config_kwargs, load_reward, step_clock  # noqa: E402

PROMPTS, GROUP = 16, 8  # 128 completions a step
# Adam moves every weight by about the learning rate a step, the zero rows that keep EOS's channel constant too: at
# 1e-6 the mean length rose 1,079 -> 1,894 tokens in 4 steps (H100, 2026-12-06). Speed does not depend on the rate.
LR = 1e-9
SHAPE_NAMES = {"qwen2.5-1.5b": "1p5b", "qwen2.5-7b": "7b", "qwen2-0.5b": "0p5b", "tiny": "tiny"}


def shape_name(bench_dir: Path, cap: int, lora_rank: int) -> str:
    """1p5b_4k, 7b_lora_4k, …: the model shape, LoRA, the cap."""
    shape = json.loads((bench_dir / "model_info.json").read_text())["shape"]
    return f"{SHAPE_NAMES.get(shape, shape)}{'_lora' if lora_rank else ''}_{cap // 1024}k"


def save(bench_dir: Path, shape: str, system: str, result: dict) -> None:
    out = bench_dir / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"realistic_{shape}_{system}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({f"{shape}/{system}": result}), flush=True)


def model_dir(bench_dir: Path, cap: int) -> Path:
    path = bench_dir / f"model_eos{cap}"
    if not (path / "config.json").exists():
        raise SystemExit(
            f"{path}: no EOS-calibrated model; run grpo_bench.py setup --dir {bench_dir} --eos_cap {cap} first"
        )
    return path


def calibration(bench_dir: Path, cap: int) -> dict:
    path = model_dir(bench_dir, cap) / "eos_calibration.json"
    return json.loads(path.read_text()) if path.exists() else {}


def per_step(
    bench_dir: Path,
    shape: str,
    system: str,
    records: list[dict],
    cap: int,
    command: str,
    peak: common.GPUPeak,
    extra: dict,
) -> None:
    """Medians over the steps after the first (start-up, CUDA graphs, compilation) of a run's metrics.jsonl."""
    tail = records[1:] or records
    med = common.phase_medians(tail)
    completions = PROMPTS * GROUP
    lengths = [r["response_length"] for r in tail]
    rate = [completions * (common.PROMPT_TOKENS + r["response_length"]) / r["time_step_s"] for r in tail]
    save(
        bench_dir,
        shape,
        system,
        {
            "step_s": med["step_s"],
            **med,
            "tokens_per_s_per_gpu": round(statistics.median(rate)),  # one GPU
            "generated_tokens_per_s": round(
                statistics.median(completions * r["response_length"] / r["time_generate_s"] for r in tail)
            ),
            "response_length_mean": round(statistics.mean(lengths), 1),
            "response_length_max": max(r["response_length_max"] for r in tail),
            "truncation_rate": round(statistics.mean(r.get("response_truncated", 0.0) for r in tail), 4),
            # The longest sample decodes through the whole generate phase: its tokens over that phase's time.
            "longest_sample_tokens_per_s": round(
                statistics.median(r["response_length_max"] / r["time_generate_s"] for r in tail), 1
            ),
            "gpu_peak_gb": peak.gb,
            # --over_sampling_batch_size: the groups cut a step, of those started
            **(
                {"dropped_groups_per_step": statistics.mean(r["rollout_dropped_groups"] for r in tail)}
                if "rollout_dropped_groups" in tail[0]
                else {}
            ),
            "steps_measured": len(tail),
            "completions_per_step": completions,
            "cap": cap,
            "calibration": calibration(bench_dir, cap),
            "command": command,
            **extra,
        },
    )


def ours(
    bench_dir: Path,
    cap: int,
    engine: str,
    steps: int,
    micro: int,
    lora_rank: int,
    gpu_memory_utilization: float,
    max_tokens_per_gpu: int,
    padded: bool,
    over_sampling_batch_size: int,
    command: str,
    zero_stage: int = 2,
    adam_offload: bool = False,
) -> None:
    shape = shape_name(bench_dir, cap, lora_rank)
    system = (
        ("ours" if engine == "vllm" else "ours_transformers")
        + ("_token_budget" if max_tokens_per_gpu else "")
        + ("_padded" if padded else "")
        + (f"_oversample{over_sampling_batch_size}" if over_sampling_batch_size else "")
        + (f"_zero{zero_stage}" if zero_stage != 2 else "")
        + ("_adam_offload" if adam_offload else "")
    )
    out = bench_dir / "out" / f"realistic_{shape}_{system}"
    args = common.grpo_args(bench_dir, out, steps, micro)
    args.update(
        pretrain=model_dir(bench_dir, cap),
        n_samples_per_prompt=GROUP,
        rollout_batch_size=PROMPTS,
        train_batch_size=PROMPTS * GROUP,
        generate_max_len=cap,
        ignore_eos=False,
        temperature=1.0,
        rollout_engine=engine,
        enable_prefix_caching=True,  # GRPO's 8 samples of a prompt share its prefill
        actor_learning_rate=LR,
        zero_stage=zero_stage,
        adam_offload=adam_offload,  # Adam's state and the fp32 master weights in host memory
    )
    if engine == "vllm":
        args.update(vllm_num_engines=1, vllm_gpu_memory_utilization=gpu_memory_utilization)
    if lora_rank:
        args.update(lora_rank=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear")
    if max_tokens_per_gpu:  # micro-batches by token budget, each trimmed to its rows (--max_tokens_per_gpu)
        args.update(max_tokens_per_gpu=max_tokens_per_gpu)
    if padded:  # rows padded to their micro-batch's longest; by default with flash-attn they pack (--packing_samples)
        args.update(packing_samples=False)
    if over_sampling_batch_size:  # the step trains on the first PROMPTS groups to finish (--over_sampling_batch_size)
        args.update(over_sampling_batch_size=over_sampling_batch_size)
    if not common.on_gpu():
        args.update(flash_attn=False, enable_prefix_caching=False)
    with common.GPUPeak() as peak:
        common.run_stage("tasks.rl", args, bench_dir / f"realistic_{shape}_{system}.log")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    per_step(
        bench_dir,
        shape,
        system,
        records,
        cap,
        command,
        peak,
        {
            "engine": engine,
            "micro_batch": micro,
            "lora_rank": lora_rank,
            "max_tokens_per_gpu": max_tokens_per_gpu,
            "padded": padded,
            "over_sampling_batch_size": over_sampling_batch_size,
            "zero_stage": zero_stage,
            "adam_offload": adam_offload,
        },
    )


def vllm_alone(
    bench_dir: Path, cap: int, gpu_memory_utilization: float, command: str, in_process: bool = False
) -> None:
    """The same 128 requests (16 prompts × n=8, temperature 1) through vLLM alone: the rate our in-stage rollout is held
    to. `in_process`: vLLM's engine core in this process, as the stage's engine runs it (VLLM_ENABLE_V1_MULTIPROCESSING=0),
    instead of a process of its own; the pair tells what that costs the long tail's decode."""
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    model = model_dir(bench_dir, cap)
    t0 = time.time()
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=common.PROMPT_TOKENS + cap,
        enable_prefix_caching=True,
        seed=0,
    )
    startup = time.time() - t0
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line)["prompt"] for line in (bench_dir / "prompts.jsonl").read_text().splitlines()]
    params = SamplingParams(
        n=GROUP, temperature=1.0, max_tokens=cap, stop_token_ids=[tokenizer.eos_token_id], logprobs=0, detokenize=False
    )
    rounds = []
    for k in range(3):  # the first warms up; the stage's prompts, as its steps take them
        prompts = [{"prompt_token_ids": tokenizer(text)["input_ids"]} for text in rows[k * PROMPTS : (k + 1) * PROMPTS]]
        t = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.time() - t
        lengths = [len(c.token_ids) for o in outs for c in o.outputs]
        rounds.append({"seconds": seconds, "lengths": lengths})
    tail = rounds[1:]
    lengths = [n for r in tail for n in r["lengths"]]
    shape = shape_name(bench_dir, cap, 0)
    save(
        bench_dir,
        shape,
        "vllm_alone_in_process" if in_process else "vllm_alone",
        {
            "generated_tokens_per_s": round(statistics.median(sum(r["lengths"]) / r["seconds"] for r in tail)),
            "generate_s": round(statistics.median(r["seconds"] for r in tail), 3),
            "response_length_mean": round(statistics.mean(lengths), 1),
            "response_length_max": max(lengths),
            "truncation_rate": round(sum(n >= cap for n in lengths) / len(lengths), 4),
            # as ours: the longest sample's tokens over the round's time (the round lasts as long as it)
            "longest_sample_tokens_per_s": round(statistics.median(max(r["lengths"]) / r["seconds"] for r in tail), 1),
            "startup_s": round(startup, 1),
            "cap": cap,
            "command": command,
        },
    )


def trl(bench_dir: Path, cap: int, steps: int, micro: int, command: str) -> None:
    """TRL's GRPOTrainer with vLLM colocated, the same 128 completions a step (micro-batches of `micro`, one update)."""
    import trl as trl_lib
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    reward = load_reward()
    model = model_dir(bench_dir, cap)
    clock = step_clock()()
    args = GRPOConfig(
        **grpo_config_kwargs(
            bench_dir / "out" / "realistic_trl",
            steps,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=PROMPTS * GROUP // micro,  # one generation of 128 completions, one update
            num_generations=GROUP,  # this file's GROUP (the same 8 as the bench's)
            max_completion_length=cap,
            temperature=1.0,
            learning_rate=LR,
            bf16=True,
            use_vllm=True,
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset = load_dataset("json", data_files=str(bench_dir / "prompts.jsonl"), split="train")
    with common.GPUPeak() as peak:
        start = time.time()
        trainer = GRPOTrainer(
            model=str(model),
            reward_funcs=reward.trl_reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[clock],
        )
        clock.stamps.append(time.time())
        setup_s = clock.stamps[0] - start
        trainer.train()
    times = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])][1:]
    logs = [x for x in clock.logs if "completions/mean_length" in x][1:]
    mean_len = statistics.mean(x["completions/mean_length"] for x in logs) if logs else None
    step = statistics.median(times)
    save(
        bench_dir,
        shape_name(bench_dir, cap, 0),
        "trl_vllm",
        {
            "step_s": round(step, 3),
            "tokens_per_s_per_gpu": round(PROMPTS * GROUP * (common.PROMPT_TOKENS + mean_len) / step)
            if mean_len
            else None,
            "response_length_mean": round(mean_len, 1) if mean_len else None,
            "response_length_max": max((x.get("completions/max_length", 0) for x in logs), default=None),
            "truncation_rate": round(statistics.mean(x.get("completions/clipped_ratio", 0) for x in logs), 4)
            if logs
            else None,
            "gpu_peak_gb": peak.gb,
            "setup_s": round(setup_s, 1),
            "steps_measured": len(times),
            "micro_batch": micro,
            "trl": trl_lib.__version__,
            "cap": cap,
            "command": command,
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["ours", "vllm", "trl", "collect"])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument(
        "--cap", type=int, default=4096, help="max new tokens a response (the EOS model calibrated for it)"
    )
    parser.add_argument("--engine", default="vllm", choices=["vllm", "transformers"], help="ours: the rollout engine")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro", type=int, default=8, help="training micro-batch (sequences)")
    parser.add_argument("--lora_rank", type=int, default=0)
    parser.add_argument(
        "--max_tokens_per_gpu",
        type=int,
        default=0,
        help="ours: training micro-batches by this token budget (0: --micro rows each)",
    )
    parser.add_argument(
        "--padded",
        action="store_true",
        help="ours: training micro-batches padded to their longest row (--packing_samples false); by default the stage packs them where flash-attn runs",
    )
    parser.add_argument(
        "--over_sampling_batch_size",
        type=int,
        default=0,
        help=f"ours: prompts drawn a step, of which the first {PROMPTS} groups to finish train (0: {PROMPTS}, no cut)",
    )
    parser.add_argument("--zero_stage", type=int, default=2, help="ours: DeepSpeed ZeRO stage")
    parser.add_argument("--adam_offload", action="store_true", help="ours: Adam's state in host memory")
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.35)
    parser.add_argument("--in_process", action="store_true", help="vllm: its engine core in this process, as ours")
    parser.add_argument(
        "--into", type=Path, default=common.ROOT / "bench" / "results.json", help="collect: the summary to merge into"
    )
    parser.add_argument("--machine", default="", help="collect: the GPU the runs were made on")
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"), help="collect: the day they were made")
    a = parser.parse_args()
    command = "python bench/realistic.py " + " ".join(sys.argv[1:])
    if a.what == "ours":
        ours(
            a.dir,
            a.cap,
            a.engine,
            a.steps,
            a.micro,
            a.lora_rank,
            a.gpu_memory_utilization,
            a.max_tokens_per_gpu,
            a.padded,
            a.over_sampling_batch_size,
            command,
            a.zero_stage,
            a.adam_offload,
        )
    elif a.what == "collect":  # here, on the results a device call brought back: --dir is that results folder
        report.collect_realistic(a.dir, a.into, a.machine, a.date)
    elif a.what == "vllm":
        vllm_alone(a.dir, a.cap, a.gpu_memory_utilization, command, a.in_process)
    else:
        trl(a.dir, a.cap, a.steps, a.micro, command)


if __name__ == "__main__":
    main()
