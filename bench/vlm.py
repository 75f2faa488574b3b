"""Vision-language RL on the GPU (issue 54): GRPO on a Qwen2.5-VL-3B-shaped model (random weights), vLLM colocated,
every prompt one image. Each run writes <dir>/results/vlm_<shape>_<system>.json.

    python bench/vlm.py setup --dir /tmp/bench-vlm                       # the model, its processor, the prompts
    python bench/vlm.py ours --dir /tmp/bench-vlm --steps 4              # our RL stage (Ray head needed), vLLM
    python bench/vlm.py ours --dir /tmp/bench-vlm --freeze_visual_encoder   # the tower frozen, the LM trained
    python bench/vlm.py setup --dir /tmp/bench-vlm-tiny --shape tiny     # a CPU dry run: transformers engine, fp32

The work: PROMPTS × GROUP = 16 × 8 = 128 completions a step of --cap new tokens (EOS ignored: a random model never
stops), after prompts of one IMAGE_SIZE² image (256 placeholder tokens at 448 px: 14 px patches merged 2 × 2) and
64 letters; one optimizer update a step, no KL, the bench's reward, ZeRO-2, gradient checkpointing. Per step: the
generate / score / train / sync split, images/s (each completion's row carries its prompt's image through the
passes: completions over step time), tokens/s/GPU (prompt, image tokens included, and response over step time) and
the GPU's peak as nvidia-smi sees it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

PROMPTS, GROUP = 16, 8
SHAPE_NAMES = {"qwen2.5-vl-3b": "3b", "tiny": "tiny"}  # in the results' names: vlm_3b_1k_ours, …
TEXT_LETTERS = 64
# Qwen2.5-VL-3B-Instruct's shape (its config.json): 3.75 B parameters, the tower's windowed attention with four
# full-attention blocks, M-RoPE sections 16/24/24 of the head's 64 frequency pairs.
SHAPES = {
    "qwen2.5-vl-3b": dict(
        text=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
        ),
        vision=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=2048,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
        mrope=[16, 24, 24],
        image_size=448,
    ),
    "tiny": dict(
        text=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        vision=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[1]
        ),
        mrope=[4, 2, 2],
        image_size=56,
    ),
}


def build_processor(vocab_size: int, image_size: int):
    """The bench tokenizer (a token per character, fillers up to the vocabulary) with the demo VLM's Qwen markers, and
    Qwen2-VL's PIL image processor at 14 px patches, images kept at their size up to image_size²."""
    from tokenizers import AddedToken
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tasks.common.nn.processors import image_only
    from tasks.data.demo_vlm import CHAT_TEMPLATE, VISION_TOKENS  # the demo VLM's markers and ChatML

    tokenizer = common.build_tokenizer(vocab_size - len(VISION_TOKENS))
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        size={"shortest_edge": 56 * 56, "longest_edge": image_size**2},
    )
    return image_only(Qwen2_5_VLProcessor)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
    )


def build_model(processor, shape: dict):
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = processor.tokenizer
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={
            **shape["text"],
            "max_position_embeddings": 8192,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": shape["mrope"]},
            "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            **shape["vision"],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    model = common.random_model(Qwen2_5_VLForConditionalGeneration, config, torch.cuda.is_available())
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    return model


def setup(bench_dir: Path, shape_name: str) -> None:
    from tasks.data.demo_vlm import COLOURS, png_base64

    shape = SHAPES[shape_name]
    processor = build_processor(shape["text"]["vocab_size"], shape["image_size"])
    model = build_model(processor, shape)
    model.save_pretrained(bench_dir / "model")
    processor.save_pretrained(bench_dir / "model")
    rng = random.Random(0)
    with open(bench_dir / "prompts.jsonl", "w") as f:
        for _ in range(512):
            text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(TEXT_LETTERS))
            f.write(
                json.dumps(
                    {"prompt": "<image>" + text, "images": [png_base64(picture(shape["image_size"], rng, COLOURS))]}
                )
                + "\n"
            )
    params = sum(p.numel() for p in model.parameters())
    info = {
        "shape": shape_name,
        "parameters": params,
        "image_size": shape["image_size"],
        "prompt_tokens": prompt_tokens(processor, bench_dir),
    }
    (bench_dir / "model_info.json").write_text(json.dumps(info) + "\n")
    print(
        f"setup: {shape_name}, {params / 1e6:.1f} M parameters, {info['prompt_tokens']} prompt tokens, in {bench_dir}",
        flush=True,
    )


