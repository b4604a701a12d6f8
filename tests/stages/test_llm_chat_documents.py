"""PDFs and scanned pages reach the prompt through LLM.chat, marked with their source."""
from __future__ import annotations

import base64

import pytest

from foveal import LLM, SamplingParams
from foveal.errors import InvalidRequestError
from tests.stages.stage_documents import make_scanned_pdf, make_text_pdf

PARAMS = SamplingParams(max_tokens=2, temperature=0.0)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    llm = LLM(model=tiny_checkpoints("tiny-qwen2-vl"), max_model_len=2048,
              kv_cache_memory_bytes=16 << 20, stages="pdf=1,ocr=1")
    yield llm
    llm.shutdown()


def _file_part(pdf: bytes, name: str) -> dict:
    data = base64.b64encode(pdf).decode()
    return {"type": "file", "file": {"file_data": f"data:application/pdf;base64,{data}",
                                     "filename": name}}


def test_text_layer_pdf_text_reaches_the_prompt(llm):
    pdf = make_text_pdf([["The secret word is banana."]])
    messages = [{"role": "user", "content": [_file_part(pdf, "note.pdf"),
                                             {"type": "text", "text": "What is the word?"}]}]
    out = llm.chat(messages, PARAMS, use_tqdm=False)[0]
    assert "banana" in out.prompt
    assert '[PDF "note.pdf" page 1 text]' in out.prompt
    assert llm.get_metrics()["foveal:visual_tokens_total"] == 0


def test_scanned_page_gives_its_image_and_ocr_text(llm):
    pdf = make_scanned_pdf(["INVOICE NUMBER 4711"])
    messages = [{"role": "user", "content": [_file_part(pdf, "scan.pdf"),
                                             {"type": "text", "text": "Read it."}]}]
    visual_before = llm.get_metrics()["foveal:visual_tokens_total"]
    out = llm.chat(messages, PARAMS, use_tqdm=False,
                   mm_processor_kwargs={"max_pixels_per_page": 200_000})[0]
    assert "[OCR of \"scan.pdf\" page 1]\nINVOICE NUMBER 4711" in out.prompt
    assert llm.get_metrics()["foveal:visual_tokens_total"] > visual_before  # page image sent
    assert any(name.startswith("foveal:stage_") for name in llm.get_metrics())


def test_unknown_preprocessing_value_is_a_request_error(llm):
    pdf = make_text_pdf([["x"]])
    messages = [{"role": "user", "content": [_file_part(pdf, "x.pdf")]}]
    with pytest.raises(InvalidRequestError, match="pdf_mode"):
        llm.chat(messages, PARAMS, use_tqdm=False, mm_processor_kwargs={"pdf_mode": "pixels"})
