"""Prometheus metrics of the server, under the names `LLM.get_metrics()` uses.

Three sources: latency histograms observed here as requests stream and finish
(TTFT, inter-token latency, end-to-end, preprocessing); the engine's counters
and gauges (`foveal:prompt_tokens_total`, `foveal:kv_cache_usage_perc`,
`foveal:request_success_total{finished_reason="stop"}`, ...) read from
`AsyncLLM.get_metrics()` at scrape time; and the preprocessing stages'
(`foveal:stage_items_total{stage="pdf"}`, `foveal:stage_queue_depth`, ...) from
`StagePools.get_metrics()`. Both snapshots are exported as they are: a name
ending in `_total` is a counter, any other a gauge.

Gauges that read 0 on an idle server (`foveal bench soak` checks them):
`foveal:kv_cache_usage_perc`, `foveal:num_requests_running` / `_waiting`,
`foveal:encoder_cache_held_entries` (encoder cache entries an unfinished request
references), `foveal:api_requests_in_flight` and `foveal:detokenizer_requests`
(the API process's request table and output processor), and
`foveal:stage_queue_depth`.
"""
from __future__ import annotations

import re
import time
from collections import defaultdict

from prometheus_client import (CollectorRegistry, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from foveal.engine.output import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_STAT_KEY = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?P<labels>.*)\})?$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')

# `*_created` timestamps double the output and no dashboard reads them.
disable_created_metrics()


class EngineStatsCollector:
    """Exports the latest `get_metrics()` snapshot; refreshed before each scrape."""

    def __init__(self) -> None:
        self.snapshot: dict[str, float] = {}

    def collect(self):
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for key, value in self.snapshot.items():
            match = _STAT_KEY.match(key)
            if match is None or not isinstance(value, (int, float)):
                continue
            labels = dict(_LABEL.findall(match.group("labels") or ""))
            samples[match.group("name")].append((labels, float(value)))
        for name, points in samples.items():
            label_names = sorted(points[0][0])
            if name.endswith("_total"):
                family = CounterMetricFamily(name[:-len("_total")], f"engine counter {name}",
                                             labels=label_names)
            else:
                family = GaugeMetricFamily(name, f"engine gauge {name}", labels=label_names)
            for labels, value in points:
                family.add_metric([labels.get(label, "") for label in label_names], value)
            families[name] = family
        return list(families.values())


class ServerMetrics:
    """One per app (its own registry, so several servers can live in one process)."""

    def __init__(self, stages=None) -> None:
        """stages: a StagePools whose stage metrics are exported too."""
        self.stages = stages
        self.registry = CollectorRegistry()
        self.engine_stats = EngineStatsCollector()
        self.registry.register(self.engine_stats)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.time_to_first_token = histogram("foveal:time_to_first_token_seconds",
                                             "arrival to first generated token")
        self.inter_token_latency = histogram("foveal:inter_token_latency_seconds",
                                             "time between two streamed token deltas")
        self.e2e_latency = histogram("foveal:e2e_request_latency_seconds",
                                     "arrival to finish")
        self.preprocess_time = histogram("foveal:request_preprocess_time_seconds",
                                         "tokenization + media processing before the engine")

    def observe_finished(self, output: RequestOutput) -> None:
        metrics = output.metrics
        if metrics is None:
            return
        if metrics.first_token_time is not None:
            self.time_to_first_token.observe(metrics.first_token_time - metrics.arrival_time)
        finished = metrics.finished_time or time.time()
        self.e2e_latency.observe(max(0.0, finished - metrics.arrival_time))
        preprocess = getattr(metrics, "preprocess_time", None)
        if preprocess is not None:
            self.preprocess_time.observe(preprocess)

    async def render(self, engine) -> bytes:
        snapshot = dict(await engine.get_metrics())
        if self.stages is not None:
            snapshot.update(self.stages.get_metrics())
        self.engine_stats.snapshot = snapshot
        return generate_latest(self.registry)


class TokenTimer:
    """Observes the gap between consecutive outputs that carry new tokens."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._last: float | None = None

    def on_output(self, output: RequestOutput) -> None:
        if output.outputs and output.outputs[0].token_ids:
            now = time.perf_counter()
            if self._last is not None:
                self._metrics.inter_token_latency.observe(now - self._last)
            self._last = now
        if output.finished:
            self._metrics.observe_finished(output)
