"""What the peer benches (openrlhf_bench.py, verl_bench.py) share: a peer's trainer run with each of its step lines
stamped as it arrives, and the step times and time split taken from those stamps.

    returncode, stamped, start = run_stamped(argv, log, marker="step:", timeout_s=480)
    summary = step_summary(records, first_step_s, start, prefix="timing_s/", split={"gen": "time_generate_s"})
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path

from common import COMPLETION_TOKENS, GROUP, PROMPTS_PER_STEP, ROOT, steady_median


def run_stamped(
    argv: list[str], log: Path, marker: str, timeout_s: float, env: dict | None = None
) -> tuple[int, list[tuple[float, str]], float]:
    """Run argv from the repo root, its output into log; every line holding marker comes back with its arrival time.
    Returns (exit code, stamped lines, start time)."""
    # Unbuffered: each line is stamped as it arrives. No log dedup: Ray would fold similar lines of several workers.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0", **(env or {})}
    stamped, start = [], time.time()
    with (
        open(log, "w") as f,
        subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        ) as proc,
    ):
        # A hung run ends here, not at the device call's limit: the phase still returns and its logs come back.
        watchdog = threading.Timer(timeout_s, lambda: os.killpg(proc.pid, signal.SIGKILL))
        watchdog.start()
        for line in proc.stdout:
            f.write(line)
            f.flush()
            if marker in line:
                stamped.append((time.time(), line))
        watchdog.cancel()
    return proc.returncode, stamped, start


# run_stamped's return code when its watchdog stopped the run at timeout_s
STOPPED = -signal.SIGKILL


def fail_unless_ran(what: str, returncode: int, records: list[dict], log: Path, min_steps: int = 3) -> None:
    """A run that failed is no measurement. One stopped at the bench's time limit is, once it logged min_steps steps:
    on a short lease the steps that ran are what there is."""
    if not ((returncode == 0 and records) or (returncode == STOPPED and len(records) >= min_steps)):
        tail = log.read_text().splitlines()[-40:]
        raise SystemExit(
            f"{what} failed ({returncode}, {len(records)} steps logged); last lines of {log}:\n" + "\n".join(tail)
        )


def step_summary(
    records: list[dict], first_step_s: float, start: float, prefix: str, split: dict[str, str], returncode: int = 0
) -> dict:
    """Step 1 from the peer's own total (the driver's start-up is no step), then the wall time between step lines;
    the median after the first two steps. split maps the peer's timing names (after prefix) to ours."""
    times = [first_step_s] + [b["t"] - a["t"] for a, b in zip(records, records[1:])]
    tail = records[2:] or records
    parts = {
        ours: round(statistics.median(r[prefix + k] for r in tail), 4)
        for k, ours in split.items()
        if prefix + k in records[-1]
    }
    generate = parts.get("time_generate_s")
    return {
        "step_s": round(steady_median(times), 4),
        **parts,
        "step_times_s": [round(t, 3) for t in times],
        "rollout_tokens_per_s": round(PROMPTS_PER_STEP * GROUP * COMPLETION_TOKENS / generate) if generate else None,
        "setup_s": round(records[0]["t"] - start - times[0], 1),
        "steps": len(records),
        "stopped_at_time_limit": returncode == STOPPED,
    }
