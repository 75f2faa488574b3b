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
from tasks.common import storage
from tasks.common.checkpoint import CheckpointStore
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

    # ------------------------------------------------------------ in-stage checkpoints (TrainingConfig)

    @property
    def checkpoints(self) -> CheckpointStore:
        return CheckpointStore(self.cfg.ckpt_path or storage.join(self.cfg.output, "checkpoints"), keep=self.cfg.max_ckpt_num)

    def resume(self, restore: Callable[[Path], None]) -> int:
        """Restore the newest complete checkpoint (when --load_checkpoint); returns its step, 0 if none."""
        step = self.checkpoints.latest()
        if not self.cfg.load_checkpoint:
            if step is not None and self.cfg.save_steps:
                # Writing beside another run's checkpoints would leave a later resume picking theirs.
                raise ConfigError(f"load_checkpoint: {self.checkpoints.root} holds checkpoints up to step {step} of an earlier run; "
                                  "resume them (--load_checkpoint true) or pass another --ckpt_path")
            return 0
        if step is None:
            return 0
        local = Path(tempfile.mkdtemp(prefix=f"rlhf-{self.stage}-resume-"))
        try:
            restore(self.checkpoints.fetch(step, local))
        finally:
            shutil.rmtree(local, ignore_errors=True)
        print(f"{self.stage}: resumed from {self.checkpoints.uri(step)}", flush=True)
        return step

    def checkpoint(self, step: int, save: Callable[[Path], None]) -> None:
        """Every --save_steps steps: `save(folder)` writes the state, then it is committed as step_<step>."""
        if not self.cfg.save_steps or step % self.cfg.save_steps:
            return
        local = Path(tempfile.mkdtemp(prefix=f"rlhf-{self.stage}-ckpt-"))
        try:
            save(local)
            uri = self.checkpoints.commit(local, step, self.cfg.run_id, self.cfg.to_dict())
        finally:
            shutil.rmtree(local, ignore_errors=True)
        print(f"{self.stage}: checkpoint {uri}", flush=True)

    def commit(self, metrics: dict, **extra) -> dict:
        """Upload the output folder and write manifest.json last."""
        self.tracker.close()
        metrics = {**metrics, "wall_time_s": round(time.time() - self.started, 1)}
        manifest = manifests.build_manifest(self.stage, self.cfg.run_id, self.cfg.to_dict(), self.inputs, metrics, **extra)
        committed = manifests.commit(self.workdir, self.cfg.output, manifest)
        print(f"committed {self.stage} output to {committed['uri']}", flush=True)
        if getattr(self.cfg, "save_path", "") and "model" in extra:
            storage.upload_dir(self.workdir / extra["model"], self.cfg.save_path)
            print(f"{self.stage}: final model also written to {self.cfg.save_path}", flush=True)
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
        # A worker's error reaches the driver wrapped by Ray (a RayTaskError that is also an
        # instance of the cause's class); the user needs the cause's one line, not the traceback.
        print(f"error: {getattr(error, 'cause', None) or error}", file=sys.stderr, flush=True)
        sys.exit(2)
