"""The router's worker pools: who serves each stage (encode, prefill, decode),
whether they are healthy, how busy they are, and which one already holds the
cache a request can reuse.

Everything here is plain data and runs on the router's one event loop, so no
locks: a choice, a health update and a registration never interleave. The
only I/O is the health probe (`check_health`), given the router's client;
`PoolMetrics` exports the pools' load and failures to Prometheus.

Cache affinity works on keys the router computes without a tokenizer:
- encode: one key per media part, sha256 of its URL string (a data: URL holds
  the bytes, so the same image sent twice has the same key);
- prefill: chained prefix hashes, h_i = sha256(h_{i-1} + canonical JSON of
  messages[i]) for chat, or over 256-character chunks of a completion prompt,
  so turn 2 of a conversation shares turn 1's keys.
Each pool remembers key -> worker in a bounded LRU and prefers the worker
holding the most of a request's keys, unless it is busier than the least
loaded healthy worker by more than `load_slack` requests.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics

from foveal.entrypoints.security_args import SecurityConfig
from foveal.errors import ConfigError
from foveal.logger import init_logger

logger = init_logger(__name__)
disable_created_metrics()  # as the server does: `*_created` samples double /metrics

ROLES = ("encode", "prefill", "decode")
PROMPT_CHUNK_CHARS = 256  # a token-free stand-in for the workers' prefix-cache blocks
MEDIA_PART_TYPES = ("image_url", "video_url")


def normalize_worker_url(url: str) -> str:
    """'http://host:port' without a trailing slash; anything else is a ConfigError."""
    if not isinstance(url, str):
        raise ConfigError(f"worker url must be a string like 'http://10.0.0.5:8000', not {url!r}")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"worker url {url!r} is not 'http(s)://host:port'; "
                          "pass the base URL a `foveal serve --role ...` worker listens on")
    return url.strip().rstrip("/")


@dataclass(eq=False)
class Worker:
    """One worker server as the router sees it. `down_since` is the monotonic
    time it was first seen failing after having been healthy; a worker that
    was never healthy (still loading its model) is never removed."""
    url: str
    healthy: bool = False
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    ever_healthy: bool = False
    down_since: float | None = None

    def describe(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight,
                "served": self.served, "failures": self.failures}


class OwnerCache:
    """Bounded LRU of cache key -> url of the worker that last served it."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"cache capacity must be at least 1 entry, got {capacity}")
        self.capacity = capacity
        self._owners: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def owner(self, key: str) -> str | None:
        return self._owners.get(key)

    def record(self, keys: Iterable[str], url: str) -> None:
        for key in keys:
            self._owners[key] = url
            self._owners.move_to_end(key)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def forget(self, url: str) -> int:
        """Drop every entry of a worker that left; returns how many."""
        stale = [key for key, owner in self._owners.items() if owner == url]
        for key in stale:
            del self._owners[key]
        return len(stale)

    def scores(self, keys: list[str]) -> dict[str, int]:
        """url -> how much of `keys` that worker holds (higher is better)."""
        raise NotImplementedError


