"""Stage results by content hash: an LRU capped by the results' approximate size."""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from typing import Any


def approx_nbytes(value: Any) -> int:
    """Rough size of a result: its bytes and strings plus a small cost per object."""
    if isinstance(value, (bytes, bytearray, str)):
        return len(value) + 48
    if dataclasses.is_dataclass(value):
        return 64 + sum(approx_nbytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, (list, tuple)):
        return 56 + sum(approx_nbytes(v) for v in value)
    return 32


class ResultCache:
    """Thread-safe LRU from cache key (sha256 hex) to result, at most `max_bytes` in total.

    A result larger than the whole cache is not stored. `max_bytes=0` disables it.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: str, result: Any) -> None:
        size = approx_nbytes(result)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                self._nbytes -= self._entries.pop(key)[1]
            self._entries[key] = (result, size)
            self._nbytes += size
            while self._nbytes > self.max_bytes:
                _, (_, evicted_size) = self._entries.popitem(last=False)
                self._nbytes -= evicted_size

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes
