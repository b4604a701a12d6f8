"""OCR stage: RapidOCR with the PP-OCR ONNX models its wheel ships (no download).

Lines come back in reading order: grouped into rows by vertical overlap,
rows top to bottom, lines in a row left to right. The recognizer already
batches the text lines of one image; `max_batch_size` only saves round trips.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from foveal.multimodal.media.image import load_image
from foveal.stages.base import Stage


@dataclass(frozen=True)
class OcrOptions:
    min_confidence: float = 0.5
    classify_orientation: bool = False  # rotated-line classifier: slower, only for rotated scans
    num_threads: int = 0  # onnxruntime intra-op threads; 0: the library default
    max_image_pixels: int = 50_000_000


@dataclass(frozen=True)
class OcrItem:
    content: bytes  # an encoded image (PNG, JPEG, ...)


@dataclass(frozen=True)
class OcrLine:
    text: str
    box: tuple[float, float, float, float]  # left, top, right, bottom in pixels
    confidence: float


@dataclass(frozen=True)
class OcrResult:
    lines: list[OcrLine] = field(default_factory=list)

    @property
    def text(self) -> str:
        """Rows joined by newlines, lines within a row by spaces."""
        return "\n".join(" ".join(line.text for line in row) for row in reading_rows(self.lines))


class OcrStage(Stage):
    name = "ocr"
    item_type = OcrItem
    result_type = OcrResult
    options_type = OcrOptions
    max_batch_size = 4

    def load(self) -> None:
        from rapidocr import RapidOCR

        params = {"Global.log_level": "warning", "Global.use_cls": self.options.classify_orientation,
                  "Global.text_score": self.options.min_confidence}
        if self.options.num_threads:
            params["EngineConfig.onnxruntime.intra_op_num_threads"] = self.options.num_threads
        self.engine = RapidOCR(params=params)

    def process(self, item: OcrItem) -> OcrResult:
        image = load_image(item.content, self.options.max_image_pixels)
        output = self.engine(image)
        if output.boxes is None:
            return OcrResult()
        lines = [OcrLine(text=text, box=_bounding_box(quad), confidence=round(float(score), 4))
                 for quad, text, score in zip(output.boxes, output.txts, output.scores)]
        return OcrResult(lines=[line for row in reading_rows(lines) for line in row])


def _bounding_box(quad) -> tuple[float, float, float, float]:
    points = np.asarray(quad, dtype=np.float64)  # (4, 2) corners
    left, top = points.min(axis=0)
    right, bottom = points.max(axis=0)
    return (float(left), float(top), float(right), float(bottom))


def reading_rows(lines: list[OcrLine]) -> list[list[OcrLine]]:
    """Lines grouped into rows (a line joins a row its vertical centre falls inside),
    rows top to bottom, each row left to right."""
    rows: list[list[OcrLine]] = []
    for line in sorted(lines, key=lambda line: line.box[1]):
        centre = (line.box[1] + line.box[3]) / 2
        row = rows[-1] if rows else None
        if row and min(l.box[1] for l in row) <= centre <= max(l.box[3] for l in row):
            row.append(line)
        else:
            rows.append([line])
    return [sorted(row, key=lambda line: line.box[0]) for row in rows]
