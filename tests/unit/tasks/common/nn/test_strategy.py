"""tasks/common/nn/strategy.py by itself (CPU, a DeepSpeed world of one, tiny real Llama models): the learning-rate
schedule worked out by hand, what a training config becomes in DeepSpeed's terms, what prepare trains and at which
rate, the forward-only models, the reductions, the HF export (full and LoRA), the resumable state with its RNG,
activation checkpointing and ZeRO's fused gradient norm. LoRA itself is tests/unit/tasks/common/nn/test_lora.py.

    pytest tests/unit/tasks/common/nn/test_strategy.py
"""

import json
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from tasks.common.config import make_config
from tasks.common.nn import lora
from tasks.common.nn.strategy import (
    DeepSpeedStrategy,
    enable_checkpointing,
    fuse_zero_step_checks,
    init_distributed,
    lr_multiplier,
    rng_state,
    set_rng_state,
    set_seed,
)
from tasks.data import demo
from tasks.preference.config import PreferenceConfig
from tasks.sft.config import SFTConfig

BASE = {"output": "o", "pretrain": "p", "dataset": "d"}


def close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol), (
        a,
        b,
    )


@pytest.fixture(scope="module")
def tok():
    return demo.build_tokenizer()


def tiny(tok, seed: int = 1):
    return demo.build_base_model(tok, seed=seed, hidden_size=32, num_layers=1)


def batch(tok, text: str = "12+30=42"):
    return torch.tensor([[tok.bos_token_id, *tok.encode(text, add_special_tokens=False)]])


def train_step(engine, x) -> float:
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


@pytest.mark.parametrize(
    "step, total, warmup, schedule, min_ratio, expected",
    [
        (0, 10, 4, "constant", 0.1, 0.25),  # warmup: (step + 1) / warmup_steps
        (2, 10, 4, "cosine", 0.1, 0.75),
        (3, 10, 4, "constant", 0.1, 1.0),  # the last warmup step reaches the peak
        (9, 10, 4, "constant", 0.1, 1.0),
        (4, 14, 4, "cosine", 0.1, 1.0),  # cosine from its top, progress 0
        (9, 14, 4, "cosine", 0.1, 0.55),  # halfway: 0.1 + 0.9 * 0.5 * (1 + cos(pi/2))
        (9, 14, 4, "cosine", 0.0, 0.5),
        (14, 14, 4, "cosine", 0.1, 0.1),  # the floor at total_steps
        (30, 14, 4, "cosine", 0.1, 0.1),  # and past it
        (0, 10, 0, "cosine", 0.1, 1.0),  # no warmup
        (5, 5, 5, "cosine", 0.1, 1.0),  # warmup the whole run: the span after it counts as 1 step
        (6, 5, 5, "cosine", 0.1, 0.1),
    ],
)
def test_the_learning_rate_warms_up_linearly_then_holds_or_falls_on_a_cosine_to_its_floor(
    step, total, warmup, schedule, min_ratio, expected
):
    assert lr_multiplier(step, total, warmup, schedule, min_ratio) == pytest.approx(expected)


def test_one_seed_repeats_every_generator_and_another_does_not():
    def draws():
        return random.random(), float(np.random.rand()), torch.rand(1).item()

    set_seed(7)
    first = draws()
    set_seed(7)
    assert draws() == first
    set_seed(8)
    assert draws() != first


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


def test_a_process_on_its_own_is_a_world_of_one_whose_reductions_are_copies_of_its_values():
    strategy = DeepSpeedStrategy(zero_stage=0)
    assert (strategy.rank, strategy.world_size, strategy.device.type) == (0, 1, "cpu")
    init_distributed()  # joined already: nothing changes
    assert dist.get_world_size() == 1
    value = torch.tensor([1.0, 2.0])
    total = strategy.all_reduce(value)
    total.add_(1)  # a copy: the caller's tensor stays
    assert value.tolist() == [1.0, 2.0]
    assert strategy.all_reduce(3, "mean").item() == 3.0 and strategy.all_reduce(2.5, "max").item() == 2.5


