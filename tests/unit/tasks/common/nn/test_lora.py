"""tasks/common/nn/lora.py by itself (CPU, tiny real Llama models, real peft): which configs train adapters, the
adapters' parameter counts worked out by hand, the frozen base, and every way an adapter leaves the process (the
adapter files, the merged checkpoint, the in-memory weights a vLLM engine loads, the merge cached beside a fetch).

    pytest tests/unit/tasks/common/nn/test_lora.py
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

from tasks.common.config import ConfigError, make_config
from tasks.common.nn import lora
from tasks.data import demo
from tasks.sft.config import SFTConfig

BASE = {"output": "o", "pretrain": "p", "dataset": "d"}
HIDDEN = 32  # one layer of hidden size 32: the adapters' sizes below are worked out by hand from it


def config(**fields) -> SFTConfig:
    return make_config(SFTConfig, {**BASE, **fields})


@pytest.fixture(scope="module")
def tok():
    return demo.build_tokenizer()


@pytest.fixture(scope="module")
def base_dir(tok, tmp_path_factory):
    """A tiny base model and its tokenizer saved as a folder: what a stage loads its base from."""
    path = tmp_path_factory.mktemp("base")
    demo.build_base_model(tok, seed=1, hidden_size=HIDDEN, num_layers=1).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def load_base(base_dir):
    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)


def ids(tok, text="3+4=7"):
    return torch.tensor([[tok.bos_token_id, *tok.encode(text, add_special_tokens=False)]])


def with_adapter(base_dir, target="q_proj,v_proj", rank=2):
    """A peft model of the base whose adapters change its output (peft starts lora_B at zero: no change); the same
    adapters at every call (lora_A's initialisation draws from torch's generator too)."""
    torch.manual_seed(0)
    model = lora.apply_lora(load_base(base_dir), config(lora_rank=rank, lora_alpha=4, target_modules=target))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.2)
    return model


def logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def test_a_config_trains_adapters_only_with_a_rank_and_exports_them_unless_merged():
    assert not lora.enabled(config()) and not lora.exports_adapter(config())
    assert lora.enabled(config(lora_rank=4)) and lora.exports_adapter(config(lora_rank=4))
    assert lora.enabled(config(lora_rank=4, merge_lora=True)) and not lora.exports_adapter(
        config(lora_rank=4, merge_lora=True)
    )
    # An adapter output names its base (the URI the stage trained on) and the config the merged model gets.
    assert lora.manifest_fields(config()) == {}
    assert lora.manifest_fields(config(lora_rank=4, merge_lora=True), reward_mean=0.5) == {}
    assert lora.manifest_fields(config(lora_rank=4)) == {"base_model": "p"}
    assert lora.manifest_fields(config(lora_rank=4), reward_mean=0.5) == {
        "base_model": "p",
        "model_config": {"reward_mean": 0.5},
    }


def test_target_modules_pass_all_linear_through_and_refuse_a_name_no_module_has(base_dir):
    model = load_base(base_dir)
    assert lora._target_modules(model, "all-linear") == "all-linear"
    assert lora._target_modules(model, "q_proj, v_proj") == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError) as refused:
        lora._target_modules(model, "q_proj,qkv")
    # One line naming the stray name and every linear layer's name the model does have.
    message = str(refused.value)
    assert message.startswith("target_modules: qkv name no module of ") and "\n" not in message
    assert message.endswith("use all-linear or some of down_proj,gate_proj,k_proj,lm_head,o_proj,q_proj,up_proj,v_proj")


def test_without_a_rank_the_model_is_returned_as_it_is(base_dir):
    model = load_base(base_dir)
    assert lora.apply_lora(model, config()) is model and not lora.is_peft_model(model)
    assert lora.unwrap(model) is model


def test_param_counts_count_what_requires_grad_and_everything():
    layer = torch.nn.Linear(3, 2)  # weight 2×3, bias 2
    layer.weight.requires_grad_(False)
    assert lora.param_counts(layer) == {"trainable_params": 2, "total_params": 8}


def test_rank_2_adapters_on_two_projections_add_exactly_their_a_and_b_matrices(base_dir):
    """q_proj and v_proj are 32×32: each gets A (2×32) and B (32×2), 128 parameters; 256 in all, all trainable."""
    base_total = lora.param_counts(load_base(base_dir))["total_params"]
    model = lora.apply_lora(load_base(base_dir), config(lora_rank=2, target_modules="q_proj,v_proj"))
    assert lora.is_peft_model(model)
    assert lora.param_counts(model) == {"trainable_params": 256, "total_params": base_total + 256}
    trained = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    assert trained == [
        f"base_model.model.model.layers.0.self_attn.{m}.lora_{ab}.default.weight"
        for m in ("q_proj", "v_proj")
        for ab in "AB"
    ]
    assert type(lora.unwrap(model)).__name__ == "LlamaForCausalLM"


def test_a_scalar_model_trains_its_score_head_in_full_beside_the_adapters(tok):
    """The reward model's head starts untrained: its 1×32 weight is trainable (a copy peft saves with the adapter)."""
    scalar = AutoModelForSequenceClassification.from_config(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=HIDDEN,
            intermediate_size=4 * HIDDEN,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_labels=1,
            pad_token_id=tok.pad_token_id,
        )
    )
    base_total = lora.param_counts(scalar)["total_params"]
    model = lora.apply_lora(scalar, config(lora_rank=2, target_modules="q_proj,v_proj"), scalar=True)
    assert lora.param_counts(model) == {"trainable_params": 256 + 32, "total_params": base_total + 256 + 32}
    assert [n for n, p in model.named_parameters() if p.requires_grad and lora.SCALAR_HEAD in n] == [
        "base_model.model.score.modules_to_save.default.weight"
    ]


