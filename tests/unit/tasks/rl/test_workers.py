"""Micro-batches by token budget (--max_tokens_per_gpu, issue 52 item 3): each micro-batch's loss is its share of
the minibatch's, so the loss and the gradients of a minibatch are those of the padded path, however it is split.

The normalizer arithmetic is checked by hand; then a tiny Llama (random weights, on the CPU) takes one minibatch
of rows of different prompt and response lengths as one padded micro-batch and as token-budget micro-batches
trimmed to their rows, and both give the same loss and gradients.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tasks.common.nn.losses import aggregate, importance_weights, kl_loss, loss_normalizer, policy_loss, value_loss
from tasks.common.nn.token_batches import padded_tokens, token_batches
from tasks.rl.experience import Experience, response_logprobs
from tasks.rl.workers import response_used, trimmed


def T(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32), torch.as_tensor(expected, dtype=torch.float32), atol=tol, rtol=0
    )


# Losses (1, 2, 3 | 4 | -) over rows of 3, 1 and 0 tokens; a minibatch of them split as [row 0] and [rows 1, 2].
LOSS = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
MASK = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


def test_the_normalizer_counts_the_minibatchs_tokens_or_its_rows_with_tokens():
    close(loss_normalizer(MASK, "token_mean"), 4.0)
    close(loss_normalizer(MASK, "seq_mean_token_mean"), 2.0)  # the empty third row is no sequence
    close(loss_normalizer(MASK, "seq_mean_token_sum_norm"), 2.0)
    keep = torch.tensor([[True, False, True], [False, False, False], [True, True, True]])
    close(loss_normalizer(MASK, "token_mean", keep=keep), 2.0)  # reject: only kept response tokens
    close(loss_normalizer(MASK, "seq_mean_token_mean", keep=keep), 1.0)  # row 1 fully rejected
    close(loss_normalizer(torch.zeros(2, 3), "token_mean"), 1.0)  # never 0
    with pytest.raises(ValueError, match="loss_agg"):
        loss_normalizer(MASK, "sum")


@pytest.mark.parametrize(
    "loss_agg,max_len,first,second,whole",
    [
        # token_mean: (1 + 2 + 3) / 4 = 1.5 and 4 / 4 = 1, sum 2.5 = (1 + 2 + 3 + 4) / 4
        ("token_mean", None, 1.5, 1.0, 2.5),
        # seq_mean_token_mean: row means 2 and 4, over 2 sequences: 1 and 2, sum 3
        ("seq_mean_token_mean", None, 1.0, 2.0, 3.0),
        # Dr. GRPO, max_len 4: row sums 6/4 and 4/4, over 2 sequences: 0.75 and 0.5, sum 1.25
        ("seq_mean_token_sum_norm", 4, 0.75, 0.5, 1.25),
    ],
)
def test_the_shares_of_a_split_sum_to_the_whole_minibatchs_loss(loss_agg, max_len, first, second, whole):
    norm = loss_normalizer(MASK, loss_agg)
    close(aggregate(LOSS[:1], MASK[:1], loss_agg, max_len, normalizer=norm), first)
    close(aggregate(LOSS[1:], MASK[1:], loss_agg, max_len, normalizer=norm), second)
    close(aggregate(LOSS, MASK, loss_agg, max_len), whole)
    # Each micro-batch's own mean, averaged as gradient accumulation did, is not the minibatch's: (2 + 4) / 2 = 3 for token_mean.
    if loss_agg == "token_mean":
        close((aggregate(LOSS[:1], MASK[:1]) + aggregate(LOSS[1:], MASK[1:])) / 2, 3.0)


def test_value_and_kl_losses_take_the_normalizer_too():
    zeros = torch.zeros(3, 3)
    # ½ (V - R)² with V = 0: ½ · (1 + 4 + 9 | 16) = 7 | 8, over the minibatch's 4 tokens: 1.75 and 2
    v_first, _ = value_loss(zeros[:1], zeros[:1], LOSS[:1], MASK[:1], clip_eps=None, normalizer=4.0)
    v_second, _ = value_loss(zeros[1:], zeros[1:], LOSS[1:], MASK[1:], clip_eps=0.2, normalizer=4.0)
    close(v_first, 1.75)
    close(v_second, 2.0)
    close(value_loss(zeros, zeros, LOSS, MASK, clip_eps=0.2)[0], 3.75)
    # k1 = log π - log π_ref = -1 a token: -3 / 4 and -1 / 4
    logp, ref = -torch.ones(3, 3), torch.zeros(3, 3)
    close(kl_loss(logp[:1], ref[:1], MASK[:1], "k1", normalizer=4.0), -0.75)
    close(kl_loss(logp[1:], ref[1:], MASK[1:], "k1", normalizer=4.0), -0.25)


# ---- the padded path against token-budget micro-batches, on a tiny model

VOCAB, PROMPT_WIDTH, RESPONSE_WIDTH = 32, 6, 9
# (prompt tokens, response tokens) of each row: prompts left-padded to 6, responses right-padded to 9
SHAPES = [(6, 9), (2, 1), (4, 5), (3, 8), (5, 2), (1, 3), (6, 4), (2, 7)]


def tiny_model(cls=LlamaForCausalLM, **overrides):
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        **overrides,
    )
    torch.manual_seed(0)
    return cls(config).float()


def minibatch(model, reject: bool) -> Experience:
    g = torch.Generator().manual_seed(1)
    rows = len(SHAPES)
    sequences = torch.zeros(rows, PROMPT_WIDTH + RESPONSE_WIDTH, dtype=torch.long)
    attention = torch.zeros_like(sequences)
    for i, (p, r) in enumerate(SHAPES):
        span = slice(PROMPT_WIDTH - p, PROMPT_WIDTH + r)
        sequences[i, span] = torch.randint(1, VOCAB, (p + r,), generator=g)
        attention[i, span] = 1
    action = attention[:, PROMPT_WIDTH:].float()
    with torch.no_grad():
        current = response_logprobs(model, sequences, attention, PROMPT_WIDTH)
    old = (current + 0.3 * torch.randn(current.shape, generator=g)) * action  # ratios away from 1: some clip
    behaviour = (old + 0.5 * torch.randn(old.shape, generator=g)) * action if reject else None
    advantages = torch.randn(rows, 1, generator=g).expand(rows, RESPONSE_WIDTH) * action  # one per row, as GRPO's
    zeros = torch.zeros_like(action)
    return Experience(
        sequences,
        attention,
        action,
        PROMPT_WIDTH,
        old,
        old - 0.1,
        zeros,
        advantages,
        zeros,
        torch.zeros(rows),
        zeros,
        behaviour,
    )


def loss_of(model, mb: Experience, loss_agg: str, norm=None, tokens=None, reject=False, cap=1.5):
    logprobs = response_logprobs(model, mb.sequences, mb.attention_mask, mb.prompt_width)
    is_weights = (
        importance_weights(mb.logprobs, mb.behaviour_logprobs, mb.action_mask, "reject", cap) if reject else None
    )
    loss, _ = policy_loss(
        logprobs,
        mb.logprobs,
        mb.advantages,
        mb.action_mask,
        0.2,
        loss_agg=loss_agg,
        max_len=RESPONSE_WIDTH + 3,
        is_weights=is_weights,
        normalizer=norm,
    )
    return loss + 0.1 * kl_loss(logprobs, mb.ref_logprobs, mb.action_mask, "k3", normalizer=tokens)


def gradients(model) -> list[torch.Tensor]:
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(
    "loss_agg,reject",
    [("token_mean", False), ("seq_mean_token_sum_norm", False), ("seq_mean_token_mean", False), ("token_mean", True)],
    ids=["token_mean", "dr_grpo", "seq_mean", "token_mean_reject"],
)
def test_token_budget_micro_batches_give_the_padded_paths_loss_and_gradients(loss_agg, reject):
    model = tiny_model()
    exp = minibatch(model, reject)

    padded = loss_of(model, exp, loss_agg, reject=reject)
    padded.backward()
    padded_grads = gradients(model)

    lengths = (exp.prompt_width + response_used(exp)).tolist()
    assert lengths == [PROMPT_WIDTH + r for _, r in SHAPES]
    batches = token_batches(lengths, max_tokens=40)
    assert len(batches) > 2 and all(padded_tokens(lengths, b) <= 40 for b in batches)
    keep = importance_weights(exp.logprobs, exp.behaviour_logprobs, exp.action_mask, "reject", 1.5) if reject else None
    if reject:
        assert 0 < int(keep.sum()) < int(exp.action_mask.sum())  # some tokens rejected: the denominator moves
    norm, tokens = loss_normalizer(exp.action_mask, loss_agg, keep=keep), loss_normalizer(exp.action_mask)
    total = 0.0
    summed = None
    for rows in batches:
        mb = trimmed(exp, rows)
        longest_prompt = max(SHAPES[i][0] for i in rows)
        assert mb.sequences.shape == (len(rows), longest_prompt + max(SHAPES[i][1] for i in rows))  # cut on both sides
        assert mb.prompt_width == longest_prompt and mb.advantages.shape[1] == mb.sequences.shape[1] - mb.prompt_width
        share = loss_of(model, mb, loss_agg, norm, tokens, reject=reject)
        share.backward()
        total += share.item()
        grads = gradients(model)
        summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]

    torch.testing.assert_close(torch.tensor(total), padded.detach(), atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # each micro-batch's own mean, averaged as count-based accumulation does: not the same
        averaged = sum(loss_of(model, trimmed(exp, rows), loss_agg, reject=reject).item() for rows in batches) / len(
            batches
        )
    assert abs(averaged - padded.item()) > 1e-3
    for a, b in zip(summed, padded_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert max(g.abs().max().item() for g in padded_grads) > 1e-3  # the gradients compared are not all ~0


def test_trimming_keeps_every_per_token_field_and_refuses_an_unknown_width():
    model = tiny_model()
    exp = minibatch(model, reject=True)
    mb = trimmed(exp, [1, 5])  # responses of 1 and 3 tokens, prompts of 2 and 1
    assert mb.sequences.shape == (2, 2 + 3) and mb.prompt_width == 2
    for name in (
        "action_mask",
        "logprobs",
        "ref_logprobs",
        "values",
        "advantages",
        "returns",
        "kl",
        "behaviour_logprobs",
    ):
        assert getattr(mb, name).shape == (2, 3), name
        torch.testing.assert_close(getattr(mb, name), getattr(exp, name)[[1, 5], :3])
    assert mb.scores.shape == (2,)
    torch.testing.assert_close(mb.sequences, exp.sequences[[1, 5], 4:9])
    exp.kl = torch.zeros(len(SHAPES), RESPONSE_WIDTH + 1)
    with pytest.raises(ValueError, match=r"Experience.kl: \[1, 10\] is not per response token"):
        trimmed(exp, [0])


# (max_tokens_per_gpu, packing_samples) of the DeepSpeed updates compared: by count, padded, is the reference.
RUNS = [(0, False), (40, False), (40, True), (0, True)]


def test_packed_passes_give_the_padded_log_probs_entropies_and_values():
    """--packing_samples: the rows run as one sequence (here SDPA with a block-diagonal mask; FlashAttention-2 varlen
    on a GPU) give every response token's log-probability, entropy and value of the padded batch; the places where
    the token is padding are 0 (never in a loss)."""
    from transformers import LlamaForSequenceClassification

    from tasks.rl.experience import response_values

    model = tiny_model()
    exp = minibatch(model, reject=False)
    args = (exp.sequences, exp.attention_mask, PROMPT_WIDTH)
    padded, padded_entropy = response_logprobs(model, *args, return_entropy=True, temperature=0.7)
    packed, packed_entropy = response_logprobs(model, *args, return_entropy=True, temperature=0.7, packed=True)
    live = exp.action_mask > 0
    torch.testing.assert_close(packed[live], padded[live], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_entropy[live], padded_entropy[live], atol=1e-5, rtol=1e-5)
    assert packed.shape == padded.shape and not packed[~live].any()
    model.chunked_logprobs = (
        True  # the head a chunk of tokens at a time, as Liger-loaded models run (vocab.head_logprobs)
    )
    chunked = response_logprobs(model, *args, temperature=0.7, packed=True)
    torch.testing.assert_close(chunked[live], padded[live], atol=1e-5, rtol=1e-5)
    critic = tiny_model(LlamaForSequenceClassification, num_labels=1)
    values, packed_values = response_values(critic, *args), response_values(critic, *args, packed=True)
    torch.testing.assert_close(packed_values[live], values[live], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo"])
def test_one_deepspeed_actor_update_by_token_budget_is_the_padded_ones(estimator):
    """ActorWorker.train through DeepSpeed (ZeRO-2, CPU, a world of one), two minibatches: by count (all 8 rows in one
    padded micro-batch), by a 40-token budget (3 micro-batches each, trimmed), and packed (--packing_samples, by that
    budget of real tokens and by count): the same losses and pre-clip gradient norms, and one optimizer step per
    minibatch every way."""
    from tasks.common.config import make_config
    from tasks.common.nn.strategy import DeepSpeedStrategy
    from tasks.rl.actor import ActorWorker
    from tasks.rl.config import RLConfig

    base = {
        "output": "o",
        "pretrain": "p",
        "reward_pretrain": "r",
        "prompt_data": "d",
        "advantage_estimator": estimator,
        "n_samples_per_prompt": 2,
    }
    results = {}
    for budget, packed in RUNS:
        model = tiny_model()
        exp = minibatch(model, reject=False)
        worker = ActorWorker.__new__(ActorWorker)  # the worker's training step, without Ray or a checkpoint to load
        worker.rank, worker.world_size = 0, 1
        worker.cfg = make_config(
            RLConfig,
            {
                **base,
                "generate_max_len": 12,
                "max_tokens_per_gpu": budget,
                "init_kl_coef": 0,
                "packing_samples": packed,
            },
        )
        # By budget, DeepSpeed is configured as for --micro_train_batch_size 2 (4 accumulation steps), which the
        # budget's 3 micro-batches a minibatch must neither step on nor divide their losses by.
        micro = 2 if budget else len(SHAPES)
        worker.strategy = DeepSpeedStrategy(
            zero_stage=2, micro_batch_size=micro, accumulation_steps=len(SHAPES) // micro
        )
        worker.engine = worker.strategy.prepare(model, 1e-3, 10)
        worker.micro = micro
        # The second minibatch's old log-probs are the first's: after a step its ratios are no longer those.
        results[budget, packed] = worker.train([exp, exp], kl_coef=0.0)
        assert worker.engine.global_steps == 2  # one optimizer step per minibatch
    padded = results[RUNS[0]]
    assert padded["grad_norm"] > 1e-3
    for run in RUNS[1:]:
        for key in ("policy_loss", "grad_norm", "entropy"):
            assert results[run][key] == pytest.approx(padded[key], rel=1e-5, abs=1e-6), (run, key)


def test_one_deepspeed_critic_update_by_token_budget_is_the_padded_ones():
    """CriticWorker.train the same way: the value loss's token mean over the minibatch, whatever the split."""
    from transformers import LlamaForSequenceClassification

    from tasks.common.config import make_config
    from tasks.common.nn.strategy import DeepSpeedStrategy
    from tasks.rl.config import RLConfig
    from tasks.rl.workers import CriticWorker

    base = {"output": "o", "pretrain": "p", "reward_pretrain": "r", "prompt_data": "d"}
    results = {}
    for budget, packed in RUNS:
        critic = tiny_model(LlamaForSequenceClassification, num_labels=1)
        exp = minibatch(tiny_model(), reject=False)
        g = torch.Generator().manual_seed(2)
        exp.returns = torch.randn(exp.action_mask.shape, generator=g) * exp.action_mask
        worker = CriticWorker.__new__(CriticWorker)
        worker.rank, worker.world_size = 0, 1
        worker.cfg = make_config(RLConfig, {**base, "max_tokens_per_gpu": budget, "packing_samples": packed})
        micro = 2 if budget else len(SHAPES)
        worker.strategy = DeepSpeedStrategy(
            zero_stage=2, micro_batch_size=micro, accumulation_steps=len(SHAPES) // micro
        )
        worker.engine = worker.strategy.prepare(critic, 1e-3, 10)
        worker.micro = micro
        results[budget, packed] = worker.train([exp])
        results[budget, packed]["grad_norm"] = float(worker.engine.get_global_grad_norm())
        assert worker.engine.global_steps == 1
    padded = results[RUNS[0]]
    assert padded["grad_norm"] > 1e-3
    for run in RUNS[1:]:
        for key in ("value_loss", "grad_norm"):
            assert results[run][key] == pytest.approx(padded[key], rel=1e-5, abs=1e-6), (run, key)
