"""Reward-model training with the Bradley-Terry loss; stores reward mean/std for normalisation.

The statistics are written into the model's config (`reward_mean`, `reward_std`), so whoever loads
the checkpoint with AutoModelForSequenceClassification gets them too.

A vision-language model (its config has a vision_config) trains as a VisionRewardModel (tasks/common/nn/
vision_reward.py: its backbone and a value head): a pair's chosen and rejected sequences share the prompt's images
(--image_key), a pair too long is dropped rather than cut, --freeze_visual_encoder keeps the vision tower as it is,
and LoRA is merged into the saved weights (the folder loads with VisionRewardModel.from_pretrained).
"""

from __future__ import annotations

import torch

from tasks.common.config import ConfigError
from tasks.common.nn import data, lora, vision
from tasks.common.nn.losses import bradley_terry_loss
from tasks.common.nn.models import (
    is_vision_model,
    kernels,
    load_scalar_model,
    load_tokenizer,
    resolve_model,
    sequence_scores,
)
from tasks.common.nn.packed import packed_scores
from tasks.common.nn.single_group import train_single_group
from tasks.common.nn.strategy import DeepSpeedStrategy
from tasks.common.nn.vision_pairs import PACKING_REFUSED, refuse_text_model, tokenize_vlm_examples
from tasks.common.nn.vision_reward import VisionRewardModel, inject_lora, vlm_sequence_scores
from tasks.common.nn.workers import TrainingWorker, shard
from tasks.common.stage import StageRun
from tasks.reward_model.config import RewardModelConfig


def tokenize_pairs(rows, tokenizer, cfg: RewardModelConfig) -> tuple[list[list[int]], list[list[int]], int]:
    """(chosen sequences, rejected sequences, number of sequences cut to max_len), encoded as SFT, RL and
    DPO encode them. A long pair loses the start of its shared prompt first (data.fit): the score is read
    at the last token, the response's closing one, which must stay."""
    chosen, rejected, truncated = [], [], 0
    for prompt, good, bad in zip(rows[cfg.prompt_key], rows[cfg.chosen_key], rows[cfg.rejected_key]):
        p, (c, r), cut = data.fit(
            data.encode_prompt(tokenizer, prompt, cfg.apply_chat_template),
            [data.encode_response(tokenizer, text, cfg.apply_chat_template) for text in (good, bad)],
            cfg.max_len,
        )
        chosen.append(p + c)
        rejected.append(p + r)
        truncated += cut
    return chosen, rejected, truncated


