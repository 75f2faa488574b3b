"""RLConfig (tasks/rl/config.py): --rollout_engine auto, the rule that picks vLLM or the transformers engine for a
run's shape; --packing_samples unset, the rule that packs where FlashAttention-2 runs long responses; the roles and placement plans the colocation flags give; and what it refuses in one line (layouts,
estimators, clips, PPO-ptx, vLLM flags, the off-policy correction, over-sampling, the token budget).

pytest tests/unit/tasks/rl/test_config.py
"""

import dataclasses

import pytest

from tasks.common.config import ConfigError, make_config, parse_config
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


@pytest.mark.parametrize(
    "flags, flash_attention, vision, packed, reason",
    [
        ({"generate_max_len": 4096}, True, False, True, "auto: FlashAttention-2 and responses over 256"),
        ({"generate_max_len": 4096}, False, False, False, "needs FlashAttention-2"),
        ({"generate_max_len": 4096}, True, True, False, "vision-language"),
        ({"generate_max_len": 256}, True, False, False, "at most 256"),
        ({"generate_max_len": 64, "env_path": "calculator", "max_episode_tokens": 2048}, True, False, True, "auto"),
        ({"generate_max_len": 4096, "packing_samples": False}, True, False, False, "--packing_samples"),
        ({"generate_max_len": 64, "packing_samples": True}, False, False, True, "--packing_samples"),
    ],
)
def test_packing_unset_packs_long_text_responses_where_flash_attention_runs(
    flags, flash_attention, vision, packed, reason
):
    assert rl(**flags).packing_samples is flags.get("packing_samples")  # unset stays None until the stage decides
    chosen, why = rl(**flags).choose_packing(flash_attention=flash_attention, vision=vision)
    assert chosen is packed and reason in why, why


def test_packing_samples_takes_the_bare_flag_true_and_false():
    base = ["--pretrain", "demo", "--prompt_data", "d", "--output", "o", "--remote_rm_url", "length"]
    assert parse_config(RLConfig, base).packing_samples is None
    assert parse_config(RLConfig, [*base, "--packing_samples"]).packing_samples is True
    assert parse_config(RLConfig, [*base, "--packing_samples", "false"]).packing_samples is False


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


def test_rl_refuses_what_it_cannot_do():
    base = {"output": "o", "pretrain": "p", "reward_pretrain": "r", "prompt_data": "d"}
    with pytest.raises(ConfigError, match="advantage_estimator: 'vtrace' is not a choice; use gae, reinforce,"):
        make_config(RLConfig, {**base, "advantage_estimator": "vtrace"})
    with pytest.raises(
        ConfigError, match="train_batch_size: 48 must divide rollout_batch_size × n_samples_per_prompt = 128"
    ):
        make_config(RLConfig, {**base, "train_batch_size": 48})


def test_rl_group_estimators_need_groups_and_a_reward():
    base = {"output": "o", "pretrain": "p", "prompt_data": "d"}
    with pytest.raises(
        ConfigError,
        match="reward_pretrain: missing; pass --reward_pretrain <URI>, --remote_rm_url <file.py or URL> or --env_path",
    ):
        make_config(RLConfig, base)
    with pytest.raises(ConfigError, match="n_samples_per_prompt: rloo compares samples of one prompt; use 2 or more"):
        make_config(RLConfig, {**base, "remote_rm_url": "r.py", "advantage_estimator": "rloo"})
    cfg = make_config(
        RLConfig,
        {
            **base,
            "remote_rm_url": "r.py",
            "advantage_estimator": "rloo",
            "n_samples_per_prompt": 4,
            "rollout_batch_size": 16,
            "train_batch_size": 32,
        },
    )
    assert cfg.n_samples_per_prompt == 4


def test_rl_clip_options_are_checked():
    base = {"output": "o", "pretrain": "p", "prompt_data": "d", "reward_pretrain": "r"}
    with pytest.raises(ConfigError, match="dual_clip: 0.5 must be greater than 1"):
        make_config(RLConfig, {**base, "dual_clip": 0.5})
    with pytest.raises(ConfigError, match="entropy_coef: must not be negative"):
        make_config(RLConfig, {**base, "entropy_coef": -0.1})


