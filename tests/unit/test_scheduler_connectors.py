"""A scheduler built from injected parts: its own KV manager (with a KV
connector) and encoder budget, and an encoder connector that supplies
embeddings instead of the vision encoder."""
from __future__ import annotations

from foveal.config import SchedulerConfig
from foveal.engine.encoder_budget import EncoderBudget
from foveal.engine.encoder_connector import EmbeddingStoreConnector
from foveal.engine.kv_manager import KVCacheManager
from foveal.engine.kv_offload import OffloadTier
from foveal.engine.scheduler import Scheduler
from tests.unit.test_scheduler import (FakeExecutor, image, image_prompt, make_request,
                                       run_to_completion)


def make(stored: set[str]) -> tuple[Scheduler, EmbeddingStoreConnector]:
    connector = EmbeddingStoreConnector(stored)
    tier = OffloadTier(capacity_blocks=8, block_bytes=100)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, encoder_compute_budget=16),
                          KVCacheManager(32, 4, offload=tier), EncoderBudget(64), connector)
    return scheduler, connector


def test_injected_parts_are_the_ones_the_scheduler_uses():
    kv, budget = KVCacheManager(8, 4), EncoderBudget(10)
    scheduler = Scheduler(SchedulerConfig(), kv, budget)
    assert scheduler.kv is kv and scheduler.encoder is budget and scheduler.offload is None


def test_an_item_the_connector_holds_is_loaded_not_encoded():
    scheduler, connector = make(stored={"remote"})
    scheduler.add_request(make_request("a", image_prompt(2, 16, 2), features=[image("remote", 2, 16)]))
    scheduler.add_request(make_request("b", image_prompt(2, 16, 2, 300),
                                       features=[image("local", 2, 16)]))
    plan = scheduler.schedule()
    # The connector's item costs no encoder compute budget (16 tokens), so both fit.
    assert plan.scheduled_encoder_inputs == {"b": [0]}
    assert plan.encoder_transfer.loads == ["remote"]
    assert plan.encoder_transfer.saves == ["local"]  # encoded here, offered to the store
    assert plan.num_scheduled_tokens == {"a": 20, "b": 20}
    assert connector.num_loads == 1 and connector.num_saves == 1


def test_requests_finish_with_connector_loads_and_nothing_leaks():
    scheduler, _ = make(stored={"remote"})
    executor = FakeExecutor(4)
    executor.encoder_cache.add("remote")  # what the worker half loads from the store
    scheduler.add_request(make_request("a", image_prompt(2, 16, 2), features=[image("remote", 2, 16)]))
    results = run_to_completion(scheduler, executor)
    assert results["a"][1] == "length" and executor.encode_counts == {}
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
