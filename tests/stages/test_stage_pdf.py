"""PDF stage: text layer, rendering within a pixel budget, page ranges, bad and oversized PDFs."""
from __future__ import annotations

import base64
import io

import pytest
from stage_documents import make_scanned_pdf, make_text_pdf
from PIL import Image

from foveal.errors import InvalidRequestError, MediaError, MediaLimitError
from foveal.stages.assembly import expand_preprocessed_parts_sync
from foveal.stages.pdf import PdfItem, PdfStage

LINES = ["Quarterly report for the harbour office", "Revenue rose by nine percent"]


def _pdf_part(data: bytes, filename: str | None = "report.pdf") -> dict:
    file = {"file_data": "data:application/pdf;base64," + base64.b64encode(data).decode()}
    if filename:
        file["filename"] = filename
    return {"type": "file", "file": file}


def _texts(messages: list[dict]) -> str:
    return "".join(p["text"] for m in messages for p in m["content"] if p["type"] == "text")


def test_text_layer_pdf_text_reaches_the_assembled_prompt(real_stages):
    data = make_text_pdf([LINES, ["Second page says hello"]])
    messages = [{"role": "user", "content": [{"type": "text", "text": "Summarize."}, _pdf_part(data)]}]
    expanded = expand_preprocessed_parts_sync(messages, real_stages)
    text = _texts(expanded)
    assert '[PDF "report.pdf" page 1 text]\n' + "\n".join(LINES) in text
    assert '[PDF "report.pdf" page 2 text]\nSecond page says hello' in text
    assert text.startswith("Summarize.")
    assert not any(p["type"] == "image_url" for p in expanded[0]["content"])  # auto: text pages stay text


def test_pdf_mode_both_adds_page_images_as_data_urls(real_stages):
    messages = [{"role": "user", "content": [_pdf_part(make_text_pdf([LINES]), filename=None)]}]
    expanded = expand_preprocessed_parts_sync(messages, real_stages,
                                              {"pdf_mode": "both", "max_pixels_per_page": 60_000})
    parts = expanded[0]["content"]
    images = [p for p in parts if p["type"] == "image_url"]
    assert len(images) == 1 and "[PDF page 1 image]" in _texts(expanded)
    png = base64.b64decode(images[0]["image_url"]["url"].split(",", 1)[1])
    picture = Image.open(io.BytesIO(png))
    assert picture.width * picture.height <= 60_000


def test_rendered_page_fits_its_pixel_budget():
    stage = PdfStage()
    for budget in (10_000, 123_457, 1_000_000):
        [page] = stage.process(PdfItem(make_text_pdf([LINES]), render="all", max_pixels_per_page=budget)).pages
        assert page.width * page.height <= budget
        assert page.width * page.height > 0.9 * min(budget, (160 / 25.4 * 300) * (60 / 25.4 * 300))


def test_page_range_selects_pages():
    data = make_text_pdf([["one"], ["two"], ["three"], ["four"]])
    result = PdfStage().process(PdfItem(data, pages="2-3", render="none"))
    assert result.num_pages == 4 and [(p.number, p.text) for p in result.pages] == [(2, "two"), (3, "three")]
    with pytest.raises(MediaError, match="outside the PDF's pages 1-4"):
        PdfStage().process(PdfItem(data, pages="3-9"))


def test_scanned_page_has_no_text_layer_and_is_rendered_in_auto_mode():
    [page] = PdfStage().process(PdfItem(make_scanned_pdf(LINES))).pages
    assert not page.has_text_layer and page.image_png is not None


def test_encrypted_pdf_is_a_media_error():
    from fpdf import FPDF

    pdf = FPDF()
    pdf.add_page()
    pdf.set_font("Helvetica")
    pdf.cell(text="secret")
    pdf.set_encryption(owner_password="owner", user_password="user")
    with pytest.raises(MediaError, match="encrypted with a password; send an unencrypted copy"):
        PdfStage().process(PdfItem(bytes(pdf.output())))


def test_corrupt_pdf_is_a_media_error():
    data = make_text_pdf([LINES])
    with pytest.raises(MediaError, match="corrupt or truncated"):
        PdfStage().process(PdfItem(data[:200]))
    with pytest.raises(MediaError, match="not a PDF"):
        PdfStage().process(PdfItem(b"GIF89a not a pdf"))


def test_oversized_pdfs_are_media_limit_errors():
    data = make_text_pdf([["p"]] * 5)
    with pytest.raises(MediaLimitError, match="selection has 5 pages; the limit is 3"):
        PdfStage(max_pages=3).process(PdfItem(data))
    assert len(PdfStage(max_pages=3).process(PdfItem(data, pages="1-3")).pages) == 3
    with pytest.raises(MediaLimitError, match="exceeds the limit of 1000000 pixels"):
        PdfStage(max_render_pixels=1_000_000).process(PdfItem(data, max_pixels_per_page=2_000_000))
    with pytest.raises(MediaLimitError, match="the limit is 0.0 MiB"):
        PdfStage(max_bytes=1000).process(PdfItem(data))


def test_unknown_pdf_mode_is_an_invalid_request(real_stages):
    messages = [{"role": "user", "content": [_pdf_part(make_text_pdf([LINES]))]}]
    with pytest.raises(InvalidRequestError, match="pdf_mode='pages'; use one of"):
        expand_preprocessed_parts_sync(messages, real_stages, {"pdf_mode": "pages"})
    with pytest.raises(InvalidRequestError, match=r"unknown preprocessing option\(s\) \['colour'\]"):
        expand_preprocessed_parts_sync(messages, real_stages, {"colour": "red"})
