"""MP4 clips for the video-transcript tests, made in the test: frames plus an AAC
audio track of speech (espeak-ng), of silence, or no audio track at all."""
from __future__ import annotations

import io
import shutil
import subprocess
import wave

import av
import numpy as np
import pytest

FPS = 4
SIZE = 56  # frame side in pixels: a few visual tokens on the tiny checkpoints


def espeak_samples(text: str, path) -> tuple[np.ndarray, int]:
    """(num_samples,) float32 mono speech of `text` and its sample rate."""
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        pytest.fail("espeak-ng is not installed; the speech tests need it: apt-get install -y espeak-ng")
    subprocess.run([espeak, "-s", "150", "-w", str(path), text], check=True)
    with wave.open(str(path), "rb") as speech:
        pcm = np.frombuffer(speech.readframes(speech.getnframes()), "<i2")
        return pcm.astype(np.float32) / 32768, speech.getframerate()


def make_clip(seconds: float, audio: np.ndarray | None = None, sample_rate: int = 16000) -> bytes:
    """An MP4 of `seconds` of moving grey frames, with `audio` as its AAC track."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as out:
        video = out.add_stream("mpeg4", rate=FPS)
        video.width, video.height, video.pix_fmt = SIZE, SIZE, "yuv420p"
        track = out.add_stream("aac", rate=sample_rate) if audio is not None else None
        for index in range(max(2, round(seconds * FPS))):
            pixels = np.full((SIZE, SIZE, 3), 30 * index % 256, np.uint8)
            out.mux(video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        out.mux(video.encode())
        if track is not None:
            for start in range(0, len(audio), 1024):
                chunk = np.ascontiguousarray(audio[None, start:start + 1024], np.float32)  # (1, n)
                frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="mono")
                frame.sample_rate = sample_rate
                out.mux(track.encode(frame))
            out.mux(track.encode())
    return buffer.getvalue()


def speech_clip(text: str, tmp_path) -> bytes:
    samples, rate = espeak_samples(text, tmp_path / "speech.wav")
    return make_clip(len(samples) / rate, samples, rate)


def silent_clip(seconds: float = 1.5) -> bytes:
    return make_clip(seconds, np.zeros(int(16000 * seconds), np.float32))


def mute_clip(seconds: float = 1.5) -> bytes:
    """No audio track at all."""
    return make_clip(seconds)
