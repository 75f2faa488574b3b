"""What every stage's `python -m tasks.<stage>` does around its own work.

    def train(cfg: SFTConfig, run: StageRun) -> None:
        …                                   # write files under run.workdir, log with run.tracker
        run.commit(metrics={...}, model="model")

    if __name__ == "__main__":
        main("sft", SFTConfig, train)

`main` parses and validates the config before any work, runs the stage, and turns the errors a
user can fix (bad config, missing or corrupt input, a read-only folder) into one line on stderr and
exit status 2, and the faults worth a retry (an unreachable store, a full disk, a placement waiting on a
busy cluster) into one line and exit status 75.
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

from tasks.common import cost, errors, provenance, storage, user_code
from tasks.common import manifest as manifests
from tasks.common.checkpoint import CheckpointStore
from tasks.common.config import ConfigError, StageConfig, parse_config, split_list
from tasks.common.stages import ERROR_PREFIX, INPUT_ERROR_EXIT, TRY_AGAIN_EXIT
from tasks.common.storage import StorageError
from tasks.common.tracking import MetricsTracker


class InjectedFailure(RuntimeError):
    """The failure --fail_after_step asks for. It stands for a crash, which a retry may get past."""

    transient = True


USER_ERRORS = (ConfigError, StorageError, InjectedFailure)


class StageRun:
    """A stage while it runs: its config, a local output folder, metrics, and the inputs it read."""

    def __init__(self, stage: str, cfg: StageConfig):
        self.stage = stage
        self.cfg = cfg
        self.workdir = Path(tempfile.mkdtemp(prefix=f"rlhf-{stage}-"))
        self.inputs: dict[str, str] = {}
        self.input_manifests: dict[str, str] = {}  # {input stage folder: sha256 of its manifest.json}, for reruns
        self.user_code: dict[str, dict[str, str]] = {}  # {flag: {file URI: sha256}}: the team's Python files it ran
        self.resumed_from = 0  # the checkpoint step this run started from (0: from scratch)
        self.checkpoint_every = 0  # steps between checkpoints, once resume() knows the run's steps
        self.placements: list = []  # the placement groups its workers held (each once), for the cost
        self.started = time.time()
        provenance.code_digest()  # of the code as the stage starts, not as it is when the stage commits
        self.tracker = MetricsTracker(
            self.workdir / "metrics.jsonl",
            use_wandb=cfg.use_wandb,
            project=cfg.wandb_project,
            run_name=f"{stage}-{cfg.run_id}",
            config=cfg.to_dict(),
            name=stage,
        )

    def input(self, name: str, uri: str) -> str:
        """Record an input URI for the manifest's lineage; returns it unchanged.

        A stage output among them (a value may list several, comma-separated) also gets its
        manifest's sha256 recorded, read now, as the stage reads it: tasks.reproduce refuses to
        rerun the stage once that input has been rewritten."""
        self.inputs[name] = uri
        for part in split_list(str(uri)):
            digest = manifests.manifest_digest(part)
            if digest:
                self.input_manifests[part] = digest
        return uri

    def code_input(self, name: str, spec: str, error: type[Exception], recorded_in: tuple[str, ...] = ()) -> str:
        """``spec`` with every Python file it names pinned to its content (``uri#sha256=…``, tasks/common/user_code.py),
        recorded as the input ``name``; give the workers the returned value, so each imports exactly these bytes.

        A file without a pin of its own takes the digest an earlier stage recorded for the same URI in its
        manifest (``recorded_in``: e.g. the policy eval scores, trained with that environment), so a file
        replaced since fails here in one line. Other parts of a comma list (a built-in name, a URL) stay."""
        recorded: dict[str, tuple[str, str]] = {}
        for uri in recorded_in:
            if manifests.manifest_digest(uri):
                for files in manifests.read_manifest(uri).get("user_code", {}).values():
                    recorded.update({file: (digest, uri) for file, digest in files.items()})
        pinned = []
        for part in split_list(str(spec)):
            uri, digest = user_code.split_pin(part)
            if not uri.endswith(".py"):
                pinned.append(part)
                continue
            source = "pinned in the flag"
            if digest is None and uri in recorded:
                digest, source = recorded[uri][0], f"recorded in {recorded[uri][1]}"
            _, actual = user_code.fetch(f"{uri}#sha256={digest}" if digest else uri, name, error, source=source)
            self.user_code.setdefault(name, {})[uri] = actual
            pinned.append(f"{uri}#sha256={actual}")
        return self.input(name, ",".join(pinned))

    # ------------------------------------------------------------ in-stage checkpoints (TrainingConfig)

    @property
    def checkpoints(self) -> CheckpointStore:
        return CheckpointStore(
            self.cfg.ckpt_path or storage.join(self.cfg.output, "checkpoints"), keep=self.cfg.max_ckpt_num
        )

    def resume(self, restore: Callable[[str], None], steps: int) -> int:
        """Restore the newest complete checkpoint (when --load_checkpoint); returns its step, 0 if none.

        `restore(uri)` gets the checkpoint's URI: every process (driver, each worker on its own node)
        fetches the part it needs into its own local folder (CheckpointStore.fetch / manifest.fetch). `steps`:
        how many the run makes in all, over which --num_checkpoints spaces its checkpoints."""
        self.cfg.check_fault_step(steps)
        self.checkpoint_every = self.cfg.checkpoint_interval(steps)
        step = self.checkpoints.latest()
        if not self.cfg.load_checkpoint:
            if step is not None and self.checkpoint_every:
                # Writing beside another run's checkpoints would leave a later resume picking theirs.
                raise ConfigError(
                    f"load_checkpoint: {self.checkpoints.root} holds checkpoints up to step {step} of an earlier run; "
                    "resume them (--load_checkpoint true) or pass another --ckpt_path"
                )
            return 0
        if step is None:
            return 0
        restore(self.checkpoints.uri(step))
        print(f"{self.stage}: resumed from {self.checkpoints.uri(step)}", flush=True)
        self.resumed_from = step
        return step

    def saves_at(self, step: int) -> bool:
        """Whether `checkpoint(step, …)` commits one (every checkpoint interval: --save_steps, or the spacing of
        --num_checkpoints over the run's steps)."""
        return bool(self.checkpoint_every) and step % self.checkpoint_every == 0

    def checkpoint(self, step: int, save: Callable[[Path, str], dict | None]) -> None:
        """At every checkpoint step (saves_at), committed as step_<step>: `save(folder, uri)` writes this process's part
        of the state into `folder` and has each worker upload its own part under `uri` (workers on other
        nodes cannot write into this process's folder); it returns the files they uploaded ({relpath
        under uri: {size, sha256}}), which the manifest, written last, lists with the folder's."""
        if not self.saves_at(step):
            return
        store = self.checkpoints
        local = Path(tempfile.mkdtemp(prefix=f"rlhf-{self.stage}-ckpt-"))
        try:
            uploaded = save(local, store.begin(step))
            uri = store.commit(local, step, self.cfg.run_id, self.cfg.to_dict(), uploaded=uploaded)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        print(f"{self.stage}: checkpoint {uri}", flush=True)
        if step == getattr(self.cfg, "fail_after_step", 0) and self.resumed_from < step:
            raise InjectedFailure(
                f"{self.stage}: injected failure after the checkpoint of step {step} (--fail_after_step); a rerun resumes from it"
            )

    def remote_output(self, rel: str) -> str:
        """The URI under --output where workers upload `rel` themselves (a group spanning nodes cannot
        write into this process's folder); list what they uploaded in commit(uploaded=…). An output
        committed there before is set aside first (manifest.set_aside): no manifest vouches for files
        being replaced."""
        manifests.set_aside(self.cfg.output)
        return storage.join(self.cfg.output, rel)

    def commit(self, metrics: dict, uploaded: dict | None = None, **extra) -> dict:
        """Upload the output folder and write manifest.json last (also listing the files workers
        `uploaded` under --output themselves, see remote_output)."""
        self.tracker.close()
        # The driver holds the one CPU its Ray job reserves (RayJobOperator's entrypoint_num_cpus).
        metrics = {
            **metrics,
            **cost.stage_cost(time.time() - self.started, **cost.held_resources(self.placements, driver_cpus=1)),
        }
        if self.resumed_from:
            extra = {"resumed_from_step": self.resumed_from, **extra}
        if self.user_code:
            extra = {"user_code": self.user_code, **extra}
        manifest = manifests.build_manifest(
            self.stage,
            self.cfg.run_id,
            self.cfg.to_dict(),
            self.inputs,
            metrics,
            input_manifests=self.input_manifests,
            **extra,
        )
        committed = manifests.commit(self.workdir, self.cfg.output, manifest, uploaded=uploaded)
        print(f"committed {self.stage} output to {committed['uri']}", flush=True)
        if getattr(self.cfg, "save_path", "") and "model" in extra and (self.workdir / extra["model"]).is_dir():
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
        run(stage, cfg, disk_faults_named(work))
    except Exception as error:
        # A worker's error reaches the driver wrapped by Ray (a RayTaskError that is also an
        # instance of the cause's class); the user needs the cause's one line, not the traceback.
        cause = known_fault(getattr(error, "cause", None) or error)
        if cause is None:
            raise  # a bug: its traceback is what the developer needs
        # Ray streams the workers' output to this process: stop it first, so the cause is the last line.
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()
        print(f"{ERROR_PREFIX}{cause}", file=sys.stderr, flush=True)
        # Exit 2 says "fix the input": the orchestrator does not retry it. An unreachable or overloaded
        # store, a full disk or a busy cluster is worth another try.
        sys.exit(TRY_AGAIN_EXIT if getattr(cause, "transient", False) else INPUT_ERROR_EXIT)


def disk_faults_named(work: Callable) -> Callable:
    """`work`, with a full or read-only disk turned into its one line (known_fault) where it happens: the free
    space is read before the stage's working folder is removed, which would free what the failed write filled."""

    def named(cfg: StageConfig, stage_run: StageRun) -> None:
        try:
            work(cfg, stage_run)
        except OSError as error:
            fault = known_fault(error)
            if not isinstance(fault, StorageError):
                raise
            raise fault from None

    return named


def known_fault(error: BaseException) -> BaseException | None:
    """The error to report in one line, or None for a bug (left to its traceback).

    The user errors as they are; an error that says it is transient (a placement that found the cluster
    busy, say); and a full, read-only or forbidden disk as a StorageError naming the path and its free
    space. A full or read-only disk that failed a write without naming its file (a plain file.write) is put
    on the working folder, where a stage writes its outputs before they are committed; a denied permission
    without a file (a socket, a signal) is no disk's."""
    if isinstance(error, USER_ERRORS) or getattr(error, "transient", False) is True:
        return error
    if not errors.disk_fault(error):
        return None
    if errors.fault_path(error):
        return errors.disk_error(error, errors.fault_path(error))
    if errors.disk_action(error) == "write":
        return errors.disk_error(error, tempfile.gettempdir(), "write in the working folder")
    return None
