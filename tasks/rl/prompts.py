"""The RL stage's prompts: loaded from its dataset, encoded as SFT encoded them, cut to prompt_max_len."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.common.nn import data
from tasks.common.stage import StageRun
from tasks.rl.config import RLConfig


@dataclass
class Prompts:
    ids: list[list[int]]
    texts: list  # as the dataset gave them (strings or chat messages): what reward functions and endpoints get
    labels: list[str | None]
    truncated: int
    rows: list[dict] | None = None  # whole rows, every column: what environments are reset with (--env_path)
    images: list[list] | None = None  # a vision-language policy's: each prompt's images (tasks/rl/images.py)
    dropped: int = 0  # prompts with images left out as too long (never cut)


def load_prompts(cfg: RLConfig, run: StageRun, tokenizer) -> Prompts:
    """The prompts encoded as SFT encoded them (strings or chat messages, with --apply_chat_template the
    template's rendering up to the assistant's opening); a prompt over prompt_max_len loses its start,
    keeping the opening the response follows, and is counted."""
    keys = [cfg.input_key] + ([cfg.label_key] if cfg.label_key else [])
    rows = data.load_rows(run.input("prompt_data", cfg.prompt_data), cfg.prompt_split, keys, cfg.max_samples)
    texts = list(rows[cfg.input_key])
    labels = [None if v is None else str(v) for v in rows[cfg.label_key]] if cfg.label_key else [None] * len(texts)
    ids = [data.encode_prompt(tokenizer, text, cfg.apply_chat_template) for text in texts]
    truncated = sum(len(p) > cfg.prompt_max_len for p in ids)
    return Prompts(
        [p[-cfg.prompt_max_len :] for p in ids], texts, labels, truncated, rows.to_list() if cfg.env_path else None
    )
