"""RL and eval on a vision-language model (issue 54), on CPU with the demo's tiny Qwen2-VL built offline: the
transformers engine generating from the pixels, the log-prob passes scoring the same rows with their images, the
RL actor and reference workers (DeepSpeed worlds of one, in this process), the guards and the refusals. The vLLM
path's pure parts are in tests/unit/tasks/common/nn/engines/test_vllm_vision.py; the stages on Ray and the learning
check in tests/e2e/test_vlm_stages.py."""

import json

import pytest
import torch

from tasks.common.config import ConfigError, make_config
from tasks.common.nn import vision
from tasks.common.nn.engines import make_engine
from tasks.common.nn.engines.rollout import concat_rollouts
from tasks.common.nn.vision_family import QWEN2_VL, check_placeholder_tokens, per_row
from tasks.common.nn.vision_passes import VisionRows, without_tokens
from tasks.data import demo_vlm
from tasks.rl.config import RLConfig
from tasks.rl.experience import make_experience, response_logprobs
from tasks.rl.workers import trimmed


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo-vlm")
    demo_vlm.save_demo_vlm(path, seed=0)
    return str(path)


@pytest.fixture(scope="module")
def rows():
    return demo_vlm.make_datasets(seed=0, sizes={"prompts": 8})["prompts"]


def encoded(processor, rows, prompts=None):
    prompts = prompts or [r["prompt"] for r in rows]
    return [vision.encode_vlm_prompt(processor, p, r["images"])["input_ids"] for p, r in zip(prompts, rows)]


def test_the_engine_samples_from_the_pixels_and_reports_the_log_probs_the_trainer_computes(folder, rows):
    """Prompts of two lengths (left padding moves the image), sampled and greedy: the engine's log-probabilities of
    its tokens are the training pass's on the same rows with the same images (M-RoPE computed by the model in both),
    and no image placeholder id is ever sampled."""
    processor, model = vision.load_processor(folder), vision.load_vision_lm(folder).eval()
    prompts = [r["prompt"] if i % 2 else "<image>which colour is it?" for i, r in enumerate(rows)]
    ids, images = encoded(processor, rows, prompts), [r["images"] for r in rows]
    # A prompt of two images, and one of none: each row's grids in order, M-RoPE positions per row.
    two = rows[2]["images"] + rows[3]["images"]
    ids[2] = vision.encode_vlm_prompt(processor, "<image> or <image>: colour?", two)["input_ids"]
    images[2], ids[3], images[3] = two, vision.encode_vlm_prompt(processor, "colour?", [])["input_ids"], []
    engine = make_engine(
        "transformers", processor.tokenizer, module=model, device=torch.device("cpu"), processor=processor
    )
    passes = VisionRows.of(processor)
    torch.manual_seed(0)
    for greedy in (False, True):
        rollout = engine.generate(ids, 6, temperature=0.7, greedy=greedy, images=images, batch_size=5)
        assert rollout.images == images and rollout.sequences.size(0) == len(rows)
        trained = passes.logprobs(
            model,
            rollout.sequences,
            rollout.attention_mask,
            rollout.images,
            temperature=1.0 if greedy else 0.7,
            start=rollout.prompt_width - 1,
        )
        assert torch.allclose(trained * rollout.response_mask, rollout.logprobs, atol=1e-5)
        sampled = rollout.responses[rollout.response_mask.bool()]
        assert not torch.isin(sampled, passes.banned).any()
    # The same prompt under another image gives other logits: the pixels reach the engine's model.
    other = [rows[1]["images"]] + images[1:]
    a = passes.logits(model, *_prompt_batch(ids, processor), images)
    b = passes.logits(model, *_prompt_batch(ids, processor), other)
    assert not torch.allclose(a[0], b[0])


def test_the_checkpoints_own_generation_settings_do_not_change_what_the_engine_samples(folder, rows):
    """A checkpoint's generation_config (Qwen2-VL-Instruct's carries top_k 1 and a repetition penalty) is not the
    policy: the engine samples from the model's distribution at the rollout's temperature whatever it says, so its
    log-probabilities stay the trainer's and the samples of one prompt differ."""
    processor, model = vision.load_processor(folder), vision.load_vision_lm(folder).eval()
    settings = model.generation_config
    settings.top_k, settings.repetition_penalty, settings.no_repeat_ngram_size = 1, 5.0, 1
    engine = make_engine(
        "transformers", processor.tokenizer, module=model, device=torch.device("cpu"), processor=processor
    )
    ids = encoded(processor, rows[:1]) * 8
    torch.manual_seed(0)
    rollout = engine.generate(ids, 4, images=[rows[0]["images"]] * 8)
    trained = VisionRows.of(processor).logprobs(
        model, rollout.sequences, rollout.attention_mask, rollout.images, start=rollout.prompt_width - 1
    )
    assert torch.allclose(trained * rollout.response_mask, rollout.logprobs, atol=1e-5)
    assert len({tuple(r) for r in rollout.responses.tolist()}) > 1
    assert model.generation_config.top_k == 1  # the checkpoint's own settings are left as they were


