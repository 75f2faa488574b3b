"""Bring your own data, end to end: a team's chat dataset and chat model through the whole DAG.

A small user-style dataset (tests/tiny_chat.py chat_rows: a `messages` column of system + user + assistant
turns, `chosen` / `rejected` answers, a `label` and an unmapped `id`; about 200 rows, see team_rows) is
uploaded as JSONL to the S3 emulator beside a tiny chat model (a character tokenizer with a chat template, a
random-weight Llama), uploaded as a plain transformers folder. The rlhf_pipeline DAG runs
in this process with dag.test() against the session's Ray head, as tests/unit/plugins/test_pipeline.py's end-to-end
test does, with the run form set the way a team would set it for such data: the dataset and base model URIs, the
column mapping, apply_chat_template, LoRA, method rl with a group estimator, tiny step counts.

Checked: prepare_data validated the rows (the rows exported twice counted as duplicates and left out), registered
the data as a version under <prefix>/datasets/<name>/<version>/ and listed it; SFT, the reward model and RL
trained LoRA adapters with the chat template (their configs and manifests say so, each adapter names the
output it sits on, and RL placed no reference model); the exports load with plain transformers: the RL
policy (merged through tasks.common.nn.models.resolve_model) generates from a chat-templated prompt, and the
reward model loads as AutoModelForSequenceClassification(num_labels=1), with its trained head and reward
statistics, and scores a templated conversation. About 100 s on 2 CPU cores (the DAG run: about 85 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.tiny_chat import CHAT_TEMPLATE, build_chat_model, chat_rows

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DAGS = REPO / "dags"
DATASET = "support-chat"  # the file's name: what prepare_data registers the data under
SYSTEMS = ("Add.", "Add the two numbers.")
REPEATED = (0, 7, 21)  # rows the team's export holds twice
LORA_RANK = 4
TRAINED = ("sft", "reward_model", "rl")


def team_rows() -> list[dict]:
    """chat_rows as a team's export: the sums under two system prompts, each conversation once, and a few rows
    exported twice. Big enough for the DAG's fixed batch sizes (128 SFT rows, 128 pairs, 128 RL prompts a
    step: the run form has no batch-size fields), so about 200 rows, not a few dozen."""
    rows, seen = [], set()
    for seed, system in enumerate(SYSTEMS):
        for row in chat_rows(400, seed=seed):  # 400 draws of 100 sums: nearly every sum
            row["messages"][0]["content"] = system
            key = json.dumps(row["messages"])
            if key not in seen:
                seen.add(key)
                rows.append(row)
    rows += [json.loads(json.dumps(rows[i])) for i in REPEATED]
    for i, row in enumerate(rows):
        row["id"] = i  # not a mapped column: the repeats are still exact duplicates
    return rows


@pytest.fixture(scope="module")
def byo_run(s3_server, ray_head, tmp_path_factory):
    """Upload the model and the data, run the DAG once; yields what the tests read."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    from plugins.stage_cli import key_safe

    root = tmp_path_factory.mktemp("byo")
    saved = os.environ.get("RLHF_CACHE_DIR")
    os.environ["RLHF_CACHE_DIR"] = str(root / "cache")  # this process's fetches of the outputs

    subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True, env=os.environ.copy()
    )
    s3, bucket = s3_server.client(), s3_server.bucket
    prefix = f"byo-{uuid.uuid4().hex[:8]}"  # a fresh prefix: no cached stage or earlier version is reused

    model_dir = Path(build_chat_model(root / "tiny-chat"))
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        s3.upload_file(str(path), bucket, f"{prefix}/base-models/tiny-chat/{path.relative_to(model_dir)}")
    rows = team_rows()
    s3.put_object(
        Bucket=bucket, Key=f"{prefix}/raw/{DATASET}.jsonl", Body="".join(json.dumps(r) + "\n" for r in rows).encode()
    )

    conf = {
        "bucket": bucket,
        "prefix": prefix,
        "dataset": s3_server.uri(f"{prefix}/raw/{DATASET}.jsonl"),
        "base_model": s3_server.uri(f"{prefix}/base-models/tiny-chat"),
        "messages_key": "messages",
        "chosen_key": "chosen",
        "rejected_key": "rejected",
        "label_key": "label",
        "eval_fraction": 0.15,
        "max_bad_fraction": 0.05,  # the default: the repeats are fewer
        "apply_chat_template": True,
        "lora_rank": LORA_RANK,
        "method": "rl",
        "advantage_estimator": "group_norm",
        "n_samples_per_prompt": 2,
        "sft_steps": 4,
        "rm_steps": 4,
        "rl_steps": 2,
        "eval_max_samples": 8,
        "checkpoints_per_stage": 0,
        "use_cache": False,
        "model_name": "byo-policy",
    }
    dagbag = DagBag(dag_folder=str(DAGS))
    assert dagbag.import_errors == {}
    DagBundlesManager().sync_bundles_to_db()
    sync_bag_to_db(dagbag, "dags-folder", None)
    started = time.monotonic()
    dr = dagbag.dags["rlhf_pipeline"].test(run_conf=conf)
    print(f"byo: the DAG ran in {time.monotonic() - started:.0f}s")
    states = {ti.task_id: str(getattr(ti.state, "value", ti.state)) for ti in dr.get_task_instances()}
    base = f"s3://{bucket}/{prefix}/runs/rlhf_pipeline/{key_safe(dr.run_id)}"
    yield {
        "conf": conf,
        "rows": rows,
        "states": states,
        "prefix": prefix,
        "root": root,
        "uris": {stage: f"{base}/{stage}/manifest.json" for stage in ("prepare_data", *TRAINED, "eval", "promote")},
    }
    if saved is None:
        os.environ.pop("RLHF_CACHE_DIR", None)
    else:
        os.environ["RLHF_CACHE_DIR"] = saved


