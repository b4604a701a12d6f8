"""The seeded request mix of `foveal bench soak`: request i is a function of
(seed, i) only, so two runs with the same seed send the same requests.

Good requests carry images (1-2 PNG data URLs), a short mp4 clip, a PDF (`file`
part) or a WAV tone (`input_audio` part), streamed or not; a share of them is
cancelled (the client closes the connection mid-stream, or mid-request when not
streaming); a share is bad input that must come back as a 4xx. Media contents
come from a bounded pool (`distinct_media`), so repeats exercise the caches'
hit paths while the caches stay bounded.
"""
from __future__ import annotations

import base64
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from foveal.bench.clip import ClipSpec, write_clip
from foveal.bench.serve import PROMPT_WORDS, png_data_url
from foveal.errors import ConfigError
from foveal.multimodal.media.audio import SAMPLE_RATE, encode_wav

GOOD_KINDS = ("image", "video", "pdf", "audio")
BAD_KINDS = ("corrupt_image", "bad_base64", "unknown_model", "invalid_temperature",
             "too_many_images", "corrupt_audio", "corrupt_pdf")
_NUM_CLIPS = 4  # distinct clips, encoded once per run
_CANCEL_MAX_TOKENS = 256  # long enough that a cancel lands mid-answer


@dataclass(frozen=True)
class MixSpec:
    seed: int = 0
    cancel_share: float = 0.1
    bad_share: float = 0.1
    stream_share: float = 0.5
    distinct_media: int = 64  # contents per kind; repeats hit the caches
    image_limit: int = 8  # the server's --limit-mm-per-prompt image; one more is bad input
    max_tokens: int = 16

    def __post_init__(self) -> None:
        shares = (self.cancel_share, self.bad_share, self.stream_share)
        if min(shares) < 0 or max(shares) > 1 or self.cancel_share + self.bad_share > 1:
            raise ConfigError(f"--cancel-share {self.cancel_share} and --bad-share "
                              f"{self.bad_share} must be in [0, 1] with a sum <= 1; "
                              f"--stream-share {self.stream_share} in [0, 1]")
        if self.distinct_media < 1 or self.image_limit < 0 or self.max_tokens < 1:
            raise ConfigError("--distinct-media and --max-tokens must be >= 1, "
                              "--image-limit >= 0")


@dataclass
class SoakRequest:
    index: int
    kind: str  # a GOOD_KINDS or BAD_KINDS entry
    stream: bool
    body: dict  # the chat completion body, "model" unset for the sender to fill
    cancel_after: float | None = None  # seconds, non-streamed cancels
    cancel_after_chunks: int | None = None  # content chunks, streamed cancels

    @property
    def is_bad(self) -> bool:
        return self.kind in BAD_KINDS

    @property
    def is_cancel(self) -> bool:
        return self.cancel_after is not None or self.cancel_after_chunks is not None


