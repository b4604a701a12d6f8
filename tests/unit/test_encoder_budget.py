from __future__ import annotations

import pytest

from foveal.engine.encoder_budget import EncoderBudget
from foveal.errors import InvalidRequestError
from foveal.multimodal.inputs import MMFeature, PlaceholderRange


def item(mm_hash: str, size: int) -> MMFeature:
    return MMFeature("image", mm_hash, PlaceholderRange(0, size))


def test_unreferenced_entry_stays_cached_until_space_is_needed():
    budget = EncoderBudget(capacity=10)
    budget.allocate("r1", item("a", 6))
    budget.release("r1", "a")
    assert budget.has("a") and budget.take_freed() == []
    assert budget.can_allocate(item("b", 6), compute_budget_left=100)
    budget.allocate("r2", item("b", 6))
    assert not budget.has("a")
    assert budget.take_freed() == ["a"]
    assert budget.take_freed() == []


def test_eviction_is_least_recently_released_first():
    budget = EncoderBudget(capacity=9)
    for name in ("a", "b", "c"):
        budget.allocate("r", item(name, 3))
    budget.release("r", "b")
    budget.release("r", "a")
    budget.release("r", "c")
    budget.allocate("r2", item("d", 3))
    assert budget.take_freed() == ["b"]
    budget.allocate("r2", item("e", 6))
    assert sorted(budget.take_freed()) == ["a", "c"]


def test_referenced_entry_is_never_evicted():
    budget = EncoderBudget(capacity=10)
    budget.allocate("r1", item("a", 6))
    assert not budget.can_allocate(item("b", 6), compute_budget_left=100)


def test_can_allocate_respects_compute_budget():
    budget = EncoderBudget(capacity=100)
    assert not budget.can_allocate(item("a", 6), compute_budget_left=5)


def test_entry_freed_only_when_last_reference_released():
    budget = EncoderBudget(capacity=6)
    budget.allocate("r1", item("a", 6))
    budget.allocate("r2", item("a", 6))
    budget.release_all("r1")
    assert budget.num_refs("a") == 1 and not budget.can_allocate(item("b", 1), 10)
    budget.release_all("r2")
    assert budget.num_refs("a") == 0 and budget.can_allocate(item("b", 6), 10)


def test_hit_on_cached_entry_takes_it_off_the_eviction_list():
    budget = EncoderBudget(capacity=6)
    budget.allocate("r1", item("a", 6))
    budget.release("r1", "a")
    budget.allocate("r2", item("a", 6))
    assert not budget.can_allocate(item("b", 6), 10)


def test_item_larger_than_cache_is_rejected_with_the_flag():
    budget = EncoderBudget(capacity=8)
    with pytest.raises(InvalidRequestError, match="encoder_cache_size"):
        budget.check_fits(item("a", 9), encoder_compute_budget=100)
    with pytest.raises(InvalidRequestError, match="encoder_compute_budget"):
        budget.check_fits(item("a", 8), encoder_compute_budget=4)
