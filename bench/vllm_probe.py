"""Where vLLM's time goes at the eval stage's shape (1,000 prompts of 128 tokens, 256 new tokens each) and at the
RL bench's (64): the engine as tasks/common/nn/engines/vllm_engine.py builds it (in the caller's process), with and without
per-token log-probs, with CUDA graphs captured up to 1,024 sequences, and in vLLM's own engine process. Each
configuration runs in a process of its own; the first also writes a cProfile of one 1,000-prompt call, and every
call's mean GPU utilisation (nvidia-smi, every 100 ms) says whether the GPU or the host is the bound.

    python bench/vllm_probe.py --dir /tmp/bench        # /tmp/bench/results/vllm_probe.json, vllm_probe_profile.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import subprocess
import sys
import time
from pathlib import Path

PROMPT_TOKENS, NEW_TOKENS = 128, 256
CONFIGS = {
    # name: (in the caller's process, extra LLM arguments)
    "inproc": (True, {}),
    "inproc_graphs1024": (True, {"max_num_seqs": 1024, "compilation_config": {"max_cudagraph_capture_size": 1024}}),
    "engine_process": (False, {}),
}
CALLS = [  # (name, prompts, per-token log-probs, greedy)
    ("eval_greedy_logprobs", 1000, True, True),
    ("eval_greedy", 1000, False, True),
    ("eval_sampled", 1000, False, False),
    ("rl_sampled_logprobs", 64, True, False),
    ("rl_sampled", 64, False, False),
]


def gpu_utilisation():
    """Start sampling nvidia-smi's utilisation; the returned function stops it and gives the mean (percent)."""
    proc = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=subprocess.PIPE,
        text=True,
    )

    def stop() -> float:
        proc.terminate()
        values = [float(v) for v in proc.communicate()[0].split() if v.strip().isdigit()]
        return round(sum(values) / len(values), 1) if values else -1.0

    return stop


def run_config(bench_dir: Path, name: str) -> dict:
    inproc, extra = CONFIGS[name]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if inproc else "1"
    if inproc:  # the external_launcher executor, as in the RL and eval workers: a torch.distributed world of one
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(29500 + random.randrange(1000)),
        )
    from vllm import LLM, SamplingParams

    model = str(bench_dir / "model")
    positions = json.loads((bench_dir / "model" / "config.json").read_text())["max_position_embeddings"]
    t0 = time.time()
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        max_model_len=positions,
        gpu_memory_utilization=0.5,
        max_num_batched_tokens=max(8192, positions),
        logprobs_mode="processed_logprobs",
        **({"distributed_executor_backend": "external_launcher"} if inproc else {}),
        **extra,
    )
    result = {"startup_s": round(time.time() - t0, 1), "inproc": inproc, "extra": extra}
    rng = random.Random(1)
    vocab = llm.llm_engine.model_config.hf_config.vocab_size

    def call(n: int, logprobs: bool, greedy: bool, profile: cProfile.Profile | None = None) -> dict:
        prompts = [{"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(PROMPT_TOKENS)]} for _ in range(n)]
        params = SamplingParams(
            temperature=0.0 if greedy else 1.0,
            max_tokens=NEW_TOKENS,
            ignore_eos=True,
            logprobs=0 if logprobs else None,
            detokenize=False,
        )
        stop = gpu_utilisation()
        t = time.perf_counter()
        if profile:
            profile.enable()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if profile:
            profile.disable()
        seconds = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"s": round(seconds, 2), "tokens_per_s": round(tokens / seconds), "gpu_util_pct": stop()}

    call(8, True, False)  # warm-up
    for label, n, logprobs, greedy in CALLS:
        result[label] = call(n, logprobs, greedy)
    if name == "inproc":
        profile = cProfile.Profile()
        result["eval_greedy_logprobs_profiled"] = call(1000, True, True, profile)
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text).sort_stats("tottime")
        stats.print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
        (bench_dir / "results" / "vllm_probe_profile.txt").write_text(text.getvalue())
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench"))
    parser.add_argument(
        "--config", choices=sorted(CONFIGS), help="run one configuration here (the parent runs each in a child)"
    )
    args = parser.parse_args()
    (args.dir / "results").mkdir(parents=True, exist_ok=True)
    if args.config:
        print("PROBE " + json.dumps(run_config(args.dir, args.config)), flush=True)
        return
    results = {}
    for name in CONFIGS:
        t = time.time()
        proc = subprocess.run(
            [sys.executable, __file__, "--dir", str(args.dir), "--config", name], capture_output=True, text=True
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
        results[name] = (
            json.loads(lines[-1][6:]) if lines else {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
        )
        print(f"{name}: {time.time() - t:.0f} s {json.dumps(results[name])}", flush=True)
        if not lines:
            print(proc.stderr[-3000:], flush=True)
        (args.dir / "results" / "vllm_probe.json").write_text(
            json.dumps(results, indent=2) + "\n"
        )  # after each: a cut-off call keeps the rest


if __name__ == "__main__":
    main()
