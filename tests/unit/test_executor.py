"""The executor registry and the executor base: one worker per rank, the same
plan and payloads broadcast to every rank, rank 0's output used."""
from __future__ import annotations

import pickle

import pytest
import torch

from foveal.config import (CacheConfig, EngineConfig, MultimodalConfig, ParallelConfig,
                           SchedulerConfig)
from foveal.engine.request import Request
from foveal.errors import ConfigError
from foveal.executor import build_engine_core, executor_names, register_executor
from foveal.executor.base import Executor
from foveal.layers.attention.kv_spec import KVCacheSpec
from foveal.multimodal.inputs import MMFeature, PlaceholderRange
from foveal.sampling_params import SamplingParams
from tests.unit.test_kv_cache import _model_config
from tests.unit.test_scheduler import FakeExecutor, image_prompt

BLOCK = 4
POOL_BLOCKS = [64, 48]  # what each rank's memory holds


class FakeWorker:
    """A rank: records what it is called with; decodes like the scheduler tests' fake."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.steps = FakeExecutor(BLOCK)
        self.calls: list[str] = []
        self.received: list[bytes] = []  # pickled (plan, payloads), as a pipe would carry them
        self.num_blocks = None

    def load_model(self) -> None:
        self.calls.append("load_model")

    def determine_num_blocks(self) -> int:
        return POOL_BLOCKS[self.rank]

    def initialize_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(num_layers=2, block_size=BLOCK, num_kv_heads=1, head_dim=8,
                           dtype=torch.float32)

    def execute(self, plan, mm_payloads):
        self.received.append(pickle.dumps((plan, mm_payloads)))
        return self.steps.execute(plan, mm_payloads)

    def shutdown(self) -> None:
        self.calls.append("shutdown")


class FakeMultiprocExecutor(Executor):
    """Every call crosses a (simulated) process boundary: arguments are pickled."""

    def _init_workers(self, encoder_connector_worker) -> None:
        self.workers = [FakeWorker(rank)
                        for rank in range(self.config.parallel.tensor_parallel_size)]

    def collective_rpc(self, method: str, *args):
        return [getattr(worker, method)(*pickle.loads(pickle.dumps(args)))
                for worker in self.workers]


register_executor("fake_mp", f"{__name__}:FakeMultiprocExecutor")


def engine_config(tp_size: int = 2) -> EngineConfig:
    return EngineConfig(model=_model_config(), cache=CacheConfig(block_size=BLOCK),
                        scheduler=SchedulerConfig(max_num_batched_tokens=8),
                        multimodal=MultimodalConfig(),
                        parallel=ParallelConfig(tensor_parallel_size=tp_size,
                                                distributed_executor_backend="fake_mp"))


def test_every_rank_gets_the_same_plans_and_payloads_and_the_smallest_pool_wins():
    core = build_engine_core(engine_config())
    workers = core.executor.workers
    assert core.scheduler.kv.num_blocks == min(POOL_BLOCKS)
    assert [w.num_blocks for w in workers] == [min(POOL_BLOCKS)] * 2
    pixels = torch.arange(12.0).view(3, 4)
    feature = MMFeature("image", "img", PlaceholderRange(2, 8), {"pixel_values": pixels,
                                                                "grid_thw": (1, 2, 4)})
    core.add_request(Request("a", image_prompt(2, 8, 3), [feature],
                             SamplingParams(max_tokens=3), 0.0))
    core.add_request(Request("b", [1, 2, 3, 4], [], SamplingParams(max_tokens=5), 0.0))
    finished = set()
    while core.has_unfinished_requests():
        finished |= {o.request_id for o in core.step() if o.finished}
    assert finished == {"a", "b"}
    plans = [pickle.loads(blob) for blob in workers[0].received]
    other_rank = [pickle.loads(blob) for blob in workers[1].received]
    assert len(plans) > 3 and [plan for plan, _ in plans] == [plan for plan, _ in other_rank]
    for (_, payloads), (_, other) in zip(plans, other_rank):
        assert payloads.keys() == other.keys()
        assert all(torch.equal(payloads[h]["pixel_values"], other[h]["pixel_values"])
                   for h in payloads)
    shipped = [payloads for _, payloads in plans if payloads]
    new_features = [f for plan, _ in plans for new in plan.new_requests for f in new.mm_features]
    assert [f.data for f in new_features] == [{"grid_thw": (1, 2, 4)}]  # no pixels in plans
    assert len(shipped) == 1 and torch.equal(shipped[0]["img"]["pixel_values"], pixels)
    core.executor.shutdown()
    assert all(w.calls == ["load_model", "shutdown"] for w in workers)


def test_registry_names_and_unknown_executor():
    assert {"uni", "fake_mp"} <= set(executor_names())
    config = engine_config()
    bad = EngineConfig(config.model, config.cache, config.scheduler, config.multimodal,
                       ParallelConfig(distributed_executor_backend="nope"))
    with pytest.raises(ConfigError, match="'nope' is unknown"):
        build_engine_core(bad)
