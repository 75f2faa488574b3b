"""The forward passes of packed rows (--packing_samples): several sequences in one row, no padding, no token
attending across sequences (FlashAttention-2's varlen path reads the boundaries from the restarting position ids;
other kernels get a block-diagonal mask). Each gives what its padded twin in tasks.common.nn.models gives.

    ids, positions, index = data.pack(rows)                                     # tasks.common.nn.data
    logprobs = packed_logprobs(policy, ids, positions, index)                  # [1, T-1], as sequence_logprobs
    logprobs = packed_sequence_logprobs(policy, input_ids, attention_mask)     # a padded batch run packed: [B, T-1]
    scores = packed_scores(reward_model, ids, positions, index)                # one per sequence, as sequence_scores
"""

from __future__ import annotations

import torch

from tasks.common.nn import lora
from tasks.common.nn.models import chunked_head, packed_attention_mask, position_ids
from tasks.common.nn.vocab import head_logprobs, token_entropy, token_logprobs


def packed_logprobs(
    model, input_ids: torch.Tensor, position_ids: torch.Tensor, sequence_index: torch.Tensor
) -> torch.Tensor:
    """sequence_logprobs of a packed row (tasks.common.nn.data.pack): [1, T] -> [1, T-1]. No token attends
    across sequences: FlashAttention-2 reads the boundaries from the restarting position ids (varlen);
    the other kernels get a block-diagonal causal mask. A sequence's last position predicts the next
    sequence's first token: callers mask it out (a prompt token, never in the loss)."""
    mask = packed_attention_mask(getattr(model, "module", model).config, sequence_index, input_ids.device)
    chunked = chunked_head(model)
    if chunked:
        backbone, head = chunked
        hidden = backbone(
            input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return head_logprobs(hidden[:, :-1], head, input_ids[:, 1:])
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
    return token_logprobs(logits[:, :-1], input_ids[:, 1:])


def packed_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """A padded batch [B, T] as one packed row without its padding: (ids [1, N], position_ids [1, N], sequence index
    [N], index [B, T]: where each token went in the packed row, -1 for padding). Positions are the padded path's
    (cumsum(mask) - 1), so a row's numbers are the same either way, to float rounding."""
    live = attention_mask > 0
    index = torch.where(live, live.flatten().cumsum(0).view_as(live) - 1, -1)
    rows = torch.arange(live.size(0), device=live.device)[:, None].expand_as(live)
    return input_ids[live][None], position_ids(attention_mask)[live][None], rows[live], index


def _scatter(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """values [M] into a zero tensor of where's shape at its True places, row-major (autograd flows through)."""
    return torch.zeros(where.shape, dtype=values.dtype, device=values.device).masked_scatter(where, values)


def packed_sequence_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    return_entropy: bool = False,
    temperature: float = 1.0,
    start: int = 0,
    entropy_grad: bool = True,
):
    """sequence_logprobs of a padded batch run as one packed row (--packing_samples): the same [B, T-1-start] to float
    rounding, but no compute on padding, and 0 wherever the token or the one before it is padding (never in a loss).
    Only the positions that predict a real token reach the output head."""
    ids, positions, rows, index = packed_rows(input_ids, attention_mask)
    source, target = index[:, start:-1], index[:, start + 1 :]
    want = (source >= 0) & (target >= 0)
    at, labels = source[want], input_ids[:, start + 1 :][want]
    mask = packed_attention_mask(lora.unwrap(model).config, rows, ids.device)
    chunked = chunked_head(model)
    if chunked:
        backbone, head = chunked
        hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).last_hidden_state
        out = head_logprobs(hidden[0, at], head, labels, temperature, return_entropy, entropy_grad=entropy_grad)
    else:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[0, at]
        out = token_logprobs(logits, labels, temperature)
        if return_entropy:
            out = (out, token_entropy(logits, temperature, entropy_grad))
    if not return_entropy:
        return _scatter(out, want)
    return _scatter(out[0], want), _scatter(out[1], want)


def packed_token_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int = 0) -> torch.Tensor:
    """token_values(...)[:, start:-1] of a padded batch run as one packed row: [B, T-1-start], 0 at padding."""
    model = lora.unwrap(model)
    ids, positions, rows, index = packed_rows(input_ids, attention_mask)
    source = index[:, start:-1]
    want = source >= 0
    mask = packed_attention_mask(model.config, rows, ids.device)
    hidden = getattr(model, model.base_model_prefix)(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
    ).last_hidden_state
    return _scatter(model.score(hidden[0, source[want]]).squeeze(-1).float(), want)


def packed_scores(
    model, input_ids: torch.Tensor, position_ids: torch.Tensor, sequence_index: torch.Tensor
) -> torch.Tensor:
    """sequence_scores of a packed row (tasks.common.nn.data.pack): [1, T] -> [number of sequences], the scalar
    head at each sequence's last token, with no token attending across sequences."""
    model = lora.unwrap(model)
    backbone = getattr(model, model.base_model_prefix)
    mask = packed_attention_mask(model.config, sequence_index, input_ids.device)
    hidden = backbone(
        input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    values = model.score(hidden).squeeze(-1).float()[0]
    index = sequence_index.to(values.device)
    last = torch.cat(
        [(index[1:] != index[:-1]).nonzero().squeeze(-1), torch.tensor([index.numel() - 1], device=values.device)]
    )
    return values[last]
