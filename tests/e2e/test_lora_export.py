"""LoRA (--lora_rank) in every training stage, and what each exports, on the tiny chat model.

Stages run in this process (stage.run) against the session's Ray head, on a few rows of JSONL data;
step counts are tiny and learning rates large, so the adapters move in a couple of steps. What is
checked: only the adapters train; the adapter export names its base in the manifest and loads
(merged on load) in later stages; the merged export, also under ZeRO-3, is a plain transformers
checkpoint with the logits of base + adapter; the reward model's export scores as the stage did and
carries its normalisation statistics; RL and DPO take their reference from the policy's own base
(adapters off) instead of a second model.
"""

import json

import pytest
import torch

from tasks.common import manifest as manifests
from tasks.common import stage
from tasks.common.config import ConfigError, make_config
from tasks.common.nn import lora
from tasks.common.nn.models import resolve_model, sequence_logprobs
from tasks.preference.config import PreferenceConfig
from tasks.reward_model.config import RewardModelConfig
from tasks.rl.config import RLConfig
from tasks.sft.config import SFTConfig

from tests.in_process import stages_in_this_process, write_jsonl
from tests.tiny_chat import build_chat_model, chat_rows

LORA = {"lora_rank": 4, "lora_alpha": 8}
PROBES = [[1, 20, 30, 40, 50, 60, 70], [1, 23, 33, 43, 53]]  # token ids scored by both sides of each comparison


@pytest.fixture(scope="module")
def env(ray_address, s3_server, tmp_path_factory):
    """The base model, the data files, and RAY_ADDRESS for stages run in this process."""
    root = tmp_path_factory.mktemp("lora")
    rows = chat_rows(16)
    prompts = [r["messages"][1]["content"] for r in rows]
    with stages_in_this_process(ray_address, root):
        yield {
            "root": root,
            "s3": s3_server,
            "base": build_chat_model(root / "base"),
            "sft_data": write_jsonl(
                root / "sft.jsonl", [{"prompt": p, "response": r["chosen"]} for p, r in zip(prompts, rows)]
            ),
            "pairs": write_jsonl(
                root / "pairs.jsonl",
                [{"prompt": p, "chosen": r["chosen"], "rejected": r["rejected"]} for p, r in zip(prompts, rows)],
            ),
            "prompts": write_jsonl(root / "prompts.jsonl", [{"prompt": p} for p in prompts]),
        }


def run_stage(name: str, cls, work, values: dict) -> dict:
    stage.run(name, make_config(cls, values), work)
    return manifests.read_manifest(values["output"])


def metrics_of(uri: str, where) -> list[dict]:
    path, _ = manifests.fetch(uri, where)
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def sft(env, name: str, **extra) -> str:
    from tasks.sft.trainer import train

    out = extra.pop("output", None) or str(env["root"] / name)
    run_stage(
        "sft",
        SFTConfig,
        train,
        {
            "output": out,
            "pretrain": env["base"],
            "dataset": env["sft_data"],
            "max_steps": 3,
            "train_batch_size": 8,
            "learning_rate": 2e-2,
            "lr_warmup_steps": 0,
            "logging_steps": 1,
            **LORA,
            **extra,
        },
    )
    return out


def reward_model(env, name: str, **extra) -> str:
    from tasks.reward_model.trainer import train

    out = str(env["root"] / name)
    run_stage(
        "reward_model",
        RewardModelConfig,
        train,
        {
            "output": out,
            "pretrain": env["base"],
            "dataset": env["pairs"],
            "max_steps": 3,
            "train_batch_size": 8,
            "learning_rate": 2e-2,
            "lr_warmup_steps": 0,
            "logging_steps": 1,
            **LORA,
            **extra,
        },
    )
    return out


def causal_logits(model) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids])).logits[0] for ids in PROBES]


def assert_close(a: list[torch.Tensor], b: list[torch.Tensor], atol: float = 1e-5) -> None:
    for x, y in zip(a, b):
        assert torch.allclose(x, y, atol=atol), (x - y).abs().max()


@pytest.fixture(scope="module")
def sft_adapter(env) -> str:
    """LoRA SFT exporting the adapter, to S3 (the base is a local folder)."""
    return sft(env, "sft_adapter", output=env["s3"].uri("lora/sft_adapter"))


@pytest.fixture(scope="module")
def rm_adapter(env) -> str:
    return reward_model(env, "rm_adapter")


# ------------------------------------------------------------------ config


