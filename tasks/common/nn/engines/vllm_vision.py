"""vLLM's requests for a vision-language model, built without vLLM or torch (eval and the RL factories size
the engine with vision_options before any GPU work):

    options = vision_options(processor, max_images=1)      # VLLMRolloutEngine(..., **options)
    requests = image_requests(prompt_ids, images, options["image_token_id"], options["image_run"])

Each request is {"prompt_token_ids": ids, "multi_modal_data": {"image": [PIL images]}} with each image's run of
placeholder ids collapsed to one (collapse_image_runs; `image_run`, LLaVA's fixed run, splits images side by side):
vLLM expands it to the image's own count itself, and an expanded run would be expanded again (OpenRLHF#1220). The
rollout keeps the prompts as the trainer encoded them (expanded), so the log-prob passes see the same tokens. The engine is sized for `max_images` images a prompt
(vLLM's limit_mm_per_prompt, from the data) and loads the model's tokenizer (vLLM's multimodal processor needs
it, vllm#31123). The placeholder ids are banned through SamplingParams.logit_bias: vLLM has no list of banned token
ids (bad_words takes strings and tokenizes them again; allowed_token_ids would list the whole rest of the
vocabulary). A bias of BAN_BIAS, the least the OpenAI form allows, leaves them e^-100 of the mass.
"""

from __future__ import annotations

import importlib
import itertools

from tasks.common.nn.images import decode_image

#: logit_bias of a banned id: vLLM's OpenAI-compatible bound, a factor e^-100 on its probability.
BAN_BIAS = -100.0


def collapse_image_runs(ids: list[int], image_token_id: int, image_run: int = 0) -> list[int]:
    """`ids` with each image's run of `image_token_id`s as one: the prompt as vLLM expects it with its images. A
    family whose images each stand for the same `image_run` tokens (LLaVA) may put two images side by side, with no
    marker between their runs: a run of k·image_run tokens is k images. Without it (Qwen2-VL: each run inside its
    vision markers) each run of consecutive ids is one image."""
    out = []
    for token, run in itertools.groupby(ids):
        n = len(list(run))
        out += [token] * (n if token != image_token_id else n // image_run if image_run and n % image_run == 0 else 1)
    return out


def image_requests(
    prompt_ids: list[list[int]], images: list[list] | None, image_token_id: int | None, image_run: int = 0
) -> list[dict]:
    """vLLM's prompts: token ids alone, or for rows with images their placeholder runs collapsed and their images
    decoded (images.decode_image's forms) as multi_modal_data. A row whose runs and images differ in number is
    refused naming it (vLLM would fail inside its processor, or pair the wrong features)."""
    if images is None:
        return [{"prompt_token_ids": ids} for ids in prompt_ids]
    requests = []
    for row, (ids, row_images) in enumerate(zip(prompt_ids, images)):
        collapsed = collapse_image_runs(ids, image_token_id, image_run)
        runs = collapsed.count(image_token_id)
        if runs != len(row_images):
            raise ValueError(
                f"images: prompt {row} has {runs} run(s) of image placeholders and {len(row_images)} image(s); "
                "encode each prompt with its own images (vision.encode_vlm_prompt)"
            )
        request = {"prompt_token_ids": collapsed}
        if row_images:
            request["multi_modal_data"] = {"image": [decode_image(i) for i in row_images]}
        requests.append(request)
    return requests


def vision_options(processor, max_images: int) -> dict:
    """VLLMRolloutEngine's options for a vision-language model with this processor: its image token and the tokens
    every image stands for where its family has one count (vision_family: LLaVA's run; 0 where an image's size
    decides it), the ids never sampled (its image and video placeholders and vision markers), and the images a
    prompt may carry (at least 1)."""
    from tasks.common.nn.vision import image_token_ids
    from tasks.common.nn.vision_family import family_of

    return {
        "image_token_id": processor.image_token_id,
        "image_run": family_of(processor).fixed_tokens(processor) or 0,
        "banned_ids": image_token_ids(processor),
        "max_images": max(1, max_images),
    }


def unloadable(model_path: str) -> str:
    """Why this vLLM cannot build the model at `model_path` beside this transformers ("" where it can). vLLM
    imports an architecture's module only when it inspects the model, and there a failed import becomes "failed to
    be inspected" in a subprocess's log: vLLM 0.26's LLaVA imports a class transformers 5.17 renamed (pixtral's
    PixtralRotaryEmbedding; seen on the GPU machine, 2026-12-07)."""
    import vllm
    from transformers import AutoConfig
    from transformers import __version__ as transformers_version
    from vllm import ModelRegistry

    for arch in AutoConfig.from_pretrained(model_path).architectures or []:
        module = getattr(ModelRegistry.models.get(arch), "module_name", "")
        try:
            if module:
                importlib.import_module(module)
        except ImportError as e:
            return f"vLLM {vllm.__version__} cannot import its {arch} beside transformers {transformers_version} ({e})"
    return ""


def ban_bias(banned_ids) -> dict[int, float] | None:
    """SamplingParams.logit_bias keeping `banned_ids` from being sampled (None: nothing banned)."""
    return {int(i): BAN_BIAS for i in banned_ids} or None
