"""The eval stage's HTML report and SVG charts, from hand-made metrics; wandb.json; the plugin's checks.

Real files and real manifests (tasks.common.manifest.commit into a local folder); nothing mocked.
"""

import json
import xml.etree.ElementTree as ET

import pytest

from tasks.common import manifest as manifests
from tasks.common.storage import StorageError
from tasks.eval import report as rpt

SVG = "{http://www.w3.org/2000/svg}"

RL_METRICS = [
    {
        "step": s,
        "time_s": s * 1.5,
        "reward": 0.1 * s,
        "reward_std": 0.5,
        "kl": 0.02 * s,
        "kl_coef": 0.05,
        "policy_loss": 1.0 / s,
        "value_loss": 2.0 / s,
        "clip_fraction": 0.1,
    }
    for s in range(1, 11)
]
DPO_METRICS = [
    {
        "step": s,
        "loss": 0.7 - 0.05 * s,
        "reward_accuracy": 0.5 + 0.04 * s,
        "margin": 0.1 * s,
        "chosen_reward": 0.05 * s,
        "rejected_reward": -0.05 * s,
        "lr": 2e-5,
    }
    for s in range(1, 6)
]
REPORT = {
    "metrics": {
        "baseline": {"accuracy": 0.844, "preferred_style_rate": 0.546, "reward_mean": 0.311, "kl_to_ref": 0.0},
        "policy": {"accuracy": 0.846, "preferred_style_rate": 0.99, "reward_mean": 3.502, "kl_to_ref": 0.738},
    },
    "num_prompts": 500,
    "temperature": 1.0,
    "inputs": {"policy": "s3://b/p/rl/manifest.json"},
    "samples": [{"prompt": "37+45=", "label": "082", "baseline": "082 is the sum", "policy": "082<script>"}],
}


def stage_output(tmp_path, name: str, records: list[dict] | None, raw: str | None = None) -> str:
    """A committed stage output folder (manifest.json listing its files) holding `records` as metrics.jsonl."""
    local = tmp_path / f"{name}-local"
    (local / "model").mkdir(parents=True)
    (local / "model" / "config.json").write_text("{}")
    if records is not None or raw is not None:
        (local / "metrics.jsonl").write_text(raw if raw is not None else "".join(json.dumps(r) + "\n" for r in records))
    out = str(tmp_path / name)
    manifests.commit(local, out, manifests.build_manifest(name, "run1", {}, {}, {}, model="model"))
    return out


def polylines(svg: str) -> dict[str, list[tuple[float, float]]]:
    root = ET.fromstring(svg)
    return {
        p.get("data-name"): [tuple(map(float, xy.split(","))) for xy in p.get("points").split()]
        for p in root.iter(f"{SVG}polyline")
    }


def test_rl_curves_become_three_charts_and_standalone_svg_files(tmp_path):
    policy = stage_output(tmp_path, "rl", RL_METRICS)
    work = tmp_path / "eval"
    work.mkdir()
    written = rpt.write_report(work, REPORT, policy_uri=policy, run_id="manual__1")
    assert written == ["report.html", "chart_reward.svg", "chart_kl.svg", "chart_loss.svg"]
    lines = {name: polylines((work / f"chart_{name}.svg").read_text()) for name in ("reward", "kl", "loss")}
    assert set(lines["reward"]) == {"reward"} and set(lines["kl"]) == {"kl"}
    assert set(lines["loss"]) == {"policy_loss", "value_loss"}
    reward = lines["reward"]["reward"]
    assert len(reward) == 10
    # Steps run left to right and a rising reward rises on screen (SVG y grows downwards).
    assert [x for x, _ in reward] == sorted(x for x, _ in reward)
    assert reward[-1][1] < reward[0][1]
    assert lines["loss"]["policy_loss"][-1][1] > lines["loss"]["policy_loss"][0][1]  # falling loss


def test_html_is_self_contained_with_table_charts_and_escaped_text(tmp_path):
    policy = stage_output(tmp_path, "rl", RL_METRICS)
    rpt.write_report(tmp_path, REPORT, policy_uri=policy, run_id="manual__1")
    page = (tmp_path / "report.html").read_text()
    assert page.count("<svg") == 3 and 'id="metrics"' in page
    assert "<script" not in page and "&lt;script&gt;" in page  # a generation is text, never markup
    assert "http" not in page.replace("http://www.w3.org/2000/svg", "")  # nothing loaded from elsewhere
    assert ">+0.444<" in page and ">0.990<" in page  # change column and the policy's value
    assert f"{policy}/metrics.jsonl" in page


