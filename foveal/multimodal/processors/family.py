"""What the input processor needs of one model family's media processing.

A `ProcessorFamily` bundles a family's image and video processor classes, the
mm_processor_kwargs each accepts, how a prompt's media placeholders expand,
and the numbers the visual-token planner works with. The registry
(`foveal.multimodal.processors`) hands out one per HF model_type, so the input
processor holds no model-specific code.

The protocols below are what the input processor calls on the processors and
on their outputs; a new family's classes implement them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from foveal.errors import InvalidRequestError
from foveal.multimodal.media.video import VideoSampling

if TYPE_CHECKING:
    from PIL import Image

    from foveal.multimodal.budget import Geometry
    from foveal.multimodal.inputs import MMFeature
    from foveal.multimodal.media.video import DecodedVideo, VideoSampling


class ProcessedItem(Protocol):
    """One processed image or video, ready to become an `MMFeature`."""

    modality: str  # "image" | "video"
    num_tokens: int  # placeholder tokens the item fills
    mm_hash: str

    def feature_data(self) -> dict[str, Any]:
        """The MMFeature's data: the encoder's arrays plus plain values (grid, timing)."""


class ImageProcessor(Protocol):
    min_pixels: int
    max_pixels: int

    @classmethod
    def from_pretrained(cls, path: str, overrides: dict | None = None) -> "ImageProcessor":
        """Read the checkpoint's processor config, then apply mm_processor_kwargs overrides."""

    def with_overrides(self, overrides: dict) -> "ImageProcessor":
        """A copy with mm_processor_kwargs applied ({"max_pixels": n} included)."""

    def tensor_params(self) -> dict[str, Any]:
        """Every parameter that changes the output tensors (processor-cache key)."""

    def process(self, image: "Image.Image") -> ProcessedItem: ...


class VideoProcessor(Protocol):
    sampling: "VideoSampling"  # the frame-sampling rule (fps, min/max frames)
    takes_video: bool  # False: every video is refused before it is loaded

    @classmethod
    def from_pretrained(cls, path: str, overrides: dict | None = None) -> "VideoProcessor": ...

    def with_overrides(self, overrides: dict) -> "VideoProcessor": ...

    def with_max_pixels(self, max_pixels: int) -> "VideoProcessor":
        """A copy whose frames are resized to at most `max_pixels` (the planner's choice)."""

    def process(self, video: "DecodedVideo") -> ProcessedItem: ...


def check_video_overrides(overrides: dict, accepted) -> None:
    """A video processor's mm_processor_kwargs: known keys, positive numbers."""
    unknown = sorted(set(overrides) - set(accepted))
    if unknown:
        raise InvalidRequestError(f"unknown video mm_processor_kwargs {unknown}; "
                                  f"accepted: {sorted(accepted)}")
    for key, value in overrides.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise InvalidRequestError(f"mm_processor_kwargs[{key!r}] must be positive, got {value!r}")


class NoVideoProcessor:
    """The video processor of a family that takes no video: a video, or a video
    option, is refused with a clear error (before any video is loaded)."""

    family_name = "this model"  # subclasses name their family
    sampling = VideoSampling()
    takes_video = False

    @classmethod
    def from_pretrained(cls, path: str, overrides: dict | None = None) -> "NoVideoProcessor":
        return cls().with_overrides(overrides or {})

    def with_overrides(self, overrides: dict) -> "NoVideoProcessor":
        if overrides:
            raise InvalidRequestError(f"mm_processor_kwargs {sorted(overrides)} are for videos; "
                                      f"Foveal runs {self.family_name} on images only")
        return self

    def with_max_pixels(self, max_pixels: int) -> "NoVideoProcessor":
        return self

    def refusal(self) -> str:
        return f"Foveal runs {self.family_name} on images only; send video frames as images"

    def process(self, video) -> None:
        raise InvalidRequestError(self.refusal())


# (token ids, modality -> (placeholder token id, processed items in prompt order))
#   -> (ids with each placeholder repeated item.num_tokens times, one MMFeature per item)
PlaceholderExpander = Callable[[list[int], dict[str, tuple[int, list]]],
                               tuple[list[int], list["MMFeature"]]]


@dataclass(frozen=True)
class ProcessorFamily:
    """One model family's media processing, as the input processor uses it."""

    name: str
    image_processor_class: type  # an ImageProcessor
    video_processor_class: type  # a VideoProcessor
    image_override_keys: tuple[str, ...]  # mm_processor_kwargs the image processor takes
    video_override_keys: tuple[str, ...]  # mm_processor_kwargs the video processor takes
    expand_placeholders: PlaceholderExpander
    # (image processor, video processor) -> the planner's Geometry
    planner_geometry: Callable[[Any, Any], "Geometry"]
    # Families whose expansion renders text (e.g. video timestamps) need the
    # tokenizer: tokenizer -> the expander used instead of expand_placeholders.
    text_expander: Callable[[Any], PlaceholderExpander] | None = None
    # ModelConfig -> the token ids one image takes in a prompt before expansion
    # (what a chat template writes per image); None: the model's image token alone.
    image_prompt_ids: Callable[[Any], tuple[int, ...]] | None = None
    # (image processor, images in the prompt) -> the processor for that prompt's images
    # (LLaVA-OneVision's multi-image mode); None: the same processor whatever the count.
    prompt_image_processor: Callable[[Any, int], Any] | None = None

    def prompt_ids_for_image(self, model_config: Any) -> tuple[int, ...]:
        """The unexpanded placeholder of one image, e.g. Qwen2-VL's
        <|vision_start|><|image_pad|><|vision_end|>, LLaVA's <image>."""
        if self.image_prompt_ids is not None:
            return self.image_prompt_ids(model_config)
        return (model_config.image_token_id,)

    def image_processor_for_prompt(self, image_processor: Any, num_images: int) -> Any:
        if self.prompt_image_processor is None:
            return image_processor
        return self.prompt_image_processor(image_processor, num_images)

    def expander(self, tokenizer: Any) -> PlaceholderExpander:
        """The placeholder expansion the input processor runs with this tokenizer."""
        return self.text_expander(tokenizer) if self.text_expander else self.expand_placeholders