def test_lora_flags_are_validated_in_one_line():
    base = {"output": "out", "pretrain": "m", "dataset": "d"}
    for values, error in (
        ({"lora_rank": -1}, "lora_rank: must not be negative, got -1; use 0 (full fine-tuning) or a rank such as 8"),
        ({"merge_lora": True}, "merge_lora: only applies to LoRA training; set --lora_rank too, or drop it"),
        ({"lora_rank": 8, "lora_alpha": 0}, "lora_alpha: must be positive, got 0; use e.g. 16 (or 2 × lora_rank)"),
        ({"lora_rank": 8, "lora_dropout": 1.0}, "lora_dropout: must be in [0, 1), got 1.0"),
        (
            {"lora_rank": 8, "target_modules": "q_proj,"},
            "target_modules: 'q_proj,' is not a module list; use all-linear or comma-separated names such as q_proj,v_proj",
        ),
    ):
        with pytest.raises(ConfigError) as caught:
            make_config(SFTConfig, {**base, **values})
        assert str(caught.value) == error
    cfg = make_config(SFTConfig, {**base, "lora_rank": 8})
    assert (cfg.lora_alpha, cfg.lora_dropout, cfg.target_modules, cfg.merge_lora) == (16, 0.0, "all-linear", False)


def test_target_modules_naming_no_module_is_refused_naming_the_ones_there(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_chat_model(tmp_path / "m"))
    cfg = make_config(
        SFTConfig, {"output": "o", "pretrain": "m", "dataset": "d", "lora_rank": 4, "target_modules": "q_proj,qkv"}
    )
    with pytest.raises(ConfigError) as caught:
        lora.apply_lora(model, cfg)
    assert str(caught.value).startswith("target_modules: qkv name no module of ")
    assert str(caught.value).endswith(
        "; use all-linear or some of down_proj,gate_proj,k_proj,lm_head,o_proj,q_proj,up_proj,v_proj"
    )
    cfg.target_modules = "q_proj,v_proj"
    trainable = [n for n, p in lora.apply_lora(model, cfg).named_parameters() if p.requires_grad]
    assert trainable and all(".q_proj.lora_" in n or ".v_proj.lora_" in n for n in trainable)


# ------------------------------------------------------------------ SFT


@pytest.mark.slow  # make test-all: LoRA stage runs and exports (80 s together)
def test_lora_sft_trains_only_the_adapters_and_exports_them_naming_the_base(env, sft_adapter, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    m = manifests.read_manifest(sft_adapter)
    assert m["base_model"] == env["base"] and m["inputs"]["pretrain"] == env["base"]
    model_files = sorted(rel.split("/", 1)[1] for rel in m["files"] if rel.startswith("model/"))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= set(model_files)
    assert not any(f.endswith("model.safetensors") and f != "adapter_model.safetensors" for f in model_files)

    # Trained: the adapters only, as many parameters as rank-4 LoRA on every linear layer but the head has.
    fresh = lora.apply_lora(
        AutoModelForCausalLM.from_pretrained(env["base"]),
        make_config(SFTConfig, {"output": "o", "pretrain": "m", "dataset": "d", **LORA}),
    )
    expected = sum(p.numel() for n, p in fresh.named_parameters() if "lora_" in n)
    assert m["metrics"]["trainable_params"] == expected < 0.1 * sum(p.numel() for p in fresh.parameters())
    path, _ = manifests.fetch(sft_adapter, tmp_path, subdir="model")
    saved = load_file(path / "adapter_model.safetensors")
    assert all("lora_" in k for k in saved) and sum(t.numel() for t in saved.values()) == expected
    assert json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"] == env["base"]

    # Loading the output merges the adapter into the base: the base's other weights are untouched.
    base = AutoModelForCausalLM.from_pretrained(env["base"]).state_dict()
    merged = AutoModelForCausalLM.from_pretrained(resolve_model(sft_adapter)).state_dict()
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.endswith("_proj.weight") for k in changed)
    losses = [r["loss"] for r in metrics_of(sft_adapter, tmp_path / "m")]
    assert losses[-1] < losses[0]


@pytest.mark.slow  # make test-all: LoRA stage runs and exports (80 s together)
def test_merged_export_gives_the_logits_of_base_plus_adapter(env, sft_adapter, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GenerationConfig

    merged_out = sft(env, "sft_merged", merge_lora=True)
    m = manifests.read_manifest(merged_out)
    assert "base_model" not in m
    folder = resolve_model(merged_out)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json"):
        assert f"model/{name}" in m["files"], name
    assert GenerationConfig.from_pretrained(folder).eos_token_id is not None

    merged = AutoModelForCausalLM.from_pretrained(folder).eval()
    adapter_dir, _ = manifests.fetch(sft_adapter, tmp_path, subdir="model")
    base_plus_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(env["base"]), str(adapter_dir)
    ).eval()
    base = AutoModelForCausalLM.from_pretrained(env["base"]).eval()
    assert_close(causal_logits(merged), causal_logits(base_plus_adapter))  # same seed, same steps: the same adapter
    assert_close(causal_logits(AutoModelForCausalLM.from_pretrained(resolve_model(sft_adapter))), causal_logits(merged))
    assert not torch.allclose(causal_logits(base)[0], causal_logits(merged)[0], atol=1e-3)


