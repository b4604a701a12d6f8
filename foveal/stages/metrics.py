"""Per-stage counters, exported under Prometheus-style `foveal:stage_*` names."""
from __future__ import annotations

import bisect
import threading
import time
from collections import deque

# seconds; an item's latency runs from submission (queueing included) to its result
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW_S = 60.0


class StageMetrics:
    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.items = 0
        self.failures = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self.rejected = 0
        self.worker_restarts = 0
        self.cancelled = 0  # queued items every caller gave up on
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)  # last: +Inf
        self.latency_sum = 0.0
        self._recent: deque[float] = deque()  # completion times within RATE_WINDOW_S
        self._lock = threading.Lock()

    def observe(self, latency_s: float, ok: bool) -> None:
        now = time.monotonic()
        with self._lock:
            self.items += ok
            self.failures += not ok
            self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, latency_s)] += 1
            self.latency_sum += latency_s
            self._recent.append(now)
            while self._recent and self._recent[0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def count(self, counter: str) -> None:
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)

    def items_per_second(self) -> float:
        with self._lock:
            recent = list(self._recent)
        if len(recent) < 2:
            return 0.0
        span = max(time.monotonic() - recent[0], 1e-3)
        return len(recent) / span

    def as_dict(self, queue_depth: int, workers: int) -> dict[str, float]:
        label = f'stage="{self.stage}"'
        stats: dict[str, float] = {
            f"foveal:stage_queue_depth{{{label}}}": queue_depth,
            f"foveal:stage_workers{{{label}}}": workers,
            f"foveal:stage_items_total{{{label}}}": self.items,
            f"foveal:stage_failures_total{{{label}}}": self.failures,
            f"foveal:stage_rejected_total{{{label}}}": self.rejected,
            f"foveal:stage_cache_hits_total{{{label}}}": self.cache_hits,
            f"foveal:stage_cache_misses_total{{{label}}}": self.cache_misses,
            f"foveal:stage_worker_restarts_total{{{label}}}": self.worker_restarts,
            f"foveal:stage_cancelled_total{{{label}}}": self.cancelled,
            f"foveal:stage_items_per_second{{{label}}}": self.items_per_second(),
            f"foveal:stage_latency_seconds_sum{{{label}}}": self.latency_sum,
            f"foveal:stage_latency_seconds_count{{{label}}}": sum(self.latency_counts),
        }
        cumulative = 0
        for bound, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], self.latency_counts):
            cumulative += count
            stats[f'foveal:stage_latency_seconds_bucket{{{label},le="{bound}"}}'] = cumulative
        return stats
