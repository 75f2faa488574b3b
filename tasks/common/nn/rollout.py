"""Rollout engines: turn prompts into sampled responses, behind one interface.

    engine = HFRolloutEngine(policy, tokenizer)
    rollout = engine.generate(prompt_ids, max_new_tokens=16, temperature=1.0)
    rollout.sequences, rollout.attention_mask   # [B, P+R]: prompts left-padded, responses right-padded
    rollout.response_mask                       # [B, R]: 1 up to and including the first stop token
    rollout.texts(tokenizer)                    # decoded responses, stop token stripped

Request by request (multi-turn episodes, tasks.rl.environment): `submit` one prompt under a key, then `step`
until it comes back as a Completion. vLLM's engine does this natively, a request joining the running batch
at its next decode step; `BatchedRequests` gives any engine that only generates whole batches the same calls.

    requests = engine if hasattr(engine, "submit") else BatchedRequests(engine)
    requests.submit(key=3, prompt_ids=ids, max_new_tokens=16)
    finished = requests.step()                  # [Completion(key=3, token_ids=[...], logprobs=[...])], or [] not yet

A response stops at the tokenizer's EOS or at the special token its chat template closes an assistant
turn with (data.stop_token_ids): a chat model ends its answer with <|im_end|> or <|eot_id|>, not EOS.

Positions in training forward passes are cumsum(attention_mask) - 1, which is what `generate()`
uses for left-padded prompts, so log-probabilities match between generation and training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tasks.common.nn.data import pad, stop_token_ids

# Static-cache prompt widths round up to this: each (batch, cache length) shape compiles its own decode.
STATIC_PROMPT_BUCKET = 64


@dataclass
class Rollout:
    sequences: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_width: int
    logprobs: torch.Tensor | None = None  # [B, R]: the engine's own log-probabilities of the response tokens (the behaviour policy's)
    versions: torch.Tensor | None = None  # [B, R]: the weight version that generated each response token (engines of their own)

    @property
    def responses(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_width :]

    def texts(self, tokenizer) -> list[str]:
        out, stops = [], set(stop_token_ids(tokenizer))
        for ids, mask in zip(self.responses.tolist(), self.response_mask.tolist()):
            kept = [t for t, m in zip(ids, mask) if m and t not in stops]
            out.append(tokenizer.decode(kept, skip_special_tokens=True))
        return out

    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)

    def oldest_versions(self) -> torch.Tensor:
        """[B]: the oldest weight version among each row's response tokens (requires `versions`)."""
        return self.versions.masked_fill(self.response_mask == 0, torch.iinfo(self.versions.dtype).max).min(-1).values

    def select(self, rows) -> "Rollout":
        """The rollout of some rows (an index tensor, list or slice), at the same widths."""
        return Rollout(
            self.sequences[rows],
            self.attention_mask[rows],
            self.response_mask[rows],
            self.prompt_width,
            *(None if t is None else t[rows] for t in (self.logprobs, self.versions)),
        )

    def to(self, device) -> "Rollout":
        return Rollout(
            self.sequences.to(device),
            self.attention_mask.to(device),
            self.response_mask.to(device),
            self.prompt_width,
            *(None if t is None else t.to(device) for t in (self.logprobs, self.versions)),
        )


@dataclass
class Completion:
    """A finished request: its response's token ids (up to and including the stop token) and, if the engine
    reports them, their log-probabilities."""

    key: int
    token_ids: list[int]
    logprobs: list[float] | None


class BatchedRequests:
    """Request-level calls on an engine that generates whole batches (the HF engine): `step` generates every
    prompt submitted since the last step in one `generate`, so a step finishes all of them."""

    def __init__(self, engine):
        self.engine, self.queue = engine, []

    def submit(self, key: int, prompt_ids: list[int], max_new_tokens: int, temperature: float = 1.0, greedy: bool = False) -> None:
        self.queue.append((key, prompt_ids, (max_new_tokens, temperature, greedy)))

    def step(self) -> list[Completion]:
        queue, self.queue = self.queue, []
        if not queue:
            return []
        sampling = {q[2] for q in queue}
        if len(sampling) > 1:
            raise ValueError(f"one batch generates with one (max_new_tokens, temperature, greedy); got {sorted(sampling)}")
        max_new_tokens, temperature, greedy = sampling.pop()
        rollout = self.engine.generate([q[1] for q in queue], max_new_tokens, temperature, greedy=greedy)
        logprobs = rollout.logprobs.tolist() if rollout.logprobs is not None else [None] * len(queue)
        finished = []
        for (key, _, _), ids, mask, values in zip(queue, rollout.responses.tolist(), rollout.response_mask.tolist(), logprobs):
            kept = [i for i, m in enumerate(mask) if m]
            finished.append(Completion(key, [ids[i] for i in kept], None if values is None else [values[i] for i in kept]))
        return finished


