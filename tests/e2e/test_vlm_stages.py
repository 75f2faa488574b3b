"""RL and eval on the vision-language demo (issue 54), as stages on the session's Ray head, in this process.

The start is the demo VLM (tasks/data/demo_vlm.py: name the colour of a shape; the text is the same for every row,
so only the pixels tell) after a short SFT, done here in seconds with the SFT stage's own loss
(supervised.vlm_micro_batch_loss): it answers with a colour's letter, greedy mostly right, sampled (T = 1) often
wrong. Then:
  - the stages' smoke test: GRPO with the exact-match reward (tasks/data/demo_vlm_reward.py) for two steps with
    --freeze_visual_encoder, then eval of its output against the start on held-out prompts; two PPO steps scored
    by a VLM reward model with the VLM critic (GAE) started from it, and eval's reward_mean from the same model;
    three --async_train steps on a rollout engine of its own;
  - the learning check (slow): on two seeds, GRPO with the exact-match reward and the control with a zero reward,
    the same steps and flags; held-out sampled accuracy (eval's sampled_exact_match, 4 samples of each of 200
    prompts) of the rewarded policy is at least 10 points above the control's. Measured at the commit that wrote
    this: seed 0, 0.599 against 0.240; seed 1, 0.895 against 0.522.
"""

import json

import datasets
import pytest
import torch

from tasks.common import manifest as manifests
from tasks.common import stage
from tasks.common.config import make_config
from tasks.common.nn import supervised, vision
from tasks.data import demo_vlm
from tasks.eval.config import EvalConfig
from tasks.rl.config import RLConfig

from tests.conftest import REPO
from tests.in_process import stages_in_this_process, write_jsonl
from tests.vlm_demo import sft_steps

EXACT = str(REPO / "tasks" / "data" / "demo_vlm_reward.py")
ZERO = str(REPO / "tests" / "rewards" / "zero_reward.py")
SFT_STEPS = 80  # from random weights: the answer's format and most colours (greedy), sampled answers still mixed


@pytest.fixture(scope="module")
def env(ray_address, s3_server, tmp_path_factory):
    """RAY_ADDRESS for stages run in this process, and a folder for their outputs."""
    root = tmp_path_factory.mktemp("vlm-stages")
    with stages_in_this_process(ray_address, root):
        yield root


def start(root, seed: int) -> dict:
    """The demo VLM after SFT_STEPS steps of SFT (batch 16, AdamW 1e-3) on its SFT split, saved with its processor;
    and the RL prompts and held-out eval prompts as JSONL."""
    folder = root / f"seed{seed}"
    if (folder / "sft" / "config.json").is_file():
        return {
            "sft": str(folder / "sft"),
            "prompts": str(folder / "prompts.jsonl"),
            "eval": str(folder / "eval.jsonl"),
        }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # this tiny model runs several times faster on one thread beside other work
    try:
        processor = demo_vlm.build_vlm_processor()
        model = demo_vlm.build_vlm_model(processor, seed=seed)
        rows = demo_vlm.make_datasets(seed=seed, sizes={"sft": 400, "prompts": 400, "eval": 200})
        table = datasets.Dataset.from_list(rows["sft"])
        ids, masks, images, _ = supervised.tokenize_vlm_rows(table, processor, "prompt", "response", "images", True, 64)
        sft_steps(model, processor, ids, masks, images, SFT_STEPS, seed)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(folder / "sft")
    processor.save_pretrained(folder / "sft")
    return {
        "sft": str(folder / "sft"),
        "prompts": write_jsonl(folder / "prompts.jsonl", rows["prompts"]),
        "eval": write_jsonl(folder / "eval.jsonl", rows["eval"]),
    }


