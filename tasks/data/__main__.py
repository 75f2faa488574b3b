"""prepare_data: write the pipeline's datasets (and the demo's base model) as one stage output.

    python -m tasks.data --output s3://bucket/prefix/runs/<dag>/<run>/prepare_data --source demo --seed 0
    python -m tasks.data --output … --source calculator      # an agentic task (tasks/data/agentic.py), for --env_path
    python -m tasks.data --output … --source demo_vlm        # the vision-language demo (tasks/data/demo_vlm.py)
    python -m tasks.data --output … --source s3://bucket/raw/chat.jsonl --datasets_root s3://bucket/prefix/datasets \\
        --messages_key messages --label_key answer            # ingest: validate, split, register a version
    python -m tasks.data --output … --source dataset:chat --datasets_root s3://bucket/prefix/datasets   # the newest version

Output: data/<split>.jsonl for every split, model/ (tokenizer + random-weight tiny Llama) when
base_model is 'demo', and manifest.json listing `datasets` and `model`. A user's dataset is first
registered as an immutable version under --datasets_root (tasks/data/ingest.py); the output then holds a
verified copy of that version's splits, names it in `inputs.dataset` and `dataset_version`, and carries
its validation summary, so the next stages keep taking `--dataset <this output>`.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

from tasks.common import manifest as manifests
from tasks.common import storage
from tasks.common.config import ConfigError
from tasks.common.stage import StageRun, main
from tasks.data import agentic, demo, demo_vlm, ingest, versions
from tasks.data.config import BUILT_IN_SOURCES, PrepareDataConfig, parse_dataset_ref, source_kind


def check_base_model(uri: str) -> None:
    """Fail here, before any training, when the base model named cannot be loaded by the next stages."""
    if storage.is_s3(uri) or uri.startswith(("/", "./", "file://")):
        if not storage.exists(storage.join(uri, "config.json")):
            raise ConfigError(f"base_model: no model at {uri} (no config.json there): fix the URI or upload the model")
    elif os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ConfigError(
            f"base_model: {uri!r} is a hub id, and HF_HUB_OFFLINE=1 forbids fetching it: pass a model URI"
        )


def demo_splits(cfg: PrepareDataConfig, data_dir: Path) -> tuple[dict, dict]:
    """A built-in task's splits written under data_dir (the demo's, or an agentic task's); returns (datasets, metrics)."""
    splits = {
        "demo": demo.make_datasets,
        "calculator": agentic.calculator_datasets,
        "guess": agentic.guess_datasets,
        "demo_vlm": demo_vlm.make_datasets,
    }[cfg.source](seed=cfg.seed)
    for name, rows in splits.items():
        with open(data_dir / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"{name}: {len(rows)} rows", flush=True)
    metrics = {f"rows_{name}": len(rows) for name, rows in splits.items()}
    if cfg.source == "demo":
        metrics["sft_terse_fraction"] = round(
            sum(row["style"] == demo.TERSE for row in splits["sft"]) / len(splits["sft"]), 4
        )
    return {name: f"data/{name}.jsonl" for name in splits}, metrics


def build_demo_model(source: str, seed: int):
    """The tiny base model of a built-in task and its tokenizer (an agentic task's has its own characters, longer positions)."""
    if source == "demo":
        tokenizer = demo.build_tokenizer()
        return demo.build_base_model(tokenizer, seed=seed), tokenizer
    tokenizer = agentic.build_tokenizer()
    return demo.build_base_model(tokenizer, seed=seed, **agentic.BASE_MODEL), tokenizer


def save_tokenizer(tokenizer, folder: Path) -> None:
    """The tokenizer saved so that it adds its BOS itself, as every stage's exported tokenizer does
    (tasks.common.nn.models.load_tokenizer): the stages put the BOS before every prompt, so anyone loading
    this model/ with AutoTokenizer must get it too, or the base model sees text it was never given."""
    bos = tokenizer.bos_token_id
    if bos is not None and tokenizer("0")["input_ids"][:1] != [bos]:
        tokenizer.add_bos_token = True
    tokenizer.save_pretrained(folder)


def dataset_version(cfg: PrepareDataConfig) -> dict:
    """The manifest of the registered version the source names: ingested now, or resolved."""
    if source_kind(cfg.source) == "dataset":
        version = versions.resolve(cfg.datasets_root, *parse_dataset_ref(cfg.source))
        print(f"{cfg.source}: version {version['dataset']['version']} at {version['uri']}", flush=True)
        return version
    scratch = Path(tempfile.mkdtemp(prefix="rlhf-ingest-"))  # not the stage's workdir: that is uploaded
    try:
        return ingest.ingest(cfg, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def version_splits(version: dict, data_dir: Path) -> tuple[dict, dict]:
    """A verified copy of the version's splits under data_dir; returns (datasets, metrics)."""
    local, _ = manifests.fetch(version["uri"], manifests.local_cache_dir(version["uri"]), subdir="data")
    datasets = {}
    for split, relative in version["datasets"].items():
        shutil.copyfile(local / Path(relative).name, data_dir / f"{split}.jsonl")
        datasets[split] = f"data/{split}.jsonl"
        print(f"{split}: {version['dataset']['rows'][split]} rows", flush=True)
    metrics = {
        **{f"rows_{split}": n for split, n in version["dataset"]["rows"].items()},
        "rows_read": version["validation"]["rows"],
        "rows_bad": version["validation"]["bad"],
    }
    return datasets, metrics


def prepare(cfg: PrepareDataConfig, run: StageRun) -> None:
    if cfg.base_model != "demo":
        check_base_model(cfg.base_model)
    data_dir = run.workdir / "data"
    data_dir.mkdir()
    extra = {}
    if cfg.source in BUILT_IN_SOURCES:
        datasets, metrics = demo_splits(cfg, data_dir)
    else:
        version = dataset_version(cfg)
        datasets, metrics = version_splits(version, data_dir)
        run.input("dataset", version["uri"])
        info = version["dataset"]
        extra = {
            "dataset_version": {
                "name": info["name"],
                "version": info["version"],
                "uri": version["uri"],
                "source": info["source"],
                "content_sha256": info["content_sha256"],
                "mapping": info["mapping"],
            },
            "validation": version["validation"],
        }

    if cfg.base_model == "demo" and cfg.source == "demo_vlm":
        demo_vlm.save_demo_vlm(run.workdir / "model", seed=cfg.seed)  # the model and its processor
        model_ref = "model"
    elif cfg.base_model == "demo":
        model, tokenizer = build_demo_model(cfg.source if cfg.source in BUILT_IN_SOURCES else "demo", cfg.seed)
        model.save_pretrained(run.workdir / "model")
        save_tokenizer(tokenizer, run.workdir / "model")
        model_ref = "model"
    else:
        model_ref = cfg.base_model
    run.commit(metrics=metrics, datasets=datasets, model=model_ref, **extra)


if __name__ == "__main__":
    main("prepare_data", PrepareDataConfig, prepare)
