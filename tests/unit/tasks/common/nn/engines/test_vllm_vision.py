"""The vLLM path of a vision-language model (issue 54): its pure parts on CPU (placeholder runs collapsed, requests
built, the ban, the engine's options), the engine itself on a GPU (marked gpu, skipped without CUDA and vllm, as
test_vllm_engine.py)."""

import importlib.util

import pytest
import torch
from PIL import Image

from tasks.common.config import ConfigError
from tasks.common.nn import vision
from tasks.common.nn.engines.vllm_vision import BAN_BIAS, ban_bias, collapse_image_runs, image_requests, vision_options
from tasks.common.nn.images import decode_image
from tasks.data import demo_vlm

from tests.vlm_demo import in_tower

GPU = torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def processor():
    return demo_vlm.build_vlm_processor()


@pytest.fixture(scope="module")
def rows():
    return demo_vlm.make_datasets(seed=0, sizes={"prompts": 4})["prompts"]


def test_each_run_of_image_placeholders_collapses_to_one():
    assert collapse_image_runs([1, 5, 9, 9, 9, 9, 6, 9, 9, 7, 9], 9) == [1, 5, 9, 6, 9, 7, 9]
    assert collapse_image_runs([9, 9], 9) == [9]
    assert collapse_image_runs([1, 2, 3], 9) == [1, 2, 3]
    assert collapse_image_runs([], 9) == []


def test_requests_carry_the_collapsed_prompt_and_the_decoded_images(processor, rows):
    """Two images in one prompt: two runs, each one token between its vision markers, and the images as PIL in
    order; a text row stays token ids alone; the rollout keeps the expanded ids (not these)."""
    two = {"prompt": "<image>left, <image>right: colour?", "images": rows[0]["images"] + rows[1]["images"]}
    prompts = [two, rows[2]]
    ids = [vision.encode_vlm_prompt(processor, r["prompt"], r["images"])["input_ids"] for r in prompts]
    pad = processor.image_token_id
    assert ids[0].count(pad) == 8  # 4 tokens an image, expanded
    requests = image_requests(ids + [[1, 2, 3]], [r["images"] for r in prompts] + [[]], pad)
    first = requests[0]["prompt_token_ids"]
    assert first.count(pad) == 2 and len(first) == len(ids[0]) - 6
    start, end = processor.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    assert [first[i - 1 : i + 2] for i, t in enumerate(first) if t == pad] == [[start, pad, end]] * 2
    pictures = requests[0]["multi_modal_data"]["image"]
    assert [p.size for p in pictures] == [(28, 28), (28, 28)] and all(isinstance(p, Image.Image) for p in pictures)
    assert pictures[1].tobytes() == decode_image(rows[1]["images"][0]).tobytes()
    assert requests[2] == {"prompt_token_ids": [1, 2, 3]}
    assert image_requests([[1, 2]], None, None) == [{"prompt_token_ids": [1, 2]}]


def test_a_request_whose_runs_and_images_differ_is_refused_naming_it(processor, rows):
    ids = vision.encode_vlm_prompt(processor, rows[0]["prompt"], rows[0]["images"])["input_ids"]
    with pytest.raises(ValueError, match=r"^images: prompt 1 has 1 run\(s\) of image placeholders and 2 image\(s\)"):
        image_requests([ids, ids], [rows[0]["images"], rows[0]["images"] * 2], processor.image_token_id)


def test_llava_images_side_by_side_are_one_placeholder_each(rows):
    """LLaVA has no markers around an image's run: two adjacent images are one run of 2 × 16 ids, which its fixed
    run (vision_options' image_run) splits into one placeholder per image; counted as one run it is refused."""
    llava = demo_vlm.build_vlm_processor(family="llava")
    token, images = llava.image_token_id, rows[0]["images"] + rows[1]["images"]
    ids = vision.encode_vlm_prompt(llava, "<image><image>colour?", images)["input_ids"]
    options = vision_options(llava, max_images=2)
    assert options["image_run"] == 16 and ids.count(token) == 32
    prompt = image_requests([ids], [images], token, options["image_run"])[0]["prompt_token_ids"]
    at = prompt.index(token)
    assert prompt.count(token) == 2 and prompt[at : at + 2] == [token, token] and len(prompt) == len(ids) - 30
    with pytest.raises(ValueError, match=r"^images: prompt 0 has 1 run\(s\) of image placeholders and 2 image\(s\)"):
        image_requests([ids], [images], token)
    assert collapse_image_runs([1, 9, 9, 9, 9, 6, 9, 9, 9], 9, image_run=2) == [1, 9, 9, 6, 9]  # 3: not whole images


