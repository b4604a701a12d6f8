"""KV cache groups: sliding-window layers take their own blocks, give back the
ones their window has left, and hit the prefix cache on the last window only."""
from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from foveal.engine.kv_groups import KVCacheGroups
from foveal.engine.kv_manager import KVCacheManager, tier_key
from foveal.engine.kv_offload import OffloadTier
from foveal.engine.request import Request
from foveal.sampling_params import SamplingParams
from tests.unit.test_kv_manager import apply_random_op, operations

BLOCK = 4
WINDOW = 8  # a query sees itself and the 7 tokens before it
# Layers 0 and 2 slide, 1 and 3 attend to everything: two groups of two layers.
GROUPS = KVCacheGroups.for_layers([WINDOW, None, WINDOW, None])


def make_request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, [], SamplingParams(), 0.0, None)


def run_prompt(kv: KVCacheManager, request: Request, step: int) -> None:
    """Compute the prompt in steps of `step` tokens, as the scheduler would."""
    blocks, hit = kv.get_computed_blocks(request)
    first = min(step, request.num_tokens - hit)
    assert kv.allocate_slots(request, first, blocks) is not None
    request.num_computed_tokens = hit + first
    kv.cache_full_blocks(request)
    while request.num_computed_tokens < request.num_tokens:
        size = min(step, request.num_tokens - request.num_computed_tokens)
        assert kv.allocate_slots(request, size) is not None
        request.num_computed_tokens += size
        kv.cache_full_blocks(request)


def test_gemma3_layers_fill_groups_the_size_of_the_full_layers():
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(34)]  # gemma-3-4b
    groups = KVCacheGroups.for_layers(windows)
    assert groups.windows == (None,) + (1024,) * 6
    assert groups.layers[0] == (5, 11, 17, 23, 29) and groups.num_slots == 5
    assert groups.layers[1] == (0, 1, 2, 3, 4) and groups.layers[-1] == (30, 31, 32, 33)
    assert sorted(i for group in groups.layers for i in group) == list(range(34))
    assert groups.group_of(17) == 0 and groups.slot_of(17) == 2 and groups.slot_of(33) == 3
    # one 8,192-token request computed in 2,048-token steps: full + 6 windows
    assert groups.pages_needed(8192, 2048, 16) == 512 + 6 * ((1023 + 2048) // 16 + 2)


def test_models_without_sliding_or_full_layers_keep_one_group():
    assert not KVCacheGroups.for_layers([None] * 4).is_hybrid
    assert not KVCacheGroups.for_layers([16] * 4).is_hybrid  # no full layer anchors a table
    assert KVCacheGroups.single(3).layers == ((0, 1, 2),)


def test_sliding_group_gives_back_blocks_behind_its_window():
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, groups=GROUPS)
    request = make_request("a", list(range(40)))
    run_prompt(kv, request, step=8)
    full, sliding = kv.group_block_ids("a")
    assert len(full) == len(sliding) == 10 and kv.null_block not in full
    # The last step started at token 32: its first query reads keys from 25 on
    # (block 6); every block before it went back to the pool.
    assert sliding[:6] == [kv.null_block] * 6
    assert kv.null_block not in sliding[6:]
    assert kv.num_free_blocks == 31 - 10 - 4
    kv.free(request)
    assert kv.num_free_blocks == 31


def test_null_block_is_never_handed_out():
    kv = KVCacheManager(num_blocks=9, block_size=BLOCK, groups=GROUPS)
    request = make_request("a", list(range(16)))
    assert kv.allocate_slots(request, 16) is not None  # 4 blocks in each group
    assert kv.null_block not in sum(kv.group_block_ids("a"), [])
    assert kv.allocate_slots(make_request("b", [1]), 1) is None  # 1 left, 2 groups


def test_prefix_hit_needs_only_the_last_window_in_sliding_groups():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK, groups=GROUPS)
    run_prompt(kv, make_request("a", list(range(40))), step=8)
    kv.free(make_request("a", []))
    again = make_request("b", list(range(40)) + [99])
    blocks, hit = kv.get_computed_blocks(again)
    assert hit == 40
    # resumed at token 40: the window reads keys 33..39 (blocks 8, 9)
    assert blocks[1][:8] == [kv.null_block] * 8 and kv.null_block not in blocks[1][8:]
    assert len(blocks[0]) == 10 and kv.null_block not in blocks[0]
    run_prompt(kv, again, step=8)
    assert kv.num_free_blocks == 63 - 11 - 3  # full table + the sliding blocks still read


