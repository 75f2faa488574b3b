"""tasks/common/nn/models.py: --torch_compile, each transformer block compiled (compile_blocks), gives the eager
model's loss and gradients, under gradient checkpointing as the GPU path trains (CPU, tiny model, no Ray; inductor
compiles for the CPU here, about 20 s); and sequence_logprobs, chunked, from a start position and at a temperature,
against the full logits' numbers and values computed by hand."""

import math

import pytest
import torch

from tasks.common.config import ConfigError, make_config
from tasks.common.nn.losses import sft_loss
from tasks.common.nn.models import compile_blocks, sequence_logprobs
from tasks.common.nn.strategy import enable_checkpointing
from tasks.common.nn.supervised import micro_batch_logprobs
from tasks.data import demo
from tasks.sft.config import SFTConfig


def close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol), (
        a,
        b,
    )


@pytest.mark.slow  # make test-all: compiles (32 s)
def test_compiled_blocks_match_eager_loss_and_gradients():
    tokenizer = demo.build_tokenizer()
    model = demo.build_base_model(tokenizer)
    enable_checkpointing(model)
    model.train()
    ids = [tokenizer.encode(text) for text in ("12+34=046", "05+05=010 is the sum")]
    masks = [[0] * 6 + [1] * (len(row) - 6) for row in ids]

    def loss_and_grad():
        model.zero_grad()
        logprobs, loss_mask = micro_batch_logprobs(
            model, ids, masks, tokenizer.pad_token_id, False, torch.device("cpu")
        )
        loss = sft_loss(logprobs, loss_mask[:, 1:])
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])

    eager_loss, eager_grad = loss_and_grad()
    assert compile_blocks(model) == model.config.num_hidden_layers
    compiled_loss, compiled_grad = loss_and_grad()
    assert abs(compiled_loss - eager_loss) < 1e-5
    assert torch.allclose(compiled_grad, eager_grad, atol=1e-5)


def _attention_that_reads_the_layer_index(module, query, key, value, attention_mask, **kwargs):
    """SDPA behind a branch on the block's layer index, as transformers' FlashAttention-2 path reads it on the GPU."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if module.layer_idx == 0:
        query = query * 1.0
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_blocks_share_their_graphs_across_layers(checkpointing):
    """--torch_compile on a 12-block model: a block's layer index (read by FlashAttention-2's path) and a KV cache
    (which a training forward without gradient checkpointing used to build) each made every block recompile, and
    blocks past torch's limit of 8 ran uncompiled. Now a few graphs serve all twelve, with the eager gradients."""
    from torch._dynamo.utils import counters
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from tasks.common.nn.models import sequence_logprobs

    AttentionInterface.register("layer_index_sdpa", _attention_that_reads_the_layer_index)
    AttentionMaskInterface.register("layer_index_sdpa", sdpa_mask)
    tokenizer = demo.build_tokenizer()
    model = demo.build_base_model(tokenizer, hidden_size=32, num_layers=12)
    model.set_attn_implementation("layer_index_sdpa")
    if checkpointing:
        enable_checkpointing(model)
    model.train()
    ids = torch.tensor([tokenizer.encode("12+34=046"), tokenizer.encode("05+05=010")])

    def grad():
        model.zero_grad()
        sequence_logprobs(model, ids, torch.ones_like(ids)).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    eager = grad()
    compile_blocks(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = grad()
    assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])
    assert torch.allclose(compiled, eager, atol=1e-5)


def test_torch_compile_refuses_zero3_and_models_without_blocks():
    with pytest.raises(ConfigError, match="torch_compile: ZeRO-3"):
        make_config(
            SFTConfig, {"output": "out", "pretrain": "m", "dataset": "d", "torch_compile": True, "zero_stage": 3}
        )
    with pytest.raises(ValueError, match="torch_compile: Linear has no transformer blocks"):
        compile_blocks(torch.nn.Linear(2, 2))