@pytest.fixture(scope="module")
def manifest_of(byo_run):
    from tasks.common import manifest as manifests

    return {
        stage: manifests.read_manifest(uri)
        for stage, uri in byo_run["uris"].items()
        if byo_run["states"].get(stage) == "success"
    }


@pytest.mark.slow  # make test-all: the team's own data down the whole DAG (dag.test, 150 s)
def test_the_run_succeeds_down_the_rl_branch(byo_run):
    assert byo_run["states"] == {
        "validate": "success",
        "prepare_data": "success",
        "sft": "success",
        "choose_method": "success",
        "reward_model": "success",
        "rl": "success",
        "dpo": "skipped",
        "kto": "skipped",
        "eval": "success",
        "promote": "success",
        "champion": "skipped",
    }, byo_run["states"]


@pytest.mark.slow  # make test-all: the team's own data down the whole DAG (dag.test, 150 s)
def test_prepare_data_validated_and_registered_the_dataset_version(byo_run, manifest_of):
    from tasks.common import manifest as manifests
    from tasks.data import versions

    conf, rows = byo_run["conf"], byo_run["rows"]
    m = manifest_of["prepare_data"]
    root = f"s3://{conf['bucket']}/{byo_run['prefix']}/datasets"
    info = m["dataset_version"]
    assert info["name"] == DATASET and info["source"] == conf["dataset"]
    assert info["uri"] == f"{root}/{DATASET}/{info['version']}" and m["inputs"]["dataset"] == info["uri"]
    assert info["mapping"] == {
        "input_key": "",
        "output_key": "",
        "messages_key": "messages",
        "chosen_key": "chosen",
        "rejected_key": "rejected",
        "label_key": "label",
    }
    # The base model is passed on by reference: the next stages load it from where the team put it.
    assert m["model"] == conf["base_model"]

    # Validation: every row read, the repeats counted under `duplicate` (by row number, 1-based) and left out.
    summary = m["validation"]
    repeats = [len(rows) - len(REPEATED) + 1 + k for k in range(len(REPEATED))]
    assert (
        summary["rows"] == len(rows)
        and summary["kept"] == len(rows) - len(REPEATED)
        and summary["bad"] == len(REPEATED)
    )
    assert summary["checks"] == {"duplicate": {"count": len(REPEATED), "rows": repeats, "fields": {}}}
    assert summary["unlabelled"] == 0
    assert m["metrics"]["rows_read"] == len(rows) and m["metrics"]["rows_bad"] == len(REPEATED)

    # The registered version: its manifest, row counts and listing; the stage output holds the same splits.
    version = manifests.read_manifest(info["uri"])
    counts = version["dataset"]["rows"]
    assert (
        set(counts)
        == set(m["datasets"])
        == {"sft", "preference", "style_pairs", "unpaired", "preference_eval", "prompts", "eval"}
    )
    assert counts == {split: m["metrics"][f"rows_{split}"] for split in counts}
    assert counts["sft"] + counts["preference_eval"] == summary["kept"] and counts["preference"] == counts["sft"] > 0
    assert counts["unpaired"] == 2 * counts["preference"] and counts["eval"] > 0 and counts["prompts"] > 0
    assert version["dataset"]["split"]["eval_fraction"] == conf["eval_fraction"]
    assert version["validation"] == summary
    assert [v["version"] for v in versions.listing(root, DATASET)["versions"]] == [info["version"]]


