"""Synthetic multimodal workload for offline benchmarks, fully determined by a seed.

Each request holds K random-content RGB images whose sides vary around the
requested size (real traffic is never one resolution), L random text tokens
drawn from the tokenizer's ordinary vocabulary, and an output length drawn
uniformly around the requested one. Prompts are token ids: each image's
placeholder as the model family's chat template writes it (Qwen-VL's
`<|vision_start|><|image_pad|><|vision_end|>`, LLaVA's `<image>`, Gemma 3's
`<start_of_image>`), then the text; the engine expands each placeholder.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from foveal.errors import CheckpointError, ConfigError

# Each image side is drawn uniformly from [LOW, HIGH] x the requested side.
WARMUP_IMAGE_SIDE = 56


@dataclass(frozen=True)
class PromptVocab:
    """The token ids a synthetic prompt is built from."""

    image_prompt_ids: tuple[int, ...]  # one image before expansion, as a chat template writes it
    image_token_id: int  # the token expansion repeats once per visual token
    text_token_ids: tuple[int, ...]  # ordinary (non-special) tokens the model can embed

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "PromptVocab":
        """The checkpoint's image placeholder and its tokenizer's ordinary tokens
        (minus special tokens and ids the model can't embed)."""
        from foveal.loader.hf_config import model_config_from_hf
        from foveal.multimodal.processors import get_processor_family
        from foveal.tokenizer import Tokenizer

        model_dir = Path(model_dir)
        model_config = model_config_from_hf(str(model_dir))
        tokenizer = Tokenizer.from_pretrained(model_dir)
        special_ids = set(tokenizer.all_special_ids)
        embeddable = min(tokenizer.vocab_size, _text_vocab_size(model_dir))
        text_ids = tuple(i for i in range(embeddable) if i not in special_ids)
        family = get_processor_family(model_config.model_type)
        return cls(image_prompt_ids=tuple(family.prompt_ids_for_image(model_config)),
                   image_token_id=model_config.image_token_id, text_token_ids=text_ids)


def _text_vocab_size(model_dir: Path) -> int:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{model_dir} has no config.json") from None
    return config.get("text_config", config)["vocab_size"]


@dataclass(frozen=True)
class WorkloadSpec:
    num_prompts: int
    images_per_prompt: int
    image_size: tuple[int, int]  # (width, height) the sizes vary around
    input_len: int  # text tokens per prompt, besides the image placeholders
    output_len: int
    output_len_range: float  # R: output lengths uniform in [out*(1-R), out*(1+R)]
    seed: int = 0
    image_size_range: float = 0.25  # each image side uniform in [side*(1-R), side*(1+R)]

    def __post_init__(self) -> None:
        checks = [
            (self.num_prompts >= 1, f"--num-prompts must be >= 1, got {self.num_prompts}"),
            (self.images_per_prompt >= 0,
             f"--images-per-prompt must be >= 0, got {self.images_per_prompt}"),
            (min(self.image_size) >= 1, f"--image-size must be positive, got {self.image_size}"),
            (self.input_len >= 0, f"--input-len must be >= 0, got {self.input_len}"),
            (self.output_len >= 1, f"--output-len must be >= 1, got {self.output_len}"),
            (0 <= self.output_len_range < 1,
             f"--output-len-range must be in [0, 1), got {self.output_len_range}"),
            (0 <= self.image_size_range < 1,
             f"--image-size-range must be in [0, 1), got {self.image_size_range}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def output_len_bounds(self) -> tuple[int, int]:
        low = max(1, math.ceil(self.output_len * (1 - self.output_len_range)))
        high = max(low, math.floor(self.output_len * (1 + self.output_len_range)))
        return low, high

    def image_side_bounds(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """((min_w, max_w), (min_h, max_h)), inclusive."""
        low, high = 1 - self.image_size_range, 1 + self.image_size_range
        return tuple((max(1, round(side * low)), max(1, round(side * high)))  # type: ignore[return-value]
                     for side in self.image_size)


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]  # placeholders not yet expanded: one per image
    images: list[Image.Image]
    output_len: int

    def to_prompt(self) -> dict:
        """The request as a Foveal / vLLM prompt dict."""
        return {"prompt_token_ids": list(self.prompt_token_ids),
                "multi_modal_data": {"image": list(self.images)}}


def parse_image_size(value: str) -> tuple[int, int]:
    """'640x480' -> (640, 480)."""
    width, sep, height = value.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit():
        raise ConfigError(f"--image-size must look like WIDTHxHEIGHT (e.g. 640x480), got {value!r}")
    return int(width), int(height)


def build_workload(spec: WorkloadSpec, vocab: PromptVocab) -> list[BenchRequest]:
    """N requests; the same spec and vocab always give the same requests."""
    if spec.input_len and not vocab.text_token_ids:
        raise CheckpointError("the tokenizer has no ordinary tokens to build text from")
    rng = np.random.default_rng(spec.seed)
    text_ids = np.asarray(vocab.text_token_ids, dtype=np.int64)
    image_prefix = list(vocab.image_prompt_ids)
    requests = []
    for _ in range(spec.num_prompts):
        images = [Image.fromarray(pixels) for pixels in draw_images(spec, rng)]
        text = rng.choice(text_ids, size=spec.input_len).tolist() if spec.input_len else []
        output_len = draw_output_len(spec, rng)
        requests.append(BenchRequest(image_prefix * len(images) + text, images, output_len))
    return requests


def draw_images(spec: WorkloadSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """One request's random images, (H, W, 3) uint8, sides drawn within the spec's range."""
    (min_w, max_w), (min_h, max_h) = spec.image_side_bounds()
    images = []
    for _ in range(spec.images_per_prompt):
        width = int(rng.integers(min_w, max_w, endpoint=True))
        height = int(rng.integers(min_h, max_h, endpoint=True))
        images.append(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))
    return images


def draw_output_len(spec: WorkloadSpec, rng: np.random.Generator) -> int:
    low, high = spec.output_len_bounds()
    return int(rng.integers(low, high, endpoint=True))


def warmup_request(vocab: PromptVocab) -> BenchRequest:
    """A tiny request run before timing; its flat gray image shares no cache entry
    with the workload's random ones."""
    image = Image.new("RGB", (WARMUP_IMAGE_SIDE, WARMUP_IMAGE_SIDE), (128, 128, 128))
    return BenchRequest(list(vocab.image_prompt_ids) + list(vocab.text_token_ids[:4]), [image],
                        output_len=2)


def workload_summary(spec: WorkloadSpec) -> dict:
    """The spec as plain data, for the JSON report."""
    (min_w, max_w), (min_h, max_h) = spec.image_side_bounds()
    return {"num_prompts": spec.num_prompts, "images_per_prompt": spec.images_per_prompt,
            "image_size": list(spec.image_size), "image_width_range": [min_w, max_w],
            "image_height_range": [min_h, max_h], "input_len": spec.input_len,
            "output_len": spec.output_len, "output_len_range": spec.output_len_range,
            "output_len_bounds": list(spec.output_len_bounds()), "seed": spec.seed}


def add_workload_args(parser) -> None:
    """The workload flags shared by `foveal bench throughput` and `foveal bench serve`."""
    group = parser.add_argument_group("workload (seeded by --seed)")
    group.add_argument("--num-prompts", type=int, default=32)
    group.add_argument("--images-per-prompt", type=int, default=1)
    group.add_argument("--image-size", default="448x448",
                       help="WIDTHxHEIGHT the image sizes vary around")
    group.add_argument("--image-size-range", type=float, default=0.25,
                       help="R: each side uniform in [side*(1-R), side*(1+R)]; 0 = exact size")
    group.add_argument("--input-len", type=int, default=64,
                       help="random text per prompt besides the images: token ids offline, "
                            "words against a server")
    group.add_argument("--output-len", type=int, default=64, help="max_tokens (EOS ignored)")
    group.add_argument("--output-len-range", type=float, default=0.0,
                       help="R: output lengths uniform in [out*(1-R), out*(1+R)]")


def workload_spec_from_args(args) -> WorkloadSpec:
    return WorkloadSpec(num_prompts=args.num_prompts, images_per_prompt=args.images_per_prompt,
                        image_size=parse_image_size(args.image_size), input_len=args.input_len,
                        output_len=args.output_len, output_len_range=args.output_len_range,
                        seed=args.seed, image_size_range=args.image_size_range)
