"""Learning checks: each advantage estimator learns on the demo task, measured against a zero-reward control.

They start from the demo's SFT and reward models on two seeds: seed 0's are the demo run's (the session's one
`make demo` run on the live stack, tests/conftest.py's demo_run), seed 1's are tests/e2e/test_demo_claim.py's (made
there, or here when that module did not run), so nothing is trained twice. Each estimator then runs RL three
times on each seed with the same flags: with the reward model (which prefers the terse style), with the
exact-match reward function, and with a zero reward (the control, which isolates what the steps and the KL pull
do by themselves). PPO-ptx, the demo's default, is off in every arm: its loss is the likelihood of the labelled
answers, the exact-match signal itself, so with it the control alone lifts seed 0's sampled accuracy from 0.64
to 0.84 and the group estimators' exact-match arms add nothing measurable (measured 2026-12-02). Held-out
evaluation (500 prompts, T = 1 samples), on each seed:
  - reward model: preferred-style rate at least 15 points above the control;
  - exact match:  sampled accuracy (the mean exact-match reward of sampled answers) above the control.
These run under `make test-all` (1 to 4 minutes an arm), as do DPO and KTO (the DAG's other
branches), held to the PPO path's bounds against the SFT start: style +25 points, accuracy within 5 points.
`make test` keeps the demo run's own check (tests/e2e/test_e2e.py) and the exports' check below.
"""

import json

import pytest

from tasks.common import manifest as manifests

from tests.conftest import REPO, SCRATCH
from tests.e2e.test_demo_claim import DEMO_METRICS, dag_default_flags, demo_models
from tests.e2e.test_stages import flags, run_cli

pytestmark = pytest.mark.e2e
ROOT = SCRATCH / "learning"
ESTIMATORS = {
    # estimator: RL flags beyond the shared ones (group estimators sample 4 answers for each of 32 prompts)
    "gae": {},  # the demo's RL stage as the DAG runs it (dag_default_flags), PPO-ptx off
    # GRPO as TRL runs it by default: no KL, one update per rollout, so the actor skips its scoring pass.
    "group_norm": {
        "rollout_batch_size": 32,
        "n_samples_per_prompt": 4,
        "train_batch_size": 128,
        "max_epochs": 1,
        "init_kl_coef": 0.0,
    },
    "rloo": {"rollout_batch_size": 32, "n_samples_per_prompt": 4},
    "reinforce_baseline": {"rollout_batch_size": 32, "n_samples_per_prompt": 4},
}
REWARDS = {
    "rm": {},
    "exact": {"remote_rm_url": str(REPO / "tasks" / "data" / "demo_reward.py"), "label_key": "label"},
    "control": {"remote_rm_url": str(REPO / "tests" / "rewards" / "zero_reward.py")},
}


def cli(live, module, **values):
    done = run_cli(module, *flags(values), env=live.stage_env())
    assert done.returncode == 0, f"{module} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def trained(demo_run):
    """The demo run's prepare_data, SFT and reward-model outputs (S3 URIs on the live stack)."""
    import shutil

    shutil.rmtree(ROOT, ignore_errors=True)
    return {
        "data": demo_run.xcom("prepare_data"),
        "sft": demo_run.xcom("sft"),
        "rm": demo_run.xcom("reward_model"),
        "live": demo_run.live,
    }


def models(trained, ray_address, seed: int) -> dict:
    """The demo's data, SFT and reward model for `seed`: the demo run's on the live stack (seed 0), or local folders."""
    if seed == 0:
        return {"data": trained["data"], "sft": trained["sft"], "rm": trained["rm"]}
    return demo_models(ray_address, seed)


def policy_metrics(trained, ray_address, estimator: str, reward: str, seed: int) -> dict:
    start = models(trained, ray_address, seed)
    name = f"{estimator}-{reward}-seed{seed}"
    rl, ev = str(ROOT / f"rl-{name}"), str(ROOT / f"eval-{name}")
    rl_flags = {
        **dag_default_flags("tasks.rl", seed),
        "ptx_coef": 0.0,
        "advantage_estimator": estimator,
        **ESTIMATORS[estimator],
        **REWARDS[reward],
    }
    cli(
        trained["live"],
        "tasks.rl",
        output=rl,
        pretrain=start["sft"],
        reward_pretrain=start["rm"],
        prompt_data=start["data"],
        **rl_flags,
    )
    cli(
        trained["live"],
        "tasks.eval",
        output=ev,
        baseline=start["sft"],
        policy=rl,
        reward_pretrain=start["rm"],
        dataset=start["data"],
        **dag_default_flags("tasks.eval", seed),
    )
    path, _ = manifests.fetch(ev, ROOT / f"fetched-{name}")
    return json.loads((path / "report.json").read_text())["metrics"]["policy"]


