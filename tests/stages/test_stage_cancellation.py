"""Callers that give up (their client went away): a queued item nobody waits for
leaves the queue; one another caller shares stays."""
from __future__ import annotations

import asyncio
import time

import pytest
from stage_fakes import FAKE_TARGET, FakeItem

from foveal.stages import register_stage
from foveal.stages.service import StagePools

register_stage("fake", FAKE_TARGET)
CANCELLED = 'foveal:stage_cancelled_total{stage="fake"}'
MISSES = 'foveal:stage_cache_misses_total{stage="fake"}'


async def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def _busy_worker(stages: StagePools) -> asyncio.Task:
    """An item the one worker has taken (submitted, and no longer queued)."""
    busy = asyncio.create_task(stages.run("fake", FakeItem(b"busy", sleep_s=1.0)))
    await _until(lambda: stages.get_metrics()[MISSES] == 1
                 and stages.backend("fake").queue_depth() == 0)
    return busy


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.fixture()
def stages():
    with StagePools({"fake": 1}) as pools:
        pools.warm_up("fake")
        yield pools


def test_queued_item_whose_only_caller_gives_up_leaves_the_queue(stages):
    backend = stages.backend("fake")

    async def scenario():
        busy = await _busy_worker(stages)
        queued = asyncio.create_task(stages.run("fake", FakeItem(b"queued")))
        await _until(lambda: backend.queue_depth() == 1)
        await _cancel(queued)
        assert backend.queue_depth() == 0
        return await busy

    assert asyncio.run(scenario()).text == "busy"
    metrics = stages.get_metrics()
    assert metrics[CANCELLED] == 1 and metrics['foveal:stage_items_total{stage="fake"}'] == 1
    assert metrics['foveal:stage_failures_total{stage="fake"}'] == 0


def test_queued_item_shared_with_a_caller_still_waiting_goes_on(stages):
    backend = stages.backend("fake")

    async def scenario():
        busy = await _busy_worker(stages)
        leaving, staying = (asyncio.create_task(stages.run("fake", FakeItem(b"shared")))
                            for _ in range(2))
        await _until(lambda: backend.queue_depth() == 1  # the second caller shares it:
                     and stages.get_metrics()['foveal:stage_cache_hits_total{stage="fake"}'] == 1)
        await _cancel(leaving)
        assert backend.queue_depth() == 1
        return await asyncio.gather(busy, staying)

    assert [result.text for result in asyncio.run(scenario())] == ["busy", "shared"]
    assert stages.get_metrics()[CANCELLED] == 0
