"""--torch_compile: each transformer block compiled (tasks.common.nn.models.compile_blocks) gives the eager
model's loss and gradients, under gradient checkpointing as the GPU path trains (CPU, tiny model, no Ray;
inductor compiles for the CPU here, about 20 s)."""

import pytest
import torch

from tasks.common.config import ConfigError, make_config
from tasks.common.nn.losses import sft_loss
from tasks.common.nn.models import compile_blocks
from tasks.common.nn.strategy import enable_checkpointing
from tasks.common.nn.supervised import micro_batch_logprobs
from tasks.data import demo
from tasks.sft.config import SFTConfig


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