class RequestMix:
    """request(i): the i-th request of the run. Clips are encoded on creation."""

    def __init__(self, spec: MixSpec) -> None:
        self.spec = spec
        with tempfile.TemporaryDirectory(prefix="foveal-soak-") as folder:
            self._clips = [write_clip(ClipSpec(1.0, 64, 48, 4, seed), Path(folder) / f"{seed}.mp4")
                           .read_bytes() for seed in range(_NUM_CLIPS)]

    def request(self, index: int) -> SoakRequest:
        rng = random.Random(f"{self.spec.seed}:{index}")
        stream = rng.random() < self.spec.stream_share
        draw = rng.random()
        if draw < self.spec.bad_share:
            kind = rng.choice(BAD_KINDS)
            return SoakRequest(index, kind, stream, self._bad_body(kind, rng))
        kind = rng.choice(GOOD_KINDS)
        body = {"messages": [{"role": "user", "content": self._parts(kind, rng)}],
                "max_tokens": rng.randint(2, self.spec.max_tokens),
                "temperature": rng.choice((0.0, 0.8)), "seed": rng.randrange(1 << 16)}
        request = SoakRequest(index, kind, stream, body)
        if draw < self.spec.bad_share + self.spec.cancel_share:
            body.update(max_tokens=_CANCEL_MAX_TOKENS, ignore_eos=True)
            if stream:
                request.cancel_after_chunks = rng.randint(1, 4)
            else:
                request.cancel_after = rng.uniform(0.05, 1.0)
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return request

    def _parts(self, kind: str, rng: random.Random) -> list[dict]:
        words = " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(3, 12)))
        if kind == "image":
            media = [_image_part(self._media_seed(rng)) for _ in range(rng.randint(1, 2))]
        elif kind == "video":
            clip = base64.b64encode(self._clips[rng.randrange(_NUM_CLIPS)]).decode()
            media = [{"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{clip}"}}]
        elif kind == "pdf":
            media = [_pdf_part(_seeded_pdf(self._media_seed(rng)))]
        else:
            media = [_audio_part(tone_wav(self._media_seed(rng)))]
        return [*media, {"type": "text", "text": words}]

    def _media_seed(self, rng: random.Random) -> int:
        return rng.randrange(self.spec.distinct_media)

    def _bad_body(self, kind: str, rng: random.Random) -> dict:
        text = {"type": "text", "text": "what is this"}
        parts = [text]
        body: dict = {"max_tokens": 4}
        if kind == "corrupt_image":
            junk = b"\x89PNG\r\n\x1a\n" + rng.randbytes(200)
            parts = [{"type": "image_url", "image_url": {
                "url": "data:image/png;base64," + base64.b64encode(junk).decode()}}, text]
        elif kind == "bad_base64":
            parts = [{"type": "image_url", "image_url": {
                "url": "data:image/png;base64,@@not*base64@@"}}, text]
        elif kind == "unknown_model":
            body["model"] = "soak-no-such-model"
        elif kind == "invalid_temperature":
            body["temperature"] = -1.0
        elif kind == "too_many_images":
            parts = [_image_part(0, side=8)] * (self.spec.image_limit + 1) + [text]
        elif kind == "corrupt_audio":
            parts = [_audio_part(b"RIFF" + rng.randbytes(200)), text]
        elif kind == "corrupt_pdf":
            parts = [_pdf_part(b"%PDF-1.4\n" + rng.randbytes(200)), text]
        return {**body, "messages": [{"role": "user", "content": parts}]}


def _image_part(seed: int, side: int | None = None) -> dict:
    rng = np.random.default_rng(seed)
    width, height = (side, side) if side else rng.integers(32, 160, size=2)
    pixels = rng.integers(0, 256, size=(int(height), int(width), 3), dtype=np.uint8)
    return {"type": "image_url", "image_url": {"url": png_data_url(pixels)}}


def _seeded_pdf(seed: int) -> bytes:
    words = random.Random(seed).choices(PROMPT_WORDS, k=8)
    return text_pdf(f"Soak page {seed}: {' '.join(words)}.")


def _pdf_part(content: bytes) -> dict:
    data = base64.b64encode(content).decode()
    return {"type": "file", "file": {"file_data": f"data:application/pdf;base64,{data}",
                                     "filename": "soak.pdf"}}


def _audio_part(content: bytes) -> dict:
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(content).decode(), "format": "wav"}}


def tone_wav(seed: int, seconds: float = 1.0) -> bytes:
    """A sine tone (200-1000 Hz by seed) as a 16 kHz WAV: speech-free but not silent."""
    frequency = 200.0 + 800.0 * random.Random(seed).random()
    t = np.arange(int(SAMPLE_RATE * seconds), dtype=np.float32) / SAMPLE_RATE
    return encode_wav(0.3 * np.sin(2 * np.pi * frequency * t))


def text_pdf(line: str) -> bytes:
    """A one-page PDF whose text layer is `line` (Helvetica; ASCII without parentheses)."""
    text = line.replace("\\", "").replace("(", "").replace(")", "")
    stream = f"BT /F1 12 Tf 10 40 Td ({text}) Tj ET".encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               (b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 100] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>"),
               b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream),
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1,
                                                                              xref)
    return bytes(out)
