"""Supervised fine-tuning with the loss masked to the response tokens (and the token closing them:
EOS, or the chat template's end of turn). With --apply_chat_template a prompt may be a whole
conversation (system, user and earlier assistant turns): only the final answer is learned. A vision-language
model (its config has a vision_config) trains on rows with images (--image_key): each row's images go to the model
with it, rows too long are dropped rather than cut, and --freeze_visual_encoder keeps the vision tower as it is.

The driver places `num_nodes × num_gpus_per_node` SFTWorkers (one data-parallel world) and steps
them; each draws the same global batch from an identically seeded sampler and trains on its share.
"""

from __future__ import annotations

import torch

from tasks.common.config import ConfigError
from tasks.common.nn import data, lora, vision
from tasks.common.nn.models import is_vision_model, kernels, load_causal_lm, load_tokenizer, resolve_model
from tasks.common.nn.single_group import train_single_group
from tasks.common.nn.strategy import DeepSpeedStrategy
from tasks.common.nn.supervised import micro_batch_loss, tokenize_rows, tokenize_vlm_rows, vlm_micro_batch_loss
from tasks.common.nn.workers import TrainingWorker, shard
from tasks.common.stage import StageRun
from tasks.sft.config import SFTConfig


def tokenize(rows, tokenizer, cfg: SFTConfig) -> tuple[list[list[int]], list[list[int]], int]:
    return tokenize_rows(rows, tokenizer, cfg.input_key, cfg.output_key, cfg.apply_chat_template, cfg.max_len)


class SFTWorker(TrainingWorker):
    def setup(self, cfg: SFTConfig) -> dict:
        rows = data.load_rows(cfg.dataset, cfg.dataset_split, [cfg.input_key, cfg.output_key], cfg.max_samples)
        path = resolve_model(cfg.pretrain)
        self.cfg, self.vision = cfg, is_vision_model(path)
        if self.vision:
            model, dropped = self.setup_vision(rows, path, cfg)
            truncated = 0
        else:
            self.tokenizer = load_tokenizer(path)
            self.ids, self.masks, truncated = tokenize(rows, self.tokenizer, cfg)
            model, dropped = load_causal_lm(path, **kernels(cfg)), 0
        self.strategy = DeepSpeedStrategy.for_training(cfg, self.world_size)
        self.micro = self.strategy.micro_batch_size
        model = lora.apply_lora(model, cfg)
        if self.vision and cfg.freeze_visual_encoder:
            vision.freeze_visual_encoder(model)  # again after LoRA: its adapters inside the tower stay as they are too
        counts = lora.param_counts(model)  # before ZeRO-3 partitions the parameters
        self.engine = self.strategy.prepare(
            model, cfg.learning_rate, cfg.max_steps, cfg.lr_warmup_steps, lr_scheduler=cfg.lr_scheduler
        )
        self.sampler = data.BatchSampler(len(self.ids), cfg.train_batch_size, cfg.seed)
        self.engine.train()
        return {"rows": len(self.ids), "truncated": truncated, "dropped": dropped, **counts}

    def setup_vision(self, rows, path: str, cfg: SFTConfig):
        """The vision-language model and its processor, and the rows' ids, masks and images; returns (model,
        rows dropped for length)."""
        if cfg.packing_samples:
            raise ConfigError(
                f"packing_samples: {cfg.pretrain} is a vision-language model, whose rows cannot be packed; drop --packing_samples"
            )
        self.processor = vision.load_processor(path)
        self.tokenizer = self.processor.tokenizer
        self.ids, self.masks, self.images, dropped = tokenize_vlm_rows(
            rows, self.processor, cfg.input_key, cfg.output_key, cfg.image_key, cfg.apply_chat_template, cfg.max_len
        )
        model = vision.load_vision_lm(path, flash_attn=cfg.flash_attn)
        if cfg.freeze_visual_encoder:
            vision.freeze_visual_encoder(model)
        return model, dropped

    def train_step(self) -> dict:
        """One optimizer step on this worker's share of the next global batch; the global mean loss."""
        batch = shard(self.sampler.next(), self.world_size)[self.rank]
        masks = [self.masks[i][1:] for i in batch]  # a token's loss sits at the position before it
        chunks = [batch[i : i + self.micro] for i in range(0, len(batch), self.micro)]
        # Every micro-batch is normalised by the global batch's token count: see sft_loss.
        tokens = self.strategy.all_reduce(sum(map(sum, masks)))
        micro_batches_in_step = len(chunks) * self.world_size
        total = torch.zeros((), device=self.strategy.device)
        for chunk in chunks:
            ids, masks = [self.ids[i] for i in chunk], [self.masks[i] for i in chunk]
            pad, packed, device, share = (
                self.tokenizer.pad_token_id,
                self.cfg.packing_samples,
                self.strategy.device,
                tokens / micro_batches_in_step,
            )
            if self.vision:
                images = [self.images[i] for i in chunk]
                loss = vlm_micro_batch_loss(self.engine, self.processor, ids, masks, images, pad, packed, device, share)
            else:
                loss = micro_batch_loss(self.engine, ids, masks, pad, packed, device, share)
            self.engine.backward(loss)
            self.engine.step()
            total += loss.detach()
        mean_loss = self.strategy.all_reduce(total) / micro_batches_in_step
        return {"loss": mean_loss.item(), "lr": self.engine.get_lr()[0], "epoch": self.sampler.epoch}


def train(cfg: SFTConfig, run: StageRun) -> None:
    def summary(info: dict) -> str:
        dropped = (
            f", {info['dropped']} with images dropped as longer than {cfg.max_len} tokens" if info["dropped"] else ""
        )
        return f"{info['rows']} rows, {info['truncated']} truncated to {cfg.max_len} tokens{dropped}, {info['trainable_params']} of {info['total_params']} parameters trained"

    info, stats, metrics = train_single_group(run, cfg, SFTWorker, summary)
    run.commit(
        metrics={
            "train_loss": round(stats["loss"], 5) if stats else None,
            "steps": cfg.max_steps,
            "rows": info["rows"],
            **metrics,
        },
        model="model",
        **lora.manifest_fields(cfg),
    )
