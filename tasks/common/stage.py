"""What every stage's `python -m tasks.<stage>` does around its own work.

    def train(cfg: SFTConfig, run: StageRun) -> None:
        …                                   # write files under run.workdir, log with run.tracker
        run.commit(metrics={...}, model="model")

    if __name__ == "__main__":
        main("sft", SFTConfig, train)

`main` parses and validates the config before any work, runs the stage, and turns the errors a
user can fix (bad config, missing or corrupt input) into one line on stderr and exit status 2.
Outputs are written to a local folder first and committed to `cfg.output` with manifest.json last.
"""
from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from tasks.common import manifest as manifests
from tasks.common.config import ConfigError, StageConfig, parse_config
from tasks.common.storage import StorageError
from tasks.common.tracking import MetricsTracker

USER_ERRORS = (ConfigError, StorageError)


class StageRun:
    """A stage while it runs: its config, a local output folder, metrics, and the inputs it read."""

    def __init__(self, stage: str, cfg: StageConfig):
        self.stage = stage
        self.cfg = cfg
        self.workdir = Path(tempfile.mkdtemp(prefix=f"rlhf-{stage}-"))
        self.inputs: dict[str, str] = {}
        self.started = time.time()
        self.tracker = MetricsTracker(
            self.workdir / "metrics.jsonl",
            use_wandb=cfg.use_wandb,
            project=cfg.wandb_project,
            run_name=f"{stage}-{cfg.run_id}",
            config=cfg.to_dict(),
        )

    def input(self, name: str, uri: str) -> str:
        """Record an input URI for the manifest's lineage; returns it unchanged."""
        self.inputs[name] = uri
        return uri

    def commit(self, metrics: dict, **extra) -> dict:
        """Upload the output folder and write manifest.json last."""
        self.tracker.close()
        metrics = {**metrics, "wall_time_s": round(time.time() - self.started, 1)}
        manifest = manifests.build_manifest(self.stage, self.cfg.run_id, self.cfg.to_dict(), self.inputs, metrics, **extra)
        committed = manifests.commit(self.workdir, self.cfg.output, manifest)
        print(f"committed {self.stage} output to {committed['uri']}", flush=True)
        return committed

    def cleanup(self) -> None:
        self.tracker.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def run(stage: str, cfg: StageConfig, work: Callable[[StageConfig, StageRun], None]) -> None:
    """Run a stage in this process (tests and debugging call this directly)."""
    stage_run = StageRun(stage, cfg)
    try:
        work(cfg, stage_run)
    finally:
        stage_run.cleanup()


def main(stage: str, config_cls: type, work: Callable, argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = parse_config(config_cls, argv, prog=f"python -m {config_cls.__module__.rsplit('.', 1)[0]}")
        print(f"{stage}: config {cfg.to_dict()}", flush=True)
        run(stage, cfg, work)
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
