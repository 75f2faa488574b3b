"""A report sample's images as inline data: URIs (issue 54): report.html stays one self-contained file, and the
reports view's CSP (plugins/reports.py: img-src data:) lets nothing else in.

    images_cell(sample["images"])      # '<img src="data:image/png;base64,…" alt="image 1 of the prompt">'

An image is base64 (PNG, as prepare_data stores it) or a data: URI of a PNG, JPEG, GIF or WebP; it is scaled to
IMAGE_SIDE pixels on its longest side. What is not an image is named, not shown, and only base64's alphabet ever
reaches the attribute.
"""

from __future__ import annotations

import base64
import binascii
import io
import re

#: A sample image's longest side in the report, in pixels; an image that cannot be scaled (no PIL) is inlined only
#: up to IMAGE_BYTES, so a few samples cannot make the page megabytes.
IMAGE_SIDE, IMAGE_BYTES = 256, 256 * 1024
_DATA_URI = re.compile(r"^data:image/(png|jpeg|gif|webp);base64,")
_BASE64 = re.compile(r"^[A-Za-z0-9+/]+={0,2}$")


def image_uri(value) -> str | None:
    """A data: URI of one stored image (base64, or a data: URI of a PNG, JPEG, GIF or WebP) to put in an <img>, PNG
    at most IMAGE_SIDE on its longest side; None for what is not an image (it is then named, not shown)."""
    if not isinstance(value, str):
        return None
    match = _DATA_URI.match(value)
    kind, body = (match.group(1), value[match.end() :]) if match else ("png", value)
    if not _BASE64.match(body):  # only base64's alphabet reaches the attribute
        return None
    try:
        raw = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        return None
    try:
        from PIL import Image
    except ImportError:  # the Airflow side's installs lack PIL: inline a small image as it is
        return f"data:image/{kind};base64,{body}" if len(body) <= IMAGE_BYTES else None
    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
    except Exception:  # PIL raises several kinds for bytes that are no image
        return None
    if max(image.size) > IMAGE_SIDE:
        image.thumbnail((IMAGE_SIDE, IMAGE_SIDE))
    out = io.BytesIO()
    image.convert("RGBA" if image.mode in ("RGBA", "LA", "P") else "RGB").save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode("ascii")


def images_cell(images) -> str:
    """The sample's images as <img> tags (an image that cannot be shown is named instead)."""
    tags = []
    for number, value in enumerate(images or [], 1):
        uri = image_uri(value)
        tags.append(
            f'<img src="{uri}" alt="image {number} of the prompt">'
            if uri
            else f'<span class="note">image {number}: not shown</span>'
        )
    return " ".join(tags) or "–"