def test_rl_ptx_needs_data_and_a_weight():
    base = {"output": "o", "pretrain": "p", "reward_pretrain": "r", "prompt_data": "d"}
    with pytest.raises(ConfigError, match=r"^ptx_coef: PPO-ptx needs both --pretrain_data"):
        make_config(RLConfig, {**base, "ptx_coef": 0.5})
    with pytest.raises(ConfigError, match=r"^ptx_coef: PPO-ptx needs both"):
        make_config(RLConfig, {**base, "pretrain_data": "d"})
    assert make_config(RLConfig, {**base, "pretrain_data": "d", "ptx_coef": 0.5}).ptx_coef == 0.5


RL = {"output": "o", "pretrain": "p", "reward_pretrain": "r", "prompt_data": "d"}


@pytest.mark.parametrize(
    "flags,expected",
    [
        ({}, [["actor"], ["ref"], ["critic"], ["reward"]]),
        ({"colocate_actor_ref": True}, [["actor", "ref"], ["critic"], ["reward"]]),
        ({"colocate_actor_ref": True, "colocate_critic_reward": True}, [["actor", "ref"], ["critic", "reward"]]),
        ({"colocate_all_models": True}, [["actor", "ref", "critic", "reward"]]),
    ],
)
def test_placement_plan_follows_the_colocation_flags(flags, expected):
    cfg = make_config(RLConfig, {**RL, **flags})
    assert cfg.roles() == ["actor", "ref", "critic", "reward"]
    assert cfg.placement_plan() == expected
    assert cfg.devices_needed() == len(expected)  # one worker per group here


def test_placement_plan_without_critic_or_reward_models():
    cfg = make_config(
        RLConfig,
        {
            **RL,
            "colocate_critic_reward": True,
            "advantage_estimator": "rloo",
            "n_samples_per_prompt": 2,
            "remote_rm_url": "r.py",
        },
    )
    assert cfg.roles() == ["actor", "ref"]
    assert cfg.placement_plan() == [["actor"], ["ref"]]
    assert (
        make_config(
            RLConfig, {**RL, "actor_num_gpus_per_node": 2, "colocate_actor_ref": True, "ref_num_gpus_per_node": 2}
        ).devices_needed()
        == 2 + 1 + 1
    )  # actor and ref share 2; critic and reward 1 each


def test_rl_config_refuses_layouts_and_flags_that_cannot_apply():
    with pytest.raises(
        ConfigError,
        match=r"^ref_num_gpus_per_node: colocate_all_models needs every group the actor's size \(2\), got 1",
    ):
        make_config(RLConfig, {**RL, "colocate_all_models": True, "actor_num_gpus_per_node": 2})
    with pytest.raises(
        ConfigError, match=r"^ref_num_gpus_per_node: colocate_actor_ref needs the ref group the actor's size"
    ):
        make_config(RLConfig, {**RL, "colocate_actor_ref": True, "actor_num_gpus_per_node": 2})
    with pytest.raises(
        ConfigError,
        match=r"^train_batch_size: 64 does not split over 3 workers \(actor_num_nodes × actor_num_gpus_per_node\)",
    ):
        make_config(RLConfig, {**RL, "actor_num_gpus_per_node": 3})
    with pytest.raises(ConfigError, match=r"^enable_prefix_caching: only applies to vLLM engines"):
        make_config(RLConfig, {**RL, "enable_prefix_caching": True})
    with pytest.raises(ConfigError, match=r"^dynamic_filtering: needs n_samples_per_prompt of 2 or more"):
        make_config(RLConfig, {**RL, "dynamic_filtering": True})
    with pytest.raises(
        ConfigError, match=r"^reward_clip_range: '5 1' .*|^reward_clip_range: low 5.0 must be below high 1.0"
    ):
        make_config(RLConfig, {**RL, "reward_clip_range": "5 1"})
    assert make_config(RLConfig, {**RL, "reward_clip_range": "-10 10"}).interval("reward_clip_range") == (-10.0, 10.0)


