"""A vision-language model's forward passes over rollout rows (issue 54): RL's old, reference and update log-prob
passes and eval's KL pass score prompt + response sequences with each row's images.

    vision_rows = VisionRows.of(processor)                      # the processor and the ids banned from sampling
    inputs = vision_rows.inputs(sequences, attention_mask, images)   # forward kwargs, placeholders checked
    logprobs = vision_rows.logprobs(model, sequences, attention_mask, images, start=prompt_width - 1)

Rows are a Rollout's: prompts left-padded, responses right-padded, each prompt's image placeholders expanded (as
vision.encode_vlm_prompt gives them). The inputs are the family's (vision_family.batch_inputs): Qwen2-VL computes
its own positions from the whole prompt + response ids, the attention mask and the image grids (M-RoPE, through
mm_token_type_ids, which transformers 5.x needs rebuilt over prompt + response); LLaVA takes 1-D positions counted
from the attention mask, as generate() counts them. Either way a row's positions are the same in generation and in
every training pass, wherever its padding is.

The image placeholder ids (vision.image_token_ids) are banned from sampling in every engine; the policy whose
log-probabilities are taken here is the same one, the model's distribution with those ids removed (their logits
set to BANNED_LOGIT), so the engine's reported log-probabilities and the trainer's agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tasks.common.nn import vision
from tasks.common.nn.vision_family import batch_inputs, family_of
from tasks.common.nn.vocab import token_entropy, token_logprobs

#: A banned token's logit: finite, so an entropy's p·log p stays 0 rather than NaN, and far enough below any real
#: logit that its probability is exactly 0 in float32 at any temperature the stages take.
BANNED_LOGIT = -1e4


def without_tokens(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """logits [..., V] with the `banned` ids' entries set to BANNED_LOGIT (a copy: autograd flows through the rest)."""
    if banned.numel() == 0:
        return logits
    return logits.index_fill(-1, banned.to(logits.device), BANNED_LOGIT)


@dataclass
class VisionRows:
    """What a pass over a VLM's rollout rows needs: its processor and the ids it never samples."""

    processor: object
    banned: torch.Tensor

    @classmethod
    def of(cls, processor) -> VisionRows:
        family_of(processor)  # a family this project lays out images for, or a one-line refusal now
        return cls(processor, torch.tensor(vision.image_token_ids(processor), dtype=torch.long))

    def inputs(self, sequences: torch.Tensor, attention_mask: torch.Tensor, images: list[list]) -> dict:
        """The forward's arguments for padded rows and their images (images.decode_image's forms), on the rows' device
        (vision_family.batch_inputs: the family's image inputs and positions). Each row's placeholder tokens are
        checked against its images first."""
        return batch_inputs(self.processor, sequences, attention_mask, images, rows="rollout row")

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
