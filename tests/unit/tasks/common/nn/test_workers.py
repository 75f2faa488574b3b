"""Worker groups (tasks/common/nn/workers.py) and what they share: shards, the environment forwarded to worker actors,
batch splits, the batch sampler's state, the checkpoint store, training knobs. RL's layout and placement plans are
tests/unit/tasks/rl/test_config.py's."""

import numpy as np
import pytest

from tasks.common.checkpoint import CheckpointStore
from tasks.common.config import ConfigError, check_batch, micro_batches
from tasks.common.nn.data import BatchSampler, encode_prompt
from tasks.common.nn.workers import forwarded_env, shard
from tasks.data import demo


def test_shard_cuts_contiguous_nearly_equal_pieces():
    assert shard(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert shard(list(range(2)), 3) == [[0], [1], []]


def test_worker_actors_get_the_drivers_settings_but_no_secret():
    environ = {
        "AWS_ENDPOINT_URL_S3": "http://s3",
        "AWS_ACCESS_KEY_ID": "id",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_SESSION_TOKEN": "t",
        "WANDB_API_KEY": "k",
        "HF_TOKEN": "h",
        "HF_HOME": "/hf",
        "RLHF_NODE_SCRATCH": "/n",
        "PATH": "/bin",
    }
    assert forwarded_env(environ) == {"AWS_ENDPOINT_URL_S3": "http://s3", "HF_HOME": "/hf"}


def test_batch_split_over_workers_and_micro_batches():
    assert micro_batches(64, 0, 2) == (32, 1)
    assert micro_batches(64, 8, 2) == (8, 4)
    check_batch("train_batch_size", 64, 8, 2, "num_gpus_per_node")
    with pytest.raises(ConfigError, match=r"^train_batch_size: 30 does not split over 4 workers \(num_gpus_per_node\)"):
        check_batch("train_batch_size", 30, 0, 4, "num_gpus_per_node")
    with pytest.raises(
        ConfigError, match=r"^micro_train_batch_size: 5 must divide each worker's share of train_batch_size, 32"
    ):
        check_batch("train_batch_size", 64, 5, 2, "num_gpus_per_node")


def test_batch_sampler_state_resumes_the_same_order():
    a = BatchSampler(10, 4, seed=3)
    for _ in range(3):  # into the second epoch
        a.next()
    b = BatchSampler(10, 4, seed=99)
    b.load_state_dict(a.state_dict())
    assert [a.next() for _ in range(5)] == [b.next() for _ in range(5)]
    assert a.epoch == b.epoch


def test_checkpoint_store_sees_only_committed_steps_and_keeps_the_newest(tmp_path):
    store = CheckpointStore(str(tmp_path / "checkpoints"), keep=2)
    assert store.latest() is None
    for step in (2, 4, 6):
        local = tmp_path / f"local{step}"
        (local / "actor").mkdir(parents=True)
        (local / "actor" / "state.bin").write_bytes(bytes([step]) * 10)
        store.commit(local, step, "run", {"a": 1})
    (tmp_path / "checkpoints" / "step_8").mkdir()  # an upload that never got its manifest
    (tmp_path / "checkpoints" / "step_8" / "state.bin").write_bytes(b"partial")
    assert store.steps() == [4, 6] and store.latest() == 6
    assert not (tmp_path / "checkpoints" / "step_2").exists()
    assert (store.fetch(6, tmp_path / "got") / "actor" / "state.bin").read_bytes() == bytes([6]) * 10


def test_chat_template_wraps_the_prompt_or_is_refused_in_one_line():
    tokenizer = demo.build_tokenizer()
    with pytest.raises(
        ConfigError, match=r"^apply_chat_template: the tokenizer of .* has no chat template; drop --apply_chat_template"
    ):
        encode_prompt(tokenizer, "1+2=", chat_template=True)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    assert encode_prompt(tokenizer, "1+2", chat_template=True) == tokenizer.encode("1+2=", add_special_tokens=False)


def _tiny_llama(num_hidden_layers: int = 1):
    """The smallest Llama DeepSpeed will wrap: what the strategy's switches act on, not what it computes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


@pytest.mark.slow  # 65 s (DeepSpeed in this process); make test runs SFT with --gradient_checkpointing (tests/e2e/test_stages.py)
def test_gradient_checkpointing_is_switched_on_for_training():
    from tasks.common.nn.strategy import DeepSpeedStrategy

    model = _tiny_llama()
    engine = DeepSpeedStrategy(zero_stage=0, gradient_checkpointing=True).prepare(model, 1e-3, 10)
    # The config is left as it is (saved models keep their use_cache): the training forwards pass use_cache=False.
    assert engine.module.is_gradient_checkpointing and engine.module.config.use_cache


@pytest.mark.slow
def test_adam_offload_keeps_the_optimizer_on_the_cpu():
    """Builds DeepSpeed's CPU Adam op on first use (about 40 s): `make test-all`."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from tasks.common.nn.strategy import DeepSpeedStrategy

    model = _tiny_llama()
    engine = DeepSpeedStrategy(zero_stage=2, adam_offload=True).prepare(model, 1e-3, 10)
    assert isinstance(engine.optimizer.optimizer, DeepSpeedCPUAdam)
    assert np.isfinite(sum(p.float().sum().item() for p in model.parameters()))


def test_bf16_zero2_skips_a_step_with_a_non_finite_gradient_without_checking_each_tensor():
    """ZeRO-2 in bf16 finds the NaN through the gradient norm (strategy.fuse_zero_step_checks): the step is skipped
    and no weight moves; the next finite step trains. The per-tensor inf/NaN pass (amax/amin of every gradient) is
    gone, and the fused norm is DeepSpeed's own to float64 rounding.
    """
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from torch.profiler import profile

    from tasks.common.nn.strategy import DeepSpeedStrategy

    torch.manual_seed(0)
    model = _tiny_llama(num_hidden_layers=2).to(torch.bfloat16)
    engine = DeepSpeedStrategy(zero_stage=2, bf16=True).prepare(model, 1e-2, 10)
    optimizer = engine.optimizer
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])

    def step():
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    engine.backward(engine(input_ids=ids, labels=ids).loss)
    grads, params = optimizer.averaged_gradients[0], optimizer.params_in_partition[0]
    fused, deepspeeds = (
        optimizer.get_grad_norm_direct(grads, params),
        DeepSpeedZeroOptimizer.get_grad_norm_direct(optimizer, grads, params),
    )
    assert fused.item() > 0 and abs(fused.item() - deepspeeds.item()) <= 1e-6 * deepspeeds.item()
    engine.step()

    before = [p.detach().clone() for p in model.parameters()]
    hook = model.model.norm.weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    with profile() as prof:
        step()
    hook.remove()
    assert engine.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not [e for e in prof.key_averages() if e.key == "aten::amax"]

    step()
    assert engine.skipped_steps == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())
