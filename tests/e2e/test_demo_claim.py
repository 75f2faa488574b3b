"""The demo's claim on every seed, and the same numbers twice (`make test-all`; `make test` holds seed 0 through
tests/e2e/test_e2e.py's run of the DAG itself).

Each seed runs the demo's stages as plain processes, with the flags the rlhf_pipeline DAG passes at its Param
defaults (plugins/form.py DEFAULTS): prepare_data → SFT → reward model → RL (PPO) → eval, every stage
on that seed. The claim (tasks/data/demo.py's verdict): the preferred style up 30 points or more, held-out
greedy accuracy down 3 points at most. Seed 0's eval table must then equal the session's DAG run of the
demo (tests/conftest.py's demo_run: the same seed and flags through Airflow and Ray jobs, from nothing),
number for number: the same commit, lock and seed give the same result, by either route. About 5 minutes
a seed on 2 cores; seed 1 reuses the data, SFT and reward model tests/e2e/test_learning.py made for it.
"""

import json
import shutil

import pytest

from plugins.form import DEFAULTS
from tasks.common import manifest as manifests
from tasks.data import demo

from tests.conftest import SCRATCH
from tests.e2e.test_stages import flags, run_cli

pytestmark = pytest.mark.slow
ROOT = SCRATCH / "demo-claim"


#: The demo's metric file, which the DAG gives eval when the dataset is the demo's.
DEMO_METRICS = "tasks/data/demo_metrics.py"


def dag_default_flags(stage: str, seed: int) -> dict:
    """The flags dags/rlhf_pipeline.py gives `stage` at the form's defaults (the parts that change numbers)."""
    d = {**DEFAULTS, "seed": seed}
    common = {"seed": seed, "zero_stage": d["zero_stage"]}
    return {
        "tasks.data": {"seed": seed},
        "tasks.sft": {**common, "max_steps": d["sft_steps"], "learning_rate": d["sft_learning_rate"]},
        "tasks.reward_model": {**common, "max_steps": d["rm_steps"], "learning_rate": d["rm_learning_rate"]},
        "tasks.rl": {
            **common,
            "max_steps": d["rl_steps"],
            "actor_learning_rate": d["actor_learning_rate"],
            "critic_learning_rate": d["critic_learning_rate"],
            "init_kl_coef": d["init_kl_coef"],
            "lambd": d["gae_lambda"],
            "ptx_coef": d["ptx_coef"],
            "advantage_estimator": d["advantage_estimator"],
            "n_samples_per_prompt": d["n_samples_per_prompt"],
            "colocate_all_models": d["colocate_all_models"],
        },
        "tasks.eval": {"seed": seed, "max_samples": d["eval_max_samples"], "metric_func": DEMO_METRICS},
    }[stage]


#: The data, SFT and reward-model outputs this test session made, by seed folder: tests/e2e/test_learning.py runs
#: its second seed on them rather than training them again.
MODELS: dict = {}


def run_stages(ray_address, root, seed: int, names: tuple[str, ...]) -> dict:
    """The demo's stages `names` for one seed into `root` (local folders), each a plain process with the DAG's
    default flags; returns every stage's output folder."""
    out = {name: str(root / name) for name in ("data", "sft", "rm", "rl", "eval")}
    stages = {
        "data": ("tasks.data", {"output": out["data"]}),
        "sft": ("tasks.sft", {"output": out["sft"], "pretrain": out["data"], "dataset": out["data"]}),
        "rm": ("tasks.reward_model", {"output": out["rm"], "pretrain": out["sft"], "dataset": out["data"]}),
        "rl": (
            "tasks.rl",
            {
                "output": out["rl"],
                "pretrain": out["sft"],
                "reward_pretrain": out["rm"],
                "prompt_data": out["data"],
                "pretrain_data": out["data"] if DEFAULTS["ptx_coef"] else "",
            },
        ),
        "eval": (
            "tasks.eval",
            {
                "output": out["eval"],
                "baseline": out["sft"],
                "policy": out["rl"],
                "reward_pretrain": out["rm"],
                "dataset": out["data"],
            },
        ),
    }
    for name in names:
        module, values = stages[name]
        done = run_cli(module, *flags({**values, **dag_default_flags(module, seed)}), ray=ray_address)
        assert done.returncode == 0, f"{module} (seed {seed}) failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        if name == "rm":
            MODELS[root] = {key: out[key] for key in ("data", "sft", "rm")}
    return out


def demo_table(ray_address, root) -> dict:
    """The demo's stages for one seed into `root`; the eval report's {baseline, policy} metrics. The data, SFT
    and reward model tests/e2e/test_learning.py already made in `root` this session are reused (the same flags)."""
    seed = int(root.name.split("-")[0].removeprefix("seed"))
    if root in MODELS:
        shutil.rmtree(root / "rl", ignore_errors=True)
        shutil.rmtree(root / "eval", ignore_errors=True)
        out = run_stages(ray_address, root, seed, ("rl", "eval"))
    else:
        shutil.rmtree(root, ignore_errors=True)
        out = run_stages(ray_address, root, seed, ("data", "sft", "rm", "rl", "eval"))
    path, _ = manifests.fetch(out["eval"], root / "fetched")
    metrics = json.loads((path / "report.json").read_text())["metrics"]
    return {side: metrics[side] for side in ("baseline", "policy")}


def demo_models(ray_address, seed: int) -> dict:
    """The demo's data, SFT and reward model for `seed` as local folders: the ones this session's demo table
    made, or made now (about 8 minutes on 2 cores)."""
    root = ROOT / f"seed{seed}"
    if root not in MODELS:
        shutil.rmtree(root, ignore_errors=True)
        run_stages(ray_address, root, seed, ("data", "sft", "rm"))
    return MODELS[root]


@pytest.fixture(scope="module")
def tables(ray_address):
    return {}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_demo_claim_holds_on_every_seed(seed, ray_address, tables):
    table = tables[seed] = demo_table(ray_address, ROOT / f"seed{seed}")
    ok, line = demo.verdict(table["baseline"], table["policy"])
    print(f"seed {seed}: {line}\n{json.dumps(table, indent=1)}")
    assert ok, f"seed {seed}: {line}"


def test_the_same_seed_gives_the_same_table_twice(ray_address, tables, demo_run):
    first = tables.get(0) or demo_table(ray_address, ROOT / "seed0")
    metrics = demo_run.report()["metrics"]  # the DAG's run: its own prepare_data, SFT, reward model, RL and eval
    assert {side: metrics[side] for side in ("baseline", "policy")} == first
