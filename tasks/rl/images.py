"""The RL stage on a vision-language policy (issue 54): its prompts with their images, and the flags it refuses.

    cfg, tokenizer, prompts = vision_setup(cfg, run, path)   # the controller's start on a VLM policy:
    refuse_for_vision(cfg)                               #   one line naming the flag and the fix, before any worker
    prompts = load_vision_prompts(cfg, run, processor)   #   Prompts with .images; too long: dropped, never cut
    images_limit(cfg, prompts)                           #   what a vLLM engine is sized for (--max_images_per_prompt)

The prompts flow through the rollout with their images (Rollout.images, Experience.images): the engines generate
from the pixels, and every log-prob pass (old, reference, update) feeds the same images, the model computing its
own positions (tasks/common/nn/vision_passes.py). The reward models (--reward_pretrain) are the reward_model
stage's on a VLM (tasks/common/nn/vision_reward.py), scoring each rollout row with its images; a text reward model
is refused. Every estimator: GAE's critic is the VLM with a value head (tasks/rl/vision_critic.py), started from
--critic_pretrain (a VLM), else the first reward model (its backbone and head, as a text critic starts), else the
policy (a head of zeros).
"""

from __future__ import annotations

import dataclasses

from tasks.common.config import ConfigError
from tasks.common.nn import data, vision
from tasks.common.nn.models import is_vision_model, resolve_model
from tasks.common.nn.vision_reward import refuse_unfit_reward_models
from tasks.common.stage import StageRun
from tasks.rl.config import GROUP_ESTIMATORS, RLConfig, uses_critic
from tasks.rl.prompts import Prompts

CRITIC_FREE = ", ".join(["group_norm (GRPO)", *[e for e in GROUP_ESTIMATORS if e != "group_norm"], "reinforce"])
REWARD_MODEL_FIX = (
    "pass the reward_model stage's output trained on this vision-language model (it scores prompt + response + "
    "pixels), or score with --remote_rm_url (a reward function file or endpoint)"
)


def refuse_for_vision(cfg: RLConfig) -> None:
    """What RL does not do on a vision-language policy yet, each refused in one line naming the fix."""
    problems = [
        (
            uses_critic(cfg.advantage_estimator) and bool(cfg.lora_rank),
            "lora_rank: a vision-language policy's critic (the VLM with a value head) trains in full; drop "
            f"--lora_rank, or use a critic-free estimator: --advantage_estimator {CRITIC_FREE}",
        ),
        (
            uses_critic(cfg.advantage_estimator) and cfg.save_value_network,
            "save_value_network: a vision-language policy's critic (the VLM with a value head) is not exported; "
            "drop --save_value_network",
        ),
        (
            cfg.packing_samples,
            "packing_samples: a vision-language policy's rows cannot be packed (each row's image features and "
            "positions are laid out for that row alone); drop --packing_samples",
        ),
        (
            bool(cfg.env_path),
            "env_path: an environment's observations carry no images; drop --env_path for a vision-language policy",
        ),
        (
            bool(cfg.over_sampling_batch_size),
            "over_sampling_batch_size: its request-by-request engine calls carry no images; drop "
            "--over_sampling_batch_size for a vision-language policy",
        ),
    ]
    for bad, message in problems:
        if bad:
            raise ConfigError(message)


def vision_setup(cfg: RLConfig, run: StageRun, path: str) -> tuple[RLConfig, object, Prompts]:
    """(the config with --max_images_per_prompt resolved, the tokenizer, the prompts with their images) of a
    vision-language policy at `path`, after refusing what RL does not do on one."""
    refuse_for_vision(cfg)
    if cfg.reward_pretrain and not cfg.remote_rm_url:  # scored with the images: VLM reward models only
        refuse_unfit_reward_models(cfg.reward_pretrain, REWARD_MODEL_FIX)
    if uses_critic(cfg.advantage_estimator) and cfg.critic_pretrain:
        critic = resolve_model(run.input("critic_pretrain", cfg.critic_pretrain))
        if not is_vision_model(critic):
            raise ConfigError(
                f"critic_pretrain: {cfg.critic_pretrain} is a text model, which cannot value a vision-language "
                "policy's rollouts; pass a vision-language model, or drop --critic_pretrain (the critic starts from the policy)"
            )
    processor = vision.load_processor(path)
    prompts = load_vision_prompts(cfg, run, processor)
    cfg = dataclasses.replace(cfg, max_images_per_prompt=images_limit(cfg, prompts))
    print(
        f"rl: a vision-language policy; prompts carry up to {cfg.max_images_per_prompt} image(s), "
        f"{prompts.dropped} dropped as longer than {cfg.prompt_max_len} tokens with their images",
        flush=True,
    )
    return cfg, processor.tokenizer, prompts


def refuse_for_text(cfg: RLConfig) -> None:
    """The vision flags on a text policy: refused rather than ignored."""
    if cfg.freeze_visual_encoder:
        raise ConfigError(
            f"freeze_visual_encoder: {cfg.pretrain} is a text model, with no vision tower; drop --freeze_visual_encoder"
        )


def load_vision_prompts(cfg: RLConfig, run: StageRun, processor) -> Prompts:
    """The prompts with their images (the --image_key column; none where a dataset has no such column), each
    image's placeholders expanded by the processor. A prompt whose placeholders and images differ in number is
    refused naming its row; one longer than prompt_max_len with its image tokens is dropped and counted (cutting
    would part the placeholders from their pixels)."""
    keys = [cfg.input_key] + ([cfg.label_key] if cfg.label_key else [])
    rows = data.load_rows(run.input("prompt_data", cfg.prompt_data), cfg.prompt_split, keys, cfg.max_samples)
    pictures = rows[cfg.image_key] if cfg.image_key in rows.column_names else [[]] * len(rows)
    labels = list(rows[cfg.label_key]) if cfg.label_key else [None] * len(rows)
    ids, texts, kept_labels, images, dropped = [], [], [], [], 0
    for number, (prompt, row_images, label) in enumerate(zip(rows[cfg.input_key], pictures, labels), 1):
        row_images = row_images or []
        try:
            enc = vision.encode_vlm_prompt(processor, prompt, row_images, cfg.apply_chat_template, row_id=number)
        except ConfigError:
            raise
        except ValueError as e:  # a count that differs, an image that does not decode: which row, and the fix
            raise ConfigError(f"{e} (images from the column --image_key {cfg.image_key!r})") from None
        if len(enc["input_ids"]) > cfg.prompt_max_len:
            dropped += 1
            continue
        ids.append(enc["input_ids"])
        texts.append(prompt)
        kept_labels.append(None if label is None else str(label))
        images.append(row_images)
    if not ids:
        raise ConfigError(
            f"prompt_max_len: all {len(rows)} prompts with their image tokens are longer than {cfg.prompt_max_len} "
            "tokens; raise --prompt_max_len (prompts with images are never cut)"
        )
    return Prompts(ids, texts, kept_labels, 0, None, images=images, dropped=dropped)


def images_limit(cfg: RLConfig, prompts: Prompts) -> int:
    """--max_images_per_prompt, or the data's most when 0; a prompt over an explicit limit is refused."""
    most = max((len(i) for i in prompts.images), default=0)
    if cfg.max_images_per_prompt and most > cfg.max_images_per_prompt:
        raise ConfigError(
            f"max_images_per_prompt: a prompt carries {most} images, over the limit of {cfg.max_images_per_prompt}; "
            "raise --max_images_per_prompt, or 0 for the data's most"
        )
    return cfg.max_images_per_prompt or most
