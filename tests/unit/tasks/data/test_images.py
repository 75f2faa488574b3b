"""Images in datasets (issue 54): prepare_data's image column in every form it takes, each bad image counted under
its check, the stored splits self-contained, and the demo VLM's generator. Real files and Pillow; CPU, seconds."""

from __future__ import annotations

import base64
import io
import shutil

import pytest
from PIL import Image

from tasks.common import manifest as manifests
from tasks.common.nn import models, vision
from tasks.common.nn.images import decode_image
from tasks.data import demo_vlm, images, ingest, mapping
from tasks.data.config import PrepareDataConfig

from tests.unit.tasks.data.test_ingest import base_model, run_prepare, split_rows, write  # noqa: F401 (base_model: a fixture)

SFT = {"output_key": "response", "chosen_key": "", "rejected_key": ""}


def picture(colour, size=(12, 10), fmt="PNG", **save) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format=fmt, **save)
    return out.getvalue()


def pixels(b64_or_image) -> list[tuple]:
    raw = decode_image(b64_or_image).convert("RGB").tobytes()
    return [tuple(raw[i : i + 3]) for i in range(0, len(raw), 3)]


def test_every_image_form_is_decoded_once_and_stored_as_png(tmp_path, base_model):  # noqa: F811
    (tmp_path / "data" / "pics").mkdir(parents=True)
    (tmp_path / "data" / "pics" / "red.png").write_bytes(picture("red"))
    (tmp_path / "data" / "blue.jpg").write_bytes(picture("blue", fmt="JPEG", quality=100))
    green = base64.b64encode(picture("green")).decode()
    forms = [
        ["pics/red.png"],  # a path relative to the dataset file
        ["blue.jpg"],
        [green],  # base64
        ["data:image/png;base64," + green],  # a data: URI
        "pics/red.png",  # one image, not in a list
    ]
    rows = [{"prompt": f"<image>colour {i}?", "response": "x", "images": f} for i, f in enumerate(forms)]
    rows.append({"prompt": "two: <image> and <image>", "response": "y", "images": ["pics/red.png", green]})
    rows += [{"prompt": f"text only {i}", "response": "z"} for i in range(4)]  # no images: a text row, kept
    source = write(tmp_path / "data" / "rows.jsonl", rows)
    manifest = run_prepare(tmp_path, base_model, source, eval_fraction=0.3, **SFT)
    assert manifest["validation"]["bad"] == 0 and manifest["validation"]["images"] == 7
    version = manifests.read_manifest(manifest["dataset_version"]["uri"])
    assert version["dataset"]["images"] == {"image_key": "images", "count": 7}
    # The splits stand alone: the source's image files are not needed to read them.
    shutil.rmtree(tmp_path / "data")
    stored = {r["prompt"]: r["images"] for split in ("sft", "eval") for r in split_rows(manifest["uri"], split)}
    assert len(stored) == len(rows)
    for b64s in stored.values():
        assert all(base64.b64decode(b)[:8] == b"\x89PNG\r\n\x1a\n" for b in b64s)
    assert pixels(stored["<image>colour 0?"][0]) == [(255, 0, 0)] * 120
    assert pixels(stored["<image>colour 2?"][0]) == pixels(stored["<image>colour 3?"][0])
    assert stored["<image>colour 4?"] == stored["<image>colour 0?"]
    assert stored["text only 0"] == []
    blue = pixels(stored["<image>colour 1?"][0])
    assert all(r < 8 and g < 8 and b > 245 for r, g, b in blue)  # JPEG, decoded then kept losslessly


