"""Load a video into sampled RGB frames with their timestamps.

Sources: a filesystem path (`str` / `pathlib.Path`), a `file://` URL, a base64
`data:video/...` URL, raw bytes (the server fetches http(s) into bytes), or
frames already decoded: a list of `PIL.Image` / (H, W, 3) uint8 arrays, a
(T, H, W, 3) uint8 array, or `{"frames": ..., "fps": 4.0}` (fps defaults to
the sampling fps, i.e. the frames are taken as already sampled).

Two steps, so the budget planner can choose the frame count before any pixel
is decoded: `probe_video` reads the container header (frame count, rate,
size) and `load_video` decodes forward once, converting only the chosen
frames (never the whole clip in memory).

Sampling rule (transformers' Qwen2-VL `sample_frames`): the frame count is
duration * fps clamped to [min_frames, min(max_frames, source frames)] and
floored to a multiple of `frame_factor` (temporal_patch_size); a clip shorter
than `frame_factor` frames keeps all its frames (the processor repeats the
last). Frame i of n is source frame floor(i * total / n): evenly spread over
the whole clip, starting at the first frame.
"""
from __future__ import annotations

import hashlib
import io
import math
import pathlib
import urllib.parse
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
from PIL import Image

from foveal.errors import MediaError, MediaLimitError
from foveal.multimodal.media.data_url import decode_data_url
from foveal.multimodal.media.image import check_pixel_limit

# Source frames the decoder may walk for one video: one hour at 30 fps.
DEFAULT_MAX_SOURCE_FRAMES = 108_000


@dataclass(frozen=True)
class VideoSampling:
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    frame_factor: int = 2  # temporal_patch_size: frame counts are multiples of it

    def num_frames(self, total_frames: int, source_fps: float) -> int:
        """Frames to sample from a clip of `total_frames` at `source_fps`."""
        if total_frames < self.frame_factor:
            return total_frames
        ceiling = min(self.max_frames, total_frames) // self.frame_factor * self.frame_factor
        wanted = total_frames / source_fps * self.fps
        wanted = min(max(wanted, self.min_frames), ceiling)
        return max(self.frame_factor, math.floor(wanted / self.frame_factor) * self.frame_factor)


@dataclass(frozen=True)
class VideoInfo:
    """What the header says: enough for the planner, no pixels decoded."""

    num_frames: int
    fps: float
    width: int
    height: int

    @property
    def duration(self) -> float:
        return self.num_frames / self.fps


