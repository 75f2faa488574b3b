"""A dataset's image column (--image_key, issue 54): each cell's images decoded once, checked, and kept as PNG.

    source = ImageSource.of(cfg.source, cfg.max_image_pixels)     # where relative paths are read from
    pngs = source.column(row["images"])                           # [base64 PNG, ...]; raises ImageError(reason)
    check_count(record["prompt"], pngs)                           # one <image> tag or image block per image

A cell is a list of images (a single image counts as a list of one; CSV may hold the list as JSON text). An image
is a path relative to the dataset file (local or on S3, never leaving its folder), a `data:` URI or base64 text,
raw bytes, or a Parquet / 🤗 datasets image dict {"bytes": ..., "path": ...}. Each is opened with Pillow, its
format and size checked before its pixels are decoded, then decoded (a truncated file fails here, not in a
stage), turned upright by its EXIF orientation, and re-encoded as PNG: the stored split is self-contained (the
stages fetch no image) and lossless, and every stage decodes the same pixels.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import posixpath
from dataclasses import dataclass

from tasks.common import storage
from tasks.common.image_tags import count_placeholders

#: What Pillow may open (a format it reads that is no photo, such as EPS, runs Ghostscript: refused).
FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")
PATH_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff")


class ImageError(Exception):
    """An image cell failing a check: `reason` is the validation check (ingest.FIXES), `detail` says which image."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


def check_count(prompt, images: list) -> None:
    """One image per placeholder (tasks/common/image_tags.py)."""
    if count_placeholders(prompt) != len(images):
        raise ImageError("image_count", f"{len(images)} image(s), {count_placeholders(prompt)} placeholder(s)")


def digest(images: list[str]) -> str:
    """What a prompt's identity adds for its images (split side, overlap, unique prompts): a hash of their PNGs."""
    return hashlib.sha256("\0".join(images).encode("ascii")).hexdigest()


@dataclass(frozen=True)
class ImageSource:
    """Where a dataset's relative image paths are read from, and the largest image (in pixels) it keeps."""

    base: str  # the dataset file's folder: a local path or an s3:// prefix
    max_pixels: int

    @classmethod
    def of(cls, source: str, max_pixels: int) -> ImageSource:
        base = source.rsplit("/", 1)[0] if storage.is_s3(source) else str(storage.local_path(source).parent)
        return cls(base, max_pixels)

    def column(self, cell) -> list[str]:
        """The cell's images as base64 PNG, in order; raises ImageError naming the first bad one."""
        if cell is None or (isinstance(cell, str) and not cell.strip()):  # CSV writes a row without images as ""
            return []
        if isinstance(cell, str) and cell.lstrip().startswith("["):  # CSV: the list as JSON text
            try:
                cell = json.loads(cell)
            except ValueError:
                raise ImageError("bad_image", "the cell is neither an image nor a JSON list of images") from None
        if isinstance(cell, (str, bytes, bytearray, dict)):
            cell = [cell]
        if not isinstance(cell, (list, tuple)):
            raise ImageError("bad_image", f"a cell of type {type(cell).__name__}")
        return [self.png(value, i) for i, value in enumerate(cell, start=1)]

    def png(self, value, number: int = 1) -> str:
        """One image as base64 PNG."""
        from PIL import Image, ImageOps, UnidentifiedImageError

        data = self.raw(value, number)
        try:
            image = Image.open(io.BytesIO(data), formats=FORMATS)
        except Image.DecompressionBombError:
            raise ImageError("image_too_large", f"image {number} is over Pillow's decompression-bomb limit") from None
        except (UnidentifiedImageError, OSError, ValueError):
            raise ImageError("bad_image", f"image {number} is not a {', '.join(FORMATS)} image") from None
        width, height = image.size  # from the header: a huge image is refused before its pixels are decoded
        if width * height > self.max_pixels:
            raise ImageError("image_too_large", f"image {number} is {width}x{height}")
        try:
            image.load()
        except (OSError, ValueError, Image.DecompressionBombError):
            raise ImageError("bad_image", f"image {number} is truncated or corrupt") from None
        image = ImageOps.exif_transpose(image)  # a phone's JPEG stores its pixels sideways and says so in EXIF
        if image.mode not in ("RGB", "RGBA", "L", "LA"):
            image = image.convert("RGBA" if "transparency" in image.info or image.mode == "PA" else "RGB")
        out = io.BytesIO()
        image.save(out, format="PNG")
        return base64.b64encode(out.getvalue()).decode("ascii")

    def raw(self, value, number: int) -> bytes:
        """The encoded bytes of one image however the cell holds it."""
        if isinstance(value, dict):  # Parquet / 🤗 datasets: bytes when embedded, else a path
            value = value.get("bytes") or value.get("path")
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
        if not isinstance(value, str) or not value.strip():
            raise ImageError("bad_image", f"image {number} is {type(value).__name__}, not a path, base64 text or bytes")
        value = value.strip()
        if value.startswith("data:"):
            value = value.partition(",")[2]
        elif value.lower().endswith(PATH_SUFFIXES):
            return self.read(value, number)
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError(
                "bad_image", f"image {number} is neither base64 nor a path ending in an image suffix"
            ) from None

    def read(self, rel: str, number: int) -> bytes:
        parts = rel.replace("\\", "/").split("/")
        if rel.startswith(("/", "\\")) or ".." in parts or ":" in parts[0]:
            raise ImageError("bad_image", f"image {number}'s path {rel!r} leaves the dataset's folder")
        try:
            return storage.read_bytes(storage.join(self.base, posixpath.join(*parts)))
        except storage.StorageError:
            raise ImageError("bad_image", f"image {number}: no file {rel!r} beside the dataset") from None
