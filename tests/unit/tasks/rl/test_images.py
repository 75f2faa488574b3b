"""RL and eval on a vision-language model (issue 54), on CPU with the demo's tiny VLMs built offline, each family
(`vlm_folder`: Qwen2-VL and LLaVA): the transformers engine generating from the pixels, the log-prob passes scoring the
same rows with their images, the guards and the refusals. The RL workers on a VLM are in test_images_workers.py;
the vLLM path's pure parts in tests/unit/tasks/common/nn/engines/test_vllm_vision.py; the stages on Ray and the
learning check in tests/e2e/test_vlm_stages.py."""

import pytest
import torch

from tasks.common.config import ConfigError, make_config
from tasks.common.nn import vision
from tasks.common.nn.engines import make_engine
from tasks.common.nn.engines.rollout import concat_rollouts
from tasks.common.nn.vision_family import QWEN2_VL, check_placeholder_tokens, family_of, per_row
from tasks.common.nn.vision_passes import VisionRows, without_tokens
from tasks.data import demo_vlm
from tasks.rl.config import RLConfig
from tasks.rl.experience import make_experience, response_logprobs
from tasks.rl.workers import trimmed

from tests.vlm_demo import StageInputs, encoded, rl_flags, write_rows


@pytest.fixture(scope="module")
def rows():
    return demo_vlm.make_datasets(seed=0, sizes={"prompts": 8})["prompts"]


def test_the_engine_samples_from_the_pixels_and_reports_the_log_probs_the_trainer_computes(vlm_folder, rows):
    """Prompts of two lengths (left padding moves the image), sampled and greedy: the engine's log-probabilities of
    its tokens are the training pass's on the same rows with the same images (the family's positions: Qwen2-VL's
    M-RoPE computed by the model in both, LLaVA's counted from the mask), and no image placeholder id is sampled."""
    processor, model = vision.load_processor(vlm_folder), vision.load_vision_lm(vlm_folder).eval()
    prompts = [r["prompt"] if i % 2 else "<image>which colour is it?" for i, r in enumerate(rows)]
    ids, images = encoded(processor, rows, prompts), [r["images"] for r in rows]
    # A prompt of two images, and one of none: each row's images in order, positions per row.
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


def test_the_checkpoints_own_generation_settings_do_not_change_what_the_engine_samples(vlm_folder, rows):
    """A checkpoint's generation_config (Qwen2-VL-Instruct's carries top_k 1 and a repetition penalty) is not the
    policy: the engine samples from the model's distribution at the rollout's temperature whatever it says, so its
    log-probabilities stay the trainer's and the samples of one prompt differ."""
    processor, model = vision.load_processor(vlm_folder), vision.load_vision_lm(vlm_folder).eval()
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


def test_a_banned_id_is_never_sampled_even_where_the_model_prefers_it(vlm_folder, rows):
    """The placeholder ids are banned in the engine and removed from the policy the trainer scores: with the image
    token's bias raised far above every other, the engine still never samples it."""
    processor, model = vision.load_processor(vlm_folder), vision.load_vision_lm(vlm_folder).eval()
    with torch.no_grad():
        model.lm_head.weight[processor.image_token_id] *= 50
    engine = make_engine(
        "transformers", processor.tokenizer, module=model, device=torch.device("cpu"), processor=processor
    )
    rollout = engine.generate(encoded(processor, rows[:4]), 4, images=[r["images"] for r in rows[:4]])
    assert processor.image_token_id not in rollout.responses[rollout.response_mask.bool()].tolist()
    logits = torch.zeros(2, 5)
    assert without_tokens(logits, torch.tensor([1, 3]))[0].tolist() == [0.0, -1e4, 0.0, -1e4, 0.0]


