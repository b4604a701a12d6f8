"""Extract a video's audio track as 16 kHz mono float32 samples (PyAV).

Speech-to-text models take 16 kHz mono; resampling here, once, lets every
transcriber stage share the same input. Decoding streams packet by packet;
only the resampled samples are kept (64 KB per second of audio).
`speech_wav` is what the engine sends to its speech-to-text stage: nothing
for a clip without an audio track or with a silent one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from foveal.errors import MediaError
from foveal.multimodal.media.audio import SAMPLE_RATE, encode_wav, resample_audio_stream

DEFAULT_MAX_SECONDS = 3600.0
# A track whose peak stays under -50 dBFS holds no speech; skipping it keeps the
# speech model from running (and from inventing words on silence).
SILENCE_PEAK = 10 ** (-50 / 20)


@dataclass(frozen=True)
class AudioTrack:
    samples: np.ndarray  # (num_samples,) float32 in [-1, 1], mono
    sample_rate: int
    start_time: float  # seconds of the first sample on the container's clock

    @property
    def duration(self) -> float:
        return len(self.samples) / self.sample_rate

    def timestamps(self) -> np.ndarray:
        """(num_samples,) float64 seconds of each sample from the track start."""
        return np.arange(len(self.samples)) / self.sample_rate

    @property
    def is_silent(self) -> bool:
        return not len(self.samples) or float(np.abs(self.samples).max()) < SILENCE_PEAK


def extract_audio(source: Any, max_seconds: float = DEFAULT_MAX_SECONDS) -> AudioTrack | None:
    """The first audio stream of `source` (any encoded video source that
    `foveal.multimodal.media.video` accepts), or None if it has none or the
    source is a list of frames."""
    import av

    from foveal.multimodal.media.video import _open_container, is_frame_source

    if is_frame_source(source):
        return None
    with _open_container(source) as container:
        if not container.streams.audio:
            return None
        try:
            chunks, start = resample_audio_stream(
                container, max_seconds, "mm_processor_kwargs transcribe_audio=false skips it")
        except av.FFmpegError as exc:
            raise MediaError(f"could not decode the video's audio track ({exc})") from exc
    samples = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    return AudioTrack(samples, SAMPLE_RATE, start)


def speech_wav(source: Any, max_seconds: float = DEFAULT_MAX_SECONDS) -> bytes | None:
    """The audio track of `source` as a 16 kHz mono WAV for a speech model; None
    when it has no audio track or the track is silent."""
    track = extract_audio(source, max_seconds)
    if track is None or track.is_silent:
        return None
    return encode_wav(track.samples)
