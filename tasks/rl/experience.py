"""Experience making: a rollout batch, scored by the actor, reference, critic and reward (in their
worker groups), turned into advantages here, in the controller."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tasks.common.nn.engines.rollout import Rollout, pick
from tasks.common.nn.models import sequence_logprobs, token_values
from tasks.common.nn.packed import packed_sequence_logprobs, packed_token_values
from tasks.rl.advantages import compute_advantages, kl_estimate


@dataclass
class Experience:
    """One rollout batch with everything a PPO update needs; per-token tensors cover response tokens."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    prompt_width: int
    logprobs: torch.Tensor | None  # None: the update's own, detached (RLConfig.needs_old_logprobs)
    ref_logprobs: torch.Tensor | None
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    scores: torch.Tensor
    kl: torch.Tensor
    behaviour_logprobs: torch.Tensor | None = (
        None  # the rollout engine's (the policy that sampled): correction, mismatch
    )
    images: list[list] | None = None  # a vision-language policy's rows: each one's images (Rollout.images)

    def minibatch(self, index: torch.Tensor) -> "Experience":
        fields = {k: (v[index] if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        fields["images"] = pick(self.images, index)
        return Experience(**fields)

    def to(self, device) -> "Experience":
        return Experience(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()})


def response_logprobs(
    model,
    rollout_sequences,
    attention_mask,
    prompt_width,
    return_entropy=False,
    temperature=1.0,
    entropy_grad=True,
    packed=False,
    images=None,
    vision=None,
):
    """Log-probabilities of the response tokens only, at the sampling temperature: [B, R] (the prompt's are
    never computed). packed: the rows run as one sequence without their padding (--packing_samples). vision (a
    vision_passes.VisionRows): a vision-language policy's rows, with their `images` (never packed: RL refuses it)."""
    if vision is not None:
        return vision.logprobs(
            model,
            rollout_sequences,
            attention_mask,
            images,
            return_entropy=return_entropy,
            temperature=temperature,
            start=prompt_width - 1,
            entropy_grad=entropy_grad,
        )
    logprobs = packed_sequence_logprobs if packed else sequence_logprobs
    return logprobs(
        model,
        rollout_sequences,
        attention_mask,
        return_entropy=return_entropy,
        temperature=temperature,
        start=prompt_width - 1,
        entropy_grad=entropy_grad,
    )


def response_values(critic, sequences, attention_mask, prompt_width, packed=False):
    """V(state before each response token): [B, R]."""
    if packed:
        return packed_token_values(critic, sequences, attention_mask, start=prompt_width - 1)
    return token_values(critic, sequences, attention_mask)[:, prompt_width - 1 : -1]


def make_experience(
    rollout: Rollout,
    logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    values: torch.Tensor | None,
    scores: torch.Tensor,
    cfg,
    kl_coef: float,
) -> Experience:
    """One scored rollout batch with its advantages; `values` is None for critic-free estimators, and
    `logprobs` None when the actor scored nothing (no KL, one update: RLConfig.needs_old_logprobs).
    Advantages are computed on the whole batch (whitening is batch-wide), never per worker."""
    action_mask = rollout.response_mask
    if logprobs is None:
        kl = torch.zeros(action_mask.shape)
    else:
        kl = kl_estimate(logprobs, ref_logprobs, cfg.kl_estimator) * action_mask
    reward_kl_coef = 0.0 if cfg.use_kl_loss else kl_coef  # with --use_kl_loss the KL is in the loss instead
    advantages, returns = compute_advantages(
        cfg.advantage_estimator,
        scores,
        kl,
        action_mask,
        values,
        cfg.n_samples_per_prompt,
        reward_kl_coef,
        cfg.gamma,
        cfg.lambd,
        reward_clip=cfg.interval("reward_clip_range"),
    )
    values = values if values is not None else torch.zeros_like(advantages)
    return Experience(
        rollout.sequences,
        rollout.attention_mask,
        action_mask,
        rollout.prompt_width,
        logprobs,
        ref_logprobs,
        values,
        advantages,
        returns,
        scores,
        kl,
        behaviour_logprobs=rollout.logprobs,
        images=rollout.images,
    )


def response_lengths(lengths: torch.Tensor, cap: int | None) -> dict[str, float]:
    """The step's response lengths (model tokens per sample): mean, max and, for one-turn responses, the share that
    reached `cap` without an EOS (verl's response_length/clip_ratio)."""
    stats = {"response_length": lengths.float().mean().item(), "response_length_max": lengths.max().item()}
    if cap:
        stats["response_truncated"] = (lengths >= cap).float().mean().item()
    return stats


def whole_groups(rollout: Rollout, n: int) -> tuple[torch.Tensor, int]:
    """(the rows of the prompt groups of `n` samples whose every response has a token, the number of other groups):
    --over_sampling_batch_size's engines leave the groups they cut empty (first_groups)."""
    whole = rollout.response_mask.any(1).view(-1, n).all(1)
    return whole.repeat_interleave(n).nonzero().squeeze(-1), int((~whole).sum())


def fresh_groups(rollout: Rollout, updates: int, n: int, max_staleness: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Which rows to train on, by groups of `n` (a group's samples are consecutive): those whose samples' oldest
    tokens are at most `max_staleness` versions behind `updates`; and the staleness statistics logged."""
    oldest = rollout.oldest_versions()
    newest = rollout.versions.masked_fill(rollout.response_mask == 0, -1).max(-1).values
    behind = updates - oldest
    keep = (behind <= max_staleness).view(-1, n).all(-1).repeat_interleave(n)
    return keep, {
        "staleness": behind.max().item(),
        "staleness_mean": behind.float().mean().item(),
        "partial_fraction": (newest > oldest).float().mean().item(),
        "dropped_stale": int((~keep).sum()),
    }