def test_samples_with_images_show_them_inline_scaled_down_and_nothing_else_gets_in(tmp_path):
    """A vision-language eval's samples (issue 54): each prompt's images as data: URIs in the page itself (the
    reports view's CSP allows images from data: only), a large one scaled to IMAGE_SIDE, and a value that is not an
    image named instead, so no text of a sample reaches an attribute."""
    import base64
    import io
    import random

    from PIL import Image

    from tasks.data import demo_vlm
    from tasks.eval import sample_images

    small = demo_vlm.png_base64(demo_vlm.draw("r", random.Random(0)))  # as prepare_data stores it
    big = io.BytesIO()
    Image.new("RGB", (1200, 600), (9, 9, 9)).save(big, format="JPEG")
    big_uri = "data:image/jpeg;base64," + base64.b64encode(big.getvalue()).decode()
    samples = [
        {"prompt": "<image>colour?", "images": [small], "label": "r", "baseline": "g", "policy": "r"},
        {
            "prompt": "<image><image>two?",
            "images": [big_uri, 'x" onerror="alert(1)'],
            "label": None,
            "baseline": "a",
            "policy": "b",
        },
    ]
    rpt.write_report(tmp_path, {**REPORT, "samples": samples}, policy_uri="")
    page = (tmp_path / "report.html").read_text()
    assert page.count('<img src="data:image/png;base64,') == 2 and "<th>images</th>" in page
    assert "image 2: not shown" in page and "onerror" not in page
    shown = page.split('<img src="data:image/png;base64,')[2].split('"')[0]
    assert Image.open(io.BytesIO(base64.b64decode(shown))).size == (sample_images.IMAGE_SIDE, 128)
    assert Image.open(io.BytesIO(base64.b64decode(sample_images.image_uri(small).split(",")[1]))).size == (28, 28)
    assert "http" not in page.replace("http://www.w3.org/2000/svg", "")  # nothing loaded from elsewhere
    assert "(2 images: see report.html)" in rpt.markdown({**REPORT, "order": ["accuracy"], "samples": samples})
    # A text eval's table has no images column.
    rpt.write_report(tmp_path, REPORT, policy_uri="")
    assert "<th>images</th>" not in (tmp_path / "report.html").read_text()


def test_each_chart_names_its_axes_and_says_what_its_numbers_are(tmp_path):
    policy = stage_output(tmp_path, "rl", RL_METRICS)  # an RL stage with the config's defaults: --normalize_reward
    rpt.write_report(tmp_path, REPORT, policy_uri=policy, run_id="manual__1")
    page = (tmp_path / "report.html").read_text()
    assert "standardised by the mean and std" in page and "another scale" in page  # beside the table's reward_mean
    assert "the table&#x27;s kl_to_ref measures the same" in page
    svg = ET.fromstring((tmp_path / "chart_kl.svg").read_text())
    assert {"training step", "nats per response"} <= {t.text for t in svg.iter(f"{SVG}text")}
    assert svg.get("width") == "100%"  # as wide as the page gives it
    rl_env = {"stage": "rl", "config": {"env_path": "guess"}}
    assert "environment or reward function" in rpt.chart_notes(rl_env)["reward"]
    assert "raw score" in rpt.chart_notes({"stage": "rl", "config": {"normalize_reward": False}})["reward"]
    assert "implicit rewards" in rpt.chart_notes({"stage": "dpo", "config": {}})["reward"]


def test_dpo_metrics_plot_what_they_have(tmp_path):
    policy = stage_output(tmp_path, "dpo", DPO_METRICS)
    svgs = rpt.charts(rpt.training_metrics(policy)[0])
    assert set(svgs) == {"reward", "loss"}  # DPO logs no KL
    assert set(polylines(svgs["reward"])) == {"chosen_reward", "rejected_reward", "margin"}
    assert set(polylines(svgs["loss"])) == {"loss"}


def test_no_curves_for_a_plain_model_folder_or_a_stage_without_metrics(tmp_path):
    plain = tmp_path / "hf-folder"
    plain.mkdir()
    assert rpt.training_metrics(str(plain)) == ([], None)
    assert rpt.training_metrics("sshleifer/tiny-gpt2") == ([], None)
    assert rpt.training_metrics(stage_output(tmp_path, "nometrics", None)) == ([], None)
    written = rpt.write_report(tmp_path, REPORT, policy_uri=str(plain))
    assert written == ["report.html"] and "<svg" not in (tmp_path / "report.html").read_text()


def test_a_torn_last_line_is_dropped_and_a_tampered_file_refused(tmp_path):
    good = "".join(json.dumps(r) + "\n" for r in RL_METRICS[:3])
    records, _ = rpt.training_metrics(stage_output(tmp_path, "torn", None, raw=good + '{"step": 4, "rew'))
    assert [r["step"] for r in records] == [1, 2, 3]
    out = stage_output(tmp_path, "tampered", RL_METRICS)
    (tmp_path / "tampered" / "metrics.jsonl").write_text(good)
    with pytest.raises(StorageError, match="does not match its manifest"):
        rpt.training_metrics(out)


def test_series_skips_non_numbers_and_keeps_a_resumed_steps_last_value():
    records = [
        {"step": 1, "kl": 0.5},
        {"step": 2, "kl": float("nan")},
        {"step": 3, "kl": "x"},
        {"step": 1, "kl": 0.25},
        {"step": 4, "kl": True},
        {"step": 5, "kl": 1},
    ]
    assert rpt.series(records, "kl") == [(1.0, 0.25), (5.0, 1.0)]