def _prompt_batch(ids, processor):
    from tasks.common.nn.data import pad

    return pad(ids, processor.tokenizer.pad_token_id, side="left")


def test_a_banned_id_is_never_sampled_even_where_the_model_prefers_it(folder, rows):
    """The placeholder ids are banned in the engine and removed from the policy the trainer scores: with the image
    token's bias raised far above every other, the engine still never samples it."""
    processor, model = vision.load_processor(folder), vision.load_vision_lm(folder).eval()
    with torch.no_grad():
        model.lm_head.weight[processor.image_token_id] *= 50
    engine = make_engine(
        "transformers", processor.tokenizer, module=model, device=torch.device("cpu"), processor=processor
    )
    rollout = engine.generate(encoded(processor, rows[:4]), 4, images=[r["images"] for r in rows[:4]])
    assert processor.image_token_id not in rollout.responses[rollout.response_mask.bool()].tolist()
    logits = torch.zeros(2, 5)
    assert without_tokens(logits, torch.tensor([1, 3]))[0].tolist() == [0.0, -1e4, 0.0, -1e4, 0.0]


def test_placeholder_tokens_are_checked_against_the_images_before_the_model_sees_them(folder, rows):
    processor = vision.load_processor(folder)
    passes = VisionRows.of(processor)
    ids = encoded(processor, rows[:2])
    # 28 px images, 7 px patches merged 2 x 2: 4 tokens each.
    grids = {"image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4], [1, 2, 2]])}
    assert per_row(QWEN2_VL.tokens_per_image(processor, grids), [2, 1]) == [8, 1]
    first = ids[1].index(processor.image_token_id)
    cut = ids[1][:first] + ids[1][first + 2 :]  # two of the second row's placeholders lost, as a truncation would
    seqs, mask = _prompt_batch([ids[0], cut], processor)
    with pytest.raises(
        ValueError, match=r"^images: rollout row 1 has 2 image placeholder token\(s\) and its images expand to 4"
    ):
        passes.inputs(seqs, mask, [rows[0]["images"], rows[1]["images"]])
    with pytest.raises(ValueError, match="rollout row 0 has 4 .* expand to 0"):
        passes.inputs(*_prompt_batch(ids[:1], processor), [[]])
    check_placeholder_tokens([4, 0], [4, 0])


def test_rollouts_and_experience_keep_each_rows_images_through_select_concat_minibatch_and_trim(folder, rows):
    processor, model = vision.load_processor(folder), vision.load_vision_lm(folder).eval()
    engine = make_engine(
        "transformers", processor.tokenizer, module=model, device=torch.device("cpu"), processor=processor
    )
    prompts = [r["prompt"] if i % 2 else "<image>which colour is the shape?" for i, r in enumerate(rows[:4])]
    ids, images = encoded(processor, rows[:4], prompts), [r["images"] for r in rows[:4]]
    rollout = engine.generate(ids, 3, images=images)
    assert rollout.select([2, 0]).images == [images[2], images[0]]
    assert rollout.select(torch.tensor([3])).images == [images[3]]
    assert rollout.select(slice(1, 3)).images == images[1:3]
    joined = concat_rollouts([rollout.select([0]), rollout.select([1, 2, 3])], processor.tokenizer.pad_token_id)
    assert joined.images == images
    with pytest.raises(ValueError, match="some rollouts carry images and some do not"):
        concat_rollouts([rollout, _text_rollout(rollout)], 0)
    cfg = make_config(RLConfig, _flags(folder, "x", advantage_estimator="group_norm", n_samples_per_prompt=2))
    logprobs = response_logprobs(
        model,
        rollout.sequences,
        rollout.attention_mask,
        rollout.prompt_width,
        images=rollout.images,
        vision=VisionRows.of(processor),
    )
    exp = make_experience(rollout, logprobs, logprobs, None, torch.tensor([1.0, 0.0, 1.0, 0.0]), cfg, 0.0)
    assert exp.images == images and exp.minibatch(torch.tensor([3, 1])).images == [images[3], images[1]]
    # A token-budget micro-batch cut to its rows' widths scores its rows as the whole batch did.
    mb = trimmed(exp, [1, 3])
    assert mb.images == [images[1], images[3]] and mb.sequences.size(1) < exp.sequences.size(1)
    again = response_logprobs(
        model, mb.sequences, mb.attention_mask, mb.prompt_width, images=mb.images, vision=VisionRows.of(processor)
    )
    assert torch.allclose(
        again * mb.action_mask, (logprobs[[1, 3]] * exp.action_mask[[1, 3]])[:, : again.size(1)], atol=1e-5
    )


def _text_rollout(rollout):
    out = rollout.select([0])
    out.images = None
    return out


def _flags(folder, data, **extra) -> dict:
    return {
        "output": "/tmp/unused",
        "pretrain": folder,
        "prompt_data": data,
        "remote_rm_url": "reward.py",
        "label_key": "label",
        "apply_chat_template": True,
        **extra,
    }


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


class Inputs:
    """What load_vision_prompts reads of a StageRun: its inputs, recorded as they are."""

    def input(self, name, uri):
        return uri


def test_prompts_keep_their_images_drop_what_is_too_long_and_name_a_row_whose_counts_differ(folder, rows, tmp_path):
    from tasks.rl.images import images_limit, load_vision_prompts

    processor = vision.load_processor(folder)
    long = {**rows[1], "prompt": "<image>" + "which colour is the shape in this picture? " * 3}
    data = write_rows(tmp_path / "p.jsonl", [rows[0], long, rows[2]])
    cfg = make_config(RLConfig, _flags(folder, data, prompt_max_len=40))
    prompts = load_vision_prompts(cfg, Inputs(), processor)
    assert prompts.dropped == 1 and prompts.images == [rows[0]["images"], rows[2]["images"]]
    assert prompts.labels == [rows[0]["label"], rows[2]["label"]] and prompts.truncated == 0
    assert all(i.count(processor.image_token_id) == 4 for i in prompts.ids)
    assert images_limit(cfg, prompts) == 1
    limited = make_config(RLConfig, _flags(folder, data, max_images_per_prompt=1))
    assert images_limit(limited, prompts) == 1
    prompts.images[0] = prompts.images[0] * 2
    with pytest.raises(ConfigError, match="^max_images_per_prompt: a prompt carries 2 images, over the limit of 1"):
        images_limit(limited, prompts)
    two_tags = write_rows(tmp_path / "bad.jsonl", [rows[0], {**rows[1], "prompt": "<image><image>colour?"}])
    with pytest.raises(ConfigError, match=r"^images: row 2 has 1 image\(s\) and 2 <image> tag.*--image_key 'images'"):
        load_vision_prompts(make_config(RLConfig, _flags(folder, two_tags)), Inputs(), processor)
    with pytest.raises(ConfigError, match="^prompt_max_len: all 3 prompts with their image tokens are longer than 8"):
        load_vision_prompts(make_config(RLConfig, _flags(folder, data, prompt_max_len=8)), Inputs(), processor)


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"lora_rank": 4}, "^lora_rank: a vision-language policy's critic .* trains in full; .* group_norm \\(GRPO\\)"),
        ({"save_value_network": True}, "^save_value_network: a vision-language policy's critic .* is not exported"),
        ({"packing_samples": True}, "^packing_samples: a vision-language policy's rows cannot be packed"),
        ({"env_path": "calculator"}, "^env_path: an environment's observations carry no images"),
        (
            {"over_sampling_batch_size": 8, "rollout_batch_size": 4, "train_batch_size": 8},
            "^over_sampling_batch_size: its request-by-request engine calls carry no images",
        ),
        ({"remote_rm_url": "", "reward_pretrain": "rm"}, "^reward_pretrain: this stage's reward models score text"),
    ],
)
def test_what_rl_does_not_do_on_a_vlm_is_refused_in_one_line(flags, message):
    from tasks.rl.images import refuse_for_vision

    gae = "lora_rank" in flags or "save_value_network" in flags
    estimator = {} if gae else {"advantage_estimator": "group_norm", "n_samples_per_prompt": 2}
    cfg = make_config(RLConfig, _flags("m", "p", **estimator, **flags))
    with pytest.raises(ConfigError, match=message):
        refuse_for_vision(cfg)
    refuse_for_vision(make_config(RLConfig, _flags("m", "p", advantage_estimator="rloo", n_samples_per_prompt=2)))
    refuse_for_vision(make_config(RLConfig, _flags("m", "p")))  # gae: the VLM critic (tasks/rl/vision_critic.py)