def test_placeholder_tokens_are_checked_against_the_images_before_the_model_sees_them(vlm_folder, rows):
    processor = vision.load_processor(vlm_folder)
    passes, family = VisionRows.of(processor), family_of(processor)
    ids = encoded(processor, rows[:2])
    if family is QWEN2_VL:  # 28 px images, 7 px patches merged 2 x 2: 4 tokens each; a smaller grid, fewer
        grids = {"image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4], [1, 2, 2]])}
        assert per_row(QWEN2_VL.tokens_per_image(processor, grids), [2, 1]) == [8, 1]
    else:  # LLaVA: every image its crop's 16 patches
        pixels = {"pixel_values": torch.zeros(3, 3, 28, 28)}
        assert per_row(family.tokens_per_image(processor, pixels), [2, 1]) == [32, 16]
    n = ids[0].count(processor.image_token_id)
    first = ids[1].index(processor.image_token_id)
    cut = ids[1][:first] + ids[1][first + 2 :]  # two of the second row's placeholders lost, as a truncation would
    seqs, mask = _prompt_batch([ids[0], cut], processor)
    with pytest.raises(
        ValueError,
        match=rf"^images: rollout row 1 has {n - 2} image placeholder token\(s\) and its images expand to {n}",
    ):
        passes.inputs(seqs, mask, [rows[0]["images"], rows[1]["images"]])
    with pytest.raises(ValueError, match=f"rollout row 0 has {n} .* expand to 0"):
        passes.inputs(*_prompt_batch(ids[:1], processor), [[]])
    check_placeholder_tokens([4, 0], [4, 0])


def test_rollouts_and_experience_keep_each_rows_images_through_select_concat_minibatch_and_trim(vlm_folder, rows):
    processor, model = vision.load_processor(vlm_folder), vision.load_vision_lm(vlm_folder).eval()
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
    cfg = make_config(RLConfig, rl_flags(vlm_folder, "x", advantage_estimator="group_norm", n_samples_per_prompt=2))
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


def test_prompts_keep_their_images_drop_what_is_too_long_and_name_a_row_whose_counts_differ(
    qwen_vlm_folder, rows, tmp_path
):
    """On Qwen2-VL (the lengths are its 4 tokens an image)."""
    from tasks.rl.images import images_limit, load_vision_prompts

    processor = vision.load_processor(qwen_vlm_folder)
    long = {**rows[1], "prompt": "<image>" + "which colour is the shape in this picture? " * 3}
    data = write_rows(tmp_path / "p.jsonl", [rows[0], long, rows[2]])
    cfg = make_config(RLConfig, rl_flags(qwen_vlm_folder, data, prompt_max_len=40))
    prompts = load_vision_prompts(cfg, StageInputs(), processor)
    assert prompts.dropped == 1 and prompts.images == [rows[0]["images"], rows[2]["images"]]
    assert prompts.labels == [rows[0]["label"], rows[2]["label"]] and prompts.truncated == 0
    assert all(i.count(processor.image_token_id) == 4 for i in prompts.ids)
    assert images_limit(cfg, prompts) == 1
    limited = make_config(RLConfig, rl_flags(qwen_vlm_folder, data, max_images_per_prompt=1))
    assert images_limit(limited, prompts) == 1
    prompts.images[0] = prompts.images[0] * 2
    with pytest.raises(ConfigError, match="^max_images_per_prompt: a prompt carries 2 images, over the limit of 1"):
        images_limit(limited, prompts)
    two_tags = write_rows(tmp_path / "bad.jsonl", [rows[0], {**rows[1], "prompt": "<image><image>colour?"}])
    with pytest.raises(ConfigError, match=r"^images: row 2 has 1 image\(s\) and 2 <image> tag.*--image_key 'images'"):
        load_vision_prompts(make_config(RLConfig, rl_flags(qwen_vlm_folder, two_tags)), StageInputs(), processor)
    with pytest.raises(ConfigError, match="^prompt_max_len: all 3 prompts with their image tokens are longer than 8"):
        load_vision_prompts(
            make_config(RLConfig, rl_flags(qwen_vlm_folder, data, prompt_max_len=8)), StageInputs(), processor
        )


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
    ],
)
def test_what_rl_does_not_do_on_a_vlm_is_refused_in_one_line(flags, message):
    from tasks.rl.images import refuse_for_vision

    gae = "lora_rank" in flags or "save_value_network" in flags
    estimator = {} if gae else {"advantage_estimator": "group_norm", "n_samples_per_prompt": 2}
    cfg = make_config(RLConfig, rl_flags("m", "p", **estimator, **flags))
    with pytest.raises(ConfigError, match=message):
        refuse_for_vision(cfg)
    refuse_for_vision(make_config(RLConfig, rl_flags("m", "p", advantage_estimator="rloo", n_samples_per_prompt=2)))
    refuse_for_vision(make_config(RLConfig, rl_flags("m", "p")))  # gae: the VLM critic (tasks/rl/vision_critic.py)


def test_eval_takes_a_vlm_reward_model_and_refuses_a_text_one_naming_the_fix(vlm_folder, tmp_path):
    """Eval's reward_mean on a vision-language baseline: the reward_model stage's VLM output is taken (the eval worker
    scores each sample with its images through RewardModels), a text reward model refused in one line."""
    from tasks.data import demo
    from tasks.eval.config import EvalConfig
    from tasks.eval.images import vision_rows

    from tests.unit.tasks.common.nn.test_vision_reward import save_vision_reward_model

    demo.build_base_model(demo.build_tokenizer()).save_pretrained(tmp_path / "text")
    flags = {"output": "/tmp/unused", "baseline": vlm_folder, "policy": vlm_folder, "dataset": "d"}
    text = make_config(EvalConfig, {**flags, "reward_pretrain": str(tmp_path / "text")})
    with pytest.raises(
        ConfigError, match="^reward_pretrain: .* is a text reward model, .*; .* or drop --reward_pretrain"
    ):
        vision_rows(vlm_folder, text)
    rm = save_vision_reward_model(vlm_folder, tmp_path / "rm")
    assert vision_rows(vlm_folder, make_config(EvalConfig, {**flags, "reward_pretrain": rm})) is not None
