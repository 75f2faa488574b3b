"""DPO / IPO / cDPO on preference pairs and KTO on unpaired examples, as one data-parallel worker group.

Each worker holds the policy (DeepSpeed) and, unless --reference_free, the frozen reference (with
--lora_rank and no --ref_pretrain, the policy's own base with its adapters off: no second copy); with
--ref_offload the reference scores the whole dataset once at setup and is freed. A sequence's
log-probability is the sum over its response tokens (prompt tokens masked out).

KTO's KL baseline z0 pairs each prompt with the next example's completion ("mismatched", index
i+1 mod N, so it can be precomputed too) and averages the policy/reference log-ratio over the
global batch.

A vision-language model (its config has a vision_config) takes each prompt's images (--image_key) in the policy's
and the reference's forward passes alike (a KTO mismatched pair keeps its prompt's images); an example too long is
dropped rather than cut, and --freeze_visual_encoder keeps the vision tower as it is (LoRA adapters in it too).
"""

from __future__ import annotations

import torch

from tasks.common.nn import data, lora, vision
from tasks.common.nn.losses import sft_loss
from tasks.common.nn.models import (
    is_vision_model,
    kernels,
    load_causal_lm,
    load_tokenizer,
    resolve_model,
    sequence_logprobs,
)
from tasks.common.nn.single_group import train_single_group
from tasks.common.nn.strategy import DeepSpeedStrategy
from tasks.common.nn.vision_pairs import refuse_text_model, tokenize_vlm_examples, vlm_summed_logps
from tasks.common.nn.workers import TrainingWorker, shard
from tasks.common.stage import StageRun
from tasks.preference.config import PreferenceConfig
from tasks.preference.losses import dpo_loss, kto_kl_baseline, kto_loss


def response_keys(cfg: PreferenceConfig) -> list[str]:
    return [cfg.completion_key] if cfg.method == "kto" else [cfg.chosen_key, cfg.rejected_key]


def keys(cfg: PreferenceConfig) -> list[str]:
    if cfg.method == "dpo":
        return [cfg.prompt_key, cfg.chosen_key, cfg.rejected_key]
    return [cfg.prompt_key, cfg.completion_key, cfg.label_key]


def tokenize(rows, tokenizer, cfg: PreferenceConfig) -> tuple[list[list[int]], list[list[list[int]]], int]:
    """(prompt ids, responses ids per column, number of sequences cut to max_len), encoded as SFT, the
    reward model and RL encode them. A long example loses the start of its shared prompt first, then,
    when a response alone does not fit, that response's end (data.fit)."""
    prompts, responses, truncated = [], [], 0
    columns = keys(cfg)[1:2] if cfg.method == "kto" else keys(cfg)[1:]
    for row in zip(*(rows[k] for k in [cfg.prompt_key, *columns])):
        p, outs, cut = data.fit(
            data.encode_prompt(tokenizer, row[0], cfg.apply_chat_template),
            [data.encode_response(tokenizer, text, cfg.apply_chat_template) for text in row[1:]],
            cfg.max_len,
        )
        prompts.append(p)
        responses.append(outs)
        truncated += cut
    return prompts, responses, truncated


def summed_logps(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int, device) -> torch.Tensor:
    """Σ log π(response tokens | prompt) per sequence: [B]."""
    ids, mask = data.pad([p + r for p, r in zip(prompts, responses)], pad_id)
    loss_mask, _ = data.pad([[0] * len(p) + [1] * len(r) for p, r in zip(prompts, responses)], 0)
    ids, mask, loss_mask = ids.to(device), mask.to(device), loss_mask.to(device)
    return (sequence_logprobs(model, ids, mask) * loss_mask[:, 1:]).sum(-1)


