"""What the VLM tests share on the demo VLM (tasks/data/demo_vlm.py, either family): the model saved, a few plain SFT
steps on its rows, its greedy accuracy on held-out rows (one token: the colour's letter, image tokens never sampled),
and which of a model's parameters are its vision tower's.

    from tests.vlm_demo import greedy_accuracy, in_tower, saved_demo, sft_steps
    folder = saved_demo(tmp_path_factory, "llava")                      # a module fixture's: demo_vlm.FAMILIES
    sft_steps(model, processor, ids, masks, images, steps=80, seed=0)   # supervised.tokenize_vlm_rows' output
    accuracy = greedy_accuracy(model, processor, rows["eval"])
"""

import json

import torch

from tasks.common.nn import supervised, vision
from tasks.data import demo_vlm


def saved_demo(tmp_path_factory, family: str, seed: int = 0) -> str:
    """The demo VLM of `family` and its processor in a fresh folder."""
    path = tmp_path_factory.mktemp(f"demo-vlm-{family}")
    demo_vlm.save_demo_vlm(path, seed=seed, family=family)
    return str(path)


def in_tower(name: str) -> bool:
    """Whether a parameter's name is inside a vision tower or its projector (vision.VISION_MODULES: Qwen2-VL's
    `visual`, LLaVA's `vision_tower` and `multi_modal_projector`), LoRA and DeepSpeed wrappers included."""
    return any(part in vision.VISION_MODULES for part in name.split("."))


def tower_parameters(model, read: bool = False) -> list:
    """The parameters of the model's vision tower and projector; with `read`, only those its forward reads (not
    CLIP's post_layernorm, which normalises the pooled CLS token alone: LLaVA takes the patches' features)."""
    return [p for n, p in model.named_parameters() if in_tower(n) and not (read and ".post_layernorm." in n)]


def sft_steps(model, processor, ids, masks, images, steps: int, seed: int, lr: float = 1e-3, batch: int = 16) -> None:
    """`steps` AdamW steps on random batches of the tokenised rows (3e-3 left one colour unlearned on some seeds)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    pad, draw = processor.tokenizer.pad_token_id, torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = torch.randint(0, len(ids), (batch,), generator=draw).tolist()
        pick = [[x[i] for i in rows] for x in (ids, masks, images)]
        loss = supervised.vlm_micro_batch_loss(model, processor, *pick, pad, False, "cpu")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def greedy_accuracy(model, processor, held: list[dict]) -> float:
    """The share of held-out rows whose greedy first token is the row's label."""
    model.eval()
    pad = processor.tokenizer.pad_token_id
    prompts = [vision.encode_vlm_prompt(processor, r["prompt"], r["images"])["input_ids"] for r in held]
    inputs = vision.vlm_inputs(processor, prompts, [r["images"] for r in held], pad, "cpu")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=1, do_sample=False, suppress_tokens=vision.image_token_ids(processor)
        )
    return sum(processor.tokenizer.decode(o[-1:]) == r["label"] for o, r in zip(out, held)) / len(held)


# ---------------------------------------------------------------- RL on the demo VLM (tests/unit/tasks/rl/)


def encoded(processor, rows, prompts=None) -> list[list[int]]:
    """Each row's prompt (or `prompts`) encoded with the row's images, placeholders expanded."""
    prompts = prompts or [r["prompt"] for r in rows]
    return [vision.encode_vlm_prompt(processor, p, r["images"])["input_ids"] for p, r in zip(prompts, rows)]


def rl_flags(folder, data, **extra) -> dict:
    """The RL stage's flags on the VLM at `folder` with prompts `data` and a reward file (never called here)."""
    return {
        "output": "/tmp/unused",
        "pretrain": folder,
        "prompt_data": data,
        "remote_rm_url": "reward.py",
        "label_key": "label",
        "apply_chat_template": True,
        **extra,
    }


def rl_config(folder, data, **extra):
    """GRPO on 4 prompts × 2 samples, one epoch, 3 new tokens: what the RL workers' tests train."""
    from tasks.common.config import make_config
    from tasks.rl.config import RLConfig

    flags = rl_flags(folder, data, advantage_estimator="group_norm", n_samples_per_prompt=2, rollout_batch_size=4)
    flags |= {"train_batch_size": 8, "max_epochs": 1, "generate_max_len": 3, "lr_warmup_steps": 0}
    return make_config(RLConfig, {**flags, "actor_learning_rate": 1e-2, "init_kl_coef": 0.0, **extra})


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


class StageInputs:
    """What load_vision_prompts reads of a StageRun: its inputs, recorded as they are."""

    def input(self, name, uri):
        return uri
