"""The pipeline's validate refuses a text base model with an image dataset (issue 54), deciding both from files the
Airflow side reads without torch (plugins/modality.py): a model's config.json, a dataset's first rows or header, a
registered version's manifest; on local disk and on S3 (moto over real HTTP)."""

import json

import pytest

from plugins.modality import (
    csv_has_images,
    dataset_has_images,
    jsonl_has_images,
    modality_problems,
    model_takes_images,
    run_problems,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A text model and a vision-language one, as saved folders (the demo's, built offline)."""
    from tasks.data import demo, demo_vlm

    root = tmp_path_factory.mktemp("models")
    demo.build_base_model(demo.build_tokenizer()).save_pretrained(root / "text")
    demo_vlm.save_demo_vlm(root / "vlm")
    return {"text": str(root / "text"), "vlm": str(root / "vlm")}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_models_kind_is_read_from_its_config_and_a_datasets_from_its_rows(models, tmp_path):
    def read_json(uri):
        try:
            return json.loads(open(uri).read())
        except OSError:
            return None

    def read_head(uri, n):
        data = open(uri, "rb").read()
        return data[:n], len(data) <= n

    assert model_takes_images(models["vlm"], "x.jsonl", read_json) is True
    assert model_takes_images(models["text"], "x.jsonl", read_json) is False
    assert model_takes_images("demo", "demo_vlm", read_json) is True  # prepare_data builds the demo's Qwen2-VL
    assert model_takes_images("demo", "demo", read_json) is False
    assert model_takes_images("Qwen/Qwen2-VL-2B-Instruct", "demo", read_json) is None  # a hub id: not known here
    assert model_takes_images(str(tmp_path / "nowhere"), "demo", read_json) is None
    # A stage output's manifest names its model folder.
    (tmp_path / "stage").mkdir()
    (tmp_path / "stage" / "manifest.json").write_text(json.dumps({"model": models["vlm"]}))
    assert model_takes_images(str(tmp_path / "stage" / "manifest.json"), "demo", read_json) is True

    images = write_rows(tmp_path / "img.jsonl", [{"prompt": "hi"}, {"prompt": "<image>?", "images": ["iVBOR"]}])
    text = write_rows(tmp_path / "text.jsonl", [{"prompt": "hi", "images": []}, {"prompt": "1+1="}])
    (tmp_path / "t.csv").write_text("prompt,chosen,pictures\n<image>a,b,x.png\n")
    has = lambda ds, key="images": dataset_has_images(ds, key, read_head, read_json, str(tmp_path / "datasets"))  # noqa: E731
    assert (has(images), has(text), has(images, ""), has("demo_vlm"), has("demo")) == (True, False, False, True, False)
    assert (has(str(tmp_path / "t.csv"), "pictures"), has(str(tmp_path / "t.csv"))) == (True, False)
    assert has("s3://b/d.parquet") is None and has("org/hub-dataset") is None
    # A JSONL file read in part: no image in the part read is not known, not text.
    assert jsonl_has_images(b'{"prompt": "a"}\n{"prompt": "b", "ima', "images", whole=False) is None
    assert jsonl_has_images(b'{"prompt": "a"}\n{"images": ["x"]}\n{"pro', "images", whole=False) is True
    assert csv_has_images(b'"prompt","images"\r\n', "images")
    # A registered version: its manifest counted the images; without @version, the listing's newest.
    version = tmp_path / "datasets" / "chats" / "v2"
    version.mkdir(parents=True)
    (version / "manifest.json").write_text(json.dumps({"dataset": {"images": {"image_key": "images", "count": 3}}}))
    (version.parent / "versions.json").write_text(json.dumps({"versions": [{"version": "v1"}, {"version": "v2"}]}))
    assert has("dataset:chats@v2") is True and has("dataset:chats") is True and has("dataset:other") is None


def test_a_text_model_with_images_is_refused_in_one_line_and_a_vlm_with_text_is_not():
    params = {"base_model": "s3://b/m/", "dataset": "s3://b/d.jsonl", "image_key": "images"}
    (line,) = modality_problems(params, takes_images=False, has_images=True)
    assert line.startswith("base_model: s3://b/m/ is a text model (its config.json has no vision_config)")
    assert "'images' column" in line and line.endswith("or a dataset without images")
    assert modality_problems(params, takes_images=True, has_images=False) == []  # a VLM is a language model too
    assert modality_problems(params, takes_images=None, has_images=True) == []  # the stage decides
    (line,) = modality_problems({**params, "freeze_visual_encoder": True}, takes_images=False, has_images=False)
    assert line.startswith("freeze_visual_encoder: s3://b/m/ is a text model, with no vision tower to freeze")


def test_validate_reads_the_runs_model_and_data_on_s3(models, s3_server, monkeypatch):
    """run_problems, as the validate task calls it: the config.json and the file's first bytes through the rlhf_s3
    connection (one ranged GET each), the registered version's manifest under the datasets root."""
    from pathlib import Path

    from plugins.s3 import S3Store
    from tools.stack.config import conn_s3

    monkeypatch.setenv("AIRFLOW_CONN_RLHF_S3", conn_s3(s3_server.endpoint))
    client, bucket = s3_server.client(), s3_server.bucket
    for kind in ("text", "vlm"):
        client.put_object(
            Bucket=bucket, Key=f"m/{kind}/config.json", Body=(Path(models[kind]) / "config.json").read_bytes()
        )
    row = json.dumps({"prompt": "<image>colour?", "images": ["iVBORw0KGgo="], "chosen": "r", "rejected": "g"})
    client.put_object(Bucket=bucket, Key="d/img.jsonl", Body=(row + "\n").encode() * 20000)  # over HEAD_BYTES
    store = S3Store("rlhf_s3")
    run = lambda model, data, **extra: run_problems(  # noqa: E731
        {"base_model": f"s3://{bucket}/m/{model}/", "dataset": data, "image_key": "images", **extra},
        store,
        f"s3://{bucket}/datasets",
    )
    (line,) = run("text", f"s3://{bucket}/d/img.jsonl")
    assert line.startswith(f"base_model: s3://{bucket}/m/text/ is a text model")
    assert run("vlm", f"s3://{bucket}/d/img.jsonl") == [] and run("vlm", "demo") == []
    assert run("text", "demo") == [] and run("text", f"s3://{bucket}/d/missing.jsonl") == []  # missing: named elsewhere
    assert [p.split(":")[0] for p in run("text", "demo_vlm", freeze_visual_encoder=True)] == [
        "base_model",
        "freeze_visual_encoder",
    ]
