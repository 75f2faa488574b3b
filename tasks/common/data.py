"""Datasets by URI: a JSONL/Parquet/CSV file, or a named split of a stage output's manifest.

    rows = load_rows("s3://bucket/…/prepare_data/manifest.json", split="sft", keys=["prompt", "response"])

A stage output lists its datasets in its manifest (`datasets: {split: relative path}`); the files
are fetched with their sizes and sha256 checked and read through 🤗 datasets.
"""
from __future__ import annotations

from pathlib import Path

from tasks.common import manifest as manifests
from tasks.common import storage
from tasks.common.config import ConfigError
from tasks.common.models import is_stage_output

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def resolve_dataset(uri: str, split: str) -> Path:
    """A local file holding the dataset named by `uri` (and `split`, for a stage output)."""
    if is_stage_output(uri):
        manifest = manifests.read_manifest(uri)
        splits = manifest.get("datasets") or {}
        if split not in splits:
            raise ConfigError(f"dataset: {manifest['uri']} has no split {split!r}; it has {sorted(splits) or 'none'}")
        relative = splits[split]
        local_dir, _ = manifests.fetch(manifest["uri"], manifests.local_cache_dir(manifest["uri"]), subdir=str(Path(relative).parent))
        return local_dir / Path(relative).name
    if storage.is_s3(uri):
        raise ConfigError(f"dataset: {uri} is not a stage output (no manifest.json); register it with the prepare_data stage")
    path = Path(uri.removeprefix("file://"))
    if not path.is_file():
        raise ConfigError(f"dataset: {uri} not found; pass a JSONL, Parquet or CSV file or a stage output's manifest")
    return path


def load_rows(uri: str, split: str, keys: list[str], max_samples: int = 0):
    """A 🤗 Dataset of the rows at `uri` (the first `max_samples` if not 0), checked to carry every key in `keys`."""
    import datasets

    path = resolve_dataset(uri, split)
    fmt = _FORMATS.get(path.suffix)
    if fmt is None:
        raise ConfigError(f"dataset: {path.name} has an unknown format; use .jsonl, .parquet or .csv")
    rows = datasets.load_dataset(fmt, data_files=str(path), split="train")
    for key in keys:
        if key not in rows.column_names:
            raise ConfigError(f"dataset: key {key!r} missing in {uri} ({split}); keys present: {', '.join(rows.column_names)}")
    if max_samples and max_samples < len(rows):
        rows = rows.select(range(max_samples))
    return rows


def encode_prompt(tokenizer, text: str, chat_template: bool = False) -> list[int]:
    """Token ids of a prompt, starting with the tokenizer's BOS when it has one; with `chat_template`,
    the prompt is a user turn of the tokenizer's chat template followed by the assistant's opening."""
    if chat_template:
        if not tokenizer.chat_template:
            raise ConfigError(f"apply_chat_template: the tokenizer of {tokenizer.name_or_path} has no chat template; "
                              "drop --apply_chat_template or use a model that ships one")
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
        ids = [tokenizer.bos_token_id] + ids
    return ids


def encode_response(tokenizer, text: str) -> list[int]:
    """Token ids of a response, ending with EOS so the model learns to stop."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def pad(sequences: list[list[int]], pad_id: int, side: str = "right"):
    """Pad to one length: returns (ids, attention_mask) as LongTensors [B, T]."""
    import torch

    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        span = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
        ids[row, span] = torch.tensor(seq, dtype=torch.long)
        mask[row, span] = 1
    return ids, mask


class BatchSampler:
    """Endless shuffled batches of row indices, reshuffled each epoch with a seeded generator."""

    def __init__(self, n_rows: int, batch_size: int, seed: int):
        import numpy as np

        if n_rows < batch_size:
            raise ConfigError(f"train_batch_size: {batch_size} is larger than the {n_rows} rows of the dataset; lower it")
        self.n_rows, self.batch_size = n_rows, batch_size
        self.rng = np.random.default_rng(seed)
        self.epoch, self.position = 0, 0
        self.order = self.rng.permutation(n_rows)

    def next(self) -> list[int]:
        if self.position + self.batch_size > self.n_rows:
            self.epoch += 1
            self.position = 0
            self.order = self.rng.permutation(self.n_rows)
        batch = self.order[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return batch.tolist()

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "epoch": self.epoch, "position": self.position, "order": self.order.tolist()}

    def load_state_dict(self, state: dict) -> None:
        import numpy as np

        self.rng.bit_generator.state = state["rng"]
        self.epoch, self.position, self.order = state["epoch"], state["position"], np.array(state["order"])