def pair_scores(
    model, chosen, rejected, pad_id, device, packed: bool = False, processor=None, images=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of chosen and rejected sequences, in one forward pass: padded to one width, or packed into
    one row (--packing_samples). A vision-language model's (`processor` given) see each pair's `images` on both
    sides."""
    if processor is not None:
        scores = vlm_sequence_scores(model, processor, chosen + rejected, images + images, pad_id, device)
    elif packed:
        ids, positions, index = data.pack(chosen + rejected)
        scores = packed_scores(model, ids.to(device), positions.to(device), index)
    else:
        ids, mask = data.pad(chosen + rejected, pad_id)
        scores = sequence_scores(model, ids.to(device), mask.to(device))
    return scores[: len(chosen)], scores[len(chosen) :]


@torch.no_grad()
def evaluate_pairs(
    model, chosen, rejected, pad_id, device, batch_size=256, processor=None, images=None
) -> tuple[list[float], list[float]]:
    """Scores of held-out pairs: (chosen sequences', rejected sequences')."""
    chosen_scores, rejected_scores = [], []
    for i in range(0, len(chosen), batch_size):
        part = slice(i, i + batch_size)
        pictures = images[part] if images is not None else None
        c, r = pair_scores(model, chosen[part], rejected[part], pad_id, device, False, processor, pictures)
        chosen_scores += c.float().tolist()
        rejected_scores += r.float().tolist()
    return chosen_scores, rejected_scores


class RewardModelWorker(TrainingWorker):
    def setup(self, cfg: RewardModelConfig) -> dict:
        keys = [cfg.prompt_key, cfg.chosen_key, cfg.rejected_key]
        train_rows = data.load_rows(cfg.dataset, cfg.dataset_split, keys, cfg.max_samples)
        eval_rows = data.load_rows(cfg.dataset, cfg.eval_split, keys)
        path = resolve_model(cfg.pretrain)
        self.cfg, self.vision, self.processor = cfg, is_vision_model(path), None
        self.images = eval_images = None
        dropped = 0
        if self.vision:
            self.chosen, self.rejected, self.images, dropped = self.vision_pairs(train_rows, cfg.dataset_split, path)
            eval_chosen, eval_rejected, eval_images, _ = self.vision_pairs(eval_rows, cfg.eval_split, path)
            truncated = eval_truncated = 0
        else:
            refuse_text_model(cfg, {cfg.dataset_split: train_rows, cfg.eval_split: eval_rows})
            self.tokenizer = load_tokenizer(path)
            self.chosen, self.rejected, truncated = tokenize_pairs(train_rows, self.tokenizer, cfg)
            eval_chosen, eval_rejected, eval_truncated = tokenize_pairs(eval_rows, self.tokenizer, cfg)
        # This worker scores its share of the held-out pairs at the end.
        self.eval_chosen, self.eval_rejected = (
            shard(side, self.world_size)[self.rank] for side in (eval_chosen, eval_rejected)
        )
        self.eval_images = shard(eval_images, self.world_size)[self.rank] if self.vision else None
        # A micro-batch of n pairs is 2n sequences in one forward pass.
        self.strategy = DeepSpeedStrategy.for_training(cfg, self.world_size, sequences_per_item=2)
        self.micro = self.strategy.micro_batch_size // 2
        if self.vision:
            model = self.vision_model(path)
        else:
            # With LoRA the score head trains in full beside the adapters (lora.apply_lora).
            model = lora.apply_lora(load_scalar_model(path, **kernels(cfg)), cfg, scalar=True)
        counts = lora.param_counts(model)  # before ZeRO-3 partitions the parameters
        self.engine = self.strategy.prepare(
            model, cfg.learning_rate, cfg.max_steps, cfg.lr_warmup_steps, lr_scheduler=cfg.lr_scheduler
        )
        self.sampler = data.BatchSampler(len(self.chosen), cfg.train_batch_size, cfg.seed)
        self.engine.train()
        return {
            **counts,
            "pairs": len(self.chosen),
            "eval_pairs": len(eval_chosen),
            "truncated": truncated,
            "eval_truncated": eval_truncated,
            "dropped": dropped,
            "vision": self.vision,
        }

    def vision_pairs(self, rows, split: str, path: str):
        """(chosen sequences, rejected sequences, each pair's images, pairs dropped as too long) of a VLM's split."""
        cfg = self.cfg
        if cfg.packing_samples:
            raise ConfigError(PACKING_REFUSED.format(model=cfg.pretrain))
        if self.processor is None:
            self.processor = vision.load_processor(path)
            self.tokenizer = self.processor.tokenizer
        prompts, responses, images, kept = tokenize_vlm_examples(
            rows,
            self.processor,
            cfg.prompt_key,
            [cfg.chosen_key, cfg.rejected_key],
            cfg.image_key,
            cfg.apply_chat_template,
            cfg.max_len,
            split,
        )
        chosen, rejected = ([p + r[k] for p, r in zip(prompts, responses)] for k in (0, 1))
        return chosen, rejected, images, len(rows) - len(kept)

    def vision_model(self, path: str) -> VisionRewardModel:
        """The VLM's backbone with a value head; LoRA in the backbone; with --freeze_visual_encoder the tower
        frozen after LoRA, so no adapter inside it trains either."""
        model = VisionRewardModel.from_pretrained(path, flash_attn=self.cfg.flash_attn)
        inject_lora(model.backbone, self.cfg)
        if self.cfg.freeze_visual_encoder:
            vision.freeze_visual_encoder(model)
        return model

    def train_step(self) -> dict:
        """One optimizer step on this worker's share of the next global batch; global means of the statistics.
        Every micro-batch holds the same number of pairs, so the mean of their losses is the batch's."""
        batch = shard(self.sampler.next(), self.world_size)[self.rank]
        sums = torch.zeros(3, device=self.strategy.device)  # loss, wins, margin, summed over micro-batches
        chunks = [batch[i : i + self.micro] for i in range(0, len(batch), self.micro)]
        for chunk in chunks:
            c, r = pair_scores(
                self.engine,
                [self.chosen[i] for i in chunk],
                [self.rejected[i] for i in chunk],
                self.tokenizer.pad_token_id,
                self.strategy.device,
                self.cfg.packing_samples,
                self.processor,
                [self.images[i] for i in chunk] if self.vision else None,
            )
            loss = bradley_terry_loss(c, r)
            self.engine.backward(loss)
            self.engine.step()
            sums += torch.stack([loss.detach(), (c > r).float().mean(), (c - r).mean().detach()])
        loss, accuracy, margin = (self.strategy.all_reduce(sums) / (len(chunks) * self.world_size)).tolist()
        return {"loss": loss, "accuracy": accuracy, "margin": margin, "lr": self.engine.get_lr()[0]}

    def score_held_out(self) -> tuple[list[float], list[float]]:
        """Scores of this worker's share of the held-out pairs (chosen, rejected)."""
        self.engine.eval()
        return evaluate_pairs(
            self.engine.module,
            self.eval_chosen,
            self.eval_rejected,
            self.tokenizer.pad_token_id,
            self.strategy.device,
            batch_size=32 if self.vision else 256,  # a VLM's batch carries its pixels too
            processor=self.processor,
            images=self.eval_images,
        )

    def save_model(self, out_dir: str, reward_mean: float, reward_std: float) -> None:
        config = self.engine.module.config  # the statistics RL normalises the scores with
        config.reward_mean, config.reward_std = reward_mean, reward_std
        super().save_model(out_dir)


def train(cfg: RewardModelConfig, run: StageRun) -> None:
    def summary(info: dict) -> str:
        dropped = (
            f", {info['dropped']} with images dropped as longer than {cfg.max_len} tokens" if info["dropped"] else ""
        )
        return f"{info['pairs']} pairs, {info['eval_pairs']} held out, {info['truncated']} sequences truncated ({info['eval_truncated']} held out) to {cfg.max_len} tokens{dropped}"

    def held_out(group, stats) -> tuple[dict, tuple]:
        """Pairwise accuracy and the reward statistics on the held-out pairs; the model saves the statistics."""
        shares = group.run("score_held_out")
        chosen = torch.tensor([s for c, _ in shares for s in c])
        rejected = torch.tensor([s for _, r in shares for s in r])
        scores = torch.cat([chosen, rejected])
        found = {
            "eval_pairwise_accuracy": (chosen > rejected).float().mean().item(),
            "reward_mean": scores.mean().item(),
            "reward_std": scores.std().item(),
        }
        run.tracker.log(cfg.max_steps, found)
        return found, (found["reward_mean"], found["reward_std"])

    info, stats, metrics = train_single_group(run, cfg, RewardModelWorker, summary, after=held_out)
    # A VLM reward model saves full weights, LoRA merged in (VisionRewardModel.save_pretrained): no adapter to
    # name a base for.
    adapter = (
        {}
        if info.get("vision")
        else lora.manifest_fields(cfg, reward_mean=metrics["reward_mean"], reward_std=metrics["reward_std"])
    )
    metrics["eval_pairwise_accuracy"] = round(metrics["eval_pairwise_accuracy"], 4)
    run.commit(
        metrics={
            "train_loss": round(stats["loss"], 5) if stats else None,
            "eval_truncated": info["eval_truncated"],
            **metrics,
        },
        # An adapter output keeps the statistics in its manifest; loading it writes them into the merged config.json.
        model="model",
        **adapter,
    )
