"""prepare_data: write the pipeline's datasets (and the demo's base model) as one stage output.

    python -m tasks.data --output s3://bucket/prefix/runs/<dag>/<run>/prepare_data --source demo --seed 0

Output: data/<split>.jsonl for every split, model/ (tokenizer + random-weight tiny Llama) when
base_model is 'demo', and manifest.json listing `datasets` and `model`.
"""
import json
import os

from tasks.common import storage
from tasks.common.config import ConfigError
from tasks.common.stage import StageRun, main
from tasks.data import demo
from tasks.data.config import PrepareDataConfig


def check_base_model(uri: str) -> None:
    """Fail here, before any training, when the base model named cannot be loaded by the next stages."""
    if storage.is_s3(uri) or uri.startswith(("/", "./", "file://")):
        if not storage.exists(storage.join(uri, "config.json")):
            raise ConfigError(f"base_model: no model at {uri} (no config.json there): fix the URI or upload the model")
    elif os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ConfigError(f"base_model: {uri!r} is a hub id, and HF_HUB_OFFLINE=1 forbids fetching it: pass a model URI")


def prepare(cfg: PrepareDataConfig, run: StageRun) -> None:
    if cfg.base_model != "demo":
        check_base_model(cfg.base_model)
    splits = demo.make_datasets(cfg.seed)
    data_dir = run.workdir / "data"
    data_dir.mkdir()
    for name, rows in splits.items():
        with open(data_dir / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"{name}: {len(rows)} rows", flush=True)

    if cfg.base_model == "demo":
        tokenizer = demo.build_tokenizer()
        model = demo.build_base_model(tokenizer, seed=cfg.seed)
        model.save_pretrained(run.workdir / "model")
        tokenizer.save_pretrained(run.workdir / "model")
        model_ref = "model"
    else:
        model_ref = cfg.base_model
    terse = sum(row["style"] == demo.TERSE for row in splits["sft"]) / len(splits["sft"])
    run.commit(
        metrics={**{f"rows_{name}": len(rows) for name, rows in splits.items()}, "sft_terse_fraction": round(terse, 4)},
        datasets={name: f"data/{name}.jsonl" for name in splits},
        model=model_ref,
    )


if __name__ == "__main__":
    main("prepare_data", PrepareDataConfig, prepare)
