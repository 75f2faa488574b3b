"""Images as a stored split holds them (prepare_data's base64 PNG, data: URIs, bytes, HF/Parquet image dicts), as PIL
images: what every vision-language path (tasks.common.nn.vision, vision_family, the engines) decodes them with.

    image = decode_image(row["images"][0])      # PIL.Image, decoded now (a truncated file fails here)
"""

from __future__ import annotations

import base64
import binascii
import io


def decode_image(value):
    """A PIL image from what a stored split holds: base64 PNG (the form prepare_data writes), a data: URI, bytes,
    an HF/Parquet image dict {"bytes", "path"} with bytes, or a PIL image. Raises ValueError when it is none."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        value = value.get("bytes")
    if isinstance(value, str):
        head, _, tail = value.partition(",") if value.startswith("data:") else ("", "", value)
        try:
            value = base64.b64decode(tail, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("not base64 image data") from None
    if not isinstance(value, (bytes, bytearray)):
        raise ValueError(f"an image must be bytes, base64 text or a PIL image, not {type(value).__name__}")
    image = Image.open(io.BytesIO(value))
    image.load()  # decode now: a truncated file fails here, not inside the processor
    return image
