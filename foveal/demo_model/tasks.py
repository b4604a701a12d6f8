"""Synthetic visual question answering: the tasks the demo model is trained and
evaluated on. Every sample is a pure function of (split, index), so the data is
deterministic, offline and never stored unless asked for (`foveal demo-data`).

Tasks (one short answer each):
  shapes    colour of a named shape, or the shape of a named colour (1-3 shapes)
  count     how many shapes (1-9)
  position  where the one shape is: left, right, top or bottom
  read      a short word or a 2-3 digit number rendered in small text
            (resolution matters: it blurs away when the image is downscaled)
  compare   two images: same shape / same colour? yes or no
  motion    a short clip; which way the shape moves (frames matter: one frame
            cannot tell)
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

from foveal.demo_model.render import (
    COLOR_NAMES, SHAPES, canvas, draw_shape, draw_text, jitter_color, text_size,
)

TASKS = ("shapes", "count", "position", "read", "compare", "motion")
# Training mix: the harder tasks get more samples.
TRAIN_WEIGHTS = {"shapes": 1.0, "count": 1.6, "position": 0.8, "read": 2.2, "compare": 1.0, "motion": 1.0}
WORDS = ("CAT", "DOG", "SUN", "MOON", "STAR", "TREE", "BIRD", "FISH", "BOOK", "DOOR",
         "LAMP", "CAKE", "BALL", "SHIP", "RAIN", "SNOW", "WIND", "FIRE", "GOLD", "OPEN",
         "STOP", "EXIT", "PARK", "ROAD", "CITY", "MILK", "TEA", "CUP", "KEY", "MAP",
         "BOX", "HAT", "PEN", "BUS", "CAR", "EGG", "ICE", "OWL", "FOX", "ZOO")
TEXT_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"  # what the texts are made of
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
TextRun = tuple[str, float, float, int]
CLIP_FRAMES = 8
CLIP_FPS = 2.0  # the processor's default sampling rate, so every frame is kept
_WIDTHS = (224, 252, 280, 308, 336)
_HEIGHTS = (168, 196, 224, 252)
_SMALL_SIDES = (112, 140, 168)


@dataclass
class Sample:
    uid: str
    task: str
    question: str
    answer: str
    images: list[Image.Image] = field(default_factory=list)
    video: list[np.ndarray] | None = None  # frames, (H, W, 3) uint8
    video_fps: float = CLIP_FPS
    # per image (or per clip frame): the shapes drawn, (cx, cy, size, shape), in pixels;
    # training reads them for its dense auxiliary targets
    objects: list[list[tuple[float, float, float, str]]] = field(default_factory=list)
    # more questions the same media answer (training asks them as later chat turns)
    follow_ups: list[tuple[str, str]] = field(default_factory=list)
    # per image (one entry for a clip): what the whole picture shows, for training's
    # scene targets: "count", "colors" ({shape: colour}, when every shape's colour is
    # known), "where" ((x, y) fractions of the one shape), "text", "direction"
    scenes: list[dict] = field(default_factory=list)
    # per image: the text runs drawn on it, (text, x, y, font size) in pixels; training
    # reads them for its per-token character targets
    texts: list[list[TextRun]] = field(default_factory=list)

    def messages(self, detail: str = "auto") -> list[dict]:
        """One user turn in OpenAI chat form (media parts first, then the question)."""
        parts: list[dict] = [{"type": "image_pil", "image_pil": image} if detail == "auto" else
                             {"type": "image_url", "image_url": {"url": image, "detail": detail}}
                             for image in self.images]
        if self.video is not None:
            parts.append({"type": "video", "video": {"frames": self.video, "fps": self.video_fps}})
        parts.append({"type": "text", "text": self.question})
        return [{"role": "user", "content": parts}]


def make_sample(split: str, index: int, task: str | None = None) -> Sample:
    """Sample `index` of `split` ("train" or "eval"). Eval cycles through the
    tasks in order (balanced); train draws them with TRAIN_WEIGHTS."""
    rng = random.Random(f"foveal-demo:{split}:{index}")
    if task is None:
        task = TASKS[index % len(TASKS)] if split != "train" else \
            rng.choices(TASKS, weights=[TRAIN_WEIGHTS[t] for t in TASKS])[0]
    question, answer, images, video, objects, follow_ups, scenes = _BUILDERS[task](rng)
    texts = [[(s["text"], *s["text_at"])] if "text" in s else [] for s in scenes[:len(images)]]
    return Sample(f"{split}-{index}", task, question, answer, images, video, objects=objects,
                  follow_ups=follow_ups, scenes=scenes, texts=texts)


def make_page(index: int) -> Sample:
    """A training-only page of text: rows of words, numbers and random character
    runs at the `read` task's glyph sizes. Stage 1 of training reads every
    glyph on it (dense per-token character targets), which teaches the vision
    tower the characters some forty times faster than the one short text of a
    `read` sample does (docs/benchmarks.md, "Demo model")."""
    rng = random.Random(f"foveal-demo:page:{index}")
    width, height = _size(rng)
    image = canvas(width, height, rng)
    draw = ImageDraw.Draw(image)
    runs: list[TextRun] = []
    y = rng.uniform(2, 10)
    while True:
        size = rng.randint(14, 22)
        line_height = text_size("A0", size)[1]
        if y + line_height + 4 > height:
            break
        x = rng.uniform(2, 20)
        while True:
            kind = rng.random()
            text = rng.choice(WORDS) if kind < 0.3 else str(rng.randint(0, 999)) if kind < 0.6 else \
                "".join(rng.choice(TEXT_CHARS) for _ in range(rng.randint(1, 5)))
            run_width = text_size(text, size)[0]
            if x + run_width + 4 > width:
                break
            if rng.random() < 0.8:  # some gaps, so that empty cells sit between runs too
                ink = rng.randint(0, 60)
                draw_text(draw, text, x, y, size, (ink, ink, ink))
                runs.append((text, x, y, size))
            x += run_width + rng.uniform(8, 40)
        y += line_height + rng.uniform(6, 30)
    first = runs[0][0] if runs else "no"
    return Sample(f"page-{index}", "page", "Read the text.", first, [image], objects=[[]],
                  scenes=[{}], texts=[runs])


def _about(shape: str, color: str) -> list[tuple[str, str]]:
    return [(f"What color is the {shape}?", color), (f"What shape is {color}?", shape)]


def _size(rng: random.Random) -> tuple[int, int]:
    return rng.choice(_WIDTHS), rng.choice(_HEIGHTS)


def _place(rng: random.Random, width: int, height: int, sizes: list[float],
           tries: int = 400) -> tuple[list[tuple[float, float]], list[float]]:
    """Centres for shapes of `sizes` that do not overlap, and the sizes drawn: when a
    shape finds no room, every size shrinks by a tenth and placement starts over
    (rare; the samples that fit at once are unchanged)."""
    while (centres := _try_place(rng, width, height, sizes, tries)) is None:
        sizes = [0.9 * size for size in sizes]
    return centres, sizes


def _try_place(rng: random.Random, width: int, height: int, sizes: list[float],
               tries: int) -> list[tuple[float, float]] | None:
    """Rejection sampling: each shape in turn gets up to `tries` draws for a centre
    clear of the shapes before it; None when one of them finds none."""
    centres: list[tuple[float, float, float]] = []
    for size in sizes:
        r = size / 2 + 3
        for _ in range(tries):
            x, y = rng.uniform(r, width - r), rng.uniform(r, height - r)
            if all((x - cx) ** 2 + (y - cy) ** 2 > ((r + cr) * 1.08) ** 2 for cx, cy, cr in centres):
                centres.append((x, y, r))
                break
        else:
            return None
    return [(x, y) for x, y, _ in centres]


def _shapes(rng):
    width, height = _size(rng)
    n = rng.randint(1, 3)
    shapes = rng.sample(SHAPES, n)
    colors = rng.sample(COLOR_NAMES, n)
    sizes = [rng.uniform(38, 64) for _ in range(n)]
    image = canvas(width, height, rng)
    draw = ImageDraw.Draw(image)
    objects = []
    centres, sizes = _place(rng, width, height, sizes)
    for (x, y), shape, color, size in zip(centres, shapes, colors, sizes):
        draw_shape(draw, shape, x, y, size, jitter_color(color, rng))
        objects.append((x, y, size, shape))
    k = rng.randrange(n)
    follow_ups = [qa for shape, color in zip(shapes, colors) for qa in _about(shape, color)]
    follow_ups.append(("How many shapes are there?", str(n)))
    scene = {"count": n, "colors": dict(zip(shapes, colors))}
    if n == 1:
        scene["where"] = (objects[0][0] / width, objects[0][1] / height)
    if rng.random() < 0.5:
        question = rng.choice(("What color is the {s}?", "Which color is the {s}?")).format(s=shapes[k])
        return question, colors[k], [image], None, [objects], follow_ups, [scene]
    question = rng.choice(("What shape is {c}?", "Which shape is {c}?")).format(c=colors[k])
    return question, shapes[k], [image], None, [objects], follow_ups, [scene]


def _count(rng):
    width, height = _size(rng)
    n = rng.randint(1, 9)
    top = 56 if n <= 3 else 42 if n <= 6 else 32
    sizes = [rng.uniform(20, top) for _ in range(n)]
    image = canvas(width, height, rng)
    draw = ImageDraw.Draw(image)
    objects = []
    centres, sizes = _place(rng, width, height, sizes)
    for (x, y), size in zip(centres, sizes):
        shape = rng.choice(SHAPES)
        draw_shape(draw, shape, x, y, size, jitter_color(rng.choice(COLOR_NAMES), rng))
        objects.append((x, y, size, shape))
    question = rng.choice(("How many shapes are there?", "How many shapes are in the image?"))
    scene = {"count": n}
    if n == 1:
        scene["where"] = (objects[0][0] / width, objects[0][1] / height)
    return question, str(n), [image], None, [objects], [], [scene]


def _position(rng):
    width, height = _size(rng)
    where = rng.choice(("left", "right", "top", "bottom"))
    size = rng.uniform(34, 56)
    near, mid = (0.08, 0.22), (0.36, 0.64)
    fx = rng.uniform(*near) if where in ("left", "right") else rng.uniform(*mid)
    fy = rng.uniform(*near) if where in ("top", "bottom") else rng.uniform(*mid)
    fx = 1 - fx if where == "right" else fx
    fy = 1 - fy if where == "bottom" else fy
    x = min(max(fx * width, size / 2 + 2), width - size / 2 - 2)
    y = min(max(fy * height, size / 2 + 2), height - size / 2 - 2)
    shape, color = rng.choice(SHAPES), rng.choice(COLOR_NAMES)
    image = canvas(width, height, rng)
    draw_shape(ImageDraw.Draw(image), shape, x, y, size, jitter_color(color, rng))
    question = rng.choice(("Where is the {c} {s}?", "Where is the {s}?")).format(c=color, s=shape)
    follow_ups = _about(shape, color) + [("How many shapes are there?", "1")]
    scene = {"count": 1, "colors": {shape: color}, "where": (x / width, y / height)}
    return question, where, [image], None, [[(x, y, size, shape)]], follow_ups, [scene]


def _read(rng):
    width, height = _size(rng)
    text = rng.choice(WORDS) if rng.random() < 0.5 else str(rng.randint(10, 999))
    size = rng.randint(15, 20)
    tw, th = text_size(text, size)
    image = canvas(width, height, rng)
    draw = ImageDraw.Draw(image)
    x, y = rng.uniform(6, width - tw - 6), rng.uniform(6, height - th - 10)
    objects, scene = [], {"text": text, "text_at": (x, y, size)}
    if rng.random() < 0.5:  # a distractor shape away from the text
        sx = rng.uniform(24, width - 24)
        sy = rng.uniform(24, height - 24)
        if abs(sx - (x + tw / 2)) > tw / 2 + 30 or abs(sy - (y + th / 2)) > th / 2 + 30:
            shape, size, color = rng.choice(SHAPES), rng.uniform(24, 40), rng.choice(COLOR_NAMES)
            draw_shape(draw, shape, sx, sy, size, jitter_color(color, rng))
            objects.append((sx, sy, size, shape))
            scene.update(colors={shape: color}, where=(sx / width, sy / height))
    scene["count"] = len(objects)
    ink = rng.randint(0, 60)
    draw_text(draw, text, x, y, size, (ink, ink, ink))
    question = rng.choice(("What does the text say?", "What is written in the image?", "Read the text."))
    return question, text, [image], None, [objects], [], [scene]


def _compare(rng):
    attribute = rng.choice(("shape", "color"))
    same = rng.random() < 0.5
    shape_a, color_a = rng.choice(SHAPES), rng.choice(COLOR_NAMES)
    shape_b, color_b = rng.choice(SHAPES), rng.choice(COLOR_NAMES)
    if attribute == "shape":
        shape_b = shape_a if same else rng.choice([s for s in SHAPES if s != shape_a])
    else:
        color_b = color_a if same else rng.choice([c for c in COLOR_NAMES if c != color_a])
    images, objects, scenes = [], [], []
    for shape, color in ((shape_a, color_a), (shape_b, color_b)):
        side_w, side_h = rng.choice(_SMALL_SIDES), rng.choice(_SMALL_SIDES)
        size = rng.uniform(36, 56)
        image = canvas(side_w, side_h, rng)
        x = rng.uniform(size / 2 + 2, side_w - size / 2 - 2)
        y = rng.uniform(size / 2 + 2, side_h - size / 2 - 2)
        draw_shape(ImageDraw.Draw(image), shape, x, y, size, jitter_color(color, rng))
        images.append(image)
        objects.append([(x, y, size, shape)])
        scenes.append({"count": 1, "colors": {shape: color}, "where": (x / side_w, y / side_h)})
    question = f"Do the two images show the same {attribute}?"
    follow_ups = [(f"Do the two images show the same {name}?", "yes" if a == b else "no")
                  for name, a, b in (("shape", shape_a, shape_b), ("color", color_a, color_b))]
    return question, "yes" if same else "no", images, None, objects, follow_ups, scenes


def _motion(rng):
    width, height = rng.choice(((168, 168), (196, 168), (168, 196)))
    direction = rng.choice(tuple(DIRECTIONS))
    dx, dy = DIRECTIONS[direction]
    size = rng.uniform(26, 40)
    travel = rng.uniform(70, 100)
    r = size / 2 + 3
    # start so the whole path stays inside the frame
    x0 = rng.uniform(r + max(0, -dx) * travel, width - r - max(0, dx) * travel)
    y0 = rng.uniform(r + max(0, -dy) * travel, height - r - max(0, dy) * travel)
    shape, color = rng.choice(SHAPES), rng.choice(COLOR_NAMES)
    fill = jitter_color(color, rng)
    background = canvas(width, height, rng)
    frames, objects = [], []
    for i in range(CLIP_FRAMES):
        step = travel * i / (CLIP_FRAMES - 1)
        frame = background.copy()
        x, y = x0 + dx * step, y0 + dy * step
        draw_shape(ImageDraw.Draw(frame), shape, x, y, size, fill)
        frames.append(np.asarray(frame))
        objects.append([(x, y, size, shape)])
    question = rng.choice(("Which way does the {s} move?", "Which way does the {c} {s} move?")).format(
        s=shape, c=color)
    scene = {"count": 1, "colors": {shape: color}, "direction": direction}
    return question, direction, [], frames, objects, _about(shape, color), [scene]


_BUILDERS = {"shapes": _shapes, "count": _count, "position": _position, "read": _read,
             "compare": _compare, "motion": _motion}


def demo_image() -> Image.Image:
    """The image `foveal demo` asks about: a red circle, a blue square and a
    green triangle, 50 px each: inside the sizes both the `shapes` task (38-64)
    and the `count` task (20-56 for up to three shapes) draw."""
    image = Image.new("RGB", (336, 224), (242, 241, 236))
    draw = ImageDraw.Draw(image)
    for shape, color, x in (("circle", "red", 64), ("square", "blue", 168), ("triangle", "green", 272)):
        draw_shape(draw, shape, x, 112, 50, jitter_color(color, random.Random(0)))
    return image
