"""Stage configs (tasks/common/config.py): YAML then flags, one-line errors naming the field, declared limits as the
JSON schema, every stage's --help, validation on every construction, the single-group stages' shared fields and the
checkpoint spacing. RLConfig's own rules are tests/unit/tasks/rl/test_config.py's."""

import dataclasses
import subprocess
import sys

import pytest

from tasks.common.config import ConfigError, make_config, parse_config
from tasks.common.stages import STAGES, config_class
from tasks.rl.config import RLConfig
from tasks.sft.config import SFTConfig

from tests.conftest import REPO


def test_yaml_then_flags(tmp_path):
    (tmp_path / "sft.yaml").write_text(
        "pretrain: base\ndataset: d.jsonl\nmax_steps: 7\nlearning_rate: 0.01\nbf16: true\n"
    )
    cfg = parse_config(SFTConfig, ["--config", str(tmp_path / "sft.yaml"), "--output", "out", "--max_steps", "9"])
    assert (cfg.pretrain, cfg.max_steps, cfg.learning_rate, cfg.bf16, cfg.output) == ("base", 9, 0.01, True, "out")


def test_bare_bool_flag_means_true():
    cfg = parse_config(
        RLConfig, ["--output", "o", "--pretrain", "p", "--reward_pretrain", "r", "--prompt_data", "d", "--use_wandb"]
    )
    assert cfg.use_wandb is True
    cfg = parse_config(
        RLConfig,
        [
            "--output",
            "o",
            "--pretrain",
            "p",
            "--reward_pretrain",
            "r",
            "--prompt_data",
            "d",
            "--normalize_reward",
            "false",
        ],
    )
    assert cfg.normalize_reward is False


@pytest.mark.parametrize(
    "values, message",
    [
        ({"output": "o", "dataset": "d"}, "pretrain: missing; pass --pretrain <URI>"),
        ({"output": "o", "pretrain": "p", "dataset": "d", "max_steps": "ten"}, "max_steps: 'ten' is not a valid int"),
        (
            {"output": "o", "pretrain": "p", "dataset": "d", "zero_stage": 5},
            "zero_stage: 5 is not a choice; use 0, 1, 2 or 3",
        ),
        (
            {"output": "o", "pretrain": "p", "dataset": "d", "bf16": "maybe"},
            "bf16: 'maybe' is not a boolean; use true or false",
        ),
        ({"pretrain": "p", "dataset": "d"}, "output: missing; pass --output s3://bucket/prefix/… or a local folder"),
    ],
)
def test_bad_values_give_one_line_naming_the_field(values, message):
    with pytest.raises(ConfigError) as error:
        make_config(SFTConfig, values)
    assert str(error.value) == message


def test_a_fields_declared_limits_are_enforced_and_are_its_json_schema():
    """A field's metadata (min, max, exclusive_min/max, choices, max_length, pattern) is checked before the stage's
    own checks, in one line, and is the JSON schema the run form's Param is made from (plugins/form.py)."""
    from tasks.common.config import param_schema
    from tasks.data.config import PrepareDataConfig
    from tasks.eval.config import EvalConfig

    base = {"output": "o", "pretrain": "p", "reward_pretrain": "r", "prompt_data": "d"}
    for values, message in (
        ({"lambd": 1.5}, "lambd: must be at most 1, got 1.5"),
        ({"actor_learning_rate": 0.0}, "actor_learning_rate: must be positive, got 0.0"),
        ({"max_steps": 0}, "max_steps: must be at least 1, got 0"),
        ({"lora_rank": -1}, "lora_rank: must not be negative, got -1; use 0 (full fine-tuning) or a rank such as 8"),
        ({"kl_estimator": "k4"}, "kl_estimator: 'k4' is not a choice; use k1, k2 or k3"),
    ):
        with pytest.raises(ConfigError) as error:
            make_config(RLConfig, {**base, **values})
        assert str(error.value) == message
    with pytest.raises(ConfigError, match=r"^judge_url: 'ftp://x' is not of the form "):
        make_config(EvalConfig, {"output": "o", "baseline": "b", "policy": "p", "dataset": "d", "judge_url": "ftp://x"})
    assert param_schema(RLConfig, "lambd") == {
        "default": 0.95,
        "type": "number",
        "description": "GAE λ",
        "minimum": 0,
        "maximum": 1,
    }
    assert param_schema(RLConfig, "kl_estimator")["enum"] == ["k1", "k2", "k3"]
    assert param_schema(PrepareDataConfig, "eval_fraction") | {"description": ""} == {
        "default": 0.1,
        "type": "number",
        "description": "",
        "exclusiveMinimum": 0,
        "exclusiveMaximum": 1,
    }
    assert param_schema(PrepareDataConfig, "label_key")["type"] == [
        "null",
        "string",
    ]  # may be empty: the form sends null
    assert param_schema(EvalConfig, "judge_model")["type"] == "string"  # its pattern needs a character


