from dataclasses import dataclass, field

from tasks.common import storage
from tasks.common.config import ConfigError, StageConfig


@dataclass
class PrepareDataConfig(StageConfig):
    """Materialise the pipeline's datasets (and, for the demo, its base model) as a stage output."""

    source: str = field(default="demo", metadata={"help": "'demo' for the built-in synthetic task"})
    base_model: str = field(default="demo", metadata={"help": "'demo' builds a tiny Llama offline; otherwise a model URI or hub id recorded for the next stages"})

    def validate(self) -> None:
        super().validate()
        if self.source != "demo":
            if (storage.is_s3(self.source) or self.source.startswith(("/", "./", "file://"))) and not storage.exists(self.source):
                raise ConfigError(f"source: no dataset at {self.source}: fix the URI or upload the dataset")
            raise ConfigError(f"source: {self.source!r}: only the built-in 'demo' dataset is supported yet")
        if not self.base_model:
            raise ConfigError("base_model: empty; pass 'demo' or a model URI / hub id")
