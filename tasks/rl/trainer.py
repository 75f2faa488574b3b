"""The PPO loop: generate, make experience, update actor and critic, log; then save the policy."""
from __future__ import annotations

import time

import torch

from tasks.common import data
from tasks.common.losses import masked_mean, policy_loss, value_loss
from tasks.common.models import load_causal_lm, load_scalar_model, load_tokenizer, resolve_model
from tasks.common.rollout import HFRolloutEngine
from tasks.common.stage import StageRun
from tasks.common.strategy import DeepSpeedStrategy
from tasks.rl.config import RLConfig
from tasks.rl.experience import Experience, make_experience, response_logprobs, response_values


def load_prompts(cfg: RLConfig, run: StageRun, tokenizer) -> tuple[list[list[int]], int]:
    rows = data.load_rows(run.input("prompt_data", cfg.prompt_data), cfg.prompt_split, [cfg.input_key])
    prompts = [data.encode_prompt(tokenizer, text) for text in rows[cfg.input_key]]
    truncated = sum(len(p) > cfg.prompt_max_len for p in prompts)
    return [p[-cfg.prompt_max_len:] for p in prompts], truncated


def ppo_update(exp: Experience, actor, critic, cfg: RLConfig, generator: torch.Generator) -> dict:
    """max_epochs passes of minibatch updates over one experience batch; returns mean statistics."""
    stats: dict[str, list[float]] = {"policy_loss": [], "value_loss": [], "clip_fraction": [], "value_clip_fraction": [], "entropy": []}
    n = exp.sequences.size(0)
    for _ in range(cfg.max_epochs):
        for index in torch.randperm(n, generator=generator).split(cfg.train_batch_size):
            mb = exp.minibatch(index)
            logprobs, entropy = response_logprobs(actor, mb.sequences, mb.attention_mask, mb.prompt_width, return_entropy=True)
            p_loss, clip_fraction = policy_loss(logprobs, mb.logprobs, mb.advantages, mb.action_mask, cfg.eps_clip)
            actor.backward(p_loss)
            actor.step()
            values = response_values(critic.module, mb.sequences, mb.attention_mask, mb.prompt_width)
            v_loss, v_clip = value_loss(values, mb.values, mb.returns, mb.action_mask, cfg.value_clip)
            critic.backward(v_loss)
            critic.step()
            for key, value in (("policy_loss", p_loss), ("value_loss", v_loss), ("clip_fraction", clip_fraction),
                               ("value_clip_fraction", v_clip), ("entropy", masked_mean(entropy.detach(), mb.action_mask))):
                stats[key].append(value.item())
    return {k: sum(v) / len(v) for k, v in stats.items()}


def train(cfg: RLConfig, run: StageRun) -> None:
    policy_path = resolve_model(run.input("pretrain", cfg.pretrain))
    reward_path = resolve_model(run.input("reward_pretrain", cfg.reward_pretrain))
    tokenizer = load_tokenizer(policy_path)
    prompts, truncated = load_prompts(cfg, run, tokenizer)
    print(f"rl: {len(prompts)} prompts, {truncated} cut to {cfg.prompt_max_len} tokens", flush=True)
    strategy = DeepSpeedStrategy(zero_stage=cfg.zero_stage, bf16=cfg.bf16, seed=cfg.seed, micro_batch_size=cfg.train_batch_size)

    updates = cfg.max_steps * cfg.max_epochs * (cfg.rollout_batch_size // cfg.train_batch_size)
    actor = strategy.prepare(load_causal_lm(policy_path), cfg.actor_learning_rate, updates, cfg.lr_warmup_steps)
    critic = strategy.prepare(load_scalar_model(reward_path), cfg.critic_learning_rate, updates, cfg.lr_warmup_steps)
    reference = strategy.frozen(load_causal_lm(policy_path))
    reward_model = strategy.frozen(load_scalar_model(reward_path))
    reward_stats = None
    if cfg.normalize_reward:
        reward_stats = (getattr(reward_model.config, "reward_mean", 0.0), getattr(reward_model.config, "reward_std", 1.0))

    engine = HFRolloutEngine(actor.module, tokenizer, strategy.device)
    sampler = data.BatchSampler(len(prompts), cfg.rollout_batch_size, cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    for step in range(1, cfg.max_steps + 1):
        t0 = time.time()
        rollout = engine.generate([prompts[i] for i in sampler.next()], cfg.generate_max_len, cfg.temperature)
        t1 = time.time()
        actor.eval(), critic.eval()
        exp = make_experience(rollout, actor.module, reference, critic.module, reward_model, cfg, cfg.init_kl_coef, reward_stats)
        t2 = time.time()
        actor.train(), critic.train()
        stats = ppo_update(exp, actor, critic, cfg, generator)
        t3 = time.time()
        if step % cfg.logging_steps == 0 or step == cfg.max_steps:
            run.tracker.log(step, {
                "reward": exp.scores.mean().item(), "reward_std": exp.scores.std().item(),
                "kl": exp.kl.sum(-1).mean().item(), **stats,
                "response_length": exp.action_mask.sum(-1).float().mean().item(),
                "time_generate_s": t1 - t0, "time_inference_s": t2 - t1, "time_train_s": t3 - t2,
            })

    strategy.save_hf(actor, tokenizer, run.workdir / "model")
    run.commit(metrics={"final_reward": exp.scores.mean().item(), "final_kl": exp.kl.sum(-1).mean().item(), "steps": cfg.max_steps},
               model="model")
