"""Loading models by URI, and the forward passes every stage shares.

    path = resolve_model("s3://bucket/…/sft/manifest.json")   # or a local folder, or a hub id
    tokenizer, policy = load_tokenizer(path), load_causal_lm(path, **kernels(cfg))   # cfg: a TrainingConfig
    logprobs = sequence_logprobs(policy, input_ids, attention_mask)    # [B, T-1]
    nll = token_nll_sum(policy, input_ids, target_mask, position_ids(attention_mask), attention_mask)  # SFT's, fused; None off CUDA
    scores = sequence_scores(reward_model, input_ids, attention_mask)  # [B]

The same passes over packed rows (--packing_samples) are tasks.common.nn.packed's.

A URI that names a stage output (s3://…, or a folder holding manifest.json) is resolved through
its manifest's `model` entry and fetched with every file's size and sha256 checked; a plain folder
is used as it is, and a plain checkpoint on S3 (config.json, no manifest.json: a team's own base model)
is downloaded once per node; anything else is passed to transformers as a hub id. A stage output holding a LoRA
adapter (its manifest names the `base_model`) resolves to a full checkpoint: the base with the
adapter merged in (tasks.common.nn.lora.merged_checkpoint), made once per node and cached.

The training stages load their models with `kernels(cfg)`: FlashAttention-2 when asked for, and on CUDA
Liger's Triton kernels (RMSNorm, SwiGLU, RoPE) with log-probabilities taken from the last hidden states a
chunk of tokens at a time (vocab.head_logprobs), so no step holds the full [tokens, vocabulary] logits.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from tasks.common import manifest as manifests
from tasks.common import storage
from tasks.common.nn import lora
from tasks.common.nn.losses import last_token_index
from tasks.common.nn.vocab import fused_linear_nll_sum, head_logprobs, token_entropy, token_logprobs

logger = logging.getLogger(__name__)


def is_stage_output(uri: str) -> bool:
    if uri.endswith("manifest.json") or storage.is_s3(uri):
        return True
    return (Path(uri) / "manifest.json").is_file()


def is_model_folder(uri: str) -> bool:
    """An S3 folder holding a plain transformers checkpoint (config.json, no manifest.json): a team's own base
    model uploaded as it is, which prepare_data's --base_model accepts and passes on to the stages."""
    return (
        storage.is_s3(uri)
        and not uri.rstrip("/").endswith("/" + manifests.MANIFEST)
        and not storage.exists(storage.join(uri, manifests.MANIFEST))
        and storage.exists(storage.join(uri, "config.json"))
    )


def fetch_model_folder(uri: str) -> Path:
    """The S3 model folder `uri` downloaded into the local cache, once per node: the copy is named by the
    folder's listing (each file's path, size and ETag), so new content under the same URI is a new copy."""
    listing = storage.list_files(uri, etags=True)
    digest = manifests.config_hash({"files": listing})[:16]
    local = manifests.local_cache_dir(uri) / f"model-{digest}"
    if not local.is_dir():
        work = Path(tempfile.mkdtemp(prefix=f"{local.name}-", dir=local.parent))
        try:
            storage.download_dir(uri, work, files=[rel for rel, _, _ in listing])
            try:
                os.replace(work, local)  # atomic; another process of the node may have made it first
            except OSError:
                if not local.is_dir():
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return local


def resolve_model(uri: str) -> str:
    """A local folder (or hub id) that transformers can load the model named by `uri` from."""
    if not is_stage_output(uri):
        return uri
    if is_model_folder(uri):
        return str(fetch_model_folder(uri))
    manifest = manifests.read_manifest(uri)
    if "model" not in manifest:
        raise storage.StorageError(
            f"{manifest['uri']} holds no model (its stage is {manifest.get('stage')!r}); pass a model's URI"
        )
    ref = manifest["model"].rstrip("/")
    if not any(path.startswith(ref + "/") for path in manifest.get("files", {})):
        return resolve_model(ref)  # the manifest points elsewhere: a hub id or another stage's output
    local, _ = manifests.fetch(manifest["uri"], manifests.local_cache_dir(manifest["uri"]), subdir=ref)
    if manifest.get("base_model"):  # a LoRA adapter: later stages get base + adapter as one full model
        return str(lora.merged_checkpoint(local, resolve_model(manifest["base_model"]), manifest.get("model_config")))
    return str(local)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    # The stages put the BOS before every plain prompt (data.encode_prompt). A tokenizer that does not add it
    # itself is told to, so the copy saved with each model encodes text as training did for anyone who loads
    # it with AutoTokenizer (the stages' own encodings do not change: they add special tokens by hand).
    bos = tokenizer.bos_token_id
    if bos is not None and hasattr(tokenizer, "update_post_processor") and tokenizer("0")["input_ids"][:1] != [bos]:
        tokenizer.add_bos_token = True
    return tokenizer


