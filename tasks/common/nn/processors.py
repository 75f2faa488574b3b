"""A vision-language model's processor (image processor, tokenizer, chat template), loaded the same way wherever
one is needed: the stages (tasks.common.nn.vision re-exports it), a LoRA merge saving it beside the weights, the demo
VLM built offline. transformers and the standard library only, so anything in tasks/common/nn may import it.

    processor = load_processor(folder)               # AutoProcessor, without its video part where torchvision is missing
    Processor = image_only(Qwen2VLProcessor)          # the class without a video processor
"""

from __future__ import annotations

import json
from pathlib import Path


def image_only(processor_class):
    """`processor_class` without its video processor. transformers 5.x builds every processor with all its parts,
    and video processors need torchvision, which CPU installs lack (huggingface/transformers#48558): this
    subclass's signature has no video_processor, so ProcessorMixin neither loads nor checks one. Images only."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        processor_class.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    # Same name and module: save_pretrained writes the real class into processor_config.json, so a machine
    # with torchvision loads the folder as the full processor.
    return type(
        processor_class.__name__, (processor_class,), {"__init__": __init__, "__module__": processor_class.__module__}
    )


def load_processor(path: str):
    """The model's processor (image processor + tokenizer + chat template) via AutoProcessor; without torchvision,
    a processor whose class takes a video processor is loaded without one (image_only). Its tokenizer pads with
    EOS when it has no pad token."""
    import transformers
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    config, processor = Path(path) / "processor_config.json", None
    if not is_torchvision_available() and config.is_file():
        name = json.loads(config.read_text()).get("processor_class", "")
        cls = getattr(transformers, name, None)
        if cls is not None and "video_processor" in cls.get_attributes():
            processor = image_only(cls).from_pretrained(path)
    processor = processor or AutoProcessor.from_pretrained(path)
    if processor.tokenizer.pad_token is None:  # as load_tokenizer: batches are padded
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor
