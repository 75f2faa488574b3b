"""Reward-model training with the Bradley-Terry loss; stores reward mean/std for normalisation.

The statistics are written into the model's config (`reward_mean`, `reward_std`), so whoever loads
the checkpoint with AutoModelForSequenceClassification gets them too.
"""
from __future__ import annotations

import torch

from tasks.common import data
from tasks.common.losses import bradley_terry_loss
from tasks.common.models import load_scalar_model, load_tokenizer, resolve_model, sequence_scores
from tasks.common.stage import StageRun
from tasks.common.strategy import DeepSpeedStrategy
from tasks.reward_model.config import RewardModelConfig


def tokenize_pairs(rows, tokenizer, cfg: RewardModelConfig) -> tuple[list[list[int]], list[list[int]], int]:
    chosen, rejected, truncated = [], [], 0
    for prompt, good, bad in zip(rows[cfg.prompt_key], rows[cfg.chosen_key], rows[cfg.rejected_key]):
        p = data.encode_prompt(tokenizer, prompt)
        for side, response in ((chosen, good), (rejected, bad)):
            seq = p + data.encode_response(tokenizer, response)
            truncated += len(seq) > cfg.max_len
            side.append(seq[:cfg.max_len])
    return chosen, rejected, truncated


def pair_scores(model, chosen, rejected, pad_id, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of chosen and rejected sequences, in one forward pass."""
    ids, mask = data.pad(chosen + rejected, pad_id)
    scores = sequence_scores(model, ids.to(device), mask.to(device))
    return scores[:len(chosen)], scores[len(chosen):]


@torch.no_grad()
def evaluate_pairs(model, chosen, rejected, pad_id, device, batch_size=256) -> tuple[float, torch.Tensor]:
    """Pairwise accuracy and every score (chosen and rejected) on held-out pairs."""
    wins, scores = 0, []
    for i in range(0, len(chosen), batch_size):
        c, r = pair_scores(model, chosen[i:i + batch_size], rejected[i:i + batch_size], pad_id, device)
        wins += (c > r).sum().item()
        scores += [c, r]
    return wins / len(chosen), torch.cat(scores)


def train(cfg: RewardModelConfig, run: StageRun) -> None:
    keys = [cfg.prompt_key, cfg.chosen_key, cfg.rejected_key]
    dataset_uri = run.input("dataset", cfg.dataset)
    train_rows, eval_rows = data.load_rows(dataset_uri, cfg.dataset_split, keys), data.load_rows(dataset_uri, cfg.eval_split, keys)
    model_path = resolve_model(run.input("pretrain", cfg.pretrain))
    tokenizer = load_tokenizer(model_path)
    chosen, rejected, truncated = tokenize_pairs(train_rows, tokenizer, cfg)
    eval_chosen, eval_rejected, _ = tokenize_pairs(eval_rows, tokenizer, cfg)
    print(f"reward_model: {len(chosen)} pairs, {len(eval_chosen)} held out, {truncated} sequences truncated", flush=True)
    strategy = DeepSpeedStrategy(zero_stage=cfg.zero_stage, bf16=cfg.bf16, seed=cfg.seed, micro_batch_size=2 * cfg.train_batch_size)

    engine = strategy.prepare(load_scalar_model(model_path), cfg.learning_rate, cfg.max_steps, cfg.lr_warmup_steps, lr_scheduler=cfg.lr_scheduler)
    model = engine.module
    sampler = data.BatchSampler(len(chosen), cfg.train_batch_size, cfg.seed)
    engine.train()
    for step in range(1, cfg.max_steps + 1):
        batch = sampler.next()
        c, r = pair_scores(model, [chosen[i] for i in batch], [rejected[i] for i in batch], tokenizer.pad_token_id, strategy.device)
        loss = bradley_terry_loss(c, r)
        engine.backward(loss)
        engine.step()
        if step % cfg.logging_steps == 0 or step == cfg.max_steps:
            run.tracker.log(step, {"loss": loss.item(), "accuracy": (c > r).float().mean().item(), "margin": (c - r).mean().item(), "lr": engine.get_lr()[0]})

    engine.eval()
    accuracy, scores = evaluate_pairs(model, eval_chosen, eval_rejected, tokenizer.pad_token_id, strategy.device)
    model.config.reward_mean, model.config.reward_std = scores.mean().item(), scores.std().item()
    run.tracker.log(cfg.max_steps, {"eval_pairwise_accuracy": accuracy, "reward_mean": model.config.reward_mean, "reward_std": model.config.reward_std})
    strategy.save_hf(engine, tokenizer, run.workdir / "model")
    run.commit(
        metrics={"train_loss": round(loss.item(), 5), "eval_pairwise_accuracy": round(accuracy, 4),
                 "reward_mean": model.config.reward_mean, "reward_std": model.config.reward_std, "truncated": truncated},
        model="model",
    )