def rl(root, begin: dict, name: str, reward: str, seed: int, **extra) -> str:
    from tasks.rl.trainer import train

    out = str(root / name)
    values = {
        "output": out,
        "pretrain": begin["sft"],
        "prompt_data": begin["prompts"],
        "remote_rm_url": reward,
        "label_key": "label",
        "apply_chat_template": True,
        "advantage_estimator": "group_norm",  # GRPO, as TRL runs it: no KL, one update a rollout
        "n_samples_per_prompt": 4,
        "rollout_batch_size": 16,
        "train_batch_size": 64,
        "max_epochs": 1,
        "init_kl_coef": 0.0,
        "generate_max_len": 2,  # the letter and <|im_end|>
        "actor_learning_rate": 1e-3,
        "lr_warmup_steps": 0,
        "seed": seed,
        **extra,
    }
    stage.run("rl", make_config(RLConfig, values), train)
    return out


def evaluate(root, begin: dict, policy: str, name: str, **extra) -> dict:
    from tasks.eval.evaluate import evaluate as run_eval

    out = str(root / name)
    values = {
        "output": out,
        "baseline": begin["sft"],
        "policy": policy,
        "dataset": begin["eval"],
        "apply_chat_template": True,
        "generate_max_len": 2,
        "n_samples_per_prompt": 4,
        "bootstrap_resamples": 200,
        **extra,
    }
    stage.run("eval", make_config(EvalConfig, values), run_eval)
    return manifests.read_manifest(out)


# Under make test-all: the DAG's run of the demo VLM (tests/unit/plugins/test_pipeline.py, vlm) runs RL and eval on the
# images with the tower frozen in make test; this one adds the verifiable reward (which the async test below keeps in
# make test) and 2 GRPO steps.
@pytest.mark.slow
def test_rl_and_eval_run_on_a_vlm_with_its_images_and_a_frozen_tower(env):
    """Two GRPO steps through the RL stage on Ray with --freeze_visual_encoder: the rollouts carry the images from the
    prompts to the update, the saved policy is a VLM with its processor whose vision tower is the start's; eval then
    scores it and the start on held-out prompts with their images."""
    begin = start(env, seed=0)
    out = rl(env, begin, "smoke-rl", EXACT, seed=0, max_steps=2, freeze_visual_encoder=True)
    m = manifests.read_manifest(out)
    assert m["metrics"]["steps"] == 2 and m["metrics"]["ref_workers"] == 0 and m["metrics"]["prompts_dropped"] == 0
    path = stage_model(out)
    assert vision.load_processor(path).image_processor.patch_size == demo_vlm.PATCH_SIZE
    trained, base = vision.load_vision_lm(path), vision.load_vision_lm(begin["sft"])
    before = dict(base.named_parameters())
    moved = {n for n, p in trained.named_parameters() if not torch.equal(p, before[n])}
    assert moved and not any(".visual." in f".{n}" for n in moved)
    report = evaluate(env, begin, out, "smoke-eval", max_samples=16)
    metrics = report["metrics"]
    assert 0 <= metrics["policy_exact_match"] <= 1 and 0 <= metrics["policy_sampled_exact_match"] <= 1
    assert metrics["baseline_kl_to_ref"] == 0.0 and "policy_kl_to_ref" in metrics
    samples = json.loads((manifest_dir(report) / "report.json").read_text())["samples"]
    assert samples and all(len(s["images"]) == 1 for s in samples)


def stage_model(uri: str) -> str:
    from tasks.common.nn.models import resolve_model

    return resolve_model(uri)


def manifest_dir(manifest: dict):
    from pathlib import Path

    return Path(manifest["uri"].removesuffix("manifest.json"))


