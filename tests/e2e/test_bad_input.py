"""Bad input gets a typed error that names what to change, costs the engine
nothing, and leaves every KV block back in the pool."""
from __future__ import annotations

import io

import pytest
from PIL import Image

from foveal import LLM, SamplingParams
from foveal.errors import (ContextLengthError, InvalidRequestError, MediaError, MediaLimitError,
                           PlaceholderMismatchError)

PAD = "<|vision_start|><|image_pad|><|vision_end|>"
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(model=tiny_checkpoints("tiny-qwen2-vl"), max_model_len=512,
               kv_cache_memory_bytes=8 << 20, limit_mm_per_prompt={"image": 2},
               max_image_pixels=300 * 300)


def _png_bytes(width=64, height=48, mode="RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height), 128).save(buffer, format="PNG")
    return buffer.getvalue()


def _image_prompt(image, count=1) -> dict:
    return {"prompt": PAD * count + "Describe.", "multi_modal_data": {"image": [image] * count}}


def _assert_pool_empty(llm: LLM) -> None:
    metrics = llm.get_metrics()
    assert metrics["foveal:kv_cache_usage_perc"] == 0
    assert metrics["foveal:num_requests_running"] == 0
    assert metrics["foveal:num_requests_waiting"] == 0


BAD_PROMPTS = [
    ("corrupt_bytes", lambda: _image_prompt(b"\x89PNG\r\n\x1a\n not a png"), MediaError, "image"),
    ("truncated_png", lambda: _image_prompt(_png_bytes(200, 200)[:120]), MediaError, "image"),
    ("bad_base64", lambda: _image_prompt("data:image/png;base64,@@@not-base64@@@"), MediaError,
     "base64"),
    ("over_pixel_limit", lambda: _image_prompt(_png_bytes(400, 400)), MediaLimitError,
     "--max-image-pixels"),
    ("too_many_images", lambda: _image_prompt(_png_bytes(), count=3), MediaLimitError,
     "limit"),
    ("prompt_too_long", lambda: "word " * 600, ContextLengthError, "--max-model-len"),
    ("more_images_than_placeholders",
     lambda: {"prompt": PAD + "x", "multi_modal_data": {"image": [_png_bytes()] * 2}},
     PlaceholderMismatchError, "<|image_pad|>"),
    ("placeholders_without_images", lambda: {"prompt": PAD + "x"}, PlaceholderMismatchError,
     "<|image_pad|>"),
    ("unsupported_mode", lambda: _image_prompt(Image.new("LAB", (32, 32))), MediaError, "LAB"),
    ("token_id_outside_vocabulary", lambda: {"prompt_token_ids": [5, 10 ** 8]},
     InvalidRequestError, "outside the vocabulary"),
    ("empty_prompt", lambda: {"prompt_token_ids": []}, InvalidRequestError, "empty"),
]


@pytest.mark.parametrize("name,make_prompt,error,hint", BAD_PROMPTS,
                         ids=[case[0] for case in BAD_PROMPTS])
def test_bad_input_raises_typed_error_naming_the_prompt_and_engine_keeps_serving(
        llm, name, make_prompt, error, hint):
    good = _image_prompt(_png_bytes())
    with pytest.raises(error) as raised:
        llm.generate([good, make_prompt()], PARAMS, use_tqdm=False)
    assert str(raised.value).startswith("prompt 1: ")
    assert hint in str(raised.value)
    _assert_pool_empty(llm)  # nothing of the good prompt was queued either
    outputs = llm.generate([good, "Hello"], PARAMS, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
    _assert_pool_empty(llm)


def test_request_that_fails_in_the_encoder_fails_alone_and_frees_its_blocks(llm):
    engine = llm.llm_engine
    requests = []
    for index in range(3):
        processed = engine.input_processor.process(
            f"midflight-{index}", _image_prompt(_png_bytes(56 + 28 * index, 56)), PARAMS)
        requests.append((processed.request, processed.text))
    broken = requests[1][0].mm_features[0]
    broken.data["pixel_values"] = broken.data["pixel_values"][:3]  # rows no longer match grid
    for request, text in requests:
        engine.core.add_request(request)
        engine.output_processor.add_request(request.request_id, text, request.prompt_token_ids,
                                            request.sampling_params, request.arrival_time)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished["midflight-1"].outputs[0].finish_reason == "error"
    assert finished["midflight-1"].error
    for ok in ("midflight-0", "midflight-2"):
        assert finished[ok].outputs[0].finish_reason == "length"
        assert len(finished[ok].outputs[0].token_ids) == 4
    _assert_pool_empty(llm)


def test_bad_sampling_params_are_rejected_before_anything_runs():
    from foveal.errors import SamplingParamsError

    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(SamplingParamsError, match="n=2"):
        SamplingParams(n=2)


def test_unknown_prompt_key_and_engine_option_are_errors(llm, tiny_checkpoints):
    from foveal.errors import ConfigError

    with pytest.raises(InvalidRequestError, match="prompt 0: unknown prompt key"):
        llm.generate({"prompt": "hi", "images": []}, PARAMS, use_tqdm=False)
    with pytest.raises(ConfigError, match="unknown engine option"):
        LLM(model=tiny_checkpoints("tiny-qwen2-vl"), max_batch=4)
