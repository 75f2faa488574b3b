"""Every stage's CLI on the tiny demo model, chained through the S3 emulator.

Step counts are tiny: these tests check the contract (inputs through manifests, outputs committed
with manifest.json, HF-format checkpoints, metrics, reports), not learning; the end-to-end test
checks learning on the demo's real settings.
"""
import json
import os
import subprocess
import sys

import pytest

from tasks.common import manifest as manifests
from tasks.common import stage
from tasks.common.config import make_config
from tasks.common.models import resolve_model
from tasks.data.__main__ import prepare
from tasks.data.config import PrepareDataConfig
from tasks.sft.config import SFTConfig

from conftest import REPO, SCRATCH


def run_cli(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, timeout=600, cwd=REPO)


def flags(values: dict) -> list[str]:
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


@pytest.fixture(scope="module")
def chain(s3_server):
    """prepare_data (in this process) -> sft -> reward_model -> rl -> eval (each its CLI), outputs on S3."""
    os.environ["RLHF_CACHE_DIR"] = str(SCRATCH / "cache-stages")
    root = s3_server.uri("stages/run1")
    out = {name: f"{root}/{name}" for name in ("prepare_data", "sft", "reward_model", "rl", "eval")}
    stage.run("prepare_data", make_config(PrepareDataConfig, {"output": out["prepare_data"]}), prepare)
    commands = {
        "tasks.sft": {"output": out["sft"], "pretrain": out["prepare_data"], "dataset": out["prepare_data"],
                      "max_steps": 6, "train_batch_size": 32, "logging_steps": 2, "use_wandb": True},
        "tasks.reward_model": {"output": out["reward_model"], "pretrain": out["sft"], "dataset": out["prepare_data"],
                               "max_steps": 4, "train_batch_size": 32, "logging_steps": 2},
        "tasks.rl": {"output": out["rl"], "pretrain": out["sft"], "reward_pretrain": out["reward_model"],
                     "prompt_data": out["prepare_data"], "max_steps": 2, "rollout_batch_size": 16, "train_batch_size": 8},
        "tasks.eval": {"output": out["eval"], "baseline": out["sft"], "policy": out["rl"], "reward_pretrain": out["reward_model"],
                       "dataset": out["prepare_data"], "max_samples": 24},
    }
    for module, values in commands.items():
        done = run_cli(module, *flags(values))
        assert done.returncode == 0, f"{module} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return out


def test_every_stage_commits_a_manifest_with_its_lineage(chain):
    for name, uri in chain.items():
        m = manifests.read_manifest(uri)
        assert m["stage"] == name and m["files"] and m["config_hash"]
        assert "metrics.jsonl" in m["files"]
    assert manifests.read_manifest(chain["sft"])["inputs"] == {"pretrain": chain["prepare_data"], "dataset": chain["prepare_data"]}
    assert manifests.read_manifest(chain["rl"])["inputs"]["reward_pretrain"] == chain["reward_model"]


def test_checkpoints_load_through_the_auto_classes(chain):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    policy = AutoModelForCausalLM.from_pretrained(resolve_model(chain["rl"]))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(chain["rl"]))
    assert policy.config.vocab_size == len(tokenizer)
    rm = AutoModelForSequenceClassification.from_pretrained(resolve_model(chain["reward_model"]))
    assert rm.config.num_labels == 1
    assert isinstance(rm.config.reward_mean, float) and rm.config.reward_std > 0


