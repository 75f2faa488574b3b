"""Vision-language models (issue 54): loading one and its processor, freezing its vision tower, and a prompt with
images as the model's inputs.

    if models.is_vision_model(path):                                # tasks.common.nn.models: its config has a vision_config
        model, processor = load_vision_lm(path), load_processor(path)
        freeze_visual_encoder(model)                                    # train the language model only
        enc = encode_vlm_prompt(processor, "<image>colour?", [image])   # image: PIL, PNG bytes or base64 PNG
        inputs = vlm_inputs(processor, [enc["input_ids"]], [[image]], pad_id, device)   # a padded batch of rows
        logits = model(**inputs).logits
        banned = image_token_ids(processor)                             # never sampled: they stand for images

A prompt marks each image's place with an `<image>` tag in its text, or with a `{"type": "image"}` block in a chat
message's content (OpenAI's and HF's form); the images come in a list beside it, in order. The processor expands
each place to the model's own placeholder run (Qwen2-VL: <|vision_start|>, one <|image_pad|> per merged patch,
<|vision_end|>; LLaVA: one <image> per patch of the crop). Where the families differ (which image inputs the model
takes, how many tokens an image stands for, which positions it wants: Qwen2-VL computes its M-RoPE itself, LLaVA
takes 1-D ones) is described once per family in tasks/common/nn/vision_family.py, which vlm_inputs goes through.
"""

from __future__ import annotations

import re

import torch

from tasks.common.config import ConfigError
from tasks.common.image_tags import IMAGE_TAG, count_placeholders
from tasks.common.nn.images import decode_image
from tasks.common.nn.models import attn_implementation
from tasks.common.nn.processors import image_only, load_processor  # noqa: F401 (the VLM's processor, here too)

#: The submodules that make up a vision tower and its projector into the language model, by the names
#: transformers' VLMs give them (Qwen2/2.5/3-VL: `visual`, its merger inside; LLaVA, Gemma 3, Mistral 3:
#: `vision_tower` + `multi_modal_projector`; Idefics 3 / SmolVLM: `vision_model` + `connector`).
VISION_MODULES = ("visual", "vision_tower", "vision_model", "multi_modal_projector", "connector", "mm_projector")
#: Tokens that stand for image or video content in the processors we know: sampling one would start a fake image.
_VISION_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_pad|>",
    "<image>",
    "<|image|>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
)


