"""A row of a user's dataset mapped to the pipeline's terms by the column flags; tasks/data/ingest.py checks and
splits every row with these.

    record = canonical(row, cfg, image_source)   # {"prompt", "response", "chosen", "rejected", "label", "images"}; BadRow
    length(record)                               # characters that must fit the model's context
    held_out(record["prompt"], seed, 0.1, record.get("images", []))   # which side of the split, by a hash

A BadRow names the check that failed (ingest.FIXES says what to change) and the column to blame.
"""

from __future__ import annotations

import hashlib
import json

from tasks.common.image_tags import content_text, is_content_blocks
from tasks.data import images, sources
from tasks.data.config import PrepareDataConfig


class BadRow(Exception):
    """A row failing one check; `field` names the column when one is to blame."""

    def __init__(self, reason: str, field: str = ""):
        super().__init__(reason)
        self.reason, self.field = reason, field


def text(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        raise BadRow("missing_field", key)
    if not isinstance(value, str):
        raise BadRow("wrong_type", key)
    if not value.strip():
        raise BadRow("empty_field", key)
    return value


def split_messages(value, key: str) -> tuple[list[dict], str | None]:
    """(prompt turns, final assistant turn or None) of a chat-messages cell."""
    if value is None:
        raise BadRow("missing_field", key)
    if isinstance(value, str):  # CSV (and some Parquet exports) hold the list as JSON text
        try:
            value = json.loads(value)
        except ValueError:
            raise BadRow("bad_messages", key) from None
    if not isinstance(value, (list, tuple)):
        raise BadRow("bad_messages", key)
    if not value:
        raise BadRow("empty_field", key)
    turns = []
    for message in value:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and (isinstance(message.get("content"), str) or is_content_blocks(message.get("content")))
        ):
            raise BadRow("bad_messages", key)
        turns.append({"role": message["role"], "content": message["content"]})
    final = None
    if turns[-1]["role"] == "assistant":
        final = content_text(turns.pop()["content"])
        if not final.strip():
            raise BadRow("empty_field", key)
    if not turns:
        raise BadRow("bad_messages", key)  # an answer to nothing
    if not any(content_text(t["content"]).strip() for t in turns):
        raise BadRow("empty_field", key)
    return turns, final


def label_of(value, key: str) -> str | None:
    """A reference answer as text; None where the row has none (eval then skips exact match for it)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, (list, dict)):
        raise BadRow("wrong_type", key)
    return str(value)


def canonical(row: sources.Row, cfg: PrepareDataConfig, image_source: images.ImageSource | None = None) -> dict:
    """The row in the pipeline's terms: prompt, response (SFT), chosen, rejected, label, and with `image_source`
    (the dataset has an image column) images. Raises BadRow."""
    if row is None:
        raise BadRow("malformed")
    if isinstance(row, sources.Unreadable):
        raise BadRow(row.reason, row.field)
    final = None
    if cfg.messages_key:
        prompt, final = split_messages(row.get(cfg.messages_key), cfg.messages_key)
    else:
        prompt = text(row, cfg.input_key)
    record: dict = {"prompt": prompt}
    if image_source is not None:
        try:
            record["images"] = image_source.column(row.get(cfg.image_key))
            images.check_count(prompt, record["images"])
        except images.ImageError as bad:
            raise BadRow(bad.reason, cfg.image_key) from None
    if cfg.chosen_key:
        record["chosen"], record["rejected"] = text(row, cfg.chosen_key), text(row, cfg.rejected_key)
        if record["chosen"] == record["rejected"]:
            raise BadRow("identical_pair", cfg.chosen_key)
    if cfg.output_key:
        record["response"] = text(row, cfg.output_key)
    elif final is not None:
        record["response"] = final
    elif cfg.chosen_key:
        record["response"] = record["chosen"]
    else:
        raise BadRow("bad_messages", cfg.messages_key)  # no final assistant turn, and no other response to learn
    if cfg.label_key:
        record["label"] = label_of(row.get(cfg.label_key), cfg.label_key)
    return record


def prompt_chars(prompt) -> int:
    """Characters of the prompt's text (an image counts as its tag: the stages never cut a prompt with images)."""
    return len(prompt) if isinstance(prompt, str) else sum(len(content_text(t["content"])) for t in prompt)


def length(record: dict) -> int:
    """Characters of the prompt plus its longest response: what has to fit in the model's context."""
    responses = [record[k] for k in ("response", "chosen", "rejected") if k in record]
    return prompt_chars(record["prompt"]) + max(map(len, responses), default=0)


def prompt_key(prompt, pictures: list[str] = ()) -> str:
    """The prompt's identity: its text or messages, and its images (one text under many images is many prompts)."""
    key = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    return key + ("\0" + images.digest(pictures) if pictures else "")


def normalized(prompt, pictures: list[str] = ()) -> str:
    """The prompt up to case and spacing, and its images: what a held-out prompt must not share with a training one."""
    flat = (
        prompt if isinstance(prompt, str) else "\n".join(f"{t['role']}: {content_text(t['content'])}" for t in prompt)
    )
    return " ".join(flat.casefold().split()) + ("\0" + images.digest(pictures) if pictures else "")


def held_out(prompt, seed: int, fraction: float, pictures: list[str] = ()) -> bool:
    """Whether the prompt belongs to the held-out side: a hash, so the same prompt always lands there."""
    digest = hashlib.sha256(f"{seed}\0{prompt_key(prompt, pictures)}".encode("utf-8")).hexdigest()
    return int(digest[:16], 16) / 16**16 < fraction
