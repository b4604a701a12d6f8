"""The synthetic tasks behind the demo model: deterministic, held-out, and each
answer is what the pixels show."""
import json

import numpy as np
import pytest
from PIL import Image

from foveal.demo_model.dataset import write_split
from foveal.demo_model.tasks import COLOR_NAMES, DIRECTIONS, SHAPES, TASKS, WORDS, make_sample
from foveal.errors import ConfigError


def _pixels(sample):
    return [np.asarray(image) for image in sample.images] + list(sample.video or [])


def _ink(frame: np.ndarray) -> np.ndarray:
    """Mask of drawn pixels: far from the (light, nearly grey) background."""
    f = frame.astype(int)
    return (f.max(axis=2) - f.min(axis=2) > 60) | (f.max(axis=2) < 150)


def _centre(frame):
    ys, xs = np.nonzero(_ink(frame))
    return xs.mean(), ys.mean()


def test_samples_are_deterministic_and_the_splits_differ():
    for index in range(12):
        a, b = make_sample("eval", index), make_sample("eval", index)
        assert (a.question, a.answer, a.task) == (b.question, b.answer, b.task)
        assert all(np.array_equal(x, y) for x, y in zip(_pixels(a), _pixels(b)))
        train = make_sample("train", index, task=a.task)
        assert not all(np.array_equal(x, y) for x, y in zip(_pixels(a), _pixels(train)))


def test_eval_cycles_through_the_tasks_and_training_draws_them_all():
    assert [make_sample("eval", i).task for i in range(12)] == list(TASKS) * 2
    assert {make_sample("train", i).task for i in range(200)} == set(TASKS)


def test_answers_come_from_each_task_vocabulary():
    allowed = {"shapes": set(SHAPES) | set(COLOR_NAMES), "count": {str(n) for n in range(1, 10)},
               "position": {"left", "right", "top", "bottom"}, "compare": {"yes", "no"},
               "motion": set(DIRECTIONS)}
    for index in range(240):
        sample = make_sample("eval", index)
        if sample.task == "read":
            assert sample.answer in WORDS or (sample.answer.isdigit() and 10 <= int(sample.answer) <= 999)
        else:
            assert sample.answer in allowed[sample.task]
        assert (sample.video is not None) == (sample.task == "motion")
        assert len(sample.images) == {"compare": 2, "motion": 0}.get(sample.task, 1)


@pytest.mark.parametrize("index", range(5, 5 + 6 * 8, 6))
def test_motion_clips_move_the_way_the_answer_says(index):
    sample = make_sample("eval", index)
    assert sample.task == "motion" and len(sample.video) == 8
    (x0, y0), (x1, y1) = _centre(sample.video[0]), _centre(sample.video[-1])
    dx, dy = DIRECTIONS[sample.answer]
    assert (x1 - x0) * dx + (y1 - y0) * dy > 50  # it travels 70-100 px that way
    assert abs((x1 - x0) * dy) + abs((y1 - y0) * dx) < 3  # and not sideways


@pytest.mark.parametrize("index", range(2, 2 + 6 * 8, 6))
def test_the_one_shape_of_a_position_sample_sits_where_the_answer_says(index):
    sample = make_sample("eval", index)
    assert sample.task == "position"
    frame = np.asarray(sample.images[0])
    x, y = _centre(frame)
    h, w = frame.shape[:2]
    side = {"left": x < 0.3 * w, "right": x > 0.7 * w, "top": y < 0.3 * h, "bottom": y > 0.7 * h}
    assert side[sample.answer]
    assert 0.3 * h < y < 0.7 * h if sample.answer in ("left", "right") else 0.3 * w < x < 0.7 * w


@pytest.mark.parametrize("index", range(4, 4 + 6 * 8, 6))
def test_compare_answers_yes_exactly_when_the_asked_attribute_matches(index):
    sample = make_sample("eval", index)
    first, second = (np.asarray(image) for image in sample.images)
    colours = []
    for frame in (first, second):
        mask = _ink(frame)
        colours.append(np.median(frame[mask], axis=0))
    if "color" in sample.question:
        same = np.abs(colours[0] - colours[1]).max() < 40  # jitter is +-18 per channel
        assert same == (sample.answer == "yes")


def test_write_split_stores_lossless_files_and_records(tmp_path):
    path = write_split(tmp_path, "eval", 7)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["task"] for r in records] == list(TASKS) + [TASKS[0]]
    for index, record in enumerate(records):
        sample = make_sample("eval", index)
        assert (record["question"], record["answer"]) == (sample.question, sample.answer)
        for name, image in zip(record["images"], sample.images):
            assert np.array_equal(np.asarray(Image.open(tmp_path / name)), np.asarray(image))
        if sample.video is not None:
            assert record["video"]["fps"] == sample.video_fps
            frames = [np.asarray(Image.open(tmp_path / name)) for name in record["video"]["frames"]]
            assert all(np.array_equal(a, b) for a, b in zip(frames, sample.video))
    with pytest.raises(ConfigError):
        write_split(tmp_path, "eval", 0)


def test_crowded_shapes_shrink_instead_of_failing():
    """Eval sample 16218 draws three shapes too large to place at their first sizes:
    placement shrinks them and starts over instead of raising."""
    sample = make_sample("eval", 16218)
    (objects,) = sample.objects
    assert sample.task == "shapes" and len(objects) == 3
    width, height = sample.images[0].size
    for i, (x, y, size, _) in enumerate(objects):
        assert size / 2 <= x <= width - size / 2 and size / 2 <= y <= height - size / 2
        for x2, y2, size2, _ in objects[i + 1:]:
            assert (x - x2) ** 2 + (y - y2) ** 2 > ((size + size2) / 2) ** 2