def test_metrics_are_logged_per_step(chain, tmp_path):
    path, _ = manifests.fetch(chain["sft"], tmp_path)
    steps = [json.loads(line)["step"] for line in (path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6]
    rl_path, _ = manifests.fetch(chain["rl"], tmp_path / "rl")
    rl_metrics = [json.loads(line) for line in (rl_path / "metrics.jsonl").read_text().splitlines()]
    assert {"reward", "kl", "policy_loss", "value_loss", "clip_fraction", "entropy", "time_generate_s"} <= set(rl_metrics[0])
    wandb_runs = list((SCRATCH / "wandb" / "wandb").glob("offline-run-*"))
    assert wandb_runs, "use_wandb wrote no offline wandb run"


def test_eval_writes_report_and_table(chain, tmp_path):
    path, m = manifests.fetch(chain["eval"], tmp_path)
    report = json.loads((path / "report.json").read_text())
    for side in ("baseline", "policy"):
        assert set(report["metrics"][side]) >= {"accuracy", "preferred_style_rate", "reward_mean", "kl_to_ref"}
    assert report["metrics"]["baseline"]["kl_to_ref"] == 0
    assert report["num_prompts"] == 24 and len(report["samples"]) == 8
    assert "| preferred_style_rate |" in (path / "report.md").read_text()
    assert m["metrics"]["policy_accuracy"] == report["metrics"]["policy"]["accuracy"]


def test_cli_refuses_a_missing_dataset_key_before_training(chain, tmp_path):
    done = run_cli("tasks.sft", "--output", str(tmp_path / "out"), "--pretrain", chain["sft"],
                   "--dataset", chain["prepare_data"], "--output_key", "answer")
    assert done.returncode == 2
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("error: dataset: key 'answer' missing") and "keys present: prompt, response, style" in error
    assert not (tmp_path / "out").exists()


def test_cli_refuses_bad_config_in_one_line(tmp_path):
    (tmp_path / "c.yaml").write_text("max_steps: 10\nlearning_rat: 0.1\n")
    done = run_cli("tasks.sft", "--config", str(tmp_path / "c.yaml"), "--output", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: config: unknown field 'learning_rat' in {tmp_path / 'c.yaml'}; known fields: " + \
        ", ".join(f for f in SFTConfig.__dataclass_fields__)
    done = run_cli("tasks.rl", "--output", str(tmp_path), "--pretrain", "x", "--reward_pretrain", "y", "--prompt_data", "z",
                   "--kl_estimator", "k9")
    assert done.returncode == 2 and done.stderr.strip() == "error: kl_estimator: 'k9' is unknown; use k1, k2 or k3"


def test_missing_upstream_checkpoint_is_refused_naming_the_uri(s3_server, tmp_path):
    missing = s3_server.uri("stages/never-written/sft")
    done = run_cli("tasks.reward_model", "--output", str(tmp_path / "rm"), "--pretrain", missing, "--dataset", missing)
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and missing in line


def test_rl_critic_free_estimator_with_a_reward_function(chain, s3_server):
    """group_norm over 4 samples per prompt, exact-match reward from a function file, adaptive KL,
    KL in the loss, entropy bonus, asymmetric and dual clipping."""
    out = s3_server.uri("stages/run1/rl_group_norm")
    done = run_cli("tasks.rl", *flags({
        "output": out, "pretrain": chain["sft"], "prompt_data": chain["prepare_data"],
        "remote_rm_url": str(REPO / "tasks" / "data" / "demo_reward.py"), "label_key": "label",
        "advantage_estimator": "group_norm", "n_samples_per_prompt": 4, "max_steps": 2,
        "rollout_batch_size": 4, "train_batch_size": 8, "kl_target": 0.5, "kl_horizon": 100,
        "use_kl_loss": True, "kl_estimator": "k3", "entropy_coef": 0.01, "eps_clip_low": 0.2, "eps_clip_high": 0.28,
        "dual_clip": 3.0}))
    assert done.returncode == 0, done.stderr[-3000:]
    m = manifests.read_manifest(out)
    assert set(m["inputs"]) == {"pretrain", "prompt_data", "remote_rm_url"}  # no critic, no reward model
    path, _ = manifests.fetch(out, SCRATCH / "cache-stages" / "rl_group_norm")
    logged = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    assert [r["kl_coef"] for r in logged][0] == 0.05 and logged[-1]["value_loss"] == 0.0
    assert all(0.0 <= r["reward"] <= 1.0 for r in logged)  # exact match: 0 or 1 per sample