def test_vllm_flags_refused_in_one_line_when_they_cannot_apply():
    base = {"output": "/tmp/x", "pretrain": "m", "prompt_data": "p", "remote_rm_url": "r.py"}
    with pytest.raises(
        ConfigError, match="^vllm_num_engines: with --colocate_all_models each actor worker hosts one vLLM engine"
    ):
        make_config(RLConfig, {**base, "vllm_num_engines": 2, "colocate_all_models": True})
    assert make_config(RLConfig, {**base, "vllm_num_engines": 2}).separate_engines()  # two engines on GPUs of their own
    with pytest.raises(ConfigError, match="^async_train: needs vLLM engines on GPUs of their own"):
        make_config(RLConfig, {**base, "vllm_num_engines": 1, "colocate_all_models": True, "async_train": True})
    # Without vLLM, --async_train places one transformers engine of its own (tests/e2e/test_agentic_learning.py runs it).
    assert make_config(RLConfig, {**base, "async_train": True}).separate_engines()
    with pytest.raises(ConfigError, match="^async_train: needs a fixed rollout"):
        make_config(RLConfig, {**base, "async_train": True, "max_staleness": 0})
    with pytest.raises(ConfigError, match="^vllm_gpu_memory_utilization: 1.0 leaves the colocated trainer no memory"):
        make_config(RLConfig, {**base, "vllm_num_engines": 1, "vllm_gpu_memory_utilization": 1.0})
    # With LoRA the engines are synced the adapter alone (tasks.common.nn.engines.vllm_engine), up to vLLM's largest rank.
    assert make_config(RLConfig, {**base, "vllm_num_engines": 1, "lora_rank": 8, "async_train": True}).lora_rank == 8
    with pytest.raises(ConfigError, match="^lora_rank: vLLM's LoRA layers hold ranks up to 512, got 600"):
        make_config(RLConfig, {**base, "vllm_num_engines": 1, "lora_rank": 600})
    with pytest.raises(ConfigError, match="^async_train: .* vLLM engines with LoRA"):
        make_config(RLConfig, {**base, "async_train": True, "lora_rank": 8})
    with pytest.raises(ConfigError, match="^vllm_enable_sleep: only applies to vLLM engines"):
        make_config(RLConfig, {**base, "vllm_enable_sleep": True})


def test_no_reference_model_when_kl_is_off_or_the_actor_is_its_own():
    base = {
        "output": "/tmp/x",
        "pretrain": "m",
        "prompt_data": "p",
        "remote_rm_url": "r.py",
        "advantage_estimator": "rloo",
        "n_samples_per_prompt": 2,
    }
    assert make_config(RLConfig, {**base, "init_kl_coef": 0.0}).roles() == ["actor"]
    assert make_config(RLConfig, {**base, "init_kl_coef": 0.01}).roles() == ["actor", "ref"]
    assert make_config(RLConfig, {**base, "init_kl_coef": 0.01, "lora_rank": 4}).roles() == ["actor"]  # its own base


def test_the_actor_scores_a_rollout_only_when_the_update_needs_it():
    """Without KL and with one optimizer update per rollout, the old log-probabilities are the update's own
    (detached): the actor's scoring pass is skipped. A KL term or a second update brings it back."""
    base = {
        "output": "/tmp/x",
        "pretrain": "m",
        "prompt_data": "p",
        "remote_rm_url": "r.py",
        "advantage_estimator": "group_norm",
        "n_samples_per_prompt": 4,
        "rollout_batch_size": 8,
        "train_batch_size": 32,
        "max_epochs": 1,
        "init_kl_coef": 0.0,
    }
    assert not make_config(RLConfig, base).needs_old_logprobs()
    assert make_config(RLConfig, {**base, "init_kl_coef": 0.01}).needs_old_logprobs()
    assert make_config(RLConfig, {**base, "train_batch_size": 16}).needs_old_logprobs()  # two updates per rollout
    assert make_config(RLConfig, {**base, "max_epochs": 2}).needs_old_logprobs()


def test_the_config_takes_reject():
    base = {"output": "o", "pretrain": "p", "reward_pretrain": "r", "prompt_data": "d"}
    assert make_config(RLConfig, {**base, "is_correction": "reject"}).correction() == "reject"
    with pytest.raises(ConfigError, match="is_correction: use auto, tis, mis, reject, none with an is_cap above 1"):
        make_config(RLConfig, {**base, "is_correction": "icepop"})


BASE = {
    "pretrain": "demo",
    "prompt_data": "d",
    "output": "o",
    "remote_rm_url": "length",
    "n_samples_per_prompt": 2,
    "train_batch_size": 8,
}


