"""Whether a run's base model takes images and whether its dataset has them, found on the Airflow side without torch
(issue 54), so the pipeline's `validate` refuses a pairing the stages would train wrongly before any Ray job.

    takes = model_takes_images("s3://b/models/qwen2-vl/", "demo", read_json)       # True, False, or None: not known here
    has = dataset_has_images("s3://b/data/chat.jsonl", "images", read_head, read_json, datasets_root)
    modality_problems(params, takes, has)    # ["base_model: … is a text model …; pick …"] or []
    run_problems(params, S3Store(), datasets_root)   # all three for a run's Params, reading S3 and local files

A model takes images when its config.json has a `vision_config` (transformers' VLMs; tasks.common.nn.models reads
it the same way). A dataset has images when its rows carry the image column (prepare_data's --image_key): the
built-in demo_vlm; a JSONL file whose first rows or a CSV file whose header has it; a registered version whose
manifest counted images. What cannot be read here (a hub id, a path only the Ray nodes see, a Parquet file) is None,
and the stage decides when it loads the model (the reward model and DPO/KTO refuse a text model with image rows).

A text model with an image dataset is refused: it would train on the prompts' text alone and never see the images.
A vision-language model on a text dataset is fine: it is a language model too, and its rows simply have no images.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Callable

#: The built-in tasks (tasks/data/config.py BUILT_IN_SOURCES) and whether their rows have images; with
#: base_model 'demo', prepare_data builds the tiny model that fits them (demo_vlm: a Qwen2-VL).
BUILT_IN_IMAGES = {"demo": False, "calculator": False, "guess": False, "demo_vlm": True}
#: How much of a file validate reads to find its columns.
HEAD_BYTES = 1 << 20
DATASET_PREFIX = "dataset:"


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def is_vision_config(config: dict) -> bool:
    return bool(config.get("vision_config"))


def model_takes_images(base_model: str, dataset: str, read_json: Callable[[str], dict | None]) -> bool | None:
    """True for a vision-language model, False for a text one, None when its config cannot be read here (a hub id,
    a path the Airflow side does not see). `read_json(uri)`: the JSON at an s3:// URI or local path, None if absent."""
    if base_model == "demo":
        return BUILT_IN_IMAGES.get(dataset, False)
    if not base_model.startswith(("s3://", "/", "./", "file://")):
        return None  # a hub id
    uri = base_model.removeprefix("file://")
    if uri.endswith("manifest.json"):  # a stage output: its model folder
        manifest = read_json(uri) or {}
        ref = manifest.get("model") or ""
        if not ref:
            return None
        uri = ref if "://" in ref or ref.startswith("/") else join(uri.rsplit("/", 1)[0], ref)
    config = read_json(join(uri, "config.json"))
    return None if config is None else is_vision_config(config)


def jsonl_has_images(head: bytes, image_key: str, whole: bool) -> bool | None:
    """Whether any row of a JSONL file's first bytes has a non-empty `image_key`; None when none does and the
    file goes on past `head` (`whole`: head is the whole file)."""
    lines = head.split(b"\n")
    if not whole:
        lines = lines[:-1]  # cut mid-row
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # prepare_data counts it as a bad row
        if isinstance(row, dict) and row.get(image_key):
            return True
    return False if whole else None


def csv_has_images(head: bytes, image_key: str) -> bool:
    header = next(csv.reader(io.StringIO(head.decode("utf-8", "replace").split("\n", 1)[0])), [])
    return image_key in header


def dataset_has_images(
    dataset: str,
    image_key: str,
    read_head: Callable[[str, int], tuple[bytes, bool] | None],
    read_json: Callable[[str], dict | None],
    datasets_root: str,
) -> bool | None:
    """True when the dataset's rows have images, False when they have none, None when that cannot be told here.
    `read_head(uri, n)`: (the first n bytes, whether that is the whole file), None if absent."""
    if not image_key:
        return False  # prepare_data reads no image column
    if dataset in BUILT_IN_IMAGES:
        return BUILT_IN_IMAGES[dataset]
    if dataset.startswith(DATASET_PREFIX):
        name, _, version = dataset.removeprefix(DATASET_PREFIX).partition("@")
        if not version:  # the newest: the listing's last
            listed = (read_json(join(datasets_root, name, "versions.json")) or {}).get("versions") or []
            version = listed[-1].get("version", "") if listed else ""
        manifest = read_json(join(datasets_root, name, version, "manifest.json")) if version else None
        return None if manifest is None else bool((manifest.get("dataset") or {}).get("images"))
    kind = dataset.lower().rsplit(".", 1)[-1]
    if kind not in ("jsonl", "json", "csv") or not dataset.startswith(("s3://", "/", "./", "file://")):
        return None  # Parquet (its columns sit at its end) or a hub dataset
    found = read_head(dataset.removeprefix("file://"), HEAD_BYTES)
    if found is None:
        return None
    head, whole = found
    return csv_has_images(head, image_key) if kind == "csv" else jsonl_has_images(head, image_key, whole)


def modality_problems(params: dict, takes_images: bool | None, has_images: bool | None) -> list[str]:
    """One line per field whose value does not fit the other's: a text model with an image dataset, or with
    freeze_visual_encoder on. A vision-language model with a text dataset is fine."""
    model, problems = params["base_model"], []
    if takes_images is False and has_images:
        problems.append(
            f"base_model: {model} is a text model (its config.json has no vision_config) and the dataset "
            f"{params['dataset']} has images in its {params.get('image_key')!r} column, which it would never see; "
            "pick a vision-language base model (for the built-in images: base_model demo with dataset demo_vlm) "
            "or a dataset without images"
        )
    if takes_images is False and params.get("freeze_visual_encoder"):
        problems.append(
            f"freeze_visual_encoder: {model} is a text model, with no vision tower to freeze; "
            "turn freeze_visual_encoder off or pick a vision-language base model"
        )
    return problems


def run_problems(params: dict, store, datasets_root: str) -> list[str]:
    """modality_problems of a run's Params (filled: plugins.operators.fill_empty), its s3:// inputs read through
    `store` (a plugins.s3.S3Store) and its local ones where the Airflow side sees them. An input that cannot be
    read counts as not known: missing ones are named by the pipeline's own check (pipeline.missing_inputs)."""
    from pathlib import Path

    from plugins.s3 import S3Error

    def read_head(uri: str, size: int) -> tuple[bytes, bool] | None:
        if uri.startswith("s3://"):
            try:
                return store.read_head(uri, size)
            except S3Error:
                return None
        path = Path(uri)
        if not path.is_file():
            return None
        with open(path, "rb") as f:
            head = f.read(size)
        return head, path.stat().st_size <= size

    def read_json(uri: str) -> dict | None:
        found = read_head(uri, 64 << 20)  # a config or manifest: small
        try:
            return json.loads(found[0]) if found else None
        except ValueError:
            return None

    takes = model_takes_images(params["base_model"], params["dataset"], read_json)
    has = dataset_has_images(params["dataset"], params.get("image_key") or "", read_head, read_json, datasets_root)
    return modality_problems(params, takes, has)
