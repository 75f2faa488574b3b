"""A whole run's flags checked before any stage runs: each stage's config built and validated, nothing loaded.

    from tasks.validate import oversized, stage_config
    cfg = stage_config("tasks.rl", {"pretrain": "s3://b/run/sft", "advantage_estimator": "group_norm", ...})
    # -> RLConfig, or ConfigError "n_samples_per_prompt: group_norm compares samples of one prompt; …" (one line)
    oversized({"rl": cfg}, {"CPU": 2.0})   # -> ["rl: its worker groups need 4 CPUs …"], or []

The configs (tasks/<stage>/config.py) need the standard library and yaml only, so the Airflow side runs this
in its first task (plugins/pipeline.py's `validate`) with the flags each stage operator would submit: a form
the stages would refuse fails there, before any Ray job.
"""

from __future__ import annotations

import importlib
from typing import Any

from tasks.common.config import make_config

STAGE_CONFIGS = {  # a stage's module -> its config class
    "tasks.data": "tasks.data.config:PrepareDataConfig",
    "tasks.sft": "tasks.sft.config:SFTConfig",
    "tasks.reward_model": "tasks.reward_model.config:RewardModelConfig",
    "tasks.rl": "tasks.rl.config:RLConfig",
    "tasks.preference": "tasks.preference.config:PreferenceConfig",
    "tasks.eval": "tasks.eval.config:EvalConfig",
    "tasks.promote": "tasks.promote.config:PromoteConfig",
}


def config_class(module: str) -> type:
    if module not in STAGE_CONFIGS:
        raise KeyError(f"{module} is not a stage; stages: {', '.join(STAGE_CONFIGS)}")
    path, name = STAGE_CONFIGS[module].split(":")
    return getattr(importlib.import_module(path), name)


def stage_config(module: str, flags: dict[str, Any]):
    """The stage's config built from these flags (as its CLI gets them: strings); ConfigError as the stage
    would raise it."""
    return make_config(config_class(module), {k: v for k, v in flags.items() if v is not None})


def oversized(configs: dict[str, Any], cluster: dict[str, float]) -> list[str]:
    """One line per stage config (by task) whose worker groups need more devices at once than the Ray cluster has
    in all (`cluster`: its total resources, e.g. {"CPU": 2.0}): Ray would wait for them forever. GPUs on a
    cluster that has them, else CPUs, as the stages place their workers."""
    kind = "GPU" if cluster.get("GPU") else "CPU"
    have = cluster.get(kind, 0)
    return [
        f"{task}: its worker groups need {cfg.devices_needed()} {kind}s at once and the Ray cluster has {have:g}; "
        "colocate them (colocate_all_models) or use fewer workers"
        for task, cfg in configs.items()
        if cfg.devices_needed() > have
    ]