def response_mask(responses: torch.Tensor, stop_ids: int | list[int]) -> torch.Tensor:
    """1 for each response token up to and including the first stop token (all of them without one)."""
    is_eos = torch.isin(responses, torch.tensor(stop_ids, dtype=responses.dtype, device=responses.device).reshape(-1))
    eos_seen_before = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~eos_seen_before).long()


class HFRolloutEngine:
    """transformers' `generate` on the policy in this process: the CPU path.

    static_cache: a static KV cache, which on CUDA makes transformers compile the decode step; prompts are
    left-padded to a multiple of STATIC_PROMPT_BUCKET so varying prompt widths reuse a few compiled shapes.
    """

    def __init__(self, model, tokenizer, device: torch.device | None = None, static_cache: bool = False):
        self.model, self.tokenizer, self.static_cache = model, tokenizer, static_cache
        self.stop_ids = stop_token_ids(tokenizer)
        self.device = device or next(model.parameters()).device

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 1.0, greedy: bool = False, batch_size: int = 256) -> Rollout:
        chunks = [self._generate(prompt_ids[i : i + batch_size], max_new_tokens, temperature, greedy) for i in range(0, len(prompt_ids), batch_size)]
        return concat_rollouts(chunks, self.tokenizer.pad_token_id)

    def _generate(self, prompt_ids, max_new_tokens, temperature, greedy) -> Rollout:
        ids, mask = pad(prompt_ids, self.tokenizer.pad_token_id, side="left")
        cache = {}
        if self.static_cache:  # extra left padding is harmless: positions come from the attention mask
            extra = -ids.size(1) % STATIC_PROMPT_BUCKET
            ids = torch.nn.functional.pad(ids, (extra, 0), value=self.tokenizer.pad_token_id)
            mask = torch.nn.functional.pad(mask, (extra, 0), value=0)
            cache = {"cache_implementation": "static"}
        ids, mask = ids.to(self.device), mask.to(self.device)
        was_training = self.model.training
        self.model.eval()
        sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        recorder = LogprobRecorder(1.0 if greedy else temperature)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            logits_processor=[recorder],
            eos_token_id=self.stop_ids or None,
            pad_token_id=self.tokenizer.pad_token_id,
            **sampling,
            **cache,
        )
        self.model.train(was_training)
        responses = out[:, ids.size(1) :]
        r_mask = response_mask(responses, self.stop_ids)
        return Rollout(out, torch.cat([mask, r_mask], dim=1), r_mask, ids.size(1), recorder.finish(responses).cpu())


class LogprobRecorder:
    """A logits processor keeping the log-probability of each sampled token under the distribution it was sampled
    from (softmax(logits / temperature)): the behaviour policy's, for off-policy correction and the check against
    the trainer's. It holds one step's distribution at a time; the token drawn from it is read at the next step.
    (transformers applies its temperature after the processors passed in, so the division is done here.)"""

    def __init__(self, temperature: float):
        self.temperature, self.previous, self.steps = temperature, None, []

    def _take(self, tokens: torch.Tensor) -> None:
        self.steps.append(self.previous.gather(1, tokens[:, None]).squeeze(1))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self._take(input_ids[:, -1])
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, responses: torch.Tensor) -> torch.Tensor:
        """[B, R]: the log-probability of each generated token."""
        if self.previous is not None and len(self.steps) < responses.size(1):
            self._take(responses[:, len(self.steps)])
        self.previous = None
        return torch.stack(self.steps, dim=1) if self.steps else torch.zeros(responses.shape)


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

    def joined(name: str):  # an optional [B, R] field, kept when every chunk has it
        parts = [getattr(c, name) for c in chunks]
        if any(p is None for p in parts):
            return None
        return torch.cat([torch.nn.functional.pad(p, (0, r_width - p.size(1)), value=0) for p in parts])

    return Rollout(torch.cat(seqs), torch.cat(masks), torch.cat(r_masks), p_width, joined("logprobs"), joined("versions"))
