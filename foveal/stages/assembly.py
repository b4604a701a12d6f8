"""Prompt assembly: PDFs and audio in OpenAI-style messages become text (and page images).

Call `expand_preprocessed_parts(messages, stages, options)` on chat messages
BEFORE chat parsing. It returns new messages in which

- a `file` part ({"type": "file", "file": {"file_data": "data:application/pdf;base64,...",
  "filename": "report.pdf"}}) becomes, per page:
    `[PDF page 2 text]` + the page's text layer, when the mode wants text;
    `[PDF page 3 image]` + an `image_url` part (PNG data URL), when the mode wants
    the image and `allow_images` is set;
    `[OCR of page 3]` + the OCR text of the rendered page, when OCR applies.
  A PDF with a filename says so: `[PDF "report.pdf" page 2 text]`.
- an `input_audio` part ({"data": base64, "format": "wav"}) becomes one text part of
  `[Transcript of audio 00:00-00:05] ...` lines, one per segment ("audio 2" when the
  messages hold several clips).
- an image part is kept; with ocr="on" a `[OCR of image 1]` text part follows it.

Videos' audio tracks go through the same "asr" stage (`video_transcripts`): the
input processor extracts each track (`InputProcessor.video_speech`), the stage
transcribes it, and the marked transcript goes right after its video.

Options (`PreprocessOptions`, or a dict of its fields; defaults need no flags):
  pdf_mode  text | image | both | auto (default). auto: a page with a text layer gives
            its text, a page without one (a scan) gives its image and its OCR text.
  ocr       on | off | auto (default). auto: OCR only pages with no text layer;
            on: also every rendered page and every image; off: never.
  transcribe_audio  default true; false makes an audio part an error (the model has no ears)
            and keeps videos' audio tracks out of the prompt.
  allow_images      default true; false keeps page images out (OCR text still comes).
  max_pixels_per_page, pdf_pages ("1-3,7"): passed to the PDF stage.

All stage work of one request (every PDF, every page's OCR, every clip) runs
concurrently through `StagePools`, and stays cached by content hash.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
from typing import Any, Mapping, Sequence

from foveal.errors import InvalidRequestError
from foveal.multimodal.media.audio import read_media_bytes
from foveal.multimodal.media.data_url import decode_base64
from foveal.multimodal.media.image import load_image
from foveal.multimodal.media.pdf import encode_png
from foveal.multimodal.transcriber import TranscriptSegment, video_transcript
from foveal.stages.asr import ASR_NAME, AsrItem
from foveal.stages.ocr import OcrItem
from foveal.stages.pdf import PdfItem, PdfPage

PDF_MODES = ("text", "image", "both", "auto")
OCR_MODES = ("on", "off", "auto")
_IMAGE_PARTS = ("image_url", "image", "image_pil")


@dataclasses.dataclass(frozen=True)
class PreprocessOptions:
    pdf_mode: str = "auto"
    ocr: str = "auto"
    transcribe_audio: bool = True
    allow_images: bool = True
    max_pixels_per_page: int | None = None
    pdf_pages: str | None = None
    max_image_pixels: int = 50_000_000

    def __post_init__(self) -> None:
        if self.pdf_mode not in PDF_MODES:
            raise InvalidRequestError(f"pdf_mode={self.pdf_mode!r}; use one of {PDF_MODES}")
        if self.ocr not in OCR_MODES:
            raise InvalidRequestError(f"ocr={self.ocr!r}; use one of {OCR_MODES}")

    @classmethod
    def from_request(cls, options: Mapping[str, Any] | None) -> "PreprocessOptions":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options or {}) - known)
        if unknown:
            raise InvalidRequestError(f"unknown preprocessing option(s) {unknown}; accepted: {sorted(known)}")
        return cls(**(options or {}))


async def expand_preprocessed_parts(messages: list[dict], stages, options=None) -> list[dict]:
    """New messages with file/input_audio parts expanded (see the module docstring)."""
    if not isinstance(options, PreprocessOptions):
        options = PreprocessOptions.from_request(options)
    expander = _Expander(stages, options, _count_audio(messages))
    expanded = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            expanded.append(message)
            continue
        groups = await asyncio.gather(*(expander.expand(part) for part in content))
        expanded.append({**message, "content": [part for group in groups for part in group]})
    return expanded


def expand_preprocessed_parts_sync(messages: list[dict], stages, options=None) -> list[dict]:
    """Blocking form for callers with no event loop running (e.g. `LLM.chat`)."""
    return asyncio.run(expand_preprocessed_parts(messages, stages, options))


def _count_audio(messages: list[dict]) -> int:
    return sum(1 for message in messages if isinstance(message, dict)
               and isinstance(message.get("content"), list)
               for part in message["content"] if isinstance(part, dict)
               and part.get("type") == "input_audio")


def _text(text: str) -> dict:
    return {"type": "text", "text": text + "\n"}


class _Expander:
    def __init__(self, stages, options: PreprocessOptions, num_audio: int) -> None:
        self.stages, self.options, self.num_audio = stages, options, num_audio
        self.counts = {"audio": 0, "image": 0}

    def expand(self, part: Any):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "file":
            return self._pdf(part.get("file") or {})
        if kind == "input_audio":
            self.counts["audio"] += 1
            return self._audio(part.get("input_audio") or {}, self.counts["audio"])
        if kind in _IMAGE_PARTS and self.options.ocr == "on":
            self.counts["image"] += 1
            return self._image_with_ocr(part, self.counts["image"])
        return _unchanged(part)

    async def _pdf(self, file: Mapping) -> list[dict]:
        if "file_data" not in file:
            raise InvalidRequestError("a file part needs file_data: 'data:application/pdf;base64,...' "
                                      "(file_id references are not supported)")
        data = read_media_bytes(file["file_data"], ("application/pdf", "application/octet-stream"), "PDF")
        label = f'"{file["filename"]}"' if file.get("filename") else ""
        item = PdfItem(data, pages=self.options.pdf_pages, render=self._render_mode(),
                       max_pixels_per_page=self.options.max_pixels_per_page)
        result = await self.stages.run("pdf", item)
        header = _text(f"[PDF {label + ', ' if label else ''}{result.num_pages} pages]")
        pages = await asyncio.gather(*(self._page(page, label) for page in result.pages))
        return [header, *(part for parts in pages for part in parts)]

    def _render_mode(self) -> str:
        if self.options.ocr == "on" or self.options.pdf_mode in ("image", "both"):
            return "all"
        if self.options.pdf_mode == "text" and self.options.ocr == "off":
            return "none"
        return "auto"

    async def _page(self, page: PdfPage, label: str) -> list[dict]:
        mode, source = self.options.pdf_mode, f"{label + ' ' if label else ''}page {page.number}"
        parts = []
        if page.has_text_layer and mode != "image":
            parts.append(_text(f"[PDF {source} text]\n{page.text}"))
        wants_image = mode in ("image", "both") or (mode == "auto" and not page.has_text_layer)
        if page.image_png and wants_image and self.options.allow_images:
            parts += [_text(f"[PDF {source} image]"), _png_part(page.image_png)]
        ocr = self.options.ocr == "on" or (self.options.ocr == "auto" and not page.has_text_layer)
        if page.image_png and ocr:
            result = await self.stages.run("ocr", OcrItem(page.image_png))
            parts.append(_text(f"[OCR of {source}]\n{result.text}"))
        return parts

    async def _audio(self, audio: Mapping, index: int) -> list[dict]:
        if not self.options.transcribe_audio:
            raise InvalidRequestError("the model cannot take audio; set transcribe_audio=true to send "
                                      "its transcript instead, or remove the input_audio part")
        if "data" not in audio:
            raise InvalidRequestError("an input_audio part needs {'data': <base64>, 'format': 'wav'}")
        segments = await transcribe(self.stages, decode_base64(audio["data"], "audio"))
        name = "audio" if self.num_audio == 1 else f"audio {index}"
        if not segments:
            return [_text(f"[Transcript of {name}: no speech]")]
        lines = [f"[Transcript of {name} {_clock(s.start)}-{_clock(s.end)}] {s.text}" for s in segments]
        return [_text("\n".join(lines))]

    async def _image_with_ocr(self, part: dict, index: int) -> list[dict]:
        image = load_image(_image_source(part), self.options.max_image_pixels)
        result = await self.stages.run("ocr", OcrItem(encode_png(image)))
        return [part, _text(f"[OCR of image {index}]\n{result.text}")]


async def transcribe(stages, audio: bytes | None) -> list[TranscriptSegment]:
    """Segments of an encoded audio file from the "asr" stage; none for no audio."""
    if audio is None:
        return []
    return (await stages.run("asr", AsrItem(audio))).segments


async def video_transcripts(stages, speech: Sequence[bytes | None]) -> list[str | None]:
    """The marked transcript of each video's audio track (from
    `InputProcessor.video_speech`), or None where it holds no speech. All tracks
    go to the stage at once; its cache answers a track heard before."""
    segments = await asyncio.gather(*(transcribe(stages, audio) for audio in speech))
    return [video_transcript(found, number, ASR_NAME) for number, found in enumerate(segments, 1)]


def video_transcripts_sync(stages, speech: Sequence[bytes | None]) -> list[str | None]:
    """Blocking form for callers with no event loop running (e.g. `LLM.generate`)."""
    return asyncio.run(video_transcripts(stages, speech))


async def _unchanged(part: Any) -> list:
    return [part]


def _image_source(part: dict) -> Any:
    value = part.get(part["type"])
    return value.get("url") if isinstance(value, dict) else value


def _png_part(png: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    return {"type": "image_url", "image_url": {"url": url}}


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


_STAGE_PARTS = ("file", "input_audio")
PREPROCESS_OPTION_KEYS = frozenset(f.name for f in dataclasses.fields(PreprocessOptions))
# Options the input processor reads too: transcribe_audio also covers videos' audio tracks.
_SHARED_OPTION_KEYS = frozenset({"transcribe_audio"})


def split_preprocess_options(kwargs: Mapping[str, Any] | None) -> tuple[dict, dict]:
    """Per-request mm_processor_kwargs -> (preprocessing options, model processor kwargs)."""
    kwargs = dict(kwargs or {})
    options = {key: value for key, value in kwargs.items() if key in PREPROCESS_OPTION_KEYS}
    processor_kwargs = {key: value for key, value in kwargs.items()
                        if key not in PREPROCESS_OPTION_KEYS or key in _SHARED_OPTION_KEYS}
    return options, processor_kwargs


def needs_stages(messages: list[dict], options: Mapping[str, Any]) -> bool:
    """True when the messages hold parts only stages can turn into prompt input
    (PDF files, audio), or OCR of images is asked for."""
    if options.get("ocr") == "on":
        return True
    return any(isinstance(part, dict) and part.get("type") in _STAGE_PARTS
               for message in messages if isinstance(message, dict)
               and isinstance(message.get("content"), list)
               for part in message["content"])
