"""Agentic RL learns: the calculator tool, through the real SFT and RL stage CLIs on a local Ray head.

A tiny Llama is fine-tuned on calculator traces that call the tool on 30% of the rows (the rest answer
`347*8=` alone, which a 1-layer model mostly gets wrong). RL with --env_path calculator then runs twice
with the same flags and steps: with the calculator's reward, and with a zero-reward control (the same
environment, every reward 0). Held-out greedy episodes (200 prompts) must show success at least 20 points
above the control's, and a higher tool-call rate. On seeds 0 and 1 (`make test-all`).
"""
import json

import pytest
import torch

from tasks.common.models import load_causal_lm, load_tokenizer, resolve_model
from tasks.common.rollout import HFRolloutEngine
from tasks.data import agentic
from tasks.data.demo import build_base_model
from tasks.rl.environment import EpisodeLimits, EpisodeRunner, load_environment

from conftest import REPO, SCRATCH
from test_stages import flags, run_cli

pytestmark = pytest.mark.e2e
LIMITS = EpisodeLimits(max_turns=3, max_episode_tokens=64, max_turn_tokens=24)
RL = {"advantage_estimator": "group_norm", "n_samples_per_prompt": 4, "rollout_batch_size": 32, "train_batch_size": 128,
      "max_epochs": 1, "init_kl_coef": 0.0, "max_steps": 30, "actor_learning_rate": 1e-4, "lr_warmup_steps": 2,
      "generate_max_len": LIMITS.max_turn_tokens, "max_turns": LIMITS.max_turns, "max_episode_tokens": LIMITS.max_episode_tokens,
      "prompt_max_len": 16, "label_key": "label"}


def write_task(root, seed: int) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    splits = agentic.calculator_datasets(seed)
    for name, rows in splits.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = agentic.build_tokenizer()
    torch.manual_seed(seed)
    build_base_model(tokenizer, seed=seed, hidden_size=64, num_layers=1, max_positions=128).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    return {name: str(root / f"{name}.jsonl") for name in splits} | {"base": str(root / "base")}


def cli(ray_address, module, **values):
    done = run_cli(module, *flags(values), ray=ray_address)
    assert done.returncode == 0, f"{module} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def held_out(model_uri: str, rows: list[dict]) -> dict:
    """Greedy episodes with the calculator on held-out rows: success rate and tool calls per episode."""
    path = resolve_model(model_uri)
    tokenizer, model = load_tokenizer(path), load_causal_lm(path)
    runner = EpisodeRunner(HFRolloutEngine(model, tokenizer), tokenizer, load_environment("calculator"), LIMITS)
    try:
        stats = runner.run(rows, greedy=True).stats
    finally:
        runner.close()
    return {"success": stats["success_rate"], "tool_calls": stats["tool_calls_per_episode"]}


@pytest.mark.slow  # about 6 minutes a seed
@pytest.mark.parametrize("seed", [0, 1])
def test_calculator_rl_raises_success_over_a_zero_reward_control(seed, ray_address):
    root = SCRATCH / "agentic" / f"seed{seed}"
    task = write_task(root, seed)
    sft = str(root / "sft")
    cli(ray_address, "tasks.sft", output=sft, pretrain=task["base"], dataset=task["sft"], max_steps=400, learning_rate=1e-3,
        train_batch_size=64, max_len=64, seed=seed)
    results = {}
    for arm, env in (("calculator", "calculator"), ("control", str(REPO / "tests" / "rewards" / "zero_env.py"))):
        out = str(root / f"rl-{arm}")
        cli(ray_address, "tasks.rl", output=out, pretrain=sft, prompt_data=task["prompts"], env_path=env, seed=seed, **RL)
        results[arm] = held_out(out, [json.loads(line) for line in open(task["eval"])])
    results["sft"] = held_out(sft, [json.loads(line) for line in open(task["eval"])])
    print(f"seed {seed}: {results}")
    assert results["calculator"]["success"] >= results["control"]["success"] + 0.20, results
    assert results["calculator"]["tool_calls"] > results["control"]["tool_calls"], results
