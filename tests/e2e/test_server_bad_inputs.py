"""Bad input through a live server: each case is a 4xx with OpenAI's error JSON and
a message a person can act on, never a 5xx, a traceback or an internal path;
afterwards the engine is idle and still answers. Cases the official `openai`
client can express go through it too; the rest (malformed JSON, wrong types,
wrong content types) go as raw HTTP."""
from __future__ import annotations

import base64
import inspect
import json

import httpx
import openai
import pytest
from test_openai_server import (MODEL_NAME, data_url, engine_stats, make_engine, png_bytes,
                                serving)

import foveal
from tests.fuzz.error_bodies import check_error_body
from tests.fuzz.media_samples import gif_declaring, mp4_clip, png_declaring

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER_HI = [{"role": "user", "content": "hi"}]


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": USER_HI, "max_tokens": 2, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **fields}


def image_part(url, **options) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, **options}},
                                         {"type": "text", "text": "what is it?"}]}]


def video_part(url) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}]


def b64(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


# (id, path, JSON body, words the message must hold); each body is a valid request
# but for one thing.
JSON_CASES = [
    # the request's shape
    ("messages_missing", CHAT, {"model": MODEL_NAME}, "messages: Field required"),
    ("messages_not_a_list", CHAT, chat(messages="hello"), "messages: Input should be a valid list"),
    ("messages_empty", CHAT, chat(messages=[]), "non-empty"),
    ("message_not_an_object", CHAT, chat(messages=["hi"]), "Input should be a valid dictionary"),
    ("message_without_role", CHAT, chat(messages=[{"content": "hi"}]), "role None"),
    ("message_role_unknown", CHAT, chat(messages=[{"role": "robot", "content": "hi"}]),
     "role 'robot'"),
    ("content_a_number", CHAT, chat(messages=[{"role": "user", "content": 5}]),
     "content is a string or a list"),
    ("content_part_a_string", CHAT, chat(messages=[{"role": "user", "content": ["hi"]}]),
     "content part type None"),
    ("content_part_type_unknown", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "hologram"}]}]), "'hologram'"),
    ("text_part_a_number", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
     "'text' is a string, got int"),
    ("model_unknown", CHAT, chat(model="gpt-4"), "not served here"),
    ("model_a_number", CHAT, chat(model=5), "model: Input should be a valid string"),
    ("model_with_nul", CHAT, chat(model="tiny\u0000"), "not served here"),
    # sampling values
    ("temperature_a_string", CHAT, chat(temperature="hot"), "temperature"),
    ("temperature_numeric_string", CHAT, chat(temperature="0.5"), "temperature"),
    ("temperature_negative", CHAT, chat(temperature=-1), "temperature must be >= 0"),
    ("top_p_zero", CHAT, chat(top_p=0), "top_p must be in (0, 1]"),
    ("top_p_above_one", CHAT, chat(top_p=1.5), "top_p must be in (0, 1]"),
    ("top_k_negative", CHAT, chat(top_k=-2), "top_k must be >= 0"),
    ("top_k_fractional", CHAT, chat(top_k=1.5), "top_k"),
    ("min_p_above_one", CHAT, chat(min_p=2), "min_p must be in [0, 1]"),
    ("n_two", CHAT, chat(n=2), "n=2 is not supported"),
    ("n_zero", CHAT, chat(n=0), "n=0 is not supported"),
    ("max_tokens_zero", CHAT, chat(max_tokens=0), "max_tokens must be >= 1"),
    ("max_tokens_negative", CHAT, chat(max_tokens=-5), "max_tokens must be >= 1"),
    ("max_tokens_a_string", CHAT, chat(max_tokens="10"), "max_tokens"),
    ("max_tokens_a_boolean", CHAT, chat(max_tokens=True), "max_tokens"),
    ("max_completion_tokens_zero", CHAT, chat(max_completion_tokens=0), "max_tokens must be >= 1"),
    ("min_tokens_negative", CHAT, chat(min_tokens=-1), "min_tokens must be >= 0"),
    ("seed_too_large", CHAT, chat(seed=10 ** 30), "seed must be a 64-bit integer"),
    ("seed_a_string", CHAT, chat(seed="abc"), "seed"),
    ("stop_a_number", CHAT, chat(stop=5), "stop"),
    ("stop_list_of_numbers", CHAT, chat(stop=[1, 2]), "stop: expected string | array of string"),
    ("stop_token_ids_negative", CHAT, chat(stop_token_ids=[-1]), "outside the model's vocabulary"),
    ("stop_token_ids_a_string", CHAT, chat(stop_token_ids="x"), "stop_token_ids"),
    ("logprobs_a_string", CHAT, chat(logprobs="yes"), "logprobs"),
    ("top_logprobs_too_many", CHAT, chat(logprobs=True, top_logprobs=50),
     "logprobs must be in [0, 20]"),
    ("top_logprobs_without_logprobs", CHAT, chat(top_logprobs=2), "top_logprobs needs logprobs"),
    ("stream_a_string", CHAT, chat(stream="yes"), "stream"),
    ("stream_options_without_stream", CHAT, chat(stream_options={"include_usage": True}),
     "stream_options is only allowed with stream=true"),
    ("stream_options_a_number", CHAT, chat(stream=True, stream_options=5), "stream_options"),
    ("presence_penalty", CHAT, chat(presence_penalty=0.5), "presence_penalty"),
    ("frequency_penalty_a_string", CHAT, chat(frequency_penalty="x"), "frequency_penalty"),
    ("tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]),
     "tools are not supported"),
    ("response_format_json", CHAT, chat(response_format={"type": "json_object"}),
     "response_format"),
    ("response_format_a_string", CHAT, chat(response_format="json"), "response_format"),
    ("chat_template_kwargs_sets_messages", CHAT, chat(chat_template_kwargs={"messages": []}),
     "chat_template_kwargs may not set ['messages']"),
    ("chat_template_kwargs_sets_template", CHAT,
     chat(chat_template_kwargs={"chat_template": "{{ 7 * 7 }}"}), "may not set ['chat_template']"),
    ("chat_template_kwargs_a_number", CHAT, chat(chat_template_kwargs=5), "chat_template_kwargs"),
    ("mm_processor_kwargs_a_string", CHAT, chat(mm_processor_kwargs="x"), "mm_processor_kwargs"),
    ("mm_processor_kwargs_unknown_key", CHAT, chat(mm_processor_kwargs={"bogus": 1}),
     "unknown mm_processor_kwargs"),
    ("max_visual_tokens_negative", CHAT, chat(mm_processor_kwargs={"max_visual_tokens": -1}),
     "must be a positive int"),
    ("mm_processor_kwargs_many_unknown_keys", CHAT,
     chat(mm_processor_kwargs={f"key{index}": index for index in range(100)}), "(and 95 more)"),
    ("kv_transfer_params_a_string", CHAT, chat(kv_transfer_params="x"), "kv_transfer_params"),
    ("kv_transfer_params_unknown_keys", CHAT, chat(kv_transfer_params={"bogus": 1}),
     "kv_transfer_params"),
    ("ignore_eos_a_string", CHAT, chat(ignore_eos="no"), "ignore_eos"),
    ("prompt_too_long", CHAT, chat(messages=[{"role": "user", "content": "word " * 3000}]),
     "--max-model-len"),
    ("image_pad_injected_as_text", CHAT,
     chat(messages=[{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>"}]),
     "<|image_pad|>"),
    ("bad_streaming_request", CHAT, chat(stream=True, temperature=-1), "temperature"),
    # media
    ("too_many_images", CHAT, chat(messages=image_part(data_url(png_bytes())) * 3),
     "the limit is 2 per request"),
    ("image_bad_base64", CHAT, chat(messages=image_part("data:image/png;base64,@@@")), "base64"),
    ("image_wrong_mime", CHAT, chat(messages=image_part(b64(png_bytes(), "text/plain"))),
     "is not an image"),
    ("image_not_base64_url", CHAT, chat(messages=image_part("data:image/png,rawbytes")),
     "only base64 data URLs"),
    ("image_garbage_bytes", CHAT, chat(messages=image_part(b64(b"not an image at all"))),
     "could not identify an image"),
    ("image_zero_bytes", CHAT, chat(messages=image_part("data:image/png;base64,")), "empty"),
    ("image_truncated", CHAT, chat(messages=image_part(b64(png_bytes((300, 300))[:100]))),
     "corrupt or truncated"),
    ("image_png_bomb", CHAT, chat(messages=image_part(b64(png_declaring(60000, 60000)))),
     "--max-image-pixels"),
    ("image_gif_bomb", CHAT, chat(messages=image_part(b64(gif_declaring(65535, 65535), "image/gif"))),
     "--max-image-pixels"),
    ("image_over_pixel_limit", CHAT, chat(messages=image_part(b64(png_declaring(2000, 2000)))),
     "--max-image-pixels"),
    ("image_url_a_number", CHAT, chat(messages=image_part(5)), "URL is a string"),
    ("image_url_missing", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "has no 'image_url' field"),
    ("image_detail_unknown", CHAT, chat(messages=image_part(data_url(png_bytes()), detail="ultra")),
     "detail 'ultra'"),
    ("image_url_unsupported_scheme", CHAT, chat(messages=image_part("ftp://example.com/a.png")),
     "no supported scheme"),
    ("image_file_url_disabled", CHAT, chat(messages=image_part("file:///etc/hostname")),
     "--allowed-local-media-path"),
    ("video_garbage_bytes", CHAT, chat(messages=video_part(b64(b"\x00" * 64, "video/mp4"))),
     "could not open the video"),
    ("video_truncated", CHAT, chat(messages=video_part(b64(mp4_clip()[:300], "video/mp4"))),
     "video"),
    ("video_with_image_mime", CHAT, chat(messages=video_part(b64(mp4_clip(), "image/png"))),
     "is not a video"),
    # text completions
    ("prompt_missing", COMPLETIONS, {"model": MODEL_NAME}, "prompt: Field required"),
    ("prompt_a_number", COMPLETIONS, completion(prompt=5), "prompt"),
    ("prompt_empty_token_list", COMPLETIONS, completion(prompt=[]), "prompt is empty"),
    ("prompt_nested_lists", COMPLETIONS, completion(prompt=[["a"]]), "prompt"),
    ("prompt_several", COMPLETIONS, completion(prompt=["a", "b"]), "got 2 prompts"),
    ("prompt_token_negative", COMPLETIONS, completion(prompt=[-1]), "outside the model's vocabulary"),
    ("prompt_token_huge", COMPLETIONS, completion(prompt=[10 ** 30]), "outside the model's vocabulary"),
    ("prompt_token_fractional", COMPLETIONS, completion(prompt=[1.5]), "prompt"),
    ("prompt_tokens_too_many", COMPLETIONS, completion(prompt=[5] * 2000), "--max-model-len"),
    ("echo", COMPLETIONS, completion(echo=True), "echo=true is not supported"),
    ("best_of", COMPLETIONS, completion(best_of=3), "best_of=3"),
    ("completion_logprobs_too_many", COMPLETIONS, completion(logprobs=21), "logprobs must be in"),
    ("completion_logprobs_a_boolean", COMPLETIONS, completion(logprobs=True), "logprobs"),
    ("completion_max_tokens_zero", COMPLETIONS, completion(max_tokens=0), "max_tokens must be >= 1"),
]

DEEP = "[" * 100_000 + "]" * 100_000
# (id, path, body bytes, content type, words the message must hold)
RAW_CASES = [
    ("json_malformed", CHAT, b'{"model": "tiny", "messages": [', "application/json",
     "not valid JSON"),
    ("json_trailing_garbage", CHAT, b"{} x", "application/json", "not valid JSON"),
    ("json_nul_byte", CHAT, b'{"model": "tiny",\x00}', "application/json", "not valid JSON"),
    ("json_nan_temperature", CHAT, json.dumps(chat(temperature=float("nan"))).encode(),
     "application/json", "temperature must be >= 0 and finite"),
    ("json_infinite_temperature", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"temperature": 1e999}', "application/json", "temperature must be >= 0 and finite"),
    ("json_invalid_utf8", CHAT, b'{"model": "\xff\xfe"}', "application/json", "UTF-8"),
    ("json_lone_surrogate", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "application/json", "lone surrogate"),
    ("json_deep_nesting", CHAT, DEEP.encode(), "application/json", "nests too deeply"),
    ("json_wide_messages", CHAT, json.dumps(chat(messages=list(range(50_000)))).encode(),
     "application/json", "and 49997 more"),
    ("body_empty", CHAT, b"", "application/json", "request body is empty"),
    ("body_an_array", CHAT, b"[1, 2]", "application/json", "must be a JSON object, got an array"),
    ("body_a_string", COMPLETIONS, b'"hi"', "application/json", "got a string"),
    ("body_null", COMPLETIONS, b"null", "application/json", "must be a JSON object, got null"),
    ("json_lone_surrogate_in_model", CHAT, b'{"model": "\\udc00", "messages": []}',
     "application/json", "is not served here"),
    ("json_lone_surrogate_in_prompt", COMPLETIONS, b'{"prompt": "\\udfff"}', "application/json",
     "lone surrogate"),
    ("content_type_text", CHAT, json.dumps(chat()).encode(), "text/plain",
     "Content-Type: application/json"),
    ("content_type_missing", CHAT, json.dumps(chat()).encode(), None,
     "Content-Type: application/json"),
    ("content_type_form", COMPLETIONS, b"prompt=hi", "application/x-www-form-urlencoded",
     "Content-Type: application/json"),
]


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    checkpoint = tiny_checkpoints("tiny-qwen2-vl")
    engine = make_engine(checkpoint)
    try:
        with serving(engine, checkpoint) as live:
            yield live
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int, words: str) -> dict:
    assert response.status_code == status, f"{response.status_code}: {response.text[:500]}"
    error = check_error_body(response.status_code, response.text, response.json())
    assert words in error["message"], error["message"]
    return error


@pytest.mark.parametrize("name,path,body,words", JSON_CASES, ids=[c[0] for c in JSON_CASES])
def test_bad_json_request_is_a_readable_400(http, name, path, body, words):
    assert_openai_error(http.post(path, json=body), 400, words)


@pytest.mark.parametrize("name,path,body,content_type,words", RAW_CASES,
                         ids=[c[0] for c in RAW_CASES])
def test_malformed_body_is_a_readable_400(http, name, path, body, content_type, words):
    headers = {"content-type": content_type} if content_type else {}
    assert_openai_error(http.post(path, content=body, headers=headers), 400, words)


def test_error_param_names_the_field(http):
    assert assert_openai_error(http.post(CHAT, json=chat(temperature="hot")), 400,
                               "temperature")["param"] == "temperature"
    assert assert_openai_error(http.post(CHAT, json=chat(model="gpt-4")), 400,
                               "not served")["param"] == "model"


def test_null_fields_are_left_out_not_refused(http):
    nulls = dict.fromkeys(("temperature", "top_p", "n", "seed", "stop", "logprobs", "top_logprobs",
                           "stream_options", "max_completion_tokens", "presence_penalty"))
    response = http.post(CHAT, json=chat(**nulls))
    assert response.status_code == 200, response.text[:500]
    assert response.json()["usage"]["completion_tokens"] == 2
    response = http.post(COMPLETIONS, json=completion(temperature=None, echo=None))
    assert response.status_code == 200, response.text[:500]


def test_wrong_route_and_method_are_openai_errors(http):
    assert_openai_error(http.post("/v1/nowhere", json={}), 404, "not found")
    assert_openai_error(http.get(CHAT), 405, "use POST")


def _client_call(client: openai.OpenAI, path: str, body: dict):
    """The client's typed keywords where it has them, the rest as extra_body."""
    create = client.chat.completions.create if path == CHAT else client.completions.create
    known = set(inspect.signature(create).parameters)
    kwargs = {key: value for key, value in body.items() if key in known}
    extra = {key: value for key, value in body.items() if key not in known}
    return create(**kwargs, extra_body=extra or None)


CLIENT_CASES = [case for case in JSON_CASES
                if ("messages" in case[2] if case[1] == CHAT else "prompt" in case[2])]


@pytest.mark.parametrize("name,path,body,words", CLIENT_CASES, ids=[c[0] for c in CLIENT_CASES])
def test_bad_request_through_the_openai_client_is_bad_request_error(server, name, path, body,
                                                                    words):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    with pytest.raises(openai.BadRequestError) as raised:
        _client_call(client, path, body)
    error = check_error_body(400, raised.value.response.text, raised.value.response.json())
    assert words in error["message"], error["message"]


def test_internal_fault_is_a_generic_500(http, monkeypatch):
    from foveal.entrypoints.openai.serving_chat import OpenAIServingChat

    def broken(self, conversation):
        raise RuntimeError(f"boom in {foveal.__file__}")

    monkeypatch.setattr(OpenAIServingChat, "_check_counts", broken)
    error = assert_openai_error(http.post(CHAT, json=chat()), 500, "internal server error")
    assert "boom" not in error["message"]


def test_after_every_bad_case_the_engine_is_idle_and_still_answers(server, http):
    """Runs after the cases above (pytest keeps file order)."""
    stats = engine_stats(server.base_url)
    assert stats["foveal:kv_cache_usage_perc"] == 0
    assert stats["foveal:num_requests_running"] == 0
    assert stats["foveal:num_requests_waiting"] == 0
    response = http.post(CHAT, json=chat(messages=image_part(data_url(png_bytes())),
                                         temperature=0.0))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
