"""The demo model's reading targets: pages of text for stage 1, the per-token
character targets (the characters whose centres fall in each visual token's
cell, left to right) and the run targets (the whole word or number a token holds
text of) that both pages and `read` samples give the probe."""
import json

import numpy as np
import pytest
import torch

from foveal.demo_model.encode import (
    CHAR_SLOTS, IGNORE_INDEX, RUN_SLOTS, TEXT_CHARS, SampleEncoder, batch_char_targets,
    batch_run_targets, char_targets, run_targets,
)
from foveal.demo_model.probe import VisualTokenProbe
from foveal.demo_model.render import text_size
from foveal.demo_model.tasks import make_page, make_sample
from foveal.demo_model.train import write_model_folder


@pytest.fixture(scope="module")
def scaffold(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo-scaffold")
    return folder, write_model_folder(folder)


def _spelled(targets: torch.Tensor) -> str:
    """The characters of a one-line text, read token by token, slot by slot."""
    return "".join(TEXT_CHARS[c - 1] for c in targets.reshape(-1).tolist() if c > 0)


def test_a_page_is_deterministic_and_draws_every_run_it_lists():
    page, again = make_page(7), make_page(7)
    assert page.texts == again.texts and page.images[0].tobytes() == again.images[0].tobytes()
    assert page.task == "page" and page.texts[0] != make_page(8).texts[0]
    runs = page.texts[0]
    assert len(runs) >= 10
    pixels = np.asarray(page.images[0].convert("L"))
    for text, x, y, size in runs:
        assert set(text) <= set(TEXT_CHARS)
        width, height = text_size(text, size)
        box = pixels[int(y):int(y) + height + 6, int(x):int(x) + width + 2]
        assert box.min() < 100, f"no ink where {text!r} was drawn"  # the background is light


def test_character_targets_spell_each_read_answer_in_order():
    exact = 0
    for index in range(120):
        sample = make_sample("eval", index, task="read")
        image = sample.images[0]
        grid = (1, image.height // 14, image.width // 14)  # the task's sizes are multiples of 28
        targets = char_targets(sample.texts[0], image.width, image.height, grid)
        assert targets.shape == (grid[1] * grid[2] // 4, CHAR_SLOTS)
        spelled = _spelled(targets)
        assert len(spelled) <= len(sample.answer) and set(spelled) <= set(sample.answer)
        exact += spelled == sample.answer
    assert exact == 120


def test_character_targets_are_ignored_on_a_shrunk_image_and_repeat_per_frame():
    sample = make_sample("eval", 3, task="read")
    image = sample.images[0]
    full = char_targets(sample.texts[0], image.width, image.height, (1, image.height // 14,
                                                                   image.width // 14))
    half = (1, image.height // 28, image.width // 28)  # half the side: the glyphs blur away
    shrunk = char_targets(sample.texts[0], image.width, image.height, half)
    assert bool((shrunk == IGNORE_INDEX).all()) and bool((full >= 0).all())
    two = char_targets(sample.texts[0], image.width, image.height, (2, image.height // 14,
                                                                   image.width // 14))
    assert torch.equal(two, full.repeat(2, 1))


def test_batch_character_targets_cover_every_image_token_in_tower_order(scaffold):
    folder, hf_config = scaffold
    encoder = SampleEncoder(folder, hf_config)
    # a read sample, a two-image compare sample (no text), a clip (no images), a page
    items = [encoder.encode(s) for s in (make_sample("eval", 3), make_sample("eval", 4),
                                         make_sample("eval", 5), make_page(0))]
    chars = batch_char_targets(items)
    merge = hf_config["vision_config"]["spatial_merge_size"] ** 2
    image_tokens = sum(t * h * w // merge for item in items for t, h, w in item.image_grid_thw)
    assert chars.shape == (image_tokens, CHAR_SLOTS)
    read_tokens = len(items[0].image_char_targets[0])
    assert _spelled(chars[:read_tokens]) == make_sample("eval", 3).answer
    assert bool((chars[read_tokens:read_tokens + sum(len(t) for t in items[1].image_char_targets)]
                 == 0).all())
    assert _spelled(chars[-len(items[3].image_char_targets[0]):]) != ""


def test_run_targets_name_the_whole_text_on_every_token_holding_its_glyphs():
    for index in range(60):
        sample = make_sample("eval", index, task="read")
        image = sample.images[0]
        grid = (1, image.height // 14, image.width // 14)
        chars = char_targets(sample.texts[0], image.width, image.height, grid)
        runs = run_targets(sample.texts[0], image.width, image.height, grid)
        assert runs.shape == (len(chars), RUN_SLOTS)
        holds = (chars > 0).any(1)
        assert bool(((runs > 0).any(1) == holds).all()) and int(holds.sum()) >= 1
        for row in runs[holds]:
            assert _spelled(row) == sample.answer and bool((row[len(sample.answer):] == 0).all())
    half = (1, image.height // 28, image.width // 28)
    assert bool((run_targets(sample.texts[0], image.width, image.height, half) == IGNORE_INDEX).all())


def test_a_cell_shared_by_two_runs_names_the_one_with_more_glyphs_there():
    # "AB" ends in cell 1 with one glyph, "CDE" starts there with two (20 px font glyphs are
    # ~12 px wide; cells are 28 px): the cell names "CDE"
    runs = [("AB", 12.0, 4.0, 20), ("CDE", 40.0, 4.0, 20)]
    chars = char_targets(runs, 112, 28, (1, 2, 8))
    per_cell = [_spelled(chars[i]) for i in range(4)]
    assert "".join(per_cell) == "ABCDE" and any(len(set(c) & set("AB")) and len(set(c) & set("CDE"))
                                                for c in per_cell), per_cell
    named = [_spelled(row) for row in run_targets(runs, 112, 28, (1, 2, 8))]
    for cell, name in zip(per_cell, named):
        if cell:
            mine = [r for r in ("AB", "CDE") if set(cell) & set(r)]
            best = max(mine, key=lambda r: (len([c for c in cell if c in r]), r == "AB"))
            assert name == best, (per_cell, named)
        else:
            assert name == ""


def test_batch_run_targets_follow_the_character_targets_order(scaffold):
    folder, hf_config = scaffold
    encoder = SampleEncoder(folder, hf_config)
    items = [encoder.encode(s) for s in (make_sample("eval", 3), make_sample("eval", 4), make_page(0))]
    chars, runs = batch_char_targets(items), batch_run_targets(items)
    assert runs.shape == (len(chars), RUN_SLOTS)
    assert bool(((runs > 0).any(1) == (chars > 0).any(1)).all())


def test_run_loss_weights_tokens_without_text_less():
    probe = VisualTokenProbe(16, [0.5] * 3, [0.5] * 3, runs=True)
    features = torch.randn(4, 16)
    runs = torch.zeros(3, RUN_SLOTS, dtype=torch.long)
    runs[0, :2] = torch.tensor([4, 7])  # a two-character run: its end slots weigh fully
    logits = probe.run_logits(features[:3]).reshape(-1, probe.CHAR_CLASSES)
    per_slot = torch.nn.functional.cross_entropy(logits, runs.reshape(-1), reduction="none")
    weight = torch.tensor([1.0] * RUN_SLOTS + [probe.EMPTY_CHAR_WEIGHT] * 2 * RUN_SLOTS)
    assert torch.allclose(probe.run_loss(features, runs), (per_slot * weight).sum() / weight.sum())
    assert VisualTokenProbe(16, [0.5] * 3, [0.5] * 3).run_head is None  # older states still load
    from foveal.demo_model.train import TrainConfig
    from foveal.errors import ConfigError

    with pytest.raises(ConfigError, match="run_weight"):
        TrainConfig(run_weight=-1.0)


def test_char_loss_weights_empty_slots_less_and_skips_ignored_ones():
    probe = VisualTokenProbe(16, [0.5] * 3, [0.5] * 3)
    features = torch.randn(5, 16)
    chars = torch.zeros(3, CHAR_SLOTS, dtype=torch.long)
    chars[0, 1] = 4
    logits = probe.char_logits(features[:3]).reshape(-1, probe.CHAR_CLASSES)
    flat = chars.reshape(-1)
    per_slot = torch.nn.functional.cross_entropy(logits, flat, reduction="none")
    weight = torch.where(flat > 0, 1.0, probe.EMPTY_CHAR_WEIGHT)
    expected = (per_slot * weight).sum() / weight.sum()
    assert torch.allclose(probe.char_loss(features, chars), expected)
    ignored = chars.clone()
    ignored[2] = IGNORE_INDEX
    keep = weight.view(3, CHAR_SLOTS)[:2].reshape(-1)
    expected = (per_slot.view(3, CHAR_SLOTS)[:2].reshape(-1) * keep).sum() / keep.sum()
    assert torch.allclose(probe.char_loss(features, ignored), expected)


def test_the_character_loss_counts_only_with_a_weight():
    torch.manual_seed(0)
    probe = VisualTokenProbe(16, [0.5] * 3, [0.5] * 3)
    features = [torch.randn(4, 16)]
    pixels = [torch.rand(16, 3 * 2 * 14 * 14)]  # 4 tokens of 2x2 patches
    shapes, grids = [torch.zeros(4, dtype=torch.long)], [torch.tensor([[1, 4, 4]])]
    classes = torch.full((4, len(probe.SCENE_COLUMNS)), IGNORE_INDEX)
    classes[:, 0] = 2
    scenes = (classes, torch.full((4, 2), float("nan")))
    chars = torch.zeros(4, CHAR_SLOTS, dtype=torch.long)
    chars[1, 0] = 5
    base = probe.loss(features, pixels, shapes, grids, scenes)
    assert torch.allclose(probe.loss(features, pixels, shapes, grids, scenes, chars), base)
    weighted = probe.loss(features, pixels, shapes, grids, scenes, chars, char_weight=2.0)
    assert torch.allclose(weighted, base + 2.0 * probe.char_loss(features[0], chars))
    with_runs = VisualTokenProbe(16, [0.5] * 3, [0.5] * 3, runs=True)
    with_runs.load_state_dict(probe.state_dict(), strict=False)
    runs = torch.zeros(4, RUN_SLOTS, dtype=torch.long)
    runs[1, 0] = 5
    assert torch.allclose(with_runs.loss(features, pixels, shapes, grids, scenes, runs=runs), base)
    both = with_runs.loss(features, pixels, shapes, grids, scenes, chars, 2.0, runs=runs, run_weight=3.0)
    assert torch.allclose(both, weighted + 3.0 * with_runs.run_loss(features[0], runs))


def test_stage_0_comes_first_with_its_own_schedule():
    from foveal.demo_model.train import TrainConfig, lr_at

    cfg = TrainConfig(read_steps=20, vision_steps=50, steps=100, warmup=10, vision_lr=2e-3, lr=1e-3,
                      min_lr_ratio=0.1)
    assert cfg.spans() == {0: (0, 20), 1: (20, 70), 2: (70, 170)} and cfg.total_steps == 170
    assert [cfg.stage_of(s) for s in (0, 19, 20, 69, 70, 169)] == [0, 0, 1, 1, 2, 2]
    assert lr_at(0, cfg) == pytest.approx(2e-4) and lr_at(9, cfg) == pytest.approx(2e-3)
    assert lr_at(19, cfg) == pytest.approx(2e-4, rel=0.25) and lr_at(19, cfg) < lr_at(10, cfg)
    assert lr_at(20, cfg) == pytest.approx(2e-4) and lr_at(70, cfg) == pytest.approx(1e-4)
    assert TrainConfig(vision_steps=50, steps=100).spans() == {1: (0, 50), 2: (50, 150)}
    own = TrainConfig(read_steps=20, vision_steps=50, steps=100, warmup=10, vision_lr=2e-3, read_lr=4e-3)
    assert lr_at(9, own) == pytest.approx(4e-3) and lr_at(29, own) == pytest.approx(2e-3)


def test_a_stage_0_step_reads_pages_and_moves_only_the_tower(tmp_path):
    from foveal.demo_model.train import TrainConfig, train

    cfg = TrainConfig(read_steps=1, vision_steps=0, steps=0, batch_size=2, warmup=1,
                      checkpoint_every=1, eval_every=1, eval_samples=6, bf16=False, run_weight=1.0)
    train(tmp_path, cfg)
    state = torch.load(tmp_path / "train_state.pt", weights_only=False)
    assert state["step"] == 1 and {"chars", "run"} <= set(state["history"][0]["probe"])
    assert any(k.startswith("run_head.") for k in state["probe"])
    from foveal.demo_model.train import build_hf_model

    initial = build_hf_model(json.loads((tmp_path / "scaffold" / "config.json").read_text()), seed=0)
    changed = {k for k, v in initial.state_dict().items() if not torch.equal(v, state["model"][k])}
    assert changed and all(".visual." in f".{k}" for k in changed)


def test_stage_0_pages_are_never_shrunk_so_every_one_has_targets(scaffold):
    from foveal.demo_model.train import TrainConfig, make_batch

    folder, hf_config = scaffold
    encoder = SampleEncoder(folder, hf_config)
    cfg = TrainConfig(read_steps=2, vision_steps=1, steps=1)
    for step in (0, 1):  # 32 pages; shrunk as the samples are, about 1 in 5 would be ignored
        chars = make_batch(encoder, cfg, step)["chars"]
        assert bool((chars != IGNORE_INDEX).all())
