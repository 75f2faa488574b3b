"""--rollout_engine auto: the rule that picks vLLM or the transformers engine for a run's shape (tasks/rl/config.py).

pytest tests/unit/test_rollout_engine.py
"""

import dataclasses

import pytest

from tasks.common.config import ConfigError, make_config
from tasks.rl.config import HF_ENGINE_MAX_TOKENS, RLConfig


def rl(**flags) -> RLConfig:
    base = {
        "pretrain": "demo",
        "prompt_data": "s3://b/data",
        "output": "s3://b/out",
        "remote_rm_url": "length",
        "colocate_all_models": True,
    }
    return make_config(RLConfig, {**base, **flags})


def test_auto_picks_vllm_for_long_responses_on_a_gpu_cluster_with_vllm():
    cfg = rl(generate_max_len=4096)
    assert cfg.choose_rollout_engine(has_gpus=True, has_vllm=True)[0] == "vllm"
    chosen = cfg.with_rollout_engine("vllm")
    # One engine per actor GPU, inside the actor workers: no GPU the run did not ask for.
    assert chosen.vllm_num_engines == chosen.group_size("actor") and not chosen.separate_engines()
    assert chosen.rollout_engine == "vllm" and cfg.rollout_engine == "auto"  # a new config; the form's stays


@pytest.mark.parametrize(
    "flags, has_gpus, has_vllm, reason",
    [
        ({"generate_max_len": 4096}, False, True, "no GPU"),
        ({"generate_max_len": 4096}, True, False, "vllm package"),
        ({"generate_max_len": HF_ENGINE_MAX_TOKENS}, True, True, "measured faster up to 256"),
        ({"generate_max_len": 4096, "colocate_all_models": False}, True, True, "GPUs of its own"),
    ],
)
def test_auto_keeps_transformers_where_vllm_is_slower_or_cannot_run(flags, has_gpus, has_vllm, reason):
    engine, why = rl(**flags).choose_rollout_engine(has_gpus, has_vllm)
    assert engine == "transformers" and reason in why, why


def test_an_episode_budget_counts_as_the_response_length():
    """A multi-turn episode decodes max_episode_tokens, even when each turn is short."""
    short_turns = rl(generate_max_len=64, env_path="calculator", max_turns=8, max_episode_tokens=2048)
    assert short_turns.choose_rollout_engine(True, True)[0] == "vllm"


def test_an_explicit_choice_wins():
    assert rl(rollout_engine="transformers", generate_max_len=4096).choose_rollout_engine(True, True) == (
        "transformers",
        "--rollout_engine",
    )
    assert rl(rollout_engine="vllm", generate_max_len=16).choose_rollout_engine(True, True)[0] == "vllm"
    # An engine count asks for vLLM, as before --rollout_engine existed.
    assert rl(vllm_num_engines=1, generate_max_len=16).choose_rollout_engine(True, True) == (
        "vllm",
        "--vllm_num_engines",
    )
    separate = rl(rollout_engine="vllm", colocate_all_models=False).with_rollout_engine("vllm")
    assert separate.vllm_num_engines == 1 and separate.separate_engines()


def test_contradicting_flags_are_one_line():
    with pytest.raises(
        ConfigError, match=r"^rollout_engine: transformers .* --vllm_num_engines is 1; drop one of them$"
    ):
        rl(rollout_engine="transformers", vllm_num_engines=1)
    with pytest.raises(ConfigError, match="rollout_engine"):
        rl(rollout_engine="sglang")


def test_the_transformers_choice_changes_nothing_else():
    cfg = rl(generate_max_len=128)
    assert dataclasses.replace(cfg.with_rollout_engine("transformers"), rollout_engine="auto") == cfg


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


def test_make_engine_builds_the_transformers_engine_on_the_live_module_and_refuses_an_unknown_kind():
    """The one factory RL and eval build their engines with (tasks.common.nn.engines.make_engine)."""
    from tasks.common.nn.data import encode_prompt
    from tasks.common.nn.engines import RolloutEngine, make_engine
    from tasks.common.nn.engines.hf_engine import HFRolloutEngine
    from tasks.data import demo

    tok = demo.build_tokenizer()
    model = demo.build_base_model(tok, seed=1).eval()
    engine = make_engine("transformers", tok, module=model, ignore_eos=True)
    assert isinstance(engine, HFRolloutEngine) and isinstance(engine, RolloutEngine) and engine.model is model
    rollout = engine.generate([encode_prompt(tok, "3+4=")], max_new_tokens=4, greedy=True)
    assert rollout.responses.shape == (1, 4) and rollout.logprobs.shape == (1, 4)  # EOS ignored: every token kept
    with pytest.raises(ValueError, match="rollout engine: unknown 'tgi'"):
        make_engine("tgi", tok, module=model)
