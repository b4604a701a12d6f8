"""Fuzzing the request schema through the real FastAPI app: every field of a chat
or text completion replaced by JSON of any type and value, messages built from
random parts, NUL and unpaired surrogates in strings, raw bodies of any bytes and
depth. Property: the answer is 200 or a 4xx with OpenAI's error JSON, never a 500.

The engine behind the app is the API process's view of one: the real config,
tokenizer and input processor (so prompts are checked and media decoded as the
engine does), answering one token without running a model."""
from __future__ import annotations

import base64
import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foveal.engine.output import CompletionOutput, RequestOutput
from foveal.entrypoints.openai.api_server import build_app
from foveal.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from foveal.entrypoints.openai.serving_engine import ServerConfig
from tests.fuzz.error_bodies import check_error_body
from tests.fuzz.media_samples import image_files

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ENGINE_OPTIONS = {"max_model_len": 1024, "limit_mm_per_prompt": {"image": 2, "video": 1},
                  "max_image_pixels": 1 << 16}
# Set by a router in disaggregated serving, checked by the engine, not the schema;
# file and input_audio parts start preprocessing worker pools.
NOT_FUZZED = {"kv_transfer_params", "ec_transfer_params"}
STAGE_PARTS = {"file", "input_audio"}


class ValidatingEngine:
    """Real config, tokenizer and input processor; generate() answers one token."""

    def __init__(self, model_dir: str) -> None:
        from foveal.engine_args import EngineArgs
        from foveal.input_processor import InputProcessor
        from foveal.tokenizer import Tokenizer

        self.engine_config = EngineArgs.from_kwargs(model_dir, **ENGINE_OPTIONS).create_engine_config()
        self.tokenizer = Tokenizer.from_pretrained(self.engine_config.model.path)
        self.input_processor = InputProcessor(self.engine_config, self.tokenizer)

    async def generate(self, prompt, sampling_params, request_id, *, stream=True, **transfer):
        processed = self.input_processor.process(request_id, prompt, sampling_params)
        completion = CompletionOutput(0, "ok", [7], None, None, finish_reason="length")
        yield RequestOutput(request_id, None, processed.request.prompt_token_ids, [completion], True)

    async def abort(self, request_id) -> None:
        pass


@pytest.fixture(scope="module")
def http(tiny_checkpoints):
    checkpoint = tiny_checkpoints("tiny-qwen2-vl")
    config = ServerConfig(served_model_names=("tiny",), model_path=checkpoint)
    with TestClient(build_app(ValidatingEngine(checkpoint), config)) as client:
        yield client


def check_answer(response, words: str | None = None) -> None:
    assert response.status_code in (200, 400), f"{response.status_code}: {response.text[:500]}"
    if response.status_code == 400:
        error = check_error_body(400, response.text, response.json())
        assert words is None or words in error["message"], error["message"]
    else:
        assert response.json()["choices"][0]["finish_reason"] == "length"


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
CHAT_BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION_BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def field_overrides(model) -> st.SearchStrategy[dict]:
    fields = sorted(set(model.model_fields) - NOT_FUZZED)
    return st.dictionaries(st.sampled_from(fields), json_value, min_size=1, max_size=3)


def post(http, path: str, body) -> object:
    # allow_nan: NaN and Infinity travel as Python's json writes them (and reads them).
    return http.post(path, content=json.dumps(body, allow_nan=True),
                     headers={"content-type": "application/json"})


@FUZZ
@given(field_overrides(ChatCompletionRequest))
def test_chat_fields_of_any_json_type_and_value_are_200_or_400(http, overrides):
    check_answer(post(http, "/v1/chat/completions", {**CHAT_BODY, **overrides}))


@FUZZ
@given(field_overrides(CompletionRequest))
def test_completion_fields_of_any_json_type_and_value_are_200_or_400(http, overrides):
    check_answer(post(http, "/v1/completions", {**COMPLETION_BODY, **overrides}))


