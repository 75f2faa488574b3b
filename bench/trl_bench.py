"""TRL's GRPOTrainer on the bench work (bench_trl): the bench model, PROMPTS_PER_STEP prompts × GROUP completions of
exactly COMPLETION_TOKENS tokens a step, one update a step, β = 0, generating with HF generate or vLLM colocated;
the step time is the median between the trainer's step ends after the first two. Writes <dir>/results/trl_<mode>.json.
What a TRL run shares with bench/realistic.py's (the GRPOConfig arguments, the step clock, the bench's reward) is
here too: grpo_config_kwargs, step_clock, load_reward.

    python bench/grpo_bench.py trl --dir /tmp/bench --mode hf|vllm [--steps 12]   # bench_trl
    GRPOConfig(**grpo_config_kwargs(out, steps, per_device_train_batch_size=..., learning_rate=..., ...))
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.common import COMPLETION_TOKENS, GROUP, PROMPTS_PER_STEP, REWARD_FILE, on_gpu, save, steady_median


def grpo_config_kwargs(output_dir: Path, steps: int, **differs) -> dict:
    """GRPOConfig's keyword arguments every TRL run of the bench has: GROUP completions a prompt, no reference model
    (β = 0), gradient checkpointing, a log line a step, no reports or checkpoints, seed 0, vLLM (where used) colocated
    at 0.3 of the GPU; `differs` adds the run's own (batch sizes, lengths, learning rate, precision, use_vllm,
    generation_kwargs, …) and wins over these."""
    return {
        "output_dir": str(output_dir),
        "max_steps": steps,
        "num_generations": GROUP,
        "beta": 0.0,
        "gradient_checkpointing": True,
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "seed": 0,
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": 0.3,
        **differs,
    }


def step_clock() -> type:
    """A TrainerCallback class: its instances stamp each optimizer step's end (`stamps`) and keep the trainer's log
    dicts (`logs`). A function, so that transformers is imported only by the runs that train."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.stamps, self.logs = [], []

        def on_step_end(self, args, state, control, **kwargs):
            self.stamps.append(time.time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    return StepClock


def load_reward():
    """bench/reward.py as a module: its trl_reward is the reward function TRL's runs are given."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_reward", REWARD_FILE)
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    return reward


def bench_trl(bench_dir: Path, mode: str, steps: int = 12) -> None:
    import trl
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    reward = load_reward()
    tokenizer = AutoTokenizer.from_pretrained(bench_dir / "model")
    dataset = load_dataset("json", data_files=str(bench_dir / "prompts.jsonl"), split="train")
    vllm = mode == "vllm"
    args = GRPOConfig(
        **grpo_config_kwargs(
            bench_dir / "out" / f"trl_{mode}",
            steps,
            per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
            gradient_accumulation_steps=1,
            max_completion_length=COMPLETION_TOKENS,
            learning_rate=1e-6,
            bf16=on_gpu(),
            use_cpu=not on_gpu(),
            use_vllm=vllm,
            generation_kwargs={"ignore_eos": True} if vllm else {"min_new_tokens": COMPLETION_TOKENS},
        )
    )
    clock = step_clock()()
    start = time.time()
    trainer = GRPOTrainer(
        model=str(bench_dir / "model"),
        reward_funcs=reward.trl_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    clock.stamps.append(time.time())
    setup_s = clock.stamps[0] - start
    trainer.train()
    times = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    save(
        bench_dir,
        f"trl_{mode}",
        {
            "step_s": round(steady_median(times), 4),
            "setup_s": round(setup_s, 1),
            "steps": len(times),
            "trl": trl.__version__,
        },
    )
