"""Fit an image into the byte budget of an inline MCP image: downscale, then re-encode.

The images come from untrusted kernel code, so they are decoded only when they are too large,
and never when their header claims more pixels than ``MAX_PIXELS`` (a decompression bomb).
"""

from __future__ import annotations

import io

from PIL import Image

from ..errors import ImageTooLarge

MAX_PIXELS = 50_000_000
INLINE_TYPES = {"image/png", "image/jpeg", "image/gif", "image/webp"}


def fit_image(data: bytes, mime: str, max_bytes: int) -> tuple[bytes, str]:
    """``(bytes, mime)`` of at most ``max_bytes``; ImageTooLarge if it cannot be made to fit."""
    if len(data) <= max_bytes:
        return data, mime
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            if w * h > MAX_PIXELS:
                raise ImageTooLarge(f"the image is {w}x{h} pixels, too large to decode")
            img.load()
            img = img.convert("RGBA" if img.mode in ("RGBA", "LA", "P") else "RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageTooLarge(f"the image cannot be decoded: {e}") from e
    scale = min(1.0, (max_bytes / len(data)) ** 0.5)
    for _ in range(8):
        size = (max(1, int(w * scale)), max(1, int(h * scale)))
        small = img.resize(size, Image.Resampling.LANCZOS)
        out = io.BytesIO()
        if small.mode == "RGBA":
            small.save(out, "PNG", optimize=True)
            kind = "image/png"
        else:
            small.save(out, "JPEG", quality=85)
            kind = "image/jpeg"
        if out.tell() <= max_bytes:
            return out.getvalue(), kind
        scale *= 0.7
    raise ImageTooLarge("the image could not be made small enough")
