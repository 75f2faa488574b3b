"""A vision-language model's forward passes over rollout rows (issue 54): RL's old, reference and update log-prob
passes and eval's KL pass score prompt + response sequences with each row's images.

    vision_rows = VisionRows.of(processor)                      # the processor and the ids banned from sampling
    inputs = vision_rows.inputs(sequences, attention_mask, images)   # forward kwargs, placeholders checked
    logprobs = vision_rows.logprobs(model, sequences, attention_mask, images, start=prompt_width - 1)

Rows are a Rollout's: prompts left-padded, responses right-padded, each prompt's image placeholders expanded (as
vision.encode_vlm_prompt gives them). No position ids are passed: the model computes its own from the whole
prompt + response ids, the attention mask and the image grids (Qwen2-VL's M-RoPE, through mm_token_type_ids,
which transformers 5.x needs rebuilt over prompt + response), so a row's positions are the same in generation and
in every training pass, wherever its padding is.

The image placeholder ids (vision.image_token_ids) are banned from sampling in every engine; the policy whose
log-probabilities are taken here is the same one, the model's distribution with those ids removed (their logits
set to BANNED_LOGIT), so the engine's reported log-probabilities and the trainer's agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tasks.common.nn import vision
from tasks.common.nn.vocab import token_entropy, token_logprobs

#: A banned token's logit: finite, so an entropy's p·log p stays 0 rather than NaN, and far enough below any real
#: logit that its probability is exactly 0 in float32 at any temperature the stages take.
BANNED_LOGIT = -1e4


def without_tokens(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """logits [..., V] with the `banned` ids' entries set to BANNED_LOGIT (a copy: autograd flows through the rest)."""
    if banned.numel() == 0:
        return logits
    return logits.index_fill(-1, banned.to(logits.device), BANNED_LOGIT)


def expected_placeholders(image_grid_thw: torch.Tensor, merge_size: int, per_row: list[int]) -> list[int]:
    """Placeholder tokens each row's images expand to: t·h·w / merge² per image (Qwen2-VL's grids), summed per row
    (per_row: how many images each row has, in order)."""
    tokens = (image_grid_thw.prod(-1) // (merge_size**2)).tolist()
    out, at = [], 0
    for n in per_row:
        out.append(int(sum(tokens[at : at + n])))
        at += n
    return out


def check_placeholder_tokens(found: list[int], expected: list[int]) -> None:
    """Each row's image placeholder tokens against what its images expand to: a row where they differ (a prompt cut,
    an image changed after encoding) would fail inside the model or, worse, pair features with the wrong tokens."""
    for row, (have, want) in enumerate(zip(found, expected)):
        if have != want:
            raise ValueError(
                f"images: rollout row {row} has {have} image placeholder token(s) and its images expand to {want}; "
                "a prompt with images must reach the model whole, as encode_vlm_prompt encoded it (never cut it: "
                "lower the prompt's text or raise --prompt_max_len)"
            )


@dataclass
class VisionRows:
    """What a pass over a VLM's rollout rows needs: its processor and the ids it never samples."""

    processor: object
    banned: torch.Tensor

    @classmethod
    def of(cls, processor) -> VisionRows:
        return cls(processor, torch.tensor(vision.image_token_ids(processor), dtype=torch.long))

    def inputs(self, sequences: torch.Tensor, attention_mask: torch.Tensor, images: list[list]) -> dict:
        """The forward's arguments for padded rows and their images (decode_image's forms), on the rows' device:
        input_ids, attention_mask, mm_token_type_ids, and pixel_values with image_grid_thw when any row has images.
        Each row's placeholder tokens are checked against its images first."""
        types = torch.tensor(self.processor.create_mm_token_type_ids(sequences.tolist()), device=sequences.device)
        # Padding is never an image token: only the attended tokens count.
        types = types * (attention_mask > 0)
        inputs = {"input_ids": sequences, "attention_mask": attention_mask, "mm_token_type_ids": types}
        flat = [vision.decode_image(i) for row in images for i in row]
        found = (types == 1).sum(-1).tolist()
        if not flat:
            check_placeholder_tokens(found, [0] * len(found))
            return inputs
        pixels = self.processor.image_processor(images=flat, return_tensors="pt")
        inputs["pixel_values"] = pixels["pixel_values"].to(sequences.device)
        if "image_grid_thw" in pixels:
            grid = pixels["image_grid_thw"]
            merge = getattr(self.processor.image_processor, "merge_size", 1)
            check_placeholder_tokens(found, expected_placeholders(grid, merge, [len(r) for r in images]))
            inputs["image_grid_thw"] = grid.to(sequences.device)
        return inputs

    def logits(self, model, sequences, attention_mask, images, start: int = 0) -> torch.Tensor:
        """[B, T-1-start, V]: the logits predicting tokens start+1 …, the banned ids' removed."""
        out = model(**self.inputs(sequences, attention_mask, images), use_cache=False).logits
        return without_tokens(out[:, start:-1], self.banned)

    def logprobs(
        self,
        model,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        images: list[list],
        return_entropy: bool = False,
        temperature: float = 1.0,
        start: int = 0,
        entropy_grad: bool = True,
    ):
        """models.sequence_logprobs for VLM rows: [B, T] -> [B, T-1-start] (and the entropy), with the images."""
        logits = self.logits(model, sequences, attention_mask, images, start)
        logprobs = token_logprobs(logits, sequences[:, start + 1 :], temperature)
        if not return_entropy:
            return logprobs
        return logprobs, token_entropy(logits, temperature, entropy_grad)