def rl_config(folder, data, **extra) -> RLConfig:
    flags = _flags(folder, data, advantage_estimator="group_norm", n_samples_per_prompt=2, rollout_batch_size=4)
    flags |= {"train_batch_size": 8, "max_epochs": 1, "generate_max_len": 3, "lr_warmup_steps": 0}
    return make_config(RLConfig, {**flags, "actor_learning_rate": 1e-2, "init_kl_coef": 0.0, **extra})


@pytest.mark.parametrize("lora", [False, True])
def test_the_actor_generates_from_images_scores_them_and_trains_the_language_model_only(folder, rows, tmp_path, lora):
    """The RL actor on the demo VLM (a DeepSpeed world of one, in this process): its rollout keeps the images, its
    log-prob pass agrees with its engine's, and one update moves the language model and leaves the vision tower as
    it was (--freeze_visual_encoder; with LoRA, only adapters train and the reference is the base, adapters off)."""
    from tasks.rl.actor import ActorWorker
    from tasks.rl.images import load_vision_prompts

    data = write_rows(tmp_path / "p.jsonl", rows)
    extra = {"lora_rank": 4, "lora_alpha": 8, "init_kl_coef": 0.01} if lora else {}
    cfg = rl_config(folder, data, freeze_visual_encoder=True, **extra)
    prompts = load_vision_prompts(cfg, Inputs(), vision.load_processor(folder))
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
    assert not any(".visual." in f".{n}" for n in moved)
    if lora:
        assert all("lora_" in n for n in moved)
        _, ref_after = worker.reference_logprobs(rollout)
        assert torch.allclose(ref_after, ref, atol=1e-5) and not torch.allclose(worker.logprobs(rollout), ref)
    saved = tmp_path / "saved"
    worker.save_model(str(saved))
    assert vision.load_processor(str(saved)).image_processor.patch_size == demo_vlm.PATCH_SIZE
    if lora:  # the adapter export: later stages (eval) merge it into its VLM base, processor and all
        from tasks.common.nn.lora import merged_checkpoint

        merged = str(merged_checkpoint(saved, folder))
        assert vision.load_processor(merged).image_processor.patch_size == demo_vlm.PATCH_SIZE
        full = vision.load_vision_lm(merged).eval()
        passes = VisionRows.of(worker.processor)
        args = (rollout.sequences, rollout.attention_mask, rollout.images)
        with torch.no_grad():
            expected = passes.logprobs(worker.engine.module, *args, start=rollout.prompt_width - 1)
            assert torch.allclose(passes.logprobs(full, *args, start=rollout.prompt_width - 1), expected, atol=1e-4)


