"""Micro-batches by a token budget rather than by a count of rows (issue 52, item 3): slime's --max_tokens_per_gpu,
verl's use_dynamic_bsz + ppo_max_token_len_per_gpu.

    batches = token_batches(lengths, max_tokens=16384)                 # [[row, …], …]
    batches = token_batches(lengths, max_tokens=16384, min_count=n)    # at least n micro-batches (every rank the same)
    batches = token_batches(lengths, max_tokens=16384, packed=True)     # sizes summed, not padded to the longest

A micro-batch of rows padded to its longest row costs rows × longest tokens of compute and memory. Rows are sorted
longest first and packed in that order while that padded size stays within the budget, so each micro-batch holds
rows of similar length and pads little; a row longer than the budget on its own gets a micro-batch of its own.
Packed (--packing_samples: the rows run as one sequence, no padding), a micro-batch costs the sum of its lengths.

`min_count`: ZeRO-2 reduces the gradients on every backward, so every rank of a data-parallel group must run the
same number of micro-batches (take the largest count over the ranks, strategy.all_reduce(…, op="max")). The
micro-batch of the largest padded size is split in two (its longer half first) until there are that many.
"""

from __future__ import annotations

from collections.abc import Sequence


def padded_tokens(lengths: Sequence[int], rows: Sequence[int]) -> int:
    """Tokens of `rows` padded to the longest of them: len(rows) × max length (0 for no rows)."""
    return len(rows) * max((int(lengths[i]) for i in rows), default=0)


def packed_tokens(lengths: Sequence[int], rows: Sequence[int]) -> int:
    """Tokens of `rows` packed into one sequence: the sum of their lengths."""
    return sum(int(lengths[i]) for i in rows)


def token_batches(lengths: Sequence[int], max_tokens: int, min_count: int = 0, packed: bool = False) -> list[list[int]]:
    """Row indices of each micro-batch, longest rows first, every row exactly once: each micro-batch's size
    (padded_tokens, or packed_tokens when `packed`) ≤ max_tokens unless it is one row longer than that. At least
    `min_count` micro-batches (at most one per row: a `min_count` above the number of rows is refused)."""
    lengths = [int(n) for n in lengths]
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be 1 or more, got {max_tokens}")
    if min_count > len(lengths):
        raise ValueError(f"min_count: {min_count} micro-batches cannot be made of {len(lengths)} rows")
    size = packed_tokens if packed else padded_tokens
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        # Longest first, so a padded micro-batch's first row is its longest: adding row i pads it to that length.
        if batches and size(lengths, batches[-1] + [i]) <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    while len(batches) < min_count:
        splittable = [k for k in range(len(batches)) if len(batches[k]) > 1]
        k = max(splittable, key=lambda k: (size(lengths, batches[k]), -k))  # the largest; the first of equals
        rows = batches[k]
        half = (len(rows) + 1) // 2
        batches[k : k + 1] = [rows[:half], rows[half:]]
    return batches
