"""`foveal train-demo`: sample encoding matches the engine's prompt, training
resumes where it stopped, and the exported folder loads in transformers and
in Foveal."""
import json

import pytest
import torch

from foveal.errors import ConfigError
from foveal.demo_model.encode import (
    IGNORE_INDEX, TEXT_CHARS, SampleEncoder, batch_centre_targets, batch_scene_targets,
    batch_shape_targets, centre_targets, collate, scene_targets, shape_targets,
)
from foveal.demo_model.render import COLOR_NAMES, SHAPES
from foveal.demo_model.probe import VisualTokenProbe
from foveal.demo_model.tasks import make_sample
from foveal.demo_model.train import (
    TrainConfig, answer_loss, build_hf_model, lr_at, train,
    write_model_folder,
)


@pytest.fixture(scope="module")
def scaffold(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo-scaffold")
    return folder, write_model_folder(folder)


def test_encoding_labels_only_the_answer_and_expands_every_placeholder(scaffold):
    folder, hf_config = scaffold
    encoder = SampleEncoder(folder, hf_config)
    for index in range(6):  # one sample of each task
        sample = make_sample("eval", index)
        item = encoder.encode(sample)
        answer = [t for t in item.labels if t != IGNORE_INDEX]
        assert encoder.tokenizer.decode(answer) == sample.answer
        assert answer[-1] == encoder.end_id and item.input_ids[-len(answer):] == answer
        merge = hf_config["vision_config"]["spatial_merge_size"] ** 2
        images = sum(t * h * w // merge for t, h, w in item.image_grid_thw)
        videos = sum(t * h * w // merge for t, h, w in item.video_grid_thw)
        assert item.input_ids.count(hf_config["image_token_id"]) == images
        assert item.input_ids.count(hf_config["video_token_id"]) == videos
        assert (videos > 0) == (sample.task == "motion")


def test_follow_up_questions_become_later_chat_turns_with_every_answer_labelled(scaffold):
    import random

    from foveal.demo_model.encode import Augment
    from foveal.multimodal.chat import parse_chat_conversation

    folder, hf_config = scaffold
    encoder = SampleEncoder(folder, hf_config)
    sample = make_sample("train", 3, task="shapes")
    item = encoder.encode(sample, random.Random(2), Augment(0, 0, max_follow_ups=3))
    answers = encoder.tokenizer.decode([t for t in item.labels if t != IGNORE_INDEX],
                                       skip_special_tokens=False).split("<|im_end|>")[:-1]
    questions = [line for line in encoder.tokenizer.decode(item.input_ids).split("\n")
                 if line.endswith("?")]
    assert len(answers) == len(questions) >= 2
    assert (questions[0], answers[0]) == (sample.question, sample.answer)
    assert all(pair in sample.follow_ups for pair in zip(questions[1:], answers[1:]))
    # the whole sequence is the chat template's rendering of that conversation
    messages = parse_chat_conversation(sample.messages()).messages
    for index, answer in enumerate(answers):
        if index:
            messages.append({"role": "user", "content": questions[index]})
        messages.append({"role": "assistant", "content": answer})
    text = encoder.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    collapsed = [t for i, t in enumerate(item.input_ids)
                 if t != 12 or item.input_ids[i - 1] != 12]
    assert collapsed == encoder.tokenizer.encode(text)[:-1]  # without the final newline


def test_encoding_matches_the_engine_prompt(scaffold):
    """The tokens training sees are the tokens LLM.chat builds for the same sample."""
    from foveal import LLM, SamplingParams

    folder, hf_config = scaffold
    build_hf_model(hf_config, seed=0).save_pretrained(folder)
    encoder = SampleEncoder(folder, hf_config)
    llm = LLM(model=str(folder), max_model_len=1024, enable_prefix_caching=False)
    for index in (0, 4, 5):  # one image, two images, a clip
        sample = make_sample("eval", index)
        out = llm.chat(sample.messages(), SamplingParams(max_tokens=1), use_tqdm=False)[0]
        item = encoder.encode(sample)
        prompt = [t for t, label in zip(item.input_ids, item.labels) if label == IGNORE_INDEX]
        assert out.prompt_token_ids == prompt


def test_collate_pads_right_and_marks_media_tokens(scaffold):
    folder, hf_config = scaffold
    encoder = SampleEncoder(folder, hf_config)
    items = [encoder.encode(make_sample("eval", i)) for i in (0, 5)]
    batch = collate(items, pad_id=0)
    lengths = [len(i.input_ids) for i in items]
    assert batch["input_ids"].shape == (2, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert int((batch["mm_token_type_ids"] == 1).sum()) == items[0].input_ids.count(12)
    assert int((batch["mm_token_type_ids"] == 2).sum()) == items[1].input_ids.count(13)
    assert batch["pixel_values"].shape[0] == sum(t * h * w for t, h, w in items[0].image_grid_thw)


def test_shape_targets_mark_the_cells_under_each_drawn_shape():
    # a 112x56 image at full resolution: 8x4 patches, 4x2 visual tokens of 28 px
    targets = shape_targets([[(14, 14, 20, "star"), (98, 42, 20, "circle")]], 112, 56, (1, 4, 8))
    grid = targets.view(2, 4)
    assert grid[0, 0] == SHAPES.index("star") + 1 and grid[1, 3] == SHAPES.index("circle") + 1
    assert int((grid > 0).sum()) == 2
    # half resolution: the same objects land in the scaled cells; a clip reads frame 2t
    half = shape_targets([[(84, 42, 40, "square")], [], [(14, 14, 20, "star")]], 224, 112,
                         (2, 4, 8))
    assert half.view(2, 2, 4)[0, 0, 1] == SHAPES.index("square") + 1
    assert half.view(2, 2, 4)[1, 0, 0] == SHAPES.index("star") + 1


def test_probe_colour_targets_read_each_cell(scaffold):
    folder, hf_config = scaffold
    encoder = SampleEncoder(folder, hf_config)
    sample = make_sample("eval", 0)  # shapes: 1-3 coloured shapes
    item = encoder.encode(sample)
    probe = VisualTokenProbe(hf_config["text_config"]["hidden_size"], encoder.images.image_mean,
                             encoder.images.image_std)
    colours = probe.targets(item.pixel_values[0])
    shapes = item.image_shape_targets[0]
    assert colours.shape == shapes.shape
    assert bool(((colours > 0) == (shapes > 0)).float().mean() > 0.9)  # shapes are the coloured cells
    assert set(colours.tolist()) - {0} <= set(range(1, len(COLOR_NAMES) + 1))


def test_batch_shape_targets_follow_the_vision_towers_order(scaffold):
    folder, hf_config = scaffold
    encoder = SampleEncoder(folder, hf_config)
    items = [encoder.encode(make_sample("eval", i)) for i in (5, 0, 4)]  # clip, image, two images
    images, videos = batch_shape_targets(items)
    assert torch.equal(images, torch.cat(items[1].image_shape_targets + items[2].image_shape_targets))
    assert torch.equal(videos, items[0].video_shape_targets[0])


def test_scene_targets_spell_out_each_known_fact_and_ignore_the_rest():
    classes, where = scene_targets({"count": 2, "colors": {"square": "blue", "star": "red"},
                                    "text": "CAT"}, tokens=3)
    assert classes.shape == (3, 1 + len(SHAPES) + 4 + 1) and torch.equal(classes[0], classes[2])
    row = classes[0].tolist()
    assert row[0] == 2
    assert row[1:1 + len(SHAPES)] == [COLOR_NAMES.index({"square": "blue", "star": "red"}[s]) + 1
                                      if s in ("square", "star") else 0 for s in SHAPES]
    assert row[1 + len(SHAPES):-1] == [TEXT_CHARS.index(c) + 1 for c in "CAT"] + [0]
    assert row[-1] == IGNORE_INDEX  # not a clip
    assert bool(where.isnan().all())  # two shapes: no single place
    classes, where = scene_targets({"count": 1, "direction": "down", "where": (0.25, 0.5)}, 2)
    assert classes[0, -1] == 3 and classes[0, 1] == IGNORE_INDEX  # colours unknown
    assert where.tolist() == [[0.25, 0.5]] * 2


@pytest.mark.parametrize("index", range(12))
def test_each_samples_scene_agrees_with_its_answer_and_drawn_objects(index):
    sample = make_sample("eval", index)
    assert len(sample.scenes) == max(1, len(sample.images))
    for scene, objects in zip(sample.scenes, sample.objects):
        assert scene["count"] == len(objects)
        if "colors" in scene:
            assert set(scene["colors"]) == {shape for *_, shape in objects}
    scene = sample.scenes[0]
    if sample.task == "read":
        assert scene["text"] == sample.answer
    elif sample.task == "motion":
        assert scene["direction"] == sample.answer
    elif sample.task == "shapes":
        assert sample.answer in set(scene["colors"]) | set(scene["colors"].values())
    elif sample.task == "position":
        x, y = scene["where"]
        assert {"left": x < 0.3, "right": x > 0.7, "top": y < 0.3, "bottom": y > 0.7}[sample.answer]


def test_scene_loss_covers_every_visual_token_in_the_towers_order(scaffold):
    folder, hf_config = scaffold
    encoder = SampleEncoder(folder, hf_config)
    items = [encoder.encode(make_sample("eval", i)) for i in (5, 3, 4)]  # clip, read, two images
    classes, where = batch_scene_targets(items)
    shapes = batch_shape_targets(items)
    assert classes.shape[0] == where.shape[0] == sum(len(t) for t in shapes)
    reads = classes[:len(items[1].image_shape_targets[0]), 1 + len(SHAPES)]
    assert bool((reads > 0).all())  # the read image's tokens all carry its first character
    assert bool((classes[-len(shapes[-1]):, -1] >= 0).all())  # the clip's tokens carry its direction
    probe = VisualTokenProbe(hf_config["text_config"]["hidden_size"], encoder.images.image_mean,
                             encoder.images.image_std)
    features = torch.randn(classes.shape[0], hf_config["text_config"]["hidden_size"])
    loss = probe.scene_loss(features, classes, where)
    assert torch.isfinite(loss) and loss > 0


def test_shape_weight_adds_the_shape_loss_on_covered_cells_alone(scaffold):
    folder, hf_config = scaffold
    encoder = SampleEncoder(folder, hf_config)
    items = [encoder.encode(make_sample("eval", i)) for i in (0, 1)]  # shapes, count
    batch = collate(items, pad_id=0)
    shapes = batch_shape_targets(items)
    covered = torch.cat(shapes) > 0
    assert 0 < int(covered.sum()) < len(covered)
    hidden = hf_config["text_config"]["hidden_size"]
    probe = VisualTokenProbe(hidden, encoder.images.image_mean, encoder.images.image_std)
    features = [torch.randn(len(covered), hidden)]
    args = ([batch["pixel_values"]], shapes, [batch["image_grid_thw"]], batch_scene_targets(items))
    plain, weighted = probe.loss(features, *args), probe.loss(features, *args, shape_weight=3.0)
    expected = torch.nn.functional.cross_entropy(probe.shape_head(features[0])[covered],
                                                 torch.cat(shapes)[covered])
    assert (weighted - plain).item() == pytest.approx(3 * expected.item(), rel=1e-5)
    with pytest.raises(ConfigError, match="shape_weight"):
        TrainConfig(shape_weight=-1.0)


def test_centre_targets_sum_to_the_shapes_drawn_and_sit_in_the_centre_cells(scaffold):
    folder, hf_config = scaffold
    encoder = SampleEncoder(folder, hf_config)
    for index in range(1, 120, 6):  # the count task of the eval split: 1-9 shapes
        sample = make_sample("eval", index)
        item = encoder.encode(sample)
        (centres,) = item.image_centre_targets
        assert sample.task == "count" and int(centres.sum()) == int(sample.answer)
        assert len(centres) == len(item.image_shape_targets[0])
        # every marked cell is covered by a shape (the one whose centre it holds)
        assert bool((item.image_shape_targets[0][centres > 0] > 0).all())
    # a 3 x 2 grid of cells (84 x 56 processed pixels from a 168 x 112 image)
    cells = centre_targets([[(10, 10, 8, "circle"), (20, 15, 8, "star"), (150, 100, 20, "square")]],
                           168, 112, (1, 4, 6))
    assert cells.tolist() == [2, 0, 0, 0, 0, 1]
    clip = encoder.encode(make_sample("eval", 5))  # motion: one shape per frame
    assert [int(v.sum()) for v in clip.video_centre_targets] == [clip.video_grid_thw[0][0]]


def test_centre_weight_adds_the_balanced_centre_loss(scaffold):
    folder, hf_config = scaffold
    encoder = SampleEncoder(folder, hf_config)
    items = [encoder.encode(make_sample("eval", i)) for i in (0, 1)]
    batch = collate(items, pad_id=0)
    centres = batch_centre_targets(items)
    marked = torch.cat(centres) > 0
    hidden = hf_config["text_config"]["hidden_size"]
    probe = VisualTokenProbe(hidden, encoder.images.image_mean, encoder.images.image_std, centres=True)
    features = [torch.randn(len(marked), hidden)]
    args = ([batch["pixel_values"]], batch_shape_targets(items), [batch["image_grid_thw"]],
            batch_scene_targets(items))
    plain = probe.loss(features, *args)
    weighted = probe.loss(features, *args, centres=centres, centre_weight=2.0)
    per_token = torch.nn.functional.cross_entropy(probe.centre_head(features[0]), torch.cat(centres),
                                                  reduction="none")
    expected = (per_token[marked].mean() + per_token[~marked].mean()) / 2
    assert (weighted - plain).item() == pytest.approx(2 * expected.item(), rel=1e-5)
    # without the flag the probe has no centre head, so older training states still load
    older = VisualTokenProbe(hidden, encoder.images.image_mean, encoder.images.image_std)
    assert older.centre_head is None and not any("centre" in k for k in older.state_dict())
    assert probe.loss(features, *args, centres=centres, centre_weight=0.0) == plain
    with pytest.raises(ConfigError, match="centre_weight"):
        TrainConfig(centre_weight=-0.5)


def test_colour_weight_adds_a_colour_loss_on_the_cells_that_show_a_colour(scaffold):
    folder, hf_config = scaffold
    encoder = SampleEncoder(folder, hf_config)
    items = [encoder.encode(make_sample("eval", i)) for i in (0, 3)]  # shapes, read: colour and ink
    batch = collate(items, pad_id=0)
    hidden = hf_config["text_config"]["hidden_size"]
    probe = VisualTokenProbe(hidden, encoder.images.image_mean, encoder.images.image_std)
    colours = probe.targets(batch["pixel_values"])
    shown = colours > 0
    assert 0 < int(shown.sum()) < len(colours) and bool((colours == probe.NUM_CLASSES - 1).any())
    features = [torch.randn(len(colours), hidden)]
    args = ([batch["pixel_values"]], batch_shape_targets(items), [batch["image_grid_thw"]],
            batch_scene_targets(items))
    plain, weighted = probe.loss(features, *args), probe.loss(features, *args, colour_weight=3.0)
    expected = torch.nn.functional.cross_entropy(probe.head(features[0])[shown], colours[shown])
    assert (weighted - plain).item() == pytest.approx(3 * expected.item(), rel=1e-5)
    with pytest.raises(ConfigError, match="colour_weight"):
        TrainConfig(colour_weight=-1.0)


def test_answer_loss_weighs_each_sample_equally():
    logits = torch.zeros(2, 4, 8)
    labels = torch.full((2, 4), IGNORE_INDEX)
    labels[0, 1:] = torch.tensor([1, 2, 3])  # three answer tokens
    labels[1, 3] = 4  # one
    logits[1, 2, 4] = 10.0  # the one-token answer is right
    per_sample = [torch.log(torch.tensor(8.0)), torch.nn.functional.cross_entropy(
        logits[1, 2:3], torch.tensor([4]))]
    assert answer_loss(logits, labels).item() == pytest.approx(float(sum(per_sample)) / 2, rel=1e-5)


def test_learning_rate_warms_up_then_decays_to_the_floor_in_each_stage():
    cfg = TrainConfig(vision_steps=50, steps=100, warmup=10, vision_lr=2e-3, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(2e-4) and lr_at(9, cfg) == pytest.approx(2e-3)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 49))
    assert lr_at(49, cfg) == pytest.approx(2e-4, rel=0.1)
    assert lr_at(50, cfg) == pytest.approx(1e-4) and lr_at(59, cfg) == pytest.approx(1e-3)
    assert lr_at(150, cfg) == pytest.approx(1e-4)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(60, 150))
    joint = TrainConfig(vision_steps=50, steps=100, joint_steps=40, warmup=10, lr=1e-3,
                        joint_lr=1e-4, min_lr_ratio=0.1)
    assert joint.stage_of(149) == 2 and joint.stage_of(150) == 3 and joint.total_steps == 190
    assert lr_at(150, joint) == pytest.approx(1e-5) and lr_at(159, joint) == pytest.approx(1e-4)
    assert lr_at(189, joint) == pytest.approx(1e-5, rel=0.1)


def test_task_weights_set_the_training_mix(scaffold, monkeypatch):
    import foveal.demo_model.train as train_module
    from foveal.demo_model.tasks import TASKS, TRAIN_WEIGHTS

    drawn = []

    def recording(split, index, task=None):
        drawn.append(task)
        return make_sample(split, index, task=task)

    monkeypatch.setattr(train_module, "make_sample", recording)
    encoder = SampleEncoder(*scaffold)
    only_shapes = {task: 0.0 for task in TASKS} | {"shapes": 1.0}
    cfg = TrainConfig(vision_steps=0, steps=4, batch_size=6, task_weights=only_shapes)
    for step in range(2):
        train_module.make_batch(encoder, cfg, step)
    assert drawn == ["shapes"] * 12
    # tasks not named keep the default weights
    assert TrainConfig(task_weights={"shapes": 3.0}).mix() == \
        [3.0 if task == "shapes" else TRAIN_WEIGHTS[task] for task in TASKS]
    for bad, message in (({"shape": 1.0}, "unknown tasks"), ({"count": -1.0}, ">= 0"),
                         ({task: 0.0 for task in TASKS}, "every task out")):
        with pytest.raises(ConfigError, match=message):
            TrainConfig(task_weights=bad)


def test_train_demo_task_weights_flag_parses_and_rejects_bad_values(capsys, tmp_path):
    from foveal.entrypoints.cli import build_parser, main

    parser = build_parser()
    args = parser.parse_args(["train-demo", "out", "--task-weights", "shapes=3,count=0"])
    assert args.task_weights == {"shapes": 3.0, "count": 0.0}
    with pytest.raises(SystemExit):
        parser.parse_args(["train-demo", "out", "--task-weights", "shapes"])
    assert "TASK=WEIGHT" in capsys.readouterr().err
    # refused before any work starts
    assert main(["train-demo", str(tmp_path / "out"), "--task-weights", "shape=1"]) == 2
    assert "unknown tasks" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_training_resumes_and_exports_a_checkpoint_both_engines_load(tmp_path):
    from transformers import Qwen2VLForConditionalGeneration

    from foveal import LLM, SamplingParams

    cfg = TrainConfig(vision_steps=2, steps=1, batch_size=2, warmup=1, checkpoint_every=1,
                      eval_every=2, eval_samples=6, bf16=False)
    folder = train(tmp_path, cfg)
    state = torch.load(tmp_path / "train_state.pt", weights_only=False)
    assert state["step"] == 3 and "probe" in state["history"][1] and "eval" in state["history"][2]
    first = {k: v.clone() for k, v in state["model"].items()}
    folder = train(tmp_path, TrainConfig(**{**cfg.__dict__, "steps": 2}))
    state = torch.load(tmp_path / "train_state.pt", weights_only=False)
    assert state["step"] == 4 and [r["step"] for r in state["history"]] == [1, 2, 3, 4]
    # stage 2 moves the text decoder only; the vision tower stays as stage 1 left it
    changed = {k for k in first if not torch.equal(first[k], state["model"][k])}
    assert changed and not any(".visual." in f".{k}" for k in changed)

    model = Qwen2VLForConditionalGeneration.from_pretrained(folder)
    assert next(model.parameters()).dtype == torch.float16
    assert json.loads((folder / "training_log.json").read_text())[0]["step"] == 4
    llm = LLM(model=str(folder), max_model_len=1024)
    out = llm.chat(make_sample("eval", 0).messages(), SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


def test_data_workers_render_the_same_batches_in_the_same_order(tmp_path):
    from foveal.demo_model.train import BatchSource, write_model_folder

    hf_config = write_model_folder(tmp_path / "scaffold")
    encoder = SampleEncoder(tmp_path / "scaffold", hf_config)
    cfg = TrainConfig(read_steps=1, vision_steps=2, steps=2, batch_size=2, pages_per_batch=1,
                      char_weight=1.0)
    batches = {}
    for workers in (0, 2):
        source = BatchSource(encoder, TrainConfig(**{**cfg.__dict__, "data_workers": workers}),
                             1, tmp_path / "scaffold", hf_config)
        batches[workers] = [source.next() for _ in range(4)]  # steps 1-4: stages 1 and 2
        source.close()
    for inline, worker in zip(batches[0], batches[2], strict=True):
        assert inline.keys() == worker.keys()
        assert inline["inputs"].keys() == worker["inputs"].keys()
        for key, value in inline["inputs"].items():
            assert torch.equal(value, worker["inputs"][key]), key
        assert torch.equal(inline["labels"], worker["labels"])
    assert "shapes" in batches[0][0] and "shapes" not in batches[0][2]  # stage 1, then 2