def picture(size: int, rng: random.Random, colours: dict):
    """A size² RGB image: a few filled boxes of the demo's colours on a dark ground (its content does not matter to
    a random model; its size sets the image's tokens)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), tuple(rng.randrange(0, 60) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        w, h = rng.randrange(size // 8, size // 2), rng.randrange(size // 8, size // 2)
        x, y = rng.randrange(0, size - w), rng.randrange(0, size - h)
        draw.rectangle((x, y, x + w, y + h), fill=rng.choice(list(colours.values())))
    return image


def prompt_tokens(processor, bench_dir: Path) -> int:
    """The first prompt's tokens with its image's placeholders expanded (every prompt has as many)."""
    from tasks.common.nn.vision import encode_vlm_prompt

    row = json.loads((bench_dir / "prompts.jsonl").open().readline())
    return len(encode_vlm_prompt(processor, row["prompt"], row["images"], chat_template=False)["input_ids"])


def ours(
    bench_dir: Path,
    cap: int,
    engine: str,
    steps: int,
    micro: int,
    freeze: bool,
    gpu_memory_utilization: float,
    command: str,
    adam_offload: bool = False,
    lora_rank: int = 0,
) -> None:
    info = json.loads((bench_dir / "model_info.json").read_text())
    shape = f"{SHAPE_NAMES[info['shape']]}_{f'{cap // 1024}k' if cap % 1024 == 0 else cap}"  # 3b_1k, …
    system = (
        ("ours" if engine == "vllm" else "ours_transformers")
        + ("_frozen_tower" if freeze else "")
        + ("_adam_offload" if adam_offload else "")
        + (f"_lora{lora_rank}" if lora_rank else "")
    )
    out = bench_dir / "out" / f"vlm_{shape}_{system}"
    args = common.grpo_args(bench_dir, out, steps, micro)
    args.update(
        n_samples_per_prompt=GROUP,
        rollout_batch_size=PROMPTS,
        train_batch_size=PROMPTS * GROUP,
        prompt_max_len=info["prompt_tokens"],
        generate_max_len=cap,
        rollout_engine=engine,
        enable_prefix_caching=True,  # GRPO's 8 samples of a prompt share its prefill, the image's tokens included
    )
    if engine == "vllm":
        args.update(vllm_num_engines=1, vllm_gpu_memory_utilization=gpu_memory_utilization)
    if freeze:
        args.update(freeze_visual_encoder=True)
    if adam_offload:  # Adam's state and the fp32 master weights in host memory: 3.75 B of them need ~45 GB
        args.update(adam_offload=True)
    if lora_rank:
        # The language model's attention alone: Qwen2.5-VL's tower shares gate/up/down_proj's names, and vLLM's LoRA
        # layers cover the language model only (docs/vision.md).
        args.update(lora_rank=lora_rank, lora_alpha=2 * lora_rank, target_modules="q_proj,k_proj,v_proj,o_proj")
    if not common.on_gpu():
        args.update(flash_attn=False, enable_prefix_caching=False)
    with common.GPUPeak() as peak:
        common.run_stage("tasks.rl", args, bench_dir / f"vlm_{shape}_{system}.log")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tail = records[1:] or records  # the first step pays start-up, CUDA graphs and compilation
    med = common.phase_medians(tail)
    completions = PROMPTS * GROUP
    result = {
        "step_s": med["step_s"],
        **med,
        "images_per_s": round(statistics.median(completions / r["time_step_s"] for r in tail), 2),
        "tokens_per_s_per_gpu": round(
            statistics.median(
                completions * (info["prompt_tokens"] + r["response_length"]) / r["time_step_s"] for r in tail
            )
        ),
        "response_length_mean": round(statistics.mean(r["response_length"] for r in tail), 1),
        "gpu_peak_gb": peak.gb,
        "steps_measured": len(tail),
        "completions_per_step": completions,
        "prompt_tokens": info["prompt_tokens"],
        "image_size": info["image_size"],
        "parameters": info["parameters"],
        "cap": cap,
        "engine": engine,
        "freeze_visual_encoder": freeze,
        "adam_offload": adam_offload,
        "lora_rank": lora_rank,
        "command": command,
    }
    results = bench_dir / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"vlm_{shape}_{system}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({f"vlm_{shape}/{system}": result}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["setup", "ours"])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--shape", default="qwen2.5-vl-3b", choices=sorted(SHAPES))
    parser.add_argument("--cap", type=int, default=1024, help="new tokens a response (EOS ignored)")
    parser.add_argument("--engine", default="vllm", choices=["vllm", "transformers"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro", type=int, default=8, help="rows a training and log-prob micro-batch")
    parser.add_argument("--freeze_visual_encoder", action="store_true", help="the vision tower frozen")
    parser.add_argument("--adam_offload", action="store_true", help="Adam's state in host memory (3B on one 80 GB GPU)")
    parser.add_argument("--lora_rank", type=int, default=0, help="LoRA of this rank on every linear layer (0: full)")
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.35)
    a = parser.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    if a.what == "setup":
        setup(a.dir, a.shape)
    else:
        command = "python bench/vlm.py " + " ".join(sys.argv[1:])
        ours(
            a.dir,
            a.cap,
            a.engine,
            a.steps,
            a.micro,
            a.freeze_visual_encoder,
            a.gpu_memory_utilization,
            command,
            a.adam_offload,
            a.lora_rank,
        )


if __name__ == "__main__":
    main()