@pytest.mark.slow  # make test-all: the team's own data down the whole DAG (dag.test, 150 s)
def test_the_training_stages_trained_lora_adapters_with_the_chat_template(byo_run, manifest_of):
    uris = byo_run["uris"]
    # Each adapter names the output it sits on: SFT the base model (through prepare_data), RM and RL the SFT adapter.
    bases = {"sft": uris["prepare_data"], "reward_model": uris["sft"], "rl": uris["sft"]}
    for stage in TRAINED:
        m = manifest_of[stage]
        assert m["config"]["apply_chat_template"] is True and m["config"]["lora_rank"] == LORA_RANK, stage
        assert m["config"]["merge_lora"] is False, stage
        assert m["base_model"] == bases[stage], stage
        assert m["inputs"]["pretrain"] == uris["prepare_data" if stage == "sft" else "sft"], stage
        model_files = {rel.split("/", 1)[1] for rel in m["files"] if rel.startswith("model/")}
        assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= model_files, stage
        assert "model.safetensors" not in model_files, stage  # the adapter alone, not a full checkpoint
    for stage in ("sft", "reward_model"):
        assert 0 < manifest_of[stage]["metrics"]["trainable_params"], stage
    # The reward model's normalisation statistics travel with its adapter, into the merged config.
    assert set(manifest_of["reward_model"]["model_config"]) == {"reward_mean", "reward_std"}

    rl = manifest_of["rl"]
    assert rl["config"]["advantage_estimator"] == "group_norm" and rl["config"]["n_samples_per_prompt"] == 2
    assert rl["metrics"]["steps"] == 2
    assert rl["metrics"]["ref_workers"] == 0  # LoRA: the reference is the actor with its adapters off
    assert (
        rl["inputs"]["reward_pretrain"] == uris["reward_model"] and rl["inputs"]["prompt_data"] == uris["prepare_data"]
    )
    assert "critic_pretrain" not in rl["inputs"]  # a group estimator: no critic

    evaluated = manifest_of["eval"]
    assert evaluated["config"]["apply_chat_template"] is True
    assert (
        evaluated["inputs"]["policy"] == uris["rl"] and evaluated["inputs"]["reward_pretrain"] == uris["reward_model"]
    )


@pytest.mark.slow  # make test-all: the team's own data down the whole DAG (dag.test, 150 s)
def test_the_rl_policy_loads_with_transformers_and_answers_a_chat(byo_run, manifest_of):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.common.nn.data import encode_prompt
    from tasks.common.nn.models import resolve_model

    path = resolve_model(byo_run["uris"]["rl"])  # the adapter merged into its base, a plain checkpoint
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= set(os.listdir(path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert tokenizer.chat_template == CHAT_TEMPLATE and model.config.vocab_size == len(tokenizer)

    messages = byo_run["rows"][0]["messages"][:-1]  # system + user: what the assistant answers
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == f"<bos><|system|>{SYSTEMS[0]}<|end|><|user|>{messages[1]['content']}<|end|><|assistant|>"
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    ids = inputs["input_ids"]
    assert ids[0].tolist() == encode_prompt(tokenizer, messages, True)  # the prompt as the stages rendered it
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert ids.shape[1] < out.shape[1] <= ids.shape[1] + 4
    assert isinstance(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True), str)

    # Trained: the policy is not the base model it started from (SFT's and RL's adapters are in its weights).
    base = AutoModelForCausalLM.from_pretrained(str(byo_run["root"] / "tiny-chat")).state_dict()
    merged = model.state_dict()
    assert set(base) == set(merged)
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.endswith("_proj.weight") for k in changed)


