"""Bidirectional spans (Gemma 3's image runs) in the scheduler: a step never
ends inside one, a prefix hit that ends inside one resumes with the rest of
the span in one step, and a span longer than a step is refused on arrival."""
from __future__ import annotations

import pytest

from foveal.errors import InvalidRequestError
from foveal.multimodal.inputs import BIDIRECTIONAL_KEY, MMFeature, PlaceholderRange
from tests.unit.test_scheduler import (IMAGE_TOKEN, FakeExecutor, assert_all_returned, image_prompt,
                                       make_request, make_scheduler, run_to_completion)


def bidirectional_image(mm_hash: str, offset: int, runs: tuple[tuple[int, int], ...]) -> MMFeature:
    length = runs[-1][0] + runs[-1][1]
    return MMFeature("image", mm_hash, PlaceholderRange(offset, length), {BIDIRECTIONAL_KEY: runs})


def scheduled_windows(executor: FakeExecutor, rid: str) -> list[tuple[int, int]]:
    windows, start = [], 0
    for plan in executor.plans:
        num_new = plan.num_scheduled_tokens.get(rid)
        if num_new:
            new = [r for r in plan.new_requests if r.request_id == rid]
            start = new[0].num_computed_tokens if new else start
            windows.append((start, start + num_new))
            start += num_new
    return windows


def test_a_step_ends_before_a_span_it_cannot_finish():
    scheduler, executor = make_scheduler(max_tokens=10), FakeExecutor(4)
    prompt = image_prompt(before=5, length=8, after=3)
    feature = bidirectional_image("a", 5, ((0, 8),))
    scheduler.add_request(make_request("r", prompt, max_tokens=2, features=[feature]))
    run_to_completion(scheduler, executor)
    windows = scheduled_windows(executor, "r")
    assert windows[:3] == [(0, 5), (5, 15), (15, 16)]  # 10 tokens would end at 10, inside [5, 13)
    assert all(not (5 < end < 13) for _, end in windows)
    assert_all_returned(scheduler)


def test_runs_of_one_item_are_kept_whole_each():
    # pan-and-scan: runs [0, 4) and [6, 10) of an item at 2, with 2 text tokens between
    scheduler, executor = make_scheduler(max_tokens=6), FakeExecutor(4)
    prompt = [1, 2] + [IMAGE_TOKEN] * 4 + [60, 61] + [IMAGE_TOKEN] * 4 + [70]
    feature = bidirectional_image("a", 2, ((0, 4), (6, 4)))
    scheduler.add_request(make_request("r", prompt, max_tokens=1, features=[feature]))
    run_to_completion(scheduler, executor)
    assert scheduled_windows(executor, "r") == [(0, 6), (6, 12), (12, 13)]


def test_a_prefix_hit_inside_a_span_resumes_with_the_whole_rest():
    # the span's cached KV was computed with the whole span in one step, so it is
    # final; the rest of the span is computed in one step and sees all of it
    scheduler, executor = make_scheduler(max_tokens=12, block_size=4), FakeExecutor(4)
    prompt = image_prompt(before=2, length=12, after=2)  # span [2, 14), 16 tokens

    def request(rid: str):
        return make_request(rid, prompt, max_tokens=1,
                            features=[bidirectional_image("x", 2, ((0, 12),))])

    scheduler.add_request(request("a"))
    run_to_completion(scheduler, executor)
    again = request("b")
    scheduler.add_request(again)
    run_to_completion(scheduler, executor)
    assert again.num_cached_tokens == 12  # three blocks: the hit ends inside [2, 14)
    assert scheduled_windows(executor, "b")[0] == (12, 16)
    assert_all_returned(scheduler)


def test_a_span_longer_than_a_step_is_refused_on_arrival():
    scheduler = make_scheduler(max_tokens=6)
    prompt = image_prompt(before=1, length=8, after=1)
    with pytest.raises(InvalidRequestError, match="8 tokens computed in one step.*max-num-batched"):
        scheduler.add_request(make_request("r", prompt, features=[bidirectional_image("a", 1, ((0, 8),))]))
