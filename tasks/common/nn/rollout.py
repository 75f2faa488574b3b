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

import contextlib
from dataclasses import dataclass

import torch
from transformers import DynamicCache, StaticCache

from tasks.common.nn import lora
from tasks.common.nn.data import pad, stop_token_ids

# Static-cache prompt widths round up to this: each (batch, cache length) shape compiles its own decode.
STATIC_PROMPT_BUCKET = 64
# On CUDA the decode loop asks the device whether every row has stopped once per this many tokens: each look
# waits for every queued step, and between looks the host only queues work.
STOP_CHECK_EVERY = 16


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
    """The policy in this process decoding with a loop of its own: the CPU path, and on CUDA a fast one at small batches.

    Each step forwards the newest token of every row against the KV cache, then samples on the device. The loop
    looks at the device only every STOP_CHECK_EVERY steps on CUDA (whether every row has stopped), so the host
    queues steps ahead of the GPU instead of waiting for each.

    static_cache: a static KV cache and the decode forward compiled into CUDA graphs (torch.compile's
    "reduce-overhead"; eager on the CPU), attention through SDPA while decoding. At RL's rollout sizes a decode
    step is a few hundred microseconds of GPU work, and vLLM's scheduler and transformers' `generate` spend
    milliseconds of Python on each (bench/RESULTS.md). Prompts are left-padded to a multiple of
    STATIC_PROMPT_BUCKET so varying widths reuse a few compiled shapes, and each shape keeps its cache, so the
    graphs keep reading the same addresses. The weights are read in place: an update needs no sync.
    """

    def __init__(self, model, tokenizer, device: torch.device | None = None, static_cache: bool = False, ignore_eos: bool = False):
        self.model, self.tokenizer, self.static_cache = model, tokenizer, static_cache
        self.stop_ids = [] if ignore_eos else stop_token_ids(tokenizer)
        self.device = device or next(model.parameters()).device
        self.caches = {}  # (batch, length) -> StaticCache
        self.stop_check_every = STOP_CHECK_EVERY if self.device.type == "cuda" else 1
        self.compiled = static_cache and self.device.type == "cuda"
        self.decode = torch.compile(self._decode, mode="reduce-overhead", dynamic=False) if self.compiled else self._decode

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 1.0, greedy: bool = False, batch_size: int = 256) -> Rollout:
        chunks = [self._generate(prompt_ids[i : i + batch_size], max_new_tokens, temperature, greedy) for i in range(0, len(prompt_ids), batch_size)]
        return concat_rollouts(chunks, self.tokenizer.pad_token_id)

    def _generate(self, prompt_ids, max_new_tokens, temperature, greedy) -> Rollout:
        pad_id = self.tokenizer.pad_token_id
        ids, mask = pad(prompt_ids, pad_id, side="left")
        if self.static_cache:  # extra left padding is harmless: positions come from the attention mask
            extra = -ids.size(1) % STATIC_PROMPT_BUCKET
            ids = torch.nn.functional.pad(ids, (extra, 0), value=pad_id)
            mask = torch.nn.functional.pad(mask, (extra, 0), value=0)
        ids, mask = ids.to(self.device), mask.to(self.device)
        rows, width = ids.shape
        # Every response position is attended once written; the cache's causal mask hides the ones not yet written.
        full_mask = torch.cat([mask, torch.ones(rows, max_new_tokens, dtype=mask.dtype, device=self.device)], dim=1)
        cache = self._cache(rows, width + max_new_tokens)
        tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros(rows, max_new_tokens, device=self.device)
        stopped = torch.zeros(rows, dtype=torch.bool, device=self.device)
        stops = torch.tensor(self.stop_ids, dtype=torch.long, device=self.device)
        next_position = mask.sum(-1)  # the first response token's position: positions are cumsum(mask) - 1
        cache_positions = torch.arange(width, width + max_new_tokens, device=self.device)  # sliced on the device: no copy from the host a step
        was_training = self.model.training
        self.model.eval()
        with self._sdpa():
            logits = self.model(
                input_ids=ids,
                attention_mask=full_mask if self.static_cache else mask,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
            for t in range(max_new_tokens):
                token, logprob = sample_next(logits, temperature, greedy)
                token = token.masked_fill(stopped, pad_id)
                tokens[:, t], logprobs[:, t] = token, logprob
                stopped |= torch.isin(token, stops)
                if t + 1 == max_new_tokens or ((t + 1) % self.stop_check_every == 0 and bool(stopped.all())):
                    break
                kv_mask = full_mask if self.static_cache else full_mask[:, : width + t + 1]
                if self.compiled:
                    torch.compiler.cudagraph_mark_step_begin()  # the last step's logits are consumed: its graph's memory may be reused
                logits = self.decode(token, next_position + t, cache_positions[t : t + 1], kv_mask, cache)
        self.model.train(was_training)
        r_mask = response_mask(tokens, self.stop_ids)
        kept = int(r_mask.sum(-1).max())  # as wide as the longest response, however often the loop looked
        responses, r_mask = tokens[:, :kept], r_mask[:, :kept]
        sequences = torch.cat([ids, responses], dim=1)
        return Rollout(sequences, torch.cat([mask, r_mask], dim=1), r_mask, width, (logprobs[:, :kept] * r_mask).cpu())

    def _decode(self, token, position, cache_position, attention_mask, cache) -> torch.Tensor:
        """The logits after one new token per row, written into the cache at cache_position."""
        out = self.model(
            input_ids=token[:, None],
            position_ids=position[:, None],
            attention_mask=attention_mask,
            past_key_values=cache,
            cache_position=cache_position,
            use_cache=True,
        )
        return out.logits[:, -1]

    def _cache(self, rows: int, length: int):
        if not self.static_cache:
            return DynamicCache(config=lora.unwrap(self.model).config)
        cache = self.caches.get((rows, length))
        if cache is None:
            cache = self.caches[(rows, length)] = StaticCache(config=lora.unwrap(self.model).config, max_cache_len=length)
        else:
            cache.reset()
        return cache

    @contextlib.contextmanager
    def _sdpa(self):
        """Decoding through SDPA: FlashAttention-2 (the trainer's, for packed rows) unpads a batch with padding on
        every call, a host sync and shapes no compiled graph holds."""
        base = lora.unwrap(self.model)
        kept = base.config._attn_implementation
        if kept == "flash_attention_2":
            base.set_attn_implementation("sdpa")
        try:
            yield
        finally:
            if kept == "flash_attention_2":
                base.set_attn_implementation(kept)


def sample_next(logits: torch.Tensor, temperature: float = 1.0, greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] logits -> each row's next token and its log-probability under the distribution it was drawn from:
    softmax(logits / temperature), or softmax(logits) for the greedy pick. Sampling is the exponential race
    (argmax of p / E, E ~ Exp(1), which draws from p) so it stays on the device, with no host sync."""
    logprobs = torch.log_softmax(logits.float() / (1.0 if greedy else temperature), dim=-1)
    if greedy:
        token = logprobs.argmax(-1)
    else:
        token = (logprobs - torch.empty_like(logprobs).exponential_().log()).argmax(-1)
    return token, logprobs.gather(-1, token[:, None]).squeeze(-1)


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
