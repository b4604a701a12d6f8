"""Speech-to-text as a pluggable stage: the `Transcriber` protocol and its registry.

A video's transcript, marked with its source and timestamps, goes right
after the video in the prompt. By default the engine's "asr" stage makes it
(`foveal.stages.assembly.video_transcripts`); an LLM configured with
`mm_processor_kwargs={"transcriber": NAME}` runs that registered transcriber
in the input processor instead. Built-in names are "module:attr" entries,
imported on first use, so no import order matters; `register_transcriber`
also takes test doubles.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Union

import numpy as np

from foveal.errors import ConfigError
from foveal.lazy_import import resolve


@dataclass(frozen=True)
class TranscriptSegment:
    start: float  # seconds from the start of the audio
    end: float
    text: str


class Transcriber(Protocol):
    name: str

    def transcribe(self, samples: np.ndarray, sample_rate: int) -> list[TranscriptSegment]:
        """(num_samples,) float32 mono samples -> segments in time order."""


TranscriberFactory = Union[Callable[[], Transcriber], str]
_TRANSCRIBERS: dict[str, TranscriberFactory] = {
    "whisper": "foveal.stages.asr:WhisperTranscriber",  # faster-whisper in this process
}


def register_transcriber(name: str, factory: TranscriberFactory) -> None:
    """factory: a callable returning a Transcriber, or "package.module:attr" naming one."""
    _TRANSCRIBERS[name] = factory


def get_transcriber(name: str) -> Transcriber:
    if name not in _TRANSCRIBERS:
        raise ConfigError(f"no transcriber named {name!r}; registered: {sorted(_TRANSCRIBERS)}")
    factory = _TRANSCRIBERS[name]
    if isinstance(factory, str):
        factory = resolve(factory)
    return factory()


def format_transcript(segments: list[TranscriptSegment], source: str, offset: float = 0.0) -> str:
    """The text put into the prompt, e.g.
    "\\n[Transcript of video 1 audio (asr: whisper)]\\n[0.0s-2.5s] hello\\n"."""
    lines = [f"[{s.start + offset:.1f}s-{s.end + offset:.1f}s] {s.text.strip()}" for s in segments]
    return "\n" + "\n".join([f"[Transcript of {source}]", *lines]) + "\n"


def video_transcript(segments: list[TranscriptSegment], video_number: int, asr_name: str) -> str | None:
    """The marked transcript of a video's audio track; None when nothing was said."""
    if not segments:
        return None
    return format_transcript(segments, f"video {video_number} audio (asr: {asr_name})")


def transcribe_video(transcriber: Transcriber, video_source, video_number: int) -> str | None:
    """The marked transcript of one video's audio track, or None if it has no audio."""
    from foveal.multimodal.media.audio_track import extract_audio

    track = extract_audio(video_source)
    if track is None or not len(track.samples):
        return None
    segments = transcriber.transcribe(track.samples, track.sample_rate)
    return video_transcript(segments, video_number, transcriber.name)


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
