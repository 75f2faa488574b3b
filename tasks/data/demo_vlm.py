"""The built-in vision-language demo (issue 54): name the colour of a shape, with a tiny VLM built offline, of
either family the stages take (tasks/common/nn/vision_family.py): Qwen2-VL (the default) or LLaVA.

    processor = build_vlm_processor()            # character-level tokenizer + Qwen2-VL's image processor (PIL)
    model = build_vlm_model(processor, seed=0)   # Qwen2VLForConditionalGeneration, random weights, ~0.14 M parameters
    processor = build_vlm_processor(family="llava")   # the same tokenizer with <image> + CLIP's image processor (PIL)
    model = build_vlm_model(processor, seed=0)   # LlavaForConditionalGeneration (CLIP tower, Llama), ~0.12 M parameters
    save_demo_vlm(folder, seed=0, family="llava")   # both, loadable with vision.load_vision_lm / vision.load_processor
    rows = make_datasets(seed=0)                 # {"sft", "prompts", "eval", "preference", "preference_eval",
                                                 #  "style_pairs", "unpaired"}: rows of each split

Each image is a 28 × 28 canvas holding one filled shape (a box or an ellipse, of random place and size, on a random
dark background) in one of COLOURS. Every prompt is the same text, PROMPT, so the answer (the colour's letter)
cannot be read from the text: a model that gets it right has looked at the pixels. Images are stored as base64
PNG, the form prepare_data writes (tasks/data/images.py), so the splits need nothing but themselves.

At 28 px with 7 px patches merged 2 × 2, an image is 16 patches and 4 placeholder tokens (Qwen2-VL): big enough to
hold a shape, small enough that a CPU test trains on it in seconds. LLaVA's CLIP tower sees the same 16 patches and
its projector gives each its own token: 16 placeholder tokens an image, CLIP's CLS dropped.
"""

from __future__ import annotations

import base64
import io
import random
import string

from tasks.data.demo import build_tokenizer

COLOURS = {"r": (220, 40, 40), "g": (40, 200, 60), "b": (50, 80, 230), "y": (230, 220, 40)}
PROMPT = "<image>colour?"
IMAGE_SIZE = 28
PATCH_SIZE = 7
MERGE_SIZE = 2
# The preference splits come last: the rows of the first three stay what they were before those were added.
SPLIT_SIZES = {
    "sft": 2000,
    "prompts": 1000,
    "eval": 200,
    "preference": 1000,
    "preference_eval": 200,
    "style_pairs": 1000,
    "unpaired": 1000,
}
#: Splits of preference pairs (the reward model's, its held-out ones, DPO's: the pipeline's names) and of KTO's
#: unpaired examples: the shape's colour is chosen (desirable), another colour rejected (undesirable).
PAIR_SPLITS = ("preference", "preference_eval", "style_pairs")
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # printable ASCII, space and newline
VISION_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
# ChatML, with an image block rendered as Qwen2-VL's placeholder (the processor expands <|image_pad|>).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for block in message['content'] %}"
    "{% if block['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif block['type'] == 'text' %}{{ block['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


FAMILIES = ("qwen2_vl", "llava")


def build_vlm_processor(max_length: int = 128, family: str = "qwen2_vl"):
    """The demo's processor of `family` (FAMILIES; LLaVA's is build_llava_processor's). Qwen2-VL's: a
    Qwen2VLProcessor, demo.build_tokenizer's kind of tokenizer over printable ASCII plus Qwen2-VL's special tokens,
    and the PIL image processor with 7 px patches (min 14 × 14, max 56 × 56 pixels after resizing)."""
    from tokenizers import AddedToken
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tasks.common.nn.vision import image_only

    if family == "llava":
        return build_llava_processor(max_length)
    if family != "qwen2_vl":
        raise ValueError(f"demo_vlm: no family {family!r}; one of {', '.join(FAMILIES)}")
    tokenizer = build_tokenizer(CHARACTERS, max_length=max_length)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE  # the stages' text path (data.turn_end_ids) reads the tokenizer's
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        temporal_patch_size=2,
        merge_size=MERGE_SIZE,
        size={"shortest_edge": (PATCH_SIZE * MERGE_SIZE) ** 2, "longest_edge": (2 * IMAGE_SIZE) ** 2},
    )
    return image_only(Qwen2VLProcessor)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
    )