@pytest.mark.slow  # make test-all: LoRA stage runs and exports (80 s together)
def test_zero3_lora_sft_exports_a_merged_checkpoint_the_auto_class_loads(env, tmp_path):
    """Under ZeRO-3 each rank holds a shard: the adapters are gathered to rank 0 and merged there (2
    workers, gradient checkpointing on, which LoRA needs input gradients for)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = sft(env, "sft_zero3", zero_stage=3, merge_lora=True, num_gpus_per_node=2, gradient_checkpointing=True)
    m = manifests.read_manifest(out)
    assert m["metrics"]["workers"] == 2 and m["config"]["zero_stage"] == 3
    model = AutoModelForCausalLM.from_pretrained(resolve_model(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(out))
    base = AutoModelForCausalLM.from_pretrained(env["base"]).eval()
    assert model.config.vocab_size == len(tokenizer)
    assert not torch.allclose(causal_logits(base)[0], causal_logits(model)[0], atol=1e-3)  # the adapters learned
    ids = tokenizer("3+4", return_tensors="pt").input_ids
    assert ids[0, 0] == tokenizer.bos_token_id  # encoded as training encoded it (data.encode_prompt's BOS)
    # min_new_tokens: trained on BOS-led prompts, the merged model may close its turn at once.
    assert model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3


@pytest.mark.slow  # 23 s; make test resumes a stage from its checkpoint in tests/e2e/test_operations.py
def test_lora_sft_resumes_from_its_checkpoint(env, tmp_path):
    """DeepSpeed's checkpoint of a peft model restores it: a longer rerun goes on from the last step."""
    out = str(env["root"] / "sft_resume")
    sft(env, "sft_resume", output=out, max_steps=2, save_steps=2)
    sft(env, "sft_resume", output=out, max_steps=3, save_steps=2)
    m = manifests.read_manifest(out)
    assert m["resumed_from_step"] == 2 and [r["step"] for r in metrics_of(out, tmp_path)] == [3]
    assert m["base_model"] == env["base"]


# ------------------------------------------------------------------ reward model


def held_out_scores(model, tokenizer, pairs_file: str) -> tuple[torch.Tensor, list[list[int]]]:
    """The stage's held-out scores recomputed (its own tokenisation and scoring, on `model`), and the sequences."""
    from tasks.reward_model.trainer import evaluate_pairs, tokenize_pairs

    rows = [json.loads(line) for line in open(pairs_file)]
    cfg = make_config(RewardModelConfig, {"output": "o", "pretrain": "m", "dataset": "d"})
    chosen, rejected, _ = tokenize_pairs({k: [r[k] for r in rows] for k in rows[0]}, tokenizer, cfg)
    c, r = evaluate_pairs(model, chosen, rejected, tokenizer.pad_token_id, torch.device("cpu"))
    return torch.tensor(c + r), (chosen + rejected)


