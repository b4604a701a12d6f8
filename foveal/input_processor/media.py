"""A prompt's media before processing: images identified and sized through the
processor cache (decoded only when it has not seen them), videos probed for
their header facts; and images processed through the same cache."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from PIL import Image

from foveal.errors import InvalidRequestError
from foveal.input_processor.prompt import check_modalities, image_item, media_items, media_uuids
from foveal.multimodal.hashing import hash_image
from foveal.multimodal.media.image import load_image
from foveal.multimodal.media.video import VideoInfo, VideoSampling, probe_video
from foveal.multimodal.processor_cache import ProcessorCache, processing_key, source_content_id


@dataclass
class ImageInput:
    """One image before processing; decoded only when the processor cache misses."""

    source: Any  # None when only a multi_modal_uuid names it
    content_id: str | None  # processor-cache identity; None: not cacheable
    width: int
    height: int
    detail: str
    decoded: Image.Image | None = None


@dataclass
class PromptMedia:
    images: list[ImageInput]
    videos: list  # sources
    video_infos: list[VideoInfo]


class MediaLoader:
    """Loads the media of prompts for one InputProcessor (its cache, its limits)."""

    def __init__(self, processor_cache: ProcessorCache, max_image_pixels: int,
                 limit_mm_per_prompt: Mapping[str, int]) -> None:
        self.processor_cache = processor_cache
        self.max_image_pixels = max_image_pixels
        self.limits = limit_mm_per_prompt

    def load(self, mm_data: Mapping[str, Any], mm_uuids: Mapping[str, Any],
             sampling: VideoSampling) -> PromptMedia:
        """Every item checked, identified and probed; raises InvalidRequestError."""
        check_modalities(mm_data)
        image_items = [image_item(item) for item in self._items(mm_data, "image")]
        videos = self._items(mm_data, "video")
        uuids = media_uuids(mm_uuids, {"image": len(image_items), "video": len(videos)})
        images = [self._image_input(index, source, detail, uuid)
                  for index, ((source, detail), uuid) in enumerate(zip(image_items, uuids["image"]))]
        return PromptMedia(images, videos, self._probe(videos, sampling))

    def load_videos(self, mm_data: Mapping[str, Any], sampling: VideoSampling) -> list:
        """The prompt's video sources, each probed (header limits checked); images untouched."""
        check_modalities(mm_data)
        videos = self._items(mm_data, "video")
        self._probe(videos, sampling)
        return videos

    def _items(self, mm_data: Mapping[str, Any], modality: str) -> list:
        return media_items(mm_data, modality, self.limits.get(modality, 0))

    def _probe(self, videos: list, sampling: VideoSampling) -> list[VideoInfo]:
        return [probe_video(video, sampling, self.max_image_pixels) for video in videos]

    def _image_input(self, index: int, source: Any, detail: str, uuid: str | None) -> ImageInput:
        """Identify an image and learn its size, decoding only what the cache has not seen."""
        decoded = None
        if uuid is not None:
            content_id = f"uuid:{uuid}"
        elif isinstance(source, Image.Image):
            decoded = load_image(source, self.max_image_pixels)
            content_id = "pixels:" + hash_image(decoded)
        else:
            content_id = source_content_id(source)
        size = self.processor_cache.size_of(content_id) if content_id else None
        if size is None:
            if source is None:
                raise InvalidRequestError(
                    f"image {index}: unknown multi_modal_uuid {uuid!r} and no data; send the "
                    "media again" if uuid is not None else
                    f"image {index} is None; send the image or a multi_modal_uuid sent before")
            decoded = decoded or load_image(source, self.max_image_pixels)
            size = decoded.size
            if content_id:
                self.processor_cache.remember_size(content_id, *size)
        return ImageInput(source, content_id, size[0], size[1], detail, decoded)

    def process_image(self, image: ImageInput, processor) -> Any:
        """Processed image from the cache, or decode and process it and keep the result."""
        key = processing_key(image.content_id, processor.tensor_params()) if image.content_id else None
        cached = self.processor_cache.get(key) if key else None
        if cached is not None:
            return cached
        if image.decoded is None:
            if image.source is None:
                raise InvalidRequestError(
                    f"multi_modal_uuid {image.content_id[len('uuid:'):]!r} is cached only with other "
                    "processing parameters (max_pixels, detail, ...); send the media again")
            image.decoded = load_image(image.source, self.max_image_pixels)
        processed = processor.process(image.decoded)
        if key:
            self.processor_cache.put(key, processed, _payload_nbytes(processed))
        return processed


def _payload_nbytes(processed: Any) -> int:
    """Bytes of the processed item's arrays (what the processor cache holds)."""
    return sum(value.nbytes for value in processed.feature_data().values() if hasattr(value, "nbytes"))
