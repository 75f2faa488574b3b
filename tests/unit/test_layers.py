"""The house's import rules and its one list of stages, checked on the source: every import statement, those
inside functions too (a deferred import is still a dependency).

- a stage package (tasks/<stage>/) imports tasks.common and itself, never another stage;
- tasks.common imports no stage;
- tasks never imports airflow; plugins and dags never import torch or its kin (tests/unit/plugins/test_operators.py
  also checks what plugins load at run time);
- tasks.common.stages names each stage's config class and work function exactly as its __main__ hands them to
  tasks.common.stage.main.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from tasks.common.stages import PIPELINE_TASKS, STAGES

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tasks"
PACKAGES = sorted(p.name for p in TASKS.iterdir() if (p / "__init__.py").exists() and p.name != "common")
TORCH_SIDE = ("torch", "transformers", "deepspeed", "peft", "vllm", "flash_attn", "liger_kernel")


def imported(path: Path) -> set[str]:
    """The absolute modules a file imports (`from tasks import x` counts as tasks.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {f"tasks.{a.name}" for a in node.names} if node.module == "tasks" else {node.module}
    return found


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def offending(folder: Path, allowed) -> dict[str, list[str]]:
    bad = {}
    for path in sorted(folder.rglob("*.py")):
        wrong = sorted(m for m in imported(path) if not allowed(m))
        if wrong:
            bad[str(path.relative_to(REPO))] = wrong
    return bad


@pytest.mark.parametrize("package", PACKAGES)
def test_a_stage_imports_only_tasks_common_and_itself(package):
    """What two stages share lives in tasks/common: a stage that reached into another would change with it."""
    own = f"tasks.{package}"
    assert not offending(
        TASKS / package, lambda m: not within(m, "tasks") or within(m, "tasks.common") or within(m, own)
    )


def test_tasks_common_imports_no_stage():
    assert not offending(TASKS / "common", lambda m: not within(m, "tasks") or within(m, "tasks.common"))


def test_tasks_never_import_airflow_and_plugins_never_import_torch():
    assert not offending(TASKS, lambda m: not within(m, "airflow"))
    for folder in ("plugins", "dags"):
        assert not offending(REPO / folder, lambda m: not any(within(m, t) for t in TORCH_SIDE)), folder


def main_call(package: str) -> tuple[str, str, str]:
    """(stage name, config class name, work function name) of the stage.main(...) call in the package's __main__."""
    tree = ast.parse((TASKS / package.removeprefix("tasks.") / "__main__.py").read_text())
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "main" and len(n.args) == 3
    ]
    assert len(calls) == 1, package
    name, config, work = calls[0].args
    return name.value, config.id, work.id


@pytest.mark.parametrize("name", sorted(STAGES))
def test_the_registry_names_what_each_stage_runs(name):
    entry = STAGES[name]
    stage_name, config, work = main_call(entry.package)
    module = importlib.import_module(f"{entry.package}.__main__")  # its main() call sits under __name__ == "__main__"
    assert stage_name == name
    assert getattr(module, config) is entry.config_class() and getattr(module, work) is entry.work_function()


def test_every_pipeline_task_runs_a_registered_stage_and_every_stage_has_a_task():
    assert set(PIPELINE_TASKS.values()) == set(STAGES)