def build_vlm_model(processor, seed: int = 0, hidden_size: int = 64, num_layers: int = 2, max_positions: int = 256):
    """A tiny VLM of the processor's family with random weights (build_llava_model for a LlavaProcessor): for
    Qwen2-VL a Qwen2VLForConditionalGeneration, a 2-block vision tower (32 wide) whose merger projects into a 2-layer
    language model `hidden_size` wide, with M-RoPE over the head's 8 frequency pairs."""
    import torch
    from transformers import LlavaProcessor, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    if isinstance(processor, LlavaProcessor):
        return build_llava_model(processor, seed, hidden_size, num_layers, max_positions)

    tokenizer = processor.tokenizer
    ids = tokenizer.convert_tokens_to_ids
    heads = 4
    pairs = hidden_size // heads // 2
    mrope = [pairs - 2 * (pairs // 3), pairs // 3, pairs // 3]  # temporal, height, width: sums to the pairs
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": 2,
            "max_position_embeddings": max_positions,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": hidden_size,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": PATCH_SIZE,
            "temporal_patch_size": 2,
            "spatial_merge_size": MERGE_SIZE,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, ids("<|im_end|>")]
    return model


#: LLaVA's demo: the same ChatML, an image block rendered as LLaVA's <image> (the processor expands it to its run).
LLAVA_TOKENS = ["<|im_start|>", "<|im_end|>", "<image>"]
LLAVA_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")


def build_llava_processor(max_length: int = 128):
    """A LlavaProcessor: demo.build_tokenizer's tokenizer plus <image> and ChatML's markers, and CLIP's PIL image
    processor at the demo's 28 px (no resize beyond it, CLIP's mean and std), 7 px patches: 16 tokens an image."""
    from tokenizers import AddedToken
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    tokenizer = build_tokenizer(CHARACTERS, max_length=max_length)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in LLAVA_TOKENS], special_tokens=True)
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",  # CLIP's CLS dropped: one token per patch
        num_additional_image_tokens=1,  # the CLS the tower adds
        chat_template=LLAVA_CHAT_TEMPLATE,
    )


def build_llava_model(processor, seed: int = 0, hidden_size: int = 64, num_layers: int = 2, max_positions: int = 256):
    """A tiny LlavaForConditionalGeneration with random weights: a 2-layer CLIP vision tower (32 wide, 7 px patches
    of 28 px images) whose last layer's patch features a 2-layer MLP projects into a 2-layer Llama `hidden_size`
    wide (1-D RoPE)."""
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    tokenizer = processor.tokenizer
    config = LlavaConfig(
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH_SIZE,
            "projection_dim": 32,
        },
        text_config={
            "model_type": "llama",
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": max_positions,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        image_token_id=processor.image_token_id,
        vision_feature_select_strategy=processor.vision_feature_select_strategy,
        vision_feature_layer=-1,
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return model


def save_demo_vlm(folder, seed: int = 0, family: str = "qwen2_vl") -> None:
    """The demo VLM of `family` and its processor, saved as one HF folder."""
    processor = build_vlm_processor(family=family)
    build_vlm_model(processor, seed=seed).save_pretrained(folder)
    processor.save_pretrained(folder)


def draw(colour: str, rng: random.Random):
    """A 28 × 28 RGB image: one box or ellipse of `colour` (a key of COLOURS) on a dark background."""
    from PIL import Image, ImageDraw

    background = tuple(rng.randrange(0, 60) for _ in range(3))
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), background)
    w, h = rng.randrange(8, 20), rng.randrange(8, 20)
    x, y = rng.randrange(0, IMAGE_SIZE - w), rng.randrange(0, IMAGE_SIZE - h)
    shape = ImageDraw.Draw(image).rectangle if rng.random() < 0.5 else ImageDraw.Draw(image).ellipse
    shape((x, y, x + w, y + h), fill=COLOURS[colour])
    return image


def png_base64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def make_datasets(seed: int = 0, sizes: dict[str, int] = SPLIT_SIZES) -> dict[str, list[dict]]:
    """Deterministic rows: sft {prompt, images, response}; prompts (RL) and eval (held out) {prompt, images, label};
    the PAIR_SPLITS {prompt, images, chosen, rejected}; unpaired {prompt, images, completion, label}, every other
    row desirable. Each colour is the answer equally often in every split."""
    rng = random.Random(seed)
    codes = sorted(COLOURS)
    splits = {}
    for split, n in sizes.items():
        answers = [codes[i % len(codes)] for i in range(n)]
        rng.shuffle(answers)
        rows = []
        for i, a in enumerate(answers):
            row = {"prompt": PROMPT, "images": [png_base64(draw(a, rng))]}
            if split in PAIR_SPLITS or split == "unpaired":
                wrong = rng.choice([c for c in codes if c != a])
                desirable = i % 2 == 0
                pair = {"chosen": a, "rejected": wrong}
                row |= pair if split != "unpaired" else {"completion": a if desirable else wrong, "label": desirable}
            else:
                row["response" if split == "sft" else "label"] = a
            rows.append(row)
        splits[split] = rows
    return splits
