"""Decode audio in any format PyAV reads into 16 kHz mono float32 samples.

Sources: raw bytes, a filesystem path, a `file://` URL or a base64
`data:audio/...` URL. `read_media_bytes` is the byte-level half, shared with
the PDF loader: it turns any of those sources into the file's bytes.
`encode_wav` goes the other way, for samples sent to a speech model.

The duration limit is checked while decoding, so a long recording fails as
soon as it passes the limit instead of after the whole file is in memory.
"""
from __future__ import annotations

import io
import pathlib
import urllib.parse
import wave

import numpy as np

from foveal.errors import MediaError, MediaLimitError
from foveal.multimodal.media.data_url import decode_data_url, read_media_file

SAMPLE_RATE = 16_000

MediaSource = bytes | bytearray | memoryview | pathlib.Path | str


def load_audio(source: MediaSource, max_duration_s: float | None = None) -> np.ndarray:
    """Return the first audio stream of `source` as float32 mono samples at 16 kHz, shape (N,)."""
    data = read_media_bytes(source, ("audio/", "video/", "application/octet-stream"), "audio")
    return decode_audio(data, max_duration_s)


def decode_audio(data: bytes, max_duration_s: float | None = None) -> np.ndarray:
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError) as exc:
        raise MediaError(
            f"could not open {len(data)} bytes as audio ({exc}); send WAV, MP3, FLAC, OGG, "
            "M4A or WebM") from exc
    with container:
        if not container.streams.audio:
            raise MediaError("the file has no audio stream")
        try:
            chunks, _ = resample_audio_stream(container, max_duration_s)
        except av.FFmpegError as exc:
            raise MediaError(f"could not decode the audio ({exc}); the file is corrupt or truncated") from exc
    if not chunks:
        raise MediaError("the audio stream holds no samples")
    return np.concatenate(chunks).astype(np.float32, copy=False)


def encode_wav(samples: np.ndarray) -> bytes:
    """16 kHz mono float32 samples, shape (N,) -> a 16-bit PCM WAV file (speech needs no more)."""
    pcm = (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        out.writeframes(pcm.tobytes())
    return buffer.getvalue()


_AUDIO_LIMIT_HINT = "--max-audio-seconds, or the asr stage option max_duration_s"


def resample_audio_stream(container, max_duration_s: float | None,
                          limit_hint: str = _AUDIO_LIMIT_HINT) -> tuple[list[np.ndarray], float]:
    """Decode the container's first audio stream packet by packet to 16 kHz mono
    float32 chunks, keeping only resampled samples. Returns (chunks, the first
    frame's time in seconds). Raises av.FFmpegError for the caller to word."""
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
    max_samples = None if max_duration_s is None else int(max_duration_s * SAMPLE_RATE)
    chunks: list[np.ndarray] = []
    num_samples, start = 0, None
    for frame in [*container.decode(container.streams.audio[0]), None]:  # None flushes
        if frame is not None and start is None:
            start = frame.time
        for out in resampler.resample(frame):
            chunk = out.to_ndarray().reshape(-1)  # (1, n) packed mono -> (n,)
            chunks.append(chunk)
            num_samples += chunk.size
            if max_samples is not None and num_samples > max_samples:
                raise MediaLimitError(
                    f"audio is longer than {max_duration_s:.0f} s; the limit is "
                    f"{max_duration_s:.0f} s ({limit_hint}); send a shorter clip")
    return chunks, float(start or 0.0)


def read_media_bytes(source: MediaSource, mime_prefixes: tuple[str, ...], kind: str) -> bytes:
    """The bytes of a media file given as bytes, a path, a file:// URL or a base64 data URL."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, pathlib.Path):
        return read_media_file(source, kind)
    if not isinstance(source, str):
        raise MediaError(
            f"cannot load {kind} from a {type(source).__name__}; pass bytes, a file path, "
            f"a file:// URL or a base64 data URL")
    scheme = source.split(":", 1)[0].lower() if ":" in source else ""
    if scheme == "data":
        return decode_data_url(source, mime_prefixes, kind)
    if scheme == "file":
        parsed = urllib.parse.urlparse(source)
        if parsed.netloc not in ("", "localhost"):
            raise MediaError(f"file URL names host {parsed.netloc!r}; only local files are supported")
        return read_media_file(pathlib.Path(urllib.parse.unquote(parsed.path)), kind)
    if scheme in ("http", "https"):
        raise MediaError(f"http(s) {kind} URLs are fetched by the server; pass bytes, a path or a data URL")
    return read_media_file(pathlib.Path(source), kind)
