"""The attention functions the transformers engine's decode loop runs (tasks/common/nn/engines/hf_engine.py), registered
with transformers under DECODE_ATTENTION and FLASH_DECODE_ATTENTION: SDPA on grouped key/value heads as they are,
and flash-attn's kv-cache kernel where it is installed.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask


def packed_gqa_sdpa(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' SDPA attention, except that a one-token query of grouped-query attention runs on the key/value
    heads as they are: [B, H, 1, D] becomes [B, KV, H/KV, D] (heads j*G ... j*G+G-1 share key/value head j, as
    repeat_kv lays them out), so the cache is never copied into H heads. transformers 5.17 repeats K and V for
    any masked call (newer versions pack as here): on the H200 that copy took 2.4 of a 0.5B decode step's 6.0 ms
    of GPU time, against 3.1 ms in all with this (bench/results.json, 2026_12_04d)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    batch, heads, _, dim = query.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, heads // groups, groups, dim), key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


# The decode loop's attention; its prefill (a 2D padding mask) builds SDPA's masks.
DECODE_ATTENTION = "sdpa_packed_gqa"
AttentionInterface.register(DECODE_ATTENTION, packed_gqa_sdpa)
AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)

try:
    from flash_attn import flash_attn_with_kvcache
except ImportError:  # the CPU install: no flash-attn
    flash_attn_with_kvcache = None

if flash_attn_with_kvcache is not None:
    # A custom op, so a compiled decode forward keeps it inside one graph (flash-attn registers its training
    # kernels this way, not the kv-cache one).
    @torch.library.custom_op("rlhf_flow::flash_decode", mutates_args=(), device_types="cuda")
    def flash_decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seqlens: torch.Tensor,
        leftpad: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, cache_leftpad=leftpad, softmax_scale=scale
        ).contiguous()

    @flash_decode.register_fake
    def _(q, k_cache, v_cache, seqlens, leftpad, scale):
        return q.new_empty(q.shape)


def flash_kvcache_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The decode step's attention through flash-attn's kv-cache kernel: it reads only each row's written slots
    (the static cache holds prompt + every response slot, and SDPA reads all of them each step), splits long
    caches across blocks, and packs a one-token query's grouped heads onto their key/value head. The mask is the
    engine's [B, 1, 1, L] one, each row's written slots one run: left padding, then prompt and tokens so far. The
    prefill (a longer query), float32 (flash-attn takes half precision only) and a machine without flash-attn go to
    packed_gqa_sdpa."""
    half = query.dtype in (torch.float16, torch.bfloat16)
    if query.shape[2] != 1 or not half or flash_attn_with_kvcache is None or kwargs.get("sliding_window"):
        return packed_gqa_sdpa(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    written = attention_mask[:, 0, 0, :]
    leftpad = written.int().argmax(-1).int()
    seqlens = (leftpad + written.sum(-1)).int()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # [B, H, 1, D] -> [B, 1, H, D]; the cache's [B, KV, L, D] read as [B, L, KV, D] in place
    out = torch.ops.rlhf_flow.flash_decode(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), seqlens, leftpad, scale
    )
    return out, None


# With flash-attn installed, a model that trains with it decodes through its kv-cache kernel. No "flash" in the
# name: transformers gives any implementation so named its FlashAttention masks and kernel loading.
FLASH_DECODE_ATTENTION = "kvcache_decode"
AttentionInterface.register(FLASH_DECODE_ATTENTION, flash_kvcache_attention)
AttentionMaskInterface.register(FLASH_DECODE_ATTENTION, sdpa_mask)
