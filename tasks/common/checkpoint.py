"""In-stage checkpoints: `<output>/checkpoints/step_<n>/`, each committed by its own manifest.json.

    store = CheckpointStore(cfg.ckpt_path or storage.join(cfg.output, "checkpoints"), keep=cfg.max_ckpt_num)
    step = store.latest()                       # newest complete step, or None
    local = store.fetch(step, "/tmp/resume")    # download it, every file's sha256 checked
    uri = store.begin(step)                     # where workers upload the files they wrote themselves
    store.commit("/tmp/ckpt", step, run_id, config, uploaded=files)   # manifest last, prune beyond `keep`

A checkpoint folder without its manifest.json is an interrupted upload: `latest` never returns it.
What goes inside is the stage's business (DeepSpeed states per model, the controller's state). Each
Ray worker saves its part on its own node and uploads it itself (nodes share no filesystem); the
driver commits the manifest listing every rank's files once all of them are up.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tasks.common import manifest as manifests
from tasks.common import storage

_STEP = re.compile(r"^step_(\d+)/" + re.escape(manifests.MANIFEST) + "$")


class CheckpointStore:
    def __init__(self, root: str, keep: int = 0):
        self.root = root.rstrip("/")
        self.keep = keep  # 0 keeps every checkpoint

    def uri(self, step: int) -> str:
        return storage.join(self.root, f"step_{step}")

    def steps(self) -> list[int]:
        """Steps with a complete (committed) checkpoint, oldest first."""
        found = [_STEP.match(rel) for rel, _ in storage.list_files(self.root)]
        return sorted(int(m.group(1)) for m in found if m)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def fetch(self, step: int, local_dir: str | Path) -> Path:
        local, _ = manifests.fetch(self.uri(step), local_dir)
        return local

    def begin(self, step: int) -> str:
        """The URI of step's checkpoint, its stale manifest (if any) removed before new files land there."""
        uri = self.uri(step)
        storage.delete(storage.join(uri, manifests.MANIFEST))
        return uri

    def commit(
        self,
        local_dir: str | Path,
        step: int,
        run_id: str,
        config: dict,
        metrics: dict | None = None,
        uploaded: dict | None = None,
    ) -> str:
        """Upload one checkpoint (manifest last, also listing the `uploaded` files workers put there),
        then delete the oldest beyond `keep`."""
        manifest = manifests.build_manifest("checkpoint", run_id, config, {}, metrics or {}, step=step)
        committed = manifests.commit(local_dir, self.uri(step), manifest, uploaded=uploaded)
        if self.keep:
            for old in self.steps()[: -self.keep]:
                self.delete(old)
        return committed["uri"]

    def delete(self, step: int) -> None:
        """Remove one checkpoint, its manifest first so no reader sees it half-deleted."""
        uri = self.uri(step)
        storage.delete(storage.join(uri, manifests.MANIFEST))
        for rel, _ in storage.list_files(uri):
            storage.delete(storage.join(uri, rel))
        if not storage.is_s3(uri):  # a local folder keeps its emptied subfolders otherwise
            shutil.rmtree(storage.local_path(uri), ignore_errors=True)
