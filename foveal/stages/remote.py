"""Client side of a remote stage: one or more HTTP endpoints, round robin.

An endpoint that refuses connections, times out or answers 5xx is marked
down and skipped; the item is retried once on another endpoint (so a
server killed mid-request costs its in-flight items one retry, not a
failure). A background thread polls GET /health and brings endpoints back.
A 4xx answer is the item's own fault (bad PDF, ...) and is raised as the
same typed error the server raised, without a retry.
"""
from __future__ import annotations

import itertools
import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from foveal.errors import StageError, StageOverloadedError
from foveal.stages import codec
from foveal.stages.metrics import StageMetrics

ATTEMPTS = 2  # the first endpoint, then one retry elsewhere


class _EndpointFailed(Exception):
    def __init__(self, note: str, overloaded: bool = False) -> None:
        super().__init__(note)
        self.overloaded = overloaded


class Endpoint:
    def __init__(self, url: str) -> None:
        self.url = url
        self.healthy = True


def run_path(stage: str) -> str:
    return f"/v1/stages/{stage}/run"


class RemoteStage:
    """`submit(item) -> Future` spread over the endpoints of one stage."""

    def __init__(self, stage: str, result_type: type, urls: tuple[str, ...], *,
                 queue_size: int, timeout_s: float, health_interval_s: float,
                 metrics: StageMetrics) -> None:
        self.stage, self.result_type = stage, result_type
        self.timeout_s, self.health_interval_s = timeout_s, health_interval_s
        self.queue_size, self.metrics = queue_size, metrics
        self.endpoints = [Endpoint(url) for url in urls]
        self._round_robin = itertools.cycle(range(len(self.endpoints)))
        self._lock = threading.Lock()
        self._in_flight = 0
        self._executor = ThreadPoolExecutor(max_workers=min(queue_size, 32),
                                            thread_name_prefix=f"foveal-remote-{stage}")
        self._closed = threading.Event()
        self._health_thread = threading.Thread(target=self._check_health, daemon=True)
        self._health_thread.start()

    @property
    def num_workers(self) -> int:
        return sum(endpoint.healthy for endpoint in self.endpoints)

    def queue_depth(self) -> int:
        return self._in_flight

    def warm_up(self) -> None:
        for endpoint in self.endpoints:
            endpoint.healthy = probe_health(endpoint.url, timeout_s=self.health_interval_s)

    def submit(self, item: Any) -> Future:
        with self._lock:
            if self._in_flight >= self.queue_size:
                self.metrics.count("rejected")
                raise StageOverloadedError(
                    f"{self.stage} remote stage has {self._in_flight} items in flight (the limit is "
                    f"{self.queue_size}); retry later or add endpoints (--stage-endpoint)")
            self._in_flight += 1
        future = self._executor.submit(self._call, json.dumps({"item": codec.encode(item)}).encode())
        future.add_done_callback(self._release)
        return future

    def _release(self, _: Future) -> None:
        with self._lock:
            self._in_flight -= 1

    def _call(self, body: bytes) -> Any:
        notes, tried, overloaded = [], [], 0
        for _ in range(ATTEMPTS):
            endpoint = self._pick(tried)
            if endpoint is None:
                break
            tried.append(endpoint)
            try:
                return self._post(endpoint, body)
            except _EndpointFailed as failure:
                overloaded += failure.overloaded
                endpoint.healthy = failure.overloaded  # busy is alive; anything else is down
                notes.append(f"{endpoint.url}: {failure}")
        if tried and overloaded == len(tried):
            raise StageOverloadedError(f"every {self.stage} endpoint tried is overloaded ({'; '.join(notes)})")
        raise StageError(
            f"{self.stage} remote stage failed on {len(tried)} endpoint(s) "
            f"({'; '.join(notes) or 'no endpoint is up'}); check the `foveal stage serve` processes")

    def _pick(self, tried: list[Endpoint]) -> Endpoint | None:
        with self._lock:
            order = [self.endpoints[next(self._round_robin)] for _ in self.endpoints]
        candidates = [e for e in order if e not in tried]
        healthy = [e for e in candidates if e.healthy]
        return (healthy or candidates or [None])[0]

    def _post(self, endpoint: Endpoint, body: bytes) -> Any:
        request = urllib.request.Request(endpoint.url + run_path(self.stage), data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return codec.decode(self.result_type, json.loads(response.read())["result"])
        except urllib.error.HTTPError as answer:
            error = codec.decode_error(_error_body(answer))
            if answer.code == 503:
                raise _EndpointFailed(str(error), overloaded=True) from answer
            if answer.code >= 500 or answer.code == 404:
                raise _EndpointFailed(f"HTTP {answer.code}: {error}") from answer
            raise error from None
        except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
            raise _EndpointFailed(f"{type(exc).__name__}: {exc}") from exc

    def _check_health(self) -> None:
        while not self._closed.wait(self.health_interval_s):
            for endpoint in self.endpoints:
                endpoint.healthy = probe_health(endpoint.url, timeout_s=self.health_interval_s)

    def close(self) -> None:
        self._closed.set()
        self._executor.shutdown(wait=False, cancel_futures=True)


def probe_health(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _error_body(answer: urllib.error.HTTPError) -> dict:
    try:
        return json.loads(answer.read())["error"]
    except (ValueError, KeyError, TypeError, OSError):
        return {"type": "StageError", "message": f"HTTP {answer.code} {answer.reason}"}
