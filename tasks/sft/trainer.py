"""Supervised fine-tuning with the loss masked to the response tokens (and the closing EOS)."""
from __future__ import annotations

import torch

from tasks.common import data
from tasks.common.losses import sft_loss
from tasks.common.models import load_causal_lm, load_tokenizer, resolve_model, sequence_logprobs
from tasks.common.stage import StageRun
from tasks.common.strategy import DeepSpeedStrategy
from tasks.sft.config import SFTConfig


def tokenize(rows, tokenizer, cfg: SFTConfig) -> tuple[list[list[int]], list[list[int]], int]:
    """(ids, loss mask) per row; rows longer than max_len are cut and counted."""
    ids, masks, truncated = [], [], 0
    for prompt, response in zip(rows[cfg.input_key], rows[cfg.output_key]):
        p, r = data.encode_prompt(tokenizer, prompt), data.encode_response(tokenizer, response)
        seq, mask = p + r, [0] * len(p) + [1] * len(r)
        if len(seq) > cfg.max_len:
            seq, mask, truncated = seq[:cfg.max_len], mask[:cfg.max_len], truncated + 1
        ids.append(seq)
        masks.append(mask)
    return ids, masks, truncated


def train(cfg: SFTConfig, run: StageRun) -> None:
    # Inputs first: a wrong URI or column fails here, before any training work.
    rows = data.load_rows(run.input("dataset", cfg.dataset), cfg.dataset_split, [cfg.input_key, cfg.output_key])
    model_path = resolve_model(run.input("pretrain", cfg.pretrain))
    tokenizer = load_tokenizer(model_path)
    ids, masks, truncated = tokenize(rows, tokenizer, cfg)
    print(f"sft: {len(ids)} rows, {truncated} truncated to {cfg.max_len} tokens", flush=True)
    strategy = DeepSpeedStrategy(zero_stage=cfg.zero_stage, bf16=cfg.bf16, seed=cfg.seed, micro_batch_size=cfg.train_batch_size)

    engine = strategy.prepare(load_causal_lm(model_path), cfg.learning_rate, cfg.max_steps, cfg.lr_warmup_steps, lr_scheduler=cfg.lr_scheduler)
    sampler = data.BatchSampler(len(ids), cfg.train_batch_size, cfg.seed)
    engine.train()
    for step in range(1, cfg.max_steps + 1):
        batch = sampler.next()
        input_ids, attention_mask = data.pad([ids[i] for i in batch], tokenizer.pad_token_id)
        loss_mask, _ = data.pad([masks[i] for i in batch], 0)
        input_ids, attention_mask, loss_mask = (t.to(strategy.device) for t in (input_ids, attention_mask, loss_mask))
        logprobs = sequence_logprobs(engine, input_ids, attention_mask)
        loss = sft_loss(logprobs, loss_mask[:, 1:])
        engine.backward(loss)
        engine.step()
        if step % cfg.logging_steps == 0 or step == cfg.max_steps:
            run.tracker.log(step, {"loss": loss.item(), "lr": engine.get_lr()[0], "epoch": sampler.epoch})

    strategy.save_hf(engine, tokenizer, run.workdir / "model")
    run.commit(metrics={"train_loss": round(loss.item(), 5), "steps": cfg.max_steps, "rows": len(ids), "truncated": truncated}, model="model")
