"""Every stage's CLI on the tiny demo model, chained through the S3 emulator.

Step counts are tiny: these tests check the contract (inputs through manifests, outputs committed
with manifest.json, HF-format checkpoints, metrics, reports), not learning; the end-to-end test
checks learning on the demo's real settings.

The chain (every stage by its CLI, about 100 s) and the tests on it run under `make test-all`; `make test`
runs every stage through the DAG on the live stack (tests/e2e/test_e2e.py) and keeps the refusals that need no chain.
"""

import json
import os
import subprocess
import sys

import pytest

from tasks.common import manifest as manifests
from tasks.common import stage, storage
from tasks.common.config import make_config
from tasks.common.nn.models import resolve_model
from tasks.data.__main__ import prepare
from tasks.data.config import PrepareDataConfig
from tasks.sft.config import SFTConfig

from tests.conftest import REPO, SCRATCH


def cli_env(ray: str = "") -> dict:
    """This environment for a stage's `python -m` process: the repository importable, `ray` the cluster's address."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "RAY_ADDRESS": ray,
    }


def run_cli(*args, ray: str = "", env: dict | None = None):
    """`python -m <args>` as a plain process; `ray` is the cluster's address for stages that place workers, or
    `env` the whole environment (LiveStack.stage_env(): the live stack's S3 and Ray)."""
    env = env or cli_env(ray)
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, timeout=600, cwd=REPO)


def flags(values: dict) -> list[str]:
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


@pytest.fixture(scope="module")
def chain(s3_server, ray_address):
    """prepare_data (in this process) -> sft -> reward_model (2 workers, packed) -> rl (actor+ref and critic+reward
    colocated) -> eval (each its CLI), outputs on S3."""
    os.environ["RLHF_CACHE_DIR"] = str(SCRATCH / "cache-stages")
    root = s3_server.uri("stages/run1")
    out = {name: f"{root}/{name}" for name in ("prepare_data", "sft", "reward_model", "rl", "eval")}
    stage.run("prepare_data", make_config(PrepareDataConfig, {"output": out["prepare_data"]}), prepare)
    commands = {
        "tasks.sft": {
            "output": out["sft"],
            "pretrain": out["prepare_data"],
            "dataset": out["prepare_data"],
            "max_steps": 6,
            "train_batch_size": 32,
            "logging_steps": 2,
            "use_wandb": True,
        },
        "tasks.reward_model": {
            "output": out["reward_model"],
            "pretrain": out["sft"],
            "dataset": out["prepare_data"],
            "max_steps": 4,
            "train_batch_size": 32,
            "logging_steps": 2,
            "num_gpus_per_node": 2,
            "packing_samples": True,
        },
        "tasks.rl": {
            "output": out["rl"],
            "pretrain": out["sft"],
            "reward_pretrain": out["reward_model"],
            "prompt_data": out["prepare_data"],
            "max_samples": 32,
            "num_episodes": 1,
            "rollout_batch_size": 16,
            "train_batch_size": 8,
            "colocate_actor_ref": True,
            "colocate_critic_reward": True,
            "save_value_network": True,
            "pretrain_data": out["prepare_data"],
            "ptx_coef": 0.5,
        },  # PPO-ptx, as the demo's RL stage
        "tasks.eval": {
            "output": out["eval"],
            "baseline": out["sft"],
            "policy": out["rl"],
            "reward_pretrain": out["reward_model"],
            "dataset": out["prepare_data"],
            "max_samples": 24,
            "metric_func": "tasks/data/demo_metrics.py",
        },
    }
    for module, values in commands.items():
        done = run_cli(module, *flags(values), ray=ray_address)
        assert done.returncode == 0, f"{module} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return out


