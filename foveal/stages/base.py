"""The stage contract: typed items in, typed results out, one worker process each.

A stage class is built twice: in the engine process (cheap; validates its
options and computes cache keys) and in each worker process, where `load()`
brings up the model once and `process_batch()` serves items.

Items are dataclasses whose `content` field holds the input bytes; every
other field is a parameter that changes the result. The cache key is the
sha256 of `content` plus those parameters plus the stage's options, so the
same bytes processed two ways are two entries.
"""
from __future__ import annotations

import dataclasses
import hashlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from foveal.errors import ConfigError, FovealError, StageError
from foveal.multimodal.hashing import mm_hash


@dataclasses.dataclass(frozen=True)
class NoOptions:
    pass


class Stage(ABC):
    """One preprocessing step. Subclasses set the class attributes and `process`."""

    name: ClassVar[str]
    item_type: ClassVar[type]
    result_type: ClassVar[type]
    options_type: ClassVar[type] = NoOptions
    # items one worker call takes; above 1 only where the model amortizes work
    max_batch_size: ClassVar[int] = 1

    def __init__(self, **options: Any) -> None:
        known = {f.name for f in dataclasses.fields(self.options_type)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown {self.name} stage option(s) {unknown}; accepted: {sorted(known)}")
        self.options = self.options_type(**options)

    def load(self) -> None:
        """Load models; runs once in each worker process before its first item."""

    @abstractmethod
    def process(self, item: Any) -> Any:
        """One item -> its result; raise a FovealError (MediaError, ...) for a bad item."""

    def process_batch(self, items: list[Any]) -> list[Any]:
        """Results or errors, one per item; one bad item does not fail its batch."""
        return [self._process_one(item) for item in items]

    def _process_one(self, item: Any) -> Any:
        try:
            return self.process(item)
        except FovealError as error:
            return error
        except Exception as exc:  # a library bug on one input must not kill the worker
            return StageError(f"{self.name} stage failed on this item ({type(exc).__name__}: {exc})")

    def cache_key(self, item: Any) -> str:
        if not isinstance(item, self.item_type):
            raise TypeError(f"{self.name} stage takes {self.item_type.__name__}, got {type(item).__name__}")
        params = {f.name: getattr(item, f.name) for f in dataclasses.fields(item) if f.name != "content"}
        params["stage"] = self.name
        params["options"] = dataclasses.asdict(self.options)
        return mm_hash(hashlib.sha256(item.content).hexdigest(), params)