def test_parquet_image_dicts_and_raw_bytes(tmp_path, base_model):  # noqa: F811
    red, blue = picture("red"), picture("blue")
    rows = [
        {"prompt": f"<image>what {i}?", "response": "r", "images": [{"bytes": red if i % 2 else blue, "path": None}]}
        for i in range(10)
    ]
    source = write(tmp_path / "rows.parquet", rows)
    manifest = run_prepare(tmp_path, base_model, source, eval_fraction=0.3, **SFT)
    assert manifest["validation"]["bad"] == 0
    stored = split_rows(manifest["uri"], "sft")
    assert {pixels(r["images"][0])[0] for r in stored} <= {(255, 0, 0), (0, 0, 255)}
    # Raw bytes in a cell (Parquet's binary type), and an image dict that names a path beside the file.
    (tmp_path / "blue.png").write_bytes(blue)
    source = images.ImageSource.of(str(tmp_path / "rows.parquet"), 10**6)
    assert source.column([red]) == source.column([{"bytes": red, "path": "ignored.png"}])
    assert pixels(source.column({"bytes": None, "path": "blue.png"})[0])[0] == (0, 0, 255)


def test_csv_holds_the_list_as_json_text(tmp_path, base_model):  # noqa: F811
    (tmp_path / "red.png").write_bytes(picture("red"))
    rows = [{"prompt": f"<image>what {i}?", "response": "r", "images": ["red.png"]} for i in range(8)]
    rows += [{"prompt": f"text {i}", "response": "t", "images": ""} for i in range(4)]  # an empty cell: no images
    manifest = run_prepare(tmp_path, base_model, write(tmp_path / "rows.csv", rows), eval_fraction=0.3, **SFT)
    assert manifest["validation"]["bad"] == 0 and manifest["validation"]["images"] == 8


def bad_image_rows(tmp_path) -> tuple[str, dict[str, list[int]]]:
    (tmp_path / "ok.png").write_bytes(picture("red"))
    (tmp_path / "big.png").write_bytes(picture("red", size=(64, 64)))
    (tmp_path / "cut.png").write_bytes(picture("red")[:40])
    (tmp_path / "notes.png").write_bytes(b"these are not pixels")
    cases = {
        "bad_image": [["missing.png"], ["../ok.png"], ["/etc/ok.png"], ["cut.png"], ["notes.png"], [3], ["!!"]],
        "image_too_large": [["big.png"]],
        "image_count": [["ok.png", "ok.png"], []],
    }
    rows, numbers = [], {}
    for reason, cells in cases.items():
        for cell in cells:
            rows.append({"prompt": f"<image>bad {len(rows)}", "response": "x", "images": cell})
            numbers.setdefault(reason, []).append(len(rows))
    rows += [{"prompt": f"<image>good {i}", "response": "x", "images": ["ok.png"]} for i in range(20)]
    return write(tmp_path / "rows.jsonl", rows), numbers


def test_each_bad_image_is_counted_under_its_check(tmp_path, base_model, capsys):  # noqa: F811
    source, numbers = bad_image_rows(tmp_path)
    manifest = run_prepare(
        tmp_path, base_model, source, eval_fraction=0.3, max_image_pixels=32 * 32, max_bad_fraction=0.5, **SFT
    )
    checks = manifest["validation"]["checks"]
    assert {name: c["rows"] for name, c in checks.items()} == {k: v[:5] for k, v in numbers.items()}
    assert {name: c["count"] for name, c in checks.items()} == {k: len(v) for k, v in numbers.items()}
    assert all(c["fields"] == {"images": c["count"]} for c in checks.values())
    assert manifest["validation"]["kept"] == 20
    assert "bad_image 7 (rows 1, 2, 3, 4, 5, …)" in capsys.readouterr().out


def test_too_many_bad_images_fail_naming_the_flag_and_the_fix(tmp_path, base_model):  # noqa: F811
    source, _ = bad_image_rows(tmp_path)
    with pytest.raises(
        Exception,
        match="image_too_large 1 \\(--image_key images; rows 8: downscale those images or raise --max_image_pixels 1024\\)",
    ):
        run_prepare(tmp_path, base_model, source, max_image_pixels=32 * 32, **SFT)


