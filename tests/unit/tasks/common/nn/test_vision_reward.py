"""The reward model and DPO/KTO on a vision-language model (issue 54): pairs whose prompt carries images, the value
head and its saved folder, the policy's and reference's log-probabilities with the images, the frozen tower and LoRA
(CPU, each stage's worker in a DeepSpeed world of one, no Ray). Tests taking `vlm_folder` run on both demo families (the
~0.14 M-parameter Qwen2-VL and the ~0.12 M-parameter LLaVA), `qwen_vlm_folder`'s on Qwen2-VL alone."""

import json

import datasets
import pytest
import torch

from tasks.common.config import ConfigError, make_config
from tasks.common.nn import lora, models, vision
from tasks.common.nn.images import decode_image
from tasks.common.nn.losses import bradley_terry_loss
from tasks.common.nn.vision_family import family_of
from tasks.common.nn.vision_pairs import tokenize_vlm_examples, vlm_summed_logps
from tasks.common.nn.vision_reward import VisionRewardModel, merge_lora_state, vlm_sequence_scores
from tasks.data import demo, demo_vlm

from tests.vlm_demo import in_tower, tower_parameters


def pairs(seed: int, n: int) -> list[dict]:
    """The demo's preference pairs: the shape's colour chosen, another colour rejected."""
    return demo_vlm.make_datasets(seed=seed, sizes={"preference": n})["preference"]


def test_the_demos_pairs_choose_the_colour_in_the_pixels():
    """demo_vlm's preference splits (the reward model's, DPO's, KTO's unpaired one) are decided by the image alone."""
    rows = demo_vlm.make_datasets(seed=5, sizes={"preference": 8, "unpaired": 8})
    for row in rows["preference"]:
        colours = set(decode_image(row["images"][0]).getdata())
        assert demo_vlm.COLOURS[row["chosen"]] in colours and demo_vlm.COLOURS[row["rejected"]] not in colours
        assert row["prompt"] == demo_vlm.PROMPT
    labels = [r["label"] for r in rows["unpaired"]]
    assert labels.count(True) == labels.count(False) == 4
    for row in rows["unpaired"]:
        shown = demo_vlm.COLOURS[row["completion"]] in set(decode_image(row["images"][0]).getdata())
        assert shown == row["label"]


def write(tmp_path, name: str, rows: list[dict]) -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tokenized(processor, rows, max_len=64, split="preference"):
    table = datasets.Dataset.from_list(rows)
    return tokenize_vlm_examples(table, processor, "prompt", ["chosen", "rejected"], "images", True, max_len, split)


# ---------------------------------------------------------------- data


def test_a_pairs_sides_share_the_prompts_images_and_a_long_pair_is_dropped_not_cut(qwen_vlm_folder):
    processor = vision.load_processor(qwen_vlm_folder)
    rows = pairs(0, 3)
    rows[1] = {**rows[1], "chosen": "x" * 80}  # too long on one side: the whole pair goes
    prompts, responses, images, kept = tokenized(processor, rows)
    assert kept == [0, 2] and images == [rows[0]["images"], rows[2]["images"]]
    assert all(p.count(processor.image_token_id) == 4 for p in prompts)  # placeholders expanded, never cut
    assert [len(r) for r in responses] == [2, 2] and all(len(r[0]) == 2 for r in responses)  # letter + <|im_end|>


def test_a_row_whose_images_and_placeholders_differ_is_named_with_the_fix(qwen_vlm_folder):
    processor = vision.load_processor(qwen_vlm_folder)
    rows = pairs(0, 3)
    rows[1] = {**rows[1], "prompt": "<image><image>" + demo_vlm.PROMPT}
    with pytest.raises(
        ConfigError, match=r"^images: row 2 of preference has 1 image\(s\) and 3 <image> tag.*one <image> tag"
    ):
        tokenized(processor, rows)


# ---------------------------------------------------------------- the value head