def test_the_frozen_base_is_the_base_model_and_the_training_mode_comes_back(tok, base_dir):
    x = ids(tok)
    expected = logits(load_base(base_dir).eval(), x)
    model = with_adapter(base_dir).train()
    assert not torch.allclose(logits(model, x), expected)
    with lora.adapters_disabled(model) as frozen:
        assert not frozen.training
        assert torch.allclose(logits(frozen, x), expected, atol=1e-6)
    assert model.training
    # FrozenBase: the same, called like a model, outside autograd: a reference without a second copy.
    reference = lora.FrozenBase(model)
    out = reference(input_ids=x).logits
    assert torch.allclose(out, expected, atol=1e-6) and not out.requires_grad and model.training
    assert reference.config is lora.unwrap(model).config
    assert torch.allclose(logits(model, x), logits(with_adapter(base_dir), x))  # the adapters are back on


def test_trainable_state_is_a_cpu_copy_of_the_trainable_tensors_alone(base_dir):
    model = with_adapter(base_dir)
    state = lora.trainable_state(model)
    params = dict(model.named_parameters())
    assert sorted(state) == sorted(n for n, p in params.items() if p.requires_grad)
    name = next(iter(state))
    assert state[name].device.type == "cpu" and torch.equal(state[name], params[name].detach())
    state[name].add_(1.0)  # a copy: the model's own tensor stays
    assert not torch.equal(state[name], params[name].detach())


def test_the_saved_adapter_names_its_base_by_uri_and_loads_back_to_the_same_outputs(tok, base_dir, tmp_path):
    from peft import PeftModel

    model = with_adapter(base_dir)
    local = model.peft_config["default"].base_model_name_or_path
    lora.save_peft(model, lora.trainable_state(model), tmp_path / "adapter", merge=False, base_uri="s3://b/run/sft")
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]  # no model card, no base weights
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == "s3://b/run/sft" and saved["r"] == 2
    assert model.peft_config["default"].base_model_name_or_path == local  # the live model keeps its own
    loaded = PeftModel.from_pretrained(load_base(base_dir), str(tmp_path / "adapter"))
    assert torch.allclose(logits(loaded, ids(tok)), logits(model, ids(tok)), atol=1e-6)