@pytest.mark.slow  # 3 to 12 minutes each; make test keeps the demo run's own check (tests/e2e/test_e2e.py)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("estimator", ["gae", "group_norm", "rloo", "reinforce_baseline"])
def test_estimator_learns_from_a_reward_model_and_from_a_reward_function(estimator, seed, trained, ray_address):
    control, with_rm, exact = (
        policy_metrics(trained, ray_address, estimator, reward, seed) for reward in ("control", "rm", "exact")
    )
    print(
        f"{estimator}, seed {seed}: style {control['sampled_preferred_style_rate']:.3f} -> {with_rm['sampled_preferred_style_rate']:.3f} (rm); "
        f"sampled accuracy {control['sampled_accuracy']:.3f} -> {exact['sampled_accuracy']:.3f} (exact match)"
    )
    assert with_rm["sampled_preferred_style_rate"] >= control["sampled_preferred_style_rate"] + 0.15
    assert exact["sampled_accuracy"] > control["sampled_accuracy"]


#: RL pushed until it games the demo's reward model: no KL, no PPO-ptx, a learning rate 10 times the demo's.
GAMED = {"init_kl_coef": 0.0, "ptx_coef": 0.0, "actor_learning_rate": 3e-4}


@pytest.mark.slow
def test_rl_that_games_its_reward_model_sets_off_the_alarm_and_the_gate_refuses(ray_address, tmp_path):
    """Reward hacking, made on purpose. The demo's reward model cannot see correctness: half its pairs carry the
    same wrong answer on both sides, so it scores the terse style alone. RL pushed hard against it (GAMED)
    reaches a high score with wrong sums. The eval report must then show the reward up and accuracy down, both
    beyond noise, with its alarm, and the default gate (the nightly DAG's) must refuse the candidate."""
    start = demo_models(ray_address, 1)  # test_demo_claim's seed 1 models, or made now
    rl, ev, promote = (str(tmp_path / name) for name in ("rl", "eval", "promote"))
    rl_flags = {
        "output": rl,
        "pretrain": start["sft"],
        "reward_pretrain": start["rm"],
        "prompt_data": start["data"],
        **dag_default_flags("tasks.rl", 1),
        **GAMED,
    }
    eval_flags = {
        "output": ev,
        "baseline": start["sft"],
        "policy": rl,
        "reward_pretrain": start["rm"],
        "dataset": start["data"],
        **dag_default_flags("tasks.eval", 1),
    }
    for module, values in (("tasks.rl", rl_flags), ("tasks.eval", eval_flags)):
        done = run_cli(module, *flags(values), ray=ray_address)
        assert done.returncode == 0, f"{module} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    path, _ = manifests.fetch(ev, tmp_path / "fetched")
    report = json.loads((path / "report.json").read_text())
    delta = report["comparisons"]["baseline"]
    print(f"gamed: reward {delta['reward_mean']}, accuracy {delta['accuracy']}; alarms {report['alarms']}")
    assert delta["reward_mean"]["interval"][0] > 0 and delta["accuracy"]["interval"][1] < 0
    assert any("reward hacking suspected" in alarm and "accuracy fell" in alarm for alarm in report["alarms"])

    done = run_cli(
        "tasks.promote",
        *flags({"output": promote, "evaluation": ev, "registry": str(tmp_path / "registry"), "run_id": "gamed"}),
        ray=ray_address,
    )
    assert done.returncode == 0, f"tasks.promote failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert "decision: rejected: the gate failed" in done.stdout
    assert "FAIL: against the baseline: reward hacking suspected" in done.stdout


