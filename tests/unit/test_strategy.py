"""tasks/common/nn/strategy.py and lora.py by themselves (CPU, a DeepSpeed world of one): what a training config
becomes in DeepSpeed's terms, the RNG state a checkpoint carries, activation checkpointing, LoRA's counts and its
frozen base.

    pytest tests/unit/test_strategy.py
"""

import random

import numpy as np
import torch

from tasks.common.config import make_config
from tasks.common.nn import lora
from tasks.common.nn.strategy import DeepSpeedStrategy, enable_checkpointing, rng_state, set_rng_state
from tasks.data import demo
from tasks.preference.config import PreferenceConfig
from tasks.sft.config import SFTConfig

BASE = {"output": "o", "pretrain": "p", "dataset": "d"}


def test_a_training_config_becomes_micro_batches_accumulation_and_zero_in_deepspeeds_terms():
    """Each of 2 workers takes 64 of the 128 rows in micro-batches of 16: 4 accumulation steps; a preference pair is
    2 sequences a micro-batch item; --adam_offload moves Adam's state to the CPU."""
    sft = make_config(SFTConfig, {**BASE, "train_batch_size": 128, "micro_train_batch_size": 16, "zero_stage": 3})
    ds = DeepSpeedStrategy.for_training(sft, world_size=2).ds_config()
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (16, 4)
    assert ds["zero_optimization"] == {"stage": 3} and ds["gradient_clipping"] == 1.0
    pairs = make_config(
        PreferenceConfig, {**BASE, "train_batch_size": 64, "micro_train_batch_size": 8, "adam_offload": True}
    )
    ds = DeepSpeedStrategy.for_training(pairs, world_size=1, sequences_per_item=2).ds_config()
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (16, 8)
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_the_rng_state_a_checkpoint_carries_restores_every_generator():
    state = rng_state()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_activation_checkpointing_recomputes_without_changing_the_loss_or_gradients():
    tok = demo.build_tokenizer()
    ids = torch.tensor([[tok.bos_token_id, *tok.encode("12+30=42", add_special_tokens=False)]])

    def loss_and_grad(checkpointed: bool):
        model = demo.build_base_model(tok, seed=3).train()
        if checkpointed:
            enable_checkpointing(model)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), model.model.embed_tokens.weight.grad.clone(), model.is_gradient_checkpointing

    plain, checkpointed = loss_and_grad(False), loss_and_grad(True)
    assert checkpointed[2] and not plain[2]
    assert abs(plain[0] - checkpointed[0]) < 1e-6 and torch.allclose(plain[1], checkpointed[1], atol=1e-6)


def test_lora_trains_the_adapters_alone_and_its_frozen_base_is_the_base_model():
    tok = demo.build_tokenizer()
    base = demo.build_base_model(tok, seed=4).eval()
    ids = torch.tensor([[tok.bos_token_id, *tok.encode("3+4=7", add_special_tokens=False)]])
    with torch.no_grad():
        expected = base(input_ids=ids).logits.clone()
    cfg = make_config(SFTConfig, {**BASE, "lora_rank": 4, "lora_alpha": 8})
    model = lora.apply_lora(demo.build_base_model(tok, seed=4), cfg)
    counts = lora.param_counts(model)
    assert 0 < counts["trainable_params"] < counts["total_params"] / 10
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    for name, p in model.named_parameters():  # a non-zero update, so the adapters change the logits
        if "lora_B" in name:
            p.data.fill_(0.05)
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits, expected)
        with lora.adapters_disabled(model) as frozen:
            assert torch.allclose(frozen(input_ids=ids).logits, expected, atol=1e-6)
    assert lora.unwrap(model).__class__ is base.__class__
