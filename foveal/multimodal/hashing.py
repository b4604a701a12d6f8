"""Content hashes that identify media items across every cache.

`hash_image` identifies decoded pixels, whatever source they came from;
`mm_hash` folds in every processing parameter that changes the tensors, so the
same picture processed at two resolutions gets two keys. Full sha256 hex, never
truncated: a collision would silently share KV between different images.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from PIL import Image


def hash_image(image: Image.Image) -> str:
    """sha256 hex of the image's mode, size and raw pixel bytes (and palette, if any)."""
    digest = hashlib.sha256()
    digest.update(f"image:{image.mode}:{image.width}x{image.height}:".encode())
    palette = image.getpalette() if image.mode in ("P", "PA") else None
    if palette is not None:
        digest.update(bytes(palette))
    digest.update(image.tobytes())
    return digest.hexdigest()


def mm_hash(content_hash: str, params: dict[str, Any]) -> str:
    """sha256 hex of a content hash plus the canonical JSON of processing params."""
    canonical = json.dumps(params, sort_keys=True, separators=(",", ":"), allow_nan=False)
    digest = hashlib.sha256()
    digest.update(content_hash.encode())
    digest.update(b"\x00")
    digest.update(canonical.encode())
    return digest.hexdigest()