class MediaAffinity(OwnerCache):
    """Score: how many of the request's media items the worker encoded before."""

    def scores(self, keys: list[str]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for key in keys:
            url = self.owner(key)
            if url is not None:
                counts[url] = counts.get(url, 0) + 1
        return counts


class PrefixAffinity(OwnerCache):
    """Score: the length of the longest prefix of the request the worker holds."""

    def scores(self, keys: list[str]) -> dict[str, int]:
        longest: dict[str, int] = {}
        for length, key in enumerate(keys, start=1):
            url = self.owner(key)
            if url is not None:
                longest[url] = length  # later keys are longer prefixes
        return longest


class WorkerPool:
    """The workers of one role, in registration order, with an optional cache affinity."""

    def __init__(self, role: str, urls: Iterable[str] = (), *, affinity: OwnerCache | None = None,
                 load_slack: int = 4) -> None:
        if role not in ROLES:
            raise ConfigError(f"unknown worker role {role!r}; expected one of {', '.join(ROLES)}")
        self.role, self.affinity, self.load_slack = role, affinity, load_slack
        self.workers: list[Worker] = []
        self._next_turn = 0  # round robin among equally loaded workers
        for url in urls:
            self.add(url)

    def __len__(self) -> int:
        return len(self.workers)

    def get(self, url: str) -> Worker | None:
        url = normalize_worker_url(url)
        return next((worker for worker in self.workers if worker.url == url), None)

    def add(self, url: str, healthy: bool = False) -> Worker:
        """Adds a worker (or returns the one already registered under `url`)."""
        worker = self.get(url)
        if worker is None:
            worker = Worker(normalize_worker_url(url))
            self.workers.append(worker)
        if healthy:
            self.record_health(worker, True)
        return worker

    def remove(self, url: str) -> Worker | None:
        """Takes a worker out of the pool and forgets what it cached."""
        worker = self.get(url)
        if worker is None:
            return None
        self.workers.remove(worker)
        if self.affinity is not None:
            self.affinity.forget(worker.url)
        return worker

    def healthy_workers(self) -> list[Worker]:
        return [worker for worker in self.workers if worker.healthy]

    def choose(self, keys: Sequence[str] = (), exclude: Iterable[str] = ()) -> Worker | None:
        """The worker for a request with these cache keys (None: no healthy
        worker left outside `exclude`). Records the keys against the choice."""
        skipped = set(exclude)
        candidates = [worker for worker in self.healthy_workers() if worker.url not in skipped]
        if not candidates:
            return None
        holder = self._best_holder(candidates, keys) if self.affinity is not None and keys else None
        lowest_load = min(worker.in_flight for worker in candidates)
        if holder is not None and holder.in_flight - lowest_load <= self.load_slack:
            chosen = holder
        else:
            chosen = self._least_loaded(candidates, lowest_load)
        if self.affinity is not None and keys:
            self.affinity.record(keys, chosen.url)
        return chosen

    def _least_loaded(self, candidates: list[Worker], lowest_load: int) -> Worker:
        ties = [worker for worker in candidates if worker.in_flight == lowest_load]
        order = {id(worker): index for index, worker in enumerate(self.workers)}
        # the first tie at or after the round-robin pointer, wrapping around
        chosen = min(ties, key=lambda worker: (order[id(worker)] - self._next_turn) % len(self.workers))
        self._next_turn = order[id(chosen)] + 1
        return chosen

    def _best_holder(self, candidates: list[Worker], keys: Sequence[str]) -> Worker | None:
        scores = self.affinity.scores(keys)
        holders = [worker for worker in candidates if scores.get(worker.url, 0) > 0]
        if not holders:
            return None
        return max(holders, key=lambda worker: (scores[worker.url], -worker.in_flight))

    def begin(self, worker: Worker) -> None:
        worker.in_flight += 1

    def finish(self, worker: Worker) -> None:
        worker.in_flight = max(0, worker.in_flight - 1)

    def mark_failed(self, worker: Worker, now: float | None = None) -> None:
        """A request failed on this worker: out of rotation until a good health check."""
        worker.failures += 1
        self.record_health(worker, False, now)

    def record_health(self, worker: Worker, ok: bool, now: float | None = None) -> None:
        if ok:
            worker.healthy, worker.ever_healthy, worker.down_since = True, True, None
            return
        worker.healthy = False
        if worker.ever_healthy and worker.down_since is None:
            worker.down_since = time.monotonic() if now is None else now

    def remove_expired(self, remove_after_s: float, now: float | None = None) -> list[Worker]:
        """Removes the workers down for at least `remove_after_s`; returns them."""
        now = time.monotonic() if now is None else now
        expired = [worker for worker in self.workers
                   if worker.down_since is not None and now - worker.down_since >= remove_after_s]
        for worker in expired:
            self.remove(worker.url)
        return expired


class RouterPools:
    """The three pools: encode and prefill cache-aware, decode least loaded."""

    def __init__(self, encode: Iterable[str] = (), prefill: Iterable[str] = (),
                 decode: Iterable[str] = (), *, cache_entries: int = 100_000,
                 load_slack: int = 4) -> None:
        if load_slack < 0:
            raise ConfigError(f"cache load slack must be >= 0 requests, got {load_slack}")
        self.encode = WorkerPool("encode", encode, affinity=MediaAffinity(cache_entries),
                                 load_slack=load_slack)
        self.prefill = WorkerPool("prefill", prefill, affinity=PrefixAffinity(cache_entries),
                                  load_slack=load_slack)
        self.decode = WorkerPool("decode", decode, load_slack=load_slack)

    def __getitem__(self, role: str) -> WorkerPool:
        if role not in ROLES:
            raise ConfigError(f"unknown worker role {role!r}; expected one of {', '.join(ROLES)}")
        return getattr(self, role)

    def __iter__(self) -> Iterator[WorkerPool]:
        return iter((self.encode, self.prefill, self.decode))

    def describe(self) -> dict[str, list[dict]]:
        return {pool.role: [worker.describe() for worker in pool.workers] for pool in self}


class PoolMetrics:
    """Per-pool counters (stage requests, worker failures, retries) and gauges
    read at scrape time (requests in flight, healthy workers)."""

    def __init__(self, pools: RouterPools) -> None:
        self.registry = CollectorRegistry()
        per_pool = {"labelnames": ["pool"], "registry": self.registry}
        self.requests = Counter("foveal:router_requests", "stage requests sent to workers", **per_pool)
        self.failures = Counter("foveal:router_failures", "stage requests a worker failed", **per_pool)
        self.retries = Counter("foveal:router_retries", "stage requests retried elsewhere", **per_pool)
        in_flight = Gauge("foveal:router_in_flight", "stage requests in flight", **per_pool)
        healthy = Gauge("foveal:router_healthy_workers", "healthy workers", **per_pool)
        for pool in pools:
            for family in (self.requests, self.failures, self.retries):
                family.labels(pool=pool.role)
            in_flight.labels(pool=pool.role).set_function(
                lambda pool=pool: sum(worker.in_flight for worker in pool.workers))
            healthy.labels(pool=pool.role).set_function(lambda pool=pool: len(pool.healthy_workers()))


async def probe_health(client: httpx.AsyncClient, url: str, timeout_s: float) -> bool:
    """Whether GET {url}/health answers 200 within `timeout_s`."""
    try:
        response = await client.get(url + "/health", timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


async def check_health(pools: RouterPools, client: httpx.AsyncClient, timeout_s: float,
                       remove_after_s: float) -> None:
    """Probes every worker once, concurrently; removes those down for `remove_after_s`."""
    members = [(pool, worker) for pool in pools for worker in pool.workers]
    results = await asyncio.gather(*(probe_health(client, worker.url, timeout_s)
                                     for _, worker in members))
    for (pool, worker), ok in zip(members, results):
        if worker in pool.workers:  # not removed while it was probed
            if ok and not worker.healthy:
                logger.info("%s worker %s is healthy", pool.role, worker.url)
            pool.record_health(worker, ok)
    for pool in pools:
        for worker in pool.remove_expired(remove_after_s):
            logger.warning("%s worker %s failed health checks for %g s; removed", pool.role,
                           worker.url, remove_after_s)


async def monitor_health(pools: RouterPools, client: httpx.AsyncClient, timeout_s: float,
                         remove_after_s: float, *, interval_s: float) -> None:
    """`check_health` every `interval_s` until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await check_health(pools, client, timeout_s, remove_after_s)
        except Exception:  # one bad round must not end health checking
            logger.exception("health check round failed")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _canonical_json(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def media_keys(body: dict) -> list[str]:
    """One key per distinct image_url / video_url part of a chat request, in order."""
    keys: dict[str, None] = {}
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in MEDIA_PART_TYPES:
                continue
            media = part.get(kind)
            url = media.get("url") if isinstance(media, dict) else media
            if isinstance(url, str):
                keys[_sha256(url)] = None
    return list(keys)


def prefix_keys(body: dict) -> list[str]:
    """Chained prefix hashes of a chat (per message) or completion (per chunk)."""
    if isinstance(body.get("messages"), list):
        seed, pieces = "chat", [_canonical_json(message) for message in body["messages"]]
    elif "prompt" in body:
        prompt = body["prompt"]
        text = prompt if isinstance(prompt, str) else _canonical_json(prompt)
        seed = "prompt"
        pieces = [text[start:start + PROMPT_CHUNK_CHARS]
                  for start in range(0, len(text), PROMPT_CHUNK_CHARS)]
    else:
        return []
    keys, previous = [], _sha256(seed)
    for piece in pieces:
        previous = _sha256(previous + piece)
        keys.append(previous)
    return keys


@dataclass(frozen=True)
class RouterConfig:
    """The router's workers (base URLs per role, each pool may start empty) and limits."""
    encode: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    request_timeout_s: float = 600.0
    stage_timeout_s: float = 300.0
    connect_timeout_s: float = 5.0
    health_interval_s: float = 2.0
    remove_after_s: float = 30.0
    max_attempts: int = 2
    cache_load_slack: int = 4
    cache_entries: int = 100_000
    security: SecurityConfig = SecurityConfig()  # API keys, per-key limits, body size

    def __post_init__(self) -> None:
        for flag in ("request_timeout_s", "stage_timeout_s", "connect_timeout_s",
                     "health_interval_s", "remove_after_s"):
            if getattr(self, flag) <= 0:
                option = "--" + flag.removesuffix("_s").replace("_", "-")
                raise ConfigError(f"{option} must be > 0 seconds, got {getattr(self, flag)}")
        for flag, least in (("max_attempts", 1), ("cache_load_slack", 0), ("cache_entries", 1)):
            if getattr(self, flag) < least:
                raise ConfigError(f"--{flag.replace('_', '-')} must be >= {least}, "
                                  f"got {getattr(self, flag)}")
