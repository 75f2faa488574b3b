"""Where vision-language model families differ (issue 54), described once per family: which of the image
processor's outputs the model takes, how many placeholder tokens each image stands for, and which positions the
model wants. Every VLM path (SFT, the reward model, DPO/KTO, RL's passes and engines, eval) builds a batch's inputs
through `batch_inputs`, so none of them asks which family it has.

    family = family_of(processor)          # QWEN2_VL or LLAVA, by the processor's class; others are refused
    inputs = batch_inputs(processor, input_ids, attention_mask, images)   # forward kwargs, placeholders checked

The families:

- Qwen2-VL / Qwen2.5-VL: pixel_values are every image's patches flattened into one [patches, dim] tensor, with
  image_grid_thw [images, 3] giving each image's grid; an image stands for t·h·w / merge² placeholder tokens (its
  size decides it). The model computes its 3-D rotary positions (M-RoPE) itself from the ids, the attention mask
  and the grids, through mm_token_type_ids (transformers 5.x wants them rebuilt over prompt + response): no
  position ids are passed.
- LLaVA (llava-hf checkpoints, LlavaForConditionalGeneration): pixel_values are batched per image, [images, 3, H, W]
  at the processor's crop size; every image stands for the same run of (H/patch)·(W/patch) tokens (one less with
  vision_feature_select_strategy "default", which drops CLIP's CLS; plus the processor's
  num_additional_image_tokens). Positions are plain 1-D: they are passed, counted from the attention mask
  (models.position_ids, as generate() counts them), so left padding moves no row's positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tasks.common.config import ConfigError
from tasks.common.nn.images import decode_image


@dataclass(frozen=True)
class Family:
    """One family's layout of images: `image_keys`, the image processor's outputs the model takes;
    `tokens_per_image(processor, pixels)`, each image's placeholder count from those outputs; `token_types`, whether
    the model takes mm_token_type_ids; `positions_from_mask`, whether 1-D position ids are passed (else the model
    computes its own); `fixed_tokens(processor)`, the one placeholder count of every image where the family has
    one (None where an image's size decides it)."""

    name: str
    image_keys: tuple[str, ...]
    tokens_per_image: Callable
    token_types: bool
    positions_from_mask: bool
    fixed_tokens: Callable = lambda processor: None


def _grid_tokens(processor, pixels) -> list[int]:
    merge = getattr(processor.image_processor, "merge_size", 1)
    return (pixels["image_grid_thw"].prod(-1) // (merge**2)).tolist()


def _llava_run(processor, height: int, width: int) -> int:
    patches = (height // processor.patch_size) * (width // processor.patch_size)
    extra = processor.num_additional_image_tokens or 0  # CLIP's CLS
    return patches + extra - (processor.vision_feature_select_strategy == "default")


def _llava_tokens(processor, pixels) -> list[int]:
    values = pixels["pixel_values"]
    return [_llava_run(processor, *values.shape[-2:])] * values.size(0)


def _llava_fixed(processor) -> int:
    crop = processor.image_processor.crop_size
    return _llava_run(processor, crop["height"], crop["width"])


QWEN2_VL = Family(
    "Qwen2-VL", ("pixel_values", "image_grid_thw"), _grid_tokens, token_types=True, positions_from_mask=False
)
LLAVA = Family("LLaVA", ("pixel_values",), _llava_tokens, False, True, fixed_tokens=_llava_fixed)
#: Processor classes by name (transformers' own, and subclasses of them: the class's MRO is searched).
FAMILIES = {"Qwen2VLProcessor": QWEN2_VL, "Qwen2_5_VLProcessor": QWEN2_VL, "LlavaProcessor": LLAVA}


def family_of(processor) -> Family:
    """The family of a VLM's processor; a processor of another family is refused in one line."""
    for cls in type(processor).__mro__:
        if cls.__name__ in FAMILIES:
            return FAMILIES[cls.__name__]
    raise ConfigError(
        f"pretrain: {type(processor).__name__} is the processor of a vision-language family this project does not lay "
        f"out images for (it knows Qwen2-VL, Qwen2.5-VL and LLaVA: {', '.join(FAMILIES)}); pass a model of one of those"
    )


def per_row(tokens: list[int], counts: list[int]) -> list[int]:
    """Each row's placeholder tokens: `tokens` (one entry per image, rows in order) summed over each row's `counts`."""
    out, at = [], 0
    for n in counts:
        out.append(int(sum(tokens[at : at + n])))
        at += n
    return out


def check_placeholder_tokens(found: list[int], expected: list[int], rows: str = "rollout row") -> None:
    """Each row's image placeholder tokens against what its images expand to: a row where they differ (a prompt cut,
    an image changed after encoding) would fail inside the model or, worse, pair features with the wrong tokens."""
    for row, (have, want) in enumerate(zip(found, expected)):
        if have != want:
            raise ValueError(
                f"images: {rows} {row} has {have} image placeholder token(s) and its images expand to {want}; "
                "a prompt with images must reach the model whole, as encode_vlm_prompt encoded it (never cut it: "
                "lower the prompt's text or raise --prompt_max_len)"
            )


def batch_inputs(processor, input_ids: torch.Tensor, attention_mask: torch.Tensor, images: list[list], rows="row"):
    """The forward's arguments for padded rows (either side) and each row's images (images.decode_image's forms), on
    the rows' device: input_ids and attention_mask, the family's image inputs when any row has images, its
    mm_token_type_ids or position ids. Each row's placeholder tokens are checked against its images first (`rows`
    names a row in the error)."""
    from tasks.common.nn.models import position_ids

    family = family_of(processor)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    attended = attention_mask > 0  # padding is never an image token: only the attended tokens count
    found = ((input_ids == processor.image_token_id) & attended).sum(-1).tolist()
    if family.token_types:
        types = torch.tensor(processor.create_mm_token_type_ids(input_ids.tolist()), device=input_ids.device)
        inputs["mm_token_type_ids"] = types * attended
    if family.positions_from_mask:
        inputs["position_ids"] = position_ids(attention_mask)
    flat = [decode_image(i) for row in images for i in row]
    if not flat:
        check_placeholder_tokens(found, [0] * len(found), rows)
        return inputs
    pixels = processor.image_processor(images=flat, return_tensors="pt")
    check_placeholder_tokens(found, per_row(family.tokens_per_image(processor, pixels), [len(r) for r in images]), rows)
    return inputs | {k: pixels[k].to(input_ids.device) for k in family.image_keys}