def kernels(cfg) -> dict:
    """The kernels a training stage's models load with, from its config's flash_attn, use_liger_kernel and
    torch_compile: keyword arguments of load_causal_lm and load_scalar_model."""
    return {"flash_attn": cfg.flash_attn, "liger": use_liger(cfg.use_liger_kernel), "torch_compile": cfg.torch_compile}


@functools.cache
def use_liger(asked: bool) -> bool:
    """Whether Liger's kernels run: when asked for (the default), on CUDA (they are Triton kernels; CPU runs
    keep the eager ones) and with liger-kernel installed (the gpu extra), which is logged when missing."""
    if not asked or not torch.cuda.is_available():
        return False
    if importlib.util.find_spec("liger_kernel") is None:
        logger.warning(
            "use_liger_kernel: the liger-kernel package is missing (pip install 'rlhf-flow[gpu]'); using eager kernels"
        )
        return False
    return True


def attn_implementation(flash_attn: bool) -> str:
    """The attention kernels to load models with: FlashAttention-2 when asked for and possible, else
    PyTorch's scaled_dot_product_attention (transformers' own default)."""
    if not flash_attn:
        return "sdpa"
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    missing = (
        "a CUDA GPU" if not torch.cuda.is_available() else "the flash-attn package (pip install 'rlhf-flow[flash]')"
    )
    logger.warning("flash_attn: %s is missing; using PyTorch's SDPA attention kernels instead", missing)
    return "sdpa"


def with_liger(model):
    """`model` with Liger's RMSNorm, SwiGLU and RoPE kernels patched in (an architecture Liger does not know
    is logged by Liger and left as it is)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    # The fused linear cross-entropy is off: the stages never pass labels; head_logprobs does that part.
    _apply_liger_kernel_to_instance(
        model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
    return model


def load_causal_lm(
    path: str,
    dtype: torch.dtype = torch.float32,
    flash_attn: bool = False,
    liger: bool = False,
    torch_compile: bool = False,
):
    """A causal LM; with `liger`, Liger's kernels and its log-probs taken a chunk of tokens at a time. With
    `torch_compile` (its blocks are to be compiled: strategy.prepare), the chunked log-probs alone: torch.compile
    fuses the norms and the MLP in Liger's place, and Liger's Triton kernels inside compiled blocks trained the
    demo's SFT to another loss curve on the H200 (1.42 against 1.34 after 20 steps, 2026-12-02)."""
    from transformers import AutoModelForCausalLM

    refuse_vision_model(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation(flash_attn))
    if liger and not torch_compile:
        with_liger(model)
    model.chunked_logprobs = liger  # read by chunked_head
    return model


def _config_dict(path_or_config) -> dict:
    if isinstance(path_or_config, (str, Path)):
        config = Path(path_or_config) / "config.json"
        if config.is_file():
            return json.loads(config.read_text())
        from transformers import AutoConfig  # a hub id (resolve_model passes those on as they are)

        try:
            return AutoConfig.from_pretrained(str(path_or_config)).to_dict()
        except (OSError, ValueError):  # not there, or offline: the loader that follows says so in its own words
            return {}
    return path_or_config if isinstance(path_or_config, dict) else path_or_config.to_dict()


def is_vision_model(path_or_config) -> bool:
    """Whether a model (a local folder, a hub id, a config or its dict) takes images: its config has a vision_config."""
    return bool(_config_dict(path_or_config).get("vision_config"))


def refuse_vision_model(path: str) -> None:
    """The text stages' guard: a vision-language model (its config has a vision_config) would load as a causal LM
    and then fail, or train without its images. SFT, RL and eval load one through tasks.common.nn.vision before they
    reach here; the others do not take one yet."""
    from tasks.common.config import ConfigError

    if is_vision_model(path):
        raise ConfigError(
            f"{path}: a vision-language model (its config has a vision_config), which this stage does not take yet "
            "(SFT, RL and eval do); pass a text model to this stage"
        )