def test_the_deepspeed_config_of_a_strategy_in_full():
    strategy = DeepSpeedStrategy(zero_stage=1, bf16=True, max_norm=0.5, micro_batch_size=3, accumulation_steps=2)
    assert strategy.ds_config() == {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def test_prepare_trains_only_what_requires_grad_at_the_scheduled_rate(tok):
    """AdamW over the trainable parameters alone; the rate starts at warmup's first step, 1e-2 × 1/2, then 1e-2."""
    model = tiny(tok)
    model.model.embed_tokens.weight.requires_grad_(False)
    frozen_before = model.model.embed_tokens.weight.detach().clone()
    head_before = model.lm_head.weight.detach().clone()
    engine = DeepSpeedStrategy(zero_stage=0).prepare(
        model, learning_rate=1e-2, total_steps=10, warmup_steps=2, lr_scheduler="cosine"
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimized = [p for group in engine.optimizer.param_groups for p in group["params"]]
    assert isinstance(engine.optimizer, torch.optim.AdamW) and len(optimized) == len(trainable)
    assert engine.get_lr() == [pytest.approx(5e-3)]
    train_step(engine, batch(tok))
    assert engine.get_lr() == [pytest.approx(1e-2)]
    assert torch.equal(model.model.embed_tokens.weight, frozen_before)
    assert not torch.equal(model.lm_head.weight, head_before)


def test_a_frozen_model_runs_forward_only_in_eval_mode_in_the_training_dtype(tok):
    for bf16, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        model = DeepSpeedStrategy(zero_stage=0, bf16=bf16).frozen(tiny(tok).train())
        assert model.dtype == dtype and not model.training
        assert not any(p.requires_grad for p in model.parameters())


def test_the_hf_export_loads_back_to_the_same_outputs(tok, tmp_path):
    strategy = DeepSpeedStrategy(zero_stage=0)
    engine = strategy.prepare(tiny(tok), 1e-2, 10)
    train_step(engine, batch(tok))
    out = strategy.save_hf(engine, tok, tmp_path / "model")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    with torch.no_grad():
        expected = engine.module.eval()(input_ids=batch(tok)).logits
        assert torch.allclose(AutoModelForCausalLM.from_pretrained(out)(input_ids=batch(tok)).logits, expected)


def test_the_hf_export_of_a_lora_model_is_its_adapter_naming_the_base_it_trained_on(tok, tmp_path):
    strategy = DeepSpeedStrategy(zero_stage=0)
    model = lora.apply_lora(tiny(tok), make_config(SFTConfig, {**BASE, "lora_rank": 2}))
    engine = strategy.prepare(model, 1e-2, 10)
    out = strategy.save_hf(engine, None, tmp_path / "model", base_uri="s3://b/runs/r/sft")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "s3://b/runs/r/sft"


def test_the_resumable_state_restores_weights_step_rate_client_state_and_rng(tok, tmp_path):
    strategy = DeepSpeedStrategy(zero_stage=0)
    engine = strategy.prepare(tiny(tok), 1e-2, total_steps=10, warmup_steps=4)
    train_step(engine, batch(tok))
    strategy.save_state(engine, tmp_path, {"sampler": {"position": 3}})
    assert (tmp_path / "rng_rank0.pt").is_file()
    saved = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    next_draw = torch.rand(1)
    train_step(engine, batch(tok, "1+1=2"))  # moves the weights, the step and the rate on
    client_state = strategy.load_state(engine, tmp_path)
    assert client_state["sampler"] == {"position": 3}
    assert all(torch.equal(saved[name], p) for name, p in engine.module.named_parameters())
    assert engine.global_steps == 1 and engine.get_lr() == [pytest.approx(1e-2 * 2 / 4)]
    assert torch.rand(1).item() == next_draw.item()  # the generator as it was when the state was saved


def test_zero2s_gradient_norm_is_the_norm_of_every_gradient_together_and_minus_1_when_not_finite(tok):
    """The fused norm (fuse_zero_step_checks) on hand-made gradients: |(3, 0, 0, 4)| = 5. fp32 keeps DeepSpeed's own
    overflow check; an optimizer that is not ZeRO-1/2's is left as it is."""
    optimizer = DeepSpeedStrategy(zero_stage=2).prepare(tiny(tok), 1e-2, 10).optimizer
    assert optimizer.get_grad_norm_direct.__qualname__.startswith("fuse_zero_step_checks.")  # the fused one
    params = [torch.zeros(2), torch.zeros(2)]
    assert optimizer.get_grad_norm_direct([torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])], params).item() == 5.0
    assert optimizer.get_grad_norm_direct([torch.tensor([float("nan"), 1.0])], params[:1]).item() == -1.0
    assert optimizer.check_overflow.__func__ is type(optimizer).check_overflow
    plain = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    fuse_zero_step_checks(plain)
    assert not hasattr(plain, "get_grad_norm_direct")


def test_lr_multiplier_warmup_then_constant_or_cosine():
    from tasks.common.nn.strategy import lr_multiplier

    # warmup 4: (step + 1) / 4
    assert [lr_multiplier(s, 100, 4) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    # cosine over steps 4..104: 1 at the start, 0.1 + 0.9·½ = 0.55 halfway, 0.1 at the end
    close(lr_multiplier(4, 104, 4, "cosine"), 1.0)
    close(lr_multiplier(54, 104, 4, "cosine"), 0.55)
    close(lr_multiplier(104, 104, 4, "cosine"), 0.1)