def test_merge_lora_state_is_peft_s_own_merge():
    """The merge the reward model saves with (W + α/r · B·A) gives what peft's merge_and_unload gives."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3, bias=False))
    peft_model = get_peft_model(net, LoraConfig(r=2, lora_alpha=6, target_modules=["0", "2"]))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.data.normal_()
    state = {k.removeprefix("base_model.model."): v for k, v in peft_model.state_dict().items()}
    merged = merge_lora_state(state, 6 / 2)
    expected = peft_model.merge_and_unload().state_dict()
    assert merged.keys() == expected.keys() == {"0.weight", "0.bias", "2.weight"}
    assert all(torch.allclose(merged[k], expected[k], atol=1e-6) for k in expected)
    assert merge_lora_state(expected, None) == expected  # no adapters: as it is


@pytest.mark.parametrize("frozen", [False, True])
def test_the_reward_models_loss_reaches_the_vision_tower_unless_frozen(vlm_folder, frozen):
    """pixel_values reach the Bradley-Terry loss: every tower weight gets a gradient, none when frozen."""
    model, processor = VisionRewardModel.from_pretrained(vlm_folder), vision.load_processor(vlm_folder)
    if frozen:
        assert vision.freeze_visual_encoder(model) > 0
    prompts, responses, images, _ = tokenized(processor, pairs(0, 4))
    chosen, rejected = ([p + r[k] for p, r in zip(prompts, responses)] for k in (0, 1))
    pad = processor.tokenizer.pad_token_id
    scores = vlm_sequence_scores(model, processor, chosen + rejected, images + images, pad, "cpu")
    loss = bradley_terry_loss(scores[:4], scores[4:])
    loss.backward()
    tower = [p.grad for p in tower_parameters(model.backbone, read=True)]
    if frozen:
        assert all(g is None for g in tower)
    else:
        assert all(g is not None for g in tower) and sum(g.abs().sum() for g in tower) > 0
    assert model.score.weight.grad.abs().sum() > 0
    # The score reads the pixels: one sequence under two images scores twice.
    other = next(i for i in images if i != images[0])
    twice = vlm_sequence_scores(model, processor, [chosen[0]] * 2, [images[0], other], pad, "cpu")
    assert not torch.isclose(twice[0], twice[1])


def reward_flags(tmp_path, vlm_folder, **extra) -> dict:
    """The stage's flags on 16 of the demo's pairs (a plain file: its held-out split is the same file)."""
    return {
        "output": str(tmp_path / "out"),
        "pretrain": vlm_folder,
        "dataset": write(tmp_path, "pairs", pairs(1, 16)),
        "apply_chat_template": True,
        "train_batch_size": 8,
        "micro_train_batch_size": 4,
        "max_steps": 4,
        "lr_warmup_steps": 0,
        "learning_rate": 3e-3,
        **extra,
    }


def text_model(tmp_path) -> str:
    from tasks.data.__main__ import save_tokenizer

    path = tmp_path / "text"
    tokenizer = demo.build_tokenizer()
    demo.build_base_model(tokenizer).save_pretrained(path)
    save_tokenizer(tokenizer, path)
    return str(path)


def test_the_reward_model_worker_trains_a_vlm_with_lora_and_a_frozen_tower_and_saves_a_loadable_model(
    vlm_folder, tmp_path
):
    """The reward-model stage's worker on the demo VLM: LoRA adapters train with the value head, the tower stays as
    it is, and the saved folder (LoRA merged in) loads back with VisionRewardModel scoring as the trained model."""
    from tasks.reward_model.config import RewardModelConfig
    from tasks.reward_model.trainer import RewardModelWorker

    flags = reward_flags(tmp_path, vlm_folder, lora_rank=4, lora_alpha=8, freeze_visual_encoder=True)
    worker = RewardModelWorker(0, 1, None, 1)
    info = worker.setup(make_config(RewardModelConfig, flags))
    assert info["vision"] and info["pairs"] == info["eval_pairs"] == 16 and info["dropped"] == 0
    module = worker.engine.module
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert "score.weight" in trainable and trainable - {"score.weight"}
    assert all("lora_" in n and not in_tower(n) for n in trainable - {"score.weight"})
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    stats = [worker.train_step() for _ in range(4)]
    assert all(0 < s["loss"] < 2 and 0 <= s["accuracy"] <= 1 for s in stats)
    after = dict(module.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert "score.weight" in changed and any("language_model" in n and "lora_B" in n for n in changed)
    assert not any(in_tower(n) for n in changed)  # the tower, its LoRA adapters included
    chosen, rejected = worker.score_held_out()
    assert len(chosen) == len(rejected) == 16
    worker.save_model(str(tmp_path / "saved"), 0.5, 2.0)
    saved = str(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert (config["reward_mean"], config["reward_std"], config["value_head"]) == (0.5, 2.0, "value_head.safetensors")
    assert models.is_vision_model(saved) and family_of(vision.load_processor(saved)) is family_of(worker.processor)
    loaded = VisionRewardModel.from_pretrained(saved).eval()
    assert not any("lora_" in n for n, _ in loaded.named_parameters())  # merged: a plain backbone
    module.eval()
    with torch.no_grad():
        ids, images = worker.eval_chosen[:3], worker.eval_images[:3]
        pad = worker.tokenizer.pad_token_id
        trained = vlm_sequence_scores(module, worker.processor, ids, images, pad, "cpu")
        reloaded = vlm_sequence_scores(loaded, vision.load_processor(saved), ids, images, pad, "cpu")
    assert torch.allclose(trained, reloaded, atol=1e-5)
    assert torch.allclose(torch.tensor(chosen[:3]), trained, atol=1e-5)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_reward_model_trained_under_zero3_saves_whole_weights_that_score_as_it_did(
    qwen_vlm_folder, tmp_path, lora_rank
):
    """ZeRO-3 holds each parameter in shards: the save gathers them (DeepSpeed's consolidated state dict, the
    adapters merged from it), and the folder scores the held-out pairs as the trained engine did. With activation
    checkpointing: the backbone's blocks recompute in the backward pass."""
    from tasks.reward_model.config import RewardModelConfig
    from tasks.reward_model.trainer import RewardModelWorker

    flags = reward_flags(
        tmp_path, qwen_vlm_folder, zero_stage=3, max_steps=2, lora_rank=lora_rank, gradient_checkpointing=True
    )
    worker = RewardModelWorker(0, 1, None, 1)
    worker.setup(make_config(RewardModelConfig, flags))
    assert worker.engine.module.backbone.is_activation_checkpointing
    for _ in range(2):
        worker.train_step()
    chosen, _ = worker.score_held_out()
    worker.save_model(str(tmp_path / "saved"), 0.0, 1.0)
    saved = str(tmp_path / "saved")
    loaded = VisionRewardModel.from_pretrained(saved).eval()
    with torch.no_grad():
        pad = worker.tokenizer.pad_token_id
        scores = vlm_sequence_scores(
            loaded, vision.load_processor(saved), worker.eval_chosen[:4], worker.eval_images[:4], pad, "cpu"
        )
    assert torch.allclose(torch.tensor(chosen[:4]), scores, atol=1e-5)


