"""Passes over the vocabulary: each token's log-probability and the sampling distribution's entropy from logits, or
from the last hidden states a chunk of tokens at a time (never the full [tokens, vocabulary] float32 logits), and
the summed NLL through Liger's fused linear cross-entropy. On a GPU they run compiled.

    logprobs = token_logprobs(logits, labels, temperature=0.7)   # [B, T]
    logprobs = head_logprobs(hidden, lm_head, labels)           # token_logprobs(lm_head(hidden), labels), a chunk at a time
    entropy = token_entropy(logits, temperature=0.7)            # of the sampling distribution, per token
    nll = fused_linear_nll_sum(hidden, lm_head.weight, labels, mask)   # Σ -logprobs under the mask, Liger's kernel (CUDA)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(labels[t] | ·) under softmax(logits / temperature), logits of the same length: [B, T, V], [B, T] -> [B, T].

    The temperature is applied inside either path, in float32 after the upcast: dividing the bf16 logits
    beforehand would round them again and, on a GPU, write one more [B, T, V] copy.

    On a GPU this runs compiled (fused_token_logprobs): eager PyTorch makes a float32 copy of the logits,
    log-softmaxes it and, in backward, scatters into a zero tensor of the same size. At 8 × 2048 tokens and
    a 152k vocabulary each of those is 10 GB written and read; compiled, one pass reads the logits each way.
    """
    if logits.is_cuda:
        return _compiled_token_logprobs()(logits, labels, temperature)
    return torch.gather(F.log_softmax(tempered(logits.float(), temperature), dim=-1), -1, labels.unsqueeze(-1)).squeeze(
        -1
    )


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature: the logits of the distribution sampled at that temperature (vLLM's and HF's
    sampling divide them the same way). At 1.0 the logits themselves, so untempered paths stay bit-for-bit."""
    return logits if temperature == 1.0 else logits / temperature


def fused_token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """token_logprobs as logit[label] - logsumexp(logits), written so torch.compile fuses it: the label's
    logit is picked by comparison rather than gather, so backward is one elementwise expression
    (onehot - softmax) × grad instead of a scatter. Eager, it would build a [B, T, V] mask: compile it."""
    x = tempered(logits.float(), temperature)
    hit = torch.arange(x.size(-1), device=x.device) == labels.unsqueeze(-1)
    return torch.where(hit, x, 0.0).sum(-1) - torch.logsumexp(x, dim=-1)


@functools.cache
def _compiled_token_logprobs():
    return torch.compile(fused_token_logprobs, dynamic=True)


def head_logprobs(
    hidden: torch.Tensor,
    head: Callable,
    labels: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_tokens: int = 1024,
    entropy_grad: bool = True,
):
    """token_logprobs(head(hidden), labels, temperature) (and the distribution's entropy) without ever holding
    the logits of more than `chunk_tokens` tokens: [..., H] hidden states, [...] labels -> [...].
    entropy_grad=False leaves the entropy out of autograd: logged, not trained on, it then costs no backward
    passes over the vocabulary.

    The logits are the largest tensor of a causal LM's step (8 × 2048 tokens × a 152k vocabulary is 10 GB in
    float32, and eager backward makes two more); here each chunk's logits are made, reduced to log-probs and
    dropped, and the backward pass remakes them one chunk at a time (activation checkpointing), so the peak is
    one chunk's. The same numbers as the full-logits path, to float rounding
    (tests/unit/tasks/common/nn/test_vocab.py)."""
    shape = labels.shape
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.size(-1)), labels.reshape(-1)
    checkpointed = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in _parameters(head)))
    parts = []
    for start in range(0, flat_labels.numel(), chunk_tokens):
        args = (
            head,
            flat_hidden[start : start + chunk_tokens],
            flat_labels[start : start + chunk_tokens],
            temperature,
            return_entropy,
            entropy_grad,
        )
        parts.append(
            torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False)
            if checkpointed
            else _chunk_logprobs(*args)
        )
    out = torch.cat(parts, dim=-1)
    if not return_entropy:
        return out.reshape(shape)
    entropy = out[1].reshape(shape)
    return out[0].reshape(shape), (entropy if entropy_grad else entropy.detach())


def _parameters(head) -> list[torch.Tensor]:
    return list(head.parameters()) if isinstance(head, torch.nn.Module) else []


def _chunk_logprobs(
    head, hidden, labels, temperature: float, return_entropy: bool, entropy_grad: bool = True
) -> torch.Tensor:
    """One chunk of head_logprobs: [N, H] -> [N] log-probs, or [2, N] log-probs and entropies."""
    logits = head(hidden)
    logprobs = token_logprobs(logits, labels, temperature)
    if not return_entropy:
        return logprobs
    return torch.stack([logprobs, token_entropy(logits, temperature, entropy_grad)])


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, grad: bool = True) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the last dimension: [..., V] -> [...]; outside autograd
    unless grad. On a GPU compiled (fused_entropy), as token_logprobs is: eager, the upcast, log-softmax, exp
    and product each wrote a float32 copy of the logits, 0.6 GB each for 1,024 tokens of a 152k vocabulary."""
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        return (_compiled_entropy() if logits.is_cuda else fused_entropy)(logits, temperature)


def fused_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """-Σ p log p, written so torch.compile fuses it into reductions over the logits as they are."""
    log_p = tempered(logits.float(), temperature)
    log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)
    return -(log_p.exp() * log_p).sum(-1)


@functools.cache
def _compiled_entropy():
    return torch.compile(fused_entropy, dynamic=True)


def fused_linear_nll_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Σ -log softmax(hidden @ weight.T)[label] over the positions where mask is 1: [..., H], [V, H], [...], [...] -> [].
    Liger's fused linear cross-entropy (CUDA only; its kernels are Triton's): a chunk of tokens at a time it makes
    the logits in the weight's precision, and one kernel reduces them and writes their gradient in place, float32
    inside; the head's gradients are taken then, in the forward pass, so backward only scales them. Against
    head_logprobs it never writes float32 logits nor remakes them in backward (on the H200 the log-softmax and the
    copies were 56 of SFT's 195 ms of kernels a step: bench/RESULTS.md, 2026-12-04 seventh lease)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    targets = labels.masked_fill(mask == 0, -100)  # Liger's ignore_index
    return liger_fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.size(-1)),
        weight,
        targets.reshape(-1),
        reduction="sum",
        accum_dtype=torch.float32,  # the head's gradient summed over chunks in float32, not bf16
        chunk_mem_const=8,  # chunks of ~1k tokens rather than ~128 at a 152k vocabulary: 8x fewer launches
    )
