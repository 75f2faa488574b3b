"""tools/export.py: a run's policy or the champion out of a real S3 emulator as a plain HF folder, verified.

pytest tests/unit/tools/test_export.py
"""

import subprocess
import sys

import pytest
import torch

from tasks.common import manifest as manifests
from tasks.common import storage
from tasks.common.registry import Registry
from tasks.data.demo import build_base_model, build_tokenizer
from tools import export

from tests.conftest import REPO


def commit_model(tmp_path, uri: str, seed: int):
    tokenizer = build_tokenizer()
    model = build_base_model(tokenizer, seed=seed, hidden_size=32, num_layers=1)
    local = tmp_path / f"out{seed}"
    model.save_pretrained(local / "model")
    tokenizer.save_pretrained(local / "model")
    manifests.commit(local, uri, manifests.build_manifest("rl", "r", {}, {}, {}, model="model"))
    return model


def test_a_runs_policy_and_the_champion_come_out_as_plain_hf_models(s3_server, tmp_path):
    from transformers import AutoModelForCausalLM

    root = s3_server.uri("export")
    run = storage.join(root, "runs", "rlhf_pipeline", "manual__1")
    trained = commit_model(tmp_path, storage.join(run, "rl"), seed=1)
    assert export.main(["--run", "manual__1", "--root", root, "--out", str(tmp_path / "policy")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), loaded.state_dict().values()))
    assert not (tmp_path / "policy" / "manifest.json").exists()  # a plain HF folder

    champion_uri = storage.join(root, "runs", "rlhf_pipeline", "manual__2", "rl")
    commit_model(tmp_path, champion_uri, seed=2)
    Registry(storage.join(root, "models", "demo-policy")).promote(
        {"policy": champion_uri}, expected_version=0, promoted_by="test"
    )
    assert export.main(["--champion", "--root", root, "--out", str(tmp_path / "champion")]) == 0
    assert (tmp_path / "champion" / "config.json").exists()


def test_what_cannot_be_exported_is_one_line_and_nothing_is_overwritten(s3_server, tmp_path, capsys):
    root = s3_server.uri("export-missing")
    assert export.main(["--run", "nope", "--root", root, "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert export.main(["--champion", "--root", root, "--out", str(tmp_path / "x")]) == 2
    assert "nothing promoted yet" in capsys.readouterr().err
    run = storage.join(root, "runs", "rlhf_pipeline", "manual__1", "rl")
    commit_model(tmp_path, run, seed=3)
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep")
    assert export.main([run, "--out", str(full)]) == 2
    assert "not empty" in capsys.readouterr().err and (full / "mine.txt").read_text() == "keep"


@pytest.mark.parametrize("args", [["--help"]])
def test_the_cli_prints_its_help(args):
    done = subprocess.run(
        [sys.executable, "-m", "tools.export", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "--champion" in done.stdout, done.stderr
