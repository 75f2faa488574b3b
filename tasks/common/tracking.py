"""Per-step metrics to stdout, to metrics.jsonl in the stage's output, and to wandb when asked.

    tracker = MetricsTracker(workdir / "metrics.jsonl", use_wandb=cfg.use_wandb, project="rlhf-flow",
                             run_name="sft-<run id>", config=cfg.to_dict())
    tracker.log(step, {"loss": 0.41, "lr": 1e-3})
    tracker.close()

With wandb on, `wandb.json` lands beside metrics.jsonl (so in the stage's manifest): {"url", "run_id",
"project", "mode"}, url null in offline mode. The Airflow operator reads it to link the task to the run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

WANDB_FILE = "wandb.json"


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class MetricsTracker:
    def __init__(self, path: Path, use_wandb: bool = False, project: str = "rlhf-flow", run_name: str = "", config: dict | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._start = time.time()
        self.wandb_run = None
        if use_wandb:
            import wandb

            self.wandb_run = wandb.init(project=project, name=run_name or None, config=config or {}, reinit="finish_previous")
            self._write_wandb_record()

    def _write_wandb_record(self) -> None:
        """wandb.json: where this stage's wandb run lives (an offline run has no URL until synced)."""
        run = self.wandb_run
        mode = "offline" if getattr(run, "offline", False) else str(getattr(run.settings, "mode", "online"))
        record = {"url": None if mode == "offline" else (run.url or None), "run_id": run.id, "project": run.project, "mode": mode}
        (self.path.parent / WANDB_FILE).write_text(json.dumps(record) + "\n")

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, "time_s": round(time.time() - self._start, 3), **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        print(f"step {step} " + " ".join(f"{k}={_format(v)}" for k, v in metrics.items()), flush=True)
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def close(self) -> None:
        self._file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