def test_the_placeholder_ids_are_banned_through_logit_bias(processor):
    options = vision_options(processor, max_images=0)
    assert options["image_token_id"] == processor.image_token_id and options["max_images"] == 1
    assert options["image_run"] == 0  # Qwen2-VL: an image's size decides its run, each inside its own markers
    assert options["banned_ids"] == vision.image_token_ids(processor)
    bias = ban_bias(options["banned_ids"])
    assert set(bias) == set(vision.image_token_ids(processor)) and set(bias.values()) == {BAN_BIAS}
    assert ban_bias([]) is None and vision_options(processor, 3)["max_images"] == 3


@pytest.fixture(scope="module", params=demo_vlm.FAMILIES)
def vlm_engine(request, tmp_path_factory):
    """The demo VLM of each family saved, loaded in bf16 on the GPU, and a vLLM engine on it with images."""
    from tasks.common.nn.engines.vllm_engine import VLLMRolloutEngine
    from tasks.common.nn.engines.vllm_vision import unloadable
    from tasks.common.nn.strategy import init_distributed

    path = tmp_path_factory.mktemp(f"vllm-vlm-{request.param}") / "m"
    demo_vlm.save_demo_vlm(path, seed=0, family=request.param)
    if why := unloadable(str(path)):
        # vLLM 0.26 with transformers 5.17: its LLaVA module does not import. The engine says so in one line.
        with pytest.raises(ConfigError, match="use --rollout_engine transformers") as refused:
            VLLMRolloutEngine(str(path), None, max_model_len=256, gpu_memory_utilization=0.2, seed=0)
        assert "\n" not in str(refused.value)
        pytest.xfail(f"{request.param}: {why}")
    init_distributed()
    processor = vision.load_processor(str(path))
    model = vision.load_vision_lm(str(path)).to("cuda", torch.bfloat16).eval()
    engine = VLLMRolloutEngine(
        str(path),
        processor.tokenizer,
        max_model_len=256,
        gpu_memory_utilization=0.2,
        seed=0,
        **vision_options(processor, max_images=2),
    )
    return engine, model, processor  # both families' engines fit the GPU at once (0.2 of its memory each)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and vllm")
def test_vllm_generates_from_the_images_never_samples_a_placeholder_and_follows_the_trained_weights(vlm_engine, rows):
    """vLLM's multimodal path on the demo VLM of each family: the rollout keeps the expanded prompts and their images
    (a prompt of two images side by side among them), no banned id is sampled, and after the language model's
    weights change (the trainable ones alone synced) the engine's log-probabilities are the trainer's on the same
    rows with the same images (bf16 tolerance)."""
    from tasks.common.nn.losses import logprob_mismatch
    from tasks.common.nn.vision_passes import VisionRows

    engine, model, processor = vlm_engine
    ids = [vision.encode_vlm_prompt(processor, r["prompt"], r["images"])["input_ids"] for r in rows]
    images = [r["images"] for r in rows]
    images[1] = rows[1]["images"] + rows[2]["images"]  # two images, no text between them
    ids[1] = vision.encode_vlm_prompt(processor, "<image><image>colour?", images[1])["input_ids"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if in_tower(name):
                p.requires_grad_(False)  # as --freeze_visual_encoder leaves it
            else:
                p.add_(0.05 * torch.randn_like(p))
    engine.load_weights(model, trainable_only=True)
    rollout = engine.generate(ids * 4, max_new_tokens=6, images=images * 4)
    assert (
        rollout.images == images * 4 and rollout.sequences[0, : rollout.prompt_width].tolist()[-len(ids[0]) :] == ids[0]
    )
    passes = VisionRows.of(processor)
    assert not torch.isin(rollout.responses[rollout.response_mask.bool()], passes.banned).any()
    with torch.no_grad():
        trainer = (
            passes.logprobs(
                model,
                rollout.sequences.cuda(),
                rollout.attention_mask.cuda(),
                rollout.images,
                start=rollout.prompt_width - 1,
            )
            .float()
            .cpu()
        )
    assert logprob_mismatch(trainer, rollout.logprobs, rollout.response_mask)["engine_logprob_max_diff"] < 0.1
