"""The driver of a stage that trains one model in one data-parallel worker group (SFT, the reward model, DPO/KTO):
the same skeleton for all three, each stage giving its worker class, its summary line and what it does after the
last step.

    info, stats, metrics = train_single_group(run, cfg, SFTWorker, lambda info: f"{info['rows']} rows")
    run.commit(metrics={**metrics, "train_loss": stats["loss"]}, model="model")
"""

from __future__ import annotations

from collections.abc import Callable

import ray

from tasks.common.nn.workers import WorkerGroup, merge_uploads, placed_group


def train_single_group(
    run, cfg, worker_cls: type, summary: Callable[[dict], str], after: Callable | None = None
) -> tuple[dict, dict, dict]:
    """Record the stage's inputs (dataset, pretrain), place `worker_cls`'s group, set it up (printing
    `summary(setup's info)`), run the steps (train_steps), then `after(group, stats)` -> (extra metrics, save_model's
    extra arguments), and save the model into the run's model/. Returns (setup's info, the last step's statistics,
    the metrics every such stage commits plus `after`'s)."""
    run.input("dataset", cfg.dataset)
    run.input("pretrain", cfg.pretrain)
    with placed_group(worker_cls, cfg.num_nodes, cfg.num_gpus_per_node, run.stage) as group:
        info = group.run("setup", cfg)[0]
        print(f"{run.stage}: {summary(info)}, {group.world_size} worker(s)", flush=True)
        stats = train_steps(run, group, cfg.max_steps, cfg.logging_steps)
        extra, save_args = after(group, stats) if after else ({}, ())
        group.run("save_model", str(run.workdir / "model"), *save_args)
    metrics = {
        "truncated": info["truncated"],
        "workers": group.world_size,
        "trainable_params": info["trainable_params"],
        **extra,
    }
    return info, stats, metrics


#: The statistics a progress line shows, of those a one-group stage's step returns.
PROGRESS_METRICS = ("loss", "accuracy", "reward_accuracy")


def train_steps(run, group: WorkerGroup, max_steps: int, logging_steps: int) -> dict:
    """The driver's loop of a one-group training stage (SFT, reward model, preference): resume from the
    newest checkpoint, then `train_step` on every rank per step, logging rank 0's (global) statistics (and on
    CUDA the ranks' largest peak of GPU memory) and checkpointing at each checkpoint step (run.saves_at). Returns the last step's statistics ({} when none ran).

    Each step's calls are queued on the workers before its results are read: the peak right behind the step, and
    the next step too unless this one is checkpointed (its state must be saved first). So between steps the
    GPU waits for no round trip to this process, nor for its logging."""
    run.placements.append(group.placement)  # what the stage held, for its cost
    start = run.resume(lambda uri: group.run("load_state", uri), max_steps)
    stats: dict = {}
    queued = group.run_async("train_step") if start < max_steps else None
    for step in range(start + 1, max_steps + 1):
        logged = step % logging_steps == 0 or step == max_steps
        peaks = group.run_async("gpu_peak_gb") if logged and group.placement.use_gpu else []
        current, queued = queued, None
        if step < max_steps and not run.saves_at(step):
            queued = group.run_async("train_step")
        stats = ray.get(current)[0]
        if logged:
            gb = [g for g in ray.get(peaks) if g is not None]
            run.tracker.log(step, {**stats, **({"gpu_peak_gb": round(max(gb), 2)} if gb else {})})
        run.tracker.progress(step, max_steps, {k: v for k, v in stats.items() if k in PROGRESS_METRICS})
        run.checkpoint(step, lambda local, uri: merge_uploads(group.run("save_state", uri)))
        if queued is None and step < max_steps:
            queued = group.run_async("train_step")
    return stats
