"""PDF documents with pypdfium2: open with limits, pick pages, read the text
layer, render a page within a pixel budget.

A page is rendered at the largest scale whose pixel count fits
`max_pixels` (the downsampling planner sets it), never above `max_scale`
(~300 dpi), so a tiny page is not blown up into a huge image.
Page numbers in user-facing specs and messages are 1-based.
"""
from __future__ import annotations

import contextlib
import io
import math

from PIL import Image

from foveal.errors import MediaError, MediaLimitError

POINTS_PER_INCH = 72.0
_PASSWORD_ERROR = 4  # FPDF_ERR_PASSWORD


def open_pdf(data: bytes):
    """A `pypdfium2.PdfDocument` over `data`, or MediaError for encrypted or corrupt files."""
    import pypdfium2 as pdfium

    if not data.lstrip()[:5].startswith(b"%PDF"):
        raise MediaError(f"{len(data)} bytes are not a PDF (no %PDF header); send a PDF file")
    try:
        return pdfium.PdfDocument(data)
    except pdfium.PdfiumError as exc:
        if getattr(exc, "err_code", None) == _PASSWORD_ERROR:
            raise MediaError("the PDF is encrypted with a password; send an unencrypted copy") from exc
        raise MediaError(f"could not open the PDF ({exc}); the file is corrupt or truncated") from exc


def select_pages(spec: str | None, num_pages: int, max_pages: int) -> list[int]:
    """0-based page indices for a 1-based spec like "1-3,7" (None: every page), capped at max_pages."""
    indices = list(range(num_pages)) if not spec else _parse_page_spec(spec, num_pages)
    if len(indices) > max_pages:
        raise MediaLimitError(
            f"the PDF selection has {len(indices)} pages; the limit is {max_pages} "
            f"(--max-pdf-pages, or the pdf stage option max_pages); pass a page range such as pages='1-{max_pages}'")
    return indices


def _parse_page_spec(spec: str, num_pages: int) -> list[int]:
    indices: list[int] = []
    for token in spec.replace(" ", "").split(","):
        first, sep, last = token.partition("-")
        try:
            start, end = int(first), int(last if sep else first)
        except ValueError as exc:
            raise MediaError(f"page range {spec!r} is not like '1-3,7'") from exc
        if not 1 <= start <= end <= num_pages:
            raise MediaError(f"page range {token!r} is outside the PDF's pages 1-{num_pages}")
        indices.extend(i for i in range(start - 1, end) if i not in indices)
    return indices


def load_page(document, index: int):
    """Page `index` (0-based) of an open document; MediaError when PDFium cannot parse it."""
    with _corrupt_page_is_media_error(f"page {index + 1}"):
        return document[index]


@contextlib.contextmanager
def _corrupt_page_is_media_error(page: str):
    import pypdfium2 as pdfium

    try:
        yield
    except pdfium.PdfiumError as exc:
        raise MediaError(f"could not read {page} of the PDF ({exc}); the file is corrupt") from exc


def page_text(page) -> str:
    """The page's text layer with PDFium's line breaks normalized to '\\n'."""
    with _corrupt_page_is_media_error("a page"):
        textpage = page.get_textpage()
        try:
            text = textpage.get_text_bounded()
        finally:
            textpage.close()
    return text.replace("\r\n", "\n").replace("\r", "\n").strip()


def render_scale(width_pt: float, height_pt: float, max_pixels: int, max_scale: float) -> float:
    """Largest scale (pixels per point) with round(w*s) * round(h*s) <= max_pixels, at most max_scale."""
    if width_pt <= 0 or height_pt <= 0:
        raise MediaError(f"PDF page is {width_pt:.0f}x{height_pt:.0f} pt: it has no area")
    scale = min(max_scale, math.sqrt(max_pixels / (width_pt * height_pt)))
    while scale > 0 and math.ceil(width_pt * scale) * math.ceil(height_pt * scale) > max_pixels:
        scale *= 0.995
    if math.ceil(width_pt * scale) < 1 or math.ceil(height_pt * scale) < 1:
        raise MediaLimitError(f"a budget of {max_pixels} pixels cannot render a page of "
                              f"{width_pt:.0f}x{height_pt:.0f} pt; raise max_pixels_per_page")
    return scale


def render_page(page, max_pixels: int, max_scale: float) -> Image.Image:
    """Render one page to an RGB image of at most `max_pixels` pixels."""
    width_pt, height_pt = page.get_size()
    scale = render_scale(width_pt, height_pt, max_pixels, max_scale)
    with _corrupt_page_is_media_error("a page"):
        bitmap = page.render(scale=scale)
    try:
        return bitmap.to_pil().convert("RGB")
    finally:
        bitmap.close()


def encode_png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
