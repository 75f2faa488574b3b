"""The bench's EOS-engineered model (bench/eos_model.py, issue 52): a tiny random Qwen2 with tied embeddings,
engineered and calibrated to a mean length of 20 under a cap of 80, then sampled with transformers' generate at
the bench's temperature (CPU, offline, a few seconds)."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from bench.common import build_tokenizer
from bench.eos_model import (
    BENCH_TEMPERATURE,
    CALIBRATION_FILE,
    _prompt_ids,
    build,
    engineer,
    length_stats,
    set_eos_scale,
)

TARGET, CAP, SAMPLES = 20, 80, 256


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The original (saved, tied) and the engineered folder build() wrote, and its calibration record."""
    root = tmp_path_factory.mktemp("eos")
    tokenizer = build_tokenizer(320)
    config = Qwen2Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    record = build(root / "model", root / "eos", TARGET, CAP, BENCH_TEMPERATURE, samples=64, verify=0)
    return root, tokenizer, record


def test_length_stats():
    stats = length_stats([1, 2, 3, 4, 100, 100], cap=100)
    assert stats["n"] == 6 and stats["mean"] == 35.0 and stats["median"] == 3.5 and stats["max"] == 100
    assert stats["truncation_rate"] == pytest.approx(1 / 3, abs=1e-4)


def test_calibrated_lengths_and_a_steady_hazard(models):
    root, tokenizer, record = models
    assert json.loads((root / "eos" / CALIBRATION_FILE).read_text()) == record
    assert record["predicted"]["mean"] == pytest.approx(TARGET, abs=0.5)
    assert record["sampling"] == dict(temperature=BENCH_TEMPERATURE, top_p=1.0, top_k=0, prompt_tokens=128)
    # A standard untied Qwen2 checkpoint (what vLLM loads): lm_head.weight saved on its own.
    assert json.loads((root / "eos" / "config.json").read_text())["tie_word_embeddings"] is False
    generation = json.loads((root / "eos" / "generation_config.json").read_text())
    assert (generation["do_sample"], generation["temperature"], generation["top_k"], generation["top_p"]) == (
        True,
        BENCH_TEMPERATURE,
        0,
        1.0,
    )
    with safe_open(str(root / "eos" / "model.safetensors"), "pt") as f:
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(f.keys())

    model = AutoModelForCausalLM.from_pretrained(root / "eos").eval()
    eos = tokenizer.eos_token_id
    torch.manual_seed(1)
    prompts = _prompt_ids(tokenizer, None, SAMPLES)
    config = GenerationConfig(
        do_sample=True,
        temperature=BENCH_TEMPERATURE,
        top_k=0,
        top_p=1.0,
        max_new_tokens=CAP,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), generation_config=config)[
            :, prompts.shape[1] :
        ]
    hit = out == eos
    lengths = torch.where(hit.any(1), hit.int().argmax(1) + 1, torch.full((SAMPLES,), CAP))
    stats = length_stats(lengths.tolist(), CAP)
    assert abs(stats["mean"] - TARGET) < 0.15 * TARGET, stats
    assert 0 < stats["truncation_rate"] < 0.05 and stats["max"] == CAP  # geometric: a tail to the cap

    # The hazard, events over tokens at risk, in the first and the second half of the cap: about the same.
    t = torch.arange(1, CAP + 1)
    at_risk, ended = (t[None] <= lengths[:, None]), (t[None] == lengths[:, None]) & hit.any(1)[:, None]
    half = CAP // 2
    first, second = (
        (ended[:, :half].sum() / at_risk[:, :half].sum()).item(),
        (ended[:, half:].sum() / at_risk[:, half:].sum()).item(),
    )
    assert 0.5 < second / first < 2, (first, second)
    predicted = record["predicted"]
    assert 0.8 < predicted["hazard_second_half"] / predicted["hazard_first_half"] < 1.25
    assert 0.5 < first * TARGET < 1.5


def test_the_channel_changes_only_the_eos_logit(models):
    root, tokenizer, record = models
    eos, c = tokenizer.eos_token_id, record["channel"]
    original = AutoModelForCausalLM.from_pretrained(root / "model").eval()
    engineered = AutoModelForCausalLM.from_pretrained(root / "eos").eval()
    # The same channel taken out of the original with nothing in it (a = 0, b = 0): what the engineering must not move.
    ablated = AutoModelForCausalLM.from_pretrained(root / "model").eval()
    engineer(ablated, eos, channel=c, value=0.0)
    x = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(0))
    keep = torch.arange(320) != eos

    def others(model):  # log-probs over the non-EOS tokens, renormalised
        with torch.no_grad():
            z = model(x).logits.float()[..., keep]
        return z.log_softmax(-1)

    ours = others(engineered)
    assert (ours - others(ablated)).abs().max() < 1e-2  # the constant a only adds to the norms' mean square
    zero_b = AutoModelForCausalLM.from_pretrained(root / "eos").eval()
    set_eos_scale(zero_b, eos, c, 0.0)
    assert torch.equal(others(zero_b), ours)  # b moves EOS's logit alone, bit for bit
    # Against the original, the only change is one of 64 channels taken out: a small KL.
    ref = others(original)
    assert (ours.exp() * (ours - ref)).sum(-1).mean() < 1e-2
    # EOS's logit is b times the normed channel, nothing else.
    with torch.no_grad():
        y = engineered.model(x).last_hidden_state
        assert torch.allclose(engineered(x).logits[..., eos], record["b"] * y[..., c], atol=1e-5)
