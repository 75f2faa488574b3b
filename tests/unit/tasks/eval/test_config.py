"""The eval stage's config (tasks/eval/config.py): which rollout engine it takes where."""

import pytest

from tasks.common.config import ConfigError, make_config


def test_eval_takes_vllm_on_a_gpu_worker_with_vllm_and_transformers_elsewhere():
    from tasks.eval.config import EvalConfig

    def ev(**flags):
        return make_config(
            EvalConfig,
            {
                "baseline": "s3://b/sft",
                "policy": "s3://b/rl",
                "dataset": "s3://b/data",
                "output": "s3://b/eval",
                **flags,
            },
        )

    assert ev().choose_rollout_engine(has_gpu=True, has_vllm=True)[0] == "vllm"
    assert ev().choose_rollout_engine(has_gpu=False, has_vllm=True) == ("transformers", "the eval worker has no GPU")
    assert ev().choose_rollout_engine(has_gpu=True, has_vllm=False)[0] == "transformers"
    assert ev(rollout_engine="transformers").choose_rollout_engine(True, True) == ("transformers", "--rollout_engine")
    assert (
        ev(use_vllm=True).choose_rollout_engine(False, False)[0] == "vllm"
    )  # asked for: the worker refuses it without a GPU
    with pytest.raises(ConfigError, match="^use_vllm: .*drop one of them$"):
        ev(use_vllm=True, rollout_engine="transformers")
