"""Processor cache: processed media (pixel tensors, grid, tokens, mm_hash) kept
for repeats, so a repeated image skips decode, resize, normalize and patchify.

Keys are a content id plus every processing parameter (`processing_key`): the
id is a hash of the raw source (bytes, data URL, file contents, or the pixels
of a PIL image) or a client-given multi_modal_uuid ("uuid:<id>"), so the same
picture at another max_pixels is another entry. Entries are an LRU capped in
bytes of tensor data. The decoded size of each content id is remembered too
(a few ints), so the visual-token planner can run without decoding again.
"""
from __future__ import annotations

import hashlib
import pathlib
import urllib.parse
from collections import OrderedDict
from typing import Any

from foveal.multimodal.hashing import mm_hash

_MAX_SIZES = 65536  # remembered (width, height) per content id


def processing_key(content_id: str, tensor_params: dict[str, Any]) -> str:
    return mm_hash(content_id, tensor_params)


def source_content_id(source: Any) -> str | None:
    """A hash of the raw bytes a source holds, or None when they cannot be read
    (loading it then raises the request's real error). PIL images are
    identified by their decoded pixels ("pixels:" + hash_image), by the caller."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return "bytes:" + hashlib.sha256(source).hexdigest()
    if isinstance(source, str) and source[:5].lower() == "data:":
        return "bytes:" + hashlib.sha256(source.encode()).hexdigest()
    if isinstance(source, (str, pathlib.Path)):
        path = str(source)
        if path[:7].lower() == "file://":
            path = urllib.parse.unquote(urllib.parse.urlparse(path).path)
        try:
            return "bytes:" + hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
        except (OSError, ValueError):
            return None
    return None


class ProcessorCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self.num_queries = 0
        self.num_hits = 0
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # LRU first
        self._sizes: OrderedDict[str, tuple[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Any | None:
        self.num_queries += 1
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        self.num_hits += 1
        return entry[0]

    def put(self, key: str, item: Any, num_bytes: int) -> None:
        """Keep an item; one larger than the whole cache is not kept."""
        if num_bytes > self.capacity_bytes or key in self._entries:
            return
        while self.num_bytes + num_bytes > self.capacity_bytes:
            _, (_, evicted_bytes) = self._entries.popitem(last=False)
            self.num_bytes -= evicted_bytes
        self._entries[key] = (item, num_bytes)
        self.num_bytes += num_bytes

    def size_of(self, content_id: str) -> tuple[int, int] | None:
        """(width, height) of decoded content seen before, or None."""
        size = self._sizes.get(content_id)
        if size is not None:
            self._sizes.move_to_end(content_id)
        return size

    def remember_size(self, content_id: str, width: int, height: int) -> None:
        if self.capacity_bytes == 0:
            return
        self._sizes[content_id] = (width, height)
        self._sizes.move_to_end(content_id)
        if len(self._sizes) > _MAX_SIZES:
            self._sizes.popitem(last=False)

    def get_metrics(self) -> dict[str, float]:
        return {
            "foveal:processor_cache_queries_total": self.num_queries,
            "foveal:processor_cache_hits_total": self.num_hits,
            "foveal:processor_cache_bytes": self.num_bytes,
        }
