"""The PPO loop: generate, make experience, update actor and critic, log; then save the policy."""
from __future__ import annotations

import time

import torch

from tasks.common import data
from tasks.common.losses import kl_loss, masked_mean, policy_loss, value_loss
from tasks.common.models import load_causal_lm, load_scalar_model, load_tokenizer, resolve_model
from tasks.common.rollout import HFRolloutEngine
from tasks.common.stage import StageRun
from tasks.common.strategy import DeepSpeedStrategy
from tasks.rl.config import RLConfig
from tasks.rl.advantages import uses_critic
from tasks.rl.experience import Experience, make_experience, response_logprobs, response_values
from tasks.rl.kl_controller import make_kl_controller
from tasks.rl.rewards import build_reward_batch, make_reward_source, split_list


def load_prompts(cfg: RLConfig, run: StageRun, tokenizer):
    """(token ids, texts, labels, number cut) of the prompt dataset; labels are None without --label_key."""
    keys = [cfg.input_key] + ([cfg.label_key] if cfg.label_key else [])
    rows = data.load_rows(run.input("prompt_data", cfg.prompt_data), cfg.prompt_split, keys)
    texts = list(rows[cfg.input_key])
    labels = [None if v is None else str(v) for v in rows[cfg.label_key]] if cfg.label_key else [None] * len(texts)
    prompts = [data.encode_prompt(tokenizer, text) for text in texts]
    truncated = sum(len(p) > cfg.prompt_max_len for p in prompts)
    return [p[-cfg.prompt_max_len:] for p in prompts], texts, labels, truncated


def ppo_update(exp: Experience, actor, critic, cfg: RLConfig, kl_coef: float, generator: torch.Generator) -> dict:
    """max_epochs passes of minibatch updates over one experience batch; returns mean statistics."""
    stats: dict[str, list[float]] = {"policy_loss": [], "value_loss": [], "clip_fraction": [], "value_clip_fraction": [], "entropy": []}
    n = exp.sequences.size(0)
    for _ in range(cfg.max_epochs):
        for index in torch.randperm(n, generator=generator).split(cfg.train_batch_size):
            mb = exp.minibatch(index)
            logprobs, entropy = response_logprobs(actor, mb.sequences, mb.attention_mask, mb.prompt_width, return_entropy=True)
            p_loss, clip_fraction = policy_loss(
                logprobs, mb.logprobs, mb.advantages, mb.action_mask, cfg.eps_clip, clip_eps_low=cfg.eps_clip_low or None,
                clip_eps_high=cfg.eps_clip_high or None, dual_clip=cfg.dual_clip or None)
            loss = p_loss
            if cfg.use_kl_loss:
                loss = loss + kl_coef * kl_loss(logprobs, mb.ref_logprobs, mb.action_mask, cfg.kl_estimator)
            if cfg.entropy_coef:
                loss = loss - cfg.entropy_coef * masked_mean(entropy, mb.action_mask)
            actor.backward(loss)
            actor.step()
            v_loss = v_clip = torch.zeros(())
            if critic is not None:
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
    tokenizer = load_tokenizer(policy_path)
    prompts, texts, labels, truncated = load_prompts(cfg, run, tokenizer)
    print(f"rl: {len(prompts)} prompts, {truncated} cut to {cfg.prompt_max_len} tokens", flush=True)
    strategy = DeepSpeedStrategy(zero_stage=cfg.zero_stage, bf16=cfg.bf16, seed=cfg.seed, micro_batch_size=cfg.train_batch_size)
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    for name in ("reward_pretrain", "remote_rm_url"):
        if getattr(cfg, name):
            run.input(name, getattr(cfg, name))
    reward = make_reward_source(cfg.reward_pretrain, cfg.remote_rm_url, strategy.device, dtype, cfg.normalize_reward)

    group = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    updates = cfg.max_steps * cfg.max_epochs * (group // cfg.train_batch_size)
    actor = strategy.prepare(load_causal_lm(policy_path), cfg.actor_learning_rate, updates, cfg.lr_warmup_steps)
    critic = None
    if uses_critic(cfg.advantage_estimator):
        critic_uri = cfg.critic_pretrain or (split_list(cfg.reward_pretrain) or [cfg.pretrain])[0]
        critic_path = resolve_model(run.input("critic_pretrain", critic_uri))
        critic = strategy.prepare(load_scalar_model(critic_path), cfg.critic_learning_rate, updates, cfg.lr_warmup_steps)
    reference = strategy.frozen(load_causal_lm(policy_path))
    kl_ctl = make_kl_controller(cfg.init_kl_coef, cfg.kl_target or None, cfg.kl_horizon)

    engine = HFRolloutEngine(actor.module, tokenizer, strategy.device)
    sampler = data.BatchSampler(len(prompts), cfg.rollout_batch_size, cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    models = [m for m in (actor, critic) if m is not None]
    for step in range(1, cfg.max_steps + 1):
        t0 = time.time()
        # The samples of one prompt are consecutive rows: the group estimators rely on it.
        index = [i for i in sampler.next() for _ in range(cfg.n_samples_per_prompt)]
        rollout = engine.generate([prompts[i] for i in index], cfg.generate_max_len, cfg.temperature)
        t1 = time.time()
        for m in models:
            m.eval()
        batch = build_reward_batch(rollout, tokenizer, [texts[i] for i in index], [labels[i] for i in index])
        exp = make_experience(rollout, actor.module, reference, critic.module if critic else None, reward, batch, cfg, kl_ctl.value)
        t2 = time.time()
        for m in models:
            m.train()
        stats = ppo_update(exp, actor, critic, cfg, kl_ctl.value, generator)
        t3 = time.time()
        sequence_kl = exp.kl.sum(-1).mean().item()
        kl_coef = kl_ctl.value
        kl_ctl.update(sequence_kl, n_steps=exp.sequences.size(0))
        if step % cfg.logging_steps == 0 or step == cfg.max_steps:
            run.tracker.log(step, {
                "reward": exp.scores.mean().item(), "reward_std": exp.scores.std().item(),
                "kl": sequence_kl, "kl_coef": kl_coef, **stats,
                "response_length": exp.action_mask.sum(-1).float().mean().item(),
                "time_generate_s": t1 - t0, "time_inference_s": t2 - t1, "time_train_s": t3 - t2,
            })

    strategy.save_hf(actor, tokenizer, run.workdir / "model")
    run.commit(metrics={"final_reward": exp.scores.mean().item(), "final_kl": exp.kl.sum(-1).mean().item(), "steps": cfg.max_steps},
               model="model")
