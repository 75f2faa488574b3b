"""prepare_data: write the pipeline's datasets (and the demo's base model) as one stage output.

    python -m tasks.data --output s3://bucket/prefix/runs/<dag>/<run>/prepare_data --source demo --seed 0

Output: data/<split>.jsonl for every split, model/ (tokenizer + random-weight tiny Llama) when
base_model is 'demo', and manifest.json listing `datasets` and `model`.
"""
import json

from tasks.common.stage import StageRun, main
from tasks.data import demo
from tasks.data.config import PrepareDataConfig


def prepare(cfg: PrepareDataConfig, run: StageRun) -> None:
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
