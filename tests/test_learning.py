"""Learning checks: each advantage estimator learns on the demo task, measured against a zero-reward control.

The fixture trains the demo's SFT model (500 steps) and reward model (100 steps) once. Each estimator then
runs 30 RL steps three times with the same learning rate: with the reward model (which prefers the terse
style), with the exact-match reward function, and with a zero reward (the control, which isolates what
small PPO steps and the KL pull do by themselves). Held-out evaluation (500 prompts, T = 1 samples):
  - reward model: preferred-style rate at least 15 points above the control;
  - exact match:  sampled accuracy (the mean exact-match reward of sampled answers) above the control.
gae and group_norm run in `make test`; rloo and reinforce_baseline are marked slow (`make test-all`).
DPO and KTO (the DAG's other branches) are held to the PPO path's bounds against the SFT start: style
+25 points, accuracy within 5 points.
"""
import json

import pytest

from tasks.common import manifest as manifests

from conftest import REPO, SCRATCH
from test_stages import flags, run_cli

ROOT = SCRATCH / "learning"
ESTIMATORS = {
    # estimator: RL flags beyond the shared ones (group estimators sample 4 answers for each of 32 prompts)
    "gae": {"rollout_batch_size": 128, "lambd": 0.8},
    # GRPO as TRL runs it by default: no KL, one update per rollout, so the actor skips its scoring pass.
    "group_norm": {"rollout_batch_size": 32, "n_samples_per_prompt": 4, "train_batch_size": 128, "max_epochs": 1, "init_kl_coef": 0.0},
    "rloo": {"rollout_batch_size": 32, "n_samples_per_prompt": 4},
    "reinforce_baseline": {"rollout_batch_size": 32, "n_samples_per_prompt": 4},
}
REWARDS = {
    "rm": {},
    "exact": {"remote_rm_url": str(REPO / "tasks" / "data" / "demo_reward.py"), "label_key": "label"},
    "control": {"remote_rm_url": str(REPO / "tests" / "rewards" / "zero_reward.py")},
}


def cli(ray_address, module, **values):
    done = run_cli(module, *flags(values), ray=ray_address)
    assert done.returncode == 0, f"{module} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def trained(ray_address):
    """prepare_data -> SFT (500 steps) -> reward model (100 steps), as local stage outputs."""
    import shutil

    from tasks.common import stage
    from tasks.common.config import make_config
    from tasks.data.__main__ import prepare
    from tasks.data.config import PrepareDataConfig

    shutil.rmtree(ROOT, ignore_errors=True)
    out = {name: str(ROOT / name) for name in ("data", "sft", "rm")}
    stage.run("prepare_data", make_config(PrepareDataConfig, {"output": out["data"]}), prepare)
    cli(ray_address, "tasks.sft", output=out["sft"], pretrain=out["data"], dataset=out["data"], max_steps=500)
    cli(ray_address, "tasks.reward_model", output=out["rm"], pretrain=out["sft"], dataset=out["data"], max_steps=100)
    return out


def policy_metrics(ray_address, trained, estimator: str, reward: str) -> dict:
    name = f"{estimator}-{reward}"
    rl, ev = str(ROOT / f"rl-{name}"), str(ROOT / f"eval-{name}")
    cli(ray_address, "tasks.rl", output=rl, pretrain=trained["sft"], reward_pretrain=trained["rm"], prompt_data=trained["data"],
        **{"advantage_estimator": estimator, "max_steps": 30, "train_batch_size": 64, "colocate_all_models": True,
           **ESTIMATORS[estimator], **REWARDS[reward]})
    cli(ray_address, "tasks.eval", output=ev, baseline=trained["sft"], policy=rl, reward_pretrain=trained["rm"], dataset=trained["data"])
    path, _ = manifests.fetch(ev, ROOT / f"fetched-{name}")
    return json.loads((path / "report.json").read_text())["metrics"]["policy"]


@pytest.mark.parametrize("estimator", [
    "gae", "group_norm",
    pytest.param("rloo", marks=pytest.mark.slow), pytest.param("reinforce_baseline", marks=pytest.mark.slow),
])
def test_estimator_learns_from_a_reward_model_and_from_a_reward_function(estimator, trained, ray_address):
    control = policy_metrics(ray_address, trained, estimator, "control")
    with_rm = policy_metrics(ray_address, trained, estimator, "rm")
    exact = policy_metrics(ray_address, trained, estimator, "exact")
    print(f"{estimator}: style {control['preferred_style_rate']:.3f} -> {with_rm['preferred_style_rate']:.3f} (rm); "
          f"sampled accuracy {control['sampled_accuracy']:.3f} -> {exact['sampled_accuracy']:.3f} (exact match)")
    assert with_rm["preferred_style_rate"] >= control["preferred_style_rate"] + 0.15
    assert exact["sampled_accuracy"] > control["sampled_accuracy"]


# The DAG's dpo and kto tasks, as flags (dags/rlhf_pipeline.py holds the same values).
PREFERENCE = {
    "dpo": {"method": "dpo", "dataset_split": "style_pairs", "nll_loss_coef": 0.5, "beta": 0.5},
    "kto": {"method": "kto", "dataset_split": "unpaired", "undesirable_weight": 0.3, "beta": 0.1},
}


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_preference_method_raises_the_style_rate_and_keeps_accuracy(method, trained, ray_address):
    """DPO and KTO, like the PPO path: preferred style +25 points over the SFT start, accuracy within 5 points."""
    out, ev = str(ROOT / method), str(ROOT / f"eval-{method}")
    cli(ray_address, "tasks.preference", output=out, pretrain=trained["sft"], dataset=trained["data"], max_steps=100,
        learning_rate=2e-5, **PREFERENCE[method])
    cli(ray_address, "tasks.eval", output=ev, baseline=trained["sft"], policy=out, dataset=trained["data"])
    path, _ = manifests.fetch(ev, ROOT / f"fetched-{method}")
    metrics = json.loads((path / "report.json").read_text())["metrics"]
    sft, policy = metrics["baseline"], metrics["policy"]
    print(f"{method}: style {sft['preferred_style_rate']:.3f} -> {policy['preferred_style_rate']:.3f}; "
          f"accuracy {sft['accuracy']:.3f} -> {policy['accuracy']:.3f}")
    assert policy["preferred_style_rate"] >= sft["preferred_style_rate"] + 0.25
    assert policy["accuracy"] >= sft["accuracy"] - 0.05