@pytest.mark.slow  # make test-all: the team's own data down the whole DAG (dag.test, 150 s)
def test_the_reward_model_loads_as_a_sequence_classifier(byo_run, manifest_of):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tasks.common import manifest as manifests
    from tasks.common.nn.models import resolve_model

    path = resolve_model(byo_run["uris"]["reward_model"])
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    stats = manifest_of["reward_model"]["metrics"]
    assert model.config.num_labels == 1 and model.score.weight.shape[0] == 1
    assert (model.config.reward_mean, model.config.reward_std) == (stats["reward_mean"], stats["reward_std"])
    # The head is the one the stage trained (exported beside the adapter), not a freshly initialised one.
    adapter_dir, _ = manifests.fetch(byo_run["uris"]["reward_model"], byo_run["root"] / "rm-adapter", subdir="model")
    trained_head = load_file(adapter_dir / "adapter_model.safetensors")["base_model.model.score.weight"]
    assert torch.equal(model.score.weight, trained_head)
    row = byo_run["rows"][0]
    scores = []
    for answer in (row["chosen"], row["rejected"]):
        conversation = row["messages"][:-1] + [{"role": "assistant", "content": answer}]
        inputs = tokenizer.apply_chat_template(conversation, return_dict=True, return_tensors="pt")
        with torch.no_grad():
            logits = model(**inputs).logits
        assert logits.shape == (1, 1) and torch.isfinite(logits).all()
        scores.append(logits.item())
    assert scores[0] != scores[1]


def test_a_plain_model_folder_on_s3_resolves_to_a_local_copy(s3_server, tmp_path, monkeypatch):
    """What a team uploads is a transformers folder, no manifest: resolve_model downloads it once per node, and
    fetches it anew when what is under the URI changes."""
    from transformers import AutoConfig

    from tasks.common.nn.models import resolve_model

    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))
    s3, prefix = s3_server.client(), f"byo-folder-{uuid.uuid4().hex[:8]}/model"
    model_dir = Path(build_chat_model(tmp_path / "model"))
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        s3.upload_file(str(path), s3_server.bucket, f"{prefix}/{path.relative_to(model_dir)}")
    uri = s3_server.uri(prefix)
    first = resolve_model(uri)
    assert sorted(os.listdir(first)) == sorted(os.listdir(model_dir)) and resolve_model(uri + "/") == first
    config = json.loads((model_dir / "config.json").read_text())
    s3.put_object(
        Bucket=s3_server.bucket, Key=f"{prefix}/config.json", Body=json.dumps({**config, "rms_norm_eps": 1e-5}).encode()
    )
    second = resolve_model(uri)
    assert second != first and AutoConfig.from_pretrained(second).rms_norm_eps == 1e-5
    # Not a model folder (no config.json, no manifest): the stage-output error, as before.
    with pytest.raises(Exception, match="no manifest.json at"):
        resolve_model(s3_server.uri(f"{prefix}-missing"))


@pytest.mark.slow  # make test-all: the team's own data down the whole DAG (dag.test, 150 s)
def test_the_evaluation_scores_the_teams_data_with_intervals_and_the_default_gate_reads_them(byo_run):
    """Not the demo's regex: the team's labels get the built-in exact_match (no metric declared), every number an
    interval, the reward model a win rate; promote's default gate is made from those declared metrics."""
    from tasks.common import manifest as manifests
    from tasks.common import storage

    uris = byo_run["uris"]
    report = storage.read_json(manifests.resolve(manifests.read_manifest(uris["eval"]), "report"))
    assert report["declared_metrics"] == ["exact_match", "sampled_exact_match"]
    assert (
        "accuracy" not in report["metrics"]["policy"]
        and "sampled_preferred_style_rate" not in report["metrics"]["policy"]
    )
    for side in ("baseline", "policy"):
        for metric in ("exact_match", "sampled_exact_match", "reward_mean", "kl_to_ref"):
            value, (lo, hi) = report["metrics"][side][metric], report["intervals"][side][metric]
            assert lo <= value <= hi, (side, metric)
    assert set(report["comparisons"]["baseline"]) >= {"exact_match", "reward_mean"}
    judged = report["win_rates"]["baseline"]["reward_model"]
    assert judged["wins"] + judged["ties"] + judged["losses"] == report["num_prompts"]
    decision = storage.read_json(uris["promote"].replace("manifest.json", "decision.json"))
    assert decision["reasons"][0].startswith("pass: exact_match drop") or decision["reasons"][0].startswith(
        "FAIL: exact_match drop"
    )
    assert any("kl_to_ref" in r for r in decision["reasons"]) and "gained" in decision["reasons"][-1]
