"""Per-token log-probabilities and entropy over the vocabulary (tasks/common/nn/vocab.py), eager, fused and compiled,
chunked through the LM head, at a temperature, against values computed by hand (the arithmetic is in each comment).
The losses are test_losses.py's, the advantages tests/unit/tasks/rl/test_advantages.py's."""

import math

import pytest
import torch

from tasks.common.nn.vocab import fused_entropy, fused_token_logprobs, token_logprobs

T = torch.tensor


def close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol), (
        a,
        b,
    )


# ---- policy loss options ---------------------------------------------------------------------------


# ---- advantage estimators ---------------------------------------------------------------------------


# ---- KL controllers ---------------------------------------------------------------------------------


def test_token_logprobs_by_hand():
    # logits (0, ln 3) over two tokens: p = (1/4, 3/4)
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    got = token_logprobs(logits, torch.tensor([[0, 1]]))
    assert torch.allclose(got, torch.tensor([[math.log(0.25), math.log(0.75)]]), atol=1e-6)


def test_fused_token_logprobs_compiled_matches_eager_values_and_gradients():
    """What runs on a GPU (the compiled fused form), here compiled for the CPU, against eager log-softmax."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 5, 37)).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 37, (2, 5))
    weights = torch.randn(2, 5)
    eager = token_logprobs(logits, labels)
    (grad_eager,) = torch.autograd.grad((eager * weights).sum(), logits)
    fused = torch.compile(fused_token_logprobs, dynamic=True)(logits, labels)
    (grad_fused,) = torch.autograd.grad((fused * weights).sum(), logits)
    assert fused.dtype == torch.float32
    assert torch.allclose(fused, eager, atol=1e-5)
    assert torch.allclose(grad_fused.float(), grad_eager.float(), atol=1e-2)  # bf16 gradients: 8 bits of mantissa


def test_entropy_by_hand_and_compiled_as_on_a_gpu():
    """token_entropy's expression: by hand, then compiled for the CPU (a GPU runs it compiled) against the eager
    log-softmax form, values and gradients."""
    # logits (0, ln 3): p = (1/4, 3/4); at temperature 0.5 the logits double: p = (1/10, 9/10)
    logits = torch.tensor([[0.0, math.log(3.0)]])
    for temperature, p in ((1.0, 0.25), (0.5, 0.1)):
        want = -(p * math.log(p) + (1 - p) * math.log(1 - p))
        assert fused_entropy(logits, temperature).item() == pytest.approx(want, abs=1e-6)
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 5, 37)).to(torch.bfloat16).requires_grad_()
    weights = torch.randn(2, 5)
    log_p = torch.log_softmax(logits.float() / 0.7, -1)
    eager = -(log_p.exp() * log_p).sum(-1)
    (grad_eager,) = torch.autograd.grad((eager * weights).sum(), logits)
    fused = torch.compile(fused_entropy, dynamic=True)(logits, 0.7)
    (grad_fused,) = torch.autograd.grad((fused * weights).sum(), logits)
    assert fused.dtype == torch.float32 and torch.allclose(fused, eager, atol=1e-5)
    assert torch.allclose(grad_fused.float(), grad_eager.float(), atol=1e-2)  # bf16 gradients


def test_head_logprobs_a_chunk_at_a_time_equal_the_full_logits_values_and_gradients():
    """head_logprobs (what a Liger-loaded model uses: no full logits) against token_logprobs(head(hidden)),
    chunks that do not divide the tokens, a temperature, the entropy too; gradients to the hidden states and
    the head's weight."""
    from tasks.common.nn.vocab import head_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 8, requires_grad=True)
    head = torch.nn.Linear(8, 37, bias=False)
    labels = torch.randint(0, 37, (2, 7))
    w1, w2 = torch.randn(2, 7), torch.randn(2, 7)

    def full():
        logits = head(hidden)
        log_p = torch.log_softmax(logits.float() / 0.7, -1)
        return token_logprobs(logits, labels, 0.7), -(log_p.exp() * log_p).sum(-1)

    results = []
    for fn in (full, lambda: head_logprobs(hidden, head, labels, 0.7, return_entropy=True, chunk_tokens=3)):
        logprobs, entropy = fn()
        grads = torch.autograd.grad((logprobs * w1 + entropy * w2).sum(), [hidden, head.weight])
        results.append((logprobs, entropy, *grads))
    for want, got in zip(*results):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    with torch.no_grad():  # scoring passes (reference, old log-probs) take the same path without checkpointing
        close(head_logprobs(hidden, head, labels, chunk_tokens=4), token_logprobs(head(hidden), labels))


# ---- sampling temperature -----------------------------------------------------------------------------


def test_token_logprobs_at_a_temperature_by_hand():
    # logits (0, ln 3) / 0.5 = (0, ln 9): p = (1/10, 9/10)
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    close(token_logprobs(logits, torch.tensor([[0, 1]]), temperature=0.5), [[math.log(0.1), math.log(0.9)]])
    # temperature 1.0 is the untempered formula bit for bit
    logits, labels = torch.randn(2, 3, 11), torch.randint(0, 11, (2, 3))
    untempered = torch.gather(torch.log_softmax(logits.float(), -1), -1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(token_logprobs(logits, labels, temperature=1.0), untempered)


def test_fused_token_logprobs_compiled_applies_the_temperature():
    """The compiled GPU path divides by the temperature too (here compiled for the CPU)."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 5, 37)).to(torch.bfloat16)
    labels = torch.randint(0, 37, (2, 5))
    expected = torch.gather(torch.log_softmax(logits.float() / 0.7, -1), -1, labels.unsqueeze(-1)).squeeze(-1)
    close(token_logprobs(logits, labels, temperature=0.7), expected)
    close(torch.compile(fused_token_logprobs, dynamic=True)(logits, labels, 0.7), expected)


# ---- masked positions: no inf/nan in the forward pass or the gradients -----------------------------------
