"""A vision-language reward model (issue 54): the VLM's backbone (vision tower + language model, no LM head) with a
scalar value head, as the reward model stage trains it and RL loads it.

    model = VisionRewardModel.from_pretrained(path)       # an SFT VLM (fresh head) or a saved reward model (its head)
    values = model(**vision.vlm_inputs(processor, ids, images, pad_id, device))   # [B, T]: the head on every token
    scores = vlm_sequence_scores(model, processor, ids, images, pad_id, device)   # [B]: at each row's last token
    model.save_pretrained(out_dir)                         # config.json + model.safetensors + value_head.safetensors

    model, passes = load_vision_reward_model(path)          # what RL and eval score rollouts with (rewards.RewardModels)
    scores = rollout_scores(model, passes, sequences, attention_mask, images)   # [B]: rollout rows with their images
    refuse_unfit_reward_models(cfg.reward_pretrain, fix)   # a VLM policy's: each a VLM reward model, else one line

transformers has no sequence-classification class for most VLMs (Qwen2-VL, LLaVA, Idefics), so the head lives
beside the backbone: the folder loads with AutoModel (the backbone: Qwen2VLModel for Qwen2-VL, LlavaModel for
LLaVA) plus the head's one tensor, `weight` [1, hidden] of value_head.safetensors, the file config.json names as
`value_head`; the reward statistics (`reward_mean`, `reward_std`) sit in config.json as for a text reward model.
With LoRA, the adapters are injected into the backbone's linear layers and merged into its weights when saved
(merge_lora_state), so the output is always a full checkpoint any stage loads as it is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tasks.common.nn.losses import last_token_index
from tasks.common.nn.models import attn_implementation

HEAD_FILE = "value_head.safetensors"
LORA_A, LORA_B, BASE = ".lora_A.default.weight", ".lora_B.default.weight", ".base_layer."


class VisionRewardModel(torch.nn.Module):
    """backbone(**VLM inputs).last_hidden_state -> score (Linear(hidden, 1), no bias) on every token."""

    def __init__(self, backbone, score: torch.nn.Linear | None = None):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.get_text_config().hidden_size
        if score is None:
            score = torch.nn.Linear(hidden, 1, bias=False, dtype=backbone.dtype)
            std = getattr(backbone.config.get_text_config(), "initializer_range", 0.02)
            torch.nn.init.normal_(score.weight, std=std)  # as transformers starts a sequence-classification head
        self.score = score

    @property
    def config(self):
        return self.backbone.config

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, flash_attn: bool = False):
        """The backbone of the VLM at `path` and its value head: the saved one where the folder has one (a
        reward model), else a fresh one (an SFT model, or any VLM)."""
        from safetensors.torch import load_file
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation(flash_attn))
        head_file = Path(path) / getattr(backbone.config, "value_head", HEAD_FILE)
        model = cls(backbone)
        if head_file.is_file():
            model.score.weight.data.copy_(load_file(str(head_file))["weight"].to(dtype))
        return model

    def forward(self, input_ids, attention_mask, use_cache: bool = False, **images) -> torch.Tensor:
        """The head on every token's last hidden state: [B, T], float32. `images`: the rest of vlm_inputs' arguments,
        the family's (pixel_values, and Qwen2-VL's image_grid_thw and mm_token_type_ids or LLaVA's position_ids)."""
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache, **images
        ).last_hidden_state
        return self.score(hidden).squeeze(-1).float()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        """What strategy.enable_checkpointing calls: the backbone's blocks recompute their activations."""
        enable = getattr(self.backbone, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=gradient_checkpointing_kwargs)
        else:
            self.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    def save_pretrained(self, out_dir, state_dict: dict | None = None, safe_serialization: bool = True) -> None:
        """The backbone as an HF folder (LoRA merged in: merge_lora_state) and the head beside it (HEAD_FILE);
        `state_dict`: this module's (DeepSpeed's ZeRO-3 consolidation gives it), default its own."""
        from safetensors.torch import save_file

        state = state_dict if state_dict is not None else self.state_dict()
        scale = lora_scale(self.backbone)
        backbone = merge_lora_state(
            {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}, scale
        )
        self.config.value_head = HEAD_FILE
        # Saved from a plain model of the same class (its layers on the meta device: no memory), so the folder holds
        # no LoRA layers; save_pretrained writes the state dict it is given.
        plain = self.backbone
        if scale is not None:
            with torch.device("meta"):
                plain = type(self.backbone)(self.config)
        plain.save_pretrained(out_dir, state_dict=backbone, safe_serialization=safe_serialization)
        save_file({"weight": state["score.weight"].detach().cpu().contiguous()}, str(Path(out_dir) / HEAD_FILE))


