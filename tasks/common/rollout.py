"""Rollout engines: turn prompts into sampled responses, behind one interface.

    engine = HFRolloutEngine(policy, tokenizer)
    rollout = engine.generate(prompt_ids, max_new_tokens=16, temperature=1.0)
    rollout.sequences, rollout.attention_mask   # [B, P+R]: prompts left-padded, responses right-padded
    rollout.response_mask                       # [B, R]: 1 up to and including the first EOS
    rollout.texts(tokenizer)                    # decoded responses

Positions in training forward passes are cumsum(attention_mask) - 1, which is what `generate()`
uses for left-padded prompts, so log-probabilities match between generation and training.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tasks.common.data import pad


@dataclass
class Rollout:
    sequences: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_width: int

    @property
    def responses(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_width:]

    def texts(self, tokenizer) -> list[str]:
        out = []
        for ids, mask in zip(self.responses.tolist(), self.response_mask.tolist()):
            kept = [t for t, m in zip(ids, mask) if m and t != tokenizer.eos_token_id]
            out.append(tokenizer.decode(kept, skip_special_tokens=True))
        return out

    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)

    def select(self, rows) -> "Rollout":
        """The rollout of some rows (an index tensor, list or slice), at the same widths."""
        return Rollout(self.sequences[rows], self.attention_mask[rows], self.response_mask[rows], self.prompt_width)

    def to(self, device) -> "Rollout":
        return Rollout(self.sequences.to(device), self.attention_mask.to(device), self.response_mask.to(device), self.prompt_width)


def response_mask(responses: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """1 for each response token up to and including the first EOS (all of them without one)."""
    is_eos = responses == eos_token_id
    eos_seen_before = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~eos_seen_before).long()


class HFRolloutEngine:
    """transformers' `generate` on the policy in this process: the CPU path."""

    def __init__(self, model, tokenizer, device: torch.device | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.device = device or next(model.parameters()).device

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                 greedy: bool = False, batch_size: int = 256) -> Rollout:
        chunks = [self._generate(prompt_ids[i:i + batch_size], max_new_tokens, temperature, greedy)
                  for i in range(0, len(prompt_ids), batch_size)]
        return concat_rollouts(chunks, self.tokenizer.pad_token_id)

    def _generate(self, prompt_ids, max_new_tokens, temperature, greedy) -> Rollout:
        ids, mask = pad(prompt_ids, self.tokenizer.pad_token_id, side="left")
        ids, mask = ids.to(self.device), mask.to(self.device)
        was_training = self.model.training
        self.model.eval()
        sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
            eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id, **sampling,
        )
        self.model.train(was_training)
        responses = out[:, ids.size(1):]
        r_mask = response_mask(responses, self.tokenizer.eos_token_id)
        return Rollout(out, torch.cat([mask, r_mask], dim=1), r_mask, ids.size(1))


def concat_rollouts(chunks: list[Rollout], pad_id: int) -> Rollout:
    """Join rollouts of different prompt and response widths into one, re-padding both sides."""
    if len(chunks) == 1:
        return chunks[0]
    p_width = max(c.prompt_width for c in chunks)
    r_width = max(c.responses.size(1) for c in chunks)
    seqs, masks, r_masks = [], [], []
    for c in chunks:
        left, right = p_width - c.prompt_width, r_width - c.responses.size(1)
        seqs.append(torch.nn.functional.pad(c.sequences, (left, right), value=pad_id))
        masks.append(torch.nn.functional.pad(c.attention_mask, (left, right), value=0))
        r_masks.append(torch.nn.functional.pad(c.response_mask, (0, right), value=0))
    return Rollout(torch.cat(seqs), torch.cat(masks), torch.cat(r_masks), p_width)