def test_a_merged_export_is_a_plain_checkpoint_with_the_adapters_outputs(tok, base_dir, tmp_path):
    model = with_adapter(base_dir)
    lora.save_peft(model, lora.trainable_state(model), tmp_path / "merged", merge=True, base_uri="s3://b/run/sft")
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.dtype == torch.float32  # the dtype it trained in
    assert torch.allclose(logits(merged, ids(tok)), logits(model, ids(tok)), atol=1e-5)


def test_adapter_weights_in_memory_are_peft_files_a_fresh_base_loads(tok, base_dir, tmp_path):
    """What a vLLM engine gets after each update: peft's tensor names (no adapter name inside) and a JSON config
    (peft's target_modules set written as a sorted list)."""
    from peft import PeftModel

    model = with_adapter(base_dir)
    weights = lora.adapter_weights(model)
    assert sorted(weights.tensors) == [
        f"base_model.model.model.layers.0.self_attn.{m}.lora_{ab}.weight" for m in ("q_proj", "v_proj") for ab in "AB"
    ]
    out = weights.save(tmp_path / "live")
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == ["q_proj", "v_proj"]
    loaded = PeftModel.from_pretrained(load_base(base_dir), str(out))
    assert torch.allclose(logits(loaded, ids(tok)), logits(model, ids(tok)), atol=1e-6)


def test_merge_adapter_sets_the_overrides_and_saves_in_the_dtype_asked(tok, base_dir, tmp_path):
    model = with_adapter(base_dir)
    lora.save_peft(model, lora.trainable_state(model), tmp_path / "adapter", merge=False, base_uri="")
    out = lora.merge_adapter(
        tmp_path / "adapter", str(base_dir), tmp_path / "bf16", overrides={"reward_mean": 0.25}, dtype=torch.bfloat16
    )
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.config.reward_mean == 0.25 and merged.dtype == torch.bfloat16
    expected = logits(model, ids(tok))
    assert torch.allclose(logits(merged.float(), ids(tok)), expected, atol=0.1)  # bfloat16's rounding, no more


def test_the_merged_checkpoint_beside_an_adapter_is_made_once_and_remade_when_what_it_came_from_changes(
    tok, base_dir, tmp_path
):
    model = with_adapter(base_dir)
    adapter = tmp_path / "fetched" / "model"
    lora.save_peft(model, lora.trainable_state(model), adapter, merge=False, base_uri="s3://b/base")
    out = lora.merged_checkpoint(adapter, str(base_dir))
    assert out == adapter.with_name("model-merged")
    assert (out / "tokenizer_config.json").is_file()  # the adapter has none: the base's tokenizer goes with it
    marker = json.loads((out / lora.MERGE_MARKER).read_text())
    assert marker == {
        "adapter_sha256": lora.manifests.file_sha256(adapter / "adapter_model.safetensors"),
        "base": str(base_dir),
        "overrides": {},
    }
    assert torch.allclose(
        logits(AutoModelForCausalLM.from_pretrained(out), ids(tok)), logits(model, ids(tok)), atol=1e-5
    )
    weights = out / "model.safetensors"
    made = weights.stat().st_mtime_ns
    assert lora.merged_checkpoint(adapter, str(base_dir)) == out and weights.stat().st_mtime_ns == made  # reused
    lora.merged_checkpoint(adapter, str(base_dir), overrides={"reward_mean": 1.5})  # other overrides: made again
    assert json.loads((out / lora.MERGE_MARKER).read_text())["overrides"] == {"reward_mean": 1.5}
    assert AutoModelForCausalLM.from_pretrained(out).config.reward_mean == 1.5
    # No work folder left beside them (the lock file stays: tasks.common.folder_lock).
    assert sorted(p.name for p in out.parent.iterdir()) == [".model-merged.lock", "model", "model-merged"]


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