def test_chat_messages_with_image_blocks(tmp_path, base_model):  # noqa: F811
    (tmp_path / "ok.png").write_bytes(picture("red"))
    rows = [
        {
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"colour {i}?"}]},
                {"role": "assistant", "content": "r"},
            ],
            "images": ["ok.png"],
        }
        for i in range(10)
    ]
    rows.append({"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "r"}]})
    source = write(tmp_path / "chat.jsonl", rows)
    manifest = run_prepare(
        tmp_path,
        base_model,
        source,
        messages_key="messages",
        eval_fraction=0.3,
        max_bad_fraction=0.2,
        **{**SFT, "output_key": ""},
    )
    assert manifest["validation"]["checks"]["image_count"]["rows"] == [11]  # a block, and no image for it
    row = split_rows(manifest["uri"], "sft")[0]
    assert row["prompt"][0]["content"][0] == {"type": "image"} and row["response"] == "r" and len(row["images"]) == 1


def test_one_prompt_text_under_many_images_is_many_prompts():
    """The demo VLM's prompts are one text: their images decide the split side, uniqueness and overlap."""
    rows = demo_vlm.make_datasets(seed=0, sizes={"sft": 200})["sft"]
    sides = {mapping.held_out(r["prompt"], 0, 0.2, r["images"]) for r in rows}
    assert sides == {True, False}
    assert mapping.normalized(rows[0]["prompt"], rows[0]["images"]) != mapping.normalized(
        rows[1]["prompt"], rows[1]["images"]
    )
    records = [{"prompt": r["prompt"], "images": r["images"]} for r in rows]
    assert len(ingest.unique_prompts(records, with_label=False)) == 200
    assert mapping.prompt_key("x") == "x" and mapping.held_out("x", 0, 0.5) == mapping.held_out("x", 0, 0.5, [])


def test_demo_vlm_data_is_deterministic_balanced_and_unguessable_from_text():
    a, b = demo_vlm.make_datasets(seed=3), demo_vlm.make_datasets(seed=3)
    assert a == b and a != demo_vlm.make_datasets(seed=4)
    assert {k: len(v) for k, v in a.items()} == demo_vlm.SPLIT_SIZES
    for split, key in (("sft", "response"), ("prompts", "label"), ("eval", "label")):
        answers = [r[key] for r in a[split]]
        assert {answers.count(c) for c in demo_vlm.COLOURS} == {len(answers) // 4}
        assert {r["prompt"] for r in a[split]} == {demo_vlm.PROMPT}
        assert all(len(r["images"]) == 1 for r in a[split])
    image = decode_image(a["sft"][0]["images"][0])
    assert image.size == (demo_vlm.IMAGE_SIZE, demo_vlm.IMAGE_SIZE)
    assert demo_vlm.COLOURS[a["sft"][0]["response"]] in set(pixels(image))  # the answer is in the pixels
    # The stored images pass prepare_data's own checks unchanged: the demo's splits are in the ingested form.
    source = images.ImageSource.of("rows.jsonl", PrepareDataConfig.max_image_pixels)
    assert source.column(a["sft"][0]["images"]) == a["sft"][0]["images"]


def test_prepare_data_builds_the_demo_vlm_and_its_splits(tmp_path):
    manifest = run_prepare(tmp_path, "demo", "demo_vlm")
    assert set(manifest["datasets"]) == set(demo_vlm.SPLIT_SIZES)
    assert manifest["metrics"]["rows_sft"] == demo_vlm.SPLIT_SIZES["sft"]
    assert split_rows(manifest["uri"], "eval") == demo_vlm.make_datasets(seed=0)["eval"]
    model = models.resolve_model(manifest["uri"])
    assert models.is_vision_model(model)
    processor = vision.load_processor(model)
    assert vision.image_token_ids(processor) and processor.tokenizer.chat_template == demo_vlm.CHAT_TEMPLATE
