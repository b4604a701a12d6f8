"""The exports a transfer server serves: a thread-safe, byte-capped store of
named tensors by key, with an optional time to live. A consumed export
(consume=True, a KV handoff with one reader) leaves when it is served; others
(embeddings) stay, least recently used evicted first."""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass


from foveal.errors import ConfigError, TransferError
from foveal.disagg.wire import Tensors, contiguous_cpu, pack

@dataclass
class Export:
    meta: dict
    tensors: Tensors  # contiguous CPU tensors; `frames` are views of them
    frames: list  # pack() output, served as is
    num_bytes: int
    consume: bool
    expires_at: float  # time.monotonic() deadline; inf without a TTL


class ExportStore:
    """Thread-safe, byte-capped store of exports the TransferServer serves.

    An export is a (meta, tensors) pair under a key, packed once at put(). The
    tensors are kept by reference: do not modify them after put(). The TTL is
    for handoffs (consume=True): one nobody claims within ttl_s of its put()
    expires. Kept exports (caches) stay until evicted. Making room drops expired
    exports first, then the least recently used (put, get and fetch count as use)."""

    def __init__(self, capacity_bytes: int, ttl_s: float | None = None):
        if capacity_bytes <= 0 or (ttl_s is not None and ttl_s <= 0):
            raise ConfigError(f"export store needs capacity_bytes > 0 and ttl_s > 0 or None; "
                              f"got {capacity_bytes} and {ttl_s}")
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self._exports: OrderedDict[str, Export] = OrderedDict()  # least recently used first
        self._num_bytes = 0
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(("num_exports", "num_fetches", "num_expired", "num_evicted",
                                     "bytes_served"), 0)

    def put(self, key: str, meta: dict, tensors: Tensors, *, consume: bool = False) -> int:
        """Store an export, replacing one under the same key; returns its bytes.
        consume=True: it leaves after its first fetch (a KV handoff has one reader)."""
        tensors = {name: contiguous_cpu(name, tensor) for name, tensor in tensors.items()}
        frames = pack(meta, tensors)
        num_bytes = sum(frame.nbytes for frame in frames[1:])
        if num_bytes > self.capacity_bytes:
            raise TransferError(f"export {key!r} is {num_bytes} bytes; the export store holds at most "
                                f"{self.capacity_bytes} bytes (raise its capacity)")
        expires_at = math.inf if self.ttl_s is None or not consume else time.monotonic() + self.ttl_s
        with self._lock:
            self._remove(key)
            self._make_room(num_bytes)
            self._exports[key] = Export(meta, tensors, frames, num_bytes, consume, expires_at)
            self._num_bytes += num_bytes
            self._stats["num_exports"] += 1
        return num_bytes

    def get(self, key: str) -> tuple[dict, Tensors] | None:
        """A local read that never consumes: the stored (meta, tensors), or None."""
        with self._lock:
            export = self._live(key)
            if export is None:
                return None
            self._exports.move_to_end(key)
            return export.meta, export.tensors

    def take(self, keys: list[str], max_bytes: int) -> list[Export]:
        """The exports for one fetch, all or none (TransferServer's half of fetch):
        consumed ones leave the store, kept ones become most recently used."""
        with self._lock:
            exports = [self._live(key) for key in keys]
            missing = [key for key, export in zip(keys, exports) if export is None]
            if missing:
                raise TransferError(f"{len(missing)} of {len(keys)} keys are not exported here (never put, "
                                    f"expired, evicted or already consumed): {missing[:8]}")
            total = sum(export.num_bytes for export in exports)
            if total > max_bytes:
                raise TransferError(f"the {len(keys)} keys hold {total} bytes; the fetch allows "
                                    f"{max_bytes} bytes (raise max_bytes)")
            for key, export in zip(keys, exports):
                if export.consume:
                    self._remove(key)
                else:
                    self._exports.move_to_end(key)
            self._stats["num_fetches"] += len(keys)
            self._stats["bytes_served"] += total
            return exports

    def delete(self, key: str) -> None:
        with self._lock:
            self._remove(key)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return self._live(key) is not None

    def __len__(self) -> int:
        with self._lock:
            self._drop_expired()
            return len(self._exports)

    @property
    def num_bytes(self) -> int:
        with self._lock:
            self._drop_expired()
            return self._num_bytes

    def stats(self) -> dict:
        """Counters since creation: num_exports (puts), num_fetches (keys served),
        num_expired, num_evicted, bytes_served."""
        with self._lock:
            return dict(self._stats)

    def _live(self, key: str) -> Export | None:
        export = self._exports.get(key)
        if export is not None and export.expires_at <= time.monotonic():
            self._remove(key)
            self._stats["num_expired"] += 1
            return None
        return export

    def _drop_expired(self) -> None:
        if self.ttl_s is None:
            return
        now = time.monotonic()
        for key in [key for key, export in self._exports.items() if export.expires_at <= now]:
            self._remove(key)
            self._stats["num_expired"] += 1

    def _make_room(self, num_bytes: int) -> None:
        self._drop_expired()
        while self._num_bytes + num_bytes > self.capacity_bytes:
            self._remove(next(iter(self._exports)))
            self._stats["num_evicted"] += 1

    def _remove(self, key: str) -> None:
        export = self._exports.pop(key, None)
        if export is not None:
            self._num_bytes -= export.num_bytes