def compile_blocks(model) -> int:
    """torch.compile each transformer block in place; returns how many. Block by block, not the whole model:
    gradient checkpointing keeps wrapping each block (the recompute reruns the compiled code), and the
    DeepSpeed hooks on parameters and gradients stay outside the compiled graphs. The blocks share one
    compiled graph (parameters are its inputs); new batch or sequence sizes recompile until torch marks them dynamic.

    transformers' FlashAttention-2 path reads each block's layer index. An integer attribute of a module is a
    constant to torch.compile by default, so every block recompiled for its own index, and past torch's limit
    of 8 the rest ran uncompiled (16 of the 0.5B shape's 24 on the H200, 2026-12-04). Read as a value like any
    integer input instead, the index changes nothing after the first recompile."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not blocks:
        raise ValueError(
            f"torch_compile: {type(model).__name__} has no transformer blocks transformers knows; drop --torch_compile"
        )
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    for block in blocks:
        block.compile()
    return len(blocks)


def load_scalar_model(
    path: str,
    dtype: torch.dtype = torch.float32,
    flash_attn: bool = False,
    liger: bool = False,
    torch_compile: bool = False,
):
    """A model with a one-output head on every token: reward models and critics (Liger's kernels as load_causal_lm)."""
    from transformers import AutoModelForSequenceClassification

    refuse_vision_model(path)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=dtype, attn_implementation=attn_implementation(flash_attn)
    )
    if model.config.pad_token_id is None:
        raise ValueError(f"{path}: config has no pad_token_id; a scalar head needs it to find the last token")
    return with_liger(model) if liger and not torch_compile else model


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as `generate()` computes them: cumsum(mask) - 1."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def packed_attention_mask(config, sequence_index: torch.Tensor, device) -> torch.Tensor | None:
    """None for FlashAttention-2, which finds the sequences in the restarting position ids; otherwise a
    block-diagonal causal mask [1, 1, T, T], so no token attends across sequences."""
    if config._attn_implementation == "flash_attention_2":
        return None
    same = sequence_index[:, None] == sequence_index[None, :]
    return (same & torch.ones_like(same).tril())[None, None].to(device)


def sequence_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    return_entropy: bool = False,
    temperature: float = 1.0,
    start: int = 0,
    entropy_grad: bool = True,
):
    """log p(token t+1 | tokens ≤ t) for every position t ≥ start under softmax(logits / temperature):
    [B, T] -> [B, T-1-start] (and that distribution's entropy; entropy_grad=False keeps it out of autograd).
    RL passes its sampling temperature, so the ratio, KL and entropy are those of the policy that sampled the
    rollout, and start = prompt width - 1: the output head and its vocabulary-wide passes skip the prompt."""
    chunked = chunked_head(model)
    if chunked:
        backbone, head = chunked
        hidden = backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids(attention_mask),
            use_cache=False,
        ).last_hidden_state
        return head_logprobs(
            hidden[:, start:-1], head, input_ids[:, start + 1 :], temperature, return_entropy, entropy_grad=entropy_grad
        )
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask), use_cache=False
    ).logits
    logits = logits[:, start:-1]
    logprobs = token_logprobs(logits, input_ids[:, start + 1 :], temperature)  # divides inside, fused on a GPU
    if not return_entropy:
        return logprobs
    return logprobs, token_entropy(logits, temperature, entropy_grad)


def token_nll_sum(
    model,
    input_ids: torch.Tensor,
    target_mask: torch.Tensor,
    positions: torch.Tensor,
    attention_mask=None,
    sequence_index=None,
) -> torch.Tensor | None:
    """Σ -log p(input_ids[:, t+1] | tokens ≤ t) over the positions t where target_mask ([B, T-1]) is 1, for rows
    padded to one width (their attention_mask) or packed into one (its sequence_index, as packed_logprobs), through
    Liger's fused linear cross-entropy (vocab.fused_linear_nll_sum). None where that kernel does not apply: off
    CUDA, without Liger (load_causal_lm's `liger`), or a head that is not a plain bias-free linear layer (LoRA on
    the head; ZeRO-3's shards): the caller then takes the log-probabilities' path."""
    chunked = chunked_head(model)
    if chunked is None or not input_ids.is_cuda:
        return None
    backbone, head = chunked
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    if sequence_index is not None:
        attention_mask = packed_attention_mask(getattr(model, "module", model).config, sequence_index, input_ids.device)
    hidden = backbone(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False
    ).last_hidden_state
    return fused_linear_nll_sum(hidden[:, :-1], head.weight, input_ids[:, 1:], target_mask)


def chunked_head(model):
    """(backbone, output head) of a causal LM loaded with Liger (load_causal_lm), whose log-probs come from the last
    hidden states a chunk of tokens at a time; None for the full-logits path. The backbone is called directly, as
    token_values does (LoRA layers stay injected; a DeepSpeed engine's forward adds nothing below ZeRO-3). Under
    ZeRO-3 the head's weight lives in shards that only its own single forward gathers: the full-logits path."""
    inner = lora.unwrap(model)
    if not getattr(inner, "chunked_logprobs", False):
        return None
    head = inner.get_output_embeddings()
    if hasattr(head.weight, "ds_id"):
        return None
    return getattr(inner, inner.base_model_prefix), head


def token_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The scalar head applied to every token's hidden state: [B, T]."""
    model = lora.unwrap(model)  # a peft wrapper's attributes are not the transformers model's
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask), use_cache=False
    ).last_hidden_state
    return model.score(hidden).squeeze(-1).float()


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The scalar head at each sequence's last real token: [B]."""
    values = token_values(model, input_ids, attention_mask)
    rows = torch.arange(values.size(0), device=values.device)
    return values[rows, last_token_index(attention_mask)]
