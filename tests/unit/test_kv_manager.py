from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from foveal.engine.kv_manager import KVCacheManager
from foveal.engine.request import Request
from foveal.multimodal.inputs import MMFeature, PlaceholderRange
from foveal.sampling_params import SamplingParams


def make_request(rid: str, prompt: list[int], features=(), cache_salt=None) -> Request:
    return Request(rid, prompt, list(features), SamplingParams(), 0.0, cache_salt)


def admit(kv: KVCacheManager, request: Request) -> int:
    """Admit with prefix lookup and compute the whole prompt; returns the hit."""
    blocks, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return num_hit


def test_allocate_returns_none_and_allocates_nothing_when_pool_is_short():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate_slots(make_request("a", list(range(8))), 8) is not None
    assert kv.allocate_slots(make_request("b", list(range(8))), 8) is None
    assert kv.num_free_blocks == 1 and kv.block_ids("b") == []


def test_prefix_hit_leaves_last_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    admit(kv, make_request("a", list(range(8))))
    blocks, num_hit = kv.get_computed_blocks(make_request("b", list(range(8))))
    assert num_hit == 4 and blocks == [kv.block_ids("a")[:1]]


def test_blocks_filled_by_generated_tokens_become_hittable():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", [1, 2, 3])
    admit(kv, request)
    request.append_output_token(9)
    kv.allocate_slots(request, 1)
    request.num_computed_tokens = 4
    kv.cache_full_blocks(request)
    kv.free(request)
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 9, 5]))[1] == 4


def test_image_at_different_offset_in_block_does_not_hit():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = [7] * 9
    first = MMFeature("image", "h", PlaceholderRange(0, 8))
    shifted = MMFeature("image", "h", PlaceholderRange(1, 8))
    admit(kv, make_request("a", tokens, [first]))
    assert kv.get_computed_blocks(make_request("b", tokens, [first]))[1] == 8
    assert kv.get_computed_blocks(make_request("c", tokens, [shifted]))[1] == 0


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(kv, make_request("a", list(range(9))))
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([[]], 0)


def test_freed_blocks_evicted_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    old, new = make_request("old", [1, 2, 3, 4, 5]), make_request("new", [6, 7, 8, 9, 10])
    admit(kv, old)
    admit(kv, new)
    kv.free(old)
    kv.free(new)
    # The two partial (unhashed) tail blocks go first, then old's cached block.
    assert kv.allocate_slots(make_request("x", [0] * 12), 12) is not None
    assert kv.get_computed_blocks(make_request("o", [1, 2, 3, 4, 5]))[1] == 0
    assert kv.get_computed_blocks(make_request("n", [6, 7, 8, 9, 10]))[1] == 4


def test_hit_takes_block_back_from_free_list():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    admit(kv, make_request("a", [1, 2, 3, 4, 5]))
    kv.free(make_request("a", []))
    reuse = make_request("b", [1, 2, 3, 4, 6])
    assert admit(kv, reuse) == 4
    assert kv.num_free_blocks == 0 and kv.ref_count(kv.block_ids("b")[0]) == 1


def test_shared_prefix_block_ref_counts():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    admit(kv, make_request("a", list(range(6))))
    admit(kv, make_request("b", list(range(6))))
    shared = kv.block_ids("a")[0]
    assert kv.block_ids("b")[0] == shared and kv.ref_count(shared) == 2
    assert kv.usage == 3 / 8


operations = st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free"]),
                                st.integers(0, 5), st.integers(1, 12)), max_size=40)


def apply_random_op(kv: KVCacheManager, live: dict[str, Request], op: str, slot: int,
                    size: int) -> None:
    """One step of a random workload: admit request r{slot} with a prefix lookup,
    grow it by `size` computed tokens, or free it; live holds the admitted ones."""
    rid = f"r{slot}"
    if op == "alloc" and rid not in live:
        request = make_request(rid, [slot % 3] * size)
        blocks, hit = kv.get_computed_blocks(request)
        if kv.allocate_slots(request, request.num_tokens - hit, blocks) is not None:
            request.num_computed_tokens = request.num_tokens
            kv.cache_full_blocks(request)
            live[rid] = request
    elif op == "grow" and rid in live:
        request = live[rid]
        if kv.allocate_slots(request, size) is not None:
            for _ in range(size):
                request.append_output_token(size)
            request.num_computed_tokens = request.num_tokens
            kv.cache_full_blocks(request)
    elif op == "free" and rid in live:
        kv.free(live.pop(rid))


@settings(max_examples=150, deadline=None)
@given(ops=operations, prefix=st.booleans())
def test_random_allocate_free_keeps_pool_invariants(ops, prefix):
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=prefix)
    live: dict[str, Request] = {}
    for op, slot, size in ops:
        apply_random_op(kv, live, op, slot, size)
        owners = Counter(b for r in live for b in kv.block_ids(r))
        assert all(len(set(kv.block_ids(r))) == len(kv.block_ids(r)) for r in live)
        assert all(kv.ref_count(b) == owners[b] for b in range(kv.num_blocks))
        assert len(owners) + kv.num_free_blocks == kv.num_blocks
        assert all(len(kv.block_ids(r)) * 4 >= live[r].num_tokens for r in live)
    for request in live.values():
        kv.free(request)
    assert kv.num_free_blocks == kv.num_blocks
