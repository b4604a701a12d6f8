"""A stage with no model, for testing pools and remote stages: it sleeps,
reports the worker pid and its start/end times, and can crash or fail on demand."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from foveal.errors import MediaError
from foveal.stages.base import Stage

FAKE_TARGET = "stage_fakes:FakeStage"


@dataclass(frozen=True)
class FakeItem:
    content: bytes
    sleep_s: float = 0.0
    crash: bool = False  # the worker exits hard on this item
    invalid: bool = False  # the item is bad media


@dataclass(frozen=True)
class FakeResult:
    text: str
    pid: int
    started: float
    finished: float
    batch_size: int


@dataclass(frozen=True)
class FakeOptions:
    suffix: str = ""


class FakeStage(Stage):
    name = "fake"
    item_type = FakeItem
    result_type = FakeResult
    options_type = FakeOptions

    def process_batch(self, items):
        self.batch_size = len(items)
        return super().process_batch(items)

    def process(self, item: FakeItem) -> FakeResult:
        if item.crash:
            os._exit(3)
        if item.invalid:
            raise MediaError(f"fake media {item.content!r} is invalid")
        started = time.time()
        time.sleep(item.sleep_s)
        return FakeResult(item.content.decode() + self.options.suffix, os.getpid(), started,
                          time.time(), self.batch_size)


class FakeBatchStage(FakeStage):
    max_batch_size = 4
