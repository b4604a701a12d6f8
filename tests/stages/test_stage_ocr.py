"""OCR stage: scanned PDF pages and images, read in reading order."""
from __future__ import annotations

import base64
import io

from PIL import Image
from stage_documents import edit_distance, make_scanned_pdf

from foveal.stages.assembly import expand_preprocessed_parts_sync
from foveal.stages.ocr import OcrLine, reading_rows

SCANNED_LINES = ["Invoice 4821, dated March 3", "Total due: 129.50 EUR", "Ship to Maple Street 17, Springfield"]


def _pdf_part(data: bytes) -> dict:
    return {"type": "file", "file": {"file_data": "data:application/pdf;base64," + base64.b64encode(data).decode(),
                                     "filename": "scan.pdf"}}


def _cer(reference: str, hypothesis: str) -> float:
    reference, hypothesis = " ".join(reference.split()), " ".join(hypothesis.split())
    return edit_distance(list(reference), list(hypothesis)) / len(reference)


def test_scanned_pdf_page_gives_its_image_and_ocr_text_within_5_percent_cer(real_stages):
    messages = [{"role": "user", "content": [_pdf_part(make_scanned_pdf(SCANNED_LINES))]}]
    parts = expand_preprocessed_parts_sync(messages, real_stages)[0]["content"]
    texts = [p["text"] for p in parts if p["type"] == "text"]
    assert texts[0] == '[PDF "scan.pdf", 1 pages]\n'
    assert texts[1] == '[PDF "scan.pdf" page 1 image]\n'
    assert [p["type"] for p in parts].count("image_url") == 1
    ocr_text = next(t for t in texts if t.startswith('[OCR of "scan.pdf" page 1]\n'))
    hypothesis = ocr_text.split("\n", 1)[1]
    cer = _cer("\n".join(SCANNED_LINES), hypothesis)
    print(f"OCR CER on the scanned page: {cer:.4f} ({hypothesis!r})")
    assert cer <= 0.05
    assert hypothesis.index("Invoice") < hypothesis.index("Total") < hypothesis.index("Ship")


def test_ocr_off_keeps_the_page_image_without_ocr_text(real_stages):
    messages = [{"role": "user", "content": [_pdf_part(make_scanned_pdf(SCANNED_LINES))]}]
    parts = expand_preprocessed_parts_sync(messages, real_stages, {"ocr": "off"})[0]["content"]
    assert [p["type"] for p in parts] == ["text", "text", "image_url"]
    assert not any("[OCR of" in p.get("text", "") for p in parts)


def test_ocr_on_reads_an_image_part(real_stages):
    page = Image.open(io.BytesIO(_first_page_png(make_scanned_pdf(SCANNED_LINES[:1]))))
    png = io.BytesIO()
    page.save(png, format="PNG")
    image_part = {"type": "image_url",
                  "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}}
    messages = [{"role": "user", "content": [image_part, {"type": "text", "text": "What is the invoice?"}]}]
    parts = expand_preprocessed_parts_sync(messages, real_stages, {"ocr": "on"})[0]["content"]
    assert parts[0] == image_part and parts[2]["text"] == "What is the invoice?"
    assert parts[1]["text"].startswith("[OCR of image 1]\n")
    assert _cer(SCANNED_LINES[0], parts[1]["text"].split("\n", 1)[1]) <= 0.05


def _first_page_png(data: bytes) -> bytes:
    from foveal.stages.pdf import PdfItem, PdfStage

    return PdfStage().process(PdfItem(data, render="all", max_pixels_per_page=200_000)).pages[0].image_png


def test_reading_order_is_rows_top_to_bottom_then_left_to_right():
    def line(text, left, top):
        return OcrLine(text, (left, top, left + 50, top + 20), 0.9)

    lines = [line("right", 300, 12), line("below", 10, 60), line("left", 10, 10), line("middle", 150, 8)]
    rows = reading_rows(lines)
    assert [[l.text for l in row] for row in rows] == [["left", "middle", "right"], ["below"]]
