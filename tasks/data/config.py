"""prepare_data's flags: where the data comes from, how its columns map to the pipeline's splits, how it is checked.

    python -m tasks.data --output … --source s3://bucket/raw/chat.jsonl --datasets_root s3://bucket/prefix/datasets \\
        --messages_key messages --chosen_key chosen --rejected_key rejected --label_key label

A source is 'demo', a file (JSONL, Parquet or CSV; s3:// or local), a hub id (only when HF_HUB_OFFLINE is
not 1), or `dataset:<name>[@<version>]`, a version registered earlier under --datasets_root.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from tasks.common import names, storage
from tasks.common.config import ConfigError, StageConfig

FILE_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".csv": "csv"}
DATASET_PREFIX = "dataset:"
NAME = re.compile(names.NAME_PATTERN)
MAPPING_KEYS = ("input_key", "output_key", "chosen_key", "rejected_key", "label_key", "messages_key")


#: Tasks built in code, each with its own tiny base model ('demo' as base_model): the demo, the agentic ones, and
#: the vision-language demo (tasks/data/demo_vlm.py: a tiny Qwen2-VL names a shape's colour).
BUILT_IN_SOURCES = ("demo", "calculator", "guess", "demo_vlm")


def source_kind(source: str) -> str:
    """'demo' (a built-in task: demo, calculator, guess, demo_vlm), 'dataset' (a registered version), 'file' (s3:// or local)
    or 'hub' (a hub id)."""
    if source in BUILT_IN_SOURCES:
        return "demo"
    if source.startswith(DATASET_PREFIX):
        return "dataset"
    if (
        storage.is_s3(source)
        or source.startswith(("/", "./", "../", "file://"))
        or os.path.splitext(source)[1].lower() in FILE_FORMATS
        or os.path.exists(source)
    ):
        return "file"
    return "hub"


def parse_dataset_ref(source: str) -> tuple[str, str]:
    """`dataset:<name>[@<version>]` -> (name, version or '')."""
    name, _, version = source[len(DATASET_PREFIX) :].partition("@")
    if not NAME.match(name) or (version and not NAME.match(version)):
        raise ConfigError(
            f"source: {source!r} is not a dataset reference; use dataset:<name> or dataset:<name>@<version>"
        )
    return name, version


def default_dataset_name(source: str) -> str:
    """A file's name without its extension (a hub id's last part), made safe for a folder name."""
    base = source.rstrip("/").rsplit("/", 1)[-1]
    stem = os.path.splitext(base)[0] if os.path.splitext(base)[1].lower() in FILE_FORMATS else base
    return re.sub(r"[^A-Za-z0-9._-]", "_", stem).lstrip("._-")[:100] or "dataset"


@dataclass
class PrepareDataConfig(StageConfig):
    """Materialise the pipeline's datasets (and, for the demo, its base model) as a stage output."""

    source: str = field(
        default="demo",
        metadata={
            "help": "'demo' (the built-in task), 'calculator' or 'guess' (the agentic tasks, for --env_path), 'demo_vlm' (images), a JSONL/Parquet/CSV file (s3:// or local), a hub id "
            "(not with HF_HUB_OFFLINE=1), or dataset:<name>[@<version>] (a registered version; newest without @)"
        },
    )
    base_model: str = field(
        default="demo",
        metadata={
            "help": "'demo' builds a tiny Llama offline; otherwise a model URI or hub id recorded for the next stages"
        },
    )
    datasets_root: str = field(
        default="",
        metadata={
            "help": "where dataset versions are registered: <root>/<name>/<version>/ (the pipeline passes <bucket root>/datasets)"
        },
    )
    dataset_name: str = field(
        default="", metadata={"help": "name to register a file source under (default: its file name without extension)"}
    )
    input_key: str = field(
        default="prompt",
        metadata={"help": "column holding the prompt (not read when --messages_key is set)", "max_length": 200},
    )
    output_key: str = field(
        default="",
        metadata={
            "help": "column holding the SFT response (default: the final assistant turn of --messages_key, else --chosen_key)",
            "max_length": 200,
        },
    )
    chosen_key: str = field(
        default="chosen",
        metadata={"help": "column holding the preferred response ('' for SFT-only data)", "max_length": 200},
    )
    rejected_key: str = field(
        default="rejected",
        metadata={"help": "column holding the other response ('' for SFT-only data)", "max_length": 200},
    )
    label_key: str = field(
        default="",
        metadata={"help": "column holding a reference answer for exact-match eval ('' for none)", "max_length": 200},
    )
    messages_key: str = field(
        default="",
        metadata={
            "help": "column holding chat messages [{role, content}]: the turns before the final assistant turn are the prompt, that turn the SFT response",
            "max_length": 200,
        },
    )
    image_key: str = field(
        default="images",
        metadata={
            "help": "column holding each row's images (a list: paths relative to the dataset file, data: URIs, base64, or image dicts), "
            "one per <image> tag or image block of the prompt; unused when no row has it ('' to ignore it)",
            "max_length": 200,
        },
    )
    max_image_pixels: int = field(
        default=4096 * 4096,
        metadata={"help": "a row holding an image of more pixels (width × height) is rejected", "min": 1},
    )
    eval_fraction: float = field(
        default=0.1,
        metadata={
            "help": "fraction of prompts held out (preference_eval, eval), chosen by a hash of the prompt and --seed",
            "exclusive_min": 0,
            "exclusive_max": 1,
            "fix": "use a fraction such as 0.1",
        },
    )
    max_chars: int = field(
        default=16000,
        metadata={"help": "a row whose prompt plus longest response is longer (characters) is rejected", "min": 1},
    )
    max_bad_fraction: float = field(
        default=0.05,
        metadata={"help": "fail when more than this fraction of the rows fails validation", "min": 0, "max": 1},
    )

    def validate(self) -> None:
        super().validate()
        if not self.base_model:
            raise ConfigError("base_model: empty; pass 'demo' or a model URI / hub id")
        kind = source_kind(self.source)
        if kind == "demo":
            return
        if self.dataset_name and not NAME.match(self.dataset_name):
            raise ConfigError(
                f"dataset_name: {self.dataset_name!r} is not a usable name; use letters, digits, '.', '_' and '-'"
            )
        if kind == "file" and not storage.exists(self.source):
            raise ConfigError(f"source: no dataset at {self.source}: fix the URI or upload the dataset")
        if kind == "hub" and os.environ.get("HF_HUB_OFFLINE") == "1":
            raise ConfigError(
                f"source: {self.source!r} is a hub id, and HF_HUB_OFFLINE=1 forbids fetching it: pass a JSONL, Parquet or CSV file URI"
            )
        if kind == "file" and os.path.splitext(self.source)[1].lower() not in FILE_FORMATS:
            raise ConfigError(f"source: {self.source} has an unknown format; use a .jsonl, .parquet or .csv file")
        if not self.datasets_root:
            raise ConfigError(
                "datasets_root: missing; pass --datasets_root s3://bucket/prefix/datasets (where dataset versions are registered)"
            )
        if kind == "dataset":
            parse_dataset_ref(self.source)  # a registered version keeps the mapping and split it was made with
        else:
            self.validate_mapping()

    def validate_mapping(self) -> None:
        """The mapping can produce at least one split, and a pair has both sides."""
        if not (self.input_key or self.messages_key):
            raise ConfigError(
                "input_key: empty and no --messages_key; pass the prompt column (--input_key) or a chat column (--messages_key)"
            )
        if bool(self.chosen_key) != bool(self.rejected_key):
            missing = "rejected_key" if self.chosen_key else "chosen_key"
            raise ConfigError(
                f"{missing}: empty while the other side of the pair is set; pass both --chosen_key and --rejected_key, or neither"
            )
        if not (self.output_key or self.chosen_key or self.messages_key):
            raise ConfigError(
                "output_key: nothing to train on; pass --output_key (SFT), --chosen_key/--rejected_key (pairs) or --messages_key"
            )

    def mapping(self) -> dict[str, str]:
        """The column mapping as used (empty: unused), recorded in a version's manifest and its id."""
        mapping = {key: getattr(self, key) for key in MAPPING_KEYS}
        if self.messages_key:
            mapping["input_key"] = ""  # the messages give the prompt: input_key is not read
        return mapping