def lora_scale(module) -> float | None:
    """lora_alpha / r of the adapters injected into `module` (peft's scaling without rsLoRA); None without any."""
    for m in module.modules():
        scaling = getattr(m, "scaling", None)
        if isinstance(scaling, dict) and "default" in scaling:
            return float(scaling["default"])
    return None


def merge_lora_state(state: dict[str, torch.Tensor], scale: float | None) -> dict[str, torch.Tensor]:
    """A state dict with peft's LoRA layers (`<m>.base_layer.weight`, `<m>.lora_A.default.weight` [r, in],
    `<m>.lora_B.default.weight` [out, r]) as plain ones: `<m>.weight` = W + scale · B·A, summed in float32 and
    kept in W's dtype; `<m>.base_layer.bias` -> `<m>.bias`. Keys of layers without LoRA pass unchanged."""
    if scale is None:
        return dict(state)
    out = {}
    for key, value in state.items():
        if key.endswith((LORA_A, LORA_B)):
            continue
        if BASE in key:
            module, _, name = key.rpartition(BASE)
            if name == "weight" and module + LORA_A in state:
                a, b = state[module + LORA_A].float(), state[module + LORA_B].float()
                value = (value.float() + scale * (b @ a)).to(value.dtype)
            key = f"{module}.{name}"
        out[key] = value
    return out


def vlm_sequence_scores(model, processor, ids, images, pad_id: int, device) -> torch.Tensor:
    """The value head at each row's last real token ([B]) of rows of token ids with their images (right padded)."""
    from tasks.common.nn import vision

    inputs = vision.vlm_inputs(processor, ids, images, pad_id, device)
    values = model(**inputs)
    rows = torch.arange(values.size(0), device=values.device)
    return values[rows, last_token_index(inputs["attention_mask"])]


def is_vision_reward_model(path: str) -> bool:
    """Whether the folder holds a reward model saved by VisionRewardModel (config.json names its value head)."""
    config = Path(path) / "config.json"
    return config.is_file() and "value_head" in json.loads(config.read_text())


def inject_lora(backbone, cfg):
    """LoRA adapters on the backbone's --target_modules, in place (no peft wrapper: the module stays the backbone,
    so the reward model saves as itself); only the adapters stay trainable there. `backbone` when LoRA is off."""
    from peft import LoraConfig, inject_adapter_in_model

    from tasks.common.nn import lora

    if not lora.enabled(cfg):
        return backbone
    config = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=lora._target_modules(backbone, cfg.target_modules),
    )
    return inject_adapter_in_model(config, backbone)


# ---------------------------------------------------------------- scoring rollouts (RL's reward workers, eval)


def load_vision_reward_model(path: str, dtype: torch.dtype = torch.float32):
    """(the reward model saved at the local folder `path`, VisionRows of its processor): what scores rollout rows."""
    from tasks.common.nn import vision
    from tasks.common.nn.vision_passes import VisionRows

    return VisionRewardModel.from_pretrained(path, dtype=dtype), VisionRows.of(vision.load_processor(path))


def rollout_scores(model, passes, sequences, attention_mask, images) -> torch.Tensor:
    """The value head at each row's last real token ([B]) of rows as a Rollout holds them (prompts left-padded,
    responses right-padded, each prompt's placeholders expanded) with each row's images: prompt + response + pixels.
    `passes` (a VisionRows) builds the family's inputs and checks each row's placeholders against its images; the
    positions follow the mask (Qwen2-VL's M-RoPE computed by the model, LLaVA's counted from it), so a row scores as
    it does unpadded (vlm_sequence_scores, as the reward model stage scored its pairs)."""
    values = model(**passes.inputs(sequences, attention_mask, images))
    rows = torch.arange(values.size(0), device=values.device)
    return values[rows, last_token_index(attention_mask)]


def refuse_unfit_reward_models(reward_pretrain: str, fix: str) -> None:
    """A vision-language model's reward models must see its prompts' images: each of `reward_pretrain` (a comma list
    of URIs) must be a folder VisionRewardModel saved (the reward_model stage's output on a VLM). A text reward model
    or a VLM without a value head is refused in one line naming it, with `fix`."""
    from tasks.common.config import ConfigError, split_list
    from tasks.common.nn.models import is_vision_model, resolve_model

    for uri in split_list(reward_pretrain):
        path = resolve_model(uri)
        if is_vision_reward_model(path):
            continue
        what = (
            "a vision-language model with no value head (its config.json names no value_head), not a reward model"
            if is_vision_model(path)
            else "a text reward model, which cannot see the images of a vision-language model's prompts"
        )
        raise ConfigError(f"reward_pretrain: {uri} is {what}; {fix}")
