"""Where rewards come from, behind one interface (OpenRLHF's `--reward_pretrain` / `--remote_rm_url`).

    source = make_reward_source(cfg.reward_pretrain, cfg.remote_rm_url, device, dtype, normalize=True)
    batch = build_reward_batch(rollout, tokenizer, prompt_texts, labels)
    scores = source.score(batch)            # [B] float32, on batch.sequences' device

Sources:

* `RewardModels("s3://…/rm/manifest.json,other/rm")`: one or several reward models (each loaded
  through `resolve_model` + `load_scalar_model`, frozen). The reward is the SUM over models of
  each model's score at the last real token, each first standardised with that model's
  `config.reward_mean` / `config.reward_std` (written by our reward-model stage) when `normalize`.
  The models read `batch.sequences` as they are, so they must share the policy's tokenizer. A reward model the
  reward_model stage trained on a vision-language model (tasks/common/nn/vision_reward.py: the VLM's backbone and
  value_head.safetensors) scores each row with its images (`batch.images`, the rollout's): prompt + response +
  pixels. A text reward model refuses a batch that carries images: it would score the text alone.
* `RewardFunction("path/or/s3/reward.py")`: a Python file defining
  `reward_func(queries, prompts, labels)` that returns B rewards (a tensor, a list of floats, or a
  dict holding them under "rewards", as newer OpenRLHF functions do).
* `RewardEndpoint("http://host:port/path")`: POSTs `{"query": queries, "prompts": prompts,
  "labels": labels}` and reads `{"rewards": [...]}` (or `{"scores": [...]}`, or a bare list).

`remote_rm_url` may also be a comma-separated list (as in OpenRLHF); the rewards then sum.
Every failure a user can fix raises RewardError (a ConfigError, so a stage's `main` prints it as
one line) naming the reward source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tasks.common import http_json, user_code
from tasks.common.config import ConfigError, split_list
from tasks.common.nn.data import decode_rows


class RewardError(ConfigError):
    """A reward source that cannot be used; the message is one line naming it and the fix."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


@dataclass
class RewardBatch:
    """What a reward source may look at, for B prompt+response sequences."""

    sequences: torch.Tensor  # [B, T] token ids: prompts left-padded, responses right-padded
    attention_mask: torch.Tensor  # [B, T]
    queries: list[str]  # prompt + response, decoded with special tokens skipped
    prompts: list[str]  # the prompts as the dataset gave them
    responses: list[str]  # the responses, decoded up to the first EOS
    labels: list[str | None]  # the dataset's label per prompt (None without one)
    images: list[list] | None = None  # a vision-language rollout's: each row's images (Rollout.images), else None

    def __len__(self) -> int:
        return self.sequences.size(0)


class RewardSource:
    """Scores a RewardBatch: `score(batch) -> torch.Tensor [B]` (float32, on batch.sequences' device)."""

    def score(self, batch: RewardBatch) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        return self.score(batch)


def _as_rewards(values: Any, n: int, who: str, device: torch.device) -> torch.Tensor:
    """B finite rewards from a tensor / list / array, or a RewardError naming `who` and what was wrong."""
    if isinstance(values, dict):
        key = next((k for k in ("rewards", "scores") if k in values), None)
        if key is None:
            raise RewardError(
                f"{who} returned a dict with keys {sorted(map(str, values))}; return the rewards under 'rewards'"
            )
        values = values[key]
    if isinstance(values, (str, bytes, dict)) or not (
        isinstance(values, (torch.Tensor, list, tuple)) or hasattr(values, "__array__")
    ):
        raise RewardError(f"{who} returned {type(values).__name__}; return a torch tensor or a list of {n} floats")
    try:
        rewards = torch.as_tensor(values).detach().to(torch.float32)
    except (TypeError, ValueError, RuntimeError):
        kinds = (
            sorted({type(v).__name__ for v in values}) if isinstance(values, (list, tuple)) else [type(values).__name__]
        )
        raise RewardError(
            f"{who} returned a {type(values).__name__} of {', '.join(kinds)}, not numbers; return a torch tensor or a list of {n} floats"
        ) from None
    if rewards.dim() == 2 and rewards.size(-1) == 1:
        rewards = rewards.squeeze(-1)
    if rewards.dim() != 1 or rewards.numel() != n:
        raise RewardError(
            f"{who} returned rewards of shape {list(rewards.shape)} for a batch of {n}; return one float per query"
        )
    if not torch.isfinite(rewards).all():
        raise RewardError(f"{who} returned non-finite rewards ({rewards.tolist()[:8]}…)")
    return rewards.to(device)


