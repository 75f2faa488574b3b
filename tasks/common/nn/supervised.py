"""Supervised learning on (prompt, response) rows: their tokens and loss mask, and the loss of a micro-batch.
SFT trains on it; RL's actor adds it as the PPO-ptx term (--ptx_coef).

    ids, masks, cut = tokenize_rows(rows, tokenizer, "prompt", "response", chat_template=True, max_len=512)
    loss = micro_batch_loss(model, ids[:8], masks[:8], tokenizer.pad_token_id, packed=False, device=device)

A vision-language model's rows carry images (tasks/common/nn/vision.py); they are never cut, and never packed:

    ids, masks, images, dropped = tokenize_vlm_rows(rows, processor, "prompt", "response", "images", True, 512)
    loss = vlm_micro_batch_loss(model, processor, ids[:8], masks[:8], images[:8], pad_id, False, device)
"""

from __future__ import annotations

import torch

from tasks.common.config import ConfigError
from tasks.common.nn import data, vision
from tasks.common.nn.losses import sft_loss
from tasks.common.nn.models import position_ids, sequence_logprobs, token_nll_sum
from tasks.common.nn.packed import packed_logprobs
from tasks.common.nn.vocab import token_logprobs


def tokenize_rows(
    rows, tokenizer, input_key: str, output_key: str, chat_template: bool, max_len: int
) -> tuple[list[list[int]], list[list[int]], int]:
    """(ids, loss mask, number of rows cut) per row; the loss mask is 1 on the response tokens only.
    Rows longer than max_len lose the start of their prompt first (data.fit), so the answer and its
    closing token stay."""
    ids, masks, truncated = [], [], 0
    for prompt, response in zip(rows[input_key], rows[output_key]):
        p, (r,), cut = data.fit(
            data.encode_prompt(tokenizer, prompt, chat_template),
            [data.encode_response(tokenizer, response, chat_template)],
            max_len,
        )
        ids.append(p + r)
        masks.append([0] * len(p) + [1] * len(r))
        truncated += cut
    return ids, masks, truncated


def micro_batch_loss(
    model, ids: list[list[int]], masks: list[list[int]], pad_id: int, packed: bool, device, num_tokens=None
) -> torch.Tensor:
    """sft_loss of a micro-batch (micro_batch_inputs' rows). On CUDA with Liger it comes from Liger's fused
    linear cross-entropy (token_nll_sum), which never holds float32 logits and takes the output head's
    gradients in the forward pass; elsewhere from the log-probabilities."""
    input_ids, positions, mask_or_index, loss_mask = micro_batch_inputs(ids, masks, pad_id, packed, device)
    targets = loss_mask[:, 1:]  # a token's loss sits at the position before it
    # Rows of one length need no mask: without one, attention skips the check for padding (a wait for the GPU).
    unpadded = len(set(map(len, ids))) == 1
    layout = {"sequence_index": mask_or_index} if packed else {"attention_mask": None if unpadded else mask_or_index}
    nll = token_nll_sum(model, input_ids, targets, positions, **layout)
    if nll is None:
        return sft_loss(_logprobs(model, input_ids, positions, mask_or_index, packed), targets, num_tokens)
    return nll / (targets.sum().clamp(min=1) if num_tokens is None else num_tokens)


def micro_batch_inputs(ids: list[list[int]], masks: list[list[int]], pad_id: int, packed: bool, device):
    """(input_ids, position ids, the attention mask of padded rows or the sequence index of a packed one, loss
    mask [B, T]) on `device`: rows padded to one width, or packed into one row (B = 1; each row's first token is
    a prompt token, so the position predicting it across the boundary is masked out like any prompt token)."""
    if packed:
        input_ids, positions, mask_or_index = data.pack(ids)
        loss_mask = torch.tensor([[m for row in masks for m in row]])
    else:
        input_ids, mask_or_index = data.pad(ids, pad_id)
        positions = position_ids(mask_or_index)
        loss_mask, _ = data.pad(masks, 0)
    return input_ids.to(device), positions.to(device), mask_or_index.to(device), loss_mask.to(device)


def micro_batch_logprobs(model, ids: list[list[int]], masks: list[list[int]], pad_id: int, packed: bool, device):
    """(log-probabilities [B, T-1], loss mask [B, T]) of micro_batch_inputs' rows."""
    input_ids, positions, mask_or_index, loss_mask = micro_batch_inputs(ids, masks, pad_id, packed, device)
    return _logprobs(model, input_ids, positions, mask_or_index, packed), loss_mask


def _logprobs(model, input_ids, positions, mask_or_index, packed: bool) -> torch.Tensor:
    return (
        packed_logprobs(model, input_ids, positions, mask_or_index)
        if packed
        else sequence_logprobs(model, input_ids, mask_or_index)
    )


def tokenize_vlm_rows(
    rows, processor, input_key: str, output_key: str, image_key: str, chat_template: bool, max_len: int
) -> tuple[list[list[int]], list[list[int]], list[list], int]:
    """(ids, loss mask, images, number of rows dropped) per row of a vision-language dataset: each prompt's image
    placeholders expanded by the processor (encode_vlm_prompt), its response closed as encode_response closes it.
    A row longer than max_len is dropped, never cut: cutting the prompt's start would part placeholders from the
    pixels they stand for. A dataset without the image column is text for the VLM."""
    pictures = rows[image_key] if image_key in rows.column_names else [[]] * len(rows)
    ids, masks, images, dropped = [], [], [], 0
    for number, (prompt, response, row_images) in enumerate(zip(rows[input_key], rows[output_key], pictures), 1):
        row_images = row_images or []
        p = vision.encode_vlm_prompt(processor, prompt, row_images, chat_template, row_id=number)["input_ids"]
        r = data.encode_response(processor.tokenizer, response, chat_template)
        if len(p) + len(r) > max_len:
            dropped += 1
            continue
        ids.append(p + r)
        masks.append([0] * len(p) + [1] * len(r))
        images.append(row_images)
    return ids, masks, images, dropped


def vlm_micro_batch_loss(
    model, processor, ids, masks, images, pad_id: int, packed: bool, device, num_tokens=None
) -> torch.Tensor:
    """sft_loss of a micro-batch of vision-language rows (tokenize_vlm_rows'), padded on the right. The model gets
    its family's image inputs and positions (vision.vlm_inputs: Qwen2-VL's image grids, from which it computes its
    M-RoPE; LLaVA's 1-D positions). Full logits: Liger's chunked head is a text-model path (models.load_causal_lm)."""
    if packed:
        raise ConfigError(
            "packing_samples: a vision-language model's rows cannot be packed (each row's image features and "
            "positions are laid out for that row alone); drop --packing_samples"
        )
    inputs = vision.vlm_inputs(processor, ids, images, pad_id, device)
    loss_mask, _ = data.pad(masks, 0)
    logits = model(**inputs, use_cache=False).logits[:, :-1]
    logprobs = token_logprobs(logits, inputs["input_ids"][:, 1:])
    return sft_loss(logprobs, loss_mask[:, 1:].to(device), num_tokens)