def test_the_reward_model_refuses_packing_a_vlm_and_a_text_model_with_images(qwen_vlm_folder, tmp_path):
    from tasks.reward_model.config import RewardModelConfig
    from tasks.reward_model.trainer import RewardModelWorker

    flags = reward_flags(tmp_path, qwen_vlm_folder, packing_samples=True)
    worker = RewardModelWorker(0, 1, None, 1)
    with pytest.raises(
        ConfigError, match="^packing_samples: .* is a vision-language model, whose rows cannot be packed"
    ):
        worker.setup(make_config(RewardModelConfig, flags))
    text_flags = {**flags, "pretrain": text_model(tmp_path), "packing_samples": False}
    with pytest.raises(
        ConfigError, match=r"^pretrain: .* is a text model .* row 1 of preference has images in 'images'"
    ):
        worker.setup(make_config(RewardModelConfig, text_flags))
    with pytest.raises(ConfigError, match="^freeze_visual_encoder: .* is a text model"):
        worker.setup(make_config(RewardModelConfig, {**text_flags, "freeze_visual_encoder": True}))


# ---------------------------------------------------------------- DPO / KTO


@pytest.mark.parametrize("frozen", [False, True])
def test_the_dpo_loss_reaches_the_vision_tower_unless_frozen(vlm_folder, frozen):
    """The policy's log-probabilities carry the images: the DPO loss gives every tower weight a gradient, none
    when frozen; the reference's (a frozen copy) take the same images."""
    from tasks.preference.losses import dpo_loss

    policy, processor = vision.load_vision_lm(vlm_folder), vision.load_processor(vlm_folder)
    reference = vision.load_vision_lm(vlm_folder).requires_grad_(False)
    if frozen:
        vision.freeze_visual_encoder(policy)
    with torch.no_grad():  # one step away from the reference, so the loss is not at its symmetric point
        for p in policy.model.language_model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    prompts, responses, images, _ = tokenized(processor, pairs(0, 4))
    pad = processor.tokenizer.pad_token_id
    side = lambda model, k: vlm_summed_logps(model, processor, prompts, [r[k] for r in responses], images, pad, "cpu")  # noqa: E731
    with torch.no_grad():
        ref = [side(reference, k) for k in (0, 1)]
    loss, _, _ = dpo_loss(side(policy, 0), side(policy, 1), *ref, beta=0.1)
    loss.backward()
    tower = [p.grad for p in tower_parameters(policy, read=True)]
    if frozen:
        assert all(g is None for g in tower)
    else:
        assert all(g is not None for g in tower) and sum(g.abs().sum() for g in tower) > 0
    # The log-probability of an answer depends on the image it is asked of.
    other = [next(i for i in images if i != images[0])] * len(images)
    with torch.no_grad():
        assert not torch.allclose(
            side(reference, 0),
            vlm_summed_logps(reference, processor, prompts, [r[0] for r in responses], other, pad, "cpu"),
        )


