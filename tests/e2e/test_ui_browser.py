"""The Airflow UI in a real browser: log in, trigger rlhf_pipeline through its Params form with one field
changed, wait for the run, then read its evaluation in the plugin's report view. Screenshots are saved
under .scratch/test/artifacts/ (paths printed).

Headless Chromium through Playwright, the browser being the system's (Debian's `chromium` package;
RLHF_CHROMIUM overrides /usr/bin/chromium). Playwright's own browser downloads are never used.
"""

import os
import time
import urllib.parse
from pathlib import Path

import pytest

from tests.conftest import SCRATCH

# make test-all: a browser drives the trigger form through a whole run (90 s); make test triggers runs
# through the REST API (tests/e2e/test_e2e.py)
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHROMIUM = os.environ.get("RLHF_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = SCRATCH / "artifacts"
EVAL_SAMPLES = 120  # the Param changed in the form (default 500): also makes the eval stage quicker
# The pipeline takes about 4 min on 2 idle cores; a loaded machine may need RLHF_BROWSER_RUN_TIMEOUT_S.
RUN_TIMEOUT_S = float(os.environ.get("RLHF_BROWSER_RUN_TIMEOUT_S", 20 * 60))
DAG = "rlhf_pipeline"


def shot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"browser-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def log_in(page, base: str, username: str, password: str) -> None:
    page.goto(f"{base}/")
    page.locator("input[name=username]").fill(username)
    page.locator("input[name=password]").fill(password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(lambda url: "/auth/login" not in url, timeout=60_000)


def trigger_through_form(page, base: str) -> None:
    page.goto(f"{base}/dags/{DAG}")
    page.get_by_role("button", name="Trigger").first.click()
    dialog = page.get_by_role("dialog")
    # The form's sections (plugins/form.py SECTIONS), folded: the Eval one is opened for its field.
    for section in ("Data", "SFT", "Reward model", "RL", "Eval", "Promotion", "Advanced"):
        assert dialog.get_by_role("button", name=section, exact=True).is_visible(), section
    shot(page, "0-trigger-form-sections")
    dialog.get_by_role("button", name="Eval", exact=True).click()
    field = dialog.locator("input[name=element_eval_max_samples]")
    field.scroll_into_view_if_needed()
    field.fill(str(EVAL_SAMPLES))
    shot(page, "1-trigger-form")
    dialog.get_by_role("button", name="Trigger").click()
    dialog.wait_for(state="hidden", timeout=30_000)


def find_run(api, since: float, timeout: float = 60) -> dict:
    """The run the form created: the newest one carrying the changed Param, created after `since`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for run in api.get(f"/api/v2/dags/{DAG}/dagRuns", order_by="-run_after", limit=5)["dag_runs"]:
            if (run.get("conf") or {}).get("eval_max_samples") == EVAL_SAMPLES and run_after(run) >= since - 5:
                return run
        time.sleep(2)
    raise AssertionError(
        f"no {DAG} run with eval_max_samples={EVAL_SAMPLES} appeared within {timeout:.0f}s of the form's Trigger"
    )


def run_after(run: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(run["run_after"].replace("Z", "+00:00")).timestamp()


def wait_for_run(api, run_id: str, timeout: float = RUN_TIMEOUT_S) -> dict:
    deadline, last = time.monotonic() + timeout, None
    quoted = urllib.parse.quote(run_id, safe="")
    while time.monotonic() < deadline:
        run = api.get(f"/api/v2/dags/{DAG}/dagRuns/{quoted}")
        if run["state"] != last:
            print(f"{time.strftime('%H:%M:%S')} run {run_id}: {run['state']}", flush=True)
            last = run["state"]
        if run["state"] in ("success", "failed"):
            tis = api.get(f"/api/v2/dags/{DAG}/dagRuns/{quoted}/taskInstances")["task_instances"]
            run["tasks"] = {t["task_id"]: t["state"] for t in tis}
            return run
        time.sleep(5)
    tis = api.get(f"/api/v2/dags/{DAG}/dagRuns/{quoted}/taskInstances")["task_instances"]
    raise AssertionError(
        f"run {run_id} did not finish within {timeout:.0f}s (raise RLHF_BROWSER_RUN_TIMEOUT_S on a loaded "
        f"machine); tasks: { ({t['task_id']: t['state'] for t in tis}) }"
    )


@pytest.fixture(scope="module")
def browser_run(live_stack):
    """One pass through the UI; yields (live_stack, the finished run, the Playwright page, its base URL)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install 'rlhf-flow[dev]'")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(
            f"RLHF_CHROMIUM: no browser at {CHROMIUM}: apt-get install chromium, or point RLHF_CHROMIUM at one",
            pytrace=False,
        )
    base = live_stack.airflow_url
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        t0 = time.time()
        log_in(page, base, live_stack.username, live_stack.password)
        trigger_through_form(page, base)
        run = find_run(live_stack.api, since=t0)
        started = time.monotonic()
        run = wait_for_run(live_stack.api, run["dag_run_id"])
        print(f"run {run['dag_run_id']} {run['state']} in {time.monotonic() - started:.0f}s: {run['tasks']}")
        try:
            yield live_stack, run, page, base
        finally:
            browser.close()


def test_the_run_triggered_from_the_form_succeeds_with_the_changed_param(browser_run):
    _, run, page, base = browser_run
    page.goto(f"{base}/dags/{DAG}/runs/{urllib.parse.quote(run['dag_run_id'], safe='')}")
    page.wait_for_load_state("networkidle")
    shot(page, "2-run")
    assert run["state"] == "success", run["tasks"]
    assert run["conf"]["eval_max_samples"] == EVAL_SAMPLES


def test_the_report_tab_of_the_run_shows_the_metrics_table_and_charts(browser_run):
    _, run, page, base = browser_run
    run_path = f"{base}/dags/{DAG}/runs/{urllib.parse.quote(run['dag_run_id'], safe='')}"
    page.goto(f"{run_path}/plugin/rlhf-report")  # the run's "Report" tab (external view, destination dag_run)
    report = page.frame_locator("iframe").first
    report.locator("#metrics").wait_for()
    rows = report.locator("#metrics tr").all_inner_texts()
    shot(page, "3-report-tab")
    assert any(r.startswith("preferred_style_rate") for r in rows), rows
    assert report.locator("svg polyline.series").count() >= 3  # reward, KL, policy and value losses
    assert f"{EVAL_SAMPLES} held-out prompts" in report.locator("body").inner_text()


def test_the_reports_page_lists_the_run_and_opens_its_report(browser_run):
    _, run, page, base = browser_run
    page.goto(f"{base}/plugin/rlhf-reports")  # Browse > RLHF reports
    listing = page.frame_locator("iframe").first
    link = listing.locator("a.report", has_text=run["dag_run_id"])
    link.wait_for()
    shot(page, "4-reports-list")
    # Each rate says how it was measured: the greedy and the sampled style rates are different numbers.
    headers = listing.locator("th").all_inner_texts()
    assert {"accuracy (greedy)", "style rate (greedy)", "style rate (sampled)"} <= set(headers), headers
    # The report itself, as a page of its own: the whole of it in one screenshot.
    page.goto(f"{base}/rlhf-flow/dags/{DAG}/runs/{urllib.parse.quote(run['dag_run_id'], safe='')}/report.html")
    assert page.locator("#metrics").is_visible()
    assert {f.get_attribute("id") for f in page.locator("figure").all()} == {"chart-reward", "chart-kl", "chart-loss"}
    # Each chart names its axes and says what its numbers are beside the table's.
    assert "standardised" in page.locator("#chart-reward figcaption").inner_text()
    assert page.locator("#chart-kl svg text", has_text="nats per response").count() == 1
    assert page.locator("a.own").get_attribute("target") == "_blank"
    # Charts as wide as the page has room for: two a row in a 1,400-pixel window, not three at a fixed width.
    widths = [f.bounding_box()["width"] for f in page.locator("figure").all()]
    assert min(widths) > 600, widths
    shot(page, "5-report")
    # As narrow as the graph view's side panel: nothing runs off the page's side.
    page.set_viewport_size({"width": 420, "height": 900})
    try:
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), "the page scrolls sideways"
        assert page.locator("#chart-loss").bounding_box()["width"] <= 420
        shot(page, "6-report-narrow")
    finally:
        page.set_viewport_size({"width": 1400, "height": 1000})


def test_stage_tasks_link_to_their_ray_job(browser_run):
    live, run, _, _ = browser_run
    links = live.rest(
        "GET", f"/api/v2/dags/{DAG}/dagRuns/{urllib.parse.quote(run['dag_run_id'], safe='')}/taskInstances/eval/links"
    )
    assert {"Ray job", "wandb run"} <= set(links["extra_links"]), links
    assert links["extra_links"]["Ray job"].startswith(f"{live.ray_dashboard}/#/jobs/airflow-{DAG}--"), links
