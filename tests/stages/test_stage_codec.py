"""Remote transport: real stage items, results and errors survive JSON unchanged."""
from __future__ import annotations

import json

from foveal.errors import MediaLimitError, StageError
from foveal.multimodal.transcriber import TranscriptSegment
from foveal.stages import codec
from foveal.stages.asr import AsrResult
from foveal.stages.ocr import OcrLine, OcrResult
from foveal.stages.pdf import PdfItem, PdfPage, PdfResult


def _round_trip(value):
    return codec.decode(type(value), json.loads(json.dumps(codec.encode(value))))


def test_stage_values_round_trip_through_json():
    values = [
        PdfItem(b"%PDF-\x00\xff", pages="1-2", max_pixels_per_page=1000),
        PdfResult(2, [PdfPage(1, "text"), PdfPage(2, "", image_png=b"\x89PNG", width=3, height=4)]),
        OcrResult([OcrLine("Total", (1.0, 2.0, 30.5, 12.0), 0.99)]),
        AsrResult([TranscriptSegment(0.0, 1.5, "hello")], duration_s=1.5),
    ]
    for value in values:
        assert _round_trip(value) == value


def test_errors_round_trip_as_their_foveal_type():
    error = codec.decode_error(codec.encode_error(MediaLimitError("PDF has 500 pages")))
    assert type(error) is MediaLimitError and str(error) == "PDF has 500 pages"
    assert type(codec.decode_error({"type": "SystemExit", "message": "x"})) is StageError
