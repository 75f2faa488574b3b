"""The vision-language bench's setup (bench/vlm.py, issue 54) at its tiny shape: the folder loads as the stages load a
VLM, its processor is a family the stages take (Qwen2.5-VL), every prompt carries one image of the same placeholder
count, and the model scores a batch of them (CPU, offline, seconds). The GPU run itself is bench/gpu/run.sh's."""

import json

import pytest
import torch

from bench.vlm import SHAPES, setup
from tasks.common.nn import vision
from tasks.common.nn.vision_family import family_of


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-bench")
    setup(root, "tiny")
    return root


def test_the_tiny_bench_model_loads_as_a_qwen2_5_vl_the_stages_take(bench_dir):
    processor = vision.load_processor(str(bench_dir / "model"))
    assert type(processor).__name__ == "Qwen2_5_VLProcessor" and family_of(processor).name
    model = vision.load_vision_lm(str(bench_dir / "model"))
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    info = json.loads((bench_dir / "model_info.json").read_text())
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert info["image_size"] == SHAPES["tiny"]["image_size"]


def test_every_prompt_has_one_image_of_the_same_token_count_and_the_model_scores_them(bench_dir):
    processor = vision.load_processor(str(bench_dir / "model"))
    model = vision.load_vision_lm(str(bench_dir / "model"))
    rows = [json.loads(line) for line in (bench_dir / "prompts.jsonl").read_text().splitlines()[:4]]
    encoded = [vision.encode_vlm_prompt(processor, r["prompt"], r["images"], chat_template=False) for r in rows]
    # 56 px at 14 px patches merged 2 x 2: 4 placeholder tokens, between the vision markers, then 64 letters.
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert all(e["input_ids"].count(image_pad) == 4 for e in encoded)
    info = json.loads((bench_dir / "model_info.json").read_text())
    assert {len(e["input_ids"]) for e in encoded} == {info["prompt_tokens"]}
    inputs = vision.vlm_inputs(
        processor,
        [e["input_ids"] for e in encoded],
        [r["images"] for r in rows],
        processor.tokenizer.pad_token_id,
        "cpu",
    )
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[:2] == (4, info["prompt_tokens"]) and torch.isfinite(logits).all()
