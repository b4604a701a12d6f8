"""Stage options: how many local workers per stage, which remote endpoints,
queue, timeout and cache sizes, and per-stage options (e.g. the ASR model).

Flag spellings parsed here:
  --stage-workers ocr=2,asr=1
  --stage-endpoint ocr=http://h1:8101,http://h2:8101   (repeatable; or ';' between stages)
A stage with endpoints runs remotely; every other stage runs in local pools
(1 worker unless --stage-workers says otherwise).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from foveal.errors import ConfigError

_STAGE_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


@dataclass(frozen=True)
class StagesConfig:
    workers: Mapping[str, int] = field(default_factory=dict)
    endpoints: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    stage_options: Mapping[str, Mapping] = field(default_factory=dict)
    queue_size: int = 64
    timeout_s: float = 300.0
    cache_max_bytes: int = 256 * 2**20
    health_interval_s: float = 2.0

    def __post_init__(self) -> None:
        for stage, count in self.workers.items():
            if not isinstance(count, int) or count < 1:
                raise ConfigError(f"--stage-workers {stage}={count}: the worker count must be an integer >= 1")
        if self.queue_size < 1:
            raise ConfigError(f"--stage-queue-size {self.queue_size}: must be >= 1")
        if self.timeout_s <= 0:
            raise ConfigError(f"--stage-timeout {self.timeout_s}: must be > 0 seconds")
        if self.cache_max_bytes < 0:
            raise ConfigError(f"stage cache size {self.cache_max_bytes}: must be >= 0 bytes")

    def num_workers(self, stage: str) -> int:
        return self.workers.get(stage, 1)

    def options_for(self, stage: str) -> dict:
        return dict(self.stage_options.get(stage, {}))


def parse_stage_workers(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """ "ocr=2,asr=1" -> {"ocr": 2, "asr": 1}."""
    if spec is None or isinstance(spec, Mapping):
        return dict(spec or {})
    workers: dict[str, int] = {}
    for token in filter(None, (t.strip() for t in spec.split(","))):
        match = _STAGE_ASSIGNMENT.match(token)
        if not match or not match.group(2).isdigit():
            raise ConfigError(f"--stage-workers {spec!r}: expected NAME=COUNT[,NAME=COUNT...], e.g. ocr=2,asr=1")
        workers[match.group(1)] = int(match.group(2))
    return workers


def parse_stage_endpoints(specs: str | Iterable[str] | Mapping | None) -> dict[str, tuple[str, ...]]:
    """ "ocr=http://h1:P,http://h2:P" (or several such strings) -> {"ocr": (url1, url2)}."""
    if specs is None or isinstance(specs, Mapping):
        return {name: tuple(urls) for name, urls in (specs or {}).items()}
    if isinstance(specs, str):
        specs = [specs]
    endpoints: dict[str, list[str]] = {}
    for spec in specs:
        current: str | None = None
        for token in filter(None, (t.strip() for t in re.split(r"[,;]", spec))):
            match = _STAGE_ASSIGNMENT.match(token)
            if match:
                current, token = match.group(1), match.group(2)
            if current is None or not token.startswith(("http://", "https://")):
                raise ConfigError(
                    f"--stage-endpoint {spec!r}: expected NAME=URL[,URL...], e.g. "
                    "ocr=http://10.0.0.5:8101,http://10.0.0.6:8101")
            endpoints.setdefault(current, []).append(token.rstrip("/"))
    return {name: tuple(urls) for name, urls in endpoints.items()}