# ---------------------------------------------------------------------------------------------- models


class RewardModels(RewardSource):
    """One or several frozen reward models; the reward is the sum of their (optionally standardised) scores."""

    def __init__(
        self,
        paths: Sequence[str] | str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        normalize: bool = True,
        batch_size: int = 256,
    ):
        from tasks.common.nn.models import is_vision_model, load_scalar_model, resolve_model
        from tasks.common.nn.vision_reward import is_vision_reward_model, load_vision_reward_model

        if isinstance(paths, str):
            paths = split_list(paths)
        if not paths:
            raise RewardError("reward_pretrain: no reward model given; pass --reward_pretrain <URI>[,<URI>…]")
        self.paths, self.normalize, self.batch_size = list(paths), normalize, batch_size
        self.device = torch.device(device)
        self.models, self.stats, self.vision = [], [], []  # vision: a VLM reward model's VisionRows, None for text
        for path in self.paths:
            local = resolve_model(path)
            if is_vision_reward_model(local):
                model, passes = load_vision_reward_model(local, dtype)
            elif is_vision_model(local):
                raise RewardError(
                    f"reward_pretrain: {path} is a vision-language model with no value head (its config.json names no "
                    "value_head), not a reward model; pass the reward_model stage's output"
                )
            else:
                model, passes = load_scalar_model(local, dtype=dtype), None
            self.vision.append(passes)
            model.requires_grad_(False)
            model.eval()
            self.models.append(model.to(self.device))
            mean, std = getattr(model.config, "reward_mean", None), getattr(model.config, "reward_std", None)
            self.stats.append((0.0 if mean is None else float(mean), 1.0 if std is None else float(std)))

    @torch.no_grad()
    def score(self, batch: RewardBatch) -> torch.Tensor:
        from tasks.common.nn.models import sequence_scores
        from tasks.common.nn.vision_reward import rollout_scores

        seqs, mask = batch.sequences.to(self.device), batch.attention_mask.to(self.device)
        images = batch.images if batch.images is not None else [[] for _ in range(seqs.size(0))]
        total = torch.zeros(seqs.size(0), dtype=torch.float32, device=self.device)
        for path, model, passes, (mean, std) in zip(self.paths, self.models, self.vision, self.stats):
            vocab = (model if passes is None else model.backbone).get_input_embeddings().num_embeddings
            if seqs.numel() and int(seqs.max()) >= vocab:
                raise RewardError(
                    f"reward_pretrain: {path} has {vocab} token embeddings but the sequences hold id {int(seqs.max())}; "
                    "reward models must share the policy's tokenizer"
                )
            if passes is None and any(images):
                raise RewardError(
                    f"reward_pretrain: {path} is a text reward model and the rows carry images, which it cannot see; "
                    "pass a reward model the reward_model stage trained on a vision-language model"
                )
            parts = []
            for i in range(0, seqs.size(0), self.batch_size):
                part = slice(i, i + self.batch_size)
                if passes is None:
                    parts.append(sequence_scores(model, seqs[part], mask[part]).float())
                else:  # prompt + response + pixels
                    parts.append(rollout_scores(model, passes, seqs[part], mask[part], images[part]).float())
            scores = torch.cat(parts)
            if self.normalize:
                scores = (scores - mean) / max(std, 1e-6)
            total += scores
        return total.to(batch.sequences.device)

    def __repr__(self) -> str:
        return f"RewardModels({self.paths}, normalize={self.normalize})"


# ---------------------------------------------------------------------------------------------- function file


class RewardFunction(RewardSource):
    """`reward_func(queries, prompts, labels)` from a Python file (a local path, file://, or s3://)."""

    def __init__(self, path: str):
        self.path = str(path)
        self._func = self._load()

    def _load(self):
        return user_code.load_function(
            self.path, "reward_func", who="remote_rm_url", error=RewardError, signature="queries, prompts, labels"
        )

    def __getstate__(self):  # a module does not pickle (Ray actors): reload from the path instead
        return {"path": self.path}

    def __setstate__(self, state):
        self.path = state["path"]
        self._func = self._load()

    def score(self, batch: RewardBatch) -> torch.Tensor:
        try:
            out = self._func(list(batch.queries), list(batch.prompts), list(batch.labels))
        except Exception as e:
            e.add_note(f"in reward_func of remote_rm_url {self.path}")
            raise
        return _as_rewards(out, len(batch.queries), f"remote_rm_url: {self.path}: reward_func", batch.sequences.device)

    def __repr__(self) -> str:
        return f"RewardFunction({self.path!r})"