@pytest.mark.slow  # the chain: make test-all (see above)
def test_every_stage_commits_a_manifest_with_its_lineage(chain):
    for name, uri in chain.items():
        m = manifests.read_manifest(uri)
        assert m["stage"] == name and m["files"] and m["config_hash"]
        assert "metrics.jsonl" in m["files"]
    assert manifests.read_manifest(chain["sft"])["inputs"] == {
        "pretrain": chain["prepare_data"],
        "dataset": chain["prepare_data"],
    }
    assert manifests.read_manifest(chain["rl"])["inputs"]["reward_pretrain"] == chain["reward_model"]
    assert (
        manifests.read_manifest(chain["rl"])["metrics"]["steps"] == 2
    )  # --num_episodes 1 over --max_samples 32 prompts, 16 a step
    assert manifests.read_manifest(chain["reward_model"])["metrics"]["workers"] == 2
    assert "critic/model.safetensors" in manifests.read_manifest(chain["rl"])["files"]  # --save_value_network
    # Each stage's cost: what it held (its driver's CPU plus a CPU per worker bundle here; no GPU) and GPU-hours.
    held = {
        name: {k: manifests.read_manifest(uri)["metrics"][k] for k in ("gpus", "cpus", "gpu_hours")}
        for name, uri in chain.items()
    }
    # RL: [actor+ref] and [critic+reward]; eval: its worker's bundle (tasks/eval/worker.py)
    cpus = {"prepare_data": 1, "sft": 2, "reward_model": 3, "rl": 3, "eval": 2}
    assert held == {name: {"gpus": 0, "cpus": n, "gpu_hours": 0.0} for name, n in cpus.items()}


@pytest.mark.slow  # the chain: make test-all (see above)
def test_checkpoints_load_through_the_auto_classes(chain):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    policy = AutoModelForCausalLM.from_pretrained(resolve_model(chain["rl"]))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(chain["rl"]))
    assert policy.config.vocab_size == len(tokenizer)
    rm = AutoModelForSequenceClassification.from_pretrained(resolve_model(chain["reward_model"]))
    assert rm.config.num_labels == 1
    assert isinstance(rm.config.reward_mean, float) and rm.config.reward_std > 0


@pytest.mark.slow  # the chain: make test-all (see above)
def test_metrics_are_logged_per_step(chain, tmp_path):
    path, _ = manifests.fetch(chain["sft"], tmp_path)
    steps = [json.loads(line)["step"] for line in (path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6]
    rl_path, _ = manifests.fetch(chain["rl"], tmp_path / "rl")
    rl_metrics = [json.loads(line) for line in (rl_path / "metrics.jsonl").read_text().splitlines()]
    assert {
        "reward",
        "kl",
        "policy_loss",
        "value_loss",
        "clip_fraction",
        "entropy",
        "ptx_loss",
        "time_generate_s",
    } <= set(rl_metrics[0])
    wandb_runs = list((SCRATCH / "wandb" / "wandb").glob("offline-run-*"))
    assert wandb_runs, "use_wandb wrote no offline wandb run"


@pytest.mark.slow  # the chain: make test-all (see above)
def test_eval_writes_report_and_table(chain, tmp_path):
    path, m = manifests.fetch(chain["eval"], tmp_path)
    report = json.loads((path / "report.json").read_text())
    for side in ("baseline", "policy"):
        assert set(report["metrics"][side]) >= {"accuracy", "sampled_preferred_style_rate", "reward_mean", "kl_to_ref"}
    assert report["metrics"]["baseline"]["kl_to_ref"] == 0
    assert report["num_prompts"] == 24 and len(report["samples"]) == 8
    assert "| sampled_preferred_style_rate |" in (path / "report.md").read_text()
    assert m["metrics"]["policy_accuracy"] == report["metrics"]["policy"]["accuracy"]


@pytest.mark.slow  # the chain: make test-all (see above)
def test_cli_refuses_a_missing_dataset_key_before_training(chain, ray_address, tmp_path):
    done = run_cli(
        "tasks.sft",
        "--output",
        str(tmp_path / "out"),
        "--pretrain",
        chain["sft"],
        "--dataset",
        chain["prepare_data"],
        "--output_key",
        "answer",
        ray=ray_address,
    )
    assert done.returncode == 2
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("error: dataset: key 'answer' missing") and "keys present: prompt, response, style" in error
    assert not (tmp_path / "out").exists()


def test_cli_refuses_bad_config_in_one_line(tmp_path):
    (tmp_path / "c.yaml").write_text("max_steps: 10\nlearning_rat: 0.1\n")
    done = run_cli("tasks.sft", "--config", str(tmp_path / "c.yaml"), "--output", str(tmp_path))
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == f"error: config: unknown field 'learning_rat' in {tmp_path / 'c.yaml'}; known fields: "
        + ", ".join(f for f in SFTConfig.__dataclass_fields__)
    )
    done = run_cli(
        "tasks.rl",
        "--output",
        str(tmp_path),
        "--pretrain",
        "x",
        "--reward_pretrain",
        "y",
        "--prompt_data",
        "z",
        "--kl_estimator",
        "k9",
    )
    assert done.returncode == 2 and done.stderr.strip() == "error: kl_estimator: 'k9' is not a choice; use k1, k2 or k3"


