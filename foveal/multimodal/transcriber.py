"""Speech-to-text as a pluggable stage: the `Transcriber` protocol and its registry.

The input processor calls a configured transcriber on a video's audio track
and places the transcript, marked with its source and timestamps, right after
the video in the prompt. Real speech models live in `foveal.stages` and
register here by name; `register_transcriber` also takes test doubles.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from foveal.errors import ConfigError


@dataclass(frozen=True)
class TranscriptSegment:
    start: float  # seconds from the start of the audio
    end: float
    text: str


class Transcriber(Protocol):
    name: str

    def transcribe(self, samples: np.ndarray, sample_rate: int) -> list[TranscriptSegment]:
        """(num_samples,) float32 mono samples -> segments in time order."""


_TRANSCRIBERS: dict[str, Callable[[], Transcriber]] = {}


def register_transcriber(name: str, factory: Callable[[], Transcriber]) -> None:
    _TRANSCRIBERS[name] = factory


def get_transcriber(name: str) -> Transcriber:
    if name not in _TRANSCRIBERS:
        raise ConfigError(f"no transcriber named {name!r}; registered: {sorted(_TRANSCRIBERS)}")
    return _TRANSCRIBERS[name]()


def format_transcript(segments: list[TranscriptSegment], source: str, offset: float = 0.0) -> str:
    """The text put into the prompt, e.g.
    "\\n[Transcript of video 1 audio (asr: whisper)]\\n[0.0s-2.5s] hello\\n"."""
    lines = [f"[{s.start + offset:.1f}s-{s.end + offset:.1f}s] {s.text.strip()}" for s in segments]
    return "\n" + "\n".join([f"[Transcript of {source}]", *lines]) + "\n"


def transcribe_video(transcriber: Transcriber, video_source, video_number: int) -> str | None:
    """The marked transcript of one video's audio track, or None if it has no audio."""
    from foveal.multimodal.media.audio_track import extract_audio

    track = extract_audio(video_source)
    if track is None or not len(track.samples):
        return None
    segments = transcriber.transcribe(track.samples, track.sample_rate)
    if not segments:
        return None
    return format_transcript(segments, f"video {video_number} audio (asr: {transcriber.name})")


def insert_transcripts(token_ids: list[int], transcripts: list[list[int]], video_token_id: int,
                       vision_end_token_id: int) -> list[int]:
    """Put transcripts[k] right after the k-th video placeholder (after its
    <|vision_end|> when one follows); empty transcripts insert nothing."""
    out: list[int] = []
    pending: list[int] | None = None
    remaining = iter(transcripts)
    for index, token_id in enumerate(token_ids):
        out.append(token_id)
        if token_id == video_token_id:
            pending = next(remaining, [])
            if index + 1 < len(token_ids) and token_ids[index + 1] == vision_end_token_id:
                continue
        if pending is not None:
            out.extend(pending)
            pending = None
    return out + (pending or [])
