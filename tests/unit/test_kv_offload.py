"""KV offload tier: the scheduler half plans saves/loads/drops, the worker half copies."""
from __future__ import annotations

import torch

from foveal.config import CacheConfig
from foveal.engine.kv_manager import KVCacheManager
from foveal.engine.kv_offload import OffloadTier
from foveal.engine.plan import KVTransferPlan
from foveal.engine.request import Request
from foveal.sampling_params import SamplingParams
from foveal.layers.attention.kv_spec import KVCacheSpec, KVCaches
from foveal.worker.kv_offload import KVOffloadWorker, BLOCK_STORES


def make_request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, [], SamplingParams(), 0.0)


def admit(kv: KVCacheManager, request: Request) -> int:
    blocks, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return num_hit


def run_and_free(kv: KVCacheManager, rid: str, prompt: list[int]) -> int:
    request = make_request(rid, prompt)
    num_hit = admit(kv, request)
    kv.free(request)
    return num_hit


def test_evicted_block_is_saved_and_a_repeat_loads_it_into_a_fresh_block():
    tier = OffloadTier(capacity_blocks=8, block_bytes=100)
    kv = KVCacheManager(num_blocks=3, block_size=4, offload=tier)
    run_and_free(kv, "a", list(range(9)))
    run_and_free(kv, "b", list(range(50, 59)))  # reuses a's hashed blocks
    saves = tier.take_transfers().saves
    assert len(saves) == 2 and tier.num_bytes_stored == 200
    request = make_request("a2", list(range(9)))
    assert admit(kv, request) == 8
    transfers = tier.take_transfers()
    # The chain is evicted from its tail, and loaded back from its head.
    assert [h for h, _ in transfers.loads] == [h for h, _ in reversed(saves)]
    assert [b for _, b in transfers.loads] == kv.block_ids("a2")[:2]
    assert tier.num_hits == 2


def test_without_a_tier_an_evicted_prefix_misses():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    run_and_free(kv, "a", list(range(9)))
    run_and_free(kv, "b", list(range(50, 59)))
    assert run_and_free(kv, "a2", list(range(9))) == 0


def test_full_tier_drops_its_least_recently_used_hash():
    tier = OffloadTier(capacity_blocks=1, block_bytes=100)
    tier.on_evict(b"old", 0)
    tier.take_transfers()
    tier.on_evict(b"new", 1)
    transfers = tier.take_transfers()
    assert transfers.saves == [(b"new".hex(), 1)] and transfers.drops == [b"old".hex()]
    assert not tier.contains(b"old") and tier.contains(b"new")


def test_hash_saved_and_dropped_in_one_step_is_never_copied():
    tier = OffloadTier(capacity_blocks=1, block_bytes=100)
    tier.on_evict(b"first", 0)
    tier.on_evict(b"second", 1)
    transfers = tier.take_transfers()
    assert transfers.saves == [(b"second".hex(), 1)] and transfers.drops == []


def test_pinned_hash_survives_saves_in_the_same_step():
    tier = OffloadTier(capacity_blocks=1, block_bytes=100)
    tier.on_evict(b"wanted", 0)
    tier.take_transfers()
    tier.pin([b"wanted"])
    tier.on_evict(b"other", 1)
    tier.load(b"wanted", 1)
    transfers = tier.take_transfers()
    assert tier.contains(b"wanted") and transfers.loads == [(b"wanted".hex(), 1)]


def test_block_reused_before_its_load_ran_cancels_the_load():
    tier = OffloadTier(capacity_blocks=4, block_bytes=100)
    tier.on_evict(b"h", 0)
    tier.take_transfers()
    tier.load(b"h", 2)
    tier.on_evict(b"h", 2)
    transfers = tier.take_transfers()
    assert not transfers and tier.num_hits == 0 and tier.contains(b"h")


def kv_pool(num_layers=2, num_blocks=4, quantization=None) -> KVCaches:
    generator = torch.Generator().manual_seed(0)
    spec = KVCacheSpec(num_layers, 4, 2, 8, torch.float32, quantization)
    pool = spec.allocate(num_blocks, "cpu")
    for tensor in pool.layers + (pool.scales or []):
        tensor.copy_(torch.randn(tensor.shape, generator=generator) * 50)
    return pool


def kv_caches(num_layers=2, num_blocks=4) -> KVCaches:
    return kv_pool(num_layers, num_blocks)


def check_round_trip(store_name: str, tmp_path, quantization=None) -> None:
    pool = kv_pool(quantization=quantization)
    tensors = pool.layers + (pool.scales or [])
    config = CacheConfig(kv_offload=store_name, kv_offload_path=str(tmp_path))
    worker = KVOffloadWorker(BLOCK_STORES[store_name](config), pool)
    original = [t[:, 1].clone() for t in tensors]
    worker.apply(KVTransferPlan(saves=[("aa", 1)]))
    for t in tensors:
        t[:, 1].zero_()
    worker.apply(KVTransferPlan(loads=[("aa", 3)]))
    for t, expected in zip(tensors, original):
        assert torch.equal(t[:, 3], expected)
    worker.apply(KVTransferPlan(drops=["aa"]))


def test_cpu_store_round_trips_a_block(tmp_path):
    check_round_trip("cpu", tmp_path)


def test_disk_store_round_trips_a_block_and_drop_deletes_its_file(tmp_path):
    check_round_trip("disk", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_offload_moves_a_quantized_block_with_its_scales(tmp_path):
    for quantization in ("int8", "int4"):
        check_round_trip("cpu", tmp_path, quantization)
        check_round_trip("disk", tmp_path, quantization)


def test_save_then_load_into_the_same_block_in_one_step_reads_the_old_kv(tmp_path):
    pool = kv_caches()
    caches = pool.layers
    worker = KVOffloadWorker(BLOCK_STORES["cpu"](CacheConfig()), pool)
    worker.apply(KVTransferPlan(saves=[("x", 0)]))
    block0 = [kv[:, 0].clone() for kv in caches]
    block2 = [kv[:, 2].clone() for kv in caches]
    worker.apply(KVTransferPlan(saves=[("y", 2)], loads=[("x", 2)]))
    worker.apply(KVTransferPlan(loads=[("y", 0)]))
    for kv, old0, old2 in zip(caches, block0, block2):
        assert torch.equal(kv[:, 2], old0) and torch.equal(kv[:, 0], old2)
