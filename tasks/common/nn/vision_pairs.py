"""Preference data for a vision-language model (issue 54): a prompt with its images and several responses to it,
as the reward model's pairs and DPO/KTO's examples take them.

    prompts, responses, images, kept = tokenize_vlm_examples(rows, processor, "prompt", ["chosen", "rejected"],
                                                             "images", chat_template=True, max_len=512, split="preference")
    logps = vlm_summed_logps(policy, processor, prompts, [r[0] for r in responses], images, pad_id, device)   # [B]

Every response of a row shares the row's prompt and so its images: a chosen and a rejected sequence see the same
pixels. The prompt's image placeholders are expanded by the processor (vision.encode_vlm_prompt); a row too long
for max_len is dropped, never cut (cutting would part placeholders from the pixels they stand for). Batches are
padded on the right and the model computes its own positions (vision.vlm_inputs); they are never packed.
"""

from __future__ import annotations

import torch

from tasks.common.config import ConfigError
from tasks.common.nn import data, vision
from tasks.common.nn.vocab import token_logprobs

PACKING_REFUSED = (
    "packing_samples: {model} is a vision-language model, whose rows cannot be packed (each row's image features "
    "and positions are laid out for that row alone); drop --packing_samples"
)


def row_images(rows, image_key: str) -> list[list]:
    """Each row's images (the split's image column), [] for every row of a dataset without one."""
    if image_key and image_key in rows.column_names:
        return [list(cell or []) for cell in rows[image_key]]
    return [[] for _ in range(len(rows))]


def refuse_text_model(cfg, splits: dict) -> None:
    """A text model (cfg.pretrain) with --freeze_visual_encoder, or with rows that have images (`splits`: name ->
    rows), which it would silently learn from by their text alone: refused in one line."""
    if cfg.freeze_visual_encoder:
        raise ConfigError(
            f"freeze_visual_encoder: {cfg.pretrain} is a text model (its config has no vision_config); "
            "drop --freeze_visual_encoder, or pass a vision-language model"
        )
    for split, rows in splits.items():
        for number, cell in enumerate(row_images(rows, cfg.image_key), 1):
            if cell:
                raise ConfigError(
                    f"pretrain: {cfg.pretrain} is a text model (its config has no vision_config) and row {number} of "
                    f"{split} has images in {cfg.image_key!r}; pass a vision-language model, or data without images"
                )


def tokenize_vlm_examples(
    rows,
    processor,
    prompt_key: str,
    response_keys: list[str],
    image_key: str,
    chat_template: bool,
    max_len: int,
    split: str = "dataset",
) -> tuple[list[list[int]], list[list[list[int]]], list[list], list[int]]:
    """(prompt ids, each response column's ids, images) per kept row, and the kept rows' indices. A row is dropped when
    its prompt and any one of its responses exceed max_len together. A row whose images and placeholders differ in
    number is refused, naming it (its number in `split`, from 1) and the fix."""
    prompts, responses, images, kept = [], [], [], []
    columns = [rows[k] for k in response_keys]
    for number, (prompt, pictures, *texts) in enumerate(
        zip(rows[prompt_key], row_images(rows, image_key), *columns), 1
    ):
        try:
            p = vision.encode_vlm_prompt(processor, prompt, pictures, chat_template, row_id=f"{number} of {split}")
        except ValueError as e:  # a mismatch, or an image that does not decode: the stage's one-line input error
            raise ConfigError(str(e)) from None
        outs = [data.encode_response(processor.tokenizer, text, chat_template) for text in texts]
        if len(p["input_ids"]) + max(map(len, outs)) > max_len:
            continue
        kept.append(number - 1)
        prompts.append(p["input_ids"])
        responses.append(outs)
        images.append(pictures)
    return prompts, responses, images, kept


def response_mask(prompts: list[list[int]], responses: list[list[int]]) -> list[list[int]]:
    """1 on each sequence's response tokens, 0 on its prompt: the tokens whose log-probabilities count."""
    return [[0] * len(p) + [1] * len(r) for p, r in zip(prompts, responses)]


def vlm_summed_logps(model, processor, prompts, responses, images, pad_id: int, device) -> torch.Tensor:
    """Σ log π(response tokens | prompt, its images) per sequence: [B]. `model` is anything called like the VLM (a
    DeepSpeed engine, a peft wrapper, lora.FrozenBase) whose output has `.logits`; the images' pixel_values reach it."""
    ids = [p + r for p, r in zip(prompts, responses)]
    inputs = vision.vlm_inputs(processor, ids, images, pad_id, device)
    loss_mask, _ = data.pad(response_mask(prompts, responses), 0)
    logits = model(**inputs, use_cache=False).logits[:, :-1]
    logprobs = token_logprobs(logits, inputs["input_ids"][:, 1:])
    return (logprobs * loss_mask[:, 1:].to(device)).sum(-1)
