"""LoRA through peft: wrap a loaded model, run it as its own frozen base, export it, load an export.

    model = apply_lora(load_causal_lm(path), cfg)                # unchanged when cfg.lora_rank is 0
    with adapters_disabled(engine.module):                       # the frozen base: the reference of RL's
        ref = sequence_logprobs(engine.module, ids, mask)        # KL and of DPO/KTO, without a second copy
    save_peft(engine.module, trainable_state(engine.module, gather=zero3), out_dir, merge=False, base_uri=cfg.pretrain)
    path = merged_checkpoint(adapter_dir, base_path)             # what resolve_model does with an adapter output
    adapter_weights(engine.module).save(dir)                     # the adapter now, for a vLLM engine (tasks.common.nn.engines.vllm_engine)

A stage trained with --lora_rank exports either the merged full checkpoint (--merge_lora) or the
adapter alone (adapter_config.json + adapter_model.safetensors + tokenizer files) with the base's URI
in its manifest (`base_model`, see `manifest_fields`). Loading an adapter output merges it into its
base once per node (cached beside the fetched adapter), so every later stage, and its own LoRA,
starts from ordinary full weights. Scalar models (reward models, critics) keep their `score` head
trainable and exported with the adapter (peft's modules_to_save).

peft is imported only when LoRA is used.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from tasks.common import manifest as manifests
from tasks.common.config import ConfigError

SCALAR_HEAD = "score"  # the head of AutoModelForSequenceClassification, as tasks.common.nn.models.token_values uses it
MERGE_MARKER = ".rlhf-merged.json"  # what a cached merge was made from


def enabled(cfg) -> bool:
    return getattr(cfg, "lora_rank", 0) > 0


def exports_adapter(cfg) -> bool:
    """Whether the stage's model/ holds an adapter (LoRA without --merge_lora) rather than full weights."""
    return enabled(cfg) and not cfg.merge_lora


def manifest_fields(cfg, **model_config) -> dict:
    """Extra manifest fields of a stage's output: for an adapter, its base (`base_model`, the URI the stage
    trained on) and the config attributes the merged model gets (`model_config`, e.g. reward statistics)."""
    if not exports_adapter(cfg):
        return {}
    return {"base_model": cfg.pretrain, **({"model_config": model_config} if model_config else {})}


def is_peft_model(model) -> bool:
    peft = sys.modules.get("peft")  # no peft imported: no peft model
    return peft is not None and isinstance(model, peft.PeftModel)


def unwrap(model):
    """The transformers model inside a DeepSpeed engine and/or a peft wrapper (LoRA layers stay injected)."""
    model = getattr(model, "module", model)
    return model.get_base_model() if is_peft_model(model) else model


