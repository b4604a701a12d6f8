"""Test inputs built in the test: PDFs with fpdf2 (core fonts only, no system
fonts), and the edit distance behind CER and WER."""
from __future__ import annotations

import io


def make_text_pdf(pages: list[list[str]], size_mm: tuple[float, float] = (160, 60)) -> bytes:
    """A PDF with a text layer: each page holds its lines in Helvetica 14."""
    from fpdf import FPDF

    pdf = FPDF(format=size_mm)
    pdf.set_margins(6, 6)
    pdf.set_auto_page_break(False)
    for lines in pages:
        pdf.add_page()
        pdf.set_font("Helvetica", size=14)
        for line in lines:
            pdf.cell(0, 9, line, new_x="LMARGIN", new_y="NEXT")
    return bytes(pdf.output())


def make_scanned_pdf(lines: list[str], dpi: int = 150) -> bytes:
    """An image-only PDF: the text page rendered to a picture, the picture embedded."""
    import pypdfium2 as pdfium
    from fpdf import FPDF

    size_mm = (160, 60)
    document = pdfium.PdfDocument(make_text_pdf([lines], size_mm))
    picture = document[0].render(scale=dpi / 72).to_pil().convert("L")
    document.close()
    png = io.BytesIO()
    picture.save(png, format="PNG")
    pdf = FPDF(format=size_mm)
    pdf.add_page()
    pdf.image(io.BytesIO(png.getvalue()), x=0, y=0, w=size_mm[0], h=size_mm[1])
    return bytes(pdf.output())


def edit_distance(reference: list, hypothesis: list) -> int:
    row = list(range(len(hypothesis) + 1))
    for i, ref in enumerate(reference, 1):
        diagonal, row[0] = row[0], i
        for j, hyp in enumerate(hypothesis, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (ref != hyp))
    return row[-1]
