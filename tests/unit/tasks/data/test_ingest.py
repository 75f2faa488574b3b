"""prepare_data on a user's dataset: JSONL/Parquet/CSV sources, the column mapping, chat messages, every
validation check, the bad-row threshold, the deterministic split, versions and dataset:<name>, and the
downstream loader reading the splits. Real files, the real S3 emulator where S3 matters; CPU, seconds."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.common import manifest as manifests
from tasks.common import stage
from tasks.common.config import ConfigError, make_config, parse_config
from tasks.common.nn import data
from tasks.data import mapping, versions
from tasks.data.__main__ import prepare
from tasks.data.config import PrepareDataConfig

from tests.conftest import REPO
from tests.tiny_chat import chat_rows

SPLITS = {"sft", "preference", "style_pairs", "unpaired", "preference_eval", "prompts", "eval"}


# ----------------------------------------------------------------------------- helpers


def write(path: Path, rows: list[dict], fmt: str | None = None) -> str:
    """rows as a JSONL, Parquet or CSV file (by the suffix); lists in CSV cells as JSON text."""
    fmt = fmt or path.suffix.lstrip(".")
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        columns = list(dict.fromkeys(k for r in rows for k in r))
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()} for r in rows)
    return str(path)


def qa_rows(n: int = 60) -> list[dict]:
    """User-style rows with their own column names: question, good, bad, answer."""
    return [
        {
            "question": f"What is {i} plus {i + 1}?",
            "good": str(2 * i + 1),
            "bad": f"{2 * i + 1}, probably",
            "answer": str(2 * i + 1),
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> str:
    """A folder the base-model check accepts, so prepare_data builds no demo model (these tests are about data)."""
    folder = tmp_path_factory.mktemp("base-model")
    (folder / "config.json").write_text("{}")
    return str(folder)


def run_prepare(tmp_path: Path, base_model: str, source: str, out: str | None = None, **flags) -> dict:
    """prepare_data in this process; returns its committed manifest."""
    out = out or str(tmp_path / "out")
    values = {
        "output": out,
        "source": source,
        "base_model": base_model,
        "datasets_root": str(tmp_path / "datasets"),
        **flags,
    }
    stage.run("prepare_data", make_config(PrepareDataConfig, values), prepare)
    return manifests.read_manifest(out)


def split_rows(output: str, split: str) -> list[dict]:
    path = data.resolve_dataset(output, split)
    return [json.loads(line) for line in path.read_text().splitlines()]


QA = {"input_key": "question", "chosen_key": "good", "rejected_key": "bad", "label_key": "answer"}


# ----------------------------------------------------------------------------- sources and mapping


def test_jsonl_parquet_and_csv_give_the_same_canonical_splits(tmp_path, base_model):
    rows = qa_rows()
    outputs = {}
    for fmt in ("jsonl", "parquet", "csv"):
        source = write(tmp_path / f"qa.{fmt}", rows)
        m = run_prepare(tmp_path, base_model, source, out=str(tmp_path / f"out-{fmt}"), dataset_name=f"qa-{fmt}", **QA)
        assert set(m["datasets"]) == SPLITS and m["model"] == base_model
        assert m["dataset_version"]["mapping"] == {**QA, "output_key": "", "messages_key": ""}
        outputs[fmt] = {split: split_rows(m["uri"], split) for split in SPLITS}
    assert outputs["jsonl"] == outputs["parquet"] == outputs["csv"]

    splits = outputs["jsonl"]
    by_question = {r["question"]: r for r in rows}
    assert all(
        set(r) == {"prompt", "response"} and r["response"] == by_question[r["prompt"]]["good"] for r in splits["sft"]
    )
    for name in ("preference", "style_pairs", "preference_eval"):
        assert all(
            set(r) == {"prompt", "chosen", "rejected"} and r["rejected"] == by_question[r["prompt"]]["bad"]
            for r in splits[name]
        )
    assert splits["style_pairs"] == splits["preference"]
    # KTO: each pair as a thumbs-up (chosen) and a thumbs-down (rejected) completion.
    assert len(splits["unpaired"]) == 2 * len(splits["preference"])
    assert {(r["completion"] == by_question[r["prompt"]]["good"]) == r["label"] for r in splits["unpaired"]} == {True}
    assert all(r["label"] == by_question[r["prompt"]]["answer"] for r in splits["prompts"] + splits["eval"])
    assert len(splits["sft"]) + len(splits["eval"]) == len(rows)


def test_sft_only_data_with_an_output_column_and_no_label(tmp_path, base_model):
    rows = [{"instruction": f"Say {i}", "reply": f"{i}!"} for i in range(40)]
    m = run_prepare(
        tmp_path,
        base_model,
        write(tmp_path / "sft.jsonl", rows),
        input_key="instruction",
        output_key="reply",
        chosen_key="",
        rejected_key="",
    )
    assert set(m["datasets"]) == {"sft", "prompts", "eval"}
    assert {r["response"] for r in split_rows(m["uri"], "sft")} <= {r["reply"] for r in rows}
    assert all(set(r) == {"prompt"} for r in split_rows(m["uri"], "eval"))  # no label_key: no label column


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv"])
def test_a_messages_column_gives_chat_prompts_and_the_final_assistant_turn(tmp_path, base_model, fmt):
    rows = chat_rows(48)
    m = run_prepare(
        tmp_path,
        base_model,
        write(tmp_path / f"chat.{fmt}", rows),
        messages_key="messages",
        label_key="label",
        max_bad_fraction=1.0,
    )
    assert m["dataset_version"]["mapping"]["input_key"] == ""  # the messages give the prompt
    by_prompt = {json.dumps(r["messages"][:-1]): r for r in rows}
    sft = split_rows(m["uri"], "sft")
    for r in sft:
        assert [t["role"] for t in r["prompt"]] == ["system", "user"]
        assert r["response"] == by_prompt[json.dumps(r["prompt"])]["messages"][-1]["content"]
    assert all(isinstance(r["prompt"], list) and r["label"] for r in split_rows(m["uri"], "eval"))
    # chat_rows repeats some sums: the repeats are exact duplicates, counted, not silently dropped.
    distinct = len({json.dumps([r["messages"], r["chosen"], r["rejected"], r["label"]]) for r in rows})
    assert m["validation"]["checks"].get("duplicate", {}).get("count", 0) == len(rows) - distinct
    assert m["validation"]["kept"] == distinct


# ----------------------------------------------------------------------------- validation


def near_copy_crossing_the_split(prompts: list[str], seed: int, fraction: float) -> tuple[str, str]:
    """(a training prompt, a copy of it up to spacing and case that the hash puts on the held-out side)."""
    for prompt in prompts:
        if mapping.held_out(prompt, seed, fraction):
            continue
        for k in range(1, 200):
            variant = prompt.upper().replace(" ", " " * k)
            if mapping.held_out(variant, seed, fraction):
                return prompt, variant
    raise AssertionError("no near-copy crosses the split")


def bad_rows_file(tmp_path: Path) -> tuple[str, dict[str, list[int]]]:
    """A JSONL file with 40 good rows, then one row failing each check; returns it and {check: its line numbers}."""
    good = [
        {"prompt": f"Name a colour number {i}.", "chosen": f"colour {i}", "rejected": f"no idea {i}", "label": str(i)}
        for i in range(40)
    ]
    trained, near = near_copy_crossing_the_split([r["prompt"] for r in good], seed=0, fraction=0.3)
    lines = [json.dumps(r) for r in good]
    bad = {
        "malformed": ['{"prompt": "cut off', "[1, 2]"],
        "missing_field": [json.dumps({"prompt": "p1", "rejected": "r"})],
        "empty_field": [json.dumps({"prompt": "   ", "chosen": "c", "rejected": "r"})],
        "wrong_type": [json.dumps({"prompt": "p2", "chosen": 42, "rejected": "r"})],
        "identical_pair": [json.dumps({"prompt": "p3", "chosen": "same", "rejected": "same"})],
        "too_long": [json.dumps({"prompt": "x" * 90, "chosen": "y" * 20, "rejected": "z"})],
        "duplicate": [lines[0]],
        "overlap": [json.dumps({"prompt": near, "chosen": "c", "rejected": "r"})],
    }
    numbers = {}
    for check, extra in bad.items():
        numbers[check] = list(range(len(lines) + 1, len(lines) + 1 + len(extra)))
        lines += extra
    lines.append(
        json.dumps({"prompt": "An unlabelled prompt", "chosen": "c", "rejected": "r"})
    )  # fine: label is optional
    lines.append("")  # a blank line is no row
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert trained in {r["prompt"] for r in good}
    return str(path), numbers


def test_every_check_counts_its_rows_and_the_good_rows_are_kept(tmp_path, base_model, capsys):
    source, numbers = bad_rows_file(tmp_path)
    m = run_prepare(
        tmp_path, base_model, source, label_key="label", eval_fraction=0.3, max_chars=100, max_bad_fraction=0.5
    )
    checks = m["validation"]["checks"]
    assert {name: c["rows"] for name, c in checks.items()} == numbers
    assert {name: c["count"] for name, c in checks.items()} == {name: len(rows) for name, rows in numbers.items()}
    assert checks["missing_field"]["fields"] == {"chosen": 1} and checks["empty_field"]["fields"] == {"prompt": 1}
    assert checks["wrong_type"]["fields"] == {"chosen": 1}
    summary = m["validation"]
    assert summary["rows"] == 50 and summary["bad"] == 9 and summary["kept"] == 41 and summary["unlabelled"] == 1
    # The same summary in the version's own manifest, and printed.
    version = manifests.read_manifest(m["dataset_version"]["uri"])
    assert version["validation"] == summary
    printed = capsys.readouterr().out
    assert "validation: 50 rows, 41 kept, 9 bad (18.0%): duplicate 1 (rows 48); empty_field 1 (rows 44); " in printed
    held = {r["prompt"] for r in split_rows(m["uri"], "eval")}
    assert not held & {r["prompt"] for r in split_rows(m["uri"], "prompts")}
    assert all(
        r["label"] is None
        for r in split_rows(m["uri"], "prompts") + split_rows(m["uri"], "eval")
        if r["prompt"] == "An unlabelled prompt"
    )


def test_bad_messages_are_counted(tmp_path, base_model):
    rows = chat_rows(30, seed=1)
    rows += [
        {"messages": [{"role": "assistant", "content": "an answer to nothing"}], "chosen": "a", "rejected": "b"},
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}], "chosen": "a", "rejected": "b"},
        {"messages": "not a list", "chosen": "a", "rejected": "b"},
        {"messages": [], "chosen": "a", "rejected": "b"},
    ]
    m = run_prepare(
        tmp_path, base_model, write(tmp_path / "chat.jsonl", rows), messages_key="messages", max_bad_fraction=1.0
    )
    checks = m["validation"]["checks"]
    assert checks["bad_messages"]["rows"] == [31, 32, 33] and checks["bad_messages"]["fields"] == {"messages": 3}
    assert checks["empty_field"]["rows"] == [34]


def test_too_many_bad_rows_fail_the_step_in_one_line_naming_the_checks_and_flags(tmp_path):
    source, numbers = bad_rows_file(tmp_path)
    out, root = tmp_path / "out", tmp_path / "datasets"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tasks.data",
            "--output",
            str(out),
            "--source",
            source,
            "--datasets_root",
            str(root),
            "--label_key",
            "label",
            "--eval_fraction",
            "0.3",
            "--max_chars",
            "100",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(
        f"error: max_bad_fraction: 9 of 50 rows of {source} (18.0%) failed validation, more than 0.05: "
    ), line
    assert f"too_long 1 (rows {numbers['too_long'][0]}: raise --max_chars 100)" in line
    assert f"missing_field 1 (--chosen_key chosen; rows {numbers['missing_field'][0]}: " in line
    assert line.endswith("fix the data or raise --max_bad_fraction")
    assert not out.exists() and not root.exists()  # nothing registered, no output


def test_mapping_and_source_mistakes_are_one_line_config_errors(tmp_path, base_model, monkeypatch):
    source = write(tmp_path / "qa.jsonl", qa_rows(10))
    base = {"output": str(tmp_path / "out"), "base_model": base_model, "datasets_root": str(tmp_path / "datasets")}
    with pytest.raises(ConfigError) as error:
        stage.run(
            "prepare_data", make_config(PrepareDataConfig, {**base, "source": source, "input_key": "question"}), prepare
        )
    assert str(error.value) == (
        f"chosen_key: no column 'chosen' in {source} (columns: answer, bad, good, question); pass --chosen_key <column>, or --chosen_key '' to not use one"
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cases = {
        "some-org/some-dataset": "source: 'some-org/some-dataset' is a hub id, and HF_HUB_OFFLINE=1 forbids fetching it",
        str(tmp_path / "qa.txt"): "source: no dataset at",
        "dataset:../x": "source: 'dataset:../x' is not a dataset reference",
    }
    for bad_source, message in cases.items():
        with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(".", r"\.")):
            make_config(PrepareDataConfig, {**base, "source": bad_source})
    with pytest.raises(ConfigError, match="^datasets_root: missing; pass --datasets_root"):
        make_config(PrepareDataConfig, {**base, "source": source, "datasets_root": ""})
    with pytest.raises(ConfigError, match="^rejected_key: empty while the other side of the pair is set"):
        make_config(PrepareDataConfig, {**base, "source": source, "rejected_key": ""})
    with pytest.raises(ConfigError, match="^eval_fraction: must be below 1, got 1.0; use a fraction such as 0.1"):
        make_config(PrepareDataConfig, {**base, "source": source, "eval_fraction": 1})


# ----------------------------------------------------------------------------- split


def test_the_split_is_deterministic_by_prompt_and_never_overlaps(tmp_path, base_model):
    # Several pairs per prompt: a prompt's rows all land on one side.
    rows = [{"prompt": f"Question {i % 50}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(200)]
    source = write(tmp_path / "pairs.jsonl", rows)

    def sides(seed: int, name: str) -> tuple[set, set]:
        m = run_prepare(tmp_path, base_model, source, out=str(tmp_path / name), seed=seed, eval_fraction=0.2)
        train = {
            r["prompt"] for split in ("sft", "preference", "unpaired", "prompts") for r in split_rows(m["uri"], split)
        }
        held = {r["prompt"] for split in ("preference_eval", "eval") for r in split_rows(m["uri"], split)}
        return train, held

    train, held = sides(0, "a")
    assert not train & held and len(train | held) == 50
    assert 0 < len(held) < 25
    assert sides(0, "b") == (train, held)  # the same seed, the same split
    assert sides(1, "c")[1] != held  # another seed, another split
    pairs = split_rows(str(tmp_path / "a"), "preference_eval")
    assert len(pairs) == 4 * len(held)


# ----------------------------------------------------------------------------- versions


def test_versions_on_s3_are_idempotent_immutable_and_resolvable(tmp_path, base_model, s3_server):
    root = s3_server.uri(f"ingest/{tmp_path.name}/datasets")
    source = s3_server.uri(f"ingest/{tmp_path.name}/raw/qa.parquet")
    s3_server.client().upload_file(write(tmp_path / "qa.parquet", qa_rows()), s3_server.bucket, source.split("/", 3)[3])
    first = run_prepare(
        tmp_path, base_model, source, out=s3_server.uri(f"ingest/{tmp_path.name}/run1"), datasets_root=root, **QA
    )
    info = first["dataset_version"]
    assert info["name"] == "qa" and info["uri"] == f"{root}/qa/{info['version']}"
    assert first["inputs"]["dataset"] == info["uri"]
    version = manifests.read_manifest(info["uri"])
    assert version["dataset"]["content_sha256"] == manifests.file_sha256(tmp_path / "qa.parquet")
    assert version["dataset"]["rows"] == {split: first["metrics"][f"rows_{split}"] for split in SPLITS}
    assert version["dataset"]["split"] == {"seed": 0, "eval_fraction": 0.1, "max_chars": 16000}

    # The same data again: the same version, not rewritten, listed once.
    again = run_prepare(
        tmp_path, base_model, source, out=s3_server.uri(f"ingest/{tmp_path.name}/run2"), datasets_root=root, **QA
    )
    assert again["dataset_version"]["version"] == info["version"]
    assert manifests.read_manifest(info["uri"])["created_at"] == version["created_at"]
    assert [v["version"] for v in versions.listing(root, "qa")["versions"]] == [info["version"]]
    # Another mapping of the same file is another version.
    sft_only = run_prepare(
        tmp_path,
        base_model,
        source,
        out=s3_server.uri(f"ingest/{tmp_path.name}/run3"),
        datasets_root=root,
        input_key="question",
        output_key="answer",
        chosen_key="",
        rejected_key="",
    )
    assert sft_only["dataset_version"]["version"] != info["version"]

    # New data under the same name: a new version, the newest.
    s3_server.client().upload_file(
        write(tmp_path / "qa2.parquet", qa_rows(80)), s3_server.bucket, source.split("/", 3)[3]
    )
    newer = run_prepare(
        tmp_path, base_model, source, out=s3_server.uri(f"ingest/{tmp_path.name}/run4"), datasets_root=root, **QA
    )
    listed = [v["version"] for v in versions.listing(root, "qa")["versions"]]
    assert listed == [info["version"], sft_only["dataset_version"]["version"], newer["dataset_version"]["version"]]

    nightly = run_prepare(
        tmp_path, base_model, "dataset:qa", out=s3_server.uri(f"ingest/{tmp_path.name}/run5"), datasets_root=root
    )
    assert nightly["dataset_version"] == newer["dataset_version"]
    assert nightly["metrics"]["rows_sft"] == newer["metrics"]["rows_sft"]
    assert split_rows(nightly["uri"], "sft") == split_rows(newer["uri"], "sft")
    pinned = run_prepare(
        tmp_path,
        base_model,
        f"dataset:qa@{info['version']}",
        out=s3_server.uri(f"ingest/{tmp_path.name}/run6"),
        datasets_root=root,
    )
    assert pinned["dataset_version"]["version"] == info["version"]

    with pytest.raises(
        ConfigError, match=f"^source: no version 'nope' of dataset 'qa' under {root}; registered: {listed[0]}"
    ):
        run_prepare(
            tmp_path,
            base_model,
            "dataset:qa@nope",
            out=s3_server.uri(f"ingest/{tmp_path.name}/run7"),
            datasets_root=root,
        )
    with pytest.raises(ConfigError, match=f"^source: no dataset 'other' registered under {root}; ingest a file first"):
        run_prepare(
            tmp_path, base_model, "dataset:other", out=s3_server.uri(f"ingest/{tmp_path.name}/run7"), datasets_root=root
        )


def test_a_stricter_threshold_than_a_version_passed_still_fails(tmp_path, base_model):
    source, _ = bad_rows_file(tmp_path)
    flags = {"label_key": "label", "eval_fraction": 0.3, "max_chars": 100}
    run_prepare(tmp_path, base_model, source, max_bad_fraction=0.5, **flags)
    with pytest.raises(ConfigError, match="^max_bad_fraction: 9 of 50 rows"):
        run_prepare(tmp_path, base_model, source, out=str(tmp_path / "out2"), max_bad_fraction=0.1, **flags)


# ----------------------------------------------------------------------------- downstream


def test_the_downstream_loader_reads_the_canonical_splits(tmp_path, base_model, s3_server):
    root = s3_server.uri(f"ingest/{tmp_path.name}/datasets")
    out = s3_server.uri(f"ingest/{tmp_path.name}/prepare_data")
    m = run_prepare(
        tmp_path,
        base_model,
        write(tmp_path / "chat.jsonl", chat_rows(48)),
        out=out,
        datasets_root=root,
        messages_key="messages",
        label_key="label",
        max_bad_fraction=1.0,
    )
    # What sft, reward_model, dpo, kto, rl and eval load, with the keys they ask for (their defaults).
    wanted = {
        "sft": ["prompt", "response"],
        "preference": ["prompt", "chosen", "rejected"],
        "preference_eval": ["prompt", "chosen", "rejected"],
        "style_pairs": ["prompt", "chosen", "rejected"],
        "unpaired": ["prompt", "completion", "label"],
        "prompts": ["prompt"],
        "eval": ["prompt", "label"],
    }
    for split, keys in wanted.items():
        rows = data.load_rows(out, split, keys)
        assert len(rows) == m["metrics"][f"rows_{split}"] > 0, split
    chats = data.load_rows(out, "eval", ["prompt", "label"])
    assert chats[0]["prompt"][-1]["role"] == "user" and isinstance(chats[0]["label"], str)
    assert data.load_rows(out, "unpaired", ["label"]).features["label"].dtype == "bool"
    # A version is read like a stage output too.
    assert len(data.load_rows(m["dataset_version"]["uri"], "sft", ["prompt", "response"])) == m["metrics"]["rows_sft"]


def test_the_pipeline_flags_parse_in_every_stage_config():
    """The flags the DAG passes (rendered with the run form's defaults) are fields of each stage's config."""
    import jinja2
    from airflow.sdk.definitions.xcom_arg import XComArg

    from plugins.form import DEFAULTS
    from plugins.pipeline import build_pipeline, fail_after, fixed_data
    from plugins.stage_cli import render_flags
    from tasks.common.stages import STAGES

    configs = {s.package: s.config_class() for s in STAGES.values() if s.name != "promote"}
    dag = build_pipeline("ingest_flags", None, "", allow_promotion=False)
    env = jinja2.Environment()
    upstream = "s3://b/p/runs/d/r/stage/manifest.json"
    context = {
        "params": {**DEFAULTS, "bucket": "b"},
        "fail_after": fail_after,
        "fixed_data": fixed_data,
        "ti": type("TI", (), {"xcom_pull": lambda self, task_ids: upstream})(),
        "conn": {},
        "dag": dag,
        "run_id": "r",
    }
    for task in dag.tasks:
        if getattr(task, "module", None) not in configs:
            continue
        args = {
            k: env.from_string(v).render(context) if isinstance(v, str) else upstream if isinstance(v, XComArg) else v
            for k, v in task.args.items()
        }
        cfg = parse_config(configs[task.module], ["--output", "s3://b/out", *render_flags(args)])
        if task.module != "tasks.data":
            assert cfg.apply_chat_template is False, task.task_id
        if task.module not in ("tasks.data", "tasks.eval"):
            assert cfg.lora_rank == 0, task.task_id
    assert env.from_string(dag.get_task("prepare_data").cache).render(context) == "True"
    for dataset, cached in (("s3://b/raw/qa.jsonl", "False"), ("dataset:qa", "False"), ("dataset:qa@0123abcd", "True")):
        assert (
            env.from_string(dag.get_task("prepare_data").cache).render(
                {**context, "params": {**context["params"], "dataset": dataset}}
            )
            == cached
        )