def preference_flags(tmp_path, vlm_folder, method: str, rows: list[dict], **extra) -> dict:
    return {
        "output": str(tmp_path / "out"),
        "pretrain": vlm_folder,
        "method": method,
        "dataset": write(tmp_path, method, rows),
        "apply_chat_template": True,
        "train_batch_size": 8,
        "micro_train_batch_size": 4,
        "max_steps": 2,
        "lr_warmup_steps": 0,
        "learning_rate": 1e-3,
        "max_len": 40,
        **extra,
    }


def test_the_dpo_worker_trains_lora_on_a_vlm_against_its_own_base_and_saves_a_merged_vlm(vlm_folder, tmp_path):
    """DPO's worker with LoRA and a frozen tower: the reference is the policy's base with its adapters off (which
    scores as the untouched VLM), only language-model adapters train, and the merged output loads as a VLM with its
    processor (lora.merge_adapter picks the image-text class)."""
    from tasks.preference.config import PreferenceConfig
    from tasks.preference.trainer import PreferenceWorker

    flags = preference_flags(tmp_path, vlm_folder, "dpo", pairs(3, 16), lora_rank=4, lora_alpha=8, max_len=64)
    cfg = make_config(PreferenceConfig, {**flags, "freeze_visual_encoder": True, "merge_lora": True})
    worker = PreferenceWorker(0, 1, None, 1)
    info = worker.setup(cfg)
    assert info["examples"] == 16 and info["dropped"] == 0 and isinstance(worker.reference, lora.FrozenBase)
    trainable = [n for n, p in worker.engine.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and not in_tower(n) for n in trainable)
    stats = [worker.train_step() for _ in range(2)]
    assert all(0 <= s["reward_accuracy"] <= 1 for s in stats)
    base = vision.load_vision_lm(vlm_folder)
    rows = [0, 1, 2]
    with torch.no_grad():
        p, r, i = worker._sequences(rows, "chosen")
        expected = vlm_summed_logps(base, worker.processor, p, r, i, worker.tokenizer.pad_token_id, "cpu")
    assert torch.allclose(worker._reference_logps(rows, "chosen"), expected, atol=1e-5)
    worker.save_model(str(tmp_path / "saved"))
    saved = str(tmp_path / "saved")
    assert models.is_vision_model(saved) and family_of(vision.load_processor(saved)) is family_of(worker.processor)
    merged = vision.load_vision_lm(saved)
    tower = {n: p for n, p in base.named_parameters() if in_tower(n)}
    assert tower and all(torch.equal(tower[n], q) for n, q in merged.named_parameters() if in_tower(n))


def test_a_vlm_lora_adapter_output_merges_into_a_vlm_with_its_processor(qwen_vlm_folder, tmp_path):
    """What resolve_model makes of an adapter output of a VLM stage: the base with the adapter merged in, loadable as
    a VLM, with the processor's files beside the tokenizer's."""
    from tasks.preference.config import PreferenceConfig

    cfg = make_config(PreferenceConfig, preference_flags(tmp_path, qwen_vlm_folder, "dpo", pairs(3, 4), lora_rank=4))
    model = lora.apply_lora(vision.load_vision_lm(qwen_vlm_folder), cfg)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(std=0.1)
    adapter = tmp_path / "adapter"
    lora.save_peft(model, lora.trainable_state(model), adapter, merge=False, base_uri=qwen_vlm_folder)
    vision.load_processor(qwen_vlm_folder).save_pretrained(adapter)
    merged = lora.merged_checkpoint(adapter, qwen_vlm_folder)
    assert models.is_vision_model(str(merged)) and (merged / "processor_config.json").is_file()
    processor = vision.load_processor(str(merged))
    reloaded = vision.load_vision_lm(str(merged))
    prompts, responses, images, _ = tokenized(processor, pairs(0, 2))
    pad = processor.tokenizer.pad_token_id
    with torch.no_grad():
        want = vlm_summed_logps(model, processor, prompts, [r[0] for r in responses], images, pad, "cpu")
        got = vlm_summed_logps(reloaded, processor, prompts, [r[0] for r in responses], images, pad, "cpu")
    assert torch.allclose(want, got, atol=1e-4)