def test_the_config_draws_the_over_sampled_prompts_and_refuses_what_it_cannot_cut():
    cfg = make_config(RLConfig, {**BASE, "rollout_batch_size": 4, "over_sampling_batch_size": 6})
    assert cfg.prompts_per_rollout() == 6
    assert make_config(RLConfig, {**BASE, "rollout_batch_size": 4}).prompts_per_rollout() == 4
    with pytest.raises(
        ConfigError, match="^over_sampling_batch_size: 4 prompts must be more than rollout_batch_size 4"
    ):
        make_config(RLConfig, {**BASE, "rollout_batch_size": 4, "over_sampling_batch_size": 4})
    with pytest.raises(ConfigError, match="^over_sampling_batch_size: cuts one-turn rollouts"):
        make_config(
            RLConfig,
            {**BASE, "rollout_batch_size": 4, "over_sampling_batch_size": 6, "dynamic_filtering": True},
        )
    with pytest.raises(ConfigError, match="^over_sampling_batch_size: it and rollout_batch_size must split evenly"):
        make_config(
            RLConfig,
            {**BASE, "rollout_batch_size": 4, "over_sampling_batch_size": 7, "actor_num_gpus_per_node": 2},
        )


def test_the_config_takes_the_budget_and_refuses_reject_without_old_logprobs():
    from tasks.common.config import ConfigError, make_config
    from tasks.rl.config import RLConfig

    base = {"output": "o", "pretrain": "p", "reward_pretrain": "r", "prompt_data": "d"}
    assert make_config(RLConfig, base).max_tokens_per_gpu == 0  # count-based micro-batches, as before
    assert make_config(RLConfig, {**base, "max_tokens_per_gpu": 16384}).max_tokens_per_gpu == 16384
    with pytest.raises(ConfigError, match="^max_tokens_per_gpu: "):
        make_config(RLConfig, {**base, "max_tokens_per_gpu": -1})
    one_update = {
        **base,
        "init_kl_coef": 0,
        "max_epochs": 1,
        "rollout_batch_size": 64,
        "train_batch_size": 64,
        "is_correction": "reject",
    }
    with pytest.raises(
        ConfigError, match=r"^max_tokens_per_gpu: with --is_correction reject it needs the rollout's old log-probs"
    ):
        make_config(RLConfig, {**one_update, "max_tokens_per_gpu": 4096})
    make_config(
        RLConfig, {**one_update, "max_tokens_per_gpu": 4096, "max_epochs": 2}
    )  # two updates: old log-probs are scored


def test_by_default_long_responses_train_by_the_tokens_of_a_micro_batch_of_the_longest_rows():
    """RLConfig.token_budget: --max_tokens_per_gpu when given; else, over 256 new tokens, micro_train_batch_size rows of
    prompt_max_len + generate_max_len (or the actor's share of the batch when that is 0); short ones by count."""
    from tasks.common.config import make_config
    from tasks.rl.config import RLConfig

    base = {
        "output": "o",
        "pretrain": "p",
        "reward_pretrain": "r",
        "prompt_data": "d",
        "prompt_max_len": 128,
        "micro_train_batch_size": 8,
    }
    assert (
        make_config(RLConfig, {**base, "generate_max_len": 256}).token_budget() == 0
    )  # the demo's and the 256-token bench's
    assert make_config(RLConfig, {**base, "generate_max_len": 4096}).token_budget() == 8 * (128 + 4096)
    assert (
        make_config(RLConfig, {**base, "generate_max_len": 4096, "max_tokens_per_gpu": 16384}).token_budget() == 16384
    )
    whole_share = {
        **base,
        "micro_train_batch_size": 0,
        "train_batch_size": 64,
        "rollout_batch_size": 64,
        "generate_max_len": 1024,
    }
    assert make_config(RLConfig, whole_share).token_budget() == 64 * (128 + 1024)
    episodes = {**base, "env_path": "calculator", "generate_max_len": 64, "max_episode_tokens": 2048}
    assert make_config(RLConfig, episodes).token_budget() == 8 * (128 + 2048)  # an episode's tokens, not one turn's
    one_update = {
        **base,
        "generate_max_len": 4096,
        "init_kl_coef": 0,
        "max_epochs": 1,
        "rollout_batch_size": 64,
        "train_batch_size": 64,
    }
    assert (
        make_config(RLConfig, {**one_update, "is_correction": "reject"}).token_budget() == 0
    )  # reject needs old log-probs