def test_prefix_hit_shrinks_to_a_point_whose_window_is_still_cached():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK, groups=GROUPS)
    tokens = list(range(40))
    request = make_request("a", tokens)
    run_prompt(kv, request, step=8)
    kv.free(request)
    # Forget the sliding group's blocks 8 and 9 (the last window): a hit of 40
    # tokens cannot resume, one of 32 can (its window is blocks 6 and 7).
    for index in (8, 9):
        block = kv._cached.pop((1, request.block_hashes[index]))
        kv._block_keys[block] = None
    blocks, hit = kv.get_computed_blocks(make_request("b", tokens + [99]))
    assert hit == 32 and len(blocks[0]) == len(blocks[1]) == 8
    assert blocks[1][:6] == [kv.null_block] * 6 and kv.null_block not in blocks[1][6:]


def test_trim_drops_the_same_trailing_blocks_in_every_group():
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, groups=GROUPS)
    request = make_request("a", list(range(12)))
    run_prompt(kv, request, step=12)
    assert kv.allocate_slots(request, 6) is not None  # drafts: 18 slots, 5 blocks
    assert kv.trim(request, 13) == 1
    assert [len(table) for table in kv.group_block_ids("a")] == [4, 4]
    assert kv.num_free_blocks == 31 - 4 - 3  # sliding block 0 left the window


def test_offload_tier_keeps_each_groups_blocks_and_loads_only_the_window_back():
    tier = OffloadTier(capacity_blocks=16, block_bytes=100)
    kv = KVCacheManager(num_blocks=11, block_size=BLOCK, offload=tier, groups=GROUPS)
    tokens = list(range(20))
    first = make_request("a", tokens)
    run_prompt(kv, first, step=20)  # 5 blocks in each group
    kv.free(first)
    run_prompt(kv, make_request("b", list(range(50, 70))), step=20)  # takes every page
    kv.free(make_request("b", []))
    saves = {bytes.fromhex(h) for h, _ in tier.take_transfers().saves}
    assert saves >= {tier_key(g, h) for g in (0, 1) for h in first.block_hashes}
    again = make_request("a2", tokens + [99])
    blocks, hit = kv.get_computed_blocks(again)
    # resumed at token 20: the window reads blocks 3 and 4; the full group needs all 5
    assert hit == 20 and blocks == [[None] * 5, [kv.null_block] * 3 + [None] * 2]
    assert kv.allocate_slots(again, 1, blocks) is not None
    loads = tier.take_transfers().loads
    assert sorted(bytes.fromhex(h) for h, _ in loads) == sorted(
        [tier_key(0, h) for h in first.block_hashes] +
        [tier_key(1, h) for h in first.block_hashes[3:]])
    tables = kv.group_block_ids("a2")
    assert {b for _, b in loads} == set(tables[0][:5] + tables[1][3:5])


@settings(max_examples=150, deadline=None)
@given(ops=operations, prefix=st.booleans())
def test_random_steps_keep_pool_invariants_across_groups(ops, prefix):
    kv = KVCacheManager(num_blocks=24, block_size=BLOCK, enable_prefix_caching=prefix,
                        groups=GROUPS)
    live: dict[str, Request] = {}
    for op, slot, size in ops:
        apply_random_op(kv, live, op, slot, size)
        tables = {r: kv.group_block_ids(r) for r in live}
        owners = Counter(b for groups in tables.values() for table in groups for b in table
                         if b != kv.null_block)
        assert all(kv.ref_count(b) == owners[b] for b in range(kv.num_blocks) if b != kv.null_block)
        assert len(owners) + kv.num_free_blocks == kv.num_usable_blocks
        for rid, (full, sliding) in tables.items():
            assert len(full) == len(sliding) and kv.null_block not in full
            assert not set(full) & set(sliding)  # a block holds one group's layers
            # every block the window of the next token reads is held
            first = max(0, live[rid].num_computed_tokens - WINDOW + 1) // BLOCK
            assert kv.null_block not in sliding[first:]
    for request in live.values():
        kv.free(request)
    assert kv.num_free_blocks == kv.num_usable_blocks
