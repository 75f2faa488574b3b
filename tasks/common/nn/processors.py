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

    def save_pretrained(self, save_directory, *args, **kwargs):
        saved = processor_class.save_pretrained(self, save_directory, *args, **kwargs)
        write_video_processor(Path(save_directory) / "processor_config.json")
        return saved

    # Same name and module: save_pretrained writes the real class into processor_config.json, so a machine
    # with torchvision loads the folder as the full processor.
    return type(
        processor_class.__name__,
        (processor_class,),
        {"__init__": __init__, "save_pretrained": save_pretrained, "__module__": processor_class.__module__},
    )


def write_video_processor(config: Path) -> None:
    """Give processor_config.json the video processor an image_only processor dropped: where torchvision is
    installed (vLLM's machines), AutoProcessor loads the full class and refuses a folder without one (seen on the
    GPU machine, 2026-12-07). It is the image processor's settings under the family's video processor type, as
    Qwen2-VL's published checkpoints have it. A folder whose image processor is in a file of its own
    (preprocessor_config.json, older transformers) needs none: the video processor falls back to it."""
    if not config.is_file():
        return
    saved = json.loads(config.read_text())
    image = saved.get("image_processor")
    if "video_processor" in saved or not image or "ImageProcessor" not in image.get("image_processor_type", ""):
        return
    video = {k: v for k, v in image.items() if k != "image_processor_type"}
    video["video_processor_type"] = image["image_processor_type"].replace("ImageProcessor", "VideoProcessor")
    config.write_text(json.dumps({**saved, "video_processor": video}, indent=2, sort_keys=True) + "\n")


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