@pytest.mark.parametrize("lo,hi", [(0.0, 1.0), (-3.2, 17.9), (5.0, 5.0), (1e-6, 3e-6), (0.0, 0.0)])
def test_ticks_are_round_and_cover_the_range(lo, hi):
    ticks = rpt.nice_ticks(lo, hi)
    assert ticks[0] <= lo and ticks[-1] >= hi and 2 <= len(ticks) <= 12
    steps = {round(b - a, 15) for a, b in zip(ticks, ticks[1:])}
    assert len({f"{s:.6g}" for s in steps}) == 1


def test_a_single_point_and_no_data_still_draw():
    one = rpt.svg_line_chart("KL", {"kl": [(1.0, 0.3)]})
    assert "<circle" in one and ET.fromstring(one) is not None
    assert "no data" in rpt.svg_line_chart("KL", {})


def test_wandb_json_lands_beside_metrics_in_offline_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    from tasks.common.tracking import WANDB_FILE, MetricsTracker

    tracker = MetricsTracker(
        tmp_path / "out" / "metrics.jsonl", use_wandb=True, project="rlhf-flow-test", run_name="sft-t"
    )
    tracker.log(1, {"loss": 1.0})
    tracker.close()
    record = json.loads((tmp_path / "out" / WANDB_FILE).read_text())
    assert record["url"] is None and record["mode"] == "offline" and record["project"] == "rlhf-flow-test"
    assert isinstance(record["run_id"], str) and record["run_id"]
    plain = MetricsTracker(tmp_path / "plain" / "metrics.jsonl")
    plain.close()
    assert not (tmp_path / "plain" / WANDB_FILE).exists()


# ------------------------------------------------------------------ the plugin's input checks


def test_report_view_refuses_traversal_and_bad_names():
    pytest.importorskip("airflow")
    from fastapi import HTTPException

    from plugins import reports

    assert reports.check_location("rlhf-flow", "rlhf-flow", "rlhf_pipeline") == "s3://rlhf-flow/rlhf-flow"
    assert reports.check_location("rlhf-flow", "", "rlhf_pipeline") == "s3://rlhf-flow"
    assert reports.check_run_id("manual__2026-01-01T00:00:00+00:00")
    for call, field in [
        (lambda: reports.check_location("rlhf-flow", "a/../b", "d"), "prefix"),
        (lambda: reports.check_location("Bad_Bucket", "p", "d"), "bucket"),
        (lambda: reports.check_location("rlhf-flow", "p", ".."), "dag_id"),
        (lambda: reports.check_run_id(".."), "run_id"),
        (lambda: reports.check_run_id("a/b"), "run_id"),
    ]:
        with pytest.raises(HTTPException) as err:
            call()
        assert err.value.status_code == 400 and err.value.detail.startswith(f"{field}: ")


def test_links_only_return_http_urls():
    pytest.importorskip("airflow")
    from plugins.links import RayJobLink, WandbRunLink, _http_url

    assert _http_url("http://127.0.0.1:8265/#/jobs/x") == "http://127.0.0.1:8265/#/jobs/x"
    assert _http_url("javascript:alert(1)") == "" and _http_url(None) == ""
    assert RayJobLink().name == "Ray job" and WandbRunLink().name == "wandb run"
    assert RayJobLink().xcom_key != WandbRunLink().xcom_key


# ------------------------------------------------------------------ the links, through Airflow's task runner


def test_links_are_stored_by_the_task_runner_from_the_operators_xcoms(tmp_path):
    """A task that pushes ray_job_url (as RayJobOperator does) and no wandb_url, run by dag.test() (the real
    task runner, which stores each link's get_link() under the link's XCom key for the API server)."""
    import subprocess
    import sys

    code = """
import datetime, json
from airflow.dag_processing.bundles.manager import DagBundlesManager
from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
DagBundlesManager().sync_bundles_to_db()
bag = DagBag(dag_folder=DAGS)
assert not bag.import_errors, bag.import_errors
sync_bag_to_db(bag, "dags-folder", None)
dr = bag.dags["links_probe"].test()
with create_session() as s:
    rows = s.query(XComModel.key, XComModel.value).filter(XComModel.run_id == dr.run_id).all()
print(json.dumps({k: v if isinstance(v, str) else json.loads(v) for k, v in rows}, default=str))
"""
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "links_probe.py").write_text("""
from airflow.sdk import DAG, BaseOperator
from plugins.links import RayJobLink, WandbRunLink

class Probe(BaseOperator):
    operator_extra_links = (RayJobLink(), WandbRunLink())
    def execute(self, context):
        context["ti"].xcom_push(key="ray_job_url", value="http://127.0.0.1:8265/#/jobs/probe")

with DAG("links_probe", schedule=None):
    Probe(task_id="probe")
""")
    import os

    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True, env=env)
    r = subprocess.run(
        [sys.executable, "-c", f"DAGS = {str(dags)!r}\n" + code], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    stored = json.loads(r.stdout.strip().splitlines()[-1])
    assert stored["_link_RayJobLink"] == "http://127.0.0.1:8265/#/jobs/probe"
    assert stored["_link_WandbRunLink"] == ""  # no wandb_url pushed: a greyed-out link, not an error
