"""PDF stage: per page, the text layer and (when asked) a rendered image.

`render` picks the pages to rasterize: "none", "all", or "auto" (only pages
with no text layer, i.e. scans, which then go to OCR and to the model as
images). Images travel as PNG bytes within `max_pixels_per_page`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from foveal.errors import InvalidRequestError, MediaLimitError
from foveal.multimodal.media import pdf as pdf_media
from foveal.stages.base import Stage

RENDER_MODES = ("none", "auto", "all")
DEFAULT_PIXELS_PER_PAGE = 1280 * 28 * 28  # ~1 MP: Qwen2-VL's common max_pixels


@dataclass(frozen=True)
class PdfOptions:
    max_pages: int = 200
    max_bytes: int = 100 * 2**20
    max_pixels_per_page: int = DEFAULT_PIXELS_PER_PAGE  # when the item does not say
    max_render_pixels: int = 50_000_000  # the most an item may ask for
    max_scale: float = 300 / pdf_media.POINTS_PER_INCH  # 300 dpi


@dataclass(frozen=True)
class PdfItem:
    content: bytes
    pages: str | None = None  # 1-based, e.g. "1-3,7"; None: all
    render: str = "auto"
    max_pixels_per_page: int | None = None

    def __post_init__(self) -> None:
        if self.render not in RENDER_MODES:
            raise InvalidRequestError(f"PDF render={self.render!r}; use one of {RENDER_MODES}")
        if self.max_pixels_per_page is not None and self.max_pixels_per_page < 1:
            raise InvalidRequestError(f"max_pixels_per_page={self.max_pixels_per_page}; must be >= 1")


@dataclass(frozen=True)
class PdfPage:
    number: int  # 1-based
    text: str  # the text layer; "" on a scanned page
    image_png: bytes | None = None
    width: int = 0  # of the image, pixels
    height: int = 0

    @property
    def has_text_layer(self) -> bool:
        return bool(self.text.strip())


@dataclass(frozen=True)
class PdfResult:
    num_pages: int
    pages: list[PdfPage] = field(default_factory=list)


class PdfStage(Stage):
    name = "pdf"
    item_type = PdfItem
    result_type = PdfResult
    options_type = PdfOptions

    def process(self, item: PdfItem) -> PdfResult:
        options = self.options
        if len(item.content) > options.max_bytes:
            raise MediaLimitError(f"PDF is {len(item.content) / 2**20:.1f} MiB; the limit is "
                                  f"{options.max_bytes / 2**20:.1f} MiB (--max-pdf-bytes, or the pdf stage option max_bytes)")
        max_pixels = item.max_pixels_per_page or options.max_pixels_per_page
        if max_pixels > options.max_render_pixels:
            raise MediaLimitError(f"max_pixels_per_page={max_pixels} exceeds the limit of "
                                  f"{options.max_render_pixels} pixels per rendered PDF page "
                                  "(the pdf stage option max_render_pixels)")
        document = pdf_media.open_pdf(item.content)
        try:
            indices = pdf_media.select_pages(item.pages, len(document), options.max_pages)
            pages = [self._page(pdf_media.load_page(document, index), index, item.render, max_pixels)
                     for index in indices]
            return PdfResult(num_pages=len(document), pages=pages)
        finally:
            document.close()

    def _page(self, page, index: int, render: str, max_pixels: int) -> PdfPage:
        try:
            text = pdf_media.page_text(page)
            if render == "none" or (render == "auto" and text):
                return PdfPage(number=index + 1, text=text)
            image = pdf_media.render_page(page, max_pixels, self.options.max_scale)
        finally:
            page.close()
        return PdfPage(number=index + 1, text=text, image_png=pdf_media.encode_png(image),
                       width=image.width, height=image.height)