sampling_values = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(-10, 1e308) | st.integers(-10, 2 ** 70),
    "top_p": st.floats(-1, 2) | st.just(float("nan")), "top_k": st.integers(-5, 2 ** 70),
    "min_p": st.floats(-1, 2), "n": st.integers(-2, 3), "max_tokens": st.integers(-2, 2 ** 70),
    "min_tokens": st.integers(-2, 2 ** 70), "seed": st.integers(-2 ** 70, 2 ** 70),
    "logprobs": st.booleans(), "top_logprobs": st.integers(-2, 30),
    "stop": st.lists(st.text(max_size=4), max_size=3) | st.text(max_size=4),
    "stop_token_ids": st.lists(st.integers(-2, 2 ** 70), max_size=3)})


@FUZZ
@given(sampling_values)
def test_out_of_range_sampling_values_are_200_or_400(http, values):
    body = {**CHAT_BODY, **values, "max_tokens": min(values.get("max_tokens", 2), 4)}
    check_answer(post(http, "/v1/chat/completions", body))


garbage_text = st.text(st.characters(codec=None, categories=None), max_size=16) | st.sampled_from(
    ["\u0000", "a\ud800b", "\udfff", "\U0010ffff", "<|image_pad|>", "\u202e", "\ufeff"])
image_url = st.one_of(
    st.sampled_from(sorted(image_files().values())).map(
        lambda data: "data:image/png;base64," + base64.b64encode(data).decode()),
    garbage_text.map(lambda text: "data:image/png;base64," + text), garbage_text, json_value)
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": garbage_text | json_value}),
    st.fixed_dictionaries({"type": st.just("image_url"),
                           "image_url": st.fixed_dictionaries({"url": image_url}, optional={
                               "detail": st.sampled_from(["low", "high", "auto", "x"])})}),
    st.fixed_dictionaries({"type": st.just("video_url"), "video_url": json_value}),
    st.dictionaries(st.just("type"), garbage_text.filter(lambda kind: kind not in STAGE_PARTS)),
    json_value)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | garbage_text},
    optional={"content": garbage_text | st.lists(part, max_size=3) | json_value,
              "name": json_value})


@FUZZ
@given(st.lists(message, min_size=0, max_size=3))
def test_random_messages_are_200_or_400(http, messages):
    check_answer(post(http, "/v1/chat/completions", {**CHAT_BODY, "messages": messages}))


@FUZZ
@given(garbage_text, st.sampled_from(["prompt", "model", "stop", "content"]))
def test_nul_and_unpaired_surrogates_in_strings_are_200_or_400(http, text, field):
    if field == "content":
        body = {**CHAT_BODY, "messages": [{"role": "user", "content": text}]}
        check_answer(post(http, "/v1/chat/completions", body))
    else:
        check_answer(post(http, "/v1/completions", {**COMPLETION_BODY, field: text}))


@FUZZ
@given(st.binary(max_size=200) | st.text(max_size=200).map(
    lambda text: text.encode("utf-8", "surrogatepass")))
def test_raw_bodies_of_any_bytes_are_400(http, body):
    response = http.post("/v1/chat/completions", content=body,
                         headers={"content-type": "application/json"})
    assert response.status_code == 400
    check_answer(response)


@FUZZ
@given(st.integers(2, 200_000), st.sampled_from(["[", '{"a":']), st.booleans())
def test_very_deep_json_is_400(http, depth, opener, closed):
    closer = "]" if opener == "[" else "}"
    body = opener * depth + ("1" + closer * depth if closed else "")
    response = http.post("/v1/chat/completions", content=body.encode(),
                         headers={"content-type": "application/json"})
    assert response.status_code == 400
    check_answer(response)


@FUZZ
@given(st.integers(1, 30_000), st.sampled_from(["messages", "stop", "stop_token_ids",
                                                 "mm_processor_kwargs"]))
def test_very_wide_json_is_200_or_400(http, width, field):
    values = {"messages": [{"role": "user", "content": "a"}] * width, "stop": ["x"] * width,
              "stop_token_ids": [1] * width,
              "mm_processor_kwargs": {f"key{index}": index for index in range(width)}}
    response = post(http, "/v1/chat/completions", {**CHAT_BODY, field: values[field]})
    check_answer(response)
    if response.status_code == 400:
        assert len(response.json()["error"]["message"]) < 2000  # a message, not a dump