def test_a_model_that_takes_log_probs_a_chunk_at_a_time_gives_the_full_logits_numbers():
    """sequence_logprobs and packed_logprobs of the demo model marked as load_causal_lm marks a Liger model (the Liger kernels
    themselves need CUDA: tests/e2e/test_gpu.py) against the same model's full-logits path: values, entropy and the
    parameters' gradients."""
    from tasks.common.nn import data
    from tasks.common.nn.packed import packed_logprobs
    from tasks.data import demo

    tok = demo.build_tokenizer()
    model = demo.build_base_model(tok, seed=1)
    sequences = [data.encode_prompt(tok, p) for p in ("3+4=7", "37+45=82", "1+1=")]
    ids, mask = data.pad(sequences, tok.pad_token_id, side="left")
    packed = data.pack(sequences)
    runs = []
    for chunked in (False, True):
        model.chunked_logprobs = chunked
        model.zero_grad()
        logprobs, entropy = sequence_logprobs(model, ids, mask, return_entropy=True, temperature=0.8)
        packed_lp = packed_logprobs(model, *packed)
        ((logprobs * mask[:, 1:]).sum() + entropy.sum() + packed_lp.sum()).backward()
        runs.append((logprobs, entropy, packed_lp, [p.grad.clone() for p in model.parameters()]))
    for want, got in zip(runs[0][:3], runs[1][:3]):
        assert torch.allclose(got, want, atol=1e-5)
    assert all(torch.allclose(g, w, atol=1e-5) for w, g in zip(runs[0][3], runs[1][3]))


def test_log_probs_from_a_start_position_are_the_full_ones_sliced_and_a_logged_entropy_takes_no_gradient():
    """RL scores response tokens only (start = prompt width - 1): the same numbers and parameter gradients as
    computing every position and slicing, on the full-logits path and the chunked one. An entropy asked for
    without entropy_grad has the same values, stays out of autograd and leaves the log-probs' gradients as they are."""
    from tasks.common.nn import data
    from tasks.data import demo

    tok = demo.build_tokenizer()
    model = demo.build_base_model(tok, seed=1)
    ids, mask = data.pad(
        [data.encode_prompt(tok, p) for p in ("3+4=7", "37+45=82", "1+1=")], tok.pad_token_id, side="left"
    )
    start = 4
    for chunked in (False, True):
        model.chunked_logprobs = chunked
        runs = []
        for kwargs in ({}, {"start": start}, {"start": start, "entropy_grad": False}):
            model.zero_grad()
            logprobs, entropy = sequence_logprobs(model, ids, mask, return_entropy=True, temperature=0.8, **kwargs)
            if "start" not in kwargs:
                logprobs, entropy = logprobs[:, start:], entropy[:, start:]
            assert entropy.requires_grad == kwargs.get("entropy_grad", True)
            (logprobs * mask[:, start + 1 :]).sum().backward()
            runs.append((logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
        for got in runs[1:]:
            assert got[0].shape == runs[0][0].shape == (3, ids.size(1) - 1 - start)
            assert torch.allclose(got[0], runs[0][0], atol=1e-6) and torch.allclose(got[1], runs[0][1], atol=1e-6)
            assert all(torch.allclose(g, w, atol=1e-6) for w, g in zip(runs[0][2], got[2]))


class FixedLogits(torch.nn.Module):
    """A causal LM whose logits are (0, ln 3) at every position, whatever the input."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        row = torch.tensor([0.0, math.log(3.0)])
        return type("Output", (), {"logits": row.expand(*input_ids.shape, 2)})()


def test_sequence_logprobs_and_entropy_are_those_of_the_tempered_distribution():
    # every position: p = (1/4, 3/4) untempered, (1/10, 9/10) at temperature 0.5
    #   entropy: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335;  -(0.1 ln 0.1 + 0.9 ln 0.9) = 0.325083
    ids, mask = torch.tensor([[0, 1, 1]]), torch.ones(1, 3)
    logprobs, entropy = sequence_logprobs(FixedLogits(), ids, mask, return_entropy=True)
    close(logprobs, [[math.log(0.75), math.log(0.75)]])
    close(entropy, [[0.562335, 0.562335]])
    logprobs, entropy = sequence_logprobs(FixedLogits(), ids, mask, return_entropy=True, temperature=0.5)
    close(logprobs, [[math.log(0.9), math.log(0.9)]])
    close(entropy, [[0.325083, 0.325083]])
    # the RL helper passes it through: response tokens only (prompt width 2 -> the last position)
    from tasks.rl.experience import response_logprobs

    close(response_logprobs(FixedLogits(), ids, mask, 2, temperature=0.5), [[math.log(0.9)]])
