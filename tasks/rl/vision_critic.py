"""The critic of a vision-language policy (issue 54): the VLM's backbone (vision tower and language model) with a value
head on each token's last hidden state, so PPO with GAE runs on a VLM.

    critic = VisionValueModel(vision.load_vision_lm(path))     # the policy's backbone, a value head of zeros
    values = critic(**VisionRows.of(processor).inputs(sequences, attention_mask, images))   # [B, T]

It starts from the policy's weights (or --critic_pretrain, a VLM too): the head starts at zero, so the first
advantages are the returns, and the backbone learns from the value loss as a text critic's does. The images reach
it as they reach the policy (vision_passes.VisionRows: the family's inputs and positions). It trains in full
(no LoRA) and is not exported (--save_value_network): it is the stage's working part, not a model of its own.
"""

from __future__ import annotations

import torch

from tasks.common.nn.vision_passes import VisionRows


class VisionValueModel(torch.nn.Module):
    """A VLM's backbone (its `base_model_prefix` submodule: Qwen2-VL's or LLaVA's `model`, tower and language
    model) and a bias-free linear value head."""

    def __init__(self, vlm):
        super().__init__()
        self.backbone = getattr(vlm, vlm.base_model_prefix)  # the output head stays behind: values need no vocabulary
        self.config = vlm.config
        self.score = torch.nn.Linear(vlm.config.get_text_config().hidden_size, 1, bias=False)
        torch.nn.init.zeros_(self.score.weight)  # V = 0 at the start: GAE's first advantages are the returns

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        """--gradient_checkpointing (strategy.enable_checkpointing): the backbone's blocks recompute in backward."""
        from tasks.common.nn.strategy import enable_checkpointing

        enable_checkpointing(self.backbone)

    def forward(self, **inputs) -> torch.Tensor:
        """The value at every token: [B, T], float32."""
        hidden = self.backbone(**inputs, use_cache=False).last_hidden_state
        return self.score(hidden).squeeze(-1).float()


def response_values(critic, rows: VisionRows, sequences, attention_mask, images, prompt_width: int) -> torch.Tensor:
    """V(state before each response token): [B, R], as experience.response_values for a text critic."""
    return critic(**rows.inputs(sequences, attention_mask, images))[:, prompt_width - 1 : -1]
