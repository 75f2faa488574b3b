"""Per-step metrics to stdout, to metrics.jsonl in the stage's output, and to wandb when asked.

    tracker = MetricsTracker(workdir / "metrics.jsonl", use_wandb=cfg.use_wandb, project="rlhf-flow",
                             run_name="sft-<run id>", config=cfg.to_dict())
    tracker.log(step, {"loss": 0.41, "lr": 1e-3})
    tracker.progress(step, total_steps, {"loss": 0.41})   # every step: a line at most every PROGRESS_EVERY_S
    tracker.close()

A progress line says where a long stage is, between the logged steps: `sft: step 12/100, 0.83 steps/s, about 1m46s
left, loss=0.41` (the rate of the steps this process ran, so a resumed stage's is its own).

With wandb on, `wandb.json` lands beside metrics.jsonl (so in the stage's manifest): {"url", "run_id",
"project", "mode"}, url null in offline mode. The Airflow operator reads it to link the task to the run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

WANDB_FILE = "wandb.json"
PROGRESS_EVERY_S = 10.0  # the demo shows the newest line of each running stage: it is never older than this


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
        if seconds >= 60
        else f"{seconds}s"
    )


def progress_line(name: str, step: int, total: int, first_step: int, elapsed_s: float, metrics: dict) -> str:
    """`<name>: step k/N, r steps/s, about T left, key=value …`: the rate over the steps since `first_step`."""
    done = step - first_step + 1
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    left = f", about {_duration((total - step) / rate)} left" if rate and step < total else ""
    shown = " ".join(f"{k}={_format(v)}" for k, v in metrics.items())
    return f"{name}: step {step}/{total}, {rate:.3g} steps/s{left}" + (f", {shown}" if shown else "")


class MetricsTracker:
    def __init__(
        self,
        path: Path,
        use_wandb: bool = False,
        project: str = "rlhf-flow",
        run_name: str = "",
        config: dict | None = None,
        name: str = "",
    ):
        self.path = Path(path)
        self.name = name or run_name or "stage"
        self._progress_from: tuple[int, float] | None = None  # (first step, its start) of this process's steps
        self._printed = 0.0
        self._total = 0  # the stage's step count, from progress()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._start = time.time()
        self.wandb_run = None
        if use_wandb:
            import wandb

            self.wandb_run = wandb.init(
                project=project, name=run_name or None, config=config or {}, reinit="finish_previous"
            )
            self._write_wandb_record()

    def _write_wandb_record(self) -> None:
        """wandb.json: where this stage's wandb run lives (an offline run has no URL until synced)."""
        run = self.wandb_run
        mode = "offline" if getattr(run, "offline", False) else str(getattr(run.settings, "mode", "online"))
        record = {
            "url": None if mode == "offline" else (run.url or None),
            "run_id": run.id,
            "project": run.project,
            "mode": mode,
        }
        (self.path.parent / WANDB_FILE).write_text(json.dumps(record) + "\n")

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, "time_s": round(time.time() - self._start, 3), **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        of = f"/{self._total}" if self._total else ""  # known once progress() has been called
        print(f"step {step}{of} " + " ".join(f"{k}={_format(v)}" for k, v in metrics.items()), flush=True)
        self._printed = time.time()
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def progress(self, step: int, total: int, metrics: dict | None = None) -> None:
        """Call once a step, after it: prints a progress line when nothing was printed for PROGRESS_EVERY_S, and
        at the last step."""
        now = time.time()
        self._total = total
        if self._progress_from is None:  # the first step this process runs: its rate starts at the tracker's start
            self._progress_from = (step, self._start)
        if now - self._printed < PROGRESS_EVERY_S and step < total:
            return
        first, since = self._progress_from
        print(progress_line(self.name, step, total, first, now - since, metrics or {}), flush=True)
        self._printed = now

    def close(self) -> None:
        self._file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