class PreferenceWorker(TrainingWorker):
    def setup(self, cfg: PreferenceConfig) -> dict:
        self.cfg = cfg
        rows = data.load_rows(cfg.dataset, cfg.split, keys(cfg), cfg.max_samples)
        path = resolve_model(cfg.pretrain)
        self.vision, self.processor = is_vision_model(path), None
        kept = list(range(len(rows)))
        if self.vision:
            self.processor = vision.load_processor(path)
            self.tokenizer = self.processor.tokenizer
            self.prompts, self.responses, self.images, kept = tokenize_vlm_examples(
                rows,
                self.processor,
                cfg.prompt_key,
                response_keys(cfg),
                cfg.image_key,
                cfg.apply_chat_template,
                cfg.max_len,
                cfg.split,
            )
            truncated = 0
        else:
            refuse_text_model(cfg, {cfg.split: rows})
            self.tokenizer = load_tokenizer(path)
            self.prompts, self.responses, truncated = tokenize(rows, self.tokenizer, cfg)
            self.images = [[] for _ in self.prompts]
        labels = rows[cfg.label_key] if cfg.method == "kto" else []
        self.desirable = torch.tensor([bool(labels[i]) for i in kept]) if cfg.method == "kto" else None
        n = len(self.prompts)
        # KTO's mismatched pairs: prompt i (and its images) with the completion of example i+1.
        self.mismatched = [self.responses[(i + 1) % n] for i in range(n)]
        self.strategy = DeepSpeedStrategy.for_training(cfg, self.world_size)
        self.micro = self.strategy.micro_batch_size
        model = lora.apply_lora(self._load(path), cfg)
        if self.vision and cfg.freeze_visual_encoder:
            vision.freeze_visual_encoder(model)  # after LoRA: its adapters inside the tower stay as they are too
        counts = lora.param_counts(model)  # before ZeRO-3 partitions the parameters
        self.engine = self.strategy.prepare(
            model, cfg.learning_rate, cfg.max_steps, cfg.lr_warmup_steps, lr_scheduler=cfg.lr_scheduler
        )
        self.sampler = data.BatchSampler(n, cfg.train_batch_size, cfg.seed)
        self.reference, self.ref_logps = None, None
        if not cfg.reference_free:
            self.reference = self._load_reference(cfg)
            if cfg.ref_offload:
                self.ref_logps = {column: self._reference_logps(list(range(n)), column) for column in self._columns()}
                self.reference = None  # freed: its log-probabilities are all it was needed for
        self.engine.train()
        return {**counts, "examples": n, "truncated": truncated, "dropped": len(rows) - len(kept)}

    def _load(self, path: str):
        if self.vision:
            return vision.load_vision_lm(path, flash_attn=self.cfg.flash_attn)
        return load_causal_lm(path, **kernels(self.cfg))

    def _load_reference(self, cfg: PreferenceConfig):
        """The frozen reference: with LoRA (and no --ref_pretrain) the policy's own base, adapters off, so
        no second copy of the weights; otherwise a model of its own."""
        if lora.enabled(cfg) and not cfg.ref_pretrain:
            return lora.FrozenBase(self.engine.module)
        return self.strategy.frozen(self._load(resolve_model(cfg.ref_pretrain or cfg.pretrain)))

    def _columns(self) -> list[str]:
        return ["chosen", "rejected"] if self.cfg.method == "dpo" else ["completion", "mismatched"]

    def _sequences(self, rows: list[int], column: str) -> tuple[list[list[int]], list[list[int]], list[list]]:
        """(prompts, responses, the prompts' images) of `rows` in `column`."""
        prompts, images = [self.prompts[i] for i in rows], [self.images[i] for i in rows]
        if column == "mismatched":
            return prompts, [self.mismatched[i][0] for i in rows], images
        k = 1 if column == "rejected" else 0
        return prompts, [self.responses[i][k] for i in rows], images

    def _logps(self, model, prompts, responses, images) -> torch.Tensor:
        pad, device = self.tokenizer.pad_token_id, self.strategy.device
        if self.vision:
            return vlm_summed_logps(model, self.processor, prompts, responses, images, pad, device)
        return summed_logps(model, prompts, responses, pad, device)

    @torch.no_grad()
    def _no_grad_logps(self, model, rows: list[int], column: str) -> torch.Tensor:
        size = 32 if self.vision else 256  # a VLM's batch carries its pixels too
        parts = [self._sequences(rows[i : i + size], column) for i in range(0, len(rows), size)]
        return torch.cat([self._logps(model, *part) for part in parts])

    def _reference_logps(self, rows: list[int], column: str) -> torch.Tensor:
        if self.ref_logps is not None:
            return self.ref_logps[column][rows].to(self.strategy.device)
        if self.reference is None:  # reference-free DPO
            return torch.zeros(len(rows), device=self.strategy.device)
        return self._no_grad_logps(self.reference, rows, column)

    def _policy_logps(self, rows: list[int], columns: list[str]) -> list[torch.Tensor]:
        """The policy's log-probabilities of several columns in one forward pass."""
        prompts, responses, images = [], [], []
        for column in columns:
            p, r, i = self._sequences(rows, column)
            prompts += p
            responses += r
            images += i
        out = self._logps(self.engine, prompts, responses, images)
        return list(out.split(len(rows)))

    def train_step(self) -> dict:
        """One optimizer step on this worker's share of the next global batch; global means of the statistics."""
        cfg = self.cfg
        batch = shard(self.sampler.next(), self.world_size)[self.rank]
        chunks = [batch[i : i + self.micro] for i in range(0, len(batch), self.micro)]
        z0 = None
        if cfg.method == "kto":
            policy = self._no_grad_logps(self.engine.module, batch, "mismatched")
            # mean over the world first, then the clamp (kto_kl_baseline): clamping per worker biases z0 up
            z0 = kto_kl_baseline(
                policy,
                self._reference_logps(batch, "mismatched"),
                reduce_mean=lambda local: self.strategy.all_reduce(local, op="mean"),
            )
        sums: dict[str, torch.Tensor] = {}
        for chunk in chunks:
            if cfg.method == "dpo":
                chosen, rejected = self._policy_logps(chunk, ["chosen", "rejected"])
                loss, chosen_rewards, rejected_rewards = dpo_loss(
                    chosen,
                    rejected,
                    self._reference_logps(chunk, "chosen"),
                    self._reference_logps(chunk, "rejected"),
                    beta=cfg.beta,
                    loss_type=cfg.loss_type,
                    label_smoothing=cfg.label_smoothing,
                    reference_free=cfg.reference_free,
                )
                if cfg.nll_loss_coef:
                    tokens = sum(len(self.responses[i][0]) for i in chunk)
                    loss = loss + cfg.nll_loss_coef * sft_loss(chosen, torch.ones_like(chosen), tokens)
                stats = {
                    "loss": loss.detach(),
                    "reward_accuracy": (chosen_rewards > rejected_rewards).float().mean(),
                    "margin": (chosen_rewards - rejected_rewards).mean(),
                    "chosen_reward": chosen_rewards.mean(),
                    "rejected_reward": rejected_rewards.mean(),
                }
            else:
                (logps,) = self._policy_logps(chunk, ["completion"])
                desirable = self.desirable[chunk].to(self.strategy.device)
                loss, rewards = kto_loss(
                    logps,
                    self._reference_logps(chunk, "completion"),
                    desirable,
                    z0,
                    beta=cfg.beta,
                    desirable_weight=cfg.desirable_weight,
                    undesirable_weight=cfg.undesirable_weight,
                )
                stats = {
                    "loss": loss.detach(),
                    "kl": z0,
                    # reward separation: mean over the desirable minus mean over the undesirable (0 if one is absent)
                    "margin": _mean(rewards[desirable]) - _mean(rewards[~desirable]),
                }
            self.engine.backward(loss)
            self.engine.step()
            for key, value in stats.items():
                sums[key] = sums.get(key, 0) + value.float()
        means = self.strategy.all_reduce(torch.stack(list(sums.values())), op="mean") / len(chunks)
        return {**dict(zip(sums, means.tolist())), "lr": self.engine.get_lr()[0]}


def _mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean() if x.numel() else torch.zeros((), device=x.device)


def train(cfg: PreferenceConfig, run: StageRun) -> None:
    if cfg.ref_pretrain:
        run.input("ref_pretrain", cfg.ref_pretrain)
    info, stats, metrics = train_single_group(
        run,
        cfg,
        PreferenceWorker,
        lambda info: (
            f"{cfg.method}, {info['examples']} examples, {info['truncated']} sequences cut to {cfg.max_len} tokens"
            + (f", {info['dropped']} with images dropped as longer" if info["dropped"] else "")
        ),
    )
    run.commit(
        metrics={
            **{k: round(v, 5) for k, v in stats.items()},
            "method": cfg.method,
            "steps": cfg.max_steps,
            "examples": info["examples"],
            **metrics,
        },
        model="model",
        **lora.manifest_fields(cfg),
    )
