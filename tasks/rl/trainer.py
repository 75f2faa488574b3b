"""The RL controller: places the worker groups (tasks.rl.placement), then loops generate → score → advantages →
update: each step's rollout comes from the scheduler (tasks.rl.rollouts), which drives the rollout engines through
their slot (tasks.rl.engine_slots).

    actor (policy + rollout engine)   reference          critic (gae only)     reward models
    ActorWorker × N                   ReferenceWorker × N  CriticWorker × N     RewardWorker × N

Each group is one data-parallel world on its own placement group, or shares one with others
(--colocate_actor_ref, --colocate_critic_reward, --colocate_all_models). With --lora_rank there is
no reference group: the actor scores the reference log-probabilities itself, with its adapters off;
with KL off there is no reference at all. This driver holds no model: it takes each step's rollout from its scheduler, shards work
over the groups' ranks, computes advantages on the whole batch (tasks.rl.advantages), plans the
minibatches, logs, and checkpoints.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from tasks.common import manifest as manifests
from tasks.common import resume_check, storage
from tasks.common.config import ConfigError
from tasks.common.nn import data, lora
from tasks.common.nn.engines.rollout import Rollout
from tasks.common.nn.environment import EnvError, check_environment, load_environment
from tasks.common.nn.models import is_vision_model, load_tokenizer, resolve_model
from tasks.common.nn.workers import cluster_has_gpus, connect_ray, gather, merge_uploads, shard
from tasks.common.stage import StageRun
from tasks.rl.config import RLConfig
from tasks.rl.experience import Experience, make_experience, response_lengths
from tasks.rl.images import refuse_for_text, vision_setup
from tasks.rl.kl_controller import make_kl_controller
from tasks.rl.placement import place
from tasks.rl.prompts import load_prompts
from tasks.rl.rollouts import RolloutScheduler

#: What a resume is checked on (tasks.common.resume_check): each step's, remembered in every checkpoint.
CHECKED_METRICS = ("reward", "kl", "entropy", "grad_norm")
HISTORY_FILE = (
    "metrics_history.json"  # in a checkpoint's controller/: the last resume_check.WINDOW steps' CHECKED_METRICS
)


class Controller:
    """The RL loop's state on the driver, and the groups it drives."""

    def __init__(self, cfg: RLConfig, run: StageRun):
        self.cfg, self.run = cfg, run
        connect_ray()
        has_gpus = cluster_has_gpus()
        engine, why = cfg.choose_rollout_engine(has_gpus, importlib.util.find_spec("vllm") is not None)
        self.cfg = cfg = cfg.with_rollout_engine(engine)
        print(f"rl: rollout engine {engine} ({why})", flush=True)
        if cfg.vllm_num_engines and not has_gpus:
            raise ConfigError(
                "vllm_num_engines: vLLM engines need GPUs and the vllm package, and this Ray cluster has no GPUs; "
                "use --vllm_num_engines 0 (transformers generate in the actor workers)"
            )
        path = resolve_model(run.input("pretrain", cfg.pretrain))
        self.vision = is_vision_model(path)  # a vision-language policy: prompts with images (tasks/rl/images.py)
        if self.vision:
            cfg, self.tokenizer, self.prompts = vision_setup(cfg, run, path)
            self.cfg = cfg
        else:
            refuse_for_text(cfg)
            self.tokenizer = load_tokenizer(path)
            self.prompts = load_prompts(cfg, run, self.tokenizer)
        flash = cfg.flash_attn and has_gpus and importlib.util.find_spec("flash_attn") is not None
        packed, why = cfg.choose_packing(flash_attention=flash, vision=self.vision)
        self.cfg = cfg = dataclasses.replace(cfg, packing_samples=packed)
        print(f"rl: packing_samples {packed} ({why})", flush=True)
        if cfg.env_path:  # a file that does not load or reset fails here, before any worker starts
            cfg.env_path = run.code_input("env_path", cfg.env_path, EnvError)  # the workers import exactly these bytes
            check_environment(load_environment(cfg.env_path), self.prompts.rows[0], cfg.env_step_timeout)
        if cfg.pretrain_data:  # PPO-ptx rows: the actor workers read them; checked and recorded here first
            data.load_rows(
                run.input("pretrain_data", cfg.pretrain_data), cfg.pretrain_split, [cfg.input_key, cfg.output_key], 1
            )
        self.steps = (
            cfg.num_episodes * (len(self.prompts.ids) // cfg.rollout_batch_size) if cfg.num_episodes else cfg.max_steps
        )
        if self.steps < 1:
            raise ConfigError(
                f"num_episodes: {len(self.prompts.ids)} prompts make no rollout batch of {cfg.rollout_batch_size}; lower rollout_batch_size"
            )
        group = cfg.rollout_batch_size * cfg.n_samples_per_prompt
        self.updates = self.steps * cfg.max_epochs * (group // cfg.train_batch_size)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.kl_ctl = make_kl_controller(cfg.init_kl_coef, cfg.kl_target or None, cfg.kl_horizon)
        self.history: list[
            dict
        ] = []  # the newest steps' CHECKED_METRICS, checkpointed: what a resume is checked against
        self.steps_done = 0  # updates this process ran (the resumed ones not counted): a resume must reach self.steps
        placed = place(cfg, run, self.tokenizer.pad_token_id, self.updates)
        self.layout, self.placements, self.groups, self.engine, self.reward = (
            placed.layout,
            placed.placements,
            placed.groups,
            placed.engine,
            placed.reward,
        )
        self.rollouts = RolloutScheduler(cfg, self.prompts, self.tokenizer, self.engine, self.reward, self.steps)
        layout = ", ".join(f"[{' + '.join(m)}] × {self.groups[m[0]].world_size}" for m in self.layout)
        print(
            f"rl: {len(self.prompts.ids)} prompts ({self.prompts.truncated} cut to {cfg.prompt_max_len} tokens), {self.steps} steps; placement groups {layout}",
            flush=True,
        )
        where = ", ".join(
            f"{role} on node(s) {sorted({n[:8] for n in g.nodes})} via {g.rendezvous}"
            for role, g in self.groups.items()
        )
        print(f"rl: driver on node {self.groups['actor'].driver_node[:8]}; {where}", flush=True)
        if not cfg.uses_kl():
            print("rl: KL off (init_kl_coef 0, no kl_target): no reference model", flush=True)
        elif "ref" not in self.groups:
            print("rl: reference = the actor's base with its LoRA adapters off (no reference model loaded)", flush=True)

    # ------------------------------------------------------------------ one step

    def in_waves(self, calls: dict[str, tuple[str, list, tuple]]) -> dict[str, list]:
        """Run {role: (method, per-rank shards, extra args)}: groups on separate placement groups at
        once, groups sharing one (colocated) one after another, as they share its devices."""
        waves: list[dict] = []
        for members in self.layout:
            for k, role in enumerate(r for r in members if r in calls):
                if len(waves) <= k:
                    waves.append({})
                method, shards, args = calls[role]
                waves[k][role] = (method, shards, args)
        results = {}
        for wave in waves:
            futures = {
                role: self.groups[role].scatter_async(method, shards, *args)
                for role, (method, shards, args) in wave.items()
            }
            results.update({role: gather(f) for role, f in futures.items()})
        return results

    def score(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Old log-probabilities (actor; None when not needed), reference log-probabilities and values of a rollout."""
        rows = list(range(rollout.sequences.size(0)))
        # LoRA: the actor returns (log-probabilities, reference ones); KL off: no reference at all.
        own_reference = "ref" not in self.groups and self.cfg.uses_kl()
        actor_method = (
            ("reference_logprobs" if own_reference else "logprobs") if self.cfg.needs_old_logprobs() else None
        )
        calls = {
            role: (method, [rollout.select(r) for r in shard(rows, self.groups[role].world_size)], ())
            for role, method in (("actor", actor_method), ("ref", "logprobs"), ("critic", "values"))
            if method and role in self.groups
        }
        parts = self.in_waves(calls)
        if own_reference:
            parts["actor"], parts["ref"] = zip(*parts["actor"])
        results = {role: torch.cat(list(p)) for role, p in parts.items()}
        return results.get("actor"), results.get("ref", results.get("actor")), results.get("critic")

    def minibatch_plan(self, n: int) -> list[torch.Tensor]:
        """Row indices of each minibatch: max_epochs shuffled passes in train_batch_size pieces."""
        return [
            index
            for _ in range(self.cfg.max_epochs)
            for index in torch.randperm(n, generator=self.generator).split(self.cfg.train_batch_size)
        ]

    def step(self, step: int) -> Experience:
        cfg = self.cfg
        t0 = time.time()
        rollout, scores, timing = self.rollouts.rollout(step)
        t1 = time.time()
        logprobs, ref_logprobs, values = self.score(rollout)  # the engine's against these: the actor's train logs it
        kl_coef = self.kl_ctl.value
        exp = make_experience(rollout, logprobs, ref_logprobs, values, scores, cfg, kl_coef)
        t2 = time.time()
        plan = self.minibatch_plan(exp.sequences.size(0))
        # Each rank gets its share of every minibatch; actor and critic train at once unless colocated.
        calls = {
            role: ("train", per_rank(exp, plan, self.groups[role].world_size), args)
            for role, args in (("actor", (kl_coef,)), ("critic", ()))
            if role in self.groups
        }
        stats = {k: v for ranks in self.in_waves(calls).values() for k, v in ranks[0].items()}
        t3 = time.time()
        self.engine.sync_weights(step)
        t4 = time.time()
        sequence_kl = exp.kl.sum(-1).mean().item()
        self.kl_ctl.update(sequence_kl, n_steps=exp.sequences.size(0))
        self.steps_done += 1
        # Every step, whatever --logging_steps: a resume is checked against the steps right before it.
        record = {
            "step": step,
            "reward": scores.mean().item(),
            "kl": sequence_kl,
            "entropy": stats.get("entropy"),
            "grad_norm": stats.get("grad_norm"),
        }
        self.history = resume_check.remember(self.history, record)
        self.run.tracker.progress(step, self.steps, {"reward": record["reward"], "kl": sequence_kl})
        if step % cfg.logging_steps == 0 or step == self.steps:
            self.run.tracker.log(
                step,
                {
                    "reward": scores.mean().item(),
                    "reward_std": scores.std().item(),
                    "kl": sequence_kl,
                    "kl_coef": kl_coef,
                    **stats,
                    **response_lengths(exp.action_mask.sum(-1), None if cfg.env_path else cfg.generate_max_len),
                    **timing,
                    "time_inference_s": t2 - t1,
                    "time_train_s": t3 - t2,
                    "time_weight_sync_s": t4 - t3,
                    "time_step_s": t4 - t0,
                },
            )
        return exp

    # ------------------------------------------------------------------ state

    def trained_groups(self) -> list[str]:
        return [role for role in ("actor", "critic") if role in self.groups]

    def save_state(self, local: Path, uri: str) -> dict:
        """Each trained group's ranks save and upload their own files under <uri>/<role>/ (on their own
        nodes); the controller's state goes into `local`. Returns what the workers uploaded."""
        import ray

        futures = {
            role: self.groups[role].run_async("save_state", storage.join(uri, role)) for role in self.trained_groups()
        }
        uploaded = {}
        for role, ranks in futures.items():
            uploaded.update(merge_uploads(ray.get(ranks), prefix=role))
        (local / "controller").mkdir()
        torch.save(
            {
                "sampler": self.rollouts.sampler.state_dict(),
                "generator": self.generator.get_state(),
                "kl": self.kl_ctl.state_dict(),
            },
            local / "controller" / "controller.pt",
        )
        (local / "controller" / HISTORY_FILE).write_text(
            json.dumps({"window": resume_check.WINDOW, "steps": self.history}) + "\n"
        )
        return uploaded

    def load_state(self, uri: str) -> None:
        """Each trained group's ranks fetch <uri>/<role>/ into their own node's scratch; the controller its own part."""
        gather([self.groups[role].run_async("load_state", uri, role) for role in self.trained_groups()])
        local = tempfile.mkdtemp(prefix="rlhf-rl-resume-")
        try:
            path, _ = manifests.fetch(uri, local, subdir="controller")
            state = torch.load(path / "controller.pt", weights_only=False)
            # A checkpoint written before the history was kept has none: its resume is not band-checked (train says so).
            history = json.loads((path / HISTORY_FILE).read_text())["steps"] if (path / HISTORY_FILE).is_file() else []
        finally:
            shutil.rmtree(local, ignore_errors=True)
        self.rollouts.sampler.load_state_dict(state["sampler"])
        self.generator.set_state(state["generator"])
        self.kl_ctl.load_state_dict(state["kl"])
        self.history = history

    def shutdown(self) -> None:
        for group in self.groups.values():
            group.shutdown()
        for placement in self.placements:
            placement.remove()


def per_rank(exp: Experience, plan: list[torch.Tensor], world_size: int) -> list[list[Experience]]:
    """For each rank of a group, its share of every minibatch of the plan."""
    out: list[list[Experience]] = [[] for _ in range(world_size)]
    for index in plan:
        for rank, rows in enumerate(shard(index, world_size)):
            out[rank].append(exp.minibatch(rows))
    return out


def check_resumed_step(start: int, step: int, last: int, before: list[dict], record: dict) -> None:
    """Fail in one line when resumed step `step`'s CHECKED_METRICS leave the band of the steps before the interruption;
    say so once the `last` step checked passed."""
    problem = resume_check.band_problem(before, record, CHECKED_METRICS)
    if problem:
        raise resume_check.ResumeCheckError(
            f"rl: resumed from the step {start} checkpoint, step {step}'s {problem}: the resumed state or flags differ from the run "
            "that wrote it (e.g. a changed learning rate, an optimizer state not restored); nothing committed, the checkpoints left as they were"
        )
    if step == last:
        print(
            f"rl: resumed steps {start + 1}-{step} inside the band of steps {before[0]['step']}-{before[-1]['step']} ({', '.join(CHECKED_METRICS)})",
            flush=True,
        )


def train(cfg: RLConfig, run: StageRun) -> None:
    controller = Controller(cfg, run)
    try:
        start = run.resume(controller.load_state, controller.steps)
        if start:
            # The engines start from the policy on disk: give them the resumed weights. Rollouts in flight at the
            # checkpoint are lost (the sampler had drawn their prompts); start only the steps left.
            controller.engine.sync_weights(start)
            controller.rollouts.started = start
        before = list(
            controller.history
        )  # the steps the checkpoint remembers: the resumed ones must stay in their band
        if start and len(before) < resume_check.MIN_HISTORY:  # none: a checkpoint from before the history was kept
            print(
                f"rl: the step {start} checkpoint remembers {len(before)} steps' metrics, fewer than {resume_check.MIN_HISTORY}; the resumed steps are not band-checked",
                flush=True,
            )
        last_checked = (
            min(start + resume_check.CHECKED_STEPS, controller.steps)
            if start and len(before) >= resume_check.MIN_HISTORY
            else 0
        )
        exp = None
        for step in range(start + 1, controller.steps + 1):
            exp = controller.step(step)
            if step <= last_checked:
                # Before this step's checkpoint: a resume that went astray leaves the checkpoints as they were.
                check_resumed_step(start, step, last_checked, before, controller.history[-1])
            run.checkpoint(step, controller.save_state)
        problem = resume_check.steps_problem(controller.steps, start, start + controller.steps_done)
        if problem:  # verl#7401: a resume that exits 0 without its remaining updates
            raise resume_check.ResumeCheckError(f"rl: refusing to commit: {problem}")
        # Rank 0 of each group uploads its model from its own node; the manifest below lists those files.
        models = {"model": ("actor", [cfg.save_path] if cfg.save_path else [])}
        if cfg.save_value_network and "critic" in controller.groups:
            models["critic"] = ("critic", [])
        uploaded = {}
        for folder, (role, also) in models.items():
            files = controller.groups[role].run("upload_model", [run.remote_output(folder), *also])[0]
            uploaded.update(merge_uploads([files], prefix=folder))
    finally:
        controller.shutdown()
    final = (
        {"final_reward": exp.scores.mean().item(), "final_kl": exp.kl.sum(-1).mean().item()} if exp is not None else {}
    )
    groups = controller.groups
    run.commit(
        metrics={
            **final,
            "steps": controller.steps,
            "truncated": controller.prompts.truncated,
            # a vision-language policy's prompts too long with their image tokens: dropped, never cut
            **({"prompts_dropped": controller.prompts.dropped} if controller.vision else {}),
            "actor_workers": groups["actor"].world_size,
            "ref_workers": groups["ref"].world_size if "ref" in groups else 0,
        },
        uploaded=uploaded,
        model="model",
        # What the resume check verified: every planned update ran, here or before the checkpoint resumed from.
        planned_steps=controller.steps,
        resumed_from_step=start,
        done_steps=start + controller.steps_done,
        rollout_engine=controller.cfg.rollout_engine,  # what --rollout_engine auto chose
        **lora.manifest_fields(cfg),
    )
    if cfg.save_path:
        print(f"rl: final model also written to {cfg.save_path}", flush=True)