# The DAG's dpo and kto tasks, as flags (dags/rlhf_pipeline.py holds the same values).
PREFERENCE = {
    "dpo": {"method": "dpo", "dataset_split": "style_pairs", "nll_loss_coef": 0.5, "beta": 0.5},
    "kto": {"method": "kto", "dataset_split": "unpaired", "undesirable_weight": 0.3, "beta": 0.1},
}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_preference_method_raises_the_style_rate_and_keeps_accuracy(method, trained):
    """DPO and KTO, like the PPO path: preferred style +25 points over the SFT start, accuracy within 5 points."""
    out, ev = str(ROOT / method), str(ROOT / f"eval-{method}")
    cli(
        trained["live"],
        "tasks.preference",
        output=out,
        pretrain=trained["sft"],
        dataset=trained["data"],
        max_steps=100,
        learning_rate=2e-5,
        **PREFERENCE[method],
    )
    cli(
        trained["live"],
        "tasks.eval",
        output=ev,
        baseline=trained["sft"],
        policy=out,
        dataset=trained["data"],
        metric_func=DEMO_METRICS,
    )
    path, _ = manifests.fetch(ev, ROOT / f"fetched-{method}")
    metrics = json.loads((path / "report.json").read_text())["metrics"]
    sft, policy = metrics["baseline"], metrics["policy"]
    print(
        f"{method}: style {sft['sampled_preferred_style_rate']:.3f} -> {policy['sampled_preferred_style_rate']:.3f}; "
        f"accuracy {sft['accuracy']:.3f} -> {policy['accuracy']:.3f}"
    )
    assert policy["sampled_preferred_style_rate"] >= sft["sampled_preferred_style_rate"] + 0.25
    assert policy["accuracy"] >= sft["accuracy"] - 0.05


def test_exports_load_with_the_auto_classes_and_give_the_trained_answers(trained):
    """The SFT model and reward model as anyone loads them (AutoTokenizer + Auto classes, no rlhf-flow code):
    the tokenizer encodes text exactly as training did (BOS included), greedy generate answers the held-out
    sums about as often as the eval stage measured, and the reward model prefers the terse answer, as trained."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from tasks.common.nn import data
    from tasks.data.demo import extract_answer

    sft, rm = (download(trained["live"], trained[name], "model/", ROOT / f"export-{name}") for name in ("sft", "rm"))
    tokenizer = AutoTokenizer.from_pretrained(sft / "model")
    eval_rows = (
        download(trained["live"], trained["data"], "data/eval.jsonl", ROOT / "export-data") / "data" / "eval.jsonl"
    )
    rows = [json.loads(line) for line in eval_rows.read_text().splitlines()[:64]]
    for row in rows[:8]:
        assert tokenizer(row["prompt"])["input_ids"] == data.encode_prompt(tokenizer, row["prompt"])
    model = AutoModelForCausalLM.from_pretrained(sft / "model").eval()
    tokenizer.padding_side = "left"
    inputs = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answers = tokenizer.batch_decode(out[:, inputs["input_ids"].size(1) :], skip_special_tokens=True)
    accuracy = sum(extract_answer(a) == r["label"] for a, r in zip(answers, rows)) / len(rows)
    assert accuracy >= 0.5, (accuracy, answers[:8])  # the eval stage measures about 0.8 on this model

    scorer = AutoModelForSequenceClassification.from_pretrained(rm / "model", num_labels=1).eval()
    rm_tokenizer = AutoTokenizer.from_pretrained(rm / "model")
    terse, wordy = rows[0]["prompt"] + rows[0]["label"], rows[0]["prompt"] + rows[0]["label"] + " is the sum"
    with torch.no_grad():
        scores = [
            scorer(**rm_tokenizer(text + rm_tokenizer.eos_token, return_tensors="pt")).logits.item()
            for text in (terse, wordy)
        ]
    assert scores[0] > scores[1]  # it prefers the terse style, as trained


def download(live, manifest_uri: str, prefix: str, dest):
    """The objects under `prefix` of a stage output on the live stack's S3, as plain files under dest: what a
    user downloads, with no rlhf-flow code."""
    bucket, key = manifest_uri.removeprefix("s3://").split("/", 1)
    root = key.rsplit("/", 1)[0] + "/"
    s3 = live.s3()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=root + prefix):
        for obj in page.get("Contents", []):
            target = dest / obj["Key"][len(root) :]
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(target))
    return dest