@pytest.mark.slow  # 2 min 20 s (seed 0) and 5 min 44 s (seed 1, beside other work) on 2 cores, the head's start in
@pytest.mark.parametrize("seed", [0, 1])
def test_rl_with_a_verifiable_reward_reads_the_colour_better_than_a_zero_reward_control(env, seed):
    """The learning check of the VLM path (issue 54, item 7): the same GRPO steps from the same start, rewarded for
    the right colour or not at all; the rewarded policy's held-out sampled accuracy beats the control's by 10
    points or more (the control's zero advantages leave it at the start)."""
    begin = start(env, seed)
    steps = {"max_steps": 40}
    rewarded = evaluate(env, begin, rl(env, begin, f"exact-{seed}", EXACT, seed, **steps), f"eval-exact-{seed}")
    control = evaluate(env, begin, rl(env, begin, f"zero-{seed}", ZERO, seed, **steps), f"eval-zero-{seed}")
    gain = rewarded["metrics"]["policy_sampled_exact_match"] - control["metrics"]["policy_sampled_exact_match"]
    print(
        f"vlm learning check, seed {seed}: sampled accuracy {rewarded['metrics']['policy_sampled_exact_match']:.3f} "
        f"against the control's {control['metrics']['policy_sampled_exact_match']:.3f} (start "
        f"{control['metrics']['baseline_sampled_exact_match']:.3f}); greedy {rewarded['metrics']['policy_exact_match']:.3f} "
        f"against {control['metrics']['policy_exact_match']:.3f}",
        flush=True,
    )
    assert gain >= 0.10, (rewarded["metrics"], control["metrics"])


def reward_model(root, begin: dict) -> str:
    """A VLM reward model as the reward_model stage saves one (backbone, value head, processor, statistics), made from
    the SFT start without training: the RL and eval stages' use of it is under test, not its skill."""
    from tests.unit.tasks.common.nn.test_vision_reward import save_vision_reward_model

    folder = root / "seed0" / "rm"
    return (
        str(folder) if (folder / "config.json").is_file() else save_vision_reward_model(begin["sft"], folder, 0.1, 2.0)
    )


# Under make test-all: the DAG's run of the demo VLM (tests/unit/plugins/test_pipeline.py, vlm) runs the same in make
# test (the form's PPO, scored by the run's VLM reward model, its critic started from it, eval's reward_mean).
@pytest.mark.slow
def test_ppo_with_a_critic_and_a_vlm_reward_model_runs_on_a_vlm(env):
    """GAE through the RL stage on Ray with a VLM reward model (--reward_pretrain): a reward group scores each rollout
    row with its images, and the critic group (started from the reward model, as a text critic is) values them beside
    the actor; then eval's reward_mean scores both sides' samples with their images."""
    begin = start(env, seed=0)
    rm = reward_model(env, begin)
    out = rl(
        env,
        begin,
        "gae-rl",
        "",
        seed=0,
        max_steps=2,
        advantage_estimator="gae",
        n_samples_per_prompt=1,
        train_batch_size=16,
        reward_pretrain=rm,
        colocate_all_models=True,  # actor, critic and reward models on the head's 2 CPUs, as the run form does
    )
    m = manifests.read_manifest(out)
    assert m["inputs"]["reward_pretrain"] == rm and "remote_rm_url" not in m["inputs"]
    logged = [json.loads(line) for line in (manifest_dir(m) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "value_loss" in r] == [1, 2]
    assert all(r["reward"] != 0 for r in logged if "value_loss" in r)  # the reward model's standardised scores
    metrics = evaluate(env, begin, out, "gae-eval", max_samples=8, reward_pretrain=rm)["metrics"]
    assert {"baseline_reward_mean", "policy_reward_mean"} <= set(metrics), sorted(metrics)


def test_async_rl_on_a_vlm_generates_on_an_engine_of_its_own(env):
    """--async_train through the RL stage on Ray: a transformers engine of its own generates the next rollout from
    the prompts' images while the actor trains, fed the actor's weights after each update."""
    begin = start(env, seed=0)
    out = rl(env, begin, "async-rl", EXACT, seed=0, max_steps=3, async_train=True)
    logged = [
        json.loads(line)
        for line in (manifest_dir(manifests.read_manifest(out)) / "metrics.jsonl").read_text().splitlines()
    ]
    stale = [r["staleness"] for r in logged if "staleness" in r]
    assert len(stale) == 3 and max(stale) <= 1
