"""Every stage in one table: the package that runs it, its config and work function, what it needs.

    from tasks.common import stages
    stages.STAGES["rl"].package                  # "tasks.rl": run as python -m tasks.rl
    stages.config_class("rl")                    # RLConfig (a stage name or its package)
    stages.stage_config("tasks.rl", {"pretrain": "s3://b/run/sft", ...})   # -> RLConfig, or ConfigError (one line)
    stages.oversized({"rl": cfg}, {"CPU": 2.0})  # -> ["rl: its worker groups need 4 CPUs …"], or []
    stages.PIPELINE_TASKS["dpo"]                 # the pipeline DAG's task -> the stage it runs ("preference")

Validation, reproduce, the run form and the pipeline read this table; nothing else lists the stages. It needs
the standard library only, and the configs it names need yaml at most, so the Airflow side builds every stage's
config in its first task (plugins/pipeline.py's `validate`): a form the stages would refuse fails there, before
any Ray job.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from tasks.common.config import make_config

#: The CLI's exit-status contract (tasks/common/stage.py raises it, plugins/operators.py reads it): input that
#: must change before the stage can succeed (bad config, missing or corrupt data), and a fault worth a retry
#: (an unreachable store, a full disk, a placement waiting on a busy cluster). The stage's last line then
#: starts with ERROR_PREFIX and says why.
INPUT_ERROR_EXIT, TRY_AGAIN_EXIT = 2, 75
ERROR_PREFIX = "error: "


@dataclass(frozen=True)
class Stage:
    """One stage: `python -m <package>`, whose __main__ passes `name`, the config class and the work function
    to tasks.common.stage.main. `gpus` is what it asks Ray for in the pipeline's layout (RL's models colocated
    on the actor's GPU); a stage that `trains` writes resumable checkpoints. `not_reproducible` says why
    tasks.reproduce will not rerun it (empty: it will)."""

    name: str
    package: str
    config: str  # module:Class
    work: str  # module:function
    trains: bool
    gpus: int
    not_reproducible: str = ""

    def config_class(self) -> type:
        return _load(self.config)

    def work_function(self) -> Callable:
        return _load(self.work)


STAGES = {
    s.name: s
    for s in (
        Stage(
            "prepare_data",
            "tasks.data",
            "tasks.data.config:PrepareDataConfig",
            "tasks.data.__main__:prepare",
            trains=False,
            gpus=0,
        ),
        Stage("sft", "tasks.sft", "tasks.sft.config:SFTConfig", "tasks.sft.trainer:train", trains=True, gpus=1),
        Stage(
            "reward_model",
            "tasks.reward_model",
            "tasks.reward_model.config:RewardModelConfig",
            "tasks.reward_model.trainer:train",
            trains=True,
            gpus=1,
        ),
        Stage("rl", "tasks.rl", "tasks.rl.config:RLConfig", "tasks.rl.trainer:train", trains=True, gpus=1),
        Stage(
            "preference",
            "tasks.preference",
            "tasks.preference.config:PreferenceConfig",
            "tasks.preference.trainer:train",
            trains=True,
            gpus=1,
        ),
        Stage(
            "eval", "tasks.eval", "tasks.eval.config:EvalConfig", "tasks.eval.evaluate:evaluate", trains=False, gpus=1
        ),
        Stage(
            "promote",
            "tasks.promote",
            "tasks.promote.config:PromoteConfig",
            "tasks.promote.__main__:promote",
            trains=False,
            gpus=0,
            not_reproducible="it records a candidate in the model registry and may promote it (a compare-and-swap on "
            "champion.json); rerun its gate by hand with python -m tasks.promote --allow_promotion false",
        ),
    )
}

#: The pipeline DAG's stage tasks -> the stage each runs: dpo and kto are tasks.preference with its `method`.
PIPELINE_TASKS = {
    **{name: name for name in ("prepare_data", "sft", "reward_model", "rl", "eval", "promote")},
    "dpo": "preference",
    "kto": "preference",
}


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def stage(name_or_package: str) -> Stage:
    """The stage called `name_or_package` ("rl") or run by it ("tasks.rl"); KeyError naming the stages otherwise."""
    for s in STAGES.values():
        if name_or_package in (s.name, s.package):
            return s
    raise KeyError(f"{name_or_package} is not a stage; stages: {', '.join(STAGES)}")


def config_class(name_or_package: str) -> type:
    return stage(name_or_package).config_class()


def stage_config(name_or_package: str, flags: dict[str, Any]):
    """The stage's config built from these flags (as its CLI gets them: strings); ConfigError as the stage
    would raise it."""
    return make_config(config_class(name_or_package), {k: v for k, v in flags.items() if v is not None})


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