def load_vision_lm(path: str, dtype: torch.dtype = torch.float32, flash_attn: bool = False):
    """A vision-language model through AutoModelForImageTextToText (Liger's kernels are not applied: its
    monkey-patching covers the text models the stages load with load_causal_lm)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation(flash_attn)
    )


def freeze_visual_encoder(model) -> int:
    """Stop training the vision tower and its projector (VISION_MODULES, found by name anywhere in the model, LoRA
    and DeepSpeed wrappers included); returns the number of parameters frozen. A model without any is an error."""
    towers = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in VISION_MODULES]
    if not towers:
        raise ConfigError(
            f"freeze_visual_encoder: {type(model).__name__} has no vision tower (no submodule named {', '.join(VISION_MODULES)}); "
            "drop --freeze_visual_encoder for a text model"
        )
    params = {id(p): p for m in towers for p in m.parameters()}  # a projector inside the tower counts once
    frozen = sum(p.numel() for p in params.values() if p.requires_grad)
    for p in params.values():
        p.requires_grad_(False)
    return frozen


def image_token_ids(processor_or_tokenizer) -> list[int]:
    """Ids that stand for images or videos (the processor's image and video tokens, and the vision start and end
    markers): banned from sampling, since a response must not open an image it has no pixels for."""
    tokenizer = getattr(processor_or_tokenizer, "tokenizer", processor_or_tokenizer)
    ids = {getattr(processor_or_tokenizer, k, None) for k in ("image_token_id", "video_token_id")}
    vocab = tokenizer.get_vocab()
    ids |= {vocab[t] for t in _VISION_TOKENS if t in vocab}
    ids.discard(None)
    ids.discard(tokenizer.unk_token_id)
    return sorted(ids)


# ---------------------------------------------------------------- images as stored


def check_image_placeholders(n_placeholders: int, n_images: int, row_id) -> None:
    """One image per placeholder: a row where they differ cannot be encoded."""
    if n_placeholders != n_images:
        raise ValueError(
            f"images: row {row_id} has {n_images} image(s) and {n_placeholders} <image> tag(s) or image block(s) in its prompt; "
            "give the prompt one <image> tag (or {'type': 'image'} block) per image, in order"
        )


def as_blocks(content) -> list[dict]:
    """Message content as HF content blocks: text with `<image>` tags becomes text and image blocks."""
    if not isinstance(content, str):  # blocks: a text block's own tags count as images too (count_placeholders)
        return [out for b in content for out in ([b] if b.get("type") != "text" else as_blocks(b.get("text", "")))]
    parts = content.split(IMAGE_TAG)
    blocks = [{"type": "text", "text": parts[0]}]
    for part in parts[1:]:
        blocks += [{"type": "image"}, {"type": "text", "text": part}]
    return [b for b in blocks if b["type"] == "image" or b["text"]]


def image_placeholder(processor) -> str:
    """The text the processor expands into one image's placeholder run: its image token, inside the vision start
    and end markers for models that have them (Qwen2-VL's <|vision_start|><|image_pad|><|vision_end|>)."""
    vocab = processor.tokenizer.get_vocab()
    token = processor.image_token
    if "<|vision_start|>" in vocab and "<|vision_end|>" in vocab:
        return f"<|vision_start|>{token}<|vision_end|>"
    return token


def render_prompt(processor, prompt, chat_template: bool) -> str:
    """The prompt as text with one placeholder per image: the chat template's rendering (ending with the
    assistant's opening), or without one the text with each `<image>` tag replaced, after the BOS if any."""
    if chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        messages = [{**m, "content": as_blocks(m["content"])} for m in messages]
        return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not isinstance(prompt, str):
        raise ConfigError(
            "apply_chat_template: the prompt is a list of chat messages, which only the chat template can render; pass --apply_chat_template"
        )
    bos = processor.tokenizer.bos_token or ""
    text = re.sub(re.escape(IMAGE_TAG), lambda _: image_placeholder(processor), prompt)
    return text if text.startswith(bos) else bos + text


def encode_vlm_prompt(processor, prompt, images, chat_template: bool = True, row_id="?") -> dict:
    """{"input_ids": list[int] with each image's placeholders expanded, "pixel_values" (Qwen2-VL: [patches, dim];
    LLaVA: [images, 3, H, W]) or None, "image_grid_thw": [images, 3] or None (Qwen2-VL's alone)} of a prompt and its
    images (images.decode_image's forms). The model's forward may want more (Qwen2-VL's mm_token_type_ids, LLaVA's
    position ids): vlm_inputs makes what its family needs for a batch."""
    from tasks.common.nn.vision_family import family_of

    family_of(processor)  # a family whose batches the stages can build, or the one-line refusal before any step
    images = [decode_image(i) for i in images or []]
    check_image_placeholders(count_placeholders(prompt), len(images), row_id)
    text = render_prompt(processor, prompt, chat_template)
    enc = processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=False)
    return {
        "input_ids": enc["input_ids"][0].tolist(),
        "pixel_values": enc.get("pixel_values"),
        "image_grid_thw": enc.get("image_grid_thw"),
    }


def vlm_inputs(processor, ids: list[list[int]], images: list[list], pad_id: int, device) -> dict:
    """A VLM's forward arguments for rows of token ids (placeholders expanded, as encode_vlm_prompt gives) and each
    row's images: input_ids and attention_mask padded on the right, and the family's image inputs and positions
    (vision_family.batch_inputs: Qwen2-VL's pixel_values, image_grid_thw and mm_token_type_ids, from which it computes
    its M-RoPE positions; LLaVA's per-image pixel_values and 1-D position ids), rows in order, placeholders checked."""
    from tasks.common.nn import data
    from tasks.common.nn.vision_family import batch_inputs

    input_ids, attention_mask = data.pad(ids, pad_id)
    inputs = batch_inputs(processor, input_ids, attention_mask, images, rows="batch row")
    return {k: v.to(device) for k, v in inputs.items()}