# ---------------------------------------------------------------------------------------------- HTTP endpoint


class RewardEndpoint(RewardSource):
    """A reward server: POST {"query", "prompts", "labels"} -> {"rewards": [...]}; retries connection errors and 5xx."""

    def __init__(self, url: str, timeout: float = 30, retries: int = 3, backoff: float = 1.0):
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff

    def score(self, batch: RewardBatch) -> torch.Tensor:
        payload = {"query": list(batch.queries), "prompts": list(batch.prompts), "labels": list(batch.labels)}
        reply = http_json.post_json(
            self.url,
            payload,
            who="remote_rm_url",
            error=RewardError,
            timeout=self.timeout,
            retries=self.retries,
            backoff=self.backoff,
        )
        if isinstance(reply, dict) and not any(k in reply for k in ("rewards", "scores")):
            raise RewardError(
                f'remote_rm_url: {self.url} answered JSON with keys {sorted(reply)}; expected {{"rewards": [...]}}'
            )
        return _as_rewards(reply, len(batch.queries), f"remote_rm_url: {self.url}", batch.sequences.device)

    def __repr__(self) -> str:
        return f"RewardEndpoint({self.url!r})"


# ---------------------------------------------------------------------------------------------- several, and the factory


class SummedRewards(RewardSource):
    """The sum of several sources' rewards (a comma-separated --remote_rm_url)."""

    def __init__(self, sources: Sequence[RewardSource]):
        self.sources = list(sources)

    def score(self, batch: RewardBatch) -> torch.Tensor:
        return torch.stack([s.score(batch) for s in self.sources]).sum(0)

    def __repr__(self) -> str:
        return f"SummedRewards({self.sources})"


def _remote_source(url: str, timeout: float, retries: int) -> RewardSource:
    if url.startswith(("http://", "https://")):
        return RewardEndpoint(url, timeout=timeout, retries=retries)
    if user_code.split_pin(url)[0].endswith(".py"):  # a file, maybe pinned to its content (uri#sha256=…)
        return RewardFunction(url)
    raise RewardError(f"remote_rm_url: {url} is neither a .py file nor an http(s):// URL")


def make_reward_source(
    reward_pretrain: str,
    remote_rm_url: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    normalize: bool = True,
    timeout: float = 30,
    retries: int = 3,
) -> RewardSource:
    """remote_rm_url when set (a .py file or an http(s):// URL; a comma list sums), else the reward models."""
    if remote_rm_url and remote_rm_url.strip():
        sources = [_remote_source(url, timeout, retries) for url in split_list(remote_rm_url)]
        return sources[0] if len(sources) == 1 else SummedRewards(sources)
    if reward_pretrain and split_list(reward_pretrain):
        return RewardModels(split_list(reward_pretrain), device, dtype, normalize)
    raise RewardError("reward: set --reward_pretrain or --remote_rm_url")


def build_reward_batch(
    rollout, tokenizer, prompts_text: Sequence[str], labels: Sequence[str | None] | None = None
) -> RewardBatch:
    """A RewardBatch for a tasks.common.nn.engines.rollout.Rollout whose row i answers prompts_text[i]."""
    n = rollout.sequences.size(0)
    labels = [None] * n if labels is None else list(labels)
    if len(prompts_text) != n or len(labels) != n:
        raise ValueError(f"build_reward_batch: {n} sequences but {len(prompts_text)} prompts and {len(labels)} labels")
    queries = decode_rows(tokenizer, rollout.sequences, rollout.attention_mask)
    return RewardBatch(
        rollout.sequences,
        rollout.attention_mask,
        queries,
        list(prompts_text),
        rollout.texts(tokenizer),
        labels,
        images=getattr(rollout, "images", None),
    )


__all__ = [
    "RewardBatch",
    "RewardSource",
    "RewardModels",
    "RewardFunction",
    "RewardEndpoint",
    "SummedRewards",
    "RewardError",
    "make_reward_source",
    "build_reward_batch",
]