@pytest.mark.slow  # make test-all: LoRA stage runs and exports (80 s together)
@pytest.mark.parametrize("merge", [True, False], ids=["merged", "adapter"])
def test_reward_model_export_loads_as_a_sequence_classifier_with_its_statistics(env, rm_adapter, merge):
    """Merged at export or on load, the reward model loads with AutoModelForSequenceClassification
    (num_labels=1, the trained head included), scores the held-out pairs as the stage did (their mean and
    std are the statistics the stage stored), and has those statistics in config.json."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from tasks.common.nn.models import load_tokenizer

    out = reward_model(env, "rm_merged", merge_lora=True) if merge else rm_adapter
    m = manifests.read_manifest(out)
    assert ("base_model" in m) is not merge
    path = resolve_model(out)
    stats = m["metrics"]["reward_mean"], m["metrics"]["reward_std"]
    config = AutoConfig.from_pretrained(path)
    assert (config.reward_mean, config.reward_std) == stats and config.num_labels == 1
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    assert model.score.weight.shape[0] == 1
    scores, sequences = held_out_scores(model, load_tokenizer(path), env["pairs"])
    assert abs(scores.mean().item() - stats[0]) < 1e-5 and abs(scores.std().item() - stats[1]) < 1e-5
    with torch.no_grad():  # the plain transformers forward of one unpadded sequence: the same score
        for k in (0, len(sequences) - 1):
            assert abs(model(input_ids=torch.tensor([sequences[k]])).logits[0, 0].item() - scores[k].item()) < 1e-5


# ------------------------------------------------------------------ RL and DPO


@pytest.mark.slow  # 23 s; make test runs RL with LoRA in tests/e2e/test_byo_e2e.py
def test_rl_with_lora_takes_its_reference_from_the_actors_base(env, sft_adapter, rm_adapter, tmp_path):
    """No reference group is placed; the KL is exactly 0 before the first update (the adapters start at
    zero, and the reference is the same weights with them off) and not after. Policy and critic start
    from adapter outputs (merged on load) and train adapters of their own."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from tasks.rl.trainer import train

    out = str(env["root"] / "rl")
    m = run_stage(
        "rl",
        RLConfig,
        train,
        {
            "output": out,
            "pretrain": sft_adapter,
            "reward_pretrain": rm_adapter,
            "prompt_data": env["prompts"],
            "max_steps": 2,
            "rollout_batch_size": 4,
            "train_batch_size": 4,
            "max_epochs": 1,
            "generate_max_len": 4,
            "actor_learning_rate": 5e-2,
            "lr_warmup_steps": 0,
            "colocate_all_models": True,
            "save_value_network": True,
            **LORA,
        },
    )
    assert m["metrics"]["ref_workers"] == 0 and m["metrics"]["steps"] == 2
    assert m["base_model"] == sft_adapter  # an adapter on the SFT adapter's merged weights
    logged = metrics_of(out, tmp_path)
    assert logged[0]["kl"] == 0.0 and logged[1]["kl"] != 0.0
    policy = AutoModelForCausalLM.from_pretrained(resolve_model(out)).eval()
    sft_model = AutoModelForCausalLM.from_pretrained(resolve_model(sft_adapter)).eval()
    assert not torch.allclose(causal_logits(policy)[0], causal_logits(sft_model)[0], atol=1e-4)
    assert "critic/model.safetensors" in m["files"]  # the critic's export is always merged
    critic_dir, _ = manifests.fetch(out, tmp_path / "critic", subdir="critic")
    assert AutoModelForSequenceClassification.from_pretrained(str(critic_dir), num_labels=1).config.num_labels == 1


@pytest.mark.slow  # make test-all: LoRA stage runs and exports (80 s together)
def test_dpo_with_lora_takes_its_reference_from_the_policys_base(env, tmp_path):
    """The implicit rewards β·(log π − log π_ref) are 0 at the first step (up to the padding of separate
    forward passes): the reference is the policy with its zero-initialised adapters off; they move after it."""
    from tasks.preference.trainer import train

    out = str(env["root"] / "dpo")
    m = run_stage(
        "preference",
        PreferenceConfig,
        train,
        {
            "output": out,
            "method": "dpo",
            "pretrain": env["base"],
            "dataset": env["pairs"],
            "max_steps": 2,
            "train_batch_size": 8,
            "learning_rate": 2e-2,
            "lr_warmup_steps": 0,
            "logging_steps": 1,
            "beta": 0.5,
            **LORA,
        },
    )
    assert m["base_model"] == env["base"] and m["metrics"]["trainable_params"] > 0
    logged = metrics_of(out, tmp_path)
    assert abs(logged[0]["chosen_reward"]) < 1e-5 and abs(logged[0]["rejected_reward"]) < 1e-5
    assert abs(logged[1]["chosen_reward"]) > 1e-3


def test_frozen_base_is_the_base_model(tmp_path):
    """lora.FrozenBase runs the peft model with its adapters off (and leaves its training mode as it was)."""
    from transformers import AutoModelForCausalLM

    path = build_chat_model(tmp_path / "m")
    cfg = make_config(SFTConfig, {"output": "o", "pretrain": "m", "dataset": "d", **LORA})
    model = lora.apply_lora(AutoModelForCausalLM.from_pretrained(path), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    model.train()
    ids = torch.tensor(PROBES[:1])
    mask = torch.ones_like(ids)
    base = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        reference = sequence_logprobs(lora.FrozenBase(model), ids, mask)
        assert torch.equal(reference, sequence_logprobs(base, ids, mask))
        assert not torch.allclose(reference, sequence_logprobs(model, ids, mask))
    assert model.training


def test_adapter_weights_are_peft_files_that_load_with_the_trained_logits(tmp_path):
    """What a vLLM engine is handed at each sync (lora.adapter_weights, saved to a folder): peft's own adapter
    files, which PeftModel loads onto the base to give the trained model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tasks.common.nn.engines.vllm_engine import lora_max_rank

    path = build_chat_model(tmp_path / "m")
    cfg = make_config(SFTConfig, {"output": "o", "pretrain": "m", "dataset": "d", **LORA})
    model = lora.apply_lora(AutoModelForCausalLM.from_pretrained(path), cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    adapter = lora.adapter_weights(model)
    assert adapter.config["r"] == 4 and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in adapter.tensors)
    saved = adapter.save(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), str(saved)).eval()
    ids = torch.tensor(PROBES[:1])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-5)
    assert [lora_max_rank(r) for r in (1, 4, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
