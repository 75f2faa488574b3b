"""The RL workers on a vision-language policy (issue 54), on CPU with the demo's tiny VLMs built offline, each a
DeepSpeed world of one in this process: the actor (with LoRA and a frozen tower) and the reference on both families
(`vlm_folder`: Qwen2-VL and LLaVA), the critic of PPO's GAE on both, and on Qwen2-VL alone (`qwen_vlm_folder`) PPO-ptx, the
text-critic refusal and an engine of its own (--async_train), whose paths are the same for every family."""

import pytest
import torch

from tasks.common.config import ConfigError, make_config
from tasks.common.nn import vision
from tasks.common.nn.engines import make_engine
from tasks.common.nn.vision_family import family_of
from tasks.common.nn.vision_passes import VisionRows
from tasks.data import demo_vlm
from tasks.rl.config import RLConfig
from tasks.rl.experience import make_experience

from tests.vlm_demo import StageInputs, encoded, in_tower, rl_config, rl_flags, write_rows


@pytest.fixture(scope="module")
def rows():
    return demo_vlm.make_datasets(seed=0, sizes={"prompts": 8})["prompts"]


@pytest.mark.parametrize("lora", [False, True])
def test_the_actor_generates_from_images_scores_them_and_trains_the_language_model_only(
    vlm_folder, rows, tmp_path, lora
):
    """The RL actor on the demo VLM (a DeepSpeed world of one, in this process): its rollout keeps the images, its
    log-prob pass agrees with its engine's, and one update moves the language model and leaves the vision tower as
    it was (--freeze_visual_encoder; with LoRA, only adapters train and the reference is the base, adapters off)."""
    from tasks.rl.actor import ActorWorker
    from tasks.rl.images import load_vision_prompts

    data = write_rows(tmp_path / "p.jsonl", rows)
    extra = {"lora_rank": 4, "lora_alpha": 8, "init_kl_coef": 0.01} if lora else {}
    cfg = rl_config(vlm_folder, data, freeze_visual_encoder=True, **extra)
    prompts = load_vision_prompts(cfg, StageInputs(), vision.load_processor(vlm_folder))
    worker = ActorWorker(0, 1, None, 1)
    worker.setup(cfg, 4)
    torch.manual_seed(0)
    rollout = worker.generate_vision([(prompts.ids[i], prompts.images[i]) for i in range(4) for _ in range(2)])
    assert rollout.images == [prompts.images[i] for i in range(4) for _ in range(2)]
    if lora:
        logprobs, ref = worker.reference_logprobs(rollout)
        assert torch.allclose(logprobs, ref, atol=1e-6)  # adapters start at zero: the base is the policy
    else:
        logprobs = ref = worker.logprobs(rollout)
    assert torch.allclose(logprobs * rollout.response_mask, rollout.logprobs, atol=1e-5)
    exp = make_experience(rollout, logprobs, ref, None, torch.tensor([1.0, 0.0] * 4), cfg, 0.0)
    before = {n: p.detach().clone() for n, p in worker.engine.module.named_parameters()}
    stats = worker.train([exp], 0.0)
    assert stats["engine_logprob_max_diff"] < 1e-5 and stats["grad_norm"] > 0
    after = dict(worker.engine.module.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert any("language_model" in n for n in moved)
    assert not any(in_tower(n) for n in moved)
    if lora:
        assert all("lora_" in n for n in moved)
        _, ref_after = worker.reference_logprobs(rollout)
        assert torch.allclose(ref_after, ref, atol=1e-5) and not torch.allclose(worker.logprobs(rollout), ref)
    saved = tmp_path / "saved"
    worker.save_model(str(saved))
    assert family_of(vision.load_processor(str(saved))) is family_of(worker.processor)
    if lora:  # the adapter export: later stages (eval) merge it into its VLM base, processor and all
        from tasks.common.nn.lora import merged_checkpoint

        merged = str(merged_checkpoint(saved, vlm_folder))
        assert family_of(vision.load_processor(merged)) is family_of(worker.processor)
        full = vision.load_vision_lm(merged).eval()
        passes = VisionRows.of(worker.processor)
        args = (rollout.sequences, rollout.attention_mask, rollout.images)
        with torch.no_grad():
            expected = passes.logprobs(worker.engine.module, *args, start=rollout.prompt_width - 1)
            assert torch.allclose(passes.logprobs(full, *args, start=rollout.prompt_width - 1), expected, atol=1e-4)


def test_the_reference_worker_scores_a_vlm_rollout_with_its_images(vlm_folder, rows, tmp_path):
    from tasks.rl.workers import ReferenceWorker

    processor, model = vision.load_processor(vlm_folder), vision.load_vision_lm(vlm_folder).eval()
    engine = make_engine(
        "transformers", processor.tokenizer, module=model, device=torch.device("cpu"), processor=processor
    )
    rollout = engine.generate(encoded(processor, rows[:3]), 3, images=[r["images"] for r in rows[:3]])
    worker = ReferenceWorker(0, 1, None, 1)
    worker.setup(rl_config(vlm_folder, "p", init_kl_coef=0.01))
    assert torch.allclose(worker.logprobs(rollout) * rollout.response_mask, rollout.logprobs, atol=1e-5)


def test_ppo_ptx_on_a_vlm_adds_the_sft_loss_of_rows_with_their_images(qwen_vlm_folder, rows, tmp_path):
    """--ptx_coef with --pretrain_data on a vision-language policy: the supervised rows keep their images, and the
    update adds their SFT loss (supervised.vlm_micro_batch_loss), logged as ptx_loss."""
    from tasks.rl.actor import ActorWorker
    from tasks.rl.images import load_vision_prompts

    sft_rows = demo_vlm.make_datasets(seed=3, sizes={"sft": 8})["sft"]
    sft = write_rows(tmp_path / "s.jsonl", sft_rows)
    cfg = rl_config(qwen_vlm_folder, write_rows(tmp_path / "p.jsonl", rows), pretrain_data=sft, ptx_coef=0.5)
    worker = ActorWorker(0, 1, None, 1)
    worker.setup(cfg, 4)
    assert worker.ptx_images == [r["images"] for r in sft_rows]
    prompts = load_vision_prompts(cfg, StageInputs(), worker.processor)
    rollout = worker.generate_vision([(prompts.ids[i], prompts.images[i]) for i in range(4) for _ in range(2)])
    logprobs = worker.logprobs(rollout)
    exp = make_experience(rollout, logprobs, logprobs, None, torch.tensor([1.0, 0.0] * 4), cfg, 0.0)
    stats = worker.train([exp], 0.0)
    assert 0 < stats["ptx_loss"] < 20


def test_gae_on_a_vlm_values_each_row_with_its_images_and_fits_the_returns(vlm_folder, rows, tmp_path):
    """PPO with a critic on the demo VLM: the critic (the VLM's backbone with a value head of zeros, from the
    policy) values the rollout's rows with their images, GAE turns the rewards into advantages, the actor and the
    critic each take a step, the critic's values move toward the returns and its frozen tower stays."""
    from tasks.rl.actor import ActorWorker
    from tasks.rl.images import load_vision_prompts
    from tasks.rl.workers import CriticWorker

    data = write_rows(tmp_path / "p.jsonl", rows)
    cfg = rl_config(vlm_folder, data, advantage_estimator="gae", n_samples_per_prompt=1, rollout_batch_size=8)
    cfg = make_config(RLConfig, {**cfg.__dict__, "freeze_visual_encoder": True, "critic_learning_rate": 1e-3})
    prompts = load_vision_prompts(cfg, StageInputs(), vision.load_processor(vlm_folder))
    actor, critic = ActorWorker(0, 1, None, 1), CriticWorker(0, 1, None, 1)
    actor.setup(cfg, 4)
    critic.setup(cfg, vlm_folder, 4)
    rollout = actor.generate_vision([(prompts.ids[i], prompts.images[i]) for i in range(8)])
    values = critic.values(rollout)
    assert values.shape == rollout.response_mask.shape and values.abs().max() == 0  # a head of zeros
    logprobs = actor.logprobs(rollout)
    exp = make_experience(rollout, logprobs, logprobs, values, torch.tensor([1.0, 0.0] * 4), cfg, 0.0)
    assert (exp.advantages * exp.action_mask).abs().sum() > 0
    tower = {n: p.detach().clone() for n, p in critic.engine.module.named_parameters() if in_tower(n)}
    assert tower and actor.train([exp], 0.0)["grad_norm"] > 0

    def error(v):  # the values' squared distance to the returns, unclipped
        return (((v - exp.returns) ** 2) * exp.action_mask).sum() / exp.action_mask.sum()

    before = error(values)
    for _ in range(3):
        stats = critic.train([exp])
    assert stats["value_loss"] > 0 and error(critic.values(rollout)) < before
    assert all(torch.equal(p, tower[n]) for n, p in critic.engine.module.named_parameters() if n in tower)


def test_a_text_critic_for_a_vlm_policy_is_refused_naming_the_fix(qwen_vlm_folder, rows, tmp_path):
    from tasks.data import demo
    from tasks.rl.images import vision_setup

    demo.build_base_model(demo.build_tokenizer()).save_pretrained(tmp_path / "text")
    data = write_rows(tmp_path / "p.jsonl", rows)
    cfg = make_config(RLConfig, rl_flags(qwen_vlm_folder, data, critic_pretrain=str(tmp_path / "text")))
    with pytest.raises(ConfigError, match="^critic_pretrain: .* is a text model, which cannot value a vision-language"):
        vision_setup(cfg, StageInputs(), qwen_vlm_folder)
    cfg, tokenizer, prompts = vision_setup(
        make_config(RLConfig, rl_flags(qwen_vlm_folder, data)), StageInputs(), qwen_vlm_folder
    )
    assert cfg.max_images_per_prompt == 1 and len(prompts.images) == len(rows) and tokenizer.pad_token_id is not None


def test_a_rollout_engine_of_its_own_generates_from_the_images_and_takes_the_actors_weights(
    qwen_vlm_folder, rows, tmp_path
):
    """--async_train on a vision-language policy: the transformers engine of its own (RolloutEngineWorker) generates
    from each prompt's images, tags the tokens with its weight version, and after the actor's full weights arrive
    (ActorWorker.engine_state) its log-probabilities are the trained actor's."""
    from tasks.rl.actor import ActorWorker
    from tasks.rl.images import load_vision_prompts
    from tasks.rl.workers import RolloutEngineWorker

    cfg = rl_config(qwen_vlm_folder, write_rows(tmp_path / "p.jsonl", rows), async_train=True)
    prompts = load_vision_prompts(cfg, StageInputs(), vision.load_processor(qwen_vlm_folder))
    items = [(prompts.ids[i], prompts.images[i]) for i in range(4) for _ in range(2)]
    actor, engine = ActorWorker(0, 1, None, 1), RolloutEngineWorker(0, 1, None, 1)
    actor.setup(cfg, 4)
    engine.setup(cfg)
    rollout = engine.generate_vision(items)
    assert rollout.images == [images for _, images in items] and rollout.versions.unique().tolist() == [0]
    logprobs = actor.logprobs(rollout)
    exp = make_experience(rollout, logprobs, logprobs, None, torch.tensor([1.0, 0.0] * 4), cfg, 0.0)
    actor.train([exp], 0.0)
    engine.load_state(actor.engine_state(), 1)
    rollout = engine.generate_vision(items)
    assert rollout.versions.unique().tolist() == [1]
    assert torch.allclose(actor.logprobs(rollout) * rollout.response_mask, rollout.logprobs, atol=1e-5)


def test_rl_scores_a_vlm_rollout_with_the_vlm_reward_model_as_it_scores_each_row_alone(vlm_folder, rows, tmp_path):
    """--reward_pretrain on a vision-language policy: the reward_model stage's VLM output is taken, a text reward
    model refused naming the fix (vision_setup, before any worker); the reward workers, each given its shard of the
    rollout with the rows' images (placement.select_batch), score each row as the reward model scores it alone,
    standardised with its reward_mean and reward_std."""
    from tasks.common.nn.rewards import build_reward_batch
    from tasks.common.nn.vision_reward import VisionRewardModel, vlm_sequence_scores
    from tasks.common.nn.workers import shard
    from tasks.data import demo
    from tasks.rl.images import vision_setup
    from tasks.rl.placement import select_batch
    from tasks.rl.workers import RewardWorker

    from tests.unit.tasks.common.nn.test_vision_reward import save_vision_reward_model

    rm = save_vision_reward_model(vlm_folder, tmp_path / "rm", mean=0.5, std=4.0)
    demo.build_base_model(demo.build_tokenizer()).save_pretrained(tmp_path / "text")
    data = write_rows(tmp_path / "p.jsonl", rows)
    text = make_config(RLConfig, rl_flags(vlm_folder, data, remote_rm_url="", reward_pretrain=str(tmp_path / "text")))
    with pytest.raises(
        ConfigError, match="^reward_pretrain: .* is a text reward model, .*; pass the reward_model stage's"
    ):
        vision_setup(text, StageInputs(), vlm_folder)
    cfg, tokenizer, prompts = vision_setup(
        rl_config(vlm_folder, data, remote_rm_url="", reward_pretrain=rm), StageInputs(), vlm_folder
    )
    processor, model = vision.load_processor(vlm_folder), vision.load_vision_lm(vlm_folder).eval()
    engine = make_engine("transformers", tokenizer, module=model, device=torch.device("cpu"), processor=processor)
    torch.manual_seed(0)
    rollout = engine.generate(prompts.ids[:5], 3, images=prompts.images[:5])
    batch = build_reward_batch(rollout, tokenizer, prompts.texts[:5], prompts.labels[:5])
    worker = RewardWorker(0, 1, None, 1)
    worker.setup(cfg)
    scores = torch.cat([worker.score(select_batch(batch, part)) for part in shard(list(range(5)), 2)])
    judge = VisionRewardModel.from_pretrained(rm).eval()
    alone = []
    for i in range(5):  # the row's real tokens, unpadded
        ids = rollout.sequences[i][rollout.attention_mask[i].bool()].tolist()
        with torch.no_grad():
            alone.append(vlm_sequence_scores(judge, processor, [ids], [prompts.images[i]], 0, "cpu"))
    assert torch.allclose(scores, (torch.cat(alone) - 0.5) / 4.0, atol=1e-5), (scores, alone)


def test_ppo_with_a_vlm_reward_model_starts_its_critic_from_it(vlm_folder, rows, tmp_path):
    """GAE with a VLM reward model and no --critic_pretrain: the critic is the reward model (backbone and trained head,
    as a text critic starts from the text reward model), valuing each response token with the row's images."""
    from tasks.common.nn.vision_reward import VisionRewardModel
    from tasks.rl.workers import CriticWorker

    from tests.unit.tasks.common.nn.test_vision_reward import save_vision_reward_model

    rm = save_vision_reward_model(vlm_folder, tmp_path / "rm", seed=1)
    processor, model = vision.load_processor(vlm_folder), vision.load_vision_lm(vlm_folder).eval()
    engine = make_engine(
        "transformers", processor.tokenizer, module=model, device=torch.device("cpu"), processor=processor
    )
    rollout = engine.generate(encoded(processor, rows[:3]), 3, images=[r["images"] for r in rows[:3]])
    cfg = rl_config(
        vlm_folder,
        "p",
        advantage_estimator="gae",
        n_samples_per_prompt=1,
        rollout_batch_size=8,
        remote_rm_url="",
        reward_pretrain=rm,
    )
    critic = CriticWorker(0, 1, None, 1)
    critic.setup(cfg, rm, 1)
    judge = VisionRewardModel.from_pretrained(rm).eval()
    with torch.no_grad():
        values = judge(**VisionRows.of(processor).inputs(rollout.sequences, rollout.attention_mask, rollout.images))
    expected = values[:, rollout.prompt_width - 1 : -1] * rollout.response_mask
    assert expected.abs().sum() > 0 and torch.allclose(critic.values(rollout), expected, atol=1e-5)