@pytest.mark.parametrize("module", sorted(s.package for s in STAGES.values()))
def test_every_stage_prints_its_help(module):
    """`python -m tasks.<stage> --help` as a newcomer types it: exit 0 and every flag listed (a "95%" in a help
    text once crashed argparse's formatting)."""
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    fields = [f.name for f in dataclasses.fields(config_class(module))]
    assert all(f"--{name}" in done.stdout for name in fields), [n for n in fields if f"--{n}" not in done.stdout]


def test_every_construction_is_validated_not_only_make_configs():
    """StageConfig.__post_init__ runs validate(): direct construction and dataclasses.replace are refused too."""
    cfg = make_config(SFTConfig, {"output": "o", "pretrain": "p", "dataset": "d"})
    with pytest.raises(ConfigError, match="^max_steps: must be at least 1, got 0$"):
        dataclasses.replace(cfg, max_steps=0)
    with pytest.raises(ConfigError, match="^pretrain: missing; pass --pretrain <URI>$"):
        SFTConfig(output="o", dataset="d")


def test_the_single_group_stages_share_their_fields_with_their_own_defaults():
    """SingleGroupTrainingConfig's fields, restated by a stage only for its default or help, limits kept."""
    from tasks.common.config import SingleGroupTrainingConfig
    from tasks.preference.config import PreferenceConfig
    from tasks.reward_model.config import RewardModelConfig

    shared = {f.name for f in dataclasses.fields(SingleGroupTrainingConfig)}
    defaults = {
        cls: {f.name: f.default for f in dataclasses.fields(cls)}
        for cls in (SFTConfig, RewardModelConfig, PreferenceConfig)
    }
    assert all(shared <= set(d) for d in defaults.values())
    assert [defaults[c]["max_steps"] for c in defaults] == [500, 300, 100]
    assert [defaults[c]["dataset_split"] for c in defaults] == ["sft", "preference", ""]
    limits = {
        cls: {f.name: f.metadata.get("max") for f in dataclasses.fields(cls)}["learning_rate"] for cls in defaults
    }
    assert set(limits.values()) == {1}  # restating the default kept the field's limits
    with pytest.raises(ConfigError, match="^train_batch_size: "):
        make_config(RewardModelConfig, {"output": "o", "pretrain": "p", "dataset": "d", "train_batch_size": 0})


def test_num_checkpoints_spaces_them_over_the_steps_the_stage_runs():
    """--num_checkpoints k: a checkpoint every ceil(steps / k) steps (wins over --save_steps); --fail_after_step must
    be one of them, checked against the steps the run really makes (StageRun.resume gets them)."""
    base = {"output": "o", "pretrain": "p", "dataset": "d", "max_steps": 12}
    cfg = make_config(SFTConfig, {**base, "num_checkpoints": 5, "save_steps": 7})
    assert (cfg.checkpoint_interval(12), cfg.checkpoint_interval(40), cfg.checkpoint_interval(3)) == (3, 8, 1)
    assert make_config(SFTConfig, {**base, "save_steps": 7}).checkpoint_interval(12) == 7
    assert make_config(SFTConfig, base).checkpoint_interval(12) == 0
    make_config(SFTConfig, {**base, "num_checkpoints": 5, "fail_after_step": 6})
    with pytest.raises(
        ConfigError,
        match=r"^fail_after_step: 4 is not a checkpoint step; use a multiple of 3 \(--num_checkpoints 5 over 12 steps\)$",
    ):
        make_config(SFTConfig, {**base, "num_checkpoints": 5, "fail_after_step": 4})
    rl = make_config(
        RLConfig,
        {
            "output": "o",
            "pretrain": "p",
            "prompt_data": "d",
            "remote_rm_url": "length",
            "num_checkpoints": 4,
            "fail_after_step": 5,
            "max_steps": 20,
        },
    )
    with pytest.raises(ConfigError, match="^fail_after_step: 5 is not a checkpoint step; use a multiple of 3"):
        rl.check_fault_step(10)  # num_episodes gave the run 10 steps: checkpoints every 3