def test_the_reference_worker_scores_a_vlm_rollout_with_its_images(folder, rows, tmp_path):
    from tasks.rl.workers import ReferenceWorker

    processor, model = vision.load_processor(folder), vision.load_vision_lm(folder).eval()
    engine = make_engine(
        "transformers", processor.tokenizer, module=model, device=torch.device("cpu"), processor=processor
    )
    rollout = engine.generate(encoded(processor, rows[:3]), 3, images=[r["images"] for r in rows[:3]])
    worker = ReferenceWorker(0, 1, None, 1)
    worker.setup(rl_config(folder, "p", init_kl_coef=0.01))
    assert torch.allclose(worker.logprobs(rollout) * rollout.response_mask, rollout.logprobs, atol=1e-5)


def test_ppo_ptx_on_a_vlm_adds_the_sft_loss_of_rows_with_their_images(folder, rows, tmp_path):
    """--ptx_coef with --pretrain_data on a vision-language policy: the supervised rows keep their images, and the
    update adds their SFT loss (supervised.vlm_micro_batch_loss), logged as ptx_loss."""
    from tasks.rl.actor import ActorWorker
    from tasks.rl.images import load_vision_prompts

    sft_rows = demo_vlm.make_datasets(seed=3, sizes={"sft": 8})["sft"]
    sft = write_rows(tmp_path / "s.jsonl", sft_rows)
    cfg = rl_config(folder, write_rows(tmp_path / "p.jsonl", rows), pretrain_data=sft, ptx_coef=0.5)
    worker = ActorWorker(0, 1, None, 1)
    worker.setup(cfg, 4)
    assert worker.ptx_images == [r["images"] for r in sft_rows]
    prompts = load_vision_prompts(cfg, Inputs(), worker.processor)
    rollout = worker.generate_vision([(prompts.ids[i], prompts.images[i]) for i in range(4) for _ in range(2)])
    logprobs = worker.logprobs(rollout)
    exp = make_experience(rollout, logprobs, logprobs, None, torch.tensor([1.0, 0.0] * 4), cfg, 0.0)
    stats = worker.train([exp], 0.0)
    assert 0 < stats["ptx_loss"] < 20