def _target_modules(model, names: str) -> str | list[str]:
    """--target_modules as peft takes it; names matching no module are refused in one line."""
    if names == "all-linear":
        return names
    wanted = [n.strip() for n in names.split(",")]
    modules = [name for name, _ in model.named_modules()]
    missing = [n for n in wanted if not any(m == n or m.endswith("." + n) for m in modules)]
    if missing:
        linear = sorted(
            {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        raise ConfigError(
            f"target_modules: {', '.join(missing)} name no module of {model.name_or_path}; use all-linear or some of {','.join(linear)}"
        )
    return wanted


def apply_lora(model, cfg, scalar: bool = False):
    """`model` with LoRA adapters on --target_modules, only they (and a scalar model's head) trainable;
    `model` itself when --lora_rank is 0."""
    if not enabled(cfg):
        return model
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=_target_modules(model, cfg.target_modules),
        task_type=TaskType.SEQ_CLS if scalar else TaskType.CAUSAL_LM,
        # A reward model's or critic's head starts untrained: it must learn in full.
        modules_to_save=[SCALAR_HEAD] if scalar else None,
    )
    return get_peft_model(model, config)


def param_counts(model) -> dict[str, int]:
    """Trainable and total parameters (count before DeepSpeed's ZeRO-3 partitions them)."""
    params = list(model.parameters())
    return {
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "total_params": sum(p.numel() for p in params),
    }


@contextmanager
def adapters_disabled(model):
    """The frozen base model inside a peft model: adapters off and eval mode, restored on exit."""
    was_training = model.training
    model.eval()
    try:
        with model.disable_adapter():
            yield model
    finally:
        model.train(was_training)


def trainable_state(model, gather: bool = False, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """The trainable tensors (adapters, a scalar head) by state-dict name, on the CPU. `gather`: ZeRO-3
    holds each rank's shard only, so every rank must call; the whole tensors are gathered (just these,
    never the frozen base) and rank 0 gets them, the others {} (or their own copy, `every_rank`)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not gather:
        return {name: p.detach().cpu().clone() for name, p in named}
    import deepspeed
    import torch.distributed as dist

    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
        return {name: p.detach().cpu().clone() for name, p in named} if every_rank or dist.get_rank() == 0 else {}


@dataclass
class AdapterWeights:
    """A causal LM's adapter in memory, as peft's files hold it (adapter_config.json's dict, and the tensors
    of adapter_model.safetensors by peft's names): what a vLLM rollout engine loads after each update, a few
    MB where the full weights are GB."""

    config: dict
    tensors: dict[str, torch.Tensor]

    def save(self, out_dir: str | Path) -> Path:
        from safetensors.torch import save_file

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(
            {name: t.contiguous() for name, t in self.tensors.items()}, str(out_dir / "adapter_model.safetensors")
        )
        (out_dir / "adapter_config.json").write_text(json.dumps(self.config, default=_json_value))
        return out_dir


def _json_value(value):
    return sorted(value) if isinstance(value, (set, frozenset)) else str(value)


def adapter_weights(model, gather: bool = False, every_rank: bool = False) -> AdapterWeights | None:
    """The peft model's adapter now (`trainable_state`'s gather rules: under ZeRO-3 every rank calls, and
    only rank 0 gets it unless `every_rank`; None where nothing came)."""
    from peft import get_peft_model_state_dict

    state = trainable_state(model, gather, every_rank)
    if not state:
        return None
    return AdapterWeights(
        model.peft_config["default"].to_dict(),
        get_peft_model_state_dict(model, state_dict=state, save_embedding_layers=False),
    )


def save_peft(model, state: dict[str, torch.Tensor], out_dir: str | Path, merge: bool, base_uri: str) -> None:
    """Write a peft model from its `trainable_state`: the adapter, its config naming `base_uri` as the base,
    or (`merge`) the full model with the adapter merged in, in the dtype it trained in (rank 0 only)."""
    out_dir = Path(out_dir)
    if merge:
        with tempfile.TemporaryDirectory(prefix="rlhf-adapter-") as adapter:
            _save_adapter(model, state, adapter, base_uri)
            base = unwrap(model)
            dtype = next(iter(state.values())).dtype if state else None
            # The base reloads from where it was loaded: LoRA left its weights as they were.
            merge_adapter(adapter, base.name_or_path, out_dir, config=base.config, dtype=dtype)
        return
    _save_adapter(model, state, out_dir, base_uri)


def _save_adapter(model, state: dict, out_dir, base_uri: str) -> None:
    config = model.peft_config["default"]
    local = config.base_model_name_or_path
    # adapter_config.json names the base by the URI the stage read, not this worker's cache folder.
    config.base_model_name_or_path = base_uri or local
    try:
        model.save_pretrained(
            str(out_dir), state_dict=state, safe_serialization=True, save_embedding_layers=False
        )  # "auto" would look the base up on the hub
    finally:
        config.base_model_name_or_path = local
    (Path(out_dir) / "README.md").unlink(missing_ok=True)  # peft's model card template: noise in a stage output


def merge_adapter(
    adapter_dir: str | Path,
    base_path: str,
    out_dir: str | Path,
    config=None,
    overrides: dict | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Load `base_path` (a causal LM, or a one-output scalar model for a SEQ_CLS adapter), merge the adapter
    in, and save the full model (config, safetensors, generation config) under `out_dir`. `config`: the
    model's config (default: the base's), with `overrides` set on it; `dtype`: what to save in (default:
    the base config's)."""
    from peft import PeftConfig, PeftModel
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
    )

    scalar = str(PeftConfig.from_pretrained(str(adapter_dir)).task_type) in ("SEQ_CLS", "TaskType.SEQ_CLS")
    if config is None:
        config = AutoConfig.from_pretrained(base_path, **({"num_labels": 1} if scalar else {}))
    config = copy.deepcopy(config)  # the caller's (a live model's) stays as it is
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    if dtype is None:
        dtype = config.dtype if isinstance(getattr(config, "dtype", None), torch.dtype) else torch.float32
    # A vision-language model (its config has a vision_config) is no causal LM to transformers' Auto classes.
    vlm = getattr(config, "vision_config", None) is not None
    auto = (
        AutoModelForSequenceClassification if scalar else AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    )
    # Merged in float32, saved in `dtype`: the sum W + B·A rounds once.
    base = auto.from_pretrained(base_path, config=config, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.to(dtype)
    merged.config.dtype = dtype
    merged.save_pretrained(str(out_dir), safe_serialization=True)
    return Path(out_dir)


def merged_checkpoint(adapter_dir: str | Path, base_path: str, overrides: dict | None = None) -> Path:
    """A full checkpoint of `base_path` with the adapter in `adapter_dir` merged in, plus the adapter's
    tokenizer files: made once beside the adapter (`<adapter_dir>-merged`) and reused while adapter, base
    and overrides are the same."""
    adapter_dir = Path(adapter_dir)
    out = adapter_dir.with_name(adapter_dir.name + "-merged")
    made_from = {
        "adapter_sha256": manifests.file_sha256(adapter_dir / "adapter_model.safetensors"),
        "base": str(base_path),
        "overrides": overrides or {},
    }
    with manifests.folder_lock(out):
        try:
            if json.loads((out / MERGE_MARKER).read_text()) == made_from:
                return out
        except (OSError, ValueError):
            pass
        work = Path(tempfile.mkdtemp(prefix=out.name + "-", dir=out.parent))
        try:
            merge_adapter(adapter_dir, str(base_path), work, overrides=overrides)
            _copy_tokenizer(adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else Path(base_path), work)
            (work / MERGE_MARKER).write_text(json.dumps(made_from))
            shutil.rmtree(out, ignore_errors=True)
            os.replace(work, out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def _copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer, or a vision-language model's whole processor (its image processor and chat template too)."""
    from transformers import AutoTokenizer

    if (src / "processor_config.json").is_file():
        from tasks.common.nn.processors import load_processor

        load_processor(str(src)).save_pretrained(str(dst))
        return
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(dst))


class FrozenBase:
    """Called like the model, runs the peft model's frozen base (adapters off): a reference model (RL's
    KL, DPO/KTO) that shares the policy's weights instead of holding a second copy."""

    def __init__(self, model):
        self.model = model

    @property
    def config(self):
        return unwrap(self.model).config

    def __call__(self, *args, **kwargs):
        with torch.no_grad(), adapters_disabled(self.model):
            return self.model(*args, **kwargs)
