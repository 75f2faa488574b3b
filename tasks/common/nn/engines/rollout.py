"""What every rollout engine returns: a batch of sampled responses (Rollout), or request by request (Completion).

rollout = engine.generate(prompt_ids, max_new_tokens=16, temperature=1.0)
rollout.sequences, rollout.attention_mask   # [B, P+R]: prompts left-padded, responses right-padded
rollout.response_mask                       # [B, R]: 1 up to and including the first stop token
rollout.texts(tokenizer)                    # decoded responses, stop token stripped
rollout.logprobs                            # [B, R] the engine's own log-probabilities, or None
rollout.images                              # a vision-language rollout: each row's images (list per row), or None

requests = engine if hasattr(engine, "submit") else BatchedRequests(engine)
requests.submit(key=3, prompt_ids=ids, max_new_tokens=16)
finished = requests.step()                  # [Completion(key=3, token_ids=[...], logprobs=[...])], or [] not yet
requests.abort([3])                         # drop a request not finished yet
rollout, dropped = first_groups(requests, prompt_ids, group_size=8, keep=16, max_new_tokens=4096, temperature=1.0, pad_id=0)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tasks.common.nn.data import decode_rows, pad, stop_token_ids


@dataclass
class Rollout:
    sequences: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_width: int
    logprobs: torch.Tensor | None = (
        None  # [B, R]: the engine's own log-probabilities of the response tokens (the behaviour policy's)
    )
    versions: torch.Tensor | None = (
        None  # [B, R]: the weight version that generated each response token (engines of their own)
    )
    # A vision-language model's rollout: each row's images (stored base64 PNG or PIL), which every later forward pass
    # of these rows needs beside their tokens (the prompt's placeholders stand for them). None for text.
    images: list[list] | None = None

    @property
    def responses(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_width :]

    def texts(self, tokenizer) -> list[str]:
        stops = torch.tensor(stop_token_ids(tokenizer), dtype=self.responses.dtype, device=self.responses.device)
        return decode_rows(tokenizer, self.responses, self.response_mask.bool() & ~torch.isin(self.responses, stops))

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
            images=pick(self.images, rows),
        )

    def to(self, device) -> "Rollout":
        return Rollout(
            self.sequences.to(device),
            self.attention_mask.to(device),
            self.response_mask.to(device),
            self.prompt_width,
            *(None if t is None else t.to(device) for t in (self.logprobs, self.versions)),
            images=self.images,
        )


def pick(values: list | None, rows) -> list | None:
    """The entries of a per-row list at `rows` (an index tensor, list or slice), as tensor indexing picks rows."""
    if values is None:
        return None
    if isinstance(rows, slice):
        return values[rows]
    if isinstance(rows, torch.Tensor):
        rows = rows.reshape(-1).tolist()
    return [values[i] for i in rows]


@dataclass
class Completion:
    """A finished request: its response's token ids (up to and including the stop token) and, if the engine
    reports them, their log-probabilities."""

    key: int
    token_ids: list[int]
    logprobs: list[float] | None


def to_rollout(
    prompt_ids: list[list[int]],
    responses: list[list[int]],
    logprobs: list[list[float]] | None,
    pad_id: int,
    images: list[list] | None = None,
) -> Rollout:
    """A Rollout of prompts (left-padded) and engine responses (right-padded; each ends at EOS or the
    length limit, so every generated token is a response token), with the engine's log-probabilities if asked for."""
    p_ids, p_mask = pad(prompt_ids, pad_id, side="left")
    r_ids, r_mask = pad(responses, pad_id)
    r_logprobs = None
    if logprobs is not None:
        r_logprobs = torch.zeros(r_ids.shape, dtype=torch.float32)
        for row, values in enumerate(logprobs):
            r_logprobs[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return Rollout(
        torch.cat([p_ids, r_ids], 1),
        torch.cat([p_mask, r_mask], 1),
        r_mask,
        p_ids.size(1),
        logprobs=r_logprobs,
        images=images,
    )


class BatchedRequests:
    """Request-level calls on an engine that generates whole batches (the HF engine): `step` generates every
    prompt submitted since the last step in one `generate`, so a step finishes all of them."""

    def __init__(self, engine):
        self.engine, self.queue = engine, []

    def submit(
        self, key: int, prompt_ids: list[int], max_new_tokens: int, temperature: float = 1.0, greedy: bool = False
    ) -> None:
        self.queue.append((key, prompt_ids, (max_new_tokens, temperature, greedy)))

    def step(self) -> list[Completion]:
        queue, self.queue = self.queue, []
        if not queue:
            return []
        sampling = {q[2] for q in queue}
        if len(sampling) > 1:
            raise ValueError(
                f"one batch generates with one (max_new_tokens, temperature, greedy); got {sorted(sampling)}"
            )
        max_new_tokens, temperature, greedy = sampling.pop()
        rollout = self.engine.generate([q[1] for q in queue], max_new_tokens, temperature, greedy=greedy)
        logprobs = rollout.logprobs.tolist() if rollout.logprobs is not None else [None] * len(queue)
        finished = []
        for (key, _, _), ids, mask, values in zip(
            queue, rollout.responses.tolist(), rollout.response_mask.tolist(), logprobs
        ):
            kept = [i for i, m in enumerate(mask) if m]
            finished.append(
                Completion(key, [ids[i] for i in kept], None if values is None else [values[i] for i in kept])
            )
        return finished

    def abort(self, keys) -> None:
        """Drop the queued requests of `keys` (a step finishes every request it starts, so nothing runs)."""
        keys = set(keys)
        self.queue = [q for q in self.queue if q[0] not in keys]


def first_groups(
    requests,
    prompt_ids: list[list[int]],
    group_size: int,
    keep: int,
    max_new_tokens: int,
    temperature: float,
    pad_id: int,
) -> tuple[Rollout, int]:
    """Over-sampling with an early cut (--over_sampling_batch_size; slime's): every prompt submitted at once (the
    samples of a group are consecutive rows), the first `keep` groups to finish all their samples kept, the rest
    aborted as soon as that many are done. Returns (the rollout of every row, a dropped group's rows with empty
    responses, the number of groups dropped). The cut favours groups of short responses: the long tail's
    stragglers are the ones dropped."""
    groups = len(prompt_ids) // group_size
    if groups * group_size != len(prompt_ids) or not 0 < keep <= groups:
        raise ValueError(
            f"first_groups: keep {keep} of {len(prompt_ids)} prompts in groups of {group_size}: not possible"
        )
    for row, ids in enumerate(prompt_ids):
        requests.submit(row, ids, max_new_tokens, temperature)
    done: dict[int, Completion] = {}
    left = [group_size] * groups
    kept: list[int] = []  # groups in the order they finished
    while len(kept) < keep:
        for completion in requests.step():
            done[completion.key] = completion
            left[completion.key // group_size] -= 1
            if not left[completion.key // group_size]:
                kept.append(completion.key // group_size)
    kept = sorted(kept[:keep])
    kept_rows = {g * group_size + i for g in kept for i in range(group_size)}
    requests.abort([row for row in range(len(prompt_ids)) if row not in done])
    responses = [done[row].token_ids if row in kept_rows else [] for row in range(len(prompt_ids))]
    has_logprobs = any(c.logprobs is not None for c in done.values())
    logprobs = [done[row].logprobs if row in kept_rows else [] for row in range(len(prompt_ids))]
    return to_rollout(prompt_ids, responses, logprobs if has_logprobs else None, pad_id), groups - keep


def response_mask(responses: torch.Tensor, stop_ids: int | list[int]) -> torch.Tensor:
    """1 for each response token up to and including the first stop token (all of them without one)."""
    is_eos = torch.isin(responses, torch.tensor(stop_ids, dtype=responses.dtype, device=responses.device).reshape(-1))
    eos_seen_before = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~eos_seen_before).long()


def distinct_rows(rows: list[list[int]]) -> tuple[list[int], list[int]]:
    """(firsts, inverse): the index of each distinct row's first occurrence, and for every row the position of
    its distinct row in `firsts`, so rows[i] == rows[firsts[inverse[i]]]."""
    seen: dict[tuple[int, ...], int] = {}
    firsts, inverse = [], []
    for i, row in enumerate(rows):
        k = seen.setdefault(tuple(row), len(seen))
        if k == len(firsts):
            firsts.append(i)
        inverse.append(k)
    return firsts, inverse


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

    images = [c.images for c in chunks]
    if any(i is None for i in images) and not all(i is None for i in images):
        raise ValueError("concat_rollouts: some rollouts carry images and some do not; join like with like")
    return Rollout(
        torch.cat(seqs),
        torch.cat(masks),
        torch.cat(r_masks),
        p_width,
        joined("logprobs"),
        joined("versions"),
        images=None if images[0] is None else [row for i in images for row in i],
    )