def test_gae_on_a_vlm_values_each_row_with_its_images_and_fits_the_returns(folder, rows, tmp_path):
    """PPO with a critic on the demo VLM: the critic (the VLM's backbone with a value head of zeros, from the
    policy) values the rollout's rows with their images, GAE turns the rewards into advantages, the actor and the
    critic each take a step, the critic's values move toward the returns and its frozen tower stays."""
    from tasks.rl.actor import ActorWorker
    from tasks.rl.images import load_vision_prompts
    from tasks.rl.workers import CriticWorker

    data = write_rows(tmp_path / "p.jsonl", rows)
    cfg = rl_config(folder, data, advantage_estimator="gae", n_samples_per_prompt=1, rollout_batch_size=8)
    cfg = make_config(RLConfig, {**cfg.__dict__, "freeze_visual_encoder": True, "critic_learning_rate": 1e-3})
    prompts = load_vision_prompts(cfg, Inputs(), vision.load_processor(folder))
    actor, critic = ActorWorker(0, 1, None, 1), CriticWorker(0, 1, None, 1)
    actor.setup(cfg, 4)
    critic.setup(cfg, folder, 4)
    rollout = actor.generate_vision([(prompts.ids[i], prompts.images[i]) for i in range(8)])
    values = critic.values(rollout)
    assert values.shape == rollout.response_mask.shape and values.abs().max() == 0  # a head of zeros
    logprobs = actor.logprobs(rollout)
    exp = make_experience(rollout, logprobs, logprobs, values, torch.tensor([1.0, 0.0] * 4), cfg, 0.0)
    assert (exp.advantages * exp.action_mask).abs().sum() > 0
    tower = {n: p.detach().clone() for n, p in critic.engine.module.named_parameters() if ".visual." in f".{n}"}
    assert tower and actor.train([exp], 0.0)["grad_norm"] > 0

    def error(v):  # the values' squared distance to the returns, unclipped
        return (((v - exp.returns) ** 2) * exp.action_mask).sum() / exp.action_mask.sum()

    before = error(values)
    for _ in range(3):
        stats = critic.train([exp])
    assert stats["value_loss"] > 0 and error(critic.values(rollout)) < before
    assert all(torch.equal(p, tower[n]) for n, p in critic.engine.module.named_parameters() if n in tower)


def test_a_text_critic_for_a_vlm_policy_is_refused_naming_the_fix(folder, rows, tmp_path):
    from tasks.data import demo
    from tasks.rl.images import vision_setup

    demo.build_base_model(demo.build_tokenizer()).save_pretrained(tmp_path / "text")
    data = write_rows(tmp_path / "p.jsonl", rows)
    cfg = make_config(RLConfig, _flags(folder, data, critic_pretrain=str(tmp_path / "text")))
    with pytest.raises(ConfigError, match="^critic_pretrain: .* is a text model, which cannot value a vision-language"):
        vision_setup(cfg, Inputs(), folder)
    cfg, tokenizer, prompts = vision_setup(make_config(RLConfig, _flags(folder, data)), Inputs(), folder)
    assert cfg.max_images_per_prompt == 1 and len(prompts.images) == len(rows) and tokenizer.pad_token_id is not None


def test_a_rollout_engine_of_its_own_generates_from_the_images_and_takes_the_actors_weights(folder, rows, tmp_path):
    """--async_train on a vision-language policy: the transformers engine of its own (RolloutEngineWorker) generates
    from each prompt's images, tags the tokens with its weight version, and after the actor's full weights arrive
    (ActorWorker.engine_state) its log-probabilities are the trained actor's."""
    from tasks.rl.actor import ActorWorker
    from tasks.rl.images import load_vision_prompts
    from tasks.rl.workers import RolloutEngineWorker

    cfg = rl_config(folder, write_rows(tmp_path / "p.jsonl", rows), async_train=True)
    prompts = load_vision_prompts(cfg, Inputs(), vision.load_processor(folder))
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