def test_missing_upstream_checkpoint_is_refused_naming_the_uri(s3_server, ray_address, tmp_path):
    missing = s3_server.uri("stages/never-written/sft")
    done = run_cli(
        "tasks.reward_model",
        "--output",
        str(tmp_path / "rm"),
        "--pretrain",
        missing,
        "--dataset",
        missing,
        ray=ray_address,
    )
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and missing in line


def test_prepare_data_refuses_a_missing_dataset_or_base_model_naming_the_uri(s3_server, tmp_path):
    """The first stage that needs them fails, in one line naming the URI, before anything is trained."""
    for flag, missing in (
        ("--source", s3_server.uri("datasets/never-uploaded.jsonl")),
        ("--base_model", s3_server.uri("models/never-uploaded")),
        ("--base_model", str(tmp_path / "no-model")),
    ):
        done = run_cli("tasks.data", "--output", str(tmp_path / "out"), flag, missing)
        assert done.returncode == 2, done.stderr
        line = done.stderr.strip().splitlines()[-1]
        assert line.startswith(f"error: {flag[2:]}: no ") and missing in line, line
        assert not (tmp_path / "out").exists()


@pytest.mark.slow  # the chain: make test-all (see above)
def test_rl_critic_free_estimator_with_a_reward_function(chain, s3_server, ray_address):
    """group_norm over 4 samples per prompt, a reward function file reading labels, adaptive KL,
    KL in the loss, entropy bonus, asymmetric and dual clipping, dynamic filtering, micro-batches."""
    out = s3_server.uri("stages/run1/rl_group_norm")
    done = run_cli(
        "tasks.rl",
        *flags(
            {
                "output": out,
                "pretrain": chain["sft"],
                "prompt_data": chain["prepare_data"],
                "remote_rm_url": str(REPO / "tests" / "rewards" / "parity_reward.py"),
                "label_key": "label",
                "advantage_estimator": "group_norm",
                "n_samples_per_prompt": 4,
                "max_steps": 2,
                "rollout_batch_size": 4,
                "train_batch_size": 8,
                "kl_target": 0.5,
                "kl_horizon": 100,
                "use_kl_loss": True,
                "kl_estimator": "k3",
                "entropy_coef": 0.01,
                "eps_clip_low": 0.2,
                "eps_clip_high": 0.28,
                "dual_clip": 3.0,
                "dynamic_filtering": True,
                "dynamic_filtering_reward_range": "0 1",
                "micro_train_batch_size": 4,
                "micro_rollout_batch_size": 8,
                "colocate_all_models": True,
            }
        ),
        ray=ray_address,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "placement groups [actor + ref] × 1" in done.stdout  # no critic, no reward-model group
    m = manifests.read_manifest(out)
    assert set(m["inputs"]) == {"pretrain", "prompt_data", "remote_rm_url"}  # no critic, no reward model
    path, _ = manifests.fetch(out, SCRATCH / "cache-stages" / "rl_group_norm")
    logged = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    assert [r["kl_coef"] for r in logged][0] == 0.05 and "value_loss" not in logged[-1]
    # Dynamic filtering kept only groups with both right and wrong answers: mean reward strictly inside (0, 1).
    assert all(0.0 < r["reward"] < 1.0 for r in logged)
    assert all(0.0 < r["filter_kept_fraction"] <= 1.0 for r in logged)


@pytest.mark.slow  # the chain: make test-all (see above)
def test_rl_over_samples_and_trains_packed_by_token_budget(chain, s3_server, ray_address):
    """--over_sampling_batch_size 6 for 4 groups a step: 2 groups cut a step and counted; --packing_samples with a
    token budget runs the actor's passes as packed rows; the stage commits as any other."""
    out = s3_server.uri("stages/run1/rl_over_sampled")
    done = run_cli(
        "tasks.rl",
        *flags(
            {
                "output": out,
                "pretrain": chain["sft"],
                "prompt_data": chain["prepare_data"],
                "remote_rm_url": str(REPO / "tests" / "rewards" / "parity_reward.py"),
                "label_key": "label",
                "advantage_estimator": "group_norm",
                "n_samples_per_prompt": 2,
                "max_steps": 2,
                "rollout_batch_size": 4,
                "over_sampling_batch_size": 6,
                "train_batch_size": 8,
                "init_kl_coef": 0,
                "max_tokens_per_gpu": 40,
                "packing_samples": True,
                "colocate_all_models": True,
            }
        ),
        ray=ray_address,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    path, _ = manifests.fetch(out, SCRATCH / "cache-stages" / "rl_over_sampled")
    logged = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 2 and all(r["rollout_dropped_groups"] == 2 for r in logged)
    assert all("policy_loss" in r for r in logged)


def metrics_of(uri: str, where) -> list[dict]:
    path, _ = manifests.fetch(uri, where)
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # the chain: make test-all (see above)
def test_two_sft_workers_follow_the_loss_curve_of_one(chain, s3_server, ray_address, tmp_path):
    """Data parallelism: 2 workers (with 2 micro-batches of gradient accumulation each) on the same global
    batch give the loss curve of 1 worker, within 1% over the first 10 steps."""
    curves = {}
    for workers, micro in ((1, 0), (2, 8)):
        out = s3_server.uri(f"stages/run1/sft_dp{workers}")
        done = run_cli(
            "tasks.sft",
            *flags(
                {
                    "output": out,
                    "pretrain": chain["prepare_data"],
                    "dataset": chain["prepare_data"],
                    "max_steps": 10,
                    "train_batch_size": 32,
                    "logging_steps": 1,
                    "num_gpus_per_node": workers,
                    "micro_train_batch_size": micro,
                }
            ),
            ray=ray_address,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert manifests.read_manifest(out)["metrics"]["workers"] == workers
        curves[workers] = [r["loss"] for r in metrics_of(out, tmp_path / str(workers))]
    assert len(curves[1]) == len(curves[2]) == 10
    for one, two in zip(curves[1], curves[2]):
        assert abs(one - two) <= 0.01 * abs(one), (curves[1], curves[2])
    assert curves[1][-1] < curves[1][0]


@pytest.mark.slow  # the chain: make test-all (see above)
def test_sft_flags_take_effect(chain, s3_server, ray_address, tmp_path):
    """--max_samples cuts the rows; --save_path gets a copy of the final model; --flash_attn falls back to SDPA
    on CPU and says so; --gradient_checkpointing recomputes activations, which changes memory, not the loss."""
    outs, logs = {}, {}
    for name, extra in (
        ("plain", {}),
        ("flags", {"save_path": str(tmp_path / "copy"), "flash_attn": True, "gradient_checkpointing": True}),
    ):
        outs[name] = s3_server.uri(f"stages/run1/sft_{name}")
        done = run_cli(
            "tasks.sft",
            *flags(
                {
                    "output": outs[name],
                    "pretrain": chain["prepare_data"],
                    "dataset": chain["prepare_data"],
                    "max_steps": 3,
                    "train_batch_size": 32,
                    "logging_steps": 1,
                    "max_samples": 64,
                    **extra,
                }
            ),
            ray=ray_address,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        logs[name] = done.stderr
    assert (
        manifests.read_manifest(outs["flags"])["metrics"]["rows"]
        == 64
        < manifests.read_manifest(chain["sft"])["metrics"]["rows"]
    )
    assert (tmp_path / "copy" / "model.safetensors").is_file() and (tmp_path / "copy" / "config.json").is_file()
    assert "flash_attn: a CUDA GPU is missing; using PyTorch's SDPA attention kernels instead" in logs["flags"]
    assert "flash_attn" not in logs["plain"]
    plain, checkpointed = (metrics_of(outs[n], tmp_path / n) for n in ("plain", "flags"))
    for a, b in zip(plain, checkpointed):
        assert abs(a["loss"] - b["loss"]) <= 1e-5


@pytest.mark.slow  # 75 s: make test-all
def test_checkpoint_flags(chain, s3_server, ray_address, tmp_path):
    """--ckpt_path puts checkpoints elsewhere, --max_ckpt_num keeps the newest, a rerun resumes from the
    newest unless --load_checkpoint false (refused when it would write beside them), and --bf16 trains and
    saves in bfloat16."""
    from transformers import AutoConfig

    from tasks.common.checkpoint import CheckpointStore

    ckpt = str(tmp_path / "ckpt")
    out = s3_server.uri("stages/run1/sft_ckpt")
    base = {
        "output": out,
        "pretrain": chain["prepare_data"],
        "dataset": chain["prepare_data"],
        "train_batch_size": 16,
        "logging_steps": 1,
        "save_steps": 2,
        "ckpt_path": ckpt,
        "max_ckpt_num": 1,
        "bf16": True,
    }
    for max_steps, extra, first_step in ((4, {}, 1), (6, {}, 5), (2, {"load_checkpoint": False, "save_steps": 0}, 1)):
        done = run_cli("tasks.sft", *flags({**base, "max_steps": max_steps, **extra}), ray=ray_address)
        assert done.returncode == 0, done.stderr[-3000:]
        assert metrics_of(out, tmp_path / f"m{max_steps}")[0]["step"] == first_step
    assert CheckpointStore(ckpt).steps() == [6]  # only the newest kept; the run that started over wrote none
    # Starting over while writing checkpoints beside an earlier run's is refused: a later resume would pick theirs.
    done = run_cli("tasks.sft", *flags({**base, "max_steps": 2, "load_checkpoint": False}), ray=ray_address)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: load_checkpoint: {ckpt} holds checkpoints up to step 6 of an earlier run; resume them (--load_checkpoint true) or pass another --ckpt_path"
    )
    assert not any(rel.startswith("checkpoints/") for rel, _ in storage.list_files(out))
    assert str(AutoConfig.from_pretrained(resolve_model(out)).dtype).endswith("bfloat16")


@pytest.mark.slow  # 200 s; a resumed RL stage also runs in make test (tests/e2e/test_operations.py, from its step-6 checkpoint)
def test_rl_run_killed_after_a_checkpoint_resumes_to_the_same_metrics(chain, s3_server, ray_address, tmp_path):
    import signal
    import time

    args = {
        "pretrain": chain["sft"],
        "reward_pretrain": chain["reward_model"],
        "prompt_data": chain["prepare_data"],
        "max_steps": 6,
        "rollout_batch_size": 8,
        "train_batch_size": 8,
        "colocate_all_models": True,
    }
    whole = s3_server.uri("stages/run1/rl_whole")
    done = run_cli("tasks.rl", *flags({**args, "output": whole}), ray=ray_address)
    assert done.returncode == 0, done.stderr[-3000:]

    killed = s3_server.uri("stages/run1/rl_killed")
    command = [sys.executable, "-m", "tasks.rl", *flags({**args, "output": killed, "save_steps": 2})]
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": ray_address}
    proc = subprocess.Popen(
        command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.time() + 300
        while not storage.exists(f"{killed}/checkpoints/step_2/manifest.json"):
            assert proc.poll() is None and time.time() < deadline, (
                "the run ended or stalled before its first checkpoint"
            )
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not storage.exists(f"{killed}/manifest.json")

    done = run_cli("tasks.rl", *flags({**args, "output": killed, "save_steps": 2}), ray=ray_address)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rl: resumed from" in done.stdout
    resumed = metrics_of(killed, tmp_path / "killed")
    assert resumed[0]["step"] > 2  # it went on from a checkpoint instead of starting over
    final, expected = resumed[-1], metrics_of(whole, tmp_path / "whole")[-1]
    assert final["step"] == expected["step"] == 6
    for key in ("reward", "kl", "policy_loss", "value_loss", "entropy", "response_length"):
        assert abs(final[key] - expected[key]) <= 1e-4, (key, final[key], expected[key])


@pytest.mark.slow  # the chain: make test-all (see above)
def test_rl_refuses_what_cannot_run_here_in_one_line(chain, ray_address, tmp_path):
    base = [
        "--output",
        str(tmp_path / "rl"),
        "--pretrain",
        chain["sft"],
        "--reward_pretrain",
        chain["reward_model"],
        "--prompt_data",
        chain["prepare_data"],
    ]
    done = run_cli("tasks.rl", *base, "--vllm_num_engines", "1", ray=ray_address)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "error: vllm_num_engines: vLLM engines need GPUs and the vllm package, and this "
        "Ray cluster has no GPUs; use --vllm_num_engines 0 (transformers generate in the actor workers)"
    )
    done = run_cli("tasks.rl", *base, ray=ray_address)  # four separate groups of one CPU each on a 2-CPU cluster
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "error: colocate_all_models: its worker groups need 4 CPUs at once and the Ray cluster has 2;"
    )
    assert line.endswith("(worker groups: [actor] × 1, [ref] × 1, [critic] × 1, [reward] × 1)")
    done = run_cli("tasks.rl", *base, "--vllm_tensor_parallel_size", "2")
    assert done.stderr.strip() == (
        "error: vllm_tensor_parallel_size: only applies to vLLM engines; set --vllm_num_engines too, or drop it"
    )
    assert not (tmp_path / "rl").exists()


@pytest.mark.slow  # the chain: make test-all (see above)
@pytest.mark.parametrize(
    "method,extra",
    [
        pytest.param(
            "dpo", {"ref_offload": True, "num_gpus_per_node": 2}, marks=pytest.mark.slow
        ),  # 2 workers, 63 s: make test-all
        ("dpo", {"loss_type": "ipo"}),
        ("kto", {"desirable_weight": 1.5}),
    ],
)
def test_preference_stage_trains_and_logs_its_metrics(method, extra, chain, s3_server, ray_address, tmp_path):
    out = s3_server.uri(f"stages/run1/preference_{method}_{'_'.join(extra)}")
    done = run_cli(
        "tasks.preference",
        *flags(
            {
                "output": out,
                "method": method,
                "pretrain": chain["sft"],
                "dataset": chain["prepare_data"],
                "max_steps": 3,
                "train_batch_size": 16,
                "logging_steps": 1,
                **extra,
            }
        ),
        ray=ray_address,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    logged = metrics_of(out, tmp_path)
    assert [r["step"] for r in logged] == [1, 2, 3]
    expected = (
        {"loss", "margin", "reward_accuracy", "chosen_reward", "rejected_reward"}
        if method == "dpo"
        else {"loss", "margin", "kl"}
    )
    assert expected <= set(logged[0])
    m = manifests.read_manifest(out)
    assert m["metrics"]["method"] == method and m["inputs"]["pretrain"] == chain["sft"]
    assert m["metrics"]["examples"] == 8500 and m["metrics"]["workers"] == extra.get("num_gpus_per_node", 1)


@pytest.mark.slow  # the chain: make test-all (see above)
def test_preference_stage_refuses_bad_input_in_one_line(chain, ray_address, tmp_path):
    base = ["--output", str(tmp_path / "p"), "--pretrain", chain["sft"], "--dataset", chain["prepare_data"]]
    done = run_cli("tasks.preference", *base, "--method", "kto", "--label_key", "thumbs", ray=ray_address)
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: dataset: key 'thumbs' missing") and "keys present: prompt, completion, label" in line
    done = run_cli("tasks.preference", *base, "--loss_type", "ipo", "--label_smoothing", "0.1")
    assert (
        done.stderr.strip()
        == "error: label_smoothing: conservative DPO smooths the sigmoid loss; use 0 with --loss_type ipo"
    )
    assert not (tmp_path / "p").exists()