@dataclass(frozen=True)
class DecodedVideo:
    frames: list[np.ndarray]  # num_frames x (H, W, 3) uint8
    timestamps: list[float]  # seconds from the clip's first frame, one per frame
    source: VideoInfo
    content_hash: str  # sha256 of the sampled frames' pixels and sizes

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the sampled clip (transformers' `sampled_fps`)."""
        return len(self.frames) / self.source.duration


def sample_indices(total_frames: int, num_frames: int) -> list[int]:
    """Source frame index of each of `num_frames` frames spread over the clip."""
    return [i * total_frames // num_frames for i in range(num_frames)]


def probe_video(source: Any, sampling: VideoSampling, max_frame_pixels: int,
                max_source_frames: int = DEFAULT_MAX_SOURCE_FRAMES) -> VideoInfo:
    """Header facts of `source`; raises MediaError / MediaLimitError."""
    frames = _as_frame_list(source, sampling)
    if frames is not None:
        info = frames[1]
    else:
        with _open_container(source) as container:
            info = _container_info(container, source)
    check_pixel_limit(info.width, info.height, max_frame_pixels)
    if info.num_frames > max_source_frames:
        raise MediaLimitError(
            f"video has {info.num_frames} frames ({info.duration:.0f} s); the limit is "
            f"{max_source_frames} frames: send a shorter clip")
    return info


def load_video(source: Any, info: VideoInfo, num_frames: int, sampling: VideoSampling) -> DecodedVideo:
    """Decode the `num_frames` frames `sample_indices` picks, streaming."""
    indices = sample_indices(info.num_frames, num_frames)
    frame_list = _as_frame_list(source, sampling)
    if frame_list is not None:
        frames = [frame_list[0][i] for i in indices]
        timestamps = [i / info.fps for i in indices]
    else:
        frames, timestamps = _decode_frames(source, info, indices)
    return DecodedVideo(frames, timestamps, info, _hash_frames(frames))


def is_frame_source(source: Any) -> bool:
    """True for frames already decoded (a list, a (T, H, W, 3) array or a frames dict)."""
    return isinstance(source, (list, tuple, dict)) or (isinstance(source, np.ndarray) and source.ndim == 4)


def _hash_frames(frames: list[np.ndarray]) -> str:
    digest = hashlib.sha256(f"video:{len(frames)}:".encode())
    for frame in frames:
        digest.update(f"{frame.shape[1]}x{frame.shape[0]}:".encode())
        digest.update(np.ascontiguousarray(frame).tobytes())
    return digest.hexdigest()


def _as_frame_list(source: Any, sampling: VideoSampling) -> tuple[list[np.ndarray], VideoInfo] | None:
    """Decoded frames passed by the caller, or None for an encoded source."""
    fps = sampling.fps
    if isinstance(source, dict):
        if set(source) - {"frames", "fps"} or "frames" not in source:
            raise MediaError(f"a video dict has 'frames' and an optional 'fps', got keys {sorted(source)}")
        fps = float(source.get("fps") or fps)
        source = source["frames"]
        if fps <= 0:
            raise MediaError(f"video fps must be positive, got {fps}")
    if isinstance(source, np.ndarray) and source.ndim == 4:
        source = list(source)
    if not isinstance(source, (list, tuple)):
        return None
    if not source:
        raise MediaError("the video has no frames; pass at least one frame")
    frames = [_frame_array(frame, index) for index, frame in enumerate(source)]
    height, width = frames[0].shape[:2]
    if any(frame.shape != frames[0].shape for frame in frames):
        raise MediaError(f"video frames differ in size; every frame must be {width}x{height}")
    return frames, VideoInfo(len(frames), fps, width, height)


def _frame_array(frame: Any, index: int) -> np.ndarray:
    if isinstance(frame, Image.Image):
        return np.asarray(frame.convert("RGB"))
    if isinstance(frame, np.ndarray) and frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[2] == 3:
        return frame
    described = f"{frame.dtype} array of shape {frame.shape}" if isinstance(frame, np.ndarray) \
        else type(frame).__name__
    raise MediaError(f"video frame {index} is a {described}; pass PIL images or (H, W, 3) uint8 arrays")


def _open_container(source: Any):
    import av

    target = _container_target(source)
    try:
        return av.open(target, mode="r")
    except (av.FFmpegError, UnicodeDecodeError) as exc:  # garbage metadata fails to decode
        raise MediaError(f"could not open the video ({type(exc).__name__}: {exc}); send MP4, "
                         "WebM, MKV, AVI or MOV") from exc


def _container_target(source: Any):
    if isinstance(source, (bytes, bytearray, memoryview)):
        if not len(source):
            raise MediaError("the video is empty (0 bytes)")
        return io.BytesIO(bytes(source))
    if isinstance(source, pathlib.Path):
        return _checked_path(source)
    if isinstance(source, str):
        scheme = source.split(":", 1)[0].lower() if ":" in source else ""
        if scheme in ("http", "https"):
            raise MediaError("http(s) video URLs are fetched by the server; pass the bytes, "
                             "a file path or a data: URL to the engine")
        if scheme == "data":
            return _container_target(decode_video_data_url(source))
        if scheme == "file":
            parsed = urllib.parse.urlparse(source)
            if parsed.netloc not in ("", "localhost"):
                raise MediaError(f"file URL names host {parsed.netloc!r}; only local files are supported")
            return _checked_path(pathlib.Path(urllib.parse.unquote(parsed.path)))
        return _checked_path(pathlib.Path(source))
    raise MediaError(f"cannot load a video from a {type(source).__name__}; pass bytes, a file path, a "
                     "file:// URL, a data:video/...;base64 URL or a list of frames")


def _checked_path(path: pathlib.Path) -> str:
    if not path.is_file():
        raise MediaError(f"video file not found: {str(path)!r}")
    if path.stat().st_size == 0:
        raise MediaError(f"video file {str(path)!r} is empty (0 bytes)")
    return str(path)


def decode_video_data_url(url: str) -> bytes:
    """Bytes of a `data:video/<format>;base64,<payload>` URL."""
    return decode_data_url(url, ("video/",), "a video")


def _container_info(container, source: Any) -> VideoInfo:
    if not container.streams.video:
        raise MediaError("the file has no video stream")
    stream = container.streams.video[0]
    try:
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        width, height = stream.width, stream.height
    except AttributeError as exc:  # PyAV gives a stream without a codec context no size
        raise MediaError(f"the video stream has no readable header ({exc}); the file is "
                         "corrupt") from exc
    num_frames = stream.frames or _count_packets(container, stream)
    if num_frames <= 0 or fps <= 0 or not width or not height:
        raise MediaError(f"the video stream has {num_frames} frames at {fps:g} fps, "
                         f"{width}x{height}: it is empty or corrupt")
    return VideoInfo(num_frames, fps, width, height)


def _count_packets(container, stream) -> int:
    """Frame count of containers whose header lacks it (WebM, MKV): demux only, no decode."""
    import av

    try:
        return sum(1 for packet in container.demux(stream) if packet.size)
    except av.FFmpegError as exc:
        raise MediaError(f"the video is corrupt ({exc})") from exc


def _decode_frames(source: Any, info: VideoInfo,
                   indices: list[int]) -> tuple[list[np.ndarray], list[float]]:
    wanted = iter(indices)
    next_index = next(wanted)
    frames, timestamps, start = [], [], None
    for index, frame in enumerate(_iter_frames(source)):
        start = frame.time if start is None and frame.time is not None else start
        if index == next_index and (frame.width, frame.height) != (info.width, info.height):
            # Frames are checked against the header's pixel limit: none may outgrow it.
            raise MediaError(f"video frame {index} is {frame.width}x{frame.height} but the "
                             f"header says {info.width}x{info.height}: the file is corrupt")
        while index == next_index:
            frames.append(frame.to_ndarray(format="rgb24"))  # (H, W, 3) uint8
            seconds = (frame.time - start) if frame.time is not None else index / info.fps
            timestamps.append(round(seconds, 6))
            next_index = next(wanted, None)
        if next_index is None:
            return frames, timestamps
    raise MediaError(f"the video stream ended after {len(frames)} of the sampled frames; the header "
                     f"promised {info.num_frames} frames: the file is truncated or corrupt")


def _iter_frames(source: Any) -> Iterator:
    import av

    with _open_container(source) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        try:
            yield from container.decode(stream)
        except av.FFmpegError as exc:
            raise MediaError(f"could not decode the video ({exc}); the file is corrupt") from exc
