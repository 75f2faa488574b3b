"""Micro-batches by a token budget (tasks.common.nn.token_batches): hand-checked packings."""

import random

import pytest

from tasks.common.nn.token_batches import packed_tokens, padded_tokens, token_batches


def test_rows_of_similar_length_are_packed_longest_first_within_the_budget():
    # longest first: 8 (row 2), 7 (row 4), 5 (row 0), 3 (row 1), 2 (row 3)
    #   [2, 4]: 2 × 8 = 16 ≤ 16; adding row 0 would make 3 × 8 = 24
    #   [0, 1, 3]: 3 × 5 = 15 ≤ 16
    lengths = [5, 3, 8, 2, 7]
    assert token_batches(lengths, 16) == [[2, 4], [0, 1, 3]]
    assert [padded_tokens(lengths, b) for b in token_batches(lengths, 16)] == [16, 15]
    assert token_batches(lengths, 1000) == [[2, 4, 0, 1, 3]]  # a budget above the whole: one micro-batch


def test_a_row_longer_than_the_budget_gets_a_micro_batch_of_its_own():
    # row 0 alone (20 > 10); rows 1 and 2: 2 × 4 = 8; row 3 would make 3 × 4 = 12
    assert token_batches([20, 4, 4, 4], 10) == [[0], [1, 2], [3]]
    assert token_batches([20, 30], 10) == [[1], [0]]


def test_packed_micro_batches_count_the_sum_of_their_lengths():
    # longest first: 8, 7, 5, 3, 2. Packed: [2] 8 (8 + 7 = 15 > 12), [4] 7 (7 + 5 = 12 ≤ 12) with row 0, then
    # [1, 3] 3 + 2 = 5. Padded, the same budget gives four: [2], [4] (2 × 8 > 12), [0, 1] (2 × 5), [3] (3 × 5 > 12).
    lengths = [5, 3, 8, 2, 7]
    assert token_batches(lengths, 12, packed=True) == [[2], [4, 0], [1, 3]]
    assert [packed_tokens(lengths, b) for b in token_batches(lengths, 12, packed=True)] == [8, 12, 5]
    assert token_batches(lengths, 12) == [[2], [4], [0, 1], [3]]
    # min_count splits the largest packed micro-batch, [4, 0] (12)
    assert token_batches(lengths, 12, min_count=4, packed=True) == [[2], [4], [0], [1, 3]]


def test_equal_lengths_keep_their_order():
    assert token_batches([4, 4, 4, 4, 4], 8) == [[0, 1], [2, 3], [4]]


def test_min_count_splits_the_largest_micro_batch_first():
    lengths = [5, 3, 8, 2, 7]  # [[2, 4], [0, 1, 3]], padded 16 and 15
    assert token_batches(lengths, 16, min_count=2) == [[2, 4], [0, 1, 3]]  # already enough
    # 3: split [2, 4] (16): [2] 8, [4] 7, [0, 1, 3] 15
    assert token_batches(lengths, 16, min_count=3) == [[2], [4], [0, 1, 3]]
    # 4: then [0, 1, 3] (15), its longer half first: [0, 1] 10 and [3] 2
    assert token_batches(lengths, 16, min_count=4) == [[2], [4], [0, 1], [3]]
    assert token_batches(lengths, 16, min_count=5) == [[2], [4], [0], [1], [3]]
    with pytest.raises(ValueError, match="min_count: 6 micro-batches cannot be made of 5 rows"):
        token_batches(lengths, 16, min_count=6)


def test_a_bad_budget_is_refused_and_no_rows_give_no_micro_batches():
    with pytest.raises(ValueError, match="max_tokens"):
        token_batches([3], 0)
    assert token_batches([], 16) == []


def test_every_row_once_and_every_micro_batch_within_the_budget():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(1, 400)
        min_count = rng.randint(0, len(lengths))
        batches = token_batches(lengths, budget, min_count)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        assert len(batches) >= min_count
        assert all(padded_tokens(lengths, b) <= budget or len(b) == 1 for b in batches)
        plain = token_batches(lengths, budget)
        assert len(batches) == max(len(plain), min_count)  # each split adds one, and only while short