def test_the_kto_worker_on_a_vlm_keeps_each_label_with_its_row_when_a_long_row_is_dropped(qwen_vlm_folder, tmp_path):
    """KTO with the reference's log-probabilities taken once (--ref_offload): a row dropped as too long takes its
    label with it, and a mismatched pair keeps its prompt's images."""
    from tasks.preference.config import PreferenceConfig
    from tasks.preference.trainer import PreferenceWorker

    rows = demo_vlm.make_datasets(seed=4, sizes={"unpaired": 16})["unpaired"]
    rows[0] = {**rows[0], "completion": "x" * 60}  # longer than max_len with its prompt: dropped, label and all
    cfg = make_config(PreferenceConfig, preference_flags(tmp_path, qwen_vlm_folder, "kto", rows, ref_offload=True))
    worker = PreferenceWorker(0, 1, None, 1)
    info = worker.setup(cfg)
    assert info["examples"] == 15 and info["dropped"] == 1 and worker.reference is None
    assert worker.desirable.tolist() == [r["label"] for r in rows[1:]]
    assert worker._sequences([0], "mismatched")[2] == [rows[1]["images"]]
    stats = [worker.train_step() for _ in range(2)]
    assert all(s["loss"] > 0 for s in stats)
    text_flags = preference_flags(tmp_path, text_model(tmp_path), "kto", rows)
    with pytest.raises(ConfigError, match=r"^pretrain: .* is a text model .* row 1 of unpaired has images"):
        worker.setup(make_config(PreferenceConfig, text_flags))


def test_sft_with_lora_and_a_frozen_tower_trains_no_adapter_inside_the_tower(vlm_folder, tmp_path):
    """LoRA's all-linear reaches the tower's layers too: --freeze_visual_encoder freezes the adapters there as well,
    in SFT as in the reward model and DPO/KTO."""
    from tasks.sft.config import SFTConfig
    from tasks.sft.trainer import SFTWorker

    rows = demo_vlm.make_datasets(seed=1, sizes={"sft": 8})["sft"]
    flags = {"output": str(tmp_path / "out"), "pretrain": vlm_folder, "dataset": write(tmp_path, "sft", rows)}
    flags |= {"apply_chat_template": True, "train_batch_size": 8, "max_steps": 1, "lora_rank": 4}
    worker = SFTWorker(0, 1, None, 1)
    worker.setup(make_config(SFTConfig, {**flags, "freeze_visual_encoder": True}))
    trainable = [n for n, p in worker.engine.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and not in_tower(n) for n in trainable)


# ---------------------------------------------------------------- scoring rollouts (RL's reward workers, eval)


def save_vision_reward_model(vlm_folder, out, mean: float = 0.0, std: float = 1.0, seed: int = 0) -> str:
    """A reward model as the reward_model stage saves one on the demo VLM (the backbone, a value head drawn with
    `seed`, the processor, reward_mean and reward_std in config.json), untrained: scoring needs its form, not skill."""
    torch.manual_seed(seed)
    model = VisionRewardModel.from_pretrained(vlm_folder)
    model.config.reward_mean, model.config.reward_std = mean, std
    model.save_pretrained(str(out))
    vision.load_processor(vlm_folder).save_pretrained(str(out))
    return str(out)


def reward_rollout(processor, rows):
    """A Rollout as RL's and eval's engines give one, on four of the demo's rows: prompts of two lengths (left-padded),
    responses of four lengths (right-padded), each row with its image; and each row's ids unpadded."""
    from tasks.common.nn.engines.rollout import to_rollout

    tok = processor.tokenizer
    texts = [demo_vlm.PROMPT, "<image>which colour is it?", demo_vlm.PROMPT, demo_vlm.PROMPT]
    prompts = [vision.encode_vlm_prompt(processor, t, r["images"])["input_ids"] for t, r in zip(texts, rows)]
    responses = [tok(t, add_special_tokens=False)["input_ids"] for t in ("r", "gb<|im_end|>", "y<|im_end|>", "bbbb")]
    rollout = to_rollout(prompts, responses, None, tok.pad_token_id, [r["images"] for r in rows])
    return rollout, texts, [p + r for p, r in zip(prompts, responses)]


