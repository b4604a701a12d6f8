"""The downsampling planner: properties over random requests, and the policy."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foveal.errors import MediaLimitError
from foveal.multimodal.budget import Geometry, ImageItem, VideoItem, plan_media
from foveal.multimodal.processors.qwen2_vl import smart_resize

GEOMETRY = Geometry()
sides = st.integers(min_value=28, max_value=2000)
images = st.builds(ImageItem, sides, sides, st.sampled_from(["auto", "auto", "low", "high"]))
videos = st.builds(VideoItem, sides, sides, st.integers(min_value=1, max_value=200))
requests = st.lists(st.one_of(images, videos), min_size=1, max_size=5)
budgets = st.integers(min_value=1, max_value=200_000)


def minimum_tokens(items) -> int:
    """What the planner reports as the request's minimum (every item needs > 1 token)."""
    with pytest.raises(MediaLimitError) as error:
        plan_media(items, GEOMETRY, 1)
    return int(str(error.value).split("at least ")[1].split()[0])


@settings(max_examples=150, deadline=None)
@given(requests, budgets)
def test_plan_never_exceeds_the_budget_or_raises_naming_the_minimum(items, budget):
    try:
        plan = plan_media(items, GEOMETRY, budget)
    except MediaLimitError as error:
        assert f"budget is {budget}" in str(error) and minimum_tokens(items) > budget
        return
    assert plan.total_tokens <= budget


@settings(max_examples=100, deadline=None)
@given(requests, budgets)
def test_plan_respects_minimums_and_pinned_details(items, budget):
    try:
        plan = plan_media(items, GEOMETRY, budget)
    except MediaLimitError:
        return
    unbudgeted = plan_media(items, GEOMETRY)
    for item, chosen, preferred in zip(items, plan.items, unbudgeted.items):
        assert chosen.num_tokens <= preferred.num_tokens
        if isinstance(item, VideoItem):
            assert chosen.num_frames >= min(item.num_frames, 4)
            assert chosen.max_pixels >= GEOMETRY.video_min_pixels
        else:
            assert chosen.max_pixels >= GEOMETRY.image_min_pixels
            if item.detail != "auto":
                assert chosen == preferred


@settings(max_examples=100, deadline=None)
@given(requests, budgets, budgets)
def test_bigger_budget_never_gives_an_item_fewer_tokens(items, budget_a, budget_b):
    small, big = sorted((budget_a, budget_b))
    try:
        plan_small = plan_media(items, GEOMETRY, small)
    except MediaLimitError:
        return
    plan_big = plan_media(items, GEOMETRY, big)
    for a, b in zip(plan_small.items, plan_big.items):
        assert b.num_tokens >= a.num_tokens


@settings(max_examples=50, deadline=None)
@given(requests, budgets)
def test_plan_is_deterministic(items, budget):
    try:
        first = plan_media(items, GEOMETRY, budget)
    except MediaLimitError:
        return
    assert plan_media(list(items), GEOMETRY, budget) == first


@settings(max_examples=200, deadline=None)
@given(sides, sides)
def test_low_detail_is_about_a_quarter_of_high(width, height):
    if max(width, height) / min(width, height) > 200:
        return
    high = plan_media([ImageItem(width, height, "high")], GEOMETRY).items[0].num_tokens
    low = plan_media([ImageItem(width, height, "low")], GEOMETRY).items[0].num_tokens
    min_px = GEOMETRY.image_min_pixels
    min_tokens = GEOMETRY.frame_tokens(width, height, min_px, min_px)  # the floor (upscaled tiny images)
    rows, cols = (side // GEOMETRY.factor for side in smart_resize(
        height, width, GEOMETRY.factor, GEOMETRY.image_min_pixels, GEOMETRY.image_max_pixels))
    # Each side halves, then snaps to the 28-pixel grid: within one row and
    # one column of tokens of a quarter.
    assert low <= max((rows // 2 + 1) * (cols // 2 + 1), min_tokens)
    assert low >= min(high / 4, (rows / 2 - 1) * (cols / 2 - 1)) or low == min_tokens


def test_long_video_drops_frames_before_resolution():
    video = VideoItem(640, 480, num_frames=120)
    full = plan_media([video], GEOMETRY).items[0]
    cut = plan_media([video], GEOMETRY, full.num_tokens // 4).items[0]
    assert cut.max_pixels == full.max_pixels and cut.num_frames < full.num_frames
    tight = plan_media([video], GEOMETRY, full.num_tokens // 60).items[0]
    assert tight.num_frames == 4 and tight.max_pixels < full.max_pixels


def test_big_items_are_cut_before_small_ones():
    small, video = ImageItem(200, 200), VideoItem(1280, 720, num_frames=60)
    full = plan_media([small, video], GEOMETRY)
    plan = plan_media([small, video], GEOMETRY, full.total_tokens // 2)
    assert plan.items[0] == full.items[0] and plan.items[1].num_tokens < full.items[1].num_tokens


def test_request_below_the_minimum_names_budget_and_minimum():
    min_px = GEOMETRY.video_min_pixels
    needed = 2 * GEOMETRY.frame_tokens(1280, 720, min_px, min_px)  # 4 frames = 2 temporal patches
    with pytest.raises(MediaLimitError, match=rf"at least {needed} visual tokens.*budget is 100"):
        plan_media([VideoItem(1280, 720, num_frames=60)], GEOMETRY, 100)


@settings(max_examples=100, deadline=None)
@given(requests, budgets)
def test_plan_reports_each_items_resized_size_and_whether_the_budget_cut_it(items, budget):
    try:
        plan = plan_media(items, GEOMETRY, budget)
    except MediaLimitError:
        return
    factor, temporal = GEOMETRY.factor, GEOMETRY.temporal_patch_size
    for chosen, preferred in zip(plan.items, plan_media(items, GEOMETRY).items):
        assert chosen.width % factor == 0 and chosen.height % factor == 0
        patches = -(-chosen.num_frames // temporal) if chosen.modality == "video" else 1
        assert chosen.num_tokens == (chosen.width // factor) * (chosen.height // factor) * patches
        assert not preferred.downsampled
        cut = (chosen.max_pixels, chosen.num_frames) != (preferred.max_pixels, preferred.num_frames)
        assert chosen.downsampled == cut
