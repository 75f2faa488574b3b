"""The rollout engines and episode runners the RL workers build, from the run's config: a vLLM engine on the policy
(a vision-language policy's takes prompts with images), the multi-turn episode runner over an engine (--env_path),
and the dtype the policy's copies load in. The actor (tasks/rl/actor.py) and the engines of their own
(workers.RolloutEngineWorker) call these; the worker roles live in workers.py.

    engine = vllm_engine_for(cfg, path, tokenizer, seed=0, processor=load_vision_processor(path))
    runner = episode_runner_for(cfg, engine, tokenizer)          # None without --env_path
    result = run_episodes_on(runner, rows, cfg)                  # a worker's share of the episodes, on the CPU
"""

from __future__ import annotations

import torch

from tasks.common.nn.engines import make_engine
from tasks.common.nn.models import is_vision_model
from tasks.rl.config import RLConfig


def model_dtype(cfg: RLConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.bf16 else torch.float32


def load_vision_processor(path: str):
    """The processor of a vision-language model at `path`; None for a text model."""
    if not is_vision_model(path):
        return None
    from tasks.common.nn.vision import load_processor

    return load_processor(path)


def episode_runner_for(cfg: RLConfig, engine, tokenizer, policy_version=None):
    """Multi-turn episodes on `engine`, one environment per episode (--env_path); None without one."""
    if not cfg.env_path:
        return None
    from tasks.common.nn.environment import episode_runner

    return episode_runner(cfg, engine, tokenizer, policy_version)


def run_episodes_on(runner, rows: list[dict], cfg: RLConfig):
    """A worker's share of a rollout's episodes (tasks.common.nn.environment.Episodes) on the CPU, None for no rows."""
    if not rows:
        return None
    result = runner.run(rows, cfg.temperature)
    result.rollout, result.episodes = result.rollout.to("cpu"), []  # the environments stay here
    return result


def vllm_engine_for(cfg: RLConfig, path: str, tokenizer, seed: int, processor=None):
    """A vLLM engine on the policy at `path`; a vision-language policy's (its `processor`) takes prompts with images,
    sized for --max_images_per_prompt (the controller sets it from the data), its placeholder ids never sampled."""
    from tasks.common.nn.engines.vllm_vision import vision_options

    vision = vision_options(processor, cfg.max_images_per_prompt) if processor is not None else {}
    return make_engine(
        "vllm",
        tokenizer,
        path=path,
        # An episode's next turn reads everything before it: up to max_episode_tokens after the prompt, then a turn.
        max_len=cfg.prompt_max_len + cfg.generate_max_len + (cfg.max_episode_tokens if cfg.env_path else 0),
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        seed=seed,
        dtype=str(model_dtype(cfg)).removeprefix("torch."),
        enable_prefix_caching=cfg.enable_prefix_caching,
        enable_sleep=cfg.vllm_enable_sleep,
        ignore_eos=cfg.ignore_eos,
        lora_rank=cfg.lora_rank,
        **vision,
    )