def test_a_vlm_reward_model_scores_rollout_rows_with_their_images_as_it_scores_each_row_alone(vlm_folder, tmp_path):
    """RewardModels on the reward_model stage's VLM output: each rollout row's score (prompt + response + pixels, in the
    rollout's padding) is the value head at the row's last token computed on that row alone, unpadded, as the stage
    scored its pairs; standardised, it is (score - reward_mean) / reward_std; another image, another score."""
    from tasks.common.nn.rewards import RewardModels, build_reward_batch

    rm = save_vision_reward_model(vlm_folder, tmp_path / "rm", mean=1.0, std=2.0)
    processor, rows = vision.load_processor(rm), demo_vlm.make_datasets(seed=2, sizes={"prompts": 4})["prompts"]
    rollout, texts, alone = reward_rollout(processor, rows)
    assert rollout.attention_mask[:, 0].tolist() == [0, 1, 0, 0] and rollout.response_mask.sum(1).tolist() == [
        1,
        3,
        2,
        4,
    ]
    batch = build_reward_batch(rollout, processor.tokenizer, texts, [r["label"] for r in rows])
    assert batch.images == [r["images"] for r in rows]
    model, pad = VisionRewardModel.from_pretrained(rm).eval(), processor.tokenizer.pad_token_id
    with torch.no_grad():
        direct = torch.cat(
            [vlm_sequence_scores(model, processor, [ids], [r["images"]], pad, "cpu") for ids, r in zip(alone, rows)]
        )
    raw = RewardModels(rm, normalize=False, batch_size=3).score(batch)  # two chunks: 3 rows, then 1
    assert torch.allclose(raw, direct, atol=1e-5), (raw, direct)
    assert torch.allclose(RewardModels(rm).score(batch), (direct - 1.0) / 2.0, atol=1e-5)
    other = next(
        r["images"]
        for r in demo_vlm.make_datasets(seed=3, sizes={"prompts": 8})["prompts"]
        if r["label"] != rows[0]["label"]
    )
    batch.images = [other, *batch.images[1:]]
    moved = RewardModels(rm, normalize=False).score(batch)
    assert not torch.isclose(moved[0], raw[0]) and torch.allclose(moved[1:], raw[1:], atol=1e-5)


def test_a_text_reward_model_or_a_vlm_without_a_value_head_is_refused_for_a_vlm_naming_the_fix(vlm_folder, tmp_path):
    """What would score a VLM's rows without their images, or with a head nobody trained, is refused in one line."""
    from tasks.common.nn.rewards import RewardError, RewardModels, build_reward_batch
    from tasks.common.nn.vision_reward import refuse_unfit_reward_models

    processor = vision.load_processor(vlm_folder)
    text = tmp_path / "text-rm"  # a text model on the VLM's own tokenizer: only the images tell it apart
    demo.build_base_model(processor.tokenizer).save_pretrained(text)
    with pytest.raises(
        ConfigError,
        match=r"^reward_pretrain: .*text-rm is a text reward model, which cannot see the images of a vision-language model's prompts; FIX$",
    ):
        refuse_unfit_reward_models(f"{save_vision_reward_model(vlm_folder, tmp_path / 'rm')},{text}", "FIX")
    with pytest.raises(
        ConfigError, match=r"^reward_pretrain: .* is a vision-language model with no value head .*; FIX$"
    ):
        refuse_unfit_reward_models(vlm_folder, "FIX")
    with pytest.raises(RewardError, match=r"^reward_pretrain: .* is a vision-language model with no value head"):
        RewardModels(vlm_folder)
    rows = demo_vlm.make_datasets(seed=2, sizes={"prompts": 4})["prompts"]
    rollout, texts, _ = reward_rollout(processor, rows)
    batch = build_reward_batch(rollout, processor.tokenizer, texts)
    with pytest.raises(RewardError, match=r"^reward_pretrain: .* is a text reward model and the rows carry images"):
        RewardModels(str(text)).score(batch)
