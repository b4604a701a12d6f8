"""Local stage pools: parallel workers, backpressure, worker death, timeouts, cache, metrics."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from stage_fakes import FAKE_TARGET, FakeItem

from foveal.errors import ConfigError, MediaError, StageError, StageOverloadedError, StageTimeoutError
from foveal.stages import register_stage
from foveal.stages.cache import ResultCache
from foveal.stages.config import StagesConfig, parse_stage_endpoints, parse_stage_workers
from foveal.stages.service import StagePools

register_stage("fake", FAKE_TARGET)
register_stage("fake_batch", "stage_fakes:FakeBatchStage")


def _wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_pool_runs_items_in_parallel_across_workers():
    with StagePools({"fake": 2}) as stages:
        stages.warm_up("fake")
        futures = [stages.submit("fake", FakeItem(f"item{i}".encode(), sleep_s=1.0)) for i in range(2)]
        first, second = (future.result(timeout=30) for future in futures)
        assert first.pid != second.pid
        assert sorted([first.pid, second.pid]) == sorted(stages.backend("fake").worker_pids())
        assert first.started < second.finished and second.started < first.finished


def test_full_queue_rejects_with_stage_overloaded_error():
    with StagePools(StagesConfig(workers={"fake": 1}, queue_size=2)) as stages:
        stages.warm_up("fake")
        busy = stages.submit("fake", FakeItem(b"busy", sleep_s=2.0))
        _wait_until(lambda: stages.backend("fake").queue_depth() == 0)
        queued = [stages.submit("fake", FakeItem(f"q{i}".encode())) for i in range(2)]
        with pytest.raises(StageOverloadedError, match=r"queue is full .*--stage-workers fake=N"):
            stages.submit("fake", FakeItem(b"one too many"))
        assert busy.result(timeout=30).text == "busy"
        assert [future.result(timeout=30).text for future in queued] == ["q0", "q1"]
        assert stages.get_metrics()['foveal:stage_rejected_total{stage="fake"}'] == 1


def test_killed_worker_is_replaced_and_its_item_retried():
    with StagePools({"fake": 1}) as stages:
        stages.warm_up("fake")
        [old_pid] = stages.backend("fake").worker_pids()
        future = stages.submit("fake", FakeItem(b"survivor", sleep_s=1.0))
        _wait_until(lambda: stages.backend("fake").queue_depth() == 0)
        time.sleep(0.2)
        os.kill(old_pid, signal.SIGKILL)
        result = future.result(timeout=60)
        assert result.text == "survivor" and result.pid != old_pid
        assert stages.get_metrics()['foveal:stage_worker_restarts_total{stage="fake"}'] == 1


def test_item_that_kills_its_worker_twice_fails_clearly_and_pool_keeps_serving():
    with StagePools({"fake": 1}) as stages:
        with pytest.raises(StageError, match="died twice while processing this item"):
            stages.run_sync("fake", FakeItem(b"poison", crash=True))
        assert stages.run_sync("fake", FakeItem(b"next")).text == "next"


def test_item_past_its_timeout_fails_and_worker_is_replaced():
    with StagePools(StagesConfig(workers={"fake": 1}, timeout_s=0.5)) as stages:
        with pytest.raises(StageTimeoutError, match=r"longer than 0.5 s on 1 item\(s\); the worker was killed"):
            stages.run_sync("fake", FakeItem(b"slow", sleep_s=30.0))
        assert stages.run_sync("fake", FakeItem(b"quick")).text == "quick"


def test_bad_item_error_crosses_the_process_boundary_typed():
    with StagePools({"fake": 1}) as stages:
        with pytest.raises(MediaError, match="fake media b'broken' is invalid"):
            asyncio.run(stages.run("fake", FakeItem(b"broken", invalid=True)))


def test_repeated_item_is_a_cache_hit():
    with StagePools({"fake": 1}) as stages:
        first = asyncio.run(stages.run("fake", FakeItem(b"same")))
        again = stages.run_sync("fake", FakeItem(b"same"))
        other = stages.run_sync("fake", FakeItem(b"same", sleep_s=0.01))  # a parameter changes the key
        assert again == first and other.started != first.started
        metrics = stages.get_metrics()
        assert metrics['foveal:stage_cache_hits_total{stage="fake"}'] == 1
        assert metrics['foveal:stage_cache_misses_total{stage="fake"}'] == 2


def test_stage_options_change_the_cache_key():
    from stage_fakes import FakeStage

    item = FakeItem(b"x")
    assert FakeStage().cache_key(item) != FakeStage(suffix="!").cache_key(item)
    assert FakeStage().cache_key(item) == FakeStage().cache_key(FakeItem(b"x"))


def test_queued_items_are_batched_when_the_stage_allows():
    with StagePools({"fake_batch": 1}) as stages:
        stages.warm_up("fake_batch")
        busy = stages.submit("fake_batch", FakeItem(b"busy", sleep_s=1.0))
        _wait_until(lambda: stages.backend("fake_batch").queue_depth() == 0)
        queued = [stages.submit("fake_batch", FakeItem(f"b{i}".encode())) for i in range(4)]
        assert busy.result(timeout=30).batch_size == 1
        assert [future.result(timeout=30).batch_size for future in queued] == [4, 4, 4, 4]


def test_metrics_report_queue_latency_throughput_and_cache():
    with StagePools({"fake": 1}) as stages:
        for i in range(3):
            stages.run_sync("fake", FakeItem(f"m{i}".encode()))
        metrics = stages.get_metrics()
    label = 'stage="fake"'
    assert metrics[f"foveal:stage_items_total{{{label}}}"] == 3
    assert metrics[f"foveal:stage_latency_seconds_count{{{label}}}"] == 3
    assert metrics[f'foveal:stage_latency_seconds_bucket{{{label},le="+Inf"}}'] == 3
    assert metrics[f"foveal:stage_queue_depth{{{label}}}"] == 0
    assert metrics[f"foveal:stage_items_per_second{{{label}}}"] > 0
    assert metrics["foveal:stage_cache_entries"] == 3


def test_unknown_stage_option_is_a_config_error():
    with StagePools(StagesConfig(stage_options={"fake": {"colour": "red"}})) as stages:
        with pytest.raises(ConfigError, match=r"unknown fake stage option\(s\) \['colour'\]"):
            stages.submit("fake", FakeItem(b"x"))


def test_parse_stage_workers_and_endpoints():
    assert parse_stage_workers("ocr=2,asr=1") == {"ocr": 2, "asr": 1}
    assert parse_stage_endpoints("ocr=http://h1:8101,http://h2:8101/;asr=http://h3:9") == {
        "ocr": ("http://h1:8101", "http://h2:8101"), "asr": ("http://h3:9",)}
    assert parse_stage_endpoints(["ocr=http://a:1", "pdf=http://b:2"]) == {
        "ocr": ("http://a:1",), "pdf": ("http://b:2",)}
    with pytest.raises(ConfigError, match="NAME=COUNT"):
        parse_stage_workers("ocr:2")
    with pytest.raises(ConfigError, match="NAME=URL"):
        parse_stage_endpoints("http://h1:8101")
    with pytest.raises(ConfigError, match="integer >= 1"):
        StagesConfig(workers={"ocr": 0})


def test_result_cache_evicts_least_recently_used_within_its_byte_cap():
    cache = ResultCache(max_bytes=300)
    cache.put("a", b"x" * 100)
    cache.put("b", b"y" * 100)
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", b"z" * 100)
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    cache.put("huge", b"h" * 1000)
    assert cache.get("huge") is None and cache.nbytes <= 300


def test_engine_stage_flags_build_the_stages_config():
    import argparse

    from foveal.stages.cli import add_engine_stage_args, stages_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_stage_args(parser)
    config = stages_config_from_args(parser.parse_args([
        "--stage-workers", "ocr=2,asr=1", "--stage-endpoint", "pdf=http://a:1,http://b:2",
        "--asr-model", "/models/whisper", "--max-pdf-pages", "5"]))
    assert config.num_workers("ocr") == 2 and config.num_workers("pdf") == 1
    assert config.endpoints == {"pdf": ("http://a:1", "http://b:2")}
    assert config.options_for("asr") == {"model": "/models/whisper"}
    assert config.options_for("pdf") == {"max_pages": 5}
