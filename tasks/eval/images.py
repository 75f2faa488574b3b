"""Eval on a vision-language model (issue 54): each side's prompts encoded with their rows' images, and what the
eval worker refuses for one.

    vision = vision_rows(path, cfg)                      # VisionRows for a VLM baseline, None for a text one
    tokenizer, ids, pictures = encode_side(path, prompts, rows, cfg)   # each prompt's ids (placeholders expanded)
    engine.generate(ids, 16, greedy=True, images=pictures)

The images come from each row's --image_key column (prepare_data stores them as base64 PNG beside the prompt), so
greedy and sampled responses, their metrics and the KL pass all see the pixels the policy trained on, and so does
the reward model (--reward_pretrain: the reward_model stage's on a VLM; reward_mean scores prompt + response +
pixels; a text reward model is refused).
"""

from __future__ import annotations

import torch

from tasks.common.config import ConfigError
from tasks.common.nn import vision
from tasks.common.nn.models import is_vision_model
from tasks.common.nn.vision_passes import VisionRows
from tasks.common.nn.vision_reward import refuse_unfit_reward_models


def vision_rows(path: str, cfg) -> VisionRows | None:
    """The baseline's VisionRows when it is a vision-language model (None for a text model); what eval does not do
    on one is refused in one line naming the fix."""
    if not is_vision_model(path):
        return None
    problems = [
        (
            cfg.lm_eval_tasks,
            "lm_eval_tasks: lm-eval's tasks are text; drop --lm_eval_tasks for a vision-language model",
        ),
        (
            cfg.env_path,
            "env_path: an environment's observations carry no images; drop --env_path for a vision-language model",
        ),
    ]
    for bad, message in problems:
        if bad:
            raise ConfigError(message)
    if cfg.reward_pretrain:  # reward_mean: each sample scored with its prompt's images, by VLM reward models only
        refuse_unfit_reward_models(
            cfg.reward_pretrain,
            "pass the reward_model stage's output trained on a vision-language model (it scores prompt + response + "
            "pixels), or drop --reward_pretrain (reward_mean is left out)",
        )
    return VisionRows.of(vision.load_processor(path))


def load_vision_model(path: str, dtype: torch.dtype):
    return vision.load_vision_lm(path, dtype=dtype)


def vllm_options(rows: VisionRows | None, cfg) -> dict:
    """A vLLM engine's options for a vision-language model (none for a text one): its image token, the ids it never
    samples, and the images a prompt may carry (--max_images_per_prompt, set from the data by evaluate)."""
    from tasks.common.nn.engines.vllm_vision import vision_options

    return {} if rows is None else vision_options(rows.processor, cfg.max_images_per_prompt)


def row_images(rows: list[dict], image_key: str) -> list[list]:
    """Each row's images (none where it has no such column or an empty cell)."""
    return [list(r.get(image_key) or []) for r in rows]


def encode_side(path: str, prompts: list, rows: list[dict], cfg) -> tuple:
    """(tokenizer, prompt ids, images per prompt) of one side's vision-language model at `path`, its own processor
    encoding each prompt with its row's images. A row whose placeholders and images differ is refused naming it."""
    processor = vision.load_processor(path)
    pictures = row_images(rows, cfg.image_key)
    ids = []
    for number, (prompt, images) in enumerate(zip(prompts, pictures), 1):
        try:
            enc = vision.encode_vlm_prompt(processor, prompt, images, cfg.apply_chat_template, row_id=number)
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"{e} (images from the column --image_key {cfg.image_key!r})") from None
        ids.append(enc["input_ids"])
    return processor.tokenizer, ids, pictures


def refuse_images_for_text(path: str, rows: list[dict], cfg) -> None:
    """A text model on rows that carry images would answer without seeing them: refused in one line."""
    if any(images for images in row_images(rows, cfg.image_key)):
        raise ConfigError(
            f"image_key: the rows carry images in {cfg.image_key!r} and {path} is a text model, which cannot see them; "
            "evaluate a vision-language model, or data without images"
        )


def most_images(rows: list[dict], image_key: str) -> int:
    """The most images any row carries: what a vLLM engine is sized for."""
    return max((len(i) for i in row_images(rows, image_key)), default=0)
