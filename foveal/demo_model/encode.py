"""Turn a task sample into model inputs exactly as the engine does at serving
time: the checkpoint's chat template, its tokenizer, Foveal's image and video
processors and placeholder expansion. Training and teacher-forced evaluation
share this path, so what the model learns is what `LLM.chat` feeds it."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from foveal.demo_model.render import COLOR_NAMES, SHAPES, font
from foveal.demo_model.tasks import DIRECTIONS, TEXT_CHARS, Sample, TextRun
from foveal.multimodal.chat import parse_chat_conversation
from foveal.multimodal.media.video import DecodedVideo, VideoInfo, sample_indices
from foveal.multimodal.processors.qwen2_vl import Qwen2VLImageProcessor, expand_mm_placeholders
from foveal.multimodal.processors.qwen2_vl_video import Qwen2VLVideoProcessor
from foveal.tokenizer import Tokenizer

IGNORE_INDEX = -100
TEXT_SLOTS = 4
# character targets per visual token: up to this many characters whose centres fall in its
# 28 px cell, left to right (a glyph at the tasks' sizes is at least 7 px wide)
CHAR_SLOTS = 4
# run targets per visual token: the whole word or number its cell holds glyphs of (run_targets)
RUN_SLOTS = 5
MAX_COUNT = 9
MAX_CENTRES = 2  # centre_targets' classes are 0 .. MAX_CENTRES


@dataclass(frozen=True)
class Augment:
    """Training-time variety so the model stays sane along the serving dials."""

    lowres_prob: float = 0.3  # shrink an image's pixel budget to 1/2 .. 1/8 of its area
    fewer_frames_prob: float = 0.3  # feed a clip at 4 or 2 of its frames
    max_follow_ups: int = 4  # more questions about the same media, as later chat turns


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    pixel_values: list[torch.Tensor]
    image_grid_thw: list[tuple[int, int, int]]
    pixel_values_videos: list[torch.Tensor]
    video_grid_thw: list[tuple[int, int, int]]
    task: str
    # one shape class per visual token (0: none, 1 + SHAPES index), per image / video
    image_shape_targets: list[torch.Tensor]
    video_shape_targets: list[torch.Tensor]
    # what each whole image / clip shows (see scene_targets), per visual token
    image_scene_targets: list[tuple[torch.Tensor, torch.Tensor]]
    video_scene_targets: list[tuple[torch.Tensor, torch.Tensor]]
    # per image: (tokens, CHAR_SLOTS) the characters in each token's cell, in order (char_targets)
    image_char_targets: list[torch.Tensor] = field(default_factory=list)
    # per image: (tokens, RUN_SLOTS) the whole text run each token's cell holds (run_targets)
    image_run_targets: list[torch.Tensor] = field(default_factory=list)
    # per image / video: how many shape centres fall in each token's cell (centre_targets)
    image_centre_targets: list[torch.Tensor] = field(default_factory=list)
    video_centre_targets: list[torch.Tensor] = field(default_factory=list)


class SampleEncoder:
    def __init__(self, folder: str | Path, hf_config: dict) -> None:
        self.tokenizer = Tokenizer.from_pretrained(folder)
        self.images = Qwen2VLImageProcessor.from_pretrained(folder)
        self.videos = Qwen2VLVideoProcessor.from_pretrained(folder)
        self.image_token_id = hf_config["image_token_id"]
        self.video_token_id = hf_config["video_token_id"]
        self.end_id = self.tokenizer.token_to_id("<|im_end|>")

    def encode(self, sample: Sample, rng: random.Random | None = None,
               augment: Augment | None = None) -> Encoded:
        conversation = parse_chat_conversation(sample.messages())
        prompt = self.tokenizer.apply_chat_template(conversation.messages, add_generation_prompt=True)
        prompt_ids = self.tokenizer.encode(prompt)
        images = [self._image_processor(image, rng, augment).process(image) for image in sample.images]
        targets = [shape_targets([objects], image.width, image.height, item.grid_thw)
                   for image, objects, item in zip(sample.images, sample.objects, images)]
        centres = [centre_targets([objects], image.width, image.height, item.grid_thw)
                   for image, objects, item in zip(sample.images, sample.objects, images)]
        texts = [text_targets(sample.texts[i] if i < len(sample.texts) else [], image.width,
                              image.height, item.grid_thw)
                 for i, (image, item) in enumerate(zip(sample.images, images))]
        videos, video_targets, video_centres = [], [], []
        if sample.video is not None:
            video, kept = self._process_video(sample, rng, augment)
            videos.append(video)
            height, width = sample.video[0].shape[:2]
            frames = [sample.objects[i] for i in kept]
            video_targets.append(shape_targets(frames, width, height, video.grid_thw))
            video_centres.append(centre_targets(frames, width, height, video.grid_thw))
        prompt_ids, _ = expand_mm_placeholders(prompt_ids, {"image": (self.image_token_id, images),
                                                            "video": (self.video_token_id, videos)})
        input_ids, labels = list(prompt_ids), [IGNORE_INDEX] * len(prompt_ids)
        turns = [(sample.question, sample.answer)] + self._follow_ups(sample, rng, augment)
        messages = list(conversation.messages)
        for index, (_, answer) in enumerate(turns):
            answer_ids = self.tokenizer.encode(answer) + [self.end_id]
            input_ids += answer_ids
            labels += answer_ids
            if index + 1 < len(turns):  # the template's text up to the next answer
                done = prompt + answer
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": turns[index + 1][0]}]
                prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                between = self.tokenizer.encode(prompt[len(done):])
                assert between[0] == self.end_id, "the template closes a turn with <|im_end|>"
                input_ids += between[1:]
                labels += [IGNORE_INDEX] * (len(between) - 1)
        return Encoded(input_ids, labels,
                       [item.pixel_values for item in images], [item.grid_thw for item in images],
                       [item.pixel_values_videos for item in videos], [item.grid_thw for item in videos],
                       sample.task, targets, video_targets,
                       [scene_targets(scene, len(t)) for scene, t in zip(sample.scenes, targets)],
                       [scene_targets(scene, len(t)) for scene, t in zip(sample.scenes, video_targets)],
                       [chars for chars, _ in texts], [words for _, words in texts],
                       centres, video_centres)

    @staticmethod
    def _follow_ups(sample: Sample, rng, augment) -> list[tuple[str, str]]:
        if rng is None or augment is None or not augment.max_follow_ups:
            return []
        pool = [qa for qa in sample.follow_ups if qa[0] != sample.question]
        rng.shuffle(pool)
        return pool[:rng.randint(0, augment.max_follow_ups)]

    def _image_processor(self, image, rng, augment) -> Qwen2VLImageProcessor:
        if rng is None or augment is None or rng.random() >= augment.lowres_prob:
            return self.images
        area = image.width * image.height * rng.choice((0.5, 0.25, 0.125))
        return self.images.with_overrides({"max_pixels": max(self.images.min_pixels, int(area))})

    def _process_video(self, sample: Sample, rng, augment):
        """The processed clip and the indices of the frames it kept."""
        kept = list(range(len(sample.video)))
        fps = sample.video_fps
        if rng is not None and augment is not None and rng.random() < augment.fewer_frames_prob:
            count = rng.choice((4, 4, 2))
            kept = sample_indices(len(sample.video), count)
            fps = fps * count / len(sample.video)
        frames = [sample.video[i] for i in kept]
        height, width = frames[0].shape[:2]
        info = VideoInfo(len(frames), fps, width, height)
        decoded = DecodedVideo(list(frames), [i / fps for i in range(len(frames))], info, sample.uid)
        return self.videos.process(decoded), kept


def _cell_grid(grid_thw: tuple[int, int, int], width: int, height: int, patch: int,
               merge: int) -> tuple[int, int, int, int, float, float]:
    """(temporal patches, rows, columns, cell side in processed pixels, x and y scale
    from source to processed pixels) of one image's or clip's visual tokens."""
    t, h, w = grid_thw
    return t, h // merge, w // merge, patch * merge, w * patch / width, h * patch / height


def shape_targets(frames: list[list[tuple]], width: int, height: int,
                  grid_thw: tuple[int, int, int], patch: int = 14, merge: int = 2) -> torch.Tensor:
    """Per visual token (temporal patch by temporal patch, row-major merge
    windows): the class of the shape covering the middle of its cell, from the
    objects drawn on each frame (temporal patch t reads frame 2t)."""
    t, rows, cols, cell, sx, sy = _cell_grid(grid_thw, width, height, patch, merge)
    out = torch.zeros((t, rows, cols), dtype=torch.long)
    for index in range(t):
        for cx, cy, size, shape in frames[min(len(frames) - 1, 2 * index)]:
            r = 0.45 * size
            top, bottom = int((cy - r) * sy // cell), int((cy + r) * sy // cell)
            left, right = int((cx - r) * sx // cell), int((cx + r) * sx // cell)
            out[index, max(0, top):min(rows, bottom + 1), max(0, left):min(cols, right + 1)] = \
                SHAPES.index(shape) + 1
    return out.flatten()


def centre_targets(frames: list[list[tuple]], width: int, height: int,
                   grid_thw: tuple[int, int, int], patch: int = 14, merge: int = 2) -> torch.Tensor:
    """Per visual token (in shape_targets' order): how many of the drawn shapes have
    their centre in its cell, at most MAX_CENTRES. Summed over an image's tokens it is
    the image's object count: a target each token can learn from its own
    neighbourhood, which the decoder can then count."""
    t, rows, cols, cell, sx, sy = _cell_grid(grid_thw, width, height, patch, merge)
    out = torch.zeros((t, rows, cols), dtype=torch.long)
    for index in range(t):
        for cx, cy, _, _ in frames[min(len(frames) - 1, 2 * index)]:
            row, col = min(rows - 1, int(cy * sy // cell)), min(cols - 1, int(cx * sx // cell))
            out[index, row, col] += 1
    return out.clamp_(max=MAX_CENTRES).flatten()


def text_targets(runs: list[TextRun], width: int, height: int, grid_thw: tuple[int, int, int],
                 patch: int = 14, merge: int = 2, min_scale: float = 0.6
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's (char_targets, run_targets), from one pass over its glyphs: per visual
    token, the text named from the glyphs whose centres fall in its cell, as classes
    (1 + TEXT_CHARS index, then 0s); 0s for a cell without glyphs. IGNORE_INDEX
    everywhere when the processor shrank the image below `min_scale`: the glyphs are
    then too blurred to name."""
    t, rows, cols, cell, sx, sy = _cell_grid(grid_thw, width, height, patch, merge)
    if min(sx, sy) < min_scale:
        return (torch.full((t * rows * cols, CHAR_SLOTS), IGNORE_INDEX),
                torch.full((t * rows * cols, RUN_SLOTS), IGNORE_INDEX))
    chars = torch.zeros((rows, cols, CHAR_SLOTS), dtype=torch.long)
    words = torch.zeros((rows, cols, RUN_SLOTS), dtype=torch.long)
    cells: dict[tuple[int, int], list[tuple[float, str, int]]] = {}
    for run, (text, x, y, size) in enumerate(runs):
        face = font(size)
        _, top, _, bottom = face.getbbox(text)
        cy = (y + (top + bottom) / 2) * sy
        for index, char in enumerate(text):
            cx = (x + face.getlength(text[:index]) + face.getlength(char) / 2) * sx
            row, col = int(cy // cell), int(cx // cell)
            if 0 <= row < rows and 0 <= col < cols:
                cells.setdefault((row, col), []).append((cx, char, run))
    for (row, col), glyphs in cells.items():
        indices = [run for _, _, run in glyphs]
        most = max(indices, key=lambda run: (indices.count(run), -run))  # ties: the first run
        for out, text in ((chars, "".join(char for _, char, _ in sorted(glyphs))), (words, runs[most][0])):
            text = text[:out.shape[-1]]
            out[row, col, :len(text)] = torch.tensor([TEXT_CHARS.index(c) + 1 for c in text])
    return chars.view(-1, CHAR_SLOTS).repeat(t, 1), words.view(-1, RUN_SLOTS).repeat(t, 1)


def char_targets(runs: list[TextRun], width: int, height: int, grid_thw: tuple[int, int, int],
                 patch: int = 14, merge: int = 2, min_scale: float = 0.6) -> torch.Tensor:
    """(tokens, CHAR_SLOTS) per visual token: the classes (1 + TEXT_CHARS index; 0: none)
    of the characters whose centres fall in the token's cell, left to right, from the
    text runs drawn on the image. Reading the tokens of a line in order, and each
    token's slots in order, spells the line. IGNORE_INDEX everywhere when the processor
    shrank the image below `min_scale`: the glyphs are then too blurred to name."""
    return text_targets(runs, width, height, grid_thw, patch, merge, min_scale)[0]


def run_targets(runs: list[TextRun], width: int, height: int, grid_thw: tuple[int, int, int],
                patch: int = 14, merge: int = 2, min_scale: float = 0.6) -> torch.Tensor:
    """(tokens, RUN_SLOTS) per visual token: the whole text run (word or number) the
    token's cell holds glyph centres of, as classes (1 + TEXT_CHARS index) then 0s
    after its end; the run with the most glyphs there where a cell holds two; all 0
    for a cell without text. Every token of a word names the whole word, so a reader
    needs any one of them rather than each in order, and a glyph on a cell boundary
    cannot shift the spelling (char_targets' slots can). IGNORE_INDEX everywhere when
    the image was shrunk below `min_scale`, as in char_targets."""
    return text_targets(runs, width, height, grid_thw, patch, merge, min_scale)[1]


def scene_targets(scene: dict, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's (or clip's) scene, repeated on each of its `tokens` visual tokens:
    classes (tokens, 1 + shapes + TEXT_SLOTS + 1) = [object count, the colour of
    each shape (0: absent, 1 + colour index), the text's characters (0: padding),
    the motion direction], IGNORE_INDEX where the scene does not say; and the one
    shape's (x, y) as fractions (tokens, 2), NaN where there is not exactly one."""
    classes = [IGNORE_INDEX] * (1 + len(SHAPES) + TEXT_SLOTS + 1)
    if "count" in scene:
        classes[0] = min(scene["count"], MAX_COUNT)
    if "colors" in scene:
        classes[1:1 + len(SHAPES)] = [COLOR_NAMES.index(scene["colors"][shape]) + 1
                                      if shape in scene["colors"] else 0 for shape in SHAPES]
    if "text" in scene:
        text = scene["text"][:TEXT_SLOTS]
        classes[1 + len(SHAPES):1 + len(SHAPES) + TEXT_SLOTS] = \
            [TEXT_CHARS.index(c) + 1 for c in text] + [0] * (TEXT_SLOTS - len(text))
    if "direction" in scene:
        classes[-1] = tuple(DIRECTIONS).index(scene["direction"])
    where = scene.get("where", (float("nan"), float("nan")))
    return (torch.tensor(classes).repeat(tokens, 1),
            torch.tensor(where, dtype=torch.float32).repeat(tokens, 1))


def collate(batch: list[Encoded], pad_id: int, image_token_id: int = 12,
            video_token_id: int = 13) -> dict[str, torch.Tensor]:
    """Right-padded batch in transformers' Qwen2-VL forward signature
    (mm_token_type_ids: 1 on image tokens, 2 on video tokens, for M-RoPE)."""
    length = max(len(item.input_ids) for item in batch)
    input_ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
    for row, item in enumerate(batch):
        n = len(item.input_ids)
        input_ids[row, :n] = torch.tensor(item.input_ids)
        labels[row, :n] = torch.tensor(item.labels)
        attention_mask[row, :n] = 1
    types = (input_ids == image_token_id).long() + 2 * (input_ids == video_token_id).long()
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
           "mm_token_type_ids": types}
    pixels = [p for item in batch for p in item.pixel_values]
    if pixels:
        out["pixel_values"] = torch.cat(pixels)
        out["image_grid_thw"] = torch.tensor([g for item in batch for g in item.image_grid_thw])
    videos = [p for item in batch for p in item.pixel_values_videos]
    if videos:
        out["pixel_values_videos"] = torch.cat(videos)
        out["video_grid_thw"] = torch.tensor([g for item in batch for g in item.video_grid_thw])
    return out


def to_device(value, device: torch.device):
    """Tensors in nested dicts, lists and tuples moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def batch_shape_targets(batch: list[Encoded]) -> list[torch.Tensor]:
    """Shape targets in the order the vision tower sees the batch: every image
    (sample order), then every video."""
    images = [t for item in batch for t in item.image_shape_targets]
    videos = [t for item in batch for t in item.video_shape_targets]
    return [torch.cat(group) for group in (images, videos) if group]


def batch_centre_targets(batch: list[Encoded]) -> list[torch.Tensor]:
    """Centre targets per image (sample order), then per clip: the tower's order."""
    return [t for item in batch for t in item.image_centre_targets] + \
        [t for item in batch for t in item.video_centre_targets]


def batch_char_targets(batch: list[Encoded]) -> torch.Tensor | None:
    """Character targets of the batch's image tokens (the tower's images come first;
    clips carry no text), or None when no image has any."""
    targets = [t for item in batch for t in item.image_char_targets]
    return torch.cat(targets) if targets else None


def batch_run_targets(batch: list[Encoded]) -> torch.Tensor | None:
    """Run targets of the batch's image tokens (run_targets), in batch_char_targets' order."""
    targets = [t for item in batch for t in item.image_run_targets]
    return torch.cat(targets) if targets else None


def batch_scene_targets(batch: list[Encoded]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scene targets of every visual token of the batch, in the vision tower's order."""
    pairs = [p for item in batch for p in item.image_scene_targets] + \
            [p for item in batch for p in item.video_scene_targets]
    return torch.cat([c for c, _ in pairs]), torch.cat([w for _, w in pairs])
